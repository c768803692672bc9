// Mixture-of-experts decode kernels: router top-k rules, expert GEMVs read in place through device pointer
// tables, and the routing-weighted sum.
//
// Pairs. Row r of the batch and its slot k (its k-th chosen expert) form pair q = r * n_slots + k;
// ids[q] is that pair's expert. The input vector of pair q is x + r * x_row_stride + k * x_slot_stride
// (elements): the token's hidden for gate/up (slot stride 0), the pair's own SwiGLU row for down. A
// single-weight GEMV (router, shared expert) is the same launch with one table entry, n_slots = 1 and
// ids all zero.
//
// Pointer tables. A projection's table is u64 [n_experts, 3]: weight address, scale address, and the
// nvfp4 global scale (f32 bits in the low word). A NULL weight is an expert held by another rank (EP):
// its pairs get zeros. Tables are built once; no weight is copied.
//
// Read-once. The block of pair q works only if q is the first pair that chose its expert; it then runs
// every pair of that expert, up to PG pairs per pass over the weight tile (each 16-byte weight chunk is
// loaded once and dotted with every pair's x), so an expert chosen by up to PG rows is streamed from HBM
// once per step. A pair's sum runs over the same chunks in the same order whichever pairs share its pass,
// so its result does not depend on the other rows of the batch.
#include "common.cuh"

// ---------------------------------------------------------------------------------------------------
// Routing. One warp per row; up to 512 experts a lane holds its entries in registers (topk_row_regs), past
// that the row's scores live in shared memory (2 * n_experts floats, which the register path uses for its slots).

enum { SCORE_SOFTMAX = 0, SCORE_SIGMOID = 1, SCORE_SQRTSOFTPLUS = 2 };
constexpr int STAGE_U = 8;   // loads a lane issues before it uses them (routing rows: global, then shared memory)

// (v, i) beats (bv, bi): larger value, ties to the lower index. NaN never wins (taken experts are NaN).
__device__ __forceinline__ bool beats(float v, u32 i, float bv, u32 bi) {
    return v > bv || (v == bv && i < bi);
}

__device__ __forceinline__ void warp_best(float& bv, u32& bi) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const u32 oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (beats(ov, oi, bv, bi)) bv = ov, bi = oi;
    }
}

