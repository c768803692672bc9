"""`mpirun -n N`: the GLM-5 MTP proposer sharded over the ranks (heads + o_proj row-parallel, EP experts, TP
shared expert, vocab-sharded head) against the same checkpoint unsharded on each rank, for both argmax
exchanges; identical drafts on every rank; a planted cross-rank tie goes to the lower rank; the device
exchange itself (digits lanes / pairs) for N = world with random values and ties."""
import tempfile

import numpy as np
import pytest

from mpi4py import MPI
from mtp_cupy.models import glm5 as glm_mtp
from mtp_cupy.runtime.dtypes import BF16, bf16_round
from mtp_cupy.speculative.vocab_argmax import ShardedArgmax, lane_count
from mtp_cupy.weights import Checkpoint, write_checkpoint
from deepseek_util import check_chain, config_of, ref_weights
from glm_util import D, V, glm_ckpt, inputs
from reference.glm_ref import GlmMtpRef

WORLD = MPI.COMM_WORLD
T, K = 18, 3
ARGMAX_TIE, ROUTE_TIE = 0.05, 1e-2
# Sharded and unsharded differ by bf16 rounding only: the ranks' partial o_proj / MoE outputs are rounded to
# bf16 before NCCL's bf16 sum (as in serving), the unsharded GEMVs round once; chained drafts compound it.
TOL0, TOL = 1e-2, 2e-2


def _shared_rng():
    """The same random stream on every rank (seed from rank 0), fresh each run."""
    import os
    seed = np.array([int(os.environ.get("MTP_TEST_SEED", int.from_bytes(np.random.bytes(4), "little")))], np.int64)
    WORLD.Bcast(seed, root=0)
    print(f"[shared seed {int(seed[0])}]")
    return np.random.default_rng(int(seed[0]))


def _same_on_all_ranks(x) -> bool:
    a = np.ascontiguousarray(np.asarray(x, np.float64).reshape(-1))
    lo, hi = np.empty_like(a), np.empty_like(a)
    WORLD.Allreduce(a, lo, op=MPI.MIN)
    WORLD.Allreduce(a, hi, op=MPI.MAX)
    return bool(np.array_equal(lo, hi))


def _needs_even_split(world):
    if 4 % world or V % world:
        pytest.skip(f"the tiny checkpoint's 4 heads / vocab {V} do not split over {world} ranks")


def _load(path, gpu, comm, **kw):
    return glm_mtp.from_checkpoint(path, gpu, max_seq_len=96, comm=comm, **kw)


def _clear(logits) -> bool:
    top = np.sort(logits)[-2:]
    return bool(top[1] - top[0] > ARGMAX_TIE * logits.std())


@pytest.mark.parametrize("exchange", ["digits", "pairs"])
def test_sharded_equals_unsharded(dev_comm, world, exchange):
    """Three prefill / propose / verify cycles on both proposers with the same inputs. The float64 reference,
    teacher-forced with the drafts, flags routing / index-selection near-ties, and an unclear top-2 may draft
    differently: bf16 rounding decides those, so the cycle's comparison stops there and only the rows built
    from equal inputs are accepted."""
    _needs_even_split(world)
    gpu, comm = dev_comm
    path = glm_ckpt("bf16")
    sharded, full = _load(path, gpu, comm, head_exchange=exchange), _load(path, gpu, None)
    assert sharded.head_sharded == (world > 1) and sharded.head.n == V // world
    ref = GlmMtpRef(ref_weights(path), config_of(path))
    rng = _shared_rng()
    toks, hs, tok, h = inputs(rng, T)
    sts = [p.alloc_state() for p in (sharded, full)]
    for p, st in zip((sharded, full), sts):
        p.prefill(st, toks, hs)
    for r in range(T):
        ref.write_row(toks[r + 1], hs[r], r)
    pos = T
    for c in range(3):
        g, w = (p.propose(st, tok, h, pos, K, return_logits=True) for p, st in zip((sharded, full), sts))
        assert _same_on_all_ranks(g.tokens), f"cycle {c}: ranks drafted differently"
        assert _same_on_all_ranks(g.logits), f"cycle {c}: ranks gathered different logits"
        clean, t_, h_ = K, tok, bf16_round(h)
        for i in range(K):
            lr, gr = ref.step(t_, h_, pos + i)
            if ref.last_margin < ROUTE_TIE or g.tokens[:i] != w.tokens[:i]:
                clean = i + 1     # row i is still built from equal inputs; later rows are not
                break
            err = np.linalg.norm(g.logits[i] - w.logits[i]) / np.linalg.norm(w.logits[i])
            assert err < (TOL0 if i == 0 else TOL), f"cycle {c} draft {i}: logits rel err {err:.2e}"
            if _clear(w.logits[i]):
                assert g.tokens[i] == w.tokens[i] == int(np.argmax(lr)), f"cycle {c} draft {i}"
            t_, h_ = w.tokens[i], bf16_round(gr)
        acc = int(rng.integers(0, clean + 1))
        for p, st in zip((sharded, full), sts):
            p.after_verify(st, acc)
        ref.truncate(len(sts[1].keys))
        assert sts[0].keys == sts[1].keys
        pos = sts[1].keys[-1] + 1
        tok, h = int(rng.integers(V)), bf16_round(rng.standard_normal(D))


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_sharded_matches_reference(dev_comm, world, fmt):
    """The sharded proposer against the float64 reference directly (not only against the unsharded one); FP8
    shards that cut a 128-block are BF16 on the device."""
    _needs_even_split(world)
    gpu, comm = dev_comm
    path = glm_ckpt(fmt, seed=5)
    prop, ref = _load(path, gpu, comm), GlmMtpRef(ref_weights(path), config_of(path))
    toks, hs, tok, h = inputs(_shared_rng(), T)
    st = prop.alloc_state()
    prop.prefill(st, toks, hs)
    for r in range(T):
        ref.write_row(toks[r + 1], hs[r], r)
    res = prop.propose(st, tok, h, T, K, return_logits=True)
    check_chain(res, ref, tok, h, T, TOL0, TOL, f"{fmt} sharded over {world}")


