"""DeepSeek-V3/R1 at its real dims: the config, random weights in the real formats (FP8 block with f32
weight_scale_inv; BF16 eh_proj, router, embedding and head), and the phases of one step. W_UK^T is random
rather than the transpose of kv_b_proj: the bytes and kernels are those of a real checkpoint."""
from __future__ import annotations

from .. import ops
from ..testing.tiny.deepseek_v3 import TINY_DIMS, TINY_YARN
from ..weights.deepseek_v3 import NORMS, DeepseekV3MtpWeights
from ..weights.linear import Linear
from .random_device import RandomDevice

REAL = dict(model_type="deepseek_v3", hidden_size=7168, num_hidden_layers=61, num_attention_heads=128,
            q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
            moe_intermediate_size=2048, n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4,
            n_shared_experts=1, routed_scaling_factor=2.5, vocab_size=129280, rms_norm_eps=1e-6, rope_theta=10000.0,
            first_k_dense_replace=3, rope_scaling=TINY_YARN)
TINY = {**REAL, **TINY_DIMS}


def mla_norms(r: RandomDevice, cfg) -> dict:
    """The MTP layer's norms of an MLA family (V3, GLM-5), N(1, 0.01)."""
    norms = {n: r.bf16(cfg.hidden_size, 0.1, 1.0) for n in NORMS}
    norms.update(q_a_layernorm=r.bf16(cfg.q_lora_rank, 0.1, 1.0), kv_a_layernorm=r.bf16(cfg.kv_lora_rank, 0.1, 1.0))
    return norms


def random_weights(gpu, cfg, seed: int) -> DeepseekV3MtpWeights:
    """A random DeepSeek-V3 MTP layer of the dims of `cfg` (DeepseekV3Config) on `gpu`, drawn from `RandomDevice(gpu, seed)`."""
    r = RandomDevice(gpu, seed)
    D, V, H = cfg.hidden_size, cfg.vocab_size, cfg.num_attention_heads
    C, dn, dr, dv, QL = cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.q_lora_rank
    E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
    fp8 = r.fp8_block
    norms = mla_norms(r, cfg)
    return DeepseekV3MtpWeights(
        embed=r.bf16(V * D, 1.0), head=Linear("bf16", V, D, r.bf16(V * D, D ** -0.5)), norms=norms,
        eh_proj=Linear("bf16", D, 2 * D, r.bf16(2 * D * D, (2 * D) ** -0.5)), q_a=fp8(QL, D),
        q_b=fp8(H * (dn + dr), QL), kv_a=fp8(C + dr, D), w_uk_t=fp8(H * C, dn), kv_b=fp8(H * (dn + dv), C),
        o_proj=fp8(D, H * dv), router=Linear("bf16", E, D, r.bf16(E * D, D ** -0.5)), bias=r.f32(E, 0.1),
        experts={e: (fp8(I, D), fp8(I, D), fp8(D, I)) for e in range(E)},
        shared=(fp8(I, D), fp8(I, D), fp8(D, I)), owners=r.owners)


def phases(prop) -> dict:
    """The parts of one V3 draft step, each a callable re-running it on the newest row (slab staged)."""
    gpu, b = prop.gpu, prop.bufs
    return {
        "front (embed, norms, eh_proj, ln)": lambda: (prop.front.forward(b.ids, prop.carry, b.x, 1),
                                                      prop.norm("input_layernorm", b.x, b.xn, 1)),
        "MLA (absorbed decode)": lambda: prop.mla.forward(b.xn, b.tmp, 1, prop.meta, prop.meta_stride),
        "residual + post-attn norm (fused)": lambda: prop.norm.add("post_attention_layernorm", b.x, b.tmp, b.xn, 1),
        "MoE (router, 8 + shared)": lambda: prop.moe.forward(b.xn, b.tmp, m=1),
        "residual + shared_head.norm (fused)": lambda: prop.norm.add("shared_head.norm", b.x, b.tmp, b.xn, 1),
        "LM head": lambda: ops.linear(gpu, b.xn, prop.head, b.logits, 1, out_dtype="f32"),
        "argmax": lambda: prop._pick(0, 1, b.logits, False, False),
    }
