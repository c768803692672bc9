"""Programmatic dependent launch: `cuLaunchKernelEx` with the programmatic-stream-serialization attribute,
called through ctypes on the driver library CuPy already loaded (CuPy 14 launches only through
`cuLaunchKernel`, which has no attributes). The same call launches thread block clusters (the cluster-dimension
attribute), with or without PDL.

With the attribute a kernel's blocks may be scheduled before the kernel ahead of it in the stream has finished;
every kernel in cuda_src starts with `pdl_entry()` (common.cuh), whose `griddepcontrol.wait` holds them until
that kernel's writes are visible. What is saved is the launch latency between the two: under a CUDA graph the
captured edge is programmatic too. Struct layouts are those of cuda.h (CUDA 12 and 13)."""
from __future__ import annotations

import ctypes

from ..errors import KernelError

_CLUSTER_DIMENSION = 4                   # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
_PROGRAMMATIC_STREAM_SERIALIZATION = 6   # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


class _Attr(ctypes.Structure):
    # CUlaunchAttribute: an enum id padded to 8 bytes, then a 64-byte union (the flag; cluster x, y, z)
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_uint * 16)]


class _Config(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_Attr)), ("n_attrs", ctypes.c_uint)]


_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14  # CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED


def allow_large_clusters(function_ptr: int) -> None:
    """Let a CUfunction launch thread block clusters past the portable 8 blocks (up to 16 on H100 / H200)."""
    rc = ctypes.CDLL("libcuda.so.1").cuFuncSetAttribute(ctypes.c_void_p(function_ptr),
                                                        _NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
    if rc:
        raise KernelError(f"cuFuncSetAttribute(non-portable cluster size) returned CUresult {rc}")


_CTYPE = {"ptr": ctypes.c_uint64, "u32": ctypes.c_uint32, "i32": ctypes.c_int32, "u64": ctypes.c_uint64,
          "i64": ctypes.c_int64, "f32": ctypes.c_float}


class PdlLauncher:
    """Launches CUfunctions through cuLaunchKernelEx (one per CupyBackend): with programmatic dependent launch
    when `pdl`, and in clusters when a launch asks for them."""

    def __init__(self, pdl: bool = True) -> None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            self._launch = lib.cuLaunchKernelEx
        except (OSError, AttributeError) as e:
            raise KernelError(f"programmatic dependent launch needs cuLaunchKernelEx in libcuda.so.1: {e}") from None
        self._launch.restype = ctypes.c_int
        self._launch.argtypes = [ctypes.POINTER(_Config), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        self._attrs = (_Attr * 2)()
        self._attrs[0].id, self._attrs[0].value[0] = _PROGRAMMATIC_STREAM_SERIALIZATION, 1
        self._attrs[1].id = _CLUSTER_DIMENSION
        self._pdl = int(bool(pdl))
        self._cfg = _Config(attrs=ctypes.cast(self._attrs, ctypes.POINTER(_Attr)) if pdl else
                            ctypes.cast(ctypes.byref(self._attrs[1]), ctypes.POINTER(_Attr)), n_attrs=self._pdl)

    def launch(self, function_ptr: int, grid, block, shared: int, args, stream_ptr: int,
               cluster=(1, 1, 1)) -> None:
        """Launch `function_ptr` (a CUfunction) on the stream handle `stream_ptr`; `args` are (kind, value)
        pairs as KernelLaunch collects them; `cluster` the cluster dims (each must divide the grid's).
        Raises KernelError with the driver's CUresult on failure."""
        cfg = self._cfg
        c = self._attrs[1].value
        c[0], c[1], c[2] = cluster
        cfg.n_attrs = self._pdl + (tuple(cluster) != (1, 1, 1))
        cfg.grid[0], cfg.grid[1], cfg.grid[2] = grid
        cfg.block[0], cfg.block[1], cfg.block[2] = block
        cfg.shared, cfg.stream = shared, stream_ptr or None
        vals = [_CTYPE[k](float(v) if k == "f32" else int(v)) for k, v in args]
        params = (ctypes.c_void_p * max(len(vals), 1))(*[ctypes.addressof(v) for v in vals])
        rc = self._launch(ctypes.byref(cfg), function_ptr, params, None)
        if rc:
            raise KernelError(f"cuLaunchKernelEx returned CUresult {rc}")
