"""Twins of cuda_src/paged_attention.cu: float64 softmax attention, written as the kernels' two passes.

The partial twins write what the CUDA partial pass writes (per sequence, split and head: the unnormalised
f32 output and (m, l)); the combine twin merges them in float64 and rounds once to bf16. Split boundaries
follow the kernel's chunk rule, so the only GPU-vs-twin difference is accumulation order."""
import numpy as np

from ...ops.kv_cache import fp8_block_layout
from ...runtime.dtypes import BF16, FP8
from ..access import kv_slots, meta_slab, slab_seq_len, slab_table
from ..registry import twin
from .kv_cache import decode_fp8_blocks

TILE = 32  # the kernel's tile: chunks are whole tiles


def _seq(dev, meta, meta_stride, s, window, dsa, sel_stride):
    """(seq_len, lo, n, slab) of sequence s: rows [lo, seq_len) are visible; n positions are iterated."""
    slab = meta_slab(meta, meta_stride, s)
    seq_len = slab_seq_len(dev, slab)
    lo = seq_len - window if 0 < window < seq_len else 0
    n = sel_stride if dsa else max(seq_len - lo, 0)
    return seq_len, lo, n, slab


def _rows(dev, sel, sel_stride, s, seq_len, lo, n):
    """Logical row of each position (-1 = masked)."""
    if not sel:
        return np.arange(lo, lo + n, dtype=np.int64)
    r = dev.view(sel.offset(4 * s * sel_stride), np.int32, n).astype(np.int64)
    return np.where((r >= lo) & (r < seq_len), r, -1)


def _gather(dev, base, slab, rows, row_bytes, col_bytes, width, dt):
    """float64 [len(rows), width] of the cache rows (masked rows are zero)."""
    out = np.zeros((rows.size, width))
    ok = rows >= 0
    if ok.any():
        r = rows[ok]
        slots = kv_slots(slab_table(dev, slab, int(r.max()) + 1), r)
        raw = dev.view(base, np.uint8, (int(slots.max()) + 1) * row_bytes).reshape(-1, row_bytes)
        out[ok] = raw[slots, col_bytes:col_bytes + width * dt.itemsize].copy().view(dt).astype(np.float64)
    return out


