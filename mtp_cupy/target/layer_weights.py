"""Device weights of one DeepSeek-V3-layout decoder layer at any key prefix (MLA + MoE or dense MLP)."""
from __future__ import annotations

from dataclasses import dataclass

from ..layers.mla import MlaWeights
from ..runtime.ptr import NULL, DevicePtr
from ..weights.config import DeepseekV3Config
from ..weights.deepseek_v3 import PROJ, _grouped, transpose_uk
from ..weights.linear import Linear
from ..weights.loader import WeightLoader


@dataclass
class LayerWeights:
    input_norm: DevicePtr
    post_norm: DevicePtr
    mla: MlaWeights
    dense: tuple[Linear, Linear, Linear] | None         # the MLP of a dense layer
    router: Linear | None                               # MoE layers
    bias: DevicePtr = NULL
    experts: dict | None = None
    shared: tuple[Linear, Linear, Linear] | None = None


def load_layer(wl: WeightLoader, cfg: DeepseekV3Config, prefix: str, moe: bool) -> LayerWeights:
    D, H = cfg.hidden_size, cfg.num_attention_heads
    C, dn, dr, dv = cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    a, m, lora = prefix + "self_attn.", prefix + "mlp.", cfg.q_lora_rank

    def vec(key, n, as_dtype="bf16"):
        buf = wl.tensor(key, (n,), as_dtype=as_dtype)
        owners.append(buf)
        return buf.ptr

    def mlp(base, inter):
        return tuple(wl.linear(f"{base}{p}", *((inter, D) if p != "down_proj" else (D, inter))) for p in PROJ)

    owners: list = []
    mla = MlaWeights(
        q_a=wl.linear(a + "q_a_proj", lora, D) if lora else None,
        q_a_norm=vec(a + "q_a_layernorm.weight", lora) if lora else NULL,
        q_b=_grouped(wl, a + ("q_b_proj" if lora else "q_proj"), H * (dn + dr), lora or D),
        kv_a=wl.linear(a + "kv_a_proj_with_mqa", C + dr, D), kv_a_norm=vec(a + "kv_a_layernorm.weight", C),
        w_uk_t=transpose_uk(wl.gpu, wl.ckpt, a + "kv_b_proj", H, dn, dv, C),
        kv_b=_grouped(wl, a + "kv_b_proj", H * (dn + dv), C), o_proj=wl.linear(a + "o_proj", D, H * dv))
    lw = LayerWeights(vec(prefix + "input_layernorm.weight", D), vec(prefix + "post_attention_layernorm.weight", D),
                      mla, None, None)
    if not moe:
        lw.dense = mlp(m, cfg.intermediate_size)
    else:
        E, inter = cfg.n_routed_experts, cfg.moe_intermediate_size
        lw.router = wl.linear(m + "gate", E, D)
        lw.bias = vec(m + "gate.e_score_correction_bias", E, "f32")
        lw.experts = {e: mlp(f"{m}experts.{e}.", inter) for e in range(E)}
        if cfg.n_shared_experts:
            lw.shared = mlp(m + "shared_experts.", inter * cfg.n_shared_experts)
    lw.owners = owners
    return lw
