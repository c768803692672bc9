"""DLPack inputs on the NumPy device: torch tensors (and any __dlpack__ object) for hiddens, tokens and positions
give exactly what NumPy arrays give; every bad tensor is an InputError with the state unchanged; device results
(DLPack arrays of their own) equal host results; `import mtp_cupy` stays free of torch."""
import subprocess
import sys

import numpy as np
import pytest

import mtp_cupy
from mtp_cupy.errors import ConfigError, InputError
from mtp_cupy.runtime.dtypes import BF16

from batch_util import FAMILIES, ckpt, hidden
from deepseek_util import snapshot

torch = pytest.importorskip("torch")

K = 3
_PROPS: dict = {}


def prop_of(fam: str, **kw):
    key = (fam, tuple(sorted(kw.items())))
    if key not in _PROPS:
        _PROPS[key] = mtp_cupy.load_proposer(ckpt(fam), gpu="ref", max_seq_len=64, **kw)
    return _PROPS[key]


def t_bf16(a: np.ndarray):
    """A torch bf16 tensor holding the bf16-exact values of `a`."""
    return torch.from_numpy(np.ascontiguousarray(a, np.float32)).to(torch.bfloat16)


def run(prop, toks, hs, tok, h, pos, **kw):
    st = prop.alloc_state()
    try:
        prop.prefill(st, toks, hs)
        res = prop.propose(st, tok, h, pos, K, return_logits=True, **kw)
        return res, list(st.keys)
    finally:
        prop.free_state(st)


def case(rng, prop, n=6, streams=False):
    toks = rng.integers(0, prop.vocab_size, n + 1)
    return toks, hidden(rng, prop, n, streams), int(rng.integers(prop.vocab_size)), hidden(rng, prop, None, streams)


@pytest.mark.parametrize("fam", FAMILIES)
def test_torch_tensors_equal_numpy(fam, rng):
    prop = prop_of(fam)
    forms = [False, True] if fam == "deepseek_v4" else [False]
    for streams in forms:
        toks, hs, tok, h = case(rng, prop, streams=streams)
        want, keys = run(prop, toks, hs, tok, h, len(toks) - 1)
        variants = {
            "f32": (torch.from_numpy(hs), torch.from_numpy(h)),
            "bf16": (t_bf16(hs), t_bf16(h)),
            "f16 of bf16-exact": (torch.from_numpy(hs).half(), torch.from_numpy(h).half()) if
            np.array_equal(hs.astype(np.float16).astype(np.float32), hs) else None,
            "requires_grad": (torch.from_numpy(hs).requires_grad_(), torch.from_numpy(h).requires_grad_()),
            "[1, D] hidden": (torch.from_numpy(hs), torch.from_numpy(h)[None]),
        }
        for name, v in variants.items():
            if v is None:
                continue
            got, gkeys = run(prop, torch.from_numpy(toks), v[0], torch.tensor(tok), v[1],
                             torch.tensor(len(toks) - 1))
            assert got.tokens == want.tokens and gkeys == keys, (fam, streams, name)
            assert np.array_equal(got.logits, want.logits), (fam, streams, name)


def test_float16_tensor_rounds_like_float32(rng):
    """A float16 tensor is widened exactly and rounded to bf16 once: the same as its float32 values."""
    prop = prop_of("deepseek_v3")
    toks, hs, tok, h = case(rng, prop)
    hs16, h16 = hs.astype(np.float16), h.astype(np.float16)
    want, _ = run(prop, toks, hs16.astype(np.float32), tok, h16.astype(np.float32), len(toks) - 1)
    got, _ = run(prop, toks, torch.from_numpy(hs16), tok, torch.from_numpy(h16), len(toks) - 1)
    assert got.tokens == want.tokens and np.array_equal(got.logits, want.logits)


def test_strided_tensor_is_copied_not_misread(rng):
    prop = prop_of("deepseek_v3")
    toks, hs, tok, h = case(rng, prop)
    want, _ = run(prop, toks, hs, tok, h, len(toks) - 1)
    wide = torch.zeros(hs.shape[0], 2 * hs.shape[1])
    wide[:, ::2] = torch.from_numpy(hs)                    # every other column: strides (2D, 2)
    hcol = torch.zeros(2 * h.shape[0])
    hcol[1::2] = torch.from_numpy(h)
    tr = torch.from_numpy(np.ascontiguousarray(hs.T)).T   # transposed: column-major
    for hs_t, h_t in ((wide[:, ::2], hcol[1::2]), (tr, torch.from_numpy(h))):
        assert not hs_t.is_contiguous()
        got, _ = run(prop, toks, hs_t, tok, h_t, len(toks) - 1)
        assert got.tokens == want.tokens and np.array_equal(got.logits, want.logits)


