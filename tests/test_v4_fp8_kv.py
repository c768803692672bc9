"""Issue 17.4: DeepSeek-V4's fp8 KV rows (kv_cache_dtype="fp8"): the non-RoPE columns as e4m3 in 64-wide blocks
with a power-of-two UE8M0 scale each, the RoPE columns bf16, as the official inference rounds them
(act_quant(kv[..., :-rd], 64, "ue8m0", inplace=True)).

The reference at the top is written from that rule, not from the twins: `encode` computes each block's
exponent with frexp and rounds with ml_dtypes; `attend` is float64 softmax attention over the rows it decodes.
The cache write must match it byte for byte (on both devices), the attention read to float64 accuracy, and the
whole proposer must match transformers' V4 layer with the same rounding hooked in."""
import math

import numpy as np
import pytest

import mtp_cupy
from mtp_cupy import ops
from mtp_cupy.errors import ConfigError
from mtp_cupy.runtime.dtypes import BF16, FP8
from mtp_cupy.runtime.ptr import NULL
from helpers import f32, get, out, rand_bf16, up
from test_paged_attention import META_STRIDE, Paged, check, softmax_attend

BLOCK = 64


# -- the reference ---------------------------------------------------------------------------------------
def layout(width: int, nope: int) -> tuple[int, int, int]:
    """(rope_off, scale_off, row_bytes): codes [0, nope), bf16 RoPE columns at the next 16-byte boundary, one
    exponent byte per block after them, the row padded to 16 bytes."""
    rope_off = math.ceil(nope / 16) * 16
    scale_off = rope_off + 2 * (width - nope)
    return rope_off, scale_off, math.ceil((scale_off + math.ceil(nope / BLOCK)) / 16) * 16


def block_exponent(amax: float) -> int:
    """e with 2^e the smallest power of two >= max(amax, 1e-4) * (1/448), all in float32 (DeepSeek's
    fast_round_scale reads ceil(log2) off the float32 bits)."""
    t = np.float32(max(np.float32(amax), np.float32(1e-4))) * (np.float32(1) / np.float32(448))
    m, e = math.frexp(float(np.float32(t)))          # t = m 2^e, m in [0.5, 1)
    return e - 1 if m == 0.5 else e


def encode(rows: np.ndarray, nope: int) -> np.ndarray:
    """uint8 [n, row_bytes] of bf16 rows [n, width]."""
    n, width = rows.shape
    rope_off, scale_off, row_bytes = layout(width, nope)
    x = rows.astype(np.float32)
    out_ = np.zeros((n, row_bytes), np.uint8)
    for r in range(n):
        for b in range(math.ceil(nope / BLOCK)):
            cols = slice(b * BLOCK, min(nope, (b + 1) * BLOCK))
            e = block_exponent(np.abs(x[r, cols]).max())
            q = np.clip(x[r, cols] * np.float32(2.0 ** -e), -448, 448).astype(FP8)
            out_[r, cols] = q.view(np.uint8)
            out_[r, scale_off + b] = e + 127
        out_[r, rope_off:scale_off] = rows[r, nope:].astype(BF16).view(np.uint8)
    return out_


def decode(raw: np.ndarray, width: int, nope: int) -> np.ndarray:
    rope_off, scale_off, _ = layout(width, nope)
    x = np.zeros((raw.shape[0], width))
    for b in range(math.ceil(nope / BLOCK)):
        cols = slice(b * BLOCK, min(nope, (b + 1) * BLOCK))
        x[:, cols] = raw[:, cols].copy().view(FP8).astype(np.float64) * np.exp2(raw[:, scale_off + b:scale_off + b + 1]
                                                                                 .astype(np.float64) - 127)
    x[:, nope:] = raw[:, rope_off:scale_off].copy().view(BF16).astype(np.float64)
    return x


