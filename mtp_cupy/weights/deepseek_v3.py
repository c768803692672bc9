"""DeepSeek-V3/R1/V3.1/V3.2 MTP checkpoint keys (arch_math.md A.1) and device loading.

The MTP module is `model.layers.{num_hidden_layers}.*`. The embedding and LM head are the target's
(`model.embed_tokens.weight`, `lm_head.weight`); the layer's own copies (`embed_tokens`, `shared_head.head`)
are the fallback when a checkpoint holds only the MTP layer. Each projection's format comes from its
safetensors dtype (FP8 block + weight_scale_inv, BF16 eh_proj, or a BF16 layer inside an FP8/NVFP4
model), never from config.json.

kv_b_proj is [H * (nope + v), C] with rows h*(nope+v) + j: W_UK[h] = j < nope, W_UV[h] = j >= nope. W_UV is
read in place by the grouped GEMV; W_UK is transposed per head at load into W_UK^T [H * C, nope] (the
absorption multiplies q_nope by W_UK[h]^T), kept FP8 where the 128x128 scale blocks survive the transpose
and dequantised to BF16 where they do not."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..runtime.backend import Backend
from ..runtime.dtypes import BF16
from ..runtime.ptr import DevicePtr
from . import quant_host as qh
from .config import DeepseekV3Config
from .linear import Linear
from .loader import WeightLoader, dequant_linear, detect_linear
from .safetensors_io import Checkpoint
from .writer import write_checkpoint

GROUPED_FORMATS = ("bf16", "fp8_block", "fp8_block_e8m0")   # what ops.grouped_gemv reads
NORMS = ("enorm", "hnorm", "input_layernorm", "post_attention_layernorm", "shared_head.norm")
ATTN_NORMS = ("q_a_layernorm", "kv_a_layernorm")
PROJ = ("gate_proj", "up_proj", "down_proj")


def mtp_keys(cfg: DeepseekV3Config) -> dict[str, str]:
    """Role -> key prefix (a projection's tensors are `<prefix>.weight` plus its scales)."""
    p = cfg.mtp_prefix
    a = p + "self_attn."
    keys = {"eh_proj": p + "eh_proj", "q_a_proj": a + "q_a_proj", "q_b_proj": a + "q_b_proj",
            "q_proj": a + "q_proj", "kv_a_proj_with_mqa": a + "kv_a_proj_with_mqa", "kv_b_proj": a + "kv_b_proj",
            "o_proj": a + "o_proj", "gate": p + "mlp.gate", "bias": p + "mlp.gate.e_score_correction_bias",
            "embed_copy": p + "embed_tokens.weight", "head_copy": p + "shared_head.head.weight"}
    keys.update({n: f"{p}{n}.weight" for n in NORMS})
    keys.update({n: f"{a}{n}.weight" for n in ATTN_NORMS})
    return keys


def expert_keys(cfg: DeepseekV3Config, e: int | None) -> tuple[str, str, str]:
    """(gate, up, down) prefixes of routed expert e, or of the shared expert when e is None."""
    m = cfg.mtp_prefix + "mlp."
    base = f"{m}experts.{e}." if e is not None else f"{m}shared_experts."
    return tuple(base + p for p in PROJ)


def first_present(ckpt: Checkpoint, *keys: str) -> str:
    for k in keys:
        if ckpt.has(k):
            return k
    return keys[0]   # absent everywhere: the loader's WeightError names the preferred key


@dataclass
class DeepseekV3MtpWeights:
    embed: DevicePtr                     # bf16 [vocab, D]
    head: Linear                         # [vocab, D]
    norms: dict[str, DevicePtr]          # NORMS + ATTN_NORMS, bf16
    eh_proj: Linear                      # [D, 2D]
    q_a: Linear | None                   # [q_lora, D] (None: q_proj directly, V2-Lite style)
    q_b: Linear                          # [H*(nope+rope), q_lora or D], grouped-GEMV format
    kv_a: Linear                         # [C + rope, D]
    w_uk_t: Linear                       # [H*C, nope], grouped-GEMV format
    kv_b: Linear                         # [H*(nope+v), C], grouped-GEMV format (W_UV rows read in place)
    o_proj: Linear                       # [D, H*v]
    router: Linear                       # [E, D]
    bias: DevicePtr                      # f32 [E] e_score_correction_bias
    experts: dict[int, tuple[Linear, Linear, Linear]]
    shared: tuple[Linear, Linear, Linear] | None
    owners: list = field(default_factory=list, repr=False)


def _grouped(wl: WeightLoader, prefix: str, n: int, k: int) -> Linear:
    """A projection the grouped GEMV reads: as stored when it can, else dequantised to bf16 on the host."""
    if detect_linear(wl.ckpt, prefix).fmt in GROUPED_FORMATS:
        return wl.linear(prefix, n, k)
    return _bf16_linear(wl.gpu, dequant_linear(wl.ckpt, prefix))


def _bf16_linear(gpu: Backend, w: np.ndarray) -> Linear:
    buf = gpu.upload(np.ascontiguousarray(w.astype(np.float32).astype(BF16)))
    return Linear("bf16", w.shape[0], w.shape[1], buf.ptr, owners=[buf])


def transpose_uk(gpu: Backend, ckpt: Checkpoint, prefix: str, H: int, nope: int, v: int, C: int) -> Linear:
    """W_UK^T [H*C, nope] from kv_b_proj: row h*C + c, column d = kv_b[h*(nope+v) + d, c]."""
    src = detect_linear(ckpt, prefix)
    ckpt.check(src.weight, (H * (nope + v), C))
    rows = (np.arange(H)[:, None, None] * (nope + v) + np.arange(nope)[None, None, :])   # [H, 1, nope]
    cols = np.arange(C)[None, :, None]                                                   # [1, C, 1]
    if src.fmt in ("fp8_block", "fp8_block_e8m0"):
        q, s = ckpt.numpy(src.weight), ckpt.numpy(src.scale)
        srow, scol = np.broadcast_arrays(rows // 128, cols // 128)
        srow, scol = srow.reshape(H * C, nope), scol.reshape(H * C, nope)
        blk_r, blk_c = srow[::128, ::128], scol[::128, ::128]
        tscale = s[blk_r, blk_c]
        per_elem = np.repeat(np.repeat(tscale.astype(np.float32), 128, 0), 128, 1)[:H * C, :nope]
        if np.array_equal(per_elem, s[srow, scol].astype(np.float32)):
            wbuf = gpu.upload(np.ascontiguousarray(q[rows, cols].reshape(H * C, nope)))
            sbuf = gpu.upload(np.ascontiguousarray(tscale))
            return Linear(src.fmt, H * C, nope, wbuf.ptr, sbuf.ptr, owners=[wbuf, sbuf])
    if src.fmt == "bf16" and ckpt.info(src.weight).dtype == "BF16":
        wt = ckpt.numpy(src.weight)[rows, cols].reshape(H * C, nope)
        buf = gpu.upload(np.ascontiguousarray(wt))
        return Linear("bf16", H * C, nope, buf.ptr, owners=[buf])
    return _bf16_linear(gpu, dequant_linear(ckpt, prefix)[rows, cols].reshape(H * C, nope))


def load_mtp_weights(gpu: Backend, path, cfg: DeepseekV3Config, progress: bool | None = None) -> DeepseekV3MtpWeights:
    """The MTP layer of the checkpoint at `path` on `gpu`, every projection in its stored format."""
    ckpt = path if isinstance(path, Checkpoint) else Checkpoint(Path(path))
    K = mtp_keys(cfg)
    D, V, H = cfg.hidden_size, cfg.vocab_size, cfg.num_attention_heads
    C, dn, dr, dv = cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    E, inter = cfg.n_routed_experts, cfg.moe_intermediate_size
    with WeightLoader(gpu, ckpt, progress=progress, total=ckpt.nbytes_total(cfg.mtp_prefix)) as wl:
        embed_key = first_present(ckpt, *cfg.embed_keys, K["embed_copy"])
        head_key = first_present(ckpt, *cfg.head_keys, K["head_copy"])
        embed = wl.tensor(embed_key, (V, D), as_dtype="bf16")
        head = wl.linear(head_key.removesuffix(".weight"), V, D)
        norms = {n: wl.tensor(K[n], (D,), as_dtype="bf16") for n in NORMS}
        norms["kv_a_layernorm"] = wl.tensor(K["kv_a_layernorm"], (C,), as_dtype="bf16")
        lora = cfg.q_lora_rank
        if lora:
            norms["q_a_layernorm"] = wl.tensor(K["q_a_layernorm"], (lora,), as_dtype="bf16")
        owners = [embed, *norms.values()]
        bias = wl.tensor(K["bias"], (E,), as_dtype="f32")
        owners.append(bias)
        shared = None
        if cfg.n_shared_experts:
            si = inter * cfg.n_shared_experts
            g, u, d = expert_keys(cfg, None)
            shared = (wl.linear(g, si, D), wl.linear(u, si, D), wl.linear(d, D, si))
        experts = {}
        for e in range(E):
            g, u, d = expert_keys(cfg, e)
            experts[e] = (wl.linear(g, inter, D), wl.linear(u, inter, D), wl.linear(d, D, inter))
        return DeepseekV3MtpWeights(
            embed=embed.ptr, head=head, norms={n: b.ptr for n, b in norms.items()},
            eh_proj=wl.linear(K["eh_proj"], D, 2 * D),
            q_a=wl.linear(K["q_a_proj"], lora, D) if lora else None,
            q_b=_grouped(wl, K["q_b_proj"] if lora else K["q_proj"], H * (dn + dr), lora or D),
            kv_a=wl.linear(K["kv_a_proj_with_mqa"], C + dr, D),
            w_uk_t=transpose_uk(gpu, ckpt, K["kv_b_proj"], H, dn, dv, C),
            kv_b=_grouped(wl, K["kv_b_proj"], H * (dn + dv), C),
            o_proj=wl.linear(K["o_proj"], D, H * dv),
            router=wl.linear(K["gate"], E, D), bias=bias.ptr, experts=experts, shared=shared, owners=owners)


# -- tiny checkpoint -----------------------------------------------------------------------------------
# Small but structurally faithful: heads with separate nope/rope/v dims, a q LoRA, a latent narrower than
# the model, group-limited routing (16 experts, 4 groups, top-2 groups, top-4), YaRN as V3's, and the MTP
# layer at index num_hidden_layers = 2 (a MoE layer: first_k_dense_replace = 1). The latent and rope dims
# are multiples of 64 (mla_decode's row tiles): cache rows of 128; q_b's per-head rows (96) cross its
# 128-row FP8 scale blocks, as at real dims.
TINY_DIMS = dict(hidden_size=256, num_attention_heads=4, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32,
                 qk_rope_head_dim=64, v_head_dim=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                 topk_group=2, moe_intermediate_size=64, n_shared_experts=1, vocab_size=512, num_hidden_layers=2,
                 first_k_dense_replace=1, intermediate_size=512, rms_norm_eps=1e-6, routed_scaling_factor=2.5,
                 rope_theta=10000.0)
TINY_YARN = {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
             "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
FP8_QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def quantised(w: np.ndarray, fmt: str) -> dict[str, np.ndarray]:
    """One projection's tensors as a `fmt` checkpoint stores them (suffix -> array)."""
    if fmt == "fp8":
        q, s = qh.quant_fp8_block(w)
        return {".weight": q, ".weight_scale_inv": s}
    return {".weight": w.astype(BF16)}


def tiny_config(fmt: str = "fp8", **dims) -> dict:
    """config.json of a tiny DeepSeek-V3 (HF names; unknown keys in `dims` are an error)."""
    bad = set(dims) - set(TINY_DIMS) - {"rope_scaling"}
    if bad:
        raise ValueError(f"unknown dims {sorted(bad)}; known: {sorted(TINY_DIMS)} and rope_scaling")
    c = {"rope_scaling": dict(TINY_YARN), **TINY_DIMS, **dims}
    c.update(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], hidden_act="silu",
             scoring_func="sigmoid", topk_method="noaux_tc", norm_topk_prob=True, num_nextn_predict_layers=1,
             tie_word_embeddings=False, rope_interleave=True, max_position_embeddings=163840,
             torch_dtype="bfloat16", num_key_value_heads=c["num_attention_heads"])
    if fmt == "fp8":
        c["quantization_config"] = dict(FP8_QUANT)
    return c


def tiny_tensors(cfg: dict, seed: int, fmt: str, top_level: bool = True, layer_copies: bool = True) -> dict[str, np.ndarray]:
    """Random weights with activations of order one: projections N(0, 1/k), norm weights 1 + N(0, 0.1^2),
    embedding N(0, 1), an LM head scaled x3 (clear top-2 margins), router N(0, 1/k) plus a correction bias
    N(0, 0.3^2) (routing decisions away from ties)."""
    rng = np.random.default_rng(seed)
    c = DeepseekV3Config.from_dict(cfg)
    K = mtp_keys(c)
    D, V, H = c.hidden_size, c.vocab_size, c.num_attention_heads
    C, dn, dr, dv, lora = c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.q_lora_rank
    E, inter = c.n_routed_experts, c.moe_intermediate_size

    def lin(n: int, k: int, scale: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((n, k)) * scale / np.sqrt(k)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(BF16)

    out: dict[str, np.ndarray] = {}

    def proj(prefix: str, w: np.ndarray, as_fmt: str = fmt) -> None:
        out.update({prefix + suf: a for suf, a in quantised(w, as_fmt).items()})

    embed = rng.standard_normal((V, D)).astype(BF16)
    head = lin(V, D, 3.0).astype(BF16)
    if top_level:
        out[c.embed_keys[0]], out[c.head_keys[0]] = embed, head
    if layer_copies:
        out[K["embed_copy"]], out[K["head_copy"]] = embed, head
    for n in NORMS:
        out[K[n]] = norm(D)
    out[K["q_a_layernorm"]], out[K["kv_a_layernorm"]] = norm(lora), norm(C)
    proj(K["eh_proj"], lin(D, 2 * D), "bf16")           # BF16 even in FP8 checkpoints (A.1)
    proj(K["q_a_proj"], lin(lora, D))
    proj(K["q_b_proj"], lin(H * (dn + dr), lora))
    proj(K["kv_a_proj_with_mqa"], lin(C + dr, D))
    proj(K["kv_b_proj"], lin(H * (dn + dv), C))
    proj(K["o_proj"], lin(D, H * dv))
    proj(K["gate"], lin(E, D), "bf16")
    out[K["bias"]] = (0.3 * rng.standard_normal(E)).astype(np.float32)
    for e in [*range(E), None]:
        g, u, d = expert_keys(c, e)
        i = inter * (c.n_shared_experts if e is None else 1)
        proj(g, lin(i, D))
        proj(u, lin(i, D))
        proj(d, lin(D, i))
    return out


def write_tiny_checkpoint(path, seed: int = 0, fmt: str = "fp8", top_level: bool = True, layer_copies: bool = True,
                          **dims) -> Path:
    """A small random DeepSeek-V3 MTP checkpoint (config.json + model.safetensors) in the real key layout
    and dtypes at `path`. fmt "fp8": block-FP8 projections with weight_scale_inv (eh_proj, router, norms,
    embedding and head BF16, the correction bias F32); "bf16": every projection BF16. top_level /
    layer_copies choose which embedding/head copies exist; `dims` override TINY_DIMS (HF names)."""
    if fmt not in ("fp8", "bf16"):
        raise ValueError(f"fmt {fmt!r}: choose fp8 or bf16")
    cfg = tiny_config(fmt, **dims)
    return Path(write_checkpoint(path, tiny_tensors(cfg, seed, fmt, top_level, layer_copies), config=cfg))
