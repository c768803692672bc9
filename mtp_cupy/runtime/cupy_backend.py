"""CupyBackend: real CUDA. Each cuda_src/<module>.cu is compiled once with NVRTC through cupy.RawModule
(cupy also caches the binary on disk) and kernels launch as RawKernels with raw addresses and scalars.

Sharing with torch: `external_stream` wraps a caller's stream (`cupy.cuda.Stream.from_external` on CuPy >= 14,
`ExternalStream` before), `from_dlpack` reads a caller's CUDA tensor in place (a torch bf16 tensor travels as
its int16 view on CuPy < 14, whose DLPack import of bf16 crashed), `bf16_rows` narrows f32/f16 rows to bf16 on
the device, `export` hands results back as fresh cupy arrays."""
from __future__ import annotations

import sys
import threading

import numpy as np

from ..errors import KernelError
from .backend import (Backend, DeviceBuffer, KernelHandle, check_stream, cuda_kernel_names, cuda_source,
                      is_torch_bf16, module_source)
from .dtypes import BF16
from .dtypes import dtype as _dtype
from .ptr import DevicePtr

# -default-device: unannotated functions (lambdas in kernels) are device code. No fast-math: the twins
# assume IEEE expf / sincosf / division.
NVRTC_OPTIONS = ("-std=c++17", "-default-device")
# Modules built for the architecture-specific target on a 9.0 device (their wgmma kernels need sm_90a; they are
# launched nowhere else).
SM90A_MODULES = frozenset({"gemv_wg"})
# CUfunction handle -> dynamic shared bytes opted in. Process-wide: CuPy shares a compiled module's functions
# between backends, so one backend's smaller opt-in must never lower what another one relies on.
_SMEM_OPTIN: dict[int, int] = {}
_LARGE_CLUSTERS: set[int] = set()   # CUfunctions allowed clusters past 8 blocks (process-wide, as above)

_SCALAR = {"ptr": np.uint64, "u32": np.uint32, "i32": np.int32, "u64": np.uint64, "i64": np.int64,
           "f32": np.float32}
H2D, D2H, D2D = 1, 2, 3
# f32 -> bf16 bits, round to nearest even (what __float2bfloat16_rn and ml_dtypes do); NaN stays a quiet NaN
_F32_TO_BF16 = """
unsigned int u = __float_as_uint(x);
y = ((u & 0x7fffffffu) > 0x7f800000u) ? (unsigned short)((u >> 16) | 0x40u)
                                      : (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
"""


def cuda_available() -> bool:
    try:
        import cupy
        return bool(cupy.cuda.is_available())
    except Exception:
        return False


BOUNCE_BYTES = 1 << 16   # device-to-host reads up to this size go through a pinned buffer


