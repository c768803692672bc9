"""The host side of a propose call: how long the Python of `propose` / `propose_batch` + `after_verify` takes, and
where it goes (phases, then cProfile by own time). The GPU sits idle for all of it in a serving loop that reads
the drafts back (it is the first-step overhead of a propose): no kernel work can remove it.

    python scripts/profile_host.py --family qwen3_next --device cuda --batch 1 --k 1 --calls 2000

Runs on an embedded model (tiny dims: the bookkeeping does not depend on them). The hiddens do: a host hidden
is checked for NaN and copied into pinned memory every call, B x D words; `--hidden-size D` runs a small random
model of --family with that hidden size (7168 for DeepSeek-V3, 6144 GLM-5, 4096 x 4 streams DeepSeek-V4, 2048
Qwen3-Next) so those costs are the real ones; `--hidden-on device` hands them over as a device pointer instead
(no check, no copy: what a GPU target does). `--skip-chain` replaces the chain's launches by nothing (the NumPy
device would otherwise time its own math)."""
from __future__ import annotations

import cProfile
import io
import pstats
import tempfile
import time

import numpy as np

import mtp_cupy
from mtp_cupy.bench.cli import Parser, positive_int, run_main
from mtp_cupy.bench.drafter import serving_step
from mtp_cupy.runtime.dtypes import to_bf16
from mtp_cupy.runtime.ptr import DevicePtr


def build(fam: str, device: str, B: int, k: int, ctx: int, checkpoint: str | None = None, hidden_on: str = "host",
          room: int = 64, host_path: str = "auto"):
    """`room`: rows past ctx each sequence may grow by (a catch-up loop advances one position a call)."""
    gpu = mtp_cupy.device(device)
    p = mtp_cupy.load_proposer(checkpoint or mtp_cupy.EMBEDDED[fam], gpu, max_seq_len=ctx + room, max_drafts=k,
                               max_batch=B, host_path=host_path)
    rng = np.random.default_rng(0)
    shape = p._hidden_shapes()[0]
    states = []
    for _ in range(B):
        st = p.alloc_state()
        p.prefill(st, rng.integers(0, p.vocab_size, ctx + 1), to_bf16(rng.standard_normal((ctx,) + shape) * 0.1))
        states.append(st)
    h = to_bf16(rng.standard_normal((B,) + shape) * 0.1)
    if hidden_on == "device":   # the rows on the device, handed over as a pointer (what a GPU target does)
        h = gpu.upload(h)
    toks = [int(t) for t in rng.integers(0, p.vocab_size, B)]
    return p, states, toks, h


def call_of(p, states, toks, h, ctx: int, k: int):
    """`h`: host bf16 rows, or a device buffer of them (passed as its pointer; the caller keeps it alive)."""
    B = len(states)
    if not isinstance(h, np.ndarray):
        h = h.ptr
    if B == 1:
        st, t, hh = states[0], toks[0], h if isinstance(h, DevicePtr) else h[0]

        def one():
            p.propose(st, t, hh, ctx, k)
            p.after_verify(st, 0)
        return one

    zeros = [0] * B

    def batch():
        p.propose_batch(states, toks, h, [ctx] * B, k)
        p.after_verify_batch(states, zeros)

    def batch_loop():   # a tree without after_verify_batch (A/B runs against an older checkout)
        p.propose_batch(states, toks, h, [ctx] * B, k)
        for st in states:
            p.after_verify(st, 0)
    return batch if hasattr(p, "after_verify_batch") else batch_loop


def catch_up_of(p, states, toks, h, ctx: int, k: int):
    """`serving_step` over the states (the proposer was built with room for a row a call), after a first propose."""
    if not isinstance(h, np.ndarray):
        h = h.ptr
    p.propose_batch(states, toks, h, [ctx] * len(states), k)
    return serving_step(p, states, toks, h, k)


def phases(p, fn, calls: int, skip_chain: bool = False) -> str:
    """Median µs per call of: host before the chain's launch, the launch call, the wait for the results (the
    chain on the GPU), host after the results (result copy, per-sequence bookkeeping, after_verify); and, on
    CUDA, the chain's own GPU time (events just around the launch). With the chain skipped: total and post only."""
    gpu, marks, evs = p.gpu, {}, None
    replay, host_results = gpu.replay, p._host_results
    cuda = gpu.is_cuda and p.cuda_graphs and p.graph_safe and not skip_chain   # (skipped: no graph launch to mark)
    if cuda:
        evs = gpu.new_event(), gpu.new_event()

    def timed_replay(graph, stream):
        marks["launch"] = time.perf_counter()
        gpu.record(evs[0], stream)
        replay(graph, stream)
        gpu.record(evs[1], stream)
        marks["launched"] = time.perf_counter()

    def timed_results(*args, **kw):
        out = host_results(*args, **kw)
        marks["results"] = time.perf_counter()
        return out

    if cuda:
        gpu.replay = timed_replay
    p._host_results = timed_results
    rows = {"total": [], "pre": [], "launch": [], "wait": [], "post": [], "chain_gpu": []}
    try:
        for _ in range(calls):
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            rows["total"].append(t1 - t0)
            if cuda:
                rows["pre"].append(marks["launch"] - t0)
                rows["launch"].append(marks["launched"] - marks["launch"])
                rows["wait"].append(marks["results"] - marks["launched"])
                rows["chain_gpu"].append(1e-3 * gpu.elapsed_ms(*evs))
            rows["post"].append(t1 - marks["results"])
    finally:
        gpu.replay, p._host_results = replay, host_results
    return "phases (median µs): " + ", ".join(f"{k} {1e6 * np.median(v):.1f}" for k, v in rows.items() if v)


