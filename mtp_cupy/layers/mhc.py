"""mHC around one DeepSeek-V4 block (docs/model_math.md B.2): the residual is hc streams per row, X bf16
[rows, hc, D]. Each site (attention, FFN) collapses X into the layer input with hc_pre and folds the layer
output back with hc_post, using the post / comb coefficients hc_pre left for that site; the head collapses
the output streams before the final norm. The collapse leaves comb as its Sinkhorn logits and hc_post runs the
Sinkhorn before its PDL wait, beside the layer's last kernel: the layer between (attention, MoE) always holds a
kernel that waits before it triggers, which that early read needs (ops.hc_post; tests/test_kernel_pdl.py checks
a step's launches).

A step runs them with their neighbours, the RMSNorm after each collapse in the collapse's launch:

    add_pre("attn", ...)          X = streams + e_proj(e); xn = attn_norm(collapse_attn(X))   2 launches (B <= 32)
    post_pre("attn", ..., "ffn")  X = post_attn(f, X);     xn = ffn_norm(collapse_ffn(X))     3
    post_head("ffn", ...)         X = post_ffn(f, X);      xn = norm(collapse_head(X))        3

Which launches fuse was measured (H100, V4-Flash dims, one site's launches graphed alone, µs at 1 / 16 / 64 rows):
the norm in the finishing kernel always pays (post site 17.9 / 23.5 / 38.0 -> 16.2 / 20.3 / 34.4); the add in the
mix pays up to 32 rows (18.9 / 24.8 / 39.5 -> 15.0 / 19.6 / 42.2 with both); hc_post in the mix never did (its
blocks then read every stream of a column: 16.0 / 20.4 / 42.9). Every route gives the same bits."""
from __future__ import annotations

from .. import ops
from ..errors import ConfigError
from ..runtime.arena import carve
from ..runtime.backend import Backend
from ..runtime.ptr import DevicePtr
from ..weights.deepseek_v4 import HcParams

ADD_MIX_ROWS = 32   # most rows whose hc_add runs inside the mix's launch (hc_add_mix; measured above)


class Mhc:
    def __init__(self, gpu: Backend, hc: int, dim: int, sites: dict[str, HcParams], head: HcParams | None,
                 rms_eps: float, hc_eps: float, iters: int, max_rows: int = 32, norm_eps: float | None = None):
        """`rms_eps`: the weightless norm folded into the coefficient GEMV; `norm_eps`: the layer RMSNorms applied
        to each collapse (default rms_eps, as in V4)."""
        if not 1 <= hc <= ops.HC_MAX:
            raise ConfigError(f"hc_mult {hc} outside [1, {ops.HC_MAX}]")
        self.gpu, self.hc, self.dim, self.sites, self.head_params = gpu, hc, dim, sites, head
        self.rms_eps, self.hc_eps, self.iters, self.max_rows = float(rms_eps), float(hc_eps), int(iters), int(max_rows)
        self.norm_eps = self.rms_eps if norm_eps is None else float(norm_eps)
        r = self.max_rows
        # per site: post f32 [rows, hc] and comb's Sinkhorn logits f32 [rows, hc, hc]; one shared GEMV workspace
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

    def _pre_norm(self, site: str, X: DevicePtr, norm_w: DevicePtr, y: DevicePtr, rows: int, stream) -> None:
        p, (post, comb) = self.sites[site], self._coef[site]
        ops.hc_pre_norm(self.gpu, X, self._work, p.scale, p.base, norm_w, y, post, comb, rows, self.dim, self.hc,
                        self.rms_eps, self.hc_eps, self.norm_eps, stream)

    def add_pre(self, site: str, src: DevicePtr, src_hc: int, e: DevicePtr, X: DevicePtr, norm_w: DevicePtr,
                y: DevicePtr, rows: int, stream=None) -> None:
        """X [rows, hc, D] = src + e[r] on every stream (src: [rows, hc, D], may be X; or [rows, D] with src_hc 1,
        one hidden expanded into hc streams), then y [rows, D] = RMSNorm(norm_w) of the site's collapse of X.
        Keeps the site's post / comb for `post_pre` / `post_head`."""
        self._rows(rows)
        if src_hc not in (1, self.hc):
            raise ConfigError(f"mHC add_pre: src_hc {src_hc} must be 1 or hc {self.hc}")
        fn, D, hc, mix = self.sites[site].fn, self.dim, self.hc, ops.hc_mix_width(self.hc)
        if rows <= ADD_MIX_ROWS:
            ops.hc_add_mix(self.gpu, src, src_hc, e, X, fn, self._work, rows, D, hc, mix, stream)
        else:
            if src_hc == 1:
                ops.hc_expand(self.gpu, src, X, rows, D, hc, stream)
            ops.hc_add(self.gpu, X, e, rows, D, hc, stream)
            ops.hc_mix(self.gpu, X, fn, self._work, rows, D, hc, mix, stream)
        self._pre_norm(site, X, norm_w, y, rows, stream)

    def post_pre(self, prev: str, f: DevicePtr, X: DevicePtr, site: str, norm_w: DevicePtr, y: DevicePtr, rows: int,
                 stream=None) -> None:
        """X = post * f + comb^T X with `prev`'s coefficients (in place), then y = RMSNorm(norm_w) of the site's
        collapse of X."""
        self._rows(rows)
        post, comb = self._coef[prev]
        ops.hc_post(self.gpu, f, X, post, comb, X, rows, self.dim, self.hc, stream, self.hc_eps, self.iters)
        ops.hc_mix(self.gpu, X, self.sites[site].fn, self._work, rows, self.dim, self.hc, ops.hc_mix_width(self.hc),
                   stream)
        self._pre_norm(site, X, norm_w, y, rows, stream)

    def post_head(self, prev: str, f: DevicePtr, X: DevicePtr, norm_w: DevicePtr, y: DevicePtr, rows: int,
                  stream=None) -> None:
        """X = `prev`'s post (as post_pre), then y [rows, D] = RMSNorm(norm_w) of the head collapse of X (of each
        row's first stream when there are no head weights)."""
        self._rows(rows)
        p, D, hc, (post, comb) = self.head_params, self.dim, self.hc, self._coef[prev]
        ops.hc_post(self.gpu, f, X, post, comb, X, rows, D, hc, stream, self.hc_eps, self.iters)
        if p is None:
            ops.rms_norm_strided(self.gpu, X, norm_w, y, rows, 1, D, hc * D, D, D, D, self.norm_eps, stream=stream)
            return
        ops.hc_mix(self.gpu, X, p.fn, self._work, rows, D, hc, hc, stream)
        ops.hc_head_norm(self.gpu, X, self._work, p.scale, p.base, norm_w, y, rows, D, hc, self.rms_eps, self.hc_eps,
                         self.norm_eps, stream)
