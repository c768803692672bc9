// y[m, n] = sum_k x[m, k] * W[n, k] for every Linear format (mtp_cupy/weights/linear.py).
// Shared argument tail of every kernel: (x, y, M, N, K, x_stride, y_stride, out_f32): x bf16 rows
// x + m*x_stride; y rows y + m*y_stride, bf16 or (out_f32 != 0) f32. fp32 accumulation, no atomics.
//
// Streaming ring kernels (the unsuffixed names; linear() uses them for every path but bf16 m = 1 and
// NVFP4). Geometry is set by ops/gemv.py; results do not depend on it
// beyond fp32 summation order:
//   grid.x blocks of (32, KS) threads, a persistent grid: block b owns the row tiles b, b + gridDim.x, ...
//   Its KS warps split every tile's k range, which is cut into units of one pipeline stage each; warp ks
//   takes units ks, ks + KS, ... Each warp streams its (tile, unit) sequence through a private ring of
//   S stages in dynamic shared memory with cp.async (16-byte copies that bypass L1), S - 1 stages ahead
//   of the math and across tile boundaries, so its loads stay in flight while it computes. S is what the
//   dynamic shared memory holds: S = (dynamic bytes - reduction area) / (KS * stage bytes).
//   KS > 1: per tile the warps meet once (__syncthreads) and add their partials in slice order, through a
//   double-buffered reduction area after the rings. The tensor-core ones (mma_stream) may also split k
//   across the grid.y = KB blocks of a thread block cluster (see there).
// x is tiny next to W and re-read by every warp, so it goes through L1 (__ldg): no limit on K.
//
// Register-round kernels (*_regs): no shared-memory pipeline. Each lane loads a round of 16-byte weight
// chunks straight into registers (all loads of a round in flight, then the math), block (32, KS, 8 / KS).
// linear() uses dense_gemv_bf16_regs for bf16 m = 1 and w4a16_gemv_regs for NVFP4, where they measured
// faster (BENCHMARKS.md); the other two are kept for side-by-side benchmarks.
#include "common.cuh"
#include "stream_mma.cuh"

// Weights are read exactly once: non-coherent, no L1 allocation (L1 stays for x). Callers keep p in
// bounds and zero what they do not want, so the loads stay unpredicated and all in flight together.
__device__ __forceinline__ uint4 ldg_stream(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// Chunk c of a row of n chunks; CHECK: past-the-end chunks read as zeros (from an in-bounds address).
// Loops run a round through the unchecked path when all of it is in range: the branch then makes
// every load of the round issue before the first use (ptxas would otherwise sink them to their uses).
template <bool CHECK, class T> __device__ __forceinline__ uint4 ld_chunk(const uint4* p, u32 c, u32 n, T ld) {
    if (!CHECK) return ld(p + c);
    const uint4 v = ld(p + min(c, n - 1));
    return c < n ? v : make_uint4(0, 0, 0, 0);
}
__device__ __forceinline__ uint4 ldg_x(const uint4* p) { return __ldg(p); }

// ---------------------------------------------------------------------------------------------
// dense_gemv_bf16_regs (the m = 1 bf16 default): one x row per blockIdx.y, block (32, KS, 8 / KS), warp
// per 2 rows, lane l reads 16-byte chunks l, l+32*KS, ... of its k-slice in register rounds: each warp load
// is 512 contiguous bytes of one row; the KS partial sums meet in shared memory in slice order.

constexpr int G_ROWS = 2, G_UNROLL = 4;

// One round: G_UNROLL chunks of x and of each of the G_ROWS rows, chunk c0 + u*step + lane.
template <bool C> __device__ __forceinline__ void gemv_round(uint4 (&wv)[G_UNROLL][G_ROWS], uint4 (&xv)[G_UNROLL],
                                                           const uint4* const (&wr)[G_ROWS], const uint4* xr,
                                                           u32 c0, u32 step, u32 KC) {
#pragma unroll
    for (int u = 0; u < G_UNROLL; ++u) {
        const u32 c = c0 + u * step + threadIdx.x;
        xv[u] = ld_chunk<C>(xr, c, KC, ldg_x);
#pragma unroll
        for (int r = 0; r < G_ROWS; ++r) wv[u][r] = ld_chunk<C>(wr[r], c, KC, ldg_stream);
    }
}

__device__ __forceinline__ float dot8(uint4 w, uint4 x, float acc) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const u32 a = word(w, i), b = word(x, i);
        acc = fmaf(__uint_as_float(a << 16), __uint_as_float(b << 16), acc);
        acc = fmaf(__uint_as_float(a & 0xffff0000u), __uint_as_float(b & 0xffff0000u), acc);
    }
    return acc;
}

extern "C" __global__ __launch_bounds__(256) void dense_gemv_bf16_regs(
    const u16* W, const u16* x, void* y, u32 M, u32 N, u32 K, u32 x_stride, u32 y_stride, u32 out_f32)
{
    pdl_entry();
    __shared__ float red[8][G_ROWS];
    const u32 lane = threadIdx.x, ks = threadIdx.y, KS = blockDim.y, m = blockIdx.y;
    const u32 wid = threadIdx.z * KS + ks;
    const u32 row0 = (blockIdx.x * blockDim.z + threadIdx.z) * G_ROWS;
    if (m >= M) return;
    const u32 KC = K / 8, step = 32 * KS;
    const uint4* xr = (const uint4*)(x + (u64)m * x_stride);
    const uint4* wr[G_ROWS];
#pragma unroll
    for (int r = 0; r < G_ROWS; ++r) wr[r] = (const uint4*)(W + (u64)min(row0 + r, N - 1) * K);
    float acc[G_ROWS] = {};
    for (u32 c0 = ks * 32; c0 < KC; c0 += G_UNROLL * step) {
        uint4 wv[G_UNROLL][G_ROWS], xv[G_UNROLL];
        if (c0 + (G_UNROLL - 1) * step + 32 <= KC) gemv_round<false>(wv, xv, wr, xr, c0, step, KC);
        else gemv_round<true>(wv, xv, wr, xr, c0, step, KC);
#pragma unroll
        for (int u = 0; u < G_UNROLL; ++u)
#pragma unroll
            for (int r = 0; r < G_ROWS; ++r) acc[r] = dot8(wv[u][r], xv[u], acc[r]);
    }
#pragma unroll
    for (int r = 0; r < G_ROWS; ++r) acc[r] = warp_sum(acc[r]);
    if (KS > 1) {
        if (lane == 0)
#pragma unroll
            for (int r = 0; r < G_ROWS; ++r) red[wid][r] = acc[r];
        __syncthreads();
        if (ks == 0)
#pragma unroll
            for (int r = 0; r < G_ROWS; ++r) {
                float s = red[wid][r];
                for (u32 j = 1; j < KS; ++j) s += red[wid + j][r];
                acc[r] = s;
            }
    }
    if (ks == 0 && lane == 0)
#pragma unroll
        for (int r = 0; r < G_ROWS; ++r)
            if (row0 + r < N) store_out(y, (u64)m * y_stride + row0 + r, acc[r], out_f32);
}

// ---------------------------------------------------------------------------------------------
// dense_gemv_bf16: streaming FMA GEMV, one x row per blockIdx.y. Tile: FR weight rows; unit: 32 * FC
// 16-byte chunks of each row (FR * FC * 512 bytes a stage). Lane l copies, and later reads back, chunks
// l, l + 32, ... of the unit: every warp copy is 512 contiguous bytes of one row and no lane reads another
// lane's copies (no warp syncs needed).

constexpr int FR = 2, FC = 2;

