// Row norms over bf16: RMSNorm (plain w, Qwen's 1 + w, no weight), the same fused behind a residual add,
// per-head RMSNorm over a strided [rows, heads, dim] tensor, and LayerNorm with bias (the DSA indexer k_norm).
// Every kernel's name ends with its weight convention: `_w` multiplies by w (DeepSeek / GLM; a NULL w means
// no weight), `_1pw` by 1 + w (Qwen3-Next's zero-centred norm weights), `_w_bias` by w then adds b.
//
// One block normalises one row (grid-stride over rows). The row is read once into registers and written
// once: thread t holds the 16-byte vectors t, t + blockDim.x, ... (at most MAXV of them), so a block of
// 1024 threads covers dim <= 32768. The launcher guarantees dim % 8 == 0, 16-byte aligned rows and a
// blockDim.x that is a multiple of 32. fp32 math; each output is rounded to bf16 once. x may equal y
// (every read of a row happens before the block_sum1 barrier that precedes its writes), except in the
// add_rms_norm kernels, whose x is an output of its own.
#include "norm.cuh"

// DeepSeek / GLM: y = w * x * rms(x) over contiguous rows of `dim` (w NULL: no weight).
extern "C" __global__ __launch_bounds__(1024) void rms_norm_w(
    const __nv_bfloat16* x, const __nv_bfloat16* w, __nv_bfloat16* y, u32 rows, u32 dim, float eps) {
    pdl_entry();
    __shared__ float red[64];
    for (u32 r = blockIdx.x, p = 0; r < rows; r += gridDim.x, ++p)
        rms_row(x + (u64)r * dim, nullptr, w, y + (u64)r * dim, dim, eps, false, red, p);
}

// Qwen3-Next: y = (1 + w) * x * rms(x) (w NULL: no weight).
extern "C" __global__ __launch_bounds__(1024) void rms_norm_1pw(
    const __nv_bfloat16* x, const __nv_bfloat16* w, __nv_bfloat16* y, u32 rows, u32 dim, float eps) {
    pdl_entry();
    __shared__ float red[64];
    for (u32 r = blockIdx.x, p = 0; r < rows; r += gridDim.x, ++p)
        rms_row(x + (u64)r * dim, nullptr, w, y + (u64)r * dim, dim, eps, true, red, p);
}

// The residual add of a decoder layer fused with the norm after it, bit-identical to bf16_residual_add
// then rms_norm_w / rms_norm_1pw at the same block size: x = bf16(x + res) is written back to x (the
// residual stream carries on from it) and y = the norm of that rounded row. Contiguous rows of `dim`; w
// NULL = no weight; res is required. x may not alias y (x must keep the sum), res may alias neither.
// At most 512 threads (dim <= 16384): x, res and w held in registers need more than 1024 threads allow
// (64 registers a thread; under a 1024 bound ptxas spills, and with res loaded after w it issued the res
// loads one after another).
extern "C" __global__ __launch_bounds__(512) void add_rms_norm_w(
    __nv_bfloat16* x, const __nv_bfloat16* res, const __nv_bfloat16* w, __nv_bfloat16* y, u32 rows, u32 dim,
    float eps) {
    pdl_entry();
    __shared__ float red[64];
    for (u32 r = blockIdx.x, p = 0; r < rows; r += gridDim.x, ++p)
        rms_row(x + (u64)r * dim, res + (u64)r * dim, w, y + (u64)r * dim, dim, eps, false, red, p);
}

// Qwen3-Next: x = bf16(x + res), y = (1 + w) * x * rms(x).
extern "C" __global__ __launch_bounds__(512) void add_rms_norm_1pw(
    __nv_bfloat16* x, const __nv_bfloat16* res, const __nv_bfloat16* w, __nv_bfloat16* y, u32 rows, u32 dim,
    float eps) {
    pdl_entry();
    __shared__ float red[64];
    for (u32 r = blockIdx.x, p = 0; r < rows; r += gridDim.x, ++p)
        rms_row(x + (u64)r * dim, res + (u64)r * dim, w, y + (u64)r * dim, dim, eps, true, red, p);
}

// Per-head norm of x[r, h, :dim] (element r * x_row_stride + h * x_head_stride + d) into the same place
// of y; one block per (row, head).
template <bool UNIT_OFFSET>
__device__ __forceinline__ void rms_norm_heads(const __nv_bfloat16* x, const __nv_bfloat16* w, __nv_bfloat16* y,
                                               u32 rows, u32 heads, u32 dim, u32 x_row_stride, u32 x_head_stride,
                                               u32 y_row_stride, u32 y_head_stride, float eps) {
    __shared__ float red[64];
    const u64 n = (u64)rows * heads;
    u32 p = 0;
    for (u64 b = blockIdx.x; b < n; b += gridDim.x, ++p) {
        const u64 r = b / heads, h = b % heads;
        rms_row(x + r * x_row_stride + h * x_head_stride, nullptr, w, y + r * y_row_stride + h * y_head_stride,
                dim, eps, UNIT_OFFSET, red, p);
    }
}

