"""DeepSeek-V4-Flash at its real dims: the config, random weights in the real formats (FP8 with e8m0 scales,
MXFP4 routed experts, FP8 shared expert; BF16 router, embedding and head), and the phases of one step."""
from __future__ import annotations

from .. import ops
from ..runtime.ptr import NULL
from ..weights.deepseek_v4 import HC_SITES, NORMS, DeepseekV4MtpWeights, HcParams
from ..weights.linear import Linear
from .random_device import RandomDevice

REAL = dict(model_type="deepseek_v4", hidden_size=4096, num_hidden_layers=43, num_attention_heads=64, head_dim=512,
            qk_rope_head_dim=64, q_lora_rank=1024, o_groups=8, o_lora_rank=1024, sliding_window=128,
            n_routed_experts=256, num_experts_per_tok=6, n_shared_experts=1, moe_intermediate_size=2048,
            vocab_size=129280, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6,
            routed_scaling_factor=1.5, swiglu_limit=10.0, scoring_func="sqrtsoftplus", rope_theta=10000.0,
            num_hash_layers=3, compress_ratios=[0, 0] + [4, 128] * 20 + [4, 0])
TINY = {**REAL, "hidden_size": 256, "num_attention_heads": 4, "head_dim": 64, "qk_rope_head_dim": 16,
        "q_lora_rank": 128, "o_groups": 2, "o_lora_rank": 128, "n_routed_experts": 16, "num_experts_per_tok": 3,
        "moe_intermediate_size": 64, "vocab_size": 512, "sliding_window": 8}


def random_weights(gpu, cfg, seed: int) -> DeepseekV4MtpWeights:
    """A random DeepSeek-V4 MTP layer of the dims of `cfg` (DeepseekV4Config) on `gpu`, drawn from `RandomDevice(gpu, seed)`."""
    r = RandomDevice(gpu, seed)
    D, hc, V, H, hd = cfg.hidden_size, cfg.hc_mult, cfg.vocab_size, cfg.num_attention_heads, cfg.head_dim
    E, I, QL, G, R = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank
    mix = (2 + hc) * hc
    dims = {"attn.q_norm": QL, "attn.kv_norm": hd}
    hc_site = {s: HcParams(r.f32(mix * hc * D, (hc * D) ** -0.5), r.f32(mix, 0.5), r.f32(3, 0.1, 1.0))
               for s in HC_SITES}
    return DeepseekV4MtpWeights(
        embed=r.bf16(V * D, 1.0), head=Linear("bf16", V, D, r.bf16(V * D, D ** -0.5)),
        norms={n: r.bf16(dims.get(n, D), 0.1, 1.0) for n in NORMS}, e_proj=r.fp8(D, D), h_proj=r.fp8(D, D),
        hc=hc_site, hc_head=HcParams(r.f32(hc * hc * D, (hc * D) ** -0.5), r.f32(hc, 0.5), r.f32(1, 0.1, 1.0)),
        attn={"wq_a": r.fp8(QL, D), "wq_b": r.fp8(H * hd, QL), "wkv": r.fp8(hd, D), "wo_a": r.fp8(G * R, H * hd // G),
              "wo_b": r.fp8(D, G * R)},
        attn_sink=r.f32(H, 1.0), router=Linear("bf16", E, D, r.bf16(E * D, D ** -0.5)), router_bias=r.f32(E, 0.1),
        tid2eid=NULL, experts={e: (r.mxfp4(I, D), r.mxfp4(I, D), r.mxfp4(D, I)) for e in range(E)},
        shared=(r.fp8(I, D), r.fp8(I, D), r.fp8(D, I)), owners=r.owners)


def phases(prop) -> dict:
    """The parts of one V4 draft step, each a callable re-running it on the newest row (slab staged)."""
    gpu, b, w = prop.gpu, prop.bufs, prop.norm.weight
    ids, meta, cap = b.ids, prop.meta, prop.meta_stride
    return {
        "front (gather + norms, e/h_proj) + mHC add + attn pre + norm": lambda: prop._front(ids, prop.carry, 1, True),
        "attention": lambda: prop.attn.forward(b.xn, b.f, 1, meta, cap),
        "mHC attn post + ffn pre + norm": lambda: prop.mhc.post_pre("attn", b.f, b.X, "ffn", w("ffn_norm"), b.xn, 1),
        "MoE": lambda: prop.moe.forward(b.xn, b.f, m=1, token_ids=ids),
        "mHC ffn post + head + norm": lambda: prop.mhc.post_head("ffn", b.f, b.X, w("norm"), b.xn, 1),
        "LM head": lambda: ops.linear(gpu, b.xn, prop.head, b.logits, 1, out_dtype="f32"),
        "argmax": lambda: prop._pick(0, 1, b.logits, False, False),
    }
