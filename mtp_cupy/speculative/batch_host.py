"""propose's and the batch calls' host bookkeeping compiled: host_src/batch_host.c, built once per machine with
the system C compiler (under ~/.cache/mtp_cupy/host) and called through ctypes.

A propose_batch / after_verify_batch of a remembered batch (speculative.batch_inputs.BatchMemo: its states
checked live and distinct) spends most of its host time in NumPy's per-call cost, a microsecond or so for each of
some forty array passes over B entries. The C functions do the same passes in one call each: the token and
position checks, the KV-block reservation, step 0's ids and every step's slab staged, the counters updated; and
the catch-up's rows (prefill_batch of one row per sequence). `propose` (B = 1) takes the same staging and
counter calls. They change nothing and return a negative code when an input is bad or a case is rare (a table to
widen, a full pool); the proposer then runs its NumPy path, which names the problem or handles the case. That
NumPy path is the twin the tests hold the C path to: the same cache mirror, pool, drafts and staged bytes after
every call.

The option `host_path` ("auto", "c", "numpy") picks it; auto uses C when a compiler builds it."""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from ..cache.paged import NBLOCKS, ROWS
from ..errors import ConfigError
from ..runtime.slab import TABLE_OFFSET
from .proposer import DRAFTED, LAST, OFF, RUN0

log = logging.getLogger("mtp_cupy")
SOURCE = Path(__file__).resolve().parents[2] / "host_src" / "batch_host.c"
CFLAGS = ("-O2", "-std=c11", "-shared", "-fPIC")

_P, _I = ctypes.c_void_p, ctypes.c_int64


class BatchPlan(ctypes.Structure):
    """batch_host.c's BatchPlan (the same fields in the same order)."""
    _fields_ = [(n, _P) for n in ("cols", "tables", "stack", "used", "drafts", "idx", "tokens", "positions",
                                  "rows0", "counts", "listed", "stage", "pad_slab", "pre_stage")] + \
               [(n, _I) for n in ("ncols", "width", "max_drafts", "nfree", "num_blocks", "c_rows", "c_nblocks",
                                  "c_off", "c_run0", "c_drafted", "c_last", "block_size", "max_seq_len", "vocab",
                                  "drafter_context", "refeed", "meta_off", "stride", "table_off", "pre_rows")]


_LIB: dict = {}   # the loaded library (or the reason it could not be built), once per process


def library():
    """The compiled batch_host library (ctypes.CDLL), built on first use; ConfigError saying why it cannot be."""
    if "lib" not in _LIB:
        try:
            _LIB["lib"] = _open(_build())
        except ConfigError as e:
            _LIB["lib"] = e
    if isinstance(_LIB["lib"], ConfigError):
        raise _LIB["lib"]
    return _LIB["lib"]


def _build() -> Path:
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise ConfigError("host_path='c' needs a C compiler (cc, gcc or clang on PATH); none was found")
    try:
        src = SOURCE.read_bytes()
    except OSError as e:
        raise ConfigError(f"host_path='c': cannot read {SOURCE} ({e.strerror})") from None
    tag = hashlib.sha256(src + " ".join(CFLAGS).encode()).hexdigest()[:16]
    root = Path(os.path.expanduser("~/.cache/mtp_cupy/host"))
    out = root / f"batch_host-{tag}.so"
    if out.exists():
        return out
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=root)   # then renamed: ranks building at once never clash
        os.close(fd)
        r = subprocess.run([cc, *CFLAGS, "-o", tmp, str(SOURCE)], capture_output=True, text=True)
        if r.returncode:
            os.unlink(tmp)
            first = (r.stderr.strip().splitlines() or ["no message"])[0]
            raise ConfigError(f"host_path='c': {cc} failed on {SOURCE.name}: {first}")
        os.replace(tmp, out)
    except OSError as e:
        raise ConfigError(f"host_path='c': cannot build under {root} ({e.strerror})") from None
    return out


def _open(path: Path):
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise ConfigError(f"host_path='c': cannot load {path} ({e})") from None
    for name, args in (("mtp_batch_stage", [_P, _I, _I, _I, _I]), ("mtp_batch_finish", [_P, _I, _I, _I, _P]),
                       ("mtp_batch_trim", [_P, _I]), ("mtp_batch_catch_up", [_P, _I, _I])):
        f = getattr(lib, name)
        f.argtypes, f.restype = args, _I
    return lib


def host_library(choice: str):
    """The compiled library for option host_path=`choice`, or None (the NumPy path): ConfigError for "c" when it
    cannot be built, a log line for "auto"."""
    if choice == "numpy":
        return None
    try:
        return library()
    except ConfigError as e:
        if choice == "c":
            raise
        log.info("batch calls' bookkeeping in NumPy: %s", e)
        return None


def _addr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


