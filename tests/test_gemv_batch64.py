"""The 64-row x-staged GEMV kernels (cuda_src/gemv.cu x64_body: dense_gemv_bf16_batch64, gemv_fp8w_batch64,
w8a16_gemv_batch64, w8a16_gemv_e8m0_batch64).

Reference: float64 x @ W.T of the dequantised weight (test_gemv.make_weight). The kernels' contract beyond
that: every row is bit-identical to the same row computed alone by the format's 8-row kernel under the plan
(ks, kb) they were given, whatever its neighbours, the row count and the kernel's own geometry (xs k slices a
block, a cluster of ks * kb / xs blocks). Outputs are poisoned before each launch (helpers.out). The bit-identity
tests draw x from normal values, whose f32 sums change with their order (fixed-exponent rows sum exactly)."""
from __future__ import annotations

import numpy as np
import pytest

from helpers import assert_close, get, out, rand_bf16, up
from test_gemv import TOL, bf16_bits, check, make_weight
from mtp_cupy import KernelError, ops
from mtp_cupy.ops.gemv import X64_KERNELS, Tune

NARROW = {"bf16": "dense_gemv_bf16_batchm", "fp8_row": "gemv_fp8w", "fp8_block": "w8a16_gemv",
          "fp8_block_e8m0": "w8a16_gemv_e8m0"}
KCHUNK = {"bf16": 8, "fp8_row": 16, "fp8_block": 16, "fp8_block_e8m0": 16}
FMTS = list(X64_KERNELS)


def run_x64(dev, fmt, arrays, x, m, n, k, xs, ys, ks, kb=1, out_dtype="f32", slices=None):
    """The format's 64-row kernel on m rows of x (padded to stride xs), y poisoned, stride ys; `slices` fixes the
    kernel's k slices a block (None: its planner's)."""
    xp = np.zeros((m, xs), x.dtype)
    xp[:, :k] = x[:m]
    bufs = [up(dev, a) for a in arrays]
    xb, y = up(dev, xp), out(dev, out_dtype, (m, ys))
    getattr(ops, X64_KERNELS[fmt])(dev, *[b.ptr for b in bufs], xb.ptr, y.ptr, m, n, k, xs, ys, out_dtype, ks=ks,
                                   kb=kb, slices=slices)
    return get(dev, y, out_dtype, (m, ys))


def run_narrow_rows(dev, fmt, arrays, x, n, k, ks, kb):
    """Each x row alone through the 8-row kernel under Tune(ks, kb): what the 64-row kernel's rows must equal."""
    bufs, rows = [up(dev, a) for a in arrays], []
    for r in range(x.shape[0]):
        xb, y = up(dev, x[r:r + 1]), out(dev, "f32", (1, n))
        getattr(ops, NARROW[fmt])(dev, *[b.ptr for b in bufs], xb.ptr, y.ptr, 1, n, k, k, n, "f32",
                                  tune=Tune(ks=ks, kb=kb))
        rows.append(get(dev, y, "f32", (1, n))[0])
    return np.stack(rows)


def fits(fmt, ks, kb, slices):
    """The layouts the kernels have, stated independently: the ks * kb slices in clusters of <= 8 one-slice
    blocks, or (bf16) both of two slices in one block."""
    kw = ks * kb
    return kw <= 8 if slices == 1 else fmt == "bf16" and kw == 2


# (ks, kb, slices a block): one block, both slices in one block (bf16), two one-slice blocks, clusters of 8
# one-slice blocks, of 6 holding two 8-row blocks' slices each, of 8 over 4 and over 2 8-row blocks
PLANS = [(1, 1, None), (2, 1, 2), (2, 1, 1), (8, 1, 1), (3, 2, 1), (2, 4, 1), (4, 2, 1)]


