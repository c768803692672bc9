"""Checkpoint tensors -> device buffers and `Linear`s, each in the format its checkpoint stored.

The format of a projection is decided per tensor from the safetensors dtype and the sibling keys,
never per model (an NVFP4 checkpoint usually keeps its MTP layer in BF16):

  weight dtype  sibling keys                                         -> Linear.fmt
  BF16/F16/F32  -                                                    bf16 (F16/F32 rounded on the host)
  F8_E4M3       weight_scale_inv F32 [ceil(n/128), ceil(k/128)]      fp8_block (DeepSeek/Qwen/GLM FP8)
  F8_E4M3       weight_scale_inv or scale F8_E8M0, same blocks        fp8_block_e8m0 (DeepSeek-V4 `.scale`)
  F8_E4M3       weight_scale F32 scalar / [1] / [n] / [n, 1]          fp8_row (a tensor scale is broadcast)
  F8_E4M3       weight_scale F32 [ceil(n/128), ceil(k/128)]           fp8_block (compressed-tensors block)
  U8/I8 [n,k/2] weight_scale F8_E4M3 [n, k/16] + weight_scale_2 F32   nvfp4 (ModelOpt)
  weight_packed U8 [n,k/2] + weight_scale + weight_global_scale F32   nvfp4, scale2 = 1/global (compressed-
                                                                     tensors stores the global as a divisor)
  U8/I8 [n,k/2] scale F8_E8M0 [n, k/32]                              mxfp4 (DeepSeek-V4 routed experts)

Device bytes are the stored bytes (except the host conversions named above), so a kernel reads
exactly what the checkpoint holds."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
from tqdm import tqdm

from ..errors import WeightError
from ..runtime.backend import Backend, DeviceBuffer
from ..runtime.dtypes import to_bf16
from ..runtime.ptr import NULL
from . import quant_host as qh
from .linear import FORMATS, Linear
from .safetensors_io import Checkpoint

PROGRESS_MIN_BYTES = 256 << 20        # show a bar by default for checkpoints larger than this
FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")
_AS = {"bf16": "BF16", "f32": "F32"}


@dataclass(frozen=True)
class LinearSource:
    """Where a projection's tensors are and which format they form (from the headers only)."""
    fmt: str
    n: int
    k: int
    weight: str                   # keys
    scale: str | None = None
    scale2: str | None = None     # weight_scale_2, or compressed-tensors weight_global_scale
    scale2_divisor: bool = False  # compressed-tensors: scale2 = 1 / stored value


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _scalar_key(ckpt: Checkpoint, key: str) -> str:
    info = ckpt.check(key, dtypes="F32")
    if info.numel != 1 or len(info.shape) > 1:
        raise WeightError(f"expected a scalar (shape [] or [1]), found {list(info.shape)}", key, info.file)
    return key


