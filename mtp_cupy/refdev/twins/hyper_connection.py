"""Twins of cuda_src/hyper_connection.cu (mHC). Dot products and sums of squares are taken in float64 per
chunk (the kernel's fp32 block sums differ by accumulation order only); the coefficient math after the
reduction is the kernel's fp32 arithmetic, Sinkhorn sums in index order."""
import numpy as np

from ...runtime.dtypes import BF16
from ..registry import twin
from .rms_norm import _gain, _rms_norm

F32 = np.float32


def _sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # exp(-x) = inf gives the right 0
        return F32(1) / (F32(1) + np.exp(-x))


def _mixes(dev, part, rows: int, mix: int, nsplit: int, n_elems: int, rms_eps: float) -> np.ndarray:
    """[rows, mix]: the chunk partials summed in chunk order (as the kernel), times the folded RMS factor."""
    p = dev.view(part, np.float32, (nsplit, rows, mix + 1))
    raw = np.zeros((rows, mix + 1), F32)
    for s in range(nsplit):
        raw += p[s]
    rinv = F32(1) / np.sqrt(raw[:, mix:] / F32(n_elems) + F32(rms_eps))
    return raw[:, :mix] * rinv


def _stream_sum(dev, X, w: np.ndarray, rows: int, dim: int, hc: int) -> np.ndarray:
    """bf16 [rows, dim]: sum_j w[r, j] X[r, j] in fp32 (j in order), one bf16 rounding."""
    xv = dev.view(X, BF16, (rows, hc, dim)).astype(F32)
    acc = np.zeros((rows, dim), F32)
    for j in range(hc):
        acc += w[:, j, None] * xv[:, j]
    return acc.astype(BF16)


def sinkhorn(logits: np.ndarray, eps: float, iters: int) -> np.ndarray:
    """[..., hc, hc]: C = softmax_k(L) + eps; C /= colsum + eps; then (iters - 1) x (rows, then columns), fp32;
    each division as a multiply by the correctly rounded reciprocal, as the kernel does."""
    c = logits.astype(F32)
    e = np.exp(c - c.max(axis=-1, keepdims=True))
    c = e * (F32(1) / _sum(e, -1)) + F32(eps)          # x * (1 / d): the kernel's reciprocal-then-multiply
    c = c * (F32(1) / (_sum(c, -2) + F32(eps)))
    for _ in range(int(iters) - 1):
        c = c * (F32(1) / (_sum(c, -1) + F32(eps)))
        c = c * (F32(1) / (_sum(c, -2) + F32(eps)))
    return c


def _sum(c: np.ndarray, axis: int) -> np.ndarray:
    """Sum over the last (-1) or second-last (-2) axis as the kernel's shuffles add, keeping dims: the hc <= 4
    entries padded with zeros to four, then (c0 + c1) + (c2 + c3)."""
    part = (lambda t: c[..., t:t + 1]) if axis == -1 else (lambda t: c[..., t:t + 1, :])
    zero = np.zeros_like(part(0))
    p = [part(t) if t < c.shape[axis] else zero for t in range(4)]
    return (p[0] + p[1]) + (p[2] + p[3])


