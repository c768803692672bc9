"""mtp_cupy: MTP speculative-decoding draft heads on raw CUDA kernels (CuPy), with a NumPy device twin.

Importing this package imports neither cupy nor mpi4py: `device()` finds CUDA lazily, and MPI (the `.[mpi]`
extra) is needed only to run over several ranks. `mtp_cupy.target` (the target runner) loads on first use."""
from .errors import (CapacityError, CollectiveTimeout, CommError, ConfigError, InputError, KernelError, MtpError,
                     WeightError)
from .models import load_proposer
from .speculative.generate import generate, generate_target_only
from .runtime import device

__version__ = "0.1.0"

from pathlib import Path as _Path

# the embedded default: a small DeepSeek-V3-layout model with its MTP layer, trained on Python's stdlib
# source (byte-level vocabulary; scripts/train_tiny.py)
DEFAULT_CHECKPOINT = str(_Path(__file__).parent / "data" / "tiny_v3")

_LAZY = ("target",)


def __getattr__(name):
    """`mtp_cupy.target` without `import mtp_cupy.target` first."""
    if name in _LAZY:
        import importlib
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'mtp_cupy' has no attribute {name!r}")


__all__ = ["device", "load_proposer", "generate", "generate_target_only", "DEFAULT_CHECKPOINT", "MtpError",
           "ConfigError", "WeightError", "InputError", "CapacityError", "KernelError", "CommError",
           "CollectiveTimeout"]
