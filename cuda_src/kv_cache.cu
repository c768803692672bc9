// Writes new K/V rows into a paged cache.
//
// Row r of src (bf16, element r * src_stride) goes to columns [col_offset, col_offset + width) of cache
// row slots[r] (a cache row holds cache_row_width elements; slot = block * KV_BLOCK_SIZE + offset, read as i64
// at slots + r * slot_stride bytes, straight out of the metadata slabs: slots = meta + SLAB_SLOT_OFFSET,
// slot_stride = meta_stride, see meta.cuh). A negative slot skips the row (a
// padded or already-cached token). Several launches fill one row in pieces: MLA writes the latent at
// column 0 and the rotated k_pe at 512. One block per row.
#include "common.cuh"

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

// Blocked fp8 cache row (layout and encoding in common.cuh, kv_fp8_block_*): DeepSeek-V4's QAT numerics. One
// block of 256 threads per row; warp w quantises the 64-column blocks w, w + 8, ...
extern "C" __global__ __launch_bounds__(256) void reshape_and_cache_fp8_blocks(
    const __nv_bfloat16* src, u32 src_stride, const i64* slots, u32 slot_stride, u8* cache, u32 rows, u32 width,
    u32 nope) {
    pdl_entry();
    const u32 row_bytes = kv_fp8_block_row_bytes(nope, width);
    for (u32 r = blockIdx.x; r < rows; r += gridDim.x) {
        const i64 slot = row_slot(slots, slot_stride, r);
        if (slot < 0) continue;
        kv_fp8_block_store(src + (u64)r * src_stride, cache + (u64)slot * row_bytes, width, nope, threadIdx.x,
                           blockDim.x);
    }
}
