"""stack_rows: one weight holding several projections' rows (one GEMV for what they compute side by side), for
every format; the stacked bytes are the parts' bytes in order, the stacked GEMV matches the float64 product of
the parts' own dequantisations, and parts that cannot share a weight are refused (None)."""
import numpy as np
import pytest

from mtp_cupy import ops
from mtp_cupy.weights.linear import FORMATS, stack_problem, stack_rows
from helpers import assert_close, bf16, get, out, up
from test_moe import host_weight, upload_weight

BLOCK = ("fp8_block", "fp8_block_e8m0")


def parts(dev, rng, fmt, ns, k):
    """Uploaded Linears of ns rows each and their float64 dequantisations (nvfp4: one global scale)."""
    hosts = [host_weight(rng, fmt, n, k) for n in ns]
    s2 = hosts[0][0][2]
    lins = [upload_weight(dev, fmt, n, k, (a[0], a[1], s2)) for n, (a, _) in zip(ns, hosts)]
    dense = [d() * (s2 / a[2]) for a, d in hosts]
    return lins, dense


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [1, 5, 40])
def test_stack_rows_is_the_parts_side_by_side(dev, rng, fmt, m):
    k = 512
    ns = (256, 128, 72) if fmt in BLOCK else (96, 40, 24)
    lins, dense = parts(dev, rng, fmt, ns, k)
    S = stack_rows(dev, lins)
    assert (S.fmt, S.n, S.k, S.weight_bytes) == (fmt, sum(ns), k, sum(L.weight_bytes for L in lins))
    for i, field in enumerate(("weight", "scale")):
        if sum(L.storage_bytes()[i] for L in lins):
            want = np.concatenate([dev.copy_d2h(getattr(L, field), L.storage_bytes()[i]) for L in lins])
            assert np.array_equal(dev.copy_d2h(getattr(S, field), S.storage_bytes()[i]), want), field
    x = bf16(rng.standard_normal((m, k)))
    xb, y = up(dev, x), out(dev, "f32", (m, S.n))
    ops.linear(dev, xb.ptr, S, y.ptr, m, out_dtype="f32", invariant=True)
    ref = x.astype(np.float32).astype(np.float64) @ np.concatenate(dense).T
    assert_close(get(dev, y, "f32", (m, S.n)), ref, 1e-5, f"{fmt} stacked")


def test_stack_rows_refuses_what_cannot_share(ref, rng):
    k = 256
    (a, b), _ = parts(ref, rng, "fp8_block", (200, 128), k)   # a block part of 200 rows before another
    assert stack_rows(ref, [a, b]) is None and "128" in stack_problem([a, b])
    assert stack_rows(ref, [b, a]) is not None                 # the odd count last is fine
    (c,), _ = parts(ref, rng, "bf16", (64,), k)
    (d,), _ = parts(ref, rng, "bf16", (64,), 2 * k)
    assert stack_rows(ref, [c, b]) is None and stack_rows(ref, [c, d]) is None
    (e,), _ = parts(ref, rng, "nvfp4", (64,), k)
    (f,), _ = parts(ref, rng, "nvfp4", (64,), k)
    assert stack_rows(ref, [e, f]) is None and "global" in stack_problem([e, f])
