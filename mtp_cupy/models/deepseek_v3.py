"""DeepSeek-V3/R1/V3.1/V3.2 MTP draft proposer (docs/model_math.md A; the V4 seed without mHC, S).

One draft step (A.2):
    x  = eh_proj([enorm(embed(token)) | hnorm(hidden)])          layers/mtp_front.py (embedding half first)
    x += MLA(input_layernorm(x))                                 over the proposer's own paged latent cache;
                                                                 V3.2 (a config with the DSA indexer): DSA-MLA,
                                                                 the indexer's top-k rows only (layers/dsa.py,
                                                                 its own indexer cache, half-split RoPE unless
                                                                 indexer_rope_interleave)
    x += MoE(post_attention_layernorm(x))                        noaux_tc: sigmoid scores, correction bias for
                                                                 selection, group-limited top-k, shared expert
    h  = shared_head.norm(x)
    logits = head(h)                                             f32 over the first `mtp_vocab_size` rows
    carried hidden: option carried_hidden, "post_norm" (h, the default: vLLM since PR #45895, SGLang,
                    transformers' MtpModel; hnorm was fitted on the target's final-normed hidden) or
                    "pre_norm" (x, vLLM's earlier rule) (docs/model_math.md E)

Prefill writes every prompt row in one batched pass (front, input_layernorm, then the latent rows: kv_a,
kv_a_layernorm, RoPE, cache write; with DSA also the indexer key rows) with no attention: a drafter row
depends only on its own (token, hidden) pair. The embedding is not zeroed at position 0 (SGLang; vLLM masks
it). Configurations the kernels cannot take are refused at load, before anything is allocated
(models/limits.py)."""
from __future__ import annotations

from dataclasses import dataclass

from .. import ops
from ..cache.paged import CacheSpec, PagedKvCache
from ..errors import ConfigError
from ..layers.dsa import INDEX_CACHE, DsaIndexer, DsaMlaAttention, IndexerDims
from ..layers.mla import MlaAttention, MlaDims, MlaRope, MlaWeights
from ..layers.moe import MoE, MoeConfig
from ..layers.mtp_front import FrontDims, FrontWeights, MtpFront
from ..layers.norm import Norms
from ..runtime.backend import Backend
from ..runtime.ptr import NULL
from ..speculative.base import MtpProposerBase
from ..speculative.options import ProposerOptions, opt
from ..weights.config import DeepseekV3Config
from ..weights.deepseek_v3 import DeepseekV3MtpWeights, load_deepseek_v3
from .limits import check_mla_moe


CARRIED_HIDDEN = ("pre_norm", "post_norm")


@dataclass(frozen=True, kw_only=True)
class DeepseekV3Options(ProposerOptions):
    mtp_vocab_size: int = opt(0, "score only the first n vocab rows (0 = the whole vocab)")
    carried_hidden: str = opt("post_norm", "the hidden the next draft step receives: 'post_norm' (after "
                                           "shared_head.norm: vLLM since PR #45895, SGLang, transformers) or "
                                           "'pre_norm' (the block output before it, vLLM's earlier rule)")

    def __post_init__(self) -> None:
        super().__post_init__()
        self._int("mtp_vocab_size", 0, 1 << 31)
        self._choice("carried_hidden", CARRIED_HIDDEN)


