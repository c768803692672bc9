// DSA (DeepSeek-V3.2 / GLM-5 lightning indexer): index scores over the paged indexer cache and the top-k
// row selection that restricts MLA to the chosen rows (docs/model_math.md C.2).
//
// `dsa_index_scores`: for sequence s and every visible row j < seq_len (causal: the sequence's own new row
// included),
//     I[s, j] = scale * sum_h w[s, h] * relu(q[s, h, :] . k_j)
// q bf16 [num_seqs, heads, head_dim] (RoPE applied), w f32 [num_seqs, heads] (weights_proj output),
// k_j the bf16 indexer-cache row of j (slot kv_slot(table, j) = table[j / 16] * 16 + j % 16, meta.cuh),
// scale = heads^-0.5 * head_dim^-0.5 (relu commutes with a positive scale). grid (row blocks, num_seqs): q
// and w of the sequence are staged in shared memory as f32; each warp scores whole rows, lane l holding
// elements [l*E, l*E + E) of the row (E = head_dim / 32), one warp reduction per head. Scores land in f32
// [num_seqs, score_stride].
//
// `dsa_topk`: the min(k, seq_len) largest scores of each sequence, ties to the lower row, written as
// ascending row indices (i32) into sel[s, 0:k'] and -1 into sel[s, k':sel_stride]. One block per sequence:
// an MSB-first radix select (4 passes of 8 bits over an order-preserving u32 key; -0 == +0, NaN lowest) finds
// the k-th largest key T and how many rows equal to T are taken; a stable block-wide compaction then keeps
// every row with key > T and the first `rem` rows with key == T, in row order. Deterministic.
#include "common.cuh"
#include "meta.cuh"

#define SCORE_WARPS 8
#define TOPK_THREADS 512
#define TOPK_WARPS (TOPK_THREADS / 32)


// q . k over this lane's E elements; q from shared memory as float / float2 / float4 vectors (consecutive
// lanes read consecutive vectors: no bank conflicts).
template <int E>
__device__ __forceinline__ float lane_dot(const float* q, const float (&k)[E]) {
    float p = 0.f;
    if (E == 1) {
        p = q[0] * k[0];
    } else if (E == 2) {
        const float2 v = *reinterpret_cast<const float2*>(q);
        p = fmaf(v.y, k[1], v.x * k[0]);
    } else {
#pragma unroll
        for (int i = 0; i < E; i += 4) {
            const float4 v = *reinterpret_cast<const float4*>(q + i);
            p = fmaf(v.x, k[i], p);
            p = fmaf(v.y, k[i + 1], p);
            p = fmaf(v.z, k[i + 2], p);
            p = fmaf(v.w, k[i + 3], p);
        }
    }
    return p;
}

template <int E>
__device__ __forceinline__ void score_rows(const float* qs, const float* ws, const u16* cache, const i32* table,
                                           i32 seq_len, u32 heads, float scale, float* out) {
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, hd = 32u * E;
    for (i32 j = blockIdx.x * SCORE_WARPS + warp; j < seq_len; j += gridDim.x * SCORE_WARPS) {
        const u64 slot = kv_slot(table, j);
        const u16* row = cache + slot * hd + lane * E;
        float k[E];
#pragma unroll
        for (int i = 0; i < E; ++i) k[i] = bits2f(row[i]);
        float acc = 0.f;
        for (u32 h = 0; h < heads; ++h) {
            const float p = warp_sum(lane_dot<E>(qs + h * hd + lane * E, k));
            acc = fmaf(ws[h], fmaxf(p, 0.f), acc);
        }
        if (lane == 0) out[j] = acc * scale;
    }
}

