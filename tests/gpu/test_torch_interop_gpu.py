"""torch <-> mtp_cupy on CUDA: a bf16 CUDA tensor is read where it is (eager: the chain reads the caller's
pointer; graphs: one device-to-device copy into hidden_in), other tensors are converted on the device, never
through the host; the caller's stream is respected (tests that race without it); no device-wide sync on the hot
path; device-side results; the transformers path for every family; the benchmark beside transformers' MTP."""
import tempfile

import numpy as np
import pytest

import mtp_cupy
from mtp_cupy.errors import InputError
from mtp_cupy.runtime.dtypes import bf16_round

from batch_util import FAMILIES, ckpt
from deepseek_util import snapshot

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="torch without CUDA")]
K = 3
SLEEP = int(2e8)          # torch.cuda._sleep cycles: ~0.1 s, far longer than a draft chain


def load(fam="deepseek_v3", **kw):
    return mtp_cupy.load_proposer(ckpt(fam), gpu=mtp_cupy.device("cuda"), max_seq_len=96, **kw)


def data(rng, prop, n=8):
    return (rng.integers(0, prop.vocab_size, n + 1), bf16_round(rng.standard_normal((n, prop.hidden_size))),
            int(rng.integers(prop.vocab_size)), bf16_round(rng.standard_normal(prop.hidden_size)))


def cuda_bf16(a):
    return torch.from_numpy(np.ascontiguousarray(a, np.float32)).cuda().to(torch.bfloat16)


def reference(prop, toks, hs, tok, h, calls=1):
    """Host-array results of `calls` proposes (a graphed proposer: eager, capture, replay)."""
    out = []
    for _ in range(calls):
        st = prop.alloc_state()
        prop.prefill(st, toks, hs)
        out.append(prop.propose(st, tok, h, len(toks) - 1, K, return_logits=True))
        prop.free_state(st)
    return out


class Spy:
    """Records the proposer's copies and the hidden pointer its first step / its prefill reads."""

    def __init__(self, prop):
        self.prop, g = prop, prop.gpu
        self.h2d, self.d2d, self.d2h, self.step0, self.rows = [], [], [], [], []
        self._saved = {n: getattr(g, n) for n in ("copy_h2d", "copy_h2d_async", "copy_d2d_async", "copy_d2h",
                                                  "copy_d2h_on")}
        s = self._saved
        g.copy_h2d = lambda dst, h: (self.h2d.append(int(dst)), s["copy_h2d"](dst, h))[1]
        g.copy_h2d_async = lambda dst, h, stream=None: (self.h2d.append(int(dst)),
                                                        s["copy_h2d_async"](dst, h, stream))[1]
        g.copy_d2d_async = lambda dst, src, n, stream=None: (self.d2d.append((int(dst), int(src), int(n))),
                                                             s["copy_d2d_async"](dst, src, n, stream))[1]
        g.copy_d2h = lambda src, n: (self.d2h.append(int(src)), s["copy_d2h"](src, n))[1]
        g.copy_d2h_on = lambda src, n, stream: (self.d2h.append(int(src)), s["copy_d2h_on"](src, n, stream))[1]
        fwd, rows = prop._forward, prop._write_rows
        prop._forward = lambda ids, hid, *a: (self.step0.append(int(hid)), fwd(ids, hid, *a))[1]
        prop._write_rows = lambda t, hid, *a: (self.rows.append(int(hid)), rows(t, hid, *a))[1]

    def close(self):
        for n, f in self._saved.items():
            setattr(self.prop.gpu, n, f)
        del self.prop._forward, self.prop._write_rows


