"""DeepSeek-V3/R1/V3.1/V3.2 MTP draft proposer (arch_math.md A, seed deepseek_v4_mtp.rs without mHC).

One draft step (A.2):
    x  = eh_proj([enorm(embed(token)) | hnorm(hidden)])          layers/mtp_front.py (embedding half first)
    x += MLA(input_layernorm(x))                                 over the proposer's own paged latent cache
    x += MoE(post_attention_layernorm(x))                        noaux_tc: sigmoid scores, correction bias for
                                                                 selection, group-limited top-k, shared expert
    g  = x                                                       the hidden carried to the next draft (vLLM's
                                                                 choice: pre-shared_head.norm)
    logits = head(shared_head.norm(g))                           f32 over the first `mtp_vocab_size` rows

Prefill writes every prompt row in one batched pass (front, input_layernorm, then the latent rows: kv_a,
kv_a_layernorm, RoPE, cache write) with no attention: a drafter latent row depends only on its own (token,
hidden) pair. The embedding is not zeroed at position 0 (SGLang; vLLM masks it)."""
from __future__ import annotations

from dataclasses import dataclass

from .. import ops
from ..cache.paged import CacheSpec, PagedKvCache
from ..errors import ConfigError
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


@dataclass(frozen=True, kw_only=True)
class DeepseekV3Options(ProposerOptions):
    mtp_vocab_size: int = opt(0, "score only the first n vocab rows (0 = the whole vocab)")

    def __post_init__(self) -> None:
        super().__post_init__()
        self._int("mtp_vocab_size", 0, 1 << 31)


class DeepseekV3MtpProposer(MtpProposerBase):
    family = "deepseek_v3"
    Options = DeepseekV3Options
    config_class = DeepseekV3Config
    graph_safe = True

    @staticmethod
    def load_weights(gpu, path, cfg, options, comm=None) -> DeepseekV3MtpWeights:
        return load_deepseek_v3(gpu, path, cfg, options.progress)

    def __init__(self, gpu: Backend, cfg: DeepseekV3Config, weights: DeepseekV3MtpWeights, max_seq_len: int = 4096,
                 comm=None, options: DeepseekV3Options | None = None, **kw):
        o = self.options_of(options, kw)
        if cfg.scoring_func != "sigmoid" or cfg.topk_method != "noaux_tc":
            raise ConfigError(f"{self.family} MTP supports scoring_func sigmoid / topk_method noaux_tc, got "
                              f"{cfg.scoring_func} / {cfg.topk_method}")
        self.cfg, self.w, self.eps, self.options = cfg, weights, float(cfg.rms_norm_eps), o
        self.inv = o.batch_invariant
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
        return [CacheSpec("latent", self.dims.row_width, "bf16")]

    def _regions(self) -> dict[str, int]:
        return {}

    def _attention(self, w: MlaWeights, rope: MlaRope, kv: PagedKvCache, rows: int):
        return MlaAttention(self.gpu, w, self.dims, rope, kv, max_rows=self.options.max_batch, max_kv_rows=rows, invariant=self.inv)

    def _head(self):
        return self.w.head.rows(0, self.vocab_eff)

    def _carry(self):
        return self.bufs.x   # g: the next step's front reads it (hnorm) before eh_proj overwrites x

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

    def _write_rows(self, st, tokens_dev, hiddens, positions, slots, row_base, n) -> None:
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
