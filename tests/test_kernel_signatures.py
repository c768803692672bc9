"""Kernel argument lists cross-checked: the `extern "C" __global__` parameter lists parsed from cuda_src/*.cu
(macro-defined kernels included) against

- the twins: same parameters after `dev`, by name and order (so also by count), no *args;
- the launchers, as they run: every ops launcher is exercised on the NumPy device with small shapes while
  KernelLaunch.launch records each launch, and each launch must pass the kinds (ptr / u32 / i32 / u64 / i64 /
  f32) the .cu declares, in order. Where a launcher's variable has the name of a kernel parameter
  (case-insensitively: the launchers' m, n, k are the kernels' M, N, K), the value launched at that
  parameter's position must be that variable's, which catches two same-kind arguments swapped. Every kernel
  in cuda_src must be reached by some launcher;
- docs/kernels.md: a backticked `name(gpu, ...)` naming a launcher lists that launcher's parameters in order
  (`stream`, `workspace`, `tune`, `threads` may be left out); a backticked `name(...)` naming a kernel (no
  `gpu`) lists the kernel's parameters (or, starting with `...`, its last ones)."""
from __future__ import annotations

import inspect
import math
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from mtp_cupy import ops
from mtp_cupy.refdev.backend import RefBackend
from mtp_cupy.refdev.registry import load_all
from mtp_cupy.runtime.arena import pack_mtp_attn_meta
from mtp_cupy.runtime.backend import CUDA_SRC, KernelLaunch, cuda_modules
from mtp_cupy.runtime.cuda_text import close_paren, expand_kernel_macros, split_top, strip_comments
from mtp_cupy.runtime.ptr import NULL, DevicePtr
from mtp_cupy.weights.linear import Linear

DOCS = Path(__file__).resolve().parents[1] / "docs" / "kernels.md"
OPS_DIR = Path(ops.__file__).resolve().parent

# -- the .cu side ---------------------------------------------------------------------------------------------

KINDS = {"u32": "u32", "unsigned": "u32", "unsigned int": "u32", "uint32_t": "u32",
         "i32": "i32", "int": "i32", "int32_t": "i32",
         "u64": "u64", "unsigned long long": "u64", "uint64_t": "u64", "size_t": "u64",
         "i64": "i64", "long long": "i64", "int64_t": "i64",
         "float": "f32"}
QUALIFIERS = {"const", "volatile", "__restrict__", "__restrict"}
_BOUNDS = r"(?:__launch_bounds__\s*\([^)]*\)\s*)?"
_KERNEL = re.compile(r'extern\s+"C"\s+__global__\s+' + _BOUNDS + r"void\s+" + _BOUNDS + r"(\w+)\s*\(")


def c_param(decl: str) -> tuple[str, str]:
    """'const __nv_bfloat16* __restrict__ x' -> ('x', 'ptr'); 'u32 n' -> ('n', 'u32')."""
    m = re.fullmatch(r"(.*?)(\w+)", decl.strip(), re.S)
    assert m, f"cannot read parameter {decl!r}"
    ty, name = m.group(1), m.group(2)
    if "*" in ty:
        return name, "ptr"
    base = " ".join(t for t in ty.split() if t not in QUALIFIERS)
    assert base in KINDS, f"parameter {decl!r}: type {base!r} has no launch kind"
    return name, KINDS[base]


def parse_kernels(src: str) -> dict[str, list[tuple[str, str]]]:
    """name -> [(parameter name, kind)] for every extern "C" __global__ in a .cu source."""
    code = expand_kernel_macros(strip_comments(src))
    out = {}
    for m in _KERNEL.finditer(code):
        end = close_paren(code, m.end() - 1)
        assert m.group(1) not in out, f"kernel {m.group(1)} defined twice"
        out[m.group(1)] = [c_param(p) for p in split_top(code[m.end():end - 1])]
    return out


KERNELS = {(mod, name): params for mod in cuda_modules()
           for name, params in parse_kernels((CUDA_SRC / f"{mod}.cu").read_text()).items()}


