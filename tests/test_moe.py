"""MoE: routing rules, expert GEMVs in every weight format, the layer, EP; twins vs float64 textbook math
written here, and CUDA vs twin at real model dims (marker gpu).

Layer inputs are drawn on a grid (x in k/4, router weights in k/64) so logits are exact in fp32 and
float64 alike, and correction biases are continuous: the selected experts are then a property of the
inputs, not of rounding, and the reference may route on its own."""
import math
from types import SimpleNamespace

import numpy as np
import pytest

from mtp_cupy import ops
from mtp_cupy.errors import ConfigError, InputError, KernelError
from mtp_cupy.layers.moe import MoE, MoeConfig
from mtp_cupy.runtime.dtypes import BF16, FP8
from mtp_cupy.runtime.ptr import NULL
from mtp_cupy.weights.linear import Linear
from helpers import assert_close, bf16, f32, get, out, run_on_both, up

E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])
FORMATS = ("bf16", "fp8_row", "fp8_block", "fp8_block_e8m0", "nvfp4", "mxfp4")


# -- textbook routing (float64, sorted() with explicit tie keys) -------------------------------------
def _score(z, fn):
    z = np.asarray(z, np.float64)
    if fn == "softmax":
        e = np.exp(z - z.max())
        return e / e.sum()
    if fn == "sigmoid":
        return 1 / (1 + np.exp(-z))
    return np.sqrt(np.log1p(np.exp(z)))


def route_key(z, rule, bias=None):
    """One row's (score, selection key = score + bias), float64."""
    s = _score(z, {"softmax": "softmax", "sigmoid_grouped": "sigmoid", "sqrtsoftplus": "sqrtsoftplus"}[rule])
    return s, s + (0 if bias is None else np.asarray(bias, np.float64))


