"""Strided reads for twins: kernels read per-row scalars through (pointer, stride-in-bytes) pairs and
tensors through element strides; these give the NumPy views of the same memory, bounds-checked. Also the
metadata-slab accessors (the twins' side of cuda_src/meta.cuh)."""
import numpy as np
from numpy.lib.stride_tricks import as_strided

from ..runtime.dtypes import dtype as _dtype
from ..runtime.slab import BLOCK_SIZE, POS_OFFSET, SEQ_LEN_OFFSET, SLOT_OFFSET, TABLE_OFFSET, blocks_for


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


# -- the metadata slab (layout: mtp_cupy.runtime.slab; the kernels' side is cuda_src/meta.cuh) -----------------
def meta_slab(meta, meta_stride: int, s: int):
    """Pointer to slab s of a batch (slabs meta_stride bytes apart)."""
    return meta.offset(s * meta_stride)


def slab_pos(dev, slab) -> int:
    return int(dev.view(slab.offset(POS_OFFSET), np.uint32, 1)[0])


def slab_slot(dev, slab) -> int:
    return int(dev.view(slab.offset(SLOT_OFFSET), np.int64, 1)[0])


def slab_seq_len(dev, slab) -> int:
    return int(dev.view(slab.offset(SEQ_LEN_OFFSET), np.int32, 1)[0])


def slab_table(dev, slab, rows: int) -> np.ndarray:
    """int64 copy of the block-table entries that cover logical rows [0, rows)."""
    return dev.view(slab.offset(TABLE_OFFSET), np.int32, blocks_for(rows)).astype(np.int64)


def kv_slots(table: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Cache slots of logical rows (all >= 0) through a block table (cuda_src/meta.cuh kv_slot)."""
    return table[rows // BLOCK_SIZE] * BLOCK_SIZE + rows % BLOCK_SIZE
