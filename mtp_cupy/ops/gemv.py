"""Launchers for cuda_src/gemv.cu. `linear` picks the kernel from the weight format and the row count.

Two kinds of kernel (see the head of gemv.cu), named by how they read the weights:
- streaming ring kernels (unsuffixed names): blocks of (32, ks) threads, a persistent grid of `blocks` blocks
  that walk the row tiles, and a ring of `stages` cp.async pipeline stages per warp in dynamic shared memory.
  `plan_gemv` picks (ks, kb, blocks, stages) per shape: enough resident warps (WARPS_PER_SM) on every
  multiprocessor, whole tiles per block and whole k units per warp. The tensor-core ones also split k across
  the kb blocks of a thread block cluster when the row tiles are too few to cover the multiprocessors (fp32
  summation order depends on ks and kb, nothing else does). `Tune` overrides any of it
  (scripts/bench_kernels.py --sweep).
- register-round kernels (`*_regs`): no shared-memory pipeline, each lane loads rounds of weight chunks
  straight into registers; blocks of 8 warps shaped (32, ks, 8 // ks). `linear` uses dense_gemv_bf16_regs
  for bf16 m = 1 and w4a16_gemv_regs for NVFP4 (faster there); the other two are for benchmarks."""
from __future__ import annotations

import functools
from dataclasses import dataclass

from ..runtime.backend import Backend
from ..runtime.ptr import NULL, DevicePtr
from ..weights.linear import Linear
from ..errors import KernelError
from ._util import launch, need
from .gemv_wg import WG_KERNELS, _wg, wg_pays, wg_runs

__all__ = ["linear", "dense_gemv_bf16", "dense_gemv_bf16_batchm", "dense_gemv_bf16_batch32", "dense_gemv_bf16_batch64",
           "gemv_fp8w_batch64", "w8a16_gemv_batch64", "w8a16_gemv_e8m0_batch64", "x64_fits", "X64_KERNELS",
           "dense_gemm_bf16", "gemv_fp8w", "w8a16_gemv", "w8a16_gemv_e8m0", "w4a16_gemv", "w4a16_gemv_mx",
           "gemv_fp8w_batch32", "w8a16_gemv_batch32", "w8a16_gemv_e8m0_batch32", "w4a16_gemv_batch32",
           "w4a16_gemv_mx_batch32",
           "dense_gemv_bf16_regs", "dense_gemv_bf16_batchm_regs", "w8a16_gemv_regs", "w4a16_gemv_regs",
           "Tune", "Plan", "plan_gemv", "plan_batch64", "invariant_tune"]

WARPS = 8  # register-round kernels: warps per block
QUANT_MAX_M = 8  # x rows a pass of the 8-row streaming kernels (32 for the _batch32 ones)
STREAM_MAX_M = 64  # x rows one streaming launch takes: its passes share each weight tile through L2

STAGES = 4              # ring stages per warp (S - 1 in flight while one is consumed)
WARPS_PER_SM = 16       # resident streaming warps wanted per SM
MIN_WARPS_PER_SM = 12   # fewer than this counts against a plan
INFLIGHT_PER_SM = 48 * 1024  # weight bytes in flight per SM (ring stages being filled) below which a plan loses
SMEM_PER_SM = 228 * 1024   # H100/H200 shared memory per SM (1 KB of it reserved per block)
SMEM_PER_BLOCK = 227 * 1024
REGS_PER_SM = 65536
SUBPARTITIONS = 4          # an SM's schedulers; each owns a quarter of the register file
REG_ALLOC_UNIT = 256       # registers are given to a warp in units of this many
MAX_KB = 8                 # blocks per cluster: the portable limit
X64_GROUPS = 8    # the 64-row kernels (*_batch64): 16-row weight groups a block (kernel XG_RG), sharing its staged x
X64_ROWS = 64     # x rows they stage a pass (kernel XG_ROWS)
X64_MAX_KS = 2    # k slices a block takes (block (32, xs, 8) <= 512 threads)
X64_REGS = 128    # their registers a thread (ptxas, sm_90a) where the backend cannot say


@dataclass(frozen=True)
class _Geom:
    kchunk: int           # k per 16-byte weight chunk: K must be a multiple (whole chunks, aligned rows)
    tile_rows: int        # weight rows per tile (streaming) / per warp (register rounds)
    unit_chunks: int      # chunks per row in one pipeline stage (streaming) / one warp k-step (register rounds)
    max_m: int
    scale_align: int = 1  # bytes per scale load
    red_floats: int = 0   # streaming: reduction-area floats per warp and buffer (ks > 1)
    max_ks: int = 16      # streaming: warps per block (the kernel's launch bound / 32)
    regs: int = 96        # register estimate where the backend cannot say
    stream: bool = True   # False: a register-round kernel
    row_grid: bool = False  # one x row per grid.y (the FMA kernels)
    stages: int = STAGES    # default ring depth and resident warps wanted per SM (Tune overrides both)
    wps: int = WARPS_PER_SM
    max_kb: int = 1         # streaming: blocks of a cluster splitting k (the tensor-core kernels: up to 8)
    pass_rows: int = 0      # streaming: x rows a pass (a launch of more rows runs several passes)


def _mma(kchunk: int, mt: int, rt: int, scale_align: int = 1, regs: int = 96, stages: int = STAGES,
         wps: int = WARPS_PER_SM, max_ks: int = 16) -> _Geom:
    return _Geom(kchunk, 16 * rt, 8, STREAM_MAX_M, scale_align, rt * mt * 4 * 32, max_ks, regs, stages=stages, wps=wps,
                 max_kb=MAX_KB, pass_rows=8 * mt)


# `bench_kernels.py --sweep` (H200, BENCHMARKS.md): the one-tile tensor-core kernels run best with a shallow
# ring and many resident warps (fp8 7168x14336 38.6 vs 42.0 us, 129280x7168 240 vs 260, m=8 40 vs 48)
_SHALLOW = dict(stages=2, wps=32)


