"""Host quantisers and the exact dequantisers (the project's ground truth for every weight format)."""
import ml_dtypes
import numpy as np
import pytest

from mtp_cupy.runtime.dtypes import E8M0, FP8
from mtp_cupy.weights import quant_host as qh


def _w(rng, n, k, scale=1.0):
    return (rng.standard_normal((n, k)) * scale * np.exp(rng.standard_normal((n, 1)))).astype(np.float32)


# -- E2M1 and nibbles ------------------------------------------------------------------------------
def test_e2m1_round_to_nearest_even_and_saturation():
    x = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 1e9, 0.26, 0.74, 4.9, -0.25, -0.75, -2.5, -5, -9])
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 6.0, 0.5, 0.5, 4.0, -0.0, -1.0, -2.0, -4.0, -6.0]
    got = qh.e2m1_values(qh.e2m1_codes(x))
    assert got.tolist() == want
    assert np.signbit(got[13])                        # -0.25 -> -0 (code 8)
    codes = np.arange(16, dtype=np.uint8)
    assert np.array_equal(qh.e2m1_values(codes), codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32))
    assert np.array_equal(qh.e2m1_codes(qh.E2M1_VALUES)[[0, *range(1, 8), *range(9, 16)]],
                          [0, *range(1, 8), *range(9, 16)])


def test_nibble_order_low_nibble_is_even_element(rng):
    assert qh.pack_nibbles(np.array([[1, 2, 3, 4]])).tolist() == [[0x21, 0x43]]
    assert qh.unpack_nibbles(np.array([[0xAB, 0xCD]], np.uint8)).tolist() == [[0xB, 0xA, 0xD, 0xC]]
    c = rng.integers(0, 16, (5, 32)).astype(np.uint8)
    assert np.array_equal(qh.unpack_nibbles(qh.pack_nibbles(c)), c)
    assert np.array_equal(qh.unpack_nibbles(qh.pack_nibbles(c).view(np.int8)), c)
    with pytest.raises(ValueError):
        qh.pack_nibbles(np.zeros((2, 3), np.uint8))


# -- power-of-two exponents ------------------------------------------------------------------------
def test_pow2_exponent_is_exact_at_boundaries():
    a = np.array([448.0, 448.0 * 2 ** 5, np.nextafter(np.float32(448 * 32), np.float32(1e9)), 224.0, 224.0001, 0.0,
                  1e-45, 3e38, 1e300])
    e = qh.pow2_exponent(a, 448.0)
    assert e.tolist() == [0, 5, 6, -1, 0, 0, -127, 120, 127]     # clamped to the E8M0 range
    amax = np.array([6.0, 6.0001, 3.0, 0.75, 12.0])
    assert qh.pow2_exponent(amax, 6.0).tolist() == [0, 1, -1, -3, 1]


# -- FP8 -------------------------------------------------------------------------------------------
def test_fp8_block_ceil_div_edges(rng):
    w = _w(rng, 200, 300)
    q, s = qh.quant_fp8_block(w)
    assert q.dtype == FP8 and s.dtype == np.float32 and s.shape == (2, 3)
    # the edge block [128:200, 256:300] is zero-padded: its scale is that region's amax / 448
    assert s[1, 2] == np.float32(np.abs(w[128:, 256:]).max()) / np.float32(448)
    d = qh.dequant_fp8_block(q, s)
    assert np.array_equal(d, q.astype(np.float32) * np.repeat(np.repeat(s, 128, 0), 128, 1)[:200, :300])
    sx = np.repeat(np.repeat(s, 128, 0), 128, 1)[:200, :300]
    assert np.all(np.abs(d - w) <= np.abs(w) * 2.0 ** -4 + sx * 2.0 ** -10)
    assert not np.isnan(q.astype(np.float32)).any() and np.abs(q.astype(np.float32)).max() <= 448


def test_fp8_block_zero_block_and_exact_block_max():
    w = np.zeros((130, 130), np.float32)
    w[0, 0] = 3.0
    q, s = qh.quant_fp8_block(w)
    assert s.tolist() == [[np.float32(3) / np.float32(448), 1.0], [1.0, 1.0]]
    assert float(q[0, 0].astype(np.float32)) == 448.0          # the block max maps to 448 (clipped if +1 ulp)
    assert float(qh.dequant_fp8_block(q, s)[0, 0]) == pytest.approx(3.0, rel=1e-6)


