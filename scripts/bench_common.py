"""Shared helpers of scripts/bench_draft.py: cold-L2 timers (CuPy events on a given stream, torch events),
the D2D copy bandwidth, freeing device memory between families, and the plain-torch bf16 peers of one MTP
draft step (DeepSeek-V3, DeepSeek-V4-Flash, Qwen3-Next, GLM-5; arch_math.md A, B, C, D).

The peers are the same step written plainly in torch: bf16 weights (no FP8/FP4), the selected experts'
weights taken by indexing a stacked [E, ...] tensor (a gather), f32 softmax/norm math, argmax on the host
never read back (the chain stays on the device, so it captures as a CUDA graph). Their numbers are not
meant to match mtp_cupy's (random weights, plain RoPE frequencies); the bytes read and the ops are the
step's. Cupy and torch are imported lazily: this module loads on a machine without either."""
from __future__ import annotations

import gc
import math
import sys
import time

import numpy as np

FLUSH_BYTES = 256 << 20          # > the 50 MB L2 of an H100/H200 (the brief asks >= 128 MB)


def median(xs):
    return float(np.median(xs)) if xs else None


# -- mtp_cupy side (cupy) ----------------------------------------------------------------------------
class CupyClock:
    """Times fn() with CUDA events recorded on `stream` and with the wall clock. Before each timed call a
    FLUSH_BYTES memset on the same stream evicts L2 (outside the event pair and outside the wall clock)."""

    def __init__(self):
        import cupy as cp
        self.cp = cp
        self.buf = cp.empty(FLUSH_BYTES, cp.uint8)
        self.e0, self.e1 = cp.cuda.Event(), cp.cuda.Event()

    def flush(self, stream, i: int) -> None:
        self.cp.cuda.runtime.memsetAsync(self.buf.data.ptr, i & 0xFF, self.buf.nbytes, stream.ptr)
        stream.synchronize()

    def time(self, fn, stream, iters: int) -> tuple[list[float], list[float]]:
        """(GPU µs per call, wall µs per call)."""
        cp, gpu, wall = self.cp, [], []
        for i in range(iters):
            self.flush(stream, i)
            t0 = time.perf_counter()
            self.e0.record(stream)
            fn()
            self.e1.record(stream)
            self.e1.synchronize()
            wall.append(1e6 * (time.perf_counter() - t0))
            gpu.append(1e3 * cp.cuda.get_elapsed_time(self.e0, self.e1))
        return gpu, wall

    def close(self) -> None:
        self.buf = None


class HostClock:
    """The NumPy device: wall clock only (there is no GPU time to measure)."""

    def time(self, fn, stream, iters: int) -> tuple[list[float], list[float]]:
        wall = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            wall.append(1e6 * (time.perf_counter() - t0))
        return [], wall

    def close(self) -> None:
        pass


def copy_bandwidth_cupy(nbytes: int = 1 << 30, reps: int = 10) -> float:
    """D2D copy bandwidth in bytes/s, bytes read + written, median of `reps` event-timed 1 GiB copies."""
    import cupy as cp
    a, b = cp.empty(nbytes, cp.uint8), cp.empty(nbytes, cp.uint8)
    a.fill(1)
    s = cp.cuda.Stream(non_blocking=False)
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    ts = []
    for i in range(reps + 1):
        e0.record(s)
        cp.cuda.runtime.memcpyAsync(b.data.ptr, a.data.ptr, nbytes, 3, s.ptr)   # 3: cudaMemcpyDeviceToDevice
        e1.record(s)
        e1.synchronize()
        if i:                                    # the first copy is a warm-up
            ts.append(cp.cuda.get_elapsed_time(e0, e1) / 1e3)
    del a, b
    free_device_memory()
    return 2 * nbytes / float(np.median(ts))


