"""Twins of cuda_src/argmax.cu: exact argmax (ties to the lowest id, NaN below every number, -0.0 == +0.0),
float64 top-1 log-prob. The workspace is the kernels' scratch; the twins leave it alone."""
import numpy as np

from ...runtime.dtypes import BF16
from ..registry import twin

NAN = np.float32("nan")


def _row(dev, x, r, row_stride, n, is_bf16):
    dt = BF16 if is_bf16 else np.dtype(np.float32)
    return dev.view(x.offset(r * row_stride * dt.itemsize), dt, n).astype(np.float64)


def _pick(v, allowed=None):
    """(id, value) of the row's max among the allowed ids; (None, -inf) when none is allowed."""
    ids = np.arange(v.size) if allowed is None else np.flatnonzero(allowed)
    if ids.size == 0:
        return None, -np.inf
    w = v[ids]
    num = ~np.isnan(w)
    if not num.any():
        return int(ids[0]), np.nan
    m = w[num].max()
    return int(ids[np.flatnonzero(w == m)[0]]), m + 0.0  # + 0.0: -0.0 reads as +0.0


def _top1_logprob(v):
    f = v[v > -np.inf]  # NaN and -inf add nothing
    if f.size == 0 or not np.isfinite(f.max()):
        return NAN
    return np.float32(-np.log(np.exp(f - f.max()).sum()))


def _argmax(dev, x, n, rows, row_stride, out_id, out_val, out_lp, is_bf16):
    for r in range(rows):
        v = _row(dev, x, r, row_stride, n, is_bf16)
        i, m = _pick(v)
        dev.view(out_id.offset(4 * r), np.int32, 1)[0] = i
        if out_val:
            dev.view(out_val.offset(4 * r), np.float32, 1)[0] = m
        if out_lp:
            dev.view(out_lp.offset(4 * r), np.float32, 1)[0] = _top1_logprob(v)


@twin("argmax", "argmax_bf16")
def argmax_bf16(dev, x, n, out_id, out_val, ws):
    _argmax(dev, x, n, 1, 0, out_id, out_val, 0, True)


@twin("argmax", "argmax_f32")
def argmax_f32(dev, x, n, out_id, out_val, ws):
    _argmax(dev, x, n, 1, 0, out_id, out_val, 0, False)


@twin("argmax", "argmax_bf16_batch")
def argmax_bf16_batch(dev, x, n, rows, row_stride, out_id, out_val, ws):
    _argmax(dev, x, n, rows, row_stride, out_id, out_val, 0, True)


@twin("argmax", "argmax_f32_batch")
def argmax_f32_batch(dev, x, n, rows, row_stride, out_id, out_val, ws):
    _argmax(dev, x, n, rows, row_stride, out_id, out_val, 0, False)


@twin("argmax", "argmax_bf16_batch_lp")
def argmax_bf16_batch_lp(dev, x, n, rows, row_stride, out_id, out_val, out_lp, ws):
    _argmax(dev, x, n, rows, row_stride, out_id, out_val, out_lp, True)


@twin("argmax", "argmax_f32_batch_lp")
def argmax_f32_batch_lp(dev, x, n, rows, row_stride, out_id, out_val, out_lp, ws):
    _argmax(dev, x, n, rows, row_stride, out_id, out_val, out_lp, False)


@twin("argmax", "argmax_bitmask")
def argmax_bitmask(dev, x, is_bf16, n, rows, row_stride, mask, mask_row_words, out_id, out_flag, out_val, ws):
    t = np.arange(n)
    for r in range(rows):
        words = dev.view(mask.offset(4 * r * mask_row_words), np.uint32, (n + 31) // 32)
        allowed = (words[t >> 5] >> (t & 31).astype(np.uint32)) & 1 == 1
        i, m = _pick(_row(dev, x, r, row_stride, n, is_bf16), allowed)
        dev.view(out_id.offset(4 * r), np.int32, 1)[0] = 0 if i is None else i
        dev.view(out_flag.offset(4 * r), np.int32, 1)[0] = i is None
        if out_val:
            dev.view(out_val.offset(4 * r), np.float32, 1)[0] = m
