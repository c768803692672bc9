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
from helpers import f32, get, out, rand_bf16, rel_err, run_on_both, up
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
# The two devices sum the off-tile widths in different chunks, so a few bf16 outputs land 1-2 ulp apart (an
# H200 run: at most 2 ulp, on under 2% of elements); over a whole tensor that stays well under 3e-3, while one
# wrong row or column is far above it. Each device also meets the float64 reference above (through `dev`).
TWIN_TOL = 3e-3


@pytest.mark.gpu
@pytest.mark.parametrize("heads,rw,dv", MLA_WIDTHS + [(64, 528, 496), (128, 568, 504)])
def test_mla_off_tile_cuda_vs_twin(rng, heads, rw, dv):
    seqs = [1, 63, 700, 2049]
    pg = Paged(rng, seqs, rw)
    q = rand_bf16(rng, (len(seqs), heads, rw))
    a, b = run_on_both(lambda d: run_mla(d, pg, q, heads, rw, dv, rw ** -0.5))
    check(b, a.astype(np.float64))
    assert rel_err(b, a) < TWIN_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype,hd", [("bf16", 32), ("bf16", 40), ("bf16", 200), ("fp8", 48), ("fp8", 80)])
def test_gqa_off_tile_cuda_vs_twin(rng, kv_dtype, hd):
    seqs, qh, kvh = [3, 900, 40], 8, 2
    kc, vc = Paged(rng, seqs, kvh * hd, kv_dtype), Paged(rng, seqs, kvh * hd, kv_dtype)
    vc.tables = kc.tables
    q = rand_bf16(rng, (len(seqs), qh * hd))
    a, b = run_on_both(lambda d: run_gqa(d, kc, vc, q, qh * hd, qh, kvh, hd, hd ** -0.5, kv_dtype, 0.5))
    check(b, a.astype(np.float64))
    assert rel_err(b, a) < TWIN_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("heads,hd", [(4, 40), (32, 96), (48, 200)])   # 64 x 200 is past the shared-memory limit
def test_dsa_scores_any_head_dim_cuda_vs_twin(rng, heads, hd):
    seqs = [5, 300, 1000]
    pg = Paged(rng, seqs, hd)
    q = rand_bf16(rng, (len(seqs), heads, hd))
    w = rng.standard_normal((len(seqs), heads)).astype(np.float32)
    a, b = run_on_both(lambda d: _index_scores(d, q, w, pg, heads, hd, 1024, 0.1))
    for s, n in enumerate(seqs):
        assert rel_err(b[s, :n], a[s, :n]) < 1e-5


# -- whole proposers at such widths against transformers' decoder layers ------------------------------------
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
import mtp_cupy  # noqa: E402
from mtp_cupy.errors import ConfigError  # noqa: E402
from width_oracles import chain_errors, oracle_for, rel as rel64, tiny  # noqa: E402

TOL0, TOL = 1.5e-2, 2.5e-2     # the first draft; chained drafts (the bf16 carried hidden compounds)

# (family, tiny-checkpoint dims, options, the carried hidden at those options): each an attention width off the
# 64-column tile
WIDTH_CASES = {
    "v3_mla_row48": ("deepseek_v3", dict(kv_lora_rank=32, qk_rope_head_dim=16, fmt="bf16"), {}, "post_norm"),
    "v3_fp8_mla_row72": ("deepseek_v3", dict(kv_lora_rank=48, qk_rope_head_dim=24, qk_nope_head_dim=48,
                                             v_head_dim=24), {}, "post_norm"),
    "glm5_row48_index40": ("glm5", dict(kv_lora_rank=32, qk_rope_head_dim=16, index_head_dim=40), {}, "post_norm"),
    "v4_head80": ("deepseek_v4", dict(head_dim=80, qk_rope_head_dim=16), dict(kv_cache_dtype="bf16"), None),
    "qwen_head32": ("qwen3_next", dict(head_dim=32), {}, "post_norm"),
    "qwen_head48_fp8kv": ("qwen3_next", dict(head_dim=48), dict(quantization="stored", kv_cache_dtype="fp8",
                                                                 kv_scale=0.25), "post_norm"),
}


def _load(dev, family, dims, opts, **kw):
    return mtp_cupy.load_proposer(tiny(family, **dims), dev, max_seq_len=64, **opts, **kw)