// A selection key as an unsigned int in the order `beats` ranks values: larger float -> larger key, -0 as +0,
// NaN (a taken expert) -> 0, below every real value (-inf included).
__device__ __forceinline__ u32 order_key(float v) {
    const u32 u = __float_as_uint(v);
    return v != v ? 0u : v == 0.f ? 0x80000000u : (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// This lane's best unselected entry of sel[lane], sel[lane + 32], ... below n, as (key, index); (0, n) when it
// has none. Index order with a strict compare keeps the lower index of equal keys; STAGE_U shared loads are
// issued before the compares that use them.
__device__ __forceinline__ void lane_best(const float* sel, u32 n, u32 lane, u32& bk, u32& bi) {
    bk = 0u, bi = n;
    for (u32 i0 = lane; i0 < n; i0 += 32 * STAGE_U) {
        float v[STAGE_U];
#pragma unroll
        for (int u = 0; u < STAGE_U; ++u) v[u] = i0 + 32 * u < n ? sel[i0 + 32 * u] : __int_as_float(0x7fc00000);
#pragma unroll
        for (int u = 0; u < STAGE_U; ++u) {
            const u32 k = order_key(v[u]);
            if (k > bk) bk = k, bi = i0 + 32 * u;
        }
    }
}

__device__ __forceinline__ float score_of(int fn, float z) {
    if (fn == SCORE_SIGMOID) return sigmoid_f32(z);
    return sqrtf(z > 20.f ? z : log1pf(expf(z)));  // sqrt(softplus(z)); softplus(z) = z above 20 (torch)
}

// dst[i] = src[i] for this lane's entries (i % 32 == lane), STAGE_U loads in flight at a time: a plain loop would
// wait for each global load before issuing the next (16 DRAM latencies for 512 experts).
__device__ __forceinline__ void stage_row(const float* __restrict__ src, float* dst, u32 E, u32 lane) {
    for (u32 i0 = lane; i0 < E; i0 += 32 * STAGE_U) {
        float v[STAGE_U];
#pragma unroll
        for (int u = 0; u < STAGE_U; ++u) v[u] = i0 + 32 * u < E ? __ldg(src + i0 + 32 * u) : 0.f;
#pragma unroll
        for (int u = 0; u < STAGE_U; ++u)
            if (i0 + 32 * u < E) dst[i0 + 32 * u] = v[u];
    }
}

// An entry's selection value: its score plus its bias (0 without), NaN mapped to -inf.
__device__ __forceinline__ float sel_value(float score, float bias) {
    const float v = score + bias;
    return v != v ? -INFINITY : v;
}

// sc[i] = score(z[i]); sel[i] = sel_value(sc[i], bias[i]) (selection key only). The logits (and
// bias) are staged in sc (and sel) first; every later pass reads only the lane's own shared entries.
__device__ void score_row(int fn, const float* z, const float* bias, float* sc, float* sel, u32 E, u32 lane) {
    stage_row(z, sc, E, lane);
    if (bias) stage_row(bias, sel, E, lane);
    if (fn == SCORE_SOFTMAX) {
        float mx = -INFINITY, sum = 0.f;
#pragma unroll (STAGE_U)
        for (u32 i = lane; i < E; i += 32) mx = fmaxf(mx, sc[i]);
        mx = warp_max(mx);
#pragma unroll (STAGE_U)
        for (u32 i = lane; i < E; i += 32) sc[i] = expf(sc[i] - mx), sum += sc[i];
        sum = warp_sum(sum);
#pragma unroll (STAGE_U)
        for (u32 i = lane; i < E; i += 32) sc[i] /= sum;
    } else {
#pragma unroll (STAGE_U)
        for (u32 i = lane; i < E; i += 32) sc[i] = score_of(fn, sc[i]);
    }
#pragma unroll (STAGE_U)
    for (u32 i = lane; i < E; i += 32) sel[i] = sel_value(sc[i], bias ? sel[i] : 0.f);
    __syncwarp();
}

// Group limit (DeepSeek noaux_tc): group score = sum of its two best keys; keep the topk_group best groups
// (ties to the lower group), set every other expert's key to -inf. n_group <= 32, E % n_group == 0.
__device__ void mask_groups(float* sel, u32 E, u32 n_group, u32 topk_group, u32 lane) {
    const u32 gsz = E / n_group;
    float gs = -INFINITY;  // lanes without a group (and taken groups) hold (-inf, ~0): they never win
    u32 gi = 0xffffffffu;
    if (lane < n_group) {
        float a = -INFINITY, b = -INFINITY;
        for (u32 j = 0; j < gsz; ++j) {
            const float v = sel[lane * gsz + j];
            if (v > a) b = a, a = v;
            else if (v > b) b = v;
        }
        gs = a + b, gi = lane;
    }
    u32 keep = 0;
    for (u32 t = 0; t < topk_group; ++t) {
        float bv = gs;
        u32 bi = gi;
        warp_best(bv, bi);
        keep |= 1u << bi;
        if (lane == bi) gs = -INFINITY, gi = 0xffffffffu;
    }
    for (u32 i = lane; i < E; i += 32)
        if (!((keep >> (i / gsz)) & 1u)) sel[i] = -INFINITY;
    __syncwarp();
}

// The top-k rounds. Each lane holds the best (key, index) of its own entries (i % 32 == lane); a round is two
// warp reductions (the largest key, then the lowest index holding it: ties to the lower id, as `beats`), and only
// the winner's lane calls take(t, win, bk, bi), which removes win (round t's pick) from its entries and re-finds
// its best. A lane touches only its own entries, so the rounds need no warp sync. Returns slot `lane`'s id (-1 past
// top_k).
template <class Take>
__device__ __forceinline__ i32 topk_rounds(u32 top_k, u32 lane, u32 bk, u32 bi, Take take) {
    i32 id = -1;
    for (u32 t = 0; t < top_k; ++t) {
        const u32 mk = __reduce_max_sync(0xffffffffu, bk);
        const u32 win = __reduce_min_sync(0xffffffffu, bk == mk ? bi : 0xffffffffu);
        if (lane == t) id = (i32)win;
        if (lane == (win & 31)) take(t, win, bk, bi);
    }
    return id;
}

// Lane t < top_k (mine) holds slot t's id and score v: weights = v / (sum + eps) when norm (and sum > 0), times scale.
__device__ __forceinline__ void write_slot(bool mine, i32 id, float v, u32 norm, float eps, float scale, i32* ids,
                                           float* w, u32 lane) {
    const float sum = warp_sum(v);
    if (norm && sum > 0.f) v /= sum + eps;  // nothing chosen (a bad hash token): weights stay 0
    if (mine) ids[lane] = id, w[lane] = v * scale;
}

// Top-k of one row (or the fixed hash ids), then weights = score of the chosen / (sum + eps) when norm
// (and sum > 0), times scale. Lane t < top_k owns slot t. An id outside [0, E) (bad hash entry or token) gets weight 0.
__device__ void finish_row(const float* sc, float* sel, u32 E, u32 top_k, i32 fixed_id, bool hashed, u32 norm,
                           float eps, float scale, i32* ids, float* w, u32 lane) {
    i32 id = hashed ? fixed_id : -1;
    if (!hashed) {   // past 512 experts (topk_row_regs below them): the winner rescans its shared entries
        u32 bk, bi;
        lane_best(sel, E, lane, bk, bi);
        id = topk_rounds(top_k, lane, bk, bi, [&](u32, u32 win, u32& bk, u32& bi) {
            sel[win] = __int_as_float(0x7fc00000);   // taken: NaN, below every real value
            lane_best(sel, E, lane, bk, bi);
        });
        __syncwarp();
    }
    const bool mine = lane < top_k;
    write_slot(mine, id, mine && id >= 0 && (u32)id < E ? sc[id] : 0.f, norm, eps, scale, ids, w, lane);
}

// A lane's best unselected key among its J registers (entry lane + 32 j) as (key, index), (0, E) when it has none:
// a tree over adjacent pairs, whose left side always holds the lower indices, so the strict compare keeps ties
// to the lower id as lane_best does, in log2(J) dependent steps instead of J.
template <int J>
__device__ __forceinline__ void lane_best_regs(const u32 (&key)[J], u32 E, u32 lane, u32& bk, u32& bi) {
    u32 k[J], i[J];
#pragma unroll
    for (int j = 0; j < J; ++j) k[j] = key[j], i[j] = lane + 32 * j;
#pragma unroll
    for (int s = 1; s < J; s *= 2)
#pragma unroll
        for (int p = 0; p < J / (2 * s); ++p)
            if (k[2 * s * p + s] > k[2 * s * p]) k[2 * s * p] = k[2 * s * p + s], i[2 * s * p] = i[2 * s * p + s];
    bk = k[0], bi = k[0] ? i[0] : E;
}

// topk_row for E <= 32 * J experts: a lane holds its entries (lane + 32 j) in registers from the load to the
// selection, so no pass goes through shared memory but the group limit's. Each step computes what score_row and
// finish_row compute, in the same order (the per-lane sums over j ascending, then the same warp reductions),
// so ids and weights are theirs bit for bit. A round's winner writes its id and score to slot t of `slot`
// (2 * top_k words); lane t reads them back after the rounds.
template <int J, int FN>
__device__ __forceinline__ void topk_row_regs(const float* __restrict__ z, const float* __restrict__ bias,
                                              float* sel, u32* slot, u32 E, u32 top_k, u32 n_group,
                                              u32 topk_group, u32 norm, float eps, float scale, i32* ids, float* w,
                                              u32 lane) {
    float s[J], b[J];
#pragma unroll
    for (int j = 0; j < J; ++j) {
        const u32 i = lane + 32 * j;
        s[j] = i < E ? __ldg(z + i) : 0.f;
        b[j] = bias && i < E ? __ldg(bias + i) : 0.f;
    }
    if (FN == SCORE_SOFTMAX) {
        float mx = -INFINITY, sum = 0.f;
#pragma unroll
        for (int j = 0; j < J; ++j)
            if (lane + 32 * j < E) mx = fmaxf(mx, s[j]);
        mx = warp_max(mx);
#pragma unroll
        for (int j = 0; j < J; ++j)
            if (lane + 32 * j < E) s[j] = expf(s[j] - mx), sum += s[j];
        sum = warp_sum(sum);
#pragma unroll
        for (int j = 0; j < J; ++j) s[j] /= sum;
    } else {
#pragma unroll
        for (int j = 0; j < J; ++j) s[j] = score_of(FN, s[j]);
    }
    u32 key[J];
#pragma unroll
    for (int j = 0; j < J; ++j) {
        const float v = sel_value(s[j], bias ? b[j] : 0.f);
        key[j] = lane + 32 * j < E ? order_key(v) : 0u;
        if (n_group > 1 && lane + 32 * j < E) sel[lane + 32 * j] = v;
    }
    if (n_group > 1) {   // the group limit reads other lanes' entries: through shared memory
        __syncwarp();
        mask_groups(sel, E, n_group, topk_group, lane);
#pragma unroll
        for (int j = 0; j < J; ++j)
            if (lane + 32 * j < E) key[j] = order_key(sel[lane + 32 * j]);
        __syncwarp();   // the slots below may reach into sel (2 * top_k > E)
    }
    u32 bk, bi;
    lane_best_regs(key, E, lane, bk, bi);
    topk_rounds(top_k, lane, bk, bi, [&](u32 t, u32 win, u32& bk, u32& bi) {
        float v = 0.f;   // win == E: nothing left to choose (not reached: every real entry has a key > 0)
#pragma unroll
        for (int j = 0; j < J; ++j)
            if (lane + 32 * j == win && win < E) v = s[j], key[j] = 0u;   // taken: below every real value
        slot[t] = win, slot[top_k + t] = __float_as_uint(v);
        lane_best_regs(key, E, lane, bk, bi);
    });
    __syncwarp();
    const bool mine = lane < top_k;
    const i32 id = mine ? (i32)slot[lane] : -1;
    write_slot(mine, id, mine ? __uint_as_float(slot[top_k + lane]) : 0.f, norm, eps, scale, ids, w, lane);
}

extern __shared__ float moe_smem[];  // routing: sc[E] then sel[E]

// Grid m (one block per row), block 32, dynamic shared memory 8 * E bytes.
template <int FN>
__device__ void topk_row(const float* logits, const float* bias, i32* ids, float* w, u32 m, u32 E, u32 top_k,
                         u32 n_group, u32 topk_group, u32 norm, float eps, float scale) {
    float *sc = moe_smem, *sel = moe_smem + E;
    const u32 r = blockIdx.x, lane = threadIdx.x;
    if (r >= m) return;
    if (E <= 256)
        return topk_row_regs<8, FN>(logits + (u64)r * E, bias, sel, (u32*)sc, E, top_k, n_group, topk_group,
                                    norm, eps, scale, ids + r * top_k, w + r * top_k, lane);
    if (E <= 512)
        return topk_row_regs<16, FN>(logits + (u64)r * E, bias, sel, (u32*)sc, E, top_k, n_group, topk_group,
                                     norm, eps, scale, ids + r * top_k, w + r * top_k, lane);
    score_row(FN, logits + (u64)r * E, bias, sc, sel, E, lane);
    if (n_group > 1) mask_groups(sel, E, n_group, topk_group, lane);
    finish_row(sc, sel, E, top_k, -1, false, norm, eps, scale, ids + r * top_k, w + r * top_k, lane);
}

// Qwen3-Next: softmax over all experts (fp32), top-k of the probabilities, renormalised when norm.
extern "C" __global__ void moe_topk_softmax(const float* logits, i32* ids, float* w, u32 m, u32 n_experts,
                                            u32 top_k, u32 norm, float scale) {
    pdl_entry();
    topk_row<SCORE_SOFTMAX>(logits, nullptr, ids, w, m, n_experts, top_k, 1, 1, norm, 0.f, scale);
}

// DeepSeek-V3 / GLM noaux_tc: sigmoid scores; selection by score + bias (NULL = none) under the group
// limit; weights are the unbiased sigmoids, normalised with +1e-20 (HF) when norm, times scale.
extern "C" __global__ void moe_topk_sigmoid_grouped(const float* logits, const float* bias, i32* ids, float* w,
                                                    u32 m, u32 n_experts, u32 top_k, u32 n_group,
                                                    u32 topk_group, u32 norm, float scale) {
    pdl_entry();
    topk_row<SCORE_SIGMOID>(logits, bias, ids, w, m, n_experts, top_k, n_group, topk_group, norm, 1e-20f, scale);
}

// DeepSeek-V4: s = sqrt(softplus(z)); selection by s + bias, no groups; weights s / sum(s) * scale.
extern "C" __global__ void moe_topk_sqrtsoftplus(const float* logits, const float* bias, i32* ids, float* w,
                                                 u32 m, u32 n_experts, u32 top_k, u32 norm, float scale) {
    pdl_entry();
    topk_row<SCORE_SQRTSOFTPLUS>(logits, bias, ids, w, m, n_experts, top_k, 1, 1, norm, 0.f, scale);
}

// DeepSeek-V4 hash layers: ids = tid2eid[token] (i32 [vocab, top_k]); weights from score_fn
// (0 softmax, 1 sigmoid, 2 sqrtsoftplus) as above. A token outside [0, vocab) selects nothing (ids -1).
// Token ids are i32 read at token_ids + r * token_ids_stride (bytes).
extern "C" __global__ void moe_topk_hash(const float* logits, const u8* token_ids, u32 token_ids_stride,
                                         const i32* tid2eid, u32 vocab, i32* ids, float* w, u32 m,
                                         u32 n_experts, u32 top_k, u32 score_fn, u32 norm, float scale) {
    pdl_entry();
    float *sc = moe_smem, *sel = moe_smem + n_experts;
    const u32 r = blockIdx.x, lane = threadIdx.x;
    if (r >= m) return;
    score_row((int)score_fn, logits + (u64)r * n_experts, nullptr, sc, sel, n_experts, lane);
    const i32 tok = *(const i32*)(token_ids + (u64)r * token_ids_stride);
    const bool ok = tok >= 0 && (u32)tok < vocab && lane < top_k;
    const i32 id = ok ? tid2eid[(u64)tok * top_k + lane] : -1;
    finish_row(sc, sel, n_experts, top_k, id, true, norm, 0.f, scale, ids + r * top_k, w + r * top_k, lane);
}

// ---------------------------------------------------------------------------------------------------
// Expert GEMVs. A weight row is read in 16-byte chunks (EPC elements along K; lane c takes chunks
// c, c + 32, ...). Each format decodes a chunk as EPC/2 element pairs; block-scaled formats apply one
// scale per group of a chunk (a chunk never straddles a scale block), and a per-row factor at the end.

enum { F_BF16, F_F32, F_FP8_ROW, F_FP8_BLOCK, F_FP8_E8M0, F_NVFP4, F_MXFP4 };

__device__ __forceinline__ float2 bf16_pair(u32 w) {
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
}

__device__ __forceinline__ float2 fp8_pair(u32 w, int hi) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(w >> (16 * hi)), __NV_E4M3);
    return __half22float2(__half2(h));
}

