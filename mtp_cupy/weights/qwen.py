"""Qwen3-Next MTP checkpoint keys (arch_math.md D.1) and a tiny random checkpoint in the real layout.

The MTP module lives under `mtp.` (vLLM maps it to `model.`); the embedding and LM head are the target's
(`model.embed_tokens.weight`, `lm_head.weight`). A dense-FFN head has `mlp.{gate,up,down}_proj` where a MoE
head has the router `mlp.gate`, `mlp.experts.{e}.*`, `mlp.shared_expert.*` and `mlp.shared_expert_gate`.

Quantised checkpoints are written the way the real ones store each tensor, decided per tensor:
  fp8    Qwen/DeepSeek block FP8: `.weight` F8_E4M3 [n, k] + `.weight_scale_inv` F32 [ceil(n/128), ceil(k/128)];
         the router, the shared-expert gate, norms, embedding and LM head stay BF16.
  nvfp4  ModelOpt: `.weight` U8 [n, k/2] + `.weight_scale` F8_E4M3 [n, k/16] + `.weight_scale_2` F32 [] +
         `.input_scale` F32 []; `hf_quant_config.json` lists what stays BF16 (`exclude_modules`): here the
         LM head, router, shared-expert gate and `mtp.fc`, so one checkpoint mixes both kinds."""
from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import WeightError
from ..runtime.backend import Backend
from ..runtime.dtypes import BF16
from ..runtime.ptr import DevicePtr
from .config import Qwen3NextConfig
from .linear import Linear
from .loader import WeightLoader
from .quant_host import quant_fp8_block, quant_nvfp4
from .writer import write_checkpoint

EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"
MTP = "mtp."
LAYER = "mtp.layers.0."
ATTN = LAYER + "self_attn."
MLP = LAYER + "mlp."

NORMS = {"pre_fc_norm_embedding": MTP + "pre_fc_norm_embedding.weight",
         "pre_fc_norm_hidden": MTP + "pre_fc_norm_hidden.weight",
         "input_layernorm": LAYER + "input_layernorm.weight",
         "post_attention_layernorm": LAYER + "post_attention_layernorm.weight",
         "norm": MTP + "norm.weight",
         "q_norm": ATTN + "q_norm.weight", "k_norm": ATTN + "k_norm.weight"}
# linear role -> module prefix (the tensor is `<prefix>.weight` plus its scales)
ATTN_LINEARS = {"fc": MTP + "fc", "q_proj": ATTN + "q_proj", "k_proj": ATTN + "k_proj",
                "v_proj": ATTN + "v_proj", "o_proj": ATTN + "o_proj"}
DENSE_FFN = {"gate_proj": MLP + "gate_proj", "up_proj": MLP + "up_proj", "down_proj": MLP + "down_proj"}
ROUTER = MLP + "gate"
SHARED_GATE = MLP + "shared_expert_gate"
SHARED_EXPERT = tuple(f"{MLP}shared_expert.{p}" for p in ("gate_proj", "up_proj", "down_proj"))


def expert(e: int) -> tuple[str, str, str]:
    """(gate, up, down) module prefixes of routed expert e."""
    return tuple(f"{MLP}experts.{e}.{p}" for p in ("gate_proj", "up_proj", "down_proj"))


def is_dense_ffn(keys) -> bool:
    """A head whose checkpoint has a dense SwiGLU FFN instead of the MoE (decided from the keys)."""
    keys = set(keys)
    return DENSE_FFN["gate_proj"] + ".weight" in keys and ROUTER + ".weight" not in keys


# -- loading -----------------------------------------------------------------------------------------
@dataclass
class QwenMtpWeights:
    """The head's tensors on the device. Linears keep their stored format until `quantize`."""
    embed: DevicePtr                                   # bf16 [vocab, hidden]
    lm_head: Linear
    norms: dict[str, DevicePtr]                        # NORMS roles -> bf16 vectors
    linears: dict[str, Linear]                         # fc, q/k/v/o_proj (+ gate/up/down_proj when dense)
    dense_ffn: bool
    router: Linear | None = None
    shared_gate: Linear | None = None
    experts: dict[int, tuple[Linear, Linear, Linear]] = field(default_factory=dict)
    shared: tuple[Linear, Linear, Linear] | None = None
    owners: list = field(default_factory=list, repr=False)

    def quantize(self, gpu: Backend, fmt: str) -> None:
        """BF16 projections -> `fmt` on the device (fp8_row / nvfp4); stored FP8/NVFP4 ones stay as they are.
        The router and the shared-expert gate stay BF16: they pick experts, and they are tiny."""
        if fmt == "bf16":
            return
        from ..ops import quantize_linear

        def q(w: Linear) -> Linear:
            return quantize_linear(gpu, w, fmt) if w.fmt == "bf16" else w
        self.linears = {r: q(w) for r, w in self.linears.items()}
        self.experts = {e: tuple(q(w) for w in gud) for e, gud in self.experts.items()}
        if self.shared is not None:
            self.shared = tuple(q(w) for w in self.shared)


