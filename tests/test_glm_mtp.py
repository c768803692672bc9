"""GLM-5 MTP proposer on the NumPy device against the independent float64 reference (tests/reference/glm_ref.py)
and transformers' GlmMoeDsa decoder layer, BF16 and FP8 checkpoints, with more rows than index_topk so the
sparse pick drops rows; DSA == dense MLA when every row fits the top-k; the loader's key map and per-rank
shards; typed errors that leave the state unchanged; free_state idempotent."""
import numpy as np
import pytest

import mtp_cupy
from mtp_cupy.cache.paged import CacheSpec, PagedKvCache
from mtp_cupy.errors import CapacityError, ConfigError, InputError
from mtp_cupy.layers.dsa import INDEX_CACHE, DsaIndexer, DsaMlaAttention, IndexerDims
from mtp_cupy.layers.mla import MlaAttention, MlaDims, MlaRope, MlaWeights
from mtp_cupy.models import glm5 as glm_mtp, load_proposer
from mtp_cupy.runtime.arena import ForwardBuffers, pack_mtp_attn_meta
from mtp_cupy.runtime.dtypes import BF16, bf16_round
from mtp_cupy.weights import load_config
from mtp_cupy.weights.glm5 import Shard, load_glm5
from deepseek_util import (check_chain, config_of, cuda_matches_ref_device, matches_oracle, ref_weights,
                           masked_drafts_obey, references_agree, rel, snapshot)
from glm_util import D, V, glm_ckpt, inputs
from helpers import assert_bf16_near, up, write_rows
from reference.checkpoint import quant_fp8_rows
from reference.glm_ref import GlmMtpRef

T, K = 20, 3
TOL0, TOL = 1e-2, 2e-2     # first draft; chained drafts (the bf16 carried hidden compounds)


def load(path, gpu=None, **kw):
    return glm_mtp.from_checkpoint(path, gpu or mtp_cupy.device("ref"), max_seq_len=kw.pop("max_seq_len", 128), **kw)


# -- the references ------------------------------------------------------------------------------------------
def test_reference_matches_transformers(rng):
    """The float64 reference against transformers' layer (which takes RoPE angles in float32), with more rows
    than index_topk: the indexer really drops rows."""
    pytest.importorskip("transformers")
    from reference.glm_torch import TorchGlmMtp
    path = glm_ckpt("bf16")
    w, cfg = ref_weights(path), config_of(path)

    def sparse(ref):      # more rows than index_topk: the indexer really drops rows
        assert len(ref.last_selected) == cfg["index_topk"] < len(ref.rows)
    references_agree(GlmMtpRef(w, cfg), TorchGlmMtp(w, cfg), rng, 12, tie=1e-6, check=sparse)


# -- loader --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_loader_keys_and_formats(fmt):
    path = glm_ckpt(fmt)
    cfg = load_config(path)
    keys = set(mtp_cupy.weights.Checkpoint(path).keys())
    p = cfg.mtp_prefix
    assert p + "self_attn.indexer.wq_b.weight" in keys and p + "self_attn.indexer.k_norm.bias" in keys
    assert not any(k.startswith(p + "embed_tokens") or k.startswith(p + "shared_head.head") for k in keys)
    w = load_glm5(mtp_cupy.device("ref"), path, cfg)
    big = "fp8_block" if fmt == "fp8" else "bf16"
    assert {w.q_a.fmt, w.q_b.fmt, w.kv_a.fmt, w.o_proj.fmt, w.indexer.wq_b.fmt, w.indexer.wk.fmt} == {big}
    assert (w.eh_proj.fmt, w.router.fmt, w.head.fmt, w.indexer.weights_proj.fmt) == ("bf16",) * 4
    assert sorted(w.experts) == list(range(16)) and (w.head_v0, w.head.n, w.heads) == (0, V, (0, 4))


def _rows(gpu, L, fmt_ok=("bf16",)):
    assert L.fmt in fmt_ok
    return gpu.read(L.weight, BF16, (L.n, L.k)).astype(np.float32)


