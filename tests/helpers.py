"""Shared test helpers: uploads, poisoned outputs, relative errors that never let NaN pass."""
import numpy as np

from mtp_cupy.refdev.backend import RefBackend
from mtp_cupy.runtime.dtypes import BF16, dtype as _dtype

POISON = 0xFF  # 0xFFFF is a bf16 NaN, 0xFFFFFFFF an f32 NaN, 0xFF an fp8 NaN


def up(dev, arr):
    """Upload a host array; returns the DeviceBuffer (keep it alive while its pointer is used)."""
    return dev.upload(np.ascontiguousarray(arr))


def out(dev, dtype, shape, poison=True):
    """An output buffer, poisoned so a kernel that skips an element is caught."""
    dt = _dtype(dtype)
    n = int(np.prod(shape)) * dt.itemsize
    buf = dev.alloc(max(n, 1))
    dev.fill(buf.ptr, n, POISON if poison else 0)
    return buf


def get(dev, buf, dtype, shape):
    return dev.read(buf.ptr, dtype, shape)


def f32(a):
    return np.asarray(a).astype(np.float32)


def rel_err(got, ref) -> float:
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    if not np.all(np.isfinite(got)):
        return float("inf")
    den = np.linalg.norm(ref.ravel())
    num = np.linalg.norm((got - ref).ravel())
    return float(num / den) if den > 0 else float(num)


def assert_close(got, ref, tol, what=""):
    e = rel_err(got, ref)
    assert e <= tol, f"{what} relative error {e:.3e} > {tol:.1e}"


def bf16(a):
    return np.asarray(a, dtype=np.float32).astype(BF16)


def rand_bf16(rng, shape, scale=1.0):
    return bf16(rng.standard_normal(shape) * scale)


def run_on_both(run, *args):
    """`run(dev, *args)` on the NumPy device and on CUDA; returns (ref_result, cuda_result)."""
    import mtp_cupy
    return run(mtp_cupy.device("ref"), *args), run(mtp_cupy.device("cuda"), *args)


def assert_bf16_near(a, b, max_frac=0.01, atol=0.0):
    """CUDA vs twin on bf16 outputs: equal but for accumulation order, i.e. at most one bf16 ulp apart (or
    within `atol`, for outputs that are a near-cancelling sum), and on few elements."""
    a, b = f32(a), f32(b)
    assert np.all(np.isfinite(a)) and np.all(np.isfinite(b)), "NaN/inf in an output"
    d = np.abs(a - b)
    big = np.maximum(np.abs(a), np.abs(b))
    ulp = np.exp2(np.floor(np.log2(np.where(big > 0, big, 1.0))) - 7)   # bf16 spacing at the larger value
    assert np.all((d <= ulp) | (d <= atol)), f"max diff {d[d > atol].max()} (more than one bf16 ulp)"
    assert np.count_nonzero(d) <= max(2, int(a.size * max_frac)), f"{np.count_nonzero(d)} of {a.size} differ"


def check_pool(prop, states):
    """Proposer invariants over live states: rows == positions recorded, exactly the blocks those rows
    need, positions increasing, and every pool block either held by exactly one state (and marked handed out)
    or on the free list (and not): no leak, no block shared, none both free and held."""
    from mtp_cupy.cache import PagedKvCache
    kv, held = prop.kv, []
    for st in states:
        assert st.seq_len == len(st.keys) and len(st.blocks.table) == PagedKvCache.blocks_for(st.seq_len)
        assert all(b > a for a, b in zip(st.keys, st.keys[1:]))
        held += st.blocks.table
    held += prop._pad.table
    free = list(kv._free)
    assert len(held) == len(set(held)) and len(free) == len(set(free)) and not set(held) & set(free)
    assert len(held) + len(free) == kv.num_blocks
    assert all(kv._used[b] for b in held) and not any(kv._used[b] for b in free)


def clear_argmax(logits, margin: float) -> bool:
    """True when the top-2 logit gap exceeds `margin` logit standard deviations: rounding cannot swap them."""
    logits = np.asarray(logits, np.float64)
    top = np.sort(logits)[-2:]
    return bool(top[1] - top[0] > margin * max(float(logits.std()), 1e-12))


class Picks(list):
    """Per draft the index of the reference outcome the device matched (0: the exact one); `tied[i]`: step i
    had a near tie (more than one legitimate outcome)."""
    tied: list[bool]


def check_chain(res, ref, token: int, hidden, position: int, tol0: float, tol: float, label: str = "",
                tie: float = 1e-2, argmax_tie: float = 0.1) -> Picks:
    """A propose's drafts replayed on a float64 reference (anything with `candidates(token, hidden, pos, tie)`,
    reference/decisions.py), teacher-forced with the device's drafts, each step's carried hidden rounded to
    bf16 as the device stores it. Every draft is compared: its logits must be within tol0 (first draft) / tol
    (chained: the bf16 carried hidden compounds) of one of the step's outcomes -- the exact one, or one that
    takes the other side of a near tie (a routing or index choice closer than `tie`, where rounding may
    legitimately choose otherwise; for chained drafts `tie * tol / tol0`, the inputs' own difference growing as
    the logits' does) -- and its id must be that outcome's argmax where the top-2 gap is clear (`argmax_tie`).
    The chain goes on from the matched outcome, as the device did. Returns the Picks."""
    assert len(res.tokens) > 0, f"{label}: nothing drafted, nothing compared"
    tok, h = token, bf16(hidden).astype(np.float64)
    picks = Picks()
    picks.tied = []
    for i in range(len(res.tokens)):
        outs = ref.candidates(tok, h, position + i, tie if i == 0 else tie * tol / tol0)
        errs = [rel_err(res.logits[i], lg) for lg, _ in outs]
        j = int(np.argmin(errs))
        assert errs[j] <= (tol0 if i == 0 else tol), \
            f"{label} draft {i}: logits rel err {errs[j]:.2e} (outcomes: {', '.join(f'{e:.2e}' for e in errs)})"
        if clear_argmax(outs[j][0], argmax_tie):
            assert res.tokens[i] == int(np.argmax(outs[j][0])), f"{label} draft {i}: argmax"
        picks.append(j)
        picks.tied.append(len(outs) > 1)
        tok, h = res.tokens[i], bf16(outs[j][1]).astype(np.float64)
    return picks


