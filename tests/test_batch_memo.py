"""The wide batch calls remember the last batch whose states they checked (speculative.batch_inputs.BatchMemo) and
skip the per-state checks when the same states come back. What must still hold: a list changed in place is read
as it is now, a freed state is refused (also once a new state has taken its mirror row), and the drafts and
states match a proposer that is never handed the same batch twice (a tuple each call: never remembered)."""
import pytest

import mtp_cupy
from batch_util import ckpt, hidden, prefill_alike
from helpers import check_pool
from mtp_cupy.errors import InputError


def load(fam):
    return mtp_cupy.load_proposer(ckpt(fam), gpu=mtp_cupy.device("ref"), max_seq_len=96, max_batch=8)


def snap(sts):
    return [(list(s.keys), s.blocks.rows, list(s.blocks.table), s.last_num_drafted, list(s.last_drafts)) for s in sts]


@pytest.mark.parametrize("fam", ["deepseek_v3", "qwen3_next"])
def test_a_remembered_batch_reads_the_list_as_it_is_now(fam, rng):
    prop, fresh = load(fam), load(fam)
    B = 6
    lens = [int(n) for n in rng.integers(5, 30, B)]
    sa, sb = prefill_alike(rng, (prop, fresh), lens)
    pos = list(lens)
    for rnd in range(4):
        if rnd == 2:   # the same list object, two states swapped in place
            for sts in (sa, sb):
                sts[0], sts[3] = sts[3], sts[0]
            pos[0], pos[3] = pos[3], pos[0]
        toks, hs = [int(t) for t in rng.integers(0, prop.vocab_size, B)], hidden(rng, prop, B)
        got = prop.propose_batch(sa, toks, hs, pos, 2)
        want = fresh.propose_batch(tuple(sb), toks, hs, pos, 2)
        assert [r.tokens for r in got] == [r.tokens for r in want]
        acc = [int(a) for a in rng.integers(0, 3, B)]
        prop.after_verify_batch(sa, acc)
        fresh.after_verify_batch(tuple(sb), acc)
        assert snap(sa) == snap(sb)
        pos = [s.next_position for s in sa]
    check_pool(prop, sa)


def test_a_freed_state_in_a_remembered_batch_is_refused(rng):
    prop = load("qwen3_next")
    B = 6
    lens = [int(n) for n in rng.integers(5, 30, B)]
    sts = prefill_alike(rng, (prop,), lens)[0]
    toks, hs = [1] * B, hidden(rng, prop, B)
    prop.propose_batch(sts, toks, hs, lens, 2)
    prop.after_verify_batch(sts, [0] * B)           # the batch is remembered
    prop.free_state(sts[3])
    before = snap(sts[:3] + sts[4:])
    with pytest.raises(InputError, match="sequence 3: proposer state was freed"):
        prop.after_verify_batch(sts, [0] * B)
    with pytest.raises(InputError, match="freed"):
        prop.propose_batch(sts, toks, hs, lens, 2)
    newcomer = prop.alloc_state()                   # takes the freed state's mirror row
    assert newcomer.blocks.row is not None
    with pytest.raises(InputError, match="freed"):
        prop.propose_batch(sts, toks, hs, lens, 2)
    assert snap(sts[:3] + sts[4:]) == before
    live = sts[:3] + sts[4:]
    res = prop.propose_batch(live, toks[:5], hs[:5], lens[:3] + lens[4:], 2)
    assert all(len(r.tokens) == 2 for r in res)
    check_pool(prop, live)
