"""Twins of cuda_src/kv_cache.cu."""
import numpy as np

from ...ops.kv_cache import FP8_BLOCK, fp8_block_layout
from ...runtime.dtypes import BF16, FP8, to_fp8
from ..registry import twin
from ..access import row_scalars, strided


def _store(dev, src, src_stride, slots, slot_stride, cache, rows, width, cache_row_width, col_offset, dt, conv):
    put_rows(dev, strided(dev, src, BF16, (rows, width), (src_stride, 1)), slots, slot_stride, cache, cache_row_width,
             col_offset, dt, conv)


def put_rows(dev, s: np.ndarray, slots, slot_stride, cache, cache_row_width, col_offset, dt, conv) -> None:
    """Rows s [rows, width] (bf16) -> conv(row) at columns [col_offset, col_offset + width) of cache row slots[r]
    (i64 at slots + r * slot_stride bytes; negative: skipped)."""
    rows, width = s.shape
    slot = row_scalars(dev, slots, "i64", rows, slot_stride)
    live = np.flatnonzero(slot >= 0)
    if live.size == 0:
        return
    nrows = int(slot[live].max()) + 1
    c = strided(dev, cache.offset(col_offset * dt.itemsize), dt, (nrows, width), (cache_row_width, 1))
    c[slot[live]] = conv(s[live])


@twin("kv_cache", "reshape_and_cache")
def reshape_and_cache(dev, src, src_stride, slots, slot_stride, cache, rows, width, cache_row_width, col_offset):
    _store(dev, src, src_stride, slots, slot_stride, cache, rows, width, cache_row_width, col_offset, BF16,
           lambda s: s)


@twin("kv_cache", "reshape_and_cache_fp8")
def reshape_and_cache_fp8(dev, src, src_stride, slots, slot_stride, cache, rows, width, cache_row_width,
                          col_offset, scale):
    _store(dev, src, src_stride, slots, slot_stride, cache, rows, width, cache_row_width, col_offset, FP8,
           fp8_quotient(scale))


def fp8_quotient(scale: float):
    """bf16 rows -> e4m3(x / scale) (the fp32 quotient, saturating): the per-tensor fp8 cache's encoding."""
    return lambda s: to_fp8(s.astype(np.float32) / np.float32(scale))


# -- the blocked fp8 row (DeepSeek-V4's cache; layout: ops.kv_cache.fp8_block_layout) ------------------------
_INV448 = np.float32(1.0) / np.float32(448.0)   # the kernel's compile-time 1.0f / 448.0f


def fp8_block_exponents(x: np.ndarray, nope: int) -> np.ndarray:
    """int [rows, blocks]: e with 2^e the scale of each 64-block of x[:, :nope] (f32 values of bf16 inputs):
    ceil(log2(max(amax, 1e-4) * (1/448))) from the f32 bits, as the kernel (and DeepSeek's fast_round_scale)."""
    rows, nb = x.shape[0], -(-nope // FP8_BLOCK)
    a = np.zeros((rows, nb), np.float32)
    for b in range(nb):
        a[:, b] = np.abs(x[:, b * FP8_BLOCK:min(nope, (b + 1) * FP8_BLOCK)]).max(axis=1)
    t = (np.maximum(a, np.float32(1e-4)) * _INV448).astype(np.float32).view(np.uint32)
    return ((t >> 23) & 0xFF).astype(np.int64) - 127 + ((t & 0x7FFFFF) != 0)


def encode_fp8_blocks(x: np.ndarray, width: int, nope: int) -> np.ndarray:
    """uint8 [rows, row_bytes]: bf16 rows x [rows, width] as the kernel stores them."""
    rope_off, scale_off, row_bytes = fp8_block_layout(width, nope)
    x = np.asarray(x, np.float32)
    e = fp8_block_exponents(x, nope)
    inv = np.exp2(-np.repeat(e, FP8_BLOCK, axis=1)[:, :nope]).astype(np.float32)   # 2^-e, exact
    out = np.zeros((x.shape[0], row_bytes), np.uint8)
    out[:, :nope] = to_fp8(x[:, :nope] * inv).view(np.uint8)
    out[:, rope_off:scale_off] = x[:, nope:].astype(BF16).view(np.uint8).reshape(x.shape[0], -1)
    out[:, scale_off:scale_off + e.shape[1]] = (e + 127).astype(np.uint8)
    return out


def decode_fp8_blocks(raw: np.ndarray, width: int, nope: int) -> np.ndarray:
    """float64 [rows, width] of blocked fp8 rows (what the attention kernel converts them to, exactly)."""
    rope_off, scale_off, _ = fp8_block_layout(width, nope)
    raw = np.ascontiguousarray(raw)
    nb = -(-nope // FP8_BLOCK)
    e = raw[:, scale_off:scale_off + nb].astype(np.float64) - 127
    out = np.empty((raw.shape[0], width))
    out[:, :nope] = raw[:, :nope].view(FP8).astype(np.float64) * np.exp2(np.repeat(e, FP8_BLOCK, axis=1)[:, :nope])
    out[:, nope:] = raw[:, rope_off:scale_off].copy().view(BF16).astype(np.float64)
    return out


@twin("kv_cache", "reshape_and_cache_fp8_blocks")
def reshape_and_cache_fp8_blocks(dev, src, src_stride, slots, slot_stride, cache, rows, width, nope):
    slot = row_scalars(dev, slots, "i64", rows, slot_stride)
    live = np.flatnonzero(slot >= 0)
    if live.size == 0:
        return
    row_bytes = fp8_block_layout(width, nope)[2]
    s = strided(dev, src, BF16, (rows, width), (src_stride, 1))[live].astype(np.float32)
    c = dev.view(cache, np.uint8, ((int(slot[live].max()) + 1), row_bytes))
    c[slot[live]] = encode_fp8_blocks(s, width, nope)
