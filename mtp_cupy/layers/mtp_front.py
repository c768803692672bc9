"""The MTP front every family shares: the new token's embedding and the target's hidden, each normed, then
projected into the block's input (docs/model_math.md A.2, B.3, C.3, D.2).

    concat form (DeepSeek-V3, GLM-5: eh_proj; Qwen3-Next: fc)
        x = proj([enorm(embed(ids)) | hnorm(hidden)])          embedding half first
        The two norms write straight into the halves of the concat rows (row stride 2D): no concat kernel.
        Both norms, and the embedding gather, are one launch (ops.front_norms) in either form.
    split form (DeepSeek-V4: e_proj, h_proj)
        e = e_proj(enorm(embed(ids))) [m, D];  h = h_proj(hnorm(hidden)) [h_rows, D]
        the same math as one projection of the concat, kept apart because V4 adds e to every mHC stream of h.

The front reads the i32 token ids and the bf16 hidden rows from device memory and allocates nothing per call."""
from __future__ import annotations

from dataclasses import dataclass

from .. import ops
from ..errors import ConfigError
from ..runtime.arena import carve
from ..runtime.backend import Backend
from ..runtime.ptr import DevicePtr
from ..weights.linear import Linear
from .norm import Norms


@dataclass
class FrontWeights:
    embed: DevicePtr              # bf16 [vocab, D]
    proj: Linear | None = None    # concat form: [D, 2D]
    e_proj: Linear | None = None  # split form: [D, D] each
    h_proj: Linear | None = None


@dataclass(frozen=True)
class FrontDims:
    hidden: int
    vocab: int
    enorm: str = "enorm"          # the norms' names in the block's Norms
    hnorm: str = "hnorm"


class MtpFront:
    def __init__(self, gpu: Backend, w: FrontWeights, dims: FrontDims, norms: Norms, max_rows: int,
                 invariant: bool = False):
        D = dims.hidden
        concat = w.proj is not None
        if concat == (w.e_proj is not None or w.h_proj is not None):
            raise ConfigError("MTP front: give proj (concat form) or e_proj and h_proj (split form)")
        for name, lin, shape in (("proj", w.proj, (D, 2 * D)), ("e_proj", w.e_proj, (D, D)),
                                 ("h_proj", w.h_proj, (D, D))):
            if lin is not None and (lin.n, lin.k) != shape:
                raise ConfigError(f"MTP front {name}: weight is [{lin.n}, {lin.k}], expected {list(shape)}")
        self.gpu, self.w, self.d, self.norms, self.max_rows = gpu, w, dims, norms, int(max_rows)
        self.inv = bool(invariant)
        # cat: the concat rows [m, 2D] (concat form) or the normed hidden rows (split form); emb: the normed
        # embedding rows (split form)
        regions = {"cat": (4 if concat else 2) * D * self.max_rows} | ({} if concat else {"emb": 2 * D * self.max_rows})
        self._buf, p = carve(gpu, regions)
        self.cat, self.emb = p["cat"], p.get("emb")

    def _norms(self, ids: DevicePtr, hidden: DevicePtr, e_out: DevicePtr, e_stride: int, h_out: DevicePtr,
               h_stride: int, m: int, h_rows: int) -> None:
        """enorm(embed(ids)) into e_out and hnorm(hidden) into h_out (row strides in elements): one launch."""
        if not 1 <= m <= self.max_rows or not 1 <= h_rows <= self.max_rows:
            raise ConfigError(f"MTP front sized for {self.max_rows} rows, got {m} token and {h_rows} hidden rows")
        n, d = self.norms, self.d
        ops.front_norms(self.gpu, self.w.embed, ids, d.vocab, n.weight(d.enorm), hidden, n.weight(d.hnorm), e_out,
                        e_stride, h_out, h_stride, m, h_rows, d.hidden, n.eps, unit_offset=n.unit_offset)

    def forward(self, ids: DevicePtr, hidden: DevicePtr, out: DevicePtr, m: int) -> None:
        """Concat form: out bf16 [m, D] = proj([enorm(embed(ids)) | hnorm(hidden)])."""
        D = self.d.hidden
        self._norms(ids, hidden, self.cat, 2 * D, self.cat.offset(2 * D), 2 * D, m, m)
        ops.linear(self.gpu, self.cat, self.w.proj, out, m, invariant=self.inv)

    def forward_split(self, ids: DevicePtr, hidden: DevicePtr, e_out: DevicePtr, h_out: DevicePtr, m: int,
                      h_rows: int) -> None:
        """Split form: e_out [m, D] = e_proj(enorm(embed(ids))), h_out [h_rows, D] = h_proj(hnorm(hidden))."""
        D = self.d.hidden
        self._norms(ids, hidden, self.emb, D, self.cat, D, m, h_rows)
        ops.linear(self.gpu, self.emb, self.w.e_proj, e_out, m, invariant=self.inv)
        ops.linear(self.gpu, self.cat, self.w.h_proj, h_out, h_rows, invariant=self.inv)

    def weight_bytes_per_step(self, m: int = 1) -> int:
        """Weight bytes one step of m rows reads: the projection(s) (the embedding rows are counted apart)."""
        return sum(x.weight_bytes for x in (self.w.proj, self.w.e_proj, self.w.h_proj) if x is not None)
