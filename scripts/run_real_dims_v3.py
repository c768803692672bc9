"""DeepSeek-V3/R1 MTP proposer at its real dims (hidden 7168, 128 MLA heads: q_lora 1536, latent 512 + rope 64,
nope 128, v 128; 256 FP8 experts top-8 in 8 groups + 1 shared; vocab 129280) with random weights in the real
formats (FP8 block + f32 weight_scale_inv; BF16 eh_proj, router, embedding and LM head) generated on the
device: milliseconds per draft step next to the weight-bytes floor (bytes a step must read / measured device
copy bandwidth), and a per-phase split.

    python scripts/run_real_dims_v3.py                          # ctx 2048, 3 drafts per propose
    python scripts/run_real_dims_v3.py --ctx 8192 --drafts 5
    python scripts/run_real_dims_v3.py --device ref --tiny --ctx 16 --iters 1   # CPU smoke run of this code

Each timed call is `propose(k)` over --ctx drafter rows (prefilled first) followed by `after_verify(0)`; the
host launches every kernel (no CUDA graph), so the step time includes Python launch overhead. W_UK^T is
random rather than the transpose of kv_b_proj: the bytes and kernels are those of a real checkpoint."""
from __future__ import annotations

import argparse
import math
import time

import numpy as np

import mtp_cupy
from mtp_cupy.models.deepseek_v3 import DeepseekV3MtpProposer
from mtp_cupy.weights.config import DeepseekV3Config
from mtp_cupy.testing.tiny.deepseek_v3 import TINY_DIMS, TINY_YARN
from mtp_cupy.weights.deepseek_v3 import NORMS, DeepseekV3MtpWeights
from mtp_cupy.weights.linear import Linear
from run_real_dims_v4 import RandomDevice, copy_bandwidth, prefill_and_time, time_phases

REAL = dict(model_type="deepseek_v3", hidden_size=7168, num_hidden_layers=61, num_attention_heads=128,
            q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
            moe_intermediate_size=2048, n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4,
            n_shared_experts=1, routed_scaling_factor=2.5, vocab_size=129280, rms_norm_eps=1e-6, rope_theta=10000.0,
            first_k_dense_replace=3, rope_scaling=TINY_YARN)
TINY = {**REAL, **TINY_DIMS}


