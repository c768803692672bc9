"""The graph path of propose / propose_batch on the NumPy device, with capture emulated (a "graph" re-runs the
launches at replay, reading the same staged buffers): bucket widths, pad sequences and their KV block, masks,
logits and confidence stops, and state after the call equal the eager path, call after call, every family."""
import numpy as np
import pytest

import mtp_cupy
from batch_util import (FAMILIES, ckpt, device_and_host_results_loop, graphed_catch_up_loop, hidden, prefill_alike,
                        verify_round)
from helpers import check_pool
from mtp_cupy.speculative.base import BUCKETS


@pytest.fixture
def ref_graphs():
    gpu = mtp_cupy.device("ref")
    gpu.capture = lambda fn, stream: fn
    gpu.replay = lambda graph, stream: graph()
    return gpu


def pair(gpu, fam, max_batch=16, **kw):
    """(graphed, eager) proposers over the same tiny checkpoint."""
    g, e = (mtp_cupy.load_proposer(ckpt(fam), gpu=gpu, max_seq_len=96, max_batch=max_batch, **kw) for _ in range(2))
    g.cuda_graphs, e.cuda_graphs = True, False
    return g, e


@pytest.mark.parametrize("fam", FAMILIES)
@pytest.mark.parametrize("B", [1, 3, 8, 13])
def test_bucketed_graph_path_equals_eager(ref_graphs, rng, fam, B):
    g, e = pair(ref_graphs, fam)
    lens = [int(n) for n in rng.integers(2, 30, B)]
    sg, se = prefill_alike(rng, (g, e), lens)
    pos, toks = list(lens), [int(t) for t in rng.integers(0, g.vocab_size, B)]
    k = 2
    for call in range(3):               # eager warm-up, capture, replay
        hs = hidden(rng, g, B)
        masks = None if call != 2 else [None] + [np.full((g.vocab_size + 31) // 32, -1, np.int32)] * (B - 1)
        rg = g.propose_batch(sg, toks, hs, pos, k, grammar_bitmasks=masks, return_logits=True)
        re = e.propose_batch(se, toks, hs, pos, k, grammar_bitmasks=masks, return_logits=True)
        for a, b in zip(rg, re):
            assert a.tokens == b.tokens and np.array_equal(a.logits, b.logits)
        assert [s.keys for s in sg] == [s.keys for s in se]
        pos, toks = verify_round(rng, (g, e), (sg, se), rg)
    width = next(b for b in BUCKETS if b >= B)
    assert any(key[:2] == (k, width) for key in g._graphs), g._graphs.keys()
    check_pool(g, sg)
    assert g.kv.free_count == e.kv.free_count       # the pads' block is taken at load in both


def test_bucket_capped_at_max_batch_and_confidence_stop(ref_graphs, rng):
    g, e = pair(ref_graphs, "qwen3_next", max_batch=6)
    sg, se = prefill_alike(rng, (g, e), [4, 9, 13, 5, 7])
    hs = hidden(rng, g, 5)
    for _ in range(3):
        rg = g.propose_batch(sg, [1, 2, 3, 4, 5], hs, [4, 9, 13, 5, 7], 3, min_logprob=-3.0)
        re = e.propose_batch(se, [1, 2, 3, 4, 5], hs, [4, 9, 13, 5, 7], 3, min_logprob=-3.0)
        assert [r.tokens for r in rg] == [r.tokens for r in re]
        assert [r.logprobs for r in rg] == [r.logprobs for r in re]
        for p, sts in ((g, sg), (e, se)):
            for st in sts:
                p.after_verify(st, 0)
    assert all(key[1] == 6 for key in g._graphs)     # 5 sequences in the capped bucket of 6


@pytest.mark.parametrize("fam", FAMILIES)
def test_graphed_catch_up_equals_eager(ref_graphs, rng, fam):
    """A serving loop whose catch-up takes device hiddens: one graph per row count, the eager rows and drafts."""
    graphed_catch_up_loop(rng, ref_graphs, *pair(ref_graphs, fam), fam)



def test_device_and_host_results_take_their_own_graphs(ref_graphs, rng):
    """Host results replay a graph whose last kernel publishes to the outbox; device results one that does not."""
    device_and_host_results_loop(rng, *pair(ref_graphs, "deepseek_v3"))
