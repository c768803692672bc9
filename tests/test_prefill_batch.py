"""prefill_batch against one-at-a-time prefill (the reference: the same proposer's `prefill`, sequence by
sequence): the KV rows each sequence holds (read back by its own slots: block ids may differ), its positions,
and the drafts that follow, bit for bit on the NumPy device; the serving loop's catch-up (propose_batch,
after_verify_batch, one catch-up row per sequence, propose_batch again); the typed errors, each leaving every
sequence and the pool as they were."""
import numpy as np
import pytest

import mtp_cupy
from batch_util import FAMILIES, ckpt, hidden, rows_digest
from helpers import check_pool
from mtp_cupy.errors import CapacityError, InputError


def load(fam, **kw):
    return mtp_cupy.load_proposer(ckpt(fam), gpu=mtp_cupy.device("ref"), max_seq_len=96, max_batch=8, **kw)


def snapshot(prop, sts):
    return ([(list(st.keys), st.blocks.rows, list(st.blocks.table), st.last_num_drafted) for st in sts],
            prop.kv.free_count, [rows_digest(prop, st) for st in sts])


def start(rng, fam, lens):
    """Twin proposers, each with B sequences of the given lengths prefilled alike (some empty)."""
    a, b = load(fam), load(fam)
    sa, sb = [a.alloc_state() for _ in lens], [b.alloc_state() for _ in lens]
    for s, n in enumerate(lens):
        if n:
            toks, hs = rng.integers(0, a.vocab_size, n + 1), hidden(rng, a, n)
            a.prefill(sa[s], toks, hs)
            b.prefill(sb[s], toks, hs)
    return a, b, sa, sb


@pytest.mark.parametrize("fam", FAMILIES)
def test_prefill_batch_equals_one_at_a_time(fam, rng):
    """Ragged row counts (zeros among them) over ragged sequences, twice: the rows, positions and blocks held
    match prefill's, and a propose_batch after it drafts the same ids and logits."""
    B = int(rng.integers(2, 8))
    lens = [int(n) if rng.random() < 0.8 else 0 for n in rng.integers(1, 30, B)]
    a, b, sa, sb = start(rng, fam, lens)
    for _ in range(2):
        n = [int(x) if rng.random() < 0.8 else 0 for x in rng.integers(1, 20, B)]
        N = sum(n)
        toks, hs = rng.integers(0, a.vocab_size, N), hidden(rng, a, N)
        assert a.prefill_batch(sa, toks, hs, n) == N
        j = 0
        for s in range(B):
            if n[s]:   # prefill takes the token before the first row too: any id (it pairs with no row)
                b.prefill(sb[s], np.concatenate([[0], toks[j:j + n[s]]]), hs[j:j + n[s]])
            j += n[s]
        for x, y in zip(sa, sb):
            assert x.keys == y.keys and x.blocks.nblocks == y.blocks.nblocks
            assert rows_digest(a, x) == rows_digest(b, y)
        check_pool(a, sa)
    live = [s for s in range(B) if sa[s].blocks.rows]
    toks, hs = [int(t) for t in rng.integers(0, a.vocab_size, len(live))], hidden(rng, a, len(live))
    pos = [sa[s].next_position for s in live]
    ra = a.propose_batch([sa[s] for s in live], toks, hs, pos, 2, return_logits=True)
    rb = b.propose_batch([sb[s] for s in live], toks, hs, pos, 2, return_logits=True)
    assert np.array_equal(ra.tokens, rb.tokens) and np.array_equal(ra.logits, rb.logits)


