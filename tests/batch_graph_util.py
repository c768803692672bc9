"""Shared by the CPU and GPU tests of propose_batch under CUDA graphs (bucketed widths with pad sequences)."""

from mtp_cupy.models import qwen3_next as qwen_mtp
from mtp_cupy.runtime.dtypes import bf16_round
from qwen_util import tiny_ckpt

V, D, K = 512, 256, 3


def two_proposers(gpu, max_batch: int = 32, **opts):
    """(graphed, eager) proposers over the same tiny checkpoint."""
    ckpt = tiny_ckpt("bf16")
    g = qwen_mtp.from_checkpoint(ckpt, gpu, max_seq_len=256, max_batch=max_batch, **opts)
    e = qwen_mtp.from_checkpoint(ckpt, gpu, max_seq_len=256, max_batch=max_batch, **opts)
    g.cuda_graphs, e.cuda_graphs = True, False
    return g, e


def batch_inputs(rng, prop_pair, B: int):
    """B sequences prefilled alike in both proposers; returns (states per proposer, tokens, hiddens, positions)."""
    lens = [int(x) for x in rng.integers(3, 40, B)]
    states = ([p.alloc_state() for _ in lens] for p in prop_pair)
    states = [list(s) for s in states]
    for i, n in enumerate(lens):
        toks, hs = rng.integers(0, V, n + 1), bf16_round(rng.standard_normal((n, D)))
        for p, sts in zip(prop_pair, states):
            p.prefill(sts[i], toks, hs)
    return states, rng.integers(0, V, B), bf16_round(rng.standard_normal((B, D))), lens
