"""The draft-step benchmark of one family (scripts/bench_draft.py): the mtp_cupy proposer with CUDA graphs on
and off, then the plain-torch peer eager and graphed, both at every batch width, every call timed cold-L2 by
`EventTimer`; per draft step medians next to the bytes floor (the distinct experts each side's step selected)."""
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
    torch_moe: str = "auto"
    batch_invariant: bool = True
    flush: str = "memset"
    hidden_on: str = "host"   # "device": the step's hiddens handed over as a device pointer (read in place)
    catch_up: bool = False    # time a serving step: after_verify_batch, prefill_batch of one row each, propose_batch


def per_step(gpu_us, wall_us, k: int) -> dict:
    """Per draft step medians of k-step calls: GPU µs, wall µs, host µs = max(wall - GPU, 0), and the samples."""
    g, w = median(gpu_us), median(wall_us)
    return dict(gpu_us=None if g is None else g / k, wall_us=w / k,
                host_us=None if g is None else max(w - g, 0.0) / k,
                gpu_us_calls=gpu_us, wall_us_calls=wall_us)


def measure_ours(o: Drafter, timer: EventTimer, k: int, B: int, iters: int, notes: list,
                 catch_up: bool = False) -> dict:
    """Graph on (warm-up: eager, capture, replay; CUDA only) and graph off, per draft step (`catch_up`: of a
    serving step's calls, see Drafter.call; the graph alone is the draft chain's either way)."""
    p, cuda = o.prop, o.gpu.is_cuda
    fn = o.call(k, B, catch_up=catch_up)
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
        if captured:   # the graph replayed alone: the call's time less its host path (checks, staging, results)
            graph = next(g for key, g in p._graphs.items() if key[:2] == (k, p.bucket(B)))
            chain = timer.time(lambda: p.gpu.replay(graph, p.stream), iters, p.stream)[0]
            out["graph_on"]["chain_us"] = median(chain) / k
    p.cuda_graphs = False
    for _ in range(2):
        fn()
    out["graph_off"] = per_step(*timer.time(fn, iters, p.stream), k)
    if cuda:
        p.cuda_graphs = True
    return out


