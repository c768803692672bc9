"""Qwen3-Next gated full attention (arch_math.md D.3) over a paged GQA cache (a K cache and a V cache).

q_proj's output is per head `[q_h | gate_h]` (2 * head_dim each). The per-head (1 + w) q_norm reads the q
halves out of that interleave and writes q contiguous, so the attention kernel gets plain `[heads, hd]`
rows and the gate halves stay where sigmoid_gate_mul reads them. q and k are normed before the neox RoPE
on the first `rot_dim` dims of each head. Per-row positions and slots come from the metadata slabs
(`pos u32 @0, slot i64 @8`, one slab per sequence), as the attention kernel reads seq_len and the block
table there."""
from __future__ import annotations

from .. import ops
from ..cache.paged import PagedKvCache
from ..runtime.backend import Backend
from ..runtime.arena import carve
from ..runtime.ptr import DevicePtr
from ..weights.linear import Linear
from .rope_tables import default_inv_freq

SLOT_OFFSET = 8  # slot i64 @8 of a metadata slab


class GatedAttention:
    def __init__(self, gpu: Backend, q_proj: Linear, k_proj: Linear, v_proj: Linear, o_proj: Linear,
                 q_norm: DevicePtr, k_norm: DevicePtr, heads: int, kv_heads: int, head_dim: int, rot_dim: int,
                 rope_theta: float, eps: float, kv: PagedKvCache, kv_dtype: str = "bf16", kv_scale: float = 1.0,
                 max_rows: int = 32, max_kv_rows: int = 512):
        H, KV, hd = heads, kv_heads, head_dim
        if H % KV:
            raise ValueError(f"{H} query heads do not group over {KV} kv heads")
        want = {"q_proj": (2 * H * hd, q_proj), "k_proj": (KV * hd, k_proj), "v_proj": (KV * hd, v_proj)}
        for name, (n, w) in want.items():
            if w.n != n:
                raise ValueError(f"{name} has {w.n} output rows; {n} expected")
        if o_proj.k != H * hd:
            raise ValueError(f"o_proj takes {o_proj.k} inputs; {H * hd} expected")
        self.gpu, self.kv = gpu, kv
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = q_proj, k_proj, v_proj, o_proj
        self.q_norm, self.k_norm = q_norm, k_norm
        self.H, self.KV, self.hd, self.rot, self.eps = H, KV, hd, rot_dim, float(eps)
        self.kv_dtype, self.kv_scale = kv_dtype, float(kv_scale)
        self.max_rows, self.max_kv_rows = int(max_rows), max(int(max_kv_rows), int(max_rows))
        self._inv_freq = gpu.upload(default_inv_freq(rot_dim, rope_theta))
        r, rk = self.max_rows, self.max_kv_rows
        sizes = {"qg": 2 * H * hd * r, "q": H * hd * r, "o": H * hd * r, "k": KV * hd * rk, "v": KV * hd * rk}
        self._buf, self._ptr = carve(gpu, {name: 2 * n for name, n in sizes.items()})

    @property
    def weight_bytes(self) -> int:
        return sum(w.weight_bytes for w in (self.q_proj, self.k_proj, self.v_proj, self.o_proj))

    def write_kv(self, xn: DevicePtr, m: int, pos: DevicePtr, pos_stride: int, slots: DevicePtr,
                 slot_stride: int, stream=None) -> None:
        """K and V of m rows of the normed input into their cache slots (RoPE on K at `pos`); no attention.
        This is all the drafter prefill and catch-up need: a row's K/V depend only on its own input."""
        if not 1 <= m <= self.max_kv_rows:
            raise ValueError(f"attention sized for {self.max_kv_rows} K/V rows, got {m}")
        gpu, KV, hd = self.gpu, self.KV, self.hd
        k, v, w = self._ptr["k"], self._ptr["v"], KV * hd
        ops.linear(gpu, xn, self.k_proj, k, m, stream=stream)
        ops.linear(gpu, xn, self.v_proj, v, m, stream=stream)
        ops.rms_norm_strided(gpu, k, self.k_norm, k, m, KV, hd, w, hd, w, hd, self.eps, unit_offset=True,
                             stream=stream)
        ops.rope(gpu, k, pos, pos_stride, m, KV, hd, self.rot, 0, w, hd, self._inv_freq.ptr, interleaved=False,
                 stream=stream)
        for src, cache in ((k, "k"), (v, "v")):
            ops.reshape_and_cache(gpu, src, w, slots, slot_stride, self.kv.base(cache), m, w, w, 0,
                                  dtype=self.kv_dtype, scale=self.kv_scale, stream=stream)

    def forward(self, xn: DevicePtr, out: DevicePtr, m: int, meta: DevicePtr, meta_stride: int,
                stream=None) -> None:
        """One decode row for each of m sequences: row s writes its K/V at its slab's slot and attends over
        its slab's seq_len rows; out[m, hidden] bf16 = o_proj(attn * sigmoid(gate))."""
        if not 1 <= m <= self.max_rows:
            raise ValueError(f"attention sized for {self.max_rows} rows, got {m}")
        gpu, H, KV, hd = self.gpu, self.H, self.KV, self.hd
        qg, q, o = self._ptr["qg"], self._ptr["q"], self._ptr["o"]
        ops.linear(gpu, xn, self.q_proj, qg, m, stream=stream)
        ops.rms_norm_strided(gpu, qg, self.q_norm, q, m, H, hd, 2 * H * hd, 2 * hd, H * hd, hd, self.eps,
                             unit_offset=True, stream=stream)
        ops.rope(gpu, q, meta, meta_stride, m, H, hd, self.rot, 0, H * hd, hd, self._inv_freq.ptr,
                 interleaved=False, stream=stream)
        self.write_kv(xn, m, meta, meta_stride, meta.offset(SLOT_OFFSET), meta_stride, stream)
        ops.gqa_decode(gpu, q, H * hd, self.kv.base("k"), self.kv.base("v"), meta, meta_stride, o, m, H, KV, hd,
                       float(hd) ** -0.5, kv_dtype=self.kv_dtype, kv_scale=self.kv_scale, stream=stream)
        ops.sigmoid_gate_mul(gpu, o, qg.offset(2 * hd), o, m, H, hd, 2 * H * hd, 2 * hd, stream=stream)
        ops.linear(gpu, o, self.o_proj, out, m, stream=stream)

