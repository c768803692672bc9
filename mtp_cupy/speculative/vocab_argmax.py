"""Global argmax of a vocab-sharded LM head across N ranks (docs/architecture.md "Several GPUs").

Rank r sweeps its vocab slice [v0_r, v0_r + n) and takes the local argmax (id, value); the ranks then agree
on the winner, ties to the lower rank (= the lower token id, since slices ascend with the rank), with the
same answer on every rank so the ranks' drafter caches never diverge. Two exchanges:

* "digits" (the seed's, generalised to N): 4N BF16 lanes, one SUM all-reduce.
      lanes[r]                    = rank r's max value (bf16)
      lanes[N + 3r + d], d = 0..2 = digit d (base 256, low first) of rank r's global id
  every other lane zero. x + 0 is exact in bf16 and integers up to 256 are exact, so the sum delivers every
  rank's lanes untouched in any order; ids up to 2^24. The value must already be a bf16 (the head writes
  bf16 logits), else two ranks whose maxima round alike tie.
* "pairs" (vLLM / TRT-LLM): an 8-byte (f32 value, i32 id) pair per rank, one all-gather of bytes.

The host functions below are the layout's specification (and what tests check the kernels against);
`ShardedArgmax` is the device path a proposer runs each draft step."""
from __future__ import annotations

import numpy as np

from .. import ops
from ..errors import ConfigError, InputError
from ..runtime.arena import carve
from ..runtime.dtypes import BF16
from ..runtime.ptr import DevicePtr

MAX_ID = 1 << 24
EXCHANGES = ("digits", "pairs")


def lane_count(world: int) -> int:
    return 4 * int(world)


def pack_lanes(rank: int, world: int, value: float, token_id: int) -> np.ndarray:
    """Rank `rank`'s contribution: bf16 [4 * world], zeros outside its own lanes."""
    if not 0 <= rank < world:
        raise InputError(f"rank {rank} outside world {world}")
    if not 0 <= token_id < MAX_ID:
        raise InputError(f"token id {token_id} does not fit three base-256 digits (< 2^24)")
    v = np.zeros(lane_count(world), np.float32)
    v[rank] = value
    v[world + 3 * rank: world + 3 * rank + 3] = [(token_id >> (8 * d)) & 255 for d in range(3)]
    return v.astype(BF16)


def decode_lanes(lanes, world: int) -> tuple[int, int, float]:
    """(winning rank, its global id, its value) from the summed lanes; ties to the lower rank."""
    v = np.asarray(lanes).astype(np.float32).reshape(-1)
    if v.size != lane_count(world):
        raise InputError(f"{v.size} lanes for world {world}; expected {lane_count(world)}")
    best = 0
    for r in range(1, world):
        if v[r] > v[best]:
            best = r
    d = v[world + 3 * best: world + 3 * best + 3].astype(np.int64)
    return best, int(d[0] + (d[1] << 8) + (d[2] << 16)), float(v[best])


def pack_pair(value: float, token_id: int) -> np.ndarray:
    """u32 [2]: the f32 bits of value, then the id."""
    if not 0 <= token_id < 1 << 31:
        raise InputError(f"token id {token_id} does not fit i32")
    return np.array([np.float32(value).view(np.uint32), token_id], np.uint32)


def decode_pairs(pairs, world: int) -> tuple[int, int, float]:
    """(winning rank, id, value) from the gathered u32 [world, 2] pairs; ties to the lower rank."""
    p = np.asarray(pairs, np.uint32).reshape(world, 2)
    vals = p[:, 0].copy().view(np.float32)
    best = 0
    for r in range(1, world):
        if vals[r] > vals[best]:
            best = r
    return best, int(p[best, 1]), float(vals[best])


class ShardedArgmax:
    """The device path for up to `max_rows` sequences at once: the local argmax of each row of this rank's
    bf16 logits slice with its value, ONE exchange for all rows (row r's lanes or pair at its own offset), and
    the decode straight into the caller's i32 id slots (no host round trip)."""

    def __init__(self, gpu, comm, v0: int, n: int, exchange: str = "digits", max_rows: int = 1):
        if exchange not in EXCHANGES:
            raise ConfigError(f"head_exchange {exchange!r}: choose one of {', '.join(EXCHANGES)}")
        if v0 + n > MAX_ID and exchange == "digits":
            raise ConfigError(f"vocab end {v0 + n} needs more than three base-256 digits")
        self.gpu, self.comm, self.v0, self.n, self.exchange = gpu, comm, int(v0), int(n), exchange
        self.max_rows = R = int(max_rows)
        W = comm.world
        # local ids i32 [R], values f32 [R], lanes bf16 [R, 4W] or pairs u32 [R, 2], gathered pairs [W, R, 2]
        self._buf, p = carve(gpu, {"id": 4 * R, "val": 4 * R, "xchg": max(8 * W, 8) * R, "gathered": 8 * W * R})
        self.local_id, self.value, self.xchg, self.gathered = p["id"], p["val"], p["xchg"], p["gathered"]

    def local(self, logits: DevicePtr, rows: int = 1, stream=None) -> None:
        """Local argmax of each bf16 row of the slice (ties to the lowest id) and its value."""
        ops.argmax(self.gpu, logits, self.n, self.local_id, rows=rows, row_stride=self.n, dtype="bf16",
                   out_val=self.value, stream=stream)

    def exchange_into(self, out_id: DevicePtr, rows: int = 1, stream=None) -> None:
        """One exchange for all rows and the decode of each row's winner into out_id[r]."""
        if not 1 <= rows <= self.max_rows:
            raise InputError(f"sharded argmax sized for {self.max_rows} rows, got {rows}")
        gpu, comm, W = self.gpu, self.comm, self.comm.world
        if self.exchange == "digits":
            ops.pack_argmax_lanes(gpu, self.local_id, self.value, self.v0, comm.rank, W, self.xchg, rows, stream)
            comm.all_reduce(self.xchg, rows * lane_count(W), dtype="bf16", op="sum", stream=stream)
            ops.decode_argmax_lanes(gpu, self.xchg, W, out_id, rows, stream)
        else:
            ops.pack_argmax_pair(gpu, self.local_id, self.value, self.v0, self.xchg, rows, stream)
            comm.all_gather(self.xchg, self.gathered, 8 * rows, dtype="u8", stream=stream)
            ops.decode_argmax_pairs(gpu, self.gathered, W, out_id, rows, stream)

    def pick(self, logits: DevicePtr, out_id: DevicePtr, rows: int = 1, stream=None) -> None:
        self.local(logits, rows, stream)
        self.exchange_into(out_id, rows, stream)
