"""DeepSeek-V3/R1 MTP proposer at its real dims (hidden 7168, 128 MLA heads: q_lora 1536, latent 512 + rope 64,
nope 128, v 128; 256 FP8 experts top-8 in 8 groups + 1 shared; vocab 129280) with random weights in the real
formats (FP8 block + f32 weight_scale_inv; BF16 eh_proj, router, embedding and LM head) generated on the
device: milliseconds per draft step next to the weight-bytes floor (bytes a step must read / measured device
copy bandwidth), and a per-phase split.

    python scripts/run_real_dims_v3.py                          # ctx 2048, 3 drafts per propose
    python scripts/run_real_dims_v3.py --ctx 8192 --drafts 5
    python scripts/run_real_dims_v3.py --device ref --tiny --ctx 16 --iters 1   # CPU smoke run of this code

Each timed call is `propose(k)` over --ctx drafter rows (prefilled first) followed by `after_verify(0)`; the
host launches every kernel (no CUDA graph), so the step time includes Python launch overhead. W_UK^T is
random rather than the transpose of kv_b_proj: the bytes and kernels are those of a real checkpoint. The
phases re-run the newest row's step in place, each --iters times back to back (CUDA events; wall clock on the
NumPy device)."""
from __future__ import annotations

import time

import numpy as np

import mtp_cupy
from mtp_cupy.bench import copy_bandwidth, phase_ms, prefill_and_time
from mtp_cupy.bench import deepseek_v3 as dims
from mtp_cupy.bench.cli import Parser, device_flags, positive_int, run_main
from mtp_cupy.models.deepseek_v3 import DeepseekV3MtpProposer
from mtp_cupy.weights.config import DeepseekV3Config


def run(device: str = "cuda", tiny: bool = False, ctx: int = 2048, drafts: int = 3, iters: int = 10,
        seed: int = 0) -> dict:
    """Build the proposer, prefill `ctx` rows, time propose(drafts); returns the numbers main() prints."""
    gpu = mtp_cupy.device(device)
    cfg = DeepseekV3Config.from_dict(dims.TINY if tiny else dims.REAL)
    t0 = time.perf_counter()
    prop = DeepseekV3MtpProposer(gpu, cfg, dims.random_weights(gpu, cfg, seed), max_seq_len=ctx + drafts + 16,
                                 max_drafts=drafts)
    built = time.perf_counter() - t0
    st, h, prefill_s, times = prefill_and_time(gpu, prop, cfg.vocab_size, (cfg.hidden_size,), ctx, drafts, iters,
                                               seed)
    phases = phase_ms(prop, st, ctx, iters, dims.phases)
    bw = copy_bandwidth(gpu)
    wbytes = prop.weight_bytes_per_step()
    kv_bytes = (ctx + 1) * prop.dims.row_width * 2
    return dict(device=gpu.name, built_s=built, prefill_s=prefill_s, ctx=ctx, drafts=drafts,
                ms_per_step=1e3 * float(np.median(times)) / drafts, weight_bytes=wbytes, kv_bytes=kv_bytes,
                copy_gbs=bw / 1e9 if bw else None, floor_ms=1e3 * (wbytes + kv_bytes) / bw if bw else None,
                phases=phases)


def main() -> None:
    p = Parser(__doc__)
    p.add_argument("--ctx", type=positive_int, default=2048, help="drafter rows prefilled before drafting")
    p.add_argument("--drafts", type=positive_int, default=3, help="draft steps per propose")
    p.add_argument("--iters", type=positive_int, default=10, help="timed propose calls, and calls per phase")
    device_flags(p)
    a = p.parse_args()
    r = run(a.device, a.tiny, a.ctx, a.drafts, a.iters, a.seed)
    print(f"DeepSeek-V3{' (tiny)' if a.tiny else ''} MTP, hidden {(dims.TINY if a.tiny else dims.REAL)['hidden_size']}, "
          f"ctx {r['ctx']}, {r['drafts']} drafts per call; device {r['device']}; weights built in "
          f"{r['built_s']:.1f} s; prefill of {r['ctx']} rows {1e3 * r['prefill_s']:.1f} ms")
    line = (f"ms/draft step {r['ms_per_step']:.3f}; weight bytes/step {r['weight_bytes'] / 1e6:.1f} MB "
            f"+ latent KV {r['kv_bytes'] / 1e6:.1f} MB")
    if r["floor_ms"]:
        line += (f"; copy bandwidth {r['copy_gbs']:.0f} GB/s; floor {r['floor_ms']:.3f} ms "
                 f"({100 * r['floor_ms'] / r['ms_per_step']:.0f}% of the step)")
    print(line)
    for name, ms in r["phases"].items():
        print(f"  {name:<36} {1e3 * ms:9.1f} us")


if __name__ == "__main__":
    run_main(main)
