// Batched fp8 block-scale GEMVs on wgmma (sm_90a): y[m, n] = sum_k x[m, k] * W[n, k] for up to 64 x rows, every
// row summed exactly as the 8-row kernel (gemv.cu, mma_stream) sums it under its k-split (ks, kb): the same
// units, the same 16 k of each k16 product, the same step sums times the block scale, the same fold of the
// slices. So a row's bits are that kernel's whatever m is (linear(invariant)). wgmma m64nNk16 with A from
// registers gives the bits of mma.sync m16n8k16 on the same fragments (measured: BENCHMARKS.md, 2026-12-07);
// one instruction multiplies 64 weight rows by up to 64 x rows, where mma.sync takes 8 x rows a warp.
//
// Grid (tiles, CB, passes) in clusters (1, CB, 1): block (tile, rank, pass) owns weight rows WG_ROWS tile .. and x
// rows NX pass .. + NX - 1; WG_GROUPS warpgroups of 64 rows share the unit's x, warp q of a warpgroup holding its
// rows 16 q .. + 15 as mma.sync's A fragments. The plan's kw = ks * kb slices are shared by the CB ranks (up to 16:
// a cluster past 8 blocks needs the non-portable attribute, which the backend sets), L = kw / CB each: rank r walks
// slices r L .. r L + L - 1 one after another, slice w's units w, w + kw, ... (a unit: 128 k, two steps of four
// k16), and keeps each slice's sums; then the cluster folds them as gemv.cu does (the ks slices of each 8-row rank in slice
// order, then those rank sums in rank order), each rank folding a share of the C fragment's elements over DSMEM.
// Dynamic shared memory: the slice sums part [L][NX / 2][threads] f32, xw (the unit's x as wgmma's B, [8 k16
// blocks][NX rows][16 k] in 8 x 8 core matrices), then a cp.async ring of NS stages, each the unit's weights
// W [WG_ROWS][8 chunks] (chunk c of row r at r * 8 + (c ^ 4 (r & 1)), as mma_stream's ring) and its raw x rows
// [NX][16 chunks of 8 bf16], permuted into xw once the stage has landed.
// Block (s, i) of xw is the k16 that mma i of step s multiplies: for t = 0..3 the k (4 s + t) * 16 + 4 i + q,
// q = 0, 2 as k columns 2t, 2t + 1 and q = 1, 3 as 2t + 8, 2t + 9 (frag_a's e4m3 pairs, frag_b's x pairs).
#include "common.cuh"
#include "stream_mma.cuh"

#define WG_GROUPS 2                 // warpgroups a block, 64 weight rows each, sharing the unit's x
#define WG_ROWS (64 * WG_GROUPS)     // weight rows a block
#define WG_THREADS (128 * WG_GROUPS)

__device__ __forceinline__ u64 wg_desc(u32 addr) {  // no swizzle: K-adjacent core matrices 128 B, N-adjacent 256 B
    return (u64)((addr & 0x3FFFF) >> 4) | ((u64)(128 >> 4) << 16) | ((u64)(256 >> 4) << 32);
}

// d (+)= A B: m64 n NX k16, A = this warp's mma.sync A fragment a, B = the k16 block at desc; acc: d += (else d =).
template <int NX> __device__ __forceinline__ void wg_mma(float (&d)[NX / 8][4], const u32 a[4], u64 desc, bool acc);

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.commit_group.sync.aligned;\n\twgmma.wait_group.sync.aligned 0;" ::: "memory");
}
// shared-memory writes made visible to wgmma, which reads through the async proxy
__device__ __forceinline__ void wg_proxy_fence() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
#define WG_ASM(N, DL, AL, DESC, P)                                                                           \
    "{\n.reg .pred p;\nsetp.ne.b32 p, " P ", 0;\nwgmma.mma_async.sync.aligned.m64n" N "k16.f32.bf16.bf16 {" DL \
    "}, {" AL "}, " DESC ", p, 1, 1, 0;\n}\n"
