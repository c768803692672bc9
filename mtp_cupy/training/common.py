"""What every family's training shares: the corpus, batches, the chained MTP rows and their mask, the losses,
the held-out evaluation and the two-shard export.

A family module (deepseek_v3.py, ...) gives `CONFIG` (the config.json of the model it trains), `build(device)`
-> (target, head) and `export(target, head, out)`. The target is transformers' own model class; the head is
an `MtpHeadMixin` module: the family's MTP module composed around layer 0 of a one-layer model of the same class (the
layer type of the MTP layer), with the target's embedding and LM head.

Chained rows (what the drafter computes at draft depth d > 0): row (d, i) sits at position i + d, pairs token
i + 1 + d with the head's own carried hidden of row (d - 1, i) (row (0, i): the target's hidden at i) and is
trained to predict token i + 2 + d. It attends to the depth-0 rows at positions <= i (the rows the target's
hiddens wrote into the drafter's cache) and to the rows of its own chain (d' <= d, same i), as a chained
propose does."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from ..bench.corpus import stdlib_files

TOKENIZER = "bytes: token id = byte value (0..255)"
VOCAB = 256


def corpus(fold: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(train, held-out) stdlib .py bytes (about 5% of files, by name hash, held out)."""
    join = lambda files: np.frombuffer(b"\n".join(f.read_bytes() for f in files), np.uint8)  # noqa: E731
    return join(stdlib_files(False, fold)), join(stdlib_files(True, fold))


def batches(data: np.ndarray, bs: int, length: int, rng):
    """Endless [bs, length] int64 windows cut at random from `data`."""
    import torch
    while True:
        idx = rng.integers(0, data.size - length, bs)
        yield torch.from_numpy(np.stack([data[i:i + length] for i in idx]).astype(np.int64))


def chain_layout(T: int, depth: int, window: int | None, device):
    """(positions [depth * T], additive mask [1, 1, N, N] of 0 / -inf) of the rows of depths 0..depth-1, row
    r = d * T + i; `window`: a sliding window over positions (the query's row included)."""
    import torch
    d = torch.arange(depth, device=device).repeat_interleave(T)
    i = torch.arange(T, device=device).repeat(depth)
    pos = i + d
    dq, dk, iq, ik = d[:, None], d[None, :], i[:, None], i[None, :]
    vis = ((dk == 0) & (ik <= iq)) | ((dk > 0) & (ik == iq) & (dk <= dq))
    if window:
        vis &= (pos[:, None] - pos[None, :]) < window
    mask = torch.zeros(vis.shape, device=device).masked_fill(~vis, float("-inf"))
    return pos, mask[None, None]


class MtpHeadMixin:
    """The three parts of an MTP head (subclasses of torch.nn.Module mix this in):
    front(target, ids [B, n], hidden) -> x,  block(x, pos [n], mask) -> y,  out(target, y) -> (logits, carried).
    `window`: the MTP layer's sliding window (None: full causal)."""
    window: int | None = None

    def chain(self, target, ids, hidden, depth: int):
        """Logits [B, T, V] of each depth 0..depth-1 (see the module docstring). ids: [B, T + depth + 1]
        tokens; hidden: the target's hiddens at positions 0..T-1."""
        import torch
        T = hidden.shape[1]
        pos, mask = chain_layout(T, depth, self.window, ids.device)
        xs, out, carried = [], [], None
        for d in range(depth):
            xs.append(self.front(target, ids[:, 1 + d:1 + d + T], hidden if d == 0 else carried))
            n = (d + 1) * T
            y = self.block(torch.cat(xs, 1), pos[:n], mask[..., :n, :n])   # float32: the attention adds it in float32
            logits, carried = self.out(target, y[:, d * T:])
            out.append(logits)
        return out


def hidden_hook(target):
    """Capture the hidden the drafter is handed (integrations.transformers.hidden_site) on every forward:
    returns (holder dict with key "h", the hook handle)."""
    from ..integrations.transformers import hidden_site
    site, where = hidden_site(target)
    box: dict = {}

    def keep(x):
        box["h"] = x[0] if isinstance(x, tuple) else x

    if where == "input":
        return box, site.register_forward_pre_hook(lambda m, args: keep(args[0]))
    return box, site.register_forward_hook(lambda m, args, out: keep(out))


def losses(target, head, box, x, depth: int):
    """(next-token CE, [MTP CE per depth], target logits, [MTP logits per depth]) of a batch x [B, T + depth + 1]
    (T target rows: the target reads x[:, :T])."""
    import torch
    import torch.nn.functional as F
    T = x.shape[1] - depth - 1
    V = target.config.vocab_size
    out = target(input_ids=x[:, :T], position_ids=torch.arange(T, device=x.device)[None])
    main = F.cross_entropy(out.logits.float().reshape(-1, V), x[:, 1:T + 1].reshape(-1))
    mls = head.chain(target, x, box["h"], depth)
    mtp = [F.cross_entropy(ml.float().reshape(-1, V), x[:, 2 + d:2 + d + T].reshape(-1)) for d, ml in enumerate(mls)]
    return main, mtp, out.logits, mls