def test_parser_reads_plain_and_macro_defined_kernels():
    src = '''
    #include "common.cuh"
    #define K(NAME, T) extern "C" __global__ __launch_bounds__(256, 1) void moe_##NAME( \\
        const T* __restrict__ x, /* a comment, with a comma */ u64 n, float s) { body<T>(x, n, s); }
    K(bf16, u16)
    K(f32, float)
    // extern "C" __global__ void commented_out(u32 a) {}
    extern "C" __global__ void __launch_bounds__(128) plain(const i64* p, i32 a, unsigned int b, long long c) {}
    '''
    assert parse_kernels(src) == {
        "moe_bf16": [("x", "ptr"), ("n", "u64"), ("s", "f32")],
        "moe_f32": [("x", "ptr"), ("n", "u64"), ("s", "f32")],
        "plain": [("p", "ptr"), ("a", "i32"), ("b", "u32"), ("c", "i64")]}


def test_every_kernel_is_parsed():
    """The parse finds each kernel the runtime's own scan finds (and those a macro defines)."""
    from mtp_cupy.runtime.backend import cuda_kernel_names
    for mod in cuda_modules():
        assert set(cuda_kernel_names(mod)) <= {n for m, n in KERNELS if m == mod}
    assert len(KERNELS) >= 70


# -- twins ----------------------------------------------------------------------------------------------------

def test_twins_take_the_kernels_arguments():
    twins = load_all()
    bad = []
    for key, params in sorted(KERNELS.items()):
        fn = twins.get(key)
        if fn is None:
            bad.append(f"{key[0]}.{key[1]}: no twin")
            continue
        ps = list(inspect.signature(fn).parameters.values())
        if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in ps):
            bad.append(f"{key[0]}.{key[1]}: the twin takes *args/**kwargs, not the kernel's list")
            continue
        got, want = [p.name for p in ps[1:]], [n for n, _ in params]
        if got != want:
            bad.append(f"{key[0]}.{key[1]}: twin ({', '.join(got)}) != kernel ({', '.join(want)})")
    extra = sorted(set(twins) - set(KERNELS))
    assert not bad and not extra, "\n".join(bad + [f"twin without a kernel: {m}.{n}" for m, n in extra])


# -- launchers ------------------------------------------------------------------------------------------------

def _public_launchers():
    """Code objects of the public launchers (ops modules' __all__ functions)."""
    codes = {}
    for mod in sys.modules.values():
        name = getattr(mod, "__name__", "")
        if name.startswith("mtp_cupy.ops.") and hasattr(mod, "__all__"):
            for n in mod.__all__:
                f = getattr(mod, n)
                if inspect.isfunction(f):
                    codes[f.__code__] = n
    return codes


def _scalar(v):
    """A launcher variable as the number a kernel argument would carry (None where it cannot be one)."""
    if isinstance(v, (bool, np.bool_)):
        return int(v)
    if isinstance(v, (int, np.integer)):
        return int(v)
    if isinstance(v, (float, np.floating)):
        return float(v)
    return None


class Recorder:
    """Patches KernelLaunch.launch: records each launch's kernel, argument kinds and values, and the
    variables of the launcher frames it came from (innermost first, up to the public launcher). A launch
    that fails check_launch is recorded with its problems and not run (its twin would only fail less
    clearly on the misplaced arguments)."""

    def __init__(self, monkeypatch):
        self.launches, self.problems = [], []
        self.public = _public_launchers()
        orig = KernelLaunch.launch
        rec = self

        def launch(self, stream=None):
            entry = (self.h.module, self.h.name, list(self._args), rec._context(sys._getframe(1)))
            rec.launches.append(entry)
            bad = check_launch(*entry)
            rec.problems += bad
            return None if bad else orig(self, stream)
        monkeypatch.setattr(KernelLaunch, "launch", launch)

    def _context(self, frame):
        names, launcher = {}, None
        while frame is not None:
            if Path(frame.f_code.co_filename).resolve().parent != OPS_DIR:
                break
            for k, v in frame.f_locals.items():
                names.setdefault(k.lower(), []).append((k, v))
            if frame.f_code in self.public:
                launcher = self.public[frame.f_code]
                break
            frame = frame.f_back
        return launcher, names


def _ptr_value(v):
    """A launcher variable as the address a pointer argument would carry (None where it is no address)."""
    if isinstance(v, DevicePtr) or (isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))):
        return int(v)
    return None


