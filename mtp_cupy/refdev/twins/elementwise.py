"""Twins of cuda_src/elementwise.cu."""
import numpy as np

from ...runtime.dtypes import BF16
from ..registry import twin
from ..access import row_scalars, strided  # noqa: F401  (re-exported for older twin imports)

F32 = np.float32


def _f32(a) -> np.ndarray:
    return np.asarray(a).astype(F32)


def _sigmoid(g: np.ndarray) -> np.ndarray:
    """The kernel's 1 / (1 + expf(-g)) in fp32; expf overflowing to inf gives 0, as on the device."""
    with np.errstate(over="ignore"):
        return F32(1) / (F32(1) + np.exp(-g))


@twin("elementwise", "bf16_residual_add")
def bf16_residual_add(dev, x, r, n):
    xv = dev.view(x, BF16, n)
    xv[:] = (xv.astype(F32) + dev.view(r, BF16, n).astype(F32)).astype(BF16)


@twin("elementwise", "bf16_concat")
def bf16_concat(dev, a, b, out, rows, na, nb):
    o = dev.view(out, BF16, (rows, na + nb))
    o[:, :na] = dev.view(a, BF16, (rows, na))
    o[:, na:] = dev.view(b, BF16, (rows, nb))


@twin("elementwise", "sigmoid_gate_mul")
def sigmoid_gate_mul(dev, x, gate, out, rows, heads, dim, gate_row_stride, gate_head_stride):
    g = _f32(strided(dev, gate, BF16, (rows, heads, dim), (gate_row_stride, gate_head_stride, 1)))
    y = (_f32(dev.view(x, BF16, (rows, heads, dim))) * _sigmoid(g)).astype(BF16)
    dev.view(out, BF16, (rows, heads, dim))[:] = y


@twin("elementwise", "silu_mul")
def silu_mul(dev, g, u, out, rows, n, g_stride, u_stride, limit):
    gv = _f32(strided(dev, g, BF16, (rows, n), (g_stride, 1)))
    uv = _f32(strided(dev, u, BF16, (rows, n), (u_stride, 1)))
    lim = F32(limit)
    if lim > 0:  # fminf/fmaxf semantics: a NaN operand yields the other one
        gv = np.fmin(gv, lim)
        uv = np.fmin(np.fmax(uv, -lim), lim)
    dev.view(out, BF16, (rows, n))[:] = ((gv * _sigmoid(gv)) * uv).astype(BF16)


def gather_rows(dev, table, ids, ids_stride, rows, dim, vocab) -> np.ndarray:
    """bf16 [rows, dim]: table[ids[r]] for the i32 ids at ids + r * ids_stride bytes, a zero row for an id outside
    [0, vocab) (embed_rows; rms_norm.cu's front_norms gathers alike)."""
    idx = row_scalars(dev, ids, "i32", rows, ids_stride).astype(np.int64)
    ok = (idx >= 0) & (idx < vocab)
    o = np.zeros((rows, dim), BF16)
    if ok.any():
        o[ok] = dev.view(table, BF16, (vocab, dim))[idx[ok]]
    return o


def _embed(dev, table, ids, ids_stride, out, rows, dim, vocab):
    dev.view(out, BF16, (rows, dim))[:] = gather_rows(dev, table, ids, ids_stride, rows, dim, vocab)


@twin("elementwise", "embed_rows")
def embed_rows(dev, table, ids, ids_stride, out, rows, dim, vocab):
    _embed(dev, table, ids, ids_stride, out, rows, dim, vocab)


@twin("elementwise", "embed_from_argmax")
def embed_from_argmax(dev, table, ids, ids_stride, out, rows, dim, vocab):
    _embed(dev, table, ids, ids_stride, out, rows, dim, vocab)


@twin("elementwise", "scale_add")
def scale_add(dev, y, x, alpha, n):
    yv = dev.view(y, BF16, n)
    yv[:] = (_f32(yv) + F32(alpha) * _f32(dev.view(x, BF16, n))).astype(BF16)