@pytest.mark.parametrize("fam", ["deepseek_v3", "qwen3_next"])
@pytest.mark.parametrize("B", [3, 8])
def test_catch_up_loop(fam, B, rng):
    """A serving loop's steps: propose_batch, a ragged verify (after_verify_batch), then one prefill_batch of the
    row the trim rule dropped for every sequence (the target's hidden at its last accepted position), then the
    next propose_batch; against the same loop catching up with prefill one sequence at a time."""
    lens = [int(n) for n in rng.integers(4, 30, B)]
    a, b, sa, sb = start(rng, fam, lens)
    pos, V = list(lens), a.vocab_size
    toks = [int(t) for t in rng.integers(0, V, B)]
    for _ in range(4):
        hs = hidden(rng, a, B)
        ra = a.propose_batch(sa, toks, hs, pos, 3)
        rb = b.propose_batch(sb, toks, hs, pos, 3)
        assert np.array_equal(ra.tokens, rb.tokens)
        acc = [int(x) for x in rng.integers(0, 4, B)]
        a.after_verify_batch(sa, acc)
        b.after_verify_batch(sb, acc)
        # the dropped row: position pos + acc (its hidden from the target), paired with the token after it
        gap = [p + x for p, x in zip(pos, acc)]
        assert [st.next_position for st in sa] == gap
        row_tok, row_h = rng.integers(0, V, B), hidden(rng, a, B)
        assert a.prefill_batch(sa, row_tok, row_h, [1] * B) == B
        for s in range(B):
            b.prefill(sb[s], [0, int(row_tok[s])], row_h[s:s + 1], start_position=gap[s])
        for x, y in zip(sa, sb):
            assert x.keys == y.keys and rows_digest(a, x) == rows_digest(b, y)
        pos, toks = [g + 1 for g in gap], [int(t) for t in row_tok]
        check_pool(a, sa)


def test_without_drafter_context_rows_may_skip_ahead(rng):
    """Loaded without drafter context a sequence may start its rows past the next position: a new run."""
    a2 = load("deepseek_v3", drafter_context=False)
    sts = [a2.alloc_state() for _ in range(3)]
    a2.prefill(sts[0], rng.integers(0, a2.vocab_size, 6), hidden(rng, a2, 5))
    a2.prefill(sts[2], rng.integers(0, a2.vocab_size, 8), hidden(rng, a2, 7))
    n, starts = [2, 3, 1], [9, 40, 7]
    a2.prefill_batch(sts, rng.integers(0, a2.vocab_size, 6), hidden(rng, a2, 6), n, starts)
    assert sts[0].keys == [0, 1, 2, 3, 4, 9, 10] and sts[1].keys == [40, 41, 42]
    assert sts[2].keys == list(range(8)) and sts[0].next_position == 11
    check_pool(a2, sts)
    with pytest.raises(InputError, match="sequence 1: prefill at position 40 would leave a hole or overwrite"):
        a2.prefill_batch(sts, [1], hidden(rng, a2, 1), [0, 1, 0], [0, 40, 0])   # an overwrite is still refused


