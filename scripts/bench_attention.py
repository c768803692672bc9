"""Decode attention on one CUDA GPU: split mode (partials + attn_combine) against walk mode (one block walks a
sequence's chunks and merges them itself), batch-invariant, per family shape and batch width, cold L2.

    python scripts/bench_attention.py [--family all] [--batches 1,2,4,8,16,32,64] [--ctx 2048] [--iters N]
                                      [--json PATH] [--groups 1,2,4,8]
    ncu --profile-from-start off -k regex:decode_walk --section WarpStateStats \
        python scripts/bench_attention.py --family deepseek_v3 --batches 64 --profile walk

Shapes (each family's decode attention at its real dims): DeepSeek-V3 MLA (128 heads, 576 / 512 bf16 latent
rows), GLM-5 (64 heads, the same rows, DSA selecting every row), DeepSeek-V4 (64 heads, 512-wide blocked fp8
rows, a 128-row window and a sink), Qwen3-Next gated GQA (16 q heads over 2 KV heads of 256, bf16). Every
sequence holds --ctx rows in a randomly permuted block pool. The floor is the KV bytes every sequence reads
(+ q and the output) at the measured copy bandwidth; the peer is torch (bf16 matmul, softmax, matmul on dense
copies of the same rows, batched over the sequences), in the same process when torch sees the GPU. `--groups`
adds split mode at each given number of splits a block (`group=`; the split column is the launcher's choice), the
data behind `_MAX_GROUP` and the walk's cost model."""
from __future__ import annotations

import json

import numpy as np

import mtp_cupy
from mtp_cupy import ops
from mtp_cupy.bench import EventTimer, copy_bandwidth, device_name
from mtp_cupy.bench.cli import Parser, int_list, positive_int, run_main
from mtp_cupy.ops.paged_attention import _HEADS
from mtp_cupy.runtime.arena import pack_mtp_attn_meta
from mtp_cupy.runtime.ptr import NULL, DevicePtr

META_STRIDE = 1024
# family, kind, q heads, kv heads, row width (dk), v width, kv dtype, nope, window, sink, dsa
SHAPES = [("deepseek_v3", "mla", 128, 1, 576, 512, "bf16", 0, 0, False, False),
          ("glm5", "mla", 64, 1, 576, 512, "bf16", 0, 0, False, True),
          ("deepseek_v4", "mla", 64, 1, 512, 512, "fp8", 448, 128, True, False),
          ("qwen3_next", "gqa", 16, 2, 256, 256, "bf16", 0, 0, False, False)]


def _ptr(a) -> DevicePtr:
    return DevicePtr(a.data.ptr)


