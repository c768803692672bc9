"""GEMV benchmark on one CUDA GPU: achieved read bandwidth per kernel and shape, against the measured D2D copy
bandwidth and cuBLAS (cupy.matmul) on the same bytes, cold L2.

    python scripts/bench_kernels.py [--quick] [--v0] [--iters N] [--json PATH]
    python scripts/bench_kernels.py --sweep [--iters N] [--json PATH]

--v0 adds the register-round kernels (*_regs) next to the streaming defaults. --sweep times, per key
shape, the v0 kernel, the default launch plan and a grid of plans (ks warps per block, ring stages, resident
warps per SM: ops.gemv.Tune), then rms_norm over thread counts, and prints which configuration wins.

Each timed launch follows a 256 MB memset that evicts L2 (50 MB on H100/H200); the memset also covers the
Python launch overhead, so the events bracket GPU time only. Medians of CUDA-event times after warm-up."""
from __future__ import annotations

import argparse
import json

import cupy as cp
import ml_dtypes
import numpy as np

import mtp_cupy
from mtp_cupy import ops
from mtp_cupy.runtime.ptr import DevicePtr
from mtp_cupy.weights.linear import Linear

BF16_SHAPES = [(129280, 7168), (154880, 6144), (151936, 2048), (7168, 14336), (4096, 2048)]
QUANT_SHAPES = [(129280, 7168), (7168, 14336), (7168, 2048), (2048, 7168)]
BATCH_SHAPES = [(7168, 14336), (129280, 7168)]
BATCH_M = [1, 2, 4, 8, 16, 32]
PREFILL = (7168, 2048, 512)  # n, k, m: the tiled GEMM path
FLUSH_BYTES = 256 << 20


class Timer:
    def __init__(self, iters: int) -> None:
        self.iters = iters
        self.flush = cp.empty(FLUSH_BYTES, cp.uint8)
        self.t0, self.t1 = cp.cuda.Event(), cp.cuda.Event()

    def us(self, fn) -> float:
        for _ in range(3):
            fn()
        ts = []
        for i in range(self.iters):
            self.flush.fill(i & 0xFF)
            self.t0.record()
            fn()
            self.t1.record()
            self.t1.synchronize()
            ts.append(cp.cuda.get_elapsed_time(self.t0, self.t1) * 1e3)
        return float(np.median(ts))


def copy_bandwidth(timer: Timer) -> float:
    """D2D copy, bytes read + written per second."""
    a = cp.empty(1 << 30, cp.uint8)
    b = cp.empty_like(a)
    t = timer.us(lambda: b.data.copy_from_device_async(a.data, a.nbytes))
    return 2 * a.nbytes / t * 1e-3  # GB/s


def ptr(a) -> DevicePtr:
    return DevicePtr(a.data.ptr)


def rand_u(shape, lo: int, hi: int, dtype) -> cp.ndarray:
    return cp.random.randint(lo, hi, shape, dtype=cp.int32).astype(dtype)


def rand_bf16(shape) -> cp.ndarray:
    b = rand_u(shape, 0, 1 << 16, cp.uint16)
    return (b & 0x807F) | (120 << 7)  # |v| in [2^-7, 2^-6): finite, no overflow in any peer


