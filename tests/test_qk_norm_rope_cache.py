"""rms_norm.cu qk_norm_rope_cache_1pw: Qwen3-Next's per-head q / k norms, RoPE on q and k, and the K / V cache
writes in one launch. Against a float64 reference (norm, rotation, the cache's e4m3 quotient), and bit-identical
to the three kernels it replaces (rms_norm_strided, rope, reshape_and_cache) on the same device. Outputs are
poisoned: a skipped cell, a row whose slot is negative or a cache row no slot names keeps its poison."""
import math

import ml_dtypes
import numpy as np
import pytest

from mtp_cupy import KernelError, ops
from mtp_cupy.layers.rope_tables import default_inv_freq
from helpers import POISON, assert_close, f32, get, out, rand_bf16, up

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
EPS = 1e-6


def heads_ref(x, w, pos, inv_freq, rot):
    """x [rows, heads, dim] bf16 -> float64 (1 + w) * x / rms(x), then neox RoPE over dims [0, rot) at pos."""
    x = f32(x).astype(np.float64)
    y = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + EPS) * (1.0 + f32(w).astype(np.float64))
    half = rot // 2
    theta = (pos.astype(np.float32)[:, None] * inv_freq[None, :]).astype(np.float64)[:, None, :]   # the fp32 angle
    c, s = np.cos(theta), np.sin(theta)
    a, b = y[..., :half].copy(), y[..., half:rot].copy()
    y[..., :half], y[..., half:rot] = a * c - b * s, b * c + a * s
    return y


# name: (rows, q_heads, k_heads, dim, rot, q_head_stride): Qwen3-Next-80B ([q_h | gate_h] interleave), a
# narrower GQA without a gate, a batch of 64, and prefill rows (K and V only)
CASES = {"qwen3_next": (3, 16, 2, 256, 64, 512), "gqa_128": (5, 8, 4, 128, 32, 128),
         "batch64": (64, 16, 2, 256, 64, 512), "prefill": (7, 0, 2, 256, 64, 512)}


def inputs(rng, rows, q_heads, k_heads, dim, q_head_stride, n_slots):
    nq = q_heads * q_head_stride
    x = rand_bf16(rng, (rows, nq + 2 * k_heads * dim), 3.0)
    qw, kw = rand_bf16(rng, dim, 0.3), rand_bf16(rng, dim, 0.3)
    pos = rng.integers(0, 40000, rows).astype(np.uint32)
    slots = rng.choice(n_slots, rows, replace=False).astype(np.int64)
    slots[rng.random(rows) < 0.25] = -1
    return x, qw, kw, pos, slots


def slab(pos, slots, stride=64):
    """Positions (u32 at 0) and slots (i64 at 8) of each row in a slab of `stride` bytes, junk between."""
    buf = np.full((len(pos), stride), 0xAB, np.uint8)
    buf[:, 0:4] = pos.view(np.uint8).reshape(-1, 4)
    buf[:, 8:16] = slots.view(np.uint8).reshape(-1, 8)
    return buf.reshape(-1)


def run_fused(dev, x, qw, kw, pos, slots, q_heads, k_heads, dim, rot, q_head_stride, n_slots, kv_dtype, scale):
    rows, row = x.shape
    inv = default_inv_freq(rot, 1e7)
    item = 1 if kv_dtype == "fp8" else 2
    xb, qwb, kwb, mb, fb = up(dev, x), up(dev, qw), up(dev, kw), up(dev, slab(pos, slots)), up(dev, inv)
    qo = out(dev, "bf16", (rows, max(q_heads, 1) * dim))
    kc, vc = out(dev, "u8", n_slots * k_heads * dim * item), out(dev, "u8", n_slots * k_heads * dim * item)
    nq = q_heads * q_head_stride
    ops.qk_norm_rope_cache(dev, xb.ptr, row, q_heads, q_head_stride, k_heads, nq, nq + k_heads * dim, qwb.ptr,
                           kwb.ptr, qo.ptr, q_heads * dim, rows, dim, EPS, mb.ptr, 64, fb.ptr, rot, mb.ptr.offset(8),
                           64, kc.ptr, vc.ptr, kv_dtype=kv_dtype, kv_scale=scale)
    shape = (n_slots, k_heads * dim)
    dt = "u8" if kv_dtype == "fp8" else "bf16"
    return (get(dev, qo, "bf16", (rows, max(q_heads, 1) * dim))[:, :q_heads * dim], get(dev, kc, dt, shape),
            get(dev, vc, dt, shape), get(dev, xb, "bf16", x.shape))


