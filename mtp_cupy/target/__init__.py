"""Target-model runners built from the same kernels as the drafters (for end-to-end speculative decoding)."""
from .deepseek_v3 import DeepseekV3Target

__all__ = ["DeepseekV3Target"]
