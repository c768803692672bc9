"""The draft-step benchmark of one family (scripts/bench_draft.py): the mtp_cupy proposer with CUDA graphs on
and off, then the plain-torch peer eager and graphed, every call timed cold-L2 by `EventTimer`; per draft
step medians next to the weight-bytes floor."""
from __future__ import annotations

import sys
import time
import traceback
from dataclasses import dataclass, field

from ..testing.torch_peers import PEERS
from .device import cupy_used_gb, free_device_memory, torch_graph
from .draft_table import best, best_t, fmt
from .drafter import TITLES, Drafter, real_config
from .timing import EventTimer, median


@dataclass
class DraftBenchConfig:
    """What one bench_draft run measures (its command-line flags)."""
    ctx: int = 2048
    ks: list = field(default_factory=lambda: [1, 2, 3, 4])
    batches: list = field(default_factory=lambda: [1])
    iters: int = 20
    seed: int = 0
    tiny: bool = False
    qwen_quant: str = "bf16"
    glm_head_fp8: bool = False
    no_torch: bool = False
    torch_cpu: bool = False


def per_step(gpu_us, wall_us, k: int) -> dict:
    """Per draft step medians of k-step calls: GPU µs, wall µs, host µs = max(wall - GPU, 0), and the samples."""
    g, w = median(gpu_us), median(wall_us)
    return dict(gpu_us=None if g is None else g / k, wall_us=w / k,
                host_us=None if g is None else max(w - g, 0.0) / k,
                gpu_us_calls=gpu_us, wall_us_calls=wall_us)


def measure_ours(o: Drafter, timer: EventTimer, k: int, B: int, iters: int, notes: list) -> dict:
    """Graph on (warm-up: eager, capture, replay; CUDA only) and graph off, per draft step."""
    p, cuda = o.prop, o.gpu.is_cuda
    fn = o.call(k, B)
    out = {"graph_on": None, "graph_off": None}
    if cuda:
        p.cuda_graphs = True
        for _ in range(3):
            fn()
        captured = bool(p.graph_safe) and any(key[:2] == (k, p.bucket(B)) for key in p._graphs)
        if not captured:
            notes.append(f"k={k}: no CUDA graph was captured (graph_safe={p.graph_safe}); graph-on ran eagerly")
        out["graph_on"] = per_step(*timer.time(fn, iters, p.stream), k)
        out["graph_on"]["captured"] = captured
    p.cuda_graphs = False
    for _ in range(2):
        fn()
    out["graph_off"] = per_step(*timer.time(fn, iters, p.stream), k)
    if cuda:
        p.cuda_graphs = True
    return out


