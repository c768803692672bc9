"""Twins of cuda_src/dsa.cu: indexer scores in float64 rounded once to f32, and the top-k row selection with
the kernel's order-preserving key (NaN lowest) and ties to the lower row."""
import numpy as np

from ...runtime.dtypes import BF16
from ..access import kv_slots, meta_slab, slab_seq_len, slab_table
from ..registry import twin


def _slab(dev, meta, meta_stride, s):
    slab = meta_slab(meta, meta_stride, s)
    return slab_seq_len(dev, slab), slab


def score_keys(x: np.ndarray) -> np.ndarray:
    """u32 keys ordered like the f32 values, -0 == +0, NaN lowest (the kernel's score_key)."""
    x = np.asarray(x, np.float32)
    u = np.where(x == 0, np.float32(0), x).view(np.uint32)
    key = np.where(u & 0x80000000, ~u, u | 0x80000000).astype(np.uint32)
    return np.where(np.isnan(x), np.uint32(0), key)


@twin("dsa", "dsa_index_scores")
def dsa_index_scores(dev, q, w, cache, meta, meta_stride, scores, num_seqs, heads, head_dim, score_stride, scale):
    qv = dev.view(q, BF16, (num_seqs, heads, head_dim)).astype(np.float64)
    wv = dev.view(w, np.float32, (num_seqs, heads)).astype(np.float64)
    out = dev.view(scores, np.float32, (num_seqs, score_stride))
    for s in range(num_seqs):
        seq_len, slab = _slab(dev, meta, meta_stride, s)
        n = min(max(seq_len, 0), score_stride)
        if n == 0:
            continue
        slots = kv_slots(slab_table(dev, slab, n), np.arange(n))
        k = dev.view(cache, BF16, (int(slots.max()) + 1, head_dim))[slots].astype(np.float64)
        dots = np.maximum(qv[s] @ k.T, 0.0)                      # [heads, n]
        out[s, :n] = ((wv[s] @ dots) * scale).astype(np.float32)


@twin("dsa", "dsa_topk")
def dsa_topk(dev, scores, score_stride, meta, meta_stride, sel, sel_stride, num_seqs, k):
    for s in range(num_seqs):
        seq_len, _ = _slab(dev, meta, meta_stride, s)
        n = min(max(seq_len, 0), score_stride)
        out = dev.view(sel.offset(4 * s * sel_stride), np.int32, sel_stride)
        kk = min(k, n)
        keys = score_keys(dev.view(scores.offset(4 * s * score_stride), np.float32, n))
        # stable sort on -key: equal keys keep row order, so the lower row wins a tie
        top = np.argsort(-keys.astype(np.int64), kind="stable")[:kk]
        out[:kk] = np.sort(top).astype(np.int32)
        out[kk:] = -1
