"""`python -m mtp_cupy info <ckpt>`: what a checkpoint's MTP head is, in which formats, how many bytes one
batch-1 draft step must read, all computed from the checkpoint's own headers (no tensor data read), and what
its proposer runs by default (attention and DSA on/off, KV cache dtype and layout, the carried-hidden rule,
the options that change them: the family's `properties(cfg)`)."""
from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any

from ..errors import ConfigError, WeightError
from .config import ModelConfig, load_config
from .loader import detect_linear
from .safetensors_io import Checkpoint

_EXPERT = re.compile(r"\.experts\.(\d+)\.")
# copies of the shared embedding / head that some checkpoints keep inside the MTP layer (DeepSeek-V3 layer 61)
_SHARED_COPIES = ("embed_tokens.", "shared_head.head.")


def _first(ckpt: Checkpoint, keys: tuple[str, ...]) -> str | None:
    return next((k for k in keys if ckpt.has(k)), None)


def _experts(cfg: ModelConfig) -> tuple[int, int]:
    """(routed experts, experts per token) of the MTP layer; (0, 0) for a dense-FFN head."""
    n = getattr(cfg, "n_routed_experts", getattr(cfg, "num_experts", 0))
    return int(n), int(getattr(cfg, "num_experts_per_tok", 0)) if n else 0


def checkpoint_dir(path: str | Path) -> Path:
    """`path` as the directory of a checkpoint of a supported family.

    Raises
    ------
    ConfigError
        A file where the directory is expected (naming its folder when that is a checkpoint), a directory
        that does not exist or has no config.json, an unsupported model_type."""
    from ..families import of_checkpoint
    p = Path(path)
    if p.is_file() and (p.parent / "config.json").is_file():
        raise ConfigError(f"{p} is a file; expected a checkpoint directory (config.json + *.safetensors), "
                          f"such as its folder {p.parent}")
    of_checkpoint(p)
    return p


def describe(path: str | Path) -> dict[str, Any]:
    """What the checkpoint directory at `path` holds (see the module docstring); ConfigError for a path that is
    not a checkpoint directory, WeightError for missing MTP tensors."""
    path = checkpoint_dir(path)
    cfg = load_config(path)
    ckpt = Checkpoint(path)
    prefix = cfg.mtp_prefix
    keys = [k for k in ckpt.keys() if k.startswith(prefix)]
    if not keys:
        raise WeightError(f"no MTP tensors under {prefix!r} (num_mtp_layers = {cfg.num_mtp_layers})",
                          file=str(path))
    own = (prefix + "embed_tokens.weight",), (prefix + "shared_head.head.weight",)
    if cfg.model_type == "deepseek_v32":     # its MTP layer's own copies load first (weights/deepseek_v3.py)
        embed = _first(ckpt, own[0]) or _first(ckpt, cfg.embed_keys)
        head = _first(ckpt, own[1]) or _first(ckpt, cfg.head_keys)
    else:
        embed = _first(ckpt, cfg.embed_keys) or _first(ckpt, own[0])
        head = _first(ckpt, cfg.head_keys) or _first(ckpt, own[1])
    if head is None and cfg.tie_word_embeddings:
        head = embed

    formats: Counter[str] = Counter()
    for k in keys:
        lin = k.removesuffix(".weight_packed") if k.endswith(".weight_packed") else \
            k.removesuffix(".weight") if k.endswith(".weight") else None
        if lin is None or any(c in k for c in _SHARED_COPIES) or len(ckpt.info(k).shape) != 2:
            continue
        formats[detect_linear(ckpt, lin).fmt] += 1

    expert_bytes: Counter[int] = Counter()
    dense = 0
    for k in keys:
        nb = ckpt.info(k).nbytes
        m = _EXPERT.search(k)
        if m:
            expert_bytes[int(m.group(1))] += nb
        elif not any(c in k for c in _SHARED_COPIES):
            dense += nb
    n_exp, top_k = _experts(cfg)
    per_expert = sum(expert_bytes.values()) / len(expert_bytes) if expert_bytes else 0.0
    embed_row = 0
    if embed is not None:
        e = ckpt.info(embed)
        embed_row = e.nbytes // max(e.shape[0], 1)
    head_bytes = ckpt.info(head).nbytes if head is not None else 0
    step = {"embedding_row": embed_row, "mtp_layer_without_experts": dense,
            "routed_experts": round(top_k * per_expert), "lm_head": head_bytes}
    from ..families import by_model_type
    run = by_model_type(cfg.model_type).proposer.properties(cfg)   # what the proposer runs by default
    return {
        "path": str(path), "family": cfg.family, "model_type": cfg.model_type, "runs": run,
        "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": getattr(cfg, "num_key_value_heads", None),
        "routed_experts": n_exp, "experts_per_token": top_k, "experts_found": len(expert_bytes),
        "num_mtp_layers": cfg.num_mtp_layers, "mtp_prefix": prefix,
        "quant_algo": cfg.quant.algo if cfg.quant else None,
        "embed_key": embed, "head_key": head,
        "formats": dict(sorted(formats.items())), "mtp_tensors": len(keys),
        "mtp_bytes": sum(ckpt.info(k).nbytes for k in keys),
        "bytes_per_draft_step": sum(step.values()), "step_breakdown": step,
    }


def _size(n: float) -> str:
    if n < 1000:
        return f"{n:.0f} B"
    for unit in ("KB", "MB"):
        n /= 1000
        if n < 1000:
            return f"{n:.2f} {unit}"
    return f"{n / 1000:.2f} GB"


def format_info(d: dict[str, Any]) -> str:
    fmts = ", ".join(f"{f} x{c}" for f, c in d["formats"].items()) or "none"
    experts = f"{d['routed_experts']} routed, top-{d['experts_per_token']}" if d["routed_experts"] else "dense FFN"
    lines = [
        f"{d['path']}",
        f"  family        {d['family']} (model_type {d['model_type']}, quantisation {d['quant_algo'] or 'none'})",
        f"  dims          hidden {d['hidden_size']}, vocab {d['vocab_size']}, heads {d['num_attention_heads']}"
        f" (kv {d['num_key_value_heads']}), experts {experts}",
        f"  MTP           {d['num_mtp_layers']} layer(s) at '{d['mtp_prefix']}': {d['mtp_tensors']} tensors, "
        f"{_size(d['mtp_bytes'])}",
        f"  projections   {fmts}",
        f"  embed / head  {d['embed_key']} / {d['head_key']}",
    ]
    run = d.get("runs", {})
    labels = {"attention": "attention", "dsa": "DSA", "kv_cache": "KV cache", "formats": "formats",
              "carried_hidden": "carried", "options": "options"}
    lines += [f"  {labels[k]:<13} {run[k]}" for k in labels if k in run]
    lines += [
        f"  draft step    {_size(d['bytes_per_draft_step'])} of weights read per batch-1 step:",
    ]
    lines += [f"                  {k:<27} {_size(v)}" for k, v in d["step_breakdown"].items()]
    return "\n".join(lines)
