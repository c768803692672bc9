import numpy as np

from mtp_cupy.runtime.comm import reduce_ranks
from mtp_cupy.runtime.dtypes import BF16
from mpi4py import MPI

WORLD = MPI.COMM_WORLD


def _shared_rng():
    """The same random stream on every rank (seed from rank 0), fresh each run."""
    seed = WORLD.bcast(int.from_bytes(np.random.bytes(4), "little"), root=0)
    return np.random.default_rng(seed)


def test_bf16_all_reduce_matches_nccl_arithmetic(dev_comm, rank, world):
    gpu, comm = dev_comm
    rng = _shared_rng()
    parts = (rng.standard_normal((world, 4099)) * 10).astype(np.float32).astype(BF16)
    buf = gpu.upload(parts[rank])
    comm.all_reduce(buf.ptr, 4099, "bf16", "sum")
    gpu.synchronize()
    got = gpu.read(buf.ptr, "bf16", 4099).view(np.uint16)
    if world == 2:  # two ranks: one fp32 add, one rounding per element, exactly
        expect = (parts[0].astype(np.float32) + parts[1].astype(np.float32)).astype(BF16)
    else:
        expect = reduce_ranks(parts, "bf16", "sum")
    exact = (got == expect.view(np.uint16)).mean()
    assert exact == 1.0 if world == 2 else exact > 0.95  # NCCL's ring order may differ beyond 2 ranks
    ref = parts.astype(np.float64).sum(0)
    assert np.abs(got.view(BF16).astype(np.float64) - ref).max() <= 0.02 * np.abs(ref).max()


def test_bf16_lanes_with_zeros_are_exact(dev_comm, rank, world):
    """x + 0 is exact in bf16, so lanes each rank owns alone travel bit for bit (the argmax exchange)."""
    gpu, comm = dev_comm
    rng = _shared_rng()
    vals = rng.standard_normal(world * 4).astype(np.float32).astype(BF16)
    mine = np.zeros(world * 4, dtype=BF16)
    mine[rank * 4:(rank + 1) * 4] = vals[rank * 4:(rank + 1) * 4]
    buf = gpu.upload(mine)
    comm.all_reduce(buf.ptr, world * 4, "bf16", "sum")
    gpu.synchronize()
    assert np.array_equal(gpu.read(buf.ptr, "bf16", world * 4).view(np.uint16), vals.view(np.uint16))


def test_f32_all_reduce_and_max(dev_comm, rank, world):
    gpu, comm = dev_comm
    rng = _shared_rng()
    parts = rng.standard_normal((world, 64)).astype(np.float32)
    buf = gpu.upload(parts[rank])
    comm.all_reduce(buf.ptr, 64, "f32", "max")
    gpu.synchronize()
    assert np.array_equal(gpu.read(buf.ptr, "f32", 64), parts.max(0))
    buf = gpu.upload(parts[rank])
    comm.all_reduce(buf.ptr, 64, "f32", "sum")
    gpu.synchronize()
    np.testing.assert_allclose(gpu.read(buf.ptr, "f32", 64), parts.astype(np.float64).sum(0), rtol=1e-5, atol=1e-5)


def test_all_gather(dev_comm, rank, world):
    gpu, comm = dev_comm
    rng = _shared_rng()
    parts = rng.standard_normal((world, 33)).astype(np.float32)
    send, recv = gpu.upload(parts[rank]), gpu.alloc(world * 33 * 4)
    comm.all_gather(send.ptr, recv.ptr, 33, "f32")
    gpu.synchronize()
    assert np.array_equal(gpu.read(recv.ptr, "f32", (world, 33)), parts)
