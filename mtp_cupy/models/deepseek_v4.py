"""DeepSeek-V4 MTP draft proposer (docs/model_math.md B; the seed, S).

One draft step (B.3):
    e = enorm(embed(token));  X_j = h_proj(hnorm(H_j)) + e_proj(e)        -> streams X [hc, D]
        the target's hidden is either its pre-hc_head streams H [hc, D] (official / vLLM: hnorm and h_proj
        per stream) or one hidden h [D] (the seed: h_proj(hnorm(h)) + e_proj(e), replicated by hc_expand;
        the same numbers as treating h as hc equal streams)
    block: X = hc_post(attn(attn_norm(hc_pre(X))), X);  X = hc_post(moe(ffn_norm(hc_pre(X))), X)
           (layers/mhc.py runs each hc_pre with the norm after it in its finishing launch)
        with V4 sliding-window + sink attention over the proposer's own paged cache (layers/v4_attention)
        and the sqrtsoftplus MoE (clamped SwiGLU, shared expert; routed by tid2eid[token] when the
        checkpoint's MTP layer is a hash layer); option kv_cache_dtype: the cache rows fp8 (default: the
        official numerics, e4m3 non-RoPE columns in 64-blocks with UE8M0 scales, B.4) or bf16
    carried hidden for the next draft = the output streams X [hc, D]
    logits = head(norm(hc_head(X))) in f32 over the first `mtp_vocab_size` rows (the first stream when the
        checkpoint has no mHC head; a low-rank head is refused at load)

Prefill writes the cache rows of a whole prompt in batched passes of max_prefill_rows rows with no
attention: a row's kv depends on the pre-attention path only (front, hc_pre of its streams, attn_norm, wkv,
kv_norm, RoPE). The embedding is not zeroed at position 0 (official; vLLM masks it)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import ops
from ..cache.paged import PagedKvCache
from ..errors import ConfigError, InputError
from ..layers.mhc import Mhc
from ..layers.moe import MoE, MoeConfig
from ..layers.mtp_front import FrontDims, FrontWeights, MtpFront
from ..layers.norm import Norms
from ..layers.v4_attention import V4Attention, V4AttentionDims, V4AttentionWeights
from ..runtime.backend import Backend
from ..runtime.dtypes import BF16
from ..runtime.ptr import DevicePtr
from ..speculative.base import MtpProposerBase
from ..speculative.options import ProposerOptions, opt
from ..weights.config import DeepseekV4Config
from ..weights.deepseek_v4 import DeepseekV4MtpWeights, load_deepseek_v4
from .limits import check_v4

HIDDEN_FORMS = ("streams", "single")
KV_CACHE_DTYPES = ("bf16", "fp8")


@dataclass(frozen=True, kw_only=True)
class DeepseekV4Options(ProposerOptions):
    mtp_vocab_size: int = opt(0, "score only the first n vocab rows (0 = the whole vocab)")
    device_hidden: str = opt("streams", "what a device-pointer hidden holds: 'streams' (the target's [hc, D] "
                                        "pre-hc_head streams) or 'single' (one [D] hidden); host arrays say "
                                        "which by their shape")
    kv_cache_dtype: str = opt("fp8", "the MTP layer's KV rows: 'fp8' (the official inference's numerics, which "
                                     "the model was trained with: the non-RoPE columns e4m3 in 64-wide blocks "
                                     "with power-of-two UE8M0 scales, the RoPE columns bf16; about half the "
                                     "bytes), or 'bf16'")

    def __post_init__(self) -> None:
        super().__post_init__()
        self._int("mtp_vocab_size", 0, 1 << 31)
        self._choice("device_hidden", HIDDEN_FORMS)
        self._choice("kv_cache_dtype", KV_CACHE_DTYPES)


class DeepseekV4MtpProposer(MtpProposerBase):
    family = "deepseek_v4"
    Options = DeepseekV4Options
    config_class = DeepseekV4Config
    graph_safe = True

    @classmethod
    def check_config(cls, cfg, options) -> None:
        """ConfigError (naming the config field, its value and the supported range) for anything the kernels
        cannot take; runs before anything is allocated."""
        if cfg.scoring_func != "sqrtsoftplus":
            raise ConfigError(f"deepseek_v4 MTP supports scoring_func sqrtsoftplus, got {cfg.scoring_func}")
        check_v4(cfg, options.kv_cache_dtype)

    @classmethod
    def load_weights(cls, gpu, path, cfg, options, comm=None) -> DeepseekV4MtpWeights:
        cls.check_config(cfg, options)
        return load_deepseek_v4(gpu, path, cfg, options.progress)

    @classmethod
    def properties(cls, cfg, options=None) -> dict[str, str]:
        """What this proposer runs for `cfg` with `options` (default options) (`python -m mtp_cupy info`)."""
        o = options or cls.Options()
        hd, nope = cfg.head_dim, cfg.head_dim - cfg.qk_rope_head_dim
        kv = f"bf16 rows of {hd} ({2 * hd} bytes)" if o.kv_cache_dtype == "bf16" else (
            f"fp8: e4m3 x {nope} in 64-blocks + UE8M0 scales, bf16 x {cfg.qk_rope_head_dim} RoPE "
            f"({ops.fp8_block_layout(hd, nope)[2]} bytes a row)")
        return {"attention": f"sliding-window MQA (window {cfg.sliding_window}) with sinks", "dsa": "off",
                "kv_cache": kv, "carried_hidden": "the output hc streams [hc, D] (pre-hc_head)",
                "options": "kv_cache_dtype: 'bf16' | 'fp8'"}

    def __init__(self, gpu: Backend, cfg: DeepseekV4Config, weights: DeepseekV4MtpWeights, max_seq_len: int = 4096,
                 comm=None, options: DeepseekV4Options | None = None, **kw):
        o = self.options_of(options, kw)
        self.check_config(cfg, o)
        self.cfg, self.w, self.eps, self.inv = cfg, weights, float(cfg.rms_norm_eps), o.batch_invariant
        D, hc, B = cfg.hidden_size, cfg.hc_mult, o.max_batch
        R = max(B, o.max_prefill_rows)            # rows of one pass: a prefill chunk or a batch
        self.hc, self.device_hidden = hc, o.device_hidden
        self._streams_in = self.device_hidden == "streams"
        adims = V4AttentionDims.from_config(cfg, o.kv_cache_dtype)
        kv = PagedKvCache(gpu, adims.cache_spec(), num_blocks=self.kv_blocks(o, max_seq_len))
        super().__init__(gpu, cfg.vocab_size, D, max_seq_len, kv, o,
                         extra_regions={"prefill_hidden": 2 * hc * D * R, "X": 2 * hc * D * R,
                                        **{n: 2 * D * R for n in ("ep", "x", "xn", "f")}})
        self.carry = self.bufs.X   # the next step reads it (hnorm) before h_proj overwrites X
        self.head = weights.head.rows(0, self.vocab_eff)
        self.norm = Norms(gpu, weights.norms, D, self.eps)
        self.front = MtpFront(gpu, FrontWeights(weights.embed, e_proj=weights.e_proj, h_proj=weights.h_proj),
                              FrontDims(D, cfg.vocab_size), self.norm, hc * R, invariant=self.inv)
        self.mhc = Mhc(gpu, hc, D, weights.hc, weights.hc_head, self.eps, cfg.hc_eps, cfg.hc_sinkhorn_iters, R)
        a, n = weights.attn, weights.norms
        self.attn = V4Attention(gpu, V4AttentionWeights(a["wq_a"], a["wq_b"], a["wkv"], a["wo_a"], a["wo_b"],
                                                        n["attn.q_norm"], n["attn.kv_norm"], weights.attn_sink),
                                adims, kv, max_rows=B, max_kv_rows=R, invariant=self.inv)
        self.moe = MoE(gpu, MoeConfig.from_config(cfg, hashed=int(weights.tid2eid) != 0), weights.router,
                       weights.experts, bias=weights.router_bias, shared=weights.shared, tid2eid=weights.tid2eid,
                       max_rows=B, vocab=cfg.vocab_size, invariant=self.inv)

    # -- hidden forms ----------------------------------------------------------------------------
    def _hidden_shapes(self) -> list[tuple[int, ...]]:
        """The device-pointer form first: a pointer carries no shape."""
        s, one = (self.hc, self.hidden_size), (self.hidden_size,)
        return [s, one] if self.device_hidden == "streams" else [one, s]

    def _use_hidden_shape(self, shape: tuple[int, ...]) -> None:
        self._streams_in = len(shape) == 2

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
    def _front(self, ids: DevicePtr, hidden: DevicePtr, m: int, streams: bool) -> None:
        """X [m, hc, D] = h_proj(hnorm(hidden)) (expanded when one hidden a token) + e_proj(enorm(embed(ids)));
        xn = attn_norm of the attention site's collapse of X."""
        b = self.bufs
        src, src_hc = (b.X, self.hc) if streams else (b.x, 1)
        self.front.forward_split(ids, hidden, b.ep, src, m, m * src_hc)
        self.mhc.add_pre("attn", src, src_hc, b.ep, b.X, self.norm.weight("attn_norm"), b.xn, m)

    def _block(self, ids: DevicePtr, m: int, meta: DevicePtr, meta_stride: int) -> None:
        """The V4 layer on the streams X [m, hc, D] in place (xn: its attention input); leaves xn = norm(hc_head(X)),
        the LM head's input. `ids` are the input tokens (hash routing)."""
        b, w = self.bufs, self.norm.weight
        self.attn.forward(b.xn, b.f, m, meta, meta_stride)
        self.mhc.post_pre("attn", b.f, b.X, "ffn", w("ffn_norm"), b.xn, m)
        self.moe.forward(b.xn, b.f, m=m, token_ids=ids)
        self.mhc.post_head("ffn", b.f, b.X, w("norm"), b.xn, m)

    def _forward(self, ids, hidden, m, meta, meta_stride, logits) -> None:
        b = self.bufs
        self._front(ids, hidden, m, self._streams_in or int(hidden) == int(self.carry))
        self._block(ids, m, meta, meta_stride)
        ops.linear(self.gpu, b.xn, self.head, logits, m, out_dtype="f32", invariant=self.inv)

    def _write_rows(self, tokens_dev, hiddens, positions, slots, n) -> None:
        # one pass over n <= max_prefill_rows rows; row r pairs embed(tokens[r + 1]) with hiddens[r]
        b = self.bufs
        self._front(tokens_dev.offset(4), hiddens, n, self._prefill_streams)
        self.attn.write_kv(b.xn, n, positions, 4, slots, 8)

    # -- accounting ------------------------------------------------------------------------------
    def weight_bytes_per_step(self, m: int = 1, experts: int | None = None) -> int:
        """Weight bytes one draft step of m rows reads at least: every projection once, the mHC maps, `experts`
        distinct routed experts (default: as many as m rows may touch) plus the shared one, the router, the head."""
        return (self.front.weight_bytes_per_step(m) + self.attn.weight_bytes_per_step(m)
                + self.mhc.weight_bytes_per_step(m) + self.moe.weight_bytes_per_step(m, experts)
                + self.head.weight_bytes)


from_checkpoint = DeepseekV4MtpProposer.from_checkpoint
