"""Programmatic dependent launch (runtime/pdl.py, pdl_entry in common.cuh).

Statically, on the sources: a kernel launched with the PDL attribute may start before the kernel ahead of it has
finished, so every kernel in cuda_src must wait (griddepcontrol.wait) before it reads what that kernel wrote.
The rule checked: a kernel's first statement is `pdl_entry();` (wait, then trigger) or `pdl_wait();` (wait, and
trigger later: moe_stage_f16 lets the GEMM after it start only near its own end), or `pdl_trigger();` when its
body calls one of LATE_WAIT, device functions that read only weights before their own `pdl_wait()`, or a call of
one of SELF_WAIT, which wait and trigger themselves (moe_mma.cu's expert_mma: a call with a routing plan waits
first; a plan-less one issues its weight ring, then waits. hyper_connection.cu's post_rows: with Sinkhorn logits
it reads them before its wait, which a step's launch order makes safe: test_hc_post_reads_a_finished_collapse).

On a GPU: kernels chained on one stream give the same bits with PDL on and off, eagerly and in a graph, and a
launch that the driver refuses raises KernelError."""
from __future__ import annotations

import re

import numpy as np
import pytest

from mtp_cupy.runtime.backend import CUDA_SRC, cuda_modules
from mtp_cupy.runtime.cuda_text import close_paren, expand_kernel_macros, strip_comments
from test_kernel_signatures import _KERNEL

LATE_WAIT = {"mma_stream", "x64_body", "wg_body"}   # gemv.cu, gemv_wg.cu: the weight ring's first stages are issued, then pdl_wait()
SELF_WAIT = {"expert_mma",               # moe_mma.cu: `if (plan) pdl_wait();` ... ring ... `if (!plan) pdl_wait();`
             "post_rows"}                # hyper_connection.cu: `if (iters) {pdl_trigger(); Sinkhorn; pdl_wait();}`


def _body(code: str, paren: int, name: str) -> str:
    """The text between the braces that follow the parameter list opening at code[paren] ('(')."""
    b = code.index("{", close_paren(code, paren))
    depth = 0
    for j in range(b, len(code)):
        depth += {"{": 1, "}": -1}.get(code[j], 0)
        if depth == 0:
            return code[b + 1:j]
    raise AssertionError(f"unbalanced braces in {name}")


def pdl_violations(src: str, late_wait: set[str], self_wait: set[str] = frozenset()) -> list[str]:
    """Kernels of `src` that do not start with pdl_entry() (or pdl_trigger() and a late-wait call, or a call of a
    self-waiting function)."""
    code = expand_kernel_macros(strip_comments(src))
    bad = []
    for m in _KERNEL.finditer(code):
        body = _body(code, m.end() - 1, m.group(1))
        first = body.strip().split(";", 1)[0].strip()
        if first in ("pdl_entry()", "pdl_wait()") or re.match(r"(%s)\s*[<(]" % "|".join(self_wait or ["$^"]), first):
            continue
        if first == "pdl_trigger()" and any(re.search(r"\b%s\s*<" % f, body) or re.search(r"\b%s\s*\(" % f, body)
                                            for f in late_wait):
            continue
        bad.append(f"{m.group(1)}: first statement {first[:60]!r}")
    return bad


def _device_fn_body(code: str, name: str) -> str:
    m = re.search(r"__device__[^;{]*?\b%s\s*\(" % name, code)
    assert m, f"device function {name} not found"
    return _body(code, m.end() - 1, name)


def test_the_rule_catches_a_kernel_without_the_wait():
    src = '''
    extern "C" __global__ void ok(const float* x) { pdl_entry(); float v = x[0]; }
    extern "C" __global__ void waits(const float* x) { pdl_wait(); float v = x[0]; pdl_trigger(); }
    extern "C" __global__ void late(const float* x) { pdl_trigger(); mma_stream<1>(x); }
    extern "C" __global__ void reads_first(const float* x) { float v = x[0]; pdl_entry(); }
    extern "C" __global__ void trigger_only(const float* x) { pdl_trigger(); float v = x[0]; }
    extern "C" __global__ void self_waits(const float* x) { expert_mma<1, false>(x); }
    extern "C" __global__ void other_call(const float* x) { helper<1>(x); pdl_entry(); }
    '''
    bad = pdl_violations(src, LATE_WAIT, SELF_WAIT)
    assert [b.split(":")[0] for b in bad] == ["reads_first", "trigger_only", "other_call"]


