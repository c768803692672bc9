"""A random soak of the proposer's state machine on the NumPy device, every family, real draft steps: sequences
join, prefill, propose in batches of random subsets, are verified with ragged accepted counts, catch up, and
leave, with bad calls in between. After every operation: no KV block leaked or shared, every sequence's rows
are exactly the positions this test derives from the calls it made, and the KV contents of every sequence
an operation did not touch are unchanged. Batches run up to 8 sequences, so both the per-sequence path and the
array path (ARRAY_MIN_BATCH and more) of the batch calls are driven; each family also runs loaded without
drafter context, where positions may skip ahead (runs of positions start and are trimmed away). Rows are
written one sequence at a time (prefill) and for several at once (prefill_batch). CI runs 10^4
operations; `-m slow` runs 10^5."""
import tempfile

import numpy as np
import pytest

import mtp_cupy
from batch_util import rows_digest
from helpers import check_pool
from mtp_cupy.errors import CapacityError, InputError
from mtp_cupy.families import family
from mtp_cupy.cache.paged import ROWS
from mtp_cupy.speculative.batch_inputs import ARRAY_MIN_BATCH
from mtp_cupy.speculative.proposer import OFF

SMALL = {
    "deepseek_v3": dict(hidden_size=64, num_attention_heads=2, n_routed_experts=4, num_experts_per_tok=2, n_group=2,
                        topk_group=1, moe_intermediate_size=32, vocab_size=128),
    "deepseek_v4": dict(hidden_size=64, num_attention_heads=2, q_lora_rank=32, o_lora_rank=32, n_routed_experts=4,
                        num_experts_per_tok=2, moe_intermediate_size=32, vocab_size=64),
    "qwen3_next": dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=64, num_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                       vocab_size=64),
    "glm5": dict(hidden_size=64, num_attention_heads=2, n_routed_experts=4, num_experts_per_tok=2,
                 moe_intermediate_size=32, vocab_size=128),
}
SEQ, LIVE, K, BATCH = 64, 10, 3, 8


