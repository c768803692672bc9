"""The text the embedded model was trained on and is measured on: the Python standard library's .py files
(tests and site-packages excluded), about 5% of files, chosen by a hash of their name, held out."""
from __future__ import annotations

import sysconfig
import zlib
from pathlib import Path

import numpy as np


def stdlib_files(held_out: bool, fold: int = 0) -> list[Path]:
    """The stdlib .py files of the training split or of the held-out one.

    Parameters
    ----------
    held_out : bool
        The held-out files (crc32 of the name % 20 == fold) instead of the training ones.
    fold : int, default 0
        Which twentieth is held out.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for p in sorted(root.rglob("*.py")):
        if "test" in p.parts or "site-packages" in p.parts:
            continue
        if (zlib.crc32(p.name.encode()) % 20 == fold) == held_out:
            out.append(p)
    return out


def held_out_prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    """`n` prompts of `length` bytes cut at random from held-out files more than 4 * length long.

    Parameters
    ----------
    n : int
        Prompts.
    length : int
        Bytes (= tokens of the byte-level vocabulary) per prompt.
    seed : int, default 0
        Seed of the file and offset picks.
    """
    rng = np.random.default_rng(seed)
    files = [f.read_bytes() for f in stdlib_files(True)]
    files = [f for f in files if len(f) > 4 * length]
    out = []
    for i in rng.choice(len(files), n, replace=len(files) < n):
        start = int(rng.integers(0, len(files[i]) - length))
        out.append(list(files[i][start:start + length]))
    return out
