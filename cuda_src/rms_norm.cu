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

// y = (x * r) * g with r = 1 / sqrt(mean(x^2) + eps) and g = w, 1 + w, or 1 when w is NULL. The weight is
// loaded with x, unconditionally (a NULL w reads x's row instead and ignores it): behind a branch, ptxas
// would issue it only after the x sum of squares, i.e. after a first full memory round trip. Products are
// not fused, so the twin rounds alike.
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
            if (w != nullptr) {
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

// y = ((x - mean) * rstd) * w + b, rstd = 1 / sqrt(var + eps), biased variance (torch LayerNorm).
// At most 512 threads (dim <= 16384): x, w and b held in registers need more than 1024 threads allow.
extern "C" __global__ __launch_bounds__(512) void layer_norm_w_bias(
    const __nv_bfloat16* x, const __nv_bfloat16* w, const __nv_bfloat16* b, __nv_bfloat16* y, u32 rows,
    u32 dim, float eps) {
    pdl_entry();
    __shared__ float red[64];
    const u32 nvec = dim >> 3;
    for (u32 r = blockIdx.x; r < rows; r += gridDim.x) {  // two block sums per row: halves 0 and 1
        uint4 v[MAXV], wv[MAXV], bv[MAXV];
        load_row(x + (u64)r * dim, nvec, v);
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
        __nv_bfloat16* yr = y + (u64)r * dim;
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
}

// Qwen3-Next's attention heads after their projection, in one launch of one warp a (row, head): q heads normed
// ((1 + q_w) per head) and RoPE'd into q_out; k heads normed ((1 + k_w)) and RoPE'd into the row's k cache row;
// v heads copied into its v cache row. Bit-identical to rms_norm_strided_1pw (whose launcher gives dim <= 1024
// one warp), rope (neox pairs (i, i + rot_dim / 2) over dims [0, rot_dim), mscale 1) and reshape_and_cache[_fp8]
// one after another: the norm rounds to bf16 in shared memory, RoPE reads and rounds those, the cache takes the
// result (fp8: e4m3(x / kv_scale), saturating). Layout: row r of x at element r * x_row_stride, q head h at
// h * q_head_stride (Qwen's [q_h | gate_h] interleave), k head h at k_off + h * dim, v head h at v_off + h * dim;
// q_out head h at r * q_out_row_stride + h * dim; a cache row holds k_heads * dim elements (u16 bf16 or u8 fp8),
// slot i64 at slots + r * slot_stride bytes (negative: no cache write), position u32 at pos + r * pos_stride.
// x is only read. The launcher keeps dim % 8 == 0, dim <= 1024, rot_dim even <= dim, 16-byte aligned rows.
extern "C" __global__ __launch_bounds__(32) void qk_norm_rope_cache_1pw(
    const __nv_bfloat16* x, u32 x_row_stride, u32 q_heads, u32 q_head_stride, u32 k_heads, u32 k_off, u32 v_off,
    const __nv_bfloat16* q_w, const __nv_bfloat16* k_w, __nv_bfloat16* q_out, u32 q_out_row_stride, u32 rows,
    u32 dim, float eps, const u32* pos, u32 pos_stride, const float* inv_freq, u32 rot_dim, const i64* slots,
    u32 slot_stride, u8* k_cache, u8* v_cache, u32 fp8, float kv_scale) {
    pdl_entry();
    __shared__ float red[64];
    __shared__ __align__(16) __nv_bfloat16 head[1024];
    const u32 lane = threadIdx.x, tasks = q_heads + 2 * k_heads, nvec = dim >> 3, half = rot_dim >> 1;
    const u64 n = (u64)rows * tasks;
    u32 parity = 0;
    for (u64 b = blockIdx.x; b < n; b += gridDim.x) {
        const u32 r = (u32)(b / tasks), t = (u32)(b % tasks);
        const bool is_q = t < q_heads, is_v = t >= q_heads + k_heads;
        const __nv_bfloat16* xr = x + (u64)r * x_row_stride;
        const i64 slot = *reinterpret_cast<const i64*>(reinterpret_cast<const u8*>(slots) + (u64)r * slot_stride);
        if (!is_q && slot < 0) continue;  // uniform over the block: no barrier is skipped by part of it
        const uint4* src;
        if (is_v) {
            src = reinterpret_cast<const uint4*>(xr + v_off + (u64)(t - q_heads - k_heads) * dim);
        } else {
            const u32 h = is_q ? t : t - q_heads;
            rms_row(is_q ? xr + (u64)h * q_head_stride : xr + k_off + (u64)h * dim, nullptr, is_q ? q_w : k_w, head,
                    dim, eps, true, red, parity++);
            __syncwarp();
            const u32 p = *reinterpret_cast<const u32*>(reinterpret_cast<const u8*>(pos) + (u64)r * pos_stride);
            for (u32 i = lane; i < half; i += 32) {  // as rope: each pair read before either is written
                float s, c;
                sincosf(__fmul_rn((float)p, inv_freq[i]), &s, &c);
                const float a = bf2f(head[i]), bb = bf2f(head[i + half]);
                head[i] = f2bf(__fsub_rn(__fmul_rn(a, c), __fmul_rn(bb, s)));
                head[i + half] = f2bf(__fadd_rn(__fmul_rn(bb, c), __fmul_rn(a, s)));
            }
            __syncwarp();
            src = reinterpret_cast<const uint4*>(head);
        }
        if (is_q) {
            uint4* d = reinterpret_cast<uint4*>(q_out + (u64)r * q_out_row_stride + (u64)t * dim);
            for (u32 i = lane; i < nvec; i += 32) d[i] = src[i];
        } else {
            const u64 at = (u64)slot * k_heads * dim + (u64)(is_v ? t - q_heads - k_heads : t - q_heads) * dim;
            u8* cache = is_v ? v_cache : k_cache;
            for (u32 i = lane; i < nvec; i += 32) {
                const uint4 v = src[i];
                if (!fp8) {
                    reinterpret_cast<uint4*>(reinterpret_cast<u16*>(cache) + at)[i] = v;
                } else {
                    float f[8];
                    unpack8(v, f);
                    u32 lo = 0, hi = 0;
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        lo |= (u32)f_to_fp8(f[j] / kv_scale) << (8 * j);
                        hi |= (u32)f_to_fp8(f[j + 4] / kv_scale) << (8 * j);
                    }
                    reinterpret_cast<uint2*>(cache + at)[i] = make_uint2(lo, hi);
                }
            }
        }
        __syncwarp();  // every lane's reads of `head` before the next task's norm writes it
    }
}
