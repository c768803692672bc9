"""Launchers for cuda_src/vocab_argmax.cu (the cross-rank argmax of a vocab-sharded head; the exchange
itself is in mtp_cupy/speculative/vocab_argmax.py)."""
from ._util import THREADS, blocks_for, launch, need

__all__ = ["pack_argmax_lanes", "decode_argmax_lanes", "pack_argmax_pair", "decode_argmax_pairs", "widen_bf16_f32"]

MAX_ID = 1 << 24   # three base-256 digits


def _world(name: str, world: int) -> None:
    need(1 <= world <= 1024, f"{name}: world {world} outside [1, 1024]")


def _rows(name: str, rows: int) -> None:
    need(1 <= rows <= 65535, f"{name}: rows {rows} outside [1, 65535]")


def pack_argmax_lanes(gpu, local_id, val, v0, rank, world, lanes, rows=1, stream=None):
    """For each of `rows` rows: lanes bf16 [4 * world] (row r at lanes + r * 4 * world) = zeros but lane `rank`
    = bf16(val[r]) and lanes world + 3 rank + d = digit d of the global id v0 + local_id[r] (i32 / f32 device
    arrays)."""
    _world("pack_argmax_lanes", world)
    _rows("pack_argmax_lanes", rows)
    need(0 <= rank < world, f"pack_argmax_lanes: rank {rank} outside world {world}")
    need(0 <= v0 < MAX_ID, f"pack_argmax_lanes: vocab offset {v0} needs more than three base-256 digits")
    launch(gpu, "vocab_argmax", "pack_argmax_lanes").grid(rows).block(min(THREADS, -(-4 * world // 32) * 32)) \
        .arg_ptr(local_id).arg_ptr(val).arg_u32(v0).arg_u32(rank).arg_u32(world).arg_ptr(lanes).arg_u32(rows) \
        .launch(stream)


def decode_argmax_lanes(gpu, lanes, world, out_id, rows=1, stream=None):
    """out_id[r] (i32) = the global id of the rank with the largest value lane of row r, ties to the lower rank."""
    _world("decode_argmax_lanes", world)
    _rows("decode_argmax_lanes", rows)
    launch(gpu, "vocab_argmax", "decode_argmax_lanes").grid(blocks_for(rows, 64)).block(64).arg_ptr(lanes) \
        .arg_u32(world).arg_ptr(out_id).arg_u32(rows).launch(stream)


def pack_argmax_pair(gpu, local_id, val, v0, pair, rows=1, stream=None):
    """pair[r] (8 bytes) = (f32 val[r], i32 v0 + local_id[r])."""
    need(0 <= v0 < 1 << 31, f"pack_argmax_pair: vocab offset {v0} does not fit i32")
    _rows("pack_argmax_pair", rows)
    launch(gpu, "vocab_argmax", "pack_argmax_pair").grid(blocks_for(rows, 64)).block(64).arg_ptr(local_id) \
        .arg_ptr(val).arg_u32(v0).arg_ptr(pair).arg_u32(rows).launch(stream)


def decode_argmax_pairs(gpu, pairs, world, out_id, rows=1, stream=None):
    """out_id[r] (i32) = the id of the largest of row r's `world` gathered pairs (pairs u32 [world, rows, 2],
    as an all-gather of every rank's rows leaves them), ties to the lower rank."""
    _world("decode_argmax_pairs", world)
    _rows("decode_argmax_pairs", rows)
    launch(gpu, "vocab_argmax", "decode_argmax_pairs").grid(blocks_for(rows, 64)).block(64).arg_ptr(pairs) \
        .arg_u32(world).arg_ptr(out_id).arg_u32(rows).launch(stream)


def widen_bf16_f32(gpu, src, dst, n, stream=None):
    """dst f32 [n] = src bf16 [n] (exact)."""
    need(0 <= n < 1 << 31, f"widen_bf16_f32: {n} elements is out of range")
    launch(gpu, "vocab_argmax", "widen_bf16_f32").grid(blocks_for(n)).block(THREADS).arg_ptr(src).arg_ptr(dst) \
        .arg_u32(n).launch(stream)
