"""MtpProposerBase: the mechanics every family shares, so a family writes only its math.

A family subclass sets `family`, `Options` (its options dataclass), `config_class` and `load_weights`
(gpu, path, cfg, options, comm) -> weights, and implements
    _forward(ids, hidden, m, meta, meta_stride, logits)   one draft step for m sequences, one row each: embed
        the i32 token ids at `ids`, combine them with the bf16 hiddens at `hidden`, run the block (row s's KV
        row and RoPE position come from its metadata slab at meta + s * meta_stride), write f32 logits
        [m, vocab_eff] at `logits`, and leave the carried hiddens [m, ...] at `self.carry`.
    _write_rows(tokens_dev, hiddens, positions, slots, n)   prefill / catch-up (speculative/prefill.py): n
        drafter KV rows pairing embed(tokens[r+1]) with hiddens[r] at the u32 positions / i64 slots given, rows
        of any sequences (no attention).
It sets `self.carry` after super().__init__ and may override `_hidden_shapes` (V4 accepts [D] and [hc, D]),
`_pick` (GLM's cross-rank argmax) and `_graph_variant`.

Batches. `propose_batch` drafts for B sequences in one chain of k steps over B rows (`propose` is a batch of
one). Every sequence has its own slab (its position, slot, seq_len and block table), staged for all k steps
in mapped host memory. The chain's first kernel reads the stage in (and fetches a device hidden); its last one
writes the drafts into a mapped outbox, then the call's sequence number, which the host spins on (ops/call_io.py:
no copy call and no stream wait on either side of the graph). A row's arithmetic does not depend on the rows
beside it (batch-invariant launch geometry), so a sequence drafts the same whatever batch it is in.

CUDA graphs: the chain is captured once per (k, bucket, masked, outputs, variant) and replayed, with the
bucket the smallest of BUCKETS (capped at max_batch) that holds B. The bucket's spare rows are pad
sequences: token 0, the hidden left in their row, one KV row in a block of their own (taken at load),
never read back. A family that sets `graph_safe = True` promises that `_forward` and `_pick` launch only
device work on fixed buffers and read every per-call value from device memory.

Tensors and streams (torch serving loops). Hiddens, tokens and positions may be any DLPack object (torch or
cupy tensors, CPU or CUDA) besides NumPy arrays (`speculative/inputs.py`). A C-contiguous bf16 CUDA tensor on the
proposer's GPU is read in place: on the eager path the chain reads the caller's pointer; on the graph path (a
graph captures the `hidden_in` address) the chain's first kernel copies it into `hidden_in` (a device-to-device
copy call when its address is not 16-byte aligned); neither touches the host. Other tensors are converted once
(f32/f16 rounded to bf16 on the device, strided ones made contiguous; CPU ones on the host). Work runs on
`self.stream`: the proposer's own blocking stream, or the caller's (`load_proposer(..., stream=s)`); a per-call
`stream=s` makes the proposer's stream wait for s before the call's work and s wait for it after (events, no host
wait). Device tokens / positions are read to the host (a wait on the proposer's stream: they drive the checks
and the host-side metadata). The only host waits are for the results the caller asks for (host results, the
default: a spin on the outbox; `device_results=True` returns device arrays instead) and, before restaging the
mapped slabs, a wait for this proposer's previous chain to have read them. Inputs are read asynchronously: keep a
tensor unchanged until the call's work ran (host results: until the call returns; otherwise pass `stream=` or
share the stream).

State changes happen only after every check passes; a failure inside the chain rolls every row back."""
from __future__ import annotations

import contextlib
import logging
import math
from pathlib import Path

import numpy as np

from .. import ops
from ..cache import PagedKvCache, SeqBlocks
from ..cache.paged import NBLOCKS, ROWS
from ..errors import CapacityError, ConfigError, InputError, KernelError
from ..runtime import slab as slab_spec
from ..runtime.arena import ForwardBuffers, OneStager, SlabStager, pack_mtp_attn_meta, stage_mtp_meta
from ..runtime.ptr import NULL, DevicePtr
from ..weights.config import ModelConfig, load_config
from .batch_host import BatchHost, host_library
from .batch_inputs import ARRAY_MIN_BATCH, BatchMemo, batch_masks, check_sequences, mirror_rows, state_list
from .inputs import host_ints, stage_hidden, take_hidden
from .options import ProposerOptions
from .prefill import Prefill
from .proposer import (DRAFTED, LAST, OFF, RUN0, DraftBatch, DraftResult, ProposerState, mtp_rows_to_trim,
                       mtp_rows_to_trim_batch)

log = logging.getLogger("mtp_cupy")

BUCKETS = (1, 2, 4, 8, 16, 32, 64)
_NO_STREAM = contextlib.nullcontext()


