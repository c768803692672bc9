"""Speculative decoding: a target runner verifies the drafter's proposals.

The target runner interface (mtp_cupy.target.DeepseekV3Target implements it):
    alloc() -> seq;  free(seq)
    forward(seq, tokens) -> (logits [m, V] f32, hiddens [m, D] f32): appends m rows at the next positions
    truncate(seq, rows)
Hiddens are the target's final-normed hiddens, what the drafter pairs with the next token's embedding.

Greedy verification emits exactly what target-only greedy decoding emits; temperature > 0 uses lossless
rejection sampling with the greedy drafts as a one-hot draft distribution."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from ..errors import InputError
from .metrics import SpecDecodeMetrics
from .sampling import greedy_verify, one_hot, rejection_verify, softmax


@dataclass
class GenerateResult:
    tokens: list[int]
    seconds: float
    metrics: SpecDecodeMetrics | None = None
    target_passes: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else 0.0


def _pick(logits: np.ndarray, temperature: float, rng) -> int:
    if temperature <= 0:
        return int(np.argmax(logits))
    return int(rng.choice(logits.shape[-1], p=softmax(logits, temperature)))


def _check(prompt, max_new_tokens, vocab, max_seq_len, margin):
    prompt = [int(t) for t in prompt]
    if len(prompt) < 2:
        raise InputError("the prompt needs at least two tokens")
    if any(not 0 <= t < vocab for t in prompt):
        raise InputError(f"prompt token out of range [0, {vocab})")
    if len(prompt) + max_new_tokens + margin > max_seq_len:
        raise InputError(f"prompt {len(prompt)} + {max_new_tokens} new tokens (+{margin}) exceed max_seq_len {max_seq_len}")
    return prompt


def generate_target_only(target, prompt, max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
                         progress=None) -> GenerateResult:
    prompt = _check(prompt, max_new_tokens, target.vocab_size, target.max_seq_len, 1)
    rng = np.random.default_rng(seed)
    seq = target.alloc()
    try:
        t0 = time.perf_counter()
        lg, _ = target.forward(seq, prompt)
        out = [_pick(lg[-1], temperature, rng)]
        while len(out) < max_new_tokens:
            lg, _ = target.forward(seq, [out[-1]])
            out.append(_pick(lg[-1], temperature, rng))
            if progress:
                progress.update(1)
        return GenerateResult(out, time.perf_counter() - t0, target_passes=len(out))
    finally:
        target.free(seq)


def generate(target, drafter, prompt, max_new_tokens: int, num_drafts: int = 3, temperature: float = 0.0,
             seed: int = 0, progress=None) -> GenerateResult:
    prompt = _check(prompt, max_new_tokens, target.vocab_size, min(target.max_seq_len, drafter.max_seq_len),
                    num_drafts + 1)
    rng = np.random.default_rng(seed)
    seq, st, m = target.alloc(), drafter.alloc_state(), SpecDecodeMetrics()
    try:
        t0 = time.perf_counter()
        lg, H = target.forward(seq, prompt)
        toks, hid = list(prompt), list(H)              # hid[p] = the target's hidden at position p
        toks.append(_pick(lg[-1], temperature, rng))
        drafter.prefill(st, prompt, H[:-1])
        pos, out, passes = len(prompt) - 1, [toks[-1]], 1
        while len(out) < max_new_tokens:
            nxt = st.keys[-1] + 1 if st.keys else 0
            if nxt < pos:   # rows the trim rule dropped: rebuild them from the target's own hiddens
                drafter.prefill(st, toks[nxt:pos + 1], np.stack(hid[nxt:pos]), start_position=nxt)
            k = min(num_drafts, max_new_tokens - len(out))
            res = drafter.propose(st, toks[pos + 1], hid[pos], pos, k)
            lg, Hv = target.forward(seq, [toks[pos + 1]] + res.tokens)
            passes += 1
            if temperature <= 0:
                a, nxt_tok = greedy_verify(lg, res.tokens)
            else:
                a, nxt_tok = rejection_verify(softmax(lg, temperature), one_hot(res.tokens, lg.shape[-1]),
                                              res.tokens, rng)
            target.truncate(seq, pos + 2 + a)
            drafter.after_verify(st, a)
            m.record(k, a)
            new = res.tokens[:a] + [nxt_tok]
            hid.extend(Hv[:a + 1])
            toks.extend(new)
            out.extend(new)
            pos += 1 + a
            if progress:
                progress.update(len(new))
        return GenerateResult(out[:max_new_tokens], time.perf_counter() - t0, m, passes)
    finally:
        target.free(seq)
        drafter.free_state(st)