def test_bf16_tensor_is_read_in_place_on_the_eager_path(rng):
    prop = load(cuda_graphs=False)
    toks, hs, tok, h = data(rng, prop)
    want = reference(prop, toks, hs, tok, h)[0]
    T, th = cuda_bf16(hs), cuda_bf16(h)
    st = prop.alloc_state()
    spy = Spy(prop)
    try:
        prop.prefill(st, torch.from_numpy(toks).cuda(), T)
        got = prop.propose(st, tok, th, len(toks) - 1, K, return_logits=True)
    finally:
        spy.close()
    assert spy.rows[0] == T.data_ptr()                   # prefill read the caller's rows
    assert spy.step0[0] == th.data_ptr()                 # the chain's first step read the caller's hidden
    hin, ph = int(prop.bufs.hidden_in), int(prop.bufs.prefill_hidden)
    assert hin not in spy.h2d and ph not in spy.h2d      # no hidden came from the host ...
    assert not [c for c in spy.d2d if c[1] in (T.data_ptr(), th.data_ptr())]   # ... nor was copied at all
    assert got.tokens == want.tokens and np.array_equal(got.logits, want.logits)
    prop.free_state(st)


@pytest.mark.parametrize("offset", [0, 1])
def test_graph_path_reads_the_tensor_once_on_the_device(rng, offset):
    """A graph reads hidden_in: the chain's first kernel fetches an aligned tensor there (the CallCtl names it, no
    copy call); one 2 bytes off 16-byte alignment takes one device-to-device copy call instead."""
    prop = load(cuda_graphs=True)
    toks, hs, tok, h = data(rng, prop)
    wants = reference(load(cuda_graphs=True), toks, hs, tok, h, calls=3)
    pad = np.zeros(8, np.float32)
    th = cuda_bf16(np.concatenate([pad[:offset], h, pad[offset:]]))[offset:offset + h.size]   # 2 offset bytes in
    assert (th.data_ptr() % 16 == 0) == (offset == 0)
    words = 2 * prop.hidden_size // 16
    for want in wants:                                      # eager, capture, replay
        st = prop.alloc_state()
        prop.prefill(st, toks, hs)
        spy = Spy(prop)
        try:
            got = prop.propose(st, tok, th, len(toks) - 1, K, return_logits=True)
        finally:
            spy.close()
        copied = [c for c in spy.d2d if c[1] == th.data_ptr()]
        if offset:
            assert copied == [(int(prop.bufs.hidden_in), th.data_ptr(), 2 * prop.hidden_size)]
            assert int(prop._ctl[0]) >> 32 == 0                    # nothing for the kernel to fetch
        else:
            assert copied == []
            assert (int(prop._ctl[0]) >> 32, int(prop._ctl[1])) == (words, th.data_ptr())
        assert int(prop.bufs.hidden_in) not in spy.h2d
        assert got.tokens == want.tokens and np.array_equal(got.logits, want.logits)
        prop.free_state(st)


def test_other_tensors_are_converted_on_the_device(rng):
    """f32, f16 and strided CUDA tensors: rounded / made contiguous on the device, equal to the host path."""
    prop = load(cuda_graphs=False)
    toks, hs, tok, h = data(rng, prop)
    h16 = h.astype(np.float16).astype(np.float32)
    want, want16 = reference(prop, toks, hs, tok, h)[0], reference(prop, toks, hs, tok, h16)[0]
    wide = torch.zeros(2 * h.size, device="cuda")
    wide[::2] = torch.from_numpy(h).cuda()
    for th, w in ((torch.from_numpy(h).cuda(), want), (torch.from_numpy(h16).cuda().half(), want16),
                  (wide[::2], want), (cuda_bf16(np.stack([h, h], 1))[:, 0], None)):
        st = prop.alloc_state()
        prop.prefill(st, toks, torch.from_numpy(hs).cuda())
        spy = Spy(prop)
        try:
            got = prop.propose(st, tok, th, len(toks) - 1, K, return_logits=True)
        finally:
            spy.close()
        assert int(prop.bufs.hidden_in) not in spy.h2d
        if w is None:      # a bf16 column of a [D, 2] tensor (stride 2)
            w = want
        assert got.tokens == w.tokens and np.array_equal(got.logits, w.logits)
        prop.free_state(st)


def test_bad_cuda_tensors_are_input_errors(rng):
    prop = load(cuda_graphs=False, check_device_finite=True)
    toks, hs, tok, h = data(rng, prop)
    st = prop.alloc_state()
    prop.prefill(st, toks, hs)
    th = torch.from_numpy(h).cuda()
    nan = th.clone()
    nan[5] = float("nan")
    bad = [th.int(), th.double(), th[:-1], torch.stack([th, th]), nan, nan.to(torch.bfloat16), nan.half()]
    if torch.cuda.device_count() > 1:
        bad.append(th.to("cuda:1"))
    before = snapshot(prop, st)
    for b in bad:
        with pytest.raises(InputError):
            prop.propose(st, tok, b, len(toks) - 1, K)
        assert snapshot(prop, st) == before
    prop.free_state(st)


