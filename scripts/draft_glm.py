"""GLM-5 MTP drafter over mpirun ranks: prefill, then propose / verify cycles; rank 0 prints the drafts and the
milliseconds per draft step (the slowest rank's).

    mpirun -n 2 python scripts/draft_glm.py                        # tiny checkpoint (rank 0 writes it)
    mpirun -n 2 python scripts/draft_glm.py --checkpoint DIR --head-exchange pairs
    mpirun -n 8 python scripts/draft_glm.py --real-dims --ctx 4096  # GLM-5 dims, random FP8 weights on the GPU
    mpirun -n 2 python scripts/draft_glm.py --device ref --real-dims --tiny --ctx 32   # CPU smoke run

--real-dims builds hidden 6144, vocab 154880, 64 heads (q_lora 2048, latent 512 + rope 64, nope 192, v 256),
indexer 32 x 128 with top-2048, 256 experts top-8 split over the ranks, weights generated on the device in
GLM-5-FP8's formats (block FP8 projections; BF16 eh_proj, router, weights_proj, embedding and head), and
also times the head sweep alone (this rank's BF16 slice vs its FP8 copy) and the argmax exchange alone
(digits: one bf16 all-reduce of 4N lanes; pairs: one all-gather of 8-byte pairs). Verification is
simulated: each cycle accepts a random number of drafts (the same on every rank)."""
from __future__ import annotations

import shutil
import tempfile
import time

import numpy as np

import mtp_cupy
from mtp_cupy import ops
from mtp_cupy.bench import back_to_back_us
from mtp_cupy.bench import glm5 as dims
from mtp_cupy.bench.cli import Parser, device_flags, positive_int, run_main
from mtp_cupy.models import glm5 as glm_mtp
from mtp_cupy.runtime.comm import make_communicator
from mtp_cupy.runtime.dtypes import to_bf16
from mtp_cupy.speculative.vocab_argmax import EXCHANGES, ShardedArgmax
from mtp_cupy.testing.tiny.glm5 import write_tiny_checkpoint
from mtp_cupy.weights.config import GlmMoeDsaConfig
from mtp_cupy.weights.glm5 import Shard

MPI = WORLD = None      # mpi4py, started by main() once the arguments are read


def start_mpi() -> None:
    global MPI, WORLD
    from mpi4py import MPI
    WORLD = MPI.COMM_WORLD


def tiny_checkpoint() -> str:
    """Rank 0 writes the tiny checkpoint; the others wait at the barrier and read the path it broadcast."""
    path = write_tiny_checkpoint(tempfile.mkdtemp(prefix="glm_tiny_")) if WORLD.rank == 0 else None
    path = WORLD.bcast(str(path) if path else None, root=0)
    WORLD.Barrier()
    return path


def slowest(x: float) -> float:
    return WORLD.allreduce(float(x), op=MPI.MAX)


def cycles(prop, ctx: int, drafts: int, n: int, seed: int) -> list[float]:
    """Prefill ctx rows, then n propose / after_verify cycles; returns ms per draft step of each cycle."""
    gpu, D, V = prop.gpu, prop.hidden_size, prop.vocab_size
    rng = np.random.default_rng(seed)        # the same on every rank: the ranks draft in lockstep
    st = prop.alloc_state()
    t0 = time.perf_counter()
    prop.prefill(st, rng.integers(0, V, ctx + 1), to_bf16(rng.standard_normal((ctx, D))))
    gpu.synchronize()
    if WORLD.rank == 0:
        print(f"prefill of {ctx} rows: {1e3 * slowest(time.perf_counter() - t0):.1f} ms")
    else:
        slowest(time.perf_counter() - t0)
    pos, tok, out = ctx, int(rng.integers(V)), []
    for c in range(n):
        h = to_bf16(rng.standard_normal(D))
        t0 = time.perf_counter()
        res = prop.propose(st, tok, h, pos, drafts)
        gpu.synchronize()
        ms = slowest(1e3 * (time.perf_counter() - t0) / drafts)
        acc = int(rng.integers(0, drafts + 1))
        prop.after_verify(st, acc)
        if WORLD.rank == 0:
            print(f"cycle {c}: position {pos} token {tok} -> drafts {res.tokens}, {acc} accepted; {ms:.3f} ms/step")
        out.append(ms)
        pos, tok = st.keys[-1] + 1, int(rng.integers(V))
    prop.free_state(st)
    return out