@pytest.mark.parametrize("fam", ["deepseek_v3", "qwen3_next"])
def test_batch_of_tensors_equals_numpy(fam, rng):
    prop = prop_of(fam, max_batch=4)
    B, lens = 3, [5, 7, 4]
    cases = [case(rng, prop, n) for n in lens]

    def batch(as_torch):
        sts = [prop.alloc_state() for _ in range(B)]
        for st, (toks, hs, _, _) in zip(sts, cases):
            prop.prefill(st, torch.from_numpy(toks) if as_torch else toks, t_bf16(hs) if as_torch else hs)
        toks = [c[2] for c in cases]
        hs = np.stack([c[3] for c in cases])
        pos = [n for n in lens]
        if as_torch:
            res = prop.propose_batch(sts, torch.tensor(toks), t_bf16(hs), torch.tensor(pos), K, return_logits=True)
        else:
            res = prop.propose_batch(sts, toks, hs, pos, K, return_logits=True)
        for st in sts:
            prop.free_state(st)
        return res

    for a, b in zip(batch(False), batch(True)):
        assert a.tokens == b.tokens and np.array_equal(a.logits, b.logits)


class FakeDLPack:
    """A DLPack producer on some other device (what a CUDA or OpenCL tensor looks like to the NumPy device)."""

    def __init__(self, dev_type: int, shape):
        self.dev, self.shape = dev_type, shape

    def __dlpack_device__(self):
        return (self.dev, 0)

    def __dlpack__(self, **kw):
        raise AssertionError("must be refused before it is read")


@pytest.mark.parametrize("fam", ["deepseek_v3", "deepseek_v4"])
def test_bad_tensors_are_input_errors_with_state_unchanged(fam, rng):
    prop = prop_of(fam)
    toks, hs, tok, h = case(rng, prop)
    st = prop.alloc_state()
    prop.prefill(st, torch.from_numpy(toks), torch.from_numpy(hs))
    pos = len(toks) - 1
    D = prop.hidden_size
    th = torch.from_numpy(h)
    nan = th.clone()
    nan[3] = float("nan")
    inf = th.clone()
    inf[0] = float("inf")
    bad = {
        "int32 hidden": (lambda: prop.propose(st, tok, th.to(torch.int32), pos, K), "float32, float16 or bfloat16"),
        "float64 hidden": (lambda: prop.propose(st, tok, th.double(), pos, K), "float32, float16 or bfloat16"),
        "short hidden": (lambda: prop.propose(st, tok, th[:D - 1], pos, K), "shape"),
        "2 rows for 1": (lambda: prop.propose(st, tok, torch.stack([th, th]), pos, K), "shape"),
        "NaN f32": (lambda: prop.propose(st, tok, nan, pos, K), "NaN"),
        "inf f32": (lambda: prop.propose(st, tok, inf, pos, K), "NaN or inf"),
        "NaN bf16": (lambda: prop.propose(st, tok, nan.to(torch.bfloat16), pos, K), "NaN"),
        "NaN f16": (lambda: prop.propose(st, tok, nan.half(), pos, K), "NaN"),
        "CUDA tensor": (lambda: prop.propose(st, tok, FakeDLPack(2, (D,)), pos, K), "CUDA"),
        "OpenCL tensor": (lambda: prop.propose(st, tok, FakeDLPack(4, (D,)), pos, K), "device type 4"),
        "float token": (lambda: prop.propose(st, torch.tensor(1.0), th, pos, K), "integers"),
        "two tokens": (lambda: prop.propose(st, torch.tensor([1, 2]), th, pos, K), "one token"),
        "token >= vocab": (lambda: prop.propose(st, torch.tensor(prop.vocab_size), th, pos, K), "out of range"),
        "position tensor behind": (lambda: prop.propose(st, tok, th, torch.tensor(pos - 2), K), "after_verify"),
        "prefill NaN bf16": (lambda: prop.prefill(st, torch.tensor([1, 2]), nan[None].to(torch.bfloat16)), "NaN"),
        "prefill count": (lambda: prop.prefill(st, torch.tensor([1, 2, 3]), th[None]), "shape"),
        "prefill CUDA": (lambda: prop.prefill(st, torch.tensor([1, 2]), FakeDLPack(2, (1, D))), "CUDA"),
        "prefill float tokens": (lambda: prop.prefill(st, torch.tensor([1.0, 2.0]), th[None]), "integers"),
        "batch of 2 hiddens for 1": (lambda: prop.propose_batch([st], [tok], torch.stack([th, th]), [pos], K),
                                     "shape"),
        "bad per-call stream": (lambda: prop.propose(st, tok, th, pos, K, stream="s0"), "stream"),
    }
    before = snapshot(prop, st)
    for name, (call, msg) in bad.items():
        with pytest.raises(InputError, match=msg):
            call()
        assert snapshot(prop, st) == before, name
    assert prop.propose(st, tok, th, pos, K).tokens       # still usable
    prop.free_state(st)


