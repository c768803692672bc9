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
    return x, post, c, logits


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


def run_post(dev, f, X, post, comb, in_place, iters=0):
    """hc_post; iters > 0: comb holds Sinkhorn logits (hc_pre_norm's), finished in the kernel."""
    rows, hc, dim = X.shape
    bf, bx, bp, bc = up(dev, f), up(dev, X), up(dev, post), up(dev, comb)
    y = bx if in_place else out(dev, "bf16", (rows, hc, dim))
    ops.hc_post(dev, bf.ptr, bx.ptr, bp.ptr, bc.ptr, y.ptr, rows, dim, hc, hc_eps=HC_EPS, iters=iters)
    return f32(get(dev, y, "bf16", (rows, hc, dim)))


@pytest.mark.parametrize("rows,hc,dim", [(1, 4, 256), (3, 4, 512), (32, 4, 256), (5, 2, 1024), (2, 1, 64)])
def test_hc_pre(dev, rng, rows, hc, dim):
    X = rand_bf16(rng, (rows, hc, dim), 3.0)
    fn, scale, base = coeffs(rng, hc, dim, (2 + hc) * hc)
    x, post, comb = run_pre(dev, X, fn, scale, base)
    rx, rpost, rcomb, _ = hc_pre_f64(X, fn, scale, base)
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
    rx, rpost, rcomb, _ = hc_pre_f64(X, fn, scale, base)
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
    rx, _, rcomb, _ = hc_pre_f64(X, fn, scale, base)
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


def norm_w_f64(x, w, eps=RMS_EPS):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * f32(w).astype(np.float64)


def bits(a):
    a = np.ascontiguousarray(a)
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


def run_site(dev, case, fused):
    """One mHC site as a step runs it: the streams written (`add`: src + e, src one row a token when src_hc is 1;
    `post`: hc_post of the site before, in place), the collapse (`pre`: hc_pre; `head`: hc_head) and the RMSNorm
    after it. Fused: hc_add_mix (add) or hc_post + hc_mix (post), then hc_pre_norm / hc_head_norm; else the
    separate launches (hc_expand, hc_add / hc_post, hc_pre / hc_head, rms_norm). A collapse site then folds a
    fixed layer output back with its coefficients ("next": the next hc_post; fused, it finishes the Sinkhorn from
    hc_pre_norm's logits itself). Returns {name: host array}."""
    kind, head, rows, hc, dim = case["kind"], case["head"], case["rows"], case["hc"], case["dim"]
    mix = ops.hc_mix_width(hc, head)
    fn, scale, base = (up(dev, a) for a in case["coef"])
    w = up(dev, case["w"])
    y = out(dev, "bf16", (rows, dim))
    po, co = out(dev, "f32", (rows, hc)), out(dev, "f32", (rows, hc, hc))
    work = dev.alloc(ops.hc_work_bytes(rows, dim, hc))
    keep = []
    if kind == "add":
        src_hc = case["src_hc"]
        e = up(dev, case["e"])
        X = up(dev, case["src"]) if src_hc == hc else out(dev, "bf16", (rows, hc, dim))   # in place, or expanded
        src = X if src_hc == hc else up(dev, case["src"])
        keep += [e, src]
        if fused:
            ops.hc_add_mix(dev, src.ptr, src_hc, e.ptr, X.ptr, fn.ptr, work.ptr, rows, dim, hc, mix)
        else:
            if src_hc == 1:
                ops.hc_expand(dev, src.ptr, X.ptr, rows, dim, hc)
            ops.hc_add(dev, X.ptr, e.ptr, rows, dim, hc)
    else:
        X = up(dev, case["X_in"])
        f, pp, pc = (up(dev, a) for a in (case["f"], case["post"], case["comb"]))
        keep += [f, pp, pc]
        ops.hc_post(dev, f.ptr, X.ptr, pp.ptr, pc.ptr, X.ptr, rows, dim, hc)   # a finished comb (iters 0)
        if fused:
            ops.hc_mix(dev, X.ptr, fn.ptr, work.ptr, rows, dim, hc, mix)
    if fused and head:
        ops.hc_head_norm(dev, X.ptr, work.ptr, scale.ptr, base.ptr, w.ptr, y.ptr, rows, dim, hc, RMS_EPS, HC_EPS,
                         RMS_EPS)
    elif fused:
        ops.hc_pre_norm(dev, X.ptr, work.ptr, scale.ptr, base.ptr, w.ptr, y.ptr, po.ptr, co.ptr, rows, dim, hc,
                        RMS_EPS, HC_EPS, RMS_EPS)
    else:
        x = out(dev, "bf16", (rows, dim))
        if head:
            ops.hc_head(dev, X.ptr, fn.ptr, scale.ptr, base.ptr, x.ptr, work.ptr, rows, dim, hc, RMS_EPS, HC_EPS)
        else:
            ops.hc_pre(dev, X.ptr, fn.ptr, scale.ptr, base.ptr, x.ptr, po.ptr, co.ptr, work.ptr, rows, dim, hc,
                       RMS_EPS, HC_EPS, ITERS)
        ops.rms_norm(dev, x.ptr, w.ptr, y.ptr, rows, dim, RMS_EPS)
    res = {"X": get(dev, X, "bf16", (rows, hc, dim)), "y": get(dev, y, "bf16", (rows, dim))}
    if not head:
        res |= {"post": get(dev, po, "f32", (rows, hc)), "logits" if fused else "comb": get(dev, co, "f32", (rows, hc, hc))}
        f2, X2 = up(dev, case["f2"]), up(dev, case["X2"])
        nxt = out(dev, "bf16", (rows, hc, dim))
        ops.hc_post(dev, f2.ptr, X2.ptr, po.ptr, co.ptr, nxt.ptr, rows, dim, hc, hc_eps=HC_EPS,
                    iters=ITERS if fused else 0)
        res["next"] = get(dev, nxt, "bf16", (rows, hc, dim))
    return res


