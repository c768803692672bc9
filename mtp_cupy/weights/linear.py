"""Linear: a projection weight on the device, in the format its checkpoint stored (never dequantised).

`ops.linear(gpu, x, W, y, m)` picks the GEMV/GEMM kernel from `W.fmt`:
    bf16         weight bf16 [n, k]
    fp8_row      weight e4m3 [n, k], scale f32 [n] (per-row; a per-tensor scale is broadcast to [n])
    fp8_block    weight e4m3 [n, k], scale f32 [ceil(n/128), ceil(k/128)] (DeepSeek weight_scale_inv)
    fp8_block_e8m0  same blocks, scale e8m0 bytes (DeepSeek-V4 `.scale`)
    nvfp4        weight u8 [n, k/2] (low nibble = even k), scale e4m3 [n, k/16], scale2 f32 global
    mxfp4        weight u8 [n, k/2] (low nibble = even k), scale e8m0 [n, k/32] (DeepSeek-V4 FP4 experts)"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..runtime.ptr import NULL, DevicePtr

FORMATS = ("bf16", "fp8_row", "fp8_block", "fp8_block_e8m0", "nvfp4", "mxfp4")


@dataclass
class Linear:
    fmt: str
    n: int                      # output features (rows of the weight)
    k: int                      # input features
    weight: DevicePtr
    scale: DevicePtr = NULL
    scale2: float = 1.0         # nvfp4 global scale (weight_scale_2); 1.0 elsewhere
    owners: list[Any] = field(default_factory=list, repr=False)  # DeviceBuffers kept alive

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise ValueError(f"unknown Linear format {self.fmt!r}; one of {FORMATS}")

    def rows(self, start: int, count: int) -> "Linear":
        """A view of output rows [start, start+count) (a vocab shard, a fused split). Block formats need
        start % 128 == 0."""
        from ..errors import InputError
        if not 0 <= start and start + count <= self.n:
            raise InputError(f"rows [{start}, {start + count}) outside {self.n}")
        f = self.fmt
        if f == "bf16":
            return Linear(f, count, self.k, self.weight.offset(start * self.k * 2), owners=self.owners)
        if f == "fp8_row":
            return Linear(f, count, self.k, self.weight.offset(start * self.k), self.scale.offset(start * 4),
                          owners=self.owners)
        if f in ("fp8_block", "fp8_block_e8m0"):
            if start % 128:
                raise InputError(f"{f} row view must start on a 128-row block (got {start})")
            kb = (self.k + 127) // 128
            es = 4 if f == "fp8_block" else 1
            return Linear(f, count, self.k, self.weight.offset(start * self.k),
                          self.scale.offset(start // 128 * kb * es), owners=self.owners)
        per = 16 if f == "nvfp4" else 32
        return Linear(f, count, self.k, self.weight.offset(start * self.k // 2),
                      self.scale.offset(start * (self.k // per)), self.scale2, owners=self.owners)

    @property
    def weight_bytes(self) -> int:
        """Bytes one pass over this weight reads (weights + scales)."""
        return sum(self.storage_bytes())

    def storage_bytes(self) -> tuple[int, int]:
        """(weight bytes, scale bytes), rows contiguous in each."""
        n, k, f = self.n, self.k, self.fmt
        if f == "bf16":
            return 2 * n * k, 0
        if f == "fp8_row":
            return n * k, 4 * n
        if f in ("fp8_block", "fp8_block_e8m0"):
            return n * k, (4 if f == "fp8_block" else 1) * ((n + 127) // 128) * ((k + 127) // 128)
        return n * k // 2, n * k // (16 if f == "nvfp4" else 32)


def stack_problem(parts: list[Linear]) -> str | None:
    """Why `parts` cannot share one weight (stack_rows), or None: one format and k; block formats need every
    part but the last a multiple of 128 rows (the scale blocks then line up), nvfp4 one global scale."""
    f, k = parts[0].fmt, parts[0].k
    if any(p.fmt != f or p.k != k for p in parts):
        return f"parts must share format and k, got {[(p.fmt, p.k) for p in parts]}"
    if f in ("fp8_block", "fp8_block_e8m0") and any(p.n % 128 for p in parts[:-1]):
        return f"{f} parts but the last need multiples of 128 rows, got {[p.n for p in parts]}"
    if f == "nvfp4" and len({p.scale2 for p in parts}) > 1:
        return "nvfp4 parts with different global scales"
    return None


def stack_rows(gpu, parts: list[Linear]) -> Linear | None:
    """One weight holding the output rows of `parts` in order, so that one GEMV computes what the parts would
    in one launch; None where they cannot share one (stack_problem says why). The parts are copied and stay
    valid."""
    if stack_problem(parts):
        return None
    f, k = parts[0].fmt, parts[0].k
    sizes = [p.storage_bytes() for p in parts]
    wbuf = gpu.alloc(sum(w for w, _ in sizes))
    sbuf = gpu.alloc(sum(s for _, s in sizes)) if f != "bf16" else None
    wo = so = 0
    for p, (wb, sb) in zip(parts, sizes):
        gpu.copy_d2d_async(wbuf.ptr.offset(wo), p.weight, wb)
        if sb:
            gpu.copy_d2d_async(sbuf.ptr.offset(so), p.scale, sb)
        wo, so = wo + wb, so + sb
    gpu.synchronize()
    return Linear(f, sum(p.n for p in parts), k, wbuf.ptr, sbuf.ptr if sbuf else NULL, parts[0].scale2,
                  owners=[wbuf] + ([sbuf] if sbuf else []))

