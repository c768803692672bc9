"""The family registry: the one list of supported model families that `load_proposer`, `load_config`, the CLI,
`info`, the benchmarks and the tests iterate. A model type listed here is supported everywhere; one that is
not is supported nowhere.

Each `Family` names its config class (whose `model_types` are the config.json spellings it reads), its
proposer class (which owns the options dataclass `Options` and the weight loader `load_weights`) and its
tiny-checkpoint writer. Proposers and writers are imported on first use, so `import mtp_cupy` stays light."""
from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError
from .weights.config import DeepseekV3Config, DeepseekV4Config, GlmMoeDsaConfig, ModelConfig, Qwen3NextConfig


def _load(spec: str):
    module, _, name = spec.partition(":")
    obj = importlib.import_module(module)
    return getattr(obj, name) if name else obj


@dataclass(frozen=True)
class Family:
    name: str                      # CLI and registry name
    title: str                     # what users call it
    config: type[ModelConfig]      # its config class; config.model_types are the model types it reads
    proposer_path: str             # "module:Class" of the proposer
    tiny_path: str                 # module with write_tiny_checkpoint(path, seed=0, **kw)
    shardable: bool = False        # runs over several ranks (a communicator of world > 1)

    @property
    def model_types(self) -> tuple[str, ...]:
        return self.config.model_types

    @property
    def proposer(self):
        return _load(self.proposer_path)

    @property
    def options(self):
        """The family's options dataclass."""
        return self.proposer.Options

    @property
    def loader(self):
        """load(gpu, path, cfg, progress=None, ...) -> the family's device weights."""
        return self.proposer.load_weights

    def write_tiny_checkpoint(self, path, seed: int = 0, **kw) -> Path:
        """A small random checkpoint of this family in its real key layout (tests, demo, benchmarks)."""
        return _load(self.tiny_path).write_tiny_checkpoint(path, seed=seed, **kw)


FAMILIES: tuple[Family, ...] = (
    Family("deepseek_v4", "DeepSeek-V4", DeepseekV4Config, "mtp_cupy.models.deepseek_v4:DeepseekV4MtpProposer",
           "mtp_cupy.testing.tiny.deepseek_v4"),
    Family("deepseek_v3", "DeepSeek-V3/R1/V3.2", DeepseekV3Config,
           "mtp_cupy.models.deepseek_v3:DeepseekV3MtpProposer", "mtp_cupy.testing.tiny.deepseek_v3"),
    Family("qwen3_next", "Qwen3-Next MTP head", Qwen3NextConfig, "mtp_cupy.models.qwen3_next:Qwen3NextMtpProposer",
           "mtp_cupy.testing.tiny.qwen3_next"),
    Family("glm5", "GLM-5", GlmMoeDsaConfig, "mtp_cupy.models.glm5:Glm5MtpProposer", "mtp_cupy.testing.tiny.glm5",
           shardable=True),
)
NAMES: tuple[str, ...] = tuple(f.name for f in FAMILIES)
MODEL_TYPES: dict[str, Family] = {mt: f for f in FAMILIES for mt in f.model_types}


def family(name: str) -> Family:
    """The family called `name` (ConfigError listing the known ones otherwise)."""
    for f in FAMILIES:
        if f.name == name:
            return f
    raise ConfigError(f"unknown family {name!r}; choose one of {', '.join(NAMES)}")


def by_model_type(model_type, where: str = "config") -> Family:
    f = MODEL_TYPES.get(model_type)
    if f is None:
        raise ConfigError(f"{where}: unsupported model_type {model_type!r}; supported: "
                          f"{', '.join(sorted(MODEL_TYPES))}")
    return f


def of_checkpoint(path) -> Family:
    """The family of the checkpoint directory at `path`, from its config.json's model_type."""
    p = Path(path)
    if p.is_file():
        raise ConfigError(f"{p} is a file; expected a checkpoint directory (config.json + *.safetensors)")
    cfg = p / "config.json"
    if not cfg.is_file():
        raise ConfigError(f"{p} has no config.json" if p.is_dir() else f"checkpoint directory {p} does not exist")
    try:
        d = json.loads(cfg.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read {cfg}: {e}") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{cfg} is not a JSON object")
    return by_model_type(d.get("model_type"), str(cfg))
