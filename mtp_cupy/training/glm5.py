"""The tiny GLM-5 (`glm_moe_dsa`: MLA + MoE + the DSA indexer, byte vocabulary) and its MTP module: DeepSeek-V3's
(enorm / hnorm / eh_proj, the MoE decoder layer, shared_head.norm, the target's head; docs/model_math.md C.3),
whose layer carries an indexer. index_topk 32 is below the context the held-out runs reach (64-byte prompts +
48 tokens), so the sparse pick drops rows in the target and in the MTP layer. The indexer is transformers'
(computed under no_grad: its weights keep their initial values; the pick is a fixed random projection).

Exported as the target through transformers (shard 1) and the MTP layer at `model.layers.{num_hidden_layers}.*`
(shard 2), as GLM-5 releases lay it out (no embedding / head copies in the MTP layer)."""
from __future__ import annotations

from pathlib import Path

from ..testing.hf_targets import hf_config
from ..testing.tiny.glm5 import tiny_config
from .common import VOCAB, as_stored, export_two_shards
from .deepseek_v3 import F32, head_class, one_layer

DIMS = dict(hidden_size=256, num_attention_heads=4, q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32,
            qk_rope_head_dim=64, v_head_dim=32, index_n_heads=4, index_head_dim=64, index_topk=32,
            n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1, moe_intermediate_size=128,
            n_shared_experts=1, vocab_size=VOCAB, num_hidden_layers=4, first_k_dense_replace=1,
            intermediate_size=768, rms_norm_eps=1e-5, routed_scaling_factor=2.5, rope_theta=10000.0)
CONFIG = tiny_config("bf16", **DIMS)


def build(device, cfg: dict = CONFIG):
    """(target GlmMoeDsaForCausalLM, its MTP head), random weights from torch's seed."""
    from transformers import AutoModelForCausalLM
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaRMSNorm
    hc = hf_config("glm5", cfg)
    target = AutoModelForCausalLM.from_config(hc, attn_implementation="eager")
    layer, model = one_layer(hc)
    attn = layer.self_attn   # transformers leaves the latent norms at 1e-6; GLM-5 (vLLM, SGLang): rms_norm_eps
    attn.q_a_layernorm.variance_epsilon = attn.kv_a_layernorm.variance_epsilon = cfg["rms_norm_eps"]
    return target.to(device), head_class()(layer, model, GlmMoeDsaRMSNorm, target).to(device)


def export(target, head, out: Path, cfg: dict = CONFIG) -> int:
    mtp = as_stored(head.tensors(f"model.layers.{cfg['num_hidden_layers']}."), F32)
    return export_two_shards(target, mtp, cfg, out)
