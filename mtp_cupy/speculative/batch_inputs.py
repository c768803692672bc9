"""The checks and host-side packing of one propose_batch call: per-sequence tokens, positions, grammar masks
and hiddens, all validated before any state changes (InputError naming the sequence and the problem)."""
from __future__ import annotations

import operator

import numpy as np

from ..cache.paged import ROWS, SEQ_COLUMNS
from ..errors import InputError
from .inputs import check_bitmask, check_position, check_token
from .proposer import OFF, ProposerState


def state_list(states, call: str) -> list:
    """The states of a batch call as a list; InputError for anything but a list or tuple of ProposerState."""
    if not isinstance(states, (list, tuple)) or not all(issubclass(t, ProposerState) for t in set(map(type, states))):
        raise InputError(f"{call} takes a list of proposer states (from alloc_state), got {type(states).__name__}"
                         + ("" if not isinstance(states, (list, tuple)) else " holding other objects"))
    return list(states)


ARRAY_MIN_BATCH = 5   # from this many sequences a batch call checks and updates its states as arrays


def mirror_rows(states) -> np.ndarray | None:
    """The states' rows in their KV cache's mirror (cache.paged: where their counters live), or None when one
    has none (a freed state)."""
    try:
        return np.fromiter(map(_MIRROR_ROW, states), np.intp, len(states))
    except TypeError:
        return None


_MIRROR_ROW = operator.attrgetter("blocks.row")


class BatchMemo:
    """The last wide batch whose states passed the per-state checks (ProposerStates, live, distinct), with their
    mirror rows: while the same states come back in the same order (list equality, identity first) and no
    mirror row of the cache changed hands since (`PagedKvCache.row_epoch`: a state allocated or freed), a batch
    call reuses those rows instead of checking and gathering B states again."""
    __slots__ = ("states", "idx", "epoch", "_aimed", "_at")

    def __init__(self):
        self.states, self.idx, self.epoch, self._aimed, self._at = None, None, -1, None, {}

    def rows(self, states, kv) -> np.ndarray | None:
        """The remembered mirror rows when `states` (a list) is the remembered batch at the cache's epoch."""
        if kv.row_epoch != self.epoch or type(states) is not list:
            return None
        try:
            return self.idx if states == self.states else None
        except Exception:   # an element whose __eq__ raises (an array, say): not the remembered batch
            return None

    def keep(self, states: list, idx: np.ndarray, kv) -> None:
        """Remember `states` (checked) and their mirror rows `idx` at the cache's current epoch."""
        idx.flags.writeable = False   # PagedKvCache keeps flat indices of a read-only rows array
        self.states, self.idx, self.epoch, self._aimed, self._at = list(states), idx, kv.row_epoch, None, {}

    def at(self, column: int) -> np.ndarray:
        """Where the remembered rows' counter `column` sits in the cache's flat `_cols` (for put / take)."""
        f = self._at.get(column)
        if f is None:
            f = self._at[column] = self.idx * SEQ_COLUMNS + column
        return f

    def aim(self, stager, kv) -> None:
        """Point `stager` (arena.SlabStager) at the remembered rows' tables in the cache's flat mirror, unless it
        already is (the same stager, rows and table width as last time)."""
        key = (stager, kv._tables.shape[1])
        if self._aimed != key:
            stager.set_first(self.idx * key[1])
            self._aimed = key