// Two E2M1 codes (low nibble = even element) -> their fp16 bit patterns, which are the values / 2^14;
// the 2^14 is folded into the row factor. Exact for every code including the subnormal 0.5.
__device__ __forceinline__ float2 fp4_pair(u32 b) {
    __half2_raw h;
    h.x = (u16)(((b & 8u) << 12) | ((b & 7u) << 9));
    h.y = (u16)(((b & 0x80u) << 8) | ((b & 0x70u) << 5));
    return __half22float2(__half2(h));
}

template <int F> struct Fmt;

template <> struct Fmt<F_BF16> {
    static constexpr int EPC = 8, G = 1;
    __device__ static float2 pair(const u32 (&w)[4], int p) { return bf16_pair(w[p]); }
    __device__ static u64 row_bytes(u32 K) { return (u64)K * 2; }
    __device__ static const u8* srow(const u8*, u32, u32) { return nullptr; }
    __device__ static void scales(const u8*, u32, float (&)[G]) {}
    __device__ static float rfac(const u8*, u32, float) { return 1.f; }
};

template <> struct Fmt<F_F32> {
    static constexpr int EPC = 4, G = 1;
    __device__ static float2 pair(const u32 (&w)[4], int p) {
        return make_float2(__uint_as_float(w[2 * p]), __uint_as_float(w[2 * p + 1]));
    }
    __device__ static u64 row_bytes(u32 K) { return (u64)K * 4; }
    __device__ static const u8* srow(const u8*, u32, u32) { return nullptr; }
    __device__ static void scales(const u8*, u32, float (&)[G]) {}
    __device__ static float rfac(const u8*, u32, float) { return 1.f; }
};

