"""transformers' `model.generate(..., custom_generate=mtp_cupy.integrations.transformers.generate)` with our drafter,
on the NumPy device: greedy output identical to target-only `generate` for every family whose target transformers
runs (DeepSeek-V3, DeepSeek-V4, Qwen3-Next, GLM-5 `glm_moe_dsa`), several prompts, every acceptance count (a
drafter steered by the target's own continuation), the hiddens handed to the drafter the target's own at the
right positions; the trained embedded model's drafts accepted; sampling lossless (chi-square at a verified
position and at a bonus position)."""
import tempfile

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import mtp_cupy  # noqa: E402
from mtp_cupy.integrations.transformers import HfTarget, generate as mtp_generate, hidden_site  # noqa: E402
from mtp_cupy.speculative.metrics import SpecDecodeMetrics  # noqa: E402
from mtp_cupy.testing.hf_targets import HF_FAMILIES, load_hf_target, write_hf_target  # noqa: E402

_PAIRS: dict = {}


def pair(fam: str):
    """(transformers target, our drafter on the NumPy device) of a tiny random checkpoint holding both."""
    if fam not in _PAIRS:
        path = mtp_cupy.DEFAULT_CHECKPOINT if fam == "embedded" else \
            write_hf_target(fam, tempfile.mkdtemp(prefix=f"hf_{fam}_"), seed=1)
        _PAIRS[fam] = (load_hf_target(path), mtp_cupy.load_proposer(path, gpu="ref", max_seq_len=128))
    return _PAIRS[fam]


def prompts(V: int, lens=(5, 9)):
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, V, (1, n), generator=g) for n in lens]


def base_and_spec(model, drafter, ids, n, k=3, **kw):
    base = model.generate(ids, max_new_tokens=n, do_sample=False, **kw)
    m = SpecDecodeMetrics()
    spec = model.generate(ids, max_new_tokens=n, do_sample=False, custom_generate=mtp_generate, drafter=drafter,
                          num_drafts=k, spec_metrics=m, **kw)
    return base, spec, m


@pytest.mark.parametrize("fam", HF_FAMILIES)
def test_greedy_equals_target_only(fam):
    model, drafter = pair(fam)
    free = drafter.kv.free_count
    for ids, k in zip(prompts(model.config.vocab_size), (3, 1)):
        base, spec, m = base_and_spec(model, drafter, ids, 12, k)
        assert torch.equal(base, spec), (fam, k, base[0, ids.shape[1]:].tolist(), spec[0, ids.shape[1]:].tolist())
        assert m.num_drafts >= 1
    assert drafter.kv.free_count == free      # the drafter state was freed


class Steered:
    """Our drafter with its draft tokens replaced by the target's greedy continuation `ref`, wrong from a chosen
    index on (cycle c: c % (k + 1) right, then wrong), so every acceptance count 0..k occurs, the full one
    included; rows and trims stay the real drafter's."""

    def __init__(self, drafter, ref: list[int]):
        self.d, self.ref, self.cycle = drafter, ref, 0
        self.max_seq_len, self.max_drafts = drafter.max_seq_len, drafter.max_drafts

    def __getattr__(self, name):
        return getattr(self.d, name)

    def propose(self, st, token, hidden, position, k, **kw):
        res = self.d.propose(st, token, hidden, position, k, **kw)
        right = self.cycle % (k + 1)
        self.cycle += 1
        want = self.ref[position + 2:position + 2 + k]
        want += [0] * (k - len(want))
        res.tokens = [t if i < right else (t + 1) % self.d.vocab_size for i, t in enumerate(want)]
        return res


@pytest.mark.parametrize("fam", HF_FAMILIES)
def test_every_acceptance_count_keeps_the_output(fam):
    """Full acceptance (no rollback), partial and none (crop, or snapshot + re-run for the recurrent / sliding
    caches of Qwen3-Next and DeepSeek-V4) all leave the output target-only's."""
    model, drafter = pair(fam)
    ids = prompts(model.config.vocab_size, (6,))[0]
    base = model.generate(ids, max_new_tokens=16, do_sample=False)
    m = SpecDecodeMetrics()
    spec = model.generate(ids, max_new_tokens=16, do_sample=False, custom_generate=mtp_generate,
                          drafter=Steered(drafter, base[0].tolist()), num_drafts=2, spec_metrics=m)
    assert torch.equal(base, spec)
    assert m.num_accepted_tokens > 0 and m.accepted_per_pos[1] > 0     # some cycles accepted everything


