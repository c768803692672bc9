"""Launchers for cuda_src/moe.cu: router top-k rules, expert GEMVs through device pointer tables, the
routing-weighted sum. The MoE layer that strings them together is mtp_cupy/layers/moe.py.

A projection's pointer table (`expert_table`) is u64 [n_experts, 3] per expert: weight address, scale
address, nvfp4 scale2 as f32 bits; an all-zero entry is an expert held by another rank. Pair q = r *
n_slots + k is row r's k-th expert `ids[q]`; its input vector is x + r*x_row_stride + k*x_slot_stride."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..runtime.ptr import NULL
from ..weights.linear import Linear
from ._util import blocks_for, launch, need

__all__ = ["EXPERT_FORMATS", "ROUTER_SCORES", "expert_table", "moe_gemv", "moe_gate_up", "moe_topk_softmax",
           "moe_topk_sigmoid_grouped", "moe_topk_sqrtsoftplus", "moe_topk_hash", "moe_weighted_sum"]

EXPERT_FORMATS = ("bf16", "f32", "fp8_row", "fp8_block", "fp8_block_e8m0", "nvfp4", "mxfp4")
ROUTER_SCORES = {"softmax": 0, "sigmoid": 1, "sqrtsoftplus": 2}
WARPS = 8                        # expert GEMV blocks: 8 warps, 4 weight rows per warp
TARGET_WARPS = 4096              # ~32 resident warps on each of an H200's 132 SMs
MAX_EXPERTS = 4096               # routing keeps 2 floats per expert in shared memory (32 KB)
MAX_PAIRS = 65535                # grid.y
_SCALE_ALIGN = {"fp8_row": 4, "fp8_block": 4, "nvfp4": 2}
# elements per 16-byte weight chunk: k must be a multiple (a chunk never straddles a scale block)
CHUNK = {"bf16": 8, "f32": 4, "fp8_row": 16, "fp8_block": 16, "fp8_block_e8m0": 16, "nvfp4": 32, "mxfp4": 32}


def expert_table(projs: Sequence[Linear | None]) -> np.ndarray:
    """u64 [len(projs), 3] rows (weight, scale, scale2 bits); None -> a zero row (not on this rank).
    Entries need `fmt`, `weight`, `scale`, `scale2` (a Linear, or any object with those fields, such as an
    f32 router weight with fmt "f32")."""
    t = np.zeros((len(projs), 3), np.uint64)
    for e, L in enumerate(projs):
        if L is None:
            continue
        need(L.fmt in EXPERT_FORMATS, f"expert_table: format {L.fmt!r} is not one of {EXPERT_FORMATS}")
        need(int(L.weight) != 0 and int(L.weight) % 16 == 0, f"expert_table: weight of entry {e} is NULL or not "
             "16-byte aligned")
        need(L.fmt in ("bf16", "f32") or int(L.scale) % _SCALE_ALIGN.get(L.fmt, 1) == 0 and int(L.scale) != 0,
             f"expert_table: {L.fmt} scale of entry {e} is NULL or misaligned")
        t[e] = (int(L.weight), int(L.scale), int(np.float32(L.scale2).view(np.uint32)))
    return t


def _check_gemv(name: str, fmt: str, n_pairs: int, n_slots: int, n_experts: int, x, xrs: int, xss: int,
                n: int, k: int) -> None:
    need(fmt in EXPERT_FORMATS, f"{name}: unknown format {fmt!r}")
    need(1 <= n_pairs <= MAX_PAIRS and n_slots >= 1 and n_experts >= 1 and n >= 1,
         f"{name}: n_pairs {n_pairs}, n_slots {n_slots}, n_experts {n_experts}, n {n} out of range")
    need(k > 0 and k % CHUNK[fmt] == 0, f"{name}: k {k} must be a positive multiple of {CHUNK[fmt]}")
    need(int(x) % 16 == 0 and xrs % 8 == 0 and xss % 8 == 0,
         f"{name}: x must be 16-byte aligned with strides in multiples of 8 elements")


# Formats whose batched calls take the grouped shape. H200, k = 3, ctx 2048 (BENCHMARKS.md): FP8 experts gain
# (DeepSeek-V3 B = 64: 10.4 vs 11.6 ms per step), BF16 and FP4 ones lose (Qwen3-Next BF16 B = 32: 1.90 vs
# 1.26 ms; DeepSeek-V4 MXFP4 B = 32: 4.18 vs 3.12 ms): their grouped kernels run short of resident warps.
GROUPED_FORMATS = ("fp8_row", "fp8_block", "fp8_block_e8m0")


def _expert_launch(gpu, kind: str, fmt: str, n: int, k: int, outputs_per_warp: int, n_pairs: int, n_slots: int,
                   invariant: bool):
    """The launch of `kind` ("moe_gemv" / "moe_gate_up"): its grouped shape when several rows share the call
    and the format gains from it (several pairs of an expert per pass over its weights, half the outputs per
    warp), else the plain one.
    Block (32, ks, 8 / ks): ks warps split K when the row tiles alone (n / outputs_per_warp per pair) would
    leave the GPU short of warps, keeping >= 2 chunks per lane. ks is chosen as for the plain shape and
    the pairs of one row (n_slots = top_k) when batch-invariant, so a pair's sum order is the same in
    either shape and whatever the batch."""
    tiles = -(-n // outputs_per_warp) * (min(n_pairs, n_slots) if invariant else n_pairs)
    chunks = k // CHUNK[fmt]
    ks = 1
    while ks < WARPS and tiles * ks < TARGET_WARPS and chunks >= 64 * 2 * ks:
        ks *= 2
    grouped = n_pairs > n_slots and fmt in GROUPED_FORMATS
    opw = outputs_per_warp // 2 if grouped else outputs_per_warp
    groups = WARPS // ks
    name = f"{kind}_{'grouped_' if grouped else ''}{fmt}"
    return launch(gpu, "moe", name).grid(-(-n // (groups * opw)), n_pairs).block(32, ks, groups)


def moe_gemv(gpu, table, fmt: str, ids, n_pairs: int, n_slots: int, n_experts: int, x, x_row_stride: int,
             x_slot_stride: int, y, n: int, k: int, stream=None, invariant: bool = False) -> None:
    """y f32 [n_pairs, n] = W[ids[q]] x_q for every pair (zeros for an expert absent on this rank); each
    chosen expert's weight is streamed once. x bf16."""
    name = f"moe_gemv_{fmt}"
    _check_gemv(name, fmt, n_pairs, n_slots, n_experts, x, x_row_stride, x_slot_stride, n, k)
    _expert_launch(gpu, "moe_gemv", fmt, n, k, 4, n_pairs, n_slots, invariant).arg_ptr(table).arg_ptr(ids).arg_u32(n_pairs) \
        .arg_u32(n_slots).arg_u32(n_experts).arg_ptr(x).arg_u32(x_row_stride).arg_u32(x_slot_stride).arg_ptr(y) \
        .arg_u32(n).arg_u32(k).launch(stream)


