"""Launchers for cuda_src/moe.cu: router top-k rules, expert GEMVs through device pointer tables, the
routing-weighted sum, and for batches the tensor-core grouped expert GEMMs of cuda_src/moe_mma.cu with the
routing plan they read. The MoE layer that strings them together is mtp_cupy/layers/moe.py.

A projection's pointer table (`expert_table`) is u64 [n_experts, 3] per expert: weight address, scale
address, nvfp4 scale2 as f32 bits; an all-zero entry is an expert held by another rank. Pair q = r *
n_slots + k is row r's k-th expert `ids[q]`; its input vector is x + r*x_row_stride + k*x_slot_stride."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..runtime.ptr import NULL, DevicePtr
from ..weights.linear import Linear
from ._util import blocks_for, kept_workspace, launch, need
from .gemv import SMEM_PER_BLOCK, SMEM_PER_SM, _sms, warps_by_regs

__all__ = ["EXPERT_FORMATS", "ROUTER_SCORES", "MMA_FORMATS", "PLAN_ROWS", "MMA8_ROWS", "ITEMS32_FROM", "item_rows",
           "MAX_PLAN_PAIRS", "expert_table", "moe_gemv",
           "moe_gate_up", "moe_topk_softmax", "moe_topk_sigmoid_grouped", "moe_topk_sqrtsoftplus", "moe_topk_hash",
           "moe_weighted_sum", "plan_max_items", "moe_plan_bytes", "moe_route_plan", "moe_gate_up_mma",
           "moe_gemv_mma", "X16_FORMATS", "mma_x_bytes", "moe_stage_f16", "moe_stage_x"]

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
                     stream=None, y_slots: int | None = None, shared_stride: int | None = None) -> None:
    """out bf16 [m, hidden] = sum_k weights[r, k] * y[r, k] (y f32 [m, y_slots, hidden], the first top_k slots
    read) + g_r * shared[r] (f32 rows `shared_stride` elements apart, default hidden; NULL = none), g_r =
    sigmoid(shared_gate[r]) (f32 [m]) or 1 when shared_gate is NULL. A shared expert fused into the routed
    call passes y_slots = top_k + 1 and shared = slot top_k of y (shared_stride = y_slots * hidden)."""
    slots = top_k if y_slots is None else y_slots
    stride = hidden if shared_stride is None else shared_stride
    need(m >= 1 and hidden >= 1 and top_k >= 1 and slots >= top_k and stride >= hidden,
         f"moe_weighted_sum: m {m}, hidden {hidden}, top_k {top_k}, y_slots {slots}, shared_stride {stride}")
    launch(gpu, "moe", "moe_weighted_sum").grid(blocks_for(m * hidden)).block(256).arg_ptr(y).arg_ptr(weights) \
        .arg_u32(top_k).arg_u32(slots).arg_ptr(shared).arg_u32(stride).arg_ptr(shared_gate).arg_ptr(out) \
        .arg_u32(m).arg_u32(hidden).launch(stream)


# -- grouped expert GEMMs (cuda_src/moe_mma.cu) ------------------------------------------------------------
# The routing plan groups a call's pairs by expert (this rank's, ascending id; each expert's pairs in pair order)
# into items of at most `rows` (PLAN_ROWS or MMA8_ROWS) pairs; the GEMMs stream each (item, 16- or 32-row weight
# tile) once with the tensor cores, for all the item's x rows. Layout of a plan (u32 words): [items, none_start,
# sorted offset, rows], then max_items (expert, first << 8 | pairs) pairs of words, then the n_pairs pair ids in
# plan order.
MMA_FORMATS = ("bf16", "fp8_row", "fp8_block", "fp8_block_e8m0", "nvfp4", "mxfp4")
# Formats whose GEMMs read x as f16 staged by moe_stage_f16 (e4m3 widens to f16 in one instruction a pair: the
# bf16 decode took ~2.4x the instructions of the hot loop; MXFP4's codes become e4m3 bytes in ~1 instruction a
# code, and its power-of-two block scales move from every weight pair onto each block's sum); the others read x
# as it comes (bf16).
X16_FORMATS = ("fp8_row", "fp8_block", "fp8_block_e8m0", "mxfp4")
PLAN_ROWS = 32                   # pairs per item: the kernels' 4 n-tiles of 8 x rows
MMA8_ROWS = 8                    # pairs per item of the one-n-tile kernels (moe_*_mma8_*)
# A plan-less call (one weight: a shared expert; the grouped GEMVs) takes 32-row items from this many rows up: at
# m = 16 and 32 they lose to 8-row items (half the warps an SM: ~190 registers against ~110), at m = 64 they win
# (H100: V4's shared expert 38.0 / 50.4 µs at m = 32 in 8- / 32-row items, 58.0 / 55.3 at 64; V4's wo_a 40.8 /
# 40.7 and 72.7 / 62.4; BENCHMARKS.md, twenty-eighth session)
ITEMS32_FROM = 33
PLAN_HEADER = 4                  # u32 words before the items
MAX_PLAN_PAIRS = 32768           # the plan kernel keeps 4 bytes per pair and 8 per expert in shared memory
MMA_STAGE = 32 * 8 * 16          # ring bytes per warp and stage: 32 weight rows x 8 chunks of 16 bytes
MX_ROW_CHUNKS = 9                # MXFP4's ring rows carry a chunk of padding (moe_mma.cu MX_ROW): no bank conflicts
MMA_MAX_STAGES = 8
MMA_MAX_KS = 4                   # warps per block (the kernels' launch bound is 128 threads)
# A call of at most this many rounds of work units over the resident blocks spreads them evenly (fewer blocks,
# each walking the same count): H200, MoE.forward at m = 1, DeepSeek-V3 (1152 / 2016 units on 528 blocks)
# 153 -> 147 us, V4 (768 units) 98 -> 96 us; at 6 or more rounds (m >= 4) the full grid was 2-5% faster.
EVEN_ROUNDS_MAX = 3
# registers per thread of the 32-pair kernels where the backend cannot say (nvcc 13, sm_90a:
# scripts/compile_kernels.sh; the mma8 ones use ~110); only the launch geometry uses them, and geometry never
# changes a result
_MMA_REGS = {"bf16": 164, "fp8_row": 187, "fp8_block": 191, "fp8_block_e8m0": 191, "nvfp4": 251, "mxfp4": 251}


def plan_max_items(n_pairs: int, n_experts: int, rows: int = PLAN_ROWS) -> int:
    """An upper bound on a plan's items: each local expert's first item, plus one per further `rows` pairs."""
    return min(n_pairs, min(n_pairs, n_experts) + n_pairs // rows)


def moe_plan_bytes(n_pairs: int, n_experts: int, rows: int = PLAN_ROWS) -> int:
    """Bytes of the plan of a call of `n_pairs` pairs over `n_experts` experts in items of `rows` pairs (a
    buffer for the largest call serves every smaller one, and one for MMA8_ROWS every larger `rows`)."""
    return 4 * (PLAN_HEADER + 2 * plan_max_items(n_pairs, n_experts, rows) + n_pairs)


def moe_route_plan(gpu, table, ids, n_pairs: int, n_experts: int, plan, stream=None, rows: int = PLAN_ROWS,
                   top_k: int = 1, shared_id: int = -1) -> None:
    """Build the routing plan of ids i32 [n_pairs] on the device (one block; no host sync, graph-safe): the
    distinct experts whose `table` entry is non-zero, each one's pairs in ascending order, cut into items of
    `rows` pairs (PLAN_ROWS for moe_gemv_mma / moe_gate_up_mma, MMA8_ROWS for their rows=MMA8_ROWS form), then
    the pairs of no local expert (another rank's, or an id outside [0, n_experts)). With shared_id >= 0, ids
    are [n_pairs / (top_k + 1), top_k] and every row gets one more pair, slot top_k, of expert shared_id (a
    shared expert fused into the routed call). A function of ids, the table, `rows` and the shared slot alone.
    `plan` holds moe_plan_bytes(n_pairs, n_experts, rows) bytes."""
    name = "moe_route_plan"
    need(1 <= n_pairs <= MAX_PLAN_PAIRS and 1 <= n_experts <= MAX_EXPERTS,
         f"{name}: n_pairs {n_pairs} must be in [1, {MAX_PLAN_PAIRS}], n_experts {n_experts} in [1, {MAX_EXPERTS}]")
    _check_rows(name, rows)
    need(top_k >= 1 and shared_id < n_experts and (shared_id < 0 or n_pairs % (top_k + 1) == 0),
         f"{name}: top_k {top_k}, shared_id {shared_id} (below {n_experts}; n_pairs {n_pairs} a multiple of "
         "top_k + 1 with a shared slot)")
    need(int(plan) != 0 and int(plan) % 16 == 0 and int(ids) != 0 and int(table) != 0,
         f"{name}: plan (16-byte aligned), ids and table must not be NULL")
    launch(gpu, "moe_mma", name).grid(1).block(1024).shared(_dynamic_smem(4 * (2 * (n_experts + 1) + n_pairs))) \
        .arg_ptr(table) \
        .arg_ptr(ids).arg_u32(n_pairs).arg_u32(n_experts).arg_u32(rows).arg_u32(top_k).arg_i32(shared_id) \
        .arg_ptr(plan).launch(stream)


def mma_ks(fmt: str, k: int) -> int:
    """Warps splitting k in the grouped GEMMs: a function of (format, k) only, so a pair's sum order (hence its
    result, bit for bit) is the same whatever pairs share the call and whichever `rows` the call uses. Doubles up
    to MMA_MAX_KS while every warp keeps at least 4 stage units (128-byte runs of each of its 32 rows)."""
    units = -(-(k // CHUNK[fmt]) // 8)
    ks = 1
    while ks < MMA_MAX_KS and units >= 4 * 2 * ks:
        ks *= 2
    return ks


_MMA_NUM_REGS: dict[tuple, int] = {}


def _mma_regs(gpu, name: str, fmt: str) -> int:
    key = (gpu.name, getattr(gpu, "device_id", 0), name)
    if key not in _MMA_NUM_REGS:
        try:
            _MMA_NUM_REGS[key] = int(gpu.kernel("moe_mma", name).fn.num_regs)
        except Exception:  # the NumPy device: the table's estimate
            _MMA_NUM_REGS[key] = _MMA_REGS[fmt]
    return _MMA_NUM_REGS[key]


def _mma_launch(gpu, name: str, fmt: str, n: int, k: int, outputs: int, items: int, rows: int,
                blocks: int | None = None):
    """Block (32, ks); a persistent grid of as many blocks as fit on the GPU at once (by registers), or fewer
    that share the (item, tile) work units evenly when they are at most EVEN_ROUNDS_MAX rounds of the full grid;
    at most one block per work unit and at most `blocks`; a ring as deep as shared memory allows them (2 .. 8
    stages, at most a warp's units + 1). None of it changes a result but ks (mma_ks)."""
    ks = mma_ks(fmt, k)
    per_sm = max(1, min(32, 64 // ks, warps_by_regs(_mma_regs(gpu, name, fmt)) // ks))
    units = -(-(k // CHUNK[fmt]) // 8)
    per_warp = -(-units // ks)
    red = mma_red_bytes(ks, rows)
    stage = MMA_STAGE // 8 * MX_ROW_CHUNKS if fmt == "mxfp4" else MMA_STAGE
    stages = min(MMA_MAX_STAGES, per_warp + 1, (SMEM_PER_SM // per_sm - 1024 - red) // (ks * stage))
    stages = max(2, min(stages, (SMEM_PER_BLOCK - red) // (ks * stage)))
    work, cap = items * -(-n // outputs), _sms(gpu) * per_sm
    need(blocks is None or blocks >= 1, f"{name}: blocks {blocks} must be >= 1")
    rounds = -(-work // cap)
    if rounds <= EVEN_ROUNDS_MAX:   # as many blocks as give every block the same count of work units
        cap = -(-work // rounds)
    blocks = max(1, min(cap, work, blocks or work))
    return launch(gpu, "moe_mma", name).grid(blocks).block(32, ks).shared(
        _dynamic_smem(ks * stages * stage + red))


def mma_red_bytes(ks: int, rows: int = PLAN_ROWS) -> int:
    """The grouped GEMMs' reduction area after the rings: two buffers of ks warps x (rows sums: 2 slabs x rows / 8
    n-tiles x 4) x 32 lanes, f32."""
    return 2 * ks * rows * 32 * 4 if ks > 1 else 0


def _dynamic_smem(nbytes: int, static: int = 256) -> int:
    """Dynamic shared bytes to launch with: beyond 48 KiB a kernel needs the opt-in attribute, which the backend
    sets only for dynamic sizes past 48 KiB, but the 48 KiB default counts static shared memory too (the GEMMs'
    128-byte pair list, the plan's 256-byte scan area): a size just under 48 KiB is raised past it (the kernels
    size their rings by whole stages, so the extra bytes go unused)."""
    return 48 * 1024 + 16 if 48 * 1024 - static < nbytes <= 48 * 1024 else nbytes


def item_rows(m: int) -> int:
    """Rows an item of a plan-less grouped GEMM takes at m rows: MMA8_ROWS below ITEMS32_FROM, else PLAN_ROWS.
    A row's sums are the same either way (batch invariance holds across the switch)."""
    return MMA8_ROWS if m < ITEMS32_FROM else PLAN_ROWS


def _check_rows(name: str, rows: int) -> None:
    need(rows in (PLAN_ROWS, MMA8_ROWS), f"{name}: rows {rows} must be {PLAN_ROWS} or {MMA8_ROWS}")


def _mma_name(kind: str, fmt: str, rows: int) -> str:
    _check_rows(kind, rows)
    return f"{kind}{'8' if rows == MMA8_ROWS else ''}_{fmt}"


def _check_mma(name: str, fmt: str, plan, n_pairs: int, n_slots: int, n_experts: int, x, xrs: int, xss: int,
               n: int, k: int, rows: int) -> int:
    """The launch's items bound (plan_max_items, or the pairs / rows of a plan-less call)."""
    need(fmt in MMA_FORMATS, f"{name}: format {fmt!r} is not one of {MMA_FORMATS}")
    top = MAX_PLAN_PAIRS if int(plan) else MAX_PAIRS
    need(1 <= n_pairs <= top and n_slots >= 1 and n_experts >= 1 and n >= 1,
         f"{name}: n_pairs {n_pairs} (at most {top}), n_slots {n_slots}, n_experts {n_experts}, n {n} out of range")
    need(k > 0 and k % CHUNK[fmt] == 0, f"{name}: k {k} must be a positive multiple of {CHUNK[fmt]}")
    need(int(x) % 16 == 0 and xrs % 8 == 0 and xss % 8 == 0,
         f"{name}: x must be 16-byte aligned with strides in multiples of 8 elements")
    need(int(plan) % 16 == 0, f"{name}: plan 0x{int(plan):x} is not 16-byte aligned")
    return plan_max_items(n_pairs, n_experts, rows) if int(plan) else -(-n_pairs // rows)


def _x16_scales_at(n_vec: int, k: int) -> int:
    """Offset of the staged x's f32 scales in its workspace: after the f16 vectors, 256-byte aligned."""
    return -(-2 * n_vec * k // 256) * 256


def mma_x_bytes(fmt: str, n_vec: int, k: int) -> int:
    """Workspace bytes a grouped GEMM call of `fmt` needs for its staged x: n_vec vectors of k (the rows of an x
    read with slot stride 0, else every pair's) as f16, then their f32 scales; 0 for the formats that read bf16."""
    return 0 if fmt not in X16_FORMATS else _x16_scales_at(n_vec, k) + 4 * n_vec


def moe_stage_f16(gpu, x, x_row_stride: int, x_slot_stride: int, n_slots: int, y, scale, n_vec: int, k: int,
                  stream=None, pairs02: bool = False) -> None:
    """x for the f16-reading grouped GEMMs (X16_FORMATS): vector v < n_vec (row v // n_slots, slot v % n_slots of
    x bf16, strides in elements) -> y f16 [n_vec, k] = x_v * 2^-e_v and scale f32 [n_vec] = 2^e_v, e_v putting the
    vector's largest magnitude in [2^14, 2^15): every element within 2^31 of it converts exactly, so the GEMMs'
    exact f16 products, times the scale, sum as bf16 ones would. A vector holding Inf or NaN, or only zeros, keeps e_v = 0.
    pairs02: each group of 8 elements is stored as elements (0, 2, 1, 3, 4, 6, 5, 7), so every f16 word holds a
    (k, k + 2) pair (the MXFP4 GEMMs' mma operand order)."""
    name = "moe_stage_f16"
    need(n_vec >= 1 and n_slots >= 1 and k > 0 and k % 8 == 0, f"{name}: n_vec {n_vec}, n_slots {n_slots}, k {k} "
         "(a positive multiple of 8)")
    need(all(int(p) % 16 == 0 and int(p) for p in (x, y)) and int(scale) % 4 == 0 and int(scale)
         and x_row_stride % 8 == 0 and x_slot_stride % 8 == 0,
         f"{name}: x, y 16-byte aligned, scale 4-byte aligned, none NULL, strides multiples of 8 elements")
    launch(gpu, "moe_mma", name).grid(n_vec).block(128).arg_ptr(x).arg_u32(x_row_stride).arg_u32(x_slot_stride) \
        .arg_u32(n_slots).arg_ptr(y).arg_ptr(scale).arg_u32(n_vec).arg_u32(k).arg_u32(int(pairs02)).launch(stream)


def _staged_x(gpu, fmt: str, x, xrs: int, xss: int, n_pairs: int, n_slots: int, k: int, workspace, stream,
              launch_stage: bool = True):
    """(x, row stride, slot stride, x_scale, scale row stride, scale slot stride) as the GEMM of `fmt` reads them:
    x itself for the bf16-reading formats; for X16_FORMATS its f16 copy in `workspace` (None: one the launcher
    keeps), one vector per row when the slot stride is 0 (every slot reads the row), else one per pair, staged
    here unless `launch_stage` is False (moe_stage_x ran already)."""
    if fmt not in X16_FORMATS:
        return x, xrs, xss, NULL, 0, 0
    per_row = xss == 0
    n_vec = -(-n_pairs // n_slots) if per_row else n_pairs
    ws = DevicePtr(int(workspace)) if workspace else kept_workspace(gpu, "moe_mma_x", mma_x_bytes(fmt, n_vec, k))
    y, sc = ws, ws.offset(_x16_scales_at(n_vec, k))
    if launch_stage:
        moe_stage_f16(gpu, x, xrs, 0 if per_row else xss, 1 if per_row else n_slots, y, sc, n_vec, k, stream,
                      pairs02=fmt == "mxfp4")
    return (y, k, 0, sc, 1, 0) if per_row else (y, n_slots * k, k, sc, n_slots, 1)


def _check_staged(name: str, fmt: str, staged: bool, workspace) -> None:
    """A staged call of an f16-reading format reads a workspace: it must be given (None takes the launcher's own)."""
    need(not staged or fmt not in X16_FORMATS or (workspace is not None and int(workspace) != 0),
         f"{name}: the staged x lives in a workspace (moe_stage_x writes it, the GEMM reads it); none was given")


def moe_stage_x(gpu, fmt: str, x, x_row_stride: int, x_slot_stride: int, n_pairs: int, n_slots: int, k: int,
                workspace, stream=None) -> None:
    """Stage x for a later grouped GEMM call of `fmt` (moe_gate_up_mma / moe_gemv_mma with the same x, strides,
    n_pairs, n_slots, k and `workspace`, and staged=True), so the staging can run earlier, or on another stream,
    than the GEMM: as that GEMM would stage it (moe_stage_f16) for X16_FORMATS, nothing for the others.
    `workspace`: a device pointer of mma_x_bytes bytes, which the GEMM then reads."""
    need(fmt in MMA_FORMATS, f"moe_stage_x: unknown format {fmt!r}; one of {MMA_FORMATS}")
    _check_staged("moe_stage_x", fmt, True, workspace)
    _staged_x(gpu, fmt, x, x_row_stride, x_slot_stride, n_pairs, n_slots, k, workspace, stream)


def moe_gemv_mma(gpu, table, fmt: str, plan, n_pairs: int, n_slots: int, n_experts: int, x, x_row_stride: int,
                 x_slot_stride: int, y, n: int, k: int, stream=None, rows: int = PLAN_ROWS,
                 blocks: int | None = None, workspace=None, staged: bool = False) -> None:
    """y f32 [n_pairs, n] = W[e] x_q for every pair q, e its expert by `plan` (moe_route_plan of the same
    n_pairs / n_experts and `rows`); zeros for a pair of no local expert. plan NULL: every pair uses table entry
    0 (a single weight, such as the shared expert's). Tensor cores, each (expert, 32-row tile) read once per
    item of up to `rows` pairs: PLAN_ROWS (4 n-tiles) or MMA8_ROWS (one n-tile: fewer registers, twice the
    warps an SM; MoE's choice at every width). Always batch-invariant: a pair's result does not depend on the
    other pairs, nor on `rows`. `blocks` caps the persistent grid (each block then walks more work units; the
    result does not change). x bf16; the fp8 and MXFP4 formats (X16_FORMATS) first stage it as f16 (moe_stage_f16) in
    `workspace`, a device pointer of mma_x_bytes(fmt, vectors, k) bytes (None: one the launcher keeps), unless
    `staged`: moe_stage_x of the same arguments staged it there already (ordered before this call)."""
    name = _mma_name("moe_gemv_mma", fmt, rows)
    items = _check_mma(name, fmt, plan, n_pairs, n_slots, n_experts, x, x_row_stride, x_slot_stride, n, k, rows)
    _check_staged(name, fmt, staged, workspace)
    x, x_row_stride, x_slot_stride, x_scale, s_row_stride, s_slot_stride = _staged_x(
        gpu, fmt, x, x_row_stride, x_slot_stride, n_pairs, n_slots, k, workspace, stream, not staged)
    _mma_launch(gpu, name, fmt, n, k, 32, items, rows, blocks).arg_ptr(plan).arg_ptr(table).arg_u32(n_pairs) \
        .arg_u32(n_slots).arg_ptr(x).arg_u32(x_row_stride).arg_u32(x_slot_stride).arg_ptr(x_scale) \
        .arg_u32(s_row_stride).arg_u32(s_slot_stride).arg_ptr(y).arg_u32(n).arg_u32(k).launch(stream)


def moe_gate_up_mma(gpu, table_gate, table_up, fmt: str, plan, n_pairs: int, n_slots: int, n_experts: int, x,
                    x_row_stride: int, x_slot_stride: int, h, n: int, k: int, limit: float = 0.0,
                    stream=None, rows: int = PLAN_ROWS, blocks: int | None = None, workspace=None,
                    staged: bool = False) -> None:
    """h bf16 [n_pairs, n] = silu(g) * u, g = Wg[e] x_q, u = Wu[e] x_q (with limit > 0, g = min(g, limit) and
    u = clamp(u, -limit, limit) first), e by `plan` as in moe_gemv_mma (`rows`, `blocks`, `workspace`, `staged`
    too); 16 gate rows and the same 16 up rows per tile."""
    name = _mma_name("moe_gate_up_mma", fmt, rows)
    items = _check_mma(name, fmt, plan, n_pairs, n_slots, n_experts, x, x_row_stride, x_slot_stride, n, k, rows)
    need(limit >= 0, f"{name}: negative swiglu limit {limit}")
    _check_staged(name, fmt, staged, workspace)
    x, x_row_stride, x_slot_stride, x_scale, s_row_stride, s_slot_stride = _staged_x(
        gpu, fmt, x, x_row_stride, x_slot_stride, n_pairs, n_slots, k, workspace, stream, not staged)
    _mma_launch(gpu, name, fmt, n, k, 16, items, rows, blocks).arg_ptr(plan).arg_ptr(table_gate).arg_ptr(table_up) \
        .arg_u32(n_pairs).arg_u32(n_slots).arg_ptr(x).arg_u32(x_row_stride).arg_u32(x_slot_stride) \
        .arg_ptr(x_scale).arg_u32(s_row_stride).arg_u32(s_slot_stride).arg_ptr(h).arg_u32(n).arg_u32(k) \
        .arg_f32(limit).launch(stream)