@pytest.mark.parametrize("out_dtype", ["bf16", "f32"])
@pytest.mark.parametrize("plan", PLANS, ids=lambda p: f"ks{p[0]}-kb{p[1]}-s{p[2]}")
@pytest.mark.parametrize("m", [1, 9, 17, 40, 64])
@pytest.mark.parametrize("fmt", FMTS)
def test_batch64_vs_float64(dev, rng, fmt, m, plan, out_dtype):
    """Partial tiles (n not a multiple of 128), partial units and steps (k not a multiple of a unit), slices
    without a unit in the last round, partial n-tiles (m % 8), 128-row scale blocks cut by the tile, strides."""
    ks, kb, slices = plan
    if slices == 2 and fmt != "bf16":
        pytest.skip("two-slice blocks are bf16's")
    n = int(rng.integers(1, 400)) * 2 + 1
    k = int(rng.integers(1, 1400 // KCHUNK[fmt])) * KCHUNK[fmt]
    xs, ys = k + 8 * int(rng.integers(0, 3)), n + int(rng.integers(1, 3))
    arrays, _, wd = make_weight(rng, fmt, n, k)
    x = bf16_bits(rng, (m, k), exp=126)
    got = run_x64(dev, fmt, arrays, x, m, n, k, xs, ys, ks, kb, out_dtype, slices)
    check(got, x.astype(np.float64) @ wd().T, out_dtype, n, f"{fmt} batch64 m={m} n={n} k={k} plan={plan}")


def test_batch64_rows_equal_the_8_row_kernel(dev, rng):
    """Rows against the 8-row kernel at a small shape on both devices (the twin is the same math either way)."""
    for fmt in FMTS:
        n, k = int(rng.integers(130, 300)), int(rng.integers(9, 140)) * 16
        arrays, _, _ = make_weight(rng, fmt, n, k)
        x = rand_bf16(rng, (23, k))
        for ks, kb, slices in PLANS:
            if slices == 2 and fmt != "bf16":
                continue
            got = run_x64(dev, fmt, arrays, x, 23, n, k, k, n, ks, kb, slices=slices)
            alone = run_narrow_rows(dev, fmt, arrays, x[[0, 11, 22]], n, k, ks, kb)
            assert np.array_equal(alone, got[[0, 11, 22], :n]), f"{fmt} {n}x{k} plan {(ks, kb, slices)}"


# (fmt, n real, k, n run): each family's projections and heads at their real k and real invariant split, on
# fewer rows where the weight is big (the split is the real shape's; the rows' sums depend on (ks, kb) and k only)
REAL = [("bf16", 7168, 14336, 1000), ("bf16", 6144, 12288, 1000), ("bf16", 8192, 2048, 8192),
        ("bf16", 4096, 4096, 1000), ("bf16", 2048, 4096, 2048),
        ("bf16", 129280, 7168, 129280), ("bf16", 151936, 2048, 8192), ("fp8_block", 7168, 16384, 1000),
        ("fp8_block", 24576, 1536, 4000), ("fp8_block", 16384, 2048, 16384), ("fp8_block_e8m0", 32768, 1024, 32768),
        ("fp8_row", 7168, 16384, 1000)]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, n_real, k, n", REAL, ids=str)
def test_batch64_rows_equal_the_8_row_kernel_real_dims(rng, fmt, n_real, k, n):
    import mtp_cupy
    dev = mtp_cupy.device("cuda")
    p = ops.invariant_tune(dev, fmt, n_real, k)   # the split linear(invariant) sums under at every m
    choices = [s for s in (1, 2) if fits(fmt, p.ks, p.kb, s)]
    assert choices, f"{fmt} {n_real}x{k}: the real split (ks {p.ks}, kb {p.kb}) has no 64-row layout"
    arrays, _, wd = make_weight(rng, fmt, n, k)
    x = rand_bf16(rng, (64, k))
    for m in (64, 33, 9):
        pick = sorted({0, m // 2, m - 1})
        alone = run_narrow_rows(dev, fmt, arrays, x[pick], n, k, p.ks, p.kb)
        for slices in choices:
            got = run_x64(dev, fmt, arrays, x, m, n, k, k, n, p.ks, p.kb, slices=slices)
            assert np.all(np.isfinite(got)), f"{fmt} {n}x{k} m={m}: NaN / inf (the poison survived)"
            assert np.array_equal(alone, got[pick]), \
                f"{fmt} {n}x{k} plan ({p.ks}, {p.kb}) xs={slices} m={m}: rows differ from the 8-row kernel"
    assert_close(got[:2].astype(np.float64), x[:2].astype(np.float64) @ wd().T, TOL["f32"], f"{fmt} {n}x{k}")


@pytest.mark.gpu
def test_dynamic_smem_opt_in_is_never_lowered_by_another_backend(rng):
    """CuPy shares a compiled module's functions between backends: a second backend's smaller opt-in (1 slice a
    block) must not lower what the first relies on (2 slices, 224 KB; that launch then failed with CUresult 1)."""
    from mtp_cupy.runtime.cupy_backend import CupyBackend
    n, k = 300, 512
    arrays, _, wd = make_weight(rng, "bf16", n, k)
    x = bf16_bits(rng, (20, k), exp=126)
    a, b = CupyBackend(), CupyBackend()
    assert ops.plan_batch64(a, n, k, 2).smem > ops.plan_batch64(a, n, k, 1).smem > 48 * 1024
    run_x64(a, "bf16", arrays, x, 20, n, k, k, n, 2)
    run_x64(b, "bf16", arrays, x, 20, n, k, k, n, 1)
    got = run_x64(a, "bf16", arrays, x, 20, n, k, k, n, 2)
    assert_close(got.astype(np.float64), x.astype(np.float64) @ wd().T, TOL["f32"], "ks=2 after a ks=1 backend")


def test_linear_takes_batch64_where_it_matches(monkeypatch):
    """linear(invariant) runs m <= 256 rows (64 sequences x V4's 4 streams) in launches of <= 64, and sends a
    launch of 8 < rows <= 64 to the 64-row kernel exactly when the format has one, the invariant split's
    (invariant_tune: the 8-row plan, or one the 64-row kernel holds) kw = ks * kb slices fit its default layout
    (<= 2 in a block, else clusters of <= 8 one-slice blocks) and each slice has >= 8 units (of 8 chunks) a tile,
    >= 24 for bf16 in clusters, with that split's (ks, kb). Other invariant launches of 9-16 rows run the 8-row
    kernel, of 17-64 the 32-row kernel where it holds the split; an fp8 block launch of 33-64 rows whose split
    gives one slice a block of a cluster of <= 16 and >= 12 units (of 128 k) a slice runs the wgmma kernel instead
    (the NumPy device plans as an sm_90 one); non-invariant calls keep their kernels, and no invariant call
    reaches the split-free kernels (the register rounds, the tiled GEMM). Launchers are replaced by recorders:
    only the routing runs."""
    import mtp_cupy
    import mtp_cupy.ops.gemv as g
    from mtp_cupy.runtime.ptr import DevicePtr
    from mtp_cupy.weights.linear import Linear
    dev = mtp_cupy.device("ref")
    calls = []
    monkeypatch.setattr(g, "_x64", lambda gpu, fmt, lead, x, y, m, *a: calls.append(("x64", m, a[-2:])))
    monkeypatch.setattr(g, "_gemv", lambda gpu, name, lead, x, y, m, *a: calls.append((name, m)))
    monkeypatch.setattr(g, "_wg", lambda gpu, fmt, w, s, x, y, m, n, k, xs, ys, o, st, ks, kb, *a:
                        calls.append(("wg", m, (ks, kb))))
    for name in ("dense_gemv_bf16_regs", "dense_gemm_bf16", "w4a16_gemv_regs"):
        monkeypatch.setattr(g, name, lambda gpu, *a, name=name: calls.append((name, a[3])))
    seen, moved, wg_seen = set(), set(), set()
    for fmt, n, k in [("bf16", 151936, 2048), ("bf16", 2048, 4096), ("bf16", 7168, 14336), ("bf16", 8192, 2048),
                      ("fp8_block", 7168, 16384), ("fp8_block", 1536, 7168), ("fp8_block", 6144, 16384),
                      ("fp8_block_e8m0", 32768, 1024), ("nvfp4", 2048, 2048), ("mxfp4", 2048, 2048)]:
        p = ops.plan_gemv(dev, g._STREAM[fmt][0], n, k)
        t = g.invariant_tune(dev, fmt, n, k)
        kw, units = t.ks * t.kb, -(-k // KCHUNK.get(fmt, 32) // 8)
        rounds = -(-units // kw)
        ok = fmt in NARROW and kw <= 8 and rounds >= 8 and (fmt != "bf16" or kw <= 2 or rounds >= 24)
        pays = fmt in ("fp8_block", "fp8_block_e8m0") and kw <= 16 and -(-k // 128) // kw >= 12
        wg_seen.add(pays)
        narrow, wide = g._STREAM[fmt]
        wide = wide if g._fits(dev, wide, n, k, g.Tune(ks=t.ks, kb=t.kb)) else narrow
        seen.add(ok)
        moved.add((t.ks, t.kb) != (p.ks, p.kb))
        W = Linear(fmt, n, k, DevicePtr(1 << 20), DevicePtr(2 << 20), 1.0)
        free = {"dense_gemv_bf16_regs", "dense_gemm_bf16", "w4a16_gemv_regs"}
        for m, inv in [(20, True), (8, True), (64, True), (70, True), (256, True), (300, True), (20, False)]:
            calls.clear()
            ops.linear(dev, DevicePtr(3 << 20), W, DevicePtr(4 << 20), m, out_dtype="f32", invariant=inv)
            x64 = [c for c in calls if c[0] == "x64"]
            held = inv and m <= 256
            sizes = [min(64, m - r0) for r0 in range(0, m, 64)]
            on_wg = [mm > 32 and pays and held for mm in sizes]
            want = [("x64", mm, (t.ks, t.kb)) for mm, w in zip(sizes, on_wg) if ok and held and mm > 8 and not w]
            assert x64 == want and calls, (fmt, n, k, m, inv, calls)
            assert [c for c in calls if c[0] == "wg"] == [("wg", mm, (t.ks, t.kb)) for mm, w in zip(sizes, on_wg)
                                                          if w], (fmt, n, k, m, inv, calls)
            if held:
                assert not free & {c[0] for c in calls}, (fmt, n, k, m, calls)
                streams = [c for c in calls if c[0] not in ("x64", "wg")]
                assert streams == [(narrow if mm <= 16 else wide, mm) for mm, w in zip(sizes, on_wg)
                                   if not (ok and mm > 8) and not w], (fmt, n, k, m, calls)
                assert sum(c[1] for c in calls) == m and max(c[1] for c in calls) <= 64, (fmt, n, k, m, calls)
    assert seen == moved == wg_seen == {True, False}   # both outcomes were exercised, and splits moved and kept


def test_batch64_refusals(rng):
    import mtp_cupy
    dev = mtp_cupy.device("ref")
    w, x, y = up(dev, np.zeros((64, 64), np.uint16)), up(dev, np.zeros((65, 64), np.uint16)), out(dev, "f32", (65, 64))
    s = up(dev, np.ones(4, np.float32))
    for fmt, kw, what in [("bf16", dict(m=65), "m=65"), ("bf16", dict(ks=17), "ks 17"), ("bf16", dict(ks=0), "ks 0"),
                          ("bf16", dict(kb=9), "kb 9"), ("bf16", dict(ks=14, kb=2), "no launch plan"),
                          ("bf16", dict(ks=8, slices=2), "no launch plan"), ("fp8_block", dict(ks=2, slices=2), "no launch plan"),
                          ("bf16", dict(slices=3), "slices 3"), ("bf16", dict(stages=1), "stages 1"),
                          ("bf16", dict(stages=0), "stages 0"),
                          ("bf16", dict(k=60, xs=64), "multiple of 8"), ("bf16", dict(xs=60), "stride"),
                          ("bf16", dict(out_dtype="f16"), "out_dtype"), ("fp8_block", dict(k=40, xs=64), "multiple of 16"),
                          ("fp8_block", dict(scale=0), "NULL")]:
        a = dict(m=3, n=64, k=64, xs=64, ys=64, ks=1, kb=1, slices=None, stages=None, out_dtype="f32", scale=s.ptr) | kw
        lead = (w.ptr,) if fmt == "bf16" else (w.ptr, a["scale"])
        with pytest.raises(KernelError, match=what):
            getattr(ops, X64_KERNELS[fmt])(dev, *lead, x.ptr, y.ptr, a["m"], a["n"], a["k"], a["xs"], a["ys"],
                                           a["out_dtype"], ks=a["ks"], kb=a["kb"], slices=a["slices"],
                                           stages=a["stages"])
    with pytest.raises(KernelError, match="no 64-row kernel"):
        ops.plan_batch64(dev, 64, 64, 1, 1, "nvfp4")
