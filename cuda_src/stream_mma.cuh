// Shared by gemv.cu and moe_mma.cu: the streaming helpers (cp.async weight rings in dynamic shared memory)
// and the tensor-core fragment helpers (mma.sync m16n8k16, bf16 in, fp32 accumulate) of every weight format,
// decoded to bf16 in registers (exactly: every e4m3 / e2m1*e4m3 / e2m1*e8m0 value fits in bf16), and for the fp8
// and MXFP4 expert GEMMs to f16 (mma on f16; e4m3 widens in one instruction a pair). Needs common.cuh first.
#pragma once

extern __shared__ __align__(16) uint4 g_dsm[];  // dynamic shared memory of the streaming kernels

__device__ __forceinline__ u32 dyn_smem_bytes() {
    u32 r;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r));
    return r;
}

// 16 bytes of a streamed weight, global -> shared, cached in L2 only, 256-byte L2 fetches; ok == false
// zero-fills without reading (callers still pass an in-bounds address).
__device__ __forceinline__ void cp_async_stream(uint4* smem, const void* gmem, bool ok) {
    const u32 s = (u32)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;" ::"r"(s), "l"(gmem), "r"(ok ? 16 : 0)
                 : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Wait until at most n of this thread's copy groups are pending (n > 7 waits for 7: stricter, still right).
__device__ __forceinline__ void cp_async_wait_n(u32 n) {
    switch (n) {
    case 0: cp_async_wait<0>(); break;
    case 1: cp_async_wait<1>(); break;
    case 2: cp_async_wait<2>(); break;
    case 3: cp_async_wait<3>(); break;
    case 4: cp_async_wait<4>(); break;
    case 5: cp_async_wait<5>(); break;
    case 6: cp_async_wait<6>(); break;
    default: cp_async_wait<7>(); break;
    }
}

__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

__device__ __forceinline__ u32 word(const uint4& v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

enum WFmt { BF16, FP8_ROW, FP8_BLOCK, FP8_BLOCK_E8M0, NVFP4, MXFP4 };

template <int F> __host__ __device__ constexpr int kchunk() { return F == BF16 ? 8 : (F == NVFP4 || F == MXFP4) ? 32 : 16; }

// The sum order of the tensor-core GEMVs and expert GEMMs. A format whose weights need no per-k-block multiplier
// (bf16, fp8 with a row scale, fp4: their scales are applied at the end or inside the decode) chains its mmas
// straight into the accumulators, as a GEMM mainloop does. The fp8 128 x 128 block formats multiply each
// step's products by the block's scale: a fresh accumulator per step, then acc = fma(step sum, scale, acc).
// Every kernel that must agree bit for bit with another (the 8-, 32- and 64-row GEMVs; the expert GEMMs' mma8
// and 32-row forms) follows this one rule.
template <int F> __host__ __device__ constexpr bool chained_acc() { return F != FP8_BLOCK && F != FP8_BLOCK_E8M0; }

__device__ __forceinline__ void mma16816(float c[4], const u32 a[4], const u32 b[2]) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// The same mma on f16 operands (the fp8 expert GEMMs: e4m3 weights widen to f16 in one instruction a pair, x
// staged as f16 by moe_stage_f16). f16 x f16 products are exact in fp32, as bf16 x bf16 ones are.
__device__ __forceinline__ void mma16816_f16(float c[4], const u32 a[4], const u32 b[2]) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// e4m3 bytes (0, 1) of v -> f16x2, exactly (every e4m3 value is an f16 normal).
__device__ __forceinline__ u32 e4m3x2_f16(u32 v) {
    u32 d;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(d) : "h"((u16)v));
    return d;
}

// The same for bytes (2h, 2h + 1) of v: the half as the cvt's 16-bit operand (no shift for the high one).
__device__ __forceinline__ u32 e4m3x2_f16_half(u32 v, int h) {
    u32 d;
    if (h == 0) asm("{.reg .b16 l, u; mov.b32 {l, u}, %1; cvt.rn.f16x2.e4m3x2 %0, l;}" : "=r"(d) : "r"(v));
    else asm("{.reg .b16 l, u; mov.b32 {l, u}, %1; cvt.rn.f16x2.e4m3x2 %0, u;}" : "=r"(d) : "r"(v));
    return d;
}

// The eight E2M1 codes of q (code j at bits 4j .. 4j + 3) as e4m3 bytes of value * 2^-6: sign at bit 7, the
// three magnitude bits under the exponent's two low bits and the mantissa's top one (E2M1's subnormal 0.5 is
// e4m3's subnormal 2^-7). lo byte i = code 2i, hi byte i = code 2i + 1; e4m3x2_f16 then widens a pair exactly.
__device__ __forceinline__ void e2m1x8_e4m3(u32 q, u32& lo, u32& hi) {
    lo = ((q << 2) & 0x1C1C1C1Cu) | ((q << 4) & 0x80808080u);
    hi = ((q >> 2) & 0x1C1C1C1Cu) | (q & 0x80808080u);
}

// A fragment i of an fp8 chunk pair as f16, in natural k order: word i of rows g (w[0]) and g + 8 (w[1]), bytes
// (0, 1) as the mma's k columns (2t, 2t + 1) and bytes (2, 3) as (2t + 8, 2t + 9), so x's f16 words pair up
// unpermuted (b = x words 2i, 2i + 1 of the lane's chunk).
__device__ __forceinline__ void frag_a_e4m3_f16(const uint4 w[2], int i, u32 a[4]) {
    const u32 q0 = word(w[0], i), q1 = word(w[1], i);
    a[0] = e4m3x2_f16(q0); a[1] = e4m3x2_f16(q1); a[2] = e4m3x2_f16(q0 >> 16); a[3] = e4m3x2_f16(q1 >> 16);
}

// bf16x2 multiply (fma with -0 keeps it sm_80-compatible). Subnormal inputs are honoured.
__device__ __forceinline__ u32 bmul2(u32 a, u32 b) {
    u32 d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
    return d;
}

// e4m3 bytes (0,2) / (1,3) of q -> bf16x2. Copying the 7 magnitude bits under the bf16 exponent gives
// value * 2^-120 (e4m3 subnormals become bf16 subnormals); the multiply by 2^120 is exact.
constexpr u32 BF16X2_2P120 = 0x7B807B80u;
__device__ __forceinline__ u32 e4m3x2_02(u32 q) {
    return bmul2(((q << 4) & 0x07F007F0u) | ((q << 8) & 0x80008000u), BF16X2_2P120);
}
__device__ __forceinline__ u32 e4m3x2_13(u32 q) {
    return bmul2(((q >> 4) & 0x07F007F0u) | (q & 0x80008000u), BF16X2_2P120);
}

// E2M1 nibbles J and J+4 of q -> bf16x2 of value * 2^-126 (code 1 = 0.5 is the bf16 subnormal 2^-127),
// times the bf16x2 block scale s; exact (an E2M1 * scale product has at most 6 significant bits).
template <int J> __device__ __forceinline__ u32 e2m1x2(u32 q, u32 s) {
    const u32 mag = (J <= 1 ? q << (6 - 4 * J) : q >> (4 * J - 6)) & 0x01C001C0u;
    return bmul2(mag | ((q << (12 - 4 * J)) & 0x80008000u), s);
}

__device__ __forceinline__ u32 splat_bf16(float v) {  // v must already be a bf16 value
    const u32 b = __float_as_uint(v) >> 16;
    return b | (b << 16);
}

// Per-chunk scales (fp4): raw bytes -> bf16x2 multipliers. nvfp4: e4m3 * 2^118 (A = w * 2^-8, undone
// with scale2 * 2^8 at the end); mxfp4: 2^(b-127) * 2^62 (A = w * 2^-64, undone at the end; exact for
// scales 2^-61 .. 2^65, 0xFF is NaN).
template <int F> __device__ __forceinline__ u32 fp4_scale(u32 sv, int blk) {
    if (F == NVFP4) return splat_bf16(fp8_to_f((u8)(sv >> (8 * blk))) * __int_as_float(0x7A800000));  // 2^118
    const u32 e = sv + 62u;
    const u32 b = sv == 0xFFu ? 0x7FC0u : e > 254u ? 0x7F80u : e << 7;
    return b | (b << 16);
}

// A fragment i (k16 mma i of the step) from the chunks of rows g, g+8 and their bf16x2 block scales.
template <int F> __device__ __forceinline__ void frag_a(const uint4 w[2], const u32 s[2][2], int i, u32 a[4]) {
    if (F == BF16) {
        a[0] = word(w[0], 2 * i); a[1] = word(w[1], 2 * i);
        a[2] = word(w[0], 2 * i + 1); a[3] = word(w[1], 2 * i + 1);
    } else if (F == NVFP4 || F == MXFP4) {
        const int wi = i >> 1, blk = F == NVFP4 ? wi >> 1 : 0;
        const u32 q0 = word(w[0], wi), q1 = word(w[1], wi);
        if (i & 1) {
            a[0] = e2m1x2<2>(q0, s[0][blk]); a[1] = e2m1x2<2>(q1, s[1][blk]);
            a[2] = e2m1x2<3>(q0, s[0][blk]); a[3] = e2m1x2<3>(q1, s[1][blk]);
        } else {
            a[0] = e2m1x2<0>(q0, s[0][blk]); a[1] = e2m1x2<0>(q1, s[1][blk]);
            a[2] = e2m1x2<1>(q0, s[0][blk]); a[3] = e2m1x2<1>(q1, s[1][blk]);
        }
    } else {
        const u32 q0 = word(w[0], i), q1 = word(w[1], i);
        a[0] = e4m3x2_02(q0); a[1] = e4m3x2_02(q1); a[2] = e4m3x2_13(q0); a[3] = e4m3x2_13(q1);
    }
}

// x words X[0 .. KC/2) (bf16 pairs k, k+1) reordered to the pairs frag_a produced.
template <int F> __device__ __forceinline__ void frag_b(const u32* X, int i, u32 b[2]) {
    if (F == BF16) {
        b[0] = X[2 * i]; b[1] = X[2 * i + 1];
    } else if (F == NVFP4 || F == MXFP4) {  // (k, k+4) pairs of 8-k word i/2
        const u32* p = X + 4 * (i >> 1) + (i & 1);
        b[0] = __byte_perm(p[0], p[2], 0x5410); b[1] = __byte_perm(p[0], p[2], 0x7632);
    } else {  // (k, k+2) pairs of 4-k word i
        b[0] = __byte_perm(X[2 * i], X[2 * i + 1], 0x5410); b[1] = __byte_perm(X[2 * i], X[2 * i + 1], 0x7632);
    }
}
