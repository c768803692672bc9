"""Strided reads for twins: kernels read per-row scalars through (pointer, stride-in-bytes) pairs and
tensors through element strides; these give the NumPy views of the same memory, bounds-checked."""
import numpy as np
from numpy.lib.stride_tricks import as_strided

from ..runtime.dtypes import dtype as _dtype


def strided(dev, ptr, dt, shape, strides) -> np.ndarray:
    """Writable view of `shape` elements at `ptr` with per-axis `strides` in elements (bounds-checked over
    the whole span)."""
    dt = _dtype(dt)
    if min(shape) == 0:
        return np.empty(shape, dt)
    span = 1 + sum((n - 1) * s for n, s in zip(shape, strides))
    return as_strided(dev.view(ptr, dt, span), shape, [s * dt.itemsize for s in strides])


def row_scalars(dev, ptr, dt, rows: int, stride_bytes: int) -> np.ndarray:
    """`rows` scalars read at `ptr + r * stride_bytes` (the metadata-slab convention); a copy."""
    dt = _dtype(dt)
    if rows == 0:
        return np.empty(0, dt)
    if int(ptr) % dt.itemsize or stride_bytes % dt.itemsize:
        raise ValueError(f"misaligned {dt} scalars: ptr 0x{int(ptr):x}, stride {stride_bytes} bytes")
    return strided(dev, ptr, dt, (rows,), (stride_bytes // dt.itemsize,)).copy()
