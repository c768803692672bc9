"""rope.cu and layers/rope_tables.py: interleaved / neox pairing, partial rotary at any offset, strided heads
and positions, mscale, inverse; YaRN tables against docs/model_math.md A.4's numbers.

The reference applies a float64 rotation matrix per row; its angle is the contract's fp32
`float(pos) * inv_freq` (so large positions test the kernel's sin/cos range reduction, not fp32 angles)."""
import math

import numpy as np
import pytest

import mtp_cupy

from mtp_cupy import ops
from mtp_cupy.layers.rope_tables import default_inv_freq, yarn_corr_range, yarn_inv_freq, yarn_mscale
from helpers import assert_close, f32, get, out, rand_bf16, run_on_both, up

V3_YARN = dict(rot_dim=64, base=10000.0, factor=40.0, orig_max_pos=4096, beta_fast=32, beta_slow=1)


def rotation_ref(x, pos, inv_freq, interleaved, mscale=1.0, inverse=False):
    """x [rows, heads, rot] -> the float64 rotation of each pair by theta = pos * inv_freq."""
    rows, heads, rot = x.shape
    half = rot // 2
    pairs = [(2 * i, 2 * i + 1) if interleaved else (i, i + half) for i in range(half)]
    y = np.empty(x.shape, np.float64)
    for r in range(rows):
        theta = (np.float32(pos[r]) * inv_freq).astype(np.float64) * (-1.0 if inverse else 1.0)
        m = np.zeros((rot, rot))
        for i, (a, b) in enumerate(pairs):
            c, s = mscale * math.cos(theta[i]), mscale * math.sin(theta[i])
            m[a, a], m[a, b], m[b, a], m[b, b] = c, -s, s, c
        y[r] = f32(x[r]).astype(np.float64) @ m.T
    return y


def run_rope(dev, x, pos, pos_stride, heads, head_dim, rot_dim, rot_offset, head_stride, inv_freq, interleaved,
             mscale=1.0, inverse=False):
    """x: host bf16 [rows, row_stride]; pos: host bytes holding the u32 positions at r * pos_stride."""
    rows, row_stride = x.shape
    xb, pb, fb = up(dev, x), up(dev, pos), up(dev, inv_freq)
    ops.rope(dev, xb.ptr, pb.ptr, pos_stride, rows, heads, head_dim, rot_dim, rot_offset, row_stride, head_stride,
             fb.ptr, interleaved, mscale=mscale, inverse=inverse)
    return get(dev, xb, "bf16", x.shape)


def positions(rng, rows, stride, high=8192):
    """u32 positions spread `stride` bytes apart (metadata-slab style), junk in between."""
    p = rng.integers(0, high, rows).astype(np.uint32)
    buf = rng.integers(0, 256, rows * stride, dtype=np.uint8)
    buf.reshape(rows, stride)[:, :4] = p.view(np.uint8).reshape(rows, 4)
    return p, buf


def heads_view(x, heads, head_stride, start, width):
    return np.stack([x[:, h * head_stride + start: h * head_stride + start + width] for h in range(heads)], 1)


