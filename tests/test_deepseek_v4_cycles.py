"""DeepSeek-V4 MTP proposer mechanics: prefill == step-by-step rows, and random propose / after_verify /
prefill / free cycles of real draft steps checked against float64 mirrors, keeping the state invariants
(the soak in test_soak.py runs every family's state machine longer)."""
import numpy as np

import helpers
from mtp_cupy.errors import CapacityError
from mtp_cupy.models import deepseek_v4 as v4
from reference.deepseek_v4_ref import V4MtpRef
from test_deepseek_v4 import ARGMAX_TIE, ROUTE_TIE, ckpt, hidden
from helpers import rel_err, check_pool

CYCLES = 300
# logits vs float64 at SMALL's hidden size 64 (fewer terms per sum than the tiny checkpoints' 256): measured
# over 1,700 draft-0 and 1,700 chained drafts, mean 5.8e-3 / 6.7e-3, max 1.2e-2 / 1.5e-2
SMALL_TOL0, SMALL_TOL = 2e-2, 3e-2
SMALL = dict(hidden_size=64, num_attention_heads=2, q_lora_rank=32, o_lora_rank=32, n_routed_experts=4,
             num_experts_per_tok=2, moe_intermediate_size=32, vocab_size=64)


def test_prefill_equals_step_by_step(rng, ref):
    """Rows written by one batched prefill equal rows written one propose(k=1) + after_verify(1) at a time."""
    path, _, cfg = ckpt()
    prop = v4.from_checkpoint(path, ref, max_seq_len=64, max_prefill_rows=7)   # several upload chunks
    toks, hs = rng.integers(0, cfg["vocab_size"], 20), hidden(rng, cfg, "streams", 19)
    a, b = prop.alloc_state(), prop.alloc_state()
    prop.prefill(a, toks, hs)
    for r in range(19):
        prop.propose(b, int(toks[r + 1]), hs[r], r, 1)
        prop.after_verify(b, 1)
    assert a.keys == b.keys == list(range(19)) and a.seq_len == b.seq_len == 19
    h = hidden(rng, cfg, "single")
    ra, rb = (prop.propose(s, 4, h, 19, 3, return_logits=True) for s in (a, b))
    assert ra.tokens == rb.tokens and rel_err(ra.logits, rb.logits) < 1e-3


def test_random_cycles_keep_invariants(ref, rng):
    """Real propose / verify / catch-up / free cycles over four sequences sharing a pool sized for fewer, both
    hidden forms: every draft checked against a float64 mirror of its sequence (check_chain: either side of
    a routing near tie), the rows kept derived from the calls (a verify of a drafts out of k keeps the a
    accepted drafts' rows), exhaustion typed and leaving the state as it was, no block leaked."""
    path, w, cfg = ckpt(seed=7, **SMALL)
    prop = v4.from_checkpoint(path, ref, kv_cache_dtype="bf16", max_seq_len=160, max_drafts=3,  # bf16 mirrors
                              max_sequences=1, max_prefill_rows=8)
    S = 4
    states = [prop.alloc_state() for _ in range(S)]
    mirrors = [V4MtpRef(w, cfg) for _ in range(S)]
    keys, nxt = [[] for _ in range(S)], [0] * S          # the rows each state must hold; its next position
    counts = dict(proposed=0, exhausted=0, freed=0)
    for cycle in range(CYCLES):
        s = int(rng.integers(S))
        st, mirror = states[s], mirrors[s]
        if nxt[s] > 150 or rng.random() < 0.01:
            prop.free_state(st)
            states[s], mirrors[s], keys[s], nxt[s] = prop.alloc_state(), V4MtpRef(w, cfg), [], 0
            counts["freed"] += 1
            continue
        form = "streams" if rng.random() < 0.5 else "single"
        k = int(rng.integers(1, 4))
        before = (list(st.keys), st.blocks.rows, list(st.blocks.table))
        try:
            if nxt[s] > len(keys[s]) or not keys[s]:          # catch up the rows the drafter lacks
                n = max(nxt[s] - len(keys[s]), 1)
                toks, hs = rng.integers(0, 64, n + 1), hidden(rng, cfg, form, n)
                prop.prefill(st, toks, hs, start_position=len(keys[s]))
                for r in range(n):
                    mirror.write_row(int(toks[r + 1]), hs[r].astype(np.float64), len(keys[s]) + r)
                keys[s] += list(range(len(keys[s]), len(keys[s]) + n))
                nxt[s] = len(keys[s])
                assert st.keys == keys[s]
            tok, h = int(rng.integers(64)), hidden(rng, cfg, form)
            before = (list(st.keys), st.blocks.rows, list(st.blocks.table))
            res = prop.propose(st, tok, h, nxt[s], k, return_logits=True)
        except CapacityError:                                   # the loop evicts the sequence
            assert (list(st.keys), st.blocks.rows, list(st.blocks.table)) == before
            del mirror.rows[len(st.keys):]
            counts["exhausted"] += 1
            check_pool(prop, states)
            prop.free_state(st)
            states[s], mirrors[s], keys[s], nxt[s] = prop.alloc_state(), V4MtpRef(w, cfg), [], 0
            continue
        helpers.check_chain(res, mirror, tok, h, nxt[s], SMALL_TOL0, SMALL_TOL, f"cycle {cycle}", ROUTE_TIE, ARGMAX_TIE)
        a = int(rng.integers(0, k + 1))
        prop.after_verify(st, a)
        keys[s] += list(range(nxt[s], nxt[s] + a))               # E: the rejected rows go
        mirror.truncate(len(keys[s]))
        assert st.keys == keys[s] and [p for p, _ in mirror.rows] == keys[s], (cycle, k, a)
        nxt[s] += a + 1                                          # the next row needs a catch-up row first
        counts["proposed"] += 1
        check_pool(prop, states)
    for st in states:
        prop.free_state(st)
    assert prop.kv.free_count == prop.pool_blocks
    print(counts)
    assert counts["exhausted"] > 0 and counts["proposed"] > CYCLES // 2, counts
