"""Twins of cuda_src/paged_attention.cu: float64 softmax attention, written as the kernels' passes.

The partial twins write what the CUDA partial pass writes (per sequence, split and head: the unnormalised
f32 output and (m, l), from float64 sums); the combine twin merges them in float32 in split order, as the
kernels' merge does, and rounds once to bf16. The walk twins are the two composed for each sequence (the same
functions, so walk and split mode agree bit for bit here too). Split boundaries follow the kernel's chunk rule,
so the only GPU-vs-twin difference is accumulation order."""
import numpy as np

from ...ops.kv_cache import fp8_block_layout
from ...ops.paged_attention import chunk_rows
from ...runtime.dtypes import BF16, FP8
from ..access import kv_slots, meta_slab, slab_seq_len, slab_table
from ..registry import twin
from .kv_cache import decode_fp8_blocks
from .elementwise import sigmoid_gate_mul


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


class Partials:
    """One sequence's partials, as the split pass writes them: ml f32 [splits, heads, 2] = (m, l), o f32
    [splits, heads, dv] (NaN where the kernel writes nothing: the empty splits), `written` [splits]."""

    def __init__(self, splits, heads, dv):
        self.ml = np.zeros((splits, heads, 2), np.float32)
        self.o = np.full((splits, heads, dv), np.nan, np.float32)
        self.written = np.zeros(splits, bool)


def _add_splits(part, splits, min_chunk, h_sel, scores, vals):
    """The heads h_sel into `part`: scores float64 [len(h_sel), n] (-inf = masked), vals [n, dv]."""
    n = vals.shape[0]
    chunk = chunk_rows(n, splits, min_chunk)
    for c in range(splits):
        p0, p1 = c * chunk, min(n, (c + 1) * chunk)
        if p0 >= p1:
            part.ml[c, h_sel] = (-np.inf, 0.0)
            continue
        sc = scores[:, p0:p1]
        m = sc.max(axis=1).astype(np.float32).astype(np.float64)
        p = np.exp(sc - np.where(np.isfinite(m), m, 0.0)[:, None])
        part.ml[c, h_sel, 0], part.ml[c, h_sel, 1] = m, p.sum(axis=1)
        part.o[c, h_sel] = p @ vals[p0:p1]
        part.written[c] = True


def _store(dev, ws_o, ws_ml, s, part):
    """Sequence s's partials into the workspace (o only of the splits the kernel writes)."""
    splits, heads, dv = part.o.shape
    base = s * splits * heads
    dev.view(ws_ml.offset(8 * base), np.float32, (splits, heads, 2))[:] = part.ml
    o = dev.view(ws_o.offset(4 * base * dv), np.float32, (splits, heads, dv))
    o[part.written] = part.o[part.written]


def _fma32(x, y, z):
    """float32 x*y + z with the product unrounded (float64 holds it exactly), for the kernels' __fmaf_rn (the
    sum rounds twice, float64 then float32: the twin matches the kernel to accumulation order, not bitwise)."""
    return (x.astype(np.float64) * y + z).astype(np.float32)


