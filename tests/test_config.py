"""config.json parsing for the four families (values from docs/model_math.md) and its errors."""
import json

import pytest

from mtp_cupy.errors import ConfigError
from mtp_cupy.weights.config import (DeepseekV3Config, DeepseekV4Config, GlmMoeDsaConfig, Qwen3NextConfig,
                                     load_config)

V3_671B = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
    "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "rms_norm_eps": 1e-6, "vocab_size": 129280, "n_routed_experts": 256,
    "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
    "scoring_func": "sigmoid", "topk_method": "noaux_tc", "n_shared_experts": 1, "first_k_dense_replace": 3,
    "max_position_embeddings": 163840, "rope_theta": 10000, "num_nextn_predict_layers": 1,
    "rope_scaling": {"type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1},
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128]},
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}

V4_FLASH = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "hidden_size": 4096,
    "num_hidden_layers": 43, "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512,
    "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024, "sliding_window": 128,
    "rms_norm_eps": 1e-6, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "n_routed_experts": 256,
    "num_experts_per_tok": 6, "n_shared_experts": 1, "moe_intermediate_size": 2048, "scoring_func": "sqrtsoftplus",
    "routed_scaling_factor": 1.5, "norm_topk_prob": True, "topk_method": "noaux_tc", "swiglu_limit": 10.0,
    "num_hash_layers": 3, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512, "rope_theta": 10000,
    "compress_rope_theta": 160000, "vocab_size": 129280, "num_nextn_predict_layers": 1,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32,
                     "beta_slow": 1},
    "compress_ratios": [0, 0] + [4 if i % 2 == 0 else 128 for i in range(41)] + [0],
    "expert_dtype": "fp4",
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                            "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
}

QWEN3_NEXT_80B = {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": 2048,
    "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-6, "vocab_size": 151936, "num_experts": 512,
    "num_experts_per_tok": 10, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
    "intermediate_size": 5120, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "full_attention_interval": 4, "rope_theta": 10000000, "rope_scaling": None, "tie_word_embeddings": False,
    "max_position_embeddings": 262144, "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False,
}

GLM5 = {
    "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "hidden_size": 6144,
    "num_hidden_layers": 78, "num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 2048,
    "kv_lora_rank": 512, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256,
    "index_n_heads": 32, "index_head_dim": 128, "index_topk": 2048, "n_routed_experts": 256,
    "num_experts_per_tok": 8, "n_shared_experts": 1, "moe_intermediate_size": 2048, "routed_scaling_factor": 2.5,
    "vocab_size": 154880, "first_k_dense_replace": 3, "num_nextn_predict_layers": 1,
    "rope_parameters": {"rope_theta": 8000000, "rope_type": "default"}, "indexer_rope_interleave": True,
    "index_topk_freq": 4, "index_skip_topk_offset": 3,
}


def test_deepseek_v3_671b():
    c = load_config(V3_671B)
    assert isinstance(c, DeepseekV3Config) and c.family == "deepseek_v3"
    assert (c.hidden_size, c.vocab_size, c.num_attention_heads, c.kv_lora_rank, c.qk_head_dim) == \
        (7168, 129280, 128, 512, 192)
    assert (c.n_group, c.topk_group, c.routed_scaling_factor, c.norm_topk_prob, c.scoring_func) == \
        (8, 4, 2.5, True, "sigmoid")
    assert c.first_k_dense_replace == 3 and c.mtp_is_moe and c.num_mtp_layers == 1
    assert c.rope.yarn and c.rope.factor == 40 and c.rope.original_max_position_embeddings == 4096
    assert (c.rope.theta, c.rope.mscale, c.rope.mscale_all_dim, c.rope.beta_fast, c.rope.beta_slow) == \
        (10000, 1.0, 1.0, 32, 1)
    assert c.rope_interleave and not c.has_indexer
    assert c.quant.method == "fp8" and c.quant.weight_block_size == (128, 128) and c.quant.fmt == "e4m3"
    assert c.mtp_prefix == "model.layers.61." and c.embed_keys[0] == "model.embed_tokens.weight"
    assert c.raw["torch_dtype"] == "bfloat16"


