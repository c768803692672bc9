"""DeepSeek-V3/R1/V3.1/V3.2 MTP checkpoint keys (docs/model_math.md A.1) and device loading.

The MTP module is `model.layers.{num_hidden_layers}.*`. The embedding and LM head are the target's
(`model.embed_tokens.weight`, `lm_head.weight`); the layer's own copies (`embed_tokens`, `shared_head.head`)
are the fallback when a checkpoint holds only the MTP layer. DeepSeek-V3.2 (`deepseek_v32`) reads its layer's
own copies first (its MTP layer ships them, as vLLM loads them) and its DSA indexer
(`self_attn.indexer.{wq_b, wk, k_norm, weights_proj}`, docs/model_math.md C.1). Each projection's format comes from its
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

from ..layers.dsa import IndexerWeights
from ..runtime.backend import Backend
from ..runtime.dtypes import BF16
from ..runtime.ptr import DevicePtr
from .config import DeepseekV3Config
from .linear import Linear
from .loader import WeightLoader, dequant_linear, detect_linear
from .safetensors_io import Checkpoint

GROUPED_FORMATS = ("bf16", "fp8_block", "fp8_block_e8m0")   # what ops.grouped_gemv reads
NORMS = ("enorm", "hnorm", "input_layernorm", "post_attention_layernorm", "shared_head.norm")
ATTN_NORMS = ("q_a_layernorm", "kv_a_layernorm")
PROJ = ("gate_proj", "up_proj", "down_proj")
INDEXER_PROJ = ("wq_b", "wk", "weights_proj")


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
    i = a + "indexer."                 # the DSA lightning indexer (V3.2, GLM-5; docs/model_math.md C.1)
    keys.update({"wq_b": i + "wq_b", "wk": i + "wk", "weights_proj": i + "weights_proj",
                 "k_norm": i + "k_norm.weight", "k_norm_bias": i + "k_norm.bias"})
    return keys


def indexer_tensor_keys(cfg: DeepseekV3Config) -> list[str]:
    """The tensors a DSA indexer needs (weights of its three projections, the LayerNorm's weight and bias)."""
    K = mtp_keys(cfg)
    return [K[r] + ".weight" for r in INDEXER_PROJ] + [K["k_norm"], K["k_norm_bias"]]


def require_indexer(ckpt: Checkpoint, cfg: DeepseekV3Config) -> None:
    """WeightError naming the first missing indexer tensor, read from the headers before anything is loaded."""
    from ..errors import WeightError
    for key in indexer_tensor_keys(cfg):
        if not ckpt.has(key) and not ckpt.has(key.removesuffix(".weight") + ".weight_scale_inv"):
            raise WeightError(f"config.json gives the MTP layer a DSA indexer (index_topk {cfg.index_topk}) but the "
                              "checkpoint has no indexer tensor there", key)


def load_indexer(wl: WeightLoader, cfg: DeepseekV3Config) -> tuple[IndexerWeights, list]:
    """The MTP layer's indexer (replicated on every rank) and the buffers that own its norm vectors."""
    K = mtp_keys(cfg)
    D, nh, hd = cfg.hidden_size, cfg.index_n_heads, cfg.index_head_dim
    kn, kb = (wl.tensor(K[n], (hd,), as_dtype="bf16") for n in ("k_norm", "k_norm_bias"))
    w = IndexerWeights(wq_b=wl.linear(K["wq_b"], nh * hd, cfg.q_lora_rank), wk=wl.linear(K["wk"], hd, D),
                       k_norm=kn.ptr, k_norm_bias=kb.ptr, weights_proj=wl.linear(K["weights_proj"], nh, D))
    return w, [kn, kb]


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
    indexer: IndexerWeights | None = None   # the DSA indexer (DeepSeek-V3.2; GLM-5's subclass always has one)


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


def load_deepseek_v3(gpu: Backend, path, cfg: DeepseekV3Config, progress: bool | None = None) -> DeepseekV3MtpWeights:
    """The MTP layer of the checkpoint at `path` on `gpu`, every projection in its stored format."""
    ckpt = path if isinstance(path, Checkpoint) else Checkpoint(Path(path))
    if cfg.has_indexer:
        require_indexer(ckpt, cfg)
    K = mtp_keys(cfg)
    D, V, H = cfg.hidden_size, cfg.vocab_size, cfg.num_attention_heads
    C, dn, dr, dv = cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    E, inter = cfg.n_routed_experts, cfg.moe_intermediate_size
    with WeightLoader(gpu, ckpt, progress=progress, total=ckpt.nbytes_total(cfg.mtp_prefix)) as wl:
        if cfg.model_type == "deepseek_v32":   # V3.2's MTP layer ships its own embedding and head: those first
            embed_key = first_present(ckpt, K["embed_copy"], *cfg.embed_keys)
            head_key = first_present(ckpt, K["head_copy"], *cfg.head_keys)
        else:
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
        indexer = None
        if cfg.has_indexer:
            indexer, own = load_indexer(wl, cfg)
            owners += own
        return DeepseekV3MtpWeights(
            embed=embed.ptr, head=head, norms={n: b.ptr for n, b in norms.items()},
            eh_proj=wl.linear(K["eh_proj"], D, 2 * D),
            q_a=wl.linear(K["q_a_proj"], lora, D) if lora else None,
            q_b=_grouped(wl, K["q_b_proj"] if lora else K["q_proj"], H * (dn + dr), lora or D),
            kv_a=wl.linear(K["kv_a_proj_with_mqa"], C + dr, D),
            w_uk_t=transpose_uk(gpu, ckpt, K["kv_b_proj"], H, dn, dv, C),
            kv_b=_grouped(wl, K["kv_b_proj"], H * (dn + dv), C),
            o_proj=wl.linear(K["o_proj"], D, H * dv),
            router=wl.linear(K["gate"], E, D), bias=bias.ptr, experts=experts, shared=shared, owners=owners,
            indexer=indexer)
