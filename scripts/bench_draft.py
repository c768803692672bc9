"""Draft-step benchmark on one GPU, one process: the mtp_cupy proposer of each family at its real dims (random
weights in the real formats, built on the device by scripts/run_real_dims_*.py) against the weight-bytes floor
and a plain-torch bf16 peer of the same step.

    python scripts/bench_draft.py --family all --ks 1,3 --json /tmp/bench_draft.json   # target: < 4 min, H200
    python scripts/bench_draft.py --family deepseek_v3 --ctx 4096 --ks 1,2,3,4 --iters 20 --json out.json
    python scripts/bench_draft.py --family all --quick                 # ctx 1024, ks 1,3, iters 10
    python scripts/bench_draft.py --family glm5 --ctx 4096 --ks 1,3    # GLM-5, one GPU: sparse (top-2048) MLA
    python scripts/bench_draft.py --family all --device ref --tiny --torch-cpu   # CPU smoke run of this code

Per family and k (drafts per propose): prefill --ctx drafter rows; warm up (propose + after_verify(0) three
times: eager, CUDA-graph capture, replay); then --iters timed calls, each after a 256 MB memset on the
proposer's stream (cold L2), with CUDA events on `prop.stream` around `propose(st, tok, h, ctx, k);
after_verify(st, 0)` and the wall clock around the same; again with `prop.cuda_graphs = False`. Reported per
draft step: GPU µs = event time / k, wall µs = wall / k, host µs = max(wall - GPU, 0) / k (medians).
Floor µs = (weight_bytes_per_step + KV bytes read) / D2D copy bandwidth (read + write, median of 10 1-GiB
copies in this process); "% of floor" = step / floor (100% = at the floor). Torch peers (bf16, batch 1):
eager and under torch.cuda.CUDAGraph, same cold-L2 timing; their floor counts their bf16 bytes.
Batch > 1 runs Qwen3-Next's propose_batch (graphed per batch bucket, like propose); DeepSeek families and
GLM-5 have no batched propose.

Families: deepseek_v4, deepseek_v3, qwen3_next, glm5. GLM-5 runs here unsharded on one GPU (draft_glm.REAL
dims, random weights from draft_glm.random_weights; the step's KV bytes are every indexer key row plus the
index_topk latent rows MLA attends); its 2-GPU (sharded heads / experts / vocab) numbers come from
`mpirun -n 2 python scripts/draft_glm.py --real-dims`."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import traceback

import numpy as np

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]      # bench_common + run_real_dims_*, then this tree's mtp_cupy

import bench_common as bc  # noqa: E402

import mtp_cupy  # noqa: E402
from mtp_cupy.runtime.dtypes import to_bf16  # noqa: E402

FAMILIES = ("deepseek_v4", "deepseek_v3", "qwen3_next", "glm5")
TITLES = {"deepseek_v4": "DeepSeek-V4-Flash", "deepseek_v3": "DeepSeek-V3/R1", "qwen3_next": "Qwen3-Next-80B-A3B",
          "glm5": "GLM-5"}


# -- the mtp_cupy proposer of a family (the run_real_dims_* builders) ------------------------------------------
class Ours:
    """prop, its states (one per batch slot, each prefilled with ctx rows), the host hidden shape, KV rows a
    step reads, and whether it has a batched propose."""

    def __init__(self, fam: str, gpu, a, kmax: int, bmax: int):
        self.fam, self.gpu, self.ctx = fam, gpu, a.ctx
        max_seq = a.ctx + kmax + 16
        t0 = time.perf_counter()
        if fam == "deepseek_v3":
            import run_real_dims_v3 as m
            from mtp_cupy.models.deepseek_v3 import DeepseekV3MtpProposer
            from mtp_cupy.weights.config import DeepseekV3Config
            self.cfgd = m.TINY if a.tiny else m.REAL
            cfg = DeepseekV3Config.from_dict(self.cfgd)
            self.prop = DeepseekV3MtpProposer(gpu, cfg, m.random_weights(gpu, cfg, a.seed), max_seq_len=max_seq,
                                              max_drafts=kmax)
            self.hshape, self.kv_rows, self.batched = (cfg.hidden_size,), a.ctx + 1, False
            self.formats = "FP8 block (f32 scales) projections + experts; BF16 eh_proj, router, embed, head"
        elif fam == "deepseek_v4":
            import run_real_dims_v4 as m
            from mtp_cupy.models.deepseek_v4 import DeepseekV4MtpProposer
            from mtp_cupy.weights.config import DeepseekV4Config
            self.cfgd = m.TINY if a.tiny else m.REAL
            cfg = DeepseekV4Config.from_dict(self.cfgd)
            self.prop = DeepseekV4MtpProposer(gpu, cfg, m.random_weights(gpu, cfg, a.seed), max_seq_len=max_seq,
                                              max_drafts=kmax, device_hidden="streams")
            self.hshape, self.batched = (cfg.hc_mult, cfg.hidden_size), False
            self.kv_rows = min(a.ctx + 1, cfg.sliding_window)
            self.formats = "FP8 (e8m0 scales) projections, MXFP4 routed experts, FP8 shared; BF16 router, embed, head"
        elif fam == "glm5":
            import draft_glm as m
            from mtp_cupy.models.glm5 import Glm5MtpProposer
            from mtp_cupy.weights.config import GlmMoeDsaConfig
            from mtp_cupy.weights.glm5 import Shard
            self.cfgd = o_cfg(fam, a)
            cfg = GlmMoeDsaConfig.from_dict(self.cfgd)
            self.prop = Glm5MtpProposer(gpu, cfg, m.random_weights(gpu, cfg, Shard(), a.seed, "fp8"),
                                       max_seq_len=max_seq, max_drafts=kmax, head_fp8=a.glm_head_fp8)
            self.hshape, self.kv_rows, self.batched = (cfg.hidden_size,), a.ctx + 1, False
            self.formats = ("FP8 block (f32 scales) projections + experts + indexer wq_b/wk; BF16 eh_proj, router, "
                            f"weights_proj, embed, {'FP8 row' if self.prop.head.fmt == 'fp8_row' else 'BF16'} head")
        else:
            import run_real_dims_qwen as m
            from mtp_cupy.cache.paged import PagedKvCache
            from mtp_cupy.models.qwen3_next import Qwen3NextMtpProposer
            from mtp_cupy.weights.config import Qwen3NextConfig
            self.cfgd = m.TINY if a.tiny else m.REAL
            cfg = Qwen3NextConfig.from_dict(self.cfgd)
            self.prop = Qwen3NextMtpProposer(gpu, cfg, m.random_weights(gpu, cfg, a.seed), max_seq_len=max_seq,
                                        quantization=a.qwen_quant, max_drafts=kmax, max_batch=bmax,
                                        kv_blocks=PagedKvCache.blocks_for(max_seq) * bmax)
            self.hshape, self.kv_rows, self.batched = (cfg.hidden_size,), a.ctx + 1, True
            self.formats = f"{a.qwen_quant} projections + experts (run_real_dims_qwen), BF16 router + shared gate"
        gpu.synchronize()
        self.build_s = time.perf_counter() - t0
        p = self.prop
        self.kv_row_bytes = sum(s.row_bytes * s.num_layers for s in p.kv.specs.values())
        self.kv_step_bytes = self.kv_rows * self.kv_row_bytes
        if fam == "glm5":    # the indexer reads every key row, MLA only the index_topk latent rows it picked
            lat = p.kv.specs["latent"]
            self.kv_step_bytes -= (self.kv_rows - min(cfg.index_topk, self.kv_rows)) * lat.row_bytes * lat.num_layers
        rng = np.random.default_rng(a.seed)
        V = p.vocab_size
        hs = to_bf16(rng.standard_normal((a.ctx, *self.hshape), dtype=np.float32))
        self.states = [p.alloc_state() for _ in range(bmax if self.batched else 1)]
        t0 = time.perf_counter()
        for st in self.states:
            p.prefill(st, rng.integers(0, V, a.ctx + 1), hs)
        gpu.synchronize()
        self.prefill_s = time.perf_counter() - t0
        self.toks = [int(t) for t in rng.integers(0, V, len(self.states))]
        self.h = to_bf16(rng.standard_normal((len(self.states), *self.hshape), dtype=np.float32))

    def call(self, k: int, B: int):
        p, ctx = self.prop, self.ctx
        if B == 1:
            st, tok, h = self.states[0], self.toks[0], self.h[0]

            def run():
                p.propose(st, tok, h, ctx, k)
                p.after_verify(st, 0)
            return run
        sts, toks, h = self.states[:B], self.toks[:B], np.ascontiguousarray(self.h[:B])

        def run_batch():
            with self.gpu.using(p.stream):      # propose_batch launches on the current stream
                p.propose_batch(sts, toks, h, [ctx] * B, k)
                for st in sts:
                    p.after_verify(st, 0)
        return run_batch

    def weight_bytes(self, B: int) -> int:
        return self.prop.weight_bytes_per_step(B) if self.batched else self.prop.weight_bytes_per_step()

    def kv_bytes(self, B: int) -> int:
        return B * self.kv_step_bytes

    def close(self) -> None:
        for st in self.states:
            self.prop.free_state(st)
        self.prop = self.states = None


def _per_step(gpu_us, wall_us, k: int) -> dict:
    g, w = bc.median(gpu_us), bc.median(wall_us)
    return dict(gpu_us=None if g is None else g / k, wall_us=w / k,
                host_us=None if g is None else max(w - g, 0.0) / k,
                gpu_us_calls=gpu_us, wall_us_calls=wall_us)


def measure_ours(o: Ours, clock, k: int, B: int, iters: int, notes: list) -> dict:
    """Graph on (warm-up: eager, capture, replay) and graph off, per draft step."""
    p, cuda = o.prop, o.gpu.is_cuda
    fn = o.call(k, B)
    out = {"graph_on": None, "graph_off": None}
    if cuda:
        p.cuda_graphs = True
        for _ in range(3):
            fn()
        captured = bool(p.graph_safe) and any(key[0] == k if B == 1 else key[:3] == ("batch", k, p._bucket(B))
                                              for key in p._graphs)
        if not captured:
            notes.append(f"k={k}: no CUDA graph was captured (graph_safe={p.graph_safe}); graph-on ran eagerly")
        out["graph_on"] = _per_step(*clock.time(fn, p.stream, iters), k)
        out["graph_on"]["captured"] = captured
    p.cuda_graphs = False
    for _ in range(2):
        fn()
    out["graph_off"] = _per_step(*clock.time(fn, p.stream, iters), k)
    if cuda:
        p.cuda_graphs = True
    return out


def measure_torch(peer, tclock, k: int, iters: int, cuda: bool, notes: list) -> dict:
    out = {"eager": None, "graph": None}
    fn = lambda: peer.chain(k)        # noqa: E731
    for _ in range(3):
        fn()
    out["eager"] = _per_step(*tclock.time(fn, iters), k)
    if not cuda:
        return out
    try:
        g = bc.torch_graph(peer.chain, k)
    except Exception as e:           # noqa: BLE001
        notes.append(f"torch k={k}: CUDA graph capture failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
        bc.free_device_memory()
        return out
    g.replay()
    out["graph"] = _per_step(*tclock.time(g.replay, iters), k)
    del g
    return out


def run_family(fam: str, gpu, a, bw: float | None, tstat: tuple[bool, str]) -> dict:
    res = dict(family=fam, title=TITLES[fam], ctx=a.ctx, ks=a.ks, batches=a.batches, rows=[], notes=[],
               error=None, torch_error=None)
    kmax, bmax = max(a.ks), max(a.batches)
    rows = {}
    o = clock = None
    try:
        clock = bc.CupyClock() if gpu.is_cuda else bc.HostClock()
        o = Ours(fam, gpu, a, kmax, bmax)
        res.update(build_s=o.build_s, prefill_s=o.prefill_s, formats=o.formats, kv_rows=o.kv_rows,
                   kv_row_bytes=o.kv_row_bytes,
                   dims={k: v for k, v in o.cfgd.items() if isinstance(v, (int, float, str))})
        print(f"# {fam}: built in {o.build_s:.1f} s, prefill of {a.ctx} rows x {len(o.states)} in "
              f"{o.prefill_s:.2f} s" + (f"; device memory in use {bc.cupy_used_gb():.1f} GiB" if gpu.is_cuda else ""),
              flush=True)
        for B in a.batches:
            if B > 1 and not o.batched:
                res["notes"].append(f"batch {B}: {fam} has no batched propose; skipped")
                continue
            wb, kvb = o.weight_bytes(B), o.kv_bytes(B)
            for k in a.ks:
                t0 = time.perf_counter()
                m = measure_ours(o, clock, k, B, a.iters, res["notes"])
                floor = 1e6 * (wb + kvb) / bw if bw else None
                rows[(k, B)] = dict(k=k, batch=B, ours=m, weight_bytes=wb, kv_bytes=kvb, floor_us=floor)
                print(f"#   k={k} batch={B}: ours {_fmt(_best(m))} µs/step ({time.perf_counter() - t0:.1f} s)",
                      flush=True)
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
        if clock is not None:
            clock.close()
        clock = None
        bc.free_device_memory()

    # the torch peer: batch 1 only, after mtp_cupy's memory is given back
    tres = {}
    if a.no_torch:
        res["notes"].append("torch peer skipped (--no-torch)")
    elif not (tstat[0] or a.torch_cpu):
        res["notes"].append(f"torch peer skipped: {tstat[1]}")
    elif 1 not in a.batches:
        res["notes"].append("torch peer runs batch 1 only; --batches has no 1")
    else:
        peer = tclock = None
        cuda = tstat[0]
        try:
            t0 = time.perf_counter()
            dev = "cuda" if cuda else "cpu"
            peer = bc.PEERS[fam](o_cfg(fam, a), a.ctx, kmax, dev, a.seed)
            tclock = bc.TorchClock(dev)
            res.update(torch_build_s=time.perf_counter() - t0, torch_bytes=peer.bytes_per_step,
                       torch_weight_bytes=peer.weight_bytes, torch_kv_bytes=peer.kv_bytes, torch_device=dev)
            print(f"# {fam}: torch peer ({dev}) built in {res['torch_build_s']:.1f} s", flush=True)
            for k in a.ks:
                tres[k] = measure_torch(peer, tclock, k, a.iters, cuda, res["notes"])
                print(f"#   k={k}: torch eager {_fmt(_best_t(tres[k], 'eager'))}, graph "
                      f"{_fmt(_best_t(tres[k], 'graph'))} µs/step", flush=True)
        except Exception:             # noqa: BLE001
            res["torch_error"] = traceback.format_exc()
            print(f"# {fam}: torch peer FAILED\n{res['torch_error']}", file=sys.stderr, flush=True)
        finally:
            peer = tclock = None
            bc.free_device_memory()
    tfloor = 1e6 * res["torch_bytes"] / bw if bw and "torch_bytes" in res else None
    res["torch_floor_us"] = tfloor
    for k in tres:                   # torch numbers survive a failed mtp_cupy side
        rows.setdefault((k, 1), dict(k=k, batch=1, ours={}, weight_bytes=None, kv_bytes=None, floor_us=None))
    for (k, B), r in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        r["torch"] = tres.get(k) if B == 1 else None
        res["rows"].append(r)
    return res


def o_cfg(fam: str, a) -> dict:
    """The config dict the proposer was built from (the peers read the same dims)."""
    if fam == "glm5":
        import draft_glm
        from mtp_cupy.testing.tiny.glm5 import TINY_DIMS
        return {**draft_glm.REAL, **TINY_DIMS} if a.tiny else draft_glm.REAL
    m = __import__({"deepseek_v3": "run_real_dims_v3", "deepseek_v4": "run_real_dims_v4",
                    "qwen3_next": "run_real_dims_qwen"}[fam])
    return m.TINY if a.tiny else m.REAL


# -- report ------------------------------------------------------------------------------------------------
def _fmt(x, nd: int = 1) -> str:
    return "-" if x is None else f"{x:,.{nd}f}"


def _best(m: dict) -> float | None:
    """Ours per step: graph-on GPU µs when measured, else graph-off GPU µs, else wall (NumPy device)."""
    for key in ("graph_on", "graph_off"):
        r = m.get(key)
        if r:
            return r["gpu_us"] if r["gpu_us"] is not None else r["wall_us"]
    return None


def _best_t(t: dict | None, key: str) -> float | None:
    if not t or not t.get(key):
        return None
    r = t[key]
    return r["gpu_us"] if r["gpu_us"] is not None else r["wall_us"]


def _pair(m: dict, field: str) -> str:
    on, off = m.get("graph_on"), m.get("graph_off")
    return f"{_fmt(on[field] if on else None)} / {_fmt(off[field] if off else None)}"


def table(res: dict, header: dict) -> str:
    L = [f"### {res['title']} ({res['family']}), ctx {res['ctx']}"]
    L.append(f"device {header['device']}; {header['date']}; D2D copy {_fmt(header['copy_gbs'], 0)} GB/s (read+write); "
             f"iters {header['iters']}; cold L2 (256 MB memset before each call)")
    if res.get("formats"):
        r0 = next((r for r in res["rows"] if r.get("weight_bytes")), None)
        L.append(f"ours: {res['formats']}; built {res['build_s']:.1f} s" +
                 (f"; weight bytes/step {r0['weight_bytes'] / 1e6:,.1f} MB + KV {res['kv_rows']} rows x "
                  f"{res['kv_row_bytes']} B" if r0 else "") +
                 (f" (reads {r0['kv_bytes'] / 1e6:,.3f} MB: latents of the index top-k only)" if r0 and
                  r0["kv_bytes"] != r0["batch"] * res["kv_rows"] * res["kv_row_bytes"] else ""))
    if "torch_bytes" in res:
        L.append(f"torch peer ({res['torch_device']}, bf16, batch 1): {res['torch_weight_bytes'] / 1e6:,.1f} MB "
                 f"weights + {res['torch_kv_bytes'] / 1e6:,.1f} MB KV per step; bf16 floor "
                 f"{_fmt(res['torch_floor_us'])} µs")
    L.append("")
    L.append("| k | batch | ours graph-on µs/step (GPU) | ours graph-off µs/step (GPU) | wall µs/step on / off | "
             "host µs/step on / off | floor µs | % of floor | torch eager µs/step | torch graph µs/step | "
             "speedup vs eager | speedup vs graph |")
    L.append("|" + "---|" * 12)
    for r in res["rows"]:
        m, t = r["ours"], r.get("torch")
        best = _best(m)
        on, off = m.get("graph_on"), m.get("graph_off")
        te, tg = _best_t(t, "eager"), _best_t(t, "graph")
        pct = 100 * best / r["floor_us"] if best and r["floor_us"] else None
        L.append(f"| {r['k']} | {r['batch']} | {_fmt(on['gpu_us'] if on else None)} | "
                 f"{_fmt(off['gpu_us'] if off else None)} | {_pair(m, 'wall_us')} | {_pair(m, 'host_us')} | "
                 f"{_fmt(r['floor_us'])} | {_fmt(pct, 0)}{'%' if pct else ''} | {_fmt(te)} | {_fmt(tg)} | "
                 f"{_fmt(te / best if te and best else None, 2)}{'x' if te and best else ''} | "
                 f"{_fmt(tg / best if tg and best else None, 2)}{'x' if tg and best else ''} |")
    for n in res["notes"]:
        L.append(f"- {n}")
    if res.get("error"):
        L.append(f"- mtp_cupy side FAILED: {res['error'].strip().splitlines()[-1]}")
    if res.get("torch_error"):
        L.append(f"- torch peer FAILED: {res['torch_error'].strip().splitlines()[-1]}")
    return "\n".join(L)


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.replace(" ", "").split(",") if x]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--family", choices=FAMILIES + ("all",), default="all")
    p.add_argument("--ctx", type=int, default=None, help="drafter rows before drafting (default 2048)")
    p.add_argument("--ks", type=_ints, default=None, help="drafts per propose, comma list (default 1,2,3,4)")
    p.add_argument("--batches", type=_ints, default=[1], help="batch widths, comma list (default 1)")
    p.add_argument("--iters", type=int, default=None, help="timed calls per point (default 20)")
    p.add_argument("--json", default=None, help="write every number here")
    p.add_argument("--no-torch", action="store_true", help="skip the torch peers")
    p.add_argument("--quick", action="store_true", help="ctx 1024, ks 1,3, iters 10 (unless given)")
    p.add_argument("--qwen-quant", choices=["bf16", "fp8", "nvfp4"], default="bf16",
                   help="Qwen3-Next projection format (the released checkpoint is bf16)")
    p.add_argument("--glm-head-fp8", action="store_true", help="GLM-5: draft from an FP8 (per-row scale) "
                   "copy of the BF16 head (head_fp8=True)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["auto", "cuda", "ref"], default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny dims (smoke run; default ctx 32, iters 2)")
    p.add_argument("--torch-cpu", action="store_true", help="run the torch peers on the CPU when torch has no CUDA "
                   "(smoke run of the peer code; use with --tiny)")
    a = p.parse_args()
    quick = dict(ctx=1024, ks=[1, 3], iters=10)
    tiny = dict(ctx=32, ks=[1, 3], iters=2)
    full = dict(ctx=2048, ks=[1, 2, 3, 4], iters=20)
    dflt = tiny if a.tiny else quick if a.quick else full
    for key, v in dflt.items():
        if getattr(a, key) is None:
            setattr(a, key, v)
    if min(a.ks) < 1 or min(a.batches) < 1 or max(a.batches) > 32 or a.ctx < 1 or a.iters < 1:
        p.error("ks, batches (1..32), ctx and iters must be positive")
    fams = FAMILIES if a.family == "all" else (a.family,)

    t_start = time.perf_counter()
    gpu = mtp_cupy.device(a.device)
    bw = bc.copy_bandwidth_cupy() if gpu.is_cuda else None
    name = bc.cuda_device_name() if gpu.is_cuda else f"{gpu.name} (NumPy device: wall clock only)"
    tstat = (False, "--no-torch") if a.no_torch else bc.torch_status()
    header = dict(device=name, date=datetime.datetime.now().isoformat(timespec="seconds"),
                  copy_gbs=bw / 1e9 if bw else None, iters=a.iters, ctx=a.ctx, ks=a.ks, batches=a.batches,
                  torch=tstat[1], argv=sys.argv[1:], qwen_quant=a.qwen_quant, glm_head_fp8=a.glm_head_fp8, tiny=a.tiny)
    print(f"# bench_draft: {name}; {header['date']}; copy bandwidth {_fmt(header['copy_gbs'], 0)} GB/s; "
          f"families {', '.join(fams)}; ctx {a.ctx}; ks {a.ks}; batches {a.batches}; iters {a.iters}; "
          f"torch: {tstat[1]}", flush=True)
    results = []
    for fam in fams:
        t0 = time.perf_counter()
        try:
            res = run_family(fam, gpu, a, bw, tstat)
        except Exception:             # noqa: BLE001  (anything run_family itself did not catch)
            res = dict(family=fam, title=TITLES[fam], ctx=a.ctx, rows=[], notes=[], error=traceback.format_exc())
            print(res["error"], file=sys.stderr, flush=True)
            bc.free_device_memory()
        res["wall_s"] = time.perf_counter() - t0
        results.append(res)
        try:
            print("\n" + table(res, header) + f"\n\n({fam}: {res['wall_s']:.1f} s)\n", flush=True)
        except Exception:             # noqa: BLE001  (the numbers still go to --json)
            traceback.print_exc()
    total = time.perf_counter() - t_start
    print(f"# total {total:.1f} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(header=header, total_s=total, families=results), f, indent=1, default=str)
        print(f"# wrote {a.json}")
    if any(r.get("error") for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
