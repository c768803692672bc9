"""The tiny DeepSeek-V4 (mHC residual streams, sliding-window + compressed attention, hash and sqrtsoftplus MoE,
byte vocabulary) and its MTP module (docs/model_math.md B.3): e = enorm(embed(t)), X_j = h_proj(hnorm(H_j)) +
e_proj(e) over the target's hc streams H [hc, D] entering its hc_head, the sliding-window MoE decoder layer,
the MTP layer's own hc_head and norm, the target's head. The carried hidden is the layer's output streams.

Exported as the target through transformers (shard 1) and the MTP layer at `mtp.0.*` in the official key
names (shard 2), every tensor BF16 except the mHC parameters, sinks and the router bias (F32)."""
from __future__ import annotations

from pathlib import Path

from ..testing.hf_targets import hf_config
from ..testing.tiny.deepseek_v4 import tiny_config
from ..weights.deepseek_v4 import HC_HEAD, P
from .common import VOCAB, MtpHeadMixin, as_stored, export_two_shards
from .deepseek_v3 import one_layer

DIMS = dict(hidden_size=256, hc_mult=4, num_attention_heads=4, head_dim=64, qk_rope_head_dim=16, q_lora_rank=128,
            o_groups=2, o_lora_rank=64, sliding_window=64, n_routed_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=128, vocab_size=VOCAB, num_hidden_layers=3, rms_norm_eps=1e-6, hc_eps=1e-6,
            hc_sinkhorn_iters=20, rope_theta=10000.0, routed_scaling_factor=1.5, swiglu_limit=10.0)
CONFIG = tiny_config(**DIMS)
# transformers' layer names -> the checkpoint's, under mtp.0.
LAYER_KEYS = {"attn_hc.fn": "hc_attn_fn", "attn_hc.base": "hc_attn_base", "attn_hc.scale": "hc_attn_scale",
              "ffn_hc.fn": "hc_ffn_fn", "ffn_hc.base": "hc_ffn_base", "ffn_hc.scale": "hc_ffn_scale",
              "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
              "self_attn.q_a_proj.weight": "attn.wq_a.weight", "self_attn.q_a_norm.weight": "attn.q_norm.weight",
              "self_attn.q_b_proj.weight": "attn.wq_b.weight", "self_attn.kv_proj.weight": "attn.wkv.weight",
              "self_attn.kv_norm.weight": "attn.kv_norm.weight", "self_attn.o_a_proj.weight": "attn.wo_a.weight",
              "self_attn.o_b_proj.weight": "attn.wo_b.weight", "self_attn.sinks": "attn.attn_sink",
              "mlp.gate.weight": "ffn.gate.weight", "mlp.gate.e_score_correction_bias": "ffn.gate.bias",
              "mlp.shared_experts.gate_proj.weight": "ffn.shared_experts.w1.weight",
              "mlp.shared_experts.up_proj.weight": "ffn.shared_experts.w3.weight",
              "mlp.shared_experts.down_proj.weight": "ffn.shared_experts.w2.weight"}
F32 = ("_fn", "_base", "_scale", "attn_sink", "gate.bias")


def head_class():
    import torch

    class V4MtpHead(MtpHeadMixin, torch.nn.Module):
        def __init__(self, layer, model, target):
            super().__init__()
            c = target.config
            d = c.hidden_size
            norm = type(model.model.norm)
            self.layer, self.rotary, self.hc_head, self.norm = layer, model.model.rotary_emb, model.model.hc_head, model.model.norm
            self.enorm, self.hnorm = norm(d, c.rms_norm_eps), norm(d, c.rms_norm_eps)
            self.e_proj, self.h_proj = torch.nn.Linear(d, d, bias=False), torch.nn.Linear(d, d, bias=False)
            for lin in (self.e_proj, self.h_proj):
                torch.nn.init.normal_(lin.weight, std=c.initializer_range)
            self.window = c.sliding_window

        def front(self, target, ids, H):
            e = self.e_proj(self.enorm(target.model.embed_tokens(ids)))
            return self.h_proj(self.hnorm(H)) + e[:, :, None]

        def block(self, x, pos, mask):
            p = pos[None]
            pe = {t: self.rotary(x, p, layer_type=t) for t in ("main", "compress")}
            y = self.layer(x, position_embeddings=pe, position_ids=p, attention_mask=mask)
            return y[0] if isinstance(y, tuple) else y

        def out(self, target, Y):
            return target.lm_head(self.norm(self.hc_head(Y))), Y

        def tensors(self) -> dict:
            """The MTP layer under the checkpoint's keys (mtp.0.*, per-expert w1 / w3 / w2)."""
            sd = {}
            for k, v in self.layer.state_dict().items():
                if "compressor" in k or "indexer" in k:      # a sliding-window layer (compress ratio 0) uses neither
                    continue
                if k == "mlp.experts.gate_up_proj":
                    inter = v.shape[1] // 2
                    for e in range(v.shape[0]):
                        sd[f"{P}ffn.experts.{e}.w1.weight"], sd[f"{P}ffn.experts.{e}.w3.weight"] = v[e, :inter], v[e, inter:]
                elif k == "mlp.experts.down_proj":
                    for e in range(v.shape[0]):
                        sd[f"{P}ffn.experts.{e}.w2.weight"] = v[e]
                elif k in LAYER_KEYS:
                    sd[P + LAYER_KEYS[k]] = v
                else:
                    raise KeyError(f"transformers' DeepseekV4 layer has {k!r}, which the export does not map")
            for name, mod in (("enorm", self.enorm), ("hnorm", self.hnorm), ("norm", self.norm),
                              ("e_proj", self.e_proj), ("h_proj", self.h_proj)):
                sd[f"{P}{name}.weight"] = mod.weight
            for key, p in zip(HC_HEAD, (self.hc_head.hc_fn, self.hc_head.hc_base, self.hc_head.hc_scale)):
                sd[key] = p
            return sd

    return V4MtpHead


def build(device, cfg: dict = CONFIG):
    """(target DeepseekV4ForCausalLM, its MTP head), random weights from torch's seed."""
    from transformers import AutoModelForCausalLM
    hc = hf_config("deepseek_v4", cfg)
    target = AutoModelForCausalLM.from_config(hc, attn_implementation="eager")
    layer, model = one_layer(hc, layer_types=["sliding_attention"], mlp_layer_types=["moe"], num_hash_layers=0)
    return target.to(device), head_class()(layer, model, target).to(device)


def export(target, head, out: Path, cfg: dict = CONFIG) -> int:
    return export_two_shards(target, as_stored(head.tensors(), F32), cfg, out)
