"""elementwise.cu beyond the residual add: concat, sigmoid gate, SwiGLU (plain and clamped), embedding
gathers (host ids and argmax ids, out-of-range ids -> zero rows), scaled add. Copies must be bit-exact;
arithmetic is checked against float64 formulas."""
import numpy as np
import pytest

from mtp_cupy import ops
from helpers import assert_close, f32, get, out, rand_bf16, run_on_both, up


def sigmoid64(x):
    return 1.0 / (1.0 + np.exp(-f32(x).astype(np.float64)))


def bits(a):
    return np.asarray(a).view(np.uint16)


@pytest.mark.parametrize("rows,na,nb", [(1, 7168, 7168), (3, 6144, 6144), (5, 2048, 2048), (2, 4096, 4096),
                                        (4, 13, 21), (3, 8, 5)])
def test_bf16_concat(dev, rng, rows, na, nb):
    a, b = rand_bf16(rng, (rows, na)), rand_bf16(rng, (rows, nb))
    ab, bb, ob = up(dev, a), up(dev, b), out(dev, "bf16", (rows, na + nb))
    ops.bf16_concat(dev, ab.ptr, bb.ptr, ob.ptr, rows, na, nb)
    assert np.array_equal(bits(get(dev, ob, "bf16", (rows, na + nb))), bits(np.concatenate([a, b], 1)))


@pytest.mark.parametrize("rows,heads,dim", [(1, 16, 256), (3, 16, 256), (2, 5, 24)])
@pytest.mark.parametrize("in_place", [False, True])
def test_sigmoid_gate_mul_qwen_layout(dev, rng, rows, heads, dim, in_place):
    """Qwen gated attention: the gate is the second half of each head of the [q_h | gate_h] projection."""
    qg = rand_bf16(rng, (rows, heads, 2 * dim), 3.0)
    x = rand_bf16(rng, (rows, heads, dim))
    xb, gb = up(dev, x), up(dev, qg)
    ob = xb if in_place else out(dev, "bf16", x.shape)
    ops.sigmoid_gate_mul(dev, xb.ptr, gb.ptr.offset(2 * dim), ob.ptr, rows, heads, dim, heads * 2 * dim, 2 * dim)
    ref = f32(x).astype(np.float64) * sigmoid64(qg[..., dim:])
    got = get(dev, ob, "bf16", x.shape)
    assert_close(f32(got), ref, 1e-2)
    assert np.all(np.abs(f32(got) - ref) <= 2.0 ** -8 * np.abs(ref) * 1.001 + 1e-30)


