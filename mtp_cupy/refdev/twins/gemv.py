"""Twins of cuda_src/gemv.cu: dequantise exactly, multiply in float64, round the output once.

Rows are processed in chunks so a float64 copy of a big weight (an LM head) never exceeds ~256 MB."""
from __future__ import annotations

from typing import Callable

import numpy as np
from numpy.lib.stride_tricks import as_strided

from ...runtime.dtypes import BF16, E8M0, FP8, to_bf16
from ..registry import twin

E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])
CHUNK_ELEMS = 1 << 25  # float64 elements per row chunk (256 MB)

Rows = Callable[[int, int], np.ndarray]  # (r0, r1) -> float64 weight rows [r1 - r0, K]


def e8m0_values(b: np.ndarray) -> np.ndarray:
    return b.view(np.uint8).view(E8M0).astype(np.float64)  # 2^(b-127), 0xFF NaN


def _run(dev, rows: Rows, x, y, M, N, K, x_stride, y_stride, out_f32) -> None:
    xv = dev.view(x, BF16, (M - 1) * x_stride + K)
    X = as_strided(xv, (M, K), (x_stride * 2, 2)).astype(np.float64)
    Y = np.empty((M, N), np.float64)
    step = max(1, CHUNK_ELEMS // max(K, 1))
    for r0 in range(0, N, step):
        r1 = min(N, r0 + step)
        Y[:, r0:r1] = X @ rows(r0, r1).T
    dt, conv = (np.float32, lambda v: v.astype(np.float32)) if out_f32 else (BF16, to_bf16)
    yv = dev.view(y, dt, (M - 1) * y_stride + N)
    as_strided(yv, (M, N), (y_stride * yv.itemsize, yv.itemsize))[:] = conv(Y)


def _bf16_rows(dev, W, N, K) -> Rows:
    w = dev.view(W, BF16, (N, K))
    return lambda r0, r1: w[r0:r1].astype(np.float64)


def _fp4_rows(dev, W, N, K, scales: np.ndarray, per: int) -> Rows:
    """Packed E2M1 (low nibble = even k) times a per-`per` block scale (float64 [N, K/per])."""
    w = dev.view(W, np.uint8, (N, K // 2))

    def rows(r0, r1):
        b = w[r0:r1]
        codes = np.empty((r1 - r0, K), np.uint8)
        codes[:, 0::2], codes[:, 1::2] = b & 0xF, b >> 4
        return E2M1[codes] * np.repeat(scales[r0:r1], per, axis=1)
    return rows


def _fp8_block_rows(dev, W, N, K, s: np.ndarray) -> Rows:
    w = dev.view(W, FP8, (N, K))

    def rows(r0, r1):
        sb = np.repeat(s[r0 // 128:(r1 + 127) // 128], 128, axis=0)[r0 % 128:r0 % 128 + r1 - r0]
        return w[r0:r1].astype(np.float64) * np.repeat(sb, 128, axis=1)[:, :K]
    return rows


def _dense(dev, W, x, y, M, N, K, x_stride, y_stride, out_f32):
    _run(dev, _bf16_rows(dev, W, N, K), x, y, M, N, K, x_stride, y_stride, out_f32)


for _name in ("dense_gemv_bf16", "dense_gemv_bf16_batchm", "dense_gemv_bf16_batch32", "dense_gemm_bf16",
              "dense_gemv_bf16_regs", "dense_gemv_bf16_batchm_regs"):  # register-round kernels: same math
    twin("gemv", _name)(_dense)


@twin("gemv", "gemv_fp8w")
def gemv_fp8w(dev, W, scale, x, y, M, N, K, x_stride, y_stride, out_f32):
    w = dev.view(W, FP8, (N, K))
    s = dev.view(scale, np.float32, N).astype(np.float64)
    _run(dev, lambda r0, r1: w[r0:r1].astype(np.float64) * s[r0:r1, None],
         x, y, M, N, K, x_stride, y_stride, out_f32)


def _kb(n: int, k: int) -> tuple[int, int]:
    return (n + 127) // 128, (k + 127) // 128


@twin("gemv", "w8a16_gemv")
def w8a16_gemv(dev, W, scale, x, y, M, N, K, x_stride, y_stride, out_f32):
    s = dev.view(scale, np.float32, _kb(N, K)).astype(np.float64)
    _run(dev, _fp8_block_rows(dev, W, N, K, s), x, y, M, N, K, x_stride, y_stride, out_f32)


@twin("gemv", "w8a16_gemv_e8m0")
def w8a16_gemv_e8m0(dev, W, scale, x, y, M, N, K, x_stride, y_stride, out_f32):
    s = e8m0_values(dev.view(scale, np.uint8, _kb(N, K)))
    _run(dev, _fp8_block_rows(dev, W, N, K, s), x, y, M, N, K, x_stride, y_stride, out_f32)


@twin("gemv", "w4a16_gemv")
def w4a16_gemv(dev, W, scale, scale2, x, y, M, N, K, x_stride, y_stride, out_f32):
    s = dev.view(scale, FP8, (N, K // 16)).astype(np.float64) * float(np.float32(scale2))
    _run(dev, _fp4_rows(dev, W, N, K, s, 16), x, y, M, N, K, x_stride, y_stride, out_f32)


@twin("gemv", "w4a16_gemv_mx")
def w4a16_gemv_mx(dev, W, scale, x, y, M, N, K, x_stride, y_stride, out_f32):
    s = e8m0_values(dev.view(scale, np.uint8, (N, K // 32)))
    _run(dev, _fp4_rows(dev, W, N, K, s, 32), x, y, M, N, K, x_stride, y_stride, out_f32)


twin("gemv", "w8a16_gemv_regs")(w8a16_gemv)  # register-round kernels: same math
twin("gemv", "w4a16_gemv_regs")(w4a16_gemv)
# M <= 32 variants of the quantised kernels: the same per-row math
twin("gemv", "gemv_fp8w_batch32")(gemv_fp8w)
twin("gemv", "w8a16_gemv_batch32")(w8a16_gemv)
twin("gemv", "w8a16_gemv_e8m0_batch32")(w8a16_gemv_e8m0)
twin("gemv", "w4a16_gemv_batch32")(w4a16_gemv)
twin("gemv", "w4a16_gemv_mx_batch32")(w4a16_gemv_mx)


# The 64-row x-staged kernels: the same per-row math; fks (the 8-row plan's slices) only orders the sums, and
# bf16's scale is unused.
@twin("gemv", "dense_gemv_bf16_batch64")
def dense_gemv_bf16_batch64(dev, W, scale, fks, x, y, M, N, K, x_stride, y_stride, out_f32):
    _dense(dev, W, x, y, M, N, K, x_stride, y_stride, out_f32)


@twin("gemv", "gemv_fp8w_batch64")
def gemv_fp8w_batch64(dev, W, scale, fks, x, y, M, N, K, x_stride, y_stride, out_f32):
    gemv_fp8w(dev, W, scale, x, y, M, N, K, x_stride, y_stride, out_f32)


@twin("gemv", "w8a16_gemv_batch64")
def w8a16_gemv_batch64(dev, W, scale, fks, x, y, M, N, K, x_stride, y_stride, out_f32):
    w8a16_gemv(dev, W, scale, x, y, M, N, K, x_stride, y_stride, out_f32)


@twin("gemv", "w8a16_gemv_e8m0_batch64")
def w8a16_gemv_e8m0_batch64(dev, W, scale, fks, x, y, M, N, K, x_stride, y_stride, out_f32):
    w8a16_gemv_e8m0(dev, W, scale, x, y, M, N, K, x_stride, y_stride, out_f32)


# The wgmma kernels (gemv_wg.cu): the same per-row math; fks and kw (the 8-row plan's slices) only order the sums.
@twin("gemv_wg", "w8a16_gemv_wg")
def w8a16_gemv_wg(dev, W, scale, fks, kw, x, y, M, N, K, x_stride, y_stride, out_f32):
    w8a16_gemv(dev, W, scale, x, y, M, N, K, x_stride, y_stride, out_f32)


@twin("gemv_wg", "w8a16_gemv_e8m0_wg")
def w8a16_gemv_e8m0_wg(dev, W, scale, fks, kw, x, y, M, N, K, x_stride, y_stride, out_f32):
    w8a16_gemv_e8m0(dev, W, scale, x, y, M, N, K, x_stride, y_stride, out_f32)
