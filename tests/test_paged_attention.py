"""Paged decode attention (mla_decode, gqa_decode) against dense float64 softmax built from the block tables;
walk mode against split mode bit for bit."""
import copy

import numpy as np
import pytest

from mtp_cupy import KernelError, ops
from mtp_cupy.ops import paged_attention as pa
from mtp_cupy.runtime.arena import pack_mtp_attn_meta
from mtp_cupy.runtime.dtypes import BF16, to_fp8
from mtp_cupy.refdev.registry import names_in
from mtp_cupy.runtime.backend import cuda_kernel_names
from mtp_cupy.runtime.ptr import NULL
from helpers import assert_close, f32, get, launched, out, rand_bf16, run_on_both, up

META_STRIDE = 1024  # room for 192 block ids per slab


class Paged:
    """Sequences whose rows live at random, non-contiguous blocks of a pool; the host keeps the pool."""

    def __init__(self, rng, seq_lens, row_elems, dtype="bf16", spare_blocks=7):
        self.seq_lens = list(seq_lens)
        need = [-(-n // 16) for n in self.seq_lens]
        ids = rng.permutation(sum(need) + spare_blocks)
        self.tables, at = [], 0
        for k in need:
            self.tables.append(ids[at:at + k].tolist())
            at += k
        shape = ((sum(need) + spare_blocks) * 16, row_elems)
        self.pool = to_fp8(rng.standard_normal(shape) * 2) if dtype == "fp8" else rand_bf16(rng, shape)

    def meta(self):
        slabs = bytearray()
        for n, t in zip(self.seq_lens, self.tables):
            slab = pack_mtp_attn_meta(max(n - 1, 0), 0, n, t, META_STRIDE)
            slabs += slab + bytes(META_STRIDE - len(slab))
        return np.frombuffer(bytes(slabs), np.uint8)

    def take(self, idx):
        """The sequences idx (in that order) over the same pool."""
        sub = copy.copy(self)
        sub.seq_lens, sub.tables = [self.seq_lens[i] for i in idx], [self.tables[i] for i in idx]
        return sub

    def rows(self, s, rows):
        """float64 pool rows of logical rows `rows` of sequence s."""
        t = np.asarray(self.tables[s], dtype=np.int64)
        r = np.asarray(rows, dtype=np.int64)
        return self.pool[t[r // 16] * 16 + r % 16].astype(np.float64)


def softmax_attend(q, k, v, scale, sink=None):
    """q [H, d], k [n, d], v [n, dv] float64; sink [H] joins the denominator. No rows -> zeros."""
    if k.shape[0] == 0:
        return np.zeros((q.shape[0], v.shape[1]))
    s = q @ k.T * scale
    m = s.max(axis=1, keepdims=True) if sink is None else np.maximum(s.max(axis=1), sink)[:, None]
    e = np.exp(s - m)
    den = e.sum(axis=1) + (0.0 if sink is None else np.exp(sink - m[:, 0]))
    return (e @ v) / den[:, None]


def run_mla(dev, pg, q, heads, row_width, v_width, scale, window=0, sink=None, sel=None, poison_ws=False, *,
            kv_dtype="bf16", nope=0, invariant=False, walk=None, bits=False, group=None):
    """float32 of the bf16 output, or (bits) its raw uint16 bits. pg.pool is uploaded as is (the blocked fp8
    rows' bytes for kv_dtype "fp8")."""
    n = len(pg.seq_lens)
    qb, cb, mb = up(dev, q), up(dev, pg.pool), up(dev, pg.meta())
    sk = up(dev, np.asarray(sink, np.float32)) if sink is not None else None
    sb = up(dev, np.asarray(sel, np.int32)) if sel is not None else None
    ob = out(dev, "bf16", (n, heads, v_width))
    ws_bytes = ops.attention_workspace_bytes(n, heads, v_width, -(-heads // 32), invariant)
    ws = out(dev, "u8", ws_bytes) if poison_ws else None  # NaN in unused partials must never leak into the output
    ops.mla_decode(dev, qb.ptr, cb.ptr, mb.ptr, META_STRIDE, ob.ptr, n, heads, row_width, v_width, scale,
                   window=window, sink=sk.ptr if sk else NULL, sel=sb.ptr if sb else NULL,
                   sel_stride=sel.shape[1] if sel is not None else 0, kv_dtype=kv_dtype, nope=nope,
                   workspace=ws.ptr if ws else None, invariant=invariant, walk=walk, group=group)
    got = get(dev, ob, "bf16", (n, heads, v_width))
    return np.asarray(got).view(np.uint16) if bits else f32(got)


def mla_ref(pg, q, v_width, scale, window=0, sink=None, sel=None):
    res = []
    for s, n in enumerate(pg.seq_lens):
        lo = n - window if 0 < window < n else 0
        rows = np.arange(lo, n) if sel is None else [r for r in sel[s] if lo <= r < n]
        kv = pg.rows(s, rows) if len(rows) else np.zeros((0, q.shape[-1]))
        res.append(softmax_attend(f32(q[s]).astype(np.float64), kv, kv[:, :v_width], scale, sink))
    return np.stack(res)


def check(got, ref):
    assert np.all(np.isfinite(got))
    assert_close(got, ref, 1e-2)


SEQS = [1, 15, 16, 17, 300]


@pytest.mark.parametrize("heads,row_width,v_width", [(5, 192, 128), (3, 64, 64)])
def test_mla_dense(dev, rng, heads, row_width, v_width):
    pg = Paged(rng, SEQS, row_width)
    q = rand_bf16(rng, (len(SEQS), heads, row_width))
    scale = row_width ** -0.5 * 1.5
    check(run_mla(dev, pg, q, heads, row_width, v_width, scale, poison_ws=True),
          mla_ref(pg, q, v_width, scale))


@pytest.mark.parametrize("window,with_sink", [(8, True), (128, True), (40, False)])
def test_mla_window_sink(dev, rng, window, with_sink):
    seqs, heads, rw = [1, 7, 8, 9, 140, 300], 4, 128
    pg = Paged(rng, seqs, rw)
    q = rand_bf16(rng, (len(seqs), heads, rw))
    sink = rng.standard_normal(heads).astype(np.float32) * 2 if with_sink else None
    check(run_mla(dev, pg, q, heads, rw, rw, 0.12, window=window, sink=sink),
          mla_ref(pg, q, rw, 0.12, window=window, sink=sink))


def test_mla_selection(dev, rng):
    seqs, heads, rw, dv, width = [1, 17, 300, 90], 6, 192, 128, 320
    pg = Paged(rng, seqs, rw)
    q = rand_bf16(rng, (len(seqs), heads, rw))
    every = np.full((len(seqs), width), -1, np.int32)   # every row, shuffled among -1 padding
    some = np.full((len(seqs), width), -1, np.int32)    # a random subset
    for s, n in enumerate(seqs):
        every[s, rng.choice(width, n, replace=False)] = rng.permutation(n)
        k = rng.integers(0, n + 1)
        some[s, rng.choice(width, k, replace=False)] = rng.choice(n, k, replace=False)
    some[0, :] = -1  # a sequence that selects nothing -> zeros
    dense = mla_ref(pg, q, dv, 0.1)
    check(run_mla(dev, pg, q, heads, rw, dv, 0.1, sel=every), dense)
    check(run_mla(dev, pg, q, heads, rw, dv, 0.1, window=50, sel=every),  # entries outside the window drop
          mla_ref(pg, q, dv, 0.1, window=50))
    got = run_mla(dev, pg, q, heads, rw, dv, 0.1, sel=some)
    check(got[1:], mla_ref(pg, q, dv, 0.1, sel=some)[1:])
    assert np.all(got[0] == 0)


def run_gqa(dev, kc, vc, q, q_row_stride, q_heads, kv_heads, hd, scale, kv_dtype, kv_scale, *, invariant=False,
            walk=None, bits=False, poison_ws=False, group=None):
    n = len(kc.seq_lens)
    qb, kb, vb = up(dev, q), up(dev, kc.pool), up(dev, vc.pool)
    mb = up(dev, kc.meta())
    ob = out(dev, "bf16", (n, q_heads, hd))
    blocks = q_heads // min(q_heads // kv_heads, 32)
    ws = out(dev, "u8", ops.attention_workspace_bytes(n, q_heads, hd, blocks, invariant)) if poison_ws else None
    ops.gqa_decode(dev, qb.ptr, q_row_stride, kb.ptr, vb.ptr, mb.ptr, META_STRIDE, ob.ptr, n, q_heads, kv_heads,
                   hd, scale, kv_dtype=kv_dtype, kv_scale=kv_scale, workspace=ws.ptr if ws else None,
                   invariant=invariant, walk=walk, group=group)
    got = get(dev, ob, "bf16", (n, q_heads, hd))
    return np.asarray(got).view(np.uint16) if bits else f32(got)


def gqa_ref(kc, vc, q, q_heads, kv_heads, hd, scale, kv_scale):
    g = q_heads // kv_heads
    res = np.zeros((len(kc.seq_lens), q_heads, hd))
    for s, n in enumerate(kc.seq_lens):
        k, v = kc.rows(s, np.arange(n)) * kv_scale, vc.rows(s, np.arange(n)) * kv_scale
        for h in range(q_heads):
            c = slice((h // g) * hd, (h // g + 1) * hd)
            qh = f32(q[s, h * hd:(h + 1) * hd]).astype(np.float64)[None]
            res[s, h] = softmax_attend(qh, k[:, c], v[:, c], scale)[0]
    return res


@pytest.mark.parametrize("kv_dtype,kv_scale", [("bf16", 1.0), ("fp8", 0.37)])
@pytest.mark.parametrize("q_heads,kv_heads,hd", [(8, 2, 64), (6, 3, 128)])
def test_gqa(dev, rng, kv_dtype, kv_scale, q_heads, kv_heads, hd):
    seqs = [1, 16, 17, 300]
    kc = Paged(rng, seqs, kv_heads * hd, kv_dtype)
    vc = Paged(rng, seqs, kv_heads * hd, kv_dtype)
    vc.tables = kc.tables  # one block table addresses both caches
    stride = q_heads * hd + 64  # q rows padded (e.g. a slice of a wider projection)
    q = rand_bf16(rng, (len(seqs), stride))
    scale = hd ** -0.5 * 1.5
    check(run_gqa(dev, kc, vc, q, stride, q_heads, kv_heads, hd, scale, kv_dtype, kv_scale),
          gqa_ref(kc, vc, q, q_heads, kv_heads, hd, scale, kv_scale))


def test_launchers_reject_bad_shapes(ref):
    with pytest.raises(KernelError, match="row_width"):
        ops.mla_decode(ref, 256, 256, 256, META_STRIDE, 256, 1, 4, 600, 512, 0.1)
    with pytest.raises(KernelError, match="v_width"):
        ops.mla_decode(ref, 256, 256, 256, META_STRIDE, 256, 1, 4, 128, 192, 0.1)
    with pytest.raises(KernelError, match="multiple of kv_heads"):
        ops.gqa_decode(ref, 256, 512, 256, 256, 256, META_STRIDE, 256, 1, 6, 4, 64, 0.1)
    with pytest.raises(KernelError, match="head_dim"):     # widths need not fill the 64-column tile, but 8
        ops.gqa_decode(ref, 256, 512, 256, 256, 256, META_STRIDE, 256, 1, 8, 2, 100, 0.1)
    with pytest.raises(KernelError, match="head_dim"):     # fp8 caches: 16-byte rows
        ops.gqa_decode(ref, 256, 512, 256, 256, 256, META_STRIDE, 256, 1, 8, 2, 40, 0.1, kv_dtype="fp8")
    with pytest.raises(KernelError, match="out_gate needs a gate"):
        ops.gqa_decode(ref, 256, 512, 256, 256, 256, META_STRIDE, 256, 1, 8, 2, 64, 0.1, out_gate=(NULL, 128, 64))
    for span, mc in ((-1, 32), (128, 0)):
        with pytest.raises(KernelError, match="span"):
            ops.attention_workspace_bytes(1, 64, 512, 2, True, span, mc)


def test_every_kernel_has_a_twin():
    """The backend finds kernels by parsing the source; each must have a twin of the same name."""
    assert sorted(cuda_kernel_names("paged_attention")) == names_in("paged_attention")

# -- CUDA vs twin at real model dims -----------------------------------------------------------------------

def _real_mla(rng, seqs, heads, rw, dv, window=0, with_sink=False, sel_of=None):
    pg = Paged(rng, seqs, rw)
    q = rand_bf16(rng, (len(seqs), heads, rw))
    sink = rng.standard_normal(heads).astype(np.float32) if with_sink else None
    sel = None
    if sel_of is not None:
        sel = np.full((len(seqs), sel_of), -1, np.int32)
        for s, n in enumerate(seqs):
            k = min(n, sel_of)
            sel[s, :k] = np.sort(rng.choice(n, k, replace=False))
    return pg, q, sink, sel


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["v3", "glm_dsa", "v4_window_sink", "batch32", "batch32_invariant"])
def test_mla_cuda_vs_twin_real_dims(rng, case):
    """batch32_invariant: invariant=True, which walks at that batch (128 blocks)."""
    heads, rw, dv, window, with_sink, sel_of, seqs = {
        "v3": (128, 576, 512, 0, False, None, [2048]),
        "glm_dsa": (64, 576, 512, 0, False, 2048, [3000]),
        "v4_window_sink": (64, 512, 512, 128, True, None, [2048]),
        "batch32": (128, 576, 512, 0, False, None, list(rng.integers(1, 700, 32))),
        "batch32_invariant": (128, 576, 512, 0, False, None, list(rng.integers(1, 2100, 32))),
    }[case]
    pg, q, sink, sel = _real_mla(rng, seqs, heads, rw, dv, window, with_sink, sel_of)
    scale = 0.13523378 if heads == 128 else 0.0625
    inv = case == "batch32_invariant"
    a, b = run_on_both(lambda d: run_mla(d, pg, q, heads, rw, dv, scale, window, sink, sel, invariant=inv))
    check(b, a.astype(np.float64))
    check(a, mla_ref(pg, q, dv, scale, window, sink, sel))


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
def test_gqa_cuda_vs_twin_qwen_dims(rng, kv_dtype):
    seqs, qh, kvh, hd = [2048, 5, 700], 16, 2, 256
    kc = Paged(rng, seqs, kvh * hd, kv_dtype)
    vc = Paged(rng, seqs, kvh * hd, kv_dtype)
    vc.tables = kc.tables
    q = rand_bf16(rng, (len(seqs), qh * hd))
    for walk in (False, True):
        a, b = run_on_both(lambda d: run_gqa(d, kc, vc, q, qh * hd, qh, kvh, hd, hd ** -0.5, kv_dtype, 0.5,
                                             walk=walk))
        check(b, a.astype(np.float64))


# -- attn_combine: which splits it reads -------------------------------------------------------------------
COMBINE_LIVE = {"first16": range(16), "scattered": [3, 17, 31, 32, 40, 63], "only33": [33], "none": [],
                "all64": range(64), "ends": [0, 63]}


def combine_ref(ml, o, sink):
    """float64 [S, H, dv]: sum_c e^(m_c - M) O_c / (sum_c e^(m_c - M) l_c (+ e^(sink - M))) over the live splits
    (m_c > -inf) of partials ml [S, C, H, 2], o [S, C, H, dv]; 0 where nothing was attended."""
    m, lv, o = ml[..., 0].astype(np.float64), ml[..., 1].astype(np.float64), o.astype(np.float64)
    on = m > -np.inf
    M = m.max(axis=1)                                                                # [S, H] (dead: -inf)
    if sink is not None:
        M = np.maximum(M, sink[None].astype(np.float64))
    e = np.where(on, np.exp(np.where(on, m, 0.0) - np.where(np.isfinite(M), M, 0.0)[:, None]), 0.0)   # [S, C, H]
    num = np.einsum("sch,schd->shd", e, np.where(on[..., None], o, 0.0))
    den = (e * np.where(on, lv, 0.0)).sum(axis=1)
    if sink is not None:
        den = den + np.where(np.isfinite(M), np.exp(sink[None] - M), 0.0)
    return np.where(den[..., None] > 0, num / np.where(den > 0, den, 1.0)[..., None], 0.0)


@pytest.mark.parametrize("with_sink", [False, True])
@pytest.mark.parametrize("live", sorted(COMBINE_LIVE))
def test_combine_reads_every_live_split_and_no_dead_one(dev, rng, live, with_sink):
    """attn_combine over hand-made partials of 64 splits (both 32-split words of its ballot; gaps between live
    splits): a dead split (m = -inf) holds NaN in its l and O, which must never reach the output; every live one,
    the last included, must be merged."""
    S, C, H, dv = 3, 64, 4, 64
    on = np.zeros(C, bool)
    on[list(COMBINE_LIVE[live])] = True
    m = (rng.standard_normal((S, C, H)) * 3).astype(np.float32)
    lv = rng.uniform(0.5, 4.0, (S, C, H)).astype(np.float32)
    o = rng.standard_normal((S, C, H, dv)).astype(np.float32)
    m[:, ~on], lv[:, ~on], o[:, ~on] = -np.inf, np.nan, np.nan
    ml = np.stack([m, lv], axis=-1)
    sink = rng.standard_normal(H).astype(np.float32) if with_sink else None
    wb, mb, ob = up(dev, o), up(dev, ml), out(dev, "bf16", (S, H, dv))
    sb = up(dev, sink) if with_sink else None
    pa._combine(dev, wb.ptr, mb.ptr, sb.ptr if sb else NULL, ob.ptr, S, H, dv, C, None)
    got = f32(get(dev, ob, "bf16", (S, H, dv)))
    check(got, combine_ref(ml, o, sink))
    if not on.any():
        assert np.all(got == 0)


# -- walk mode: split mode's bits --------------------------------------------------------------------------
# With invariant=True the split count is fixed per head-block count (33 splits for 4 head blocks, 64 for 2,
# chunks of at least 64 rows), so these lengths leave empty splits (all but 2100), a sequence of one row and
# one of none.
RAGGED = [0, 1, 31, 33, 65, 300, 2100]


def _batches(rng):
    """Sub-batches (1, 3, then all sequences, in a fresh order) of RAGGED."""
    perm = rng.permutation(len(RAGGED))
    return [perm[:1], perm[:3], perm]


def fp8_block_rows(rng, rows, width, nope):
    """(uint8 [rows, row_bytes], float64 [rows, width]): random blocked fp8 rows in the documented layout
    (`ops.fp8_block_layout`: e4m3 codes of [0, nope), bf16 columns [nope, width) at rope_off, one UE8M0 byte a
    64-block at scale_off) and what they decode to."""
    rope_off, scale_off, row_bytes = ops.fp8_block_layout(width, nope)
    nb = -(-nope // 64)
    codes = to_fp8(rng.standard_normal((rows, nope)) * 2)
    rope = rand_bf16(rng, (rows, width - nope))
    e = rng.integers(-3, 3, (rows, nb))
    raw = np.zeros((rows, row_bytes), np.uint8)
    raw[:, :nope] = codes.view(np.uint8)
    raw[:, rope_off:scale_off] = rope.view(np.uint8).reshape(rows, -1)
    raw[:, scale_off:scale_off + nb] = e + 127
    dec = np.empty((rows, width))
    dec[:, :nope] = codes.astype(np.float64) * np.exp2(np.repeat(e, 64, axis=1)[:, :nope])
    dec[:, nope:] = rope.astype(np.float64)
    return raw, dec


def _dsa_sel(rng, seqs, width):
    """Selections of width entries: real rows among -1 padding, rows past seq_len and negative ones, and a
    stretch of -1 covering whole chunks (splits that are not empty but attend nothing)."""
    sel = np.full((len(seqs), width), -1, np.int32)
    for s, n in enumerate(seqs):
        k = min(n, width - 40)
        at = rng.choice(width, k + 40, replace=False)
        sel[s, at[:k]] = rng.choice(n, k, replace=False)
        sel[s, at[k:k + 20]] = n + rng.integers(0, 1000, 20)      # out of range
        sel[s, at[k + 20:]] = -rng.integers(2, 50, 20)             # negative, not -1
        sel[s, 64:192] = -1
    return sel


WALK_MLA = {  # heads, row_width, v_width, window, sink, DSA selection width, fp8 nope
    "deepseek_v3": (128, 576, 512, 0, False, None, None),
    "glm5_dsa": (64, 576, 512, 0, False, 2048, None),
    "v4_window_sink": (64, 512, 512, 700, True, None, None),
    "v4_fp8_window_sink": (64, 512, 512, 128, True, None, 448),
}


def _mla_walk_inputs(rng, case, seqs):
    """(pg uploaded, pg of float64 rows for the reference, q, sink, sel, kwargs of run_mla)."""
    heads, rw, dv, window, with_sink, sel_w, nope = WALK_MLA[case]
    pg = Paged(rng, seqs, rw)
    ref_pg, kv_dtype = pg, "bf16"
    if nope is not None:
        raw, dec = fp8_block_rows(rng, pg.pool.shape[0], rw, nope)
        ref_pg, kv_dtype = copy.copy(pg), "fp8"
        pg.pool, ref_pg.pool = raw, dec
    q = rand_bf16(rng, (len(seqs), heads, rw))
    sink = rng.standard_normal(heads).astype(np.float32) * 2 if with_sink else None
    sel = _dsa_sel(rng, seqs, sel_w) if sel_w else None
    kw = dict(heads=heads, row_width=rw, v_width=dv, scale=rw ** -0.5, window=window, kv_dtype=kv_dtype,
              nope=nope or 0)
    return pg, ref_pg, q, sink, sel, kw


def _mla_modes(dev, pg, q, sink, sel, kw, idx):
    """(split, walk) raw bf16 bits of the sequences idx, invariant, split mode over a poisoned workspace."""
    def run(walk):
        return run_mla(dev, pg.take(idx), q[idx], sink=sink, sel=None if sel is None else sel[idx],
                       poison_ws=not walk, invariant=True, walk=walk, bits=True, **kw)
    return run(False), run(True)


def _gqa_walk_inputs(rng, kv_dtype, seqs):
    qh, kvh, hd = 16, 2, 256       # Qwen3-Next's gated attention
    kc, vc = Paged(rng, seqs, kvh * hd, kv_dtype), Paged(rng, seqs, kvh * hd, kv_dtype)
    vc.tables = kc.tables
    stride = qh * hd + 64
    return kc, vc, rand_bf16(rng, (len(seqs), stride)), (stride, qh, kvh, hd, hd ** -0.5, kv_dtype)


def _gqa_modes(dev, kc, vc, q, args, kv_scale, idx):
    def run(walk):
        return run_gqa(dev, kc.take(idx), vc.take(idx), q[idx], *args, kv_scale, invariant=True, walk=walk,
                       bits=True, poison_ws=not walk)
    return run(False), run(True)


def _same(split, walk, what):
    assert np.array_equal(walk, split), \
        f"{what}: walk != split on {np.count_nonzero(walk != split)} of {walk.size} elements"


def _modes_agree(rng, modes, what):
    """modes(idx) -> (split bits, walk bits) of the sequences idx, for every sub-batch: walk == split and each
    sequence's bits the same in every sub-batch. Returns f32 of every sequence's output, in order."""
    seen = {}
    for idx in _batches(rng):
        split, walk = modes(idx)
        _same(split, walk, f"{what}batch {idx.tolist()}")
        for j, s in enumerate(idx):
            assert np.array_equal(seen.setdefault(s, walk[j]), walk[j]), f"sequence {s} differs between batches"
    return f32(np.stack([seen[s] for s in range(len(RAGGED))]).view(BF16))


@pytest.mark.parametrize("case", sorted(WALK_MLA))
def test_mla_walk_is_split_bit_for_bit(dev, rng, case):
    """For every sub-batch: walk == split (raw bf16 bits, split mode over a poisoned workspace), a sequence's
    bits the same in every sub-batch (batch invariance across the two modes), both near the float64 reference."""
    pg, ref_pg, q, sink, sel, kw = _mla_walk_inputs(rng, case, RAGGED)
    got = _modes_agree(rng, lambda idx: _mla_modes(dev, pg, q, sink, sel, kw, idx), f"{case}, ")
    check(got, mla_ref(ref_pg, q, kw["v_width"], kw["scale"], kw["window"], sink, sel))
    assert np.all(got[RAGGED.index(0)] == 0)   # nothing attended -> zeros


@pytest.mark.parametrize("walk", [False, True])
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
def test_gqa_out_gate_is_decode_then_gate_mul(dev, rng, kv_dtype, walk):
    """out_gate (Qwen3-Next's sigmoid gate on the attention output) gives the bits of the call without it followed
    by sigmoid_gate_mul: inside attn_combine in split mode, by the launcher's launch after the walk."""
    kc, vc, q, (stride, qh, kvh, hd, scale, kvd) = _gqa_walk_inputs(rng, kv_dtype, [300, 17, 1, 40])
    n = len(kc.seq_lens)
    grow = 2 * qh * hd + 32                     # the gate halves interleave with q, as the layer's projection
    gate = rand_bf16(rng, (n, grow), 4.0)
    qb, kb, vb, mb, gb = up(dev, q), up(dev, kc.pool), up(dev, vc.pool), up(dev, kc.meta()), up(dev, gate)
    outs = []
    for fused in (True, False):
        ob = out(dev, "bf16", (n, qh, hd))
        ops.gqa_decode(dev, qb.ptr, stride, kb.ptr, vb.ptr, mb.ptr, META_STRIDE, ob.ptr, n, qh, kvh, hd, scale,
                       kv_dtype=kvd, kv_scale=0.37, invariant=True, walk=walk,
                       out_gate=(gb.ptr.offset(2 * hd), grow, 2 * hd) if fused else None)
        plain = np.asarray(get(dev, ob, "bf16", (n, qh, hd))).view(np.uint16).copy()
        if not fused:
            ops.sigmoid_gate_mul(dev, ob.ptr, gb.ptr.offset(2 * hd), ob.ptr, n, qh, hd, grow, 2 * hd)
        outs.append(np.asarray(get(dev, ob, "bf16", (n, qh, hd))).view(np.uint16))
    assert np.array_equal(outs[0], outs[1]), f"{np.count_nonzero(outs[0] != outs[1])} elements differ"
    assert not np.array_equal(outs[1], plain), "the gate moved nothing"


@pytest.mark.parametrize("kv_dtype,kv_scale", [("bf16", 1.0), ("fp8", 0.37)])
def test_gqa_walk_is_split_bit_for_bit(dev, rng, kv_dtype, kv_scale):
    """Qwen3-Next's gated attention (16 q heads, 2 KV heads, head_dim 256), as the MLA test."""
    kc, vc, q, args = _gqa_walk_inputs(rng, kv_dtype, RAGGED)
    got = _modes_agree(rng, lambda idx: _gqa_modes(dev, kc, vc, q, args, kv_scale, idx), "")
    check(got, gqa_ref(kc, vc, q, *args[1:4], args[4], kv_scale))


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(WALK_MLA) + ["qwen3_next_bf16", "qwen3_next_fp8"])
def test_walk_is_split_bit_for_bit_at_batch64(cuda, rng, case):
    """64 sequences of 0 .. 3000 rows: millions of outputs, so that even a rare rounding difference between the
    modes shows (one f32 ulp moves a bf16 output about once in 2^16)."""
    seqs = [0, 1, 65] + rng.integers(0, 3000, 61).tolist()
    idx = np.arange(len(seqs))
    if case.startswith("qwen3_next"):
        kv_dtype = case.rsplit("_", 1)[1]
        kc, vc, q, args = _gqa_walk_inputs(rng, kv_dtype, seqs)
        split, walk = _gqa_modes(cuda, kc, vc, q, args, 0.37 if kv_dtype == "fp8" else 1.0, idx)
    else:
        pg, _, q, sink, sel, kw = _mla_walk_inputs(rng, case, seqs)
        split, walk = _mla_modes(cuda, pg, q, sink, sel, kw, idx)
    _same(split, walk, case)
    assert np.all(np.isfinite(f32(walk.view(BF16))))


@pytest.mark.parametrize("walk", [False, True])
def test_walk_and_split_near_the_reference_off_tile(dev, rng, walk):
    """Both modes, not invariant (the batch's own split count), at widths off the 64-column tile."""
    heads, rw, dv, seqs = 33, 200, 136, [0, 1, 15, 140, 700]
    pg = Paged(rng, seqs, rw)
    q = rand_bf16(rng, (len(seqs), heads, rw))
    sink = rng.standard_normal(heads).astype(np.float32)
    check(run_mla(dev, pg, q, heads, rw, dv, 0.09, 100, sink, walk=walk), mla_ref(pg, q, dv, 0.09, 100, sink))


def test_walk_is_chosen_for_large_invariant_batches(ref, rng, monkeypatch):
    """walk=None: invariant calls split at one sequence and walk at 64 (V3's 4 head blocks, GLM-5's selection,
    V4's window, Qwen's GQA), walk sooner when a window leaves most splits empty; non-invariant calls never walk
    (their split count shrinks with the batch instead). Not monotone in between: a walk block takes all of a
    sequence's splits, so a second, part-filled wave of them costs a whole walk. The launcher runs the kernels
    of the mode chosen."""
    choose = [(hb, bound, [pa._walks("t", None, True, n, hb, bound, pa._min_chunk(window)) for n in range(1, 65)])
              for hb, bound, window in [(4, 0, 0), (2, 2048, 0), (2, 128, 128), (2, 0, 0)]]
    for hb, bound, w in choose:
        assert not w[0] and w[-1], (hb, bound, w)
        assert not any(pa._walks("t", None, False, n, hb, bound) for n in range(1, 65))
    assert choose[2][2].index(True) < choose[1][2].index(True)     # V4's window walks sooner than GLM-5
    names = launched(monkeypatch)
    heads, rw = 40, 64                      # 2 head blocks
    w = [pa._walks("t", None, True, n, 2, 0) for n in range(1, 65)]
    at = w.index(True) + 1                  # the smallest batch that walks
    split, walk = ["mla_decode_partial", "attn_combine"], ["mla_decode_walk"]
    for n, invariant, want in [(at, True, walk), (at - 1, True, split), (at, False, split)]:
        pg = Paged(rng, rng.integers(0, 40, n), rw)
        q = rand_bf16(rng, (n, heads, rw))
        del names[:]
        run_mla(ref, pg, q, heads, rw, rw, 0.1, invariant=invariant)
        assert names == want, (n, invariant, names)
    # GQA: 8 q heads over 2 KV heads -> 2 head blocks of 4
    for n, invariant, want in [(at, True, ["gqa_decode_walk_fp8"]), (at, False, ["gqa_decode_partial_fp8",
                                                                                 "attn_combine"])]:
        kc = Paged(rng, rng.integers(0, 40, n), 2 * 32, "fp8")
        vc = copy.copy(kc)
        q = rand_bf16(rng, (n, 8 * 32))
        del names[:]
        run_gqa(ref, kc, vc, q, 8 * 32, 8, 2, 32, 0.2, "fp8", 0.5, invariant=invariant)
        assert names == want, (n, invariant, names)
    del names[:]                            # an explicit walk wins, either way
    pg = Paged(rng, [5, 9], rw)
    run_mla(ref, pg, rand_bf16(rng, (2, heads, rw)), heads, rw, rw, 0.1, invariant=False, walk=True)
    run_mla(ref, pg, rand_bf16(rng, (2, heads, rw)), heads, rw, rw, 0.1, invariant=True, walk=False)
    assert names == walk + split


# (shape, sequences, split mode at the launcher's G µs, walk µs): H100 80GB HBM3, ctx 2048, cold L2, medians of 10
# (BENCHMARKS.md, forty-first session, `bench_attention.py --batches 16,17,20,24,32,34,40,48,64`, the base tree).
# Shapes as `_walks` takes them: (head blocks, bound, window).
_V3, _GLM, _V4, _QWEN = (4, 0, 0), (2, 2048, 0), (2, 128, 128), (2, 0, 0)
_MEASURED = [(_V3, 16, 119.7, 155.3), (_V3, 20, 165.0, 154.3), (_V3, 24, 174.3, 155.3), (_V3, 32, 226.9, 158.5),
             (_V3, 34, 265.4, 305.9), (_V3, 40, 279.7, 307.0), (_V3, 48, 331.3, 307.4), (_V3, 64, 434.6, 310.9),
             (_GLM, 16, 60.4, 156.8), (_GLM, 17, 98.3, 156.3), (_GLM, 20, 104.0, 157.7), (_GLM, 24, 112.0, 156.8),
             (_GLM, 32, 121.2, 156.8), (_GLM, 40, 168.5, 158.1), (_GLM, 48, 178.3, 159.9), (_GLM, 64, 231.3, 163.0),
             (_V4, 16, 17.7, 29.0), (_V4, 17, 20.9, 28.9), (_V4, 20, 23.7, 28.8), (_V4, 24, 24.6, 29.0),
             (_V4, 32, 26.0, 29.2), (_V4, 34, 33.2, 29.3), (_V4, 40, 36.5, 30.7), (_V4, 48, 37.5, 32.2),
             (_V4, 64, 42.9, 33.5),
             (_QWEN, 16, 54.0, 93.6), (_QWEN, 17, 67.0, 92.8), (_QWEN, 20, 68.9, 92.7), (_QWEN, 24, 71.9, 93.1),
             (_QWEN, 32, 84.1, 94.0), (_QWEN, 40, 101.6, 95.9), (_QWEN, 48, 114.9, 99.8), (_QWEN, 64, 142.2, 113.4)]


@pytest.mark.parametrize("shape,n,split_us,walk_us", _MEASURED)
def test_walk_choice_matches_the_measured_faster_mode(shape, n, split_us, walk_us):
    """walk=None picks the mode that measured faster, at every measured point more than 3% apart (V3 at 17, GLM-5
    and Qwen3-Next at 34 were closer: ties either way, left out of the table): split mode's cost counts waves of grouped
    blocks, so Qwen3-Next at 32 sequences splits (G = 4: 84 µs, the walk 94) and DeepSeek-V3 at 40 splits."""
    hb, bound, window = shape
    assert abs(split_us - walk_us) > 0.03 * min(split_us, walk_us), "a tie: not a test of the model"
    got = pa._walks("t", None, True, n, hb, bound, pa._min_chunk(window), span=window or bound)
    assert got == (walk_us < split_us), (shape, n, split_us, walk_us)


@pytest.mark.parametrize("case", ["window128", "window40", "dsa"])
def test_bounded_splits_keep_the_bits(dev, rng, monkeypatch, case):
    """A window or DSA row bounds the positions a sequence walks, so the launcher launches only the splits such a
    sequence can fill (V4's 128-row window: 4, not 66). Every sequence keeps its chunk, so its bits are those of
    the uncapped split count, in both modes, and near the float64 reference."""
    heads, rw, window, sel_w = {"window128": (40, 64, 128, 0), "window40": (40, 64, 40, 0),
                                "dsa": (40, 64, 0, 320)}[case]
    seqs = [1, 33, 127, 128, 129, 300]
    pg = Paged(rng, seqs, rw)
    q = rand_bf16(rng, (len(seqs), heads, rw))
    sink = rng.standard_normal(heads).astype(np.float32)
    sel = None
    if sel_w:
        sel = np.full((len(seqs), sel_w), -1, np.int32)
        for s, n in enumerate(seqs):
            k = min(n, sel_w)
            sel[s, rng.choice(sel_w, k, replace=False)] = rng.choice(n, k, replace=False)
    span, mc = sel_w or window, pa._min_chunk(window)
    capped = pa._splits(1, 2, True, span, mc)
    assert capped == -(-span // mc) < pa._splits(1, 2, True), (capped, span, mc)
    assert pa.attention_workspace_bytes(1, heads, rw, 2, True, span, mc) < pa.attention_workspace_bytes(1, heads, rw,
                                                                                                        2, True)
    got = {w: run_mla(dev, pg, q, heads, rw, rw, 0.11, window, sink, sel, poison_ws=True, invariant=True, walk=w,
                      bits=True) for w in (False, True)}
    orig = pa._splits
    monkeypatch.setattr(pa, "_splits", lambda n, hb, inv=False, span=0, min_chunk=0: orig(n, hb, inv))
    for w in (False, True):
        want = run_mla(dev, pg, q, heads, rw, rw, 0.11, window, sink, sel, poison_ws=True, invariant=True, walk=w,
                       bits=True)
        _same(want, got[w], f"{case}, walk={w}, {capped} splits against {orig(1, 2, True)}")
    check(f32(got[False].view(BF16)), mla_ref(pg, q, rw, 0.11, window, sink, sel))


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(WALK_MLA) + ["qwen3_next_bf16", "qwen3_next_fp8"])
def test_split_groups_move_no_bit(cuda, rng, case):
    """A split-mode block may take several consecutive splits in turn (`group`; the NumPy twin computes every
    split alike, so only CUDA can tell): every group, and the launcher's own choice, gives the bits of one split a
    block, for ragged sequences (a block's range ending inside a sequence, past it, or holding none of it)."""
    if case.startswith("qwen3_next"):
        kv_dtype = case.rsplit("_", 1)[1]
        kc, vc, q, args = _gqa_walk_inputs(rng, kv_dtype, RAGGED)
        def run(g):
            return run_gqa(cuda, kc, vc, q, *args, 0.37 if kv_dtype == "fp8" else 1.0, invariant=True, walk=False,
                           bits=True, poison_ws=True, group=g)
    else:
        pg, _, q, sink, sel, kw = _mla_walk_inputs(rng, case, RAGGED)
        def run(g):
            return run_mla(cuda, pg, q, sink=sink, sel=sel, poison_ws=True, invariant=True, walk=False, bits=True,
                           group=g, **kw)
    one = run(1)
    assert np.all(np.isfinite(f32(one.view(BF16))))
    for g in (2, 3, 5, 16, 64, None):
        got = run(g)
        assert np.array_equal(got, one), f"{case}: group {g} differs on {np.count_nonzero(got != one)} elements"


@pytest.mark.parametrize("invariant", [False, True])
def test_no_sequences_launch_nothing(ref, monkeypatch, invariant):
    """num_seqs = 0 is a call that launches nothing (and needs no workspace), in both ops, invariant or not (the
    batch's own split count once divided by the sequences)."""
    names = launched(monkeypatch)
    buf = ref.alloc(1 << 12)
    p = buf.ptr
    ops.mla_decode(ref, p, p, p, META_STRIDE, p, 0, 8, 64, 64, 0.1, invariant=invariant)
    ops.gqa_decode(ref, p, 64, p, p, p, META_STRIDE, p, 0, 8, 2, 32, 0.1, invariant=invariant)
    assert names == []
    assert ops.attention_workspace_bytes(0, 8, 64, 1, invariant) == 0


def test_split_group_choice(ref, monkeypatch):
    """group=None puts the blocks with rows in one wave (V3's 4 head blocks at 2,048 rows: 1 split a block up to 2
    sequences, 4 from 8, never more than _MAX_GROUP); an explicit group is taken (capped at the split count) and a
    bad one is a KernelError before any launch. The grid's first dimension is ceil(splits / group), for GQA too,
    whatever its q heads per KV head."""
    assert pa._MAX_GROUP == 4
    assert [pa._group("t", None, n, 4, 33, 0, 128) for n in (1, 2, 3, 8, 16, 64)] == [1, 1, 2, 4, 4, 4]
    assert pa._group("t", 5, 1, 4, 33, 0, 128) == 5 and pa._group("t", 99, 1, 4, 33, 0, 128) == 33
    for bad in (0, -1, 2.0, True, "2"):
        with pytest.raises(KernelError, match="group"):
            pa._group("t", bad, 1, 4, 33, 0, 128)
    grids = []
    real = pa.launch
    monkeypatch.setattr(pa, "launch", lambda gpu, mod, name: grids.append(name) or real(gpu, mod, name))
    from mtp_cupy.runtime.backend import KernelLaunch
    orig = KernelLaunch.grid
    monkeypatch.setattr(KernelLaunch, "grid", lambda self, *g: grids.append(g) or orig(self, *g))
    rng = np.random.default_rng(0)
    pg = Paged(rng, [300] * 8, 64)
    run_mla(ref, pg, rand_bf16(rng, (8, 128, 64)), 128, 64, 64, 0.1, invariant=True, walk=False)
    assert grids[:2] == ["mla_decode_partial", (9, 4, 8)], grids   # 33 splits, 4 a block at 8 sequences
    grids.clear()   # Qwen3-Next's 16 q heads over 2 KV heads of 256, one sequence: 64 splits, one a block
    kc, vc = (Paged(rng, [300], 2 * 256) for _ in range(2))
    run_gqa(ref, kc, vc, rand_bf16(rng, (1, 16, 256)), 16 * 256, 16, 2, 256, 0.1, "bf16", 1.0, invariant=True,
            walk=False)
    assert grids[:2] == ["gqa_decode_partial", (64, 2, 1)], grids


@pytest.mark.parametrize("walk", ["auto", 1, 0, "yes"])
@pytest.mark.parametrize("num_seqs", [0, 1])
def test_walk_must_be_none_or_a_bool(ref, walk, num_seqs):
    with pytest.raises(KernelError, match="walk"):
        ops.mla_decode(ref, 256, 256, 256, META_STRIDE, 256, num_seqs, 4, 128, 128, 0.1, walk=walk)
    with pytest.raises(KernelError, match="walk"):
        ops.gqa_decode(ref, 256, 512, 256, 256, 256, META_STRIDE, 256, num_seqs, 8, 2, 64, 0.1, walk=walk)
