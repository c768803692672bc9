"""DeepSeek-V4 MTP draft proposer (arch_math.md B, seed deepseek_v4_mtp.rs).

One draft step (B.3):
    e = enorm(embed(token));  X_j = h_proj(hnorm(H_j)) + e_proj(e)        -> streams X [hc, D]
        the target's hidden is either its pre-hc_head streams H [hc, D] (official / vLLM: hnorm and h_proj
        per stream) or one hidden h [D] (the seed: h_proj(hnorm(h)) + e_proj(e), replicated by hc_expand;
        the same numbers as treating h as hc equal streams)
    block: X = hc_post(attn(attn_norm(hc_pre(X))), X);  X = hc_post(moe(ffn_norm(hc_pre(X))), X)
        with V4 sliding-window + sink attention over the proposer's own paged cache (layers/v4_attention)
        and the sqrtsoftplus MoE (clamped SwiGLU, shared expert; routed by tid2eid[token] when the
        checkpoint's MTP layer is a hash layer)
    carried hidden for the next draft = the output streams X [hc, D]
    logits = head(norm(hc_head(X))) in f32 over the first `mtp_vocab_size` rows (the first stream when the
        checkpoint has no mHC head; a low-rank head is refused at load)

Prefill writes the cache rows of a whole prompt in batched passes of max_prefill_rows rows with no
attention: a row's kv depends on the pre-attention path only (front, hc_pre of its streams, attn_norm, wkv,
kv_norm, RoPE). The embedding is not zeroed at position 0 (official; vLLM masks it)."""
from __future__ import annotations


import numpy as np

from .. import ops
from ..cache.paged import CacheSpec, PagedKvCache
from ..errors import ConfigError, InputError
from ..layers.mhc import Mhc
from ..layers.moe import MoE, MoeConfig
from ..layers.v4_attention import CACHE, V4Attention
from ..runtime.backend import Backend
from ..runtime.dtypes import BF16
from ..runtime.ptr import DevicePtr
from ..speculative.base import MtpProposerBase
from .options import checked_config
from ..weights.config import DeepseekV4Config
from ..weights.deepseek_v4 import (LowRankHcHeadError, V4MtpWeights, load_v4_mtp,  # noqa: F401 (re-export)
                                   write_tiny_checkpoint)

HIDDEN_FORMS = ("streams", "single")


