"""grouped_gemv, both forms (the FMA kernels; with a group table, the tensor-core grouped_mma8 kernels), against
float64 textbook math (exact dequantisation), each row against its own one-row call, and CUDA against the twin."""
import numpy as np
import pytest

from mtp_cupy import ops
from mtp_cupy.errors import KernelError
from mtp_cupy.runtime.dtypes import BF16
from mtp_cupy.weights import quant_host as qh
from mtp_cupy.weights.linear import Linear
from helpers import assert_close, f32, out, up

FMTS = ["bf16", "fp8_block", "fp8_block_e8m0"]


def make_weight(dev, rng, fmt, rows, k, scale=0.1):
    """(Linear, float64 dequantised matrix, buffers to keep alive)."""
    w = rng.standard_normal((rows, k)).astype(np.float32) * scale
    if fmt == "bf16":
        q = w.astype(BF16)
        bufs = [up(dev, q)]
        return Linear(fmt, rows, k, bufs[0].ptr, owners=bufs), f32(q).astype(np.float64)
    quant = qh.quant_fp8_block if fmt == "fp8_block" else qh.quant_fp8_block_e8m0
    q, s = quant(w)
    bufs = [up(dev, q), up(dev, s)]
    return Linear(fmt, rows, k, bufs[0].ptr, bufs[1].ptr, owners=bufs), qh.dequant_fp8_block(q, s).astype(np.float64)


def textbook(x, wd, groups, m, n, k, row0, group_rows, xgs, xrs):
    y = np.zeros((m, groups, n))
    for r in range(m):
        for g in range(groups):
            xv = x[r * xrs + g * xgs: r * xrs + g * xgs + k].astype(np.float64)
            y[r, g] = wd[row0 + g * group_rows: row0 + g * group_rows + n] @ xv
    return y


# (groups, n, k, row0, group_rows, m, x_group_stride, y_group_stride): plain packed groups; W_UV read in
# place from a fused kv_b-like matrix (rows h*(dn+dv) + dn); q_b's rope rows with one shared x
# (x_group_stride 0) written into a wider row (MLA's Q = [q_abs | q_pe]); several input rows.
CASES = [(4, 64, 32, 0, None, 1, None, None),
         (4, 32, 64, 32, 64, 1, 64, 32),
         (3, 16, 64, 32, 48, 2, 0, 80),
         (2, 40, 144, 0, None, 3, None, None)]


def run_textbook(dev, rng, fmt, case, out_dtype, tensor_cores):
    """One CASES / MMA_CASES case through grouped_gemv (with a group table: the tensor-core form) against the
    float64 textbook, row gaps in x and y, the unaddressed elements still poisoned."""
    groups, n, k, row0, group_rows, m, xgs, ygs = case
    gr = n if group_rows is None else group_rows
    xgs_, ygs_ = (k if xgs is None else xgs), (n if ygs is None else ygs)
    xrs, yrs = groups * xgs_ + 8, groups * ygs_ + 8   # row gaps: only the addressed elements are touched
    W, wd = make_weight(dev, rng, fmt, row0 + (groups - 1) * gr + n + 5, k)
    tab = _table(dev, W, groups, n, row0, group_rows) if tensor_cores else None
    xh = rng.standard_normal(m * xrs + k).astype(BF16)
    x = up(dev, xh)
    yn = (m - 1) * yrs + (groups - 1) * ygs_ + n + 8
    y = out(dev, out_dtype, yn)
    ops.grouped_gemv(dev, x.ptr, W, y.ptr, groups, n, row0=row0, group_rows=group_rows, x_group_stride=xgs,
                     y_group_stride=ygs, m=m, x_row_stride=xrs, y_row_stride=yrs, out_dtype=out_dtype, table=tab)
    got = dev.read(y.ptr, out_dtype, yn)
    ref = textbook(xh, wd, groups, m, n, k, row0, gr, xgs_, xrs)
    idx = (np.arange(m)[:, None, None] * yrs + np.arange(groups)[None, :, None] * ygs_ + np.arange(n)).reshape(-1)
    assert_close(f32(got[idx]), ref.reshape(-1), 4e-3 if out_dtype == "bf16" else 1e-5)
    mask = np.ones(yn, bool)
    mask[idx] = False
    assert np.isnan(f32(got[mask])).all(), "wrote outside the addressed elements"


