"""Qwen3-Next-80B-A3B MTP head at its real dims (hidden 2048, 16 heads / 2 KV heads of 256, 512 experts top-10,
vocab 151936) with random weights generated on the GPU: milliseconds per draft step for each quantisation and
batch width, next to the weight-bytes floor (bytes a step must read / measured device copy bandwidth).

    python scripts/run_real_dims_qwen.py                               # bf16, fp8, nvfp4 x batch 1 4 16 32
    python scripts/run_real_dims_qwen.py --quant nvfp4 --batch 1 32 --ctx 4096
    python scripts/run_real_dims_qwen.py --device ref --tiny --ctx 32  # CPU smoke run of the same code

Batch 1 times `propose`, wider batches `propose_batch`; each call drafts --drafts tokens over a context of
--ctx drafter rows per sequence (prefilled first), then `after_verify(0)` returns the rows."""
from __future__ import annotations

import time

import numpy as np

import mtp_cupy
from mtp_cupy.bench import copy_bandwidth
from mtp_cupy.bench import qwen3_next as dims
from mtp_cupy.bench.cli import Parser, device_flags, nonneg_int, positive_int, run_main
from mtp_cupy.models.qwen3_next import Qwen3NextMtpProposer
from mtp_cupy.runtime.dtypes import to_bf16
from mtp_cupy.weights.config import Qwen3NextConfig


def time_widths(prop: Qwen3NextMtpProposer, batches: list[int], ctx: int, drafts: int, iters: int, seed: int):
    """Yield (batch, ms per step, weight bytes per step) per batch width: prefill max(batches) states, then
    time propose / propose_batch + after_verify(0), one warm-up call first, wall clock, median."""
    gpu, D, V = prop.gpu, prop.hidden_size, prop.vocab_size
    rng = np.random.default_rng(seed)
    hs = to_bf16(rng.standard_normal((ctx, D)))
    states = [prop.alloc_state() for _ in range(max(batches))]
    for st in states:
        prop.prefill(st, rng.integers(0, V, ctx + 1), hs)
    for B in batches:
        sts, toks = states[:B], rng.integers(0, V, B)
        h = to_bf16(rng.standard_normal((B, D)))

        def run():
            if B == 1:
                prop.propose(sts[0], int(toks[0]), h[0], ctx, drafts)
            else:
                prop.propose_batch(sts, toks, h, [ctx] * B, drafts)
            gpu.synchronize()
            for st in sts:
                prop.after_verify(st, 0)
        run()                                            # warm-up: kernel compiles, workspaces
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
        yield B, 1e3 * float(np.median(times)) / drafts, prop.weight_bytes_per_step(B)


def main() -> None:
    p = Parser(__doc__)
    p.add_argument("--quant", nargs="+", default=["bf16", "fp8", "nvfp4"], choices=["bf16", "fp8", "nvfp4"],
                   help="projection formats to time, one proposer each (default: bf16 fp8 nvfp4)")
    p.add_argument("--batch", nargs="+", type=positive_int, default=[1, 4, 16, 32],
                   help="batch widths, 1..32 (default: 1 4 16 32)")
    p.add_argument("--ctx", type=positive_int, default=1024, help="drafter rows per sequence before drafting")
    p.add_argument("--drafts", type=positive_int, default=8, help="draft steps per propose")
    p.add_argument("--iters", type=positive_int, default=5, help="timed calls per batch width")
    p.add_argument("--mtp-vocab-size", type=nonneg_int, default=0, help="LM-head rows scored (0 = the full vocab)")
    device_flags(p)
    a = p.parse_args()
    if max(a.batch) > 64:
        p.error(f"--batch {max(a.batch)}: propose_batch takes at most 64 sequences")
    gpu = mtp_cupy.device(a.device)
    cfg = Qwen3NextConfig.from_dict(dims.TINY if a.tiny else dims.REAL)
    bw = copy_bandwidth(gpu)
    print(f"Qwen3-Next MTP head, hidden {cfg.hidden_size}, {cfg.num_experts} experts top-{cfg.num_experts_per_tok}, "
          f"vocab {cfg.vocab_size} (scoring {a.mtp_vocab_size or cfg.vocab_size}); ctx {a.ctx}, {a.drafts} drafts "
          f"per call; device {gpu.name}" + (f"; copy bandwidth {bw / 1e9:.0f} GB/s" if bw else ""))
    print(f"{'quant':>6} {'batch':>5} {'ms/step':>9} {'ms/seq-step':>11} {'weight MB':>10} {'floor ms':>9} "
          f"{'% floor':>8}")
    max_seq = a.ctx + a.drafts + 16
    for q in a.quant:
        t0 = time.perf_counter()
        prop = Qwen3NextMtpProposer(gpu, cfg, dims.random_weights(gpu, cfg, a.seed), max_seq_len=max_seq,
                                    quantization=q, max_drafts=a.drafts, max_batch=max(a.batch),
                                    mtp_vocab_size=a.mtp_vocab_size)
        print(f"# {q}: built and quantised in {time.perf_counter() - t0:.1f} s")
        for B, ms, wbytes in time_widths(prop, sorted(a.batch), a.ctx, a.drafts, a.iters, a.seed):
            floor = 1e3 * wbytes / bw if bw else float("nan")
            print(f"{q:>6} {B:>5} {ms:>9.3f} {ms / B:>11.4f} {wbytes / 1e6:>10.1f} {floor:>9.3f} "
                  f"{100 * floor / ms:>7.0f}%")
        del prop


if __name__ == "__main__":
    run_main(main)