def evaluate(target, head, box, held, T: int, depth: int, device, n: int = 64) -> dict:
    """Held-out losses, next-token accuracy, and per depth how often the MTP argmax equals the target's own
    greedy prediction of the same token (the acceptance a teacher-forced chain would get)."""
    import torch
    with torch.no_grad():
        x = next(batches(held, n, T + depth + 1, np.random.default_rng(123))).to(device)
        with torch.autocast("cuda", torch.bfloat16, enabled=device == "cuda"):
            main, mtp, lg, mls = losses(target, head, box, x, depth)
        greedy = lg.argmax(-1)                       # greedy[:, j]: the target's pick for token j + 1
        rec = dict(loss=main.item(), acc=(greedy == x[:, 1:T + 1]).float().mean().item())
        for d, ml in enumerate(mls):                 # row i of depth d predicts token i + 2 + d
            rec[f"mtp_loss_{d}"] = mtp[d].item()
            rec[f"mtp_agree_{d}"] = (ml[:, :T - 1 - d].argmax(-1) == greedy[:, 1 + d:]).float().mean().item()
        return rec


def greedy_acceptance(target, head, box, prompts: list[list[int]], new_tokens: int, depth: int, device) -> list[float]:
    """Acceptance per draft position of greedy speculative decoding with `depth` drafts, estimated at every
    position of the target's greedy continuations of `prompts` (equal lengths): draft j is accepted when it
    and every draft before it equal the target's greedy tokens, and while they do, the chained rows read
    exactly the tokens teacher forcing gives them, so one chained pass over the greedy sequences computes
    what each draft step would. (A real decode drafts only at the positions after each verify; this counts
    every position.)"""
    import torch
    with torch.no_grad(), torch.autocast("cuda", torch.bfloat16, enabled=device == "cuda"):
        x = torch.tensor(prompts, device=device)
        L = x.shape[1]
        for _ in range(new_tokens + depth + 1):
            x = torch.cat([x, target(input_ids=x).logits[:, -1].argmax(-1, keepdim=True)], 1)
        T = x.shape[1] - depth - 1
        target(input_ids=x[:, :T])
        mls = head.chain(target, x, box["h"], depth)
        ok = torch.ones_like(x[:, L - 1:T], dtype=torch.bool)
        rates = []
        for d, ml in enumerate(mls):   # row p of depth d drafts token p + 2 + d
            ok &= ml[:, L - 1:T].argmax(-1) == x[:, L + 1 + d:T + 2 + d]
            rates.append(ok.float().mean().item())
        return rates


def lr_factor(step: int, done: float, warm: int = 100) -> float:
    """Linear warm-up over `warm` steps, then cosine over the schedule's fraction `done` (0..1) to zero."""
    return min(1.0, (step + 1) / warm) * 0.5 * (1 + math.cos(math.pi * done))


def split_experts(sd: dict) -> dict:
    """transformers' fused experts (`...experts.gate_up_proj` [E, 2I, D], `...experts.down_proj` [E, D, I])
    as the per-expert keys real checkpoints use (`...experts.{e}.{gate,up,down}_proj.weight`)."""
    flat = {}
    for k, v in sd.items():
        if k.endswith("experts.gate_up_proj"):
            inter = v.shape[1] // 2
            for e in range(v.shape[0]):
                flat[k.replace("gate_up_proj", f"{e}.gate_proj.weight")] = v[e, :inter]
                flat[k.replace("gate_up_proj", f"{e}.up_proj.weight")] = v[e, inter:]
        elif k.endswith("experts.down_proj"):
            for e in range(v.shape[0]):
                flat[k.replace("down_proj", f"{e}.down_proj.weight")] = v[e]
        else:
            flat[k] = v
    return flat


def as_stored(tensors: dict, f32=()) -> dict:
    """The tensors as the checkpoint stores them: NumPy arrays, BF16 except the keys ending in one of `f32`."""
    from ..runtime.dtypes import BF16
    return {k: v.detach().float().cpu().numpy().astype(np.float32 if k.endswith(tuple(f32)) else BF16)
            for k, v in tensors.items()}


def export_two_shards(target, mtp: dict, config: dict, out: Path) -> int:
    """The target through transformers' `save_pretrained` (BF16) as shard 1 and the MTP tensors `mtp` (checkpoint
    keys, `as_stored`) as shard 2, in testing/hf_targets.py's layout. Returns the parameters written."""
    import torch
    from ..testing.hf_targets import save_with_mtp
    out.mkdir(parents=True, exist_ok=True)
    try:
        return save_with_mtp(target.to(torch.bfloat16), out, mtp, config, tokenizer=TOKENIZER)
    finally:
        target.float()
