"""Acceptance of the embedded MTP drafter on held-out text: prompts cut from the stdlib files the training
held out, greedy speculative decoding for K = 1..4, mean acceptance length and per-position rates.

    python scripts/acceptance.py [--device ref|cuda] [--prompts 12] [--new-tokens 48] [--json PATH]
    python scripts/acceptance.py --device ref --prompts 1 --prompt-len 16 --new-tokens 4 --ks 1   # smoke run

Each prompt is decoded target-only and speculatively; the run stops with an error if the two differ (greedy
speculative decoding must emit exactly the target's own tokens)."""
from __future__ import annotations

import json
from pathlib import Path

import mtp_cupy
from mtp_cupy.bench.cli import Parser, int_list, positive_int, run_main
from mtp_cupy.bench.corpus import held_out_prompts
from mtp_cupy.speculative.metrics import SpecDecodeMetrics
from mtp_cupy.target import DeepseekV3Target


def main() -> int:
    ap = Parser(__doc__)
    ap.add_argument("--device", default="auto", choices=("auto", "cuda", "ref"),
                    help="cuda, the NumPy device (ref), or cuda when there is one (auto)")
    ap.add_argument("--prompts", type=positive_int, default=12, help="held-out prompts decoded per K")
    ap.add_argument("--prompt-len", type=positive_int, default=64, help="bytes (tokens) per prompt")
    ap.add_argument("--new-tokens", type=positive_int, default=48, help="tokens generated per prompt")
    ap.add_argument("--ks", type=int_list, default="1,2,3,4", help="drafts per step K, comma list")
    ap.add_argument("--carried-hidden", choices=("pre_norm", "post_norm"), default=None,
                    help="the hidden the drafter carries to its next step (default: the proposer's, post_norm)")
    ap.add_argument("--json", help="write the counters per K (vLLM names) to this file (default: none)")
    a = ap.parse_args()
    gpu = mtp_cupy.device(a.device)
    ck = mtp_cupy.DEFAULT_CHECKPOINT
    max_len = a.prompt_len + a.new_tokens + 8
    target = DeepseekV3Target(gpu, ck, max_seq_len=max_len)
    opts = {} if a.carried_hidden is None else {"carried_hidden": a.carried_hidden}
    drafter = mtp_cupy.load_proposer(ck, gpu=gpu, max_seq_len=max_len, **opts)
    ps, rows = held_out_prompts(a.prompts, a.prompt_len), {}
    print(f"{len(ps)} held-out prompts of {a.prompt_len} bytes, {a.new_tokens} new tokens each; device {gpu.name}; "
          f"carried hidden {drafter.options.carried_hidden}")
    print("| K | mean acceptance length | acceptance per position | drafts | accepted |")
    print("|---|---|---|---|---|")
    for k in a.ks:
        m = SpecDecodeMetrics()
        for p in ps:
            base = mtp_cupy.generate_target_only(target, p, a.new_tokens)
            r = mtp_cupy.generate(target, drafter, p, a.new_tokens, num_drafts=k)
            if r.tokens != base.tokens:
                raise SystemExit(f"speculative output differs from target-only (K={k})")
            m.merge(r.metrics)
        rate = ", ".join(f"{x:.2f}" for x in m.acceptance_rate_per_pos())
        print(f"| {k} | {m.mean_acceptance_length:.2f} | {rate} | {m.num_drafts} | {m.num_accepted_tokens} |")
        rows[k] = dict(m.as_vllm(), mean_acceptance_length=m.mean_acceptance_length)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    run_main(main)