def test_errors_change_nothing(rng):
    """Every bad call raises a typed error naming the problem (and the sequence) before any sequence changes."""
    a, _, sts, _ = start(rng, "deepseek_v3", [5, 9, 0])
    V, nxt = a.vocab_size, [5, 9, 0]
    h = hidden(rng, a, 3)
    bad = {
        "sequence 1: prefill at position 11": (InputError, lambda: a.prefill_batch(sts, [1] * 3, h, [1, 1, 1],
                                                                                    [5, 11, 0])),
        "sequence 0: prefill at position 3": (InputError, lambda: a.prefill_batch(sts, [1] * 3, h, [1, 1, 1],
                                                                                   [3, 9, 0])),
        "sequence 1: rows up to position 96 are past": (InputError, lambda: a.prefill_batch(
            sts, [1] * 89, h, [0, 88, 1])),
        "out of range": (InputError, lambda: a.prefill_batch(sts, [1, V, 1], h, [1, 1, 1])),
        "3 rows but 2 tokens": (InputError, lambda: a.prefill_batch(sts, [1, 1], h, [1, 1, 1])),
        "num_rows -1 is negative": (InputError, lambda: a.prefill_batch(sts, [1] * 3, h, [2, 2, -1])),
        "3 states but 2 row counts": (InputError, lambda: a.prefill_batch(sts, [1] * 3, h, [2, 1])),
        "appears twice": (InputError, lambda: a.prefill_batch([sts[0], sts[0]], [1, 1], h[:2], [1, 1])),
        "hiddens has shape": (InputError, lambda: a.prefill_batch(sts, [1] * 3, h[:2], [1, 1, 1])),
        "NaN or inf": (InputError, lambda: a.prefill_batch(
            sts, [1] * 3, np.where(np.arange(3)[:, None] == 2, np.nan, h), [1, 1, 1])),
        "list of proposer states": (InputError, lambda: a.prefill_batch(sts[0], [1], h[:1], [1])),
    }
    before = snapshot(a, sts)
    for what, (err, call) in bad.items():
        with pytest.raises(err, match=what):
            call()
        assert snapshot(a, sts) == before, what
    # a full pool: the first sequences would fit, the last not; nothing is kept
    while a.kv.free_count > 4:   # other sequences hold all but 4 blocks
        rows = min(96, (a.kv.free_count - 4) * a.kv.block_size)
        a.prefill(a.alloc_state(), rng.integers(0, V, rows + 1), hidden(rng, a, rows))
    before = snapshot(a, sts)
    n = [16, 16, 48]   # one block more for sequences 0 and 1 (they fit), three for sequence 2: 5 > 4
    with pytest.raises(CapacityError):
        a.prefill_batch(sts, rng.integers(0, V, sum(n)), hidden(rng, a, sum(n)), n)
    assert snapshot(a, sts) == before
    # a failure while the rows are written (a launch, say) gives back the blocks the call took: sequence 0's 5
    # rows and 12 more need a second block
    before = snapshot(a, sts)

    def fail(*args):
        raise RuntimeError("launch failed")
    a._write_rows = fail
    with pytest.raises(RuntimeError, match="launch failed"):
        a.prefill_batch(sts, rng.integers(0, V, 12), hidden(rng, a, 12), [12, 0, 0])
    del a._write_rows
    assert snapshot(a, sts) == before
    a.free_state(sts[1])
    with pytest.raises(InputError, match="sequence 1: proposer state was freed"):
        a.prefill_batch(sts, [1] * 3, h, [1, 1, 1])
    assert a.prefill_batch([sts[0], sts[2]], [1, 2], h[:2], [1, 1]) == 2 and sts[2].keys == [0]
    assert [st.next_position for st in (sts[0], sts[2])] == [nxt[0] + 1, 1]


@pytest.mark.parametrize("dtype", [np.int32, np.uint16, np.int64])
def test_integer_inputs_of_any_dtype(dtype, rng):
    """Ids, counts and positions as integer arrays of any width (a torch int32 tensor reads back as int32), odd
    lengths included: the same rows as Python ints."""
    a, b, sa, sb = start(rng, "qwen3_next", [3, 4, 6])
    n, N = [2, 0, 3], 5
    toks, hs = rng.integers(0, a.vocab_size, N), hidden(rng, a, N)
    a.prefill_batch(sa, toks.astype(dtype), hs, np.array(n, dtype), np.array([3, 4, 6], dtype))
    b.prefill_batch(sb, [int(t) for t in toks], hs, n)
    for x, y in zip(sa, sb):
        assert x.keys == y.keys and rows_digest(a, x) == rows_digest(b, y)
    st = a.alloc_state()
    a.prefill(st, rng.integers(0, a.vocab_size, 4).astype(dtype), hidden(rng, a, 3))   # 4 ids: an even count
    a.prefill(st, rng.integers(0, a.vocab_size, 2).astype(dtype), hidden(rng, a, 1))   # 2 ids
    a.prefill(st, rng.integers(0, a.vocab_size, 4).astype(dtype)[:3], hidden(rng, a, 2))   # 3: odd, strided
    assert st.keys == list(range(6))
    with pytest.raises(InputError, match="tokens: 18446744073709551615 does not fit int64"):
        a.prefill_batch([st], np.array([2**64 - 1], np.uint64), hidden(rng, a, 1), [1])