def cuda_device_name() -> str:
    import cupy as cp
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.runtime.getDevice())
    name = props["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def free_device_memory() -> None:
    """Drop unreferenced device memory of both allocators (cupy pools, torch caching allocator)."""
    gc.collect()
    cp = sys.modules.get("cupy")
    if cp is not None:
        try:
            cp.get_default_memory_pool().free_all_blocks()
            cp.get_default_pinned_memory_pool().free_all_blocks()
        except Exception:
            pass
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
        except Exception:
            pass


def cupy_used_gb() -> float | None:
    cp = sys.modules.get("cupy")
    if cp is None:
        return None
    try:
        free, total = cp.cuda.runtime.memGetInfo()
        return (total - free) / 2**30
    except Exception:
        return None


# -- torch side ----------------------------------------------------------------------------------------
def torch_status() -> tuple[bool, str]:
    """(torch has CUDA, a note)."""
    try:
        import torch
    except Exception as e:       # noqa: BLE001
        return False, f"torch not importable ({e})"
    if not torch.cuda.is_available():
        return False, f"torch {torch.__version__} has no CUDA"
    return True, f"torch {torch.__version__} (CUDA {torch.version.cuda})"


class TorchClock:
    """Cold-L2 timing of a torch callable on the current stream: CUDA events (+ wall), or wall only on CPU."""

    def __init__(self, device: str):
        import torch
        self.torch, self.cuda = torch, device.startswith("cuda")
        if self.cuda:
            self.buf = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device)
            self.e0 = torch.cuda.Event(enable_timing=True)
            self.e1 = torch.cuda.Event(enable_timing=True)

    def time(self, fn, iters: int) -> tuple[list[float], list[float]]:
        torch, gpu, wall = self.torch, [], []
        for i in range(iters):
            if self.cuda:
                self.buf.fill_(i & 0xFF)
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            if self.cuda:
                self.e0.record()
            fn()
            if self.cuda:
                self.e1.record()
                self.e1.synchronize()
                gpu.append(1e3 * self.e0.elapsed_time(self.e1))
            wall.append(1e6 * (time.perf_counter() - t0))
        return gpu, wall

    def close(self) -> None:
        self.buf = None


def torch_graph(chain, k: int):
    """chain(k) captured as a torch.cuda.CUDAGraph (warmed up on a side stream first, as torch asks)."""
    import torch
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            chain(k)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        chain(k)
    torch.cuda.synchronize()
    return g


class _Rand:
    """bf16 / f32 random tensors made on the device (no host copy)."""

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


def _rms(x, w, eps: float, unit_offset: bool = False):
    """RMSNorm over the last dim in f32, rounded once (plain w, or (1 + w) for Qwen3-Next)."""
    xf = x.float()
    y = xf * (xf.pow(2).mean(-1, keepdim=True) + eps).rsqrt()
    return (y * (w.float() + 1.0 if unit_offset else w.float())).to(x.dtype)


def _rope_table(n: int, d: int, theta: float, device: str):
    import torch
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(n, dtype=torch.float64)[:, None] * inv[None]
    return ang.cos().float().to(device), ang.sin().float().to(device)


def _rope_interleaved(x, c, s):
    """GPT-J pairs (x[2i], x[2i+1]); c, s: [d/2] f32 (pass -s for the inverse rotation)."""
    import torch
    x1, x2 = x[..., 0::2].float(), x[..., 1::2].float()
    return torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), -1).flatten(-2).to(x.dtype)


def _rope_neox(x, c, s):
    import torch
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h].float(), x[..., h:].float()
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1).to(x.dtype)


def _swiglu(gu, limit: float | None):
    import torch.nn.functional as F
    g, u = gu.float().chunk(2, -1)
    if limit:
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    return (F.silu(g) * u).to(gu.dtype)


def _routed(xn, w13, w2, w, limit: float | None = None):
    """sum_k w_k E_k(xn); w13 [K, 2I, D] and w2 [K, D, I] are the gathered experts, w [K] f32."""
    import torch
    a = _swiglu(torch.matmul(w13, xn.reshape(-1, 1))[..., 0], limit)           # [K, I]
    y = torch.matmul(w2, a[..., None])[..., 0]                                  # [K, D]
    return (y.float() * w[:, None]).sum(0, keepdim=True)                        # [1, D] f32


