"""Twins of cuda_src/grouped_gemv.cu: y[r, g, j] = sum_k W[row0 + g*group_rows + j, k] * x[r, g, k] over
arbitrary element strides; the weight is dequantised exactly (fp8 * block scale in fp32), the dot is
taken in float64 and rounded once to the output dtype."""
import numpy as np

from ...runtime.dtypes import BF16, E8M0, FP8
from ..registry import twin


def _offsets(m: int, groups: int, row_stride: int, group_stride: int) -> np.ndarray:
    return (np.arange(m, dtype=np.int64)[:, None] * row_stride
            + np.arange(groups, dtype=np.int64)[None, :] * group_stride)


def _products(dev, x, wg, y, groups, m, n, k, x_group_stride, x_row_stride, y_group_stride, y_row_stride, out_f32):
    """y[r, g] = wg[g] @ x[r, g] (wg f32 [groups, n, k]) in float64, rounded once to the output dtype."""
    base = _offsets(m, groups, x_row_stride, x_group_stride)
    xv = dev.view(x, BF16, int(base.max()) + k)
    xs = xv[base[..., None] + np.arange(k)].astype(np.float64)                # [m, G, k]
    out = np.einsum("mgk,gnk->mgn", xs, wg.astype(np.float64))
    yo = _offsets(m, groups, y_row_stride, y_group_stride)[..., None] + np.arange(n)
    yv = dev.view(y, np.float32 if out_f32 else BF16, int(yo.max()) + 1)
    yv[yo] = out.astype(np.float32).astype(yv.dtype)


def _run(dev, x, w_rows, y, groups, m, n, k, row0, group_rows, x_group_stride, x_row_stride, y_group_stride,
         y_row_stride, out_f32):
    rows = row0 + np.arange(groups, dtype=np.int64)[:, None] * group_rows + np.arange(n)  # [G, n]
    _products(dev, x, w_rows(int(rows.max()) + 1)[rows], y, groups, m, n, k, x_group_stride, x_row_stride,
              y_group_stride, y_row_stride, out_f32)


def _fp8_rows(dev, W, scale, k, sdt):
    kb = (k + 127) // 128

    def rows(nrows):
        q = dev.view(W, FP8, (nrows, k)).astype(np.float32)
        s = dev.view(scale, sdt, ((nrows + 127) // 128, kb)).astype(np.float32)
        return q * np.repeat(np.repeat(s, 128, axis=0), 128, axis=1)[:nrows, :k]
    return rows


@twin("grouped_gemv", "grouped_gemv_bf16")
def grouped_gemv_bf16(dev, x, W, y, groups, m, n, k, row0, group_rows, x_group_stride, x_row_stride,
                      y_group_stride, y_row_stride, out_f32, lpr):
    _run(dev, x, lambda nrows: dev.view(W, BF16, (nrows, k)).astype(np.float32), y, groups, m, n, k, row0,
         group_rows, x_group_stride, x_row_stride, y_group_stride, y_row_stride, out_f32)


@twin("grouped_gemv", "grouped_gemv_fp8_block")
def grouped_gemv_fp8_block(dev, x, W, scale, y, groups, m, n, k, row0, group_rows, x_group_stride, x_row_stride,
                           y_group_stride, y_row_stride, out_f32, lpr):
    _run(dev, x, _fp8_rows(dev, W, scale, k, np.float32), y, groups, m, n, k, row0, group_rows, x_group_stride,
         x_row_stride, y_group_stride, y_row_stride, out_f32)


@twin("grouped_gemv", "grouped_gemv_fp8_block_e8m0")
def grouped_gemv_fp8_block_e8m0(dev, x, W, scale, y, groups, m, n, k, row0, group_rows, x_group_stride,
                                x_row_stride, y_group_stride, y_row_stride, out_f32, lpr):
    _run(dev, x, _fp8_rows(dev, W, scale, k, E8M0), y, groups, m, n, k, row0, group_rows, x_group_stride,
         x_row_stride, y_group_stride, y_row_stride, out_f32)


# -- grouped_mma8_<fmt> / grouped_mma_<fmt> (cuda_src/moe_mma.cu): the same products, group g's weight from
# table entry g -------------------------------------------------------------------------------------------------
def _table_rows(dev, fmt, entry, n, k):
    """Group weight [n, k] f32 from a group_table row (first row's address, its scale block's scales, the row's
    offset in that block): the block's rows from its first, dequantised as the FMA form's twin does."""
    w, s, off = entry
    if fmt == "bf16":
        return dev.view(w, BF16, (n, k)).astype(np.float32)
    rows = _fp8_rows(dev, w - off * k, s, k, np.float32 if fmt == "fp8_block" else E8M0)
    return rows(off + n)[off:]


def _grouped_mma(fmt):
    def fn(dev, tab, m, groups, x, x_row_stride, x_group_stride, y, y_row_stride, y_group_stride, out_f32, N, K):
        t = dev.view(tab, np.uint64, (groups, 3)).tolist()
        wg = np.stack([_table_rows(dev, fmt, (int(a), int(b), int(c)), N, K) for a, b, c in t])   # [G, N, K]
        _products(dev, x, wg, y, groups, m, N, K, x_group_stride, x_row_stride, y_group_stride, y_row_stride,
                  out_f32)
    return fn


for _f in ("bf16", "fp8_block", "fp8_block_e8m0"):
    for _kind in ("mma8", "mma"):   # 8- and 32-row items: the same sums
        twin("moe_mma", f"grouped_{_kind}_{_f}")(_grouped_mma(_f))
