"""Independent float64 functional reference of the GLM-5 (`glm_moe_dsa`) MTP module, from docs/model_math.md C + A.

It never calls mtp_cupy kernels, twins or layers. It extends the DeepSeek-V3 reference (same A.2 wrapper, A.3
MLA in naive form, A.5 routing with n_group 1) with what C.2 / C.3 change:

    indexer  q = (q_a_layernorm(q_a(xn)) @ wq_b.T).view(nh, hd);  k_s = LayerNorm(xn_s @ wk.T; k_norm, eps 1e-6)
             RoPE (interleaved per indexer_rope_interleave, else neox) on q[:, :dr] and k[:dr], the MLA's freqs
             w = (xn @ weights_proj.T) * nh^-0.5;  I[s] = sum_h w_h relu(q_h . k_s) * hd^-0.5 over rows s <= t
             top-k = min(index_topk, visible), and MLA attends only those rows
    carried  the hidden after shared_head.norm (not the raw block output)
    norms    every RMSNorm (latent ones included) uses rms_norm_eps"""
from __future__ import annotations

import numpy as np

from .deepseek_ref import DeepseekMtpRef, rms, rope_gptj


def rope_neox(x: np.ndarray, pos: int, inv: np.ndarray, mag: float) -> np.ndarray:
    """Half-split pairs (x[i], x[i + d/2]) rotated by pos * inv[i]."""
    c, s = np.cos(pos * inv) * mag, np.sin(pos * inv) * mag
    h = x.shape[-1] // 2
    a, b = x[..., :h], x[..., h:]
    return np.concatenate([a * c - b * s, b * c + a * s], axis=-1)


def layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    mu = x.mean(axis=-1, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


class GlmMtpRef(DeepseekMtpRef):
    def __init__(self, w: dict[str, np.ndarray], cfg: dict):
        super().__init__(w, cfg)
        self.nh, self.hd, self.topk = cfg["index_n_heads"], cfg["index_head_dim"], cfg["index_topk"]
        self.index_rope = rope_gptj if cfg.get("indexer_rope_interleave", True) else rope_neox
        self.last_selected: list[int] = []

    def _xn(self, token: int, hidden) -> np.ndarray:
        return rms(self.front(token, hidden), self.g("input_layernorm.weight"), self.eps)

    def index_key(self, token: int, hidden, pos: int) -> np.ndarray:
        """k of one row [hd]: what the indexer cache stores."""
        xn = self._xn(token, hidden)
        k = layer_norm(xn @ self.g("self_attn.indexer.wk.weight").T, self.g("self_attn.indexer.k_norm.weight"),
                       self.g("self_attn.indexer.k_norm.bias"), 1e-6)
        k[:self.dr] = self.index_rope(k[:self.dr], pos, self.inv, self.mag)
        return k

    def select(self, xn: np.ndarray, pos: int) -> list[int]:
        """Rows (indices into self.rows, ascending) the indexer keeps for the newest row."""
        cq = rms(xn @ self.g("self_attn.q_a_proj.weight").T, self.g("self_attn.q_a_layernorm.weight"), self.eps)
        q = (cq @ self.g("self_attn.indexer.wq_b.weight").T).reshape(self.nh, self.hd)
        q[:, :self.dr] = self.index_rope(q[:, :self.dr], pos, self.inv, self.mag)
        k = np.stack([self.index_key(*r) for r in self.rows])                 # [T, hd]
        wts = (xn @ self.g("self_attn.indexer.weights_proj.weight").T) * self.nh ** -0.5
        scores = (wts @ np.maximum(q @ k.T, 0.0)) * self.hd ** -0.5           # [T]
        kk = min(self.topk, len(self.rows))     # a near tie is relative to the score spread
        return sorted(int(i) for i in self.pick("index", scores, kk, float(np.ptp(scores)) or 1.0))

    def mla(self, xn: np.ndarray, pos: int) -> np.ndarray:
        self.last_selected = self.select(xn, pos)
        held = self.rows
        self.rows = [held[i] for i in self.last_selected]
        try:
            return super().mla(xn, pos)
        finally:
            self.rows = held

    def carried(self, g: np.ndarray) -> np.ndarray:
        """The hidden after shared_head.norm (C.3). Decisions of a step: the index top-k and the routing."""
        return rms(g, self.g("shared_head.norm.weight"), self.eps)
