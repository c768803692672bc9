"""Launchers for cuda_src/gemv.cu. `linear` picks the kernel from the weight format and the row count.

GEMV geometry: blocks of 8 warps, shape (32, ks, 8 // ks); `ks` warps split the k range of one row tile
(deterministic in-block reduction) when there are too few tiles to keep ~32 warps busy per SM."""
from __future__ import annotations

import functools
from dataclasses import dataclass

from ..runtime.backend import Backend
from ..runtime.ptr import DevicePtr
from ..weights.linear import Linear
from ._util import launch, need

__all__ = ["linear", "dense_gemv_bf16", "dense_gemv_bf16_batchm", "dense_gemv_bf16_batch32",
           "dense_gemm_bf16", "gemv_fp8w", "w8a16_gemv", "w8a16_gemv_e8m0", "w4a16_gemv", "w4a16_gemv_mx"]

WARPS = 8
QUANT_MAX_M = 8  # x rows per pass of the quantised kernels; `linear` loops for more


@dataclass(frozen=True)
class _Geom:
    kchunk: int       # k per 16-byte weight chunk: K must be a multiple (whole chunks, aligned rows)
    tile_rows: int    # weight rows per warp
    step_chunks: int  # chunks per row that one warp reads per k-step
    max_m: int
    scale_align: int = 1  # bytes per scale load


_FMA = _Geom(8, 2, 32, 65535)  # dense_gemv_bf16: x row per grid.y
_GEOM = {"dense_gemv_bf16": _FMA,
         "dense_gemv_bf16_batchm": _Geom(8, 16, 4, 8),
         "dense_gemv_bf16_batch32": _Geom(8, 32, 4, 32),
         "gemv_fp8w": _Geom(16, 16, 4, QUANT_MAX_M, 4),
         "w8a16_gemv": _Geom(16, 16, 4, QUANT_MAX_M, 4),
         "w8a16_gemv_e8m0": _Geom(16, 16, 4, QUANT_MAX_M),
         "w4a16_gemv": _Geom(32, 16, 4, QUANT_MAX_M, 2),  # two e4m3 scales per 32-code chunk
         "w4a16_gemv_mx": _Geom(32, 16, 4, QUANT_MAX_M)}
GEMM_TILE = 128


@functools.cache
def _cuda_sms(device_id: int) -> int:
    import cupy
    return int(cupy.cuda.runtime.getDeviceProperties(device_id)["multiProcessorCount"])


def _sms(gpu: Backend) -> int:
    return _cuda_sms(getattr(gpu, "device_id", 0)) if gpu.is_cuda else 132


def _out_f32(out_dtype: str) -> int:
    need(out_dtype in ("bf16", "f32"), f"gemv: out_dtype must be 'bf16' or 'f32', got {out_dtype!r}")
    return int(out_dtype == "f32")


def _check(name: str, kchunk: int, w, x, m: int, n: int, k: int, x_stride: int, y_stride: int,
           max_m: int) -> None:
    need(n > 0 and k > 0, f"{name}: empty weight {n}x{k}")
    need(1 <= m <= max_m, f"{name}: m={m} outside 1..{max_m}")
    need(k % kchunk == 0, f"{name}: K={k} must be a multiple of {kchunk} (16-byte weight chunks)")
    need(int(w) % 16 == 0, f"{name}: weight pointer 0x{int(w):x} is not 16-byte aligned")
    need(int(x) % 16 == 0 and x_stride % 8 == 0,
         f"{name}: x (0x{int(x):x}, row stride {x_stride}) must be 16-byte aligned with a stride % 8 == 0")
    need(x_stride >= k and y_stride >= n, f"{name}: strides x {x_stride} < K={k} or y {y_stride} < N={n}")