def _dense_ffn(xn, w13, w2, limit: float | None = None):
    import torch.nn.functional as F
    return F.linear(_swiglu(F.linear(xn, w13), limit), w2)


def _noaux_topk(z, bias, G: int, TG: int, K: int, rsf: float):
    """noaux_tc routing (A.5) of router logits z [1, E]: sigmoid, + bias for the pick only, top TG of G groups
    (by their top-2 sum), top K in those; weights = the unbiased sigmoids, normalized, * rsf. (idx, w f32)."""
    import torch
    s = z.float()[0].sigmoid()                                                  # [E]
    sb = (s + bias).view(G, -1)
    keep = sb.topk(2, -1).values.sum(-1).topk(TG).indices
    gmask = torch.full((G, 1), float("-inf"), device=s.device).index_fill_(0, keep, 0.0)
    idx = (sb + gmask).flatten().topk(K).indices
    w = s[idx]
    return idx, w / w.sum() * rsf


class TorchPeer:
    """A built peer: chain(k) runs k chained draft steps from the static inputs (token, hidden) on the device;
    bytes_per_step = bf16 weight bytes a step reads once (dense + top_k experts + embedding row) + KV bytes."""

    def __init__(self, chain, weight_bytes: int, kv_bytes: int, tensors: dict):
        self.chain, self.weight_bytes, self.kv_bytes, self.tensors = chain, weight_bytes, kv_bytes, tensors

    @property
    def bytes_per_step(self) -> int:
        return self.weight_bytes + self.kv_bytes


def _nbytes(ts) -> int:
    return int(sum(t.numel() * t.element_size() for t in ts))


