"""MoE layer benchmark on one CUDA GPU at real expert dims: MoE.forward, batch-invariant as drafters run it, on
the FMA expert GEMVs ("fma", expert_kernels="plain") against the grouped tensor-core GEMMs ("mma",
expert_kernels="grouped": each chosen expert read once for all its rows) at several batch widths; cold L2, CUDA
events around a replayed CUDA graph of the forward, medians; bytes read (router, the distinct experts the rows
chose, the shared expert and its gate), their floor at the device-to-device copy bandwidth, and the % of it.

    python scripts/bench_moe.py [--models deepseek_v3,qwen3_next_bf16,qwen3_next_nvfp4,deepseek_v4]
                                [--batches 1,8,32,64] [--iters N] [--json PATH]

Weights are random and every expert has its own memory (nothing is shared through L2); inputs are random, so
the router's choices are about uniform: more distinct experts are read than a trained router picks (the
DeepSeek-V3 B = 64 step measured on an H200 read 122 of 256). GB/s counts each chosen expert's bytes once."""
from __future__ import annotations

import json

import numpy as np

import mtp_cupy
from mtp_cupy.bench import EventTimer, copy_bandwidth, device_name, free_device_memory
from mtp_cupy.bench.cli import Parser, positive_int, run_main
from mtp_cupy.bench.random_device import RandomDevice
from mtp_cupy.layers.moe import MoE, MoeConfig
from mtp_cupy.weights.linear import Linear

# routed experts (format), shared expert (format), MoeConfig
MODELS = {
    "deepseek_v3": ("fp8_block", "fp8_block", dict(n_experts=256, top_k=8, hidden=7168, inter=2048,
                                                   routing="sigmoid_grouped", n_group=8, topk_group=4,
                                                   routed_scaling=2.5), 2048, False),
    "qwen3_next_bf16": ("bf16", "bf16", dict(n_experts=512, top_k=10, hidden=2048, inter=512, routing="softmax"),
                        512, True),
    "qwen3_next_nvfp4": ("nvfp4", "nvfp4", dict(n_experts=512, top_k=10, hidden=2048, inter=512,
                                                routing="softmax"), 512, True),
    "deepseek_v4": ("mxfp4", "fp8_block_e8m0", dict(n_experts=256, top_k=6, hidden=4096, inter=2048,
                                                    routing="sqrtsoftplus", routed_scaling=1.5, swiglu_limit=10.0),
                    2048, False),
}


def weight(rd: RandomDevice, fmt: str, n: int, k: int) -> Linear:
    if fmt == "bf16":
        return rd.linears(1, n, k)[0]
    if fmt == "fp8_block":
        return rd.fp8_block(n, k)
    if fmt == "fp8_block_e8m0":
        return rd.fp8(n, k)
    if fmt == "mxfp4":
        return rd.mxfp4(n, k)
    # nvfp4: e4m3 block scales in [2^-6, 1.875] (codes & 0x3F), a global scale of about 1 / (sqrt(k) * 3)
    return Linear("nvfp4", n, k, rd.codes(n * k // 2), rd.codes(n * k // 16, 0x3F), float(k ** -0.5 / 3))


def build(gpu, rd: RandomDevice, model: str):
    fmt, sfmt, cfg, si, gated = MODELS[model]
    c = MoeConfig(**cfg)
    D, I = c.hidden, c.inter
    experts = {e: (weight(rd, fmt, I, D), weight(rd, fmt, I, D), weight(rd, fmt, D, I)) for e in range(c.n_experts)}
    kw = dict(router=rd.linears(1, c.n_experts, D)[0],
              shared=(weight(rd, sfmt, si, D), weight(rd, sfmt, si, D), weight(rd, sfmt, D, si)))
    if c.routing in ("sigmoid_grouped", "sqrtsoftplus"):
        kw["bias"] = rd.f32(c.n_experts, 0.01)
    if gated:
        kw["shared_gate"] = rd.linears(1, 1, D)[0]
    return c, {kind: MoE(gpu, c, experts=experts, max_rows=64, **kw, **opts) for kind, opts in
               (("fma", dict(invariant=True, expert_kernels="plain")),
                ("mma", dict(invariant=True, expert_kernels="grouped")))}


def main() -> None:
    ap = Parser(__doc__)
    ap.add_argument("--models", default=",".join(MODELS), help="comma list of " + ", ".join(MODELS))
    ap.add_argument("--batches", default="1,8,32,64", help="comma list of rows per forward (at most 64)")
    ap.add_argument("--iters", type=positive_int, default=20, help="timed forwards per point")
    ap.add_argument("--seed", type=int, default=0, help="seed of the weights and inputs")
    ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON (default: none)")
    a = ap.parse_args()
    models = [m for m in a.models.split(",") if m]
    bad = [m for m in models if m not in MODELS]
    batches = [int(b) for b in a.batches.split(",") if b]
    if bad or not all(1 <= b <= 64 for b in batches):
        ap.error(f"unknown model {bad[0]!r}" if bad else f"batches {batches} must be in [1, 64]")
    gpu = mtp_cupy.device("cuda")
    stream = gpu.new_stream()
    timer = EventTimer.cupy(iters=a.iters, warmup=3, sync_flush=False)
    copy_gbs = copy_bandwidth(gpu) / 1e9
    print(f"# MoE.forward on {device_name(gpu)}: D2D copy {copy_gbs:.0f} GB/s (read + write), cold L2, median of "
          f"{a.iters}")
    print(f"{'model':18s} {'m':>3s} {'experts':>7s} {'MB':>8s} {'floor us':>8s} | {'fma us':>8s} {'%copy':>6s} | "
          f"{'mma us':>8s} {'%copy':>6s} | mma speedup")
    rows = []
    for model in models:
        rd = RandomDevice(gpu, a.seed)
        cfg, layers = build(gpu, rd, model)
        for m in batches:
            x, o = rd.bf16(m * cfg.hidden, 1.0), gpu.alloc(2 * m * cfg.hidden)
            res = {}
            for kind, moe in layers.items():   # a captured graph: the host's launch calls would dominate m = 1
                moe.forward(x, o.ptr, m, stream=stream)
                graph = gpu.capture(lambda: moe.forward(x, o.ptr, m, stream=stream), stream)
                res[kind] = timer.us(lambda: gpu.replay(graph, stream), stream=stream)
            chosen = len(layers["mma"].selected_experts(m))
            nbytes = layers["mma"].weight_bytes_per_step(m, experts=chosen)
            floor = nbytes / (copy_gbs * 1e3)
            pct = {k: 100 * floor / us for k, us in res.items()}
            rows.append(dict(model=model, m=m, experts=chosen, bytes=nbytes, floor_us=floor, fma_us=res["fma"],
                             mma_us=res["mma"]))
            print(f"{model:18s} {m:3d} {chosen:7d} {nbytes / 1e6:8.1f} {floor:8.1f} | {res['fma']:8.1f} "
                  f"{pct['fma']:5.0f}% | {res['mma']:8.1f} {pct['mma']:5.0f}% | {res['fma'] / res['mma']:.2f}x",
                  flush=True)
        del layers, rd
        free_device_memory()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(gpu=device_name(gpu), copy_gbs=copy_gbs, rows=rows), f, indent=1)
    assert np.isfinite([r["mma_us"] for r in rows]).all()


if __name__ == "__main__":
    run_main(main)
