// Paged decode attention: one query row per sequence over its paged KV rows, flash-decoding style. A block
// takes up to 32 query heads that share one KV head; a sequence's attended positions are cut into `splits`
// chunks, each walked in tiles of 32 cache rows (a three-buffer cp.async ring in shared memory, so every head of
// the block reads each row once) into an unnormalised partial per (sequence, split, head):
//     O_c = vmul * sum_j exp(s_j - m) v_j,  (m, l = sum_j exp(s_j - m))   (m = -inf, l = 0: an empty split)
// and the partials of a (sequence, head) are merged in split order (merge_ml / merge_o / merge_finish: an
// online merge, the optional attention sink, 1 / L). Two modes, the same bits for the same `splits` and
// `min_chunk` (the launcher picks both):
//   split: `mla_decode_partial[_fp8]`, `gqa_decode_partial[_fp8]`, grid (ceil(splits / G), head blocks,
//     sequences), a block taking G consecutive splits in turn (G = 1: one split a block), writing
//     ws_o[s][c][h][0:dv] = O_c and ws_ml[s][c][h][0:2] = (m, l) (f32) at each one's last tile; then
//     `attn_combine`, grid (heads, sequences), merges them into out. A partial is the same whichever block
//     computes it, so G (the launcher's, for the batch) moves no bit.
//   walk: `mla_decode_walk[_fp8]`, `gqa_decode_walk[_fp8]`, grid (1, head blocks, sequences): a block walks
//     all the splits of its sequence in order with the same per-split code, merges each into a running
//     (M, L, O) in registers and writes out itself. No workspace, and one set of fixed costs (Q fragments,
//     pipeline fill, padding) per block instead of per split: for large batches.
//
// Chunking: a sequence attends n positions (dense: its last min(seq_len, window) rows, or all seq_len when
// window == 0; DSA: the sel_stride entries of its `sel` row, -1 / out-of-range entries masked).
// Split c covers positions [c*chunk, min(n, (c+1)*chunk)) with chunk = roundup32(max(min_chunk, ceil(n/splits))).
// A row r of a sequence lives at slot kv_slot(table, r) = table[r / 16] * 16 + r % 16, seq_len and the table
// read from its metadata slab (meta.cuh).
//
// The math runs on bf16 tensor cores (mma.sync m16n8k16, f32 accumulation): S = Q K^T, with the head dim
// split over four warps per 16 heads (Q fragments stay in registers) and summed in a fixed order; the
// probabilities P are split into bf16 hi + lo parts for P V, so P keeps ~16 mantissa bits.
//
// Widths: q, the cache rows and the outputs keep their real widths dk / dv (multiples of 8; 16 for fp8
// caches); the shared-memory tiles are padded to the 64-column mma tile with zeros written once per block
// (cp.async and the fp8 conversion only ever write the real columns), and Q fragments past dk load as zeros,
// so the dot products are exact and no extra byte is stored or read from global memory.
//
// KV formats: bf16 rows; fp8 e4m3 rows times a per-tensor kv_scale (`gqa_decode_*_fp8`); and the
// blocked fp8 row of `mla_decode_*_fp8` (DeepSeek-V4's cache, kv_cache.cu): columns [0, nope) as e4m3 in
// blocks of 64 with a UE8M0 scale each, columns [nope, dk) bf16, converted exactly to bf16 in shared memory.
#include "common.cuh"
#include "meta.cuh"

#define TILE 32          // cache rows per shared-memory tile
#define HEADS 32         // query heads per block (two groups of 16 = the mma M dimension)
#define THREADS 256      // 8 warps: (head group 0..1) x (quarter 0..3)
#define SP_STRIDE 40     // f32 row stride of the S partials (bank-conflict-free float2 stores)
#define P_STRIDE 40      // bf16 row stride of P (conflict-free ldmatrix rows)
#define MAX_KSTEPS 9     // dk <= 576: a quarter of the head dim is <= 9 k-steps of 16
#define MAX_NTILES 16    // dv <= 512: a quarter of the value dim is <= 16 n-tiles of 8
#define MAX_SPLITS 64

__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }

// 16-byte async copy; src_bytes 0 zero-fills the destination (masked rows must hold finite zeros).
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, u32 src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldsm_x4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
// Two floats -> bf16x2 (x in the low half: the lower column / row of an mma fragment pair).
__device__ __forceinline__ u32 pack_bf16(float x, float y) {
    return (u32)__bfloat16_as_ushort(f2bf(x)) | ((u32)__bfloat16_as_ushort(f2bf(y)) << 16);
}
// d += a (16x16 bf16, row) * b (16x8 bf16, col), f32 accumulators.
__device__ __forceinline__ void mma_bf16(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Attended positions of sequence s: n, the lowest allowed row lo, seq_len.
struct SeqSpan { i32 seq_len, lo, n; const i32* table; };

__device__ __forceinline__ SeqSpan seq_span(const u8* meta, u32 meta_stride, u32 s, u32 window, bool dsa,
                                            u32 sel_stride) {
    const u8* slab = meta_slab(meta, meta_stride, s);
    SeqSpan r;
    r.seq_len = slab_seq_len(slab);
    r.table = slab_table(slab);
    r.lo = (window > 0 && r.seq_len > (i32)window) ? r.seq_len - (i32)window : 0;
    r.n = dsa ? (i32)sel_stride : max(r.seq_len - r.lo, 0);
    return r;
}

struct AttnArgs {
    const __nv_bfloat16* q; u64 q_seq_stride, q_head_stride;  // elements
    const u8* kc; const u8* vc;   // vc == nullptr: V is the first dv columns of the K row (MLA, V4)
    u64 row_bytes, col_bytes;     // cache row size; byte offset of this block's KV head inside a row
    const u8* meta; u32 meta_stride;
    float* ws_o; float* ws_ml;    // split mode: the partials
    const float* sink; __nv_bfloat16* out;   // walk mode: f32 [heads] or null; bf16 [num_seqs, heads, dv]
    u32 heads, h0, h_end, dk, dv;
    float smul, vmul;             // score multiplier (scale * kv_scale), value multiplier (kv_scale)
    u32 window; const i32* sel; u32 sel_stride, splits, min_chunk;
    u32 nope;                     // KV_FP8_BLOCK: columns [0, nope) are the e4m3 blocks (kv_fp8_block_layout)
};

enum { KV_BF16 = 0, KV_FP8 = 1, KV_FP8_BLOCK = 2 };

// The merge of a (sequence, head)'s split partials, shared by attn_combine and the walk kernels. Its arithmetic
// is _rn intrinsics (never contracted into an fma) around fmaxf / expf, so the two round identically. From
// (M, L, O) = (-inf, 0, 0), for each split c in order with m_c > -inf:
//     M' = max(M, m_c), a = exp(M - M') (0 for M = -inf), b = exp(m_c - M'), L = L a + l_c b, O = O a + O_c b.
struct MergeAB { float a, b; };

// (a, b) of a split with max mc, given M before it and Mn = max(M, mc)
__device__ __forceinline__ MergeAB merge_ab(float M, float Mn, float mc) {
    MergeAB w;
    w.a = M == -INFINITY ? 0.f : expf(__fsub_rn(M, Mn));
    w.b = expf(__fsub_rn(mc, Mn));
    return w;
}

__device__ __forceinline__ float merge_l(float L, MergeAB w, float lc) { return __fmaf_rn(L, w.a, __fmul_rn(lc, w.b)); }

__device__ __forceinline__ MergeAB merge_ml(float& M, float& L, float mc, float lc) {
    const float Mn = fmaxf(M, mc);
    const MergeAB w = merge_ab(M, Mn, mc);
    L = merge_l(L, w, lc);
    M = Mn;
    return w;
}

__device__ __forceinline__ float merge_o(float O, MergeAB w, float Oc) { return __fmaf_rn(O, w.a, __fmul_rn(Oc, w.b)); }

// The sink (exp(sink_h) joins the denominator: M' = max(M, sink_h), a = exp(M - M'), L = L a + exp(sink_h - M'),
// O = O a) and the normalisation: returns (a, inv) for merge_out; inv = 0 where nothing was attended (L = 0).
__device__ __forceinline__ float2 merge_finish(float M, float L, const float* sink, u32 h) {
    float a = 1.f;
    if (sink != nullptr) {
        const float sk = sink[h], Mn = fmaxf(M, sk);
        if (Mn != -INFINITY) {
            a = M == -INFINITY ? 0.f : expf(__fsub_rn(M, Mn));
            L = __fmaf_rn(L, a, expf(__fsub_rn(sk, Mn)));
        }
    }
    return make_float2(a, L > 0.f ? __frcp_rn(L) : 0.f);
}

__device__ __forceinline__ __nv_bfloat16 merge_out(float O, float2 f) {
    return f2bf(__fmul_rn(__fmul_rn(O, f.x), f.y));
}

__device__ __forceinline__ u32 pad64(u32 x) { return (x + 63) / 64 * 64; }

// Shared memory (bytes; the launcher's _smem_bytes mirrors this), with dkp / dvp = dk / dv rounded up to 64:
//   Sp  f32 [4][32][SP_STRIDE]                 S partials of the four head-dim quarters
//   K   bf16 [NBF][32][dkp + 8]                NBF = 3 (bf16 caches: the copy ring) or 1 (fp8: converted)
//   V   bf16 [NBF][32][dvp + 8]                only with a separate V cache
//   stage u8 [3][32][stage_row]                fp8 only: raw rows landing from cp.async (dk (+ dv) bytes, or
//                                              the blocked row's row_bytes)
//   Phi, Plo bf16 [32][P_STRIDE]; alpha f32 [32]; rowok i32 [3][32]; ml f32 [32][2] (walk: a split's (m, l))
//   Qsm bf16 [32][dkp + 8]                     the walk kernels at fixed widths only (attend's QS)
// Columns [dk, dkp) of K and [dv, dvp) of V are zeroed once and never written again.
//
// Split c covers positions [c*chunk, min(n, (c+1)*chunk)); chunk is a whole number of tiles, so a tile never
// straddles two splits and the walk is the same tile sequence as the splits' one after another, the partial
// (o, m_run, l_run) restarting from zero at each split's first tile. The copy ring runs across the
// split boundaries.
// SEPV: a separate V cache (GQA; MLA's V is the first dv columns of K and vmul is 1). DK, DV > 0: the widths
// as compile-time constants (the families' real ones), so every shared-memory address is a base plus an
// immediate and the copy loops unroll; 0: dk / dv at run time. Same arithmetic, same bits either way.
template <int KVF, bool WALK, bool SEPV, int DK, int DV>
__device__ __forceinline__ void attend(const AttnArgs& a) {
    extern __shared__ __align__(16) u8 smem[];
    const u32 tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
    const u32 s = blockIdx.z;
    const SeqSpan sp = seq_span(a.meta, a.meta_stride, s, a.window, a.sel != nullptr, a.sel_stride);
    const u32 per = (u32)((sp.n + (i32)a.splits - 1) / (i32)a.splits);
    const u32 chunk = (max(per, a.min_chunk) + TILE - 1) / TILE * TILE;
    // split mode: the G = ceil(splits / gridDim.x) consecutive splits c0 .. c0 + G - 1 (G = 1: one split a
    // block), each partial written at its last tile; walk: every split, i.e. all n positions
    const u32 G = WALK ? a.splits : (a.splits + gridDim.x - 1) / gridDim.x, c0 = WALK ? 0u : blockIdx.x * G;
    const i32 p_begin = WALK ? 0 : (i32)min((u64)c0 * chunk, (u64)sp.n);
    const i32 p_end = WALK ? sp.n : (i32)min((u64)p_begin + (u64)G * chunk, (u64)sp.n);
    const u64 part0 = (u64)s * a.splits * a.heads;  // split mode: (s, split 0, head 0) partial index

    if (!WALK) {  // this block's splits past the sequence's positions are empty: the combine skips them
        for (u32 c = c0 + (u32)(p_end - p_begin + (i32)chunk - 1) / chunk; c < min(c0 + G, a.splits); ++c)
            if (tid < HEADS && a.h0 + tid < a.h_end)
                *(float2*)(a.ws_ml + (part0 + (u64)c * a.heads + a.h0 + tid) * 2) = make_float2(-INFINITY, 0.f);
        if (p_begin >= p_end) return;
    }

    constexpr bool RAW = KVF != KV_BF16;   // rows land raw in `stage` and are converted into K / V
    auto vscale = [&](float x) { return SEPV ? __fmul_rn(x, a.vmul) : x; };   // O_c = o * vmul
    const u32 dk = DK > 0 ? (u32)DK : a.dk, dv = DV > 0 ? (u32)DV : a.dv;
    const u32 dkp = pad64(dk), dvp = pad64(dv);
    const u32 NBF = RAW ? 1 : 3, ks_ = dkp + 8, vs_ = dvp + 8, esz = KVF == KV_BF16 ? 2 : 1;
    float* Sp = (float*)smem;
    __nv_bfloat16* Kt = (__nv_bfloat16*)(smem + 4 * HEADS * SP_STRIDE * 4);
    __nv_bfloat16* Vt = Kt + NBF * TILE * ks_;
    u8* stage = (u8*)(Vt + (SEPV ? NBF * TILE * vs_ : 0));
    const u32 stage_row = KVF == KV_FP8_BLOCK ? (u32)a.row_bytes : dk + (SEPV ? dv : 0);
    __nv_bfloat16* Phi = (__nv_bfloat16*)(stage + (RAW ? 3 * TILE * stage_row : 0));
    __nv_bfloat16* Plo = Phi + HEADS * P_STRIDE;
    float* alpha_s = (float*)(Plo + HEADS * P_STRIDE);
    i32* rowok = (i32*)(alpha_s + HEADS);
    float2* ml_s = (float2*)(rowok + 3 * TILE);
    // the walk at fixed widths keeps Q in shared memory (a budget of 255 registers leaves no room for its
    // fragments beside o, O and the unrolled copies): Qsm bf16 [32 heads][dkp + 8], zero past dk / h_end
    constexpr bool QS = WALK && DK > 0;
    __nv_bfloat16* Qsm = (__nv_bfloat16*)(ml_s + HEADS);

    // The tile padding: zero once; the loads and conversions below write only the real columns.
    const __nv_bfloat16 zero = f2bf(0.f);
    if (dkp > dk)
        for (u32 i = tid; i < NBF * TILE * (dkp - dk); i += THREADS)
            Kt[(i / (dkp - dk)) * ks_ + dk + i % (dkp - dk)] = zero;
    if (SEPV && dvp > dv)
        for (u32 i = tid; i < NBF * TILE * (dvp - dv); i += THREADS)
            Vt[(i / (dvp - dv)) * vs_ + dv + i % (dvp - dv)] = zero;

    // Tile loader: thread -> (row = tid / 8, 16-byte chunks tid % 8, +8, ...) so 8 lanes copy 128 contiguous bytes.
    // Its global reads are pipelined in registers so no copy waits on them: a tile's logical rows (DSA: its sel
    // entries) are read two tiles before its copies are issued, their block-table entries one tile before.
    const u32 lrow = tid >> 3, lsub = tid & 7;
    auto row_of = [&](u32 tt) -> i32 {   // position p_begin + tt*TILE + lrow -> its row, or -1 (masked)
        const i32 p = p_begin + (i32)(tt * TILE + lrow);
        if (p >= p_end) return -1;
        return a.sel ? a.sel[(u64)s * a.sel_stride + p] : sp.lo + p;
    };
    auto entry_of = [&](i32& r) -> i32 {  // masks an out-of-range row; its block-table entry (0 if masked)
        if (r < sp.lo || r >= sp.seq_len) r = -1;
        return r >= 0 ? sp.table[r >> KV_BLOCK_SHIFT] : 0;
    };
    // per thread: its row's shared-memory addresses in buffer 0 (a buffer adds a constant), its chunk's offset
    const u32 kdst0 = RAW ? smem_addr(stage + lrow * stage_row + 16 * lsub) : smem_addr(Kt + lrow * ks_ + 8 * lsub);
    const u32 vdst0 = RAW ? smem_addr(stage + lrow * stage_row + dk + 16 * lsub) : smem_addr(Vt + lrow * vs_ + 8 * lsub);
    const u32 kbuf_bytes = RAW ? TILE * stage_row : TILE * ks_ * 2, vbuf_bytes = RAW ? TILE * stage_row : TILE * vs_ * 2;
    auto load_tile = [&](u32 buf, i32 r, i32 entry) {
        if (lsub == 0) rowok[buf * TILE + lrow] = r >= 0;
        u64 off = 16 * lsub;
        if (r >= 0) off += kv_slot_at(entry, r) * a.row_bytes + a.col_bytes;
        const u32 nb = r >= 0 ? 16 : 0;
        const u32 kch = KVF == KV_FP8_BLOCK ? stage_row / 16 : dk * esz / 16, vch = dv * esz / 16;
        // copy j: chunk lsub + 8 j, 128 j bytes on from the thread's first (source and destination alike)
        const u8* ksrc = a.kc + off;
        const u32 kdst = kdst0 + buf * kbuf_bytes;
#pragma unroll
        for (u32 j = 0; j < (kch + 7) / 8; ++j) {
            if (lsub + 8 * j >= kch) break;
            cp_async16(kdst + 128 * j, ksrc + 128 * j, nb);
        }
        if (SEPV) {
            const u8* vsrc = a.vc + off;
            const u32 vdst = vdst0 + buf * vbuf_bytes;
#pragma unroll
            for (u32 j = 0; j < (vch + 7) / 8; ++j) {
                if (lsub + 8 * j >= vch) break;
                cp_async16(vdst + 128 * j, vsrc + 128 * j, nb);
            }
        }
    };

    // Q fragments (mma A operand): warp (hg, qt) owns heads hg*16 .. +15 and head-dim quarter qt; columns
    // past dk are zeros (dk is even, so a pair is wholly inside or outside).
    const u32 hg = warp >> 2, qt = warp & 3, KS = dkp / 64;
    const u32 hA = a.h0 + hg * 16 + g, hB = hA + 8;
    // GQA: a head group wholly past h_end (Qwen3-Next's groups of 8 heads) skips its mmas; its Sp rows, P and
    // merges are then garbage that only its own heads, never stored, read. (MLA blocks are full but the last.)
    const bool live = !SEPV || a.h0 + hg * 16 < a.h_end;
    // Inside a tile, S -> softmax -> P V never reads across head groups (Sp, P, alpha and ml rows are the
    // group's own heads: softmax thread tid / 8 is a head of warp tid / 32's group), so with bf16 caches those two
    // barriers hold only the group's four warps (named barrier 1 + hg: V3 and GLM-5 attention 1-2% faster on an
    // H200, same bits). The tile's first barrier (the ring) stays block-wide; so do the fp8 kernels' barriers
    // (with named ones V4 measured 1-3% slower on an H100).
    auto hg_sync = [&]() {
        if constexpr (RAW) __syncthreads();
        else asm volatile("bar.sync %0, %1;\n" ::"r"(1u + hg), "n"(4 * 32) : "memory");
    };
    const __nv_bfloat16* qs = a.q + (u64)s * a.q_seq_stride;
    u32 qf[QS ? 1 : MAX_KSTEPS][4];
    if constexpr (QS) {   // all loads in flight at once; the first tile's barrier orders the stores before any read
        constexpr u32 W = (DK + 63) / 64 * 32, N = HEADS * W / THREADS;   // words per padded row, per thread
        static_assert(HEADS * W % THREADS == 0, "Qsm fill: whole rounds");
        u32 v[N];
#pragma unroll
        for (u32 j = 0; j < N; ++j) {
            const u32 i = tid + j * THREADS, hh = i / W, d = 2 * (i % W), h = a.h0 + hh;
            v[j] = h < a.h_end && d < dk ? *(const u32*)(qs + h * a.q_head_stride + d) : 0u;
        }
#pragma unroll
        for (u32 j = 0; j < N; ++j) {
            const u32 i = tid + j * THREADS;
            *(u32*)(Qsm + (i / W) * ks_ + 2 * (i % W)) = v[j];
        }
    } else {
#pragma unroll
        for (u32 ks = 0; ks < MAX_KSTEPS; ++ks) {
            const u32 d = (qt * KS + ks) * 16 + 2 * t4;
            const bool lo = ks < KS && d < dk, hi = ks < KS && d + 8 < dk;
            qf[ks][0] = lo && hA < a.h_end ? *(const u32*)(qs + hA * a.q_head_stride + d) : 0u;
            qf[ks][1] = lo && hB < a.h_end ? *(const u32*)(qs + hB * a.q_head_stride + d) : 0u;
            qf[ks][2] = hi && hA < a.h_end ? *(const u32*)(qs + hA * a.q_head_stride + d + 8) : 0u;
            qf[ks][3] = hi && hB < a.h_end ? *(const u32*)(qs + hB * a.q_head_stride + d + 8) : 0u;
        }
    }

    const u32 VW = dvp / 4, NTV = VW / 8;  // this warp's value columns [qt*VW, qt*VW + VW)
    float o[MAX_NTILES][4];
#pragma unroll
    for (u32 nt = 0; nt < MAX_NTILES; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.f;
    float m_run = -INFINITY, l_run = 0.f;   // softmax thread (head tid/8): replicated over its 8 lanes
    const u32 sh = tid >> 3, sq = tid & 7;  // softmax thread -> head sh, rows 4*sq .. 4*sq+3
    // walk: the running merge of heads hA (O[nt][0..1]) and hB (O[nt][2..3]), each thread its own copy of
    // (M, L), all computed alike from the same (m_c, l_c)
    float O[WALK ? MAX_NTILES : 1][4];
    float MA = -INFINITY, LA = 0.f, MB = -INFINITY, LB = 0.f;
    if constexpr (WALK) {
#pragma unroll
        for (u32 nt = 0; nt < MAX_NTILES; ++nt) O[nt][0] = O[nt][1] = O[nt][2] = O[nt][3] = 0.f;
    }

    // ldmatrix lane offsets: K (non-trans, rows = cache rows), P (A operand), V (trans, rows = cache rows).
    const u32 k_row = (lane & 7) + ((lane >> 4) << 3), k_col = ((lane >> 3) & 1) * 8;
    const u32 x_row = (lane & 7) + ((lane >> 3) & 1) * 8, x_col = (lane >> 4) * 8;
    // their shared-memory addresses in buffer 0 at the warp's first k-step / value column (bytes; a buffer, a
    // k-step, an n-tile pair add constants): K and Q for S, P and V for P V
    const u32 k_lane = smem_addr(Kt + k_row * ks_ + qt * KS * 16 + k_col);
    const u32 q_lane = smem_addr(Qsm + (hg * 16 + x_row) * ks_ + qt * KS * 16 + x_col);
    const u32 p_lane = smem_addr(Phi + (hg * 16 + x_row) * P_STRIDE + x_col);
    const u32 vstride = SEPV ? vs_ : ks_;
    const u32 v_lane = smem_addr((SEPV ? Vt : Kt) + x_row * vstride + qt * VW + x_col);

    // Three buffers, copies two tiles ahead: tile t + 2's copies are issued after tile t's first barrier, when
    // every thread is done with tile t - 1 (the buffer they overwrite), so a tile needs no closing barrier. One
    // commit group per tile (empty past the end), so wait_group 1 always means "tile t has landed".
    const u32 ntiles = p_end > p_begin ? (u32)(p_end - p_begin + TILE - 1) / TILE : 0u;
    {
        i32 r0 = row_of(0), r1 = row_of(1);
        const i32 e0 = entry_of(r0), e1 = entry_of(r1);
        if (ntiles > 0) load_tile(0, r0, e0);
        cp_commit();
        if (ntiles > 1) load_tile(1, r1, e1);
        cp_commit();
    }
    i32 r_next = row_of(2), r_later = row_of(3);   // tile t + 2's row (entry read below), tile t + 3's
    i32 e_next = entry_of(r_next);
    const u32 split_tiles = chunk / TILE;
    u32 tin = 0;   // tile t's index inside its split (p_begin is a split's first position)
    u32 cur = c0;  // split mode: the split tile t belongs to
    u32 buf = 0, buf2 = 2;   // t % 3 and (t + 2) % 3
    for (u32 t = 0; t < ntiles; ++t, buf = buf == 2 ? 0 : buf + 1, buf2 = buf2 == 2 ? 0 : buf2 + 1) {
        const u32 bb = RAW ? 0 : buf;
        const bool split_first = tin == 0, split_end = tin + 1 == split_tiles || t + 1 == ntiles;
        tin = split_end ? 0 : tin + 1;
        cp_wait<1>();
        __syncthreads();
        if (t + 2 < ntiles) load_tile(buf2, r_next, e_next);
        cp_commit();
        r_next = r_later;
        e_next = entry_of(r_next);
        r_later = row_of(t + 4);
        if (KVF == KV_FP8) {  // e4m3 -> bf16 is exact; kv_scale is applied through smul / vmul
            const u32 per_row = stage_row / 16;
            for (u32 i = tid; i < TILE * per_row; i += THREADS) {
                const u32 row = i / per_row, col = (i % per_row) * 16;
                const uint4 raw = *(const uint4*)(stage + (buf * TILE + row) * stage_row + col);
                const u32 src[4] = {raw.x, raw.y, raw.z, raw.w};
                u32 w[8];
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    const u32 word = src[e >> 1] >> (16 * (e & 1));
                    w[e] = pack_bf16(fp8_to_f((u8)(word & 0xFF)), fp8_to_f((u8)(word >> 8)));
                }
                __nv_bfloat16* dst = col < dk ? Kt + row * ks_ + col : Vt + row * vs_ + (col - dk);
                *(uint4*)dst = make_uint4(w[0], w[1], w[2], w[3]);
                *(uint4*)(dst + 8) = make_uint4(w[4], w[5], w[6], w[7]);
            }
            __syncthreads();
        }
        if (KVF == KV_FP8_BLOCK) {  // e4m3 x 2^k and the bf16 RoPE columns -> bf16, both exact
            const u32 cpr = dk / 8, rope_off = kv_fp8_block_rope_off(a.nope);
            const u32 scale_off = kv_fp8_block_scale_off(a.nope, dk);
            for (u32 i = tid; i < TILE * cpr; i += THREADS) {
                const u32 row = i / cpr, c0 = (i % cpr) * 8;
                const u8* sr = stage + (buf * TILE + row) * stage_row;
                __nv_bfloat16* dst = Kt + row * ks_ + c0;
                if (c0 + 8 <= a.nope) {          // 8 e4m3 codes of one 64-block
                    const uint2 raw = *(const uint2*)(sr + c0);
                    const float sc = e8m0_to_f(sr[scale_off + c0 / 64]);
                    const u32 src[2] = {raw.x, raw.y};
                    u32 w[4];
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const u32 word = src[e >> 1] >> (16 * (e & 1));
                        w[e] = pack_bf16(fp8_to_f((u8)(word & 0xFF)) * sc, fp8_to_f((u8)(word >> 8)) * sc);
                    }
                    *(uint4*)dst = make_uint4(w[0], w[1], w[2], w[3]);
                } else if (c0 >= a.nope && (c0 - a.nope) % 8 == 0) {   // 8 bf16 RoPE columns
                    *(uint4*)dst = *(const uint4*)(sr + rope_off + 2 * (c0 - a.nope));
                } else {                          // a chunk across the nope / RoPE boundary
                    for (u32 e = 0; e < 8; ++e) {
                        const u32 col = c0 + e;
                        dst[e] = col < a.nope ? f2bf(fp8_to_f(sr[col]) * e8m0_to_f(sr[scale_off + col / 64]))
                                              : *(const __nv_bfloat16*)(sr + rope_off + 2 * (col - a.nope));
                    }
                }
            }
            __syncthreads();
        }

        // S partial = Q[16 heads, quarter] . K[32 rows, quarter]^T -> Sp[qt]
        if (live) {
            const u32 kb = k_lane + bb * (TILE * ks_ * 2);
            float sacc[4][4];
#pragma unroll
            for (u32 nt = 0; nt < 4; ++nt) sacc[nt][0] = sacc[nt][1] = sacc[nt][2] = sacc[nt][3] = 0.f;
#pragma unroll
            for (u32 ks = 0; ks < MAX_KSTEPS; ++ks) {
                if (ks < KS) {
                    u32 qa[4];
                    if constexpr (QS) ldsm_x4(qa, q_lane + ks * 32);
                    const u32 (&qv)[4] = QS ? qa : qf[QS ? 0 : ks];
#pragma unroll
                    for (u32 np = 0; np < 2; ++np) {
                        u32 b[4];
                        ldsm_x4(b, kb + (np * 16 * ks_ + ks * 16) * 2);
                        mma_bf16(sacc[2 * np], qv, b[0], b[1]);
                        mma_bf16(sacc[2 * np + 1], qv, b[2], b[3]);
                    }
                }
            }
            float* sp_q = Sp + qt * HEADS * SP_STRIDE + (hg * 16 + g) * SP_STRIDE + 2 * t4;
#pragma unroll
            for (u32 nt = 0; nt < 4; ++nt) {
                *(float2*)(sp_q + nt * 8) = make_float2(sacc[nt][0], sacc[nt][1]);
                *(float2*)(sp_q + 8 * SP_STRIDE + nt * 8) = make_float2(sacc[nt][2], sacc[nt][3]);
            }
        }
        hg_sync();

        // Online softmax: sum the quarters in a fixed order, mask, update (m, l), write P = hi + lo.
        {
            float sv[4];
            const float* sp0 = Sp + sh * SP_STRIDE + 4 * sq;
            const float4 x0 = *(const float4*)sp0, x1 = *(const float4*)(sp0 + HEADS * SP_STRIDE),
                         x2 = *(const float4*)(sp0 + 2 * HEADS * SP_STRIDE),
                         x3 = *(const float4*)(sp0 + 3 * HEADS * SP_STRIDE);
            // _rn intrinsics: nothing contracts into an fma, so split and walk kernels round alike
            sv[0] = __fmul_rn(__fadd_rn(__fadd_rn(__fadd_rn(x0.x, x1.x), x2.x), x3.x), a.smul);
            sv[1] = __fmul_rn(__fadd_rn(__fadd_rn(__fadd_rn(x0.y, x1.y), x2.y), x3.y), a.smul);
            sv[2] = __fmul_rn(__fadd_rn(__fadd_rn(__fadd_rn(x0.z, x1.z), x2.z), x3.z), a.smul);
            sv[3] = __fmul_rn(__fadd_rn(__fadd_rn(__fadd_rn(x0.w, x1.w), x2.w), x3.w), a.smul);
            float tmax = -INFINITY;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                if (!rowok[buf * TILE + 4 * sq + i]) sv[i] = -INFINITY;
                tmax = fmaxf(tmax, sv[i]);
            }
#pragma unroll
            for (int o_ = 1; o_ < 8; o_ <<= 1) tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, o_));
            const float m_new = fmaxf(m_run, tmax), mu = m_new == -INFINITY ? 0.f : m_new;
            const float alpha = expf(__fsub_rn(m_run, mu));
            float psum = 0.f, hi[4], lo[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const float p = expf(__fsub_rn(sv[i], mu));
                psum = __fadd_rn(psum, p);
                hi[i] = bf2f(f2bf(p));
                lo[i] = __fsub_rn(p, hi[i]);
            }
