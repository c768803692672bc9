"""Verification rules: greedy (exact match with the target's argmax) and lossless rejection sampling.

Rejection sampling (Leviathan et al. / Chen et al.): draft d_i ~ q_i is accepted with probability
min(1, p_i(d_i) / q_i(d_i)); at the first rejection the token is resampled from norm(max(0, p_i - q_i));
if every draft is accepted, a bonus token is drawn from p_{k+1}. The emitted tokens are then distributed
exactly as sampling from the target alone. Greedy drafts are the one-hot q (accept with probability p(d))."""
from __future__ import annotations

import numpy as np


def softmax(logits: np.ndarray, temperature: float) -> np.ndarray:
    z = np.asarray(logits, np.float64) / temperature
    z = z - z.max(-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(-1, keepdims=True)


def greedy_verify(target_logits: np.ndarray, drafts: list[int]) -> tuple[int, int]:
    """(accepted, bonus): the longest prefix of drafts equal to the target's argmax, and the target's
    token after it. target_logits has len(drafts) + 1 rows."""
    g = np.argmax(target_logits, axis=-1)
    a = 0
    while a < len(drafts) and drafts[a] == int(g[a]):
        a += 1
    return a, int(g[a])


def one_hot(drafts: list[int], vocab: int) -> np.ndarray:
    q = np.zeros((len(drafts), vocab))
    q[np.arange(len(drafts)), drafts] = 1.0
    return q


def rejection_verify(p: np.ndarray, q: np.ndarray, drafts: list[int], rng) -> tuple[int, int]:
    """(accepted, next_token) with p [k+1, V] target probabilities and q [k, V] draft probabilities."""
    k = len(drafts)
    for i, d in enumerate(drafts):
        if rng.random() * q[i, d] < p[i, d]:      # u < p/q without dividing by a zero q
            continue
        resid = np.maximum(p[i] - q[i], 0.0)
        s = resid.sum()
        probs = resid / s if s > 0 else p[i]
        return i, int(rng.choice(p.shape[1], p=probs))
    return k, int(rng.choice(p.shape[1], p=p[k]))
