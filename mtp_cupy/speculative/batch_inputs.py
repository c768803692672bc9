"""The checks and host-side packing of one propose_batch call: per-sequence tokens, positions, grammar masks
and hiddens, all validated before any state changes (InputError naming the sequence and the problem)."""
from __future__ import annotations

import numpy as np

from ..errors import InputError
from .inputs import check_bitmask, check_position, check_token


def state_list(states, call: str) -> list:
    """The states of a batch call as a list; InputError for anything but a list or tuple of ProposerState."""
    from .proposer import ProposerState
    if not isinstance(states, (list, tuple)) or not all(isinstance(s, ProposerState) for s in states):
        raise InputError(f"{call} takes a list of proposer states (from alloc_state), got {type(states).__name__}"
                         + ("" if not isinstance(states, (list, tuple)) else " holding other objects"))
    return list(states)


def check_sequences(prop, states, tokens, positions, k: int) -> tuple[list[int], list[int]]:
    """(tokens, positions) as ints after checking B, k, every state and the no-hole rule."""
    B = len(states)
    if not 1 <= B <= prop.max_batch:
        raise InputError(f"{B} sequences; this proposer batches 1 to {prop.max_batch} (max_batch at load)")
    if len(tokens) != B or len(positions) != B:
        raise InputError(f"{B} states but {len(tokens)} tokens and {len(positions)} positions")
    if len({id(s) for s in states}) != B:
        raise InputError("the same proposer state appears twice in one batch")
    if not 1 <= k <= prop.max_drafts:
        raise InputError(f"num_drafts {k} outside [1, {prop.max_drafts}] (raise max_drafts at load)")
    if B > 4:   # one array pass over the batch; the loop below runs only to name the first bad sequence
        try:
            t, p = np.asarray(tokens, dtype=np.int64), np.asarray(positions, dtype=np.int64)
            newest = np.fromiter((st.keys[-1] if st.keys else -1 for st in states), np.int64, B)
        except (TypeError, ValueError, OverflowError):
            t = None
        if t is not None and t.shape == p.shape == (B,) and not any(st.released for st in states):
            ok = (t.min() >= 0) & (t.max() < prop.vocab_size) & (p.min() >= 0) & (p.max() + k <= prop.max_seq_len)
            ok &= bool((p > newest).all()) and (not prop.drafter_context or bool((p <= newest + 1).all()))
            if ok:
                return t.tolist(), p.tolist()
    toks, poss = [], []
    for s, (st, t, p) in enumerate(zip(states, tokens, positions)):
        prop._live(st)
        toks.append(check_token(t, prop.vocab_size, "token" if B == 1 else f"sequence {s}: token"))
        p = check_position(p, prop.max_seq_len)
        if p + k > prop.max_seq_len:
            raise InputError(f"{k} drafts from position {p} run past max_seq_len {prop.max_seq_len}")
        newest = st.keys[-1] if st.keys else -1
        if p <= newest:
            raise InputError(f"sequence {s}: position {p} is not after its newest drafter row ({newest}); "
                             "call after_verify first")
        if p > newest + 1 and prop.drafter_context:
            held = f"rows at positions {st.keys[0]}..{newest}" if st.keys else "no rows"
            raise InputError(f"sequence {s}: position {p} would leave a hole in its drafter KV ({held}); "
                             f"prefill positions {newest + 1}..{p - 1} first (or load with drafter_context=False)")
        poss.append(p)
    return toks, poss


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