@pytest.mark.parametrize("world", [2, 4])
def test_shards_reassemble_the_layer(world):
    """Every rank's heads (q_b / kv_b rows, W_UK^T rows, o_proj columns), experts, shared-expert slice and
    head rows put back together are the unsharded layer."""
    path, gpu = glm_ckpt("bf16"), mtp_cupy.device("ref")
    cfg = load_config(path)
    full = load_glm5(gpu, path, cfg)
    parts = [load_glm5(gpu, path, cfg, Shard(r, world)) for r in range(world)]
    cat = np.concatenate
    for name in ("q_b", "kv_b", "w_uk_t", "head"):
        got = cat([_rows(gpu, getattr(p, name)) for p in parts])
        assert np.array_equal(got, _rows(gpu, getattr(full, name))), name
    assert np.array_equal(cat([_rows(gpu, p.o_proj) for p in parts], 1), _rows(gpu, full.o_proj))
    assert np.array_equal(cat([_rows(gpu, p.shared[0]) for p in parts]), _rows(gpu, full.shared[0]))
    assert np.array_equal(cat([_rows(gpu, p.shared[2]) for p in parts], 1), _rows(gpu, full.shared[2]))
    assert sorted(e for p in parts for e in p.experts) == list(range(16))
    assert [p.head_v0 for p in parts] == [r * V // world for r in range(world)]
    with pytest.raises(ConfigError, match="attention heads"):
        load_glm5(gpu, path, cfg, Shard(0, 3))
    odd = glm_ckpt("bf16", vocab_size=510)                   # 510 % 4 != 0: every rank sweeps the whole head
    w = load_glm5(gpu, odd, load_config(odd), Shard(1, 4))
    assert (w.head_v0, w.head.n, w.heads) == (0, 510, (1, 1))


def test_fp8_shards_keep_blocks_or_fall_back():
    """An FP8 slice that keeps whole 128-blocks stays FP8 (the experts); one that cuts a block (2 heads of
    48 q_b rows) is dequantised to BF16 with the same values."""
    path, gpu = glm_ckpt("fp8"), mtp_cupy.device("ref")
    cfg = load_config(path)
    w = load_glm5(gpu, path, cfg, Shard(1, 2))
    assert w.q_b.fmt == "bf16" and all(x.fmt == "fp8_block" for e in w.experts.values() for x in e)
    from mtp_cupy.weights import Checkpoint, dequant_linear
    qb = dequant_linear(Checkpoint(path), cfg.mtp_prefix + "self_attn.q_b_proj")
    half = qb.shape[0] // 2
    assert np.array_equal(_rows(gpu, w.q_b), qb[half:].astype(BF16).astype(np.float32))


# -- DSA == dense MLA while every row fits the top-k ------------------------------------------------------------
def test_dsa_equals_dense_mla_when_rows_fit_topk(rng):
    path, gpu = glm_ckpt("bf16"), mtp_cupy.device("ref")
    cfg = load_config(path)
    w = load_glm5(gpu, path, cfg)
    n = 6                                    # visible rows (incl. the new one) < index_topk = 8
    dims, rope = MlaDims.from_config(cfg), MlaRope.from_config(cfg)
    kv = PagedKvCache(gpu, [CacheSpec("latent", dims.row_width), CacheSpec(INDEX_CACHE, cfg.index_head_dim)], 4)
    mw = MlaWeights(w.q_a, w.norms["q_a_layernorm"], w.q_b, w.kv_a, w.norms["kv_a_layernorm"], w.w_uk_t, w.kv_b,
                    w.o_proj)
    idx = DsaIndexer(gpu, w.indexer, IndexerDims(cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim,
                                                 cfg.index_topk), rope, kv, 64, cfg.q_lora_rank, max_kv_rows=n)
    dsa, dense = DsaMlaAttention(gpu, mw, dims, rope, kv, idx, max_kv_rows=n), MlaAttention(gpu, mw, dims, rope, kv)
    table = [2, 0]
    xn = up(gpu, bf16_round(rng.standard_normal((n, D))).astype(BF16))
    slots = np.array([table[r // 16] * 16 + r % 16 for r in range(n)], np.int64)
    pos, sl = up(gpu, np.arange(3, 3 + n, dtype=np.uint32)), up(gpu, slots)
    dsa.write_kv(xn.ptr, n - 1, pos.ptr, 4, sl.ptr, 8)
    bufs = ForwardBuffers(gpu, {"a": 2 * D, "b": 2 * D})
    gpu.copy_h2d(bufs.mtp_meta, pack_mtp_attn_meta(3 + n - 1, int(slots[-1]), n, table, bufs.mtp_meta_capacity))
    last = xn.ptr.offset(2 * D * (n - 1))
    dsa.forward(last, bufs.a, 1, bufs.mtp_meta, bufs.mtp_meta_capacity)
    assert gpu.read(idx.sel, np.int32, cfg.index_topk).tolist() == list(range(n)) + [-1] * (cfg.index_topk - n)
    dense.forward(last, bufs.b, 1, bufs.mtp_meta, bufs.mtp_meta_capacity)
    assert_bf16_near(gpu.read(bufs.a, BF16, D), gpu.read(bufs.b, BF16, D))


def test_dsa_indexer_branch(rng):
    """GLM-5's indexer runs on a branch beside MLA's q path: its key row (LayerNorm + RoPE + store) and head weights
    beside the projection, then its queries, scores and top-k beside absorbed_q; joined right before the attention,
    which reads the selection. The drafts and logits are those of the NumPy device without a side stream."""
    from helpers import BranchLog, branch_sites
    path = glm_ckpt("bf16")
    toks, hs, tok, h = inputs(rng, T)
    watched = BranchLog()
    res = []
    for gpu in (watched, mtp_cupy.device("ref")):
        prop = load(path, gpu=gpu)
        st = prop.alloc_state()
        prop.prefill(st, toks, hs)
        if gpu is watched:
            watched.log.clear()
        res.append(prop.propose(st, tok, h, T, 1, return_logits=True))
    assert res[0].tokens == res[1].tokens and np.array_equal(res[0].logits, res[1].logits)
    sites = branch_sites(watched.log)
    assert [r for _, r in sites] == ["mla_decode_walk"], sites
    side = sites[0][0]
    assert side[1] == "norm_rope_w_bias" and side[-2:] == ["dsa_index_scores", "dsa_topk"], side
    forks = [i for i, (n, s) in enumerate(watched.log) if n == "wait" and s]
    assert len(forks) == 2 and any(n == "rms_norm_strided_w" for n, _ in watched.log[forks[0]:forks[1]]), \
        "the second fork must come after the q latent's norm"


def test_indexer_halves_refuse_bad_rows(rng):
    """prepare and select name a decode batch outside [1, max_rows] before they launch anything."""
    prop = load(glm_ckpt("bf16"))
    ix, gpu = prop.indexer, prop.gpu
    n = gpu.launches
    for m in (0, ix.max_rows + 1):
        with pytest.raises(ConfigError, match="decode rows"):
            ix.prepare(prop.bufs.xn, m, prop.meta, 0)
        with pytest.raises(ConfigError, match="decode rows"):
            ix.select(prop.bufs.xn, m, prop.meta, 0)
    assert gpu.launches == n


# -- whole draft steps -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_prefill_and_propose_match_reference(rng, fmt):
    path = glm_ckpt(fmt)
    prop = load(path)
    ref = GlmMtpRef(ref_weights(path), config_of(path))
    toks, hs, tok, h = inputs(rng, T)
    st = prop.alloc_state()
    assert prop.prefill(st, toks, hs) == T and st.keys == list(range(T))
    cache = prop.gpu.read(prop.kv.base(INDEX_CACHE), BF16, (prop.kv.num_blocks * 16, 64))
    for r in range(T):
        ref.write_row(toks[r + 1], hs[r], r)
        assert rel(cache[st.blocks.slot(r)].astype(np.float64), ref.index_key(toks[r + 1], hs[r], r)) < 1e-2
    pos, dropped = T, 0
    for cycle in range(3):
        res = prop.propose(st, tok, h, pos, K, return_logits=True)
        check_chain(res, ref, tok, h, pos, TOL0, TOL, f"{fmt} cycle {cycle}")
        dropped += len(ref.rows) - len(ref.last_selected)
        acc = int(rng.integers(0, K + 1))
        prop.after_verify(st, acc)
        pos += acc                  # E: the k - a rejected rows go, the accepted drafts' rows stay
        assert st.seq_len == pos and st.keys == list(range(pos)), (cycle, acc, st.keys[-4:])
        ref.truncate(pos)
        tok, h = int(rng.integers(V)), bf16_round(rng.standard_normal(D))
    assert dropped > 0, "the indexer never dropped a row"


def test_matches_transformers(rng):
    pytest.importorskip("transformers")
    from reference.glm_torch import TorchGlmMtp
    path = glm_ckpt("bf16", seed=1)
    w, cfg = ref_weights(path), config_of(path)
    matches_oracle(load(path), GlmMtpRef(w, cfg), TorchGlmMtp(w, cfg), rng, 12, K, TOL0, TOL, "transformers")


def test_head_fp8_drafts_match_reference(rng):
    """head_fp8 scores with an FP8 (per-row scale) copy of the head: the chain against the float64 reference
    whose head is the reference's own per-row FP8 quantisation of the file's head (and the logits are those
    of the FP8 head: the BF16 reference differs by more than its rounding)."""
    path = glm_ckpt("bf16")
    prop = load(path, head_fp8=True)
    assert prop.head.fmt == "fp8_row"
    w, cfg = ref_weights(path), config_of(path)
    w["lm_head.weight"] = quant_fp8_rows(w["lm_head.weight"])
    ref = GlmMtpRef(w, cfg)
    toks, hs, tok, h = inputs(rng, T)
    st = prop.alloc_state()
    prop.prefill(st, toks, hs)
    write_rows([ref], toks, hs, T)
    res = prop.propose(st, tok, h, T, K, return_logits=True)
    check_chain(res, ref, tok, h, T, TOL0, TOL, "head_fp8")


def test_drafts_without_logits_equal_argmax_of_logits(rng):
    """The bf16 head's device argmax (no f32 widening) is the argmax of the returned logits."""
    prop = load(glm_ckpt("bf16"))
    toks, hs, tok, h = inputs(rng, 10)
    st = prop.alloc_state()
    prop.prefill(st, toks, hs)
    a = prop.propose(st, tok, h, 10, K, return_logits=True)
    prop.after_verify(st, 0)
    b = prop.propose(st, tok, h, 10, K)
    assert a.tokens == b.tokens == [int(np.argmax(x)) for x in a.logits]
    assert np.array_equal(a.logits, a.logits.astype(BF16).astype(np.float32))


def test_grammar_mask_and_logprob_stop(rng, caplog):
    prop = load(glm_ckpt("bf16"))
    st, tok, h = masked_drafts_obey(prop, rng, 10)
    res = prop.propose(st, tok, h, 10, K, min_logprob=0.0)         # log-probs are < 0: stops after one
    assert len(res.tokens) == 1 and res.logprobs[0] < 0 and st.seq_len == 11


# -- typed errors, state unchanged ------------------------------------------------------------------------------
def test_errors_leave_state_unchanged(rng):
    prop = load(glm_ckpt("bf16"), max_seq_len=64)
    toks, hs, tok, h = inputs(rng, 10)
    st = prop.alloc_state()
    prop.prefill(st, toks, hs)
    before = snapshot(prop, st)
    bad_calls = [
        (InputError, lambda: prop.propose(st, V, h, 10, 2)),                          # token >= vocab
        (InputError, lambda: prop.propose(st, tok, h, 64, 1)),                        # position >= max_seq_len
        (InputError, lambda: prop.propose(st, tok, h, 62, 3)),                        # drafts run past it
        (InputError, lambda: prop.propose(st, tok, h, 5, 2)),                         # behind the newest row
        (InputError, lambda: prop.prefill(st, toks[:3], hs[:2], start_position=12)),  # a hole
        (InputError, lambda: prop.prefill(st, toks[:3], hs[:2], start_position=9)),   # overwrite
        (InputError, lambda: prop.prefill(st, np.arange(60), hs[:1].repeat(59, 0))),  # past max_seq_len
        (InputError, lambda: prop.prefill(st, [1, 2, 3], hs[:1])),                    # hiddens count
        (InputError, lambda: prop.after_verify(st, 1)),                               # nothing drafted
    ]
    for err, call in bad_calls:
        with pytest.raises(err):
            call()
        assert snapshot(prop, st) == before
    want = prop.propose(st, tok, h, 10, 2).tokens
    prop.after_verify(st, 0)
    assert prop.prefill(st, toks[:3], hs[:2], start_position=10) == 2     # appends at the current length
    prop.free_state(st)
    prop.free_state(st)                                                    # idempotent
    assert prop.kv.free_count == prop.pool_blocks
    with pytest.raises(InputError, match="freed"):
        prop.propose(st, tok, h, 12, 1)
    st = prop.alloc_state()
    prop.prefill(st, toks, hs)
    assert prop.propose(st, tok, h, 10, 2).tokens == want                 # the failed calls changed nothing


def test_kv_pool_exhaustion_is_typed(rng):
    prop = load(glm_ckpt("bf16"), max_seq_len=32, max_sequences=1)   # 2 blocks: one sequence of 32 rows
    toks, hs, _, _ = inputs(rng, 20)
    a, b = prop.alloc_state(), prop.alloc_state()
    prop.prefill(a, toks, hs)
    before = snapshot(prop, a)
    with pytest.raises(CapacityError, match="exhausted"):
        prop.prefill(b, toks, hs)
    assert snapshot(prop, a) == before and b.seq_len == 0


def test_options_and_config_errors(rng):
    with pytest.raises(ConfigError, match="unknown option"):
        load(glm_ckpt("bf16"), mtp_vocab_size=100)
    with pytest.raises(ConfigError, match="head_exchange"):
        load(glm_ckpt("bf16"), head_exchange="gather")
    prop = load_proposer(glm_ckpt("bf16"), mtp_cupy.device("ref"), max_seq_len=64, head_fp8=True, max_drafts=K)
    assert prop.family == "glm5" and prop.head.fmt == "fp8_row" and prop.xchg is None   # no comm: unsharded
    st = prop.alloc_state()
    toks, hs, tok, h = inputs(rng, T)
    prop.prefill(st, toks, hs)
    assert len(prop.propose(st, tok, h, T, K).tokens) == K


# -- GPU -----------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_cuda_matches_ref_device(rng, fmt):
    path = glm_ckpt(fmt, seed=2)
    cuda_matches_ref_device(load, path, rng, T, K, lambda: GlmMtpRef(ref_weights(path), config_of(path)), TOL)


@pytest.mark.gpu
def test_cuda_graph_replay_matches_eager(rng):
    """The first chain per (k, mask, return_logits) runs eagerly, later ones replay a captured graph: same drafts."""
    prop = load(glm_ckpt("bf16", seed=2), mtp_cupy.device("cuda"))
    toks, hs, tok, h = inputs(rng, T)
    st = prop.alloc_state()
    prop.prefill(st, toks, hs)
    for logits in (False, True):
        runs = []
        for _ in range(3):
            runs.append(prop.propose(st, tok, h, T, K, return_logits=logits))
            prop.after_verify(st, 0)
        assert runs[0].tokens == runs[1].tokens == runs[2].tokens
        if logits:
            assert np.array_equal(runs[0].logits, runs[2].logits)
    assert prop._graphs, "no chain was captured"
