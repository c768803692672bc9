"""DeepSeek-V4 MTP proposer on tiny random checkpoints (real key layout and formats) against the independent
float64 reference (tests/reference/deepseek_v4_ref.py): prefill + propose chains for both hidden forms,
after_verify trims mirrored on the reference, the head variants, and every error path leaving state as it was.
The reference keeps bf16 KV rows, so the chains against it run kv_cache_dtype="bf16"; the fp8 default is held
to the official rounding in test_v4_fp8_kv.py."""
import tempfile

import numpy as np
import pytest

import mtp_cupy
from mtp_cupy.errors import CapacityError, ConfigError, InputError
from mtp_cupy.models import deepseek_v4 as v4
from mtp_cupy.testing.tiny.deepseek_v4 import write_tiny_checkpoint
from mtp_cupy.weights.deepseek_v4 import LowRankHcHeadError
from mtp_cupy.runtime.dtypes import BF16
from reference.deepseek_v4_ref import V4MtpRef, load_weights
import helpers
from helpers import clear_argmax, rel_err

TOL = 1e-2           # logits vs float64, first draft (measured: mean 5e-3, max 7.6e-3 over 700 fresh seeds)
CHAIN_TOL = 1.5e-2   # chained drafts (the bf16 carried streams compound: mean 6e-3, max 1.0e-2)
ROUTE_TIE = 1e-2     # gap of sqrt(softplus) score + bias at the top-k boundary where either side is legitimate
ARGMAX_TIE = 0.05    # top-2 logit gap (in logit std) below which a different draft is legitimate
_CKPTS: dict = {}


def ckpt(seed: int = 1, **kw):
    """A tiny checkpoint written once per process, and its float64 weights / config."""
    key = (seed, tuple(sorted(kw.items())))
    if key not in _CKPTS:
        path = write_tiny_checkpoint(tempfile.mkdtemp(prefix="v4_"), seed=seed, **kw)
        _CKPTS[key] = (path, *load_weights(path))
    return _CKPTS[key]


def hidden(rng, cfg, form: str, n: int | None = None) -> np.ndarray:
    """Target hiddens as the proposer sees them (bf16 values, float32 arrays)."""
    shape = (cfg["hc_mult"], cfg["hidden_size"]) if form == "streams" else (cfg["hidden_size"],)
    h = rng.standard_normal(shape if n is None else (n, *shape)).astype(np.float32)
    return h.astype(BF16).astype(np.float32)


def snapshot(prop, st) -> tuple:
    return (st.blocks.rows, list(st.keys), list(st.blocks.table), st.last_num_drafted, st.last_pair_key,
            list(st.last_drafts), prop.kv.free_count)


def check_chain(prop, st, ref: V4MtpRef, token: int, h, position: int, k: int) -> list[int]:
    """propose(k) against the reference teacher-forced on the proposer's own drafts (helpers.check_chain:
    every draft compared, either side of a routing near tie); returns the drafts."""
    res = prop.propose(st, token, h, position, k, return_logits=True)
    assert len(res.tokens) == k and res.logits.shape == (k, prop.vocab_size)
    helpers.check_chain(res, ref, token, h, position, TOL, CHAIN_TOL, f"V4 at {position}", ROUTE_TIE, ARGMAX_TIE)
    return res.tokens


@pytest.mark.parametrize("form", ["streams", "single"])
def test_prefill_and_propose_cycles_match_reference(ref, rng, form):
    path, w, cfg = ckpt()
    prop = v4.from_checkpoint(path, ref, kv_cache_dtype="bf16", max_seq_len=64)
    st = prop.alloc_state()
    model = V4MtpRef(w, cfg)
    n = 12                                             # longer than the window (8): old rows drop out
    toks = rng.integers(0, cfg["vocab_size"], n + 1)
    hs = hidden(rng, cfg, form, n)
    assert prop.prefill(st, toks, hs) == n
    for r in range(n):
        model.write_row(int(toks[r + 1]), hs[r].astype(np.float64), r)
    pos = n
    for accept in (2, 0, 3):
        tok = int(rng.integers(0, cfg["vocab_size"]))
        rows = len(model.rows)
        check_chain(prop, st, model, tok, hidden(rng, cfg, form), pos, 3)
        prop.after_verify(st, accept)
        model.truncate(rows + accept)           # the accepted drafts' rows stay, the rejected ones go
        assert [p for p, _ in model.rows] == st.keys == list(range(pos + accept))
        pos += accept + 1                       # catch-up: the row of the last accepted token, from the target
        t2, h1 = rng.integers(0, cfg["vocab_size"], 2), hidden(rng, cfg, form, 1)
        prop.prefill(st, t2, h1)
        model.write_row(int(t2[1]), h1[0].astype(np.float64), pos - 1)
    prop.free_state(st)
    assert prop.kv.free_count == prop.pool_blocks