def write_rows(refs, toks, hs, n: int) -> None:
    """Prefill rows 0..n-1 (embed(toks[r + 1]) paired with hs[r]) into each reference."""
    for ref in refs:
        for r in range(n):
            ref.write_row(toks[r + 1], hs[r], r)


def matches_oracle(prop, ref, hf, inputs, k: int, tol0: float, tol: float, label: str, tie: float,
                   argmax_tie: float) -> list[int]:
    """inputs = (n + 1 prompt tokens, n hiddens, token, hidden): prefill the n rows on the proposer and on both
    references, propose k, and check the chain (check_chain) against transformers' layer (hf: write_row /
    step), with the float64 reference (ref) adding the other-side outcomes of its near ties."""
    class Both:
        def candidates(self, tok, h, pos, tie):
            outs = ref.candidates(tok, h, pos, tie)
            return [hf.step(tok, h, pos)] + outs[1:]

    toks, hs, tok, h = inputs
    n = len(hs)
    st = prop.alloc_state()
    prop.prefill(st, toks, hs)
    write_rows((ref, hf), toks, hs, n)
    return check_chain(prop.propose(st, tok, h, n, k, return_logits=True), Both(), tok, h, n, tol0, tol, label,
                       tie, argmax_tie)


class BranchLog(RefBackend):
    """A NumPy device whose fork / join (Backend.fork, docs/architecture.md "Branches") can be watched: its
    streams are objects, so the side stream is told apart, and `log` lists every launch as (kernel, on the side)
    and every event record / stream wait as ("record" | "wait", on the side): the fork's and join's events, or
    ("mark" | "wait_mark", on the side) for any other event (a caller's point on the side stream that main waits
    for). Launches run as on the NumPy device."""

    def __init__(self):
        super().__init__()
        self.log = []

    def new_stream(self, non_blocking=True):
        return object()

    def new_event(self, timing=True):
        return object()

    def _side(self, stream):
        return stream is not None and stream is getattr(self._branch, "side", None)

    def _branch_event(self, event):
        return any(event is getattr(self._branch, e, None) for e in ("forked", "done"))

    def record(self, event, stream=None):
        self.log.append(("record" if self._branch_event(event) else "mark", self._side(stream)))

    def wait_event(self, stream, event):
        self.log.append(("wait" if self._branch_event(event) else "wait_mark", self._side(stream)))

    def launch(self, handle, grid, block, shared, args, stream, cluster=(1, 1, 1), early=True):
        self.log.append((handle.name, self._side(stream)))
        super().launch(handle, grid, block, shared, args, stream, cluster, early)


EVENTS = ("record", "wait", "mark", "wait_mark")   # BranchLog's entries that are not launches


def launches(log, side: bool | None = None) -> list[str]:
    """The kernels of a BranchLog's `log` in order: all, or those on the side stream (side=True) or main (False)."""
    return [n for n, s in log if n not in EVENTS and (side is None or s == side)]


def mark_sites(log):
    """[(side kernels queued before the mark, the first main kernel after main waits for it)] for each mark (an
    event recorded on the side stream that main waits for) in a BranchLog's `log`."""
    sites, side, marks = [], [], []
    for name, on_side in log:
        if name == "mark" and on_side:
            marks.append(list(side))
        elif name == "wait_mark" and not on_side:
            sites.append([marks.pop(0), None])
        elif name not in EVENTS:
            if on_side:
                side.append(name)
            else:
                for s in sites:
                    if s[1] is None:
                        s[1] = name
    assert not marks and all(r is not None for _, r in sites), "a mark no main kernel waits for"
    return [tuple(s) for s in sites]


def branch_sites(log):
    """[(side kernels, the first main kernel after the join)] for each branch in a BranchLog's `log` (a fork: a
    record on main and a wait on the side; forking again continues the branch; the join: a record on the side and a
    wait on main). Asserts every branch is joined."""
    sites, side, open_, joined = [], [], False, False
    for i, (name, on_side) in enumerate(log):
        if name == "wait" and on_side:
            open_ = True
        elif name == "wait" and open_:
            open_, joined = False, True
        elif name not in EVENTS:
            if on_side:
                assert open_, f"{name} on the side stream outside a branch"
                side.append(name)
            elif joined:
                sites.append((side, name))
                side, joined = [], False
    assert not open_ and not joined, "a branch was left open"
    return sites


def launched(monkeypatch) -> list[str]:
    """Names of the kernels launched from here on (appended as each launches)."""
    from mtp_cupy.runtime.backend import KernelLaunch
    names, orig = [], KernelLaunch.launch

    def launch(self, stream=None):
        names.append(self.h.name)
        return orig(self, stream)
    monkeypatch.setattr(KernelLaunch, "launch", launch)
    return names
