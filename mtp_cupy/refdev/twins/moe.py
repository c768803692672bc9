"""Twins of cuda_src/moe.cu (router top-k rules, expert GEMVs through pointer tables, the weighted sum) and
of cuda_src/moe_mma.cu (the routing plan and the grouped expert GEMMs that read it).

Scores and selection use the kernels' fp32 arithmetic (selection order: larger key, ties to the lower
expert id); GEMVs dequantise each chosen expert once (weights/quant_host.py) and accumulate in fp32, so
GPU-vs-twin differences are accumulation order only."""
import numpy as np

from ...ops.moe import X16_FORMATS
from ...runtime.dtypes import BF16, E8M0, FP8
from ...weights.quant_host import dequant_fp8_block, dequant_fp8_row, dequant_mxfp4, dequant_nvfp4
from ..registry import twin
from .elementwise import row_scalars, strided

F32 = np.float32
SCORES = {0: "softmax", 1: "sigmoid", 2: "sqrtsoftplus"}


# -- routing ---------------------------------------------------------------------------------------
def scores(z: np.ndarray, fn: str) -> np.ndarray:
    """fp32 scores of logits z [..., E]: softmax over E, sigmoid, or sqrt(softplus) (z itself above 20)."""
    z = z.astype(F32)
    with np.errstate(over="ignore", invalid="ignore"):
        if fn == "softmax":
            e = np.exp(z - z.max(-1, keepdims=True))
            return e / e.sum(-1, keepdims=True, dtype=F32)
        if fn == "sigmoid":
            return F32(1) / (F32(1) + np.exp(-z))
        return np.sqrt(np.where(z > 20, z, np.log1p(np.exp(z))))


def best_first(key: np.ndarray) -> np.ndarray:
    """Indices by key descending, ties to the lower index (NaN keys last)."""
    k = np.where(np.isnan(key), -np.inf, key)
    return np.lexsort((np.arange(k.size), -k.astype(np.float64)))


def select_row(sel: np.ndarray, top_k: int, n_group: int, topk_group: int) -> np.ndarray:
    """Top-k of one row's selection keys (NaN -> -inf) under the group limit: group score = sum of its two
    best keys, the topk_group best groups kept, every other expert's key -inf."""
    sel = np.where(np.isnan(sel), -np.inf, sel).astype(F32)
    if n_group > 1:
        g = sel.reshape(n_group, -1)
        two = -np.sort(-g, axis=1)[:, :2]
        keep = best_first(two[:, 0] + two[:, 1])[:topk_group]
        mask = np.zeros(n_group, bool)
        mask[keep] = True
        sel = np.where(np.repeat(mask, g.shape[1]), sel, -np.inf).astype(F32)
    return best_first(sel)[:top_k]


def finish(sc: np.ndarray, ids: np.ndarray, norm: int, eps: float, scale: float) -> np.ndarray:
    """Weights of one row's chosen ids: sc[id] (0 for an id outside [0, E)), / (sum + eps) when norm and
    the sum is positive, * scale."""
    ok = (ids >= 0) & (ids < sc.size)
    w = np.where(ok, sc[np.where(ok, ids, 0)], F32(0)).astype(F32)
    if norm and w.sum(dtype=F32) > 0:
        w = w / (w.sum(dtype=F32) + F32(eps))
    return (w * F32(scale)).astype(F32)


def _topk(dev, logits, bias, ids, w, m, E, top_k, n_group, topk_group, norm, eps, scale, fn):
    z = dev.view(logits, F32, (m, E))
    b = dev.view(bias, F32, E) if int(bias) else F32(0)
    sc = scores(z, fn)
    iv, wv = dev.view(ids, "i32", (m, top_k)), dev.view(w, F32, (m, top_k))
    for r in range(m):
        sel_ids = select_row(sc[r] + b, top_k, n_group, topk_group).astype(np.int32)
        iv[r], wv[r] = sel_ids, finish(sc[r], sel_ids, norm, eps, scale)