def test_reference_round_trip_is_the_official_fake_quant():
    """decode(encode(x)) is DeepSeek's in-place act_quant: blocks scaled by a power of two and rounded to e4m3,
    the RoPE columns untouched; an all-zero block gets the 1e-4 floor."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((5, 80)) * np.array([1e-6, 1, 30, 448, 5e3])[:, None]).astype(BF16)
    y = decode(encode(x, 64), 80, 64)
    xf = f32(x).astype(np.float64)
    assert np.array_equal(y[:, 64:], xf[:, 64:])
    for r in range(5):
        s = 2.0 ** block_exponent(np.abs(xf[r, :64]).max())
        assert np.abs(xf[r, :64]).max() / s <= 448 * (1 + 1e-6)
        np.testing.assert_array_equal(y[r, :64], (xf[r, :64] / s).astype(np.float32).astype(FP8).astype(np.float64) * s)
    z = encode(np.zeros((1, 80), BF16), 64)
    assert z[0, layout(80, 64)[1]] == block_exponent(0.0) + 127 and not z[0, :64].any()


# -- the kernels -------------------------------------------------------------------------------------------
SHAPES = [(512, 448), (80, 64), (136, 120), (88, 72), (40, 8)]   # (head_dim, nope); partial last blocks too


def write_rows(dev, rows, nope, slots, pool_rows):
    width = rows.shape[1]
    rb = layout(width, nope)[2]
    cache = out(dev, "u8", (pool_rows, rb))
    src, sl = up(dev, rows), up(dev, np.asarray(slots, np.int64))
    ops.reshape_and_cache_fp8_blocks(dev, src.ptr, width, sl.ptr, 8, cache.ptr, len(rows), width, nope)
    return get(dev, cache, "u8", (pool_rows, rb))


@pytest.mark.parametrize("width,nope", SHAPES)
def test_cache_write_matches_the_reference_byte_for_byte(dev, rng, width, nope):
    rows = (rand_bf16(rng, (9, width)) * BF16.type(rng.choice([1e-3, 1.0, 40.0]))).astype(BF16)
    rows[3] = 0                                                   # an all-zero row
    rows[4, :nope] = BF16.type(448.0 * 8)                         # exactly a power-of-two boundary
    slots = [5, -1, 0, 7, 2, 8, 9, 1, 3]                          # -1: skipped
    got = write_rows(dev, rows, nope, slots, 11)
    want = encode(rows, nope)
    for r, s in enumerate(slots):
        if s >= 0:
            np.testing.assert_array_equal(got[s], want[r], err_msg=f"row {r}")
    assert ops.fp8_block_layout(width, nope) == layout(width, nope)


def _fp8_pool(rng, seqs, width, nope, dev_for_bytes=None):
    """A Paged pool of bf16 rows and the same rows as the blocked fp8 bytes the reference encodes."""
    pg = Paged(rng, seqs, width)
    raw = encode(pg.pool, nope)
    return pg, raw


def run_mla_fp8(dev, pg, raw, q, heads, width, v_width, nope, scale, window=0, sink=None, sel=None):
    n = len(pg.seq_lens)
    qb, cb, mb = up(dev, q), up(dev, raw), up(dev, pg.meta())
    sk = up(dev, np.asarray(sink, np.float32)) if sink is not None else None
    sb = up(dev, np.asarray(sel, np.int32)) if sel is not None else None
    ob = out(dev, "bf16", (n, heads, v_width))
    ops.mla_decode(dev, qb.ptr, cb.ptr, mb.ptr, META_STRIDE, ob.ptr, n, heads, width, v_width, scale, window=window,
                   sink=sk.ptr if sk else NULL, sel=sb.ptr if sb else NULL,
                   sel_stride=sel.shape[1] if sel is not None else 0, kv_dtype="fp8", nope=nope)
    return f32(get(dev, ob, "bf16", (n, heads, v_width)))


def attend(pg, raw, q, width, v_width, nope, scale, window=0, sink=None, sel=None):
    """float64 attention over the decoded rows of each sequence (the reference)."""
    res = []
    for s, n in enumerate(pg.seq_lens):
        lo = n - window if 0 < window < n else 0
        rows = np.arange(lo, n) if sel is None else np.array([r for r in sel[s] if lo <= r < n], np.int64)
        t = np.asarray(pg.tables[s])
        kv = decode(raw[t[rows // 16] * 16 + rows % 16], width, nope) if len(rows) else np.zeros((0, width))
        res.append(softmax_attend(f32(q[s]).astype(np.float64), kv, kv[:, :v_width], scale, sink))
    return np.stack(res)


@pytest.mark.parametrize("width,nope", SHAPES)
def test_attention_reads_the_fp8_rows_exactly(dev, rng, width, nope):
    seqs, heads = [1, 17, 40, 130], 5
    pg, raw = _fp8_pool(rng, seqs, width, nope)
    q = rand_bf16(rng, (len(seqs), heads, width))
    sink = rng.standard_normal(heads).astype(np.float32)
    scale = width ** -0.5
    check(run_mla_fp8(dev, pg, raw, q, heads, width, width, nope, scale), attend(pg, raw, q, width, width, nope, scale))
    check(run_mla_fp8(dev, pg, raw, q, heads, width, width, nope, scale, window=16, sink=sink),
          attend(pg, raw, q, width, width, nope, scale, window=16, sink=sink))


# -- the layer and the proposer --------------------------------------------------------------------------
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from width_oracles import V4Mtp, assert_batch_equals_single, chain_errors, read_checkpoint, rel, tiny  # noqa: E402

V4_CASES = {"tiny": {}, "head80": dict(head_dim=80, qk_rope_head_dim=16), "head136_partial": dict(
    head_dim=136, qk_rope_head_dim=24)}


def _v4(dev, dims, kv, **kw):
    return mtp_cupy.load_proposer(tiny("deepseek_v4", **dims), dev, max_seq_len=64, kv_cache_dtype=kv, **kw)


@pytest.mark.parametrize("case", sorted(V4_CASES))
def test_cache_rows_are_the_bf16_rows_quantised(dev, case):
    """Prefill the same rows into a bf16-KV and an fp8-KV proposer: every fp8 cache row is the reference
    encoding of the bf16 proposer's row (the layers before the cache compute the same bits)."""
    dims = V4_CASES[case]
    a, b = _v4(dev, dims, "bf16"), _v4(dev, dims, "fp8")
    rng = np.random.default_rng(4)
    toks, hs = rng.integers(0, a.vocab_size, 30), rng.standard_normal((29, a.hidden_size)).astype(np.float32)
    sa, sb = a.alloc_state(), b.alloc_state()
    a.prefill(sa, toks, hs)
    b.prefill(sb, toks, hs)
    hd, nope = a.cfg.head_dim, a.cfg.head_dim - a.cfg.qk_rope_head_dim
    rb = layout(hd, nope)[2]
    assert b.kv.specs["kv"].row_bytes == rb < 2 * hd
    slots = [sa.blocks.slot(r) for r in range(29)]
    bf = dev.read(a.kv.base("kv"), BF16, (max(slots) + 1, hd))[slots]
    got = dev.read(b.kv.base("kv"), np.uint8, (max(slots) + 1, rb))[[sb.blocks.slot(r) for r in range(29)]]
    np.testing.assert_array_equal(got, encode(bf, nope))