class CupyBackend(Backend):
    name = "cuda"

    def __init__(self, device_id: int = 0, pdl: bool = True) -> None:
        """A CUDA device. `pdl`: launch kernels with programmatic dependent launch (see runtime/pdl.py); each
        kernel's launch then overlaps the tail of the one before it, in eager runs and in captured graphs. It
        needs compute capability 9.0 (Hopper); on older GPUs kernels launch plainly."""
        super().__init__()
        import cupy
        self.cp = cupy
        self.device_id = device_id
        cupy.cuda.Device(device_id).use()
        self._modules: dict[str, object] = {}
        self._pinned: list = []
        self._bounce = threading.local()   # per thread: a pinned landing area for small device-to-host reads
        self._narrow = None
        self.cupy_major = int(cupy.__version__.split(".")[0])
        self.launches = 0
        self.pdl = None
        self.compute_capability = int(cupy.cuda.Device(device_id).compute_capability)   # 90: Hopper
        if pdl and self.compute_capability >= 90:
            from .pdl import PdlLauncher
            self.pdl = PdlLauncher()
        self._cufunc: dict[int, int] = {}   # id(RawKernel) -> CUfunction handle
        self._plain_ex = None   # a launcher without PDL, for cluster launches when pdl is off

    @property
    def is_cuda(self) -> bool:
        return True

    def module(self, module: str):
        m = self._modules.get(module)
        if m is None:
            path = cuda_source(module)
            if not path.exists():
                raise KernelError(f"kernel module {module!r} not found ({path} does not exist)")
            opts = NVRTC_OPTIONS + (("-arch=sm_90a",) if module in SM90A_MODULES and self.compute_capability == 90
                                    else ())
            m = self.cp.RawModule(code=module_source(module), options=opts)
            try:
                m.compile()
            except Exception as e:
                raise KernelError(f"NVRTC failed to compile {path.name}: {e}") from e
            self._modules[module] = m
        return m

    def _load_kernel(self, module: str, name: str) -> KernelHandle:
        mod = self.module(module)
        try:  # names a macro defines are not in the source scan, so ask the module itself
            return KernelHandle(module, name, mod.get_function(name))
        except Exception:
            raise self._missing(module, name, cuda_kernel_names(module)) from None

    def _stream(self, stream):
        return stream if stream is not None else self.cp.cuda.get_current_stream()

    def launch(self, handle, grid, block, shared, args, stream, cluster=(1, 1, 1), early=True) -> None:
        if shared > 48 * 1024:
            # more than 48 KiB of dynamic shared memory needs the per-kernel opt-in attribute; only ever raised
            key = int(handle.fn.kernel.ptr)
            if _SMEM_OPTIN.get(key, 0) < shared:
                handle.fn.max_dynamic_shared_size_bytes = shared
                _SMEM_OPTIN[key] = shared
        try:
            ex = self.pdl if early else None
            if ex is None and (cluster != (1, 1, 1) or self.pdl is not None):
                if self._plain_ex is None:
                    from .pdl import PdlLauncher
                    self._plain_ex = PdlLauncher(pdl=False)
                ex = self._plain_ex
            if ex is not None:
                f = self._cufunc.get(id(handle.fn))
                if f is None:
                    f = self._cufunc[id(handle.fn)] = int(handle.fn.kernel.ptr)
                if cluster[0] * cluster[1] * cluster[2] > 8 and f not in _LARGE_CLUSTERS:
                    from .pdl import allow_large_clusters
                    allow_large_clusters(f)
                    _LARGE_CLUSTERS.add(f)
                ex.launch(f, grid, block, shared, args, self._stream(stream).ptr, cluster)
            else:
                handle.fn(grid, block, tuple(_SCALAR[k](v) for k, v in args), shared_mem=shared,
                          stream=self._stream(stream))
        except Exception as e:
            raise KernelError(f"launch of {handle.module}.{handle.name} failed: {e}") from e
        self.launches += 1

    def alloc(self, nbytes: int) -> DeviceBuffer:
        mem = self.cp.cuda.alloc(int(nbytes))
        return DeviceBuffer(DevicePtr(mem.ptr), int(nbytes), mem)

    def copy_h2d(self, dst, host) -> None:
        h = np.frombuffer(bytes(host), np.uint8) if isinstance(host, (bytes, bytearray)) else np.ascontiguousarray(host)
        if h.nbytes:
            self.cp.cuda.runtime.memcpy(int(dst), h.ctypes.data, h.nbytes, H2D)

    def copy_h2d_async(self, dst, host, stream=None) -> None:
        h = np.frombuffer(bytes(host), np.uint8) if isinstance(host, (bytes, bytearray)) else np.ascontiguousarray(host)
        if h.nbytes:  # pageable source: the driver stages it before returning, so `h` may go
            self.cp.cuda.runtime.memcpyAsync(int(dst), h.ctypes.data, h.nbytes, H2D, self._stream(stream).ptr)

    def copy_d2h(self, src, nbytes: int) -> np.ndarray:
        out = np.empty(int(nbytes), np.uint8)
        if nbytes:
            self.cp.cuda.runtime.memcpy(out.ctypes.data, int(src), int(nbytes), D2H)
        return out

    def copy_d2d_async(self, dst, src, nbytes: int, stream=None) -> None:
        if nbytes:
            self.cp.cuda.runtime.memcpyAsync(int(dst), int(src), int(nbytes), D2D, self._stream(stream).ptr)

    def memset_async(self, dst, value: int, nbytes: int, stream=None) -> None:
        if nbytes:
            self.cp.cuda.runtime.memsetAsync(int(dst), int(value), int(nbytes), self._stream(stream).ptr)

    def synchronize(self, stream=None) -> None:
        if stream is None:
            self.cp.cuda.Device(self.device_id).synchronize()
        else:
            stream.synchronize()

    def alloc_pinned(self, nbytes: int) -> np.ndarray:
        mem = self.cp.cuda.alloc_pinned_memory(int(nbytes))
        arr = np.frombuffer(mem, np.uint8, int(nbytes))
        self._pinned.append(mem)          # the array does not own the pinned block
        return arr

    def alloc_mapped(self, nbytes: int) -> tuple[np.ndarray, DeviceBuffer]:
        mem = self.cp.cuda.alloc_pinned_memory(int(nbytes))
        self._pinned.append(mem)   # kept, as alloc_pinned's: a chain still queued may read it after its owner goes
        arr = np.frombuffer(mem, np.uint8, int(nbytes))
        arr[:] = 0
        host = arr.ctypes.data
        dev = int(self.cp.cuda.runtime.pointerGetAttributes(host).devicePointer)
        if dev != host:   # unified addressing maps pinned memory at its host address (every 64-bit Linux GPU)
            raise KernelError(f"pinned host memory at 0x{host:x} is mapped at 0x{dev:x}, not at its host address")
        return arr, DeviceBuffer(DevicePtr(dev), int(nbytes), mem)

    def stream_done(self, stream) -> bool:
        return bool(self._stream(stream).done)

    def using(self, stream):
        return stream

    def capture(self, fn, stream):
        with stream:
            stream.begin_capture()
            try:
                fn()
            finally:
                graph = stream.end_capture()
        return graph

    def replay(self, graph, stream) -> None:
        graph.launch(stream=stream)

    def new_stream(self, non_blocking: bool = True):
        return self.cp.cuda.Stream(non_blocking=non_blocking)

    def new_event(self, timing: bool = True):
        return self.cp.cuda.Event(disable_timing=not timing)

    # -- sharing streams and arrays with the caller ------------------------------------------------
    @property
    def xp(self):
        return self.cp

    def external_stream(self, stream):
        cp = self.cp
        if stream is None or type(stream).__module__.startswith("cupy"):    # a cupy stream already
            return stream
        if hasattr(stream, "__cuda_stream__"):
            ptr = stream.__cuda_stream__()
            ptr = ptr[1] if isinstance(ptr, tuple) else ptr
            if int(ptr) != 0 and hasattr(cp.cuda.Stream, "from_external"):   # CuPy >= 14: keeps it alive
                return cp.cuda.Stream.from_external(stream)
        elif hasattr(stream, "cuda_stream"):                  # torch streams before __cuda_stream__
            ptr = stream.cuda_stream
        elif isinstance(stream, int) and not isinstance(stream, bool):
            ptr = stream
        else:
            check_stream(stream)          # raises for anything that is not a stream
            ptr = stream.ptr              # another library's stream object with a raw handle
        if int(ptr) == 0:                 # the legacy default stream (torch's default stream)
            return cp.cuda.Stream.null
        return cp.cuda.ExternalStream(int(ptr), self.device_id)

    def wait_event(self, stream, event) -> None:
        self._stream(stream).wait_event(event)

    def host_wait(self, event) -> None:
        if event is not None:
            event.synchronize()

    def copy_d2h_on(self, src, nbytes: int, stream) -> np.ndarray:
        """A host copy of `nbytes` at `src`, once the stream's work before it ran (a wait on that stream). Up to
        BOUNCE_BYTES land in a pinned buffer first (a pageable destination costs the driver a staging copy on
        every call: about 10 us of the host path of a propose on an H200 machine)."""
        nbytes = int(nbytes)
        if not nbytes:
            return np.empty(0, np.uint8)
        s = self._stream(stream)
        if nbytes > BOUNCE_BYTES:
            out = np.empty(nbytes, np.uint8)
            self.cp.cuda.runtime.memcpyAsync(out.ctypes.data, int(src), nbytes, D2H, s.ptr)
            s.synchronize()
            return out
        buf = getattr(self._bounce, "buf", None)
        if buf is None:
            buf = self._bounce.buf = self.alloc_pinned(BOUNCE_BYTES)
        self.cp.cuda.runtime.memcpyAsync(buf.ctypes.data, int(src), nbytes, D2H, s.ptr)
        s.synchronize()
        return buf[:nbytes].copy()

    def export(self, src, dtype, shape, stream=None):
        s = self._stream(stream)
        with s:   # cupy's pool hands the block out again only in stream order
            arr = self.cp.empty(shape, dtype=_dtype(dtype))
        if arr.nbytes:
            self.cp.cuda.runtime.memcpyAsync(arr.data.ptr, int(src), arr.nbytes, D2D, s.ptr)
        return arr

    def from_dlpack(self, obj, stream=None):
        bf16 = is_torch_bf16(obj)
        if bf16 and self.cupy_major < 14:      # CuPy 13 has no bf16 dtype (its bf16 import crashed): raw words
            obj = obj.view(sys.modules["torch"].int16)
        with self._stream(stream):             # the producer makes this stream wait on its current one
            arr = self.cp.from_dlpack(obj)
        return arr, "bfloat16" if bf16 or arr.dtype == BF16 else arr.dtype.name

    def bf16_rows(self, arr, kind: str, stream=None):
        """A C-contiguous uint16 array of bf16 words holding `arr` (bfloat16 words as they are, float32 / float16
        rounded to nearest even), computed on `stream`; `arr` itself when it already is that."""
        cp = self.cp
        with self._stream(stream):
            if kind == "bfloat16":
                w = arr.view(cp.uint16)
                return w if w.flags.c_contiguous else cp.ascontiguousarray(w)
            if self._narrow is None:
                self._narrow = cp.ElementwiseKernel("float32 x", "uint16 y", _F32_TO_BF16, "mtp_f32_to_bf16")
            return self._narrow(arr.astype(cp.float32, copy=False))

    def to_host(self, arr, stream=None) -> np.ndarray:
        s = self._stream(stream)
        out = arr.get(stream=s)
        s.synchronize()
        return out

    def record(self, event, stream=None) -> None:
        event.record(self._stream(stream))

    def elapsed_ms(self, start, end) -> float:
        end.synchronize()
        return float(self.cp.cuda.get_elapsed_time(start, end))
