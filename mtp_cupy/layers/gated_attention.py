"""Qwen3-Next gated full attention (docs/model_math.md D.3) over a paged GQA cache (a K cache and a V cache).

q_proj's output is per head `[q_h | gate_h]` (2 * head_dim each). The per-head (1 + w) q_norm reads the q
halves out of that interleave and writes q contiguous, so the attention kernel gets plain `[heads, hd]`
rows and the gate halves stay where sigmoid_gate_mul reads them. q and k are normed before the neox RoPE
on the first `rot_dim` dims of each head; both norms, both RoPEs and the K / V cache writes are one launch
(ops.qk_norm_rope_cache). Per-row positions and slots come from the metadata slabs
(`pos u32 @0, slot i64 @8`, one slab per sequence), as the attention kernel reads seq_len and the block
table there."""
from __future__ import annotations

from dataclasses import dataclass

from .. import ops
from ..cache.paged import PagedKvCache
from ..errors import ConfigError
from ..runtime.arena import carve
from ..runtime.backend import Backend
from ..runtime.ptr import NULL, DevicePtr
from ..runtime.slab import SLOT_OFFSET
from ..weights.linear import Linear, stack_rows
from .rope_tables import default_inv_freq


@dataclass
class GatedAttentionWeights:
    q_proj: Linear               # [2 * heads * head_dim, D]: per head [q_h | gate_h]
    k_proj: Linear               # [kv_heads * head_dim, D]
    v_proj: Linear               # [kv_heads * head_dim, D]
    o_proj: Linear               # [D, heads * head_dim]
    q_norm: DevicePtr            # bf16 [head_dim], (1 + w)
    k_norm: DevicePtr            # bf16 [head_dim], (1 + w)


@dataclass(frozen=True)
class GatedAttentionDims:
    heads: int
    kv_heads: int
    head_dim: int
    rot_dim: int                 # neox RoPE on the first rot_dim dims of each head
    rope_theta: float
    eps: float
    kv_dtype: str = "bf16"       # cache rows bf16, or fp8 e4m3 times kv_scale
    kv_scale: float = 1.0

    @classmethod
    def from_config(cls, cfg, kv_dtype: str = "bf16", kv_scale: float = 1.0) -> "GatedAttentionDims":
        return cls(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rotary_dim, cfg.rope.theta,
                   float(cfg.rms_norm_eps), kv_dtype, float(kv_scale))


