"""Independent float64 functional reference of the DeepSeek-V4 MTP module, written from docs/model_math.md B.

It never calls mtp_cupy kernels, twins, readers or dequantisers: `load_weights` reads the stored tensors
with the references' own reader (reference/checkpoint.py), and the model keeps its own list of cache rows
(position, kv row), one per drafter row, so a test can mirror prefill / propose / trim on it.

    B.3  e = rms(Embed(u); enorm);  X_j = h_proj(rms(H_j; hnorm)) + e_proj(e)   (one hidden [D]: X_j equal)
    B.2  X = hc_post(attn(rms(x; attn_norm)), X, post, comb) with (x, post, comb) = hc_pre(X; hc_attn_*),
         then the same with hc_ffn_*, ffn_norm and the MoE;  logits = head(rms(hc_head(X); norm))
    B.4  sliding window (last `sliding_window` rows, this one included) MQA with per-head sinks; q is RMS-
         normalised per head without a weight; interleaved RoPE (plain, rope_theta) on the last
         qk_rope_head_dim dims of q and kv, inverse RoPE on the output; grouped low-rank wo_a, then wo_b
    B.5  sqrt(softplus) scores, top-k on score + bias (hash layer: tid2eid[token]), weights renormalised
         x routed_scaling_factor;
         experts and the shared expert clamp gate <= limit and |up| <= limit before silu(gate) * up"""
from __future__ import annotations

import numpy as np

from .checkpoint import read_weights
from .decisions import Decisions

P = "mtp.0."


def load_weights(path) -> tuple[dict[str, np.ndarray], dict]:
    """(float64 weights by checkpoint key (quantised projections under `<module>.weight`), config dict), read
    and dequantised by the references' own reader (FP8 e4m3 x E8M0 128x128 blocks, FP4 e2m1 low-nibble-first
    x E8M0 per 32)."""
    return read_weights(path)


def rms(x: np.ndarray, w: np.ndarray | None, eps: float) -> np.ndarray:
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y if w is None else y * w


def rope_interleaved(x: np.ndarray, pos: int, rot: int, theta: float, inverse: bool = False) -> np.ndarray:
    """GPT-J pairs (2i, 2i+1) on the LAST `rot` dims of the last axis; `inverse` rotates by -theta."""
    inv = theta ** (-np.arange(0, rot, 2, dtype=np.float64) / rot)
    c, s = np.cos(pos * inv), np.sin(pos * inv) * (-1.0 if inverse else 1.0)
    r = x[..., -rot:]
    a, b = r[..., 0::2], r[..., 1::2]
    out = np.empty_like(r)
    out[..., 0::2], out[..., 1::2] = a * c - b * s, a * s + b * c
    return np.concatenate([x[..., :-rot], out], axis=-1)


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def silu(x):
    return x * sigmoid(x)