@pytest.mark.parametrize("rows,inter", [(1, 2048), (4, 512), (3, 18432 // 8), (5, 7)])
@pytest.mark.parametrize("limit", [0.0, 10.0])
def test_silu_mul(dev, rng, rows, inter, limit):
    """Fused [gate | up] rows (strides 2*inter); V4's clamp when limit > 0 (inputs reach +-30)."""
    gu = rand_bf16(rng, (rows, 2 * inter), 10.0)
    gb, ob = up(dev, gu), out(dev, "bf16", (rows, inter))
    ops.silu_mul(dev, gb.ptr, gb.ptr.offset(2 * inter), ob.ptr, rows, inter, 2 * inter, 2 * inter, limit=limit)
    g, u = f32(gu[:, :inter]).astype(np.float64), f32(gu[:, inter:]).astype(np.float64)
    if limit > 0:
        g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
    ref = g * sigmoid64(g) * u
    assert_close(f32(get(dev, ob, "bf16", (rows, inter))), ref, 1e-2)


def _ids_buffer(ids, stride):
    buf = np.full(len(ids) * stride, 0x5A, np.uint8)
    buf.reshape(len(ids), stride)[:, :4] = np.asarray(ids, np.int32).view(np.uint8).reshape(-1, 4)
    return buf


@pytest.mark.parametrize("vocab,dim,ids_stride", [(1000, 7168, 4), (300, 2048, 8), (97, 6144, 4096), (50, 13, 4)])
def test_embed_rows(dev, rng, vocab, dim, ids_stride):
    table = rand_bf16(rng, (vocab, dim))
    ids = np.concatenate([rng.integers(0, vocab, 6), [0, vocab - 1, -1, vocab, 2 ** 31 - 1]]).astype(np.int32)
    rng.shuffle(ids)
    tb, ib, ob = up(dev, table), up(dev, _ids_buffer(ids, ids_stride)), out(dev, "bf16", (len(ids), dim))
    ops.embed_rows(dev, tb.ptr, ib.ptr, ob.ptr, len(ids), dim, ids_stride=ids_stride, vocab=vocab)
    want = np.zeros((len(ids), dim), table.dtype)
    ok = (ids >= 0) & (ids < vocab)
    want[ok] = table[ids[ok]]
    assert np.array_equal(bits(get(dev, ob, "bf16", (len(ids), dim))), bits(want))


def test_embed_from_argmax(dev, rng):
    """The id an argmax kernel left on the device (i32) selects the next embedding row; -1 -> zeros."""
    vocab, dim = 512, 7168
    table = rand_bf16(rng, (vocab, dim))
    tb = up(dev, table)
    for rows, ids in [(1, [int(rng.integers(vocab))]), (4, list(rng.integers(0, vocab, 3)) + [-1])]:
        ib, ob = up(dev, np.asarray(ids, np.int32)), out(dev, "bf16", (rows, dim))
        ops.embed_from_argmax(dev, tb.ptr, ib.ptr, ob.ptr, dim, rows=rows, vocab=vocab)
        want = np.stack([table[i] if i >= 0 else np.zeros(dim, table.dtype) for i in ids])
        assert np.array_equal(bits(get(dev, ob, "bf16", (rows, dim))), bits(want))


@pytest.mark.parametrize("n", [1, 7168, 6144 * 4 + 3])
def test_scale_add(dev, rng, n):
    y, x = rand_bf16(rng, n), rand_bf16(rng, n)
    alpha = float(rng.uniform(-3, 3))
    yb, xb = up(dev, y), up(dev, x)
    ops.scale_add(dev, yb.ptr, xb.ptr, alpha, n)
    ref = f32(y).astype(np.float64) + np.float32(alpha) * f32(x).astype(np.float64)
    assert_close(f32(get(dev, yb, "bf16", n)), ref, 1e-2)


def _run_all(dev, a, b, qg, gu, table, ids, alpha):
    rows, d = a.shape
    heads, hd = qg.shape[1], qg.shape[2] // 2
    inter = gu.shape[1] // 2
    ab, bb, qb, gb, tb, ib = (up(dev, v) for v in (a, b, qg, gu, table, ids))
    cat, gate, s0, s1, emb = (out(dev, "bf16", s) for s in ((rows, 2 * d), (rows, heads, hd), (rows, inter),
                                                            (rows, inter), (len(ids), d)))
    ops.bf16_concat(dev, ab.ptr, bb.ptr, cat.ptr, rows, d, d)
    ops.sigmoid_gate_mul(dev, qb.ptr, qb.ptr.offset(2 * hd), gate.ptr, rows, heads, hd, heads * 2 * hd, 2 * hd)
    ops.silu_mul(dev, gb.ptr, gb.ptr.offset(2 * inter), s0.ptr, rows, inter, 2 * inter, 2 * inter)
    ops.silu_mul(dev, gb.ptr, gb.ptr.offset(2 * inter), s1.ptr, rows, inter, 2 * inter, 2 * inter, limit=10.0)
    ops.embed_rows(dev, tb.ptr, ib.ptr, emb.ptr, len(ids), d, vocab=table.shape[0])
    ops.scale_add(dev, ab.ptr, bb.ptr, alpha, rows * d)
    return [get(dev, buf, "bf16", s) for buf, s in ((cat, (rows, 2 * d)), (gate, (rows, heads, hd)),
                                                    (s0, (rows, inter)), (s1, (rows, inter)), (emb, (len(ids), d)),
                                                    (ab, (rows, d)))]


@pytest.mark.gpu
@pytest.mark.parametrize("rows,d", [(1, 7168), (1, 6144), (3, 2048), (1, 4096), (256, 7168), (5, 1000), (3, 13)])
def test_elementwise_cuda_matches_twin(rng, rows, d):
    a, b = rand_bf16(rng, (rows, d)), rand_bf16(rng, (rows, d))
    qg, gu = rand_bf16(rng, (rows, 16, 512), 3.0), rand_bf16(rng, (rows, 2 * 2048), 10.0)
    table = rand_bf16(rng, (300, d))
    ids = np.array([5, 299, -1, 300, 0], np.int32)
    ref_out, cuda_out = run_on_both(_run_all, a, b, qg, gu, table, ids, -0.75)
    for i, (r, c) in enumerate(zip(ref_out, cuda_out)):
        if i in (0, 4, 5):  # copies and the unfused scale_add are exact
            assert np.array_equal(bits(r), bits(c)), i
        else:  # expf vs numpy exp: at most one bf16 ulp, rarely
            r32, c32 = f32(r), f32(c)
            assert np.all(np.isfinite(c32))
            dlt = np.abs(r32 - c32)
            assert np.all(dlt <= 2.0 ** -7 * np.maximum(np.abs(r32), np.abs(c32))), i
            assert np.count_nonzero(dlt) <= max(2, dlt.size // 100), i