extern "C" __global__ __launch_bounds__(512) void dense_gemv_bf16(
    const u16* W, const u16* x, void* y, u32 M, u32 N, u32 K, u32 x_stride, u32 y_stride, u32 out_f32)
{
    pdl_entry();
    constexpr u32 STAGE = FR * FC * 32;  // uint4 per warp and stage
    const u32 lane = threadIdx.x, ks = threadIdx.y, KS = blockDim.y, m = blockIdx.y;
    if (m >= M) return;
    const u32 KC = K / 8, UC = 32 * FC, NU = (KC + UC - 1) / UC, T = (N + FR - 1) / FR;
    const u32 ntile = blockIdx.x < T ? (T - 1 - blockIdx.x) / gridDim.x + 1 : 0;
    const u32 nunit = ks < NU ? (NU - 1 - ks) / KS + 1 : 0;
    const u32 red_bytes = KS > 1 ? 2 * KS * FR * 4 : 0;
    const u32 S = (dyn_smem_bytes() - red_bytes) / (KS * STAGE * 16);  // >= 1 (launcher)
    uint4* const ring = g_dsm + ks * S * STAGE + lane;
    float* const red = (float*)(g_dsm + KS * S * STAGE);
    const uint4* xr = (const uint4*)(x + (u64)m * x_stride);

    u32 it = 0, iu = 0, islot = 0, left = ntile * nunit;  // issue side: next tile, unit, ring slot
    auto issue = [&]() {
        if (left) {
            --left;
            const u32 row0 = (blockIdx.x + it * gridDim.x) * FR, c0 = (ks + iu * KS) * UC + lane;
            uint4* dst = ring + islot * STAGE;
#pragma unroll
            for (int r = 0; r < FR; ++r) {
                const uint4* wr = (const uint4*)(W + (u64)min(row0 + r, N - 1) * K);
#pragma unroll
                for (int c = 0; c < FC; ++c) {
                    const u32 ch = c0 + c * 32;
                    cp_async_stream(dst + (r * FC + c) * 32, wr + (ch < KC ? ch : 0), ch < KC);
                }
            }
            if (++iu == nunit) { iu = 0; ++it; }
            if (++islot == S) islot = 0;
        }
        cp_async_commit();  // an empty group past the end keeps the wait count uniform
    };

    for (u32 p = 1; p < S; ++p) issue();
    u32 cslot = 0;
    for (u32 i = 0; i < ntile; ++i) {
        const u32 row0 = (blockIdx.x + i * gridDim.x) * FR;
        float acc[FR] = {};
        for (u32 j = 0; j < nunit; ++j) {
            issue();
            const u32 c0 = (ks + j * KS) * UC + lane;
            uint4 xv[FC];
#pragma unroll
            for (int c = 0; c < FC; ++c) {
                const u32 ch = c0 + c * 32;
                xv[c] = ch < KC ? __ldg(xr + ch) : make_uint4(0, 0, 0, 0);
            }
            cp_async_wait_n(S - 1);
            const uint4* src = ring + cslot * STAGE;
#pragma unroll
            for (int c = 0; c < FC; ++c)
#pragma unroll
                for (int r = 0; r < FR; ++r) acc[r] = dot8(src[(r * FC + c) * 32], xv[c], acc[r]);
            if (++cslot == S) cslot = 0;
        }
#pragma unroll
        for (int r = 0; r < FR; ++r) acc[r] = warp_sum(acc[r]);
        if (KS == 1) {
            if (lane == 0)
#pragma unroll
                for (int r = 0; r < FR; ++r)
                    if (row0 + r < N) store_out(y, (u64)m * y_stride + row0 + r, acc[r], out_f32);
        } else {
            float* rb = red + (i & 1) * KS * FR;  // double buffer: tile i + 2 writes after tile i + 1's sync
            if (lane == 0)
#pragma unroll
                for (int r = 0; r < FR; ++r) rb[ks * FR + r] = acc[r];
            __syncthreads();
            if (ks == 0 && lane < FR && row0 + lane < N) {
                float s = rb[lane];
                for (u32 q = 1; q < KS; ++q) s += rb[q * FR + lane];
                store_out(y, (u64)m * y_stride + row0 + lane, s, out_f32);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Tensor-core GEMV (mma.sync m16n8k16, bf16 in, fp32 accumulate) for M > 1 and every quantised
// format; mma_stream is the streaming version, mma_regs the register-round one (the *_regs kernels).
// A = 16 weight rows, B = up to 8 x rows per n-tile. At step s lane (g, t) holds the 16-byte
// chunk 4s+t of weight rows g and g+8 and, as B, the same k range of x row g (+8 per n-tile): a dot
// product does not care which k sits in which fragment slot, as long as A and B agree. Weights are
// decoded to bf16 in registers (exactly: every e4m3 / e2m1*e4m3 / e2m1*e8m0 value fits in bf16).

// One round of weight chunks (and fp4 scale bytes): step s0 + u*KS, chunk 4*step + t of each row.
template <int F, int RT, int U, bool C>
__device__ __forceinline__ void mma_round(uint4 (&wv)[U][RT][2], u32 (&sv)[U][RT][2], const uint4* const (&wp)[RT][2],
                                          const u32 (&rows)[RT][2], const void* S, u32 K, u32 KCH, u32 s0, u32 KS) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const u32 c = (s0 + u * KS) * 4 + (threadIdx.x & 3);
        const bool ok = !C || c < KCH;
#pragma unroll
        for (int r = 0; r < RT; ++r)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                wv[u][r][h] = ld_chunk<C>(wp[r][h], c, KCH, ldg_stream);
                if (F == NVFP4) sv[u][r][h] = ok ? __ldg((const u16*)S + (u64)rows[r][h] * (K / 32) + c) : 0;
                if (F == MXFP4) sv[u][r][h] = ok ? __ldg((const u8*)S + (u64)rows[r][h] * (K / 32) + c) : 0;
            }
    }
}

template <int F, int MT, int RT, int U>
__device__ __forceinline__ void mma_regs(const u8* W, const void* S, float scale2, const u16* x, void* y,
                                         u32 M, u32 N, u32 K, u32 xs, u32 ys, u32 out_f32)
{
    constexpr int KC = kchunk<F>(), NM = KC / 4;  // k per lane chunk; k16 mmas per chunk pair
    constexpr bool FP4 = F == NVFP4 || F == MXFP4, BLOCK = F == FP8_BLOCK || F == FP8_BLOCK_E8M0;
    __shared__ float red[8][RT * MT * 4][32];
    const u32 lane = threadIdx.x, g = lane >> 2, t = lane & 3;
    const u32 ks = threadIdx.y, KS = blockDim.y, wid = threadIdx.z * KS + ks;
    const u32 row0 = (blockIdx.x * blockDim.z + threadIdx.z) * (16 * RT);
    const u32 KCH = K / KC, nsteps = (KCH + 3) / 4;
    const u64 rowbytes = (u64)K * (F == BF16 ? 2 : 1) / (FP4 ? 2 : 1);
    const uint4* wp[RT][2];
    u32 rows[RT][2];
#pragma unroll
    for (int r = 0; r < RT; ++r)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            rows[r][h] = min(row0 + r * 16 + g + 8 * h, N - 1);
            wp[r][h] = (const uint4*)(W + rows[r][h] * rowbytes);
        }
    float acc[RT][MT][4] = {};
    for (u32 s0 = ks; s0 < nsteps; s0 += KS * U) {
        uint4 wv[U][RT][2];
        u32 sv[U][RT][2];
        if ((s0 + (U - 1) * KS) * 4 + 4 <= KCH) mma_round<F, RT, U, false>(wv, sv, wp, rows, S, K, KCH, s0, KS);
        else mma_round<F, RT, U, true>(wv, sv, wp, rows, S, K, KCH, s0, KS);
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const u32 s = s0 + u * KS;
            if (s >= nsteps) break;
            const u32 c = s * 4 + t;
            u32 X[MT][KC / 2];
#pragma unroll
            for (int j = 0; j < MT; ++j) {
                const u32 xm = 8 * j + g;
                const uint4* xp = (const uint4*)(x + (u64)xm * xs + (u64)c * KC);
#pragma unroll
                for (int v = 0; v < KC / 8; ++v) {
                    const uint4 q = xm < M && c < KCH ? __ldg(xp + v) : make_uint4(0, 0, 0, 0);
                    X[j][4 * v] = q.x; X[j][4 * v + 1] = q.y; X[j][4 * v + 2] = q.z; X[j][4 * v + 3] = q.w;
                }
            }
            float f = 1.f;  // fp8 block scale of this step's 64 k (one 128x128 block for the whole tile)
            if (BLOCK) {
                const u64 si = (u64)(min(row0, N - 1) >> 7) * ((K + 127) / 128) + (s * 4 * KC >> 7);
                f = F == FP8_BLOCK ? __ldg((const float*)S + si) : e8m0_to_f(__ldg((const u8*)S + si));
            }
#pragma unroll
            for (int r = 0; r < RT; ++r) {
                u32 sc[2][2] = {};
                if (FP4)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        sc[h][0] = fp4_scale<F>(sv[u][r][h], 0);
                        if (F == NVFP4) sc[h][1] = fp4_scale<F>(sv[u][r][h], 1);
                    }
                // the sum order of chained_acc (stream_mma.cuh)
                float tmp[MT][4] = {};
#pragma unroll
                for (int i = 0; i < NM; ++i) {
                    u32 a[4];
                    frag_a<F>(wv[u][r], sc, i, a);
#pragma unroll
                    for (int j = 0; j < MT; ++j) {
                        u32 b[2];
                        frag_b<F>(X[j], i, b);
                        mma16816(chained_acc<F>() ? acc[r][j] : tmp[j], a, b);
                    }
                }
                if (!chained_acc<F>())
#pragma unroll
                    for (int j = 0; j < MT; ++j)
#pragma unroll
                        for (int e = 0; e < 4; ++e) acc[r][j][e] = fmaf(tmp[j][e], f, acc[r][j][e]);
            }
        }
    }
    if (KS > 1) {
#pragma unroll
        for (int r = 0; r < RT; ++r)
#pragma unroll
            for (int j = 0; j < MT; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) red[wid][(r * MT + j) * 4 + e][lane] = acc[r][j][e];
        __syncthreads();
        if (ks != 0) return;
#pragma unroll
        for (int r = 0; r < RT; ++r)
#pragma unroll
            for (int j = 0; j < MT; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    float v = acc[r][j][e];
                    for (u32 q = 1; q < KS; ++q) v += red[wid + q][(r * MT + j) * 4 + e][lane];
                    acc[r][j][e] = v;
                }
    }
    // C fragment: c0, c1 = (row g, x rows 2t, 2t+1), c2, c3 = (row g+8, same x rows).