def _mix(dev, X, fn, part, rows, dim, hc, mix, chunk) -> None:
    k = hc * dim
    x = dev.view(X, BF16, (rows, k)).astype(np.float64)
    w = dev.view(fn, np.float32, (mix, k)).astype(np.float64)
    nsplit = -(-k // chunk)
    out = dev.view(part, np.float32, (nsplit, rows, mix + 1))
    for s in range(nsplit):
        xs, ws = x[:, s * chunk:(s + 1) * chunk], w[:, s * chunk:(s + 1) * chunk]
        out[s, :, :mix] = (xs @ ws.T).astype(F32)
        out[s, :, mix] = np.square(xs).sum(1).astype(F32)


@twin("hyper_connection", "hc_mix")
def hc_mix(dev, X, fn, part, rows, dim, hc, mix, chunk, rpb):   # rpb: rows a block takes (geometry only)
    _mix(dev, X, fn, part, rows, dim, hc, mix, chunk)


@twin("hyper_connection", "hc_add_mix")
def hc_add_mix(dev, X, src, src_hc, e, fn, part, rows, dim, hc, mix, chunk, rpb):
    s = dev.view(src, BF16, (rows, src_hc, dim)).astype(F32)
    dev.view(X, BF16, (rows, hc, dim))[:] = (s + dev.view(e, BF16, (rows, dim)).astype(F32)[:, None, :]).astype(BF16)
    _mix(dev, X, fn, part, rows, dim, hc, mix, chunk)


def _pre(dev, part, scale, base, post_out, comb_out, rows, dim, hc, nsplit, rms_eps, hc_eps, iters) -> np.ndarray:
    """hc_pre's coefficients: writes post and comb (iters None: the comb's Sinkhorn logits, as hc_pre_norm),
    returns pre [rows, hc]."""
    mix = (2 + hc) * hc
    s = dev.view(scale, np.float32, 3)
    b = dev.view(base, np.float32, mix)
    m = _mixes(dev, part, rows, mix, nsplit, hc * dim, rms_eps)
    dev.view(post_out, np.float32, (rows, hc))[:] = F32(2) * _sigmoid(m[:, hc:2 * hc] * s[1] + b[hc:2 * hc])
    logits = (m[:, 2 * hc:] * s[2] + b[2 * hc:]).reshape(rows, hc, hc)
    dev.view(comb_out, np.float32, (rows, hc, hc))[:] = logits if iters is None else sinkhorn(logits, hc_eps, iters)
    return _sigmoid(m[:, :hc] * s[0] + b[:hc]) + F32(hc_eps)


def _head_pre(dev, part, scale, base, rows, dim, hc, nsplit, rms_eps, hc_eps) -> np.ndarray:
    s = dev.view(scale, np.float32, 1)
    b = dev.view(base, np.float32, hc)
    return _sigmoid(_mixes(dev, part, rows, hc, nsplit, hc * dim, rms_eps) * s[0] + b) + F32(hc_eps)


@twin("hyper_connection", "hc_pre")
def hc_pre(dev, X, part, scale, base, x_out, post_out, comb_out, rows, dim, hc, nsplit, rms_eps, hc_eps, iters):
    pre = _pre(dev, part, scale, base, post_out, comb_out, rows, dim, hc, nsplit, rms_eps, hc_eps, iters)
    dev.view(x_out, BF16, (rows, dim))[:] = _stream_sum(dev, X, pre, rows, dim, hc)


@twin("hyper_connection", "hc_head")
def hc_head(dev, X, part, scale, base, y, rows, dim, hc, nsplit, rms_eps, hc_eps):
    pre = _head_pre(dev, part, scale, base, rows, dim, hc, nsplit, rms_eps, hc_eps)
    dev.view(y, BF16, (rows, dim))[:] = _stream_sum(dev, X, pre, rows, dim, hc)


@twin("hyper_connection", "hc_pre_norm")
def hc_pre_norm(dev, X, part, scale, base, w, y, post_out, logit_out, rows, dim, hc, nsplit, rms_eps, hc_eps,
                norm_eps):
    pre = _pre(dev, part, scale, base, post_out, logit_out, rows, dim, hc, nsplit, rms_eps, hc_eps, None)
    x = _stream_sum(dev, X, pre, rows, dim, hc).astype(F32)
    dev.view(y, BF16, (rows, dim))[:] = _rms_norm(x, _gain(dev, w, dim, False), norm_eps)


@twin("hyper_connection", "hc_head_norm")
def hc_head_norm(dev, X, part, scale, base, w, y, rows, dim, hc, nsplit, rms_eps, hc_eps, norm_eps):
    pre = _head_pre(dev, part, scale, base, rows, dim, hc, nsplit, rms_eps, hc_eps)
    x = _stream_sum(dev, X, pre, rows, dim, hc).astype(F32)
    dev.view(y, BF16, (rows, dim))[:] = _rms_norm(x, _gain(dev, w, dim, False), norm_eps)


@twin("hyper_connection", "hc_post")
def hc_post(dev, f, X, post, comb, Y, rows, dim, hc, hc_eps, iters):
    fv = dev.view(f, BF16, (rows, dim)).astype(F32)
    xv = dev.view(X, BF16, (rows, hc, dim)).astype(F32)
    p = dev.view(post, np.float32, (rows, hc))
    c = dev.view(comb, np.float32, (rows, hc, hc))
    if iters:   # comb holds hc_pre_norm's logits
        c = sinkhorn(c, hc_eps, iters)
    y = np.empty((rows, hc, dim), F32)
    for k in range(hc):
        acc = p[:, k, None] * fv
        for j in range(hc):
            acc = acc + c[:, j, k, None] * xv[:, j]
        y[:, k] = acc
    dev.view(Y, BF16, (rows, hc, dim))[:] = y.astype(BF16)


@twin("hyper_connection", "hc_expand")
def hc_expand(dev, x, out, rows, dim, hc):
    xv = dev.view(x, BF16, (rows, dim)).copy()
    dev.view(out, BF16, (rows, hc, dim))[:] = xv[:, None, :]


@twin("hyper_connection", "hc_add")
def hc_add(dev, X, x, rows, dim, hc):
    xv = dev.view(X, BF16, (rows, hc, dim))
    xv[:] = (xv.astype(F32) + dev.view(x, BF16, (rows, dim)).astype(F32)[:, None, :]).astype(BF16)
