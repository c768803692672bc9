// Tensor-core grouped expert GEMMs for batches, and the routing plan they read (launchers in ops/moe.py,
// twins in refdev/twins/moe.py, the layer in layers/moe.py).
//
// Plan (moe_route_plan, one block). Pair q = row q / n_slots, slot q % n_slots chose expert ids[q]. The plan
// groups the pairs by expert: this rank's experts (table entry non-zero) in ascending id order, each one's
// pairs in ascending pair order, cut into items of at most `rows` pairs (32 for the GEMMs below, 8 for their
// one-n-tile "mma8" forms); pairs without a local expert (another rank's, or an id outside [0, n_experts)) come
// last, as the "none" list. Layout, u32 words:
//   [0] items, [1] none_start (= pairs with a local expert), [2] offset of `sorted` (words), [3] rows,
//   [4 ..) items (uint2 each: expert id, first sorted position << 8 | pairs), max_items of them,
//   sorted[n_pairs] at plan + plan[2]: the pair ids in that order.
// max_items = min(n_pairs, min(n_pairs, n_experts) + n_pairs / rows) (ops.moe.plan_max_items). Ranks
// within an expert come from one warp walking the pairs in order (__match_any_sync), and the counts and
// offsets are integer sums: the plan is a function of ids and the table alone (no atomics). Graph-safe:
// buffers sized by n_pairs, nothing read back by the host.
//
// GEMMs (moe_gate_up_mma_<fmt>, moe_gemv_mma_<fmt>). Work unit = (item, weight-row tile); a persistent grid
// of blocks (32, KS) walks the units b, b + gridDim.x, ... while below items * tiles (read from the plan), so
// no block waits on a plan slot that is empty. A unit streams its expert's tile once with the mma_stream
// machinery of gemv.cu (cp.async ring per warp, warp ks taking k units ks, ks + KS, ...; weights decoded in
// registers, fp8 and MXFP4 to f16 against x staged as f16 by moe_stage_f16, the others to bf16; mma.sync
// m16n8k16) and multiplies it by all the item's gathered x rows (MT n-tiles of 8: up to 8 MT rows in one pass;
// an expert with more pairs has several items). MT = 4 (32-row items) for batches; MT = 1 (the mma8 kernels,
// 8-row items) for few rows, where the 4 n-tiles' registers would halve the warps an SM holds. Tile: 2 slabs of
// 16 weight rows: gate/up = 16 gate rows + the same 16 up rows (16 outputs, SwiGLU in the epilogue); down = 32
// rows of one matrix. Results are scattered to the item's pairs' output rows. A pair's arithmetic (the k units
// of each warp, the mma order of chained_acc in stream_mma.cuh or MXFP4's block sums, the slice order of the KS
// partial sums) depends on (format, N, K, KS) only; the launcher picks KS from (format, K): a pair's result is
// bit-identical whatever other pairs share the call, and whichever n-tile column it lands in. plan == NULL: one
// weight (table entry 0) for every pair, items of 8 MT consecutive pairs (the shared expert).
#include "common.cuh"
#include "stream_mma.cuh"

// ---------------------------------------------------------------------------------------------------
// Routing plan.

constexpr u32 PLAN_HEADER = 4;  // u32 words before the items

__device__ __forceinline__ u32 plan_max_items(u32 n_pairs, u32 n_experts, u32 rows) {
    return min(n_pairs, min(n_pairs, n_experts) + n_pairs / rows);
}

// Exclusive prefix sums of a[0, n) and b[0, n) in shared memory, in place, by the whole block (blockDim.x a
// multiple of 32, at most 1024; ws: 64 words of shared memory).
__device__ void scan2_exclusive(u32* a, u32* b, u32 n, u32* ws) {
    const u32 tid = threadIdx.x, lane = tid & 31, wid = tid >> 5, nw = blockDim.x >> 5;
    const u32 per = (n + blockDim.x - 1) / blockDim.x, lo = min(n, tid * per), hi = min(n, lo + per);
    u32 sa = 0, sb = 0;
    for (u32 i = lo; i < hi; ++i) sa += a[i], sb += b[i];
    u32 ia = sa, ib = sb;  // inclusive over the warp's threads
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const u32 va = __shfl_up_sync(0xffffffffu, ia, o), vb = __shfl_up_sync(0xffffffffu, ib, o);
        if (lane >= (u32)o) ia += va, ib += vb;
    }
    if (lane == 31) ws[wid] = ia, ws[32 + wid] = ib;
    __syncthreads();
    if (wid == 0) {  // the warps' totals -> their exclusive offsets
        const u32 xa = lane < nw ? ws[lane] : 0u, xb = lane < nw ? ws[32 + lane] : 0u;
        u32 ya = xa, yb = xb;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const u32 va = __shfl_up_sync(0xffffffffu, ya, o), vb = __shfl_up_sync(0xffffffffu, yb, o);
            if (lane >= (u32)o) ya += va, yb += vb;
        }
        ws[lane] = ya - xa, ws[32 + lane] = yb - xb;
    }
    __syncthreads();
    u32 pa = ws[wid] + ia - sa, pb = ws[32 + wid] + ib - sb;
    for (u32 i = lo; i < hi; ++i) {
        const u32 va = a[i], vb = b[i];
        a[i] = pa, b[i] = pb;
        pa += va, pb += vb;
    }
    __syncthreads();
}

