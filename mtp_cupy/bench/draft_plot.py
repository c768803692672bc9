"""The plot of the draft-step benchmark (scripts/bench_draft.py --plot): µs per draft step against the batch width
(log2 axis), one panel per family (two to a row), lines for ours, the graphed and the eager torch peer, and both
floors. matplotlib (Agg backend) is imported when a plot is drawn; without it the plot is skipped with a one-line
note."""
from __future__ import annotations

import math

from .draft_table import best, best_t

# (label, row -> µs or None, matplotlib format, line width)
LINES = (
    ("ours", lambda r: best(r["ours"]), "o-", 2.0),
    ("torch graph", lambda r: best_t(r.get("torch"), "graph"), "s-", 1.5),
    ("torch eager", lambda r: best_t(r.get("torch"), "eager"), "^--", 1.2),
    ("floor (ours' bytes)", lambda r: r.get("floor_us"), "k:", 1.5),
    ("torch bf16 floor", lambda r: (r.get("torch") or {}).get("floor_us"), ":", 1.0),
)


def plot_k(res: dict) -> int | None:
    """The k a family's panel shows by default: the largest k with a measured row."""
    ks = [r["k"] for r in res.get("rows", []) if best(r["ours"]) or r.get("torch")]
    return max(ks) if ks else None


def series(res: dict, k: int) -> dict:
    """The lines of one family's panel: its rows at `k`, by batch width.

    Parameters
    ----------
    res : dict
        One family's result: `draft_bench.run_family`'s, or the same read back from --json.
    k : int
        Drafts per propose.

    Returns
    -------
    dict
        {label: ([batch], [µs per step])}, `LINES`' labels; a line with no measured point is left out.
    """
    rows = sorted((r for r in res.get("rows", []) if r["k"] == k), key=lambda r: r["batch"])
    out = {}
    for label, get, _, _ in LINES:
        pts = [(r["batch"], get(r)) for r in rows if get(r)]
        if pts:
            out[label] = ([b for b, _ in pts], [y for _, y in pts])
    return out


def _ours_label(res: dict, k: int) -> str:
    rows = [r["ours"] for r in res.get("rows", []) if r["k"] == k and r["ours"]]
    if any(m.get("graph_on") for m in rows):
        return "ours (graph on)"
    return "ours (graph off)" if any((m.get("graph_off") or {}).get("gpu_us") for m in rows) else "ours (wall)"


def _tick(v: float, _pos) -> str:
    """A log axis' label: µs with thousands separators at 1, 2 and 5 times a power of ten, else none."""
    if v <= 0:
        return ""
    lead = v / 10 ** math.floor(math.log10(v) + 1e-9)
    return f"{v:,.0f}" if min(abs(lead - d) for d in (1, 2, 5)) < 1e-6 else ""


def plot(results: list, header: dict, path: str, k: int | None = None) -> str:
    """Write the PNG of a run: a panel per family, µs per draft step against the batch width.

    Parameters
    ----------
    results : list of dict
        `run_family` results, one per family.
    header : dict
        The run's header (device, date, ctx).
    path : str
        The PNG to write.
    k : int, optional
        Drafts per propose to show (default: each family's largest k).

    Returns
    -------
    str
        A one-line note: what was written, or why nothing was.
    """
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter
    except Exception as e:           # noqa: BLE001
        return f"--plot skipped: matplotlib is not importable ({type(e).__name__}: {e})"
    panels = [(res, k or plot_k(res)) for res in results if (k or plot_k(res))]
    if not panels:
        return "--plot skipped: no measured rows"
    ticks = FuncFormatter(_tick)
    cols = min(2, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.6 * cols, 4.2 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (res, kk) in zip(axes.flat, panels):
        ss = series(res, kk)
        for label, _, style, lw in LINES:
            if label in ss:
                xs, ys = ss[label]
                ax.plot(xs, ys, style, lw=lw, ms=4, label=_ours_label(res, kk) if label == "ours" else label)
        bs = sorted({b for xs, _ in ss.values() for b in xs})
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(ticks)
        ax.yaxis.set_minor_formatter(ticks)
        if bs:
            ax.set_xticks(bs, [str(b) for b in bs])
        ax.set_title(f"{res.get('title', res['family'])}, k={kk}")
        ax.set_xlabel("batch (sequences drafted together)")
        ax.set_ylabel("µs per draft step")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"Draft step against batch width: {header.get('device')}, ctx {header.get('ctx')}, "
                 f"{header.get('date')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote {path} ({len(panels)} panel(s))"
