"""Speculative decoding: a target runner verifies the drafter's proposals.

The target runner interface (mtp_cupy.target.DeepseekV3Target implements it):
    alloc() -> seq;  free(seq)
    forward(seq, tokens) -> (logits [m, V] f32, hiddens [m, D] f32): appends m rows at the next positions
    truncate(seq, rows)
Hiddens are the target's final-normed hiddens, what the drafter pairs with the next token's embedding.

Greedy verification emits exactly what target-only greedy decoding emits; temperature > 0 uses lossless
rejection sampling with the greedy drafts as a one-hot draft distribution."""
from __future__ import annotations

import math
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


def _count(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise InputError(f"{name} must be an integer >= 1, got {v!r}")
    return int(v)


def _check(prompt, max_new_tokens, vocab, max_seq_len, temperature, num_drafts=None):
    """The prompt as a list of ints after checking every argument of a run (InputError naming the bad one);
    num_drafts None: target-only."""
    if isinstance(prompt, (str, bytes)):
        raise InputError(f"prompt must be a sequence of token ids, not {type(prompt).__name__}; tokenize it first "
                         "(the embedded model is byte-level: list(text.encode()))")
    try:
        prompt = [int(t) for t in prompt]
    except (TypeError, ValueError):
        raise InputError("prompt must be a sequence of int token ids") from None
    max_new_tokens = _count("max_new_tokens", max_new_tokens)
    margin = 1 if num_drafts is None else _count("num_drafts", num_drafts) + 1
    try:
        t = float(temperature)
    except (TypeError, ValueError):
        t = math.nan
    if not (t >= 0 and math.isfinite(t)):
        raise InputError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if len(prompt) < 2:
        raise InputError("the prompt needs at least two tokens")
    if any(not 0 <= t < vocab for t in prompt):
        raise InputError(f"prompt token out of range [0, {vocab})")
    if len(prompt) + max_new_tokens + margin > max_seq_len:
        raise InputError(f"prompt {len(prompt)} + {max_new_tokens} new tokens (+{margin}) exceed max_seq_len "
                         f"{max_seq_len}")
    return prompt


def generate_target_only(target, prompt, max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
                         progress=None) -> GenerateResult:
    """Decode with the target alone: the baseline that speculative decoding must match.

    Parameters
    ----------
    target, prompt, max_new_tokens, temperature, seed, progress
        As for `generate`.

    Returns
    -------
    GenerateResult
        `tokens` (max_new_tokens ids), `seconds`, `tokens_per_s`, `target_passes` and `extra`
        {"prompt_seconds", "decode_seconds"}: the prompt's pass, and the 1-row decode passes after it.

    Raises
    ------
    InputError
        As for `generate`."""
    prompt = _check(prompt, max_new_tokens, target.vocab_size, target.max_seq_len, temperature)
    rng = np.random.default_rng(seed)
    seq = target.alloc()
    try:
        t0 = time.perf_counter()
        lg, _ = target.forward(seq, prompt)
        out = [_pick(lg[-1], temperature, rng)]
        t1 = time.perf_counter()
        while len(out) < max_new_tokens:
            lg, _ = target.forward(seq, [out[-1]])
            out.append(_pick(lg[-1], temperature, rng))
            if progress:
                progress.update(1)
        t2 = time.perf_counter()
        return GenerateResult(out, t2 - t0, target_passes=len(out), extra={"prompt_seconds": t1 - t0,
                                                                            "decode_seconds": t2 - t1})
    finally:
        target.free(seq)


def _accept(target, seq, lg, Hv, drafts: list[int], pos: int, temperature: float, rng, toks: list, hid: list,
            out: list) -> tuple[int, list[int]]:
    """The verify rule on the target's pass over [token at pos + 1, *drafts] (logits lg, hiddens Hv): a drafts
    accepted and the target's next token. The target keeps its rows up to the last emitted token; toks / out get
    the emitted tokens, hid the hiddens of the kept rows. Returns (a, the emitted tokens)."""
    if temperature <= 0:
        a, nxt_tok = greedy_verify(lg, drafts)
    else:
        a, nxt_tok = rejection_verify(softmax(lg, temperature), one_hot(drafts, lg.shape[-1]), drafts, rng)
    target.truncate(seq, pos + 2 + a)
    new = drafts[:a] + [nxt_tok]
    hid.extend(Hv[:a + 1])
    toks.extend(new)
    out.extend(new)
    return a, new


def _check_run(target, drafter, prompt, max_new_tokens, temperature, num_drafts):
    """`_check` of a speculative run's prompt (the context both models hold)."""
    return _check(prompt, max_new_tokens, target.vocab_size, min(target.max_seq_len, drafter.max_seq_len),
                  temperature, num_drafts)


def _check_drafts(drafter, num_drafts) -> None:
    """num_drafts an integer >= 1 the drafter was sized for (InputError naming it)."""
    if _count("num_drafts", num_drafts) > drafter.max_drafts:
        raise InputError(f"num_drafts {num_drafts} is more than the drafter's max_drafts {drafter.max_drafts} "
                         "(load_proposer(..., max_drafts=...) sizes it)")


def catch_up(drafter, st, toks, hid, pos: int) -> int:
    """Rewrite the drafter rows before position `pos` that the trim rule dropped (after_verify), from the
    target's own hiddens: row p pairs toks[p + 1] with hid[p]. A propose at `pos` then leaves no hole in the
    drafter's KV. Returns the rows written."""
    nxt = st.keys[-1] + 1 if st.keys else 0
    if nxt >= pos:
        return 0
    return drafter.prefill(st, toks[nxt:pos + 1], np.stack(hid[nxt:pos]), start_position=nxt)


def generate(target, drafter, prompt, max_new_tokens: int, num_drafts: int = 3, temperature: float = 0.0,
             seed: int = 0, progress=None) -> GenerateResult:
    """Speculative decoding: `drafter` proposes up to `num_drafts` tokens a step and `target` verifies them in one
    pass. Greedy output is exactly target-only decoding's; temperature > 0 is lossless rejection sampling.

    Parameters
    ----------
    target : target runner
        `vocab_size`, `max_seq_len`, `alloc()`, `free(seq)`, `truncate(seq, rows)` and `forward(seq, tokens)` ->
        (logits float32 [m, vocab], hiddens float32 [m, D]), as in the module docstring
        (`mtp_cupy.target.DeepseekV3Target` is one).
    drafter : DraftProposer
        The MTP proposer of the target's checkpoint (`mtp_cupy.load_proposer`), with max_drafts >= num_drafts.
    prompt : sequence of int
        Token ids, at least two, each in [0, target.vocab_size). Not a string: tokenize first (the embedded
        model is byte-level: `list(text.encode())`).
    max_new_tokens : int
        Tokens to generate, >= 1. prompt + max_new_tokens + num_drafts + 1 must fit both max_seq_lens.
    num_drafts : int
        Drafts per step, 1 to drafter.max_drafts (fewer when fewer tokens remain).
    temperature : float
        0 = greedy (argmax); > 0 samples from softmax(logits / temperature).
    seed : int
        Seed of the sampler.
    progress : tqdm-like, optional
        `progress.update(n)` gets the number of tokens each step emits.

    Returns
    -------
    GenerateResult
        `tokens` (max_new_tokens ids), `seconds`, `tokens_per_s`, `target_passes`, `metrics` (SpecDecodeMetrics:
        acceptance counters with vLLM's names) and `extra` {"draft_seconds", "verify_seconds"}: time spent
        drafting (catch-up prefill included) and in the target's verify passes (the prompt's pass not included).

    Raises
    ------
    InputError
        A string or non-integer prompt, fewer than two tokens, a token out of range, max_new_tokens or
        num_drafts < 1, num_drafts > drafter.max_drafts, a negative temperature, a run that does not fit.
    CapacityError
        A KV pool too small for the run."""
    prompt = _check_run(target, drafter, prompt, max_new_tokens, temperature, num_drafts)
    _check_drafts(drafter, num_drafts)
    rng = np.random.default_rng(seed)
    seq, st, m = target.alloc(), drafter.alloc_state(), SpecDecodeMetrics()
    clock = time.perf_counter
    draft_s = verify_s = 0.0
    try:
        t0 = clock()
        lg, H = target.forward(seq, prompt)
        toks, hid = list(prompt), list(H)              # hid[p] = the target's hidden at position p
        toks.append(_pick(lg[-1], temperature, rng))
        drafter.prefill(st, prompt, H[:-1])
        pos, out, passes = len(prompt) - 1, [toks[-1]], 1
        while len(out) < max_new_tokens:
            t1 = clock()
            catch_up(drafter, st, toks, hid, pos)   # rows the trim rule dropped, from the target's hiddens
            k = min(num_drafts, max_new_tokens - len(out))
            res = drafter.propose(st, toks[pos + 1], hid[pos], pos, k)
            t2 = clock()
            lg, Hv = target.forward(seq, [toks[pos + 1]] + res.tokens)
            verify_s += clock() - t2
            draft_s += t2 - t1
            passes += 1
            a, new = _accept(target, seq, lg, Hv, res.tokens, pos, temperature, rng, toks, hid, out)
            drafter.after_verify(st, a)
            m.record(k, a)
            pos += 1 + a
            if progress:
                progress.update(len(new))
        return GenerateResult(out[:max_new_tokens], clock() - t0, m, passes,
                              extra={"draft_seconds": draft_s, "verify_seconds": verify_s})
    finally:
        target.free(seq)
        drafter.free_state(st)


def generate_batch(target, drafter, prompts, max_new_tokens: int, num_drafts: int = 3, temperature: float = 0.0,
                   seed: int = 0) -> list[GenerateResult]:
    """`generate` for several prompts at once, as a serving loop runs them: every step the drafter catches all live
    sequences up in one `prefill_batch`, drafts for them in one `propose_batch` and trims them in one
    `after_verify_batch`; the target verifies each sequence (its runner takes one sequence a pass). A sequence
    leaves the batch when it has its tokens.

    Sequence s's tokens are exactly `generate(target, drafter, prompts[s], max_new_tokens, num_drafts,
    temperature, seed + s)`'s: the drafts of a sequence do not depend on the batch (batch-invariant drafting), and
    each sequence samples from its own generator, seeded seed + s. Every step drafts `num_drafts` for the whole
    batch; a sequence with fewer tokens left verifies only the first of them, as `generate` drafts only those.

    Parameters
    ----------
    target, drafter, max_new_tokens, num_drafts, temperature
        As for `generate`; the drafter needs max_batch >= len(prompts).
    prompts : list of sequences of int
        One prompt per sequence, each as `generate` takes it.
    seed : int
        Sequence s's sampler is seeded seed + s.

    Returns
    -------
    list of GenerateResult
        One per prompt, in order; `seconds` is the whole batch's wall time (the sequences ran together) and
        `extra` holds {"batch": len(prompts)}.

    Raises
    ------
    InputError
        As for `generate`, naming the prompt; no prompts, or more than the drafter's max_batch.
    CapacityError
        A KV pool too small for the run."""
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise InputError("prompts must be a non-empty list of token-id sequences")
    if len(prompts) > drafter.max_batch:
        raise InputError(f"{len(prompts)} prompts; the drafter batches at most {drafter.max_batch} (max_batch)")
    _check_drafts(drafter, num_drafts)
    checked = []
    for s, p in enumerate(prompts):
        try:
            checked.append(_check_run(target, drafter, p, max_new_tokens, temperature, num_drafts))
        except InputError as e:
            raise InputError(f"prompt {s}: {e}") from None
    B, clock = len(checked), time.perf_counter
    rngs = [np.random.default_rng(seed + s) for s in range(B)]
    seqs, sts, ms = [], [], [SpecDecodeMetrics() for _ in range(B)]
    toks, hid, out, pos, passes = [], [], [], [], [1] * B
    try:
        t0 = clock()
        for s, prompt in enumerate(checked):
            seqs.append(target.alloc())
            sts.append(drafter.alloc_state())
            lg, H = target.forward(seqs[s], prompt)
            toks.append(list(prompt) + [_pick(lg[-1], temperature, rngs[s])])   # toks[s][p]: the token at p
            hid.append(list(H))                                                # hid[s][p]: the hidden at p
            out.append([toks[s][-1]])
            pos.append(len(prompt) - 1)
        drafter.prefill_batch(sts, [t for p in checked for t in p[1:]], np.concatenate([h[:-1] for h in hid]),
                              [len(p) - 1 for p in checked])
        live = [s for s in range(B) if len(out[s]) < max_new_tokens]
        while live:
            lst = [sts[s] for s in live]
            # the rows after_verify dropped (one a sequence with the default rule), from the target's hiddens
            n = [pos[s] - sts[s].next_position for s in live]
            rows = [(s, p) for s, c in zip(live, n) for p in range(pos[s] - c, pos[s])]
            if rows:
                drafter.prefill_batch(lst, [toks[s][p + 1] for s, p in rows], np.stack([hid[s][p] for s, p in rows]),
                                      n)
            res = drafter.propose_batch(lst, [toks[s][pos[s] + 1] for s in live],
                                        np.stack([hid[s][pos[s]] for s in live]), None, num_drafts)
            acc = []
            for j, s in enumerate(live):
                k = min(num_drafts, max_new_tokens - len(out[s]))
                drafts = res.tokens[j, :k].tolist()
                lg, Hv = target.forward(seqs[s], [toks[s][pos[s] + 1]] + drafts)
                passes[s] += 1
                a, _ = _accept(target, seqs[s], lg, Hv, drafts, pos[s], temperature, rngs[s], toks[s], hid[s], out[s])
                ms[s].record(k, a)
                pos[s] += 1 + a
                acc.append(a)
            drafter.after_verify_batch(lst, acc)
            live = [s for s in live if len(out[s]) < max_new_tokens]
        seconds = clock() - t0
        return [GenerateResult(out[s][:max_new_tokens], seconds, ms[s], passes[s], extra={"batch": B})
                for s in range(B)]
    finally:
        for seq in seqs:
            target.free(seq)
        for st in sts:
            drafter.free_state(st)