struct Fp8Base {
    static constexpr int EPC = 16, G = 1;
    __device__ static float2 pair(const u32 (&w)[4], int p) { return fp8_pair(w[p >> 1], p & 1); }
    __device__ static u64 row_bytes(u32 K) { return K; }
};

// Per-row f32 scale (a per-tensor scale is broadcast to [n] by the loader).
template <> struct Fmt<F_FP8_ROW> : Fp8Base {
    __device__ static const u8* srow(const u8*, u32, u32) { return nullptr; }
    __device__ static void scales(const u8*, u32, float (&)[G]) {}
    __device__ static float rfac(const u8* S, u32 n, float) { return ((const float*)S)[n]; }
};

// 128x128 blocks, scale [ceil(n/128), ceil(K/128)]: chunk c (16 elements) lies in K-block c / 8.
template <> struct Fmt<F_FP8_BLOCK> : Fp8Base {
    __device__ static const u8* srow(const u8* S, u32 n, u32 K) { return S + (u64)(n >> 7) * ((K + 127) >> 7) * 4; }
    __device__ static void scales(const u8* s, u32 c, float (&o)[G]) { o[0] = ((const float*)s)[c >> 3]; }
    __device__ static float rfac(const u8*, u32, float) { return 1.f; }
};

template <> struct Fmt<F_FP8_E8M0> : Fp8Base {
    __device__ static const u8* srow(const u8* S, u32 n, u32 K) { return S + (u64)(n >> 7) * ((K + 127) >> 7); }
    __device__ static void scales(const u8* s, u32 c, float (&o)[G]) { o[0] = e8m0_to_f(s[c >> 3]); }
    __device__ static float rfac(const u8*, u32, float) { return 1.f; }
};