# name: (rows, heads, head_dim, head_stride, rot_dim, rot_offset, interleaved, inv_freq, mscale)
CASES = {
    "v3_q": (3, 128, 192, 192, 64, 128, True, yarn_inv_freq(**V3_YARN), 1.0),
    "v3_kpe": (5, 1, 576, 576, 64, 512, True, yarn_inv_freq(**V3_YARN), 1.0),
    "v4_q": (2, 64, 512, 512, 64, 448, True, default_inv_freq(64, 10000.0), 1.0),
    "qwen_q": (4, 16, 256, 512, 64, 0, False, default_inv_freq(64, 1e7), 1.0),   # q half of [q_h | gate_h]
    "qwen_k": (4, 2, 256, 256, 64, 0, False, default_inv_freq(64, 1e7), 1.0),
    "dsa_indexer": (2, 64, 128, 128, 64, 0, False, yarn_inv_freq(**V3_YARN), 1.0),
    "glm_q_yarn_mscale": (2, 64, 256, 256, 64, 192, True, yarn_inv_freq(64, 8e6, 4.0, 8192, 32, 1), 1.2),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_rope_matches_rotation(dev, rng, case):
    rows, heads, head_dim, hs, rot, off, inter, inv, ms = CASES[case]
    x = rand_bf16(rng, (rows, heads * hs))
    p, pbuf = positions(rng, rows, 8 if rows % 2 else 4096)
    got = run_rope(dev, x, pbuf, pbuf.size // rows, heads, head_dim, rot, off, hs, inv, inter, mscale=ms)
    ref = rotation_ref(heads_view(x, heads, hs, off, rot), p, inv, inter, ms)
    assert_close(f32(heads_view(got, heads, hs, off, rot)), ref, 1e-2, case)
    mask = np.ones(x.shape, bool)  # everything outside the rotary dims is bit-identical
    for h in range(heads):
        mask[:, h * hs + off: h * hs + off + rot] = False
    assert np.array_equal(got.view(np.uint16)[mask], x.view(np.uint16)[mask])


def test_rope_random_shapes(dev, rng):
    for _ in range(4):
        rows, heads = int(rng.integers(1, 9)), int(rng.integers(1, 12))
        rot = 2 * int(rng.integers(1, 40))
        off = int(rng.integers(0, 50))
        head_dim = off + rot + int(rng.integers(0, 20))
        hs = head_dim + int(rng.integers(0, 9))
        inter, ms, inverse = bool(rng.integers(2)), float(rng.uniform(0.5, 2)), bool(rng.integers(2))
        inv = default_inv_freq(rot, float(rng.choice([1e4, 1e6])))
        x = rand_bf16(rng, (rows, heads * hs + int(rng.integers(0, 5))))
        p, pbuf = positions(rng, rows, 12, high=300000)   # large positions: full range reduction
        got = run_rope(dev, x, pbuf, 12, heads, head_dim, rot, off, hs, inv, inter, mscale=ms, inverse=inverse)
        ref = rotation_ref(heads_view(x, heads, hs, off, rot), p, inv, inter, ms, inverse)
        assert_close(f32(heads_view(got, heads, hs, off, rot)), ref, 1e-2)


def run_rope_out(dev, x, pos, pos_stride, heads, rot_dim, rot_offset, head_stride, out_shape, out_offset,
                 out_head_stride, inv_freq, interleaved, mscale=1.0, inverse=False):
    """Out-of-place rope of host x into a poisoned buffer of out_shape; returns (x after, out)."""
    rows, row_stride = x.shape
    xb, pb, fb, ob = up(dev, x), up(dev, pos), up(dev, inv_freq), out(dev, "bf16", out_shape)
    ops.rope(dev, xb.ptr, pb.ptr, pos_stride, rows, heads, rot_offset + rot_dim, rot_dim, rot_offset, row_stride,
             head_stride, fb.ptr, interleaved, mscale=mscale, inverse=inverse, out=ob.ptr, out_offset=out_offset,
             out_row_stride=out_shape[1], out_head_stride=out_head_stride)
    return get(dev, xb, "bf16", x.shape), get(dev, ob, "bf16", out_shape)


@pytest.mark.parametrize("interleaved", [True, False])
def test_rope_out_of_place(dev, rng, interleaved):
    """MLA's use: q_b's rope rows (offset 128 of 192-wide heads) rotated into Q's heads (offset 512 of 576):
    the rotated dims equal the in-place result bit for bit, nothing else of out is written, x is unchanged."""
    rows, heads, hs, off, rot, W, C = 3, 16, 192, 128, 64, 576, 512
    inv = yarn_inv_freq(**V3_YARN)
    x = rand_bf16(rng, (rows, heads * hs))
    _, pbuf = positions(rng, rows, 8)
    x_after, o = run_rope_out(dev, x, pbuf, 8, heads, rot, off, hs, (rows, heads * W), C, W, inv, interleaved)
    inplace = run_rope(dev, x, pbuf, 8, heads, off + rot, rot, off, hs, inv, interleaved)
    assert np.array_equal(x_after.view(np.uint16), x.view(np.uint16)), "x was written"
    assert np.array_equal(heads_view(o, heads, W, C, rot).view(np.uint16),
                          heads_view(inplace, heads, hs, off, rot).view(np.uint16))
    mask = np.ones(o.shape, bool)
    for h in range(heads):
        mask[:, h * W + C: h * W + C + rot] = False
    assert np.all(o.view(np.uint16)[mask] == 0xFFFF), "wrote outside the rotated dims"


def test_interleaved_equals_permuted_neox(dev, rng):
    """GPT-J on x == neox on x permuted to [x0, x2, .., x1, x3, ..] (HF's rope_interleave), bit for bit."""
    rows, heads, rot = 3, 8, 64
    inv = yarn_inv_freq(**V3_YARN)
    x = rand_bf16(rng, (rows, heads * rot))
    perm = np.concatenate([np.arange(0, rot, 2), np.arange(1, rot, 2)])
    xp = x.reshape(rows, heads, rot)[..., perm].reshape(rows, -1)
    p, pbuf = positions(rng, rows, 4)
    gi = run_rope(dev, x, pbuf, 4, heads, rot, rot, 0, rot, inv, True).reshape(rows, heads, rot)
    gn = run_rope(dev, xp, pbuf, 4, heads, rot, rot, 0, rot, inv, False).reshape(rows, heads, rot)
    assert np.array_equal(gi[..., perm].view(np.uint16), gn.view(np.uint16))


@pytest.mark.parametrize("interleaved", [True, False])
def test_inverse_undoes_rope(dev, rng, interleaved):
    rows, heads, head_dim, off = 4, 64, 512, 448  # V4 de-rotation of the attention output
    inv = default_inv_freq(64, 10000.0)
    x = rand_bf16(rng, (rows, heads * head_dim))
    _, pbuf = positions(rng, rows, 4, high=1 << 20)
    fwd = run_rope(dev, x, pbuf, 4, heads, head_dim, 64, off, head_dim, inv, interleaved)
    back = run_rope(dev, fwd, pbuf, 4, heads, head_dim, 64, off, head_dim, inv, interleaved, inverse=True)
    assert_close(f32(back), f32(x), 1e-2)
    assert np.all(np.abs(f32(back) - f32(x)) <= 2.0 ** -6 * (np.abs(f32(x)) + 1.0))


def test_yarn_tables_v3():
    """docs/model_math.md A.3 / A.4: low 10, high 23, mscale 1.3688879, MLA softmax scale 0.13523378."""
    assert yarn_corr_range(64, 10000.0, 4096, 32, 1) == (10, 23)
    inv = yarn_inv_freq(**V3_YARN)
    base = 10000.0 ** (-np.arange(32) * 2 / 64)
    for i in range(32):
        ramp = min(max((i - 10) / 13, 0.0), 1.0)
        assert inv[i] == np.float32(base[i] * (1 - ramp) + base[i] / 40 * ramp)
    assert inv.dtype == np.float32 and inv[0] == 1.0 and inv[10] == np.float32(base[10])
    assert inv[23] == np.float32(base[23] / 40)
    m = yarn_mscale(40.0, 1.0)
    assert abs(m - 1.3688879) < 1e-7
    assert abs(192 ** -0.5 * m * m - 0.13523378) < 1e-8
    assert yarn_mscale(1.0, 1.0) == 1.0 and yarn_mscale(40.0, 1.0) / yarn_mscale(40.0, 1.0) == 1.0


def test_yarn_equal_bounds_and_default_table():
    # 4096 / (2 pi 1000) < 1: both correction dims fall in (-1, 0], low == high == 0, the ramp steps at 0.001
    assert yarn_corr_range(16, 10000.0, 4096, 1000, 1000) == (0, 0)
    inv = yarn_inv_freq(16, 10000.0, 4.0, 4096, 1000, 1000)
    base = 10000.0 ** (-np.arange(8) * 2 / 16)
    assert inv[0] == 1.0 and np.allclose(inv[1:], base[1:] / 4, rtol=1e-7)
    d = default_inv_freq(64, 1e7)
    assert d.dtype == np.float32 and d[0] == 1.0
    assert np.allclose(d, 1e7 ** (-np.arange(32) / 32), rtol=1e-7)


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("inverse", [False, True])
def test_rope_cuda_matches_twin(rng, case, inverse):
    rows, heads, head_dim, hs, rot, off, inter, inv, ms = CASES[case]
    rows = 32
    x = rand_bf16(rng, (rows, heads * hs))
    _, pbuf = positions(rng, rows, 8, high=1 << 20)
    r, c = run_on_both(run_rope, x, pbuf, 8, heads, head_dim, rot, off, hs, inv, inter, ms, inverse)
    a, b = f32(c), f32(r)
    if case == "v3_q":  # and out of place, into Q's layout (the rotated dims only; the rest stays poisoned)
        _, oc = run_rope_out(mtp_cupy.device("cuda"), x, pbuf, 8, heads, rot, off, hs, (rows, heads * 576), 512,
                             576, inv, inter, ms, inverse)
        assert np.array_equal(heads_view(oc, heads, 576, 512, rot).view(np.uint16),
                              heads_view(c, heads, hs, off, rot).view(np.uint16))
    assert np.all(np.isfinite(a))
    # sincosf vs correctly rounded sin/cos: at most one bf16 ulp, rarely; where a*c - b*s cancels to near 0,
    # their ~1e-7 absolute difference can exceed one ulp of the tiny result (seed 1088664881 on an H200)
    d = np.abs(a - b)
    assert np.all(d <= 2.0 ** -7 * np.maximum(np.abs(a), np.abs(b)) + 4e-6 * max(1.0, ms))
    assert np.count_nonzero(d) <= max(2, a.size // 100)
