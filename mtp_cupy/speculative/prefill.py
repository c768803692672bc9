"""Writing drafter rows from the target's hiddens without drafting: a prompt's prefill, and the catch-up a serving
loop runs every step (the rows `after_verify` dropped, which a propose at the next position needs: no hole).

`prefill` writes one sequence's rows; `prefill_batch` the rows of B sequences in one pass, each row carrying its
own position and cache slot, so the families' `_write_rows` (embed, combine with the hidden, write the KV row: no
attention) runs once per chunk of `max_prefill_rows` rows for the whole batch."""
from __future__ import annotations

import numpy as np

from .. import ops
from ..cache.paged import ROWS, SEQ_COLUMNS
from ..errors import InputError
from ..runtime.dtypes import BF16
from ..runtime.ptr import DevicePtr
from .batch_inputs import mirror_rows, state_list
from .inputs import check_position, host_ints, is_device_pointer, take_hidden
from .proposer import OFF, ProposerState


class Prefill:
    """MtpProposerBase's prefill calls (a mixin: it uses the base's buffers, stream, checks and `_write_rows`)."""

    def prefill(self, st: ProposerState, tokens, hiddens, start_position: int | None = None, stream=None) -> int:
        """Write drafter rows pairing embed(tokens[r+1]) with hiddens[r] at positions start_position + r.

        Parameters
        ----------
        st : ProposerState
        tokens : n + 1 token ids (ints, an array or a DLPack tensor)
        hiddens : [n, D] (V4 also [n, hc, D]) float32, float16 or bfloat16: a NumPy array, any DLPack tensor (a
            C-contiguous bf16 CUDA one is read in place), or a device pointer to n bf16 rows
        start_position : int, optional
            Must be the next position after the newest row (the default): no hole, no overwrite.
        stream : optional; a caller's stream the call is ordered after (and that waits for the call's work)

        Returns
        -------
        int : rows written (n).

        Raises InputError (bad ids, shapes, positions) or CapacityError (KV pool or max_seq_len); the state is
        unchanged on failure."""
        self._live(st)
        with self._ordered(stream):
            toks = host_ints(tokens, self.gpu, "tokens", self.stream, as_array=True)
            n = toks.size - 1
            if n < 1:
                raise InputError("prefill needs at least two tokens (one row)")
            _check_ids(toks, self.vocab_size, "tokens")
            nxt = st.next_position
            start = nxt if start_position is None else int(start_position)
            if start != nxt and (self.drafter_context or start < nxt):
                raise InputError(f"prefill at position {start} would leave a hole or overwrite: the next drafter "
                                 f"position is {nxt}")
            check_position(start + n - 1, self.max_seq_len)
            h, keep = self._prefill_hiddens(hiddens, n)
            rows0 = st.blocks.rows
            self._reserve(st, rows0 + n)
            try:
                pos = np.arange(start, start + n, dtype=np.uint32)
                self._write_chunks(toks.astype(np.int32), h, pos, st.blocks.slots(rows0, n), n)
            except Exception:
                st.blocks.truncate(rows0)
                raise
            del keep   # converted copies go back to the pool in stream order
            st.blocks.rows = rows0 + n
            st._extend(rows0, start)
        return n

    def prefill_batch(self, states: list[ProposerState], tokens, hiddens, num_rows, start_positions=None,
                      stream=None) -> int:
        """Write drafter rows for B sequences in one pass: a serving loop's catch-up (after `after_verify_batch`,
        the rows the trim rule dropped, from the target's hiddens: one row per sequence with the default rule)
        or a batch of prompts.

        Parameters
        ----------
        states : list of B distinct live ProposerState
        tokens : N ids (N = sum(num_rows)), sequence by sequence: row r's token is the one that follows its
            position (what `prefill` takes as tokens[r + 1])
        hiddens : [N, D] (V4 also [N, hc, D]) in the same order, as `prefill` takes them (NumPy, DLPack, or a
            device pointer to N bf16 rows)
        num_rows : B ints >= 0, the rows of each sequence
        start_positions : B ints, optional; sequence s's rows take positions start_positions[s] + 0, 1, ... Each
            must be its sequence's next position (the default), or a later one for a proposer loaded without
            drafter context.
        stream : optional; a caller's stream the call is ordered after (and that waits for the call's work)

        Returns
        -------
        int : rows written (N).

        Raises InputError (naming the sequence: a hole, an overwrite, a position past max_seq_len; bad ids,
        counts or shapes) or CapacityError (KV pool, max_seq_len); no sequence changes on failure."""
        gpu, kv = self.gpu, self.kv
        idx = self._memo.rows(states, kv)   # a serving loop passes the batch it proposes for: checked already
        known = idx is not None
        if idx is None:
            states = state_list(states, "prefill_batch")
            for s, st in enumerate(states):
                if st.released:
                    raise InputError(f"sequence {s}: proposer state was freed")
            idx = mirror_rows(states)
            if len(set(idx.tolist())) != len(states):
                raise InputError("the same proposer state appears twice in one prefill_batch")
        B = len(states)
        with self._ordered(stream):
            n = host_ints(num_rows, gpu, "num_rows", self.stream, as_array=True)
            if len(n) != B:
                raise InputError(f"{B} states but {len(n)} row counts")
            toks = host_ints(tokens, gpu, "tokens", self.stream, as_array=True)
            given = None if start_positions is None else \
                host_ints(start_positions, gpu, "start_positions", self.stream, as_array=True)
            h = keep = None
            # a remembered batch with a token each: the catch-up, compiled (it checks that every count is one)
            if known and len(toks) == B and self._batch_host() is not None:
                try:
                    h, keep = self._prefill_hiddens(hiddens, B)
                except InputError:   # the NumPy path below names the first problem: ids before hiddens
                    pass
                if h is not None and self._catch_up(states, idx, toks, n, h, given):
                    return B
            if np.count_nonzero(n < 0):
                raise InputError(f"sequence {int(np.argmax(n < 0))}: num_rows {int(n[n < 0][0])} is negative")
            N = int(n.sum())
            if len(toks) != N:
                raise InputError(f"{N} rows but {len(toks)} tokens (one per row: the token after its position)")
            _check_ids(toks, self.vocab_size, "tokens")
            c = kv._cols.take(idx, axis=0)
            nxt = c[:, OFF] + c[:, ROWS]
            starts = nxt if given is None else given
            if len(starts) != B:
                raise InputError(f"{B} states but {len(starts)} start positions")
            some = n > 0   # a sequence without rows is left alone, whatever its start
            bad = None if starts is nxt else some & ((starts != nxt) if self.drafter_context else (starts < nxt))
            if bad is not None and np.count_nonzero(bad):
                s = int(np.argmax(bad))
                raise InputError(f"sequence {s}: prefill at position {int(starts[s])} would leave a hole or "
                                 f"overwrite: its next drafter position is {int(nxt[s])}")
            past = some & (starts + n > self.max_seq_len)
            if np.count_nonzero(past):
                s = int(np.argmax(past))
                raise InputError(f"sequence {s}: rows up to position {int(starts[s] + n[s] - 1)} are past the sized "
                                 f"context (max_seq_len {self.max_seq_len})")
            if N == 0:
                return 0
            if h is None:
                h, keep = self._prefill_hiddens(hiddens, N)
            # room for every sequence's rows, all or none (rows0 + n <= starts + n <= max_seq_len: checked)
            rows0 = self._reserve_rows(states, n, idx, c)
            try:
                bs, tables = kv.block_size, kv._tables
                if N == B and not np.count_nonzero(n != 1):   # a catch-up: one row each
                    rows, at, pos = rows0, idx, starts
                else:   # row j of the call is row rows0[s] + i of sequence s (i < n[s]) at position starts[s] + i
                    local = np.arange(N, dtype=np.int64) - np.repeat(np.cumsum(n) - n, n)
                    rows, at, pos = np.repeat(rows0, n) + local, np.repeat(idx, n), np.repeat(starts, n) + local
                blocks = tables.ravel().take(at * tables.shape[1] + rows // bs)
                ids = np.empty(N + 1, np.int32)
                ids[0], ids[1:] = 0, toks   # (ids[0]: never read; _write_rows pairs row j with ids[j + 1])
                self._write_chunks(ids, h, pos.astype(np.uint32), blocks.astype(np.int64) * bs + rows % bs, N)
            except Exception:   # the rows counters are unchanged: truncating to them gives the new blocks back
                for st, r0 in zip(states, rows0.tolist()):
                    st.blocks.truncate(r0)
                raise
            del keep
            kv._cols.ravel().put(idx * SEQ_COLUMNS + ROWS, rows0 + n)
            # a sequence's first rows, or (without drafter context) rows past its next position: a new run
            new_run = some & (rows0 == 0 if starts is nxt else (rows0 == 0) | (starts != nxt))
            if np.count_nonzero(new_run):
                for s in np.flatnonzero(new_run).tolist():
                    states[s]._extend(int(rows0[s]), int(starts[s]))
        return N

    def _catch_up(self, states, idx, toks, n, h, starts) -> bool:
        """prefill_batch of one row per sequence (row counts `n`, all ones; `h` what `_prefill_hiddens` gave;
        `starts` int64 [B] or None: the next positions) through the compiled bookkeeping (batch_host.py): True
        when done, False when it declined (nothing changed: the NumPy path then names the problem or takes the
        case)."""
        done = None
        if starts is None or len(starts) == len(states):
            self._wait_prefill_stage()
            done = self._batch_host().catch_up(idx, toks, starts, n)
        if done is None:
            return False
        new_run, rows0, starts = done
        try:
            self._send_prefill(h, 0, len(states))
        except Exception:   # the row counts went one up: truncating to rows0 gives a new block back too
            for st, r0 in zip(states, rows0.tolist()):
                st.blocks.truncate(r0)
            raise
        for s in new_run.tolist():
            states[s]._extend(int(rows0[s]), int(starts[s]))
        return True

    def _write_chunks(self, ids: np.ndarray, h, pos: np.ndarray, slots: np.ndarray, n: int) -> None:
        """n rows at the u32 positions / i64 cache slots given, row j pairing embed(ids[j + 1]) with hidden row j
        (`h`: host bf16 rows, or a device pointer to them), in passes of max_prefill_rows rows. A pass's ids,
        positions and slots go in with one copy from pinned staging (a host hidden with one more)."""
        _, st_slots, st_pos, st_ids = self._prefill_staging()
        for c0 in range(0, n, self.max_prefill_rows):
            c = min(self.max_prefill_rows, n - c0)
            self._wait_prefill_stage()
            st_slots[:c], st_pos[:c], st_ids[:c + 1] = slots[c0:c0 + c], pos[c0:c0 + c], ids[c0:c0 + c + 1]
            self._send_prefill(h, c0, c)

    def _wait_prefill_stage(self) -> None:
        """Wait until the last pass's copy has read the prefill stage."""
        if self._prefill_copied is not None:
            self.gpu.host_wait(self._prefill_copied)

    def _send_prefill(self, h, c0: int, c: int) -> None:
        """One pass of `_write_chunks`: the staged ids, positions and slots of c rows copied in, and those rows
        written from hidden rows c0.. of `h`. Device hiddens of at most max_batch rows (a serving loop's
        catch-up) go through a graph per row count when graphs are on: a graph reads fixed addresses, so its first
        kernel reads the stage in and fetches the rows into prefill_hidden (a copy call first when they are not
        16-byte aligned), and the row writes replay with it as one launch."""
        b, gpu, E = self.bufs, self.gpu, self._hidden_row_elems()
        with gpu.using(self.stream):
            if self.cuda_graphs and self.graph_safe and not isinstance(h, np.ndarray) and c <= self.max_batch:
                src, nbytes = int(h) + 2 * E * c0, 2 * E * c
                fetch = ops.fetch_words(src, nbytes)
                if not fetch:
                    gpu.copy_d2d_async(b.prefill_hidden, DevicePtr(src), nbytes)
                ops.write_ctl(self._prefill_ctl, 0, fetch, src if fetch else 0)
                self._replay(("rows", c, E), lambda: self._rows_pass(b.prefill_hidden, c, mapped=True))
                self._record_prefill_copied()   # after the graph, which reads the stage in
            elif isinstance(h, np.ndarray):   # pageable: staged by the driver before the call returns
                gpu.copy_h2d_async(b.prefill_hidden, h[c0:c0 + c])
                self._rows_pass(b.prefill_hidden, c, record=True)
            elif (int(h) + 2 * E * c0) % 16:   # kernels read 16-byte chunks: rows off that alignment are copied
                gpu.copy_d2d_async(b.prefill_hidden, DevicePtr(int(h) + 2 * E * c0), 2 * E * c)
                self._rows_pass(b.prefill_hidden, c, record=True)
            else:
                self._rows_pass(DevicePtr(int(h) + 2 * E * c0), c, record=True)

    def _rows_pass(self, hp: DevicePtr, c: int, record: bool = False, mapped: bool = False) -> None:
        """The staged ids, positions and slots copied in, then c rows written from the hiddens at `hp`. `record`
        (eager passes): the stage's event right after the copy, so the next pass may restage while these rows
        are written; a graph's caller records it after the replay. `mapped` (a graphed pass): call_stage_in
        reads the stage in and fetches the rows its CallCtl names into `hp` (c rows at most)."""
        b, P = self.bufs, self.max_prefill_rows
        if mapped:
            at = self._prefill_ctl_at   # the stage's bytes, rounded up to 16
            ops.call_stage_in(self.gpu, self._prefill_ptr, b.prefill_in, at, self._prefill_ptr.offset(at), hp,
                              b.call_seq.offset(4), ops.up16(2 * self._hidden_row_elems() * c))
        else:
            self.gpu.copy_h2d_async(b.prefill_in, self._prefill_stage[0])
        if record:
            self._record_prefill_copied()
        self._write_rows(b.prefill_in.offset(12 * P), hp, b.prefill_in.offset(8 * P), b.prefill_in, c)

    def _record_prefill_copied(self) -> None:
        """Record, on the stream, the event the next pass waits for before it rewrites the prefill stage."""
        if self._prefill_copied is None:
            self._prefill_copied = self.gpu.new_event(timing=False)
        self.gpu.record(self._prefill_copied, self.stream)

    def _prefill_staging(self):
        """The mapped twin of the prefill_in region [slots i64 P | positions u32 P | ids i32 P + 1] and its three
        views (made on first use; a graphed pass's CallCtl follows it)."""
        if self._prefill_stage is None:
            P = self.max_prefill_rows
            at = self._prefill_ctl_at = ops.up16(16 * P + 4)
            arr, self._prefill_buf = self.gpu.alloc_mapped(at + ops.CTL_BYTES)
            self._prefill_ptr = self._prefill_buf.ptr
            stage, self._prefill_ctl = arr[:16 * P + 4], arr[at:].view(np.uint64)
            self._prefill_stage = (stage, stage[:8 * P].view(np.int64), stage[8 * P:12 * P].view(np.uint32),
                                   stage[12 * P:].view(np.int32))
        return self._prefill_stage

    def _prefill_hiddens(self, hiddens, n: int):
        """(what `_host_hiddens` takes, what keeps converted device rows alive): a bare pointer as it is; a
        DLPack / NumPy input checked by `take_hidden`. A device tensor in the form a pointer carries
        (`_hidden_shapes()[0]`) is read in place; one in another accepted form is read back to the host."""
        if is_device_pointer(hiddens):
            return self._host_hiddens(hiddens, n), None
        shapes = self._hidden_shapes()
        hid = take_hidden(self.gpu, hiddens, n, shapes, "hiddens", self.stream,
                          check_device=self.options.check_device_finite)
        if hid.host is not None:
            return self._host_hiddens(hid.host, n), hid
        if hid.row_shape != shapes[0]:
            return self._host_hiddens(self.gpu.read(hid.ptr, "bf16", hid.shape, stream=self.stream), n), hid
        return self._host_hiddens(hid.ptr, n), hid

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


def _check_ids(toks: np.ndarray, vocab: int, what: str) -> None:
    """InputError naming the first id outside [0, vocab) (toks: int64)."""
    bad = toks.view(np.uint64) >= vocab   # as uint64 a negative id is huge: one comparison checks both ends
    if np.count_nonzero(bad):
        raise InputError(f"{what}: id {int(toks[np.argmax(bad)])} is out of range [0, {vocab})")
