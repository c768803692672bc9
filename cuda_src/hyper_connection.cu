// mHC (DeepSeek-V4 manifold-constrained hyper-connections). The residual is hc streams per row, X bf16
// [rows, hc, dim]; hc_pre / hc_head collapse them into one layer input, hc_post expands a layer output back.
//
// The coefficients come from one GEMV over the flattened row (hc * dim columns: 16384 at V4-Flash dims, so
// fn is 24 x 16384 f32 = 1.5 MB). hc_mix splits those columns over many blocks and writes per-chunk partial
// sums (plus the sum of squares that folds the weightless RMSNorm in); hc_pre and hc_head reduce the
// partials in chunk order (deterministic, no atomics) and finish each row. Every block of a finishing kernel
// recomputes the few coefficients of its row so the stream sum can spread over the whole grid.
#include "norm.cuh"

#define HC_MAX 4                          // streams; the hc x hc Sinkhorn matrix lives in 16 lanes of a warp
#define MIX_MAX ((2 + HC_MAX) * HC_MAX)   // pre | post | comb coefficients of hc_pre

#define MIX_CPT 2    // columns a thread owns: chunk <= MIX_CPT * blockDim (ops/hyper_connection.py)
#define MIX_ROWS 8   // most rows a block takes
static_assert(MIX_MAX < 32, "mix_body reduces the mixes and the sum of squares as 32 lanes");

// ADD: the block first writes X[r, j, d] = bf16(src[r, j, d] + e[r, d]) (hc_add; src_hc 1 reads one row a token
// for every stream: hc_expand then hc_add; src may be X) at the columns it owns, then sums those values: each
// column of a row has one owner, so the block reads exactly what it stored.
template <bool ADD>
__device__ __forceinline__ void mix_body(__nv_bfloat16* X, const __nv_bfloat16* src, u32 src_hc,
                                         const __nv_bfloat16* e, const float* fn, float* part, u32 rows, u32 dim,
                                         u32 hc, u32 mix, u32 chunk, u32 rpb) {
    __shared__ float red[2][32][MIX_MAX + 1];   // two buffers: one barrier a row
    const u32 k = hc * dim;
    const u32 s = blockIdx.x, r0 = blockIdx.y * rpb, c0 = s * chunk, c1 = min(k, c0 + chunk);
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    const u32 nr = min(rows - r0, min(rpb, (u32)MIX_ROWS));
    float f[MIX_CPT][MIX_MAX], xv[MIX_ROWS][MIX_CPT];
#pragma unroll
    for (int i = 0; i < MIX_CPT; ++i) {         // every load of the block's rows in flight before the math
        const u32 c = c0 + threadIdx.x + i * blockDim.x;
#pragma unroll
        for (int m = 0; m < MIX_MAX; ++m) f[i][m] = c < c1 && m < (int)mix ? fn[(u64)m * k + c] : 0.f;
        const u32 st = c / dim, d = c - st * dim;   // the column's stream and element
#pragma unroll
        for (int j = 0; j < MIX_ROWS; ++j) {
            xv[j][i] = 0.f;
            if (c >= c1 || j >= (int)nr) continue;
            const u64 r = r0 + j, o = r * k + c;
            if (ADD) {
                const __nv_bfloat16 v = f2bf(bf2f(src[(r * src_hc + (src_hc == 1 ? 0 : st)) * dim + d]) +
                                             bf2f(e[r * dim + d]));
                X[o] = v;
                xv[j][i] = bf2f(v);
            } else {
                xv[j][i] = bf2f(X[o]);
            }
        }
    }
#pragma unroll
    for (int j = 0; j < MIX_ROWS; ++j) {
        if (j >= (int)nr) break;                // block-uniform
        float acc[32];   // the mixes, then the sum of squares at MIX_MAX; the rest stay 0
#pragma unroll
        for (int m = 0; m < 32; ++m) acc[m] = 0.f;
#pragma unroll
        for (int i = 0; i < MIX_CPT; ++i) {
            if (c0 + threadIdx.x + i * blockDim.x >= c1) break;
            const float x = xv[j][i];
            acc[MIX_MAX] += x * x;
#pragma unroll
            for (int m = 0; m < MIX_MAX; ++m)
                if (m < (int)mix) acc[m] += x * f[i][m];
        }
        const float v = warp_sum_scatter(acc);   // lane m: the warp's sum of acc[m]
        if (lane <= MIX_MAX) red[j & 1][wid][lane] = v;
        __syncthreads();
        for (u32 m = threadIdx.x; m <= mix; m += blockDim.x) {
            const int srcm = m == mix ? MIX_MAX : (int)m;
            float v = 0.f;
            for (int w = 0; w < nw; ++w) v += red[j & 1][w][srcm];
            part[((u64)s * rows + r0 + j) * (mix + 1) + m] = v;
        }
    }
}

