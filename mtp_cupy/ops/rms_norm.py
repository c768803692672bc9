"""Launchers for cuda_src/rms_norm.cu: one block per row (or per (row, head)), the row held in registers.

Kernel names end with the weight convention: `_w` (g = w, or 1 when w is NULL), `_1pw` (g = 1 + w, what
`unit_offset=True` picks), `_w_bias` (LayerNorm: w then + b).

Threads per block: VECS_PER_THREAD 16-byte vectors each by default (fewer warps = a shorter reduction), a
whole number of warps; `threads=` overrides it (scripts/bench_kernels.py --sweep)."""
from ..runtime.ptr import NULL
from ._util import launch, need

__all__ = ["rms_norm", "add_rms_norm", "rms_norm_strided", "front_norms", "layer_norm_bias"]

MAXV = 4  # 16-byte vectors per thread at most, as in rms_norm.cu
VECS_PER_THREAD = 4


def _threads(name: str, dim: int, max_threads: int = 1024, threads: int | None = None) -> int:
    """VECS_PER_THREAD 16-byte vectors per thread (or `threads`), a whole number of warps; raises when the
    row cannot fit."""
    need(dim > 0 and dim % 8 == 0, f"{name}: dim {dim} must be a positive multiple of 8")
    need(dim <= MAXV * 8 * max_threads, f"{name}: dim {dim} > {MAXV * 8 * max_threads}")
    nvec = dim // 8
    least = max(32, -(-nvec // (MAXV * 32)) * 32)  # the fewest threads that hold the row
    if threads is not None:
        need(threads % 32 == 0 and least <= threads <= max_threads,
             f"{name}: threads={threads} must be a multiple of 32 in [{least}, {max_threads}] for dim {dim}")
        return int(threads)
    return min(max_threads, max(least, -(-nvec // (VECS_PER_THREAD * 32)) * 32))


def _aligned(name: str, *ptrs) -> None:
    for p in ptrs:
        need(int(p) % 16 == 0, f"{name}: pointer 0x{int(p):x} is not 16-byte aligned")


def rms_norm(gpu, x, w, y, rows, dim, eps, unit_offset=False, stream=None, threads=None):
    """y[r] = g * x[r] * rms(x[r]) over contiguous [rows, dim]; g = 1 + w (unit_offset, Qwen3-Next), w
    (DeepSeek/GLM) or 1 when w is NULL. x may equal y."""
    name = "rms_norm_1pw" if unit_offset else "rms_norm_w"
    w = w or NULL
    t = _threads(name, dim, threads=threads)
    _aligned(name, x, w, y)
    launch(gpu, "rms_norm", name).grid(rows).block(t).arg_ptr(x).arg_ptr(w).arg_ptr(y) \
        .arg_u32(rows).arg_u32(dim).arg_f32(eps).launch(stream)


def add_rms_norm(gpu, x, res, w, y, rows, dim, eps, unit_offset=False, stream=None, threads=None):
    """x[r] = bf16(x[r] + res[r]) in place, then y[r] = rms_norm of that row (g as in rms_norm): one launch,
    bit-identical to bf16_residual_add then rms_norm (same threads per block, hence the same sum order).
    x may not be y (x keeps the sum); res may be neither. dim <= 16384 (at most 512 threads)."""
    name = "add_rms_norm_1pw" if unit_offset else "add_rms_norm_w"
    w = w or NULL
    t = _threads(name, dim, max_threads=512, threads=threads)
    need(int(res) != 0, f"{name}: res is required")
    need(int(x) != int(y), f"{name}: x may not be y (x keeps the residual sum)")
    need(int(res) != int(x) and int(res) != int(y), f"{name}: res may not be x or y")
    _aligned(name, x, res, w, y)
    launch(gpu, "rms_norm", name).grid(rows).block(t).arg_ptr(x).arg_ptr(res).arg_ptr(w).arg_ptr(y) \
        .arg_u32(rows).arg_u32(dim).arg_f32(eps).launch(stream)


def rms_norm_strided(gpu, x, w, y, rows, heads, dim, x_row_stride, x_head_stride, y_row_stride, y_head_stride,
                     eps, unit_offset=False, stream=None):
    """Per-head RMSNorm of x[r, h, :dim] (strides in elements) into y; w NULL = no weight (V4's q scaling)."""
    name = "rms_norm_strided_1pw" if unit_offset else "rms_norm_strided_w"
    w = w or NULL
    t = _threads(name, dim)
    _aligned(name, x, w, y)
    need(all(s % 8 == 0 for s in (x_row_stride, x_head_stride, y_row_stride, y_head_stride)),
         f"{name}: strides must be multiples of 8 elements (16-byte rows)")
    launch(gpu, "rms_norm", name).grid(rows * heads).block(t).arg_ptr(x).arg_ptr(w) \
        .arg_ptr(y).arg_u32(rows).arg_u32(heads).arg_u32(dim).arg_u32(x_row_stride).arg_u32(x_head_stride) \
        .arg_u32(y_row_stride).arg_u32(y_head_stride).arg_f32(eps).launch(stream)


def front_norms(gpu, table, ids, vocab, ew, hidden, hw, e_out, e_stride, h_out, h_stride, m, h_rows, dim, eps,
                unit_offset=False, ids_stride=4, stream=None):
    """The MTP front's norms in one launch: e_out[r] (row stride e_stride elements) = norm with ew of table[ids[r]]
    (bf16 [vocab, dim]; a zero row for an id outside [0, vocab)) for r < m, and h_out[r] (stride h_stride) = norm
    with hw of the contiguous hidden rows [h_rows, dim]. The bits of embed_rows then two rms_norm_strided."""
    name = "front_norms_1pw" if unit_offset else "front_norms_w"
    t = _threads(name, dim)
    need(int(ew) != 0 and int(hw) != 0, f"{name}: both norm weights are required")
    need(vocab > 0 and m >= 1 and h_rows >= 1, f"{name}: vocab {vocab}, m {m} and h_rows {h_rows} must be positive")
    need(ids_stride % 4 == 0 and int(ids) % 4 == 0, f"{name}: ids must be 4-byte aligned (stride {ids_stride})")
    need(e_stride >= dim and h_stride >= dim and e_stride % 8 == 0 and h_stride % 8 == 0,
         f"{name}: row strides {e_stride}, {h_stride} must be multiples of 8 elements, at least dim {dim}")
    _aligned(name, table, ew, hidden, hw, e_out, h_out)
    launch(gpu, "rms_norm", name).grid(m + h_rows).block(t).arg_ptr(table).arg_ptr(ids).arg_u32(ids_stride) \
        .arg_u32(vocab).arg_ptr(ew).arg_ptr(hidden).arg_ptr(hw).arg_ptr(e_out).arg_u32(e_stride).arg_ptr(h_out) \
        .arg_u32(h_stride).arg_u32(m).arg_u32(h_rows).arg_u32(dim).arg_f32(eps).launch(stream)


def layer_norm_bias(gpu, x, w, b, y, rows, dim, eps, stream=None):
    """y = LayerNorm(x) * w + b over contiguous [rows, dim] (the DSA indexer k_norm, eps 1e-6)."""
    name = "layer_norm_w_bias"
    t = _threads(name, dim, max_threads=512)
    need(int(w) != 0 and int(b) != 0, f"{name}: w and b are required")
    _aligned(name, x, w, b, y)
    launch(gpu, "rms_norm", name).grid(rows).block(t).arg_ptr(x).arg_ptr(w).arg_ptr(b).arg_ptr(y) \
        .arg_u32(rows).arg_u32(dim).arg_f32(eps).launch(stream)

