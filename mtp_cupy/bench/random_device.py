"""Random tensors written straight into device memory, in the formats of the real checkpoints: the weights of
the real-dims benchmarks. On CUDA they are drawn with CuPy on the device (no host copy of a 100 GB layer);
on the NumPy device with NumPy. Values are about N(0, 1/k) for a [n, k] weight."""
from __future__ import annotations

import math

import numpy as np

from ..runtime.dtypes import to_bf16
from ..runtime.ptr import DevicePtr
from ..weights.linear import Linear

CHUNK = 1 << 26   # elements generated per step on the device (bounds the temporaries)


class RandomDevice:
    """A source of random device tensors; keeps every allocation in `owners` (hand it to the weights).

    Parameters
    ----------
    gpu : mtp_cupy Backend
        The device the tensors live on.
    seed : int
        Seed of the generator (CuPy's RandomState on CUDA, NumPy's default_rng on the NumPy device).
    """

    def __init__(self, gpu, seed: int):
        self.gpu, self.owners = gpu, []
        if gpu.is_cuda:
            import cupy as cp
            self.cp, self.rs = cp, cp.random.RandomState(seed)
        else:
            self.rng = np.random.default_rng(seed)

    def _alloc(self, nbytes: int):
        buf = self.gpu.alloc(nbytes)
        self.owners.append(buf)
        return buf

    def _put(self, dst: DevicePtr, arr) -> None:
        if self.gpu.is_cuda:
            self.gpu.copy_d2d_async(dst, DevicePtr(arr.data.ptr), arr.nbytes)
            self.gpu.synchronize()
        else:
            self.gpu.copy_h2d(dst, arr)

    def _normal(self, c: int):
        return self.rs.standard_normal(c, dtype=self.cp.float32) if self.gpu.is_cuda else \
            self.rng.standard_normal(c).astype(np.float32)

    def _bytes(self, c: int):
        return self.rs.randint(0, 256, c, dtype=self.cp.uint8) if self.gpu.is_cuda else \
            self.rng.integers(0, 256, c, dtype=np.uint8)

    def f32(self, n: int, scale: float, loc: float = 0.0) -> DevicePtr:
        """n float32 values N(loc, scale^2)."""
        ptr = self._alloc(4 * n).ptr
        for c0 in range(0, n, CHUNK):
            self._put(ptr.offset(4 * c0), self._normal(min(CHUNK, n - c0)) * np.float32(scale) + np.float32(loc))
        return ptr

    def _bf16_buffer(self, n: int, scale: float, loc: float):
        buf = self._alloc(2 * n)
        for c0 in range(0, n, CHUNK):
            x = self._normal(min(CHUNK, n - c0)) * np.float32(scale) + np.float32(loc)
            if self.gpu.is_cuda:
                u = x.view(self.cp.uint32)
                x = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(self.cp.uint16)   # round to nearest even
            else:
                x = to_bf16(x)
            self._put(buf.ptr.offset(2 * c0), x)
        return buf

    def bf16(self, n: int, scale: float, loc: float = 0.0) -> DevicePtr:
        """n bfloat16 values N(loc, scale^2) (rounded to nearest even)."""
        return self._bf16_buffer(n, scale, loc).ptr

    def linears(self, count: int, n: int, k: int) -> list[Linear]:
        """`count` bf16 [n, k] Linears in one allocation, weights N(0, 1/k)."""
        buf = self._bf16_buffer(count * n * k, k ** -0.5, 0.0)
        return [Linear("bf16", n, k, buf.ptr.offset(2 * i * n * k), owners=[buf]) for i in range(count)]

    def codes(self, n: int, mask: int = 0xFF) -> DevicePtr:
        """Random bytes & mask: 0xBF gives e4m3 codes below 2 in magnitude (no NaN); 0xFF any two e2m1 codes."""
        ptr = self._alloc(n).ptr
        for c0 in range(0, n, CHUNK):
            self._put(ptr.offset(c0), self._bytes(min(CHUNK, n - c0)) & mask)
        return ptr

    def e8m0(self, n: int, exponent: int) -> DevicePtr:
        """n e8m0 scales, all 2**exponent."""
        ptr = self._alloc(n).ptr
        self._put(ptr, (self.cp if self.gpu.is_cuda else np).full(n, 127 + exponent, dtype=np.uint8))
        return ptr

    def fp8(self, n: int, k: int) -> Linear:
        """fp8_block_e8m0 [n, k] (DeepSeek-V4's FP8 with power-of-two block scales), values about N(0, 1/k)."""
        e = -round(math.log2(math.sqrt(k))) - 1
        return Linear("fp8_block_e8m0", n, k, self.codes(n * k, 0xBF), self.e8m0(-(-n // 128) * -(-k // 128), e))

    def fp8_block(self, n: int, k: int) -> Linear:
        """fp8_block [n, k] with f32 block scales (DeepSeek-V3 / GLM-5 FP8), values about N(0, 1/k)."""
        s = 2.0 ** (-round(math.log2(math.sqrt(k))) - 1)
        return Linear("fp8_block", n, k, self.codes(n * k, 0xBF), self.f32(-(-n // 128) * -(-k // 128), 0.0, s))

    def mxfp4(self, n: int, k: int) -> Linear:
        """mxfp4 [n, k] (two e2m1 codes a byte, an e8m0 scale per 32), values about N(0, 1/k)."""
        e = -round(math.log2(math.sqrt(k))) - 2
        return Linear("mxfp4", n, k, self.codes(n * k // 2), self.e8m0(n * k // 32, e))
