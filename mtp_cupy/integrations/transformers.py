"""Speculative decoding in transformers' `generate` with an mtp_cupy drafter.

    import mtp_cupy
    from mtp_cupy.integrations.transformers import generate as mtp_generate
    model = AutoModelForCausalLM.from_pretrained(ckpt)             # the target, with the MTP layer in ckpt
    drafter = mtp_cupy.load_proposer(ckpt, gpu="auto", max_seq_len=4096)
    out = model.generate(input_ids, max_new_tokens=64, custom_generate=mtp_generate, drafter=drafter, num_drafts=3)

transformers (>= 5.14) prepares everything (generation config, logits processors and warpers, stopping
criteria, the cache) and calls `generate(model, input_ids, logits_processor=..., stopping_criteria=...,
generation_config=..., **model_kwargs)`; `drafter`, `num_drafts` and `spec_metrics` are this function's own
arguments, which transformers passes through. Batch size 1 (as transformers' own `use_mtp`). transformers hands
a custom_generate callable no `streamer` (it streams the prompt itself); a direct call may pass one.

One cycle, the target at position p with token t next:
    drafts = drafter.propose(t, hidden(p), p, k)        the target's hidden handed over through DLPack (a bf16
                                                        CUDA tensor on the drafter's GPU is read in place)
    one target forward over [t] + drafts                logits and hiddens of k + 1 rows
    accept                                              greedy: the longest prefix equal to the target's argmax
                                                        (after the logits processors); sampling: rejection
                                                        sampling, lossless (the drafts are the drafter's argmax,
                                                        so the draft distribution is one-hot and draft d is
                                                        kept with probability p(d), else the token is drawn from
                                                        p with d removed; all kept: a bonus token from p_k)
    target cache rolled back to the kept tokens, drafter.after_verify, the drafter's catch-up row
Greedy output is token for token what `model.generate` gives without drafting (up to the target's own
arithmetic differing between a 1-row and a (k+1)-row forward at a near tie).

The hidden the drafter pairs with the next token is the target's final-normed hidden (the output of
`model.model.norm`; DeepSeek-V3, GLM-5, Qwen3-Next) or, for DeepSeek-V4, the residual streams [hc, D] entering
`model.model.hc_head`; forward hooks capture them.

Rolling the target cache back: layers that keep every token's keys in order (transformers' DynamicLayer and
DynamicIndexedLayer) are cropped; layers that cannot be cropped (linear-attention recurrent states of
Qwen3-Next, DeepSeek-V4's sliding windows and compressor states) are copied before each verify, restored
after a rejection, and the kept tokens re-run through the target (one more forward on rejection)."""
from __future__ import annotations

import copy
import inspect

from ..speculative.metrics import SpecDecodeMetrics

CROPPABLE_LAYERS = ("DynamicLayer", "DynamicIndexedLayer")
_DRAFTERS: dict = {}


