"""Every family on checkpoints our writer did not write (tests/outside_ckpt.py: transformers' save_pretrained of a
random model, the MTP-only tensors and renames written by safetensors, FP8 / FP4 tensors hand-encoded from the
published encodings), one per weight format, against the float64 reference reading the same files with its
own reader: a key the loader maps wrongly, or a convention our writer and loader share but the formats do not
(nibble order, scale layout, which tensor is which), shows as a wrong chain."""
import numpy as np
import pytest

import helpers
import mtp_cupy
from deepseek_util import ref_weights as mla_ref_weights
from helpers import write_rows
from qwen_util import ref_weights as qwen_ref_weights, run_quant
from reference.checkpoint import E4M3, RawCheckpoint, read_weights

pytest.importorskip("transformers")
from outside_ckpt import FORMATS, outside_checkpoint  # noqa: E402

CASES = [(fam, fmt) for fam, fmts in FORMATS.items() for fmt in fmts]
# (first-draft tolerance, chained, decision near tie, top-2 gap): the bounds each family's own tests measured
BOUNDS = {"deepseek_v3": (1.5e-2, 2.5e-2, 2e-2, 0.1), "glm5": (1e-2, 2e-2, 2e-2, 0.1),
          "qwen3_next": (1.2e-2, 2e-2, 3e-2, 0.05), "deepseek_v4": (1e-2, 1.5e-2, 1e-2, 0.05)}
# the Linear formats the hand-built tensors must load as (a loader that fell back to another would pass the
# chain check with the wrong kernels)
LOADED_AS = {("deepseek_v3", "fp8"): {"fp8_block"}, ("glm5", "fp8"): {"fp8_block"},
             ("qwen3_next", "nvfp4"): {"nvfp4"}, ("deepseek_v4", "fp8_mxfp4"): {"fp8_block_e8m0", "mxfp4"}}


def _reference(family: str, path, prop):
    from reference.deepseek_ref import DeepseekMtpRef
    from reference.deepseek_v4_ref import V4MtpRef
    from reference.glm_ref import GlmMtpRef
    from reference.qwen_ref import QwenMtpRef
    cfg = RawCheckpoint(path).config
    if family == "deepseek_v3":
        return DeepseekMtpRef(mla_ref_weights(path), cfg)
    if family == "glm5":
        return GlmMtpRef(mla_ref_weights(path), cfg)
    if family == "qwen3_next":
        q = run_quant(prop)
        return QwenMtpRef(qwen_ref_weights(path, q), cfg, kv_fp8=q == "nvfp4")
    return V4MtpRef(read_weights(path)[0], cfg)


def _linear_formats(prop) -> set[str]:
    from mtp_cupy.weights.linear import Linear
    seen, out = set(), set()

    def walk(x):
        if id(x) in seen:
            return
        seen.add(id(x))
        if isinstance(x, Linear):
            out.add(x.fmt)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
        elif hasattr(x, "__dataclass_fields__"):
            for f in x.__dataclass_fields__:
                walk(getattr(x, f))
    walk(prop.w)
    return out


@pytest.mark.parametrize("family,fmt", CASES)
def test_outside_checkpoint_matches_reference(ref, rng, family, fmt):
    path = outside_checkpoint(family, fmt)
    opts = {"kv_cache_dtype": "bf16"} if family == "deepseek_v4" else {}   # the reference keeps bf16 rows
    prop = mtp_cupy.load_proposer(path, gpu=ref, max_seq_len=64, **opts)
    assert prop.family == family
    assert LOADED_AS.get((family, fmt), {"bf16"}) <= _linear_formats(prop), _linear_formats(prop)
    model = _reference(family, path, prop)
    D, V, n, k = prop.hidden_size, prop.vocab_size, 12, 3
    shape = (prop.cfg.hc_mult, D) if family == "deepseek_v4" else (D,)
    toks = rng.integers(0, V, n + 1)
    hs = helpers.bf16(rng.standard_normal((n, *shape))).astype(np.float32)
    tok, h = int(rng.integers(V)), helpers.bf16(rng.standard_normal(shape)).astype(np.float32)
    st = prop.alloc_state()
    prop.prefill(st, toks, hs)
    write_rows([model], toks, hs.astype(np.float64), n)
    res = prop.propose(st, tok, h, n, k, return_logits=True)
    tol0, tol, tie, argmax_tie = BOUNDS[family]
    helpers.check_chain(res, model, tok, h, n, tol0, tol, f"{family}/{fmt}", tie, argmax_tie)


def test_reader_decodes_like_torch():
    """The references' e4m3 / e8m0 decoding of the hand-built tensors equals torch's own float8 conversion."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file
    path = outside_checkpoint("deepseek_v4", "fp8_mxfp4")
    ck = RawCheckpoint(path)
    for f in sorted(path.glob("*.safetensors")):
        for key, t in load_file(f).items():
            if t.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.bfloat16):
                assert np.array_equal(ck.value(key), t.to(torch.float64).numpy(), equal_nan=True), key
    codes = np.arange(256, dtype=np.uint8)
    assert np.array_equal(E4M3, torch.from_numpy(codes).view(torch.float8_e4m3fn).to(torch.float64).numpy(),
                          equal_nan=True)
