"""DeepSeek-V4 MTP proposer mechanics: prefill == step-by-step rows, and thousands of random
propose / after_verify / prefill / free cycles keeping the state invariants."""
import time

import numpy as np

from mtp_cupy.errors import CapacityError
from mtp_cupy.models import deepseek_v4 as v4
from mtp_cupy.weights.config import load_config
from test_deepseek_v4 import ckpt, hidden
from helpers import rel_err, check_pool

CYCLES = 5000
REAL_EVERY = 25   # every 25th cycle runs the whole forward on the NumPy device; the rest a stub (see below)
SMALL = dict(hidden_size=64, num_attention_heads=2, q_lora_rank=32, o_lora_rank=32, n_routed_experts=4,
             num_experts_per_tok=2, moe_intermediate_size=32, vocab_size=64)


def test_prefill_equals_step_by_step(ref):
    """Rows written by one batched prefill equal rows written one propose(k=1) + after_verify(1) at a time."""
    path, _, cfg = ckpt()
    prop = v4.from_checkpoint(path, ref, max_seq_len=64, max_prefill_rows=7)   # several upload chunks
    rng = np.random.default_rng(0)
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


class StubbedSteps(v4.DeepseekV4MtpProposer):
    """The proposer with its math replaced by random logits unless `real`: the state machine (reserve, metadata
    slabs, argmax picks, trims, rollbacks) is the real one, at a cost that lets 5,000 cycles run in seconds."""
    real = False
    rng = np.random.default_rng(0)

    def _forward(self, ids, hidden, m, meta, meta_stride, logits):
        if self.real:
            return super()._forward(ids, hidden, m, meta, meta_stride, logits)
        self.gpu.copy_h2d(logits, self.rng.standard_normal((m, self.vocab_eff)).astype(np.float32))

    def _write_rows(self, st, tokens_dev, hiddens, positions, slots, row_base, n):
        if self.real:
            super()._write_rows(st, tokens_dev, hiddens, positions, slots, row_base, n)


def test_random_cycles_keep_invariants(ref, rng):
    """5,000 cycles over four sequences with prefill, catch-up, frees, both hidden forms and pool exhaustion:
    no block leaks, rows == positions written, keys increasing, tables sized to rows."""
    path, _, cfg = ckpt(seed=7, **SMALL)
    c = load_config(path)
    prop = StubbedSteps(ref, c, v4.load_deepseek_v4(ref, path, c), max_seq_len=160, max_drafts=3, max_sequences=1,
                        max_prefill_rows=8, drafter_context=False)
    states = [prop.alloc_state() for _ in range(4)]
    nxt = [0] * 4
    t0, cycles, exhausted, real = time.perf_counter(), 0, 0, 0

    while cycles < CYCLES:
        s = int(rng.integers(4))
        st = states[s]
        if nxt[s] > 150 or rng.random() < 0.002:
            prop.free_state(st)
            states[s], nxt[s] = prop.alloc_state(), 0
            continue
        prop.real = cycles % REAL_EVERY == 0
        form = "streams" if rng.random() < 0.5 else "single"
        k = int(rng.integers(1, 4))
        try:
            last = st.keys[-1] + 1 if st.keys else 0
            if nxt[s] > last and rng.random() < 0.5:                 # catch up the rows the drafter lacks
                n = nxt[s] - last
                prop.prefill(st, rng.integers(0, 64, n + 1), hidden(rng, cfg, form, n), start_position=last)
            r = prop.propose(st, int(rng.integers(64)), hidden(rng, cfg, form), nxt[s], k, return_logits=prop.real)
            assert len(r.tokens) == k and all(0 <= t < 64 for t in r.tokens)
            if prop.real:
                real += 1
                assert np.all(np.isfinite(r.logits))
            a = int(rng.integers(0, k + 1))
            prop.after_verify(st, a)
            nxt[s] += a + 1
        except CapacityError:                                       # the loop evicts the sequence
            exhausted += 1
            check_pool(prop, states)
            prop.free_state(st)
            states[s], nxt[s] = prop.alloc_state(), 0
        cycles += 1
        check_pool(prop, states)
    for st in states:
        prop.free_state(st)
    assert prop.kv.free_count == prop.pool_blocks
    assert time.perf_counter() - t0 < 60
    assert exhausted > 0 and real > 100   # the pool ran dry at times, and real steps ran among the stubs
