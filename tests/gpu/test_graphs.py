"""propose(k) replayed as a CUDA graph gives exactly what the eager launches give (same kernels, same
order, per-call values in device buffers): tokens and logits bit for bit, across positions, k and calls."""
import numpy as np
import pytest

import mtp_cupy
from mtp_cupy.families import family as family_module

FAMILIES = ["deepseek_v3", "deepseek_v4", "qwen3_next"]


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_graph_replay_equals_eager(tmp_path, family, rng):
    family_module(family).write_tiny_checkpoint(tmp_path, seed=int(rng.integers(1 << 30)))
    gpu = mtp_cupy.device("cuda")
    eager = mtp_cupy.load_proposer(tmp_path, gpu=gpu, max_seq_len=256, cuda_graphs=False)
    graph = mtp_cupy.load_proposer(tmp_path, gpu=gpu, max_seq_len=256, cuda_graphs=True)
    assert graph.cuda_graphs and not eager.cuda_graphs
    V, D = eager.vocab_size, eager.hidden_size
    toks = rng.integers(0, V, 40)
    hid = rng.standard_normal((40, D)).astype(np.float32)
    se, sg = eager.alloc_state(), graph.alloc_state()
    for p, s in ((eager, se), (graph, sg)):
        p.prefill(s, toks[:20], hid[:19])
    pos = 19
    for cycle in range(8):                    # k repeats so graphs are captured and then replayed
        k = [1, 2, 3][cycle % 3]
        re = eager.propose(se, int(toks[pos + 1]), hid[pos], pos, k, return_logits=True)
        rg = graph.propose(sg, int(toks[pos + 1]), hid[pos], pos, k, return_logits=True)
        assert re.tokens == rg.tokens, (cycle, re.tokens, rg.tokens)
        assert np.array_equal(re.logits, rg.logits), cycle
        a = int(rng.integers(0, k + 1))
        eager.after_verify(se, a)
        graph.after_verify(sg, a)
        pos += a + 1
    assert len(graph._graphs) >= 2          # replays really happened


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 3, 8, 20, 32])
def test_batched_graph_replay_equals_eager(B, rng):
    """propose_batch replayed per (k, bucket) with pad sequences gives the eager batched drafts and state;
    a token may differ only where the eager logits have no clear top-1 (padded widths may sum differently)."""
    from batch_graph_util import K, V, batch_inputs, two_proposers
    from qwen_util import clear_argmax
    g, e = two_proposers(mtp_cupy.device("cuda"), max_batch=32)
    (sg, se), toks, hs, pos = batch_inputs(rng, (g, e), B)
    for call in range(4):                     # eager warm-up, capture, two replays
        rg = g.propose_batch(sg, toks, hs, pos, K)
        re = e.propose_batch(se, toks, hs, pos, K, return_logits=True)
        for s in range(B):
            for i in range(K):
                if rg[s].tokens[i] != re[s].tokens[i]:
                    assert not clear_argmax(re[s].logits[i]), (call, s, i)
                    break
        acc = [0 if rg[s].tokens != re[s].tokens else int(a) for s, a in enumerate(rng.integers(0, K + 1, B))]
        for p, sts in ((g, sg), (e, se)):
            for st, a in zip(sts, acc):
                p.after_verify(st, a)
        assert [s.keys for s in sg] == [s.keys for s in se]
        pos, toks = [st.keys[-1] + 1 for st in sg], rng.integers(0, V, B)
    assert any(key[0] == "batch" for key in g._graphs)
