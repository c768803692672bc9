// Argmax over rows of logits (bf16 or f32): ties go to the lowest id (torch.argmax); NaN ranks below every
// number (-inf included), so an all-NaN row gives id 0; -0.0 == +0.0. Optional outputs: the max value (f32),
// the top-1 log-prob max - logsumexp (NaN and -inf logits add nothing; NaN when the max is not finite), and
// for the grammar-masked kernel a flag (1 = the mask allows no token: id 0, value -inf).
//
// One pass, no atomics on data: grid (blocks per row, rows). Each block reduces a chunk of its row (16-byte
// loads) to a candidate key, writes it to the workspace, and the last block of the row to finish (counter
// ticket) reduces the partials in a fixed order and writes the outputs. atomicInc wraps the counter back to
// 0, so the workspace is ready for the next launch (CUDA-graph safe). With one block per row no workspace
// is touched.
//
// Workspace: u32 counters[MAX_ROWS] (zero before the first launch), then Partial[row][block]; at most THREADS
// blocks per row (the last block reads one partial per thread).
#include "common.cuh"

#define THREADS 256
#define MAX_ROWS 256
#define LOADS 4          // 16-byte loads per thread in flight

struct Partial { u64 key; float m, s; };

// Candidate key (rank << 32) | ~id: the u64 max is the highest rank and, among equal ranks, the lowest id.
// rank 0 = masked out, 1 = NaN, else the IEEE order-preserving map (>= 0x007FFFFF for -inf).
__device__ __forceinline__ u64 cand(float x, u32 id, bool allowed) {
    const u32 u = x == 0.f ? 0x00000000u : __float_as_uint(x);
    const u32 rank = !allowed ? 0u : (x != x) ? 1u : (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return ((u64)rank << 32) | (u64)(~id);
}

__device__ __forceinline__ float rank_value(u32 rank) {
    if (rank == 0) return -INFINITY;
    if (rank == 1) return __uint_as_float(0x7fc00000u);
    return __uint_as_float((rank & 0x80000000u) ? (rank & 0x7fffffffu) : ~rank);
}

__device__ __forceinline__ u64 umax64(u64 a, u64 b) { return a > b ? a : b; }

// Running log-sum-exp (m, s): s = sum exp(x - m) over the finite-or-+inf logits seen.
__device__ __forceinline__ void lse_add(float& m, float& s, float x) {
    if (!(x > -INFINITY)) return;
    if (x > m) { s = s * expf(m - x) + 1.f; m = x; } else { s += expf(x - m); }
}
__device__ __forceinline__ void lse_merge(float& m, float& s, float m2, float s2) {
    const float M = fmaxf(m, m2);
    if (M == -INFINITY) return;
    s = s * expf(m - M) + s2 * expf(m2 - M);
    m = M;
}

// Block-wide reduction (fixed shuffle tree, so the log-sum-exp is deterministic); the result is in thread 0.
template <bool LP>
__device__ __forceinline__ void block_reduce(u64& best, float& m, float& s) {
    __shared__ u64 wb[THREADS / 32];
    __shared__ float wm[THREADS / 32], wsum[THREADS / 32];
    const u32 lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        best = umax64(best, __shfl_xor_sync(0xffffffffu, best, o));
        if (LP) lse_merge(m, s, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, s, o));
    }
    if (lane == 0) { wb[wid] = best; wm[wid] = m; wsum[wid] = s; }
    __syncthreads();
    if (wid == 0) {
        const bool on = lane < THREADS / 32;
        best = on ? wb[lane] : 0ull;
        m = on ? wm[lane] : -INFINITY;
        s = on ? wsum[lane] : 0.f;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            best = umax64(best, __shfl_xor_sync(0xffffffffu, best, o));
            if (LP) lse_merge(m, s, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, s, o));
        }
    }
}