_KEEP: list = []


def racing_hidden(h, s):
    """A CUDA hidden that holds zeros until stream `s`, after a long sleep, copies `h` into it (device to
    device: nothing on the host waits for s)."""
    t = torch.zeros(h.size, dtype=torch.bfloat16, device="cuda")
    src = cuda_bf16(h)
    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        torch.cuda._sleep(SLEEP)
        t.copy_(src)
    _KEEP.append(src)       # not freed (and reused on another stream) before s ran the copy
    return t


def test_per_call_stream_is_waited_for(rng):
    """The hidden is written on a side stream; the call runs from the default stream. With stream=s the
    proposer's work waits for s (and s for it); without, it reads the zeros (the control: this test races)."""
    prop = load(cuda_graphs=False)
    toks, hs, tok, h = data(rng, prop)
    want = reference(prop, toks, hs, tok, h)[0]
    s = torch.cuda.Stream()
    for use_stream in (True, False):
        st = prop.alloc_state()
        prop.prefill(st, toks, hs)
        t = racing_hidden(h, s)
        got = prop.propose(st, tok, t, len(toks) - 1, K, return_logits=True, stream=s if use_stream else None)
        torch.cuda.synchronize()
        prop.free_state(st)
        assert np.array_equal(got.logits, want.logits) == use_stream
    # the other direction: device results read on s after the call are the call's
    st = prop.alloc_state()
    prop.prefill(st, toks, hs)
    res = prop.propose(st, tok, racing_hidden(h, s), len(toks) - 1, K, stream=s, device_results=True)
    with torch.cuda.stream(s):
        ids = torch.from_dlpack(res.device_tokens).clone()
    s.synchronize()
    assert ids.tolist() == want.tokens
    prop.free_state(st)


@pytest.mark.parametrize("which", ["side", "default"])
def test_proposer_runs_on_the_callers_stream(which, rng):
    """load_proposer(stream=s): every launch and copy is on s (graphs captured on a private stream, replayed on
    s; torch's default stream cannot capture), so work queued on s before the call is seen."""
    s = torch.cuda.Stream() if which == "side" else torch.cuda.default_stream()
    prop = load(cuda_graphs=True, stream=s)
    assert prop.stream.ptr == s.cuda_stream
    toks, hs, tok, h = data(rng, prop)
    ref = load(cuda_graphs=True)
    for want in reference(ref, toks, hs, tok, h, calls=3):
        st = prop.alloc_state()
        prop.prefill(st, toks, hs)
        t = racing_hidden(h, s)
        got = prop.propose(st, tok, t, len(toks) - 1, K, return_logits=True)
        assert got.tokens == want.tokens and np.array_equal(got.logits, want.logits)
        prop.free_state(st)


def test_no_device_wide_sync_on_the_hot_path(rng, monkeypatch):
    """prefill / propose / after_verify with CUDA tensors: no cudaDeviceSynchronize, no synchronous (legacy
    stream) memcpy; the only host waits are the result reads on the proposer's stream (host results, or
    DraftResult.host() of device results)."""
    import cupy
    prop = load(cuda_graphs=True)
    toks, hs, tok, h = data(rng, prop)
    T, th = cuda_bf16(hs), cuda_bf16(h)
    st = prop.alloc_state()
    prop.prefill(st, toks, T)
    prop.propose(st, tok, th, len(toks) - 1, K)        # warm: compiles, lazy workspaces
    prop.after_verify(st, 0)

    def forbidden(*a, **k):
        raise AssertionError("device-wide synchronisation on the hot path")
    monkeypatch.setattr(cupy.cuda.runtime, "deviceSynchronize", forbidden)   # what mtp_cupy's Python calls
    monkeypatch.setattr(cupy.cuda.runtime, "memcpy", forbidden)              # synchronous, legacy stream
    monkeypatch.setattr(prop.gpu, "synchronize", forbidden)
    monkeypatch.setattr(prop.gpu, "copy_h2d", forbidden)
    monkeypatch.setattr(prop.gpu, "copy_d2h", forbidden)
    pos = len(toks) - 1
    for i in range(4):
        prop.prefill(st, [tok, 1], th[None], stream=torch.cuda.current_stream())
        res = prop.propose(st, 1, th, pos + 1, K, device_results=i % 2 == 1)
        if i % 2:
            res.host()
        prop.after_verify(st, 0)
        pos += 1
    prop.free_state(st)


