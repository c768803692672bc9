"""Launchers for cuda_src/gemv_wg.cu: the fp8 block-scale GEMVs of 9-64 x rows on wgmma (sm_90a only).

Each row sums as the 8-row streaming kernel sums it under a k-split (ks, kb) (gemv.cu, `plan_gemv`), so
linear(invariant) runs them under `invariant_tune`'s split and a row's bits do not depend on m. A block is one
warpgroup of 64 weight rows and NX x rows (16, 32 or 64: the plan's), walking every k unit of the split in the
fold's order; the grid is (ceil(n / 64) tiles, ceil(m / NX) passes), the passes of a tile side by side so that
all but one find its weights in L2."""
from __future__ import annotations

import functools
from dataclasses import dataclass

from ..runtime.backend import Backend
from ._util import launch, need

__all__ = ["WG_KERNELS", "WG_MAX_M", "WgPlan", "plan_wg", "wg_runs", "w8a16_gemv_wg", "w8a16_gemv_e8m0_wg"]

WG_KERNELS = {"fp8_block": "w8a16_gemv_wg", "fp8_block_e8m0": "w8a16_gemv_e8m0_wg"}
WG_MAX_M = 64             # x rows a launch takes
WG_ROWS = 64              # weight rows a block (kernel WG_ROWS)
WG_STAGES = 4             # ring stages (3 units in flight while one is multiplied)
WG_FILL = 0.9             # blocks per multiprocessor below which the plan halves NX (more passes, more blocks)
_NX = (64, 32, 16)


@dataclass(frozen=True)
class WgPlan:
    nx: int       # x rows a pass (the kernel's wgmma n)
    passes: int   # grid.y
    tiles: int    # grid.x
    stages: int
    smem: int     # dynamic shared memory bytes


def wg_runs(gpu: Backend) -> bool:
    """Whether this device runs the wgmma kernels: a CUDA device of compute capability 9.0 (H100, H200), or the
    NumPy device (whose twins plan as an H200 does)."""
    return not gpu.is_cuda or getattr(gpu, "compute_capability", 0) == 90


def wg_smem(nx: int, stages: int) -> int:
    """Dynamic shared memory of a plan: x as wgmma's B (nx x 128 k bf16), then the ring of weights + raw x."""
    return 16 * (nx * 16 + stages * (WG_ROWS * 8 + nx * 16))


@functools.lru_cache(maxsize=1024)
def _plan_wg(n: int, m: int, sms: int, nx: int | None, stages: int | None) -> WgPlan:
    tiles = -(-n // WG_ROWS)
    if nx is None:   # the widest pass that still gives every multiprocessor about a block
        nx = next((c for c in _NX if c >= 16 and tiles * -(-m // c) >= WG_FILL * sms), 16)
        while nx > 16 and nx // 2 >= m:
            nx //= 2
    s = WG_STAGES if stages is None else stages
    return WgPlan(nx, -(-m // nx), tiles, s, wg_smem(nx, s))


def plan_wg(gpu: Backend, n: int, m: int, nx: int | None = None, stages: int | None = None) -> WgPlan:
    """The launch plan of the wgmma GEMV for n weight rows and m x rows; `nx` (16, 32 or 64) and `stages`
    (2..8) fix its choices (benchmarks)."""
    from .gemv import _sms
    need(nx in (None, 16, 32, 64), f"plan_wg: nx {nx!r} must be 16, 32 or 64 (None: the planner's)")
    need(stages is None or (isinstance(stages, int) and 2 <= stages <= 8),
         f"plan_wg: stages {stages!r} must be an int in 2..8 (None: the planner's)")
    need(1 <= int(m) <= WG_MAX_M, f"plan_wg: m={m} outside 1..{WG_MAX_M}")
    return _plan_wg(int(n), int(m), _sms(gpu), nx, stages)


def _wg(gpu, fmt, w, scale, x, y, m, n, k, x_stride, y_stride, out_dtype, stream, ks, kb, nx, stages):
    from .gemv import MAX_KB, _check, _out_f32
    name = WG_KERNELS[fmt]
    f32 = _out_f32(out_dtype)
    need(wg_runs(gpu), f"{name}: needs a compute capability 9.0 GPU (wgmma), this device is {gpu.name}")
    _check(name, 16, w, x, m, n, k, x_stride, y_stride, WG_MAX_M)
    need(int(scale) != 0, f"{name}: scale pointer is NULL")
    for what, v, hi in (("ks", ks, 16), ("kb", kb, MAX_KB)):
        need(isinstance(v, int) and 1 <= v <= hi, f"{name}: {what} {v!r} outside 1..{hi}")
    p = plan_wg(gpu, n, m, nx, stages)
    launch(gpu, "gemv_wg", name).arg_ptr(w).arg_ptr(scale).arg_u32(ks).arg_u32(ks * kb).arg_ptr(x).arg_ptr(y) \
        .arg_u32(m).arg_u32(n).arg_u32(k).arg_u32(x_stride).arg_u32(y_stride).arg_u32(f32) \
        .grid(p.tiles, p.passes).block(128).shared(p.smem).launch(stream)


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
