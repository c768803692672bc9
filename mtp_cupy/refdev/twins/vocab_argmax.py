"""Twins of cuda_src/vocab_argmax.cu: the lane / pair packing of a vocab-sharded argmax and its decoders, for
`rows` sequences at once (row r's lanes at lanes + r * 4 * world, gathered pairs [world][rows][2])."""
import numpy as np

from ...runtime.dtypes import BF16
from ..registry import twin


@twin("vocab_argmax", "pack_argmax_lanes")
def pack_argmax_lanes(dev, local_id, val, v0, rank, world, lanes, rows):
    ids = dev.view(local_id, np.int32, rows).astype(np.int64)
    g = (int(v0) + ids) & 0xFFFFFFFF
    v = np.zeros((rows, 4 * world), np.float32)
    v[:, rank] = dev.view(val, np.float32, rows)
    for d in range(3):
        v[:, world + 3 * rank + d] = (g >> (8 * d)) & 255
    dev.view(lanes, BF16, rows * 4 * world)[:] = v.astype(BF16).reshape(-1)


def _first_max(vals: np.ndarray) -> int:
    best = 0
    for q in range(1, vals.size):
        if vals[q] > vals[best]:
            best = q
    return best


@twin("vocab_argmax", "decode_argmax_lanes")
def decode_argmax_lanes(dev, lanes, world, out_id, rows):
    v = dev.view(lanes, BF16, rows * 4 * world).astype(np.float32).reshape(rows, 4 * world)
    out = dev.view(out_id, np.int32, rows)
    for r in range(rows):
        best = _first_max(v[r, :world])
        d = v[r, world + 3 * best: world + 3 * best + 3].astype(np.int64)
        out[r] = d[0] + (d[1] << 8) + (d[2] << 16)


@twin("vocab_argmax", "pack_argmax_pair")
def pack_argmax_pair(dev, local_id, val, v0, pair, rows):
    p = dev.view(pair, np.uint32, 2 * rows).reshape(rows, 2)
    p[:, 0] = dev.view(val, np.uint32, rows)
    p[:, 1] = (int(v0) + dev.view(local_id, np.int32, rows).astype(np.int64)) & 0xFFFFFFFF


@twin("vocab_argmax", "decode_argmax_pairs")
def decode_argmax_pairs(dev, pairs, world, out_id, rows):
    p = dev.view(pairs, np.uint32, world * rows * 2).reshape(world, rows, 2)
    out = dev.view(out_id, np.uint32, rows)
    for r in range(rows):
        best = _first_max(p[:, r, 0].copy().view(np.float32))
        out[r] = p[best, r, 1]


@twin("vocab_argmax", "widen_bf16_f32")
def widen_bf16_f32(dev, src, dst, n):
    dev.view(dst, np.float32, n)[:] = dev.view(src, BF16, n).astype(np.float32)