def ref_route(z, rule, top_k, bias=None, n_group=1, topk_group=1, norm=True, scale=1.0):
    """One row: (ids, weights) by the rule's textbook definition; ties go to the lower expert id."""
    s, key = route_key(z, rule, bias)
    E = len(z)
    if n_group > 1:
        gsz = E // n_group
        gscore = [sum(sorted(key[g * gsz:(g + 1) * gsz])[-2:]) for g in range(n_group)]
        kept = sorted(range(n_group), key=lambda g: (-gscore[g], g))[:topk_group]
        key = np.array([key[i] if i // gsz in kept else -np.inf for i in range(E)])
    ids = np.array(sorted(range(E), key=lambda i: (-key[i], i))[:top_k])
    return ids, route_weights(s, ids, rule, norm, scale)


def route_weights(s, ids, rule, norm=True, scale=1.0):
    """The routing weights of the experts `ids` from one row's scores s."""
    w = s[ids]
    if norm:
        w = w / (w.sum() + (1e-20 if rule == "sigmoid_grouped" else 0))
    return w * scale


def tied_inputs(rng, m, E, profiles, scale=1.0):
    """Logits [m, E] and bias [E] where each expert copies one of a few random "profiles" (its logit in
    every row and its bias): many exact ties, yet keys are equal only for equal profiles, so group sums tie
    only exactly (never as sigmoid(a) + sigmoid(-a) = 1, or as swapped bias pairs, could on a grid) and the
    tie structure is the same in fp32 and float64."""
    prof = rng.integers(0, profiles, E)
    z = (rng.standard_normal((m, profiles)) * scale).astype(np.float32)[:, prof]
    return z, (rng.standard_normal(profiles) * 0.5).astype(np.float32)[prof]


# -- weights in every format: random codes and scales, dense float64 dequant written here ------------
def host_weight(rng, fmt, n, k):
    """((weight, scale or None, scale2), dense) with dense() the float64 [n, k] dequantisation written
    here. Random codes and scales; weights of order 0.05."""
    if fmt == "bf16":
        w = bf16(rng.standard_normal((n, k)) * 0.05)
        return (w, None, 1.0), lambda: f32(w).astype(np.float64)
    if fmt.startswith("fp8"):
        # random e4m3 bytes with the top exponent bit clear: |v| in [2^-9, 1.875], log-uniform, never NaN
        codes = (rng.integers(0, 256, (n, k), dtype=np.uint8) & np.uint8(0xBF)).view(FP8)
        if fmt == "fp8_row":
            s = (rng.uniform(0.5, 1.5, n) / 8).astype(np.float32)
            full = lambda: np.repeat(s[:, None], k, 1)  # noqa: E731
        elif fmt == "fp8_block":
            s = (rng.uniform(0.5, 1.5, (-(-n // 128), -(-k // 128))) / 8).astype(np.float32)
            full = lambda: np.repeat(np.repeat(s, 128, 0), 128, 1)[:n, :k]  # noqa: E731
        else:
            s = (127 + rng.integers(-4, -1, (-(-n // 128), -(-k // 128)))).astype(np.uint8)
            full = lambda: np.repeat(np.repeat(2.0 ** (s.astype(np.float64) - 127), 128, 0), 128, 1)[:n, :k]  # noqa
        return (codes, s, 1.0), lambda: codes.astype(np.float64) * full()
    codes = rng.integers(0, 16, (n, k)).astype(np.uint8)
    packed = (codes[:, 0::2] | codes[:, 1::2] << 4).astype(np.uint8)
    if fmt == "nvfp4":
        sb = rng.integers(0x28, 0x48, (n, k // 16)).astype(np.uint8)  # e4m3 0.125 .. 2
        s2 = float(np.float32(rng.uniform(0.01, 0.03)))
        bs = sb.view(FP8).astype(np.float64)
        return (packed, sb, s2), lambda: E2M1[codes] * np.repeat(bs, 16, 1) * s2
    sb = (127 + rng.integers(-6, -3, (n, k // 32))).astype(np.uint8)
    return (packed, sb, 1.0), lambda: E2M1[codes] * np.repeat(2.0 ** (sb.astype(np.float64) - 127), 32, 1)


def upload_weight(dev, fmt, n, k, arrays):
    w, s, s2 = arrays
    wb = up(dev, w)
    sb = up(dev, s) if s is not None else None
    return Linear(fmt, n, k, wb.ptr, sb.ptr if sb else NULL, s2, owners=[wb, sb])


def grid_x(rng, m, D):
    return bf16(rng.integers(-4, 5, (m, D)) / 4)


# -- reference MoE (float64) -----------------------------------------------------------------------
def swiglu(g, u, limit):
    if limit > 0:
        g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
    return g / (1 + np.exp(-g)) * u


def ref_moe(x, router, experts, cfg, bias=None, shared=None, shared_gate=None, tok=None, tid2eid=None,
            only=None):
    """x [m, D] f64; experts: id -> dense (g, u, d); only: expert ids whose contributions count."""
    out = np.zeros((x.shape[0], cfg.hidden))
    for r, xr in enumerate(x):
        z = router @ xr
        if cfg.routing == "hash":
            ids = tid2eid[tok[r]]
            s = _score(z, cfg.hash_score)[ids]
            w = s / s.sum() * cfg.routed_scaling if cfg.norm_topk_prob else s * cfg.routed_scaling
        else:
            ids, w = ref_route(z, cfg.routing, cfg.top_k, bias, cfg.n_group, cfg.topk_group, cfg.norm_topk_prob,
                               cfg.routed_scaling)
        for e, we in zip(ids, w):
            if e in experts and (only is None or e in only):
                g, u, d = experts[e]
                out[r] += we * (d @ swiglu(g @ xr, u @ xr, cfg.swiglu_limit))
        if shared is not None:
            g, u, d = shared
            gate = 1.0 if shared_gate is None else 1 / (1 + np.exp(-(shared_gate @ xr)[0]))
            out[r] += gate * (d @ swiglu(g @ xr, u @ xr, cfg.swiglu_limit))
    return out


class Built:
    """Host weights for a MoE config and their upload to a device. `pool` > 0 makes that many distinct
    weight sets stand in for all experts (the pointer tables alias them)."""

    def __init__(self, rng, cfg, fmt, shared_inter=0, shared_gate=False, pool=0, bias=False,
                 hash_vocab=0):
        E, D, I = cfg.n_experts, cfg.hidden, cfg.inter
        self.cfg, self.fmt = cfg, fmt
        self.shapes = ((I, D), (I, D), (D, I))
        self.shared_shapes = ((shared_inter, D), (shared_inter, D), (D, shared_inter))
        self.router = (rng.integers(-4, 5, (E, D)) / 64).astype(np.float32).astype(BF16)
        sets = [tuple(host_weight(rng, fmt, *sh) for sh in self.shapes) for _ in range(pool or E)]
        self.experts = {e: sets[e % len(sets)] for e in range(E)}
        self.shared = tuple(host_weight(rng, fmt, *sh) for sh in self.shared_shapes) if shared_inter else None
        self.shared_gate = bf16(rng.standard_normal((1, D)) * 0.05) if shared_gate else None
        self.bias = (rng.standard_normal(E) * 0.1).astype(np.float32) if bias else None
        self.tid2eid = None
        if hash_vocab:
            self.tid2eid = np.stack([rng.permutation(E)[:cfg.top_k] for _ in range(hash_vocab)]).astype(np.int32)

    def _upload(self, dev, shapes, tri):
        return tuple(upload_weight(dev, self.fmt, *sh, hw[0]) for sh, hw in zip(shapes, tri))

    def build(self, dev, only=None, **layer):
        """The MoE on `dev` with the experts in `only` (all when None) local; `layer`: MoE keywords (max_rows,
        invariant, expert_kernels)."""
        c, D = self.cfg, self.cfg.hidden
        sets, experts = {}, {}
        for e, tri in self.experts.items():
            if only is None or e in only:
                if id(tri) not in sets:
                    sets[id(tri)] = self._upload(dev, self.shapes, tri)
                experts[e] = sets[id(tri)]
        rb = up(dev, self.router)
        kw = dict(router=Linear("bf16", c.n_experts, D, rb.ptr, owners=[rb]))
        if self.shared:
            kw["shared"] = self._upload(dev, self.shared_shapes, self.shared)
        if self.shared_gate is not None:
            gb = up(dev, self.shared_gate)
            kw["shared_gate"] = Linear("bf16", 1, D, gb.ptr, owners=[gb])
        keep = []
        if self.bias is not None:
            keep.append(up(dev, self.bias))
            kw["bias"] = keep[-1].ptr
        if self.tid2eid is not None:
            keep.append(up(dev, self.tid2eid))
            kw.update(tid2eid=keep[-1].ptr, vocab=self.tid2eid.shape[0])
        moe = MoE(dev, c, experts=experts, **kw, **layer)
        moe.test_buffers = keep  # the bias / table buffers live as long as the layer
        return moe

    def reference(self, x, tok=None, only=None):
        sets = {id(t): t for t in self.experts.values()}
        dense_sets = {k: tuple(hw[1]() for hw in t) for k, t in sets.items()}
        dense = {e: dense_sets[id(t)] for e, t in self.experts.items()}
        shared = tuple(hw[1]() for hw in self.shared) if self.shared else None
        sg = f32(self.shared_gate).astype(np.float64) if self.shared_gate is not None else None
        return ref_moe(f32(x).astype(np.float64), f32(self.router).astype(np.float64), dense, self.cfg,
                       self.bias, shared, sg, tok, self.tid2eid, only)


def forward(dev, moe, x, m, tok=None, add_shared=True):
    xb = up(dev, x)
    o = out(dev, "bf16", (m, moe.cfg.hidden))
    tb = up(dev, np.asarray(tok, np.int32)) if tok is not None else None
    moe.forward(xb.ptr, o.ptr, m, token_ids=tb.ptr if tb else NULL, add_shared=add_shared)
    return f32(get(dev, o, "bf16", (m, moe.cfg.hidden)))


# -- routing ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("rule,E,top_k,n_group,topk_group", [
    ("softmax", 64, 10, 1, 1), ("sigmoid_grouped", 64, 8, 8, 4), ("sigmoid_grouped", 48, 6, 1, 1),
    ("sigmoid_grouped", 16, 6, 8, 2),  # fewer unmasked experts than top_k: masked ones by lower id
    ("sqrtsoftplus", 64, 6, 1, 1)])
@pytest.mark.parametrize("norm,ties", [(True, True), (False, True), (True, False)])
def test_routing(dev, rng, rule, E, top_k, n_group, topk_group, norm, ties):
    m = 7
    if ties:
        z, bias = tied_inputs(rng, m, E, 6)
    else:
        z, bias = rng.standard_normal((m, E)).astype(np.float32), (rng.standard_normal(E) * 0.5).astype(np.float32)
    bias = None if rule == "softmax" else bias
    scale = 2.5 if rule != "softmax" else 1.0
    zb, ids, w = up(dev, z), out(dev, "i32", (m, top_k)), out(dev, "f32", (m, top_k))
    if rule == "softmax":
        ops.moe_topk_softmax(dev, zb.ptr, ids.ptr, w.ptr, m, E, top_k, norm, scale)
    else:
        bb = up(dev, bias)
        if rule == "sigmoid_grouped":
            ops.moe_topk_sigmoid_grouped(dev, zb.ptr, bb.ptr, ids.ptr, w.ptr, m, E, top_k, n_group, topk_group,
                                         norm, scale)
        else:
            ops.moe_topk_sqrtsoftplus(dev, zb.ptr, bb.ptr, ids.ptr, w.ptr, m, E, top_k, norm, scale)
    got_ids, got_w = get(dev, ids, "i32", (m, top_k)), get(dev, w, "f32", (m, top_k))
    for r in range(m):
        rid, rw = ref_route(z[r], rule, top_k, bias, n_group, topk_group, norm, scale)
        if got_ids[r].tolist() != rid.tolist():
            # a near-tie (keys closer than the kernel's fp32 resolves) may go either way: then the picks must be
            # distinct, carry the reference's keys position by position, and weigh what those experts weigh
            sc, key = route_key(z[r], rule, bias)
            g = got_ids[r]
            assert len(set(g.tolist())) == top_k and np.allclose(key[g], key[rid], rtol=1e-6, atol=0), \
                (r, g, rid, key[g], key[rid])
            rw = route_weights(sc, g, rule, norm, scale)
        assert_close(got_w[r], rw, 1e-6, f"row {r} weights")


def test_routing_no_bias_and_nan(dev, rng):
    """NULL bias is no bias; a NaN logit is never chosen over a finite one."""
    m, E, top_k = 3, 32, 4
    z = rng.standard_normal((m, E)).astype(np.float32)
    z[:, 5] = np.nan
    zb, ids, w = up(dev, z), out(dev, "i32", (m, top_k)), out(dev, "f32", (m, top_k))
    ops.moe_topk_sigmoid_grouped(dev, zb.ptr, NULL, ids.ptr, w.ptr, m, E, top_k, 4, 2, True, 1.0)
    got = get(dev, ids, "i32", (m, top_k))
    for r in range(m):
        zr = np.where(np.isnan(z[r]), -np.inf, z[r])
        assert got[r].tolist() == ref_route(zr, "sigmoid_grouped", top_k, None, 4, 2)[0].tolist()
    assert np.isfinite(get(dev, w, "f32", (m, top_k))).all()


@pytest.mark.parametrize("score", ["sqrtsoftplus", "sigmoid", "softmax"])
def test_hash_routing(dev, rng, score):
    m, E, top_k, vocab, stride = 5, 64, 6, 50, 8
    z = rng.standard_normal((m, E)).astype(np.float32)
    table = np.stack([rng.permutation(E)[:top_k] for _ in range(vocab)]).astype(np.int32)
    toks = rng.integers(0, vocab, m)
    toks[3] = vocab + 7  # out of range: selects nothing
    slab = np.zeros((m, stride // 4), np.int32)
    slab[:, 0] = toks
    zb, tb, tab = up(dev, z), up(dev, slab), up(dev, table)
    ids, w = out(dev, "i32", (m, top_k)), out(dev, "f32", (m, top_k))
    ops.moe_topk_hash(dev, zb.ptr, tb.ptr, stride, tab.ptr, vocab, ids.ptr, w.ptr, m, E, top_k, score, True, 1.5)
    got_ids, got_w = get(dev, ids, "i32", (m, top_k)), get(dev, w, "f32", (m, top_k))
    for r in range(m):
        if r == 3:
            assert (got_ids[r] == -1).all() and (got_w[r] == 0).all()
            continue
        s = _score(z[r], score)[table[toks[r]]]
        assert got_ids[r].tolist() == table[toks[r]].tolist()
        assert_close(got_w[r], s / s.sum() * 1.5, 1e-6)


# -- expert GEMVs ----------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS + ("f32",))
def test_moe_gemv_formats(dev, rng, fmt):
    """y[q] = W[ids[q]] x_q over pairs with repeated experts (one pass per expert), an absent expert (NULL
    entry), an out-of-range id, an N tail, and several K chunks per lane."""
    n_experts, m, n_slots, N, K = 5, 3, 3, 136, 2048 if fmt != "f32" else 256
    host = [host_weight(rng, "bf16" if fmt == "f32" else fmt, N, K) for _ in range(n_experts)]
    if fmt == "f32":  # an f32 router weight: Linear has no f32 format, the table takes any such object
        host = [((f32(a[0]), None, 1.0), d) for a, d in host]
    keep = [up(dev, a[0]) for a, _ in host] if fmt == "f32" else []
    lins = [(SimpleNamespace(fmt=fmt, weight=keep[e].ptr, scale=NULL, scale2=1.0) if fmt == "f32" else
             upload_weight(dev, fmt, N, K, a)) if e != 3 else None for e, (a, _) in enumerate(host)]
    tab = up(dev, ops.expert_table(lins))
    ids = np.array([[0, 2, 3], [2, 1, 0], [4, 9, 2]], np.int32)
    x = bf16(rng.standard_normal((m, n_slots, K)))
    xb, ib, y = up(dev, x), up(dev, ids), out(dev, "f32", (m * n_slots, N))
    ops.moe_gemv(dev, tab.ptr, fmt, ib.ptr, m * n_slots, n_slots, n_experts, xb.ptr, n_slots * K, K, y.ptr, N, K)
    got = get(dev, y, "f32", (m * n_slots, N))
    for q, e in enumerate(ids.ravel()):
        ref = np.zeros(N) if e in (3, 9) else host[e][1]() @ f32(x.reshape(-1, K)[q]).astype(np.float64)
        if e in (3, 9):
            assert np.array_equal(got[q], ref), (q, e)
        else:
            assert_close(got[q], ref, 1e-5, f"pair {q} expert {e}")


@pytest.mark.parametrize("limit", [0.0, 0.5])
def test_moe_gate_up(dev, rng, limit):
    n_experts, m, N, K = 4, 2, 24, 256
    host = [[host_weight(rng, "fp8_block", N, K) for _ in range(2)] for _ in range(n_experts)]
    lins = [[upload_weight(dev, "fp8_block", N, K, h[j][0]) for h in host] for j in range(2)]  # kept alive
    tabs = [up(dev, ops.expert_table(lj)) for lj in lins]
    ids = np.array([[1, 3], [3, 0]], np.int32)
    x = bf16(rng.standard_normal((m, K)) * 4)
    xb, ib, h = up(dev, x), up(dev, ids), out(dev, "bf16", (m * 2, N))
    ops.moe_gate_up(dev, tabs[0].ptr, tabs[1].ptr, "fp8_block", ib.ptr, m * 2, 2, n_experts, xb.ptr, K, 0, h.ptr, N,
                    K, limit)
    got = f32(get(dev, h, "bf16", (m * 2, N)))
    for q, e in enumerate(ids.ravel()):
        xr = f32(x[q // 2]).astype(np.float64)
        ref = swiglu(host[e][0][1]() @ xr, host[e][1][1]() @ xr, limit)
        assert_close(got[q], ref, 1e-2, f"pair {q}")
        if limit:
            assert np.abs(got[q]).max() <= limit * limit + 1e-6


def test_weighted_sum(dev, rng):
    m, K, D = 3, 4, 96
    y, w, ys, g = (rng.standard_normal(s).astype(np.float32) for s in ((m, K, D), (m, K), (m, D), (m,)))
    yb, wb, ysb, gb = up(dev, y), up(dev, w), up(dev, ys), up(dev, g)
    for shared, gate in ((NULL, NULL), (ysb.ptr, NULL), (ysb.ptr, gb.ptr)):
        o = out(dev, "bf16", (m, D))
        ops.moe_weighted_sum(dev, yb.ptr, wb.ptr, K, o.ptr, m, D, shared, gate)
        ref = np.einsum("rk,rkd->rd", w.astype(np.float64), y)
        if shared:
            ref += (1 / (1 + np.exp(-g.astype(np.float64))) if gate else np.ones(m))[:, None] * ys
        assert_close(f32(get(dev, o, "bf16", (m, D))), ref, 1e-2)


# -- the layer -------------------------------------------------------------------------------------
LAYER_CASES = {
    "deepseek_v3": dict(cfg=dict(n_experts=32, top_k=8, routing="sigmoid_grouped", n_group=8, topk_group=4,
                                 routed_scaling=2.5), shared_inter=64, bias=True),
    "glm5": dict(cfg=dict(n_experts=32, top_k=8, routing="sigmoid_grouped", routed_scaling=2.5), shared_inter=64,
                 bias=True),
    "deepseek_v4": dict(cfg=dict(n_experts=32, top_k=6, routing="sqrtsoftplus", routed_scaling=1.5,
                                 swiglu_limit=0.25), shared_inter=64, bias=True),
    "v4_hash": dict(cfg=dict(n_experts=32, top_k=6, routing="hash", routed_scaling=1.5, swiglu_limit=0.25),
                    shared_inter=64, hash_vocab=40),
    "qwen3_next": dict(cfg=dict(n_experts=48, top_k=10, routing="softmax"), shared_inter=32, shared_gate=True),
}


def _built(rng, case, fmt, D=256, I=128, **kw):
    c = LAYER_CASES[case]
    cfg = MoeConfig(hidden=D, inter=I, **c["cfg"])
    opts = {k: v for k, v in c.items() if k != "cfg"}
    opts.update(kw)
    return Built(rng, cfg, fmt, **opts)


# every routing on bf16; every format on a grouped-sigmoid and a softmax layer
@pytest.mark.parametrize("case,fmt", [(c, "bf16") for c in LAYER_CASES] +
                         [(c, f) for c in ("deepseek_v3", "qwen3_next") for f in FORMATS[1:]])
def test_moe_layer(dev, rng, case, fmt):
    b = _built(rng, case, fmt)
    m = 3
    x = grid_x(rng, m, b.cfg.hidden)
    tok = rng.integers(0, 40, m) if case == "v4_hash" else None
    got = forward(dev, b.build(dev), x, m, tok)
    assert_close(got, b.reference(x, tok), 1e-2, f"{case} {fmt}")


def test_moe_shared_expert_branch(rng):
    """What needs only x runs on a branch beside the router and the routed experts: first the routed gate/up's f16 x
    (fp8 and MXFP4 experts), which that GEMM alone waits for (a mark), then the shared expert's own launches (an
    unfused one: V4's FP8 beside MXFP4 experts) and its gate, joined right before the weighted sum. bf16 experts
    with a fused shared expert and no gate take no branch. The outputs stay the reference's."""
    from helpers import BranchLog, branch_sites, launches, mark_sites
    for fmt, shared_inter, gate, fused in (("fp8_block", 64, False, False), ("fp8_block", 64, True, False),
                                           ("fp8_block", 128, False, True), ("bf16", 128, False, True)):
        b = _built(rng, "deepseek_v3", fmt, shared_inter=shared_inter, shared_gate=gate)
        dev = BranchLog()
        moe = b.build(dev)
        assert moe.fuse_shared == fused
        x = grid_x(rng, 3, b.cfg.hidden)
        dev.log.clear()
        got = forward(dev, moe, x, 3)
        assert_close(got, b.reference(x), 1e-2, f"{fmt} shared {shared_inter} gate {gate}")
        sites, marks, main = branch_sites(dev.log), mark_sites(dev.log), launches(dev.log, side=False)
        assert main[0].startswith("dense_gemv") and "moe_route_plan" in main, main   # the router on main
        if fmt == "bf16":
            assert sites == [] and marks == [], (sites, marks)
            continue
        (side, reader), = sites
        assert reader == "moe_weighted_sum", (reader, dev.log)
        assert marks == [(["moe_stage_f16"], f"moe_gate_up_mma8_{fmt}")], marks   # x staged first, gate/up waits
        assert main.index("moe_route_plan") < main.index(f"moe_gate_up_mma8_{fmt}")
        assert main.count("moe_stage_f16") == 1, main   # down's h stays on main, after gate/up
        shared = [n for n in side if n.startswith(("moe_gate_up", "moe_gemv"))]
        assert len(shared) == (0 if fused else 2) and all(n.startswith("moe_") for n in side[:len(side) - gate]), side
        assert not gate or side[-1].startswith("dense_gemv"), side    # the gate's GEMV


def test_moe_shared_expert_items_by_width(rng):
    """An unfused shared expert (one weight, no plan) takes 8-row items up to m = 32 and 32-row items past it,
    the rule the grouped GEMVs use (ops.item_rows); either way each row gets the reference's result."""
    from helpers import BranchLog
    b = _built(rng, "deepseek_v3", "fp8_block", shared_inter=64)
    dev = BranchLog()
    moe = b.build(dev, max_rows=40)
    assert not moe.fuse_shared
    for m, kernels in ((1, "mma8"), (9, "mma8"), (32, "mma8"), (33, "mma")):
        x = grid_x(rng, m, b.cfg.hidden)
        dev.log.clear()
        got = forward(dev, moe, x, m)
        side = [n for n, s in dev.log if s and n.startswith(("moe_gate_up", "moe_gemv"))]
        assert side == [f"moe_gate_up_{kernels}_fp8_block", f"moe_gemv_{kernels}_fp8_block"], (m, side)
        assert_close(got, b.reference(x), 1e-2, f"m {m}")


def test_moe_layer_batch_shares_experts(dev, rng):
    """m = 20 rows over 8 experts: every expert serves several rows; each row still gets its own result."""
    b = Built(rng, MoeConfig(n_experts=8, top_k=4, hidden=256, inter=128), "nvfp4", shared_inter=32,
              shared_gate=True)
    x = grid_x(rng, 20, 256)
    assert_close(forward(dev, b.build(dev), x, 20), b.reference(x), 1e-2)


def test_moe_expert_parallel(dev, rng):
    """Half the experts on each of two ranks: each rank's output is the full result minus the other half's
    contributions, and the two (shared expert on one only) sum to the full result."""
    b = _built(rng, "deepseek_v3", "fp8_block")
    m = 4
    x = grid_x(rng, m, b.cfg.hidden)
    even = {e for e in range(b.cfg.n_experts) if e % 2 == 0}
    odd = set(range(b.cfg.n_experts)) - even
    full = forward(dev, b.build(dev), x, m)
    part_even = forward(dev, b.build(dev, only=even), x, m)
    part_odd = forward(dev, b.build(dev, only=odd), x, m, add_shared=False)
    assert_close(part_even, b.reference(x, only=even), 1e-2, "even half + shared")
    routed_odd = b.reference(x, only=odd) - b.reference(x, only=set())  # odd experts without the shared one
    assert_close(part_even, b.reference(x) - routed_odd, 1e-2, "full minus the other half")
    assert_close(part_odd, routed_odd, 1e-2, "odd half alone")
    assert_close(part_even + part_odd, full, 1e-2, "halves sum to the full result")


def test_moe_layer_errors(ref, rng):
    b = _built(rng, "qwen3_next", "bf16")
    moe = b.build(ref)
    x = up(ref, grid_x(rng, 1, 256))
    o = out(ref, "bf16", (1, 256))
    with pytest.raises(InputError):
        moe.forward(x.ptr, o.ptr, m=33)
    with pytest.raises(ConfigError):
        MoeConfig(n_experts=8, top_k=2, hidden=64, inter=32, routing="topk")
    with pytest.raises(ConfigError):
        MoE(ref, moe.cfg, moe.router, {0: moe.experts[0], 1: (moe.experts[1][2],) * 3})
    with pytest.raises(KernelError):
        ops.moe_gemv(ref, moe.tab_down, "nvfp4", moe.ids, 1, 1, 48, x.ptr, 0, 0, o.ptr, 256, 48)
    hb = _built(rng, "v4_hash", "bf16").build(ref)
    with pytest.raises(InputError):
        hb.forward(x.ptr, o.ptr)


def test_weight_bytes_per_step(ref, rng):
    b = _built(rng, "deepseek_v3", "fp8_block")
    moe = b.build(ref)
    D, I, E = 256, 128, 32
    expert = 3 * (D * I + 4 * 2 * 1)  # fp8 codes + the f32 block scales of [128, 256] / [256, 128]
    shared = 3 * (D * 64 + 4 * 2)
    assert moe.weight_bytes_per_step() == 2 * E * D + 8 * expert + shared
    assert moe.weight_bytes_per_step(m=8) == 2 * E * D + E * expert + shared


# -- the routing plan and the grouped tensor-core GEMMs (cuda_src/moe_mma.cu) ---------------------------------
def ref_plan(ids, local, E, rows=32):
    """(items [(expert, first, pairs)], pair ids in plan order, none_start) by definition: this rank's experts
    by id, each one's pairs in pair order cut into runs of `rows`, then the pairs of no local expert."""
    key = [e if 0 <= e < E and local[e] else E for e in ids]
    order = sorted(range(len(ids)), key=lambda q: (key[q], q))
    items, pos = [], 0
    for e in range(E):
        c = key.count(e)
        items += [(e, pos + j, min(rows, c - j)) for j in range(0, c, rows)]
        pos += c
    return items, order, pos


def read_plan(dev, buf, n_pairs, E):
    """(header [4], items [(expert, first, pairs)], sorted pair ids) of a plan buffer."""
    hdr = dev.read(buf.ptr, np.uint32, 4).tolist()
    words = dev.read(buf.ptr.offset(16), np.uint32, (max(hdr[0], 1), 2))[:hdr[0]].tolist()
    srt = dev.read(buf.ptr.offset(4 * hdr[2]), np.uint32, n_pairs).tolist()
    return hdr, [(e, v >> 8, v & 0xFF) for e, v in words], srt


def skewed_ids(rng, m, top_k, E, hot=(), p_hot=0.0):
    """ids [m, top_k]: each row's top_k distinct experts, drawn with `hot` experts favoured (repeats across rows,
    some experts chosen by more than 32 pairs)."""
    w = np.ones(E)
    for e in hot:
        w[e] += p_hot * E
    return np.stack([rng.choice(E, top_k, replace=False, p=w / w.sum()) for _ in range(m)]).astype(np.int32)


@pytest.mark.parametrize("rows", [ops.PLAN_ROWS, ops.MMA8_ROWS])
@pytest.mark.parametrize("n_pairs", [1, 7, 96, 640, 2048])
def test_route_plan(dev, rng, n_pairs, rows):
    """The plan against its definition: experts held by another rank (NULL entries), ids outside [0, E) and -1
    go to the none list; a hot expert has several items; poisoned buffer."""
    E = 40
    local = [e % 7 != 3 for e in range(E)]
    tab = np.zeros((E, 3), np.uint64)
    tab[local, 0] = 16 * (1 + np.nonzero(local)[0])   # the plan reads only whether the weight is NULL
    ids = rng.choice(np.r_[np.arange(E), [5] * 60, [-1, E, E + 7]], n_pairs).astype(np.int32)
    tb, ib, pb = up(dev, tab), up(dev, ids), out(dev, "u8", ops.moe_plan_bytes(n_pairs, E, rows))
    ops.moe_route_plan(dev, tb.ptr, ib.ptr, n_pairs, E, pb.ptr, rows=rows)
    hdr, items, srt = read_plan(dev, pb, n_pairs, E)
    want_items, want_order, none0 = ref_plan(ids.tolist(), local, E, rows)
    assert hdr == [len(want_items), none0, 4 + 2 * ops.plan_max_items(n_pairs, E, rows), rows]
    assert items == want_items and srt == want_order
    assert len(items) <= ops.plan_max_items(n_pairs, E, rows)


@pytest.mark.parametrize("rows", [ops.PLAN_ROWS, ops.MMA8_ROWS])
def test_route_plan_shared_slot(dev, rng, rows):
    """shared_id >= 0: ids [m, top_k] and one more pair per row, slot top_k, of the shared expert (a routed slot
    naming it goes to the none list), against the definition on the expanded ids; n_pairs must be m (top_k + 1)."""
    m, K, E = 45, 3, 12
    sid = E - 1
    local = [e % 5 != 2 for e in range(E)]
    tab = np.zeros((E, 3), np.uint64)
    tab[local, 0] = 16 * (1 + np.nonzero(local)[0])
    ids = rng.choice(np.r_[np.arange(E), [-1, E + 3]], (m, K)).astype(np.int32)
    ids[4, 1] = sid
    n_pairs = m * (K + 1)
    tb, ib, pb = up(dev, tab), up(dev, ids), out(dev, "u8", ops.moe_plan_bytes(n_pairs, E, rows))
    ops.moe_route_plan(dev, tb.ptr, ib.ptr, n_pairs, E, pb.ptr, rows=rows, top_k=K, shared_id=sid)
    hdr, items, srt = read_plan(dev, pb, n_pairs, E)
    full = np.concatenate([np.where(ids == sid, -1, ids), np.full((m, 1), sid, np.int32)], axis=1)
    want_items, want_order, none0 = ref_plan(full.ravel().tolist(), local, E, rows)
    assert hdr == [len(want_items), none0, 4 + 2 * ops.plan_max_items(n_pairs, E, rows), rows]
    assert items == want_items and srt == want_order
    with pytest.raises(KernelError):
        ops.moe_route_plan(dev, tb.ptr, ib.ptr, n_pairs - 1, E, pb.ptr, top_k=K, shared_id=sid)


# K in chunks of the format: a ragged last k unit, and 1, 2 or 4 warps splitting k (ops.moe.mma_ks)
MMA_CHUNKS = {20: 1, 75: 2, 136: 4}


def _mma_case(dev, rng, fmt, chunks, n, n_experts, gate_up):
    k = chunks * ops.moe.CHUNK[fmt]
    assert ops.moe.mma_ks(fmt, k) == MMA_CHUNKS[chunks]
    host = [[host_weight(rng, fmt, n, k) for _ in range(2 if gate_up else 1)] for _ in range(n_experts)]
    lins = [[upload_weight(dev, fmt, n, k, h[j][0]) if e != 3 else None for e, h in enumerate(host)]
            for j in range(2 if gate_up else 1)]
    return k, host, lins, [up(dev, ops.expert_table(lj)) for lj in lins]


@pytest.mark.parametrize("rows", [ops.PLAN_ROWS, ops.MMA8_ROWS])
@pytest.mark.parametrize("chunks", list(MMA_CHUNKS))
@pytest.mark.parametrize("fmt", FORMATS)
def test_moe_gemv_mma_formats(dev, rng, fmt, chunks, rows):
    """y[q] = W[ids[q]] x_q through a plan: repeats (a hot expert with more than 32 pairs: two items), an absent
    expert (NULL entry), an out-of-range id and -1 (zeros), an N tail, a ragged last k unit."""
    n_experts, m, n_slots, n = 5, 24, 3, 136
    k, host, lins, tabs = _mma_case(dev, rng, fmt, chunks, n, n_experts, False)
    ids = rng.choice([0, 1, 1, 1, 1, 2, 3, 4, 9, -1], (m, n_slots)).astype(np.int32)
    x = bf16(rng.standard_normal((m, n_slots, k)))
    n_pairs = m * n_slots
    xb, ib, y = up(dev, x), up(dev, ids), out(dev, "f32", (n_pairs, n))
    plan = out(dev, "u8", ops.moe_plan_bytes(n_pairs, n_experts, rows))
    ops.moe_route_plan(dev, tabs[0].ptr, ib.ptr, n_pairs, n_experts, plan.ptr, rows=rows)
    ops.moe_gemv_mma(dev, tabs[0].ptr, fmt, plan.ptr, n_pairs, n_slots, n_experts, xb.ptr, n_slots * k, k, y.ptr, n,
                     k, rows=rows)
    got = get(dev, y, "f32", (n_pairs, n))
    dense = [h[0][1]() for h in host]
    for q, e in enumerate(ids.ravel()):
        if e in (3, 9, -1):
            assert np.array_equal(got[q], np.zeros(n)), (q, e)
        else:
            assert_close(got[q], dense[e] @ f32(x.reshape(-1, k)[q]).astype(np.float64), 1e-5, f"pair {q} expert {e}")


@pytest.mark.parametrize("rows", [ops.PLAN_ROWS, ops.MMA8_ROWS])
@pytest.mark.parametrize("chunks", list(MMA_CHUNKS))
@pytest.mark.parametrize("fmt", FORMATS)
def test_moe_gate_up_mma_formats(dev, rng, fmt, chunks, rows):
    """h[q] = swiglu(Wg x_r, Wu x_r) of row r = q / n_slots (x slot stride 0) through a plan, as above; the
    clamp of V4 on odd chunk counts."""
    n_experts, m, n_slots, n = 5, 20, 4, 136
    limit = 0.5 if chunks % 2 else 0.0
    k, host, lins, tabs = _mma_case(dev, rng, fmt, chunks, n, n_experts, True)
    ids = skewed_ids(rng, m, n_slots, 5, hot=(1,), p_hot=3.0)
    ids[2, 1], ids[7, 3] = 9, -1
    x = bf16(rng.standard_normal((m, k)) * 4)
    n_pairs = m * n_slots
    xb, ib, h = up(dev, x), up(dev, ids), out(dev, "bf16", (n_pairs, n))
    plan = out(dev, "u8", ops.moe_plan_bytes(n_pairs, n_experts, rows))
    ops.moe_route_plan(dev, tabs[0].ptr, ib.ptr, n_pairs, n_experts, plan.ptr, rows=rows)
    assert read_plan(dev, plan, n_pairs, n_experts)[0][0] >= 4   # expert 1 has two items
    ops.moe_gate_up_mma(dev, tabs[0].ptr, tabs[1].ptr, fmt, plan.ptr, n_pairs, n_slots, n_experts, xb.ptr, k, 0,
                        h.ptr, n, k, limit, rows=rows)
    got = f32(get(dev, h, "bf16", (n_pairs, n)))
    for q, e in enumerate(ids.ravel()):
        if e in (3, 9, -1):
            assert np.array_equal(got[q], np.zeros(n)), (q, e)
            continue
        xr = f32(x[q // n_slots]).astype(np.float64)
        assert_close(got[q], swiglu(host[e][0][1]() @ xr, host[e][1][1]() @ xr, limit), 1e-2, f"pair {q}")
        if limit:
            assert np.abs(got[q]).max() <= limit * limit + 1e-6


@pytest.mark.parametrize("fmt", ["fp8_block", "mxfp4", "bf16"])
def test_moe_mma_staged_ahead(dev, rng, fmt):
    """moe_stage_x ahead of the GEMMs (what MoE.forward runs on its side stream), then the GEMMs with staged=True:
    the bits of the calls that stage for themselves. For the f16-reading formats x is NaN-poisoned after the staging,
    so a GEMM that read x (or staged again) would differ; gate/up's x one vector a row, down's one a pair."""
    n_experts, m, n_slots, n = 5, 9, 3, 72
    k, _, _, tabs = _mma_case(dev, rng, fmt, 75, n, n_experts, True)
    ids = rng.choice([0, 1, 1, 2, 3, 4, 9], (m, n_slots)).astype(np.int32)
    n_pairs, rows = m * n_slots, ops.MMA8_ROWS
    ib = up(dev, ids)
    plan = out(dev, "u8", ops.moe_plan_bytes(n_pairs, n_experts, rows))
    ops.moe_route_plan(dev, tabs[0].ptr, ib.ptr, n_pairs, n_experts, plan.ptr, rows=rows)
    x_row = bf16(rng.standard_normal((m, k)) * 3)
    x_pair = bf16(rng.standard_normal((m, n_slots, k)))
    ws = out(dev, "u8", ops.mma_x_bytes(fmt, n_pairs, k))
    poison = fmt in ops.X16_FORMATS

    def gate_up(xp, staged):
        h = out(dev, "bf16", (n_pairs, n))
        ops.moe_gate_up_mma(dev, tabs[0].ptr, tabs[1].ptr, fmt, plan.ptr, n_pairs, n_slots, n_experts, xp, k, 0,
                            h.ptr, n, k, rows=rows, workspace=ws.ptr, staged=staged)
        return get(dev, h, "bf16", (n_pairs, n))

    def down(xp, staged):
        y = out(dev, "f32", (n_pairs, n))
        ops.moe_gemv_mma(dev, tabs[0].ptr, fmt, plan.ptr, n_pairs, n_slots, n_experts, xp, n_slots * k, k, y.ptr,
                         n, k, rows=rows, workspace=ws.ptr, staged=staged)
        return get(dev, y, "f32", (n_pairs, n))

    for call, x, xss in ((gate_up, x_row, 0), (down, x_pair, k)):
        xb = up(dev, x)
        want = call(xb.ptr, False)
        ops.moe_stage_x(dev, fmt, xb.ptr, n_slots * k if xss else k, xss, n_pairs, n_slots, k, ws.ptr)
        if poison:
            dev.fill(xb.ptr, 2 * x.size, 0xFF)   # every bf16 0xffff: NaN
        got = call(xb.ptr, True)
        assert np.isfinite(want).all() and np.array_equal(want.tobytes(), got.tobytes()), call.__name__
    if poison:   # the staged x lives in a workspace the GEMM is told of
        x = up(dev, x_row)
        with pytest.raises(KernelError, match="workspace"):
            ops.moe_stage_x(dev, fmt, x.ptr, k, 0, n_pairs, n_slots, k, NULL)
        with pytest.raises(KernelError, match="unknown format"):
            ops.moe_stage_x(dev, "fp6", x.ptr, k, 0, n_pairs, n_slots, k, ws.ptr)
        with pytest.raises(KernelError, match="staged x lives in a workspace"):
            ops.moe_gate_up_mma(dev, tabs[0].ptr, tabs[1].ptr, fmt, plan.ptr, n_pairs, n_slots, n_experts, x.ptr,
                                k, 0, x.ptr, n, k, rows=rows, staged=True)


@pytest.mark.parametrize("rows", [ops.PLAN_ROWS, ops.MMA8_ROWS])
@pytest.mark.parametrize("fmt", ["bf16", "fp8_row", "nvfp4"])
def test_moe_mma_one_weight(dev, rng, fmt, rows):
    """plan NULL: table entry 0 for every pair (the shared expert: one "expert" for all rows), 70 rows in items of
    `rows` (32, 32, 6 or eight 8s and 6); a NULL entry gives zeros."""
    m, n, k = 70, 96, 32 * ops.moe.CHUNK[fmt]
    hg, hu, hd = (host_weight(rng, fmt, *sh) for sh in ((n, k), (n, k), (k, n)))
    lg, lu, ld = (upload_weight(dev, fmt, *sh, hw[0]) for sh, hw in zip(((n, k), (n, k), (k, n)), (hg, hu, hd)))
    tg, tu, td = (up(dev, ops.expert_table([L])) for L in (lg, lu, ld))
    none = up(dev, ops.expert_table([None]))
    x = bf16(rng.standard_normal((m, k)))
    xb, h, y = up(dev, x), out(dev, "bf16", (m, n)), out(dev, "f32", (m, k))
    ops.moe_gate_up_mma(dev, tg.ptr, tu.ptr, fmt, NULL, m, 1, 1, xb.ptr, k, 0, h.ptr, n, k, 0.0, rows=rows)
    ops.moe_gemv_mma(dev, td.ptr, fmt, NULL, m, 1, 1, h.ptr, n, 0, y.ptr, k, n, rows=rows)
    xs = f32(x).astype(np.float64)
    hh = f32(get(dev, h, "bf16", (m, n)))
    assert_close(hh, swiglu(xs @ hg[1]().T, xs @ hu[1]().T, 0.0), 1e-2, "gate/up")
    assert_close(get(dev, y, "f32", (m, k)), f32(hh).astype(np.float64) @ hd[1]().T, 1e-5, "down")
    ops.moe_gemv_mma(dev, none.ptr, fmt, NULL, m, 1, 1, h.ptr, n, 0, y.ptr, k, n, rows=rows)
    assert np.array_equal(get(dev, y, "f32", (m, k)), np.zeros((m, k), np.float32))


@pytest.mark.parametrize("fmt", FORMATS)
def test_moe_mma_grid_walks(dev, rng, fmt):
    """A persistent grid smaller than the work (`blocks` 1, 2, 7): every block walks several (item, tile) units
    with its ring running across them, through an absent expert's units (NULL entry, zeros) in between; the
    results are bit-identical to the full grid's, the same for 32- and 8-pair items (the 4- and 1-n-tile
    kernels), and match the reference."""
    n_experts, m, n_slots, n, k = 5, 24, 3, 96, 75 * ops.moe.CHUNK[fmt]
    host = [[host_weight(rng, fmt, *sh) for sh in ((n, k), (n, k), (k, n))] for _ in range(n_experts)]
    lins = [[upload_weight(dev, fmt, *sh, h[j][0]) if e != 3 else None for e, h in enumerate(host)]
            for j, sh in enumerate(((n, k), (n, k), (k, n)))]
    tg, tu, td = (up(dev, ops.expert_table(L)) for L in lins)
    ids = rng.choice([0, 1, 1, 2, 3, 3, 4, -1], (m, n_slots)).astype(np.int32)
    x = bf16(rng.standard_normal((m, k)))
    n_pairs = m * n_slots
    xb, ib = up(dev, x), up(dev, ids)
    runs = {}
    for rows in (ops.PLAN_ROWS, ops.MMA8_ROWS):
        plan = out(dev, "u8", ops.moe_plan_bytes(n_pairs, n_experts, rows))
        ops.moe_route_plan(dev, tg.ptr, ib.ptr, n_pairs, n_experts, plan.ptr, rows=rows)
        for blocks in (None, 1, 2, 7):
            h, y = out(dev, "bf16", (n_pairs, n)), out(dev, "f32", (n_pairs, k))
            ops.moe_gate_up_mma(dev, tg.ptr, tu.ptr, fmt, plan.ptr, n_pairs, n_slots, n_experts, xb.ptr, k, 0,
                                h.ptr, n, k, rows=rows, blocks=blocks)
            ops.moe_gemv_mma(dev, td.ptr, fmt, plan.ptr, n_pairs, 1, n_experts, h.ptr, n, 0, y.ptr, k, n,
                             rows=rows, blocks=blocks)
            runs[rows, blocks] = (get(dev, h, "bf16", (n_pairs, n)), get(dev, y, "f32", (n_pairs, k)))
    first = runs[ops.PLAN_ROWS, None]
    for key, got in runs.items():
        assert all(np.array_equal(a, b) for a, b in zip(got, first)), f"rows, blocks = {key}"
    hh, yy = first
    for q, e in enumerate(ids.ravel()):
        if e in (3, -1):
            assert not hh[q].any() and not yy[q].any(), (q, e)
            continue
        xr = f32(x[q // n_slots]).astype(np.float64)
        assert_close(f32(hh[q]), swiglu(host[e][0][1]() @ xr, host[e][1][1]() @ xr, 0.0), 1e-2, f"gate/up {q}")
        assert_close(yy[q], host[e][2][1]() @ f32(hh[q]).astype(np.float64), 1e-5, f"down {q}")


def ref_stage_f16(v):
    """One vector's (f16 values, scale) by the definition, float64: e = floor(log2 max|v|) - 14 (so the max lands in
    [2^14, 2^15)), clamped to [-126, 113]; e = 0 for a vector of zeros or holding Inf / NaN; values = f16(v 2^-e)."""
    v = f32(v).astype(np.float64)
    M = np.abs(v).max()
    if M == 0 or not np.isfinite(v).all():
        e = 0
    else:
        e = min(max(math.frexp(M)[1] - 1 - 14, -126), 113)
    with np.errstate(over="ignore"):
        return (v * 2.0 ** -e).astype(np.float16), 2.0 ** e


@pytest.mark.parametrize("pairs02", [False, True])
@pytest.mark.parametrize("k", [8, 136, 2048, 7168])
def test_stage_f16(dev, rng, k, pairs02):
    """moe_stage_f16 against its definition: vectors of (row, slot) read through strides, magnitudes from bf16
    subnormals to 1e38, a zero vector, Inf and NaN vectors; outputs poisoned. Every element within 2^31 of its
    vector's largest comes back exactly as f16 times the scale; with pairs02 each 8 elements come in the order
    0, 2, 1, 3, 4, 6, 5, 7."""
    rows, n_slots = 5, 3
    exps = [-40, -8, 0, 4, 30]
    x = f32(rng.standard_normal((rows, n_slots, k + 8)))
    for r in range(rows):
        x[r] *= 10.0 ** exps[r]
    x[0, 1, :k] = rng.standard_normal(k) * 2.0 ** -130        # bf16 subnormals only
    x[1, 0, :k] = 0
    x[1, 2, 3] = np.inf
    x[2, 1, 5] = np.nan
    x[3, 2, :k] *= np.where(rng.random(k) < 0.5, 1.0, 2.0 ** -40)   # a 2^40 spread inside one vector
    x[4, 0, 0] = 3.0e38
    xb = bf16(x)
    n_vec = rows * n_slots
    xd, y, sc = up(dev, xb), out(dev, "f16", (n_vec, k)), out(dev, "f32", n_vec)
    ops.moe_stage_f16(dev, xd.ptr, n_slots * (k + 8), k + 8, n_slots, y.ptr, sc.ptr, n_vec, k, pairs02=pairs02)
    got_y, got_s = get(dev, y, np.float16, (n_vec, k)), get(dev, sc, "f32", n_vec)
    if pairs02:   # back to element order: swap elements 1, 2 and 5, 6 of every 8
        got_y = got_y.reshape(n_vec, k // 8, 8)[..., [0, 2, 1, 3, 4, 6, 5, 7]].reshape(n_vec, k)
    for v in range(n_vec):
        vec = xb[v // n_slots, v % n_slots, :k]
        want_y, want_s = ref_stage_f16(vec)
        assert got_s[v] == want_s, (v, got_s[v], want_s)
        assert np.array_equal(got_y[v], want_y, equal_nan=True), v
        xv = f32(vec).astype(np.float64)
        big = np.abs(xv) >= np.abs(xv).max() * 2.0 ** -31
        if np.isfinite(xv).all():
            assert np.array_equal(got_y[v][big].astype(np.float64) * got_s[v], xv[big]), v


def test_stage_f16_errors(ref):
    x = up(ref, bf16(np.zeros((4, 64))))
    before = ref.read(x.ptr, np.uint8, 512).copy()
    with pytest.raises(KernelError, match="k 60"):
        ops.moe_stage_f16(ref, x.ptr, 64, 0, 1, x.ptr, x.ptr, 4, 60)
    with pytest.raises(KernelError, match="16-byte"):
        ops.moe_stage_f16(ref, x.ptr.offset(8), 64, 0, 1, x.ptr, x.ptr, 4, 64)
    assert np.array_equal(ref.read(x.ptr, np.uint8, 512), before), "a refused call wrote"
    assert ops.mma_x_bytes("nvfp4", 4, 64) == ops.mma_x_bytes("bf16", 4, 64) == 0
    assert ops.mma_x_bytes("fp8_block", 4, 64) >= 2 * 4 * 64 + 4 * 4


@pytest.mark.parametrize("fmt", ops.X16_FORMATS)
def test_moe_mma_fp8_x_magnitudes(dev, rng, fmt):
    """The fp8 GEMMs' f16 x over magnitudes f16 cannot hold (rows of 1e-30 .. 1e30, one row spread over 2^40): each
    pair's result against float64 to 1e-5, the same bits with the launcher's own workspace and with one passed."""
    m, n, k = 6, 64, 40 * ops.moe.CHUNK[fmt]
    hw = host_weight(rng, fmt, n, k)
    W = upload_weight(dev, fmt, n, k, hw[0])
    td = up(dev, ops.expert_table([W]))
    x = rng.standard_normal((m, k)) * (10.0 ** np.array([-30, -6, 0, 5, 30, 0]))[:, None]
    x[5] *= np.where(rng.random(k) < 0.5, 1.0, 2.0 ** -40)
    x = bf16(x)
    xb = up(dev, x)
    ws = out(dev, "u8", ops.mma_x_bytes(fmt, m, k))
    runs = []
    for w in (None, ws.ptr):
        y = out(dev, "f32", (m, n))
        ops.moe_gemv_mma(dev, td.ptr, fmt, NULL, m, 1, 1, xb.ptr, k, 0, y.ptr, n, k, rows=ops.MMA8_ROWS, workspace=w)
        runs.append(get(dev, y, "f32", (m, n)))
    assert np.array_equal(runs[0], runs[1])
    dense = hw[1]()
    for r in range(m):
        assert_close(runs[0][r], dense @ f32(x[r]).astype(np.float64), 1e-5, f"row {r}")


def test_mxfp4_ring_row_matches_the_kernel():
    """The launcher sizes MXFP4's ring stages by MX_ROW_CHUNKS; the kernel derives its stage count from the shared
    memory it gets with its own MX_ROW, so the two must agree (else it could find fewer than 2 stages)."""
    import re
    from mtp_cupy.runtime.backend import CUDA_SRC
    found = re.findall(r"^constexpr int MX_ROW = (\d+);", (CUDA_SRC / "moe_mma.cu").read_text(), re.M)
    assert [int(v) for v in found] == [ops.moe.MX_ROW_CHUNKS]


def test_moe_mma_grid_spreads_short_calls(ref):
    """The persistent grid: the resident cap when the work units fill it more than EVEN_ROUNDS_MAX times; for
    shorter calls the fewest blocks that still give every block the same count of units (no tail of blocks
    walking one unit more than the rest), never more blocks than units."""
    from mtp_cupy.ops import moe as om
    fmt, name, n, k, outputs = "mxfp4", "moe_gate_up_mma8_mxfp4", 2048, 4096, 16
    tiles = n // outputs
    grid = lambda items, blocks=None: om._mma_launch(ref, name, fmt, n, k, outputs, items, 8, blocks)._grid[0]
    cap = grid(64)                                      # 64 items x 128 tiles: far more than EVEN_ROUNDS_MAX rounds
    assert 64 * tiles > om.EVEN_ROUNDS_MAX * cap
    for items in (1, 2, 6, 9, 11):
        work = items * tiles
        rounds = -(-work // cap)
        b = grid(items)
        assert b <= min(cap, work), (items, b)
        if rounds <= om.EVEN_ROUNDS_MAX:
            assert -(-work // b) == rounds and b == -(-work // rounds), (items, b, rounds)
        else:
            assert b == cap, (items, b)
    assert grid(6, blocks=7) == 7 and grid(1, blocks=10 ** 6) == grid(1)


def test_moe_mma_errors(ref, rng):
    x = up(ref, bf16(np.zeros((4, 64))))
    with pytest.raises(KernelError):      # f32 experts have no grouped kernel
        ops.moe_gemv_mma(ref, x.ptr, "f32", NULL, 4, 1, 1, x.ptr, 64, 0, x.ptr, 8, 64)
    with pytest.raises(KernelError):      # k not whole chunks
        ops.moe_gemv_mma(ref, x.ptr, "nvfp4", NULL, 4, 1, 1, x.ptr, 64, 0, x.ptr, 8, 48)
    with pytest.raises(KernelError):      # a plan holds at most MAX_PLAN_PAIRS pairs
        ops.moe_route_plan(ref, x.ptr, x.ptr, ops.MAX_PLAN_PAIRS + 1, 8, x.ptr)
    with pytest.raises(KernelError):
        ops.moe_gate_up_mma(ref, x.ptr, x.ptr, "bf16", NULL, 4, 1, 1, x.ptr, 64, 0, x.ptr, 8, 64, limit=-1.0)
    before = ref.read(x.ptr, np.uint8, 512).copy()
    with pytest.raises(KernelError, match="rows 16"):           # items of 8 or 32 pairs only
        ops.moe_gemv_mma(ref, x.ptr, "bf16", NULL, 4, 1, 1, x.ptr, 64, 0, x.ptr, 8, 64, rows=16)
    with pytest.raises(KernelError, match="rows 16"):
        ops.moe_route_plan(ref, x.ptr, x.ptr, 4, 8, x.ptr, rows=16)
    with pytest.raises(KernelError, match="blocks 0"):
        ops.moe_gate_up_mma(ref, x.ptr, x.ptr, "bf16", NULL, 4, 1, 1, x.ptr, 64, 0, x.ptr, 8, 64, blocks=0)
    with pytest.raises(KernelError, match="shared_id 8"):       # the shared expert's id must be a table entry
        ops.moe_route_plan(ref, x.ptr, x.ptr, 4, 8, x.ptr, top_k=3, shared_id=8)
    with pytest.raises(KernelError, match="y_slots 2"):         # fewer y slots a row than top_k
        ops.moe_weighted_sum(ref, x.ptr, x.ptr, 3, x.ptr, 2, 8, y_slots=2)
    with pytest.raises(KernelError, match="shared_stride 4"):
        ops.moe_weighted_sum(ref, x.ptr, x.ptr, 3, x.ptr, 2, 8, shared=x.ptr, shared_stride=4)
    assert np.array_equal(ref.read(x.ptr, np.uint8, 512), before), "a refused call wrote"


# every family's routing on its own format; the grouped twins must give each row the bits of its m = 1 call
@pytest.mark.parametrize("case,fmt,kernels", [("deepseek_v3", "fp8_block", "auto"), ("qwen3_next", "nvfp4", "auto"),
                                              ("deepseek_v4", "mxfp4", "grouped"), ("v4_hash", "bf16", "auto"),
                                              ("qwen3_next", "bf16", "plain"), ("deepseek_v3", "fp8_block", "plain")])
def test_moe_layer_rows_independent_of_batch(ref, rng, case, fmt, kernels):
    """forward of m = 3, 17, 64 rows on the NumPy device: each row bit-identical to its m = 1 forward (the
    grouped GEMMs, or with "plain" the FMA GEMVs); some experts absent."""
    b = _built(rng, case, fmt)
    E = b.cfg.n_experts
    moe = b.build(ref, only={e for e in range(E) if e % 8 != 5}, max_rows=64, expert_kernels=kernels)
    x = grid_x(rng, 64, b.cfg.hidden)
    tok = rng.integers(0, 40, 64) if case == "v4_hash" else None
    assert moe.grouped(64) == moe.grouped(1) == (kernels != "plain")
    single = np.concatenate([forward(ref, moe, x[r:r + 1], 1, None if tok is None else tok[r:r + 1])
                             for r in range(64)])
    for m in (3, 17, 64):
        got = forward(ref, moe, x[:m], m, None if tok is None else tok[:m])
        assert np.array_equal(got, single[:m]), m
    assert_close(single[:3], b.reference(x[:3], None if tok is None else tok[:3],
                                         only={e for e in range(E) if e % 8 != 5}), 1e-2)


def test_moe_layer_expert_kernels(ref, rng):
    """expert_kernels: "auto" and "grouped" take the grouped GEMMs at every m, "plain" keeps the FMA GEMVs at
    every m (same results on the NumPy device); anything else is a ConfigError."""
    b = _built(rng, "deepseek_v3", "fp8_row")
    m = 35
    x = grid_x(rng, m, b.cfg.hidden)
    outs = []
    for kind in ("auto", "plain", "grouped"):
        for inv in (False, True):
            moe = b.build(ref, expert_kernels=kind, invariant=inv, max_rows=m)
            assert [moe.grouped(r) for r in (1, 8, 9, m)] == [kind != "plain"] * 4
        outs.append(forward(ref, moe, x, m))
    assert np.array_equal(outs[0], outs[1]) and np.array_equal(outs[0], outs[2])
    with pytest.raises(ConfigError):
        b.build(ref, expert_kernels="fast")


@pytest.mark.parametrize("case,fmt", [("deepseek_v3", "fp8_block"), ("qwen3_next", "bf16"), ("v4_hash", "mxfp4")])
def test_moe_layer_fused_shared(dev, rng, case, fmt):
    """A shared expert of the routed format and width runs as expert E of the routed grouped GEMMs: bit-identical
    to its own launches (fuse_shared off on the same layer), each row bit-identical to its m = 1 forward, against
    the float64 reference; add_shared=False leaves it out; some experts absent (EP)."""
    b = _built(rng, case, fmt, shared_inter=128)
    E, m = b.cfg.n_experts, 11
    only = {e for e in range(E) if e % 8 != 5}
    moe = b.build(dev, only=only, max_rows=m, invariant=True)
    assert moe.fuse_shared
    x = grid_x(rng, m, b.cfg.hidden)
    tok = rng.integers(0, 40, m) if case == "v4_hash" else None
    fused = forward(dev, moe, x, m, tok)
    alone = forward(dev, moe, x, m, tok, add_shared=False)
    single = np.concatenate([forward(dev, moe, x[r:r + 1], 1, None if tok is None else tok[r:r + 1])
                             for r in range(m)])
    moe.fuse_shared = False    # the same weights through the shared expert's own launches
    apart = forward(dev, moe, x, m, tok)
    assert np.array_equal(fused, apart) and np.array_equal(fused, single)
    assert np.array_equal(alone, forward(dev, moe, x, m, tok, add_shared=False))
    assert_close(fused, b.reference(x, tok, only=only), 1e-2)


# -- CUDA vs twin at real model dims ---------------------------------------------------------------
REAL = {  # (config, fmt, shared inter, shared gate, bias)
    "deepseek_v3": (dict(n_experts=256, top_k=8, hidden=7168, inter=2048, routing="sigmoid_grouped", n_group=8,
                         topk_group=4, routed_scaling=2.5), "fp8_block", 2048, False, True),
    "deepseek_v4": (dict(n_experts=256, top_k=6, hidden=4096, inter=2048, routing="sqrtsoftplus",
                         routed_scaling=1.5, swiglu_limit=10.0), "mxfp4", 2048, False, True),
    "glm5": (dict(n_experts=256, top_k=8, hidden=6144, inter=2048, routing="sigmoid_grouped", routed_scaling=2.5),
             "fp8_block", 2048, False, True),
    "qwen3_next_bf16": (dict(n_experts=512, top_k=10, hidden=2048, inter=512, routing="softmax"), "bf16", 512,
                        True, False),
    "qwen3_next_nvfp4": (dict(n_experts=512, top_k=10, hidden=2048, inter=512, routing="softmax"), "nvfp4", 512,
                         True, False),
}


def _run_real(dev, built, x, m, local):
    moe = built.build(dev, only=local, max_rows=max(32, m))
    return forward(dev, moe, x, m), dev.read(moe.ids, "i32", (m, built.cfg.top_k))


@pytest.mark.gpu
@pytest.mark.parametrize("model,m", [(name, 1) for name in REAL] + [("deepseek_v3", 4), ("qwen3_next_nvfp4", 8),
                                                                     ("deepseek_v4", 33), ("qwen3_next_bf16", 64)])
def test_moe_real_dims_cuda_vs_twin(rng, model, m):
    """4 distinct weight sets stand in for all experts (pointer tables alias them); 1 in 8 experts is
    absent (EP). Routing must agree exactly, outputs to bf16 accuracy. m = 1 runs the FMA GEMVs, batches the
    grouped GEMMs (and the shared expert as one of them)."""
    cfg, fmt, si, sg, bias = REAL[model]
    cfg = MoeConfig(**cfg)
    b = Built(rng, cfg, fmt, shared_inter=si, shared_gate=sg, bias=bias, pool=4)
    x = grid_x(rng, m, cfg.hidden)
    local = {e for e in range(cfg.n_experts) if e % 8 != 5}
    (o_ref, id_ref), (o_gpu, id_gpu) = run_on_both(_run_real, b, x, m, local)
    assert np.array_equal(id_ref, id_gpu)
    assert_close(o_gpu, o_ref, 1e-2, model)


@pytest.mark.gpu
@pytest.mark.parametrize("rule,E,top_k,n_group,topk_group", [
    ("softmax", 512, 10, 1, 1), ("sigmoid_grouped", 256, 8, 8, 4), ("sqrtsoftplus", 256, 6, 1, 1),
    ("sqrtsoftplus", 384, 10, 1, 1),   # registers for 16 entries a lane, half of them past E
    ("sigmoid_grouped", 384, 8, 8, 4),  # the group limit between the register passes
    ("sigmoid_grouped", 16, 6, 8, 2),   # fewer unmasked experts than top_k; most lanes hold nothing
    ("softmax", 640, 8, 1, 1)])        # past 512 experts: score_row and the shared-memory rounds
def test_routing_real_dims_cuda_vs_twin(rng, rule, E, top_k, n_group, topk_group):
    m = 32
    z, bias = tied_inputs(rng, m, E, 24, 2.0)

    def run(dev):
        zb, bb, ids, w = up(dev, z), up(dev, bias), out(dev, "i32", (m, top_k)), out(dev, "f32", (m, top_k))
        if rule == "softmax":
            ops.moe_topk_softmax(dev, zb.ptr, ids.ptr, w.ptr, m, E, top_k)
        elif rule == "sigmoid_grouped":
            ops.moe_topk_sigmoid_grouped(dev, zb.ptr, bb.ptr, ids.ptr, w.ptr, m, E, top_k, n_group, topk_group,
                                         True, 2.5)
        else:
            ops.moe_topk_sqrtsoftplus(dev, zb.ptr, bb.ptr, ids.ptr, w.ptr, m, E, top_k, True, 1.5)
        return get(dev, ids, "i32", (m, top_k)), get(dev, w, "f32", (m, top_k))

    (i_ref, w_ref), (i_gpu, w_gpu) = run_on_both(run)
    assert np.array_equal(i_ref, i_gpu)
    assert_close(w_gpu, w_ref, 1e-5)


# -- the grouped GEMMs on CUDA at real dims ----------------------------------------------------------------------
MMA_REAL = {  # hidden, inter, format, n_experts, swiglu limit
    "deepseek_v3": (7168, 2048, "fp8_block", 256, 0.0),
    "qwen3_next_bf16": (2048, 512, "bf16", 512, 0.0),
    "qwen3_next_nvfp4": (2048, 512, "nvfp4", 512, 0.0),
    "deepseek_v4": (4096, 2048, "mxfp4", 256, 10.0),
}
MMA_TOP_K = 8


class _Experts:
    """4 distinct (gate, up, down) weight sets standing in for n_experts experts (pointer tables alias them), 1 in
    8 experts absent (EP); host arrays, uploaded per device by `on`."""

    def __init__(self, rng, model):
        self.D, self.I, self.fmt, self.E, self.limit = MMA_REAL[model]
        self.shapes = ((self.I, self.D), (self.I, self.D), (self.D, self.I))
        self.sets = [[host_weight(rng, self.fmt, *sh)[0] for sh in self.shapes] for _ in range(4)]
        self.local = np.array([e % 8 != 5 for e in range(self.E)])

    def on(self, dev):
        lins = [[upload_weight(dev, self.fmt, *sh, s[j]) for j, sh in enumerate(self.shapes)] for s in self.sets]
        tabs = [up(dev, ops.expert_table([lins[e % 4][j] if self.local[e] else None for e in range(self.E)]))
                for j in range(3)]
        return lins, tabs

    def run(self, dev, tabs, ids, x, hin):
        """(plan, h bf16 [pairs, I], y f32 [pairs, D]) of rows x [B, D] (gate/up) and h rows hin [B * top_k, I]
        (down) routed by ids [B, top_k]; outputs poisoned first."""
        B, K = ids.shape
        n = B * K
        xb, ib, hb = up(dev, x), up(dev, ids), up(dev, hin)
        plan = out(dev, "u8", ops.moe_plan_bytes(n, self.E))
        ops.moe_route_plan(dev, tabs[0].ptr, ib.ptr, n, self.E, plan.ptr)
        h, y = out(dev, "bf16", (n, self.I)), out(dev, "f32", (n, self.D))
        ops.moe_gate_up_mma(dev, tabs[0].ptr, tabs[1].ptr, self.fmt, plan.ptr, n, K, self.E, xb.ptr, self.D, 0,
                            h.ptr, self.I, self.D, self.limit)
        ops.moe_gemv_mma(dev, tabs[2].ptr, self.fmt, plan.ptr, n, K, self.E, hb.ptr, K * self.I, self.I, y.ptr,
                         self.D, self.I)
        return read_plan(dev, plan, n, self.E), get(dev, h, "bf16", (n, self.I)), get(dev, y, "f32", (n, self.D))


def _near_rows(got, want, rel, floor):
    """Element-wise CUDA vs twin: within `rel` of the element or `floor` times its row's rms (a near-cancelling
    sum has the absolute error of its terms); never NaN."""
    got, want = f32(got).astype(np.float64), f32(want).astype(np.float64)
    assert np.all(np.isfinite(got)), "NaN/inf in a CUDA output"
    rms = np.sqrt(np.mean(want ** 2, axis=1, keepdims=True))
    bad = np.abs(got - want) > rel * np.abs(want) + floor * rms
    assert not bad.any(), f"{bad.sum()} elements off, first at {np.argwhere(bad)[0]}"


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 7, 64])
@pytest.mark.parametrize("model", list(MMA_REAL))
def test_moe_mma_real_dims_cuda_vs_twin(rng, model, B):
    """The plan bit for bit, and the grouped GEMMs to accumulation order, CUDA against the twin: B rows of 8
    experts, hot experts repeated across rows (more than 32 pairs at B = 64), 1 in 8 experts absent (zeros)."""
    ex = _Experts(rng, model)
    ids = skewed_ids(rng, B, MMA_TOP_K, ex.E, hot=range(0, ex.E, 37), p_hot=0.5)
    if ex.local[ids].all():  # a draw of only local experts (likely at B = 1): make one pair absent
        ids[0, -1] = next(e for e in np.flatnonzero(~ex.local) if e not in ids[0])
    x = bf16(rng.standard_normal((B, ex.D)))
    hin = bf16(rng.standard_normal((B * MMA_TOP_K, ex.I)))

    def run(dev):
        lins, tabs = ex.on(dev)
        res = ex.run(dev, tabs, ids, x, hin)
        del lins  # the Linears own the weight buffers the tables point into: alive until here
        return res

    (p_ref, h_ref, y_ref), (p_gpu, h_gpu, y_gpu) = run_on_both(run)
    assert p_gpu == p_ref
    absent = ~ex.local[ids.ravel()]
    assert absent.any() and not np.any(f32(h_gpu)[absent]) and not np.any(y_gpu[absent])
    _near_rows(h_gpu[~absent], h_ref[~absent], 2 ** -7, 1e-3)
    _near_rows(y_gpu[~absent], y_ref[~absent], 1e-4, 1e-5)


def _bits(a):
    return np.ascontiguousarray(a).view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


@pytest.mark.gpu
@pytest.mark.parametrize("model", list(MMA_REAL))
def test_moe_mma_batch_invariant_cuda(cuda, rng, model):
    """A pair's bits do not depend on the call it is in: rows alone (B = 1: items of one row), among 64 rows
    whose experts overlap (items of many rows, some split at 32), and among 16 others with other experts, in
    another order (the pair in another n-tile column)."""
    ex = _Experts(rng, model)
    K, E = MMA_TOP_K, ex.E
    lins, tabs = ex.on(cuda)
    X = bf16(rng.standard_normal((64, ex.D)))
    H = bf16(rng.standard_normal((64, K, ex.I)))
    ids = skewed_ids(rng, 64, K, E, hot=range(0, E, 37), p_hot=0.5)

    def call(rows, ids_rows):
        _, h, y = ex.run(cuda, tabs, ids_rows, X[rows], H[rows].reshape(-1, ex.I))
        return _bits(h).reshape(len(rows), K, -1), _bits(y).reshape(len(rows), K, -1)

    h64, y64 = call(np.arange(64), ids)
    for t in (0, 5, 40, 63):
        h1, y1 = call(np.array([t]), ids[t:t + 1])
        assert np.array_equal(h1[0], h64[t]) and np.array_equal(y1[0], y64[t]), t
    rows = np.r_[[63, 40], rng.permutation(np.arange(1, 40))[:15]]
    other = skewed_ids(rng, 17, K, E, hot=range(3, E, 29), p_hot=0.5)
    other[:2] = ids[[63, 40]]
    h17, y17 = call(rows, other)
    for j, t in enumerate((63, 40)):
        assert np.array_equal(h17[j], h64[t]) and np.array_equal(y17[j], y64[t]), t


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["deepseek_v3", "qwen3_next_nvfp4", "deepseek_v4", "qwen3_next_bf16"])
def test_moe_layer_real_dims_batch_invariant_cuda(cuda, rng, model):
    """The batch-invariant layer on the grouped GEMMs (every m, the shared expert one more "expert") at real
    dims: each row of m = 64 and m = 17 bit-identical to its m = 1 forward; 1 in 8 experts absent. x holds normal
    values (not grid_x's quarters) so that a changed summation order changes the sums."""
    cfg, fmt, si, sg, bias = REAL[model]
    cfg = MoeConfig(**cfg)
    b = Built(rng, cfg, fmt, shared_inter=si, shared_gate=sg, bias=bias, pool=4)
    moe = b.build(cuda, only={e for e in range(cfg.n_experts) if e % 8 != 5}, max_rows=64, invariant=True,
                  expert_kernels="grouped")
    assert moe.grouped(1)
    x = bf16(rng.standard_normal((64, cfg.hidden)))
    full = forward(cuda, moe, x, 64)
    assert np.all(np.isfinite(full))
    for r in (0, 17, 63):
        assert np.array_equal(forward(cuda, moe, x[r:r + 1], 1)[0], full[r]), r
    assert np.array_equal(forward(cuda, moe, x[10:27], 17), full[10:27])
