"""transformers' DeepseekV3 decoder layer as an oracle for the DeepSeek-V3 MTP module (float64 on the CPU).

transformers drops MTP layers, so the wrapper is composed by hand around `model.model.layers[0]` of a tiny
DeepseekV3ForCausalLM built with the checkpoint's dims (first_k_dense_replace = 0, so layer 0 is MoE):
enorm / hnorm, concat [e | h], eh_proj, the layer, shared_head.norm, head. Every step re-runs the layer over
all rows held; only the last row's output is used, and it attends to every row, so no mask is needed.

`TorchMtpWrapper` (the hand-composed front and the layer's loading) and `fused_experts` (per-expert checkpoint
keys -> transformers' fused experts tensors) serve glm_torch.py and v3_target_torch.py too."""
from __future__ import annotations

import numpy as np
import torch

DIMS = ("hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
        "v_head_dim", "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group", "moe_intermediate_size",
        "n_shared_experts", "vocab_size", "rms_norm_eps", "routed_scaling_factor", "norm_topk_prob",
        "max_position_embeddings")


def rope_parameters(cfg: dict) -> dict:
    rs = cfg.get("rope_scaling") or {}
    rp = {"rope_type": rs.get("type", rs.get("rope_type", "default")), "rope_theta": cfg.get("rope_theta", 10000.0)}
    rp.update({k: v for k, v in rs.items() if k not in ("type", "rope_type")})
    return rp


def fused_experts(t: dict, prefix: str, n_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up_proj [E, 2I, D], down_proj [E, D, I]) as transformers holds them, from the per-expert keys
    `{prefix}{e}.{gate,up,down}_proj.weight` of a checkpoint (prefix ends in "mlp.experts.")."""
    ex = [f"{prefix}{e}." for e in range(n_experts)]
    gate_up = torch.stack([torch.cat([t[x + "gate_proj.weight"], t[x + "up_proj.weight"]]) for x in ex])
    return gate_up, torch.stack([t[x + "down_proj.weight"] for x in ex])


class TorchMtpWrapper:
    """The MTP wrapper composed by hand around a transformers decoder layer (transformers drops MTP layers):
    x = eh_proj([enorm(embed(token)), hnorm(hidden)]); subclasses call _load_layer and run it in step()."""

    def _load_layer(self, model_type: str, w: dict[str, np.ndarray], cfg: dict, dims: tuple, **hf) -> None:
        """Layer 0 of a one-layer float64 `model_type` model with the checkpoint's dims and the MTP layer's
        weights (the checkpoint's `model.layers.{num_hidden_layers}.*`)."""
        from transformers import AutoConfig, AutoModelForCausalLM
        torch.manual_seed(0)
        hf_cfg = AutoConfig.for_model(model_type, **{k: cfg[k] for k in dims}, num_hidden_layers=1,
                                      first_k_dense_replace=0, intermediate_size=64,
                                      num_key_value_heads=cfg["num_attention_heads"], attn_implementation="eager",
                                      experts_implementation="eager", **hf)
        self.model = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float64).eval()
        self.layer = self.model.model.layers[0]
        self.eps = cfg["rms_norm_eps"]
        self.P = P = f"model.layers.{cfg['num_hidden_layers']}."
        self.t = t = {k: torch.tensor(np.asarray(v, np.float64)) for k, v in w.items()}
        sd = {k: t[P + k] for k in self.layer.state_dict() if P + k in t}
        sd["mlp.experts.gate_up_proj"], sd["mlp.experts.down_proj"] = fused_experts(t, f"{P}mlp.experts.",
                                                                                    cfg["n_routed_experts"])
        missing = set(self.layer.state_dict()) - set(sd)
        assert not missing, f"no checkpoint tensor for {sorted(missing)}"
        self.layer.load_state_dict(sd)
        self.rows: list[tuple[int, torch.Tensor, int]] = []

    def _rms(self, x: torch.Tensor, key: str) -> torch.Tensor:
        return self.t[self.P + key] * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def _front(self, token: int, hidden: torch.Tensor) -> torch.Tensor:
        e = self._rms(self.t["model.embed_tokens.weight"][token], "enorm.weight")
        return torch.cat([e, self._rms(hidden, "hnorm.weight")]) @ self.t[self.P + "eh_proj.weight"].T

    def _last_row(self, causal: bool) -> torch.Tensor:
        """The layer over every row held (fronts at their positions); its output at the last row."""
        x = torch.stack([self._front(tk, h) for tk, h, _ in self.rows])[None]       # [1, T, D]
        T = x.shape[1]
        mask = torch.full((T, T), float("-inf"), dtype=torch.float64).triu(1)[None, None] if causal else None
        pos_ids = torch.tensor([[p for _, _, p in self.rows]])
        pe = self.model.model.rotary_emb(x, pos_ids)
        out = self.layer(x, attention_mask=mask, position_ids=pos_ids, position_embeddings=pe)
        return (out[0] if isinstance(out, tuple) else out)[0, -1]

    def write_row(self, token: int, hidden, pos: int) -> None:
        self.rows.append((int(token), torch.as_tensor(np.asarray(hidden, np.float64)), int(pos)))

    def truncate(self, rows: int) -> None:
        del self.rows[rows:]


class TorchDeepseekMtp(TorchMtpWrapper):
    def __init__(self, w: dict[str, np.ndarray], cfg: dict, carried_hidden: str = "post_norm"):
        self.carried_hidden = carried_hidden
        self._load_layer("deepseek_v3", w, cfg, DIMS, rope_interleave=True, rope_parameters=rope_parameters(cfg))

    @torch.no_grad()
    def step(self, token: int, hidden, pos: int) -> tuple[np.ndarray, np.ndarray]:
        """(logits, carried hidden: the shared_head.norm output, or the block output g for pre_norm) of a draft
        step appended after the rows held."""
        self.write_row(token, hidden, pos)
        g = self._last_row(causal=False)
        h = self._rms(g, "shared_head.norm.weight")
        return (h @ self.t["lm_head.weight"].T).numpy(), (g if self.carried_hidden == "pre_norm" else h).numpy()
