import numpy as np
import pytest

from mtp_cupy.speculative.generate import generate, generate_target_only
from mtp_cupy.speculative.metrics import SpecDecodeMetrics
from mtp_cupy.speculative.sampling import greedy_verify, rejection_verify, softmax


def test_greedy_verify():
    lg = np.full((4, 5), -1.0)
    lg[0, 2] = lg[1, 3] = lg[2, 0] = lg[3, 4] = 1.0
    assert greedy_verify(lg, [2, 3, 0]) == (3, 4)
    assert greedy_verify(lg, [2, 1, 0]) == (1, 3)
    assert greedy_verify(lg, [0, 3, 0]) == (0, 2)
    lg[1, 1] = 1.0  # tie at row 1: argmax takes the lower id
    assert greedy_verify(lg, [2, 1, 0]) == (3, 4)


def _chi2_ok(counts, probs, n, z=5.3):
    """Pearson's chi-square of counts against n * probs (cells expecting more than 5) below the chi-square
    quantile of upper tail ~6e-8 (z = 5.3), by Wilson-Hilferty: at few degrees of freedom the tail is far
    heavier than a normal one, so mean + z sigma would flag a correct sampler about once in 3,000 checks."""
    exp = probs * n
    keep = exp > 5
    chi2 = (((counts - exp) ** 2)[keep] / exp[keep]).sum()
    dof = keep.sum()
    return chi2 < dof * (1 - 2 / (9 * dof) + z * np.sqrt(2 / (9 * dof))) ** 3


def _markov(rng, V):
    """A target P[next | current] and a draft Q that agrees with it often but not always."""
    P = softmax(rng.standard_normal((V, V)) * 1.5, 1.0)
    Q = 0.6 * P + 0.4 * softmax(rng.standard_normal((V, V)) * 1.5, 1.0)
    return P, Q


def _marginals(P, x0: int, L: int) -> np.ndarray:
    """[L, V]: the exact distribution of the token at each of the L positions after x0 under target-only
    sampling (x_{t+1} ~ P[x_t])."""
    out, d = [], np.eye(len(P))[x0]
    for _ in range(L):
        d = d @ P
        out.append(d)
    return np.array(out)


def _assert_continuations(samples: np.ndarray, P, x0: int, what: str) -> None:
    """Every position's token (chi-square against the exact marginal) and every adjacent pair (against
    marginal x transition) distributed as target-only sampling."""
    n, L = samples.shape
    V = len(P)
    m = _marginals(P, x0, L)
    for t in range(L):
        assert _chi2_ok(np.bincount(samples[:, t], minlength=V), m[t], n), (what, "position", t)
    for t in range(L - 1):
        pairs = np.bincount(samples[:, t] * V + samples[:, t + 1], minlength=V * V)
        assert _chi2_ok(pairs, (m[t][:, None] * P).reshape(-1), n), (what, "positions", t, t + 1)


def _draw(rng, probs) -> int:
    return int(np.searchsorted(np.cumsum(probs), rng.random() * probs.sum()))


@pytest.mark.parametrize("mode", ["sampled", "greedy"])
def test_rejection_sampling_continuations_match_target(rng, mode):
    """Whole sampled continuations: 6 tokens emitted by cycles of k = 3 drafts (drawn from Q, or Q's argmax
    as a one-hot q) verified by rejection_verify against a Markov target P, the drafts sometimes right and
    sometimes wrong. Each position's token and each adjacent pair is distributed as sampling P alone -- the
    accepted drafts, the resampled token after a rejection and the bonus token after k acceptances."""
    V, k, L, n, x0 = 5, 3, 6, 12000, 0
    P, Q = _markov(rng, V)
    samples = np.empty((n, L), np.int64)
    for r in range(n):
        out, last = [], x0
        while len(out) < L:
            drafts, q, prev = [], np.zeros((k, V)), last
            for i in range(k):
                d = _draw(rng, Q[prev]) if mode == "sampled" else int(np.argmax(Q[prev]))
                q[i] = Q[prev] if mode == "sampled" else np.eye(V)[d]
                drafts.append(d)
                prev = d
            p = P[[last] + drafts]                   # p_i: the target after the first i drafts
            a, nxt = rejection_verify(p, q, drafts, rng)
            out += drafts[:a] + [nxt]
            last = out[-1]
        samples[r] = out[:L]
    _assert_continuations(samples, P, x0, mode)


class _MarkovTarget:
    """A target runner whose next-token logits depend only on the current token (log P[token]); the hidden
    of a row is its token one-hot."""

    def __init__(self, P):
        self.logp, self.vocab_size, self.max_seq_len = np.log(P).astype(np.float32), len(P), 64

    def alloc(self):
        return []

    def forward(self, seq, tokens):
        seq += list(tokens)
        return self.logp[list(tokens)], np.eye(self.vocab_size, dtype=np.float32)[list(tokens)]

    def truncate(self, seq, rows):
        del seq[rows:]

    def free(self, seq):
        pass