class DeepseekV3MtpProposer(MtpProposerBase):
    family = "deepseek_v3"
    Options = DeepseekV3Options
    config_class = DeepseekV3Config
    graph_safe = True

    @classmethod
    def check_config(cls, cfg, options) -> None:
        """ConfigError (naming the config field, its value and the supported range) for anything the kernels
        cannot take; runs before anything is allocated."""
        if cfg.scoring_func != "sigmoid" or cfg.topk_method != "noaux_tc":
            raise ConfigError(f"{cls.family} MTP supports scoring_func sigmoid / topk_method noaux_tc, got "
                              f"{cfg.scoring_func} / {cfg.topk_method}")
        check_mla_moe(cfg, dsa=cfg.has_indexer)

    @classmethod
    def load_weights(cls, gpu, path, cfg, options, comm=None) -> DeepseekV3MtpWeights:
        cls.check_config(cfg, options)
        return load_deepseek_v3(gpu, path, cfg, options.progress)

    @classmethod
    def properties(cls, cfg, options=None) -> dict[str, str]:
        """What this proposer runs for `cfg` with `options` (default options): attention, KV cache, carried
        hidden (`python -m mtp_cupy info`)."""
        o = options or cls.Options()
        attn = "MLA" if not cfg.has_indexer else (
            f"DSA-MLA (indexer {cfg.index_n_heads} heads x {cfg.index_head_dim}, top-{cfg.index_topk}, "
            f"{'interleaved' if cfg.indexer_rope_interleave else 'half-split'} RoPE)")
        kv = f"bf16 latent rows of {cfg.kv_lora_rank + cfg.qk_rope_head_dim}" + (
            f" + bf16 indexer rows of {cfg.index_head_dim}" if cfg.has_indexer else "")
        carried = getattr(o, "carried_hidden", "post_norm")
        props = {"attention": attn, "dsa": "on" if cfg.has_indexer else "off", "kv_cache": kv,
                 "carried_hidden": carried + (" (after shared_head.norm)" if carried == "post_norm"
                                              else " (before shared_head.norm)")}
        if "carried_hidden" in cls.Options.names():
            props["options"] = "carried_hidden: 'pre_norm' | 'post_norm'"
        return props

    def __init__(self, gpu: Backend, cfg: DeepseekV3Config, weights: DeepseekV3MtpWeights, max_seq_len: int = 4096,
                 comm=None, options: DeepseekV3Options | None = None, **kw):
        o = self.options_of(options, kw)
        self.check_config(cfg, o)
        self.cfg, self.w, self.eps, self.options = cfg, weights, float(cfg.rms_norm_eps), o
        self.inv = o.batch_invariant
        self.dsa = cfg.has_indexer
        if self.dsa and weights.indexer is None:
            raise ConfigError(f"{cfg.model_type} config has a DSA indexer (index_topk {cfg.index_topk}) but the "
                              "weights hold none")
        self.idx_dims = IndexerDims.from_config(cfg) if self.dsa else None
        self._setup_shard(cfg, weights, comm, o)
        D, B, rows = cfg.hidden_size, o.max_batch, max(o.max_batch, o.max_prefill_rows)
        self.dims = MlaDims.from_config(cfg, heads=self._local_heads())
        kv = PagedKvCache(gpu, self._cache_specs(), num_blocks=self.kv_blocks(o, max_seq_len))
        super().__init__(gpu, cfg.vocab_size, D, max_seq_len, kv, o,
                         extra_regions={"x": 2 * D * rows, "xn": 2 * D * rows, "tmp": 2 * D * B, **self._regions()})
        self.norm = Norms(gpu, weights.norms, D, self.eps)
        self.front = MtpFront(gpu, FrontWeights(weights.embed, proj=weights.eh_proj), FrontDims(D, cfg.vocab_size),
                              self.norm, rows, invariant=self.inv)
        self.mla = self._attention(MlaWeights(weights.q_a, weights.norms.get("q_a_layernorm", NULL), weights.q_b,
                                              weights.kv_a, weights.norms["kv_a_layernorm"], weights.w_uk_t,
                                              weights.kv_b, weights.o_proj), MlaRope.from_config(cfg), kv, rows)
        self.moe = MoE(gpu, MoeConfig.from_config(cfg), weights.router, weights.experts, bias=weights.bias,
                       shared=weights.shared, max_rows=B, invariant=self.inv)
        self.head = self._head()
        self.carry = self._carry()

    # -- hooks GLM-5 overrides -------------------------------------------------------------------
    def _setup_shard(self, cfg, weights, comm, options) -> None:
        self.comm = None

    def _local_heads(self) -> int | None:
        return None

    def _cache_specs(self) -> list[CacheSpec]:
        specs = [CacheSpec("latent", self.dims.row_width, "bf16")]
        if self.dsa:
            specs.append(CacheSpec(INDEX_CACHE, self.idx_dims.head_dim, "bf16"))
        return specs

    def _regions(self) -> dict[str, int]:
        return {}

    def _attention(self, w: MlaWeights, rope: MlaRope, kv: PagedKvCache, rows: int):
        B = self.options.max_batch
        if not self.dsa:
            return MlaAttention(self.gpu, w, self.dims, rope, kv, max_rows=B, max_kv_rows=rows, invariant=self.inv)
        self.indexer = DsaIndexer(self.gpu, self.w.indexer, self.idx_dims, rope, kv, self.max_seq_len,
                                  self.cfg.q_lora_rank, max_rows=B, max_kv_rows=rows, invariant=self.inv)
        return DsaMlaAttention(self.gpu, w, self.dims, rope, kv, self.indexer, max_rows=B, max_kv_rows=rows,
                               invariant=self.inv)

    def _head(self):
        return self.w.head.rows(0, self.vocab_eff)

    def _carry(self):
        # the next step's front reads it (hnorm) before eh_proj overwrites x and input_layernorm xn
        return self.bufs.xn if self.options.carried_hidden == "post_norm" else self.bufs.x

    # -- the step --------------------------------------------------------------------------------
    def _block(self, ids, hidden, m: int, meta, meta_stride: int, normed) -> None:
        """front, attention, MoE over m rows; leaves the shared_head.norm output in `normed`."""
        b = self.bufs
        self.front.forward(ids, hidden, b.x, m)
        self.norm("input_layernorm", b.x, b.xn, m)
        self.mla.forward(b.xn, b.tmp, m, meta, meta_stride)
        self._reduce(b.tmp, m)
        self.norm.add("post_attention_layernorm", b.x, b.tmp, b.xn, m)
        self.moe.forward(b.xn, b.tmp, m=m)
        self._reduce(b.tmp, m)
        self.norm.add("shared_head.norm", b.x, b.tmp, normed, m)

    def _reduce(self, ptr, m: int) -> None:
        """Sum partial block outputs across ranks (GLM-5 sharded); nothing on one rank."""

    def _forward(self, ids, hidden, m, meta, meta_stride, logits) -> None:
        self._block(ids, hidden, m, meta, meta_stride, self.bufs.xn)
        ops.linear(self.gpu, self.bufs.xn, self.head, logits, m, out_dtype="f32", invariant=self.inv)

    def _write_rows(self, tokens_dev, hiddens, positions, slots, n) -> None:
        # row r pairs embed(tokens[r + 1]) with hiddens[r]
        b = self.bufs
        self.front.forward(tokens_dev.offset(4), hiddens, b.x, n)
        self.norm("input_layernorm", b.x, b.xn, n)
        self.mla.write_kv(b.xn, n, positions, 4, slots, 8)

    # -- accounting ------------------------------------------------------------------------------
    def weight_bytes_per_step(self, m: int = 1, experts: int | None = None) -> int:
        """Weight bytes one draft step of m rows reads at least: every projection once, the router, `experts`
        distinct routed experts (default: as many as m rows may touch) and the shared one, the head rows."""
        return (self.front.weight_bytes_per_step(m) + self.mla.weight_bytes_per_step(m)
                + self.moe.weight_bytes_per_step(m, experts) + self.head.weight_bytes)


from_checkpoint = DeepseekV3MtpProposer.from_checkpoint