def _graph(peer, k: int, notes: list):
    """``peer.chain(k)`` captured as a CUDA graph, or None (the failure noted)."""
    try:
        return torch_graph(peer.chain, k)
    except Exception as e:           # noqa: BLE001
        notes.append(f"torch batch={peer.batch} k={k} ({peer.moe_path} MoE): CUDA graph capture failed: "
                     f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
        free_device_memory()
        return None


def _eager(peer, timer: EventTimer, k: int, iters: int, notes: list) -> dict:
    """Warm up and time the peer's chain eagerly; a failing grouped MoE falls back to the gather path."""
    fn = lambda: peer.chain(k)        # noqa: E731
    try:
        for _ in range(3):
            fn()
    except Exception as e:           # noqa: BLE001
        if peer.moe_path != "grouped":
            raise
        peer.moe.use_gather(f"torch._grouped_mm failed eagerly ({type(e).__name__}); gathered instead")
        notes.append(f"torch batch={peer.batch} k={k}: {peer.moe.reason}")
        for _ in range(3):
            fn()
    return per_step(*timer.time(fn, iters), k)


def measure_torch(peer, timer: EventTimer, k: int, iters: int, cuda: bool, notes: list) -> dict:
    """The torch peer's k-step chain eager and (CUDA) under torch.cuda.CUDAGraph, per draft step.

    Parameters
    ----------
    peer : TorchPeer
        A peer of B sequences (`mtp_cupy.testing.torch_peers.PEERS`).
    timer : EventTimer
        The cold-L2 timer of the peer's device.
    k : int
        Steps per chain.
    iters : int
        Timed calls per mode.
    cuda : bool
        Also capture and time a CUDA graph.
    notes : list of str
        Failures and fallbacks go here.

    Returns
    -------
    dict
        "eager", "graph" (`per_step` results or None), "moe_path" (what ran: a grouped MoE failing eagerly or at
        capture re-runs both modes gathered), "experts" (distinct experts of the last step, read after timing).
    """
    out = {"eager": _eager(peer, timer, k, iters, notes), "graph": None}
    g = _graph(peer, k, notes) if cuda else None
    if cuda and g is None and peer.moe_path == "grouped":
        peer.moe.use_gather("torch._grouped_mm failed at capture; gathered instead")
        notes.append(f"torch batch={peer.batch} k={k}: re-timed eager and graph on the gather path")
        out["eager"] = _eager(peer, timer, k, iters, notes)
        g = _graph(peer, k, notes)
    if g is not None:
        g.replay()
        out["graph"] = per_step(*timer.time(g.replay, iters), k)
    out.update(moe_path=peer.moe_path, experts=peer.experts_selected())
    del g
    return out


def _ours(fam: str, gpu, a: DraftBenchConfig, bw: float | None, res: dict) -> dict:
    """The mtp_cupy side of `run_family`: {(k, batch): row}; failures go to res["error"]."""
    kmax, bmax = max(a.ks), max(a.batches)
    rows, o, timer = {}, None, None
    try:
        timer = EventTimer.for_device(gpu, a.flush)
        o = Drafter(fam, gpu, a.ctx, kmax, bmax, tiny=a.tiny, seed=a.seed, qwen_quant=a.qwen_quant,
                    batch_invariant=a.batch_invariant,
                    glm_head_fp8=a.glm_head_fp8, hidden_on=a.hidden_on,
                    catch_up_room=2 * a.iters + 64 if a.catch_up else 0)
        res.update(build_s=o.build_s, prefill_s=o.prefill_s, formats=o.formats, kv_rows=o.kv_rows,
                   kv_row_bytes=o.kv_row_bytes,
                   dims={k: v for k, v in o.cfgd.items() if isinstance(v, (int, float, str))})
        print(f"# {fam}: built in {o.build_s:.1f} s, prefill of {a.ctx} rows x {len(o.states)} in "
              f"{o.prefill_s:.2f} s" + (f"; device memory in use {cupy_used_gb():.1f} GiB" if gpu.is_cuda else ""),
              flush=True)
        for B in a.batches:
            for k in a.ks:
                t0 = time.perf_counter()
                m = measure_ours(o, timer, k, B, a.iters, res["notes"], a.catch_up)
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


def _torch_rows(peer, timer: EventTimer, a: DraftBenchConfig, cuda: bool, bw: float | None, notes: list) -> dict:
    """{(k, B): measure_torch result plus the bytes and floor of the experts really selected} of one peer."""
    out = {}
    for k in a.ks:
        t0 = time.perf_counter()
        t = out[(k, peer.batch)] = measure_torch(peer, timer, k, a.iters, cuda, notes)
        n = t["experts"] if t["experts"] is not None else peer.moe.expected_distinct()
        t.update(weight_bytes=peer.weight_bytes_for(n), kv_bytes=peer.kv_bytes)
        t["floor_us"] = 1e6 * (t["weight_bytes"] + t["kv_bytes"]) / bw if bw else None
        print(f"#   k={k} batch={peer.batch}: torch eager {fmt(best_t(t, 'eager'))}, graph "
              f"{fmt(best_t(t, 'graph'))} µs/step, {t['experts']} distinct experts ({t['moe_path']} MoE; "
              f"{time.perf_counter() - t0:.1f} s)", flush=True)
    return out


def _torch(fam: str, a: DraftBenchConfig, tstat: tuple[bool, str], bw: float | None, res: dict) -> dict:
    """The torch side of `run_family`: {(k, batch): torch row}, one peer per batch width, built after the last is
    freed; a width that fails goes to res["torch_error"] and the next one still runs."""
    tres, cuda = {}, tstat[0]
    if a.no_torch or not (cuda or a.torch_cpu):
        res["notes"].append("torch peer skipped (--no-torch)" if a.no_torch else f"torch peer skipped: {tstat[1]}")
        return tres
    dev = "cuda" if cuda else "cpu"
    res.update(torch_device=dev, torch_peers=[])
    timer = EventTimer.torch(dev, a.flush)
    for B in a.batches:
        peer = None
        try:
            t0 = time.perf_counter()
            peer = PEERS[fam](real_config(fam, a.tiny), a.ctx, max(a.ks), dev, a.seed, batch=B, moe=a.torch_moe)
            info = dict(batch=B, build_s=time.perf_counter() - t0, moe_path=peer.moe_path, moe_reason=peer.moe.reason,
                        dense_bytes=peer.dense_bytes, expert_bytes=peer.moe.expert_bytes, kv_bytes=peer.kv_bytes)
            res["torch_peers"].append(info)
            print(f"# {fam}: torch peer ({dev}, batch {B}, {peer.moe_path} MoE) built in {info['build_s']:.1f} s",
                  flush=True)
            tres.update(_torch_rows(peer, timer, a, cuda, bw, res["notes"]))
            info.update(moe_path=peer.moe_path, moe_reason=peer.moe.reason)    # after a fallback: what ran last
        except Exception:             # noqa: BLE001
            err = f"batch {B}: " + traceback.format_exc()
            res["torch_error"] = (res["torch_error"] + "\n" if res.get("torch_error") else "") + err
            print(f"# {fam}: torch peer FAILED at {err}", file=sys.stderr, flush=True)
        finally:
            peer = None
            free_device_memory()
    timer.close()
    return tres


def run_family(fam: str, gpu, a: DraftBenchConfig, bw: float | None, tstat: tuple[bool, str]) -> dict:
    """Benchmark one family: ours (every k and batch), then the torch peer (every k and batch) after ours is freed.

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
        The family's result (rows per (k, batch), each with "ours" and "torch", notes, errors, bytes, the torch
        peers built, "torch_peers"); `draft_table.table` prints it.
    """
    res = dict(family=fam, title=TITLES[fam], ctx=a.ctx, ks=a.ks, batches=a.batches, rows=[], notes=[],
               error=None, torch_error=None)
    rows = _ours(fam, gpu, a, bw, res)
    tres = _torch(fam, a, tstat, bw, res)
    for kb in tres:                  # torch numbers survive a failed mtp_cupy side
        rows.setdefault(kb, dict(k=kb[0], batch=kb[1], ours={}, weight_bytes=None, kv_bytes=None, floor_us=None,
                                 experts=None))
    for kb, r in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        r["torch"] = tres.get(kb)
        res["rows"].append(r)
    return res
