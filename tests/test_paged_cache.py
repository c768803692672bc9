import numpy as np
import pytest

from mtp_cupy.cache import CacheSpec, PagedKvCache, SeqBlocks
from mtp_cupy.errors import CapacityError, ConfigError, InputError


def test_pool_alloc_free_and_exhaustion(ref):
    kv = PagedKvCache(ref, CacheSpec("latent", 576), num_blocks=4)
    assert [kv.alloc_block() for _ in range(3)] == [0, 1, 2]
    with pytest.raises(CapacityError):
        kv.alloc_blocks(2)            # all or nothing
    assert kv.free_count == 1         # nothing taken by the failed call
    kv.free_blocks([1])
    with pytest.raises(InputError):
        kv.free_blocks([1])           # double free
    with pytest.raises(InputError):
        kv.free_blocks([9])
    assert sorted(kv.alloc_blocks(2)) == [1, 3]


def test_sizing_from_bytes_and_layouts(ref):
    specs = [CacheSpec("kv", 512, "bf16", num_layers=2), CacheSpec("idx", 132, "u8")]
    per_block = (512 * 2 * 2 + 132) * 16
    kv = PagedKvCache(ref, specs, pool_bytes=per_block * 5 + 7)
    assert kv.num_blocks == 5
    assert kv.specs["kv"].row_bytes == 1024 and CacheSpec("f", 576, "fp8").row_bytes == 576
    with pytest.raises(ConfigError):
        PagedKvCache(ref, specs, pool_bytes=10)
    with pytest.raises(ConfigError):
        PagedKvCache(ref, CacheSpec("x", 8, "int4"), num_blocks=1)


def test_slot_address_arithmetic(ref):
    kv = PagedKvCache(ref, [CacheSpec("a", 8, "bf16", num_layers=3)], num_blocks=6)
    # layer 1, slot 37 = block 2, offset 5
    assert kv.slot_addr("a", 1, 37) == kv.bufs["a"].ptr + (1 * 6 * 16 + 37) * 16
    assert kv.slot_of([4, 0, 3], 37) == 3 * 16 + 5
    with pytest.raises(InputError):
        kv.slot_addr("a", 3, 0)
    with pytest.raises(InputError):
        kv.slot_addr("a", 0, 6 * 16)
    # every slot of every layer is addressable and distinct, and the last byte is inside the pool
    addrs = {kv.slot_addr("a", l, s) for l in range(3) for s in range(96)}
    assert len(addrs) == 3 * 96
    ref.view(max(addrs), np.uint8, 16)


def test_seq_blocks_reserve_truncate(ref, rng):
    kv = PagedKvCache(ref, CacheSpec("latent", 4), num_blocks=8)
    seqs = [SeqBlocks(kv) for _ in range(3)]
    for _ in range(2000):
        s = seqs[rng.integers(3)]
        if rng.random() < 0.6:
            want = s.rows + int(rng.integers(1, 20))
            try:
                s.reserve(want)
                s.rows = want
            except CapacityError:
                pass
        else:
            s.truncate(int(rng.integers(0, s.rows + 1)))
        used = sum(len(x.table) for x in seqs)
        assert used + kv.free_count == kv.num_blocks
        for x in seqs:
            assert len(x.table) == PagedKvCache.blocks_for(x.rows)
        if all(x.table for x in seqs):   # the int32 mirror a batch stages from holds every table
            tab, lens = kv.tables_of(seqs)
            assert [row[:n].tolist() for row, n in zip(tab, lens)] == [x.table for x in seqs]
    for s in seqs:
        s.release()
    assert kv.free_count == kv.num_blocks


def test_table_mirror_grows_with_the_longest_table_and_the_live_sequences(ref, rng):
    """The int32 mirror a batch stages from widens past its first 16 columns and gains rows past its first
    four sequences without losing a table; a released sequence's row is reused."""
    kv = PagedKvCache(ref, CacheSpec("latent", 4), num_blocks=400)
    seqs = [SeqBlocks(kv) for _ in range(7)]
    for s in seqs:
        s.reserve(16 * int(rng.integers(1, 12)))
    seqs[3].reserve(16 * 90)                      # widens the mirror
    row0 = seqs[0].row
    seqs[0].release()
    seqs[0] = SeqBlocks(kv)
    assert seqs[0].row == row0
    seqs[0].reserve(16 * 33)
    tab, lens = kv.tables_of(seqs)
    assert tab.shape[1] == max(lens) == 90
    assert [row[:n].tolist() for row, n in zip(tab, lens)] == [s.table for s in seqs]
