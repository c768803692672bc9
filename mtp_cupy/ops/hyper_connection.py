"""Launchers for cuda_src/hyper_connection.cu (mHC, docs/model_math.md B.2). Streams are bf16 [rows, hc, dim].

hc_pre and hc_head run two kernels: hc_mix (the coefficient GEMV split over column chunks, partials into
`work`) and the finishing kernel. Size `work` with `hc_work_bytes(rows, dim, hc)`.

A block step (layers/mhc.py) runs `hc_mix` and a finishing kernel fused with the RMSNorm after it
(`hc_pre_norm`, `hc_head_norm`); at the attention site of small batches `hc_add_mix` also writes the streams
(hc_add, or hc_expand + hc_add) in the mix's launch. Each fused kernel gives the bits of the launches it replaces."""
from ._util import THREADS, blocks_for, launch, need
from .gemv import _sms
from .rms_norm import _aligned, _threads

__all__ = ["HC_MAX", "mix_chunks", "hc_work_bytes", "hc_mix_width", "hc_expand", "hc_add", "hc_pre", "hc_post",
           "hc_head", "hc_mix", "hc_add_mix", "hc_pre_norm", "hc_head_norm"]

HC_MAX = 4          # as in hyper_connection.cu
MIX_CHUNK = 512     # columns per hc_mix block: 32 blocks share V4-Flash's 16384 columns
MIX_ROWS = 8        # most rows an hc_mix block takes (hyper_connection.cu): fn is read once for all of them
MIX_ROWS_PER = 8    # batch rows per row of a block past 16 rows (mix_rows)
MIX_CPT = 2         # columns a thread keeps in registers (hyper_connection.cu): the chunk must fit them
assert MIX_CHUNK <= MIX_CPT * THREADS
DIM_PER_BLOCK = 1024