// part[s, r, m] = sum over columns c of chunk s of X[r, c] * fn[m, c] (m < mix); part[s, r, mix] = sum X^2.
// grid (chunks, row groups of rpb <= MIX_ROWS rows): a thread keeps fn at its (at most MIX_CPT) columns of the
// chunk in registers for every row of its group, so fn leaves L2 once per group, not once per row (64 decode
// rows read the 1.5 MB of V4-Flash's fn 64 times otherwise); the launcher keeps the groups small at small batches
// (ops/hyper_connection.py mix_rows). A row's sums do not depend on its group: each thread adds its columns in
// column order, then a warp sum and the warps in index order, whatever the rows beside it.
extern "C" __global__ void hc_mix(const __nv_bfloat16* __restrict__ X, const float* __restrict__ fn,
                                  float* __restrict__ part, u32 rows, u32 dim, u32 hc, u32 mix, u32 chunk, u32 rpb) {
    pdl_entry();
    mix_body<false>(const_cast<__nv_bfloat16*>(X), nullptr, 0, nullptr, fn, part, rows, dim, hc, mix, chunk, rpb);
}

// hc_add (src_hc = hc) or hc_expand + hc_add (src_hc = 1) into X, then hc_mix of X: the bits of those launches.
extern "C" __global__ void hc_add_mix(__nv_bfloat16* X, const __nv_bfloat16* src, u32 src_hc,
                                      const __nv_bfloat16* __restrict__ e, const float* __restrict__ fn,
                                      float* __restrict__ part, u32 rows, u32 dim, u32 hc, u32 mix, u32 chunk,
                                      u32 rpb) {
    pdl_entry();
    mix_body<true>(X, src, src_hc, e, fn, part, rows, dim, hc, mix, chunk, rpb);
}

// Sum of the chunk partials of row r, scaled by the folded RMS factor; fills mixes[0..mix). One warp per
// coefficient (lanes stride the chunks, then a fixed-order warp sum), RED_Q coefficients per warp at once so
// their loads are in flight together (mix + 1 = 25 coefficients on 8 warps: one round of L2 latency, not
// four). blockDim a multiple of 32.
#define RED_Q 4
__device__ __forceinline__ void reduce_mixes(const float* part, u32 r, u32 rows, u32 mix, u32 nsplit, u32 n_elems,
                                             float rms_eps, float* mixes) {
    __shared__ float raw[MIX_MAX + 1];
    const u32 lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    for (u32 m0 = threadIdx.x >> 5; m0 <= mix; m0 += RED_Q * nw) {
        float v[RED_Q];
#pragma unroll
        for (int q = 0; q < RED_Q; ++q) v[q] = 0.f;
        for (u32 s = lane; s < nsplit; s += 32) {
            const float* ps = part + ((u64)s * rows + r) * (mix + 1);
#pragma unroll
            for (int q = 0; q < RED_Q; ++q)
                if (m0 + q * nw <= mix) v[q] += ps[m0 + q * nw];
        }
#pragma unroll
        for (int q = 0; q < RED_Q; ++q) {
            const float t = warp_sum(v[q]);
            if (lane == 0 && m0 + q * nw <= mix) raw[m0 + q * nw] = t;
        }
    }
    __syncthreads();
    const float rinv = rsqrtf(raw[mix] / (float)n_elems + rms_eps);
    for (u32 m = threadIdx.x; m < mix; m += blockDim.x) mixes[m] = raw[m] * rinv;
    __syncthreads();
}

