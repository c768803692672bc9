// Cross-rank argmax of a vocab-sharded LM head (docs/architecture.md "Several GPUs"): each rank has the argmax of its
// vocab slice [v0, v0 + n) (local id i32 + max value f32, from argmax.cu) and the ranks agree on the global
// winner, ties to the lower rank, identically on every rank. Two exchanges:
//
// digits: 4 * world bf16 lanes, one SUM all-reduce. Rank r writes its max (rounded to bf16) in lane r and
//   the three base-256 digits of its global id (low digit first) in lanes world + 3r .. world + 3r + 2;
//   every other lane is zero. x + 0 is exact in bf16 and integers up to 256 are exact, so the all-reduce
//   delivers every rank's lanes untouched whatever the summation order (ids < 2^24).
// pairs: one 8-byte (f32 value, i32 global id) pair per rank, all-gathered as bytes (vLLM / TRT-LLM).
//
// The decoders run on the device and write the winner's global id, so the next draft step's embedding
// gather needs no host round trip. Every kernel takes `rows` sequences at once: row r's lanes are
// lanes + r * 4 * world, its pair pair + 2r; gathered pairs are [world][rows][2], so one all-reduce or
// all-gather serves the whole batch. `widen_bf16_f32` turns bf16 logits into the f32 rows a caller reads.
#include "common.cuh"

__device__ __forceinline__ u16 bf16_bits(float v) { return __bfloat16_as_ushort(f2bf(v)); }

extern "C" __global__ void pack_argmax_lanes(const i32* local_id, const float* val, u32 v0, u32 rank, u32 world,
                                             u16* lanes, u32 rows) {
    pdl_entry();
    const u32 r = blockIdx.x;
    if (r >= rows) return;
    const u32 g = v0 + (u32)local_id[r];
    u16* row = lanes + (u64)r * 4 * world;
    for (u32 t = threadIdx.x; t < 4 * world; t += blockDim.x) {
        float v = 0.f;
        if (t == rank) {
            v = val[r];
        } else if (t >= world + 3 * rank && t < world + 3 * rank + 3) {
            v = (float)((g >> (8 * (t - world - 3 * rank))) & 255u);
        }
        row[t] = bf16_bits(v);
    }
}

// `>` keeps the earlier (lower) rank on a tie.
extern "C" __global__ void decode_argmax_lanes(const u16* lanes, u32 world, i32* out_id, u32 rows) {
    pdl_entry();
    const u32 r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const u16* row = lanes + (u64)r * 4 * world;
    u32 best = 0;
    for (u32 q = 1; q < world; ++q)
        if (bits2f(row[q]) > bits2f(row[best])) best = q;
    const u16* d = row + world + 3 * best;
    out_id[r] = (i32)bits2f(d[0]) + ((i32)bits2f(d[1]) << 8) + ((i32)bits2f(d[2]) << 16);
}

extern "C" __global__ void pack_argmax_pair(const i32* local_id, const float* val, u32 v0, u32* pair, u32 rows) {
    pdl_entry();
    const u32 r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    pair[2 * r] = __float_as_uint(val[r]);
    pair[2 * r + 1] = v0 + (u32)local_id[r];
}

extern "C" __global__ void decode_argmax_pairs(const u32* pairs, u32 world, i32* out_id, u32 rows) {
    pdl_entry();
    const u32 r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    u32 best = 0;
    for (u32 q = 1; q < world; ++q)
        if (__uint_as_float(pairs[2 * ((u64)q * rows + r)]) > __uint_as_float(pairs[2 * ((u64)best * rows + r)]))
            best = q;
    out_id[r] = (i32)pairs[2 * ((u64)best * rows + r) + 1];
}

extern "C" __global__ void widen_bf16_f32(const u16* src, float* dst, u32 n) {
    pdl_entry();
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) dst[i] = bits2f(src[i]);
}