def _mla_peer(c: dict, ctx: int, kmax: int, device: str, seed: int, glm: bool) -> TorchPeer:
    """The DeepSeek-V3 MTP step (A.2-A.5): [enorm(e) | hnorm(h)] -> eh_proj; MLA absorbed over a latent cache of
    ctx rows; noaux_tc group-limited top-k MoE + shared expert; shared_head.norm; LM head; argmax. With `glm`,
    GLM-5's step (C.3): plus the DSA lightning indexer (C.2): index q = wq_b(MLA q latent) [nh, hd], index
    k = LayerNorm(wk xn; w, b) into a bf16 key cache, interleaved RoPE on the first qk_rope dims of both;
    I_j = nh^-0.5 hd^-0.5 sum_h w_h relu(q_h . k_j), w = weights_proj(xn), over the rows j <= pos; MLA attends
    only the top min(index_topk, pos + 1) latent rows; the carried hidden is the post-norm one."""
    import torch
    import torch.nn.functional as F
    bf = torch.bfloat16
    D, V, H = c["hidden_size"], c["vocab_size"], c["num_attention_heads"]
    QL, C, dn, dr, dv = (c[n] for n in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                          "v_head_dim"))
    E, I, K = c["n_routed_experts"], c["moe_intermediate_size"], c["num_experts_per_tok"]
    Is = I * c.get("n_shared_experts", 1)
    G, TG, eps, rsf = c["n_group"], c["topk_group"], c["rms_norm_eps"], c["routed_scaling_factor"]
    r = _Rand(device, seed)
    W = dict(embed=r(V, D, std=1.0), eh=r(D, 2 * D), q_a=r(QL, D), q_b=r(H * (dn + dr), QL), kv_a=r(C + dr, D),
             kv_b=r(H * (dn + dv), C), o=r(D, H * dv), gate=r(E, D), s13=r(2 * Is, D), s2=r(D, Is), head=r(V, D))
    w13, w2 = r(E, 2 * I, D), r(E, D, I)             # stacked experts: [gate; up] and down
    N = {n: r.norm(D) for n in ("enorm", "hnorm", "ln1", "ln2", "final")}
    N.update(q_a=r.norm(QL), kv_a=r.norm(C))
    bias = r.f32(E)
    cache = r(ctx + kmax, C + dr, std=1.0)           # latent rows [c (C) | k_pe (dr)]
    rp = c.get("rope_parameters") or c.get("rope_scaling") or {}
    cos, sin = _rope_table(ctx + kmax, dr, rp.get("rope_theta", c.get("rope_theta", 1e4)), device)
    f = rp.get("factor", 1.0)
    m = 0.1 * math.log(f) + 1.0 if f > 1 else 1.0
    scale = (dn + dr) ** -0.5 * m * m
    wkv = W["kv_b"].view(H, dn + dv, C)
    w_uk, w_uv_t = wkv[:, :dn], wkv[:, dn:].transpose(1, 2)                     # [H, dn, C], [H, C, dv]
    io = dict(tok=torch.zeros(1, dtype=torch.long, device=device), h=r(1, D, std=1.0))
    tensors = dict(W=W, w13=w13, w2=w2, cache=cache)
    kvb = (ctx + 1) * (C + dr) * 2
    if glm:
        nh, hd, topk = c["index_n_heads"], c["index_head_dim"], c["index_topk"]
        W.update(wq_b=r(nh * hd, QL), wk=r(hd, D), wp=r(nh, D))
        N.update(k_norm=r.norm(hd), k_bias=r(hd, std=0.1))
        kcache = tensors["kcache"] = r(ctx + kmax, hd, std=1.0)     # indexer key rows [k_pe (dr) | rest]
        iscale = nh ** -0.5 * hd ** -0.5
        kvb = (ctx + 1) * hd * 2 + min(topk, ctx + 1) * (C + dr) * 2         # indexer keys + selected latents

    def select(xn, qr, cs, pos: int):
        """The latent rows MLA attends: all rows <= pos, or the indexer's top-k of them (GLM)."""
        rows = cache[:pos + 1]
        if not glm:
            return rows
        qi = F.linear(qr, W["wq_b"]).view(nh, hd)
        qi = torch.cat([_rope_interleaved(qi[:, :dr], *cs), qi[:, dr:]], -1)
        ki = F.layer_norm(F.linear(xn, W["wk"]).float(), (hd,), N["k_norm"].float(), N["k_bias"].float(), 1e-6)
        ki = ki[0].to(bf)
        kcache[pos] = torch.cat([_rope_interleaved(ki[:dr], *cs), ki[dr:]])
        wi = F.linear(xn, W["wp"]).float()                                      # [1, nh]
        score = torch.matmul(wi, torch.matmul(qi, kcache[:pos + 1].T).float().relu())[0] * iscale   # [n]
        if topk < pos + 1:                           # else every row is selected (dense MLA)
            rows = rows.index_select(0, score.topk(topk).indices)
        return rows

    def step(tok, h, pos: int):
        e = W["embed"][tok]                                                     # [1, D]
        x = F.linear(torch.cat([_rms(e, N["enorm"], eps), _rms(h, N["hnorm"], eps)], -1), W["eh"])
        xn = _rms(x, N["ln1"], eps)
        qr = _rms(F.linear(xn, W["q_a"]), N["q_a"], eps)
        q = F.linear(qr, W["q_b"]).view(H, dn + dr)
        a = F.linear(xn, W["kv_a"])[0]
        cs = (cos[pos], sin[pos])
        cache[pos, :C] = _rms(a[:C], N["kv_a"], eps)
        cache[pos, C:] = _rope_interleaved(a[C:], *cs)
        rows = select(xn, qr, cs, pos)
        q_abs = torch.bmm(q[:, None, :dn], w_uk)[:, 0]                          # [H, C]
        Q = torch.cat([q_abs, _rope_interleaved(q[:, dn:], *cs)], -1)           # [H, C + dr]
        p = (torch.matmul(Q, rows.T).float() * scale).softmax(-1).to(bf)        # [H, n]
        o = torch.bmm(torch.matmul(p, rows[:, :C])[:, None], w_uv_t)[:, 0]      # [H, dv]
        x = x + F.linear(o.reshape(1, H * dv), W["o"])
        xn = _rms(x, N["ln2"], eps)
        idx, w = _noaux_topk(F.linear(xn, W["gate"]), bias, G, TG, K, rsf)
        y = _routed(xn, w13[idx], w2[idx], w) + _dense_ffn(xn, W["s13"], W["s2"]).float()
        x = x + y.to(bf)
        g = _rms(x, N["final"], eps)
        return F.linear(g, W["head"]).float().argmax(-1), (g if glm else x)   # GLM carries post-norm, V3 pre-norm

    def chain(k: int):
        tok, h = io["tok"], io["h"]
        for i in range(k):
            tok, h = step(tok, h, ctx + i)
        return tok

    wb = _nbytes(list(W.values()) + list(N.values()) + [bias]) - _nbytes([W["embed"]]) + 2 * D \
        + K * _nbytes([w13[0], w2[0]])
    return TorchPeer(chain, wb, kvb, tensors)


