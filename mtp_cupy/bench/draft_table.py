"""The report of the draft-step benchmark: one markdown table per family (scripts/bench_draft.py)."""
from __future__ import annotations


def fmt(x, nd: int = 1) -> str:
    """`x` with thousands separators and `nd` decimals, or "-" for None."""
    return "-" if x is None else f"{x:,.{nd}f}"


def best(m: dict) -> float | None:
    """Ours per step: graph-on GPU µs when measured, else graph-off GPU µs, else wall (NumPy device)."""
    for key in ("graph_on", "graph_off"):
        r = m.get(key)
        if r:
            return r["gpu_us"] if r["gpu_us"] is not None else r["wall_us"]
    return None


def best_t(t: dict | None, key: str) -> float | None:
    """The torch peer's per-step µs of `key` ("eager" or "graph"): GPU time, else wall."""
    if not t or not t.get(key):
        return None
    r = t[key]
    return r["gpu_us"] if r["gpu_us"] is not None else r["wall_us"]


def _pair(m: dict, field: str) -> str:
    on, off = m.get("graph_on"), m.get("graph_off")
    return f"{fmt(on[field] if on else None)} / {fmt(off[field] if off else None)}"


def _ratio(t, b) -> str:
    return f"{fmt(t / b if t and b else None, 2)}{'x' if t and b else ''}"


def table(res: dict, header: dict) -> str:
    """The markdown report of one family.

    Parameters
    ----------
    res : dict
        `draft_bench.run_family`'s result.
    header : dict
        The run's header (device, date, copy_gbs, iters).
    """
    L = [f"### {res['title']} ({res['family']}), ctx {res['ctx']}"]
    L.append(f"device {header['device']}; {header['date']}; D2D copy {fmt(header['copy_gbs'], 0)} GB/s (read+write); "
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
                 f"{fmt(res['torch_floor_us'])} µs")
    L.append("")
    L.append("| k | batch | ours graph-on µs/step (GPU) | ours graph-off µs/step (GPU) | wall µs/step on / off | "
             "host µs/step on / off | floor µs | % of floor | torch eager µs/step | torch graph µs/step | "
             "speedup vs eager | speedup vs graph |")
    L.append("|" + "---|" * 12)
    for r in res["rows"]:
        m, t = r["ours"], r.get("torch")
        b = best(m)
        on, off = m.get("graph_on"), m.get("graph_off")
        te, tg = best_t(t, "eager"), best_t(t, "graph")
        pct = 100 * b / r["floor_us"] if b and r["floor_us"] else None
        L.append(f"| {r['k']} | {r['batch']} | {fmt(on['gpu_us'] if on else None)} | "
                 f"{fmt(off['gpu_us'] if off else None)} | {_pair(m, 'wall_us')} | {_pair(m, 'host_us')} | "
                 f"{fmt(r['floor_us'])} | {fmt(pct, 0)}{'%' if pct else ''} | {fmt(te)} | {fmt(tg)} | "
                 f"{_ratio(te, b)} | {_ratio(tg, b)} |")
    for n in res["notes"]:
        L.append(f"- {n}")
    if res.get("error"):
        L.append(f"- mtp_cupy side FAILED: {res['error'].strip().splitlines()[-1]}")
    if res.get("torch_error"):
        L.append(f"- torch peer FAILED: {res['torch_error'].strip().splitlines()[-1]}")
    return "\n".join(L)
