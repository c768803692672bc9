"""DeepSeek-V4 sliding-window MQA with attention sinks (docs/model_math.md B.4), the MTP layer's kind (compress
ratio 0: no compressor, no indexer).

    q  = rms_head(wq_b(rms(wq_a x; q_norm)))        per-head RMS without a weight, H heads of head_dim
    kv = rms(wkv x; kv_norm)                         one row: both K and V
    RoPE (interleaved, plain rope_theta, no YaRN) on the last rot_dim dims of every q head and of kv
    o  = softmax over the last `window` cache rows plus a per-head sink, times the same rows
    inverse RoPE on o's last rot_dim dims;  out = wo_b(grouped wo_a(o))  (wo_a: o_groups blocks of rows,
    each applied to its own head group)

The cache holds one row of head_dim per drafter row, in one of two dtypes (`kv_dtype`):
  bf16   rows as computed (vLLM's bf16 path, transformers);
  fp8    the official inference's numerics: the non-RoPE columns [0, head_dim - rot_dim) as e4m3 in 64-wide
         blocks with a power-of-two (UE8M0) scale each, the RoPE columns bf16 (`ops.reshape_and_cache_fp8_blocks`,
         the layout of `ops.fp8_block_layout`). DeepSeek's QAT simulation rounds kv[..., :-rd] exactly so before
         caching (act_quant(kv[..., :-rd], 64, "ue8m0", inplace=True)), and the attention reads the rows back
         exactly, so the drafter sees the values the model was trained with and reads about half the bytes
         (592 instead of 1024 per row at head_dim 512).
Per-row positions and slots come from the metadata slabs (`pos u32 @0, slot i64 @8`)."""
from __future__ import annotations

from dataclasses import dataclass

from .. import ops
from ..cache.paged import CacheSpec, PagedKvCache
from ..errors import ConfigError
from ..runtime.arena import carve
from ..runtime.backend import Backend
from ..runtime.ptr import NULL, DevicePtr
from ..runtime.slab import SLOT_OFFSET
from ..weights.linear import Linear, stack_rows
from .rope_tables import default_inv_freq

CACHE = "kv"


@dataclass
class V4AttentionWeights:
    wq_a: Linear                 # [q_lora, D]
    wq_b: Linear                 # [heads * head_dim, q_lora]
    wkv: Linear                  # [head_dim, D]
    wo_a: Linear                 # [o_groups * o_lora, heads * head_dim / o_groups]
    wo_b: Linear                 # [D, o_groups * o_lora]
    q_norm: DevicePtr            # bf16 [q_lora]
    kv_norm: DevicePtr           # bf16 [head_dim]
    sink: DevicePtr              # f32 [heads]


@dataclass(frozen=True)
class V4AttentionDims:
    heads: int
    head_dim: int
    rot_dim: int
    rope_theta: float
    o_groups: int
    window: int
    eps: float
    kv_dtype: str = "bf16"       # "bf16" | "fp8" (the blocked fp8 rows above)

    @property
    def nope(self) -> int:
        """Columns quantised by the fp8 cache: all but the RoPE ones."""
        return self.head_dim - self.rot_dim

    def cache_spec(self) -> CacheSpec:
        """The paged cache this attention writes and reads: bf16 rows of head_dim, or the blocked fp8 rows as
        raw bytes."""
        if self.kv_dtype == "fp8":
            return CacheSpec(CACHE, ops.fp8_block_layout(self.head_dim, self.nope)[2], "u8")
        return CacheSpec(CACHE, self.head_dim, "bf16")

    @classmethod
    def from_config(cls, cfg, kv_dtype: str = "bf16") -> "V4AttentionDims":
        return cls(cfg.num_attention_heads, cfg.head_dim, cfg.qk_rope_head_dim, cfg.rope.theta, cfg.o_groups,
                   cfg.sliding_window, float(cfg.rms_norm_eps), kv_dtype)