// x[r, d] = sum_j w[j] * X[r, j, d] in fp32, one bf16 rounding; the grid's y dimension splits d.
__device__ __forceinline__ void stream_sum(const __nv_bfloat16* X, const float* w, __nv_bfloat16* out, u32 r,
                                           u32 dim, u32 hc) {
    const __nv_bfloat16* xr = X + (u64)r * hc * dim;
    for (u32 d = blockIdx.y * blockDim.x + threadIdx.x; d < dim; d += gridDim.y * blockDim.x) {
        float acc = 0.f;
        for (u32 j = 0; j < hc; ++j) acc += w[j] * bf2f(xr[(u64)j * dim + d]);
        out[(u64)r * dim + d] = f2bf(acc);
    }
}

// Sinkhorn over the hc x hc matrix, one entry per lane: lane j * HC_MAX + k (< 16) holds C[j][k], every other
// lane and every entry outside hc x hc holds 0. A row sum is two xor-shuffles (lanes k ^ 1, k ^ 2), a column sum
// two more (j ^ 1, j ^ 2 as lane ^ 4, ^ 8), so all 16 entries normalise at once: (c0 + c1) + (c2 + c3), the
// order the twin sums in (with zero padding it is plain index order for hc < 4). Each division is a multiply by
// the correctly rounded reciprocal (x * (1 / d)); nothing is contracted into an FMA. All 32 lanes call it.
__device__ __forceinline__ float row_sum4(float c) {
    c = __fadd_rn(c, __shfl_xor_sync(0xffffffffu, c, 1));
    return __fadd_rn(c, __shfl_xor_sync(0xffffffffu, c, 2));
}

__device__ __forceinline__ float col_sum4(float c) {
    c = __fadd_rn(c, __shfl_xor_sync(0xffffffffu, c, 4));
    return __fadd_rn(c, __shfl_xor_sync(0xffffffffu, c, 8));
}

__device__ __forceinline__ float sinkhorn_lanes(float logit, bool in, float eps, u32 iters) {
    float mx = in ? logit : -INFINITY;
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    float c = in ? expf(logit - mx) : 0.f;
    const float rs = __frcp_rn(row_sum4(c));
    c = in ? __fadd_rn(__fmul_rn(c, rs), eps) : 0.f;
    for (u32 it = 0; it < (iters > 0u ? iters : 1u); ++it) {   // the first column pass always runs
        if (it > 0) {
            const float rr = __frcp_rn(__fadd_rn(row_sum4(c), eps));
            c = in ? __fmul_rn(c, rr) : 0.f;
        }
        const float rc = __frcp_rn(__fadd_rn(col_sum4(c), eps));
        c = in ? __fmul_rn(c, rc) : 0.f;
    }
    return c;
}

// Collapse (docs/model_math.md B.2): pre_j = sigmoid(mix_j s0 + b_j) + hc_eps -> x = sum_j pre_j X_j (bf16);
// post_j = 2 sigmoid(mix_{hc+j} s1 + b_{hc+j}); comb = Sinkhorn(L), L[j,k] = mix_{2hc+hc j+k} s2 + b_{..}:
// C = softmax_k(L) + eps, C /= colsum + eps, then (iters-1) x {C /= rowsum + eps; C /= colsum + eps}.
__device__ __forceinline__ float pre_coef(const float* mixes, const float* scale, const float* base, u32 j,
                                          float hc_eps) {
    return sigmoid_f32(mixes[j] * scale[0] + base[j]) + hc_eps;
}

// post_j = 2 sigmoid(mix_{hc+j} s1 + b_{hc+j}) and the comb's Sinkhorn logit m = 2hc + hc j + k: the one spelling of
// each, for hc_pre (post_comb) and hc_pre_norm (post_logits).
__device__ __forceinline__ float post_coef(const float* mixes, const float* scale, const float* base, u32 j, u32 hc) {
    return 2.f * sigmoid_f32(mixes[hc + j] * scale[1] + base[hc + j]);
}

__device__ __forceinline__ float comb_logit(const float* mixes, const float* scale, const float* base, u32 m) {
    return mixes[m] * scale[2] + base[m];
}