def mix_chunks(k: int) -> int:
    """hc_mix's column chunks over k = hc * dim columns: the partials a row has in the workspace."""
    return -(-k // MIX_CHUNK)


def hc_work_bytes(rows: int, dim: int, hc: int) -> int:
    """Bytes of f32 partials hc_pre / hc_head need for `rows` rows."""
    return 4 * mix_chunks(hc * dim) * rows * ((2 + hc) * hc + 1)


def hc_mix_width(hc: int, head: bool = False) -> int:
    """Coefficients a site's mix computes: pre | post | comb ((2 + hc) hc), or the head's pre (hc)."""
    return hc if head else (2 + hc) * hc


def _check(name: str, rows: int, dim: int, hc: int) -> None:
    need(1 <= hc <= HC_MAX, f"{name}: hc {hc} outside [1, {HC_MAX}]")
    need(1 <= rows <= 65535 and dim >= 1, f"{name}: rows {rows} (<= 65535) and dim {dim} must be positive")
    need(hc * dim < 1 << 31, f"{name}: hc * dim {hc * dim} is out of range")


def mix_rows(rows: int) -> int:
    """Rows an hc_mix block takes: two up to 16 rows, then one per 8 batch rows (a group reads fn's chunk once;
    fewer, longer blocks lose at small batches: H100, hc_mix + hc_pre at V4 dims, 17.6 / 20.9 / 26.9 / 34.4 µs at
    8 / 16 / 32 / 64 rows against 18.9 / 20.5 / 28.4 / 38.5 for a block per row). Any choice gives a row the
    same bits."""
    return min(MIX_ROWS, max(2, rows // MIX_ROWS_PER))


def _mix(gpu, kernel, lead, X, fn, work, rows, dim, hc, mix, stream):
    """hc_mix or a fused form: `lead` puts the kernel's arguments before fn (X first for every form)."""
    need(mix in (hc, hc_mix_width(hc)), f"{kernel}: mix {mix} is neither hc {hc} nor (2 + hc) hc")
    rpb = mix_rows(rows)
    ln = launch(gpu, "hyper_connection", kernel).grid(mix_chunks(hc * dim), -(-rows // rpb)).block(THREADS).arg_ptr(X)
    lead(ln)
    ln.arg_ptr(fn).arg_ptr(work).arg_u32(rows).arg_u32(dim).arg_u32(hc).arg_u32(mix).arg_u32(MIX_CHUNK) \
        .arg_u32(rpb).launch(stream)


def hc_expand(gpu, x, out, rows, dim, hc, stream=None):
    """out[r, j, :] = x[r, :] for j < hc (x [rows, dim] -> streams [rows, hc, dim])."""
    _check("hc_expand", rows, dim, hc)
    launch(gpu, "hyper_connection", "hc_expand").grid(blocks_for(rows * dim)).block(THREADS) \
        .arg_ptr(x).arg_ptr(out).arg_u32(rows).arg_u32(dim).arg_u32(hc).launch(stream)


def hc_add(gpu, X, x, rows, dim, hc, stream=None):
    """X[r, j, :] += x[r, :] for j < hc (in place, one bf16 rounding)."""
    _check("hc_add", rows, dim, hc)
    launch(gpu, "hyper_connection", "hc_add").grid(blocks_for(rows * dim)).block(THREADS) \
        .arg_ptr(X).arg_ptr(x).arg_u32(rows).arg_u32(dim).arg_u32(hc).launch(stream)


def hc_pre(gpu, X, fn, scale, base, x_out, post, comb, work, rows, dim, hc, rms_eps, hc_eps, iters=20,
           stream=None):
    """Collapse the streams for one layer: x_out bf16 [rows, dim] = sum_j pre_j X_j; post f32 [rows, hc];
    comb f32 [rows, hc, hc] (Sinkhorn, [source j, target k]). fn f32 [(2+hc)hc, hc*dim], scale f32 [3],
    base f32 [(2+hc)hc]."""
    _check("hc_pre", rows, dim, hc)
    need(iters >= 1, f"hc_pre: {iters} Sinkhorn iterations")
    mix = (2 + hc) * hc
    hc_mix(gpu, X, fn, work, rows, dim, hc, mix, stream)
    launch(gpu, "hyper_connection", "hc_pre").grid(rows, blocks_for(dim, DIM_PER_BLOCK)).block(THREADS) \
        .arg_ptr(X).arg_ptr(work).arg_ptr(scale).arg_ptr(base).arg_ptr(x_out).arg_ptr(post).arg_ptr(comb) \
        .arg_u32(rows).arg_u32(dim).arg_u32(hc).arg_u32(mix_chunks(hc * dim)).arg_f32(rms_eps).arg_f32(hc_eps) \
        .arg_u32(iters).launch(stream)


def hc_post(gpu, f, X, post, comb, Y, rows, dim, hc, stream=None, hc_eps=0.0, iters=0):
    """Y[r, k] = post[r, k] f[r] + sum_j comb[r, j, k] X[r, j] (bf16 streams; Y may be X).

    iters 0: comb f32 [rows, hc, hc] is the matrix (hc_pre's). iters > 0: comb holds the Sinkhorn logits that
    hc_pre_norm wrote, and the kernel runs the Sinkhorn (hc_eps, iters) as hc_pre would, before its PDL wait. That
    read is safe only when a kernel that waits before it triggers runs between the hc_pre_norm and this launch (in
    a block step, the attention or the MoE does: layers/mhc.py)."""
    _check("hc_post", rows, dim, hc)
    need(iters >= 0, f"hc_post: {iters} Sinkhorn iterations")
    gx = blocks_for(dim)
    if iters:   # each block runs its row's Sinkhorn: at most ~2 blocks an SM, so it is paid in one wave
        gx = min(gx, max(1, 2 * _sms(gpu) // rows))
    launch(gpu, "hyper_connection", "hc_post").grid(gx, rows).block(THREADS) \
        .arg_ptr(f).arg_ptr(X).arg_ptr(post).arg_ptr(comb).arg_ptr(Y).arg_u32(rows).arg_u32(dim).arg_u32(hc) \
        .arg_f32(hc_eps).arg_u32(iters).launch(stream)


def hc_head(gpu, X, fn, scale, base, y, work, rows, dim, hc, rms_eps, hc_eps, stream=None):
    """Final collapse: y bf16 [rows, dim] = sum_j (sigmoid(mix_j scale + base_j) + hc_eps) X_j; fn f32
    [hc, hc*dim], scale f32 [1], base f32 [hc]."""
    _check("hc_head", rows, dim, hc)
    hc_mix(gpu, X, fn, work, rows, dim, hc, hc, stream)
    launch(gpu, "hyper_connection", "hc_head").grid(rows, blocks_for(dim, DIM_PER_BLOCK)).block(THREADS) \
        .arg_ptr(X).arg_ptr(work).arg_ptr(scale).arg_ptr(base).arg_ptr(y).arg_u32(rows).arg_u32(dim).arg_u32(hc) \
        .arg_u32(mix_chunks(hc * dim)).arg_f32(rms_eps).arg_f32(hc_eps).launch(stream)


def hc_mix(gpu, X, fn, work, rows, dim, hc, mix, stream=None):
    """The coefficient GEMV's partials of the streams X [rows, hc, dim] with fn f32 [mix, hc*dim] into `work`, for
    hc_pre_norm (mix = hc_mix_width(hc)) or hc_head_norm (mix = hc)."""
    _check("hc_mix", rows, dim, hc)
    _mix(gpu, "hc_mix", lambda ln: None, X, fn, work, rows, dim, hc, mix, stream)


def hc_add_mix(gpu, src, src_hc, e, X, fn, work, rows, dim, hc, mix, stream=None):
    """X[r, j] = bf16(src[r, j] + e[r]) (src_hc = hc: hc_add; src may be X) or bf16(src[r] + e[r]) for every j
    (src_hc = 1: hc_expand then hc_add), then hc_mix of X: one launch, the bits of those."""
    _check("hc_add_mix", rows, dim, hc)
    need(src_hc in (1, hc), f"hc_add_mix: src_hc {src_hc} must be 1 or hc {hc}")
    _mix(gpu, "hc_add_mix", lambda ln: ln.arg_ptr(src).arg_u32(src_hc).arg_ptr(e), X, fn, work, rows, dim, hc, mix,
         stream)


def _norm_geometry(name, X, w, y, rows, dim, hc):
    _check(name, rows, dim, hc)
    need(int(w) != 0, f"{name}: the norm weight is required")
    _aligned(name, X, w, y)
    return _threads(name, dim, max_threads=512)


def hc_pre_norm(gpu, X, work, scale, base, w, y, post, logits, rows, dim, hc, rms_eps, hc_eps, norm_eps,
                stream=None):
    """hc_pre's finish over the partials an hc_mix / hc_add_mix left in `work`, then y = rms_norm_w(x, w,
    norm_eps) of the collapsed row x (not stored): the bits of hc_pre then rms_norm. post as hc_pre; logits f32
    [rows, hc, hc]: the comb's Sinkhorn logits L[j, k], which hc_post(..., hc_eps, iters) finishes into hc_pre's
    comb (the Sinkhorn's dependent passes then run beside the layer, not before it)."""
    t = _norm_geometry("hc_pre_norm", X, w, y, rows, dim, hc)
    launch(gpu, "hyper_connection", "hc_pre_norm").grid(rows).block(t).arg_ptr(X).arg_ptr(work).arg_ptr(scale) \
        .arg_ptr(base).arg_ptr(w).arg_ptr(y).arg_ptr(post).arg_ptr(logits).arg_u32(rows).arg_u32(dim).arg_u32(hc) \
        .arg_u32(mix_chunks(hc * dim)).arg_f32(rms_eps).arg_f32(hc_eps).arg_f32(norm_eps).launch(stream)


def hc_head_norm(gpu, X, work, scale, base, w, y, rows, dim, hc, rms_eps, hc_eps, norm_eps, stream=None):
    """hc_head's finish over the partials of a head-width mix in `work`, then y = rms_norm_w of the collapse."""
    t = _norm_geometry("hc_head_norm", X, w, y, rows, dim, hc)
    launch(gpu, "hyper_connection", "hc_head_norm").grid(rows).block(t).arg_ptr(X).arg_ptr(work).arg_ptr(scale) \
        .arg_ptr(base).arg_ptr(w).arg_ptr(y).arg_u32(rows).arg_u32(dim).arg_u32(hc).arg_u32(mix_chunks(hc * dim)) \
        .arg_f32(rms_eps).arg_f32(hc_eps).arg_f32(norm_eps).launch(stream)
