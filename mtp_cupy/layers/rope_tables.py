"""Host-side RoPE frequency tables (docs/model_math.md section 0 and A.4). Computed in float64, rounded once to
the float32 the `rope` kernel reads (DeepSeek's torch code computes them in float32: <= 1 ulp apart)."""
from __future__ import annotations

import math

import numpy as np

from ..errors import ConfigError


def _freq64(rot_dim: int, base: float) -> np.ndarray:
    if rot_dim <= 0 or rot_dim % 2:
        raise ConfigError(f"rot_dim must be positive and even, got {rot_dim}")
    return float(base) ** (-np.arange(0, rot_dim, 2, dtype=np.float64) / rot_dim)


def default_inv_freq(rot_dim: int, base: float) -> np.ndarray:
    """inv_freq[i] = base^(-2i / rot_dim), i < rot_dim / 2."""
    return _freq64(rot_dim, base).astype(np.float32)


def _yarn_corr_dim(n_rot: float, rot_dim: int, base: float, orig_max_pos: int) -> float:
    """The dimension whose wavelength fits `n_rot` turns into the original context."""
    return rot_dim * math.log(orig_max_pos / (n_rot * 2 * math.pi)) / (2 * math.log(base))


def yarn_corr_range(rot_dim: int, base: float, orig_max_pos: int, beta_fast: float,
                    beta_slow: float) -> tuple[int, int]:
    """(low, high): pairs below `low` keep their frequency, pairs above `high` are divided by the factor."""
    low = math.floor(_yarn_corr_dim(beta_fast, rot_dim, base, orig_max_pos))
    high = math.ceil(_yarn_corr_dim(beta_slow, rot_dim, base, orig_max_pos))
    return max(low, 0), min(high, rot_dim - 1)


def yarn_inv_freq(rot_dim: int, base: float, factor: float, orig_max_pos: int, beta_fast: float,
                  beta_slow: float) -> np.ndarray:
    """DeepSeek YaRN: inv = f * (1 - ramp) + (f / factor) * ramp, ramp linear from `low` to `high`."""
    freq = _freq64(rot_dim, base)
    low, high = yarn_corr_range(rot_dim, base, orig_max_pos, beta_fast, beta_slow)
    span = high - low if high != low else 0.001
    ramp = np.clip((np.arange(rot_dim // 2, dtype=np.float64) - low) / span, 0.0, 1.0)
    return (freq * (1 - ramp) + freq / factor * ramp).astype(np.float32)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """0.1 * mscale * ln(factor) + 1 when factor > 1, else 1 (attention-scale / cos-sin magnitude)."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0
