"""norm_rope.cu: a projection's heads normed, RoPE'd and stored in one launch. qk_norm_rope_cache (Qwen3-Next: q / k
norms, RoPE on both, the K / V cache writes) and norm_rope (MLA's latent row, V4's kv row and q heads). Against
float64 references (norm, rotation, the cache's e4m3 / blocked fp8 encodings), and bit-identical to the kernels
they replace (rms_norm_strided, rope, reshape_and_cache[_fp8_blocks]) on the same device. Outputs are poisoned: a
skipped cell, a row whose slot is negative or a cache row no slot names keeps its poison."""

import ml_dtypes
import numpy as np
import pytest

from mtp_cupy import KernelError, ops
from mtp_cupy.layers.rope_tables import default_inv_freq, yarn_inv_freq
from mtp_cupy.refdev.twins.kv_cache import decode_fp8_blocks
from helpers import POISON, assert_close, bf16, f32, get, out, rand_bf16, up

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
EPS = 1e-6


def heads_ref(x, w, pos, inv_freq, rot, norm_dim=None, unit_offset=True, rot_offset=0, interleaved=False, mscale=1.0,
              bias=None):
    """x [rows, heads, width] bf16 -> float64: g * x / rms(x) over [0, norm_dim) (g = 1 + w, w, or 1 when w is None;
    with `bias`, the LayerNorm (x - mean) / std * w + bias instead; the rest as it is), then RoPE over [rot_offset,
    rot_offset + rot) at pos (neox or interleaved pairs)."""
    y = f32(x).astype(np.float64)
    nd = y.shape[-1] if norm_dim is None else norm_dim
    v = y[..., :nd]
    g = 1.0 if w is None else (1.0 if unit_offset else 0.0) + f32(w).astype(np.float64)
    if bias is None:
        y[..., :nd] = v / np.sqrt(np.mean(v * v, -1, keepdims=True) + EPS) * g
    else:
        c = v - v.mean(-1, keepdims=True)
        y[..., :nd] = c / np.sqrt(np.mean(c * c, -1, keepdims=True) + EPS) * g + f32(bias).astype(np.float64)
    half = rot // 2
    theta = (pos.astype(np.float32)[:, None] * inv_freq[None, :]).astype(np.float64)[:, None, :]   # the fp32 angle
    c, s = mscale * np.cos(theta), mscale * np.sin(theta)
    idx = np.arange(half)
    ia, ib = (rot_offset + 2 * idx, rot_offset + 2 * idx + 1) if interleaved else (rot_offset + idx, rot_offset + half + idx)
    a, b = y[..., ia].copy(), y[..., ib].copy()
    y[..., ia], y[..., ib] = a * c - b * s, b * c + a * s
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


def run_qk(dev, x, qw, kw, pos, slots, q_heads, k_heads, dim, rot, q_head_stride, n_slots, kv_dtype, scale, fused):
    """qk_norm_rope_cache, or (fused=False) the launches it replaces as gated_attention made them (k normed in
    place in x). Returns (q, k cache, v cache, x after)."""
    rows, row = x.shape
    item = 1 if kv_dtype == "fp8" else 2
    xb, qwb, kwb, mb = up(dev, x), up(dev, qw), up(dev, kw), up(dev, slab(pos, slots))
    fb = up(dev, default_inv_freq(rot, 1e7))
    qo = out(dev, "bf16", (rows, max(q_heads, 1) * dim))
    kc, vc = out(dev, "u8", n_slots * k_heads * dim * item), out(dev, "u8", n_slots * k_heads * dim * item)
    nq, w = q_heads * q_head_stride, k_heads * dim
    if fused:
        ops.qk_norm_rope_cache(dev, xb.ptr, row, q_heads, q_head_stride, k_heads, nq, nq + w, qwb.ptr, kwb.ptr, qo.ptr,
                               q_heads * dim, rows, dim, EPS, mb.ptr, 64, fb.ptr, rot, mb.ptr.offset(8), 64, kc.ptr,
                               vc.ptr, kv_dtype=kv_dtype, kv_scale=scale)
    else:
        if q_heads:
            ops.rms_norm_strided(dev, xb.ptr, qwb.ptr, qo.ptr, rows, q_heads, dim, row, q_head_stride, q_heads * dim,
                                 dim, EPS, unit_offset=True)
            ops.rope(dev, qo.ptr, mb.ptr, 64, rows, q_heads, dim, rot, 0, q_heads * dim, dim, fb.ptr,
                     interleaved=False)
        k = xb.ptr.offset(2 * nq)
        ops.rms_norm_strided(dev, k, kwb.ptr, k, rows, k_heads, dim, row, dim, row, dim, EPS, unit_offset=True)
        ops.rope(dev, k, mb.ptr, 64, rows, k_heads, dim, rot, 0, row, dim, fb.ptr, interleaved=False)
        for src, c in ((k, kc), (k.offset(2 * w), vc)):
            ops.reshape_and_cache(dev, src, row, mb.ptr.offset(8), 64, c.ptr, rows, w, w, 0, dtype=kv_dtype,
                                  scale=scale)
    shape, dt = (n_slots, w), "u8" if kv_dtype == "fp8" else "bf16"
    return (get(dev, qo, "bf16", (rows, max(q_heads, 1) * dim))[:, :q_heads * dim], get(dev, kc, dt, shape),
            get(dev, vc, dt, shape), get(dev, xb, "bf16", x.shape))


