"""Dense SwiGLU FFN (docs/model_math.md section 0): y = down(silu(gate x) * (up x)), for heads without a MoE."""
from __future__ import annotations

from .. import ops
from ..errors import ConfigError
from ..runtime.arena import carve
from ..runtime.backend import Backend
from ..runtime.ptr import DevicePtr
from ..weights.linear import Linear


class DenseFFN:
    """`weights` = (gate [I, D], up [I, D], down [D, I])."""

    def __init__(self, gpu: Backend, weights: tuple[Linear, Linear, Linear], max_rows: int, invariant: bool = False):
        gate, up, down = weights
        if not (gate.n == up.n == down.k and gate.k == up.k == down.n):
            raise ConfigError(f"dense FFN shapes do not chain: gate {gate.n}x{gate.k}, up {up.n}x{up.k}, "
                              f"down {down.n}x{down.k}")
        self.gpu, self.gate, self.up, self.down, self.max_rows = gpu, gate, up, down, int(max_rows)
        self.inv = bool(invariant)
        self.inter = gate.n
        # gate and up outputs side by side; silu_mul writes the product over the gate half
        self._buf, p = carve(gpu, {"g": 2 * self.max_rows * self.inter, "u": 2 * self.max_rows * self.inter})
        self._g, self._u = p["g"], p["u"]

    def weight_bytes_per_step(self, m: int = 1) -> int:
        return self.gate.weight_bytes + self.up.weight_bytes + self.down.weight_bytes

    def forward(self, x: DevicePtr, out: DevicePtr, m: int = 1, stream=None) -> None:
        """out[m, hidden] (bf16) = FFN(x[m, hidden])."""
        if not 1 <= m <= self.max_rows:
            raise ConfigError(f"dense FFN sized for {self.max_rows} rows, got {m}")
        gpu, i = self.gpu, self.inter
        ops.linear(gpu, x, self.gate, self._g, m, stream=stream, invariant=self.inv)
        ops.linear(gpu, x, self.up, self._u, m, stream=stream, invariant=self.inv)
        ops.silu_mul(gpu, self._g, self._u, self._g, m, i, i, i, stream=stream)
        ops.linear(gpu, self._g, self.down, out, m, stream=stream, invariant=self.inv)
