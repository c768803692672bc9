"""Train a tiny DeepSeek-V3-layout model (MLA + MoE, byte-level vocabulary) jointly with its MTP module, on
the Python standard library's own source, and write it as an HF-layout checkpoint with the real key names
(MTP layer at `model.layers.{num_hidden_layers}.*`). Runs on a GPU machine with torch + transformers:

    python scripts/train_tiny.py --out mtp_cupy/data/tiny_v3 --steps 3000

Loss (DeepSeek-V3 report): CE(next token) + lambda * CE(MTP: token after next), where the MTP row at i pairs
the main model's final-normed hidden at i with embed(token i+1): x = eh_proj([enorm(e), hnorm(h)])."""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np

from mtp_cupy.bench.cli import Parser, positive_int, run_main
from mtp_cupy.bench.corpus import stdlib_files

CONFIG = dict(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], vocab_size=256,
              hidden_size=256, intermediate_size=768, moe_intermediate_size=128, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
              num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
              scoring_func="sigmoid", topk_method="noaux_tc", first_k_dense_replace=1, q_lora_rank=128,
              kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32, rms_norm_eps=1e-6,
              rope_theta=10000.0, rope_scaling=None, rope_interleave=True, max_position_embeddings=4096,
              num_nextn_predict_layers=1, tie_word_embeddings=False, hidden_act="silu", attention_bias=False,
              bos_token_id=None, eos_token_id=None, torch_dtype="bfloat16",
              tokenizer="bytes: token id = byte value (0..255)")


def corpus(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """stdlib .py bytes; ~5% of files (by name hash) held out."""
    join = lambda files: np.frombuffer(b"\n".join(f.read_bytes() for f in files), np.uint8)  # noqa: E731
    return join(stdlib_files(False, seed)), join(stdlib_files(True, seed))


def make_mtp(model, cfg):
    """The MTP module (enorm, hnorm, eh_proj, the extra decoder layer, shared_head.norm) around `model`."""
    import torch

    class Mtp(torch.nn.Module):
        def __init__(self, model, cfg):
            super().__init__()
            from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm
            d = cfg.hidden_size
            # built as an extra layer (MoE), unused by the main forward
            self.layer = model.model.layers[cfg.num_hidden_layers]
            self.enorm, self.hnorm = DeepseekV3RMSNorm(d, cfg.rms_norm_eps), DeepseekV3RMSNorm(d, cfg.rms_norm_eps)
            self.head_norm = DeepseekV3RMSNorm(d, cfg.rms_norm_eps)
            self.eh_proj = torch.nn.Linear(2 * d, d, bias=False)
            torch.nn.init.normal_(self.eh_proj.weight, std=cfg.initializer_range)

        def forward(self, model, h, next_ids, pos):
            e = model.model.embed_tokens(next_ids)
            x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(h)], -1))
            pe = model.model.rotary_emb(x, pos)
            mask = torch.full((x.shape[1], x.shape[1]), float("-inf"), device=x.device).triu(1)[None, None]
            g = self.layer(x, position_embeddings=pe, attention_mask=mask.to(x.dtype), position_ids=pos)
            return model.lm_head(self.head_norm(g))

    return Mtp(model, cfg)


def build(device):
    from transformers import AutoConfig, AutoModelForCausalLM
    keys = {k: v for k, v in CONFIG.items() if k not in ("model_type", "architectures", "tokenizer", "torch_dtype", "scoring_func",
                                                          "topk_method", "rope_theta", "rope_scaling")}
    keys["num_hidden_layers"] = CONFIG["num_hidden_layers"] + 1
    cfg = AutoConfig.for_model("deepseek_v3", rope_parameters={"rope_theta": CONFIG["rope_theta"], "rope_type": "default"},
                               attn_implementation="eager", **keys)
    model = AutoModelForCausalLM.from_config(cfg).to(device)
    model.config.num_hidden_layers = CONFIG["num_hidden_layers"]  # the main forward runs the first N layers
    return model, make_mtp(model, model.config).to(device)


def batches(data: np.ndarray, bs: int, T: int, rng):
    import torch
    while True:
        idx = rng.integers(0, data.size - T - 2, bs)
        yield torch.from_numpy(np.stack([data[i:i + T + 2] for i in idx]).astype(np.int64))


def losses(model, mtp, x):
    import torch
    import torch.nn.functional as F
    ids, T = x[:, :-2], x.shape[1] - 2
    pos = torch.arange(T, device=x.device)[None]
    out = model(input_ids=ids, position_ids=pos, output_hidden_states=True)
    h = out.hidden_states[-1]                              # final-normed, what the drafter is handed
    main = F.cross_entropy(out.logits.float().reshape(-1, 256), x[:, 1:-1].reshape(-1))
    ml = mtp(model, h, x[:, 1:-1], pos)
    mtpl = F.cross_entropy(ml.float().reshape(-1, 256), x[:, 2:].reshape(-1))
    return main, mtpl, out.logits, ml


def evaluate(model, mtp, held, T, device, n=64):
    import torch
    with torch.no_grad():
        rng = np.random.default_rng(123)
        x = next(batches(held, n, T, rng)).to(device)
        with torch.autocast("cuda", torch.bfloat16, enabled=device == "cuda"):
            main, mtpl, lg, ml = losses(model, mtp, x)
        acc = (lg.argmax(-1) == x[:, 1:-1]).float().mean().item()
        macc = (ml.argmax(-1) == x[:, 2:]).float().mean().item()
        # the drafter's proposal is accepted when it equals the target's own greedy next-next prediction
        agree = (ml[:, :-1].argmax(-1) == lg[:, 1:].argmax(-1)).float().mean().item()
        return dict(loss=main.item(), mtp_loss=mtpl.item(), acc=acc, mtp_acc=macc, mtp_agree=agree)


