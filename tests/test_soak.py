"""A random soak of the proposer's state machine on the NumPy device, every family, real draft steps: sequences
join, prefill, propose in batches of random subsets, are verified with ragged accepted counts, catch up, and
leave, with bad calls in between. After every operation: no KV block leaked or shared, every sequence's rows
are exactly the positions this test derives from the calls it made, and the KV contents of every sequence
an operation did not touch are unchanged. CI runs 10^4 operations; `-m slow` runs 10^5."""
import hashlib
import tempfile

import numpy as np
import pytest

import mtp_cupy
from helpers import check_pool
from mtp_cupy.errors import CapacityError, InputError
from mtp_cupy.families import family

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
SEQ, LIVE, K = 64, 6, 3


def kv_digest(prop, st) -> str:
    """A digest of every cache row the sequence holds (all caches of the pool)."""
    h = hashlib.sha256()
    for name, spec in prop.kv.specs.items():
        base = prop.kv.base(name)
        for r in range(st.blocks.rows):
            h.update(prop.gpu.read(base.offset(st.blocks.slot(r) * spec.row_bytes), np.uint8, spec.row_bytes))
    return h.hexdigest()


class Soak:
    def __init__(self, fam: str, rng):
        path = family(fam).write_tiny_checkpoint(tempfile.mkdtemp(prefix=f"soak_{fam}_"), seed=1, **SMALL[fam])
        self.p = mtp_cupy.load_proposer(path, gpu=mtp_cupy.device("ref"), max_seq_len=SEQ, max_batch=4,
                                        max_drafts=K, max_sequences=3)     # 12 blocks for up to 6 sequences
        self.rng, self.live, self.keys, self.digest = rng, [], {}, {}
        self.counts = dict.fromkeys(("join", "leave", "prefill", "propose", "verify", "capacity", "bad"), 0)

    def hid(self, n):
        return self.rng.standard_normal((n, self.p.hidden_size)).astype(np.float32)

    def nxt(self, st) -> int:
        return self.keys[id(st)][-1] + 1 if self.keys[id(st)] else 0

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
        elif op == "prefill" and self.live:
            st = self.live[int(rng.integers(len(self.live)))]
            n, start = int(rng.integers(1, 13)), self.nxt(st)
            if start + n <= SEQ:
                try:
                    p.prefill(st, rng.integers(0, p.vocab_size, n + 1), self.hid(n))
                    self.keys[id(st)] += list(range(start, start + n))
                    touched.add(id(st))
                except CapacityError:
                    self.counts["capacity"] += 1
        elif op == "propose" and self.live:
            B = int(rng.integers(1, min(4, len(self.live)) + 1))
            sts = [self.live[i] for i in rng.choice(len(self.live), B, replace=False) if self.keys[id(self.live[i])]]
            sts = [st for st in sts if st.last_num_drafted == 0]
            k = int(rng.integers(1, K + 1))
            if sts and all(self.nxt(st) + k <= SEQ for st in sts):
                pos = [self.nxt(st) for st in sts]
                try:
                    res = p.propose_batch(sts, rng.integers(0, p.vocab_size, len(sts)), self.hid(len(sts)), pos, k)
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
                   lambda: p.propose(st, 1, self.hid(1)[0], q + 1, 1),                 # a hole
                   lambda: p.propose_batch([st, st], [1, 1], self.hid(2), [q, q], 1),  # a state twice
                   lambda: p.prefill(st, [1, 2], self.hid(2)),                          # hiddens of the wrong count
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
            assert st.keys == self.keys[id(st)] and st.blocks.rows == len(st.keys)
            d = kv_digest(self.p, st) if id(st) in touched or id(st) not in self.digest or self.rng.random() < .1 \
                else None
            if d is not None:
                if id(st) not in touched and id(st) in self.digest:
                    assert d == self.digest[id(st)], "an operation on other sequences changed this one's KV"
                self.digest[id(st)] = d


def soak(rng, ops: int) -> None:
    runs = {fam: Soak(fam, rng) for fam in SMALL}
    for i in range(ops):
        runs[list(SMALL)[i % len(SMALL)]].step()
    for fam, s in runs.items():
        for st in s.live:
            s.p.free_state(st)
        assert s.p.kv.free_count == s.p.pool_blocks, fam
        assert s.counts["propose"] > ops // 40 and s.counts["capacity"] > 0, (fam, s.counts)


def test_soak(rng):
    soak(rng, 10_000)


@pytest.mark.slow
def test_soak_long(rng):
    soak(rng, 100_000)
