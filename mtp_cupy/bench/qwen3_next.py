"""Qwen3-Next-80B-A3B's MTP head at its real dims: the config and random BF16 weights (the released checkpoint
is BF16; the proposer quantises them at build time when asked)."""
from __future__ import annotations

from ..weights.qwen3_next import NORMS, Qwen3NextMtpWeights
from .random_device import RandomDevice

REAL = dict(model_type="qwen3_next", hidden_size=2048, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
            partial_rotary_factor=0.25, rope_theta=1e7, rms_norm_eps=1e-6, vocab_size=151936, num_hidden_layers=48,
            num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512,
            norm_topk_prob=True)
TINY = {**REAL, "hidden_size": 256, "num_attention_heads": 4, "head_dim": 64, "vocab_size": 512, "num_experts": 16,
        "num_experts_per_tok": 4, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64}


def random_weights(gpu, cfg, seed: int) -> Qwen3NextMtpWeights:
    """A random BF16 Qwen3-Next MTP head of the dims of `cfg` (Qwen3NextConfig) on `gpu`, drawn from
    `RandomDevice(gpu, seed)`; (1 + w) norms with w ~ N(0, 0.01)."""
    r = RandomDevice(gpu, seed)
    D, V, H, KV, hd = cfg.hidden_size, cfg.vocab_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    E, inter, sh = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    embed = r.bf16(V * D, 1.0)
    norms = {role: r.bf16(hd if role in ("q_norm", "k_norm") else D, 0.1) for role in NORMS}
    shapes = {"fc": (D, 2 * D), "q_proj": (2 * H * hd, D), "k_proj": (KV * hd, D), "v_proj": (KV * hd, D),
              "o_proj": (D, H * hd)}
    linears = {role: r.linears(1, *s)[0] for role, s in shapes.items()}
    gate, up, down = r.linears(E, inter, D), r.linears(E, inter, D), r.linears(E, D, inter)
    return Qwen3NextMtpWeights(embed, r.linears(1, V, D)[0], norms, linears, False,
                               router=r.linears(1, E, D)[0], shared_gate=r.linears(1, 1, D)[0],
                               experts={e: (gate[e], up[e], down[e]) for e in range(E)},
                               shared=(r.linears(1, sh, D)[0], r.linears(1, sh, D)[0], r.linears(1, D, sh)[0]),
                               owners=r.owners)
