"""DeepSeek-V3/R1/V3.1/V3.2 MTP draft proposer (arch_math.md A, seed deepseek_v4_mtp.rs without mHC).

One draft step (A.2): embed(token) -> enorm / hnorm (plain w) written straight into the two halves of the
concat [enorm(e) | hnorm(h)] (embedding half first) -> eh_proj -> x; x += MLA(input_layernorm(x)) over the
proposer's own paged latent cache; x += MoE(post_attention_layernorm(x)) (noaux_tc: sigmoid scores,
correction bias for selection, group-limited top-k, shared expert); g = x is the hidden carried to the next
draft (vLLM's choice: pre-shared_head.norm); logits = head(shared_head.norm(g)) in f32 over the first
`mtp_vocab_size` rows.

Prefill writes every prompt row in one batched pass (norms, eh_proj with m = rows, input_layernorm, then
the latent rows: kv_a, kv_a_layernorm, RoPE, cache write) with no attention: a drafter latent row depends
only on its own (token, hidden) pair. The embedding is not zeroed at position 0 (SGLang; vLLM masks it)."""
from __future__ import annotations


from .. import ops
from ..cache.paged import CacheSpec, PagedKvCache
from ..errors import ConfigError
from ..layers.mla import MlaAttention, MlaDims, MlaRope, MlaWeights
from ..layers.moe import MoE, MoeConfig
from ..runtime.backend import Backend
from ..runtime.ptr import NULL, DevicePtr
from ..speculative.base import MtpProposerBase
from .options import checked_config
from ..weights.config import DeepseekV3Config
from ..weights.deepseek_v3 import DeepseekV3MtpWeights, load_mtp_weights, write_tiny_checkpoint  # noqa: F401


