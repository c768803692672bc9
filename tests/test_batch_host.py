"""The batch calls' compiled bookkeeping (host_src/batch_host.c through speculative/batch_host.py) against its
twin, the NumPy path: two proposers of one checkpoint, host_path "c" and "numpy", take the same random serving
traffic in lockstep (joins, leaves, prefills, the catch-up, propose_batch and propose with and without
positions, grammar masks, confidence stops, device results, ragged after_verify_batch, bad ids, holes, bad
counts, a pool that runs full), and after every operation hold the same drafts and errors, and the same state
byte for byte: the cache mirror's counters and tables, the free-block stack, the used flags, the drafts and both
pinned stages the device copies from."""
import numpy as np
import pytest

import mtp_cupy
from batch_util import ckpt, hidden
from helpers import check_pool
from mtp_cupy.errors import CapacityError, ConfigError, InputError
from mtp_cupy.speculative import batch_host


def load(fam, host_path, **kw):
    return mtp_cupy.load_proposer(ckpt(fam), gpu=mtp_cupy.device("ref"), max_seq_len=80, max_batch=8, max_drafts=4,
                                  max_sequences=5, host_path=host_path, **kw)


def staged(buf):
    """A pinned stage's bytes; None for one not made yet or made and never written (stages are made zeroed on first
    use, and the compiled path makes them when it first aims at them, even for a call it then refuses)."""
    return None if buf is None or not buf.any() else buf.tobytes()


def state_of(prop, states):
    kv = prop.kv
    return {"seqs": [(list(s.keys), s.blocks.rows, list(s.blocks.table), s.last_num_drafted, list(s.last_drafts))
                     for s in states],
            "cols": kv._cols.tobytes(), "tables": kv._tables.tobytes(), "free": kv._free.tobytes(),
            "used": bytes(kv._used), "drafts": prop._drafts_rows().tobytes(),
            "stage": staged(prop._stage),
            "prefill_stage": staged(None if prop._prefill_stage is None else prop._prefill_stage[0])}


def both(props, fn):
    """fn(prop, i) on each proposer: the same result, or the same error (type and message)."""
    outs = []
    for i, p in enumerate(props):
        try:
            outs.append(("ok", fn(p, i)))
        except (InputError, CapacityError) as e:
            outs.append((type(e).__name__, str(e)))
    assert outs[0] == outs[1], outs
    return outs[0]


def drafts_of(res):
    if res.tokens is None:
        return np.asarray(res.device_tokens).tolist(), None
    return res.tokens.tolist(), res.num_drafts.tolist()


class Counted:
    """Counts a BatchHost method's calls that did the work (returned something other than None)."""

    def __init__(self, fn):
        self.fn, self.done, self.declined = fn, 0, 0

    def __call__(self, *a):
        out = self.fn(*a)
        if out is None:
            self.declined += 1
        else:
            self.done += 1
        return out


@pytest.mark.parametrize("fam,kw", [("deepseek_v3", {}), ("deepseek_v3", {"drafter_context": False}),
                                    ("qwen3_next", {"refeed_accepted": True})])