@twin("moe", "moe_topk_softmax")
def moe_topk_softmax(dev, logits, ids, w, m, n_experts, top_k, norm, scale):
    _topk(dev, logits, 0, ids, w, m, n_experts, top_k, 1, 1, norm, 0.0, scale, "softmax")


@twin("moe", "moe_topk_sigmoid_grouped")
def moe_topk_sigmoid_grouped(dev, logits, bias, ids, w, m, n_experts, top_k, n_group, topk_group, norm, scale):
    _topk(dev, logits, bias, ids, w, m, n_experts, top_k, n_group, topk_group, norm, 1e-20, scale, "sigmoid")


@twin("moe", "moe_topk_sqrtsoftplus")
def moe_topk_sqrtsoftplus(dev, logits, bias, ids, w, m, n_experts, top_k, norm, scale):
    _topk(dev, logits, bias, ids, w, m, n_experts, top_k, 1, 1, norm, 0.0, scale, "sqrtsoftplus")


@twin("moe", "moe_topk_hash")
def moe_topk_hash(dev, logits, token_ids, token_ids_stride, tid2eid, vocab, ids, w, m, n_experts, top_k, score_fn,
                  norm, scale):
    sc = scores(dev.view(logits, F32, (m, n_experts)), SCORES[int(score_fn)])
    toks = row_scalars(dev, token_ids, "i32", m, token_ids_stride)
    table = dev.view(tid2eid, "i32", (vocab, top_k))
    iv, wv = dev.view(ids, "i32", (m, top_k)), dev.view(w, F32, (m, top_k))
    for r in range(m):
        t = int(toks[r])
        sel_ids = table[t].copy() if 0 <= t < vocab else np.full(top_k, -1, np.int32)
        iv[r], wv[r] = sel_ids, finish(sc[r], sel_ids, norm, 0.0, scale)


