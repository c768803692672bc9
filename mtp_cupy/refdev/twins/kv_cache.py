"""Twins of cuda_src/kv_cache.cu."""
import numpy as np

from ...runtime.dtypes import BF16, FP8, to_fp8
from ..registry import twin
from ..access import row_scalars, strided


def _store(dev, src, src_stride, slots, slot_stride, cache, rows, width, cache_row_width, col_offset, dt, conv):
    slot = row_scalars(dev, slots, "i64", rows, slot_stride)
    live = np.flatnonzero(slot >= 0)
    if live.size == 0:
        return
    s = strided(dev, src, BF16, (rows, width), (src_stride, 1))[live]
    nrows = int(slot[live].max()) + 1
    c = strided(dev, cache.offset(col_offset * dt.itemsize), dt, (nrows, width), (cache_row_width, 1))
    c[slot[live]] = conv(s)


@twin("kv_cache", "reshape_and_cache")
def reshape_and_cache(dev, src, src_stride, slots, slot_stride, cache, rows, width, cache_row_width, col_offset):
    _store(dev, src, src_stride, slots, slot_stride, cache, rows, width, cache_row_width, col_offset, BF16,
           lambda s: s)


@twin("kv_cache", "reshape_and_cache_fp8")
def reshape_and_cache_fp8(dev, src, src_stride, slots, slot_stride, cache, rows, width, cache_row_width,
                          col_offset, scale):
    _store(dev, src, src_stride, slots, slot_stride, cache, rows, width, cache_row_width, col_offset, FP8,
           lambda s: to_fp8(s.astype(np.float32) / np.float32(scale)))
