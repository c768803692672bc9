"""Qwen3-Next MTP head on the NumPy device against the float64 reference (tests/reference/qwen_ref.py) and
transformers' Qwen3Next full-attention decoder layer, for BF16, FP8 and NVFP4 heads (both oracles read the
checkpoint file themselves; heads quantised at load are compared with the reference's own quantisation of
the file's weights), plus the quantisation option and typed errors."""
import numpy as np
import pytest

import mtp_cupy
from mtp_cupy.errors import CapacityError, ConfigError, InputError
from mtp_cupy.models import qwen3_next as qwen_mtp
from mtp_cupy.models.qwen3_next import MtpQuantization
from mtp_cupy.runtime.dtypes import bf16_round
import helpers
from helpers import write_rows
from qwen_util import (ARGMAX_TIE, ROUTE_TIE, check_chain, ref_weights, rel, run_quant, snapshot,
                       tiny_ckpt)
from reference.qwen_ref import QwenMtpRef

T, K, D, V = 40, 4, 256, 512
TOL0, TOL = 1.2e-2, 2e-2   # logits vs float64: first draft; chained drafts (the bf16 carried hidden compounds)
# (checkpoint format, quantization option, dense FFN): on-device quantisation, and stored formats (None = the
# default, "stored": an NVFP4 checkpoint's BF16 fc and head stay BF16, K/V BF16)
CASES = [("bf16", "bf16", False), ("bf16", "fp8", False), ("bf16", "nvfp4", False), ("fp8", None, False),
         ("nvfp4", None, False), ("bf16", "bf16", True), ("bf16", "nvfp4", True), ("fp8", "fp8", False),
         ("nvfp4", "nvfp4", False)]


def _load(ckpt_quant, quant, dense=False, gpu=None, max_seq_len=256, **kw):
    gpu = gpu or mtp_cupy.device("ref")
    opts = {} if quant is None else {"quantization": quant}
    return qwen_mtp.from_checkpoint(tiny_ckpt(ckpt_quant, dense), gpu, max_seq_len=max_seq_len, **opts, **kw)


def _inputs(rng):
    return (rng.integers(0, V, T + 1), bf16_round(rng.standard_normal((T, D))), int(rng.integers(V)),
            bf16_round(rng.standard_normal(D)))


def _ref_weights(ckpt_quant, prop, dense=False):
    """The reference's weights, read from the checkpoint file (never from the proposer's device)."""
    return ref_weights(tiny_ckpt(ckpt_quant, dense), run_quant(prop))


@pytest.mark.parametrize("ckpt_quant,quant,dense", CASES)
def test_matches_float64_reference(rng, ckpt_quant, quant, dense):
    prop = _load(ckpt_quant, quant, dense)
    want = None if quant is None else MtpQuantization.parse(quant).effective_for_head(dense)
    assert prop.quantization is want
    assert prop.kv.specs["k"].dtype == ("fp8" if want is MtpQuantization.NVFP4 else "bf16")
    if want is MtpQuantization.NVFP4:
        assert prop.lm_head.fmt == "nvfp4"
    ref = QwenMtpRef(_ref_weights(ckpt_quant, prop, dense), prop.cfg.raw, kv_fp8=want is MtpQuantization.NVFP4)
    toks, hs, tok, h = _inputs(rng)
    st = prop.alloc_state()
    assert prop.prefill(st, toks, hs) == T
    write_rows([ref], toks, hs, T)
    res = prop.propose(st, tok, h, T, K, return_logits=True)
    check_chain(res, ref, tok, h, T, TOL0, TOL, f"{ckpt_quant}/{quant}/dense={dense}")


@pytest.mark.parametrize("ckpt_quant,quant,dense", CASES[:6] + CASES[7:])
def test_matches_transformers(rng, ckpt_quant, quant, dense):
    """The whole draft chain against transformers' layer wrapped by hand (no FP8 K/V there, so NVFP4 heads
    are held to the reference's bound plus the e4m3 K/V rounding transformers does not model)."""
    pytest.importorskip("transformers")
    from reference.qwen_hf import HfQwenMtp
    prop = _load(ckpt_quant, quant, dense)
    w = _ref_weights(ckpt_quant, prop, dense)
    hf, ref = HfQwenMtp(w, prop.cfg.raw), QwenMtpRef(w, prop.cfg.raw)
    nv = prop.quantization is MtpQuantization.NVFP4
    helpers.matches_oracle(prop, ref, hf, _inputs(rng), K, 2 * TOL0 if nv else TOL0, 2 * TOL if nv else TOL,
                           f"transformers {ckpt_quant}/{quant}/dense={dense}", ROUTE_TIE, ARGMAX_TIE)


def test_reference_equals_transformers(rng):
    """The two oracles agree to float32 rounding (transformers' RMSNorm runs in float32)."""
    pytest.importorskip("transformers")
    from reference.qwen_hf import HfQwenMtp
    prop = _load("fp8", None)
    w = _ref_weights("fp8", prop)
    hf, ref = HfQwenMtp(w, prop.cfg.raw), QwenMtpRef(w, prop.cfg.raw)
    toks, hs, _, _ = _inputs(rng)
    pos = np.arange(5, 5 + T)
    lh, gh = hf.run(toks[:T], hs, pos)
    for r in (0, 7, T - 1):
        ref.truncate(0)
        for j in range(r):
            ref.write_row(toks[j], hs[j], pos[j])
        outs = ref.candidates(toks[r], hs[r], pos[r], 1e-6)   # transformers' float32 router may break a tie
        assert min(max(rel(lh[r], lr), rel(gh[r], gr)) for lr, gr in outs) < 1e-5


