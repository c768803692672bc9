"""Checkpoint side: safetensors reading/writing, HF config parsing, host quantisers, device loading.

    ckpt = Checkpoint(path); cfg = load_config(path)
    with WeightLoader(gpu, ckpt) as wl:
        W = wl.linear("model.layers.61.self_attn.o_proj", n, k)     # format decided from the checkpoint"""
from .config import (DeepseekV3Config, DeepseekV4Config, GlmMoeDsaConfig, ModelConfig, Qwen3NextConfig, RopeConfig,
                     load_config)
from .info import describe, format_info
from .linear import FORMATS, Linear
from .loader import LinearSource, WeightLoader, dequant_linear, detect_linear
from .quant_config import QuantConfig
from .safetensors_io import Checkpoint, TensorInfo
from .writer import write_checkpoint, write_config, write_safetensors

__all__ = ["Checkpoint", "TensorInfo", "load_config", "ModelConfig", "DeepseekV3Config", "DeepseekV4Config",
           "Qwen3NextConfig", "GlmMoeDsaConfig", "RopeConfig", "QuantConfig", "WeightLoader", "LinearSource",
           "detect_linear", "dequant_linear", "Linear", "FORMATS", "describe", "format_info", "write_safetensors",
           "write_checkpoint", "write_config"]
