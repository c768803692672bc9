"""Launchers for cuda_src/call_io.cu: a propose's inputs brought into its chain, and its drafts handed out, by
kernels that read and write mapped host memory (Backend.alloc_mapped), so a graph needs no copy node or call."""
import numpy as np

from ._util import THREADS, blocks_for, launch, need

__all__ = ["CTL_BYTES", "OUTBOX_HEAD", "up16", "fetch_words", "write_ctl", "call_stage_in", "call_publish"]

CTL_BYTES = 16    # struct CallCtl: seq u32, hidden16 u32, hidden_src u64
OUTBOX_HEAD = 4   # u32 words before the outbox's ids: the seq, then padding to 16 bytes
STAGE_BLOCKS = 512   # most blocks of call_stage_in (a V4 batch of 64 hiddens is 131,072 words: 1 round)


def up16(n: int) -> int:
    """`n` bytes rounded up to whole 16-byte words."""
    return -(-int(n) // 16) * 16


def fetch_words(src: int, nbytes: int) -> int:
    """The 16-byte words call_stage_in may fetch for `nbytes` of device rows at `src`: all of them when both are
    16-byte aligned, else 0 (the caller copies them instead)."""
    return nbytes // 16 if int(src) % 16 == 0 and nbytes % 16 == 0 else 0


def write_ctl(ctl: np.ndarray, seq: int, hidden16: int = 0, hidden_src: int = 0) -> None:
    """Fill a CallCtl (`ctl`: its CTL_BYTES of mapped host memory viewed as two uint64 words, little-endian):
    the call's seq, and `hidden16` 16-byte words of device rows at `hidden_src` for call_stage_in to fetch (0:
    none)."""
    need(0 <= seq < 1 << 32 and 0 <= hidden16 < 1 << 32, f"write_ctl: seq {seq} or {hidden16} words out of range")
    ctl[0] = seq | hidden16 << 32
    ctl[1] = hidden_src


def call_stage_in(gpu, stage, call_in, nbytes, ctl, hidden_dst, seq, hidden_bytes=0, stream=None):
    """call_in[:nbytes] = stage[:nbytes] (mapped host memory), the rows the CallCtl at `ctl` names into
    `hidden_dst`, and its seq into the device word `seq`. `hidden_bytes`: the most that CallCtl may name (the
    grid covers it; a graph replays this grid for every call of its key). Sizes in multiples of 16 bytes;
    every address 16-byte aligned."""
    need(nbytes % 16 == 0 and hidden_bytes % 16 == 0, f"call_stage_in: {nbytes} and {hidden_bytes} bytes must be "
         "multiples of 16")
    need(0 < nbytes < 1 << 35 and 0 <= hidden_bytes < 1 << 35, f"call_stage_in: {nbytes} / {hidden_bytes} bytes "
         "out of range")
    need(all(int(p) % 16 == 0 for p in (stage, call_in, ctl, hidden_dst)),
         "call_stage_in: stage, call_in, ctl and hidden_dst must be 16-byte aligned")
    words = max(nbytes, hidden_bytes) // 16
    launch(gpu, "call_io", "call_stage_in").grid(blocks_for(words, cap=STAGE_BLOCKS)).block(THREADS) \
        .arg_ptr(stage).arg_ptr(call_in).arg_u32(nbytes // 16).arg_ptr(ctl).arg_ptr(hidden_dst).arg_ptr(seq) \
        .launch(stream)


def call_publish(gpu, ids, flags, lps, n, outbox, seq, stream=None):
    """Into the outbox (mapped host memory, u32 words): ids [n] (and flags [n], lps [n] where given, else None)
    after OUTBOX_HEAD words, then word 0 = the device word `seq`, last."""
    need(1 <= n < 1 << 24, f"call_publish: {n} words out of range")
    launch(gpu, "call_io", "call_publish").grid(1).block(THREADS).arg_ptr(ids).arg_ptr(flags or 0) \
        .arg_ptr(lps or 0).arg_u32(n).arg_ptr(outbox).arg_ptr(seq).launch(stream)
