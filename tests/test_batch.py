"""propose_batch for every family against one-at-a-time propose (the reference here is the same proposer on a
batch of one: a sequence must draft the same whatever batch it is in), continuous-batching semantics (ragged
lengths, ragged accepted counts, sequences joining and leaving, per-sequence masks and confidence stops),
and the typed errors of a batch (a hole, a full pool) leaving every sequence as it was."""
import numpy as np
import pytest

import mtp_cupy
from batch_util import FAMILIES, ckpt, hidden, prefill_alike, verify_round, watch_ties
from helpers import check_pool
from mtp_cupy.errors import CapacityError, InputError
from mtp_cupy.speculative import DraftResult


def load(fam, gpu=None, **kw):
    return mtp_cupy.load_proposer(ckpt(fam), gpu=gpu or mtp_cupy.device("ref"), max_seq_len=96,
                                  max_batch=kw.pop("max_batch", 8), **kw)


def random_masks(rng, prop, B):
    """None for some sequences, a random allowed set for others, an all-zero mask (pad drafts) for one."""
    words = (prop.vocab_size + 31) // 32
    out = []
    for s in range(B):
        r = rng.random()
        out.append(None if r < 0.4 else np.zeros(words, np.int32) if r < 0.5 else
                   rng.integers(-2**31, 2**31 - 1, words, dtype=np.int64).astype(np.int32))
    return out


def same(got, want, bit_equal: bool) -> None:
    assert got.tokens == want.tokens
    if want.logits is not None:
        fin = np.isfinite(want.logits)
        assert np.array_equal(np.isfinite(got.logits), fin)
        if bit_equal:
            assert np.array_equal(got.logits[fin], want.logits[fin])
        else:
            d = np.linalg.norm(got.logits[fin] - want.logits[fin]) / np.linalg.norm(want.logits[fin])
            assert d <= 1e-6, d
    assert (got.logprobs is None) == (want.logprobs is None)
    if want.logprobs is not None:
        assert got.logprobs == want.logprobs


@pytest.mark.parametrize("fam", FAMILIES)
@pytest.mark.parametrize("B", [1, 3, 8])
def test_batched_equals_one_at_a_time(fam, B, rng):
    """Three rounds of propose_batch against propose on twin states: drafts, logits (bit for bit on the NumPy
    device: every kernel's per-row arithmetic is independent of the other rows), log-probs and state."""
    batched, single = load(fam), load(fam)
    streams = fam == "deepseek_v4" and rng.random() < 0.5
    lens = [int(n) for n in rng.integers(1, 30, B)]
    sa, sb = prefill_alike(rng, (batched, single), lens, streams)
    pos, toks = list(lens), [int(t) for t in rng.integers(0, batched.vocab_size, B)]
    for rnd in range(3):
        hs = hidden(rng, batched, B, streams)
        k = int(rng.integers(1, 4))
        mode = rnd % 3
        kw = {}
        masks = random_masks(rng, batched, B) if mode == 1 else None
        if mode == 2:
            kw["min_logprob"] = float(rng.uniform(-6, -1))
        got = batched.propose_batch(sa, toks, hs, pos, k, grammar_bitmasks=masks, return_logits=True, **kw)
        for s in range(B):
            want = single.propose(sb[s], toks[s], hs[s], pos[s], k, return_logits=True,
                                  grammar_bitmask=None if masks is None else masks[s], **kw)
            same(got[s], want, bit_equal=True)
            assert (sa[s].keys, sa[s].blocks.rows, sa[s].last_num_drafted) == \
                (sb[s].keys, sb[s].blocks.rows, sb[s].last_num_drafted)
            if masks is not None and masks[s] is not None and not masks[s].any():
                assert got[s].tokens == [0] * k        # a mask that allows nothing drafts the pad id
        pos, toks = verify_round(rng, (batched, single), (sa, sb), got, streams)
        check_pool(batched, sa)