template <bool BF16, bool LP, bool MASK>
__device__ __forceinline__ void argmax_rows(const void* x, u32 n, u32 row_stride, const i32* mask, u32 mask_words,
                                            i32* out_id, float* out_val, float* out_lp, i32* out_flag, u8* ws) {
    constexpr u32 ESZ = BF16 ? 2 : 4, V = 16 / ESZ;
    const u32 row = blockIdx.y, nb = gridDim.x, b = blockIdx.x, tid = threadIdx.x;
    const u32 chunk = ((n + nb - 1) / nb + 7) & ~7u;  // a multiple of 8: vectors stay aligned, mask bits in one word
    const u32 lo = min(n, b * chunk), hi = min(n, lo + chunk);
    const u8* base = (const u8*)x + (u64)row * row_stride * ESZ;
    const u32* mrow = (const u32*)mask + (u64)row * mask_words;

    u64 best = 0;
    float m = -INFINITY, s = 0.f;
    auto take = [&](float v, u32 id, bool ok) {
        best = umax64(best, cand(v, id, ok));
        if (LP) lse_add(m, s, v);
    };
    auto value = [&](u32 id) {
        return BF16 ? bits2f(((const u16*)base)[id]) : ((const float*)base)[id];
    };
    auto allowed = [&](u32 id) { return !MASK || ((mrow[id >> 5] >> (id & 31)) & 1u); };

    u32 scalar_from = lo;
    if ((((unsigned long long)base) & 15) == 0) {
        const u32 nv = (hi - lo) / V;
        const uint4* vp = (const uint4*)(base + (u64)lo * ESZ);
        for (u32 i0 = tid; i0 < nv; i0 += LOADS * THREADS) {
            uint4 w[LOADS];  // all loads in flight before any compare
#pragma unroll
            for (u32 k = 0; k < LOADS; ++k)
                if (i0 + k * THREADS < nv) w[k] = __ldg(vp + i0 + k * THREADS);
#pragma unroll
            for (u32 k = 0; k < LOADS; ++k) {
                if (i0 + k * THREADS >= nv) break;
                const u32 id0 = lo + (i0 + k * THREADS) * V;
                const u32 bits = MASK ? mrow[id0 >> 5] >> (id0 & 31) : 0xFFu;
                const u32 words[4] = {w[k].x, w[k].y, w[k].z, w[k].w};
#pragma unroll
                for (u32 e = 0; e < V; ++e) {
                    const float v = BF16 ? bits2f((u16)(words[e >> 1] >> (16 * (e & 1)))) : __uint_as_float(words[e]);
                    take(v, id0 + e, (bits >> e) & 1u);
                }
            }
        }
        scalar_from = lo + nv * V;
    }
    for (u32 id = scalar_from + tid; id < hi; id += THREADS) take(value(id), id, allowed(id));

    block_reduce<LP>(best, m, s);
    if (nb > 1) {
        __shared__ bool last;
        Partial* parts = (Partial*)(ws + MAX_ROWS * 4) + (u64)row * nb;
        if (tid == 0) {
            parts[b].key = best; parts[b].m = m; parts[b].s = s;
            __threadfence();
            last = atomicInc((u32*)ws + row, nb - 1) == nb - 1;  // wraps to 0: ready for the next launch
        }
        __syncthreads();
        if (!last) return;
        __threadfence();
        best = 0; m = -INFINITY; s = 0.f;
        if (tid < nb) {  // L2 reads: the partials were written by other blocks
            best = __ldcg(&parts[tid].key);
            m = __ldcg(&parts[tid].m);
            s = __ldcg(&parts[tid].s);
        }
        block_reduce<LP>(best, m, s);
    }
    if (tid == 0) {
        const u32 rank = (u32)(best >> 32);
        const bool none = rank == 0;
        out_id[row] = none ? 0 : (i32)(~(u32)best);
        if (out_val) out_val[row] = rank_value(rank);
        if (MASK) out_flag[row] = none ? 1 : 0;
        if (LP) out_lp[row] = m > -INFINITY && m < INFINITY ? -logf(s) : __uint_as_float(0x7fc00000u);
    }
}

extern "C" __global__ __launch_bounds__(THREADS) void
argmax_bf16(const __nv_bfloat16* x, u32 n, i32* out_id, float* out_val, u8* ws) {
    pdl_entry();
    argmax_rows<true, false, false>(x, n, 0, nullptr, 0, out_id, out_val, nullptr, nullptr, ws);
}

extern "C" __global__ __launch_bounds__(THREADS) void
argmax_f32(const float* x, u32 n, i32* out_id, float* out_val, u8* ws) {
    pdl_entry();
    argmax_rows<false, false, false>(x, n, 0, nullptr, 0, out_id, out_val, nullptr, nullptr, ws);
}

// Batched: row r at x + r * row_stride (elements); grid (blocks per row, rows).
extern "C" __global__ __launch_bounds__(THREADS) void
argmax_bf16_batch(const __nv_bfloat16* x, u32 n, u32 rows, u32 row_stride, i32* out_id, float* out_val, u8* ws) {
    pdl_entry();
    argmax_rows<true, false, false>(x, n, row_stride, nullptr, 0, out_id, out_val, nullptr, nullptr, ws);
}

extern "C" __global__ __launch_bounds__(THREADS) void
argmax_f32_batch(const float* x, u32 n, u32 rows, u32 row_stride, i32* out_id, float* out_val, u8* ws) {
    pdl_entry();
    argmax_rows<false, false, false>(x, n, row_stride, nullptr, 0, out_id, out_val, nullptr, nullptr, ws);
}

extern "C" __global__ __launch_bounds__(THREADS) void
argmax_bf16_batch_lp(const __nv_bfloat16* x, u32 n, u32 rows, u32 row_stride, i32* out_id, float* out_val,
                     float* out_lp, u8* ws) {
    pdl_entry();
    argmax_rows<true, true, false>(x, n, row_stride, nullptr, 0, out_id, out_val, out_lp, nullptr, ws);
}

extern "C" __global__ __launch_bounds__(THREADS) void
argmax_f32_batch_lp(const float* x, u32 n, u32 rows, u32 row_stride, i32* out_id, float* out_val, float* out_lp,
                    u8* ws) {
    pdl_entry();
    argmax_rows<false, true, false>(x, n, row_stride, nullptr, 0, out_id, out_val, out_lp, nullptr, ws);
}

// Grammar-masked: token t is allowed iff bit t % 32 of mask[r * mask_row_words + t / 32] is set (xgrammar's
// int32 words). Logits bf16 when is_bf16, else f32.
extern "C" __global__ __launch_bounds__(THREADS) void
argmax_bitmask(const void* x, u32 is_bf16, u32 n, u32 rows, u32 row_stride, const i32* mask, u32 mask_row_words,
               i32* out_id, i32* out_flag, float* out_val, u8* ws) {
    pdl_entry();
    if (is_bf16)
        argmax_rows<true, false, true>(x, n, row_stride, mask, mask_row_words, out_id, out_val, nullptr, out_flag, ws);
    else
        argmax_rows<false, false, true>(x, n, row_stride, mask, mask_row_words, out_id, out_val, nullptr, out_flag, ws);
}
