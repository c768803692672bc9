"""propose_batch's graph path on the NumPy device, with capture emulated (a "graph" re-runs the launches at
replay, reading the same staged buffers): bucket widths, pad sequences and their KV block, masks, and state
after the call equal the eager batched path, call after call."""
import numpy as np
import pytest

import mtp_cupy
from batch_graph_util import K, V, batch_inputs, two_proposers
from mtp_cupy.errors import CapacityError
from mtp_cupy.models.qwen_batch import BUCKETS


@pytest.fixture
def ref_graphs():
    gpu = mtp_cupy.device("ref")
    gpu.capture = lambda fn, stream: fn
    gpu.replay = lambda graph, stream: graph()
    return gpu


@pytest.mark.parametrize("B", [1, 3, 5, 8, 13])
def test_bucketed_graph_path_equals_eager(ref_graphs, rng, B):
    g, e = two_proposers(ref_graphs, max_batch=16)
    (sg, se), toks, hs, pos = batch_inputs(rng, (g, e), B)
    for call in range(3):               # eager warm-up, capture, replay
        rg = g.propose_batch(sg, toks, hs, pos, K)
        re = e.propose_batch(se, toks, hs, pos, K)
        assert [r.tokens for r in rg] == [r.tokens for r in re], call
        assert [s.keys for s in sg] == [s.keys for s in se]
        acc = [int(a) for a in rng.integers(0, K + 1, B)]
        for p, sts in ((g, sg), (e, se)):
            for st, a in zip(sts, acc):
                p.after_verify(st, a)
        pos = [st.keys[-1] + 1 for st in sg]
        toks = rng.integers(0, V, B)
    width = next(b for b in BUCKETS if b >= B)
    assert ("batch", K, width, False) in g._graphs
    assert (g._pad is not None) == (width > B)
    assert g.kv.free_count == e.kv.free_count - (width > B)     # the pad sequences hold one block


def test_bucket_choice_and_masks(ref_graphs, rng):
    g, e = two_proposers(ref_graphs, max_batch=6)
    assert [g._bucket(b) for b in range(1, 7)] == [1, 2, 4, 4, 6, 6]   # capped at max_batch
    (sg, se), toks, hs, pos = batch_inputs(rng, (g, e), 3)
    words = (V + 31) // 32
    masks = [None, rng.integers(-2**31, 2**31 - 1, words, dtype=np.int64).astype(np.int32), None]
    for _ in range(3):
        rg = g.propose_batch(sg, toks, hs, pos, 2, grammar_bitmasks=masks)
        re = e.propose_batch(se, toks, hs, pos, 2, grammar_bitmasks=masks)
        assert [r.tokens for r in rg] == [r.tokens for r in re]
        for p, sts in ((g, sg), (e, se)):
            for st in sts:
                p.after_verify(st, 0)
    assert ("batch", 2, 4, True) in g._graphs


def test_logits_and_confidence_stop_run_eagerly(ref_graphs, rng):
    g, e = two_proposers(ref_graphs, max_batch=8)
    (sg, se), toks, hs, pos = batch_inputs(rng, (g, e), 3)
    rg = g.propose_batch(sg, toks, hs, pos, K, return_logits=True)
    re = e.propose_batch(se, toks, hs, pos, K, return_logits=True)
    for a, b in zip(rg, re):
        assert a.tokens == b.tokens and np.array_equal(a.logits, b.logits)
    assert not g._graphs and g._pad is None


def test_pad_block_from_a_full_pool_fails_cleanly(ref_graphs, rng):
    """The pad sequences' block comes from the pool: a full pool refuses the call and changes nothing."""
    g, _ = two_proposers(ref_graphs, max_batch=4, kv_blocks=3)
    sts = [g.alloc_state() for _ in range(3)]
    for st in sts:
        g.prefill(st, rng.integers(0, V, 10), rng.standard_normal((9, 256)).astype(np.float32))
    before = [(list(st.keys), st.blocks.rows) for st in sts]
    with pytest.raises(CapacityError):
        g.propose_batch(sts, [1, 2, 3], np.zeros((3, 256), np.float32), [9, 9, 9], 2)
    assert [(list(st.keys), st.blocks.rows) for st in sts] == before and g.kv.free_count == 0