def parts(prop, comm, iters: int) -> dict[str, float]:
    """Microseconds of the head sweep (BF16 slice, FP8 copy) and of each exchange, alone."""
    gpu, b, w = prop.gpu, prop.bufs, prop.w
    out = {"head sweep, BF16 slice": back_to_back_us(gpu, lambda: ops.linear(gpu, b.carry, w.head, b.hlog, 1), iters)}
    if w.head.fmt == "bf16":
        fp8 = ops.quantize_linear(gpu, w.head, "fp8_row")
        out["head sweep, FP8 slice"] = back_to_back_us(gpu, lambda: ops.linear(gpu, b.carry, fp8, b.hlog, 1), iters)
    if prop.head_sharded:
        for ex in EXCHANGES:
            xa = ShardedArgmax(gpu, comm, prop.head_v0, prop.head_n, ex)
            xa.local(b.hlog)
            out[f"exchange {ex}"] = back_to_back_us(gpu, lambda: xa.exchange_into(b.ids), iters)
        out[f"local argmax ({prop.head_n} bf16)"] = back_to_back_us(gpu, lambda: xa.local(b.hlog), iters)
    return {k: slowest(v) for k, v in out.items()}


def main() -> None:
    p = Parser(__doc__)
    p.add_argument("--checkpoint", help="a glm_moe_dsa checkpoint directory (default: a tiny random one that "
                   "rank 0 writes)")
    p.add_argument("--real-dims", action="store_true", help="GLM-5 dims, random weights made on the device")
    p.add_argument("--tiny", action="store_true", help="with --real-dims: tiny dims (a smoke run of that path)")
    p.add_argument("--quant", choices=["fp8", "bf16"], default="fp8", help="--real-dims projection format")
    p.add_argument("--ctx", type=positive_int, default=64, help="drafter rows prefilled before drafting")
    p.add_argument("--drafts", type=positive_int, default=3, help="draft steps per propose")
    p.add_argument("--cycles", type=positive_int, default=5, help="propose / verify cycles timed")
    p.add_argument("--iters", type=positive_int, default=20, help="--real-dims: repetitions of each part timed alone")
    p.add_argument("--head-fp8", action="store_true", help="draft from an FP8 copy of this rank's head slice")
    p.add_argument("--head-exchange", choices=EXCHANGES, default="digits",
                   help="how the ranks agree on the draft id: digits (one bf16 all-reduce) or pairs (an all-gather)")
    device_flags(p, "auto", tiny=False)
    a = p.parse_args()
    if a.checkpoint and a.real_dims:
        p.error("--checkpoint and --real-dims exclude each other")
    start_mpi()
    rank, world = WORLD.rank, WORLD.size
    gpu = mtp_cupy.device(a.device, device_id=rank)
    comm = make_communicator(gpu, WORLD) if world > 1 else None
    opts = dict(max_drafts=a.drafts, head_fp8=a.head_fp8, head_exchange=a.head_exchange)
    max_seq = a.ctx + a.drafts * a.cycles + 16
    t0 = time.perf_counter()
    if a.real_dims:
        cfg = GlmMoeDsaConfig.from_dict(dims.TINY if a.tiny else dims.REAL)
        shard = Shard(rank, world) if world > 1 else Shard()
        prop = glm_mtp.Glm5MtpProposer(gpu, cfg, dims.random_weights(gpu, cfg, shard, a.seed, a.quant),
                                       max_seq_len=max_seq, comm=comm, **opts)
        what = f"GLM-5 {'tiny' if a.tiny else 'real'} dims, random {a.quant} weights"
    else:
        path = a.checkpoint or tiny_checkpoint()
        prop = glm_mtp.from_checkpoint(path, gpu, max_seq_len=max_seq, comm=comm, **opts)
        if not a.checkpoint:          # the weights are on the device now: drop the tiny checkpoint
            WORLD.Barrier()
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
        cfg, what = prop.cfg, f"checkpoint {path}"
    built = slowest(time.perf_counter() - t0)
    if rank == 0:
        head = f"sharded {prop.head_n} rows/rank, {a.head_exchange}" if prop.head_sharded else "unsharded"
        head += ", FP8 head" if prop.head.fmt == "fp8_row" else ""
        print(f"{what}; {world} rank(s), device {gpu.name}; hidden {cfg.hidden_size}, {cfg.num_attention_heads} "
              f"heads, {cfg.n_routed_experts} experts top-{cfg.num_experts_per_tok}, vocab {cfg.vocab_size} ({head}); "
              f"index_topk {cfg.index_topk}; built in {built:.1f} s")
    ms = cycles(prop, a.ctx, a.drafts, a.cycles, a.seed)
    if rank == 0:
        print(f"ms per draft step (median of {len(ms)} cycles, slowest rank): {float(np.median(ms)):.3f}; "
              f"weight bytes/step/rank {prop.weight_bytes_per_step() / 1e6:.1f} MB")
    if a.real_dims:
        times = parts(prop, comm, a.iters)
        if rank == 0:
            for name, us in times.items():
                print(f"  {name:<36} {us:9.1f} us")


if __name__ == "__main__":
    run_main(main)