def test_forward_one_without_hc_head_takes_first_stream(ref, rng):
    path, w, cfg = ckpt(seed=2, hc_head=False)
    prop = v4.from_checkpoint(path, ref, kv_cache_dtype="bf16", max_seq_len=32)
    assert prop.w.hc_head is None
    st = prop.alloc_state()
    check_chain(prop, st, V4MtpRef(w, cfg), 5, hidden(rng, cfg, "streams"), 0, 2)


def test_hash_routed_mtp_layer(ref, rng):
    """A checkpoint whose MTP layer is a hash layer (tid2eid, no bias) routes by the step's input token."""
    path, w, cfg = ckpt(seed=8, hash_routed=True)
    prop = v4.from_checkpoint(path, ref, kv_cache_dtype="bf16", max_seq_len=32)
    assert prop.moe.cfg.routing == "hash"
    check_chain(prop, prop.alloc_state(), V4MtpRef(w, cfg), 9, hidden(rng, cfg, "single"), 0, 3)


def test_low_rank_hc_head_is_refused(ref):
    path, _, _ = ckpt(seed=4, low_rank_head=True)
    with pytest.raises(LowRankHcHeadError, match="low-rank"):
        v4.from_checkpoint(path, ref)
    assert issubclass(LowRankHcHeadError, ConfigError)


def test_device_pointer_hiddens_and_vocab_limit(ref, rng):
    """A device-pointer hidden is read in the `device_hidden` form; mtp_vocab_size limits the scored rows."""
    path, w, cfg = ckpt()
    for form in ("streams", "single"):
        prop = v4.from_checkpoint(path, ref, max_seq_len=32, device_hidden=form, mtp_vocab_size=300)
        st = prop.alloc_state()
        hs = hidden(rng, cfg, form, 3)
        buf = ref.upload(hs.astype(BF16))
        prop.prefill(st, [1, 2, 3, 4], buf.ptr)
        h = hidden(rng, cfg, form)
        hb = ref.upload(h.astype(BF16))
        res = prop.propose(st, 7, hb.ptr, 3, 2, return_logits=True)
        host = v4.from_checkpoint(path, ref, max_seq_len=32, mtp_vocab_size=300)
        st2 = host.alloc_state()
        host.prefill(st2, [1, 2, 3, 4], hs)
        res2 = host.propose(st2, 7, h, 3, 2, return_logits=True)
        assert res.tokens == res2.tokens and np.array_equal(res.logits, res2.logits)
        assert all(t < 300 for t in res.tokens) and np.all(np.isneginf(res.logits[:, 300:]))


def test_grammar_bitmask_limits_drafts(ref, rng):
    """Masked drafts are the best allowed ids of the same logits; a mask that allows nothing drafts pad 0."""
    path, _, cfg = ckpt()
    words = (cfg["vocab_size"] + 31) // 32
    even = np.full(words, 0x55555555, np.uint32).view(np.int32)
    prop = v4.from_checkpoint(path, ref, max_seq_len=32)
    st = prop.alloc_state()
    h = hidden(rng, cfg, "streams")
    res = prop.propose(st, 2, h, 0, 2, grammar_bitmask=even, return_logits=True)
    for i, t in enumerate(res.tokens):
        assert t == 2 * int(np.argmax(res.logits[i][0::2]))
    prop.after_verify(st, 0)
    assert prop.propose(st, 2, h, 0, 2, grammar_bitmask=np.zeros(words, np.int32)).tokens == [0, 0]


