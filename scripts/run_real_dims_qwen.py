"""Qwen3-Next-80B-A3B MTP head at its real dims (hidden 2048, 16 heads / 2 KV heads of 256, 512 experts top-10,
vocab 151936) with random weights generated on the GPU: milliseconds per draft step for each quantisation and
batch width, next to the weight-bytes floor (bytes a step must read / measured device copy bandwidth).

    python scripts/run_real_dims_qwen.py                               # bf16, fp8, nvfp4 x batch 1 4 16 32
    python scripts/run_real_dims_qwen.py --quant nvfp4 --batch 1 32 --ctx 4096
    python scripts/run_real_dims_qwen.py --device ref --tiny --ctx 32  # CPU smoke run of the same code

Batch 1 times `propose`, wider batches `propose_batch`; each call drafts --drafts tokens over a context of
--ctx drafter rows per sequence (prefilled first), then `after_verify(0)` returns the rows."""
from __future__ import annotations

import argparse
import time

import numpy as np

import mtp_cupy
from mtp_cupy.cache.paged import PagedKvCache
from mtp_cupy.models.qwen3_next import Qwen3NextMtpProposer
from mtp_cupy.runtime.dtypes import to_bf16
from mtp_cupy.runtime.ptr import DevicePtr
from mtp_cupy.weights.config import Qwen3NextConfig
from mtp_cupy.weights.linear import Linear
from run_real_dims_v4 import copy_bandwidth
from mtp_cupy.weights.qwen3_next import NORMS, Qwen3NextMtpWeights

REAL = dict(model_type="qwen3_next", hidden_size=2048, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
            partial_rotary_factor=0.25, rope_theta=1e7, rms_norm_eps=1e-6, vocab_size=151936, num_hidden_layers=48,
            num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512,
            norm_topk_prob=True)
TINY = {**REAL, "hidden_size": 256, "num_attention_heads": 4, "head_dim": 64, "vocab_size": 512, "num_experts": 16,
        "num_experts_per_tok": 4, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64}
CHUNK = 1 << 26   # elements generated per step on the device (bounds the f32 temporary)


class RandomBf16:
    """N(0, scale^2) bf16 tensors written straight into device memory (cupy on CUDA, numpy on the NumPy device)."""

    def __init__(self, gpu, seed: int):
        self.gpu = gpu
        if gpu.is_cuda:
            import cupy as cp
            self.cp, self.rs = cp, cp.random.RandomState(seed)
        else:
            self.rng = np.random.default_rng(seed)

    def fill(self, ptr: DevicePtr, n: int, scale: float) -> None:
        for c0 in range(0, n, CHUNK):
            c = min(CHUNK, n - c0)
            dst = ptr.offset(2 * c0)
            if self.gpu.is_cuda:
                cp = self.cp
                u = (self.rs.standard_normal(c, dtype=cp.float32) * cp.float32(scale)).view(cp.uint32)
                bits = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(cp.uint16)   # round to nearest even
                self.gpu.copy_d2d_async(dst, DevicePtr(bits.data.ptr), 2 * c)
                self.gpu.synchronize()
            else:
                self.gpu.copy_h2d(dst, to_bf16(self.rng.standard_normal(c) * scale))

    def tensor(self, n: int, scale: float):
        buf = self.gpu.alloc(2 * n)
        self.fill(buf.ptr, n, scale)
        return buf

    def linears(self, count: int, n: int, k: int) -> list[Linear]:
        """`count` bf16 [n, k] Linears in one allocation (weights N(0, 1/k))."""
        buf = self.tensor(count * n * k, k ** -0.5)
        return [Linear("bf16", n, k, buf.ptr.offset(2 * i * n * k), owners=[buf]) for i in range(count)]


