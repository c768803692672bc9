"""PagedKvCache: a pool of fixed-size blocks (BLOCK_SIZE = 16 rows each, from runtime.slab) on the device,
shared by one or more caches (e.g. the MLA latent cache and the DSA indexer cache) that use the same block
ids.

A row of cache `c` at layer `l` for slot `s = block * block_size + offset` lives at
    base[c] + ((l * num_blocks + block) * block_size + offset) * row_bytes[c]
`slot_addr` is the one place that arithmetic is written.

Every live SeqBlocks owns one row of the cache's mirror: its block table (int32 `_tables[row]`) and its
per-sequence counters (int64 `_cols[row]`: ROWS, NBLOCKS, then OWNER_COLUMNS columns its owner keeps, such as a
proposer's positions and draft counts), so a batch of sequences reads and updates its state with one gather and
one scatter instead of a Python loop."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import CapacityError, ConfigError, InputError
from ..runtime.backend import Backend
from ..runtime.dtypes import dtype as _dtype
from ..runtime.ptr import DevicePtr
from ..runtime.slab import BLOCK_SIZE
from ..runtime.slab import blocks_for as _blocks_for

ROWS, NBLOCKS = 0, 1          # `_cols` columns: rows held, blocks in the table
OWNER = 2                     # the first of the owner's columns
OWNER_COLUMNS = 6
SEQ_COLUMNS = OWNER + OWNER_COLUMNS


@dataclass(frozen=True)
class CacheSpec:
    name: str
    row_width: int          # elements per row (e.g. 512 + 64 for the MLA latent)
    dtype: str = "bf16"     # "bf16" or "fp8" (+ an f32 scale row when scale_width > 0), "u8" for raw rows
    num_layers: int = 1

    @property
    def row_bytes(self) -> int:
        return self.row_width * _dtype(self.dtype).itemsize


class PagedKvCache:
    def __init__(self, gpu: Backend, specs: list[CacheSpec] | CacheSpec, num_blocks: int | None = None,
                 pool_bytes: int | None = None, block_size: int = BLOCK_SIZE):
        specs = [specs] if isinstance(specs, CacheSpec) else list(specs)
        if not specs:
            raise ConfigError("PagedKvCache needs at least one CacheSpec")
        for s in specs:
            if s.dtype not in ("bf16", "fp8", "u8", "f32"):
                raise ConfigError(f"cache {s.name}: dtype {s.dtype!r} is not bf16/fp8/u8/f32")
        per_block = sum(s.row_bytes * s.num_layers for s in specs) * block_size
        if num_blocks is None:
            if pool_bytes is None:
                raise ConfigError("PagedKvCache needs num_blocks or pool_bytes")
            num_blocks = pool_bytes // per_block
        if num_blocks <= 0:
            raise ConfigError(f"PagedKvCache: {num_blocks} blocks (pool too small for one block of {per_block} bytes)")
        self.gpu, self.specs, self.block_size, self.num_blocks = gpu, {s.name: s for s in specs}, block_size, num_blocks
        self.bufs = {s.name: gpu.alloc(s.row_bytes * s.num_layers * num_blocks * block_size) for s in specs}
        # the free blocks as a stack (top = the last of its first `_nfree` entries; handed out 0, 1, 2, ...): an
        # array, so the batch calls take and give back a block per sequence with one slice each
        self._stack = np.arange(num_blocks - 1, -1, -1, dtype=np.int32)
        self._nfree = num_blocks
        self._used = bytearray(num_blocks)   # 1 = handed out (a bytearray: per-call paths index it one at a time)
        self._used_np = np.frombuffer(self._used, np.uint8)   # the same bytes, for the batch calls' array stores
        # every live SeqBlocks' table mirrored in one int32 row of `_tables` (rows and width grown by doubling:
        # width is the longest table yet, not the pool), so a batch's tables stage as one gather (`tables_of`)
        # instead of converting B Python lists on every call
        self._tables = np.zeros((0, 16), np.int32)
        self._cols = np.zeros((0, SEQ_COLUMNS), np.int64)
        self._rows_free: list[int] = []
        # bumped whenever a mirror row changes hands (taken or given back): a batch's mirror rows remembered at
        # one epoch are still its states' rows at the same epoch (speculative.batch_inputs.BatchMemo)
        self.row_epoch = 0
        self._flat_memo = None   # _flat's last (rows, width, indices)

    @staticmethod
    def blocks_for(rows: int, block_size: int = BLOCK_SIZE) -> int:
        return _blocks_for(rows, block_size)

    # -- pool ------------------------------------------------------------------------------------
    @property
    def free_count(self) -> int:
        return self._nfree

    @property
    def _free(self) -> np.ndarray:
        """The free blocks, the next one handed out last (a read-only view of the stack)."""
        v = self._stack[:self._nfree]
        v.flags.writeable = False
        return v

    def alloc_block(self) -> int:
        return self.alloc_blocks(1)[0]

    def alloc_blocks(self, n: int) -> list[int]:
        """All n blocks or none (CapacityError, pool unchanged); none for n <= 0."""
        m = self._nfree
        if n <= 0:
            return []
        if n > m:
            raise CapacityError(f"KV pool exhausted: {n} blocks asked, {m} of {self.num_blocks} free")
        self._nfree = m - n
        if n == 1:
            b = self._stack.item(m - 1)
            self._used[b] = 1
            return [b]
        out = self._stack[m - n:m][::-1].tolist()
        for b in out:
            self._used[b] = 1
        return out

    def free_blocks(self, blocks) -> None:
        """Give blocks back (InputError, pool unchanged, for one not handed out or given twice)."""
        blocks = list(blocks)
        for b in blocks:
            if not 0 <= b < self.num_blocks or not self._used[b]:
                raise InputError(f"block {b} is not allocated")
        if len(blocks) > 1 and len(set(blocks)) != len(blocks):
            raise InputError("a block freed twice in one call")
        for b in blocks:
            self._used[b] = 0
        m = self._nfree
        self._stack[m:m + len(blocks)] = blocks
        self._nfree = m + len(blocks)

    # -- the block-table mirror ---------------------------------------------------------------------
    def _take_row(self) -> int:
        if not self._rows_free:
            n, w = self._tables.shape
            grow = max(n, 4)
            self._tables = np.concatenate([self._tables, np.zeros((grow, w), np.int32)])
            self._cols = np.concatenate([self._cols, np.zeros((grow, SEQ_COLUMNS), np.int64)])
            self._rows_free = list(range(n + grow - 1, n - 1, -1))
        row = self._rows_free.pop()
        self._cols[row] = 0
        self.row_epoch += 1
        return row

    def _widen(self, width: int) -> None:
        n, w = self._tables.shape
        if width > w:
            wide = np.zeros((n, max(width, 2 * w)), np.int32)
            wide[:, :w] = self._tables
            self._tables = wide

    def _give_row(self, row: int) -> None:
        self._rows_free.append(row)
        self.row_epoch += 1

    def tables_of(self, seqs: list["SeqBlocks"]) -> tuple[np.ndarray, list[int]]:
        """(int32 [B, L], lens): row s holds seqs[s]'s block table in its first lens[s] entries (L = max lens)."""
        lens = [s.nblocks for s in seqs]
        return self.tables_at(np.array([s.row for s in seqs], np.intp), np.array(lens)), lens

    def _flat(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(rows * SEQ_COLUMNS + NBLOCKS, rows * width): where the mirror rows' NBLOCKS counters and tables start in
        the flat `_cols` / `_tables`. Kept for the last read-only `rows` (a batch call's remembered rows, passed
        call after call) while the width holds; every put / take then runs on precomputed indices."""
        w, f = self._tables.shape[1], self._flat_memo
        if f is not None and f[0] is rows and f[1] == w:
            return f[2]
        out = rows * SEQ_COLUMNS + NBLOCKS, rows * w
        if not rows.flags.writeable:
            self._flat_memo = rows, w, out
        return out

    def grow_one(self, rows: np.ndarray, nblocks: np.ndarray) -> None:
        """One more block for each of the sequences at mirror rows `rows` (tables of `nblocks` blocks now), handed
        out as one-at-a-time reserves in that order would; all or none (CapacityError, nothing changed)."""
        n, m = len(rows), self._nfree
        if n > m:
            raise CapacityError(f"KV pool exhausted: {n} blocks asked, {m} of {self.num_blocks} free")
        new = self._stack[m - n:m][::-1]   # pop() order (a view: stored below before the stack changes again)
        self._widen(int(nblocks.max()) + 1)
        self._nfree = m - n
        # (put / take at flat indices: scatters and gathers a few times faster than fancy indexing)
        at_nblocks, at_table = self._flat(rows)
        self._used_np.put(new, 1)
        self._tables.ravel().put(at_table + nblocks, new)
        self._cols.ravel().put(at_nblocks, nblocks + 1)

    def shrink_one(self, rows: np.ndarray, nblocks: np.ndarray) -> None:
        """Give back the last block of each of the sequences at mirror rows `rows` (tables of `nblocks` >= 1
        blocks), in the order one-at-a-time truncates would. Row counts are the caller's."""
        keep = nblocks - 1
        at_nblocks, at_table = self._flat(rows)
        last = self._tables.ravel().take(at_table + keep)
        used = self._used_np
        if np.count_nonzero(used.take(last)) != len(last):
            raise InputError(f"block {int(last[used[last] == 0][0])} is not allocated")
        used.put(last, 0)
        self._cols.ravel().put(at_nblocks, keep)
        m = self._nfree
        self._stack[m:m + len(last)] = last
        self._nfree = m + len(last)

    def tables_at(self, rows: np.ndarray, nblocks: np.ndarray, most: int | None = None) -> np.ndarray:
        """int32 [B, max(nblocks)]: the block tables of the mirror rows `rows` (entries past a row's own
        nblocks are stale: no reader looks there); `most`: max(nblocks) when the caller knows it."""
        t, w = self._tables, max(int(nblocks.max()) if most is None else most, 1)
        # take copies whole mirror rows, a few times faster than fancy indexing while the rows are narrow or not much
        # wider than w
        return t.take(rows, axis=0)[:, :w] if t.shape[1] <= max(2 * w, 64) else t[rows, :w]

    # -- addressing ------------------------------------------------------------------------------
    def base(self, cache: str, layer: int = 0) -> DevicePtr:
        s = self.specs[cache]
        if not 0 <= layer < s.num_layers:
            raise InputError(f"cache {cache}: layer {layer} of {s.num_layers}")
        return self.bufs[cache].ptr.offset(layer * self.num_blocks * self.block_size * s.row_bytes)

    def slot_addr(self, cache: str, layer: int, slot: int) -> DevicePtr:
        if not 0 <= slot < self.num_blocks * self.block_size:
            raise InputError(f"slot {slot} outside the pool")
        return self.base(cache, layer).offset(slot * self.specs[cache].row_bytes)

    def slot_of(self, block_table, row: int) -> int:
        return int(block_table[row // self.block_size]) * self.block_size + row % self.block_size


class SeqBlocks:
    """The block table of one sequence in a PagedKvCache, grown and trimmed with its row count. Both live in the
    cache's mirror row (`row`): the table in `_tables`, its length and `rows` in `_cols`; `table` reads a copy."""

    def __init__(self, cache: PagedKvCache):
        self.cache = cache
        self.row = cache._take_row()   # this sequence's row in the cache's mirror (`PagedKvCache.tables_of`)

    @property
    def rows(self) -> int:
        return 0 if self.row is None else self.cache._cols.item(self.row, ROWS)

    @rows.setter
    def rows(self, n: int) -> None:
        if self.row is None:
            if n == 0:
                return
            self.row = self.cache._take_row()
        self.cache._cols[self.row, ROWS] = n

    @property
    def nblocks(self) -> int:
        """Blocks in the table."""
        return 0 if self.row is None else self.cache._cols.item(self.row, NBLOCKS)

    @property
    def table(self) -> list[int]:
        """The block ids, in row order (a new list)."""
        return self.table_view().tolist()

    def table_view(self) -> np.ndarray:
        """The block ids as an int32 view of the mirror (valid until the table or the mirror changes)."""
        n = self.nblocks
        return self.cache._tables[self.row, :n] if n else np.zeros(0, np.int32)

    def reserve(self, rows: int) -> None:
        """Make room for `rows` rows (all blocks or none)."""
        c, n = self.cache, self.nblocks
        need = _blocks_for(rows, c.block_size) - n
        if need <= 0:
            return
        new = c.alloc_blocks(need)
        if self.row is None:
            self.row = c._take_row()
        c._widen(n + need)
        if need == 1:   # a draft crossing into the next block: the common case, a scalar store
            c._tables[self.row, n] = new[0]
        else:
            c._tables[self.row, n:n + need] = new
        c._cols[self.row, NBLOCKS] = n + need

    def slot(self, row: int) -> int:
        """The cache slot of row `row` (InputError past the table)."""
        c = self.cache
        if not 0 <= row < self.nblocks * c.block_size:
            raise InputError(f"row {row} is outside the {self.nblocks}-block table")
        return c.slot_of(c._tables[self.row], row)

    def slots(self, first: int, n: int) -> np.ndarray:
        """int64 [n]: the cache slots of rows first .. first + n - 1 (InputError past the table)."""
        c = self.cache
        if not (0 <= first and first + n <= self.nblocks * c.block_size):
            raise InputError(f"rows {first}..{first + n - 1} are outside the {self.nblocks}-block table")
        r = np.arange(first, first + n, dtype=np.int64)
        return self.table_view()[r // c.block_size].astype(np.int64) * c.block_size + r % c.block_size

    def truncate(self, rows: int) -> None:
        """Keep the first `rows` rows and give back blocks no longer needed."""
        c, row = self.cache, self.row
        held = 0 if row is None else c._cols.item(row, ROWS)
        if not 0 <= rows <= held:
            raise InputError(f"truncate to {rows} rows of {held}")
        keep = -(-rows // c.block_size)
        if row is not None:
            n = c._cols.item(row, NBLOCKS)
            if keep < n:
                c.free_blocks(c._tables[row, keep:n].tolist())
                c._cols[row, NBLOCKS] = keep
            c._cols[row, ROWS] = rows

    def release(self) -> None:
        if self.row is not None:
            n = self.nblocks
            if n:
                self.cache.free_blocks(self.cache._tables[self.row, :n].tolist())
            self.cache._give_row(self.row)
            self.row = None
