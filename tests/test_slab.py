"""The metadata slab has one layout (mtp_cupy/runtime/slab.py): cuda_src/meta.cuh spells the same constants, the
packers in runtime/arena.py write it, the twins' accessors (refdev/access.py) read it, and every slab reader
(attention, DSA, and rope / kv_cache through (meta + offset, meta_stride) pairs) agrees with a host reference
over slabs at a stride that is not slab.stride()'s, on the NumPy device and, where CUDA exists, on the GPU."""
import math
import re
from pathlib import Path

import numpy as np
import pytest

from mtp_cupy import ops
from mtp_cupy.cache.paged import PagedKvCache
from mtp_cupy.refdev import access
from mtp_cupy.refdev.backend import RefBackend
from mtp_cupy.runtime import slab
from mtp_cupy.runtime.arena import pack_mtp_attn_meta, stage_mtp_meta, unpack_mtp_attn_meta
from mtp_cupy.runtime.backend import CUDA_SRC
from helpers import assert_close, f32, get, out, rand_bf16, run_on_both, up

TWINS = Path(access.__file__).parent / "twins"


def meta_cuh_constants() -> dict[str, int]:
    text = (CUDA_SRC / "meta.cuh").read_text()
    return {k: int(v) for k, v in re.findall(r"^#define\s+(\w+)\s+(\d+)\b", text, re.M)}


# -- one spec ------------------------------------------------------------------------------------------------

def test_meta_cuh_matches_slab_py():
    want = {"SLAB_POS_OFFSET": slab.POS_OFFSET, "SLAB_SLOT_OFFSET": slab.SLOT_OFFSET,
            "SLAB_SEQ_LEN_OFFSET": slab.SEQ_LEN_OFFSET, "SLAB_TABLE_OFFSET": slab.TABLE_OFFSET,
            "KV_BLOCK_SIZE": slab.BLOCK_SIZE, "KV_BLOCK_SHIFT": int(math.log2(slab.BLOCK_SIZE)),
            "KV_BLOCK_MASK": slab.BLOCK_SIZE - 1}
    assert meta_cuh_constants() == want  # every constant of meta.cuh is checked, none is missing


