"""The MLA draft step in torch: DeepSeek-V3's, and GLM-5's with its DSA lightning indexer."""
from __future__ import annotations

import math

from .common import Rand, TorchPeer, dense_ffn, first_tokens, nbytes, noaux_topk, rms, rope_interleaved, rope_table
from .moe import RoutedMoE


def mla_peer(c: dict, ctx: int, kmax: int, device: str, seed: int, glm: bool, batch: int = 1,
             moe: str = "auto") -> TorchPeer:
    """The DeepSeek-V3 MTP step (A.2-A.5): [enorm(e) | hnorm(h)] -> eh_proj; MLA absorbed over a latent cache of
    ctx rows; noaux_tc group-limited top-k MoE + shared expert; shared_head.norm; LM head; argmax. With `glm`,
    GLM-5's step (C.3): plus the DSA lightning indexer (C.2): index q = wq_b(MLA q latent) [nh, hd], index
    k = LayerNorm(wk xn; w, b) into a bf16 key cache, interleaved RoPE on the first qk_rope dims of both;
    I_j = nh^-0.5 hd^-0.5 sum_h w_h relu(q_h . k_j), w = weights_proj(xn), over the rows j <= pos; MLA attends
    only the top min(index_topk, pos + 1) latent rows; the carried hidden is the post-norm one.

    `batch` sequences step together: the projections are one matmul over the B rows, attention is batched
    over the sequences (each its own cache), the routed experts run by `moe` (`moe.pick_path`)."""
    import torch
    import torch.nn.functional as F
    bf = torch.bfloat16
    D, V, H = c["hidden_size"], c["vocab_size"], c["num_attention_heads"]
    QL, C, dn, dr, dv = (c[n] for n in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                          "v_head_dim"))
    E, I, K = c["n_routed_experts"], c["moe_intermediate_size"], c["num_experts_per_tok"]
    Is = I * c.get("n_shared_experts", 1)
    G, TG, eps, rsf = c["n_group"], c["topk_group"], c["rms_norm_eps"], c["routed_scaling_factor"]
    r = Rand(device, seed)
    W = dict(embed=r(V, D, std=1.0), eh=r(D, 2 * D), q_a=r(QL, D), q_b=r(H * (dn + dr), QL), kv_a=r(C + dr, D),
             kv_b=r(H * (dn + dv), C), o=r(D, H * dv), gate=r(E, D), s13=r(2 * Is, D), s2=r(D, Is), head=r(V, D))
    w13, w2 = r(E, 2 * I, D), r(E, D, I)             # stacked experts: [gate; up] and down
    N = {n: r.norm(D) for n in ("enorm", "hnorm", "ln1", "ln2", "final")}
    N.update(q_a=r.norm(QL), kv_a=r.norm(C))
    bias = r.f32(E)
    if glm:                                          # weights before the per-sequence state (cache, hidden)
        nh, hd, topk = c["index_n_heads"], c["index_head_dim"], c["index_topk"]
        W.update(wq_b=r(nh * hd, QL), wk=r(hd, D), wp=r(nh, D))
        N.update(k_norm=r.norm(hd), k_bias=r(hd, std=0.1))
    B = batch
    cache = r(B, ctx + kmax, C + dr, std=1.0)        # latent rows [c (C) | k_pe (dr)] per sequence
    rp = c.get("rope_parameters") or c.get("rope_scaling") or {}
    cos, sin = rope_table(ctx + kmax, dr, rp.get("rope_theta", c.get("rope_theta", 1e4)), device)
    f = rp.get("factor", 1.0)
    m = 0.1 * math.log(f) + 1.0 if f > 1 else 1.0
    scale = (dn + dr) ** -0.5 * m * m
    wkv = W["kv_b"].view(H, dn + dv, C)
    w_uk, w_uv_t = wkv[:, :dn], wkv[:, dn:].transpose(1, 2)                     # [H, dn, C], [H, C, dv]
    state = dict(tok=first_tokens(B, V, device), h=r(B, D, std=1.0), cache=cache)
    kvb = (ctx + 1) * (C + dr) * 2
    if glm:
        kcache = state["kcache"] = r(B, ctx + kmax, hd, std=1.0)    # indexer key rows [k_pe (dr) | rest]
        iscale = nh ** -0.5 * hd ** -0.5
        kvb = (ctx + 1) * hd * 2 + min(topk, ctx + 1) * (C + dr) * 2         # indexer keys + selected latents

    def select(xn, qr, cs, pos: int):
        """The latent rows MLA attends [B, n, C + dr]: all rows <= pos, or the indexer's top-k of them (GLM)."""
        rows = cache[:, :pos + 1]
        if not glm:
            return rows
        qi = F.linear(qr, W["wq_b"]).view(B, nh, hd)
        qi = torch.cat([rope_interleaved(qi[..., :dr], *cs), qi[..., dr:]], -1)
        ki = F.layer_norm(F.linear(xn, W["wk"]).float(), (hd,), N["k_norm"].float(), N["k_bias"].float(), 1e-6)
        ki = ki.to(bf)
        kcache[:, pos] = torch.cat([rope_interleaved(ki[:, :dr], *cs), ki[:, dr:]], -1)
        wi = F.linear(xn, W["wp"]).float()[:, None]                             # [B, 1, nh]
        score = torch.matmul(wi, torch.matmul(qi, kcache[:, :pos + 1].transpose(1, 2)).float().relu())[:, 0]
        if topk < pos + 1:                           # else every row is selected (dense MLA)
            sel = (score * iscale).topk(topk, -1).indices                       # [B, topk]
            rows = rows.gather(1, sel[..., None].expand(-1, -1, C + dr))
        return rows

    def step(tok, h, pos: int):
        e = W["embed"][tok]                                                     # [B, D]
        x = F.linear(torch.cat([rms(e, N["enorm"], eps), rms(h, N["hnorm"], eps)], -1), W["eh"])
        xn = rms(x, N["ln1"], eps)
        qr = rms(F.linear(xn, W["q_a"]), N["q_a"], eps)
        q = F.linear(qr, W["q_b"]).view(B, H, dn + dr)
        a = F.linear(xn, W["kv_a"])
        cs = (cos[pos], sin[pos])
        cache[:, pos, :C] = rms(a[:, :C], N["kv_a"], eps)
        cache[:, pos, C:] = rope_interleaved(a[:, C:], *cs)
        rows = select(xn, qr, cs, pos)
        q_abs = torch.bmm(q[..., :dn].transpose(0, 1), w_uk).transpose(0, 1)   # [B, H, C]
        Q = torch.cat([q_abs, rope_interleaved(q[..., dn:], *cs)], -1)        # [B, H, C + dr]
        p = (torch.matmul(Q, rows.transpose(1, 2)).float() * scale).softmax(-1).to(bf)     # [B, H, n]
        o = torch.bmm(torch.matmul(p, rows[..., :C]).transpose(0, 1), w_uv_t)  # [H, B, dv]
        x = x + F.linear(o.transpose(0, 1).reshape(B, H * dv), W["o"])
        xn = rms(x, N["ln2"], eps)
        idx, w = noaux_topk(F.linear(xn, W["gate"]), bias, G, TG, K, rsf)
        y = experts(xn, idx, w) + dense_ffn(xn, W["s13"], W["s2"]).float()
        x = x + y.to(bf)
        g = rms(x, N["final"], eps)
        return F.linear(g, W["head"]).float().argmax(-1), (g if glm else x)   # GLM carries post-norm, V3 pre-norm

    experts = RoutedMoE(w13, w2, K, B, path=moe)
    dense = nbytes(list(W.values()) + list(N.values()) + [bias]) - nbytes([W["embed"]]) + B * 2 * D
    return TorchPeer(step, ctx, dense, experts, B * kvb, dict(W=W, N=N, w13=w13, w2=w2), state)
