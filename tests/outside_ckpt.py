"""Checkpoints our writer did not write, one per weight format, for loaders and references to meet on:

  * transformers' `save_pretrained` of a randomly initialised model of each family (its key names, dtypes,
    config.json spelling and file layout): the decoder layer that serves as the MTP layer, the embedding and
    the head;
  * what transformers does not model (the MTP-only tensors: enorm / hnorm / eh_proj / shared_head.norm,
    Qwen's `mtp.*` wrapper, V4's e_proj / h_proj), the renames to each release's MTP prefix and the
    quantised projections written with safetensors' own torch API (`safetensors.torch.save_file`), into a
    second shard with the index a sharded release has;
  * FP8 / FP4 tensors hand-encoded from the published encodings (reference/checkpoint.py's encoders, never
    mtp_cupy's quantisers): block FP8 with a float32 `weight_scale_inv` (DeepSeek-V3, GLM-5), block FP8 with
    an E8M0 `.scale` and MXFP4 experts (DeepSeek-V4), ModelOpt NVFP4 (Qwen3-Next).

`outside_checkpoint(family, fmt)` builds one per process (a few seconds: transformers' model classes)."""
from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import numpy as np

from reference.checkpoint import encode_e2m1, encode_e4m3, pack_e2m1

FORMATS = {"deepseek_v3": ("bf16", "fp8"), "glm5": ("bf16", "fp8"), "qwen3_next": ("bf16", "nvfp4"),
           "deepseek_v4": ("fp8_mxfp4",)}
_BUILT: dict = {}

V3_DIMS = dict(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=64, num_attention_heads=4,
               num_key_value_heads=4, n_shared_experts=1, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
               topk_group=2, first_k_dense_replace=1, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32,
               qk_rope_head_dim=64, v_head_dim=32, rope_interleave=True, routed_scaling_factor=2.5,
               rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                                "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
                                "mscale": 1.0, "mscale_all_dim": 1.0})
GLM_DIMS = dict(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=64, num_attention_heads=4,
                num_key_value_heads=4, n_shared_experts=1, n_routed_experts=16, num_experts_per_tok=4, n_group=1,
                topk_group=1, first_k_dense_replace=1, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32,
                qk_rope_head_dim=64, v_head_dim=32, index_n_heads=8, index_head_dim=64, index_topk=8)
QWEN_DIMS = dict(vocab_size=512, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                 partial_rotary_factor=0.25, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=64,
                 shared_expert_intermediate_size=64, intermediate_size=128, rope_theta=1e7)
V4_DIMS = dict(vocab_size=512, hidden_size=256, moe_intermediate_size=64, num_attention_heads=4, head_dim=64,
               q_lora_rank=64, num_experts_per_tok=3, n_routed_experts=16, n_shared_experts=1,
               scoring_func="sqrtsoftplus", routed_scaling_factor=1.5, norm_topk_prob=True, rope_theta=10000.0,
               partial_rotary_factor=0.25, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, swiglu_limit=10.0,
               sliding_window=8, o_groups=2, o_lora_rank=64, layer_types=["sliding_attention"],
               mlp_layer_types=["moe"], rms_norm_eps=1e-6)


def outside_checkpoint(family: str, fmt: str) -> Path:
    """The checkpoint of `family` in `fmt` (FORMATS), built once per process."""
    if (family, fmt) not in _BUILT:
        assert fmt in FORMATS[family], (family, fmt)
        path = Path(tempfile.mkdtemp(prefix=f"outside_{family}_{fmt}_"))
        {"deepseek_v3": _v3, "glm5": _glm, "qwen3_next": _qwen, "deepseek_v4": _v4}[family](path, fmt)
        _BUILT[family, fmt] = path
    return _BUILT[family, fmt]