template <> __device__ __forceinline__ void wg_mma<16>(float (&d)[2][4], const u32 a[4], u64 desc, bool acc) {
    asm volatile(WG_ASM("16", "%0,%1,%2,%3,%4,%5,%6,%7", "%8,%9,%10,%11", "%12", "%13")
                 : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]),
                   "+f"(d[1][2]), "+f"(d[1][3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"((u32)acc));
}
template <> __device__ __forceinline__ void wg_mma<32>(float (&d)[4][4], const u32 a[4], u64 desc, bool acc) {
    asm volatile(WG_ASM("32", "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15", "%16,%17,%18,%19", "%20",
                        "%21")
                 : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]),
                   "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
                   "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"((u32)acc));
}
template <> __device__ __forceinline__ void wg_mma<64>(float (&d)[8][4], const u32 a[4], u64 desc, bool acc) {
    asm volatile(WG_ASM("64", "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,"
                              "%23,%24,%25,%26,%27,%28,%29,%30,%31", "%32,%33,%34,%35", "%36", "%37")
                 : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]),
                   "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
                   "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]),
                   "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
                   "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]),
                   "+f"(d[7][2]), "+f"(d[7][3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"((u32)acc));
}
#undef WG_ASM
#else   // other targets: never launched there (ops/gemv_wg.py wg_runs: sm_90 only); the module still compiles
template <int NX> __device__ __forceinline__ void wg_mma(float (&)[NX / 8][4], const u32*, u64, bool) { __trap(); }
__device__ __forceinline__ void wg_fence() {}
__device__ __forceinline__ void wg_wait() {}
__device__ __forceinline__ void wg_proxy_fence() {}
#endif

// cp_async_stream on a shared-space address (the callers keep their destinations as such: no conversion a copy).
__device__ __forceinline__ void cp_async_at(u32 saddr, const void* gmem, bool ok) {
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;" ::"r"(saddr), "l"(gmem), "r"(ok ? 16 : 0)
                 : "memory");
}

