"""argmax / argmax_bitmask against float64 textbook math; ties to the lowest id, NaN below every number."""
import numpy as np
import pytest

from mtp_cupy import KernelError, ops
from mtp_cupy.runtime.dtypes import BF16
from mtp_cupy.refdev.registry import names_in
from mtp_cupy.runtime.backend import cuda_kernel_names
from mtp_cupy.runtime.ptr import NULL
from helpers import bf16, get, out, run_on_both, up

VOCABS = [1, 7, 1000, 154880 + 5]


def logits(rng, shape, dtype, scale=3.0):
    x = (rng.standard_normal(shape) * scale).astype(np.float32)
    return bf16(x) if dtype == "bf16" else x


def first_max(x):
    """Textbook argmax of a NaN-free row: the first index holding the largest value."""
    x = np.asarray(x, np.float64)
    return int(np.flatnonzero(x == x.max())[0])


def log_softmax_top1(x):
    x = np.asarray(x, np.float64)
    m = x.max()
    return m - (m + np.log(np.exp(x - m).sum()))


def run_argmax(dev, x, n, rows=1, row_stride=None, dtype="f32", lp=False):
    xb = up(dev, x)
    ids, vals = out(dev, "i32", rows), out(dev, "f32", rows)
    lps = out(dev, "f32", rows) if lp else None
    ops.argmax(dev, xb.ptr, n, ids.ptr, rows=rows, row_stride=row_stride, dtype=dtype, out_val=vals.ptr,
               out_lp=lps.ptr if lp else NULL)
    return (get(dev, ids, "i32", rows), get(dev, vals, "f32", rows),
            get(dev, lps, "f32", rows) if lp else None)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("n", VOCABS)
def test_argmax_planted_ties(dev, rng, dtype, n):
    x = logits(rng, n, dtype)
    top = np.float32(x.astype(np.float32).max()) + 1
    at = np.sort(rng.choice(n, min(n, 3), replace=False))
    x[at] = top  # the same max at several ids: the lowest wins
    ids, vals, _ = run_argmax(dev, x, n, dtype=dtype)
    assert ids[0] == at[0] == first_max(x)
    assert vals[0] == np.float32(x[at[0]])


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("lp", [False, True])
def test_argmax_batch(dev, rng, dtype, lp):
    n, rows = 151936, 5
    stride = n + 3  # odd stride: most rows start off a 16-byte boundary
    x = logits(rng, (rows, stride), dtype)
    x[2, 100:110] = x[2].astype(np.float32).max() + 1  # a tie run inside one vector
    ids, vals, lps = run_argmax(dev, x, n, rows=rows, row_stride=stride, dtype=dtype, lp=lp)
    for r in range(rows):
        row = x[r, :n]
        assert ids[r] == first_max(row)
        assert vals[r] == np.float32(row[ids[r]])
        if lp:
            assert abs(lps[r] - log_softmax_top1(row)) <= 1e-5 * max(1.0, abs(log_softmax_top1(row)))


def test_argmax_counter_resets_between_launches(dev, rng):
    """Rows split over several blocks meet through a counter in the workspace; it must rearm itself."""
    for _ in range(3):
        x = logits(rng, (2, 129280), "f32")
        ids, _, _ = run_argmax(dev, x, 129280, rows=2, dtype="f32")
        assert ids.tolist() == [first_max(x[0]), first_max(x[1])]


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_argmax_nan_and_signed_zero(dev, rng, dtype):
    n = 4000
    rows = np.stack([logits(rng, n, dtype).astype(np.float32) for _ in range(4)])
    rows[0, ::7] = np.nan                                   # NaN among numbers: the largest number wins
    rows[1, :] = np.nan                                     # all NaN: id 0
    rows[2, :] = np.nan
    rows[2, [5, 900]] = -np.inf                             # NaN ranks below -inf
    rows[3, :] = -1.0
    rows[3, 37], rows[3, 38] = -0.0, 0.0                    # -0.0 == +0.0: the lower id
    x = rows.astype(BF16) if dtype == "bf16" else rows
    ids, vals, lps = run_argmax(dev, x, n, rows=4, dtype=dtype, lp=True)
    finite = np.where(np.isnan(rows[0]), -np.inf, rows[0])
    assert ids.tolist() == [first_max(finite), 0, 5, 37]
    assert vals[0] == np.float32(x[0, ids[0]]) and np.isnan(vals[1]) and vals[2] == -np.inf
    assert vals[3] == 0.0 and not np.signbit(vals[3])
    assert abs(lps[0] - log_softmax_top1(rows[0][~np.isnan(rows[0])])) <= 1e-5
    assert np.isnan(lps[1]) and np.isnan(lps[2])