#pragma unroll
            for (int o_ = 1; o_ < 8; o_ <<= 1) psum = __fadd_rn(psum, __shfl_xor_sync(0xffffffffu, psum, o_));
            l_run = __fmaf_rn(l_run, alpha, psum);
            m_run = m_new;
            if (sq == 0) alpha_s[sh] = alpha;
            if constexpr (WALK) {
                if (split_end && sq == 0) ml_s[sh] = make_float2(m_run, l_run);
            }
            *(uint2*)(Phi + sh * P_STRIDE + 4 * sq) = make_uint2(pack_bf16(hi[0], hi[1]), pack_bf16(hi[2], hi[3]));
            *(uint2*)(Plo + sh * P_STRIDE + 4 * sq) = make_uint2(pack_bf16(lo[0], lo[1]), pack_bf16(lo[2], lo[3]));
        }
        hg_sync();

        // O[16 heads, this warp's columns] = alpha * O + (Phi + Plo) . V
        if (live) {
            const u32 vb = v_lane + bb * (TILE * vstride * 2);
            const float aA = alpha_s[hg * 16 + g], aB = alpha_s[hg * 16 + g + 8];
            // a split's first tile finds o = +0 (and alpha = 0: m_run was -inf), and once the running max settles
            // alpha is 1 for every head of the warp: o * alpha == o in both cases, so skip it
            if (!split_first && !__all_sync(0xffffffffu, aA == 1.f && aB == 1.f)) {
#pragma unroll
                for (u32 nt = 0; nt < MAX_NTILES; ++nt) {
                    o[nt][0] = __fmul_rn(o[nt][0], aA); o[nt][1] = __fmul_rn(o[nt][1], aA);
                    o[nt][2] = __fmul_rn(o[nt][2], aB); o[nt][3] = __fmul_rn(o[nt][3], aB);
                }
            }
#pragma unroll
            for (u32 kk = 0; kk < 2; ++kk) {
                u32 ph[4], pl[4];
                ldsm_x4(ph, p_lane + kk * 32);
                ldsm_x4(pl, p_lane + (HEADS * P_STRIDE + kk * 16) * 2);   // Plo = Phi + HEADS * P_STRIDE
#pragma unroll
                for (u32 np = 0; np < MAX_NTILES / 2; ++np) {
                    if (2 * np < NTV) {
                        u32 b[4];
                        ldsm_x4_t(b, vb + (kk * 16 * vstride + np * 16) * 2);
                        mma_bf16(o[2 * np], ph, b[0], b[1]);
                        mma_bf16(o[2 * np], pl, b[0], b[1]);
                        mma_bf16(o[2 * np + 1], ph, b[2], b[3]);
                        mma_bf16(o[2 * np + 1], pl, b[2], b[3]);
                    }
                }
            }
        }
        if constexpr (WALK) {
            // the split's partial joins the running merge (ml_s was written before the last barrier); O_c is
            // what the split pass stores, o * vmul
            if (split_end) {
                const float2 cA = ml_s[hg * 16 + g], cB = ml_s[hg * 16 + g + 8];
                if (cA.x != -INFINITY) {
                    const MergeAB w = merge_ml(MA, LA, cA.x, cA.y);
#pragma unroll
                    for (u32 nt = 0; nt < MAX_NTILES; ++nt) {
                        O[nt][0] = merge_o(O[nt][0], w, vscale(o[nt][0]));
                        O[nt][1] = merge_o(O[nt][1], w, vscale(o[nt][1]));
                    }
                }
                if (cB.x != -INFINITY) {
                    const MergeAB w = merge_ml(MB, LB, cB.x, cB.y);
#pragma unroll
                    for (u32 nt = 0; nt < MAX_NTILES; ++nt) {
                        O[nt][2] = merge_o(O[nt][2], w, vscale(o[nt][2]));
                        O[nt][3] = merge_o(O[nt][3], w, vscale(o[nt][3]));
                    }
                }
            }
        } else if (split_end) {   // split cur's partial O_c = o * vmul and (m, l)
            const u64 part = part0 + (u64)cur * a.heads;
#pragma unroll
            for (u32 nt = 0; nt < MAX_NTILES; ++nt) {
                const u32 col = qt * VW + nt * 8 + 2 * t4;
                if (nt < NTV && col < dv) {   // the padded value columns are not stored
                    if (hA < a.h_end)
                        *(float2*)(a.ws_o + (part + hA) * dv + col) =
                            make_float2(vscale(o[nt][0]), vscale(o[nt][1]));
                    if (hB < a.h_end)
                        *(float2*)(a.ws_o + (part + hB) * dv + col) =
                            make_float2(vscale(o[nt][2]), vscale(o[nt][3]));
                }
            }
            if (sq == 0 && a.h0 + sh < a.h_end)
                *(float2*)(a.ws_ml + (part + a.h0 + sh) * 2) = make_float2(m_run, l_run);
            ++cur;
        }
        if (split_end) {   // the next split's partial starts from zero, in both modes
#pragma unroll
            for (u32 nt = 0; nt < MAX_NTILES; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.f;
            m_run = -INFINITY;
            l_run = 0.f;
        }
    }

    if constexpr (WALK) {  // the sink and 1 / L, as attn_combine; bf16 out [s][h][0:dv]
        const float2 fA = hA < a.h_end ? merge_finish(MA, LA, a.sink, hA) : make_float2(0.f, 0.f);
        const float2 fB = hB < a.h_end ? merge_finish(MB, LB, a.sink, hB) : make_float2(0.f, 0.f);
#pragma unroll
        for (u32 nt = 0; nt < MAX_NTILES; ++nt) {
            const u32 col = qt * VW + nt * 8 + 2 * t4;
            if (nt < NTV && col < dv) {
                if (hA < a.h_end) {
                    __nv_bfloat16* d = a.out + ((u64)s * a.heads + hA) * dv + col;
                    d[0] = merge_out(O[nt][0], fA);
                    d[1] = merge_out(O[nt][1], fA);
                }
                if (hB < a.h_end) {
                    __nv_bfloat16* d = a.out + ((u64)s * a.heads + hB) * dv + col;
                    d[0] = merge_out(O[nt][2], fB);
                    d[1] = merge_out(O[nt][3], fB);
                }
            }
        }
    }
}

