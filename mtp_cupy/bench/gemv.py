"""The GEMV benchmark (scripts/bench_kernels.py): achieved read bandwidth of mtp_cupy's linear kernels per
format and shape against the copy bandwidth and cuBLAS (cupy.matmul) on the same bytes, cold L2, plus a
few small kernels (argmax, rms_norm, the fused residual add + norm) and an empty kernel as the timing floor.
Each function takes an `EventTimer` (`EventTimer.cupy(warmup=3, sync_flush=False)`). CuPy is imported
inside the functions."""
from __future__ import annotations

import numpy as np

from ..errors import KernelError
from ..runtime.ptr import DevicePtr
from ..weights.linear import Linear

BF16_SHAPES = [(129280, 7168), (154880, 6144), (151936, 2048), (7168, 14336), (4096, 2048)]
QUANT_SHAPES = [(129280, 7168), (7168, 14336), (7168, 2048), (2048, 7168)]
BATCH_SHAPES = [(7168, 14336), (129280, 7168)]
BATCH_M = [1, 2, 4, 8, 16, 32]
# Each family's mid-size projections at real dims (family, weight, fmt, n, k): under 132 row tiles of 16 for
# the first of each family, the cases split-K across a cluster's blocks is for (bench_kernels.py --mid)
MID_SHAPES = [("deepseek_v4", "wkv", "fp8_block_e8m0", 512, 4096),
              ("deepseek_v4", "wq_a", "fp8_block_e8m0", 1024, 4096),
              ("deepseek_v4", "shared gate / up", "fp8_block_e8m0", 2048, 4096),
              ("deepseek_v4", "shared down", "fp8_block_e8m0", 4096, 2048),
              ("deepseek_v4", "wq_b", "fp8_block_e8m0", 32768, 1024),
              ("deepseek_v4", "wo_b", "fp8_block_e8m0", 4096, 8192),
              ("deepseek_v3", "kv_a", "fp8_block", 576, 7168), ("deepseek_v3", "q_a", "fp8_block", 1536, 7168),
              ("deepseek_v3", "shared gate / up", "fp8_block", 2048, 7168),
              ("deepseek_v3", "q_b", "fp8_block", 24576, 1536), ("deepseek_v3", "o_proj", "fp8_block", 7168, 16384),
              ("glm5", "kv_a", "fp8_block", 576, 6144), ("glm5", "q_a", "fp8_block", 2048, 6144),
              ("glm5", "q_b", "fp8_block", 16384, 2048), ("glm5", "o_proj", "fp8_block", 6144, 16384),
              ("qwen3_next", "k / v", "bf16", 512, 2048), ("qwen3_next", "o_proj", "bf16", 2048, 4096),
              ("qwen3_next", "q (+ gate), k, v stacked", "bf16", 9216, 2048)]
# The LM heads (family, n, k) at decode batch widths (bench_kernels.py --heads)
# the e / h projections of the MTP front, for the batch table beside MID_SHAPES: one [D, 2D] bf16 weight, or V4's
# e_proj and h_proj [D, D] in FP8 with e8m0 block scales (mtp.0.e_proj / h_proj; h_proj on each of its 4 streams)
FRONT_SHAPES = [("deepseek_v3", "e / h proj", "bf16", 7168, 14336), ("glm5", "e / h proj", "bf16", 6144, 12288),
                ("deepseek_v4", "e_proj, h_proj", "fp8_block_e8m0", 4096, 4096),
                ("qwen3_next", "e / h proj", "bf16", 2048, 4096)]
MID_BATCH_M = [16, 32, 64]
HEAD_SHAPES = [("deepseek_v3", 129280, 7168), ("glm5", 154880, 6144), ("deepseek_v4", 129280, 4096),
               ("qwen3_next", 151936, 2048)]
HEAD_M = [1, 8, 16, 32, 64]
PREFILL = (7168, 2048, 512)  # n, k, m: the tiled GEMM path
NAN = float("nan")


def ptr(a) -> DevicePtr:
    """The device pointer of a CuPy array."""
    return DevicePtr(a.data.ptr)


def rand_u(shape, lo: int, hi: int, dtype):
    """Uniform integers in [lo, hi) of `dtype`, on the device."""
    import cupy as cp
    return cp.random.randint(lo, hi, shape, dtype=cp.int32).astype(dtype)


