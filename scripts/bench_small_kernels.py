"""Per-launch µs of a draft step's small kernels (V4's mHC, the MoE routers, RMSNorm) at real dims, each
captured as a CUDA graph of --launches back-to-back launches and timed with CUDA events (median of --reps
replays): the cost a kernel adds inside a step's graph, launch included, without ncu's idle-clock gaps.

    python scripts/bench_small_kernels.py [--launches 50] [--reps 5] [--rows 1,8,64]

The inputs stay in L2 across a graph's launches, so these are the kernels' latency floors, not cold-L2
times; `profile_step.py --events` times the same kernels inside a real step. `--device ref` runs every case
once on the NumPy device and times nothing (a check that the launches still match their ops)."""
from __future__ import annotations

import numpy as np

import mtp_cupy
from mtp_cupy import ops
from mtp_cupy.bench.cli import Parser, int_list, positive_int, run_main
from mtp_cupy.ops._util import launch
from mtp_cupy.ops.hyper_connection import mix_chunks


def mhc_cases(gpu, rows: int, s=None, keep: list | None = None) -> list[tuple[str, object]]:
    """(name, launch) of V4's mHC kernels on `rows` rows of 4 streams x 4096, on stream `s`. The buffers go into
    `keep` (the caller holds them while the launches run)."""
    keep = [] if keep is None else keep
    hc, dim = 4, 4096
    mix = (2 + hc) * hc
    rng = np.random.default_rng(0)
    X = gpu.upload(np.zeros((rows, hc, dim), np.uint16) + 0x3c00)       # bf16 1.0
    fn = gpu.upload((rng.standard_normal((mix, hc * dim)) * 0.01).astype(np.float32))
    scale, base = gpu.upload(np.ones(3, np.float32)), gpu.upload(np.zeros(mix, np.float32))
    xo, post, comb = gpu.alloc(2 * rows * dim), gpu.alloc(4 * rows * hc), gpu.alloc(4 * rows * hc * hc)
    work, Y = gpu.alloc(ops.hc_work_bytes(rows, dim, hc)), gpu.alloc(2 * rows * hc * dim)
    keep += [X, fn, scale, base, xo, post, comb, work, Y]

    def pre_only(iters):
        return lambda: launch(gpu, "hyper_connection", "hc_pre").grid(rows, 4).block(256) \
            .arg_ptr(X.ptr).arg_ptr(work.ptr).arg_ptr(scale.ptr).arg_ptr(base.ptr).arg_ptr(xo.ptr) \
            .arg_ptr(post.ptr).arg_ptr(comb.ptr).arg_u32(rows).arg_u32(dim).arg_u32(hc) \
            .arg_u32(mix_chunks(hc * dim)).arg_f32(1e-6).arg_f32(1e-6).arg_u32(iters).launch(s)

    r = f", {rows} rows" if rows > 1 else ""
    return [
        (f"hc_mix (mix 24){r}", lambda: ops.hc_mix(gpu, X.ptr, fn.ptr, work.ptr, rows, dim, hc, mix, stream=s)),
        (f"hc_pre finishing kernel, 20 Sinkhorn iterations{r}", pre_only(20)),
        (f"hc_pre finishing kernel, 1 Sinkhorn iteration{r}", pre_only(1)),
        (f"hc_pre (hc_mix + hc_pre, 20 iterations){r}", lambda: ops.hc_pre(
            gpu, X.ptr, fn.ptr, scale.ptr, base.ptr, xo.ptr, post.ptr, comb.ptr, work.ptr, rows, dim, hc, 1e-6, 1e-6,
            20, stream=s)),
        (f"hc_post{r}", lambda: ops.hc_post(gpu, xo.ptr, X.ptr, post.ptr, comb.ptr, Y.ptr, rows, dim, hc, stream=s)),
        (f"hc_post from Sinkhorn logits, 20 iterations{r}", lambda: ops.hc_post(
            gpu, xo.ptr, X.ptr, post.ptr, comb.ptr, Y.ptr, rows, dim, hc, s, 1e-6, 20)),
        (f"hc_head (hc_mix + hc_head){r}", lambda: ops.hc_head(gpu, X.ptr, fn.ptr, scale.ptr, base.ptr, xo.ptr,
                                                               work.ptr, rows, dim, hc, 1e-6, 1e-6, stream=s)),
        (f"hc_add{r}", lambda: ops.hc_add(gpu, X.ptr, xo.ptr, rows, dim, hc, stream=s)),
        (f"hc_expand (about an empty kernel){r}", lambda: ops.hc_expand(gpu, xo.ptr, Y.ptr, rows, dim, hc, stream=s)),
    ]


