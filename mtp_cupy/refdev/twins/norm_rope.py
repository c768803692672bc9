"""Twins of cuda_src/norm_rope.cu: the rms_norm_strided, rope and reshape_and_cache twins' arithmetic, chained as
the kernels chain the launches they replace."""
import numpy as np

from ...runtime.dtypes import BF16, FP8
from ..access import row_scalars, strided
from ..registry import twin
from .kv_cache import encode_fp8_blocks, fp8_quotient, put_rows
from .rms_norm import _gain, _layer_norm, _rms_norm
from .rope import rotate

F32 = np.float32


def _norm_rope(dev, x, x_row_stride, x_head_stride, rows, heads, norm, norm_dim, width, pos, pos_stride, inv_freq,
               rot_offset, rot_dim, interleaved, mscale, out, out_row_stride, out_head_stride, slots, slot_stride,
               cache, fp8_nope) -> None:
    """`norm` maps float32 [..., norm_dim] to its bf16 normed values (RMSNorm or LayerNorm)."""
    xv = strided(dev, x, BF16, (rows, heads, width), (x_row_stride, x_head_stride, 1))
    y = xv.copy()
    y[..., :norm_dim] = norm(xv[..., :norm_dim].astype(F32))
    r = y[..., rot_offset:rot_offset + rot_dim]
    rotate(dev, r, r, row_scalars(dev, pos, "u32", rows, pos_stride), inv_freq, bool(interleaved), mscale)
    if not int(slots):
        strided(dev, out, BF16, (rows, heads, width), (out_row_stride, out_head_stride, 1))[:] = y
    elif fp8_nope:
        rb = encode_fp8_blocks(y[:, 0], width, fp8_nope)
        put_rows(dev, rb, slots, slot_stride, cache, rb.shape[1], 0, np.dtype(np.uint8), lambda s: s)
    else:
        put_rows(dev, y[:, 0], slots, slot_stride, cache, width, 0, BF16, lambda s: s)


@twin("norm_rope", "norm_rope_w")
def norm_rope_w(dev, x, x_row_stride, x_head_stride, rows, heads, w, norm_dim, width, eps, pos, pos_stride, inv_freq,
                rot_offset, rot_dim, interleaved, mscale, out, out_row_stride, out_head_stride, slots, slot_stride,
                cache, fp8_nope):
    _norm_rope(dev, x, x_row_stride, x_head_stride, rows, heads,
               lambda v: _rms_norm(v, _gain(dev, w, norm_dim, False), eps), norm_dim, width, pos, pos_stride, inv_freq,
               rot_offset, rot_dim, interleaved, mscale, out, out_row_stride, out_head_stride, slots, slot_stride,
               cache, fp8_nope)


@twin("norm_rope", "norm_rope_w_bias")
def norm_rope_w_bias(dev, x, x_row_stride, x_head_stride, rows, heads, w, b, norm_dim, width, eps, pos, pos_stride,
                     inv_freq, rot_offset, rot_dim, interleaved, mscale, out, out_row_stride, out_head_stride, slots,
                     slot_stride, cache, fp8_nope):
    _norm_rope(dev, x, x_row_stride, x_head_stride, rows, heads, lambda v: _layer_norm(dev, v, w, b, eps), norm_dim,
               width, pos, pos_stride, inv_freq, rot_offset, rot_dim, interleaved, mscale, out, out_row_stride,
               out_head_stride, slots, slot_stride, cache, fp8_nope)


@twin("norm_rope", "qk_norm_rope_cache_1pw")
def qk_norm_rope_cache_1pw(dev, x, x_row_stride, q_heads, q_head_stride, k_heads, k_off, v_off, q_w, k_w, q_out,
                           q_out_row_stride, rows, dim, eps, pos, pos_stride, inv_freq, rot_dim, slots, slot_stride,
                           k_cache, v_cache, fp8, kv_scale):
    """rms_norm_strided_1pw, rope (neox over [0, rot_dim)) and reshape_and_cache[_fp8], as the kernel chains them."""
    p = row_scalars(dev, pos, "u32", rows, pos_stride)

    def normed_rotated(at, heads, head_stride, w):
        v = _rms_norm(strided(dev, at, BF16, (rows, heads, dim), (x_row_stride, head_stride, 1)).astype(F32),
                      _gain(dev, w, dim, True), eps)
        rotate(dev, v[..., :rot_dim], v[..., :rot_dim], p, inv_freq, False)
        return v

    if q_heads:
        strided(dev, q_out, BF16, (rows, q_heads, dim), (q_out_row_stride, dim, 1))[:] = \
            normed_rotated(x, q_heads, q_head_stride, q_w)
    dt, conv = (FP8, fp8_quotient(kv_scale)) if fp8 else (BF16, lambda s: s)
    w = k_heads * dim
    k = normed_rotated(x.offset(2 * k_off), k_heads, dim, k_w).reshape(rows, w)
    put_rows(dev, k, slots, slot_stride, k_cache, w, 0, dt, conv)
    put_rows(dev, strided(dev, x.offset(2 * v_off), BF16, (rows, w), (x_row_stride, 1)), slots, slot_stride, v_cache,
             w, 0, dt, conv)
