"""Tiny random Qwen3-Next MTP checkpoints, each tensor stored the way a real `quant` checkpoint stores it:

  fp8    Qwen/DeepSeek block FP8: `.weight` F8_E4M3 [n, k] + `.weight_scale_inv` F32 [ceil(n/128), ceil(k/128)];
         the router, the shared-expert gate, norms, embedding and LM head stay BF16.
  nvfp4  ModelOpt: `.weight` U8 [n, k/2] + `.weight_scale` F8_E4M3 [n, k/16] + `.weight_scale_2` F32 [] +
         `.input_scale` F32 []; `hf_quant_config.json` lists what stays BF16 (`exclude_modules`): here the
         LM head, router, shared-expert gate and `mtp.fc`, so one checkpoint mixes both kinds."""
from __future__ import annotations

import fnmatch
import json
from pathlib import Path

import numpy as np

from ...runtime.dtypes import BF16
from ...weights.quant_host import quant_fp8_block, quant_nvfp4
from ...weights.qwen3_next import (ATTN_LINEARS, DENSE_FFN, EMBED, LM_HEAD, MTP, NORMS, ROUTER, SHARED_EXPERT,
                                   SHARED_GATE, expert)
from ...weights.writer import write_checkpoint

TINY_DIMS = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                 partial_rotary_factor=0.25, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=64,
                 shared_expert_intermediate_size=64, intermediate_size=128, vocab_size=512,
                 rope_theta=10000000.0, rms_norm_eps=1e-6, num_hidden_layers=4, full_attention_interval=4)
NVFP4_EXCLUDE = ["lm_head", MTP + "fc", "*.mlp.gate", "*.shared_expert_gate"]
FP8_EXCLUDE = ["lm_head", "*.mlp.gate", "*.shared_expert_gate"]


def tiny_config(quant: str = "bf16", **dims) -> dict:
    """config.json of a tiny Qwen3-Next (HF names; unknown keys in `dims` are an error)."""
    bad = set(dims) - set(TINY_DIMS)
    if bad:
        raise ValueError(f"unknown dims {sorted(bad)}; known: {sorted(TINY_DIMS)}")
    c = {**TINY_DIMS, **dims}
    n = c["num_hidden_layers"]
    c.update(model_type="qwen3_next", architectures=["Qwen3NextForCausalLM"], hidden_act="silu",
             norm_topk_prob=True, tie_word_embeddings=False, mtp_num_hidden_layers=1, decoder_sparse_step=1,
             max_position_embeddings=32768, torch_dtype="bfloat16",
             layer_types=["full_attention" if (i + 1) % c["full_attention_interval"] == 0 else "linear_attention"
                          for i in range(n)])
    if quant == "fp8":
        c["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                    "weight_block_size": [128, 128], "modules_to_not_convert": FP8_EXCLUDE}
    elif quant == "nvfp4":
        c["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                                    "exclude_modules": NVFP4_EXCLUDE}
    return c


def _excluded(module: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(module, p) for p in patterns)


def _store(out: dict[str, np.ndarray], module: str, w: np.ndarray, quant: str) -> None:
    """One linear under `module`, in the format a real `quant` checkpoint stores it."""
    if quant == "fp8" and not _excluded(module, FP8_EXCLUDE):
        out[module + ".weight"], out[module + ".weight_scale_inv"] = quant_fp8_block(w)
    elif quant == "nvfp4" and not _excluded(module, NVFP4_EXCLUDE):
        q, s, s2 = quant_nvfp4(w)
        out[module + ".weight"], out[module + ".weight_scale"] = q, s
        out[module + ".weight_scale_2"] = np.array(s2, np.float32)
        out[module + ".input_scale"] = np.array(1.0, np.float32)
    else:
        out[module + ".weight"] = w.astype(BF16)


def tiny_tensors(cfg: dict, seed: int, quant: str, dense_ffn: bool) -> dict[str, np.ndarray]:
    """Random weights with activations of order one: linears N(0, 1/k), norm weights N(0, 0.1^2) (the
    (1 + w) convention), embedding N(0, 1)."""
    rng = np.random.default_rng(seed)
    D, H, KV, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    V = cfg["vocab_size"]

    def lin(n: int, k: int) -> np.ndarray:
        return (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)

    out: dict[str, np.ndarray] = {EMBED: rng.standard_normal((V, D)).astype(BF16)}
    for key in NORMS.values():
        dim = hd if key in (NORMS["q_norm"], NORMS["k_norm"]) else D
        out[key] = (0.1 * rng.standard_normal(dim)).astype(BF16)
    shapes = {"fc": (D, 2 * D), "q_proj": (2 * H * hd, D), "k_proj": (KV * hd, D), "v_proj": (KV * hd, D),
              "o_proj": (D, H * hd)}
    for role, module in ATTN_LINEARS.items():
        _store(out, module, lin(*shapes[role]), quant)
    if dense_ffn:
        inter = cfg["intermediate_size"]
        for role, module in DENSE_FFN.items():
            _store(out, module, lin(D, inter) if role == "down_proj" else lin(inter, D), quant)
    else:
        E, inter, sh = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["shared_expert_intermediate_size"]
        _store(out, ROUTER, lin(E, D), quant)
        _store(out, SHARED_GATE, lin(1, D), quant)
        for prefixes, i in [(expert(e), inter) for e in range(E)] + [(SHARED_EXPERT, sh)]:
            g, u, d = prefixes
            _store(out, g, lin(i, D), quant)
            _store(out, u, lin(i, D), quant)
            _store(out, d, lin(D, i), quant)
    _store(out, LM_HEAD[:-len(".weight")], lin(V, D), quant)
    return out


def write_tiny_checkpoint(path, seed: int = 0, quant: str = "bf16", dense_ffn: bool = False, **dims) -> Path:
    """A small random Qwen3-Next MTP checkpoint (config.json + model.safetensors, plus ModelOpt's
    hf_quant_config.json for nvfp4) at `path`; `dims` override TINY_DIMS (HF config names)."""
    if quant not in ("bf16", "fp8", "nvfp4"):
        raise ValueError(f"quant {quant!r}: choose bf16, fp8 or nvfp4")
    if dense_ffn:   # Qwen3NextConfig: num_experts == 0 marks a dense-FFN head
        dims = {"num_experts": 0, "num_experts_per_tok": 0, **dims}
    cfg = tiny_config(quant, **dims)
    d = write_checkpoint(path, tiny_tensors(cfg, seed, quant, dense_ffn), config=cfg)
    if quant == "nvfp4":
        hq = {"producer": {"name": "modelopt"},
              "quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": NVFP4_EXCLUDE,
                               "kv_cache_quant_algo": None}}
        (Path(d) / "hf_quant_config.json").write_text(json.dumps(hq, indent=2) + "\n")
    return Path(d)
