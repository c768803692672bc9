"""DeepSeek-V3 MTP proposer invariants over 5,000 random propose / after_verify cycles on several sequences
sharing one KV pool (sized for fewer sequences than are live, so exhaustion happens): no block leaks, the
row count always equals the keys, blocks are never shared, failed calls change nothing."""
import numpy as np
import pytest

import mtp_cupy
from mtp_cupy.cache import PagedKvCache
from mtp_cupy.errors import CapacityError, InputError
from mtp_cupy.models import deepseek_v3 as deepseek_mtp
from deepseek_util import tiny_ckpt

CYCLES, SEQ, LIVE = 5000, 64, 3
SMALL = dict(hidden_size=64, num_attention_heads=2, q_lora_rank=32, n_routed_experts=8, n_group=4, topk_group=2,
             num_experts_per_tok=2, moe_intermediate_size=32, vocab_size=128)


def check(prop, states) -> None:
    kv, seen = prop.kv, []
    for st in states:
        assert st.seq_len == len(st.keys) == st.blocks.rows
        assert all(b > a for a, b in zip(st.keys, st.keys[1:]))
        assert len(st.blocks.table) == PagedKvCache.blocks_for(st.seq_len)
        seen += st.blocks.table
    assert len(set(seen)) == len(seen), "a block is in two tables"
    assert kv.free_count + len(seen) == prop.pool_blocks, "a block leaked"


def snap(st):
    return st.blocks.rows, list(st.keys), list(st.blocks.table), st.last_num_drafted


@pytest.mark.slow
def test_random_cycles_keep_invariants(rng):
    prop = deepseek_mtp.from_checkpoint(tiny_ckpt("bf16", seed=9, **SMALL), mtp_cupy.device("ref"), max_seq_len=SEQ,
                                        max_sequences=1, max_drafts=3, max_prefill_rows=8, drafter_context=False)
    D, V, start_free = prop.hidden_size, prop.vocab_size, prop.kv.free_count
    states = [prop.alloc_state() for _ in range(LIVE)]
    hidden = lambda: rng.standard_normal(D).astype(np.float32)   # noqa: E731
    counts = dict(proposed=0, capacity=0, past_end=0, reset=0)
    for _ in range(CYCLES):
        st = states[int(rng.integers(LIVE))]
        nxt = st.keys[-1] + 1 if st.keys else 0
        if rng.random() < 0.05 and nxt + 4 <= SEQ:      # catch-up rows from the target
            n = int(rng.integers(1, 5))
            before = snap(st)
            try:
                assert prop.prefill(st, rng.integers(0, V, n + 1), rng.standard_normal((n, D)).astype(np.float32)) == n
            except CapacityError:
                assert snap(st) == before
                counts["capacity"] += 1
        pos, k = nxt + int(rng.integers(0, 3)), int(rng.integers(1, 4))
        before = snap(st)
        try:
            res = prop.propose(st, int(rng.integers(V)), hidden(), pos, k)
        except (CapacityError, InputError) as e:
            assert snap(st) == before
            counts["capacity" if isinstance(e, CapacityError) else "past_end"] += 1
            prop.free_state(st)
            states[states.index(st)] = st = prop.alloc_state()
            counts["reset"] += 1
        else:
            assert len(res.tokens) == k and all(0 <= t < V for t in res.tokens)
            assert st.keys[-k:] == list(range(pos, pos + k))
            with pytest.raises(InputError):                  # a bad call in between changes nothing
                prop.propose(st, V, hidden(), pos + k, 1)
            prop.after_verify(st, int(rng.integers(0, k + 1)))
            counts["proposed"] += 1
        if rng.random() < 0.01:
            prop.free_state(st)
            states[states.index(st)] = prop.alloc_state()
        check(prop, states)
    for st in states:
        prop.free_state(st)
    assert prop.kv.free_count == start_free
    print(counts)
    assert counts["proposed"] > CYCLES // 2 and counts["capacity"] > 0 and counts["past_end"] > 0, counts
