"""Communicators for mpirun-launched ranks: rank r drives GPU r.

NcclCommunicator: cupy's NCCL binding; rank 0 makes the unique id and broadcasts it over mpi4py.
MpiCommunicator: the same calls for the NumPy device, over MPI on the CPU, with NCCL's bf16 arithmetic
(each element accumulated in fp32 and rounded to bf16 after every add, in rank order), so the
BF16-lane tricks that rely on `x + 0 == x` are exercised in CI exactly as on the GPU.

Deadlines. A rank that dies ends the job (mpirun); a rank that hangs, or never reaches a collective, would
leave the others waiting forever. Every call therefore has a deadline, `collective_timeout_s` (default
300 s): MPI calls are non-blocking collectives polled against it; eager NCCL calls are followed on the host
(an event, NCCL's async error) until done or expired, then the NCCL communicator is aborted. On expiry the
rank raises CollectiveTimeout and the communicator refuses every later call (a collective left half done
cannot be resumed). Each communicator works on its own duplicate of the MPI communicator, so a collective
left pending cannot match a later call the caller makes on the one it passed in.

mpi4py is an optional dependency (`pip install 'mtp_cupy[mpi]'`); it is imported only here, on first use."""
from __future__ import annotations

import math
import time

import numpy as np

from ..errors import CollectiveTimeout, CommError, ConfigError
from .backend import Backend
from .dtypes import BF16, dtype as _dtype

OPS = ("sum", "max")
DEFAULT_COLLECTIVE_TIMEOUT_S = 300.0
MPI_HINT = "pip install 'mtp_cupy[mpi]' (mpi4py and the mpich wheel, which provides mpiexec)"
_NCCL_ID_BYTES = 128


def mpi_world():
    """MPI.COMM_WORLD; CommError saying what to install when mpi4py or its MPI library is missing."""
    try:
        from mpi4py import MPI
    except ImportError as e:   # no mpi4py, or mpi4py without an MPI library (libmpi.so)
        raise CommError(f"several ranks need MPI, which is not usable here ({e}); {MPI_HINT}") from None
    except RuntimeError as e:
        raise CommError(f"MPI failed to start ({e}); {MPI_HINT}") from None
    return MPI.COMM_WORLD


def find_mpiexec(what: str = "several ranks") -> str:
    """The mpiexec that launches this Python's ranks: the one installed beside it (the mpich wheel puts it in
    the environment's bin/), else mpiexec or mpirun on PATH. CommError, one line saying what to install, when
    mpi4py, its MPI library or an mpiexec is missing. Does not initialise MPI in this process."""
    import importlib.util
    import shutil
    import subprocess
    import sys
    from pathlib import Path
    if importlib.util.find_spec("mpi4py") is None:
        raise CommError(f"{what} needs MPI, and mpi4py is not installed; {MPI_HINT}")
    beside = Path(sys.executable).parent / "mpiexec"
    exe = str(beside) if beside.is_file() else shutil.which("mpiexec") or shutil.which("mpirun")
    if exe is None:
        raise CommError(f"{what} needs MPI, and there is no mpiexec beside {sys.executable} or on PATH; {MPI_HINT}")
    probe = subprocess.run([sys.executable, "-c", "import mpi4py; mpi4py.rc.initialize = False; "
                            "from mpi4py import MPI"], capture_output=True, text=True)
    if probe.returncode != 0:
        why = (probe.stderr.strip().splitlines() or ["unknown error"])[-1]
        raise CommError(f"{what} needs MPI, and mpi4py cannot load an MPI library ({why}); {MPI_HINT}")
    return exe


def check_timeout(seconds) -> float:
    """`collective_timeout_s` as a float > 0 (math.inf: no deadline); ConfigError otherwise."""
    try:
        t = float(seconds)
    except (TypeError, ValueError):
        t = math.nan
    if isinstance(seconds, bool) or not t > 0:
        raise ConfigError(f"collective_timeout_s={seconds!r} must be a number of seconds > 0")
    return t


