"""Launcher for cuda_src/rope.cu (frequency tables: mtp_cupy/layers/rope_tables.py)."""
from ._util import THREADS, blocks_for, launch, need

__all__ = ["rope"]


def rope(gpu, x, pos, pos_stride, rows, heads, head_dim, rot_dim, rot_offset, row_stride, head_stride, inv_freq,
         interleaved, mscale=1.0, inverse=False, stream=None, out=None, out_offset=0, out_row_stride=None,
         out_head_stride=None):
    """RoPE on dims [rot_offset, rot_offset + rot_dim) of each head x[r, h] (element
    r * row_stride + h * head_stride); positions are u32 at `pos + r * pos_stride` bytes; `inv_freq` is a
    device f32 [rot_dim / 2]. interleaved: GPT-J pairs (2i, 2i+1), else neox (i, i + rot_dim/2). cos/sin
    are scaled by mscale; inverse rotates by -theta.

    In place by default; with `out` the rotated dims are written to out[r, h, out_offset:out_offset + rot_dim]
    (element r * out_row_stride + h * out_head_stride, strides defaulting to x's) and x is only read (MLA:
    q_b's rope rows rotated straight into Q)."""
    need(rot_dim > 0 and rot_dim % 2 == 0, f"rope: rot_dim {rot_dim} must be positive and even")
    need(rot_offset + rot_dim <= head_dim,
         f"rope: dims [{rot_offset}, {rot_offset + rot_dim}) exceed head_dim {head_dim}")
    need(pos_stride % 4 == 0 and int(pos) % 4 == 0, f"rope: positions must be 4-byte aligned (stride {pos_stride})")
    n = rows * heads * (rot_dim // 2)
    need(n < 1 << 31, f"rope: {n} pairs is out of range (< 2^31)")
    if out is None:
        out, out_offset = x, rot_offset
    ors = row_stride if out_row_stride is None else out_row_stride
    ohs = head_stride if out_head_stride is None else out_head_stride
    need(min(out_offset, ors, ohs) >= 0, f"rope: negative out offset / strides ({out_offset}, {ors}, {ohs})")
    launch(gpu, "rope", "rope").grid(blocks_for(n)).block(THREADS).arg_ptr(x).arg_ptr(out).arg_ptr(pos) \
        .arg_u32(pos_stride).arg_u32(rows).arg_u32(heads).arg_u32(rot_dim).arg_u32(rot_offset).arg_u32(row_stride) \
        .arg_u32(head_stride).arg_u32(out_offset).arg_u32(ors).arg_u32(ohs).arg_ptr(inv_freq) \
        .arg_u32(bool(interleaved)).arg_f32(mscale).arg_u32(bool(inverse)).launch(stream)
