"""Launchers for cuda_src/dsa.cu: DSA indexer scores over the paged indexer cache and the top-k selection."""
from ._util import blocks_for, launch, need

__all__ = ["dsa_index_scores", "dsa_topk", "index_smem_bytes"]

SCORE_WARPS = 8      # as in dsa.cu
TOPK_THREADS = 512
SMEM_LIMIT = 48 * 1024
MAX_HEAD_DIM = 256   # eight elements of a row per lane (the vector paths: 32, 64, 128, 256; any other width strided)


def index_smem_bytes(heads: int, head_dim: int) -> int:
    """Shared memory of dsa_index_scores: the sequence's q and weights as f32."""
    return 4 * heads * (head_dim + 1)


def dsa_index_scores(gpu, q, w, cache, meta, meta_stride, scores, num_seqs, heads, head_dim, score_stride, scale,
                     stream=None):
    """scores[s, j] = scale * sum_h w[s, h] * relu(q[s, h] . k_j) for every row j < seq_len of sequence s
    (seq_len and the block table from the metadata slab at meta + s * meta_stride). q bf16
    [num_seqs, heads, head_dim], w f32 [num_seqs, heads], cache rows bf16 [head_dim]; scores f32
    [num_seqs, score_stride] (rows past seq_len are not written; seq_len must be <= score_stride)."""
    need(1 <= head_dim <= MAX_HEAD_DIM, f"dsa_index_scores: head_dim {head_dim} must be in [1, {MAX_HEAD_DIM}]")
    smem = index_smem_bytes(heads, head_dim)
    need(0 < heads and smem <= SMEM_LIMIT, f"dsa_index_scores: {heads} heads x {head_dim} do not fit shared memory")
    need(num_seqs >= 1 and score_stride >= 1, "dsa_index_scores: need at least one sequence and one score column")
    launch(gpu, "dsa", "dsa_index_scores").grid(blocks_for(score_stride, 2 * SCORE_WARPS, 1024), num_seqs) \
        .block(SCORE_WARPS * 32).shared(smem).arg_ptr(q).arg_ptr(w).arg_ptr(cache).arg_ptr(meta) \
        .arg_u32(meta_stride).arg_ptr(scores).arg_u32(num_seqs).arg_u32(heads).arg_u32(head_dim) \
        .arg_u32(score_stride).arg_f32(scale).launch(stream)


def dsa_topk(gpu, scores, score_stride, meta, meta_stride, sel, sel_stride, num_seqs, k, stream=None):
    """sel[s, :k'] = the rows of the k' = min(k, seq_len) largest scores[s, :seq_len], ascending, ties to the
    lower row (NaN ranks lowest); sel[s, k':sel_stride] = -1. sel i32 [num_seqs, sel_stride]."""
    need(1 <= k <= sel_stride, f"dsa_topk: k {k} must be in [1, sel_stride {sel_stride}]")
    need(num_seqs >= 1, "dsa_topk: need at least one sequence")
    launch(gpu, "dsa", "dsa_topk").grid(num_seqs).block(TOPK_THREADS).arg_ptr(scores).arg_u32(score_stride) \
        .arg_ptr(meta).arg_u32(meta_stride).arg_ptr(sel).arg_u32(sel_stride).arg_u32(num_seqs).arg_u32(k) \
        .launch(stream)
