"""Helpers for the GLM-5 MTP tests (single process and mpirun): tiny checkpoints written once per process and
the inputs of a prefill + propose cycle."""
from __future__ import annotations

import tempfile
from pathlib import Path

from mtp_cupy.runtime.dtypes import bf16_round

D, V = 256, 512
_CKPTS: dict = {}


def glm_ckpt(fmt: str = "bf16", seed: int = 0, **kw) -> Path:
    from mtp_cupy.weights.glm import write_tiny_checkpoint
    key = (fmt, seed, tuple(sorted(kw.items())))
    if key not in _CKPTS:
        _CKPTS[key] = write_tiny_checkpoint(tempfile.mkdtemp(prefix=f"glm_{fmt}_"), seed, fmt, **kw)
    return _CKPTS[key]


def inputs(rng, n: int):
    """(n + 1 prompt tokens, n bf16-exact hiddens, the next token, its hidden)."""
    return (rng.integers(0, V, n + 1), bf16_round(rng.standard_normal((n, D))), int(rng.integers(V)),
            bf16_round(rng.standard_normal(D)))