// e4m3 scale per 16 elements ([n, K/16]): two per chunk, read as one u16; global scale2 per row factor.
template <> struct Fmt<F_NVFP4> {
    static constexpr int EPC = 32, G = 2;
    __device__ static float2 pair(const u32 (&w)[4], int p) { return fp4_pair(w[p >> 2] >> (8 * (p & 3))); }
    __device__ static u64 row_bytes(u32 K) { return K / 2; }
    __device__ static const u8* srow(const u8* S, u32 n, u32 K) { return S + (u64)n * (K / 16); }
    __device__ static void scales(const u8* s, u32 c, float (&o)[G]) {
        const u16 two = ((const u16*)s)[c];
        o[0] = fp8_to_f((u8)two), o[1] = fp8_to_f((u8)(two >> 8));
    }
    __device__ static float rfac(const u8*, u32, float s2) { return s2 * 16384.f; }
};

// e8m0 scale per 32 elements ([n, K/32]): one per chunk.
template <> struct Fmt<F_MXFP4> {
    static constexpr int EPC = 32, G = 1;
    __device__ static float2 pair(const u32 (&w)[4], int p) { return fp4_pair(w[p >> 2] >> (8 * (p & 3))); }
    __device__ static u64 row_bytes(u32 K) { return K / 2; }
    __device__ static const u8* srow(const u8* S, u32 n, u32 K) { return S + (u64)n * (K / 32); }
    __device__ static void scales(const u8* s, u32 c, float (&o)[G]) { o[0] = e8m0_to_f(s[c]); }
    __device__ static float rfac(const u8*, u32, float) { return 16384.f; }
};

// Weights are streamed once: read-only, no L1 allocation (x stays cached instead).
__device__ __forceinline__ uint4 ld_stream(const u8* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// EPC bf16 of x starting at element k0, as EPC/2 packed pairs (16-byte loads; 8-byte for f32 weights).
template <int NW>
__device__ __forceinline__ void load_x(const u16* x, u32 k0, u32 (&xw)[NW]) {
    if constexpr (NW == 2) {
        const uint2 v = __ldg((const uint2*)(x + k0));
        xw[0] = v.x, xw[1] = v.y;
    } else {
#pragma unroll
        for (int i = 0; i < NW / 4; ++i) {
            const uint4 v = __ldg((const uint4*)(x + k0) + i);
            xw[4 * i] = v.x, xw[4 * i + 1] = v.y, xw[4 * i + 2] = v.z, xw[4 * i + 3] = v.w;
        }
    }
}

// acc[j][r] += W_row_r . x_j over chunks c0, c0 + step, ... of K, for the np <= P inputs x_j. The R weight
// rows are loaded together (R 16-byte loads in flight per lane) once per chunk for all np inputs.
template <int F, int R, int P>
__device__ __forceinline__ void dot_rows(const u8* const (&wrow)[R], const u8* const (&srow)[R], u32 K,
                                         const u16* const (&xs)[P], u32 np, float (&acc)[P][R], u32 c0, u32 step) {
    using T = Fmt<F>;
    constexpr int PAIRS = T::EPC / 2, PPG = PAIRS / T::G;
    const u32 nc = K / T::EPC;
    for (u32 c = c0; c < nc; c += step) {
        u32 w[R][4];
        float s[R][T::G];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const uint4 v = ld_stream(wrow[r] + (u64)c * 16);
            w[r][0] = v.x, w[r][1] = v.y, w[r][2] = v.z, w[r][3] = v.w;
            T::scales(srow[r], c, s[r]);
        }
#pragma unroll
        for (int j = 0; j < P; ++j) {
            if ((u32)j >= np) break;
            u32 xw[PAIRS];
            load_x(xs[j], c * T::EPC, xw);
#pragma unroll
            for (int r = 0; r < R; ++r) {
#pragma unroll
                for (int g = 0; g < T::G; ++g) {
                    float part = 0.f;
#pragma unroll
                    for (int p = g * PPG; p < (g + 1) * PPG; ++p) {
                        const float2 wv = T::pair(w[r], p), xv = bf16_pair(xw[p]);
                        part = fmaf(wv.x, xv.x, part);
                        part = fmaf(wv.y, xv.y, part);
                    }
                    if constexpr (F == F_FP8_BLOCK || F == F_FP8_E8M0 || F == F_NVFP4 || F == F_MXFP4)
                        acc[j][r] = fmaf(part, s[r][g], acc[j][r]);
                    else
                        acc[j][r] += part;
                }
            }
        }
    }
}

constexpr int WARPS = 8;  // 256 threads per block
// Two shapes of the same arithmetic (a pair's sum runs over the same chunks in the same order in both):
//   plain    RR = 4 weight rows per warp, one pair per pass (a row's own top-k experts are distinct)
//   grouped  RR = 2 weight rows per warp, up to PG = 4 pairs of the expert per pass (batches)
// gate/up warps read a gate and an up row per output: RR / 2 outputs, else RR.
constexpr int PG_MAX = 4;    // the grouped shape's PG

__device__ __forceinline__ float swiglu(float g, float u, float limit) {
    if (limit > 0.f) {  // written so that NaN passes through (torch clamp semantics)
        g = g > limit ? limit : g;
        u = u > limit ? limit : (u < -limit ? -limit : u);
    }
    return g / (1.f + expf(-g)) * u;
}