class V4MtpRef(Decisions):
    """The MTP layer `mtp.0`; the expert selection (score + bias, top-k) is a Decision."""

    def __init__(self, w: dict[str, np.ndarray], cfg: dict):
        Decisions.__init__(self)
        self.w, self.cfg = w, cfg
        self.eps, self.hc_eps = cfg.get("rms_norm_eps", 1e-6), cfg.get("hc_eps", 1e-6)
        self.hc, self.D = cfg["hc_mult"], cfg["hidden_size"]
        self.H, self.hd, self.rot = cfg["num_attention_heads"], cfg["head_dim"], cfg.get("qk_rope_head_dim", 64)
        self.window, self.theta = cfg.get("sliding_window", 128), cfg.get("rope_theta", 10000.0)
        self.rows: list[tuple[int, np.ndarray]] = []   # (position, kv row) per drafter row

    def g(self, k: str) -> np.ndarray:
        return self.w[P + k]

    # -- B.2 mHC ------------------------------------------------------------------------------------
    def hc_pre(self, X: np.ndarray, which: str):
        hc = self.hc
        xf = X.reshape(-1)
        m = (self.g(f"hc_{which}_fn") @ xf) / np.sqrt(np.mean(xf * xf) + self.eps)
        s, b = self.g(f"hc_{which}_scale"), self.g(f"hc_{which}_base")
        pre = sigmoid(m[:hc] * s[0] + b[:hc]) + self.hc_eps
        post = 2.0 * sigmoid(m[hc:2 * hc] * s[1] + b[hc:2 * hc])
        L = (m[2 * hc:] * s[2] + b[2 * hc:]).reshape(hc, hc)
        C = np.exp(L - L.max(1, keepdims=True))
        C = C / C.sum(1, keepdims=True) + self.hc_eps
        C = C / (C.sum(0, keepdims=True) + self.hc_eps)
        for _ in range(self.cfg.get("hc_sinkhorn_iters", 20) - 1):
            C = C / (C.sum(1, keepdims=True) + self.hc_eps)
            C = C / (C.sum(0, keepdims=True) + self.hc_eps)
        return pre @ X, post, C

    @staticmethod
    def hc_post(f: np.ndarray, X: np.ndarray, post: np.ndarray, C: np.ndarray) -> np.ndarray:
        return post[:, None] * f[None, :] + C.T @ X          # Y_k = post_k f + sum_j C[j,k] X_j

    def hc_head(self, X: np.ndarray) -> np.ndarray:
        if P + "hc_head_fn" not in self.w:
            return X[0]
        xf = X.reshape(-1)
        m = (self.g("hc_head_fn") @ xf) / np.sqrt(np.mean(xf * xf) + self.eps)
        pre = sigmoid(m * self.g("hc_head_scale")[0] + self.g("hc_head_base")) + self.hc_eps
        return pre @ X

    # -- B.3 front -----------------------------------------------------------------------------------
    def streams(self, token: int, hidden: np.ndarray) -> np.ndarray:
        e = rms(self.w["embed.weight"][token], self.g("enorm.weight"), self.eps) @ self.g("e_proj.weight").T
        h = np.asarray(hidden, np.float64)
        hp = rms(h, self.g("hnorm.weight"), self.eps) @ self.g("h_proj.weight").T
        if h.ndim == 1:
            hp = np.repeat(hp[None], self.hc, axis=0)
        return hp + e[None, :]

    # -- B.4 attention --------------------------------------------------------------------------------
    def kv_of(self, xn: np.ndarray, pos: int) -> np.ndarray:
        kv = rms(xn @ self.g("attn.wkv.weight").T, self.g("attn.kv_norm.weight"), self.eps)
        return rope_interleaved(kv, pos, self.rot, self.theta)

    def attention(self, xn: np.ndarray, pos: int) -> np.ndarray:
        H, hd = self.H, self.hd
        qr = rms(xn @ self.g("attn.wq_a.weight").T, self.g("attn.q_norm.weight"), self.eps)
        q = rms((qr @ self.g("attn.wq_b.weight").T).reshape(H, hd), None, self.eps)
        q = rope_interleaved(q, pos, self.rot, self.theta)
        K = np.stack([r for _, r in self.rows[-self.window:]])             # K == V
        s = (q @ K.T) * hd ** -0.5
        M = s.max(1, keepdims=True)
        e = np.exp(s - M)
        p = e / (e.sum(1, keepdims=True) + np.exp(self.g("attn.attn_sink")[:, None] - M))
        o = rope_interleaved(p @ K, pos, self.rot, self.theta, inverse=True)
        G = self.cfg["o_groups"]
        wo_a = self.g("attn.wo_a.weight").reshape(G, -1, H * hd // G)
        z = np.einsum("grd,gd->gr", wo_a, o.reshape(G, -1)).reshape(-1)
        return z @ self.g("attn.wo_b.weight").T

    # -- B.5 MoE ----------------------------------------------------------------------------------------
    def expert(self, x: np.ndarray, pre: str) -> np.ndarray:
        lim = self.cfg.get("swiglu_limit", 0.0)
        g, u = x @ self.g(pre + "w1.weight").T, x @ self.g(pre + "w3.weight").T
        if lim > 0:
            g, u = np.minimum(g, lim), np.clip(u, -lim, lim)
        return (silu(g) * u) @ self.g(pre + "w2.weight").T

    def moe(self, x: np.ndarray, token: int) -> np.ndarray:
        z = self.g("ffn.gate.weight") @ x
        s = np.sqrt(np.logaddexp(0.0, z))
        if P + "ffn.gate.tid2eid" in self.w:                   # hash layer: experts fixed per token id
            idx = self.g("ffn.gate.tid2eid")[token].astype(int)
        else:
            idx = self.pick("experts", s + self.g("ffn.gate.bias"), self.cfg["num_experts_per_tok"])
        wts = s[idx] / s[idx].sum() * self.cfg.get("routed_scaling_factor", 1.0)
        y = sum(wt * self.expert(x, f"ffn.experts.{e}.") for e, wt in zip(idx, wts))
        return y + self.expert(x, "ffn.shared_experts.")

    # -- a whole step ------------------------------------------------------------------------------------
    def block(self, X: np.ndarray, pos: int, token: int) -> np.ndarray:
        x, post, C = self.hc_pre(X, "attn")
        X = self.hc_post(self.attention(rms(x, self.g("attn_norm.weight"), self.eps), pos), X, post, C)
        x, post, C = self.hc_pre(X, "ffn")
        return self.hc_post(self.moe(rms(x, self.g("ffn_norm.weight"), self.eps), token), X, post, C)

    def forward(self, token: int, hidden: np.ndarray, pos: int) -> tuple[np.ndarray, np.ndarray]:
        """One draft step over the rows held (its own included): (logits [vocab], output streams [hc, D] =
        carried hidden)."""
        X = self.block(self.streams(token, hidden), pos, token)
        y = rms(self.hc_head(X), self.g("norm.weight"), self.eps)
        return y @ self.w["head.weight"].T, X

    def write_row(self, token: int, hidden: np.ndarray, pos: int) -> None:
        """A prefill row: only the cache row (the path up to kv), no attention."""
        x, _, _ = self.hc_pre(self.streams(token, hidden), "attn")
        self.rows.append((pos, self.kv_of(rms(x, self.g("attn_norm.weight"), self.eps), pos)))

    def truncate(self, n: int) -> None:
        del self.rows[n:]