// Row r's post and comb from its mixes; all 32 lanes of one warp call it.
__device__ __forceinline__ void post_comb(const float* mixes, const float* scale, const float* base, u32 r, u32 hc,
                                          float hc_eps, u32 iters, float* post_out, float* comb_out) {
    const int lane = threadIdx.x & 31;
    if (lane < (int)hc) post_out[(u64)r * hc + lane] = post_coef(mixes, scale, base, lane, hc);
    const int j = lane / HC_MAX, k = lane % HC_MAX;
    const bool in = lane < HC_MAX * HC_MAX && j < (int)hc && k < (int)hc;
    const float c = sinkhorn_lanes(in ? comb_logit(mixes, scale, base, 2 * hc + j * hc + k) : 0.f, in, hc_eps, iters);
    if (in) comb_out[(u64)r * hc * hc + j * hc + k] = c;
}

// Row r's post and its comb's Sinkhorn logits L[j, k] (hc_pre_norm: hc_post runs the Sinkhorn, off the collapse's
// path).
__device__ __forceinline__ void post_logits(const float* mixes, const float* scale, const float* base, u32 r, u32 hc,
                                            float* post_out, float* logit_out) {
    const u32 t = threadIdx.x & 31;
    if (t < hc) post_out[(u64)r * hc + t] = post_coef(mixes, scale, base, t, hc);
    if (t < hc * hc) logit_out[(u64)r * hc * hc + t] = comb_logit(mixes, scale, base, 2 * hc + t);
}

// part from hc_mix with mix = (2 + hc) hc. grid (rows, dim splits), blockDim a multiple of 32.
extern "C" __global__ void hc_pre(const __nv_bfloat16* __restrict__ X, const float* __restrict__ part,
                                  const float* __restrict__ scale, const float* __restrict__ base,
                                  __nv_bfloat16* __restrict__ x_out, float* __restrict__ post_out,
                                  float* __restrict__ comb_out, u32 rows, u32 dim, u32 hc, u32 nsplit,
                                  float rms_eps, float hc_eps, u32 iters) {
    pdl_entry();
    __shared__ float mixes[MIX_MAX];
    __shared__ float pre[HC_MAX];
    const u32 r = blockIdx.x, mix = (2 + hc) * hc;
    reduce_mixes(part, r, rows, mix, nsplit, hc * dim, rms_eps, mixes);
    if (threadIdx.x < 32) {
        if (threadIdx.x < hc) pre[threadIdx.x] = pre_coef(mixes, scale, base, threadIdx.x, hc_eps);
        // one block per row writes post and comb; the others only need pre (the branch is block-uniform)
        if (blockIdx.y == 0) post_comb(mixes, scale, base, r, hc, hc_eps, iters, post_out, comb_out);
    }
    __syncthreads();
    stream_sum(X, pre, x_out, r, dim, hc);
}

// Final collapse before the norm and LM head: pre_j = sigmoid(mix_j s0 + b_j) + hc_eps, y = sum_j pre_j X_j.
// part from hc_mix with mix = hc. grid (rows, dim splits).
extern "C" __global__ void hc_head(const __nv_bfloat16* __restrict__ X, const float* __restrict__ part,
                                   const float* __restrict__ scale, const float* __restrict__ base,
                                   __nv_bfloat16* __restrict__ y, u32 rows, u32 dim, u32 hc, u32 nsplit,
                                   float rms_eps, float hc_eps) {
    pdl_entry();
    __shared__ float mixes[HC_MAX];
    __shared__ float pre[HC_MAX];
    const u32 r = blockIdx.x;
    reduce_mixes(part, r, rows, hc, nsplit, hc * dim, rms_eps, mixes);
    if (threadIdx.x < hc) pre[threadIdx.x] = pre_coef(mixes, scale, base, threadIdx.x, hc_eps);
    __syncthreads();
    stream_sum(X, pre, y, r, dim, hc);
}

