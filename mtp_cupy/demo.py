"""The demo drafter: a tiny random checkpoint in the family's real key layout (written once, reused), a
prefilled prompt and propose/verify cycles with a stand-in verifier. With random weights nobody can judge
draft quality; the demo shows the serving-loop calls, their latency and the device."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def tiny_checkpoint(family: str, seed: int = 0) -> Path:
    from .families import family as family_of
    root = Path(os.path.expanduser("~/.cache/mtp_cupy/tiny")) / f"{family}-s{seed}"
    if not (root / "config.json").exists():
        root.mkdir(parents=True, exist_ok=True)
        family_of(family).write_tiny_checkpoint(root, seed=seed)
    return root


def run_demo(args) -> int:
    if args.ranks > 1 and not args.as_rank:
        if args.family != "glm5":
            print("error: --ranks applies to --family glm5 (the vocab-sharded head)", file=sys.stderr)
            return 2
        tiny_checkpoint(args.family, args.seed)  # write once, before the ranks race for it
        cmd = ["mpiexec", "-n", str(args.ranks), sys.executable, "-m", "mtp_cupy", *sys.argv[1:], "--as-rank"]
        return subprocess.call(cmd)
    import mtp_cupy
    from .runtime.comm import make_communicator, mpi_world
    rank = mpi_world().Get_rank() if args.as_rank else 0
    gpu = mtp_cupy.device(args.device, device_id=rank) if args.device != "ref" else mtp_cupy.device("ref")
    comm = make_communicator(gpu) if args.as_rank else None
    path = Path(args.checkpoint) if args.checkpoint else tiny_checkpoint(args.family, args.seed)
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"device: {gpu.name}" + (f" (GPU {gpu.device_id})" if gpu.is_cuda else " (NumPy reference device)")
        + (f", {comm.world} ranks" if comm else ""))
    t0 = time.perf_counter()
    prop = mtp_cupy.load_proposer(path, gpu=gpu, max_seq_len=args.max_seq_len, comm=comm)
    say(f"loaded {args.family} drafter from {path} in {time.perf_counter() - t0:.2f} s "
        f"(vocab {prop.vocab_size}, hidden {prop.hidden_size})")
    rng = np.random.default_rng(args.seed)
    st = prop.alloc_state()
    n = args.prompt_len
    tokens = rng.integers(0, prop.vocab_size, n + 1)
    hiddens = rng.standard_normal((n + 1, prop.hidden_size)).astype(np.float32)
    t0 = time.perf_counter()
    prop.prefill(st, tokens[:n], hiddens[:n - 1])
    gpu.synchronize()
    say(f"prefill: {n - 1} rows in {1e3 * (time.perf_counter() - t0):.1f} ms")
    pos, tok = n - 1, int(tokens[n])
    for c in range(args.cycles):
        t0 = time.perf_counter()
        res = prop.propose(st, tok, hiddens[pos % (n + 1)], pos, args.num_drafts)
        dt = (time.perf_counter() - t0) / args.num_drafts
        accepted = int(rng.integers(0, args.num_drafts + 1))   # stand-in verifier
        prop.after_verify(st, accepted)
        say(f"cycle {c}: position {pos} drafts {res.tokens} ({1e3 * dt:.2f} ms/step) -> accepted {accepted}")
        pos += accepted + 1
        tok = int(res.tokens[accepted]) if accepted < len(res.tokens) else int(rng.integers(prop.vocab_size))
        if pos + args.num_drafts >= args.max_seq_len:
            break
    prop.free_state(st)
    return 0