def hidden_site(model):
    """(module, "output" | "input"): where the hidden the MTP layer pairs with the next token appears."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    if getattr(model.config, "model_type", "") == "deepseek_v4":
        return base.hc_head, "input"          # the streams [B, S, hc, D] before the mHC head
    return base.norm, "output"                 # the final-normed hidden [B, S, D]


def repoint_mtp_keys(model_class, num_hidden_layers: int) -> None:
    """Point transformers' MTP key pattern (`_keys_to_ignore_on_load_unexpected`, which `MtpModel.from_pretrained`
    reads to find the MTP layer and which DeepSeek-V3 hard-codes to layer 61) at layer `num_hidden_layers`,
    before `from_pretrained`: transformers' own `generate(use_mtp=True)` then finds a smaller checkpoint's MTP
    layer."""
    model_class._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{int(num_hidden_layers)}.*"]


def load_drafter(path, gpu=None, max_seq_len: int = 4096, **options):
    """`mtp_cupy.load_proposer(path, ...)`, loaded once per (path, device, options) in this process."""
    from .. import load_proposer
    key = (str(path), str(gpu), max_seq_len, tuple(sorted(options.items())))
    if key not in _DRAFTERS:
        _DRAFTERS[key] = load_proposer(path, gpu=gpu, max_seq_len=max_seq_len, **options)
    return _DRAFTERS[key]


class HfTarget:
    """An HF causal LM as a target runner over one sequence: `forward(tokens)` appends the tokens at the next
    positions and returns (f32 logits [n, V], hiddens [n, ...]) on the model's device; `rollback` keeps the first
    tokens of the last forward."""

    def __init__(self, model, cache=None):
        import torch
        self.torch, self.model = torch, model
        params = inspect.signature(model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.cache_position = "cache_position" in params
        if cache is None:
            from transformers import DynamicCache
            cache = DynamicCache(config=model.config)
        self.cache, self.length, self.device = cache, 0, model.device
        self.max_rows = 1 if self.row_by_row(model) else 1 << 30
        site, where = hidden_site(model)
        self._h = None
        if where == "input":
            self._hook = site.register_forward_pre_hook(lambda m, args: self._keep(args[0]))
        else:
            self._hook = site.register_forward_hook(lambda m, args, out: self._keep(out))

    @staticmethod
    def row_by_row(model) -> bool:
        """Whether a verify must run one row per forward to compute what 1-row decoding computes. A multi-row
        forward after earlier ones was measured (transformers 5.24, CPU float32) to differ from 1-row decoding by
        up to 5e-2 .. 8e-2 in the logits where the attention picks keys: DeepSeek-V4's compressed layers (its
        compressor cache; at some positions only), and GLM-5 / V3.2's DSA top-k (the indexer's scores round
        otherwise in a multi-row forward and a near tie picks other keys). Greedy output would then differ from
        target-only's; row by row it cannot. Other targets verify in one forward."""
        c = model.config
        mt = getattr(c, "model_type", "")
        if mt in ("glm_moe_dsa", "deepseek_v32"):
            return True
        return mt == "deepseek_v4" and (any(getattr(c, "compress_ratios", None) or [])
                                        or any("compress" in t for t in getattr(c, "layer_types", None) or []))

    def _keep(self, x) -> None:
        self._h = x[0] if isinstance(x, tuple) else x

    def close(self) -> None:
        self._hook.remove()

    def forward(self, tokens: list[int]):
        if len(tokens) > self.max_rows:      # row by row, as one forward would compute them
            parts = [self.forward(tokens[i:i + self.max_rows]) for i in range(0, len(tokens), self.max_rows)]
            return self.torch.cat([p[0] for p in parts]), self.torch.cat([p[1] for p in parts])
        torch, n = self.torch, len(tokens)
        pos = torch.arange(self.length, self.length + n, device=self.device)
        kw = {self.cache_kw: self.cache}
        if self.cache_position:
            kw["cache_position"] = pos
        out = self.model(input_ids=torch.tensor([tokens], device=self.device), position_ids=pos[None],
                         use_cache=True, return_dict=True, **kw)
        new = out.get("cache") if "cache" in out else out.get("past_key_values")
        if new is not None:
            self.cache = new
        self.length += n
        return out.logits[0].float(), self._h[0]

    def snapshot(self):
        """Before a verify: copies of the layers a crop cannot roll back ({} when crops suffice)."""
        layers = getattr(self.cache, "layers", None)
        if layers is None:
            return {}
        return {i: copy.deepcopy(layer) for i, layer in enumerate(layers)
                if type(layer).__name__ not in CROPPABLE_LAYERS}

    def rollback(self, snap: dict, n_new: int, keep: list[int]) -> None:
        """After a forward of n_new tokens, keep only its first len(keep) (= `keep`, the tokens themselves)."""
        drop = n_new - len(keep)
        if drop <= 0:
            return
        layers = getattr(self.cache, "layers", None)
        if layers is None:
            self.cache.crop(-drop)
            self.length -= drop
            return
        if not snap:
            for layer in layers:
                layer.crop(-drop)
            self.length -= drop
            return
        for i, layer in enumerate(layers):   # back to before the verify, then re-run what was kept
            if i in snap:
                layers[i] = snap[i]
            else:
                layer.crop(-n_new)
        self.length -= n_new
        if keep:
            self.forward(keep)


def _stop(stopping_criteria, ids) -> bool:
    return bool(stopping_criteria(ids, None).any()) if stopping_criteria else False


def _rejection(probs, drafts: list[int], torch) -> tuple[int, int]:
    """(accepted, next token) for one-hot drafts: draft d_i is kept with probability p_i(d_i), else the token is
    drawn from p_i with d_i removed (renormalised); all kept: drawn from p_k. `probs(i)` gives p_i."""
    for i, d in enumerate(drafts):
        p = probs(i)
        if torch.rand((), device=p.device) < p[d]:
            continue
        resid = p.clone()
        resid[d] = 0
        s = resid.sum()
        return i, int(torch.multinomial(resid / s if s > 0 else p, 1))
    return len(drafts), int(torch.multinomial(probs(len(drafts)), 1))