def _table(dev, W, groups, n, row0, group_rows):
    t = ops.group_table(W, groups, n, row0, group_rows)
    assert t is not None
    return up(dev, t)


def test_grouped_gemv_errors(ref, rng):
    W, _ = make_weight(ref, rng, "bf16", 64, 32)
    x, y = up(ref, np.zeros(128, BF16)), out(ref, "bf16", 256)
    with pytest.raises(KernelError, match="exceed"):
        ops.grouped_gemv(ref, x.ptr, W, y.ptr, groups=3, n=32)
    bad = Linear("nvfp4", 64, 32, W.weight, W.weight)
    with pytest.raises(KernelError, match="dequantise"):
        ops.grouped_gemv(ref, x.ptr, bad, y.ptr, groups=1, n=8)
    odd = Linear("bf16", 64, 20, W.weight)                   # bf16 rows: whole 16-byte loads of 8
    with pytest.raises(KernelError, match="multiple of 8"):
        ops.grouped_gemv(ref, x.ptr, odd, y.ptr, groups=1, n=8)
    odd8 = Linear("fp8_block", 64, 24, W.weight, W.weight)   # fp8 rows: of 16
    with pytest.raises(KernelError, match="multiple of 16"):
        ops.grouped_gemv(ref, x.ptr, odd8, y.ptr, groups=1, n=8)


# Real dims: V3 absorption (W_UK^T [128 heads, 512, 128]), W_UV in place in kv_b_proj [32768, 512]
# (rows h*256 + 128), V4 wo_a (8 groups of [1024, 4096]).
REAL = [("bf16", 128, 512, 128, 0, None), ("fp8_block", 128, 512, 128, 0, None),
        ("fp8_block", 128, 128, 512, 128, 256), ("fp8_block_e8m0", 8, 1024, 4096, 0, None)]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,groups,n,k,row0,group_rows", REAL)
def test_grouped_gemv_cuda_vs_twin(ref, cuda, rng, fmt, groups, n, k, row0, group_rows):
    gr = n if group_rows is None else group_rows
    rows = row0 + (groups - 1) * gr + n
    seed = int(rng.integers(1 << 30))
    xh = rng.standard_normal(groups * k).astype(BF16)
    res = []
    for dev in (ref, cuda):
        W, _ = make_weight(dev, np.random.default_rng(seed), fmt, rows, k)
        x, y = up(dev, xh), out(dev, "f32", groups * n)
        ops.grouped_gemv(dev, x.ptr, W, y.ptr, groups, n, row0=row0, group_rows=group_rows, out_dtype="f32")
        res.append(dev.read(y.ptr, "f32", groups * n))
    assert_close(res[1], res[0].astype(np.float64), 1e-4)


# -- the tensor-core form (group table) ------------------------------------------------------------------
# (groups, n, k, row0, group_rows, m, x_group_stride, y_group_stride): CASES' shapes whose groups start on
# 16-row slabs, a GLM-5-like W_UV (row0 192, group_rows 448: groups start mid scale block and run into the
# next), partial tiles (n 40, 24), k of one partial 128-unit (144, 192), 1 / 3 / 9 / 17 rows (items of 8: full
# and partial).
MMA_CASES = [(4, 64, 32, 0, None, 1, None, None),
             (4, 32, 64, 32, 64, 3, 64, 32),
             (3, 16, 64, 32, 48, 2, 0, 80),
             (2, 40, 144, 0, 48, 9, None, None),
             (3, 128, 128, 192, 448, 17, None, None),
             (5, 24, 192, 16, 32, 9, 200, 40)]


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("tensor_cores,case", [(False, c) for c in CASES] + [(True, c) for c in MMA_CASES])
@pytest.mark.parametrize("out_dtype", ["bf16", "f32"])
def test_grouped_gemv_textbook(dev, rng, fmt, tensor_cores, case, out_dtype):
    run_textbook(dev, rng, fmt, case, out_dtype, tensor_cores)


