"""DeepSeek-V3 MTP proposer on the NumPy device against the independent float64 reference
(tests/reference/deepseek_ref.py) and transformers' DeepseekV3 decoder layer, for FP8-block and BF16
checkpoints; the loader's key map, formats and fallbacks; typed errors that leave the state unchanged."""
import json
import shutil

import numpy as np
import pytest

import mtp_cupy
from mtp_cupy.errors import CapacityError, ConfigError, InputError, WeightError
from mtp_cupy.models import deepseek_v3 as deepseek_mtp
from mtp_cupy.runtime.dtypes import BF16, FP8, bf16_round
from mtp_cupy.weights import Checkpoint, dequant_linear, load_config
from mtp_cupy.weights import quant_host as qh
from mtp_cupy.weights.deepseek_v3 import load_deepseek_v3
from deepseek_util import (check_chain, config_of, cuda_matches_ref_device, inputs, matches_oracle, ref_weights,
                           masked_drafts_obey, references_agree, rel, snapshot, tiny_ckpt)
from reference.deepseek_ref import DeepseekMtpRef

T, K, D, V = 24, 3, 256, 512
# Logits tolerance vs float64, first draft / chained drafts. Measured on this tiny model (bf16 activations
# throughout, as the kernels store them): first draft mean 6.5e-3, sd 0.8e-3, max 9.9e-3 over 326 samples;
# chained drafts up to 1.6e-2 (each feeds on a bf16 carried hidden that already holds the previous error).
TOL0, TOL = 1.5e-2, 2.5e-2


def load(path, gpu=None, **kw):
    return deepseek_mtp.from_checkpoint(path, gpu or mtp_cupy.device("ref"), max_seq_len=kw.pop("max_seq_len", 256), **kw)


# -- the reference itself ------------------------------------------------------------------------------
def test_reference_matches_transformers(rng):
    """The float64 reference (naive MLA, written from docs/model_math.md) against transformers' layer: both are
    float64 but transformers computes RoPE angles and router logits in float32."""
    pytest.importorskip("transformers")
    from reference.deepseek_torch import TorchDeepseekMtp
    path = tiny_ckpt("fp8")
    w, cfg = ref_weights(path), config_of(path)
    references_agree(DeepseekMtpRef(w, cfg), TorchDeepseekMtp(w, cfg), rng, 6, tie=1e-5)