def run_separate(dev, x, qw, kw, pos, slots, q_heads, k_heads, dim, rot, q_head_stride, n_slots, kv_dtype, scale):
    """The launches the fused kernel replaces, as gated_attention made them (k normed in place in x)."""
    rows, row = x.shape
    inv = default_inv_freq(rot, 1e7)
    item = 1 if kv_dtype == "fp8" else 2
    xb, qwb, kwb, mb, fb = up(dev, x), up(dev, qw), up(dev, kw), up(dev, slab(pos, slots)), up(dev, inv)
    qo = out(dev, "bf16", (rows, max(q_heads, 1) * dim))
    kc, vc = out(dev, "u8", n_slots * k_heads * dim * item), out(dev, "u8", n_slots * k_heads * dim * item)
    nq, w = q_heads * q_head_stride, k_heads * dim
    if q_heads:
        ops.rms_norm_strided(dev, xb.ptr, qwb.ptr, qo.ptr, rows, q_heads, dim, row, q_head_stride, q_heads * dim, dim,
                             EPS, unit_offset=True)
        ops.rope(dev, qo.ptr, mb.ptr, 64, rows, q_heads, dim, rot, 0, q_heads * dim, dim, fb.ptr, interleaved=False)
    k = xb.ptr.offset(2 * nq)
    ops.rms_norm_strided(dev, k, kwb.ptr, k, rows, k_heads, dim, row, dim, row, dim, EPS, unit_offset=True)
    ops.rope(dev, k, mb.ptr, 64, rows, k_heads, dim, rot, 0, row, dim, fb.ptr, interleaved=False)
    for src, c in ((k, kc), (k.offset(2 * w), vc)):
        ops.reshape_and_cache(dev, src, row, mb.ptr.offset(8), 64, c.ptr, rows, w, w, 0, dtype=kv_dtype, scale=scale)
    shape = (n_slots, w)
    dt = "u8" if kv_dtype == "fp8" else "bf16"
    return (get(dev, qo, "bf16", (rows, max(q_heads, 1) * dim))[:, :q_heads * dim], get(dev, kc, dt, shape),
            get(dev, vc, dt, shape))


@pytest.mark.parametrize("kv_dtype,scale", [("bf16", 1.0), ("fp8", 0.37)])
@pytest.mark.parametrize("case", sorted(CASES))
def test_qk_norm_rope_cache_matches_reference(dev, rng, case, kv_dtype, scale):
    rows, qh, kh, dim, rot, qhs = CASES[case]
    n_slots = rows + 5
    x, qw, kw, pos, slots = inputs(rng, rows, qh, kh, dim, qhs, n_slots)
    q, kc, vc, x_after = run_fused(dev, x, qw, kw, pos, slots, qh, kh, dim, rot, qhs, n_slots, kv_dtype, scale)
    assert np.array_equal(x_after.view(np.uint16), x.view(np.uint16)), "x must only be read"
    inv = default_inv_freq(rot, 1e7)
    nq = qh * qhs
    if qh:
        xq = np.stack([x[:, h * qhs:h * qhs + dim] for h in range(qh)], 1)
        assert_close(f32(q).reshape(rows, qh, dim), heads_ref(xq, qw, pos, inv, rot), 1e-2, f"{case} q")
    k_ref = heads_ref(x[:, nq:nq + kh * dim].reshape(rows, kh, dim), kw, pos, inv, rot).reshape(rows, -1)
    v_ref = f32(x[:, nq + kh * dim:]).astype(np.float64)
    live = slots >= 0
    for got, ref, what in ((kc, k_ref, "k"), (vc, v_ref, "v")):
        cells = got[slots[live]]
        if kv_dtype == "fp8":
            want = np.clip(ref[live] / scale, -448.0, 448.0)
            assert_close(f32(cells.view(FP8)), want, 4e-2, f"{case} {what} cache")
        else:
            assert_close(f32(cells), ref[live], 1e-2, f"{case} {what} cache")
        others = np.setdiff1d(np.arange(len(got)), slots[live])
        assert np.all(got[others].view(np.uint8) == POISON), f"{case}: {what} cache rows no slot names were written"


@pytest.mark.parametrize("kv_dtype,scale", [("bf16", 1.0), ("fp8", 0.37)])
@pytest.mark.parametrize("case", ["qwen3_next", "gqa_128", "prefill"])
def test_qk_norm_rope_cache_is_the_three_kernels(dev, rng, case, kv_dtype, scale):
    """Bit for bit what rms_norm_strided, rope and reshape_and_cache give on the same device."""
    rows, qh, kh, dim, rot, qhs = CASES[case]
    n_slots = rows + 3
    args = (*inputs(rng, rows, qh, kh, dim, qhs, n_slots), qh, kh, dim, rot, qhs, n_slots, kv_dtype, scale)
    fused, separate = run_fused(dev, *args)[:3], run_separate(dev, *args)
    for a, b, what in zip(fused, separate, ("q", "k cache", "v cache")):
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), f"{case} {what} differs from the separate kernels"


@pytest.mark.parametrize("dim,rot", [(1032, 64), (260, 64), (256, 66), (256, 0), (256, 258)])
def test_qk_norm_rope_cache_refuses_bad_dims(ref, dim, rot):
    with pytest.raises(KernelError):
        ops.qk_norm_rope_cache(ref, 0x100, 3 * dim, 1, dim, 1, dim, 2 * dim, 0, 0, 0x200, dim, 1, dim, EPS, 0x300, 64,
                               0x400, rot, 0x308, 64, 0x500, 0x600)
