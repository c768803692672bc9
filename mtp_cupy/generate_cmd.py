"""`python -m mtp_cupy generate`: speculative decoding with a DeepSeek-V3-layout target and its MTP layer
(default: the embedded trained checkpoint, byte-level vocabulary), compared with target-only decoding."""
from __future__ import annotations

import json
import sys

from tqdm import tqdm


def run_generate(args) -> int:
    import mtp_cupy
    from .speculative.generate import generate, generate_target_only
    from .target import DeepseekV3Target
    gpu = mtp_cupy.device(args.device)
    path = args.checkpoint or mtp_cupy.DEFAULT_CHECKPOINT
    prompt = list(args.prompt.encode())
    max_len = len(prompt) + args.max_new_tokens + args.num_drafts + 2
    target = DeepseekV3Target(gpu, path, max_seq_len=max_len)
    drafter = mtp_cupy.load_proposer(path, gpu=gpu, max_seq_len=max_len)
    print(f"device: {gpu.name}; target {path}: {target.cfg.num_hidden_layers} layers, hidden {target.hidden_size}, "
          f"vocab {target.vocab_size}; {args.num_drafts} drafts per step", file=sys.stderr)
    if gpu.is_cuda:  # compile and warm up outside the timings
        generate(target, drafter, prompt, min(8, args.max_new_tokens), args.num_drafts)
    base = None
    if not args.no_baseline:
        with tqdm(total=args.max_new_tokens, desc="target only", file=sys.stderr, leave=False) as bar:
            base = generate_target_only(target, prompt, args.max_new_tokens, args.temperature, args.seed, bar)
    with tqdm(total=args.max_new_tokens, desc="speculative", file=sys.stderr, leave=False) as bar:
        spec = generate(target, drafter, prompt, args.max_new_tokens, args.num_drafts, args.temperature, args.seed, bar)
    m = spec.metrics
    print(args.prompt + bytes(spec.tokens).decode("utf-8", errors="replace"))
    print("---", file=sys.stderr)
    print(f"speculative: {spec.tokens_per_s:.1f} tokens/s, {spec.target_passes} target passes, mean acceptance "
          f"length {m.mean_acceptance_length:.2f}", file=sys.stderr)
    print("acceptance per position: " + ", ".join(f"{r:.2f}" for r in m.acceptance_rate_per_pos()), file=sys.stderr)
    if base is not None:
        same = "identical" if base.tokens == spec.tokens else "DIFFERENT"
        print(f"target only: {base.tokens_per_s:.1f} tokens/s; speedup {spec.tokens_per_s / base.tokens_per_s:.2f}x; "
              f"output {same} to target-only" + (" (greedy)" if args.temperature <= 0 else " (sampled)"),
              file=sys.stderr)
    if args.metrics_json:
        rec = dict(m.as_vllm(), mean_acceptance_length=m.mean_acceptance_length,
                   acceptance_rate_per_pos=m.acceptance_rate_per_pos(), tokens_per_s=spec.tokens_per_s,
                   target_only_tokens_per_s=base.tokens_per_s if base else None, device=gpu.name,
                   num_drafts=args.num_drafts, new_tokens=len(spec.tokens))
        with open(args.metrics_json, "w") as f:
            json.dump(rec, f, indent=1)
    return 0