@pytest.mark.parametrize("fam", FAMILIES)
def test_sequences_join_and_leave(fam, rng):
    """A sequence's drafts do not depend on which sequences share its batch: the same sequence proposed beside
    different neighbours (which join, leave and change order between calls) drafts the same."""
    prop, alone = load(fam), load(fam)
    lens = [int(n) for n in rng.integers(2, 20, 5)]
    states, solo = prefill_alike(rng, (prop, alone), lens)
    live = [0, 1, 2]
    pos = {s: lens[s] for s in range(5)}
    for rnd in range(4):
        if rnd == 1:
            live = [2, 3, 0]                       # 1 leaves, 3 joins, order changes
            prop.free_state(states[1])
            alone.free_state(solo[1])
        if rnd == 2:
            live = [4, 2]
        toks = [int(t) for t in rng.integers(0, prop.vocab_size, len(live))]
        hs = hidden(rng, prop, len(live))
        got = prop.propose_batch([states[s] for s in live], toks, hs, [pos[s] for s in live], 2, return_logits=True)
        for j, s in enumerate(live):
            same(got[j], alone.propose(solo[s], toks[j], hs[j], pos[s], 2, return_logits=True), bit_equal=True)
        nxt, _ = verify_round(rng, (prop, alone), ([states[s] for s in live], [solo[s] for s in live]), got)
        pos.update(zip(live, nxt))
    check_pool(prop, [states[s] for s in range(5) if not states[s].released])


@pytest.mark.parametrize("fam", FAMILIES)
def test_hole_and_full_pool_errors_change_nothing(fam, rng):
    prop = load(fam, max_sequences=1)                      # 6 blocks: one sequence of 96 rows
    sts = prefill_alike(rng, (prop,), [20, 30, 30])[0]      # 2 + 2 + 2 blocks: the pool is full
    snap = lambda: [(list(s.keys), s.blocks.rows, list(s.blocks.table)) for s in sts]  # noqa: E731
    before, free = snap(), prop.kv.free_count
    hs = hidden(rng, prop, 3)
    with pytest.raises(InputError, match="sequence 1: position 31 would leave a hole"):
        prop.propose_batch(sts, [1, 2, 3], hs, [20, 31, 30], 2)
    with pytest.raises(CapacityError):          # sequence 0 fits in its block, 1 and 2 need new ones
        prop.propose_batch(sts, [1, 2, 3], hs, [20, 30, 30], 3)
    with pytest.raises(InputError, match="twice"):
        prop.propose_batch([sts[0], sts[0]], [1, 2], hs[:2], [20, 20], 1)
    with pytest.raises(InputError, match="shape"):
        prop.propose_batch(sts, [1, 2, 3], hs[:2], [20, 30, 30], 1)
    with pytest.raises(InputError, match="out of range"):
        prop.propose_batch(sts, [1, prop.vocab_size, 3], hs, [20, 30, 30], 1)
    assert snap() == before and prop.kv.free_count == free
    res = prop.propose_batch(sts[:1], [1], hs[:1], [20], 3)     # still works: 20..22 fit block 1 of seq 0
    assert len(res[0].tokens) == 3


@pytest.mark.parametrize("fam", FAMILIES)
def test_without_drafter_context_holes_are_allowed(fam, rng):
    prop = load(fam, drafter_context=False)
    st = prefill_alike(rng, (prop,), [10])[0][0]
    res = prop.propose(st, 1, hidden(rng, prop), 17, 2)
    assert len(res.tokens) == 2 and st.keys == list(range(10)) + [17, 18]


def test_pool_sizing_option_and_report():
    prop = load("deepseek_v3", max_batch=4)
    assert prop.sequences_that_fit() == 4 and prop.pool_blocks == 4 * 6
    assert load("qwen3_next", max_batch=2, max_sequences=5).sequences_that_fit() == 5


def test_wide_batch_errors_name_the_sequence(rng):
    """Past four sequences the checks run as array operations; each problem still names its sequence and
    leaves every sequence as it was."""
    prop = load("qwen3_next")
    lens = [int(n) for n in rng.integers(5, 30, 8)]
    sts = prefill_alike(rng, (prop,), lens)[0]
    snap = lambda: [(list(s.keys), s.blocks.rows, list(s.blocks.table)) for s in sts]  # noqa: E731
    before, free = snap(), prop.kv.free_count
    hs, toks, bad = hidden(rng, prop, 8), [1] * 8, int(rng.integers(0, 8))
    pos = list(lens)
    cases = [(dict(pos={bad: lens[bad] + 1}), f"sequence {bad}: position {lens[bad] + 1} would leave a hole"),
             (dict(pos={bad: lens[bad] - 1}), f"sequence {bad}: position {lens[bad] - 1} is not after"),
             (dict(tok={bad: prop.vocab_size}), f"sequence {bad}: token id {prop.vocab_size} is out of range"),
             (dict(tok={bad: -1}), f"sequence {bad}: token id -1 is out of range"),
             (dict(pos={bad: prop.max_seq_len - 1}), "past max_seq_len"),
             (dict(tok={bad: 1 << 64}), "outside the 64-bit integer range"),
             (dict(pos={bad: -(1 << 70)}), "outside the 64-bit integer range")]
    for change, msg in cases:
        p, t = list(pos), list(toks)
        for s, v in change.get("pos", {}).items():
            p[s] = v
        for s, v in change.get("tok", {}).items():
            t[s] = v
        with pytest.raises(InputError, match=msg):
            prop.propose_batch(sts, t, hs, p, 2)
        assert snap() == before and prop.kv.free_count == free
    prop.free_state(sts[bad])
    with pytest.raises(InputError, match="freed"):
        prop.propose_batch(sts, toks, hs, pos, 2)
    live = [s for i, s in enumerate(sts) if i != bad]
    res = prop.propose_batch(live, toks[:7], hs[:7], [p for i, p in enumerate(pos) if i != bad], 2)
    assert all(len(r.tokens) == 2 for r in res)
    check_pool(prop, live)