#pragma unroll
    for (int r = 0; r < RT; ++r) {
        const float fm = F == NVFP4 ? scale2 * 256.f : F == MXFP4 ? 0x1p64f : 1.f;  // undo fp4_scale
        float rs[2] = {fm, fm};
        if (F == FP8_ROW) { rs[0] = __ldg((const float*)S + rows[r][0]); rs[1] = __ldg((const float*)S + rows[r][1]); }
#pragma unroll
        for (int j = 0; j < MT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const u32 m = 8 * j + 2 * t + (e & 1), n = row0 + r * 16 + g + 8 * (e >> 1);
                if (m < M && n < N) store_out(y, (u64)m * ys + n, acc[r][j][e] * rs[e >> 1], out_f32);
            }
    }
}

// Streaming tensor-core GEMV (the default for M > 1 and every quantised format). Tile: 16 * RT weight
// rows; unit: CH = 8 chunks (128 bytes) of each row, i.e. two mma steps of 4 chunks. Copies run along
// rows (8 lanes per row, 4 rows per warp copy); lane (g, t) then reads the chunks 4s + t of rows g, g + 8
// that the fragment layout above wants, so the warp syncs around each stage. Chunk c of ring row r sits at
// r * CH + (c ^ 4 * (r & 1)): both the copies and the fragment reads are free of bank conflicts.
// Split-K across blocks: launched as grid (walkers, KB) in clusters (1, KB, 1), the KB blocks of a cluster
// share each of their tiles, warp w = blockIdx.y * KS + ks taking units w, w + KB * KS, ...; each block sums
// its warps' slices, then rank 0 adds the KB block sums in rank order from the others' shared memory (DSMEM)
// and stores. A row's sum order depends on (KS, KB) only, never on M or on which tiles a block walks.
// Rows: a pass takes 8 MT x rows; M > 8 MT runs P = ceil(M / 8 MT) passes in one launch, the walk's units
// being (tile, pass) with the pass fastest, so the blocks that read a tile for its P passes run at once and
// all but one of them find it in L2 (W leaves DRAM about once for all M rows).
template <int F, int MT, int RT>
__device__ __forceinline__ void mma_stream(const u8* W, const void* S, float scale2, const u16* x, void* y,
                                           u32 M, u32 N, u32 K, u32 xs, u32 ys, u32 out_f32)
{
    constexpr int KC = kchunk<F>(), NM = KC / 4, CH = 8, TR = 16 * RT, E = RT * MT * 4;
    constexpr u32 STAGE = TR * CH;  // uint4 per warp and stage
    constexpr bool FP4 = F == NVFP4 || F == MXFP4, BLOCK = F == FP8_BLOCK || F == FP8_BLOCK_E8M0;
    const u32 lane = threadIdx.x, g = lane >> 2, t = lane & 3, ks = threadIdx.y, KS = blockDim.y;
    const u32 KB = gridDim.y, kr = blockIdx.y, w = kr * KS + ks, KW = KB * KS;  // kr: rank in the cluster
    const u32 tb = blockIdx.x, NB = gridDim.x;  // tile walker (cluster) index, walkers
    const u32 KCH = K / KC, NU = (KCH + CH - 1) / CH, T = (N + TR - 1) / TR;
    constexpr u32 R = 8 * MT;  // x rows a pass
    const u32 P = (M + R - 1) / R, TP = T * P;  // passes; (tile, pass) units
    const u32 ntile = tb < TP ? (TP - 1 - tb) / NB + 1 : 0;
    const u32 nunit = w < NU ? (NU - 1 - w) / KW + 1 : 0;
    const u64 rowbytes = (u64)K * (F == BF16 ? 2 : 1) / (FP4 ? 2 : 1);
    const u32 red_bytes = (KS > 1 ? 2 * KS * E * 32 * 4 : 0) + (KB > 1 ? E * 32 * 4 : 0);
    const u32 NS = (dyn_smem_bytes() - red_bytes) / (KS * STAGE * 16);  // ring stages, >= 1 (launcher)
    uint4* const ring = g_dsm + ks * NS * STAGE;
    float* const red = (float*)(g_dsm + KS * NS * STAGE);
    float* const part = red + (KS > 1 ? 2 * KS * E * 32 : 0);  // KB > 1: this block's sums, [E][32]

    const u32 cc = lane & 7, cr = lane >> 3;  // this lane copies chunk cc of rows 4i + cr
    u32 it = 0, iu = 0, islot = 0, left = ntile * nunit;
    auto issue = [&]() {
        if (left) {
            --left;
            const u32 row0 = (tb + it * NB) / P * TR, c0 = (w + iu * KW) * CH, ch = c0 + cc;
            const bool ok = ch < KCH;
            uint4* dst = ring + islot * STAGE + (cc ^ ((cr & 1) << 2));
#pragma unroll
            for (int i = 0; i < TR / 4; ++i) {
                const u32 r = 4 * i + cr;
                cp_async_stream(dst + r * CH, W + (u64)min(row0 + r, N - 1) * rowbytes + (ok ? ch : 0) * 16u, ok);
            }
            if (FP4 && lane < TR)  // this unit's block scales: into L2 now, read (through L1) when consumed
                prefetch_l2((const u8*)S + (u64)min(row0 + lane, N - 1) * (F == NVFP4 ? K / 16 : K / 32) +
                            c0 * (F == NVFP4 ? 2 : 1));
            if (++iu == nunit) { iu = 0; ++it; }
            if (++islot == NS) islot = 0;
        }
        cp_async_commit();  // an empty group past the end keeps the wait count uniform
    };

    for (u32 p = 1; p < NS; ++p) issue();
    pdl_wait();   // the ring's first stages are weights; x and y belong to the kernels around this one
    u32 cslot = 0;
    const float fm = F == NVFP4 ? scale2 * 256.f : F == MXFP4 ? 0x1p64f : 1.f;  // undo fp4_scale
    for (u32 i = 0; i < ntile; ++i) {
        const u32 tu = tb + i * NB, row0 = tu / P * TR, p0 = tu % P * R;  // p0: the pass's first x row
        u32 rows[RT][2];
#pragma unroll
        for (int r = 0; r < RT; ++r)
#pragma unroll
            for (int h = 0; h < 2; ++h) rows[r][h] = min(row0 + r * 16 + g + 8 * h, N - 1);
        float acc[RT][MT][4] = {};
        for (u32 j = 0; j < nunit; ++j) {
            __syncwarp();  // every lane is done reading the slot that this issue overwrites
            issue();
            const u32 c0 = (w + j * KW) * CH;
            // x words and fp4 scale bytes of the unit's two steps (not through the ring)
            u32 X[2][MT][KC / 2], sv[2][RT][2];
#pragma unroll
            for (int s = 0; s < 2; ++s) {
                const u32 c = c0 + 4 * s + t;
#pragma unroll
                for (int jm = 0; jm < MT; ++jm) {
                    const u32 xm = p0 + 8 * jm + g;
                    const uint4* xp = (const uint4*)(x + (u64)xm * xs + (u64)c * KC);
#pragma unroll
                    for (int v = 0; v < KC / 8; ++v) {
                        const uint4 q = xm < M && c < KCH ? __ldg(xp + v) : make_uint4(0, 0, 0, 0);
                        X[s][jm][4 * v] = q.x; X[s][jm][4 * v + 1] = q.y;
                        X[s][jm][4 * v + 2] = q.z; X[s][jm][4 * v + 3] = q.w;
                    }
                }
#pragma unroll
                for (int r = 0; r < RT; ++r)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        sv[s][r][h] = 0;
                        if (F == NVFP4 && c < KCH) sv[s][r][h] = __ldg((const u16*)S + (u64)rows[r][h] * (K / 32) + c);
                        if (F == MXFP4 && c < KCH) sv[s][r][h] = __ldg((const u8*)S + (u64)rows[r][h] * (K / 32) + c);
                    }
            }
            float f = 1.f;  // fp8 block scale: a unit is 128 k, one 128x128 block for the whole tile
            if (BLOCK) {
                const u64 si = (u64)(min(row0, N - 1) >> 7) * ((K + 127) / 128) + (c0 >> 3);
                f = F == FP8_BLOCK ? __ldg((const float*)S + si) : e8m0_to_f(__ldg((const u8*)S + si));
            }
            cp_async_wait_n(NS - 1);
            __syncwarp();  // the other lanes' copies of this stage are visible
            const uint4* st = ring + cslot * STAGE;
#pragma unroll
            for (int s = 0; s < 2; ++s) {
                if (c0 + 4 * s >= KCH) break;  // warp-uniform: the step lies past K
#pragma unroll
                for (int r = 0; r < RT; ++r) {
                    uint4 wv[2];
                    const u32 pc = (4 * s + t) ^ ((g & 1) << 2);  // rows g, g + 8 have g's parity
                    wv[0] = st[(r * 16 + g) * CH + pc];
                    wv[1] = st[(r * 16 + g + 8) * CH + pc];
                    u32 sc[2][2] = {};
                    if (FP4)
#pragma unroll
                        for (int h = 0; h < 2; ++h) {
                            sc[h][0] = fp4_scale<F>(sv[s][r][h], 0);
                            if (F == NVFP4) sc[h][1] = fp4_scale<F>(sv[s][r][h], 1);
                        }
                    // the sum order of chained_acc, as in mma_regs
                    float tmp[MT][4] = {};
#pragma unroll
                    for (int mi = 0; mi < NM; ++mi) {
                        u32 a[4];
                        frag_a<F>(wv, sc, mi, a);
#pragma unroll
                        for (int jm = 0; jm < MT; ++jm) {
                            u32 b[2];
                            frag_b<F>(X[s][jm], mi, b);
                            mma16816(chained_acc<F>() ? acc[r][jm] : tmp[jm], a, b);
                        }
                    }
                    if (!chained_acc<F>())
#pragma unroll
                        for (int jm = 0; jm < MT; ++jm)
#pragma unroll
                            for (int e = 0; e < 4; ++e) acc[r][jm][e] = fmaf(tmp[jm][e], f, acc[r][jm][e]);
                }
            }
            if (++cslot == NS) cslot = 0;
        }
        // C fragment element e of (slab r, n-tile jm): x row 8jm + 2t + (e & 1), weight row 16r + g + 8(e >> 1)
        auto emit = [&](u32 r, u32 jm, u32 e, float v) {
            const u32 m = p0 + 8 * jm + 2 * t + (e & 1), n = row0 + r * 16 + g + 8 * (e >> 1);
            if (m < M && n < N)
                store_out(y, (u64)m * ys + n, v * (F == FP8_ROW ? __ldg((const float*)S + n) : fm), out_f32);
        };
        // element e = (r * MT + jm) * 4 + e4 of this block's sums: stored, or kept for rank 0 of the cluster
        auto finish = [&](u32 e, float v) {
            if (KB == 1) emit(e / (4 * MT), (e / 4) % MT, e % 4, v);
            else part[e * 32 + lane] = v;
        };
        if (KS == 1) {
#pragma unroll
            for (int r = 0; r < RT; ++r)
#pragma unroll
                for (int jm = 0; jm < MT; ++jm)
#pragma unroll
                    for (int e = 0; e < 4; ++e) finish((r * MT + jm) * 4 + e, acc[r][jm][e]);
        } else {
            float* rb = red + (i & 1) * KS * E * 32;  // double buffer: tile i + 2 writes after tile i + 1's sync
#pragma unroll
            for (int r = 0; r < RT; ++r)
#pragma unroll
                for (int jm = 0; jm < MT; ++jm)
#pragma unroll
                    for (int e = 0; e < 4; ++e) rb[(ks * E + (r * MT + jm) * 4 + e) * 32 + lane] = acc[r][jm][e];
            __syncthreads();
            for (u32 e = ks; e < E; e += KS) {  // the warps share the sums; each adds the slices in order
                float v = rb[e * 32 + lane];
                for (u32 q = 1; q < KS; ++q) v += rb[(q * E + e) * 32 + lane];
                finish(e, v);
            }
        }
        if (KB > 1) {  // ntile is the same for the whole cluster, so every block meets both barriers
            cluster_sync();
            if (kr == 0)
                for (u32 e = ks; e < E; e += KS) {
                    float v = part[e * 32 + lane];
                    for (u32 q = 1; q < KB; ++q) v += ld_cluster_f32(part + e * 32 + lane, q);
                    emit(e / (4 * MT), (e / 4) % MT, e % 4, v);
                }
            cluster_sync();  // rank 0 is done reading: the others may reuse `part` or exit
        }
    }
}

