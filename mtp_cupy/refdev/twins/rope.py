"""Twin of cuda_src/rope.cu: the same fp32 angle and products; sin/cos are taken in float64 and rounded to
fp32 (the kernel's accurate sincosf is within 2 ulp of that)."""
import numpy as np

from ...runtime.dtypes import BF16
from ..registry import twin
from ..access import row_scalars, strided

F32 = np.float32


def rotate(dev, o: np.ndarray, v: np.ndarray, p: np.ndarray, inv_freq, interleaved: bool, mscale: float = 1.0,
           inverse: bool = False) -> None:
    """o [rows, heads, rot_dim] (bf16; may be v) = the rotation of bf16 v at u32 positions p [rows]: pairs (2i, 2i + 1)
    when interleaved, else (i, i + rot_dim / 2); v is read whole before o is written."""
    half = v.shape[-1] // 2
    theta = (p.astype(F32)[:, None] * dev.view(inv_freq, "f32", half)[None, :]).astype(np.float64)
    c = np.cos(theta).astype(F32)[:, None, :] * F32(mscale)
    s = np.sin(theta).astype(F32)[:, None, :] * F32(mscale)
    if inverse:
        s = -s
    ia, ib = (slice(0, None, 2), slice(1, None, 2)) if interleaved else (slice(0, half), slice(half, None))
    a, b = v[..., ia].astype(F32), v[..., ib].astype(F32)
    o[..., ia], o[..., ib] = (a * c - b * s).astype(BF16), (b * c + a * s).astype(BF16)


@twin("rope", "rope")
def rope(dev, x, out, pos, pos_stride, rows, heads, rot_dim, rot_offset, row_stride, head_stride, out_offset,
         out_row_stride, out_head_stride, inv_freq, interleaved, mscale, inverse):
    v = strided(dev, x.offset(2 * rot_offset), BF16, (rows, heads, rot_dim), (row_stride, head_stride, 1))
    o = strided(dev, out.offset(2 * out_offset), BF16, (rows, heads, rot_dim), (out_row_stride, out_head_stride, 1))
    rotate(dev, o, v, row_scalars(dev, pos, "u32", rows, pos_stride), inv_freq, interleaved, mscale, inverse)
