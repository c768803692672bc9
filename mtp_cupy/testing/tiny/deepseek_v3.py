"""Tiny random DeepSeek-V3 checkpoints in the real key layout and dtypes (tests, the demo, benchmarks).

Small but structurally faithful: heads with separate nope/rope/v dims, a q LoRA, a latent narrower than
the model, group-limited routing (16 experts, 4 groups, top-2 groups, top-4), YaRN as V3's, and the MTP
layer at index num_hidden_layers = 2 (a MoE layer: first_k_dense_replace = 1). Cache rows of 128 (latent
64 + rope 64; any multiple of 8 runs: `dims` override them); q_b's per-head rows (96) cross its 128-row FP8
scale blocks, as at real dims. model_type "deepseek_v32" adds the MTP layer's DSA indexer."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ...runtime.dtypes import BF16
from ...weights import quant_host as qh
from ...weights.config import DeepseekV3Config
from ...weights.deepseek_v3 import NORMS, expert_keys, mtp_keys
from ...weights.writer import write_checkpoint

TINY_DIMS = dict(hidden_size=256, num_attention_heads=4, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32,
                 qk_rope_head_dim=64, v_head_dim=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                 topk_group=2, moe_intermediate_size=64, n_shared_experts=1, vocab_size=512, num_hidden_layers=2,
                 first_k_dense_replace=1, intermediate_size=512, rms_norm_eps=1e-6, routed_scaling_factor=2.5,
                 rope_theta=10000.0)
TINY_YARN = {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
             "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
FP8_QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def quantised(w: np.ndarray, fmt: str) -> dict[str, np.ndarray]:
    """One projection's tensors as a `fmt` checkpoint stores them (suffix -> array)."""
    if fmt == "fp8":
        q, s = qh.quant_fp8_block(w)
        return {".weight": q, ".weight_scale_inv": s}
    return {".weight": w.astype(BF16)}


# DeepSeek-V3.2 (model_type deepseek_v32): the same layer plus the DSA indexer. 8 indexer heads of 64 and
# index_topk 8, so the sparse pick drops rows once a sequence holds more than 8 (as GLM-5's tiny checkpoint)
TINY_V32 = dict(index_n_heads=8, index_head_dim=128, index_topk=8)


def tiny_config(fmt: str = "fp8", model_type: str = "deepseek_v3", **dims) -> dict:
    """config.json of a tiny DeepSeek-V3 (model_type deepseek_v3) or V3.2 (deepseek_v32, with the indexer
    fields of TINY_V32; its indexer RoPE is half-split: indexer_rope_interleave false) (HF names; unknown keys
    in `dims` are an error)."""
    v32 = model_type == "deepseek_v32"
    known = set(TINY_DIMS) | ({"index_n_heads", "index_head_dim", "index_topk", "indexer_rope_interleave"} if v32
                              else set())
    bad = set(dims) - known - {"rope_scaling"}
    if bad:
        raise ValueError(f"unknown dims {sorted(bad)}; known: {sorted(known)} and rope_scaling")
    c = {"rope_scaling": dict(TINY_YARN), **TINY_DIMS, **(TINY_V32 if v32 else {}), **dims}
    c.update(model_type=model_type, architectures=["DeepseekV32ForCausalLM" if v32 else "DeepseekV3ForCausalLM"],
             hidden_act="silu", scoring_func="sigmoid", topk_method="noaux_tc", norm_topk_prob=True,
             num_nextn_predict_layers=1, tie_word_embeddings=False, rope_interleave=True,
             max_position_embeddings=163840, torch_dtype="bfloat16", num_key_value_heads=c["num_attention_heads"])
    if v32:
        c.setdefault("indexer_rope_interleave", False)
    if fmt == "fp8":
        c["quantization_config"] = dict(FP8_QUANT)
    return c


def indexer_tensors(cfg: dict, seed: int, fmt: str) -> dict[str, np.ndarray]:
    """The MTP layer's DSA indexer (V3.2, GLM-5): wq_b and wk in `fmt` (weights_proj always BF16), the
    LayerNorm k_norm with a bias."""
    c = DeepseekV3Config.from_dict({**cfg, "model_type": "deepseek_v3"})
    K = mtp_keys(c)
    rng = np.random.default_rng(seed + 7919)
    D, nh, hd, ql = c.hidden_size, c.index_n_heads, c.index_head_dim, c.q_lora_rank

    def lin(n: int, k: int) -> np.ndarray:
        return (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)

    out: dict[str, np.ndarray] = {}
    for role, w, as_fmt in (("wq_b", lin(nh * hd, ql), fmt), ("wk", lin(hd, D), fmt),
                            ("weights_proj", lin(nh, D), "bf16")):
        out.update({K[role] + suf: a for suf, a in quantised(w, as_fmt).items()})
    out[K["k_norm"]] = (1.0 + 0.1 * rng.standard_normal(hd)).astype(BF16)
    out[K["k_norm_bias"]] = (0.1 * rng.standard_normal(hd)).astype(BF16)
    return out


