import numpy as np

from mtp_cupy.speculative.metrics import SpecDecodeMetrics
from mtp_cupy.speculative.sampling import greedy_verify, one_hot, rejection_verify, softmax


def test_greedy_verify():
    lg = np.full((4, 5), -1.0)
    lg[0, 2] = lg[1, 3] = lg[2, 0] = lg[3, 4] = 1.0
    assert greedy_verify(lg, [2, 3, 0]) == (3, 4)
    assert greedy_verify(lg, [2, 1, 0]) == (1, 3)
    assert greedy_verify(lg, [0, 3, 0]) == (0, 2)
    lg[1, 1] = 1.0  # tie at row 1: argmax takes the lower id
    assert greedy_verify(lg, [2, 1, 0]) == (3, 4)


def _chi2_ok(counts, probs, n):
    exp = probs * n
    keep = exp > 5
    chi2 = (((counts - exp) ** 2)[keep] / exp[keep]).sum()
    return chi2 < keep.sum() + 6 * np.sqrt(2 * keep.sum())  # mean + ~6 sigma of a chi-square


def test_rejection_sampling_matches_target(rng):
    """The first emitted token is distributed exactly as p_0, for random q and for greedy (one-hot) drafts."""
    V, n = 6, 40000
    p = softmax(rng.standard_normal((3, V)) * 1.5, 1.0)
    q = softmax(rng.standard_normal((2, V)) * 1.5, 1.0)
    for mode in ("sampled", "greedy"):
        counts = np.zeros(V)
        for _ in range(n):
            if mode == "sampled":
                drafts = [int(rng.choice(V, p=q[i])) for i in range(2)]
                qq = q
            else:
                drafts = [int(np.argmax(q[0])), int(np.argmax(q[1]))]
                qq = one_hot(drafts, V)
            a, nxt = rejection_verify(p, qq, drafts, rng)
            counts[drafts[0] if a >= 1 else nxt] += 1
        assert _chi2_ok(counts, p[0], n), (mode, counts / n, p[0])


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