// y = w * x * rms(x) per head: DeepSeek / GLM norms of a strided slice, V4's per-head q scaling (w NULL).
extern "C" __global__ __launch_bounds__(1024) void rms_norm_strided_w(
    const __nv_bfloat16* x, const __nv_bfloat16* w, __nv_bfloat16* y, u32 rows, u32 heads, u32 dim,
    u32 x_row_stride, u32 x_head_stride, u32 y_row_stride, u32 y_head_stride, float eps) {
    pdl_entry();
    rms_norm_heads<false>(x, w, y, rows, heads, dim, x_row_stride, x_head_stride, y_row_stride, y_head_stride, eps);
}

// y = (1 + w) * x * rms(x) per head: Qwen's q_norm / k_norm.
extern "C" __global__ __launch_bounds__(1024) void rms_norm_strided_1pw(
    const __nv_bfloat16* x, const __nv_bfloat16* w, __nv_bfloat16* y, u32 rows, u32 heads, u32 dim,
    u32 x_row_stride, u32 x_head_stride, u32 y_row_stride, u32 y_head_stride, float eps) {
    pdl_entry();
    rms_norm_heads<true>(x, w, y, rows, heads, dim, x_row_stride, x_head_stride, y_row_stride, y_head_stride, eps);
}

// The MTP front's two norms in one launch (layers/mtp_front.py): blocks [0, m) norm the embedding rows of the
// i32 token ids at `ids + r * ids_stride` bytes (an id outside [0, vocab) gives a zero row, as embed_rows does)
// with ew into e_out; blocks [m, m + h_rows) norm the contiguous hidden rows with hw into h_out. Output row
// strides in elements (a concat's halves: 2 * dim). Bit-identical to embed_rows then rms_norm_strided of each
// at the same block size: the gathered row goes through the same register layout and sum order.
template <bool UNIT_OFFSET>
__device__ __forceinline__ void front_norms(const __nv_bfloat16* table, const i32* ids, u32 ids_stride, u32 vocab,
                                            const __nv_bfloat16* ew, const __nv_bfloat16* hidden,
                                            const __nv_bfloat16* hw, __nv_bfloat16* e_out, u32 e_stride,
                                            __nv_bfloat16* h_out, u32 h_stride, u32 m, u32 h_rows, u32 dim,
                                            float eps) {
    __shared__ float red[64];
    const u32 nvec = dim >> 3;
    u32 p = 0;
    for (u32 b = blockIdx.x; b < m + h_rows; b += gridDim.x, ++p) {
        if (b >= m) {
            const u64 r = b - m;
            rms_row(hidden + r * dim, nullptr, hw, h_out + r * h_stride, dim, eps, UNIT_OFFSET, red, p);
            continue;
        }
        const i32 id = *reinterpret_cast<const i32*>(reinterpret_cast<const u8*>(ids) + (u64)b * ids_stride);
        uint4 v[MAXV], wv[MAXV];
        if (id >= 0 && (u32)id < vocab) {
            load_row(table + (u64)id * dim, nvec, v);
        } else {
#pragma unroll
            for (int k = 0; k < MAXV; ++k) v[k] = make_uint4(0u, 0u, 0u, 0u);
        }
        load_row(ew, nvec, wv);
        rms_row_regs(v, wv, true, e_out + (u64)b * e_stride, dim, eps, UNIT_OFFSET, red, p);
    }
}

#define FRONT_NORMS(NAME, UNIT_OFFSET)                                                                         \
    extern "C" __global__ __launch_bounds__(1024) void NAME(                                                    \
        const __nv_bfloat16* table, const i32* ids, u32 ids_stride, u32 vocab, const __nv_bfloat16* ew,         \
        const __nv_bfloat16* hidden, const __nv_bfloat16* hw, __nv_bfloat16* e_out, u32 e_stride,               \
        __nv_bfloat16* h_out, u32 h_stride, u32 m, u32 h_rows, u32 dim, float eps) {                            \
        pdl_entry();                                                                                            \
        front_norms<UNIT_OFFSET>(table, ids, ids_stride, vocab, ew, hidden, hw, e_out, e_stride, h_out, h_stride, \
                                 m, h_rows, dim, eps);                                                          \
    }
FRONT_NORMS(front_norms_w, false)    // DeepSeek / GLM: g = w
FRONT_NORMS(front_norms_1pw, true)   // Qwen3-Next: g = 1 + w

// y = ((x - mean) * rstd) * w + b, rstd = 1 / sqrt(var + eps), biased variance (torch LayerNorm).
// At most 512 threads (dim <= 16384): x, w and b held in registers need more than 1024 threads allow.
extern "C" __global__ __launch_bounds__(512) void layer_norm_w_bias(
    const __nv_bfloat16* x, const __nv_bfloat16* w, const __nv_bfloat16* b, __nv_bfloat16* y, u32 rows,
    u32 dim, float eps) {
    pdl_entry();
    __shared__ float red[64];
    for (u32 r = blockIdx.x; r < rows; r += gridDim.x)
        layer_row(x + (u64)r * dim, w, b, y + (u64)r * dim, dim, eps, red);
}
