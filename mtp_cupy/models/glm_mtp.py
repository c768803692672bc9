"""GLM-5 (`glm_moe_dsa`) MTP draft proposer (seed glm5next_mtp_head.rs, arch_math.md C.3 + A.2), sharded over
mpirun ranks like a text layer.

One draft step:
    x = eh_proj([enorm(embed(token)) | hnorm(hidden)])          (DeepseekV3MtpProposer._front, shared)
    x += allreduce(DSA-MLA(input_layernorm(x)))                 this rank's heads; o_proj row-parallel
    x += allreduce(MoE(post_attention_layernorm(x)))            this rank's experts + its shared-expert slice
    h  = shared_head.norm(x)                                    the carried hidden (GLM: post-norm)
    logits_r = h @ head[v0_r : v0_r + n].T                      bf16, this rank's vocab slice (FP8 copy of the
                                                                slice, or of the whole head, with head_fp8)
    draft = cross-rank argmax (digits all-reduce or pairs all-gather), decoded on the device
Without a communicator (or world 1) nothing is reduced and the head sweeps the whole vocab; with vocab %
world != 0 the block is still sharded but every rank sweeps the whole head (no exchange).

Logits are bf16, as in the seed: the digit exchange carries a bf16 value, so a bf16 head makes the
sharded pick exactly the unsharded argmax (ties to the lowest id). When f32 logits are wanted (return_logits,
a grammar mask, a log-prob stop) the slices are all-gathered and widened, and every rank picks from the
same full row.

Prefill / catch-up rows run the front, input_layernorm and the cache writes only (MLA latent + indexer
key): no attention, no MoE, no head (their output would be discarded). The latent and indexer caches share
one PagedKvCache pool and its block ids, so the base state's block table covers both."""
from __future__ import annotations


from .. import ops
from ..cache.paged import CacheSpec, PagedKvCache
from ..errors import ConfigError
from ..layers.dsa import INDEX_CACHE, DsaIndexer, DsaMlaAttention, IndexerDims
from ..layers.mla import MlaDims, MlaRope, MlaWeights
from ..layers.moe import MoE, MoeConfig
from ..runtime.backend import Backend
from ..runtime.ptr import DevicePtr
from ..speculative.base import MtpProposerBase
from ..speculative.vocab_argmax import EXCHANGES, ShardedArgmax
from ..weights.config import GlmMoeDsaConfig
from .options import checked_config
from ..weights.glm import GlmMtpWeights, Shard, load_glm_weights, write_tiny_checkpoint  # noqa: F401
from .deepseek_mtp import DeepseekV3MtpProposer