// Grid 1, block 1024, dynamic shared memory 4 * (2 * (n_experts + 1) + n_pairs) bytes; n_experts <= 4096,
// n_pairs <= 32768 (ops.moe: MAX_EXPERTS, MAX_PLAN_PAIRS), 1 <= rows <= 255. ids are [rows of the batch, top_k];
// with shared_id >= 0 every row has one more slot, slot top_k, whose expert is shared_id (a shared expert fused
// into the routed call: pair q is row q / (top_k + 1), slot q % (top_k + 1); a routed slot holding shared_id
// goes to the none list); else pair q's expert is ids[q]. A pair's expert is local when its id is in
// [0, n_experts) and tab[id]'s weight is not NULL.
extern "C" __global__ __launch_bounds__(1024) void moe_route_plan(const u64* tab, const i32* ids, u32 n_pairs,
                                                                   u32 n_experts, u32 rows, u32 top_k,
                                                                   i32 shared_id, u32* plan)
{
    pdl_entry();
    __shared__ u32 ws[64];
    const u32 E = n_experts, tid = threadIdx.x, nt = blockDim.x;
    u32* cnt = (u32*)g_dsm;  // [E + 1] pairs per key (key E: the none list), then each key's first position
    u32* its = cnt + E + 1;  // [E + 1] items per expert, then each expert's first item
    u32* kr = its + E + 1;   // [n_pairs] key << 16 | the pair's rank among the pairs of its key
    const u32 mi = plan_max_items(n_pairs, E, rows);
    uint2* items = (uint2*)(plan + PLAN_HEADER);
    u32* sorted = plan + PLAN_HEADER + 2 * mi;
    for (u32 i = tid; i <= E; i += nt) cnt[i] = 0;
    const u32 slots = top_k + (shared_id >= 0 ? 1u : 0u);
    for (u32 q = tid; q < n_pairs; q += nt) {
        const u32 r = q / slots, s = q - r * slots;
        i32 e = s < top_k ? ids[r * top_k + s] : shared_id;
        if (s < top_k && e == shared_id) e = -1;  // a routed slot never reaches the fused shared expert
        kr[q] = e >= 0 && (u32)e < E && tab[3 * (u64)e] != 0 ? (u32)e : E;
    }
    __syncthreads();
    if (tid < 32) {  // one warp walks the pairs in order, 32 a step: ranks in pair order
        for (u32 q0 = 0; q0 < n_pairs; q0 += 32) {
            const u32 q = q0 + tid;
            const bool in = q < n_pairs;
            const u32 k = in ? kr[q] : 0xffffffffu;
            const u32 same = __match_any_sync(0xffffffffu, k);
            const u32 below = same & ((1u << tid) - 1u);
            const u32 r = in ? cnt[k] + __popc(below) : 0u;
            __syncwarp();
            if (in && !below) cnt[k] += __popc(same);  // the key's lowest lane counts the step's pairs
            __syncwarp();
            if (in) kr[q] = k << 16 | r;
        }
    }
    __syncthreads();
    for (u32 i = tid; i <= E; i += nt) its[i] = i < E ? (cnt[i] + rows - 1) / rows : 0u;
    __syncthreads();
    scan2_exclusive(cnt, its, E + 1, ws);
    for (u32 q = tid; q < n_pairs; q += nt) sorted[cnt[kr[q] >> 16] + (kr[q] & 0xffffu)] = q;
    for (u32 e = tid; e < E; e += nt) {
        const u32 p0 = cnt[e], c = cnt[e + 1] - p0;
        for (u32 j = 0; j * rows < c; ++j)
            items[its[e] + j] = make_uint2(e, (p0 + j * rows) << 8 | min(rows, c - j * rows));
    }
    if (tid == 0) plan[0] = its[E], plan[1] = cnt[E], plan[2] = PLAN_HEADER + 2 * mi, plan[3] = rows;
}

// ---------------------------------------------------------------------------------------------------
// Grouped expert GEMMs. Block (32, KS), KS in {1, 2, 4}; dynamic shared memory KS * NS * 4096 bytes of rings
// (NS stages of 32 rows x 8 chunks per warp, NS >= 2) then, for KS > 1, a double-buffered reduction area of
// 2 * KS * 1024 * MT bytes (ops.moe.mma_red_bytes); a persistent grid (ops.moe picks its size: results do not
// depend on it). As in mma_stream, each warp's ring runs across unit boundaries: the copies of the next unit's
// first stages are in flight while the warp finishes this one, so a block that walks several units never
// drains its pipeline between them.

constexpr int MMA_RT = 2;  // slabs of 16 weight rows per tile

__device__ __forceinline__ float swiglu(float g, float u, float limit) {  // as moe.cu: NaN passes through
    if (limit > 0.f) {
        g = g > limit ? limit : g;
        u = u > limit ? limit : (u < -limit ? -limit : u);
    }
    return g / (1.f + expf(-g)) * u;
}

__device__ __forceinline__ void store_zero(void* out, u64 i, bool bf) {
    if (bf) ((u16*)out)[i] = 0;
    else ((float*)out)[i] = 0.f;
}

// Work unit u of a plan (or of the plan-less call): its expert, first output row, first sorted position and
// rows. Grouped calls (per > 0: groups = n_slots, per items of `rows` batch rows each): the units of one
// (group, tile) are consecutive, so the blocks that read a tile for its row items run at once and share it
// through L2; p0 is the item's first batch row.
struct Unit {
    u32 e, n0, p0, nrows;
};
__device__ __forceinline__ Unit unit_of(const u32* plan, u32 u, u32 T, u32 outs, u32 n_pairs, u32 rows, u32 per,
                                        u32 n_slots) {
    Unit r;
    if (per) {
        const u32 tp = T * per, e = u / tp, rem = u - e * tp, tile = rem / per, c = rem - tile * per;
        r.e = e, r.n0 = tile * outs, r.p0 = c * rows, r.nrows = min(rows, n_pairs / n_slots - r.p0);
        return r;
    }
    const u32 it = u / T;
    r.n0 = (u - it * T) * outs;
    if (plan) {
        const uint2 v = ((const uint2*)(plan + PLAN_HEADER))[it];
        r.e = v.x, r.p0 = v.y >> 8, r.nrows = v.y & 0xffu;
    } else {
        r.e = 0, r.p0 = it * rows, r.nrows = min(rows, n_pairs - r.p0);
    }
    return r;
}

