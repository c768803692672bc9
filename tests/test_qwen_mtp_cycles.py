"""Qwen3-Next MTP proposer mechanics on the NumPy device: prefill == step-by-step rows, batched == unbatched,
catch-up / refeed RoPE positions, the confidence stop, and thousands of random propose/verify cycles."""
import numpy as np
import pytest

import mtp_cupy
from mtp_cupy.errors import CapacityError
from mtp_cupy.models import qwen3_next as qwen_mtp
from mtp_cupy.runtime.dtypes import bf16_round
from qwen_util import check_chain, ref_weights, rel, tiny_ckpt
from reference.qwen_ref import QwenMtpRef
from helpers import check_pool, write_rows

D, V = 256, 512
CYCLES = 5000


def _load(quant="bf16", **kw):
    return qwen_mtp.from_checkpoint(tiny_ckpt(quant), mtp_cupy.device("ref"), max_seq_len=256, **kw)


def _seq(rng, n, d=D, v=V):
    return rng.integers(0, v, n + 1), bf16_round(rng.standard_normal((n, d)))


def test_prefill_equals_step_by_step(rng):
    prop = _load("bf16", quantization="nvfp4")
    toks, hs = _seq(rng, 21)
    a, b = prop.alloc_state(), prop.alloc_state()
    prop.prefill(a, toks, hs)
    for r in range(21):                      # one row per propose, kept by after_verify(1)
        prop.propose(b, toks[r + 1], hs[r], r, 1)
        prop.after_verify(b, 1)
    assert a.keys == b.keys == list(range(21)) and a.seq_len == b.seq_len == 21
    tok, h = int(rng.integers(V)), bf16_round(rng.standard_normal(D))
    ra, rb = (prop.propose(s, tok, h, 21, 3, return_logits=True) for s in (a, b))
    assert ra.tokens == rb.tokens
    assert rel(ra.logits, rb.logits) < 1e-3


@pytest.mark.parametrize("mode", ["plain", "confidence", "grammar"])
def test_batched_equals_unbatched(rng, mode):
    prop = _load("bf16", quantization="fp8", max_batch=8, drafter_context=False)
    lens = [5, 17, 32, 33]
    A, B = [prop.alloc_state() for _ in lens], [prop.alloc_state() for _ in lens]
    for n, a, b in zip(lens, A, B):
        toks, hs = _seq(rng, n)
        prop.prefill(a, toks, hs)
        prop.prefill(b, toks, hs)
    pos = list(lens)
    for rnd in range(2):
        toks, hs = rng.integers(0, V, 4), bf16_round(rng.standard_normal((4, D)))
        kw = {}
        if mode == "confidence":     # a threshold that stops some sequences part way
            probe = [prop.propose(s, t, h, p, 4, min_logprob=-np.inf) for s, t, h, p in zip(B, toks, hs, pos)]
            for s in B:
                prop.after_verify(s, 0)
            kw["min_logprob"] = float(np.median([lp for r in probe for lp in r.logprobs]))
        masks = None
        if mode == "grammar":        # sequence 1 may only draft even ids; sequence 2 nothing (pad 0)
            words = (V + 31) // 32
            even = np.full(words, 0x55555555, dtype=np.uint32).view(np.int32)
            masks = [None, even, np.zeros(words, np.int32), None]
        got = prop.propose_batch(A, toks, hs, pos, 4, grammar_bitmasks=masks, return_logits=True, **kw)
        for s in range(4):
            want = prop.propose(B[s], toks[s], hs[s], pos[s], 4, return_logits=True,
                                grammar_bitmask=None if masks is None else masks[s], **kw)
            assert got[s].tokens == want.tokens, (rnd, s)
            # not bit-equal on the twins: the MoE twin multiplies all rows that share an expert in one f32
            # product, so a row's last bits depend on its batch mates (the GPU kernels differ likewise)
            fin = np.isfinite(want.logits)
            assert rel(got[s].logits[fin], want.logits[fin]) < 1e-2
            assert got[s].logprobs == pytest.approx(want.logprobs) if want.logprobs else got[s].logprobs is None
            assert (A[s].keys, A[s].blocks.rows, A[s].last_num_drafted) == \
                (B[s].keys, B[s].blocks.rows, B[s].last_num_drafted)
        if mode == "grammar":
            assert all(t % 2 == 0 for t in got[1].tokens) and got[2].tokens == [0] * 4
        for s in range(4):
            acc = int(rng.integers(0, len(got[s].tokens) + 1))
            prop.after_verify(A[s], acc)
            prop.after_verify(B[s], acc)
            pos[s] += acc + 1
    used = sum(len(s.blocks.table) for s in A + B)
    assert prop.kv.free_count + used == prop.pool_blocks


