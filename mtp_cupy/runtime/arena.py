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
# the slab fields as indices into int32 / int64 views of a slab (the stagers write through those). pos (u32) and
# seq_len (i32) are each followed by 4 bytes no field uses, so the stagers write each as one int64 word (the
# value, then 4 zero bytes); pos, slot, seq_len are the slab's int64 words 0, 1, 2 (SlabStager's one store)
_TABLE32 = TABLE_OFFSET // 4
_POS64, _SLOT64, _SEQ_LEN64 = POS_OFFSET // 8, SLOT_OFFSET // 8, SEQ_LEN_OFFSET // 8
assert POS_OFFSET % 8 == 0 and SEQ_LEN_OFFSET % 8 == 0 and (_POS64, _SLOT64, _SEQ_LEN64) == (0, 1, 2)


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
    too, where no reader looks); `most`, when the caller knows it, is max(lens) (it saves a pass). The
    tables are the allocator's own (valid block ids), so only their size is checked. A caller that stages
    the same slabs call after call keeps a `SlabStager` instead."""
    B = len(tables)
    if lens is None:
        lens = [len(t) for t in tables]
    slab = stride or stage.shape[1]
    if most is None:
        most = int(lens.max()) if isinstance(lens, np.ndarray) else max(lens)
    if B == 1:                                   # propose's case: a few scalar stores beat the array plan
        table = np.asarray(tables[0][:lens[0]], np.int32)   # (OneStager checks that it fits)
        OneStager(stage, slab)(k, int(positions[0]), int(rows0[0]), table, block_size)
        return
    if not isinstance(tables, np.ndarray):
        tab = np.zeros((B, most), np.int32)
        for s, t in enumerate(tables):
            tab[s, :len(t)] = t
        tables = tab
    stager = SlabStager(stage, k, B, slab, block_size)
    stager.set_first(np.arange(0, B * tables.shape[1], tables.shape[1]))
    stager(positions, rows0, np.ascontiguousarray(tables, dtype=np.int32).ravel(), tables, most)


def _check_fits(B: int, most: int, slab: int, row_bytes: int) -> None:
    if TABLE_OFFSET + 4 * most > slab or B * slab > row_bytes:
        raise CapacityError(f"{B} MTP slabs with block tables of up to {most} entries do not fit "
                            f"{slab}-byte slabs in a {row_bytes}-byte stage row")


class SlabStager:
    """stage_mtp_meta's array plan for k steps of B slabs `stride` bytes apart in a uint8 stage [steps, bytes],
    its views, temporaries and operands made once (a batch call restages the same slabs call after call). Every
    NumPy call costs about a microsecond at these sizes less when its operands are contiguous int64 arrays of
    one shape (no broadcast, no scalar, no cast): so the per-sequence values are broadcast into [k, B] arrays by
    stores, and the arithmetic runs on those against [k, B] constants."""
    __slots__ = ("k", "B", "slab", "pos", "slot", "seq_len", "tab", "rp", "steps", "first", "ops", "by", "ones",
                 "t", "j")

    def __init__(self, stage: np.ndarray, k: int, B: int, stride: int, block_size: int):
        _check_fits(B, 0, stride, stage.shape[1])
        self.k, self.B, self.slab = k, B, stride
        v = stage[:k, :B * stride]
        v64 = v.view(np.int64).reshape(k, B, stride // 8)
        self.pos, self.slot, self.seq_len = v64[:, :, _POS64], v64[:, :, _SLOT64], v64[:, :, _SEQ_LEN64]
        self.tab = v.view(np.int32).reshape(k, B, stride // 4)[:, :, _TABLE32:]
        kb = (k, B)
        self.rp = np.empty((2,) + kb, np.int64)                     # [0]: the steps' rows, [1]: their positions
        self.steps = np.broadcast_to(np.arange(k, dtype=np.int64)[:, None], (2,) + kb).copy()
        self.first = np.empty(kb, np.int64)   # each sequence's entry 0 in the flat tables (`first`, per row)
        # row // bs, t * bs, row % bs: shifts and a mask for a power-of-two block size (a division is slower)
        pow2 = block_size & (block_size - 1) == 0
        self.ops = (np.right_shift, np.left_shift, np.bitwise_and) if pow2 else \
            (np.floor_divide, np.multiply, np.remainder)
        sh = block_size.bit_length() - 1
        self.by = tuple(np.full(kb, v, np.int64) for v in ((sh, sh, block_size - 1) if pow2 else (block_size,) * 3))
        self.ones = np.ones(kb, np.int64)
        self.t, self.j = np.empty(kb, np.int64), np.empty(kb, np.int64)

    def set_first(self, first) -> None:
        """Sequence s's block table starts at entry first[s] of the flat tables the calls pass."""
        self.first[...] = first

    def __call__(self, positions, rows0, flat_tables: np.ndarray, tables: np.ndarray, most: int) -> None:
        """Stage positions / rows0 ([B] ints) with the tables [B, >= most] (int32), which `flat_tables` also
        holds (sequence s's from entry `first[s]`, see set_first)."""
        _check_fits(self.B, most, self.slab, self.B * self.slab)
        rp, t, j = self.rp, self.t, self.j
        rp[0] = rows0
        rp[1] = positions
        np.add(rp, self.steps, out=rp)
        rows = rp[0]
        self.pos[...] = rp[1]
        np.add(rows, self.ones, out=t)
        self.seq_len[...] = t
        (div, mul, rem), (d, m, r) = self.ops, self.by
        div(rows, d, out=j)
        np.add(j, self.first, out=j)
        t[...] = flat_tables.take(j)   # (a take into `out` buffers; a cast on the store is cheap)
        mul(t, m, out=t)
        rem(rows, r, out=j)
        np.add(t, j, out=t)
        self.slot[...] = t
        self.tab[:, :, :most] = tables[:, :most]


class OneStager:
    """stage_mtp_meta for one sequence (propose's case) into the uint8 stage [steps, bytes] (its slab at byte 0 of
    each row), the views made once: a few scalar stores beat the array plan."""
    __slots__ = ("s32", "s64", "slab", "row_bytes")

    def __init__(self, stage: np.ndarray, stride: int = 0):
        self.s32, self.s64 = stage.view(np.int32), stage.view(np.int64)
        self.slab, self.row_bytes = stride or stage.shape[1], stage.shape[1]

    def __call__(self, k: int, position: int, rows0: int, table: np.ndarray, bs: int) -> None:
        """Steps 0..k-1 of a sequence at `position` / drafter row `rows0` with block table `table` (int32)."""
        n, s64 = len(table), self.s64
        _check_fits(1, n, self.slab, self.row_bytes)
        self.s32[:k, _TABLE32:_TABLE32 + n] = table
        for i in range(k):
            row = rows0 + i
            s64[i, _POS64], s64[i, _SEQ_LEN64] = position + i, row + 1
            s64[i, _SLOT64] = table.item(row // bs) * bs + row % bs


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
