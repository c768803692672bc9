"""Launchers for cuda_src/rms_norm.cu: one block per row (or per (row, head)), the row held in registers.

Kernel names end with the weight convention: `_w` (g = w, or 1 when w is NULL), `_1pw` (g = 1 + w, what
`unit_offset=True` picks), `_w_bias` (LayerNorm: w then + b).

Threads per block: VECS_PER_THREAD 16-byte vectors each by default (fewer warps = a shorter reduction), a
whole number of warps; `threads=` overrides it (scripts/bench_kernels.py --sweep)."""
from ..runtime.ptr import NULL
from ._util import launch, need

__all__ = ["rms_norm", "add_rms_norm", "rms_norm_strided", "layer_norm_bias", "qk_norm_rope_cache"]

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


def layer_norm_bias(gpu, x, w, b, y, rows, dim, eps, stream=None):
    """y = LayerNorm(x) * w + b over contiguous [rows, dim] (the DSA indexer k_norm, eps 1e-6)."""
    name = "layer_norm_w_bias"
    t = _threads(name, dim, max_threads=512)
    need(int(w) != 0 and int(b) != 0, f"{name}: w and b are required")
    _aligned(name, x, w, b, y)
    launch(gpu, "rms_norm", name).grid(rows).block(t).arg_ptr(x).arg_ptr(w).arg_ptr(b).arg_ptr(y) \
        .arg_u32(rows).arg_u32(dim).arg_f32(eps).launch(stream)


def qk_norm_rope_cache(gpu, x, x_row_stride, q_heads, q_head_stride, k_heads, k_off, v_off, q_w, k_w, q_out,
                       q_out_row_stride, rows, dim, eps, pos, pos_stride, inv_freq, rot_dim, slots, slot_stride,
                       k_cache, v_cache, kv_dtype="bf16", kv_scale=1.0, stream=None):
    """Qwen3-Next's heads after the qkv projection, one launch: for each of `rows` rows of x (strides in
    elements), q head h (at h * q_head_stride) normed by (1 + q_w) and RoPE'd into q_out[r, h]; k head h (at
    k_off + h * dim) normed by (1 + k_w), RoPE'd and stored in k_cache row slots[r]; v head h (at v_off + h * dim)
    stored in v_cache row slots[r]. RoPE: neox pairs over dims [0, rot_dim) at the u32 position at
    pos + r * pos_stride bytes (`inv_freq` f32 [rot_dim / 2]); slots i64 at slots + r * slot_stride (negative:
    the row's cache writes are skipped); a cache row is k_heads * dim elements of `kv_dtype` ("bf16", or "fp8":
    e4m3(x / kv_scale)). Bit-identical to rms_norm_strided(unit_offset=True), rope and reshape_and_cache in
    turn. x is only read; q_heads may be 0 (prefill rows: K and V only)."""
    name = "qk_norm_rope_cache_1pw"
    need(_threads(name, dim) == 32 and dim <= 1024,
         f"{name}: head dim {dim} must be a multiple of 8 of at most 1024 (one warp a head, as rms_norm_strided)")
    need(rot_dim > 0 and rot_dim % 2 == 0 and rot_dim <= dim, f"{name}: rot_dim {rot_dim} must be even, in (0, {dim}]")
    need(k_heads > 0 and rows > 0, f"{name}: {rows} rows of {k_heads} k heads")
    need(kv_dtype in ("bf16", "fp8"), f"{name}: kv_dtype {kv_dtype!r} is not bf16 or fp8")
    need(kv_dtype == "bf16" or kv_scale > 0, f"{name}: fp8 scale {kv_scale} must be positive")
    need(all(s % 8 == 0 for s in (x_row_stride, q_head_stride, k_off, v_off, q_out_row_stride)),
         f"{name}: strides and offsets must be multiples of 8 elements (16-byte heads)")
    need(pos_stride % 4 == 0 and int(pos) % 4 == 0 and slot_stride % 8 == 0 and int(slots) % 8 == 0,
         f"{name}: positions must be 4-byte and slots 8-byte aligned (strides {pos_stride}, {slot_stride})")
    q_w, k_w = q_w or NULL, k_w or NULL
    _aligned(name, x, q_w, k_w, q_out, k_cache, v_cache)
    n = rows * (q_heads + 2 * k_heads)
    launch(gpu, "rms_norm", name).grid(min(n, 1 << 14)).block(32).arg_ptr(x).arg_u32(x_row_stride) \
        .arg_u32(q_heads).arg_u32(q_head_stride).arg_u32(k_heads).arg_u32(k_off).arg_u32(v_off).arg_ptr(q_w) \
        .arg_ptr(k_w).arg_ptr(q_out).arg_u32(q_out_row_stride).arg_u32(rows).arg_u32(dim).arg_f32(eps).arg_ptr(pos) \
        .arg_u32(pos_stride).arg_ptr(inv_freq).arg_u32(rot_dim).arg_ptr(slots).arg_u32(slot_stride) \
        .arg_ptr(k_cache).arg_ptr(v_cache).arg_u32(kv_dtype == "fp8").arg_f32(kv_scale).launch(stream)