def run_masked(dev, x, n, mask, rows=1, row_stride=None, dtype="f32"):
    xb, mb = up(dev, x), up(dev, mask.astype(np.int32))
    ids, flags, vals = out(dev, "i32", rows), out(dev, "i32", rows), out(dev, "f32", rows)
    ops.argmax_bitmask(dev, xb.ptr, n, mb.ptr, ids.ptr, flags.ptr, dtype=dtype, rows=rows, row_stride=row_stride,
                       mask_row_words=mask.shape[-1], out_val=vals.ptr)
    return get(dev, ids, "i32", rows), get(dev, flags, "i32", rows), get(dev, vals, "f32", rows)


def pack_mask(allowed, words):
    """xgrammar layout: bit t % 32 of int32 word t // 32."""
    bits = np.zeros(words * 32, np.uint64)
    bits[:allowed.size] = allowed
    return (bits.reshape(words, 32) << np.arange(32, dtype=np.uint64)).sum(axis=1).astype(np.uint32).view(np.int32)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_argmax_bitmask(dev, rng, dtype):
    n, rows, words = 154880, 4, 154880 // 32 + 3  # rows of the mask padded past ceil(n / 32)
    x = logits(rng, (rows, n), dtype)
    allowed = rng.random((rows, n)) < 0.3
    best = [first_max(x[r]) for r in range(rows)]
    allowed[0, best[0]] = False                 # the true max is masked out
    allowed[1, :] = False                       # nothing allowed: id 0, flag 1
    allowed[2, :] = False
    allowed[2, [n - 1, 17]] = True              # two allowed; equal values -> the lower id
    x[2, [17, n - 1]] = x[2, n - 1]
    allowed[3, best[3]] = True                  # the max allowed
    mask = np.stack([pack_mask(allowed[r], words) for r in range(rows)])
    ids, flags, vals = run_masked(dev, x, n, mask, rows, dtype=dtype)
    for r in range(rows):
        if not allowed[r].any():
            assert ids[r] == 0 and flags[r] == 1 and vals[r] == -np.inf
            continue
        want = np.flatnonzero(allowed[r])[first_max(x[r][allowed[r]])]
        assert flags[r] == 0 and ids[r] == want and vals[r] == np.float32(x[r, want])
    assert ids[0] != best[0] and ids[2] == 17 and ids[3] == best[3]


def test_launchers_reject_bad_input(ref):
    with pytest.raises(KernelError, match="dtype"):
        ops.argmax(ref, 256, 10, 256, dtype="f16")
    with pytest.raises(KernelError, match="mask words"):
        ops.argmax_bitmask(ref, 256, 100, 256, 256, 256, mask_row_words=3)
    with pytest.raises(KernelError, match="row_stride"):
        ops.argmax(ref, 256, 100, 256, rows=2, row_stride=50)


def test_every_kernel_has_a_twin():
    """The backend finds kernels by parsing the source; each must have a twin of the same name."""
    assert sorted(cuda_kernel_names("argmax")) == names_in("argmax")

@pytest.mark.gpu
@pytest.mark.parametrize("n", [129280, 154880, 151936])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_argmax_cuda_vs_twin_real_vocab(rng, n, dtype):
    x = logits(rng, (3, n), dtype)
    x[1, [5, n - 1]] = x[1].astype(np.float32).max() + 1
    allowed = rng.random((3, n)) < 0.5
    mask = np.stack([pack_mask(allowed[r], -(-n // 32)) for r in range(3)])
    a, b = run_on_both(lambda d: run_argmax(d, x, n, rows=3, dtype=dtype, lp=True))
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    assert np.allclose(a[2], b[2], rtol=1e-5, atol=1e-6)
    a, b = run_on_both(lambda d: run_argmax(d, x[0], n, dtype=dtype))
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    a, b = run_on_both(lambda d: run_masked(d, x, n, mask, 3, dtype=dtype))
    assert all(np.array_equal(u, v) for u, v in zip(a, b))
