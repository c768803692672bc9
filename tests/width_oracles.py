"""Outside oracles for the issue-17 tests (attention widths, DeepSeek-V3.2's DSA, the carried hidden, V4's fp8
KV): checkpoints read with `safetensors` (torch) and dequantised here, and transformers' decoder layers
(DeepseekV3, DeepseekV32, DeepseekV4, Qwen3Next) wrapped by hand into the MTP module (transformers drops MTP
layers). Nothing here calls mtp_cupy's loaders, kernels or twins; the MTP wrapper follows docs/model_math.md
A.2 / B.3 / C.2 / D.2 / E.

Every oracle runs a whole sequence of MTP rows at once under a causal mask: row r pairs embed(tokens[r]) with
hiddens[r] at positions[r] and attends rows <= r, so the last row of a run is a draft step after the others."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

FP8_MAX = 448.0
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def fp4_values(packed: torch.Tensor) -> torch.Tensor:
    """[n, k/2] bytes (low nibble the even element) -> float64 [n, k]."""
    b = packed.view(torch.uint8).to(torch.int64)
    nib = torch.stack([b & 15, b >> 4], dim=-1).flatten(-2)
    return torch.where(nib >= 8, -1.0, 1.0).double() * E2M1[nib & 7]


def _blocks(s: torch.Tensor, n: int, k: int, rb: int, cb: int) -> torch.Tensor:
    return s.repeat_interleave(rb, 0).repeat_interleave(cb, 1)[:n, :k]


def read_checkpoint(path) -> tuple[dict[str, torch.Tensor], dict]:
    """(every tensor of the checkpoint at `path` as float64 under its key, projections dequantised; config.json).
    Formats: FP8 + weight_scale_inv (F32 blocks of 128) or + .scale (E8M0 blocks of 128); ModelOpt NVFP4
    (U8 + F8 weight_scale per 16 + weight_scale_2); MXFP4 (I8/U8 + E8M0 .scale per 32)."""
    from safetensors import safe_open
    path = Path(path)
    raw: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            raw.update({k: fh.get_tensor(k) for k in fh.keys()})
    out = {}
    for k, t in raw.items():
        base = k.removesuffix(".weight")
        if any(k.endswith(s) for s in (".weight_scale_inv", ".weight_scale", ".weight_scale_2", ".input_scale")) or \
                (k.endswith(".scale") and k[:-6] + ".weight" in raw):
            continue
        if t.dtype == torch.float8_e4m3fn:
            n, kk = t.shape
            s = raw.get(base + ".weight_scale_inv", raw.get(base + ".scale"))
            out[k] = t.double() * _blocks(s.double(), n, kk, 128, 128)
        elif t.dtype in (torch.uint8, torch.int8) and base + ".weight_scale_2" in raw:
            n = t.shape[0]
            w = fp4_values(t)
            out[k] = w * raw[base + ".weight_scale"].double().repeat_interleave(16, 1)[:, :w.shape[1]] \
                * raw[base + ".weight_scale_2"].double().reshape(())
        elif t.dtype in (torch.uint8, torch.int8) and base + ".scale" in raw:
            w = fp4_values(t)
            out[k] = w * raw[base + ".scale"].double().repeat_interleave(32, 1)[:, :w.shape[1]]
        else:
            out[k] = t.double()
    return out, json.loads((path / "config.json").read_text())


def _rms(x: torch.Tensor, w: torch.Tensor | None, eps: float, unit_offset: bool = False) -> torch.Tensor:
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * (1.0 + w if unit_offset else w)


def _causal(T: int) -> torch.Tensor:
    return torch.full((T, T), float("-inf"), dtype=torch.float64).triu(1)[None, None]


def _fused_experts(w: dict, prefix: str, E: int, names=("gate_proj", "up_proj", "down_proj")):
    g, u, d = names
    gate_up = torch.stack([torch.cat([w[f"{prefix}{e}.{g}.weight"], w[f"{prefix}{e}.{u}.weight"]]) for e in range(E)])
    return gate_up, torch.stack([w[f"{prefix}{e}.{d}.weight"] for e in range(E)])


def _model(model_type: str, **kw):
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(model_type, attn_implementation="eager", experts_implementation="eager", **kw)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float64).eval()


def fake_quant_fp8_blocks(x: torch.Tensor, nope: int) -> torch.Tensor:
    """DeepSeek-V4's QAT rounding of kv[..., :nope] (act_quant(..., 64, "ue8m0", inplace=True)) of the bf16 kv
    rows: per 64-block the power-of-two scale s = 2^ceil(log2(max(amax, 1e-4) / 448)), the values
    e4m3(x / s) * s (nearest even, saturating); the other columns untouched. A last partial block scales over
    what it has."""
    y = x.clone()
    xb = x.to(torch.bfloat16).double()           # the official kv rows are bf16 when they are quantised
    for b0 in range(0, nope, 64):
        blk = xb[..., b0:min(nope, b0 + 64)]
        amax = blk.abs().amax(-1, keepdim=True).clamp_min(1e-4)
        s = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))
        q = (blk / s).clamp(-FP8_MAX, FP8_MAX).float().to(torch.float8_e4m3fn).double()
        y[..., b0:min(nope, b0 + 64)] = q * s
    return y


# -- DeepSeek-V3 / V3.2 (MLA, DSA) --------------------------------------------------------------------------
class MlaMtp:
    """The MTP module around layer 0 of a one-layer DeepseekV3 / DeepseekV32 / GlmMoeDsa model with the
    checkpoint's dims and its MTP layer's weights. run() -> (logits, g = block output, h = shared_head.norm(g)),
    all rows."""

    DIMS = ("hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
            "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group",
            "moe_intermediate_size", "n_shared_experts", "vocab_size", "rms_norm_eps", "routed_scaling_factor",
            "norm_topk_prob")

    def __init__(self, w: dict, cfg: dict):
        mt = cfg["model_type"]
        v32, dsa = mt == "deepseek_v32", mt in ("deepseek_v32", "glm_moe_dsa")
        rs = cfg.get("rope_scaling") or {}
        rope = cfg.get("rope_parameters") or {"rope_type": rs.get("type", "default"),
                                              "rope_theta": cfg.get("rope_theta", 10000.0),
                                              **{k: v for k, v in rs.items() if k != "type"}}
        extra = {k: cfg[k] for k in ("index_topk", "index_head_dim", "index_n_heads")} if dsa else \
            {"rope_interleave": True}
        self.model = _model(cfg["model_type"], **{k: cfg[k] for k in self.DIMS}, num_hidden_layers=1,
                            first_k_dense_replace=0, intermediate_size=64, num_key_value_heads=cfg["num_attention_heads"],
                            max_position_embeddings=cfg["max_position_embeddings"], rope_parameters=rope, **extra)
        self.layer = self.model.model.layers[0]
        self.P = P = f"model.layers.{cfg['num_hidden_layers']}."
        self.eps, self.w = cfg["rms_norm_eps"], w
        sd = {k: w[P + k] for k in self.layer.state_dict() if P + k in w}
        sd["mlp.experts.gate_up_proj"], sd["mlp.experts.down_proj"] = _fused_experts(w, P + "mlp.experts.",
                                                                                     cfg["n_routed_experts"])
        missing = set(self.layer.state_dict()) - set(sd)
        assert not missing, f"no checkpoint tensor for {sorted(missing)}"
        self.layer.load_state_dict(sd)
        attn = self.layer.self_attn        # the latent norms at rms_norm_eps (vLLM, SGLang; docs/model_math.md C.3)
        attn.q_a_layernorm.variance_epsilon = attn.kv_a_layernorm.variance_epsilon = self.eps
        own = v32 and P + "shared_head.head.weight" in w      # V3.2: the MTP layer's own embedding and head
        self.embed = w[P + "embed_tokens.weight"] if own else w["model.embed_tokens.weight"]
        self.head = w[P + "shared_head.head.weight"] if own else w["lm_head.weight"]

    @torch.no_grad()
    def run(self, tokens, hiddens, positions):
        w, P, eps = self.w, self.P, self.eps
        e = _rms(self.embed[torch.as_tensor(np.asarray(tokens, np.int64))], w[P + "enorm.weight"], eps)
        h = _rms(torch.as_tensor(np.stack(hiddens).astype(np.float64)), w[P + "hnorm.weight"], eps)
        x = (torch.cat([e, h], -1) @ w[P + "eh_proj.weight"].T)[None]
        pos = torch.as_tensor(np.asarray(positions, np.int64))[None]
        g = self.layer(x, attention_mask=_causal(x.shape[1]), position_ids=pos,
                       position_embeddings=self.model.model.rotary_emb(x, pos))
        g = (g[0] if isinstance(g, tuple) else g)[0]
        hn = _rms(g, w[P + "shared_head.norm.weight"], eps)
        return (hn @ self.head.T).numpy(), g.numpy(), hn.numpy()


# -- DeepSeek-V4 -------------------------------------------------------------------------------------------
class V4Mtp:
    """The V4 MTP module (B.3) around a sliding-window layer of a tiny DeepseekV4; `kv_fp8` rounds the kv rows'
    non-RoPE columns as DeepSeek's inference does (fake_quant_fp8_blocks, hooked on kv_norm: RoPE touches only
    the last columns, so the order does not matter). run() -> (logits, output streams [T, hc, D])."""

    def __init__(self, w: dict, cfg: dict, kv_fp8: bool = False):
        P, E, hc = "mtp.0.", cfg["n_routed_experts"], cfg["hc_mult"]
        self.model = _model(
            "deepseek_v4", vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            moe_intermediate_size=cfg["moe_intermediate_size"], num_hidden_layers=1,
            num_attention_heads=cfg["num_attention_heads"], head_dim=cfg["head_dim"], q_lora_rank=cfg["q_lora_rank"],
            num_experts_per_tok=cfg["num_experts_per_tok"], n_routed_experts=E, n_shared_experts=1,
            scoring_func="sqrtsoftplus", routed_scaling_factor=cfg["routed_scaling_factor"], norm_topk_prob=True,
            rope_theta=cfg["rope_theta"], partial_rotary_factor=cfg["qk_rope_head_dim"] / cfg["head_dim"],
            hc_mult=hc, hc_sinkhorn_iters=cfg["hc_sinkhorn_iters"], hc_eps=cfg["hc_eps"],
            swiglu_limit=cfg["swiglu_limit"], sliding_window=cfg["sliding_window"], o_groups=cfg["o_groups"],
            o_lora_rank=cfg["o_lora_rank"], layer_types=["sliding_attention"], mlp_layer_types=["moe"],
            rms_norm_eps=cfg["rms_norm_eps"])
        self.layer = lay = self.model.model.layers[0]
        names = {"attn_hc.": "hc_attn_", "ffn_hc.": "hc_ffn_", "input_layernorm.": "attn_norm.",
                 "post_attention_layernorm.": "ffn_norm.", "self_attn.q_a_proj.": "attn.wq_a.",
                 "self_attn.q_a_norm.": "attn.q_norm.", "self_attn.q_b_proj.": "attn.wq_b.",
                 "self_attn.kv_proj.": "attn.wkv.", "self_attn.kv_norm.": "attn.kv_norm.",
                 "self_attn.o_a_proj.": "attn.wo_a.", "self_attn.o_b_proj.": "attn.wo_b.",
                 "self_attn.sinks": "attn.attn_sink", "mlp.gate.e_score_correction_bias": "ffn.gate.bias",
                 "mlp.gate.": "ffn.gate.", "mlp.shared_experts.gate_proj.": "ffn.shared_experts.w1.",
                 "mlp.shared_experts.up_proj.": "ffn.shared_experts.w3.",
                 "mlp.shared_experts.down_proj.": "ffn.shared_experts.w2."}

        def ours(k: str) -> str:
            for hf, o in names.items():
                if k.startswith(hf):
                    return P + o + k[len(hf):]
            return P + k
        sd = {k: w[ours(k)] for k in lay.state_dict() if ours(k) in w}
        sd["mlp.experts.gate_up_proj"], sd["mlp.experts.down_proj"] = _fused_experts(
            w, P + "ffn.experts.", E, ("w1", "w3", "w2"))
        missing = [k for k in set(lay.state_dict()) - set(sd) if "compressor" not in k]
        assert not missing, f"no checkpoint tensor for {sorted(missing)}"
        lay.load_state_dict(sd, strict=False)
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperHead
        self.hc_head = DeepseekV4HyperHead(self.model.config).double()
        self.hc_head.load_state_dict({"hc_fn": w[P + "hc_head_fn"], "hc_base": w[P + "hc_head_base"],
                                      "hc_scale": w[P + "hc_head_scale"]})
        if kv_fp8:
            nope = cfg["head_dim"] - cfg["qk_rope_head_dim"]
            lay.self_attn.kv_norm.register_forward_hook(lambda m, i, o: fake_quant_fp8_blocks(o, nope))
        self.w, self.cfg, self.P = w, cfg, P

    @torch.no_grad()
    def run(self, tokens, hiddens, positions):
        w, P, eps, hc = self.w, self.P, self.cfg["rms_norm_eps"], self.cfg["hc_mult"]
        e = _rms(w["embed.weight"][torch.as_tensor(np.asarray(tokens, np.int64))], w[P + "enorm.weight"], eps)
        e = e @ w[P + "e_proj.weight"].T
        D = self.cfg["hidden_size"]   # a single hidden [D] is hc equal streams (B.3)
        h = torch.as_tensor(np.stack([np.broadcast_to(np.asarray(x, np.float64).reshape(-1, D), (hc, D))
                                      for x in hiddens]))
        X = ((_rms(h, w[P + "hnorm.weight"], eps) @ w[P + "h_proj.weight"].T) + e[:, None])[None]
        T, W = X.shape[1], self.cfg["sliding_window"]
        pos = torch.as_tensor(np.asarray(positions, np.int64))[None]
        q, k = torch.arange(T)[:, None], torch.arange(T)[None, :]
        mask = torch.where((k <= q) & (k > q - W), 0.0, float("-inf")).double()[None, None]
        rot = self.model.model.rotary_emb
        pe = {"main": rot(X, pos, layer_type="main"), "compress": rot(X, pos, layer_type="compress")}
        Y = self.layer(X, position_embeddings=pe, position_ids=pos, attention_mask=mask)
        Y = (Y[0] if isinstance(Y, tuple) else Y)
        y = _rms(self.hc_head(Y)[0], w[P + "norm.weight"], eps)
        return (y @ w["head.weight"].T).numpy(), Y[0].numpy()


# -- Qwen3-Next ----------------------------------------------------------------------------------------------
class QwenMtp:
    """The MTP head (D.2) around the full-attention layer of a one-layer Qwen3Next. run() -> (logits, carried
    hidden = mtp.norm output)."""

    KEEP = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "partial_rotary_factor",
            "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
            "intermediate_size", "vocab_size", "rope_theta", "rms_norm_eps", "norm_topk_prob")

    def __init__(self, w: dict, cfg: dict):
        self.model = _model("qwen3_next", num_hidden_layers=1, layer_types=["full_attention"],
                            **{k: cfg[k] for k in self.KEEP if k in cfg})
        self.layer = lay = self.model.model.layers[0]
        L = "mtp.layers.0."
        sd = {k: w[L + k] for k in lay.state_dict() if L + k in w}
        if cfg.get("num_experts", 0):
            sd["mlp.experts.gate_up_proj"], sd["mlp.experts.down_proj"] = _fused_experts(
                w, L + "mlp.experts.", cfg["num_experts"])
        missing = set(lay.state_dict()) - set(sd)
        assert not missing, f"no checkpoint tensor for {sorted(missing)}"
        lay.load_state_dict(sd)
        self.w, self.eps = w, cfg["rms_norm_eps"]

    @torch.no_grad()
    def run(self, tokens, hiddens, positions):
        w, eps = self.w, self.eps
        e = _rms(w["model.embed_tokens.weight"][torch.as_tensor(np.asarray(tokens, np.int64))],
                 w["mtp.pre_fc_norm_embedding.weight"], eps, True)
        h = _rms(torch.as_tensor(np.stack(hiddens).astype(np.float64)), w["mtp.pre_fc_norm_hidden.weight"], eps, True)
        x = (torch.cat([e, h], -1) @ w["mtp.fc.weight"].T)[None]
        pos = torch.as_tensor(np.asarray(positions, np.int64))[None]
        y = self.layer(x, position_embeddings=self.model.model.rotary_emb(x, pos), attention_mask=_causal(x.shape[1]),
                       position_ids=pos)
        g = _rms((y[0] if isinstance(y, tuple) else y)[0], w["mtp.norm.weight"], eps, True)
        return (g @ w["lm_head.weight"].T).numpy(), g.numpy()


def oracle_for(path, **kw):
    """The oracle of the checkpoint at `path` (by its model_type) and its tensors / config."""
    w, cfg = read_checkpoint(path)
    cls = {"deepseek_v3": MlaMtp, "deepseek_v32": MlaMtp, "glm_moe_dsa": MlaMtp, "deepseek_v4": V4Mtp,
           "qwen3_next": QwenMtp}[cfg["model_type"]]
    return cls(w, cfg, **kw), w, cfg


def bf16(x) -> np.ndarray:
    """float64 values rounded to bf16, as the device stores a carried hidden."""
    return torch.as_tensor(np.asarray(x, np.float64)).to(torch.bfloat16).double().numpy()


def draft_chain(oracle, tokens, hiddens, drafts, carried: str = "post_norm"):
    """The oracle's logits of each draft step of a chain after prompt rows (tokens[r + 1], hiddens[r]) at
    positions 0..T-1 (the last one is the propose's first row), teacher-forced with the device's `drafts`: step
    i + 1 appends (drafts[i], the oracle's carried hidden of step i, rounded to bf16). `carried` picks the
    MlaMtp hidden ("pre_norm" = g, "post_norm" = h); other oracles carry their own."""
    toks, hs = list(np.asarray(tokens)[1:]), [np.asarray(h, np.float64) for h in hiddens]
    out = []
    for i in range(len(drafts)):
        res = oracle.run(toks, hs, np.arange(len(toks)))
        out.append(res[0][-1])
        nxt = res[1] if len(res) == 2 else (res[1] if carried == "pre_norm" else res[2])
        toks.append(int(drafts[i]))
        hs.append(bf16(nxt[-1]))
    return out


# -- tiny checkpoints and the chain comparison the tests share ------------------------------------------------
_CKPTS: dict = {}


def tiny(family: str, seed: int = 1, **kw) -> Path:
    """A tiny checkpoint of `family` (mtp_cupy.testing.tiny writers, real key layout), written once per process."""
    import tempfile
    from mtp_cupy.families import family as fam
    key = (family, seed, tuple(sorted(kw.items())))
    if key not in _CKPTS:
        _CKPTS[key] = fam(family).write_tiny_checkpoint(tempfile.mkdtemp(prefix=f"h8_{family}_"), seed=seed, **kw)
    return _CKPTS[key]


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b)) if np.all(np.isfinite(a)) else float("inf")


CHAIN_T = 20     # prompt rows of chain_errors: more than the tiny DSA checkpoints' index_topk (8)


def chain_errors(prop, oracle, seed: int = 3, T: int = CHAIN_T, k: int = 3, carried: str = "post_norm",
                 streams: bool = False) -> tuple[list[float], object]:
    """Prefill T - 1 prompt rows, one propose of k drafts (return_logits) on `prop`; each draft's logits against
    `oracle`'s teacher-forced chain (relative errors), and the propose's result. `streams`: V4 hiddens [hc, D]."""
    from mtp_cupy.runtime.dtypes import bf16_round
    rng = np.random.default_rng(seed)
    D = prop.hidden_size
    shape = (T, prop.hc, D) if streams else (T, D)
    toks, hs = rng.integers(0, prop.vocab_size, T + 1), bf16_round(rng.standard_normal(shape))
    st = prop.alloc_state()
    prop.prefill(st, toks[:T], hs[:T - 1])
    res = prop.propose(st, int(toks[T]), hs[T - 1], T - 1, k, return_logits=True)
    want = draft_chain(oracle, toks, list(hs), res.tokens, carried)
    return [rel(res.logits[i], want[i]) for i in range(k)], res


def assert_batch_equals_single(make, lens, seed: int, k: int = 3) -> None:
    """Sequences of `lens` prompt rows drafted in one propose_batch on one proposer, then one at a time on
    another (`make()` builds each): the same drafts and logits, bit for bit."""
    batched, single = make(), make()
    rng = np.random.default_rng(seed)
    D, V = batched.hidden_size, batched.vocab_size
    data = [(rng.integers(0, V, n + 1), rng.standard_normal((n, D)).astype(np.float32), int(rng.integers(V)),
             rng.standard_normal(D).astype(np.float32)) for n in lens]
    sts = [batched.alloc_state() for _ in lens]
    for st, (toks, hs, _, _) in zip(sts, data):
        batched.prefill(st, toks, hs)
    got = batched.propose_batch(sts, [d[2] for d in data], np.stack([d[3] for d in data]), list(lens), k,
                                return_logits=True)
    for (toks, hs, tok, h), n, g in zip(data, lens, got):
        st = single.alloc_state()
        single.prefill(st, toks, hs)
        one = single.propose(st, tok, h, n, k, return_logits=True)
        assert one.tokens == g.tokens and np.array_equal(one.logits, g.logits), f"sequence of {n} rows"


def ref_with_emulated_graphs():
    """A NumPy device whose capture records nothing and whose replay re-runs the launches (as test_batch_graphs)."""
    import mtp_cupy
    gpu = mtp_cupy.device("ref")
    gpu.capture = lambda fn, stream: fn
    gpu.replay = lambda graph, stream: graph()
    return gpu


def assert_graphs_equal_eager(make, gpu, lens=(4, 13, 22), seed: int = 8, k: int = 2) -> None:
    """Three rounds of propose_batch (eager warm-up, capture, replay) on a graphed proposer and on an eager one
    built by make(gpu): the same drafts and logits every round, and a graph was made."""
    g, e = make(gpu), make(gpu)
    g.cuda_graphs, e.cuda_graphs = True, False
    rng = np.random.default_rng(seed)
    D, V, B = g.hidden_size, g.vocab_size, len(lens)
    sg, se = [g.alloc_state() for _ in lens], [e.alloc_state() for _ in lens]
    for a, b, n in zip(sg, se, lens):
        toks, hs = rng.integers(0, V, n + 1), rng.standard_normal((n, D)).astype(np.float32)
        g.prefill(a, toks, hs)
        e.prefill(b, toks, hs)
    pos = list(lens)
    for _ in range(3):
        toks, hs = [int(t) for t in rng.integers(0, V, B)], rng.standard_normal((B, D)).astype(np.float32)
        rg = g.propose_batch(sg, toks, hs, pos, k, return_logits=True)
        re = e.propose_batch(se, toks, hs, pos, k, return_logits=True)
        for a, b in zip(rg, re):
            assert a.tokens == b.tokens and np.array_equal(a.logits, b.logits)
        for p, sts in ((g, sg), (e, se)):
            for st in sts:
                p.after_verify(st, 1)
        pos = [q + 1 for q in pos]
    assert g._graphs, "no graph was captured"
