"""DeepSeek-V4 sliding-window MQA with attention sinks (arch_math.md B.4), the MTP layer's kind (compress
ratio 0: no compressor, no indexer).

    q  = rms_head(wq_b(rms(wq_a x; q_norm)))        per-head RMS without a weight, H heads of head_dim
    kv = rms(wkv x; kv_norm)                         one row: both K and V
    RoPE (interleaved, plain rope_theta, no YaRN) on the last rot_dim dims of every q head and of kv
    o  = softmax over the last `window` cache rows plus a per-head sink, times the same rows
    inverse RoPE on o's last rot_dim dims;  out = wo_b(grouped wo_a(o))  (wo_a: o_groups blocks of rows,
    each applied to its own head group)

The cache holds one bf16 row of head_dim per drafter row. The official QAT simulation (fp8 fake-quantisation
of kv[:-rot_dim] in 64-wide blocks before caching) is NOT applied: rows are cached as bf16, which is what
vLLM's bf16 path and transformers do; the difference is the fp8 rounding of the nope dims (<= 2^-4 relative
per element). Per-row positions and slots come from the metadata slabs (`pos u32 @0, slot i64 @8`)."""
from __future__ import annotations

from .. import ops
from ..cache.paged import PagedKvCache
from ..runtime.backend import Backend
from ..runtime.arena import carve
from ..runtime.ptr import NULL, DevicePtr
from ..weights.linear import Linear
from .rope_tables import default_inv_freq

SLOT_OFFSET = 8  # slot i64 @8 of a metadata slab
CACHE = "kv"


class V4Attention:
    def __init__(self, gpu: Backend, wq_a: Linear, wq_b: Linear, wkv: Linear, wo_a: Linear, wo_b: Linear,
                 q_norm: DevicePtr, kv_norm: DevicePtr, sink: DevicePtr, heads: int, head_dim: int, rot_dim: int,
                 rope_theta: float, o_groups: int, window: int, eps: float, kv: PagedKvCache, max_rows: int = 1,
                 max_kv_rows: int = 128):
        H, hd, G = heads, head_dim, o_groups
        if H * hd % G or wo_a.n % G:
            raise ValueError(f"{H} heads x {hd} and wo_a's {wo_a.n} rows do not split into {G} groups")
        want = {"wq_b": (wq_b, H * hd, wq_a.n), "wkv": (wkv, hd, wq_a.k), "wo_a": (wo_a, wo_a.n, H * hd // G),
                "wo_b": (wo_b, wo_b.n, wo_a.n)}
        for name, (w, n, k) in want.items():
            if (w.n, w.k) != (n, k):
                raise ValueError(f"{name} is [{w.n}, {w.k}]; [{n}, {k}] expected")
        if kv.specs[CACHE].row_width != hd:
            raise ValueError(f"cache rows of {kv.specs[CACHE].row_width}; {hd} expected")
        self.gpu, self.kv = gpu, kv
        self.wq_a, self.wq_b, self.wkv, self.wo_a, self.wo_b = wq_a, wq_b, wkv, wo_a, wo_b
        self.q_norm, self.kv_norm, self.sink = q_norm, kv_norm, sink
        self.H, self.hd, self.rot, self.G, self.window, self.eps = H, hd, rot_dim, G, int(window), float(eps)
        self.max_rows, self.max_kv_rows = int(max_rows), max(int(max_kv_rows), int(max_rows))
        self._inv_freq = gpu.upload(default_inv_freq(rot_dim, rope_theta))
        r = self.max_rows
        sizes = {"qa": wq_a.n * r, "q": H * hd * r, "o": H * hd * r, "kv": hd * self.max_kv_rows, "z": wo_a.n * r}
        self._buf, self._ptr = carve(gpu, {name: 2 * n for name, n in sizes.items()})

    @property
    def weight_bytes(self) -> int:
        return sum(w.weight_bytes for w in (self.wq_a, self.wq_b, self.wkv, self.wo_a, self.wo_b))

    @staticmethod
    def _check(m: int, most: int) -> None:
        if not 1 <= m <= most:
            raise ValueError(f"V4 attention sized for {most} rows, got {m}")

    def _rope(self, x: DevicePtr, pos: DevicePtr, pos_stride: int, m: int, heads: int, inverse: bool, stream):
        hd = self.hd
        ops.rope(self.gpu, x, pos, pos_stride, m, heads, hd, self.rot, hd - self.rot, heads * hd, hd,
                 self._inv_freq.ptr, interleaved=True, inverse=inverse, stream=stream)

    def write_kv(self, xn: DevicePtr, m: int, pos: DevicePtr, pos_stride: int, slots: DevicePtr,
                 slot_stride: int, stream=None) -> None:
        """The cache rows of m normed inputs (RoPE'd at `pos`) into their slots; no attention. All prefill
        needs: a row's kv depends only on its own input."""
        self._check(m, self.max_kv_rows)
        gpu, hd, kv = self.gpu, self.hd, self._ptr["kv"]
        ops.linear(gpu, xn, self.wkv, kv, m, stream=stream)
        ops.rms_norm(gpu, kv, self.kv_norm, kv, m, hd, self.eps, stream=stream)
        self._rope(kv, pos, pos_stride, m, 1, False, stream)
        ops.reshape_and_cache(gpu, kv, hd, slots, slot_stride, self.kv.base(CACHE), m, hd, hd, 0, stream=stream)

    def forward(self, xn: DevicePtr, out: DevicePtr, m: int, meta: DevicePtr, meta_stride: int,
                stream=None) -> None:
        """One decode row for each of m sequences (slab s at meta + s * meta_stride): writes the row's kv at
        the slab's slot, attends the last `window` of its seq_len rows; out [m, hidden] bf16."""
        self._check(m, self.max_rows)
        gpu, H, hd, p = self.gpu, self.H, self.hd, self._ptr
        ops.linear(gpu, xn, self.wq_a, p["qa"], m, stream=stream)
        ops.rms_norm(gpu, p["qa"], self.q_norm, p["qa"], m, self.wq_a.n, self.eps, stream=stream)
        ops.linear(gpu, p["qa"], self.wq_b, p["q"], m, stream=stream)
        ops.rms_norm_strided(gpu, p["q"], NULL, p["q"], m, H, hd, H * hd, hd, H * hd, hd, self.eps, stream=stream)
        self._rope(p["q"], meta, meta_stride, m, H, False, stream)
        self.write_kv(xn, m, meta, meta_stride, meta.offset(SLOT_OFFSET), meta_stride, stream)
        ops.mla_decode(gpu, p["q"], self.kv.base(CACHE), meta, meta_stride, p["o"], m, H, hd, hd, float(hd) ** -0.5,
                       window=self.window, sink=self.sink, stream=stream)
        self._rope(p["o"], meta, meta_stride, m, H, True, stream)
        ops.grouped_gemv(gpu, p["o"], self.wo_a, p["z"], self.G, self.wo_a.n // self.G, m=m, stream=stream)
        ops.linear(gpu, p["z"], self.wo_b, out, m, stream=stream)