template <int F, int NX>
__device__ __forceinline__ void wg_body(const u8* W, const void* S, u32 fks, u32 kw, const u16* x, void* y, u32 M,
                                        u32 N, u32 K, u32 xs, u32 ys, u32 out_f32)
{
    constexpr u32 KC = 16, CH = 8, NJ = NX / 8, E = NJ * 4, SW = WG_ROWS * CH, SX = NX * 16, STAGE = SW + SX;  // uint4
    constexpr u32 NT = WG_THREADS, CW = SW / NT, CX = SX / NT;   // threads; copies a thread per stage
    constexpr u32 WRS = NT / CH, XRS = NT / 16;                   // weight / raw x rows a copy round covers
    const u32 tid = threadIdx.x, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const u32 wq = (tid >> 5) & 3, wrow = (tid >> 7) * 64 + 16 * wq;   // warp in its warpgroup; its 16 rows
    const u32 KCH = K / KC, NU = (KCH + CH - 1) / CH;
    const u32 CB = gridDim.y, kr = blockIdx.y, L = kw / CB;   // cluster size and rank; slices kr L .. + L - 1 here
    const u32 row0 = blockIdx.x * WG_ROWS, p0 = blockIdx.z * NX;
    float* const part = (float*)g_dsm;                         // [L][E][NT]: each slice's sums
    uint4* const xw = g_dsm + L * E * NT / 4;
    uint4* const ring = xw + SX;
    const u32 NS = (dyn_smem_bytes() / 16 - L * E * NT / 4 - SX) / STAGE;   // >= 2 (launcher)
    auto units = [&](u32 w) -> u32 { return w < NU ? (NU - 1 - w) / kw + 1 : 0; };
    u32 total = 0;
    for (u32 l = 0; l < L; ++l) total += units(kr * L + l);

    u32 i_l = 0, i_u = kr * L, i_slot = 0, left = total;   // the next stage to issue: slice, unit, ring slot
    // weight copies: rows wr + WRS i, chunk wc of the unit (ring row r's chunk c at r * 8 + (c ^ 4 (r & 1)))
    const u32 wr = tid / CH, wc = tid % CH, ring_s = (u32)__cvta_generic_to_shared(ring);
    const u32 w_dst = ring_s + 16 * (wr * CH + (wc ^ ((wr & 1) << 2)));
    const u8* const w_src = W + (u64)(row0 + wr) * K + wc * 16;
    u32 w_rows = 0;   // bit i: row wr + WRS i is a weight row
#pragma unroll
    for (u32 i = 0; i < CW; ++i) w_rows |= (u32)(row0 + wr + WRS * i < N) << i;
    auto issue_w = [&]() {
        if (!left) return;
        const u32 dst = w_dst + i_slot * STAGE * 16;
        const bool kok = i_u * CH + wc < KCH;
#pragma unroll
        for (u32 i = 0; i < CW; ++i) {
            const bool ok = kok && (w_rows >> i & 1);
            cp_async_at(dst + i * WRS * CH * 16, ok ? w_src + (u64)WRS * i * K + i_u * 128u : W, ok);
        }
    };
    auto advance = [&]() {
        if (!left) return;
        --left;
        i_u += kw;
        if (i_u >= NU) i_u = kr * L + ++i_l;
        if (++i_slot == NS) i_slot = 0;
    };
    // The first NS - 1 stages' weights go out before the PDL wait (no kernel of the step writes them), their x
    // after: copy group 0 holds those weights and stage 0's x, group p stage p's x.
    const u32 s0 = i_l, s1 = i_u, s2 = i_slot, s3 = left;
    for (u32 p = 0; p + 1 < NS; ++p) { issue_w(); advance(); }
    i_l = s0; i_u = s1; i_slot = s2; left = s3;
    pdl_wait();
    // raw x copies: rows xr + XRS i, chunk xc (8 bf16) of the unit
    const u32 xr = tid / 16, xc = tid % 16, x_dst = ring_s + 16 * (SW + xr * 16 + xc);
    const u16* const x_src = x + (u64)(p0 + xr) * xs + xc * 8;
    u32 x_rows = 0;   // bit i: row p0 + xr + 8 i is an x row
#pragma unroll
    for (u32 i = 0; i < CX; ++i) x_rows |= (u32)(p0 + xr + XRS * i < M) << i;
    auto issue_x = [&]() {
        if (!left) return;
        const u32 dst = x_dst + i_slot * STAGE * 16;
        const bool kok = i_u * 16 + xc < K / 8;
#pragma unroll
        for (u32 i = 0; i < CX; ++i) {
            const bool ok = kok && (x_rows >> i & 1);
            cp_async_at(dst + i * XRS * 16 * 16, ok ? x_src + (u64)XRS * i * xs + i_u * 128u : x, ok);
        }
    };
    for (u32 p = 0; p + 1 < NS; ++p) { issue_x(); advance(); cp_async_commit(); }

    const u32 xw_addr = (u32)__cvta_generic_to_shared(xw);
    const u64 srow = (u64)(min(row0, N - 1) >> 7) * ((K + 127) / 128);   // this tile's 128-row scale block
    const u32 pr = tid / 4, pt = tid % 4;   // the permute: row pr (+ NT / 4 ii) and column pair pt of every k16 block
    u32 cslot = 0;
    float tmp[NJ][4] = {};
    for (u32 l = 0; l < L; ++l) {
        float acc[NJ][4] = {};
        for (u32 u = kr * L + l; u < NU; u += kw) {
            cp_async_wait_n(NS - 2);   // this thread's copies of the stage have landed
            __syncthreads();           // everyone's have; everyone is done with the last unit (xw and its slot)
            issue_w();
            issue_x();
            advance();
            cp_async_commit();         // an empty group past the end keeps the wait count uniform
            const uint4* st = ring + cslot * STAGE;
            if (++cslot == NS) cslot = 0;
            const float f = F == FP8_BLOCK ? __ldg((const float*)S + srow + u)
                                           : e8m0_to_f(__ldg((const u8*)S + srow + u));
            // raw chunk 8 s + 2 pt + hh of a row (k 8 c16 .. + 7, c16 = 8 s + 2 pt + hh) holds words 2 hh, 2 hh + 1
            // of fp8 chunk 4 s + pt: the k of blocks (s, 2 hh + h), column pair pt (conflict-free stores: a warp
            // covers 8 rows x 4 column pairs)
#pragma unroll
            for (u32 ii = 0; ii < (NX + NT / 4 - 1) / (NT / 4); ++ii) {
                const u32 r = pr + NT / 4 * ii;
                if (r >= NX) break;
                u32* const dst = (u32*)xw + (r >> 3) * 64 + (r & 7) * 4 + pt;
#pragma unroll
                for (u32 s = 0; s < 2; ++s)
#pragma unroll
                    for (u32 hh = 0; hh < 2; ++hh) {
                        const uint4 q = st[SW + r * 16 + 8 * s + 2 * pt + hh];
#pragma unroll
                        for (u32 h = 0; h < 2; ++h) {
                            const u32 lo = h ? q.z : q.x, hi = h ? q.w : q.y, blk = s * 4 + 2 * hh + h;
                            dst[blk * NX * 8] = __byte_perm(lo, hi, 0x5410);        // k q = 0, 2: columns 2t, 2t + 1
                            dst[blk * NX * 8 + 32] = __byte_perm(lo, hi, 0x7632);   // q = 1, 3: columns 2t + 8, 2t + 9
                        }
                    }
            }
            wg_proxy_fence();
            __syncthreads();
#pragma unroll
            for (u32 s = 0; s < 2; ++s) {
                if (u * CH + 4 * s >= KCH) break;   // block-uniform: the step lies past K
                const u32 pc = (4 * s + t) ^ ((g & 1) << 2);
                const uint4 wv[2] = {st[(wrow + g) * CH + pc], st[(wrow + g + 8) * CH + pc]};
                const u32 sc[2][2] = {};
                u32 a[4][4];
#pragma unroll
                for (u32 mi = 0; mi < 4; ++mi) frag_a<F>(wv, sc, mi, a[mi]);
                // the step sum: mma_stream adds its products to +0, this overwrites (scale-d 0); the two differ only
                // in the sign of a zero sum, which fma(sum, f, acc) cannot see (acc is never -0)
                wg_fence();
#pragma unroll
                for (u32 mi = 0; mi < 4; ++mi)
                    wg_mma<NX>(tmp, a[mi], wg_desc(xw_addr + (s * 4 + mi) * NX * 32), mi > 0);
                wg_wait();
#pragma unroll
                for (u32 j = 0; j < NJ; ++j)
#pragma unroll
                    for (u32 e = 0; e < 4; ++e) acc[j][e] = fmaf(tmp[j][e], f, acc[j][e]);
            }
        }
#pragma unroll
        for (u32 j = 0; j < NJ; ++j)
#pragma unroll
            for (u32 e = 0; e < 4; ++e) part[(l * E + j * 4 + e) * NT + tid] = acc[j][e];
    }
    // gemv.cu's fold of slice w = b8 fks + q8 (held by rank w / L): a rank's slices in slice order, then the rank
    // sums in rank order. Rank kr folds elements kr, kr + CB, ... of every thread's C fragment (each thread its own).
    if (CB > 1) cluster_sync();
    const u32 fkb = kw / fks;
    for (u32 e = kr; e < E; e += CB) {
        float v = 0.f;
        u32 rank = 0, li = 0;   // slice w = b8 fks + q8 is slice li of rank `rank`
        for (u32 b8 = 0; b8 < fkb; ++b8) {
            float bs = 0.f;
            for (u32 q8 = 0; q8 < fks; ++q8) {
                const float* p = part + (li * E + e) * NT + tid;
                const float sv = rank == kr ? *p : ld_cluster_f32(p, rank);
                bs = q8 ? bs + sv : sv;
                if (++li == L) { li = 0; ++rank; }
            }
            v = b8 ? v + bs : bs;
        }
        // C fragment element e = 4 j + e4 of n-tile j: weight row 16 q + g + 8 (e4 >> 1), x row 8 j + 2t + (e4 & 1)
        const u32 m = p0 + 8 * (e / 4) + 2 * t + (e & 1), n = row0 + wrow + g + 8 * ((e >> 1) & 1);
        if (m < M && n < N) store_out(y, (u64)m * ys + n, v, out_f32);
    }
    if (CB > 1) cluster_sync();   // the others' reads of this block's sums are done: it may exit
}

