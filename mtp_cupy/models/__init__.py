"""Proposer families and `load_proposer`, which dispatches on config.json's model_type.

Each family module exposes `from_checkpoint(path, gpu, max_seq_len, comm=None, **options)` and
`write_tiny_checkpoint(path, seed=0, **dims)` (a small random checkpoint in the family's real key layout)."""
from __future__ import annotations

import importlib
import json
from pathlib import Path

from ..errors import ConfigError

# model_type -> (family, module)
MODEL_TYPES = {
    "deepseek_v3": ("deepseek_v3", "mtp_cupy.models.deepseek_mtp"),
    "deepseek_v32": ("deepseek_v3", "mtp_cupy.models.deepseek_mtp"),
    "deepseek_v4": ("deepseek_v4", "mtp_cupy.models.deepseek_v4_mtp"),
    "qwen3_next": ("qwen3_next", "mtp_cupy.models.qwen_mtp"),
    "qwen3_5": ("qwen3_next", "mtp_cupy.models.qwen_mtp"),
    "qwen3_5_moe": ("qwen3_next", "mtp_cupy.models.qwen_mtp"),
    "glm_moe_dsa": ("glm5", "mtp_cupy.models.glm_mtp"),
}
FAMILIES = {fam: mod for fam, mod in MODEL_TYPES.values()}


def family_module(family: str):
    if family not in FAMILIES:
        raise ConfigError(f"unknown family {family!r}; choose one of {', '.join(sorted(FAMILIES))}")
    return importlib.import_module(FAMILIES[family])


def model_type_of(path) -> str:
    cfg = Path(path) / "config.json"
    if not cfg.exists():
        raise ConfigError(f"{path} has no config.json")
    try:
        mt = json.loads(cfg.read_text()).get("model_type")
    except json.JSONDecodeError as e:
        raise ConfigError(f"{cfg} is not valid JSON: {e}") from e
    if mt not in MODEL_TYPES:
        raise ConfigError(f"model_type {mt!r} in {cfg} is not supported; supported: {', '.join(sorted(MODEL_TYPES))}")
    return mt


def load_proposer(path, gpu=None, max_seq_len: int = 4096, comm=None, **options):
    """Load the MTP draft proposer of the checkpoint at `path` onto `gpu` (default: device("auto"))."""
    from ..runtime import device
    gpu = gpu if gpu is not None else device("auto")
    family, module = MODEL_TYPES[model_type_of(path)]
    graphs = options.pop("cuda_graphs", None)   # every family: replay propose(k) as a CUDA graph (default on CUDA)
    prop = importlib.import_module(module).from_checkpoint(path, gpu, max_seq_len=max_seq_len, comm=comm, **options)
    if graphs is not None:
        prop.cuda_graphs = bool(graphs) and gpu.is_cuda
    return prop