def tiny_tensors(cfg: dict, seed: int, fmt: str, top_level: bool = True, layer_copies: bool = True) -> dict[str, np.ndarray]:
    """Random weights with activations of order one: projections N(0, 1/k), norm weights 1 + N(0, 0.1^2),
    embedding N(0, 1), an LM head scaled x3 (clear top-2 margins), router N(0, 1/k) plus a correction bias
    N(0, 0.3^2) (routing decisions away from ties)."""
    rng = np.random.default_rng(seed)
    c = DeepseekV3Config.from_dict(cfg)
    K = mtp_keys(c)
    D, V, H = c.hidden_size, c.vocab_size, c.num_attention_heads
    C, dn, dr, dv, lora = c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.q_lora_rank
    E, inter = c.n_routed_experts, c.moe_intermediate_size

    def lin(n: int, k: int, scale: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((n, k)) * scale / np.sqrt(k)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(BF16)

    out: dict[str, np.ndarray] = {}

    def proj(prefix: str, w: np.ndarray, as_fmt: str = fmt) -> None:
        out.update({prefix + suf: a for suf, a in quantised(w, as_fmt).items()})

    embed = rng.standard_normal((V, D)).astype(BF16)
    head = lin(V, D, 3.0).astype(BF16)
    if top_level:
        out[c.embed_keys[0]], out[c.head_keys[0]] = embed, head
    if layer_copies:
        out[K["embed_copy"]], out[K["head_copy"]] = embed, head
    for n in NORMS:
        out[K[n]] = norm(D)
    out[K["q_a_layernorm"]], out[K["kv_a_layernorm"]] = norm(lora), norm(C)
    proj(K["eh_proj"], lin(D, 2 * D), "bf16")           # BF16 even in FP8 checkpoints (A.1)
    proj(K["q_a_proj"], lin(lora, D))
    proj(K["q_b_proj"], lin(H * (dn + dr), lora))
    proj(K["kv_a_proj_with_mqa"], lin(C + dr, D))
    proj(K["kv_b_proj"], lin(H * (dn + dv), C))
    proj(K["o_proj"], lin(D, H * dv))
    proj(K["gate"], lin(E, D), "bf16")
    out[K["bias"]] = (0.3 * rng.standard_normal(E)).astype(np.float32)
    for e in [*range(E), None]:
        g, u, d = expert_keys(c, e)
        i = inter * (c.n_shared_experts if e is None else 1)
        proj(g, lin(i, D))
        proj(u, lin(i, D))
        proj(d, lin(D, i))
    return out


def write_tiny_checkpoint(path, seed: int = 0, fmt: str = "fp8", top_level: bool = True, layer_copies: bool = True,
                          model_type: str = "deepseek_v3", distinct_copies: bool = False, **dims) -> Path:
    """A small random DeepSeek-V3 MTP checkpoint (config.json + model.safetensors) in the real key layout
    and dtypes at `path`. fmt "fp8": block-FP8 projections with weight_scale_inv (eh_proj, router, norms,
    embedding and head BF16, the correction bias F32); "bf16": every projection BF16. top_level /
    layer_copies choose which embedding/head copies exist (`distinct_copies`: the layer's copies get values of
    their own, so a test sees which one loads); model_type "deepseek_v32" adds the DSA indexer to the MTP
    layer; `dims` override TINY_DIMS (and TINY_V32) (HF names)."""
    if fmt not in ("fp8", "bf16"):
        raise ValueError(f"fmt {fmt!r}: choose fp8 or bf16")
    if model_type not in DeepseekV3Config.model_types:
        raise ValueError(f"model_type {model_type!r}: choose one of {DeepseekV3Config.model_types}")
    cfg = tiny_config(fmt, model_type, **dims)
    tensors = tiny_tensors(cfg, seed, fmt, top_level, layer_copies)
    if model_type == "deepseek_v32":
        tensors.update(indexer_tensors(cfg, seed, fmt))
    if distinct_copies and layer_copies:
        K, rng = mtp_keys(DeepseekV3Config.from_dict(cfg)), np.random.default_rng(seed + 104729)
        for key in (K["embed_copy"], K["head_copy"]):
            tensors[key] = (rng.standard_normal(tensors[key].shape) * (1.0 if key == K["embed_copy"] else 3.0)
                            / (1.0 if key == K["embed_copy"] else np.sqrt(tensors[key].shape[1]))).astype(BF16)
    return Path(write_checkpoint(path, tensors, config=cfg))
