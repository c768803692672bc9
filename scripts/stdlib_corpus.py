"""The text the embedded model was trained on: the Python standard library's .py files (tests and
site-packages excluded), with about 5% of files, chosen by a hash of their name, held out."""
from __future__ import annotations

import sysconfig
import zlib
from pathlib import Path


def stdlib_files(held_out: bool, fold: int = 0) -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for p in sorted(root.rglob("*.py")):
        if "test" in p.parts or "site-packages" in p.parts:
            continue
        if (zlib.crc32(p.name.encode()) % 20 == fold) == held_out:
            out.append(p)
    return out
