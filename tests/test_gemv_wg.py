"""The wgmma fp8 block GEMVs (cuda_src/gemv_wg.cu: w8a16_gemv_wg, w8a16_gemv_e8m0_wg) and linear's route to them.

Reference: float64 x @ W.T of the dequantised weight (test_gemv.make_weight). The kernels' contract beyond that:
every row is bit-identical to the same row computed alone by the format's 8-row kernel under the split (ks, kb)
they were given, whatever the row count, the pass width nx and the ring depth. Outputs are poisoned before each
launch (helpers.out); x rows are normal values, whose f32 sums change with their order."""
from __future__ import annotations

import numpy as np
import pytest

from helpers import assert_close, get, out, rand_bf16, up
from test_gemv import TOL, check, make_weight
from test_gemv_batch64 import run_narrow_rows
from mtp_cupy import KernelError, ops
from mtp_cupy.ops.gemv_wg import WG_KERNELS, WG_SMEM, plan_wg, wg_pays, wg_smem
from mtp_cupy.weights.linear import Linear

FMTS = list(WG_KERNELS)


def run_wg(dev, fmt, arrays, x, m, n, k, xs, ys, ks, kb=1, out_dtype="f32", nx=None, stages=None):
    """The format's wgmma kernel on m rows of x (padded to stride xs), y poisoned, stride ys."""
    xp = np.zeros((m, xs), x.dtype)
    xp[:, :k] = x[:m]
    bufs = [up(dev, a) for a in arrays]
    xb, y = up(dev, xp), out(dev, out_dtype, (m, ys))
    getattr(ops, WG_KERNELS[fmt])(dev, *[b.ptr for b in bufs], xb.ptr, y.ptr, m, n, k, xs, ys, out_dtype, ks=ks,
                                  kb=kb, nx=nx, stages=stages)
    return get(dev, y, out_dtype, (m, ys))


# (ks, kb): one slice; slices in one 8-row block; ranks of one slice; 3 x 2 with slices past the units
PLANS = [(1, 1), (4, 1), (1, 4), (3, 2), (16, 1), (7, 8)]


@pytest.mark.parametrize("out_dtype", ["bf16", "f32"])
@pytest.mark.parametrize("plan", PLANS, ids=lambda p: f"ks{p[0]}-kb{p[1]}")
@pytest.mark.parametrize("m", [1, 9, 17, 40, 64])
@pytest.mark.parametrize("fmt", FMTS)
def test_wg_vs_float64(dev, rng, fmt, m, plan, out_dtype):
    """Partial tiles (n not a multiple of 128), partial units and steps (k not a multiple of 128), slices without
    units, partial passes (m % nx), 128-row scale blocks, strides."""
    ks, kb = plan
    n = int(rng.integers(1, 300)) * 2 + 1
    k = int(rng.integers(1, 100)) * 16
    xs, ys = k + 8 * int(rng.integers(0, 3)), n + int(rng.integers(1, 3))
    arrays, _, wd = make_weight(rng, fmt, n, k)
    x = rand_bf16(rng, (m, k))
    got = run_wg(dev, fmt, arrays, x, m, n, k, xs, ys, ks, kb, out_dtype)
    check(got, x.astype(np.float64) @ wd().T, out_dtype, n, f"{fmt} wg m={m} n={n} k={k} plan={plan}")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FMTS)