def test_errors_are_typed_and_leave_state_unchanged(ref, rng):
    path, _, cfg = ckpt()
    D, hc, V = cfg["hidden_size"], cfg["hc_mult"], cfg["vocab_size"]
    toks, hs = rng.integers(0, V, 11), hidden(rng, cfg, "streams", 10)
    prop = v4.from_checkpoint(path, ref, max_seq_len=40, max_sequences=1)    # 3 blocks
    st, filler = prop.alloc_state(), prop.alloc_state()
    prop.prefill(st, toks, hs)
    prop.prefill(filler, rng.integers(0, V, 31), hidden(rng, cfg, "single", 30))   # the other 2 blocks
    good = hidden(rng, cfg, "streams")
    before = snapshot(prop, st)
    bad_calls = [
        (InputError, lambda: prop.propose(st, V, good, 10, 2)),                          # token >= vocab
        (InputError, lambda: prop.propose(st, 1, good, 40, 1)),                          # position >= max_seq_len
        (InputError, lambda: prop.propose(st, 1, good, 39, 2)),                          # drafts run past it
        (InputError, lambda: prop.propose(st, 1, np.zeros(D + 1, np.float32), 10, 1)),  # hidden size
        (InputError, lambda: prop.propose(st, 1, np.zeros((hc + 1, D), np.float32), 10, 1)),
        (InputError, lambda: prop.propose(st, 1, np.zeros(D, np.float64), 10, 1)),      # hidden dtype
        (CapacityError, lambda: prop.propose(st, 1, good, 10, 8)),                       # KV pool full
        (InputError, lambda: prop.propose(st, 1, good, 11, 1)),                          # a hole at 10
        (InputError, lambda: prop.prefill(st, [1, V + 3], hidden(rng, cfg, "streams", 1))),
        (InputError, lambda: prop.prefill(st, [1, 2, 3], np.zeros((2, hc + 1, D), np.float32))),
        (CapacityError, lambda: prop.prefill(st, rng.integers(0, V, 25), hidden(rng, cfg, "single", 24))),
        (InputError, lambda: prop.after_verify(st, 1)),                                  # nothing drafted
    ]
    for err, call in bad_calls:
        with pytest.raises(err):
            call()
        assert snapshot(prop, st) == before
    # nothing the failed calls touched shows in the next call: same result as a proposer that never failed
    got = prop.propose(st, 3, good, 10, 2, return_logits=True)
    clean = v4.from_checkpoint(path, ref, max_seq_len=40, max_sequences=1)
    st2 = clean.alloc_state()
    clean.prefill(st2, toks, hs)
    want = clean.propose(st2, 3, good, 10, 2, return_logits=True)
    assert got.tokens == want.tokens and np.array_equal(got.logits, want.logits)


def test_unknown_option_and_wrong_family(ref):
    path, _, _ = ckpt()
    with pytest.raises(ConfigError, match="unknown option"):
        v4.from_checkpoint(path, ref, kv_blocks=4)
    with pytest.raises(ConfigError, match="device_hidden"):
        v4.from_checkpoint(path, ref, device_hidden="both")


def test_load_proposer_dispatches_to_v4(ref):
    path, _, _ = ckpt()
    prop = mtp_cupy.load_proposer(path, gpu=ref, max_seq_len=16)
    assert isinstance(prop, v4.DeepseekV4MtpProposer) and prop.family == "deepseek_v4"
    assert prop.weight_bytes_per_step() > 0


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["streams", "single"])
def test_cuda_matches_ref_backend(form):
    """The same tiny checkpoint on CupyBackend and RefBackend: logits within 1e-2, same drafts unless near-tied."""
    path, _, cfg = ckpt()
    rng = np.random.default_rng(21)
    toks, hs = rng.integers(0, cfg["vocab_size"], 13), hidden(rng, cfg, form, 12)
    h = hidden(rng, cfg, form)
    out = []
    for kind in ("ref", "cuda"):
        prop = v4.from_checkpoint(path, mtp_cupy.device(kind), max_seq_len=64)
        st = prop.alloc_state()
        prop.prefill(st, toks, hs)
        out.append(prop.propose(st, 9, h, 12, 3, return_logits=True))
    (r, c) = out
    for i in range(3):
        assert rel_err(c.logits[i], r.logits[i]) <= TOL
        if r.tokens[:i] == c.tokens[:i] and clear_argmax(r.logits[i], ARGMAX_TIE):
            assert c.tokens[i] == r.tokens[i]