def test_device_results(rng):
    """device_results=True: the drafts (and logits) come back as CUDA arrays of the call's own (DLPack), nothing is
    read to the host, and later calls (other tokens) overwrite none of them; eager, capture and replay."""
    ref = load(cuda_graphs=False)
    for graphs in (False, True):
        prop = load(cuda_graphs=graphs)
        toks, hs, tok, h = data(rng, prop)
        kept = []
        for i in range(3):
            t_i = (tok + 37 * i) % prop.vocab_size
            want = reference(ref, toks, hs, t_i, h)[0]
            st = prop.alloc_state()
            prop.prefill(st, toks, hs)
            spy = Spy(prop)
            try:
                res = prop.propose(st, t_i, cuda_bf16(h), len(toks) - 1, K, return_logits=True,
                                   device_results=True)
            finally:
                spy.close()
            assert not spy.d2h                               # nothing read back to the host
            ids = torch.from_dlpack(res.device_tokens)
            assert ids.is_cuda and ids.dtype == torch.int32
            ptr = ids.data_ptr()
            assert not int(prop.bufs.ids) <= ptr < int(prop.bufs.ids) + 4 * prop.max_batch * (K + 1)
            res.ready.synchronize()
            assert ids.tolist() == want.tokens
            assert np.array_equal(torch.from_dlpack(res.device_logits).cpu().numpy(), want.logits)
            kept.append((res, list(want.tokens)))
            prop.free_state(st)
        assert len({tuple(t) for _, t in kept}) > 1
        for res, toks_then in kept:
            assert res.host().tokens == toks_then


def test_device_results_of_a_batch(rng):
    """propose_batch(device_results=True): one int32 [B, K] and one f32 [B, K, vocab] CUDA array for the batch
    (DLPack), nothing read back, each sequence's DraftResult a view of its row; equal to host results of the same
    calls; eager, capture and replay."""
    B = 5
    for graphs in (False, True):
        dev, host = load(cuda_graphs=graphs, max_batch=8), load(cuda_graphs=graphs, max_batch=8)
        cases = [data(rng, dev, int(n)) for n in rng.integers(3, 20, B)]
        sd, sh = [dev.alloc_state() for _ in cases], [host.alloc_state() for _ in cases]
        for c, a, b in zip(cases, sd, sh):
            dev.prefill(a, c[0], c[1])
            host.prefill(b, c[0], c[1])
        for _ in range(3):
            toks, hs = [int(t) for t in rng.integers(0, dev.vocab_size, B)], np.stack([c[3] for c in cases])
            want = host.propose_batch(sh, toks, hs, None, K, return_logits=True)
            spy = Spy(dev)
            try:
                res = dev.propose_batch(sd, toks, cuda_bf16(hs), None, K, return_logits=True, device_results=True)
            finally:
                spy.close()
            assert not spy.d2h and res.tokens is None
            ids = torch.from_dlpack(res.device_tokens)
            assert ids.is_cuda and ids.dtype == torch.int32 and tuple(ids.shape) == (B, K)
            res.ready.synchronize()
            assert np.array_equal(ids.cpu().numpy(), want.tokens)
            assert np.array_equal(torch.from_dlpack(res.device_logits).cpu().numpy(), want.logits)
            assert [torch.from_dlpack(r.device_tokens).tolist() for r in res] == want.tokens.tolist()
            assert np.array_equal(res.host().tokens, want.tokens) and np.array_equal(res.logits, want.logits)
            dev.after_verify_batch(sd, [0] * B)
            host.after_verify_batch(sh, [0] * B)


_HF: dict = {}