@pytest.mark.parametrize("fam", ["deepseek_v3", "qwen3_next"])
@pytest.mark.parametrize("B", [3, 6, 8])   # below and from ARRAY_MIN_BATCH: the per-sequence and the array path
def test_after_verify_batch_equals_one_at_a_time(fam, B, rng):
    """after_verify_batch trims each sequence as after_verify does; a bad count, a repeated or freed state, or
    a length mismatch is an InputError that names the problem and changes no sequence."""
    a, b = load(fam), load(fam)
    lens = [int(n) for n in rng.integers(10, 40, B)]
    sa, sb = prefill_alike(rng, (a, b), lens)
    toks, hs = [int(t) for t in rng.integers(0, a.vocab_size, B)], hidden(rng, a, B)
    ra, rb = a.propose_batch(sa, toks, hs, lens, 3), b.propose_batch(sb, toks, hs, lens, 3)
    assert [r.tokens for r in ra] == [r.tokens for r in rb]
    snap = lambda sts: [(list(s.keys), s.blocks.rows, list(s.blocks.table), s.last_num_drafted)  # noqa: E731
                        for s in sts]
    before = snap(sa)
    over, neg = [0] * B, [0] * B
    over[1], neg[B - 1] = 4, -1
    for bad_args, msg in (((sa, [0] * (B - 1)), f"{B} states but {B - 1}"),
                          ((sa, over), "sequence 1: num_accepted 4 outside"),
                          ((sa, neg), f"sequence {B - 1}: num_accepted -1"),
                          ((sa[:B - 1] + sa[:1], [0] * B), "twice")):
        with pytest.raises(InputError, match=msg):
            a.after_verify_batch(*bad_args)
        assert snap(sa) == before
    acc = [int(x) for x in rng.integers(0, 4, B)]
    a.after_verify_batch(sa, acc)
    for st, n in zip(sb, acc):
        b.after_verify(st, n)
    assert snap(sa) == snap(sb)
    check_pool(a, sa)
    a.free_state(sa[0])
    with pytest.raises(InputError, match="sequence 0: proposer state was freed"):
        a.after_verify_batch(sa[:2], [0, 0])


def test_batch_calls_take_a_list_of_states(rng):
    prop = load("qwen3_next")
    st = prefill_alike(rng, (prop,), [6])[0][0]
    for call, args in ((prop.propose_batch, (st, [1], hidden(rng, prop, 1), [6], 1)),
                       (prop.propose_batch, ([st, "x"], [1, 1], hidden(rng, prop, 2), [6, 6], 1)),
                       (prop.after_verify_batch, (st, [0]))):
        with pytest.raises(InputError, match="list of proposer states"):
            call(*args)
    assert st.keys == list(range(6)) and st.blocks.rows == 6


@pytest.mark.parametrize("fam", FAMILIES)
def test_tie_watch_reads_each_steps_slab(fam, rng):
    """The GPU tests' near-tie watch must see, at draft step i, the rows the sequence holds at that step (its
    prefilled rows, plus one per step so far): a watch that read step 0's slab at every step measured GLM-5's
    indexer gap over too few rows and let a true near-tie through."""
    prop = mtp_cupy.load_proposer(ckpt(fam), gpu=mtp_cupy.device("ref"), max_seq_len=96, max_batch=8)
    margins = watch_ties(prop)
    lens = [int(n) for n in rng.integers(2, 40, 3)]
    states = prefill_alike(rng, (prop,), lens)[0]
    prop.propose_batch(states, [int(t) for t in rng.integers(0, prop.vocab_size, 3)], hidden(rng, prop, 3), lens, 3)
    assert len(margins) == len(margins.rows) == 3
    for i, rows in enumerate(margins.rows):
        assert rows.tolist() == [n + 1 + i for n in lens], (i, rows, lens)
        assert np.all(np.isfinite(margins[i]) | (margins[i] == np.inf)) and not np.any(np.isnan(margins[i]))


