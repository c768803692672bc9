// On-device weight quantisation from bf16: abs-max, per-row FP8 (e4m3), NVFP4 (ModelOpt recipe).
// Layouts are those of weights/linear.py: fp8_row codes [n, k] + f32 scale [n]; nvfp4 codes [n, k/2]
// (low nibble = even element) + e4m3 block scales [n, k/16] + the host-side global scale2.
#include "common.cuh"

// *out = max |x| over n bf16 (NaN wins). |x| as bits orders like an unsigned integer, so the max is an
// integer max: a warp reduction, then one atomicMax per warp on an `out` the launcher zeroed.
extern "C" __global__ void absmax_bf16(const u16* x, u32 n, u32* out) {
    pdl_entry();
    u32 mx = 0;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        mx = max(mx, (u32)(x[i] & 0x7fffu));
    mx = __reduce_max_sync(0xffffffffu, mx);
    if ((threadIdx.x & 31) == 0 && mx) atomicMax(out, mx << 16);
}

// One block per row: scale = rowmax / 448 (1.0 for a zero row), q = e4m3(w / scale), saturating.
extern "C" __global__ void quantize_fp8_rows(const __nv_bfloat16* w, u32 n, u32 k, u8* q, float* scale) {
    pdl_entry();
    __shared__ float red[32];
    const __nv_bfloat16* row = w + (u64)blockIdx.x * k;
    float mx = 0.f;
    for (u32 i = threadIdx.x; i < k; i += blockDim.x) mx = fmaxf(mx, fabsf(bf2f(row[i])));
    mx = block_max(mx, red);
    const float s = mx > 0.f ? mx / 448.f : 1.f;
    u8* qrow = q + (u64)blockIdx.x * k;
    for (u32 i = threadIdx.x; i < k; i += blockDim.x) qrow[i] = f_to_fp8(bf2f(row[i]) / s);
    if (threadIdx.x == 0) scale[blockIdx.x] = s;
}

// E2M1 code of v, round to nearest even, saturating at 6 (bit-identical to ml_dtypes and to CUDA's
// __nv_cvt_float_to_fp4 RN): the count of rounding bounds below |v|, ties at the odd bounds going up.
__device__ __forceinline__ u32 f_to_e2m1(float v) {
    const float a = fabsf(v);
    const u32 c = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) + (a > 5.f);
    return c | ((__float_as_uint(v) >> 28) & 8u);
}

// One thread per 16-element block (n * k / 16 of them, row-major, so block b covers elements 16b..16b+15):
// block_scale = e4m3(clamp(block_amax / (6 * scale2), 2^-9, 448)), 1.0 for an all-zero block;
// codes = E2M1(w / (block_scale * scale2)).
extern "C" __global__ void quantize_nvfp4(const __nv_bfloat16* w, u32 n, u32 k, u8* q, u8* scale, float scale2) {
    pdl_entry();
    const u64 blocks = (u64)n * (k / 16);
    for (u64 b = blockIdx.x * (u64)blockDim.x + threadIdx.x; b < blocks; b += (u64)gridDim.x * blockDim.x) {
        const uint4* src = (const uint4*)(w + b * 16);
        const uint4 v0 = src[0], v1 = src[1];
        const u32 words[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
        float x[16], amax = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            x[2 * i] = __uint_as_float(words[i] << 16);
            x[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
            amax = fmaxf(amax, fmaxf(fabsf(x[2 * i]), fabsf(x[2 * i + 1])));
        }
        const float bs = amax > 0.f ? fminf(fmaxf(amax / (6.f * scale2), 0x1p-9f), 448.f) : 1.f;
        const u8 sb = f_to_fp8(bs);
        const float denom = fp8_to_f(sb) * scale2;
        u32 packed[2] = {0u, 0u};
#pragma unroll
        for (int i = 0; i < 16; ++i) packed[i >> 3] |= f_to_e2m1(x[i] / denom) << (4 * (i & 7));
        *(uint2*)(q + b * 8) = make_uint2(packed[0], packed[1]);
        scale[b] = sb;
    }
}
