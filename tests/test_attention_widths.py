"""Issue 17.1: attention widths off the kernels' 64-column tile.

Kernels first: mla_decode, gqa_decode, dsa_index_scores and the bf16 grouped GEMV at widths that are multiples
of 8 but not of 64, against the dense float64 softmax of test_paged_attention (independent of the twins) on
both devices, and CUDA against the twin (the padded shared-memory tiles must change nothing but the summation
order). Then whole proposers of such widths against transformers' decoder layers (tests/width_oracles.py)
on both devices, the config checks at load, and a sweep that either loads and drafts or refuses at load."""
import numpy as np
import pytest

from mtp_cupy import ops
from mtp_cupy.weights.linear import Linear
from helpers import assert_bf16_near, f32, get, out, rand_bf16, rel_err, run_on_both, up
from test_paged_attention import META_STRIDE, Paged, check, gqa_ref, mla_ref, run_gqa, run_mla

SEQS = [1, 15, 33, 140]

# (heads, row_width, v_width): MLA rows of kv_lora_rank + qk_rope_head_dim (value = the latent), V4 rows of
# head_dim (value = the whole row)
MLA_WIDTHS = [(3, 48, 32), (4, 80, 80), (5, 136, 120), (33, 200, 136), (2, 8, 8)]


@pytest.mark.parametrize("heads,rw,dv", MLA_WIDTHS)
def test_mla_decode_off_tile_widths(dev, rng, heads, rw, dv):
    pg = Paged(rng, SEQS, rw)
    q = rand_bf16(rng, (len(SEQS), heads, rw))
    scale = rw ** -0.5 * 1.3
    check(run_mla(dev, pg, q, heads, rw, dv, scale, poison_ws=True), mla_ref(pg, q, dv, scale))


def test_mla_decode_off_tile_window_sink_selection(dev, rng):
    heads, rw, dv = 4, 80, 80
    pg = Paged(rng, SEQS, rw)
    q = rand_bf16(rng, (len(SEQS), heads, rw))
    sink = rng.standard_normal(heads).astype(np.float32)
    check(run_mla(dev, pg, q, heads, rw, dv, 0.11, window=9, sink=sink), mla_ref(pg, q, dv, 0.11, 9, sink))
    sel = np.full((len(SEQS), 12), -1, np.int32)
    for s, n in enumerate(SEQS):
        k = min(n, 12)
        sel[s, :k] = rng.choice(n, k, replace=False)
    check(run_mla(dev, pg, q, heads, rw, 48, 0.11, sel=sel), mla_ref(pg, q, 48, 0.11, sel=sel))


@pytest.mark.parametrize("kv_dtype,q_heads,kv_heads,hd", [("bf16", 4, 2, 32), ("bf16", 6, 3, 40), ("bf16", 8, 1, 72),
                                                          ("bf16", 4, 4, 136), ("fp8", 4, 2, 32), ("fp8", 6, 2, 48)])
def test_gqa_decode_off_tile_head_dims(dev, rng, kv_dtype, q_heads, kv_heads, hd):
    kc, vc = Paged(rng, SEQS, kv_heads * hd, kv_dtype), Paged(rng, SEQS, kv_heads * hd, kv_dtype)
    vc.tables = kc.tables
    stride = q_heads * hd + 8
    q = rand_bf16(rng, (len(SEQS), stride))
    kv_scale = 0.5 if kv_dtype == "fp8" else 1.0
    check(run_gqa(dev, kc, vc, q, stride, q_heads, kv_heads, hd, hd ** -0.5, kv_dtype, kv_scale),
          gqa_ref(kc, vc, q, q_heads, kv_heads, hd, hd ** -0.5, kv_scale))


