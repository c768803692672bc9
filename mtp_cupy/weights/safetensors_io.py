"""Lazy safetensors reading with precise errors.

A safetensors file is `u64 little-endian header length N | N bytes of JSON | data`. The JSON maps each
tensor name to `{"dtype", "shape", "data_offsets": [begin, end]}` (offsets relative to the data section)
plus an optional `"__metadata__"` of strings. We parse the header ourselves instead of using
safetensors' reader because (a) its numpy path has no float8/e8m0/bf16 types, (b) a checkpoint of
hundreds of GB must be read lazily, tensor by tensor, from an mmap, and (c) a truncated download must
be reported as "tensor X in file Y runs past the end of the file", not as a generic failure.

A checkpoint is a directory with `model.safetensors`, or shards plus `model.safetensors.index.json`
(`{"weight_map": {key: file}}`), or any set of `*.safetensors` files, or one file path. A file's header
is parsed on first use, so a partial download still serves the tensors it holds; `validate()` checks
every file and every index entry at once."""
from __future__ import annotations

import json
import mmap
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from ..errors import WeightError
from ..runtime.dtypes import BF16, E8M0, FP8

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

# safetensors dtype string -> numpy dtype. Sub-byte types (F4, F6_*) have no numpy view; their bytes
# are still readable through `raw`.
DTYPES: dict[str, np.dtype] = {
    "BF16": BF16, "F16": np.dtype(np.float16), "F32": np.dtype(np.float32), "F64": np.dtype(np.float64),
    "F8_E4M3": FP8, "F8_E8M0": E8M0, "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "U8": np.dtype(np.uint8), "I8": np.dtype(np.int8), "U16": np.dtype(np.uint16), "I16": np.dtype(np.int16),
    "U32": np.dtype(np.uint32), "I32": np.dtype(np.int32), "U64": np.dtype(np.uint64),
    "I64": np.dtype(np.int64), "BOOL": np.dtype(np.bool_),
}


@dataclass(frozen=True)
class TensorInfo:
    dtype: str                  # safetensors dtype string: "BF16", "F8_E4M3", ...
    shape: tuple[int, ...]
    file: str                   # file name, relative to the checkpoint directory
    nbytes: int
    offset: int                 # absolute byte offset of the data in the file

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


def _shape_str(shape: Sequence) -> str:
    return "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"


class _File:
    """One .safetensors file: header parsed and validated on first use, data mmapped."""

    def __init__(self, path: Path, name: str):
        self.path, self.name = path, name
        self._header: dict[str, TensorInfo] | None = None
        self._mm: mmap.mmap | None = None

    def header(self, key: str | None = None) -> dict[str, TensorInfo]:
        """Parse on first call; `key` is only used to name the tensor asked for in errors."""
        if self._header is None:
            self._header = self._parse(key)
        return self._header

    def _parse(self, key: str | None) -> dict[str, TensorInfo]:
        name = self.name
        if not self.path.is_file():
            raise WeightError(f"safetensors file does not exist ({self.path})", key, name)
        size = self.path.stat().st_size
        with open(self.path, "rb") as fh:
            if size < 8:
                raise WeightError(f"file is {size} bytes, shorter than the 8-byte header length "
                                  "(truncated?)", key, name)
            (hlen,) = struct.unpack("<Q", fh.read(8))
            if 8 + hlen > size:
                raise WeightError(f"header length {hlen} runs past the end of the file ({size} bytes; "
                                  "truncated or not a safetensors file)", key, name)
            raw = fh.read(hlen)
        try:
            meta = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise WeightError(f"header is not valid JSON: {e}", key, name) from None
        if not isinstance(meta, dict):
            raise WeightError("header is not a JSON object", key, name)
        data_start, data_len = 8 + hlen, size - 8 - hlen
        out: dict[str, TensorInfo] = {}
        spans: list[tuple[int, int, str]] = []
        for k, v in meta.items():
            if k == "__metadata__":
                continue
            try:
                dt, shape, (b, e) = v["dtype"], tuple(int(s) for s in v["shape"]), v["data_offsets"]
                b, e = int(b), int(e)
            except (KeyError, TypeError, ValueError):
                raise WeightError(f"malformed header entry {v!r}", k, name) from None
            if not 0 <= b <= e:
                raise WeightError(f"data_offsets [{b}, {e}) are not an ordered range", k, name)
            if e > data_len:
                raise WeightError(f"data [{b}, {e}) runs past the end of the file: the data section has "
                                  f"only {data_len} bytes (truncated?)", k, name)
            if dt in DTYPES:
                need = int(np.prod(shape, dtype=np.int64)) * DTYPES[dt].itemsize
                if need != e - b:
                    raise WeightError(f"data range holds {e - b} bytes but {dt} {_shape_str(shape)} needs "
                                      f"{need}", k, name)
            out[k] = TensorInfo(dt, shape, name, e - b, data_start + b)
            spans.append((b, e, k))
        spans.sort()
        for (b0, e0, k0), (b1, e1, k1) in zip(spans, spans[1:]):
            if b1 < e0:
                raise WeightError(f"data [{b1}, {e1}) overlaps tensor {k0} [{b0}, {e0})", k1, name)
        return out

    def bytes(self, info: TensorInfo) -> np.ndarray:
        """Read-only uint8 view of one tensor's bytes (zero-copy from the mmap)."""
        if info.nbytes == 0:
            return np.empty(0, np.uint8)
        if self._mm is None:
            with open(self.path, "rb") as fh:
                self._mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        return np.frombuffer(self._mm, np.uint8, count=info.nbytes, offset=info.offset)