def test_host_bf16_hiddens_refuse_every_nonfinite_word(rng):
    """Every one of the 65,536 bf16 words, alone among finite ones in a host hidden [B, D]: the check says
    finite exactly where the word's float value is (an independent decode through float32); a wide batch with
    one NaN or inf word anywhere is an InputError and changes no sequence."""
    from mtp_cupy.runtime.dtypes import BF16
    from mtp_cupy.speculative.inputs import _WIDE_WORDS, _finite
    words = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    want = np.isfinite(words.view(BF16).astype(np.float32))
    base = bf16_words(rng, 9)
    got = np.empty(words.size, bool)
    for w in range(words.size):
        base[4] = w
        got[w] = _finite(base)
    assert np.array_equal(got, want), np.flatnonzero(got != want)[:8]
    wide = np.resize(words[want], _WIDE_WORDS + 5)      # the wide path: every finite word, then each bad one
    assert _finite(wide)
    for w in np.flatnonzero(~want):
        at = int(rng.integers(wide.size))
        keep, wide[at] = wide[at], w
        assert not _finite(wide), hex(w)
        wide[at] = keep
    for deferred in (False, True):   # True: checked after the chain's launch, as on CUDA, then rolled back
        prop = load("qwen3_next")
        prop._defer_nan_check = deferred
        B = 6
        lens = [int(n) for n in rng.integers(2, 30, B)]
        states = prefill_alike(rng, (prop,), lens)[0]
        before = [(s.keys, s.blocks.rows, list(s.blocks.table)) for s in states]
        free = prop.kv.free_count
        for w in rng.choice(np.flatnonzero(~want), 4, replace=False):
            hs = hidden(rng, prop, B).astype(BF16)
            hs.view(np.uint16).reshape(-1)[int(rng.integers(hs.size))] = w
            with np.errstate(all="ignore"), pytest.raises(InputError, match="NaN or inf"):
                prop.propose_batch(states, [1] * B, hs, lens, 2)
            assert [(s.keys, s.blocks.rows, list(s.blocks.table)) for s in states] == before
            assert prop.kv.free_count == free
        got = prop.propose_batch(states, [1] * B, hidden(rng, prop, B), lens, 2)   # and the next call is fine
        assert all(len(r.tokens) == 2 for r in got)


def bf16_words(rng, n: int) -> np.ndarray:
    """n random finite bf16 words."""
    from mtp_cupy.runtime.dtypes import bf16_round
    return bf16_round(rng.standard_normal(n)).view(np.uint16).copy()