def check_sequences(prop, states, tokens, positions, k: int, idx=None):
    """(tokens, positions, mirror rows, counters) after checking B, k, every state and the no-hole rule.

    From ARRAY_MIN_BATCH sequences the checks are array passes over the batch: tokens and positions come back as
    int64 arrays, with the states' mirror rows and a copy of their counters (int64 [B, SEQ_COLUMNS]) that the
    call updates and scatters back. `idx`: the batch's mirror rows when its states are known to be live and
    distinct (BatchMemo). The per-sequence loop runs to name the first bad sequence, and for smaller batches,
    where it is faster (mirror rows and counters None). `positions` None: each sequence's next position."""
    B = len(states)
    if not 1 <= B <= prop.max_batch:
        raise InputError(f"{B} sequences; this proposer batches 1 to {prop.max_batch} (max_batch at load)")
    if len(tokens) != B or (positions is not None and len(positions) != B):
        raise InputError(f"{B} states but {len(tokens)} tokens and "
                         f"{'next' if positions is None else len(positions)} positions")
    if not 1 <= k <= prop.max_drafts:
        raise InputError(f"num_drafts {k} outside [1, {prop.max_drafts}] (raise max_drafts at load)")
    if idx is None and B >= ARRAY_MIN_BATCH:
        idx = mirror_rows(states)
        if idx is not None and len(set(idx.tolist())) != B:
            idx = None
    if idx is not None:
        try:
            t = np.asarray(tokens, dtype=np.int64)
            p = None if positions is None else np.asarray(positions, dtype=np.int64)
        except (TypeError, ValueError, OverflowError):
            t = None
        if t is not None and t.shape == (B,) and (p is None or p.shape == (B,)):
            c = prop.kv._cols.take(idx, axis=0)   # (take: a row gather a few times cheaper than c[idx])
            nxt = c[:, OFF] + c[:, ROWS]           # next_position of each sequence (>= 0)
            if p is None:
                p = nxt
            # as uint64 a negative id is huge: one comparison checks both ends; p >= nxt >= 0 needs no lower
            # bound (count_nonzero: the cheapest any() on a small array)
            ok = not np.count_nonzero(t.view(np.uint64) >= prop.vocab_size) and not np.count_nonzero(
                p > prop.max_seq_len - k)
            if ok and (p is nxt or not np.count_nonzero(p != nxt if prop.drafter_context else p < nxt)):
                return t, p, idx, c
    elif 1 < B < ARRAY_MIN_BATCH and len({id(s) for s in states}) != B:
        raise InputError("the same proposer state appears twice in one batch")
    toks, poss = [], []
    for s, (st, t, p) in enumerate(zip(states, tokens, [None] * B if positions is None else positions)):
        prop._live(st)
        toks.append(check_token(t, prop.vocab_size, "token" if B == 1 else f"sequence {s}: token"))
        p = check_position(st.next_position if p is None else p, prop.max_seq_len)
        if p + k > prop.max_seq_len:
            raise InputError(f"{k} drafts from position {p} run past max_seq_len {prop.max_seq_len}")
        newest = st.newest_position
        if p <= newest:
            raise InputError(f"sequence {s}: position {p} is not after its newest drafter row ({newest}); "
                             "call after_verify first")
        if p > newest + 1 and prop.drafter_context:
            held = f"rows at positions {st.runs[0][1]}..{newest}" if st.runs else "no rows"
            raise InputError(f"sequence {s}: position {p} would leave a hole in its drafter KV ({held}); "
                             f"prefill positions {newest + 1}..{p - 1} first (or load with drafter_context=False)")
        poss.append(p)
    if B >= ARRAY_MIN_BATCH and len({id(s) for s in states}) != B:
        raise InputError("the same proposer state appears twice in one batch")
    return toks, poss, None, None


def sequence_masks(bitmask, vocab: int, k: int) -> np.ndarray | None:
    """One sequence's grammar masks as int32 [k, words]: a [words] mask applies to every draft."""
    if bitmask is None:
        return None
    m = np.asarray(bitmask)
    rows = [m] * k if m.ndim == 1 else list(m)
    if len(rows) < k:
        raise InputError(f"grammar bitmask has {len(rows)} rows for {k} drafts")
    return np.stack([check_bitmask(r, vocab) for r in rows[:k]]).reshape(k, (vocab + 31) // 32)


def batch_masks(grammar_bitmasks, B: int, W: int, vocab: int, k: int) -> np.ndarray | None:
    """int32 [k, W, words] (every token allowed where a sequence, or a pad row, has no mask), or None."""
    if grammar_bitmasks is None:
        return None
    if len(grammar_bitmasks) != B:
        raise InputError(f"{len(grammar_bitmasks)} grammar bitmasks for {B} sequences")
    out = np.full((k, W, (vocab + 31) // 32), -1, dtype=np.int32)
    for s, m in enumerate(grammar_bitmasks):
        rows = sequence_masks(m, vocab, k)
        if rows is not None:
            out[:, s] = rows
    return out