@pytest.mark.parametrize("kv_dtype,scale", [("bf16", 1.0), ("fp8", 0.37)])
@pytest.mark.parametrize("case", sorted(CASES))
def test_qk_norm_rope_cache_matches_reference(dev, rng, case, kv_dtype, scale):
    rows, qh, kh, dim, rot, qhs = CASES[case]
    n_slots = rows + 5
    x, qw, kw, pos, slots = inputs(rng, rows, qh, kh, dim, qhs, n_slots)
    q, kc, vc, x_after = run_qk(dev, x, qw, kw, pos, slots, qh, kh, dim, rot, qhs, n_slots, kv_dtype, scale, True)
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
    fused, separate = run_qk(dev, *args, True)[:3], run_qk(dev, *args, False)[:3]
    for a, b, what in zip(fused, separate, ("q", "k cache", "v cache")):
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), f"{case} {what} differs from the separate kernels"


@pytest.mark.parametrize("dim,rot", [(1032, 64), (260, 64), (256, 66), (256, 0), (256, 258)])
def test_qk_norm_rope_cache_refuses_bad_dims(ref, dim, rot):
    with pytest.raises(KernelError):
        ops.qk_norm_rope_cache(ref, 0x100, 3 * dim, 1, dim, 1, dim, 2 * dim, 0, 0, 0x200, dim, 1, dim, EPS, 0x300, 64,
                               0x400, rot, 0x308, 64, 0x500, 0x600)


# -- norm_rope: DeepSeek / GLM ----------------------------------------------------------------------------------
V3_INV = yarn_inv_freq(64, 10000.0, 40.0, 4096, 32, 1)
# name: (rows, heads, norm_dim, width, rot_offset, rot, interleaved, mscale, w, target): target "cache" (bf16 rows),
# "fp8" (blocked fp8 rows, nope = width - rot), "out" (a q buffer, in place)
NR_CASES = {"mla_latent": (3, 1, 512, 576, 512, 64, True, 1.0, True, "cache"),
            "mla_latent_mscale_b64": (64, 1, 512, 576, 512, 64, True, 1.3, True, "cache"),
            "v4_kv_fp8": (5, 1, 512, 512, 448, 64, True, 1.0, True, "fp8"),
            "v4_kv_bf16": (2, 1, 512, 512, 448, 64, True, 1.0, True, "cache"),
            "v4_q": (3, 64, 512, 512, 448, 64, True, 1.0, False, "out"),
            "neox_weighted_q": (2, 8, 128, 128, 0, 32, False, 1.0, True, "out")}


def nr_inputs(rng, case, n_slots):
    """x, the norm weight (None: unweighted), positions and slots (a quarter of them negative) of a case."""
    rows, heads, nd, width, *_, weighted, _ = NR_CASES[case]
    x = rand_bf16(rng, (rows, heads * width), 3.0)
    w = bf16(1.0 + 0.5 * rng.standard_normal(nd)) if weighted else None
    pos = rng.integers(0, 40000, rows).astype(np.uint32)
    slots = rng.choice(n_slots, rows, replace=False).astype(np.int64)
    slots[rng.random(rows) < 0.25] = -1
    return x, w, pos, slots


