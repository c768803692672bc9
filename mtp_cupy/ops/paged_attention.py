"""Launchers for cuda_src/paged_attention.cu: flash-decoding over `splits` row chunks per sequence, merged in
split order. Two modes with the same bits for the same splits: split mode runs one block per (split, head
block, sequence) writing f32 partials, then `attn_combine`; walk mode runs one block per (head block, sequence)
that walks its splits in order and merges them itself (no workspace, fewer blocks: for large batches).

Workspace (split mode only): the partial pass writes f32 partials (`attention_workspace_bytes`). Pass
`workspace=` (a device pointer of at least that many bytes) or let the launcher use one it allocates on the
first call and keeps per (device, power-of-two size class). Nothing is allocated afterwards, so a stream capture
after one warm-up call with the same shapes is safe. Launches on several streams at once need their own
`workspace`."""
from __future__ import annotations

import math

from ..runtime.ptr import NULL, DevicePtr
from ..runtime.slab import TABLE_OFFSET
from ._util import kept_workspace, launch, need
from .kv_cache import fp8_block_layout
from .elementwise import sigmoid_gate_mul

__all__ = ["gqa_decode", "mla_decode", "attention_workspace_bytes", "MAX_ROW_WIDTH", "MAX_HEAD_DIM"]

_HEADS = 32            # query heads per block (kernel HEADS)
_TILE = 32             # cache rows per tile (kernel TILE); chunks are whole tiles
_THREADS = 256
_MAX_SPLITS = 64       # kernel MAX_SPLITS
# Positions per split at least (whole 32-row tiles). A split block's fixed costs (Q, the ring's fill, its
# partials) are about a tile's work, so 4-tile chunks beat 2-tile ones from 8 sequences up and cost at most
# 1.4 µs for one (H100, ctx 2049: DeepSeek-V3 split mode at B = 8 105 -> 74 µs, B = 1 24.9 -> 24.7, GLM-5 B = 1
# 27.0 -> 28.4; the walk at B = 64 331 -> 322). A window (DeepSeek-V4's 128 rows) takes 1-tile chunks: its four
# splits' blocks run side by side (H100, split mode: 2-tile chunks over 66 splits 24.0 µs at B = 1 and 26.1 at
# B = 8; 1-tile chunks over the four splits `_splits` keeps 13.6 and 15.8; 4-tile chunks, one split, 31.1).
_MIN_CHUNK = 128
_MIN_CHUNK_WINDOW = 32
_TARGET_BLOCKS = 132   # one wave of one block per SM on an H200; seq_len lives on the device, so this is fixed
# Splits a split-mode block takes at most (`_group`). A partial block's tiles run about twice as long as the walk's
# (not yet known why; Q in registers rather than shared memory is the lead), so long chains of them lose: DeepSeek-V3
# at 16 sequences took 125 µs with one split a block and 166 with 8 (H200 under ncu); 2 and 4 won wherever chosen.
_MAX_GROUP = 4
_COMBINE_THREADS = 128
# walk=None's cost model (`_walks`), in units of one split's work, for sequences of _REF_ROWS rows (the benchmarks'
# ctx; seq_len lives on the device): a walk block pays 0.69 of a split for each split it walks; split mode pays G
# for each wave of its blocks with rows (G splits a block, `_group`) and ~0.15 of a split for each empty block. A
# grouped split-mode block's tiles run at one split's pace per split (H100, ctx 2048: DeepSeek-V3 ~14.5 µs a unit
# at G = 1, 2 and 4), so the waves of grouped blocks, not of splits, set the count. The constants were fitted at
# G = 1 (4-tile chunks); the H100 points the model must order are `_MEASURED` in tests/test_paged_attention.py.
_REF_ROWS = 2048
_WALK_SPLIT_COST = 0.69
_EMPTY_SPLIT_COST = 0.15
MAX_ROW_WIDTH = 576    # dk: nine 16-wide k-steps per head-dim quarter (kernel MAX_KSTEPS)
MAX_HEAD_DIM = 512     # dv (and GQA head_dim): sixteen 8-wide n-tiles per quarter (kernel MAX_NTILES)


