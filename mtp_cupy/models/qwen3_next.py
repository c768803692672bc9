"""Qwen3-Next `MtpHead` draft proposer (docs/model_math.md D; the seed, S).

One draft step (D.2): pre-fc (1 + w) norms -> concat [norm(embed), norm(hidden)] -> fc -> input_layernorm ->
gated attention over the head's own paged K/V cache -> residual -> post_attention_layernorm -> MoE (softmax
top-k, sigmoid-gated shared expert) or dense FFN -> residual -> mtp.norm -> LM head (f32 logits over the
first `mtp_vocab_size` rows). The post-mtp.norm hidden is carried to the next draft step.

Formats (option `quantization`):
  "stored" (default) every tensor runs in the format the checkpoint stores it (dtype, scales; what a ModelOpt
                     checkpoint lists in exclude_modules stays BF16), the LM head as stored, K/V in BF16: the
                     checkpoint's own numerics.
  "nvfp4" / "fp8" / "bf16"  the seed's MtpQuantization: BF16 projections are quantised on the device at load
                     (nvfp4 -> nvfp4, fp8 -> fp8_row); tensors already FP8/NVFP4 stay as stored; an NVFP4 head
                     scores with an NVFP4 copy of lm_head and keeps K/V in FP8. A lossy speed trade: on an NVFP4
                     checkpoint whose MTP block is quantised but whose fc and head are BF16 it moves the logits
                     by about 35% (relative) from the checkpoint's numerics.
The router and the shared-expert gate always stay as stored. `kv_cache_dtype` overrides the K/V dtype."""
from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

from .. import ops
from ..cache.paged import CacheSpec, PagedKvCache
from ..errors import ConfigError
from ..layers.dense_ffn import DenseFFN
from ..layers.gated_attention import GatedAttention, GatedAttentionDims, GatedAttentionWeights
from ..layers.moe import MoE, MoeConfig
from ..layers.mtp_front import FrontDims, FrontWeights, MtpFront
from ..layers.norm import Norms
from ..runtime.backend import Backend
from ..runtime.ptr import DevicePtr
from ..speculative.base import MtpProposerBase
from ..speculative.options import ProposerOptions, opt
from ..weights.config import Qwen3NextConfig
from ..weights.qwen3_next import Qwen3NextMtpWeights, load_qwen3_next
from .limits import check_qwen3_next

log = logging.getLogger("mtp_cupy")


class MtpQuantization(enum.Enum):
    NVFP4 = "nvfp4"
    FP8 = "fp8"
    BF16 = "bf16"

    @classmethod
    def parse(cls, s: "str | MtpQuantization") -> "MtpQuantization":
        if isinstance(s, cls):
            return s
        name = str(s).lower()
        if name == "fp4":
            return cls.NVFP4
        try:
            return cls(name)
        except ValueError:
            raise ConfigError(f"Unknown MTP quantization: {s}. Expected: nvfp4, fp8, bf16") from None

    def effective_for_head(self, dense_ffn_head: bool) -> "MtpQuantization":
        """A dense-FFN head under NVFP4 runs the BF16 forward (the seed); everything else runs as asked."""
        return MtpQuantization.BF16 if dense_ffn_head and self is MtpQuantization.NVFP4 else self

    @property
    def linear_fmt(self) -> str:
        """The Linear format BF16 projections are quantised to at load."""
        return {"nvfp4": "nvfp4", "fp8": "fp8_row", "bf16": "bf16"}[self.value]

    @property
    def kv_dtype(self) -> str:
        return "fp8" if self is MtpQuantization.NVFP4 else "bf16"


STORED = "stored"
KV_CACHE_DTYPES = ("bf16", "fp8")


def quantization_mode(option: str, dense_ffn: bool) -> MtpQuantization | None:
    """The MtpQuantization the head runs at, or None for "stored" (each tensor in its stored format)."""
    return None if option == STORED else MtpQuantization.parse(option).effective_for_head(dense_ffn)


