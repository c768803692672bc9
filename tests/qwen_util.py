"""Helpers for the Qwen3-Next MTP tests: tiny checkpoints, the reference's weights read from the checkpoint
file by the references' own reader (quantised by the reference's own recipes where the proposer quantises at
load), the weights a proposer holds on its device (for device-to-device checks only), and the chain check."""
from __future__ import annotations

import numpy as np

import helpers
from mtp_cupy.runtime.dtypes import BF16, FP8
from mtp_cupy.weights import quant_host as qh
from mtp_cupy.weights import qwen3_next as keys
from mtp_cupy.weights.linear import Linear
from reference.checkpoint import RawCheckpoint, quant_fp8_rows, quant_nvfp4

ROUTE_TIE = 3e-2     # router logit gap (a log-probability ratio) at the top-k boundary where either side is legitimate
ARGMAX_TIE = 0.05    # top-2 logit gap (in logit std) below which a different draft is legitimate
NOT_QUANTISED = ("mtp.layers.0.mlp.gate.weight", "mtp.layers.0.mlp.shared_expert_gate.weight")


def run_quant(prop) -> str:
    """The quantization a proposer runs at, as ref_weights takes it ("stored" when each tensor is as stored)."""
    return "stored" if prop.quantization is None else prop.quantization.value


def ref_weights(path, quantization: str = "bf16") -> dict[str, np.ndarray]:
    """The weights a Qwen3-Next proposer running at `quantization` (its effective one) computes with, float64
    under the checkpoint's keys, from the file: stored FP8 / NVFP4 tensors as stored; at fp8 / nvfp4 every
    BF16 projection of the MTP layer but the router and the shared-expert gate quantised at load (per-row
    FP8 / ModelOpt NVFP4, the reference's own recipes), and at nvfp4 a BF16 LM head too (the NVFP4 head
    scores with an NVFP4 copy: models/qwen3_next.py)."""
    ck = RawCheckpoint(path)
    w = ck.weights()
    if quantization not in ("fp8", "nvfp4"):
        return w
    q = quant_fp8_rows if quantization == "fp8" else quant_nvfp4
    stored_float = lambda k: ck.dtype(k) in ("BF16", "F16", "F32")          # noqa: E731
    for k in w:
        if k.startswith("mtp.") and w[k].ndim == 2 and k not in NOT_QUANTISED and stored_float(k):
            w[k] = q(w[k])
    if quantization == "nvfp4" and stored_float("lm_head.weight"):
        w["lm_head.weight"] = quant_nvfp4(w["lm_head.weight"])
    return w


def device_linear(gpu, W: Linear) -> np.ndarray:
    """A device Linear dequantised on the host, float64 [n, k]."""
    n, k = W.n, W.k
    if W.fmt == "bf16":
        return gpu.read(W.weight, BF16, (n, k)).astype(np.float64)
    if W.fmt == "fp8_row":
        return qh.dequant_fp8_row(gpu.read(W.weight, FP8, (n, k)), gpu.read(W.scale, np.float32, n)).astype(np.float64)
    if W.fmt == "fp8_block":
        s = gpu.read(W.scale, np.float32, (-(-n // 128), -(-k // 128)))
        return qh.dequant_fp8_block(gpu.read(W.weight, FP8, (n, k)), s).astype(np.float64)
    if W.fmt == "nvfp4":
        return qh.dequant_nvfp4(gpu.read(W.weight, np.uint8, (n, k // 2)), gpu.read(W.scale, FP8, (n, k // 16)),
                                W.scale2).astype(np.float64)
    raise AssertionError(f"unexpected format {W.fmt}")


def head_weights(prop) -> dict[str, np.ndarray]:
    """Every tensor the proposer holds on its device, float64, under the checkpoint's keys: for comparing two
    devices' weights, never as a reference's weights (a loader bug would be copied into it)."""
    g, w, cfg = prop.gpu, prop.w, prop.cfg
    D = cfg.hidden_size
    out = {keys.EMBED: g.read(w.embed, BF16, (cfg.vocab_size, D)).astype(np.float64),
           keys.LM_HEAD: device_linear(g, w.lm_head)}
    for role, key in keys.NORMS.items():
        n = cfg.head_dim if role in ("q_norm", "k_norm") else D
        out[key] = g.read(w.norms[role], BF16, n).astype(np.float64)
    modules = {**keys.ATTN_LINEARS, **keys.DENSE_FFN}
    for role, lin in w.linears.items():
        out[modules[role] + ".weight"] = device_linear(g, lin)
    if not w.dense_ffn:
        out[keys.ROUTER + ".weight"] = device_linear(g, w.router)
        out[keys.SHARED_GATE + ".weight"] = device_linear(g, w.shared_gate)
        groups = [(keys.expert(e), w.experts[e]) for e in w.experts] + [(keys.SHARED_EXPERT, w.shared)]
        for prefixes, lins in groups:
            for p, lin in zip(prefixes, lins):
                out[p + ".weight"] = device_linear(g, lin)
    return out


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


_CKPTS: dict = {}


def tiny_ckpt(quant: str = "bf16", dense_ffn: bool = False, seed: int = 0, **dims):
    """A tiny checkpoint written once per process (tests only read it)."""
    import tempfile

    from mtp_cupy.testing.tiny.qwen3_next import write_tiny_checkpoint
    key = (quant, dense_ffn, seed, tuple(sorted(dims.items())))
    if key not in _CKPTS:
        _CKPTS[key] = write_tiny_checkpoint(tempfile.mkdtemp(prefix=f"qwen_{quant}_"), seed, quant, dense_ffn, **dims)
    return _CKPTS[key]


def snapshot(prop, st) -> tuple:
    """Everything a failed call must leave as it was."""
    return (st.blocks.rows, list(st.keys), list(st.blocks.table), st.last_num_drafted, st.last_pair_key,
            list(st.last_drafts), prop.kv.free_count)


def check_chain(res, ref, token: int, hidden, position: int, tol0: float, tol: float, label: str = "") -> list[int]:
    """helpers.check_chain with Qwen's near-tie bounds (every draft compared, either side of a routing tie)."""
    return helpers.check_chain(res, ref, token, hidden, position, tol0, tol, label, ROUTE_TIE, ARGMAX_TIE)


def devices_agree(want, got, label: str, tol: float = 1e-2) -> None:
    """Two devices' chains from the same weights and inputs (CUDA vs twin, batched vs one at a time): logits
    within tol while the drafts so far agree, the same draft where the top-2 gap is clear; from the first
    differing draft the two chains run on different inputs. Compares at least draft 0."""
    for i in range(len(want.tokens)):
        if got.tokens[:i] != want.tokens[:i]:
            break
        e = rel(got.logits[i], want.logits[i])
        assert e <= tol, f"{label}: draft {i} logits rel err {e:.3e}"
        if helpers.clear_argmax(want.logits[i], ARGMAX_TIE):
            assert got.tokens[i] == want.tokens[i], f"{label}: draft {i} argmax"
