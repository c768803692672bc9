"""HF config.json -> typed, frozen configs for the four MTP families.

`load_config(path_or_dict)` dispatches on `model_type`. Fields keep their config.json names; a field
without a default here is required and its absence raises ConfigError naming it (a silently defaulted
dimension would only show up as garbage drafts). Both RoPE styles are read: transformers-5
`rope_parameters` ({rope_type, rope_theta, factor, ...}) and the older `rope_theta` + `rope_scaling`."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from ..errors import ConfigError
from .config_base import ModelConfig, RopeConfig, build, parse_rope, rope_from
from .quant_config import parse_quant


@dataclass(frozen=True, kw_only=True)
class _MlaMoeConfig(ModelConfig):
    """DeepSeek-V3-style MLA attention + group-limited routed MoE (V3/R1/V3.1/V3.2, GLM-5)."""
    num_key_value_heads: int | None = None
    q_lora_rank: int | None = 1536              # None: q is projected directly (V2-Lite style)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate_size: int = 18432              # dense layers (first_k_dense_replace)
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int = 1
    num_experts_per_tok: int
    n_group: int = 8
    topk_group: int = 4
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    first_k_dense_replace: int = 3
    num_nextn_predict_layers: int = 1
    rope_interleave: bool = True
    # DSA lightning indexer (V3.2, GLM-5); index_topk == 0 means no indexer
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    indexer_rope_interleave: bool = False

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:         # MLA: one latent, HF reports heads
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)

    @property
    def num_mtp_layers(self) -> int:
        return self.num_nextn_predict_layers

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def has_indexer(self) -> bool:
        return self.index_topk > 0

    @property
    def mtp_is_moe(self) -> bool:
        return self.num_hidden_layers >= self.first_k_dense_replace


# DeepSeek-V3.2's indexer when its config.json leaves the fields out (transformers' DeepseekV32Config defaults)
V32_INDEXER_DEFAULTS = {"index_n_heads": 64, "index_head_dim": 128, "index_topk": 2048}


@dataclass(frozen=True, kw_only=True)
class DeepseekV3Config(_MlaMoeConfig):
    """DeepSeek-V3/R1/V3.1 (`deepseek_v3`) and V3.2 (`deepseek_v32`: every layer, the MTP layer included,
    carries the DSA indexer; its RoPE is half-split unless `indexer_rope_interleave`)."""
    family: ClassVar[str] = "deepseek_v3"
    model_types: ClassVar[tuple[str, ...]] = ("deepseek_v3", "deepseek_v32")

    @classmethod
    def from_dict(cls, d: dict, hf_quant: dict | None = None, where: str = "config.json") -> "DeepseekV3Config":
        if d.get("model_type") == "deepseek_v32":
            d = {**d, **{k: v for k, v in V32_INDEXER_DEFAULTS.items() if d.get(k) is None}}
        return super().from_dict(d, hf_quant, where)


@dataclass(frozen=True, kw_only=True)
class GlmMoeDsaConfig(_MlaMoeConfig):
    family: ClassVar[str] = "glm5"
    model_types: ClassVar[tuple[str, ...]] = ("glm_moe_dsa",)
    rms_norm_eps: float = 1e-5
    q_lora_rank: int | None = 2048
    intermediate_size: int = 12288
    n_group: int = 1
    topk_group: int = 1
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 2048
    indexer_rope_interleave: bool = True
    index_share_for_mtp_iteration: bool = False
    indexer_types: tuple[str, ...] = ()         # per main layer: "full" | "shared"

    @classmethod
    def from_dict(cls, d: dict, hf_quant: dict | None = None, where: str = "config.json") -> "GlmMoeDsaConfig":
        if "indexer_types" not in d:
            n = int(d.get("num_hidden_layers", 0))
            pattern = d.get("index_topk_pattern")
            if pattern is not None:
                types = [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else pattern
            else:   # HF rule: layer l is full iff max(l - offset + 1, 0) % freq == 0
                freq, off = max(int(d.get("index_topk_freq", 1)), 1), int(d.get("index_skip_topk_offset", 2))
                types = ["full" if max(i - off + 1, 0) % freq == 0 else "shared" for i in range(n)]
            d = {**d, "indexer_types": list(types)}
        return super().from_dict(d, hf_quant, where)


@dataclass(frozen=True, kw_only=True)
class DeepseekV4Config(ModelConfig):
    """DeepSeek-V4: mHC streams, sliding-window MQA with sinks, grouped low-rank output, sqrtsoftplus MoE.
    `rope` is the plain RoPE of sliding-window layers (the MTP layer's kind); `compress_rope` the YaRN
    RoPE of compressed layers."""
    family: ClassVar[str] = "deepseek_v4"
    model_types: ClassVar[tuple[str, ...]] = ("deepseek_v4",)
    embed_keys: ClassVar[tuple[str, ...]] = ("embed.weight", "model.embed_tokens.weight")
    head_keys: ClassVar[tuple[str, ...]] = ("head.weight", "lm_head.weight")
    max_position_embeddings: int = 1048576
    num_key_value_heads: int = 1
    head_dim: int
    qk_rope_head_dim: int = 64
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int = 128
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int = 1
    num_experts_per_tok: int
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    topk_method: str = "noaux_tc"
    swiglu_limit: float = 10.0
    num_hash_layers: int = 3
    compress_ratios: tuple[int, ...] = ()       # per layer incl. the MTP layers: 0 = sliding window only
    compress_rope_theta: float = 160000.0
    compress_rope: RopeConfig = RopeConfig()
    hc_mult: int
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    num_nextn_predict_layers: int = 1

    @property
    def mtp_prefix(self) -> str:
        return "mtp.0."

    @property
    def num_mtp_layers(self) -> int:
        return self.num_nextn_predict_layers

    @property
    def mtp_compress_ratio(self) -> int:
        r = self.compress_ratios
        return r[self.num_hidden_layers] if len(r) > self.num_hidden_layers else 0

    @classmethod
    def from_dict(cls, d: dict, hf_quant: dict | None = None, where: str = "config.json") -> "DeepseekV4Config":
        extra: dict[str, Any] = {}
        if "compress_ratios" not in d and "layer_types" in d:    # transformers-5 spelling
            rates = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128,
                     **(d.get("compress_rates") or {})}
            extra["compress_ratios"] = [rates[t] for t in d["layer_types"]]
        if "num_hash_layers" not in d and "mlp_layer_types" in d:
            extra["num_hash_layers"] = sum(t == "hash_moe" for t in d["mlp_layer_types"])
        if "qk_rope_head_dim" not in d and "partial_rotary_factor" in d and "head_dim" in d:
            extra["qk_rope_head_dim"] = round(float(d["partial_rotary_factor"]) * int(d["head_dim"]))
        d = {**d, **extra}
        partial = int(d.get("qk_rope_head_dim", 64)) / int(d["head_dim"]) if "head_dim" in d else 1.0
        rp = d.get("rope_parameters")
        theta, ctheta = d.get("rope_theta", 10000.0), d.get("compress_rope_theta", 160000.0)
        if isinstance(rp, dict) and isinstance(rp.get("main"), dict):
            main, comp = parse_rope(rp["main"], theta, partial), parse_rope(rp.get("compress"), ctheta, partial)
        else:
            yarn = rp if isinstance(rp, dict) else d.get("rope_scaling")
            main = parse_rope({"rope_theta": theta}, theta, partial)
            comp = parse_rope({**(yarn or {}), "rope_theta": ctheta}, ctheta, partial)
        quant = parse_quant(d.get("quantization_config"), hf_quant, d.get("expert_dtype"))
        return build(cls, d, where, model_type=d["model_type"], rope=main, compress_rope=comp, quant=quant, raw=d)


@dataclass(frozen=True, kw_only=True)
class Qwen3NextConfig(ModelConfig):
    """Qwen3-Next `mtp.*` head (also Qwen3.5 / Qwen3.5-MoE, whose text_config has the same MTP layout).
    num_experts == 0 means a dense-FFN head (intermediate_size)."""
    family: ClassVar[str] = "qwen3_next"
    model_types: ClassVar[tuple[str, ...]] = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe",
                                              "qwen3_5_moe_text")
    embed_keys: ClassVar[tuple[str, ...]] = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight")
    max_position_embeddings: int = 32768
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    attn_output_gate: bool = True
    mtp_num_hidden_layers: int = 1

    @property
    def mtp_prefix(self) -> str:
        return "mtp."

    @property
    def num_mtp_layers(self) -> int:
        return self.mtp_num_hidden_layers

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rope.partial_rotary_factor)

    @property
    def mtp_is_moe(self) -> bool:
        return self.num_experts > 0

    @classmethod
    def from_dict(cls, d: dict, hf_quant: dict | None = None, where: str = "config.json") -> "Qwen3NextConfig":
        if isinstance(d.get("text_config"), dict):     # Qwen3.5 multimodal wrapper
            d = {**d["text_config"], **{k: d[k] for k in ("quantization_config", "tie_word_embeddings") if k in d},
                 "model_type": d["model_type"]}
        quant = parse_quant(d.get("quantization_config"), hf_quant)
        return build(cls, d, where, model_type=d["model_type"], rope=rope_from(d, 0.25), quant=quant, raw=d)


def _read_json(p: Path) -> dict:
    try:
        d = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read {p} as JSON: {e}") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{p} is not a JSON object")
    return d


def load_config(src: str | Path | dict) -> ModelConfig:
    """A checkpoint directory, a config.json path, or an already-parsed dict -> the family config.
    A directory's (or config.json's sibling) `hf_quant_config.json` supplies the ModelOpt quantisation."""
    hf_quant = None
    if isinstance(src, dict):
        d, where = src, "config"
    else:
        p = Path(src)
        p = p / "config.json" if p.is_dir() else p
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        d, where = _read_json(p), str(p)
        q = p.parent / "hf_quant_config.json"
        hf_quant = _read_json(q) if q.is_file() else None
    mt = d.get("model_type")
    if mt is None:
        raise ConfigError(f"{where}: missing required field 'model_type'")
    from ..families import by_model_type          # the registry owns the model-type table
    return by_model_type(mt, where).config.from_dict(d, hf_quant, where)
