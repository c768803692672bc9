"""transformers' GlmMoeDsa decoder layer as an oracle for the GLM-5 MTP module (float64 on the CPU).

transformers drops MTP layers, so the wrapper is composed by hand around `model.model.layers[0]` of a tiny
GlmMoeDsaForCausalLM with the checkpoint's dims (first_k_dense_replace 0, so layer 0 is MoE with a full
indexer): enorm / hnorm, concat [e | h], eh_proj, the layer, shared_head.norm (the carried hidden), head.
Every step re-runs the layer over all rows held under a causal mask (the indexer needs one); only the last
row's output is used. transformers leaves the latent norms at eps 1e-6; they are set to rms_norm_eps here
(arch_math.md C.3: vLLM and SGLang use rms_norm_eps)."""
from __future__ import annotations

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from .deepseek_torch import TorchMtpWrapper

DIMS = ("hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
        "v_head_dim", "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group", "moe_intermediate_size",
        "n_shared_experts", "vocab_size", "rms_norm_eps", "routed_scaling_factor", "norm_topk_prob",
        "max_position_embeddings", "index_n_heads", "index_head_dim", "index_topk", "rope_parameters")


class TorchGlmMtp(TorchMtpWrapper):
    def __init__(self, w: dict[str, np.ndarray], cfg: dict):
        torch.manual_seed(0)
        hf = AutoConfig.for_model("glm_moe_dsa", **{k: cfg[k] for k in DIMS}, num_hidden_layers=1,
                                  first_k_dense_replace=0, intermediate_size=64,
                                  num_key_value_heads=cfg["num_attention_heads"], attn_implementation="eager",
                                  experts_implementation="eager")
        self.model = AutoModelForCausalLM.from_config(hf, dtype=torch.float64).eval()
        self.layer = self.model.model.layers[0]
        self.eps = cfg["rms_norm_eps"]
        attn = self.layer.self_attn
        attn.q_a_layernorm.variance_epsilon = attn.kv_a_layernorm.variance_epsilon = self.eps
        P = f"model.layers.{cfg['num_hidden_layers']}."
        t = {k: torch.tensor(np.asarray(v, np.float64)) for k, v in w.items()}
        E = cfg["n_routed_experts"]
        sd = {k: t[P + k] for k in self.layer.state_dict() if P + k in t}
        ex = [f"{P}mlp.experts.{e}." for e in range(E)]
        sd["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([t[x + "gate_proj.weight"], t[x + "up_proj.weight"]])
                                                      for x in ex])
        sd["mlp.experts.down_proj"] = torch.stack([t[x + "down_proj.weight"] for x in ex])
        missing = set(self.layer.state_dict()) - set(sd)
        assert not missing, f"no checkpoint tensor for {sorted(missing)}"
        self.layer.load_state_dict(sd)
        self.t, self.P = t, P
        self.rows: list[tuple[int, torch.Tensor, int]] = []

    @torch.no_grad()
    def step(self, token: int, hidden, pos: int) -> tuple[np.ndarray, np.ndarray]:
        """(logits, carried hidden = shared_head.norm output) of a draft step appended after the rows held."""
        self.write_row(token, hidden, pos)
        x = torch.stack([self._front(tk, h) for tk, h, _ in self.rows])[None]       # [1, T, D]
        T = x.shape[1]
        mask = torch.full((T, T), float("-inf"), dtype=torch.float64).triu(1)[None, None]
        pos_ids = torch.tensor([[p for _, _, p in self.rows]])
        pe = self.model.model.rotary_emb(x, pos_ids)
        g = self.layer(x, attention_mask=mask, position_ids=pos_ids, position_embeddings=pe)[0][0, -1]
        h = self._rms(g, "shared_head.norm.weight")
        return (h @ self.t["lm_head.weight"].T).numpy(), h.numpy()