// hc_pre (PRE) or hc_head, then rms_norm_w with w of the collapsed row into y: one block a row at the threads
// rms_norm_w takes for dim, holding the row in norm.cuh's layout, so y has the bits of the two launches (the
// collapse is the same fp32 sum over streams in order, one bf16 rounding). The streams and w are loaded before
// the coefficients arrive; warp 0 computes pre, warp 1 (warp 0 when it is alone) writes post and the comb's
// Sinkhorn logits, which hc_post finishes: the 20 dependent Sinkhorn passes (6-7 us a V4 step on an H100) are
// then off this kernel's path, which every block after it waits for. The collapsed row itself is not stored.
// grid rows.
template <bool PRE>
__device__ __forceinline__ void collapse_norm(const __nv_bfloat16* X, const float* part, const float* scale,
                                              const float* base, const __nv_bfloat16* w, __nv_bfloat16* y,
                                              float* post_out, float* logit_out, u32 rows, u32 dim, u32 hc,
                                              u32 nsplit, float rms_eps, float hc_eps, float norm_eps) {
    __shared__ float mixes[MIX_MAX];
    __shared__ float pre[HC_MAX];
    __shared__ float red[64];
    const u32 r = blockIdx.x, nvec = dim >> 3, wid = threadIdx.x >> 5, lane = threadIdx.x & 31;
    uint4 xs[HC_MAX][MAXV], wv[MAXV], v[MAXV];
#pragma unroll
    for (int j = 0; j < HC_MAX; ++j) {
        if (j < (int)hc) {
            load_row(X + ((u64)r * hc + j) * dim, nvec, xs[j]);
        } else {
#pragma unroll
            for (int k = 0; k < MAXV; ++k) xs[j][k] = make_uint4(0u, 0u, 0u, 0u);
        }
    }
    load_row(w, nvec, wv);
    reduce_mixes(part, r, rows, PRE ? (2 + hc) * hc : hc, nsplit, hc * dim, rms_eps, mixes);
    if (wid == 0 && lane < hc) pre[lane] = pre_coef(mixes, scale, base, lane, hc_eps);
    if (PRE && wid == (blockDim.x > 32 ? 1u : 0u)) post_logits(mixes, scale, base, r, hc, post_out, logit_out);
    __syncthreads();
#pragma unroll
    for (int k = 0; k < MAXV; ++k) {
        float acc[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] = 0.f;
#pragma unroll
        for (int j = 0; j < HC_MAX; ++j) {
            if (j >= (int)hc) break;
            float fx[8];
            unpack8(xs[j][k], fx);
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[e] += pre[j] * fx[e];
        }
        v[k] = pack8(acc);
    }
    rms_row_regs(v, wv, true, y + (u64)r * dim, dim, norm_eps, false, red, 0);
}

extern "C" __global__ __launch_bounds__(512) void hc_pre_norm(
    const __nv_bfloat16* __restrict__ X, const float* __restrict__ part, const float* __restrict__ scale,
    const float* __restrict__ base, const __nv_bfloat16* __restrict__ w, __nv_bfloat16* __restrict__ y,
    float* __restrict__ post_out, float* __restrict__ logit_out, u32 rows, u32 dim, u32 hc, u32 nsplit, float rms_eps,
    float hc_eps, float norm_eps) {
    pdl_entry();
    collapse_norm<true>(X, part, scale, base, w, y, post_out, logit_out, rows, dim, hc, nsplit, rms_eps, hc_eps,
                        norm_eps);
}

extern "C" __global__ __launch_bounds__(512) void hc_head_norm(
    const __nv_bfloat16* __restrict__ X, const float* __restrict__ part, const float* __restrict__ scale,
    const float* __restrict__ base, const __nv_bfloat16* __restrict__ w, __nv_bfloat16* __restrict__ y, u32 rows,
    u32 dim, u32 hc, u32 nsplit, float rms_eps, float hc_eps, float norm_eps) {
    pdl_entry();
    collapse_norm<false>(X, part, scale, base, w, y, nullptr, nullptr, rows, dim, hc, nsplit, rms_eps, hc_eps,
                         norm_eps);
}