// MLA / V4 / DSA: one KV head; V = the first v_width columns of each row. q bf16 [num_seqs, heads, row_width];
// grid (ceil(splits / G), ceil(heads / 32), num_seqs) for the partial kernels, (1, ceil(heads / 32), num_seqs)
// for the walk kernels. `_partial` / `_walk`: rows of row_width bf16; `_fp8`: blocked fp8 rows of
// kv_fp8_block_row_bytes(nope, row_width) bytes.
template <int KVF, bool WALK>
__device__ __forceinline__ void mla_entry(const __nv_bfloat16* q, const u8* cache, const u8* meta, u32 meta_stride,
                                          float* ws_o, float* ws_ml, const float* sink, __nv_bfloat16* out,
                                          u32 heads, u32 row_width, u32 v_width, float scale, u32 window,
                                          const i32* sel, u32 sel_stride, u32 splits, u32 min_chunk, u32 nope) {
    AttnArgs a;
    a.q = q; a.q_seq_stride = (u64)heads * row_width; a.q_head_stride = row_width;
    a.kc = cache; a.vc = nullptr;
    a.row_bytes = KVF == KV_FP8_BLOCK ? (u64)kv_fp8_block_row_bytes(nope, row_width) : (u64)row_width * 2;
    a.col_bytes = 0;
    a.meta = meta; a.meta_stride = meta_stride; a.ws_o = ws_o; a.ws_ml = ws_ml; a.sink = sink; a.out = out;
    a.heads = heads; a.h0 = blockIdx.y * HEADS; a.h_end = min(heads, a.h0 + HEADS);
    a.dk = row_width; a.dv = v_width; a.smul = scale; a.vmul = 1.f;
    a.window = window; a.sel = sel; a.sel_stride = sel_stride; a.splits = splits; a.min_chunk = min_chunk;
    a.nope = nope;
    // the families' widths compiled as constants: V3 / GLM-5's 576 / 512 bf16 rows, V4's 512 / 512 fp8 rows
    constexpr int RW = KVF == KV_FP8_BLOCK ? 512 : 576;
    if (row_width == RW && v_width == 512) attend<KVF, WALK, false, RW, 512>(a);
    else attend<KVF, WALK, false, 0, 0>(a);
}

