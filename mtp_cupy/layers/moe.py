"""Routed mixture of experts for decode: router GEMV, the family's top-k rule, SwiGLU experts read in place
through device pointer tables (no weight is copied), an optional shared expert, and the weighted sum.

One forward is 6 launches (router GEMV through ops.linear, top-k, the routing plan, gate/up, down, weighted sum),
plus 1 for Qwen's shared-expert gate; a shared expert of another format or width than the routed ones (V4's
FP8 one beside MXFP4 experts) adds 2. It allocates nothing and reads every per-call value from device memory, so
it can be captured in a CUDA graph. Expert ids missing from `experts` live on other ranks (EP): they contribute
0, and the caller all-reduces `out` across ranks (with `add_shared=True` on one rank only).

Expert kernels. The grouped tensor-core GEMMs (ops.moe_gate_up_mma / moe_gemv_mma) at every m by default: a
routing plan built on the device groups the (row, expert) pairs by expert, and each chosen expert's weights are
streamed once for all its rows, in items of 8 pairs (the one-n-tile kernels, 16 warps an SM). A shared expert of
the routed experts' format and width is fused into that call as expert E, chosen by every row in an extra slot
(as SGLang fuses DeepSeek's): no launches of its own, and its tiles share the GPU with the routed ones. A pair's
result does not depend on the other pairs, so the layer is batch-invariant. expert_kernels="plain" keeps the FMA
GEMVs (ops.moe_gate_up / moe_gemv; also invariant per pair, but an expert chosen by several rows is re-read).
An H200 (scripts/bench_moe.py, batch-invariant, graphed) measured the grouped GEMMs 1.5-3.1x faster from m = 8
on, 0.8-0.9x at m = 1 before the shared expert was fused.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import ops
from ..errors import ConfigError, InputError
from ..runtime.arena import carve
from ..runtime.ptr import NULL, DevicePtr
from ..weights.linear import Linear

ROUTINGS = ("softmax", "sigmoid_grouped", "sqrtsoftplus", "hash")
EXPERT_KERNELS = ("auto", "plain", "grouped")  # MoE(expert_kernels=): "auto" is "grouped"; see MoE.grouped


@dataclass
class MoeConfig:
    n_experts: int
    top_k: int
    hidden: int
    inter: int                      # routed experts' intermediate size
    routing: str = "softmax"        # softmax (Qwen3-Next) | sigmoid_grouped (DeepSeek-V3, GLM) |
                                    # sqrtsoftplus (DeepSeek-V4) | hash (V4 hash layers: tid2eid[token])
    n_group: int = 1
    topk_group: int = 1
    routed_scaling: float = 1.0
    norm_topk_prob: bool = True
    swiglu_limit: float = 0.0       # > 0: V4's clamped SwiGLU (routed and shared experts)
    hash_score: str = "sqrtsoftplus"  # the score that weights hash-routed experts

    def __post_init__(self) -> None:
        if self.routing not in ROUTINGS:
            raise ConfigError(f"unknown MoE routing {self.routing!r}; one of {ROUTINGS}")
        if not 1 <= self.top_k <= min(32, self.n_experts):
            raise ConfigError(f"top_k {self.top_k} must be in [1, min(32, n_experts={self.n_experts})]")
        if self.routing == "sigmoid_grouped" and (self.n_experts % self.n_group or not
                                                  1 <= self.topk_group <= self.n_group <= 32):
            raise ConfigError(f"n_group {self.n_group} / topk_group {self.topk_group} do not fit "
                              f"{self.n_experts} experts")
        if self.hash_score not in ops.ROUTER_SCORES:
            raise ConfigError(f"hash_score {self.hash_score!r} is not one of {list(ops.ROUTER_SCORES)}")

    @classmethod
    def from_config(cls, cfg, hashed: bool = False) -> "MoeConfig":
        """The MTP layer's routing from a family config: DeepSeek-V3 / GLM-5 (scoring_func sigmoid:
        group-limited top-k), DeepSeek-V4 (sqrtsoftplus, or `hashed`: tid2eid[token]), Qwen3-Next (no
        scoring_func: softmax top-k)."""
        score = getattr(cfg, "scoring_func", None)
        if score is None:
            return cls(cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size,
                       routing="softmax", norm_topk_prob=cfg.norm_topk_prob)
        common = dict(routed_scaling=cfg.routed_scaling_factor, norm_topk_prob=cfg.norm_topk_prob)
        if score == "sigmoid":
            return cls(cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size,
                       routing="sigmoid_grouped", n_group=cfg.n_group, topk_group=cfg.topk_group, **common)
        if score == "sqrtsoftplus":
            return cls(cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size,
                       routing="hash" if hashed else "sqrtsoftplus", swiglu_limit=cfg.swiglu_limit, **common)
        raise ConfigError(f"scoring_func {score!r} is not supported (sigmoid, sqrtsoftplus)")


def _check(L, what: str, n: int, k: int) -> None:
    if (L.n, L.k) != (n, k):
        raise ConfigError(f"MoE {what}: weight is [{L.n}, {L.k}], expected [{n}, {k}]")
    if L.fmt not in ops.EXPERT_FORMATS or (L.fmt == "f32" and what != "router"):
        raise ConfigError(f"MoE {what}: format {L.fmt!r} is not supported")


def _one_format(linears, what: str) -> str:
    fmts = {L.fmt for L in linears}
    if len(fmts) != 1:
        raise ConfigError(f"MoE {what} projections mix formats {sorted(fmts)}; one launch needs one format")
    return fmts.pop()


class MoE:
    """`MoE(gpu, cfg, router, experts, bias, shared, shared_gate, tid2eid, max_rows)` then
    `forward(x, out, m)`: out bf16 [m, hidden] = sum_k w_k E_{id_k}(x) (+ shared(x), times
    sigmoid(shared_gate . x) when given). router: Linear [n_experts, hidden] (bf16, or any expert format;
    an object with fmt "f32" for f32 checkpoints); experts: id -> (gate, up, down); bias: f32 [n_experts]
    device pointer (selection only; sigmoid_grouped / sqrtsoftplus); tid2eid: i32 [vocab, top_k] device
    pointer for hash routing (with `vocab`). expert_kernels: "auto" or "grouped" (the grouped GEMMs at every m)
    or "plain" (the FMA GEMVs at every m)."""

    def __init__(self, gpu, cfg: MoeConfig, router: Linear, experts: dict[int, tuple[Linear, Linear, Linear]],
                 bias: DevicePtr = NULL, shared: tuple[Linear, Linear, Linear] | None = None,
                 shared_gate: Linear | None = None, tid2eid: DevicePtr = NULL, max_rows: int = 32, vocab: int = 0,
                 invariant: bool = False, expert_kernels: str = "auto"):
        E, K, D, I = cfg.n_experts, cfg.top_k, cfg.hidden, cfg.inter
        if not experts:
            raise ConfigError("MoE needs at least one local expert")
        if any(not 0 <= e < E for e in experts):
            raise ConfigError(f"MoE expert ids must be in [0, {E})")
        if cfg.routing == "hash" and (int(tid2eid) == 0 or vocab < 1):
            raise ConfigError("hash routing needs tid2eid and vocab")
        if shared_gate is not None and shared is None:
            raise ConfigError("MoE shared_gate without a shared expert")
        if expert_kernels not in EXPERT_KERNELS:
            raise ConfigError(f"MoE expert_kernels {expert_kernels!r} is not one of {EXPERT_KERNELS}")
        _check(router, "router", E, D)
        for e, tri in experts.items():
            for L, role, (n, k) in zip(tri, ("gate", "up", "down"), ((I, D), (I, D), (D, I))):
                _check(L, f"expert {e} {role}", n, k)
        self.fmt_gu = _one_format([p for t in experts.values() for p in t[:2]], "gate/up")
        self.fmt_down = _one_format([t[2] for t in experts.values()], "down")
        self.inter_s = 0
        if shared is not None:
            self.inter_s = Is = shared[0].n
            for L, role, (n, k) in zip(shared, ("gate", "up", "down"), ((Is, D), (Is, D), (D, Is))):
                _check(L, f"shared {role}", n, k)
            _one_format(shared[:2], "shared gate/up")
        if shared_gate is not None:
            _check(shared_gate, "shared_gate", 1, D)
        self.gpu, self.cfg, self.max_rows, self.vocab, self.inv = gpu, cfg, int(max_rows), int(vocab), bool(invariant)
        self.router, self.experts, self.shared, self.shared_gate = router, dict(experts), shared, shared_gate
        self.bias, self.tid2eid = DevicePtr(bias), DevicePtr(tid2eid)
        self.expert_kernels = expert_kernels

        # pointer tables: gate, up, down [E + 1, 3] each (entry E: the shared expert's, NULL without one), then the
        # router's [1, 3] (used for an f32 weight only: ops.linear takes every Linear format)
        sh = list(shared or (None, None, None))
        local = [experts.get(e) for e in range(E)]
        tabs = [ops.expert_table([t and t[j] for t in local] + [sh[j]]) for j in range(3)]
        self._tables = gpu.upload(np.concatenate(tabs + [ops.expert_table([router])]))
        base, row = self._tables.ptr, 3 * 8
        self.tab_gate, self.tab_up, self.tab_down = (base.offset(j * (E + 1) * row) for j in range(3))
        self.tab_sh_gate, self.tab_sh_up, self.tab_sh_down = (t.offset(E * row) for t in
                                                              (self.tab_gate, self.tab_up, self.tab_down))
        self.tab_router = base.offset(3 * (E + 1) * row)
        # a shared expert of the routed experts' formats and width runs as expert E in the routed grouped GEMMs
        # (slot K of every row): no launches of its own, and its tiles fill the GPU with the routed ones
        self.fuse_shared = (shared is not None and shared[0].fmt == self.fmt_gu and shared[2].fmt == self.fmt_down
                            and self.inter_s == I)

        R, S = self.max_rows, K + (1 if self.fuse_shared else 0)
        # the f16-reading GEMMs' staged x (ops.mma_x_bytes): one region serves the routed calls of a forward, one
        # after another; the shared expert's own launches have theirs (xs), as they run beside them (forward)
        xw = [ops.mma_x_bytes(self.fmt_gu, R, D), ops.mma_x_bytes(self.fmt_down, R * S, I)]
        xs = [0] if shared is None else \
            [ops.mma_x_bytes(shared[0].fmt, R, D), ops.mma_x_bytes(shared[2].fmt, R, self.inter_s)]
        regions = {"logits": 4 * R * E, "ids": 4 * R * K, "w": 4 * R * K, "h": 2 * R * S * I, "y": 4 * R * S * D,
                   "xw": max(xw), "xs": max(xs), "zeros": 4 * R, "hs": 2 * R * self.inter_s,
                   "ys": 4 * R * D if shared else 0,
                   "glogit": 4 * R if shared_gate is not None else 0,
                   "plan": ops.moe_plan_bytes(min(R * S, ops.MAX_PLAN_PAIRS), E + 1, ops.MMA8_ROWS)}
        self._x_staged = gpu.new_event(timing=False)   # the routed gate/up's x staged on the side stream (forward)
        self._scratch, ptrs = carve(gpu, regions)
        gpu.fill(self._scratch.ptr, self._scratch.nbytes, 0)  # `zeros` (the expert id of single-weight launches) stays 0
        for name, ptr in ptrs.items():
            setattr(self, name, ptr)

    def forward(self, x, out, m: int = 1, token_ids=NULL, token_ids_stride: int = 4, add_shared: bool = True,
                stream=None) -> None:
        """out bf16 [m, hidden] = routed experts (+ the shared expert when add_shared) for x bf16 [m, hidden].
        token_ids (i32 at token_ids + r * token_ids_stride bytes) are read by hash routing only."""
        c, gpu = self.cfg, self.gpu
        E, K, D, I = c.n_experts, c.top_k, c.hidden, c.inter
        if not 1 <= m <= self.max_rows:
            raise InputError(f"MoE forward: m {m} outside [1, max_rows={self.max_rows}]")
        grouped = self.grouped(m)
        fused = add_shared and self.fuse_shared and grouped
        S = K + 1 if fused else K   # y slots a row: the routed experts' (and the fused shared expert's)
        # what needs only x runs on a branch beside the router and the routed experts (latency-bound launches at
        # small m): first the routed gate/up's f16 x (X16 formats), which that GEMM alone waits for, then the
        # shared expert's own launches and its gate, which join before the weighted sum
        early = grouped and self.fmt_gu in ops.X16_FORMATS
        side_expert = add_shared and self.shared is not None and not fused
        side_gate = add_shared and self.shared_gate is not None
        branch = early or side_expert or side_gate
        if branch:
            side = gpu.fork(stream)
            if early:
                ops.moe_stage_x(gpu, self.fmt_gu, x, D, 0, m * S, S, D, self.xw, stream=side)
                gpu.record(self._x_staged, side)
            if side_expert:
                self._shared_expert(x, m, side)
            if side_gate:
                ops.linear(gpu, x, self.shared_gate, self.glogit, m, out_dtype="f32", stream=side,
                           invariant=self.inv)
        if self.router.fmt == "f32":
            ops.moe_gemv(gpu, self.tab_router, "f32", self.zeros, m, 1, 1, x, D, 0, self.logits, E, D, stream=stream, invariant=self.inv)
        else:
            ops.linear(gpu, x, self.router, self.logits, m, out_dtype="f32", stream=stream, invariant=self.inv)
        self._route(m, token_ids, token_ids_stride, stream)
        if grouped:
            rows = ops.MMA8_ROWS    # 16 warps an SM (the 32-pair kernels: 8); an expert rarely has 8 pairs
            En, sid = (E + 1, E) if fused else (E, -1)
            ops.moe_route_plan(gpu, self.tab_gate, self.ids, m * S, En, self.plan, stream=stream, rows=rows,
                               top_k=K, shared_id=sid)
            if early:
                gpu.wait_event(stream, self._x_staged)
            ops.moe_gate_up_mma(gpu, self.tab_gate, self.tab_up, self.fmt_gu, self.plan, m * S, S, En, x, D, 0,
                                self.h, I, D, c.swiglu_limit, stream=stream, rows=rows, workspace=self.xw,
                                staged=early)
            ops.moe_gemv_mma(gpu, self.tab_down, self.fmt_down, self.plan, m * S, S, En, self.h, S * I, I, self.y, D,
                             I, stream=stream, rows=rows, workspace=self.xw)
        else:
            ops.moe_gate_up(gpu, self.tab_gate, self.tab_up, self.fmt_gu, self.ids, m * K, K, E, x, D, 0, self.h, I,
                            D, c.swiglu_limit, stream=stream, invariant=self.inv)
            ops.moe_gemv(gpu, self.tab_down, self.fmt_down, self.ids, m * K, K, E, self.h, K * I, I, self.y, D, I,
                         stream=stream, invariant=self.inv)
        if branch:
            gpu.join(stream)
        ys, ys_stride = NULL, D
        if fused:
            ys, ys_stride = self.y.offset(4 * K * D), S * D
        elif add_shared and self.shared is not None:
            ys = self.ys
        gate = self.glogit if int(ys) and self.shared_gate is not None else NULL
        ops.moe_weighted_sum(gpu, self.y, self.w, K, out, m, D, ys, gate, stream=stream, y_slots=S,
                             shared_stride=ys_stride)

    def _shared_expert(self, x, m: int, stream) -> None:
        """ys f32 [m, hidden] = the shared expert of x, through its own launches (not fused), on `stream`; the
        staged x of its fp8 GEMMs goes to its own workspace (xs)."""
        c, gpu, (g, _, d) = self.cfg, self.gpu, self.shared
        D, Is = c.hidden, self.inter_s
        if self.grouped(m, shared=True):  # one "expert" (table entry 0) for all m rows: no plan
            rows = ops.item_rows(m)   # the same sums in either item size
            ops.moe_gate_up_mma(gpu, self.tab_sh_gate, self.tab_sh_up, g.fmt, NULL, m, 1, 1, x, D, 0, self.hs, Is,
                                D, c.swiglu_limit, stream=stream, rows=rows, workspace=self.xs)
            ops.moe_gemv_mma(gpu, self.tab_sh_down, d.fmt, NULL, m, 1, 1, self.hs, Is, 0, self.ys, D, Is,
                             stream=stream, rows=rows, workspace=self.xs)
        else:
            ops.moe_gate_up(gpu, self.tab_sh_gate, self.tab_sh_up, g.fmt, self.zeros, m, 1, 1, x, D, 0, self.hs,
                            Is, D, c.swiglu_limit, stream=stream, invariant=self.inv)
            ops.moe_gemv(gpu, self.tab_sh_down, d.fmt, self.zeros, m, 1, 1, self.hs, Is, 0, self.ys, D, Is,
                         stream=stream, invariant=self.inv)

    def grouped(self, m: int, shared: bool = False) -> bool:
        """Whether a forward of m rows runs the grouped tensor-core GEMMs (the routed experts', or with `shared`
        the shared expert's) rather than the FMA GEMVs: at every m (up to the plan's MAX_PLAN_PAIRS) unless
        expert_kernels is "plain". Both are batch-invariant per pair; the grouped ones read each chosen expert
        once for all its rows."""
        if self.expert_kernels == "plain":
            return False
        return shared or m * (self.cfg.top_k + self.fuse_shared) <= ops.MAX_PLAN_PAIRS

    def _route(self, m: int, token_ids, token_ids_stride: int, stream) -> None:
        c, gpu = self.cfg, self.gpu
        args = (c.n_experts, c.top_k)
        if c.routing == "softmax":
            ops.moe_topk_softmax(gpu, self.logits, self.ids, self.w, m, *args, c.norm_topk_prob, c.routed_scaling,
                                 stream=stream)
        elif c.routing == "sigmoid_grouped":
            ops.moe_topk_sigmoid_grouped(gpu, self.logits, self.bias, self.ids, self.w, m, *args, c.n_group,
                                         c.topk_group, c.norm_topk_prob, c.routed_scaling, stream=stream)
        elif c.routing == "sqrtsoftplus":
            ops.moe_topk_sqrtsoftplus(gpu, self.logits, self.bias, self.ids, self.w, m, *args, c.norm_topk_prob,
                                      c.routed_scaling, stream=stream)
        else:
            if int(token_ids) == 0:
                raise InputError("hash-routed MoE needs token_ids")
            ops.moe_topk_hash(gpu, self.logits, token_ids, token_ids_stride, self.tid2eid, self.vocab, self.ids,
                              self.w, m, *args, c.hash_score, c.norm_topk_prob, c.routed_scaling, stream=stream)

    def selected_experts(self, m: int) -> set[int]:
        """The distinct experts the last forward's first m rows chose that this rank holds (reads the device)."""
        ids = self.gpu.read(self.ids, np.int32, m * self.cfg.top_k)
        return {int(e) for e in ids if int(e) in self.experts}

    def weight_bytes_per_step(self, m: int = 1, experts: int | None = None) -> int:
        """Bytes one decode step of m rows reads: the router, `experts` distinct experts (default min(m * top_k,
        n_experts), as if all were local), the shared expert and its gate."""
        g, u, d = next(iter(self.experts.values()))
        per_expert = g.weight_bytes + u.weight_bytes + d.weight_bytes
        n = min(m * self.cfg.top_k, self.cfg.n_experts) if experts is None else experts
        total = self.router.weight_bytes + n * per_expert
        if self.shared is not None:
            total += sum(L.weight_bytes for L in self.shared)
        if self.shared_gate is not None:
            total += self.shared_gate.weight_bytes
        return int(total)
