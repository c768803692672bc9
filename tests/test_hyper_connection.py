"""mHC kernels (cuda_src/hyper_connection.cu) against float64 math written from docs/model_math.md B.2."""
import numpy as np
import pytest

from mtp_cupy import ops
from helpers import assert_close, f32, get, out, rand_bf16, up

RMS_EPS, HC_EPS, ITERS = 1e-6, 1e-6, 20


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def mixes_f64(X, fn):
    t, hc, d = X.shape
    xf = f32(X).reshape(t, hc * d).astype(np.float64)
    r = 1.0 / np.sqrt(np.mean(xf ** 2, axis=1) + RMS_EPS)
    return (xf @ fn.astype(np.float64).T) * r[:, None]


def hc_pre_f64(X, fn, scale, base):
    hc = X.shape[1]
    m = mixes_f64(X, fn)
    pre = sigmoid(m[:, :hc] * scale[0] + base[:hc]) + HC_EPS
    post = 2.0 * sigmoid(m[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
    logits = (m[:, 2 * hc:] * scale[2] + base[2 * hc:]).reshape(-1, hc, hc)
    e = np.exp(logits - logits.max(-1, keepdims=True))
    c = e / e.sum(-1, keepdims=True) + HC_EPS
    c = c / (c.sum(-2, keepdims=True) + HC_EPS)
    for _ in range(ITERS - 1):
        c = c / (c.sum(-1, keepdims=True) + HC_EPS)
        c = c / (c.sum(-2, keepdims=True) + HC_EPS)
    x = np.einsum("tj,tjd->td", pre, f32(X).astype(np.float64))
    return x, post, c


def coeffs(rng, hc, dim, mix, spread=2.0):
    fn = (rng.standard_normal((mix, hc * dim)) * spread / np.sqrt(hc * dim)).astype(np.float32)
    scale = rng.uniform(0.5, 2.0, 3).astype(np.float32)
    base = rng.standard_normal(mix).astype(np.float32)
    return fn, scale, base


def run_pre(dev, X, fn, scale, base):
    rows, hc, dim = X.shape
    bx, bfn, bs, bb = up(dev, X), up(dev, fn), up(dev, scale), up(dev, base)
    xo, po, co = out(dev, "bf16", (rows, dim)), out(dev, "f32", (rows, hc)), out(dev, "f32", (rows, hc, hc))
    work = dev.alloc(ops.hc_work_bytes(rows, dim, hc))
    ops.hc_pre(dev, bx.ptr, bfn.ptr, bs.ptr, bb.ptr, xo.ptr, po.ptr, co.ptr, work.ptr, rows, dim, hc,
               RMS_EPS, HC_EPS, ITERS)
    return f32(get(dev, xo, "bf16", (rows, dim))), get(dev, po, "f32", (rows, hc)), get(dev, co, "f32", (rows, hc, hc))


def run_head(dev, X, fn, scale, base):
    rows, hc, dim = X.shape
    bx, bfn, bs, bb = up(dev, X), up(dev, fn), up(dev, scale), up(dev, base)
    y = out(dev, "bf16", (rows, dim))
    work = dev.alloc(ops.hc_work_bytes(rows, dim, hc))
    ops.hc_head(dev, bx.ptr, bfn.ptr, bs.ptr, bb.ptr, y.ptr, work.ptr, rows, dim, hc, RMS_EPS, HC_EPS)
    return f32(get(dev, y, "bf16", (rows, dim)))


def run_post(dev, f, X, post, comb, in_place):
    rows, hc, dim = X.shape
    bf, bx, bp, bc = up(dev, f), up(dev, X), up(dev, post), up(dev, comb)
    y = bx if in_place else out(dev, "bf16", (rows, hc, dim))
    ops.hc_post(dev, bf.ptr, bx.ptr, bp.ptr, bc.ptr, y.ptr, rows, dim, hc)
    return f32(get(dev, y, "bf16", (rows, hc, dim)))


@pytest.mark.parametrize("rows,hc,dim", [(1, 4, 256), (3, 4, 512), (32, 4, 256), (5, 2, 1024), (2, 1, 64)])
def test_hc_pre(dev, rng, rows, hc, dim):
    X = rand_bf16(rng, (rows, hc, dim), 3.0)
    fn, scale, base = coeffs(rng, hc, dim, (2 + hc) * hc)
    x, post, comb = run_pre(dev, X, fn, scale, base)
    rx, rpost, rcomb = hc_pre_f64(X, fn, scale, base)
    assert_close(x, rx, 8e-3, "x")
    np.testing.assert_allclose(post, rpost, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(comb, rcomb, rtol=1e-4, atol=1e-6)
    # Sinkhorn ends on a column normalisation: columns sum to 1 (up to eps); rows only approach 1 (20 rounds
    # of a linearly converging iteration), as the float64 reference's rows do.
    np.testing.assert_allclose(comb.sum(-2), 1.0, atol=1e-5)
    np.testing.assert_allclose(comb.sum(-1), rcomb.sum(-1), atol=1e-4)
    assert np.all(np.abs(comb.sum(-1) - 1.0) < 0.1)
    assert np.all(comb > 0) and np.all((post > 0) & (post < 2))


def test_hc_pre_sharp_logits(dev, rng):
    """Large coefficient logits: the max-subtracted softmax stays finite and Sinkhorn still normalises."""
    X = rand_bf16(rng, (4, 4, 256), 1.0)
    fn, scale, base = coeffs(rng, 4, 256, 24, spread=40.0)
    x, post, comb = run_pre(dev, X, fn, scale, base)
    rx, rpost, rcomb = hc_pre_f64(X, fn, scale, base)
    assert np.all(np.isfinite(comb))
    np.testing.assert_allclose(comb, rcomb, rtol=1e-3, atol=1e-5)
    np.testing.assert_allclose(comb.sum(-2), 1.0, atol=1e-5)
    assert_close(x, rx, 8e-3, "x")


@pytest.mark.parametrize("rpb", [1, 3, 8])
def test_hc_pre_rows_alone(dev, rng, monkeypatch, rpb):
    """A row's coefficients and collapse are the same bits alone as among 18 others whatever rows an hc_mix block
    takes (groups share fn's reads; 19 leaves a partial group), and match the float64 reference."""
    monkeypatch.setattr(ops.hyper_connection, "mix_rows", lambda rows: rpb)
    X = rand_bf16(rng, (19, 4, 512), 3.0)
    fn, scale, base = coeffs(rng, 4, 512, 24)
    x, post, comb = run_pre(dev, X, fn, scale, base)
    rx, _, rcomb = hc_pre_f64(X, fn, scale, base)
    assert_close(x, rx, 8e-3, "x")
    np.testing.assert_allclose(comb, rcomb, rtol=1e-4, atol=1e-6)
    for r in (0, 2, 3, 7, 8, 16, 18):
        xr, pr, cr = run_pre(dev, X[r:r + 1], fn, scale, base)
        for name, a, b in (("x", xr[0], x[r]), ("post", pr[0], post[r]), ("comb", cr[0], comb[r])):
            assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), f"row {r}: {name} differs alone"


@pytest.mark.parametrize("rows,hc,dim", [(1, 4, 256), (7, 4, 512), (32, 3, 256)])
def test_hc_head(dev, rng, rows, hc, dim):
    X = rand_bf16(rng, (rows, hc, dim), 2.0)
    fn, scale, base = coeffs(rng, hc, dim, hc)
    scale = scale[:1]
    y = run_head(dev, X, fn, scale, base)
    pre = sigmoid(mixes_f64(X, fn) * scale[0] + base) + HC_EPS
    assert_close(y, np.einsum("tj,tjd->td", pre, f32(X).astype(np.float64)), 8e-3, "y")


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("rows,hc,dim", [(1, 4, 256), (9, 4, 1000), (2, 2, 64)])
def test_hc_post(dev, rng, rows, hc, dim, in_place):
    X, f = rand_bf16(rng, (rows, hc, dim)), rand_bf16(rng, (rows, dim))
    post = rng.uniform(0, 2, (rows, hc)).astype(np.float32)
    comb = rng.uniform(0, 1, (rows, hc, hc)).astype(np.float32)
    y = run_post(dev, f, X, post, comb, in_place)
    ref = post[:, :, None] * f32(f)[:, None, :] + np.einsum("tjk,tjd->tkd", comb, f32(X))
    assert_close(y, ref.astype(np.float64), 8e-3, "Y")


def test_hc_expand_and_add(dev, rng):
    rows, hc, dim = 3, 4, 256
    x, e = rand_bf16(rng, (rows, dim)), rand_bf16(rng, (rows, dim))
    bx, be, streams = up(dev, x), up(dev, e), out(dev, "bf16", (rows, hc, dim))
    ops.hc_expand(dev, bx.ptr, streams.ptr, rows, dim, hc)
    assert np.array_equal(f32(get(dev, streams, "bf16", (rows, hc, dim))), np.repeat(f32(x)[:, None], hc, 1))
    ops.hc_add(dev, streams.ptr, be.ptr, rows, dim, hc)
    want = np.repeat((f32(x) + f32(e)).astype(x.dtype)[:, None], hc, 1)  # one rounding of the fp32 sum
    assert np.array_equal(get(dev, streams, "bf16", (rows, hc, dim)), want)


def test_hc_launcher_refuses_too_many_streams(ref):
    from mtp_cupy.errors import KernelError
    with pytest.raises(KernelError, match="hc 5"):
        ops.hc_expand(ref, 0, 0, 1, 64, 5)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 32])
def test_hc_cuda_vs_twin_real_dims(rng, rows):
    """V4-Flash dims (hc 4 x 4096): CUDA against the twin, every output, poisoned first."""
    import mtp_cupy
    refd, cud = mtp_cupy.device("ref"), mtp_cupy.device("cuda")
    hc, dim = 4, 4096
    X = rand_bf16(rng, (rows, hc, dim), 2.0)
    fn, scale, base = coeffs(rng, hc, dim, 24)
    (x0, p0, c0), (x1, p1, c1) = run_pre(refd, X, fn, scale, base), run_pre(cud, X, fn, scale, base)
    assert_close(x1, x0, 4e-3, "hc_pre x")
    np.testing.assert_allclose(p1, p0, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(c1, c0, rtol=1e-3, atol=1e-6)
    hfn, hs, hb = coeffs(rng, hc, dim, hc)
    assert_close(run_head(cud, X, hfn, hs[:1], hb), run_head(refd, X, hfn, hs[:1], hb), 4e-3, "hc_head")
    f = rand_bf16(rng, (rows, dim))
    for in_place in (False, True):
        assert_close(run_post(cud, f, X, p0, c0, in_place), run_post(refd, f, X, p0, c0, in_place), 4e-3, "hc_post")