@pytest.mark.parametrize("module", cuda_modules())
def test_every_kernel_waits_before_it_reads(module):
    assert not pdl_violations((CUDA_SRC / f"{module}.cu").read_text(), LATE_WAIT, SELF_WAIT)


def test_late_waiters_wait():
    code = "".join(strip_comments((CUDA_SRC / f).read_text()) for f in ("gemv.cu", "gemv_wg.cu"))
    for name in LATE_WAIT:
        body = _device_fn_body(code, name)
        assert body.count("pdl_wait();") == 1, f"{name} must call pdl_wait() once"
        # before it, the weight ring's prefill only: neither the input x nor the output y is named
        before = body[:body.index("pdl_wait();")]
        assert not re.search(r"(?<![.\w])[xy]\b", before), f"{name} touches x or y before pdl_wait()"


def test_expert_mma_waits_before_it_reads():
    """A routing plan (the router's output) is read only after `if (plan) pdl_wait();`; x and its scales only after
    `if (!plan) pdl_wait();`, which follows the weight ring's first stages; each wait and the trigger once."""
    body = _device_fn_body(strip_comments((CUDA_SRC / "moe_mma.cu").read_text()), "expert_mma")
    first, second = "if (plan) pdl_wait();", "if (!plan) pdl_wait();"
    assert body.count("pdl_wait();") == 2 and body.count(first) == body.count(second) == 1
    assert body.count("pdl_trigger();") == 1 and body.index(first) < body.index("pdl_trigger();")
    assert not re.search(r"\bplan\s*(\[|\+)", body[:body.index(first)]), "the plan is read before the wait"
    before = re.sub(r'"[^"]*"', '""', body[:body.index(second)])   # string literals (static_assert texts) out
    assert body.index("for (u32 p = 1; p < NS; ++p) issue();") < body.index(second)
    assert not re.search(r"(?<![.\w])(x|xsc)\b", before), "x or its scales read before the plan-less wait"


def wait_first_kernels() -> set[str]:
    """Every kernel whose first statement waits for the kernel ahead (pdl_entry() or pdl_wait()): when it lets
    the next launch start, everything launched before it has finished."""
    names = set()
    for module in cuda_modules():
        code = expand_kernel_macros(strip_comments((CUDA_SRC / f"{module}.cu").read_text()))
        for m in _KERNEL.finditer(code):
            first = _body(code, m.end() - 1, m.group(1)).strip().split(";", 1)[0].strip()
            if first in ("pdl_entry()", "pdl_wait()"):
                names.add(m.group(1))
    return names


def test_wait_first_kernels_are_told_apart():
    waits = wait_first_kernels()
    assert {"rms_norm_strided_w", "norm_rope_w", "moe_topk_sqrtsoftplus", "hc_pre_norm", "moe_stage_f16"} <= waits
    assert not waits & {"dense_gemv_bf16_batchm", "w8a16_gemv_e8m0", "moe_gemv_mma8_mxfp4", "hc_post"}


def test_post_rows_reads_logits_only_on_their_path():
    """hc_post's body: with Sinkhorn logits (iters > 0) it triggers, reads post and the logits, then waits; with a
    finished comb it waits first. f and X (the layer's output and the streams) only after either wait."""
    body = _device_fn_body(strip_comments((CUDA_SRC / "hyper_connection.cu").read_text()), "post_rows")
    early, late = body.index("if (iters) {"), body.index("} else {")
    first = body[early:late]
    assert first.index("pdl_trigger();") < first.index("pdl_wait();")
    assert body[late + len("} else {"):].strip().startswith("pdl_entry();")
    rest = body[body.index("__syncthreads();"):]
    assert not re.search(r"(?<![.\w])(f|X)\b", body[:body.index("__syncthreads();")]), "f or X read before the wait"
    assert re.search(r"\bX\[", rest) and re.search(r"\bf\[", rest)