class V4Attention:
    def __init__(self, gpu: Backend, w: V4AttentionWeights, dims: V4AttentionDims, kv: PagedKvCache,
                 max_rows: int = 1, max_kv_rows: int = 128, invariant: bool = False):
        H, hd, G = dims.heads, dims.head_dim, dims.o_groups
        if H * hd % G or w.wo_a.n % G:
            raise ConfigError(f"{H} heads x {hd} and wo_a's {w.wo_a.n} rows do not split into {G} groups")
        want = {"wq_b": (w.wq_b, H * hd, w.wq_a.n), "wkv": (w.wkv, hd, w.wq_a.k),
                "wo_a": (w.wo_a, w.wo_a.n, H * hd // G), "wo_b": (w.wo_b, w.wo_b.n, w.wo_a.n)}
        for name, (lin, n, k) in want.items():
            if (lin.n, lin.k) != (n, k):
                raise ConfigError(f"{name} is [{lin.n}, {lin.k}]; [{n}, {k}] expected")
        want = dims.cache_spec()
        got = kv.specs.get(CACHE)
        if got is None or (got.row_width, got.dtype) != (want.row_width, want.dtype):
            raise ConfigError(f"V4 attention cache {CACHE!r}: rows {None if got is None else (got.row_width, got.dtype)}"
                              f"; {(want.row_width, want.dtype)} expected for kv_dtype {dims.kv_dtype!r}")
        self.gpu, self.kv, self.w, self.d, self.inv = gpu, kv, w, dims, bool(invariant)
        self.H, self.hd, self.rot, self.G, self.window, self.eps = H, hd, dims.rot_dim, G, int(dims.window), dims.eps
        self.max_rows, self.max_kv_rows = int(max_rows), max(int(max_kv_rows), int(max_rows))
        self._inv_freq = gpu.upload(default_inv_freq(dims.rot_dim, dims.rope_theta))
        r = self.max_rows
        # a decode row's wq_a and wkv outputs side by side, [q latent | kv row] (one GEMV where the two weights can
        # share one); prefill rows take wkv alone
        nqa = w.wq_a.n
        self._qkv = stack_rows(gpu, [w.wq_a, w.wkv]) if nqa % 8 == 0 and hd % 8 == 0 else None
        sizes = {"qkv": (nqa + hd) * r, "qa": nqa * r, "q": H * hd * r, "o": H * hd * r, "kv": hd * self.max_kv_rows,
                 "z": w.wo_a.n * r}
        self._buf, self._ptr = carve(gpu, {name: 2 * n for name, n in sizes.items()})
        self._wo_a_tab = ops.upload_group_table(gpu, w.wo_a, G, w.wo_a.n // G)   # tensor-core form where it fits

    def weight_bytes_per_step(self, m: int = 1) -> int:
        """Weight bytes one decode step of m rows reads (every projection once for all rows)."""
        w = self.w
        return sum(x.weight_bytes for x in (w.wq_a, w.wq_b, w.wkv, w.wo_a, w.wo_b))

    @staticmethod
    def _check(m: int, most: int) -> None:
        if not 1 <= m <= most:
            raise ConfigError(f"V4 attention sized for {most} rows, got {m}")

    def _rope(self, x: DevicePtr, pos: DevicePtr, pos_stride: int, m: int, heads: int, inverse: bool, stream):
        hd = self.hd
        ops.rope(self.gpu, x, pos, pos_stride, m, heads, hd, self.rot, hd - self.rot, heads * hd, hd,
                 self._inv_freq.ptr, interleaved=True, inverse=inverse, stream=stream)

    def write_kv(self, xn: DevicePtr, m: int, pos: DevicePtr, pos_stride: int, slots: DevicePtr,
                 slot_stride: int, stream=None) -> None:
        """The cache rows of m normed inputs (RoPE'd at `pos`) into their slots; no attention. All prefill
        needs: a row's kv depends only on its own input."""
        self._check(m, self.max_kv_rows)
        kv = self._ptr["kv"]
        ops.linear(self.gpu, xn, self.w.wkv, kv, m, stream=stream, invariant=self.inv)
        self._store_kv(kv, self.hd, m, pos, pos_stride, slots, slot_stride, stream)

    def _store_kv(self, kv: DevicePtr, row: int, m: int, pos: DevicePtr, pos_stride: int, slots: DevicePtr,
                  slot_stride: int, stream) -> None:
        """wkv outputs (row stride `row` elements): kv_norm and RoPE, into the cache slots, in one launch."""
        hd = self.hd
        ops.norm_rope(self.gpu, kv, row, hd, m, 1, self.w.kv_norm, hd, hd, self.eps, pos, pos_stride, self._inv_freq.ptr,
                      hd - self.rot, self.rot, True, slots=slots, slot_stride=slot_stride, cache=self.kv.base(CACHE),
                      fp8_nope=self.d.nope if self.d.kv_dtype == "fp8" else 0, stream=stream)

    def forward(self, xn: DevicePtr, out: DevicePtr, m: int, meta: DevicePtr, meta_stride: int,
                stream=None) -> None:
        """One decode row for each of m sequences (slab s at meta + s * meta_stride): writes the row's kv at
        the slab's slot, attends the last `window` of its seq_len rows; out [m, hidden] bf16."""
        self._check(m, self.max_rows)
        gpu, H, hd, p, w = self.gpu, self.H, self.hd, self._ptr, self.w
        slots = meta.offset(SLOT_OFFSET)
        if self._qkv is None:
            ops.linear(gpu, xn, w.wq_a, p["qa"], m, stream=stream, invariant=self.inv)
            ops.rms_norm(gpu, p["qa"], w.q_norm, p["qa"], m, w.wq_a.n, self.eps, stream=stream)
            self.write_kv(xn, m, meta, meta_stride, slots, meta_stride, stream)
        else:
            nqa = w.wq_a.n
            row = nqa + hd
            ops.linear(gpu, xn, self._qkv, p["qkv"], m, stream=stream, invariant=self.inv)
            ops.rms_norm_strided(gpu, p["qkv"], w.q_norm, p["qa"], m, 1, nqa, row, nqa, nqa, nqa, self.eps,
                                 stream=stream)
            self._store_kv(p["qkv"].offset(2 * nqa), row, m, meta, meta_stride, slots, meta_stride, stream)
        ops.linear(gpu, p["qa"], w.wq_b, p["q"], m, stream=stream, invariant=self.inv)
        ops.norm_rope(gpu, p["q"], H * hd, hd, m, H, NULL, hd, hd, self.eps, meta, meta_stride, self._inv_freq.ptr,
                      hd - self.rot, self.rot, True, out=p["q"], out_row_stride=H * hd, out_head_stride=hd,
                      stream=stream)   # the per-head q scaling (no weight) and RoPE, in place
        ops.mla_decode(gpu, p["q"], self.kv.base(CACHE), meta, meta_stride, p["o"], m, H, hd, hd, float(hd) ** -0.5,
                       window=self.window, sink=w.sink, kv_dtype=self.d.kv_dtype, nope=self.d.nope, stream=stream,
                       invariant=self.inv)
        self._rope(p["o"], meta, meta_stride, m, H, True, stream)
        ops.grouped_gemv(gpu, p["o"], w.wo_a, p["z"], self.G, w.wo_a.n // self.G, m=m, stream=stream,
                         table=self._wo_a_tab)
        ops.linear(gpu, p["z"], w.wo_b, out, m, stream=stream, invariant=self.inv)
