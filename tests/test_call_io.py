"""ops/call_io.py: a call's stage read in and its drafts published through mapped host memory. Reference: plain
byte copies of the inputs (NumPy), with every byte the kernel must not touch poisoned and checked unchanged."""
import numpy as np
import pytest

from mtp_cupy import ops
from mtp_cupy.errors import KernelError
from helpers import POISON, get, out, up


def _mapped(dev, nbytes, fill=POISON):
    """(host array, device address, owner) of poisoned mapped memory."""
    host, buf = dev.alloc_mapped(nbytes)
    assert not host.any(), "mapped memory must come zeroed"
    host[:] = fill
    return host, buf.ptr, buf


# nbytes, hidden words fetched, the grid's hidden bytes: tiny, V3 B = 1 (k = 3), a V4 batch of 64 hiddens
@pytest.mark.parametrize("nbytes,fetch16,most", [(16, 0, 0), (272, 1, 64), (3 * 1 * 1104 + 256, 896, 14336),
                                                 (256 + 3 * 64 * 624, 131072, 2097152)])
def test_stage_in(dev, rng, nbytes, fetch16, most):
    stage_host = rng.integers(0, 256, nbytes, dtype=np.uint8)
    rows = rng.integers(0, 256, max(16 * fetch16, 16), dtype=np.uint8)
    src = up(dev, rows)
    host, ptr, keep = _mapped(dev, nbytes + ops.CTL_BYTES)
    host[:nbytes] = stage_host
    seq = int(rng.integers(1, 1 << 32))
    ops.write_ctl(host[nbytes:].view(np.uint64), seq, fetch16, int(src.ptr) if fetch16 else 0)
    call_in, hid = out(dev, np.uint8, nbytes + 64), out(dev, np.uint8, max(most, 16) + 64)
    seq_dev = out(dev, np.uint32, 1)
    ops.call_stage_in(dev, ptr, call_in.ptr, nbytes, ptr.offset(nbytes), hid.ptr, seq_dev.ptr, most)
    got = get(dev, call_in, np.uint8, nbytes + 64)
    assert np.array_equal(got[:nbytes], stage_host)
    assert (got[nbytes:] == POISON).all(), "call_stage_in wrote past its bytes"
    h = get(dev, hid, np.uint8, max(most, 16) + 64)
    assert np.array_equal(h[:16 * fetch16], rows[:16 * fetch16])
    assert (h[16 * fetch16:] == POISON).all(), "call_stage_in fetched past the CallCtl's words"
    assert int(get(dev, seq_dev, np.uint32, 1)[0]) == seq


@pytest.mark.parametrize("k,W,masked,want_lp", [(1, 1, False, False), (3, 1, True, True), (3, 8, False, True),
                                                (8, 64, True, False), (8, 64, True, True)])
def test_publish(dev, rng, k, W, masked, want_lp):
    n = k * W
    ids = rng.integers(-(1 << 31), 1 << 31, n, dtype=np.int64).astype(np.int32)
    flags = rng.integers(0, 2, n).astype(np.int32)
    lps = rng.standard_normal(n).astype(np.float32)
    bufs = [up(dev, a) for a in (ids, flags, lps)]
    seq = int(rng.integers(1, 1 << 32))
    seq_dev = up(dev, np.array([seq], np.uint32))
    host, ptr, keep = _mapped(dev, 4 * (ops.OUTBOX_HEAD + 3 * n) + 64)
    ops.call_publish(dev, bufs[0].ptr, bufs[1].ptr if masked else None, bufs[2].ptr if want_lp else None, n, ptr,
                     seq_dev.ptr)
    dev.synchronize()
    words = host.view(np.uint32)
    assert int(words[0]) == seq
    assert (host[4:16] == POISON).all()
    body = words[ops.OUTBOX_HEAD:]
    assert np.array_equal(body[:n].view(np.int32), ids)
    if masked:
        assert np.array_equal(body[n:2 * n].view(np.int32), flags)
    else:
        assert (body[n:2 * n] == 0xFFFFFFFF).all(), "flags published that were not asked for"
    if want_lp:
        assert np.array_equal(body[2 * n:3 * n].view(np.float32), lps)   # bit copies: NaN-free by construction
    else:
        assert (body[2 * n:3 * n] == 0xFFFFFFFF).all(), "log-probs published that were not asked for"
    assert (host[4 * (ops.OUTBOX_HEAD + 3 * n):] == POISON).all()


def test_checks(ref):
    host, buf = ref.alloc_mapped(64)
    ptr = buf.ptr
    d = ref.alloc(256)
    with pytest.raises(KernelError, match="multiples of 16"):
        ops.call_stage_in(ref, ptr, d.ptr, 24, ptr.offset(32), d.ptr, d.ptr)
    with pytest.raises(KernelError, match="16-byte aligned"):
        ops.call_stage_in(ref, ptr.offset(8), d.ptr, 16, ptr.offset(32), d.ptr, d.ptr)
    with pytest.raises(KernelError, match="out of range"):
        ops.call_publish(ref, d.ptr, None, None, 0, ptr, d.ptr)
    ctl = host[:16].view(np.uint64)
    ops.write_ctl(ctl, 7, 3, 0x1230)
    for bad in ((1 << 32, 0), (1, 1 << 32), (-1, 0)):
        with pytest.raises(KernelError, match="out of range"):
            ops.write_ctl(ctl, *bad, 0x4560)
        assert ctl.tolist() == [7 | 3 << 32, 0x1230], "a refused CallCtl must stay as it was"


def test_fetch_words_and_up16():
    assert [ops.up16(n) for n in (0, 1, 16, 17, 4100)] == [0, 16, 16, 32, 4112]
    assert ops.fetch_words(0x1000, 4096) == 256
    assert ops.fetch_words(0x1002, 4096) == 0 and ops.fetch_words(0x1000, 4100) == 0


def test_unpublished_chain_raises_and_rolls_back(monkeypatch):
    """A chain that never publishes (its last kernel lost) fails the call with KernelError once the stream has run
    dry, and the call's rows are rolled back."""
    import mtp_cupy
    from mtp_cupy.speculative import base
    p = mtp_cupy.load_proposer(mtp_cupy.EMBEDDED["deepseek_v3"], gpu="ref", max_seq_len=64)
    st = p.alloc_state()
    p.prefill(st, [1, 2, 3], np.zeros((2, p.hidden_size), np.float32))
    rows = st.blocks.rows
    monkeypatch.setattr(base.ops, "call_publish", lambda *a, **kw: None)
    with pytest.raises(KernelError, match="without publishing"):
        p.propose(st, 4, np.zeros(p.hidden_size, np.float32), 2, 2)
    assert st.blocks.rows == rows
    monkeypatch.undo()
    assert len(p.propose(st, 4, np.zeros(p.hidden_size, np.float32), 2, 2).tokens) == 2