class MtpProposerBase(Prefill):
    family = "base"
    Options: type[ProposerOptions] = ProposerOptions
    config_class: type[ModelConfig] = ModelConfig
    shardable = False    # may run over a communicator of several ranks
    refeed_accepted = False
    graph_safe = False   # a family whose _forward/_pick launch only device work on fixed buffers sets True

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

    @staticmethod
    def kv_blocks(options: ProposerOptions, max_seq_len: int) -> int:
        """Pool blocks: max_sequences (default max_batch) sequences of max_seq_len, plus the pad block."""
        seqs = options.max_sequences or options.max_batch
        return PagedKvCache.blocks_for(max_seq_len) * seqs + 1

    def __init__(self, gpu, vocab_size: int, hidden_size: int, max_seq_len: int, kv: PagedKvCache,
                 options: ProposerOptions, extra_regions: dict[str, int] | None = None):
        self.gpu, self.vocab_size, self.hidden_size = gpu, int(vocab_size), int(hidden_size)
        self.options = o = options
        self.max_seq_len, self.kv, self.max_drafts = int(max_seq_len), kv, int(o.max_drafts)
        self.max_batch, self.drafter_context = int(o.max_batch), bool(o.drafter_context)
        mtp_vocab_size = int(getattr(o, "mtp_vocab_size", 0))
        self.vocab_eff = min(mtp_vocab_size, vocab_size) if mtp_vocab_size > 0 else vocab_size
        self.max_prefill_rows = int(o.max_prefill_rows)
        B, k, words = self.max_batch, self.max_drafts, (self.vocab_size + 31) // 32
        hmax = max(int(np.prod(s)) for s in self._hidden_shapes())
        self.meta_stride = slab_spec.stride(self.max_seq_len)
        # call_in: what one copy brings in per call, [step-0 token ids i32 [B] | every step's slabs]; its host
        # twin is the pinned `_stage`, laid out alike (step i's W slabs at meta_off + i * W * meta_stride)
        self._meta_off = -(-4 * B // 256) * 256
        regions = {"ids": 4 * B * (k + 1), "hidden_in": 2 * hmax * B, "logits": 4 * self.vocab_eff * B,
                   "flags": 4 * B * k, "lp": 4 * B * k, "mask": 4 * words * B * k,
                   "call_in": ops.up16(self._meta_off + k * B * self.meta_stride),
                   "call_seq": 16,   # u32 words: a propose's seq, a graphed prefill pass's
                   "prefill_in": ops.up16(16 * self.max_prefill_rows + 4),   # speculative/prefill.py's staged rows
                   "prefill_hidden": 2 * hmax * self.max_prefill_rows}   # host rows, or a graphed pass's
        regions.update(extra_regions or {})
        self.bufs = ForwardBuffers(gpu, regions)
        self.meta = self.bufs.call_in.offset(self._meta_off)   # step 0's slabs
        # mapped host staging of call_in (then the call's CallCtl), and the inbox of a call's host hiddens (bf16
        # [max_batch, hmax]); the chain reads both in itself (inside the graph: no copy call per propose); the
        # mapped outbox the chain's last kernel publishes the drafts to; made on first use
        self._stage = None
        self._seq = 0   # the last call's sequence number (its CallCtl's, and what its outbox says when published)
        self._outbox = None
        self._steps = {}   # (k, W) -> the [k, W * meta_stride] view of the stage's slabs
        self._stagers = {}   # (k, W, B) -> the SlabStager of a wide batch's B slabs in that view (B = 1: a OneStager)
        self._inbox = None
        self._prefill_stage = None   # pinned twin of prefill_in (made on first use) and its copy's event
        self._prefill_copied = None
        self._hmax = hmax
        self._all_logits = None   # f32 [max_drafts, max_batch, vocab_eff], made on the first return_logits
        # the pad sequences' one KV row, in a block of their own, so a full pool never fails a bucketed call
        self._pad = SeqBlocks(kv)
        self._pad.reserve(1)
        raw = pack_mtp_attn_meta(0, self._pad.slot(0), 1, self._pad.table, self.meta_stride)
        self._pad_slab = np.frombuffer(raw.ljust(self.meta_stride, b"\0"), np.uint8)
        self._pad_zeroed = False
        graphs = o.cuda_graphs
        self.cuda_graphs = bool(gpu.is_cuda) if graphs is None else bool(graphs) and gpu.is_cuda
        # a host hidden's NaN check runs after the chain's launch where launches are asynchronous (CUDA): it then
        # overlaps the GPU's work (a bad hidden still raises InputError, with every row rolled back)
        self._defer_nan_check = bool(gpu.is_cuda)
        # own stream blocking: ordered after work the caller left on the default stream (e.g. the target's
        # hidden); or the caller's stream itself
        self._own_stream = o.stream is None
        self.stream = gpu.new_stream(non_blocking=False) if self._own_stream else gpu.external_stream(o.stream)
        self._capture_stream = None
        self._stage_done = None   # set when a call returned before its chain read the pinned stage (_mark_stage_read)
        self._chain_done = None   # the one event object _stage_done records (made on first use)
        self._graphs: dict = {}
        self._warm: set = set()
        self._memo = BatchMemo()   # the last wide batch's checked states and mirror rows (a serving loop repeats it)
        # blocks_for(rows) for every row count a sequence can hold: the batch calls' block arithmetic as one take
        self._blocks_of = (np.arange(self.max_seq_len + 1, dtype=np.int64) + kv.block_size - 1) // kv.block_size
        self._zeros = np.zeros(self.max_batch, np.int64)
        self._drafts = np.zeros((0, self.max_drafts), np.int32)   # the last drafts of mirror row r (ProposerState)
        # the propose / batch calls' bookkeeping compiled (batch_host.py), or None: NumPy's
        self._host_lib, self._host = host_library(o.host_path), None
        self._one_row = np.zeros(1, np.intp)   # propose's state's mirror row (the compiled path's idx)
        log.info("%s drafter: KV pool of %d blocks holds %d sequences of %d rows; batch bookkeeping %s", self.family,
                 kv.num_blocks, self.sequences_that_fit(), self.max_seq_len,
                 "compiled" if self._host_lib is not None else "in NumPy")

    def bucket(self, B: int) -> int:
        """The graph width a batch of B sequences runs at: the smallest of BUCKETS that holds it (<= max_batch)."""
        return next((b for b in BUCKETS if B <= b <= self.max_batch), self.max_batch)

    @property
    def pool_blocks(self) -> int:
        """KV blocks the sequences share (the pool less the pad sequences' block)."""
        return self.kv.num_blocks - self._pad.nblocks

    def sequences_that_fit(self, rows: int | None = None) -> int:
        """How many sequences of `rows` rows (default max_seq_len) the KV pool holds at once."""
        return self.pool_blocks // max(PagedKvCache.blocks_for(self.max_seq_len if rows is None else rows), 1)

    # -- hooks -----------------------------------------------------------------------------------
    def _hidden_shapes(self) -> list[tuple[int, ...]]:
        """Shapes one sequence's hidden may have; the first is what a device pointer holds."""
        return [(self.hidden_size,)]

    def _graph_variant(self):
        """Anything besides (k, bucket, masked, outputs) that changes which launches a chain makes."""
        return None

    def _use_hidden_shape(self, shape: tuple[int, ...]) -> None:
        """Called with the per-sequence hidden shape of a call before its chain (V4 picks its front)."""

    def _hidden_row_elems(self) -> int:
        """Elements of one prefill hidden row behind a device pointer (V4 streams: hc * D)."""
        return self.hidden_size

    def _forward(self, ids: DevicePtr, hidden: DevicePtr, m: int, meta: DevicePtr, meta_stride: int,
                 logits: DevicePtr) -> None:
        raise NotImplementedError

    def _write_rows(self, tokens_dev: DevicePtr, hiddens: DevicePtr, positions: DevicePtr, slots: DevicePtr,
                    n: int) -> None:
        raise NotImplementedError

    def _pick(self, step: int, W: int, logits: DevicePtr, masked: bool, want_lp: bool, keep: bool = False) -> None:
        """The draft ids of `step` for the W rows: argmax of each row's f32 logits into ids[step + 1] (`keep`:
        the logits are returned to the caller)."""
        b, V = self.bufs, self.vocab_eff
        out = b.ids.offset(4 * W * (step + 1))
        if masked:
            words = (self.vocab_size + 31) // 32
            ops.argmax_bitmask(self.gpu, logits, V, b.mask.offset(4 * words * W * step), out,
                               b.flags.offset(4 * W * step), rows=W, row_stride=V, mask_row_words=words)
        else:
            ops.argmax(self.gpu, logits, V, out, rows=W, row_stride=V,
                       out_lp=b.lp.offset(4 * W * step) if want_lp else NULL)

    # -- state -----------------------------------------------------------------------------------
    def alloc_state(self) -> ProposerState:
        """A new, empty sequence state (its drafter rows live in this proposer's KV pool)."""
        return ProposerState(blocks=SeqBlocks(self.kv), owner=self)

    def free_state(self, st: ProposerState) -> None:
        """Give the sequence's KV blocks back; calling it again does nothing."""
        if st.released:
            return
        st.blocks.release()
        st.runs, st.released = [], True

    def _live(self, st: ProposerState) -> None:
        if st.released:
            raise InputError("proposer state was freed")

    def _reserve(self, st, rows: int) -> None:
        if rows > self.max_seq_len:
            raise CapacityError(f"drafter would hold {rows} rows; it was sized for {self.max_seq_len}")
        st.blocks.reserve(rows)

    def _reserve_rows(self, states, k, idx=None, c=None) -> list[int] | np.ndarray:
        """Room for k more rows in every sequence (a propose's drafts, or a prefill_batch's rows: then k is an
        int array, rows per sequence), all or none (CapacityError with every table as it was); returns the row
        counts before (an array when the batch's mirror rows `idx` and counters `c` are given: c's NBLOCKS follow
        the growth). Most calls need no new block: one comparison per sequence, or one array comparison for the
        batch, whose sequences that need one block more get it in one pool call."""
        room, ones = self.kv.block_size, None
        if c is not None:   # rows0 + k <= max_seq_len: every position checked is at least its row count
            rows0 = c[:, ROWS]   # (c's own; the mirror's column is updated when the call finishes)
            need = self._blocks_of[k:].take(rows0) if isinstance(k, int) else self._blocks_of.take(rows0 + k)
            need -= c[:, NBLOCKS]   # >= 0: a table holds its rows' blocks
            n = np.count_nonzero(need)
            if not n:
                return rows0
            one = need == 1
            n1 = np.count_nonzero(one)
            todo = np.flatnonzero(need > 1).tolist() if n1 < n else []
            if n1 == len(need):   # every sequence crosses into a new block (and todo is empty)
                self.kv.grow_one(idx, c[:, NBLOCKS])
                c[:, NBLOCKS] += 1
            elif n1:
                ones = np.flatnonzero(one)
                self.kv.grow_one(idx[ones], c[ones, NBLOCKS])
                c[ones, NBLOCKS] += 1
        else:
            rows0, todo = [], []
            for st in states:   # a plain loop: the common B = 1 case pays no comprehension frame
                b = st.blocks
                r0 = b.rows
                if r0 + k > b.nblocks * room or r0 + k > self.max_seq_len:
                    todo.append(len(rows0))
                rows0.append(r0)
            if not todo:
                return rows0
        done = []
        try:
            for s in todo:
                self._reserve(states[s], int(rows0[s]) + (k if isinstance(k, int) else int(k[s])))
                done.append(s)
        except Exception:
            for s in done + ([] if ones is None else ones.tolist()):
                states[s].blocks.truncate(int(rows0[s]))
            raise
        if c is not None:
            for s in done:
                c[s, NBLOCKS] = states[s].blocks.nblocks
        return rows0

    # -- propose ---------------------------------------------------------------------------------
    def propose(self, st: ProposerState, token, hidden, position, num_drafts: int, grammar_bitmask=None,
                return_logits: bool = False, min_logprob: float | None = None, stream=None,
                device_results: bool = False) -> DraftResult:
        """Draft `num_drafts` tokens for one sequence: `propose_batch` of one (see there). `hidden` is one
        sequence's hidden ([D], V4 also [hc, D]), with or without a leading 1."""
        masks = None if grammar_bitmask is None else [grammar_bitmask]
        return self._propose([st], token, hidden, position, num_drafts, masks, return_logits, min_logprob, stream,
                             device_results, single=True)._item(0)

    def propose_batch(self, states: list[ProposerState], tokens, hiddens, positions, num_drafts: int,
                      grammar_bitmasks=None, return_logits: bool = False, min_logprob: float | None = None,
                      stream=None, device_results: bool = False) -> DraftBatch:
        """Draft `num_drafts` tokens for each of B sequences in one chain of batched steps.

        Parameters
        ----------
        states : list of ProposerState, B distinct live sequences (1 <= B <= max_batch)
        tokens : B ints (or an integer array / DLPack tensor); tokens[s] is what the target emitted after
            position positions[s]
        hiddens : [B, D] (V4 also [B, hc, D]) float32, float16 or bfloat16: a NumPy array, any DLPack tensor (a
            C-contiguous bf16 CUDA tensor on this GPU is not copied to the host, see the module docstring), or a
            device pointer to B bf16 rows: the target's hidden at positions[s]
        positions : B ints (or an array / tensor); each must be the next position after the sequence's newest
            drafter row (a later one without drafter context). None: every sequence's next position.
        num_drafts : int, 1 <= k <= max_drafts
        grammar_bitmasks : list of B masks (int32 [words] or [k, words], None = unconstrained), optional
        return_logits : bool; DraftResult.logits is then float32 [drafts, vocab] on the host
        min_logprob : float, optional; a sequence stops after the first draft whose top-1 log-prob is below it
        stream : optional; a caller's stream (torch.cuda.Stream, cupy stream, __cuda_stream__, cudaStream_t int)
            the call's work is ordered after, and that is made to wait for that work (device events, no host wait)
        device_results : bool; the drafts (and logits) stay on the device (DraftResult.device_tokens /
            device_logits, DLPack arrays of their own) and the call returns without waiting for them

        Returns
        -------
        DraftBatch : a sequence of B DraftResults, in order, and the batch's arrays whole (`tokens` int32 [B, k],
            `device_tokens`, ...).

        Raises InputError (bad ids, shapes, dtypes, devices, a hole in a sequence's rows, ...) or CapacityError
        (KV pool, max_seq_len); no sequence changes on failure."""
        idx = self._memo.rows(states, self.kv)
        if idx is None:
            states = state_list(states, "propose_batch")
        return self._propose(states, tokens, hiddens, positions, num_drafts, grammar_bitmasks, return_logits,
                             min_logprob, stream, device_results, single=False, idx=idx)

    def _propose(self, states, tokens, hiddens, positions, num_drafts, grammar_bitmasks, return_logits,
                 min_logprob, stream, device_results, single: bool, idx=None) -> DraftBatch:
        k, gpu = int(num_drafts), self.gpu
        with self._ordered(stream):
            toks = host_ints(tokens, gpu, "token" if single else "tokens", self.stream, as_array=not single)
            poss = None if positions is None else \
                host_ints(positions, gpu, "position" if single else "positions", self.stream, as_array=not single)
            if single and (len(toks) != 1 or (poss is not None and len(poss) != 1)):
                raise InputError(f"propose takes one token and one position, got {len(toks)} and "
                                 f"{1 if poss is None else len(poss)}")
            if min_logprob is not None and grammar_bitmasks is not None:
                raise InputError("min_logprob is measured by the plain argmax; it cannot be combined with "
                                 "grammar bitmasks")
            if min_logprob is not None and device_results:
                raise InputError("min_logprob stops on log-probs read on the host; it cannot be combined with "
                                 "device_results")
            B = len(states)
            if single and self._host_lib is not None and isinstance(states[0], ProposerState) \
                    and not states[0].released:
                idx = self._one_row   # propose's one live state: its mirror row, for the compiled bookkeeping
                idx[0] = states[0].blocks.row
            # a remembered wide batch (its states checked), or propose's state, with inputs of its length: the
            # compiled bookkeeping
            host = self._batch_host() if idx is not None and len(toks) == B and (poss is None or len(poss) == B) \
                and 1 <= k <= self.max_drafts else None
            if host is None:
                known = idx is not None
                toks, poss, idx, cols = check_sequences(self, states, toks, poss, k, idx)
                if idx is not None and not known:
                    self._memo.keep(states, idx, self.kv)
            graphed = self.cuda_graphs and self.graph_safe
            W = self.bucket(B) if graphed else B
            masks = batch_masks(grammar_bitmasks, B, W, self.vocab_size, k)
            try:
                hid = take_hidden(gpu, hiddens, B, self._hidden_shapes(), "hidden" if single else "hiddens",
                                  self.stream, single=single, check_device=self.options.check_device_finite,
                                  defer_check=self._defer_nan_check)
            except InputError:
                if host is not None:   # the compiled path checks the ids later: name a bad id first, as NumPy does
                    check_sequences(self, states, toks, poss, k, None if single else idx)
                raise
            if host is not None:   # checks, blocks and every step's slab at once (into the stage: wait first)
                self._wait_stage()
                staged = host.stage(idx, toks, poss, k, W)
                if staged is None:   # nothing changed: the NumPy path names the problem or takes the rare case
                    host = None   # (propose's state takes the per-sequence path: its row is not the memo's)
                    toks, poss, idx, cols = check_sequences(self, states, toks, poss, k, None if single else idx)
                else:
                    rows0, poss = staged
            if host is None:
                rows0 = self._reserve_rows(states, k, idx, cols)
            want_lp = min_logprob is not None
            try:
                with gpu.using(self.stream):
                    self._use_hidden_shape(hid.row_shape)
                    # eager: the chain reads a 16-byte aligned device hidden where it is (kernels read 16-byte
                    # chunks); a graph reads hidden_in (its address is captured), where the chain's first kernel
                    # fetches an aligned device hidden; any other goes there by a copy first
                    in_place = hid.ptr is not None and not graphed and int(hid.ptr) % 16 == 0
                    h_elems = math.prod(hid.row_shape)
                    self._stage_inputs(None if host is not None else toks, hid, W, h_elems)
                    fetch = 0   # 16-byte words of device hiddens the chain's first kernel copies into hidden_in
                    if hid.host is None and not in_place and int(hid.ptr) != int(self.bufs.hidden_in):
                        fetch = ops.fetch_words(hid.ptr, 2 * B * h_elems)
                        if not fetch:
                            stage_hidden(gpu, hid, self.bufs.hidden_in)
                    self._seq = self._seq % 0xFFFFFFFF + 1
                    ops.write_ctl(self._ctl, self._seq, fetch, int(hid.ptr) if fetch else 0)
                    hidden0 = hid.ptr if in_place else self.bufs.hidden_in
                    self._pad_rows(B, W, h_elems)
                    if masks is not None:
                        gpu.copy_h2d_async(self.bufs.mask, masks)
                    if host is None:
                        self._stage_slabs(states, rows0, poss, k, W, idx, cols)
                    inbox = 2 * W * h_elems if hid.host is not None else 0   # host hidden bytes the chain copies
                    publish = not device_results
                    if graphed:
                        key = (k, W, masks is not None, want_lp, return_logits, inbox, publish,
                               self._graph_variant())
                        self._replay(key, lambda: self._chain(k, W, masks is not None, want_lp, return_logits,
                                                              hidden0, inbox, publish))
                    else:
                        self._chain(k, W, masks is not None, want_lp, return_logits, hidden0, inbox, publish)
                    hid.require_finite()   # while the chain runs; a NaN row has only written rows dropped below
                    if device_results:
                        self._mark_stage_read()
                        out = self._device_results(k, W, B, return_logits)
                    else:   # the outbox is published after the chain read the stage (no event needed)
                        out = self._host_results(k, W, B, masks is not None, want_lp, return_logits)
            except Exception:
                self._mark_stage_read()
                for st, r0 in zip(states, rows0):
                    st.blocks.truncate(int(r0))
                hid.require_finite()   # a failure a NaN hidden caused is reported as the bad input it is
                raise
            del hid   # a converted copy goes back to the pool in stream order
        return self._finish(states, rows0, poss, k, out, min_logprob, idx, None if host is not None else cols, host)

    def _mark_stage_read(self) -> None:
        """Record, after the work on the stream so far, the event the next call waits for before it rewrites the
        pinned stage and inbox (a call that returns without waiting for its chain: device results, an error)."""
        if self._chain_done is None:
            self._chain_done = self.gpu.new_event(timing=False)
        self.gpu.record(self._chain_done, self.stream)
        self._stage_done = self._chain_done

    def _host_results(self, k: int, W: int, B: int, masked: bool, want_lp: bool, logits: bool) -> dict:
        """The chain's outputs from the outbox its last kernel published (ids, flags, log-probs: [k, W] each,
        once this call's seq is there); the logits, when asked for, read on the proposer's stream after it."""
        n, h = k * W, ops.OUTBOX_HEAD
        self._await_outbox()
        got = self._outbox_words[h:h + (3 if want_lp else 2 if masked else 1) * n].copy()
        st = self.stream
        return {"ids": got[:n].view(np.int32).reshape(k, W)[:, :B],
                "flags": got[n:2 * n].view(np.int32).reshape(k, W)[:, :B] if masked else None,
                "lps": got[2 * n:3 * n].view(np.float32).reshape(k, W)[:, :B] if want_lp else None,
                "logits": self.gpu.read(self._all_logits.ptr, np.float32, (k, W, self.vocab_eff), stream=st)[:, :B]
                if logits else None}

    def _await_outbox(self) -> None:
        """Spin until the outbox holds this call's seq: the host sees the drafts a few µs sooner than a stream wait
        would tell it (BENCHMARKS.md). A stream that ran dry without it means the chain failed."""
        seq, box, polls = self._seq, self._outbox_words, 0
        while box[0] != seq:
            polls += 1
            if polls % 64 == 0 and self.gpu.stream_done(self.stream) and box[0] != seq:
                raise KernelError(f"the draft chain ran without publishing call {seq} (the outbox holds call "
                                  f"{int(box[0])})")

    def _device_results(self, k: int, W: int, B: int, logits: bool) -> dict:
        """The chain's outputs copied on the proposer's stream into device arrays of this call: ids [B, k]
        (int32), logits [B, k, vocab] (f32, -inf past mtp_vocab_size); `ready` is recorded after them."""
        gpu, xp = self.gpu, self.gpu.xp
        ids = gpu.export(self.bufs.ids.offset(4 * W), "i32", (k, W), self.stream)
        ids = ids[:, :B].T.copy()
        lg = None
        if logits:
            lg = gpu.export(self._all_logits.ptr, "f32", (k, W, self.vocab_eff), self.stream)[:, :B]
            lg = lg.transpose(1, 0, 2)
            if self.vocab_eff < self.vocab_size:
                full = xp.full((B, k, self.vocab_size), -np.inf, dtype=np.float32)
                full[:, :, :self.vocab_eff] = lg
                lg = full
            else:
                lg = lg.copy()
        ready = gpu.new_event(timing=False)
        gpu.record(ready, self.stream)
        return {"device_ids": ids, "device_logits": lg, "ready": ready}

    def _finish(self, states, rows0, positions, k: int, out: dict, min_logprob, idx=None, c=None,
                host: BatchHost | None = None) -> DraftBatch:
        """Every sequence's state update (rows, positions, drafts; a confidence stop trims its rows) and the call's
        DraftBatch, from the chain's outputs. With the batch's mirror rows `idx` and counters `c` the counters
        are scattered back as one array (or by `host`, the compiled bookkeeping, when it staged the call), and
        only sequences that start a run of positions or stop early take a Python step."""
        lps, B = out.get("lps"), len(states)
        done = None   # drafts kept per sequence: all k unless a confidence stop
        if lps is not None:
            low = lps < min_logprob   # [k, B]
            if np.count_nonzero(low):
                done = np.where(low.any(axis=0), low.argmax(axis=0) + 1, k).astype(np.int64)
        kept = k if done is None else done
        dev = "device_ids" in out   # nothing read back: the drafts live on the device (no grammar warnings)
        toks = None if dev or host is not None else out["ids"].T.copy()   # int32 [B, k]
        drafts = self._drafts_rows()
        if host is not None:
            new_run, toks = host.finish(B, k, done, None if dev else out["ids"])
            for s in new_run.tolist():
                states[s]._extend(int(rows0[s]), int(positions[s]))
        elif idx is not None:
            if self.drafter_context:   # checked: every position is its sequence's next one, so only a first row
                new_run = None if np.count_nonzero(rows0) == len(rows0) else rows0 == 0   # starts a run
            else:
                new_run = (positions != c[:, OFF] + rows0) | (rows0 == 0)   # a later position, or a first row
            cols = self.kv._cols.ravel()   # (put at the rows' flat indices: a scatter cheaper than cols[idx] = c)
            cols.put(self._memo.at(ROWS), rows0 + k)
            cols.put(self._memo.at(DRAFTED), kept)
            cols.put(self._memo.at(LAST), 0 if dev else kept)
            if toks is not None:
                drafts[idx, :k] = toks
            if new_run is not None and np.count_nonzero(new_run):
                for s in np.flatnonzero(new_run).tolist():
                    states[s]._extend(int(rows0[s]), int(positions[s]))
        else:   # a few sequences: scalar stores beat fancy indexing
            cols = self.kv._cols
            for s, (st, r0, p, d) in enumerate(zip(states, rows0, positions,
                                                   [kept] * B if done is None else done.tolist())):
                row = st.blocks.row
                if not r0 or p != cols.item(row, OFF) + r0:   # not the next position of its last run
                    st._extend(r0, p)
                cols[row, ROWS], cols[row, DRAFTED], cols[row, LAST] = r0 + k, d, 0 if dev else d
                if toks is not None:
                    drafts[row, :k] = toks[s]
        if done is not None:
            for s in np.flatnonzero(done < k).tolist():   # a confidence stop: the rows past its last kept draft go
                states[s].blocks.truncate(int(rows0[s]) + int(done[s]))
        if dev:
            return DraftBatch(B, k, vocab=self.vocab_size, device_tokens=out["device_ids"],
                              device_logits=out["device_logits"], ready=out["ready"], stream=self.stream)
        flags = out["flags"]
        if flags is not None:
            for s, i in np.argwhere(flags.T).tolist():
                if done is None or i < done[s]:
                    log.warning("grammar mask allowed no token at draft %d (position %d); drafting pad id 0", i,
                                int(positions[s]) + i)
        lp = None
        if lps is not None:
            lp = lps.T.copy()
            if done is not None:
                past = np.arange(k) >= done[:, None]
                toks[past], lp[past] = -1, np.nan
        return DraftBatch(B, k, toks, done, out["logits"], self.vocab_size, lp)

    def _drafts_rows(self) -> np.ndarray:
        """int32 [mirror rows, max_drafts]: row r holds the last drafts of the sequence at mirror row r
        (ProposerState.last_drafts; how many: its LAST counter), grown with the mirror."""
        d, n = self._drafts, self.kv._cols.shape[0]
        if d.shape[0] < n:
            d = self._drafts = np.concatenate([d, np.zeros((n - d.shape[0], self.max_drafts), np.int32)])
        return d

    # -- streams ---------------------------------------------------------------------------------
    def _ordered(self, stream):
        """Order a call's work after `stream` (a caller's stream) and make `stream` wait for it, with events on
        the device (no host wait); nothing when `stream` is None or the proposer's own."""
        return _NO_STREAM if stream is None else self._ordered_after(stream)

    @contextlib.contextmanager
    def _ordered_after(self, stream):
        try:
            caller = self.gpu.external_stream(stream)
        except ConfigError as e:
            raise InputError(str(e)) from None
        if caller is not None and caller == self.stream:
            caller = None
        if caller is not None:
            ev = self.gpu.new_event(timing=False)
            self.gpu.record(ev, caller)
            self.gpu.wait_event(self.stream, ev)
        try:
            yield
        finally:
            if caller is not None:
                done = self.gpu.new_event(timing=False)
                self.gpu.record(done, self.stream)
                self.gpu.wait_event(caller, done)

    # -- the k-step chain over W rows: eager, or captured once per key and replayed ------------------------
    def _pad_rows(self, B: int, W: int, h_elems: int) -> None:
        """Zero the hidden rows past B once, so pad rows always read finite hiddens."""
        if W > B and not self._pad_zeroed:
            self.gpu.memset_async(self.bufs.hidden_in.offset(2 * B * h_elems), 0,
                                  2 * (self.max_batch - B) * h_elems, self.stream)
            self._pad_zeroed = True

    def _stage_inputs(self, toks: list[int] | None, hid, W: int, h_elems: int) -> None:
        """The call's token ids (pad rows: 0; None: staged already, by the compiled bookkeeping) into the pinned
        stage and, for a host hidden, its bf16 rows into the pinned inbox, both of which `_chain` copies from.
        Hidden rows past the batch keep what an earlier call left there: finite (checked), never read back. The
        previous chain must have read both first (a wait for it only)."""
        self._wait_stage()
        self._staging()
        if self._inbox is None:
            self._inbox = self.gpu.alloc_pinned(2 * self.max_batch * self._hmax)
            self._inbox[:] = 0
        if toks is not None:
            ids = self._staging()[:4 * self.max_batch].view(np.int32)
            ids[:len(toks)] = toks
            ids[len(toks):W] = 0
        if hid.host is not None:
            src = np.ascontiguousarray(hid.host).reshape(-1).view(np.uint8)
            self._inbox[:src.size] = src

    def _wait_stage(self) -> None:
        """Wait until the last chain that has not been waited for has read the pinned stage and inbox."""
        if self._stage_done is not None:
            self.gpu.host_wait(self._stage_done)
            self._stage_done = None

    def _batch_host(self) -> BatchHost | None:
        """The compiled bookkeeping of propose and the batch calls (made on first use), or None (host_path numpy,
        or no C compiler)."""
        if self._host is None and self._host_lib is not None:
            self._host = BatchHost(self._host_lib, self)
        return self._host

    def _staging(self) -> np.ndarray:
        """The mapped host twin of the call_in region (made on first use, with the CallCtl after it and the
        outbox)."""
        if self._stage is None:
            n = self.bufs.region_bytes("call_in")
            arr, self._stage_buf = self.gpu.alloc_mapped(n + ops.CTL_BYTES)
            self._stage, self._stage_ptr = arr[:n], self._stage_buf.ptr
            self._ctl, self._ctl_ptr = arr[n:].view(np.uint64), self._stage_ptr.offset(n)
            box, self._outbox_buf = self.gpu.alloc_mapped(4 * (ops.OUTBOX_HEAD + 3 * self.max_drafts * self.max_batch))
            self._outbox, self._outbox_words = self._outbox_buf.ptr, box.view(np.uint32)
        return self._stage

    def _stage_slabs(self, states, rows0, positions, k: int, W: int, idx=None, c=None) -> None:
        """Every step's slabs into the pinned stage; rows past len(states) (up to W) get the pad slab. The chain
        copies from the stage when it runs, so the previous chain must have run first (`_stage_inputs` waited
        for it)."""
        S, B = self.meta_stride, len(states)
        steps = self._steps.get((k, W))
        if steps is None:
            steps = self._steps[k, W] = self._staging()[self._meta_off:self._meta_off + k * W * S].reshape(k, W * S)
        if B == 1:
            one = self._stagers.get((k, W, 1))
            if one is None:
                one = self._stagers[k, W, 1] = OneStager(steps, S)
            one(k, int(positions[0]), int(rows0[0]), states[0].blocks.table_view(), self.kv.block_size)
        elif idx is not None:   # the mirror's tables are read in place (entry 0 of row r at r * width)
            kv, nblocks = self.kv, c[:, NBLOCKS]
            most = int(nblocks.max())
            stager = self._stagers.get((k, W, B))
            if stager is None:
                stager = self._stagers[k, W, B] = SlabStager(steps, k, B, S, kv.block_size)
            self._memo.aim(stager, kv)
            stager(positions, rows0, kv._tables.ravel(), kv.tables_at(idx, nblocks, most), most)
        else:
            tables, lens = self.kv.tables_of([st.blocks for st in states])
            stage_mtp_meta(steps, k, positions, rows0, tables, self.kv.block_size, S, lens=lens)
        if W > B:
            steps[:, B * S:] = np.tile(self._pad_slab, W - B)

    def _logits_at(self, step: int, W: int, keep: bool) -> DevicePtr:
        if not keep:
            return self.bufs.logits
        if self._all_logits is None:
            self._all_logits = self.gpu.alloc(4 * self.max_drafts * self.max_batch * self.vocab_eff)
        return self._all_logits.ptr.offset(4 * W * self.vocab_eff * step)

    def _chain(self, k: int, W: int, masked: bool, want_lp: bool, keep_logits: bool, hidden0=None,
               inbox: int = 0, publish: bool = True) -> None:
        """The k steps over W rows. Per-call values come from mapped host staging (ids, every step's slabs, the
        CallCtl naming device hiddens to fetch) read in by the chain's first kernel, from `inbox` bytes of host
        hiddens it copies, or live in device buffers, so the same launches replay as a graph; eagerly, step 0 may
        read the hiddens at `hidden0` instead. `publish`: the last kernel hands ids, flags and log-probs to the
        outbox."""
        b, S, gpu = self.bufs, self.meta_stride, self.gpu
        fetchable = 2 * W * self._hmax if hidden0 is None or int(hidden0) == int(b.hidden_in) else 0
        ops.call_stage_in(gpu, self._stage_ptr, b.call_in, ops.up16(self._meta_off + k * W * S), self._ctl_ptr,
                          b.hidden_in, b.call_seq, ops.up16(fetchable))   # ids, all k steps' slabs, the hiddens
        if inbox:
            self.gpu.copy_h2d_async(b.hidden_in, self._inbox[:inbox])
        hid = b.hidden_in if hidden0 is None else hidden0
        for i in range(k):
            logits = self._logits_at(i, W, keep_logits)
            ids = b.call_in if i == 0 else b.ids.offset(4 * W * i)
            self._forward(ids, hid, W, self.meta.offset(i * W * S), S, logits)
            self._pick(i, W, logits, masked, want_lp, keep_logits)
            hid = self.carry
        if publish:
            ops.call_publish(gpu, b.ids.offset(4 * W), b.flags if masked else None, b.lp if want_lp else None, k * W,
                             self._outbox, b.call_seq)

    def _replay(self, key, launches) -> None:
        """Replay the graph of `key` on self.stream; the first call per key runs `launches` eagerly (lazy
        workspaces get allocated), the second captures them (on a private stream when self.stream is the
        caller's: that may be the legacy default stream, which cannot capture)."""
        graph = self._graphs.get(key)
        if graph is None:
            if key not in self._warm:
                self._warm.add(key)
                launches()
                return
            graph = self._graphs[key] = self.gpu.capture(launches, self._capture_on())
        self.gpu.replay(graph, self.stream)

    def _capture_on(self):
        if self._own_stream:
            return self.stream
        if self._capture_stream is None:
            self._capture_stream = self.gpu.new_stream(non_blocking=True)
        return self._capture_stream

    def after_verify(self, st: ProposerState, num_accepted: int) -> None:
        """Trim the drafter rows the verifier rejected (`mtp_rows_to_trim`); InputError for a count outside
        [0, drafts of the last propose]."""
        self._live(st)
        a, d = int(num_accepted), st.last_num_drafted
        if not 0 <= a <= d:
            raise InputError(f"num_accepted {a} outside [0, {d}] (drafts of the last propose)")
        self._trim(st, a, d)

    def after_verify_batch(self, states: list[ProposerState], num_accepted) -> None:
        """`after_verify` for every sequence of a batch in one call (states and accepted counts in order); every
        count is checked before any sequence changes (InputError naming the sequence)."""
        idx = self._memo.rows(states, self.kv)
        if idx is None:
            states = state_list(states, "after_verify_batch")
        B = len(states)
        acc = host_ints(num_accepted, self.gpu, "num_accepted", as_array=B >= ARRAY_MIN_BATCH)
        if len(acc) != B:
            raise InputError(f"{B} states but {len(acc)} accepted counts")
        if idx is None and B >= ARRAY_MIN_BATCH:
            idx = mirror_rows(states)
            if idx is not None:
                if len(set(idx.tolist())) != B:
                    idx = None
                else:
                    self._memo.keep(states, idx, self.kv)
        host = self._batch_host() if idx is not None and len(acc) == B else None
        if host is not None:
            done = host.trim(idx, acc)   # None: nothing changed, the NumPy path below names the bad count
            if done is not None:
                cut, rows = done
                for s in cut.tolist():
                    states[s]._cut(int(rows[s]))
                return
        if idx is not None:
            a = np.asarray(acc, dtype=np.int64)
            c = self.kv._cols.take(idx, axis=0)
            d = c[:, DRAFTED]
            if np.count_nonzero(a.view(np.uint64) > d.view(np.uint64)):   # as uint64 a negative count is huge
                idx = None   # the loop below names the first bad sequence
        if idx is None:
            for s, (st, n) in enumerate(zip(states, acc)):
                if st.released:
                    raise InputError(f"sequence {s}: proposer state was freed")
                if not 0 <= n <= st.last_num_drafted:
                    raise InputError(f"sequence {s}: num_accepted {n} outside [0, {st.last_num_drafted}] (drafts "
                                     "of its last propose)")
            if len({id(st) for st in states}) != B:
                raise InputError("the same proposer state appears twice in one after_verify_batch")
            for st, n in zip(states, acc):
                self._trim(st, n)
            return
        rows = c[:, ROWS] - mtp_rows_to_trim_batch(d, a, self.refeed_accepted)
        nb = c[:, NBLOCKS]
        drop = self._blocks_of.take(rows)   # blocks emptied: nb - blocks_for(rows)
        np.subtract(nb, drop, out=drop)
        cut = rows <= c[:, RUN0]   # the last run of positions gone
        cols = self.kv._cols.ravel()   # (put at the rows' flat indices: a scatter cheaper than cols[idx] = c)
        cols.put(self._memo.at(ROWS), rows)
        cols.put(self._memo.at(DRAFTED), self._zeros[:B])
        n = np.count_nonzero(drop)
        if n:
            one = drop == 1
            n1 = np.count_nonzero(one)
            if n1 == B:   # every sequence gives back one block
                self.kv.shrink_one(idx, nb)
            elif n1:
                ones = np.flatnonzero(one)
                self.kv.shrink_one(idx[ones], nb[ones])
            for s in (np.flatnonzero(drop > 1).tolist() if n1 < n else ()):
                states[s].blocks.truncate(int(rows[s]))
        if np.count_nonzero(cut):
            for s in np.flatnonzero(cut).tolist():
                states[s]._cut(int(rows[s]))

    def _trim(self, st: ProposerState, a: int, d: int | None = None) -> None:
        b = st.blocks
        cols, row = b.cache._cols, b.row
        trim = mtp_rows_to_trim(cols.item(row, DRAFTED) if d is None else d, a, self.refeed_accepted)
        if trim:
            n = cols.item(row, ROWS) - trim
            b.truncate(n)
            if n <= cols.item(row, RUN0):   # the last run of positions is gone
                st._cut(n)
        cols[row, DRAFTED] = 0
