"""Launcher for per-group GEMVs over row blocks of one weight matrix: cuda_src/grouped_gemv.cu (FMA, one x
row a block) and, given a group table, the tensor-core grouped_mma8_<fmt> / grouped_mma_<fmt> of
cuda_src/moe_mma.cu (each group's weight tile decoded once for 8 rows of x, or for 32 when m > 32).

Used by MLA (q absorption with W_UK^T per head, the W_UV up-projection read in place from kv_b_proj) and
DeepSeek-V4's grouped low-rank output projection (wo_a)."""
import numpy as np

from ..runtime.ptr import NULL
from ..weights.linear import Linear
from ._util import launch, need
from .moe import CHUNK, MAX_PAIRS, MMA8_ROWS, _check_rows, _mma_launch, item_rows

__all__ = ["grouped_gemv", "group_table", "upload_group_table"]

FORMATS = ("bf16", "fp8_block", "fp8_block_e8m0")  # both forms (kernels grouped_{gemv,mma8,mma}_<fmt>)

THREADS = 256
MAX_K = 12288  # x row staged in 48 KB of shared memory as fp32
RPT = 4        # rows each lane group carries at once (cuda_src/grouped_gemv.cu)


def lanes_per_row(k: int, fmt: str) -> int:
    """Lanes that read one row: the 16-byte loads in a row, rounded down to a power of two, at most 32."""
    loads = k // (8 if fmt == "bf16" else 16)
    return min(32, 1 << (max(loads, 1).bit_length() - 1))


