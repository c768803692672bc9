"""Shared by the batched-drafting tests (CPU and GPU): a tiny checkpoint per family, B sequences of ragged lengths
prefilled alike into several proposers, and one verify round (ragged accepted counts, then the catch-up row of
the last accepted token, from the 'target')."""
from __future__ import annotations

import hashlib
import tempfile

import numpy as np

from helpers import check_pool
from mtp_cupy.families import family
from mtp_cupy.runtime.dtypes import BF16, bf16_round
from mtp_cupy.runtime.slab import SEQ_LEN_OFFSET

FAMILIES = ["deepseek_v3", "deepseek_v4", "qwen3_next", "glm5"]
_CKPTS: dict = {}


def ckpt(fam: str, seed: int = 3):
    key = (fam, seed)
    if key not in _CKPTS:
        _CKPTS[key] = family(fam).write_tiny_checkpoint(tempfile.mkdtemp(prefix=f"batch_{fam}_"), seed=seed)
    return _CKPTS[key]


def hidden(rng, prop, n: int | None = None, streams: bool = False) -> np.ndarray:
    """bf16-exact hiddens: [n, D] (or [n, hc, D] for V4 streams)."""
    shape = (prop.hc, prop.hidden_size) if streams else (prop.hidden_size,)
    return bf16_round(rng.standard_normal(shape if n is None else (n, *shape)))


def prefill_alike(rng, props, lens, streams: bool = False) -> list[list]:
    """B sequences of lengths `lens` prefilled with the same rows into every proposer: states[p][s] (a length
    of 0 leaves its sequence empty)."""
    states = [[p.alloc_state() for _ in lens] for p in props]
    for s, n in enumerate(lens):
        if not n:
            continue
        toks, hs = rng.integers(0, props[0].vocab_size, n + 1), hidden(rng, props[0], n, streams)
        for p, sts in zip(props, states):
            p.prefill(sts[s], toks, hs)
    return states


def verify_round(rng, props, states, results, streams: bool = False) -> tuple[list[int], list[int]]:
    """Accept a random prefix of each sequence's drafts (the same in every proposer), add the catch-up row at
    the last accepted position, and return the next (positions, tokens). The kept rows are derived from what
    was proposed and accepted, not read from the proposer."""
    V = props[0].vocab_size
    nxt, toks = [], []
    for s, res in enumerate(results):
        a = int(rng.integers(0, len(res.tokens) + 1))
        expect = states[0][s].keys[:len(states[0][s].keys) - len(res.tokens)] + \
            list(range(states[0][s].keys[-len(res.tokens)], states[0][s].keys[-len(res.tokens)] + a))
        row, t = hidden(rng, props[0], 1, streams), rng.integers(0, V, 2)
        for p, sts in zip(props, states):
            p.after_verify(sts[s], a)
            assert sts[s].keys == expect, (s, a)
            p.prefill(sts[s], t, row)          # the row of the last accepted token, from the target
        nxt.append(expect[-1] + 2 if expect else 1)
        toks.append(int(rng.integers(0, V)))
    return nxt, toks