def _rounds(kchunk: int, tile_rows: int, step_chunks: int, max_m: int, scale_align: int = 1,
            row_grid=False) -> _Geom:
    """A register-round kernel's geometry."""
    return _Geom(kchunk, tile_rows, step_chunks, max_m, scale_align, stream=False, row_grid=row_grid)


_GEOM = {"dense_gemv_bf16": _Geom(8, 2, 64, 65535, red_floats=2, max_ks=16, regs=48, row_grid=True),
         "dense_gemv_bf16_batchm": _mma(8, 1, 1, regs=64, **_SHALLOW),
         "dense_gemv_bf16_batch32": _mma(8, 4, 2, regs=128),
         "gemv_fp8w": _mma(16, 1, 1, 4, regs=64, **_SHALLOW),
         "w8a16_gemv": _mma(16, 1, 1, 4, regs=64, **_SHALLOW),
         "w8a16_gemv_e8m0": _mma(16, 1, 1, regs=64, **_SHALLOW),
         # fp4: at most 8 warps per block, so the 32-row kernels (256 threads) can take the 8-row plan's k-split
         "w4a16_gemv": _mma(32, 1, 1, 2, regs=80, max_ks=8),  # two e4m3 scales per 32-code chunk
         "w4a16_gemv_mx": _mma(32, 1, 1, regs=80, max_ks=8),
         # the 32-row streaming kernels of the quantised formats (linear: 8 < m <= 32, and batch-invariant)
         "gemv_fp8w_batch32": _mma(16, 4, 1, 4, regs=126, **_SHALLOW),
         "w8a16_gemv_batch32": _mma(16, 4, 1, 4, regs=126, **_SHALLOW),
         "w8a16_gemv_e8m0_batch32": _mma(16, 4, 1, regs=126, **_SHALLOW),
         "w4a16_gemv_batch32": _mma(32, 4, 1, 2, regs=204, max_ks=8),
         "w4a16_gemv_mx_batch32": _mma(32, 4, 1, regs=198, max_ks=8),
         "dense_gemv_bf16_regs": _rounds(8, 2, 32, 65535, row_grid=True),
         "dense_gemv_bf16_batchm_regs": _rounds(8, 16, 4, 8),
         "w8a16_gemv_regs": _rounds(16, 16, 4, QUANT_MAX_M, 4),
         "w4a16_gemv_regs": _rounds(32, 16, 4, QUANT_MAX_M, 2)}
GEMM_TILE = 128
GEMM_SMEM = 4 * (128 + 128) * 40 * 2  # dense_gemm_bf16: GS ring stages of x and W tiles (gemv.cu)


@dataclass(frozen=True)
class Tune:
    """Overrides for plan_gemv (None = the planner's choice): ks warps per block, kb blocks per cluster
    splitting k, the ring depth (shrunk to fit shared memory, not below 2 unless asked), the resident warps
    wanted per SM, and blocks (the tile walkers before whole-tile rounding; at least the tile count = one tile
    per walker, not persistent)."""
    ks: int | None = None
    stages: int | None = None
    warps_per_sm: int | None = None
    blocks: int | None = None
    kb: int | None = None


@dataclass(frozen=True)
class Plan:
    ks: int       # warps per block, splitting each tile's k units
    blocks: int   # grid.x; walker b (a cluster of kb blocks) walks tiles b, b + blocks, ...
    stages: int   # ring depth per warp
    smem: int     # dynamic shared memory bytes: ks * stages * stage bytes (+ the reduction areas)
    score: float  # the planner's efficiency estimate (1.0 = no idle warp or tile slot)
    kb: int = 1   # grid.y = cluster.y: blocks sharing each tile, splitting its k units


@functools.cache
def _cuda_sms(device_id: int) -> int:
    import cupy
    return int(cupy.cuda.runtime.getDeviceProperties(device_id)["multiProcessorCount"])


def _sms(gpu: Backend) -> int:
    return _cuda_sms(getattr(gpu, "device_id", 0)) if gpu.is_cuda else 132


def _max_kb(gpu: Backend) -> int:
    """Blocks per cluster the device can launch: thread block clusters need sm_90 (the NumPy device plans as an
    H200 does)."""
    return MAX_KB if getattr(gpu, "compute_capability", 90) >= 90 else 1


_REGS: dict[tuple[str, int, str], int] = {}


def _regs(gpu: Backend, name: str) -> int:
    """Registers per thread of a compiled kernel (cupy RawKernel.num_regs), else the table's estimate."""
    key = (gpu.name, getattr(gpu, "device_id", 0), name)
    if key not in _REGS:
        try:
            _REGS[key] = int(gpu.kernel("gemv", name).fn.num_regs)
        except Exception:
            _REGS[key] = _GEOM[name].regs if name in _GEOM else X64_REGS
    return _REGS[key]


