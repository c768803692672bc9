"""Tiny random DeepSeek-V4 checkpoints in the real key layout and dtypes (FP8-E8M0 projections, MXFP4 routed
experts, f32 mHC parameters and sinks)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ...runtime.dtypes import BF16
from ...weights.deepseek_v4 import EMBED, HC_HEAD, HC_SITES, HEAD, NORMS, P
from ...weights.quant_host import quant_fp8_block_e8m0, quant_mxfp4
from ...weights.writer import write_checkpoint

TINY_DIMS = dict(hidden_size=256, hc_mult=4, num_attention_heads=4, head_dim=64, qk_rope_head_dim=16,
                 q_lora_rank=64, o_groups=2, o_lora_rank=64, sliding_window=8, n_routed_experts=16,
                 num_experts_per_tok=3, moe_intermediate_size=64, vocab_size=512, num_hidden_layers=2,
                 rms_norm_eps=1e-6, hc_eps=1e-6, hc_sinkhorn_iters=20, rope_theta=10000.0,
                 routed_scaling_factor=1.5, swiglu_limit=10.0)


def tiny_config(hash_routed: bool = False, **dims) -> dict:
    """config.json of a tiny DeepSeek-V4 in the official spelling (compress_ratios per layer + the MTP
    layer, whose entry is 0 = sliding window only); `hash_routed` makes the MTP layer a hash layer."""
    bad = set(dims) - set(TINY_DIMS)
    if bad:
        raise ValueError(f"unknown dims {sorted(bad)}; known: {sorted(TINY_DIMS)}")
    c = {**TINY_DIMS, **dims}
    n = c["num_hidden_layers"]
    c.update(model_type="deepseek_v4", architectures=["DeepseekV4ForCausalLM"], num_key_value_heads=1,
             n_shared_experts=1, scoring_func="sqrtsoftplus", norm_topk_prob=True, topk_method="noaux_tc",
             num_hash_layers=n + 1 if hash_routed else min(n, 1), compress_ratios=[0] + [4] * (n - 1) + [0],
             compress_rope_theta=160000.0, num_nextn_predict_layers=1, tie_word_embeddings=False,
             torch_dtype="bfloat16", expert_dtype="fp4", max_position_embeddings=65536, index_n_heads=4,
             index_head_dim=32, index_topk=8,
             quantization_config={"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                  "activation_scheme": "dynamic", "weight_block_size": [128, 128]})
    return c


def tiny_tensors(cfg: dict, seed: int, low_rank_head: bool = False, hc_head: bool = True,
                 hash_routed: bool = False) -> dict[str, np.ndarray]:
    """Random weights with activations of order one: projections N(0, 1/k), norm weights 1 + N(0, 0.1^2),
    mHC maps whose mixes are of order one, embedding N(0, 1)."""
    rng = np.random.default_rng(seed)
    D, hc, H, hd = cfg["hidden_size"], cfg["hc_mult"], cfg["num_attention_heads"], cfg["head_dim"]
    V, E, I = cfg["vocab_size"], cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    QL, G, R = cfg["q_lora_rank"], cfg["o_groups"], cfg["o_lora_rank"]
    mix = (2 + hc) * hc

    def lin(n: int, k: int) -> np.ndarray:
        return (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)

    def f32(*shape, scale=1.0, loc=0.0) -> np.ndarray:
        return (loc + scale * rng.standard_normal(shape)).astype(np.float32)

    out: dict[str, np.ndarray] = {EMBED: f32(V, D).astype(BF16), HEAD: (2.0 * lin(V, D)).astype(BF16)}
    dims = {"attn.q_norm": QL, "attn.kv_norm": hd}
    for n in NORMS:
        out[P + n + ".weight"] = f32(dims.get(n, D), scale=0.1, loc=1.0).astype(BF16)

    def fp8(module: str, w: np.ndarray) -> None:
        out[P + module + ".weight"], out[P + module + ".scale"] = quant_fp8_block_e8m0(w)

    fp8("e_proj", lin(D, D))
    fp8("h_proj", lin(D, D))
    shapes = {"wq_a": (QL, D), "wq_b": (H * hd, QL), "wkv": (hd, D), "wo_a": (G * R, H * hd // G), "wo_b": (D, G * R)}
    for n, s in shapes.items():
        fp8("attn." + n, lin(*s))
    out[P + "attn.attn_sink"] = f32(H)
    for s in HC_SITES:
        out[P + f"hc_{s}_fn"] = f32(mix, hc * D, scale=1.0 / np.sqrt(hc * D))
        out[P + f"hc_{s}_base"] = f32(mix, scale=0.5)
        out[P + f"hc_{s}_scale"] = rng.uniform(0.5, 1.5, 3).astype(np.float32)
    if low_rank_head:
        out[P + "hc_head_fn_a"] = f32(2, hc * D, scale=1.0 / np.sqrt(hc * D))
        out[P + "hc_head_fn_b"] = f32(hc, 2)
    if hc_head or low_rank_head:
        if not low_rank_head:
            out[HC_HEAD[0]] = f32(hc, hc * D, scale=1.0 / np.sqrt(hc * D))
        out[HC_HEAD[1]] = f32(hc, scale=0.5)
        out[HC_HEAD[2]] = rng.uniform(0.5, 1.5, 1).astype(np.float32)
    out[P + "ffn.gate.weight"] = lin(E, D).astype(BF16)
    if hash_routed:   # tid2eid: top_k distinct experts per token id, no selection bias
        k = cfg["num_experts_per_tok"]
        out[P + "ffn.gate.tid2eid"] = np.argsort(rng.random((V, E)), axis=1)[:, :k].astype(np.int32)
    else:
        out[P + "ffn.gate.bias"] = f32(E, scale=0.1)
    for e in range(E):
        for n, (rows, k) in {"w1": (I, D), "w3": (I, D), "w2": (D, I)}.items():
            q, s = quant_mxfp4(lin(rows, k))
            out[P + f"ffn.experts.{e}.{n}.weight"], out[P + f"ffn.experts.{e}.{n}.scale"] = q.view(np.int8), s
    for n, s in {"w1": (I, D), "w3": (I, D), "w2": (D, I)}.items():
        fp8(f"ffn.shared_experts.{n}", lin(*s))
    return out


def write_tiny_checkpoint(path, seed: int = 0, low_rank_head: bool = False, hc_head: bool = True,
                          hash_routed: bool = False, **dims) -> Path:
    """A small random DeepSeek-V4 MTP checkpoint (config.json + model.safetensors) at `path` in the real key
    layout and dtypes; `dims` override TINY_DIMS (config.json names). `hc_head=False` leaves out the mHC
    head (the proposer then takes the first stream); `low_rank_head` writes a factored one (refused);
    `hash_routed` routes the MTP layer's MoE by `ffn.gate.tid2eid[token]` (a layer below num_hash_layers)."""
    cfg = tiny_config(hash_routed, **dims)
    return Path(write_checkpoint(path, tiny_tensors(cfg, seed, low_rank_head, hc_head, hash_routed), config=cfg))
