"""Launcher for cuda_src/kv_cache.cu."""
from ._util import THREADS, launch, need

FP8_BLOCK = 64          # columns per UE8M0 scale in the blocked fp8 row (DeepSeek-V4's act_quant block)


def fp8_block_layout(width: int, nope: int) -> tuple[int, int, int]:
    """(rope_off, scale_off, row_bytes) of the blocked fp8 KV row of `width` columns, the first `nope` of them
    e4m3 codes (bytes [0, nope), zeros to rope_off = roundup16(nope)), then the bf16 rest ([rope_off,
    scale_off)), then one UE8M0 byte per 64-block, zeros to row_bytes (a multiple of 16). The one Python copy
    of cuda_src/common.cuh kv_fp8_block_*."""
    rope_off = -(-nope // 16) * 16
    scale_off = rope_off + 2 * (width - nope)
    return rope_off, scale_off, -(-(scale_off + -(-nope // FP8_BLOCK)) // 16) * 16

__all__ = ["reshape_and_cache", "reshape_and_cache_fp8_blocks", "fp8_block_layout", "FP8_BLOCK"]


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


def reshape_and_cache_fp8_blocks(gpu, src, src_stride, slots, slot_stride, cache_base, rows, width, nope,
                                 stream=None):
    """Row r of src (bf16 [width], element r * src_stride) -> the blocked fp8 row at cache slot slots[r]
    (`fp8_block_layout(width, nope)`; negative slots skip): each 64-block of columns [0, nope) as e4m3 with the
    power-of-two scale 2^ceil(log2(max(amax, 1e-4) / 448)) (UE8M0), columns [nope, width) as bf16 (DeepSeek-V4's
    QAT numerics for its KV rows; the attention reads them back exactly with mla_decode(kv_dtype="fp8"))."""
    need(width % 8 == 0 and 0 < nope <= width and nope % 2 == 0,
         f"reshape_and_cache_fp8_blocks: width {width} (a multiple of 8) and nope {nope} (even, in [1, width])")
    need(slot_stride % 8 == 0 and int(slots) % 8 == 0,
         f"reshape_and_cache_fp8_blocks: slots must be 8-byte aligned (stride {slot_stride})")
    need(int(cache_base) % 16 == 0, "reshape_and_cache_fp8_blocks: the cache must be 16-byte aligned")
    launch(gpu, "kv_cache", "reshape_and_cache_fp8_blocks").grid(max(1, rows)).block(THREADS) \
        .arg_ptr(src).arg_u32(src_stride).arg_ptr(slots).arg_u32(slot_stride).arg_ptr(cache_base).arg_u32(rows) \
        .arg_u32(width).arg_u32(nope).launch(stream)