// 8 x rows a pass over W (streaming kernels; block (32, KS), KS <= 16; passes as in mma_stream).
extern "C" __global__ __launch_bounds__(512) void dense_gemv_bf16_batchm(
    const u16* W, const u16* x, void* y, u32 M, u32 N, u32 K, u32 x_stride, u32 y_stride, u32 out_f32)
{
    pdl_trigger();
    mma_stream<BF16, 1, 1>((const u8*)W, nullptr, 1.f, x, y, M, N, K, x_stride, y_stride, out_f32);
}

// 32 x rows a pass over W; 32 weight rows per tile so each x chunk (from L1/L2) serves two A tiles.
extern "C" __global__ __launch_bounds__(512) void dense_gemv_bf16_batch32(
    const u16* W, const u16* x, void* y, u32 M, u32 N, u32 K, u32 x_stride, u32 y_stride, u32 out_f32)
{
    pdl_trigger();
    mma_stream<BF16, 4, 2>((const u8*)W, nullptr, 1.f, x, y, M, N, K, x_stride, y_stride, out_f32);
}

// Up to 64 x rows in one pass over W, x staged in shared memory once per block and shared by its XG_RG row
// groups (mma_stream's x comes from L2 to every warp: as many bytes as its weights for 32-row tiles, and twice
// over for 64 rows in two passes). bf16 and the fp8 formats. Block (32, XS, XG_RG), either alone (CL false;
// XS = 1, or 2 for bf16) or in clusters (1, CB, 1) of one-slice blocks, grid (walkers, CB): the KW = XS * CB
// warps (ks, rank r) of a walker are the KW k slices w = r * XS + ks of the 8-row kernel's plan (KS8, KB8),
// KS8 * KB8 = KW; warp (ks, rg) owns weight rows tile * 16 XG_RG + 16 rg .. + 15 of every tile the walker
// takes (tiles b, b + gridDim.x, ...) and slice w's units w, w + KW, ...: the units, steps and mma order of
// mma_stream<F> (chained_acc). At the end of a tile slice 0 adds the other slice's sums (alone), or every
// warp leaves its sums in shared memory and the cluster's warps fold them over DSMEM in the 8-row kernel's
// order (the KS8 slices of each of its blocks in slice order, then those KB8 block sums in rank order), so a
// row's result is bit-identical to the 8-row kernel's under that plan. `fks` is KS8.
// One block-wide cp.async ring of NS stages (dynamic shared memory after the reduction area / stage bytes);
// stage (tile, round j) holds, for each slice ks, unit j * KW + w of the tile's weight rows, W [XS][16 XG_RG][8
// chunks], then of x rows 0 .. 8 MA (MA n-tiles of 8 rows, the fewest that cover M; rows past M zero-filled),
// X [XS][64][KC chunks] (a unit's k range: 8 chunks of bf16, 16 for fp8's 128 k). Chunk c of a row r sits at
// r * 8 + (c ^ 4 (r & 1)) (W, bf16 x) or r * 16 + (c ^ (r & 1)) (fp8's x), free of bank conflicts for the
// copies and the fragment reads. One __syncthreads a stage. XS and MA are template parameters so that every
// thread's copy positions are shifts of its index (the kernel is bound by issued instructions, not bytes).
#define XG_RG 8
#define XG_ROWS 64
#define XG_PE 16   // C-fragment floats a lane hands over per fold round (4 n-tiles; MA = 8 folds twice a tile)
template <int F, u32 XS, u32 MA, bool CL>
__device__ __forceinline__ void x64_body(const u8* W, const void* S, u32 fks, const u16* x, void* y, u32 M, u32 N,
                                         u32 K, u32 xs, u32 ys, u32 out_f32)
{
    static_assert(XS == 1 || !CL, "two-slice blocks run without a cluster");
    constexpr u32 KC = kchunk<F>(), NM = KC / 4, CH = 8, XCH = KC, TR = 16 * XG_RG, E = MA * 4;
    constexpr u32 NT = 32 * XS * XG_RG, SW = XS * TR * CH, STAGE = SW + XS * XG_ROWS * XCH;  // uint4 per stage
    constexpr u32 CW = SW / NT, XR = 8 * MA, CX = (XS * XR * XCH + NT - 1) / NT;  // copies per thread
    constexpr u32 XSW = F == BF16 ? 2 : 0;                                       // x swizzle shift
    // CL: the fold area [XS][XG_RG][PE][32]; else slices 1.. hand slice 0 their sums, [XS - 1][XG_RG][32][32]
    constexpr u32 PE = E < XG_PE ? E : XG_PE, PART_U4 = CL ? XS * XG_RG * PE * 32 / 4 : (XS - 1) * XG_RG * 32 * 32 / 4;
    constexpr bool BLOCK = F == FP8_BLOCK || F == FP8_BLOCK_E8M0;
    const u32 lane = threadIdx.x, g = lane >> 2, t = lane & 3, ks = threadIdx.y, rg = threadIdx.z;
    const u32 wi = rg * XS + ks, tid = wi * 32 + lane;
    const u32 CB = CL ? gridDim.y : 1, kr = CL ? blockIdx.y : 0, KW = CB * XS, w = kr * XS + ks;  // kr: cluster rank
    const u32 KCH = K / KC, NU = (KCH + CH - 1) / CH, T = (N + TR - 1) / TR, NR = (NU + KW - 1) / KW;
    const u32 tb = blockIdx.x, NB = gridDim.x, ntile = tb < T ? (T - 1 - tb) / NB + 1 : 0;
    float* const part = (float*)g_dsm;                                 // this block's sums (above)
    uint4* const ring = g_dsm + PART_U4;
    const u32 NS = (dyn_smem_bytes() / 16 - PART_U4) / STAGE;          // >= 2 (launcher)
    const u64 rowbytes = (u64)K * (F == BF16 ? 2 : 1);

    u32 i_tile = 0, i_round = 0, i_slot = 0, left = ntile * NR;   // the next stage to issue, in walk order
    auto issue_w = [&]() {
        if (!left) return;
        uint4* st = ring + i_slot * STAGE;
        const u32 row0 = (tb + i_tile * NB) * TR;
#pragma unroll
        for (u32 i = 0; i < CW; ++i) {
            const u32 L = tid + i * NT, sl = L / (TR * CH), r = L / CH % TR, cc = L % CH;
            const u32 u = i_round * KW + kr * XS + sl, ch = u * CH + cc;
            const bool ok = u < NU && ch < KCH;
            cp_async_stream(st + (sl * TR + r) * CH + (cc ^ ((r & 1) << 2)),
                            W + (u64)min(row0 + r, N - 1) * rowbytes + (ok ? ch : 0) * 16u, ok);
        }
    };
    auto advance = [&]() {
        if (!left) return;
        --left;
        if (++i_round == NR) { i_round = 0; ++i_tile; }
        if (++i_slot == NS) i_slot = 0;
    };

    // The first NS - 1 stages' weights go out before the wait (no kernel of the step writes them), their x after;
    // copy group 0 then holds all of those weights and stage 0's x, group p stage p's x.
    const u32 s0 = i_tile, s1 = i_round, s2 = i_slot, s3 = left;
    for (u32 p = 0; p + 1 < NS; ++p) { issue_w(); advance(); }
    i_tile = s0; i_round = s1; i_slot = s2; left = s3;
    pdl_wait();
    auto issue_x = [&]() {
        if (!left) return;
        uint4* st = ring + i_slot * STAGE + SW;
#pragma unroll
        for (u32 i = 0; i < CX; ++i) {
            const u32 L = tid + i * NT, sl = L / (XR * XCH), r = L / XCH % XR, cc = L % XCH;
            const u32 u = i_round * KW + kr * XS + sl, xc = u * XCH + cc;
            const bool ok = u < NU && xc < K / 8 && r < M;
            if (L < XS * XR * XCH)
                cp_async_stream(st + (sl * XG_ROWS + r) * XCH + (cc ^ ((r & 1) << XSW)),
                                x + (u64)(r < M ? r : 0) * xs + (ok ? xc : 0) * 8u, ok);
        }
    };
    for (u32 p = 0; p + 1 < NS; ++p) { issue_x(); advance(); cp_async_commit(); }

    u32 cslot = 0;
    for (u32 i = 0; i < ntile; ++i) {
        const u32 rbase = (tb + i * NB) * TR, row0 = rbase + rg * 16;
        float acc[MA][4] = {};
        for (u32 j = 0; j < NR; ++j) {
            cp_async_wait_n(NS - 2);   // this thread's copies of this stage have landed
            __syncthreads();           // everyone's have, and everyone is done with the previous stage's slot
            issue_w();
            issue_x();
            advance();
            cp_async_commit();         // an empty group past the end keeps the wait count uniform
            const u32 u = j * KW + w, c0 = u * CH;
            const uint4* sw = ring + cslot * STAGE + (ks * TR + rg * 16) * CH;
            const uint4* sx = ring + cslot * STAGE + SW + ks * XG_ROWS * XCH;
            if (++cslot == NS) cslot = 0;
            if (u >= NU) continue;     // warp-uniform: this slice has no unit in the last round
            float f = 1.f;             // fp8 block scale: a unit is 128 k, one 128 x 128 block for the group
            if (BLOCK) {
                const u64 si = (u64)(min(row0, N - 1) >> 7) * ((K + 127) / 128) + u;
                f = F == FP8_BLOCK ? __ldg((const float*)S + si) : e8m0_to_f(__ldg((const u8*)S + si));
            }
#pragma unroll
            for (int s = 0; s < 2; ++s) {
                if (c0 + 4 * s >= KCH) break;  // warp-uniform: the step lies past K
                const u32 pc = (4 * s + t) ^ ((g & 1) << 2);  // rows g, g + 8 and x rows 8 jm + g: g's parity
                const uint4 wv[2] = {sw[g * CH + pc], sw[(g + 8) * CH + pc]};
                const u32 sc[2][2] = {};
                if constexpr (F == BF16) {     // one x fragment at a time, its mmas chained (mma_stream's order)
#pragma unroll
                    for (u32 jm = 0; jm < MA; ++jm) {
                        const uint4 q = sx[(8 * jm + g) * XCH + pc];
                        const u32 X[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
                        for (u32 mi = 0; mi < NM; ++mi) {
                            u32 a[4], b[2];
                            frag_a<F>(wv, sc, mi, a);
                            frag_b<F>(X, mi, b);
                            mma16816(acc[jm], a, b);
                        }
                    }
                } else {                       // fp8: the step's A fragments decoded once, one n-tile at a time
                    u32 a[NM][4];
#pragma unroll
                    for (u32 mi = 0; mi < NM; ++mi) frag_a<F>(wv, sc, mi, a[mi]);
#pragma unroll
                    for (u32 jm = 0; jm < MA; ++jm) {
                        const uint4* xr = sx + (8 * jm + g) * XCH;
                        u32 X[KC / 2];
#pragma unroll
                        for (u32 v = 0; v < KC / 8; ++v) {
                            const uint4 q = xr[(8 * s + 2 * t + v) ^ (g & 1)];
                            X[4 * v] = q.x; X[4 * v + 1] = q.y; X[4 * v + 2] = q.z; X[4 * v + 3] = q.w;
                        }
                        float tmp[4] = {};     // mma_stream's order: its mmas in mi order, chained_acc's rule
#pragma unroll
                        for (u32 mi = 0; mi < NM; ++mi) {
                            u32 b[2];
                            frag_b<F>(X, mi, b);
                            mma16816(chained_acc<F>() ? acc[jm] : tmp, a[mi], b);
                        }
                        if (!chained_acc<F>())
#pragma unroll
                            for (int e = 0; e < 4; ++e) acc[jm][e] = fmaf(tmp[e], f, acc[jm][e]);
                    }
                }
            }
        }
        // C fragment element e of n-tile jm: x row 8 jm + 2t + (e & 1), weight row row0 + g + 8 (e >> 1).
        if constexpr (!CL) {           // one block: slice 0 adds the others' sums in slice order and stores
            if (XS > 1) {
                if (ks > 0)
#pragma unroll
                    for (u32 jm = 0; jm < MA; ++jm)
#pragma unroll
                        for (int e = 0; e < 4; ++e) part[(((ks - 1) * XG_RG + rg) * 32 + jm * 4 + e) * 32 + lane] = acc[jm][e];
                __syncthreads();  // slice 0 reads them; the next writes come after the next tile's barriers
            }
            if (ks == 0)
#pragma unroll
                for (u32 jm = 0; jm < MA; ++jm)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        float v = acc[jm][e];
#pragma unroll
                        for (u32 sl = 1; sl < XS; ++sl) v += part[(((sl - 1) * XG_RG + rg) * 32 + jm * 4 + e) * 32 + lane];
                        const u32 m = 8 * jm + 2 * t + (e & 1), n = row0 + g + 8 * (e >> 1);
                        if (m < M && n < N)
                            store_out(y, (u64)m * ys + n, v * (F == FP8_ROW ? __ldg((const float*)S + n) : 1.f), out_f32);
                    }
            continue;
        }
        // A cluster: the fold, PE floats a lane at a time. Element q of the tile's XG_RG * PE is folded by warp
        // q % (KW XG_RG) of the cluster (rank q / (XS XG_RG) within that): the work is spread over every rank.
        const u32 fkb = KW / fks;
        auto at = [&](u32 sl, u32 r, u32 e) -> const float* { return part + ((sl * XG_RG + r) * PE + e) * 32 + lane; };
        auto slice = [&](u32 ws, u32 r, u32 e) -> float {
            const u32 rank = ws / XS;
            return rank == kr ? *at(ws % XS, r, e) : ld_cluster_f32(at(ws % XS, r, e), rank);
        };
#pragma unroll
        for (u32 h = 0; h < E; h += PE) {
#pragma unroll
            for (u32 e = 0; e < PE; ++e) part[((ks * XG_RG + rg) * PE + e) * 32 + lane] = acc[(h + e) / 4][(h + e) % 4];
            cluster_sync();
            for (u32 q = kr * XS * XG_RG + wi; q < XG_RG * PE; q += KW * XG_RG) {
                const u32 r = q / PE, e = q % PE;
                float v = 0.f;
                for (u32 b8 = 0; b8 < fkb; ++b8) {
                    float bs = slice(b8 * fks, r, e);
                    for (u32 q8 = 1; q8 < fks; ++q8) bs += slice(b8 * fks + q8, r, e);
                    v = b8 ? v + bs : bs;
                }
                const u32 ee = h + e, m = 8 * (ee / 4) + 2 * t + (ee & 1), n = rbase + r * 16 + g + 8 * ((ee >> 1) & 1);
                if (m < M && n < N) store_out(y, (u64)m * ys + n, v * (F == FP8_ROW ? __ldg((const float*)S + n) : 1.f), out_f32);
            }
            cluster_sync();  // every fold is done reading: part may be rewritten
        }
    }
}

