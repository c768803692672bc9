"""Batched propose: k draft steps for up to `max_batch` sequences at once, each step one pass over the
weights with m = #sequences (the batched GEMV path). Each sequence gets what proposing it alone gives (the
same drafts, rows and state; logits up to the accumulation order of the batched kernels).

A family using it implements `_forward(ids, hidden, m, meta, meta_stride, logits)` (m sequences, one row
each, per-sequence metadata slab `s` at `meta + s * meta_stride`, carried hidden left at `self.carry`)
and calls `_batch_regions(...)` for its ForwardBuffers. Slabs live at `scratch + MTP_META_OFFSET + s * stride`
when they fit the scratch, else in a region of their own; every step's slabs are staged in pinned host memory
and copied in by the chain itself.

CUDA graphs (a graph_safe family with cuda_graphs on): the k-step chain over B sequences is captured once per
(k, bucket, masked) with bucket the smallest of BUCKETS (capped at max_batch) holding B, and replayed. The
bucket's spare rows are pad sequences: token 0, the hidden left in their row, one KV row at a block of their
own (allocated on first use, written over by every pad row), never read back. A call that asks for logits
or a confidence stop runs eagerly (both read the device mid-chain)."""
from __future__ import annotations

import logging

import numpy as np

from .. import ops
from ..cache.paged import SeqBlocks
from ..errors import InputError
from ..runtime import slab
from ..runtime.arena import DEFAULT_SCRATCH, MTP_META_OFFSET, pack_mtp_attn_meta, stage_mtp_meta
from ..runtime.ptr import DevicePtr
from ..speculative.inputs import check_position, check_token, hidden_to_device
from ..speculative.proposer import DraftResult, ProposerState

log = logging.getLogger("mtp_cupy")

BUCKETS = (1, 2, 4, 8, 16, 32)


