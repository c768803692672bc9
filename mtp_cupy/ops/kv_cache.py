"""Launcher for cuda_src/kv_cache.cu."""
from ._util import THREADS, launch, need

__all__ = ["reshape_and_cache"]


def reshape_and_cache(gpu, src, src_stride, slots, slot_stride, cache_base, rows, width, cache_row_width,
                      col_offset, dtype="bf16", scale=1.0, stream=None):
    """Row r of src (bf16, element r * src_stride) -> columns [col_offset, col_offset + width) of cache row
    slots[r] (i64 at `slots + r * slot_stride` bytes; negative = skip). dtype "fp8" stores e4m3(x / scale),
    saturating; cache rows are cache_row_width elements of `dtype`."""
    need(dtype in ("bf16", "fp8"), f"reshape_and_cache: dtype {dtype!r} is not bf16 or fp8")
    need(col_offset + width <= cache_row_width,
         f"reshape_and_cache: columns [{col_offset}, {col_offset + width}) exceed the row of {cache_row_width}")
    need(slot_stride % 8 == 0 and int(slots) % 8 == 0,
         f"reshape_and_cache: slots must be 8-byte aligned (stride {slot_stride})")
    name = "reshape_and_cache" if dtype == "bf16" else "reshape_and_cache_fp8"
    k = launch(gpu, "kv_cache", name).grid(rows).block(min(THREADS, max(32, -(-width // 32) * 32))) \
        .arg_ptr(src).arg_u32(src_stride).arg_ptr(slots).arg_u32(slot_stride).arg_ptr(cache_base).arg_u32(rows) \
        .arg_u32(width).arg_u32(cache_row_width).arg_u32(col_offset)
    if dtype == "fp8":
        need(scale > 0, f"reshape_and_cache: fp8 scale {scale} must be positive")
        k.arg_f32(scale)
    k.launch(stream)
