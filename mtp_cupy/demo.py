"""The demo drafter: a tiny random checkpoint in the family's real key layout (written once, reused), a
prefilled prompt and propose/verify cycles with a stand-in verifier. With random weights nobody can judge
draft quality, so the verifier accepts a random number of drafts and the stand-in target's hiddens are
random too; the demo shows the serving-loop calls (prefill, propose, after_verify, the catch-up prefill of
the rows the trim rule drops), their latency and the device."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from .errors import InputError


def tiny_checkpoint(family: str, seed: int = 0) -> Path:
    from .families import family as family_of
    root = Path(os.path.expanduser("~/.cache/mtp_cupy/tiny")) / f"{family}-s{seed}"
    if not (root / "config.json").exists():
        root.mkdir(parents=True, exist_ok=True)
        family_of(family).write_tiny_checkpoint(root, seed=seed)
    return root


def _check_args(args) -> None:
    """Everything the command line decides, before any work (InputError / ConfigError naming the option)."""
    from .families import family, of_checkpoint
    from .weights.info import checkpoint_dir
    fam = of_checkpoint(checkpoint_dir(args.checkpoint)) if args.checkpoint else family(args.family)
    if args.ranks > 1 and not fam.shardable:
        raise InputError(f"--ranks {args.ranks} applies to glm5 (the vocab-sharded head), not {fam.name}")
    if args.ranks > 1 and args.device == "cuda":
        from .runtime.cupy_backend import cuda_available
        if not cuda_available():   # said once here, not once per rank
            raise InputError("--device cuda asked for, but no CUDA device is available (is cupy installed?)")
    if args.prompt_len - 1 + args.num_drafts > args.max_seq_len:
        raise InputError(f"--prompt-len {args.prompt_len} and --num-drafts {args.num_drafts} do not fit in "
                         f"--max-seq-len {args.max_seq_len} (the first propose needs positions up to "
                         f"{args.prompt_len - 2 + args.num_drafts})")


def _launch_ranks(args) -> int:
    """Run this command again under `mpiexec -n ranks`, each rank with --as-rank."""
    from .runtime.comm import find_mpiexec
    mpiexec = find_mpiexec(f"--ranks {args.ranks}")
    if not args.checkpoint:
        tiny_checkpoint(args.family, args.seed)  # write once, before the ranks race for it
    cmd = [mpiexec, "-n", str(args.ranks), sys.executable, "-m", "mtp_cupy", *args.argv, "--as-rank"]
    return subprocess.call(cmd)


def run_demo(args) -> int:
    if not args.as_rank:
        _check_args(args)
        if args.ranks > 1:
            return _launch_ranks(args)
    import mtp_cupy
    from .speculative.generate import catch_up
    comm, rank = None, 0
    if args.as_rank:
        from .runtime.comm import make_communicator, mpi_world
        rank = mpi_world().Get_rank()
        if rank > 0:   # rank 0 speaks for all
            logging.getLogger("mtp_cupy").setLevel(logging.ERROR)
    gpu = mtp_cupy.device(args.device, device_id=rank) if args.device != "ref" else mtp_cupy.device("ref")
    if args.as_rank:
        comm = make_communicator(gpu, collective_timeout_s=args.collective_timeout_s)
    path = Path(args.checkpoint) if args.checkpoint else tiny_checkpoint(args.family, args.seed)
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"device: {gpu.name}" + (f" (GPU {gpu.device_id})" if gpu.is_cuda else " (NumPy reference device)")
        + (f", {comm.world} ranks" if comm else ""))
    t0 = time.perf_counter()
    k = args.num_drafts
    prop = mtp_cupy.load_proposer(path, gpu=gpu, max_seq_len=args.max_seq_len, comm=comm, max_drafts=k)
    V, D = prop.vocab_size, prop.hidden_size
    say(f"loaded {prop.family} drafter from {path} in {time.perf_counter() - t0:.2f} s (vocab {V}, hidden {D})")
    say("verifier: a random stand-in (random weights, so acceptance means nothing here); its hiddens are random "
        "and it accepts a random number of drafts. The drafts, the calls and their latency are real.")
    rng = np.random.default_rng(args.seed)
    st = prop.alloc_state()
    n = args.prompt_len
    toks = [int(t) for t in rng.integers(0, V, n + 1)]               # the prompt + the target's first token
    hid = list(rng.standard_normal((n, D)).astype(np.float32))       # hid[p]: the target's hidden at position p
    t0 = time.perf_counter()
    prop.prefill(st, toks[:n], np.stack(hid[:n - 1]))
    gpu.synchronize()
    say(f"prefill: {n - 1} rows in {1e3 * (time.perf_counter() - t0):.1f} ms")
    pos = n - 1
    for c in range(args.cycles):
        if pos + k > args.max_seq_len:
            say(f"stopped: {k} more drafts from position {pos} would pass --max-seq-len {args.max_seq_len}")
            break
        rows = catch_up(prop, st, toks, hid, pos)   # the rows after_verify dropped, from the target's hiddens
        t0 = time.perf_counter()
        res = prop.propose(st, toks[pos + 1], hid[pos], pos, k)
        dt = (time.perf_counter() - t0) / k
        accepted = int(rng.integers(0, k + 1))
        prop.after_verify(st, accepted)
        say(f"cycle {c}: position {pos}" + (f" (caught up {rows} row{'s' * (rows > 1)})" if rows else "")
            + f" drafts {res.tokens} ({1e3 * dt:.2f} ms/step) -> stand-in verifier accepted {accepted}")
        toks += res.tokens[:accepted] + [int(rng.integers(V))]        # accepted drafts + the target's own token
        hid += list(rng.standard_normal((accepted + 1, D)).astype(np.float32))
        pos += accepted + 1
    prop.free_state(st)
    return 0