class BatchHost:
    """One proposer's BatchPlan and its calls (stage, finish, trim, catch_up). The plan points at arrays that the
    cache reallocates when it grows (its mirror) and at the batch's mirror rows: `_aim` re-points it when one of
    them is a new object."""

    def __init__(self, lib, prop):
        self._stage_fn, self._finish_fn, self._trim_fn = lib.mtp_batch_stage, lib.mtp_batch_finish, lib.mtp_batch_trim
        self._catch_up_fn = lib.mtp_batch_catch_up
        kv = prop.kv
        self.plan = p = BatchPlan()
        self._at = ctypes.addressof(p)
        self.bufs = np.zeros((5, prop.max_batch), np.int64)
        self.tokens, self.positions, self.rows0, self.counts, self.listed = self.bufs
        self._toks = np.zeros(prop.max_batch * prop.max_drafts, np.int32)   # finish's drafts, [B, k] views
        self._toks_at, self._toks_views = _addr(self._toks), {}
        for name, a in zip(("tokens", "positions", "rows0", "counts", "listed"), self.bufs):
            setattr(p, name, _addr(a))
        p.stack, p.used, p.pad_slab = _addr(kv._stack), _addr(kv._used_np), _addr(prop._pad_slab)
        p.num_blocks, p.block_size, p.max_seq_len = kv.num_blocks, kv.block_size, prop.max_seq_len
        p.max_drafts, p.vocab = prop.max_drafts, prop.vocab_size
        p.c_rows, p.c_nblocks, p.c_off, p.c_run0, p.c_drafted, p.c_last = ROWS, NBLOCKS, OFF, RUN0, DRAFTED, LAST
        p.drafter_context, p.refeed = int(prop.drafter_context), int(prop.refeed_accepted)
        p.meta_off, p.stride, p.table_off = prop._meta_off, prop.meta_stride, TABLE_OFFSET
        p.pre_rows = prop.max_prefill_rows
        self._prop, self._kv = prop, kv
        self._aimed = (None,) * 3

    def _aim(self, idx: np.ndarray) -> None:
        """Point the plan at the cache mirror, drafts, stages and `idx` when the mirror or `idx` is a new object (one
        identity test each, the common case)."""
        kv, a = self._kv, self._aimed
        if kv._cols is a[0] and kv._tables is a[1] and idx is a[2]:
            return   # (the drafts grow only with the mirror's rows, a new `_cols`; the stages are made once)
        prop = self._prop
        p, now = self.plan, (kv._cols, kv._tables, idx, prop._drafts_rows(), prop._staging(),
                             prop._prefill_staging()[0])
        p.cols, p.tables, p.idx, p.drafts, p.stage, p.pre_stage = map(_addr, now)
        p.ncols, p.width = kv._cols.shape[1], kv._tables.shape[1]
        self._aimed = now[:3]

    def stage(self, idx: np.ndarray, toks: np.ndarray, positions, k: int, W: int):
        """propose_batch's checks, block reservation and slab staging for the B sequences at mirror rows `idx`
        (int64 tokens [B]; positions [B] or None: the next ones), pad rows to W. Returns (rows0, positions) as
        int64 [B] views that the next call reuses, or None (nothing changed: the NumPy path decides)."""
        B = len(idx)
        if not self._load(idx, toks, positions) or self._call(self._stage_fn, B, k, W, positions is not None) < 0:
            return None
        return self.rows0[:B], self.positions[:B]

    def catch_up(self, idx: np.ndarray, toks: np.ndarray, positions, rows: np.ndarray):
        """prefill_batch's one row per sequence at mirror rows `idx` (int64 tokens [B]; positions [B] or None: the
        next ones; `rows`, the call's row counts, must all be one): checked, blocks reserved, staged into the
        prefill stage, row counts one up. Returns (batch indices that start a new run, rows0, positions) as int64
        views the next call reuses, or None (nothing changed: the NumPy path decides)."""
        B = len(idx)
        n = self._call(self._catch_up_fn, B, positions is not None) if self._load(idx, toks, positions, rows) else -1
        if n < 0:
            return None
        return self.listed[:n], self.rows0[:B], self.positions[:B]

    def trim(self, idx: np.ndarray, accepted: np.ndarray):
        """after_verify_batch for the sequences at `idx`. Returns (batch indices whose last run went, every row
        count), views the next call reuses, or None (nothing changed: the NumPy path decides)."""
        B = len(idx)
        n = self._call(self._trim_fn, B) if self._load(idx, counts=accepted) else -1
        if n < 0:
            return None
        return self.listed[:n], self.rows0[:B]

    def _load(self, idx: np.ndarray, toks=None, positions=None, counts=None) -> bool:
        """The plan aimed at `idx` and the call's inputs in its buffers; False for a batch wider than max_batch
        (one an after_verify_batch remembered: the NumPy path refuses it)."""
        B = len(idx)
        if B > len(self.tokens):
            return False
        self._aim(idx)
        if toks is not None:
            self.tokens[:B] = toks
        if positions is not None:
            self.positions[:B] = positions
        if counts is not None:
            self.counts[:B] = counts
        return True

    def _call(self, fn, *args) -> int:
        """fn(plan, *args) with the pool's free count handed over and back (kept when it declined: negative)."""
        kv, p = self._kv, self.plan
        p.nfree = kv._nfree
        n = fn(self._at, *args)
        if n >= 0:
            kv._nfree = p.nfree
        return n

    def finish(self, B: int, k: int, kept, ids):
        """The counters and drafts after the chain (`kept`: int [B] drafts kept, or None: all k; `ids`: the drafts
        int32 [k, B], None for device results). Returns (the batch indices that start a new run, the drafts as a
        new int32 [B, k] array or None)."""
        if kept is not None:
            self.counts[:B] = kept
        toks = None
        if ids is not None:   # through a buffer the plan knows (no pointer read per call)
            toks = self._toks_views.get((B, k))
            if toks is None:
                toks = self._toks_views[B, k] = self._toks[:B * k].reshape(B, k)
            np.copyto(toks, ids.T)
        n = self._finish_fn(self._at, B, k, kept is None, None if ids is None else self._toks_at)
        return self.listed[:n], None if toks is None else toks.copy()
