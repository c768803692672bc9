// The attention-metadata slab and the KV block size, as the kernels see them: the layout of
// mtp_cupy/runtime/slab.py (its one home; tests/test_slab.py checks every constant here against it).
//
// One slab per decode row of a sequence (little endian), slab s at meta + s * meta_stride:
//     pos u32 @SLAB_POS_OFFSET, slot i64 @SLAB_SLOT_OFFSET, seq_len i32 @SLAB_SEQ_LEN_OFFSET,
//     block_table i32[] @SLAB_TABLE_OFFSET
// Row r of a sequence lives at cache slot table[r / KV_BLOCK_SIZE] * KV_BLOCK_SIZE + r % KV_BLOCK_SIZE.
// Kernels that take per-row positions / slots as (pointer, stride) pairs (rope, kv_cache) do not know the
// layout: their callers pass meta + SLAB_POS_OFFSET / meta + SLAB_SLOT_OFFSET with stride meta_stride.
//
// Self-contained (builtin types only): CupyBackend inlines local .cuh files one level deep, so this file
// includes nothing; nvcc finds it with -I cuda_src.
#pragma once

#define SLAB_POS_OFFSET 0        // u32 RoPE position of the row
#define SLAB_SLOT_OFFSET 8       // i64 cache slot the row is written to
#define SLAB_SEQ_LEN_OFFSET 16   // i32 rows the attention reads, the new one included
#define SLAB_TABLE_OFFSET 256    // i32[] the sequence's cache blocks, in row order

#define KV_BLOCK_SIZE 16         // cache rows per KV block
#define KV_BLOCK_SHIFT 4         // log2(KV_BLOCK_SIZE)
#define KV_BLOCK_MASK 15         // KV_BLOCK_SIZE - 1

static_assert((1 << KV_BLOCK_SHIFT) == KV_BLOCK_SIZE && KV_BLOCK_MASK == KV_BLOCK_SIZE - 1,
              "KV block shift / mask disagree with the block size");

// Slab s of a batch.
__device__ __forceinline__ const unsigned char* meta_slab(const unsigned char* meta, unsigned int meta_stride,
                                                          unsigned int s) {
    return meta + (unsigned long long)s * meta_stride;
}

__device__ __forceinline__ unsigned int slab_pos(const unsigned char* slab) {
    return *reinterpret_cast<const unsigned int*>(slab + SLAB_POS_OFFSET);
}

__device__ __forceinline__ long long slab_slot(const unsigned char* slab) {
    return *reinterpret_cast<const long long*>(slab + SLAB_SLOT_OFFSET);
}

__device__ __forceinline__ int slab_seq_len(const unsigned char* slab) {
    return *reinterpret_cast<const int*>(slab + SLAB_SEQ_LEN_OFFSET);
}

__device__ __forceinline__ const int* slab_table(const unsigned char* slab) {
    return reinterpret_cast<const int*>(slab + SLAB_TABLE_OFFSET);
}

// Cache slot of logical row r (0 <= r < seq_len) given its block-table entry table[r >> KV_BLOCK_SHIFT]
// (kernels that read the entry a pipeline stage before they use it), or through the table itself.
__device__ __forceinline__ unsigned long long kv_slot_at(int entry, int r) {
    return (unsigned long long)entry * KV_BLOCK_SIZE + (unsigned int)(r & KV_BLOCK_MASK);
}
__device__ __forceinline__ unsigned long long kv_slot(const int* table, int r) {
    return kv_slot_at(table[r >> KV_BLOCK_SHIFT], r);
}