def same_or_near_tie(model, base: list[int], spec: list[int], margin: float = 0.25) -> bool:
    """Equal, or first different where the target's own top-2 logits (one forward over the common prefix) are
    within `margin`: a bf16 target's 1-row and (k+1)-row forwards may round a near tie either way."""
    j = next((i for i, (x, y) in enumerate(zip(base, spec)) if x != y), None)
    if j is None:
        return len(base) == len(spec)
    with torch.no_grad():
        lg = model(torch.tensor([base[:j]], device="cuda")).logits[0, -1].float()
    top = torch.topk(lg, 2)
    return float(top.values[0] - top.values[1]) < margin and {base[j], spec[j]} <= set(top.indices.tolist())


def hf_pair(fam, dtype=None):
    from mtp_cupy.testing.hf_targets import load_hf_target, write_hf_target
    if fam not in _HF:
        _HF[fam] = mtp_cupy.DEFAULT_CHECKPOINT if fam == "embedded" else \
            write_hf_target(fam, tempfile.mkdtemp(prefix=f"hfg_{fam}_"), seed=1)
    path = _HF[fam]
    return load_hf_target(path, dtype=dtype, device="cuda"), \
        mtp_cupy.load_proposer(path, gpu=mtp_cupy.device("cuda"), max_seq_len=256)


@pytest.mark.parametrize("fam", FAMILIES)
def test_transformers_path_every_family(fam):
    """float32 target on the GPU, our drafter on the GPU (hiddens converted on the device): greedy output is
    target-only's, several prompts."""
    from mtp_cupy.integrations.transformers import generate as mtp_generate
    model, drafter = hf_pair(fam)
    g = torch.Generator().manual_seed(3)
    for n, k in ((5, 3), (9, 1), (12, 2)):
        ids = torch.randint(0, model.config.vocab_size, (1, n), generator=g).cuda()
        base = model.generate(ids, max_new_tokens=16, do_sample=False)
        spec = model.generate(ids, max_new_tokens=16, do_sample=False, custom_generate=mtp_generate,
                              drafter=drafter, num_drafts=k)
        assert torch.equal(base, spec), (fam, n, k)


def test_transformers_path_bf16_zero_copy():
    """A bf16 target: its hiddens reach the drafter without a copy through the host; the trained drafter is
    accepted and greedy output is target-only's (or parts at a bf16 near tie of the target's own logits)."""
    from mtp_cupy.integrations.transformers import generate as mtp_generate
    from mtp_cupy.speculative.metrics import SpecDecodeMetrics
    model, drafter = hf_pair("embedded", torch.bfloat16)
    ids = torch.tensor([list(b"import os\nimport sys\n\n\ndef main(")]).cuda()
    m = SpecDecodeMetrics()
    base = model.generate(ids, max_new_tokens=64, do_sample=False)
    spy = Spy(drafter)
    try:
        spec = model.generate(ids, max_new_tokens=64, do_sample=False, custom_generate=mtp_generate,
                              drafter=drafter, num_drafts=3, spec_metrics=m)
    finally:
        spy.close()
    assert same_or_near_tie(model, base[0].tolist(), spec[0].tolist()), (base.tolist(), spec.tolist())
    assert m.acceptance_rate_per_pos()[0] > 0.5
    assert int(drafter.bufs.hidden_in) not in spy.h2d and int(drafter.bufs.prefill_hidden) not in spy.h2d


def test_benchmark_beside_transformers_mtp(tmp_path, capsys):
    """scripts/bench_transformers.py on the GPU (bf16 target, drafter on CUDA): prints the table to paste; every
    output is target-only's (or parts at a bf16 near tie of the target's own logits)."""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
    import bench_transformers
    out = bench_transformers.main(["--device", "cuda", "--max-new-tokens", "200", "--repeats", "3",
                                   "--json", str(tmp_path / "bench_transformers_gpu.json")])
    with capsys.disabled():
        print()
        for r in out["results"]:
            print(r)
    model = hf_pair("embedded", torch.bfloat16)[0]
    ref = out["outputs"]["target only"]
    for name, toks in out["outputs"].items():
        assert same_or_near_tie(model, ref, toks), name
