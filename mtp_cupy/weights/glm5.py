"""GLM-5 (`glm_moe_dsa`) MTP checkpoint keys (docs/model_math.md C.3) and per-rank shard loading.

The MTP module is `model.layers.{num_hidden_layers}.*`: enorm, hnorm, eh_proj, shared_head.norm and a full
decoder layer (DSA attention with `self_attn.indexer.{wq_b, wk, k_norm, weights_proj}` + routed MoE). It has
no embedding or head of its own: `model.embed_tokens.weight` and `lm_head.weight` are the target's (the
layer's own copies, when a converter added them, are the fallback).

Sharding over `world` ranks (rank r), as a text layer is sharded; world 1 loads everything:
  attention  heads split contiguously: rank r owns heads [r H/W, (r+1) H/W): its rows of q_b_proj and
             kv_b_proj (and W_UK^T), its columns of o_proj (row-parallel: each rank's o_proj output is a
             partial sum, all-reduced). The latent (q_a, kv_a, their norms, the 576-wide cache row) is shared
             by all heads, so it is replicated, as is the indexer (every rank computes the same top-k from
             the same all-reduced input; sharding its heads would need an all-reduce of every score).
  MoE        routed experts split contiguously: rank r owns experts [r E/W, (r+1) E/W) (EP; vLLM's expert
             map); the router is replicated; the shared expert is tensor-parallel (its intermediate split
             contiguously: gate/up rows, down columns), so each rank's MoE output is a partial sum,
             all-reduced.
  LM head    vocab split contiguously when vocab % W == 0 (rank r sweeps [r V/W, (r+1) V/W)); the whole
             head otherwise. The embedding is replicated (any rank embeds any token).
A sub-tensor keeps its stored format when its bounds fall on the 128x128 scale blocks (or the format has
none); otherwise it is dequantised to BF16 on the host."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import ConfigError
from ..layers.dsa import IndexerWeights
from ..runtime.backend import Backend
from ..runtime.dtypes import BF16
from .config import GlmMoeDsaConfig
from .deepseek_v3 import (GROUPED_FORMATS, NORMS, DeepseekV3MtpWeights, expert_keys, first_present, load_indexer,
                          mtp_keys, require_indexer, transpose_uk)
from .linear import FORMATS, Linear
from .loader import WeightLoader, dequant_linear, detect_linear
from .safetensors_io import Checkpoint

BLOCK = 128


def glm_keys(cfg: GlmMoeDsaConfig) -> dict[str, str]:
    """Role -> key (prefix for projections): the DeepSeek-V3 roles, the indexer's among them."""
    return mtp_keys(cfg)


@dataclass(frozen=True)
class Shard:
    """Rank `rank` of `world`: which heads, experts, shared-expert columns and vocab rows it holds."""
    rank: int = 0
    world: int = 1

    def split(self, n: int, what: str) -> tuple[int, int]:
        """(start, count) of this rank's contiguous equal part of n."""
        if n % self.world:
            raise ConfigError(f"{what} ({n}) does not divide over {self.world} ranks")
        per = n // self.world
        return self.rank * per, per

    def vocab(self, vocab: int) -> tuple[int, int]:
        """This rank's head rows; the whole vocab when it does not divide (the head is then unsharded)."""
        return self.split(vocab, "vocab") if vocab % self.world == 0 else (0, vocab)


@dataclass(kw_only=True)
class Glm5MtpWeights(DeepseekV3MtpWeights):
    """DeepseekV3MtpWeights of this rank's shard (q_b, kv_b, w_uk_t, o_proj: its heads; experts: its own;
    shared: its slice; head: its vocab rows) plus the indexer."""
    indexer: IndexerWeights
    shard: Shard
    heads: tuple[int, int]               # (first head, count) held
    head_v0: int                         # head rows [head_v0, head_v0 + head.n)


def _aligned(start: int, count: int, full: int) -> bool:
    return start % BLOCK == 0 and ((start + count) % BLOCK == 0 or start + count == full)


def _upload_bf16(gpu: Backend, w: np.ndarray) -> Linear:
    buf = gpu.upload(np.ascontiguousarray(np.asarray(w, np.float32).astype(BF16)))
    return Linear("bf16", w.shape[0], w.shape[1], buf.ptr, owners=[buf])


