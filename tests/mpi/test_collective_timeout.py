"""`mpirun -n N`: a rank that never reaches a collective does not hang the others. Rank 1 skips the call;
rank 0, with a 2 s deadline, raises CollectiveTimeout within ~5 s, and its communicator refuses every later
call. The communicator works on its own duplicate of COMM_WORLD, so the collective rank 0 leaves pending
cannot match the calls the session makes afterwards (the barrier here, the conftest's exit-status
reduction), and every rank ends cleanly."""
import math
import time

import numpy as np
import pytest

from mpi4py import MPI
import mtp_cupy
from mtp_cupy.errors import CollectiveTimeout, CommError, ConfigError
from mtp_cupy.runtime.comm import DEFAULT_COLLECTIVE_TIMEOUT_S, make_communicator
from mtp_cupy.runtime.dtypes import BF16

WORLD = MPI.COMM_WORLD
TIMEOUT = 2.0


def _call(comm, gpu, what):
    buf = gpu.upload(np.ones(8, BF16))
    out = gpu.alloc(2 * 8 * comm.world)
    if what == "all_reduce":
        comm.all_reduce(buf.ptr, 8, "bf16", "sum")
    elif what == "all_gather":
        comm.all_gather(buf.ptr, out.ptr, 8, "bf16")
    else:
        comm.barrier()


@pytest.mark.parametrize("what", ["all_reduce", "all_gather", "barrier"])
def test_skipped_collective_raises_on_the_rank_that_waits(rank, world, what):
    if world < 2:
        pytest.skip("needs two ranks")
    gpu = mtp_cupy.device("ref")
    comm = make_communicator(gpu, WORLD, collective_timeout_s=TIMEOUT)
    assert comm.collective_timeout_s == TIMEOUT
    if rank == 0:
        t0 = time.monotonic()
        with pytest.raises(CollectiveTimeout, match=rf"rank 0 of {world}: {what}.*collective_timeout_s=2 s"
                                                    r".*unusable"):
            _call(comm, gpu, what)
        took = time.monotonic() - t0
        assert TIMEOUT <= took < 5, f"raised after {took:.2f} s"
        with pytest.raises(CollectiveTimeout, match="unusable after"):   # no later call reaches MPI
            _call(comm, gpu, "all_reduce")
        assert isinstance(CollectiveTimeout("x"), CommError)
    # rank 1 skipped the call; everyone meets here, on COMM_WORLD, once rank 0 has given up
    WORLD.Barrier()


def test_collectives_within_the_deadline_are_unchanged(rank, world):
    gpu = mtp_cupy.device("ref")
    comm = make_communicator(gpu, WORLD, collective_timeout_s=TIMEOUT)
    buf = gpu.upload(np.full(4, rank + 1, np.float32))
    comm.all_reduce(buf.ptr, 4, "f32", "sum")
    assert np.array_equal(gpu.read(buf.ptr, "f32", 4), np.full(4, world * (world + 1) / 2, np.float32))
    comm.barrier()
    assert make_communicator(gpu, WORLD).collective_timeout_s == DEFAULT_COLLECTIVE_TIMEOUT_S
    assert make_communicator(gpu, WORLD, collective_timeout_s=math.inf).collective_timeout_s == math.inf


@pytest.mark.parametrize("bad", [0, -1, "soon", None, True, math.nan])
def test_timeout_must_be_positive(bad):
    with pytest.raises(ConfigError, match="collective_timeout_s"):
        make_communicator(mtp_cupy.device("ref"), WORLD, collective_timeout_s=bad)