// Block (32, ks, 8 / ks): the ks warps of a row group (threadIdx.z) split K (lane c of split j takes chunks
// j * 32 + c, step 32 * ks) and add their partials in a fixed order, so few-tile launches (a shared
// expert, small experts) still fill the GPU. Grid (ceil(N / (row groups * outputs per warp)), n_pairs).
// GU: tab_a = gate, tab_b = up, out = bf16 h [n_pairs, N] = swiglu(gate x, up x); else out = f32 y
// [n_pairs, N] = W x (tab_b unused). The block of an expert's first pair runs all of its pairs, PG per pass.
template <int F, bool GU, int R, int PG>
__device__ void expert_gemv(const u64* tab_a, const u64* tab_b, const i32* ids, u32 n_pairs, u32 n_slots,
                            u32 n_experts, const u16* x, u32 x_row_stride, u32 x_slot_stride, void* out,
                            u32 N, u32 K, float limit) {
    using T = Fmt<F>;
    constexpr u32 OUT = GU ? R / 2 : R;
    __shared__ float part[WARPS][PG][R];
    const u32 lane = threadIdx.x, ks = threadIdx.y, KS = blockDim.y, p = blockIdx.y;
    const u32 wid = threadIdx.z * KS + ks;
    const u32 n0 = (blockIdx.x * blockDim.z + threadIdx.z) * OUT;
    const i32 e = ids[p];
    const bool valid =
        n0 < N && e >= 0 && (u32)e < n_experts && tab_a[3 * e] != 0 && (!GU || tab_b[3 * e] != 0);
    const u8* wrow[R];
    const u8* srow[R];
    float rf[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const u64* t = GU && r >= (int)OUT ? tab_b : tab_a;
        const u32 n = min(n0 + (GU ? r % OUT : r), N - 1);  // rows past N repeat the last (not stored)
        wrow[r] = srow[r] = nullptr, rf[r] = 1.f;
        if (valid) {
            const u8 *W = (const u8*)t[3 * e], *S = (const u8*)t[3 * e + 1];
            wrow[r] = W + n * T::row_bytes(K);
            srow[r] = T::srow(S, n, K);
            rf[r] = T::rfac(S, n, __uint_as_float((u32)t[3 * e + 2]));
        }
    }
    u32 grp[PG];        // pending pairs of this expert (uniform over the block)
    u32 ng = 0;
    auto run = [&]() {  // one pass over the weight tile for the ng pending pairs
        float acc[PG][R] = {};
        const u16* xs[PG];
#pragma unroll
        for (int j = 0; j < PG; ++j) {
            const u32 q = grp[(u32)j < ng ? j : 0];
            xs[j] = x + (u64)(q / n_slots) * x_row_stride + (u64)(q % n_slots) * x_slot_stride;
        }
        if (valid) dot_rows<F, R, PG>(wrow, srow, K, xs, ng, acc, ks * 32 + lane, 32 * KS);
#pragma unroll
        for (int j = 0; j < PG; ++j)
#pragma unroll
            for (int r = 0; r < R; ++r) acc[j][r] = warp_sum(acc[j][r]);
        if (KS > 1) {
            if (lane == 0)
#pragma unroll
                for (int j = 0; j < PG; ++j)
#pragma unroll
                    for (int r = 0; r < R; ++r) part[wid][j][r] = acc[j][r];
            __syncthreads();
#pragma unroll
            for (int j = 0; j < PG; ++j)
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    acc[j][r] = part[wid - ks][j][r];
                    for (u32 i = 1; i < KS; ++i) acc[j][r] += part[wid - ks + i][j][r];
                }
            __syncthreads();  // `part` is reused by the next pass
        }
        if (lane == 0 && ks == 0 && n0 < N) {
#pragma unroll
            for (int j = 0; j < PG; ++j) {
                if ((u32)j >= ng) break;
                const u64 o = (u64)grp[j] * N + n0;
#pragma unroll
                for (u32 i = 0; i < OUT; ++i) {
                    if (n0 + i >= N) break;
                    if constexpr (GU)
                        ((__nv_bfloat16*)out)[o + i] =
                            f2bf(swiglu(acc[j][i] * rf[i], acc[j][OUT + i] * rf[OUT + i], limit));
                    else
                        ((float*)out)[o + i] = acc[j][i] * rf[i];
                }
            }
        }
        ng = 0;
    };
    for (u32 q0 = 0; q0 < n_pairs; q0 += 32) {
        u32 hit = __ballot_sync(0xffffffffu, q0 + lane < n_pairs && ids[q0 + lane] == e);
        if (q0 <= p) {
            const u32 before = p - q0 >= 32 ? 0xffffffffu : (1u << (p - q0)) - 1u;
            if (hit & before) return;  // an earlier pair's block runs this expert (uniform over the block)
            hit &= ~before;
        }
        for (; hit; hit &= hit - 1) {  // uniform over the block
#pragma unroll
            for (int j = 0; j < PG; ++j)
                if ((u32)j == ng) grp[j] = q0 + __ffs(hit) - 1;
            if (++ng == PG) run();
        }
    }
    if (ng) run();
}

// y f32 [n_pairs, N] = W[ids[q]] x_q: down projections, the shared expert's down, an f32 router.
// *_grouped (FP8 formats, ops/moe.py GROUPED_FORMATS): the batched shape (several pairs of an expert per pass),
// the same per-pair arithmetic.
extern "C" __global__ __launch_bounds__(256) void moe_gemv_bf16(
    const u64* tab, const i32* ids, u32 n_pairs, u32 n_slots, u32 n_experts, const u16* x, u32 x_row_stride,
    u32 x_slot_stride, float* y, u32 N, u32 K)
{
    pdl_entry();
    expert_gemv<F_BF16, false, 4, 1>(tab, nullptr, ids, n_pairs, n_slots, n_experts, x, x_row_stride, x_slot_stride,
                                     y, N, K, 0.f);
}

extern "C" __global__ __launch_bounds__(256) void moe_gemv_f32(
    const u64* tab, const i32* ids, u32 n_pairs, u32 n_slots, u32 n_experts, const u16* x, u32 x_row_stride,
    u32 x_slot_stride, float* y, u32 N, u32 K)
{
    pdl_entry();
    expert_gemv<F_F32, false, 4, 1>(tab, nullptr, ids, n_pairs, n_slots, n_experts, x, x_row_stride, x_slot_stride,
                                     y, N, K, 0.f);
}