def generate(model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None,
             synced_gpus: bool = False, streamer=None, drafter=None, num_drafts: int = 3,
             spec_metrics: SpecDecodeMetrics | None = None, **model_kwargs):
    """transformers `custom_generate`: speculative decoding with `drafter` (an mtp_cupy proposer, or a
    checkpoint path for `load_drafter`) proposing `num_drafts` tokens per target forward. `spec_metrics` (a
    SpecDecodeMetrics) collects drafts and acceptances. Returns the sequences [1, prompt + new] (or
    transformers' GenerateDecoderOnlyOutput with them when return_dict_in_generate)."""
    import torch
    from transformers import LogitsProcessorList, StoppingCriteriaList
    if drafter is None:
        raise ValueError("pass drafter=: an mtp_cupy proposer (mtp_cupy.load_proposer(checkpoint)) or its path")
    if not hasattr(drafter, "propose"):
        drafter = load_drafter(drafter, max_seq_len=int(getattr(model.config, "max_position_embeddings", 4096)))
    if input_ids.shape[0] != 1:
        raise ValueError(f"mtp_cupy's transformers generate runs batch size 1, got {input_ids.shape[0]}")
    mask = model_kwargs.get("attention_mask")
    if mask is not None and not bool((mask == 1).all()):
        raise ValueError("padded inputs are not supported (batch size 1 needs no padding)")
    cfg = generation_config if generation_config is not None else model.generation_config
    lp = logits_processor if logits_processor is not None else LogitsProcessorList()
    sc = stopping_criteria if stopping_criteria is not None else StoppingCriteriaList()
    max_len = getattr(cfg, "max_length", None) or drafter.max_seq_len
    k_max = max(1, min(int(num_drafts), int(getattr(drafter, "max_drafts", num_drafts))))
    if max_len + k_max + 1 > drafter.max_seq_len:
        raise ValueError(f"max_length {max_len} + {k_max} drafts exceeds the drafter's max_seq_len "
                         f"{drafter.max_seq_len}")
    metrics = spec_metrics if spec_metrics is not None else SpecDecodeMetrics()
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    target = HfTarget(model, cache)
    on_cuda = getattr(getattr(drafter, "gpu", None), "is_cuda", False)
    stream = torch.cuda.current_stream(model.device) if on_cuda and model.device.type == "cuda" else None

    def to_drafter(h):
        return h if on_cuda or h.device.type == "cpu" else h.cpu()

    def scores(prefix, row):   # processors may write in place: theirs is a copy, as in transformers' _sample
        return lp(prefix, row[None].clone())[0] if len(lp) else row

    st = drafter.alloc_state()
    try:
        with torch.no_grad():
            ids = input_ids[0].tolist()
            lg, H = target.forward(ids)
            hid = list(H.unbind(0))                       # hid[p]: the target's hidden at position p
            if len(ids) > 1:
                drafter.prefill(st, ids, to_drafter(H[:-1]), stream=stream)
            seq = input_ids
            row = scores(seq, lg[-1])
            first = int(torch.multinomial(torch.softmax(row, -1), 1)) if cfg.do_sample else int(row.argmax())
            pos, new = len(ids) - 1, [first]
            while True:
                done = False
                for t in new:
                    seq = torch.cat([seq, seq.new_tensor([[t]])], 1)
                    ids.append(t)
                    if streamer is not None:
                        streamer.put(seq.new_tensor([t]).cpu())
                    if _stop(sc, seq) or seq.shape[1] >= max_len:
                        done = True
                        break
                if done:
                    break
                nxt = st.next_position
                if nxt < pos:   # rows the trim rule dropped: rebuilt from the target's own hiddens
                    drafter.prefill(st, ids[nxt:pos + 1], to_drafter(torch.stack(hid[nxt:pos])), start_position=nxt,
                                    stream=stream)
                k = max(1, min(k_max, max_len - seq.shape[1] - 1))
                drafts = drafter.propose(st, ids[pos + 1], to_drafter(hid[pos]), pos, k, stream=stream).tokens
                snap = target.snapshot()
                lg, Hv = target.forward([ids[pos + 1]] + drafts)
                cand = torch.cat([seq, seq.new_tensor([drafts])], 1)
                L = seq.shape[1]
                if cfg.do_sample:
                    a, t_next = _rejection(lambda i: torch.softmax(scores(cand[:, :L + i], lg[i]), -1), drafts, torch)
                else:
                    a = 0
                    while True:
                        g = int(scores(cand[:, :L + a], lg[a]).argmax())
                        if a == len(drafts) or drafts[a] != g:
                            t_next = g
                            break
                        a += 1
                target.rollback(snap, k + 1, [ids[pos + 1]] + drafts[:a])
                drafter.after_verify(st, a)
                metrics.record(k, a)
                hid.extend(Hv[:a + 1].unbind(0))
                new = drafts[:a] + [t_next]
                pos += 1 + a
    finally:
        drafter.free_state(st)
        target.close()
    if streamer is not None:
        streamer.end()
    if getattr(cfg, "return_dict_in_generate", False):
        from transformers.generation.utils import GenerateDecoderOnlyOutput
        fields = GenerateDecoderOnlyOutput.__dataclass_fields__
        extra = {name: target.cache for name in ("cache", "past_key_values") if name in fields}
        return GenerateDecoderOnlyOutput(sequences=seq, **extra)
    return seq