def _merge(ml, o, sink):
    """bf16 [heads, dv] of one sequence's partials (ml f32 [splits, heads, 2], o f32 [splits, heads, dv]) and
    sink (f32 [heads] or None): the kernels' merge_ml / merge_o / merge_finish in float32, in split order,
    skipping splits with m == -inf (their o is never read)."""
    splits, heads, dv = o.shape
    M = np.full(heads, -np.inf, np.float32)
    L = np.zeros(heads, np.float32)
    O = np.zeros((heads, dv), np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        for c in range(splits):
            m, l = ml[c, :, 0], ml[c, :, 1]
            on = m != -np.inf
            if not on.any():
                continue
            Mn = np.maximum(M, m)
            a = np.where(M == -np.inf, np.float32(0), np.exp(M - Mn)).astype(np.float32)
            b = np.exp(m - Mn).astype(np.float32)
            L = np.where(on, _fma32(L, a, l * b), L)
            O[on] = _fma32(O[on], a[on, None], o[c, on] * b[on, None])
            M = np.where(on, Mn, M)
        a = np.ones(heads, np.float32)
        if sink is not None:
            Mn = np.maximum(M, sink)
            ok = Mn != -np.inf
            a = np.where(ok, np.where(M == -np.inf, np.float32(0), np.exp(M - Mn)), a).astype(np.float32)
            L = np.where(ok, _fma32(L, a, np.exp(sink - Mn).astype(np.float32)), L)
        inv = np.where(L > 0, np.float32(1) / np.where(L > 0, L, np.float32(1)), np.float32(0)).astype(np.float32)
    return ((O * a[:, None]) * inv[:, None]).astype(BF16)


def _mla(dev, q, meta, meta_stride, num_seqs, heads, row_width, v_width, scale, window, sel, sel_stride, splits,
         min_chunk, rows_of, emit):
    """rows_of(slab, rows) -> float64 [len(rows), row_width] (masked rows zero); emit(s, Partials)."""
    qv = dev.view(q, BF16, (num_seqs, heads, row_width)).astype(np.float64)
    for s in range(num_seqs):
        seq_len, lo, n, slab = _seq(dev, meta, meta_stride, s, window, bool(sel), sel_stride)
        rows = _rows(dev, sel, sel_stride, s, seq_len, lo, n)
        kv = rows_of(slab, rows)
        sc = np.where(rows >= 0, qv[s] @ kv.T * scale, -np.inf)
        part = Partials(splits, heads, v_width)
        _add_splits(part, splits, min_chunk, np.arange(heads), sc, kv[:, :v_width])
        emit(s, part)


def _bf16_rows(dev, cache, row_width):
    return lambda slab, rows: _gather(dev, cache, slab, rows, 2 * row_width, 0, row_width, BF16)


def _fp8_block_rows(dev, cache, row_width, nope):
    """The blocked fp8 rows (kv_cache twin) decoded exactly; then the bf16 path's math."""
    row_bytes = fp8_block_layout(row_width, nope)[2]

    def rows_of(slab, rows):
        raw = _gather(dev, cache, slab, rows, row_bytes, 0, row_bytes, np.dtype(np.uint8)).astype(np.uint8)
        return decode_fp8_blocks(raw, row_width, nope)
    return rows_of


def _to_ws(dev, ws_o, ws_ml):
    return lambda s, part: _store(dev, ws_o, ws_ml, s, part)


def _to_out(dev, sink, out, num_seqs, heads, dv):
    """emit for the walk twins: each sequence's partials merged straight into out."""
    ov = dev.view(out, BF16, (num_seqs, heads, dv))
    sk = dev.view(sink, np.float32, heads).copy() if sink else None

    def emit(s, part):
        ov[s] = _merge(part.ml, part.o, sk)
    return emit


@twin("paged_attention", "mla_decode_partial")
def mla_decode_partial(dev, q, cache, meta, meta_stride, ws_o, ws_ml, num_seqs, heads, row_width, v_width, scale,
                       window, sel, sel_stride, splits, min_chunk):
    _mla(dev, q, meta, meta_stride, num_seqs, heads, row_width, v_width, scale, window, sel, sel_stride, splits,
         min_chunk, _bf16_rows(dev, cache, row_width), _to_ws(dev, ws_o, ws_ml))


@twin("paged_attention", "mla_decode_partial_fp8")
def mla_decode_partial_fp8(dev, q, cache, meta, meta_stride, ws_o, ws_ml, num_seqs, heads, row_width, v_width,
                           scale, window, sel, sel_stride, splits, min_chunk, nope):
    _mla(dev, q, meta, meta_stride, num_seqs, heads, row_width, v_width, scale, window, sel, sel_stride, splits,
         min_chunk, _fp8_block_rows(dev, cache, row_width, nope), _to_ws(dev, ws_o, ws_ml))


@twin("paged_attention", "mla_decode_walk")
def mla_decode_walk(dev, q, cache, meta, meta_stride, sink, out, num_seqs, heads, row_width, v_width, scale, window,
                    sel, sel_stride, splits, min_chunk):
    _mla(dev, q, meta, meta_stride, num_seqs, heads, row_width, v_width, scale, window, sel, sel_stride, splits,
         min_chunk, _bf16_rows(dev, cache, row_width), _to_out(dev, sink, out, num_seqs, heads, v_width))


@twin("paged_attention", "mla_decode_walk_fp8")
def mla_decode_walk_fp8(dev, q, cache, meta, meta_stride, sink, out, num_seqs, heads, row_width, v_width, scale,
                        window, sel, sel_stride, splits, min_chunk, nope):
    _mla(dev, q, meta, meta_stride, num_seqs, heads, row_width, v_width, scale, window, sel, sel_stride, splits,
         min_chunk, _fp8_block_rows(dev, cache, row_width, nope), _to_out(dev, sink, out, num_seqs, heads, v_width))


def _gqa(dev, q, q_row_stride, k_cache, v_cache, meta, meta_stride, num_seqs, q_heads, kv_heads, head_dim, scale,
         kv_scale, splits, min_chunk, dt, emit):
    group, row_bytes = q_heads // kv_heads, kv_heads * head_dim * dt.itemsize
    for s in range(num_seqs):
        qs = dev.view(q.offset(2 * s * q_row_stride), BF16, (q_heads, head_dim)).astype(np.float64)
        seq_len, lo, n, slab = _seq(dev, meta, meta_stride, s, 0, False, 0)
        rows = _rows(dev, 0, 0, s, seq_len, lo, n)
        part = Partials(splits, q_heads, head_dim)
        for g in range(kv_heads):
            col = g * head_dim * dt.itemsize
            k = _gather(dev, k_cache, slab, rows, row_bytes, col, head_dim, dt) * kv_scale
            v = _gather(dev, v_cache, slab, rows, row_bytes, col, head_dim, dt) * kv_scale
            h = np.arange(g * group, (g + 1) * group)
            _add_splits(part, splits, min_chunk, h, qs[h] @ k.T * scale, v)
        emit(s, part)


@twin("paged_attention", "gqa_decode_partial")
def gqa_decode_partial(dev, q, q_row_stride, k_cache, v_cache, meta, meta_stride, ws_o, ws_ml, num_seqs, q_heads,
                       kv_heads, head_dim, scale, kv_scale, splits, min_chunk):
    _gqa(dev, q, q_row_stride, k_cache, v_cache, meta, meta_stride, num_seqs, q_heads, kv_heads, head_dim, scale,
         kv_scale, splits, min_chunk, BF16, _to_ws(dev, ws_o, ws_ml))


@twin("paged_attention", "gqa_decode_partial_fp8")
def gqa_decode_partial_fp8(dev, q, q_row_stride, k_cache, v_cache, meta, meta_stride, ws_o, ws_ml, num_seqs,
                           q_heads, kv_heads, head_dim, scale, kv_scale, splits, min_chunk):
    _gqa(dev, q, q_row_stride, k_cache, v_cache, meta, meta_stride, num_seqs, q_heads, kv_heads, head_dim, scale,
         kv_scale, splits, min_chunk, FP8, _to_ws(dev, ws_o, ws_ml))


@twin("paged_attention", "gqa_decode_walk")
def gqa_decode_walk(dev, q, q_row_stride, k_cache, v_cache, meta, meta_stride, out, num_seqs, q_heads, kv_heads,
                    head_dim, scale, kv_scale, splits, min_chunk):
    _gqa(dev, q, q_row_stride, k_cache, v_cache, meta, meta_stride, num_seqs, q_heads, kv_heads, head_dim, scale,
         kv_scale, splits, min_chunk, BF16, _to_out(dev, 0, out, num_seqs, q_heads, head_dim))


@twin("paged_attention", "gqa_decode_walk_fp8")
def gqa_decode_walk_fp8(dev, q, q_row_stride, k_cache, v_cache, meta, meta_stride, out, num_seqs, q_heads,
                        kv_heads, head_dim, scale, kv_scale, splits, min_chunk):
    _gqa(dev, q, q_row_stride, k_cache, v_cache, meta, meta_stride, num_seqs, q_heads, kv_heads, head_dim, scale,
         kv_scale, splits, min_chunk, FP8, _to_out(dev, 0, out, num_seqs, q_heads, head_dim))


@twin("paged_attention", "attn_combine")
def attn_combine(dev, ws_o, ws_ml, sink, out, num_seqs, heads, dv, splits, gate, gate_row_stride, gate_head_stride):
    ov = dev.view(out, BF16, (num_seqs, heads, dv))
    sk = dev.view(sink, np.float32, heads).copy() if sink else None
    for s in range(num_seqs):
        base = s * splits * heads
        ml = dev.view(ws_ml.offset(8 * base), np.float32, (splits, heads, 2))
        o = dev.view(ws_o.offset(4 * base * dv), np.float32, (splits, heads, dv))
        ov[s] = _merge(ml, o, sk)
    if gate:   # Qwen3-Next's output gate, as sigmoid_gate_mul
        sigmoid_gate_mul(dev, out, gate, out, num_seqs, heads, dv, gate_row_stride, gate_head_stride)
