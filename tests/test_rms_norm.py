"""rms_norm.cu: RMSNorm (w, 1 + w, none), residual add + RMSNorm, per-head strided RMSNorm, LayerNorm with bias.

References are float64 textbook formulas (docs/model_math.md section 0, C.2), never the twins."""
import numpy as np
import pytest

from mtp_cupy import KernelError, ops
from mtp_cupy.runtime.ptr import NULL
from helpers import assert_close, bf16, f32, get, out, rand_bf16, run_on_both, up, assert_bf16_near

BF16_U = 2.0 ** -8  # bf16 unit roundoff: one rounding moves a value by at most this, relatively


def rms_ref(x, w, eps, unit_offset=False):
    x = f32(x).astype(np.float64)
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    if w is None:
        return y
    w = f32(w).astype(np.float64)
    return y * (1.0 + w if unit_offset else w)


def assert_one_rounding(got, ref):
    """Each element is ref rounded once to bf16 (plus fp32 noise): a bound per element, not just a norm."""
    got = f32(got).astype(np.float64)
    assert np.all(np.isfinite(got))
    assert np.all(np.abs(got - ref) <= (BF16_U + 1e-5) * np.abs(ref) + 1e-30)


@pytest.mark.parametrize("rows,dim", [(1, 7168), (3, 6144), (2, 2048), (5, 4096), (1, 16384), (4, 1536), (7, 8)])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_rms_norm(dev, rng, rows, dim, unit_offset):
    x, w = rand_bf16(rng, (rows, dim), 3.0), rand_bf16(rng, dim, 0.5)
    xb, wb, yb = up(dev, x), up(dev, w), out(dev, "bf16", (rows, dim))
    eps = 1e-6 if unit_offset else 1e-5
    ops.rms_norm(dev, xb.ptr, wb.ptr, yb.ptr, rows, dim, eps, unit_offset=unit_offset)
    ref = rms_ref(x, w, eps, unit_offset)
    got = get(dev, yb, "bf16", (rows, dim))
    assert_close(f32(got), ref, 1e-2)
    assert_one_rounding(got, ref)


def test_rms_norm_random_shapes_in_place_no_weight(dev, rng):
    for _ in range(3):
        rows, dim = int(rng.integers(1, 40)), 8 * int(rng.integers(1, 2048))
        x = rand_bf16(rng, (rows, dim), float(rng.uniform(0.01, 100)))
        xb = up(dev, x)
        ops.rms_norm(dev, xb.ptr, NULL, xb.ptr, rows, dim, 1e-6)  # in place, w NULL = no weight
        ref = rms_ref(x, None, 1e-6)
        got = get(dev, xb, "bf16", (rows, dim))
        assert_close(f32(got), ref, 1e-2)
        assert_one_rounding(got, ref)


def _add_norm_two_ways(dev, x, r, w, rows, dim, eps, unit_offset):
    """(x, y) after bf16_residual_add + rms_norm, then (x, y) after add_rms_norm, from the same inputs."""
    rb, wb = up(dev, r), up(dev, w) if w is not None else None
    wp = wb.ptr if wb is not None else NULL
    x1, y1 = up(dev, x), out(dev, "bf16", (rows, dim))
    ops.bf16_residual_add(dev, x1.ptr, rb.ptr, rows * dim)
    ops.rms_norm(dev, x1.ptr, wp, y1.ptr, rows, dim, eps, unit_offset=unit_offset)
    x2, y2 = up(dev, x), out(dev, "bf16", (rows, dim))
    ops.add_rms_norm(dev, x2.ptr, rb.ptr, wp, y2.ptr, rows, dim, eps, unit_offset=unit_offset)
    return [get(dev, b, "bf16", (rows, dim)) for b in (x1, y1, x2, y2)]


