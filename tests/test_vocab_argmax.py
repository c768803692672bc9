"""The N-rank argmax exchange of a vocab-sharded head: the host lane layout (any N, ids to 2^24, ties,
negative values) under NCCL's bf16 SUM arithmetic in every rank order, the pair layout, and the device
kernels (pack on each simulated rank -> summed lanes -> decode) against the host functions."""
import itertools

import numpy as np
import pytest

from mtp_cupy import ops
from mtp_cupy.errors import InputError
from mtp_cupy.runtime.comm import reduce_ranks
from mtp_cupy.runtime.dtypes import BF16
from mtp_cupy.speculative.vocab_argmax import (decode_lanes, decode_pairs, lane_count, pack_lanes, pack_pair)
from helpers import get, out, up


def summed(parts: list[np.ndarray], order) -> np.ndarray:
    """NCCL's bf16 all-reduce of the ranks' lanes, accumulated in `order`."""
    return reduce_ranks(np.stack([parts[r] for r in order]), "bf16", "sum")


def expected(vals, ids) -> tuple[int, int]:
    """Reference winner: the largest bf16 value, the lowest rank on a tie."""
    v = np.asarray(vals, np.float32).astype(BF16).astype(np.float32)
    r = int(np.flatnonzero(v == v.max())[0])
    return r, ids[r]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 8])
def test_lanes_any_world_any_order(world, rng):
    assert lane_count(world) == 4 * world
    for trial in range(40):
        vals = (rng.standard_normal(world) * 10 ** rng.uniform(-3, 3)).astype(np.float32)
        if trial % 4 == 0:      # a forced tie between two ranks (bf16-equal maxima)
            vals[:] = -50.0
            a, b = sorted(rng.choice(world, 2, replace=False)) if world > 1 else (0, 0)
            vals[a] = vals[b] = 7.25
        ids = [int(x) for x in rng.integers(0, 1 << 24, world)]
        ids[0] = (1 << 24) - 1 if trial % 5 == 0 else ids[0]
        parts = [pack_lanes(r, world, vals[r], ids[r]) for r in range(world)]
        want = expected(vals, ids)
        orders = list(itertools.permutations(range(world)))[:6]
        for order in orders:
            rank, tid, val = decode_lanes(summed(parts, order), world)
            assert (rank, tid) == want
            assert val == float(np.float32(vals[rank]).astype(BF16))


def test_lanes_edge_values():
    world = 3
    ids = [0, 255, 256 * 256 * 255 + 256 * 17 + 3]
    for vals in ([-1e30, -3.0, -3.0], [-0.0, 0.0, -1.0], [np.inf, 1.0, np.inf], [-np.inf, -np.inf, -np.inf]):
        parts = [pack_lanes(r, world, vals[r], ids[r]) for r in range(world)]
        rank, tid, _ = decode_lanes(summed(parts, range(world)), world)
        assert (rank, tid) == expected(vals, ids)


def test_lanes_errors():
    with pytest.raises(InputError):
        pack_lanes(0, 2, 1.0, 1 << 24)
    with pytest.raises(InputError):
        pack_lanes(2, 2, 1.0, 5)
    with pytest.raises(InputError):
        decode_lanes(np.zeros(7, BF16), 2)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_pairs(world, rng):
    for trial in range(20):
        vals = rng.standard_normal(world).astype(np.float32)
        if trial % 3 == 0 and world > 1:
            vals[world - 1] = vals[0] = vals.max() + 1.0
        ids = [int(x) for x in rng.integers(0, 1 << 31, world)]
        rank, tid, val = decode_pairs(np.stack([pack_pair(vals[r], ids[r]) for r in range(world)]), world)
        r = int(np.flatnonzero(vals == vals.max())[0])
        assert (rank, tid, val) == (r, ids[r], float(vals[r]))


def _device_exchange(dev, world, vals, local_ids, v0s, exchange):
    """Each simulated rank packs on the device; the bf16 sum / byte gather; the decode kernel."""
    idb, valb = out(dev, "i32", 1), out(dev, "f32", 1)
    parts = []
    for r in range(world):
        dev.copy_h2d(idb.ptr, np.array([local_ids[r]], np.int32))
        dev.copy_h2d(valb.ptr, np.array([vals[r]], np.float32))
        if exchange == "digits":
            lanes = out(dev, "bf16", lane_count(world))
            ops.pack_argmax_lanes(dev, idb.ptr, valb.ptr, v0s[r], r, world, lanes.ptr)
            parts.append(get(dev, lanes, "bf16", lane_count(world)))
        else:
            pair = out(dev, "u32", 2)
            ops.pack_argmax_pair(dev, idb.ptr, valb.ptr, v0s[r], pair.ptr)
            parts.append(get(dev, pair, "u32", 2))
    res = out(dev, "i32", 1)
    if exchange == "digits":
        src = up(dev, summed(parts, range(world)))
        ops.decode_argmax_lanes(dev, src.ptr, world, res.ptr)
    else:
        src = up(dev, np.stack(parts))
        ops.decode_argmax_pairs(dev, src.ptr, world, res.ptr)
    return int(get(dev, res, "i32", 1)[0]), parts


@pytest.mark.parametrize("exchange", ["digits", "pairs"])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_device_kernels_match_host(dev, world, exchange, rng):
    n = 154880 // 4
    for trial in range(6):
        vals = rng.standard_normal(world).astype(np.float32).astype(BF16).astype(np.float32)
        if trial % 2 == 0:
            vals[1] = vals[world - 1] = vals.max() + 0.5    # a tie: rank 1 must win
        local = [int(x) for x in rng.integers(0, n, world)]
        v0s = [r * n for r in range(world)]
        got, parts = _device_exchange(dev, world, vals, local, v0s, exchange)
        ids = [v0s[r] + local[r] for r in range(world)]
        assert got == expected(vals, ids)[1]
        for r in range(world):
            host = pack_lanes(r, world, vals[r], ids[r]) if exchange == "digits" else pack_pair(vals[r], ids[r])
            np.testing.assert_array_equal(parts[r].view(np.uint16 if exchange == "digits" else np.uint32),
                                          host.view(np.uint16 if exchange == "digits" else np.uint32))


def test_widen(dev, rng):
    x = rng.standard_normal(1000).astype(BF16)
    xb, y = up(dev, x), out(dev, "f32", 1000)
    ops.widen_bf16_f32(dev, xb.ptr, y.ptr, 1000)
    np.testing.assert_array_equal(get(dev, y, "f32", 1000), x.astype(np.float32))
