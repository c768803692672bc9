"""The parts of config parsing every family shares: RoPE parameters, the common fields, and the typed
field reader that turns a config.json dict into a frozen dataclass (ConfigError naming a missing or
ill-typed field)."""
from __future__ import annotations

import typing
from dataclasses import MISSING, dataclass, field, fields
from types import UnionType
from typing import Any, ClassVar

from ..errors import ConfigError
from .quant_config import QuantConfig, parse_quant


@dataclass(frozen=True, kw_only=True)
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"                       # "default" | "yarn" | ...
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0                         # DeepSeek YaRN attention-scale terms
    mscale_all_dim: float = 0.0                 # 0 when the config has none
    attention_factor: float | None = None
    partial_rotary_factor: float = 1.0

    @property
    def yarn(self) -> bool:
        return self.type == "yarn"


def parse_rope(src: dict | None, theta: float, partial: float = 1.0) -> RopeConfig:
    """One RoPE parameter dict (rope_parameters or rope_scaling style; may be None) -> RopeConfig."""
    s = dict(src or {})
    g = s.get
    omp = g("original_max_position_embeddings")
    return RopeConfig(theta=float(g("rope_theta", theta)), type=str(g("rope_type", g("type", "default"))),
                      factor=float(g("factor", 1.0)), original_max_position_embeddings=None if omp is None else int(omp),
                      beta_fast=float(g("beta_fast", 32.0)), beta_slow=float(g("beta_slow", 1.0)),
                      mscale=float(g("mscale", 1.0)), mscale_all_dim=float(g("mscale_all_dim", 0.0)),
                      attention_factor=None if g("attention_factor") is None else float(g("attention_factor")),
                      partial_rotary_factor=float(g("partial_rotary_factor", partial)))


def rope_from(d: dict, partial: float = 1.0) -> RopeConfig:
    theta = d.get("rope_theta", 10000.0)
    partial = d.get("partial_rotary_factor", partial)
    rp = d.get("rope_parameters")
    return parse_rope(rp if isinstance(rp, dict) else d.get("rope_scaling"), theta, partial)


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Fields every family has. `raw` is the config.json dict for anything not typed here."""
    family: ClassVar[str]
    model_types: ClassVar[tuple[str, ...]]
    model_type: str
    hidden_size: int
    vocab_size: int
    num_hidden_layers: int
    num_attention_heads: int
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    rope: RopeConfig = RopeConfig()
    quant: QuantConfig | None = None
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    # checkpoint key names of the first MTP module and of the shared embedding / LM head (candidates in order)
    embed_keys: ClassVar[tuple[str, ...]] = ("model.embed_tokens.weight",)
    head_keys: ClassVar[tuple[str, ...]] = ("lm_head.weight",)

    @property
    def mtp_prefix(self) -> str:
        return f"model.layers.{self.num_hidden_layers}."

    @property
    def num_mtp_layers(self) -> int:
        raise NotImplementedError

    @classmethod
    def from_dict(cls, d: dict, hf_quant: dict | None = None, where: str = "config.json") -> "ModelConfig":
        quant = parse_quant(d.get("quantization_config"), hf_quant, d.get("expert_dtype"))
        return build(cls, d, where, model_type=d["model_type"], rope=rope_from(d), quant=quant, raw=d)


def _optional(tp: Any) -> bool:
    return (isinstance(tp, UnionType) or typing.get_origin(tp) is typing.Union) and type(None) in typing.get_args(tp)


def _coerce(name: str, v: Any, tp: Any, where: str) -> Any:
    if _optional(tp):
        if v is None:
            return None
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    try:
        if typing.get_origin(tp) is tuple:
            return tuple(typing.get_args(tp)[0](x) for x in v)
        if tp is bool and isinstance(v, bool):
            return v
        if tp is int and not isinstance(v, bool) and float(v) == int(v):
            return int(v)
        if tp in (float, str) and not isinstance(v, (bool, list, dict)):
            return tp(v)
    except (TypeError, ValueError):
        pass
    raise ConfigError(f"{where}: field {name!r} = {v!r} is not a valid {getattr(tp, '__name__', tp)}")


def build(cls: type, d: dict, where: str, **given: Any) -> Any:
    """`cls(**fields)` read from `d` by field name; `given` fields are set as passed. A null value counts as
    absent unless the field is Optional; an absent field without a default raises ConfigError."""
    hints = typing.get_type_hints(cls)
    kw = dict(given)
    for f in fields(cls):
        if f.name in kw:
            continue
        if f.name in d and (d[f.name] is not None or _optional(hints[f.name])):
            kw[f.name] = _coerce(f.name, d[f.name], hints[f.name], where)
        elif f.default is MISSING and f.default_factory is MISSING:
            raise ConfigError(f"{where}: missing required field {f.name!r} for model_type {d.get('model_type')!r}")
    return cls(**kw)