@pytest.mark.parametrize("case", sorted(V4_CASES))
def test_proposer_matches_transformers_with_the_official_rounding(dev, case):
    """Three chained drafts against transformers' V4 layer whose kv rows get the same rounding, and closer to it
    (over two prompts) than to the unrounded layer. The bounds are twice the bf16 path's: a kv element the
    device computes one bf16 ulp away from the float64 layer lands on the other side of an e4m3 rounding
    boundary now and then, a whole e4m3 step (the exact check is the byte-for-byte one above)."""
    dims = V4_CASES[case]
    w, cfg = read_checkpoint(tiny("deepseek_v4", **dims))
    exact, rounded = V4Mtp(w, cfg), V4Mtp(w, cfg, kv_fp8=True)
    near = far = 0.0
    for seed in (3, 4):
        errs, _ = chain_errors(_v4(dev, dims, "fp8"), rounded, seed=seed, streams=True)
        assert errs[0] <= 2.5e-2 and max(errs) <= 3e-2, errs
        off, _ = chain_errors(_v4(dev, dims, "fp8"), exact, seed=seed, streams=True)
        near, far = near + sum(errs), far + sum(off)
    assert near < far, (near, far)


def test_option_and_refusals():
    """kv_cache_dtype is "fp8" by default (the official numerics; "bf16" by option);
    a bad value, or fp8 with no non-RoPE column, is a ConfigError naming it, before any allocation."""
    from mtp_cupy.models.deepseek_v4 import DeepseekV4MtpProposer
    from test_attention_widths import CountingRef
    assert DeepseekV4MtpProposer.Options().kv_cache_dtype == "fp8"
    default = mtp_cupy.load_proposer(tiny("deepseek_v4"), mtp_cupy.device("ref"), max_seq_len=64)
    hd, rot = default.cfg.head_dim, default.cfg.qk_rope_head_dim
    assert default.kv.specs["kv"].row_bytes == layout(hd, hd - rot)[2]
    with pytest.raises(ConfigError, match="kv_cache_dtype='int8'.*bf16, fp8"):
        DeepseekV4MtpProposer.Options(kv_cache_dtype="int8")
    gpu = CountingRef()
    with pytest.raises(ConfigError, match="qk_rope_head_dim = 64 .*head_dim = 64"):
        mtp_cupy.load_proposer(tiny("deepseek_v4", qk_rope_head_dim=64), gpu.dev, max_seq_len=64,
                               kv_cache_dtype="fp8")
    assert gpu.allocs == 0
    props = DeepseekV4MtpProposer.properties(mtp_cupy.weights.load_config(tiny("deepseek_v4")),
                                             DeepseekV4MtpProposer.Options(kv_cache_dtype="fp8"))
    assert props["kv_cache"].startswith("fp8: e4m3 x 48 in 64-blocks") and "(96 bytes a row)" in props["kv_cache"]


