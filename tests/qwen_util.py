"""Helpers for the Qwen3-Next MTP tests: tiny checkpoints, the weights a proposer really runs (read back from
the device and dequantised, so NVFP4/FP8 are compared on their own dequantised values), and a reference
that mirrors a proposer state's rows."""
from __future__ import annotations

import numpy as np

from mtp_cupy.runtime.dtypes import BF16, FP8
from mtp_cupy.weights import quant_host as qh
from mtp_cupy.weights import qwen3_next as keys
from mtp_cupy.weights.linear import Linear


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
    """Every tensor the proposer runs with, float64, under the checkpoint's keys."""
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


def clear_argmax(ref_logits: np.ndarray, margin: float = 0.05) -> bool:
    """True when the reference's top-2 gap is large enough that rounding cannot swap them."""
    top = np.sort(ref_logits)[-2:]
    return bool(top[1] - top[0] > margin * max(ref_logits.std(), 1e-9))


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


def reference_chain(ref, token: int, hidden, position: int, drafts) -> list[tuple[np.ndarray, list[float]]]:
    """The reference's draft chain along the proposer's own drafts: per step (logits, router gaps)."""
    out, t, h = [], token, hidden
    for i, d in enumerate(drafts):
        n = len(ref.route_gaps)
        logits, h = ref.step(t, h, position + i)
        out.append((logits, ref.route_gaps[n:]))
        t = d
    return out


def assert_chain_close(steps, res, label: str, tol: float = 1e-2, route_tie: float = 1e-2) -> None:
    """Logits rel. err <= tol per draft and the same argmax where the reference's top-2 margin is clear, up to
    the first draft whose routing was a near tie (a different expert is then a legitimate pick) or whose
    token differs (when `steps` come from an independent run rather than along the proposer's drafts)."""
    for i, (lr, gaps) in enumerate(steps):
        e = rel(res.logits[i], lr)
        assert e <= tol, f"{label}: draft {i} logits rel err {e:.3e}"
        if clear_argmax(lr):
            assert res.tokens[i] == int(np.argmax(lr)), f"{label}: draft {i} argmax"
        if (gaps and min(gaps) < route_tie) or res.tokens[i] != int(np.argmax(lr)):
            break   # past here the two chains may legitimately follow different inputs
