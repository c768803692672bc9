"""Acceptance statistics with vLLM's counter names (vllm/v1/spec_decode/metrics.py)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeMetrics:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_drafted:
            self.accepted_per_pos += [0] * (num_drafted - len(self.accepted_per_pos))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    def merge(self, other: "SpecDecodeMetrics") -> None:
        """Add another run's counters to these."""
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        n = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        self.accepted_per_pos = [(self.accepted_per_pos[i] if i < len(self.accepted_per_pos) else 0)
                                 + (other.accepted_per_pos[i] if i < len(other.accepted_per_pos) else 0)
                                 for i in range(n)]

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per target verify pass (accepted drafts + the bonus token)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def acceptance_rate_per_pos(self) -> list[float]:
        return [a / self.num_drafts for a in self.accepted_per_pos] if self.num_drafts else []

    def as_vllm(self) -> dict:
        return {"spec_decode_num_drafts": self.num_drafts,
                "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_pos)}