class DeepseekV4MtpProposer(MtpProposerBase):
    family = "deepseek_v4"
    graph_safe = True

    def __init__(self, gpu: Backend, cfg: DeepseekV4Config, weights: V4MtpWeights, max_seq_len: int = 4096,
                 max_drafts: int = 8, mtp_vocab_size: int = 0, max_prefill_rows: int = 128,
                 kv_blocks: int | None = None, device_hidden: str = "streams"):
        if cfg.scoring_func != "sqrtsoftplus":
            raise ConfigError(f"deepseek_v4 MTP supports scoring_func sqrtsoftplus, got {cfg.scoring_func}")
        if device_hidden not in HIDDEN_FORMS:
            raise ConfigError(f"device_hidden {device_hidden!r}: choose one of {HIDDEN_FORMS}")
        self.cfg, self.w, self.eps = cfg, weights, float(cfg.rms_norm_eps)
        D, hc, R = cfg.hidden_size, cfg.hc_mult, int(max_prefill_rows)   # R: rows of one prefill pass
        self.hc, self.device_hidden = hc, device_hidden
        self._streams_in = device_hidden == "streams"
        blocks = kv_blocks if kv_blocks is not None else PagedKvCache.blocks_for(max_seq_len) + 1
        kv = PagedKvCache(gpu, CacheSpec(CACHE, cfg.head_dim, "bf16"), num_blocks=blocks)
        super().__init__(gpu, cfg.vocab_size, D, max_seq_len, kv, max_drafts=max_drafts,
                         mtp_vocab_size=mtp_vocab_size, max_prefill_rows=R,
                         extra_regions={"prefill_hidden": 2 * hc * D * R, "X": 2 * hc * D * R,
                                        "hn": 2 * hc * D * R, **{n: 2 * D * R for n in ("e", "ep", "x", "xn", "f")}})
        self.carry = self.bufs.X   # the next step reads it (hnorm) before h_proj overwrites X
        self.head = weights.head.rows(0, self.vocab_eff)
        self.mhc = Mhc(gpu, hc, D, weights.hc, weights.hc_head, self.eps, cfg.hc_eps, cfg.hc_sinkhorn_iters, R)
        a, n = weights.attn, weights.norms
        self.attn = V4Attention(gpu, a["wq_a"], a["wq_b"], a["wkv"], a["wo_a"], a["wo_b"], n["attn.q_norm"],
                                n["attn.kv_norm"], weights.attn_sink, cfg.num_attention_heads, cfg.head_dim,
                                cfg.qk_rope_head_dim, cfg.rope.theta, cfg.o_groups, cfg.sliding_window, self.eps, kv,
                                max_rows=1, max_kv_rows=R)
        hashed = int(weights.tid2eid) != 0
        mc = MoeConfig(cfg.n_routed_experts, cfg.num_experts_per_tok, D, cfg.moe_intermediate_size,
                       routing="hash" if hashed else "sqrtsoftplus", routed_scaling=cfg.routed_scaling_factor,
                       norm_topk_prob=cfg.norm_topk_prob, swiglu_limit=cfg.swiglu_limit)
        self.moe = MoE(gpu, mc, weights.router, weights.experts, bias=weights.router_bias, shared=weights.shared,
                       tid2eid=weights.tid2eid, max_rows=1, vocab=cfg.vocab_size)

    # -- hidden forms ----------------------------------------------------------------------------
    def _hidden_shapes(self) -> list[tuple[int, ...]]:
        """The device-pointer form first: a pointer carries no shape."""
        s, one = (self.hc, self.hidden_size), (self.hidden_size,)
        return [s, one] if self.device_hidden == "streams" else [one, s]

    def _check_hidden_shape(self, hidden):
        shape = super()._check_hidden_shape(hidden)
        self._streams_in = len(shape) == 2
        return shape

    def _graph_variant(self):
        return self._streams_in

    def _hidden_row_elems(self) -> int:
        return self.hc * self.hidden_size if self._prefill_streams else self.hidden_size

    def _host_hiddens(self, hiddens, n: int):
        """Prefill hiddens: n rows of [D] or of [hc, D] (host arrays), or a device pointer in the
        `device_hidden` form."""
        D, hc = self.hidden_size, self.hc
        if isinstance(hiddens, (DevicePtr, int)) and not isinstance(hiddens, np.ndarray):
            self._prefill_streams = self.device_hidden == "streams"
            return super()._host_hiddens(hiddens, n)
        h = np.asarray(hiddens)
        if h.dtype not in (np.float32, BF16):
            raise InputError(f"hiddens must be float32 or bfloat16, got {h.dtype}")
        if h.shape not in ((n, D), (n, hc, D)):
            raise InputError(f"hiddens has shape {h.shape}; expected ({n}, {D}) or ({n}, {hc}, {D}) "
                             "(one per token but the last)")
        if h.dtype == np.float32 and not np.all(np.isfinite(h)):
            raise InputError("hiddens hold NaN or inf")
        self._prefill_streams = h.ndim == 3
        return np.ascontiguousarray(h.astype(BF16, copy=False))

    # -- the step --------------------------------------------------------------------------------
    def _norm(self, x: DevicePtr, name: str, y: DevicePtr, m: int) -> None:
        ops.rms_norm(self.gpu, x, self.w.norms[name], y, m, self.hidden_size, self.eps)

    def _front(self, ids: DevicePtr, hidden: DevicePtr, m: int, streams: bool) -> None:
        """Streams X [m, hc, D] = h_proj(hnorm(hidden)) (+ expanded when single) + e_proj(enorm(embed(ids)))."""
        gpu, b, D, hc = self.gpu, self.bufs, self.hidden_size, self.hc
        ops.embed_rows(gpu, self.w.embed, ids, b.e, m, D, vocab=self.vocab_size)
        self._norm(b.e, "enorm", b.e, m)
        ops.linear(gpu, b.e, self.w.e_proj, b.ep, m)
        if streams:
            self._norm(hidden, "hnorm", b.hn, m * hc)
            ops.linear(gpu, b.hn, self.w.h_proj, b.X, m * hc)
        else:
            self._norm(hidden, "hnorm", b.hn, m)
            ops.linear(gpu, b.hn, self.w.h_proj, b.x, m)
            self.mhc.expand(b.x, b.X, m)
        self.mhc.add(b.X, b.ep, m)

    def _block(self, ids: DevicePtr, m: int, meta: DevicePtr, meta_stride: int) -> None:
        """The V4 layer on the streams X [m, hc, D] in place; `ids` are the input tokens (hash routing)."""
        b = self.bufs
        self.mhc.pre("attn", b.X, b.x, m)
        self._norm(b.x, "attn_norm", b.xn, m)
        self.attn.forward(b.xn, b.f, m, meta, meta_stride)
        self.mhc.post("attn", b.f, b.X, m)
        self.mhc.pre("ffn", b.X, b.x, m)
        self._norm(b.x, "ffn_norm", b.xn, m)
        self.moe.forward(b.xn, b.f, m=m, token_ids=ids)
        self.mhc.post("ffn", b.f, b.X, m)

    def _step(self, st, ids, hidden, position, row, logits) -> None:
        b = self.bufs
        self._front(ids, hidden, 1, self._streams_in or int(hidden) == int(self.carry))
        self._block(ids, 1, b.mtp_meta, b.mtp_meta_capacity)  # one slab
        self.mhc.head(b.X, b.x, 1)
        self._norm(b.x, "norm", b.xn, 1)
        ops.linear(self.gpu, b.xn, self.head, logits, 1, out_dtype="f32")

    def _write_rows(self, st, tokens_dev, hiddens, positions, slots, row_base, n) -> None:
        # one pass over n <= max_prefill_rows rows; row r pairs embed(tokens[r + 1]) with hiddens[r]
        b = self.bufs
        self._front(tokens_dev.offset(4), hiddens, n, self._prefill_streams)
        self.mhc.pre("attn", b.X, b.x, n)
        self._norm(b.x, "attn_norm", b.xn, n)
        self.attn.write_kv(b.xn, n, positions, 4, slots, 8)

    # -- accounting ------------------------------------------------------------------------------
    def weight_bytes_per_step(self) -> int:
        """Weight bytes one draft step reads at least: every projection once, the mHC maps, top_k routed
        experts plus the shared one, the router, the LM head rows scored."""
        w, cfg, D, hc = self.w, self.cfg, self.hidden_size, self.hc
        expert = sum(x.weight_bytes for x in next(iter(w.experts.values())))
        mhc = 4 * hc * D * (2 * (2 + hc) * hc + (hc if w.hc_head is not None else 0))
        return (w.e_proj.weight_bytes + w.h_proj.weight_bytes + self.attn.weight_bytes + mhc
                + w.router.weight_bytes + sum(x.weight_bytes for x in w.shared)
                + cfg.num_experts_per_tok * expert + self.head.weight_bytes)


_OPTIONS = ("max_drafts", "mtp_vocab_size", "max_prefill_rows", "kv_blocks", "device_hidden")


def from_checkpoint(path, gpu: Backend, max_seq_len: int = 4096, comm=None, **options) -> DeepseekV4MtpProposer:
    """The DeepSeek-V4 MTP proposer of the checkpoint at `path`. Options: max_drafts, mtp_vocab_size (0 = full
    vocab), max_prefill_rows (rows per batched prefill pass), kv_blocks (the cache pool; default one sequence of
    max_seq_len), device_hidden ("streams": a device-pointer hidden is the target's [hc, D] pre-hc_head
    streams; "single": one [D] hidden; host arrays say which by their shape)."""
    cfg = checked_config(path, comm, options, _OPTIONS, "deepseek_v4", DeepseekV4Config, "DeepSeek-V4 MTP layer")
    return DeepseekV4MtpProposer(gpu, cfg, load_v4_mtp(gpu, path, cfg), max_seq_len=max_seq_len, **options)