// Any other head_dim <= 256: lane l holds the elements l, l + 32, ... of the row (strided, conflict-free reads).
__device__ __forceinline__ void score_rows_any(const float* qs, const float* ws, const u16* cache, const i32* table,
                                               i32 seq_len, u32 heads, u32 hd, float scale, float* out) {
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (i32 j = blockIdx.x * SCORE_WARPS + warp; j < seq_len; j += gridDim.x * SCORE_WARPS) {
        const u16* row = cache + kv_slot(table, j) * hd;
        float k[8];
#pragma unroll
        for (u32 i = 0; i < 8; ++i) k[i] = lane + 32 * i < hd ? bits2f(row[lane + 32 * i]) : 0.f;
        float acc = 0.f;
        for (u32 h = 0; h < heads; ++h) {
            float p = 0.f;
#pragma unroll
            for (u32 i = 0; i < 8; ++i)
                if (lane + 32 * i < hd) p = fmaf(qs[h * hd + lane + 32 * i], k[i], p);
            p = warp_sum(p);
            acc = fmaf(ws[h], fmaxf(p, 0.f), acc);
        }
        if (lane == 0) out[j] = acc * scale;
    }
}

// Dynamic shared memory: (heads * head_dim + heads) floats. head_dim 32, 64, 128 and 256 take the vector
// paths, any other head_dim <= 256 the strided one.
extern "C" __global__ __launch_bounds__(SCORE_WARPS * 32) void dsa_index_scores(
    const u16* q, const float* w, const u16* cache, const u8* meta, u32 meta_stride, float* scores, u32 num_seqs,
    u32 heads, u32 head_dim, u32 score_stride, float scale) {
    pdl_entry();
    extern __shared__ float4 smem_v[];  // float4: 16-byte aligned for the vector reads
    float* smem = reinterpret_cast<float*>(smem_v);
    const u32 s = blockIdx.y;
    if (s >= num_seqs) return;
    const u8* slab = meta_slab(meta, meta_stride, s);
    i32 seq_len = slab_seq_len(slab);
    const i32* table = slab_table(slab);
    if (seq_len > (i32)score_stride) seq_len = (i32)score_stride;
    if ((i32)(blockIdx.x * SCORE_WARPS) >= seq_len) return;  // no rows for this block: skip the staging
    float* qs = smem;
    float* ws = smem + heads * head_dim;
    const u16* qsrc = q + (u64)s * heads * head_dim;
    for (u32 i = threadIdx.x; i < heads * head_dim; i += blockDim.x) qs[i] = bits2f(qsrc[i]);
    for (u32 i = threadIdx.x; i < heads; i += blockDim.x) ws[i] = w[(u64)s * heads + i];
    __syncthreads();
    float* out = scores + (u64)s * score_stride;
    switch (head_dim) {
        case 32: score_rows<1>(qs, ws, cache, table, seq_len, heads, scale, out); break;
        case 64: score_rows<2>(qs, ws, cache, table, seq_len, heads, scale, out); break;
        case 128: score_rows<4>(qs, ws, cache, table, seq_len, heads, scale, out); break;
        case 256: score_rows<8>(qs, ws, cache, table, seq_len, heads, scale, out); break;
        default: score_rows_any(qs, ws, cache, table, seq_len, heads, head_dim, scale, out); break;
    }
}

// Order-preserving key: a > b as floats iff key(a) > key(b); -0 == +0; NaN maps to 0 (below every number).
__device__ __forceinline__ u32 score_key(float x) {
    const u32 u = x == 0.f ? 0u : __float_as_uint(x);
    if (x != x) return 0u;
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Warp 0 finds the bin holding the rem-th largest key of this pass (bins scanned from 255 down) and
// leaves (bin, rem within the bin) in out[0], out[1].
__device__ __forceinline__ void pick_bin(const u32* hist, u32 rem, u32* out) {
    const u32 lane = threadIdx.x & 31;
    u32 c = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) c += hist[255 - (lane * 8 + j)];
    u32 incl = c;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const u32 v = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= (u32)o) incl += v;
    }
    const u32 hit = __ballot_sync(0xffffffffu, incl >= rem);
    if (lane == (u32)(__ffs(hit) - 1)) {
        u32 before = incl - c;
        for (int j = 0; j < 8; ++j) {
            const u32 b = 255 - (lane * 8 + j);
            if (before + hist[b] >= rem) {
                out[0] = b;
                out[1] = rem - before;
                break;
            }
            before += hist[b];
        }
    }
}

