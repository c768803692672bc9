"""GEMV benchmark on one CUDA GPU: achieved read bandwidth per kernel and shape, against the measured D2D copy
bandwidth and cuBLAS (cupy.matmul) on the same bytes, cold L2.

    python scripts/bench_kernels.py [--quick] [--regs] [--iters N] [--json PATH]
    python scripts/bench_kernels.py --sweep [--iters N] [--json PATH]
    python scripts/bench_kernels.py --mid [--iters N] [--json PATH]
    python scripts/bench_kernels.py --heads [--iters N] [--json PATH]
    python scripts/bench_kernels.py --mid-batch [--iters N] [--json PATH]
    python scripts/bench_kernels.py --grouped [--iters N] [--json PATH]

--regs adds the register-round kernels (*_regs) next to the streaming defaults. --sweep times, per key
shape, the register-round kernel, the default launch plan and a grid of plans (ks warps per block, ring stages, resident
warps per SM: ops.gemv.Tune), then rms_norm over thread counts, and prints which configuration wins. --mid
times each family's mid-size projections (MID_SHAPES in mtp_cupy/bench/gemv.py) at m = 1 under the default
plan and without split-K across blocks, beside cuBLAS. --heads times each family's LM head at decode batch
widths (HEAD_SHAPES, HEAD_M), batch-invariant, against the 32-row kernel and cuBLAS. --mid-batch times the
mid-size and e / h projections at m = 16, 32, 64 (MID_BATCH_M), batch-invariant: linear, the 64-row x-staged
kernel with one and two k slices a block, the 32-row kernel under the same k-split, cuBLAS. --grouped times
each family's grouped GEMVs (GROUPED_SHAPES: V4's wo_a, MLA's W_UK^T and W_UV) at m = 1..64 in 8- and 32-row
items against cuBLAS's batched GEMM.

Each timed launch follows a 256 MB memset that evicts L2 (50 MB on H100/H200); the memset also covers the
Python launch overhead, so the events bracket GPU time only. Medians of CUDA-event times after warm-up."""
from __future__ import annotations

import json

import mtp_cupy
from mtp_cupy.bench import EventTimer, copy_bandwidth, device_name
from mtp_cupy.bench.cli import Parser, positive_int, run_main
from mtp_cupy.bench.gemv import (BATCH_M, BATCH_SHAPES, BF16_SHAPES, PREFILL, QUANT_SHAPES, bench_heads,
                                 bench_grouped, bench_linear, bench_mid, bench_mid_batch,
                                 bench_optional)
from mtp_cupy.bench.gemv_sweep import sweep


