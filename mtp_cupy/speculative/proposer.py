"""The DraftProposer protocol a serving loop calls, the per-sequence state, and the trim rule.

Row/position model: drafter KV rows are dense (row r is the r-th row written); `position` is the RoPE
position the caller gives. A row at position p pairs the target's hidden at p with embed(token at p+1)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ..cache.paged import OWNER


@dataclass(slots=True)   # slots: a wide batch makes B of them per call
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


# ProposerState's counters in its blocks' mirror row (cache.paged: one gather / scatter for a batch): the last
# run's offset (its row r holds position r + OFF, so OFF + rows is the next position; 0 with no rows), the row
# it starts at, and the drafts of the last propose
OFF, RUN0, DRAFTED = OWNER, OWNER + 1, OWNER + 2


class ProposerState:
    """Per-sequence drafter state: its drafter KV rows (`blocks`, a cache.SeqBlocks) and their positions.

    Row r holds RoPE position keys[r]. Positions come in runs of consecutive positions (a new run starts only
    where a proposer loaded without drafter context is given a later position than the next one); `runs`
    holds (first row, first position) of each, and the last run's offset and first row are mirrored, with
    the drafts of the last propose, in the blocks' mirror row, so a batch call checks and updates every
    sequence as arrays."""

    def __init__(self, blocks=None):
        self.blocks = blocks
        self.runs: list[tuple[int, int]] = []
        self.last_drafts: list[int] = []
        self.released = False

    def __repr__(self) -> str:
        return (f"ProposerState(rows={self.seq_len}, next_position={self.next_position}, "
                f"last_num_drafted={self.last_num_drafted}, released={self.released})")

    @property
    def seq_len(self) -> int:
        return self.blocks.rows if self.blocks is not None else 0

    @property
    def keys(self) -> list[int]:
        """The RoPE position of every drafter row, in row order (a new list)."""
        out, n = [], self.seq_len
        for i, (r0, p0) in enumerate(self.runs):
            r1 = self.runs[i + 1][0] if i + 1 < len(self.runs) else n
            out.extend(range(p0, p0 + r1 - r0))
        return out

    @property
    def newest_position(self) -> int:
        """The position of the newest drafter row (-1 before any)."""
        n = self.seq_len
        if not n:
            return -1
        r0, p0 = self.runs[-1]
        return p0 + n - 1 - r0

    @property
    def next_position(self) -> int:
        """The position the next row must have (with drafter context): newest_position + 1."""
        return self.newest_position + 1

    @property
    def last_pair_key(self) -> int | None:
        """The position of the newest row (None before any)."""
        p = self.newest_position
        return None if p < 0 else p

    @property
    def last_num_drafted(self) -> int:
        b = self.blocks
        return 0 if b is None or b.row is None else b.cache._cols.item(b.row, DRAFTED)

    @last_num_drafted.setter
    def last_num_drafted(self, d: int) -> None:
        b = self.blocks
        if b.row is not None:
            b.cache._cols[b.row, DRAFTED] = d

    def _extend(self, r0: int, position: int) -> None:
        """Rows from r0 on (the row count before they were written) hold positions position, position + 1, ..:
        a new run unless they continue the last one."""
        if self.runs:
            q0, p0 = self.runs[-1]
            if r0 > q0 and position == p0 + r0 - q0:
                return
        self.runs.append((r0, position))
        b = self.blocks
        b.cache._cols[b.row, OFF], b.cache._cols[b.row, RUN0] = position - r0, r0

    def _cut(self, rows: int) -> None:
        """The rows past `rows` are gone: drop the runs that started there (the mirror follows)."""
        while self.runs and self.runs[-1][0] >= rows:
            self.runs.pop()
        b = self.blocks
        if b.row is not None:   # no run left: offset 0, so OFF + rows is the next position (0) here too
            r0, p0 = self.runs[-1] if self.runs else (0, 0)
            b.cache._cols[b.row, OFF], b.cache._cols[b.row, RUN0] = p0 - r0, r0


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


def mtp_rows_to_trim_batch(num_drafted: np.ndarray, num_accepted: np.ndarray, refeed_accepted: bool) -> np.ndarray:
    """`mtp_rows_to_trim` over int arrays with 0 <= num_accepted <= num_drafted (what after_verify_batch has
    checked): the rejected d - a, plus with refeed every accepted row but the first, i.e. d - min(a, 1)."""
    return num_drafted - (np.minimum(num_accepted, 1) if refeed_accepted else num_accepted)
