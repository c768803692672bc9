"""MtpProposerBase: the mechanics every family shares, so a family writes only its math.

A family subclass sets `family`, `Options` (its options dataclass, models/options.py) and `load_weights`
(gpu, path, cfg, options, comm) -> weights, and implements
    _step(st, ids, hidden, position, row, logits)   one draft step: embed the i32 token id at device ptr
        `ids`, combine with the bf16 hidden at `hidden`, run the block (its KV row and RoPE position come
        from the metadata slab at bufs.mtp_meta), write f32 logits [vocab_eff] at `logits`, and leave the
        carried hidden for the next step at `self.carry`.
    _write_rows(st, tokens_dev, hiddens, positions, slots, row_base, n)  prefill / catch-up: n drafter KV
        rows pairing embed(tokens[r+1]) with hiddens[r] at the u32 positions / i64 slots given (no attention).
and sets `self.carry` after super().__init__; it may override `_hidden_shapes` (V4 accepts [D] and [hc, D]),
`_pick` (GLM's cross-rank argmax) and `_graph_variant`.

CUDA graphs: propose(k) is captured once per (k, masked, variant) and replayed. A family that sets
`graph_safe = True` promises that `_step` and `_pick` launch only device work on fixed buffers and read
every per-call value (token ids, hidden, positions, slots, block tables) from device memory, never from
their Python arguments, which are those of the capturing call.

State changes happen only after every check passes; a failure inside the chain rolls the rows back."""
from __future__ import annotations

import logging

import numpy as np

from pathlib import Path

from .. import ops
from ..cache import PagedKvCache, SeqBlocks
from ..errors import CapacityError, ConfigError, InputError
from .options import ProposerOptions
from ..runtime.arena import ForwardBuffers, stage_mtp_meta
from ..runtime import slab as slab_spec
from ..runtime.dtypes import BF16
from ..runtime.ptr import DevicePtr
from ..weights.config import ModelConfig, load_config
from .inputs import check_bitmask, check_position, check_token, hidden_to_device
from .proposer import DraftResult, ProposerState, mtp_rows_to_trim

log = logging.getLogger("mtp_cupy")


