"""DeepSeek-V4 MTP against transformers' DeepseekV4 decoder layer (an outside oracle).

transformers drops the `mtp.*` weights, so the MTP wrapper (enorm/hnorm, e_proj/h_proj, the MTP hc_head and
norm, the shared head) is composed by hand around a sliding-window decoder layer of a tiny DeepseekV4 model
whose weights are replaced by the tiny checkpoint's (dequantised). Composed in float64, the oracle checks
the float64 reference to 1e-6 (transformers' RoPE tables are float32) -- hc_pre / hc_post / Sinkhorn, the
window, sinks, partial interleaved RoPE on the last dims with the inverse on the output, grouped wo_a,
sqrtsoftplus routing, clamps -- and the proposer (RefBackend, bf16) to 1e-2."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from reference.deepseek_v4_ref import P, V4MtpRef, load_weights, rms  # noqa: E402
from helpers import clear_argmax, rel_err  # noqa: E402


def hf_layer(w: dict, cfg: dict):
    """Layer 0 (sliding_attention, moe) of a tiny DeepseekV4 with the checkpoint's MTP weights copied in,
    its rotary embedding, in float64."""
    hc = cfg["hc_mult"]
    hcfg = transformers.AutoConfig.for_model(
        "deepseek_v4", vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        moe_intermediate_size=cfg["moe_intermediate_size"], num_hidden_layers=2,
        num_attention_heads=cfg["num_attention_heads"], head_dim=cfg["head_dim"], q_lora_rank=cfg["q_lora_rank"],
        num_experts_per_tok=cfg["num_experts_per_tok"], n_routed_experts=cfg["n_routed_experts"], n_shared_experts=1,
        scoring_func="sqrtsoftplus", routed_scaling_factor=cfg["routed_scaling_factor"], norm_topk_prob=True,
        rope_theta=cfg["rope_theta"], partial_rotary_factor=cfg["qk_rope_head_dim"] / cfg["head_dim"],
        hc_mult=hc, hc_sinkhorn_iters=cfg["hc_sinkhorn_iters"], hc_eps=cfg["hc_eps"],
        swiglu_limit=cfg["swiglu_limit"], sliding_window=cfg["sliding_window"], o_groups=cfg["o_groups"],
        o_lora_rank=cfg["o_lora_rank"], layer_types=["sliding_attention"] * 2, mlp_layer_types=["moe"] * 2,
        rms_norm_eps=cfg["rms_norm_eps"], attn_implementation="eager", experts_implementation="eager")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hcfg).double().eval()
    layer = model.model.layers[0]
    E = cfg["n_routed_experts"]
    t = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in w.items()}
    sd = {"attn_hc.fn": t[P + "hc_attn_fn"], "attn_hc.base": t[P + "hc_attn_base"],
          "attn_hc.scale": t[P + "hc_attn_scale"], "ffn_hc.fn": t[P + "hc_ffn_fn"],
          "ffn_hc.base": t[P + "hc_ffn_base"], "ffn_hc.scale": t[P + "hc_ffn_scale"],
          "input_layernorm.weight": t[P + "attn_norm.weight"],
          "post_attention_layernorm.weight": t[P + "ffn_norm.weight"],
          **{f"self_attn.{hf}.weight": t[P + f"attn.{ours}.weight"] for hf, ours in
             (("q_a_proj", "wq_a"), ("q_a_norm", "q_norm"), ("q_b_proj", "wq_b"), ("kv_proj", "wkv"),
              ("kv_norm", "kv_norm"), ("o_a_proj", "wo_a"), ("o_b_proj", "wo_b"))},
          "self_attn.sinks": t[P + "attn.attn_sink"],
          "mlp.gate.weight": t[P + "ffn.gate.weight"], "mlp.gate.e_score_correction_bias": t[P + "ffn.gate.bias"],
          "mlp.experts.gate_up_proj": torch.stack([torch.cat([t[P + f"ffn.experts.{e}.w1.weight"],
                                                              t[P + f"ffn.experts.{e}.w3.weight"]]) for e in range(E)]),
          "mlp.experts.down_proj": torch.stack([t[P + f"ffn.experts.{e}.w2.weight"] for e in range(E)]),
          "mlp.shared_experts.gate_proj.weight": t[P + "ffn.shared_experts.w1.weight"],
          "mlp.shared_experts.up_proj.weight": t[P + "ffn.shared_experts.w3.weight"],
          "mlp.shared_experts.down_proj.weight": t[P + "ffn.shared_experts.w2.weight"]}
    missing, unexpected = layer.load_state_dict(sd, strict=False)
    assert not unexpected and not [m for m in missing if "compressor" not in m], (missing, unexpected)
    head = transformers.models.deepseek_v4.modeling_deepseek_v4.DeepseekV4HyperHead(hcfg).double()
    head.load_state_dict({"hc_fn": t[P + "hc_head_fn"], "hc_base": t[P + "hc_head_base"],
                          "hc_scale": t[P + "hc_head_scale"]})
    return layer, model.model.rotary_emb, head


def hf_mtp_logits(w: dict, cfg: dict, tokens: np.ndarray, hiddens: np.ndarray) -> np.ndarray:
    """logits [S, vocab] of the hand-composed MTP module over S rows at positions 0..S-1 (row r pairs
    hiddens[r] with embed(tokens[r]))."""
    layer, rotary, head = hf_layer(w, cfg)
    eps, S, W = cfg["rms_norm_eps"], len(tokens), cfg["sliding_window"]
    with torch.no_grad():
        e = rms(w["embed.weight"][tokens], w[P + "enorm.weight"], eps) @ w[P + "e_proj.weight"].T
        h = rms(hiddens, w[P + "hnorm.weight"], eps) @ w[P + "h_proj.weight"].T
        X = torch.from_numpy((h if h.ndim == 3 else np.repeat(h[:, None], cfg["hc_mult"], 1)) + e[:, None])[None]
        pos = torch.arange(S)[None]
        q, k = torch.arange(S)[:, None], torch.arange(S)[None, :]
        mask = torch.where((k <= q) & (k > q - W), 0.0, float("-inf")).double()[None, None]
        pe = {"main": rotary(X, pos, layer_type="main"), "compress": rotary(X, pos, layer_type="compress")}
        Y = layer(X, position_embeddings=pe, position_ids=pos, attention_mask=mask)
        y = head(Y)[0].numpy()
    return rms(y, w[P + "norm.weight"], eps) @ w["head.weight"].T


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from mtp_cupy.testing.tiny.deepseek_v4 import write_tiny_checkpoint
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("v4hf"), seed=3)
    w, cfg = load_weights(path)
    return path, w, cfg


@pytest.mark.parametrize("form", ["streams", "single"])
def test_reference_matches_transformers(tiny, rng, form):
    """The float64 reference equals the transformers composition at every row of a prompt longer than the
    window (rows past the window drop the oldest); at a routing gap under 1e-6 either side may match."""
    _, w, cfg = tiny
    S, D, hc = 20, cfg["hidden_size"], cfg["hc_mult"]
    tokens = rng.integers(0, cfg["vocab_size"], S)
    hiddens = rng.standard_normal((S, hc, D) if form == "streams" else (S, D))
    want = hf_mtp_logits(w, cfg, tokens, hiddens)
    ref = V4MtpRef(w, cfg)
    for r in range(S):
        errs = [rel_err(logits, want[r]) for logits, _ in ref.candidates(int(tokens[r]), hiddens[r], r, 1e-6)]
        assert min(errs) < 1e-6, f"row {r}: {errs}"   # transformers' cos/sin are float32


@pytest.mark.parametrize("form", ["streams", "single"])
def test_proposer_matches_transformers(ref, rng, tiny, form):
    """Prefill rows 0..S-2 on RefBackend, one draft at S-1: its logits against the composition's last row (or,
    at a routing near tie, the float64 reference's other-side outcome)."""
    from mtp_cupy.models.deepseek_v4 import from_checkpoint
    from mtp_cupy.runtime.dtypes import BF16
    path, w, cfg = tiny
    S, D, hc = 14, cfg["hidden_size"], cfg["hc_mult"]
    tokens = rng.integers(0, cfg["vocab_size"], S + 1)
    hiddens = rng.standard_normal((S, hc, D) if form == "streams" else (S, D)).astype(np.float32)
    hiddens = hiddens.astype(BF16).astype(np.float32)          # what the proposer receives
    want = hf_mtp_logits(w, cfg, tokens[1:], hiddens.astype(np.float64))[-1]
    model = V4MtpRef(w, cfg)
    for r in range(S - 1):
        model.write_row(int(tokens[r + 1]), hiddens[r].astype(np.float64), r)
    outs = [want] + [lg for lg, _ in model.candidates(int(tokens[S]), hiddens[S - 1].astype(np.float64), S - 1,
                                                       1e-2)[1:]]
    prop = from_checkpoint(path, ref, max_seq_len=32, kv_cache_dtype="bf16")
    st = prop.alloc_state()
    prop.prefill(st, tokens[:S], hiddens[:S - 1])
    res = prop.propose(st, int(tokens[S]), hiddens[S - 1], S - 1, 1, return_logits=True)
    errs = [rel_err(res.logits[0], o) for o in outs]
    assert min(errs) <= 1e-2, errs
    best = outs[int(np.argmin(errs))]
    if clear_argmax(best, 0.05):
        assert res.tokens[0] == int(np.argmax(best))
