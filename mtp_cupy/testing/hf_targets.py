"""Tiny transformers target models with their MTP layer in the same checkpoint, one per family (tests of the
transformers integration, its benchmark).

`write_hf_target(family, path, seed)` writes what a real release looks like to both readers:
    1. the family's tiny random MTP checkpoint (`mtp_cupy.testing.tiny`) gives the dims and the MTP layer's
       tensors in the family's key layout (V3 / GLM: `model.layers.{L}.*`, Qwen3-Next: `mtp.*`, V4: `mtp.0.*`);
    2. transformers' own class for the family, built from the same dims with random weights
       (`torch.manual_seed(seed)`), is saved with `save_pretrained` (transformers' key layout for the target);
    3. the target's file becomes shard 1 and the MTP tensors shard 2 of a `model.safetensors.index.json`, and
       config.json is transformers' with the tiny config's extra fields (no quantization_config: the target is
       plain float, only the MTP tensors carry their stored formats, which transformers never reads).
The MTP layer's embedding and head are the target's (`model.embed_tokens.weight`, `lm_head.weight` /
`head.weight`). transformers loads the target and ignores the MTP keys; `mtp_cupy.load_proposer` reads the MTP
layer and the target's embedding and head. Needs torch and transformers."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np

from ..families import family as _family
from ..weights.config import load_config
from ..weights.safetensors_io import Checkpoint
from ..weights.writer import write_safetensors

HF_FAMILIES = ("deepseek_v3", "deepseek_v4", "qwen3_next", "glm5")
MODEL_TYPE = {"deepseek_v3": "deepseek_v3", "deepseek_v4": "deepseek_v4", "qwen3_next": "qwen3_next",
              "glm5": "glm_moe_dsa"}
# config.json fields of the tiny writers that transformers must not see (quantization would make it quantise the
# float target) or that it spells otherwise
NOT_FOR_HF = ("model_type", "architectures", "torch_dtype", "quantization_config", "expert_dtype", "rope_scaling")
# what the tiny configs leave to transformers' defaults but a tiny target needs: small linear-attention heads
# (Qwen3-Next), plain RoPE where the tiny V3 config has YaRN
_HF_EXTRA = {
    "deepseek_v3": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    "qwen3_next": {"linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 32,
                   "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4},
}
TARGET_SHARD, MTP_SHARD = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"


def hf_config(fam: str, tiny_cfg: dict, **overrides):
    """transformers' config of the target with the tiny MTP checkpoint's dims."""
    from transformers import AutoConfig
    keys = {k: v for k, v in tiny_cfg.items() if k not in NOT_FOR_HF}
    keys.update(_HF_EXTRA.get(fam, {}))
    keys.update(overrides)
    return AutoConfig.for_model(MODEL_TYPE[fam], **keys)


def write_hf_target(fam: str, path, seed: int = 0, mtp_seed: int | None = None, **overrides) -> Path:
    """A tiny `fam` target model (transformers' class, random weights from `seed`) with an MTP layer (random,
    from `mtp_seed`, default `seed`) in one checkpoint directory at `path`; `overrides` go to transformers'
    config (e.g. initializer_range). Returns the directory."""
    import torch
    from transformers import AutoModelForCausalLM
    if fam not in HF_FAMILIES:
        raise ValueError(f"unknown family {fam!r}; choose one of {', '.join(HF_FAMILIES)}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"mtp_{fam}_") as tmp:
        tiny = _family(fam).write_tiny_checkpoint(tmp, seed=seed if mtp_seed is None else mtp_seed)
        tiny_cfg = json.loads((Path(tiny) / "config.json").read_text())
        prefix = load_config(Path(tiny)).mtp_prefix
        ck = Checkpoint(tiny)
        mtp = {k: np.array(ck.numpy(k)) for k in ck.keys() if k.startswith(prefix)}
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(fam, tiny_cfg, **overrides), dtype=torch.float32)
    save_with_mtp(model, path, mtp, tiny_cfg)
    return path


def save_with_mtp(model, path, mtp: dict[str, np.ndarray], tiny_cfg: dict, **config_extra) -> int:
    """`model.save_pretrained(path)` (transformers' key layout, the model's dtype) as shard 1, the MTP tensors
    `mtp` (arrays in the checkpoint's stored dtypes, under its keys) as shard 2, the index, and config.json:
    transformers' plus the fields of `tiny_cfg` it lacks plus `config_extra`. Returns the parameters written."""
    path = Path(path)
    model.save_pretrained(path)
    single = path / "model.safetensors"
    if not single.is_file():
        raise RuntimeError(f"save_pretrained wrote shards in {path}; the tiny target should fit one file")
    single.rename(path / TARGET_SHARD)
    write_safetensors(path / MTP_SHARD, mtp)
    target = Checkpoint(path / TARGET_SHARD)
    weight_map = {k: TARGET_SHARD for k in target.keys()}
    weight_map.update({k: MTP_SHARD for k in mtp})
    total = sum(f.stat().st_size for f in (path / TARGET_SHARD, path / MTP_SHARD))
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1) + "\n")
    cfg = json.loads((path / "config.json").read_text())
    extra = {k: v for k, v in tiny_cfg.items() if k not in cfg and k not in NOT_FOR_HF}
    (path / "config.json").write_text(json.dumps({**cfg, **extra, **config_extra}, indent=2) + "\n")
    return sum(int(np.prod(target.info(k).shape)) for k in target.keys()) + sum(int(a.size) for a in mtp.values())


def load_hf_target(path, dtype=None, device=None, attn_implementation: str = "eager"):
    """transformers' model of a checkpoint written by `write_hf_target` (or any HF checkpoint), in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()      # the MTP keys are "unexpected" to transformers' target class
    hf_logging.disable_progress_bar()     # a tiny model loads at once; the bar would only break tables
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32,
                                                     attn_implementation=attn_implementation)
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    return model.to(device).eval() if device is not None else model.eval()
