// Shared device helpers. NVRTC has no host std headers: only cuda_bf16.h / cuda_fp8.h are included.
// CupyBackend inlines this file in place of `#include "common.cuh"` (so cupy's source-keyed cache
// sees header changes); nvcc in CI finds it with -I cuda_src.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp8.h>

// NVRTC has no math.h: the float constants kernels need.
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
#ifndef NAN
#define NAN __int_as_float(0x7fffffff)
#endif

typedef unsigned int u32;
typedef int i32;
typedef unsigned long long u64;
typedef long long i64;
typedef unsigned short u16;
typedef unsigned char u8;

// Programmatic dependent launch (PDL). Every kernel starts with pdl_entry(): wait until the kernel before it in
// the stream has finished and its writes are visible, then let the next kernel's blocks be scheduled while this
// one runs (they park in their own wait). A kernel may instead trigger first and wait later, reading before the
// wait only memory no kernel of the step writes (the streaming GEMVs prefetch their weights), or wait first and
// trigger late (moe_stage_f16, whose dependent is a persistent GEMM). Launched without the PDL attribute, both
// instructions are no-ops.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_entry() {
    pdl_wait();
    pdl_trigger();
}

// Thread block clusters (sm_90): the blocks of a cluster can read each other's shared memory. cluster_sync:
// every thread of every block of the cluster; shared-memory writes before it are visible to the others after.
__device__ __forceinline__ void cluster_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

// The float at this block's shared address p, in the shared memory of cluster block `rank`.
__device__ __forceinline__ float ld_cluster_f32(const float* p, u32 rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    u32 a = (u32)__cvta_generic_to_shared(p), r;
    float v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(r) : "memory");
    return v;
#else
    return *p;
#endif
}

