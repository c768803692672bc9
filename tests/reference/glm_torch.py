"""transformers' GlmMoeDsa decoder layer as an oracle for the GLM-5 MTP module (float64 on the CPU).

transformers drops MTP layers, so the wrapper is composed by hand around `model.model.layers[0]` of a tiny
GlmMoeDsaForCausalLM with the checkpoint's dims (first_k_dense_replace 0, so layer 0 is MoE with a full
indexer): enorm / hnorm, concat [e | h], eh_proj, the layer, shared_head.norm (the carried hidden), head.
Every step re-runs the layer over all rows held under a causal mask (the indexer needs one); only the last
row's output is used. transformers leaves the latent norms at eps 1e-6; they are set to rms_norm_eps here
(docs/model_math.md C.3: vLLM and SGLang use rms_norm_eps)."""
from __future__ import annotations

import numpy as np
import torch

from .deepseek_torch import DIMS as V3_DIMS
from .deepseek_torch import TorchMtpWrapper

DIMS = V3_DIMS + ("index_n_heads", "index_head_dim", "index_topk", "rope_parameters")


class TorchGlmMtp(TorchMtpWrapper):
    def __init__(self, w: dict[str, np.ndarray], cfg: dict):
        self._load_layer("glm_moe_dsa", w, cfg, DIMS)
        attn = self.layer.self_attn
        attn.q_a_layernorm.variance_epsilon = attn.kv_a_layernorm.variance_epsilon = self.eps

    @torch.no_grad()
    def step(self, token: int, hidden, pos: int) -> tuple[np.ndarray, np.ndarray]:
        """(logits, carried hidden = shared_head.norm output) of a draft step appended after the rows held."""
        self.write_row(token, hidden, pos)
        h = self._rms(self._last_row(causal=True), "shared_head.norm.weight")
        return (h @ self.t["lm_head.weight"].T).numpy(), h.numpy()