def nr_run(dev, case, x, w, pos, slots, n_slots, fused):
    """The fused launch or the launches it replaces, as the layers made them; returns (out or cache bytes, x)."""
    rows, heads, nd, width, off, rot, inter, ms, _, target = NR_CASES[case]
    inv = V3_INV if ms != 1.0 else default_inv_freq(rot, 10000.0)
    row = heads * width
    xb, mb, fb = up(dev, x), up(dev, slab(pos, slots)), up(dev, inv)
    wb = up(dev, w) if w is not None else None
    wp = wb.ptr if wb is not None else 0
    fp8 = width - rot if target == "fp8" else 0
    row_bytes = ops.fp8_block_layout(width, fp8)[2] if fp8 else 2 * width
    cb = out(dev, "u8", n_slots * row_bytes) if target != "out" else None
    slots_p = mb.ptr.offset(8) if target != "out" else 0
    if fused:
        ops.norm_rope(dev, xb.ptr, row, width, rows, heads, wp, nd, width, EPS, mb.ptr, 64, fb.ptr, off, rot, inter,
                      ms, out=xb.ptr if target == "out" else 0, out_row_stride=row if target == "out" else 0,
                      out_head_stride=width if target == "out" else 0, slots=slots_p, slot_stride=64,
                      cache=cb.ptr if cb is not None else 0, fp8_nope=fp8)
    else:
        ops.rms_norm_strided(dev, xb.ptr, wp, xb.ptr, rows, heads, nd, row, width, row, width, EPS)
        ops.rope(dev, xb.ptr, mb.ptr, 64, rows, heads, width, rot, off, row, width, fb.ptr, inter, mscale=ms)
        if fp8:
            ops.reshape_and_cache_fp8_blocks(dev, xb.ptr, row, slots_p, 64, cb.ptr, rows, width, fp8)
        elif cb is not None:
            ops.reshape_and_cache(dev, xb.ptr, row, slots_p, 64, cb.ptr, rows, width, width, 0)
    got_x = get(dev, xb, "bf16", x.shape)
    return (got_x if cb is None else get(dev, cb, "u8", (n_slots, row_bytes))), got_x


@pytest.mark.parametrize("case", sorted(NR_CASES))
def test_norm_rope_matches_reference(dev, rng, case):
    rows, heads, nd, width, off, rot, inter, ms, weighted, target = NR_CASES[case]
    n_slots = rows + 4
    x, w, pos, slots = nr_inputs(rng, case, n_slots)
    got, x_after = nr_run(dev, case, x, w, pos, slots, n_slots, fused=True)
    inv = V3_INV if ms != 1.0 else default_inv_freq(rot, 10000.0)
    ref = heads_ref(x.reshape(rows, heads, width), w, pos, inv, rot, nd, False, off, inter, ms)
    if target == "out":
        assert_close(f32(got).reshape(rows, heads, width), ref, 1e-2, case)
        return
    assert np.array_equal(x_after.view(np.uint16), x.view(np.uint16)), "x must only be read for a cache store"
    live = slots >= 0
    cells = got[slots[live]]
    if target == "fp8":
        assert_close(decode_fp8_blocks(cells, width, width - rot), ref[live, 0], 4e-2, f"{case} cache")
    else:
        assert_close(f32(cells.view(ml_dtypes.bfloat16)), ref[live, 0], 1e-2, f"{case} cache")
    others = np.setdiff1d(np.arange(n_slots), slots[live])
    assert np.all(got[others] == POISON), f"{case}: cache rows no slot names were written"


@pytest.mark.parametrize("case", sorted(NR_CASES))
def test_norm_rope_is_the_three_kernels(dev, rng, case):
    """Bit for bit what rms_norm_strided, rope and reshape_and_cache[_fp8_blocks] give on the same device."""
    n_slots = NR_CASES[case][0] + 2
    x, w, pos, slots = nr_inputs(rng, case, n_slots)
    fused = nr_run(dev, case, x, w, pos, slots, n_slots, fused=True)[0]
    separate = nr_run(dev, case, x, w, pos, slots, n_slots, fused=False)[0]
    assert np.array_equal(fused.view(np.uint8), separate.view(np.uint8)), f"{case} differs from the separate kernels"


# GLM-5's DSA indexer key: LayerNorm (w, b) over the 128-dim head, RoPE on its first 64 dims, the indexer cache row
# (bf16). name: (rows, head_dim, rot, interleaved, mscale)
LN_CASES = {"dsa_k": (3, 128, 64, False, 1.0), "dsa_k_interleaved_yarn_b64": (64, 128, 64, True, 1.3)}


