"""MtpProposerBase: the mechanics every family shares, so a family writes only its math.

A family subclass sets `family`, `Options` (its options dataclass), `config_class` and `load_weights`
(gpu, path, cfg, options, comm) -> weights, and implements
    _forward(ids, hidden, m, meta, meta_stride, logits)   one draft step for m sequences, one row each: embed
        the i32 token ids at `ids`, combine them with the bf16 hiddens at `hidden`, run the block (row s's KV
        row and RoPE position come from its metadata slab at meta + s * meta_stride), write f32 logits
        [m, vocab_eff] at `logits`, and leave the carried hiddens [m, ...] at `self.carry`.
    _write_rows(st, tokens_dev, hiddens, positions, slots, row_base, n)   prefill / catch-up: n drafter KV
        rows pairing embed(tokens[r+1]) with hiddens[r] at the u32 positions / i64 slots given (no attention).
It sets `self.carry` after super().__init__ and may override `_hidden_shapes` (V4 accepts [D] and [hc, D]),
`_pick` (GLM's cross-rank argmax) and `_graph_variant`.

Batches. `propose_batch` drafts for B sequences in one chain of k steps over B rows (`propose` is a batch of
one). Every sequence has its own slab (its position, slot, seq_len and block table), staged for all k steps
in pinned host memory and copied in by the chain itself. A row's arithmetic does not depend on the rows
beside it (batch-invariant launch geometry), so a sequence drafts the same whatever batch it is in.

CUDA graphs: the chain is captured once per (k, bucket, masked, outputs, variant) and replayed, with the
bucket the smallest of BUCKETS (capped at max_batch) that holds B. The bucket's spare rows are pad
sequences: token 0, the hidden left in their row, one KV row in a block of their own (taken at load),
never read back. A family that sets `graph_safe = True` promises that `_forward` and `_pick` launch only
device work on fixed buffers and read every per-call value from device memory.

State changes happen only after every check passes; a failure inside the chain rolls every row back."""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from .. import ops
from ..cache import PagedKvCache, SeqBlocks
from ..errors import CapacityError, ConfigError, InputError
from ..runtime import slab as slab_spec
from ..runtime.arena import ForwardBuffers, pack_mtp_attn_meta, stage_mtp_meta
from ..runtime.dtypes import BF16
from ..runtime.ptr import NULL, DevicePtr
from ..weights.config import ModelConfig, load_config
from .batch_inputs import batch_masks, check_sequences
from .inputs import check_position, check_token, hidden_to_device
from .options import ProposerOptions
from .proposer import DraftResult, ProposerState, mtp_rows_to_trim

log = logging.getLogger("mtp_cupy")

BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class MtpProposerBase:
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
        regions = {"ids": 4 * B * (k + 1), "hidden_in": 2 * hmax * B, "logits": 4 * self.vocab_eff * B,
                   "flags": 4 * B * k, "lp": 4 * B * k, "mask": 4 * words * B * k, "meta": B * self.meta_stride,
                   "prefill_ids": 4 * (self.max_prefill_rows + 1),
                   "prefill_pos": 4 * self.max_prefill_rows, "prefill_slots": 8 * self.max_prefill_rows,
                   "prefill_hidden": 2 * self.hidden_size * self.max_prefill_rows}
        regions.update(extra_regions or {})
        self.bufs = ForwardBuffers(gpu, regions)
        self.meta = self.bufs.meta
        # pinned host staging of every step's slabs [max_drafts, max_batch * stride], made on first use
        self._stage = None
        self._all_logits = None   # f32 [max_drafts, max_batch, vocab_eff], made on the first return_logits
        # the pad sequences' one KV row, in a block of their own, so a full pool never fails a bucketed call
        self._pad = SeqBlocks(kv)
        self._pad.reserve(1)
        raw = pack_mtp_attn_meta(0, self._pad.slot(0), 1, self._pad.table, self.meta_stride)
        self._pad_slab = np.frombuffer(raw.ljust(self.meta_stride, b"\0"), np.uint8)
        self._pad_zeroed = False
        graphs = o.cuda_graphs
        self.cuda_graphs = bool(gpu.is_cuda) if graphs is None else bool(graphs) and gpu.is_cuda
        # blocking: ordered after work the caller left on the default stream (e.g. the target's hidden)
        self.stream = gpu.new_stream(non_blocking=False)
        self._graphs: dict = {}
        self._warm: set = set()
        log.info("%s drafter: KV pool of %d blocks holds %d sequences of %d rows", self.family, kv.num_blocks,
                 self.sequences_that_fit(), self.max_seq_len)

    def bucket(self, B: int) -> int:
        """The graph width a batch of B sequences runs at: the smallest of BUCKETS that holds it (<= max_batch)."""
        return next((b for b in BUCKETS if B <= b <= self.max_batch), self.max_batch)

    @property
    def pool_blocks(self) -> int:
        """KV blocks the sequences share (the pool less the pad sequences' block)."""
        return self.kv.num_blocks - len(self._pad.table)

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

    def _write_rows(self, st, tokens_dev: DevicePtr, hiddens: DevicePtr, positions: DevicePtr,
                    slots: DevicePtr, row_base: int, n: int) -> None:
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
        return ProposerState(blocks=SeqBlocks(self.kv))

    def free_state(self, st: ProposerState) -> None:
        """Give the sequence's KV blocks back; calling it again does nothing."""
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
        """Write drafter rows pairing embed(tokens[r+1]) with hiddens[r] at positions start_position + r.

        Parameters
        ----------
        st : ProposerState
        tokens : sequence of int, n + 1 token ids
        hiddens : array [n, D] float32 or bfloat16 (V4 also [n, hc, D]), or a device pointer to n bf16 rows
        start_position : int, optional
            Must be the next position after the newest row (the default): no hole, no overwrite.

        Returns
        -------
        int : rows written (n).

        Raises InputError (bad ids, shapes, positions) or CapacityError (KV pool or max_seq_len); the state is
        unchanged on failure."""
        self._live(st)
        toks = np.asarray(tokens, dtype=np.int64).reshape(-1)
        n = toks.size - 1
        if n < 1:
            raise InputError("prefill needs at least two tokens (one row)")
        for t in toks:
            check_token(t, self.vocab_size)
        nxt = st.keys[-1] + 1 if st.keys else 0
        start = nxt if start_position is None else int(start_position)
        if start != nxt and (self.drafter_context or start < nxt):
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
    def _batch_hidden_shape(self, hiddens, B: int) -> tuple[int, ...]:
        """The per-sequence hidden shape of B hiddens (a device pointer holds the first of _hidden_shapes)."""
        if isinstance(hiddens, (DevicePtr, int)) and not isinstance(hiddens, (bool, np.ndarray)):
            return self._hidden_shapes()[0]
        shape = tuple(np.shape(hiddens))
        for s in self._hidden_shapes():
            if shape == (B,) + s:
                return s
        raise InputError(f"hiddens has shape {shape}; expected one of {[(B,) + s for s in self._hidden_shapes()]}")

    def propose(self, st: ProposerState, token: int, hidden, position: int, num_drafts: int,
                grammar_bitmask=None, return_logits: bool = False, min_logprob: float | None = None) -> DraftResult:
        """Draft `num_drafts` tokens for one sequence: `propose_batch` of one (see there)."""
        if not (isinstance(hidden, (DevicePtr, int)) and not isinstance(hidden, (bool, np.ndarray))):
            h = np.asarray(hidden)
            if not any(h.shape in (s, (1,) + s) for s in self._hidden_shapes()):
                raise InputError(f"hidden has shape {h.shape}; expected one of {self._hidden_shapes()}")
            hidden = h.reshape((1,) + next(s for s in self._hidden_shapes() if int(np.prod(s)) == h.size))
        masks = None if grammar_bitmask is None else [grammar_bitmask]
        return self.propose_batch([st], [token], hidden, [position], num_drafts, masks, return_logits,
                                  min_logprob)[0]

    def propose_batch(self, states: list[ProposerState], tokens, hiddens, positions, num_drafts: int,
                      grammar_bitmasks=None, return_logits: bool = False,
                      min_logprob: float | None = None) -> list[DraftResult]:
        """Draft `num_drafts` tokens for each of B sequences in one chain of batched steps.

        Parameters
        ----------
        states : list of ProposerState, B distinct live sequences (1 <= B <= max_batch)
        tokens : B ints; tokens[s] is what the target emitted after position positions[s]
        hiddens : array [B, D] (V4 also [B, hc, D]) float32 or bfloat16, or a device pointer to B bf16 rows:
            the target's hidden at positions[s]
        positions : B ints; each must be the next position after the sequence's newest drafter row
        num_drafts : int, 1 <= k <= max_drafts
        grammar_bitmasks : list of B masks (int32 [words] or [k, words], None = unconstrained), optional
        return_logits : bool; DraftResult.logits is then float32 [drafts, vocab] on the host
        min_logprob : float, optional; a sequence stops after the first draft whose top-1 log-prob is below it

        Returns
        -------
        list of DraftResult, one per sequence, in order.

        Raises InputError (bad ids, shapes, a hole in a sequence's rows, ...) or CapacityError (KV pool,
        max_seq_len); no sequence changes on failure."""
        k = int(num_drafts)
        toks, poss = check_sequences(self, states, tokens, positions, k)
        B = len(states)
        if min_logprob is not None and grammar_bitmasks is not None:
            raise InputError("min_logprob is measured by the plain argmax; it cannot be combined with "
                             "grammar bitmasks")
        hshape = self._batch_hidden_shape(hiddens, B)
        graphed = self.cuda_graphs and self.graph_safe
        W = self.bucket(B) if graphed else B
        masks = batch_masks(grammar_bitmasks, B, W, self.vocab_size, k)
        rows0 = [st.blocks.rows for st in states]
        reserved = []
        try:
            for st, r0 in zip(states, rows0):
                self._reserve(st, r0 + k)
                reserved.append(st)
        except Exception:
            for st, r0 in zip(reserved, rows0):
                st.blocks.truncate(r0)
            raise
        gpu, want_lp = self.gpu, min_logprob is not None
        try:
            with gpu.using(self.stream):
                self._use_hidden_shape(hshape)
                hidden_to_device(gpu, hiddens, (B,) + hshape, self.bufs.hidden_in)
                self._pad_rows(B, W, int(np.prod(hshape)))
                gpu.copy_h2d_async(self.bufs.ids, np.array(toks + [0] * (W - B), dtype=np.int32))
                if masks is not None:
                    gpu.copy_h2d_async(self.bufs.mask, masks)
                self._stage_slabs(states, rows0, poss, k, W)
                key = (k, W, masks is not None, want_lp, return_logits, self._graph_variant())
                run = lambda: self._chain(k, W, masks is not None, want_lp, return_logits)  # noqa: E731
                if graphed:
                    self._replay(key, run)
                else:
                    run()
                ids = gpu.read(self.bufs.ids.offset(4 * W), np.int32, (k, W))[:, :B]
                flags = gpu.read(self.bufs.flags, np.int32, (k, W))[:, :B] if masks is not None else None
                lps = gpu.read(self.bufs.lp, np.float32, (k, W))[:, :B] if want_lp else None
                logits = gpu.read(self._all_logits.ptr, np.float32, (k, W, self.vocab_eff))[:, :B] \
                    if return_logits else None
        except Exception:
            for st, r0 in zip(states, rows0):
                st.blocks.truncate(r0)
            raise
        return [self._finish(st, s, r0, p, k, ids, flags, lps, logits, min_logprob)
                for s, (st, r0, p) in enumerate(zip(states, rows0, poss))]

    def _finish(self, st, s: int, r0: int, position: int, k: int, ids, flags, lps, logits, min_logprob):
        done = k
        if lps is not None:
            low = np.flatnonzero(lps[:, s] < min_logprob)
            done = int(low[0]) + 1 if low.size else k
        st.blocks.rows = r0 + k
        st.blocks.truncate(r0 + done)
        toks = ids[:done, s].tolist()
        if flags is not None:
            for i in np.flatnonzero(flags[:done, s]):
                log.warning("grammar mask allowed no token at draft %d (position %d); drafting pad id 0",
                            i, position + i)
        st.keys.extend(range(position, position + done))
        st.last_num_drafted, st.last_pair_key, st.last_drafts = done, position + done - 1, toks
        lg = None
        if logits is not None:
            lg = np.ascontiguousarray(logits[:done, s])
            if self.vocab_eff < self.vocab_size:
                lg = np.pad(lg, ((0, 0), (0, self.vocab_size - self.vocab_eff)), constant_values=-np.inf)
        return DraftResult(toks, lg, lps[:done, s].tolist() if lps is not None else None)

    # -- the k-step chain over W rows: eager, or captured once per key and replayed ------------------------
    def _pad_rows(self, B: int, W: int, h_elems: int) -> None:
        """Zero the hidden rows past B once, so pad rows always read finite hiddens."""
        if W > B and not self._pad_zeroed:
            self.gpu.memset_async(self.bufs.hidden_in.offset(2 * B * h_elems), 0,
                                  2 * (self.max_batch - B) * h_elems, self.stream)
            self._pad_zeroed = True

    def _stage_slabs(self, states, rows0, positions, k: int, W: int) -> None:
        """Every step's slabs into the pinned stage; rows past len(states) (up to W) get the pad slab."""
        if self._stage is None:
            self._stage = self.gpu.alloc_pinned(self.max_drafts * self.max_batch * self.meta_stride)
            self._stage = self._stage.reshape(self.max_drafts, -1)
        S, B = self.meta_stride, len(states)
        stage_mtp_meta(self._stage, k, positions, rows0, [st.blocks.table for st in states], self.kv.block_size, S)
        if W > B:
            self._stage[:k, B * S:W * S] = np.tile(self._pad_slab, W - B)

    def _logits_at(self, step: int, W: int, keep: bool) -> DevicePtr:
        if not keep:
            return self.bufs.logits
        if self._all_logits is None:
            self._all_logits = self.gpu.alloc(4 * self.max_drafts * self.max_batch * self.vocab_eff)
        return self._all_logits.ptr.offset(4 * W * self.vocab_eff * step)

    def _chain(self, k: int, W: int, masked: bool, want_lp: bool, keep_logits: bool) -> None:
        """The k steps over W rows. Per-call values live in device buffers (ids, hidden_in, the staged slabs),
        so the same launches replay as a graph."""
        b, hid = self.bufs, self.bufs.hidden_in
        for i in range(k):
            self.gpu.copy_h2d_async(self.meta, self._stage[i, :W * self.meta_stride])
            logits = self._logits_at(i, W, keep_logits)
            self._forward(b.ids.offset(4 * W * i), hid, W, self.meta, self.meta_stride, logits)
            self._pick(i, W, logits, masked, want_lp, keep_logits)
            hid = self.carry

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
        """Trim the drafter rows the verifier rejected (`mtp_rows_to_trim`); InputError for a count outside
        [0, drafts of the last propose]."""
        self._live(st)
        a = int(num_accepted)
        if not 0 <= a <= st.last_num_drafted:
            raise InputError(f"num_accepted {a} outside [0, {st.last_num_drafted}] (drafts of the last propose)")
        trim = mtp_rows_to_trim(st.last_num_drafted, a, self.refeed_accepted)
        st.blocks.truncate(st.blocks.rows - trim)
        del st.keys[len(st.keys) - trim:]
        st.last_pair_key = st.keys[-1] if st.keys else None
        st.last_num_drafted = 0
