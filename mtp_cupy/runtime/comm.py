"""Communicators for mpirun-launched ranks: rank r drives GPU r.

NcclCommunicator: cupy's NCCL binding; rank 0 makes the unique id and broadcasts it over mpi4py.
MpiCommunicator: the same calls for the NumPy device, over MPI on the CPU, with NCCL's bf16 arithmetic
(each element accumulated in fp32 and rounded to bf16 after every add, in rank order), so the
BF16-lane tricks that rely on `x + 0 == x` are exercised in CI exactly as on the GPU."""
from __future__ import annotations

import numpy as np

from ..errors import CommError
from .backend import Backend
from .dtypes import BF16, dtype as _dtype

OPS = ("sum", "max")


def mpi_world():
    from mpi4py import MPI
    return MPI.COMM_WORLD


class Communicator:
    rank: int
    world: int

    def all_reduce(self, ptr, count: int, dtype: str = "bf16", op: str = "sum", stream=None) -> None:
        raise NotImplementedError

    def all_gather(self, send_ptr, recv_ptr, count: int, dtype: str = "bf16", stream=None) -> None:
        """recv holds world * count elements, rank r's at [r*count, (r+1)*count)."""
        raise NotImplementedError

    def barrier(self) -> None:
        raise NotImplementedError

    def _check(self, dtype: str, op: str = "sum") -> None:
        if op not in OPS:
            raise CommError(f"reduction {op!r} not supported (choose {', '.join(OPS)})")
        _dtype(dtype)


def reduce_ranks(parts: np.ndarray, dtype: str, op: str) -> np.ndarray:
    """Reduce [world, count] in rank order with the element type's own rounding after each step."""
    dt = _dtype(dtype)
    acc = parts[0].copy()
    for p in parts[1:]:
        if op == "max":
            acc = np.maximum(acc, p)
        elif dt == BF16:
            acc = (acc.astype(np.float32) + p.astype(np.float32)).astype(BF16)
        else:
            acc = (acc + p).astype(dt)
    return acc


class MpiCommunicator(Communicator):
    def __init__(self, gpu: Backend, mpi_comm=None):
        self.gpu = gpu
        self.mpi = mpi_comm if mpi_comm is not None else mpi_world()
        self.rank, self.world = self.mpi.Get_rank(), self.mpi.Get_size()

    def all_reduce(self, ptr, count, dtype="bf16", op="sum", stream=None):
        self._check(dtype, op)
        dt = _dtype(dtype)
        local = self.gpu.read(ptr, dt, count)
        parts = np.empty((self.world, count), dtype=dt)
        self.mpi.Allgather(local.view(np.uint8), parts.view(np.uint8))
        self.gpu.copy_h2d(ptr, reduce_ranks(parts, dtype, op))

    def all_gather(self, send_ptr, recv_ptr, count, dtype="bf16", stream=None):
        self._check(dtype)
        dt = _dtype(dtype)
        local = self.gpu.read(send_ptr, dt, count)
        out = np.empty(self.world * count * dt.itemsize, dtype=np.uint8)
        self.mpi.Allgather(local.view(np.uint8), out)
        self.gpu.copy_h2d(recv_ptr, out)

    def barrier(self):
        self.mpi.Barrier()


class NcclCommunicator(Communicator):
    def __init__(self, gpu: Backend, mpi_comm=None):
        from cupy.cuda import nccl
        self.nccl, self.gpu = nccl, gpu
        self.mpi = mpi_comm if mpi_comm is not None else mpi_world()
        self.rank, self.world = self.mpi.Get_rank(), self.mpi.Get_size()
        uid = nccl.get_unique_id() if self.rank == 0 else None
        uid = self.mpi.bcast(uid, root=0)
        self.comm = nccl.NcclCommunicator(self.world, uid, self.rank)
        self._types = {"bf16": nccl.NCCL_BFLOAT16, "f32": nccl.NCCL_FLOAT32, "i32": nccl.NCCL_INT32,
                       "u8": nccl.NCCL_UINT8, "f16": nccl.NCCL_FLOAT16, "i64": nccl.NCCL_INT64}
        self._ops = {"sum": nccl.NCCL_SUM, "max": nccl.NCCL_MAX}

    def _stream_ptr(self, stream) -> int:
        return (stream if stream is not None else self.gpu.cp.cuda.get_current_stream()).ptr

    def all_reduce(self, ptr, count, dtype="bf16", op="sum", stream=None):
        self._check(dtype, op)
        if dtype not in self._types:
            raise CommError(f"NCCL has no mapping for dtype {dtype}")
        self.comm.allReduce(int(ptr), int(ptr), int(count), self._types[dtype], self._ops[op], self._stream_ptr(stream))

    def all_gather(self, send_ptr, recv_ptr, count, dtype="bf16", stream=None):
        self._check(dtype)
        self.comm.allGather(int(send_ptr), int(recv_ptr), int(count), self._types[dtype], self._stream_ptr(stream))

    def barrier(self):
        self.gpu.synchronize()
        self.mpi.Barrier()


def make_communicator(gpu: Backend, mpi_comm=None) -> Communicator:
    """The communicator that fits the device: NCCL for CUDA, MPI emulation for the NumPy device."""
    mpi_comm = mpi_comm if mpi_comm is not None else mpi_world()
    if gpu.is_cuda:
        return NcclCommunicator(gpu, mpi_comm)
    return MpiCommunicator(gpu, mpi_comm)
