"""Element types shared by both devices. bf16 travels as raw 16-bit words; numpy views use ml_dtypes."""
import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
FP4 = np.dtype(ml_dtypes.float4_e2m1fn)  # one code per byte in numpy; the device packs two per byte

NAMES = {"bf16": BF16, "f32": np.dtype(np.float32), "f16": np.dtype(np.float16), "fp8": FP8,
         "u8": np.dtype(np.uint8), "i32": np.dtype(np.int32), "u32": np.dtype(np.uint32),
         "i64": np.dtype(np.int64), "u16": np.dtype(np.uint16), "e8m0": E8M0, "f64": np.dtype(np.float64)}


def dtype(name) -> np.dtype:
    if isinstance(name, str):
        return NAMES[name]
    return np.dtype(name)


def to_bf16(x) -> np.ndarray:
    """float -> bf16, round to nearest even (what __float2bfloat16_rn does)."""
    return np.asarray(x, dtype=np.float32).astype(BF16)


def to_fp8(x) -> np.ndarray:
    """float -> e4m3 saturating to +-448 (CUDA's __NV_SATFINITE); ml_dtypes alone would give NaN."""
    return np.clip(np.asarray(x, dtype=np.float32), -448.0, 448.0).astype(FP8)


def bf16_round(x) -> np.ndarray:
    """Round to bf16 and back to float32."""
    return to_bf16(x).astype(np.float32)
