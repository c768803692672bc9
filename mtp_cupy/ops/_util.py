"""Helpers shared by the launchers."""
import weakref

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


_ws: "weakref.WeakKeyDictionary[object, dict[tuple, object]]" = weakref.WeakKeyDictionary()


def kept_workspace(gpu: Backend, owner: str, nbytes: int):
    """A device buffer of at least nbytes that `owner`'s launcher keeps for calls given no workspace (sizes round
    up to powers of two from 1 MiB; one buffer per owner and size, reused: graph-safe after a warm-up call)."""
    size = 1 << max(20, (int(nbytes) - 1).bit_length())
    per = _ws.setdefault(gpu, {})
    if (owner, size) not in per:
        per[owner, size] = gpu.alloc(size)
    return per[owner, size].ptr
