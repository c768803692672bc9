"""DeepSeek sparse attention (DSA): the lightning indexer picks the top-k cache rows, then absorbed MLA attends
only those rows (docs/model_math.md C.2 / C.3).

    qr   = q_a_layernorm(q_a(xn))                   shared with MLA (the indexer reads it, never recomputes it)
    q    = (qr @ wq_b.T).view(nh, hd);  RoPE on q[:, :rope]   (interleaved GLM-5, neox V3.2: the config flag)
    k    = LayerNorm(xn @ wk.T; k_norm, eps 1e-6);  RoPE on k[:rope]     -> the indexer cache row (bf16 [hd])
    w    = xn @ weights_proj.T                      (f32)
    I[j] = nh^-0.5 hd^-0.5 sum_h w_h relu(q_h . k_j)  for every row j <= t (causal, the new row included)
    sel  = rows of the min(index_topk, visible) largest I (ties to the lower row), then MLA over sel

The indexer cache is a CacheSpec of bf16 rows of hd in the same PagedKvCache as the latent (same block ids,
so a slot addresses both). bf16 keeps the scores within bf16 rounding of the reference; vLLM's FP8 + f32
scale row (132 B instead of 256 B) would halve the bytes a step reads (1 MB at 4096 rows), a later option.
The indexer's RoPE uses the MLA's frequencies and cos/sin magnitude, at the same positions."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import ops
from ..cache.paged import PagedKvCache
from ..errors import ConfigError
from ..runtime.arena import carve
from ..runtime.backend import Backend
from ..runtime.ptr import NULL, DevicePtr
from ..runtime.slab import SLOT_OFFSET
from ..weights.linear import Linear
from .mla import MlaAttention, MlaDims, MlaRope, MlaWeights

INDEX_CACHE = "index_k"
K_NORM_EPS = 1e-6     # LayerNorm(head_dim, eps=1e-6) in every public implementation


@dataclass(frozen=True)
class IndexerDims:
    heads: int                   # index_n_heads
    head_dim: int                # index_head_dim
    rope: int                    # RoPE on dims [0, rope) of q and k (qk_rope_head_dim)
    topk: int                    # index_topk
    interleaved: bool = True     # indexer_rope_interleave

    @property
    def score_scale(self) -> float:
        return self.heads ** -0.5 * self.head_dim ** -0.5

    @classmethod
    def from_config(cls, cfg) -> "IndexerDims":
        return cls(cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim, cfg.index_topk,
                   cfg.indexer_rope_interleave)


@dataclass
class IndexerWeights:
    wq_b: Linear                 # [heads * head_dim, q_lora]
    wk: Linear                   # [head_dim, D]
    k_norm: DevicePtr            # bf16 [head_dim]
    k_norm_bias: DevicePtr       # bf16 [head_dim]
    weights_proj: Linear         # [heads, D]


class DsaIndexer:
    """Indexer cache rows for prefill / decode, and the top-k selection of m decode rows."""

    def __init__(self, gpu: Backend, w: IndexerWeights, dims: IndexerDims, rope: MlaRope, kv: PagedKvCache,
                 max_seq_len: int, q_lora: int, cache: str = INDEX_CACHE, layer: int = 0, max_rows: int = 1,
                 max_kv_rows: int = 512, invariant: bool = False):
        nh, hd = dims.heads, dims.head_dim
        D = w.wk.k
        for name, lin, n, k in (("wq_b", w.wq_b, nh * hd, q_lora), ("wk", w.wk, hd, D),
                                ("weights_proj", w.weights_proj, nh, D)):
            if (lin.n, lin.k) != (n, k):
                raise ConfigError(f"indexer {name}: expected [{n}, {k}], got [{lin.n}, {lin.k}]")
        if not 0 < dims.rope <= hd or dims.rope % 2:
            raise ConfigError(f"indexer rope dims {dims.rope} must be even and within head_dim {hd}")
        if dims.topk < 1:
            raise ConfigError(f"index_topk {dims.topk} must be >= 1")
        spec = kv.specs.get(cache)
        if spec is None or spec.row_width != hd or spec.dtype != "bf16":
            raise ConfigError(f"indexer cache {cache!r} must hold bf16 rows of {hd}")
        self.gpu, self.w, self.d, self.rope, self.kv, self.cache, self.layer = gpu, w, dims, rope, kv, cache, layer
        self.inv = bool(invariant)
        self.max_rows, self.max_kv_rows = int(max_rows), max(int(max_kv_rows), int(max_rows))
        self.score_stride, self.sel_stride = int(max_seq_len), dims.topk
        self._inv_freq = gpu.upload(np.asarray(rope.inv_freq, np.float32))
        r = self.max_rows
        self._buf, self.ptr = carve(gpu, {"q": 2 * r * nh * hd, "k": 2 * self.max_kv_rows * hd, "w": 4 * r * nh,
                                          "scores": 4 * r * self.score_stride, "sel": 4 * r * self.sel_stride})

    @property
    def sel(self) -> DevicePtr:
        """i32 [max_rows, topk]: the rows the last `select` picked (-1 = unused)."""
        return self.ptr["sel"]

    def weight_bytes_per_step(self, m: int = 1) -> int:
        """Weight bytes one decode step of m rows reads (wq_b, wk, weights_proj), once for all rows."""
        return sum(x.weight_bytes for x in (self.w.wq_b, self.w.wk, self.w.weights_proj))

    def write_kv(self, xn: DevicePtr, m: int, pos: DevicePtr, pos_stride: int, slots: DevicePtr,
                 slot_stride: int, stream=None) -> None:
        """Indexer cache rows of m normed inputs: LayerNorm(wk xn) with RoPE on its first `rope` dims."""
        if not 1 <= m <= self.max_kv_rows:
            raise ConfigError(f"indexer sized for {self.max_kv_rows} cache rows per call, got {m}")
        gpu, d, k = self.gpu, self.d, self.ptr["k"]
        hd = d.head_dim
        ops.linear(gpu, xn, self.w.wk, k, m, stream=stream, invariant=self.inv)
        # LayerNorm, RoPE on the first `rope` dims and the cache store in one launch (norm_rope_w_bias)
        ops.norm_rope(gpu, k, hd, hd, m, 1, self.w.k_norm, hd, hd, K_NORM_EPS, pos, pos_stride, self._inv_freq.ptr, 0,
                      d.rope, d.interleaved, self.rope.mscale, slots=slots, slot_stride=slot_stride,
                      cache=self.kv.base(self.cache, self.layer), bias=self.w.k_norm_bias, stream=stream)

    def _decode_rows(self, m: int) -> None:
        if not 1 <= m <= self.max_rows:
            raise ConfigError(f"indexer sized for {self.max_rows} decode rows, got {m}")

    def prepare(self, xn: DevicePtr, m: int, meta: DevicePtr, meta_stride: int, stream=None) -> None:
        """What `select` needs of the m decode rows' normed inputs alone: their own indexer rows written (slots
        from the slabs) and the per-head weights (weights_proj). No q latent: this may run beside MLA's q path."""
        self._decode_rows(m)
        self.write_kv(xn, m, meta, meta_stride, meta.offset(SLOT_OFFSET), meta_stride, stream)
        ops.linear(self.gpu, xn, self.w.weights_proj, self.ptr["w"], m, out_dtype="f32", stream=stream,
                   invariant=self.inv)

    def select(self, qr: DevicePtr, m: int, meta: DevicePtr, meta_stride: int, stream=None) -> DevicePtr:
        """After `prepare` of the same rows: the indexer queries from the q latent `qr`, every visible row scored,
        the top-k left in `sel`; returns `sel`."""
        self._decode_rows(m)
        gpu, d, p = self.gpu, self.d, self.ptr
        nh, hd = d.heads, d.head_dim
        ops.linear(gpu, qr, self.w.wq_b, p["q"], m, stream=stream, invariant=self.inv)
        ops.rope(gpu, p["q"], meta, meta_stride, m, nh, hd, d.rope, 0, nh * hd, hd, self._inv_freq.ptr,
                 d.interleaved, self.rope.mscale, stream=stream)
        cache = self.kv.base(self.cache, self.layer)
        ops.dsa_index_scores(gpu, p["q"], p["w"], cache, meta, meta_stride, p["scores"], m, nh, hd,
                             self.score_stride, d.score_scale, stream=stream)
        ops.dsa_topk(gpu, p["scores"], self.score_stride, meta, meta_stride, p["sel"], self.sel_stride, m, d.topk,
                     stream=stream)
        return p["sel"]


