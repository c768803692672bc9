import numpy as np
import pytest

from mtp_cupy import ops
from helpers import assert_close, get, rand_bf16, up, f32


@pytest.mark.parametrize("n", [1, 1000, 7168, 6144 * 3 + 5])
def test_bf16_residual_add(dev, rng, n):
    a, b = rand_bf16(rng, n), rand_bf16(rng, n)
    x, r = up(dev, a), up(dev, b)
    ops.bf16_residual_add(dev, x.ptr, r.ptr, n)
    got = get(dev, x, "bf16", n)
    ref = f32(a).astype(np.float64) + f32(b)
    assert_close(f32(got), ref, 1e-2)
    assert np.array_equal(f32(got), f32((f32(a) + f32(b)).astype(a.dtype)))  # one rounding, exact
