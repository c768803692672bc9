"""The GEMV launch-plan sweep (scripts/bench_kernels.py --sweep): per key shape, the register-round kernel, the default
launch plan and a grid of plans (ops.gemv.Tune), then rms_norm over thread counts; prints which wins. CuPy
is imported inside `sweep`."""
from __future__ import annotations

from ..errors import KernelError
from .gemv import make_linear, ptr, rand_bf16, raw_call

# (fmt, n, k, m, streaming kernel to sweep, its register-round kernel or None)
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
         ("nvfp4", 2048, 7168, 1, "w4a16_gemv", "w4a16_gemv_regs"),
         ("fp8_block_e8m0", 1024, 4096, 1, "w8a16_gemv_e8m0", None),  # V4's wq_a: 64 row tiles (split-K)
         ("fp8_block", 576, 7168, 1, "w8a16_gemv", "w8a16_gemv_regs")]  # V3's kv_a: 36 row tiles
SWEEP_KS = (1, 2, 4, 8, 16)
SWEEP_STAGES = (2, 3, 4, 6, 8)
SWEEP_WPS = (8, 16, 24, 32)
SWEEP_KB = (2, 4, 8)  # blocks per cluster splitting k (the tensor-core kernels)
RMS_THREADS = (224, 256, 448, 512, 896, 1024)


def sweep(gpu, timer, copy_gbs, top: int) -> dict:
    """Per SWEEP shape: the register-round kernel, the default plan and a grid of plans (ks warps per block, ring stages,
    resident warps per SM), the fastest `top` of them printed; then rms_norm over thread counts. `gpu`, `timer`
    and `copy_gbs` as for `gemv.bench_linear`. Returns every row (gemv, summary, rms_norm)."""
    import cupy as cp

    from .. import ops
    from ..ops.gemv import _GEOM, Tune
    from ..ops.rms_norm import _threads
    out = {"gemv": [], "summary": [], "rms_norm": []}
    summary = []
    for fmt, n, k, m, name, regs in SWEEP:
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
                r.update(ks=plan.ks, kb=plan.kb, blocks=plan.blocks, stages=plan.stages, smem_kb=plan.smem / 1024,
                         warps_per_sm=plan.blocks * plan.kb * plan.ks / sms, score=plan.score)
            rows.append(r)
            return r

        if regs:
            run(f"regs ({regs})", raw_call(gpu, regs, W, x, y, m))
        default = ops.plan_gemv(gpu, name, n, k)
        d = run("default", raw_call(gpu, name, W, x, y, m), default)
        seen = {default}
        max_ks = _GEOM[name].max_ks
        tunes = [(f"ks={ks} stages={st} wps={wps}", Tune(ks=ks, stages=st, warps_per_sm=wps))
                 for ks in SWEEP_KS for st in SWEEP_STAGES for wps in SWEEP_WPS if ks <= max_ks]
        tunes += [(f"ks={ks} stages=4 one tile per block", Tune(ks=ks, stages=4, blocks=1 << 30))
                  for ks in SWEEP_KS if ks <= max_ks]  # not persistent: a block per tile
        if _GEOM[name].max_kb > 1:
            tunes += [(f"ks={ks} kb={kb} stages={st}", Tune(ks=ks, kb=kb, stages=st))
                      for ks in SWEEP_KS for kb in SWEEP_KB for st in (2, 4) if ks <= max_ks]
        for label, tune in tunes:
            try:
                plan = ops.plan_gemv(gpu, name, n, k, tune)
            except KernelError:
                continue
            if plan in seen:
                continue
            seen.add(plan)
            run(label, raw_call(gpu, name, W, x, y, m, tune), plan)
        best = min(rows, key=lambda r: r["us"])
        print(f"\n### {fmt} {m}x{n}x{k} ({read / 1e6:.1f} MB read): {name}, {len(rows)} variants\n")
        print("| variant | ks x kb | walkers | stages | smem KB | warps/SM | µs | GB/s | % copy BW | / default |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        shown = sorted(rows, key=lambda r: r["us"])[:top]
        shown += [r for r in rows if r not in shown and (r["variant"] == "default" or r["variant"].startswith("regs"))]
        for r in shown:
            geo = (f"{r['ks']} x {r['kb']} | {r['blocks']} | {r['stages']} | {r['smem_kb']:.0f} | "
                   f"{r['warps_per_sm']:.1f}" if "ks" in r else "- | - | - | - | -")
            print(f"| {r['variant']} | {geo} | {r['us']:.1f} | {r['gbs']:.0f} | {r['pct_copy']:.0f} | "
                  f"{r['us'] / d['us']:.3f} |")
        regsr = next((r for r in rows if r["variant"].startswith("regs")), None)
        summary.append(dict(shape=f"{fmt} {m}x{n}x{k}", kernel=name, regs_us=regsr["us"] if regsr else float("nan"),
                            default_us=d["us"], default_gbs=d["gbs"], best_us=best["us"], best_gbs=best["gbs"],
                            best=best["variant"] + (f" (ks={best['ks']} kb={best['kb']} blocks={best['blocks']} "
                                                    f"stages={best['stages']})" if "ks" in best else "")))
        out["gemv"] += rows
        del keep, x, y, W
        cp.get_default_memory_pool().free_all_blocks()

    print("\n### Summary: register-round vs default plan vs best plan\n")
    print("| shape | kernel | regs µs | default µs | default GB/s | best µs | best GB/s | best variant |")
    print("|---|---|---|---|---|---|---|---|")
    for r in summary:
        print(f"| {r['shape']} | {r['kernel']} | {r['regs_us']:.1f} | {r['default_us']:.1f} | {r['default_gbs']:.0f} | "
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
