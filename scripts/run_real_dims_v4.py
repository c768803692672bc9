"""DeepSeek-V4-Flash MTP proposer at its real dims (hidden 4096, 4 mHC streams, 64 heads of 512 with rope 64,
q_lora 1024, 8 output groups of rank 1024, window 128, 256 FP4 experts top-6 + an FP8 shared expert, vocab
129280) with random weights in the real formats generated on the device: milliseconds per draft step next to
the weight-bytes floor (bytes a step must read / measured device copy bandwidth), and a per-phase split.

    python scripts/run_real_dims_v4.py                          # ctx 1024, 3 drafts per propose
    python scripts/run_real_dims_v4.py --ctx 4096 --drafts 8 --form single
    python scripts/run_real_dims_v4.py --device ref --tiny --ctx 16 --iters 1   # CPU smoke run of this code

Each timed call is `propose(k)` over --ctx drafter rows (prefilled first) followed by `after_verify(0)`."""
from __future__ import annotations

import argparse
import math
import time

import numpy as np

import mtp_cupy
from mtp_cupy.models.deepseek_v4 import DeepseekV4MtpProposer
from mtp_cupy.runtime.dtypes import to_bf16
from mtp_cupy.runtime.ptr import NULL, DevicePtr
from mtp_cupy.weights.config import DeepseekV4Config
from mtp_cupy.weights.deepseek_v4 import HC_SITES, NORMS, HcParams, DeepseekV4MtpWeights
from mtp_cupy.weights.linear import Linear

REAL = dict(model_type="deepseek_v4", hidden_size=4096, num_hidden_layers=43, num_attention_heads=64, head_dim=512,
            qk_rope_head_dim=64, q_lora_rank=1024, o_groups=8, o_lora_rank=1024, sliding_window=128,
            n_routed_experts=256, num_experts_per_tok=6, n_shared_experts=1, moe_intermediate_size=2048,
            vocab_size=129280, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6,
            routed_scaling_factor=1.5, swiglu_limit=10.0, scoring_func="sqrtsoftplus", rope_theta=10000.0,
            num_hash_layers=3, compress_ratios=[0, 0] + [4, 128] * 20 + [4, 0])
TINY = {**REAL, "hidden_size": 256, "num_attention_heads": 4, "head_dim": 64, "qk_rope_head_dim": 16,
        "q_lora_rank": 128, "o_groups": 2, "o_lora_rank": 128, "n_routed_experts": 16, "num_experts_per_tok": 3,
        "moe_intermediate_size": 64, "vocab_size": 512, "sliding_window": 8}
CHUNK = 1 << 26   # elements generated per step on the device (bounds the temporaries)