def test_deepseek_v32_and_defaults():
    d = {**V3_671B, "model_type": "deepseek_v32", "index_n_heads": 64, "index_head_dim": 128, "index_topk": 2048}
    del d["num_key_value_heads"], d["n_group"]
    c = load_config(d)
    assert c.family == "deepseek_v3" and c.has_indexer and c.index_topk == 2048
    assert not c.indexer_rope_interleave and c.num_key_value_heads == 128 and c.n_group == 8
    assert load_config({**V3_671B, "q_lora_rank": None}).q_lora_rank is None


def test_deepseek_v4_flash():
    c = load_config(V4_FLASH)
    assert isinstance(c, DeepseekV4Config) and c.family == "deepseek_v4"
    assert (c.hidden_size, c.head_dim, c.qk_rope_head_dim, c.o_groups, c.o_lora_rank, c.sliding_window) == \
        (4096, 512, 64, 8, 1024, 128)
    assert (c.hc_mult, c.hc_sinkhorn_iters, c.hc_eps, c.swiglu_limit, c.num_hash_layers) == (4, 20, 1e-6, 10.0, 3)
    assert c.scoring_func == "sqrtsoftplus" and c.num_experts_per_tok == 6 and c.routed_scaling_factor == 1.5
    assert len(c.compress_ratios) == 44 and c.compress_ratios[2:4] == (4, 128) and c.compress_ratios[42] == 4
    assert c.mtp_compress_ratio == 0 and c.mtp_prefix == "mtp.0." and c.embed_keys[0] == "embed.weight"
    assert c.rope.type == "default" and c.rope.theta == 10000 and c.rope.partial_rotary_factor == 0.125
    assert c.compress_rope.yarn and c.compress_rope.theta == 160000 and c.compress_rope.factor == 16
    assert c.compress_rope.original_max_position_embeddings == 65536
    assert c.quant.scale_fmt == "ue8m0" and c.quant.expert_dtype == "fp4"


def test_deepseek_v4_transformers5_spelling():
    d = {k: v for k, v in V4_FLASH.items() if k not in ("compress_ratios", "num_hash_layers", "qk_rope_head_dim",
                                                      "rope_scaling")}
    kinds = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
    d["layer_types"] = [kinds[r] for r in V4_FLASH["compress_ratios"][:43]]
    d["mlp_layer_types"] = ["hash_moe"] * 3 + ["moe"] * 40
    d["partial_rotary_factor"] = 0.125
    d["rope_parameters"] = {"main": {"rope_type": "default", "rope_theta": 10000.0},
                            "compress": {"rope_type": "yarn", "rope_theta": 160000.0, "factor": 16,
                                         "original_max_position_embeddings": 65536, "attention_factor": 1.0}}
    c = load_config(d)
    assert c.compress_ratios == tuple(V4_FLASH["compress_ratios"][:43]) and c.mtp_compress_ratio == 0
    assert c.num_hash_layers == 3 and c.qk_rope_head_dim == 64
    assert c.rope.theta == 10000 and not c.rope.yarn
    assert c.compress_rope.yarn and c.compress_rope.attention_factor == 1.0


def test_qwen3_next_80b():
    c = load_config(QWEN3_NEXT_80B)
    assert isinstance(c, Qwen3NextConfig) and c.family == "qwen3_next"
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rotary_dim) == (16, 2, 256, 64)
    assert (c.num_experts, c.num_experts_per_tok, c.shared_expert_intermediate_size) == (512, 10, 512)
    assert c.mtp_is_moe and c.mtp_prefix == "mtp." and c.num_mtp_layers == 1 and c.rope.theta == 1e7
    assert c.quant is None and c.mlp_only_layers == ()
    d = {k: v for k, v in QWEN3_NEXT_80B.items() if k not in ("rope_theta", "partial_rotary_factor", "rope_scaling")}
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}
    assert load_config(d).rotary_dim == 64 and load_config(d).rope.theta == 1e7