class GlmMtpProposer(DeepseekV3MtpProposer):
    """Reuses DeepseekV3MtpProposer's front (embed, enorm/hnorm into the concat halves, eh_proj,
    input_layernorm) and its prefill row writer; builds its own DSA attention, EP MoE and sharded head."""
    family = "glm5"

    def __init__(self, gpu: Backend, cfg: GlmMoeDsaConfig, weights: GlmMtpWeights, max_seq_len: int = 4096,
                 comm=None, max_sequences: int = 1, max_drafts: int = 8, max_prefill_rows: int = 128,
                 head_fp8: bool = False, head_exchange: str = "digits", cuda_graphs: bool | None = None):
        if cfg.scoring_func != "sigmoid" or cfg.topk_method != "noaux_tc":
            raise ConfigError(f"glm_moe_dsa MTP supports scoring_func sigmoid / topk_method noaux_tc, got "
                              f"{cfg.scoring_func} / {cfg.topk_method}")
        if head_exchange not in EXCHANGES:
            raise ConfigError(f"head_exchange {head_exchange!r}: choose one of {', '.join(EXCHANGES)}")
        if max_sequences < 1:
            raise ConfigError(f"max_sequences {max_sequences} must be >= 1")
        world = comm.world if comm is not None else 1
        expect = Shard(comm.rank, world) if world > 1 else Shard()
        if weights.shard != expect:
            raise ConfigError(f"weights hold shard {weights.shard}; this proposer runs as {expect}")
        self.cfg, self.w, self.eps = cfg, weights, float(cfg.rms_norm_eps)
        self.comm = comm if world > 1 else None
        D, V = cfg.hidden_size, cfg.vocab_size
        h0, hl = weights.heads
        self.dims = MlaDims(hl, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                            cfg.v_head_dim, self.eps)
        idx = IndexerDims(cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim, cfg.index_topk,
                          cfg.indexer_rope_interleave)
        kv = PagedKvCache(gpu, [CacheSpec("latent", self.dims.row_width, "bf16"),
                                CacheSpec(INDEX_CACHE, idx.head_dim, "bf16")],
                          num_blocks=PagedKvCache.blocks_for(max_seq_len) * int(max_sequences))
        rows = int(max_prefill_rows)
        self.head_v0, self.head_n = weights.head_v0, weights.head.n
        self.head_sharded = self.comm is not None and self.head_n != V
        MtpProposerBase.__init__(self, gpu, V, D, max_seq_len, kv, max_drafts=max_drafts, max_prefill_rows=rows,
                                 extra_regions={"emb": 2 * D * rows, "cat": 4 * D * rows, "x": 2 * D * rows,
                                                "xn": 2 * D * rows, "tmp": 2 * D, "carry": 2 * D,
                                                "hlog": 2 * self.head_n, "full": 2 * V if self.head_sharded else 0},
                                 cuda_graphs=cuda_graphs)
        self.carry = self.bufs.carry
        self.head = weights.head
        if head_fp8 and weights.head.fmt == "bf16":
            self.head = ops.quantize_linear(gpu, weights.head, "fp8_row")
        rope = MlaRope.from_config(cfg.rope, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.rope_interleave)
        n = weights.norms
        self.indexer = DsaIndexer(gpu, weights.indexer, idx, rope, kv, max_seq_len, cfg.q_lora_rank, max_rows=1,
                                  max_kv_rows=rows)
        self.mla = DsaMlaAttention(gpu, MlaWeights(weights.q_a, n["q_a_layernorm"], weights.q_b, weights.kv_a,
                                                   n["kv_a_layernorm"], weights.w_uk_t, weights.kv_b, weights.o_proj),
                                   self.dims, rope, kv, self.indexer, max_rows=1, max_kv_rows=rows)
        mc = MoeConfig(cfg.n_routed_experts, cfg.num_experts_per_tok, D, cfg.moe_intermediate_size,
                       routing="sigmoid_grouped", n_group=cfg.n_group, topk_group=cfg.topk_group,
                       routed_scaling=cfg.routed_scaling_factor, norm_topk_prob=cfg.norm_topk_prob)
        self.moe = MoE(gpu, mc, weights.router, weights.experts, bias=weights.bias, shared=weights.shared, max_rows=1)
        self.xchg = ShardedArgmax(gpu, self.comm, self.head_v0, self.head_n, head_exchange) \
            if self.head_sharded else None
        self._f32_logits = False

    # -- the step --------------------------------------------------------------------------------
    def _reduce(self, ptr: DevicePtr) -> None:
        """Sum the ranks' partial block outputs (o_proj row-parallel, EP MoE) in bf16, as NCCL does."""
        if self.comm is not None:
            self.comm.all_reduce(ptr, self.hidden_size, dtype="bf16", op="sum")

    def _step(self, st, ids, hidden, position, row, logits) -> None:
        gpu, b = self.gpu, self.bufs
        self._front(ids, hidden, 1)
        self.mla.forward(b.xn, b.tmp, 1, b.mtp_meta, b.mtp_meta_capacity)
        self._reduce(b.tmp)
        self._add_norm(b.x, b.tmp, "post_attention_layernorm", b.xn)
        self.moe.forward(b.xn, b.tmp, m=1)
        self._reduce(b.tmp)
        self._add_norm(b.x, b.tmp, "shared_head.norm", b.carry)
        ops.linear(gpu, b.carry, self.head, b.hlog, 1)

    def _full_logits(self, logits: DevicePtr) -> None:
        """f32 [vocab] at `logits`: this rank's slice gathered with the others' (sharded) and widened."""
        src = self.bufs.hlog
        if self.head_sharded:
            self.comm.all_gather(src, self.bufs.full, self.head_n, dtype="bf16")
            src = self.bufs.full
        ops.widen_bf16_f32(self.gpu, src, logits, self.vocab_size)

    def _graph_variant(self):
        """return_logits adds the gather / widen launches to every step: a chain of its own."""
        return self._f32_logits

    def _pick(self, step: int, logits: DevicePtr, mask: DevicePtr | None, want_lp: bool) -> None:
        if mask is None and not want_lp and not self._f32_logits:
            ids_out = self.bufs.ids.offset(4 * (step + 1))
            if self.xchg is not None:
                self.xchg.pick(self.bufs.hlog, ids_out)
            else:
                ops.argmax(self.gpu, self.bufs.hlog, self.vocab_size, ids_out, dtype="bf16")
            return
        self._full_logits(logits)
        super()._pick(step, logits, mask, want_lp)

    def propose(self, st, token, hidden, position, num_drafts, grammar_bitmask=None, return_logits=False,
                min_logprob=None):
        self._f32_logits = bool(return_logits)
        try:
            return super().propose(st, token, hidden, position, num_drafts, grammar_bitmask, return_logits,
                                   min_logprob)
        finally:
            self._f32_logits = False

    # -- accounting ------------------------------------------------------------------------------
    def weight_bytes_per_step(self) -> int:
        """Weight bytes this rank reads per draft step, at least: every projection once, the indexer, the
        router, its share of the top_k routed experts, its shared-expert slice, its head rows."""
        w, cfg = self.w, self.cfg
        expert = sum(x.weight_bytes for x in next(iter(w.experts.values())))
        local = cfg.num_experts_per_tok * len(w.experts) / cfg.n_routed_experts
        ix = w.indexer
        return int(w.eh_proj.weight_bytes + self.mla.weight_bytes + ix.wq_b.weight_bytes + ix.wk.weight_bytes
                   + ix.weights_proj.weight_bytes + w.router.weight_bytes + local * expert
                   + (sum(x.weight_bytes for x in w.shared) if w.shared else 0) + self.head.weight_bytes)


