"""Norms: the RMSNorm weights of one block by name, with the block's eps and weight convention, so a model's
forward reads `self.norm("post_attention_layernorm", x, y, m)` instead of repeating launch arguments."""
from __future__ import annotations

from .. import ops
from ..errors import ConfigError
from ..runtime.backend import Backend
from ..runtime.ptr import DevicePtr


class Norms:
    """`weights` maps a norm's name to its bf16 [dim] weight; `unit_offset` is Qwen3-Next's (1 + w) convention
    (DeepSeek and GLM scale by w itself)."""

    def __init__(self, gpu: Backend, weights: dict[str, DevicePtr], dim: int, eps: float, unit_offset: bool = False):
        self.gpu, self.w, self.dim, self.eps, self.unit_offset = gpu, dict(weights), int(dim), float(eps), unit_offset

    def weight(self, name: str) -> DevicePtr:
        if name not in self.w:
            raise ConfigError(f"no norm weight {name!r}; have {sorted(self.w)}")
        return self.w[name]

    def __call__(self, name: str, x: DevicePtr, y: DevicePtr, m: int, stream=None) -> None:
        """y [m, dim] = norm `name`(x) (x may be y)."""
        ops.rms_norm(self.gpu, x, self.weight(name), y, m, self.dim, self.eps, unit_offset=self.unit_offset,
                     stream=stream)

    def add(self, name: str, x: DevicePtr, res: DevicePtr, y: DevicePtr, m: int, stream=None) -> None:
        """x += res (bf16, in place), then y = norm `name`(x): one launch, the bits of the two-launch pair."""
        ops.add_rms_norm(self.gpu, x, res, self.weight(name), y, m, self.dim, self.eps,
                         unit_offset=self.unit_offset, stream=stream)

    def strided(self, name: str, x: DevicePtr, y: DevicePtr, m: int, x_row_stride: int, y_row_stride: int,
                stream=None) -> None:
        """The norm of m rows read and written at row strides (elements): e.g. into one half of a concat."""
        D = self.dim
        ops.rms_norm_strided(self.gpu, x, self.weight(name), y, m, 1, D, x_row_stride, D, y_row_stride, D, self.eps,
                             unit_offset=self.unit_offset, stream=stream)