// MXFP4's ring rows: 8 chunks and one of padding, so lanes reading word t of one chunk in rows g = 0..7 hit 32
// banks (row g starts 4g banks on) with no swizzle: every read is an immediate offset from the lane's row.
constexpr int MX_ROW = 9;

// One MXFP4 slab step, block-major (see expert_mma): rows g, g + 8 of a 16-row slab, step s's chunks 4s .. 4s + 3
// = blocks b, lane t taking word t (codes 8t .. 8t + 7) of each. rw: word t of row g's chunk 0; sv: the rows'
// scale bytes (block b in byte b); X: the lane's f16 x words of MT n-tiles (4 a block: elements 8t .. 8t + 7 as
// moe_stage_f16's pairs02 stores them). Each block's two mmas (codes 0..3, then 4..7 of every lane: pairs (0, 2)
// and (1, 3)) sum unscaled, then acc += sum * 2^(e - 127) (e = 0: 0; 255: Inf). A block past K needs no check:
// its weights were zero-filled, its x loads masked and its scale byte left 0, so it adds fma(0, 0, acc).
template <int MT>
__device__ __forceinline__ void mx_step(const u32* rw, int s, const u32 sv[2], const u32 (&X)[MT][16],
                                        float (&acc)[MT][4], u32 nrows) {
#pragma unroll
    for (int b = 0; b < 4; ++b) {
        const u32* w = rw + 4 * (4 * s + b);
        u32 lo[2], hi[2];
        e2m1x8_e4m3(w[0], lo[0], hi[0]);
        e2m1x8_e4m3(w[8 * MX_ROW * 4], lo[1], hi[1]);  // row g + 8
        float tmp[MT][4] = {};
#pragma unroll
        for (int hk = 0; hk < 2; ++hk) {
            const u32 a[4] = {e4m3x2_f16_half(lo[0], hk), e4m3x2_f16_half(lo[1], hk), e4m3x2_f16_half(hi[0], hk),
                              e4m3x2_f16_half(hi[1], hk)};
#pragma unroll
            for (int jm = 0; jm < MT; ++jm) {
                if (8 * jm >= (int)nrows) break;  // uniform over the block
                const u32 bx[2] = {X[jm][4 * b + 2 * hk], X[jm][4 * b + 2 * hk + 1]};  // x staged as (k, k + 2) pairs
                mma16816_f16(tmp[jm], a, bx);
            }
        }
        const float f0 = __uint_as_float(((sv[0] >> (8 * b)) & 0xFFu) << 23);
        const float f1 = __uint_as_float(((sv[1] >> (8 * b)) & 0xFFu) << 23);
#pragma unroll
        for (int jm = 0; jm < MT; ++jm) {
            if (8 * jm >= (int)nrows) break;
            acc[jm][0] = fmaf(tmp[jm][0], f0, acc[jm][0]);
            acc[jm][1] = fmaf(tmp[jm][1], f0, acc[jm][1]);
            acc[jm][2] = fmaf(tmp[jm][2], f1, acc[jm][2]);
            acc[jm][3] = fmaf(tmp[jm][3], f1, acc[jm][3]);
        }
    }
}

