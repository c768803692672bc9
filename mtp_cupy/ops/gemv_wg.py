"""Launchers for cuda_src/gemv_wg.cu: the fp8 block-scale GEMVs of 9-64 x rows on wgmma (sm_90a only).

Each row sums as the 8-row streaming kernel sums it under a k-split (ks, kb) (gemv.cu, `plan_gemv`), so
linear(invariant) runs them under `invariant_tune`'s split (for launches of 33-64 rows where `wg_pays`) and a row's
bits do not depend on m. A block is two warpgroups of 64 weight rows sharing NX x rows (16, 32 or 64: the plan's);
the ks * kb slices of the split are shared by the CB blocks of a cluster (CB the largest divisor <= 16), each
walking its slices' units and keeping each slice's sums, which the cluster then folds in the 8-row kernel's order.
Grid (ceil(n / 128) tiles, CB, ceil(m / NX) passes)."""
from __future__ import annotations

import functools
from dataclasses import dataclass

from ..runtime.backend import Backend
from . import gemv as _gemv   # gemv imports this module at its top: attributes are read at call time
from ._util import launch, need

__all__ = ["WG_KERNELS", "WG_MAX_M", "WgPlan", "plan_wg", "wg_pays", "wg_runs", "w8a16_gemv_wg",
           "w8a16_gemv_e8m0_wg"]

WG_KERNELS = {"fp8_block": "w8a16_gemv_wg", "fp8_block_e8m0": "w8a16_gemv_e8m0_wg"}
WG_MAX_M = 64             # x rows a launch takes
WG_ROWS = 128             # weight rows a block (kernel WG_ROWS: two warpgroups of 64)
WG_THREADS = 256
WG_STAGES = (4, 3, 2)     # ring depths tried, deepest first (depth - 1 units in flight while one is multiplied)
WG_SMEM = 113 * 1024      # shared memory a block may take: two blocks a multiprocessor
WG_FILL = 0.9             # blocks per multiprocessor below which the plan halves NX (more passes, more blocks)
WG_MAX_CB = 16            # blocks a cluster (past the portable 8: the backend sets the non-portable attribute)
# linear(invariant) takes these kernels for launches of 33-64 rows where each block holds one slice of the split
# (ks * kb <= WG_MAX_CB) streaming >= WG_MIN_UNITS units (H100, m = 64: V3 o_proj (8, 1) 16 units 88.0 vs 111.5 us
# on the 64-row kernel, GLM-5 o_proj (10, 1) 12 units 102.9 vs 136.5, V3 q_b (1, 1) 12 units 39.3 vs 41.0, GLM-5 q_b
# (1, 1) 16 units 40.6 vs 38.7; shorter walks lost: V4 wq_b (1, 1) 8 units 34.0 vs 33.2, e_proj (16, 1) 2 units 35.5
# vs 33.1, shared down 1 unit 27.4 vs 20.9, and every 9-32-row launch measured but V3 o_proj's)
WG_MIN_UNITS = 12


@dataclass(frozen=True)
class WgPlan:
    nx: int       # x rows a pass (the kernel's wgmma n)
    passes: int   # grid.z
    tiles: int    # grid.x
    cb: int       # grid.y = cluster.y: blocks sharing a tile's k slices
    stages: int
    smem: int     # dynamic shared memory bytes


def wg_runs(gpu: Backend) -> bool:
    """Whether this device runs the wgmma kernels: a CUDA device of compute capability 9.0 (H100, H200), or the
    NumPy device (whose twins plan as an H200 does)."""
    return not gpu.is_cuda or getattr(gpu, "compute_capability", 0) == 90


