// A projection's heads made ready for attention in one launch: RMSNorm per head, RoPE, and the store (into a
// q buffer, or into the KV cache at the row's slot), instead of a norm, a RoPE and a cache-write launch each.
// One warp a (row, head): the norm is rms_row at 32 threads, which is what rms_norm_strided's launcher gives
// any dim <= 1024, so the normed values are bit-identical to rms_norm_strided's; they are rounded to bf16 in
// shared memory, RoPE reads and rounds them as rope.cu does (same fp32 angle, accurate sincosf, unfused
// products), and the stores are reshape_and_cache's (bf16 copy, e4m3(x / scale), or the blocked fp8 row of
// common.cuh). So each kernel equals the launches it replaces, bit for bit.
#include "norm.cuh"

// RoPE over dims [off, off + rot_dim) of the bf16 row h (shared memory) at position p, by the warp: pairs (2i,
// 2i + 1) when interleaved, else (i, i + rot_dim / 2); each pair read before either is written (rope_pair).
__device__ __forceinline__ void rope_row(__nv_bfloat16* h, u32 p, const float* inv_freq, u32 off, u32 rot_dim,
                                         bool interleaved, float mscale) {
    const u32 half = rot_dim >> 1;
    for (u32 i = threadIdx.x & 31; i < half; i += 32) {
        const u32 ia = off + (interleaved ? 2 * i : i), ib = off + (interleaved ? 2 * i + 1 : i + half);
        float a = bf2f(h[ia]), b = bf2f(h[ib]);
        rope_pair(a, b, p, inv_freq[i], mscale, false);
        h[ia] = f2bf(a);
        h[ib] = f2bf(b);
    }
}

// DeepSeek / GLM (w, or no weight when NULL): per (row r, head h) of x (element r * x_row_stride + h *
// x_head_stride), y = [rms_w(x[0, norm_dim)) | x[norm_dim, width)], RoPE'd over [rot_offset, rot_offset + rot_dim)
// at the u32 position at pos + r * pos_stride, then stored: with `slots` NULL into out (element r * out_row_stride +
// h * out_head_stride; out may be x), else (one head) into the cache row at the i64 slot at slots + r * slot_stride
// (negative: skipped): bf16 [width] when fp8_nope is 0, the blocked fp8 row with nope = fp8_nope otherwise.
// MLA's latent row (norm 512 of 576, RoPE on the raw last 64), V4's kv row (norm and RoPE over 512) and V4's q
// heads (no weight, in place). LN (norm_rope_w_bias): the norm is layer_norm_w_bias's LayerNorm with w and b
// instead (GLM-5's DSA indexer key: LayerNorm, RoPE on its first dims, the indexer cache row). The launcher keeps
// norm_dim and width multiples of 8 of at most 1024, 16-byte aligned heads, and RoPE inside the row.
template <bool LN>
__device__ __forceinline__ void norm_rope_body(
    const __nv_bfloat16* x, u32 x_row_stride, u32 x_head_stride, u32 rows, u32 heads, const __nv_bfloat16* w,
    const __nv_bfloat16* b, u32 norm_dim, u32 width, float eps, const u32* pos, u32 pos_stride, const float* inv_freq,
    u32 rot_offset, u32 rot_dim, u32 interleaved, float mscale, __nv_bfloat16* out, u32 out_row_stride,
    u32 out_head_stride, const i64* slots, u32 slot_stride, u8* cache, u32 fp8_nope) {
    __shared__ float red[64];
    __shared__ __align__(16) __nv_bfloat16 head[1024];
    const u32 lane = threadIdx.x;
    const u64 n = (u64)rows * heads;
    u32 parity = 0;
    for (u64 blk = blockIdx.x; blk < n; blk += gridDim.x) {
        const u32 r = (u32)(blk / heads), h = (u32)(blk % heads);
        const i64 slot = slots != nullptr ? row_slot(slots, slot_stride, r) : 0;
        if (slot < 0) continue;  // uniform over the block
        const __nv_bfloat16* xh = x + (u64)r * x_row_stride + (u64)h * x_head_stride;
        if (LN) {
            layer_row(xh, w, b, head, norm_dim, eps, red);
        } else {
            rms_row(xh, nullptr, w, head, norm_dim, eps, false, red, parity++);
        }
        for (u32 j = norm_dim + lane; j < width; j += 32) head[j] = xh[j];
        __syncwarp();
        rope_row(head, row_pos(pos, pos_stride, r), inv_freq, rot_offset, rot_dim, interleaved != 0, mscale);
        __syncwarp();
        if (slots == nullptr) {
            uint4* d = reinterpret_cast<uint4*>(out + (u64)r * out_row_stride + (u64)h * out_head_stride);
            for (u32 i = lane; i < (width >> 3); i += 32) d[i] = reinterpret_cast<const uint4*>(head)[i];
        } else if (fp8_nope == 0) {
            uint4* d = reinterpret_cast<uint4*>(cache + (u64)slot * width * 2);
            for (u32 i = lane; i < (width >> 3); i += 32) d[i] = reinterpret_cast<const uint4*>(head)[i];
        } else {
            kv_fp8_block_store(head, cache + (u64)slot * kv_fp8_block_row_bytes(fp8_nope, width), width, fp8_nope,
                               lane, 32);
        }
        __syncwarp();  // every lane's reads of `head` before the next task's norm writes it
    }
}