def check_launch(module, name, args, context) -> list[str]:
    """Problems of one recorded launch against the parsed .cu parameter list."""
    params = KERNELS.get((module, name))
    where = f"{module}.{name}"
    if params is None:
        return [f"{where}: launched but not defined in cuda_src/{module}.cu"]
    kinds, want = [k for k, _ in args], [k for _, k in params]
    if kinds != want:
        return [f"{where}: launched with {len(kinds)} args ({', '.join(kinds)}) but the kernel takes "
                f"{len(want)} ({', '.join(f'{k} {n}' for n, k in params)})"]
    launcher, names = context
    bad = []
    for (pname, kind), (_, value) in zip(params, args):
        cands = names.get(pname.lower(), [])
        exact = [v for k, v in cands if k == pname]
        if not exact and len({k for k, _ in cands}) != 1:
            continue  # no launcher variable of that name (or an ambiguous case-insensitive one)
        vname, var = (exact and (pname, exact[0])) or cands[0]  # innermost frame first
        expect = _ptr_value(var) if kind == "ptr" else _scalar(var)
        if expect is None:
            continue
        got = value if kind != "ptr" else int(value)
        same = math.isclose(got, expect, rel_tol=1e-6) if kind == "f32" else got == expect
        if not same:
            bad.append(f"{where} (from {launcher}): parameter {pname} got {got!r}, but the launcher's {vname} "
                       f"is {expect!r} (arguments out of order?)")
    return bad


class Mem:
    """Zeroed device buffers kept alive for the duration of an exercise."""

    def __init__(self, dev):
        self.dev, self.keep = dev, []

    def __call__(self, nbytes: int, fill: int = 0) -> DevicePtr:
        b = self.dev.alloc(max(int(nbytes), 1))
        self.dev.fill(b.ptr, b.nbytes, fill)
        self.keep.append(b)
        return b.ptr

    def put(self, arr) -> DevicePtr:
        b = self.dev.upload(np.ascontiguousarray(arr))
        self.keep.append(b)
        return b.ptr


# Exercisers: every public launcher with small shapes whose scalars are distinct within a call, so that
# two same-kind arguments swapped land on a value the launcher's variable of that name does not have.
EXERCISERS = []


def exercise(fn):
    EXERCISERS.append(fn)
    return fn


@exercise
def _elementwise(dev, mem):
    ops.bf16_residual_add(dev, mem(128), mem(128), 64)
    ops.bf16_concat(dev, mem(2 * 3 * 8), mem(2 * 3 * 16), mem(2 * 3 * 24), 3, 8, 16)
    ops.sigmoid_gate_mul(dev, mem(2 * 3 * 2 * 8), mem(2 * 3 * 40), mem(2 * 3 * 2 * 8), 3, 2, 8, 40, 16)
    for limit in (0.0, 7.0):
        ops.silu_mul(dev, mem(2 * 3 * 24), mem(2 * 3 * 32), mem(2 * 3 * 8), 3, 8, 24, 32, limit)
    ids = mem.put(np.array([0, 3, 9, 1], np.int32))
    ops.embed_rows(dev, mem(2 * 5 * 8), ids, mem(2 * 3 * 8), 3, 8, ids_stride=4, vocab=5)
    ops.embed_from_argmax(dev, mem(2 * 5 * 8), ids, mem(2 * 2 * 8), 8, rows=2, ids_stride=8, vocab=5)
    ops.scale_add(dev, mem(128), mem(128), 0.25, 64)


@exercise
def _rms_norm(dev, mem):
    rows, dim = 3, 16
    for unit_offset in (False, True):
        ops.rms_norm(dev, mem(2 * rows * dim), mem(2 * dim), mem(2 * rows * dim), rows, dim, 1e-6, unit_offset)
        ops.add_rms_norm(dev, mem(2 * rows * dim), mem(2 * rows * dim), mem(2 * dim), mem(2 * rows * dim), rows,
                         dim, 1e-5, unit_offset)
        ops.rms_norm_strided(dev, mem(2 * rows * 2 * 24), mem(2 * dim), mem(2 * rows * 2 * 32), rows, 2, dim, 48,
                             24, 64, 32, 1e-6, unit_offset)
    ops.layer_norm_bias(dev, mem(2 * rows * dim), mem(2 * dim), mem(2 * dim), mem(2 * rows * dim), rows, dim, 1e-6)
    ids = mem.put(np.array([1, 9, 0], np.int32))
    for unit_offset in (False, True):   # 3 token rows of a 4-row table, 6 hidden rows, e into a concat half
        ops.front_norms(dev, mem(2 * 4 * dim), ids, 4, mem(2 * dim), mem(2 * 6 * dim), mem(2 * dim),
                        mem(2 * rows * 2 * dim), 2 * dim, mem(2 * 6 * dim), dim, rows, 6, dim, 1e-6, unit_offset)