def rand_bf16(shape):
    """Random bf16 bit patterns with |v| in [2^-7, 2^-6): finite, no overflow in any peer."""
    import cupy as cp
    b = rand_u(shape, 0, 1 << 16, cp.uint16)
    return (b & 0x807F) | (120 << 7)


def make_linear(fmt: str, n: int, k: int) -> tuple[Linear, list]:
    """A random [n, k] Linear of `fmt` ("bf16", "fp8_block", "fp8_block_e8m0", "mxfp4" or "nvfp4") and the
    arrays that hold it."""
    import cupy as cp
    if fmt == "bf16":
        w = rand_bf16((n, k))
        return Linear(fmt, n, k, ptr(w)), [w]
    if fmt == "fp8_block":
        w = rand_u((n, k), 0, 0x7E, cp.uint8)
        s = cp.full((-(-n // 128), -(-k // 128)), 1e-3, cp.float32)
        return Linear(fmt, n, k, ptr(w), ptr(s)), [w, s]
    if fmt == "fp8_block_e8m0":
        w = rand_u((n, k), 0, 0x7E, cp.uint8)
        s = cp.full((-(-n // 128), -(-k // 128)), 117, cp.uint8)  # 2^-10
        return Linear(fmt, n, k, ptr(w), ptr(s)), [w, s]
    if fmt == "mxfp4":
        w = rand_u((n, k // 2), 0, 256, cp.uint8)
        s = rand_u((n, k // 32), 118, 124, cp.uint8)
        return Linear(fmt, n, k, ptr(w), ptr(s)), [w, s]
    w = rand_u((n, k // 2), 0, 256, cp.uint8)
    s = rand_u((n, k // 16), 0x30, 0x50, cp.uint8)
    return Linear("nvfp4", n, k, ptr(w), ptr(s), 1e-3), [w, s]


def peer_matmul(w16, x16):
    """cuBLAS on the same bytes: bf16 when this cupy has it, else the bits viewed as fp16 (same traffic). w16
    [n, k] with x16 [m, k]; or w16 [G, n, k] with x16 [m, G, k], a batched GEMM y[g] = W[g] x[:, g]^T."""
    import cupy as cp
    import ml_dtypes
    if w16.ndim == 3:
        x16 = x16.transpose(1, 2, 0)   # [G, k, m]
        call = lambda W, X: lambda: cp.matmul(W, X)   # noqa: E731
    else:
        call = lambda W, X: (lambda: W @ X[0]) if X.shape[0] == 1 else (lambda: X @ W.T)   # noqa: E731
    try:
        fn = call(w16.view(np.dtype(ml_dtypes.bfloat16)), x16.view(np.dtype(ml_dtypes.bfloat16)))
        fn()
        return fn, "bf16"
    except Exception:
        return call(w16.view(cp.float16), x16.view(cp.float16)), "f16"


def raw_call(gpu, name: str, W: Linear, x, y, m: int, tune=None):
    """A raw launcher of cuda_src/gemv.cu on W (any format), f32 output; `tune` for streaming kernels."""
    from .. import ops
    fn, n, k = getattr(ops, name), W.n, W.k
    kw = {} if tune is None else {"tune": tune}
    if W.fmt == "bf16":
        return lambda: fn(gpu, W.weight, ptr(x), ptr(y), m, n, k, k, n, "f32", **kw)
    if W.fmt == "nvfp4":
        return lambda: fn(gpu, W.weight, W.scale, W.scale2, ptr(x), ptr(y), m, n, k, k, n, "f32", **kw)
    return lambda: fn(gpu, W.weight, W.scale, ptr(x), ptr(y), m, n, k, k, n, "f32", **kw)


def _linear_row(gpu, timer, copy_gbs, fmt, n, k, m, peer_cache, raw: str | None) -> dict:
    from .. import ops
    import cupy as cp
    W, keep = make_linear(fmt, n, k)
    x = rand_bf16((m, k))
    y = cp.empty((m, n), cp.float32)
    if raw:
        t = timer.us(raw_call(gpu, raw, W, x, y, m))
    else:
        t = timer.us(lambda: ops.linear(gpu, ptr(x), W, ptr(y), m, out_dtype="f32"))
    read = W.weight_bytes + x.nbytes
    key = (n, k, m)
    if key not in peer_cache:
        w16 = keep[0] if fmt == "bf16" else rand_bf16((n, k))
        fn, kind = peer_matmul(w16, x)
        peer_cache[key] = (timer.us(fn), kind)
    tp, kind = peer_cache[key]
    gbs = read / t * 1e-3
    return dict(kernel=f"{raw} ({fmt})" if raw else f"linear {fmt}", shape=f"{m}x{n}x{k}", mb_read=read / 1e6,
                us=t, gbs=gbs, pct_copy=100 * gbs / copy_gbs, cublas_us=tp, cublas_dtype=kind, ratio=t / tp)


def bench_linear(gpu, timer, copy_gbs, fmt, n, k, m, rows, peer_cache, raw: str | None = None) -> None:
    """Append the row of ops.linear (or the raw launcher `raw`) on one shape, f32 output, and its cuBLAS peer.

    Parameters
    ----------
    gpu : CupyBackend
        The device.
    timer : EventTimer
        The cold-L2 timer.
    copy_gbs : float
        Copy bandwidth in GB/s (the "% copy BW" column).
    fmt : str
        Weight format.
    n, k, m : int
        Output rows, input width, batch rows.
    rows : list
        Where the row goes.
    peer_cache : dict
        cuBLAS times per (n, k, m), measured once.
    raw : str, optional
        A launcher of ops to time instead of ops.linear.
    """
    import cupy as cp
    rows.append(_linear_row(gpu, timer, copy_gbs, fmt, n, k, m, peer_cache, raw))
    cp.get_default_memory_pool().free_all_blocks()   # the shape's arrays went with _linear_row


def bench_mid(gpu, timer, copy_gbs) -> list[dict]:
    """MID_SHAPES at m = 1: ops.linear (its plan), the format's 8-row streaming kernel under its default plan
    and under the same planner without split-K across blocks (kb = 1), and cuBLAS bf16 on the same shape.
    Prints a table; returns its rows."""
    import cupy as cp
    from .. import ops
    from ..ops.gemv import _STREAM, Tune
    print("| family | weight | fmt | n x k | MB | plan (ks, kb, walkers) | linear µs | % copy | stream µs | "
          "kb = 1 µs | kb = 1 plan | cuBLAS bf16 µs |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for fam, label, fmt, n, k in MID_SHAPES:
        W, keep = make_linear(fmt, n, k)
        x, y = rand_bf16((1, k)), cp.empty((1, n), cp.float32)
        name = _STREAM[fmt][0]
        p, p1 = ops.plan_gemv(gpu, name, n, k), ops.plan_gemv(gpu, name, n, k, Tune(kb=1))
        t_lin = timer.us(lambda: ops.linear(gpu, ptr(x), W, ptr(y), 1, out_dtype="f32"))
        t_str = timer.us(raw_call(gpu, name, W, x, y, 1))
        t_kb1 = timer.us(raw_call(gpu, name, W, x, y, 1, Tune(kb=1)))
        fn, kind = peer_matmul(keep[0] if fmt == "bf16" else rand_bf16((n, k)), x)
        t_peer = timer.us(fn)
        mb = (W.weight_bytes + x.nbytes) / 1e6
        pct = 100 * mb * 1e3 / t_lin / copy_gbs
        rows.append(dict(family=fam, weight=label, fmt=fmt, n=n, k=k, mb=mb, ks=p.ks, kb=p.kb, walkers=p.blocks,
                         linear_us=t_lin, pct_copy=pct, stream_us=t_str, kb1_us=t_kb1, kb1_ks=p1.ks,
                         peer_us=t_peer, peer=kind))
        print(f"| {fam} | {label} | {fmt} | {n}x{k} | {mb:.1f} | {p.ks}, {p.kb}, {p.blocks} | {t_lin:.1f} | "
              f"{pct:.0f} | {t_str:.1f} | {t_kb1:.1f} | {p1.ks}, 1, {p1.blocks} | {t_peer:.1f} ({kind}) |", flush=True)
    return rows


def bench_mid_batch(gpu, timer, copy_gbs) -> list[dict]:
    """MID_SHAPES and FRONT_SHAPES at MID_BATCH_M rows, batch-invariant: ops.linear(invariant=True) under its
    split (`invariant_tune`; the 64-row x-staged kernel where it holds the split), the 64-row kernel with one
    and with two k slices a block where both fit, the 32-row streaming kernel under the same split (where it
    holds it), the 8-row kernel's passes under it, what linear ran before invariant_tune (the 32-row kernel under
    the 8-row plan's split where it fits, else 8-row passes), and cuBLAS bf16. Prints a table; returns its rows."""
    import cupy as cp
    from .. import ops
    from ..ops.gemv import _STREAM, X64_KERNELS, Tune, _fits, plan_batch64, x64_fits
    print("| family | weight | fmt | m x n x k | MB | floor µs | split (8-row plan) | 64-row plan (xs, cb, walkers, "
          "stages) "
          "| linear µs | % copy | xs = 1 µs | xs = 2 µs | 32-row µs | 8-row µs | before µs | cuBLAS bf16 µs |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for fam, label, fmt, n, k in MID_SHAPES + FRONT_SHAPES:
        W, keep = make_linear(fmt, n, k)
        narrow, wide = _STREAM[fmt]
        p = ops.invariant_tune(gpu, fmt, n, k)   # the split linear(invariant) sums under
        p0 = ops.plan_gemv(gpu, narrow, n, k)
        tune = Tune(ks=p0.ks, kb=p0.kb)
        fits = fmt in X64_KERNELS and x64_fits(gpu, fmt, n, k, p.ks, p.kb)
        wb = wide if _fits(gpu, wide, n, k, tune) else narrow
        split = Tune(ks=p.ks, kb=p.kb)
        w32 = _fits(gpu, wide, n, k, split)   # the 32-row kernel under linear's split (a routing alternative)
        wpeer = keep[0] if fmt == "bf16" else rand_bf16((n, k))
        for m in MID_BATCH_M:
            x, y = rand_bf16((m, k)), cp.empty((m, n), cp.float32)
            t_lin = timer.us(lambda: ops.linear(gpu, ptr(x), W, ptr(y), m, out_dtype="f32", invariant=True))
            t_xs = {}
            for xs in (1, 2):
                try:
                    plan_batch64(gpu, n, k, p.ks, p.kb, fmt, slices=xs)
                except KernelError:
                    t_xs[xs] = NAN
                    continue
                fn = getattr(ops, X64_KERNELS[fmt])
                lead = (W.weight,) if fmt == "bf16" else (W.weight, W.scale)
                t_xs[xs] = timer.us(lambda: fn(gpu, *lead, ptr(x), ptr(y), m, n, k, k, n, "f32", ks=p.ks, kb=p.kb,
                                               slices=xs))
            t_32 = timer.us(raw_call(gpu, wide, W, x, y, m, split)) if w32 else NAN
            t_8 = timer.us(raw_call(gpu, narrow, W, x, y, m, split))
            t_old = timer.us(raw_call(gpu, wb, W, x, y, m, tune))
            fn, kind = peer_matmul(wpeer, x)
            t_peer = timer.us(fn)
            mb = (W.weight_bytes + x.nbytes) / 1e6
            floor = mb * 1e3 / copy_gbs
            q = plan_batch64(gpu, n, k, p.ks, p.kb, fmt) if fits else None
            qs = f"{q.ks}, {q.kb}, {q.blocks}, {q.stages}" if q else "-"
            rows.append(dict(family=fam, weight=label, fmt=fmt, m=m, n=n, k=k, mb=mb, floor_us=floor, ks=p.ks,
                             kb=p.kb, x64=qs, linear_us=t_lin, pct_copy=100 * floor / t_lin, xs1_us=t_xs[1],
                             xs2_us=t_xs[2], batch32_us=t_32, batch8_us=t_8, before_us=t_old, before=wb,
                             peer_us=t_peer, peer=kind))
            print(f"| {fam} | {label} | {fmt} | {m}x{n}x{k} | {mb:.1f} | {floor:.1f} | {p.ks}, {p.kb} "
                  f"({p0.ks}, {p0.kb}) | {qs} | "
                  f"{t_lin:.1f} | {100 * floor / t_lin:.0f} | {t_xs[1]:.1f} | {t_xs[2]:.1f} | {t_32:.1f} | {t_8:.1f} | "
                  f"{t_old:.1f} | "
                  f"{t_peer:.1f} ({kind}) |", flush=True)
        W = keep = wpeer = None
        cp.get_default_memory_pool().free_all_blocks()
    return rows


# Each family's grouped GEMVs (family, weight, fmt, groups, n, k, row0, group_rows), the tensor-core form
# (bench_kernels.py --grouped): V4's wo_a over the attention output's 8 groups, MLA's per-head W_UK^T (bf16,
# transposed at load) and W_UV read in place from kv_b (rows h * (dn + dv) + dn)
GROUPED_SHAPES = [("deepseek_v4", "wo_a", "fp8_block_e8m0", 8, 1024, 4096, 0, None),
                  ("deepseek_v3", "W_UK^T", "bf16", 128, 512, 128, 0, None),
                  ("deepseek_v3", "W_UV", "fp8_block", 128, 128, 512, 128, 256),
                  ("glm5", "W_UK^T", "bf16", 64, 512, 192, 0, None),
                  ("glm5", "W_UV", "fp8_block", 64, 256, 512, 192, 448)]
GROUPED_M = [1, 8, 16, 32, 64]


def bench_grouped(gpu, timer, copy_gbs) -> list[dict]:
    """GROUPED_SHAPES at GROUPED_M rows: ops.grouped_gemv's tensor-core form in 8-row items, in 32-row items
    (m > 1) and as the launcher chooses, and cuBLAS's batched GEMM over the groups on the same weight bytes. The
    floor is the weight bytes read once (+ x and y) at the copy bandwidth. Prints a table; returns its rows."""
    import cupy as cp
    from .. import ops
    print("| family | weight | fmt | groups x n x k | m | MB | floor µs | 8-row items µs | 32-row items µs | "
          "chosen µs | % copy | cuBLAS bf16 batched µs |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for fam, label, fmt, G, n, k, row0, gr in GROUPED_SHAPES:
        step = n if gr is None else gr
        W, keep = make_linear(fmt, row0 + (G - 1) * step + n, k)
        tab = ops.upload_group_table(gpu, W, G, n, row0, gr)
        wpeer = rand_bf16((G, n, k))
        wbytes = G * n * k * (2 if fmt == "bf16" else 1)
        for m in GROUPED_M:
            x, y = rand_bf16((m, G * k)), cp.empty((m, G * n), cp.uint16)
            t = {r: timer.us(lambda: ops.grouped_gemv(gpu, ptr(x), W, ptr(y), G, n, row0=row0, group_rows=gr, m=m,
                                                      table=tab, rows=r))
                 for r in (ops.MMA8_ROWS, ops.PLAN_ROWS) if r != ops.PLAN_ROWS or m > 1}
            t[None] = t[ops.item_rows(m)]   # what the launcher picks: one of the two timed above
            fn, kind = peer_matmul(wpeer, x.reshape(m, G, k))
            t_peer = timer.us(fn)
            mb = (wbytes + x.nbytes + y.nbytes) / 1e6
            floor = mb * 1e3 / copy_gbs
            t32 = t.get(ops.PLAN_ROWS, NAN)
            rows.append(dict(family=fam, weight=label, fmt=fmt, groups=G, n=n, k=k, m=m, mb=mb, floor_us=floor,
                             rows8_us=t[ops.MMA8_ROWS], rows32_us=t32, chosen_us=t[None],
                             pct_copy=100 * floor / t[None], peer_us=t_peer, peer=kind))
            print(f"| {fam} | {label} | {fmt} | {G}x{n}x{k} | {m} | {mb:.1f} | {floor:.1f} | "
                  f"{t[ops.MMA8_ROWS]:.1f} | {t32:.1f} | {t[None]:.1f} | {100 * floor / t[None]:.0f} | "
                  f"{t_peer:.1f} ({kind}) |", flush=True)
        W = keep = tab = wpeer = None
        cp.get_default_memory_pool().free_all_blocks()
    return rows


def bench_heads(gpu, timer, copy_gbs) -> list[dict]:
    """HEAD_SHAPES at HEAD_M rows, batch-invariant: ops.linear(invariant=True) (x staged per block,
    dense_gemv_bf16_batch64, for m > 8), the 32-row streaming kernel under the same k-split (what linear ran
    before), and cuBLAS bf16 on the same bytes. The floor is the weight bytes (+ x) at the copy bandwidth.
    Prints a table; returns its rows."""
    import cupy as cp
    from .. import ops
    from ..ops.gemv import Tune
    print("| family | m x n x k | MB | floor µs | linear µs | % copy | batch32 µs | cuBLAS bf16 µs | "
          "linear / cuBLAS |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    for fam, n, k in HEAD_SHAPES:
        W, keep = make_linear("bf16", n, k)
        p = ops.plan_gemv(gpu, "dense_gemv_bf16_batchm", n, k)
        for m in HEAD_M:
            x, y = rand_bf16((m, k)), cp.empty((m, n), cp.float32)
            t_lin = timer.us(lambda: ops.linear(gpu, ptr(x), W, ptr(y), m, out_dtype="f32", invariant=True))
            t_32 = timer.us(raw_call(gpu, "dense_gemv_bf16_batch32", W, x, y, m, Tune(ks=p.ks, kb=p.kb))) \
                if m > 8 else NAN
            fn, kind = peer_matmul(keep[0], x)
            t_peer = timer.us(fn)
            mb = (W.weight_bytes + x.nbytes) / 1e6
            floor = mb * 1e3 / copy_gbs
            rows.append(dict(family=fam, m=m, n=n, k=k, mb=mb, floor_us=floor, linear_us=t_lin,
                             pct_copy=100 * floor / t_lin, batch32_us=t_32, peer_us=t_peer, peer=kind))
            print(f"| {fam} | {m}x{n}x{k} | {mb:.0f} | {floor:.1f} | {t_lin:.1f} | {100 * floor / t_lin:.0f} | "
                  f"{t_32:.1f} | {t_peer:.1f} ({kind}) | {t_lin / t_peer:.2f} |", flush=True)
        W = keep = None   # this head's arrays go before the next one is made
        cp.get_default_memory_pool().free_all_blocks()
    return rows


def _row(kernel, shape, mb, us, gbs=NAN, cublas_us=NAN, cublas_dtype="-") -> dict:
    return dict(kernel=kernel, shape=shape, mb_read=mb, us=us, gbs=gbs, pct_copy=NAN, cublas_us=cublas_us,
                cublas_dtype=cublas_dtype, ratio=us / cublas_us if cublas_us == cublas_us else NAN)


def bench_optional(gpu, timer, rows, notes) -> None:
    """ops.argmax / ops.rms_norm / ops.add_rms_norm (when those launchers exist) against cupy or the launches
    they replace, and an empty kernel (the timing floor); appends to `rows`, skips to `notes`."""
    from .. import ops
    import cupy as cp
    n, d = 154880, 7168
    logits = cp.random.standard_normal(n, dtype=cp.float32)
    out_id = cp.empty(1, cp.int32)
    try:
        t = timer.us(lambda: ops.argmax(gpu, ptr(logits), n, ptr(out_id), dtype="f32"))
        tp = timer.us(lambda: cp.argmax(logits))
        rows.append(_row("argmax f32", str(n), logits.nbytes / 1e6, t, logits.nbytes / t * 1e-3, tp, "cupy.argmax"))
    except (AttributeError, TypeError, KernelError) as e:
        notes.append(f"argmax skipped: {e}")
    noop = cp.RawKernel('extern "C" __global__ void noop() {}', "noop")
    rows.append(_row("empty kernel (timing floor)", "1 block", 0.0, timer.us(lambda: noop((1,), (32,), ()))))
    x, w = rand_bf16((1, d)), rand_bf16(d)
    yb = cp.empty_like(x)
    try:
        t = timer.us(lambda: ops.rms_norm(gpu, ptr(x), ptr(w), ptr(yb), 1, d, 1e-6))
        rows.append(_row("rms_norm", f"1x{d}", (x.nbytes + w.nbytes) / 1e6, t))
    except (AttributeError, TypeError, KernelError) as e:
        notes.append(f"rms_norm skipped: {e}")
    r = rand_bf16((1, d))
    try:  # the fused residual add + norm against the two launches it replaces
        t = timer.us(lambda: ops.add_rms_norm(gpu, ptr(x), ptr(r), ptr(w), ptr(yb), 1, d, 1e-6))
        tp = timer.us(lambda: (ops.bf16_residual_add(gpu, ptr(x), ptr(r), d),
                               ops.rms_norm(gpu, ptr(x), ptr(w), ptr(yb), 1, d, 1e-6)))
        rows.append(_row("add_rms_norm", f"1x{d}", (2 * x.nbytes + w.nbytes) / 1e6, t, NAN, tp,
                         "residual_add + rms_norm"))
    except (AttributeError, TypeError, KernelError) as e:
        notes.append(f"add_rms_norm skipped: {e}")