def ln_run(dev, case, x, w, b, pos, slots, n_slots, fused):
    """norm_rope with a bias (norm_rope_w_bias) or the launches it replaces; returns (cache bytes, x)."""
    rows, hd, rot, inter, ms = LN_CASES[case]
    inv = V3_INV if ms != 1.0 else default_inv_freq(rot, 10000.0)
    xb, mb, fb, wb, bb = up(dev, x), up(dev, slab(pos, slots)), up(dev, inv), up(dev, w), up(dev, b)
    cb = out(dev, "u8", n_slots * 2 * hd)
    if fused:
        ops.norm_rope(dev, xb.ptr, hd, hd, rows, 1, wb.ptr, hd, hd, EPS, mb.ptr, 64, fb.ptr, 0, rot, inter, ms,
                      slots=mb.ptr.offset(8), slot_stride=64, cache=cb.ptr, bias=bb.ptr)
    else:
        ops.layer_norm_bias(dev, xb.ptr, wb.ptr, bb.ptr, xb.ptr, rows, hd, EPS)
        ops.rope(dev, xb.ptr, mb.ptr, 64, rows, 1, hd, rot, 0, hd, hd, fb.ptr, inter, mscale=ms)
        ops.reshape_and_cache(dev, xb.ptr, hd, mb.ptr.offset(8), 64, cb.ptr, rows, hd, hd, 0)
    return get(dev, cb, "u8", (n_slots, 2 * hd)), get(dev, xb, "bf16", x.shape)


@pytest.mark.parametrize("case", sorted(LN_CASES))
def test_norm_rope_layernorm(dev, rng, case):
    """The LayerNorm form against float64 LayerNorm + RoPE, x left unread, cache rows no slot names left poisoned,
    and bit for bit what layer_norm_bias, rope and reshape_and_cache give on the same device."""
    rows, hd, rot, inter, ms = LN_CASES[case]
    n_slots = rows + 4
    x = rand_bf16(rng, (rows, hd), 3.0) + bf16(rng.standard_normal((rows, 1)))   # rows off zero mean
    w, b = bf16(1.0 + 0.5 * rng.standard_normal(hd)), bf16(0.3 * rng.standard_normal(hd))
    pos = rng.integers(0, 40000, rows).astype(np.uint32)
    slots = rng.choice(n_slots, rows, replace=False).astype(np.int64)
    slots[rng.random(rows) < 0.25] = -1
    got, x_after = ln_run(dev, case, x, w, b, pos, slots, n_slots, fused=True)
    inv = V3_INV if ms != 1.0 else default_inv_freq(rot, 10000.0)
    ref = heads_ref(x.reshape(rows, 1, hd), w, pos, inv, rot, None, False, 0, inter, ms, bias=b)
    assert np.array_equal(x_after.view(np.uint16), x.view(np.uint16)), "x must only be read"
    live = slots >= 0
    assert_close(f32(got[slots[live]].view(ml_dtypes.bfloat16)), ref[live, 0], 1e-2, case)
    others = np.setdiff1d(np.arange(n_slots), slots[live])
    assert np.all(got[others] == POISON), f"{case}: cache rows no slot names were written"
    separate = ln_run(dev, case, x, w, b, pos, slots, n_slots, fused=False)[0]
    assert np.array_equal(got, separate), f"{case} differs from layer_norm_bias + rope + reshape_and_cache"


def test_norm_rope_layernorm_needs_its_weight(ref):
    with pytest.raises(KernelError, match="LayerNorm needs its weight"):
        ops.norm_rope(ref, 0x100, 128, 128, 1, 1, 0, 128, 128, EPS, 0x300, 64, 0x400, 0, 64, False, slots=0x500,
                      slot_stride=64, cache=0x600, bias=0x700)


@pytest.mark.parametrize("kw", [dict(norm_dim=1032, width=1032), dict(norm_dim=512, width=520 + 512),
                                dict(norm_dim=520, width=512), dict(rot_offset=480), dict(slots=0x700),
                                dict(out=0)])
def test_norm_rope_refuses_bad_geometry(ref, kw):
    a = dict(norm_dim=512, width=576, rot_offset=512, out=0x200, slots=0)
    a.update(kw)
    with pytest.raises(KernelError):
        ops.norm_rope(ref, 0x100, 576, 576, 1, 1, 0, a["norm_dim"], a["width"], EPS, 0x300, 64, 0x400, a["rot_offset"],
                      64, True, out=a["out"], out_row_stride=576, out_head_stride=576, slots=a["slots"], slot_stride=64,
                      cache=0)