class Spy:
    """Our drafter, recording what the integration hands it (as float32 arrays)."""

    def __init__(self, drafter):
        self.d, self.calls = drafter, []
        self.max_seq_len, self.max_drafts = drafter.max_seq_len, drafter.max_drafts

    def __getattr__(self, name):
        return getattr(self.d, name)

    def prefill(self, st, tokens, hiddens, start_position=None, **kw):
        start = start_position if start_position is not None else (st.keys[-1] + 1 if st.keys else 0)
        self.calls.append(("prefill", start, list(tokens), hiddens.float().numpy().copy()))
        return self.d.prefill(st, tokens, hiddens, start_position, **kw)

    def propose(self, st, token, hidden, position, k, **kw):
        self.calls.append(("propose", position, [token], hidden[None].float().numpy().copy()))
        return self.d.propose(st, token, hidden, position, k, **kw)


@pytest.mark.parametrize("fam", HF_FAMILIES)
def test_drafter_gets_the_targets_hidden_at_each_position(fam):
    """Every row handed to the drafter pairs token p + 1 with the target's hidden at p (the final-normed
    hidden; V4's streams into hc_head), as one forward over the finished sequence computes them."""
    model, drafter = pair(fam)
    ids = prompts(model.config.vocab_size, (7,))[0]
    spy = Spy(drafter)
    seq = model.generate(ids, max_new_tokens=10, do_sample=False, custom_generate=mtp_generate, drafter=spy,
                         num_drafts=2)
    full = HfTarget(model)
    try:
        with torch.no_grad():
            _, H = full.forward(seq[0].tolist())
    finally:
        full.close()
    H, toks = H.float().numpy(), seq[0].tolist()
    assert [c[0] for c in spy.calls[:2]] == ["prefill", "propose"] and len(spy.calls) > 4
    for kind, start, tokens, hs in spy.calls:
        n = hs.shape[0]
        np.testing.assert_allclose(hs, H[start:start + n], rtol=1e-3, atol=1e-4, err_msg=f"{kind} at {start}")
        if kind == "prefill":
            assert tokens == toks[start:start + n + 1]
        else:
            assert tokens == [toks[start + 1]]
    site, where = hidden_site(model)
    assert where == ("input" if fam == "deepseek_v4" else "output") and site is not None


def test_trained_drafter_is_accepted_and_output_identical():
    model, drafter = pair("embedded")
    for p in (b"import os\nimport sys\n\n\ndef main(", b"class Foo:\n    def __init__(self"):
        ids = torch.tensor([list(p)])
        base, spec, m = base_and_spec(model, drafter, ids, 32, k=3)
        assert torch.equal(base, spec), p
        assert m.acceptance_rate_per_pos()[0] > 0.5 and m.mean_acceptance_length > 1.5, m.as_vllm()


def test_processors_eos_and_return_dict():
    """Logits processors apply to every verified row with its own prefix; EOS stops where target-only stops;
    return_dict_in_generate works."""
    model, drafter = pair("embedded")
    ids = torch.tensor([list(b"def add(a, b):\n    return")])
    base, spec, _ = base_and_spec(model, drafter, ids, 24, k=3, repetition_penalty=1.3)
    assert torch.equal(base, spec)
    eos = int(base[0, ids.shape[1] + 7])
    base, spec, _ = base_and_spec(model, drafter, ids, 24, k=3, repetition_penalty=1.3, eos_token_id=eos,
                                  pad_token_id=0)
    assert torch.equal(base, spec) and int(spec[0, -1]) == eos and spec.shape[1] < ids.shape[1] + 24

    out = model.generate(ids, max_new_tokens=10, do_sample=False, custom_generate=mtp_generate, drafter=drafter,
                         num_drafts=2, return_dict_in_generate=True)
    assert torch.equal(out.sequences, model.generate(ids, max_new_tokens=10, do_sample=False))


def test_errors():
    model, drafter = pair("embedded")
    ids = torch.tensor([list(b"def f(")] * 2)
    with pytest.raises(ValueError, match="batch size 1"):
        model.generate(ids, max_new_tokens=4, custom_generate=mtp_generate, drafter=drafter)
    with pytest.raises(ValueError, match="drafter"):
        model.generate(ids[:1], max_new_tokens=4, custom_generate=mtp_generate)
    with pytest.raises(ValueError, match="max_seq_len"):
        model.generate(ids[:1], max_new_tokens=200, custom_generate=mtp_generate, drafter=drafter)