def test_group_table(ref, rng):
    """The table's rows by definition; None where the tensor-core form cannot take the weight."""
    W, _ = make_weight(ref, rng, "fp8_block", 1152, 128)
    t = ops.group_table(W, 3, 64, 192, 448)
    starts = [192, 640, 1088]
    assert t[:, 0].tolist() == [int(W.weight) + r * 128 for r in starts]
    assert t[:, 1].tolist() == [int(W.scale) + (r // 128) * 4 for r in starts]   # kb = 1 f32 scale a block
    assert t[:, 2].tolist() == [r % 128 for r in starts]
    assert ops.group_table(W, 3, 64, 200, 448) is None                        # a slab across a scale block
    assert ops.group_table(W, 3, 64, 192, 480) is None                        # rows past the weight's
    Wb, _ = make_weight(ref, rng, "bf16", 64, 40)
    assert ops.group_table(Wb, 2, 16, 0, 24) is not None
    assert ops.group_table(Linear("nvfp4", 64, 32, Wb.weight, Wb.weight), 1, 8) is None


def test_grouped_mma_errors(ref, rng):
    W, _ = make_weight(ref, rng, "bf16", 64, 32)
    tab = _table(ref, W, 2, 32, 0, None)
    x, y = up(ref, np.zeros(256, BF16)), out(ref, "bf16", 256)
    before = ref.read(y.ptr, "bf16", 256)
    with pytest.raises(KernelError, match="multiples of 8"):
        ops.grouped_gemv(ref, x.ptr, W, y.ptr, 2, 32, x_group_stride=36, table=tab.ptr)
    with pytest.raises(KernelError, match="16-byte aligned"):
        ops.grouped_gemv(ref, x.ptr.offset(2), W, y.ptr, 2, 32, table=tab.ptr)
    with pytest.raises(KernelError, match="out_dtype"):
        ops.grouped_gemv(ref, x.ptr, W, y.ptr, 2, 32, out_dtype="f16", table=tab.ptr)
    with pytest.raises(KernelError, match="not supported"):
        ops.grouped_gemv(ref, x.ptr, Linear("nvfp4", 64, 32, W.weight, W.weight), y.ptr, 1, 8, table=tab.ptr)
    assert np.array_equal(ref.read(y.ptr, "bf16", 256).view(np.uint16), before.view(np.uint16))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,groups,n,k,row0,group_rows", REAL + [("fp8_block", 64, 256, 512, 192, 448)])
def test_grouped_mma_cuda_vs_twin(ref, cuda, rng, fmt, groups, n, k, row0, group_rows):
    """Real dims (and GLM-5's W_UV: 64 heads, rows h*448 + 192), m = 1 and 64, bf16 out as the layers use it."""
    gr = n if group_rows is None else group_rows
    rows = row0 + (groups - 1) * gr + n
    seed = int(rng.integers(1 << 30))
    for m in (1, 64):
        xh = rng.standard_normal(m * groups * k).astype(BF16)
        res = []
        for dev in (ref, cuda):
            W, _ = make_weight(dev, np.random.default_rng(seed), fmt, rows, k)
            tab = _table(dev, W, groups, n, row0, group_rows)
            x, y = up(dev, xh), out(dev, "bf16", m * groups * n)
            ops.grouped_gemv(dev, x.ptr, W, y.ptr, groups, n, row0=row0, group_rows=group_rows, m=m, table=tab.ptr)
            res.append(f32(dev.read(y.ptr, "bf16", m * groups * n)))
        assert np.isfinite(res[1]).all()
        assert_close(res[1], res[0].astype(np.float64), 1e-2, f"m {m}")


@pytest.mark.gpu
@pytest.mark.parametrize("m,rows", [(2, None), (9, None), (64, None), (33, None), (64, 8), (5, 32)])
@pytest.mark.parametrize("fmt,groups,n,k,row0,group_rows", REAL[1:])
def test_grouped_mma_rows_bit_identical(cuda, rng, fmt, groups, n, k, row0, group_rows, m, rows):
    """An m-row call, in 8- or 32-row items (`rows`; None: the launcher's choice), gives each row the bits of its
    own m = 1 call (batch-invariant drafting); real dims, outputs poisoned."""
    gr = n if group_rows is None else group_rows
    W, _ = make_weight(cuda, rng, fmt, row0 + (groups - 1) * gr + n, k)
    tab = _table(cuda, W, groups, n, row0, group_rows)
    xh = rng.standard_normal(m * groups * k).astype(BF16)
    x, y = up(cuda, xh), out(cuda, "f32", m * groups * n)
    ops.grouped_gemv(cuda, x.ptr, W, y.ptr, groups, n, row0=row0, group_rows=group_rows, m=m, out_dtype="f32",
                     table=tab.ptr, rows=rows)
    got = cuda.read(y.ptr, "f32", m * groups * n).reshape(m, -1)
    assert np.isfinite(got).all()
    for r in range(m):
        xr, yr = up(cuda, xh[r * groups * k:(r + 1) * groups * k]), out(cuda, "f32", groups * n)
        ops.grouped_gemv(cuda, xr.ptr, W, yr.ptr, groups, n, row0=row0, group_rows=group_rows, out_dtype="f32",
                         table=tab.ptr)
        assert np.array_equal(cuda.read(yr.ptr, "f32", groups * n), got[r]), f"row {r} of {m}"


def test_grouped_mma_items_by_width(rng):
    """The tensor-core form runs 8-row items up to m = 32 and 32-row items past it (each decoded weight fragment
    feeds four mmas), or what `rows` asks; a `rows` of neither size is refused before anything launches."""
    from helpers import BranchLog
    dev = BranchLog()
    W, _ = make_weight(dev, rng, "fp8_block_e8m0", 256, 256)
    tab = _table(dev, W, 2, 128, 0, None)
    x, y = up(dev, rng.standard_normal(64 * 512).astype(BF16)), out(dev, "bf16", 64 * 256)
    for m, rows, want in ((1, None, "grouped_mma8_"), (32, None, "grouped_mma8_"), (33, None, "grouped_mma_"),
                          (64, None, "grouped_mma_"), (64, 8, "grouped_mma8_"), (2, 32, "grouped_mma_")):
        dev.log.clear()
        ops.grouped_gemv(dev, x.ptr, W, y.ptr, 2, 128, m=m, table=tab.ptr, rows=rows)
        assert [n for n, _ in dev.log] == [want + "fp8_block_e8m0"], (m, rows, dev.log)
    dev.log.clear()
    with pytest.raises(KernelError, match="rows 16"):
        ops.grouped_gemv(dev, x.ptr, W, y.ptr, 2, 128, m=4, table=tab.ptr, rows=16)
    assert dev.log == []


@pytest.mark.parametrize("fam", ["deepseek_v3", "glm5", "deepseek_v4"])
def test_layers_take_the_tensor_core_form(ref, fam):
    """The embedded models' MLA (W_UK^T, W_UV) and V4 (wo_a) layers built their group tables: a weight layout
    that group_table refuses would silently fall back to the FMA form (W re-read for every batch row)."""
    import mtp_cupy
    from mtp_cupy.layers.mla import MlaAttention
    from mtp_cupy.layers.v4_attention import V4Attention
    p = mtp_cupy.load_proposer(mtp_cupy.EMBEDDED[fam], gpu=ref, max_seq_len=64, max_drafts=1)
    found, seen, todo = [], set(), [p]
    while todo:   # the proposer's object graph, a few levels deep
        o = todo.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, (MlaAttention, V4Attention)):
            found.append(o)
            continue
        for v in getattr(o, "__dict__", {}).values():
            todo.extend(v if isinstance(v, (list, tuple)) else [v] if hasattr(v, "__dict__") else [])
    assert found, f"{fam}: no attention layer found"
    for a in found:
        tabs = [a._uk_tab, a._uv_tab] if isinstance(a, MlaAttention) else [a._wo_a_tab]
        assert all(t is not None for t in tabs), f"{fam}: {type(a).__name__} runs the FMA form"