__device__ __forceinline__ float bf2f(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ __nv_bfloat16 f2bf(float v) { return __float2bfloat16_rn(v); }

// Element i of an output y of bf16 (out_f32 == 0) or f32.
__device__ __forceinline__ void store_out(void* y, u64 i, float v, u32 out_f32) {
    if (out_f32) ((float*)y)[i] = v;
    else ((__nv_bfloat16*)y)[i] = f2bf(v);
}
__device__ __forceinline__ float bits2f(u16 b) { return __uint_as_float(((u32)b) << 16); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Lane l gets warp_sum(v[l]) of 32 values a lane, bit for bit, in 31 shuffles instead of 32 x 5: each step sends
// the half of the values the partner keeps and adds the same two partial sums warp_sum's butterfly adds (lane
// bit o set keeps the upper half; a + b == b + a). v is consumed.
template <int O> __device__ __forceinline__ void scatter_step(float (&v)[32], u32 lane) {
    const bool hi = lane & O;
#pragma unroll
    for (int i = 0; i < O; ++i) {
        const float send = hi ? v[i] : v[i + O], keep = hi ? v[i + O] : v[i];
        v[i] = keep + __shfl_xor_sync(0xffffffffu, send, O);
    }
}
__device__ __forceinline__ float warp_sum_scatter(float (&v)[32]) {
    const u32 lane = threadIdx.x & 31;
    scatter_step<16>(v, lane); scatter_step<8>(v, lane); scatter_step<4>(v, lane); scatter_step<2>(v, lane);
    scatter_step<1>(v, lane);
    return v[0];
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Block-wide sum for blockDim.x a multiple of 32 (<= 1024); `red` is 32 floats of shared memory.
__device__ __forceinline__ float block_sum(float v, float* red) {
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) red[wid] = v;
    __syncthreads();
    v = lane < nw ? red[lane] : 0.f;
    return warp_sum(v);
}

__device__ __forceinline__ float block_max(float v, float* red) {
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) red[wid] = v;
    __syncthreads();
    v = lane < nw ? red[lane] : -INFINITY;
    return warp_max(v);
}

// Per-row scalars read through (pointer, stride in bytes): a metadata slab's position (u32) and cache slot (i64)
// at meta + offset + r * meta_stride, or packed arrays (stride 4 / 8).
__device__ __forceinline__ u32 row_pos(const u32* pos, u32 pos_stride, u32 r) {
    return *reinterpret_cast<const u32*>(reinterpret_cast<const u8*>(pos) + (u64)r * pos_stride);
}

__device__ __forceinline__ i64 row_slot(const i64* slots, u32 slot_stride, u32 r) {
    return *reinterpret_cast<const i64*>(reinterpret_cast<const u8*>(slots) + (u64)r * slot_stride);
}

// sigmoid in fp32: 1 / (1 + exp(-g)), correctly rounded division (the twins' np.float32 formula). Qwen3-Next's output
// and shared-expert gates, SwiGLU's silu, sigmoid routing, the mHC coefficients.
__device__ __forceinline__ float sigmoid_f32(float g) { return 1.f / (1.f + expf(-g)); }

// RoPE of one pair (a, b) at position p: theta = float(p) * inv_freq in fp32, accurate sincosf (no fast-math:
// large positions need the full range reduction), cos and sin scaled by mscale, -theta when inverse; products
// unfused, so the twin rounds alike. rope.cu and norm_rope.cu both rotate through it.
__device__ __forceinline__ void rope_pair(float& a, float& b, u32 p, float inv_freq, float mscale, bool inverse) {
    float s, c;
    sincosf(__fmul_rn((float)p, inv_freq), &s, &c);
    c = __fmul_rn(c, mscale);
    s = inverse ? -__fmul_rn(s, mscale) : __fmul_rn(s, mscale);
    const float x = a, y = b;
    a = __fsub_rn(__fmul_rn(x, c), __fmul_rn(y, s));
    b = __fadd_rn(__fmul_rn(y, c), __fmul_rn(x, s));
}

__device__ __forceinline__ float fp8_to_f(u8 b) {
    __nv_fp8_e4m3 v;
    v.__x = b;
    return float(v);
}

__device__ __forceinline__ u8 f_to_fp8(float f) {
    return (u8)__nv_cvt_float_to_fp8(f, __NV_SATFINITE, __NV_E4M3);
}

// E8M0 scale byte -> 2^(b-127); 0xFF is NaN.
__device__ __forceinline__ float e8m0_to_f(u8 b) {
    return b == 0xFF ? __int_as_float(0x7fc00000) : (b == 0 ? __uint_as_float(0x00400000u) : __uint_as_float(((u32)b) << 23));
}

// E2M1 nibble -> float via the fp16 bit trick (exact for every code, including the subnormal 0.5).
__device__ __forceinline__ float e2m1_to_f(u32 n) {
    const u16 h = (u16)(((n & 8u) << 12) | ((n & 7u) << 9));
    return __half2float(__ushort_as_half(h)) * 16384.f;
}

// The blocked fp8 KV row (DeepSeek-V4's cache; kv_cache.cu writes it, paged_attention.cu reads it): a row of
// `width` columns whose first `nope` are e4m3 codes in blocks of 64 with one UE8M0 scale byte per block and
// whose last width - nope (the RoPE columns) stay bf16. Bytes: codes [0, nope) | zeros to rope_off |
// bf16 [rope_off, scale_off) | scales [scale_off, scale_off + ceil(nope / 64)) | zeros to row_bytes, a multiple
// of 16. Mirrored by mtp_cupy/ops/kv_cache.py fp8_block_layout.
__device__ __forceinline__ u32 kv_fp8_block_rope_off(u32 nope) { return (nope + 15) / 16 * 16; }
__device__ __forceinline__ u32 kv_fp8_block_scale_off(u32 nope, u32 width) {
    return kv_fp8_block_rope_off(nope) + 2 * (width - nope);
}
__device__ __forceinline__ u32 kv_fp8_block_row_bytes(u32 nope, u32 width) {
    return (kv_fp8_block_scale_off(nope, width) + (nope + 63) / 64 + 15) / 16 * 16;
}

// One blocked fp8 row (the layout above) from bf16 s[0, width) into d (row_bytes): each 64-column block b of
// [0, nope) gets the power-of-two scale 2^e, e = ceil(log2(max(amax_b, 1e-4) * (1/448))) from the f32 bits (the
// official fast_round_scale), stored as the UE8M0 byte e + 127, and codes e4m3(x * 2^-e) (exact scaling, round
// to nearest even, saturating); a last partial block scales over the columns it has; columns [nope, width) are
// copied as bf16, padding bytes written as zeros. Called by every thread of `nthreads` (a whole number of warps;
// thread `tid`): warp w quantises blocks w, w + warps, ... The bits do not depend on the thread count.
__device__ __forceinline__ void kv_fp8_block_store(const __nv_bfloat16* s, u8* d, u32 width, u32 nope, u32 tid,
                                                   u32 nthreads) {
    const u32 rope_off = kv_fp8_block_rope_off(nope), scale_off = kv_fp8_block_scale_off(nope, width);
    const u32 row_bytes = kv_fp8_block_row_bytes(nope, width), nblk = (nope + 63) / 64;
    const u32 lane = tid & 31, warp = tid >> 5, warps = nthreads >> 5;
    for (u32 b = warp; b < nblk; b += warps) {
        const u32 c0 = b * 64 + lane, c1 = c0 + 32;
        const float x0 = c0 < nope ? bf2f(s[c0]) : 0.f, x1 = c1 < nope ? bf2f(s[c1]) : 0.f;
        const float amax = fmaxf(warp_max(fmaxf(fabsf(x0), fabsf(x1))), 1e-4f);
        const u32 bits = __float_as_uint(amax * (1.0f / 448.0f));
        const i32 e = (i32)((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFFu) != 0u ? 1 : 0);
        const float inv = __uint_as_float((u32)(127 - e) << 23);   // 2^-e, exact
        if (c0 < nope) d[c0] = f_to_fp8(x0 * inv);
        if (c1 < nope) d[c1] = f_to_fp8(x1 * inv);
        if (lane == 0) d[scale_off + b] = (u8)(e + 127);
    }
    const u16* sr = reinterpret_cast<const u16*>(s);
    for (u32 j = tid; j < width - nope; j += nthreads) *reinterpret_cast<u16*>(d + rope_off + 2 * j) = sr[nope + j];
    for (u32 j = nope + tid; j < rope_off; j += nthreads) d[j] = 0;
    for (u32 j = scale_off + nblk + tid; j < row_bytes; j += nthreads) d[j] = 0;
}