@functools.lru_cache(maxsize=1024)
def wg_pays(k: int, ks: int, kb: int) -> bool:
    """Whether linear(invariant) runs a 33-64-row launch of an fp8 block k-column weight under the split (ks, kb)
    here: one slice a block, of >= WG_MIN_UNITS 128-k units."""
    kw = ks * kb
    return kw <= WG_MAX_CB and -(-k // 128) // kw >= WG_MIN_UNITS


def wg_smem(nx: int, stages: int, slices: int) -> int:
    """Dynamic shared memory of a plan: each of the block's `slices` slice sums (WG_ROWS x nx f32), x as wgmma's
    B (nx x 128 k bf16), then the ring of weights (WG_ROWS x 128 B) and raw x (nx x 256 B)."""
    return 16 * (slices * nx * WG_THREADS // 8 + nx * 16 + stages * (WG_ROWS * 8 + nx * 16))


@functools.lru_cache(maxsize=1024)
def _plan_wg(n: int, m: int, kw: int, sms: int, max_kb: int, nx: int | None, stages: int | None,
             max_cb: int = WG_MAX_CB) -> WgPlan:
    tiles = -(-n // WG_ROWS)
    cb = max(c for c in range(1, (max_cb if max_kb > 1 else 1) + 1) if kw % c == 0)
    fit = [(c, s) for c in (64, 32, 16) if (c < 2 * max(m, 16) if nx is None else c == nx)
           for s in (WG_STAGES if stages is None else (stages,)) if wg_smem(c, s, kw // cb) <= WG_SMEM]
    need(fit, f"plan_wg: no plan fits {WG_SMEM} bytes of shared memory for {kw} slices (nx {nx}, stages {stages})")
    c, s = fit[0]
    if nx is None:   # halve the pass while the blocks leave multiprocessors idle
        while c > 16 and tiles * cb * -(-m // c) < WG_FILL * sms:
            c //= 2
        s = next(d for cc, d in fit if cc == c)
    return WgPlan(nx=c, passes=-(-m // c), tiles=tiles, cb=cb, stages=s, smem=wg_smem(c, s, kw // cb))


def plan_wg(gpu: Backend, n: int, m: int, ks: int = 1, kb: int = 1, nx: int | None = None,
            stages: int | None = None, max_cb: int = WG_MAX_CB) -> WgPlan:
    """The launch plan of the wgmma GEMV for n weight rows, m x rows and the 8-row plan's k-split (ks, kb); `nx`
    (16, 32 or 64), `stages` (2..8) and `max_cb` (the largest cluster, 1..16) fix its choices (benchmarks)."""
    need(nx in (None, 16, 32, 64), f"plan_wg: nx {nx!r} must be 16, 32 or 64 (None: the planner's)")
    need(stages is None or (isinstance(stages, int) and 2 <= stages <= 8),
         f"plan_wg: stages {stages!r} must be an int in 2..8 (None: the planner's)")
    need(isinstance(max_cb, int) and 1 <= max_cb <= WG_MAX_CB, f"plan_wg: max_cb {max_cb!r} outside 1..{WG_MAX_CB}")
    need(1 <= int(m) <= WG_MAX_M, f"plan_wg: m={m} outside 1..{WG_MAX_M}")
    return _plan_wg(int(n), int(m), int(ks) * int(kb), _gemv._sms(gpu), _gemv._max_kb(gpu), nx, stages, max_cb)


def _wg(gpu, fmt, w, scale, x, y, m, n, k, x_stride, y_stride, out_dtype, stream, ks, kb, nx, stages,
        max_cb=WG_MAX_CB):
    name = WG_KERNELS[fmt]
    f32 = _gemv._out_f32(out_dtype)
    need(wg_runs(gpu), f"{name}: needs a compute capability 9.0 GPU (wgmma), this device is {gpu.name}")
    _gemv._check(name, 16, w, x, m, n, k, x_stride, y_stride, WG_MAX_M)
    need(int(scale) != 0, f"{name}: scale pointer is NULL")
    _gemv.check_split(name, ks, kb)
    p = plan_wg(gpu, n, m, ks, kb, nx, stages, max_cb)
    l = launch(gpu, "gemv_wg", name).arg_ptr(w).arg_ptr(scale).arg_u32(ks).arg_u32(ks * kb).arg_ptr(x).arg_ptr(y) \
        .arg_u32(m).arg_u32(n).arg_u32(k).arg_u32(x_stride).arg_u32(y_stride).arg_u32(f32)
    if p.cb > 1:
        l.cluster(1, p.cb)
    l.grid(p.tiles, p.cb, p.passes).block(WG_THREADS).shared(p.smem).launch(stream)


def w8a16_gemv_wg(gpu, w, scale, x, y, m, n, k, x_stride, y_stride, out_dtype="bf16", stream=None, ks=1, kb=1,
                  nx=None, stages=None):
    """y[m, n] = x[m, k] @ W.T for e4m3 W with f32 128 x 128 block scales, m <= 64, on wgmma: each row's bits are
    w8a16_gemv's under Tune(ks=ks, kb=kb) (plan: `plan_wg`; nx, stages fix its choices)."""
    _wg(gpu, "fp8_block", w, scale, x, y, m, n, k, x_stride, y_stride, out_dtype, stream, ks, kb, nx, stages)


def w8a16_gemv_e8m0_wg(gpu, w, scale, x, y, m, n, k, x_stride, y_stride, out_dtype="bf16", stream=None, ks=1,
                       kb=1, nx=None, stages=None):
    """As w8a16_gemv_wg for E8M0 block scales (w8a16_gemv_e8m0's rows)."""
    _wg(gpu, "fp8_block_e8m0", w, scale, x, y, m, n, k, x_stride, y_stride, out_dtype, stream, ks, kb, nx,
        stages)