# -- expert GEMVs ----------------------------------------------------------------------------------
def dequant(dev, fmt: str, w: int, s: int, s2: float, n: int, k: int) -> np.ndarray:
    """One expert projection's weight [n, k] as fp32, read from the table's addresses."""
    kb, nb = -(-k // 128), -(-n // 128)
    if fmt == "bf16":
        return dev.view(w, BF16, (n, k)).astype(F32)
    if fmt == "f32":
        return dev.view(w, F32, (n, k)).copy()
    if fmt == "fp8_row":
        return dequant_fp8_row(dev.view(w, FP8, (n, k)), dev.view(s, F32, n))
    if fmt == "fp8_block":
        return dequant_fp8_block(dev.view(w, FP8, (n, k)), dev.view(s, F32, (nb, kb)))
    if fmt == "fp8_block_e8m0":
        return dequant_fp8_block(dev.view(w, FP8, (n, k)), dev.view(s, E8M0, (nb, kb)))
    if fmt == "nvfp4":
        return dequant_nvfp4(dev.view(w, "u8", (n, k // 2)), dev.view(s, FP8, (n, k // 16)), s2)
    return dequant_mxfp4(dev.view(w, "u8", (n, k // 2)), dev.view(s, E8M0, (n, k // 32)))


def _table(dev, tab, n_experts: int):
    t = dev.view(tab, np.uint64, (n_experts, 3))
    return [(int(a), int(b), float(np.uint32(c & 0xFFFFFFFF).view(F32))) for a, b, c in t.tolist()]


def _pairs(dev, ids, n_pairs, n_slots, x, x_row_stride, x_slot_stride, K):
    """Expert id and input vector (fp32 [K]) of every pair."""
    e = dev.view(ids, "i32", n_pairs)
    rows = -(-n_pairs // n_slots)
    xv = strided(dev, x, BF16, (rows, n_slots, K), (x_row_stride, x_slot_stride, 1))
    return e, [xv[q // n_slots, q % n_slots].astype(F32) for q in range(n_pairs)]


def _expert_products(dev, fmt, tabs, ids, n_pairs, n_slots, n_experts, x, xrs, xss, N, K):
    """[n_pairs, len(tabs), N] fp32 products W_t[ids[q]] x_q; zeros for a NULL or out-of-range expert. Pairs
    are grouped by their table entries, so each distinct weight is dequantised once."""
    e, xs = _pairs(dev, ids, n_pairs, n_slots, x, xrs, xss, K)
    tables = [_table(dev, t, n_experts) for t in tabs]
    groups: dict[tuple, list[int]] = {}
    for q, ex in enumerate(e.tolist()):
        if 0 <= ex < n_experts and all(t[ex][0] for t in tables):
            groups.setdefault(tuple(t[ex] for t in tables), []).append(q)
    out = np.zeros((n_pairs, len(tabs), N), F32)
    for entries, qs in groups.items():
        # float64 products: a pair's result must not depend on which other pairs share its expert
        X = np.stack([xs[q] for q in qs], axis=1).astype(np.float64)
        for j, entry in enumerate(entries):
            out[qs, j] = (dequant(dev, fmt, *entry, N, K).astype(np.float64) @ X).T
    return out


def swiglu(g: np.ndarray, u: np.ndarray, limit: float) -> np.ndarray:
    """silu(g) * u in fp32; with limit > 0, g clamped above at limit and u to [-limit, limit] (NaN kept)."""
    if limit > 0:
        L = F32(limit)
        g = np.where(g > L, L, g)
        u = np.where(u > L, L, np.where(u < -L, -L, u))
    with np.errstate(over="ignore"):
        return (g / (F32(1) + np.exp(-g)) * u).astype(F32)


def _gemv(fmt):
    def fn(dev, tab, ids, n_pairs, n_slots, n_experts, x, x_row_stride, x_slot_stride, y, N, K):
        p = _expert_products(dev, fmt, [tab], ids, n_pairs, n_slots, n_experts, x, x_row_stride, x_slot_stride, N, K)
        dev.view(y, F32, (n_pairs, N))[:] = p[:, 0]
    return fn


def _gate_up(fmt):
    def fn(dev, tab_gate, tab_up, ids, n_pairs, n_slots, n_experts, x, x_row_stride, x_slot_stride, h, N, K, limit):
        p = _expert_products(dev, fmt, [tab_gate, tab_up], ids, n_pairs, n_slots, n_experts, x, x_row_stride,
                             x_slot_stride, N, K)
        dev.view(h, BF16, (n_pairs, N))[:] = swiglu(p[:, 0], p[:, 1], limit).astype(BF16)
    return fn


# the plain and the grouped (FP8) kernels compute the same per-pair products (they differ in launch shape only)
for _f in ("bf16", "f32", "fp8_row", "fp8_block", "fp8_block_e8m0", "nvfp4", "mxfp4"):
    for _g in ("", "grouped_") if _f.startswith("fp8") else ("",):
        twin("moe", f"moe_gemv_{_g}{_f}")(_gemv(_f))
        if _f != "f32":
            twin("moe", f"moe_gate_up_{_g}{_f}")(_gate_up(_f))


@twin("moe", "moe_weighted_sum")
def moe_weighted_sum(dev, y, w, top_k, y_slots, ys, ys_stride, gate, out, m, hidden):
    acc = np.einsum("rk,rkd->rd", dev.view(w, F32, (m, top_k)).astype(np.float64),
                    dev.view(y, F32, (m, y_slots, hidden))[:, :top_k].astype(np.float64))
    if int(ys):
        g = np.ones(m) if not int(gate) else 1.0 / (1.0 + np.exp(-dev.view(gate, F32, m).astype(np.float64)))
        acc += g[:, None] * strided(dev, ys, F32, (m, hidden), (ys_stride, 1))
    dev.view(out, BF16, (m, hidden))[:] = acc.astype(F32).astype(BF16)


# -- moe_mma: the routing plan and the grouped expert GEMMs ----------------------------------------------------
PLAN_ROWS, PLAN_HEADER = 32, 4


def plan_max_items(n_pairs: int, n_experts: int, rows: int) -> int:
    return min(n_pairs, min(n_pairs, n_experts) + n_pairs // rows)


@twin("moe_mma", "moe_route_plan")
def moe_route_plan(dev, tab, ids, n_pairs, n_experts, rows, top_k, shared_id, plan):
    n, E, R, K, sid = int(n_pairs), int(n_experts), int(rows), int(top_k), int(np.int32(shared_id))
    if sid >= 0:   # slot K of every row is the shared expert
        e = np.full((n // (K + 1), K + 1), sid, np.int64)
        routed = dev.view(ids, "i32", (n // (K + 1), K)).astype(np.int64)
        e[:, :K] = np.where(routed == sid, -1, routed)   # a routed slot never reaches the shared expert
        e = e.ravel()
    else:
        e = dev.view(ids, "i32", n).astype(np.int64)
    t = dev.view(tab, np.uint64, (E, 3))
    local = (e >= 0) & (e < E)
    local[local] = t[e[local], 0] != 0
    key = np.where(local, e, E)
    order = np.argsort(key, kind="stable")             # by expert, each expert's pairs in pair order
    counts = np.bincount(key, minlength=E + 1)
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])
    items = [(ex, (int(first[ex]) + j) << 8 | min(R, int(counts[ex]) - j))
             for ex in np.nonzero(counts[:E])[0].tolist() for j in range(0, int(counts[ex]), R)]
    mi = plan_max_items(n, E, R)
    dev.view(plan, np.uint32, PLAN_HEADER)[:] = (len(items), int(first[E]), PLAN_HEADER + 2 * mi, R)
    if items:
        dev.view(plan.offset(4 * PLAN_HEADER), np.uint32, (len(items), 2))[:] = items
    dev.view(plan.offset(4 * (PLAN_HEADER + 2 * mi)), np.uint32, n)[:] = order


def plan_units(dev, plan, n_pairs: int):
    """([(expert, pair ids)] per item, pair ids of no local expert) of a plan; plan NULL: entry 0 for every
    pair, PLAN_ROWS pairs an item (how a plan-less call is cut does not change a product)."""
    if not int(plan):
        return [(0, np.arange(q, min(q + PLAN_ROWS, n_pairs))) for q in range(0, n_pairs, PLAN_ROWS)], []
    count, none0, soff, _ = (int(v) for v in dev.view(plan, np.uint32, PLAN_HEADER))
    srt = dev.view(plan.offset(4 * soff), np.uint32, n_pairs).astype(np.int64)
    items = dev.view(plan.offset(4 * PLAN_HEADER), np.uint32, (count, 2)).tolist() if count else []
    return [(ex, srt[(v >> 8):(v >> 8) + (v & 0xFF)]) for ex, v in items], srt[none0:]


def _entry(dev, tab, e: int):
    a, b, c = dev.view(tab.offset(24 * e), np.uint64, 3).tolist()
    return int(a), int(b), float(np.uint32(c & 0xFFFFFFFF).view(F32))


PAIRS02 = [0, 2, 1, 3, 4, 6, 5, 7]   # moe_stage_f16's pairs02 order within each 8 elements


def _mma_x(dev, fmt, n_pairs, n_slots, x, xrs, xss, xsc, srs, sss, K) -> np.ndarray:
    """x of every (row, slot) as float64 [rows, n_slots, K]: bf16, or f16 for X16_FORMATS; times the pair's scale
    (xsc NULL: 1)."""
    rows = -(-n_pairs // n_slots)
    xv = strided(dev, x, np.float16 if fmt in X16_FORMATS else BF16, (rows, n_slots, K), (xrs, xss, 1))
    xv = xv.astype(np.float64)
    if fmt == "mxfp4":   # staged with pairs02: (0, 2, 1, 3, 4, 6, 5, 7) is its own inverse
        xv = xv.reshape(rows, n_slots, K // 8, 8)[..., PAIRS02].reshape(rows, n_slots, K)
    if int(xsc):
        xv = xv * strided(dev, xsc, F32, (rows, n_slots), (srs, sss))[:, :, None]   # powers of two: exact
    return xv


@twin("moe_mma", "moe_stage_f16")
def moe_stage_f16(dev, x, x_row_stride, x_slot_stride, n_slots, y, scale, n_vec, K, pairs02):
    v = np.arange(n_vec)
    xb = strided(dev, x, BF16, (-(-n_vec // n_slots), n_slots, K), (x_row_stride, x_slot_stride, 1))
    xv = xb[v // n_slots, v % n_slots].astype(F32)
    mag = xv.view(np.uint32) >> 16 & 0x7FFF          # bf16 magnitude bits, NaN above Inf
    mb = mag.max(axis=1).astype(np.int64)
    E = np.maximum(mb >> 7, 15)
    keep = (mb == 0) | (mb >= 0x7F80)
    mul = np.where(keep, F32(1), ((268 - E) << 23).astype(np.uint32).view(F32))
    sc = np.where(keep, F32(1), ((E - 14) << 23).astype(np.uint32).view(F32))
    with np.errstate(over="ignore", invalid="ignore"):
        yv = (xv * mul[:, None]).astype(np.float16)
    if pairs02:
        yv = yv.reshape(n_vec, K // 8, 8)[..., PAIRS02].reshape(n_vec, K)
    dev.view(y, np.float16, (n_vec, K))[:] = yv
    dev.view(scale, F32, n_vec)[:] = sc


def _mma_products(dev, fmt, tabs, plan, n_pairs, n_slots, x, xrs, xss, xsc, srs, sss, N, K):
    """(products fp32 [n_pairs, len(tabs), N], pairs the items hold, pairs that get zeros: no local expert or an
    entry NULL in these tables). The float64 products of _expert_products, each distinct weight dequantised
    once for all its pairs."""
    units, none = plan_units(dev, plan, n_pairs)
    xv = _mma_x(dev, fmt, n_pairs, n_slots, x, xrs, xss, xsc, srs, sss, K)
    groups: dict[tuple, list] = {}
    zeros = [np.asarray(none, np.int64)]
    for ex, qs in units:
        entries = tuple(_entry(dev, t, ex) for t in tabs)
        if all(en[0] for en in entries):
            groups.setdefault(entries, []).extend(int(q) for q in qs)
        else:
            zeros.append(np.asarray(qs, np.int64))
    out = np.zeros((n_pairs, len(tabs), N), F32)
    for entries, qs in groups.items():
        X = np.stack([xv[q // n_slots, q % n_slots] for q in qs], axis=1).astype(np.float64)
        for j, en in enumerate(entries):
            out[qs, j] = (dequant(dev, fmt, *en, N, K).astype(np.float64) @ X).T
    held = np.array(sorted(q for qs in groups.values() for q in qs), np.int64)
    return out, held, np.concatenate(zeros)


def _gemv_mma(fmt):
    def fn(dev, plan, tab, n_pairs, n_slots, x, x_row_stride, x_slot_stride, x_scale, s_row_stride, s_slot_stride,
           y, N, K):
        p, held, zeros = _mma_products(dev, fmt, [tab], plan, n_pairs, n_slots, x, x_row_stride, x_slot_stride,
                                       x_scale, s_row_stride, s_slot_stride, N, K)
        yv = dev.view(y, F32, (n_pairs, N))
        yv[held] = p[held, 0]
        yv[zeros] = 0
    return fn


def _gate_up_mma(fmt):
    def fn(dev, plan, tab_gate, tab_up, n_pairs, n_slots, x, x_row_stride, x_slot_stride, x_scale, s_row_stride,
           s_slot_stride, h, N, K, limit):
        p, held, zeros = _mma_products(dev, fmt, [tab_gate, tab_up], plan, n_pairs, n_slots, x, x_row_stride,
                                       x_slot_stride, x_scale, s_row_stride, s_slot_stride, N, K)
        hv = dev.view(h, BF16, (n_pairs, N))
        hv[held] = swiglu(p[held, 0], p[held, 1], limit).astype(BF16)
        hv[zeros] = 0
    return fn


for _f in ("bf16", "fp8_row", "fp8_block", "fp8_block_e8m0", "nvfp4", "mxfp4"):
    for _v in ("", "8"):   # 32- and 8-row items: the same products
        twin("moe_mma", f"moe_gemv_mma{_v}_{_f}")(_gemv_mma(_f))
        twin("moe_mma", f"moe_gate_up_mma{_v}_{_f}")(_gate_up_mma(_f))
