"""GLM-5 at its real dims: the config and one rank's shard of a random MTP layer in GLM-5-FP8's formats (block
FP8 projections and indexer wq_b / wk; BF16 eh_proj, router, weights_proj, embedding and head)."""
from __future__ import annotations

from ..layers.dsa import IndexerWeights
from ..testing.tiny.glm5 import TINY_DIMS
from ..weights.glm5 import Glm5MtpWeights, Shard
from ..weights.linear import Linear
from .deepseek_v3 import mla_norms
from .random_device import RandomDevice

REAL = dict(model_type="glm_moe_dsa", hidden_size=6144, num_hidden_layers=78, num_attention_heads=64,
            q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256,
            index_n_heads=32, index_head_dim=128, index_topk=2048, n_routed_experts=256, num_experts_per_tok=8,
            n_group=1, topk_group=1, moe_intermediate_size=2048, n_shared_experts=1, vocab_size=154880,
            rms_norm_eps=1e-5, routed_scaling_factor=2.5, first_k_dense_replace=3,
            rope_parameters={"rope_type": "default", "rope_theta": 8e6})
TINY = {**REAL, **TINY_DIMS}


def random_weights(gpu, cfg, shard: Shard | None = None, seed: int = 0, quant: str = "fp8") -> Glm5MtpWeights:
    """This rank's shard of a random GLM-5 MTP layer of `cfg`'s dims, made on the device (values about N(0, 1/k)).

    Parameters
    ----------
    gpu : mtp_cupy Backend
        The device.
    cfg : GlmMoeDsaConfig
        The dims.
    shard : Shard, optional
        This rank's part of the heads, experts, shared expert and vocab (default: all of them, one GPU).
    seed : int, default 0
        Generator seed; rank r draws with seed + r.
    quant : {"fp8", "bf16"}, default "fp8"
        Format of the projections and experts.
    """
    shard = shard or Shard()
    r = RandomDevice(gpu, seed + shard.rank)
    D, V, H, QL = cfg.hidden_size, cfg.vocab_size, cfg.num_attention_heads, cfg.q_lora_rank
    C, dn, dr, dv = cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    E, I, nh, hd = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.index_n_heads, cfg.index_head_dim
    h0, hl = shard.split(H, "heads")
    e0, el = shard.split(E, "experts")
    _, sl = shard.split(I * cfg.n_shared_experts, "shared-expert intermediate")
    v0, vn = shard.vocab(V)

    def bf16(n: int, k: int) -> Linear:
        return Linear("bf16", n, k, r.bf16(n * k, k ** -0.5))

    def proj(n: int, k: int) -> Linear:
        return r.fp8_block(n, k) if quant == "fp8" else bf16(n, k)

    norms = mla_norms(r, cfg)
    indexer = IndexerWeights(proj(nh * hd, QL), proj(hd, D), r.bf16(hd, 0.1, 1.0), r.bf16(hd, 0.1), bf16(nh, D))
    return Glm5MtpWeights(
        embed=r.bf16(V * D, 1.0), head=bf16(vn, D), norms=norms, eh_proj=bf16(D, 2 * D), q_a=proj(QL, D),
        q_b=proj(hl * (dn + dr), QL), kv_a=proj(C + dr, D), w_uk_t=proj(hl * C, dn), kv_b=proj(hl * (dn + dv), C),
        o_proj=proj(D, hl * dv), router=bf16(E, D), bias=r.f32(E, 0.1),
        experts={e: (proj(I, D), proj(I, D), proj(D, I)) for e in range(e0, e0 + el)},
        shared=(proj(sl, D), proj(sl, D), proj(D, sl)), owners=r.owners, indexer=indexer, shard=shard,
        heads=(h0, hl), head_v0=v0)