def v3_peer(c: dict, ctx: int, kmax: int, device: str, seed: int = 0) -> TorchPeer:
    return _mla_peer(c, ctx, kmax, device, seed, glm=False)


def glm_peer(c: dict, ctx: int, kmax: int, device: str, seed: int = 0) -> TorchPeer:
    return _mla_peer(c, ctx, kmax, device, seed, glm=True)


def v4_peer(c: dict, ctx: int, kmax: int, device: str, seed: int = 0) -> TorchPeer:
    """DeepSeek-V4-Flash MTP step (B.2-B.5) on the hc=4 streams: e_proj/h_proj front; mHC pre/post
    (Sinkhorn) around sliding-window (ring of `window`) MQA attention with sink and grouped low-rank wo;
    sqrtsoftplus top-k MoE with clamped SwiGLU + shared expert; hc_head; norm; LM head; argmax."""
    import torch
    import torch.nn.functional as F
    bf = torch.bfloat16
    D, V, H, hd, dr = c["hidden_size"], c["vocab_size"], c["num_attention_heads"], c["head_dim"], c["qk_rope_head_dim"]
    QL, G, R, Wn, hc = c["q_lora_rank"], c["o_groups"], c["o_lora_rank"], c["sliding_window"], c["hc_mult"]
    E, I, K, lim = c["n_routed_experts"], c["moe_intermediate_size"], c["num_experts_per_tok"], c["swiglu_limit"]
    eps, hc_eps, iters, rsf = c["rms_norm_eps"], c["hc_eps"], c["hc_sinkhorn_iters"], c["routed_scaling_factor"]
    mix = (2 + hc) * hc
    r = _Rand(device, seed)
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
    cache = r(Wn, hd, std=1.0)                                                  # ring: slot = pos % window
    cos, sin = _rope_table(ctx + kmax, dr, c.get("rope_theta", 1e4), device)
    wo_a_t = W["wo_a"].view(G, R, H * hd // G).transpose(1, 2)                 # [G, H*hd/G, R]
    io = dict(tok=torch.zeros(1, dtype=torch.long, device=device), h=r(hc, D, std=1.0))

    def hc_mix(X, site):
        fn, base, sc = HC[site]
        Xf = X.float().reshape(1, hc * D)
        return F.linear(Xf, fn)[0] * (Xf.pow(2).mean() + eps).rsqrt(), base, sc, X.float()

    def hc_pre(X, site):
        m, base, sc, Xf = hc_mix(X, site)
        pre = torch.sigmoid(m[:hc] * sc[0] + base[:hc]) + hc_eps
        post = 2 * torch.sigmoid(m[hc:2 * hc] * sc[1] + base[hc:2 * hc])
        comb = (m[2 * hc:] * sc[2] + base[2 * hc:]).view(hc, hc).softmax(-1) + hc_eps
        comb = comb / (comb.sum(0, keepdim=True) + hc_eps)
        for _ in range(iters - 1):
            comb = comb / (comb.sum(1, keepdim=True) + hc_eps)
            comb = comb / (comb.sum(0, keepdim=True) + hc_eps)
        return (pre[:, None] * Xf).sum(0, keepdim=True).to(bf), post, comb

    def hc_post(f, X, post, comb):                                              # Y_k = post_k f + sum_j C[j,k] X_j
        return (post[:, None] * f.float() + comb.T @ X.float()).to(bf)

    def step(tok, X, pos: int):
        e = _rms(W["embed"][tok], N["enorm"], eps)
        X = F.linear(_rms(X, N["hnorm"], eps), W["h_proj"]) + F.linear(e, W["e_proj"])   # [hc, D]
        x, post, comb = hc_pre(X, "attn")
        xn = _rms(x, N["attn_norm"], eps)
        q = F.linear(_rms(F.linear(xn, W["wq_a"]), N["q_norm"], eps), W["wq_b"]).view(H, hd)
        q = (q.float() * (q.float().pow(2).mean(-1, keepdim=True) + eps).rsqrt()).to(bf)
        kv = _rms(F.linear(xn, W["wkv"]), N["kv_norm"], eps)[0]
        cs = (cos[pos], sin[pos])
        q = torch.cat([q[:, :-dr], _rope_interleaved(q[:, -dr:], *cs)], -1)
        cache[pos % Wn] = torch.cat([kv[:-dr], _rope_interleaved(kv[-dr:], *cs)])
        rows = cache[:min(pos + 1, Wn)]
        s = torch.cat([torch.matmul(q, rows.T).float() * hd ** -0.5, sink[:, None]], -1)
        o = torch.matmul(s.softmax(-1)[:, :-1].to(bf), rows)                   # [H, hd]
        o = torch.cat([o[:, :-dr], _rope_interleaved(o[:, -dr:], cs[0], -cs[1])], -1)
        z = torch.bmm(o.reshape(G, 1, H * hd // G), wo_a_t)                    # [G, 1, R]
        X = hc_post(F.linear(z.reshape(1, G * R), W["wo_b"]), X, post, comb)
        x, post, comb = hc_pre(X, "ffn")
        xn = _rms(x, N["ffn_norm"], eps)
        sc = F.softplus(F.linear(xn, W["gate"]).float()[0]).sqrt()
        idx = (sc + bias).topk(K).indices
        w = sc[idx]
        w = w / w.sum() * rsf
        y = _routed(xn, w13[idx], w2[idx], w, lim) + _dense_ffn(xn, W["s13"], W["s2"], lim).float()
        X = hc_post(y.to(bf), X, post, comb)
        m, base, hsc, Xf = hc_mix(X, "head")
        yh = ((torch.sigmoid(m * hsc[0] + base) + hc_eps)[:, None] * Xf).sum(0, keepdim=True).to(bf)
        logits = F.linear(_rms(yh, N["norm"], eps), W["head"]).float()
        return logits.argmax(-1), X                                             # the streams are carried

    def chain(k: int):
        tok, X = io["tok"], io["h"]
        for i in range(k):
            tok, X = step(tok, X, ctx + i)
        return tok

    hcb = _nbytes([t for v in HC.values() for t in v])
    wb = _nbytes(list(W.values()) + list(N.values()) + [sink, bias]) - _nbytes([W["embed"]]) + 2 * D + hcb \
        + K * _nbytes([w13[0], w2[0]])
    return TorchPeer(chain, wb, min(ctx + 1, Wn) * hd * 2, dict(W=W, w13=w13, w2=w2, cache=cache))


def qwen_peer(c: dict, ctx: int, kmax: int, device: str, seed: int = 0) -> TorchPeer:
    """Qwen3-Next MTP step (D.2-D.5): (1 + w) norms; fc on the concat; gated GQA attention (q_norm/k_norm,
    neox RoPE on the rotary dims, sigmoid output gate) over a K/V cache of ctx rows; softmax top-k MoE +
    sigmoid-gated shared expert; mtp.norm; LM head; argmax; the post-norm hidden is carried."""
    import torch
    import torch.nn.functional as F
    bf = torch.bfloat16
    D, V, H, KV, hd = (c[n] for n in ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads",
                                        "head_dim"))
    E, I, Is, K = c["num_experts"], c["moe_intermediate_size"], c["shared_expert_intermediate_size"], \
        c["num_experts_per_tok"]
    rd, eps = round(c["partial_rotary_factor"] * hd), c["rms_norm_eps"]
    r = _Rand(device, seed)
    W = dict(embed=r(V, D, std=1.0), fc=r(D, 2 * D), q=r(2 * H * hd, D), k=r(KV * hd, D), v=r(KV * hd, D),
             o=r(D, H * hd), router=r(E, D), sg=r(1, D), s13=r(2 * Is, D), s2=r(D, Is), head=r(V, D))
    w13, w2 = r(E, 2 * I, D), r(E, D, I)
    N = {n: r(D, std=0.1) for n in ("pre_e", "pre_h", "ln1", "ln2", "norm")}  # (1 + w) norms: w near 0
    N.update(q_norm=r(hd, std=0.1), k_norm=r(hd, std=0.1))
    Kc, Vc = r(KV, ctx + kmax, hd, std=1.0), r(KV, ctx + kmax, hd, std=1.0)
    cos, sin = _rope_table(ctx + kmax, rd, c.get("rope_theta", 1e7), device)
    io = dict(tok=torch.zeros(1, dtype=torch.long, device=device), h=r(1, D, std=1.0))

    def rope(x, cs):
        return torch.cat([_rope_neox(x[..., :rd], *cs), x[..., rd:]], -1)

    def step(tok, h, pos: int):
        e = W["embed"][tok]
        x = F.linear(torch.cat([_rms(e, N["pre_e"], eps, True), _rms(h, N["pre_h"], eps, True)], -1), W["fc"])
        xn = _rms(x, N["ln1"], eps, True)
        qg = F.linear(xn, W["q"]).view(H, 2 * hd)                               # per head [q_h | gate_h]
        cs = (cos[pos], sin[pos])
        q = rope(_rms(qg[:, :hd], N["q_norm"], eps, True), cs)
        Kc[:, pos] = rope(_rms(F.linear(xn, W["k"]).view(KV, hd), N["k_norm"], eps, True), cs)
        Vc[:, pos] = F.linear(xn, W["v"]).view(KV, hd)
        s = torch.matmul(q.view(KV, H // KV, hd), Kc[:, :pos + 1].transpose(1, 2)).float() * hd ** -0.5
        o = torch.matmul(s.softmax(-1).to(bf), Vc[:, :pos + 1])                # [KV, H/KV, hd]
        attn = o.reshape(1, H * hd) * torch.sigmoid(qg[:, hd:].reshape(1, H * hd))
        x = x + F.linear(attn, W["o"])
        xn = _rms(x, N["ln2"], eps, True)
        w, idx = F.linear(xn, W["router"]).float()[0].softmax(-1).topk(K)
        w = w / w.sum()
        y = _routed(xn, w13[idx], w2[idx], w) \
            + torch.sigmoid(F.linear(xn, W["sg"]).float()) * _dense_ffn(xn, W["s13"], W["s2"]).float()
        g = _rms(x + y.to(bf), N["norm"], eps, True)
        return F.linear(g, W["head"]).float().argmax(-1), g

    def chain(k: int):
        tok, h = io["tok"], io["h"]
        for i in range(k):
            tok, h = step(tok, h, ctx + i)
        return tok

    wb = _nbytes(list(W.values()) + list(N.values())) - _nbytes([W["embed"]]) + 2 * D + K * _nbytes([w13[0], w2[0]])
    return TorchPeer(chain, wb, (ctx + 1) * 2 * KV * hd * 2, dict(W=W, w13=w13, w2=w2, K=Kc, V=Vc))


PEERS = {"deepseek_v3": v3_peer, "deepseek_v4": v4_peer, "qwen3_next": qwen_peer, "glm5": glm_peer}