# the real hidden sizes (Qwen3-Next 2048, 4096, GLM-5 6144, DeepSeek-V3 7168), one row and several
@pytest.mark.parametrize("rows,dim", [(1, 2048), (4, 2048), (1, 4096), (3, 4096), (1, 6144), (5, 6144), (1, 7168),
                                      (2, 7168), (7, 8), (2, 16384)])
@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("weighted", [True, False])
def test_add_rms_norm_matches_add_then_norm(dev, rng, rows, dim, unit_offset, weighted):
    x, r = rand_bf16(rng, (rows, dim), 3.0), rand_bf16(rng, (rows, dim), 2.0)
    w = rand_bf16(rng, dim, 0.5) if weighted else None
    x1, y1, x2, y2 = _add_norm_two_ways(dev, x, r, w, rows, dim, 1e-6, unit_offset)
    assert np.array_equal(x2.view(np.uint16), x1.view(np.uint16))  # the residual stream, bit for bit
    assert np.array_equal(y2.view(np.uint16), y1.view(np.uint16))


@pytest.mark.parametrize("rows,dim", [(1, 7168), (3, 6144), (2, 2048), (5, 4096), (7, 8)])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_add_rms_norm(dev, rng, rows, dim, unit_offset):
    x, r, w = rand_bf16(rng, (rows, dim), 3.0), rand_bf16(rng, (rows, dim), 3.0), rand_bf16(rng, dim, 0.5)
    xb, rb, wb, yb = up(dev, x), up(dev, r), up(dev, w), out(dev, "bf16", (rows, dim))
    ops.add_rms_norm(dev, xb.ptr, rb.ptr, wb.ptr, yb.ptr, rows, dim, 1e-6, unit_offset=unit_offset)
    s = f32(x).astype(np.float64) + f32(r)
    got_x = get(dev, xb, "bf16", (rows, dim))
    assert_close(f32(got_x), s, 1e-2)
    assert np.array_equal(got_x.view(np.uint16), bf16(f32(x) + f32(r)).view(np.uint16))  # one rounding
    assert_close(f32(get(dev, yb, "bf16", (rows, dim))), rms_ref(s, w, 1e-6, unit_offset), 1e-2)
    assert np.array_equal(get(dev, rb, "bf16", (rows, dim)).view(np.uint16), r.view(np.uint16))  # res untouched


def test_add_rms_norm_rejects(ref):
    a, b, c = ref.alloc(4096), ref.alloc(4096), ref.alloc(4096)
    with pytest.raises(KernelError, match="x may not be y"):
        ops.add_rms_norm(ref, a.ptr, b.ptr, NULL, a.ptr, 1, 64, 1e-6)
    with pytest.raises(KernelError, match="res may not be"):
        ops.add_rms_norm(ref, a.ptr, a.ptr, NULL, c.ptr, 1, 64, 1e-6)
    with pytest.raises(KernelError, match="res may not be"):
        ops.add_rms_norm(ref, a.ptr, c.ptr, NULL, c.ptr, 1, 64, 1e-6)
    with pytest.raises(KernelError, match="res is required"):
        ops.add_rms_norm(ref, a.ptr, NULL, NULL, c.ptr, 1, 64, 1e-6)
    with pytest.raises(KernelError, match="aligned"):
        ops.add_rms_norm(ref, a.ptr, b.ptr.offset(2), NULL, c.ptr, 1, 64, 1e-6)
    with pytest.raises(KernelError, match=">"):  # 512 threads at most: dim <= 16384
        ops.add_rms_norm(ref, a.ptr, b.ptr, NULL, c.ptr, 1, 16392, 1e-6)


# (rows, heads, dim, head_stride of x): V4 q per-head scaling (no weight), Qwen q_norm over the q half of
# the interleaved [q_h | gate_h] projection (stride 512), Qwen k_norm, and a random one.
@pytest.mark.parametrize("rows,heads,dim,hs,weighted", [(2, 64, 512, 512, False), (3, 16, 256, 512, True),
                                                        (5, 2, 256, 256, True), (4, 7, 40, 48, True)])