@exercise
def _norm_rope(dev, mem):
    rows, dim = 3, 16
    slots, pos = mem.put(np.array([3, -1, 5], np.int64)), mem.put(np.array([7, 1, 4], np.uint32))
    inv = mem.put(np.ones(4, np.float32))
    for kv_dtype in ("bf16", "fp8"):   # rows of [q0 | g0 | q1 | g1 | k0 | v0], 2 q heads, 1 k head of 16
        ops.qk_norm_rope_cache(dev, mem(2 * rows * 96), 96, 2, 32, 1, 64, 80, mem(2 * dim), mem(2 * dim),
                               mem(2 * rows * 32), 32, rows, dim, 1e-6, pos, 4, inv, 8, slots, 8, mem(2 * 6 * dim),
                               mem(2 * 6 * dim), kv_dtype=kv_dtype, kv_scale=0.5)
    x = mem(2 * rows * 2 * 24)   # 2 heads of 24 a row: norm 16, RoPE 8 at 16
    ops.norm_rope(dev, x, 48, 24, rows, 2, mem(2 * dim), dim, 24, 1e-6, pos, 4, inv, 16, 8, True, 1.5, out=x,
                  out_row_stride=48, out_head_stride=24)
    for nope in (0, 16):   # bf16 rows, blocked fp8 rows
        ops.norm_rope(dev, x, 48, 24, rows, 1, 0, dim, 24, 1e-6, pos, 4, inv, 16, 8, False, slots=slots,
                      slot_stride=8, cache=mem(6 * 64), fp8_nope=nope)
    ops.norm_rope(dev, x, 48, 24, rows, 1, mem(2 * dim), dim, 24, 1e-6, pos, 4, inv, 0, 8, False, slots=slots,
                  slot_stride=8, cache=mem(6 * 64), bias=mem(2 * dim))   # LayerNorm (norm_rope_w_bias)


@exercise
def _rope(dev, mem):
    ops.rope(dev, mem(2 * 3 * 40), mem(3 * 8), 8, 3, 2, 20, 8, 4, 40, 20, mem.put(np.ones(4, np.float32)), True,
             mscale=0.5, inverse=True)


@exercise
def _kv_cache(dev, mem):
    slots = mem.put(np.array([3, -1, 5, 0, 1, 2], np.int64))
    for dtype in ("bf16", "fp8"):
        ops.reshape_and_cache(dev, mem(2 * 3 * 24), 24, slots, 16, mem(2 * 7 * 40), 3, 8, 40, 12, dtype=dtype,
                              scale=2.0)
    ops.reshape_and_cache_fp8_blocks(dev, mem(2 * 3 * 88), 88, slots, 16,
                                     mem(7 * ops.fp8_block_layout(80, 64)[2]), 3, 80, 64)