class DsaMlaAttention(MlaAttention):
    """MLA whose attention runs over the indexer's selection: cache writes add the indexer row to the latent
    row; the decode forward hands MLA's q latent to the indexer between MLA's q projection and attention."""

    def __init__(self, gpu: Backend, w: MlaWeights, dims: MlaDims, rope: MlaRope, kv: PagedKvCache,
                 indexer: DsaIndexer, cache: str = "latent", layer: int = 0, max_rows: int = 1,
                 max_kv_rows: int = 512, invariant: bool = False):
        if w.q_a is None:
            raise ConfigError("DSA needs the q LoRA (its normed latent is the indexer's query input)")
        super().__init__(gpu, w, dims, rope, kv, cache=cache, layer=layer, max_rows=max_rows, max_kv_rows=max_kv_rows,
                         invariant=invariant)
        self.indexer = indexer

    def weight_bytes_per_step(self, m: int = 1) -> int:
        return super().weight_bytes_per_step(m) + self.indexer.weight_bytes_per_step(m)

    def write_kv(self, xn: DevicePtr, m: int, pos: DevicePtr, pos_stride: int, slots: DevicePtr,
                 slot_stride: int, stream=None) -> None:
        super().write_kv(xn, m, pos, pos_stride, slots, slot_stride, stream)
        self.indexer.write_kv(xn, m, pos, pos_stride, slots, slot_stride, stream)

    def forward(self, xn: DevicePtr, out: DevicePtr, m: int, meta: DevicePtr, meta_stride: int,
                sel: DevicePtr = NULL, sel_stride: int = 0, stream=None) -> None:
        """As MlaAttention.forward, attending the indexer's top-k rows (a caller's `sel` is not accepted)."""
        if int(sel):
            raise ConfigError("DSA attention picks its own rows; pass no sel")
        if not 1 <= m <= self.max_rows:
            raise ConfigError(f"MLA sized for {self.max_rows} decode rows, got {m}")
        # the indexer runs on a branch beside MLA's q path: its key rows and weights from xn beside the projection,
        # then (caught up with the q latent) its scores and top-k beside absorbed_q; joined before the attention
        ix, gpu = self.indexer, self.gpu
        side = gpu.fork(stream)
        ix.prepare(xn, m, meta, meta_stride, side)
        qr = self.project(xn, m, meta, meta_stride, stream)
        side = gpu.fork(stream)
        chosen = ix.select(qr, m, meta, meta_stride, side)
        self.absorbed_q(qr, m, meta, meta_stride, stream)
        gpu.join(stream)
        self.attend(out, m, meta, meta_stride, chosen, ix.sel_stride, stream)
