"""gemv: every Linear format against float64 textbook math (exact numpy dequantisation, then a float64
matmul on the same bf16 x), and CUDA against its twin at real model dims.

Tolerances (norm-relative): a bf16 output is one round-to-nearest away from the exact value (<= 2^-9
per element), so 2^-8 leaves room for fp32 accumulation and nothing else; an f32 output carries only
fp32 accumulation error (~1e-7 at these K), so 1e-5."""
import ml_dtypes
import numpy as np
import pytest

from helpers import POISON, assert_close, get, launched, out, rand_bf16, run_on_both, up
from mtp_cupy import KernelError, ops
from mtp_cupy.ops.gemv import _GEOM, SMEM_PER_BLOCK, SMEM_PER_SM, Tune
from mtp_cupy.runtime.ptr import NULL
from mtp_cupy.weights.linear import Linear

E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])
TOL = {"bf16": 2.0 ** -8, "f32": 1e-5}
KCHUNK = {"bf16": 8, "fp8_row": 16, "fp8_block": 16, "fp8_block_e8m0": 16, "nvfp4": 32, "mxfp4": 32}
FORMATS = list(KCHUNK)


def bf16_bits(rng, shape, exp=120):
    """Random bf16 with a fixed exponent (|v| in [2^(exp-127), 2^(exp-126))): cheap at LM-head sizes."""
    b = rng.integers(0, 1 << 16, shape, dtype=np.uint16)
    return ((b & 0x807F) | (exp << 7)).view(ml_dtypes.bfloat16)


def e4m3(b):
    return np.asarray(b, np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)


def finite_e4m3_bytes(rng, shape, hi=256):
    b = rng.integers(0, hi, shape, dtype=np.uint8)
    return np.where((b & 0x7F) == 0x7F, b ^ 0x01, b).astype(np.uint8)  # no NaN codes