def test_fp8_block_e8m0(rng):
    w = _w(rng, 130, 260, scale=100.0)
    q, s = qh.quant_fp8_block_e8m0(w)
    assert s.dtype == E8M0 and s.shape == (2, 3)
    sv = s.astype(np.float32)
    amax = np.zeros((2, 3), np.float32)
    for i in range(2):
        for j in range(3):
            amax[i, j] = np.abs(w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]).max()
    assert np.all(amax <= 448 * sv) and np.all(amax > 224 * sv)    # the smallest power of two that fits
    assert np.array_equal(np.log2(sv), np.round(np.log2(sv)))
    d = qh.dequant_fp8_block(q, s)
    exact = q.astype(np.float64) * np.repeat(np.repeat(sv, 128, 0), 128, 1)[:130, :260]
    assert np.array_equal(d, exact.astype(np.float32)) and np.array_equal(d.astype(np.float64), exact)
    sx = np.repeat(np.repeat(sv, 128, 0), 128, 1)[:130, :260]
    assert np.all(np.abs(d - w) <= np.abs(w) * 2.0 ** -4 + sx * 2.0 ** -10)
    _, z = qh.quant_fp8_block_e8m0(np.zeros((4, 4), np.float32))
    assert z.astype(np.float32).tolist() == [[1.0]]


def test_fp8_row_and_tensor(rng):
    w = _w(rng, 9, 40)
    w[3] = 0
    q, s = qh.quant_fp8_row(w)
    assert s.shape == (9,) and s[3] == 1.0 and s[0] == np.float32(np.abs(w[0]).max()) / np.float32(448)
    d = qh.dequant_fp8_row(q, s)
    assert np.array_equal(d, qh.dequant_fp8_row(q, s[:, None]))
    assert np.all(np.abs(d - w) <= np.abs(w) * 2.0 ** -4 + s[:, None] * 2.0 ** -10)
    qt, st = qh.quant_fp8_tensor(w)
    assert st.shape == () and st == np.float32(np.abs(w).max()) / np.float32(448)
    dt = qh.dequant_fp8_row(qt, st)
    assert np.array_equal(dt, qh.dequant_fp8_row(qt, st.reshape(1)))
    assert np.all(np.abs(dt - w) <= np.abs(w) * 2.0 ** -4 + st * 2.0 ** -10)
    with pytest.raises(ValueError):
        qh.dequant_fp8_row(q, np.ones(4, np.float32))


def test_fp8_overflow_never_nan():
    w = np.full((2, 2), 1e6, np.float32)
    q, s = qh.quant_fp8_row(w)
    assert np.isfinite(qh.dequant_fp8_row(q, s)).all()
    with pytest.raises(ValueError, match="non-finite"):
        qh.quant_fp8_block(np.array([[np.inf]], np.float32))


# -- NVFP4 -----------------------------------------------------------------------------------------
def test_nvfp4_modelopt_recipe_by_hand():
    w = np.zeros((3, 32), np.float32)
    # row 0, block 0: block amax 6 -> block scale 6/(6*scale2) = 1, so w is rounded to E2M1 as is
    w[0, :16] = [6, 0.25, 0.75, 2.5, 5, 1.25, 1.75, 3.5, -0.25, -0.75, -2.5, -5, 0, 0.5, 1, 1.5]
    # row 0, block 1: all zero -> block scale 1.0
    # row 1, block 0: the tensor amax 6*448 -> scale2 = 1 exactly, block scale 448
    w[1, :4] = [2688, 448 * 2.5, -448 * 0.75, 448 * 5]
    # row 1, block 1: tiny block -> block scale clamped up to 2^-9
    w[1, 16:19] = [2.0 ** -9 * 3, 1e-4, -2.0 ** -9 * 0.5]
    # row 2, block 0: 6.375/6 = 1.0625 rounds (tie, even) down to e4m3 1.0 -> 6.375 saturates to 6
    w[2, :3] = [6.375, -6.375, 3.2]
    # row 2, block 1: 7.125/6 = 1.1875 rounds (tie, even) up to 1.25 -> x / 1.25
    w[2, 16:18] = [7.125, 1.25]
    packed, bs, s2 = qh.quant_nvfp4(w)
    assert s2 == np.float32(1.0) and packed.shape == (3, 16) and packed.dtype == np.uint8 and bs.dtype == FP8
    assert bs.astype(np.float32).tolist() == [[1.0, 1.0], [448.0, 2.0 ** -9], [1.0, 1.25]]
    codes = qh.unpack_nibbles(packed)
    assert codes[0, :16].tolist() == [7, 0, 2, 4, 6, 2, 4, 6, 8, 10, 12, 14, 0, 1, 2, 3]
    assert codes[0, 16:].tolist() == [0] * 16
    assert codes[1, :4].tolist() == [7, 4, 10, 6]
    assert codes[1, 16:19].tolist() == [5, 0, 9]                 # 3, 0.0512 -> 0, -0.5
    assert codes[2, :3].tolist() == [7, 15, 5]                   # +-6 saturated, 3.2 -> 3
    assert codes[2, 16:18].tolist() == [7, 2]                    # 7.125 / 1.25 = 5.7 -> 6, 1.25 / 1.25 = 1
    d = qh.dequant_nvfp4(packed, bs, s2)
    assert d[0, :8].tolist() == [6, 0, 1, 2, 4, 1, 2, 4] and d[2, :2].tolist() == [6, -6]
    assert d[1, :4].tolist() == [2688, 896, -448, 1792]


