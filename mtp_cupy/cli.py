"""`python -m mtp_cupy ...`: inspect checkpoints and kernels, run the demo drafter."""
from __future__ import annotations

import argparse
import sys
import time

from .families import NAMES as FAMILIES


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mtp_cupy", description=(
        "MTP speculative-decoding draft heads on raw CUDA kernels (CuPy), with a NumPy reference device "
        "that runs the same code on CPU-only machines."))
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    s = sub.add_parser("generate", help="speculative decoding: the target model verifies its MTP drafter's tokens")
    s.add_argument("--prompt", default="import os\nimport sys\n\n\ndef main(", help="prompt text (byte-level)")
    s.add_argument("--max-new-tokens", type=int, default=64)
    s.add_argument("--num-drafts", type=int, default=3, help="draft tokens per verify pass (default 3)")
    s.add_argument("--checkpoint", help="deepseek_v3-layout checkpoint with its MTP layer (default: the "
                   "embedded model trained on Python's stdlib)")
    s.add_argument("--device", choices=("auto", "cuda", "ref"), default="auto")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; > 0 = lossless rejection sampling")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--metrics-json", help="write acceptance counters (vLLM's names) and throughput here")
    s.add_argument("--no-baseline", action="store_true", help="skip the target-only run")

    s = sub.add_parser("info", help="family, dims, weight formats and bytes per draft step of a checkpoint")
    s.add_argument("path", help="HF-layout checkpoint directory (config.json + *.safetensors)")

    s = sub.add_parser("kernels", help="list the cuda_src modules and kernels; compile them when CUDA is present")
    s.add_argument("--no-compile", action="store_true", help="only list, even when CUDA is present")

    s = sub.add_parser("demo", help="draft with a tiny random checkpoint (or yours): prefill, propose/verify cycles")
    s.add_argument("--family", choices=FAMILIES, default="deepseek_v4")
    s.add_argument("--checkpoint", help="checkpoint directory (default: a tiny random one, written once and reused)")
    s.add_argument("--device", choices=("auto", "cuda", "ref"), default="auto",
                   help="auto = CUDA when present, else the NumPy device")
    s.add_argument("--prompt-len", type=int, default=24, help="prompt rows to prefill (default 24)")
    s.add_argument("--cycles", type=int, default=4, help="propose/verify cycles (default 4)")
    s.add_argument("--num-drafts", type=int, default=3, help="draft tokens per propose (default 3)")
    s.add_argument("--max-seq-len", type=int, default=512)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--ranks", type=int, default=1, help="glm5 only: run over N mpirun ranks (starts mpirun itself)")
    s.add_argument("--as-rank", action="store_true", help=argparse.SUPPRESS)
    return p


def cmd_info(args) -> int:
    from .weights.info import describe, format_info
    print(format_info(describe(args.path)))
    return 0


def cmd_kernels(args) -> int:
    from .runtime.backend import cuda_kernel_names, cuda_modules
    from .runtime.cupy_backend import cuda_available
    compile_ = cuda_available() and not args.no_compile
    gpu = None
    if compile_:
        from .runtime.cupy_backend import CupyBackend
        gpu = CupyBackend()
    for m in cuda_modules():
        names = cuda_kernel_names(m)
        note = ""
        if gpu is not None:
            t0 = time.perf_counter()
            gpu.module(m)
            note = f"  [compiled in {time.perf_counter() - t0:.2f} s]"
        print(f"{m}.cu: {', '.join(names)}{note}")
    if not compile_:
        print("(CUDA not present or --no-compile: listed only)" if not args.no_compile else "")
    return 0


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    from .errors import MtpError
    try:
        if args.cmd == "info":
            return cmd_info(args)
        if args.cmd == "kernels":
            return cmd_kernels(args)
        if args.cmd == "generate":
            from .generate_cmd import run_generate
            return run_generate(args)
        if args.cmd == "demo":
            from .demo import run_demo
            return run_demo(args)
    except MtpError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 1
