"""Qwen3-Next `MtpHead` draft proposer (arch_math.md D, seed mtp_head.rs).

One draft step (D.2): pre-fc (1 + w) norms -> concat [norm(embed), norm(hidden)] -> fc -> input_layernorm ->
gated attention over the head's own paged K/V cache -> residual -> post_attention_layernorm -> MoE (softmax
top-k, sigmoid-gated shared expert) or dense FFN -> residual -> mtp.norm -> LM head (f32 logits over the
first `mtp_vocab_size` rows). The post-mtp.norm hidden is carried to the next draft step.

`quantization` is the precision the projections run at: a BF16 checkpoint is quantised on the device at load
(fp8 -> fp8_row, nvfp4 -> nvfp4); tensors a checkpoint already stores as FP8/NVFP4 are taken as stored. The
router and the shared-expert gate stay BF16. An NVFP4 head scores with an NVFP4 copy of lm_head (as the
seed) and keeps its K/V in FP8; BF16 and FP8 heads keep K/V in BF16."""
from __future__ import annotations

import enum

from .. import ops
from ..cache.paged import CacheSpec, PagedKvCache
from ..errors import ConfigError
from ..layers.dense_ffn import DenseFFN
from ..layers.gated_attention import GatedAttention
from ..layers.moe import MoE, MoeConfig
from ..runtime.backend import Backend
from ..runtime.ptr import DevicePtr
from ..speculative.base import MtpProposerBase
from .options import checked_config
from ..weights.config import Qwen3NextConfig
from ..weights.qwen import QwenMtpWeights, load_qwen_mtp, write_tiny_checkpoint  # noqa: F401 (re-export)
from .qwen_batch import BatchProposeMixin


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


def default_quantization(cfg: Qwen3NextConfig) -> MtpQuantization:
    """What the checkpoint itself stores: NVFP4 / FP8 checkpoints run at their format, others at BF16."""
    algo = (cfg.quant.algo if cfg.quant else "").upper()
    return MtpQuantization.NVFP4 if "NVFP4" in algo else MtpQuantization.FP8 if "FP8" in algo else MtpQuantization.BF16