def detect_linear(ckpt: Checkpoint, prefix: str) -> LinearSource:
    """The format of projection `prefix` ("...q_proj" or "...q_proj.weight"), its [n, k], and the keys,
    after checking that the scales fit the weight."""
    p = prefix.removesuffix(".weight")

    def key(s: str) -> str:
        return f"{p}.{s}"

    def has(s: str) -> bool:
        return ckpt.has(key(s))

    if has("weight_packed"):
        w = ckpt.check(key("weight_packed"), (None, None), ("U8", "I8"))
        n, k = w.shape[0], 2 * w.shape[1]
        ckpt.check(key("weight_scale"), (n, _cdiv(k, qh.NVFP4_GROUP)), "F8_E4M3")
        return LinearSource("nvfp4", n, k, key("weight_packed"), key("weight_scale"),
                            _scalar_key(ckpt, key("weight_global_scale")), True)
    w = ckpt.info(key("weight"))
    if len(w.shape) != 2:
        raise WeightError(f"expected a 2-D projection weight, found shape {list(w.shape)}", key("weight"), w.file)
    if w.dtype in FLOAT_DTYPES:
        return LinearSource("bf16", *w.shape, key("weight"))
    if w.dtype == "F8_E4M3":
        n, k = w.shape
        blocks = (_cdiv(n, 128), _cdiv(k, 128))
        for s in ("weight_scale_inv", "scale"):
            if has(s):
                si = ckpt.check(key(s), blocks, ("F32", "F8_E8M0"))
                return LinearSource("fp8_block" if si.dtype == "F32" else "fp8_block_e8m0", n, k, key("weight"), key(s))
        if has("weight_scale"):
            si = ckpt.check(key("weight_scale"), None, "F32")
            if si.shape in ((), (1,), (n,), (n, 1)):
                return LinearSource("fp8_row", n, k, key("weight"), key("weight_scale"))
            if si.shape == blocks:
                return LinearSource("fp8_block", n, k, key("weight"), key("weight_scale"))
            raise WeightError(f"expected weight_scale of shape [], [1], [{n}], [{n}, 1] or {list(blocks)} for a "
                              f"[{n}, {k}] weight, found {list(si.shape)}", key("weight_scale"), si.file)
        raise WeightError("F8_E4M3 weight without a scale (weight_scale_inv, scale or weight_scale)",
                          key("weight"), w.file)
    if w.dtype in ("U8", "I8"):
        n, k = w.shape[0], 2 * w.shape[1]
        if has("weight_scale_2"):
            ckpt.check(key("weight_scale"), (n, _cdiv(k, qh.NVFP4_GROUP)), "F8_E4M3")
            return LinearSource("nvfp4", n, k, key("weight"), key("weight_scale"),
                                _scalar_key(ckpt, key("weight_scale_2")))
        if has("scale"):
            ckpt.check(key("scale"), (n, _cdiv(k, qh.MXFP4_GROUP)), "F8_E8M0")
            return LinearSource("mxfp4", n, k, key("weight"), key("scale"))
        raise WeightError(f"packed FP4 weight ({w.dtype}) without weight_scale + weight_scale_2 (NVFP4) "
                          "or an E8M0 scale (MXFP4)", key("weight"), w.file)
    raise WeightError(f"unsupported projection weight dtype {w.dtype}", key("weight"), w.file)


