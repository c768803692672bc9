"""Launchers for cuda_src/norm_rope.cu: a projection's heads normed, RoPE'd and stored in one launch, each
bit-identical to the rms_norm_strided, rope and reshape_and_cache launches it replaces (one warp a head: the
thread count rms_norm_strided's launcher gives every dim <= 1024)."""
from ..runtime.ptr import NULL
from ._util import launch, need
from .rms_norm import _aligned, _threads

__all__ = ["norm_rope", "qk_norm_rope_cache"]

_SMEM_ELEMS = 1024   # the kernels' shared row


def _one_warp(name: str, what: str, dim: int) -> None:
    need(dim % 8 == 0 and 0 < dim <= _SMEM_ELEMS and _threads(name, dim) == 32,
         f"{name}: {what} {dim} must be a multiple of 8 in [8, {_SMEM_ELEMS}] (one warp a head)")


def norm_rope(gpu, x, x_row_stride, x_head_stride, rows, heads, w, norm_dim, width, eps, pos, pos_stride, inv_freq,
              rot_offset, rot_dim, interleaved, mscale=1.0, out=NULL, out_row_stride=0, out_head_stride=0,
              slots=NULL, slot_stride=0, cache=NULL, fp8_nope=0, bias=NULL, stream=None):
    """DeepSeek / GLM heads: for row r, head h of x (element r * x_row_stride + h * x_head_stride), y = [w * x * rms(x)
    over [0, norm_dim) (w NULL: no weight) | x over [norm_dim, width)], RoPE'd over [rot_offset, rot_offset +
    rot_dim) (interleaved GPT-J pairs or neox, cos / sin scaled by mscale) at the u32 position at pos + r *
    pos_stride bytes, then stored: into out[r, h] (strides in elements; out may be x) when `slots` is NULL, else
    (one head) into the cache row at the i64 slot at slots + r * slot_stride (negative: skipped), bf16 [width]
    rows, or the blocked fp8 rows of fp8_block_layout(width, fp8_nope) when fp8_nope > 0. MLA's latent row
    (norm_dim 512 of width 576), V4's kv row and V4's q heads (w NULL, in place). With `bias` the norm is
    layer_norm_bias's LayerNorm (w and bias required; kernel norm_rope_w_bias): GLM-5's DSA indexer key."""
    name = "norm_rope_w_bias" if bias else "norm_rope_w"
    need(not bias or bool(w), f"{name}: LayerNorm needs its weight")
    _one_warp(name, "norm_dim", norm_dim)
    need(width % 8 == 0 and norm_dim <= width <= _SMEM_ELEMS,
         f"{name}: width {width} must be a multiple of 8 in [norm_dim {norm_dim}, {_SMEM_ELEMS}]")
    need(rot_dim > 0 and rot_dim % 2 == 0 and rot_offset + rot_dim <= width,
         f"{name}: RoPE dims [{rot_offset}, {rot_offset + rot_dim}) must be an even count inside the row of {width}")
    need(rows > 0 and heads > 0, f"{name}: {rows} rows of {heads} heads")
    need(all(s % 8 == 0 for s in (x_row_stride, x_head_stride, out_row_stride, out_head_stride)),
         f"{name}: strides must be multiples of 8 elements (16-byte heads)")
    need(pos_stride % 4 == 0 and int(pos) % 4 == 0, f"{name}: positions must be 4-byte aligned (stride {pos_stride})")
    if slots:
        need(heads == 1 and bool(cache) and not out, f"{name}: a cache store takes one head a row and no out")
        need(slot_stride % 8 == 0 and int(slots) % 8 == 0, f"{name}: slots must be 8-byte aligned ({slot_stride})")
        need(fp8_nope == 0 or (0 < fp8_nope <= width and fp8_nope % 2 == 0),
             f"{name}: fp8_nope {fp8_nope} must be even, in (0, {width}]")
    else:
        need(bool(out) and not cache, f"{name}: give out, or slots and a cache")
    w = w or NULL
    _aligned(name, x, w, out, cache, bias or NULL)
    ln = launch(gpu, "norm_rope", name).grid(min(rows * heads, 1 << 14)).block(32).arg_ptr(x).arg_u32(x_row_stride) \
        .arg_u32(x_head_stride).arg_u32(rows).arg_u32(heads).arg_ptr(w)
    if bias:
        ln.arg_ptr(bias)
    ln.arg_u32(norm_dim).arg_u32(width).arg_f32(eps).arg_ptr(pos).arg_u32(pos_stride).arg_ptr(inv_freq) \
        .arg_u32(rot_offset).arg_u32(rot_dim).arg_u32(bool(interleaved)).arg_f32(mscale).arg_ptr(out or NULL).arg_u32(out_row_stride) \
        .arg_u32(out_head_stride).arg_ptr(slots or NULL).arg_u32(slot_stride).arg_ptr(cache or NULL) \
        .arg_u32(fp8_nope).launch(stream)


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
    _one_warp(name, "head dim", dim)
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
    launch(gpu, "norm_rope", name).grid(min(n, 1 << 14)).block(32).arg_ptr(x).arg_u32(x_row_stride) \
        .arg_u32(q_heads).arg_u32(q_head_stride).arg_u32(k_heads).arg_u32(k_off).arg_u32(v_off).arg_ptr(q_w) \
        .arg_ptr(k_w).arg_ptr(q_out).arg_u32(q_out_row_stride).arg_u32(rows).arg_u32(dim).arg_f32(eps).arg_ptr(pos) \
        .arg_u32(pos_stride).arg_ptr(inv_freq).arg_u32(rot_dim).arg_ptr(slots).arg_u32(slot_stride) \
        .arg_ptr(k_cache).arg_ptr(v_cache).arg_u32(kv_dtype == "fp8").arg_f32(kv_scale).launch(stream)