def test_wg_rows_equal_the_8_row_kernel(rng, fmt):
    """Every plan, every pass width and two ring depths at a shape with partial tiles, units and steps."""
    import mtp_cupy
    dev = mtp_cupy.device("cuda")
    n, k = int(rng.integers(130, 300)), int(rng.integers(9, 140)) * 16
    arrays, _, _ = make_weight(rng, fmt, n, k)
    x = rand_bf16(rng, (64, k))
    for ks, kb in PLANS:
        alone = run_narrow_rows(dev, fmt, arrays, x[[0, 16, 33, 63]], n, k, ks, kb)
        cb = max(c for c in range(1, 17) if ks * kb % c == 0)
        for m, nx, stages in ((64, 64, None), (64, 16, 2), (40, 32, 3), (17, None, None)):
            if nx and wg_smem(nx, stages or 2, ks * kb // cb) > WG_SMEM:
                continue   # those slice sums do not fit beside the ring (test_wg_plan_and_errors)
            got = run_wg(dev, fmt, arrays, x, m, n, k, k, n, ks, kb, nx=nx, stages=stages)
            pick = [r for r in (0, 16, 33, 63) if r < m]
            assert np.all(np.isfinite(got)), f"{fmt} {n}x{k} m={m}: NaN / inf (the poison survived)"
            assert np.array_equal(alone[:len(pick)], got[pick, :n]), \
                f"{fmt} {n}x{k} plan ({ks}, {kb}) m={m} nx={nx} stages={stages}: rows differ from the 8-row kernel"


# (fmt, n real, k, n run): every fp8 block projection of V4, V3 and GLM-5 at its real k and real invariant split, on
# fewer rows where the weight is big (a row's sums depend on the split and k only)
REAL = [("fp8_block_e8m0", 512, 4096, 512), ("fp8_block_e8m0", 1024, 4096, 1024),
        ("fp8_block_e8m0", 2048, 4096, 2048), ("fp8_block_e8m0", 4096, 2048, 4096),
        ("fp8_block_e8m0", 32768, 1024, 8192), ("fp8_block_e8m0", 4096, 8192, 1000),
        ("fp8_block_e8m0", 4096, 4096, 4096), ("fp8_block", 576, 7168, 576), ("fp8_block", 1536, 7168, 1536),
        ("fp8_block", 2048, 7168, 1000), ("fp8_block", 24576, 1536, 4000), ("fp8_block", 7168, 16384, 1000),
        ("fp8_block", 576, 6144, 576), ("fp8_block", 2048, 6144, 1000), ("fp8_block", 16384, 2048, 4000),
        ("fp8_block", 6144, 16384, 1000)]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, n_real, k, n", REAL, ids=str)
def test_wg_rows_equal_the_8_row_kernel_real_dims(rng, fmt, n_real, k, n):
    import mtp_cupy
    dev = mtp_cupy.device("cuda")
    p = ops.invariant_tune(dev, fmt, n_real, k)   # the split linear(invariant) sums under at every m
    arrays, _, wd = make_weight(rng, fmt, n, k)
    x = rand_bf16(rng, (64, k))
    for m in (64, 33, 16, 9):
        pick = sorted({0, m // 2, m - 1})
        alone = run_narrow_rows(dev, fmt, arrays, x[pick], n, k, p.ks, p.kb)
        got = run_wg(dev, fmt, arrays, x, m, n, k, k, n, p.ks, p.kb)
        assert np.all(np.isfinite(got)), f"{fmt} {n}x{k} m={m}: NaN / inf (the poison survived)"
        assert np.array_equal(alone, got[pick]), \
            f"{fmt} {n}x{k} plan ({p.ks}, {p.kb}) m={m}: rows differ from the 8-row kernel"
    assert_close(got[:2].astype(np.float64), x[:2].astype(np.float64) @ wd().T, TOL["f32"], f"{fmt} {n}x{k}")


def test_wg_pays():
    """One slice a block (ks * kb <= 16, a cluster's blocks) streaming >= 12 units of 128 k."""
    assert wg_pays(16384, 8, 1) and wg_pays(16384, 10, 1) and wg_pays(1536, 1, 1) and wg_pays(2048, 1, 1)
    assert not wg_pays(4096, 16, 1) and not wg_pays(8192, 16, 1)     # 2 and 4 units a slice
    assert not wg_pays(1024, 1, 1) and not wg_pays(8192, 8, 1)       # 8 units
    assert not wg_pays(16384, 7, 8)     # 56 slices: several a block


@pytest.mark.parametrize("fmt", FMTS)
def test_linear_invariant_routes_33_to_64_rows_to_wg(dev, rng, fmt, monkeypatch):
    """linear(invariant) of an fp8 block weight whose split walks >= 12 units a slice: launches of 33-64 rows on the
    wgmma kernel, up to 32 rows not, and every row equal to the row alone."""
    n, k = 16384, 1536
    tune = ops.invariant_tune(dev, fmt, n, k)
    assert wg_pays(k, tune.ks, tune.kb), tune   # this shape's split ((1, 1): 12 units a slice) is one that pays
    arrays, _, _ = make_weight(rng, fmt, n, k)
    bufs = [up(dev, a) for a in arrays]
    W = Linear(fmt, n, k, bufs[0].ptr, scale=bufs[1].ptr)
    names = []
    import mtp_cupy.ops.gemv_wg as gw
    real = gw.launch
    monkeypatch.setattr(gw, "launch", lambda gpu, mod, name: names.append(name) or real(gpu, mod, name))
    x = rand_bf16(rng, (100, k))
    xb = up(dev, x)
    rows = {}
    for m in (1, 32, 33, 64, 100):
        y = out(dev, "f32", (m, n))
        names.clear()
        ops.linear(dev, xb.ptr, W, y.ptr, m, "f32", invariant=True)
        rows[m] = get(dev, y, "f32", (m, n))
        launches = [m] if m <= 64 else [64, m - 64]
        assert names == [WG_KERNELS[fmt]] * sum(s > 32 for s in launches), f"m={m}: {names}"
    for m in (32, 33, 64, 100):
        assert np.array_equal(rows[1][0], rows[m][0]), f"{fmt} m={m}: row 0 differs from the row alone"
    assert np.array_equal(rows[64][63], rows[100][63]) and np.array_equal(rows[33][32], rows[100][32])


def test_wg_plan_and_errors(dev, rng):
    """The cluster takes the largest divisor <= 16 of the split's slices; the pass is the widest whose slice sums,
    x and ring fit two blocks a multiprocessor, halved while the blocks leave multiprocessors idle (never wider
    than m needs); bad arguments are KernelErrors naming the problem."""
    sms = ops.gemv._sms(dev)
    wide = plan_wg(dev, 128 * sms, 64)            # tiles alone fill the GPU: one 64-row pass
    assert (wide.nx, wide.passes, wide.tiles, wide.cb, wide.stages) == (64, 1, sms, 1, 2)
    assert wide.smem == wg_smem(64, 2, 1) <= WG_SMEM < wg_smem(64, 3, 1)
    half = plan_wg(dev, 128 * (sms // 2 + 1), 64)  # two passes of 32 rows do
    assert (half.nx, half.passes) == (32, 2)
    assert (plan_wg(dev, 512, 64).nx, plan_wg(dev, 512, 64).passes) == (16, 4)
    wkv = plan_wg(dev, 512, 64, ks=7, kb=8)       # 56 slices: clusters of 14, 4 slice sums a block
    assert (wkv.cb, wkv.nx, wkv.passes, wkv.stages) == (14, 16, 4, 3)
    assert plan_wg(dev, 4096, 64, ks=16).cb == 16 and plan_wg(dev, 4096, 64, ks=10).cb == 10
    assert plan_wg(dev, 4096, 64, ks=14, kb=2).cb == 14 and plan_wg(dev, 4096, 64, ks=5, kb=4).cb == 10
    assert plan_wg(dev, 128 * sms, 12).nx == 16 and plan_wg(dev, 128 * sms, 30).nx == 32
    assert plan_wg(dev, 4096, 64, nx=64, stages=2).smem == wg_smem(64, 2, 1)
    for bad in ({"nx": 8}, {"stages": 1}, {"stages": 9}, {"nx": 64, "ks": 7, "kb": 8}, {"max_cb": 0}, {"max_cb": 17}):
        with pytest.raises(KernelError, match="plan_wg"):
            plan_wg(dev, 4096, 64, **bad)
    with pytest.raises(KernelError, match="m=65"):
        plan_wg(dev, 4096, 65)
    n, k = 100, 256
    arrays, _, _ = make_weight(rng, "fp8_block", n, k)
    bufs = [up(dev, a) for a in arrays]
    xb, y = up(dev, rand_bf16(rng, (20, k))), out(dev, "f32", (20, n))
    calls = [({"ks": 0}, "ks 0"), ({"kb": 9}, "kb 9"), ({"m": 65}, "m=65"), ({"k": 250}, "multiple of 16"),
             ({"scale": 0}, "scale pointer is NULL")]
    for change, msg in calls:
        a = {"w": bufs[0].ptr, "scale": bufs[1].ptr, "x": xb.ptr, "y": y.ptr, "m": 20, "n": n, "k": k,
             "x_stride": k, "y_stride": n, "out_dtype": "f32"}
        a.update(change)
        with pytest.raises(KernelError, match=msg):
            ops.w8a16_gemv_wg(dev, **a)