// The 64-row kernels, one signature (bf16's scale is unused): W, the 8-row kernels' scale, fks, the shared tail.
// The instance for the launch: XS = blockDim.y (1, or 2 for bf16 without a cluster), MA = the fewest n-tiles
// that cover M, CL = launched in clusters (gridDim.y > 1). Launch bounds: bf16 (512, 1), fp8 one-slice blocks
// two a multiprocessor (256, 2); 128 registers a thread either way.
#define X64_KERNEL(NAME, F_, WT, ST, LB_T, LB_B)                                                              \
    extern "C" __global__ __launch_bounds__(LB_T, LB_B) void NAME(                                            \
        const WT* W, ST scale, u32 fks, const u16* x, void* y, u32 M, u32 N, u32 K, u32 x_stride, u32 y_stride, \
        u32 out_f32)                                                                                          \
    {                                                                                                         \
        pdl_trigger();                                                                                        \
        const u32 ma = M <= 16 ? 2 : M <= 32 ? 4 : 8, xsl = blockDim.y;                                        \
        const u8* w = (const u8*)W;                                                                           \
        if (gridDim.y > 1) {  /* clusters of one-slice blocks */                                              \
            if (ma == 2) x64_body<F_, 1, 2, true>(w, scale, fks, x, y, M, N, K, x_stride, y_stride, out_f32); \
            else if (ma == 4) x64_body<F_, 1, 4, true>(w, scale, fks, x, y, M, N, K, x_stride, y_stride, out_f32); \
            else x64_body<F_, 1, 8, true>(w, scale, fks, x, y, M, N, K, x_stride, y_stride, out_f32);         \
        } else if (F_ != BF16 || xsl == 1) {                                                                  \
            if (ma == 2) x64_body<F_, 1, 2, false>(w, scale, fks, x, y, M, N, K, x_stride, y_stride, out_f32); \
            else if (ma == 4) x64_body<F_, 1, 4, false>(w, scale, fks, x, y, M, N, K, x_stride, y_stride, out_f32); \
            else x64_body<F_, 1, 8, false>(w, scale, fks, x, y, M, N, K, x_stride, y_stride, out_f32);        \
        } else if constexpr (F_ == BF16) {  /* two-slice blocks: fp8's decode leaves no registers for them */ \
            if (ma == 2) x64_body<F_, 2, 2, false>(w, scale, fks, x, y, M, N, K, x_stride, y_stride, out_f32); \
            else if (ma == 4) x64_body<F_, 2, 4, false>(w, scale, fks, x, y, M, N, K, x_stride, y_stride, out_f32); \
            else x64_body<F_, 2, 8, false>(w, scale, fks, x, y, M, N, K, x_stride, y_stride, out_f32);        \
        }                                                                                                     \
    }
