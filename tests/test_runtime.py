import logging
import subprocess
import sys

import numpy as np
import pytest

import mtp_cupy
from mtp_cupy.errors import CapacityError, ConfigError, InputError, KernelError
from mtp_cupy.runtime import DevicePtr, KernelLaunch, NULL
from mtp_cupy.runtime.arena import (MTP_META_OFFSET, TARGET_META_OFFSET, ForwardBuffers, pack_mtp_attn_meta,
                                    stage_mtp_meta, unpack_mtp_attn_meta)
from mtp_cupy.runtime.backend import cuda_kernel_names, cuda_modules
from mtp_cupy.refdev.registry import load_all


def test_import_does_not_import_cupy():
    code = "import sys, mtp_cupy, mtp_cupy.ops, mtp_cupy.models; print('cupy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_device_ptr_offset():
    p = DevicePtr(0x1000)
    assert p.offset(16) == 0x1010 and isinstance(p.offset(16), DevicePtr)
    with pytest.raises(ValueError):
        NULL.offset(4)


def test_device_selection(caplog, monkeypatch):
    assert mtp_cupy.device("ref").name == "ref"
    with pytest.raises(ConfigError):
        mtp_cupy.device("tpu")
    from mtp_cupy.runtime import cupy_backend
    monkeypatch.setattr(cupy_backend, "cuda_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger="mtp_cupy"):
        assert mtp_cupy.device("auto").name == "ref"
    assert sum("NumPy reference device" in r.message for r in caplog.records) == 1
    with pytest.raises(ConfigError):
        mtp_cupy.device("cuda")


def test_every_cuda_kernel_has_a_twin_and_back():
    twins = set(load_all())
    cuda = {(m, n) for m in cuda_modules() for n in cuda_kernel_names(m)}
    assert cuda, "no kernels found in cuda_src"
    assert cuda - twins == set(), f"kernels without a twin: {sorted(cuda - twins)}"
    assert twins - cuda == set(), f"twins without a kernel: {sorted(twins - cuda)}"


def test_kernel_lookup_errors(dev):
    h = dev.kernel("elementwise", "bf16_residual_add")
    assert dev.kernel("elementwise", "bf16_residual_add") is h  # cached
    with pytest.raises(KernelError, match="bf16_residual_add"):  # names what the module does define
        dev.kernel("elementwise", "no_such_kernel")
    with pytest.raises(KernelError, match="no_such_module"):
        dev.kernel("no_such_module", "x")
    assert dev.kernel_opt("elementwise", "no_such_kernel") is None


def test_launch_argument_checks(ref):
    h = ref.kernel("elementwise", "bf16_residual_add")
    with pytest.raises(KernelError):
        KernelLaunch(ref, h).arg_u32(-1)
    with pytest.raises(KernelError):
        KernelLaunch(ref, h).arg_i32(1 << 31)
    with pytest.raises(KernelError, match=r"cluster \(1, 3, 1\) does not divide grid \(4, 2, 1\)"):
        KernelLaunch(ref, h).grid(4, 2).block(32).cluster(1, 3).launch()
    with pytest.raises(KernelError, match="cluster dims"):
        KernelLaunch(ref, h).grid(4, 2).cluster(1, 0)


def test_ref_memory_bounds_and_null(ref):
    a = ref.alloc(64)
    ref.copy_h2d(a.ptr, np.arange(16, dtype=np.float32))
    assert np.array_equal(ref.read(a.ptr, "f32", 16), np.arange(16, dtype=np.float32))
    with pytest.raises(KernelError, match="past its allocation"):
        ref.view(a.ptr.offset(60), np.float32, 2)
    with pytest.raises(KernelError, match="NULL"):
        ref.view(NULL, np.uint8, 1)
    x = ref.upload(np.ones(8, np.float32).astype(mtp_cupy.runtime.dtypes.BF16))
    with pytest.raises(KernelError, match="bf16_residual_add"):  # a twin overrunning names the kernel
        KernelLaunch(ref, ref.kernel("elementwise", "bf16_residual_add")).grid(1).block(32) \
            .arg_ptr(x.ptr).arg_ptr(x.ptr).arg_u32(9).launch()


def test_copies_memset(dev, rng):
    data = rng.integers(0, 255, 1000, dtype=np.uint8)
    a, b = dev.upload(data), dev.alloc(1000)
    dev.copy_d2d_async(b.ptr, a.ptr, 1000)
    dev.synchronize()
    assert np.array_equal(dev.copy_d2h(b.ptr, 1000), data)
    dev.memset_async(b.ptr.offset(10), 7, 20)
    dev.synchronize()
    got = dev.copy_d2h(b.ptr, 1000)
    assert (got[10:30] == 7).all() and np.array_equal(got[:10], data[:10]) and np.array_equal(got[30:], data[30:])


_SPIN = r"""extern "C" __global__ void spin(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}"""


def test_fork_join_orders_work(dev):
    """Side work forked off a stream sees what the stream queued before the fork (and, forked again, what it
    queued since), and the stream's work after join waits for the side's, eagerly and in a captured graph. The
    side spins 2 ms first (CUDA), so a missing wait reads the bytes of the run before."""
    a, b, c = dev.alloc(256), dev.alloc(256), dev.alloc(256)
    stream = dev.new_stream()
    if dev.is_cuda:
        import cupy
        kernel = cupy.RawKernel(_SPIN, "spin")

        def spin(s):
            kernel((1,), (1,), (np.uint64(2_000_000),), stream=s)
    else:
        assert dev.fork(stream) is stream and dev.fork(None) is None   # one order: the NumPy device's
        def spin(s):
            pass

    def work(v):
        dev.memset_async(a.ptr, v, 256, stream)
        side = dev.fork(stream)
        spin(side)
        dev.copy_d2d_async(b.ptr, a.ptr, 128, side)        # the value from before the fork
        dev.memset_async(c.ptr, v + 1, 256, stream)          # the stream goes on beside the side's spin
        side = dev.fork(stream)                              # caught up: sees c
        dev.copy_d2d_async(b.ptr.offset(128), c.ptr, 128, side)
        dev.join(stream)
        dev.copy_d2d_async(c.ptr, b.ptr, 256, stream)        # after the join: the side's bytes

    def check(v):
        dev.synchronize()
        got = dev.copy_d2h(c.ptr, 256)
        assert (got[:128] == v).all() and (got[128:] == v + 1).all(), (v, got[:4], got[128:132])

    work(5)
    check(5)
    if dev.is_cuda:
        graph = dev.capture(lambda: work(9), stream)
        for _ in range(2):
            dev.memset_async(c.ptr, 0, 256, stream)
            dev.replay(graph, stream)
            check(9)


def test_trivial_kernel_through_handle(dev):
    """A kernel launched by name through gpu.kernel(...) (on the GPU: the CUDA build of it)."""
    from mtp_cupy.runtime.dtypes import BF16
    x = dev.upload(np.full(300, 1.5, np.float32).astype(BF16))
    r = dev.upload(np.full(300, 2.25, np.float32).astype(BF16))
    KernelLaunch(dev, dev.kernel("elementwise", "bf16_residual_add")).grid(2).block(128) \
        .arg_ptr(x.ptr).arg_ptr(r.ptr).arg_u32(300).launch()
    dev.synchronize()
    assert (dev.read(x.ptr, "bf16", 300).astype(np.float32) == 3.75).all()


def test_meta_layout_exact():
    raw = pack_mtp_attn_meta(7, (3 << 33) + 5, 42, [9, 1, 4], capacity=1024)
    assert len(raw) == 256 + 12
    assert raw[0:4] == (7).to_bytes(4, "little")
    assert raw[8:16] == ((3 << 33) + 5).to_bytes(8, "little")
    assert raw[16:20] == (42).to_bytes(4, "little")
    assert raw[256:268] == b"".join(v.to_bytes(4, "little") for v in (9, 1, 4))
    assert unpack_mtp_attn_meta(raw, 3) == (7, (3 << 33) + 5, 42, [9, 1, 4])


def test_meta_refuses_oversized_table():
    with pytest.raises(CapacityError):
        pack_mtp_attn_meta(0, 0, 1, list(range(200)), capacity=256 + 4 * 199)
    pack_mtp_attn_meta(0, 0, 1, list(range(199)), capacity=256 + 4 * 199)
    with pytest.raises(InputError):
        pack_mtp_attn_meta(-1, 0, 1, [0], capacity=1024)


def test_staged_slabs_equal_packed_ones(rng):
    """The hot-path stager writes exactly pack_mtp_attn_meta's bytes, per step and sequence."""
    bs, B, S = 16, 3, 1024
    stage = np.full((5, B * S), 0xAB, np.uint8)
    tables = [[int(b) for b in rng.permutation(500)[:int(rng.integers(1, 40))]] for _ in range(B)]
    rows0 = [int(rng.integers(0, len(t) * bs - 4)) for t in tables]
    pos = [int(x) for x in rng.integers(0, 1 << 20, B)]
    stage_mtp_meta(stage, 4, pos, rows0, tables, bs, S)
    for c, table in enumerate(tables):
        for i in range(4):
            row = rows0[c] + i
            want = pack_mtp_attn_meta(pos[c] + i, table[row // bs] * bs + row % bs, row + 1, table, S)
            got = stage[i, c * S:c * S + len(want)]
            assert unpack_mtp_attn_meta(got, len(table)) == unpack_mtp_attn_meta(want, len(table))
            assert bytes(got[256:]) == want[256:] and bytes(got[:4]) + bytes(got[8:20]) == want[:4] + want[8:20]
    one = np.full((5, S), 0xAB, np.uint8)           # one sequence (propose's path) writes the same bytes
    stage_mtp_meta(one, 4, pos[2:], rows0[2:], tables[2:], bs)
    n = 256 + 4 * len(tables[2])
    assert np.array_equal(one[:4, :n], stage[:4, 2 * S:2 * S + n])
    with pytest.raises(CapacityError):
        stage_mtp_meta(stage, 1, [0, 0], [0, 0], [[1], list(range(200))], bs, S)
    with pytest.raises(CapacityError):
        stage_mtp_meta(stage[:, :1024], 1, [0], [0], [list(range(200))], bs)


def test_forward_buffers(dev):
    fb = ForwardBuffers(dev, {"hidden_states": 2 * 7168, "logits": 4 * 1000})
    assert fb.hidden_states != fb.logits and fb.region_bytes("logits") == 4000
    assert fb.mtp_meta == fb.scratch.offset(MTP_META_OFFSET)
    assert fb.target_meta == fb.scratch.offset(TARGET_META_OFFSET)
    assert MTP_META_OFFSET - TARGET_META_OFFSET >= 256 + 4 * 1024  # the target's slab never reaches ours
    with pytest.raises(AttributeError):
        fb.nope
    with pytest.raises(CapacityError):
        ForwardBuffers(dev, {}, scratch_bytes=1024)
    for clash in ("scratch", "mtp_meta", "layout", "region_bytes"):   # a region may not hide an attribute
        with pytest.raises(ValueError, match=clash):
            ForwardBuffers(dev, {clash: 64})
    assert fb.layout["logits"][1] == 4000 and int(fb.logits) == int(fb.buf.ptr) + fb.layout["logits"][0]
    # the slab lands where the layout says: write through the region, read back at the offset
    slab = pack_mtp_attn_meta(5, 80, 6, [5], fb.mtp_meta_capacity)
    dev.copy_h2d(fb.mtp_meta, slab)
    assert bytes(dev.copy_d2h(fb.scratch.offset(MTP_META_OFFSET), len(slab))) == slab