def export(model, mtp, out: Path):
    import torch
    from safetensors.torch import save_file
    n = CONFIG["num_hidden_layers"]
    sd = {}
    for k, v in model.state_dict().items():
        if k.startswith(f"model.layers.{n}.") or "rotary" in k:
            continue
        sd[k] = v
    for k, v in mtp.layer.state_dict().items():
        sd[f"model.layers.{n}.{k}"] = v
    for name, mod in (("enorm", mtp.enorm), ("hnorm", mtp.hnorm), ("shared_head.norm", mtp.head_norm),
                      ("eh_proj", mtp.eh_proj)):
        sd[f"model.layers.{n}.{name}.weight"] = mod.weight
    flat = {}
    for k, v in sd.items():   # fused experts -> the per-expert checkpoint keys real V3 checkpoints use
        if k.endswith("mlp.experts.gate_up_proj"):
            inter = v.shape[1] // 2
            for e in range(v.shape[0]):
                flat[k.replace("gate_up_proj", f"{e}.gate_proj.weight")] = v[e, :inter]
                flat[k.replace("gate_up_proj", f"{e}.up_proj.weight")] = v[e, inter:]
        elif k.endswith("mlp.experts.down_proj"):
            for e in range(v.shape[0]):
                flat[k.replace("down_proj", f"{e}.down_proj.weight")] = v[e]
        else:
            flat[k] = v
    tensors = {k: (v.float() if k.endswith("e_score_correction_bias") else v.to(torch.bfloat16)).contiguous().cpu()
               for k, v in flat.items()}
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
    return sum(t.numel() for t in tensors.values())


def main():
    ap = Parser(__doc__)
    ap.add_argument("--out", default="mtp_cupy/data/tiny_v3",
                    help="checkpoint directory written (config.json, model.safetensors, training.json)")
    ap.add_argument("--steps", type=positive_int, default=3000, help="optimizer steps")
    ap.add_argument("--batch", type=positive_int, default=64, help="sequences per step")
    ap.add_argument("--seq", type=positive_int, default=256, help="tokens (bytes) per sequence")
    ap.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW; 100 warm-up steps, cosine)")
    ap.add_argument("--mtp-weight", type=float, default=0.3, help="lambda: weight of the MTP loss")
    ap.add_argument("--seed", type=int, default=0, help="seed of the weights and the batches")
    ap.add_argument("--time-limit", type=float, default=0,
                    help="stop (and export) after this many seconds (default 0: no limit)")
    args = ap.parse_args()
    import torch
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(args.seed)
    train, held = corpus()
    print(f"corpus: {train.size / 1e6:.1f} MB train, {held.size / 1e6:.2f} MB held out; device {device}")
    model, mtp = build(device)
    params = list(model.parameters()) + [p for n, p in mtp.named_parameters() if not n.startswith("layer.")]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warm = 100
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
    rng, log, t0 = np.random.default_rng(args.seed), [], time.time()
    it = batches(train, args.batch, args.seq, rng)
    for step in range(args.steps + 1):
        x = next(it).to(device)
        with torch.autocast("cuda", torch.bfloat16, enabled=device == "cuda"):
            main_l, mtp_l, _, _ = losses(model, mtp, x)
        loss = main_l + args.mtp_weight * mtp_l
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        out_of_time = args.time_limit and time.time() - t0 > args.time_limit
        if step % 100 == 0 or step == args.steps or out_of_time:
            ev = evaluate(model, mtp, held, args.seq, device)
            rec = dict(step=step, train_loss=main_l.item(), train_mtp_loss=mtp_l.item(), time=time.time() - t0, **ev)
            log.append(rec)
            print(json.dumps(rec), flush=True)
        if out_of_time:
            print(f"time limit reached at step {step}")
            break
    out = Path(args.out)
    n = export(model, mtp, out)
    (out / "training.json").write_text(json.dumps(dict(args=vars(args), params=n, device=torch.cuda.get_device_name()
                                                       if device == "cuda" else "cpu", log=log), indent=1) + "\n")
    print(f"wrote {out} ({n / 1e6:.2f} M params, {sum(f.stat().st_size for f in out.iterdir()) / 1e6:.1f} MB) "
          f"in {time.time() - t0:.0f} s")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        s = [r["step"] for r in log]
        fig, ax = plt.subplots(1, 2, figsize=(10, 4))
        ax[0].plot(s, [r["train_loss"] for r in log], label="train next-token")
        ax[0].plot(s, [r["loss"] for r in log], label="held-out next-token")
        ax[0].plot(s, [r["mtp_loss"] for r in log], label="held-out MTP (token after next)")
        ax[0].set_xlabel("step"); ax[0].set_ylabel("cross-entropy (nats)"); ax[0].legend()
        ax[1].plot(s, [r["acc"] for r in log], label="next-token top-1")
        ax[1].plot(s, [r["mtp_acc"] for r in log], label="MTP top-1")
        ax[1].plot(s, [r["mtp_agree"] for r in log], label="MTP == target greedy")
        ax[1].set_xlabel("step"); ax[1].set_ylabel("held-out accuracy"); ax[1].legend()
        fig.tight_layout(); fig.savefig(out / "training.png", dpi=80)
    except Exception as e:  # the plot is a convenience; the numbers are in training.json
        print(f"no plot: {e}")


if __name__ == "__main__":
    run_main(main)
