"""The device model: the Backend ("gpu") interface, kernel handles by (module, name), KernelLaunch.

Two implementations: CupyBackend (real CUDA, kernels compiled from cuda_src/<module>.cu by NVRTC) and
RefBackend (the NumPy device in mtp_cupy.refdev, one Python twin per kernel)."""
from __future__ import annotations

import contextlib
import math
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..errors import ConfigError, KernelError
from .cuda_text import expand_kernel_macros, strip_comments
from .dtypes import dtype as _dtype
from .ptr import DevicePtr

CUDA_SRC = Path(__file__).resolve().parents[2] / "cuda_src"
_BOUNDS = r'(?:__launch_bounds__\([^)]*\)\s+)?'
_KERNEL_RE = re.compile(r'extern\s+"C"\s+__global__\s+' + _BOUNDS + r'void\s+' + _BOUNDS + r'(\w+)\s*\(')


def cuda_source(module: str) -> Path:
    return CUDA_SRC / f"{module}.cu"


def cuda_kernel_names(module: str) -> list[str]:
    """The extern "C" __global__ names a cuda_src module defines (read from the source text)."""
    path = cuda_source(module)
    if not path.exists():
        return []
    return _KERNEL_RE.findall(expand_kernel_macros(strip_comments(path.read_text())))


_INCLUDE_RE = re.compile(r'^#include "(\w+\.cuh)"\s*$', re.M)


def module_source(module: str) -> str:
    """The module's source with local `#include "x.cuh"` headers inlined (those they include too, each header
    once, as `#pragma once` would), so that a compile cache keyed on the source text sees header edits too."""
    seen: set[str] = set()

    def inline(m):
        if m.group(1) in seen:
            return ""
        seen.add(m.group(1))
        return _INCLUDE_RE.sub(inline, (CUDA_SRC / m.group(1)).read_text())
    return _INCLUDE_RE.sub(inline, cuda_source(module).read_text())


def cuda_modules() -> list[str]:
    return sorted(p.stem for p in CUDA_SRC.glob("*.cu"))


def is_torch_bf16(obj) -> bool:
    """A torch tensor of dtype bfloat16 (told without importing torch): NumPy and CuPy < 14 read it through
    its int16 view."""
    return type(obj).__module__.startswith("torch") and str(getattr(obj, "dtype", "")) == "torch.bfloat16"


def is_stream_like(obj) -> bool:
    """A torch / cupy stream, anything with `__cuda_stream__`, or a cudaStream_t address."""
    return (hasattr(obj, "__cuda_stream__") or hasattr(obj, "cuda_stream") or hasattr(obj, "ptr")
            or (isinstance(obj, int) and not isinstance(obj, bool)))


def check_stream(obj) -> None:
    """ConfigError unless `obj` is None or stream-like."""
    if obj is not None and not is_stream_like(obj):
        raise ConfigError(f"stream {obj!r}: pass a torch.cuda.Stream, a cupy stream, an object with __cuda_stream__ "
                          "or a cudaStream_t address")


@dataclass(frozen=True)
class KernelHandle:
    module: str
    name: str
    fn: Any  # cupy RawKernel, or the twin callable

    def __repr__(self) -> str:
        return f"KernelHandle({self.module}.{self.name})"


@dataclass
class DeviceBuffer:
    """Owns device memory; `.ptr` is what kernels get. Freed when the Python object goes."""
    ptr: DevicePtr
    nbytes: int
    owner: Any = None


