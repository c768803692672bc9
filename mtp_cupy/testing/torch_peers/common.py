"""What the torch peers share: the built-peer record (and its k-step chain), device-side random tensors, and the
step's pieces (RMSNorm, RoPE tables and rotations, SwiGLU, one row's gathered experts, dense FFNs, batched
noaux_tc routing). torch is imported inside each function."""
from __future__ import annotations


class TorchPeer:
    """A built peer: one draft step for B sequences at once, each with its own cache, token and hidden.

    Parameters
    ----------
    step : callable
        ``step(tok, h, pos)``: one draft step of the B rows at position `pos` (ids [B], carried hidden [B, ...])
        -> (draft ids [B] on the device, carried hidden); writes each sequence's cache row `pos`.
    ctx : int
        Cache rows before the chain; step i of a chain runs at position ctx + i.
    dense_bytes : int
        bf16 weight bytes one step reads whatever the routing: the dense weights once, B embedding rows.
    moe : RoutedMoE
        The routed experts (`moe.RoutedMoE`): the path, one expert's bytes, what the newest step selected.
    kv_bytes : int
        Cache bytes one step reads, all B sequences.
    tensors : dict
        The weights (kept alive with the peer).
    state : dict
        Per-sequence tensors, leading dim B: "tok" [B], "h" [B, ...] and the caches.

    Attributes
    ----------
    out : dict
        After `chain`: "ids", every step's draft ids (device tensors [B]), and "h", the carried hidden.
    """

    def __init__(self, step, ctx: int, dense_bytes: int, moe, kv_bytes: int, tensors: dict, state: dict):
        self.step, self.ctx, self.dense_bytes, self.moe, self.kv_bytes = step, ctx, dense_bytes, moe, kv_bytes
        self.tensors, self.state, self.out = tensors, state, {}

    def chain(self, k: int):
        """Run k chained draft steps from the static token and hidden; return the last draft ids [B]."""
        tok, h, ids = self.state["tok"], self.state["h"], []
        for i in range(k):
            tok, h = self.step(tok, h, self.ctx + i)
            ids.append(tok)
        self.out = dict(ids=ids, h=h)
        return tok

    @property
    def batch(self) -> int:
        return int(self.state["tok"].shape[0])

    @property
    def moe_path(self) -> str:
        return self.moe.path

    def weight_bytes_for(self, experts: int) -> int:
        """bf16 weight bytes of one step that reads `experts` distinct routed experts."""
        return self.dense_bytes + experts * self.moe.expert_bytes

    @property
    def weight_bytes(self) -> int:
        """Weight bytes of one step with the expected distinct experts (`RoutedMoE.expected_distinct`)."""
        return self.weight_bytes_for(self.moe.expected_distinct())

    def experts_selected(self) -> int | None:
        """Distinct experts the newest step selected (read back from the device; None before a chain)."""
        return self.moe.distinct()

    @property
    def bytes_per_step(self) -> int:
        return self.weight_bytes + self.kv_bytes


def first_tokens(batch: int, vocab: int, device: str):
    """The B sequences' input tokens: 0 for the first (the batch-1 peer's), distinct ids for the rest."""
    import torch
    return (torch.arange(batch, device=device) * 7919) % vocab


class Rand:
    """bf16 / f32 random tensors made on the device (no host copy); std defaults to 1/sqrt(last dim)."""

    def __init__(self, device: str, seed: int):
        import torch
        self.torch, self.dev = torch, device
        self.gen = torch.Generator(device=device)
        self.gen.manual_seed(seed)

    def __call__(self, *shape, std: float | None = None, dtype=None):
        t = self.torch.empty(shape, dtype=dtype or self.torch.bfloat16, device=self.dev)
        return t.normal_(0.0, shape[-1] ** -0.5 if std is None else std, generator=self.gen)

    def norm(self, n: int):
        return self(n, std=0.1).add_(1.0)

    def f32(self, *shape, std: float = 0.1):
        return self(*shape, std=std, dtype=self.torch.float32)


def nbytes(ts) -> int:
    """Bytes of the tensors `ts`."""
    return int(sum(t.numel() * t.element_size() for t in ts))


def rms(x, w, eps: float, unit_offset: bool = False):
    """RMSNorm over the last dim in f32, rounded once (plain w, or (1 + w) for Qwen3-Next)."""
    xf = x.float()
    y = xf * (xf.pow(2).mean(-1, keepdim=True) + eps).rsqrt()
    return (y * (w.float() + 1.0 if unit_offset else w.float())).to(x.dtype)


def rope_table(n: int, d: int, theta: float, device: str):
    """(cos, sin) [n, d/2] f32 of positions 0..n-1, plain frequencies theta^(-2i/d)."""
    import torch
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(n, dtype=torch.float64)[:, None] * inv[None]
    return ang.cos().float().to(device), ang.sin().float().to(device)


def rope_interleaved(x, c, s):
    """GPT-J pairs (x[2i], x[2i+1]); c, s: [d/2] f32 (pass -s for the inverse rotation)."""
    import torch
    x1, x2 = x[..., 0::2].float(), x[..., 1::2].float()
    return torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), -1).flatten(-2).to(x.dtype)


def rope_neox(x, c, s):
    """NeoX halves (x[i], x[i + d/2]); c, s: [d/2] f32."""
    import torch
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h].float(), x[..., h:].float()
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1).to(x.dtype)


def swiglu(gu, limit: float | None):
    """silu(gate) * up of the [gate | up] halves, clamped at `limit` when given (V4)."""
    import torch.nn.functional as F
    g, u = gu.float().chunk(2, -1)
    if limit:
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    return (F.silu(g) * u).to(gu.dtype)


def routed(xn, w13, w2, w, limit: float | None = None):
    """sum_k w_k E_k(xn) of one row xn [1, D]; w13 [K, 2I, D] and w2 [K, D, I] are its gathered experts, w [K]
    f32. [1, D] f32."""
    import torch
    a = swiglu(torch.matmul(w13, xn.reshape(-1, 1))[..., 0], limit)           # [K, I]
    y = torch.matmul(w2, a[..., None])[..., 0]                                 # [K, D]
    return (y.float() * w[:, None]).sum(0, keepdim=True)                       # [1, D] f32


def dense_ffn(xn, w13, w2, limit: float | None = None):
    """The shared expert: w2 swiglu(w13 xn)."""
    import torch.nn.functional as F
    return F.linear(swiglu(F.linear(xn, w13), limit), w2)


def noaux_topk(z, bias, G: int, TG: int, K: int, rsf: float):
    """noaux_tc routing (A.5) of router logits z [B, E]: sigmoid, + bias for the pick only, top TG of G groups
    (by their top-2 sum), top K in those; weights = the unbiased sigmoids, normalized, * rsf. (idx, w f32) [B, K]."""
    import torch
    s = z.float().sigmoid()                                                    # [B, E]
    sb = (s + bias).view(len(s), G, -1)
    keep = sb.topk(2, -1).values.sum(-1).topk(TG, -1).indices                 # [B, TG]
    gmask = torch.full((len(s), G, 1), float("-inf"), device=s.device).scatter_(1, keep[..., None], 0.0)
    idx = (sb + gmask).flatten(1).topk(K, -1).indices
    w = s.gather(1, idx)
    return idx, w / w.sum(-1, keepdim=True) * rsf