def main() -> int:
    ap = Parser(__doc__)
    ap.add_argument("--family", default="qwen3_next", choices=sorted(mtp_cupy.EMBEDDED), help="the model family")
    ap.add_argument("--checkpoint", help="a checkpoint of --family (default: its embedded model)")
    ap.add_argument("--hidden-size", type=positive_int, metavar="D",
                    help="a small random model of --family with this hidden size instead (default: none)")
    ap.add_argument("--device", choices=["auto", "cuda", "ref"], default="auto",
                    help="cuda, the NumPy device (ref), or cuda when there is one (auto)")
    ap.add_argument("--batch", type=positive_int, default=1, help="sequences per call (1: propose, else propose_batch)")
    ap.add_argument("--k", type=positive_int, default=1, help="drafts per call")
    ap.add_argument("--ctx", type=positive_int, default=64, help="prefilled rows per sequence")
    ap.add_argument("--calls", type=positive_int, default=1000, help="timed calls (and as many profiled)")
    ap.add_argument("--top", type=positive_int, default=25, help="functions listed by own time")
    ap.add_argument("--skip-chain", action="store_true", help="launch nothing (host bookkeeping only; on CUDA the "
                    "prefill's copies still run)")
    ap.add_argument("--hidden-on", choices=("host", "device"), default="host", help="where each call's hiddens "
                    "live: host (NumPy, checked and copied every call) or device (a device pointer read in place)")
    ap.add_argument("--host-path", choices=("auto", "c", "numpy"), default="auto", help="the proposer option: the "
                    "calls' bookkeeping compiled (c) or in NumPy")
    ap.add_argument("--no-profile", action="store_true", help="phases only, no cProfile listing")
    ap.add_argument("--catch-up", action="store_true", help="time a serving step instead: after_verify_batch, the "
                    "dropped row caught up by prefill_batch, propose_batch one position on (--batch > 1)")
    a = ap.parse_args()
    if a.hidden_size and a.checkpoint:
        ap.error("--hidden-size makes its own model; it does not take --checkpoint")
    ckpt = a.checkpoint
    if a.hidden_size:
        from mtp_cupy.families import family
        ckpt = family(a.family).write_tiny_checkpoint(tempfile.mkdtemp(prefix="profile_host_"), seed=0,
                                                      hidden_size=a.hidden_size, vocab_size=256)
    if a.catch_up and a.batch == 1:
        ap.error("--catch-up times the batch calls: give --batch > 1")
    room = 64 + (3 * a.calls + 40 if a.catch_up else 0)   # warm-up, timed, phased and profiled calls
    p, states, toks, h = build(a.family, a.device, a.batch, a.k, a.ctx, ckpt, a.hidden_on, room, a.host_path)
    if a.skip_chain:   # no launches: the chain (its outbox marked published), and the rows prefill_batch writes;
        p._chain = lambda *args, **kw: p._outbox_words.__setitem__(0, p._seq)
        p._write_rows = lambda *args, **kw: None
        p._replay = lambda key, launches: launches()   # no graph: a captured one would hold none of those marks
    fn = (catch_up_of if a.catch_up else call_of)(p, states, toks, h, a.ctx, a.k)
    for _ in range(20):
        fn()
    t0 = time.perf_counter()
    for _ in range(a.calls):
        fn()
    us = 1e6 * (time.perf_counter() - t0) / a.calls
    print(f"{a.family} device={a.device} batch={a.batch} k={a.k} graphs={p.cuda_graphs and p.graph_safe} "
          f"skip_chain={a.skip_chain} hidden_on={a.hidden_on} host_path={a.host_path} "
          f"(compiled: {p._batch_host() is not None}): {us:.1f} µs wall per call "
          f"({'after_verify + catch-up prefill + propose' if a.catch_up else 'propose + after_verify'})")
    print(phases(p, fn, a.calls, a.skip_chain))
    if a.no_profile:
        return 0
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(a.calls):
        fn()
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(a.top)
    print(s.getvalue())
    return 0


if __name__ == "__main__":
    run_main(main)