def test_rms_norm_strided_in_place(dev, rng, rows, heads, dim, hs, weighted):
    rs = heads * hs
    x = rand_bf16(rng, (rows, rs), 2.0)
    w = rand_bf16(rng, dim, 0.3) if weighted else None
    xb = up(dev, x)
    wb = up(dev, w) if weighted else None
    ops.rms_norm_strided(dev, xb.ptr, wb.ptr if weighted else NULL, xb.ptr, rows, heads, dim, rs, hs, rs, hs, 1e-6,
                         unit_offset=weighted)
    got = get(dev, xb, "bf16", (rows, heads, hs))
    x3 = x.reshape(rows, heads, hs)
    ref = rms_ref(x3[..., :dim], w, 1e-6, unit_offset=True)
    assert_close(f32(got[..., :dim]), ref, 1e-2)
    assert_one_rounding(got[..., :dim], ref)
    assert np.array_equal(got[..., dim:].view(np.uint16), x3[..., dim:].view(np.uint16))  # gates untouched


def test_rms_norm_strided_out_of_place(dev, rng):
    rows, heads, dim = 3, 4, 128
    x = rand_bf16(rng, (rows, heads, 2 * dim))           # x heads at stride 2*dim
    w = rand_bf16(rng, dim)
    xb, wb = up(dev, x), up(dev, w)
    yb = out(dev, "bf16", (heads, rows, dim))            # y transposed: [heads, rows, dim]
    ops.rms_norm_strided(dev, xb.ptr, wb.ptr, yb.ptr, rows, heads, dim, heads * 2 * dim, 2 * dim, dim, rows * dim,
                         1e-5)
    ref = rms_ref(x[..., :dim], w, 1e-5).transpose(1, 0, 2)
    assert_close(f32(get(dev, yb, "bf16", (heads, rows, dim))), ref, 1e-2)


@pytest.mark.parametrize("rows,dim", [(1, 128), (9, 128), (2, 2048), (3, 7168)])
def test_layer_norm_bias(dev, rng, rows, dim):
    x = bf16(rng.standard_normal((rows, dim)) * 2.0 + 3.0)  # a mean well away from 0
    w, b = rand_bf16(rng, dim), rand_bf16(rng, dim)
    xb, wb, bb, yb = up(dev, x), up(dev, w), up(dev, b), out(dev, "bf16", (rows, dim))
    ops.layer_norm_bias(dev, xb.ptr, wb.ptr, bb.ptr, yb.ptr, rows, dim, 1e-6)
    x64 = f32(x).astype(np.float64)
    mu = x64.mean(-1, keepdims=True)
    ref = (x64 - mu) / np.sqrt(((x64 - mu) ** 2).mean(-1, keepdims=True) + 1e-6) * f32(w) + f32(b)
    assert_close(f32(get(dev, yb, "bf16", (rows, dim))), ref, 1e-2)


def test_rms_norm_rejects(ref):
    b = ref.alloc(4096)
    with pytest.raises(KernelError, match="multiple of 8"):
        ops.rms_norm(ref, b.ptr, NULL, b.ptr, 1, 100, 1e-6)
    with pytest.raises(KernelError, match="aligned"):
        ops.rms_norm(ref, b.ptr.offset(2), NULL, b.ptr, 1, 64, 1e-6)
    with pytest.raises(KernelError, match=">"):
        ops.rms_norm(ref, b.ptr, NULL, b.ptr, 1, 40000, 1e-6)


def _run_norms(dev, x, w, b, rows, dim):
    xb, wb, bb = up(dev, x), up(dev, w), up(dev, b)
    res = []
    for kind in ("vanilla", "unit", "none", "layer"):
        yb = out(dev, "bf16", (rows, dim))
        if kind == "layer":
            ops.layer_norm_bias(dev, xb.ptr, wb.ptr, bb.ptr, yb.ptr, rows, dim, 1e-6)
        else:
            ops.rms_norm(dev, xb.ptr, NULL if kind == "none" else wb.ptr, yb.ptr, rows, dim, 1e-6,
                         unit_offset=kind == "unit")
        res.append(get(dev, yb, "bf16", (rows, dim)))
    return res


