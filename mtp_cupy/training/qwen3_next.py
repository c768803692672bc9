"""The tiny Qwen3-Next (three gated-DeltaNet linear-attention layers, one gated full-attention layer, MoE with a
gated shared expert, byte vocabulary) and its MTP head (docs/model_math.md D.2): x = fc([pre_fc_norm_embedding(
embed(t)), pre_fc_norm_hidden(h)]), one full-attention MoE decoder layer, mtp.norm, the target's LM head; the
carried hidden is the mtp.norm output. Every norm is transformers' (1 + w) Qwen3NextRMSNorm.

Exported as the target through transformers (shard 1) and the head at `mtp.*` (shard 2), per-expert keys."""
from __future__ import annotations

from pathlib import Path

from ..testing.hf_targets import hf_config
from ..testing.tiny.qwen3_next import tiny_config
from ..weights.qwen3_next import LAYER, MTP
from .common import VOCAB, MtpHeadMixin, as_stored, export_two_shards, split_experts
from .deepseek_v3 import one_layer

DIMS = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, partial_rotary_factor=0.25,
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=256,
            intermediate_size=512, vocab_size=VOCAB, rope_theta=10000000.0, rms_norm_eps=1e-6, num_hidden_layers=4,
            full_attention_interval=4)
CONFIG = tiny_config("bf16", **DIMS)


def head_class():
    import torch

    class QwenMtpHead(MtpHeadMixin, torch.nn.Module):
        def __init__(self, layer, model, target):
            super().__init__()
            c = target.config
            d, norm = c.hidden_size, type(model.model.norm)
            self.layer, self.rotary, self.final = layer, model.model.rotary_emb, model.model.norm
            self.pre_e, self.pre_h = norm(d, c.rms_norm_eps), norm(d, c.rms_norm_eps)
            self.fc = torch.nn.Linear(2 * d, d, bias=False)
            torch.nn.init.normal_(self.fc.weight, std=c.initializer_range)

        def front(self, target, ids, h):
            return self.fc(torch.cat([self.pre_e(target.model.embed_tokens(ids)), self.pre_h(h)], -1))

        def block(self, x, pos, mask):
            p = pos[None]
            y = self.layer(x, position_embeddings=self.rotary(x, p), attention_mask=mask, position_ids=p)
            return y[0] if isinstance(y, tuple) else y

        def out(self, target, y):
            g = self.final(y)
            return target.lm_head(g), g

        def tensors(self) -> dict:
            sd = {LAYER + k: v for k, v in split_experts(self.layer.state_dict()).items()}
            for name, mod in (("pre_fc_norm_embedding", self.pre_e), ("pre_fc_norm_hidden", self.pre_h),
                              ("norm", self.final), ("fc", self.fc)):
                sd[f"{MTP}{name}.weight"] = mod.weight
            return sd

    return QwenMtpHead


def build(device, cfg: dict = CONFIG):
    """(target Qwen3NextForCausalLM, its MTP head), random weights from torch's seed."""
    from transformers import AutoModelForCausalLM
    hc = hf_config("qwen3_next", cfg)
    target = AutoModelForCausalLM.from_config(hc, attn_implementation="eager")
    layer, model = one_layer(hc, layer_types=["full_attention"])
    return target.to(device), head_class()(layer, model, target).to(device)


def export(target, head, out: Path, cfg: dict = CONFIG) -> int:
    return export_two_shards(target, as_stored(head.tensors()), cfg, out)