def test_slab_fields_are_aligned_and_disjoint():
    fields = sorted([(slab.POS_OFFSET, 4), (slab.SLOT_OFFSET, 8), (slab.SEQ_LEN_OFFSET, 4)])
    for off, size in fields:
        assert off % size == 0, f"field at {off} is not {size}-byte aligned"
    for (a, na), (b, _) in zip(fields, fields[1:]):
        assert a + na <= b, "slab fields overlap"
    assert fields[-1][0] + fields[-1][1] <= slab.TABLE_OFFSET and slab.TABLE_OFFSET % 16 == 0
    assert slab.BLOCK_SIZE & (slab.BLOCK_SIZE - 1) == 0
    assert PagedKvCache.blocks_for(33) == slab.blocks_for(33) == -(-33 // slab.BLOCK_SIZE)
    for n in (1, 16, 17, 4096, 262144):
        assert slab.slab_bytes(n) == slab.TABLE_OFFSET + 4 * slab.blocks_for(n) <= slab.stride(n)
        assert slab.stride(n) % slab.STRIDE_ALIGN == 0 and slab.stride(n) - slab.slab_bytes(n) < slab.STRIDE_ALIGN


def test_no_slab_literals_outside_the_spec():
    """Kernels that read a slab or a block table include meta.cuh and spell no offset or block size
    themselves; twins read slabs only through refdev/access.py."""
    readers = []
    for cu in sorted(CUDA_SRC.glob("*.cu")):
        src = cu.read_text()
        code = re.sub(r"//[^\n]*", "", src)
        if re.search(r"\bmeta_stride\b|\btable\s*\[", code):
            readers.append(cu.stem)
            assert '#include "meta.cuh"' in src, f"{cu.name} reads slabs or block tables without meta.cuh"
        assert not re.search(r"\b(slab|meta)\s*\+\s*\d", code), f"{cu.name}: a literal slab offset"
        assert not re.search(r"table\s*\[[^\]]*(>>|/)\s*\d", code), f"{cu.name}: a literal block size"
    assert {"paged_attention", "dsa"} <= set(readers)
    for py in sorted(TWINS.glob("*.py")):
        code = py.read_text()
        assert not re.search(r"slab\.offset\(\s*\d", code), f"{py.name}: a literal slab offset"
        assert not re.search(r"\b(r|j|rows?)\s*//\s*16\b", code), f"{py.name}: a literal block size"


# -- packers -> twin accessors ---------------------------------------------------------------------------------

def _read(dev, meta, stride, s, rows_in_table):
    p = access.meta_slab(meta, stride, s)
    return (access.slab_pos(dev, p), access.slab_slot(dev, p), access.slab_seq_len(dev, p),
            access.slab_table(dev, p, rows_in_table))


def _slot(table, row):
    """Independent of slab.py: the contract's table[r // 16] * 16 + r % 16."""
    return int(table[row // 16]) * 16 + row % 16


def test_packed_slab_reads_back_through_the_twin_accessors(rng):
    dev = RefBackend()
    B = 5
    stride = slab.stride(4096) + 8 * int(rng.integers(1, 32))  # not the batch default
    buf = dev.alloc(B * stride)
    dev.fill(buf.ptr, B * stride, 0xFF)
    want = []
    for s in range(B):
        n = int(rng.integers(1, 4096))
        table = rng.choice(1 << 20, slab.blocks_for(n), replace=False)
        pos, slot = int(rng.integers(0, 1 << 32)), int(rng.integers(-(1 << 40), 1 << 40))
        raw = pack_mtp_attn_meta(pos, slot, n, table, stride)
        assert unpack_mtp_attn_meta(raw, len(table)) == (pos, slot, n, table.tolist())
        dev.copy_h2d(buf.ptr.offset(s * stride), raw)
        want.append((pos, slot, n, table))
    for s, (pos, slot, n, table) in enumerate(want):
        got = _read(dev, buf.ptr, stride, s, n)
        assert got[:3] == (pos, slot, n)
        np.testing.assert_array_equal(got[3], table)
        rows = rng.integers(0, n, 50)
        np.testing.assert_array_equal(access.kv_slots(got[3], rows), [_slot(table, int(r)) for r in rows])


@pytest.mark.parametrize("B,as_array", [(1, False), (4, False), (4, True), (9, True)])
def test_staged_slabs_read_back_through_the_twin_accessors(rng, B, as_array):
    """stage_mtp_meta (k steps, B sequences; B == 1 is propose's scalar path) at a non-default stride, from
    lists of block ids or from an int32 [B, L] array with lens (the cache mirror's form, junk past lens)."""
    dev, k = RefBackend(), 3
    max_len = 2000
    stride = slab.stride(max_len) + 8 * int(rng.integers(1, 32)) if B > 1 else 0
    row_bytes = B * stride if B > 1 else slab.stride(max_len)
    tables = [rng.choice(5000, int(rng.integers(1, slab.blocks_for(max_len) + 1)), replace=False).tolist()
              for _ in range(B)]
    rows0 = [int(rng.integers(0, len(t) * 16 - k + 1)) for t in tables]
    positions = [int(rng.integers(0, 1 << 30)) for _ in range(B)]
    stage = np.full((k + 1, row_bytes), 0xAB, np.uint8)
    if as_array:
        lens = [len(t) for t in tables]
        arr = rng.integers(0, 1 << 30, (B, max(lens) + 3)).astype(np.int32)
        for s, t in enumerate(tables):
            arr[s, :len(t)] = t
        stage_mtp_meta(stage, k, positions, rows0, arr, 16, stride, lens=lens)
    else:
        stage_mtp_meta(stage, k, positions, rows0, tables, 16, stride)
    buf = dev.upload(stage)
    for i in range(k):
        meta = buf.ptr.offset(i * row_bytes)
        for s, table in enumerate(tables):
            row = rows0[s] + i
            pos, slot, seq_len, tab = _read(dev, meta, stride, s, len(table) * 16)
            assert (pos, slot, seq_len) == (positions[s] + i, _slot(table, row), row + 1)
            np.testing.assert_array_equal(tab, table)
            assert access.kv_slots(tab, np.array([row]))[0] == slot


# -- slab readers over slabs at a non-default stride -----------------------------------------------------------

class Batch:
    """B sequences with shuffled block tables; one decode row each (the last), staged at a stride that is
    slab.stride(max_len) plus a non-multiple of 256, 0xFF junk in every byte no field covers."""

    def __init__(self, rng, seq_lens, row_elems, spare_blocks=5):
        self.seq_lens = list(seq_lens)
        need = [slab.blocks_for(n) for n in self.seq_lens]
        ids = rng.permutation(sum(need) + spare_blocks)
        self.tables, at = [], 0
        for nb in need:
            self.tables.append([int(b) for b in ids[at:at + nb]])
            at += nb
        self.n_slots = (sum(need) + spare_blocks) * 16
        self.pool = rand_bf16(rng, (self.n_slots, row_elems))
        self.positions = [int(p) for p in rng.integers(0, 1 << 20, len(self.seq_lens))]
        self.stride = slab.stride(max(self.seq_lens)) + 8 * int(rng.integers(1, 32))
        self.meta = np.full((1, len(self.seq_lens) * self.stride), 0xFF, np.uint8)
        stage_mtp_meta(self.meta, 1, self.positions, [n - 1 for n in self.seq_lens], self.tables, 16,
                       self.stride)
        self.meta = self.meta[0]

    def rows(self, s, rows):
        t = self.tables[s]
        return self.pool[[_slot(t, int(r)) for r in rows]].astype(np.float64)

    def last_slots(self):
        return [_slot(t, n - 1) for t, n in zip(self.tables, self.seq_lens)]


def softmax_attend(q, k, v, scale):
    s = q @ k.T * scale
    e = np.exp(s - s.max(axis=1, keepdims=True))
    return (e @ v) / e.sum(axis=1)[:, None]


def run_mla(dev, b, q, heads, rw, dv, scale):
    n = len(b.seq_lens)
    qb, cb, mb, ob = up(dev, q), up(dev, b.pool), up(dev, b.meta), out(dev, "bf16", (n, heads, dv))
    ops.mla_decode(dev, qb.ptr, cb.ptr, mb.ptr, b.stride, ob.ptr, n, heads, rw, dv, scale)
    return f32(get(dev, ob, "bf16", (n, heads, dv)))


def run_gqa(dev, b, v_pool, q, qh, kvh, hd, scale):
    n = len(b.seq_lens)
    qb, kb, vb, mb = up(dev, q), up(dev, b.pool), up(dev, v_pool), up(dev, b.meta)
    ob = out(dev, "bf16", (n, qh, hd))
    ops.gqa_decode(dev, qb.ptr, qh * hd, kb.ptr, vb.ptr, mb.ptr, b.stride, ob.ptr, n, qh, kvh, hd, scale)
    return f32(get(dev, ob, "bf16", (n, qh, hd)))


def run_scores(dev, b, q, w, heads, hd):
    n, width = len(b.seq_lens), max(b.seq_lens) + 3
    qb, wb, cb, mb, sc = up(dev, q), up(dev, w), up(dev, b.pool), up(dev, b.meta), out(dev, "f32", (n, width))
    ops.dsa_index_scores(dev, qb.ptr, wb.ptr, cb.ptr, mb.ptr, b.stride, sc.ptr, n, heads, hd, width, 0.1)
    return get(dev, sc, "f32", (n, width))


def run_topk(dev, b, scores, k):
    n, width = scores.shape
    sb, mb, sel = up(dev, scores), up(dev, b.meta), out(dev, "i32", (n, k + 2))
    ops.dsa_topk(dev, sb.ptr, width, mb.ptr, b.stride, sel.ptr, k + 2, n, k)
    return get(dev, sel, "i32", (n, k + 2))


def run_rope_and_cache(dev, b, x, heads, hd, inv_freq):
    """rope on x [B, heads*hd] at the slabs' positions, then each row into the pool at the slabs' slots."""
    n = len(b.seq_lens)
    xb, mb, fb, cb = up(dev, x), up(dev, b.meta), up(dev, inv_freq), up(dev, b.pool)
    ops.rope(dev, xb.ptr, mb.ptr.offset(slab.POS_OFFSET), b.stride, n, heads, hd, hd, 0, heads * hd, hd, fb.ptr,
             True)
    ops.reshape_and_cache(dev, xb.ptr, heads * hd, mb.ptr.offset(slab.SLOT_OFFSET), b.stride, cb.ptr, n,
                          heads * hd, b.pool.shape[1], 0)
    return get(dev, xb, "bf16", x.shape), get(dev, cb, "bf16", b.pool.shape)


SEQS = [1, 16, 17, 90, 300]


def test_attention_reads_slabs_at_any_stride(dev, rng):
    heads, rw, dv = 4, 128, 64
    b = Batch(rng, SEQS, rw)
    q = rand_bf16(rng, (len(SEQS), heads, rw))
    got = run_mla(dev, b, q, heads, rw, dv, 0.1)
    for s, n in enumerate(SEQS):
        kv = b.rows(s, range(n))
        assert_close(got[s], softmax_attend(f32(q[s]).astype(np.float64), kv, kv[:, :dv], 0.1), 1e-2, f"mla {s}")
    qh, kvh, hd = 4, 2, 64
    v_pool = rand_bf16(rng, b.pool.shape)
    q = rand_bf16(rng, (len(SEQS), qh * hd))
    got = run_gqa(dev, b, v_pool, q, qh, kvh, hd, 0.125)
    for s, n in enumerate(SEQS):
        k, v = b.rows(s, range(n)), v_pool[[_slot(b.tables[s], r) for r in range(n)]].astype(np.float64)
        for h in range(qh):
            c = slice((h // (qh // kvh)) * hd, (h // (qh // kvh) + 1) * hd)
            ref = softmax_attend(f32(q[s, h * hd:(h + 1) * hd]).astype(np.float64)[None], k[:, c], v[:, c], 0.125)
            assert_close(got[s, h], ref[0], 1e-2, f"gqa {s}/{h}")


def test_dsa_reads_slabs_at_any_stride(dev, rng):
    heads, hd, k = 4, 64, 20
    b = Batch(rng, SEQS, hd)
    q = rand_bf16(rng, (len(SEQS), heads, hd))
    w = rng.standard_normal((len(SEQS), heads)).astype(np.float32)
    sc = run_scores(dev, b, q, w, heads, hd)
    sel = run_topk(dev, b, sc, k)
    for s, n in enumerate(SEQS):
        ref = 0.1 * (w[s].astype(np.float64) @ np.maximum(f32(q[s]).astype(np.float64) @ b.rows(s, range(n)).T, 0))
        assert_close(sc[s, :n], ref, 1e-5, f"scores {s}")
        top = np.sort(np.argsort(-sc[s, :n].astype(np.float64), kind="stable")[:min(k, n)])
        np.testing.assert_array_equal(sel[s, :len(top)], top)
        assert np.all(sel[s, len(top):] == -1)


def test_rope_and_cache_read_slab_fields_at_any_stride(dev, rng):
    heads, hd = 2, 32
    b = Batch(rng, SEQS, heads * hd + 16)
    x = rand_bf16(rng, (len(SEQS), heads * hd))
    inv_freq = (10000.0 ** (-np.arange(0, hd, 2) / hd)).astype(np.float32)
    xr, pool = run_rope_and_cache(dev, b, x, heads, hd, inv_freq)
    for s, p in enumerate(b.positions):
        theta = (np.float32(p) * inv_freq).astype(np.float64)
        v = f32(x[s]).astype(np.float64).reshape(heads, hd // 2, 2)
        ref = np.stack([v[..., 0] * np.cos(theta) - v[..., 1] * np.sin(theta),
                        v[..., 1] * np.cos(theta) + v[..., 0] * np.sin(theta)], -1).reshape(-1)
        assert_close(f32(xr[s]), ref, 1e-2, f"rope {s}")
    want = b.pool.copy()
    want[b.last_slots(), :heads * hd] = xr
    np.testing.assert_array_equal(pool.view(np.uint16), want.view(np.uint16))


@pytest.mark.gpu
def test_slab_readers_cuda_vs_twin_at_a_nondefault_stride(rng):
    """Every slab reader on CUDA against its twin, over the same slabs (stride not slab.stride's)."""
    seqs = [1, 17, 700, 2049, 33]
    b = Batch(rng, seqs, 576)
    q = rand_bf16(rng, (len(seqs), 16, 576))
    a, g = run_on_both(run_mla, b, q, 16, 576, 512, 0.0625)
    assert_close(g, a.astype(np.float64), 1e-2, "mla_decode")
    q = rand_bf16(rng, (len(seqs), 8 * 128))
    bg = Batch(rng, seqs, 2 * 128)
    a, g = run_on_both(run_gqa, bg, rand_bf16(rng, bg.pool.shape), q, 8, 2, 128, 128 ** -0.5)
    assert_close(g, a.astype(np.float64), 1e-2, "gqa_decode")
    bd = Batch(rng, seqs, 128)
    q, w = rand_bf16(rng, (len(seqs), 8, 128)), rng.standard_normal((len(seqs), 8)).astype(np.float32)
    sa, sg = run_on_both(run_scores, bd, q, w, 8, 128)
    for s, n in enumerate(seqs):
        assert_close(sg[s, :n], sa[s, :n], 1e-5, f"dsa scores {s}")
    la, lg = run_on_both(run_topk, bd, sa, 256)   # the same scores into both: the same selections
    np.testing.assert_array_equal(lg, la)
    br = Batch(rng, seqs, 4 * 64)
    x = rand_bf16(rng, (len(seqs), 4 * 64))
    inv_freq = (10000.0 ** (-np.arange(0, 64, 2) / 64)).astype(np.float32)
    (xa, pa), (xg, pg) = run_on_both(run_rope_and_cache, br, x, 4, 64, inv_freq)
    assert_close(f32(xg), f32(xa), 1e-2, "rope")
    np.testing.assert_array_equal(pg.view(np.uint16)[br.last_slots()], xg.view(np.uint16))