class Backend:
    """The `gpu` of the seeds. Subclasses: CupyBackend, RefBackend."""

    name = "abstract"

    def __init__(self) -> None:
        self._kernels: dict[tuple[str, str], KernelHandle] = {}
        self._branch = threading.local()   # per thread: the side stream of fork / join and its two events

    # -- kernels ---------------------------------------------------------------------------------
    def kernel(self, module: str, name: str) -> KernelHandle:
        key = (module, name)
        h = self._kernels.get(key)
        if h is None:
            h = self._load_kernel(module, name)
            self._kernels[key] = h
        return h

    def kernel_opt(self, module: str, name: str) -> KernelHandle | None:
        try:
            return self.kernel(module, name)
        except KernelError:
            return None

    def _load_kernel(self, module: str, name: str) -> KernelHandle:
        raise NotImplementedError

    def _missing(self, module: str, name: str, defined: list[str]) -> KernelError:
        src = cuda_source(module)
        if not src.exists() and not defined:
            return KernelError(f"kernel module {module!r} not found ({src} does not exist)")
        return KernelError(f"kernel {name!r} is not defined in {src.name}; it defines: {', '.join(defined) or 'nothing'}")

    def launch(self, handle: KernelHandle, grid, block, shared: int, args: list[tuple[str, Any]], stream,
               cluster=(1, 1, 1), early: bool = True) -> None:
        """Launch `handle`. `early`: its blocks may be scheduled while the kernel ahead still runs (programmatic
        dependent launch, where the device has it); False: only once that kernel has finished."""
        raise NotImplementedError

    # -- memory ----------------------------------------------------------------------------------
    def alloc(self, nbytes: int) -> DeviceBuffer:
        raise NotImplementedError

    def copy_h2d(self, dst: DevicePtr, host: np.ndarray | bytes) -> None:
        raise NotImplementedError

    def copy_h2d_async(self, dst: DevicePtr, host: np.ndarray | bytes, stream=None) -> None:
        self.copy_h2d(dst, host)

    def copy_d2h(self, src: DevicePtr, nbytes: int) -> np.ndarray:
        """Synchronous copy; returns a new uint8[nbytes] (8-byte aligned, owned by the caller)."""
        raise NotImplementedError

    def copy_d2d_async(self, dst: DevicePtr, src: DevicePtr, nbytes: int, stream=None) -> None:
        raise NotImplementedError

    def memset_async(self, dst: DevicePtr, value: int, nbytes: int, stream=None) -> None:
        raise NotImplementedError

    def synchronize(self, stream=None) -> None:
        pass

    def new_stream(self, non_blocking: bool = True):
        return None

    def new_event(self, timing: bool = True):
        return None

    def record(self, event, stream=None) -> None:
        pass

    def fork(self, stream=None):
        """A side stream for work that does not depend on what `stream` runs next: it starts after the work queued
        on `stream` so far and runs beside `stream`'s later work. Forking again while the branch is open makes the
        side catch up with `stream` (for side work that needs what `stream` has produced since); `join(stream)`
        ends the branch. A captured graph holds it as a second path. One side stream per thread. On a device
        without streams (the NumPy device, synchronous) this is `stream`, and the work runs in queue order."""
        b = self._branch
        if not hasattr(b, "side"):
            b.side, b.forked, b.done = self.new_stream(True), self.new_event(False), self.new_event(False)
        if b.side is None:
            return stream
        self.record(b.forked, stream)
        self.wait_event(b.side, b.forked)
        b.open = True
        return b.side

    def join(self, stream=None) -> None:
        """`stream`'s later work waits for the work queued on this thread's side stream since the branch opened
        (see fork); without an open branch nothing (a capture must not wait for work outside it)."""
        b = self._branch
        if not getattr(b, "open", False):
            return
        self.record(b.done, b.side)
        self.wait_event(stream, b.done)
        b.open = False

    # -- sharing streams and arrays with the caller (torch, cupy) ----------------------------------
    @property
    def xp(self):
        """The array module of this device's arrays (numpy here, cupy on CUDA)."""
        return np

    def external_stream(self, stream):
        """This device's handle of a caller's stream (a torch.cuda.Stream, a cupy stream, anything with
        `__cuda_stream__`, or a raw cudaStream_t int); None where the device has no streams (the NumPy device
        is synchronous, so any stream is respected)."""
        check_stream(stream)
        return None

    def wait_event(self, stream, event) -> None:
        """Make `stream` wait for `event` on the device; the host does not wait."""

    def host_wait(self, event) -> None:
        """Block the host until `event` has happened (one event, never the whole device)."""

    def copy_d2h_on(self, src: DevicePtr, nbytes: int, stream) -> np.ndarray:
        """copy_d2h ordered on `stream`: the host waits for that stream only, never for the whole device."""
        return self.copy_d2h(src, nbytes)

    def export(self, src: DevicePtr, dtype, shape, stream=None):
        """A new array of this device (it exports `__dlpack__`) holding a copy of `shape` `dtype` elements at
        `src`, written on `stream`; later calls never overwrite it."""
        return self.read(src, dtype, shape)

    def from_dlpack(self, obj, stream=None):
        """(array, dtype name) of a DLPack object on this device, read in place; `stream` is the one that will
        use it (the producer orders its own stream before it). Only CUDA devices hold device tensors."""
        raise NotImplementedError(f"the {self.name} device holds no DLPack device tensors")

    def to_host(self, arr, stream=None) -> np.ndarray:
        """A host copy of an array of this device (waits for `stream` only)."""
        return np.asarray(arr)

    def elapsed_ms(self, start, end) -> float:
        return 0.0

    @property
    def is_cuda(self) -> bool:
        return False

    def alloc_pinned(self, nbytes: int) -> np.ndarray:
        """Host staging memory (page-locked on CUDA: a captured copy from it reads it at replay time)."""
        return np.zeros(int(nbytes), np.uint8)

    def alloc_mapped(self, nbytes: int) -> tuple[np.ndarray, DeviceBuffer]:
        """Zeroed host memory kernels read and write in place: (the host's uint8 array, the buffer that owns it,
        whose `.ptr` kernels take; keep it while either is used). Page-locked and mapped on CUDA; on the NumPy
        device a segment of its address space."""
        raise NotImplementedError

    def stream_done(self, stream) -> bool:
        """Whether all work queued on `stream` has run (never waits). A failed kernel raises here."""
        return True

    def using(self, stream):
        """Context making `stream` the one launches with stream=None go to."""
        return contextlib.nullcontext()

    def capture(self, fn, stream):
        """Record fn()'s launches on `stream` as a graph (None where the device has no graphs)."""
        return None

    def replay(self, graph, stream) -> None:
        raise NotImplementedError

    # -- typed conveniences (host <-> device) -----------------------------------------------------
    def upload(self, host: np.ndarray) -> DeviceBuffer:
        host = np.ascontiguousarray(host)
        buf = self.alloc(max(host.nbytes, 1))
        self.copy_h2d(buf.ptr, host)
        return buf

    def read(self, src: DevicePtr, dtype, shape, stream=None) -> np.ndarray:
        """A host copy of `shape` `dtype` elements at `src` (with `stream`: ordered on it, waiting for it only)."""
        dt = _dtype(dtype)
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        n = math.prod(shape) * dt.itemsize
        raw = self.copy_d2h(src, n) if stream is None else self.copy_d2h_on(src, n, stream)
        return raw.view(dt).reshape(shape)   # copy_d2h(_on) hands out a new array

    def fill(self, dst: DevicePtr, nbytes: int, byte: int = 0xFF) -> None:
        """Poison or clear a region (synchronous)."""
        self.memset_async(dst, byte, nbytes)
        self.synchronize()