def measure_torch(peer, timer: EventTimer, k: int, iters: int, cuda: bool, notes: list) -> dict:
    """The torch peer's k-step chain eager and (CUDA) under torch.cuda.CUDAGraph, per draft step."""
    out = {"eager": None, "graph": None}
    fn = lambda: peer.chain(k)        # noqa: E731
    for _ in range(3):
        fn()
    out["eager"] = per_step(*timer.time(fn, iters), k)
    if not cuda:
        return out
    try:
        g = torch_graph(peer.chain, k)
    except Exception as e:           # noqa: BLE001
        notes.append(f"torch k={k}: CUDA graph capture failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
        free_device_memory()
        return out
    g.replay()
    out["graph"] = per_step(*timer.time(g.replay, iters), k)
    del g
    return out


def _ours(fam: str, gpu, a: DraftBenchConfig, bw: float | None, res: dict) -> dict:
    """The mtp_cupy side of `run_family`: {(k, batch): row}; failures go to res["error"]."""
    kmax, bmax = max(a.ks), max(a.batches)
    rows, o, timer = {}, None, None
    try:
        timer = EventTimer.for_device(gpu)
        o = Drafter(fam, gpu, a.ctx, kmax, bmax, tiny=a.tiny, seed=a.seed, qwen_quant=a.qwen_quant,
                    glm_head_fp8=a.glm_head_fp8)
        res.update(build_s=o.build_s, prefill_s=o.prefill_s, formats=o.formats, kv_rows=o.kv_rows,
                   kv_row_bytes=o.kv_row_bytes,
                   dims={k: v for k, v in o.cfgd.items() if isinstance(v, (int, float, str))})
        print(f"# {fam}: built in {o.build_s:.1f} s, prefill of {a.ctx} rows x {len(o.states)} in "
              f"{o.prefill_s:.2f} s" + (f"; device memory in use {cupy_used_gb():.1f} GiB" if gpu.is_cuda else ""),
              flush=True)
        for B in a.batches:
            for k in a.ks:
                t0 = time.perf_counter()
                m = measure_ours(o, timer, k, B, a.iters, res["notes"])
                # the floor counts the distinct experts the (last) step really selected, not an estimate
                experts = o.experts_selected(B)
                wb, kvb = o.weight_bytes(B, experts), o.kv_bytes(B)
                floor = 1e6 * (wb + kvb) / bw if bw else None
                rows[(k, B)] = dict(k=k, batch=B, ours=m, weight_bytes=wb, kv_bytes=kvb, floor_us=floor,
                                    experts=experts)
                print(f"#   k={k} batch={B}: ours {fmt(best(m))} µs/step, {experts} distinct experts "
                      f"({time.perf_counter() - t0:.1f} s)", flush=True)
    except Exception:                 # noqa: BLE001
        res["error"] = traceback.format_exc()
        print(f"# {fam}: FAILED (mtp_cupy side)\n{res['error']}", file=sys.stderr, flush=True)
    finally:
        if o is not None:
            try:
                o.close()
            except Exception:         # noqa: BLE001
                pass
        o = None
        if timer is not None:
            timer.close()
        timer = None
        free_device_memory()
    return rows


def _torch(fam: str, a: DraftBenchConfig, tstat: tuple[bool, str], res: dict) -> dict:
    """The torch side of `run_family`: {k: measure_torch result}, batch 1 only; failures go to res."""
    tres = {}
    if a.no_torch:
        res["notes"].append("torch peer skipped (--no-torch)")
    elif not (tstat[0] or a.torch_cpu):
        res["notes"].append(f"torch peer skipped: {tstat[1]}")
    elif 1 not in a.batches:
        res["notes"].append("torch peer runs batch 1 only; --batches has no 1")
    else:
        peer = timer = None
        cuda = tstat[0]
        try:
            t0 = time.perf_counter()
            dev = "cuda" if cuda else "cpu"
            peer = PEERS[fam](real_config(fam, a.tiny), a.ctx, max(a.ks), dev, a.seed)
            timer = EventTimer.torch(dev)
            res.update(torch_build_s=time.perf_counter() - t0, torch_bytes=peer.bytes_per_step,
                       torch_weight_bytes=peer.weight_bytes, torch_kv_bytes=peer.kv_bytes, torch_device=dev)
            print(f"# {fam}: torch peer ({dev}) built in {res['torch_build_s']:.1f} s", flush=True)
            for k in a.ks:
                tres[k] = measure_torch(peer, timer, k, a.iters, cuda, res["notes"])
                print(f"#   k={k}: torch eager {fmt(best_t(tres[k], 'eager'))}, graph "
                      f"{fmt(best_t(tres[k], 'graph'))} µs/step", flush=True)
        except Exception:             # noqa: BLE001
            res["torch_error"] = traceback.format_exc()
            print(f"# {fam}: torch peer FAILED\n{res['torch_error']}", file=sys.stderr, flush=True)
        finally:
            peer = timer = None
            free_device_memory()
    return tres


def run_family(fam: str, gpu, a: DraftBenchConfig, bw: float | None, tstat: tuple[bool, str]) -> dict:
    """Benchmark one family: ours (every k and batch), then the torch peer (batch 1) after ours is freed.

    Parameters
    ----------
    fam : str
        A family of `mtp_cupy.bench.drafter.FAMILIES`.
    gpu : mtp_cupy Backend
        The device.
    a : DraftBenchConfig
        What to measure.
    bw : float or None
        Copy bandwidth in bytes/s (`copy_bandwidth`), for the floors; None on the NumPy device.
    tstat : (bool, str)
        `torch_status()`: whether torch has CUDA, and a note.

    Returns
    -------
    dict
        The family's result (rows per (k, batch), notes, errors, bytes); `draft_table.table` prints it.
    """
    res = dict(family=fam, title=TITLES[fam], ctx=a.ctx, ks=a.ks, batches=a.batches, rows=[], notes=[],
               error=None, torch_error=None)
    rows = _ours(fam, gpu, a, bw, res)
    tres = _torch(fam, a, tstat, res)
    res["torch_floor_us"] = 1e6 * res["torch_bytes"] / bw if bw and "torch_bytes" in res else None
    for k in tres:                   # torch numbers survive a failed mtp_cupy side
        rows.setdefault((k, 1), dict(k=k, batch=1, ours={}, weight_bytes=None, kv_bytes=None, floor_us=None))
    for (k, B), r in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        r["torch"] = tres.get(k) if B == 1 else None
        res["rows"].append(r)
    return res
