"""Launchers for cuda_src/paged_attention.cu: a flash-decoding partial pass over row chunks, then a combine.

Workspace: the partial pass writes f32 partials (`attention_workspace_bytes`). Pass `workspace=` (a device
pointer of at least that many bytes) or let the launcher use one it allocates on the first call and keeps per
(device, power-of-two size class). Nothing is allocated afterwards, so a stream capture after one warm-up call
with the same shapes is safe. Launches on several streams at once need their own `workspace`."""
from __future__ import annotations

import math
import weakref

from ..runtime.ptr import NULL, DevicePtr
from ..runtime.slab import TABLE_OFFSET
from ._util import launch, need
from .kv_cache import fp8_block_layout

__all__ = ["gqa_decode", "mla_decode", "attention_workspace_bytes", "MAX_ROW_WIDTH", "MAX_HEAD_DIM"]

_HEADS = 32            # query heads per block (kernel HEADS)
_THREADS = 256
_MAX_SPLITS = 64       # kernel MAX_SPLITS
_MIN_CHUNK = 64        # positions per split at least: below this the partials cost more than they save
_TARGET_BLOCKS = 132   # one wave of one block per SM on an H200; seq_len lives on the device, so this is fixed
_COMBINE_THREADS = 128
MAX_ROW_WIDTH = 576    # dk: nine 16-wide k-steps per head-dim quarter (kernel MAX_KSTEPS)
MAX_HEAD_DIM = 512     # dv (and GQA head_dim): sixteen 8-wide n-tiles per quarter (kernel MAX_NTILES)

_ws: "weakref.WeakKeyDictionary[object, dict[int, object]]" = weakref.WeakKeyDictionary()


