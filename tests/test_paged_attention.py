"""Paged decode attention (mla_decode, gqa_decode) against dense float64 softmax built from the block tables."""
import numpy as np
import pytest

from mtp_cupy import KernelError, ops
from mtp_cupy.runtime.arena import pack_mtp_attn_meta
from mtp_cupy.runtime.dtypes import to_fp8
from mtp_cupy.refdev.registry import names_in
from mtp_cupy.runtime.backend import cuda_kernel_names
from mtp_cupy.runtime.ptr import NULL
from helpers import assert_close, f32, get, out, rand_bf16, run_on_both, up

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
            slab = pack_mtp_attn_meta(n - 1, 0, n, t, META_STRIDE)
            slabs += slab + bytes(META_STRIDE - len(slab))
        return np.frombuffer(bytes(slabs), np.uint8)

    def rows(self, s, rows):
        """float64 pool rows of logical rows `rows` of sequence s."""
        t = np.asarray(self.tables[s])
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


def run_mla(dev, pg, q, heads, row_width, v_width, scale, window=0, sink=None, sel=None, poison_ws=False):
    n = len(pg.seq_lens)
    qb, cb, mb = up(dev, q), up(dev, pg.pool), up(dev, pg.meta())
    sk = up(dev, np.asarray(sink, np.float32)) if sink is not None else None
    sb = up(dev, np.asarray(sel, np.int32)) if sel is not None else None
    ob = out(dev, "bf16", (n, heads, v_width))
    ws_bytes = ops.attention_workspace_bytes(n, heads, v_width, -(-heads // 32))
    ws = out(dev, "u8", ws_bytes) if poison_ws else None  # NaN in unused partials must never leak into the output
    ops.mla_decode(dev, qb.ptr, cb.ptr, mb.ptr, META_STRIDE, ob.ptr, n, heads, row_width, v_width, scale,
                   window=window, sink=sk.ptr if sk else NULL, sel=sb.ptr if sb else NULL,
                   sel_stride=sel.shape[1] if sel is not None else 0, workspace=ws.ptr if ws else None)
    return f32(get(dev, ob, "bf16", (n, heads, v_width)))


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


def run_gqa(dev, kc, vc, q, q_row_stride, q_heads, kv_heads, hd, scale, kv_dtype, kv_scale):
    n = len(kc.seq_lens)
    qb, kb, vb = up(dev, q), up(dev, kc.pool), up(dev, vc.pool)
    mb = up(dev, kc.meta())
    ob = out(dev, "bf16", (n, q_heads, hd))
    ops.gqa_decode(dev, qb.ptr, q_row_stride, kb.ptr, vb.ptr, mb.ptr, META_STRIDE, ob.ptr, n, q_heads, kv_heads,
                   hd, scale, kv_dtype=kv_dtype, kv_scale=kv_scale)
    return f32(get(dev, ob, "bf16", (n, q_heads, hd)))


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
@pytest.mark.parametrize("case", ["v3", "glm_dsa", "v4_window_sink", "batch32"])
def test_mla_cuda_vs_twin_real_dims(rng, case):
    heads, rw, dv, window, with_sink, sel_of, seqs = {
        "v3": (128, 576, 512, 0, False, None, [2048]),
        "glm_dsa": (64, 576, 512, 0, False, 2048, [3000]),
        "v4_window_sink": (64, 512, 512, 128, True, None, [2048]),
        "batch32": (128, 576, 512, 0, False, None, list(rng.integers(1, 700, 32))),
    }[case]
    pg, q, sink, sel = _real_mla(rng, seqs, heads, rw, dv, window, with_sink, sel_of)
    scale = 0.13523378 if heads == 128 else 0.0625
    a, b = run_on_both(lambda d: run_mla(d, pg, q, heads, rw, dv, scale, window, sink, sel))
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
    a, b = run_on_both(lambda d: run_gqa(d, kc, vc, q, qh * hd, qh, kvh, hd, hd ** -0.5, kv_dtype, 0.5))
    check(b, a.astype(np.float64))
