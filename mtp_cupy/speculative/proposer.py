"""The DraftProposer protocol a serving loop calls, the per-sequence state, and the trim rule.

Row/position model: drafter KV rows are dense (row r is the r-th row written); `position` is the RoPE
position the caller gives. A row at position p pairs the target's hidden at p with embed(token at p+1)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np


@dataclass
class DraftResult:
    """One sequence's drafts. Host results (the default): `tokens` and, when asked, `logits`.

    Device results (`propose(..., device_results=True)`): `tokens` and `logits` are None and the drafts stay on
    the proposer's device as arrays of their own that export `__dlpack__` (cupy on CUDA, NumPy on the NumPy
    device): `device_tokens` int32 [num_drafts], `device_logits` float32 [num_drafts, vocab] with
    return_logits. They are written on the proposer's stream (`ready` is an event recorded there after them);
    read them on that stream, on a stream passed as `stream=` to the call (it waits for them), or after `host()`.
    Later calls never overwrite them."""
    tokens: list[int] | None
    logits: np.ndarray | None = None      # [num_drafts, vocab] float32 on the host when asked
    logprobs: list[float] | None = None   # top-1 log-probabilities when measured (confidence stop)
    device_tokens: Any = None
    device_logits: Any = None
    ready: Any = None
    stream: Any = field(default=None, repr=False)     # the proposer's stream the device arrays were written on

    def host(self) -> "DraftResult":
        """Fill `tokens` (and `logits`) from the device arrays: copied on the proposer's stream, waiting for that
        stream only. Returns self."""
        if self.tokens is None and self.device_tokens is not None:
            self.tokens = [int(t) for t in self._read(self.device_tokens)]
            if self.device_logits is not None:
                self.logits = self._read(self.device_logits).astype(np.float32, copy=False)
        return self

    def _read(self, a) -> np.ndarray:
        if isinstance(a, np.ndarray):
            return a
        out = a.get(stream=self.stream)
        if self.stream is not None:
            self.stream.synchronize()
        return out


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
