"""The references' own checkpoint reader: raw bytes from safetensors' `deserialize`, decoded here from the
published encodings. It never calls mtp_cupy (its reader, dtypes, dequantisers or quantisers), so a loader
that maps the wrong key, or a convention shared by our writer and our loader, shows as a difference.

Encodings (OCP FP8 / MX specs, NVIDIA ModelOpt, DeepSeek's inference code):
  BF16      the high 16 bits of an IEEE binary32
  F8_E4M3   e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is subnormal (m/8 * 2^-6);
            S.1111.111 is NaN; no infinities; largest finite 448
  F8_E8M0   2^(byte - 127); 0xFF is NaN
  E2M1      (FP4, two per U8/I8 byte, the LOW nibble the even element) sign, 2 exponent bits (bias 1),
            1 mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6

A projection `<m>.weight` is decoded from its dtype and sibling keys:
  F8_E4M3 + `weight_scale_inv` (F32 or E8M0) [ceil(n/128), ceil(k/128)]   block FP8 (DeepSeek, GLM, Qwen)
  F8_E4M3 + `scale` (E8M0), same blocks                                  block FP8 (DeepSeek-V4)
  F8_E4M3 + `weight_scale` F32 of 1 or n values                           per-tensor / per-row FP8
  U8 [n, k/2] + `weight_scale` F8_E4M3 [n, k/16] + `weight_scale_2` F32   NVFP4 (ModelOpt):
            value = e2m1 * block scale * scale_2
  I8/U8 [n, k/2] + `scale` E8M0 [n, k/32]                                 MXFP4 (DeepSeek-V4 experts)
`read_weights(path)` gives every tensor as float64 under its key, projections dequantised and their scale
siblings dropped; integer tensors (V4's tid2eid) stay integers."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors import deserialize

BLOCK = 128
RAW = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2", "F8_E4M3": "u1", "F8_E8M0": "u1",
       "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1", "U8": "u1", "BOOL": "?"}
SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale_2", ".weight_scale", ".input_scale")


def _e4m3_table() -> np.ndarray:
    v = np.empty(256)
    for c in range(256):
        sign, e, m = (-1.0 if c & 0x80 else 1.0), (c >> 3) & 0xF, c & 7
        if e == 15 and m == 7:
            v[c] = np.nan
        else:
            v[c] = sign * (m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return v


E4M3 = _e4m3_table()                                           # code -> value
E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])


def e8m0(codes) -> np.ndarray:
    c = np.asarray(codes).astype(np.float64)
    return np.where(c == 255, np.nan, np.exp2(c - 127.0))


def e2m1_unpack(packed) -> np.ndarray:
    """[n, k/2] bytes -> [n, k] values (low nibble first)."""
    b = np.asarray(packed).view(np.uint8)
    return E2M1[np.stack([b & 0x0F, b >> 4], axis=-1).reshape(b.shape[0], -1)]


def values(dtype: str, raw: np.ndarray) -> np.ndarray:
    """One stored tensor's values: floats as float64, integers unchanged."""
    if dtype == "BF16":
        return (raw.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    if dtype == "F8_E4M3":
        return E4M3[raw]
    if dtype == "F8_E8M0":
        return e8m0(raw)
    if dtype.startswith("F"):
        return raw.astype(np.float64)
    return raw


class RawCheckpoint:
    """Every tensor of a checkpoint directory's *.safetensors files as (dtype string, raw array)."""

    def __init__(self, path):
        self.path = Path(path)
        self.raw: dict[str, tuple[str, np.ndarray]] = {}
        files = sorted(self.path.glob("*.safetensors"))
        assert files, f"no .safetensors files in {self.path}"
        for f in files:
            for name, t in deserialize(f.read_bytes()):
                assert name not in self.raw, f"{name} in two files"
                arr = np.frombuffer(bytes(t["data"]), np.dtype(RAW[t["dtype"]])).reshape(t["shape"])
                self.raw[name] = (t["dtype"], arr)
        self.config = json.loads((self.path / "config.json").read_text())

    def has(self, key: str) -> bool:
        return key in self.raw

    def dtype(self, key: str) -> str:
        return self.raw[key][0]

    def value(self, key: str) -> np.ndarray:
        return values(*self.raw[key])

    def projection(self, module: str) -> np.ndarray:
        """`<module>.weight` dequantised to float64 [n, k]."""
        dt, w = self.raw[module + ".weight"]
        has = lambda s: self.has(module + s)              # noqa: E731
        if dt == "F8_E4M3":
            q = E4M3[w]
            if has(".weight_scale_inv") or has(".scale"):
                s = self.value(module + (".weight_scale_inv" if has(".weight_scale_inv") else ".scale"))
                n, k = q.shape
                assert s.shape == (-(-n // BLOCK), -(-k // BLOCK)), (module, s.shape, q.shape)
                return q * np.kron(s, np.ones((BLOCK, BLOCK)))[:n, :k]
            s = self.value(module + ".weight_scale").reshape(-1)
            assert s.size in (1, q.shape[0]), (module, s.shape)
            return q * (s[:, None] if s.size > 1 else s[0])
        if dt in ("U8", "I8") and has(".weight_scale_2"):
            s = self.value(module + ".weight_scale")
            return e2m1_unpack(w) * np.repeat(s, 16, axis=1) * float(self.value(module + ".weight_scale_2"))
        if dt in ("U8", "I8") and has(".scale"):
            return e2m1_unpack(w) * np.repeat(self.value(module + ".scale"), 32, axis=1)
        assert dt.startswith("F") or dt == "BF16", f"{module}.weight: unexpected {dt} without scales"
        return values(dt, w)

    def is_scale(self, key: str) -> bool:
        if key.endswith(".scale") and self.has(key[:-len(".scale")] + ".weight"):
            return True
        return any(key.endswith(s) and self.has(key[:-len(s)] + ".weight") for s in SCALE_SUFFIXES)

    def weights(self) -> dict[str, np.ndarray]:
        out = {}
        for k in self.raw:
            if self.is_scale(k):
                continue
            out[k] = self.projection(k[:-len(".weight")]) if k.endswith(".weight") and self.raw[k][1].ndim == 2 \
                else self.value(k)
        return out


def read_weights(path) -> tuple[dict[str, np.ndarray], dict]:
    """(every tensor as float64 under its key, projections dequantised; config.json as a dict)."""
    ck = RawCheckpoint(path)
    return ck.weights(), ck.config


# -- quantisers: what a proposer computes when it quantises a BF16 projection at load ------------------------
def _round_to(x: np.ndarray, table: np.ndarray) -> np.ndarray:
    """x (float32) to the nearest value of `table` (the non-negative finite values of a format, ascending,
    index = code, so an even index is an even mantissa), ties to even, saturating at the largest."""
    a = np.minimum(np.abs(x).astype(np.float64), table[-1])
    hi = np.clip(np.searchsorted(table, a), 1, len(table) - 1)
    lo = hi - 1
    dlo, dhi = a - table[lo], table[hi] - a
    pick = np.where((dhi < dlo) | ((dhi == dlo) & (hi % 2 == 0)), hi, lo)
    return np.copysign(table[pick], x)


E4M3_POS = E4M3[:127]           # codes 0..126: 0 .. 448
E2M1_POS = E2M1[:8]


def quant_fp8_rows(w: np.ndarray) -> np.ndarray:
    """Per-row FP8, dequantised: s = rowmax|w| / 448 (fp32; 1 for a zero row), e4m3(w / s) * s."""
    w = np.asarray(w, np.float32)
    amax = np.abs(w).max(axis=1)
    s = np.where(amax > 0, amax / np.float32(448), np.float32(1)).astype(np.float32)
    return _round_to((w / s[:, None]).astype(np.float32), E4M3_POS) * s[:, None].astype(np.float64)


def quant_nvfp4(w: np.ndarray) -> np.ndarray:
    """ModelOpt NVFP4, dequantised: scale_2 = amax / (6 * 448); per 16 inputs a block scale
    e4m3(clamp(block amax / (6 scale_2), 2^-9, 448)) (1 for a zero block); codes e2m1(w / (block * scale_2))."""
    w = np.asarray(w, np.float32)
    n, k = w.shape
    amax = np.float32(np.abs(w).max())
    s2 = np.float32(amax / np.float32(6 * 448)) if amax > 0 else np.float32(1)
    bamax = np.abs(w).reshape(n, k // 16, 16).max(axis=-1)
    bs = np.where(bamax > 0, np.clip(bamax / (np.float32(6) * s2), np.float32(2.0 ** -9), np.float32(448)),
                  np.float32(1)).astype(np.float32)
    bs = _round_to(bs, E4M3_POS).astype(np.float32)
    denom = np.repeat((bs * s2).astype(np.float32), 16, axis=1)
    codes = _round_to((w / denom).astype(np.float32), E2M1_POS)
    return codes * np.repeat(bs.astype(np.float64), 16, axis=1) * float(s2)


# -- encoders: hand-built FP8 / FP4 tensors for checkpoints our writer did not write ------------------------
def encode_e4m3(x: np.ndarray) -> np.ndarray:
    """The e4m3fn code (uint8) of the nearest value to each x (ties to even, saturating)."""
    x = np.asarray(x, np.float64)
    v = _round_to(x.astype(np.float32), E4M3_POS)
    codes = np.searchsorted(E4M3_POS, np.abs(v)).astype(np.uint8)
    return codes | np.where(np.signbit(v) & (v != 0), np.uint8(0x80), np.uint8(0))


def encode_e2m1(x: np.ndarray) -> np.ndarray:
    """The e2m1 code (0..15) of the nearest value to each x (ties to even, saturating)."""
    v = _round_to(np.asarray(x, np.float32), E2M1_POS)
    codes = np.searchsorted(E2M1_POS, np.abs(v)).astype(np.uint8)
    return codes | np.where(np.signbit(v) & (v != 0), np.uint8(8), np.uint8(0))


def pack_e2m1(codes: np.ndarray) -> np.ndarray:
    """[n, k] codes -> [n, k/2] bytes, the even element in the low nibble."""
    c = np.asarray(codes, np.uint8)
    return (c[:, 0::2] | (c[:, 1::2] << 4)).astype(np.uint8)