def test_compiled_bookkeeping_equals_numpy(fam, kw, rng):
    props = (load(fam, "c", **kw), load(fam, "numpy", **kw))
    assert props[0]._batch_host() is not None and props[1]._batch_host() is None
    host = props[0]._batch_host()
    host.stage, host.trim, host.catch_up = Counted(host.stage), Counted(host.trim), Counted(host.catch_up)
    V, live, batch, last = props[0].vocab_size, [], None, None
    for op in range(240):
        r, done = rng.random(), [j for j, pair in enumerate(live) if pair[0].next_position > 72]
        full = props[0].kv.free_count < 2 and r < 0.5
        if done or len(live) > 5 and (r < 0.05 or full):   # leave: a finished sequence, or any when the pool is full
            pair = live.pop(done[0] if done else int(rng.integers(len(live))))
            for p, st in zip(props, pair):
                p.free_state(st)
            batch = last = None
        elif r < 0.12 or len(live) < 5:   # join: a prompt of random length (the pool may be full)
            n = 0 if rng.random() < 0.3 else int(rng.integers(1, 24))   # 0: its first row is a propose's
            toks, hs = rng.integers(0, V, n + 1), hidden(rng, props[0], n)
            pair = [p.alloc_state() for p in props]
            if not n or both(props, lambda p, i: p.prefill(pair[i], toks, hs))[0] == "ok":
                live.append(pair)
            else:
                for p, st in zip(props, pair):
                    p.free_state(st)
        elif last is not None and rng.random() < 0.6:   # after_verify_batch of the last propose (now and then bad)
            acc = [int(rng.integers(0, d + 1)) for d in last]
            if rng.random() < 0.1:
                acc[int(rng.integers(len(acc)))] = max(last) + 1 if rng.random() < 0.5 else -1
            both(props, lambda p, i: p.after_verify_batch([pair[i] for pair in batch], acc))
            last = None
        elif r < 0.35 and batch is not None:   # the catch-up: one row per sequence at its next position
            toks, hs = rng.integers(0, V, len(batch)), hidden(rng, props[0], len(batch))
            starts = None if rng.random() < 0.5 else [pair[0].next_position for pair in batch]
            bad = rng.random()
            if bad < 0.05:
                toks[int(rng.integers(len(batch)))] = -1
                if rng.random() < 0.5:   # and a hidden of the wrong width: the id is named first on both paths
                    hs = hs[:, :-1]
            elif bad < 0.07:
                hs = hs[:, :-1]
            elif starts is not None and (bad < 0.1 or not props[0].drafter_context and bad < 0.4):
                starts[int(rng.integers(len(batch)))] += 1   # a hole (a new run without drafter context)
            rows = [1] * len(batch)
            if rng.random() < 0.1:   # as many rows, not one each: the NumPy path's case
                rows[0], rows[-1] = 2, 0
            both(props, lambda p, i: p.prefill_batch([pair[i] for pair in batch], toks, hs, rows, starts))
            last = None
        elif rng.random() < 0.15:   # propose for one sequence (the compiled path at B = 1), then its verify
            pair, k = live[int(rng.integers(len(live)))], int(rng.integers(1, 5))
            tok, h = int(rng.integers(0, V + 1 if rng.random() < 0.05 else V)), hidden(rng, props[0])
            pos = None if rng.random() < 0.5 else pair[0].next_position + int(rng.random() < 0.1)
            got = both(props, lambda p, i: p.propose(pair[i], tok, h, pos, k).tokens)
            if got[0] == "ok":
                a = int(rng.integers(0, len(got[1]) + 1))
                both(props, lambda p, i: p.after_verify(pair[i], a))
            last = None
        else:   # propose_batch: the remembered batch again (the compiled path) or a new one
            if batch is None or rng.random() < 0.25:
                B = int(rng.integers(5, min(8, len(live)) + 1))
                batch = [live[j] for j in rng.permutation(len(live))[:B]]
            B, k = len(batch), int(rng.integers(1, 5))
            toks, hs = [int(t) for t in rng.integers(0, V, B)], hidden(rng, props[0], B)
            pos = None if rng.random() < 0.5 else [pair[0].next_position for pair in batch]
            if pos is not None and not props[0].drafter_context and rng.random() < 0.3:
                pos[int(rng.integers(B))] += int(rng.integers(1, 4))   # a later position: a new run
            bad = rng.random()
            if bad < 0.04:
                toks[int(rng.integers(B))] = V
                if rng.random() < 0.5:   # and a hidden of the wrong width: the id is named first on both paths
                    hs = hs[:, :-1]
            elif bad < 0.06:
                hs = hs[:, :-1]
            elif bad < 0.1 and pos is not None:
                pos[int(rng.integers(B))] += 1   # a hole (allowed without drafter context)
            stop = float(rng.uniform(-3, 0)) if rng.random() < 0.2 else None
            dev = stop is None and rng.random() < 0.1
            masks = None   # now and then grammar masks: random allowed sets, some sequences unconstrained
            if stop is None and rng.random() < 0.15:
                words = (V + 31) // 32
                masks = [None if rng.random() < 0.3 else rng.integers(-2**31, 2**31, words).astype(np.int32)
                         for _ in range(B)]
            got = both(props, lambda p, i: drafts_of(p.propose_batch([pair[i] for pair in batch], toks, hs, pos, k,
                                                                      grammar_bitmasks=masks, min_logprob=stop,
                                                                      device_results=dev)))
            if got[0] == "ok":
                last = [k] * B if got[1][1] is None else got[1][1]
        want = state_of(props[1], [pair[1] for pair in live])
        assert state_of(props[0], [pair[0] for pair in live]) == want, f"operation {op}"
    check_pool(props[0], [pair[0] for pair in live])
    # the compiled path ran, and declined what the NumPy path then refused or handled
    calls = [(f.done, f.declined) for f in (host.stage, host.trim, host.catch_up)]
    assert calls[0][0] > 20 and calls[1][0] > 5 and calls[2][0] > 3, calls
    assert sum(declined for _, declined in calls) > 0, calls


