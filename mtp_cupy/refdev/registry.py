"""Registry of kernel twins keyed by (module, name): the executable specification of every CUDA kernel.

A twin has the kernel's argument list: `fn(dev, *args)` where pointers arrive as DevicePtr and scalars as
Python numbers, and it reads/writes the simulated arena through `dev.view(...)`. Twins round to bf16/fp8
wherever the kernel stores bf16/fp8, so GPU-vs-twin differences are accumulation order only."""
from __future__ import annotations

import importlib
import pkgutil

TWINS: dict[tuple[str, str], object] = {}
_loaded = False


def twin(module: str, name: str):
    def deco(fn):
        key = (module, name)
        if key in TWINS:
            raise RuntimeError(f"twin {module}.{name} registered twice")
        TWINS[key] = fn
        return fn
    return deco


def load_all() -> dict[tuple[str, str], object]:
    global _loaded
    if not _loaded:
        from . import twins
        for m in pkgutil.iter_modules(twins.__path__):
            importlib.import_module(f"{twins.__name__}.{m.name}")
        _loaded = True
    return TWINS


def names_in(module: str) -> list[str]:
    return sorted(n for (m, n) in load_all() if m == module)
