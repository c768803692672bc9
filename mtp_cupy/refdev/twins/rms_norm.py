"""Twins of cuda_src/rms_norm.cu. Sums of squares are taken in float64 (geometry-independent; the kernel's
fp32 block sum differs by accumulation order only); everything after is the kernel's fp32 arithmetic."""
import numpy as np

from ...runtime.dtypes import BF16
from ..registry import twin
from ..access import strided
from .elementwise import gather_rows

F32 = np.float32


def _gain(dev, w, dim: int, unit_offset: bool) -> np.ndarray:
    if int(w) == 0:
        return np.ones(dim, F32)
    g = dev.view(w, BF16, dim).astype(F32)
    return F32(1) + g if unit_offset else g


def _rms_norm(x: np.ndarray, g: np.ndarray, eps: float) -> np.ndarray:
    """x float32 [..., dim] -> bf16 (x * r) * g, r = 1 / sqrt(mean(x^2) + eps)."""
    dim = x.shape[-1]
    ss = np.square(x, dtype=np.float64).sum(-1, keepdims=True).astype(F32)
    r = F32(1) / np.sqrt(ss / F32(dim) + F32(eps))
    return ((x * r) * g).astype(BF16)


@twin("rms_norm", "rms_norm_w")
def rms_norm_w(dev, x, w, y, rows, dim, eps):
    out = _rms_norm(dev.view(x, BF16, (rows, dim)).astype(F32), _gain(dev, w, dim, False), eps)
    dev.view(y, BF16, (rows, dim))[:] = out


@twin("rms_norm", "rms_norm_1pw")
def rms_norm_1pw(dev, x, w, y, rows, dim, eps):
    out = _rms_norm(dev.view(x, BF16, (rows, dim)).astype(F32), _gain(dev, w, dim, True), eps)
    dev.view(y, BF16, (rows, dim))[:] = out


def _add_rms_norm(dev, x, res, w, y, rows, dim, eps, unit_offset: bool) -> None:
    """x = bf16(x + res) (fp32 add, one rounding, as bf16_residual_add) written back, then y = norm of it."""
    xv = dev.view(x, BF16, (rows, dim))
    xv[:] = (xv.astype(F32) + dev.view(res, BF16, (rows, dim)).astype(F32)).astype(BF16)
    out = _rms_norm(xv.astype(F32), _gain(dev, w, dim, unit_offset), eps)
    dev.view(y, BF16, (rows, dim))[:] = out


@twin("rms_norm", "add_rms_norm_w")
def add_rms_norm_w(dev, x, res, w, y, rows, dim, eps):
    _add_rms_norm(dev, x, res, w, y, rows, dim, eps, False)


@twin("rms_norm", "add_rms_norm_1pw")
def add_rms_norm_1pw(dev, x, res, w, y, rows, dim, eps):
    _add_rms_norm(dev, x, res, w, y, rows, dim, eps, True)


def _rms_norm_strided(dev, x, w, y, rows, heads, dim, x_row_stride, x_head_stride, y_row_stride, y_head_stride,
                      eps, unit_offset: bool) -> None:
    xv = strided(dev, x, BF16, (rows, heads, dim), (x_row_stride, x_head_stride, 1)).astype(F32)
    out = _rms_norm(xv, _gain(dev, w, dim, unit_offset), eps)
    strided(dev, y, BF16, (rows, heads, dim), (y_row_stride, y_head_stride, 1))[:] = out


@twin("rms_norm", "rms_norm_strided_w")
def rms_norm_strided_w(dev, x, w, y, rows, heads, dim, x_row_stride, x_head_stride, y_row_stride, y_head_stride,
                       eps):
    _rms_norm_strided(dev, x, w, y, rows, heads, dim, x_row_stride, x_head_stride, y_row_stride, y_head_stride, eps,
                      False)


@twin("rms_norm", "rms_norm_strided_1pw")
def rms_norm_strided_1pw(dev, x, w, y, rows, heads, dim, x_row_stride, x_head_stride, y_row_stride, y_head_stride,
                         eps):
    _rms_norm_strided(dev, x, w, y, rows, heads, dim, x_row_stride, x_head_stride, y_row_stride, y_head_stride, eps,
                      True)


def _front_norms(dev, table, ids, ids_stride, vocab, ew, hidden, hw, e_out, e_stride, h_out, h_stride, m, h_rows,
                 dim, eps, unit_offset: bool) -> None:
    e = gather_rows(dev, table, ids, ids_stride, m, dim, vocab).astype(F32)
    h = dev.view(hidden, BF16, (h_rows, dim)).astype(F32)
    eo = _rms_norm(e, _gain(dev, ew, dim, unit_offset), eps)
    ho = _rms_norm(h, _gain(dev, hw, dim, unit_offset), eps)
    strided(dev, e_out, BF16, (m, dim), (e_stride, 1))[:] = eo
    strided(dev, h_out, BF16, (h_rows, dim), (h_stride, 1))[:] = ho


@twin("rms_norm", "front_norms_w")
def front_norms_w(dev, table, ids, ids_stride, vocab, ew, hidden, hw, e_out, e_stride, h_out, h_stride, m, h_rows,
                  dim, eps):
    _front_norms(dev, table, ids, ids_stride, vocab, ew, hidden, hw, e_out, e_stride, h_out, h_stride, m, h_rows,
                 dim, eps, False)


@twin("rms_norm", "front_norms_1pw")
def front_norms_1pw(dev, table, ids, ids_stride, vocab, ew, hidden, hw, e_out, e_stride, h_out, h_stride, m, h_rows,
                    dim, eps):
    _front_norms(dev, table, ids, ids_stride, vocab, ew, hidden, hw, e_out, e_stride, h_out, h_stride, m, h_rows,
                 dim, eps, True)


def _layer_norm(dev, xv: np.ndarray, w, b, eps: float) -> np.ndarray:
    """xv float32 [..., dim] -> bf16 ((x - mean) * rstd) * w + b (sums in float64, the rest the kernel's fp32)."""
    dim = xv.shape[-1]
    mean = xv.sum(-1, dtype=np.float64, keepdims=True).astype(F32) / F32(dim)
    d = xv - mean
    var = np.square(d, dtype=np.float64).sum(-1, keepdims=True).astype(F32) / F32(dim)
    rstd = F32(1) / np.sqrt(var + F32(eps))
    g, c = dev.view(w, BF16, dim).astype(F32), dev.view(b, BF16, dim).astype(F32)
    return ((d * rstd) * g + c).astype(BF16)


@twin("rms_norm", "layer_norm_w_bias")
def layer_norm_w_bias(dev, x, w, b, y, rows, dim, eps):
    dev.view(y, BF16, (rows, dim))[:] = _layer_norm(dev, dev.view(x, BF16, (rows, dim)).astype(F32), w, b, eps)