extern "C" __global__ __launch_bounds__(32) void norm_rope_w(
    const __nv_bfloat16* x, u32 x_row_stride, u32 x_head_stride, u32 rows, u32 heads, const __nv_bfloat16* w,
    u32 norm_dim, u32 width, float eps, const u32* pos, u32 pos_stride, const float* inv_freq, u32 rot_offset,
    u32 rot_dim, u32 interleaved, float mscale, __nv_bfloat16* out, u32 out_row_stride, u32 out_head_stride,
    const i64* slots, u32 slot_stride, u8* cache, u32 fp8_nope) {
    pdl_entry();
    norm_rope_body<false>(x, x_row_stride, x_head_stride, rows, heads, w, nullptr, norm_dim, width, eps, pos,
                          pos_stride, inv_freq, rot_offset, rot_dim, interleaved, mscale, out, out_row_stride,
                          out_head_stride, slots, slot_stride, cache, fp8_nope);
}

extern "C" __global__ __launch_bounds__(32) void norm_rope_w_bias(
    const __nv_bfloat16* x, u32 x_row_stride, u32 x_head_stride, u32 rows, u32 heads, const __nv_bfloat16* w,
    const __nv_bfloat16* b, u32 norm_dim, u32 width, float eps, const u32* pos, u32 pos_stride,
    const float* inv_freq, u32 rot_offset, u32 rot_dim, u32 interleaved, float mscale, __nv_bfloat16* out,
    u32 out_row_stride, u32 out_head_stride, const i64* slots, u32 slot_stride, u8* cache, u32 fp8_nope) {
    pdl_entry();
    norm_rope_body<true>(x, x_row_stride, x_head_stride, rows, heads, w, b, norm_dim, width, eps, pos, pos_stride,
                         inv_freq, rot_offset, rot_dim, interleaved, mscale, out, out_row_stride, out_head_stride,
                         slots, slot_stride, cache, fp8_nope);
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
    const u32 lane = threadIdx.x, tasks = q_heads + 2 * k_heads, nvec = dim >> 3;
    const u64 n = (u64)rows * tasks;
    u32 parity = 0;
    for (u64 b = blockIdx.x; b < n; b += gridDim.x) {
        const u32 r = (u32)(b / tasks), t = (u32)(b % tasks);
        const bool is_q = t < q_heads, is_v = t >= q_heads + k_heads;
        const __nv_bfloat16* xr = x + (u64)r * x_row_stride;
        const i64 slot = row_slot(slots, slot_stride, r);
        if (!is_q && slot < 0) continue;  // uniform over the block: no barrier is skipped by part of it
        const uint4* src;
        if (is_v) {
            src = reinterpret_cast<const uint4*>(xr + v_off + (u64)(t - q_heads - k_heads) * dim);
        } else {
            const u32 h = is_q ? t : t - q_heads;
            rms_row(is_q ? xr + (u64)h * q_head_stride : xr + k_off + (u64)h * dim, nullptr, is_q ? q_w : k_w, head,
                    dim, eps, true, red, parity++);
            __syncwarp();
            rope_row(head, row_pos(pos, pos_stride, r), inv_freq, 0, rot_dim, false, 1.f);
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