class BatchProposeMixin:
    def _batch_regions(self, max_seq_len: int, max_batch: int, max_drafts: int, vocab: int, vocab_eff: int,
                       hidden: int) -> dict[str, int]:
        """The regions propose_batch uses, for the family's ForwardBuffers (extra_regions)."""
        B, k, words = max_batch, max_drafts, (vocab + 31) // 32
        self.meta_stride = slab.stride(max_seq_len)
        self._meta_in_scratch = B * self.meta_stride <= DEFAULT_SCRATCH - MTP_META_OFFSET
        self._bstage = self._pad = self._pad_slab = None      # made on first use (pinned stage; pad sequences)
        return {"b_ids": 4 * B * (k + 1), "b_hidden": 2 * B * hidden, "b_logits": 4 * B * vocab_eff,
                "b_lp": 4 * B * k, "b_flags": 4 * B * k, "b_mask": 4 * B * k * words,
                **({} if self._meta_in_scratch else {"batch_meta": B * self.meta_stride})}

    @property
    def batch_meta(self) -> DevicePtr:
        return self.bufs.mtp_meta if self._meta_in_scratch else self.bufs.batch_meta

    def _batch_hidden(self, hiddens, B: int) -> None:
        D = self.hidden_size
        if isinstance(hiddens, np.ndarray) and hiddens.shape != (B, D):
            raise InputError(f"hiddens has shape {hiddens.shape}; expected ({B}, {D}) (one per sequence)")
        hidden_to_device(self.gpu, hiddens, (B, D), self.bufs.b_hidden)

    def _check_batch(self, states, tokens, positions, k: int):
        B = len(states)
        if not 1 <= B <= self.max_batch:
            raise InputError(f"{B} sequences; this proposer batches 1 to {self.max_batch} (max_batch at load)")
        if len(tokens) != B or len(positions) != B:
            raise InputError(f"{B} states but {len(tokens)} tokens and {len(positions)} positions")
        if len({id(s) for s in states}) != B:
            raise InputError("the same proposer state appears twice in one batch")
        if not 1 <= k <= self.max_drafts:
            raise InputError(f"num_drafts {k} outside [1, {self.max_drafts}] (raise max_drafts at load)")
        toks, poss = [], []
        for st, t, p in zip(states, tokens, positions):
            self._live(st)
            toks.append(check_token(t, self.vocab_size))
            poss.append(check_position(p, self.max_seq_len))
            if poss[-1] + k > self.max_seq_len:
                raise InputError(f"{k} drafts from position {poss[-1]} run past max_seq_len {self.max_seq_len}")
            if st.keys and poss[-1] <= st.keys[-1]:
                raise InputError(f"position {poss[-1]} is not after the newest drafter row ({st.keys[-1]}); "
                                 "call after_verify first")
        return toks, poss

    def _batch_masks(self, grammar_bitmasks, B: int, k: int):
        if grammar_bitmasks is None:
            return None
        if len(grammar_bitmasks) != B:
            raise InputError(f"{len(grammar_bitmasks)} grammar bitmasks for {B} sequences")
        words = (self.vocab_size + 31) // 32
        out = np.full((k, B, words), -1, dtype=np.int32)        # all allowed where a sequence has no mask
        for s, m in enumerate(grammar_bitmasks):
            rows = self._masks(m, k)
            if rows is not None:
                out[:, s] = rows
        return out

    def _bucket(self, B: int) -> int:
        return next((b for b in BUCKETS if B <= b <= self.max_batch), self.max_batch)

    def _stage_slabs(self, states, rows0, positions, k: int, width: int) -> None:
        """Every step's slabs into the pinned stage [max_drafts, max_batch * stride]; rows past len(states)
        (up to `width`) get the pad sequence's slab."""
        if self._bstage is None:
            self._bstage = self.gpu.alloc_pinned(self.max_drafts * self.max_batch * self.meta_stride)
            self._bstage = self._bstage.reshape(self.max_drafts, -1)
        S = self.meta_stride
        stage_mtp_meta(self._bstage, k, positions, rows0, [st.blocks.table for st in states], self.kv.block_size, S)
        if width > len(states):
            self._bstage[:k, len(states) * S:width * S] = np.tile(self._pad_slab, width - len(states))

    def _pad_rows(self, B: int) -> None:
        """The pad sequences' KV block and slab, and the hidden rows past this call's B zeroed (once: rows
        hold finite hiddens from then on)."""
        if self._pad is not None:
            return
        pad = SeqBlocks(self.kv)
        pad.reserve(1)                     # a full pool raises CapacityError here, before any state changed
        raw = pack_mtp_attn_meta(0, pad.slot(0), 1, pad.table, self.meta_stride).ljust(self.meta_stride, b"\0")
        self._pad, self._pad_slab = pad, np.frombuffer(raw, np.uint8)
        D = self.hidden_size
        self.gpu.memset_async(self.bufs.b_hidden.offset(2 * B * D), 0, 2 * (self.max_batch - B) * D, self.stream)

    def _batch_chain(self, k: int, width: int, words: int | None, want_lp: bool = False, each_step=None) -> int:
        """The k steps over `width` rows from the staged slabs (top-1 log-probs too with want_lp);
        each_step(i) -> True stops after step i. Returns the steps run."""
        b, hid = self.bufs, self.bufs.b_hidden
        for i in range(k):
            self.gpu.copy_h2d_async(self.batch_meta, self._bstage[i, :width * self.meta_stride])
            self._forward(b.b_ids.offset(4 * width * i), hid, width, self.batch_meta, self.meta_stride, b.b_logits)
            self._pick_batch(i, width, words, want_lp)
            hid = self.carry
            if each_step is not None and each_step(i):
                return i + 1
        return k

    def _pick_batch(self, i: int, B: int, words: int | None, want_lp: bool) -> None:
        b, V = self.bufs, self.vocab_eff
        out_id = b.b_ids.offset(4 * B * (i + 1))
        if words is not None:
            ops.argmax_bitmask(self.gpu, b.b_logits, V, b.b_mask.offset(4 * words * B * i), out_id,
                               b.b_flags.offset(4 * B * i), rows=B, row_stride=V, mask_row_words=words)
        else:
            ops.argmax(self.gpu, b.b_logits, V, out_id, rows=B, row_stride=V,
                       out_lp=b.b_lp.offset(4 * B * i) if want_lp else DevicePtr(0))

    def propose_batch(self, states: list[ProposerState], tokens, hiddens, positions, num_drafts: int,
                      grammar_bitmasks=None, return_logits: bool = False,
                      min_logprob: float | None = None) -> list[DraftResult]:
        """`propose` for several sequences: sequence s pairs embed(tokens[s]) with hiddens[s] (host [B, D]
        float32/bfloat16, or a device pointer to B bf16 rows) at positions[s]. A sequence whose top-1
        log-prob falls below `min_logprob` stops there; the others go on."""
        k = int(num_drafts)
        toks, poss = self._check_batch(states, tokens, positions, k)
        B = len(states)
        if min_logprob is not None and grammar_bitmasks is not None:
            raise InputError("min_logprob is measured by the plain argmax; it cannot be combined with "
                             "grammar bitmasks")
        masks = self._batch_masks(grammar_bitmasks, B, k)
        self._batch_hidden(hiddens, B)
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
        gpu, V = self.gpu, self.vocab_eff
        graphed = self.cuda_graphs and self.graph_safe and not return_logits and min_logprob is None
        W = self._bucket(B) if graphed else B
        done, lps, logits_host = [k] * B, [[] for _ in range(B)], []
        words = None if masks is None else masks.shape[-1]

        def each_step(i: int) -> bool:
            if return_logits:
                logits_host.append(gpu.read(self.bufs.b_logits, np.float32, (B, V)))
            if min_logprob is None:
                return False
            lp = gpu.read(self.bufs.b_lp.offset(4 * B * i), np.float32, B)
            for s in range(B):
                if done[s] > i:
                    lps[s].append(float(lp[s]))
                    if lp[s] < min_logprob and i + 1 < k:
                        done[s] = i + 1
            return all(d <= i + 1 for d in done)
        try:
            with gpu.using(self.stream):
                if W > B:
                    self._pad_rows(B)
                gpu.copy_h2d_async(self.bufs.b_ids, np.array(toks + [0] * (W - B), dtype=np.int32))
                if masks is not None:
                    padded = np.full((k, W, words), -1, dtype=np.int32)
                    padded[:, :B] = masks
                    gpu.copy_h2d_async(self.bufs.b_mask, padded)
                self._stage_slabs(states, rows0, poss, k, W)
                if graphed:
                    self._replay(("batch", k, W, words is not None), lambda: self._batch_chain(k, W, words))
                    steps = k
                else:
                    steps = self._batch_chain(k, W, words, min_logprob is not None, each_step)
                ids = gpu.read(self.bufs.b_ids.offset(4 * W), np.int32, (steps, W))[:, :B]
                flags = gpu.read(self.bufs.b_flags, np.int32, (steps, W))[:, :B] if masks is not None else None
        except Exception:
            for st, r0 in zip(states, rows0):
                st.blocks.truncate(r0)
            raise
        return [self._finish(st, s, r0, p, done[s], steps, ids, flags, logits_host, lps[s])
                for s, (st, r0, p) in enumerate(zip(states, rows0, poss))]

    def _finish(self, st, s: int, r0: int, position: int, done: int, steps: int, ids, flags, logits_host,
                lps) -> DraftResult:
        st.blocks.rows = r0 + steps
        st.blocks.truncate(r0 + done)
        toks = ids[:done, s].tolist()
        if flags is not None:
            for i in np.flatnonzero(flags[:done, s]):
                log.warning("grammar mask allowed no token at draft %d (position %d); drafting pad id 0",
                            i, position + i)
        st.keys.extend(range(position, position + done))
        st.last_num_drafted, st.last_pair_key, st.last_drafts = done, position + done - 1, toks
        logits = None
        if logits_host:
            logits = np.stack([lg[s] for lg in logits_host[:done]])
            if self.vocab_eff < self.vocab_size:
                logits = np.pad(logits, ((0, 0), (0, self.vocab_size - self.vocab_eff)), constant_values=-np.inf)
        return DraftResult(toks, logits, lps or None)