def moe_gate_up(gpu, table_gate, table_up, fmt: str, ids, n_pairs: int, n_slots: int, n_experts: int, x,
                x_row_stride: int, x_slot_stride: int, h, n: int, k: int, limit: float = 0.0, stream=None,
                invariant: bool = False) -> None:
    """h bf16 [n_pairs, n] = silu(g) * u with g = Wg[ids[q]] x_q, u = Wu[ids[q]] x_q; with limit > 0,
    g = min(g, limit) and u = clamp(u, -limit, limit) first (DeepSeek-V4)."""
    name = f"moe_gate_up_{fmt}"
    need(fmt != "f32", f"{name}: f32 experts are not supported")
    _check_gemv(name, fmt, n_pairs, n_slots, n_experts, x, x_row_stride, x_slot_stride, n, k)
    need(limit >= 0, f"{name}: negative swiglu limit {limit}")
    _expert_launch(gpu, "moe_gate_up", fmt, n, k, 2, n_pairs, n_slots, invariant).arg_ptr(table_gate).arg_ptr(table_up).arg_ptr(ids) \
        .arg_u32(n_pairs).arg_u32(n_slots).arg_u32(n_experts).arg_ptr(x).arg_u32(x_row_stride) \
        .arg_u32(x_slot_stride).arg_ptr(h).arg_u32(n).arg_u32(k).arg_f32(limit).launch(stream)


def _route(gpu, name: str, m: int, n_experts: int, top_k: int):
    need(1 <= m <= MAX_PAIRS, f"{name}: m {m} out of range")
    need(1 <= top_k <= min(32, n_experts) and n_experts <= MAX_EXPERTS,
         f"{name}: top_k {top_k} must be in [1, min(32, n_experts)], n_experts {n_experts} <= {MAX_EXPERTS}")
    return launch(gpu, "moe", name).grid(m).block(32).shared(8 * n_experts)


def moe_topk_softmax(gpu, logits, ids, weights, m: int, n_experts: int, top_k: int, norm: bool = True,
                     scale: float = 1.0, stream=None) -> None:
    """Qwen3-Next: p = softmax(logits f32 [m, E]); ids i32 [m, top_k] = top-k of p (ties to the lower id);
    weights f32 = p[ids] (/ sum when norm) * scale."""
    _route(gpu, "moe_topk_softmax", m, n_experts, top_k).arg_ptr(logits).arg_ptr(ids).arg_ptr(weights) \
        .arg_u32(m).arg_u32(n_experts).arg_u32(top_k).arg_u32(bool(norm)).arg_f32(scale).launch(stream)