def test_quantization_names():
    assert MtpQuantization.parse("NVFP4") is MtpQuantization.parse("fp4") is MtpQuantization.NVFP4
    assert MtpQuantization.parse("fp8") is MtpQuantization.FP8 and MtpQuantization.parse("Bf16") is MtpQuantization.BF16
    assert MtpQuantization.NVFP4.effective_for_head(True) is MtpQuantization.BF16
    assert MtpQuantization.FP8.effective_for_head(True) is MtpQuantization.FP8
    assert MtpQuantization.NVFP4.effective_for_head(False) is MtpQuantization.NVFP4
    with pytest.raises(ConfigError, match="Unknown MTP quantization: int4. Expected: nvfp4, fp8, bf16"):
        MtpQuantization.parse("int4")
    with pytest.raises(ConfigError, match="Expected: nvfp4, fp8, bf16"):
        _load("bf16", "int8")
    with pytest.raises(ConfigError, match="unknown option"):
        _load("bf16", None, kv_dtype="fp8")


def test_mtp_vocab_size_limits_rows_scored(rng):
    prop = _load("bf16", "bf16", mtp_vocab_size=100)
    toks, hs, tok, h = _inputs(rng)
    st = prop.alloc_state()
    prop.prefill(st, toks[:9], hs[:8])
    res = prop.propose(st, tok, h, 8, 3, return_logits=True)
    assert all(t < 100 for t in res.tokens)
    assert res.logits.shape == (3, V) and np.all(np.isneginf(res.logits[:, 100:]))
    full = _load("bf16", "bf16")
    st2 = full.alloc_state()
    full.prefill(st2, toks[:9], hs[:8])
    r2 = full.propose(st2, tok, h, 8, 1, return_logits=True)
    np.testing.assert_allclose(res.logits[0, :100], r2.logits[0, :100], rtol=1e-6, atol=1e-6)


def test_typed_errors_leave_state_unchanged(rng):
    prop = _load("bf16", "bf16", max_seq_len=96, max_sequences=1)     # 6 blocks
    toks, hs = rng.integers(0, V, 49), bf16_round(rng.standard_normal((48, D)))
    tok, h = int(toks[-1]), hs[-1]
    st, other, hog = prop.alloc_state(), prop.alloc_state(), prop.alloc_state()
    prop.prefill(st, toks[:48], hs[:47])                # 3 blocks
    prop.prefill(other, toks[:31], hs[:30])             # 2 blocks
    prop.prefill(hog, toks[:2], hs[:1])                 # the last block
    before, before_other = snapshot(prop, st), snapshot(prop, other)
    good = dict(token=tok, hidden=h, position=47, num_drafts=1)
    bad = [(InputError, dict(token=V)), (InputError, dict(token=-1)), (InputError, dict(position=96)),
           (InputError, dict(position=90, num_drafts=8)), (InputError, dict(position=46)),
           (InputError, dict(position=48)),                                        # a hole at 47
           (InputError, dict(hidden=h[:-1])), (InputError, dict(hidden=h.astype(np.float64))),
           (InputError, dict(hidden=h.astype(np.int32))), (InputError, dict(num_drafts=9)),
           (CapacityError, dict(num_drafts=2))]
    for err, kw in bad:
        with pytest.raises(err):
            prop.propose(st, **{**good, **kw})
        assert snapshot(prop, st) == before, kw
    with pytest.raises(CapacityError):
        prop.prefill(st, toks[:11], hs[:10])
    with pytest.raises(InputError):
        prop.prefill(st, toks[:3], hs[:2], start_position=49)
    with pytest.raises(InputError):
        prop.prefill(st, [0, V], hs[:1])
    with pytest.raises(InputError):
        prop.prefill(st, toks[:3], hs[:3])
    assert snapshot(prop, st) == before
    prop.free_state(hog)
    free = prop.kv.free_count
    with pytest.raises(CapacityError):                  # `other` reserves a block, then `st` finds none
        prop.propose_batch([other, st], [tok, tok], np.stack([h, h]), [30, 47], 8)
    with pytest.raises(InputError):
        prop.propose_batch([st, st], [tok, tok], np.stack([h, h]), [47, 47], 1)
    with pytest.raises(InputError):
        prop.propose_batch([other, st], [tok, tok], np.stack([h, h])[:, :-1], [30, 47], 1)
    with pytest.raises(InputError):
        prop.propose_batch([other, st], [tok, V], np.stack([h, h]), [30, 47], 1)
    assert prop.kv.free_count == free
    assert snapshot(prop, st)[:-1] == before[:-1] and snapshot(prop, other)[:-1] == before_other[:-1]
    res = prop.propose(st, tok, h, 47, 2)               # still works after all that
    assert len(res.tokens) == 2 and st.seq_len == 49


def test_load_proposer_dispatches_to_qwen():
    prop = mtp_cupy.load_proposer(tiny_ckpt("nvfp4"), gpu=mtp_cupy.device("ref"), max_seq_len=64)
    assert isinstance(prop, qwen_mtp.Qwen3NextMtpProposer) and prop.quantization is None   # as stored
    assert prop.w.linears["fc"].fmt == "bf16" and prop.w.linears["q_proj"].fmt == "nvfp4"
    assert prop.kv.specs["k"].dtype == "bf16"