def test_qwen3_5_moe_text_config():
    text = {k: v for k, v in QWEN3_NEXT_80B.items() if k != "model_type"}
    text.update(model_type="qwen3_5_moe_text", num_experts=256, num_experts_per_tok=8, vocab_size=248320)
    d = {"model_type": "qwen3_5_moe", "text_config": text, "vision_config": {"depth": 27},
         "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    c = load_config(d)
    assert c.family == "qwen3_next" and c.model_type == "qwen3_5_moe" and c.vocab_size == 248320
    assert c.num_experts == 256 and c.quant.weight_block_size == (128, 128)
    dense = load_config({**text, "model_type": "qwen3_5_text", "num_experts": 0, "intermediate_size": 12288})
    assert not dense.mtp_is_moe and dense.intermediate_size == 12288


def test_glm5():
    c = load_config(GLM5)
    assert isinstance(c, GlmMoeDsaConfig) and c.family == "glm5"
    assert c.rms_norm_eps == 1e-5 and (c.n_group, c.topk_group) == (1, 1)
    assert (c.qk_nope_head_dim, c.v_head_dim, c.qk_head_dim, c.index_n_heads, c.index_topk) == (192, 256, 256, 32, 2048)
    assert c.indexer_rope_interleave and c.has_indexer and c.rope.theta == 8e6 and not c.rope.yarn
    assert c.mtp_prefix == "model.layers.78." and c.head_keys == ("lm_head.weight",)
    full = [i for i, t in enumerate(c.indexer_types) if t == "full"]
    assert full[:6] == [0, 1, 2, 6, 10, 14] and full[-1] == 74 and len(c.indexer_types) == 78


def test_modelopt_nvfp4_quant(tmp_path):
    d = {**V3_671B, "quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                                            "ignore": ["lm_head", "model.layers.61*"]}}
    q = load_config(d).quant
    assert (q.method, q.algo, q.group_size) == ("modelopt", "NVFP4", 16)
    assert q.excluded("model.layers.61.eh_proj.weight") and q.excluded("lm_head")
    assert not q.excluded("model.layers.60.mlp.experts.0.up_proj")
    (tmp_path / "config.json").write_text(json.dumps({**V3_671B, "quantization_config": None}))
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(
        {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4", "group_size": 16,
                                                            "exclude_modules": ["model.layers.61*"]}}))
    for src in (tmp_path, tmp_path / "config.json"):
        q = load_config(src).quant
        assert q.algo == "NVFP4" and q.excluded("model.layers.61.mlp.gate")


def test_compressed_tensors_quant():
    d = {**QWEN3_NEXT_80B, "quantization_config": {
        "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "float",
                                                                         "strategy": "tensor_group", "group_size": 16}}},
        "ignore": ["lm_head", "re:.*mlp.gate$", "re:mtp.*"]}}
    q = load_config(d).quant
    assert (q.algo, q.group_size) == ("NVFP4", 16)
    assert q.excluded("model.layers.3.mlp.gate") and q.excluded("mtp.fc") and not q.excluded("model.layers.3.mlp.up")


def test_unknown_model_type():
    with pytest.raises(ConfigError, match=r"unsupported model_type 'llama'.*deepseek_v3.*glm_moe_dsa.*qwen3_next"):
        load_config({"model_type": "llama"})
    with pytest.raises(ConfigError, match="model_type"):
        load_config({"hidden_size": 3})


@pytest.mark.parametrize("base, field", [(V3_671B, "kv_lora_rank"), (V4_FLASH, "hc_mult"), (V4_FLASH, "head_dim"),
                                         (QWEN3_NEXT_80B, "num_key_value_heads"), (GLM5, "vocab_size")])
def test_missing_required_field(base, field):
    d = {k: v for k, v in base.items() if k != field}
    with pytest.raises(ConfigError, match=f"missing required field '{field}'"):
        load_config(d)


def test_bad_values_and_files(tmp_path):
    with pytest.raises(ConfigError, match="'hidden_size' = 'big'"):
        load_config({**V3_671B, "hidden_size": "big"})
    with pytest.raises(ConfigError, match="'num_attention_heads' = 1.5"):
        load_config({**V3_671B, "num_attention_heads": 1.5})
    with pytest.raises(ConfigError, match="'norm_topk_prob'"):
        load_config({**V3_671B, "norm_topk_prob": "yes"})
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{broken")
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path)


def test_configs_are_frozen():
    c = load_config(V3_671B)
    with pytest.raises(AttributeError):
        c.hidden_size = 1
    assert c == load_config(dict(V3_671B))
