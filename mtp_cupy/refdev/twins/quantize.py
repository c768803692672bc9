"""Twins of cuda_src/quantize.cu. The recipes are the host quantisers of weights/quant_host.py (the same
fp32 steps as the kernels: IEEE division, RNE to e4m3 saturating, RNE to E2M1 saturating)."""
import numpy as np

from ...runtime.dtypes import BF16
from ...weights.quant_host import quant_fp8_row, quant_nvfp4
from ..registry import twin


@twin("quantize", "absmax_bf16")
def absmax_bf16(dev, x, n, out):
    a = np.abs(dev.view(x, BF16, n).astype(np.float32))
    dev.view(out, np.float32, 1)[0] = a.max() if n else np.float32(0)


@twin("quantize", "quantize_fp8_rows")
def quantize_fp8_rows(dev, w, n, k, q, scale):
    codes, s = quant_fp8_row(dev.view(w, BF16, (n, k)))
    dev.view(q, np.uint8, (n, k))[:] = codes.view(np.uint8)
    dev.view(scale, np.float32, n)[:] = s


@twin("quantize", "quantize_nvfp4")
def quantize_nvfp4(dev, w, n, k, q, scale, scale2):
    packed, bs, _ = quant_nvfp4(dev.view(w, BF16, (n, k)), np.float32(scale2))
    dev.view(q, np.uint8, (n, k // 2))[:] = packed
    dev.view(scale, np.uint8, (n, k // 16))[:] = bs.view(np.uint8)