def _first_key(ckpt, keys: tuple[str, ...], what: str) -> str:
    for k in keys:
        if ckpt.has(k):
            return k
    raise WeightError(f"no {what} in the checkpoint (looked for {', '.join(keys)})", keys[0])


def load_qwen_mtp(gpu: Backend, path, cfg: Qwen3NextConfig, progress: bool | None = None) -> QwenMtpWeights:
    """The MTP head of the checkpoint at `path` (shapes checked against `cfg`), each projection in the format
    the checkpoint stores it."""
    D, V, H, KV, hd = cfg.hidden_size, cfg.vocab_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    with WeightLoader(gpu, path, progress) as wl:
        ck = wl.ckpt
        dense = is_dense_ffn(ck.keys())
        if not dense and not cfg.mtp_is_moe:
            raise WeightError("config.json has num_experts = 0 but the checkpoint has a MoE head", ROUTER + ".weight")
        owners = []

        def vec(key: str, n: int) -> DevicePtr:
            owners.append(wl.tensor(key, (n,), as_dtype="bf16"))
            return owners[-1].ptr
        emb_key = _first_key(ck, cfg.embed_keys, "embedding")
        owners.append(wl.tensor(emb_key, (V, D), as_dtype="bf16"))
        embed = owners[-1].ptr
        if any(ck.has(k) for k in cfg.head_keys) or not cfg.tie_word_embeddings:
            lm_head = wl.linear(_first_key(ck, cfg.head_keys, "LM head")[:-len(".weight")], V, D)
        else:   # tied: the embedding table is the head
            lm_head = Linear("bf16", V, D, embed, owners=[owners[-1]])
        norms = {r: vec(k, hd if r in ("q_norm", "k_norm") else D) for r, k in NORMS.items()}
        shapes = {"fc": (D, 2 * D), "q_proj": (2 * H * hd, D), "k_proj": (KV * hd, D), "v_proj": (KV * hd, D),
                  "o_proj": (D, H * hd)}
        linears = {r: wl.linear(m, *shapes[r]) for r, m in ATTN_LINEARS.items()}
        w = QwenMtpWeights(embed, lm_head, norms, linears, dense, owners=owners)
        if dense:
            inter = ck.info(DENSE_FFN["gate_proj"] + ".weight").shape[0]
            w.linears.update(gate_proj=wl.linear(DENSE_FFN["gate_proj"], inter, D),
                             up_proj=wl.linear(DENSE_FFN["up_proj"], inter, D),
                             down_proj=wl.linear(DENSE_FFN["down_proj"], D, inter))
            return w
        E, inter, sh = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size

        def swiglu(prefixes: tuple[str, str, str], i: int) -> tuple[Linear, Linear, Linear]:
            g, u, d = prefixes
            return wl.linear(g, i, D), wl.linear(u, i, D), wl.linear(d, D, i)
        w.router = wl.linear(ROUTER, E, D)
        w.shared_gate = wl.linear(SHARED_GATE, 1, D)
        w.experts = {e: swiglu(expert(e), inter) for e in range(E)}
        w.shared = swiglu(SHARED_EXPERT, sh)
        return w


# -- tiny checkpoint -----------------------------------------------------------------------------------
TINY_DIMS = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                 partial_rotary_factor=0.25, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=64,
                 shared_expert_intermediate_size=64, intermediate_size=128, vocab_size=512,
                 rope_theta=10000000.0, rms_norm_eps=1e-6, num_hidden_layers=4, full_attention_interval=4)
NVFP4_EXCLUDE = ["lm_head", MTP + "fc", "*.mlp.gate", "*.shared_expert_gate"]
FP8_EXCLUDE = ["lm_head", "*.mlp.gate", "*.shared_expert_gate"]