def test_nvfp4_all_zero_tensor():
    packed, bs, s2 = qh.quant_nvfp4(np.zeros((2, 16), np.float32))
    assert s2 == 1.0 and (packed == 0).all() and bs.astype(np.float32).tolist() == [[1.0], [1.0]]
    assert (qh.dequant_nvfp4(packed, bs, s2) == 0).all()


def test_nvfp4_random_bounds_and_exact_dequant(rng):
    w = _w(rng, 64, 256)
    packed, bs, s2 = qh.quant_nvfp4(w)
    assert s2 == np.float32(np.abs(w).max()) / np.float32(2688) and bs.shape == (64, 16)
    d = qh.dequant_nvfp4(packed, bs, s2)
    v = qh.e2m1_values(qh.unpack_nibbles(packed)).astype(np.float64)
    exact = v * np.repeat(bs.astype(np.float64), 16, 1) * np.float64(s2)
    assert np.array_equal(d, exact.astype(np.float32))           # one rounding, for the global scale
    denom = np.repeat(bs.astype(np.float32) * s2, 16, 1)
    assert np.all(np.abs(d - w) <= denom * 1.0001)               # at most one E2M1 half-step (or saturation)
    rel = np.linalg.norm(d - w) / np.linalg.norm(w)
    assert rel < 0.12
    with pytest.raises(ValueError, match="k % 16"):
        qh.quant_nvfp4(np.ones((2, 24), np.float32))


def test_nvfp4_explicit_scale2(rng):
    w = _w(rng, 4, 32)
    p1, b1, s1 = qh.quant_nvfp4(w)
    p2, b2, s2 = qh.quant_nvfp4(w, scale2=float(s1))
    assert s1 == s2 and np.array_equal(p1, p2) and np.array_equal(b1.view(np.uint8), b2.view(np.uint8))


# -- MXFP4 -----------------------------------------------------------------------------------------
def test_mxfp4_exact_for_representable_values(rng):
    codes = rng.integers(0, 16, (6, 64)).astype(np.uint8)
    codes[:, 0] = 7                                          # each block holds a +-6 so its exponent is e
    codes[:, 32] = 15
    e = rng.integers(-20, 20, (6, 2))
    w = qh.e2m1_values(codes) * np.ldexp(np.float32(1), np.repeat(e, 32, 1)).astype(np.float32)
    packed, s = qh.quant_mxfp4(w)
    assert s.dtype == E8M0 and s.shape == (6, 2) and np.array_equal(np.log2(s.astype(np.float64)), e)
    assert np.array_equal(qh.dequant_mxfp4(packed, s), w)
    assert np.array_equal(qh.dequant_mxfp4(packed.view(np.int8), s), w)


def test_mxfp4_random_bounds(rng):
    w = _w(rng, 16, 128)
    packed, s = qh.quant_mxfp4(w)
    sv = s.astype(np.float32)
    bmax = np.abs(w).reshape(16, 4, 32).max(-1)
    assert np.all(bmax <= 6 * sv) and np.all(bmax > 3 * sv)      # smallest power of two, nothing saturates
    d = qh.dequant_mxfp4(packed, s)
    assert np.all(np.abs(d - w) <= np.repeat(sv, 32, 1))         # half of the widest E2M1 step (2) x scale
    _, z = qh.quant_mxfp4(np.zeros((1, 32), np.float32))
    assert z.view(np.uint8).tolist() == [[127]]
    with pytest.raises(ValueError, match="k % 32"):
        qh.quant_mxfp4(np.ones((1, 48), np.float32))
