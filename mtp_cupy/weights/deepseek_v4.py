"""DeepSeek-V4 MTP checkpoint keys (arch_math.md B.1), the device loader, and a tiny random checkpoint in the
real key layout and dtypes.

The MTP module lives under `mtp.0.` with no `model.` prefix; it has no embedding or LM head of its own and
uses the target's top-level `embed.weight` / `head.weight` (bf16; transformers' `model.embed_tokens.weight` /
`lm_head.weight` when those are what the checkpoint has). Projections are FP8 e4m3 with an E8M0
`.scale` per 128 x 128 block; routed experts are FP4 (two e2m1 per byte, stored as I8) with an E8M0 `.scale`
per 32 inputs; the router `ffn.gate` is bf16 with an f32 `.bias`; the mHC parameters and attention sinks
are f32; norms bf16."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError
from ..runtime.backend import Backend
from ..runtime.dtypes import BF16
from ..runtime.ptr import NULL, DevicePtr
from .config import DeepseekV4Config
from .linear import Linear
from .loader import WeightLoader
from .quant_host import quant_fp8_block_e8m0, quant_mxfp4
from .safetensors_io import Checkpoint
from .writer import write_checkpoint

P = "mtp.0."
EMBED, HEAD = "embed.weight", "head.weight"
NORMS = ("enorm", "hnorm", "norm", "attn_norm", "ffn_norm", "attn.q_norm", "attn.kv_norm")
ATTN = ("wq_a", "wq_b", "wkv", "wo_a", "wo_b")
HC_SITES = ("attn", "ffn")
HC_HEAD = tuple(P + f"hc_head_{s}" for s in ("fn", "base", "scale"))
FP8_PROJ = ("e_proj", "h_proj") + tuple(f"attn.{n}" for n in ATTN) + \
    tuple(f"ffn.shared_experts.{n}" for n in ("w1", "w3", "w2"))


class LowRankHcHeadError(ConfigError):
    """The checkpoint's mHC head is low-rank (factored hc_head_fn); only the full Sinkhorn-style head runs."""


@dataclass
class HcParams:
    """One mHC site on the device: fn f32 [mix, hc*D], base f32 [mix], scale f32 [3] ([1] for the head)."""
    fn: DevicePtr
    base: DevicePtr
    scale: DevicePtr


@dataclass
class V4MtpWeights:
    embed: DevicePtr                                  # bf16 [vocab, D]
    head: Linear                                      # bf16 [vocab, D]
    norms: dict[str, DevicePtr]                       # NORMS -> bf16 weight
    e_proj: Linear
    h_proj: Linear
    hc: dict[str, HcParams]                           # "attn", "ffn"
    hc_head: HcParams | None                          # None: no head weights (first stream is taken)
    attn: dict[str, Linear]                           # ATTN -> Linear
    attn_sink: DevicePtr                              # f32 [heads]
    router: Linear                                    # bf16 [experts, D]
    router_bias: DevicePtr                            # f32 [experts] (NULL for a hash-routed layer)
    tid2eid: DevicePtr                                # i32 [vocab, top_k] of a hash-routed layer, else NULL
    experts: dict[int, tuple[Linear, Linear, Linear]]  # e -> (w1 gate, w3 up, w2 down)
    shared: tuple[Linear, Linear, Linear]
    owners: list[Any] = field(default_factory=list, repr=False)


def check_hc_head(ckpt: Checkpoint, hc: int, dim: int) -> bool:
    """True for a full mHC head, False for none; a factored (low-rank) head raises LowRankHcHeadError."""
    keys = [k for k in ckpt.keys() if k.startswith(P + "hc_head")]
    if not keys:
        return False
    extra = sorted(set(keys) - set(HC_HEAD))
    fn = ckpt.info(HC_HEAD[0]).shape if ckpt.has(HC_HEAD[0]) else None
    if extra or fn != (hc, hc * dim):
        raise LowRankHcHeadError(
            f"the MTP mHC head is not the full [hc, hc*D] = [{hc}, {hc * dim}] map (hc_head_fn "
            f"{list(fn) if fn else 'absent'}; other head keys {extra}): a low-rank head is not supported")
    return True


