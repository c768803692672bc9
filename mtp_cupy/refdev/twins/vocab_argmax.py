"""Twins of cuda_src/vocab_argmax.cu: the lane / pair packing of a vocab-sharded argmax and its decoders."""
import numpy as np

from ...runtime.dtypes import BF16
from ..registry import twin


def _scalar(dev, ptr, dt):
    return dev.view(ptr, dt, 1)[0]


@twin("vocab_argmax", "pack_argmax_lanes")
def pack_argmax_lanes(dev, local_id, val, v0, rank, world, lanes):
    g = (int(v0) + int(_scalar(dev, local_id, np.int32))) & 0xFFFFFFFF
    v = np.zeros(4 * world, np.float32)
    v[rank] = _scalar(dev, val, np.float32)
    v[world + 3 * rank: world + 3 * rank + 3] = [(g >> (8 * d)) & 255 for d in range(3)]
    dev.view(lanes, BF16, 4 * world)[:] = v.astype(BF16)


@twin("vocab_argmax", "decode_argmax_lanes")
def decode_argmax_lanes(dev, lanes, world, out_id):
    v = dev.view(lanes, BF16, 4 * world).astype(np.float32)
    best = 0
    for r in range(1, world):
        if v[r] > v[best]:
            best = r
    d = v[world + 3 * best: world + 3 * best + 3].astype(np.int64)
    dev.view(out_id, np.int32, 1)[0] = d[0] + (d[1] << 8) + (d[2] << 16)


@twin("vocab_argmax", "pack_argmax_pair")
def pack_argmax_pair(dev, local_id, val, v0, pair):
    p = dev.view(pair, np.uint32, 2)
    p[0] = dev.view(val, np.uint32, 1)[0]
    p[1] = (int(v0) + int(_scalar(dev, local_id, np.int32))) & 0xFFFFFFFF


@twin("vocab_argmax", "decode_argmax_pairs")
def decode_argmax_pairs(dev, pairs, world, out_id):
    p = dev.view(pairs, np.uint32, (world, 2))
    vals = p[:, 0].copy().view(np.float32)
    best = 0
    for r in range(1, world):
        if vals[r] > vals[best]:
            best = r
    dev.view(out_id, np.uint32, 1)[0] = p[best, 1]


@twin("vocab_argmax", "widen_bf16_f32")
def widen_bf16_f32(dev, src, dst, n):
    dev.view(dst, np.float32, n)[:] = dev.view(src, BF16, n).astype(np.float32)
