"""Per-kernel profile of one draft step at real dims: which kernels a step launches, how long each takes and
how far each is from its own memory roofline. Two modes:

    # on the GPU machine: one eager propose(k=1) between cudaProfilerStart/Stop, under Nsight Compute
    ncu --profile-from-start off --clock-control none --cache-control all --csv --print-units base \\
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \\
        --log-file v4.csv python scripts/profile_step.py --family deepseek_v4
    # anywhere: the per-kernel table of that CSV (µs, MB moved, GB/s, % of the copy bandwidth)
    python scripts/profile_step.py --summarize v4.csv --copy-gbs 4200 --step-us 646

The profiled call runs with graphs off (ncu times each kernel alone, with L2 flushed before each: the sum of
kernel times is what the step costs without launch gaps). It also prints the graph-replay step time measured
with CUDA events (cold L2) in the same process, so "sum of kernels" vs "graph step" splits the gap between
kernel time and launch / dependency gaps.

`--events` times every kernel of one eager propose in place instead, without ncu: a CUDA event pair around
each launch, all of them queued behind a multi-GB memset so the kernels run back to back at the clocks and
with the L2 contents of a real step (ncu runs each kernel alone, after an idle gap, on an idle-clocked GPU).
Its table is per kernel name: launches, µs, share of the step."""
from __future__ import annotations

import csv
from collections import OrderedDict

from mtp_cupy.bench.cli import Parser, positive_int, run_main
from mtp_cupy.bench.drafter import FAMILIES

METRICS = {"gpu__time_duration.sum": "ns", "dram__bytes_read.sum": "read", "dram__bytes_write.sum": "write"}


def summarize(path: str, copy_gbs: float | None, step_us: float | None) -> str:
    """The ncu CSV (one row per kernel and metric) as a per-kernel-name table, launch order kept."""
    per_launch: dict[str, dict] = OrderedDict()
    with open(path, newline="") as f:
        lines = [ln for ln in f if ln.startswith('"')]          # ncu prefixes its own log lines with ==PROF==
    for r in csv.DictReader(lines):
        key = METRICS.get(r.get("Metric Name", ""))
        if key is None:
            continue
        d = per_launch.setdefault(r["ID"], {"name": r["Kernel Name"].split("(")[0]})
        d[key] = float(r["Metric Value"].replace(",", ""))
    rows: dict[str, dict] = OrderedDict()
    for d in per_launch.values():
        agg = rows.setdefault(d["name"], {"n": 0, "ns": 0.0, "read": 0.0, "write": 0.0})
        agg["n"] += 1
        for key in ("ns", "read", "write"):
            agg[key] += d.get(key, 0.0)
    tot_ns = sum(a["ns"] for a in rows.values())
    tot_b = sum(a["read"] + a["write"] for a in rows.values())
    out = [f"{len(per_launch)} launches, {len(rows)} kernels; sum of kernel times {tot_ns / 1e3:.1f} µs, "
           f"{tot_b / 1e6:.1f} MB moved" + (f"; floor at {copy_gbs:.0f} GB/s {tot_b / copy_gbs / 1e3:.1f} µs"
                                             if copy_gbs else "")
           + (f"; graph step {step_us:.1f} µs (gaps {step_us - tot_ns / 1e3:.1f} µs)" if step_us else ""), "",
           "| kernel | launches | µs | % of step kernels | MB read | MB written | GB/s | % of copy BW | "
           "µs at copy BW |", "|---|---|---|---|---|---|---|---|---|"]
    for name, a in sorted(rows.items(), key=lambda kv: -kv[1]["ns"]):
        b = a["read"] + a["write"]
        gbs = b / a["ns"] if a["ns"] else 0.0
        pct = f"{100 * gbs / copy_gbs:.0f}%" if copy_gbs else "-"
        ideal = f"{b / copy_gbs / 1e3:.1f}" if copy_gbs else "-"
        out.append(f"| {name} | {a['n']} | {a['ns'] / 1e3:.1f} | {100 * a['ns'] / tot_ns:.0f}% | "
                   f"{a['read'] / 1e6:.2f} | {a['write'] / 1e6:.2f} | {gbs:.0f} | {pct} | {ideal} |")
    return "\n".join(out)


def warmed(a):
    """(gpu, proposer, its propose callable, graph step µs): the real-dims family built, its graph replay timed
    (cold L2, CUDA events, median of 10), then left warmed up eagerly with graphs off."""
    import mtp_cupy
    from mtp_cupy.bench import EventTimer, median
    from mtp_cupy.bench.drafter import Drafter
    gpu = mtp_cupy.device("cuda")
    o = Drafter(a.family, gpu, a.ctx, a.k, a.batch)
    p, fn = o.prop, o.call(a.k, a.batch)
    timer = EventTimer.cupy()
    p.cuda_graphs = True
    for _ in range(3):
        fn()
    step = median(timer.time(fn, 10, p.stream)[0]) / a.k
    p.cuda_graphs = False
    for _ in range(2):
        fn()
    return gpu, p, fn, step


