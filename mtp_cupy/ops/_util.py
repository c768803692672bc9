"""Helpers shared by the launchers."""
from ..errors import KernelError
from ..runtime.backend import Backend, KernelLaunch

THREADS = 256


def launch(gpu: Backend, module: str, name: str) -> KernelLaunch:
    return KernelLaunch(gpu, gpu.kernel(module, name))


def blocks_for(n: int, threads: int = THREADS, cap: int = 4096) -> int:
    return max(1, min(cap, (int(n) + threads - 1) // threads))


def need(cond: bool, msg: str) -> None:
    if not cond:
        raise KernelError(msg)
