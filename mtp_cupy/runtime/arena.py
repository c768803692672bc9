"""ForwardBuffers: one device allocation carved into named regions, and the attention-metadata slab.

The target's attention metadata lives at `scratch + TARGET_META_OFFSET`; an MTP proposer uploads its own
at `scratch + MTP_META_OFFSET` so the two never overlap. The slab layout is mtp_cupy.runtime.slab's
(pos u32, slot i64, seq_len i32, block_table i32[] at POS_OFFSET, SLOT_OFFSET, SEQ_LEN_OFFSET, TABLE_OFFSET)."""
from __future__ import annotations

import numpy as np

from ..errors import CapacityError, InputError
from .backend import Backend
from .ptr import DevicePtr
from .slab import POS_OFFSET, SEQ_LEN_OFFSET, SLOT_OFFSET, TABLE_OFFSET

TARGET_META_OFFSET = 32768
MTP_META_OFFSET = 65536
META_TABLE_OFFSET = TABLE_OFFSET  # alias kept for callers that predate runtime.slab
DEFAULT_SCRATCH = MTP_META_OFFSET + 64 * 1024  # room for a 16,320-entry block table (261k tokens)
ALIGN = 256
# the slab fields as indices into int32 / int64 views of a slab (the stager writes through those). pos (u32) and
# seq_len (i32) are each followed by 4 bytes no field uses, so the stager writes each as one int64 word (the
# value, then 4 zero bytes): a field per store, whatever the batch
_TABLE32 = TABLE_OFFSET // 4
_POS64, _SLOT64, _SEQ_LEN64 = POS_OFFSET // 8, SLOT_OFFSET // 8, SEQ_LEN_OFFSET // 8
assert POS_OFFSET % 8 == 0 and SEQ_LEN_OFFSET % 8 == 0 and len({_POS64, _SLOT64, _SEQ_LEN64}) == 3
_STEPS = np.arange(16, dtype=np.int64)[:, None]   # the draft steps 0..k-1 as a column, for k up to 16


def pack_mtp_attn_meta(pos: int, slot: int, seq_len: int, block_table, capacity: int) -> bytes:
    """The MTP metadata slab. `capacity` is the bytes available after MTP_META_OFFSET; a table that
    does not fit raises CapacityError (nothing is written)."""
    table = np.asarray(block_table, dtype=np.int64)
    need = TABLE_OFFSET + 4 * table.size
    if need > capacity:
        raise CapacityError(f"MTP block table of {table.size} entries needs {need} bytes of metadata; "
                            f"only {capacity} fit after MTP_META_OFFSET")
    if not 0 <= pos < 1 << 32:
        raise InputError(f"position {pos} does not fit u32")
    if table.size and (table.min() < 0 or table.max() >= 1 << 31):
        raise InputError("block ids must fit i32")
    buf = bytearray(need)
    buf[POS_OFFSET:POS_OFFSET + 4] = np.uint32(pos).tobytes()
    buf[SLOT_OFFSET:SLOT_OFFSET + 8] = np.int64(slot).tobytes()
    buf[SEQ_LEN_OFFSET:SEQ_LEN_OFFSET + 4] = np.int32(seq_len).tobytes()
    buf[TABLE_OFFSET:] = table.astype("<i4").tobytes()
    return bytes(buf)