def site_case(rng, kind, head, rows, hc, dim, src_hc=None):
    mix = ops.hc_mix_width(hc, head)
    fn, scale, base = coeffs(rng, hc, dim, mix)
    c = dict(kind=kind, head=head, rows=rows, hc=hc, dim=dim, coef=(fn, scale[:1] if head else scale, base),
             w=rand_bf16(rng, dim, 0.5), f2=rand_bf16(rng, (rows, dim)), X2=rand_bf16(rng, (rows, hc, dim), 2.0))
    if kind == "add":
        c |= dict(src_hc=src_hc, src=rand_bf16(rng, (rows, src_hc, dim), 2.0), e=rand_bf16(rng, (rows, dim)))
    else:
        c |= dict(f=rand_bf16(rng, (rows, dim)), X_in=rand_bf16(rng, (rows, hc, dim), 2.0),
                  post=rng.uniform(0, 2, (rows, hc)).astype(np.float32),
                  comb=rng.uniform(0, 1, (rows, hc, hc)).astype(np.float32))
    return c


def site_streams_f64(c):
    """The streams a site's first launch writes, in float64 from the formulas (docs/model_math.md B.2)."""
    if c["kind"] == "add":
        x = f32(c["src"]).astype(np.float64) + f32(c["e"]).astype(np.float64)[:, None, :]
        return np.broadcast_to(x, (c["rows"], c["hc"], c["dim"]))   # one row a token: every stream
    return (c["post"][:, :, None] * f32(c["f"])[:, None, :].astype(np.float64)
            + np.einsum("tjk,tjd->tkd", c["comb"].astype(np.float64), f32(c["X_in"]).astype(np.float64)))


SITES = [("add", False, 4), ("add", False, 1), ("post", False, None), ("post", True, None)]


@pytest.mark.parametrize("kind,head,src_hc", SITES)
@pytest.mark.parametrize("rows,hc,dim", [(1, 4, 512), (3, 4, 256), (19, 4, 512), (2, 2, 1024), (5, 3, 64),
                                         (2, 4, 4096)])
