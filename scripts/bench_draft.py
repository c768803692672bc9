"""Draft-step benchmark on one GPU, one process: the mtp_cupy proposer of each family at its real dims (random
weights in the real formats, built on the device by mtp_cupy.bench) against the weight-bytes floor
and a plain-torch bf16 peer of the same step.

    python scripts/bench_draft.py --family all --ks 1,3 --json /tmp/bench_draft.json   # target: < 4 min, H200
    python scripts/bench_draft.py --family deepseek_v3 --ctx 4096 --ks 1,2,3,4 --iters 20 --json out.json
    python scripts/bench_draft.py --family all --quick                 # ctx 1024, ks 1,3, iters 10
    python scripts/bench_draft.py --family glm5 --ctx 4096 --ks 1,3    # GLM-5, one GPU: sparse (top-2048) MLA
    python scripts/bench_draft.py --family all --device ref --tiny --torch-cpu   # CPU smoke run of this code
    python scripts/bench_draft.py --family all --ks 1,3 --batches 1,2,4,8,16,32,64 --json b.json --plot b.png
    python scripts/bench_draft.py --from-json v4.json v3.json --plot b.png --plot-k 1   # re-print, re-plot, no run

Per family and k (drafts per propose): prefill --ctx drafter rows; warm up (propose + after_verify(0) three
times: eager, CUDA-graph capture, replay); then --iters timed calls, each after a 256 MB memset on the
proposer's stream (cold L2), with CUDA events on `prop.stream` around `propose(st, tok, h, ctx, k);
after_verify(st, 0)` and the wall clock around the same; again with `prop.cuda_graphs = False`. Reported per
draft step: GPU µs = event time / k, wall µs = wall / k, host µs = max(wall - GPU, 0) / k (medians). "graph
alone" replays the captured graph with nothing around it (same flush and events): the call's GPU µs less it is
the host path the events hold (checks, staging, reading results); the first-step overhead of the graph itself is
3/2 (graph alone at k = 1 - at k = 3). `--flush read` empties L2 with a read of the buffer instead (clean lines):
the difference is what the first kernels pay to write back the memset's dirty lines.
Floor µs = (weight_bytes_per_step + KV bytes read) / D2D copy bandwidth (read + write, median of 10 1-GiB
copies in this process); "% of floor" = step / floor (100% = at the floor).
Batch > 1 runs propose_batch (every family; graphed per batch bucket, like propose); the floor of a batch
counts the dense weights once, the distinct experts the step really selected (printed) and every sequence's KV.
Torch peers (bf16) run at every batch width too, built one width at a time after ours is freed, eager and under
torch.cuda.CUDAGraph, same cold-L2 timing: B sequences with their own caches, the projections one matmul over
the B rows, attention batched, the routed experts through torch._grouped_mm over the (row, expert) pairs sorted
by expert (each distinct expert read once; --torch-moe auto picks it for B > 1 when it runs on the device, and
falls back to gathering each row's experts, rows sharing an expert re-reading it, when it does not or fails at
capture; the table's notes say which ran). Their floor counts their own bf16 bytes and distinct experts.
--plot writes µs per step against the batch width, a panel per family (needs matplotlib).

Families: deepseek_v4, deepseek_v3, qwen3_next, glm5. GLM-5 runs here unsharded on one GPU (mtp_cupy.bench.glm5
REAL dims and random weights; the step's KV bytes are every indexer key row plus the
index_topk latent rows MLA attends); its 2-GPU (sharded heads / experts / vocab) numbers come from
`mpirun -n 2 python scripts/draft_glm.py --real-dims`."""
from __future__ import annotations

import datetime
import json
import sys
import time
import traceback

import mtp_cupy
from mtp_cupy.bench import copy_bandwidth, device_name, free_device_memory, torch_status
from mtp_cupy.bench.cli import Parser, device_flags, int_list, positive_int, run_main
from mtp_cupy.bench.draft_bench import DraftBenchConfig, run_family
from mtp_cupy.bench.draft_table import fmt, table
from mtp_cupy.bench.draft_plot import plot
from mtp_cupy.bench.drafter import FAMILIES, TITLES
from mtp_cupy.bench.timing import FLUSHES
from mtp_cupy.testing.torch_peers import MOE_PATHS