@exercise
def _gemv(dev, mem):
    n, k = 48, 64

    def run(fn, w, *lead, m=3, **kw):
        fn(dev, w, *lead, mem(2 * m * (k + 8)), mem(4 * m * (n + 4)), m, n, k, k + 8, n + 4, "f32", **kw)
    bf16, fp8, fp4 = mem(2 * n * k), mem(n * k), mem(n * k // 2)
    blk = mem(4 * math.ceil(n / 128) * math.ceil(k / 128))
    run(ops.dense_gemv_bf16, bf16, m=2)
    run(ops.dense_gemv_bf16_batchm, bf16, m=5)
    run(ops.dense_gemv_bf16_batch32, bf16, m=20)
    run(ops.dense_gemv_bf16_batch64, bf16, m=20)
    run(ops.dense_gemv_bf16_batch64, bf16, m=20, ks=4, kb=2)   # a cluster of 4 or 8 blocks
    run(ops.gemv_fp8w_batch64, fp8, mem(4 * n), m=20)
    run(ops.w8a16_gemv_batch64, fp8, blk, m=40, ks=3)
    run(ops.w8a16_gemv_e8m0_batch64, fp8, blk, m=64, kb=2)
    run(ops.w8a16_gemv_wg, fp8, blk, m=40, ks=3)
    run(ops.w8a16_gemv_e8m0_wg, fp8, blk, m=17, ks=2, kb=4)
    run(ops.dense_gemm_bf16, bf16, m=40)
    run(ops.gemv_fp8w, fp8, mem(4 * n))
    run(ops.w8a16_gemv, fp8, blk)
    run(ops.w8a16_gemv_e8m0, fp8, blk)
    run(ops.w4a16_gemv, fp4, mem(n * k // 16), 0.5)
    run(ops.w4a16_gemv_mx, fp4, mem(n * k // 32))
    run(ops.dense_gemv_bf16_regs, bf16, m=2)
    run(ops.dense_gemv_bf16_batchm_regs, bf16, m=5)
    run(ops.w8a16_gemv_regs, fp8, blk)
    run(ops.w4a16_gemv_regs, fp4, mem(n * k // 16), 0.5)
    weights = [Linear("bf16", n, k, bf16), Linear("fp8_row", n, k, fp8, mem(4 * n)),
               Linear("fp8_block", n, k, fp8, blk), Linear("fp8_block_e8m0", n, k, fp8, blk),
               Linear("nvfp4", n, k, fp4, mem(n * k // 16), 0.5), Linear("mxfp4", n, k, fp4, mem(n * k // 32))]
    for W in weights:
        for m in (1, 9):
            ops.linear(dev, mem(2 * m * k), W, mem(2 * m * n), m)


@exercise
def _grouped_gemv(dev, mem):
    k = 32
    for W in (Linear("bf16", 40, k, mem(2 * 40 * k)), Linear("fp8_block", 40, k, mem(40 * k), mem(4)),
              Linear("fp8_block_e8m0", 40, k, mem(40 * k), mem(4))):
        ops.grouped_gemv(dev, mem(2 * 3 * 2 * k), W, mem(4 * 3 * 2 * 16), 2, 16, row0=4, group_rows=18, m=3,
                         out_dtype="f32")
        tab = mem.put(ops.group_table(W, 2, 16, row0=0, group_rows=16))   # the tensor-core form
        for rows in (8, 32):   # grouped_mma8_* and grouped_mma_*
            ops.grouped_gemv(dev, mem(2 * 3 * 2 * k), W, mem(4 * 3 * 2 * 16), 2, 16, row0=0, group_rows=16, m=3,
                             out_dtype="f32", table=tab, rows=rows)


@exercise
def _hyper_connection(dev, mem):
    rows, dim, hc = 3, 16, 2
    X, work = mem(2 * rows * hc * dim), mem(ops.hc_work_bytes(rows, dim, hc))
    mix = (2 + hc) * hc
    ops.hc_pre(dev, X, mem(4 * mix * hc * dim), mem(12), mem(4 * mix), mem(2 * rows * dim), mem(4 * rows * hc),
               mem(4 * rows * hc * hc), work, rows, dim, hc, 1e-6, 1e-5, iters=4)
    for iters in (0, 4):   # a finished comb, or Sinkhorn logits
        ops.hc_post(dev, mem(2 * rows * dim), X, mem(4 * rows * hc), mem(4 * rows * hc * hc), mem(2 * rows * hc * dim),
                    rows, dim, hc, hc_eps=1e-5, iters=iters)
    ops.hc_head(dev, X, mem(4 * hc * hc * dim), mem(4), mem(4 * hc), mem(2 * rows * dim), work, rows, dim, hc,
                1e-6, 1e-5)
    fn, X2 = mem(4 * mix * hc * dim), mem(2 * rows * hc * dim)
    for src, src_hc in ((X, hc), (mem(2 * rows * dim), 1)):
        ops.hc_add_mix(dev, src, src_hc, mem(2 * rows * dim), X, fn, work, rows, dim, hc, mix)
    ops.hc_mix(dev, X2, fn, work, rows, dim, hc, mix)
    ops.hc_pre_norm(dev, X2, work, mem(12), mem(4 * mix), mem(2 * dim), mem(2 * rows * dim), mem(4 * rows * hc),
                    mem(4 * rows * hc * hc), rows, dim, hc, 1e-6, 1e-5, 1e-6)
    ops.hc_head_norm(dev, X2, work, mem(4), mem(4 * hc), mem(2 * dim), mem(2 * rows * dim), rows, dim, hc, 1e-6, 1e-5,
                     1e-6)
    ops.hc_expand(dev, mem(2 * rows * dim), mem(2 * rows * hc * dim), rows, dim, hc)
    ops.hc_add(dev, X, mem(2 * rows * dim), rows, dim, hc)


def _slabs(mem, seq_lens, stride):
    raw = b"".join(pack_mtp_attn_meta(n - 1, n - 1, n, [0], stride).ljust(stride, b"\0") for n in seq_lens)
    return mem.put(np.frombuffer(raw, np.uint8))


@exercise
def _paged_attention(dev, mem):
    meta = _slabs(mem, [3, 9], 768)
    for walk in (False, True):   # split mode (partial + combine) and walk mode
        ops.mla_decode(dev, mem(2 * 2 * 3 * 128), mem(2 * 16 * 128), meta, 768, mem(2 * 2 * 3 * 64), 2, 3, 128, 64,
                       0.125, window=5, sink=mem(4 * 3), sel=mem.put(np.array([[0, 1, -1, 2]] * 2, np.int32)),
                       sel_stride=4, walk=walk)
        ops.mla_decode(dev, mem(2 * 2 * 3 * 80), mem(16 * ops.fp8_block_layout(80, 64)[2]), meta, 768,
                       mem(2 * 2 * 3 * 80), 2, 3, 80, 80, 0.125, window=5, sink=mem(4 * 3), kv_dtype="fp8", nope=64,
                       walk=walk)
        for kv_dtype in ("bf16", "fp8"):
            ops.gqa_decode(dev, mem(2 * 2 * 4 * 64 + 64), 4 * 64 + 32, mem(2 * 16 * 2 * 64), mem(2 * 16 * 2 * 64),
                           meta, 768, mem(2 * 2 * 4 * 64), 2, 4, 2, 64, 0.125, kv_dtype=kv_dtype, kv_scale=0.5,
                           walk=walk, out_gate=(mem(2 * 2 * 4 * 128), 4 * 128, 128))   # Qwen's output gate


@exercise
def _argmax(dev, mem):
    n, rows = 64, 3
    for dtype in ("f32", "bf16"):
        logits = mem(4 * rows * (n + 8))
        ops.argmax(dev, logits, n, mem(4), dtype=dtype, out_val=mem(4))
        ops.argmax(dev, logits, n, mem(4 * rows), rows=rows, row_stride=n + 8, dtype=dtype, out_val=mem(4 * rows))
        ops.argmax(dev, logits, n, mem(4 * rows), rows=rows, row_stride=n + 8, dtype=dtype, out_lp=mem(4 * rows))
        ops.argmax_bitmask(dev, logits, n, mem.put(np.full(rows * 5, -1, np.int32)), mem(4 * rows), mem(4 * rows),
                           dtype=dtype, rows=rows, row_stride=n + 8, mask_row_words=5, out_val=mem(4 * rows))


@exercise
def _moe(dev, mem):
    n, k, n_experts = 24, 64, 3
    scale_bytes = {"bf16": 0, "f32": 0, "fp8_row": 4 * n, "fp8_block": 4, "fp8_block_e8m0": 4,
                   "nvfp4": n * k // 16, "mxfp4": n * k // 32}
    elem = {"bf16": 2, "f32": 4, "fp8_row": 1, "fp8_block": 1, "fp8_block_e8m0": 1, "nvfp4": 0.5, "mxfp4": 0.5}
    ids = mem.put(np.array([0, 2, 1, 2], np.int32))
    for fmt in ops.EXPERT_FORMATS:
        def proj():
            return SimpleNamespace(fmt=fmt, weight=mem(int(n * k * elem[fmt])),
                                   scale=mem(scale_bytes[fmt]) if scale_bytes[fmt] else NULL, scale2=0.5)
        tab = mem.put(ops.expert_table([proj(), None, proj()]))
        x = mem(2 * 2 * 2 * (k + 8))
        for n_pairs in (2, 4):          # one row (the plain kernels), two rows (the grouped ones)
            ops.moe_gemv(dev, tab, fmt, ids, n_pairs, 2, n_experts, x, 2 * (k + 8), k + 8, mem(4 * 4 * n), n, k)
            if fmt != "f32":
                ops.moe_gate_up(dev, tab, mem.put(ops.expert_table([proj(), proj(), None])), fmt, ids, n_pairs, 2,
                                n_experts, x, 2 * (k + 8), k + 8, mem(2 * 4 * n), n, k, limit=7.0)
    # the grouped GEMMs: a routing plan over a NULL entry and an out-of-range id, then every format with the
    # plan and without (one weight for every pair)
    ids = mem.put(np.array([0, 2, 1, 2, 7, 0], np.int32))
    n_pairs, n_slots = 6, 2
    for fmt in ops.MMA_FORMATS:
        def proj():
            return SimpleNamespace(fmt=fmt, weight=mem(int(n * k * elem[fmt])),
                                   scale=mem(scale_bytes[fmt]) if scale_bytes[fmt] else NULL, scale2=0.5)
        tab, tab_up = (mem.put(ops.expert_table([proj(), None, proj()])) for _ in range(2))
        for rows in (ops.PLAN_ROWS, ops.MMA8_ROWS):
            plan = mem(ops.moe_plan_bytes(n_pairs, n_experts, rows))
            ops.moe_route_plan(dev, tab, ids, n_pairs, n_experts, plan, rows=rows)
            x = mem(2 * n_pairs * n_slots * (k + 8))
            for p, slots in ((plan, n_slots), (NULL, 1)):
                ops.moe_gemv_mma(dev, tab, fmt, p, n_pairs, slots, n_experts, x, n_slots * (k + 8), k + 8,
                                 mem(4 * n_pairs * n), n, k, rows=rows)
                ops.moe_gate_up_mma(dev, tab, tab_up, fmt, p, n_pairs, slots, n_experts, x, n_slots * (k + 8),
                                    k + 8, mem(2 * n_pairs * n), n, k, limit=7.0, rows=rows)
    m, E, top_k = 3, 8, 2
    logits, bias = mem(4 * m * E), mem(4 * E)
    ops.moe_topk_softmax(dev, logits, mem(4 * m * top_k), mem(4 * m * top_k), m, E, top_k, scale=2.5)
    ops.moe_topk_sigmoid_grouped(dev, logits, bias, mem(4 * m * top_k), mem(4 * m * top_k), m, E, top_k, n_group=4,
                                 topk_group=3, scale=2.5)
    ops.moe_topk_sqrtsoftplus(dev, logits, bias, mem(4 * m * top_k), mem(4 * m * top_k), m, E, top_k, scale=2.5)
    ops.moe_topk_hash(dev, logits, mem.put(np.array([1, 0, 4, 0, 5, 0], np.int32)), 8,
                      mem.put(np.zeros((7, top_k), np.int32)), 7, mem(4 * m * top_k), mem(4 * m * top_k), m, E,
                      top_k, scale=2.5)
    ops.moe_weighted_sum(dev, mem(4 * m * top_k * 16), mem(4 * m * top_k), top_k, mem(2 * m * 16), m, 16,
                         shared=mem(4 * m * 16), shared_gate=mem(4 * m))


@exercise
def _quantize(dev, mem):
    W = Linear("bf16", 5, 64, mem(2 * 5 * 64))
    for fmt in ("fp8_row", "nvfp4"):
        ops.quantize_linear(dev, W, fmt)


@exercise
def _dsa(dev, mem):
    meta = _slabs(mem, [3, 9], 512)
    scores = mem(4 * 2 * 12)
    ops.dsa_index_scores(dev, mem(2 * 2 * 4 * 32), mem(4 * 2 * 4), mem(2 * 16 * 32), meta, 512, scores, 2, 4, 32, 12,
                         0.25)
    ops.dsa_topk(dev, scores, 12, meta, 512, mem(4 * 2 * 6), 6, 2, 5)


@exercise
def _vocab_argmax(dev, mem):
    local_id, val = mem.put(np.array([3], np.int32)), mem.put(np.array([1.5], np.float32))
    lanes = mem(2 * 4 * 3)
    ops.pack_argmax_lanes(dev, local_id, val, 1000, 1, 3, lanes)
    ops.decode_argmax_lanes(dev, lanes, 3, mem(4))
    ops.pack_argmax_pair(dev, local_id, val, 1000, mem(8))
    ops.decode_argmax_pairs(dev, mem(8 * 3), 3, mem(4))
    ops.widen_bf16_f32(dev, mem(2 * 40), mem(4 * 40), 40)


@exercise
def _call_io(dev, mem):
    stage, ctl = mem(96), mem(ops.CTL_BYTES)
    ops.call_stage_in(dev, stage, mem(96), 96, ctl, mem(64), mem(4), hidden_bytes=64)
    ops.call_publish(dev, mem(4 * 6), mem(4 * 6), mem(4 * 6), 6, mem(16 + 3 * 4 * 6), mem(4))


def recorded_launches(monkeypatch):
    rec = Recorder(monkeypatch)
    dev = RefBackend()
    for fn in EXERCISERS:
        fn(dev, Mem(dev))
    return rec.launches, sorted(set(rec.problems))


def test_launches_pass_the_kernels_arguments(monkeypatch):
    launches, problems = recorded_launches(monkeypatch)
    assert not problems, "\n".join(problems)
    reached = {(mod, name) for mod, name, _, _ in launches}
    missing = sorted(f"{m}.{n}" for m, n in set(KERNELS) - reached)
    assert not missing, f"kernels no launcher reached (add them to an exerciser): {', '.join(missing)}"
    # the name check must actually bite: most launches have several parameters it compares by value
    checked = [sum(1 for p, _ in KERNELS[(m, n)] if p.lower() in ctx[1]) for m, n, _, ctx in launches]
    assert sum(c >= 3 for c in checked) >= 0.9 * len(checked)


def test_the_launch_check_catches_swapped_and_missing_arguments(monkeypatch):
    """The checker itself: the dsa_index_scores launch with two u32 arguments swapped, a ptr and a u32
    swapped, and one argument dropped."""
    launches, _ = recorded_launches(monkeypatch)
    mod, name, args, ctx = next(x for x in launches if x[1] == "dsa_index_scores")
    assert check_launch(mod, name, args, ctx) == []
    names = [p for p, _ in KERNELS[(mod, name)]]
    i, j = names.index("heads"), names.index("head_dim")
    swapped = list(args)
    swapped[i], swapped[j] = swapped[j], swapped[i]
    assert any("heads" in p for p in check_launch(mod, name, swapped, ctx))
    i, j = names.index("meta"), names.index("meta_stride")
    swapped = list(args)
    swapped[i], swapped[j] = swapped[j], swapped[i]
    assert check_launch(mod, name, swapped, ctx)
    assert check_launch(mod, name, args[:-1], ctx)


# -- docs/kernels.md ------------------------------------------------------------------------------------------

DOC_OPTIONAL = {"stream", "workspace", "tune", "threads", "invariant", "walk", "group"}


def doc_signatures() -> list[tuple[str, list[str]]]:
    """(name, parameter names) of every backticked `name(...)` (`module.*(...)`, `name(...) -> T`) in
    docs/kernels.md."""
    out = []
    for span in re.findall(r"`([^`]+)`", DOCS.read_text()):
        m = re.fullmatch(r"(\w+(?:\.\*)?)\((.*)\)(?:\s*->\s*[\w.\[\], |]+)?", " ".join(span.split()))
        if not m:
            continue
        names = []
        for p in split_top(m.group(2)):
            p = p.lstrip("*").strip()
            if p:
                names.append(p if p == "..." else re.split(r"[:=]", p, maxsplit=1)[0].strip())
        out.append((m.group(1), names))
    return out


def test_docs_argument_lists_match():
    kernels = {}
    for (mod, name), params in KERNELS.items():
        kernels.setdefault(name, []).append((name, [n for n, _ in params]))
        kernels.setdefault(f"{mod}.*", []).append((name, [n for n, _ in params]))
    bad, seen = [], 0
    for name, names in doc_signatures():
        if names[:1] != ["gpu"] and name in kernels:  # a launcher's list starts with gpu, a kernel's does not
            seen += 1
            tail = names[:1] == ["..."]
            for kname, want in kernels[name]:
                ok = len(want) >= len(names) - 1 and want[len(want) - len(names) + 1:] == names[1:] if tail \
                    else want == names
                if not ok:
                    bad.append(f"docs `{name}({', '.join(names)})` but {kname} takes ({', '.join(want)})")
        elif name in ops.__dict__ and inspect.isfunction(ops.__dict__[name]):
            seen += 1
            want = [p for p in inspect.signature(ops.__dict__[name]).parameters]
            if [p for p in want if p in names or p not in DOC_OPTIONAL] != names:
                bad.append(f"docs `{name}({', '.join(names)})` but the launcher takes ({', '.join(want)})")
    assert not bad, "\n".join(bad)
    assert seen >= 30