class Communicator:
    """One rank's view of the ranks: `all_reduce`, `all_gather`, `barrier`, each with a deadline."""
    rank: int
    world: int
    collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S
    _failed: str | None = None     # why this communicator is unusable, once a call has timed out or failed
    _timed_out = False

    def all_reduce(self, ptr, count: int, dtype: str = "bf16", op: str = "sum", stream=None) -> None:
        """In place: every rank's `count` elements at `ptr` become the element-wise reduction over the ranks.
        Raises CollectiveTimeout when the ranks do not all join within collective_timeout_s."""
        raise NotImplementedError

    def all_gather(self, send_ptr, recv_ptr, count: int, dtype: str = "bf16", stream=None) -> None:
        """recv holds world * count elements, rank r's at [r*count, (r+1)*count). Raises CollectiveTimeout."""
        raise NotImplementedError

    def barrier(self) -> None:
        """Wait until every rank is here (and, on CUDA, its device idle). Raises CollectiveTimeout."""
        raise NotImplementedError

    def _usable(self, what: str) -> None:
        if self._failed is not None:
            err = CollectiveTimeout if self._timed_out else CommError
            raise err(f"rank {self.rank}: {what} refused: this communicator is unusable after {self._failed}; "
                      "make a new one (every rank)")

    def _check(self, dtype: str, op: str = "sum", what: str = "collective") -> None:
        self._usable(what)
        if op not in OPS:
            raise CommError(f"reduction {op!r} not supported (choose {', '.join(OPS)})")
        _dtype(dtype)

    def _poll(self, done, what: str, on_timeout=None, check=None) -> None:
        """Poll `done()` until true or past the deadline (`check()` each round may raise); on expiry call
        `on_timeout()`, mark the communicator unusable and raise CollectiveTimeout. Spins briefly (a partner a
        few microseconds late), then sleeps, backing off to 1 ms."""
        deadline = time.monotonic() + self.collective_timeout_s
        spins = 0
        while not done():
            if check is not None:
                check()
            if time.monotonic() > deadline:
                if on_timeout is not None:
                    on_timeout()
                self._failed, self._timed_out = f"{what} timed out after {self.collective_timeout_s:g} s", True
                raise CollectiveTimeout(
                    f"rank {self.rank} of {self.world}: {what} did not complete within collective_timeout_s="
                    f"{self.collective_timeout_s:g} s (another rank is hung, dead or never made the call); the "
                    "communicator is aborted and unusable")
            spins += 1
            if spins > 200:
                time.sleep(min(1e-3, 1e-5 * (spins - 200)))

    def _mpi_wait(self, req, what: str, buffers) -> None:
        """Wait for an MPI request against the deadline. A timed-out request stays pending (MPI cannot cancel
        a collective), so it and its buffers are kept alive on the communicator."""
        def keep():
            self._pending = (req, buffers)
        self._poll(req.Test, what, on_timeout=keep)


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


def _own_mpi(mpi_comm):
    """A duplicate of `mpi_comm` (default COMM_WORLD): collective, so every rank constructs together."""
    return (mpi_comm if mpi_comm is not None else mpi_world()).Dup()


class MpiCommunicator(Communicator):
    """Collectives of the NumPy device over MPI (CPU), with NCCL's rounding."""

    def __init__(self, gpu: Backend, mpi_comm=None, collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S):
        self.gpu = gpu
        self.collective_timeout_s = check_timeout(collective_timeout_s)
        self.mpi = _own_mpi(mpi_comm)
        self.rank, self.world = self.mpi.Get_rank(), self.mpi.Get_size()

    def _gather(self, local: np.ndarray, out: np.ndarray, what: str) -> None:
        self._mpi_wait(self.mpi.Iallgather(local.view(np.uint8), out.view(np.uint8)), what, (local, out))

    def all_reduce(self, ptr, count, dtype="bf16", op="sum", stream=None):
        self._check(dtype, op, "all_reduce")
        dt = _dtype(dtype)
        local = np.ascontiguousarray(self.gpu.read(ptr, dt, count))
        parts = np.empty((self.world, count), dtype=dt)
        self._gather(local, parts, f"all_reduce of {count} {dtype}")
        self.gpu.copy_h2d(ptr, reduce_ranks(parts, dtype, op))

    def all_gather(self, send_ptr, recv_ptr, count, dtype="bf16", stream=None):
        self._check(dtype, what="all_gather")
        dt = _dtype(dtype)
        local = np.ascontiguousarray(self.gpu.read(send_ptr, dt, count))
        out = np.empty(self.world * count * dt.itemsize, dtype=np.uint8)
        self._gather(local, out, f"all_gather of {count} {dtype}")
        self.gpu.copy_h2d(recv_ptr, out)

    def barrier(self):
        self._usable("barrier")
        self._mpi_wait(self.mpi.Ibarrier(), "barrier", None)


