"""Host (NumPy) quantisers and exact dequantisers for every weight format a `Linear` can hold.

The quantisers build test fixtures and tiny checkpoints; the dequantisers are the ground truth that
kernels, twins and references are checked against, so each is written as the one fp32 computation a
kernel performs:

  fp8 block / row  W = float(e4m3) * s                       one fp32 rounding (a 4-bit x 24-bit product)
  fp8 block e8m0   W = float(e4m3) * 2^(byte-127)            exact
  nvfp4            W = (E2M1 * float(e4m3 block scale)) * scale2   the bracket is exact in fp32; one
                                                             rounding for the global scale
  mxfp4            W = E2M1 * 2^(byte-127)                   exact

Layouts (all row-major, K contiguous): fp8 block scales [ceil(n/128), ceil(k/128)] over zero-padded
edge blocks; nvfp4 codes [n, k/2] with the LOW nibble holding the even element and e4m3 scales
[n, k/16]; mxfp4 codes likewise with e8m0 scales [n, k/32]."""
from __future__ import annotations

import numpy as np

from ..runtime.dtypes import E8M0, FP4, FP8, to_fp8

FP8_MAX = 448.0
E2M1_MAX = 6.0
NVFP4_GROUP = 16
MXFP4_GROUP = 32
# E2M1 code -> value: bit 3 sign, bits 2..1 exponent (bias 1), bit 0 mantissa; code 1 is the subnormal 0.5
E2M1_VALUES = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def _f32(w) -> np.ndarray:
    w = np.asarray(w).astype(np.float32)
    if not np.isfinite(w).all():
        raise ValueError("cannot quantise non-finite weights")
    return w


# -- E2M1 codes and nibble packing -----------------------------------------------------------------
def e2m1_codes(x) -> np.ndarray:
    """float -> E2M1 code (uint8 0..15), round to nearest even, saturating at +-6 (ml_dtypes, which is
    bit-identical to CUDA's __nv_cvt_float_to_fp4 RN)."""
    return np.asarray(x, np.float32).astype(FP4).view(np.uint8) & np.uint8(0x0F)


def e2m1_values(codes) -> np.ndarray:
    return E2M1_VALUES[np.asarray(codes, np.uint8) & 0x0F]


def pack_nibbles(codes) -> np.ndarray:
    """[..., 2m] codes -> [..., m] bytes; element 2j in the low nibble, 2j+1 in the high nibble
    (ModelOpt's `(q[..., 1::2] << 4) | q[..., 0::2]`)."""
    c = np.asarray(codes, np.uint8)
    if c.shape[-1] % 2:
        raise ValueError(f"odd last dimension {c.shape[-1]} cannot be packed two per byte")
    return ((c[..., 1::2] & 0x0F) << 4 | (c[..., 0::2] & 0x0F)).astype(np.uint8)


def unpack_nibbles(packed) -> np.ndarray:
    p = np.asarray(packed).view(np.uint8)
    out = np.empty(p.shape[:-1] + (2 * p.shape[-1],), np.uint8)
    out[..., 0::2], out[..., 1::2] = p & 0x0F, p >> 4
    return out


# -- power-of-two (E8M0) scales --------------------------------------------------------------------
def pow2_exponent(amax, limit: float) -> np.ndarray:
    """The smallest e with amax <= limit * 2^e (i.e. 2^ceil(log2(amax/limit)), computed exactly),
    clamped to the E8M0 range [-127, 127]; 0 where amax == 0."""
    a = np.asarray(amax, np.float64)
    with np.errstate(divide="ignore"):
        e = np.where(a > 0, np.ceil(np.log2(np.where(a > 0, a, 1.0) / limit)), 0).astype(np.int64)
    e += a > np.ldexp(limit, e)                      # log2 rounding can land one off either way
    e -= (a > 0) & (a <= np.ldexp(limit, e - 1))
    return np.clip(e, -127, 127)


def e8m0_from_exponent(e) -> np.ndarray:
    """Exponent -> E8M0 byte (value 2^(byte-127)) as float8_e8m0fnu."""
    return (np.asarray(e, np.int64) + 127).astype(np.uint8).view(E8M0)


