"""transformers' DeepseekV3ForCausalLM holding an HF-layout checkpoint's weights (per-expert keys fused back
into the in-memory experts tensors), as an oracle for mtp_cupy.target."""
import json
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import load_file

from .deepseek_torch import fused_experts


def load_hf_model(path):
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = json.loads((Path(path) / "config.json").read_text())
    keys = {k: v for k, v in cfg.items() if k not in ("model_type", "architectures", "tokenizer", "torch_dtype",
                                                       "scoring_func", "topk_method", "rope_theta", "rope_scaling")}
    hf = AutoConfig.for_model("deepseek_v3", rope_parameters={"rope_theta": cfg["rope_theta"], "rope_type": "default"},
                              attn_implementation="eager", **keys)
    model = AutoModelForCausalLM.from_config(hf).to(torch.float32).eval()  # grouped expert matmuls have no f64
    t = {k: torch.from_numpy(np.asarray(v).astype(np.float32)) for k, v in load_file(str(Path(path) / "model.safetensors")).items()}
    sd = model.state_dict()
    n_layers, E = cfg["num_hidden_layers"], cfg["n_routed_experts"]
    for k in list(sd):
        if k.endswith("mlp.experts.gate_up_proj"):      # sets down_proj too
            sd[k], sd[k.replace("gate_up_proj", "down_proj")] = fused_experts(t, k.removesuffix("gate_up_proj"), E)
        elif k.endswith("mlp.experts.down_proj"):
            pass
        elif k in t:
            sd[k] = t[k]
        elif "rotary" not in k:
            raise KeyError(k)
    model.load_state_dict(sd)
    assert len(model.model.layers) == n_layers
    return model