def test_host_path_c_without_a_compiler_is_a_config_error(monkeypatch):
    monkeypatch.setattr(batch_host.shutil, "which", lambda name: None)
    monkeypatch.setattr(batch_host, "_LIB", {})
    with pytest.raises(ConfigError, match="needs a C compiler"):
        load("deepseek_v3", "c")
    prop = load("deepseek_v3", "auto")   # auto: the NumPy path, which drafts alike
    assert prop._batch_host() is None


def test_host_path_is_checked():
    with pytest.raises(ConfigError, match="host_path='fortran'"):
        load("deepseek_v3", "fortran")


def test_pad_rows_stage_alike(rng):
    """A graph's bucket runs W > B rows (CUDA only): the compiled staging of the pad rows (id 0, the pad slab) and
    of the B sequences equals the NumPy path's, checked here by staging one call both ways at every width."""
    from types import SimpleNamespace

    from batch_util import prefill_alike
    from mtp_cupy.speculative.batch_inputs import check_sequences, mirror_rows
    props = (load("deepseek_v3", "c"), load("deepseek_v3", "numpy"))
    for B, W in ((5, 8), (6, 8), (8, 8)):
        states = prefill_alike(rng, props, [int(n) for n in rng.integers(1, 40, B)])
        k = int(rng.integers(1, 5))
        toks = rng.integers(0, props[0].vocab_size, B).astype(np.int64)
        c, n = props
        c._wait_stage()
        rows0, poss = c._batch_host().stage(mirror_rows(states[0]), toks, None, k, W)
        t, p, idx, cols = check_sequences(n, states[1], toks, None, k)
        n._memo.keep(states[1], idx, n.kv)
        want_rows0 = n._reserve_rows(states[1], k, idx, cols)
        n._stage_inputs(t, SimpleNamespace(host=None), W, 0)
        n._stage_slabs(states[1], want_rows0, p, k, W, idx, cols)
        assert rows0.tolist() == want_rows0.tolist() and poss.tolist() == p.tolist()
        assert c._stage.tobytes() == n._stage.tobytes(), (B, W, k)
        for p_, sts in zip(props, states):
            for st in sts:
                p_.free_state(st)


def test_a_widened_mirror_is_followed(rng):
    """Past 16 blocks a table outgrows the mirror's width: the compiled call declines, the NumPy path widens the
    mirror (a new array), and the next compiled call works on the new one."""
    from batch_util import prefill_alike
    props = [mtp_cupy.load_proposer(ckpt("deepseek_v3"), gpu=mtp_cupy.device("ref"), max_seq_len=320, max_batch=8,
                                    max_drafts=4, host_path=hp) for hp in ("c", "numpy")]
    B, V = 5, props[0].vocab_size
    states = prefill_alike(rng, props, [int(n) for n in rng.integers(240, 250, B)])
    host = props[0]._batch_host()
    host.stage = Counted(host.stage)
    width = props[0].kv._tables.shape[1]
    for _ in range(8):
        toks, hs = [int(t) for t in rng.integers(0, V, B)], hidden(rng, props[0], B)
        got = [p.propose_batch(sts, toks, hs, None, 4).tokens.tolist() for p, sts in zip(props, states)]
        assert got[0] == got[1]
        for p, sts in zip(props, states):
            p.after_verify_batch(sts, [4] * B)
        assert state_of(props[0], states[0]) == state_of(props[1], states[1])
    assert props[0].kv._tables.shape[1] > width   # widened, and the compiled path went on after it
    assert host.stage.declined >= 1 and host.stage.done >= 5, (host.stage.done, host.stage.declined)