class Soak:
    def __init__(self, fam: str, rng, holes: bool = False):
        path = family(fam).write_tiny_checkpoint(tempfile.mkdtemp(prefix=f"soak_{fam}_"), seed=1, **SMALL[fam])
        self.p = mtp_cupy.load_proposer(path, gpu=mtp_cupy.device("ref"), max_seq_len=SEQ, max_batch=BATCH,
                                        max_drafts=K, max_sequences=5,     # 20 blocks for up to 10 sequences
                                        drafter_context=not holes,
                                        # the bookkeeping compiled or in NumPy (test_batch_host: alike)
                                        host_path=("auto", "numpy")[int(rng.integers(2))])
        self.holes = holes
        self.rng, self.live, self.keys, self.digest = rng, [], {}, {}
        self.wide = self.runs = 0   # batches on the array path; checks of a state holding several runs
        self.counts = dict.fromkeys(("join", "leave", "prefill", "propose", "verify", "capacity", "bad"), 0)

    def hid(self, n):
        return self.rng.standard_normal((n, self.p.hidden_size)).astype(np.float32)

    def nxt(self, st) -> int:
        return self.keys[id(st)][-1] + 1 if self.keys[id(st)] else 0

    def at(self, st) -> int:
        """The position the next rows take: the next one, or without drafter context sometimes a later one."""
        gap = int(self.rng.integers(1, 4)) if self.holes and self.rng.random() < 0.3 else 0
        return self.nxt(st) + gap

    def step(self) -> None:
        p, rng = self.p, self.rng
        op = rng.choice(["join", "leave", "prefill", "propose", "verify", "bad"], p=[.08, .03, .22, .37, .2, .1])
        touched = set()
        if op == "join" and len(self.live) < LIVE:
            st = p.alloc_state()
            self.live.append(st)
            self.keys[id(st)] = []
        elif op == "leave" and self.live:
            st = self.live.pop(int(rng.integers(len(self.live))))
            p.free_state(st)
            p.free_state(st)                       # idempotent
            del self.keys[id(st)], self.digest[id(st)]
        elif op == "prefill" and self.live and rng.random() < 0.4:   # several sequences' rows in one pass
            sts = [self.live[i] for i in rng.choice(len(self.live), int(rng.integers(1, len(self.live) + 1)),
                                                     replace=False)]
            n = [int(x) for x in rng.integers(0, 4, len(sts))]
            starts = [self.at(st) for st in sts]
            if all(q + m <= SEQ for q, m in zip(starts, n)):
                try:
                    p.prefill_batch(sts, rng.integers(0, p.vocab_size, sum(n)), self.hid(sum(n)), n, starts)
                    for st, q, m in zip(sts, starts, n):
                        self.keys[id(st)] += list(range(q, q + m))
                        touched.add(id(st))
                except CapacityError:
                    self.counts["capacity"] += 1
        elif op == "prefill" and self.live:
            st = self.live[int(rng.integers(len(self.live)))]
            n, start = int(rng.integers(1, 13)), self.at(st)
            if start + n <= SEQ:
                try:
                    p.prefill(st, rng.integers(0, p.vocab_size, n + 1), self.hid(n), start_position=start)
                    self.keys[id(st)] += list(range(start, start + n))
                    touched.add(id(st))
                except CapacityError:
                    self.counts["capacity"] += 1
        elif op == "propose" and self.live:
            most = min(BATCH, len(self.live))
            B = most if rng.random() < 0.5 else int(rng.integers(1, most + 1))   # wide batches half the time
            sts = [self.live[i] for i in rng.choice(len(self.live), B, replace=False)   # empty ones now and then
                   if self.keys[id(self.live[i])] or rng.random() < 0.3]
            sts = [st for st in sts if st.last_num_drafted == 0]
            k = int(rng.integers(1, K + 1))
            pos = [self.at(st) for st in sts]
            if sts and all(q + k <= SEQ for q in pos):
                try:
                    nxt = all(q == self.nxt(st) for st, q in zip(sts, pos))   # then positions may be left out
                    res = p.propose_batch(sts, rng.integers(0, p.vocab_size, len(sts)), self.hid(len(sts)),
                                          None if nxt and rng.random() < 0.3 else pos, k)
                    self.wide += len(sts) >= ARRAY_MIN_BATCH
                    for st, r, q in zip(sts, res, pos):
                        assert len(r.tokens) == k and all(0 <= t < p.vocab_size for t in r.tokens)
                        self.keys[id(st)] += list(range(q, q + k))
                        touched.add(id(st))
                except CapacityError:
                    self.counts["capacity"] += 1
        elif op == "verify":
            drafted = [st for st in self.live if st.last_num_drafted]
            ks = [st.last_num_drafted for st in drafted]
            accs = [int(rng.integers(0, k + 1)) for k in ks]
            if drafted and rng.random() < 0.5:      # the batch call, or one call per sequence
                p.after_verify_batch(drafted, accs)
                self.wide += len(drafted) >= ARRAY_MIN_BATCH
            else:
                for st, a in zip(drafted, accs):
                    p.after_verify(st, a)
            for st, k, a in zip(drafted, ks, accs):
                del self.keys[id(st)][len(self.keys[id(st)]) - (k - a):]
                touched.add(id(st))
        elif op == "bad" and self.live:
            st = self.live[int(rng.integers(len(self.live)))]
            q = self.nxt(st)
            bad = [lambda: p.propose(st, p.vocab_size, self.hid(1)[0], q, 1),          # token out of range
                   lambda: p.propose(st, 1, self.hid(1)[0], q + (-1 if self.holes else 1), 1),  # a hole / overlap
                   lambda: p.propose_batch([st, st], [1, 1], self.hid(2), [q, q], 1),  # a state twice
                   lambda: p.prefill(st, [1, 2], self.hid(2)),                          # hiddens of the wrong count
                   lambda: p.prefill_batch([st], [1], self.hid(1), [1], [q + (-1 if self.holes else 1)]),
                   lambda: p.after_verify(st, st.last_num_drafted + 1)]
            with pytest.raises(InputError):
                bad[int(rng.integers(len(bad)))]()
        else:
            return
        self.counts[op] += 1
        self.check(touched)

    def check(self, touched) -> None:
        check_pool(self.p, self.live)
        for st in self.live:
            keys = self.keys[id(st)]
            assert st.keys == keys and st.blocks.rows == len(keys)
            assert st.newest_position == (keys[-1] if keys else -1) and st.next_position == self.nxt(st)
            c = self.p.kv._cols[st.blocks.row]      # the mirror the wide calls check with says the same
            assert c[OFF] + c[ROWS] == self.nxt(st) and c[ROWS] == len(keys), (c, keys)
            self.runs += len(st.runs) > 1
            d = rows_digest(self.p, st) if id(st) in touched or id(st) not in self.digest or self.rng.random() < .1 \
                else None
            if d is not None:
                if id(st) not in touched and id(st) in self.digest:
                    assert d == self.digest[id(st)], "an operation on other sequences changed this one's KV"
                self.digest[id(st)] = d


def soak(rng, ops: int) -> None:
    runs = [Soak(fam, rng, holes) for fam in SMALL for holes in (False, True)]
    for i in range(ops):
        runs[i % len(runs)].step()
    for s in runs:
        for st in s.live:
            s.p.free_state(st)
        what = (s.p.family, s.holes, s.p.options.host_path, s.counts)
        assert s.p.kv.free_count == s.p.pool_blocks, what
        assert s.counts["propose"] > ops // 80 and s.counts["capacity"] > 0 and s.wide > 0, what
        assert not s.holes or s.runs > 0, what


def test_soak(rng):
    soak(rng, 10_000)


@pytest.mark.slow
def test_soak_long(rng):
    soak(rng, 100_000)
