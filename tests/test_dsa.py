"""dsa.cu: indexer scores over a paged indexer cache (causal, several sequences, shuffled block tables) against
float64 textbook math (docs/model_math.md C.2), and the top-k selection against a sort (ties to the lower row,
-1 padding, fewer visible rows than k, NaN). GPU: the kernels against their twins at tiny and GLM-5 dims."""
import numpy as np
import pytest

from mtp_cupy import ops
from mtp_cupy.runtime.arena import pack_mtp_attn_meta
from helpers import assert_close, get, out, rand_bf16, run_on_both, up

SLAB = 2048   # metadata slab per sequence: pos @0, slot @8, seq_len @16, table @256 (<= 448 blocks)


def paged(rng, seq_lens, width):
    """Random bf16 cache rows placed in shuffled blocks; returns (cache [slots, width], rows per seq, meta)."""
    blocks = [-(-n // 16) for n in seq_lens]
    ids = rng.permutation(sum(blocks) + 3)
    cache = rand_bf16(rng, (len(ids) * 16, width))
    meta, rows, at = bytearray(), [], 0
    for n, nb in zip(seq_lens, blocks):
        table = ids[at:at + nb]
        at += nb
        slots = np.array([table[j // 16] * 16 + j % 16 for j in range(n)], np.int64)
        rows.append(cache[slots].astype(np.float64))
        slab = pack_mtp_attn_meta(max(n - 1, 0), int(slots[-1]) if n else 0, n, table, SLAB)
        meta += slab + bytes(SLAB - len(slab))
    return cache, rows, np.frombuffer(bytes(meta), np.uint8)


def scores_ref(q, w, rows, scale):
    """I[j] = scale * sum_h w_h relu(q_h . k_j), float64."""
    return scale * (np.asarray(w, np.float64) @ np.maximum(np.asarray(q, np.float64) @ rows.T, 0.0))


def run_scores(dev, q, w, cache, meta, num_seqs, heads, hd, stride, scale):
    qb, wb, cb, mb = up(dev, q), up(dev, w), up(dev, cache), up(dev, meta)
    sb = out(dev, "f32", (num_seqs, stride))
    ops.dsa_index_scores(dev, qb.ptr, wb.ptr, cb.ptr, mb.ptr, SLAB, sb.ptr, num_seqs, heads, hd, stride, scale)
    return get(dev, sb, "f32", (num_seqs, stride))


@pytest.mark.parametrize("heads,hd", [(4, 32), (8, 64), (32, 128), (2, 256)])
def test_scores_vs_float64(ref, rng, heads, hd):
    seq_lens = [37, 1, 100]
    stride = 128
    cache, rows, meta = paged(rng, seq_lens, hd)
    q = rand_bf16(rng, (len(seq_lens), heads, hd))
    w = rng.standard_normal((len(seq_lens), heads)).astype(np.float32)
    scale = heads ** -0.5 * hd ** -0.5
    got = run_scores(ref, q, w, cache, meta, len(seq_lens), heads, hd, stride, scale)
    for s, n in enumerate(seq_lens):
        assert_close(got[s, :n], scores_ref(q[s].astype(np.float32), w[s], rows[s], scale), 1e-6, f"seq {s}")
        assert np.isnan(got[s, n:]).all(), "rows past seq_len must not be written"


def topk_ref(x, k):
    """Rows of the k largest (NaN lowest), ties to the lower row, ascending."""
    key = np.where(np.isnan(x), -np.inf, x)
    order = sorted(range(len(x)), key=lambda j: (-key[j], j))
    return sorted(order[:min(k, len(x))])


def run_topk(dev, scores, meta, num_seqs, sel_stride, k):
    sb, mb = up(dev, scores), up(dev, meta)
    sel = out(dev, "i32", (num_seqs, sel_stride))
    ops.dsa_topk(dev, sb.ptr, scores.shape[1], mb.ptr, SLAB, sel.ptr, sel_stride, num_seqs, k)
    return get(dev, sel, "i32", (num_seqs, sel_stride))


@pytest.mark.parametrize("k", [1, 8, 50, 64, 200])
def test_topk_vs_sort(ref, rng, k):
    seq_lens = [100, 3, 64, 150]
    stride = 160
    _, _, meta = paged(rng, seq_lens, 16)
    scores = np.full((len(seq_lens), stride), np.nan, np.float32)
    for s, n in enumerate(seq_lens):
        scores[s, :n] = np.round(rng.standard_normal(n) * 3) / 2       # many exact ties
    scores[0, 5] = -0.0
    scores[0, 7] = np.nan
    scores[3, 10:20] = 1e30
    sel_stride = max(k, 1) + 5
    got = run_topk(ref, scores, meta, len(seq_lens), sel_stride, k)
    for s, n in enumerate(seq_lens):
        want = topk_ref(scores[s, :n], k)
        assert got[s, :len(want)].tolist() == want, f"seq {s}"
        assert (got[s, len(want):] == -1).all()


def test_topk_all_equal_takes_lowest_rows(ref):
    n, k = 40, 8
    _, _, meta = paged(np.random.default_rng(0), [n], 16)
    got = run_topk(ref, np.zeros((1, n), np.float32), meta, 1, k, k)
    assert got[0].tolist() == list(range(k))


@pytest.mark.gpu
@pytest.mark.parametrize("heads,hd,seq_lens,k", [(4, 32, [37, 5], 8), (32, 128, [3000, 2049], 2048),
                                                 (32, 128, [1500], 2048), (64, 128, [4097], 2048)])
def test_gpu_matches_twin(rng, heads, hd, seq_lens, k):
    stride = max(seq_lens) + 3
    cache, _, meta = paged(rng, seq_lens, hd)
    q = rand_bf16(rng, (len(seq_lens), heads, hd))
    w = rng.standard_normal((len(seq_lens), heads)).astype(np.float32)
    scale = heads ** -0.5 * hd ** -0.5
    a, b = run_on_both(run_scores, q, w, cache, meta, len(seq_lens), heads, hd, stride, scale)
    for s, n in enumerate(seq_lens):
        assert_close(b[s, :n], a[s, :n], 1e-5, f"scores seq {s}")
    # the same scores into both top-k kernels: identical selections
    sa, sb = run_on_both(run_topk, a, meta, len(seq_lens), k + 4, k)
    np.testing.assert_array_equal(sa, sb)
    tied = np.round(a * 4) / 4
    sa, sb = run_on_both(run_topk, tied, meta, len(seq_lens), k + 4, k)
    np.testing.assert_array_equal(sa, sb)
