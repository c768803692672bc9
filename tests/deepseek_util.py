"""Helpers for the DeepSeek-V3 MTP tests: tiny checkpoints written once per process, the reference's weights
read straight from the checkpoint (dequantised on the host, never from the device), and the chain check."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np

from mtp_cupy.runtime.dtypes import bf16_round
from mtp_cupy.weights import Checkpoint, dequant_linear

ROUTE_TIE = 1e-2     # router selection gap below which a different expert choice is legitimate
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
    """Every tensor under its checkpoint key as float32 (projections dequantised); the embedding / head
    under the top-level names even when only the MTP layer's copies exist."""
    ck, cfg = Checkpoint(path), config_of(path)
    w = {k: dequant_linear(ck, k) if len(ck.info(k).shape) == 2 else ck.numpy(k).astype(np.float32)
         for k in ck.keys() if not k.endswith("weight_scale_inv")}
    p = f"model.layers.{cfg['num_hidden_layers']}."
    w.setdefault("model.embed_tokens.weight", w.get(p + "embed_tokens.weight"))
    w.setdefault("lm_head.weight", w.get(p + "shared_head.head.weight"))
    return w


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def clear_argmax(logits: np.ndarray) -> bool:
    top = np.sort(logits)[-2:]
    return bool(top[1] - top[0] > ARGMAX_TIE * logits.std())


def check_chain(res, ref, token: int, hidden, position: int, tol0: float, tol: float, label: str = "") -> int:
    """Replays a propose on `ref` (a DeepseekMtpRef or the transformers oracle) with the device's drafts
    teacher-forced and the carried hidden rounded to bf16 as the device stores it; checks each draft's
    logits and argmax. Returns how many leading rows are uncontaminated: a routing near-tie at draft j
    (a legitimately different expert choice) changes draft j's logits and its carried hidden, so drafts
    from j on are not compared and rows after j differ (row j itself depends only on its inputs)."""
    tok, h = token, bf16_round(hidden).astype(np.float64)
    clean = len(res.tokens)
    for i in range(len(res.tokens)):
        logits, g = ref.step(tok, h, position + i)
        if i < clean and getattr(ref, "last_margin", np.inf) < ROUTE_TIE:
            clean = i + 1           # this draft's own expert choice may differ: row i is still clean
        elif i < clean:
            e = rel(res.logits[i], logits)
            assert e <= (tol0 if i == 0 else tol), f"{label} draft {i}: logits rel err {e:.2e}"
            if clear_argmax(logits):
                assert res.tokens[i] == int(np.argmax(logits)), f"{label} draft {i}: argmax"
        tok, h = res.tokens[i], bf16_round(g).astype(np.float64)
    return clean


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


def write_rows(refs, toks, hs, n: int) -> None:
    """Prefill rows 0..n-1 (embed(toks[r + 1]) paired with hs[r]) into each reference."""
    for ref in refs:
        for r in range(n):
            ref.write_row(toks[r + 1], hs[r], r)


def references_agree(ref, hf, rng, n: int, tie: float, check=None, steps: int = 3) -> None:
    """The float64 reference against transformers' layer (hf) along the reference's greedy chain after n
    prefilled rows: logits and carried hidden within 1e-5 until a routing near-tie (margin < tie, where
    transformers' float32 router may pick otherwise); check(ref) adds per-step assertions."""
    toks, hs, tok, h = inputs(rng, n)
    write_rows((ref, hf), toks, hs, n)
    for i in range(steps):
        (lr, gr), (lt, gt) = ref.step(tok, h, n + i), hf.step(tok, h, n + i)
        if ref.last_margin < tie:
            break
        if check is not None:
            check(ref)
        assert rel(lr, lt) < 1e-5 and rel(gr, gt) < 1e-5
        tok, h = int(np.argmax(lr)), gr


def cuda_matches_ref_device(load, path, rng, n: int, k: int, make_ref, tol: float) -> None:
    """The same prefill + propose(k) on the NumPy device and on CUDA. The CUDA chain is checked against the
    float64 reference (`make_ref()`, rows written here) by check_chain: draft 0 within 1e-2, chained drafts
    within `tol` (the module's chain tolerance: the bf16 carried hidden compounds), argmax where clear, up to
    a routing near-tie. Against its NumPy twin: the same bounds while both chains agree and the reference saw
    no routing near-tie (from one, the devices may legitimately pick different experts)."""
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
    check_chain(cu, refs[0], tok, h, n, 1e-2, tol, "cuda vs float64")
    margins, t, g = [], tok, bf16_round(h).astype(np.float64)        # the reference along the twin's chain
    for i in range(k):
        _, g = refs[1].step(t, g, n + i)
        margins.append(refs[1].last_margin)
        t, g = twin.tokens[i], bf16_round(g).astype(np.float64)
    for i in range(k):
        if cu.tokens[:i] != twin.tokens[:i] or margins[i] < ROUTE_TIE:
            break
        assert rel(cu.logits[i], twin.logits[i]) <= (1e-2 if i == 0 else tol), f"cuda vs twin, draft {i}"
        if clear_argmax(twin.logits[i]):
            assert cu.tokens[i] == twin.tokens[i], f"cuda vs twin, draft {i}"


def matches_oracle(prop, ref, hf, rng, n: int, k: int, tol0: float, tol: float, label: str) -> None:
    """Prefill n rows on the proposer and on both references, propose k, and check the chain against
    transformers' logits (hf) while the float64 reference (ref) supplies the routing/indexer margins."""
    class Both:
        def step(self, tok, h, pos):
            ref.step(tok, h, pos)
            self.last_margin = ref.last_margin
            return hf.step(tok, h, pos)

    toks, hs, tok, h = inputs(rng, n)
    st = prop.alloc_state()
    prop.prefill(st, toks, hs)
    write_rows((ref, hf), toks, hs, n)
    check_chain(prop.propose(st, tok, h, n, k, return_logits=True), Both(), tok, h, n, tol0, tol, label)