class NcclCommunicator(Communicator):
    """NCCL on GPU `rank`. Eager calls are waited for on the host against the deadline (an event on the
    stream, polled with NCCL's async error); on expiry or an NCCL error the communicator is aborted
    (ncclCommAbort, which ends its kernels) and the call raises. Calls made while the stream is being
    captured into a CUDA graph are not waited for: a replayed graph runs without a deadline. Waiting makes an
    eager collective synchronous with the host; collective_timeout_s=math.inf keeps it asynchronous (and
    without a deadline). `barrier` synchronizes the device first, which has no deadline either."""

    def __init__(self, gpu: Backend, mpi_comm=None, collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S):
        from cupy.cuda import nccl
        self.nccl, self.gpu = nccl, gpu
        self.collective_timeout_s = check_timeout(collective_timeout_s)
        self.mpi = _own_mpi(mpi_comm)
        self.rank, self.world = self.mpi.Get_rank(), self.mpi.Get_size()
        uid = np.zeros(_NCCL_ID_BYTES, dtype=np.int16)   # cupy gives the id's chars as ints, signed or not
        if self.rank == 0:
            uid[:] = nccl.get_unique_id()
        self._mpi_wait(self.mpi.Ibcast(uid, root=0), "the NCCL unique id broadcast", uid)
        # every rank reached the broadcast, so none is missing from the (blocking) NCCL init
        self.comm = nccl.NcclCommunicator(self.world, tuple(int(x) for x in uid), self.rank)
        self._types = {"bf16": nccl.NCCL_BFLOAT16, "f32": nccl.NCCL_FLOAT32, "i32": nccl.NCCL_INT32,
                       "u8": nccl.NCCL_UINT8, "f16": nccl.NCCL_FLOAT16, "i64": nccl.NCCL_INT64}
        self._ops = {"sum": nccl.NCCL_SUM, "max": nccl.NCCL_MAX}

    def _stream(self, stream):
        return stream if stream is not None else self.gpu.cp.cuda.get_current_stream()

    def _abort(self) -> None:
        try:
            self.comm.abort()
        except Exception:   # noqa: BLE001 - already aborted or never made; the call raises anyway
            pass

    def _wait(self, stream, what: str) -> None:
        if math.isinf(self.collective_timeout_s) or stream.is_capturing():   # no deadline: stay asynchronous
            return
        done = self.gpu.cp.cuda.Event(disable_timing=True)
        done.record(stream)

        def async_error():
            try:
                self.comm.check_async_error()
            except self.nccl.NcclError as e:
                self._abort()
                self._failed = f"{what} failed ({e})"
                raise CommError(f"rank {self.rank} of {self.world}: {what}: NCCL reported {e}; the "
                                "communicator is aborted and unusable") from None
        self._poll(lambda: done.done, what, on_timeout=self._abort, check=async_error)

    def _nccl_type(self, dtype: str):
        if dtype not in self._types:
            raise CommError(f"NCCL has no mapping for dtype {dtype}")
        return self._types[dtype]

    def all_reduce(self, ptr, count, dtype="bf16", op="sum", stream=None):
        self._check(dtype, op, "all_reduce")
        s = self._stream(stream)
        self.comm.allReduce(int(ptr), int(ptr), int(count), self._nccl_type(dtype), self._ops[op], s.ptr)
        self._wait(s, f"all_reduce of {count} {dtype}")

    def all_gather(self, send_ptr, recv_ptr, count, dtype="bf16", stream=None):
        self._check(dtype, what="all_gather")
        s = self._stream(stream)
        self.comm.allGather(int(send_ptr), int(recv_ptr), int(count), self._nccl_type(dtype), s.ptr)
        self._wait(s, f"all_gather of {count} {dtype}")

    def barrier(self):
        self._usable("barrier")
        self.gpu.synchronize()
        self._mpi_wait(self.mpi.Ibarrier(), "barrier", None)


def make_communicator(gpu: Backend, mpi_comm=None,
                      collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S) -> Communicator:
    """The communicator that fits the device: NCCL for CUDA, MPI emulation for the NumPy device.

    Parameters
    ----------
    gpu : Backend
        This rank's device (`mtp_cupy.device("cuda", device_id=rank)` or `device("ref")`).
    mpi_comm : mpi4py.MPI.Comm, optional
        The ranks to span (default COMM_WORLD); the communicator works on its own duplicate of it.
        Collective: every rank of `mpi_comm` must call this together.
    collective_timeout_s : float
        Deadline of every call, in seconds (> 0; math.inf for none).

    Returns
    -------
    Communicator
        `NcclCommunicator` on CUDA, `MpiCommunicator` on the NumPy device.

    Raises
    ------
    ConfigError
        A collective_timeout_s that is not > 0.
    CommError
        mpi4py or its MPI library is missing (the message says what to install).
    CollectiveTimeout
        A later call that does not complete in time, on every rank that is still alive; the communicator
        is then unusable."""
    timeout = check_timeout(collective_timeout_s)
    mpi_comm = mpi_comm if mpi_comm is not None else mpi_world()
    if gpu.is_cuda:
        return NcclCommunicator(gpu, mpi_comm, timeout)
    return MpiCommunicator(gpu, mpi_comm, timeout)