class _MarkovDrafter:
    """A drafter drafting Q's greedy chain from the token it is given, with the proposer's row bookkeeping
    (a row per position, no holes, k - a rows trimmed after a verify). It checks what generate pairs: a
    row at position p gets the target's hidden at p (here the one-hot of the token at p) and the token at
    p + 1, consistent with every token it has been told of (prompt, accepted drafts, bonus tokens)."""

    class State:
        def __init__(self):
            self.keys, self.seen, self.last = [], {}, None

    def __init__(self, Q):
        self.Q, self.max_seq_len, self.max_drafts = Q, 64, 8

    def alloc_state(self):
        return self.State()

    @staticmethod
    def _token_at(st, p: int, t: int) -> None:
        assert st.seen.setdefault(p, t) == t, f"position {p}: token {t}, told {st.seen[p]} before"

    def prefill(self, st, tokens, hiddens, start_position=None):
        start = len(st.keys) if start_position is None else start_position
        assert start == len(st.keys) and len(tokens) == len(hiddens) + 1
        for r, h in enumerate(hiddens):
            self._token_at(st, start + r, int(np.argmax(h)))
            self._token_at(st, start + r + 1, int(tokens[r + 1]))
        st.keys += list(range(start, start + len(hiddens)))

    def propose(self, st, token, hidden, position, k):
        assert position == len(st.keys), "a hole or an overwrite in the drafter's rows"
        self._token_at(st, position, int(np.argmax(hidden)))
        self._token_at(st, position + 1, int(token))
        drafts, t = [], token
        for _ in range(k):
            t = int(np.argmax(self.Q[t]))
            drafts.append(t)
        st.keys += list(range(position, position + k))
        st.last = (position, drafts)

        class R:
            tokens = drafts
        return R

    def after_verify(self, st, a):
        position, drafts = st.last
        for i, d in enumerate(drafts[:a]):          # draft i is the token at position + 2 + i
            self._token_at(st, position + 2 + i, d)
        st.seen = {p: t for p, t in st.seen.items() if p <= position + 1 + a}
        del st.keys[len(st.keys) - (len(drafts) - a):]

    def free_state(self, st):
        pass


def test_generate_sampling_matches_target_only(rng):
    """generate() at temperature 0.8 with k = 3 on a Markov target and a drafter that is sometimes right:
    every position's token and adjacent pair of the continuation is distributed as target-only sampling
    at that temperature (generate_target_only draws from the same distribution)."""
    V, L, n = 5, 7, 3000
    P, Q = _markov(rng, V)
    target, drafter = _MarkovTarget(P), _MarkovDrafter(Q)
    PT = softmax(np.log(P), 0.8)
    prompt = [1, 0]
    seeds = rng.integers(1 << 62, size=n)
    samples = np.array([generate(target, drafter, prompt, L, num_drafts=3, temperature=0.8, seed=int(s)).tokens
                        for s in seeds])
    _assert_continuations(samples, PT, prompt[-1], "generate")
    base = np.array([generate_target_only(target, prompt, L, temperature=0.8, seed=int(s)).tokens
                     for s in seeds[:n // 3]])
    _assert_continuations(base, PT, prompt[-1], "target only")


def test_metrics_add_up(rng):
    m = SpecDecodeMetrics()
    acc = []
    for _ in range(200):
        k = int(rng.integers(1, 5))
        a = int(rng.integers(0, k + 1))
        m.record(k, a)
        acc.append((k, a))
    v = m.as_vllm()
    assert v["spec_decode_num_drafts"] == 200
    assert v["spec_decode_num_draft_tokens"] == sum(k for k, _ in acc)
    assert v["spec_decode_num_accepted_tokens"] == sum(a for _, a in acc) == sum(v["spec_decode_num_accepted_tokens_per_pos"])
    assert all(x >= y for x, y in zip(m.accepted_per_pos, m.accepted_per_pos[1:]))
    assert abs(m.mean_acceptance_length - (1 + sum(a for _, a in acc) / 200)) < 1e-12


def test_metrics_merge(rng):
    a, b, both = SpecDecodeMetrics(), SpecDecodeMetrics(), SpecDecodeMetrics()
    for m in (a, b):
        for _ in range(50):
            k = int(rng.integers(1, 5))
            acc = int(rng.integers(0, k + 1))
            m.record(k, acc)
            both.record(k, acc)
    a.merge(b)
    assert a.as_vllm() == both.as_vllm()