def fp8_block(r: RandomDevice, n: int, k: int) -> Linear:
    """fp8_block [n, k] with f32 block scales, values about N(0, 1/k) (e4m3 codes below 2 in magnitude)."""
    s = 2.0 ** (-round(math.log2(math.sqrt(k))) - 1)
    return Linear("fp8_block", n, k, r.codes(n * k, 0xBF), r.f32(-(-n // 128) * -(-k // 128), 0.0, s))


def random_weights(gpu, cfg: DeepseekV3Config, seed: int) -> DeepseekV3MtpWeights:
    r = RandomDevice(gpu, seed)
    D, V, H = cfg.hidden_size, cfg.vocab_size, cfg.num_attention_heads
    C, dn, dr, dv, QL = cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.q_lora_rank
    E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
    norms = {n: r.bf16(D, 0.1, 1.0) for n in NORMS}
    norms.update(q_a_layernorm=r.bf16(QL, 0.1, 1.0), kv_a_layernorm=r.bf16(C, 0.1, 1.0))
    return DeepseekV3MtpWeights(
        embed=r.bf16(V * D, 1.0), head=Linear("bf16", V, D, r.bf16(V * D, D ** -0.5)), norms=norms,
        eh_proj=Linear("bf16", D, 2 * D, r.bf16(2 * D * D, (2 * D) ** -0.5)), q_a=fp8_block(r, QL, D),
        q_b=fp8_block(r, H * (dn + dr), QL), kv_a=fp8_block(r, C + dr, D), w_uk_t=fp8_block(r, H * C, dn),
        kv_b=fp8_block(r, H * (dn + dv), C), o_proj=fp8_block(r, D, H * dv),
        router=Linear("bf16", E, D, r.bf16(E * D, D ** -0.5)), bias=r.f32(E, 0.1),
        experts={e: (fp8_block(r, I, D), fp8_block(r, I, D), fp8_block(r, D, I)) for e in range(E)},
        shared=(fp8_block(r, I, D), fp8_block(r, I, D), fp8_block(r, D, I)), owners=r.owners)


def phase_ms(prop: DeepseekV3MtpProposer, st, position: int, iters: int) -> dict[str, float]:
    """GPU milliseconds of each part of one draft step (CUDA events; re-runs the newest row in place)."""
    gpu, b = prop.gpu, prop.bufs
    if not gpu.is_cuda:
        return {}
    prop._meta(st, position, st.blocks.rows - 1)
    phases = {
        "front (embed, norms, eh_proj, ln)": lambda: (prop.front.forward(b.ids, prop.carry, b.x, 1), prop.norm("input_layernorm", b.x, b.xn, 1)),
        "MLA (absorbed decode)": lambda: prop.mla.forward(b.xn, b.tmp, 1, b.mtp_meta, b.mtp_meta_capacity),
        "residual + post-attn norm (fused)": lambda: prop.norm.add("post_attention_layernorm", b.x, b.tmp, b.xn, 1),
        "MoE (router, 8 + shared)": lambda: prop.moe.forward(b.xn, b.tmp, m=1),
        "residual + shared_head.norm (fused)": lambda: prop.norm.add("shared_head.norm", b.x, b.tmp, b.xn, 1),
        "LM head": lambda: mtp_cupy.ops.linear(gpu, b.xn, prop.head, b.logits, 1, out_dtype="f32"),
        "argmax": lambda: prop._pick(0, b.logits, None, False),
    }
    return time_phases(gpu, phases, iters)


def run(device: str = "cuda", tiny: bool = False, ctx: int = 2048, drafts: int = 3, iters: int = 10,
        seed: int = 0) -> dict:
    """Build the proposer, prefill `ctx` rows, time propose(drafts); returns the numbers main() prints."""
    gpu = mtp_cupy.device(device)
    cfg = DeepseekV3Config.from_dict(TINY if tiny else REAL)
    t0 = time.perf_counter()
    prop = DeepseekV3MtpProposer(gpu, cfg, random_weights(gpu, cfg, seed), max_seq_len=ctx + drafts + 16,
                                 max_drafts=drafts)
    built = time.perf_counter() - t0
    st, h, prefill_s, times = prefill_and_time(gpu, prop, cfg.vocab_size, (cfg.hidden_size,), ctx, drafts, iters,
                                               seed)
    phases = phase_ms(prop, st, ctx, iters)
    bw = copy_bandwidth(gpu)
    wbytes = prop.weight_bytes_per_step()
    kv_bytes = (ctx + 1) * prop.dims.row_width * 2
    return dict(device=gpu.name, built_s=built, prefill_s=prefill_s, ctx=ctx, drafts=drafts,
                ms_per_step=1e3 * float(np.median(times)) / drafts, weight_bytes=wbytes, kv_bytes=kv_bytes,
                copy_gbs=bw / 1e9 if bw else None, floor_ms=1e3 * (wbytes + kv_bytes) / bw if bw else None,
                phases=phases)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ctx", type=int, default=2048, help="drafter rows before drafting")
    p.add_argument("--drafts", type=int, default=3, help="draft steps per propose")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["auto", "cuda", "ref"], default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny dims (a smoke run of this script)")
    a = p.parse_args()
    r = run(a.device, a.tiny, a.ctx, a.drafts, a.iters, a.seed)
    print(f"DeepSeek-V3{' (tiny)' if a.tiny else ''} MTP, hidden {(TINY if a.tiny else REAL)['hidden_size']}, "
          f"ctx {r['ctx']}, {r['drafts']} drafts per call; device {r['device']}; weights built in "
          f"{r['built_s']:.1f} s; prefill of {r['ctx']} rows {1e3 * r['prefill_s']:.1f} ms")
    line = (f"ms/draft step {r['ms_per_step']:.3f}; weight bytes/step {r['weight_bytes'] / 1e6:.1f} MB "
            f"+ latent KV {r['kv_bytes'] / 1e6:.1f} MB")
    if r["floor_ms"]:
        line += (f"; copy bandwidth {r['copy_gbs']:.0f} GB/s; floor {r['floor_ms']:.3f} ms "
                 f"({100 * r['floor_ms'] / r['ms_per_step']:.0f}% of the step)")
    print(line)
    for name, ms in r["phases"].items():
        print(f"  {name:<36} {1e3 * ms:9.1f} us")


if __name__ == "__main__":
    main()