def load_v4_mtp(gpu: Backend, path, cfg: DeepseekV4Config) -> V4MtpWeights:
    """Every tensor the V4 MTP step reads, in its stored format (see the module docstring)."""
    if cfg.mtp_compress_ratio != 0:
        raise ConfigError(f"the MTP layer has compress ratio {cfg.mtp_compress_ratio}; only the sliding-window "
                          "kind (0, no compressor or indexer) is supported")
    ckpt = Checkpoint(path)
    embed_key, head_key = (next((k for k in keys if ckpt.has(k)), keys[0])   # the first spelling present
                           for keys in (cfg.embed_keys, cfg.head_keys))
    D, hc, V, H, hd = cfg.hidden_size, cfg.hc_mult, cfg.vocab_size, cfg.num_attention_heads, cfg.head_dim
    has_head = check_hc_head(ckpt, hc, D)
    mix, E, I = (2 + hc) * hc, cfg.n_routed_experts, cfg.moe_intermediate_size
    G, R, QL = cfg.o_groups, cfg.o_lora_rank, cfg.q_lora_rank
    total = ckpt.nbytes_total(P) + ckpt.info(embed_key).nbytes + ckpt.info(head_key).nbytes
    with WeightLoader(gpu, ckpt, total=total) as wl:
        owners: list[Any] = []

        def t(key: str, shape, as_dtype: str) -> DevicePtr:
            buf = wl.tensor(key, shape, as_dtype=as_dtype)
            owners.append(buf)
            return buf.ptr

        def lin(module: str, n: int, k: int, allow=("bf16", "fp8_block", "fp8_block_e8m0")) -> Linear:
            return wl.linear(P + module, n, k, allow)

        norm_dims = {"attn.q_norm": QL, "attn.kv_norm": hd}
        hc_site = {s: HcParams(t(P + f"hc_{s}_fn", (mix, hc * D), "f32"), t(P + f"hc_{s}_base", (mix,), "f32"),
                               t(P + f"hc_{s}_scale", (3,), "f32")) for s in HC_SITES}
        head_hc = HcParams(t(HC_HEAD[0], (hc, hc * D), "f32"), t(HC_HEAD[1], (hc,), "f32"),
                           t(HC_HEAD[2], (1,), "f32")) if has_head else None
        attn_shapes = {"wq_a": (QL, D), "wq_b": (H * hd, QL), "wkv": (hd, D), "wo_a": (G * R, H * hd // G),
                       "wo_b": (D, G * R)}
        fp4 = ("mxfp4", "bf16", "fp8_block_e8m0")
        hashed = ckpt.has(P + "ffn.gate.tid2eid")   # a hash-routed layer (layer id < num_hash_layers)

        def tid2eid(key: str) -> DevicePtr:
            ids = ckpt.get(key, (V, cfg.num_experts_per_tok), ("I32", "I64", "U8", "I8", "I16"))
            buf = wl.gpu.upload(np.ascontiguousarray(ids.astype(np.int32)))
            owners.append(buf)
            return buf.ptr

        return V4MtpWeights(
            embed=t(embed_key, (V, D), "bf16"),
            head=wl.linear(head_key.removesuffix(".weight"), V, D, ("bf16",)),
            norms={n: t(P + n + ".weight", (norm_dims.get(n, D),), "bf16") for n in NORMS},
            e_proj=lin("e_proj", D, D), h_proj=lin("h_proj", D, D), hc=hc_site, hc_head=head_hc,
            attn={n: lin("attn." + n, *s) for n, s in attn_shapes.items()},
            attn_sink=t(P + "attn.attn_sink", (H,), "f32"),
            router=lin("ffn.gate", E, D, ("bf16",)),
            router_bias=NULL if hashed else t(P + "ffn.gate.bias", (E,), "f32"),
            tid2eid=tid2eid(P + "ffn.gate.tid2eid") if hashed else NULL,
            experts={e: (lin(f"ffn.experts.{e}.w1", I, D, fp4), lin(f"ffn.experts.{e}.w3", I, D, fp4),
                         lin(f"ffn.experts.{e}.w2", D, I, fp4)) for e in range(E)},
            shared=(lin("ffn.shared_experts.w1", I * cfg.n_shared_experts, D),
                    lin("ffn.shared_experts.w3", I * cfg.n_shared_experts, D),
                    lin("ffn.shared_experts.w2", D, I * cfg.n_shared_experts)),
            owners=owners)


# -- tiny checkpoint ---------------------------------------------------------------------------------------
TINY_DIMS = dict(hidden_size=256, hc_mult=4, num_attention_heads=4, head_dim=64, qk_rope_head_dim=16,
                 q_lora_rank=64, o_groups=2, o_lora_rank=64, sliding_window=8, n_routed_experts=16,
                 num_experts_per_tok=3, moe_intermediate_size=64, vocab_size=512, num_hidden_layers=2,
                 rms_norm_eps=1e-6, hc_eps=1e-6, hc_sinkhorn_iters=20, rope_theta=10000.0,
                 routed_scaling_factor=1.5, swiglu_limit=10.0)


def tiny_config(hash_routed: bool = False, **dims) -> dict:
    """config.json of a tiny DeepSeek-V4 in the official spelling (compress_ratios per layer + the MTP
    layer, whose entry is 0 = sliding window only); `hash_routed` makes the MTP layer a hash layer."""
    bad = set(dims) - set(TINY_DIMS)
    if bad:
        raise ValueError(f"unknown dims {sorted(bad)}; known: {sorted(TINY_DIMS)}")
    c = {**TINY_DIMS, **dims}
    n = c["num_hidden_layers"]
    c.update(model_type="deepseek_v4", architectures=["DeepseekV4ForCausalLM"], num_key_value_heads=1,
             n_shared_experts=1, scoring_func="sqrtsoftplus", norm_topk_prob=True, topk_method="noaux_tc",
             num_hash_layers=n + 1 if hash_routed else min(n, 1), compress_ratios=[0] + [4] * (n - 1) + [0],
             compress_rope_theta=160000.0, num_nextn_predict_layers=1, tie_word_embeddings=False,
             torch_dtype="bfloat16", expert_dtype="fp4", max_position_embeddings=65536, index_n_heads=4,
             index_head_dim=32, index_topk=8,
             quantization_config={"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                  "activation_scheme": "dynamic", "weight_block_size": [128, 128]})
    return c


def tiny_tensors(cfg: dict, seed: int, low_rank_head: bool = False, hc_head: bool = True,
                 hash_routed: bool = False) -> dict[str, np.ndarray]:
    """Random weights with activations of order one: projections N(0, 1/k), norm weights 1 + N(0, 0.1^2),
    mHC maps whose mixes are of order one, embedding N(0, 1)."""
    rng = np.random.default_rng(seed)
    D, hc, H, hd = cfg["hidden_size"], cfg["hc_mult"], cfg["num_attention_heads"], cfg["head_dim"]
    V, E, I = cfg["vocab_size"], cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    QL, G, R = cfg["q_lora_rank"], cfg["o_groups"], cfg["o_lora_rank"]
    mix = (2 + hc) * hc

    def lin(n: int, k: int) -> np.ndarray:
        return (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)

    def f32(*shape, scale=1.0, loc=0.0) -> np.ndarray:
        return (loc + scale * rng.standard_normal(shape)).astype(np.float32)

    out: dict[str, np.ndarray] = {EMBED: f32(V, D).astype(BF16), HEAD: (2.0 * lin(V, D)).astype(BF16)}
    dims = {"attn.q_norm": QL, "attn.kv_norm": hd}
    for n in NORMS:
        out[P + n + ".weight"] = f32(dims.get(n, D), scale=0.1, loc=1.0).astype(BF16)

    def fp8(module: str, w: np.ndarray) -> None:
        out[P + module + ".weight"], out[P + module + ".scale"] = quant_fp8_block_e8m0(w)

    fp8("e_proj", lin(D, D))
    fp8("h_proj", lin(D, D))
    shapes = {"wq_a": (QL, D), "wq_b": (H * hd, QL), "wkv": (hd, D), "wo_a": (G * R, H * hd // G), "wo_b": (D, G * R)}
    for n, s in shapes.items():
        fp8("attn." + n, lin(*s))
    out[P + "attn.attn_sink"] = f32(H)
    for s in HC_SITES:
        out[P + f"hc_{s}_fn"] = f32(mix, hc * D, scale=1.0 / np.sqrt(hc * D))
        out[P + f"hc_{s}_base"] = f32(mix, scale=0.5)
        out[P + f"hc_{s}_scale"] = rng.uniform(0.5, 1.5, 3).astype(np.float32)
    if low_rank_head:
        out[P + "hc_head_fn_a"] = f32(2, hc * D, scale=1.0 / np.sqrt(hc * D))
        out[P + "hc_head_fn_b"] = f32(hc, 2)
    if hc_head or low_rank_head:
        if not low_rank_head:
            out[HC_HEAD[0]] = f32(hc, hc * D, scale=1.0 / np.sqrt(hc * D))
        out[HC_HEAD[1]] = f32(hc, scale=0.5)
        out[HC_HEAD[2]] = rng.uniform(0.5, 1.5, 1).astype(np.float32)
    out[P + "ffn.gate.weight"] = lin(E, D).astype(BF16)
    if hash_routed:   # tid2eid: top_k distinct experts per token id, no selection bias
        k = cfg["num_experts_per_tok"]
        out[P + "ffn.gate.tid2eid"] = np.argsort(rng.random((V, E)), axis=1)[:, :k].astype(np.int32)
    else:
        out[P + "ffn.gate.bias"] = f32(E, scale=0.1)
    for e in range(E):
        for n, (rows, k) in {"w1": (I, D), "w3": (I, D), "w2": (D, I)}.items():
            q, s = quant_mxfp4(lin(rows, k))
            out[P + f"ffn.experts.{e}.{n}.weight"], out[P + f"ffn.experts.{e}.{n}.scale"] = q.view(np.int8), s
    for n, s in {"w1": (I, D), "w3": (I, D), "w2": (D, I)}.items():
        fp8(f"ffn.shared_experts.{n}", lin(*s))
    return out


def write_tiny_checkpoint(path, seed: int = 0, low_rank_head: bool = False, hc_head: bool = True,
                          hash_routed: bool = False, **dims) -> Path:
    """A small random DeepSeek-V4 MTP checkpoint (config.json + model.safetensors) at `path` in the real key
    layout and dtypes; `dims` override TINY_DIMS (config.json names). `hc_head=False` leaves out the mHC
    head (the proposer then takes the first stream); `low_rank_head` writes a factored one (refused);
    `hash_routed` routes the MTP layer's MoE by `ffn.gate.tid2eid[token]` (a layer below num_hash_layers)."""
    cfg = tiny_config(hash_routed, **dims)
    return Path(write_checkpoint(path, tiny_tensors(cfg, seed, low_rank_head, hc_head, hash_routed), config=cfg))
