"""Writing safetensors checkpoints and config files (tiny test checkpoints, converted weights).

The header is written here rather than by `safetensors.numpy`, which cannot store float8/e8m0 (or bf16
without ml_dtypes). Tensors are laid out largest element first so every tensor starts on a multiple of
its element size (the JSON header is space-padded to 8 bytes), as safetensors itself does."""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np

from .safetensors_io import DTYPES, INDEX_NAME, SINGLE_NAME

_NAMES = {dt: name for name, dt in DTYPES.items()}


def dtype_name(a: np.ndarray) -> str:
    """The safetensors dtype string of a numpy array (uint8 -> U8, int8 -> I8, bfloat16 -> BF16, ...)."""
    name = _NAMES.get(np.dtype(a.dtype))
    if name is None:
        raise TypeError(f"numpy dtype {a.dtype} has no safetensors equivalent")
    return name


def write_safetensors(path: str | Path, tensors: dict[str, np.ndarray],
                      metadata: dict[str, str] | None = None) -> Path:
    """One .safetensors file holding `tensors` (any dtype in safetensors_io.DTYPES)."""
    path = Path(path)
    arrays = {k: np.array(v, order="C", copy=None) for k, v in tensors.items()}   # keeps 0-d shapes
    order = sorted(arrays, key=lambda k: (-arrays[k].dtype.itemsize, k))
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    off = 0
    for k in order:
        a = arrays[k]
        header[k] = {"dtype": dtype_name(a), "shape": list(a.shape), "data_offsets": [off, off + a.nbytes]}
        off += a.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(blob)))
        fh.write(blob)
        for k in order:
            fh.write(arrays[k].reshape(-1).view(np.uint8).tobytes())
    return path


def write_checkpoint(directory: str | Path, tensors: dict[str, np.ndarray], config: dict | None = None,
                     shards: int = 1, metadata: dict[str, str] | None = None) -> Path:
    """A checkpoint directory: `model.safetensors` (shards=1) or `model-0000i-of-0000N.safetensors` plus
    `model.safetensors.index.json`, and `config.json` when `config` is given. Sorted keys are split
    into `shards` contiguous runs of equal count."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    if config is not None:
        write_config(d, config)
    if shards <= 1:
        (d / INDEX_NAME).unlink(missing_ok=True)     # a stale index would take precedence when reading
        write_safetensors(d / SINGLE_NAME, tensors, metadata)
        return d
    keys = sorted(tensors)
    if len(keys) < shards:
        raise ValueError(f"{shards} shards asked for {len(keys)} tensors")
    groups = [list(g) for g in np.array_split(np.array(keys, dtype=object), shards)]
    total = sum(np.asarray(tensors[k]).nbytes for k in keys)
    weight_map = {}
    for i, ks in enumerate(groups):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        write_safetensors(d / name, {k: tensors[k] for k in ks}, metadata)
        weight_map.update({k: name for k in ks})
    write_config(d / INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": weight_map})
    return d


def write_config(path: str | Path, config: dict) -> Path:
    """Write a JSON file; a directory path gets `config.json` inside it."""
    path = Path(path)
    if path.is_dir() or path.suffix != ".json":
        path.mkdir(parents=True, exist_ok=True)
        path = path / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return path
