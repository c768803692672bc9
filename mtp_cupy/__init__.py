"""mtp_cupy: MTP speculative-decoding draft heads on raw CUDA kernels (CuPy), with a NumPy device twin.

Importing this package imports neither cupy nor mpi4py: `device()` finds CUDA lazily, and MPI (the `.[mpi]`
extra) is needed only to run over several ranks. `mtp_cupy.target` (the target runner) loads on first use."""
from .errors import (CapacityError, CollectiveTimeout, CommError, ConfigError, InputError, KernelError, MtpError,
                     WeightError)
from .models import load_proposer
from .speculative.generate import generate, generate_batch, generate_target_only
from .runtime import device

__version__ = "0.1.0"

from pathlib import Path as _Path

# the embedded models: per family a small model with its MTP layer, trained on Python's stdlib source (byte-level
# vocabulary; scripts/train_tiny.py). The DeepSeek-V3 one is the default (mtp_cupy's own target runs it)
EMBEDDED = {fam: str(_Path(__file__).parent / "data" / d) for fam, d in (
    ("deepseek_v3", "tiny_v3"), ("deepseek_v4", "tiny_v4"), ("qwen3_next", "tiny_qwen3_next"), ("glm5", "tiny_glm5"))}
DEFAULT_CHECKPOINT = EMBEDDED["deepseek_v3"]

_LAZY = ("target",)


def __getattr__(name):
    """`mtp_cupy.target` without `import mtp_cupy.target` first."""
    if name in _LAZY:
        import importlib
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'mtp_cupy' has no attribute {name!r}")


__all__ = ["device", "load_proposer", "generate", "generate_batch", "generate_target_only", "DEFAULT_CHECKPOINT",
           "EMBEDDED", "MtpError",
           "ConfigError", "WeightError", "InputError", "CapacityError", "KernelError", "CommError",
           "CollectiveTimeout"]
