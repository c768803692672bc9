// Elementwise bf16 kernels: residual add, concat, gates, SwiGLU, embedding gathers, scaled add.
// fp32 math, one bf16 rounding per stored value; products that feed a sum are not fused (__fmul_rn), so
// the NumPy twins round alike.
#include "common.cuh"

// x[i] += r[i] over n elements, in place (fp32 add, one bf16 rounding).
extern "C" __global__ void bf16_residual_add(__nv_bfloat16* x, const __nv_bfloat16* r, u32 n) {
    pdl_entry();
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        x[i] = f2bf(bf2f(x[i]) + bf2f(r[i]));
}

// The calling block copies n bf16 words (16-byte vectors when both ends are aligned, then the tail).
__device__ __forceinline__ void block_copy(u16* dst, const u16* src, u32 n) {
    const u32 nv = (((u64)dst | (u64)src) & 15u) == 0 ? n >> 3 : 0u;
    for (u32 i = threadIdx.x; i < nv; i += blockDim.x)
        reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(src)[i];
    for (u32 i = nv * 8 + threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
}

__device__ __forceinline__ void block_zero(u16* dst, u32 n) {
    const u32 nv = ((u64)dst & 15u) == 0 ? n >> 3 : 0u;
    for (u32 i = threadIdx.x; i < nv; i += blockDim.x) reinterpret_cast<uint4*>(dst)[i] = make_uint4(0u, 0u, 0u, 0u);
    for (u32 i = nv * 8 + threadIdx.x; i < n; i += blockDim.x) dst[i] = 0;
}

// out[r] = [a[r, :na] | b[r, :nb]], bit-exact; one block per row.
extern "C" __global__ void bf16_concat(const u16* a, const u16* b, u16* out, u32 rows, u32 na, u32 nb) {
    pdl_entry();
    for (u32 r = blockIdx.x; r < rows; r += gridDim.x) {
        u16* o = out + (u64)r * (na + nb);
        block_copy(o, a + (u64)r * na, na);
        block_copy(o + na, b + (u64)r * nb, nb);
    }
}

// out[r, h, d] = x[r, h, d] * sigmoid(gate[r * gate_row_stride + h * gate_head_stride + d]); x and out
// are contiguous [rows, heads, dim] (out may be x). Qwen's gated attention output.
extern "C" __global__ void sigmoid_gate_mul(const __nv_bfloat16* x, const __nv_bfloat16* gate, __nv_bfloat16* out,
                                            u32 rows, u32 heads, u32 dim, u32 gate_row_stride,
                                            u32 gate_head_stride) {
    pdl_entry();
    const u32 hd = heads * dim, n = rows * hd;  // the launcher keeps rows * heads * dim < 2^32
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const u32 r = i / hd, h = (i % hd) / dim, d = i % dim;
        const float g = bf2f(gate[(u64)r * gate_row_stride + (u64)h * gate_head_stride + d]);
        out[i] = f2bf(__fmul_rn(bf2f(x[i]), sigmoid_f32(g)));
    }
}

// out[r, j] = silu(g) * u with g = g_ptr[r * g_stride + j], u = u_ptr[r * u_stride + j]; out contiguous
// [rows, n]. limit > 0 is DeepSeek-V4's clamped SwiGLU: silu(min(g, limit)) * clamp(u, -limit, limit).
extern "C" __global__ void silu_mul(const __nv_bfloat16* g, const __nv_bfloat16* u, __nv_bfloat16* out, u32 rows,
                                    u32 n, u32 g_stride, u32 u_stride, float limit) {
    pdl_entry();
    const u32 total = rows * n;  // the launcher keeps rows * n < 2^32
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
        const u32 r = i / n, j = i % n;
        float gv = bf2f(g[(u64)r * g_stride + j]), uv = bf2f(u[(u64)r * u_stride + j]);
        if (limit > 0.f) {
            gv = fminf(gv, limit);
            uv = fminf(fmaxf(uv, -limit), limit);
        }
        out[i] = f2bf(__fmul_rn(__fmul_rn(gv, sigmoid_f32(gv)), uv));
    }
}

// out[r] = table[id_r] with id_r the i32 at ids + r * ids_stride bytes; an id outside [0, vocab) gives a
// zero row and reads nothing. One block per row.
__device__ __forceinline__ void embed_row_block(const u16* table, const i32* ids, u32 ids_stride, u16* out,
                                                u32 rows, u32 dim, u32 vocab) {
    for (u32 r = blockIdx.x; r < rows; r += gridDim.x) {
        const i32 id = *reinterpret_cast<const i32*>(reinterpret_cast<const u8*>(ids) + (u64)r * ids_stride);
        u16* o = out + (u64)r * dim;
        if (id >= 0 && (u32)id < vocab)
            block_copy(o, table + (u64)id * dim, dim);
        else
            block_zero(o, dim);
    }
}

// Prefill gather: ids are host-uploaded tokens.
extern "C" __global__ void embed_rows(const u16* table, const i32* ids, u32 ids_stride, u16* out, u32 rows,
                                      u32 dim, u32 vocab) {
    pdl_entry();
    embed_row_block(table, ids, ids_stride, out, rows, dim, vocab);
}

// Draft chaining: ids are what the argmax kernels wrote, so the next step's embedding is fetched without
// the host ever seeing the id (one launch, no sync).
extern "C" __global__ void embed_from_argmax(const u16* table, const i32* ids, u32 ids_stride, u16* out,
                                             u32 rows, u32 dim, u32 vocab) {
    pdl_entry();
    embed_row_block(table, ids, ids_stride, out, rows, dim, vocab);
}

// y[i] = y[i] + alpha * x[i] over n elements (fp32, product not fused, one bf16 rounding).
extern "C" __global__ void scale_add(__nv_bfloat16* y, const __nv_bfloat16* x, float alpha, u32 n) {
    pdl_entry();
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        y[i] = f2bf(bf2f(y[i]) + __fmul_rn(alpha, bf2f(x[i])));
}