extern "C" __global__ __launch_bounds__(THREADS, 1) void
mla_decode_partial(const __nv_bfloat16* q, const u8* cache, const u8* meta, u32 meta_stride, float* ws_o,
                   float* ws_ml, u32 num_seqs, u32 heads, u32 row_width, u32 v_width, float scale, u32 window,
                   const i32* sel, u32 sel_stride, u32 splits, u32 min_chunk) {
    pdl_entry();
    mla_entry<KV_BF16, false>(q, cache, meta, meta_stride, ws_o, ws_ml, nullptr, nullptr, heads, row_width, v_width,
                              scale, window, sel, sel_stride, splits, min_chunk, 0);
}

extern "C" __global__ __launch_bounds__(THREADS, 1) void
mla_decode_partial_fp8(const __nv_bfloat16* q, const u8* cache, const u8* meta, u32 meta_stride, float* ws_o,
                       float* ws_ml, u32 num_seqs, u32 heads, u32 row_width, u32 v_width, float scale, u32 window,
                       const i32* sel, u32 sel_stride, u32 splits, u32 min_chunk, u32 nope) {
    pdl_entry();
    mla_entry<KV_FP8_BLOCK, false>(q, cache, meta, meta_stride, ws_o, ws_ml, nullptr, nullptr, heads, row_width,
                                   v_width, scale, window, sel, sel_stride, splits, min_chunk, nope);
}