def random_weights(gpu, cfg: Qwen3NextConfig, seed: int) -> Qwen3NextMtpWeights:
    r = RandomBf16(gpu, seed)
    D, V, H, KV, hd = cfg.hidden_size, cfg.vocab_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    E, inter, sh = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    embed = r.tensor(V * D, 1.0)
    owners, norms = [embed], {}
    for role in NORMS:
        owners.append(r.tensor(hd if role in ("q_norm", "k_norm") else D, 0.1))
        norms[role] = owners[-1].ptr
    shapes = {"fc": (D, 2 * D), "q_proj": (2 * H * hd, D), "k_proj": (KV * hd, D), "v_proj": (KV * hd, D),
              "o_proj": (D, H * hd)}
    linears = {role: r.linears(1, *s)[0] for role, s in shapes.items()}
    gate, up, down = r.linears(E, inter, D), r.linears(E, inter, D), r.linears(E, D, inter)
    return Qwen3NextMtpWeights(embed.ptr, r.linears(1, V, D)[0], norms, linears, False,
                          router=r.linears(1, E, D)[0], shared_gate=r.linears(1, 1, D)[0],
                          experts={e: (gate[e], up[e], down[e]) for e in range(E)},
                          shared=(r.linears(1, sh, D)[0], r.linears(1, sh, D)[0], r.linears(1, D, sh)[0]),
                          owners=owners)


def time_widths(prop: Qwen3NextMtpProposer, batches: list[int], ctx: int, drafts: int, iters: int, seed: int):
    gpu, D, V = prop.gpu, prop.hidden_size, prop.vocab_size
    rng = np.random.default_rng(seed)
    hs = to_bf16(rng.standard_normal((ctx, D)))
    states = [prop.alloc_state() for _ in range(max(batches))]
    for st in states:
        prop.prefill(st, rng.integers(0, V, ctx + 1), hs)
    for B in batches:
        sts, toks = states[:B], rng.integers(0, V, B)
        h = to_bf16(rng.standard_normal((B, D)))

        def run():
            if B == 1:
                prop.propose(sts[0], int(toks[0]), h[0], ctx, drafts)
            else:
                prop.propose_batch(sts, toks, h, [ctx] * B, drafts)
            gpu.synchronize()
            for st in sts:
                prop.after_verify(st, 0)
        run()                                            # warm-up: kernel compiles, workspaces
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
        yield B, 1e3 * float(np.median(times)) / drafts, prop.weight_bytes_per_step(B)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quant", nargs="+", default=["bf16", "fp8", "nvfp4"], choices=["bf16", "fp8", "nvfp4"])
    p.add_argument("--batch", nargs="+", type=int, default=[1, 4, 16, 32])
    p.add_argument("--ctx", type=int, default=1024, help="drafter rows per sequence before drafting")
    p.add_argument("--drafts", type=int, default=8, help="draft steps per propose")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--mtp-vocab-size", type=int, default=0, help="LM-head rows scored (0 = the full vocab)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["auto", "cuda", "ref"], default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny dims (a smoke run of this script)")
    a = p.parse_args()
    gpu = mtp_cupy.device(a.device)
    cfg = Qwen3NextConfig.from_dict(TINY if a.tiny else REAL)
    bw = copy_bandwidth(gpu)
    print(f"Qwen3-Next MTP head, hidden {cfg.hidden_size}, {cfg.num_experts} experts top-{cfg.num_experts_per_tok}, "
          f"vocab {cfg.vocab_size} (scoring {a.mtp_vocab_size or cfg.vocab_size}); ctx {a.ctx}, {a.drafts} drafts per call; device {gpu.name}"
          + (f"; copy bandwidth {bw / 1e9:.0f} GB/s" if bw else ""))
    print(f"{'quant':>6} {'batch':>5} {'ms/step':>9} {'ms/seq-step':>11} {'weight MB':>10} {'floor ms':>9} "
          f"{'% floor':>8}")
    max_seq = a.ctx + a.drafts + 16
    for q in a.quant:
        t0 = time.perf_counter()
        prop = Qwen3NextMtpProposer(gpu, cfg, random_weights(gpu, cfg, a.seed), max_seq_len=max_seq, quantization=q,
                               max_drafts=a.drafts, max_batch=max(a.batch), mtp_vocab_size=a.mtp_vocab_size,
                               kv_blocks=PagedKvCache.blocks_for(max_seq) * max(a.batch))
        print(f"# {q}: built and quantised in {time.perf_counter() - t0:.1f} s")
        for B, ms, wbytes in time_widths(prop, sorted(a.batch), a.ctx, a.drafts, a.iters, a.seed):
            floor = 1e3 * wbytes / bw if bw else float("nan")
            print(f"{q:>6} {B:>5} {ms:>9.3f} {ms / B:>11.4f} {wbytes / 1e6:>10.1f} {floor:>9.3f} "
                  f"{100 * floor / ms:>7.0f}%")
        del prop


if __name__ == "__main__":
    main()
