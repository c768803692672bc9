"""Device housekeeping the benchmarks share: device names, giving memory back between families, memory in
use, whether torch has CUDA, and capturing a torch chain as a CUDA graph. CuPy and torch are only looked at
when already imported, or imported inside a function."""
from __future__ import annotations

import gc
import sys


def device_name(gpu) -> str:
    """What a report calls the device: the CUDA device's name, or the NumPy device's note.

    Parameters
    ----------
    gpu : mtp_cupy Backend
        The device.
    """
    if not gpu.is_cuda:
        return f"{gpu.name} (NumPy device: wall clock only)"
    import cupy as cp
    name = cp.cuda.runtime.getDeviceProperties(cp.cuda.runtime.getDevice())["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def free_device_memory() -> None:
    """Drop unreferenced device memory of both allocators (CuPy's pools, torch's caching allocator)."""
    gc.collect()
    cp = sys.modules.get("cupy")
    if cp is not None:
        try:
            cp.get_default_memory_pool().free_all_blocks()
            cp.get_default_pinned_memory_pool().free_all_blocks()
        except Exception:
            pass
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
        except Exception:
            pass


def cupy_used_gb() -> float | None:
    """GiB of the current CUDA device in use, or None without CuPy."""
    cp = sys.modules.get("cupy")
    if cp is None:
        return None
    try:
        free, total = cp.cuda.runtime.memGetInfo()
        return (total - free) / 2**30
    except Exception:
        return None


def torch_status() -> tuple[bool, str]:
    """(torch has CUDA, a note saying which torch or why not)."""
    try:
        import torch
    except Exception as e:       # noqa: BLE001
        return False, f"torch not importable ({e})"
    if not torch.cuda.is_available():
        return False, f"torch {torch.__version__} has no CUDA"
    return True, f"torch {torch.__version__} (CUDA {torch.version.cuda})"


def torch_graph(chain, k: int):
    """``chain(k)`` captured as a ``torch.cuda.CUDAGraph``, warmed up on a side stream first as torch asks.

    Parameters
    ----------
    chain : callable
        ``chain(k)`` launches k chained draft steps on torch's current stream.
    k : int
        Steps.
    """
    import torch
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            chain(k)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        chain(k)
    torch.cuda.synchronize()
    return g
