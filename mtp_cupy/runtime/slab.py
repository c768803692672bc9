"""The attention-metadata slab: the one home of its layout, shared by Python, the NumPy twins and (through
cuda_src/meta.cuh, which tests/test_slab.py checks against this file) the CUDA kernels.

One slab describes one decode row of one sequence (little endian):

    offset   field        type     meaning
    0        pos          u32      RoPE position of the row
    8        slot         i64      cache slot the row is written to (block * BLOCK_SIZE + row % BLOCK_SIZE)
    16       seq_len      i32      rows the attention reads, the new one included
    256      block_table  i32[]    the sequence's cache blocks, in row order

B sequences (or B verify rows) use B slabs `stride(max_seq_len)` bytes apart; a slab is sized for the whole
max_seq_len table, so a captured CUDA graph never outgrows it."""
from __future__ import annotations

POS_OFFSET = 0
SLOT_OFFSET = 8
SEQ_LEN_OFFSET = 16
TABLE_OFFSET = 256
BLOCK_SIZE = 16          # cache rows per KV block
STRIDE_ALIGN = 256       # slabs of a batch start on this many bytes


def blocks_for(rows: int, block_size: int = BLOCK_SIZE) -> int:
    """KV blocks that hold `rows` rows."""
    return (int(rows) + block_size - 1) // block_size


def slab_bytes(max_seq_len: int) -> int:
    """Bytes one slab needs for a sequence of up to max_seq_len rows."""
    return TABLE_OFFSET + 4 * blocks_for(max_seq_len)


def stride(max_seq_len: int) -> int:
    """Distance in bytes between consecutive slabs of a batch."""
    return -(-slab_bytes(max_seq_len) // STRIDE_ALIGN) * STRIDE_ALIGN