extern "C" __global__ __launch_bounds__(256) void moe_gemv_fp8_row(
    const u64* tab, const i32* ids, u32 n_pairs, u32 n_slots, u32 n_experts, const u16* x, u32 x_row_stride,
    u32 x_slot_stride, float* y, u32 N, u32 K)
{
    pdl_entry();
    expert_gemv<F_FP8_ROW, false, 4, 1>(tab, nullptr, ids, n_pairs, n_slots, n_experts, x, x_row_stride, x_slot_stride,
                                     y, N, K, 0.f);
}

extern "C" __global__ __launch_bounds__(256, 1) void moe_gemv_grouped_fp8_row(
    const u64* tab, const i32* ids, u32 n_pairs, u32 n_slots, u32 n_experts, const u16* x, u32 x_row_stride,
    u32 x_slot_stride, float* y, u32 N, u32 K)
{
    pdl_entry();
    expert_gemv<F_FP8_ROW, false, 2, PG_MAX>(tab, nullptr, ids, n_pairs, n_slots, n_experts, x, x_row_stride, x_slot_stride,
                                     y, N, K, 0.f);
}

extern "C" __global__ __launch_bounds__(256) void moe_gemv_fp8_block(
    const u64* tab, const i32* ids, u32 n_pairs, u32 n_slots, u32 n_experts, const u16* x, u32 x_row_stride,
    u32 x_slot_stride, float* y, u32 N, u32 K)
{
    pdl_entry();
    expert_gemv<F_FP8_BLOCK, false, 4, 1>(tab, nullptr, ids, n_pairs, n_slots, n_experts, x, x_row_stride, x_slot_stride,
                                     y, N, K, 0.f);
}

extern "C" __global__ __launch_bounds__(256, 1) void moe_gemv_grouped_fp8_block(
    const u64* tab, const i32* ids, u32 n_pairs, u32 n_slots, u32 n_experts, const u16* x, u32 x_row_stride,
    u32 x_slot_stride, float* y, u32 N, u32 K)
{
    pdl_entry();
    expert_gemv<F_FP8_BLOCK, false, 2, PG_MAX>(tab, nullptr, ids, n_pairs, n_slots, n_experts, x, x_row_stride, x_slot_stride,
                                     y, N, K, 0.f);
}

extern "C" __global__ __launch_bounds__(256) void moe_gemv_fp8_block_e8m0(
    const u64* tab, const i32* ids, u32 n_pairs, u32 n_slots, u32 n_experts, const u16* x, u32 x_row_stride,
    u32 x_slot_stride, float* y, u32 N, u32 K)
{
    pdl_entry();
    expert_gemv<F_FP8_E8M0, false, 4, 1>(tab, nullptr, ids, n_pairs, n_slots, n_experts, x, x_row_stride, x_slot_stride,
                                     y, N, K, 0.f);
}

extern "C" __global__ __launch_bounds__(256, 1) void moe_gemv_grouped_fp8_block_e8m0(
    const u64* tab, const i32* ids, u32 n_pairs, u32 n_slots, u32 n_experts, const u16* x, u32 x_row_stride,
    u32 x_slot_stride, float* y, u32 N, u32 K)
{
    pdl_entry();
    expert_gemv<F_FP8_E8M0, false, 2, PG_MAX>(tab, nullptr, ids, n_pairs, n_slots, n_experts, x, x_row_stride, x_slot_stride,
                                     y, N, K, 0.f);
}

extern "C" __global__ __launch_bounds__(256) void moe_gemv_nvfp4(
    const u64* tab, const i32* ids, u32 n_pairs, u32 n_slots, u32 n_experts, const u16* x, u32 x_row_stride,
    u32 x_slot_stride, float* y, u32 N, u32 K)
{
    pdl_entry();
    expert_gemv<F_NVFP4, false, 4, 1>(tab, nullptr, ids, n_pairs, n_slots, n_experts, x, x_row_stride, x_slot_stride,
                                     y, N, K, 0.f);
}

extern "C" __global__ __launch_bounds__(256) void moe_gemv_mxfp4(
    const u64* tab, const i32* ids, u32 n_pairs, u32 n_slots, u32 n_experts, const u16* x, u32 x_row_stride,
    u32 x_slot_stride, float* y, u32 N, u32 K)
{
    pdl_entry();
    expert_gemv<F_MXFP4, false, 4, 1>(tab, nullptr, ids, n_pairs, n_slots, n_experts, x, x_row_stride, x_slot_stride,
                                     y, N, K, 0.f);
}

// h bf16 [n_pairs, N] = swiglu(Wg[ids[q]] x_q, Wu[ids[q]] x_q), clamped when limit > 0.
extern "C" __global__ __launch_bounds__(256) void moe_gate_up_bf16(
    const u64* tab_gate, const u64* tab_up, const i32* ids, u32 n_pairs, u32 n_slots, u32 n_experts, const u16* x,
    u32 x_row_stride, u32 x_slot_stride, __nv_bfloat16* h, u32 N, u32 K, float limit)
{
    pdl_entry();
    expert_gemv<F_BF16, true, 4, 1>(tab_gate, tab_up, ids, n_pairs, n_slots, n_experts, x, x_row_stride,
                                    x_slot_stride, h, N, K, limit);
}

extern "C" __global__ __launch_bounds__(256) void moe_gate_up_fp8_row(
    const u64* tab_gate, const u64* tab_up, const i32* ids, u32 n_pairs, u32 n_slots, u32 n_experts, const u16* x,
    u32 x_row_stride, u32 x_slot_stride, __nv_bfloat16* h, u32 N, u32 K, float limit)
{
    pdl_entry();
    expert_gemv<F_FP8_ROW, true, 4, 1>(tab_gate, tab_up, ids, n_pairs, n_slots, n_experts, x, x_row_stride,
                                    x_slot_stride, h, N, K, limit);
}

