"""Does wgmma give mma.sync's bits? wgmma m64n64k16 (A = each warp's mma.sync A fragment from registers, B = x in
shared memory as 8 x 8 core matrices, no swizzle) against chains of mma.sync m16n8k16 on the same bf16 operands and
f32 accumulators: random normal, wide-exponent and zero-C inputs, k = 16, 64, 256, both descriptor offset
assignments (the wrong one shows as a large error against float64, not as a rounding difference).

    python scripts/probe_wgmma.py        # needs a compute capability 9.0 GPU (NVRTC with -arch=sm_90a)

gemv_wg.cu relies on the answer (bits equal with LBO 128, SBO 256: BENCHMARKS.md, 2026-12-07)."""
import time

import numpy as np

from mtp_cupy.bench.cli import Parser, run_main

SRC = r'''
typedef unsigned int u32; typedef unsigned short u16; typedef unsigned long long u64;
__device__ __forceinline__ void mma16816(float c[4], const u32 a[4], const u32 b[2]) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};"
     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ u32 pk(u16 lo, u16 hi) { return (u32)lo | ((u32)hi << 16); }
__device__ __forceinline__ u64 desc(u32 addr, u32 lbo, u32 sbo) {
  return (u64)((addr & 0x3FFFF) >> 4) | ((u64)((lbo & 0x3FFFF) >> 4) << 16)
       | ((u64)((sbo & 0x3FFFF) >> 4) << 32);
}
__device__ __forceinline__ void wg(float d[32], const u32 a[4], u64 ds) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
     "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {DLIST}, {%32,%33,%34,%35}, %36, p, 1, 1, 0;\n}\n"
     : OUTS : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(ds), "r"(1));
}
// A [P][64][K], X [P][64][K] bf16; C, D [P][64 weight rows][64 x rows] f32
extern "C" __global__ void __launch_bounds__(128) probe(const u16* A, const u16* X, const float* C, float* D1,
                                                   float* D2, int K, int lbo, int sbo) {
  __shared__ __align__(1024) u16 sx[16 * 64 * 16];   // up to 16 k16 steps
  const int p = blockIdx.x, tid = threadIdx.x, w = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const u16* a = A + (u64)p * 64 * K; const u16* x = X + (u64)p * 64 * K;
  const float* c = C + (u64)p * 4096;
  const int S = K / 16;
  auto afrag = [&](int s, u32 r[4]) {
    const int r0 = 16 * w + g, k0 = 16 * s + 2 * t;
    r[0] = pk(a[r0 * K + k0], a[r0 * K + k0 + 1]); r[1] = pk(a[(r0 + 8) * K + k0], a[(r0 + 8) * K + k0 + 1]);
    r[2] = pk(a[r0 * K + k0 + 8], a[r0 * K + k0 + 9]); r[3] = pk(a[(r0 + 8) * K + k0 + 8], a[(r0 + 8) * K + k0 + 9]);
  };
  float d[32];
  for (int j = 0; j < 8; ++j)
    for (int e = 0; e < 4; ++e) d[4 * j + e] = c[(16 * w + g + 8 * (e >> 1)) * 64 + 8 * j + 2 * t + (e & 1)];
  // path 1: mma.sync per warp and n-tile, k16 steps chained
  for (int j = 0; j < 8; ++j) {
    float acc[4] = {d[4 * j], d[4 * j + 1], d[4 * j + 2], d[4 * j + 3]};
    for (int s = 0; s < S; ++s) {
      u32 ar[4], b[2]; afrag(s, ar);
      const int n = 8 * j + g, k0 = 16 * s + 2 * t;
      b[0] = pk(x[n * K + k0], x[n * K + k0 + 1]); b[1] = pk(x[n * K + k0 + 8], x[n * K + k0 + 9]);
      mma16816(acc, ar, b);
    }
    for (int e = 0; e < 4; ++e) D1[(u64)p * 4096 + (16 * w + g + 8 * (e >> 1)) * 64 + 8 * j + 2 * t + (e & 1)] = acc[e];
  }
  // path 2: x into shared memory as 8 x 8 core matrices (no swizzle), one 2 KB block a k16 step
  for (int i = tid; i < S * 64 * 16; i += 128) {
    const int s = i / 1024, n = i / 16 % 64, k = i % 16;
    sx[(s * 2048 + (n / 8) * sbo + (k / 8) * lbo + (n % 8) * 16 + (k % 8) * 2) / 2] = x[n * K + 16 * s + k];
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  const u32 base = (u32)__cvta_generic_to_shared(sx);
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
  for (int s = 0; s < S; ++s) {
    u32 ar[4]; afrag(s, ar);
    wg(d, ar, desc(base + s * 2048, lbo, sbo));
  }
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
  for (int j = 0; j < 8; ++j)
    for (int e = 0; e < 4; ++e)
      D2[(u64)p * 4096 + (16 * w + g + 8 * (e >> 1)) * 64 + 8 * j + 2 * t + (e & 1)] = d[4 * j + e];
}
'''
SRC = SRC.replace("DLIST", ", ".join(f"%{i}" for i in range(32))) \
         .replace("OUTS", ", ".join(f'"+f"(d[{i}])' for i in range(32)))