def make_linear(fmt: str, n: int, k: int) -> tuple[Linear, list]:
    if fmt == "bf16":
        w = rand_bf16((n, k))
        return Linear(fmt, n, k, ptr(w)), [w]
    if fmt == "fp8_block":
        w = rand_u((n, k), 0, 0x7E, cp.uint8)
        s = cp.full((-(-n // 128), -(-k // 128)), 1e-3, cp.float32)
        return Linear(fmt, n, k, ptr(w), ptr(s)), [w, s]
    w = rand_u((n, k // 2), 0, 256, cp.uint8)
    s = rand_u((n, k // 16), 0x30, 0x50, cp.uint8)
    return Linear("nvfp4", n, k, ptr(w), ptr(s), 1e-3), [w, s]


def peer_matmul(w16: cp.ndarray, x16: cp.ndarray):
    """cuBLAS on the same bytes: bf16 when this cupy has it, else the bits viewed as fp16 (same traffic)."""
    try:
        dt = np.dtype(ml_dtypes.bfloat16)
        W, X = w16.view(dt), x16.view(dt)
        (W @ X[0]) if X.shape[0] == 1 else (X @ W.T)
        kind = "bf16"
    except Exception:
        W, X, kind = w16.view(cp.float16), x16.view(cp.float16), "f16"
    return (lambda: W @ X[0]) if X.shape[0] == 1 else (lambda: X @ W.T), kind


def raw_call(gpu, name: str, W: Linear, x, y, m: int, tune=None):
    """A raw launcher of cuda_src/gemv.cu on W (any format), f32 output; `tune` for streaming kernels."""
    fn, n, k = getattr(ops, name), W.n, W.k
    kw = {} if tune is None else {"tune": tune}
    if W.fmt == "bf16":
        return lambda: fn(gpu, W.weight, ptr(x), ptr(y), m, n, k, k, n, "f32", **kw)
    if W.fmt == "nvfp4":
        return lambda: fn(gpu, W.weight, W.scale, W.scale2, ptr(x), ptr(y), m, n, k, k, n, "f32", **kw)
    return lambda: fn(gpu, W.weight, W.scale, ptr(x), ptr(y), m, n, k, k, n, "f32", **kw)


def bench_linear(gpu, timer, copy_gbs, fmt, n, k, m, rows, peer_cache, raw: str | None = None):
    """ops.linear (or the raw launcher `raw`) on one shape, f32 output, plus its cuBLAS peer."""
    W, keep = make_linear(fmt, n, k)
    x = rand_bf16((m, k))
    y = cp.empty((m, n), cp.float32)
    if raw:
        t = timer.us(raw_call(gpu, raw, W, x, y, m))
    else:
        t = timer.us(lambda: ops.linear(gpu, ptr(x), W, ptr(y), m, out_dtype="f32"))
    read = W.weight_bytes + x.nbytes
    key = (n, k, m)
    if key not in peer_cache:
        w16 = keep[0] if fmt == "bf16" else rand_bf16((n, k))
        fn, kind = peer_matmul(w16, x)
        peer_cache[key] = (timer.us(fn), kind)
        del w16, fn
    tp, kind = peer_cache[key]
    gbs = read / t * 1e-3
    rows.append(dict(kernel=f"{raw} ({fmt})" if raw else f"linear {fmt}", shape=f"{m}x{n}x{k}",
                     mb_read=read / 1e6, us=t, gbs=gbs,
                     pct_copy=100 * gbs / copy_gbs, cublas_us=tp, cublas_dtype=kind, ratio=t / tp))
    del keep, x, y
    cp.get_default_memory_pool().free_all_blocks()


def bench_optional(gpu, timer, rows, notes):
    """ops.argmax / ops.rms_norm when those launchers exist (other modules), against cupy."""
    n, d = 154880, 7168
    logits = cp.random.standard_normal(n, dtype=cp.float32)
    out_id = cp.empty(1, cp.int32)
    try:
        t = timer.us(lambda: ops.argmax(gpu, ptr(logits), n, ptr(out_id), dtype="f32"))
        tp = timer.us(lambda: cp.argmax(logits))
        rows.append(dict(kernel="argmax f32", shape=str(n), mb_read=logits.nbytes / 1e6, us=t,
                         gbs=logits.nbytes / t * 1e-3, pct_copy=float("nan"), cublas_us=tp,
                         cublas_dtype="cupy.argmax", ratio=t / tp))
    except (AttributeError, TypeError, mtp_cupy.KernelError) as e:
        notes.append(f"argmax skipped: {e}")
    noop = cp.RawKernel('extern "C" __global__ void noop() {}', "noop")
    t = timer.us(lambda: noop((1,), (32,), ()))
    rows.append(dict(kernel="empty kernel (timing floor)", shape="1 block", mb_read=0.0, us=t, gbs=float("nan"),
                     pct_copy=float("nan"), cublas_us=float("nan"), cublas_dtype="-", ratio=float("nan")))
    x, w = rand_bf16((1, d)), rand_bf16(d)
    yb = cp.empty_like(x)
    try:
        t = timer.us(lambda: ops.rms_norm(gpu, ptr(x), ptr(w), ptr(yb), 1, d, 1e-6))
        rows.append(dict(kernel="rms_norm", shape=f"1x{d}", mb_read=(x.nbytes + w.nbytes) / 1e6, us=t,
                         gbs=float("nan"), pct_copy=float("nan"), cublas_us=float("nan"), cublas_dtype="-",
                         ratio=float("nan")))
    except (AttributeError, TypeError, mtp_cupy.KernelError) as e:
        notes.append(f"rms_norm skipped: {e}")
    r = rand_bf16((1, d))
    try:  # the fused residual add + norm against the two launches it replaces
        t = timer.us(lambda: ops.add_rms_norm(gpu, ptr(x), ptr(r), ptr(w), ptr(yb), 1, d, 1e-6))
        tp = timer.us(lambda: (ops.bf16_residual_add(gpu, ptr(x), ptr(r), d),
                               ops.rms_norm(gpu, ptr(x), ptr(w), ptr(yb), 1, d, 1e-6)))
        rows.append(dict(kernel="add_rms_norm", shape=f"1x{d}", mb_read=(2 * x.nbytes + w.nbytes) / 1e6, us=t,
                         gbs=float("nan"), pct_copy=float("nan"), cublas_us=tp,
                         cublas_dtype="residual_add + rms_norm", ratio=t / tp))
    except (AttributeError, TypeError, mtp_cupy.KernelError) as e:
        notes.append(f"add_rms_norm skipped: {e}")


# -- --sweep ------------------------------------------------------------------------------------------------
# (fmt, n, k, m, streaming kernel to sweep, its v0 kernel or None)
SWEEP = [("bf16", 7168, 14336, 1, "dense_gemv_bf16", "dense_gemv_bf16_regs"),
         ("bf16", 129280, 7168, 1, "dense_gemv_bf16", "dense_gemv_bf16_regs"),
         ("bf16", 151936, 2048, 1, "dense_gemv_bf16", "dense_gemv_bf16_regs"),
         ("bf16", 4096, 2048, 1, "dense_gemv_bf16", "dense_gemv_bf16_regs"),
         ("bf16", 7168, 14336, 1, "dense_gemv_bf16_batchm", "dense_gemv_bf16_batchm_regs"),
         ("bf16", 7168, 14336, 8, "dense_gemv_bf16_batchm", "dense_gemv_bf16_batchm_regs"),
         ("bf16", 7168, 14336, 32, "dense_gemv_bf16_batch32", None),
         ("fp8_block", 7168, 14336, 1, "w8a16_gemv", "w8a16_gemv_regs"),
         ("fp8_block", 129280, 7168, 1, "w8a16_gemv", "w8a16_gemv_regs"),
         ("fp8_block", 7168, 2048, 1, "w8a16_gemv", "w8a16_gemv_regs"),
         ("fp8_block", 7168, 14336, 8, "w8a16_gemv", "w8a16_gemv_regs"),
         ("nvfp4", 7168, 14336, 1, "w4a16_gemv", "w4a16_gemv_regs"),
         ("nvfp4", 129280, 7168, 1, "w4a16_gemv", "w4a16_gemv_regs"),
         ("nvfp4", 2048, 7168, 1, "w4a16_gemv", "w4a16_gemv_regs")]
SWEEP_KS = (1, 2, 4, 8, 16)
SWEEP_STAGES = (2, 3, 4, 6, 8)
SWEEP_WPS = (8, 16, 24, 32)
RMS_THREADS = (224, 256, 448, 512, 896, 1024)


def sweep(gpu, timer, copy_gbs, top: int) -> dict:
    from mtp_cupy.ops.gemv import _GEOM, Tune
    from mtp_cupy.ops.rms_norm import _threads
    out = {"gemv": [], "summary": [], "rms_norm": []}
    summary = []
    for fmt, n, k, m, name, v0 in SWEEP:
        W, keep = make_linear(fmt, n, k)
        x = rand_bf16((m, k))
        y = cp.empty((m, n), cp.float32)
        read = W.weight_bytes + x.nbytes
        sms = cp.cuda.runtime.getDeviceProperties(gpu.device_id)["multiProcessorCount"]
        rows = []

        def run(label, fn, plan=None):
            t = timer.us(fn)
            r = dict(shape=f"{fmt} {m}x{n}x{k}", kernel=name, variant=label, us=t, gbs=read / t * 1e-3,
                     pct_copy=100 * read / t * 1e-3 / copy_gbs)
            if plan is not None:
                r.update(ks=plan.ks, blocks=plan.blocks, stages=plan.stages, smem_kb=plan.smem / 1024,
                         warps_per_sm=plan.blocks * plan.ks / sms, score=plan.score)
            rows.append(r)
            return r

        if v0:
            run(f"v0 ({v0})", raw_call(gpu, v0, W, x, y, m))
        default = ops.plan_gemv(gpu, name, n, k)
        d = run("default", raw_call(gpu, name, W, x, y, m), default)
        seen = {default}
        max_ks = _GEOM[name].max_ks
        tunes = [(f"ks={ks} stages={st} wps={wps}", Tune(ks=ks, stages=st, warps_per_sm=wps))
                 for ks in SWEEP_KS for st in SWEEP_STAGES for wps in SWEEP_WPS if ks <= max_ks]
        tunes += [(f"ks={ks} stages=4 one tile per block", Tune(ks=ks, stages=4, blocks=1 << 30))
                  for ks in SWEEP_KS if ks <= max_ks]  # not persistent: a block per tile
        for label, tune in tunes:
            try:
                plan = ops.plan_gemv(gpu, name, n, k, tune)
            except mtp_cupy.KernelError:
                continue
            if plan in seen:
                continue
            seen.add(plan)
            run(label, raw_call(gpu, name, W, x, y, m, tune), plan)
        best = min(rows, key=lambda r: r["us"])
        print(f"\n### {fmt} {m}x{n}x{k} ({read / 1e6:.1f} MB read): {name}, {len(rows)} variants\n")
        print("| variant | ks | blocks | stages | smem KB | warps/SM | µs | GB/s | % copy BW | / default |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        shown = sorted(rows, key=lambda r: r["us"])[:top]
        shown += [r for r in rows if r not in shown and (r["variant"] == "default" or r["variant"].startswith("v0"))]
        for r in shown:
            geo = (f"{r['ks']} | {r['blocks']} | {r['stages']} | {r['smem_kb']:.0f} | {r['warps_per_sm']:.1f}"
                   if "ks" in r else "- | - | - | - | -")
            print(f"| {r['variant']} | {geo} | {r['us']:.1f} | {r['gbs']:.0f} | {r['pct_copy']:.0f} | "
                  f"{r['us'] / d['us']:.3f} |")
        v0r = next((r for r in rows if r["variant"].startswith("v0")), None)
        summary.append(dict(shape=f"{fmt} {m}x{n}x{k}", kernel=name, v0_us=v0r["us"] if v0r else float("nan"),
                            default_us=d["us"], default_gbs=d["gbs"], best_us=best["us"], best_gbs=best["gbs"],
                            best=best["variant"] + (f" (ks={best['ks']} blocks={best['blocks']} "
                                                    f"stages={best['stages']})" if "ks" in best else "")))
        out["gemv"] += rows
        del keep, x, y, W
        cp.get_default_memory_pool().free_all_blocks()

    print("\n### Summary: v0 vs default plan vs best plan\n")
    print("| shape | kernel | v0 µs | default µs | default GB/s | best µs | best GB/s | best variant |")
    print("|---|---|---|---|---|---|---|---|")
    for r in summary:
        print(f"| {r['shape']} | {r['kernel']} | {r['v0_us']:.1f} | {r['default_us']:.1f} | {r['default_gbs']:.0f} | "
              f"{r['best_us']:.1f} | {r['best_gbs']:.0f} | {r['best']} |")
    m1 = next((r for r in summary if r["shape"] == "bf16 1x7168x14336" and r["kernel"] == "dense_gemv_bf16"), None)
    m8 = next((r for r in summary if r["shape"] == "bf16 8x7168x14336"), None)
    if m1 and m8:
        print(f"\nbatched M=8 / M=1 (7168x14336, default plans): {m8['default_us'] / m1['default_us']:.2f} "
              f"(best plans: {m8['best_us'] / m1['best_us']:.2f})")
    out["summary"] = summary

    d = 7168
    noop = cp.RawKernel('extern "C" __global__ void noop() {}', "noop")
    floor = timer.us(lambda: noop((1,), (32,), ()))
    x, w = rand_bf16((1, d)), rand_bf16(d)
    yb = cp.empty_like(x)
    print(f"\n### rms_norm 1x{d} over threads per block (empty-kernel floor {floor:.2f} µs)\n")
    print("| threads | µs |")
    print("|---|---|")
    default_t = _threads("rms_norm_w", d)
    for th in RMS_THREADS:
        t = timer.us(lambda: ops.rms_norm(gpu, ptr(x), ptr(w), ptr(yb), 1, d, 1e-6, threads=th))
        out["rms_norm"].append(dict(threads=th, us=t, floor_us=floor))
        print(f"| {th}{' (default)' if th == default_t else ''} | {t:.2f} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a few shapes only")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    ap.add_argument("--v0", action="store_true", help="also time the register-round (*_regs) GEMV kernels")
    ap.add_argument("--sweep", action="store_true", help="launch-plan sweep of the streaming GEMV kernels")
    ap.add_argument("--top", type=int, default=8, help="--sweep: fastest plans shown per shape")
    a = ap.parse_args()
    gpu = mtp_cupy.device("cuda")
    timer = Timer(10 if a.quick else 20 if a.sweep and a.iters == 30 else a.iters)
    copy_gbs = copy_bandwidth(timer)
    if a.sweep:
        name = cp.cuda.runtime.getDeviceProperties(gpu.device_id)["name"]
        name = name.decode() if isinstance(name, bytes) else name
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
        if a.v0:
            bench_linear(gpu, timer, copy_gbs, "bf16", n, k, 1, rows, peers, raw="dense_gemv_bf16_regs")
    for fmt, v0 in (("fp8_block", "w8a16_gemv_regs"), ("nvfp4", "w4a16_gemv_regs")):
        for n, k in quant_shapes:
            bench_linear(gpu, timer, copy_gbs, fmt, n, k, 1, rows, peers)
            if a.v0:
                bench_linear(gpu, timer, copy_gbs, fmt, n, k, 1, rows, peers, raw=v0)
    for n, k, m in batch:
        bench_linear(gpu, timer, copy_gbs, "bf16", n, k, m, rows, peers)
        if m == 1:  # the tensor-core kernel at one row, against the FMA kernel `linear` picks
            bench_linear(gpu, timer, copy_gbs, "bf16", n, k, m, rows, peers, raw="dense_gemv_bf16_batchm")
        if a.v0 and m <= 8:
            bench_linear(gpu, timer, copy_gbs, "bf16", n, k, m, rows, peers, raw="dense_gemv_bf16_batchm_regs")
    bench_linear(gpu, timer, copy_gbs, "bf16", *PREFILL, rows, peers)
    bench_optional(gpu, timer, rows, notes)

    name = cp.cuda.runtime.getDeviceProperties(gpu.device_id)["name"]
    name = name.decode() if isinstance(name, bytes) else name
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
    main()
