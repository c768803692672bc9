"""Training the embedded tiny models (scripts/train_tiny.py): per family, transformers' own model class as the
target and the family's MTP module around a decoder layer of that class, trained jointly on the Python
standard library's source (byte vocabulary), exported in the family's checkpoint layout. Needs torch and
transformers."""
from __future__ import annotations

import importlib

FAMILIES = ("deepseek_v3", "deepseek_v4", "qwen3_next", "glm5")


def family_module(name: str):
    """The training module of a family (CONFIG, build(device), export(target, head, out))."""
    from ..errors import ConfigError
    if name not in FAMILIES:
        raise ConfigError(f"unknown family {name!r}; choose one of {', '.join(FAMILIES)}")
    return importlib.import_module(f".{name}", __name__)