def _pad64(x: int) -> int:
    return -(-x // 64) * 64


def _smem_bytes(dk: int, dv: int, sep_v: bool, fp8: bool, stage_row: int | None = None) -> int:
    """Mirrors the shared-memory map above attend_split in paged_attention.cu (tiles padded to 64 columns;
    `stage_row`: the raw bytes per staged fp8 row, default dk (+ dv))."""
    nbf = 1 if fp8 else 2
    b = 4 * 32 * 40 * 4 + nbf * 32 * (_pad64(dk) + 8) * 2
    if sep_v:
        b += nbf * 32 * (_pad64(dv) + 8) * 2
    if fp8:
        b += 2 * 32 * (stage_row if stage_row is not None else dk + (dv if sep_v else 0))
    return b + 2 * 32 * 40 * 2 + 32 * 4 + 2 * 32 * 4


def _splits(num_seqs: int, head_blocks: int, invariant: bool = False) -> int:
    """Row chunks per sequence. Batch-invariant: chosen as for one sequence, so a sequence's chunking (and
    the combine order of its partials) does not depend on how many others run beside it."""
    seqs = 1 if invariant else num_seqs
    return max(1, min(_MAX_SPLITS, -(-_TARGET_BLOCKS // (seqs * head_blocks))))


def attention_workspace_bytes(num_seqs: int, heads: int, dv: int, head_blocks: int, invariant: bool = False) -> int:
    """Partials of `num_seqs` sequences: f32 [seqs, splits, heads, dv] + (m, l) [seqs, splits, heads, 2].
    head_blocks: ceil(heads / 32) for mla_decode, q_heads / min(32, q_heads // kv_heads) for gqa_decode."""
    return 4 * num_seqs * _splits(num_seqs, head_blocks, invariant) * heads * (dv + 2)


def _workspace(gpu, nbytes: int) -> DevicePtr:
    size = 1 << max(20, (nbytes - 1).bit_length())
    per = _ws.setdefault(gpu, {})
    if size not in per:
        per[size] = gpu.alloc(size)
    return per[size].ptr


def _prepare(gpu, name: str, num_seqs: int, heads: int, dv: int, head_blocks: int, smem: int, workspace,
             invariant: bool):
    """The partial-pass launch with its geometry set, and where its partials go."""
    splits = _splits(num_seqs, head_blocks, invariant)
    ws = DevicePtr(int(workspace)) if workspace else \
        _workspace(gpu, attention_workspace_bytes(num_seqs, heads, dv, head_blocks, invariant))
    k = launch(gpu, "paged_attention", name)
    k.grid(splits, head_blocks, num_seqs).block(_THREADS).shared(smem)
    return k, ws, ws.offset(4 * num_seqs * splits * heads * dv), splits


def _combine(gpu, ws, ws_ml, sink, out, num_seqs, heads, dv, splits, stream):
    launch(gpu, "paged_attention", "attn_combine").grid(heads, num_seqs).block(_COMBINE_THREADS) \
        .arg_ptr(ws).arg_ptr(ws_ml).arg_ptr(sink).arg_ptr(out).arg_u32(num_seqs).arg_u32(heads).arg_u32(dv) \
        .arg_u32(splits).launch(stream)


def _check_common(name: str, meta, meta_stride: int, num_seqs: int, scale: float) -> None:
    need(meta_stride >= TABLE_OFFSET and meta_stride % 4 == 0,
         f"{name}: meta_stride {meta_stride} must be >= {TABLE_OFFSET} and 4-aligned")
    need(0 <= num_seqs <= 65535, f"{name}: num_seqs {num_seqs} out of range")
    need(int(meta) % 4 == 0, f"{name}: metadata must be 4-byte aligned")
    need(math.isfinite(scale), f"{name}: scale {scale} is not finite")


def gqa_decode(gpu, q, q_row_stride, k_cache, v_cache, meta, meta_stride, out, num_seqs, q_heads, kv_heads,
               head_dim, scale, kv_dtype="bf16", kv_scale=1.0, stream=None, *, workspace=None, invariant=False):
    """Decode attention for num_seqs sequences, one query row each: q bf16 at `q + s*q_row_stride + h*head_dim`
    (elements); q head h reads KV head h // (q_heads // kv_heads) of the k/v caches (rows of kv_heads*head_dim,
    bf16, or fp8 e4m3 times kv_scale), over all seq_len rows of the sequence's slab (meta + s*meta_stride).
    out bf16 [num_seqs, q_heads, head_dim]."""
    name = "gqa_decode_partial" + ("_fp8" if kv_dtype == "fp8" else "")
    _check_common(name, meta, meta_stride, num_seqs, scale)
    need(kv_dtype in ("bf16", "fp8"), f"{name}: kv_dtype {kv_dtype!r} is not bf16/fp8")
    need(kv_heads >= 1 and q_heads >= kv_heads and q_heads % kv_heads == 0,
         f"{name}: q_heads {q_heads} is not a multiple of kv_heads {kv_heads}")
    group = q_heads // kv_heads
    hpb = min(group, _HEADS)
    need(group % hpb == 0, f"{name}: a GQA group of {group} heads must be <= 32 or a multiple of 32")
    step = 16 if kv_dtype == "fp8" else 8
    need(head_dim % step == 0 and step <= head_dim <= MAX_HEAD_DIM,
         f"{name}: head_dim {head_dim} must be a multiple of {step} in [{step}, {MAX_HEAD_DIM}]")
    need(q_row_stride % 2 == 0 and int(q) % 4 == 0, f"{name}: q rows must be 4-byte aligned (stride {q_row_stride})")
    need(int(k_cache) % 16 == 0 and int(v_cache) % 16 == 0, f"{name}: k/v caches must be 16-byte aligned")
    if num_seqs == 0:
        return
    blocks = q_heads // hpb
    k, ws, ws_ml, splits = _prepare(gpu, name, num_seqs, q_heads, head_dim, blocks,
                                    _smem_bytes(head_dim, head_dim, True, kv_dtype == "fp8"), workspace, invariant)
    k.arg_ptr(q).arg_u32(q_row_stride).arg_ptr(k_cache).arg_ptr(v_cache).arg_ptr(meta).arg_u32(meta_stride) \
        .arg_ptr(ws).arg_ptr(ws_ml).arg_u32(num_seqs).arg_u32(q_heads).arg_u32(kv_heads).arg_u32(head_dim) \
        .arg_f32(scale).arg_f32(kv_scale).arg_u32(splits).arg_u32(_MIN_CHUNK).launch(stream)
    _combine(gpu, ws, ws_ml, NULL, out, num_seqs, q_heads, head_dim, splits, stream)


def mla_decode(gpu, q, cache, meta, meta_stride, out, num_seqs, heads, row_width, v_width, scale, window=0,
               sink=NULL, sel=NULL, sel_stride=0, kv_dtype="bf16", nope=0, stream=None, *, workspace=None,
               invariant=False):
    """Single-KV-head decode attention (MLA latent 576 / V4 512): q bf16 [num_seqs, heads, row_width] against
    cache rows of row_width columns; value = the first v_width columns of each row. kv_dtype "bf16": rows of
    row_width bf16; "fp8": DeepSeek-V4's blocked rows (`ops.kv_cache.fp8_block_layout(row_width, nope)`:
    columns [0, nope) e4m3 in 64-blocks with UE8M0 scales, the rest bf16). window > 0: only the last `window`
    rows; sink f32 [heads]: exp(sink_h) joins the denominator; sel i32 [num_seqs, sel_stride]: only those
    logical rows (-1 or rows outside [0, seq_len) / the window are skipped). out bf16 [num_seqs, heads,
    v_width]; a sequence that attends nothing gets zeros. Widths need not be multiples of the kernel's
    64-column tile (multiples of 8)."""
    fp8 = kv_dtype == "fp8"
    name = "mla_decode_partial" + ("_fp8" if fp8 else "")
    _check_common(name, meta, meta_stride, num_seqs, scale)
    need(kv_dtype in ("bf16", "fp8"), f"{name}: kv_dtype {kv_dtype!r} is not bf16/fp8")
    need(heads >= 1, f"{name}: heads {heads} must be >= 1")
    need(row_width % 8 == 0 and 8 <= row_width <= MAX_ROW_WIDTH,
         f"{name}: row_width {row_width} must be a multiple of 8 in [8, {MAX_ROW_WIDTH}]")
    need(v_width % 8 == 0 and 8 <= v_width <= min(row_width, MAX_HEAD_DIM),
         f"{name}: v_width {v_width} must be a multiple of 8 in [8, min(row_width, {MAX_HEAD_DIM})]")
    need(not fp8 or 0 < nope <= row_width, f"{name}: nope {nope} must be in [1, row_width {row_width}]")
    need(window >= 0, f"{name}: window {window} < 0")
    need(not sel or sel_stride >= 1, f"{name}: sel needs sel_stride >= 1")
    need(int(q) % 4 == 0 and int(cache) % 16 == 0, f"{name}: q must be 4-byte and the cache 16-byte aligned")
    if num_seqs == 0:
        return
    blocks = -(-heads // _HEADS)
    stage = fp8_block_layout(row_width, nope)[2] if fp8 else None
    k, ws, ws_ml, splits = _prepare(gpu, name, num_seqs, heads, v_width, blocks,
                                    _smem_bytes(row_width, v_width, False, fp8, stage), workspace, invariant)
    k.arg_ptr(q).arg_ptr(cache).arg_ptr(meta).arg_u32(meta_stride).arg_ptr(ws).arg_ptr(ws_ml).arg_u32(num_seqs) \
        .arg_u32(heads).arg_u32(row_width).arg_u32(v_width).arg_f32(scale).arg_u32(window).arg_ptr(sel) \
        .arg_u32(sel_stride if sel else 0).arg_u32(splits).arg_u32(_MIN_CHUNK)
    if fp8:
        k.arg_u32(nope)
    k.launch(stream)
    _combine(gpu, ws, ws_ml, sink, out, num_seqs, heads, v_width, splits, stream)