class MtpProposerBase:
    family = "base"
    Options: type[ProposerOptions] = ProposerOptions
    config_class: type[ModelConfig] = ModelConfig
    shardable = False    # may run over a communicator of several ranks
    refeed_accepted = False
    graph_safe = False   # a family whose _step/_pick launch only device work on fixed buffers sets True

    @classmethod
    def options_of(cls, options: ProposerOptions | None, kw: dict) -> ProposerOptions:
        """The family's options from an Options object and/or keyword options (ConfigError when unknown)."""
        return cls.Options.parse(cls.family, kw, base=options)

    @staticmethod
    def load_weights(gpu, path, cfg, options, comm=None):
        raise NotImplementedError

    @classmethod
    def from_checkpoint(cls, path, gpu, max_seq_len: int = 4096, comm=None, options=None, **kw):
        """The proposer of the checkpoint at `path` (see `mtp_cupy.load_proposer`). Options are checked, and the
        config read and checked, before any weight is read."""
        opts = cls.options_of(options, kw)
        if not cls.shardable and comm is not None and getattr(comm, "world", 1) != 1:
            raise ConfigError(f"the {cls.family} MTP proposer runs on one GPU; it is not sharded over ranks")
        cfg = load_config(Path(path))
        if not isinstance(cfg, cls.config_class):
            raise ConfigError(f"{path} is a {cfg.family} checkpoint, not {cls.family}")
        return cls(gpu, cfg, cls.load_weights(gpu, path, cfg, opts, comm), max_seq_len=max_seq_len, comm=comm,
                   options=opts)

    def __init__(self, gpu, vocab_size: int, hidden_size: int, max_seq_len: int, kv: PagedKvCache,
                 options: ProposerOptions, extra_regions: dict[str, int] | None = None):
        self.gpu, self.vocab_size, self.hidden_size = gpu, int(vocab_size), int(hidden_size)
        self.options = options
        self.max_seq_len, self.kv, self.max_drafts = int(max_seq_len), kv, int(options.max_drafts)
        mtp_vocab_size = int(getattr(options, "mtp_vocab_size", 0))
        self.vocab_eff = min(mtp_vocab_size, vocab_size) if mtp_vocab_size > 0 else vocab_size
        self.max_prefill_rows = int(options.max_prefill_rows)
        hmax = max(int(np.prod(s)) for s in self._hidden_shapes())
        regions = {"ids": 4 * (self.max_drafts + 1), "hidden_in": 2 * hmax,
                   "logits": 4 * self.vocab_eff * self.max_drafts, "flags": 4 * self.max_drafts,
                   "lp": 4 * self.max_drafts, "mask": 4 * ((vocab_size + 31) // 32) * self.max_drafts,
                   "prefill_ids": 4 * (self.max_prefill_rows + 1),
                   "prefill_pos": 4 * self.max_prefill_rows, "prefill_slots": 8 * self.max_prefill_rows,
                   "prefill_hidden": 2 * self.hidden_size * self.max_prefill_rows}
        regions.update(extra_regions or {})
        self.bufs = ForwardBuffers(gpu, regions)
        # a slab holds a block table as long as max_seq_len needs, so a graph never outgrows it
        self._slab_bytes = slab_spec.slab_bytes(self.max_seq_len)
        if self._slab_bytes > self.bufs.mtp_meta_capacity:
            raise CapacityError(f"max_seq_len {self.max_seq_len} needs a {self._slab_bytes}-byte metadata slab; "
                                f"the scratch holds {self.bufs.mtp_meta_capacity}")
        self._stage = None
        graphs = options.cuda_graphs
        self.cuda_graphs = bool(gpu.is_cuda) if graphs is None else bool(graphs) and gpu.is_cuda
        # blocking: ordered after work the caller left on the default stream (e.g. the target's hidden)
        self.stream = gpu.new_stream(non_blocking=False)
        self._graphs: dict = {}
        self._warm: set = set()

    # -- hooks -----------------------------------------------------------------------------------
    def _hidden_shapes(self) -> list[tuple[int, ...]]:
        return [(self.hidden_size,)]

    def _graph_variant(self):
        """Anything besides (k, masked) that changes which launches a chain makes (V4: the hidden form)."""
        return None

    def _hidden_row_elems(self) -> int:
        """Elements of one prefill hidden row behind a device pointer (V4 streams: hc * D)."""
        return self.hidden_size

    def _step(self, st, ids: DevicePtr, hidden: DevicePtr, position: int, row: int, logits: DevicePtr) -> None:
        raise NotImplementedError

    def _write_rows(self, st, tokens_dev: DevicePtr, hiddens: DevicePtr, positions: DevicePtr,
                    slots: DevicePtr, row_base: int, n: int) -> None:
        raise NotImplementedError

    def _pick(self, step: int, logits: DevicePtr, mask: DevicePtr | None, want_lp: bool) -> None:
        """Write the draft id of `step` to ids[step+1] (device)."""
        ids_out = self.bufs.ids.offset(4 * (step + 1))
        if mask is not None:
            ops.argmax_bitmask(self.gpu, logits, self.vocab_eff, mask, ids_out, self.bufs.flags.offset(4 * step))
        else:
            ops.argmax(self.gpu, logits, self.vocab_eff, ids_out,
                       out_lp=self.bufs.lp.offset(4 * step) if want_lp else DevicePtr(0))

    # -- state -----------------------------------------------------------------------------------
    def alloc_state(self) -> ProposerState:
        return ProposerState(blocks=SeqBlocks(self.kv))

    def free_state(self, st: ProposerState) -> None:
        if st.released:
            return
        st.blocks.release()
        st.keys, st.released, st.last_num_drafted = [], True, 0

    def _live(self, st: ProposerState) -> None:
        if st.released:
            raise InputError("proposer state was freed")

    def _reserve(self, st, rows: int) -> None:
        if rows > self.max_seq_len:
            raise CapacityError(f"drafter would hold {rows} rows; it was sized for {self.max_seq_len}")
        st.blocks.reserve(rows)

    # -- prefill / catch-up ----------------------------------------------------------------------
    def prefill(self, st: ProposerState, tokens, hiddens, start_position: int | None = None) -> int:
        """Rows pairing embed(tokens[r+1]) with hiddens[r] at position start_position + r. Rows must follow
        the newest row without a hole (start_position defaults to the next position). Returns rows written."""
        self._live(st)
        toks = np.asarray(tokens, dtype=np.int64).reshape(-1)
        n = toks.size - 1
        if n < 1:
            raise InputError("prefill needs at least two tokens (one row)")
        for t in toks:
            check_token(t, self.vocab_size)
        nxt = st.keys[-1] + 1 if st.keys else 0
        start = nxt if start_position is None else int(start_position)
        if start != nxt:
            raise InputError(f"prefill at position {start} would leave a hole or overwrite: the next drafter "
                             f"position is {nxt}")
        check_position(start + n - 1, self.max_seq_len)
        h = self._host_hiddens(hiddens, n)
        rows0 = st.blocks.rows
        self._reserve(st, rows0 + n)
        try:
            with self.gpu.using(self.stream):
                self._prefill_chunks(st, toks, h, start, rows0, n)
        except Exception:
            st.blocks.truncate(rows0)
            raise
        st.keys.extend(range(start, start + n))
        return n

    def _prefill_chunks(self, st, toks, h, start: int, rows0: int, n: int) -> None:
        for c0 in range(0, n, self.max_prefill_rows):
            c = min(self.max_prefill_rows, n - c0)
            pos = np.arange(start + c0, start + c0 + c, dtype=np.uint32)
            slots = np.array([st.blocks.slot(rows0 + c0 + r) for r in range(c)], dtype=np.int64)
            self.gpu.copy_h2d(self.bufs.prefill_ids, toks[c0:c0 + c + 1].astype(np.int32))
            self.gpu.copy_h2d(self.bufs.prefill_pos, pos)
            self.gpu.copy_h2d(self.bufs.prefill_slots, slots)
            if isinstance(h, np.ndarray):
                self.gpu.copy_h2d(self.bufs.prefill_hidden, h[c0:c0 + c])
                hp = self.bufs.prefill_hidden
            else:
                hp = DevicePtr(int(h) + 2 * self._hidden_row_elems() * c0)
            self._write_rows(st, self.bufs.prefill_ids, hp, self.bufs.prefill_pos, self.bufs.prefill_slots,
                             rows0 + c0, c)
            st.blocks.rows = rows0 + c0 + c

    def _host_hiddens(self, hiddens, n: int):
        if isinstance(hiddens, (DevicePtr, int)) and not isinstance(hiddens, np.ndarray):
            if int(hiddens) == 0:
                raise InputError("hiddens is a NULL device pointer")
            return DevicePtr(int(hiddens))
        h = np.asarray(hiddens)
        if h.dtype not in (np.float32, BF16):
            raise InputError(f"hiddens must be float32 or bfloat16, got {h.dtype}")
        if h.shape != (n, self.hidden_size):
            raise InputError(f"hiddens has shape {h.shape}; expected ({n}, {self.hidden_size}) "
                             "(one per token but the last)")
        return np.ascontiguousarray(h.astype(BF16, copy=False))

    # -- propose ---------------------------------------------------------------------------------
    def _masks(self, bitmask, k: int):
        if bitmask is None:
            return None
        m = np.asarray(bitmask)
        words = (self.vocab_size + 31) // 32
        rows = [m] * k if m.ndim == 1 else list(m)
        if len(rows) < k:
            raise InputError(f"grammar bitmask has {len(rows)} rows for {k} drafts")
        return np.stack([check_bitmask(r, self.vocab_size) for r in rows[:k]]).reshape(k, words)

    def _check_hidden_shape(self, hidden):
        if isinstance(hidden, (DevicePtr, int)) and not isinstance(hidden, np.ndarray):
            return self._hidden_shapes()[0]
        shape = tuple(np.shape(hidden))
        for s in self._hidden_shapes():
            if shape == s or (len(s) == 1 and shape == (1,) + s):
                return s
        raise InputError(f"hidden has shape {shape}; expected one of {self._hidden_shapes()}")

    def propose(self, st: ProposerState, token: int, hidden, position: int, num_drafts: int,
                grammar_bitmask=None, return_logits: bool = False, min_logprob: float | None = None) -> DraftResult:
        """k draft tokens from the row at `position` (pairs embed(token) with the target's hidden there).
        `min_logprob` stops the chain early once a draft's top-1 log-prob falls below it."""
        self._live(st)
        token = check_token(token, self.vocab_size)
        position = check_position(position, self.max_seq_len)
        k = int(num_drafts)
        if not 1 <= k <= self.max_drafts:
            raise InputError(f"num_drafts {k} outside [1, {self.max_drafts}] (raise max_drafts at load)")
        if position + k > self.max_seq_len:
            raise InputError(f"{k} drafts from position {position} run past max_seq_len {self.max_seq_len}")
        if st.keys and position <= st.keys[-1]:
            raise InputError(f"position {position} is not after the newest drafter row ({st.keys[-1]}); "
                             "call after_verify first")
        masks = self._masks(grammar_bitmask, k)
        if masks is not None and min_logprob is not None:
            raise InputError("min_logprob (confidence stop) cannot be combined with a grammar bitmask")
        hshape = self._check_hidden_shape(hidden)
        rows0 = st.blocks.rows
        self._reserve(st, rows0 + k)
        gpu, b = self.gpu, self.bufs
        try:
            with gpu.using(self.stream):
                hidden_to_device(gpu, hidden, hshape, b.hidden_in)
                gpu.copy_h2d_async(b.ids, np.array([token], dtype=np.int32))
                if masks is not None:
                    gpu.copy_h2d_async(b.mask, masks)
                self._stage_meta(st, position, rows0, k)
                done, lps = self._run_chain(st, position, rows0, k, masks is not None, min_logprob)
                st.blocks.rows = rows0 + k              # written rows; the confidence stop trims below
                ids = gpu.read(b.ids.offset(4), np.int32, done).tolist()
        except Exception:
            st.blocks.truncate(rows0)
            raise
        st.blocks.truncate(rows0 + done)
        if masks is not None:
            flags = gpu.read(b.flags, np.int32, done)
            for i in np.flatnonzero(flags):
                log.warning("grammar mask allowed no token at draft %d (position %d); drafting pad id 0",
                            i, position + i)
        st.keys.extend(range(position, position + done))
        st.last_num_drafted, st.last_pair_key, st.last_drafts = done, position + done - 1, ids
        logits = gpu.read(b.logits, np.float32, (done, self.vocab_eff)) if return_logits else None
        if logits is not None and self.vocab_eff < self.vocab_size:
            logits = np.pad(logits, ((0, 0), (0, self.vocab_size - self.vocab_eff)), constant_values=-np.inf)
        return DraftResult(ids, logits, lps or None)

    # -- the k-step chain: eager, captured once per (k, masked), replayed ---------------------------
    def _stage_meta(self, st, position: int, rows0: int, k: int) -> None:
        """The k steps' metadata slabs, in host staging memory the chain copies from (pinned on CUDA)."""
        if self._stage is None:
            stride = slab_spec.stride(self.max_seq_len)
            self._stage = self.gpu.alloc_pinned(self.max_drafts * stride).reshape(self.max_drafts, stride)
        stage_mtp_meta(self._stage, k, [position], [rows0], [st.blocks.table], self.kv.block_size)

    def _chain(self, k: int, masked: bool, min_logprob: float | None = None, st=None, position: int = 0,
               rows0: int = 0) -> tuple[int, list[float]]:
        """Launch the k steps. Per-call values live in device buffers (ids, hidden_in, the staged slabs), so
        the same launches replay as a graph. Returns (steps run, log-probs read for the confidence stop)."""
        gpu, b = self.gpu, self.bufs
        words = (self.vocab_size + 31) // 32
        hid, lps = b.hidden_in, []
        for i in range(k):
            logits = b.logits.offset(4 * self.vocab_eff * i)
            gpu.copy_h2d_async(b.mtp_meta, self._stage[i, :self._slab_bytes])
            self._step(st, b.ids.offset(4 * i), hid, position + i, rows0 + i, logits)
            self._pick(i, logits, b.mask.offset(4 * words * i) if masked else None, min_logprob is not None)
            hid = self.carry
            if min_logprob is not None:
                lps.append(float(gpu.read(b.lp.offset(4 * i), np.float32, 1)[0]))
                if lps[-1] < min_logprob and i + 1 < k:
                    return i + 1, lps
        return k, lps

    def _run_chain(self, st, position: int, rows0: int, k: int, masked: bool, min_logprob) -> tuple[int, list]:
        if not (self.cuda_graphs and self.graph_safe) or min_logprob is not None:
            return self._chain(k, masked, min_logprob, st, position, rows0)
        self._replay((k, masked, self._graph_variant()), lambda: self._chain(k, masked, None, st, position, rows0))
        return k, []

    def _replay(self, key, launches) -> None:
        """Replay the graph of `key` on self.stream; the first call per key runs `launches` eagerly (lazy
        workspaces get allocated), the second captures them."""
        graph = self._graphs.get(key)
        if graph is None:
            if key not in self._warm:
                self._warm.add(key)
                launches()
                return
            graph = self._graphs[key] = self.gpu.capture(launches, self.stream)
        self.gpu.replay(graph, self.stream)

    def after_verify(self, st: ProposerState, num_accepted: int) -> None:
        self._live(st)
        a = int(num_accepted)
        if not 0 <= a <= st.last_num_drafted:
            raise InputError(f"num_accepted {a} outside [0, {st.last_num_drafted}] (drafts of the last propose)")
        trim = mtp_rows_to_trim(st.last_num_drafted, a, self.refeed_accepted)
        st.blocks.truncate(st.blocks.rows - trim)
        del st.keys[len(st.keys) - trim:]
        st.last_pair_key = st.keys[-1] if st.keys else None
        st.last_num_drafted = 0
