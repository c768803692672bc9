"""Independent float64 functional reference of the Qwen3-Next MTP head, written from docs/model_math.md D.

It never calls mtp_cupy kernels or twins. Weights are float64 arrays under the checkpoint's own keys
(already dequantised by the caller); the reference keeps its own list of K/V rows, one per drafter row,
so a test can mirror prefill / propose / trim on it.

    D.2  x = fc([rms1p(embed(u); pre_fc_norm_embedding), rms1p(h; pre_fc_norm_hidden)])
         x = x + Attn(rms1p(x; input_layernorm));  x = x + FFN(rms1p(x; post_attention_layernorm))
         g = rms1p(x; mtp.norm);  logits = g @ lm_head.T;  g is the hidden carried to the next draft
    D.3  q_proj rows are per-head [q_h | gate_h]; q/k (1+w) norms per head before neox RoPE on the first
         rotary_dim dims; GQA; out = (o * sigmoid(gate)) @ o_proj.T
    D.4  softmax over experts, top-k, renormalised; + sigmoid(x . shared_expert_gate) * shared_expert(x)"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from .decisions import Decisions

P = "mtp."
L = "mtp.layers.0."


def rms1p(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """Unit-offset RMSNorm over the last axis: (1 + w) * x / sqrt(mean(x^2) + eps)."""
    return (1.0 + w) * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def rope_neox(x: np.ndarray, pos: int, rot: int, theta: float) -> np.ndarray:
    """Half-split RoPE on dims [0, rot) of each head (last axis); the rest passes through."""
    inv = theta ** (-np.arange(0, rot, 2, dtype=np.float64) / rot)
    c, s = np.cos(pos * inv), np.sin(pos * inv)
    a, b = x[..., :rot // 2], x[..., rot // 2:rot]
    return np.concatenate([a * c - b * s, b * c + a * s, x[..., rot:]], axis=-1)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def swiglu(x: np.ndarray, wg: np.ndarray, wu: np.ndarray, wd: np.ndarray) -> np.ndarray:
    return (silu(x @ wg.T) * (x @ wu.T)) @ wd.T


def e4m3(x: np.ndarray, scale: float) -> np.ndarray:
    """Value an FP8 (e4m3, saturating) cache stores for x with the given scale."""
    q = np.clip(x / scale, -448.0, 448.0).astype(ml_dtypes.float8_e4m3fn)
    return q.astype(np.float64) * scale


class QwenMtpRef(Decisions):
    """One MTP decoder layer over its own K/V rows. `cfg` uses the HF config.json names. The expert selection
    is a Decision (near ties measured on the router logits, i.e. log-probability ratios)."""

    def __init__(self, w: dict[str, np.ndarray], cfg: dict, kv_fp8: bool = False, kv_scale: float = 1.0):
        Decisions.__init__(self)
        self.w = {k: np.asarray(v, dtype=np.float64) for k, v in w.items()}
        self.H, self.KV = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.hd = cfg["head_dim"]
        rp = cfg.get("rope_parameters") or {}      # transformers 5 writes these under rope_parameters
        self.rot = int(self.hd * cfg.get("partial_rotary_factor", rp.get("partial_rotary_factor", 1.0)))
        self.theta = float(cfg.get("rope_theta", rp.get("rope_theta", 10000.0)))
        self.eps = float(cfg["rms_norm_eps"])
        self.top_k, self.n_exp = cfg.get("num_experts_per_tok", 0), cfg.get("num_experts", 0)
        self.norm_topk = cfg.get("norm_topk_prob", True)
        self.kv_fp8, self.kv_scale = kv_fp8, kv_scale
        self.K: list[np.ndarray] = []   # [KV, hd] per row, RoPE applied, as the cache stores it
        self.V: list[np.ndarray] = []

    # -- pieces ----------------------------------------------------------------------------------
    def front(self, token: int, hidden: np.ndarray) -> np.ndarray:
        w, e = self.w, self.eps
        emb = rms1p(w["model.embed_tokens.weight"][token], w[P + "pre_fc_norm_embedding.weight"], e)
        hid = rms1p(np.asarray(hidden, np.float64), w[P + "pre_fc_norm_hidden.weight"], e)
        return np.concatenate([emb, hid]) @ w[P + "fc.weight"].T

    def _kv(self, xn: np.ndarray, pos: int) -> tuple[np.ndarray, np.ndarray]:
        w = self.w
        k = rms1p((xn @ w[L + "self_attn.k_proj.weight"].T).reshape(self.KV, self.hd),
                  w[L + "self_attn.k_norm.weight"], self.eps)
        k = rope_neox(k, pos, self.rot, self.theta)
        v = (xn @ w[L + "self_attn.v_proj.weight"].T).reshape(self.KV, self.hd)
        if self.kv_fp8:
            k, v = e4m3(k, self.kv_scale), e4m3(v, self.kv_scale)
        return k, v

    def attention(self, xn: np.ndarray, pos: int) -> np.ndarray:
        """Attends over every row held (causal: all earlier rows and this one's, written by step)."""
        w = self.w
        qg = (xn @ w[L + "self_attn.q_proj.weight"].T).reshape(self.H, 2 * self.hd)
        q, gate = qg[:, :self.hd], qg[:, self.hd:]
        q = rope_neox(rms1p(q, w[L + "self_attn.q_norm.weight"], self.eps), pos, self.rot, self.theta)
        K, V = np.stack(self.K), np.stack(self.V)          # [T, KV, hd]
        grp = self.H // self.KV
        o = np.empty((self.H, self.hd))
        for h in range(self.H):
            s = K[:, h // grp] @ q[h] / np.sqrt(self.hd)
            p = np.exp(s - s.max())
            o[h] = (p / p.sum()) @ V[:, h // grp]
        return (o * sigmoid(gate)).reshape(-1) @ w[L + "self_attn.o_proj.weight"].T

    def ffn(self, x: np.ndarray) -> np.ndarray:
        w, m = self.w, L + "mlp."
        if m + "gate.weight" not in w:
            return swiglu(x, w[m + "gate_proj.weight"], w[m + "up_proj.weight"], w[m + "down_proj.weight"])
        logits = w[m + "gate.weight"] @ x
        p = np.exp(logits - logits.max())
        p /= p.sum()
        idx = self.pick("experts", logits, self.top_k)
        wk = p[idx] / p[idx].sum() if self.norm_topk else p[idx]
        y = np.zeros_like(x)
        for e, we in zip(idx, wk):
            pe = f"{m}experts.{e}."
            y += we * swiglu(x, w[pe + "gate_proj.weight"], w[pe + "up_proj.weight"], w[pe + "down_proj.weight"])
        sh = m + "shared_expert."
        shared = swiglu(x, w[sh + "gate_proj.weight"], w[sh + "up_proj.weight"], w[sh + "down_proj.weight"])
        return y + sigmoid(w[m + "shared_expert_gate.weight"][0] @ x) * shared

    # -- what the drafter does -------------------------------------------------------------------
    def write_row(self, token: int, hidden: np.ndarray, pos: int) -> None:
        """Prefill / catch-up: the row's K/V only."""
        xn = rms1p(self.front(token, hidden), self.w[L + "input_layernorm.weight"], self.eps)
        k, v = self._kv(xn, pos)
        self.K.append(k)
        self.V.append(v)

    def forward(self, token: int, hidden: np.ndarray, pos: int) -> tuple[np.ndarray, np.ndarray]:
        """One draft step over the rows held (its own included): (logits over the full vocab, carried g)."""
        w, e = self.w, self.eps
        x = self.front(token, hidden)
        x = x + self.attention(rms1p(x, w[L + "input_layernorm.weight"], e), pos)
        x = x + self.ffn(rms1p(x, w[L + "post_attention_layernorm.weight"], e))
        g = rms1p(x, w[P + "norm.weight"], e)
        return w["lm_head.weight"] @ g, g

    def truncate(self, rows: int) -> None:
        del self.K[rows:], self.V[rows:]

    @property
    def rows(self) -> int:
        return len(self.K)