_OPTIONS = ("max_sequences", "max_drafts", "max_prefill_rows", "head_fp8", "head_exchange", "cuda_graphs",
            "progress")


def from_checkpoint(path, gpu: Backend, max_seq_len: int = 4096, comm=None, **options) -> GlmMtpProposer:
    """The GLM-5 MTP proposer of the checkpoint at `path`, this rank's shard when `comm` spans several ranks.
    Options: max_sequences (KV pool size in sequences of max_seq_len), max_drafts, max_prefill_rows,
    head_fp8 (draft from an FP8 (per-row scale) copy of this rank's head slice, or of the whole head),
    head_exchange ("digits": bf16 lanes, one all-reduce; "pairs": (f32, i32) all-gather), cuda_graphs
    (capture each draft chain, NCCL calls included; default on CUDA), progress (weight-loading bar)."""
    cfg = checked_config(path, comm, options, _OPTIONS, "glm5", GlmMoeDsaConfig)
    progress = options.pop("progress", None)
    shard = Shard(comm.rank, comm.world) if comm is not None and comm.world > 1 else Shard()
    weights = load_glm_weights(gpu, path, cfg, shard, progress)
    return GlmMtpProposer(gpu, cfg, weights, max_seq_len=max_seq_len, comm=comm, **options)