# -- loader ------------------------------------------------------------------------------------------------
def test_loader_formats_and_transposed_uk():
    path = tiny_ckpt("fp8")
    gpu, cfg = mtp_cupy.device("ref"), load_config(path)
    w = load_deepseek_v3(gpu, path, cfg)
    assert (w.eh_proj.fmt, w.router.fmt, w.head.fmt) == ("bf16", "bf16", "bf16")
    assert {w.q_a.fmt, w.q_b.fmt, w.kv_a.fmt, w.kv_b.fmt, w.o_proj.fmt, w.w_uk_t.fmt} == {"fp8_block"}
    assert all(x.fmt == "fp8_block" for e in w.experts.values() for x in e) and len(w.experts) == 16
    H, C, dn, dv = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.v_head_dim
    kvb = dequant_linear(Checkpoint(path), cfg.mtp_prefix + "self_attn.kv_b_proj").reshape(H, dn + dv, C)
    s = gpu.read(w.w_uk_t.scale, np.float32, (-(-H * C // 128), 1))
    got = qh.dequant_fp8_block(gpu.read(w.w_uk_t.weight, FP8, (H * C, dn)), s)
    assert np.array_equal(got, kvb[:, :dn].transpose(0, 2, 1).reshape(H * C, dn))
    assert np.allclose(gpu.read(w.bias, np.float32, 16), Checkpoint(path).numpy(cfg.mtp_prefix + "mlp.gate.e_score_correction_bias"))


def test_transposed_uk_falls_back_to_bf16_when_blocks_do_not_transpose():
    """kv_lora 192: a transposed 128-row block spans two latent blocks of kv_b with different scales."""
    path = tiny_ckpt("fp8", kv_lora_rank=192)
    gpu, cfg = mtp_cupy.device("ref"), load_config(path)
    w = load_deepseek_v3(gpu, path, cfg)
    H, C, dn, dv = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.v_head_dim
    assert w.w_uk_t.fmt == "bf16"
    kvb = dequant_linear(Checkpoint(path), cfg.mtp_prefix + "self_attn.kv_b_proj").reshape(H, dn + dv, C)
    want = kvb[:, :dn].transpose(0, 2, 1).reshape(H * C, dn)
    assert np.array_equal(gpu.read(w.w_uk_t.weight, BF16, (H * C, dn)).astype(np.float32), want.astype(BF16).astype(np.float32))


def test_embed_head_fallback_to_layer_copies(rng):
    """Without the top-level embed/head the MTP layer's own copies load, and the drafts are the same."""
    a = load(tiny_ckpt("bf16", seed=3))
    b = load(tiny_ckpt("bf16", seed=3, top_level=False))
    toks, hs, tok, h = inputs(rng, 4)
    out = []
    for p in (a, b):
        st = p.alloc_state()
        p.prefill(st, toks, hs)
        out.append(p.propose(st, tok, h, 4, 2, return_logits=True))
    assert out[0].tokens == out[1].tokens and np.array_equal(out[0].logits, out[1].logits)
    with pytest.raises(WeightError, match="embed_tokens"):
        load(tiny_ckpt("bf16", seed=3, top_level=False, layer_copies=False))


def test_bf16_mtp_layer_inside_fp8_model(tmp_path):
    """The format is read per tensor: a config declaring FP8 with a BF16 MTP layer loads as BF16."""
    path = tmp_path / "ck"
    shutil.copytree(tiny_ckpt("bf16"), path)
    cfg = config_of(path)
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (path / "config.json").write_text(json.dumps(cfg))
    prop = load(path)
    assert prop.w.kv_b.fmt == prop.w.q_b.fmt == prop.w.w_uk_t.fmt == "bf16"


def test_shape_mismatch_names_the_key(tmp_path):
    path = tmp_path / "ck"
    shutil.copytree(tiny_ckpt("fp8"), path)
    cfg = config_of(path)
    cfg["qk_nope_head_dim"] = 64                               # q_b / kv_b rows no longer match
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WeightError, match=r"q_b_proj.*expected shape|expected shape.*q_b_proj"):
        load(path)


# -- whole draft steps vs the reference ------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["fp8", "bf16"])
def test_prefill_and_propose_match_reference(rng, fmt):
    path = tiny_ckpt(fmt)
    prop = load(path)
    ref = DeepseekMtpRef(ref_weights(path), config_of(path))
    toks, hs, tok, h = inputs(rng, T)
    st = prop.alloc_state()
    assert prop.prefill(st, toks, hs) == T and st.keys == list(range(T))
    rows = prop.gpu.read(prop.kv.base("latent"), BF16, (prop.kv.num_blocks * 16, prop.dims.row_width))
    for r in range(T):
        ref.write_row(toks[r + 1], hs[r], r)
        c, kpe = ref.latent(toks[r + 1], hs[r], r)
        assert rel(rows[st.blocks.slot(r)].astype(np.float64), np.concatenate([c, kpe])) < 1e-2
    pos = T
    for cycle in range(3):          # propose, verify, continue from the next drafter row
        res = prop.propose(st, tok, h, pos, K, return_logits=True)
        check_chain(res, ref, tok, h, pos, TOL0, TOL, f"{fmt} cycle {cycle}")
        acc = int(rng.integers(0, K + 1))
        prop.after_verify(st, acc)
        pos += acc                  # E: the k - a rejected rows go, the accepted drafts' rows stay
        assert st.seq_len == pos and st.keys == list(range(pos)), (cycle, acc, st.keys[-4:])
        ref.truncate(pos)
        tok, h = int(rng.integers(V)), bf16_round(rng.standard_normal(D))


def test_real_head_dims_match_reference(rng):
    """V3's per-head attention dims (latent 512 + rope 64, nope 128, v 128: q_b heads of 192 rows straddle its
    128-row FP8 blocks, W_UK^T spans four blocks per head) on a narrow model, against the reference."""
    dims = dict(hidden_size=512, num_attention_heads=8, q_lora_rank=384, kv_lora_rank=512, qk_nope_head_dim=128,
                qk_rope_head_dim=64, v_head_dim=128, moe_intermediate_size=128, vocab_size=1024)
    path = tiny_ckpt("fp8", seed=4, **dims)
    prop, ref = load(path), DeepseekMtpRef(ref_weights(path), config_of(path))
    assert prop.w.w_uk_t.fmt == "fp8_block" and prop.dims.row_width == 576
    toks, hs = rng.integers(0, 1024, 21), bf16_round(rng.standard_normal((20, 512)))
    tok, h = int(rng.integers(1024)), bf16_round(rng.standard_normal(512))
    st = prop.alloc_state()
    prop.prefill(st, toks, hs)
    for r in range(20):
        ref.write_row(toks[r + 1], hs[r], r)
    check_chain(prop.propose(st, tok, h, 20, K, return_logits=True), ref, tok, h, 20, TOL0, TOL, "real heads")


@pytest.mark.parametrize("fmt", ["fp8", "bf16"])
def test_matches_transformers(rng, fmt):
    pytest.importorskip("transformers")
    from reference.deepseek_torch import TorchDeepseekMtp
    path = tiny_ckpt(fmt, seed=1)
    w, cfg = ref_weights(path), config_of(path)
    matches_oracle(load(path), DeepseekMtpRef(w, cfg), TorchDeepseekMtp(w, cfg), rng, 8, K, TOL0, TOL,
                   f"transformers {fmt}")


def test_mtp_vocab_size_limits_the_head(rng):
    prop = load(tiny_ckpt("bf16"), mtp_vocab_size=300)
    full = load(tiny_ckpt("bf16"))
    toks, hs, tok, h = inputs(rng, 4)
    res = []
    for p in (prop, full):
        st = p.alloc_state()
        p.prefill(st, toks, hs)
        res.append(p.propose(st, tok, h, 4, 1, return_logits=True))
    assert res[0].logits.shape == (1, V) and np.isneginf(res[0].logits[0, 300:]).all()
    assert np.array_equal(res[0].logits[0, :300], res[1].logits[0, :300])
    assert res[0].tokens[0] == int(np.argmax(res[1].logits[0, :300]))


# -- typed errors, state unchanged ----------------------------------------------------------------------
def test_errors_leave_state_unchanged(rng):
    prop = load(tiny_ckpt("fp8"), max_seq_len=64)
    toks, hs, tok, h = inputs(rng, 10)
    st = prop.alloc_state()
    prop.prefill(st, toks, hs)
    before = snapshot(prop, st)
    bad_calls = [
        (InputError, lambda: prop.propose(st, V, h, 10, 2)),                          # token >= vocab
        (InputError, lambda: prop.propose(st, -1, h, 10, 2)),
        (InputError, lambda: prop.propose(st, tok, h, 64, 1)),                        # position >= max_seq_len
        (InputError, lambda: prop.propose(st, tok, h, 62, 3)),                        # drafts run past it
        (InputError, lambda: prop.propose(st, tok, h[:100], 10, 2)),                  # wrong hidden size
        (InputError, lambda: prop.propose(st, tok, h.astype(np.float16), 10, 2)),     # wrong dtype
        (InputError, lambda: prop.propose(st, tok, np.full(D, np.nan, np.float32), 10, 2)),
        (InputError, lambda: prop.propose(st, tok, h, 5, 2)),                         # behind the newest row
        (InputError, lambda: prop.propose(st, tok, h, 10, 99)),                       # too many drafts
        (InputError, lambda: prop.prefill(st, [1, V], hs[:1])),                      # prefill token >= vocab
        (InputError, lambda: prop.prefill(st, [1, 2, 3], hs[:1])),                   # hiddens count
        (InputError, lambda: prop.prefill(st, np.arange(60), hs[:1].repeat(59, 0))), # past max_seq_len
        (InputError, lambda: prop.after_verify(st, 1)),                               # nothing drafted
    ]
    for err, call in bad_calls:
        with pytest.raises(err):
            call()
        assert snapshot(prop, st) == before
    want = prop.propose(st, tok, h, 10, 2).tokens
    prop.after_verify(st, 0)
    assert prop.propose(st, tok, h, 10, 2).tokens == want      # the failed calls changed nothing


def test_kv_pool_exhaustion_is_typed_and_changes_nothing(rng):
    prop = load(tiny_ckpt("bf16"), max_seq_len=64, max_sequences=1)   # 4 blocks: one sequence of 64 rows
    toks, hs, tok, h = inputs(rng, 40)
    a, b = prop.alloc_state(), prop.alloc_state()
    prop.prefill(a, toks, hs)
    before_a, free = snapshot(prop, a), prop.kv.free_count
    with pytest.raises(CapacityError, match="exhausted"):
        prop.prefill(b, toks, hs)
    with pytest.raises(CapacityError, match="exhausted"):
        prop.prefill(b, toks[:33], hs[:32])
    assert snapshot(prop, a) == before_a and prop.kv.free_count == free and b.seq_len == 0
    prop.free_state(a)
    prop.free_state(a)                                         # idempotent
    assert prop.kv.free_count == prop.pool_blocks
    assert prop.prefill(b, toks, hs) == 40


def test_load_proposer_dispatches_here():
    prop = mtp_cupy.load_proposer(tiny_ckpt("bf16"), gpu=mtp_cupy.device("ref"), max_seq_len=64, max_sequences=2)
    assert isinstance(prop, deepseek_mtp.DeepseekV3MtpProposer) and prop.pool_blocks == 8
    assert prop.sequences_that_fit() == 2


def test_options_and_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="unknown option"):
        load(tiny_ckpt("bf16"), kv_blocks=4)

    class TwoRanks:
        world = 2
    with pytest.raises(ConfigError, match="one GPU"):
        deepseek_mtp.from_checkpoint(tiny_ckpt("bf16"), mtp_cupy.device("ref"), comm=TwoRanks())
    path = tmp_path / "ck"
    shutil.copytree(tiny_ckpt("bf16"), path)
    cfg = config_of(path)
    cfg["scoring_func"] = "softmax"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="sigmoid"):
        load(path)


