"""Launchers for cuda_src/quantize.cu: abs-max and bf16 -> fp8_row / nvfp4 quantisation on the device."""
from __future__ import annotations

import numpy as np

from ..weights.linear import Linear
from ._util import blocks_for, launch, need

__all__ = ["absmax", "quantize_fp8_rows", "quantize_nvfp4", "quantize_linear", "nvfp4_scale2"]

E2M1_MAX_X_FP8_MAX = np.float32(6 * 448)


def absmax(gpu, x, n: int, out, stream=None) -> None:
    """out f32 [1] = max |x| over n bf16 (NaN if any is NaN); out is zeroed first (one memset)."""
    need(n >= 1, f"absmax_bf16: n {n} must be >= 1")
    gpu.memset_async(out, 0, 4, stream)
    launch(gpu, "quantize", "absmax_bf16").grid(blocks_for(n, cap=1024)).block(256).arg_ptr(x).arg_u32(n) \
        .arg_ptr(out).launch(stream)


def quantize_fp8_rows(gpu, w_bf16, n: int, k: int, out_w, out_scale, stream=None) -> None:
    """out_w e4m3 [n, k] = w / s, out_scale f32 [n] = s = rowmax|w| / 448 (1.0 for a zero row); saturating."""
    need(n >= 1 and k >= 1, f"quantize_fp8_rows: n {n}, k {k}")
    launch(gpu, "quantize", "quantize_fp8_rows").grid(n).block(256).arg_ptr(w_bf16).arg_u32(n).arg_u32(k) \
        .arg_ptr(out_w).arg_ptr(out_scale).launch(stream)


def nvfp4_scale2(amax: float) -> float:
    """ModelOpt's global scale amax / (6 * 448) in fp32 (1.0 for an all-zero tensor)."""
    a = np.float32(amax)
    return float(a / E2M1_MAX_X_FP8_MAX) if a > 0 else 1.0


def quantize_nvfp4(gpu, w_bf16, n: int, k: int, out_w, out_scale, scale2: float, stream=None) -> None:
    """ModelOpt NVFP4 with the given global scale2 (> 0; see nvfp4_scale2): out_scale e4m3 [n, k/16] =
    clamp(block_amax / (6 * scale2), 2^-9, 448) (1.0 for an all-zero block), out_w u8 [n, k/2] = RNE E2M1 of
    w / (block_scale * scale2), low nibble = even element."""
    name = "quantize_nvfp4"
    need(n >= 1 and k >= 16 and k % 16 == 0, f"{name}: k {k} must be a positive multiple of 16")
    need(scale2 > 0 and np.isfinite(scale2), f"{name}: scale2 {scale2} must be positive and finite")
    need(int(w_bf16) % 16 == 0 and int(out_w) % 8 == 0, f"{name}: w must be 16-byte and out_w 8-byte aligned")
    launch(gpu, "quantize", name).grid(blocks_for(n * (k // 16))).block(256).arg_ptr(w_bf16).arg_u32(n) \
        .arg_u32(k).arg_ptr(out_w).arg_ptr(out_scale).arg_f32(scale2).launch(stream)


def quantize_linear(gpu, W: Linear, fmt: str, stream=None) -> Linear:
    """A new Linear in `fmt` ("fp8_row" or "nvfp4") quantised on the device from a bf16 Linear. nvfp4 reads
    the abs-max back to the host (one synchronisation) for scale2. Returns once the codes are written: the
    streaming GEMVs read their weights before they wait for the kernel ahead of them (pdl_entry in common.cuh),
    so a weight must not be the output of the kernel just before its GEMV."""
    need(W.fmt == "bf16", f"quantize_linear: source must be bf16, not {W.fmt}")
    need(fmt in ("fp8_row", "nvfp4"), f"quantize_linear: target {fmt!r} is not fp8_row or nvfp4")
    n, k = W.n, W.k
    codes = n * k if fmt == "fp8_row" else n * k // 2
    off = (codes + 255) // 256 * 256
    buf = gpu.alloc(off + (4 * n if fmt == "fp8_row" else n * k // 16))
    q, s = buf.ptr, buf.ptr.offset(off)
    if fmt == "fp8_row":
        quantize_fp8_rows(gpu, W.weight, n, k, q, s, stream)
        gpu.synchronize(stream)
        return Linear("fp8_row", n, k, q, s, owners=[buf])
    tmp = gpu.alloc(4)
    absmax(gpu, W.weight, n * k, tmp.ptr, stream)
    gpu.synchronize(stream)
    scale2 = nvfp4_scale2(gpu.read(tmp.ptr, "f32", 1)[0])
    quantize_nvfp4(gpu, W.weight, n, k, q, s, scale2, stream)
    gpu.synchronize(stream)
    return Linear("nvfp4", n, k, q, s, scale2, owners=[buf])
