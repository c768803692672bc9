"""mtp_cupy: MTP speculative-decoding draft heads on raw CUDA kernels (CuPy), with a NumPy device twin.

Importing this package does not import cupy; `device()` finds CUDA lazily."""
from .errors import CapacityError, CommError, ConfigError, InputError, KernelError, MtpError, WeightError
from .models import load_proposer
from .speculative.generate import generate, generate_target_only
from .runtime import device

__version__ = "0.1.0"

from pathlib import Path as _Path

# the embedded default: a small DeepSeek-V3-layout model with its MTP layer, trained on Python's stdlib
# source (byte-level vocabulary; scripts/train_tiny.py)
DEFAULT_CHECKPOINT = str(_Path(__file__).parent / "data" / "tiny_v3")

__all__ = ["device", "load_proposer", "generate", "generate_target_only", "DEFAULT_CHECKPOINT", "MtpError", "ConfigError", "WeightError", "InputError", "CapacityError", "KernelError",
           "CommError"]
