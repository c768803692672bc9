"""Run as `mpirun -n N python -m pytest tests/mpi`. Rank 0 prints the report; the other ranks write theirs to
pytest-rank{r}.log; the session's exit status is the worst over all ranks. GPU tests skip without CUDA by
tests/conftest.py's hook, which applies here too."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from mpi4py import MPI  # noqa: E402

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()


def pytest_configure(config):
    if RANK > 0:
        log = open(f"pytest-rank{RANK}.log", "w")
        sys.stdout = sys.stderr = log
        config.option.verbose = -1


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    import numpy as np
    mine = np.array([int(exitstatus)], dtype=np.int64)
    worst = np.zeros(1, dtype=np.int64)
    WORLD.Allreduce(mine, worst, op=MPI.MAX)
    session.exitstatus = int(worst[0])
    if RANK == 0 and worst[0] != exitstatus:
        print(f"\n[mpi] another rank failed (worst exit status {int(worst[0])}); see pytest-rank*.log")


_CACHE = {}


def _setup(kind):
    if kind not in _CACHE:
        import mtp_cupy
        from mtp_cupy.runtime.comm import make_communicator
        gpu = mtp_cupy.device(kind, device_id=RANK) if kind == "cuda" else mtp_cupy.device("ref")
        _CACHE[kind] = (gpu, make_communicator(gpu, WORLD))
    return _CACHE[kind]


@pytest.fixture(params=["ref", pytest.param("cuda", marks=pytest.mark.gpu)])
def dev_comm(request):
    """(device, communicator): MpiCommunicator on the NumPy device; NCCL on GPU `rank` where CUDA exists."""
    return _setup(request.param)


@pytest.fixture
def rank():
    return RANK


@pytest.fixture
def world():
    return SIZE
