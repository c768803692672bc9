"""The Qwen3-Next draft step in torch."""
from __future__ import annotations

from .common import Rand, TorchPeer, dense_ffn, first_tokens, nbytes, rms, rope_neox, rope_table
from .moe import RoutedMoE


def qwen_peer(c: dict, ctx: int, kmax: int, device: str, seed: int = 0, batch: int = 1,
              moe: str = "auto") -> TorchPeer:
    """Qwen3-Next MTP step (D.2-D.5): (1 + w) norms; fc on the concat; gated GQA attention (q_norm/k_norm,
    neox RoPE on the rotary dims, sigmoid output gate) over a K/V cache of ctx rows; softmax top-k MoE +
    sigmoid-gated shared expert; mtp.norm; LM head; argmax; the post-norm hidden is carried. `batch` sequences
    step together (projections one matmul over the rows, attention batched, experts by `moe`)."""
    import torch
    import torch.nn.functional as F
    bf = torch.bfloat16
    D, V, H, KV, hd = (c[n] for n in ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads",
                                        "head_dim"))
    E, I, Is, K = c["num_experts"], c["moe_intermediate_size"], c["shared_expert_intermediate_size"], \
        c["num_experts_per_tok"]
    rd, eps, B = round(c["partial_rotary_factor"] * hd), c["rms_norm_eps"], batch
    r = Rand(device, seed)
    W = dict(embed=r(V, D, std=1.0), fc=r(D, 2 * D), q=r(2 * H * hd, D), k=r(KV * hd, D), v=r(KV * hd, D),
             o=r(D, H * hd), router=r(E, D), sg=r(1, D), s13=r(2 * Is, D), s2=r(D, Is), head=r(V, D))
    w13, w2 = r(E, 2 * I, D), r(E, D, I)
    N = {n: r(D, std=0.1) for n in ("pre_e", "pre_h", "ln1", "ln2", "norm")}  # (1 + w) norms: w near 0
    N.update(q_norm=r(hd, std=0.1), k_norm=r(hd, std=0.1))
    Kc, Vc = r(B, KV, ctx + kmax, hd, std=1.0), r(B, KV, ctx + kmax, hd, std=1.0)
    cos, sin = rope_table(ctx + kmax, rd, c.get("rope_theta", 1e7), device)
    state = dict(tok=first_tokens(B, V, device), h=r(B, D, std=1.0), K=Kc, V=Vc)

    def rope(x, cs):
        return torch.cat([rope_neox(x[..., :rd], *cs), x[..., rd:]], -1)

    def step(tok, h, pos: int):
        e = W["embed"][tok]
        x = F.linear(torch.cat([rms(e, N["pre_e"], eps, True), rms(h, N["pre_h"], eps, True)], -1), W["fc"])
        xn = rms(x, N["ln1"], eps, True)
        qg = F.linear(xn, W["q"]).view(B, H, 2 * hd)                            # per head [q_h | gate_h]
        cs = (cos[pos], sin[pos])
        q = rope(rms(qg[..., :hd], N["q_norm"], eps, True), cs)
        Kc[:, :, pos] = rope(rms(F.linear(xn, W["k"]).view(B, KV, hd), N["k_norm"], eps, True), cs)
        Vc[:, :, pos] = F.linear(xn, W["v"]).view(B, KV, hd)
        s = torch.matmul(q.view(B, KV, H // KV, hd), Kc[:, :, :pos + 1].transpose(2, 3)).float() * hd ** -0.5
        o = torch.matmul(s.softmax(-1).to(bf), Vc[:, :, :pos + 1])             # [B, KV, H/KV, hd]
        attn = o.reshape(B, H * hd) * torch.sigmoid(qg[..., hd:].reshape(B, H * hd))
        x = x + F.linear(attn, W["o"])
        xn = rms(x, N["ln2"], eps, True)
        w, idx = F.linear(xn, W["router"]).float().softmax(-1).topk(K, -1)
        w = w / w.sum(-1, keepdim=True)
        y = experts(xn, idx, w) \
            + torch.sigmoid(F.linear(xn, W["sg"]).float()) * dense_ffn(xn, W["s13"], W["s2"]).float()
        g = rms(x + y.to(bf), N["norm"], eps, True)
        return F.linear(g, W["head"]).float().argmax(-1), g

    experts = RoutedMoE(w13, w2, K, B, path=moe)
    dense = nbytes(list(W.values()) + list(N.values())) - nbytes([W["embed"]]) + B * 2 * D
    return TorchPeer(step, ctx, dense, experts, B * (ctx + 1) * 2 * KV * hd * 2, dict(W=W, N=N, w13=w13, w2=w2),
                     state)
