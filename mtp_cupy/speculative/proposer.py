"""The DraftProposer protocol a serving loop calls, the per-sequence state, and the trim rule.

Row/position model: drafter KV rows are dense (row r is the r-th row written); `position` is the RoPE
position the caller gives. A row at position p pairs the target's hidden at p with embed(token at p+1)."""
from __future__ import annotations

from collections.abc import Sequence
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
            self.tokens = [int(t) for t in _to_host(self.device_tokens, self.stream)]
            if self.device_logits is not None:
                self.logits = _to_host(self.device_logits, self.stream).astype(np.float32, copy=False)
        return self


def _to_host(a, stream) -> np.ndarray:
    """A device result array on the host: copied on `stream`, waiting for that stream only."""
    if isinstance(a, np.ndarray):
        return a
    out = a.get(stream=stream)
    if stream is not None:
        stream.synchronize()
    return out


class DraftBatch(Sequence):
    """The drafts of one `propose_batch` call: a sequence of B DraftResults in the batch's order (each made when
    first read) over the batch's own arrays, which a serving loop can also take whole.

    Attributes
    ----------
    tokens : int32 [B, k] host array (host results; None with device results until `host()`). A sequence that
        stopped early (min_logprob) holds -1 past its drafts.
    num_drafts : int64 [B], each sequence's drafts (k unless it stopped early).
    logprobs : float32 [B, k] top-1 log-probabilities when measured (min_logprob), else None.
    logits : float32 [B, k, vocab] host array with return_logits (-inf past mtp_vocab_size; made when read),
        else None.
    device_tokens, device_logits, ready, stream : device results (`device_results=True`), as DraftResult's for
        the whole batch: int32 [B, k] and float32 [B, k, vocab] arrays of their own on the proposer's device."""
    __slots__ = ("tokens", "logprobs", "device_tokens", "device_logits", "ready", "stream", "_n", "_k", "_done",
                 "_lg", "_vocab", "_items", "_logits")

    def __init__(self, n: int, k: int, tokens=None, done=None, lg=None, vocab: int = 0, logprobs=None,
                 device_tokens=None, device_logits=None, ready=None, stream=None):
        """`done`: int [B] drafts kept per sequence, or None (all k); `lg`: host logits as [k, B, V] (V <= vocab:
        padded with -inf per sequence when read)."""
        self._n, self._k, self.tokens, self._done, self._lg, self._vocab = n, k, tokens, done, lg, vocab
        self.logprobs, self.device_tokens, self.device_logits = logprobs, device_tokens, device_logits
        self.ready, self.stream, self._items, self._logits = ready, stream, [None] * n, None

    def __len__(self) -> int:
        return self._n

    def __repr__(self) -> str:
        return f"DraftBatch({self._n} sequences, {self._k} drafts{', on the device' if self.tokens is None else ''})"

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._n))]
        r = self._items[i]
        if r is None:
            r = self._items[i] = self._item(range(self._n)[i])
        return r

    def __iter__(self):
        for i in range(self._n):
            yield self[i]

    @property
    def num_drafts(self) -> np.ndarray:
        return np.full(self._n, self._k, np.int64) if self._done is None else self._done.copy()

    @property
    def logits(self) -> np.ndarray | None:
        if self._logits is None and self._lg is not None:   # made on first read, then kept
            out = np.full((self._n, self._k, self._vocab), -np.inf, np.float32)
            out[:, :, :self._lg.shape[2]] = self._lg.transpose(1, 0, 2)
            self._logits = out
        return self._logits

    def host(self) -> "DraftBatch":
        """Fill `tokens` (and `logits`) from the device arrays: copied on the proposer's stream, waiting for that
        stream only. Returns self."""
        if self.tokens is None and self.device_tokens is not None:
            self.tokens = _to_host(self.device_tokens, self.stream).astype(np.int32, copy=False)
            if self.device_logits is not None:
                self._lg = _to_host(self.device_logits, self.stream).astype(np.float32, copy=False).transpose(1, 0, 2)
        return self

    def _item(self, s: int) -> DraftResult:
        dt, dl = self.device_tokens, self.device_logits
        dev = {} if dt is None else {"device_tokens": dt[s], "device_logits": None if dl is None else dl[s],
                                     "ready": self.ready, "stream": self.stream}
        if self.tokens is None:
            return DraftResult(None, **dev)
        d = self._k if self._done is None else int(self._done[s])
        lg = None
        if self._lg is not None:
            lg = np.ascontiguousarray(self._lg[:d, s])
            if lg.shape[1] < self._vocab:
                lg = np.pad(lg, ((0, 0), (0, self._vocab - lg.shape[1])), constant_values=-np.inf)
        lp = None if self.logprobs is None else self.logprobs[s, :d].tolist()
        return DraftResult(self.tokens[s, :d].tolist(), lg, lp, **dev)


# ProposerState's counters in its blocks' mirror row (cache.paged: one gather / scatter for a batch): the last
# run's offset (its row r holds position r + OFF, so OFF + rows is the next position; 0 with no rows), the row
# it starts at, the drafts of the last propose not yet verified, and the drafts the last propose kept (its
# tokens: the owner's `_drafts[row]`, ProposerState.last_drafts)
OFF, RUN0, DRAFTED, LAST = OWNER, OWNER + 1, OWNER + 2, OWNER + 3


class ProposerState:
    """Per-sequence drafter state: its drafter KV rows (`blocks`, a cache.SeqBlocks) and their positions.

    Row r holds RoPE position keys[r]. Positions come in runs of consecutive positions (a new run starts only
    where a proposer loaded without drafter context is given a later position than the next one); `runs`
    holds (first row, first position) of each, and the last run's offset and first row are mirrored, with
    the drafts of the last propose, in the blocks' mirror row, so a batch call checks and updates every
    sequence as arrays."""

    def __init__(self, blocks=None, owner=None):
        self.blocks = blocks
        self.owner = owner   # the proposer (its `_drafts` [mirror rows, max_drafts] holds last_drafts)
        self.runs: list[tuple[int, int]] = []
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
    def last_drafts(self) -> list[int]:
        """The drafts of the last propose (host results), kept through after_verify; [] before any, after
        device results and after free_state."""
        b = self.blocks
        if b is None or b.row is None or self.owner is None:
            return []
        n = b.cache._cols.item(b.row, LAST)
        return self.owner._drafts[b.row, :n].tolist() if n else []

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
