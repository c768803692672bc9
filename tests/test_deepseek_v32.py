"""Issue 17.2: DeepSeek-V3.2 (`deepseek_v32`) runs its MTP layer through the DSA layer (lightning indexer + MLA
over the selected rows), with its own indexer cache, against transformers' DeepseekV32 decoder layer with an
index_topk small enough that the selection drops rows; half-split indexer RoPE; the layer's own embedding and
head; typed refusals that allocate nothing; batches draft what single sequences draft."""
import json
import shutil

import numpy as np
import pytest

import mtp_cupy
from mtp_cupy.errors import WeightError
from mtp_cupy.weights import load_config

pytest.importorskip("transformers")
from width_oracles import (CHAIN_T, MlaMtp, assert_batch_equals_single, chain_errors, oracle_for,  # noqa: E402
                           read_checkpoint, rel, tiny)

TOL0, TOL = 1.5e-2, 2.5e-2


def v32(fmt="bf16", **kw):
    return tiny("deepseek_v3", model_type="deepseek_v32", fmt=fmt, distinct_copies=True, **kw)


def load(path, dev=None, **kw):
    return mtp_cupy.load_proposer(path, dev or mtp_cupy.device("ref"), max_seq_len=64, **kw)


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_matches_transformers_deepseek_v32_with_rows_dropped(dev, fmt):
    """Twenty rows against index_topk 8: the indexer drops most of them. The chain of three drafts matches
    transformers' DeepseekV32 layer; dense MLA (every row) is far from it."""
    path = v32(fmt)
    prop = load(path, dev)
    cfg = load_config(path)
    assert type(prop.mla).__name__ == "DsaMlaAttention" and "index_k" in prop.kv.specs
    assert cfg.index_topk == 8 < CHAIN_T and not cfg.indexer_rope_interleave
    oracle, w, c = oracle_for(path)
    errs, res = chain_errors(prop, oracle)
    assert errs[0] <= TOL0 and max(errs) <= TOL, errs
    dense = MlaMtp(w, {**c, "index_topk": 10 ** 6})        # the same layer attending every row
    far, _ = chain_errors(load(path, dev), dense)
    assert far[0] > 10 * errs[0], (far, errs)


def test_dsa_equals_dense_mla_while_rows_fit_topk():
    """With no more rows than index_topk the selection keeps every row: the DSA proposer drafts what the dense
    oracle drafts (docs/model_math.md C.2)."""
    path = v32(index_topk=32)
    oracle, w, c = oracle_for(path)
    dense = MlaMtp(w, {**c, "index_topk": 10 ** 6})
    errs, _ = chain_errors(load(path), dense, T=12)
    assert max(errs) <= TOL, errs


def test_indexer_rope_is_half_split_and_the_flag_is_read(tmp_path):
    """DeepSeek-V3.2's indexer rotates (x[i], x[i + d/2]) unless indexer_rope_interleave is set (vLLM reads the
    flag); the proposer's IndexerDims follow the config."""
    assert load(v32()).idx_dims.interleaved is False
    d = tmp_path / "ck"
    shutil.copytree(v32(), d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "indexer_rope_interleave": True}))
    assert load(d).idx_dims.interleaved is True


def test_own_embedding_and_head_of_the_mtp_layer():
    """The tiny checkpoint's layer copies differ from the top-level tensors: V3.2 loads the layer's own, V3 the
    top-level ones (both as vLLM's MTP loader would for these checkpoints)."""
    path = v32()
    w, c = read_checkpoint(path)
    P = f"model.layers.{c['num_hidden_layers']}."
    prop = load(path)
    dev = prop.gpu
    head = dev.read(prop.w.head.weight, "bf16", (prop.w.head.n, prop.w.head.k)).astype(np.float64)
    embed = dev.read(prop.w.embed, "bf16", (c["vocab_size"], c["hidden_size"])).astype(np.float64)
    assert np.array_equal(head, w[P + "shared_head.head.weight"].numpy())
    assert np.array_equal(embed, w[P + "embed_tokens.weight"].numpy())
    assert not np.array_equal(head, w["lm_head.weight"].numpy())
    v3 = load(tiny("deepseek_v3", fmt="bf16", distinct_copies=True))
    h3 = v3.gpu.read(v3.w.head.weight, "bf16", (v3.w.head.n, v3.w.head.k)).astype(np.float64)
    w3, _ = read_checkpoint(tiny("deepseek_v3", fmt="bf16", distinct_copies=True))
    assert np.array_equal(h3, w3["lm_head.weight"].numpy())