def main() -> None:
    ap = Parser(__doc__)
    ap.add_argument("--quick", action="store_true", help="a few shapes only, 10 timed launches each")
    ap.add_argument("--iters", type=positive_int, default=30,
                    help="timed launches per kernel and shape (default 30; 20 with --sweep unless given)")
    ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON (default: none)")
    ap.add_argument("--regs", action="store_true", help="also time the register-round (*_regs) GEMV kernels")
    ap.add_argument("--sweep", action="store_true", help="launch-plan sweep of the streaming GEMV kernels")
    ap.add_argument("--top", type=positive_int, default=8, help="--sweep: fastest plans shown per shape")
    ap.add_argument("--mid", action="store_true",
                    help="each family's mid-size projections at m = 1, with and without split-K across blocks")
    ap.add_argument("--heads", action="store_true",
                    help="each family's LM head at m = 1..64, batch-invariant, against the 32-row kernel and cuBLAS")
    ap.add_argument("--mid-batch", action="store_true",
                    help="the mid-size projections and the e / h projections at m = 16, 32, 64, batch-invariant: "
                         "the 64-row x-staged kernels against the 32-row kernel and cuBLAS")
    ap.add_argument("--grouped", action="store_true",
                    help="each family's grouped GEMVs (V4's wo_a, MLA's W_UK^T / W_UV) at m = 1..64, 8- against "
                         "32-row items, beside cuBLAS's batched GEMM")
    a = ap.parse_args()
    gpu = mtp_cupy.device("cuda")
    iters = 10 if a.quick else 20 if a.sweep and a.iters == 30 else a.iters
    timer = EventTimer.cupy(iters=iters, warmup=3, sync_flush=False)
    copy_gbs = copy_bandwidth(gpu) / 1e9
    name = device_name(gpu)
    if a.mid or a.heads or a.mid_batch or a.grouped:
        what = ("Mid-size GEMVs" if a.mid else "Mid-size GEMVs at batch" if a.mid_batch else
                "Grouped GEMVs" if a.grouped else "LM heads")
        print(f"# {what} on {name}: D2D copy {copy_gbs:.0f} GB/s (read + write), cold L2, median of "
              f"{timer.iters}\n")
        res = (bench_mid if a.mid else bench_mid_batch if a.mid_batch else bench_grouped if a.grouped else
               bench_heads)(gpu, timer, copy_gbs)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(dict(gpu=name, copy_gbs=copy_gbs, mid=res), f, indent=1)
        return
    if a.sweep:
        print(f"# GEMV launch-plan sweep on {name}: D2D copy {copy_gbs:.0f} GB/s (read + write), cold L2, "
              f"median of {timer.iters}")
        res = sweep(gpu, timer, copy_gbs, a.top)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(dict(gpu=name, copy_gbs=copy_gbs, **res), f, indent=1)
        return
    bf16_shapes = BF16_SHAPES[:1] + BF16_SHAPES[3:4] if a.quick else BF16_SHAPES
    quant_shapes = QUANT_SHAPES[:2] if a.quick else QUANT_SHAPES
    batch = [(n, k, m) for n, k in (BATCH_SHAPES[:1] if a.quick else BATCH_SHAPES)
             for m in ([1, 8, 32] if a.quick else BATCH_M)]
    rows, notes, peers = [], [], {}
    for n, k in bf16_shapes:
        bench_linear(gpu, timer, copy_gbs, "bf16", n, k, 1, rows, peers)
        if a.regs:
            bench_linear(gpu, timer, copy_gbs, "bf16", n, k, 1, rows, peers, raw="dense_gemv_bf16_regs")
    for fmt, regs in (("fp8_block", "w8a16_gemv_regs"), ("nvfp4", "w4a16_gemv_regs")):
        for n, k in quant_shapes:
            bench_linear(gpu, timer, copy_gbs, fmt, n, k, 1, rows, peers)
            if a.regs:
                bench_linear(gpu, timer, copy_gbs, fmt, n, k, 1, rows, peers, raw=regs)
    for n, k, m in batch:
        bench_linear(gpu, timer, copy_gbs, "bf16", n, k, m, rows, peers)
        if m == 1:  # the tensor-core kernel at one row, against the FMA kernel `linear` picks
            bench_linear(gpu, timer, copy_gbs, "bf16", n, k, m, rows, peers, raw="dense_gemv_bf16_batchm")
        if a.regs and m <= 8:
            bench_linear(gpu, timer, copy_gbs, "bf16", n, k, m, rows, peers, raw="dense_gemv_bf16_batchm_regs")
    bench_linear(gpu, timer, copy_gbs, "bf16", *PREFILL, rows, peers)
    bench_optional(gpu, timer, rows, notes)

    print(f"# GEMV benchmark on {name}: D2D copy {copy_gbs:.0f} GB/s (read + write), cold L2, "
          f"median of {timer.iters}\n")
    print("| kernel | m x n x k | MB read | µs | GB/s read | % copy BW | cuBLAS µs | ours / cuBLAS |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kernel']} | {r['shape']} | {r['mb_read']:.1f} | {r['us']:.1f} | {r['gbs']:.0f} | "
              f"{r['pct_copy']:.0f} | {r['cublas_us']:.1f} ({r['cublas_dtype']}) | {r['ratio']:.2f} |")
    print("\ncuBLAS column: cupy.matmul on a bf16 (or, without cupy bf16, f16-viewed) weight of the same shape;"
          " for fp8/nvfp4 rows that is the bf16 baseline, not the same bytes.")
    for note in notes:
        print(note)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(gpu=name, copy_gbs=copy_gbs, rows=rows, notes=notes), f, indent=1)


if __name__ == "__main__":
    run_main(main)