extern "C" __global__ __launch_bounds__(256, 1) void moe_gate_up_grouped_fp8_row(
    const u64* tab_gate, const u64* tab_up, const i32* ids, u32 n_pairs, u32 n_slots, u32 n_experts, const u16* x,
    u32 x_row_stride, u32 x_slot_stride, __nv_bfloat16* h, u32 N, u32 K, float limit)
{
    pdl_entry();
    expert_gemv<F_FP8_ROW, true, 2, PG_MAX>(tab_gate, tab_up, ids, n_pairs, n_slots, n_experts, x, x_row_stride,
                                    x_slot_stride, h, N, K, limit);
}

extern "C" __global__ __launch_bounds__(256) void moe_gate_up_fp8_block(
    const u64* tab_gate, const u64* tab_up, const i32* ids, u32 n_pairs, u32 n_slots, u32 n_experts, const u16* x,
    u32 x_row_stride, u32 x_slot_stride, __nv_bfloat16* h, u32 N, u32 K, float limit)
{
    pdl_entry();
    expert_gemv<F_FP8_BLOCK, true, 4, 1>(tab_gate, tab_up, ids, n_pairs, n_slots, n_experts, x, x_row_stride,
                                    x_slot_stride, h, N, K, limit);
}

extern "C" __global__ __launch_bounds__(256, 1) void moe_gate_up_grouped_fp8_block(
    const u64* tab_gate, const u64* tab_up, const i32* ids, u32 n_pairs, u32 n_slots, u32 n_experts, const u16* x,
    u32 x_row_stride, u32 x_slot_stride, __nv_bfloat16* h, u32 N, u32 K, float limit)
{
    pdl_entry();
    expert_gemv<F_FP8_BLOCK, true, 2, PG_MAX>(tab_gate, tab_up, ids, n_pairs, n_slots, n_experts, x, x_row_stride,
                                    x_slot_stride, h, N, K, limit);
}

extern "C" __global__ __launch_bounds__(256) void moe_gate_up_fp8_block_e8m0(
    const u64* tab_gate, const u64* tab_up, const i32* ids, u32 n_pairs, u32 n_slots, u32 n_experts, const u16* x,
    u32 x_row_stride, u32 x_slot_stride, __nv_bfloat16* h, u32 N, u32 K, float limit)
{
    pdl_entry();
    expert_gemv<F_FP8_E8M0, true, 4, 1>(tab_gate, tab_up, ids, n_pairs, n_slots, n_experts, x, x_row_stride,
                                    x_slot_stride, h, N, K, limit);
}

extern "C" __global__ __launch_bounds__(256, 1) void moe_gate_up_grouped_fp8_block_e8m0(
    const u64* tab_gate, const u64* tab_up, const i32* ids, u32 n_pairs, u32 n_slots, u32 n_experts, const u16* x,
    u32 x_row_stride, u32 x_slot_stride, __nv_bfloat16* h, u32 N, u32 K, float limit)
{
    pdl_entry();
    expert_gemv<F_FP8_E8M0, true, 2, PG_MAX>(tab_gate, tab_up, ids, n_pairs, n_slots, n_experts, x, x_row_stride,
                                    x_slot_stride, h, N, K, limit);
}

extern "C" __global__ __launch_bounds__(256) void moe_gate_up_nvfp4(
    const u64* tab_gate, const u64* tab_up, const i32* ids, u32 n_pairs, u32 n_slots, u32 n_experts, const u16* x,
    u32 x_row_stride, u32 x_slot_stride, __nv_bfloat16* h, u32 N, u32 K, float limit)
{
    pdl_entry();
    expert_gemv<F_NVFP4, true, 4, 1>(tab_gate, tab_up, ids, n_pairs, n_slots, n_experts, x, x_row_stride,
                                    x_slot_stride, h, N, K, limit);
}

extern "C" __global__ __launch_bounds__(256) void moe_gate_up_mxfp4(
    const u64* tab_gate, const u64* tab_up, const i32* ids, u32 n_pairs, u32 n_slots, u32 n_experts, const u16* x,
    u32 x_row_stride, u32 x_slot_stride, __nv_bfloat16* h, u32 N, u32 K, float limit)
{
    pdl_entry();
    expert_gemv<F_MXFP4, true, 4, 1>(tab_gate, tab_up, ids, n_pairs, n_slots, n_experts, x, x_row_stride,
                                    x_slot_stride, h, N, K, limit);
}

// ---------------------------------------------------------------------------------------------------
// out[r, d] = bf16( sum_k w[r, k] * y[r, k, d]  +  g_r * ys[r, d] ), g_r = sigmoid(gate[r]) or 1 when gate
// is NULL; the shared term is skipped when ys is NULL. y rows hold y_slots >= top_k slots of `hidden` and ys
// rows are ys_stride apart (a shared expert fused into the routed call: its output is slot top_k of y).
// fp32 throughout, k in order, one rounding.
extern "C" __global__ void moe_weighted_sum(const float* y, const float* w, u32 top_k, u32 y_slots, const float* ys,
                                            u32 ys_stride, const float* gate, __nv_bfloat16* out, u32 m, u32 hidden) {
    pdl_entry();
    const u64 total = (u64)m * hidden;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        const u64 r = i / hidden, d = i - r * hidden;
        float acc = 0.f;
        for (u32 k = 0; k < top_k; ++k) acc = fmaf(w[r * top_k + k], y[(r * y_slots + k) * hidden + d], acc);
        if (ys) acc = fmaf(gate ? sigmoid_f32(gate[r]) : 1.f, ys[r * ys_stride + d], acc);
        out[i] = f2bf(acc);
    }
}