def test_batch_drafts_what_single_sequences_draft():
    """Batch invariance with fp8 rows: three sequences drafted together, bit for bit what each drafts alone."""
    assert_batch_equals_single(lambda: _v4(mtp_cupy.device("ref"), V4_CASES["head80"], "fp8", max_batch=4),
                               [2, 11, 19], seed=6)


def test_graphs_replay_what_eager_runs():
    """The fp8 path under (emulated) graph capture: the staged slabs carry every per-call value."""
    from width_oracles import assert_graphs_equal_eager, ref_with_emulated_graphs
    assert_graphs_equal_eager(lambda gpu: _v4(gpu, V4_CASES["head80"], "fp8", max_batch=4),
                              ref_with_emulated_graphs())


# -- CUDA against the twin -------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("width,nope", SHAPES)
def test_fp8_cache_write_cuda_equals_twin(rng, width, nope):
    """The write is exact arithmetic (a max, a power of two, one rounding): CUDA and the twin agree bit for
    bit, and with the reference, at real V4 dims (512 / 448) and off-tile ones."""
    rows = rand_bf16(rng, (300, width), 3.0)
    slots = rng.permutation(320)[:300]
    a = write_rows(mtp_cupy.device("ref"), rows, nope, slots, 320)
    b = write_rows(mtp_cupy.device("cuda"), rows, nope, slots, 320)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(b[slots], encode(rows, nope))


@pytest.mark.gpu
@pytest.mark.parametrize("heads,width,nope,window,seqs", [(64, 512, 448, 128, [2048, 5]), (4, 80, 64, 8, [300, 33]),
                                                           (33, 136, 120, 0, [700, 1])])
def test_fp8_attention_cuda_vs_twin(rng, heads, width, nope, window, seqs):
    pg, raw = _fp8_pool(rng, seqs, width, nope)
    q = rand_bf16(rng, (len(seqs), heads, width))
    sink = rng.standard_normal(heads).astype(np.float32)
    a = run_mla_fp8(mtp_cupy.device("ref"), pg, raw, q, heads, width, width, nope, width ** -0.5, window, sink)
    b = run_mla_fp8(mtp_cupy.device("cuda"), pg, raw, q, heads, width, width, nope, width ** -0.5, window, sink)
    check(b, a.astype(np.float64))
    check(a, attend(pg, raw, q, width, width, nope, width ** -0.5, window, sink))


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(V4_CASES))
def test_fp8_proposer_cuda_vs_twin(case):
    dims = V4_CASES[case]
    w, cfg = read_checkpoint(tiny("deepseek_v4", **dims))
    rounded = V4Mtp(w, cfg, kv_fp8=True)
    (er, rr), (eg, rg) = [chain_errors(_v4(mtp_cupy.device(k), dims, "fp8"), rounded, streams=True)
                          for k in ("ref", "cuda")]
    assert eg[0] <= 2.5e-2 and max(eg) <= 3e-2, eg
    assert rel(rg.logits[0], rr.logits[0]) <= 1.5e-2


@pytest.mark.gpu
def test_fp8_graphs_replay_what_eager_runs_on_cuda():
    from width_oracles import assert_graphs_equal_eager
    assert_graphs_equal_eager(lambda gpu: _v4(gpu, V4_CASES["head80"], "fp8", max_batch=4), mtp_cupy.device("cuda"))