class QwenMtpProposer(BatchProposeMixin, MtpProposerBase):
    family = "qwen3_next"
    graph_safe = True

    def __init__(self, gpu: Backend, cfg: Qwen3NextConfig, weights: QwenMtpWeights, max_seq_len: int = 4096,
                 quantization: "str | MtpQuantization | None" = None, mtp_vocab_size: int = 0,
                 max_drafts: int = 8, max_batch: int = 32, max_prefill_rows: int = 512, kv_blocks: int | None = None,
                 kv_scale: float = 1.0, refeed_accepted: bool = False):
        q = default_quantization(cfg) if quantization is None else MtpQuantization.parse(quantization)
        self.quantization = q.effective_for_head(weights.dense_ffn)
        self.cfg, self.w, self.refeed_accepted = cfg, weights, bool(refeed_accepted)
        D, V = cfg.hidden_size, cfg.vocab_size
        if not 1 <= max_batch <= 32:
            raise ConfigError(f"max_batch {max_batch} outside [1, 32] (the batched GEMV path)")
        self.max_batch, self.eps = int(max_batch), float(cfg.rms_norm_eps)
        weights.quantize(gpu, self.quantization.linear_fmt)
        if self.quantization is MtpQuantization.NVFP4 and weights.lm_head.fmt == "bf16":
            weights.lm_head = ops.quantize_linear(gpu, weights.lm_head, "nvfp4")
        kvw = cfg.num_key_value_heads * cfg.head_dim
        blocks = kv_blocks if kv_blocks is not None else PagedKvCache.blocks_for(max_seq_len) * self.max_batch
        kv = PagedKvCache(gpu, [CacheSpec("k", kvw, self.quantization.kv_dtype),
                                CacheSpec("v", kvw, self.quantization.kv_dtype)], num_blocks=blocks)
        rows = max(self.max_batch, int(max_prefill_rows))
        v_eff = min(mtp_vocab_size, V) if mtp_vocab_size > 0 else V
        super().__init__(gpu, V, D, max_seq_len, kv, max_drafts=max_drafts, mtp_vocab_size=mtp_vocab_size,
                         max_prefill_rows=max_prefill_rows,
                         extra_regions={**{n: 2 * D * rows for n in ("emb", "x", "xn", "tmp")},
                                        "cat": 4 * D * rows, "carry": 2 * D * self.max_batch,
                                        **self._batch_regions(max_seq_len, self.max_batch, max_drafts, V, v_eff, D)})
        self.carry = self.bufs.carry
        self.lm_head = weights.lm_head.rows(0, self.vocab_eff)
        self.attn = GatedAttention(gpu, *(weights.linears[r] for r in ("q_proj", "k_proj", "v_proj", "o_proj")),
                                   weights.norms["q_norm"], weights.norms["k_norm"], cfg.num_attention_heads,
                                   cfg.num_key_value_heads, cfg.head_dim, cfg.rotary_dim, cfg.rope.theta, self.eps,
                                   kv, self.quantization.kv_dtype, kv_scale, self.max_batch, rows)
        if weights.dense_ffn:
            self.ffn = DenseFFN(gpu, *(weights.linears[r] for r in ("gate_proj", "up_proj", "down_proj")),
                                max_rows=self.max_batch)
        else:
            mc = MoeConfig(cfg.num_experts, cfg.num_experts_per_tok, D, cfg.moe_intermediate_size,
                           routing="softmax", norm_topk_prob=cfg.norm_topk_prob)
            self.ffn = MoE(gpu, mc, weights.router, weights.experts, shared=weights.shared,
                           shared_gate=weights.shared_gate, max_rows=self.max_batch)

    # -- the step --------------------------------------------------------------------------------
    def _norm(self, x: DevicePtr, name: str, y: DevicePtr, m: int) -> None:
        ops.rms_norm(self.gpu, x, self.w.norms[name], y, m, self.hidden_size, self.eps, unit_offset=True)

    def _add_norm(self, x: DevicePtr, res: DevicePtr, name: str, y: DevicePtr, m: int) -> None:
        """x += res (bf16) then y = norm `name`(x) over m rows: one launch, the bits of residual_add + _norm."""
        ops.add_rms_norm(self.gpu, x, res, self.w.norms[name], y, m, self.hidden_size, self.eps, unit_offset=True)

    def _front(self, ids: DevicePtr, hidden: DevicePtr, m: int) -> None:
        """x = fc([norm(embed(ids)), norm(hidden)]) into bufs.x; xn = input_layernorm(x). The two pre-fc
        norms write straight into the halves of the concat rows (embedding half first)."""
        gpu, b, D, eps = self.gpu, self.bufs, self.hidden_size, self.eps
        ops.embed_rows(gpu, self.w.embed, ids, b.emb, m, D, vocab=self.vocab_size)
        halves = ((b.emb, "pre_fc_norm_embedding", b.cat), (hidden, "pre_fc_norm_hidden", b.cat.offset(2 * D)))
        for src, name, dst in halves:
            ops.rms_norm_strided(gpu, src, self.w.norms[name], dst, m, 1, D, D, D, 2 * D, 2 * D, eps, unit_offset=True)
        ops.linear(gpu, b.cat, self.w.linears["fc"], b.x, m)
        self._norm(b.x, "input_layernorm", b.xn, m)

    def _forward(self, ids: DevicePtr, hidden: DevicePtr, m: int, meta: DevicePtr, meta_stride: int,
                 logits: DevicePtr) -> None:
        """m sequences, one row each: logits[m, vocab_eff] f32 and the carried hidden at self.carry."""
        gpu, b = self.gpu, self.bufs
        self._front(ids, hidden, m)
        self.attn.forward(b.xn, b.tmp, m, meta, meta_stride)
        self._add_norm(b.x, b.tmp, "post_attention_layernorm", b.xn, m)
        self.ffn.forward(b.xn, b.tmp, m)
        self._add_norm(b.x, b.tmp, "norm", self.carry, m)
        ops.linear(gpu, self.carry, self.lm_head, logits, m, out_dtype="f32")

    def _step(self, st, ids, hidden, position, row, logits) -> None:
        self._forward(ids, hidden, 1, self.bufs.mtp_meta, self.meta_stride, logits)

    def _write_rows(self, st, tokens_dev, hiddens, positions, slots, row_base, n) -> None:
        # row r pairs embed(tokens[r + 1]) with hiddens[r]
        self._front(tokens_dev.offset(4), hiddens, n)
        self.attn.write_kv(self.bufs.xn, n, positions, 4, slots, 8)

    # -- accounting ------------------------------------------------------------------------------
    def weight_bytes_per_step(self, m: int = 1) -> int:
        """Weight bytes one draft step over m sequences must read at least: every projection once, the
        routed experts m rows are expected to touch (uniform routing), the LM head rows scored."""
        w = self.w
        total = w.linears["fc"].weight_bytes + self.attn.weight_bytes + self.lm_head.weight_bytes
        if w.dense_ffn:
            return total + self.ffn.weight_bytes
        E, k = self.cfg.num_experts, self.cfg.num_experts_per_tok
        per_expert = sum(x.weight_bytes for x in next(iter(w.experts.values())))
        touched = E * (1 - (1 - k / E) ** m)
        total += w.router.weight_bytes + w.shared_gate.weight_bytes + sum(x.weight_bytes for x in w.shared)
        return int(total + touched * per_expert)


_OPTIONS = ("quantization", "mtp_vocab_size", "max_drafts", "max_batch", "max_prefill_rows", "kv_blocks",
            "kv_scale", "refeed_accepted")


def from_checkpoint(path, gpu: Backend, max_seq_len: int = 4096, comm=None, **options) -> QwenMtpProposer:
    """The Qwen3-Next MTP proposer of the checkpoint at `path`. Options: quantization ("nvfp4"/"fp4", "fp8",
    "bf16"; default: the checkpoint's own format), mtp_vocab_size (0 = full vocab), max_drafts, max_batch,
    max_prefill_rows, kv_blocks, kv_scale (FP8 K/V), refeed_accepted."""
    cfg = checked_config(path, comm, options, _OPTIONS, "qwen3_next", Qwen3NextConfig, "Qwen3-Next MTP head")
    if "quantization" in options and options["quantization"] is not None:
        MtpQuantization.parse(options["quantization"])   # a bad name fails before any weight is read
    return QwenMtpProposer(gpu, cfg, load_qwen_mtp(gpu, path, cfg), max_seq_len=max_seq_len, **options)
