"""Twins of cuda_src/elementwise.cu."""
import numpy as np

from ...runtime.dtypes import BF16
from ..registry import twin


@twin("elementwise", "bf16_residual_add")
def bf16_residual_add(dev, x, r, n):
    xv = dev.view(x, BF16, n)
    xv[:] = (xv.astype(np.float32) + dev.view(r, BF16, n).astype(np.float32)).astype(BF16)
