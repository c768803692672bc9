// Row RMSNorm in registers, shared by rms_norm.cu, norm_rope.cu and hyper_connection.cu: one block (blockDim.x
// threads, a whole number of warps) normalises one row; thread t holds the 16-byte vectors t, t + blockDim.x, ...
// (at most MAXV), so the sum order, hence the bits, depend on blockDim.x (the launchers pick it from dim alone).
#pragma once
#include "common.cuh"

#define MAXV 4

// Block-wide sum behind a single barrier: each warp publishes its warp_sum, then every thread adds all
// the partials in warp order (one order everywhere, so every thread holds the same sum). `red` is 2 x 32
// floats; consecutive calls alternate halves (`parity`), so a warp that runs ahead into the next call
// writes the other half while slow warps may still be reading this one; the barrier of the call in
// between orders the reuse.
__device__ __forceinline__ float block_sum1(float v, float* red, u32 parity) {
    const u32 lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    float* r = red + 32 * (parity & 1);
    if (lane == 0) r[wid] = v;
    __syncthreads();
    float s = r[0];
    for (u32 i = 1; i < nw; ++i) s += r[i];
    return s;
}

__device__ __forceinline__ void load_row(const __nv_bfloat16* x, u32 nvec, uint4 (&v)[MAXV]) {
#pragma unroll
    for (int k = 0; k < MAXV; ++k) {
        const u32 i = threadIdx.x + k * blockDim.x;
        v[k] = i < nvec ? reinterpret_cast<const uint4*>(x)[i] : make_uint4(0u, 0u, 0u, 0u);
    }
}

// Eight bf16 in a vector: element 2j is the low half of word j.
__device__ __forceinline__ void unpack8(uint4 q, float (&f)[8]) {
    const u32 w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        f[2 * j] = __uint_as_float(w[j] << 16);
        f[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
    }
}

__device__ __forceinline__ uint4 pack8(const float (&f)[8]) {
    u32 w[4];
#pragma unroll
    for (int j = 0; j < 4; ++j)
        w[j] = (u32)__bfloat16_as_ushort(f2bf(f[2 * j])) | ((u32)__bfloat16_as_ushort(f2bf(f[2 * j + 1])) << 16);
    return make_uint4(w[0], w[1], w[2], w[3]);
}

// y = (x * r) * g with r = 1 / sqrt(mean(x^2) + eps) and g = w, 1 + w, or 1 (has_w false) over a row this
// thread already holds in load_row's layout (v: the row, wv: the weight). Products are not fused, so the twin
// rounds alike. Kernels that build the row themselves (a gathered embedding, an mHC collapse) call this.
__device__ __forceinline__ void rms_row_regs(const uint4 (&v)[MAXV], const uint4 (&wv)[MAXV], bool has_w,
                                             __nv_bfloat16* y, u32 dim, float eps, bool unit_offset, float* red,
                                             u32 parity) {
    const u32 nvec = dim >> 3;
    float ssk[MAXV];  // one chain per vector: 8-deep FFMA chains instead of one 8 * MAXV deep
#pragma unroll
    for (int k = 0; k < MAXV; ++k) {
        float f[8];
        unpack8(v[k], f);
        ssk[k] = 0.f;
#pragma unroll
        for (int j = 0; j < 8; ++j) ssk[k] += f[j] * f[j];
    }
    float ss = ssk[0];
#pragma unroll
    for (int k = 1; k < MAXV; ++k) ss += ssk[k];
    ss = block_sum1(ss, red, parity);
    const float r = 1.f / sqrtf(ss / (float)dim + eps);
#pragma unroll
    for (int k = 0; k < MAXV; ++k) {
        const u32 i = threadIdx.x + k * blockDim.x;
        if (i < nvec) {
            float f[8], g[8];
            unpack8(v[k], f);
            if (has_w) {
                unpack8(wv[k], g);
#pragma unroll
                for (int j = 0; j < 8; ++j) g[j] = unit_offset ? 1.f + g[j] : g[j];
            } else {
#pragma unroll
                for (int j = 0; j < 8; ++j) g[j] = 1.f;
            }
#pragma unroll
            for (int j = 0; j < 8; ++j) f[j] = __fmul_rn(__fmul_rn(f[j], r), g[j]);
            reinterpret_cast<uint4*>(y)[i] = pack8(f);
        }
    }
}

