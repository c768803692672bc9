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


DEFAULT_PROMPT = "import os\nimport sys\n\n\ndef main("
MAX_PROMPTS = 64   # the drafter's largest batch (ProposerOptions.max_batch; tests/test_cli.py checks it)


def plan(args, path) -> tuple[list[list[int]], int, int]:
    """(the prompts' ids, drafts per step, max_seq_len) for the run, checked against the checkpoint before any
    weight is read. Drafts are capped to what max_new_tokens can use (the prefill pass gives the first token)."""
    from .weights.config import load_config
    from .weights.info import checkpoint_dir
    cfg = load_config(checkpoint_dir(path))
    if args.metrics_json and not Path(args.metrics_json).resolve().parent.is_dir():
        raise InputError(f"--metrics-json {args.metrics_json}: directory {Path(args.metrics_json).parent} does "
                         "not exist")
    texts = args.prompt or [DEFAULT_PROMPT]
    if len(texts) > MAX_PROMPTS:
        raise InputError(f"{len(texts)} --prompt given; at most {MAX_PROMPTS} are decoded together")
    prompts = [list(t.encode()) for t in texts]
    for text, prompt in zip(texts, prompts):
        if len(prompt) < 2:
            raise InputError(f"--prompt {text!r} is {len(prompt)} byte(s); the drafter needs at least two tokens")
        if any(t >= cfg.vocab_size for t in prompt):
            raise InputError(f"--prompt {text!r} has bytes outside this checkpoint's vocab of {cfg.vocab_size}")
    k = min(args.num_drafts, max(args.max_new_tokens - 1, 1))
    if k < args.num_drafts:
        print(f"note: --max-new-tokens {args.max_new_tokens} leaves room for at most {k} draft(s) per step; "
              f"drafting {k}, not {args.num_drafts}", file=sys.stderr)
    longest = max(len(p) for p in prompts)
    max_len = longest + args.max_new_tokens + k + 2
    ctx = getattr(cfg, "max_position_embeddings", None) or max_len
    if max_len > ctx:
        raise InputError(f"--max-new-tokens {args.max_new_tokens} does not fit the model's context: the prompt's "
                         f"{longest} tokens + {args.max_new_tokens} new + {k} drafts (+2) run past "
                         f"max_position_embeddings {ctx}; at most {ctx - longest - k - 2} new tokens here")
    return prompts, k, max_len


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
    prompts, k, max_len = plan(args, path)
    gpu = mtp_cupy.device(args.device)
    target = load_target(path, gpu, max_len, max_sequences=max(len(prompts), 2))
    drafter = mtp_cupy.load_proposer(path, gpu=gpu, max_seq_len=max_len, max_drafts=k, max_batch=len(prompts))
    runner = "mtp_cupy's own target" if isinstance(target, DeepseekV3Target) else "transformers' target"
    print(f"device: {gpu.name}; {drafter.family} {path} ({runner}): {target.cfg.num_hidden_layers} layers, hidden "
          f"{target.hidden_size}, vocab {target.vocab_size}; {k} drafts per step", file=sys.stderr)
    if len(prompts) > 1:
        return run_batch(args, target, drafter, prompts, k)
    prompt = prompts[0]
    if gpu.is_cuda:  # compile and warm up outside the timings
        generate(target, drafter, prompt, min(8, args.max_new_tokens), k)
    base = None
    if not args.no_baseline:
        with tqdm(total=args.max_new_tokens, desc="target only", file=sys.stderr, leave=False) as bar:
            base = generate_target_only(target, prompt, args.max_new_tokens, args.temperature, args.seed, bar)
    with tqdm(total=args.max_new_tokens, desc="speculative", file=sys.stderr, leave=False) as bar:
        spec = generate(target, drafter, prompt, args.max_new_tokens, k, args.temperature, args.seed, bar)
    m = spec.metrics
    print((args.prompt or [DEFAULT_PROMPT])[0] + bytes(spec.tokens).decode("utf-8", errors="replace"))
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


def run_batch(args, target, drafter, prompts: list[list[int]], k: int) -> int:
    """Several prompts decoded together (`generate_batch`): each continuation, then the batch's throughput and
    acceptance; with the baseline, each prompt target-only and whether every output is identical to it."""
    from .speculative.generate import generate_batch, generate_target_only
    from .speculative.metrics import SpecDecodeMetrics
    if drafter.gpu.is_cuda:  # compile and warm up outside the timings
        generate_batch(target, drafter, prompts, min(8, args.max_new_tokens), k)
    base = None
    if not args.no_baseline:
        base = [generate_target_only(target, p, args.max_new_tokens, args.temperature, args.seed + s)
                for s, p in enumerate(prompts)]
    res = generate_batch(target, drafter, prompts, args.max_new_tokens, k, args.temperature, args.seed)
    m = SpecDecodeMetrics()
    for s, (text, r) in enumerate(zip(args.prompt, res)):
        m.merge(r.metrics)
        print(f"[{s}] " + text + bytes(r.tokens).decode("utf-8", errors="replace"))
    tokens, seconds = sum(len(r.tokens) for r in res), res[0].seconds
    print("---", file=sys.stderr)
    print(f"speculative, {len(prompts)} prompts together: {tokens / seconds:.1f} tokens/s, mean acceptance length "
          f"{m.mean_acceptance_length:.2f}", file=sys.stderr)
    print("acceptance per position: " + ", ".join(f"{r:.2f}" for r in m.acceptance_rate_per_pos()), file=sys.stderr)
    if base is not None:
        same = sum(b.tokens == r.tokens for b, r in zip(base, res))
        b_s = sum(b.seconds for b in base)
        print(f"target only, one prompt at a time: {tokens / b_s:.1f} tokens/s; outputs identical to target-only: "
              f"{same} of {len(prompts)}" + (" (greedy)" if args.temperature <= 0 else " (sampled: prompt s seeds "
                                              "--seed + s)"), file=sys.stderr)
    if args.metrics_json:
        rec = dict(m.as_vllm(), mean_acceptance_length=m.mean_acceptance_length,
                   acceptance_rate_per_pos=m.acceptance_rate_per_pos(), tokens_per_s=tokens / seconds,
                   prompts=len(prompts), device=drafter.gpu.name, num_drafts=k, family=drafter.family)
        with open(args.metrics_json, "w") as f:
            json.dump(rec, f, indent=1)
    return 0