def _stored_shape(src: LinearSource, n: int, k: int) -> tuple[int, int]:
    return (n, k // 2) if src.fmt in ("nvfp4", "mxfp4") else (n, k)


def _scale2(ckpt: Checkpoint, src: LinearSource) -> float:
    v = np.float32(ckpt.numpy(src.scale2).reshape(-1)[0])
    return float(np.float32(1) / v) if src.scale2_divisor else float(v)


def dequant_linear(ckpt: Checkpoint, prefix: str) -> np.ndarray:
    """The projection as the device computes it, dequantised to f32 [n, k] on the host (ground truth for
    references; bf16 weights are widened exactly, F16/F32 ones first rounded to bf16 as loaded)."""
    src = detect_linear(ckpt, prefix)
    w = ckpt.numpy(src.weight)
    if src.fmt == "bf16":
        return to_bf16(w.astype(np.float32)).astype(np.float32)
    s = ckpt.numpy(src.scale)
    if src.fmt in ("fp8_block", "fp8_block_e8m0"):
        return qh.dequant_fp8_block(w, s)
    if src.fmt == "fp8_row":
        return qh.dequant_fp8_row(w, s)
    if src.fmt == "nvfp4":
        return qh.dequant_nvfp4(w, s, _scale2(ckpt, src))
    return qh.dequant_mxfp4(w, s)


class WeightLoader:
    """Loads tensors from `ckpt` onto `gpu`, counting the bytes read. A tqdm bar (stderr) is shown when
    `progress=True`, or by default when `total` (or, without it, the checkpoint on disk) exceeds 256 MB;
    `total` is what the bar counts towards, e.g. `ckpt.nbytes_total("mtp.")`."""

    def __init__(self, gpu: Backend, ckpt: Checkpoint | str | Path, progress: bool | None = None,
                 total: int | None = None):
        self.gpu = gpu
        self.ckpt = ckpt if isinstance(ckpt, Checkpoint) else Checkpoint(ckpt)
        self.bytes_loaded = 0
        if progress is None:
            size = total if total is not None else sum(f.stat().st_size for f in self.ckpt.files if f.is_file())
            progress = size > PROGRESS_MIN_BYTES
        self._bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
                         desc="loading weights", disable=not progress, leave=False)

    def __enter__(self) -> "WeightLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._bar.close()

    def _count(self, stored_bytes: int) -> None:
        self.bytes_loaded += stored_bytes
        self._bar.update(stored_bytes)

    def _upload(self, host: np.ndarray, stored_bytes: int) -> DeviceBuffer:
        buf = self.gpu.upload(host)
        self._count(stored_bytes)
        return buf

    def tensor(self, key: str, shape: Sequence[int | None] | None = None,
               dtypes: str | Sequence[str] | None = None, as_dtype: str | None = None) -> DeviceBuffer:
        """One tensor as stored, after checking shape/dtype; `as_dtype="bf16"|"f32"` converts a float tensor
        on the host (F16/F32 -> bf16 with round-to-nearest-even, bf16 -> f32 exactly)."""
        info = self.ckpt.check(key, shape, dtypes)
        if as_dtype is None or _AS.get(as_dtype) == info.dtype:
            return self._upload(self.ckpt.raw(key), info.nbytes)
        if as_dtype not in _AS:
            raise ValueError(f"as_dtype must be one of {sorted(_AS)}, not {as_dtype!r}")
        if info.dtype not in FLOAT_DTYPES:
            raise WeightError(f"cannot convert {info.dtype} to {as_dtype} (expected a float tensor)", key, info.file)
        x = self.ckpt.numpy(key).astype(np.float32)
        return self._upload(to_bf16(x) if as_dtype == "bf16" else x, info.nbytes)

    def linear(self, prefix: str, n: int, k: int, allow: Sequence[str] = FORMATS) -> Linear:
        """Projection `prefix` (without ".weight") of `n` outputs and `k` inputs, in its stored format."""
        src = detect_linear(self.ckpt, prefix)
        file = self.ckpt.file_of(src.weight)
        if src.fmt not in allow:
            raise WeightError(f"expected a weight in format {' or '.join(allow)}, found {src.fmt}", src.weight, file)
        self.ckpt.check(src.weight, _stored_shape(src, n, k))
        if src.fmt in ("nvfp4", "mxfp4") and k % (qh.NVFP4_GROUP if src.fmt == "nvfp4" else qh.MXFP4_GROUP):
            raise WeightError(f"{src.fmt} needs k divisible by its group size (k = {k})", src.weight, file)
        winfo = self.ckpt.info(src.weight)
        if src.fmt == "bf16" and winfo.dtype != "BF16":
            wbuf = self._upload(to_bf16(self.ckpt.numpy(src.weight).astype(np.float32)), winfo.nbytes)
        else:
            wbuf = self._upload(self.ckpt.raw(src.weight), winfo.nbytes)
        owners = [wbuf]
        scale_ptr, scale2 = NULL, 1.0
        if src.scale is not None:
            sinfo = self.ckpt.info(src.scale)
            if src.fmt == "fp8_row":     # per-tensor / [n, 1] -> f32 [n]
                s = np.broadcast_to(self.ckpt.numpy(src.scale).reshape(-1), (n,)).astype(np.float32)
                sbuf = self._upload(s, sinfo.nbytes)
            else:
                sbuf = self._upload(self.ckpt.raw(src.scale), sinfo.nbytes)
            owners.append(sbuf)
            scale_ptr = sbuf.ptr
        if src.scale2 is not None:
            scale2 = _scale2(self.ckpt, src)
            self._count(self.ckpt.info(src.scale2).nbytes)
        return Linear(src.fmt, n, k, wbuf.ptr, scale_ptr, scale2, owners=owners)
