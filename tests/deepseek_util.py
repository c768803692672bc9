"""Helpers for the DeepSeek-V3 MTP tests: tiny checkpoints written once per process, the reference's weights
read straight from the checkpoint file by the references' own reader (tests/reference/checkpoint.py: never
mtp_cupy's reader or dequantisers, never the device), and the chain check."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np

import helpers
from helpers import write_rows
from mtp_cupy.runtime.dtypes import bf16_round
from reference.checkpoint import read_weights

ROUTE_TIE = 2e-2     # decision gap (router score; index score / its spread) where the other side is legitimate
ARGMAX_TIE = 0.1     # top-2 logit gap (in logit std) below which a different draft is legitimate

_CKPTS: dict = {}
D, V = 256, 512      # the tiny checkpoints' hidden size and vocabulary (V3 and GLM alike)


def cached_ckpt(writer, prefix: str, fmt: str, seed: int, **kw) -> Path:
    """A tiny checkpoint written once per process by `writer(path, seed, fmt, **kw)`."""
    key = (prefix, fmt, seed, tuple(sorted(kw.items())))
    if key not in _CKPTS:
        _CKPTS[key] = writer(tempfile.mkdtemp(prefix=f"{prefix}_{fmt}_"), seed, fmt, **kw)
    return _CKPTS[key]


def tiny_ckpt(fmt: str = "fp8", seed: int = 0, **kw) -> Path:
    from mtp_cupy.testing.tiny.deepseek_v3 import write_tiny_checkpoint
    return cached_ckpt(write_tiny_checkpoint, "dsv3", fmt, seed, **kw)


def inputs(rng, n: int):
    """(n + 1 prompt tokens, n bf16-exact hiddens, the next token, its hidden)."""
    return (rng.integers(0, V, n + 1), bf16_round(rng.standard_normal((n, D))), int(rng.integers(V)),
            bf16_round(rng.standard_normal(D)))


def snapshot(prop, st) -> tuple:
    """Everything a failed call must leave as it was."""
    return (st.blocks.rows, list(st.keys), list(st.blocks.table), st.last_num_drafted, st.last_pair_key,
            list(st.last_drafts), prop.kv.free_count)


def config_of(path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


def ref_weights(path) -> dict[str, np.ndarray]:
    """Every tensor under its checkpoint key as float64 (projections dequantised by the references' reader);
    the embedding / head under the top-level names even when only the MTP layer's copies exist."""
    w, cfg = read_weights(path)
    p = f"model.layers.{cfg['num_hidden_layers']}."
    w.setdefault("model.embed_tokens.weight", w.get(p + "embed_tokens.weight"))
    w.setdefault("lm_head.weight", w.get(p + "shared_head.head.weight"))
    return w


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def check_chain(res, ref, token: int, hidden, position: int, tol0: float, tol: float, label: str = "") -> list[int]:
    """helpers.check_chain with this family's near-tie bounds: every draft compared against the reference's
    outcomes (the exact one or the other side of a routing / index near tie); returns the outcome matched."""
    return helpers.check_chain(res, ref, token, hidden, position, tol0, tol, label, ROUTE_TIE, ARGMAX_TIE)


def masked_drafts_obey(prop, rng, n: int):
    """Prefill n rows, propose 2 drafts under a grammar bitmask of 20 random ids: the first is the best allowed
    logit and both are allowed. Returns (state, token, hidden) for more proposes after after_verify(0)."""
    toks, hs, tok, h = inputs(rng, n)
    st = prop.alloc_state()
    prop.prefill(st, toks, hs)
    allowed = np.sort(rng.choice(V, 20, replace=False))
    mask = np.zeros(V // 32, np.int32)
    for t in allowed:
        mask[t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
    res = prop.propose(st, tok, h, n, 2, grammar_bitmask=mask, return_logits=True)
    assert res.tokens[0] == int(allowed[np.argmax(res.logits[0, allowed])]) and set(res.tokens) <= set(allowed)
    prop.after_verify(st, 0)
    return st, tok, h


def references_agree(ref, hf, rng, n: int, tie: float, check=None, steps: int = 3) -> None:
    """The float64 reference against transformers' layer (hf) along the reference's greedy chain after n
    prefilled rows: logits and carried hidden within 1e-5 of the reference's exact outcome, or, at a decision
    closer than `tie` (where transformers' float32 router may choose otherwise), of its other-side outcome;
    the chain goes on from the outcome matched. check(ref) adds per-step assertions."""
    toks, hs, tok, h = inputs(rng, n)
    write_rows((ref, hf), toks, hs, n)
    for i in range(steps):
        outs, (lt, gt) = ref.candidates(tok, h, n + i, tie), hf.step(tok, h, n + i)
        if check is not None:
            check(ref)
        errs = [max(rel(lr, lt), rel(gr, gt)) for lr, gr in outs]
        j = int(np.argmin(errs))
        assert errs[j] < 1e-5, f"step {i}: reference vs transformers {errs}"
        tok, h = int(np.argmax(outs[j][0])), outs[j][1]


def cuda_matches_ref_device(load, path, rng, n: int, k: int, make_ref, tol: float) -> None:
    """The same prefill + propose(k) on the NumPy device and on CUDA. Each chain is checked against the float64
    reference (`make_ref()`, rows written here) by check_chain: draft 0 within 1e-2, chained drafts within `tol`
    (the module's chain tolerance: the bf16 carried hidden compounds), argmax where clear, either side of a
    near tie. CUDA against its NumPy twin: the same bounds while both drafted the same ids and matched the same
    outcomes (past a near tie the two devices may legitimately have taken different sides)."""
    import mtp_cupy
    toks, hs, tok, h = inputs(rng, n)
    out = []
    for gpu in (mtp_cupy.device("ref"), mtp_cupy.device("cuda")):
        prop = load(path, gpu)
        st = prop.alloc_state()
        prop.prefill(st, toks, hs)
        out.append(prop.propose(st, tok, h, n, k, return_logits=True))
    twin, cu = out
    refs = [make_ref(), make_ref()]
    write_rows(refs, toks, hs, n)
    picks_cu = check_chain(cu, refs[0], tok, h, n, 1e-2, tol, "cuda vs float64")
    picks_twin = check_chain(twin, refs[1], tok, h, n, 1e-2, tol, "twin vs float64")
    for i in range(k):
        if cu.tokens[:i] != twin.tokens[:i] or picks_cu[:i + 1] != picks_twin[:i + 1]:
            break
        assert rel(cu.logits[i], twin.logits[i]) <= (1e-2 if i == 0 else tol), f"cuda vs twin, draft {i}"
        if helpers.clear_argmax(twin.logits[i], ARGMAX_TIE):
            assert cu.tokens[i] == twin.tokens[i], f"cuda vs twin, draft {i}"


def matches_oracle(prop, ref, hf, rng, n: int, k: int, tol0: float, tol: float, label: str) -> None:
    """helpers.matches_oracle on fresh inputs with this family's near-tie bounds."""
    helpers.matches_oracle(prop, ref, hf, inputs(rng, n), k, tol0, tol, label, ROUTE_TIE, ARGMAX_TIE)
