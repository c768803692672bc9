"""On-device quantisation: abs-max, per-row FP8, NVFP4 (ModelOpt recipe), quantize_linear. The recipe is
re-implemented here the way ModelOpt writes it (searchsorted over the E2M1 rounding bounds); results must
match it bit for bit, and dequant(quant(w)) must stay within the formats' error bounds."""
import numpy as np
import pytest

from mtp_cupy import ops
from mtp_cupy.errors import KernelError
from mtp_cupy.runtime.dtypes import FP8
from mtp_cupy.weights.linear import Linear
from helpers import bf16, f32, get, out, run_on_both, up

E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)
BOUNDS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)


def modelopt_nvfp4(w: np.ndarray):
    """ModelOpt NVFP4QTensor, written from its description: (codes [n, k/2], e4m3 bytes [n, k/16], scale2)."""
    w = f32(w)
    n, k = w.shape
    amax = np.abs(w).max()
    s2 = amax / np.float32(6 * 448) if amax > 0 else np.float32(1)
    blocks = w.reshape(n, k // 16, 16)
    bamax = np.abs(blocks).max(-1)
    bs = np.clip(bamax / (np.float32(6) * s2), np.float32(2 ** -9), np.float32(448))
    bs = np.where(bamax == 0, np.float32(1), bs).astype(np.float32)
    sbytes = bs.astype(FP8)  # RNE
    scaled = blocks / (sbytes.astype(np.float32) * s2)[..., None]
    mag = np.abs(scaled)
    ordinal = np.searchsorted(BOUNDS, mag, side="left")  # count of bounds below |v|
    ordinal += np.isin(mag, BOUNDS[[1, 3, 5]])           # ties at the odd bounds round up (to even)
    codes = (np.minimum(ordinal, 7) | np.signbit(scaled) * 8).astype(np.uint8).reshape(n, k)
    return (codes[:, 0::2] | codes[:, 1::2] << 4).astype(np.uint8), sbytes.view(np.uint8), np.float32(s2)


def dequant_nvfp4(packed, sbytes, s2):
    codes = np.stack([packed & 15, packed >> 4], -1).reshape(packed.shape[0], -1)
    return E2M1[codes].astype(np.float64) * np.repeat(sbytes.view(FP8).astype(np.float64), 16, 1) * float(s2)


def _weights(rng, n, k, heavy_tail=True):
    w = rng.standard_normal((n, k)) * 0.02
    if heavy_tail:
        w *= np.exp(rng.standard_normal((n, 1)))                  # per-row magnitudes
        w[rng.integers(0, n, 4), rng.integers(0, k, 4)] *= 50    # outliers
    w = bf16(w)
    w[0, :16] = 0          # an all-zero block (scale 1.0)
    w[1, 16:32] = bf16(1e-7)  # a block whose scale clamps at 2^-9
    return w


@pytest.mark.parametrize("n", [1, 1000, 7168 * 3 + 5])
def test_absmax(dev, rng, n):
    x = bf16(rng.standard_normal(n) * 3)
    xb, o = up(dev, x), out(dev, "f32", 1)
    ops.absmax(dev, xb.ptr, n, o.ptr)
    assert get(dev, o, "f32", 1)[0] == np.abs(f32(x)).max()
    x[n // 2] = np.nan
    xb = up(dev, x)
    ops.absmax(dev, xb.ptr, n, o.ptr)
    assert np.isnan(get(dev, o, "f32", 1)[0])


@pytest.mark.parametrize("n,k", [(3, 64), (130, 1000)])
def test_quantize_fp8_rows(dev, rng, n, k):
    w = _weights(rng, n, k)
    w[2] = 0  # zero row: scale 1
    wb, q, s = up(dev, w), out(dev, "u8", (n, k)), out(dev, "f32", n)
    ops.quantize_fp8_rows(dev, wb.ptr, n, k, q.ptr, s.ptr)
    codes, scale = get(dev, q, "u8", (n, k)), get(dev, s, "f32", n)
    amax = np.abs(f32(w)).max(1)
    ref_scale = np.where(amax > 0, amax / np.float32(448), np.float32(1)).astype(np.float32)
    assert np.array_equal(scale, ref_scale)
    ref_codes = np.clip(f32(w) / ref_scale[:, None], -448, 448).astype(FP8).view(np.uint8)
    assert np.array_equal(codes, ref_codes)
    assert not np.isin(codes & 0x7F, [0x7F]).any(), "NaN code: saturation failed"
    assert (np.abs(codes.view(FP8).astype(np.float32)).max(1)[amax > 0] == 448).all()
    deq = codes.view(FP8).astype(np.float64) * scale[:, None]
    err = np.abs(deq - f32(w))
    # e4m3: 3 mantissa bits -> half-ulp 2^-4 relative for normals; subnormal steps 2^-9 * scale
    assert (err <= np.maximum(np.abs(f32(w)) * 2 ** -4, 2.0 ** -10 * scale[:, None]) * (1 + 1e-6)).all()


@pytest.mark.parametrize("n,k", [(4, 32), (96, 1024)])
def test_quantize_nvfp4_modelopt_recipe(dev, rng, n, k):
    w = _weights(rng, n, k)
    packed_ref, s_ref, s2 = modelopt_nvfp4(w)
    wb, q, s = up(dev, w), out(dev, "u8", (n, k // 2)), out(dev, "u8", (n, k // 16))
    assert ops.nvfp4_scale2(np.abs(f32(w)).max()) == s2
    ops.quantize_nvfp4(dev, wb.ptr, n, k, q.ptr, s.ptr, float(s2))
    packed, sb = get(dev, q, "u8", (n, k // 2)), get(dev, s, "u8", (n, k // 16))
    assert np.array_equal(sb, s_ref)
    assert np.array_equal(packed, packed_ref)
    assert sb[0, 0] == 0x38 and sb[1, 1] == 0x01 and (packed[0, :8] == 0).all()
    assert sb.max() <= 0x7E  # never the e4m3 NaN
    # error bound: half an E2M1 step of the block's unit (scale * scale2) is at most 1 unit (the 4..6
    # step); where the e4m3 rounding of the block scale went down, |w| may exceed 6 units and saturate
    deq = dequant_nvfp4(packed, sb, s2)
    unit = np.repeat(sb.view(FP8).astype(np.float64), 16, 1) * float(s2)
    bound = unit * (1 + 1e-6) + np.maximum(np.abs(f32(w)) - 6 * unit, 0)
    assert (np.abs(deq - f32(w)) <= bound).all()
    rel = np.linalg.norm(deq - f32(w)) / np.linalg.norm(f32(w))
    assert rel < (0.2 if n * k < 4096 else 0.11)  # ~0.095 at size; a few samples vary more


def test_quantize_nvfp4_saturates(dev, rng):
    """A block whose e4m3 scale rounded down has |w| / (scale * scale2) > 6: those codes saturate to +-6."""
    n, k = 1, 32
    w = bf16(np.ones((n, k)))
    w[0, 0], w[0, 16] = bf16(448 * 6 * 0.01), bf16(-1.0)
    s2 = np.float32(0.01)
    # block 1: amax 1.0 / (6 * 0.01) = 16.67 -> e4m3 16 (rounded down): 1.0 / (16 * 0.01) = 6.25 -> 6
    wb, q, s = up(dev, w), out(dev, "u8", (n, 16)), out(dev, "u8", (n, 2))
    ops.quantize_nvfp4(dev, wb.ptr, n, k, q.ptr, s.ptr, float(s2))
    packed, sb = get(dev, q, "u8", (n, 16)), get(dev, s, "u8", (n, 2))
    assert sb[0, 1].view(FP8).astype(np.float32) == 16
    codes = np.stack([packed & 15, packed >> 4], -1).reshape(-1)
    assert codes[16] == 15 and (codes[17:] == 7).all()  # -6 and +6


@pytest.mark.parametrize("fmt", ["fp8_row", "nvfp4"])
def test_quantize_linear(dev, rng, fmt):
    n, k = 48, 512
    w = _weights(rng, n, k, heavy_tail=False)
    wb = up(dev, w)
    L = ops.quantize_linear(dev, Linear("bf16", n, k, wb.ptr, owners=[wb]), fmt)
    assert (L.fmt, L.n, L.k) == (fmt, n, k)
    if fmt == "fp8_row":
        deq = dev.read(L.weight, "u8", (n, k)).view(FP8).astype(np.float64) * dev.read(L.scale, "f32", n)[:, None]
        tol = 0.04
    else:
        packed_ref, s_ref, s2 = modelopt_nvfp4(w)
        assert L.scale2 == float(s2)
        packed, sb = dev.read(L.weight, "u8", (n, k // 2)), dev.read(L.scale, "u8", (n, k // 16))
        assert np.array_equal(packed, packed_ref) and np.array_equal(sb, s_ref)
        deq = dequant_nvfp4(packed, sb, s2)
        tol = 0.11
    assert np.linalg.norm(deq - f32(w)) / np.linalg.norm(f32(w)) < tol
    # the result is usable by the format kernels: one GEMV through the expert path
    x = bf16(rng.standard_normal((1, k)))
    tab, ids, xb, y = up(dev, ops.expert_table([L])), up(dev, np.zeros(1, np.int32)), up(dev, x), out(dev, "f32", n)
    ops.moe_gemv(dev, tab.ptr, fmt, ids.ptr, 1, 1, 1, xb.ptr, k, 0, y.ptr, n, k)
    ref = deq @ f32(x[0]).astype(np.float64)
    assert np.linalg.norm(get(dev, y, "f32", n) - ref) <= 1e-5 * np.linalg.norm(ref)


def test_quantize_errors(ref):
    b = ref.alloc(64)
    with pytest.raises(KernelError):
        ops.quantize_nvfp4(ref, b.ptr, 1, 24, b.ptr, b.ptr, 0.1)
    with pytest.raises(KernelError):
        ops.quantize_nvfp4(ref, b.ptr, 1, 16, b.ptr, b.ptr, 0.0)
    with pytest.raises(KernelError):
        ops.quantize_linear(ref, Linear("fp8_row", 1, 16, b.ptr, b.ptr), "nvfp4")


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(2048, 7168), (7168, 2048), (512, 2048)])
def test_quantize_real_dims_cuda_vs_twin(rng, n, k):
    w = _weights(rng, n, k)

    def run(dev):
        wb = up(dev, w)
        L8 = ops.quantize_linear(dev, Linear("bf16", n, k, wb.ptr, owners=[wb]), "fp8_row")
        L4 = ops.quantize_linear(dev, Linear("bf16", n, k, wb.ptr, owners=[wb]), "nvfp4")
        return (dev.read(L8.weight, "u8", (n, k)), dev.read(L8.scale, "f32", n),
                dev.read(L4.weight, "u8", (n, k // 2)), dev.read(L4.scale, "u8", (n, k // 16)), L4.scale2)

    a, b = run_on_both(run)
    for x, y in zip(a, b):
        assert np.array_equal(np.asarray(x), np.asarray(y))  # same fp32 steps: bit-identical
