"""`python -m mtp_cupy ...`: inspect checkpoints and kernels, run the demo drafter.

Every error is one line on stderr (`error: ...`) and a non-zero exit (2), never a traceback. The numbers a
command takes are checked before any work, and the message names the option and the value typed."""
from __future__ import annotations

import argparse
import math
import sys
import time

from .families import NAMES as FAMILIES

# most drafts per step the CLI asks for: the range of the proposers' max_drafts option (ProposerOptions)
MAX_DRAFTS = 64


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error in one line (`error: ...`, exit 2) instead of usage + message."""

    def error(self, message):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


class _Formatter(argparse.HelpFormatter):
    """Every option's help ends with its default unless the help already states it."""

    def _get_help_string(self, action):
        h = action.help or ""
        if not action.option_strings or action.default is argparse.SUPPRESS or "default" in h:
            return h
        if isinstance(action, argparse._StoreTrueAction):
            return h + " (default: off)"
        d = action.default
        return h + " (default: " + (repr(d) if isinstance(d, str) else str(d)).replace("%", "%%") + ")"


def _int_in(lo: int, hi: int | None = None):
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            v = None
        if v is None or v < lo or (hi is not None and v > hi):
            want = f"an integer in [{lo}, {hi}]" if hi is not None else f"an integer >= {lo}"
            raise argparse.ArgumentTypeError(f"must be {want}, got {s!r}")
        return v
    return parse


def _float_min(lo: float, strict: bool, finite: bool = True):
    def parse(s: str) -> float:
        try:
            v = float(s)
        except ValueError:
            v = math.nan
        if not (v > lo if strict else v >= lo) or (finite and math.isinf(v)):
            what = f"a{' finite' if finite else ''} number {'>' if strict else '>='} {lo:g}"
            raise argparse.ArgumentTypeError(f"must be {what}, got {s!r}")
        return v
    return parse


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m mtp_cupy", formatter_class=_Formatter, description=(
        "MTP speculative-decoding draft heads on raw CUDA kernels (CuPy), with a NumPy reference device "
        "that runs the same code on CPU-only machines."))
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    add = lambda name, help: sub.add_parser(name, help=help, description=help, formatter_class=_Formatter)  # noqa: E731
    drafts = f"draft tokens per step, 1 to {MAX_DRAFTS} (the drafter is sized for it)"
    devices = dict(choices=("auto", "cuda", "ref"), default="auto",
                   help="auto = CUDA when present, else the NumPy reference device")

    s = add("generate", "speculative decoding: the target model verifies its MTP drafter's tokens")
    s.add_argument("--prompt", action="append", metavar="TEXT", help="prompt text (byte-level); give it several "
                   "times to decode the prompts together, drafting for all of them in one batch a step "
                   "(default: 'import os\\nimport sys\\n\\n\\ndef main(')")
    s.add_argument("--max-new-tokens", type=_int_in(1), default=64, metavar="N", help="tokens to generate")
    s.add_argument("--num-drafts", type=_int_in(1, MAX_DRAFTS), default=3, metavar="K", help=drafts)
    s.add_argument("--family", choices=FAMILIES, help="run the embedded model of this family (trained on Python's "
                   "stdlib; default: deepseek_v3, or the family of --checkpoint). deepseek_v3 runs mtp_cupy's own "
                   "target; the others run transformers' target (needs torch + transformers)")
    s.add_argument("--checkpoint", metavar="DIR", help="checkpoint directory holding the target and its MTP layer "
                   "(default: the embedded model of --family)")
    s.add_argument("--device", **devices)
    s.add_argument("--temperature", type=_float_min(0, False), default=0.0,
                   help="0 = greedy; > 0 = lossless rejection sampling")
    s.add_argument("--seed", type=_int_in(0), default=0, help="sampling seed")
    s.add_argument("--metrics-json", metavar="FILE", help="write acceptance counters (vLLM's names) and throughput "
                   "here (default: not written)")
    s.add_argument("--no-baseline", action="store_true", help="skip the target-only run")

    s = add("info", "family, dims, weight formats and bytes per draft step of a checkpoint")
    s.add_argument("path", help="HF-layout checkpoint directory (config.json + *.safetensors)")

    s = add("kernels", "list the cuda_src modules and kernels; compile them when CUDA is present")
    s.add_argument("--no-compile", action="store_true", help="only list, even when CUDA is present")

    s = add("demo", "draft with a tiny random checkpoint (or yours): prefill, propose/verify cycles against a "
                    "random stand-in verifier")
    s.add_argument("--family", choices=FAMILIES, default="deepseek_v4", help="model family")
    s.add_argument("--checkpoint", metavar="DIR", help="checkpoint directory (default: a tiny random one of "
                   "--family, written once under ~/.cache/mtp_cupy and reused)")
    s.add_argument("--device", **devices)
    s.add_argument("--prompt-len", type=_int_in(2), default=24, metavar="N",
                   help="prompt tokens (prefill writes one drafter row fewer)")
    s.add_argument("--cycles", type=_int_in(1), default=4, metavar="N", help="propose/verify cycles")
    s.add_argument("--num-drafts", type=_int_in(1, MAX_DRAFTS), default=3, metavar="K", help=drafts)
    s.add_argument("--max-seq-len", type=_int_in(2), default=512, metavar="N", help="drafter positions per sequence")
    s.add_argument("--seed", type=_int_in(0), default=0, help="seed of the tiny checkpoint and the inputs")
    s.add_argument("--ranks", type=_int_in(1), default=1, metavar="N",
                   help="glm5 only: run over N mpirun ranks (starts mpiexec itself; needs .[mpi])")
    s.add_argument("--collective-timeout-s", type=_float_min(0, True, finite=False), default=300.0, metavar="S",
                   help="with --ranks: a collective that has not completed after S seconds raises on the ranks "
                        "that are alive ('inf': no deadline)")
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
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    args.argv = argv
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
    except OSError as e:   # a file the command was told to write or read
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    return 1
