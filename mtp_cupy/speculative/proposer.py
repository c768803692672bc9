"""The DraftProposer protocol a serving loop calls, the per-sequence state, and the trim rule.

Row/position model: drafter KV rows are dense (row r is the r-th row written); `position` is the RoPE
position the caller gives. A row at position p pairs the target's hidden at p with embed(token at p+1)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np


@dataclass
class DraftResult:
    tokens: list[int]
    logits: np.ndarray | None = None      # [num_drafts, vocab] float32 on the host when asked
    logprobs: list[float] | None = None   # top-1 log-probabilities when measured (confidence stop)


@dataclass
class ProposerState:
    """Per-sequence drafter state. Families subclass it; `blocks` is a cache.SeqBlocks."""
    blocks: object = None
    last_num_drafted: int = 0
    last_pair_key: int | None = None      # position of the newest row written (None before any)
    last_drafts: list[int] = field(default_factory=list)
    keys: list[int] = field(default_factory=list)  # RoPE position of every drafter row, in row order
    released: bool = False

    @property
    def seq_len(self) -> int:
        return self.blocks.rows if self.blocks is not None else 0


@runtime_checkable
class DraftProposer(Protocol):
    vocab_size: int
    max_seq_len: int

    def alloc_state(self) -> ProposerState: ...

    def prefill(self, state: ProposerState, tokens, hiddens) -> int: ...

    def propose(self, state: ProposerState, token: int, hidden, position: int, num_drafts: int,
                grammar_bitmask=None, return_logits: bool = False) -> DraftResult: ...

    def after_verify(self, state: ProposerState, num_accepted: int) -> None: ...

    def free_state(self, state: ProposerState) -> None: ...


def mtp_rows_to_trim(num_drafted: int, num_accepted: int, refeed_accepted: bool = False) -> int:
    """Drafter KV rows `after_verify` drops (the seed's rule).

    * Rejected rows always go: num_drafted - num_accepted.
    * With refeed_accepted, the accepted rows built from a drafter hidden go too (every accepted draft
      but the first, whose row was built from the target's hidden); the caller re-feeds them from the
      target's hiddens (catch-up).
    Never more than num_drafted."""
    if num_drafted < 0 or num_accepted < 0:
        raise ValueError("counts must be >= 0")
    rejected = max(num_drafted - num_accepted, 0)
    refed = max(num_accepted - 1, 0) if refeed_accepted else 0
    return min(rejected + refed, num_drafted)
