"""Multi-head latent attention (MLA), absorbed decode form over a paged latent cache (docs/model_math.md A.3).

    cq = rms(q_a(x); q_a_layernorm)            (or x itself when there is no q LoRA)
    q_nope[h] = q_b rows h*(nope+rope) + [0, nope) . cq      -> [H, nope]
    Q[h, C:]  = q_b rows h*(nope+rope) + [nope, nope+rope) . cq, then RoPE at the row's position
    Q[h, :C]  = W_UK[h]^T q_nope[h]            (absorption: q in latent space)
    a = kv_a(x) = [c | k_pe];  c = rms(c; kv_a_layernorm);  k_pe = RoPE(k_pe)   -> the cache row [c | k_pe]
    o_lat = attention(Q, cache rows; scale)    (single KV head; value = the first C columns of a row)
    o[h] = W_UV[h] o_lat[h];  out = o_proj(o)

q_b is one streaming GEMV into [H, nope + rope]; RoPE rotates the rope columns from there into Q's rope
columns and W_UK^T reads q_nope in place (group stride nope + rope), so no copy kernel runs; W_UV is read in
place from kv_b_proj by a grouped GEMV. Positions and cache slots are read on the device through (pointer,
stride) pairs: from the metadata slabs in decode (`pos u32 @0, slot i64 @8`, one slab per sequence), from packed
arrays in `write_kv`. General over heads/dims/eps/RoPE pairing so DeepSeek-V3 and GLM-5 share it; `sel` (DSA
selected rows) passes through to ops.mla_decode."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import ops
from ..cache.paged import PagedKvCache
from ..errors import ConfigError
from ..runtime.backend import Backend
from ..runtime.arena import carve
from ..runtime.ptr import NULL, DevicePtr
from ..runtime.slab import SLOT_OFFSET
from ..weights.linear import Linear, stack_rows
from .rope_tables import default_inv_freq, yarn_inv_freq, yarn_mscale


@dataclass(frozen=True)
class MlaDims:
    heads: int
    q_lora_rank: int | None      # None: q is projected from x directly
    kv_lora_rank: int            # C
    qk_nope: int
    qk_rope: int
    v_head: int
    eps: float

    @property
    def row_width(self) -> int:
        """Cache row: [c (C) | k_pe (rope)]."""
        return self.kv_lora_rank + self.qk_rope

    @classmethod
    def from_config(cls, cfg, heads: int | None = None) -> "MlaDims":
        """From a DeepSeek-V3-style config (V3, GLM-5); `heads` overrides the head count (a rank's shard)."""
        return cls(cfg.num_attention_heads if heads is None else heads, cfg.q_lora_rank, cfg.kv_lora_rank,
                   cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, float(cfg.rms_norm_eps))


@dataclass(frozen=True)
class MlaRope:
    """The RoPE of q_pe / k_pe and the softmax scale it implies."""
    inv_freq: np.ndarray         # f32 [rope / 2]
    mscale: float                # cos/sin magnitude
    softmax_scale: float
    interleaved: bool = True     # GPT-J pairs (DeepSeek, GLM-5 main attention); False: neox halves

    @classmethod
    def from_config(cls, cfg) -> "MlaRope":
        """From a DeepSeek-V3-style config's RoPE (docs/model_math.md A.3/A.4): YaRN frequencies with cos/sin scaled by
        mscale(f, mscale) / mscale(f, mscale_all_dim) and softmax scale d^-0.5 * mscale(f, mscale_all_dim)^2."""
        rope, qk_nope, qk_rope, interleaved = cfg.rope, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.rope_interleave
        scale = (qk_nope + qk_rope) ** -0.5
        if not rope.yarn:
            return cls(default_inv_freq(qk_rope, rope.theta), 1.0, scale, interleaved)
        if rope.original_max_position_embeddings is None:
            raise ConfigError("YaRN rope needs original_max_position_embeddings")
        f = rope.factor
        inv = yarn_inv_freq(qk_rope, rope.theta, f, rope.original_max_position_embeddings, rope.beta_fast,
                            rope.beta_slow)
        m_all = yarn_mscale(f, rope.mscale_all_dim)
        mag = rope.attention_factor if rope.attention_factor is not None else yarn_mscale(f, rope.mscale) / m_all
        return cls(inv, float(mag), scale * m_all * m_all, interleaved)


@dataclass
class MlaWeights:
    q_a: Linear | None           # [q_lora, D]
    q_a_norm: DevicePtr          # bf16 [q_lora] (NULL without q LoRA)
    q_b: Linear                  # [H*(nope+rope), q_lora or D]; bf16 / fp8_block / fp8_block_e8m0
    kv_a: Linear                 # [C + rope, D]
    kv_a_norm: DevicePtr         # bf16 [C]
    w_uk_t: Linear               # [H*C, nope] (W_UK transposed per head); grouped-GEMV format
    kv_b: Linear                 # [H*(nope+v), C]; W_UV rows read in place; grouped-GEMV format
    o_proj: Linear               # [D, H*v]


class MlaAttention:
    def __init__(self, gpu: Backend, w: MlaWeights, dims: MlaDims, rope: MlaRope, kv: PagedKvCache,
                 cache: str = "latent", layer: int = 0, max_rows: int = 1, max_kv_rows: int = 512,
                 invariant: bool = False):
        H, C, dn, dr, dv = dims.heads, dims.kv_lora_rank, dims.qk_nope, dims.qk_rope, dims.v_head
        qin = dims.q_lora_rank or w.kv_a.k
        want = {"q_b": (w.q_b, H * (dn + dr), qin), "kv_a": (w.kv_a, C + dr, w.kv_a.k),
                "w_uk_t": (w.w_uk_t, H * C, dn), "kv_b": (w.kv_b, H * (dn + dv), C), "o_proj": (w.o_proj, w.kv_a.k, H * dv)}
        if dims.q_lora_rank:
            want["q_a"] = (w.q_a, dims.q_lora_rank, w.kv_a.k)
        for name, (lin, n, k) in want.items():
            if lin is None or (lin.n, lin.k) != (n, k):
                raise ConfigError(f"MLA {name}: expected [{n}, {k}], got {None if lin is None else [lin.n, lin.k]}")
        if kv.specs[cache].row_width != dims.row_width or kv.specs[cache].dtype != "bf16":
            raise ConfigError(f"MLA cache {cache!r} must hold bf16 rows of {dims.row_width}")
        self.gpu, self.w, self.d, self.rope, self.kv, self.inv = gpu, w, dims, rope, kv, bool(invariant)
        self.cache, self.layer = cache, layer
        self.max_rows, self.max_kv_rows = int(max_rows), max(int(max_kv_rows), int(max_rows))
        self._inv_freq = gpu.upload(np.asarray(rope.inv_freq, np.float32))
        r, rk = self.max_rows, self.max_kv_rows
        # a decode row's q_a and kv_a outputs side by side, [q latent | latent row] (one GEMV where the two
        # weights can share one); prefill rows take kv_a alone
        ql = dims.q_lora_rank or 0
        self._qkv_a = stack_rows(gpu, [w.q_a, w.kv_a]) if ql and ql % 8 == 0 and dims.row_width % 8 == 0 else None
        sizes = {"cq": ql * r, "qkv": (ql + dims.row_width) * r if ql else 0, "qb": H * (dn + dr) * r,
                 "Q": H * dims.row_width * r, "o_lat": H * C * r, "o": H * dv * r, "kv": dims.row_width * rk}
        self._buf, self._ptr = carve(gpu, {name: 2 * n for name, n in sizes.items()})   # 256-byte aligned
        # W_UK^T and W_UV per head on tensor cores (each head's tile read once per 8 rows) where the format allows
        self._uk_tab = ops.upload_group_table(gpu, w.w_uk_t, H, C)
        self._uv_tab = ops.upload_group_table(gpu, w.kv_b, H, dv, dn, dn + dv)

    def weight_bytes_per_step(self, m: int = 1) -> int:
        """Weight bytes one decode step of m rows reads (W_UK^T and the W_UV half of kv_b_proj), once for all rows."""
        w = self.w
        lins = [w.q_b, w.kv_a, w.w_uk_t, w.o_proj] + ([w.q_a] if w.q_a is not None else [])
        return sum(x.weight_bytes for x in lins) + w.kv_b.weight_bytes * self.d.v_head // (self.d.qk_nope + self.d.v_head)

    def _store_latent(self, kvp: DevicePtr, row: int, m: int, pos: DevicePtr, pos_stride: int, slots: DevicePtr,
                      slot_stride: int, stream) -> None:
        """kv_a outputs (row stride `row` elements) -> the cache rows [rms(c) | RoPE(k_pe)] at their slots, in one
        launch (kv_a's outputs are only read)."""
        d = self.d
        ops.norm_rope(self.gpu, kvp, row, d.row_width, m, 1, self.w.kv_a_norm, d.kv_lora_rank, d.row_width, d.eps, pos,
                      pos_stride, self._inv_freq.ptr, d.kv_lora_rank, d.qk_rope, self.rope.interleaved, self.rope.mscale,
                      slots=slots, slot_stride=slot_stride, cache=self.kv.base(self.cache, self.layer), stream=stream)

    def write_kv(self, xn: DevicePtr, m: int, pos: DevicePtr, pos_stride: int, slots: DevicePtr,
                 slot_stride: int, stream=None) -> None:
        """Prefill / catch-up: the cache rows of m normed inputs (u32 positions at pos + r*pos_stride, i64
        slots at slots + r*slot_stride bytes); no attention: a latent row depends only on its own input."""
        if not 1 <= m <= self.max_kv_rows:
            raise ConfigError(f"MLA sized for {self.max_kv_rows} cache rows per call, got {m}")
        kvp = self._ptr["kv"]
        ops.linear(self.gpu, xn, self.w.kv_a, kvp, m, stream=stream, invariant=self.inv)
        self._store_latent(kvp, self.d.row_width, m, pos, pos_stride, slots, slot_stride, stream)

    def forward(self, xn: DevicePtr, out: DevicePtr, m: int, meta: DevicePtr, meta_stride: int,
                sel: DevicePtr = NULL, sel_stride: int = 0, stream=None) -> None:
        """Decode m sequences, one new row each: xn bf16 [m, D] (input_layernorm'ed) -> out bf16 [m, D].
        Sequence s's slab at meta + s*meta_stride gives its position, the slot its row is written to, and
        the seq_len / block table the attention reads (the new row included). The pieces are public so a
        variant (DSA) can run its indexer between them: project (the row written, the q latent), absorbed_q,
        attend."""
        if not 1 <= m <= self.max_rows:
            raise ConfigError(f"MLA sized for {self.max_rows} decode rows, got {m}")
        self.absorbed_q(self.project(xn, m, meta, meta_stride, stream), m, meta, meta_stride, stream)
        self.attend(out, m, meta, meta_stride, sel, sel_stride, stream)

    def project(self, xn: DevicePtr, m: int, meta: DevicePtr, meta_stride: int, stream=None) -> DevicePtr:
        """m decode rows: each row's latent cache row written at its slab's slot; returns the input of q_b,
        rms(q_a(xn); q_a_layernorm) [m, q_lora] with a q LoRA, else xn itself."""
        w, d, p = self.w, self.d, self._ptr
        slots = meta.offset(SLOT_OFFSET)
        ql = d.q_lora_rank
        if self._qkv_a is None:
            MlaAttention.write_kv(self, xn, m, meta, meta_stride, slots, meta_stride, stream)   # the latent row only
            if w.q_a is None:
                return xn
            ops.linear(self.gpu, xn, w.q_a, p["cq"], m, stream=stream, invariant=self.inv)
            ops.rms_norm(self.gpu, p["cq"], w.q_a_norm, p["cq"], m, ql, d.eps, stream=stream)
            return p["cq"]
        row = ql + d.row_width
        ops.linear(self.gpu, xn, self._qkv_a, p["qkv"], m, stream=stream, invariant=self.inv)
        self._store_latent(p["qkv"].offset(2 * ql), row, m, meta, meta_stride, slots, meta_stride, stream)
        ops.rms_norm_strided(self.gpu, p["qkv"], w.q_a_norm, p["cq"], m, 1, ql, row, ql, ql, ql, d.eps, stream=stream)
        return p["cq"]

    def absorbed_q(self, qin: DevicePtr, m: int, meta: DevicePtr, meta_stride: int, stream=None) -> None:
        """Q [m, H, C + rope] = [W_UK^T q_nope | RoPE(q_pe)] from the q latent (positions from the slabs)."""
        gpu, d, w, p = self.gpu, self.d, self.w, self._ptr
        H, C, dn, dr, W = d.heads, d.kv_lora_rank, d.qk_nope, d.qk_rope, d.row_width
        G = dn + dr
        ops.linear(gpu, qin, w.q_b, p["qb"], m, stream=stream, invariant=self.inv)   # [m, H, nope | rope]
        ops.rope(gpu, p["qb"], meta, meta_stride, m, H, G, dr, dn, H * G, G, self._inv_freq.ptr,
                 self.rope.interleaved, self.rope.mscale, stream=stream, out=p["Q"], out_offset=C,
                 out_row_stride=H * W, out_head_stride=W)
        ops.grouped_gemv(gpu, p["qb"], w.w_uk_t, p["Q"], H, C, x_group_stride=G, y_group_stride=W, m=m,
                         stream=stream, table=self._uk_tab)

    def attend(self, out: DevicePtr, m: int, meta: DevicePtr, meta_stride: int, sel: DevicePtr = NULL,
               sel_stride: int = 0, stream=None) -> None:
        """out [m, D] = o_proj(W_UV attention(Q, cache rows)); `sel` restricts the rows (DSA)."""
        gpu, d, w, p = self.gpu, self.d, self.w, self._ptr
        H, C, dn, dv, W = d.heads, d.kv_lora_rank, d.qk_nope, d.v_head, d.row_width
        ops.mla_decode(gpu, p["Q"], self.kv.base(self.cache, self.layer), meta, meta_stride, p["o_lat"], m, H, W, C,
                       self.rope.softmax_scale, sel=sel, sel_stride=sel_stride, stream=stream, invariant=self.inv)
        ops.grouped_gemv(gpu, p["o_lat"], w.kv_b, p["o"], H, dv, row0=dn, group_rows=dn + dv, m=m, stream=stream,
                         table=self._uv_tab)
        ops.linear(gpu, p["o"], w.o_proj, out, m, stream=stream, invariant=self.inv)
