"""Issue 17.3: the hidden DeepSeek-V3/R1/V3.2's MTP carries to its next draft step (docs/model_math.md E):
option carried_hidden "post_norm" (shared_head.norm(g), the default: vLLM since PR #45895, SGLang, transformers'
MtpModel) or "pre_norm" (the block output g, vLLM's earlier rule). Each against transformers' layer
wrapped into the MTP module carrying that hidden; GLM-5 carries the post-norm hidden whatever the option."""
import pytest

import mtp_cupy
from mtp_cupy.errors import ConfigError
from mtp_cupy.models.deepseek_v3 import DeepseekV3MtpProposer

pytest.importorskip("transformers")
from width_oracles import chain_errors, oracle_for, rel, tiny  # noqa: E402

TOL0, TOL = 1.5e-2, 2.5e-2
CKPTS = {"v3_fp8": ("deepseek_v3", {}), "v3_bf16_row48": ("deepseek_v3", dict(fmt="bf16", kv_lora_rank=32,
                                                                               qk_rope_head_dim=16)),
         "v32": ("deepseek_v3", dict(fmt="bf16", model_type="deepseek_v32"))}


@pytest.mark.parametrize("carried", ["pre_norm", "post_norm"])
@pytest.mark.parametrize("ckpt", sorted(CKPTS))
def test_carried_hidden_matches_transformers(dev, ckpt, carried):
    """Three chained drafts against the oracle carrying the same hidden; against the other rule the second
    draft is far off (the first is the same: it gets the target's hidden)."""
    family, dims = CKPTS[ckpt]
    path = tiny(family, **dims)
    oracle, _, _ = oracle_for(path)
    prop = mtp_cupy.load_proposer(path, dev, max_seq_len=64, carried_hidden=carried)
    assert prop.carry == (prop.bufs.xn if carried == "post_norm" else prop.bufs.x)
    errs, _ = chain_errors(prop, oracle, carried=carried)
    assert errs[0] <= TOL0 and max(errs) <= TOL, errs
    other = "pre_norm" if carried == "post_norm" else "post_norm"
    wrong, _ = chain_errors(mtp_cupy.load_proposer(path, dev, max_seq_len=64, carried_hidden=carried), oracle,
                            carried=other)
    assert abs(wrong[0] - errs[0]) < 1e-9 and wrong[1] > 3 * max(errs[1], TOL0), (errs, wrong)


def test_default_option_and_validation():
    """A bad value is a ConfigError naming the option and the choices; `properties` (info) states the rule in
    force, the default's ("post_norm", the rule today's engines carry) when no options are given."""
    with pytest.raises(ConfigError, match="carried_hidden='final'.*pre_norm, post_norm"):
        DeepseekV3MtpProposer.Options(carried_hidden="final")
    cfg = mtp_cupy.weights.load_config(tiny("deepseek_v3"))
    assert DeepseekV3MtpProposer.Options().carried_hidden == "post_norm"
    assert DeepseekV3MtpProposer.properties(cfg)["carried_hidden"] == "post_norm (after shared_head.norm)"
    for value, where in (("pre_norm", "before"), ("post_norm", "after")):
        opts = DeepseekV3MtpProposer.Options(carried_hidden=value)
        assert DeepseekV3MtpProposer.properties(cfg, opts)["carried_hidden"] == f"{value} ({where} shared_head.norm)"


def test_glm5_carries_the_post_norm_hidden():
    """GLM-5 (post-norm already) against the oracle carrying shared_head.norm's output; it takes no
    carried_hidden option."""
    path = tiny("glm5")
    oracle, _, _ = oracle_for(path)
    prop = mtp_cupy.load_proposer(path, mtp_cupy.device("ref"), max_seq_len=64)
    errs, _ = chain_errors(prop, oracle, carried="post_norm")
    assert max(errs) <= TOL, errs
    with pytest.raises(ConfigError, match="unknown option"):
        mtp_cupy.load_proposer(path, mtp_cupy.device("ref"), max_seq_len=64, carried_hidden="pre_norm")


@pytest.mark.gpu
@pytest.mark.parametrize("carried", ["pre_norm", "post_norm"])
def test_carried_hidden_cuda_vs_twin(carried):
    path = tiny("deepseek_v3")
    oracle, _, _ = oracle_for(path)
    (er, rr), (eg, rg) = [chain_errors(mtp_cupy.load_proposer(path, mtp_cupy.device(k), max_seq_len=64,
                                                              carried_hidden=carried), oracle, carried=carried)
                          for k in ("ref", "cuda")]
    assert eg[0] <= TOL0 and max(eg) <= TOL, eg
    assert rel(rg.logits[1], rr.logits[1]) <= 1.5e-2