// sink: f32 [heads] or null; out: bf16 [num_seqs, heads, v_width].
extern "C" __global__ __launch_bounds__(THREADS, 1) void
mla_decode_walk(const __nv_bfloat16* q, const u8* cache, const u8* meta, u32 meta_stride, const float* sink,
                __nv_bfloat16* out, u32 num_seqs, u32 heads, u32 row_width, u32 v_width, float scale, u32 window,
                const i32* sel, u32 sel_stride, u32 splits, u32 min_chunk) {
    pdl_entry();
    mla_entry<KV_BF16, true>(q, cache, meta, meta_stride, nullptr, nullptr, sink, out, heads, row_width, v_width,
                             scale, window, sel, sel_stride, splits, min_chunk, 0);
}

extern "C" __global__ __launch_bounds__(THREADS, 1) void
mla_decode_walk_fp8(const __nv_bfloat16* q, const u8* cache, const u8* meta, u32 meta_stride, const float* sink,
                    __nv_bfloat16* out, u32 num_seqs, u32 heads, u32 row_width, u32 v_width, float scale,
                    u32 window, const i32* sel, u32 sel_stride, u32 splits, u32 min_chunk, u32 nope) {
    pdl_entry();
    mla_entry<KV_FP8_BLOCK, true>(q, cache, meta, meta_stride, nullptr, nullptr, sink, out, heads, row_width,
                                  v_width, scale, window, sel, sel_stride, splits, min_chunk, nope);
}

