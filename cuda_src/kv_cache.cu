// Writes new K/V rows into a paged cache.
//
// Row r of src (bf16, element r * src_stride) goes to columns [col_offset, col_offset + width) of cache
// row slots[r] (a cache row holds cache_row_width elements; slot = block * KV_BLOCK_SIZE + offset, read as i64
// at slots + r * slot_stride bytes, straight out of the metadata slabs: slots = meta + SLAB_SLOT_OFFSET,
// slot_stride = meta_stride, see meta.cuh). A negative slot skips the row (a
// padded or already-cached token). Several launches fill one row in pieces: MLA writes the latent at
// column 0 and the rotated k_pe at 512. One block per row.
#include "common.cuh"

__device__ __forceinline__ i64 row_slot(const i64* slots, u32 slot_stride, u32 r) {
    return *reinterpret_cast<const i64*>(reinterpret_cast<const u8*>(slots) + (u64)r * slot_stride);
}

// bf16 cache: a bit-exact copy.
extern "C" __global__ void reshape_and_cache(const u16* src, u32 src_stride, const i64* slots, u32 slot_stride,
                                             u16* cache, u32 rows, u32 width, u32 cache_row_width,
                                             u32 col_offset) {
    pdl_entry();
    for (u32 r = blockIdx.x; r < rows; r += gridDim.x) {
        const i64 slot = row_slot(slots, slot_stride, r);
        if (slot < 0) continue;
        const u16* s = src + (u64)r * src_stride;
        u16* d = cache + (u64)slot * cache_row_width + col_offset;
        for (u32 j = threadIdx.x; j < width; j += blockDim.x) d[j] = s[j];
    }
}

// fp8 e4m3 cache: stores e4m3(x / scale), saturating to +-448 (a per-tensor scale).
extern "C" __global__ void reshape_and_cache_fp8(const __nv_bfloat16* src, u32 src_stride, const i64* slots,
                                                 u32 slot_stride, u8* cache, u32 rows, u32 width,
                                                 u32 cache_row_width, u32 col_offset, float scale) {
    pdl_entry();
    for (u32 r = blockIdx.x; r < rows; r += gridDim.x) {
        const i64 slot = row_slot(slots, slot_stride, r);
        if (slot < 0) continue;
        const __nv_bfloat16* s = src + (u64)r * src_stride;
        u8* d = cache + (u64)slot * cache_row_width + col_offset;
        for (u32 j = threadIdx.x; j < width; j += blockDim.x) d[j] = f_to_fp8(bf2f(s[j]) / scale);
    }
}

// Blocked fp8 cache row (layout in common.cuh, kv_fp8_block_*): DeepSeek-V4's QAT numerics. Each 64-column
// block b of [0, nope) gets the power-of-two scale s_b = 2^e, e = ceil(log2(max(amax_b, 1e-4) * (1/448)))
// taken from the f32 bits (the official fast_round_scale), stored as the UE8M0 byte e + 127; its codes are
// e4m3(x * 2^-e) (exact scaling, round to nearest even, saturating to +-448). A last partial block scales over
// the columns it has. Columns [nope, width) are copied as bf16; padding bytes are written as zeros. One block
// of 256 threads per row; warp w quantises blocks w, w + 8, ...
extern "C" __global__ __launch_bounds__(256) void reshape_and_cache_fp8_blocks(
    const __nv_bfloat16* src, u32 src_stride, const i64* slots, u32 slot_stride, u8* cache, u32 rows, u32 width,
    u32 nope) {
    pdl_entry();
    const u32 rope_off = kv_fp8_block_rope_off(nope), scale_off = kv_fp8_block_scale_off(nope, width);
    const u32 row_bytes = kv_fp8_block_row_bytes(nope, width), nblk = (nope + 63) / 64;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (u32 r = blockIdx.x; r < rows; r += gridDim.x) {
        const i64 slot = row_slot(slots, slot_stride, r);
        if (slot < 0) continue;
        const __nv_bfloat16* s = src + (u64)r * src_stride;
        u8* d = cache + (u64)slot * row_bytes;
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
        for (u32 j = threadIdx.x; j < width - nope; j += blockDim.x)
            *reinterpret_cast<u16*>(d + rope_off + 2 * j) = sr[nope + j];
        for (u32 j = nope + threadIdx.x; j < rope_off; j += blockDim.x) d[j] = 0;
        for (u32 j = scale_off + nblk + threadIdx.x; j < row_bytes; j += blockDim.x) d[j] = 0;
    }
}