def _pad64(x: int) -> int:
    return -(-x // 64) * 64


# The widths the kernels compile as constants (mla_entry / gqa_entry): (dk, dv) per (GQA?, fp8?). The walk
# kernels keep Q in shared memory at those widths.
_FIXED = {(False, False): (576, 512), (False, True): (512, 512), (True, False): (256, 256), (True, True): (256, 256)}


def _smem_bytes(dk: int, dv: int, sep_v: bool, fp8: bool, stage_row: int | None = None, walk: bool = False) -> int:
    """Mirrors the shared-memory map above attend in paged_attention.cu (tiles padded to 64 columns, a
    three-buffer ring; `stage_row`: the raw bytes per staged fp8 row, default dk (+ dv); sep_v: GQA)."""
    nbf = 1 if fp8 else 3
    b = 4 * 32 * 40 * 4 + nbf * 32 * (_pad64(dk) + 8) * 2
    if sep_v:
        b += nbf * 32 * (_pad64(dv) + 8) * 2
    if fp8:
        b += 3 * 32 * (stage_row if stage_row is not None else dk + (dv if sep_v else 0))
    b += 2 * 32 * 40 * 2 + 32 * 4 + 3 * 32 * 4 + 32 * 2 * 4
    if walk and _FIXED[(sep_v, fp8)] == (dk, dv):
        b += 32 * (_pad64(dk) + 8) * 2
    return b


def _min_chunk(window: int) -> int:
    """The kernels' `min_chunk` for a call: a function of the call's family shape only, never of the batch."""
    return _MIN_CHUNK_WINDOW if window > 0 else _MIN_CHUNK


def chunk_rows(n: int, splits: int, min_chunk: int) -> int:
    """Positions per split of a sequence attending n positions (the kernels' rule): whole 32-row tiles, at least
    min_chunk, few enough for `splits` chunks."""
    return -(-max(min_chunk, -(-n // splits)) // _TILE) * _TILE


def _splits(num_seqs: int, head_blocks: int, invariant: bool = False, span: int = 0,
            min_chunk: int = _MIN_CHUNK) -> int:
    """Row chunks per sequence. Batch-invariant: chosen as for one sequence, so a sequence's chunking (and
    the combine order of its partials) does not depend on how many others run beside it. span > 0: no sequence
    walks more than span positions (a window, or DSA's selection row); where min_chunk sets the chunk of a
    span-long sequence, the count drops to the splits such a sequence fills, which leaves every sequence's chunk
    (min_chunk) and so its bits as they were, and launches no split block that could only be empty (V4's window:
    4 splits, not 66)."""
    seqs = 1 if invariant else max(1, num_seqs)   # no sequences: a call that launches nothing
    s = max(1, min(_MAX_SPLITS, -(-_TARGET_BLOCKS // (seqs * head_blocks))))
    if span > 0 and -(-span // s) <= min_chunk:
        s = -(-span // min_chunk)
    return s


def attention_workspace_bytes(num_seqs: int, heads: int, dv: int, head_blocks: int, invariant: bool = False,
                              span: int = 0, min_chunk: int = _MIN_CHUNK) -> int:
    """Split mode's partials of `num_seqs` sequences: f32 [seqs, splits, heads, dv] + (m, l) [seqs, splits,
    heads, 2]. head_blocks: ceil(heads / 32) for mla_decode, q_heads / min(32, q_heads // kv_heads) for
    gqa_decode; span, min_chunk: as `_splits` (0: unbounded; the bytes without them cover any call). Walk mode
    uses none (a `workspace=` passed to a call that walks is left untouched)."""
    need(span >= 0 and min_chunk >= 1, f"attention_workspace_bytes: span {span} must be >= 0 and min_chunk "
         f"{min_chunk} >= 1")
    return _partials_bytes(num_seqs, _splits(num_seqs, head_blocks, invariant, span, min_chunk), heads, dv)


def _partials_bytes(num_seqs: int, splits: int, heads: int, dv: int) -> int:
    """f32 O partials [seqs, splits, heads, dv], then their (m, l) [seqs, splits, heads, 2]."""
    return 4 * num_seqs * splits * heads * (dv + 2)


def _walks(name: str, walk, invariant: bool, num_seqs: int, head_blocks: int, bound: int = 0,
           min_chunk: int = _MIN_CHUNK, span: int = 0, group=None) -> bool:
    """The mode: `walk` if given, else (batch-invariant calls only: the non-invariant split count already shrinks
    as the batch grows) whichever the cost model says is faster for sequences of _REF_ROWS rows. Split mode:
    waves of the blocks with rows, G splits each (`_group`; `group` as the launchers take it), plus the empty
    blocks; walk mode: waves of (head block, sequence) blocks, each walking every split with rows. `bound` > 0: no
    sequence attends more positions than that (the window, or DSA's selection); `span`: as `_splits`. Splits with
    rows follow the kernels' chunk rule (V3: 16 of 33; V4's 128-row window: 4 of 4)."""
    need(walk is None or isinstance(walk, bool), f"{name}: walk {walk!r} must be None, True or False")
    if walk is not None:
        return walk
    if not invariant or num_seqs == 0:
        return False
    splits = _splits(num_seqs, head_blocks, True, span, min_chunk)
    used = _used(splits, bound, min_chunk)
    g = _group(name, group, num_seqs, head_blocks, splits, bound, min_chunk)
    blocks, full, grid = num_seqs * head_blocks, -(-used // g), -(-splits // g)
    split_cost = -(-blocks * full // _TARGET_BLOCKS) * g + _EMPTY_SPLIT_COST * blocks * (grid - full) / _TARGET_BLOCKS
    return -(-blocks // _TARGET_BLOCKS) * used * _WALK_SPLIT_COST < split_cost


def _used(splits: int, bound: int, min_chunk: int) -> int:
    """Splits with rows of a sequence of _REF_ROWS rows (fewer under a bound of attended positions)."""
    n = min(bound, _REF_ROWS) if bound > 0 else _REF_ROWS
    return min(splits, -(-n // chunk_rows(n, splits, min_chunk)))


def _group(name: str, group, num_seqs: int, head_blocks: int, splits: int, bound: int, min_chunk: int) -> int:
    """Splits a split-mode block takes in turn (each partial is the same whichever block computes it, so this
    moves no bit): `group` if given, else the fewest that fit the blocks with rows, for sequences of _REF_ROWS
    rows, in one wave (V3's 4 head blocks: 1 up to 2 sequences, 4 at 8), at most _MAX_GROUP, not one block a
    split over several waves."""
    need(group is None or (isinstance(group, int) and not isinstance(group, bool) and group >= 1),
         f"{name}: group {group!r} must be None or an int >= 1")
    if group is not None:
        return min(group, splits)
    used, blocks = _used(splits, bound, min_chunk), max(1, num_seqs * head_blocks)
    cap = min(used, _MAX_GROUP)
    return next((g for g in range(1, cap) if blocks * -(-used // g) <= _TARGET_BLOCKS), cap)


def _prepare(gpu, name: str, num_seqs: int, heads: int, dv: int, head_blocks: int, smem: int, workspace,
             splits: int, group: int):
    """The partial-pass launch of `splits` splits, `group` a block, with its geometry set, and where its
    partials go (`_partials_bytes`)."""
    ws = DevicePtr(int(workspace)) if workspace else \
        kept_workspace(gpu, "attention", _partials_bytes(num_seqs, splits, heads, dv))
    k = launch(gpu, "paged_attention", name)
    k.grid(-(-splits // group), head_blocks, num_seqs).block(_THREADS).shared(smem)
    return k, ws, ws.offset(4 * num_seqs * splits * heads * dv)


def _prepare_walk(gpu, name: str, num_seqs: int, head_blocks: int, smem: int):
    """The walk launch with its geometry set."""
    k = launch(gpu, "paged_attention", name)
    k.grid(1, head_blocks, num_seqs).block(_THREADS).shared(smem)
    return k


def _combine(gpu, ws, ws_ml, sink, out, num_seqs, heads, dv, splits, stream, out_gate=None):
    gate, grs, ghs = (NULL, 0, 0) if out_gate is None else out_gate
    launch(gpu, "paged_attention", "attn_combine").grid(heads, num_seqs).block(_COMBINE_THREADS) \
        .arg_ptr(ws).arg_ptr(ws_ml).arg_ptr(sink).arg_ptr(out).arg_u32(num_seqs).arg_u32(heads).arg_u32(dv) \
        .arg_u32(splits).arg_ptr(gate).arg_u32(grs).arg_u32(ghs).launch(stream)


def _check_common(name: str, meta, meta_stride: int, num_seqs: int, scale: float) -> None:
    need(meta_stride >= TABLE_OFFSET and meta_stride % 4 == 0,
         f"{name}: meta_stride {meta_stride} must be >= {TABLE_OFFSET} and 4-aligned")
    need(0 <= num_seqs <= 65535, f"{name}: num_seqs {num_seqs} out of range")
    need(int(meta) % 4 == 0, f"{name}: metadata must be 4-byte aligned")
    need(math.isfinite(scale), f"{name}: scale {scale} is not finite")


def gqa_decode(gpu, q, q_row_stride, k_cache, v_cache, meta, meta_stride, out, num_seqs, q_heads, kv_heads,
               head_dim, scale, kv_dtype="bf16", kv_scale=1.0, stream=None, *, workspace=None, invariant=False,
               walk=None, out_gate=None, group=None):
    """Decode attention for num_seqs sequences, one query row each.

    Parameters
    ----------
    q, q_row_stride : bf16 query rows, head h of sequence s at `q + s*q_row_stride + h*head_dim` (elements).
    k_cache, v_cache : rows of kv_heads*head_dim, bf16 or (kv_dtype "fp8") e4m3 times kv_scale; q head h reads
        KV head h // (q_heads // kv_heads), over all seq_len rows of the sequence's slab (meta + s*meta_stride).
    out : bf16 [num_seqs, q_heads, head_dim].
    workspace : split mode's partials (`attention_workspace_bytes`); None = one kept by the launcher.
    invariant : choose the split count as for one sequence, so a sequence's bits do not depend on the batch.
    walk : None (choose for invariant calls by the cost model of `_walks`: walk 34 to 66 Qwen3-Next
        sequences and from 77), True (one block per (head block, sequence) walks the splits; no workspace) or
        False (split mode). The same bits either way.
    out_gate : (gate, gate_row_stride, gate_head_stride) or None. Qwen3-Next's output gate: out[s, h, d] *=
        sigmoid(gate[s * gate_row_stride + h * gate_head_stride + d]) (bf16 gate, strides in elements), inside the
        combine in split mode, by a sigmoid_gate_mul launch after the walk: the bits of the call without it then
        `sigmoid_gate_mul`.
    group : None (the fewest splits a split-mode block takes in turn that put the blocks with rows in one wave,
        `_group`) or an int >= 1. Each split's partial is the same whichever block computes it: no bit moves.
    """
    name = "gqa_decode_partial" + ("_fp8" if kv_dtype == "fp8" else "")
    _check_common(name, meta, meta_stride, num_seqs, scale)
    need(kv_dtype in ("bf16", "fp8"), f"{name}: kv_dtype {kv_dtype!r} is not bf16/fp8")
    need(kv_heads >= 1 and q_heads >= kv_heads and q_heads % kv_heads == 0,
         f"{name}: q_heads {q_heads} is not a multiple of kv_heads {kv_heads}")
    per_kv = q_heads // kv_heads   # q heads per KV head (not `group`: that is the splits a block takes)
    hpb = min(per_kv, _HEADS)
    need(per_kv % hpb == 0, f"{name}: a GQA group of {per_kv} heads must be <= 32 or a multiple of 32")
    step = 16 if kv_dtype == "fp8" else 8
    need(head_dim % step == 0 and step <= head_dim <= MAX_HEAD_DIM,
         f"{name}: head_dim {head_dim} must be a multiple of {step} in [{step}, {MAX_HEAD_DIM}]")
    need(q_row_stride % 2 == 0 and int(q) % 4 == 0, f"{name}: q rows must be 4-byte aligned (stride {q_row_stride})")
    need(int(k_cache) % 16 == 0 and int(v_cache) % 16 == 0, f"{name}: k/v caches must be 16-byte aligned")
    blocks = q_heads // hpb
    mc = _min_chunk(0)
    walks = _walks(name, walk, invariant, num_seqs, blocks, min_chunk=mc, group=group)
    splits = _splits(num_seqs, blocks, invariant)
    g = _group(name, group, num_seqs, blocks, splits, 0, mc)
    if num_seqs == 0:
        return
    smem = _smem_bytes(head_dim, head_dim, True, kv_dtype == "fp8", walk=walks)
    if out_gate is not None:
        need(int(out_gate[0]) != 0, f"{name}: out_gate needs a gate pointer")
    if walks:
        k = _prepare_walk(gpu, name.replace("_partial", "_walk"), num_seqs, blocks, smem)
        k.arg_ptr(q).arg_u32(q_row_stride).arg_ptr(k_cache).arg_ptr(v_cache).arg_ptr(meta).arg_u32(meta_stride) \
            .arg_ptr(out).arg_u32(num_seqs).arg_u32(q_heads).arg_u32(kv_heads).arg_u32(head_dim).arg_f32(scale) \
            .arg_f32(kv_scale).arg_u32(splits).arg_u32(mc).launch(stream)
        if out_gate is not None:
            sigmoid_gate_mul(gpu, out, out_gate[0], out, num_seqs, q_heads, head_dim, out_gate[1], out_gate[2],
                             stream=stream)
        return
    k, ws, ws_ml = _prepare(gpu, name, num_seqs, q_heads, head_dim, blocks, smem, workspace, splits, g)
    k.arg_ptr(q).arg_u32(q_row_stride).arg_ptr(k_cache).arg_ptr(v_cache).arg_ptr(meta).arg_u32(meta_stride) \
        .arg_ptr(ws).arg_ptr(ws_ml).arg_u32(num_seqs).arg_u32(q_heads).arg_u32(kv_heads).arg_u32(head_dim) \
        .arg_f32(scale).arg_f32(kv_scale).arg_u32(splits).arg_u32(mc).launch(stream)
    _combine(gpu, ws, ws_ml, NULL, out, num_seqs, q_heads, head_dim, splits, stream, out_gate=out_gate)


def mla_decode(gpu, q, cache, meta, meta_stride, out, num_seqs, heads, row_width, v_width, scale, window=0,
               sink=NULL, sel=NULL, sel_stride=0, kv_dtype="bf16", nope=0, stream=None, *, workspace=None,
               invariant=False, walk=None, group=None):
    """Single-KV-head decode attention (MLA latent 576 / V4 512).

    Parameters
    ----------
    q : bf16 [num_seqs, heads, row_width], against cache rows of row_width columns; value = the first v_width
        columns of each row. Widths need not be multiples of the kernel's 64-column tile (multiples of 8).
    kv_dtype : "bf16": rows of row_width bf16; "fp8": DeepSeek-V4's blocked rows
        (`ops.kv_cache.fp8_block_layout(row_width, nope)`: columns [0, nope) e4m3 in 64-blocks with UE8M0
        scales, the rest bf16).
    window : > 0: only the last `window` rows.
    sink : f32 [heads] or NULL: exp(sink_h) joins the denominator.
    sel, sel_stride : i32 [num_seqs, sel_stride] or NULL: only those logical rows (-1 or rows outside
        [0, seq_len) / the window are skipped).
    out : bf16 [num_seqs, heads, v_width]; a sequence that attends nothing gets zeros.
    workspace : split mode's partials (`attention_workspace_bytes`); None = one kept by the launcher.
    invariant : choose the split count as for one sequence, so a sequence's bits do not depend on the batch.
    walk : None (choose for invariant calls by the cost model of `_walks`: DeepSeek-V3 walks 17 to 33
        sequences and from 42, GLM-5 34 to 66 and from 83, the windowed V4 from 34), True (one block per (head
        block, sequence) walks the splits; no workspace) or False (split mode). The same bits either way.
    group : None or an int >= 1, as in `gqa_decode`.
    """
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
    blocks = -(-heads // _HEADS)
    bound = min((b for b in (window, sel_stride if sel else 0) if b > 0), default=0)   # positions attended, at most
    span = sel_stride if sel else window   # positions walked, at most (DSA walks its whole selection row)
    mc = _min_chunk(window)
    walks = _walks(name, walk, invariant, num_seqs, blocks, bound, min_chunk=mc, span=span, group=group)
    splits = _splits(num_seqs, blocks, invariant, span, mc)
    g = _group(name, group, num_seqs, blocks, splits, bound, mc)
    if num_seqs == 0:
        return
    stage = fp8_block_layout(row_width, nope)[2] if fp8 else None
    smem = _smem_bytes(row_width, v_width, False, fp8, stage, walks)
    if walks:
        k = _prepare_walk(gpu, name.replace("_partial", "_walk"), num_seqs, blocks, smem)
        k.arg_ptr(q).arg_ptr(cache).arg_ptr(meta).arg_u32(meta_stride).arg_ptr(sink).arg_ptr(out) \
            .arg_u32(num_seqs).arg_u32(heads).arg_u32(row_width).arg_u32(v_width).arg_f32(scale).arg_u32(window) \
            .arg_ptr(sel).arg_u32(sel_stride if sel else 0).arg_u32(splits).arg_u32(mc)
        if fp8:
            k.arg_u32(nope)
        k.launch(stream)
        return
    k, ws, ws_ml = _prepare(gpu, name, num_seqs, heads, v_width, blocks, smem, workspace, splits, g)
    k.arg_ptr(q).arg_ptr(cache).arg_ptr(meta).arg_u32(meta_stride).arg_ptr(ws).arg_ptr(ws_ml).arg_u32(num_seqs) \
        .arg_u32(heads).arg_u32(row_width).arg_u32(v_width).arg_f32(scale).arg_u32(window).arg_ptr(sel) \
        .arg_u32(sel_stride if sel else 0).arg_u32(splits).arg_u32(mc)
    if fp8:
        k.arg_u32(nope)
    k.launch(stream)
    _combine(gpu, ws, ws_ml, sink, out, num_seqs, heads, v_width, splits, stream)
