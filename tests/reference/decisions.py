"""Discrete decisions of a float64 reference step (expert routing, group limits, the DSA index top-k) and their
near ties. Where two choices are closer than the rounding of a bf16 device, either is a legitimate outcome;
a check that only stops there compares nothing after it, one that ignores it fails on a fresh seed. So a
reference step can be run under each outcome (`run_candidates`): the device must match one of them, and a
device that is wrong (a dropped scale, a wrong key, a flipped concat) matches none."""
from __future__ import annotations

import math

import numpy as np


class Decisions:
    """Mixed into a reference that has write_row(token, hidden, pos) and forward(token, hidden, pos) ->
    (logits, carried hidden) over the rows it holds."""

    def __init__(self):
        self.last_margin = math.inf   # smallest normalised decision gap of the last step
        self._force: dict = {}        # decision name -> selection, in a candidate run
        self._decisions: list = []

    def pick(self, name: str, scores: np.ndarray, n: int, scale: float = 1.0) -> np.ndarray:
        """The top-n indices of `scores` (ties to the lower index), or what a candidate run forces. Records the
        decision: a member whose score is within `tie * scale` of a non-member's is a near tie."""
        sel = np.asarray(self._force[name]) if name in self._force else np.argsort(-scores, kind="stable")[:n]
        self._decisions.append((name, scores, sel, scale))
        return sel

    def step(self, token: int, hidden, pos: int) -> tuple[np.ndarray, np.ndarray]:
        """One draft step (appends its row): (logits [vocab], carried hidden); last_margin its smallest gap."""
        return self.candidates(token, hidden, pos, 0.0)[0]

    def candidates(self, token: int, hidden, pos: int, tie: float) -> list[tuple[np.ndarray, np.ndarray]]:
        """One draft step (appends its row) under every near-tie outcome of its decisions, the exact one first
        (run_candidates). A device that rounds differently at a tie matches one; a wrong device none."""
        self.write_row(token, hidden, pos)
        return self.run_candidates(lambda: self.forward(token, hidden, pos), tie)

    def run_candidates(self, forward, tie: float, depth: int = 3, most: int = 256) -> list:
        """forward() once free (recording its decisions), then once per near tie (a member and a non-member
        of a selection closer than tie * scale) with that pair swapped and every later decision of the step
        recomputed, and so on for the near ties of those runs, `depth` swaps at most (several index rows and
        an expert can be close at once), `most` outcomes at most. Returns the outcomes, the exact one first;
        last_margin is the free run's smallest gap, outcome_gaps per outcome the largest gap it crossed."""
        out, seen, first = [], set(), None
        self.outcome_gaps = []
        queue = [({}, depth, 0.0)]          # breadth first: an outcome is met first by its fewest swaps
        for force, d, gap in queue:
            if len(out) >= most or len(queue) > 8 * most:
                break
            self._force, self._decisions = force, []
            res, decisions = forward(), self._decisions
            first = decisions if first is None else first
            sig = tuple((name, tuple(sorted(int(i) for i in sel))) for name, _, sel, _ in decisions)
            if sig in seen:             # the same selections as an outcome already held
                continue
            seen.add(sig)
            out.append(res)
            self.outcome_gaps.append(gap)
            if d:
                queue += [({**force, name: tuple(sel)}, d - 1, max(gap, g))
                          for name, sel, g in near_ties(decisions, tie)[0]]
        self.last_margin = near_ties(first, tie)[1]
        self._force, self._decisions = {}, []
        return out

def near_ties(decisions, tie: float):
    """(name, selection, normalised gap) for every single swap of a member and a non-member whose scores are
    closer than tie * scale, and the smallest normalised gap across any selection boundary."""
    alts, margin = [], math.inf
    for name, scores, sel, scale in decisions:
        inside = [int(i) for i in sel]
        outside = [j for j in range(len(scores)) if j not in set(inside) and np.isfinite(scores[j])]
        if not outside:
            continue
        margin = min(margin, (min(scores[inside]) - max(scores[outside])) / scale)
        for i in inside:
            for j in outside:
                gap = abs(scores[i] - scores[j]) / scale
                if gap < tie:
                    alts.append((name, sorted(set(inside) - {i} | {j}), float(gap)))
    return alts, margin