class Checkpoint:
    """Tensors of a safetensors checkpoint by key, read lazily.

    `keys()`, `has(key)`, `info(key) -> TensorInfo`, `raw(key) -> uint8 bytes`, `numpy(key)` (typed,
    shaped view), `get(key, shape, dtypes)` (checked), `nbytes_total(prefix)`, `validate()`."""

    def __init__(self, path: str | Path):
        path = Path(path)
        self.path = path
        self._map: dict[str, _File] = {}
        if path.is_file():
            self.root = path.parent
            self._add_whole(_File(path, path.name))
        elif path.is_dir():
            self.root = path
            self._open_dir(path)
        else:
            raise WeightError("checkpoint path does not exist", file=str(path))
        self._files = {f.name: f for f in self._map.values()}

    def _open_dir(self, d: Path) -> None:
        index = d / INDEX_NAME
        if index.is_file():
            try:
                wm = json.loads(index.read_text())["weight_map"]
                items = [(str(k), str(v)) for k, v in wm.items()]
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
                raise WeightError(f"cannot read weight_map: {type(e).__name__}: {e}", file=INDEX_NAME) from None
            files: dict[str, _File] = {}
            for k, fname in items:
                f = files.get(fname)
                if f is None:
                    f = files[fname] = _File(d / fname, fname)
                self._map[k] = f
            return
        if (d / SINGLE_NAME).is_file():
            self._add_whole(_File(d / SINGLE_NAME, SINGLE_NAME))
            return
        shards = sorted(d.glob("*.safetensors"))
        if not shards:
            raise WeightError(f"no {SINGLE_NAME}, {INDEX_NAME} or *.safetensors in the directory", file=str(d))
        for p in shards:
            self._add_whole(_File(p, p.name))

    def _add_whole(self, f: _File) -> None:
        for k in f.header():
            if k in self._map:
                raise WeightError(f"tensor is in two files ({self._map[k].name} and {f.name})", k, f.name)
            self._map[k] = f

    # -- lookup ----------------------------------------------------------------------------------
    @property
    def files(self) -> list[Path]:
        return [f.path for f in self._files.values()]

    def keys(self) -> list[str]:
        return sorted(self._map)

    def has(self, key: str) -> bool:
        return key in self._map

    def file_of(self, key: str) -> str:
        f = self._map.get(key)
        if f is None:
            raise WeightError("tensor not found in the checkpoint", key, self._where())
        return f.name

    def _where(self) -> str:
        if self.path.is_file():
            return self.path.name
        return INDEX_NAME if (self.root / INDEX_NAME).is_file() else str(self.root)

    def info(self, key: str) -> TensorInfo:
        f = self._map.get(key)
        if f is None:
            raise WeightError("tensor not found in the checkpoint", key, self._where())
        info = f.header(key).get(key)
        if info is None:
            raise WeightError(f"{INDEX_NAME} places this tensor in {f.name}, but that file does not "
                              "hold it", key, f.name)
        return info

    def raw(self, key: str) -> np.ndarray:
        info = self.info(key)
        return self._files[info.file].bytes(info)

    def numpy(self, key: str) -> np.ndarray:
        """Typed read-only view: BF16 -> bfloat16, F8_E4M3 -> float8_e4m3fn, F8_E8M0 -> float8_e8m0fnu,
        integers and floats as themselves."""
        info = self.info(key)
        dt = DTYPES.get(info.dtype)
        if dt is None:
            raise WeightError(f"dtype {info.dtype} has no numpy view (read it with raw())", key, info.file)
        return self._files[info.file].bytes(info).view(dt).reshape(info.shape)

    def check(self, key: str, shape: Sequence[int | None] | None = None,
              dtypes: str | Sequence[str] | None = None) -> TensorInfo:
        """The TensorInfo after checking shape (None entries match anything) and dtype."""
        info = self.info(key)
        if dtypes is not None:
            allowed = (dtypes,) if isinstance(dtypes, str) else tuple(dtypes)
            if info.dtype not in allowed:
                raise WeightError(f"expected dtype {' or '.join(allowed)}, found {info.dtype}", key, info.file)
        if shape is not None:
            shape = tuple(shape)
            if len(shape) != len(info.shape) or any(s is not None and s != t for s, t in zip(shape, info.shape)):
                raise WeightError(f"expected shape {_shape_str(shape)}, found {_shape_str(info.shape)}",
                                  key, info.file)
        return info

    def get(self, key: str, shape: Sequence[int | None] | None = None,
            dtypes: str | Sequence[str] | None = None) -> np.ndarray:
        self.check(key, shape, dtypes)
        return self.numpy(key)

    def nbytes_total(self, prefix: str = "") -> int:
        """Bytes of all tensors whose key starts with `prefix` (parses the headers involved)."""
        return sum(self.info(k).nbytes for k in self._map if k.startswith(prefix))

    def validate(self) -> None:
        """Parse every file and check every key the index lists (raises the first WeightError)."""
        for k in self._map:
            self.info(k)

    def __repr__(self) -> str:
        return f"Checkpoint({str(self.path)!r}, {len(self._map)} tensors in {len(self._files)} files)"