def test_config_defaults_and_properties(tmp_path):
    """A deepseek_v32 config.json without index fields takes transformers' defaults (64 heads x 128, top-2048);
    `properties` (python -m mtp_cupy info) says DSA is on."""
    cfg = json.loads((v32() / "config.json").read_text())
    for k in ("index_n_heads", "index_head_dim", "index_topk"):
        cfg.pop(k)
    c = load_config(cfg)
    assert (c.index_n_heads, c.index_head_dim, c.index_topk, c.has_indexer) == (64, 128, 2048, True)
    from mtp_cupy.models.deepseek_v3 import DeepseekV3MtpProposer
    props = DeepseekV3MtpProposer.properties(load_config(v32()))
    assert props["dsa"] == "on" and "half-split" in props["attention"] and "indexer rows of 128" in props["kv_cache"]
    assert DeepseekV3MtpProposer.properties(load_config(tiny("deepseek_v3")))["dsa"] == "off"


def test_missing_indexer_is_a_weight_error_before_any_allocation(tmp_path):
    """A V3.2 config whose MTP layer has no indexer tensors: WeightError naming the key, read from the headers
    before a single tensor is uploaded."""
    from safetensors.numpy import load_file, save_file
    d = tmp_path / "ck"
    shutil.copytree(tiny("deepseek_v3", fmt="bf16"), d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "deepseek_v32", "index_n_heads": 4,
                                               "index_head_dim": 64, "index_topk": 8}))
    save_file(load_file(str(d / "model.safetensors")), str(d / "model.safetensors"))   # still no indexer
    from test_attention_widths import CountingRef
    gpu = CountingRef()
    with pytest.raises(WeightError, match="indexer.wq_b.weight"):
        mtp_cupy.load_proposer(d, gpu.dev, max_seq_len=64)
    assert gpu.allocs == 0


def test_batch_drafts_what_single_sequences_draft():
    """Batch invariance with the indexer: three sequences of different lengths (some past index_topk) drafted
    together, bit for bit what each drafts alone."""
    assert_batch_equals_single(lambda: load(v32(), max_batch=4), [3, 14, 25], seed=5)


def test_graphs_replay_what_eager_runs():
    from width_oracles import assert_graphs_equal_eager, ref_with_emulated_graphs
    assert_graphs_equal_eager(lambda gpu: load(v32(), gpu, max_batch=4), ref_with_emulated_graphs())


@pytest.mark.gpu
def test_v32_graphs_replay_what_eager_runs_on_cuda():
    from width_oracles import assert_graphs_equal_eager
    assert_graphs_equal_eager(lambda gpu: load(v32(), gpu, max_batch=4), mtp_cupy.device("cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_v32_cuda_vs_twin(fmt):
    """The DSA proposer on CUDA against the NumPy device: the same drafts where the logits are not near a tie,
    first-draft logits within accumulation-order noise, and both against transformers."""
    path = v32(fmt)
    oracle, _, _ = oracle_for(path)
    (er, rr), (eg, rg) = [chain_errors(load(path, mtp_cupy.device(k)), oracle)
                          for k in ("ref", "cuda")]
    assert eg[0] <= TOL0 and max(eg) <= TOL, eg
    assert rel(rg.logits[0], rr.logits[0]) <= 1e-2
