"""The wide batch path's cached host structures (SlabStager, BatchMemo.aim / at, PagedKvCache._flat) stay right when
the mirror they point into widens or the remembered batch changes: every staged slab equals stage_mtp_meta's."""
import numpy as np

from mtp_cupy.cache import PagedKvCache, SeqBlocks
from mtp_cupy.cache.paged import CacheSpec, NBLOCKS, ROWS
from mtp_cupy.refdev.backend import RefBackend
from mtp_cupy.runtime.arena import SlabStager, stage_mtp_meta
from mtp_cupy.speculative.batch_inputs import BatchMemo

K, S = 3, 2048


def _rows(seqs):
    return np.array([s.row for s in seqs], np.intp)


def _stage_both(kv, memo, stager, got, seqs, rng):
    idx = memo.idx
    c = kv._cols.take(idx, axis=0)
    rows0 = np.array([int(rng.integers(0, max(s.rows - K, 0) + 1)) for s in seqs], np.int64)
    pos = rows0 + rng.integers(0, 1000, len(seqs))
    nb = c[:, NBLOCKS]
    most = int(nb.max())
    want = np.full_like(got, 0xAB)
    memo.aim(stager, kv)
    stager(pos, rows0, kv._tables.ravel(), kv.tables_at(idx, nb, most), most)
    stage_mtp_meta(want, K, pos, rows0, [s.table for s in seqs], kv.block_size, S)
    for s, sq in enumerate(seqs):   # the fields and the table's own entries (bytes past them: no reader looks)
        o, n = s * S, 256 + 4 * sq.nblocks
        np.testing.assert_array_equal(got[:, o:o + 24], want[:, o:o + 24])
        np.testing.assert_array_equal(got[:, o + 256:o + n], want[:, o + 256:o + n])


def test_stager_follows_widening_and_new_batches():
    rng = np.random.default_rng(0)
    kv = PagedKvCache(RefBackend(), CacheSpec("kv", 8), num_blocks=400)
    seqs = [SeqBlocks(kv) for _ in range(6)]
    for s in seqs:
        s.reserve(int(rng.integers(K, 60)))
        s.rows = s.nblocks * 16 - int(rng.integers(0, 16))
    got = np.zeros((K, len(seqs) * S), np.uint8)
    stager, memo = SlabStager(got, K, len(seqs), S, kv.block_size), BatchMemo()
    memo.keep(seqs, _rows(seqs), kv)
    for _ in range(3):
        _stage_both(kv, memo, stager, got, seqs, rng)
        kv.grow_one(memo.idx, kv._cols.take(memo.idx, axis=0)[:, NBLOCKS].copy())   # cached flat indices
        for s in seqs:
            s.rows = s.nblocks * 16 - 1
        _stage_both(kv, memo, stager, got, seqs, rng)
    seqs[2].reserve(16 * 40)   # the mirror widens past 16 entries: every cached flat index is stale
    seqs[2].rows = 16 * 40
    assert kv._tables.shape[1] > 16
    _stage_both(kv, memo, stager, got, seqs, rng)
    kv.shrink_one(memo.idx, kv._cols.take(memo.idx, axis=0)[:, NBLOCKS].copy())
    for s in seqs:
        s.rows = min(s.rows, s.nblocks * 16)
    _stage_both(kv, memo, stager, got, seqs, rng)
    other = seqs[::-1]   # a new batch (the same rows in another order) re-aims the same stager
    memo.keep(other, _rows(other), kv)
    _stage_both(kv, memo, stager, got, other, rng)
    assert [kv._cols[s.row, ROWS] for s in seqs] == [s.rows for s in seqs]
