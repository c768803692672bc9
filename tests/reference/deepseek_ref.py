"""Independent float64 functional reference of the DeepSeek-V3 MTP module, written from docs/model_math.md A.

It never calls mtp_cupy kernels, twins or layers. Weights are float64 arrays under the checkpoint's own
keys (dequantised by the caller); attention is the NAIVE MLA form (per-head K/V expanded from the latent
with kv_b_proj), recomputed every step from the list of rows held, each kept as its input
(token, hidden, position): a drafter KV row depends only on its own input pair.

    A.2  x = eh_proj([rms(embed(u); enorm), rms(h; hnorm)]);  x += MLA(rms(x; input_layernorm));
         x += MoE(rms(x; post_attention_layernorm));  g = x;  h = rms(g; shared_head.norm);  logits = h @ head.T
         carried: h ("post_norm", the default, as vLLM / SGLang carry it) or g ("pre_norm")
    A.3  q = q_b(rms(q_a(x); q_a_layernorm)) per head [nope | rope]; a = kv_a(x); c = rms(a[:C]; kv_a_layernorm);
         k_pe = rope(a[C:]); k_nope/v = kv_b(c) per head [W_UK | W_UV]; scale = d_qk^-0.5 * m^2
    A.4  YaRN inv_freq, interleaved (GPT-J) pairs, cos/sin times mscale(f, mscale) / mscale(f, mscale_all_dim)
    A.5  sigmoid scores + correction bias for selection only; top-2-sum group scores; topk_group groups;
         top_k experts; weights = unbiased scores renormalised, times routed_scaling_factor; + shared expert

The group and expert selections are Decisions (reference/decisions.py): `candidates` runs a step under each
near-tie outcome."""
from __future__ import annotations

import math

import numpy as np

from .decisions import Decisions


def rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def swiglu(x: np.ndarray, wg: np.ndarray, wu: np.ndarray, wd: np.ndarray) -> np.ndarray:
    return (silu(x @ wg.T) * (x @ wu.T)) @ wd.T


def mscale(factor: float, m: float) -> float:
    return 0.1 * m * math.log(factor) + 1.0 if factor > 1 else 1.0