def profile(a) -> None:
    """One eager propose(k) of a real-dims family between cudaProfilerStart / Stop, after timing its graph
    replay (cold L2, CUDA events, median of 10)."""
    gpu, p, fn, step = warmed(a)        # a one-line ConfigError without CUDA
    import cupy as cp

    from mtp_cupy.bench import copy_bandwidth
    p.stream.synchronize()
    cp.cuda.runtime.profilerStart()
    fn()
    p.stream.synchronize()
    cp.cuda.runtime.profilerStop()
    print(f"# {a.family}: graph step {step:.1f} µs (k={a.k}, batch {a.batch}, ctx {a.ctx}, cold L2, median of 10); "
          f"copy {copy_bandwidth(gpu) / 1e9:.0f} GB/s", flush=True)


def timeline(a) -> None:
    """`--events`: per-kernel CUDA-event times of one eager propose(k), queued behind a blocking memset."""
    gpu, p, fn, step = warmed(a)
    import cupy as cp
    block = cp.empty(a.block_gb << 30, cp.uint8)
    launched, real = [], gpu.launch

    def launch(handle, grid, block_dim, shared, args, stream, *cluster):
        s = gpu._stream(stream)
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record(s)
        real(handle, grid, block_dim, shared, args, stream, *cluster)
        e1.record(s)
        launched.append((handle.name, e0, e1))

    p.stream.synchronize()
    cp.cuda.runtime.memsetAsync(block.data.ptr, 0, block.nbytes, p.stream.ptr)   # the queue fills behind it
    gpu.launch = launch
    try:
        fn()
    finally:
        gpu.launch = real
    p.stream.synchronize()
    per = OrderedDict()
    for name, e0, e1 in launched:
        d = per.setdefault(name, [0, 0.0])
        d[0] += 1
        d[1] += 1e3 * cp.cuda.get_elapsed_time(e0, e1)
    span = 1e3 * cp.cuda.get_elapsed_time(launched[0][1], launched[-1][2])
    total = sum(v[1] for v in per.values())
    print(f"# {a.family}: graph step {step:.1f} µs (k={a.k}, batch {a.batch}, ctx {a.ctx}); eager propose "
          f"{len(launched)} launches, kernels {total:.1f} µs, first to last event {span:.1f} µs "
          f"({total / a.k:.1f} / {span / a.k:.1f} µs per step)")
    print("\n| kernel | launches | µs | % of kernels |\n|---|---|---|---|")
    for name, (n, us) in sorted(per.items(), key=lambda kv: -kv[1][1]):
        print(f"| {name} | {n} | {us:.1f} | {100 * us / total:.0f}% |")


def main() -> None:
    ap = Parser(__doc__)
    ap.add_argument("--family", choices=FAMILIES, default="deepseek_v4", help="the family whose step is profiled")
    ap.add_argument("--ctx", type=positive_int, default=2048, help="drafter rows prefilled before the step")
    ap.add_argument("--k", type=positive_int, default=1, help="draft steps in the profiled propose")
    ap.add_argument("--batch", type=positive_int, default=1, help="sequences drafted together (propose_batch, up to 64)")
    ap.add_argument("--events", action="store_true", help="time each kernel in place with CUDA events instead "
                    "of under ncu (default: off)")
    ap.add_argument("--block-gb", type=positive_int, default=16,
                    help="GiB of the memset the --events launches queue behind; too small a one lets the host fall "
                    "behind and puts its gaps into the kernels' times (4 did for Qwen3-Next) (default: 16)")
    ap.add_argument("--summarize", metavar="CSV", help="print the per-kernel table of an ncu CSV and exit "
                    "(needs no GPU)")
    ap.add_argument("--copy-gbs", type=float, default=None,
                    help="copy bandwidth in GB/s for the roofline columns (default: none, columns show -)")
    ap.add_argument("--step-us", type=float, default=None,
                    help="graph step time in µs, to show the launch gaps (default: none)")
    a = ap.parse_args()
    if a.summarize:
        try:
            print(summarize(a.summarize, a.copy_gbs, a.step_us))
        except (OSError, KeyError, ValueError) as e:
            ap.error(f"--summarize {a.summarize}: not a readable ncu CSV ({type(e).__name__}: {e})")
    else:
        if a.batch > 64:
            ap.error(f"--batch {a.batch}: batches go up to 64")
        timeline(a) if a.events else profile(a)


if __name__ == "__main__":
    run_main(main)
