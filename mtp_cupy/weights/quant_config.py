"""The checkpoint's quantisation description, from config.json `quantization_config` or ModelOpt's
`hf_quant_config.json`. Informational: the loader decides each tensor's format from its safetensors dtype
and sibling keys, never from this (NVFP4 checkpoints usually keep the MTP layer in BF16)."""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass

# compressed-tensors `format` -> algorithm name
_CT_FORMATS = {"nvfp4-pack-quantized": "NVFP4", "float-quantized": "FP8", "mxfp4-pack-quantized": "MXFP4",
               "naive-quantized": "FP8", "pack-quantized": "INT4"}


@dataclass(frozen=True)
class QuantConfig:
    method: str                                 # "fp8" | "modelopt" | "compressed-tensors" | ...
    algo: str                                   # "FP8" | "NVFP4" | "MXFP4" | "W4A16_NVFP4" | ...
    group_size: int | None = None               # NVFP4 16, MXFP4 32
    weight_block_size: tuple[int, int] | None = None   # DeepSeek/Qwen block FP8 [128, 128]
    fmt: str | None = None                      # "e4m3"
    scale_fmt: str | None = None                # "ue8m0" (DeepSeek V3.1+/V4)
    exclude: tuple[str, ...] = ()               # module patterns kept unquantised (fnmatch, or "re:<regex>")
    kv_cache_algo: str | None = None
    expert_dtype: str | None = None             # DeepSeek-V4: "fp4" routed experts

    def excluded(self, module: str) -> bool:
        """True when `module` (a key prefix such as "model.layers.61.mlp", ".weight" optional) matches
        an exclusion pattern."""
        names = {module, module.removesuffix(".weight")}
        for pat in self.exclude:
            if pat.startswith("re:"):
                if any(re.match(pat[3:], n) for n in names):
                    return True
            elif any(fnmatch.fnmatchcase(n, pat) for n in names):
                return True
        return False


def _first_group_weights(q: dict) -> dict:
    groups = q.get("config_groups") or {}
    for g in groups.values():
        if isinstance(g, dict) and isinstance(g.get("weights"), dict):
            return g["weights"]
    return {}


def parse_quant(q: dict | None, hf_quant: dict | None = None, expert_dtype: str | None = None) -> QuantConfig | None:
    """`q` = config.json quantization_config, `hf_quant` = hf_quant_config.json (ModelOpt; wins)."""
    if hf_quant is not None:
        h = hf_quant.get("quantization", hf_quant)
        return QuantConfig("modelopt", str(h.get("quant_algo") or ""), h.get("group_size"),
                           exclude=tuple(h.get("exclude_modules") or h.get("ignore") or ()),
                           kv_cache_algo=h.get("kv_cache_quant_algo"), expert_dtype=expert_dtype)
    if not q:
        return None
    method = str(q.get("quant_method", ""))
    w = _first_group_weights(q)
    algo = q.get("quant_algo")
    if algo is None and method == "compressed-tensors":
        algo = _CT_FORMATS.get(str(q.get("format")), str(q.get("format", "")).upper())
    if algo is None:
        algo = method.upper()
    block = q.get("weight_block_size") or w.get("block_structure")
    exclude = q.get("exclude_modules") or q.get("ignore") or q.get("modules_to_not_convert") \
        or q.get("ignored_layers") or ()
    return QuantConfig(method, str(algo), q.get("group_size", w.get("group_size")),
                       tuple(int(b) for b in block) if block else None, q.get("fmt"), q.get("scale_fmt"),
                       tuple(exclude), q.get("kv_cache_quant_algo"),
                       q.get("expert_dtype", expert_dtype))