def rest_cases(gpu, s=None, keep: list | None = None) -> list[tuple[str, object]]:
    """(name, launch) of RMSNorm at V4's and V3's widths and the routers' top-k, one row."""
    keep = [] if keep is None else keep
    rng = np.random.default_rng(0)
    out = []
    for dim in (4096, 7168):
        x, w, y = gpu.upload(np.full(dim, 0x3c00, np.uint16)), gpu.upload(np.full(dim, 0x3f80, np.uint16)), \
            gpu.alloc(2 * dim)
        keep += [x, w, y]
        out.append((f"rms_norm {dim} bf16", lambda x=x, w=w, y=y, dim=dim: ops.rms_norm(
            gpu, x.ptr, w.ptr, y.ptr, 1, dim, 1e-6, stream=s)))
    for E, K in ((512, 10), (256, 6)):
        lg, ids, ww = gpu.upload(rng.standard_normal(E).astype(np.float32)), gpu.alloc(4 * K), gpu.alloc(4 * K)
        keep += [lg, ids, ww]
        out.append((f"moe_topk_softmax E={E} k={K}", lambda lg=lg, ids=ids, ww=ww, E=E, K=K: ops.moe_topk_softmax(
            gpu, lg.ptr, ids.ptr, ww.ptr, 1, E, K, stream=s)))
        out.append((f"moe_topk_sqrtsoftplus E={E} k={K}", lambda lg=lg, ids=ids, ww=ww, E=E, K=K:
                    ops.moe_topk_sqrtsoftplus(gpu, lg.ptr, 0, ids.ptr, ww.ptr, 1, E, K, stream=s)))
    return out


def timer(cp, s, launches: int, reps: int):
    """timed(name, f): prints the median µs a launch of f, from a graph of `launches` of them replayed `reps`
    times."""
    def timed(name, f):
        with s:
            f()
            s.synchronize()
            s.begin_capture()
            for _ in range(launches):
                f()
            g = s.end_capture()
        g.launch(stream=s)
        s.synchronize()
        e0, e1, ts = cp.cuda.Event(), cp.cuda.Event(), []
        for _ in range(reps):
            e0.record(s)
            g.launch(stream=s)
            e1.record(s)
            e1.synchronize()
            ts.append(1e3 * cp.cuda.get_elapsed_time(e0, e1) / launches)
        print(f"| {name} | {np.median(ts):.2f} |", flush=True)
    return timed


def main() -> int:
    ap = Parser(__doc__)
    ap.add_argument("--launches", type=positive_int, default=50, help="launches captured in each graph")
    ap.add_argument("--reps", type=positive_int, default=5, help="timed replays of each graph (the median is shown)")
    ap.add_argument("--rows", type=int_list, default=[1], help="rows (batch width) of the mHC kernels, comma list")
    ap.add_argument("--device", choices=["cuda", "ref"], default="cuda",
                    help="cuda (timed), or ref: run each case once on the NumPy device, time nothing")
    a = ap.parse_args()
    if any(r > 65535 for r in a.rows):
        ap.error(f"--rows must lie in 1..65535, got {a.rows}")
    gpu = mtp_cupy.device(a.device)      # a one-line ConfigError without CUDA
    keep: list = []
    if a.device == "ref":
        for name, f in [c for rows in a.rows for c in mhc_cases(gpu, rows, keep=keep)] + rest_cases(gpu, keep=keep):
            f()
            print(f"ran {name}")
        return 0
    import cupy as cp
    s = cp.cuda.Stream(non_blocking=True)
    timed = timer(cp, s, a.launches, a.reps)
    print("| kernel (V4 dims unless named) | µs per launch |\n|---|---|")
    for rows in a.rows:
        for name, f in mhc_cases(gpu, rows, s, keep):
            timed(name, f)
    for name, f in rest_cases(gpu, s, keep):
        timed(name, f)
    return 0


if __name__ == "__main__":
    run_main(main)
