"""The copy-bandwidth probe: the device-to-device copy rate every benchmark's floor and "% of copy" use."""
from __future__ import annotations

import numpy as np

from .device import free_device_memory


def copy_bandwidth(gpu=None, nbytes: int = 1 << 30, reps: int = 10) -> float | None:
    """Device-to-device copy bandwidth in bytes/s, bytes read + written.

    The median of `reps` copies of `nbytes`, each timed alone with CUDA events on a blocking stream of its
    own, after one untimed copy. CuPy is imported here.

    Parameters
    ----------
    gpu : mtp_cupy Backend, optional
        The device; on the NumPy device (``gpu.is_cuda`` false) there is nothing to measure. Without one, the
        current CUDA device.
    nbytes : int, default 1 GiB
        Bytes per copy.
    reps : int, default 10
        Timed copies.

    Returns
    -------
    float or None
        ``2 * nbytes / median seconds``, or None on the NumPy device.
    """
    if gpu is not None and not gpu.is_cuda:
        return None
    import cupy as cp
    a, b = cp.empty(nbytes, cp.uint8), cp.empty(nbytes, cp.uint8)
    a.fill(1)
    s = cp.cuda.Stream(non_blocking=False)
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    ts = []
    for i in range(reps + 1):
        e0.record(s)
        cp.cuda.runtime.memcpyAsync(b.data.ptr, a.data.ptr, nbytes, 3, s.ptr)   # 3: cudaMemcpyDeviceToDevice
        e1.record(s)
        e1.synchronize()
        if i:                                    # the first copy is a warm-up
            ts.append(cp.cuda.get_elapsed_time(e0, e1) / 1e3)
    del a, b
    free_device_memory()
    return 2 * nbytes / float(np.median(ts))