def test_hc_fused_site(dev, rng, kind, head, src_hc, rows, hc, dim):
    """The fused launches give the bytes of the separate ones (streams, normed collapse, post, and the next hc_post:
    from hc_pre_norm's Sinkhorn logits as from hc_pre's comb), and the normed collapse, post, logits and comb match
    float64 math from the streams' formula."""
    c = site_case(rng, kind, head, rows, hc, dim, None if src_hc is None else min(src_hc, hc))  # 4: every stream
    got, want = run_site(dev, c, True), run_site(dev, c, False)
    for name in ("X", "y") + (() if head else ("post", "next")):
        assert np.array_equal(bits(got[name]), bits(want[name])), f"{name} differs from the separate launches"
    Xr = site_streams_f64(c)
    assert_close(f32(got["X"]), Xr, 8e-3, "streams")
    fn, scale, base = c["coef"]
    if head:
        pre = sigmoid(mixes_f64(got["X"], fn) * scale[0] + base) + HC_EPS
        x = np.einsum("tj,tjd->td", pre, f32(got["X"]).astype(np.float64))
    else:
        x, post, comb, logits = hc_pre_f64(got["X"], fn, scale, base)
        np.testing.assert_allclose(got["post"], post, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got["logits"], logits, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(want["comb"], comb, rtol=1e-4, atol=1e-6)
    assert_close(f32(got["y"]), norm_w_f64(x, c["w"]), 1e-2, "normed collapse")


def test_hc_fused_refuse_bad_geometry(ref):
    from mtp_cupy.errors import KernelError
    p = ref.alloc(1 << 16).ptr
    with pytest.raises(KernelError, match="src_hc 2"):
        ops.hc_add_mix(ref, p, 2, p, p, p, p, 1, 64, 4, 24)
    with pytest.raises(KernelError, match="mix 7"):
        ops.hc_add_mix(ref, p, 4, p, p, p, p, 1, 64, 4, 7)
    with pytest.raises(KernelError, match="norm weight"):
        ops.hc_pre_norm(ref, p, p, p, p, 0, p, p, p, 1, 64, 4, 1e-6, 1e-6, 1e-6)
    with pytest.raises(KernelError, match="-1 Sinkhorn"):
        ops.hc_post(ref, p, p, p, p, p, 1, 64, 4, iters=-1)
    with pytest.raises(KernelError, match="dim 36"):
        ops.hc_head_norm(ref, p, p, p, p, p, p, 1, 36, 4, 1e-6, 1e-6, 1e-6)


@pytest.mark.parametrize("src_hc", [4, 1])
def test_mhc_layer_routes_agree(dev, rng, src_hc):
    """layers/mhc.py: add_pre takes hc_add_mix up to ADD_MIX_ROWS rows and the separate launches past it; a row's
    streams, normed collapse, post and comb are the same bits either way, and post_pre / post_head of 40 rows give
    each row what it gets alone."""
    from mtp_cupy.layers.mhc import ADD_MIX_ROWS, Mhc
    from mtp_cupy.weights.deepseek_v4 import HcParams
    hc, dim, rows = 4, 64, ADD_MIX_ROWS + 8
    keep, sites = [], {}
    for s, mix in (("attn", 24), ("ffn", 24), ("head", hc)):
        fn, scale, base = coeffs(rng, hc, dim, mix)
        bufs = [up(dev, a) for a in (fn, base, scale[:1] if s == "head" else scale)]
        keep += bufs
        sites[s] = HcParams(*(b.ptr for b in bufs))
    head = sites.pop("head")
    src = rand_bf16(rng, (rows, src_hc, dim), 2.0)
    e, f1, f2 = (rand_bf16(rng, (rows, dim)) for _ in range(3))
    w = up(dev, rand_bf16(rng, dim, 0.5))

    def run(r0, n):
        m = Mhc(dev, hc, dim, sites, head, RMS_EPS, HC_EPS, ITERS, max_rows=rows)
        X = out(dev, "bf16", (n, hc, dim)) if src_hc == 1 else up(dev, src[r0:r0 + n])
        s = X if src_hc == hc else up(dev, src[r0:r0 + n])
        be, b1, b2 = (up(dev, a[r0:r0 + n]) for a in (e, f1, f2))
        ys = [out(dev, "bf16", (n, dim)) for _ in range(3)]
        m.add_pre("attn", s.ptr, src_hc, be.ptr, X.ptr, w.ptr, ys[0].ptr, n)
        X1 = get(dev, X, "bf16", (n, hc, dim))
        m.post_pre("attn", b1.ptr, X.ptr, "ffn", w.ptr, ys[1].ptr, n)
        m.post_head("ffn", b2.ptr, X.ptr, w.ptr, ys[2].ptr, n)
        return [X1, get(dev, X, "bf16", (n, hc, dim))] + [get(dev, y, "bf16", (n, dim)) for y in ys]

    whole = run(0, rows)
    assert_close(f32(whole[0]), np.broadcast_to(f32(src) + f32(e)[:, None], (rows, hc, dim)), 8e-3, "streams")
    for r in (0, ADD_MIX_ROWS - 1, ADD_MIX_ROWS, rows - 1):
        for name, a, b in zip(("X after add", "X after the block", "attn xn", "ffn xn", "head xn"), whole, run(r, 1)):
            assert np.array_equal(bits(a[r:r + 1]), bits(b)), f"row {r}: {name} differs from the row alone"


def test_mhc_layer_refuses_before_launching(ref):
    """A bad stream count or too many rows: ConfigError, and nothing launched (no stream or coefficient changed)."""
    from mtp_cupy.errors import ConfigError
    from mtp_cupy.layers.mhc import Mhc
    from mtp_cupy.weights.deepseek_v4 import HcParams
    p = ref.alloc(1 << 16).ptr
    m = Mhc(ref, 4, 64, {"attn": HcParams(p, p, p)}, None, RMS_EPS, HC_EPS, ITERS, max_rows=4)
    before = ref.launches
    with pytest.raises(ConfigError, match="src_hc 2"):
        m.add_pre("attn", p, 2, p, p, p, p, 1)
    with pytest.raises(ConfigError, match="sized for 4 rows, got 5"):
        m.add_pre("attn", p, 4, p, p, p, p, 5)
    assert ref.launches == before


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


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8, 64])
def test_hc_fused_cuda_vs_twin_real_dims(rng, rows):
    """V4-Flash dims (hc 4 x 4096), every site as a step runs it: CUDA against the twin, outputs poisoned first."""
    import mtp_cupy
    refd, cud = mtp_cupy.device("ref"), mtp_cupy.device("cuda")
    for kind, head, src_hc in SITES:
        c = site_case(rng, kind, head, rows, 4, 4096, src_hc)
        a, b = run_site(refd, c, True), run_site(cud, c, True)
        if kind == "add":   # adds only: the twin rounds alike (hc_post's products may contract into FMAs)
            assert np.array_equal(bits(b["X"]), bits(a["X"])), "streams differ from the twin"
        assert_close(f32(b["X"]), f32(a["X"]), 4e-3, f"{kind} streams")
        assert_close(f32(b["y"]), f32(a["y"]), 4e-3, f"{kind} head={head} y")
        if not head:   # after hc_post the two devices' streams differ by a bf16 ulp here and there
            np.testing.assert_allclose(b["post"], a["post"], rtol=1e-4 if kind == "add" else 1e-3, atol=1e-6)
            # logits are sums of +-terms that can cancel to ~0: their error is on the scale of the largest one
            np.testing.assert_allclose(b["logits"], a["logits"], rtol=1e-3, atol=1e-4 * np.abs(a["logits"]).max())
            assert_close(f32(b["next"]), f32(a["next"]), 4e-3, f"{kind} next hc_post")