def warps_by_regs(regs: int) -> int:
    """Warps of a kernel using `regs` registers a thread that an SM holds by registers: each warp takes its
    registers (rounded up to REG_ALLOC_UNIT) from one scheduler's quarter of the file, so 112 registers give 4 x 4
    warps, not 65536 / 3584 = 18. Counting the whole file instead overplans persistent grids, whose surplus blocks
    then run as a partial second wave."""
    per_warp = -(-max(regs, 1) * 32 // REG_ALLOC_UNIT) * REG_ALLOC_UNIT
    return SUBPARTITIONS * (REGS_PER_SM // SUBPARTITIONS // per_warp)


@functools.lru_cache(maxsize=1024)
def _plan(name: str, n: int, k: int, sms: int, regs: int, tune: Tune, max_kb: int, passes: int = 1) -> Plan:
    g = _GEOM[name]
    bad = [f"{f}={v}" for f, v in vars(tune).items() if v is not None and not (isinstance(v, int) and v >= 1)]
    need(not bad, f"plan_gemv: {', '.join(bad)}: every Tune field is None (the planner's choice) or an int >= 1")
    max_kb = min(max_kb, g.max_kb)
    tiles = -(-n // g.tile_rows) * passes  # the walk's (tile, pass) units
    units = -(-(k // g.kchunk) // g.unit_chunks)
    stage = g.tile_rows * g.unit_chunks * 16
    want = tune.warps_per_sm or g.wps
    best = None
    # k splits across blocks only when the row tiles are fewer than the multiprocessors
    kbs = [tune.kb] if tune.kb else [kb for kb in (1, 2, 4, 8) if kb == 1 or (kb <= max_kb and tiles < sms)]
    for kb in kbs:
        for ks in ([tune.ks] if tune.ks else range(1, min(g.max_ks, units) + 1)):
            red = (2 * ks * g.red_floats * 4 if ks > 1 else 0) + (g.red_floats * 4 if kb > 1 else 0)
            s = tune.stages or g.stages
            while s > min(2, s) and ks * s * stage + red > SMEM_PER_BLOCK:  # shrink to fit, not below 2 stages
                s -= 1
            smem = ks * s * stage + red
            per_sm = min(32, 64 // ks, warps_by_regs(regs) // ks, SMEM_PER_SM // (smem + 1024))
            if smem > SMEM_PER_BLOCK or per_sm < 1 or kb > max_kb:
                continue
            nb = tune.blocks or min(sms * per_sm, -(-sms * want // ks)) // kb
            nb = max(1, min(tiles, nb))
            per_block = -(-tiles // nb)
            nb = -(-tiles // per_block)  # the fewest walkers with that many tiles each
            warps, kw = nb * kb * ks, kb * ks
            # fewer blocks than multiprocessors leave some idle whatever their warps (V4's 1024 x 4096
            # projection: 64 tiles); splitting k over a cluster's blocks spreads a tile over more of them
            score = (tiles / (nb * per_block)) * (units / (kw * -(-units // kw))) * \
                min(1.0, nb * kb / sms) * min(1.0, warps / (sms * MIN_WARPS_PER_SM)) * \
                min(1.0, max(warps * (s - 1) * stage, 1) / (sms * INFLIGHT_PER_SM))
            # a shape too small to fill the GPU scores below 1e-3 at every ks; rounded, they all tie and ks = 1
            # would win: one warp streaming all of K (the Qwen shared-expert gate, 1 x 2048: 22 us on an H200)
            coarse = round(score, 3)
            key = (coarse, 0.0 if coarse else score, -kb, -ks)
            if best is None or key > best[0]:
                best = (key, Plan(ks, nb, s, smem, score, kb))
    need(best is not None, f"{name}: no launch plan fits {n}x{k} (tune {tune})")
    return best[1]


def plan_gemv(gpu: Backend, name: str, n: int, k: int, tune: Tune | None = None, m: int = 1) -> Plan:
    """The launch plan of streaming GEMV kernel `name` for an n x k weight and m x rows (what the launcher
    uses); m beyond the kernel's pass rows adds passes to the walk, never changing ks or kb that Tune fixes."""
    need(name in _GEOM and _GEOM[name].stream, f"plan_gemv: {name!r} is not a streaming GEMV kernel")
    need(int(m) >= 1, f"plan_gemv: m {m} must be >= 1")
    pr = _GEOM[name].pass_rows   # 0: the FMA kernel, one x row per grid row
    passes = -(-int(m) // pr) if pr else 1
    return _plan(name, int(n), int(k), _sms(gpu), _regs(gpu, name), tune or Tune(), _max_kb(gpu), passes)


# The 64-row x-staged kernels (gemv.cu x64_body) per format, and k per 16-byte weight chunk.
X64 = "x64"   # linear's route: the format's 64-row kernel (X64_KERNELS)
WG = "wg"     # linear's route: the format's wgmma kernel (ops/gemv_wg.py WG_KERNELS)
X64_KERNELS = {"bf16": "dense_gemv_bf16_batch64", "fp8_row": "gemv_fp8w_batch64",
               "fp8_block": "w8a16_gemv_batch64", "fp8_block_e8m0": "w8a16_gemv_e8m0_batch64"}
X64_PART = 16 * 32 * 4    # a cluster's fold area bytes per warp (kernel XG_PE floats x 32 lanes)
X64_INFLIGHT = 64 * 1024  # weight bytes in flight per SM from which a plan stops gaining
X64_MIN_ROUNDS = 8        # units a k slice streams per tile below which linear keeps the 32-row kernel
# bf16 plans in clusters: units a slice streams a tile below which the cluster's fold of each tile outweighs the
# 64-row kernel's gain and linear runs the 8- / 32-row kernels under the split (H100, m = 64: Qwen o_proj 2048 x
# 4096 at 8 units 36.9 vs 23.0 us, bf16 4096 x 8192 at 16 units 65.2 vs 57.1; GLM-5's e/h projection at 24 units
# 88.8 vs 111.4, V3's at 28 104.4 vs 159.2). The fp8 ones paid wherever measured (V3 o_proj in clusters of 8 at 16
# units: 110.7 vs 142.2): their 8- and 32-row kernels decode each weight once a pass.
X64_FOLD_ROUNDS = 24


@functools.lru_cache(maxsize=256)
def _plan_x64(fmt: str, n: int, k: int, ks: int, kb: int, sms: int, regs: int, max_kb: int,
              slices: int | None, stages: int | None) -> Plan:
    kw, kc = ks * kb, 8 if fmt == "bf16" else 16
    tiles = -(-n // (16 * X64_GROUPS))
    best = None
    # a bf16 block holds every slice when kw <= 2; otherwise a block holds one, in a cluster of kw blocks (two-slice
    # blocks of 512 threads fit one a multiprocessor, whose every barrier then stalls it: slower wherever measured
    # with clusters; the fp8 kernels have no registers for them)
    for x in ([slices] if slices else [kw if kw <= X64_MAX_KS and fmt == "bf16" else 1]):
        cb = kw // x
        if x > (X64_MAX_KS if fmt == "bf16" else 1) or kw % x or cb > max_kb or (x > 1 and cb > 1):
            continue
        stage = x * (16 * X64_GROUPS * 8 + X64_ROWS * kc) * 16   # W [x][128 rows][8 chunks] + x [x][64 rows][kc]
        threads = 32 * x * X64_GROUPS
        part = x * X64_GROUPS * X64_PART if cb > 1 else (x - 1) * X64_GROUPS * 32 * 32 * 4   # gemv.cu PART_U4
        for s in ([stages] if stages else [6, 5, 4, 3, 2]):
            smem = part + s * stage
            per_sm = min(SMEM_PER_SM // (smem + 1024), warps_by_regs(regs) // (threads // 32), 2048 // threads)
            if smem > SMEM_PER_BLOCK or per_sm < 1:
                continue
            walkers = max(1, min(tiles, sms * per_sm // cb))
            rounds = -(-tiles // walkers)
            walkers = -(-tiles // rounds)   # the fewest walkers with that many tiles each
            inflight = per_sm * (s - 1) * x * 16 * X64_GROUPS * 128
            score = tiles / (walkers * rounds) * min(1.0, walkers * cb / sms) * min(1.0, inflight / X64_INFLIGHT)
            key = (round(score, 3), -cb, s)
            if best is None or key > best[0]:
                best = (key, Plan(x, walkers, s, smem, score, cb))
    need(best is not None, f"{X64_KERNELS[fmt]}: no launch plan fits {n}x{k} for the 8-row plan ks={ks} kb={kb}")
    return best[1]


def plan_batch64(gpu: Backend, n: int, k: int, ks: int = 1, kb: int = 1, fmt: str = "bf16",
                 slices: int | None = None, stages: int | None = None) -> Plan:
    """The 64-row x-staged kernel's launch plan for an n x k weight of format `fmt` whose rows must sum as the
    8-row kernel's plan (ks, kb) does: blocks of (32, s, 8) holding s k slices (s = 2 only for bf16 and
    ks * kb = 2: one block), else clusters of ks * kb one-slice blocks (the returned plan's ks is s, its kb the
    cluster size), the ring depth, a persistent grid of whole-tile walkers. `slices` and `stages` fix those
    choices (benchmarks)."""
    need(slices in (None, 1, 2), f"plan_batch64: slices {slices!r} must be 1 or 2 (None: the planner's)")
    need(stages is None or (isinstance(stages, int) and stages >= 2),
         f"plan_batch64: stages {stages!r} must be an int >= 2 (None: the planner's)")
    need(fmt in X64_KERNELS, f"plan_batch64: format {fmt!r} has no 64-row kernel (one of {sorted(X64_KERNELS)})")
    check_split(X64_KERNELS[fmt], ks, kb)
    return _plan_x64(fmt, int(n), int(k), ks, kb, _sms(gpu), _regs(gpu, X64_KERNELS[fmt]), _max_kb(gpu), slices,
                     stages)


def x64_fits(gpu: Backend, fmt: str, n: int, k: int, ks: int, kb: int) -> bool:
    """Whether the 64-row kernel can take the 8-row plan (ks, kb) for linear: the format has one, its layout
    holds the plan's k slices (bf16: one block of <= 2; else clusters of <= MAX_KB one-slice blocks), and each
    slice streams >= X64_MIN_ROUNDS units a tile (shorter streams measured slower than the 32-row kernel:
    the ring's fill and the tile's fold are paid over too few stages). linear then also asks bf16 plans in
    clusters for X64_FOLD_ROUNDS."""
    return fmt in X64_KERNELS and _x64_fits(fmt, int(n), int(k), ks, kb, _sms(gpu), _regs(gpu, X64_KERNELS[fmt]),
                                            _max_kb(gpu))


@functools.lru_cache(maxsize=1024)
def _x64_fits(fmt: str, n: int, k: int, ks: int, kb: int, sms: int, regs: int, max_kb: int) -> bool:
    # cached: linear asks on every invariant call, and a refused plan is an exception lru_cache does not keep
    units = -(-(k // (8 if fmt == "bf16" else 16)) // 8)
    if -(-units // (ks * kb)) < X64_MIN_ROUNDS:
        return False
    try:
        _plan_x64(fmt, n, k, ks, kb, sms, regs, max_kb, None, None)
        return True
    except KernelError:
        return False


def check_split(name: str, ks, kb) -> None:
    """An 8-row plan's k-split as the wide kernels take it: ks (warps a block) 1..16, kb (cluster blocks) 1..MAX_KB."""
    for what, v, hi in (("ks", ks, 16), ("kb", kb, MAX_KB)):
        need(isinstance(v, int) and 1 <= v <= hi, f"{name}: {what} {v!r} outside 1..{hi}")


def _out_f32(out_dtype: str) -> int:
    need(out_dtype in ("bf16", "f32"), f"gemv: out_dtype must be 'bf16' or 'f32', got {out_dtype!r}")
    return int(out_dtype == "f32")


def _check(name: str, kchunk: int, w, x, m: int, n: int, k: int, x_stride: int, y_stride: int,
           max_m: int) -> None:
    need(n > 0 and k > 0, f"{name}: empty weight {n}x{k}")
    need(1 <= m <= max_m, f"{name}: m={m} outside 1..{max_m}")
    need(k % kchunk == 0, f"{name}: K={k} must be a multiple of {kchunk} (16-byte weight chunks)")
    need(int(w) % 16 == 0, f"{name}: weight pointer 0x{int(w):x} is not 16-byte aligned")
    need(int(x) % 16 == 0 and x_stride % 8 == 0,
         f"{name}: x (0x{int(x):x}, row stride {x_stride}) must be 16-byte aligned with a stride % 8 == 0")
    need(x_stride >= k and y_stride >= n, f"{name}: strides x {x_stride} < K={k} or y {y_stride} < N={n}")


def _gemv(gpu: Backend, name: str, lead: list[tuple[str, object]], x, y, m: int, n: int, k: int,
          x_stride: int, y_stride: int, out_dtype: str, stream, tune: Tune | None = None) -> None:
    g = _GEOM[name]
    f32 = _out_f32(out_dtype)
    _check(name, g.kchunk, lead[0][1], x, m, n, k, x_stride, y_stride, g.max_m)
    if len(lead) > 1:
        sp = int(lead[1][1])
        need(sp != 0 and sp % g.scale_align == 0, f"{name}: scale pointer 0x{sp:x} is NULL or not "
                                                  f"{g.scale_align}-byte aligned")
    l = launch(gpu, "gemv", name)
    for kind, v in lead:
        getattr(l, "arg_" + kind)(v)
    l.arg_ptr(x).arg_ptr(y).arg_u32(m).arg_u32(n).arg_u32(k).arg_u32(x_stride).arg_u32(y_stride).arg_u32(f32)
    rows = m if g.row_grid else 1
    if g.stream:
        p = plan_gemv(gpu, name, n, k, tune, m)
        if p.kb > 1:  # the row-grid kernels (rows > 1) never split k across blocks (max_kb 1)
            l.cluster(1, p.kb)
        l.grid(p.blocks, rows * p.kb).block(32, p.ks).shared(p.smem).launch(stream)
        return
    units = -(-n // g.tile_rows)
    k_steps = -(-(k // g.kchunk) // g.unit_chunks)
    ks = 1  # split k while warps are scarce (latency-bound), keeping >= 1 k-step per warp
    while ks < WARPS and units * ks < 32 * _sms(gpu) and k_steps >= 2 * ks:
        ks *= 2
    l.grid(-(-units // (WARPS // ks)), rows).block(32, ks, WARPS // ks).launch(stream)


def dense_gemv_bf16(gpu, w, x, y, m, n, k, x_stride, y_stride, out_dtype="bf16", stream=None, tune=None):
    """Streaming FMA GEMV, one x row per grid row (the m = 1 path)."""
    _gemv(gpu, "dense_gemv_bf16", [("ptr", w)], x, y, m, n, k, x_stride, y_stride, out_dtype, stream, tune)


def dense_gemv_bf16_batchm(gpu, w, x, y, m, n, k, x_stride, y_stride, out_dtype="bf16", stream=None, tune=None):
    """m <= 8 x rows in one pass over W (tensor cores)."""
    _gemv(gpu, "dense_gemv_bf16_batchm", [("ptr", w)], x, y, m, n, k, x_stride, y_stride, out_dtype, stream, tune)


def dense_gemv_bf16_batch32(gpu, w, x, y, m, n, k, x_stride, y_stride, out_dtype="bf16", stream=None, tune=None):
    """m <= 32 x rows in one pass over W (tensor cores)."""
    _gemv(gpu, "dense_gemv_bf16_batch32", [("ptr", w)], x, y, m, n, k, x_stride, y_stride, out_dtype, stream,
          tune)


def _x64(gpu, fmt, lead, x, y, m, n, k, x_stride, y_stride, out_dtype, stream, ks, kb, slices=None, stages=None):
    name = X64_KERNELS[fmt]
    f32 = _out_f32(out_dtype)
    _check(name, 8 if fmt == "bf16" else 16, lead[0][1], x, m, n, k, x_stride, y_stride, X64_ROWS)
    if fmt != "bf16":
        need(int(lead[1][1]) != 0, f"{name}: scale pointer is NULL")
    p = plan_batch64(gpu, n, k, ks, kb, fmt, slices, stages)
    l = launch(gpu, "gemv", name)
    for kind, v in lead:
        getattr(l, "arg_" + kind)(v)
    l.arg_u32(ks).arg_ptr(x).arg_ptr(y).arg_u32(m).arg_u32(n).arg_u32(k).arg_u32(x_stride).arg_u32(y_stride) \
        .arg_u32(f32)
    if p.kb > 1:
        l.cluster(1, p.kb)
    l.grid(p.blocks, p.kb).block(32, p.ks, X64_GROUPS).shared(p.smem).launch(stream)


def dense_gemv_bf16_batch64(gpu, w, x, y, m, n, k, x_stride, y_stride, out_dtype="bf16", stream=None, ks=1, kb=1,
                            slices=None, stages=None):
    """m <= 64 x rows in one pass over W (tensor cores), x staged in shared memory once per block for its eight
    16-row weight groups. Each row's sums are those of dense_gemv_bf16_batchm under Tune(ks=ks, kb=kb), so a
    row's result is bit-identical to that kernel's (plan: `plan_batch64`; slices, stages fix its choices)."""
    _x64(gpu, "bf16", [("ptr", w), ("ptr", NULL)], x, y, m, n, k, x_stride, y_stride, out_dtype, stream, ks, kb,
         slices, stages)


def gemv_fp8w_batch64(gpu, w, scale, x, y, m, n, k, x_stride, y_stride, out_dtype="bf16", stream=None, ks=1, kb=1,
                      slices=None, stages=None):
    """As dense_gemv_bf16_batch64 for e4m3 weights with a per-row f32 scale (gemv_fp8w's rows)."""
    _x64(gpu, "fp8_row", [("ptr", w), ("ptr", scale)], x, y, m, n, k, x_stride, y_stride, out_dtype, stream, ks, kb,
         slices, stages)


def w8a16_gemv_batch64(gpu, w, scale, x, y, m, n, k, x_stride, y_stride, out_dtype="bf16", stream=None, ks=1, kb=1,
                       slices=None, stages=None):
    """As dense_gemv_bf16_batch64 for e4m3 weights with f32 128 x 128 block scales (w8a16_gemv's rows)."""
    _x64(gpu, "fp8_block", [("ptr", w), ("ptr", scale)], x, y, m, n, k, x_stride, y_stride, out_dtype, stream, ks,
         kb, slices, stages)


def w8a16_gemv_e8m0_batch64(gpu, w, scale, x, y, m, n, k, x_stride, y_stride, out_dtype="bf16", stream=None, ks=1,
                            kb=1, slices=None, stages=None):
    """As dense_gemv_bf16_batch64 for e4m3 weights with E8M0 128 x 128 block scales (w8a16_gemv_e8m0's rows)."""
    _x64(gpu, "fp8_block_e8m0", [("ptr", w), ("ptr", scale)], x, y, m, n, k, x_stride, y_stride, out_dtype, stream,
         ks, kb, slices, stages)


def gemv_fp8w(gpu, w, scale, x, y, m, n, k, x_stride, y_stride, out_dtype="bf16", stream=None, tune=None):
    """e4m3 weight with a f32 scale per row; m <= 8."""
    _gemv(gpu, "gemv_fp8w", [("ptr", w), ("ptr", scale)], x, y, m, n, k, x_stride, y_stride, out_dtype, stream,
          tune)


def w8a16_gemv(gpu, w, scale, x, y, m, n, k, x_stride, y_stride, out_dtype="bf16", stream=None, tune=None):
    """e4m3 weight with f32 128x128 block scales [ceil(n/128), ceil(k/128)]; m <= 8."""
    _gemv(gpu, "w8a16_gemv", [("ptr", w), ("ptr", scale)], x, y, m, n, k, x_stride, y_stride, out_dtype, stream,
          tune)


def w8a16_gemv_e8m0(gpu, w, scale, x, y, m, n, k, x_stride, y_stride, out_dtype="bf16", stream=None, tune=None):
    """e4m3 weight with E8M0 128x128 block scales; m <= 8."""
    _gemv(gpu, "w8a16_gemv_e8m0", [("ptr", w), ("ptr", scale)], x, y, m, n, k, x_stride, y_stride, out_dtype,
          stream, tune)


def w4a16_gemv(gpu, w, scale, scale2, x, y, m, n, k, x_stride, y_stride, out_dtype="bf16", stream=None, tune=None):
    """NVFP4: packed E2M1, e4m3 scales [n, k/16] (linear layout), global f32 scale2; m <= 8."""
    _gemv(gpu, "w4a16_gemv", [("ptr", w), ("ptr", scale), ("f32", scale2)], x, y, m, n, k, x_stride, y_stride,
          out_dtype, stream, tune)


def w4a16_gemv_mx(gpu, w, scale, x, y, m, n, k, x_stride, y_stride, out_dtype="bf16", stream=None, tune=None):
    """MXFP4: packed E2M1, E8M0 scales [n, k/32]; m <= 8. Exact for scales 2^-61 .. 2^65."""
    _gemv(gpu, "w4a16_gemv_mx", [("ptr", w), ("ptr", scale)], x, y, m, n, k, x_stride, y_stride, out_dtype,
          stream, tune)


# Register-round kernels (no shared-memory pipeline): linear()'s bf16 m = 1 and NVFP4 paths, and the other
# two for side-by-side benchmarks.
def gemv_fp8w_batch32(gpu, w, scale, x, y, m, n, k, x_stride, y_stride, out_dtype="bf16", stream=None, tune=None):
    """As gemv_fp8w for m <= 32 in one pass over W."""
    _gemv(gpu, "gemv_fp8w_batch32", [("ptr", w), ("ptr", scale)], x, y, m, n, k, x_stride, y_stride, out_dtype,
          stream, tune)


def w8a16_gemv_batch32(gpu, w, scale, x, y, m, n, k, x_stride, y_stride, out_dtype="bf16", stream=None, tune=None):
    """As w8a16_gemv for m <= 32 in one pass over W."""
    _gemv(gpu, "w8a16_gemv_batch32", [("ptr", w), ("ptr", scale)], x, y, m, n, k, x_stride, y_stride, out_dtype,
          stream, tune)


def w8a16_gemv_e8m0_batch32(gpu, w, scale, x, y, m, n, k, x_stride, y_stride, out_dtype="bf16", stream=None,
                            tune=None):
    """As w8a16_gemv_e8m0 for m <= 32 in one pass over W."""
    _gemv(gpu, "w8a16_gemv_e8m0_batch32", [("ptr", w), ("ptr", scale)], x, y, m, n, k, x_stride, y_stride,
          out_dtype, stream, tune)


def w4a16_gemv_batch32(gpu, w, scale, scale2, x, y, m, n, k, x_stride, y_stride, out_dtype="bf16", stream=None,
                       tune=None):
    """As w4a16_gemv for m <= 32 in one pass over W."""
    _gemv(gpu, "w4a16_gemv_batch32", [("ptr", w), ("ptr", scale), ("f32", scale2)], x, y, m, n, k, x_stride,
          y_stride, out_dtype, stream, tune)


def w4a16_gemv_mx_batch32(gpu, w, scale, x, y, m, n, k, x_stride, y_stride, out_dtype="bf16", stream=None,
                          tune=None):
    """As w4a16_gemv_mx for m <= 32 in one pass over W."""
    _gemv(gpu, "w4a16_gemv_mx_batch32", [("ptr", w), ("ptr", scale)], x, y, m, n, k, x_stride, y_stride, out_dtype,
          stream, tune)


def dense_gemv_bf16_regs(gpu, w, x, y, m, n, k, x_stride, y_stride, out_dtype="bf16", stream=None):
    """Register-round FMA GEMV, one x row per grid row (linear()'s bf16 m = 1 path)."""
    _gemv(gpu, "dense_gemv_bf16_regs", [("ptr", w)], x, y, m, n, k, x_stride, y_stride, out_dtype, stream)


def dense_gemv_bf16_batchm_regs(gpu, w, x, y, m, n, k, x_stride, y_stride, out_dtype="bf16", stream=None):
    _gemv(gpu, "dense_gemv_bf16_batchm_regs", [("ptr", w)], x, y, m, n, k, x_stride, y_stride, out_dtype, stream)


def w8a16_gemv_regs(gpu, w, scale, x, y, m, n, k, x_stride, y_stride, out_dtype="bf16", stream=None):
    _gemv(gpu, "w8a16_gemv_regs", [("ptr", w), ("ptr", scale)], x, y, m, n, k, x_stride, y_stride, out_dtype,
          stream)


def w4a16_gemv_regs(gpu, w, scale, scale2, x, y, m, n, k, x_stride, y_stride, out_dtype="bf16", stream=None):
    """Register-round NVFP4 (linear()'s NVFP4 kernel); m <= 8."""
    _gemv(gpu, "w4a16_gemv_regs", [("ptr", w), ("ptr", scale), ("f32", scale2)], x, y, m, n, k, x_stride,
          y_stride, out_dtype, stream)


def dense_gemm_bf16(gpu, w, x, y, m, n, k, x_stride, y_stride, out_dtype="bf16", stream=None):
    """Tiled tensor-core GEMM for prefill rows (any m)."""
    f32 = _out_f32(out_dtype)
    _check("dense_gemm_bf16", 8, w, x, m, n, k, x_stride, y_stride, 65535 * GEMM_TILE)
    need(n <= 65535 * GEMM_TILE, f"dense_gemm_bf16: N={n} too large for grid.y")
    launch(gpu, "gemv", "dense_gemm_bf16").grid(-(-m // GEMM_TILE), -(-n // GEMM_TILE)).block(256) \
        .shared(GEMM_SMEM).arg_ptr(w).arg_ptr(x).arg_ptr(y).arg_u32(m).arg_u32(n).arg_u32(k).arg_u32(x_stride) \
        .arg_u32(y_stride).arg_u32(f32).launch(stream)


# Measured on the H200 (BENCHMARKS.md, same run, cold L2): for m=1 bf16 and for NVFP4 the register-round
# kernels beat the streaming ones (7168x14336 bf16 59.7 vs 67.9 us, 129280x7168 nvfp4 208.5 vs 242.1 us);
# the streaming ones win for fp8 and the batched bf16 paths. linear() takes the winner of each.
# Streaming kernels per format: (up to 8 x rows, up to 32 x rows in one pass over W).
_STREAM = {"bf16": ("dense_gemv_bf16_batchm", "dense_gemv_bf16_batch32"),
           "fp8_row": ("gemv_fp8w", "gemv_fp8w_batch32"), "fp8_block": ("w8a16_gemv", "w8a16_gemv_batch32"),
           "fp8_block_e8m0": ("w8a16_gemv_e8m0", "w8a16_gemv_e8m0_batch32"),
           "nvfp4": ("w4a16_gemv", "w4a16_gemv_batch32"), "mxfp4": ("w4a16_gemv_mx", "w4a16_gemv_mx_batch32")}
WIDE_M = 32
# rows of a decode batch: 64 sequences x up to 4 streams (V4's h_proj runs on every mHC stream); larger calls are
# prefill chunks and take the fastest path
INVARIANT_MAX_M = 256


def _lead(W: Linear) -> list[tuple[str, object]]:
    if W.fmt == "bf16":
        return [("ptr", W.weight)]
    if W.fmt == "nvfp4":
        return [("ptr", W.weight), ("ptr", W.scale), ("f32", W.scale2)]
    return [("ptr", W.weight), ("ptr", W.scale)]


def linear(gpu: Backend, x, W: Linear, y, m: int = 1, out_dtype: str = "bf16", x_stride: int | None = None,
           y_stride: int | None = None, stream=None, invariant: bool = False) -> None:
    """y[m, W.n] = x[m, W.k] @ W.T (x bf16; y bf16 or f32). Strides are in elements (default dense).

    invariant: a row's arithmetic (hence its result, bit for bit) is the same whatever m is, up to
    INVARIANT_MAX_M rows in launches of up to STREAM_MAX_M, all under one k-split (ks, kb), `invariant_tune`'s:
    a launch of 9-64 rows runs the 64-row x-staged kernel of bf16 and the fp8 formats where it holds the split
    and pays (bf16 in clusters: >= X64_FOLD_ROUNDS units a slice), else 9-16 rows two 8-row passes and 17-64
    rows 32-row passes where that kernel holds the split (else 8-row passes); up to 8 rows the 8-row kernel. On a
    9.0 device the fp8 block formats' 33-64-row launches run on wgmma where `wg_pays` (ops/gemv_wg.py).
    Otherwise each m takes the fastest kernel: the register-round ones for bf16 m = 1 and NVFP4 m <= 8, the tiled
    GEMM for bf16 m > 32. Streaming launches take up to STREAM_MAX_M rows, their passes sharing each weight tile
    through L2 (W read from DRAM about once)."""
    xs = W.k if x_stride is None else int(x_stride)
    ys = W.n if y_stride is None else int(y_stride)
    need(m >= 1, f"linear({W.fmt}): m={m} < 1")
    invariant = invariant and m <= INVARIANT_MAX_M
    if not invariant:
        if W.fmt == "bf16" and m == 1:
            return dense_gemv_bf16_regs(gpu, W.weight, x, y, m, W.n, W.k, xs, ys, out_dtype, stream)
        if W.fmt == "bf16" and m > WIDE_M:
            return dense_gemm_bf16(gpu, W.weight, x, y, m, W.n, W.k, xs, ys, out_dtype, stream)
        if W.fmt == "nvfp4" and m <= QUANT_MAX_M:
            return w4a16_gemv_regs(gpu, W.weight, W.scale, W.scale2, x, y, m, W.n, W.k, xs, ys, out_dtype, stream)
    narrow, wide = _STREAM[W.fmt]
    tune, kinds = None, (wide,) * 3
    if invariant:   # one cached lookup: the split and the kernel for launches of 9-16, 17-32 and 33-64 rows
        tune, kinds = _invariant_route(gpu, W.fmt, W.n, W.k)
    ybytes = 4 if _out_f32(out_dtype) else 2
    for r0 in range(0, m, STREAM_MAX_M):     # each launch reads W from DRAM about once
        mm = min(STREAM_MAX_M, m - r0)
        xr, yr = DevicePtr(int(x) + r0 * xs * 2), DevicePtr(int(y) + r0 * ys * ybytes)
        kern = narrow if mm <= QUANT_MAX_M else kinds[(mm > 16) + (mm > 32)]
        if kern == WG:
            _wg(gpu, W.fmt, W.weight, W.scale, xr, yr, mm, W.n, W.k, xs, ys, out_dtype, stream, tune.ks, tune.kb,
                None, None)
        elif kern == X64:    # the 64-row kernels take a scale pointer in every format (bf16: NULL)
            _x64(gpu, W.fmt, _lead(W)[:2] + [("ptr", NULL)] * (W.fmt == "bf16"), xr, yr, mm, W.n, W.k, xs, ys,
                 out_dtype, stream, tune.ks, tune.kb)
        else:
            _gemv(gpu, kern, _lead(W), xr, yr, mm, W.n, W.k, xs, ys, out_dtype, stream, tune)


INVARIANT_MIN_SCORE = 0.2  # 8-row plan score a k-split the 64-row kernel holds needs to replace the planner's
X64_MIN_SCORE = 0.9        # and the 64-row plan's (it must fill the GPU: small n leaves multiprocessors idle)


def invariant_tune(gpu: Backend, fmt: str, n: int, k: int) -> Tune:
    """The k-split (ks, kb) every batch-invariant linear call of an n x k `fmt` weight sums under, at every m.

    The 8-row kernel's plan, unless the 64-row kernel cannot hold it while holding another split that scores
    >= INVARIANT_MIN_SCORE in the 8-row planner and >= X64_MIN_SCORE in its own, and either the 32-row kernel
    cannot hold the plan either (m > 8 would run 8-row passes) or the 64-row kernel takes that split without a
    cluster. The best such split (the 8-row planner's key) is taken: m = 1 pays a little for m = 64 (H100,
    BENCHMARKS.md: bf16 4096x8192 m = 1 35.5 -> 37.5 us, m = 64 85.6 -> 62.7; V4 wq_b fp8
    32768x1024 21.9 -> 22.3, 47.3 -> 33.1). Clustered 64-row plans where the 32-row kernel holds the plan
    measured slower (V4 wo_b fp8 4096x8192: 60.7 vs 49.2 us), so they are not taken. linear may still run a
    moved split on the 32-row kernel (X64_FOLD_ROUNDS: Qwen's 2048 x 4096 at m = 64, 23.0 us against 36.8 on the
    64-row kernel and 45.8 under the plan)."""
    need(fmt in _STREAM, f"invariant_tune: format {fmt!r} is not one of {sorted(_STREAM)}")
    need(int(n) >= 1 and int(k) >= 1, f"invariant_tune: n={n} and k={k} must be >= 1")
    return _invariant_route(gpu, fmt, int(n), int(k))[0]


def _invariant_route(gpu: Backend, fmt: str, n: int, k: int) -> tuple[Tune, tuple[str, str, str]]:
    """(invariant_tune's split, the kernel that runs launches of 9-16, 17-32 and 33-64 rows under it: the 8-row or
    32-row streaming kernel's name, X64 or WG): what linear routes by."""
    return _route(fmt, n, k, _sms(gpu), _regs(gpu, _STREAM[fmt][0]), _regs(gpu, _STREAM[fmt][1]),
                  _regs(gpu, X64_KERNELS[fmt]) if fmt in X64_KERNELS else 0, _max_kb(gpu), wg_runs(gpu))


def _holds(name: str, n: int, k: int, sms: int, regs: int, tune: Tune, max_kb: int) -> bool:
    try:
        _plan(name, n, k, sms, regs, tune, max_kb)
        return True
    except KernelError:
        return False


@functools.lru_cache(maxsize=1024)
def _route(fmt: str, n: int, k: int, sms: int, regs8: int, regs32: int, regs64: int, max_kb: int, wg: bool):
    # cached: linear asks on every invariant call, and a refused plan is an exception lru_cache does not keep.
    # wg: the device runs the wgmma kernels, which take 33-64-row launches where they pay (wg_pays)
    t = _split(fmt, n, k, sms, regs8, regs32, regs64, max_kb)
    narrow, wide = _STREAM[fmt]
    wide64 = WG if wg and fmt in WG_KERNELS and wg_pays(k, t.ks, t.kb) else None
    if fmt in X64_KERNELS and _x64_fits(fmt, n, k, t.ks, t.kb, sms, regs64, max_kb):
        q = _plan_x64(fmt, n, k, t.ks, t.kb, sms, regs64, max_kb, None, None)
        units = -(-(k // 8) // 8)    # bf16: 8-chunk units of 8 k
        if fmt != "bf16" or q.kb == 1 or -(-units // (t.ks * t.kb)) >= X64_FOLD_ROUNDS:
            return t, (X64, X64, wide64 or X64)
    # 9-16 rows: two 8-row passes beat one half-empty 32-row pass (H100, every such real shape: V4 wkv 12.1 vs
    # 15.8 us, wo_b 26.4 vs 29.0, Qwen o_proj 17.4 vs 20.5 and 22.9 on the 64-row kernel)
    w = wide if _holds(wide, n, k, sms, regs32, t, max_kb) else narrow
    return t, (narrow, w, wide64 or w)


def _split(fmt: str, n: int, k: int, sms: int, regs8: int, regs32: int, regs64: int, max_kb: int) -> Tune:
    narrow, wide = _STREAM[fmt]
    p = _plan(narrow, n, k, sms, regs8, Tune(), max_kb)
    if fmt not in X64_KERNELS or _x64_fits(fmt, n, k, p.ks, p.kb, sms, regs64, max_kb):
        return Tune(ks=p.ks, kb=p.kb)
    wide_holds = _holds(wide, n, k, sms, regs32, Tune(ks=p.ks, kb=p.kb), max_kb)
    best = None
    for ks in range(1, _GEOM[narrow].max_ks + 1):
        for kb in (1, 2, 4, 8):
            if not _x64_fits(fmt, n, k, ks, kb, sms, regs64, max_kb):
                continue
            q = _plan_x64(fmt, n, k, ks, kb, sms, regs64, max_kb, None, None)
            try:
                c = _plan(narrow, n, k, sms, regs8, Tune(ks=ks, kb=kb), max_kb)
            except KernelError:
                continue
            if c.score < INVARIANT_MIN_SCORE or q.score < X64_MIN_SCORE or (wide_holds and q.kb > 1):
                continue
            key = (round(c.score, 3), -kb, -ks)
            if best is None or key > best[0]:
                best = (key, Tune(ks=ks, kb=kb))
    return best[1] if best else Tune(ks=p.ks, kb=p.kb)


def _fits(gpu: Backend, name: str, n: int, k: int, tune: Tune) -> bool:
    """Whether streaming kernel `name` has a launch plan for n x k under `tune` on this device (`_holds`)."""
    return _holds(name, int(n), int(k), _sms(gpu), _regs(gpu, name), tune, _max_kb(gpu))
