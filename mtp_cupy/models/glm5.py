"""GLM-5 (`glm_moe_dsa`) MTP draft proposer (docs/model_math.md C.3 + A.2; the seed, S), sharded over
mpirun ranks like a text layer.

One draft step:
    x = eh_proj([enorm(embed(token)) | hnorm(hidden)])          (layers/mtp_front.py)
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

from dataclasses import dataclass

from .. import ops
from ..errors import ConfigError
from ..runtime.ptr import DevicePtr
from ..speculative.options import ProposerOptions, opt
from ..speculative.vocab_argmax import EXCHANGES, ShardedArgmax
from ..weights.config import GlmMoeDsaConfig
from ..weights.glm5 import Glm5MtpWeights, Shard, load_glm5
from .deepseek_v3 import DeepseekV3MtpProposer


@dataclass(frozen=True, kw_only=True)
class Glm5Options(ProposerOptions):
    head_fp8: bool = opt(False, "draft from an FP8 (per-row scale) copy of this rank's head slice (or of the "
                                "whole head on one rank)")
    head_exchange: str = opt("digits", "cross-rank argmax: 'digits' (bf16 lanes, one all-reduce) or 'pairs' "
                                       "((f32, i32) all-gather)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.head_fp8, bool):
            raise ConfigError(f"option head_fp8={self.head_fp8!r} must be True or False")
        self._choice("head_exchange", EXCHANGES)


def _shard_of(comm) -> Shard:
    return Shard(comm.rank, comm.world) if comm is not None and comm.world > 1 else Shard()


class Glm5MtpProposer(DeepseekV3MtpProposer):
    """DeepSeek-V3's step shape (front, attention, MoE, shared_head.norm) with DSA attention, this rank's
    shard of heads and experts (partial sums all-reduced), the post-norm carried hidden, and a bf16 head
    over this rank's vocab slice picked by the cross-rank exchange."""
    family = "glm5"
    Options = Glm5Options
    config_class = GlmMoeDsaConfig
    shardable = True

    @classmethod
    def load_weights(cls, gpu, path, cfg, options, comm=None) -> Glm5MtpWeights:
        cls.check_config(cfg, options)
        return load_glm5(gpu, path, cfg, _shard_of(comm), options.progress)

    @classmethod
    def check_config(cls, cfg, options) -> None:
        if not cfg.has_indexer or not cfg.q_lora_rank:
            raise ConfigError(f"glm_moe_dsa config: index_topk = {cfg.index_topk}, q_lora_rank = {cfg.q_lora_rank}: "
                              "the GLM-5 MTP layer needs its DSA indexer (index_topk > 0) and a q LoRA")
        super().check_config(cfg, options)

    # -- hooks -----------------------------------------------------------------------------------
    def _setup_shard(self, cfg, weights, comm, options) -> None:
        if weights.shard != _shard_of(comm):
            raise ConfigError(f"weights hold shard {weights.shard}; this proposer runs as {_shard_of(comm)}")
        self.comm = comm if comm is not None and comm.world > 1 else None
        self.head_v0, self.head_n = weights.head_v0, weights.head.n
        self.head_sharded = self.comm is not None and self.head_n != cfg.vocab_size

    def _local_heads(self) -> int:
        return self.w.heads[1]

    def _regions(self) -> dict[str, int]:
        D, V, B = self.cfg.hidden_size, self.cfg.vocab_size, self.options.max_batch
        return {"carry": 2 * D * B, "hlog": 2 * self.head_n * B, "full": 2 * V if self.head_sharded else 0}

    def _head(self):
        self.xchg = ShardedArgmax(self.gpu, self.comm, self.head_v0, self.head_n, self.options.head_exchange,
                                  self.max_batch) if self.head_sharded else None
        if self.options.head_fp8 and self.w.head.fmt == "bf16":
            return ops.quantize_linear(self.gpu, self.w.head, "fp8_row")
        return self.w.head

    def _carry(self) -> DevicePtr:
        return self.bufs.carry   # GLM-5 carries the post-shared_head.norm hidden

    # -- the step --------------------------------------------------------------------------------
    def _reduce(self, ptr: DevicePtr, m: int) -> None:
        """Sum the ranks' partial block outputs (o_proj row-parallel, EP MoE) in bf16, as NCCL does."""
        if self.comm is not None:
            self.comm.all_reduce(ptr, m * self.hidden_size, dtype="bf16", op="sum")

    def _forward(self, ids, hidden, m, meta, meta_stride, logits) -> None:
        """bf16 logits of this rank's vocab slice [m, head_n] into hlog (the pick widens them when f32 ones
        are wanted)."""
        self._block(ids, hidden, m, meta, meta_stride, self.bufs.carry)
        ops.linear(self.gpu, self.bufs.carry, self.head, self.bufs.hlog, m, invariant=self.inv)

    def _full_logits(self, logits: DevicePtr, W: int) -> None:
        """f32 [W, vocab] at `logits`: each row's slice gathered with the other ranks' (sharded), widened."""
        b, V, n = self.bufs, self.vocab_size, self.head_n
        for r in range(W):
            src = b.hlog.offset(2 * n * r)
            if self.head_sharded:
                self.comm.all_gather(src, b.full, n, dtype="bf16")
                src = b.full
            ops.widen_bf16_f32(self.gpu, src, logits.offset(4 * V * r), V)

    def _pick(self, step: int, W: int, logits: DevicePtr, masked: bool, want_lp: bool, keep: bool = False) -> None:
        if not (masked or want_lp or keep):
            out = self.bufs.ids.offset(4 * W * (step + 1))
            if self.xchg is not None:
                self.xchg.pick(self.bufs.hlog, out, W)
            else:
                ops.argmax(self.gpu, self.bufs.hlog, self.vocab_size, out, rows=W, row_stride=self.head_n,
                           dtype="bf16")
            return
        self._full_logits(logits, W)
        super()._pick(step, W, logits, masked, want_lp, keep)

    # -- accounting ------------------------------------------------------------------------------
    def weight_bytes_per_step(self, m: int = 1, experts: int | None = None) -> int:
        """Weight bytes this rank reads per draft step of m rows, at least: every projection once, the indexer,
        the router, `experts` distinct routed experts of its own (default: its share of as many as m rows may
        touch), its shared-expert slice, its head rows."""
        w, cfg = self.w, self.cfg
        if experts is None:
            experts = min(m * cfg.num_experts_per_tok, cfg.n_routed_experts) * len(w.experts) / cfg.n_routed_experts
        return int(self.front.weight_bytes_per_step(m) + self.mla.weight_bytes_per_step(m)
                   + self.moe.weight_bytes_per_step(m, experts) + self.head.weight_bytes)

from_checkpoint = Glm5MtpProposer.from_checkpoint
