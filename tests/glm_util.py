"""Helpers for the GLM-5 MTP tests (single process and mpirun): tiny checkpoints written once per process;
the cycle inputs are deepseek_util's (same tiny hidden size and vocabulary)."""
from __future__ import annotations

from pathlib import Path

from deepseek_util import D, V, cached_ckpt, inputs  # noqa: F401  (re-exported for the GLM tests)


def glm_ckpt(fmt: str = "bf16", seed: int = 0, **kw) -> Path:
    from mtp_cupy.testing.tiny.glm5 import write_tiny_checkpoint
    return cached_ckpt(write_tiny_checkpoint, "glm", fmt, seed, **kw)
