"""Batched drafting on CUDA, every family and bucket: CUDA against the NumPy device on the same inputs (drafts
equal where the device's top-1 is clear, logits within bf16 accumulation-order error), a sequence drafting the
same in a batch as alone (batch-invariant launch geometry: bit for bit), and graph replay == eager launches."""
import numpy as np
import pytest

import mtp_cupy
from batch_util import (FAMILIES, ckpt, device_and_host_results_loop, graphed_catch_up_loop, hidden, prefill_alike,
                        rows_digest, verify_round, watch_ties)

pytestmark = pytest.mark.gpu
BATCHES = [1, 2, 5, 16, 33, 64]


def rel(a, b):
    fin = np.isfinite(b)
    return float(np.linalg.norm(a[fin] - b[fin]) / np.linalg.norm(b[fin]))


def clear(logits, margin=0.05):
    top = np.sort(logits[np.isfinite(logits)])[-2:]
    return bool(top[1] - top[0] > margin * logits[np.isfinite(logits)].std())


def load(fam, gpu, **kw):
    return mtp_cupy.load_proposer(ckpt(fam), gpu=gpu, max_seq_len=96, max_batch=64, **kw)


@pytest.mark.parametrize("fam", FAMILIES)
@pytest.mark.parametrize("B", BATCHES)
def test_cuda_batch_matches_ref_device(fam, B, rng):
    """Each sequence's chain, CUDA against the NumPy device, until a step where the NumPy device saw a
    selection near-tie (routing, or GLM-5's indexer top-k: the devices may then choose differently) or the
    drafts part at an unclear top-1. At least one draft per two sequences must be compared: a batch whose
    chains all start at ties is drawn again (up to 5 times)."""
    cu, rf = load(fam, mtp_cupy.device("cuda")), load(fam, mtp_cupy.device("ref"))
    margins = watch_ties(rf)
    for attempt in range(5):
        lens = [int(n) for n in rng.integers(2, 40, B)]
        sc, sr = prefill_alike(rng, (cu, rf), lens)
        toks, hs = [int(t) for t in rng.integers(0, cu.vocab_size, B)], hidden(rng, cu, B)
        margins.clear()
        gc = cu.propose_batch(sc, toks, hs, lens, 3, return_logits=True)
        gr = rf.propose_batch(sr, toks, hs, lens, 3, return_logits=True)
        compared = 0
        for s in range(B):
            for i in range(3):
                if margins[i][s] < (1e-2 if i == 0 else 3e-2):
                    break
                assert rel(gc[s].logits[i], gr[s].logits[i]) <= (1e-2 if i == 0 else 3e-2), (s, i)
                compared += 1
                if gc[s].tokens[i] != gr[s].tokens[i]:
                    assert not clear(gr[s].logits[i]), (s, i)
                    break
        for p, sts in ((cu, sc), (rf, sr)):
            for st in sts:
                p.free_state(st)
        if compared >= max(1, B // 2):
            return
    raise AssertionError(f"only {compared} drafts compared for {B} sequences in 5 draws")


@pytest.mark.parametrize("fam", FAMILIES)
def test_cuda_sequence_drafts_the_same_in_any_batch(fam, rng):
    gpu = mtp_cupy.device("cuda")
    batched, single = load(fam, gpu, cuda_graphs=False), load(fam, gpu, cuda_graphs=False)
    B = 24
    lens = [int(n) for n in rng.integers(2, 40, B)]
    sa, sb = prefill_alike(rng, (batched, single), lens)
    toks, hs = [int(t) for t in rng.integers(0, batched.vocab_size, B)], hidden(rng, batched, B)
    got = batched.propose_batch(sa, toks, hs, lens, 3, return_logits=True)
    for s in range(B):
        want = single.propose(sb[s], toks[s], hs[s], lens[s], 3, return_logits=True)
        assert got[s].tokens == want.tokens and np.array_equal(got[s].logits, want.logits), s


@pytest.mark.parametrize("fam", FAMILIES)
@pytest.mark.parametrize("B", [1, 3, 20, 64])
def test_cuda_graph_replay_equals_eager(fam, B, rng):
    gpu = mtp_cupy.device("cuda")
    g, e = load(fam, gpu, cuda_graphs=True), load(fam, gpu, cuda_graphs=False)
    lens = [int(n) for n in rng.integers(2, 30, B)]
    sg, se = prefill_alike(rng, (g, e), lens)
    pos, toks = list(lens), [int(t) for t in rng.integers(0, g.vocab_size, B)]
    for call in range(4):                     # eager warm-up, capture, two replays
        hs = hidden(rng, g, B)
        rg = g.propose_batch(sg, toks, hs, pos, 3)
        re = e.propose_batch(se, toks, hs, pos, 3)
        assert [r.tokens for r in rg] == [r.tokens for r in re], call
        pos, toks = verify_round(rng, (g, e), (sg, se), rg)
    assert g._graphs, "no chain was captured"


@pytest.mark.parametrize("fam", FAMILIES)
def test_cuda_prefill_batch_equals_prefill(fam, rng):
    """prefill_batch on CUDA writes the rows prefill writes one sequence at a time, bit for bit (the row writes
    are batch-invariant up to 64 rows: N <= 60 here), and a serving loop's catch-up through it (propose_batch,
    after_verify_batch, one row each, propose_batch) drafts what the per-sequence catch-up drafts."""
    gpu = mtp_cupy.device("cuda")
    a, b = load(fam, gpu), load(fam, gpu)
    B = 6
    lens = [int(n) if rng.random() < 0.8 else 0 for n in rng.integers(2, 40, B)]
    lens[0] = max(lens[0], 2)
    sa, sb = prefill_alike(rng, (a, b), lens)
    n = [int(x) if rng.random() < 0.8 else 0 for x in rng.integers(1, 11, B)]
    toks, hs = rng.integers(0, a.vocab_size, sum(n)), hidden(rng, a, sum(n))
    a.prefill_batch(sa, toks, hs, n)
    j = 0
    for s in range(B):
        if n[s]:
            b.prefill(sb[s], np.concatenate([[0], toks[j:j + n[s]]]), hs[j:j + n[s]])
        j += n[s]
    for x, y in zip(sa, sb):
        assert x.keys == y.keys and rows_digest(a, x) == rows_digest(b, y)
    live = [s for s in range(B) if sa[s].blocks.rows]
    sa, sb = [sa[s] for s in live], [sb[s] for s in live]
    pos = [st.next_position for st in sa]
    nxt = [int(t) for t in rng.integers(0, a.vocab_size, len(live))]
    for _ in range(4):   # eager, capture, replays
        h = hidden(rng, a, len(live))
        ra, rb = a.propose_batch(sa, nxt, h, pos, 3), b.propose_batch(sb, nxt, h, pos, 3)
        assert np.array_equal(ra.tokens, rb.tokens)
        acc = [int(x) for x in rng.integers(0, 4, len(live))]
        a.after_verify_batch(sa, acc)
        b.after_verify_batch(sb, acc)
        gap = [p + x for p, x in zip(pos, acc)]
        rt, rh = rng.integers(0, a.vocab_size, len(live)), hidden(rng, a, len(live))
        a.prefill_batch(sa, rt, rh, [1] * len(live))
        for s, st in enumerate(sb):
            b.prefill(st, [0, int(rt[s])], rh[s:s + 1], start_position=gap[s])
        pos, nxt = [g + 1 for g in gap], [int(t) for t in rt]


@pytest.mark.parametrize("fam", FAMILIES)
def test_cuda_compiled_bookkeeping_equals_numpy(fam, rng):
    """The compiled bookkeeping (host_path c: checks, blocks, slabs, pad rows, counters, the catch-up's rows) on
    CUDA with graphs, B = 5 in a bucket of 8 (three pad rows): a serving loop of propose_batch, ragged
    after_verify_batch and the catch-up drafts and writes what the NumPy path does, bit for bit, and leaves the
    same mirror and pool (tests/test_batch_host.py holds the two alike on the NumPy device)."""
    gpu = mtp_cupy.device("cuda")
    c, n = load(fam, gpu, host_path="c"), load(fam, gpu, host_path="numpy")
    assert c._batch_host() is not None and c.cuda_graphs
    B = 5
    sc, sn = prefill_alike(rng, (c, n), [int(x) for x in rng.integers(2, 40, B)])
    nxt = [int(t) for t in rng.integers(0, c.vocab_size, B)]
    for _ in range(5):   # eager, capture, replays
        h = hidden(rng, c, B)
        rc, rn = c.propose_batch(sc, nxt, h, None, 3), n.propose_batch(sn, nxt, h, None, 3)
        assert np.array_equal(rc.tokens, rn.tokens)
        acc = [int(x) for x in rng.integers(0, 4, B)]
        c.after_verify_batch(sc, acc)
        n.after_verify_batch(sn, acc)
        rt, rh = rng.integers(0, c.vocab_size, B), hidden(rng, c, B)
        c.prefill_batch(sc, rt, rh, [1] * B)
        n.prefill_batch(sn, rt, rh, [1] * B)
        nxt = [int(t) for t in rt]
        for x, y in zip(sc, sn):
            assert x.keys == y.keys and rows_digest(c, x) == rows_digest(n, y)
        assert np.array_equal(c.kv._cols, n.kv._cols) and np.array_equal(c.kv._tables, n.kv._tables)
    assert c._graphs, "no chain was captured"


@pytest.mark.parametrize("fam", FAMILIES)
def test_cuda_graphed_catch_up_equals_eager(fam, rng):
    """The catch-up from device hiddens replayed as a graph per row count (real capture) against eager launches:
    the same rows and drafts, bit for bit, as the batch shrinks and grows back."""
    gpu = mtp_cupy.device("cuda")
    graphed_catch_up_loop(rng, gpu, load(fam, gpu), load(fam, gpu, cuda_graphs=False), fam)


def test_cuda_device_and_host_results_take_their_own_graphs(rng):
    """Real capture: device and host results alternate through their own graphs, equal to eager launches."""
    gpu = mtp_cupy.device("cuda")
    device_and_host_results_loop(rng, load("deepseek_v3", gpu), load("deepseek_v3", gpu, cuda_graphs=False))