@pytest.mark.parametrize("fam", ["deepseek_v3", "qwen3_next"])
@pytest.mark.parametrize("B", [2, 6])
def test_draft_batch_arrays_and_last_drafts(fam, B, rng):
    """A DraftBatch's arrays hold what a one-at-a-time propose drafts (tokens [B, k] with -1 past a confidence
    stop, num_drafts, logprobs, logits [B, k, vocab]); each state's last_drafts are its drafts through
    after_verify, and [] after device results, after free_state and for a new state on a reused mirror row."""
    batched, single, probe = load(fam), load(fam), load(fam)
    lens = [int(n) for n in rng.integers(1, 30, B)]
    sa, sb, sp = prefill_alike(rng, (batched, single, probe), lens, False)
    toks, k = [int(t) for t in rng.integers(0, batched.vocab_size, B)], 3
    hs = hidden(rng, batched, B)
    # a cut inside the drafts' own log-probs (measured on a third twin), so some sequences stop and some do not
    lps = probe.propose_batch(sp, toks, hs, lens, k, min_logprob=-np.inf).logprobs
    lp_cut = float(np.median(lps[:, 1:]))
    got = batched.propose_batch(sa, toks, hs, lens, k, return_logits=True, min_logprob=lp_cut)
    assert len(got) == B and isinstance(got[-1], DraftResult) and got[1:] == [got[1 + i] for i in range(B - 1)]
    assert got.tokens.shape == (B, k) and got.tokens.dtype == np.int32
    assert got.logits.shape == (B, k, batched.vocab_size)
    for s in range(B):
        want = single.propose(sb[s], toks[s], hs[s], lens[s], k, return_logits=True, min_logprob=lp_cut)
        d = len(want.tokens)
        assert got.num_drafts[s] == d and got.tokens[s, :d].tolist() == want.tokens
        assert (got.tokens[s, d:] == -1).all() and np.isnan(got.logprobs[s, d:]).all()
        assert got.logprobs[s, :d].tolist() == want.logprobs
        assert np.array_equal(got.logits[s, :d], want.logits)
        assert sa[s].last_drafts == want.tokens == sb[s].last_drafts
    print("confidence stops:", int((got.num_drafts < k).sum()), "of", B)
    acc = [int(rng.integers(0, int(d) + 1)) for d in got.num_drafts]
    batched.after_verify_batch(sa, acc)
    assert [st.last_drafts for st in sa] == [r.tokens for r in got]   # kept through after_verify
    pos = [st.next_position for st in sa]
    dev = batched.propose_batch(sa, toks, hs, pos, 2, device_results=True)
    assert dev.tokens is None and np.asarray(dev.device_tokens).shape == (B, 2)
    assert [st.last_drafts for st in sa] == [[]] * B   # device results: nothing read back
    assert dev.host().tokens.tolist() == [np.asarray(r.device_tokens).tolist() for r in dev]
    gone = sa[0]
    batched.free_state(gone)
    assert gone.last_drafts == []
    fresh = batched.alloc_state()
    assert fresh.blocks.row is not None and fresh.last_drafts == []


@pytest.mark.parametrize("B", [1, 3, 7])
def test_positions_default_to_the_next_ones(B, rng):
    """positions None: every sequence drafts at its next position, the same drafts and state as positions given
    (the per-sequence path below ARRAY_MIN_BATCH, the array path from it, and propose)."""
    a, b = load("deepseek_v3"), load("deepseek_v3")
    lens = [int(n) for n in rng.integers(1, 30, B)]
    sa, sb = prefill_alike(rng, (a, b), lens)
    for _ in range(2):
        toks, hs = [int(t) for t in rng.integers(0, a.vocab_size, B)], hidden(rng, a, B)
        got = a.propose_batch(sa, toks, hs, None, 2, return_logits=True)
        want = b.propose_batch(sb, toks, hs, [st.next_position for st in sb], 2, return_logits=True)
        assert np.array_equal(got.tokens, want.tokens) and np.array_equal(got.logits, want.logits)
        assert [st.keys for st in sa] == [st.keys for st in sb]
        acc = [int(x) for x in rng.integers(0, 3, B)]
        a.after_verify_batch(sa, acc)
        b.after_verify_batch(sb, acc)
    with pytest.raises(InputError, match=f"{B} states but {B + 1} tokens and next positions"):
        a.propose_batch(sa, [1] * (B + 1), hidden(rng, a, B), None, 1)
    one = a.propose(sa[0], 1, hs[0], None, 1)
    assert one.tokens == b.propose(sb[0], 1, hs[0], sb[0].next_position, 1).tokens
    assert sa[0].keys == sb[0].keys


def test_draft_batch_logits_past_mtp_vocab_size(rng):
    """mtp_vocab_size scores the first rows only: the batch's logits [B, k, vocab] and each DraftResult's hold -inf
    past it, and the scored part is what a one-at-a-time propose returns."""
    a, b = load("deepseek_v3", mtp_vocab_size=100), load("deepseek_v3", mtp_vocab_size=100)
    B, k = 6, 2
    lens = [int(n) for n in rng.integers(1, 30, B)]
    sa, sb = prefill_alike(rng, (a, b), lens)
    toks, hs = [int(t) for t in rng.integers(0, a.vocab_size, B)], hidden(rng, a, B)
    got = a.propose_batch(sa, toks, hs, None, k, return_logits=True)
    assert got.logits.shape == (B, k, a.vocab_size) and np.isneginf(got.logits[:, :, 100:]).all()
    assert (got.tokens < 100).all()
    for s in range(B):
        want = b.propose(sb[s], toks[s], hs[s], None, k, return_logits=True)
        assert np.array_equal(got[s].logits, want.logits) and np.array_equal(got.logits[s], want.logits)