def _case(gpu, shape, b: int, ctx: int):
    """(run(walk, group=None), bytes read, torch peer or None) for b sequences of ctx rows."""
    import cupy as cp
    fam, kind, hq, hkv, dk, dv, kvd, nope, window, sink, dsa = shape
    rng = np.random.default_rng(0)
    blocks = -(-ctx // 16)
    ids = rng.permutation(b * blocks + 3)
    meta = bytearray()
    for s in range(b):
        slab = pack_mtp_attn_meta(ctx - 1, 0, ctx, ids[s * blocks:(s + 1) * blocks].tolist(), META_STRIDE)
        meta += slab + bytes(META_STRIDE - len(slab))
    meta = cp.asarray(np.frombuffer(bytes(meta), np.uint8))
    rows = (b * blocks + 3) * 16
    q = (cp.random.standard_normal((b, hq, dk), cp.float32) * 0.1).astype(cp.float16).view(cp.uint16)
    out = cp.empty((b, hq, dv), cp.uint16)
    if kind == "gqa":
        kc = cp.random.randint(0, 1 << 16, (rows, hkv * dk), dtype=cp.int32).astype(cp.uint16) & 0x3FFF
        vc = kc.copy()
        kv_bytes = 2 * b * ctx * hkv * dk * 2

        def run(walk, group=None):
            ops.gqa_decode(gpu, _ptr(q), hq * dk, _ptr(kc), _ptr(vc), _ptr(meta), META_STRIDE, _ptr(out), b, hq,
                           hkv, dk, dk ** -0.5, invariant=True, walk=walk, group=group)
    else:
        if kvd == "fp8":
            row_bytes = ops.fp8_block_layout(dk, nope)[2]
            cache = cp.random.randint(0, 0x7E, (rows, row_bytes), dtype=cp.int32).astype(cp.uint8)
        else:
            row_bytes = 2 * dk
            cache = cp.random.randint(0, 1 << 16, (rows, dk), dtype=cp.int32).astype(cp.uint16) & 0x3FFF
        attended = min(ctx, window) if window else ctx
        kv_bytes = b * attended * row_bytes
        sk = cp.zeros(hq, cp.float32) if sink else None
        sel = cp.asarray(np.tile(np.arange(ctx, dtype=np.int32), (b, 1))) if dsa else None

        def run(walk, group=None):
            ops.mla_decode(gpu, _ptr(q), _ptr(cache), _ptr(meta), META_STRIDE, _ptr(out), b, hq, dk, dv,
                           dk ** -0.5, window=window, sink=_ptr(sk) if sk is not None else NULL,
                           sel=_ptr(sel) if sel is not None else NULL, sel_stride=ctx if dsa else 0, kv_dtype=kvd,
                           nope=nope, invariant=True, walk=walk, group=group)
    total = kv_bytes + q.nbytes + out.nbytes
    return run, total, _torch_peer(b, hq, hkv, dk, dv, min(ctx, window) if window else ctx)


def _torch_peer(b, hq, hkv, dk, dv, n):
    """softmax(q k^T) v in bf16 torch over dense [b, hkv, n, dk] rows (the heads of a KV head batched)."""
    try:
        import torch
        if not torch.cuda.is_available():
            return None
    except ImportError:
        return None
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, hkv, hq // hkv, dk, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(b, hkv, n, dk, device="cuda", dtype=torch.bfloat16, generator=g)
    v = k[..., :dv] if dv < dk else torch.randn(b, hkv, n, dv, device="cuda", dtype=torch.bfloat16, generator=g)
    scale = dk ** -0.5
    return lambda: torch.softmax((q @ k.transpose(-1, -2)).float() * scale, -1).to(torch.bfloat16) @ v


def main() -> None:
    ap = Parser(__doc__)
    ap.add_argument("--family", choices=[sh[0] for sh in SHAPES] + ["all"], default="all",
                    help="the family shape to time, or all")
    ap.add_argument("--batches", type=int_list, default=[1, 2, 4, 8, 16, 32, 64], help="batch widths")
    ap.add_argument("--ctx", type=positive_int, default=2048, help="rows per sequence")
    ap.add_argument("--iters", type=positive_int, default=20, help="timed calls per point")
    ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON (default: none)")
    ap.add_argument("--groups", type=int_list, default=[], help="also time split mode at these splits a block "
                    "(default: none)")
    ap.add_argument("--profile", choices=["split", "walk", "auto"], help="time nothing: run each point once in "
                    "that mode inside a CUDA profiler range, for `ncu --profile-from-start off` (default: time)")
    a = ap.parse_args()
    gpu = mtp_cupy.device("cuda")   # a one-line ConfigError without CUDA, before cupy is imported
    import cupy as cp
    if a.profile:
        walk = {"split": False, "walk": True, "auto": None}[a.profile]
        for shape in (sh for sh in SHAPES if a.family in ("all", sh[0])):
            for b in a.batches:
                run = _case(gpu, shape, b, a.ctx)[0]
                run(walk)                      # compiles and warms up outside the range
                cp.cuda.Device().synchronize()
                cp.cuda.profiler.start()
                run(walk)
                cp.cuda.Device().synchronize()
                cp.cuda.profiler.stop()
                print(f"{shape[0]} B={b} {a.profile}: one call profiled", flush=True)
        return
    timer = EventTimer.cupy(iters=a.iters, warmup=3, sync_flush=False)
    copy_gbs = copy_bandwidth(gpu) / 1e9
    print(f"# Decode attention on {device_name(gpu)}: ctx {a.ctx}, batch-invariant, D2D copy {copy_gbs:.0f} GB/s, "
          f"cold L2, median of {timer.iters}\n")
    by_g = " | split µs at G = " + " / ".join(map(str, a.groups)) if a.groups else ""
    print("| family | B | head blocks | MB read | floor µs | split µs | walk µs | auto | best, % of copy | "
          f"torch µs{by_g} |")
    print("|---|---|---|---|---|---|---|---|---|---|" + ("---|" if a.groups else ""))
    res = []
    for shape in (sh for sh in SHAPES if a.family in ("all", sh[0])):
        hq, hkv = shape[2], shape[3]
        hb = -(-hq // _HEADS) if shape[1] == "mla" else hq // min(hq // hkv, _HEADS)
        for b in a.batches:
            run, nbytes, peer = _case(gpu, shape, b, a.ctx)
            t_split, t_walk = timer.us(lambda: run(False)), timer.us(lambda: run(True))
            t_auto = timer.us(lambda: run(None))
            t_peer = timer.us(peer) if peer else float("nan")
            t_g = [timer.us(lambda g=g: run(False, g)) for g in a.groups]
            floor = nbytes / copy_gbs / 1e3
            best = min(t_split, t_walk)
            res.append(dict(family=shape[0], batch=b, head_blocks=hb, mb=nbytes / 1e6, floor_us=floor,
                            split_us=t_split, walk_us=t_walk, auto_us=t_auto, torch_us=t_peer,
                            split_us_by_group=dict(zip(a.groups, t_g))))
            cells = " | " + " / ".join(f"{t:.1f}" for t in t_g) if a.groups else ""
            print(f"| {shape[0]} | {b} | {hb} | {nbytes / 1e6:.1f} | {floor:.1f} | {t_split:.1f} | {t_walk:.1f} | "
                  f"{t_auto:.1f} | {'walk' if t_walk < t_split else 'split'}, {100 * floor / best:.0f}% | "
                  f"{t_peer:.1f}{cells} |", flush=True)
            cp.get_default_memory_pool().free_all_blocks()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(gpu=device_name(gpu), copy_gbs=copy_gbs, ctx=a.ctx, rows=res), f, indent=1)


if __name__ == "__main__":
    run_main(main)