@pytest.mark.parametrize("case", sorted(WIDTH_CASES))
def test_proposer_matches_transformers_at_off_tile_widths(dev, case):
    """Prefill, then a chain of three drafts, each against transformers' layer wrapped into the MTP module
    (the fp8-K/V case is held to the same bounds: transformers keeps K/V in float64)."""
    family, dims, opts, carried = WIDTH_CASES[case]
    prop = _load(dev, family, dims, opts)
    oracle, _, _ = oracle_for(tiny(family, **dims))
    errs, _ = chain_errors(prop, oracle, carried=carried or "post_norm")
    assert errs[0] <= TOL0 and max(errs) <= TOL, f"{case}: {errs}"


# -- refused at load, naming the field; nothing allocated ---------------------------------------------------
def _config_only(tmp_path, family, **dims):
    """A checkpoint directory with only config.json: the checks run before any tensor is read."""
    import json
    d = tiny(family)
    cfg = {**json.loads((d / "config.json").read_text()), **dims}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


class CountingRef:
    """The NumPy device, counting allocations: a refused load must make none."""

    def __init__(self):
        from mtp_cupy.refdev.backend import RefBackend
        self.dev = RefBackend()
        self.allocs = 0
        real = self.dev.alloc

        def alloc(nbytes):
            self.allocs += 1
            return real(nbytes)
        self.dev.alloc = alloc


REFUSED = [   # (family, config fields, options, what the message must name)
    ("deepseek_v3", dict(kv_lora_rank=20), {}, "kv_lora_rank = 20"),
    ("deepseek_v3", dict(kv_lora_rank=512, qk_rope_head_dim=128), {}, "kv_lora_rank + qk_rope_head_dim = 640"),
    ("deepseek_v3", dict(qk_rope_head_dim=12), {}, "qk_rope_head_dim = 12"),
    ("deepseek_v3", dict(qk_nope_head_dim=40), {}, "qk_nope_head_dim = 40"),      # fp8: W_UK^T needs 16
    ("deepseek_v3", dict(n_group=3), {}, "n_group = 3"),
    ("deepseek_v3", dict(num_experts_per_tok=40), {}, "num_experts_per_tok = 40"),
    ("glm5", dict(index_head_dim=300), {}, "index_head_dim = 300"),
    ("glm5", dict(index_n_heads=200), {}, "index_n_heads = 200"),
    ("deepseek_v4", dict(head_dim=520), {}, "head_dim = 520"),
    ("deepseek_v4", dict(head_dim=84), {}, "head_dim = 84"),
    ("deepseek_v4", dict(o_groups=3), {}, "o_groups = 3"),
    ("deepseek_v4", dict(qk_rope_head_dim=64), dict(kv_cache_dtype="fp8"), "qk_rope_head_dim = 64"),
    ("qwen3_next", dict(head_dim=36), {}, "head_dim = 36"),
    ("qwen3_next", dict(head_dim=40), dict(kv_cache_dtype="fp8"), "head_dim = 40"),
    ("qwen3_next", dict(num_key_value_heads=3), {}, "num_key_value_heads = 3"),
    ("qwen3_next", dict(hidden_size=264), dict(quantization="nvfp4"), "hidden_size = 264"),
]


@pytest.mark.parametrize("family,fields,opts,names", REFUSED)
def test_unsupported_widths_are_refused_at_load(tmp_path, family, fields, opts, names):
    """ConfigError from load_proposer naming the field and its value and the supported range, before any device
    allocation (a config-only directory: not one tensor is read either)."""
    gpu = CountingRef()
    with pytest.raises(ConfigError, match="supported") as e:
        mtp_cupy.load_proposer(_config_only(tmp_path, family, **fields), gpu.dev, max_seq_len=64, **opts)
    assert names in str(e.value), str(e.value)
    assert gpu.allocs == 0 and gpu.dev.bytes_in_use == 0


SWEEP = {   # widths a user might give a tiny test model: each either loads and drafts, or is refused at load
    "deepseek_v3": [dict(kv_lora_rank=c, qk_rope_head_dim=r, qk_nope_head_dim=n, v_head_dim=v, fmt="bf16")
                    for c, r, n, v in ((8, 8, 8, 8), (16, 24, 8, 40), (24, 8, 16, 12), (40, 40, 24, 8), (12, 8, 8, 8),
                                       (16, 6, 8, 8))],
    "deepseek_v4": [dict(head_dim=h, qk_rope_head_dim=r) for h, r in ((8, 2), (24, 8), (40, 24), (96, 32), (20, 4))],
    "qwen3_next": [dict(head_dim=h, partial_rotary_factor=f) for h, f in ((8, 0.25), (16, 0.5), (40, 0.2),
                                                                            (104, 0.25), (12, 0.5))],
}