// GU: tab_a = gate, tab_b = up, out = bf16 h = swiglu(gate x, up x); else out = y = W x (tab_b = tab_a), bf16
// when obf, else f32. x of pair q: x + (q / n_slots) * xrs + (q % n_slots) * xss; its output row at out +
// (q / n_slots) * yrs + (q % n_slots) * yss. A plan's items hold at most 8 MT pairs (its rows). per > 0: a
// grouped call (plan NULL; pair q = row * n_slots + group uses table entry `group`, whose third word is the
// row offset of its first row inside its 128-row scale block for the block formats).
// X16 (the fp8 and MXFP4 formats' MoE kernels): x is f16 (moe_stage_f16), the weights widen to f16 (fp8:
// frag_a_e4m3_f16; MXFP4: e2m1x8_e4m3 then the same widening), and pair q's results are multiplied by its x scale
// xsc[(q / n_slots) * srs + (q % n_slots) * sss] (xsc NULL: 1). Without X16, x is bf16 and xsc is not read.
// MXFP4 is block-major: each mma lies inside one 32-k scale block (lane t takes word t, codes 8t .. 8t + 7, of
// each of the step's four chunks), so its products sum unscaled and the block's power-of-two scale multiplies the
// pair of mmas' sum: acc = fma(block sum, 2^(e - 127), acc). Its ring rows are padded (MX_ROW) so the lanes'
// 4-byte reads of one chunk hit 32 banks.
template <int F, bool GU, int MT, bool X16>
__device__ __forceinline__ void expert_mma(const u32* plan, const u64* tab_a, const u64* tab_b, u32 n_pairs,
                                           u32 n_slots, const u16* x, u32 xrs, u32 xss, const float* xsc,
                                           u32 srs, u32 sss, void* out, u32 yrs, u32 yss, bool obf, u32 per,
                                           u32 N, u32 K, float limit)
{
    static_assert(!X16 || F == FP8_ROW || F == FP8_BLOCK || F == FP8_BLOCK_E8M0 || F == MXFP4,
                  "f16 x is for e4m3 and MXFP4 weights");
    static_assert(F != MXFP4 || X16, "MXFP4 reads f16 x");
    constexpr int RT = MMA_RT, KC = kchunk<F>(), NM = KC / 4, CH = 8, TR = 16 * RT, E = RT * MT * 4;
    constexpr int SL = GU ? RT / 2 : RT;  // slabs per matrix: a tile has 16 * SL outputs
    constexpr bool FP4 = F == NVFP4 || F == MXFP4, BLOCK = F == FP8_BLOCK || F == FP8_BLOCK_E8M0, MXB = F == MXFP4;
    constexpr u32 RS = MXB ? MX_ROW : CH;  // ring row stride (uint4)
    constexpr u32 OUTS = 16 * SL, STAGE = TR * RS, ROWS = 8 * MT;  // STAGE: uint4 per warp and stage
    constexpr int XS = FP4 ? 1 : 2;  // steps of x held at once
    static_assert(TR == 32, "a lane copies / prefetches one row");
    const u32 lane = threadIdx.x, g = lane >> 2, t = lane & 3, ks = threadIdx.y, KS = blockDim.y;
    const u32 tid = ks * 32 + lane, nth = 32 * KS;
    const u32 KCH = K / KC, NU = (KCH + CH - 1) / CH, T = (N + OUTS - 1) / OUTS;
    const u32 nunit = ks < NU ? (NU - 1 - ks) / KS + 1 : 0;
    const u64 rowbytes = (u64)K * (F == BF16 ? 2 : 1) / (FP4 ? 2 : 1);
    const u32 red_bytes = KS > 1 ? 2 * KS * E * 32 * 4 : 0;
    const u32 NS = (dyn_smem_bytes() - red_bytes) / (KS * STAGE * 16);  // ring stages, >= 2 (launcher)
    uint4* const ring = g_dsm + ks * NS * STAGE;
    float* const red = (float*)(g_dsm + KS * NS * STAGE);
    // PDL: a call with a plan reads the router's choices, so it waits first; a plan-less one (a single weight, or
    // grouped) reads only weights and its tables before its first ring stages, so it issues those, then waits
    if (plan) pdl_wait();
    pdl_trigger();
    const u32 count = plan ? plan[0] : per ? n_slots * per : (n_pairs + ROWS - 1) / ROWS;
    const u32 none0 = plan ? plan[1] : n_pairs;
    const u32* sorted = plan ? plan + plan[2] : nullptr;

    const bool obf16 = GU || obf;
    auto out_at = [&](u32 q, u32 n) { return (u64)(q / n_slots) * yrs + (u64)(q % n_slots) * yss + n; };
    // pairs without a local expert: zero rows (the whole grid shares them)
    const u64 nz = (u64)(n_pairs - none0) * N;
    for (u64 i = (u64)blockIdx.x * nth + tid; i < nz; i += (u64)gridDim.x * nth)
        store_zero(out, out_at(sorted[none0 + i / N], i % N), obf16);

    const u32 total = count * T, NB = gridDim.x, bx = blockIdx.x;
    const u32 nwalk = bx < total ? (total - 1 - bx) / NB + 1 : 0;  // this block's units bx, bx + NB, ...

    // Issue side: unit iw, its k unit iu, ring slot islot. A unit whose expert is not in the table (the plan
    // may have been built from another) still takes its ring slots, zero-filled, so the two sides stay in step.
    const u32 cc = lane & 7, cr = lane >> 3;  // this lane copies chunk cc of rows 4i + cr
    u32 iw = 0, iu = 0, islot = 0, left = nwalk * nunit, in0 = 0;
    const u8* wsrc[2] = {nullptr, nullptr};
    const u8* pf = nullptr;  // fp4: the block scales of tile row `lane`, prefetched into L2 with each stage
    bool whole = false;      // every row of the tile is below N: row 4i + cr is row cr's address + (i % 4) 4 rows
    const u32 rb4 = 4 * (u32)rowbytes;   // < 4 GB: an expert's four rows
    auto issue = [&]() {
        if (left) {
            --left;
            if (iu == 0) {
                const Unit u = unit_of(plan, bx + iw * NB, T, OUTS, n_pairs, ROWS, per, n_slots);
                const u64* ta = tab_a + 3 * (u64)u.e;
                const u64* tb = GU ? tab_b + 3 * (u64)u.e : ta;
                in0 = u.n0, wsrc[0] = (const u8*)ta[0], wsrc[1] = (const u8*)tb[0];
                if (!wsrc[0] || !wsrc[1]) wsrc[0] = wsrc[1] = nullptr;
                if (FP4 && wsrc[0]) {
                    const u32 sr = lane >> 4, n = min(in0 + (GU ? 0u : 16u * sr) + (lane & 15), N - 1);
                    pf = (const u8*)(GU && sr ? tb[1] : ta[1]) + (u64)n * (F == NVFP4 ? K / 16 : K / 32);
                }
                whole = wsrc[0] && in0 + (GU ? 15u : 31u) < N;
                if (whole) {   // from here on wsrc[s] is row cr of slab s (the same rows as the clamped path)
                    const u8* w1 = wsrc[GU ? 1 : 0];
                    wsrc[0] += (u64)(in0 + cr) * rowbytes;
                    wsrc[1] = w1 + (u64)(in0 + (GU ? 0u : 16u) + cr) * rowbytes;
                }
            }
            const u32 c0 = (ks + iu * KS) * CH, ch = c0 + cc;
            const bool ok = wsrc[0] && ch < KCH;
            // chunk cc of row 4i + cr lands at cc ^ ((row & 1) << 2) (MXFP4: at cc of a padded row)
            uint4* const st0 = ring + islot * STAGE + cr * RS + (MXB ? cc : cc ^ ((cr & 1) << 2));
            auto at = [&](int i) { return st0 + 4 * i * RS; };
            if (whole) {
#pragma unroll
                for (int s2 = 0; s2 < 2; ++s2) {
                    const u8* base = wsrc[s2] + ch * 16u;
#pragma unroll
                    for (int i = 4 * s2; i < 4 * s2 + 4; ++i)
                        cp_async_stream(at(i), ok ? base + (i & 3) * rb4 : (const u8*)tab_a, ok);
                }
            } else {
#pragma unroll
                for (int i = 0; i < TR / 4; ++i) {
                    const int sr = i / 4;  // the slab of rows 4i + cr
                    const u32 r = 4 * i + cr, n = min(in0 + (GU ? 0u : 16u * sr) + (r & 15), N - 1);
                    const u8* src = ok ? wsrc[GU ? sr : 0] + (u64)n * rowbytes + ch * 16u : (const u8*)tab_a;
                    cp_async_stream(at(i), src, ok);
                }
            }
            if (FP4 && wsrc[0]) prefetch_l2(pf + c0 * (F == NVFP4 ? 2 : 1));
            if (++iu == nunit) iu = 0, ++iw;
            if (++islot == NS) islot = 0;
        }
        cp_async_commit();  // an empty group past the end keeps the wait count uniform
    };

    for (u32 p = 1; p < NS; ++p) issue();
    if (!plan) pdl_wait();
    u32 cslot = 0, nred = 0;
    for (u32 i = 0; i < nwalk; ++i) {
        const Unit u = unit_of(plan, bx + i * NB, T, OUTS, n_pairs, ROWS, per, n_slots);
        const u32 n0 = u.n0, nrows = u.nrows;
        const u64* ta = tab_a + 3 * (u64)u.e;
        const u64* tb = GU ? tab_b + 3 * (u64)u.e : ta;
        const bool have = ta[0] && tb[0];  // uniform over the block
        const u8* const Sm[2] = {(const u8*)ta[1], (const u8*)tb[1]};
        auto pair_of = [&](u32 r) {  // item row -> pair
            return sorted ? __ldg(sorted + u.p0 + r) : per ? (u.p0 + r) * n_slots + u.e : u.p0 + r;
        };
        const u32 roff = per && BLOCK ? (u32)ta[2] : 0u;  // grouped: the first row's place in its scale block

        const u16* xp[MT];  // x row of item row 8 jm + g (the last row stands in past nrows: loads masked)
#pragma unroll
        for (int jm = 0; jm < MT; ++jm) {
            const u32 q = pair_of(min(8 * jm + g, nrows - 1));
            xp[jm] = x + (u64)(q / n_slots) * xrs + (u64)(q % n_slots) * xss;
        }
        // chunk c of the item's x rows, as lane (g, t) wants; MXFP4 (c the step's first chunk): elements 8t .. 8t + 7
        // of chunks c .. c + 3, the codes of word t of each
        auto load_x = [&](u32 (&X)[MT][KC / 2], u32 c) {
#pragma unroll
            for (int jm = 0; jm < MT; ++jm) {
#pragma unroll
                for (int v = 0; v < KC / 8; ++v) {
                    const u32 cv = MXB ? c + v : c;
                    const bool ok = 8 * jm + g < nrows && cv < KCH;
                    const uint4* xq = (const uint4*)(xp[jm] + (u64)cv * KC + (MXB ? 8 * t : 8 * v));
                    const uint4 q = ok ? __ldg(xq) : make_uint4(0, 0, 0, 0);
                    X[jm][4 * v] = q.x; X[jm][4 * v + 1] = q.y; X[jm][4 * v + 2] = q.z; X[jm][4 * v + 3] = q.w;
                }
            }
        };
        u32 rows[RT][2];
#pragma unroll
        for (int r = 0; r < RT; ++r)
#pragma unroll
            for (int h = 0; h < 2; ++h) rows[r][h] = min(n0 + (GU ? 0u : 16u * r) + g + 8 * h, N - 1);
        float acc[RT][MT][4] = {};
        for (u32 j = 0; j < nunit; ++j) {
            __syncwarp();  // every lane is done reading the slot that this issue overwrites
            issue();
            if (!have) {  // the slot's zero fill must land before a later copy reuses it
                cp_async_wait_n(NS - 1);
                if (++cslot == NS) cslot = 0;
                continue;
            }
            const u32 c0 = (ks + j * KS) * CH;
            // x words and fp4 scale bytes of the unit's two steps (not through the ring). fp4 holds one step
            // of x at a time (32 rows x 32 k a lane would not fit next to the accumulators): step 1's loads
            // follow step 0's mmas.
            u32 X[XS][MT][KC / 2], sv[2][RT][2];
            load_x(X[0], c0 + (MXB ? 0u : t));
            if (XS == 2) load_x(X[XS - 1], c0 + 4 + t);
#pragma unroll
            for (int s = 0; s < 2; ++s) {
                const u32 c = c0 + 4 * s + t;
#pragma unroll
                for (int r = 0; r < RT; ++r)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        sv[s][r][h] = 0;
                        const u8* S = Sm[GU ? r : 0];
                        if (F == NVFP4 && c < KCH) sv[s][r][h] = __ldg((const u16*)S + (u64)rows[r][h] * (K / 32) + c);
                        if (MXB) {  // the step's four blocks' scale bytes (block b in byte b): one word when aligned
                            const u32 cb = c0 + 4 * s;
                            const u8* p = S + (u64)rows[r][h] * (K / 32) + cb;
                            if (cb + 3 < KCH && ((size_t)p & 3) == 0) sv[s][r][h] = __ldg((const u32*)p);
                            else  // a partial last step, or rows not 4-byte aligned (K / 32 not a multiple of 4)
#pragma unroll 1
                                for (u32 b = 0; b < 4 && cb + b < KCH; ++b) sv[s][r][h] |= (u32)__ldg(p + b) << (8 * b);
                        }
                    }
            }
            float f[RT];  // fp8 block scale: a unit is 128 k, one 128x128 block for a slab
#pragma unroll
            for (int r = 0; r < RT; ++r) {
                f[r] = 1.f;
                if (BLOCK) {
                    const u8* S = Sm[GU ? r : 0];
                    const u32 sr = (min(n0 + (GU ? 0u : 16u * r), N - 1) + roff) >> 7;  // the slab's block row
                    const u64 si = (u64)sr * ((K + 127) / 128) + (c0 >> 3);
                    f[r] = F == FP8_BLOCK ? __ldg((const float*)S + si) : e8m0_to_f(__ldg(S + si));
                }
            }
            cp_async_wait_n(NS - 1);
            __syncwarp();  // the other lanes' copies of this stage are visible
            const uint4* st = ring + cslot * STAGE;
#pragma unroll
            for (int s = 0; s < 2; ++s) {
                if (c0 + 4 * s >= KCH) break;  // warp-uniform: the step lies past K
                if (XS == 1 && s == 1) load_x(X[0], c0 + 4 + (MXB ? 0u : t));
                if constexpr (MXB) {
#pragma unroll
                    for (int r = 0; r < RT; ++r)
                        mx_step<MT>((const u32*)(st + (r * 16 + g) * RS) + t, s, sv[s][r], X[0], acc[r], nrows);
                } else {
#pragma unroll
                for (int r = 0; r < RT; ++r) {
                    uint4 wv[2];
                    const u32 pc = (4 * s + t) ^ ((g & 1) << 2);  // rows g, g + 8 have g's parity
                    wv[0] = st[(r * 16 + g) * CH + pc];
                    wv[1] = st[(r * 16 + g + 8) * CH + pc];
                    u32 sc[2][2] = {};
                    if (FP4)
#pragma unroll
                        for (int h = 0; h < 2; ++h) {
                            sc[h][0] = fp4_scale<F>(sv[s][r][h], 0);
                            if (F == NVFP4) sc[h][1] = fp4_scale<F>(sv[s][r][h], 1);
                        }
                    // the mma order of chained_acc, as in mma_stream; n-tiles past the item's rows are skipped
                    float tmp[MT][4] = {};
#pragma unroll
                    for (int mi = 0; mi < NM; ++mi) {
                        u32 a[4];
                        if (X16) frag_a_e4m3_f16(wv, mi, a);
                        else frag_a<F>(wv, sc, mi, a);
#pragma unroll
                        for (int jm = 0; jm < MT; ++jm) {
                            if (8 * jm >= (int)nrows) break;  // uniform over the block
                            const u32* xw = X[XS == 1 ? 0 : s][jm];
                            if (X16) {
                                const u32 b[2] = {xw[2 * mi], xw[2 * mi + 1]};
                                mma16816_f16(chained_acc<F>() ? acc[r][jm] : tmp[jm], a, b);
                            } else {
                                u32 b[2];
                                frag_b<F>(xw, mi, b);
                                mma16816(chained_acc<F>() ? acc[r][jm] : tmp[jm], a, b);
                            }
                        }
                    }
                    if (!chained_acc<F>())
#pragma unroll
                        for (int jm = 0; jm < MT; ++jm)
#pragma unroll
                            for (int e2 = 0; e2 < 4; ++e2) acc[r][jm][e2] = fmaf(tmp[jm][e2], f[r], acc[r][jm][e2]);
                }
                }
            }
            if (++cslot == NS) cslot = 0;
        }
        if (!have) {  // not in this table: zeros (uniform over the block)
            for (u32 q = tid; q < nrows * OUTS; q += nth) {
                const u32 n = n0 + q % OUTS;
                if (n < N) store_zero(out, out_at(pair_of(q / OUTS), n), obf16);
            }
            continue;
        }

        // C fragment element e2 of (slab r, n-tile jm): item row 8jm + 2t + (e2 & 1), output row (slab row)
        // g + 8 (e2 >> 1). GU: v = gate, vu = up of the same output.
        auto emit = [&](u32 r, u32 jm, u32 e2, float v, float vu) {
            const u32 q = 8 * jm + 2 * t + (e2 & 1), n = n0 + (GU ? 0u : 16u * r) + g + 8 * (e2 >> 1);
            if (q >= nrows || n >= N) return;
            const u32 pq = pair_of(q);
            const u64 o = out_at(pq, n);
            if (X16 && xsc) {  // a power of two: the product is exact, in any order with the scales below
                const float xs = __ldg(xsc + (u64)(pq / n_slots) * srs + (u64)(pq % n_slots) * sss);
                v *= xs, vu *= xs;
            }
            const float fm0 = F == NVFP4 ? __uint_as_float((u32)ta[2]) * 256.f : F == MXFP4 ? 64.f : 1.f;
            if (GU) {
                const float fm1 = F == NVFP4 ? __uint_as_float((u32)tb[2]) * 256.f : fm0;  // undo fp4_scale
                const float rg = F == FP8_ROW ? __ldg((const float*)Sm[0] + n) : fm0;
                const float ru = F == FP8_ROW ? __ldg((const float*)Sm[1] + n) : fm1;
                ((__nv_bfloat16*)out)[o] = f2bf(swiglu(v * rg, vu * ru, limit));
            } else {
                const float yv = v * (F == FP8_ROW ? __ldg((const float*)Sm[0] + n) : fm0);
                if (obf) ((__nv_bfloat16*)out)[o] = f2bf(yv);
                else ((float*)out)[o] = yv;
            }
        };
        constexpr u32 EO = GU ? E / 2 : E;  // outputs per lane
        if (KS == 1) {
#pragma unroll
            for (u32 o = 0; o < EO; ++o)
                emit(o / (4 * MT), (o / 4) % MT, o % 4, acc[o / (4 * MT)][(o / 4) % MT][o % 4],
                     GU ? acc[1][(o / 4) % MT][o % 4] : 0.f);
        } else {
            // double buffer, alternating per reduction: reduction j + 2 writes after every warp met reduction
            // j + 1's barrier, so after every warp finished reading reduction j's buffer
            float* rb = red + (nred++ & 1) * KS * E * 32;
#pragma unroll
            for (int r = 0; r < RT; ++r)
#pragma unroll
                for (int jm = 0; jm < MT; ++jm)
#pragma unroll
                    for (int e2 = 0; e2 < 4; ++e2) rb[(ks * E + (r * MT + jm) * 4 + e2) * 32 + lane] = acc[r][jm][e2];
            __syncthreads();
            for (u32 o = ks; o < EO; o += KS) {  // the warps share the sums; each adds the slices in order
                float v = rb[o * 32 + lane], vu = GU ? rb[(o + EO) * 32 + lane] : 0.f;
                for (u32 q = 1; q < KS; ++q) {
                    v += rb[(q * E + o) * 32 + lane];
                    if (GU) vu += rb[(q * E + o + EO) * 32 + lane];
                }
                emit(o / (4 * MT), (o / 4) % MT, o % 4, v, vu);
            }
        }
    }
    cp_async_wait<0>();  // only the trailing empty groups are pending
}

