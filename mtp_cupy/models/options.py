"""What every family's from_checkpoint checks before reading a weight."""
from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError
from ..weights.config import load_config


def checked_config(path, comm, options: dict, known, family: str, cfg_type, single_gpu: str | None = None):
    """The checkpoint's typed config, after refusing unknown options, a config of another family, and (when
    `single_gpu` names the module) a communicator of several ranks."""
    bad = sorted(set(options) - set(known))
    if bad:
        raise ConfigError(f"unknown option(s) {bad} for {family}; known: {', '.join(known)}")
    if single_gpu and comm is not None and getattr(comm, "world", 1) != 1:
        raise ConfigError(f"the {single_gpu} runs on one GPU; it is not sharded over ranks")
    cfg = load_config(Path(path))
    if not isinstance(cfg, cfg_type):
        raise ConfigError(f"{path} is a {cfg.family} checkpoint, not {family}")
    return cfg
