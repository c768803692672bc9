"""rms_norm.cu front_norms_w / _1pw: the MTP front's embedding gather and its two norms in one launch.

The reference is the float64 RMSNorm of the gathered rows (docs/model_math.md A.2); on each device the kernel
must also give the bytes of the launches it replaces (embed_rows, then rms_norm_strided of each half)."""
import numpy as np
import pytest

from mtp_cupy import KernelError, ops
from helpers import POISON, assert_close, f32, get, out, rand_bf16, up

# (m token rows, hidden rows, dim, concat): V3 7168, GLM-5 6144, Qwen3-Next 2048 concat; V4 4096 x 4 streams split
CASES = [(1, 1, 7168, True), (3, 3, 6144, True), (64, 64, 2048, True), (1, 4, 4096, False), (5, 20, 4096, False),
         (2, 2, 8, True)]


def front_inputs(rng, m, h_rows, dim, vocab=50):
    table = rand_bf16(rng, (vocab, dim), 2.0)
    ids = rng.integers(0, vocab, m).astype(np.int32)
    ids[m // 2] = vocab + 3 if m > 1 else ids[0]     # one id out of range: a zero row
    return table, ids, rand_bf16(rng, dim, 0.5), rand_bf16(rng, (h_rows, dim), 3.0), rand_bf16(rng, dim, 0.5)


def run_front(dev, inputs, m, h_rows, dim, concat, unit_offset, fused):
    """(e rows, h rows) as the front writes them: the halves of [m, 2 dim] concat rows, or e [m, dim] and
    h [h_rows, dim]; one launch (fused) or embed_rows + rms_norm_strided twice."""
    table, ids, ew, hidden, hw = inputs
    vocab, eps = table.shape[0], 1e-6
    bt, bi, bew, bh, bhw = (up(dev, a) for a in (table, ids, ew, hidden, hw))
    if concat:
        cat = out(dev, "bf16", (m, 2 * dim))
        e_out, es, h_out, hs = cat.ptr, 2 * dim, cat.ptr.offset(2 * dim), 2 * dim
    else:
        eb, hb = out(dev, "bf16", (m, dim)), out(dev, "bf16", (h_rows, dim))
        e_out, es, h_out, hs = eb.ptr, dim, hb.ptr, dim
    if fused:
        ops.front_norms(dev, bt.ptr, bi.ptr, vocab, bew.ptr, bh.ptr, bhw.ptr, e_out, es, h_out, hs, m, h_rows, dim,
                        eps, unit_offset=unit_offset)
    else:
        emb = out(dev, "bf16", (m, dim))
        ops.embed_rows(dev, bt.ptr, bi.ptr, emb.ptr, m, dim, vocab=vocab)
        ops.rms_norm_strided(dev, emb.ptr, bew.ptr, e_out, m, 1, dim, dim, dim, es, dim, eps, unit_offset=unit_offset)
        ops.rms_norm_strided(dev, bh.ptr, bhw.ptr, h_out, h_rows, 1, dim, dim, dim, hs, dim, eps,
                             unit_offset=unit_offset)
    if concat:
        c = get(dev, cat, "bf16", (m, 2 * dim))
        return c[:, :dim], c[:, dim:]
    return get(dev, eb, "bf16", (m, dim)), get(dev, hb, "bf16", (h_rows, dim))


def norm_f64(x, w, unit_offset, eps=1e-6):
    x = x.astype(np.float64)
    g = f32(w).astype(np.float64)
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * (1.0 + g if unit_offset else g)


@pytest.mark.parametrize("m,h_rows,dim,concat", CASES)
@pytest.mark.parametrize("unit_offset", [False, True])
def test_front_norms(dev, rng, m, h_rows, dim, concat, unit_offset):
    inputs = front_inputs(rng, m, h_rows, dim)
    table, ids, ew, hidden, hw = inputs
    e, h = run_front(dev, inputs, m, h_rows, dim, concat, unit_offset, fused=True)
    ok = (ids >= 0) & (ids < table.shape[0])
    gathered = np.where(ok[:, None], f32(table[np.clip(ids, 0, table.shape[0] - 1)]), 0.0)
    assert np.all(f32(e)[~ok] == 0.0), "an out-of-range id must give a zero row"
    assert_close(f32(e)[ok], norm_f64(gathered[ok], ew, unit_offset), 1e-2, "e")
    assert_close(f32(h), norm_f64(f32(hidden), hw, unit_offset), 1e-2, "h")
    e2, h2 = run_front(dev, inputs, m, h_rows, dim, concat, unit_offset, fused=False)
    assert np.array_equal(e.view(np.uint16), e2.view(np.uint16)), "e differs from embed_rows + rms_norm_strided"
    assert np.array_equal(h.view(np.uint16), h2.view(np.uint16)), "h differs from rms_norm_strided"


def test_front_norms_refuses_bad_geometry(ref):
    ptr = ref.alloc(64).ptr
    for kw, what in ((dict(dim=12), "dim 12"), (dict(e_stride=4), "row strides"), (dict(h_rows=0), "h_rows 0"),
                     (dict(ew=0), "weights are required"), (dict(ids_stride=2), "4-byte aligned")):
        a = dict(table=ptr, ids=ptr, vocab=4, ew=ptr, hidden=ptr, hw=ptr, e_out=ptr, e_stride=64, h_out=ptr,
                 h_stride=64, m=1, h_rows=1, dim=64, eps=1e-6) | kw
        with pytest.raises(KernelError, match=what):
            ops.front_norms(ref, **a)


@pytest.mark.gpu
@pytest.mark.parametrize("m,h_rows,dim,concat", [(1, 1, 7168, True), (64, 64, 6144, True), (1, 4, 4096, False),
                                                 (64, 256, 4096, False)])
def test_front_norms_cuda_matches_twin(rng, m, h_rows, dim, concat):
    import mtp_cupy
    inputs = front_inputs(rng, m, h_rows, dim, vocab=1000)
    for unit_offset in (False, True):
        (e0, h0), (e1, h1) = (run_front(mtp_cupy.device(d), inputs, m, h_rows, dim, concat, unit_offset, True)
                              for d in ("ref", "cuda"))
        assert not np.any(e1.view(np.uint16) == POISON * 257) and not np.any(h1.view(np.uint16) == POISON * 257)
        assert_close(f32(e1), f32(e0), 4e-3, "e")
        assert_close(f32(h1), f32(h0), 4e-3, "h")
