"""propose(k) replayed as a CUDA graph gives exactly what the eager launches give (same kernels, same
order, per-call values in device buffers): tokens and logits bit for bit, across positions, k and calls."""
import numpy as np
import pytest

import mtp_cupy
from mtp_cupy.families import family as family_module

FAMILIES = ["deepseek_v3", "deepseek_v4", "qwen3_next", "glm5"]


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_graph_replay_equals_eager(tmp_path, family, rng):
    family_module(family).write_tiny_checkpoint(tmp_path, seed=int(rng.integers(1 << 30)))
    gpu = mtp_cupy.device("cuda")
    eager = mtp_cupy.load_proposer(tmp_path, gpu=gpu, max_seq_len=256, cuda_graphs=False)
    graph = mtp_cupy.load_proposer(tmp_path, gpu=gpu, max_seq_len=256, cuda_graphs=True)
    assert graph.cuda_graphs and not eager.cuda_graphs
    V, D = eager.vocab_size, eager.hidden_size
    toks = rng.integers(0, V, 80)
    hid = rng.standard_normal((80, D)).astype(np.float32)
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
        pos += a + 1                          # the catch-up row of the last accepted token, from the target
        for p, s in ((eager, se), (graph, sg)):
            p.prefill(s, toks[pos - 1:pos + 1], hid[pos - 1:pos])
    assert len(graph._graphs) >= 2          # replays really happened