class DeepseekV3MtpProposer(MtpProposerBase):
    family = "deepseek_v3"
    graph_safe = True

    def __init__(self, gpu: Backend, cfg: DeepseekV3Config, weights: DeepseekV3MtpWeights, max_seq_len: int = 4096,
                 max_sequences: int = 1, max_drafts: int = 8, mtp_vocab_size: int = 0, max_prefill_rows: int = 128):
        if cfg.scoring_func != "sigmoid" or cfg.topk_method != "noaux_tc":
            raise ConfigError(f"deepseek_v3 MTP supports scoring_func sigmoid / topk_method noaux_tc, got "
                              f"{cfg.scoring_func} / {cfg.topk_method}")
        if max_sequences < 1:
            raise ConfigError(f"max_sequences {max_sequences} must be >= 1")
        self.cfg, self.w, self.eps = cfg, weights, float(cfg.rms_norm_eps)
        D = cfg.hidden_size
        self.dims = MlaDims(cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim,
                            cfg.qk_rope_head_dim, cfg.v_head_dim, self.eps)
        kv = PagedKvCache(gpu, CacheSpec("latent", self.dims.row_width, "bf16"),
                          num_blocks=PagedKvCache.blocks_for(max_seq_len) * int(max_sequences))
        rows = int(max_prefill_rows)
        super().__init__(gpu, cfg.vocab_size, D, max_seq_len, kv, max_drafts=max_drafts,
                         mtp_vocab_size=mtp_vocab_size, max_prefill_rows=rows,
                         extra_regions={"emb": 2 * D * rows, "cat": 4 * D * rows, "x": 2 * D * rows,
                                        "xn": 2 * D * rows, "tmp": 2 * D})
        # g lives in bufs.x: the next step reads it (hnorm) before eh_proj overwrites x
        self.carry = self.bufs.x
        self.head = weights.head.rows(0, self.vocab_eff)
        n = weights.norms
        self.mla = MlaAttention(gpu, MlaWeights(weights.q_a, n.get("q_a_layernorm", NULL), weights.q_b,
                                                weights.kv_a, n["kv_a_layernorm"], weights.w_uk_t, weights.kv_b,
                                                weights.o_proj),
                                self.dims, MlaRope.from_config(cfg.rope, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                                                               cfg.rope_interleave),
                                kv, max_rows=1, max_kv_rows=rows)
        mc = MoeConfig(cfg.n_routed_experts, cfg.num_experts_per_tok, D, cfg.moe_intermediate_size,
                       routing="sigmoid_grouped", n_group=cfg.n_group, topk_group=cfg.topk_group,
                       routed_scaling=cfg.routed_scaling_factor, norm_topk_prob=cfg.norm_topk_prob)
        self.moe = MoE(gpu, mc, weights.router, weights.experts, bias=weights.bias, shared=weights.shared, max_rows=1)

    # -- the step --------------------------------------------------------------------------------
    def _norm(self, x: DevicePtr, name: str, y: DevicePtr, m: int = 1) -> None:
        ops.rms_norm(self.gpu, x, self.w.norms[name], y, m, self.hidden_size, self.eps)

    def _add_norm(self, x: DevicePtr, res: DevicePtr, name: str, y: DevicePtr, m: int = 1) -> None:
        """x += res (bf16) then y = norm `name`(x): one launch, the bits of residual_add + _norm."""
        ops.add_rms_norm(self.gpu, x, res, self.w.norms[name], y, m, self.hidden_size, self.eps)

    def _front(self, ids: DevicePtr, hidden: DevicePtr, m: int) -> None:
        """x = eh_proj([enorm(embed(ids)), hnorm(hidden)]) into bufs.x and xn = input_layernorm(x), m rows.
        The norms write the concat halves in place (row stride 2D), so no concat kernel runs."""
        gpu, b, D = self.gpu, self.bufs, self.hidden_size
        ops.embed_rows(gpu, self.w.embed, ids, b.emb, m, D, vocab=self.vocab_size)
        for src, name, dst in ((b.emb, "enorm", b.cat), (hidden, "hnorm", b.cat.offset(2 * D))):
            ops.rms_norm_strided(gpu, src, self.w.norms[name], dst, m, 1, D, D, D, 2 * D, 2 * D, self.eps)
        ops.linear(gpu, b.cat, self.w.eh_proj, b.x, m)
        self._norm(b.x, "input_layernorm", b.xn, m)

    def _step(self, st, ids, hidden, position, row, logits) -> None:
        gpu, b = self.gpu, self.bufs
        self._front(ids, hidden, 1)
        self.mla.forward(b.xn, b.tmp, 1, b.mtp_meta, b.mtp_meta_capacity)
        self._add_norm(b.x, b.tmp, "post_attention_layernorm", b.xn)
        self.moe.forward(b.xn, b.tmp, m=1)
        self._add_norm(b.x, b.tmp, "shared_head.norm", b.xn)
        ops.linear(gpu, b.xn, self.head, logits, 1, out_dtype="f32")

    def _write_rows(self, st, tokens_dev, hiddens, positions, slots, row_base, n) -> None:
        # row r pairs embed(tokens[r + 1]) with hiddens[r]
        self._front(tokens_dev.offset(4), hiddens, n)
        self.mla.write_rows(self.bufs.xn, n, positions, 4, slots, 8)

    # -- accounting ------------------------------------------------------------------------------
    def weight_bytes_per_step(self) -> int:
        """Weight bytes one draft step reads at least: every projection once, the router, top_k routed
        experts and the shared one, the LM head rows scored."""
        return (self.w.eh_proj.weight_bytes + self.mla.weight_bytes + self.moe.weight_bytes_per_step(1)
                + self.head.weight_bytes)


_OPTIONS = ("max_sequences", "max_drafts", "mtp_vocab_size", "max_prefill_rows", "progress")


def from_checkpoint(path, gpu: Backend, max_seq_len: int = 4096, comm=None, **options) -> DeepseekV3MtpProposer:
    """The DeepSeek-V3-family MTP proposer of the checkpoint at `path`. Options: max_sequences (KV pool size
    in sequences of max_seq_len), max_drafts, mtp_vocab_size (0 = full vocab), max_prefill_rows (rows per
    batched prefill pass), progress (weight-loading bar)."""
    cfg = checked_config(path, comm, options, _OPTIONS, "deepseek_v3", DeepseekV3Config, "DeepSeek-V3 MTP layer")
    progress = options.pop("progress", None)
    return DeepseekV3MtpProposer(gpu, cfg, load_mtp_weights(gpu, path, cfg, progress), max_seq_len=max_seq_len,
                                 **options)
