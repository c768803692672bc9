"""Launchers for cuda_src/elementwise.cu."""
from ._util import THREADS, blocks_for, launch, need

__all__ = ["bf16_residual_add", "bf16_concat", "sigmoid_gate_mul", "silu_mul", "embed_rows", "embed_from_argmax",
           "scale_add"]

_MAX_N = 1 << 31  # flat u32 indices with a grid-stride loop


def _flat(name: str, n: int) -> int:
    need(0 <= n < _MAX_N, f"{name}: {n} elements is out of range (< 2^31)")
    return blocks_for(n)


def bf16_residual_add(gpu, x, r, n, stream=None):
    """x += r over n bf16 elements (in place)."""
    launch(gpu, "elementwise", "bf16_residual_add").grid(_flat("bf16_residual_add", n)).block(THREADS) \
        .arg_ptr(x).arg_ptr(r).arg_u32(n).launch(stream)


def bf16_concat(gpu, a, b, out, rows, na, nb, stream=None):
    """out[r] = [a[r, :na] | b[r, :nb]] (contiguous rows, bit-exact)."""
    launch(gpu, "elementwise", "bf16_concat").grid(rows).block(THREADS) \
        .arg_ptr(a).arg_ptr(b).arg_ptr(out).arg_u32(rows).arg_u32(na).arg_u32(nb).launch(stream)


def sigmoid_gate_mul(gpu, x, gate, out, rows, heads, dim, gate_row_stride, gate_head_stride, stream=None):
    """out[r, h, d] = x[r, h, d] * sigmoid(gate[r * gate_row_stride + h * gate_head_stride + d]) (strides in
    elements; x, out contiguous; out may be x)."""
    launch(gpu, "elementwise", "sigmoid_gate_mul").grid(_flat("sigmoid_gate_mul", rows * heads * dim)) \
        .block(THREADS).arg_ptr(x).arg_ptr(gate).arg_ptr(out).arg_u32(rows).arg_u32(heads).arg_u32(dim) \
        .arg_u32(gate_row_stride).arg_u32(gate_head_stride).launch(stream)


def silu_mul(gpu, g, u, out, rows, n, g_stride, u_stride, limit=0.0, stream=None):
    """out[r, :n] = silu(g[r]) * u[r]; with limit > 0, silu(min(g, limit)) * clamp(u, -limit, limit)."""
    launch(gpu, "elementwise", "silu_mul").grid(_flat("silu_mul", rows * n)).block(THREADS) \
        .arg_ptr(g).arg_ptr(u).arg_ptr(out).arg_u32(rows).arg_u32(n).arg_u32(g_stride).arg_u32(u_stride) \
        .arg_f32(limit).launch(stream)


def _embed(gpu, kernel, table, ids, out, rows, dim, ids_stride, vocab, stream):
    need(ids_stride % 4 == 0 and int(ids) % 4 == 0, f"{kernel}: ids must be 4-byte aligned (stride {ids_stride})")
    need(vocab > 0 and dim > 0, f"{kernel}: vocab {vocab} and dim {dim} must be positive")
    launch(gpu, "elementwise", kernel).grid(rows).block(THREADS).arg_ptr(table).arg_ptr(ids).arg_u32(ids_stride) \
        .arg_ptr(out).arg_u32(rows).arg_u32(dim).arg_u32(vocab).launch(stream)


def embed_rows(gpu, table, ids, out, rows, dim, ids_stride=4, *, vocab, stream=None):
    """out[r] = table[ids[r]] for the i32 ids at `ids + r * ids_stride` bytes; table is bf16 [vocab, dim];
    an id outside [0, vocab) gives a zero row."""
    _embed(gpu, "embed_rows", table, ids, out, rows, dim, ids_stride, vocab, stream)


def embed_from_argmax(gpu, table, ids, out, dim, rows=1, ids_stride=4, *, vocab, stream=None):
    """embed_rows on the ids an argmax kernel wrote on the device: the next draft step's embedding without a
    host round trip."""
    _embed(gpu, "embed_from_argmax", table, ids, out, rows, dim, ids_stride, vocab, stream)


def scale_add(gpu, y, x, alpha, n, stream=None):
    """y = y + alpha * x over n bf16 elements (fp32 math, one rounding)."""
    launch(gpu, "elementwise", "scale_add").grid(_flat("scale_add", n)).block(THREADS) \
        .arg_ptr(y).arg_ptr(x).arg_f32(alpha).arg_u32(n).launch(stream)
