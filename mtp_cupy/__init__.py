"""mtp_cupy: MTP speculative-decoding draft heads on raw CUDA kernels (CuPy), with a NumPy device twin.

Importing this package does not import cupy; `device()` finds CUDA lazily."""
from .errors import CapacityError, CommError, ConfigError, InputError, KernelError, MtpError, WeightError
from .models import load_proposer
from .runtime import device

__version__ = "0.1.0"

__all__ = ["device", "load_proposer", "MtpError", "ConfigError", "WeightError", "InputError", "CapacityError", "KernelError",
           "CommError"]