def stage_mtp_meta(stage: np.ndarray, k: int, positions, rows0, tables, block_size: int, stride: int = 0,
                   lens=None, most: int | None = None) -> None:
    """pack_mtp_attn_meta's layout for k steps of B sequences, written straight into the uint8 host array
    `stage` [steps, bytes]: step i of sequence s (position positions[s] + i at drafter row rows0[s] + i,
    seq_len rows0[s] + i + 1, table tables[s]) lands in row i at byte s * stride (stride 0: one slab, the
    whole row; stride and row bytes multiples of 8). `tables` is B lists of block ids, or an int array
    [B, L] whose row s holds lens[s] of them (`PagedKvCache.tables_of`; entries past lens[s] are staged
    too, where no reader looks); `most`, when the caller knows it, is max(lens) (it saves a pass). The per-call
    hot path: a fixed number of array operations whatever B is; the tables are the allocator's own (valid
    block ids), so only their size is checked."""
    B, bs = len(tables), block_size
    if lens is None:
        lens = [len(t) for t in tables]
    slab = stride or stage.shape[1]
    if most is None:
        most = int(lens.max()) if isinstance(lens, np.ndarray) else max(lens)
    if TABLE_OFFSET + 4 * most > slab or B * slab > stage.shape[1]:
        raise CapacityError(f"{B} MTP slabs with block tables of up to {most} entries do not fit "
                            f"{slab}-byte slabs in a {stage.shape[1]}-byte stage row")
    if B == 1:                                   # propose's case: a few scalar stores beat the array plan
        _stage_one(stage, k, int(positions[0]), int(rows0[0]), tables[0][:lens[0]], bs)
        return
    if not isinstance(tables, np.ndarray):
        tab = np.zeros((B, most), np.int32)
        for s, t in enumerate(tables):
            tab[s, :len(t)] = t
        tables = tab
    # each field is computed into a contiguous [k, B] array, then stored into the strided slabs (ufuncs writing
    # straight into a strided view, and operator broadcasts, are slower at these sizes)
    step = _STEPS[:k] if k <= len(_STEPS) else np.arange(k)[:, None]
    rows = np.add(np.asarray(rows0, dtype=np.int64), step)                      # [k, B]
    v = stage[:k, :B * slab]
    v64 = v.view(np.int64).reshape(k, B, slab // 8)
    v64[:, :, _POS64] = np.add(np.asarray(positions, dtype=np.int64), step)
    v64[:, :, _SEQ_LEN64] = np.add(rows, 1)
    blk, off = np.divmod(rows, bs)
    blk += np.arange(0, B * tables.shape[1], tables.shape[1])                   # flat index of each entry
    np.multiply(tables.ravel().take(blk), bs, out=blk)
    blk += off
    v64[:, :, _SLOT64] = blk
    v.view(np.int32).reshape(k, B, slab // 4)[:, :, _TABLE32:_TABLE32 + most] = tables[:, :most]


def _stage_one(stage: np.ndarray, k: int, position: int, rows0: int, table, bs: int) -> None:
    s32, s64 = stage.view(np.int32), stage.view(np.int64)
    s32[:k, _TABLE32:_TABLE32 + len(table)] = table
    for i in range(k):
        row = rows0 + i
        s64[i, _POS64], s64[i, _SEQ_LEN64] = position + i, row + 1
        s64[i, _SLOT64] = table[row // bs] * bs + row % bs


def unpack_mtp_attn_meta(raw: bytes | np.ndarray, num_blocks: int) -> tuple[int, int, int, list[int]]:
    raw = bytes(raw)
    pos = int(np.frombuffer(raw, "<u4", 1, POS_OFFSET)[0])
    slot = int(np.frombuffer(raw, "<i8", 1, SLOT_OFFSET)[0])
    seq_len = int(np.frombuffer(raw, "<i4", 1, SEQ_LEN_OFFSET)[0])
    table = np.frombuffer(raw[TABLE_OFFSET:TABLE_OFFSET + 4 * num_blocks], "<i4").tolist()
    return pos, slot, seq_len, table


def layout(regions: dict[str, int], align: int = ALIGN) -> tuple[dict[str, tuple[int, int]], int]:
    """Offsets of named regions (bytes) packed in order, each `align`-aligned; and the total size."""
    out, off = {}, 0
    for name, nbytes in regions.items():
        out[name] = (off, int(nbytes))
        off += (int(nbytes) + align - 1) // align * align
    return out, max(off, align)


def carve(gpu: Backend, regions: dict[str, int]):
    """One device allocation cut into named aligned regions: (the owning buffer, {name: pointer})."""
    lay, total = layout(regions)
    buf = gpu.alloc(total)
    return buf, {name: buf.ptr.offset(off) for name, (off, _) in lay.items()}


_RESERVED = ("scratch", "layout", "total_bytes", "buf", "scratch_bytes")


class ForwardBuffers:
    """Named device regions in one allocation. `regions` maps name -> bytes; `scratch` is always present.

    Example: ForwardBuffers(gpu, {"hidden_states": 2*D, "logits": 4*V}) then `bufs.hidden_states`."""

    def __init__(self, gpu: Backend, regions: dict[str, int], scratch_bytes: int = DEFAULT_SCRATCH):
        if scratch_bytes < MTP_META_OFFSET + TABLE_OFFSET:
            raise CapacityError(f"scratch of {scratch_bytes} bytes leaves no room for MTP metadata")
        taken = [n for n in regions if n in _RESERVED or hasattr(type(self), n)]
        if taken:
            raise ValueError(f"region names {taken} are reserved")
        self.layout, self.total_bytes = layout({**regions, "scratch": scratch_bytes})
        self.buf = gpu.alloc(self.total_bytes)
        self.scratch_bytes = scratch_bytes
        # each region's pointer is a plain attribute: the per-call paths read them often
        for name, (off, _) in self.layout.items():
            setattr(self, name, self.buf.ptr.offset(off))

    def __getattr__(self, name: str) -> DevicePtr:   # only reached for a name that is no region
        raise AttributeError(f"ForwardBuffers has no region {name!r}")

    def region_bytes(self, name: str) -> int:
        return self.layout[name][1]

    @property
    def mtp_meta(self) -> DevicePtr:
        return self.scratch.offset(MTP_META_OFFSET)

    @property
    def target_meta(self) -> DevicePtr:
        return self.scratch.offset(TARGET_META_OFFSET)

    @property
    def mtp_meta_capacity(self) -> int:
        return self.scratch_bytes - MTP_META_OFFSET