def bf16(a):
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def f32(b):
    return (b.astype(np.uint32) << 16).view(np.float32)


def run(fn, label, seed=None):
    seed = time.time_ns() % 2**31 if seed is None else seed
    rng = np.random.default_rng(seed)
    print(label, "seed", seed, flush=True)
    for dist in ("normal", "wide", "zeroC"):
        for K in (16, 64, 256):
            P = 256
            sh = (P, 64, K)
            if dist == "wide":
                A = rng.standard_normal(sh) * 2.0 ** rng.integers(-20, 20, sh)
                X = rng.standard_normal(sh) * 2.0 ** rng.integers(-20, 20, sh)
                C = rng.standard_normal((P, 64, 64)) * 2.0 ** rng.integers(-10, 10, (P, 64, 64))
            else:
                A, X = rng.standard_normal(sh), rng.standard_normal(sh)
                C = rng.standard_normal((P, 64, 64)) * (0 if dist == "zeroC" else 4)
            Ab, Xb, C32 = bf16(A), bf16(X), C.astype(np.float32)
            a64, x64 = f32(Ab).astype(np.float64), f32(Xb).astype(np.float64)
            ref = C32.astype(np.float64) + np.einsum("prk,pnk->prn", a64, x64)
            mag = np.abs(C32) + np.einsum("prk,pnk->prn", np.abs(a64), np.abs(x64)) + 1e-300
            for lbo, sbo in ((128, 256), (256, 128)):
                D1 = cp.full((P, 64, 64), np.nan, np.float32)
                D2 = cp.full((P, 64, 64), np.nan, np.float32)
                fn((P,), (128,), (cp.asarray(Ab), cp.asarray(Xb), cp.asarray(C32), D1, D2, np.int32(K),
                                  np.int32(lbo), np.int32(sbo)))
                d1, d2 = D1.get(), D2.get()
                e1 = np.nanmax(np.abs(d1 - ref) / mag) if not np.isnan(d1).any() else np.nan
                e2 = np.nanmax(np.abs(d2 - ref) / mag) if not np.isnan(d2).any() else np.nan
                diff = int(np.count_nonzero(d1.view(np.uint32) != d2.view(np.uint32)))
                print(f"  {dist:6s} K={K:3d} lbo={lbo} sbo={sbo}: mma.sync rel {e1:.2e}, wgmma rel {e2:.2e}, "
                      f"bits differ {diff} of {d1.size}", flush=True)


def main() -> int:
    p = Parser(__doc__)
    p.add_argument("--seed", type=int, default=None, help="seed of the inputs (default: a fresh one, printed)")
    a = p.parse_args()
    import cupy as cp
    globals()["cp"] = cp
    mod = cp.RawModule(code=SRC, options=("-std=c++17", "-arch=sm_90a"))
    run(mod.get_function("probe"), "nvrtc -arch=sm_90a", a.seed)
    return 0


if __name__ == "__main__":
    run_main(main)
