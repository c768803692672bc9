"""Discrete decisions of a float64 reference step (expert routing, group limits, the DSA index top-k) and their
near ties. Where two choices are closer than the rounding of a bf16 device, either is a legitimate outcome;
a check that only stops there compares nothing after it, one that ignores it fails on a fresh seed. So a
reference step can be run under each outcome (`run_candidates`): the device must match one of them, and a
device that is wrong (a dropped scale, a wrong key, a flipped concat) matches none."""
from __future__ import annotations

import math

import numpy as np


class Decisions:
    def __init__(self):
        self.last_margin = math.inf   # smallest normalised decision gap of the last step
        self._force: dict = {}        # decision name -> selection, in a candidate run
        self._decisions: list = []

    def pick(self, name: str, scores: np.ndarray, n: int, scale: float = 1.0) -> np.ndarray:
        """The top-n indices of `scores` (ties to the lower index), or what a candidate run forces. Records the
        decision: a member whose score is within `tie * scale` of a non-member's is a near tie."""
        order = np.argsort(-scores, kind="stable")
        self._decisions.append((name, scores, order, n, scale))
        if name in self._force:
            return np.asarray(self._force[name])
        return order[:n]

    def run_candidates(self, forward, tie: float) -> list:
        """forward() once free (recording its decisions), then once per near tie (a member and a non-member
        of a selection closer than tie * scale) with that pair swapped and every later decision of the step
        recomputed. Returns the outcomes, the exact one first; last_margin is the free run's smallest gap."""
        self._force, self._decisions = {}, []
        out = [forward()]
        alts, self.last_margin = near_ties(self._decisions, tie)
        for name, sel in alts:
            self._force, self._decisions = {name: sel}, []
            out.append(forward())
        self._force, self._decisions = {}, []
        return out


def near_ties(decisions, tie: float):
    """(name, forced selection) for every single swap across a decision boundary closer than tie * scale,
    and the smallest normalised gap over all decisions."""
    alts, margin = [], math.inf
    for name, scores, order, n, scale in decisions:
        if n >= len(scores):
            continue
        inside, outside = order[:n], [j for j in order[n:] if np.isfinite(scores[j])]
        if outside:
            margin = min(margin, (scores[inside[-1]] - scores[outside[0]]) / scale)
        for i in inside:
            for j in outside:
                if (scores[i] - scores[j]) / scale < tie:
                    alts.append((name, sorted(set(inside.tolist()) - {int(i)} | {int(j)})))
    return alts, margin