def _index_scores(dev, q, w, pg, heads, hd, score_stride, scale):
    n = len(pg.seq_lens)
    sc = out(dev, "f32", (n, score_stride))
    bufs = [up(dev, a) for a in (q, w, pg.pool, pg.meta())]     # alive until the launch is done
    ops.dsa_index_scores(dev, *[b.ptr for b in bufs[:3]], bufs[3].ptr, META_STRIDE, sc.ptr, n, heads, hd,
                         score_stride, scale)
    return get(dev, sc, "f32", (n, score_stride))


@pytest.mark.parametrize("heads,hd", [(4, 40), (3, 96), (2, 200), (8, 24)])
def test_dsa_index_scores_any_head_dim(dev, rng, heads, hd):
    pg = Paged(rng, SEQS, hd)
    q = rand_bf16(rng, (len(SEQS), heads, hd))
    w = rng.standard_normal((len(SEQS), heads)).astype(np.float32)
    got = _index_scores(dev, q, w, pg, heads, hd, 160, 0.3)
    for s, n in enumerate(SEQS):
        k = pg.rows(s, np.arange(n))
        want = 0.3 * (w[s].astype(np.float64) @ np.maximum(f32(q[s]).astype(np.float64) @ k.T, 0.0))
        assert rel_err(got[s, :n], want) < 1e-5


def test_grouped_gemv_bf16_takes_k_multiple_of_8(dev, rng):
    groups, n, k, m = 3, 20, 24, 2
    W = rand_bf16(rng, (groups * n, k))
    x = rand_bf16(rng, (m, groups, k))
    wb, xb, y = up(dev, W), up(dev, x), out(dev, "f32", (m, groups, n))
    ops.grouped_gemv(dev, xb.ptr, Linear("bf16", groups * n, k, wb.ptr), y.ptr, groups, n, m=m, out_dtype="f32")
    want = np.einsum("mgk,gnk->mgn", f32(x).astype(np.float64), f32(W).reshape(groups, n, k).astype(np.float64))
    assert rel_err(get(dev, y, "f32", (m, groups, n)), want) < 1e-6


# -- CUDA against the twin -----------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("heads,rw,dv", MLA_WIDTHS + [(64, 528, 496), (128, 568, 504)])
def test_mla_off_tile_cuda_vs_twin(rng, heads, rw, dv):
    seqs = [1, 63, 700, 2049]
    pg = Paged(rng, seqs, rw)
    q = rand_bf16(rng, (len(seqs), heads, rw))
    a, b = run_on_both(lambda d: run_mla(d, pg, q, heads, rw, dv, rw ** -0.5))
    check(b, a.astype(np.float64))
    assert_bf16_near(b, a, max_frac=0.02)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype,hd", [("bf16", 32), ("bf16", 40), ("bf16", 200), ("fp8", 48), ("fp8", 80)])
def test_gqa_off_tile_cuda_vs_twin(rng, kv_dtype, hd):
    seqs, qh, kvh = [3, 900, 40], 8, 2
    kc, vc = Paged(rng, seqs, kvh * hd, kv_dtype), Paged(rng, seqs, kvh * hd, kv_dtype)
    vc.tables = kc.tables
    q = rand_bf16(rng, (len(seqs), qh * hd))
    a, b = run_on_both(lambda d: run_gqa(d, kc, vc, q, qh * hd, qh, kvh, hd, hd ** -0.5, kv_dtype, 0.5))
    check(b, a.astype(np.float64))
    assert_bf16_near(b, a, max_frac=0.02)


@pytest.mark.gpu
@pytest.mark.parametrize("heads,hd", [(4, 40), (32, 96), (64, 200)])
def test_dsa_scores_any_head_dim_cuda_vs_twin(rng, heads, hd):
    seqs = [5, 300, 1000]
    pg = Paged(rng, seqs, hd)
    q = rand_bf16(rng, (len(seqs), heads, hd))
    w = rng.standard_normal((len(seqs), heads)).astype(np.float32)
    a, b = run_on_both(lambda d: _index_scores(d, q, w, pg, heads, hd, 1024, 0.1))
    for s, n in enumerate(seqs):
        assert rel_err(b[s, :n], a[s, :n]) < 1e-5