# -- transformers: a random model saved as its release would be -----------------------------------------------
def _saved(model_type: str, dims: dict, seed: int, norm_offset: float, f32=()) -> tuple[dict, dict]:
    """save_pretrained of a random `model_type` model (weights redrawn so activations are of order one:
    projections N(0, 1/k), norm weights norm_offset + N(0, 0.1^2), embedding N(0, 1)), BF16 but for the
    names matching `f32`. Returns (torch tensors by saved key, the saved config.json)."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **dims))
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if "rotary" in name or "inv_freq" in name:
                continue
            if p.ndim >= 2:            # [out, in], or [experts, out, in] held fused
                p.copy_(torch.randn_like(p) / (1.0 if "embed" in name else math.sqrt(p.shape[-1])))
            elif name.endswith("norm.weight"):
                p.copy_(norm_offset + 0.1 * torch.randn_like(p))
            elif name.endswith("scale"):  # mHC scales
                p.copy_(0.5 + torch.rand_like(p))
            else:                     # biases (router correction, k_norm), mHC bases, sinks
                p.copy_((0.3 if "e_score" in name else 0.5) * torch.randn_like(p))
    model = model.to(torch.bfloat16)
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        if any(s in name for s in f32):
            p.data = p.data.float()
    out = Path(tempfile.mkdtemp(prefix=f"hf_{model_type}_"))
    model.save_pretrained(out)
    tensors = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors, json.loads((out / "config.json").read_text())


def _write(path: Path, first: dict, second: dict, config: dict, hf_quant: dict | None = None) -> None:
    """Two shards (what transformers saved, renamed / quantised; the tensors added) and their index, with
    safetensors' own writer; config.json as given."""
    from safetensors.torch import save_file
    shards = {"model-00001-of-00002.safetensors": first, "model-00002-of-00002.safetensors": second}
    for name, tensors in shards.items():
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / name), metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(v.numel() * v.element_size() for t in shards.values() for v in t.values())},
             "weight_map": {k: name for name, t in shards.items() for k in t}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    if hf_quant is not None:
        (path / "hf_quant_config.json").write_text(json.dumps(hf_quant, indent=2))


def _rand(shape, scale: float, seed: int):
    import torch
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)


# -- hand-built quantised tensors ------------------------------------------------------------------------------
def _np(t) -> np.ndarray:
    import torch
    return t.to(torch.float64).numpy()