@pytest.mark.parametrize("family", sorted(SWEEP))
def test_never_fails_at_the_first_propose(family):
    """Over a sweep of widths, a configuration either drafts (prefill, a batched and a single propose, an
    after_verify) or is refused by load_proposer with a ConfigError: never a KernelError later."""
    dev, ran = mtp_cupy.device("ref"), 0
    for dims in SWEEP[family]:
        try:
            prop = _load(dev, family, dims, {}, max_batch=2)
        except ConfigError as e:
            assert "supported" in str(e), str(e)
            continue
        rng = np.random.default_rng(0)
        D, V = prop.hidden_size, prop.vocab_size
        sts = [prop.alloc_state() for _ in range(2)]
        for st in sts:
            prop.prefill(st, rng.integers(0, V, 6), rng.standard_normal((5, D)).astype(np.float32))
        prop.propose_batch(sts, [1, 2], rng.standard_normal((2, D)).astype(np.float32), [5, 5], 2)
        prop.after_verify(sts[0], 1)
        prop.propose(sts[0], 3, rng.standard_normal(D).astype(np.float32), 6, 2)
        ran += 1
    assert ran >= 3, f"only {ran} of the {family} sweep ran"


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(WIDTH_CASES))
def test_off_tile_widths_cuda_vs_twin(case):
    """CUDA against the NumPy device on the same checkpoint and inputs: accumulation order only."""
    family, dims, opts, carried = WIDTH_CASES[case]
    out = []
    for kind in ("ref", "cuda"):
        prop = _load(mtp_cupy.device(kind), family, dims, opts)
        oracle, _, _ = oracle_for(tiny(family, **dims))
        out.append(chain_errors(prop, oracle, carried=carried or "post_norm"))
    (er, rr), (eg, rg) = out
    assert eg[0] <= TOL0 and max(eg) <= TOL, f"{case} cuda vs transformers: {eg}"
    assert rel64(rg.logits[0], rr.logits[0]) <= 1e-2


@pytest.mark.parametrize("case", ["v3_mla_row48", "v4_head80", "qwen_head32"])
def test_off_tile_batches_draft_what_single_sequences_draft(case):
    from width_oracles import assert_batch_equals_single
    family, dims, opts, _ = WIDTH_CASES[case]
    assert_batch_equals_single(lambda: _load(mtp_cupy.device("ref"), family, dims, opts, max_batch=4), [1, 9, 21],
                               seed=7)


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v4", "qwen3_next", "glm5"])
@pytest.mark.parametrize("quant", [None, "fp8", "nvfp4"])
def test_real_dims_pass_the_load_checks(family, quant):
    """The released models' dims (the benchmarks' REAL configs) pass every load-time check, in every format."""
    from mtp_cupy.bench.drafter import real_config
    from mtp_cupy.families import family as fam
    from mtp_cupy.weights import load_config
    d = dict(real_config(family))
    if quant == "fp8":
        d["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    elif quant == "nvfp4":
        d["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4"}
    cfg = load_config(d)
    P = fam(family).proposer
    P.check_config(cfg, P.Options())
    if family == "deepseek_v3":
        P.check_config(load_config({**d, "model_type": "deepseek_v32", "index_n_heads": 64, "index_head_dim": 128,
                                    "index_topk": 2048}), P.Options())
    if family == "deepseek_v4":
        P.check_config(cfg, P.Options(kv_cache_dtype="fp8"))
    if family == "qwen3_next":
        for q in ("stored", "nvfp4", "fp8"):
            P.check_config(cfg, P.Options(quantization=q))


@pytest.mark.parametrize("case", ["v3_mla_row48", "qwen_head32"])
def test_off_tile_graphs_replay_what_eager_runs(case):
    from width_oracles import assert_graphs_equal_eager, ref_with_emulated_graphs
    family, dims, opts, _ = WIDTH_CASES[case]
    assert_graphs_equal_eager(lambda gpu: _load(gpu, family, dims, opts, max_batch=4), ref_with_emulated_graphs())


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(WIDTH_CASES))
def test_off_tile_graphs_replay_what_eager_runs_on_cuda(case):
    from width_oracles import assert_graphs_equal_eager
    family, dims, opts, _ = WIDTH_CASES[case]
    assert_graphs_equal_eager(lambda gpu: _load(gpu, family, dims, opts, max_batch=4), mtp_cupy.device("cuda"))