@pytest.mark.parametrize("exchange", ["digits", "pairs"])
def test_drafts_without_logits_match(dev_comm, world, exchange):
    """The device exchange (no logits gathered) drafts what the gathered logits' argmax drafts."""
    _needs_even_split(world)
    gpu, comm = dev_comm
    prop = _load(glm_ckpt("bf16", seed=4), gpu, comm, head_exchange=exchange)
    rng = _shared_rng()
    toks, hs, tok, h = inputs(rng, 12)
    st = prop.alloc_state()
    prop.prefill(st, toks, hs)
    a = prop.propose(st, tok, h, 12, K, return_logits=True)
    prop.after_verify(st, 0)
    b = prop.propose(st, tok, h, 12, K)
    assert a.tokens == b.tokens == [int(np.argmax(x)) for x in a.logits]
    assert _same_on_all_ranks(b.tokens)


def test_grammar_mask_sharded(dev_comm, world):
    """A grammar mask (and the f32 logits it needs) on the sharded head drafts what the unsharded one does."""
    _needs_even_split(world)
    gpu, comm = dev_comm
    rng = _shared_rng()
    toks, hs, tok, h = inputs(rng, 10)
    allowed = np.sort(rng.choice(V, 30, replace=False))
    mask = np.zeros(V // 32, np.uint32)
    for t in allowed:
        mask[t // 32] |= np.uint32(1 << (t % 32))
    out = []
    for c in (comm, None):
        prop = _load(glm_ckpt("bf16", seed=6), gpu, c)
        st = prop.alloc_state()
        prop.prefill(st, toks, hs)
        out.append(prop.propose(st, tok, h, 10, 1, grammar_bitmask=mask.view(np.int32), return_logits=True))
    assert out[0].tokens[0] in allowed and _same_on_all_ranks(out[0].tokens)
    if _clear(out[1].logits[0][allowed]):
        assert out[0].tokens == out[1].tokens


def test_vocab_not_dividing_keeps_the_head_whole(dev_comm, world):
    """vocab % world != 0: the block is still sharded, every rank sweeps the whole head, no exchange runs."""
    if 4 % world or world == 1:
        pytest.skip(f"needs a world that splits 4 heads, got {world}")
    gpu, comm = dev_comm
    path = glm_ckpt("bf16", vocab_size=V - 1)
    prop = _load(path, gpu, comm)
    assert not prop.head_sharded and prop.xchg is None and prop.head.n == V - 1
    toks, hs, tok, h = inputs(_shared_rng(), 10)
    out = []
    for p in (prop, _load(path, gpu, None)):
        st = p.alloc_state()
        p.prefill(st, toks % (V - 1), hs)
        out.append(p.propose(st, tok % (V - 1), h, 10, 2, return_logits=True))
    assert _same_on_all_ranks(out[0].tokens)
    assert np.linalg.norm(out[0].logits[0] - out[1].logits[0]) / np.linalg.norm(out[1].logits[0]) < TOL0
    if _clear(out[1].logits[0]):
        assert out[0].tokens[0] == out[1].tokens[0]


def _tied_head_checkpoint(world) -> str:
    """The tiny checkpoint with an lm_head whose only non-zero rows are +v / -v at the same offset of every
    rank's slice: the largest logit is tied across all ranks."""
    src = Checkpoint(glm_ckpt("bf16"))
    tensors = {k: np.array(src.numpy(k)) for k in src.keys()}
    head = np.zeros((V, D), np.float32)
    v = np.random.default_rng(11).standard_normal(D)
    for r in range(world):
        j = r * (V // world) + 37
        head[j], head[j + 1] = v, -v
    tensors["lm_head.weight"] = head.astype(BF16)
    path = tempfile.mkdtemp(prefix=f"glm_tie_{WORLD.Get_rank()}_")
    write_checkpoint(path, tensors, config=config_of(src.path))
    return path


@pytest.mark.parametrize("exchange", ["digits", "pairs"])
def test_planted_tie_goes_to_the_lower_rank(dev_comm, world, exchange):
    _needs_even_split(world)
    gpu, comm = dev_comm
    path = _tied_head_checkpoint(world)
    rng = _shared_rng()
    toks, hs, tok, h = inputs(rng, 10)
    res = []
    for c in (comm, None):
        prop = _load(path, gpu, c, head_exchange=exchange)
        st = prop.alloc_state()
        prop.prefill(st, toks, hs)
        res.append(prop.propose(st, tok, h, 10, 2, return_logits=False))
    assert all(t in (37, 38) for t in res[0].tokens), res[0].tokens      # rank 0's slice won every tie
    assert res[0].tokens == res[1].tokens and _same_on_all_ranks(res[0].tokens)


@pytest.mark.parametrize("exchange", ["digits", "pairs"])
def test_device_exchange_n_ranks(dev_comm, rank, world, exchange):
    """ShardedArgmax over the real communicator: random bf16 slices, then slices whose maxima are equal on a
    random subset of ranks (the lowest of them must win); identical on every rank."""
    gpu, comm = dev_comm
    n = 1000
    rng = _shared_rng()
    xa = ShardedArgmax(gpu, comm, rank * n, n, exchange)
    out = gpu.alloc(4)
    assert lane_count(world) == 4 * world
    for trial in range(8):
        logits = (rng.standard_normal((world, n)) * 3).astype(BF16)
        if trial % 2:
            tied = rng.random(world) < 0.6
            tied[rng.integers(world)] = True
            idx = rng.integers(0, n, world)
            logits[tied, idx[tied]] = 20.0
        lb = gpu.upload(logits[rank])
        xa.pick(lb.ptr, out.ptr)
        got = int(gpu.read(out.ptr, np.int32, 1)[0])
        flat = logits.astype(np.float32).reshape(-1)
        assert got == int(np.argmax(flat)), f"trial {trial}"       # np.argmax: the first (lowest) id
        assert _same_on_all_ranks([got])


@pytest.mark.parametrize("exchange", ["digits", "pairs"])
def test_sharded_batch_equals_sharded_one_at_a_time(dev_comm, world, exchange):
    """propose_batch of B ragged sequences on the sharded proposer (one exchange for all B rows per step) drafts
    exactly what it drafts for each sequence alone (logits bit for bit), and every rank gets the same B winners.
    With test_sharded_equals_unsharded (sharded == unsharded per sequence, tie-aware) and tests/test_batch.py
    (unsharded batch == unsharded one at a time) this makes the sharded batch the unsharded one."""
    _needs_even_split(world)
    gpu, comm = dev_comm
    path = glm_ckpt("bf16", seed=8)
    a, b = (_load(path, gpu, comm, head_exchange=exchange) for _ in range(2))
    rng = _shared_rng()
    B = 5
    lens = [int(n) for n in rng.integers(3, 30, B)]
    sts = [[p.alloc_state() for _ in lens] for p in (a, b)]
    for s, n in enumerate(lens):
        toks, hs, _, _ = inputs(rng, n)
        for p, st in zip((a, b), sts):
            p.prefill(st[s], toks, hs)
    toks, hs = [int(t) for t in rng.integers(0, V, B)], bf16_round(rng.standard_normal((B, D)))
    for logits in (False, True):          # the device exchange, and the gathered f32 logits
        got = a.propose_batch(sts[0], toks, hs, lens, K, return_logits=logits)
        assert _same_on_all_ranks([t for r in got for t in r.tokens]), "ranks drafted differently"
        for s in range(B):
            one = b.propose(sts[1][s], toks[s], hs[s], lens[s], K, return_logits=logits)
            assert one.tokens == got[s].tokens, s
            if logits:
                assert np.array_equal(one.logits, got[s].logits), s
        for p, st in zip((a, b), sts):
            for x in st:
                p.after_verify(x, 0)


@pytest.mark.parametrize("exchange", ["digits", "pairs"])
def test_device_exchange_many_rows(dev_comm, rank, world, exchange):
    """One exchange for R rows at once: row r's winner is the global argmax of row r (ties to the lower rank)."""
    gpu, comm = dev_comm
    n, R = 300, 7
    rng = _shared_rng()
    xa = ShardedArgmax(gpu, comm, rank * n, n, exchange, max_rows=R)
    out = gpu.alloc(4 * R)
    logits = (rng.standard_normal((world, R, n)) * 3).astype(BF16)
    logits[:, 2, 17] = 30.0                       # row 2: tied on every rank, rank 0 wins
    lb = gpu.upload(np.ascontiguousarray(logits[rank]))
    xa.pick(lb.ptr, out.ptr, R)
    got = gpu.read(out.ptr, np.int32, R).tolist()
    want = [int(np.argmax(logits[:, r].astype(np.float32).reshape(-1))) for r in range(R)]
    assert got == want and got[2] == 17 and _same_on_all_ranks(got)