// Kernels, per format: moe_gemv_mma_<fmt> (y f32 [n_pairs, N] = W x_q for every pair: routed experts' down
// projections, the shared expert's with plan NULL; zeros for a pair whose expert is not in the table) and
// moe_gate_up_mma_<fmt> (h bf16 [n_pairs, N] = swiglu(Wg x_q, Wu x_q), clamped when limit > 0), each for 32-pair
// items (MT = 4, 2 blocks an SM) and, as moe_*_mma8_<fmt>, for 8-pair items (MT = 1, ~115 registers: 4 blocks,
// 16 warps an SM). A pair's arithmetic is the same in both. x is bf16, or for X16 formats (fp8, MXFP4) f16 from
// moe_stage_f16, whose kernels multiply pair q's results by x_scale[(q / n_slots) * s_row_stride + (q % n_slots)
// * s_slot_stride] (x_scale NULL: by 1); the others do not read x_scale.
#define MOE_GEMV_MMA(KIND, FMT, F, MT, MINB, X16)                                                                 \
    extern "C" __global__ __launch_bounds__(128, MINB) void moe_##KIND##_##FMT(                                   \
        const u32* plan, const u64* tab, u32 n_pairs, u32 n_slots, const u16* x, u32 x_row_stride,                \
        u32 x_slot_stride, const float* x_scale, u32 s_row_stride, u32 s_slot_stride, float* y, u32 N, u32 K) {   \
        expert_mma<F, false, MT, X16>(plan, tab, tab, n_pairs, n_slots, x, x_row_stride, x_slot_stride, x_scale,  \
                                      s_row_stride, s_slot_stride, y, n_slots * N, N, false, 0, N, K, 0.f);       \
    }