// Gated-GQA: K and V caches with rows of kv_heads * head_dim; q head h reads KV head h / (q_heads / kv_heads).
// A block takes min(32, group) q heads of one KV head; grid (ceil(splits / G), q_heads / that, num_seqs) for the
// partial kernels, (1, q_heads / that, num_seqs) for the walk kernels. No sink.
template <int KVF, bool WALK>
__device__ __forceinline__ void gqa_entry(const __nv_bfloat16* q, u32 q_row_stride, const u8* k_cache,
                                          const u8* v_cache, const u8* meta, u32 meta_stride, float* ws_o,
                                          float* ws_ml, __nv_bfloat16* out, u32 q_heads, u32 kv_heads,
                                          u32 head_dim, float scale, float kv_scale, u32 splits, u32 min_chunk) {
    const u32 group = q_heads / kv_heads, hpb = min(group, (u32)HEADS), esz = KVF == KV_FP8 ? 1 : 2;
    AttnArgs a;
    a.q = q; a.q_seq_stride = q_row_stride; a.q_head_stride = head_dim;
    a.kc = k_cache; a.vc = v_cache;
    a.row_bytes = (u64)kv_heads * head_dim * esz;
    a.h0 = blockIdx.y * hpb; a.h_end = a.h0 + hpb;
    a.col_bytes = (u64)(a.h0 / group) * head_dim * esz;
    a.meta = meta; a.meta_stride = meta_stride; a.ws_o = ws_o; a.ws_ml = ws_ml; a.sink = nullptr; a.out = out;
    a.heads = q_heads; a.dk = head_dim; a.dv = head_dim; a.smul = scale * kv_scale; a.vmul = kv_scale;
    a.window = 0; a.sel = nullptr; a.sel_stride = 0; a.splits = splits; a.min_chunk = min_chunk; a.nope = 0;
    if (head_dim == 256) attend<KVF, WALK, true, 256, 256>(a);   // Qwen3-Next's heads, compiled as constants
    else attend<KVF, WALK, true, 0, 0>(a);
}

extern "C" __global__ __launch_bounds__(THREADS, 1) void
gqa_decode_partial(const __nv_bfloat16* q, u32 q_row_stride, const u8* k_cache, const u8* v_cache,
                   const u8* meta, u32 meta_stride, float* ws_o, float* ws_ml, u32 num_seqs, u32 q_heads,
                   u32 kv_heads, u32 head_dim, float scale, float kv_scale, u32 splits, u32 min_chunk) {
    pdl_entry();
    gqa_entry<KV_BF16, false>(q, q_row_stride, k_cache, v_cache, meta, meta_stride, ws_o, ws_ml, nullptr, q_heads,
                              kv_heads, head_dim, scale, kv_scale, splits, min_chunk);
}

extern "C" __global__ __launch_bounds__(THREADS, 1) void
gqa_decode_partial_fp8(const __nv_bfloat16* q, u32 q_row_stride, const u8* k_cache, const u8* v_cache,
                       const u8* meta, u32 meta_stride, float* ws_o, float* ws_ml, u32 num_seqs, u32 q_heads,
                       u32 kv_heads, u32 head_dim, float scale, float kv_scale, u32 splits, u32 min_chunk) {
    pdl_entry();
    gqa_entry<KV_FP8, false>(q, q_row_stride, k_cache, v_cache, meta, meta_stride, ws_o, ws_ml, nullptr, q_heads,
                             kv_heads, head_dim, scale, kv_scale, splits, min_chunk);
}

// out: bf16 [num_seqs, q_heads, head_dim].
extern "C" __global__ __launch_bounds__(THREADS, 1) void
gqa_decode_walk(const __nv_bfloat16* q, u32 q_row_stride, const u8* k_cache, const u8* v_cache, const u8* meta,
                u32 meta_stride, __nv_bfloat16* out, u32 num_seqs, u32 q_heads, u32 kv_heads, u32 head_dim,
                float scale, float kv_scale, u32 splits, u32 min_chunk) {
    pdl_entry();
    gqa_entry<KV_BF16, true>(q, q_row_stride, k_cache, v_cache, meta, meta_stride, nullptr, nullptr, out, q_heads,
                             kv_heads, head_dim, scale, kv_scale, splits, min_chunk);
}

