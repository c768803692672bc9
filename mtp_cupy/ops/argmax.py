"""Launchers for cuda_src/argmax.cu (ties to the lowest id; NaN ranks below every number).

Workspace: a row split over several blocks meets in a small workspace (per-row counters that reset
themselves, then one partial per block). Pass `workspace=` (ARGMAX_WORKSPACE_BYTES, its first 1 KiB zeroed
once) or let the launcher use the zeroed one it allocates per device on the first call; nothing is allocated
later, so capturing after one warm-up call is safe. Launches on several streams at once need their own.

Both launch after the whole kernel ahead (`KernelLaunch.after_whole`): behind an LM head, blocks parked early
in their PDL wait took SM slots from the head and cost 2-7 us a step (H100, BENCHMARKS.md)."""
from __future__ import annotations

import weakref

from ..runtime.ptr import NULL, DevicePtr
from ._util import launch, need

__all__ = ["argmax", "argmax_bitmask", "ARGMAX_WORKSPACE_BYTES"]

_THREADS = 256
_MAX_ROWS = 256            # kernel MAX_ROWS: rows that may span several blocks
_MAX_BLOCKS = 128          # blocks per row (the kernel allows up to THREADS)
_BLOCK_BYTES = 256 * 16 * 4  # one block: 4 x 16-byte loads per thread, all in flight at once
ARGMAX_WORKSPACE_BYTES = 4 * _MAX_ROWS + 16 * _MAX_ROWS * _MAX_BLOCKS
_DTYPES = {"bf16": 2, "f32": 4}

_ws: "weakref.WeakKeyDictionary[object, object]" = weakref.WeakKeyDictionary()


def _workspace(gpu) -> DevicePtr:
    buf = _ws.get(gpu)
    if buf is None:
        buf = _ws[gpu] = gpu.alloc(ARGMAX_WORKSPACE_BYTES)
        gpu.fill(buf.ptr, ARGMAX_WORKSPACE_BYTES, 0)
    return buf.ptr


def _geometry(name, n, rows, row_stride, dtype, logits):
    need(dtype in _DTYPES, f"{name}: dtype {dtype!r} is not bf16/f32")
    need(1 <= n < 1 << 31, f"{name}: n {n} out of range")
    need(1 <= rows <= 65535, f"{name}: rows {rows} out of range")
    stride = n if row_stride is None else int(row_stride)
    need(rows == 1 or stride >= n, f"{name}: row_stride {stride} < n {n}")
    need(int(logits) % _DTYPES[dtype] == 0, f"{name}: logits are not {_DTYPES[dtype]}-byte aligned")
    blocks = 1 if rows > _MAX_ROWS else max(1, min(_MAX_BLOCKS, -(-n * _DTYPES[dtype] // _BLOCK_BYTES)))
    return stride, blocks


def argmax(gpu, logits, n, out_id, rows=1, row_stride=None, dtype="f32", out_val=NULL, out_lp=NULL, stream=None,
           *, workspace=None):
    """out_id[r] (i32) = argmax of logits row r (`logits + r * row_stride` elements); out_val[r] (f32) the max,
    out_lp[r] (f32) the top-1 log-prob max - logsumexp (NaN and -inf logits excluded), both optional."""
    lp = bool(out_lp)
    name = f"argmax_{dtype}" + ("_batch_lp" if lp else "_batch" if rows > 1 else "")
    stride, blocks = _geometry(name, n, rows, row_stride, dtype, logits)
    ws = DevicePtr(int(workspace)) if workspace else _workspace(gpu)
    k = launch(gpu, "argmax", name).grid(blocks, rows).block(_THREADS).arg_ptr(logits).arg_u32(n)
    if lp or rows > 1:
        k.arg_u32(rows).arg_u32(stride)
    k.arg_ptr(out_id).arg_ptr(out_val)
    if lp:
        k.arg_ptr(out_lp)
    k.arg_ptr(ws).after_whole().launch(stream)


def argmax_bitmask(gpu, logits, n, bitmask, out_id, out_flag, dtype="f32", rows=1, row_stride=None,
                   mask_row_words=0, stream=None, *, out_val=NULL, workspace=None):
    """argmax over the tokens whose bit is set (bit t % 32 of int32 word t // 32 of the row's mask, rows
    `mask_row_words` words apart; 0 = ceil(n / 32)). out_flag[r] = 1 and out_id[r] = 0 when no token is allowed."""
    name = "argmax_bitmask"
    stride, blocks = _geometry(name, n, rows, row_stride, dtype, logits)
    words = mask_row_words or -(-n // 32)
    need(words >= -(-n // 32), f"{name}: {words} mask words per row cannot cover {n} tokens")
    need(int(bitmask) % 4 == 0, f"{name}: bitmask is not 4-byte aligned")
    ws = DevicePtr(int(workspace)) if workspace else _workspace(gpu)
    launch(gpu, "argmax", name).grid(blocks, rows).block(_THREADS).arg_ptr(logits).arg_u32(dtype == "bf16") \
        .arg_u32(n).arg_u32(rows).arg_u32(stride).arg_ptr(bitmask).arg_u32(words).arg_ptr(out_id) \
        .arg_ptr(out_flag).arg_ptr(out_val).arg_ptr(ws).after_whole().launch(stream)
