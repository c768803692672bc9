"""Plain-torch bf16 peers of one MTP draft step per family (docs/model_math.md A-D), the benchmarks' baseline.

Each peer is the family's step written plainly in torch: bf16 weights (no FP8/FP4), f32 softmax / norm math,
the argmax left on the device (the chain never reads the host, so it captures as a CUDA graph). A peer drafts
for B sequences at once, each with its own cache of ctx (+ kmax) rows, token and hidden: the projections are one
matmul over the B rows (each weight read once), attention is batched over the sequences, and the routed experts
run by one of two paths (`moe`): ``grouped`` (``torch._grouped_mm`` over the (row, expert) pairs sorted by
expert: each distinct selected expert read once) or ``gather`` (each row's experts copied out of the stacked
[E, ...] tensors, the batch-1 peer's op). Their numbers are not meant to match mtp_cupy's (random weights, plain
RoPE frequencies); the bytes read and the ops are the step's. DeepSeek-V3 and GLM-5 share one MLA step (`mla`),
GLM adding its DSA indexer.

``PEERS[family](cfg, ctx, kmax, device, seed, batch=1, moe="auto")`` builds a `TorchPeer`. torch is imported
when a peer is built."""
from __future__ import annotations

from .common import TorchPeer
from .moe import MOE_PATHS, grouped_mm_works


def v3_peer(c: dict, ctx: int, kmax: int, device: str, seed: int = 0, batch: int = 1,
            moe: str = "auto") -> TorchPeer:
    """The DeepSeek-V3 peer: `mla.mla_peer` without the indexer (arguments as there)."""
    from .mla import mla_peer
    return mla_peer(c, ctx, kmax, device, seed, glm=False, batch=batch, moe=moe)


def glm_peer(c: dict, ctx: int, kmax: int, device: str, seed: int = 0, batch: int = 1,
             moe: str = "auto") -> TorchPeer:
    """The GLM-5 peer: `mla.mla_peer` with the DSA indexer (arguments as there)."""
    from .mla import mla_peer
    return mla_peer(c, ctx, kmax, device, seed, glm=True, batch=batch, moe=moe)


def v4_peer(c: dict, ctx: int, kmax: int, device: str, seed: int = 0, batch: int = 1,
            moe: str = "auto") -> TorchPeer:
    """The DeepSeek-V4 peer (`deepseek_v4.v4_peer`)."""
    from .deepseek_v4 import v4_peer as build
    return build(c, ctx, kmax, device, seed, batch, moe)


def qwen_peer(c: dict, ctx: int, kmax: int, device: str, seed: int = 0, batch: int = 1,
              moe: str = "auto") -> TorchPeer:
    """The Qwen3-Next peer (`qwen3_next.qwen_peer`)."""
    from .qwen3_next import qwen_peer as build
    return build(c, ctx, kmax, device, seed, batch, moe)


PEERS = {"deepseek_v3": v3_peer, "deepseek_v4": v4_peer, "qwen3_next": qwen_peer, "glm5": glm_peer}

__all__ = ["MOE_PATHS", "PEERS", "TorchPeer", "glm_peer", "grouped_mm_works", "qwen_peer", "v3_peer", "v4_peer"]
