"""RefBackend: the NumPy device.

Device memory is a simulated address space: every allocation is a uint8 segment placed at a 256-byte
aligned address above a non-zero base (so NULL is caught), and a view that runs past the end of its
segment raises, the way compute-sanitizer would flag it. Kernels are the Python twins in refdev/twins."""
from __future__ import annotations

import bisect
import math
import weakref

import numpy as np

from ..errors import KernelError
from ..runtime.backend import Backend, DeviceBuffer, KernelHandle
from ..runtime.dtypes import dtype as _dtype
from ..runtime.ptr import DevicePtr
from .registry import load_all, names_in

BASE = 0x7F00_0000_0000
ALIGN = 256
GUARD = 4096  # gap between segments so a small overrun never lands in a neighbour


class RefBackend(Backend):
    name = "ref"

    def __init__(self) -> None:
        super().__init__()
        self._starts: list[int] = []
        self._segs: dict[int, np.ndarray] = {}
        self._next = BASE
        self.launch_geometry = ((1, 1, 1), (1, 1, 1), 0)
        self.launches = 0

    # -- kernels ---------------------------------------------------------------------------------
    def _load_kernel(self, module: str, name: str) -> KernelHandle:
        fn = load_all().get((module, name))
        if fn is None:
            raise self._missing(module, name, names_in(module))
        return KernelHandle(module, name, fn)

    def launch(self, handle, grid, block, shared, args, stream, cluster=(1, 1, 1), early=True) -> None:
        self.launch_geometry = (grid, block, shared)
        self.launches += 1
        try:
            handle.fn(self, *[v for _, v in args])
        except Exception as e:  # a twin failing (an overrun included) is a kernel failure: name it
            raise KernelError(f"kernel {handle.module}.{handle.name} failed: {e}") from e

    # -- memory ----------------------------------------------------------------------------------
    def alloc(self, nbytes: int) -> DeviceBuffer:
        nbytes = int(nbytes)
        if nbytes <= 0:
            raise ValueError(f"alloc of {nbytes} bytes")
        addr = self._next
        self._next = (addr + nbytes + GUARD + ALIGN - 1) // ALIGN * ALIGN
        seg = np.zeros(nbytes, dtype=np.uint8)
        bisect.insort(self._starts, addr)
        self._segs[addr] = seg
        buf = DeviceBuffer(DevicePtr(addr), nbytes)
        weakref.finalize(buf, self._free, addr)
        return buf

    def alloc_mapped(self, nbytes: int) -> tuple[np.ndarray, DeviceBuffer]:
        buf = self.alloc(nbytes)
        return self._segs[int(buf.ptr)], buf

    def _free(self, addr: int) -> None:
        if addr in self._segs:
            del self._segs[addr]
            self._starts.pop(bisect.bisect_left(self._starts, addr))

    def _locate(self, ptr: int, nbytes: int) -> tuple[np.ndarray, int]:
        ptr = int(ptr)
        if ptr == 0:
            raise KernelError("NULL device pointer dereferenced")
        i = bisect.bisect_right(self._starts, ptr) - 1
        if i < 0:
            raise KernelError(f"address 0x{ptr:x} is not in any allocation")
        start = self._starts[i]
        seg = self._segs[start]
        off = ptr - start
        if off + nbytes > seg.nbytes:
            raise KernelError(f"access of {nbytes} bytes at 0x{ptr:x} runs past its allocation "
                              f"(0x{start:x}, {seg.nbytes} bytes)")
        return seg, off

    def view(self, ptr, dtype, shape) -> np.ndarray:
        """Writable numpy view of device memory (twins use this)."""
        dt = _dtype(dtype)
        shape = (int(shape),) if np.isscalar(shape) else tuple(int(s) for s in shape)
        n = math.prod(shape) * dt.itemsize
        seg, off = self._locate(ptr, n)
        if off % dt.itemsize:
            raise KernelError(f"misaligned {dt} access at 0x{int(ptr):x}")
        return seg[off:off + n].view(dt).reshape(shape)

    def copy_h2d(self, dst, host) -> None:
        b = np.frombuffer(bytes(host), dtype=np.uint8) if isinstance(host, (bytes, bytearray)) else \
            np.ascontiguousarray(host).reshape(-1).view(np.uint8)
        self.view(dst, np.uint8, b.size)[:] = b

    def copy_d2h(self, src, nbytes: int) -> np.ndarray:
        return self.view(src, np.uint8, nbytes).copy()

    def copy_d2d_async(self, dst, src, nbytes: int, stream=None) -> None:
        data = self.view(src, np.uint8, nbytes).copy()
        self.view(dst, np.uint8, nbytes)[:] = data

    def memset_async(self, dst, value: int, nbytes: int, stream=None) -> None:
        self.view(dst, np.uint8, nbytes)[:] = value & 0xFF

    @property
    def bytes_in_use(self) -> int:
        return sum(s.nbytes for s in self._segs.values())