class GatedAttention:
    def __init__(self, gpu: Backend, w: GatedAttentionWeights, dims: GatedAttentionDims, kv: PagedKvCache,
                 max_rows: int = 32, max_kv_rows: int = 512, invariant: bool = False):
        H, KV, hd = dims.heads, dims.kv_heads, dims.head_dim
        if H % KV:
            raise ConfigError(f"{H} query heads do not group over {KV} kv heads")
        want = {"q_proj": (2 * H * hd, w.q_proj), "k_proj": (KV * hd, w.k_proj), "v_proj": (KV * hd, w.v_proj)}
        for name, (n, lin) in want.items():
            if lin.n != n:
                raise ConfigError(f"{name} has {lin.n} output rows; {n} expected")
        if w.o_proj.k != H * hd:
            raise ConfigError(f"o_proj takes {w.o_proj.k} inputs; {H * hd} expected")
        self.gpu, self.kv, self.w, self.d, self.inv = gpu, kv, w, dims, bool(invariant)
        self.H, self.KV, self.hd, self.rot, self.eps = H, KV, hd, dims.rot_dim, float(dims.eps)
        self.kv_dtype, self.kv_scale = dims.kv_dtype, float(dims.kv_scale)
        self.max_rows, self.max_kv_rows = int(max_rows), max(int(max_kv_rows), int(max_rows))
        self._inv_freq = gpu.upload(default_inv_freq(dims.rot_dim, dims.rope_theta))
        r, rk = self.max_rows, self.max_kv_rows
        # a decode row's projections land in one row [q | gate interleave (2 H hd) | k (KV hd) | v (KV hd)], in
        # one GEMV where the three weights can share one (stack_rows); prefill rows take [k | v] alone
        self._nq, self._w = 2 * H * hd, KV * hd
        self._qkv, self._kv = stack_rows(gpu, [w.q_proj, w.k_proj, w.v_proj]), stack_rows(gpu, [w.k_proj, w.v_proj])
        sizes = {"qkv": (self._nq + 2 * self._w) * r, "q": H * hd * r, "o": H * hd * r, "kv": 2 * self._w * rk}
        self._buf, self._ptr = carve(gpu, {name: 2 * n for name, n in sizes.items()})

    def weight_bytes_per_step(self, m: int = 1) -> int:
        """Weight bytes one decode step of m rows reads (every projection once for all rows)."""
        return sum(x.weight_bytes for x in (self.w.q_proj, self.w.k_proj, self.w.v_proj, self.w.o_proj))

    def write_kv(self, xn: DevicePtr, m: int, pos: DevicePtr, pos_stride: int, slots: DevicePtr,
                 slot_stride: int, stream=None) -> None:
        """K and V of m rows of the normed input into their cache slots (RoPE on K at `pos`); no attention.
        This is all the drafter prefill and catch-up need: a row's K/V depend only on its own input."""
        if not 1 <= m <= self.max_kv_rows:
            raise ConfigError(f"attention sized for {self.max_kv_rows} K/V rows, got {m}")
        kv, w = self._ptr["kv"], self._w
        self._project(xn, [self._kv] if self._kv else [self.w.k_proj, self.w.v_proj], kv, 2 * w, m, stream)
        self._store_kv(kv, 2 * w, m, pos, pos_stride, slots, slot_stride, stream)

    def _project(self, xn, weights, y, row, m, stream) -> None:
        """y [m, row] = the weights' outputs side by side, one GEMV each."""
        col = 0
        for W in weights:
            ops.linear(self.gpu, xn, W, y.offset(2 * col), m, y_stride=row, stream=stream, invariant=self.inv)
            col += W.n

    def _store_kv(self, x: DevicePtr, row: int, m: int, pos, pos_stride, slots, slot_stride, stream,
                  q_out: DevicePtr = NULL) -> None:
        """One launch over rows of x (row stride `row` elements) laid out as this layer's projections write them: k
        and v heads at the row's last 2 KV hd columns, normed and RoPE'd k and plain v into the caches; with
        `q_out`, the q heads at the row's start ([q_h | gate_h] interleave) normed and RoPE'd there."""
        H, KV, hd, w = self.H, self.KV, self.hd, self._w
        k_off = row - 2 * w
        ops.qk_norm_rope_cache(self.gpu, x, row, H if q_out else 0, 2 * hd, KV, k_off, k_off + w, self.w.q_norm,
                               self.w.k_norm, q_out, H * hd, m, hd, self.eps, pos, pos_stride, self._inv_freq.ptr,
                               self.rot, slots, slot_stride, self.kv.base("k"), self.kv.base("v"),
                               kv_dtype=self.kv_dtype, kv_scale=self.kv_scale, stream=stream)

    def forward(self, xn: DevicePtr, out: DevicePtr, m: int, meta: DevicePtr, meta_stride: int,
                stream=None) -> None:
        """One decode row for each of m sequences: row s writes its K/V at its slab's slot and attends over
        its slab's seq_len rows; out[m, hidden] bf16 = o_proj(attn * sigmoid(gate))."""
        if not 1 <= m <= self.max_rows:
            raise ConfigError(f"attention sized for {self.max_rows} rows, got {m}")
        gpu, H, KV, hd = self.gpu, self.H, self.KV, self.hd
        qg, q, o = self._ptr["qkv"], self._ptr["q"], self._ptr["o"]
        row = self._nq + 2 * self._w
        w = self.w
        self._project(xn, [self._qkv] if self._qkv else [w.q_proj, w.k_proj, w.v_proj], qg, row, m, stream)
        self._store_kv(qg, row, m, meta, meta_stride, meta.offset(SLOT_OFFSET), meta_stride, stream, q_out=q)
        ops.gqa_decode(gpu, q, H * hd, self.kv.base("k"), self.kv.base("v"), meta, meta_stride, o, m, H, KV, hd,
                       float(hd) ** -0.5, kv_dtype=self.kv_dtype, kv_scale=self.kv_scale, stream=stream,
                       invariant=self.inv, out_gate=(qg.offset(2 * hd), row, 2 * hd))   # o * sigmoid(gate)
        ops.linear(gpu, o, self.w.o_proj, out, m, stream=stream, invariant=self.inv)