@pytest.mark.parametrize("B", [1, 3])
def test_hc_post_reads_a_finished_collapse(B):
    """hc_post reads its site's post and Sinkhorn logits before its PDL wait (the Sinkhorn then overlaps the kernel
    ahead). That is safe because, in a V4 step, a kernel that waits before it triggers runs between each hc_pre_norm
    and the hc_post that reads its coefficients: by the time hc_post may launch, hc_pre_norm has finished. Checked
    on the embedded V4 model's launches (k = 2)."""
    import mtp_cupy
    from helpers import BranchLog, launches
    gpu = BranchLog()
    prop = mtp_cupy.load_proposer(mtp_cupy.EMBEDDED["deepseek_v4"], gpu=gpu)
    rng = np.random.default_rng(0)
    shape, T = prop._hidden_shapes()[0], 12
    sts = [prop.alloc_state() for _ in range(B)]
    for st in sts:
        prop.prefill(st, rng.integers(0, 200, T).astype(np.int32), rng.standard_normal((T - 1,) + shape).astype(np.float32))
    gpu.log.clear()
    prop.propose_batch(sts, [int(t) for t in rng.integers(0, 200, B)], rng.standard_normal((B,) + shape).astype(
        np.float32), [T - 1] * B, 2)
    main = launches(gpu.log, side=False)
    waits = wait_first_kernels()
    posts = [i for i, n in enumerate(main) if n == "hc_post"]
    assert len(posts) == 2 * 2, main            # two sites' folds a step (the attention's, the FFN's), two steps
    for i in posts:
        j = max(q for q in range(i) if main[q] == "hc_pre_norm")
        between = main[j + 1:i]
        assert any(n in waits for n in between), f"no waiting kernel between hc_pre_norm and hc_post: {between}"


# -- on the GPU ------------------------------------------------------------------------------------------------

def _chain(dev, x0, w_n, w1, w2):
    """(run, buffers): norm -> GEMV (late wait) -> norm -> GEMV on `dev`, each kernel reading the one before;
    buffers[1:5] are the intermediates and the output."""
    from mtp_cupy import ops
    from mtp_cupy.weights.linear import Linear
    from helpers import up
    N, D = w1.shape
    bufs = [up(dev, x0), dev.alloc(2 * D), dev.alloc(2 * N), dev.alloc(2 * N), dev.alloc(2 * D)]
    wn, b1, b2 = up(dev, w_n), up(dev, w1), up(dev, w2)
    l1, l2 = Linear("bf16", N, D, b1.ptr, owners=[b1]), Linear("bf16", D, N, b2.ptr, owners=[b2])

    def run():
        ops.rms_norm(dev, bufs[0].ptr, wn.ptr, bufs[1].ptr, 1, D, 1e-6)
        ops.linear(dev, bufs[1].ptr, l1, bufs[2].ptr, invariant=True)
        ops.rms_norm(dev, bufs[2].ptr, None, bufs[3].ptr, 1, N, 1e-6)
        ops.linear(dev, bufs[3].ptr, l2, bufs[4].ptr, invariant=True)
    return run, bufs + [wn, l1, l2]


def _inputs(D=2048, N=6144):
    from helpers import rand_bf16
    seed = int(np.random.SeedSequence().entropy % (1 << 31))
    print(f"seed {seed}")
    rng = np.random.default_rng(seed)
    return (rand_bf16(rng, (1, D)), rand_bf16(rng, (D,)), rand_bf16(rng, (N, D), D ** -0.5),
            rand_bf16(rng, (D, N), N ** -0.5))


def _poison(dev, bufs):
    for b in bufs[1:5]:
        dev.fill(b.ptr, b.nbytes)      # 0xFF bytes: NaN in bf16, so a read that overtakes its writer shows


def test_the_chain_runs_on_the_numpy_device():
    from mtp_cupy.refdev import RefBackend
    from helpers import get
    dev = RefBackend()
    run, bufs = _chain(dev, *_inputs(256, 512))
    _poison(dev, bufs)
    run()
    assert np.all(np.isfinite(get(dev, bufs[4], "bf16", (1, 256)).astype(np.float32)))


