"""mHC around one DeepSeek-V4 block (docs/model_math.md B.2): the residual is hc streams per row, X bf16
[rows, hc, D]. Each site (attention, FFN) collapses X into the layer input with hc_pre and folds the layer
output back with hc_post, using the post / comb coefficients hc_pre left for that site; the head collapses
the output streams before the final norm."""
from __future__ import annotations

from .. import ops
from ..errors import ConfigError
from ..runtime.arena import carve
from ..runtime.backend import Backend
from ..runtime.ptr import DevicePtr
from ..weights.deepseek_v4 import HcParams


class Mhc:
    def __init__(self, gpu: Backend, hc: int, dim: int, sites: dict[str, HcParams], head: HcParams | None,
                 rms_eps: float, hc_eps: float, iters: int, max_rows: int = 32):
        if not 1 <= hc <= ops.HC_MAX:
            raise ConfigError(f"hc_mult {hc} outside [1, {ops.HC_MAX}]")
        self.gpu, self.hc, self.dim, self.sites, self.head_params = gpu, hc, dim, sites, head
        self.rms_eps, self.hc_eps, self.iters, self.max_rows = float(rms_eps), float(hc_eps), int(iters), int(max_rows)
        r = self.max_rows
        # per site: post f32 [rows, hc] and comb f32 [rows, hc, hc]; one shared GEMV workspace
        regions = {f"{s}.{c}": 4 * r * hc * (hc if c == "comb" else 1) for s in sites for c in ("post", "comb")}
        self._buf, p = carve(gpu, {**regions, "work": ops.hc_work_bytes(r, dim, hc)})
        self._coef = {s: (p[f"{s}.post"], p[f"{s}.comb"]) for s in sites}
        self._work = p["work"]

    def weight_bytes_per_step(self, m: int = 1) -> int:
        """f32 mHC maps read per step: each site's fn [(2 + hc) hc, hc D] (and the head's [hc, hc D])."""
        hc, D = self.hc, self.dim
        return 4 * hc * D * (len(self.sites) * (2 + hc) * hc + (hc if self.head_params is not None else 0))

    def _rows(self, rows: int) -> None:
        if not 1 <= rows <= self.max_rows:
            raise ConfigError(f"mHC sized for {self.max_rows} rows, got {rows}")

    def expand(self, x: DevicePtr, X: DevicePtr, rows: int, stream=None) -> None:
        """Every stream of row r = x[r] (one hidden into hc streams)."""
        ops.hc_expand(self.gpu, x, X, rows, self.dim, self.hc, stream)

    def add(self, X: DevicePtr, x: DevicePtr, rows: int, stream=None) -> None:
        """X[r, j] += x[r] for every stream j."""
        ops.hc_add(self.gpu, X, x, rows, self.dim, self.hc, stream)

    def pre(self, site: str, X: DevicePtr, x_out: DevicePtr, rows: int, stream=None) -> None:
        """x_out [rows, D] = the site's collapse of X; keeps the site's post / comb for `post`."""
        self._rows(rows)
        p, (post, comb) = self.sites[site], self._coef[site]
        ops.hc_pre(self.gpu, X, p.fn, p.scale, p.base, x_out, post, comb, self._work, rows, self.dim,
                   self.hc, self.rms_eps, self.hc_eps, self.iters, stream)

    def post(self, site: str, f: DevicePtr, X: DevicePtr, rows: int, stream=None) -> None:
        """X = post * f + comb^T X with the coefficients of the site's last `pre` (in place)."""
        self._rows(rows)
        post, comb = self._coef[site]
        ops.hc_post(self.gpu, f, X, post, comb, X, rows, self.dim, self.hc, stream)

    def head(self, X: DevicePtr, y: DevicePtr, rows: int, stream=None) -> None:
        """y [rows, D] = the head collapse of X, or each row's first stream when there are no head weights."""
        self._rows(rows)
        p, D = self.head_params, self.dim
        if p is None:
            for r in range(rows):
                self.gpu.copy_d2d_async(y.offset(2 * r * D), X.offset(2 * r * self.hc * D), 2 * D, stream)
            return
        ops.hc_head(self.gpu, X, p.fn, p.scale, p.base, y, self._work, rows, D, self.hc, self.rms_eps,
                    self.hc_eps, stream)