extern "C" __global__ __launch_bounds__(THREADS, 1) void
gqa_decode_walk_fp8(const __nv_bfloat16* q, u32 q_row_stride, const u8* k_cache, const u8* v_cache,
                    const u8* meta, u32 meta_stride, __nv_bfloat16* out, u32 num_seqs, u32 q_heads, u32 kv_heads,
                    u32 head_dim, float scale, float kv_scale, u32 splits, u32 min_chunk) {
    pdl_entry();
    gqa_entry<KV_FP8, true>(q, q_row_stride, k_cache, v_cache, meta, meta_stride, nullptr, nullptr, out, q_heads,
                            kv_heads, head_dim, scale, kv_scale, splits, min_chunk);
}

// out[s, h, :dv] = the merge of the splits' partials in split order (merge_ml / merge_o), then the sink and
// 1 / L (merge_finish): the walk kernels' arithmetic exactly. Splits with m_c == -inf (empty, or nothing in
// them attended) are skipped, so their O is never read. Nothing attended -> 0. grid (heads, num_seqs), 128
// threads: thread 0 runs the (M, L) recurrence once into shared memory, then each thread merges 4 columns.
// gate != NULL (Qwen3-Next): then out = bf16(out * sigmoid(gate[s * gate_row_stride + h * gate_head_stride + d])),
// sigmoid_gate_mul's arithmetic on the stored values.
extern "C" __global__ __launch_bounds__(128) void
attn_combine(const float* ws_o, const float* ws_ml, const float* sink, __nv_bfloat16* out, u32 num_seqs,
             u32 heads, u32 dv, u32 splits, const __nv_bfloat16* gate, u32 gate_row_stride, u32 gate_head_stride) {
    pdl_entry();
    __shared__ float2 ml[MAX_SPLITS];   // (m_c, l_c)
    __shared__ MergeAB ab[MAX_SPLITS];  // merge_ml's (a, b) of each live split
    __shared__ float2 ad[MAX_SPLITS];   // L's step: (a, l_c b) of a live split, (1, 0) of an empty one
    __shared__ bool live[MAX_SPLITS];
    __shared__ float2 fin;
    __shared__ u32 nsp;                 // 1 + the last live split: the loops below stop there
    const u32 h = blockIdx.x, s = blockIdx.y, tid = threadIdx.x;
    const u64 base = (u64)s * splits * heads + h;  // partial index of split 0; split c adds c * heads
    for (u32 c = tid; c < splits; c += blockDim.x) ml[c] = *(const float2*)(ws_ml + (base + (u64)c * heads) * 2);
    __syncthreads();
    // merge_ml's M before split c is the max of the earlier m (empty splits are -inf, so they may join): a
    // prefix max over the warp (splits c = lane, lane + 32) gives every (a, b) at once, with merge_ml's bits;
    // only L's chain of fmas stays serial
    if (tid < 32) {
        const float m0 = tid < splits ? ml[tid].x : -INFINITY, m1 = tid + 32 < splits ? ml[tid + 32].x : -INFINITY;
        float i0 = m0, i1 = m1;   // inclusive prefix maxima
#pragma unroll
        for (u32 o = 1; o < 32; o <<= 1) {
            const float u0 = __shfl_up_sync(0xffffffffu, i0, o), u1 = __shfl_up_sync(0xffffffffu, i1, o);
            if (tid >= o) { i0 = fmaxf(i0, u0); i1 = fmaxf(i1, u1); }
        }
        const float tot0 = __shfl_sync(0xffffffffu, i0, 31);
        i1 = fmaxf(i1, tot0);
        float e0 = __shfl_up_sync(0xffffffffu, i0, 1), e1 = __shfl_up_sync(0xffffffffu, i1, 1);
        if (tid == 0) { e0 = -INFINITY; e1 = tot0; }
        const float mc[2] = {m0, m1}, ex[2] = {e0, e1}, in[2] = {i0, i1};
#pragma unroll
        for (u32 k = 0; k < 2; ++k) {
            const u32 c = tid + 32 * k;
            if (c < splits) {
                live[c] = mc[k] != -INFINITY;
                ab[c] = merge_ab(ex[k], in[k], mc[k]);
                ad[c] = live[c] ? make_float2(ab[c].a, __fmul_rn(ml[c].y, ab[c].b)) : make_float2(1.f, 0.f);
            }
        }
        const float M = __shfl_sync(0xffffffffu, i1, 31);
        const u32 b0 = __ballot_sync(0xffffffffu, m0 != -INFINITY), b1 = __ballot_sync(0xffffffffu, m1 != -INFINITY);
        const u32 n = b1 ? 64 - __clz(b1) : 32 - __clz(b0);   // splits past the last live one add nothing
        __syncwarp();
        if (tid == 0) {  // merge_l's chain; an empty split's (1, 0) leaves L exactly as it is (L >= 0)
            float L = 0.f;
#pragma unroll 8
            for (u32 c = 0; c < n; ++c) L = __fmaf_rn(L, ad[c].x, ad[c].y);
            fin = merge_finish(M, L, sink, h);
            nsp = n;
        }
    }
    __syncthreads();
    const float2 f = fin;
    const u32 n = nsp;
    for (u32 d = 4 * tid; d < dv; d += 4 * blockDim.x) {
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        for (u32 c0 = 0; c0 < n; c0 += 8) {  // 8 loads in flight, merged in split order
            float4 v[8];
#pragma unroll
            for (u32 k = 0; k < 8; ++k) {
                const u32 c = c0 + k;
                v[k] = c < n && live[c] ? *(const float4*)(ws_o + (base + (u64)c * heads) * dv + d)
                                        : make_float4(0.f, 0.f, 0.f, 0.f);
            }
#pragma unroll
            for (u32 k = 0; k < 8; ++k) {
                const u32 c = c0 + k;
                if (c < n && live[c]) {
                    const MergeAB w = ab[c];
                    acc.x = merge_o(acc.x, w, v[k].x); acc.y = merge_o(acc.y, w, v[k].y);
                    acc.z = merge_o(acc.z, w, v[k].z); acc.w = merge_o(acc.w, w, v[k].w);
                }
            }
        }
        __nv_bfloat16 ob[4] = {merge_out(acc.x, f), merge_out(acc.y, f), merge_out(acc.z, f), merge_out(acc.w, f)};
        if (gate != nullptr) {
            const __nv_bfloat16* g = gate + (u64)s * gate_row_stride + (u64)h * gate_head_stride + d;
#pragma unroll
            for (u32 k = 0; k < 4; ++k) ob[k] = f2bf(__fmul_rn(bf2f(ob[k]), sigmoid_f32(bf2f(g[k]))));
        }
        __nv_bfloat16* o = out + ((u64)s * heads + h) * dv + d;
        o[0] = ob[0]; o[1] = ob[1]; o[2] = ob[2]; o[3] = ob[3];
    }
}