def test_numpy_float16_keeps_its_contract(rng):
    """NumPy arrays stay float32 / bfloat16 (float16 is a tensor dtype here)."""
    prop = prop_of("deepseek_v3")
    toks, hs, tok, h = case(rng, prop)
    st = prop.alloc_state()
    prop.prefill(st, toks, hs)
    with pytest.raises(InputError, match="float16"):
        prop.propose(st, tok, h.astype(np.float16), len(toks) - 1, K)
    prop.free_state(st)


def test_eager_path_reads_a_device_pointer_in_place(rng):
    """A hidden already on the device is read where it is by the eager chain (no copy into hidden_in)."""
    prop = prop_of("deepseek_v3")
    toks, hs, tok, h = case(rng, prop)
    want, _ = run(prop, toks, hs, tok, h, len(toks) - 1)
    buf = prop.gpu.upload(h.astype(BF16))
    seen, copies = [], []
    fwd, d2d = prop._forward, prop.gpu.copy_d2d_async
    prop._forward = lambda ids, hid, *a: (seen.append(int(hid)), fwd(ids, hid, *a))[1]
    prop.gpu.copy_d2d_async = lambda dst, src, n, stream=None: (copies.append((int(dst), int(src))),
                                                                 d2d(dst, src, n, stream))[1]
    try:
        got, _ = run(prop, toks, hs, tok, buf.ptr, len(toks) - 1)
    finally:
        del prop._forward, prop.gpu.copy_d2d_async
    assert seen[0] == int(buf.ptr) and (int(prop.bufs.hidden_in), int(buf.ptr)) not in copies
    assert got.tokens == want.tokens and np.array_equal(got.logits, want.logits)


@pytest.mark.parametrize("fam", ["deepseek_v3", "glm5"])
def test_device_results_equal_host_results(fam, rng):
    prop = prop_of(fam, max_batch=4)
    toks, hs, tok, h = case(rng, prop)
    pos = len(toks) - 1
    want, keys = run(prop, toks, hs, tok, h, pos)
    st = prop.alloc_state()
    prop.prefill(st, toks, hs)
    res = prop.propose(st, tok, torch.from_numpy(h), pos, K, return_logits=True, device_results=True)
    assert res.tokens is None and res.logits is None and list(st.keys) == keys
    ids = torch.from_dlpack(res.device_tokens)            # exports DLPack without a host copy of ours
    assert ids.dtype == torch.int32 and ids.tolist() == want.tokens
    assert np.array_equal(np.from_dlpack(res.device_logits), want.logits)
    kept = np.array(res.device_tokens).copy()
    prop.after_verify(st, 0)
    prop.prefill(st, [tok, 1], h[None])
    prop.propose(st, 2, h, pos + 1, K, device_results=True)           # a later call ...
    assert np.array_equal(np.asarray(res.device_tokens), kept)         # ... never overwrites an earlier result
    assert res.host().tokens == want.tokens and np.array_equal(res.logits, want.logits)
    with pytest.raises(InputError, match="device_results"):
        prop.propose(st, 2, h, pos + 1, K, min_logprob=-1.0, device_results=True)
    prop.free_state(st)


def test_device_results_of_a_batch(rng):
    prop = prop_of("qwen3_next", max_batch=4)
    lens = [4, 6]
    cases = [case(rng, prop, n) for n in lens]
    outs = []
    for dev in (False, True):
        sts = [prop.alloc_state() for _ in lens]
        for st, c in zip(sts, cases):
            prop.prefill(st, c[0], c[1])
        outs.append(prop.propose_batch(sts, [c[2] for c in cases], np.stack([c[3] for c in cases]), lens, K,
                                       return_logits=True, device_results=dev))
        for st in sts:
            prop.free_state(st)
    for a, b in zip(*outs):
        assert np.asarray(b.device_tokens).tolist() == a.tokens
        assert np.array_equal(np.asarray(b.device_logits), a.logits)
    host, dev = outs   # the batch's arrays whole: [B, K] ids and [B, K, vocab] logits, on the device and read back
    assert np.asarray(dev.device_tokens).shape == (len(lens), K) and dev.tokens is None and dev.logits is None
    assert np.array_equal(np.asarray(dev.device_tokens), host.tokens)
    assert np.array_equal(np.asarray(dev.device_logits), host.logits)
    assert np.array_equal(dev.host().tokens, host.tokens) and np.array_equal(dev.logits, host.logits)


def test_stream_option_is_checked():
    with pytest.raises(ConfigError, match="stream"):
        mtp_cupy.load_proposer(ckpt("deepseek_v3"), gpu="ref", max_seq_len=64, stream="default")
    prop = mtp_cupy.load_proposer(ckpt("deepseek_v3"), gpu="ref", max_seq_len=64, stream=0)
    assert prop.options.stream == 0      # the NumPy device has no streams: any stream is trivially respected


def test_import_mtp_cupy_does_not_import_torch():
    code = "import sys, mtp_cupy, mtp_cupy.speculative, mtp_cupy.integrations; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