// Y[r, k, d] = post[r, k] f[r, d] + sum_j comb[r, j, k] X[r, j, d] (fp32, one bf16 rounding). One thread owns
// every stream of its (r, d), reading all of X before writing, so Y may be X. grid (dim blocks, rows).
// iters == 0: comb is the matrix (hc_pre's). iters > 0: comb holds the Sinkhorn logits hc_pre_norm wrote, and warp 0
// of each block runs the Sinkhorn (hc_eps, iters) first. PDL: that path reads post and the logits before its wait:
// the launcher's caller keeps at least one kernel that waits before it triggers (pdl_entry) between hc_pre_norm and
// this launch (layers/mhc.py: the attention or the MoE between), so hc_pre_norm has finished when this kernel
// launches, and the Sinkhorn overlaps the kernel ahead. f and X are read after the wait on both paths.
__device__ __forceinline__ void post_rows(const __nv_bfloat16* f, const __nv_bfloat16* X, const float* post,
                                          const float* comb, __nv_bfloat16* Y, u32 rows, u32 dim, u32 hc,
                                          float hc_eps, u32 iters) {
    __shared__ float p[HC_MAX], cm[HC_MAX * HC_MAX];
    const u32 r = blockIdx.y, t = threadIdx.x;
    if (iters) {
        pdl_trigger();
        if (t < 32) {   // lane j * HC_MAX + k holds entry (j, k), as sinkhorn_lanes wants
            const u32 j = t / HC_MAX, k = t % HC_MAX;
            const bool in = t < HC_MAX * HC_MAX && j < hc && k < hc;
            const float c = sinkhorn_lanes(in ? comb[(u64)r * hc * hc + j * hc + k] : 0.f, in, hc_eps, iters);
            if (in) cm[j * hc + k] = c;
            if (t < hc) p[t] = post[(u64)r * hc + t];
        }
        pdl_wait();
    } else {
        pdl_entry();
        if (t < hc) p[t] = post[(u64)r * hc + t];
        if (t < hc * hc) cm[t] = comb[(u64)r * hc * hc + t];
    }
    __syncthreads();
    const u64 row = (u64)r * hc * dim;
    for (u32 d = blockIdx.x * blockDim.x + t; d < dim; d += gridDim.x * blockDim.x) {
        float xs[HC_MAX];
#pragma unroll
        for (int j = 0; j < HC_MAX; ++j) xs[j] = j < (int)hc ? bf2f(X[row + (u64)j * dim + d]) : 0.f;
        const float fv = bf2f(f[(u64)r * dim + d]);
#pragma unroll
        for (int kk = 0; kk < HC_MAX; ++kk) {
            if (kk >= (int)hc) break;
            float acc = p[kk] * fv;
#pragma unroll
            for (int j = 0; j < HC_MAX; ++j)
                if (j < (int)hc) acc += cm[j * hc + kk] * xs[j];
            Y[row + (u64)kk * dim + d] = f2bf(acc);
        }
    }
}

extern "C" __global__ void hc_post(const __nv_bfloat16* f, const __nv_bfloat16* X, const float* __restrict__ post,
                                   const float* __restrict__ comb, __nv_bfloat16* Y, u32 rows, u32 dim, u32 hc,
                                   float hc_eps, u32 iters) {
    post_rows(f, X, post, comb, Y, rows, dim, hc, hc_eps, iters);
}

// out[r, j, :] = x[r, :] for every stream j (the seed's expansion of one hidden into hc streams).
extern "C" __global__ void hc_expand(const __nv_bfloat16* __restrict__ x, __nv_bfloat16* __restrict__ out, u32 rows,
                                     u32 dim, u32 hc) {
    pdl_entry();
    const u64 n = (u64)rows * dim;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const u64 r = i / dim, d = i % dim;
        const __nv_bfloat16 v = x[i];
        for (u32 j = 0; j < hc; ++j) out[(r * hc + j) * dim + d] = v;
    }
}

// X[r, j, :] += x[r, :] for every stream j (fp32 add, one bf16 rounding): adds e_proj(e) to each h_proj stream.
extern "C" __global__ void hc_add(__nv_bfloat16* X, const __nv_bfloat16* __restrict__ x, u32 rows, u32 dim, u32 hc) {
    pdl_entry();
    const u64 n = (u64)rows * dim;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const u64 r = i / dim, d = i % dim;
        const float v = bf2f(x[i]);
        for (u32 j = 0; j < hc; ++j) {
            const u64 o = (r * hc + j) * dim + d;
            X[o] = f2bf(bf2f(X[o]) + v);
        }
    }
}
