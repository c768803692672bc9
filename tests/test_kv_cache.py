"""kv_cache.cu: rows into paged cache slots (i64 through (pointer, stride)), column pieces, negative slots
skipped, bf16 bit-exact, fp8 e4m3(x / scale) saturating. Everything outside the written cells must keep
its poison."""
import ml_dtypes
import numpy as np
import pytest

from mtp_cupy import KernelError, ops
from helpers import POISON, get, out, rand_bf16, run_on_both, up

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


def slot_buffer(slots, stride):
    """i64 slots `stride` bytes apart (stride 8: packed; 4096: one per metadata slab)."""
    buf = np.full(len(slots) * stride, 0xAB, np.uint8)
    buf.reshape(len(slots), stride)[:, :8] = np.asarray(slots, np.int64).view(np.uint8).reshape(-1, 8)
    return buf


def fp8_ref(x, scale):
    """e4m3 of the fp32 quotient, saturating at +-448 (round to nearest even, as __NV_SATFINITE)."""
    q = x.astype(np.float32) / np.float32(scale)
    return np.clip(q.astype(np.float64), -448.0, 448.0).astype(FP8)


def run_cache(dev, src, slots, slot_stride, n_slots, width, row_width, col_offset, dtype, scale=1.0, cache=None):
    rows, src_stride = src.shape
    sb, lb = up(dev, src), up(dev, slot_buffer(slots, slot_stride))
    item = 2 if dtype == "bf16" else 1
    cb = up(dev, cache) if cache is not None else out(dev, "u8", n_slots * row_width * item)
    ops.reshape_and_cache(dev, sb.ptr, src_stride, lb.ptr, slot_stride, cb.ptr, rows, width, row_width, col_offset,
                          dtype=dtype, scale=scale)
    return get(dev, cb, "u8", n_slots * row_width * item)


# (rows, src_stride, width, row_width, col_offset): MLA latent then k_pe into 576-wide rows (kv_a output rows
# of 576), V4 512 rows, GQA 2 heads x 256, and an odd piece.
SHAPES = [(5, 576, 512, 576, 0), (5, 576, 64, 576, 512), (3, 512, 512, 512, 0), (7, 512, 512, 512, 0),
          (4, 40, 13, 29, 9)]


@pytest.mark.parametrize("rows,src_stride,width,row_width,col_offset", SHAPES)
@pytest.mark.parametrize("slot_stride", [8, 4096])
def test_reshape_and_cache_bf16(dev, rng, rows, src_stride, width, row_width, col_offset, slot_stride):
    n_slots = 64
    src = rand_bf16(rng, (rows, src_stride))
    slots = rng.choice(n_slots, rows, replace=False).astype(np.int64)
    slots[rng.random(rows) < 0.3] = -1  # skipped rows
    got = run_cache(dev, src, slots, slot_stride, n_slots, width, row_width, col_offset, "bf16")
    want = np.full(n_slots * row_width * 2, POISON, np.uint8).view(np.uint16).reshape(n_slots, row_width)
    for r, s in enumerate(slots):
        if s >= 0:
            want[s, col_offset:col_offset + width] = src[r, :width].view(np.uint16)
    assert np.array_equal(got.view(np.uint16).reshape(n_slots, row_width), want)


def test_reshape_and_cache_pieces_fill_a_row(dev, rng):
    """MLA: latent (512) and rotated k_pe (64) from separate sources land side by side in one 576 row."""
    rows, n_slots = 3, 16
    lat, pe = rand_bf16(rng, (rows, 512)), rand_bf16(rng, (rows, 64))
    slots = np.array([7, 0, 15], np.int64)
    cache = np.full(n_slots * 576 * 2, POISON, np.uint8)
    cache = run_cache(dev, lat, slots, 8, n_slots, 512, 576, 0, "bf16", cache=cache)
    cache = run_cache(dev, pe, slots, 8, n_slots, 64, 576, 512, "bf16", cache=cache)
    rows_got = cache.view(np.uint16).reshape(n_slots, 576)[slots]
    assert np.array_equal(rows_got, np.concatenate([lat, pe], 1).view(np.uint16))


@pytest.mark.parametrize("rows,src_stride,width,row_width,col_offset", SHAPES)
@pytest.mark.parametrize("scale", [1.0, 0.0173, 3.5])
def test_reshape_and_cache_fp8(dev, rng, rows, src_stride, width, row_width, col_offset, scale):
    n_slots = 32
    src = rand_bf16(rng, (rows, src_stride), 300.0 * scale)  # ~13% of |x / scale| beyond 448: saturates
    slots = rng.choice(n_slots, rows, replace=False).astype(np.int64)
    slots[0] = -1
    got = run_cache(dev, src, slots, 8, n_slots, width, row_width, col_offset, "fp8", scale).reshape(n_slots, row_width)
    want = np.full((n_slots, row_width), POISON, np.uint8)
    for r, s in enumerate(slots):
        if s >= 0:
            want[s, col_offset:col_offset + width] = fp8_ref(src[r, :width], scale).view(np.uint8)
    assert np.array_equal(got, want)
    vals = got.view(FP8).astype(np.float64)[want != POISON]
    assert np.all(np.isfinite(vals)) and np.abs(vals).max() <= 448.0


def test_reshape_and_cache_rejects(ref):
    b = ref.alloc(4096)
    with pytest.raises(KernelError, match="exceed"):
        ops.reshape_and_cache(ref, b.ptr, 64, b.ptr, 8, b.ptr, 1, 64, 100, 40)
    with pytest.raises(KernelError, match="aligned"):
        ops.reshape_and_cache(ref, b.ptr, 64, b.ptr, 12, b.ptr, 1, 64, 64, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("rows,src_stride,width,row_width,col_offset", SHAPES + [(2048, 576, 576, 576, 0)])
def test_reshape_and_cache_cuda_matches_twin(rng, dtype, rows, src_stride, width, row_width, col_offset):
    n_slots = 4096
    src = rand_bf16(rng, (rows, src_stride), 200.0)
    slots = rng.choice(n_slots, rows, replace=False).astype(np.int64)
    slots[rng.random(rows) < 0.1] = -1
    r, c = run_on_both(run_cache, src, slots, 4096, n_slots, width, row_width, col_offset, dtype, 0.37)
    assert np.array_equal(r, c)
