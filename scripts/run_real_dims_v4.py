"""DeepSeek-V4-Flash MTP proposer at its real dims (hidden 4096, 4 mHC streams, 64 heads of 512 with rope 64,
q_lora 1024, 8 output groups of rank 1024, window 128, 256 FP4 experts top-6 + an FP8 shared expert, vocab
129280) with random weights in the real formats generated on the device: milliseconds per draft step next to
the weight-bytes floor (bytes a step must read / measured device copy bandwidth), and a per-phase split.

    python scripts/run_real_dims_v4.py                          # ctx 1024, 3 drafts per propose
    python scripts/run_real_dims_v4.py --ctx 4096 --drafts 8 --form single
    python scripts/run_real_dims_v4.py --device ref --tiny --ctx 16 --iters 1   # CPU smoke run of this code

Each timed call is `propose(k)` over --ctx drafter rows (prefilled first) followed by `after_verify(0)`. The
phases re-run the newest row's step in place, each --iters times back to back (CUDA events; wall clock on the
NumPy device)."""
from __future__ import annotations

import time

import numpy as np

import mtp_cupy
from mtp_cupy.bench import copy_bandwidth, phase_ms, prefill_and_time
from mtp_cupy.bench import deepseek_v4 as dims
from mtp_cupy.bench.cli import Parser, device_flags, positive_int, run_main
from mtp_cupy.models.deepseek_v4 import DeepseekV4MtpProposer
from mtp_cupy.weights.config import DeepseekV4Config


def run(device: str = "cuda", tiny: bool = False, ctx: int = 1024, drafts: int = 3, iters: int = 10,
        form: str = "streams", seed: int = 0) -> dict:
    """Build the proposer, prefill `ctx` rows, time propose(drafts); returns the numbers main() prints."""
    gpu = mtp_cupy.device(device)
    cfg = DeepseekV4Config.from_dict(dims.TINY if tiny else dims.REAL)
    t0 = time.perf_counter()
    prop = DeepseekV4MtpProposer(gpu, cfg, dims.random_weights(gpu, cfg, seed), max_seq_len=ctx + drafts + 16,
                                 max_drafts=drafts, device_hidden=form)
    built = time.perf_counter() - t0
    shape = (cfg.hc_mult, cfg.hidden_size) if form == "streams" else (cfg.hidden_size,)
    st, h, prefill_s, times = prefill_and_time(gpu, prop, cfg.vocab_size, shape, ctx, drafts, iters, seed)
    phases = phase_ms(prop, st, ctx, iters, dims.phases)
    bw = copy_bandwidth(gpu)
    wbytes = prop.weight_bytes_per_step()
    return dict(device=gpu.name, built_s=built, prefill_s=prefill_s, ctx=ctx, drafts=drafts, form=form,
                ms_per_step=1e3 * float(np.median(times)) / drafts, weight_bytes=wbytes,
                copy_gbs=bw / 1e9 if bw else None, floor_ms=1e3 * wbytes / bw if bw else None, phases=phases)


def main() -> None:
    p = Parser(__doc__)
    p.add_argument("--ctx", type=positive_int, default=1024, help="drafter rows prefilled before drafting")
    p.add_argument("--drafts", type=positive_int, default=3, help="draft steps per propose")
    p.add_argument("--iters", type=positive_int, default=10, help="timed propose calls, and calls per phase")
    p.add_argument("--form", choices=["streams", "single"], default="streams",
                   help="the target hidden's form: the 4 mHC streams [4, D] or one [D] row")
    device_flags(p)
    a = p.parse_args()
    r = run(a.device, a.tiny, a.ctx, a.drafts, a.iters, a.form, a.seed)
    print(f"DeepSeek-V4{' (tiny)' if a.tiny else '-Flash'} MTP, hidden {(dims.TINY if a.tiny else dims.REAL)['hidden_size']}, "
          f"ctx {r['ctx']}, {r['drafts']} drafts per call, {r['form']} hidden; device {r['device']}; "
          f"weights built in {r['built_s']:.1f} s; prefill of {r['ctx']} rows {1e3 * r['prefill_s']:.1f} ms")
    line = f"ms/draft step {r['ms_per_step']:.3f}; weight bytes/step {r['weight_bytes'] / 1e6:.1f} MB"
    if r["floor_ms"]:
        line += (f"; copy bandwidth {r['copy_gbs']:.0f} GB/s; floor {r['floor_ms']:.3f} ms "
                 f"({100 * r['floor_ms'] / r['ms_per_step']:.0f}% of the step)")
    print(line)
    for name, ms in r["phases"].items():
        print(f"  {name:<32} {1e3 * ms:9.1f} us")


if __name__ == "__main__":
    run_main(main)
