"""The DeepSeek-V4-Flash draft step in torch."""
from __future__ import annotations

from .common import Rand, TorchPeer, dense_ffn, first_tokens, nbytes, rms, rope_interleaved, rope_table
from .moe import RoutedMoE


def v4_peer(c: dict, ctx: int, kmax: int, device: str, seed: int = 0, batch: int = 1,
            moe: str = "auto") -> TorchPeer:
    """DeepSeek-V4-Flash MTP step (B.2-B.5) on the hc=4 streams: e_proj/h_proj front; mHC pre/post
    (Sinkhorn) around sliding-window (ring of `window`) MQA attention with sink and grouped low-rank wo;
    sqrtsoftplus top-k MoE with clamped SwiGLU + shared expert; hc_head; norm; LM head; argmax. `batch`
    sequences step together (projections one matmul over the rows, attention batched, experts by `moe`)."""
    import torch
    import torch.nn.functional as F
    bf = torch.bfloat16
    D, V, H, hd, dr = c["hidden_size"], c["vocab_size"], c["num_attention_heads"], c["head_dim"], c["qk_rope_head_dim"]
    QL, G, R, Wn, hc = c["q_lora_rank"], c["o_groups"], c["o_lora_rank"], c["sliding_window"], c["hc_mult"]
    E, I, K, lim = c["n_routed_experts"], c["moe_intermediate_size"], c["num_experts_per_tok"], c["swiglu_limit"]
    eps, hc_eps, iters, rsf = c["rms_norm_eps"], c["hc_eps"], c["hc_sinkhorn_iters"], c["routed_scaling_factor"]
    mix, B = (2 + hc) * hc, batch
    r = Rand(device, seed)
    W = dict(embed=r(V, D, std=1.0), e_proj=r(D, D), h_proj=r(D, D), wq_a=r(QL, D), wq_b=r(H * hd, QL),
             wkv=r(hd, D), wo_a=r(G * R, H * hd // G), wo_b=r(D, G * R), gate=r(E, D), s13=r(2 * I, D),
             s2=r(D, I), head=r(V, D))
    w13, w2 = r(E, 2 * I, D), r(E, D, I)
    N = {n: r.norm(D) for n in ("enorm", "hnorm", "attn_norm", "ffn_norm", "norm")}
    N.update(q_norm=r.norm(QL), kv_norm=r.norm(hd))
    HC = {s: (r.f32(mix, hc * D, std=(hc * D) ** -0.5), r.f32(mix, std=0.5), r.f32(3, std=0.1) + 1)
          for s in ("attn", "ffn")}
    HC["head"] = (r.f32(hc, hc * D, std=(hc * D) ** -0.5), r.f32(hc, std=0.5), r.f32(1, std=0.1) + 1)
    sink, bias = r.f32(H, std=1.0), r.f32(E)
    cache = r(B, Wn, hd, std=1.0)                                               # ring: slot = pos % window
    cos, sin = rope_table(ctx + kmax, dr, c.get("rope_theta", 1e4), device)
    wo_a_t = W["wo_a"].view(G, R, H * hd // G).transpose(1, 2)                 # [G, H*hd/G, R]
    state = dict(tok=first_tokens(B, V, device), h=r(B, hc, D, std=1.0), cache=cache)

    def hc_mix(X, site):
        fn, base, sc = HC[site]
        Xf = X.float().reshape(B, hc * D)
        return F.linear(Xf, fn) * (Xf.pow(2).mean(-1, keepdim=True) + eps).rsqrt(), base, sc, X.float()

    def hc_pre(X, site):
        m, base, sc, Xf = hc_mix(X, site)
        pre = torch.sigmoid(m[:, :hc] * sc[0] + base[:hc]) + hc_eps                      # [B, hc]
        post = 2 * torch.sigmoid(m[:, hc:2 * hc] * sc[1] + base[hc:2 * hc])
        comb = (m[:, 2 * hc:] * sc[2] + base[2 * hc:]).view(B, hc, hc).softmax(-1) + hc_eps
        comb = comb / (comb.sum(1, keepdim=True) + hc_eps)
        for _ in range(iters - 1):
            comb = comb / (comb.sum(2, keepdim=True) + hc_eps)
            comb = comb / (comb.sum(1, keepdim=True) + hc_eps)
        return (pre[..., None] * Xf).sum(1).to(bf), post, comb                              # [B, D]

    def hc_post(f, X, post, comb):                                              # Y_k = post_k f + sum_j C[j,k] X_j
        return (post[..., None] * f[:, None].float() + comb.transpose(1, 2) @ X.float()).to(bf)

    def step(tok, X, pos: int):
        e = rms(W["embed"][tok], N["enorm"], eps)
        X = F.linear(rms(X, N["hnorm"], eps), W["h_proj"]) + F.linear(e, W["e_proj"])[:, None]   # [B, hc, D]
        x, post, comb = hc_pre(X, "attn")
        xn = rms(x, N["attn_norm"], eps)
        q = F.linear(rms(F.linear(xn, W["wq_a"]), N["q_norm"], eps), W["wq_b"]).view(B, H, hd)
        q = (q.float() * (q.float().pow(2).mean(-1, keepdim=True) + eps).rsqrt()).to(bf)
        kv = rms(F.linear(xn, W["wkv"]), N["kv_norm"], eps)                     # [B, hd]
        cs = (cos[pos], sin[pos])
        q = torch.cat([q[..., :-dr], rope_interleaved(q[..., -dr:], *cs)], -1)
        cache[:, pos % Wn] = torch.cat([kv[:, :-dr], rope_interleaved(kv[:, -dr:], *cs)], -1)
        rows = cache[:, :min(pos + 1, Wn)]                                      # [B, n, hd]
        s = torch.matmul(q, rows.transpose(1, 2)).float() * hd ** -0.5
        s = torch.cat([s, sink[:, None].expand(B, H, 1)], -1)
        o = torch.matmul(s.softmax(-1)[..., :-1].to(bf), rows)                 # [B, H, hd]
        o = torch.cat([o[..., :-dr], rope_interleaved(o[..., -dr:], cs[0], -cs[1])], -1)
        z = torch.bmm(o.reshape(B, G, H * hd // G).transpose(0, 1), wo_a_t)   # [G, B, R]
        X = hc_post(F.linear(z.transpose(0, 1).reshape(B, G * R), W["wo_b"]), X, post, comb)
        x, post, comb = hc_pre(X, "ffn")
        xn = rms(x, N["ffn_norm"], eps)
        sc = F.softplus(F.linear(xn, W["gate"]).float()).sqrt()                # [B, E]
        idx = (sc + bias).topk(K, -1).indices
        w = sc.gather(1, idx)
        w = w / w.sum(-1, keepdim=True) * rsf
        y = experts(xn, idx, w) + dense_ffn(xn, W["s13"], W["s2"], lim).float()
        X = hc_post(y.to(bf), X, post, comb)
        m, base, hsc, Xf = hc_mix(X, "head")
        yh = ((torch.sigmoid(m * hsc[0] + base) + hc_eps)[..., None] * Xf).sum(1).to(bf)
        logits = F.linear(rms(yh, N["norm"], eps), W["head"]).float()
        return logits.argmax(-1), X                                             # the streams are carried

    experts = RoutedMoE(w13, w2, K, B, lim, moe)
    hcb = nbytes([t for v in HC.values() for t in v])
    dense = nbytes(list(W.values()) + list(N.values()) + [sink, bias]) - nbytes([W["embed"]]) + B * 2 * D + hcb
    return TorchPeer(step, ctx, dense, experts, B * min(ctx + 1, Wn) * hd * 2, dict(W=W, N=N, HC=HC, w13=w13, w2=w2),
                     state)