def _write_splits(dev, ws_o, ws_ml, s, splits, min_chunk, heads, h_sel, scores, vals):
    """Partials of the heads h_sel: scores float64 [len(h_sel), n] (-inf = masked), vals [n, dv]."""
    n, dv = vals.shape
    per = -(-n // splits)
    chunk = -(-max(per, min_chunk) // TILE) * TILE
    for c in range(splits):
        base = (s * splits + c) * heads
        ml = dev.view(ws_ml.offset(8 * base), np.float32, (heads, 2))
        p0, p1 = c * chunk, min(n, (c + 1) * chunk)
        if p0 >= p1:
            ml[h_sel] = (-np.inf, 0.0)
            continue
        sc = scores[:, p0:p1]
        m = sc.max(axis=1).astype(np.float32).astype(np.float64)
        p = np.exp(sc - np.where(np.isfinite(m), m, 0.0)[:, None])
        ml[h_sel, 0], ml[h_sel, 1] = m, p.sum(axis=1)
        dev.view(ws_o.offset(4 * base * dv), np.float32, (heads, dv))[h_sel] = p @ vals[p0:p1]


def _mla(dev, q, meta, meta_stride, ws_o, ws_ml, num_seqs, heads, row_width, v_width, scale, window, sel,
         sel_stride, splits, min_chunk, rows_of):
    """rows_of(slab, rows) -> float64 [len(rows), row_width] (masked rows zero)."""
    qv = dev.view(q, BF16, (num_seqs, heads, row_width)).astype(np.float64)
    for s in range(num_seqs):
        seq_len, lo, n, slab = _seq(dev, meta, meta_stride, s, window, bool(sel), sel_stride)
        rows = _rows(dev, sel, sel_stride, s, seq_len, lo, n)
        kv = rows_of(slab, rows)
        sc = np.where(rows >= 0, qv[s] @ kv.T * scale, -np.inf)
        _write_splits(dev, ws_o, ws_ml, s, splits, min_chunk, heads, np.arange(heads), sc, kv[:, :v_width])


@twin("paged_attention", "mla_decode_partial")
def mla_decode_partial(dev, q, cache, meta, meta_stride, ws_o, ws_ml, num_seqs, heads, row_width, v_width, scale,
                       window, sel, sel_stride, splits, min_chunk):
    _mla(dev, q, meta, meta_stride, ws_o, ws_ml, num_seqs, heads, row_width, v_width, scale, window, sel, sel_stride,
         splits, min_chunk, lambda slab, rows: _gather(dev, cache, slab, rows, 2 * row_width, 0, row_width, BF16))


@twin("paged_attention", "mla_decode_partial_fp8")
def mla_decode_partial_fp8(dev, q, cache, meta, meta_stride, ws_o, ws_ml, num_seqs, heads, row_width, v_width,
                           scale, window, sel, sel_stride, splits, min_chunk, nope):
    """The blocked fp8 rows (kv_cache twin) decoded exactly, then the bf16 path's math."""
    row_bytes = fp8_block_layout(row_width, nope)[2]

    def rows_of(slab, rows):
        raw = _gather(dev, cache, slab, rows, row_bytes, 0, row_bytes, np.dtype(np.uint8)).astype(np.uint8)
        return decode_fp8_blocks(raw, row_width, nope)
    _mla(dev, q, meta, meta_stride, ws_o, ws_ml, num_seqs, heads, row_width, v_width, scale, window, sel, sel_stride,
         splits, min_chunk, rows_of)


def _gqa(dev, q, q_row_stride, k_cache, v_cache, meta, meta_stride, ws_o, ws_ml, num_seqs, q_heads, kv_heads,
         head_dim, scale, kv_scale, splits, min_chunk, dt):
    group, row_bytes = q_heads // kv_heads, kv_heads * head_dim * dt.itemsize
    for s in range(num_seqs):
        qs = dev.view(q.offset(2 * s * q_row_stride), BF16, (q_heads, head_dim)).astype(np.float64)
        seq_len, lo, n, slab = _seq(dev, meta, meta_stride, s, 0, False, 0)
        rows = _rows(dev, 0, 0, s, seq_len, lo, n)
        for g in range(kv_heads):
            col = g * head_dim * dt.itemsize
            k = _gather(dev, k_cache, slab, rows, row_bytes, col, head_dim, dt) * kv_scale
            v = _gather(dev, v_cache, slab, rows, row_bytes, col, head_dim, dt) * kv_scale
            h = np.arange(g * group, (g + 1) * group)
            _write_splits(dev, ws_o, ws_ml, s, splits, min_chunk, q_heads, h, qs[h] @ k.T * scale, v)


@twin("paged_attention", "gqa_decode_partial")
def gqa_decode_partial(dev, q, q_row_stride, k_cache, v_cache, meta, meta_stride, ws_o, ws_ml, num_seqs, q_heads,
                       kv_heads, head_dim, scale, kv_scale, splits, min_chunk):
    _gqa(dev, q, q_row_stride, k_cache, v_cache, meta, meta_stride, ws_o, ws_ml, num_seqs, q_heads, kv_heads,
         head_dim, scale, kv_scale, splits, min_chunk, BF16)


@twin("paged_attention", "gqa_decode_partial_fp8")
def gqa_decode_partial_fp8(dev, q, q_row_stride, k_cache, v_cache, meta, meta_stride, ws_o, ws_ml, num_seqs,
                           q_heads, kv_heads, head_dim, scale, kv_scale, splits, min_chunk):
    _gqa(dev, q, q_row_stride, k_cache, v_cache, meta, meta_stride, ws_o, ws_ml, num_seqs, q_heads, kv_heads,
         head_dim, scale, kv_scale, splits, min_chunk, FP8)


@twin("paged_attention", "attn_combine")
def attn_combine(dev, ws_o, ws_ml, sink, out, num_seqs, heads, dv, splits):
    ov = dev.view(out, BF16, (num_seqs, heads, dv))
    sk = dev.view(sink, np.float32, heads).astype(np.float64) if sink else None
    for s in range(num_seqs):
        base = s * splits * heads
        ml = dev.view(ws_ml.offset(8 * base), np.float32, (splits, heads, 2)).astype(np.float64)
        o = dev.view(ws_o.offset(4 * base * dv), np.float32, (splits, heads, dv))
        m, l = ml[..., 0], ml[..., 1]
        M = m.max(axis=0) if sk is None else np.maximum(m.max(axis=0), sk)
        with np.errstate(invalid="ignore"):
            w = np.where(m == -np.inf, 0.0, np.exp(m - M))
        L = (w * l).sum(axis=0) + (0.0 if sk is None else np.exp(sk - M))
        acc = np.zeros((heads, dv))
        for c in range(splits):
            on = w[c] > 0  # splits that carry no weight are never read (their output was not written)
            acc[on] += w[c, on, None] * o[c, on]
        ov[s] = np.where(L[:, None] > 0, acc / np.where(L > 0, L, 1.0)[:, None], 0.0).astype(BF16)