@dataclass(frozen=True, kw_only=True)
class Qwen3NextOptions(ProposerOptions):
    max_prefill_rows: int = opt(512, "drafter rows written per batched prefill pass")
    quantization: str = opt(STORED, "'stored' (every tensor in the format the checkpoint stores it, BF16 "
                                     "K/V), or quantise BF16 projections at load, a lossy speed trade: "
                                     "'nvfp4' ('fp4'; also an NVFP4 head and FP8 K/V), 'fp8', 'bf16'")
    mtp_vocab_size: int = opt(0, "score only the first n vocab rows (0 = the whole vocab)")
    kv_cache_dtype: str | None = opt(None, "K/V rows 'bf16' or 'fp8' (e4m3 times kv_scale) (default: fp8 under "
                                           "an nvfp4 quantization, else bf16)")
    kv_scale: float = opt(1.0, "scale of FP8 K/V cache rows")
    refeed_accepted: bool = opt(False, "after_verify also drops accepted rows built from a drafter hidden (the "
                                       "caller re-feeds them from the target)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.quantization != STORED:
            try:
                MtpQuantization.parse(self.quantization)
            except ConfigError as e:
                raise ConfigError(f"option quantization={self.quantization!r}: {e}, or 'stored' (every tensor in "
                                  "its stored format)") from None
        if self.kv_cache_dtype is not None:
            self._choice("kv_cache_dtype", KV_CACHE_DTYPES)
        self._int("mtp_vocab_size", 0, 1 << 31)
        if not isinstance(self.kv_scale, (int, float)) or not self.kv_scale > 0:
            raise ConfigError(f"option kv_scale={self.kv_scale!r} must be a positive number")
        if not isinstance(self.refeed_accepted, bool):
            raise ConfigError(f"option refeed_accepted={self.refeed_accepted!r} must be True or False")


class Qwen3NextMtpProposer(MtpProposerBase):
    family = "qwen3_next"
    Options = Qwen3NextOptions
    config_class = Qwen3NextConfig
    graph_safe = True

    @classmethod
    def check_config(cls, cfg, options, dense_ffn: bool | None = None) -> None:
        """ConfigError (naming the config field, its value and the supported range) for anything the kernels
        cannot take at these options; runs before anything is allocated."""
        dense = (not cfg.mtp_is_moe) if dense_ffn is None else dense_ffn
        q = quantization_mode(options.quantization, dense)
        check_qwen3_next(cfg, cls.kv_dtype_of(q, options), q.linear_fmt if q is not None else None, dense)

    @staticmethod
    def kv_dtype_of(q: MtpQuantization | None, options) -> str:
        return options.kv_cache_dtype or (q.kv_dtype if q is not None else "bf16")

    @classmethod
    def load_weights(cls, gpu, path, cfg, options, comm=None) -> Qwen3NextMtpWeights:
        cls.check_config(cfg, options)
        return load_qwen3_next(gpu, path, cfg, options.progress)

    @classmethod
    def properties(cls, cfg, options=None) -> dict[str, str]:
        """What this proposer runs for `cfg` with `options` (default options) (`python -m mtp_cupy info`)."""
        o = options or cls.Options()
        q = quantization_mode(o.quantization, not cfg.mtp_is_moe)
        fmt = "each tensor as stored" if q is None else (
            f"{q.value}: BF16 projections quantised at load" + (", NVFP4 head" if q is MtpQuantization.NVFP4 else ""))
        return {"attention": f"gated GQA ({cfg.num_attention_heads} q / {cfg.num_key_value_heads} kv heads of "
                             f"{cfg.head_dim})", "dsa": "off",
                "kv_cache": f"{cls.kv_dtype_of(q, o)} K and V rows of {cfg.num_key_value_heads * cfg.head_dim}",
                "formats": fmt, "carried_hidden": "post_norm (after mtp.norm)",
                "options": "quantization: 'stored' | 'nvfp4' | 'fp8' | 'bf16'; kv_cache_dtype: 'bf16' | 'fp8'"}

    def __init__(self, gpu: Backend, cfg: Qwen3NextConfig, weights: Qwen3NextMtpWeights, max_seq_len: int = 4096,
                 comm=None, options: Qwen3NextOptions | None = None, **kw):
        o = self.options_of(options, kw)
        self.check_config(cfg, o, weights.dense_ffn)
        self.quantization = quantization_mode(o.quantization, weights.dense_ffn)
        self.cfg, self.w, self.refeed_accepted, self.inv = cfg, weights, o.refeed_accepted, o.batch_invariant
        D, V = cfg.hidden_size, cfg.vocab_size
        B, self.eps = o.max_batch, float(cfg.rms_norm_eps)
        if self.quantization is not None:
            done = weights.quantize(gpu, self.quantization.linear_fmt)
            if self.quantization is MtpQuantization.NVFP4 and weights.lm_head.fmt == "bf16":
                weights.lm_head = ops.quantize_linear(gpu, weights.lm_head, "nvfp4")
                done.append("lm_head")
            if done:
                log.info("qwen3_next: quantised %s (stored BF16) to %s at load%s", ", ".join(done),
                         self.quantization.linear_fmt,
                         " and the K/V cache to FP8" if self.kv_dtype_of(self.quantization, o) == "fp8" else "")
        kvw, kv_dtype = cfg.num_key_value_heads * cfg.head_dim, self.kv_dtype_of(self.quantization, o)
        kv = PagedKvCache(gpu, [CacheSpec("k", kvw, kv_dtype), CacheSpec("v", kvw, kv_dtype)],
                          num_blocks=self.kv_blocks(o, max_seq_len))
        rows = max(B, o.max_prefill_rows)
        super().__init__(gpu, V, D, max_seq_len, kv, o,
                         extra_regions={**{n: 2 * D * rows for n in ("x", "xn", "tmp")}, "carry": 2 * D * B})
        self.carry = self.bufs.carry
        self.lm_head = weights.lm_head.rows(0, self.vocab_eff)
        self.norm = Norms(gpu, weights.norms, D, self.eps, unit_offset=True)
        self.front = MtpFront(gpu, FrontWeights(weights.embed, proj=weights.linears["fc"]), FrontDims(
            D, V, "pre_fc_norm_embedding", "pre_fc_norm_hidden"), self.norm, rows, invariant=self.inv)
        L = weights.linears
        self.attn = GatedAttention(gpu, GatedAttentionWeights(L["q_proj"], L["k_proj"], L["v_proj"], L["o_proj"],
                                                              weights.norms["q_norm"], weights.norms["k_norm"]),
                                   GatedAttentionDims.from_config(cfg, kv_dtype, o.kv_scale), kv, B, rows, invariant=self.inv)
        if weights.dense_ffn:
            self.ffn = DenseFFN(gpu, (L["gate_proj"], L["up_proj"], L["down_proj"]), max_rows=B, invariant=self.inv)
        else:
            self.ffn = MoE(gpu, MoeConfig.from_config(cfg), weights.router, weights.experts, shared=weights.shared,
                           shared_gate=weights.shared_gate, max_rows=B, invariant=self.inv)

    # -- the step --------------------------------------------------------------------------------
    def _forward(self, ids: DevicePtr, hidden: DevicePtr, m: int, meta: DevicePtr, meta_stride: int,
                 logits: DevicePtr) -> None:
        """m sequences, one row each: logits[m, vocab_eff] f32 and the carried hidden at self.carry."""
        b = self.bufs
        self.front.forward(ids, hidden, b.x, m)
        self.norm("input_layernorm", b.x, b.xn, m)
        self.attn.forward(b.xn, b.tmp, m, meta, meta_stride)
        self.norm.add("post_attention_layernorm", b.x, b.tmp, b.xn, m)
        self.ffn.forward(b.xn, b.tmp, m)
        self.norm.add("norm", b.x, b.tmp, self.carry, m)
        ops.linear(self.gpu, self.carry, self.lm_head, logits, m, out_dtype="f32", invariant=self.inv)

    def _write_rows(self, tokens_dev, hiddens, positions, slots, n) -> None:
        # row r pairs embed(tokens[r + 1]) with hiddens[r]
        self.front.forward(tokens_dev.offset(4), hiddens, self.bufs.x, n)
        self.norm("input_layernorm", self.bufs.x, self.bufs.xn, n)
        self.attn.write_kv(self.bufs.xn, n, positions, 4, slots, 8)

    # -- accounting ------------------------------------------------------------------------------
    def weight_bytes_per_step(self, m: int = 1, experts: int | None = None) -> int:
        """Weight bytes one draft step over m sequences must read at least: every projection once, `experts`
        distinct routed experts (default: the number m rows are expected to touch under uniform routing),
        the LM head rows scored."""
        total = self.front.weight_bytes_per_step(m) + self.attn.weight_bytes_per_step(m) + self.lm_head.weight_bytes
        if self.w.dense_ffn:
            return total + self.ffn.weight_bytes_per_step(m)
        if experts is None:
            E, k = self.cfg.num_experts, self.cfg.num_experts_per_tok
            experts = E * (1 - (1 - k / E) ** m)
        return int(total + self.ffn.weight_bytes_per_step(m, experts))

from_checkpoint = Qwen3NextMtpProposer.from_checkpoint