def yarn_inv_freq(d: int, base: float, rs: dict | None) -> np.ndarray:
    inv = base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    if not rs:
        return inv
    f, L0 = rs["factor"], rs["original_max_position_embeddings"]

    def corr(n):
        return d * math.log(L0 / (2 * math.pi * n)) / (2 * math.log(base))
    low, high = max(math.floor(corr(rs.get("beta_fast", 32))), 0), min(math.ceil(corr(rs.get("beta_slow", 1))), d - 1)
    ramp = np.clip((np.arange(d // 2) - low) / (high - low if high != low else 0.001), 0, 1)
    return inv * (1 - ramp) + inv / f * ramp


def rope_gptj(x: np.ndarray, pos: int, inv: np.ndarray, mag: float) -> np.ndarray:
    """Interleaved pairs (x[2i], x[2i+1]) rotated by pos * inv[i]; cos/sin scaled by `mag`."""
    c, s = np.cos(pos * inv) * mag, np.sin(pos * inv) * mag
    a, b = x[..., 0::2], x[..., 1::2]
    y = np.empty_like(x)
    y[..., 0::2], y[..., 1::2] = a * c - b * s, a * s + b * c
    return y


class DeepseekMtpRef(Decisions):
    """The MTP layer `model.layers.{num_hidden_layers}` of a DeepSeek-V3 config (HF config.json names)."""

    def __init__(self, w: dict[str, np.ndarray], cfg: dict, carried_hidden: str = "post_norm"):
        if carried_hidden not in ("pre_norm", "post_norm"):
            raise ValueError(f"carried_hidden {carried_hidden!r}: expected 'pre_norm' or 'post_norm'")
        self.carried_hidden = carried_hidden
        self.w = {k: np.asarray(v, dtype=np.float64) for k, v in w.items()}
        self.P = f"model.layers.{cfg['num_hidden_layers']}."
        self.eps = float(cfg["rms_norm_eps"])
        self.H, self.C = cfg["num_attention_heads"], cfg["kv_lora_rank"]
        self.dn, self.dr, self.dv = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
        rp = cfg.get("rope_parameters") or {}      # transformers 5 writes rope_parameters, older configs rope_scaling
        rs = cfg.get("rope_scaling") or (rp if rp.get("rope_type", "default") != "default" else None)
        self.inv = yarn_inv_freq(self.dr, float(cfg.get("rope_theta", rp.get("rope_theta", 10000.0))), rs)
        self.scale = (self.dn + self.dr) ** -0.5
        self.mag = 1.0
        if rs:
            f = rs["factor"]
            self.scale *= mscale(f, rs.get("mscale_all_dim", 0)) ** 2
            self.mag = mscale(f, rs.get("mscale", 1)) / mscale(f, rs.get("mscale_all_dim", 0))
        self.top_k, self.E = cfg["num_experts_per_tok"], cfg["n_routed_experts"]
        self.n_group, self.topk_group = cfg["n_group"], cfg["topk_group"]
        self.route_scale, self.norm_topk = cfg["routed_scaling_factor"], cfg.get("norm_topk_prob", True)
        self.rows: list[tuple[int, np.ndarray, int]] = []
        Decisions.__init__(self)

    def g(self, key: str) -> np.ndarray:
        return self.w[self.P + key]

    # -- pieces ----------------------------------------------------------------------------------
    def front(self, token: int, hidden) -> np.ndarray:
        e = rms(self.w["model.embed_tokens.weight"][token], self.g("enorm.weight"), self.eps)
        h = rms(np.asarray(hidden, np.float64), self.g("hnorm.weight"), self.eps)
        return np.concatenate([e, h]) @ self.g("eh_proj.weight").T

    def latent(self, token: int, hidden, pos: int) -> tuple[np.ndarray, np.ndarray]:
        """(c [C], k_pe [dr]) of one row: what the paged cache stores."""
        xn = rms(self.front(token, hidden), self.g("input_layernorm.weight"), self.eps)
        a = xn @ self.g("self_attn.kv_a_proj_with_mqa.weight").T
        c = rms(a[:self.C], self.g("self_attn.kv_a_layernorm.weight"), self.eps)
        return c, rope_gptj(a[self.C:], pos, self.inv, self.mag)

    def mla(self, xn: np.ndarray, pos: int) -> np.ndarray:
        H, C, dn, dr, dv = self.H, self.C, self.dn, self.dr, self.dv
        cq = rms(xn @ self.g("self_attn.q_a_proj.weight").T, self.g("self_attn.q_a_layernorm.weight"), self.eps)
        q = (cq @ self.g("self_attn.q_b_proj.weight").T).reshape(H, dn + dr)
        q_nope, q_pe = q[:, :dn], rope_gptj(q[:, dn:], pos, self.inv, self.mag)
        lat = [self.latent(*r) for r in self.rows]
        c = np.stack([a for a, _ in lat])                                   # [T, C]
        k_pe = np.stack([b for _, b in lat])                                # [T, dr]
        kvb = self.g("self_attn.kv_b_proj.weight").reshape(H, dn + dv, C)
        k_nope = np.einsum("hdc,tc->htd", kvb[:, :dn], c)                   # [H, T, dn]
        v = np.einsum("hdc,tc->htd", kvb[:, dn:], c)                        # [H, T, dv]
        s = self.scale * (np.einsum("hd,htd->ht", q_nope, k_nope) + q_pe @ k_pe.T)
        p = np.exp(s - s.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        o = np.einsum("ht,htd->hd", p, v)
        return o.reshape(-1) @ self.g("self_attn.o_proj.weight").T

    def route(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(expert ids, weights)."""
        s = 1.0 / (1.0 + np.exp(-(self.g("mlp.gate.weight") @ x)))
        sel = s + self.g("mlp.gate.e_score_correction_bias")
        grp = np.sort(sel.reshape(self.n_group, -1), axis=1)[:, -2:].sum(axis=1)
        keep = np.zeros(self.n_group, bool)
        keep[self.pick("groups", grp, self.topk_group)] = True
        masked = np.where(np.repeat(keep, self.E // self.n_group), sel, -np.inf)
        idx = self.pick("experts", masked, self.top_k)
        wk = s[idx] / s[idx].sum() if self.norm_topk else s[idx]
        return idx, wk * self.route_scale

    def moe(self, x: np.ndarray) -> np.ndarray:
        idx, wk = self.route(x)
        y = np.zeros_like(x)
        for e, we in zip(idx, wk):
            pe = f"mlp.experts.{e}."
            y += we * swiglu(x, self.g(pe + "gate_proj.weight"), self.g(pe + "up_proj.weight"), self.g(pe + "down_proj.weight"))
        sh = "mlp.shared_experts."
        return y + swiglu(x, self.g(sh + "gate_proj.weight"), self.g(sh + "up_proj.weight"), self.g(sh + "down_proj.weight"))

    # -- what the drafter does -------------------------------------------------------------------
    def write_row(self, token: int, hidden, pos: int) -> None:
        """Prefill / catch-up: hold the row (its latent is recomputed when attended)."""
        self.rows.append((int(token), np.asarray(hidden, np.float64), int(pos)))

    def carried(self, g: np.ndarray) -> np.ndarray:
        """The hidden carried to the next draft step (A.2): rms(g; shared_head.norm), or g itself for pre_norm."""
        return g if self.carried_hidden == "pre_norm" else rms(g, self.g("shared_head.norm.weight"), self.eps)

    def forward(self, token: int, hidden, pos: int) -> tuple[np.ndarray, np.ndarray]:
        """One draft step over the rows held (its own row included): (logits [vocab], carried hidden)."""
        x = self.front(token, hidden)
        x = x + self.mla(rms(x, self.g("input_layernorm.weight"), self.eps), pos)
        x = x + self.moe(rms(x, self.g("post_attention_layernorm.weight"), self.eps))
        logits = self.w["lm_head.weight"] @ rms(x, self.g("shared_head.norm.weight"), self.eps)
        return logits, self.carried(x)

    def truncate(self, rows: int) -> None:
        del self.rows[rows:]

