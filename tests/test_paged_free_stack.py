"""The pool's free blocks as an int32 stack (cache.paged): every way blocks are taken or given back hands them out
in the order a Python list used as a stack (pop() / extend()) would, and the free view, free_count and the
handed-out flags agree with it."""
import numpy as np
import pytest

from mtp_cupy.cache import CacheSpec, PagedKvCache, SeqBlocks
from mtp_cupy.cache.paged import NBLOCKS
from mtp_cupy.errors import CapacityError, InputError


def _agree(kv, model):
    assert kv._free.tolist() == model and kv.free_count == len(model)
    assert [b for b in range(kv.num_blocks) if not kv._used[b]] == sorted(model)


def test_free_stack_matches_a_list_stack(ref, rng):
    kv = PagedKvCache(ref, CacheSpec("latent", 4), num_blocks=97)
    model = list(range(kv.num_blocks - 1, -1, -1))   # the free list as a stack: pop() hands out 0, 1, 2, ...
    seqs = [SeqBlocks(kv) for _ in range(9)]
    for _ in range(400):
        op = rng.integers(0, 4)
        live = [s for s in seqs if s.nblocks]
        if op == 0:                                   # a reserve of one or more blocks (alloc_blocks)
            s, n = seqs[rng.integers(len(seqs))], int(rng.integers(1, 4))
            if n <= len(model):
                want = [model.pop() for _ in range(n)]
                s.reserve(16 * (s.nblocks + n))
                assert s.table[-n:] == want
        elif op == 1 and live:                        # a truncate (free_blocks)
            s = live[rng.integers(len(live))]
            keep = int(rng.integers(0, s.nblocks))
            model.extend(s.table[keep:])
            s.rows = 16 * s.nblocks
            s.truncate(16 * keep)
        elif op == 2:                                 # a batch's one block each (grow_one)
            pick = [s for s in seqs if rng.random() < 0.6]
            if pick and len(pick) <= len(model):
                rows = np.array([s.row for s in pick], np.intp)
                nb = kv._cols[rows, NBLOCKS].copy()
                want = [model.pop() for _ in pick]
                kv.grow_one(rows, nb)
                assert [s.table[-1] for s in pick] == want and [s.nblocks for s in pick] == (nb + 1).tolist()
        elif live:                                    # a batch giving one block each back (shrink_one)
            pick = [s for s in live if rng.random() < 0.6]
            if pick:
                rows = np.array([s.row for s in pick], np.intp)
                nb = kv._cols[rows, NBLOCKS].copy()
                model.extend(s.table[-1] for s in pick)
                kv.shrink_one(rows, nb)
                assert [s.nblocks for s in pick] == (nb - 1).tolist()
        _agree(kv, model)
    for s in seqs:
        model.extend(s.table)
        s.release()
    _agree(kv, model)
    assert kv.free_count == kv.num_blocks


def test_free_stack_refusals_change_nothing(ref):
    kv = PagedKvCache(ref, CacheSpec("latent", 4), num_blocks=5)
    a, b = SeqBlocks(kv), SeqBlocks(kv)
    a.reserve(16 * 3)
    before = kv._free.tolist()
    with pytest.raises(CapacityError):
        kv.grow_one(np.array([a.row, b.row, a.row], np.intp), np.array([3, 0, 3]))
    with pytest.raises(InputError):
        kv.free_blocks([kv._free.tolist()[0]])         # a free block
    with pytest.raises(InputError):
        kv.free_blocks([a.table[0], a.table[0]])
    assert kv.alloc_blocks(0) == []
    assert kv._free.tolist() == before and a.nblocks == 3 and b.nblocks == 0
    with pytest.raises(ValueError):
        kv._free[0] = 9                                # the view is read-only: the stack changes only here