def parse_args():
    p = Parser(__doc__)
    p.add_argument("--family", choices=FAMILIES + ("all",), default="all", help="the family to time, or all")
    p.add_argument("--ctx", type=positive_int, default=None,
                   help="drafter rows before drafting (default 2048; 1024 with --quick, 32 with --tiny)")
    p.add_argument("--ks", type=int_list, default=None,
                   help="drafts per propose, comma list (default 1,2,3,4; 1,3 with --quick or --tiny)")
    p.add_argument("--batches", type=int_list, default="1",
                   help="batch widths (sequences drafted together) 1..64, comma list; every family and its torch "
                   "peer run each")
    p.add_argument("--iters", type=positive_int, default=None,
                   help="timed calls per point (default 20; 10 with --quick, 2 with --tiny)")
    p.add_argument("--json", default=None, help="write every number to this file (default: none)")
    p.add_argument("--plot", default=None, help="write a PNG of µs per draft step against the batch width, a "
                   "panel per family (needs matplotlib; skipped with a note without it)")
    p.add_argument("--plot-k", type=positive_int, default=None,
                   help="the k the plot shows (default: the largest k measured)")
    p.add_argument("--from-json", nargs="+", default=None, metavar="PATH",
                   help="measure nothing: re-print the tables of saved --json files, one run or one per family "
                   "(and --plot them together; the header is the first file's)")
    p.add_argument("--no-torch", action="store_true", help="skip the torch peers")
    p.add_argument("--torch-moe", choices=list(MOE_PATHS), default="auto",
                   help="the torch peers' routed-expert path: grouped (torch._grouped_mm, each distinct expert "
                   "once), gather (each row's experts copied out), or auto (gather at batch 1, else grouped where "
                   "it runs)")
    p.add_argument("--quick", action="store_true", help="ctx 1024, ks 1,3, iters 10 (unless given)")
    p.add_argument("--qwen-quant", choices=["bf16", "fp8", "nvfp4"], default="bf16",
                   help="Qwen3-Next projection format (the released checkpoint is bf16)")
    p.add_argument("--glm-head-fp8", action="store_true", help="GLM-5: draft from an FP8 (per-row scale) "
                   "copy of the BF16 head (head_fp8=True)")
    device_flags(p, tiny=False)
    p.add_argument("--tiny", action="store_true", help="tiny dims (smoke run; default ctx 32, ks 1,3, iters 2)")
    p.add_argument("--torch-cpu", action="store_true", help="run the torch peers on the CPU when torch has no CUDA "
                   "(smoke run of the peer code; use with --tiny)")
    p.add_argument("--no-batch-invariant", action="store_true", help="build the proposers with batch_invariant=False "
                   "(the fastest kernel per batch width; a sequence's drafts may then depend on its batch)")
    p.add_argument("--flush", choices=FLUSHES, default="memset", help="how L2 is emptied before each timed call: "
                   "memset leaves it full of dirty lines of the flush buffer, read (a sum of it) of clean ones "
                   "(default: memset)")
    p.add_argument("--catch-up", action="store_true", help="time ours as a serving step: after_verify_batch, the "
                   "row it dropped caught up by prefill_batch (one row a sequence), propose_batch; the floor stays "
                   "the draft step's (it does not count the catch-up's front pass)")
    p.add_argument("--hidden-on", choices=("host", "device"), default="host", help="where each call's hiddens "
                   "live: host (a NumPy array, checked for NaN and copied every call) or device (a device pointer "
                   "read in place, as a GPU target hands them over) (default: host)")
    p.add_argument("--no-pdl", action="store_true", help="launch kernels without programmatic dependent launch "
                   "(CUDA; by default each kernel's launch overlaps the end of the one before it)")
    a = p.parse_args()
    quick = dict(ctx=1024, ks=[1, 3], iters=10)
    tiny = dict(ctx=32, ks=[1, 3], iters=2)
    full = dict(ctx=2048, ks=[1, 2, 3, 4], iters=20)
    dflt = tiny if a.tiny else quick if a.quick else full
    for key, v in dflt.items():
        if getattr(a, key) is None:
            setattr(a, key, v)
    if max(a.batches) > 64:
        p.error(f"--batches {max(a.batches)}: batch widths go up to 64")
    return a


