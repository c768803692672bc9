"""The tiny DeepSeek-V3 (MLA + MoE, byte vocabulary) and its MTP module (docs/model_math.md A.2):
x = eh_proj([enorm(embed(t)), hnorm(h)]), the MoE decoder layer, shared_head.norm, the target's head. The
carried hidden is the shared_head.norm output (post_norm, the proposer's default).

Written as one file, the real V3 layout: the target's layers with per-expert keys and the MTP layer at
`model.layers.{num_hidden_layers}.*` (mtp_cupy's own DeepseekV3Target reads it, as does transformers)."""
from __future__ import annotations

from pathlib import Path

from .common import TOKENIZER, VOCAB, MtpHeadMixin, as_stored, split_experts

CONFIG = dict(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], vocab_size=VOCAB,
              hidden_size=256, intermediate_size=768, moe_intermediate_size=128, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
              num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
              scoring_func="sigmoid", topk_method="noaux_tc", first_k_dense_replace=1, q_lora_rank=128,
              kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32, rms_norm_eps=1e-6,
              rope_theta=10000.0, rope_scaling=None, rope_interleave=True, max_position_embeddings=4096,
              num_nextn_predict_layers=1, tie_word_embeddings=False, hidden_act="silu", attention_bias=False,
              bos_token_id=None, eos_token_id=None, torch_dtype="bfloat16", tokenizer=TOKENIZER)
# config.json fields transformers' config does not take as keywords (or spells otherwise)
_NOT_KWARGS = ("model_type", "architectures", "tokenizer", "torch_dtype", "scoring_func", "topk_method", "rope_theta",
               "rope_scaling")
F32 = ("e_score_correction_bias",)


def hf_kwargs(cfg: dict) -> dict:
    keys = {k: v for k, v in cfg.items() if k not in _NOT_KWARGS}
    keys["rope_parameters"] = {"rope_theta": cfg["rope_theta"], "rope_type": "default"}
    return keys


PER_LAYER = ("layer_types", "mlp_layer_types", "indexer_types", "compress_ratios")


def one_layer(config, **fields):
    """(layer 0, the model) of a one-layer model of `config`'s class and dims (the per-layer lists dropped and
    rebuilt for one layer, a MoE layer, with `fields` set)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    keys = {k: v for k, v in config.to_dict().items()
            if k not in PER_LAYER + ("model_type", "architectures", "transformers_version")}
    keys.update(num_hidden_layers=1, first_k_dense_replace=0, **fields)
    m = AutoModelForCausalLM.from_config(AutoConfig.for_model(config.model_type, **keys), attn_implementation="eager")
    return m.model.layers[0], m


def head_class():
    import torch

    class DeepseekMtpHead(MtpHeadMixin, torch.nn.Module):
        """enorm / hnorm / eh_proj around `layer` (layer 0 of `model`), shared_head.norm."""

        def __init__(self, layer, model, norm_cls, target):
            super().__init__()
            d, eps = target.config.hidden_size, target.config.rms_norm_eps
            self.layer, self.rotary = layer, model.model.rotary_emb   # the target's RoPE (same config)
            self.enorm, self.hnorm, self.head_norm = (norm_cls(d, eps) for _ in range(3))
            self.eh_proj = torch.nn.Linear(2 * d, d, bias=False)
            torch.nn.init.normal_(self.eh_proj.weight, std=target.config.initializer_range)

        def front(self, target, ids, h):
            e = target.model.embed_tokens(ids)
            return self.eh_proj(torch.cat([self.enorm(e), self.hnorm(h)], -1))

        def block(self, x, pos, mask):
            y = self.layer(x, position_embeddings=self.rotary(x, pos[None]), attention_mask=mask,
                           position_ids=pos[None])
            return y[0] if isinstance(y, tuple) else y

        def out(self, target, y):
            h = self.head_norm(y)
            return target.lm_head(h), h

        def tensors(self, prefix: str) -> dict:
            """The MTP layer under the checkpoint's keys (per-expert)."""
            sd = {prefix + k: v for k, v in split_experts(self.layer.state_dict()).items()}
            for name, mod in (("enorm", self.enorm), ("hnorm", self.hnorm), ("shared_head.norm", self.head_norm),
                              ("eh_proj", self.eh_proj)):
                sd[f"{prefix}{name}.weight"] = mod.weight
            return sd

    return DeepseekMtpHead


def build(device, cfg: dict = CONFIG):
    """(target DeepseekV3ForCausalLM, its MTP head), random weights from torch's seed."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm
    hc = AutoConfig.for_model("deepseek_v3", **hf_kwargs(cfg))
    target = AutoModelForCausalLM.from_config(hc, attn_implementation="eager")
    layer, model = one_layer(hc)
    return target.to(device), head_class()(layer, model, DeepseekV3RMSNorm, target).to(device)


def export(target, head, out: Path, cfg: dict = CONFIG) -> int:
    """model.safetensors (BF16, the correction biases F32) + config.json at `out`; returns the parameters."""
    from ..weights.writer import write_checkpoint
    sd = {k: v for k, v in target.state_dict().items() if "rotary" not in k}
    tensors = as_stored({**split_experts(sd), **head.tensors(f"model.layers.{cfg['num_hidden_layers']}.")}, F32)
    write_checkpoint(out, tensors, config=cfg, metadata={"format": "pt"})   # transformers reads the format
    return sum(a.size for a in tensors.values())