def tiny_config(quant: str = "bf16", **dims) -> dict:
    """config.json of a tiny Qwen3-Next (HF names; unknown keys in `dims` are an error)."""
    bad = set(dims) - set(TINY_DIMS)
    if bad:
        raise ValueError(f"unknown dims {sorted(bad)}; known: {sorted(TINY_DIMS)}")
    c = {**TINY_DIMS, **dims}
    n = c["num_hidden_layers"]
    c.update(model_type="qwen3_next", architectures=["Qwen3NextForCausalLM"], hidden_act="silu",
             norm_topk_prob=True, tie_word_embeddings=False, mtp_num_hidden_layers=1, decoder_sparse_step=1,
             max_position_embeddings=32768, torch_dtype="bfloat16",
             layer_types=["full_attention" if (i + 1) % c["full_attention_interval"] == 0 else "linear_attention"
                          for i in range(n)])
    if quant == "fp8":
        c["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                    "weight_block_size": [128, 128], "modules_to_not_convert": FP8_EXCLUDE}
    elif quant == "nvfp4":
        c["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                                    "exclude_modules": NVFP4_EXCLUDE}
    return c


def _excluded(module: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(module, p) for p in patterns)


def _store(out: dict[str, np.ndarray], module: str, w: np.ndarray, quant: str) -> None:
    """One linear under `module`, in the format a real `quant` checkpoint stores it."""
    if quant == "fp8" and not _excluded(module, FP8_EXCLUDE):
        out[module + ".weight"], out[module + ".weight_scale_inv"] = quant_fp8_block(w)
    elif quant == "nvfp4" and not _excluded(module, NVFP4_EXCLUDE):
        q, s, s2 = quant_nvfp4(w)
        out[module + ".weight"], out[module + ".weight_scale"] = q, s
        out[module + ".weight_scale_2"] = np.array(s2, np.float32)
        out[module + ".input_scale"] = np.array(1.0, np.float32)
    else:
        out[module + ".weight"] = w.astype(BF16)


def tiny_tensors(cfg: dict, seed: int, quant: str, dense_ffn: bool) -> dict[str, np.ndarray]:
    """Random weights with activations of order one: linears N(0, 1/k), norm weights N(0, 0.1^2) (the
    (1 + w) convention), embedding N(0, 1)."""
    rng = np.random.default_rng(seed)
    D, H, KV, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    V = cfg["vocab_size"]

    def lin(n: int, k: int) -> np.ndarray:
        return (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)

    out: dict[str, np.ndarray] = {EMBED: rng.standard_normal((V, D)).astype(BF16)}
    for key in NORMS.values():
        dim = hd if key in (NORMS["q_norm"], NORMS["k_norm"]) else D
        out[key] = (0.1 * rng.standard_normal(dim)).astype(BF16)
    shapes = {"fc": (D, 2 * D), "q_proj": (2 * H * hd, D), "k_proj": (KV * hd, D), "v_proj": (KV * hd, D),
              "o_proj": (D, H * hd)}
    for role, module in ATTN_LINEARS.items():
        _store(out, module, lin(*shapes[role]), quant)
    if dense_ffn:
        inter = cfg["intermediate_size"]
        for role, module in DENSE_FFN.items():
            _store(out, module, lin(D, inter) if role == "down_proj" else lin(inter, D), quant)
    else:
        E, inter, sh = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["shared_expert_intermediate_size"]
        _store(out, ROUTER, lin(E, D), quant)
        _store(out, SHARED_GATE, lin(1, D), quant)
        for prefixes, i in [(expert(e), inter) for e in range(E)] + [(SHARED_EXPERT, sh)]:
            g, u, d = prefixes
            _store(out, g, lin(i, D), quant)
            _store(out, u, lin(i, D), quant)
            _store(out, d, lin(D, i), quant)
    _store(out, LM_HEAD[:-len(".weight")], lin(V, D), quant)
    return out


def write_tiny_checkpoint(path, seed: int = 0, quant: str = "bf16", dense_ffn: bool = False, **dims) -> Path:
    """A small random Qwen3-Next MTP checkpoint (config.json + model.safetensors, plus ModelOpt's
    hf_quant_config.json for nvfp4) at `path`; `dims` override TINY_DIMS (HF config names)."""
    if quant not in ("bf16", "fp8", "nvfp4"):
        raise ValueError(f"quant {quant!r}: choose bf16, fp8 or nvfp4")
    if dense_ffn:   # Qwen3NextConfig: num_experts == 0 marks a dense-FFN head
        dims = {"num_experts": 0, "num_experts_per_tok": 0, **dims}
    cfg = tiny_config(quant, **dims)
    d = write_checkpoint(path, tiny_tensors(cfg, seed, quant, dense_ffn), config=cfg)
    if quant == "nvfp4":
        hq = {"producer": {"name": "modelopt"},
              "quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": NVFP4_EXCLUDE,
                               "kv_cache_quant_algo": None}}
        (Path(d) / "hf_quant_config.json").write_text(json.dumps(hq, indent=2) + "\n")
    return Path(d)
