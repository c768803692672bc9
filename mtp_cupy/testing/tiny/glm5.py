"""Tiny random GLM-5 (`glm_moe_dsa`) checkpoints in the real key layout.

Small but faithful: separate nope/rope/v dims (rope 64 as GLM-5's: latent rows of 64 + 64; `dims` take any
width the kernels take, multiples of 8), q and kv LoRA, 8 indexer heads of 64 with index_topk 8 (the sparse
pick drops rows once a sequence holds more than 8; with 8 heads a row whose every relu is 0, an exact
score tie, is rare), 16 experts top-4 with no group limit (n_group 1, GLM-5's routing), vocab 512
(divides over 2, 4 and 8 ranks), the MTP layer at index num_hidden_layers = 2 with no embedding / head
copies (GLM checkpoints carry none)."""
from __future__ import annotations

from pathlib import Path

from ...weights.glm5 import BLOCK
from ...weights.writer import write_checkpoint
from .deepseek_v3 import indexer_tensors, tiny_tensors as v3_tiny_tensors

TINY_DIMS = dict(hidden_size=256, num_attention_heads=4, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32,
                 qk_rope_head_dim=64, v_head_dim=32, index_n_heads=8, index_head_dim=64, index_topk=8,
                 n_routed_experts=16, num_experts_per_tok=4, n_group=1, topk_group=1, moe_intermediate_size=64,
                 n_shared_experts=1, vocab_size=512, num_hidden_layers=2, first_k_dense_replace=1,
                 intermediate_size=512, rms_norm_eps=1e-5, routed_scaling_factor=2.5, rope_theta=10000.0)


def tiny_config(fmt: str = "bf16", **dims) -> dict:
    """config.json of a tiny GLM-5 (HF names; unknown keys in `dims` are an error)."""
    bad = set(dims) - set(TINY_DIMS)
    if bad:
        raise ValueError(f"unknown dims {sorted(bad)}; known: {sorted(TINY_DIMS)}")
    c = {**TINY_DIMS, **dims}
    c.update(model_type="glm_moe_dsa", architectures=["GlmMoeDsaForCausalLM"], hidden_act="silu",
             scoring_func="sigmoid", topk_method="noaux_tc", norm_topk_prob=True, num_nextn_predict_layers=1,
             tie_word_embeddings=False, rope_interleave=True, indexer_rope_interleave=True,
             rope_parameters={"rope_type": "default", "rope_theta": c["rope_theta"]},
             max_position_embeddings=4096, torch_dtype="bfloat16", num_key_value_heads=c["num_attention_heads"],
             head_dim=c["qk_rope_head_dim"])
    if fmt == "fp8":
        c["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                    "weight_block_size": [BLOCK, BLOCK]}
    return c


def write_tiny_checkpoint(path, seed: int = 0, fmt: str = "bf16", **dims) -> Path:
    """A small random GLM-5 MTP checkpoint (config.json + model.safetensors) in the real key layout at `path`.
    fmt "bf16" (GLM-5's BF16 release) or "fp8" (block FP8 projections with weight_scale_inv; eh_proj, router,
    weights_proj, norms, embedding and head BF16). `dims` override TINY_DIMS (HF names)."""
    if fmt not in ("fp8", "bf16"):
        raise ValueError(f"fmt {fmt!r}: choose fp8 or bf16")
    cfg = tiny_config(fmt, **dims)
    tensors = v3_tiny_tensors(cfg, seed, fmt, top_level=True, layer_copies=False)
    tensors.update(indexer_tensors(cfg, seed, fmt))
    return Path(write_checkpoint(path, tensors, config=cfg))
