"""What the kernels take, checked against a family config at load, before anything is allocated (issue 17).

Each rule names the config.json field (or the expression of fields), its value and the range the kernels
support, so a configuration the kernels cannot run is refused by `load_proposer` with a ConfigError and never
at the first propose. The ranges come from the launchers (`mtp_cupy/ops`):

* attention: MLA rows (kv_lora_rank + qk_rope_head_dim) multiples of 8 up to 576 (ops.MAX_ROW_WIDTH), values
  (kv_lora_rank, V4 head_dim) and GQA head_dim multiples of 8 up to 512 (ops.MAX_HEAD_DIM); 16 for an fp8 GQA
  cache. Widths need not fill the kernels' 64-column tile.
* every projection's input width a whole number of 16-byte weight chunks: 8 elements for bf16 weights, 16 for
  fp8, 32 for fp4 (`k_step`: the strictest format the checkpoint declares or the options quantise to); RMSNorm
  widths multiples of 8, up to 16384 for the fused residual norm; grouped GEMV inputs (MLA q_b, W_UK^T, W_UV,
  V4 wo_a) multiples of 8 (bf16) or 16 (fp8), up to 12288.
* routing: at most 4096 experts, top-k in [1, min(32, experts)], DeepSeek groups that divide the experts.
* the DSA indexer: head_dim a multiple of 8 up to 256, its scores' shared memory (heads x (head_dim + 1) f32)
  within 48 KiB."""
from __future__ import annotations

from dataclasses import dataclass

from .. import ops
from ..errors import ConfigError
from ..ops.grouped_gemv import MAX_K as GROUPED_MAX_K
from ..ops.moe import MAX_EXPERTS

RMS_FUSED_MAX = 16384        # add_rms_norm (ops/rms_norm.py)


def _declared(cfg, *fields) -> str:
    q = getattr(cfg, "quant", None)
    return " ".join(str(getattr(q, f) or "") for f in fields).upper() if q is not None else ""


def _step(names: str) -> int:
    return 32 if "FP4" in names else 16 if "FP8" in names else 8


def k_step(cfg, extra: str | None = None) -> int:
    """Elements per 16-byte weight chunk of the narrowest format the checkpoint declares for its projections
    (config.json quantization_config / hf_quant_config.json) or `extra` (a format the options quantise BF16
    projections to): 8 bf16, 16 fp8, 32 fp4."""
    return _step(_declared(cfg, "algo", "method") + " " + (extra or "").upper())


def expert_k_step(cfg, extra: str | None = None) -> int:
    """k_step of the routed experts, which DeepSeek-V4 stores apart (expert_dtype "fp4")."""
    return max(k_step(cfg, extra), _step(_declared(cfg, "expert_dtype")))


def grouped_step(cfg) -> int:
    """Input-width step of the grouped GEMV (bf16 8, fp8 16; other formats are dequantised to bf16 at load)."""
    return 16 if k_step(cfg) >= 16 else 8


@dataclass
class Limits:
    """Checks of one config; `fail` raises the ConfigError."""
    cfg: object

    def fail(self, field: str, value, want: str) -> None:
        raise ConfigError(f"{self.cfg.model_type} config: {field} = {value} is not supported; {want}")

    def multiple(self, field: str, value, step: int, lo: int, hi: int, why: str) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value % step or not lo <= value <= hi:
            self.fail(field, value, f"{why} takes a multiple of {step} in [{lo}, {hi}]")

    def within(self, field: str, value, lo: int, hi: int, why: str) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            self.fail(field, value, f"{why} takes a value in [{lo}, {hi}]")

    def hidden(self, D: int, step: int) -> None:
        self.multiple("hidden_size", D, step, step, RMS_FUSED_MAX, "the projections (16-byte weight chunks) and "
                      "the fused residual RMSNorm")

    def experts(self, E: int, top_k: int, E_field: str, k_field: str = "num_experts_per_tok") -> None:
        self.within(E_field, E, 1, MAX_EXPERTS, "the router (experts in shared memory)")
        self.within(k_field, top_k, 1, min(32, E), f"the router (top-k of {E_field} = {E}, at most 32)")