def grouped_gemv(gpu, x, W: Linear, y, groups: int, n: int, row0: int = 0, group_rows: int | None = None,
                 x_group_stride: int | None = None, y_group_stride: int | None = None, m: int = 1,
                 x_row_stride: int | None = None, y_row_stride: int | None = None, out_dtype: str = "bf16",
                 stream=None, table=None, rows: int | None = None) -> None:
    """For g < groups, r < m, j < n:
        y[r*y_row_stride + g*y_group_stride + j] = sum_k W[row0 + g*group_rows + j, k] * x[r*x_row_stride + g*x_group_stride + k]

    `W` is the whole [W.n, W.k] matrix (bf16, fp8_block or fp8_block_e8m0; block scales are looked up by
    absolute row, so groups may start anywhere). x is bf16; y is bf16 or f32 (`out_dtype`). Strides are in
    elements; defaults: group_rows = n, x_group_stride = k, y_group_stride = n, and rows packed after
    all groups (x_row_stride = groups * x_group_stride, y_row_stride = groups * y_group_stride).

    `table`: a device copy of `group_table(W, groups, n, row0, group_rows)` (the same arguments; a buffer, its
    pointer, or None for the FMA form): the tensor-core form, grouped_mma8_<fmt> / grouped_mma_<fmt>, runs
    instead (x 16-byte aligned, its strides multiples of 8), in items of `rows` x rows: MMA8_ROWS or PLAN_ROWS
    (32: each decoded weight fragment feeds four mmas); None: 8 below m = ITEMS32_FROM, else 32. Each form gives
    a row the same bits whatever m and `rows` are (batch-invariant); the two forms differ in their sum order."""
    tab = NULL if table is None else getattr(table, "ptr", table)
    k = W.k
    rows = item_rows(m) if rows is None else rows
    _check_rows("grouped_gemv", rows)
    name = f"grouped_{('mma8' if rows == MMA8_ROWS else 'mma') if int(tab) else 'gemv'}_{W.fmt}"
    need(W.fmt in FORMATS, f"grouped_gemv: weight format {W.fmt!r} is not supported ({', '.join(FORMATS)}; "
         "dequantise other formats to bf16 at load)")
    group_rows = n if group_rows is None else group_rows
    xgs = k if x_group_stride is None else x_group_stride
    ygs = n if y_group_stride is None else y_group_stride
    xrs = groups * xgs if x_row_stride is None else x_row_stride
    yrs = groups * ygs if y_row_stride is None else y_row_stride
    need(groups >= 1 and m >= 1 and n >= 1, f"{name}: groups {groups}, m {m}, n {n} must be >= 1")
    need(row0 >= 0 and group_rows >= 0 and row0 + (groups - 1) * group_rows + n <= W.n,
         f"{name}: rows up to {row0 + (groups - 1) * group_rows + n} exceed the weight's {W.n}")
    vec = CHUNK[W.fmt]                          # elements per 16-byte load of a row
    need(k % vec == 0 and int(W.weight) % 16 == 0,
         f"{name}: k {k} must be a multiple of {vec} ({W.fmt} rows of whole 16-byte loads) and W 16-byte aligned")
    need(out_dtype in ("bf16", "f32"), f"{name}: out_dtype {out_dtype!r} is not bf16/f32")
    need(min(xgs, ygs, xrs, yrs) >= 0, f"{name}: negative stride")
    if int(tab):
        need(m * groups <= MAX_PAIRS and max(xgs, xrs, ygs, yrs) < 1 << 32,
             f"{name}: m * groups {m * groups} (at most {MAX_PAIRS}) or a stride out of range")
        need(int(x) % 16 == 0 and xgs % 8 == 0 and xrs % 8 == 0,
             f"{name}: x must be 16-byte aligned with strides in multiples of 8 elements")
        _mma_launch(gpu, name, W.fmt, n, k, 32, groups * -(-m // rows), rows).arg_ptr(tab) \
            .arg_u32(m).arg_u32(groups).arg_ptr(x).arg_u32(xrs).arg_u32(xgs).arg_ptr(y).arg_u32(yrs).arg_u32(ygs) \
            .arg_u32(out_dtype == "f32").arg_u32(n).arg_u32(k).launch(stream)
        return
    need(k <= MAX_K, f"{name}: k {k} > {MAX_K} (x is staged in shared memory)")
    lpr = lanes_per_row(k, W.fmt)
    block_rows = THREADS // 32 * (32 // lpr) * RPT
    L = launch(gpu, "grouped_gemv", name).grid(min(-(-n // block_rows), 65535), min(groups, 65535),
                                               min(m, 65535)).block(THREADS).shared(4 * k)
    L.arg_ptr(x).arg_ptr(W.weight)
    if W.fmt != "bf16":
        need(int(W.scale) != 0, f"{name}: NULL block scale")
        L.arg_ptr(W.scale)
    L.arg_ptr(y).arg_u32(groups).arg_u32(m).arg_u32(n).arg_u32(k).arg_u32(row0).arg_u32(group_rows)
    L.arg_u64(xgs).arg_u64(xrs).arg_u64(ygs).arg_u64(yrs).arg_u32(out_dtype == "f32").arg_u32(lpr).launch(stream)


def group_table(W: Linear, groups: int, n: int, row0: int = 0, group_rows: int | None = None):
    """u64 [groups, 3] rows for grouped_gemv's tensor-core form: the address of group g's first row (row0 + g *
    group_rows), of its 128-row scale block's scales (block formats) and that row's offset in the block; None
    where the form cannot take W (another format, k not whole 16-byte chunks, a group whose 16-row slabs would
    straddle a scale block, a misaligned row). Upload it once and pass it as `table`."""
    gr = n if group_rows is None else group_rows
    if W.fmt not in FORMATS or W.k % CHUNK[W.fmt] or groups < 1 or n < 1 or row0 < 0 or gr < 0 \
            or row0 + (groups - 1) * gr + n > W.n:
        return None
    es = 2 if W.fmt == "bf16" else 1
    kb, ss = (W.k + 127) // 128, (4 if W.fmt == "fp8_block" else 1)
    t = np.zeros((groups, 3), np.uint64)
    for g in range(groups):
        r = row0 + g * gr
        w = int(W.weight) + r * W.k * es
        if w % 16 or (W.fmt != "bf16" and r % 16):
            return None
        t[g] = (w, int(W.scale) + (r // 128) * kb * ss if W.fmt != "bf16" else 0, r % 128)
    return t


def upload_group_table(gpu, W: Linear, groups: int, n: int, row0: int = 0, group_rows: int | None = None):
    """group_table on the device (a buffer to keep and pass as grouped_gemv's `table`), or None where the
    tensor-core form cannot take W (grouped_gemv then runs its FMA form)."""
    t = group_table(W, groups, n, row0, group_rows)
    return None if t is None else gpu.upload(t)