def replay(a) -> int:
    """--from-json: the tables (and --plot) of saved runs, each table with its own run's header."""
    fams, header = [], None
    for path in a.from_json:
        with open(path) as f:
            saved = json.load(f)
        header = header or saved["header"]
        for res in saved["families"]:
            print("\n" + table(res, saved["header"]) + "\n")
            fams.append(res)
    if a.plot:
        print(f"# {plot(fams, header, a.plot, a.plot_k)}")
    return 0


def main() -> int:
    a = parse_args()
    if a.from_json:
        return replay(a)
    fams = FAMILIES if a.family == "all" else (a.family,)
    cfg = DraftBenchConfig(ctx=a.ctx, ks=a.ks, batches=a.batches, iters=a.iters, seed=a.seed, tiny=a.tiny,
                           qwen_quant=a.qwen_quant, glm_head_fp8=a.glm_head_fp8, no_torch=a.no_torch,
                           torch_cpu=a.torch_cpu, torch_moe=a.torch_moe, batch_invariant=not a.no_batch_invariant,
                           flush=a.flush, hidden_on=a.hidden_on, catch_up=a.catch_up)
    t_start = time.perf_counter()
    gpu = mtp_cupy.device(a.device, pdl=not a.no_pdl)
    bw = copy_bandwidth(gpu)
    name = device_name(gpu)
    tstat = (False, "--no-torch") if a.no_torch else torch_status()
    header = dict(device=name, date=datetime.datetime.now().isoformat(timespec="seconds"),
                  copy_gbs=bw / 1e9 if bw else None, iters=a.iters, ctx=a.ctx, ks=a.ks, batches=a.batches,
                  torch=tstat[1], argv=sys.argv[1:], qwen_quant=a.qwen_quant, glm_head_fp8=a.glm_head_fp8, tiny=a.tiny,
                  torch_moe=a.torch_moe, pdl=not a.no_pdl, flush=a.flush, hidden_on=a.hidden_on,
                  catch_up=a.catch_up)
    print(f"# bench_draft: {name}; {header['date']}; copy bandwidth {fmt(header['copy_gbs'], 0)} GB/s; "
          f"families {', '.join(fams)}; ctx {a.ctx}; ks {a.ks}; batches {a.batches}; iters {a.iters}; "
          f"torch: {tstat[1]}", flush=True)
    results = []
    for fam in fams:
        t0 = time.perf_counter()
        try:
            res = run_family(fam, gpu, cfg, bw, tstat)
        except Exception:             # noqa: BLE001  (anything run_family itself did not catch)
            res = dict(family=fam, title=TITLES[fam], ctx=a.ctx, rows=[], notes=[], error=traceback.format_exc())
            print(res["error"], file=sys.stderr, flush=True)
            free_device_memory()
        res["wall_s"] = time.perf_counter() - t0
        results.append(res)
        try:
            print("\n" + table(res, header) + f"\n\n({fam}: {res['wall_s']:.1f} s)\n", flush=True)
        except Exception:             # noqa: BLE001  (the numbers still go to --json)
            traceback.print_exc()
    total = time.perf_counter() - t_start
    print(f"# total {total:.1f} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(header=header, total_s=total, families=results), f, indent=1, default=str)
        print(f"# wrote {a.json}")
    if a.plot:
        print(f"# {plot(results, header, a.plot, a.plot_k)}")
    return 1 if any(r.get("error") for r in results) else 0


if __name__ == "__main__":
    run_main(main)