def check_mla_moe(cfg, dsa: bool) -> None:
    """DeepSeek-V3/R1/V3.1/V3.2 and GLM-5: MLA (+ the DSA indexer when `dsa`) and the grouped-sigmoid MoE."""
    L, kq, kg = Limits(cfg), k_step(cfg), grouped_step(cfg)
    D, H, C, R = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    L.hidden(D, kq)
    L.within("num_attention_heads", H, 1, 65535, "the attention")
    if cfg.q_lora_rank:
        L.multiple("q_lora_rank", cfg.q_lora_rank, kq, kq, GROUPED_MAX_K, "q_a_layernorm and the q_b grouped GEMV")
    else:
        L.multiple("hidden_size", D, kg, kg, GROUPED_MAX_K, "the q_proj grouped GEMV (no q LoRA)")
    L.multiple("kv_lora_rank", C, kg, kg, ops.MAX_HEAD_DIM, "the MLA value (mla_decode v_width), kv_a_layernorm "
               "and the W_UV grouped GEMV")
    L.multiple("qk_rope_head_dim", R, 8, 8, ops.MAX_ROW_WIDTH, "the MLA cache row (8-column steps)")
    L.multiple("kv_lora_rank + qk_rope_head_dim", C + R, 8, 8, ops.MAX_ROW_WIDTH, "the MLA cache row (mla_decode)")
    L.multiple("qk_nope_head_dim", cfg.qk_nope_head_dim, kg, kg, GROUPED_MAX_K, "the W_UK^T absorption GEMV")
    L.multiple("num_attention_heads * v_head_dim", H * cfg.v_head_dim, kq, kq, 1 << 20, "o_proj")
    L.experts(cfg.n_routed_experts, cfg.num_experts_per_tok, "n_routed_experts")
    E, g, tg = cfg.n_routed_experts, cfg.n_group, cfg.topk_group
    if not (1 <= g <= 32 and E % g == 0 and (g == 1 or E // g >= 2)):
        L.fail("n_group", g, f"the grouped router takes 1 to 32 groups that divide n_routed_experts = {E} "
                             "(at least 2 experts each)")
    L.within("topk_group", tg, 1, g, f"the grouped router (n_group = {g})")
    ke = expert_k_step(cfg)
    L.multiple("hidden_size", D, ke, ke, RMS_FUSED_MAX, "the expert projections")
    L.multiple("moe_intermediate_size", cfg.moe_intermediate_size, ke, ke, 1 << 20, "the expert down projections")
    if dsa:
        if not cfg.q_lora_rank:
            L.fail("q_lora_rank", cfg.q_lora_rank, "DSA's indexer reads the normed q LoRA latent (a positive rank)")
        nh, hd = cfg.index_n_heads, cfg.index_head_dim
        L.multiple("index_head_dim", hd, 8, max(8, R), ops.dsa.MAX_HEAD_DIM,
                   f"the indexer (its LayerNorm, RoPE on the first qk_rope_head_dim = {R} dims, its scores)")
        L.within("index_n_heads", nh, 1, ops.dsa.SMEM_LIMIT // (4 * (hd + 1)),
                 f"the indexer scores (index_n_heads x (index_head_dim + 1) f32 in {ops.dsa.SMEM_LIMIT} bytes)")
        L.within("index_topk", cfg.index_topk, 1, 1 << 24, "the DSA selection")


def check_v4(cfg, kv_cache_dtype: str) -> None:
    """DeepSeek-V4: mHC, sliding-window MQA with sinks (bf16 or blocked-fp8 rows), the sqrtsoftplus MoE."""
    L, kq, kg = Limits(cfg), k_step(cfg), grouped_step(cfg)
    D, H, hd, rot, G = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.qk_rope_head_dim, cfg.o_groups
    L.hidden(D, kq)
    L.within("hc_mult", cfg.hc_mult, 1, ops.HC_MAX, "the mHC kernels")
    L.multiple("head_dim", hd, 8, 8, ops.MAX_HEAD_DIM, "the V4 attention (mla_decode, value = the whole row)")
    L.multiple("qk_rope_head_dim", rot, 2, 2, hd, f"RoPE on the last dims of head_dim = {hd}")
    if kv_cache_dtype == "fp8" and rot >= hd:
        L.fail("qk_rope_head_dim", rot, f"an fp8 KV cache quantises the head_dim - qk_rope_head_dim non-RoPE "
                                        f"columns (head_dim = {hd}): at least one (or kv_cache_dtype='bf16')")
    L.multiple("q_lora_rank", cfg.q_lora_rank, kq, kq, 1 << 20, "q_norm and wq_b")
    L.within("num_attention_heads", H, 1, 65535, "the attention")
    if G < 1 or (H * hd) % G:
        L.fail("o_groups", G, f"the grouped output projection splits num_attention_heads * head_dim = {H * hd} "
                              "into o_groups equal parts")
    L.multiple("num_attention_heads * head_dim / o_groups", H * hd // G, kg, kg, GROUPED_MAX_K, "the wo_a grouped GEMV")
    L.multiple("o_groups * o_lora_rank", G * cfg.o_lora_rank, kq, kq, 1 << 20, "wo_b")
    L.experts(cfg.n_routed_experts, cfg.num_experts_per_tok, "n_routed_experts")
    ke = expert_k_step(cfg)
    L.multiple("hidden_size", D, ke, ke, RMS_FUSED_MAX, "the expert projections")
    L.multiple("moe_intermediate_size", cfg.moe_intermediate_size, ke, ke, 1 << 20, "the expert down projections")


def check_qwen3_next(cfg, kv_dtype: str, quant_fmt: str | None, dense_ffn: bool | None = None) -> None:
    """Qwen3-Next: gated GQA (bf16 or fp8 K/V) and the softmax MoE or a dense FFN. `quant_fmt`: the format the
    options quantise BF16 projections to (None: as stored)."""
    L, kq = Limits(cfg), k_step(cfg, quant_fmt)
    D, H, KV, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    L.hidden(D, kq)
    step = 16 if kv_dtype == "fp8" else 8
    L.multiple("head_dim", hd, step, step, ops.MAX_HEAD_DIM,
               f"the gated attention (gqa_decode, {kv_dtype} K/V) and q_norm / k_norm")
    L.multiple("rotary dims (head_dim * partial_rotary_factor)", cfg.rotary_dim, 2, 2, hd, "RoPE")
    if not cfg.attn_output_gate:
        L.fail("attn_output_gate", cfg.attn_output_gate, "the MTP head runs Qwen3-Next's gated attention (true)")
    if KV < 1 or H % KV:
        L.fail("num_key_value_heads", KV, f"the GQA groups need num_attention_heads = {H} to be a multiple")
    group = H // KV
    if group > 32 and group % 32:
        L.fail("num_attention_heads / num_key_value_heads", group, "gqa_decode takes groups of at most 32 query "
                                                                   "heads or a multiple of 32")
    L.multiple("num_attention_heads * head_dim", H * hd, kq, kq, 1 << 20, "o_proj")
    moe = cfg.mtp_is_moe if dense_ffn is None else not dense_ffn
    if moe:
        L.experts(cfg.num_experts, cfg.num_experts_per_tok, "num_experts")
        L.multiple("moe_intermediate_size", cfg.moe_intermediate_size, kq, kq, 1 << 20, "the expert down projections")
        if cfg.shared_expert_intermediate_size:
            L.multiple("shared_expert_intermediate_size", cfg.shared_expert_intermediate_size, kq, kq, 1 << 20,
                       "the shared expert's down projection")
    elif cfg.intermediate_size:
        L.multiple("intermediate_size", cfg.intermediate_size, kq, kq, 1 << 20, "the dense FFN's down projection")
