// Grouped GEMV: for every group g and input row r,
//     y[r*y_row_stride + g*y_group_stride + j] = sum_k W[row0 + g*group_rows + j, k] * x[r*x_row_stride + g*x_group_stride + k]
// for j < n. The groups are row blocks of one row-major [*, k] matrix, so a per-head slice of a fused
// checkpoint tensor (kv_b_proj's W_UV rows, q_b_proj's nope/rope rows) is used in place, with no copy.
// FP8 block scales are indexed by the ABSOLUTE row (row / 128), so a group need not start on a 128-row
// block. Strides are in elements. The block's x row is staged in shared memory as fp32 (k <= 12288).
// A row is read by `lpr` lanes (a power of two <= 32 chosen by the launcher so short rows such as W_UK^T's
// 128 bytes keep every lane busy), and each lane group carries RPT rows at once so that RPT independent
// 16-byte loads are in flight per lane (rows of whole 16-byte loads, k % 8 bf16 / % 16 fp8, and a 16-byte
// aligned W, checked by the launcher).
// fp32 accumulation in a fixed order that depends on k and lpr only, one rounding on store.
#include "common.cuh"

enum { FMT_BF16 = 0, FMT_FP8_F32 = 1, FMT_FP8_E8M0 = 2 };
#define RPT 4

template <int FMT>
__device__ __forceinline__ float block_scale(const void* scale, u64 idx) {
    if (FMT == FMT_FP8_F32) return ((const float*)scale)[idx];
    return e8m0_to_f(((const u8*)scale)[idx]);
}

template <int FMT>
__device__ __forceinline__ float dot16(const uint4 v, const float* xv) {
    const u32 p[4] = {v.x, v.y, v.z, v.w};
    float part = 0.f;
    if (FMT == FMT_BF16) {
#pragma unroll
        for (int q = 0; q < 4; ++q)
            part += xv[2 * q] * __uint_as_float(p[q] << 16) + xv[2 * q + 1] * __uint_as_float(p[q] & 0xffff0000u);
    } else {
#pragma unroll
        for (int q = 0; q < 4; ++q)
#pragma unroll
            for (int b = 0; b < 4; ++b) part += xv[4 * q + b] * fp8_to_f((u8)(p[q] >> (8 * b)));
    }
    return part;
}

template <int FMT>
__device__ __forceinline__ void grouped_gemv_impl(const u16* __restrict__ x, const u8* __restrict__ W,
                                                  const void* __restrict__ scale, void* __restrict__ y,
                                                  u32 groups, u32 m, u32 n, u32 k, u32 row0, u32 group_rows,
                                                  u64 x_group_stride, u64 x_row_stride, u64 y_group_stride,
                                                  u64 y_row_stride, u32 out_f32, u32 lpr) {
    extern __shared__ float xs[];
    const u32 lane = threadIdx.x & 31, wid = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const u32 subs = 32 / lpr, sub = lane / lpr, sl = lane % lpr;
    const u32 warp_rows = subs * RPT, block_rows = warps * warp_rows;
    const u32 vec = FMT == FMT_BF16 ? 8 : 16;            // elements per 16-byte load
    const u32 nc = k / vec, esz = FMT == FMT_BF16 ? 2 : 1, kb = (k + 127) / 128;
    for (u32 r = blockIdx.z; r < m; r += gridDim.z) {
        for (u32 g = blockIdx.y; g < groups; g += gridDim.y) {
            const u16* xg = x + r * x_row_stride + g * x_group_stride;
            __syncthreads();  // the previous (r, g) may still be reading xs
            for (u32 i = threadIdx.x; i < k; i += blockDim.x) xs[i] = bits2f(xg[i]);
            __syncthreads();
            // jw is warp-uniform, so every lane reaches the shuffles below
            for (u32 jw = blockIdx.x * block_rows + wid * warp_rows; jw < n; jw += gridDim.x * block_rows) {
                const u32 j0 = jw + sub * RPT;
                const uint4* w[RPT];
                u64 srow[RPT];
                float acc[RPT];
#pragma unroll
                for (int t = 0; t < RPT; ++t) {
                    const u64 row = (u64)row0 + (u64)g * group_rows + min(j0 + t, n - 1);
                    w[t] = (const uint4*)(W + row * k * esz);
                    srow[t] = (row / 128) * kb;
                    acc[t] = 0.f;
                }
                for (u32 c = sl; c < nc; c += lpr) {
                    uint4 v[RPT];
#pragma unroll
                    for (int t = 0; t < RPT; ++t) v[t] = __ldg(w[t] + c);
                    const float* xv = xs + c * vec;
#pragma unroll
                    for (int t = 0; t < RPT; ++t) {
                        const float part = dot16<FMT>(v[t], xv);
                        if (FMT == FMT_BF16) acc[t] += part;
                        else acc[t] += part * block_scale<FMT>(scale, srow[t] + (c * 16) / 128);
                    }
                }
#pragma unroll
                for (int t = 0; t < RPT; ++t) {
                    float a = acc[t];
                    for (u32 o = lpr >> 1; o > 0; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
                    if (sl == 0 && j0 + t < n) {
                        const u64 o = r * y_row_stride + g * y_group_stride + j0 + t;
                        if (out_f32) ((float*)y)[o] = a;
                        else ((__nv_bfloat16*)y)[o] = f2bf(a);
                    }
                }
            }
        }
    }
}

extern "C" __global__ void grouped_gemv_bf16(const u16* x, const u8* W, void* y, u32 groups, u32 m, u32 n, u32 k,
                                             u32 row0, u32 group_rows, u64 x_group_stride, u64 x_row_stride,
                                             u64 y_group_stride, u64 y_row_stride, u32 out_f32, u32 lpr) {
    pdl_entry();
    grouped_gemv_impl<FMT_BF16>(x, W, nullptr, y, groups, m, n, k, row0, group_rows, x_group_stride, x_row_stride,
                                y_group_stride, y_row_stride, out_f32, lpr);
}

extern "C" __global__ void grouped_gemv_fp8_block(const u16* x, const u8* W, const float* scale, void* y, u32 groups,
                                                  u32 m, u32 n, u32 k, u32 row0, u32 group_rows, u64 x_group_stride,
                                                  u64 x_row_stride, u64 y_group_stride, u64 y_row_stride, u32 out_f32, u32 lpr) {
    pdl_entry();
    grouped_gemv_impl<FMT_FP8_F32>(x, W, scale, y, groups, m, n, k, row0, group_rows, x_group_stride, x_row_stride,
                                   y_group_stride, y_row_stride, out_f32, lpr);
}

extern "C" __global__ void grouped_gemv_fp8_block_e8m0(const u16* x, const u8* W, const u8* scale, void* y,
                                                       u32 groups, u32 m, u32 n, u32 k, u32 row0, u32 group_rows,
                                                       u64 x_group_stride, u64 x_row_stride, u64 y_group_stride,
                                                       u64 y_row_stride, u32 out_f32, u32 lpr) {
    pdl_entry();
    grouped_gemv_impl<FMT_FP8_E8M0>(x, W, scale, y, groups, m, n, k, row0, group_rows, x_group_stride, x_row_stride,
                                    y_group_stride, y_row_stride, out_f32, lpr);
}
