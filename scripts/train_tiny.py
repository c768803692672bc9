"""Train a family's tiny model jointly with its MTP module on the Python standard library's own source (byte
vocabulary) and write it in the family's checkpoint layout, with training.json and training.png (the curves).
transformers' own model class is the target; the MTP module is composed around a decoder layer of that class
(mtp_cupy/training/). Runs on a GPU machine with torch + transformers (a CPU does a smoke run):

    python scripts/train_tiny.py --family deepseek_v4 --steps 4000 --time-limit 300

Loss (DeepSeek-V3 report): CE(next token) + lambda * mean over depths d < --chain of CE(MTP row at depth d:
token i + 2 + d). Depth 0 pairs the target's hidden at i with token i + 1; depth d > 0 pairs the head's own
carried hidden of depth d - 1 with token i + 1 + d, attending as a chained draft does (training/common.py), so
the head is trained for the k > 1 drafts it is reused for. Deterministic given --seed on one device when the
schedule is --steps alone (a --time-limit ends it where the time runs out, which depends on the machine)."""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

import mtp_cupy
from mtp_cupy.bench.cli import Parser, positive_int, run_main
from mtp_cupy.bench.corpus import held_out_prompts
from mtp_cupy.training import FAMILIES, family_module
from mtp_cupy.training.common import batches, corpus, evaluate, greedy_acceptance, hidden_hook, lr_factor, losses


def plot(log: list[dict], depth: int, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    s = [r["step"] for r in log]
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    ax[0].plot(s, [r["train_loss"] for r in log], label="train next-token")
    ax[0].plot(s, [r["loss"] for r in log], label="held-out next-token")
    ax[1].plot(s, [r["acc"] for r in log], label="next-token top-1")
    for d in range(depth):
        ax[0].plot(s, [r[f"mtp_loss_{d}"] for r in log], label=f"held-out MTP depth {d}")
        ax[1].plot(s, [r[f"mtp_agree_{d}"] for r in log], label=f"MTP depth {d} == target greedy")
    ax[0].set_xlabel("step"); ax[0].set_ylabel("cross-entropy (nats)"); ax[0].legend()
    ax[1].set_xlabel("step"); ax[1].set_ylabel("held-out accuracy"); ax[1].legend()
    fig.tight_layout(); fig.savefig(path, dpi=80)
    plt.close(fig)


def main(argv=None):
    ap = Parser(__doc__)
    ap.add_argument("--family", choices=FAMILIES, default="deepseek_v3", help="model family")
    ap.add_argument("--out", help="checkpoint directory written (default: the family's embedded model, "
                    "mtp_cupy.EMBEDDED[family])")
    ap.add_argument("--steps", type=positive_int, default=3000, help="optimizer steps (the cosine schedule's length)")
    ap.add_argument("--batch", type=positive_int, default=64, help="sequences per step")
    ap.add_argument("--seq", type=positive_int, default=256, help="target tokens (bytes) per sequence")
    ap.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW; 100 warm-up steps, then "
                    "cosine to zero at the end of the schedule)")
    ap.add_argument("--mtp-weight", type=float, default=0.3, help="lambda: weight of the MTP loss")
    ap.add_argument("--chain", type=positive_int, default=3,
                    help="MTP depths trained: 1 = the next-next token only; d > 1 adds d - 1 chained rows (3 won "
                         "for every family: BENCHMARKS.md)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the weights and the batches")
    ap.add_argument("--time-limit", type=float, default=0,
                    help="train for this many seconds at most: the schedule runs over min(--steps, what fits) and "
                         "decays to zero at the limit (default 0: --steps alone)")
    ap.add_argument("--eval-every", type=positive_int, default=100, help="steps between held-out evaluations")
    args = ap.parse_args(argv)
    import torch
    fam = family_module(args.family)
    out = Path(args.out or mtp_cupy.EMBEDDED[args.family])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(args.seed)
    train, held = corpus()
    print(f"{args.family}: corpus {train.size / 1e6:.1f} MB train, {held.size / 1e6:.2f} MB held out; device "
          f"{device}; chain {args.chain}", flush=True)
    target, head = fam.build(device)
    box, hook = hidden_hook(target)
    params = [p for p in list(target.parameters()) + list(head.parameters()) if p.requires_grad]
    params = list({id(p): p for p in params}.values())
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    rng, log, t0 = np.random.default_rng(args.seed), [], time.time()
    it = batches(train, args.batch, args.seq + args.chain + 1, rng)
    for step in range(args.steps + 1):
        done = step / args.steps if not args.time_limit else max(step / args.steps, (time.time() - t0) / args.time_limit)
        for g in opt.param_groups:
            g["lr"] = args.lr * lr_factor(step, min(done, 1.0))
        x = next(it).to(device)
        with torch.autocast("cuda", torch.bfloat16, enabled=device == "cuda"):
            main_l, mtp_l, _, _ = losses(target, head, box, x, args.chain)
        loss = main_l + args.mtp_weight * sum(mtp_l) / len(mtp_l)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        last = done >= 1.0 or step == args.steps
        if step % args.eval_every == 0 or last:
            ev = evaluate(target, head, box, held, args.seq, args.chain, device)
            rec = dict(step=step, train_loss=main_l.item(), time=round(time.time() - t0, 1), lr=opt.param_groups[0]["lr"],
                       **ev)
            log.append(rec)
            print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in rec.items()}), flush=True)
        if last:
            if step < args.steps:
                print(f"time limit reached at step {step}: the schedule ended there (rerun with --steps {step} and "
                      "no --time-limit to repeat it)")
            break
    target.eval()
    rates = greedy_acceptance(target, head, box, held_out_prompts(12, 64), 48, 3, device)
    print(f"greedy acceptance per position (held-out, k = 3, every position): {', '.join(f'{r:.3f}' for r in rates)}; "
          f"mean acceptance length {1 + sum(rates):.2f}")
    hook.remove()
    n = fam.export(target, head, out)
    (out / "training.json").write_text(json.dumps(dict(family=args.family, args={**vars(args), "out": str(out)},
                                                       params=n, torch=torch.__version__,
                                                       greedy_acceptance_k3=rates, steps_run=step,
                                                       device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
                                                       log=log), indent=1) + "\n")
    print(f"wrote {out} ({n / 1e6:.2f} M params, {sum(f.stat().st_size for f in out.iterdir()) / 1e6:.1f} MB) "
          f"in {time.time() - t0:.0f} s")
    try:
        plot(log, args.chain, out / "training.png")
    except ImportError as e:  # the plot is a convenience; the numbers are in training.json
        print(f"no plot: {e}")
    return 0


if __name__ == "__main__":
    run_main(main)