// Exclusive block prefix of two per-thread flags; returns the block totals. Uses 2*TOPK_WARPS u32 of `red`.
__device__ __forceinline__ void block_scan2(bool a, bool b, u32* red, u32* pa, u32* pb, u32* ta, u32* tb) {
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 ba = __ballot_sync(0xffffffffu, a), bb = __ballot_sync(0xffffffffu, b);
    const u32 lt = (1u << lane) - 1u;
    if (lane == 0) {
        red[warp] = __popc(ba);
        red[TOPK_WARPS + warp] = __popc(bb);
    }
    __syncthreads();
    u32 oa = 0, ob = 0, sa = 0, sb = 0;
    for (u32 w = 0; w < TOPK_WARPS; ++w) {
        const u32 x = red[w], y = red[TOPK_WARPS + w];
        if (w < warp) {
            oa += x;
            ob += y;
        }
        sa += x;
        sb += y;
    }
    *pa = oa + __popc(ba & lt);
    *pb = ob + __popc(bb & lt);
    *ta = sa;
    *tb = sb;
    __syncthreads();
}

extern "C" __global__ __launch_bounds__(TOPK_THREADS) void dsa_topk(
    const float* scores, u32 score_stride, const u8* meta, u32 meta_stride, i32* sel, u32 sel_stride, u32 num_seqs,
    u32 k) {
    pdl_entry();
    __shared__ u32 hist[256];
    __shared__ u32 pick[2];
    __shared__ u32 red[2 * TOPK_WARPS];
    const u32 s = blockIdx.x;
    if (s >= num_seqs) return;
    const i32 seq_len = slab_seq_len(meta_slab(meta, meta_stride, s));
    const u32 n = (u32)min(max(seq_len, 0), (i32)score_stride);
    const float* x = scores + (u64)s * score_stride;
    i32* out = sel + (u64)s * sel_stride;
    const u32 kk = min(k, n);
    for (u32 i = kk + threadIdx.x; i < sel_stride; i += blockDim.x) out[i] = -1;
    if (n <= k) {  // every visible row is selected
        for (u32 i = threadIdx.x; i < n; i += blockDim.x) out[i] = (i32)i;
        return;
    }
    u32 prefix = 0, mask = 0, rem = k;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (u32 i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
        __syncthreads();
        for (u32 base = 0; base < n; base += blockDim.x) {  // warp-uniform trip count (match below)
            const u32 i = base + threadIdx.x;
            const u32 key = i < n ? score_key(x[i]) : 0u;
            const u32 bin = i < n && (key & mask) == prefix ? (key >> shift) & 255u : 256u;
            // Scores of one magnitude share a few bins: one atomic per distinct bin per warp, not per row.
            const u32 peers = __match_any_sync(0xffffffffu, bin);
            if (bin < 256u && (threadIdx.x & 31) == (u32)(__ffs(peers) - 1)) atomicAdd(&hist[bin], __popc(peers));
        }
        __syncthreads();
        if (threadIdx.x < 32) pick_bin(hist, rem, pick);
        __syncthreads();
        prefix |= pick[0] << shift;
        mask |= 255u << shift;
        rem = pick[1];
        __syncthreads();
    }
    // key > prefix: taken (k - rem of them); key == prefix: the first rem in row order.
    u32 n_gt = 0, n_eq = 0;
    for (u32 base = 0; base < n; base += blockDim.x) {
        const u32 i = base + threadIdx.x;
        const u32 key = i < n ? score_key(x[i]) : 0u;
        const bool gt = i < n && key > prefix, eq = i < n && key == prefix;
        u32 pg, pe, tg, te;
        block_scan2(gt, eq, red, &pg, &pe, &tg, &te);
        const u32 eq_rank = n_eq + pe;
        if (gt || (eq && eq_rank < rem)) out[n_gt + pg + min(eq_rank, rem)] = (i32)i;
        n_gt += tg;
        n_eq += te;
    }
}
