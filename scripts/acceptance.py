"""Acceptance of the embedded MTP drafter on held-out text: prompts cut from the stdlib files the training
held out, greedy speculative decoding for K = 1..4, mean acceptance length and per-position rates.

    python scripts/acceptance.py [--device ref|cuda] [--prompts 12] [--new-tokens 48] [--json PATH]"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))
import mtp_cupy  # noqa: E402
from mtp_cupy.speculative.metrics import SpecDecodeMetrics  # noqa: E402
from mtp_cupy.target import DeepseekV3Target  # noqa: E402
from stdlib_corpus import stdlib_files  # noqa: E402


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    files = [f.read_bytes() for f in stdlib_files(True)]
    files = [f for f in files if len(f) > 4 * length]
    out = []
    for i in rng.choice(len(files), n, replace=len(files) < n):
        start = int(rng.integers(0, len(files[i]) - length))
        out.append(list(files[i][start:start + length]))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto", choices=("auto", "cuda", "ref"))
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--ks", default="1,2,3,4")
    ap.add_argument("--json")
    a = ap.parse_args()
    gpu = mtp_cupy.device(a.device)
    ck = mtp_cupy.DEFAULT_CHECKPOINT
    max_len = a.prompt_len + a.new_tokens + 8
    target = DeepseekV3Target(gpu, ck, max_seq_len=max_len)
    drafter = mtp_cupy.load_proposer(ck, gpu=gpu, max_seq_len=max_len)
    ps, rows = prompts(a.prompts, a.prompt_len), {}
    print(f"{len(ps)} held-out prompts of {a.prompt_len} bytes, {a.new_tokens} new tokens each; device {gpu.name}")
    print("| K | mean acceptance length | acceptance per position | drafts | accepted |")
    print("|---|---|---|---|---|")
    for k in (int(x) for x in a.ks.split(",")):
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
    raise SystemExit(main())