def moe_topk_sigmoid_grouped(gpu, logits, bias, ids, weights, m: int, n_experts: int, top_k: int, n_group: int = 1,
                             topk_group: int = 1, norm: bool = True, scale: float = 1.0, stream=None) -> None:
    """DeepSeek-V3 / GLM noaux_tc: s = sigmoid(logits); keys s + bias (f32 [E], NULL = none); with n_group > 1
    only the topk_group groups with the largest sum of their two best keys stay (others -inf); ids = top-k
    keys; weights = s[ids] (/ (sum + 1e-20) when norm) * scale."""
    name = "moe_topk_sigmoid_grouped"
    need(1 <= n_group <= 32 and n_experts % n_group == 0 and 1 <= topk_group <= n_group
         and (n_group == 1 or n_experts // n_group >= 2),
         f"{name}: n_group {n_group} / topk_group {topk_group} do not fit {n_experts} experts")
    _route(gpu, name, m, n_experts, top_k).arg_ptr(logits).arg_ptr(bias).arg_ptr(ids).arg_ptr(weights) \
        .arg_u32(m).arg_u32(n_experts).arg_u32(top_k).arg_u32(n_group).arg_u32(topk_group).arg_u32(bool(norm)) \
        .arg_f32(scale).launch(stream)


def moe_topk_sqrtsoftplus(gpu, logits, bias, ids, weights, m: int, n_experts: int, top_k: int, norm: bool = True,
                          scale: float = 1.0, stream=None) -> None:
    """DeepSeek-V4: s = sqrt(softplus(logits)); ids = top-k of s + bias (NULL = none); weights = s[ids]
    (/ sum when norm) * scale."""
    _route(gpu, "moe_topk_sqrtsoftplus", m, n_experts, top_k).arg_ptr(logits).arg_ptr(bias).arg_ptr(ids) \
        .arg_ptr(weights).arg_u32(m).arg_u32(n_experts).arg_u32(top_k).arg_u32(bool(norm)).arg_f32(scale) \
        .launch(stream)


def moe_topk_hash(gpu, logits, token_ids, token_ids_stride: int, tid2eid, vocab: int, ids, weights, m: int,
                  n_experts: int, top_k: int, score: str = "sqrtsoftplus", norm: bool = True, scale: float = 1.0,
                  stream=None) -> None:
    """DeepSeek-V4 hash layers: ids = tid2eid[token] (i32 [vocab, top_k]; token i32 read at token_ids +
    r * token_ids_stride bytes); weights = score(logits)[ids] (/ sum when norm) * scale. A token outside
    [0, vocab) selects nothing (ids -1, weights 0)."""
    name = "moe_topk_hash"
    need(score in ROUTER_SCORES, f"{name}: score {score!r} is not one of {list(ROUTER_SCORES)}")
    need(vocab >= 1 and token_ids_stride >= 4 and token_ids_stride % 4 == 0,
         f"{name}: vocab {vocab}, token_ids_stride {token_ids_stride}")
    _route(gpu, name, m, n_experts, top_k).arg_ptr(logits).arg_ptr(token_ids).arg_u32(token_ids_stride) \
        .arg_ptr(tid2eid).arg_u32(vocab).arg_ptr(ids).arg_ptr(weights).arg_u32(m).arg_u32(n_experts) \
        .arg_u32(top_k).arg_u32(ROUTER_SCORES[score]).arg_u32(bool(norm)).arg_f32(scale).launch(stream)


def moe_weighted_sum(gpu, y, weights, top_k: int, out, m: int, hidden: int, shared=NULL, shared_gate=NULL,
                     stream=None) -> None:
    """out bf16 [m, hidden] = sum_k weights[r, k] * y[r, k] (y f32 [m, top_k, hidden]) + g_r * shared[r]
    (f32 [m, hidden], NULL = none), g_r = sigmoid(shared_gate[r]) (f32 [m]) or 1 when shared_gate is NULL."""
    need(m >= 1 and hidden >= 1 and top_k >= 1, f"moe_weighted_sum: m {m}, hidden {hidden}, top_k {top_k}")
    launch(gpu, "moe", "moe_weighted_sum").grid(blocks_for(m * hidden)).block(256).arg_ptr(y).arg_ptr(weights) \
        .arg_u32(top_k).arg_ptr(shared).arg_ptr(shared_gate).arg_ptr(out).arg_u32(m).arg_u32(hidden).launch(stream)
