"""Device model. Importing this does not import cupy: CUDA is found lazily by `device()`."""
from __future__ import annotations

import logging

from ..errors import ConfigError
from .backend import Backend, DeviceBuffer, KernelHandle, KernelLaunch, cuda_kernel_names, cuda_modules
from .ptr import NULL, DevicePtr

log = logging.getLogger("mtp_cupy")


def device(kind: str = "auto", device_id: int = 0, *, pdl: bool = True) -> Backend:
    """The device proposers and target runners run on.

    Parameters
    ----------
    kind : {"auto", "cuda", "ref"}
        "cuda": the GPU through CuPy (needs .[cuda12] or .[cuda13]); "ref": the NumPy reference device, which
        runs every kernel's Python twin on the CPU (exact, slow); "auto": CUDA when a device is present, else
        "ref" (with a warning on the "mtp_cupy" logger).
    device_id : int
        The GPU to use with "cuda" / "auto" (under mpirun: the rank); ignored by "ref".
    pdl : bool, default True
        CUDA: launch kernels with programmatic dependent launch, so that each kernel's launch overlaps the end of
        the one before it (eager and in graphs; compute capability 9.0 and newer); False launches them plainly.
        Ignored by "ref".

    Returns
    -------
    Backend
        `CupyBackend` or `RefBackend`; pass it as `gpu` to `load_proposer` and the target runners.

    Raises
    ------
    ConfigError
        An unknown `kind`, or "cuda" asked for where no CUDA device (or no cupy) is available."""
    from .cupy_backend import CupyBackend, cuda_available
    if kind not in ("auto", "cuda", "ref"):
        raise ConfigError(f"unknown device {kind!r}; choose auto, cuda or ref")
    if kind == "ref":
        from ..refdev import RefBackend
        return RefBackend()
    if cuda_available():
        return CupyBackend(device_id, pdl=pdl)
    if kind == "cuda":
        raise ConfigError("device 'cuda' asked for, but no CUDA device is available (is cupy installed?)")
    from ..refdev import RefBackend
    log.warning("mtp_cupy: no CUDA device found; running on the NumPy reference device (slow, exact)")
    return RefBackend()


def as_device(gpu) -> Backend:
    """A Backend from a Backend, a device name ("auto", "cuda", "ref") or None (= "auto"); ConfigError for
    anything else."""
    if gpu is None or isinstance(gpu, str):
        return device(gpu or "auto")
    if not isinstance(gpu, Backend):
        raise ConfigError(f"gpu must be a Backend (mtp_cupy.device(...)) or a device name, not {type(gpu).__name__}")
    return gpu


__all__ = ["as_device", "Backend", "DeviceBuffer", "KernelHandle", "KernelLaunch", "DevicePtr", "NULL", "device",
           "cuda_kernel_names", "cuda_modules"]