class Force(transformers.LogitsProcessor):
    """Only `tokens[i]` is allowed at generated position i (for i < len(tokens)); free afterwards."""

    def __init__(self, prompt_len: int, tokens: list[int]):
        self.L, self.tokens = prompt_len, tokens

    def __call__(self, input_ids, scores):
        i = input_ids.shape[1] - self.L
        if i < len(self.tokens):
            keep = scores[:, self.tokens[i]].clone()
            scores[:] = -float("inf")
            scores[:, self.tokens[i]] = keep
        return scores


def _chi2_ok(counts, probs, n):
    exp = probs * n
    keep = exp > 5
    rest_o, rest_e = counts[~keep].sum(), exp[~keep].sum()
    chi2 = (((counts - exp) ** 2)[keep] / exp[keep]).sum() + ((rest_o - rest_e) ** 2 / rest_e if rest_e > 5 else 0)
    dof = keep.sum() + (rest_e > 5) - 1
    return chi2 < dof + 6 * np.sqrt(2 * dof), chi2, dof


@pytest.mark.parametrize("forced", [1, 2])
def test_sampling_is_lossless(forced):
    """Sampled speculative decoding draws each token from the target's own distribution. The first `forced`
    tokens are forced (a logits processor), so the next token has a known distribution p (temperature 0.9):
    forced=1 checks the verified position (draft kept with probability p(d), else drawn from p without d),
    forced=2 the bonus position after a kept draft (the trained drafter drafts the forced token)."""
    model, drafter = pair("embedded")
    # next tokens uncertain (entropy 3.4 / 2.5 nats at temperature 0.9); after "class " the trained drafter's
    # first draft is the forced token, so with forced=2 it is kept and the checked token is the bonus draw
    ids = torch.tensor([list(b"# Copyright" if forced == 1 else b"class ")])
    greedy = model.generate(ids, max_new_tokens=forced, do_sample=False)[0, ids.shape[1]:].tolist()
    with torch.no_grad():
        row = model(torch.cat([ids, torch.tensor([greedy])], 1)).logits[0, -1].double()
    p = torch.softmax(row / 0.9, -1).numpy()
    n, counts, m = 300, np.zeros(p.size), SpecDecodeMetrics()
    for i in range(n):
        torch.manual_seed(1000 + i)
        out = model.generate(ids, max_new_tokens=forced + 1, do_sample=True, temperature=0.9, top_k=0, top_p=1.0,
                             logits_processor=transformers.LogitsProcessorList([Force(ids.shape[1], greedy)]),
                             custom_generate=mtp_generate, drafter=drafter, num_drafts=2, spec_metrics=m)
        assert out[0, ids.shape[1]:-1].tolist() == greedy
        counts[int(out[0, -1])] += 1
    ok, chi2, dof = _chi2_ok(counts, p, n)
    assert ok and dof >= 5, (chi2, dof, np.argsort(-counts)[:5], np.argsort(-p)[:5])
    if forced == 1:     # the checked token came from kept drafts and from draws after rejections
        assert 0 < m.num_accepted_tokens < m.num_draft_tokens, m.as_vllm()
    else:               # the (right) draft of the forced token was kept: the checked token is the bonus draw
        assert m.num_accepted_tokens >= n, m.as_vllm()


def test_benchmark_beside_transformers_mtp_runs(tmp_path):
    """scripts/bench_transformers.py in small (CPU): transformers' own use_mtp finds the embedded checkpoint's
    MTP layer once its key pattern is re-pointed at layer 4, and every method's output is target-only's."""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
    import bench_transformers
    cls = transformers.DeepseekV3ForCausalLM
    saved = cls._keys_to_ignore_on_load_unexpected
    try:
        out = bench_transformers.main(["--max-new-tokens", "24", "--repeats", "1", "--ks", "1,2",
                                       "--json", str(tmp_path / "b.json")])
    finally:
        cls._keys_to_ignore_on_load_unexpected = saved
    rows = {r["method"]: r for r in out["results"]}
    assert set(rows) == {"target only", "transformers use_mtp", "mtp_cupy k=1", "mtp_cupy k=2"}
    assert all(r["identical_to_target"] for r in rows.values())
    assert rows["transformers use_mtp"]["target_forwards"] < 24 and rows["mtp_cupy k=1"]["target_forwards"] < 24