X64_KERNEL(dense_gemv_bf16_batch64, BF16, u16, const u8*, 512, 1)
X64_KERNEL(gemv_fp8w_batch64, FP8_ROW, u8, const float*, 256, 2)
X64_KERNEL(w8a16_gemv_batch64, FP8_BLOCK, u8, const float*, 256, 2)
X64_KERNEL(w8a16_gemv_e8m0_batch64, FP8_BLOCK_E8M0, u8, const u8*, 256, 2)
#undef X64_KERNEL

// e4m3 W [N, K], f32 scale [N]; 8 x rows a pass.
extern "C" __global__ __launch_bounds__(512) void gemv_fp8w(
    const u8* W, const float* scale, const u16* x, void* y, u32 M, u32 N, u32 K, u32 x_stride, u32 y_stride,
    u32 out_f32)
{
    pdl_trigger();
    mma_stream<FP8_ROW, 1, 1>(W, scale, 1.f, x, y, M, N, K, x_stride, y_stride, out_f32);
}

// e4m3 W [N, K], f32 scale [ceil(N/128), ceil(K/128)] (DeepSeek weight_scale_inv); 8 x rows a pass.
extern "C" __global__ __launch_bounds__(512) void w8a16_gemv(
    const u8* W, const float* scale, const u16* x, void* y, u32 M, u32 N, u32 K, u32 x_stride, u32 y_stride,
    u32 out_f32)
{
    pdl_trigger();
    mma_stream<FP8_BLOCK, 1, 1>(W, scale, 1.f, x, y, M, N, K, x_stride, y_stride, out_f32);
}

