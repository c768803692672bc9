"""Qwen3-Next MTP head: CupyBackend against RefBackend (the twins) for BF16, FP8 and NVFP4 heads, and the
batched propose on the GPU against single-sequence proposes."""
import numpy as np
import pytest

import mtp_cupy
from mtp_cupy.models import qwen3_next as qwen_mtp
from mtp_cupy.runtime.dtypes import bf16_round
from qwen_util import devices_agree, head_weights, tiny_ckpt

pytestmark = pytest.mark.gpu
# quantization None = the default, "stored"
CASES = [("bf16", "bf16"), ("bf16", "fp8"), ("bf16", "nvfp4"), ("fp8", "fp8"), ("nvfp4", "nvfp4"), ("fp8", None),
         ("nvfp4", None)]
T, K, D, V = 40, 4, 256, 512


def _run(gpu, ckpt_quant, quant, seed=0):
    opts = {} if quant is None else {"quantization": quant}
    prop = qwen_mtp.from_checkpoint(tiny_ckpt(ckpt_quant), gpu, max_seq_len=256, **opts)
    rng = np.random.default_rng(seed)
    toks, hs = rng.integers(0, V, T + 1), bf16_round(rng.standard_normal((T, D)))
    tok, h = int(rng.integers(V)), bf16_round(rng.standard_normal(D))
    st = prop.alloc_state()
    prop.prefill(st, toks, hs)
    return prop, prop.propose(st, tok, h, T, K, return_logits=True)


@pytest.mark.parametrize("ckpt_quant,quant", CASES)
def test_cupy_matches_twins(ckpt_quant, quant):
    pref, rr = _run(mtp_cupy.device("ref"), ckpt_quant, quant)
    pgpu, rg = _run(mtp_cupy.device("cuda"), ckpt_quant, quant)
    wr, wg = head_weights(pref), head_weights(pgpu)
    for k in wr:      # on-device quantisation is exact on both devices
        np.testing.assert_array_equal(wr[k], wg[k], err_msg=k)
    # the twin run is the reference here: same weights, accumulation order is the only difference
    devices_agree(rr, rg, f"{ckpt_quant}/{quant} cuda vs ref")


@pytest.mark.parametrize("ckpt_quant,quant", CASES)
def test_cupy_batched_equals_unbatched(ckpt_quant, quant):
    gpu = mtp_cupy.device("cuda")
    opts = {} if quant is None else {"quantization": quant}
    prop = qwen_mtp.from_checkpoint(tiny_ckpt(ckpt_quant), gpu, max_seq_len=256, max_batch=32, **opts)
    rng = np.random.default_rng(1)
    lens = [int(x) for x in rng.integers(3, 60, 32)]
    A, B = [prop.alloc_state() for _ in lens], [prop.alloc_state() for _ in lens]
    for n, a, b in zip(lens, A, B):
        toks, hs = rng.integers(0, V, n + 1), bf16_round(rng.standard_normal((n, D)))
        prop.prefill(a, toks, hs)
        prop.prefill(b, toks, hs)
    toks, hs = rng.integers(0, V, 32), bf16_round(rng.standard_normal((32, D)))
    got = prop.propose_batch(A, toks, hs, lens, K, return_logits=True)
    for s in range(32):
        want = prop.propose(B[s], toks[s], hs[s], lens[s], K, return_logits=True)
        # GEMV kernels of different batch widths may sum in a different order: compare like CUDA vs twin
        devices_agree(want, got[s], f"seq {s}")
        assert A[s].keys == B[s].keys
