"""transformers `generate` three ways on one DeepSeek-V3-layout checkpoint, in one process: the target alone,
transformers' own MTP drafting (`generate(use_mtp=True)`: one draft per target forward, batch 1), and mtp_cupy's
drafter through `custom_generate=mtp_cupy.integrations.transformers.generate` with k drafts per forward.

    python scripts/bench_transformers.py                         # CPU: float32 target, drafter on the NumPy device
    python scripts/bench_transformers.py --device cuda           # GPU: bf16 target on cuda:0, drafter on CUDA
    python scripts/bench_transformers.py --ks 1,2,3 --max-new-tokens 200 --repeats 3 --json out.json

Default checkpoint: the embedded trained tiny model (mtp_cupy.DEFAULT_CHECKPOINT, 4 layers + the MTP layer at
index 4). transformers' `MtpModel.from_pretrained` finds the MTP keys through the target class's
`_keys_to_ignore_on_load_unexpected`, which DeepSeek-V3 hard-codes to layer 61: it is re-pointed at layer
`num_hidden_layers` before loading (`repoint_mtp_keys`).

Per method, greedy, `--max-new-tokens` from `--prompt`: tokens/s (new tokens / wall seconds: the median and
the best of --repeats runs, the methods taking turns, after one warm-up run each), target forwards, mean acceptance length (new tokens per target forward
after the prefill) and the per-draft acceptance rate, and whether the output equals the target's own.
transformers' counts come from counting its target forwards (each verifies one draft); ours from
SpecDecodeMetrics."""
from __future__ import annotations

import json
import time


def parse(argv=None):
    from mtp_cupy.bench.cli import Parser, int_list, positive_int
    ap = Parser(__doc__)
    ap.add_argument("--checkpoint", default=None, help="DeepSeek-V3-layout checkpoint (default: the embedded one)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="where the target runs; the drafter runs on cuda, or on the NumPy device for cpu")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                    help="target dtype (default: float32 on CPU, bfloat16 on CUDA)")
    ap.add_argument("--prompt", default="def main(", help="prompt text (bytes are the embedded model's tokens)")
    ap.add_argument("--max-new-tokens", type=positive_int, default=200, help="greedy tokens generated per run")
    ap.add_argument("--ks", type=int_list, default="1,3", help="mtp_cupy drafts per target forward, comma list")
    ap.add_argument("--repeats", type=positive_int, default=2, help="timed runs per method")
    ap.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--json", default=None, help="write the results here (default: none)")
    return ap.parse_args(argv)


class Counter:
    """Counts calls of a module's forward (the target's passes)."""

    def __init__(self, module):
        self.n = 0
        self.h = module.register_forward_pre_hook(self._count)

    def _count(self, *_):
        self.n += 1

    def close(self):
        self.h.remove()


def timed(fn, torch, cuda: bool):
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if cuda:
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def run(args) -> dict:
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    import mtp_cupy
    from mtp_cupy.integrations.transformers import generate as mtp_generate
    from mtp_cupy.integrations.transformers import repoint_mtp_keys
    from mtp_cupy.speculative.metrics import SpecDecodeMetrics

    if args.threads:
        torch.set_num_threads(args.threads)
    ckpt = args.checkpoint or mtp_cupy.DEFAULT_CHECKPOINT
    cuda = args.device == "cuda"
    dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))
    cfg = AutoConfig.from_pretrained(ckpt)
    cls = getattr(transformers, cfg.architectures[0])          # DeepseekV3ForCausalLM
    repoint_mtp_keys(cls, cfg.num_hidden_layers)
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype).to(args.device).eval()
    drafter = mtp_cupy.load_proposer(ckpt, gpu="cuda" if cuda else "ref",
                                     max_seq_len=len(args.prompt.encode()) + args.max_new_tokens + 16)
    ids = torch.tensor([list(args.prompt.encode())], device=args.device)
    n = args.max_new_tokens
    counter = Counter(model)
    methods = [("target only", None, lambda t, m: model.generate(ids, max_new_tokens=t, do_sample=False)),
               ("transformers use_mtp", None, lambda t, m: model.generate(ids, max_new_tokens=t, do_sample=False,
                                                                          use_mtp=True))]
    for k in args.ks:
        methods.append((f"mtp_cupy k={k}", k, lambda t, m, k=k: model.generate(
            ids, max_new_tokens=t, do_sample=False, custom_generate=mtp_generate, drafter=drafter, num_drafts=k,
            spec_metrics=m)))
    for _, _, call in methods:
        call(min(n, 16), SpecDecodeMetrics())              # warm-up (kernels, graphs, caches)
    runs = {name: [] for name, _, _ in methods}
    for _ in range(args.repeats):                         # round robin: a busy machine slows every method alike
        for name, _, call in methods:
            counter.n = 0
            m = SpecDecodeMetrics()
            out, s = timed(lambda: call(n, m), torch, cuda)
            runs[name].append((s, counter.n, m, out))
    results, outputs = [], {}
    for name, k, _ in methods:
        s, passes, m, out = sorted(runs[name], key=lambda r: r[0])[len(runs[name]) // 2]
        new = int(out.shape[1] - ids.shape[1])
        outputs[name] = out[0].tolist()
        row = {"method": name, "k": k, "new_tokens": new, "seconds_median": s,
               "tokens_per_s": new / s, "tokens_per_s_best": new / min(r[0] for r in runs[name]),
               "target_forwards": passes}
        if k is not None:
            row.update(mean_acceptance_length=m.mean_acceptance_length,
                       acceptance_rate_per_pos=m.acceptance_rate_per_pos(), num_drafts=m.num_drafts,
                       num_accepted_tokens=m.num_accepted_tokens)
        elif name == "transformers use_mtp":
            verifies = max(passes - 1, 1)
            row.update(mean_acceptance_length=(new - 1) / verifies, acceptance_rate_per_pos=[(new - passes) / verifies])
        results.append(row)
    counter.close()
    ref = outputs["target only"]
    for row in results:
        row["identical_to_target"] = outputs[row["method"]] == ref
    return {"checkpoint": str(ckpt), "device": torch.cuda.get_device_name(0) if cuda else f"cpu ({torch.get_num_threads()} threads)",
            "target_dtype": str(dtype).replace("torch.", ""), "drafter_device": drafter.gpu.name,
            "transformers": transformers.__version__, "torch": torch.__version__, "prompt": args.prompt,
            "max_new_tokens": n, "results": results, "outputs": outputs,
            "text": bytes(t for t in ref if t < 256).decode("utf-8", "replace")}


def main(argv=None) -> dict:
    args = parse(argv)
    out = run(args)
    print(f"{out['device']}, target {out['target_dtype']}, drafter on {out['drafter_device']}, transformers "
          f"{out['transformers']}, torch {out['torch']}; {out['max_new_tokens']} greedy tokens from {out['prompt']!r}")
    print(f"{'method':<22} {'tokens/s':>9} {'best':>7} {'fwd':>5} {'accept len':>10} {'accept/pos':>22} {'identical':>9}")
    for r in out["results"]:
        acc = r.get("acceptance_rate_per_pos")
        print(f"{r['method']:<22} {r['tokens_per_s']:9.1f} {r['tokens_per_s_best']:7.1f} {r['target_forwards']:5d} "
              f"{r.get('mean_acceptance_length', 1.0):10.2f} {' '.join(f'{a:.2f}' for a in acc) if acc else '-':>22} "
              f"{str(r['identical_to_target']):>9}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    from mtp_cupy.bench.cli import run_main
    run_main(lambda: main() and 0)
