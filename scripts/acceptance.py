"""Acceptance of the embedded MTP drafters on held-out text: prompts cut from the stdlib files the training
held out, greedy speculative decoding for K = 1..4, mean acceptance length and per-position rates, per family.

    python scripts/acceptance.py [--family all|F[,F...]] [--device ref|cuda] [--prompts 12] [--new-tokens 48]
                                 [--json PATH] [--plot PATH]
    python scripts/acceptance.py --family deepseek_v4 --device ref --prompts 1 --prompt-len 16 --new-tokens 4 --ks 1

DeepSeek-V3 runs mtp_cupy's own target; the other families run transformers' target (mtp_cupy.target.load_target).
Each prompt is decoded target-only and speculatively; the run stops with an error if the two differ (greedy
speculative decoding must emit exactly the target's own tokens)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import mtp_cupy
from mtp_cupy.bench.cli import Parser, int_list, positive_int, run_main
from mtp_cupy.bench.corpus import held_out_prompts
from mtp_cupy.errors import InputError
from mtp_cupy.speculative.metrics import SpecDecodeMetrics
from mtp_cupy.target import load_target


def families(s: str) -> list[str]:
    """"all" or a comma list of embedded families (argparse type)."""
    names = list(mtp_cupy.EMBEDDED) if s == "all" else [x for x in s.replace(" ", "").split(",") if x]
    bad = [n for n in names if n not in mtp_cupy.EMBEDDED]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"{s!r}: choose all or from {', '.join(mtp_cupy.EMBEDDED)}")
    return names


def measure(fam: str, gpu, ps: list[list[int]], new_tokens: int, ks: list[int], carried=None) -> dict:
    """{K: counters (vLLM names) + mean_acceptance_length + acceptance_rate_per_pos} of one family."""
    ck = mtp_cupy.EMBEDDED[fam]
    max_len = len(ps[0]) + new_tokens + max(ks) + 8
    target = load_target(ck, gpu, max_len)
    opts = {} if carried is None else {"carried_hidden": carried}
    drafter = mtp_cupy.load_proposer(ck, gpu=gpu, max_seq_len=max_len, max_drafts=max(ks), **opts)
    rows = {}
    for k in ks:
        m = SpecDecodeMetrics()
        for p in ps:
            base = mtp_cupy.generate_target_only(target, p, new_tokens)
            r = mtp_cupy.generate(target, drafter, p, new_tokens, num_drafts=k)
            if r.tokens != base.tokens:
                raise InputError(f"{fam}: speculative output differs from target-only (K={k})")
            m.merge(r.metrics)
        rows[k] = dict(m.as_vllm(), mean_acceptance_length=m.mean_acceptance_length,
                       acceptance_rate_per_pos=m.acceptance_rate_per_pos())
    return rows


def plot(results: dict, k: int, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for fam, rows in results.items():
        r = rows[k]["acceptance_rate_per_pos"]
        ax.plot(range(1, len(r) + 1), r, marker="o", label=f"{fam} (mean length {rows[k]['mean_acceptance_length']:.2f})")
    ax.set_xlabel("draft position"); ax.set_ylabel("acceptance rate"); ax.set_ylim(0, 1.02)
    ax.set_xticks(range(1, k + 1)); ax.set_title(f"embedded models, held-out stdlib text, K = {k}"); ax.legend()
    fig.tight_layout(); fig.savefig(path, dpi=80)
    plt.close(fig)


def main(argv=None) -> int:
    ap = Parser(__doc__)
    ap.add_argument("--family", type=families, default="all", help="all, or a comma list of families")
    ap.add_argument("--device", default="auto", choices=("auto", "cuda", "ref"),
                    help="cuda, the NumPy device (ref), or cuda when there is one (auto)")
    ap.add_argument("--prompts", type=positive_int, default=12, help="held-out prompts decoded per K")
    ap.add_argument("--prompt-len", type=positive_int, default=64, help="bytes (tokens) per prompt")
    ap.add_argument("--new-tokens", type=positive_int, default=48, help="tokens generated per prompt")
    ap.add_argument("--ks", type=int_list, default="1,2,3,4", help="drafts per step K, comma list")
    ap.add_argument("--carried-hidden", choices=("pre_norm", "post_norm"), default=None,
                    help="DeepSeek-V3 only: the hidden the drafter carries to its next step (default: post_norm)")
    ap.add_argument("--json", help="write the counters per family and K (vLLM names) to this file (default: none)")
    ap.add_argument("--plot", help="PNG of acceptance per position at the largest K, one line per family "
                    "(default: none)")
    a = ap.parse_args(argv)
    if a.carried_hidden and a.family != ["deepseek_v3"]:
        raise InputError("--carried-hidden is a DeepSeek-V3 option: pass --family deepseek_v3 with it")
    gpu = mtp_cupy.device(a.device)
    ps = held_out_prompts(a.prompts, a.prompt_len)
    print(f"{len(ps)} held-out prompts of {a.prompt_len} bytes, {a.new_tokens} new tokens each; device {gpu.name}")
    print("| family | K | mean acceptance length | acceptance per position | drafts | accepted |")
    print("|---|---|---|---|---|---|")
    results = {}
    for fam in a.family:
        results[fam] = measure(fam, gpu, ps, a.new_tokens, a.ks, a.carried_hidden)
        for k, r in results[fam].items():
            rate = ", ".join(f"{x:.2f}" for x in r["acceptance_rate_per_pos"])
            print(f"| {fam} | {k} | {r['mean_acceptance_length']:.2f} | {rate} | {r['spec_decode_num_drafts']} | "
                  f"{r['spec_decode_num_accepted_tokens']} |", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(dict(device=gpu.name, prompts=len(ps), prompt_len=a.prompt_len,
                                                new_tokens=a.new_tokens, results=results), indent=1))
    if a.plot:
        plot(results, max(a.ks), a.plot)
    return 0


if __name__ == "__main__":
    run_main(main)