class RandomDevice:
    """Random tensors written straight into device memory (cupy on CUDA, numpy on the NumPy device)."""

    def __init__(self, gpu, seed: int):
        self.gpu, self.owners = gpu, []
        if gpu.is_cuda:
            import cupy as cp
            self.cp, self.rs = cp, cp.random.RandomState(seed)
        else:
            self.rng = np.random.default_rng(seed)

    def _alloc(self, nbytes: int):
        buf = self.gpu.alloc(nbytes)
        self.owners.append(buf)
        return buf.ptr

    def _put(self, dst: DevicePtr, arr) -> None:
        if self.gpu.is_cuda:
            self.gpu.copy_d2d_async(dst, DevicePtr(arr.data.ptr), arr.nbytes)
            self.gpu.synchronize()
        else:
            self.gpu.copy_h2d(dst, arr)

    def _normal(self, c: int):
        return self.rs.standard_normal(c, dtype=self.cp.float32) if self.gpu.is_cuda else \
            self.rng.standard_normal(c).astype(np.float32)

    def _bytes(self, c: int):
        return self.rs.randint(0, 256, c, dtype=self.cp.uint8) if self.gpu.is_cuda else \
            self.rng.integers(0, 256, c, dtype=np.uint8)

    def f32(self, n: int, scale: float, loc: float = 0.0) -> DevicePtr:
        ptr = self._alloc(4 * n)
        for c0 in range(0, n, CHUNK):
            self._put(ptr.offset(4 * c0), self._normal(min(CHUNK, n - c0)) * np.float32(scale) + np.float32(loc))
        return ptr

    def bf16(self, n: int, scale: float, loc: float = 0.0) -> DevicePtr:
        ptr = self._alloc(2 * n)
        for c0 in range(0, n, CHUNK):
            x = self._normal(min(CHUNK, n - c0)) * np.float32(scale) + np.float32(loc)
            if self.gpu.is_cuda:
                u = x.view(self.cp.uint32)
                x = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(self.cp.uint16)   # round to nearest even
            else:
                x = to_bf16(x)
            self._put(ptr.offset(2 * c0), x)
        return ptr

    def codes(self, n: int, mask: int = 0xFF) -> DevicePtr:
        """Random bytes & mask: 0xBF gives e4m3 codes below 2 in magnitude (no NaN); 0xFF any two e2m1 codes."""
        ptr = self._alloc(n)
        for c0 in range(0, n, CHUNK):
            self._put(ptr.offset(c0), self._bytes(min(CHUNK, n - c0)) & mask)
        return ptr

    def e8m0(self, n: int, exponent: int) -> DevicePtr:
        ptr = self._alloc(n)
        self._put(ptr, (self.cp if self.gpu.is_cuda else np).full(n, 127 + exponent, dtype=np.uint8))
        return ptr

    def fp8(self, n: int, k: int) -> Linear:
        """fp8_block_e8m0 [n, k], values about N(0, 1/k)."""
        e = -round(math.log2(math.sqrt(k))) - 1
        return Linear("fp8_block_e8m0", n, k, self.codes(n * k, 0xBF), self.e8m0(-(-n // 128) * -(-k // 128), e))

    def mxfp4(self, n: int, k: int) -> Linear:
        e = -round(math.log2(math.sqrt(k))) - 2
        return Linear("mxfp4", n, k, self.codes(n * k // 2), self.e8m0(n * k // 32, e))


def random_weights(gpu, cfg: DeepseekV4Config, seed: int) -> DeepseekV4MtpWeights:
    r = RandomDevice(gpu, seed)
    D, hc, V, H, hd = cfg.hidden_size, cfg.hc_mult, cfg.vocab_size, cfg.num_attention_heads, cfg.head_dim
    E, I, QL, G, R = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank
    mix = (2 + hc) * hc
    dims = {"attn.q_norm": QL, "attn.kv_norm": hd}
    hc_site = {s: HcParams(r.f32(mix * hc * D, (hc * D) ** -0.5), r.f32(mix, 0.5), r.f32(3, 0.1, 1.0))
               for s in HC_SITES}
    return DeepseekV4MtpWeights(
        embed=r.bf16(V * D, 1.0), head=Linear("bf16", V, D, r.bf16(V * D, D ** -0.5)),
        norms={n: r.bf16(dims.get(n, D), 0.1, 1.0) for n in NORMS}, e_proj=r.fp8(D, D), h_proj=r.fp8(D, D),
        hc=hc_site, hc_head=HcParams(r.f32(hc * hc * D, (hc * D) ** -0.5), r.f32(hc, 0.5), r.f32(1, 0.1, 1.0)),
        attn={"wq_a": r.fp8(QL, D), "wq_b": r.fp8(H * hd, QL), "wkv": r.fp8(hd, D), "wo_a": r.fp8(G * R, H * hd // G),
              "wo_b": r.fp8(D, G * R)},
        attn_sink=r.f32(H, 1.0), router=Linear("bf16", E, D, r.bf16(E * D, D ** -0.5)), router_bias=r.f32(E, 0.1),
        tid2eid=NULL, experts={e: (r.mxfp4(I, D), r.mxfp4(I, D), r.mxfp4(D, I)) for e in range(E)},
        shared=(r.fp8(I, D), r.fp8(I, D), r.fp8(D, I)), owners=r.owners)


def copy_bandwidth(gpu, nbytes: int = 1 << 30, reps: int = 10) -> float | None:
    """Device-to-device copy bandwidth in bytes/s (read + write counted), or None on the NumPy device."""
    if not gpu.is_cuda:
        return None
    a, b = gpu.alloc(nbytes), gpu.alloc(nbytes)
    gpu.copy_d2d_async(b.ptr, a.ptr, nbytes)
    e0, e1 = gpu.new_event(), gpu.new_event()
    gpu.record(e0)
    for _ in range(reps):
        gpu.copy_d2d_async(b.ptr, a.ptr, nbytes)
    gpu.record(e1)
    gpu.synchronize()
    return 2 * nbytes * reps / (gpu.elapsed_ms(e0, e1) / 1e3)


def phase_ms(prop: DeepseekV4MtpProposer, st, position: int, iters: int) -> dict[str, float]:
    """GPU milliseconds of each part of one draft step (CUDA events; re-runs the newest row in place)."""
    gpu, b = prop.gpu, prop.bufs
    if not gpu.is_cuda:
        return {}
    row = st.blocks.rows - 1
    prop._meta(st, position, row)
    ids, meta, cap = b.ids, b.mtp_meta, b.mtp_meta_capacity
    phases = {
        "front (embed, norms, e/h_proj)": lambda: prop._front(ids, prop.carry, 1, True),
        "mHC attn pre + post": lambda: (prop.mhc.pre("attn", b.X, b.x, 1), prop.mhc.post("attn", b.f, b.X, 1)),
        "attention": lambda: prop.attn.forward(b.xn, b.f, 1, meta, cap),
        "mHC ffn pre + post": lambda: (prop.mhc.pre("ffn", b.X, b.x, 1), prop.mhc.post("ffn", b.f, b.X, 1)),
        "MoE": lambda: prop.moe.forward(b.xn, b.f, m=1, token_ids=ids),
        "hc_head + norm": lambda: (prop.mhc.head(b.X, b.x, 1), prop.norm("norm", b.x, b.xn, 1)),
        "LM head": lambda: mtp_cupy.ops.linear(gpu, b.xn, prop.head, b.logits, 1, out_dtype="f32"),
        "argmax": lambda: prop._pick(0, b.logits, None, False),
    }
    return time_phases(gpu, phases, iters)


def time_phases(gpu, phases: dict, iters: int) -> dict[str, float]:
    """Milliseconds per call of each phase: one warm call, then `iters` back to back between two events."""
    out = {}
    e0, e1 = gpu.new_event(), gpu.new_event()
    for name, fn in phases.items():
        fn()
        gpu.record(e0)
        for _ in range(iters):
            fn()
        gpu.record(e1)
        out[name] = gpu.elapsed_ms(e0, e1) / iters
    return out


def prefill_and_time(gpu, prop, V: int, shape: tuple, ctx: int, drafts: int, iters: int, seed: int):
    """Prefill `ctx` random rows, then time propose(drafts) + after_verify(0) `iters` times after one warm-up
    call (kernel compiles, workspaces). Returns (state, hidden, prefill seconds, wall seconds per call); the
    state is left holding one extra drafted row for a phase breakdown."""
    rng = np.random.default_rng(seed)
    st = prop.alloc_state()
    t0 = time.perf_counter()
    prop.prefill(st, rng.integers(0, V, ctx + 1), to_bf16(rng.standard_normal((ctx, *shape))))
    gpu.synchronize()
    prefill_s = time.perf_counter() - t0
    h = to_bf16(rng.standard_normal(shape))

    def call():
        prop.propose(st, int(rng.integers(V)), h, ctx, drafts)
        prop.after_verify(st, 0)
    call()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    prop.propose(st, 1, h, ctx, 1)
    return st, h, prefill_s, times


def run(device: str = "cuda", tiny: bool = False, ctx: int = 1024, drafts: int = 3, iters: int = 10,
        form: str = "streams", seed: int = 0) -> dict:
    """Build the proposer, prefill `ctx` rows, time propose(drafts); returns the numbers main() prints."""
    gpu = mtp_cupy.device(device)
    cfg = DeepseekV4Config.from_dict(TINY if tiny else REAL)
    t0 = time.perf_counter()
    prop = DeepseekV4MtpProposer(gpu, cfg, random_weights(gpu, cfg, seed), max_seq_len=ctx + drafts + 16,
                                 max_drafts=drafts, device_hidden=form)
    built = time.perf_counter() - t0
    shape = (cfg.hc_mult, cfg.hidden_size) if form == "streams" else (cfg.hidden_size,)
    st, h, prefill_s, times = prefill_and_time(gpu, prop, cfg.vocab_size, shape, ctx, drafts, iters, seed)
    phases = phase_ms(prop, st, ctx, iters)
    bw = copy_bandwidth(gpu)
    wbytes = prop.weight_bytes_per_step()
    return dict(device=gpu.name, built_s=built, prefill_s=prefill_s, ctx=ctx, drafts=drafts, form=form,
                ms_per_step=1e3 * float(np.median(times)) / drafts, weight_bytes=wbytes,
                copy_gbs=bw / 1e9 if bw else None, floor_ms=1e3 * wbytes / bw if bw else None, phases=phases)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ctx", type=int, default=1024, help="drafter rows before drafting")
    p.add_argument("--drafts", type=int, default=3, help="draft steps per propose")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--form", choices=["streams", "single"], default="streams", help="the target hidden's form")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["auto", "cuda", "ref"], default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny dims (a smoke run of this script)")
    a = p.parse_args()
    r = run(a.device, a.tiny, a.ctx, a.drafts, a.iters, a.form, a.seed)
    print(f"DeepSeek-V4{' (tiny)' if a.tiny else '-Flash'} MTP, hidden {REAL['hidden_size'] if not a.tiny else 256}, "
          f"ctx {r['ctx']}, {r['drafts']} drafts per call, {r['form']} hidden; device {r['device']}; "
          f"weights built in {r['built_s']:.1f} s; prefill of {r['ctx']} rows {1e3 * r['prefill_s']:.1f} ms")
    line = f"ms/draft step {r['ms_per_step']:.3f}; weight bytes/step {r['weight_bytes'] / 1e6:.1f} MB"
    if r["floor_ms"]:
        line += (f"; copy bandwidth {r['copy_gbs']:.0f} GB/s; floor {r['floor_ms']:.3f} ms "
                 f"({100 * r['floor_ms'] / r['ms_per_step']:.0f}% of the step)")
    print(line)
    for name, ms in r["phases"].items():
        print(f"  {name:<32} {1e3 * ms:9.1f} us")


if __name__ == "__main__":
    main()