def make_weight(rng, fmt, n, k):
    """(arrays to upload: w [, s], scale2, () -> float64 dequantised W [n, k])."""
    if fmt == "bf16":
        w = bf16_bits(rng, (n, k), exp=int(rng.integers(118, 124)))
        return (w,), 1.0, lambda: w.astype(np.float64)
    if fmt.startswith("fp8"):
        q = finite_e4m3_bytes(rng, (n, k))  # every code, subnormals included
        if fmt == "fp8_row":
            s = rng.uniform(1e-4, 1e-2, n).astype(np.float32)
            return (q, s), 1.0, lambda: e4m3(q) * s[:, None]
        nb, kb = -(-n // 128), -(-k // 128)
        if fmt == "fp8_block":
            s = rng.uniform(1e-4, 1e-2, (nb, kb)).astype(np.float32)
            sv = s.astype(np.float64)
        else:
            s = rng.integers(110, 127, (nb, kb), dtype=np.uint8)
            sv = np.ldexp(1.0, s.astype(int) - 127)
        return (q, s), 1.0, lambda: e4m3(q) * np.repeat(np.repeat(sv, 128, 0), 128, 1)[:n, :k]
    codes = rng.integers(0, 16, (n, k), dtype=np.uint8)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    if fmt == "nvfp4":
        s = finite_e4m3_bytes(rng, (n, k // 16), hi=0x7F)  # positive scales, subnormal ones included
        scale2 = float(np.float32(rng.uniform(1e-4, 1e-3)))
        return (packed, s), scale2, lambda: E2M1[codes] * np.repeat(e4m3(s), 16, 1) * scale2
    s = rng.integers(100, 130, (n, k // 32), dtype=np.uint8)
    return (packed, s), 1.0, lambda: E2M1[codes] * np.repeat(np.ldexp(1.0, s.astype(int) - 127), 32, 1)


def run_linear(dev, fmt, n, k, m, arrays, scale2, x, out_dtype, xs, ys, invariant=False):
    bufs = [up(dev, a) for a in arrays]
    W = Linear(fmt, n, k, bufs[0].ptr, bufs[1].ptr if len(bufs) > 1 else NULL, scale2, owners=bufs)
    xp = np.zeros((m, xs), x.dtype)
    xp[:, :k] = x
    xb = up(dev, xp)
    y = out(dev, out_dtype, (m, ys))
    ops.linear(dev, xb.ptr, W, y.ptr, m, out_dtype=out_dtype, x_stride=xs, y_stride=ys, invariant=invariant)
    return get(dev, y, out_dtype, (m, ys))


def check(got, ref, out_dtype, n, what):
    assert_close(got[:, :n].astype(np.float64), ref, TOL[out_dtype], what)
    gap = got[:, n:].view(np.uint8)
    assert np.all(gap == POISON), f"{what}: wrote outside [0, n) of a strided row"


@pytest.mark.parametrize("out_dtype", ["bf16", "f32"])
@pytest.mark.parametrize("m", [1, 2, 5, 8, 17, 32])
@pytest.mark.parametrize("fmt", FORMATS)
def test_linear_vs_float64(dev, rng, fmt, m, out_dtype):
    n = int(rng.integers(1, 160)) * 2 + 1
    k = int(rng.integers(1, 384 // KCHUNK[fmt] + 1)) * KCHUNK[fmt]
    xs, ys = k + 8 * int(rng.integers(0, 3)), n + int(rng.integers(0, 3))
    arrays, scale2, wd = make_weight(rng, fmt, n, k)
    x = bf16_bits(rng, (m, k), exp=126)
    got = run_linear(dev, fmt, n, k, m, arrays, scale2, x, out_dtype, xs, ys)
    check(got, x.astype(np.float64) @ wd().T, out_dtype, n, f"{fmt} m={m} n={n} k={k}")


@pytest.mark.parametrize("m", [1, 9, 33, 40, 64, 100, 256])
@pytest.mark.parametrize("fmt", FORMATS)
def test_linear_batch_invariant(dev, rng, fmt, m):
    """invariant=True: correct against float64 at every width (one 8-row pass, one or two 32-row passes in one
    launch, the last partial at 33 and 40, several launches past 64 rows: V4's h_proj runs B x 4 streams), and
    each row's result bit-identical to that row computed alone, whoever its neighbours are. x is normal values,
    whose f32 sums depend on their order (bf16_bits rows sum exactly in any order: no order change would show)."""
    n, k = int(rng.integers(1, 120)) * 2 + 1, int(rng.integers(1, 12)) * 32
    xs, ys = k + 8, n + 1
    arrays, scale2, wd = make_weight(rng, fmt, n, k)
    x = rand_bf16(rng, (m, k))
    got = run_linear(dev, fmt, n, k, m, arrays, scale2, x, "f32", xs, ys, invariant=True)
    check(got, x.astype(np.float64) @ wd().T, "f32", n, f"{fmt} m={m} invariant")
    for r in {0, m // 2, m - 1}:
        alone = run_linear(dev, fmt, n, k, 1, arrays, scale2, x[r:r + 1], "f32", xs, ys, invariant=True)
        assert np.array_equal(alone[0, :n], got[r, :n]), f"{fmt} m={m}: row {r} depends on its neighbours"


@pytest.mark.parametrize("fmt, n, k", [("bf16", 1024, 1024), ("bf16", 4096, 4096), ("fp8_block", 2112, 7168)])
def test_linear_batch_invariant_with_order_sensitive_sums(dev, rng, fmt, n, k):
    """Rows of normal values (full-mantissa bf16 x; bf16 W of normal values, or fp8 codes of every exponent), whose
    f32 sums change with their order (bf16_bits' fixed-exponent rows sum exactly in any order): a row alone and
    among 63, 80 and 256 rows (V4's h_proj: B x 4 streams) gives the same bits. On CUDA the split kernels and the
    tiled GEMM sum in different orders (past 64 rows linear took the GEMM, and rows changed with their
    neighbours)."""
    if fmt == "bf16":
        f = rng.standard_normal((n, k)).astype(np.float32)
        arrays, scale2 = ((f.view(np.uint32) >> 16).astype(np.uint16).view(ml_dtypes.bfloat16),), 1.0
    else:
        arrays, scale2, _ = make_weight(rng, fmt, n, k)
    x = rng.standard_normal((256, k)).astype(ml_dtypes.bfloat16)
    alone = {r: run_linear(dev, fmt, n, k, 1, arrays, scale2, x[r:r + 1], "f32", k, n, invariant=True)[0]
             for r in (0, 62, 79, 255)}
    for m in (63, 80, 256):
        got = run_linear(dev, fmt, n, k, m, arrays, scale2, x[:m], "f32", k, n, invariant=True)
        assert np.all(np.isfinite(got)), f"{fmt} {n}x{k} m={m}"
        for r in [r for r in alone if r < m]:
            assert np.array_equal(alone[r], got[r]), f"{fmt} {n}x{k} m={m}: row {r} differs from the row alone"


def test_linear_batch_invariant_falls_back_to_8_row_passes(dev, rng):
    """A shape whose 8-row plan splits k 16 ways in each of 4 blocks, which neither wide kernel can hold and whose
    64-row plans would leave most multiprocessors idle (8 weight groups): invariant calls run 8-row passes, still
    correct and still the same per row."""
    from mtp_cupy.ops.gemv import _fits, invariant_tune, plan_gemv, x64_fits
    n, k = 1024, 4096
    p, t = plan_gemv(dev, "dense_gemv_bf16_batchm", n, k), invariant_tune(dev, "bf16", n, k)
    assert p.ks == 16 and (t.ks, t.kb) == (p.ks, p.kb) and not _fits(dev, "dense_gemv_bf16_batch32", n, k, t)
    assert not x64_fits(dev, "bf16", n, k, t.ks, t.kb)
    arrays, scale2, wd = make_weight(rng, "bf16", n, k)
    x = rand_bf16(rng, (20, k))
    got = run_linear(dev, "bf16", n, k, 20, arrays, scale2, x, "f32", k, n, invariant=True)
    check(got, x.astype(np.float64) @ wd().T, "f32", n, "bf16 1024x4096 m=20 invariant")
    alone = run_linear(dev, "bf16", n, k, 1, arrays, scale2, x[13:14], "f32", k, n, invariant=True)
    assert np.array_equal(alone[0], got[13])


def test_invariant_tune_refuses_bad_input():
    import mtp_cupy
    dev = mtp_cupy.device("ref")
    for fmt, n, k, what in [("fp16", 64, 64, "format 'fp16'"), ("bf16", 0, 64, "n=0"), ("bf16", 64, -8, "k=-8")]:
        with pytest.raises(KernelError, match=what):
            ops.invariant_tune(dev, fmt, n, k)


@pytest.mark.parametrize("fmt, n, k, wide, why", [
    ("bf16", 2048, 4096, "dense_gemv_bf16_batch32",
     "Qwen's e/h proj: its 8-row plan (16, 2) fits neither wide kernel; the 64-row kernel's clusters at 8 units "
     "a slice are slower than the 32-row kernel under the same split"),
    ("fp8_block_e8m0", 32768, 1024, "w8a16_gemv_e8m0_batch64",
     "V4's wq_b: its plan (2, 1) leaves the 64-row kernel 4 units a slice")])
def test_linear_invariant_moves_to_a_split_the_64_row_kernel_holds(dev, rng, monkeypatch, fmt, n, k, wide, why):
    """Where the 64-row kernel cannot hold the 8-row plan but holds another split that fills the GPU, every
    invariant call sums under that split: m = 64 runs one wide launch (the 64-row kernel, or the 32-row one where
    linear routes there), m = 1 one 8-row launch, and each row's bits are those of the row alone (and correct
    against float64)."""
    from mtp_cupy.ops.gemv import _STREAM, invariant_tune, plan_gemv, x64_fits
    narrow = _STREAM[fmt][0]
    p, t = plan_gemv(dev, narrow, n, k), invariant_tune(dev, fmt, n, k)
    assert (t.ks, t.kb) != (p.ks, p.kb) and not x64_fits(dev, fmt, n, k, p.ks, p.kb), why
    assert x64_fits(dev, fmt, n, k, t.ks, t.kb), why
    arrays, scale2, wd = make_weight(rng, fmt, n, k)
    x = rand_bf16(rng, (64, k))
    names = launched(monkeypatch)
    got = run_linear(dev, fmt, n, k, 64, arrays, scale2, x, "f32", k, n, invariant=True)
    assert names == [wide], names
    check(got, x.astype(np.float64) @ wd().T, "f32", n, f"{fmt} {n}x{k} m=64 invariant")
    for r in (0, int(rng.integers(1, 63)), 63):
        names.clear()
        alone = run_linear(dev, fmt, n, k, 1, arrays, scale2, x[r:r + 1], "f32", k, n, invariant=True)
        assert names == [narrow], names
        assert np.array_equal(alone[0], got[r]), f"{fmt} {n}x{k}: row {r} differs alone"


@pytest.mark.parametrize("name, m", [("dense_gemv_bf16", 3), ("dense_gemv_bf16_batchm", 8),
                                     ("dense_gemv_bf16_batch32", 32), ("dense_gemv_bf16_batch64", 64),
                                     ("dense_gemm_bf16", 45),
                                     ("dense_gemm_bf16", 1), ("dense_gemv_bf16_regs", 2),
                                     ("dense_gemv_bf16_batchm_regs", 5)])
def test_dense_kernels(dev, rng, name, m):
    """Each bf16 kernel on its own, whatever `linear` would pick for m."""
    n, k = int(rng.integers(100, 300)), int(rng.integers(1, 80)) * 8
    (w,), _, wd = make_weight(rng, "bf16", n, k)
    x = bf16_bits(rng, (m, k), exp=126)
    wb, xb, y = up(dev, w), up(dev, x), out(dev, "f32", (m, n))
    getattr(ops, name)(dev, wb.ptr, xb.ptr, y.ptr, m, n, k, k, n, "f32")
    assert_close(get(dev, y, "f32", (m, n)), x.astype(np.float64) @ wd().T, TOL["f32"], name)


# Streaming kernels under launch plans the planner would not pick: k split over 2..16 warps, ring depths
# 1..8, a handful of blocks walking many tiles (the reduction buffers swap every tile), odd n and k.
# m up to 64: the tensor-core streaming kernels run ceil(m / pass rows) passes in one launch.
STREAM = [("bf16", "dense_gemv_bf16", 3), ("bf16", "dense_gemv_bf16_batchm", 64),
          ("bf16", "dense_gemv_bf16_batch32", 64), ("fp8_row", "gemv_fp8w", 64), ("fp8_block", "w8a16_gemv", 64),
          ("fp8_block_e8m0", "w8a16_gemv_e8m0", 64), ("nvfp4", "w4a16_gemv", 64), ("mxfp4", "w4a16_gemv_mx", 64),
          ("fp8_block", "w8a16_gemv_batch32", 64), ("mxfp4", "w4a16_gemv_mx_batch32", 64),
          ("fp8_block", "w8a16_gemv_regs", 8), ("nvfp4", "w4a16_gemv_regs", 8)]
TUNES = [Tune(ks=1, stages=1, blocks=1), Tune(ks=2, stages=2, blocks=2), Tune(ks=3, stages=8, blocks=3),
         Tune(ks=5, stages=3, blocks=1), Tune(ks=8, stages=4), Tune(stages=6, warps_per_sm=1),
         # k split across the blocks of a cluster: one walker, several, uneven units per warp
         Tune(ks=1, kb=2, stages=2, blocks=1), Tune(ks=3, kb=4, stages=3, blocks=2), Tune(ks=2, kb=8),
         Tune(kb=3, stages=4, blocks=5)]


def raw_gemv(dev, name, fmt, bufs, scale2, x, y, m, n, k, xs, ys, out_dtype, tune=None):
    kw = {} if tune is None or name.endswith("_regs") else {"tune": tune}
    fn = getattr(ops, name)
    if fmt == "bf16":
        fn(dev, bufs[0].ptr, x, y, m, n, k, xs, ys, out_dtype, **kw)
    elif fmt == "nvfp4":
        fn(dev, bufs[0].ptr, bufs[1].ptr, scale2, x, y, m, n, k, xs, ys, out_dtype, **kw)
    else:
        fn(dev, bufs[0].ptr, bufs[1].ptr, x, y, m, n, k, xs, ys, out_dtype, **kw)


@pytest.mark.parametrize("tune", TUNES, ids=str)
@pytest.mark.parametrize("fmt, name, max_m", STREAM)
def test_streaming_launch_plans(dev, rng, fmt, name, max_m, tune):
    if tune.ks and tune.ks > _GEOM[name].max_ks:
        pytest.skip(f"{name} takes at most {_GEOM[name].max_ks} warps per block")
    if (tune.kb or 1) > _GEOM[name].max_kb:
        pytest.skip(f"{name} does not split k across blocks")
    m = int(rng.integers(1, max_m + 1))
    n = int(rng.integers(1, 100)) * 3 + 1
    k = int(rng.integers(1, 1024 // KCHUNK[fmt] + 1)) * KCHUNK[fmt]
    xs, ys = k + 8, n + 2
    arrays, scale2, wd = make_weight(rng, fmt, n, k)
    x = bf16_bits(rng, (m, k), exp=126)
    bufs = [up(dev, a) for a in arrays]
    xp = np.zeros((m, xs), x.dtype)
    xp[:, :k] = x
    xb, y = up(dev, xp), out(dev, "f32", (m, ys))
    raw_gemv(dev, name, fmt, bufs, scale2, xb.ptr, y.ptr, m, n, k, xs, ys, "f32", tune)
    check(get(dev, y, "f32", (m, ys)), x.astype(np.float64) @ wd().T, "f32", n, f"{name} {tune} m={m} n={n} k={k}")


@pytest.mark.parametrize("n, k", [(129280, 7168), (154880, 6144), (151936, 2048), (7168, 14336), (4096, 2048),
                                  (7168, 2048), (2048, 7168), (256, 7168), (576, 1536), (3, 32)])
@pytest.mark.parametrize("name", [nm for nm, g in _GEOM.items() if g.stream])
def test_plans_fit(name, n, k):
    """Every plan fits one block's shared memory and a multiprocessor, with whole warps splitting k."""
    import mtp_cupy
    dev = mtp_cupy.device("ref")
    g = _GEOM[name]
    if k % g.kchunk:
        pytest.skip("k is not whole chunks")
    for tune in [Tune()] + TUNES + [Tune(ks=16, stages=8), Tune(warps_per_sm=64)]:
        if tune.ks and tune.ks > g.max_ks:
            continue
        stage = g.tile_rows * g.unit_chunks * 16
        part = 4 * g.red_floats if (tune.kb or 1) > 1 else 0
        if (tune.kb or 1) > g.max_kb or tune.ks and \
                tune.ks * min(2, tune.stages or 2) * stage + 8 * tune.ks * g.red_floats + part > SMEM_PER_BLOCK:
            with pytest.raises(KernelError, match="no launch plan fits"):
                ops.plan_gemv(dev, name, n, k, tune)
            continue
        p = ops.plan_gemv(dev, name, n, k, tune)
        red = (2 * p.ks * g.red_floats * 4 if p.ks > 1 else 0) + (4 * g.red_floats if p.kb > 1 else 0)
        assert 1 <= p.ks <= g.max_ks and 1 <= p.kb <= g.max_kb and p.blocks >= 1 and p.stages >= 1
        if p.kb > 1 and not tune.kb:  # the planner splits k across blocks only for too few row tiles
            assert -(-n // g.tile_rows) < 132
        assert p.smem == p.ks * p.stages * stage + red <= min(SMEM_PER_BLOCK, SMEM_PER_SM - 1024)
        tiles = -(-n // g.tile_rows)
        assert p.blocks <= tiles and -(-tiles // p.blocks) * (p.blocks - 1) < tiles  # no block without a tile
        if tune.ks:
            assert p.ks == tune.ks
        if tune.kb:
            assert p.kb == tune.kb
        if tune.stages and p.stages != tune.stages:  # only shrunk to fit, and never below 2
            assert 2 <= p.stages < tune.stages and p.ks * (p.stages + 1) * stage + red > SMEM_PER_BLOCK
        elif not tune.stages:
            assert p.stages >= 2


def test_no_split_k_before_hopper():
    """Thread block clusters need sm_90: on an older device the planner never splits k across blocks, and a
    Tune asking for it finds no plan (KernelError), where an H200's plan for the same shape does split."""
    import mtp_cupy
    dev = mtp_cupy.device("ref")
    n, k = 576, 7168                       # V3's kv_a: 36 row tiles
    assert ops.plan_gemv(dev, "w8a16_gemv", n, k).kb > 1
    dev.compute_capability = 80
    assert ops.plan_gemv(dev, "w8a16_gemv", n, k).kb == 1
    with pytest.raises(KernelError, match="no launch plan fits"):
        ops.plan_gemv(dev, "w8a16_gemv", n, k, Tune(kb=2))
    for bad in (Tune(kb=-1), Tune(ks=0), Tune(stages=-2), Tune(blocks=1.5)):   # a typed error, never an empty grid
        with pytest.raises(KernelError, match="every Tune field"):
            ops.plan_gemv(dev, "w8a16_gemv", n, k, bad)


def test_shape_errors(rng):
    import mtp_cupy
    dev = mtp_cupy.device("ref")
    w, x, y = dev.alloc(1 << 16), dev.alloc(1 << 12), dev.alloc(1 << 12)
    with pytest.raises(KernelError, match="multiple of 32"):
        ops.linear(dev, x.ptr, Linear("nvfp4", 4, 48, w.ptr, w.ptr), y.ptr)
    with pytest.raises(KernelError, match="16-byte aligned"):
        ops.linear(dev, x.ptr, Linear("bf16", 4, 64, w.ptr), y.ptr, m=2, x_stride=68)
    with pytest.raises(KernelError, match="16-byte aligned"):
        ops.linear(dev, x.ptr.offset(2), Linear("bf16", 4, 64, w.ptr), y.ptr)
    with pytest.raises(KernelError, match="m=65"):   # STREAM_MAX_M rows a launch
        ops.gemv_fp8w(dev, w.ptr, w.ptr, x.ptr, y.ptr, 65, 4, 64, 64, 4)
    with pytest.raises(KernelError, match="m 0"):
        ops.plan_gemv(dev, "dense_gemv_bf16_batch32", 64, 64, m=0)
    with pytest.raises(KernelError, match="scale pointer"):
        ops.linear(dev, x.ptr, Linear("fp8_row", 4, 64, w.ptr), y.ptr)
    with pytest.raises(KernelError, match="out_dtype"):
        ops.linear(dev, x.ptr, Linear("bf16", 4, 64, w.ptr), y.ptr, out_dtype="f16")


# -- CUDA against the twin at real model dims (the twin side stays in float64 chunks of <= 256 MB) ------

# (fmt, kernel, n, k, m, tune): real dims under plans the planner would not pick
REAL_PLANS = [("bf16", "dense_gemv_bf16", 7168, 14336, 1, Tune(ks=16, stages=8)),
              ("bf16", "dense_gemv_bf16", 4096, 2048, 1, Tune(ks=3, stages=2, blocks=100)),
              ("bf16", "dense_gemv_bf16_batchm", 7168, 14336, 8, Tune(ks=8, stages=6)),
              ("fp8_block", "w8a16_gemv", 2048, 7168, 8, Tune(ks=7, stages=3, blocks=50)),
              ("nvfp4", "w4a16_gemv", 7168, 2048, 1, Tune(ks=2, stages=8, warps_per_sm=4)),
              ("fp8_block", "w8a16_gemv_regs", 7168, 2048, 8, None), ("nvfp4", "w4a16_gemv_regs", 2048, 7168, 1, None),
              ("bf16", "dense_gemv_bf16_regs", 7168, 2048, 1, None),
              # split-K across a cluster's blocks at the V4 / V3 shapes it is for, and the planner's own pick
              ("fp8_block_e8m0", "w8a16_gemv_e8m0", 1024, 4096, 1, Tune(ks=8, kb=4)),
              ("fp8_block_e8m0", "w8a16_gemv_e8m0_batch32", 512, 4096, 20, Tune(ks=7, kb=8)),
              ("fp8_block", "w8a16_gemv", 576, 7168, 8, None), ("mxfp4", "w4a16_gemv_mx", 576, 7168, 3, Tune(kb=2)),
              ("bf16", "dense_gemv_bf16_batch32", 1536, 7168, 32, Tune(ks=4, kb=8))]


def run_raw(dev, fmt, name, n, k, m, arrays, scale2, x, tune):
    bufs = [up(dev, a) for a in arrays]
    xb, y = up(dev, x), out(dev, "bf16", (m, n))
    raw_gemv(dev, name, fmt, bufs, scale2, xb.ptr, y.ptr, m, n, k, k, n, "bf16", tune)
    return get(dev, y, "bf16", (m, n))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, name, n, k, m, tune", REAL_PLANS, ids=str)
def test_cuda_vs_twin_real_dims_plans(rng, fmt, name, n, k, m, tune):
    arrays, scale2, _ = make_weight(rng, fmt, n, k)
    x = bf16_bits(rng, (m, k), exp=126)
    ref, got = run_on_both(run_raw, fmt, name, n, k, m, arrays, scale2, x, tune)
    assert_close(got.astype(np.float64), ref.astype(np.float64), TOL["bf16"], f"{name} {m}x{n}x{k} {tune}")


REAL = [("bf16", 129280, 7168, 1, "f32"), ("bf16", 154880, 6144, 1, "f32"), ("bf16", 151936, 2048, 1, "f32"),
        ("bf16", 7168, 14336, 1, "bf16"), ("bf16", 4096, 2048, 1, "bf16"), ("bf16", 256, 7168, 1, "f32"),
        ("bf16", 7168, 14336, 8, "bf16"), ("bf16", 129280, 7168, 8, "f32"), ("bf16", 7168, 14336, 32, "bf16"),
        ("bf16", 7168, 2048, 300, "bf16")] + \
       [(f, n, k, m, "bf16") for f in FORMATS[1:] for n, k in ((7168, 2048), (2048, 7168)) for m in (1, 8)] + \
       [("nvfp4", 129280, 7168, 1, "f32"), ("fp8_block", 129280, 7168, 1, "f32"), ("mxfp4", 2048, 7168, 17, "bf16")]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, n, k, m, out_dtype", REAL)
def test_cuda_vs_twin_real_dims(rng, fmt, n, k, m, out_dtype):
    arrays, scale2, _ = make_weight(rng, fmt, n, k)
    x = bf16_bits(rng, (m, k), exp=126)
    ref, got = run_on_both(run_linear, fmt, n, k, m, arrays, scale2, x, out_dtype, k, n)
    assert_close(got.astype(np.float64), ref.astype(np.float64), TOL[out_dtype], f"{fmt} {m}x{n}x{k}")


@pytest.mark.gpu
def test_split_k_cluster_launch_with_and_without_pdl_and_in_a_graph(rng):
    """Split-K across a cluster's blocks (V4's wq_a shape, the planner's kb and a forced one): eager and
    captured, PDL on and off, the output poisoned before each run: all runs bit-identical and finite, and the
    forced plan within f32 accumulation of float64 (its own twin)."""
    pytest.importorskip("cupy")
    from mtp_cupy.runtime.cupy_backend import CupyBackend
    n, k, m = 1024, 4096, 3
    arrays, scale2, wd = make_weight(rng, "fp8_block_e8m0", n, k)
    x = bf16_bits(rng, (m, k), exp=126)
    want = x.astype(np.float64) @ wd().T
    for tune in (None, Tune(ks=4, kb=8)):
        outs = []
        for pdl in (False, True):
            dev = CupyBackend(pdl=pdl)
            assert tune or ops.plan_gemv(dev, "w8a16_gemv_e8m0", n, k).kb > 1  # the planner splits this shape
            bufs, xb, y = [up(dev, a) for a in arrays], up(dev, x), out(dev, "f32", (m, n))

            def run():
                raw_gemv(dev, "w8a16_gemv_e8m0", "fp8_block_e8m0", bufs, scale2, xb.ptr, y.ptr, m, n, k, k, n,
                         "f32", tune)
            stream = dev.new_stream()
            graph = dev.capture(run, stream)
            for graphed in (False, True, False, True):
                dev.fill(y.ptr, m * n * 4, POISON)
                dev.synchronize()
                if graphed:
                    dev.replay(graph, stream)
                    dev.synchronize(stream)
                else:
                    run()
                    dev.synchronize()
                outs.append(get(dev, y, "f32", (m, n)))
        for o in outs:
            assert np.array_equal(o.view(np.uint32), outs[0].view(np.uint32)), f"{tune}: runs differ"
        check(outs[0], want, "f32", n, f"w8a16_gemv_e8m0 {m}x{n}x{k} {tune}")
