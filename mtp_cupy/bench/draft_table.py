"""The report of the draft-step benchmark (scripts/bench_draft.py): one markdown table per family, a row per
(batch, k)."""
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


def _pct(x, floor) -> str:
    return f"{fmt(100 * x / floor, 0)}%" if x and floor else "-"


def first_step(t1: float | None, tk: float | None, k: int) -> tuple[float, float] | None:
    """(a later step's µs, the first step against it) from the per-step µs of a 1-step call (t1) and a k-step
    call (tk): a k-step call costs first + (k - 1) later, so later = (k tk - t1) / (k - 1). None when either is
    missing or k < 2."""
    if t1 is None or tk is None or k < 2:
        return None
    later = (k * tk - t1) / (k - 1)
    return (later, t1 / later) if later > 0 else None


def _first_lines(res: dict) -> list[str]:
    """Per batch width with a k = 1 row and a longer one: the first step of a call against a later one (issue 16:
    <= 1.05), for the call and for the graph alone."""
    out = []
    rows = {(r["batch"], r["k"]): r for r in res["rows"]}
    for (B, k), r in sorted(rows.items()):
        one = rows.get((B, 1))
        if k < 2 or one is None or any(q > k for b, q in rows if b == B):   # the longest k of the width
            continue
        call = first_step(best(one["ours"]), best(r["ours"]), k)
        graph = first_step(*((m["ours"].get("graph_on") or {}).get("chain_us") for m in (one, r)), k)
        if call:
            out.append(f"first step at batch {B} (k = 1 against k = {k}): {call[1]:.3f}x a later step of "
                       f"{fmt(call[0])} µs" + (f"; graph alone {graph[1]:.3f}x of {fmt(graph[0])} µs" if graph else ""))
    return out


def _torch_lines(res: dict) -> tuple[list[str], list[str]]:
    """The header line of the torch peer, and a note per MoE path (which batch widths ran it, and why)."""
    peers = res.get("torch_peers") or []
    if not peers:
        return [], []
    p = peers[0]
    line = (f"torch peer ({res['torch_device']}, bf16, batched like ours): dense {p['dense_bytes'] / 1e6:,.1f} MB "
            f"per step at batch {p['batch']}, {p['expert_bytes'] / 1e6:,.1f} MB per distinct routed expert, KV "
            f"{p['kv_bytes'] / p['batch'] / 1e6:,.2f} MB per sequence; its floor counts its own distinct experts")
    paths = {}
    for r in res["rows"]:
        t = r.get("torch")
        if t and t.get("moe_path"):
            paths.setdefault(t["moe_path"], set()).add(r["batch"])
    why = {q["moe_path"]: q["moe_reason"] for q in peers}
    notes = [f"torch MoE path {path} at batch {', '.join(map(str, sorted(bs)))}"
             + (f" ({why[path]})" if path in why else "") for path, bs in sorted(paths.items())]
    return [line], notes


def table(res: dict, header: dict) -> str:
    """The markdown report of one family: a row per (batch, k), ours next to the torch peer at the same width.

    Parameters
    ----------
    res : dict
        `draft_bench.run_family`'s result (or the same read back from --json).
    header : dict
        The run's header (device, date, copy_gbs, iters).
    """
    L = [f"### {res['title']} ({res['family']}), ctx {res['ctx']}"]
    L.append(f"device {header['device']}; {header['date']}; D2D copy {fmt(header['copy_gbs'], 0)} GB/s (read+write); "
             f"iters {header['iters']}; cold L2 (256 MB {header.get('flush', 'memset')} before each call); "
             f"hiddens on the {header.get('hidden_on', 'host')}" +
             ("; ours timed as serving steps (after_verify_batch, one catch-up row a sequence by prefill_batch, "
              "propose_batch: the floor does not count the catch-up)" if header.get("catch_up") else ""))
    if res.get("formats"):
        r0 = next((r for r in res["rows"] if r.get("weight_bytes")), None)
        L.append(f"ours: {res['formats']}; built {res['build_s']:.1f} s" +
                 (f"; weight bytes/step {r0['weight_bytes'] / 1e6:,.1f} MB at batch {r0['batch']} + KV "
                  f"{res['kv_rows']} rows x {res['kv_row_bytes']} B per sequence" if r0 else "") +
                 (f" (reads {r0['kv_bytes'] / r0['batch'] / 1e6:,.3f} MB: latents of the index top-k only)"
                  if r0 and r0["kv_bytes"] != r0["batch"] * res["kv_rows"] * res["kv_row_bytes"] else ""))
    tl, tnotes = _torch_lines(res)
    L += tl
    L.append("")
    L.append("| batch | k | ours µs/step | graph on / off µs (GPU) | host µs on / off | graph alone µs | "
             "floor µs | % of floor | experts | torch eager µs/step | torch graph µs/step | torch floor µs | "
             "torch experts | vs torch eager | vs torch graph |")
    L.append("|" + "---|" * 15)
    for r in res["rows"]:
        m, t = r["ours"], r.get("torch") or {}
        b = best(m)
        te, tg = best_t(t, "eager"), best_t(t, "graph")
        alone = (m.get("graph_on") or {}).get("chain_us")
        L.append(f"| {r['batch']} | {r['k']} | {fmt(b)} | {_pair(m, 'gpu_us')} | {_pair(m, 'host_us')} | "
                 f"{fmt(alone)} | {fmt(r['floor_us'])} | {_pct(b, r['floor_us'])} | {fmt(r.get('experts'), 0)} | "
                 f"{fmt(te)} | {fmt(tg)} | {fmt(t.get('floor_us'))} | {fmt(t.get('experts'), 0)} | {_ratio(te, b)} | "
                 f"{_ratio(tg, b)} |")
    for n in _first_lines(res) + tnotes + res["notes"]:
        L.append(f"- {n}")
    if res.get("error"):
        L.append(f"- mtp_cupy side FAILED: {res['error'].strip().splitlines()[-1]}")
    if res.get("torch_error"):
        L.append(f"- torch peer FAILED: {res['torch_error'].strip().splitlines()[-1]}")
    return "\n".join(L)