@pytest.mark.gpu
def test_pdl_on_and_off_give_the_same_bits():
    """The chain eager and captured, with PDL on and off, intermediates poisoned before every run: all runs
    bit-identical, finite, and within bf16 rounding of the NumPy device's run."""
    cp = pytest.importorskip("cupy")
    if not cp.cuda.is_available():
        pytest.skip("no CUDA device")
    from mtp_cupy.refdev import RefBackend
    from mtp_cupy.runtime.cupy_backend import CupyBackend
    from helpers import assert_close, get

    inputs = _inputs()
    D = inputs[0].shape[1]
    outs = []
    for pdl in (False, True):
        dev = CupyBackend(pdl=pdl)
        run, bufs = _chain(dev, *inputs)
        stream = dev.new_stream()
        graph = dev.capture(run, stream)
        for graphed in (False, True) * 5:
            _poison(dev, bufs)
            if graphed:
                dev.replay(graph, stream)
                dev.synchronize(stream)
            else:
                run()
            outs.append(get(dev, bufs[4], "bf16", (1, D)))
    ref = RefBackend()
    run, bufs = _chain(ref, *inputs)
    run()
    want = get(ref, bufs[4], "bf16", (1, D))
    for o in outs:
        assert np.array_equal(o.view(np.uint16), outs[0].view(np.uint16))
    assert np.all(np.isfinite(outs[0].astype(np.float32)))
    assert_close(outs[0], want, 1e-2, "CUDA chain against the NumPy device")


@pytest.mark.gpu
def test_a_refused_launch_raises_kernel_error():
    cp = pytest.importorskip("cupy")
    if not cp.cuda.is_available():
        pytest.skip("no CUDA device")
    from mtp_cupy import KernelError
    from mtp_cupy.runtime.cupy_backend import CupyBackend
    dev = CupyBackend(pdl=True)
    h = dev.kernel("rms_norm", "rms_norm_w")
    with pytest.raises(KernelError, match="rms_norm_w"):
        dev.launch(h, (1, 1, 1), (4096, 1, 1), 0, [("ptr", 0), ("ptr", 0), ("ptr", 0), ("u32", 0), ("u32", 0),
                                                   ("f32", 1.0)], None)


def _argmax_then_norm(dev):
    """ops.argmax then ops.rms_norm on small buffers (the launches' routes are what the tests look at)."""
    from mtp_cupy import ops
    from helpers import out, rand_bf16, up
    logits = up(dev, np.random.default_rng(0).standard_normal(1000).astype(np.float32))
    ids, x = out(dev, "i32", 1), up(dev, rand_bf16(np.random.default_rng(1), (1, 64)))
    ops.argmax(dev, logits.ptr, 1000, ids.ptr)
    ops.rms_norm(dev, x.ptr, 0, x.ptr, 1, 64, 1e-6)
    dev.synchronize()
    return [logits, ids, x]


def test_argmax_launches_after_the_whole_kernel_ahead(monkeypatch):
    """The argmax behind an LM head asks for no early (PDL) scheduling; other launches keep it."""
    from mtp_cupy.refdev import RefBackend
    seen, orig = [], RefBackend.launch

    def launch(self, handle, grid, block, shared, args, stream, cluster=(1, 1, 1), early=True):
        seen.append((handle.name, early))
        return orig(self, handle, grid, block, shared, args, stream, cluster, early)
    monkeypatch.setattr(RefBackend, "launch", launch)
    _argmax_then_norm(RefBackend())
    assert seen == [("argmax_f32", False), ("rms_norm_w", True)]


@pytest.mark.gpu
def test_after_whole_takes_the_launcher_without_pdl(monkeypatch):
    cp = pytest.importorskip("cupy")
    if not cp.cuda.is_available():
        pytest.skip("no CUDA device")
    from mtp_cupy.runtime.cupy_backend import CupyBackend
    from mtp_cupy.runtime.pdl import PdlLauncher
    seen, orig = [], PdlLauncher.launch

    def launch(self, *a, **kw):
        seen.append(self._pdl)
        return orig(self, *a, **kw)
    monkeypatch.setattr(PdlLauncher, "launch", launch)
    _argmax_then_norm(CupyBackend(pdl=True))
    assert seen == [0, 1]