@pytest.mark.gpu
@pytest.mark.parametrize("rows,dim", [(1, 7168), (1, 6144), (1, 2048), (1, 4096), (1, 16384), (2048, 7168),
                                      (33, 1536), (5, 512), (3, 128)])
def test_norms_cuda_matches_twin(rng, rows, dim):
    x, w, b = rand_bf16(rng, (rows, dim), 2.0), rand_bf16(rng, dim), rand_bf16(rng, dim)
    for kind, r, c in zip(("vanilla", "unit", "none", "layer"), *run_on_both(_run_norms, x, w, b, rows, dim)):
        # LayerNorm + bias: where (x - mu) r w + b nearly cancels, the fp32 rounding of the two terms
        # (~2^-24 of |b|) is many bf16 ulps of the tiny result (seen on the H200 at outputs ~1e-6)
        assert_bf16_near(c, r, atol=2.0 ** -22 * float(np.abs(f32(b)).max()) if kind == "layer" else 0.0)


def _run_strided(dev, x, w, rows, heads, dim, hs, unit_offset):
    xb = up(dev, x)
    wb = up(dev, w) if w is not None else None
    ops.rms_norm_strided(dev, xb.ptr, wb.ptr if wb else NULL, xb.ptr, rows, heads, dim, heads * hs, hs, heads * hs,
                         hs, 1e-6, unit_offset=unit_offset)
    return get(dev, xb, "bf16", x.shape)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,heads,dim,hs,weighted", [(1, 64, 512, 512, False), (32, 64, 512, 512, False),
                                                        (1, 16, 256, 512, True), (8, 2, 256, 256, True)])
def test_rms_norm_strided_cuda_matches_twin(rng, rows, heads, dim, hs, weighted):
    x = rand_bf16(rng, (rows, heads * hs), 2.0)
    w = rand_bf16(rng, dim) if weighted else None
    r, c = run_on_both(_run_strided, x, w, rows, heads, dim, hs, weighted)
    assert_bf16_near(c, r)


def _run_add_norm(dev, x, r, w, rows, dim, unit_offset):
    xb, rb, yb = up(dev, x), up(dev, r), out(dev, "bf16", (rows, dim))
    wb = up(dev, w) if w is not None else None
    ops.add_rms_norm(dev, xb.ptr, rb.ptr, wb.ptr if wb is not None else NULL, yb.ptr, rows, dim, 1e-6,
                     unit_offset=unit_offset)
    return get(dev, xb, "bf16", (rows, dim)), get(dev, yb, "bf16", (rows, dim))


@pytest.mark.gpu
@pytest.mark.parametrize("rows,dim", [(1, 7168), (1, 6144), (1, 2048), (1, 4096), (1, 16384), (2048, 7168),
                                      (33, 1536), (3, 128)])
@pytest.mark.parametrize("unit_offset,weighted", [(False, True), (True, True), (False, False)])
def test_add_rms_norm_cuda_matches_twin(rng, rows, dim, unit_offset, weighted):
    x, r = rand_bf16(rng, (rows, dim), 2.0), rand_bf16(rng, (rows, dim), 2.0)
    w = rand_bf16(rng, dim) if weighted else None
    (rx, ry), (cx, cy) = run_on_both(_run_add_norm, x, r, w, rows, dim, unit_offset)
    assert np.array_equal(cx.view(np.uint16), rx.view(np.uint16))  # the add is elementwise: bit-exact
    # y: the twin sums squares in float64, the kernel in fp32 over its block (as test_norms_cuda_matches_twin)
    assert_bf16_near(cy, ry)