def test_grammar_mask_restricts_drafts(rng, caplog):
    prop = load(tiny_ckpt("bf16"))
    st, tok, h = masked_drafts_obey(prop, rng, 4)
    res = prop.propose(st, tok, h, 4, 1, grammar_bitmask=np.zeros(V // 32, np.int32))
    assert res.tokens == [0] and "allowed no token" in caplog.text


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8", "bf16"])
def test_cuda_matches_ref_device(rng, fmt):
    path = tiny_ckpt(fmt, seed=2)
    cuda_matches_ref_device(load, path, rng, T, K, lambda: DeepseekMtpRef(ref_weights(path), config_of(path)), TOL)


@pytest.mark.gpu
def test_cuda_matches_ref_device_at_real_head_dims(rng):
    """V3's attention shapes (128 heads, latent 512 + rope 64, nope 128, v 128, q_lora 1536) on a narrow model,
    so every MLA kernel runs at its real per-head sizes; CUDA against the NumPy device."""
    dims = dict(hidden_size=1024, num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                qk_rope_head_dim=64, v_head_dim=128, moe_intermediate_size=256, vocab_size=4096)
    path = tiny_ckpt("fp8", seed=4, **dims)
    toks, hs = rng.integers(0, 4096, 41), bf16_round(rng.standard_normal((40, 1024)))
    tok, h = int(rng.integers(4096)), bf16_round(rng.standard_normal(1024))
    out = []
    for gpu in (mtp_cupy.device("ref"), mtp_cupy.device("cuda")):
        prop = load(path, gpu)
        st = prop.alloc_state()
        prop.prefill(st, toks, hs)
        out.append(prop.propose(st, tok, h, 40, 2, return_logits=True))
    assert rel(out[1].logits[0], out[0].logits[0]) <= 1e-2
    if out[1].tokens[0] == out[0].tokens[0]:
        assert rel(out[1].logits[1], out[0].logits[1]) <= 1e-2