# -- block helpers ---------------------------------------------------------------------------------
def _block_shape(block: int | tuple[int, int]) -> tuple[int, int]:
    return (block, block) if isinstance(block, int) else (int(block[0]), int(block[1]))


def _block_amax(w: np.ndarray, bn: int, bk: int) -> np.ndarray:
    """abs-max of each [bn, bk] block; edge blocks are zero-padded (ceil-div grid)."""
    n, k = w.shape
    nb, kb = -(-n // bn), -(-k // bk)
    p = np.zeros((nb * bn, kb * bk), np.float32)
    p[:n, :k] = np.abs(w)
    return p.reshape(nb, bn, kb, bk).max(axis=(1, 3))


def _expand(s: np.ndarray, bn: int, bk: int, n: int, k: int) -> np.ndarray:
    return np.repeat(np.repeat(s, bn, axis=0), bk, axis=1)[:n, :k]


# -- FP8 e4m3 --------------------------------------------------------------------------------------
def quant_fp8_block(w, block: int | tuple[int, int] = 128) -> tuple[np.ndarray, np.ndarray]:
    """DeepSeek block FP8: (e4m3 [n, k], weight_scale_inv f32 [ceil(n/128), ceil(k/128)]).
    The scale is the dequant multiplier amax/448 (1.0 for an all-zero block)."""
    w = _f32(w)
    bn, bk = _block_shape(block)
    amax = _block_amax(w, bn, bk)
    s = np.where(amax > 0, amax / np.float32(FP8_MAX), np.float32(1)).astype(np.float32)
    q = to_fp8(w / _expand(s, bn, bk, *w.shape))     # to_fp8 clips the odd 448+ulp quotient
    return q, s


def quant_fp8_block_e8m0(w, block: int | tuple[int, int] = 128) -> tuple[np.ndarray, np.ndarray]:
    """DeepSeek-V4 block FP8: (e4m3 [n, k], e8m0 [ceil(n/128), ceil(k/128)]), scale 2^ceil(log2(amax/448))
    so no element saturates; 1.0 for an all-zero block."""
    w = _f32(w)
    bn, bk = _block_shape(block)
    e = pow2_exponent(_block_amax(w, bn, bk), FP8_MAX)
    inv = np.ldexp(np.float32(1), -_expand(e, bn, bk, *w.shape)).astype(np.float32)
    return to_fp8(w * inv), e8m0_from_exponent(e)


def dequant_fp8_block(q, scale, block: int | tuple[int, int] = 128) -> np.ndarray:
    """e4m3 [n, k] x block scale (f32 or e8m0) [ceil(n/bn), ceil(k/bk)] -> f32 [n, k]."""
    q = np.asarray(q)
    bn, bk = _block_shape(block)
    s = np.asarray(scale).astype(np.float32)
    n, k = q.shape
    if s.shape != (-(-n // bn), -(-k // bk)):
        raise ValueError(f"block scale shape {s.shape} does not fit weight {q.shape} with blocks {bn}x{bk}")
    return q.astype(np.float32) * _expand(s, bn, bk, n, k)


def quant_fp8_row(w) -> tuple[np.ndarray, np.ndarray]:
    """Per-output-row FP8: (e4m3 [n, k], f32 [n] = row amax / 448, 1.0 for a zero row)."""
    w = _f32(w)
    amax = np.abs(w).max(axis=1)
    s = np.where(amax > 0, amax / np.float32(FP8_MAX), np.float32(1)).astype(np.float32)
    return to_fp8(w / s[:, None]), s


def quant_fp8_tensor(w) -> tuple[np.ndarray, np.ndarray]:
    """Per-tensor FP8: (e4m3 [n, k], f32 scalar array of shape ())."""
    w = _f32(w)
    amax = np.float32(np.abs(w).max()) if w.size else np.float32(0)
    s = np.float32(amax / np.float32(FP8_MAX)) if amax > 0 else np.float32(1)
    return to_fp8(w / s), np.array(s, np.float32)


def dequant_fp8_row(q, scale) -> np.ndarray:
    """e4m3 [n, k] x f32 scale (scalar, [1], [n] or [n, 1]) -> f32 [n, k]."""
    q = np.asarray(q)
    s = np.asarray(scale, np.float32).reshape(-1)
    if s.size not in (1, q.shape[0]):
        raise ValueError(f"fp8 row scale of {s.size} values for {q.shape[0]} rows")
    return q.astype(np.float32) * (s[:, None] if s.size > 1 else s[0])


# -- NVFP4 (ModelOpt) ------------------------------------------------------------------------------
def quant_nvfp4(w, scale2: float | None = None) -> tuple[np.ndarray, np.ndarray, np.float32]:
    """ModelOpt NVFP4QTensor recipe -> (u8 [n, k/2], e4m3 [n, k/16], f32 scale2).

    scale2 = amax(W) / (6*448) (1.0 for an all-zero tensor); block scale = clamp(block_amax /
    (6*scale2), 2^-9, 448) rounded to e4m3, 1.0 for an all-zero block; codes = RNE_E2M1(w /
    (block_scale * scale2)), saturating at 6 where the e4m3 rounding of the block scale went down."""
    w = _f32(w)
    n, k = w.shape
    if k % NVFP4_GROUP:
        raise ValueError(f"nvfp4 needs k % 16 == 0 (k = {k})")
    if scale2 is None:
        amax = np.float32(np.abs(w).max()) if w.size else np.float32(0)
        scale2 = amax / np.float32(E2M1_MAX * FP8_MAX) if amax > 0 else np.float32(1)
    s2 = np.float32(scale2)
    bamax = np.abs(w).reshape(n, k // NVFP4_GROUP, NVFP4_GROUP).max(axis=-1)
    bs = bamax / (np.float32(E2M1_MAX) * s2)
    bs = np.where(bamax > 0, np.clip(bs, np.float32(2.0 ** -9), np.float32(FP8_MAX)), np.float32(1))
    bs = bs.astype(np.float32).astype(FP8)
    denom = np.repeat(bs.astype(np.float32) * s2, NVFP4_GROUP, axis=1)
    return pack_nibbles(e2m1_codes(w / denom)), bs, s2


def dequant_nvfp4(packed, scale, scale2) -> np.ndarray:
    """u8 [n, k/2] x e4m3 [n, k/16] x f32 scale2 -> f32 [n, k] (see the module docstring)."""
    v = e2m1_values(unpack_nibbles(packed))
    s = np.asarray(scale).astype(np.float32)
    if s.shape != (v.shape[0], v.shape[1] // NVFP4_GROUP):
        raise ValueError(f"nvfp4 scale shape {s.shape} does not fit codes {v.shape}")
    return (v * np.repeat(s, NVFP4_GROUP, axis=1)) * np.float32(scale2)


# -- MXFP4 (DeepSeek-V4 routed experts) ------------------------------------------------------------
def quant_mxfp4(w) -> tuple[np.ndarray, np.ndarray]:
    """MXFP4 -> (u8 [n, k/2], e8m0 [n, k/32]).

    Shared exponent choice: 2^ceil(log2(block_amax / 6)), the smallest power of two that puts the block
    max at or below 6, so nothing saturates (DeepSeek's ue8m0 rounding). The OCP MX recipe,
    2^(floor(log2(amax)) - 2), can leave the block max up to 8 and clip it to 6; dequantisation is the
    same either way. An all-zero block gets 1.0."""
    w = _f32(w)
    n, k = w.shape
    if k % MXFP4_GROUP:
        raise ValueError(f"mxfp4 needs k % 32 == 0 (k = {k})")
    e = pow2_exponent(np.abs(w).reshape(n, k // MXFP4_GROUP, MXFP4_GROUP).max(axis=-1), E2M1_MAX)
    inv = np.ldexp(np.float32(1), -np.repeat(e, MXFP4_GROUP, axis=1)).astype(np.float32)
    return pack_nibbles(e2m1_codes(w * inv)), e8m0_from_exponent(e)


def dequant_mxfp4(packed, scale) -> np.ndarray:
    """u8 (or i8) [n, k/2] x e8m0 [n, k/32] -> f32 [n, k], exact."""
    v = e2m1_values(unpack_nibbles(packed))
    s = np.asarray(scale).astype(np.float32)
    if s.shape != (v.shape[0], v.shape[1] // MXFP4_GROUP):
        raise ValueError(f"mxfp4 scale shape {s.shape} does not fit codes {v.shape}")
    return v * np.repeat(s, MXFP4_GROUP, axis=1)