#define MOE_GATE_UP_MMA(KIND, FMT, F, MT, MINB, X16)                                                              \
    extern "C" __global__ __launch_bounds__(128, MINB) void moe_##KIND##_##FMT(                                   \
        const u32* plan, const u64* tab_gate, const u64* tab_up, u32 n_pairs, u32 n_slots, const u16* x,          \
        u32 x_row_stride, u32 x_slot_stride, const float* x_scale, u32 s_row_stride, u32 s_slot_stride,           \
        __nv_bfloat16* h, u32 N, u32 K, float limit) {                                                            \
        expert_mma<F, true, MT, X16>(plan, tab_gate, tab_up, n_pairs, n_slots, x, x_row_stride, x_slot_stride,    \
                                     x_scale, s_row_stride, s_slot_stride, h, n_slots * N, N, true, 0, N, K,      \
                                     limit);                                                                      \
    }
#define MOE_MMA_KERNELS(FMT, F, X16)                                                                              \
    MOE_GEMV_MMA(gemv_mma, FMT, F, 4, 2, X16)                                                                     \
    MOE_GEMV_MMA(gemv_mma8, FMT, F, 1, 4, X16)                                                                    \
    MOE_GATE_UP_MMA(gate_up_mma, FMT, F, 4, 2, X16)                                                               \
    MOE_GATE_UP_MMA(gate_up_mma8, FMT, F, 1, 4, X16)