// rms_row_regs over row x read here. The weight is loaded with x, unconditionally (a NULL w reads x's row
// instead and ignores it): behind a branch, ptxas would issue it only after the x sum of squares, i.e. after a
// first full memory round trip.
// res != nullptr (the add_rms_norm kernels, whose x is writable): x = bf16(x + res) first, elementwise as
// bf16_residual_add rounds it, stored back to x by the thread that read it, and that rounded row is what
// the sum of squares and y see. res is loaded between x and w, so all 3 * MAXV loads issue before the first
// add (loaded after w, ptxas put part of them behind the adds: a second memory round trip). The plain
// norms pass a literal nullptr: after inlining their PTX is what it was without res (no load, add, store).
__device__ __forceinline__ void rms_row(const __nv_bfloat16* x, const __nv_bfloat16* res, const __nv_bfloat16* w,
                                        __nv_bfloat16* y, u32 dim, float eps, bool unit_offset, float* red,
                                        u32 parity) {
    const u32 nvec = dim >> 3;
    uint4 v[MAXV], wv[MAXV], rv[MAXV];
    load_row(x, nvec, v);
    if (res != nullptr) load_row(res, nvec, rv);
    load_row(w != nullptr ? w : x, nvec, wv);
    if (res != nullptr) {
#pragma unroll
        for (int k = 0; k < MAXV; ++k) {  // padding vectors: 0 + 0 stays 0, as load_row left them
            float f[8], g[8];
            unpack8(v[k], f);
            unpack8(rv[k], g);
#pragma unroll
            for (int j = 0; j < 8; ++j) f[j] = __fadd_rn(f[j], g[j]);
            v[k] = pack8(f);  // the one bf16 rounding of the sum
            const u32 i = threadIdx.x + k * blockDim.x;
            if (i < nvec) reinterpret_cast<uint4*>(const_cast<__nv_bfloat16*>(x))[i] = v[k];
        }
    }
    rms_row_regs(v, wv, w != nullptr, y, dim, eps, unit_offset, red, parity);
}

// y = ((x - mean) * rstd) * w + b over one row, rstd = 1 / sqrt(var + eps) (biased variance, torch LayerNorm), in
// load_row's layout; two block sums (halves 0 and 1 of `red`: the second's barrier orders the next row's first).
__device__ __forceinline__ void layer_row(const __nv_bfloat16* x, const __nv_bfloat16* w, const __nv_bfloat16* b,
                                          __nv_bfloat16* yr, u32 dim, float eps, float* red) {
    const u32 nvec = dim >> 3;
    uint4 v[MAXV], wv[MAXV], bv[MAXV];
    load_row(x, nvec, v);
    load_row(w, nvec, wv);
    load_row(b, nvec, bv);
    float s = 0.f;
#pragma unroll
    for (int k = 0; k < MAXV; ++k) {
        float f[8];
        unpack8(v[k], f);
#pragma unroll
        for (int j = 0; j < 8; ++j) s += f[j];
    }
    const float mean = block_sum1(s, red, 0) / (float)dim;
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < MAXV; ++k) {
        if (threadIdx.x + k * blockDim.x < nvec) {  // padding vectors would add mean^2
            float f[8];
            unpack8(v[k], f);
#pragma unroll
            for (int j = 0; j < 8; ++j) ss += (f[j] - mean) * (f[j] - mean);
        }
    }
    const float rstd = 1.f / sqrtf(block_sum1(ss, red, 1) / (float)dim + eps);
#pragma unroll
    for (int k = 0; k < MAXV; ++k) {
        const u32 i = threadIdx.x + k * blockDim.x;
        if (i < nvec) {
            float f[8], g[8], c[8];
            unpack8(v[k], f);
            unpack8(wv[k], g);
            unpack8(bv[k], c);
#pragma unroll
            for (int j = 0; j < 8; ++j)
                f[j] = __fadd_rn(__fmul_rn(__fmul_rn(__fsub_rn(f[j], mean), rstd), g[j]), c[j]);
            reinterpret_cast<uint4*>(yr)[i] = pack8(f);
        }
    }
}