// As w8a16_gemv with E8M0 scale bytes (2^(b-127)).
extern "C" __global__ __launch_bounds__(512) void w8a16_gemv_e8m0(
    const u8* W, const u8* scale, const u16* x, void* y, u32 M, u32 N, u32 K, u32 x_stride, u32 y_stride,
    u32 out_f32)
{
    pdl_trigger();
    mma_stream<FP8_BLOCK_E8M0, 1, 1>(W, scale, 1.f, x, y, M, N, K, x_stride, y_stride, out_f32);
}

// NVFP4: W u8 [N, K/2] (low nibble = even k), e4m3 scale [N, K/16], f32 global scale2; 8 x rows a pass.
extern "C" __global__ __launch_bounds__(512) void w4a16_gemv(
    const u8* W, const u8* scale, float scale2, const u16* x, void* y, u32 M, u32 N, u32 K, u32 x_stride,
    u32 y_stride, u32 out_f32)
{
    pdl_trigger();
    mma_stream<NVFP4, 1, 1>(W, scale, scale2, x, y, M, N, K, x_stride, y_stride, out_f32);
}

// MXFP4: W u8 [N, K/2], E8M0 scale [N, K/32], no global scale; 8 x rows a pass.
extern "C" __global__ __launch_bounds__(512) void w4a16_gemv_mx(
    const u8* W, const u8* scale, const u16* x, void* y, u32 M, u32 N, u32 K, u32 x_stride, u32 y_stride,
    u32 out_f32)
{
    pdl_trigger();
    mma_stream<MXFP4, 1, 1>(W, scale, 1.f, x, y, M, N, K, x_stride, y_stride, out_f32);
}

// 32 x rows a pass over W for every quantised format (4 x tiles of 8 rows). A row's sum runs over the
// same units in the same order as in the 8-row kernel of its format when launched with the same KS, so
// linear() keeps a row's arithmetic whatever the batch it runs in.
extern "C" __global__ __launch_bounds__(512) void gemv_fp8w_batch32(
    const u8* W, const float* scale, const u16* x, void* y, u32 M, u32 N, u32 K, u32 x_stride, u32 y_stride,
    u32 out_f32)
{
    pdl_trigger();
    mma_stream<FP8_ROW, 4, 1>(W, scale, 1.f, x, y, M, N, K, x_stride, y_stride, out_f32);
}