@pytest.mark.parametrize("refeed", [False, True])
def test_catch_up_keeps_rope_positions(rng, refeed):
    """Mirror every row on the float64 reference (the position each row was written at), including the
    rows after_verify trims and the catch-up rows the caller re-feeds from the target's hiddens; every draft
    checked against it (check_chain: either side of a routing near tie)."""
    prop = _load("bf16", refeed_accepted=refeed)
    ref = QwenMtpRef(ref_weights(tiny_ckpt("bf16")), prop.cfg.raw)
    toks, hs = _seq(rng, 30)
    st = prop.alloc_state()
    prop.prefill(st, toks, hs)
    write_rows([ref], toks, hs, 30)
    p = 30
    for rnd in range(4):
        tok, h = int(rng.integers(V)), bf16_round(rng.standard_normal(D))
        res = prop.propose(st, tok, h, p, 3, return_logits=True)
        check_chain(res, ref, tok, h, p, 1.2e-2, 2e-2, f"refeed={refeed} round {rnd}")
        acc = int(rng.integers(0, 4))
        prop.after_verify(st, acc)
        keep = st.seq_len
        assert keep == (p + (1 if refeed else acc) if acc else p)
        ref.truncate(keep)
        assert st.keys == list(range(keep)) and st.last_pair_key == keep - 1
        # the next row is at p + acc + 1; re-feed the rows the drafter lacks before it from the target's hiddens
        n = p + acc + 1 - keep
        if n:
            ct, ch = _seq(rng, n)
            prop.prefill(st, ct, ch, start_position=keep)
            for r in range(n):
                ref.write_row(ct[r + 1], ch[r], keep + r)
        p = p + acc + 1   # the next row pairs the target's hidden at p + acc with its bonus token


def test_confidence_stop(rng):
    prop = _load("bf16")
    toks, hs = _seq(rng, 12)
    st = prop.alloc_state()
    prop.prefill(st, toks, hs)
    tok, h = int(rng.integers(V)), bf16_round(rng.standard_normal(D))
    full = prop.propose(st, tok, h, 12, 6, min_logprob=-np.inf)
    assert len(full.tokens) == 6 and len(full.logprobs) == 6 and all(lp <= 0 for lp in full.logprobs)
    prop.after_verify(st, 0)
    thr = sorted(full.logprobs[:5])[2]
    stop = next(i for i, lp in enumerate(full.logprobs) if lp < thr) + 1
    res = prop.propose(st, tok, h, 12, 6, min_logprob=thr)
    assert res.tokens == full.tokens[:stop] and st.seq_len == 12 + stop and st.last_num_drafted == stop
    prop.after_verify(st, 0)
    res = prop.propose(st, tok, h, 12, 6, min_logprob=1.0)        # every draft is below: stop after one
    assert len(res.tokens) == 1 and st.seq_len == 13


def test_random_cycles_keep_invariants(rng):
    """5,000 propose / after_verify cycles over four sequences with prefill, catch-up, frees and pool
    exhaustion: no block leaks, rows == positions written, keys increasing, tables sized to rows."""
    dims = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=64, num_experts=4,
                num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32, vocab_size=64)
    prop = qwen_mtp.from_checkpoint(tiny_ckpt("bf16", **dims), mtp_cupy.device("ref"), max_seq_len=160,
                                    max_drafts=2, max_batch=4, max_sequences=1, refeed_accepted=True,
                                    drafter_context=False)
    states = [prop.alloc_state() for _ in range(4)]
    nxt = [0] * 4
    cycles, exhausted = 0, 0

    while cycles < CYCLES:
        s = int(rng.integers(4))
        st = states[s]
        if nxt[s] > 150 or rng.random() < 0.002:
            prop.free_state(st)
            states[s], nxt[s] = prop.alloc_state(), 0
            continue
        k = int(rng.integers(1, 3))
        try:
            last = st.keys[-1] + 1 if st.keys else 0
            if nxt[s] > last and rng.random() < 0.5:                 # catch up the rows the drafter lacks
                toks, hs = _seq(rng, nxt[s] - last, 64, 64)
                prop.prefill(st, toks, hs, start_position=last)
            if rng.random() < 0.2 and s < 3:                        # two sequences in one batched call
                pair = [states[s], states[s + 1]]
                ps = [nxt[s], nxt[s + 1]]
                out = prop.propose_batch(pair, rng.integers(0, 64, 2), bf16_round(rng.standard_normal((2, 64))),
                                         ps, k)
                for j, (st2, r) in enumerate(zip(pair, out)):
                    a = int(rng.integers(0, len(r.tokens) + 1))
                    prop.after_verify(st2, a)
                    nxt[s + j] += a + 1
            else:
                r = prop.propose(st, int(rng.integers(64)), bf16_round(rng.standard_normal(64)), nxt[s], k)
                a = int(rng.integers(0, len(r.tokens) + 1))
                prop.after_verify(st, a)
                nxt[s] += a + 1
        except CapacityError:
            exhausted += 1
        cycles += 1
        check_pool(prop, states)
    assert exhausted > 0   # the pool ran dry at times and nothing leaked