// grouped_mma8_<fmt> / grouped_mma_<fmt>: for g < groups, r < m, j < N: y[r * y_row_stride + g * y_group_stride + j]
// = sum_k W_g[j, k] x[r * x_row_stride + g * x_group_stride + k], W_g table entry g (ops.grouped_gemv's
// tensor-core form: MLA's W_UK^T and W_UV, V4's wo_a). y bf16, or f32 with out_f32. Items of 8 rows (mma8: MT = 1)
// or 32 (MT = 4: each decoded weight fragment feeds 4 mmas); a row's sums are the same in both and at every m.
#define GROUPED_MMA(KIND, FMT, F, MT, MINB)                                                                       \
    extern "C" __global__ __launch_bounds__(128, MINB) void grouped_##KIND##_##FMT(                               \
        const u64* tab, u32 m, u32 groups, const u16* x, u32 x_row_stride, u32 x_group_stride, void* y,           \
        u32 y_row_stride, u32 y_group_stride, u32 out_f32, u32 N, u32 K) {                                        \
        expert_mma<F, false, MT, false>(nullptr, tab, tab, m * groups, groups, x, x_row_stride, x_group_stride,   \
                                        nullptr, 0, 0, y, y_row_stride, y_group_stride, out_f32 == 0,             \
                                        (m + 8 * MT - 1) / (8 * MT), N, K, 0.f);                                  \
    }