def watch_ties(prop) -> list[np.ndarray]:
    """Record, for every draft step the proposer runs from now on, each row's selection margins on the NumPy
    device: the routing gap (the last chosen expert's selection key minus the best unchosen one's, from the
    router logits the step computed) and, for GLM-5, the indexer's top-k gap. A step whose margin is near zero
    may legitimately choose otherwise on another device. Returns the list the margins [m] are appended to; the
    rows each step's slab says a sequence holds are appended to `margins.rows` alike (the indexer's gap is over
    exactly those rows: step i of a propose reads its own slab, not step 0's)."""
    moe = getattr(prop, "moe", None) or prop.ffn
    c, gpu, margins, step = moe.cfg, prop.gpu, _Margins(), {}
    bias = gpu.read(moe.bias, np.float32, c.n_experts).astype(np.float64) if int(moe.bias) else 0.0
    fwd, step_fwd = moe.forward, prop._forward

    def step_forward(ids, hidden, m, meta, meta_stride, logits):
        step["meta"], step["stride"] = meta, meta_stride
        return step_fwd(ids, hidden, m, meta, meta_stride, logits)

    def forward(x, out, m=1, **kw):
        fwd(x, out, m=m, **kw)
        z = gpu.read(moe.logits, np.float32, (m, c.n_experts)).astype(np.float64)
        key = {"softmax": lambda: z, "sigmoid_grouped": lambda: 1 / (1 + np.exp(-z)) + bias,
               "sqrtsoftplus": lambda: np.sqrt(np.logaddexp(0, z)) + bias}[c.routing]()
        gap = np.full(m, np.inf)
        if c.routing == "sigmoid_grouped" and c.n_group > 1:    # the group limit is a choice of its own
            grp = -np.sort(-key.reshape(m, c.n_group, -1), axis=2)[:, :, :2].sum(2)       # [m, n_group]
            order = np.argsort(-grp, axis=1, kind="stable")
            g_sorted = np.take_along_axis(grp, order, 1)
            gap = g_sorted[:, c.topk_group - 1] - g_sorted[:, c.topk_group]
            keep = np.zeros((m, c.n_group), bool)
            np.put_along_axis(keep, order[:, :c.topk_group], True, 1)
            key = np.where(np.repeat(keep, c.n_experts // c.n_group, 1), key, -np.inf)
        srt = -np.sort(-key, axis=1)
        gap = np.minimum(gap, srt[:, c.top_k - 1] - srt[:, c.top_k])
        rows = np.array([int(gpu.read(step["meta"].offset(r * step["stride"] + SEQ_LEN_OFFSET), np.int32, 1)[0])
                         for r in range(m)])   # this step's slab: the rows each sequence holds now
        if hasattr(prop, "indexer"):
            ix = prop.indexer
            sc = gpu.read(ix.ptr["scores"], np.float32, (m, ix.score_stride)).astype(np.float64)
            for r in range(m):
                row = np.sort(sc[r, :rows[r]])[::-1]
                if row.size > ix.d.topk:
                    gap[r] = min(gap[r], row[ix.d.topk - 1] - row[ix.d.topk])
        margins.append(gap)
        margins.rows.append(rows)
    moe.forward, prop._forward = forward, step_forward
    return margins


class _Margins(list):
    """watch_ties' record: the margins per step, and `rows`, the rows per sequence each step's slab held."""

    def __init__(self):
        super().__init__()
        self.rows: list[np.ndarray] = []

    def clear(self) -> None:
        super().clear()
        self.rows.clear()


def rows_digest(prop, st) -> str:
    """A digest of every cache row the sequence holds (all caches of the pool), in row order, read through its own
    slots (two proposers may give a sequence different blocks)."""
    h = hashlib.sha256()
    for name, spec in prop.kv.specs.items():
        base = prop.kv.base(name)
        for r in range(st.blocks.rows):
            h.update(prop.gpu.read(base.offset(st.blocks.slot(r) * spec.row_bytes), np.uint8, spec.row_bytes))
    return h.hexdigest()


def graphed_catch_up_loop(rng, gpu, g, e, fam: str) -> None:
    """A serving loop (propose_batch, after_verify_batch, the catch-up from device hiddens) through a graphed
    proposer `g` and an eager one `e` of one checkpoint: `g` replays one graph per catch-up row count (the stage
    read in, the hiddens fetched to a fixed buffer, the row writes) and holds e's rows and drafts, call after
    call, as the batch shrinks and grows back; device hiddens aligned and 2 bytes off 16-byte alignment."""
    streams = fam == "deepseek_v4"   # V4's device hiddens are the target's [hc, D] streams by default
    lens = [int(n) for n in rng.integers(2, 30, 5)]
    sg, se = prefill_alike(rng, (g, e), lens, streams)
    pos, toks = list(lens), [int(t) for t in rng.integers(0, g.vocab_size, 5)]
    for call, B in enumerate([5, 5, 5, 4, 4, 5]):   # rows graphs: warm, capture, replay; 4 likewise after
        live_g, live_e = sg[:B], se[:B]
        hs = hidden(rng, g, B, streams)
        if call:   # a device pointer: the graph's first kernel fetches it (a copy call at odd calls: 2 bytes off)
            hd = gpu.upload(np.concatenate([np.zeros(call % 2, BF16), hs.astype(BF16).reshape(-1)]))
            hs = hd.ptr.offset(2 * (call % 2))
        rg = g.propose_batch(live_g, toks[:B], hs, pos[:B], 2, return_logits=True)
        re = e.propose_batch(live_e, toks[:B], hs, pos[:B], 2, return_logits=True)
        for a, b in zip(rg, re):
            assert a.tokens == b.tokens and np.array_equal(a.logits, b.logits), f"call {call}"
        acc = [int(a) for a in rng.integers(0, 3, B)]
        g.after_verify_batch(live_g, acc)
        e.after_verify_batch(live_e, acc)
        rt = rng.integers(0, g.vocab_size, B)
        off = call % 2   # odd calls: the rows 2 bytes off 16-byte alignment (a copy call, not the graph's fetch)
        dev = gpu.upload(np.concatenate([np.zeros(off, BF16), hidden(rng, g, B, streams).astype(BF16).reshape(-1)]))
        for p, live in ((g, live_g), (e, live_e)):
            assert p.prefill_batch(live, rt, dev.ptr.offset(2 * off), [1] * B) == B
        for x, y in zip(live_g, live_e):
            assert x.keys == y.keys and rows_digest(g, x) == rows_digest(e, y), f"call {call}"
        pos[:B] = [st.next_position for st in live_g]
        toks[:B] = [int(t) for t in rt]
    E = g._hidden_row_elems()
    assert {("rows", 5, E), ("rows", 4, E)} <= set(g._graphs), g._graphs.keys()
    assert not any(key[0] == "rows" for key in e._graphs)
    check_pool(g, sg)


def device_and_host_results_loop(rng, g, e) -> None:
    """Device and host results alternating through a graphed proposer `g` (each kind: eager warm-up, capture,
    replay) against an eager one `e`: the same drafts every call, and two graphs of the width that differ only in
    `publish` (a host-results call replaying the device-results graph would wait for an outbox that never comes)."""
    lens = [int(n) for n in rng.integers(2, 30, 3)]
    sg, se = prefill_alike(rng, (g, e), lens)
    pos, toks = list(lens), [int(t) for t in rng.integers(0, g.vocab_size, 3)]
    for call in range(6):
        dev = call % 2 == 1
        hs = hidden(rng, g, 3)
        rg = g.propose_batch(sg, toks, hs, pos, 2, device_results=dev)
        re = e.propose_batch(se, toks, hs, pos, 2)
        got = rg.host().tokens if dev else rg.tokens
        assert np.array_equal(np.asarray(got), re.tokens), f"call {call}"
        pos, toks = verify_round(rng, (g, e), (sg, se), re)
    keys = [key for key in g._graphs if key[:2] == (2, 4)]
    assert len(keys) == 2 and {key[6] for key in keys} == {True, False}, keys