extern "C" __global__ __launch_bounds__(512) void w8a16_gemv_batch32(
    const u8* W, const float* scale, const u16* x, void* y, u32 M, u32 N, u32 K, u32 x_stride, u32 y_stride,
    u32 out_f32)
{
    pdl_trigger();
    mma_stream<FP8_BLOCK, 4, 1>(W, scale, 1.f, x, y, M, N, K, x_stride, y_stride, out_f32);
}

extern "C" __global__ __launch_bounds__(512) void w8a16_gemv_e8m0_batch32(
    const u8* W, const u8* scale, const u16* x, void* y, u32 M, u32 N, u32 K, u32 x_stride, u32 y_stride,
    u32 out_f32)
{
    pdl_trigger();
    mma_stream<FP8_BLOCK_E8M0, 4, 1>(W, scale, 1.f, x, y, M, N, K, x_stride, y_stride, out_f32);
}

extern "C" __global__ __launch_bounds__(256) void w4a16_gemv_batch32(
    const u8* W, const u8* scale, float scale2, const u16* x, void* y, u32 M, u32 N, u32 K, u32 x_stride,
    u32 y_stride, u32 out_f32)
{
    pdl_trigger();
    mma_stream<NVFP4, 4, 1>(W, scale, scale2, x, y, M, N, K, x_stride, y_stride, out_f32);
}

extern "C" __global__ __launch_bounds__(256) void w4a16_gemv_mx_batch32(
    const u8* W, const u8* scale, const u16* x, void* y, u32 M, u32 N, u32 K, u32 x_stride, u32 y_stride,
    u32 out_f32)
{
    pdl_trigger();
    mma_stream<MXFP4, 4, 1>(W, scale, 1.f, x, y, M, N, K, x_stride, y_stride, out_f32);
}

// Register-round tensor-core kernels (block (32, KS, 8 / KS)); w4a16_gemv_regs is linear()'s NVFP4 kernel.
extern "C" __global__ __launch_bounds__(256) void dense_gemv_bf16_batchm_regs(
    const u16* W, const u16* x, void* y, u32 M, u32 N, u32 K, u32 x_stride, u32 y_stride, u32 out_f32)
{
    pdl_entry();
    mma_regs<BF16, 1, 1, 4>((const u8*)W, nullptr, 1.f, x, y, M, N, K, x_stride, y_stride, out_f32);
}

extern "C" __global__ __launch_bounds__(256) void w8a16_gemv_regs(
    const u8* W, const float* scale, const u16* x, void* y, u32 M, u32 N, u32 K, u32 x_stride, u32 y_stride,
    u32 out_f32)
{
    pdl_entry();
    mma_regs<FP8_BLOCK, 1, 1, 4>(W, scale, 1.f, x, y, M, N, K, x_stride, y_stride, out_f32);
}

extern "C" __global__ __launch_bounds__(256) void w4a16_gemv_regs(
    const u8* W, const u8* scale, float scale2, const u16* x, void* y, u32 M, u32 N, u32 K, u32 x_stride,
    u32 y_stride, u32 out_f32)
{
    pdl_entry();
    mma_regs<NVFP4, 1, 1, 4>(W, scale, scale2, x, y, M, N, K, x_stride, y_stride, out_f32);
}

// ---------------------------------------------------------------------------------------------
// dense_gemm_bf16 (prefill): block tile 128 x rows * 128 W rows * 32 k, 8 warps as 2 (m) x 4 (n) with
// 64 x 32 warp tiles; a ring of GS cp.async stages in dynamic shared memory (GEMM_SMEM bytes, set by the
// launcher), GS - 1 k-steps in flight, one barrier per k-step; smem rows padded to 40 bf16 (80 B) so the
// 8 row addresses of every ldmatrix phase fall on distinct banks. grid (ceil(M/128), ceil(N/128)):
// consecutive blocks share a W tile, which stays in L2 while x (small) is reused from L2 too.

constexpr int TM = 128, TN = 128, TK = 32, TPAD = 40, GS = 4;  // GEMM_SMEM = GS * (TM + TN) * TPAD * 2

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool ok) {
    const u32 s = (u32)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(gmem), "r"(ok ? 16 : 0)
                 : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(u32 r[4], const void* smem) {
    const u32 s = (u32)__cvta_generic_to_shared(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s));
}

extern "C" __global__ __launch_bounds__(256) void dense_gemm_bf16(
    const u16* W, const u16* x, void* y, u32 M, u32 N, u32 K, u32 x_stride, u32 y_stride, u32 out_f32)
{
    pdl_entry();
    u16 (*sx)[TM][TPAD] = (u16 (*)[TM][TPAD])g_dsm;         // [GS][TM][TPAD]
    u16 (*sw)[TN][TPAD] = (u16 (*)[TN][TPAD])(sx + GS);     // [GS][TN][TPAD]
    const u32 tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wm = warp >> 2, wn = warp & 3;
    const u32 m0 = blockIdx.x * TM, n0 = blockIdx.y * TN;
    const u32 nk = (K + TK - 1) / TK;

    auto load = [&](u32 kt) {  // k-step kt into its ring slot, then close the group (empty past the end)
        if (kt < nk) {
            const u32 st = kt % GS, k0 = kt * TK;
#pragma unroll
            for (int i = 0; i < 2; ++i) {  // 128 rows * 4 chunks per operand = 2 chunks per thread
                const u32 idx = tid + 256 * i, r = idx >> 2, kk = k0 + (idx & 3) * 8;
                const bool okx = m0 + r < M && kk < K, okw = n0 + r < N && kk < K;
                cp_async16(&sx[st][r][(idx & 3) * 8], x + (okx ? (u64)(m0 + r) * x_stride + kk : 0), okx);
                cp_async16(&sw[st][r][(idx & 3) * 8], W + (okw ? (u64)(n0 + r) * K + kk : 0), okw);
            }
        }
        cp_async_commit();
    };

    float acc[4][4][4] = {};
#pragma unroll
    for (int s = 0; s < GS - 1; ++s) load(s);
    for (u32 kt = 0; kt < nk; ++kt) {
        cp_async_wait<GS - 2>();  // this thread's copies of step kt have landed
        __syncthreads();          // everyone's have; and everyone is done with step kt - 1's slot
        load(kt + GS - 1);        // refills that slot
        const u32 st = kt % GS;
#pragma unroll
        for (int kk = 0; kk < TK; kk += 16) {
            u32 a[4][4], b[4][2];
#pragma unroll
            for (int i = 0; i < 4; ++i)  // x rows of m16 tile i: lanes 0-15 k 0-7, lanes 16-31 k 8-15
                ldmatrix_x4(a[i], &sx[st][wm * 64 + i * 16 + (lane & 15)][kk + (lane >> 4) * 8]);
#pragma unroll
            for (int p = 0; p < 2; ++p) {  // W rows of n8 tiles 2p, 2p+1 (k halves as b0 / b1)
                u32 r[4];
                ldmatrix_x4(r, &sw[st][wn * 32 + p * 16 + (lane & 7) + ((lane >> 4) << 3)][kk + ((lane >> 3) & 1) * 8]);
                b[2 * p][0] = r[0]; b[2 * p][1] = r[1]; b[2 * p + 1][0] = r[2]; b[2 * p + 1][1] = r[3];
            }
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) mma16816(acc[i][j], a[i], b[j]);
        }
    }
    const u32 g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const u32 m = m0 + wm * 64 + i * 16 + g + 8 * (e >> 1), n = n0 + wn * 32 + j * 8 + 2 * t + (e & 1);
                if (m < M && n < N) store_out(y, (u64)m * y_stride + n, acc[i][j][e], out_f32);
            }
}