def _fp8_block(w, e8m0: bool) -> dict:
    """Block FP8 of a [n, k] weight: 128 x 128 blocks, scale = amax / 448 as a float32 multiplier
    (`weight_scale_inv`), or the power of two 2^ceil(log2(amax / 448)) as an E8M0 byte (`scale`)."""
    import torch
    a = _np(w)
    n, k = a.shape
    nb, kb = -(-n // 128), -(-k // 128)
    pad = np.zeros((nb * 128, kb * 128))
    pad[:n, :k] = np.abs(a)
    amax = pad.reshape(nb, 128, kb, 128).max(axis=(1, 3))
    if e8m0:
        e = np.where(amax > 0, np.ceil(np.log2(np.where(amax > 0, amax, 1) / 448.0)), 0).astype(np.int64)
        s = np.exp2(e.astype(np.float64))
        scale = torch.from_numpy((e + 127).astype(np.uint8)).view(torch.float8_e8m0fnu)
    else:
        s = np.where(amax > 0, amax / 448.0, 1.0).astype(np.float32).astype(np.float64)
        scale = torch.from_numpy(s.astype(np.float32))
    codes = encode_e4m3(a / np.kron(s, np.ones((128, 128)))[:n, :k])
    return {".weight": torch.from_numpy(codes).view(torch.float8_e4m3fn),
            (".scale" if e8m0 else ".weight_scale_inv"): scale}


def _mxfp4(w) -> dict:
    """MXFP4 of a [n, k] weight (DeepSeek-V4 experts): per 32 inputs the power of two 2^ceil(log2(amax / 6)) as
    an E8M0 `scale`, e2m1 codes two per byte (the even element in the low nibble) stored as I8."""
    import torch
    a = _np(w)
    n, k = a.shape
    amax = np.abs(a).reshape(n, k // 32, 32).max(axis=-1)
    e = np.where(amax > 0, np.ceil(np.log2(np.where(amax > 0, amax, 1) / 6.0)), 0).astype(np.int64)
    codes = encode_e2m1(a / np.repeat(np.exp2(e.astype(np.float64)), 32, axis=1))
    return {".weight": torch.from_numpy(pack_e2m1(codes).view(np.int8)),
            ".scale": torch.from_numpy((e + 127).astype(np.uint8)).view(torch.float8_e8m0fnu)}


def _nvfp4(w) -> dict:
    """ModelOpt NVFP4 of a [n, k] weight: weight_scale_2 = amax / (6 * 448); per 16 inputs an e4m3 block scale
    of block amax / (6 * weight_scale_2); e2m1 codes of w / (block scale * weight_scale_2), two per U8 byte
    (even element low); an input_scale as ModelOpt exports it."""
    import torch
    from reference.checkpoint import E4M3
    a = _np(w)
    n, k = a.shape
    s2 = float(np.float32(np.abs(a).max() / (6 * 448)))
    bamax = np.abs(a).reshape(n, k // 16, 16).max(axis=-1)
    bs_codes = encode_e4m3(np.clip(bamax / (6 * s2), 2.0 ** -9, 448.0))
    bs = E4M3[bs_codes]
    codes = encode_e2m1(a / np.repeat(bs * s2, 16, axis=1))
    return {".weight": torch.from_numpy(pack_e2m1(codes)),
            ".weight_scale": torch.from_numpy(bs_codes).view(torch.float8_e4m3fn),
            ".weight_scale_2": torch.tensor(s2, dtype=torch.float32), ".input_scale": torch.tensor(1.0)}


def _quantise(tensors: dict, modules, enc) -> dict:
    """Replace `<module>.weight` of each module with its encoded tensors."""
    out = dict(tensors)
    for m in modules:
        w = out.pop(m + ".weight")
        out.update({m + suffix: t for suffix, t in enc(w).items()})
    return out


# -- the families ----------------------------------------------------------------------------------------------
def _mla_mtp(path: Path, fmt: str, model_type: str, dims: dict, quant_skip: tuple) -> None:
    """DeepSeek-V3 / GLM-5: a 2-layer model whose layer 1 (MoE) is the MTP layer, `model.layers.1.`; config
    num_hidden_layers 1; the MTP-only tensors in the second shard (A.1, C.3); FP8: every projection of the
    layer but eh_proj, the router and `quant_skip` block-FP8 with a float32 weight_scale_inv."""
    t, cfg = _saved(model_type, {**dims, "num_hidden_layers": 2}, seed=1, norm_offset=1.0,
                    f32=("e_score_correction_bias",))
    P, D = "model.layers.1.", dims["hidden_size"]
    extra = {P + "enorm.weight": 1 + _rand((D,), 0.1, 2).float(), P + "hnorm.weight": 1 + _rand((D,), 0.1, 3).float(),
             P + "shared_head.norm.weight": 1 + _rand((D,), 0.1, 4).float(),
             P + "eh_proj.weight": _rand((D, 2 * D), 1 / math.sqrt(2 * D), 5)}
    extra = {k: v.to(t[P + "input_layernorm.weight"].dtype) for k, v in extra.items()}
    t["lm_head.weight"] = (t["lm_head.weight"].float() * 3).to(t["lm_head.weight"].dtype)   # clear top-2 margins
    cfg.update(num_hidden_layers=1, num_nextn_predict_layers=1)
    for key in ("layer_types", "mlp_layer_types", "indexer_types"):
        if key in cfg:
            cfg[key] = cfg[key][:1]
    if fmt == "fp8":
        proj = [k[:-len(".weight")] for k, v in t.items() if k.startswith(P) and v.ndim == 2
                and not k.endswith(("mlp.gate.weight",) + quant_skip)]
        t = _quantise(t, proj, lambda w: _fp8_block(w, e8m0=False))
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": [128, 128]}
    _write(path, t, extra, cfg)


def _v3(path: Path, fmt: str) -> None:
    _mla_mtp(path, fmt, "deepseek_v3", V3_DIMS, ())


def _glm(path: Path, fmt: str) -> None:
    _mla_mtp(path, fmt, "glm_moe_dsa", GLM_DIMS, ("indexer.weights_proj.weight",))


def _qwen(path: Path, fmt: str) -> None:
    """Qwen3-Next: a one-layer (full attention) model's layer renamed `mtp.layers.0.` (transformers has no MTP
    module), the wrapper (fc, the pre-fc norms, mtp.norm) added; config.json back to a 4-layer hybrid whose
    MTP head that is. NVFP4: every projection of the layer but the router and the shared-expert gate, as a
    ModelOpt export (mtp.fc and lm_head excluded, listed in exclude_modules)."""
    import torch
    dims = {**QWEN_DIMS, "num_hidden_layers": 1, "layer_types": ["full_attention"]}
    t, cfg = _saved("qwen3_next", dims, seed=6, norm_offset=0.0)       # (1 + w) norms: w near 0
    D = dims["hidden_size"]
    t = {("mtp.layers.0." + k[len("model.layers.0."):] if k.startswith("model.layers.0.") else k): v
         for k, v in t.items() if k != "model.norm.weight"}
    extra = {"mtp.fc.weight": _rand((D, 2 * D), 1 / math.sqrt(2 * D), 7),
             **{f"mtp.{n}.weight": _rand((D,), 0.1, 8 + i) for i, n in
                enumerate(("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"))}}
    cfg.update(num_hidden_layers=4, full_attention_interval=4, mtp_num_hidden_layers=1,
               layer_types=["linear_attention"] * 3 + ["full_attention"])
    hf_quant = None
    if fmt == "nvfp4":
        skip = ("mlp.gate.weight", "shared_expert_gate.weight")
        proj = [k[:-len(".weight")] for k, v in t.items() if k.startswith("mtp.layers.0.") and v.ndim == 2
                and not k.endswith(skip)]
        t = _quantise(t, proj, _nvfp4)
        exclude = ["lm_head", "mtp.fc", "*.mlp.gate", "*.shared_expert_gate"]
        cfg["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                                      "exclude_modules": exclude}
        hf_quant = {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4", "group_size": 16,
                                                                      "exclude_modules": exclude}}
    assert all(v.dtype != torch.float32 or v.ndim == 0 for v in t.values())
    _write(path, t, extra, cfg, hf_quant)


def _v4(path: Path, fmt: str) -> None:
    """DeepSeek-V4: the one-layer model's layer (transformers saves DeepSeek's own names) renamed `mtp.0.`,
    its hc_head and final norm the MTP layer's, kv_norm under its release name (DeepSeek's `attn.kv_norm`;
    transformers 5.24 saves it as `attn.norm`, inverting its load-time rename of the compressor's norm),
    e_proj / h_proj / enorm / hnorm added; FP8 projections with E8M0 block scales, MXFP4 routed experts, the
    router, norms, mHC parameters and sinks as released (BF16 / F32)."""
    t, cfg = _saved("deepseek_v4", {**V4_DIMS, "num_hidden_layers": 1}, seed=11, norm_offset=1.0,
                    f32=("_hc.", "hc_head.", "sinks", "e_score"))
    D = V4_DIMS["hidden_size"]
    ren = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "mtp.0.norm.weight",
           "model.hc_head.hc_fn": "mtp.0.hc_head_fn", "model.hc_head.hc_base": "mtp.0.hc_head_base",
           "model.hc_head.hc_scale": "mtp.0.hc_head_scale"}
    out = {}
    for k, v in t.items():
        k = ren.get(k, "mtp.0." + k[len("model.layers.0."):] if k.startswith("model.layers.0.") else k)
        out[k.replace("mtp.0.attn.norm.weight", "mtp.0.attn.kv_norm.weight")] = v
    extra = {"mtp.0.e_proj.weight": _rand((D, D), 1 / math.sqrt(D), 12),
             "mtp.0.h_proj.weight": _rand((D, D), 1 / math.sqrt(D), 13),
             "mtp.0.enorm.weight": (1 + _rand((D,), 0.1, 14).float()).bfloat16(),
             "mtp.0.hnorm.weight": (1 + _rand((D,), 0.1, 15).float()).bfloat16()}
    experts = [k[:-len(".weight")] for k in out if ".ffn.experts." in k]
    fp8 = [k[:-len(".weight")] for k, v in out.items() if k.startswith("mtp.0.") and v.ndim == 2
           and ".ffn.experts." not in k and "hc_" not in k and not k.endswith("gate.weight")]
    out = _quantise(_quantise(out, experts, _mxfp4), fp8, lambda w: _fp8_block(w, e8m0=True))
    extra = _quantise(extra, ["mtp.0.e_proj", "mtp.0.h_proj"], lambda w: _fp8_block(w, e8m0=True))
    cfg.update(expert_dtype="fp4", quantization_config={
        "quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "activation_scheme": "dynamic",
        "weight_block_size": [128, 128]})
    _write(path, out, extra, cfg)
