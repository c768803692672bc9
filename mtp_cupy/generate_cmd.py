"""`python -m mtp_cupy generate`: speculative decoding with a checkpoint's target and its MTP layer (default: the
embedded trained model of --family, byte-level vocabulary), compared with target-only decoding. The target is
mtp_cupy's own runner for DeepSeek-V3 and transformers' model of the checkpoint for the other families."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from tqdm import tqdm

from .errors import ConfigError, InputError


def checkpoint_of(args) -> str:
    """--checkpoint, else the embedded model of --family (default deepseek_v3); a --family that is not the
    checkpoint's is an error."""
    import mtp_cupy
    from .weights.config import load_config
    from .weights.info import checkpoint_dir
    if args.checkpoint is None:
        return mtp_cupy.EMBEDDED[args.family or "deepseek_v3"]
    fam = load_config(checkpoint_dir(args.checkpoint)).family
    if args.family and args.family != fam:
        raise ConfigError(f"--checkpoint {args.checkpoint} is a {fam} checkpoint, not --family {args.family}")
    return args.checkpoint


def plan(args, path) -> tuple[list[int], int, int]:
    """(prompt ids, drafts per step, max_seq_len) for the run, checked against the checkpoint before any weight
    is read. Drafts are capped to what max_new_tokens can use (the prefill pass gives the first token)."""
    from .weights.config import load_config
    from .weights.info import checkpoint_dir
    cfg = load_config(checkpoint_dir(path))
    if args.metrics_json and not Path(args.metrics_json).resolve().parent.is_dir():
        raise InputError(f"--metrics-json {args.metrics_json}: directory {Path(args.metrics_json).parent} does "
                         "not exist")
    prompt = list(args.prompt.encode())
    if len(prompt) < 2:
        raise InputError(f"--prompt {args.prompt!r} is {len(prompt)} byte(s); the drafter needs at least two tokens")
    if any(t >= cfg.vocab_size for t in prompt):
        raise InputError(f"--prompt has bytes outside this checkpoint's vocab of {cfg.vocab_size}")
    k = min(args.num_drafts, max(args.max_new_tokens - 1, 1))
    if k < args.num_drafts:
        print(f"note: --max-new-tokens {args.max_new_tokens} leaves room for at most {k} draft(s) per step; "
              f"drafting {k}, not {args.num_drafts}", file=sys.stderr)
    max_len = len(prompt) + args.max_new_tokens + k + 2
    ctx = getattr(cfg, "max_position_embeddings", None) or max_len
    if max_len > ctx:
        raise InputError(f"--max-new-tokens {args.max_new_tokens} does not fit the model's context: the prompt's "
                         f"{len(prompt)} tokens + {args.max_new_tokens} new + {k} drafts (+2) run past "
                         f"max_position_embeddings {ctx}; at most {ctx - len(prompt) - k - 2} new tokens here")
    return prompt, k, max_len


def cpu_note(spec, base) -> str:
    """Why drafting does not pay on the NumPy device, with this run's own times."""
    m = spec.metrics
    step = 1e3 * spec.extra["draft_seconds"] / m.num_draft_tokens
    verify = 1e3 * spec.extra["verify_seconds"] / m.num_drafts
    rows = 1 + m.num_draft_tokens / m.num_drafts
    decode = ""
    if base is not None and len(base.tokens) > 1:
        decode = f" against {1e3 * base.extra['decode_seconds'] / (len(base.tokens) - 1):.1f} ms for a 1-row decode"
    return (f"note: on the NumPy device drafting costs more than it saves: a pass costs per row it computes (the "
            f"kernel twins run row by row in Python), {verify:.1f} ms for a {rows:.1f}-row verify{decode}, and "
            f"each draft step {step:.1f} ms. On a GPU a pass costs the weight bytes it reads: verifying k+1 rows "
            "costs about one decode step, and a draft step a small part of one.")


def run_generate(args) -> int:
    import mtp_cupy
    from .speculative.generate import generate, generate_target_only
    from .target import DeepseekV3Target, load_target
    path = checkpoint_of(args)
    prompt, k, max_len = plan(args, path)
    gpu = mtp_cupy.device(args.device)
    target = load_target(path, gpu, max_len)
    drafter = mtp_cupy.load_proposer(path, gpu=gpu, max_seq_len=max_len, max_drafts=k)
    runner = "mtp_cupy's own target" if isinstance(target, DeepseekV3Target) else "transformers' target"
    print(f"device: {gpu.name}; {drafter.family} {path} ({runner}): {target.cfg.num_hidden_layers} layers, hidden "
          f"{target.hidden_size}, vocab {target.vocab_size}; {k} drafts per step", file=sys.stderr)
    if gpu.is_cuda:  # compile and warm up outside the timings
        generate(target, drafter, prompt, min(8, args.max_new_tokens), k)
    base = None
    if not args.no_baseline:
        with tqdm(total=args.max_new_tokens, desc="target only", file=sys.stderr, leave=False) as bar:
            base = generate_target_only(target, prompt, args.max_new_tokens, args.temperature, args.seed, bar)
    with tqdm(total=args.max_new_tokens, desc="speculative", file=sys.stderr, leave=False) as bar:
        spec = generate(target, drafter, prompt, args.max_new_tokens, k, args.temperature, args.seed, bar)
    m = spec.metrics
    print(args.prompt + bytes(spec.tokens).decode("utf-8", errors="replace"))
    print("---", file=sys.stderr)
    print(f"speculative: {spec.tokens_per_s:.1f} tokens/s, {spec.target_passes} target passes, mean acceptance "
          f"length {m.mean_acceptance_length:.2f}", file=sys.stderr)
    print("acceptance per position: " + (", ".join(f"{r:.2f}" for r in m.acceptance_rate_per_pos()) or "none (no "
          "draft step: one token needs only the prefill pass)"), file=sys.stderr)
    if base is not None:
        same = "identical" if base.tokens == spec.tokens else "DIFFERENT"
        print(f"target only: {base.tokens_per_s:.1f} tokens/s; speedup {spec.tokens_per_s / base.tokens_per_s:.2f}x; "
              f"output {same} to target-only" + (" (greedy)" if args.temperature <= 0 else " (sampled)"),
              file=sys.stderr)
    if not gpu.is_cuda and isinstance(target, DeepseekV3Target) and m.num_drafts and (base is None or spec.tokens_per_s < base.tokens_per_s):
        print(cpu_note(spec, base), file=sys.stderr)
    if args.metrics_json:
        rec = dict(m.as_vllm(), mean_acceptance_length=m.mean_acceptance_length,
                   acceptance_rate_per_pos=m.acceptance_rate_per_pos(), tokens_per_s=spec.tokens_per_s,
                   target_only_tokens_per_s=base.tokens_per_s if base else None, device=gpu.name,
                   num_drafts=k, new_tokens=len(spec.tokens), family=drafter.family, checkpoint=str(path))
        with open(args.metrics_json, "w") as f:
            json.dump(rec, f, indent=1)
    return 0