#define GROUPED_MMA_KERNELS(FMT, F) GROUPED_MMA(mma8, FMT, F, 1, 4) GROUPED_MMA(mma, FMT, F, 4, 2)

MOE_MMA_KERNELS(bf16, BF16, false)
MOE_MMA_KERNELS(fp8_row, FP8_ROW, true)
MOE_MMA_KERNELS(fp8_block, FP8_BLOCK, true)
MOE_MMA_KERNELS(fp8_block_e8m0, FP8_BLOCK_E8M0, true)
MOE_MMA_KERNELS(nvfp4, NVFP4, false)
MOE_MMA_KERNELS(mxfp4, MXFP4, true)
GROUPED_MMA_KERNELS(bf16, BF16)
GROUPED_MMA_KERNELS(fp8_block, FP8_BLOCK)
GROUPED_MMA_KERNELS(fp8_block_e8m0, FP8_BLOCK_E8M0)

// ---------------------------------------------------------------------------------------------------
// x for the X16 GEMMs (fp8, MXFP4). Vector v < n_vec is row v / n_slots, slot v % n_slots of x (bf16, strides
// in elements); it goes to y + v * K as f16 of x * 2^-e, with scale[v] = 2^e: e puts the vector's largest
// magnitude in [2^14, 2^15) (e in [-126, 113]), so every element within 2^31 of it converts exactly (f16 normals hold bf16's
// 8 significant bits; below 2^-14 its subnormals keep them down to 2^-17) and smaller ones round to the nearest
// f16 (subnormal or 0). A vector holding Inf or NaN, or only zeros, keeps e = 0 (Inf and NaN pass through). The
// GEMMs multiply each result by its scale: exact, so a row sums as it would in bf16. Grid n_vec, block 128; K a
// multiple of 8, x and y 16-byte aligned. pairs02: each 8-element group goes out as elements (0, 2, 1, 3, 4, 6,
// 5, 7), so its f16 words hold pairs (k, k + 2) (the MXFP4 GEMMs'); 0: in order. PDL: it waits first and lets
// the GEMM after it launch only at its end.
// Triggered at its start, the GEMM's persistent grid launched while this kernel's blocks still held the SMs,
// and the forward lost what the faster GEMMs gained (H200, DeepSeek-V3 MoE.forward at m = 64, graph replay:
// 2,939 us against 2,445 us with the late trigger, and 2,451 us without PDL).
extern "C" __global__ __launch_bounds__(128) void moe_stage_f16(const u16* x, u32 x_row_stride, u32 x_slot_stride,
                                                                u32 n_slots, u16* y, float* scale, u32 n_vec, u32 K,
                                                                u32 pairs02)
{
    pdl_wait();
    __shared__ u32 red[4];
    const u32 v = blockIdx.x, tid = threadIdx.x, nc = K / 8;
    const uint4* src = (const uint4*)(x + (u64)(v / n_slots) * x_row_stride + (u64)(v % n_slots) * x_slot_stride);
    u32 m2 = 0;  // the largest |x| bits of each half (bf16 magnitudes order as unsigned integers; NaN above Inf)
    for (u32 c = tid; c < nc; c += blockDim.x) {
        const uint4 q = __ldg(src + c);
        m2 = __vmaxu2(m2, __vmaxu2(__vmaxu2(q.x & 0x7fff7fffu, q.y & 0x7fff7fffu),
                                   __vmaxu2(q.z & 0x7fff7fffu, q.w & 0x7fff7fffu)));
    }
    u32 mb = max(m2 & 0xffffu, m2 >> 16);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mb = max(mb, __shfl_xor_sync(0xffffffffu, mb, o));
    if ((tid & 31) == 0) red[tid >> 5] = mb;
    __syncthreads();
    mb = max(max(red[0], red[1]), max(red[2], red[3]));
    const u32 E = max(mb >> 7, 15u);  // bf16 exponent field of the largest magnitude (subnormals as 15)
    const bool keep = mb == 0 || mb >= 0x7f80u;
    // 2^-e as a bf16x2 multiplier: bf16 arithmetic keeps subnormal inputs, where fp32's flushes them (CuPy
    // compiles with -ftz=true); the products are exact down to 2^-133, far below f16's smallest step
    const u32 mul = keep ? 0x3f803f80u : ((268u - E) << 7) * 0x10001u;
    if (tid == 0) scale[v] = keep ? 1.f : __uint_as_float((E - 14u) << 23);
    uint4* dst = (uint4*)(y + (u64)v * K);
    for (u32 c = tid; c < nc; c += blockDim.x) {
        const uint4 q = __ldg(src + c);
        u32 o[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const u32 w = bmul2(word(q, i), mul);
            const __half2 h = __floats2half2_rn(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
            o[i] = *(const u32*)&h;
        }
        if (pairs02)  // elements (0, 2, 1, 3, 4, 6, 5, 7): words of (k, k + 2) pairs, as the MXFP4 mmas take them
            dst[c] = make_uint4(__byte_perm(o[0], o[1], 0x5410), __byte_perm(o[0], o[1], 0x7632),
                                __byte_perm(o[2], o[3], 0x5410), __byte_perm(o[2], o[3], 0x7632));
        else
            dst[c] = make_uint4(o[0], o[1], o[2], o[3]);
    }
    pdl_trigger();
}
