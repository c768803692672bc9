"""DeepSeek-V4 MTP checkpoint keys (docs/model_math.md B.1) and the device loader.

The MTP module lives under `mtp.0.` with no `model.` prefix; it has no embedding or LM head of its own and
uses the target's top-level `embed.weight` / `head.weight` (bf16; transformers' `model.embed_tokens.weight` /
`lm_head.weight` when those are what the checkpoint has). Projections are FP8 e4m3 with an E8M0
`.scale` per 128 x 128 block; routed experts are FP4 (two e2m1 per byte, stored as I8) with an E8M0 `.scale`
per 32 inputs; the router `ffn.gate` is bf16 with an f32 `.bias`; the mHC parameters and attention sinks
are f32; norms bf16."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import ConfigError
from ..runtime.backend import Backend
from ..runtime.ptr import NULL, DevicePtr
from .config import DeepseekV4Config
from .linear import Linear
from .loader import WeightLoader
from .safetensors_io import Checkpoint

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
class DeepseekV4MtpWeights:
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


def load_deepseek_v4(gpu: Backend, path, cfg: DeepseekV4Config, progress: bool | None = None) -> DeepseekV4MtpWeights:
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
    with WeightLoader(gpu, ckpt, progress=progress, total=total) as wl:
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

        return DeepseekV4MtpWeights(
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