def _gemv(gpu: Backend, name: str, lead: list[tuple[str, object]], x, y, m: int, n: int, k: int,
          x_stride: int, y_stride: int, out_dtype: str, stream) -> None:
    g = _GEOM[name]
    f32 = _out_f32(out_dtype)
    _check(name, g.kchunk, lead[0][1], x, m, n, k, x_stride, y_stride, g.max_m)
    if len(lead) > 1:
        sp = int(lead[1][1])
        need(sp != 0 and sp % g.scale_align == 0, f"{name}: scale pointer 0x{sp:x} is NULL or not "
                                                  f"{g.scale_align}-byte aligned")
    units = -(-n // g.tile_rows)
    k_steps = -(-(k // g.kchunk) // g.step_chunks)
    ks = 1  # split k while warps are scarce (latency-bound), keeping >= 1 k-step per warp
    while ks < WARPS and units * ks < 32 * _sms(gpu) and k_steps >= 2 * ks:
        ks *= 2
    l = launch(gpu, "gemv", name)
    for kind, v in lead:
        getattr(l, "arg_" + kind)(v)
    l.arg_ptr(x).arg_ptr(y).arg_u32(m).arg_u32(n).arg_u32(k).arg_u32(x_stride).arg_u32(y_stride).arg_u32(f32)
    l.grid(-(-units // (WARPS // ks)), m if g is _FMA else 1).block(32, ks, WARPS // ks).launch(stream)


def dense_gemv_bf16(gpu, w, x, y, m, n, k, x_stride, y_stride, out_dtype="bf16", stream=None):
    """Warp-per-row-pair FMA GEMV, one x row per grid row (the m = 1 path)."""
    _gemv(gpu, "dense_gemv_bf16", [("ptr", w)], x, y, m, n, k, x_stride, y_stride, out_dtype, stream)


def dense_gemv_bf16_batchm(gpu, w, x, y, m, n, k, x_stride, y_stride, out_dtype="bf16", stream=None):
    """m <= 8 x rows in one pass over W (tensor cores)."""
    _gemv(gpu, "dense_gemv_bf16_batchm", [("ptr", w)], x, y, m, n, k, x_stride, y_stride, out_dtype, stream)


def dense_gemv_bf16_batch32(gpu, w, x, y, m, n, k, x_stride, y_stride, out_dtype="bf16", stream=None):
    """m <= 32 x rows in one pass over W (tensor cores)."""
    _gemv(gpu, "dense_gemv_bf16_batch32", [("ptr", w)], x, y, m, n, k, x_stride, y_stride, out_dtype, stream)


def gemv_fp8w(gpu, w, scale, x, y, m, n, k, x_stride, y_stride, out_dtype="bf16", stream=None):
    """e4m3 weight with a f32 scale per row; m <= 8."""
    _gemv(gpu, "gemv_fp8w", [("ptr", w), ("ptr", scale)], x, y, m, n, k, x_stride, y_stride, out_dtype, stream)


def w8a16_gemv(gpu, w, scale, x, y, m, n, k, x_stride, y_stride, out_dtype="bf16", stream=None):
    """e4m3 weight with f32 128x128 block scales [ceil(n/128), ceil(k/128)]; m <= 8."""
    _gemv(gpu, "w8a16_gemv", [("ptr", w), ("ptr", scale)], x, y, m, n, k, x_stride, y_stride, out_dtype, stream)


def w8a16_gemv_e8m0(gpu, w, scale, x, y, m, n, k, x_stride, y_stride, out_dtype="bf16", stream=None):
    """e4m3 weight with E8M0 128x128 block scales; m <= 8."""
    _gemv(gpu, "w8a16_gemv_e8m0", [("ptr", w), ("ptr", scale)], x, y, m, n, k, x_stride, y_stride, out_dtype,
          stream)


def w4a16_gemv(gpu, w, scale, scale2, x, y, m, n, k, x_stride, y_stride, out_dtype="bf16", stream=None):
    """NVFP4: packed E2M1, e4m3 scales [n, k/16] (linear layout), global f32 scale2; m <= 8."""
    _gemv(gpu, "w4a16_gemv", [("ptr", w), ("ptr", scale), ("f32", scale2)], x, y, m, n, k, x_stride, y_stride,
          out_dtype, stream)


def w4a16_gemv_mx(gpu, w, scale, x, y, m, n, k, x_stride, y_stride, out_dtype="bf16", stream=None):
    """MXFP4: packed E2M1, E8M0 scales [n, k/32]; m <= 8. Exact for scales 2^-61 .. 2^65."""
    _gemv(gpu, "w4a16_gemv_mx", [("ptr", w), ("ptr", scale)], x, y, m, n, k, x_stride, y_stride, out_dtype,
          stream)


def dense_gemm_bf16(gpu, w, x, y, m, n, k, x_stride, y_stride, out_dtype="bf16", stream=None):
    """Tiled tensor-core GEMM for prefill rows (any m)."""
    f32 = _out_f32(out_dtype)
    _check("dense_gemm_bf16", 8, w, x, m, n, k, x_stride, y_stride, 65535 * GEMM_TILE)
    need(n <= 65535 * GEMM_TILE, f"dense_gemm_bf16: N={n} too large for grid.y")
    launch(gpu, "gemv", "dense_gemm_bf16").grid(-(-m // GEMM_TILE), -(-n // GEMM_TILE)).block(256) \
        .arg_ptr(w).arg_ptr(x).arg_ptr(y).arg_u32(m).arg_u32(n).arg_u32(k).arg_u32(x_stride) \
        .arg_u32(y_stride).arg_u32(f32).launch(stream)


_BF16_BY_M = ((1, dense_gemv_bf16), (8, dense_gemv_bf16_batchm), (32, dense_gemv_bf16_batch32))
_QUANT = {"fp8_row": gemv_fp8w, "fp8_block": w8a16_gemv, "fp8_block_e8m0": w8a16_gemv_e8m0,
          "mxfp4": w4a16_gemv_mx}


def linear(gpu: Backend, x, W: Linear, y, m: int = 1, out_dtype: str = "bf16", x_stride: int | None = None,
           y_stride: int | None = None, stream=None) -> None:
    """y[m, W.n] = x[m, W.k] @ W.T (x bf16; y bf16 or f32). Strides are in elements (default dense)."""
    xs = W.k if x_stride is None else int(x_stride)
    ys = W.n if y_stride is None else int(y_stride)
    if W.fmt == "bf16":
        fn = next((f for lim, f in _BF16_BY_M if m <= lim), dense_gemm_bf16)
        fn(gpu, W.weight, x, y, m, W.n, W.k, xs, ys, out_dtype, stream)
        return
    ybytes = 4 if _out_f32(out_dtype) else 2
    need(m >= 1, f"linear({W.fmt}): m={m} < 1")
    for r0 in range(0, m, QUANT_MAX_M):  # each pass reads W once for up to 8 x rows
        mm = min(QUANT_MAX_M, m - r0)
        xr, yr = DevicePtr(int(x) + r0 * xs * 2), DevicePtr(int(y) + r0 * ys * ybytes)
        if W.fmt == "nvfp4":
            w4a16_gemv(gpu, W.weight, W.scale, W.scale2, xr, yr, mm, W.n, W.k, xs, ys, out_dtype, stream)
        else:
            _QUANT[W.fmt](gpu, W.weight, W.scale, xr, yr, mm, W.n, W.k, xs, ys, out_dtype, stream)