def load_part(wl: WeightLoader, prefix: str, n: int, k: int, rows: tuple[int, int] | None = None,
              cols: tuple[int, int] | None = None, allow=FORMATS) -> Linear:
    """Rows [r0, r0 + nr) x columns [c0, c0 + nc) of projection `prefix` ([n, k]), in its stored format when
    the slice keeps whole scale blocks and the format is in `allow`, else BF16 dequantised on the host."""
    (r0, nr), (c0, nc) = rows or (0, n), cols or (0, k)
    src = detect_linear(wl.ckpt, prefix)
    if (r0, nr, c0, nc) == (0, n, 0, k) and src.fmt in allow:
        return wl.linear(prefix, n, k)
    wl.ckpt.check(src.weight, (n, k) if src.fmt not in ("nvfp4", "mxfp4") else (n, k // 2))
    rs, cs = slice(r0, r0 + nr), slice(c0, c0 + nc)
    if src.fmt == "bf16" and "bf16" in allow:
        return _upload_bf16(wl.gpu, wl.ckpt.numpy(src.weight)[rs, cs])
    if src.fmt in ("fp8_block", "fp8_block_e8m0") and src.fmt in allow and _aligned(r0, nr, n) and _aligned(c0, nc, k):
        q = np.ascontiguousarray(wl.ckpt.numpy(src.weight)[rs, cs])
        s = np.ascontiguousarray(wl.ckpt.numpy(src.scale)[r0 // BLOCK: -(-(r0 + nr) // BLOCK),
                                                          c0 // BLOCK: -(-(c0 + nc) // BLOCK)])
        qb, sb = wl.gpu.upload(q), wl.gpu.upload(s)
        return Linear(src.fmt, nr, nc, qb.ptr, sb.ptr, owners=[qb, sb])
    return _upload_bf16(wl.gpu, dequant_linear(wl.ckpt, prefix)[rs, cs])


def _uk_t(wl: WeightLoader, prefix: str, H: int, dn: int, dv: int, C: int, h0: int, hl: int) -> Linear:
    """W_UK^T rows of heads [h0, h0 + hl): [hl * C, dn] (see deepseek_v3.transpose_uk)."""
    full = transpose_uk(wl.gpu, wl.ckpt, prefix, H, dn, dv, C)
    if hl == H:
        return full
    if full.fmt == "bf16" or _aligned(h0 * C, hl * C, H * C):
        return full.rows(h0 * C, hl * C)
    w = dequant_linear(wl.ckpt, prefix).reshape(H, dn + dv, C)[h0:h0 + hl, :dn]      # [hl, dn, C]
    return _upload_bf16(wl.gpu, w.transpose(0, 2, 1).reshape(hl * C, dn))


def load_glm5(gpu: Backend, path, cfg: GlmMoeDsaConfig, shard: Shard = Shard(),
                     progress: bool | None = None) -> Glm5MtpWeights:
    """This rank's shard of the GLM MTP layer at `path` on `gpu`."""
    ckpt = path if isinstance(path, Checkpoint) else Checkpoint(Path(path))
    if not cfg.has_indexer or not cfg.q_lora_rank:
        raise ConfigError("glm_moe_dsa MTP needs the DSA indexer (index_topk > 0) and a q LoRA")
    if not cfg.mtp_is_moe:
        raise ConfigError(f"the MTP layer {cfg.num_hidden_layers} is dense (first_k_dense_replace "
                          f"{cfg.first_k_dense_replace}); only a MoE MTP layer is supported")
    require_indexer(ckpt, cfg)
    K = glm_keys(cfg)
    D, V, H, ql = cfg.hidden_size, cfg.vocab_size, cfg.num_attention_heads, cfg.q_lora_rank
    C, dn, dr, dv = cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    E, inter = cfg.n_routed_experts, cfg.moe_intermediate_size
    h0, hl = shard.split(H, "attention heads")
    e0, el = shard.split(E, "routed experts")
    si = inter * cfg.n_shared_experts
    s0, sl = shard.split(si, "shared-expert intermediate") if cfg.n_shared_experts else (0, 0)
    v0, vn = shard.vocab(V)
    with WeightLoader(gpu, ckpt, progress=progress) as wl:
        embed = wl.tensor(first_present(ckpt, *cfg.embed_keys, K["embed_copy"]), (V, D), as_dtype="bf16")
        head_key = first_present(ckpt, *cfg.head_keys, K["head_copy"]).removesuffix(".weight")
        norms = {n: wl.tensor(K[n], (D,), as_dtype="bf16") for n in NORMS}
        norms["q_a_layernorm"] = wl.tensor(K["q_a_layernorm"], (ql,), as_dtype="bf16")
        norms["kv_a_layernorm"] = wl.tensor(K["kv_a_layernorm"], (C,), as_dtype="bf16")
        bias = wl.tensor(K["bias"], (E,), as_dtype="f32")
        experts = {}
        for e in range(e0, e0 + el):
            g, u, d = expert_keys(cfg, e)
            experts[e] = (wl.linear(g, inter, D), wl.linear(u, inter, D), wl.linear(d, D, inter))
        shared = None
        if cfg.n_shared_experts:
            g, u, d = expert_keys(cfg, None)
            shared = (load_part(wl, g, si, D, rows=(s0, sl)), load_part(wl, u, si, D, rows=(s0, sl)),
                      load_part(wl, d, D, si, cols=(s0, sl)))
        indexer, own = load_indexer(wl, cfg)
        return Glm5MtpWeights(
            embed=embed.ptr, head=load_part(wl, head_key, V, D, rows=(v0, vn)),
            norms={n: b.ptr for n, b in norms.items()}, eh_proj=wl.linear(K["eh_proj"], D, 2 * D),
            q_a=wl.linear(K["q_a_proj"], ql, D),
            q_b=load_part(wl, K["q_b_proj"], H * (dn + dr), ql, rows=(h0 * (dn + dr), hl * (dn + dr)),
                          allow=GROUPED_FORMATS),
            kv_a=wl.linear(K["kv_a_proj_with_mqa"], C + dr, D),
            w_uk_t=_uk_t(wl, K["kv_b_proj"], H, dn, dv, C, h0, hl),
            kv_b=load_part(wl, K["kv_b_proj"], H * (dn + dv), C, rows=(h0 * (dn + dv), hl * (dn + dv)),
                           allow=GROUPED_FORMATS),
            o_proj=load_part(wl, K["o_proj"], D, H * dv, cols=(h0 * dv, hl * dv)),
            router=wl.linear(K["gate"], E, D), bias=bias.ptr, experts=experts, shared=shared,
            owners=[embed, *norms.values(), *own, bias], indexer=indexer, shard=shard, heads=(h0, hl), head_v0=v0)