class KernelLaunch:
    """`KernelLaunch(gpu, h).grid(..).block(..).shared(..).arg_ptr(p).arg_u32(n).launch(stream)`.

    Argument types must match the kernel's parameters: ptr -> pointer, u32/i32/f32/u64/i64 scalars."""

    __slots__ = ("gpu", "h", "_grid", "_block", "_shared", "_args", "_cluster", "_early")

    def __init__(self, gpu: Backend, handle: KernelHandle):
        self.gpu, self.h = gpu, handle
        self._grid, self._block, self._shared, self._args, self._cluster = (1, 1, 1), (1, 1, 1), 0, [], (1, 1, 1)
        self._early = True

    def after_whole(self):
        """Schedule no block before the kernel ahead has finished (no programmatic dependent launch): for a kernel
        whose blocks, parked early in their pdl_wait, would take SM slots from a large kernel ahead (the argmax
        behind an LM head: 2-7 us a step on an H100, BENCHMARKS.md)."""
        self._early = False
        return self

    def grid(self, x, y=1, z=1):
        self._grid = (int(x), int(y), int(z))
        return self

    def block(self, x, y=1, z=1):
        self._block = (int(x), int(y), int(z))
        return self

    def shared(self, nbytes: int):
        self._shared = int(nbytes)
        return self

    def cluster(self, x=1, y=1, z=1):
        """Thread block cluster dims (sm_90; each divides the grid's): the blocks of a cluster share shared memory."""
        c = (int(x), int(y), int(z))
        if min(c) < 1:
            raise KernelError(f"{self.h}: cluster dims {c} must be >= 1")
        self._cluster = c
        return self

    def _arg(self, kind: str, v):
        self._args.append((kind, v))
        return self

    def arg_ptr(self, p):
        return self._arg("ptr", DevicePtr(int(p)))

    def arg_u32(self, v):
        v = int(v)
        if not 0 <= v < 1 << 32:
            raise KernelError(f"{self.h}: u32 argument {v} out of range")
        return self._arg("u32", v)

    def arg_i32(self, v):
        v = int(v)
        if not -(1 << 31) <= v < 1 << 31:
            raise KernelError(f"{self.h}: i32 argument {v} out of range")
        return self._arg("i32", v)

    def arg_u64(self, v):
        return self._arg("u64", int(v))

    def arg_i64(self, v):
        return self._arg("i64", int(v))

    def arg_f32(self, v):
        return self._arg("f32", float(v))

    def launch(self, stream=None) -> None:
        if min(self._grid) <= 0 or min(self._block) <= 0:
            return  # empty launch: nothing to do (CUDA would reject a zero grid)
        if any(g % c for g, c in zip(self._grid, self._cluster)):
            raise KernelError(f"{self.h}: cluster {self._cluster} does not divide grid {self._grid}")
        self.gpu.launch(self.h, self._grid, self._block, self._shared, self._args, stream, self._cluster, self._early)


TwinFn = Callable[..., None]