// One signature: W e4m3 [N, K], its 128 x 128 block scales, the 8-row plan's ks (fks) and ks * kb (kw), then the
// shared tail of gemv.cu. Grid (tiles, cluster size <= 16, passes) in clusters (1, CB, 1); NX (x rows a pass) = 16,
// 32 or 64, the launcher's: the fewest that cover M / gridDim.z. Two blocks an SM (<= 128 registers).
#define WG_KERNEL(NAME, F_, ST)                                                                               \
    extern "C" __global__ __launch_bounds__(WG_THREADS, 2) void NAME(                                       \
        const u8* W, ST scale, u32 fks, u32 kw, const u16* x, void* y, u32 M, u32 N, u32 K, u32 x_stride,     \
        u32 y_stride, u32 out_f32)                                                                            \
    {                                                                                                         \
        pdl_trigger();                                                                                        \
        const u32 per = (M + gridDim.z - 1) / gridDim.z;                                                      \
        if (per <= 16) wg_body<F_, 16>(W, scale, fks, kw, x, y, M, N, K, x_stride, y_stride, out_f32);        \
        else if (per <= 32) wg_body<F_, 32>(W, scale, fks, kw, x, y, M, N, K, x_stride, y_stride, out_f32);   \
        else wg_body<F_, 64>(W, scale, fks, kw, x, y, M, N, K, x_stride, y_stride, out_f32);                  \
    }
WG_KERNEL(w8a16_gemv_wg, FP8_BLOCK, const float*)
WG_KERNEL(w8a16_gemv_e8m0_wg, FP8_BLOCK_E8M0, const u8*)
#undef WG_KERNEL
