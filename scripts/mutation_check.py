#!/usr/bin/env python3
"""Does the test suite catch small deliberate bugs? Each mutation below is applied, alone, to a scratch copy of
the checkout (the files git tracks plus the untracked ones it does not ignore), the tests it names run there
on the CPU, and the mutation counts as caught when they fail. A table of caught / missed follows; the exit
status is non-zero if any mutation was missed, did not apply (its snippet is gone: update the list), or the
unmutated tests failed (then nothing would mean anything). Not part of CI: about 10 minutes on 2 cores.

    python scripts/mutation_check.py                   # every mutation, after a baseline run
    python scripts/mutation_check.py -k qwen -j 2      # the mutations whose name contains "qwen", 2 at a time
    python scripts/mutation_check.py --list

Tests draw fresh random seeds (printed by the tests); `--seed N` fixes MTP_TEST_SEED for a replay."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from mtp_cupy.bench.cli import Parser

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutation:
    name: str
    why: str                                  # what the bug is
    edits: tuple[tuple[str, str, str], ...]   # (file, original snippet, mutated snippet), each must match once
    tests: tuple[str, ...]                    # pytest arguments (relative to the checkout)
    mpi: bool = False                         # run the tests under `mpiexec -n 2`


def M(name, why, file, old, new, *tests, mpi=False, more=()):
    return Mutation(name, why, ((file, old, new),) + tuple(more), tuple(tests), mpi)


MUTATIONS = [
    # -- the six blind spots the issue named ----------------------------------------------------------------
    M("qwen-expert-off-by-one", "Qwen3-Next expert e loaded from the keys of expert e + 1",
      "mtp_cupy/weights/qwen3_next.py",
      "w.experts = {e: swiglu(expert(e), inter) for e in range(E)}",
      "w.experts = {e: swiglu(expert((e + 1) % E), inter) for e in range(E)}",
      "tests/test_qwen_mtp.py", "tests/test_outside_checkpoints.py"),
    M("trim-keeps-rejected-row", "after_verify keeps one rejected row (off-by-one trim)",
      "mtp_cupy/speculative/proposer.py",
      "rejected = max(num_drafted - num_accepted, 0)", "rejected = max(num_drafted - num_accepted - 1, 0)",
      "tests/test_deepseek_v3.py", "tests/test_glm_mtp.py", "tests/test_deepseek_v4.py"),
    M("bonus-from-previous-position", "rejection sampling draws the bonus token from p[k - 1], not p[k]",
      "mtp_cupy/speculative/sampling.py",
      "return k, int(rng.choice(p.shape[1], p=p[k]))", "return k, int(rng.choice(p.shape[1], p=p[k - 1]))",
      "tests/test_sampling.py"),
    M("bonus-with-wrong-hidden", "generate pairs the bonus token with the hidden of the row after it",
      "mtp_cupy/speculative/generate.py",
      "hid.extend(Hv[:a + 1])", "hid.extend(list(Hv[:a]) + [Hv[min(a + 1, len(Hv) - 1)]])",
      "tests/test_generate.py", "tests/test_sampling.py"),
    M("glm-head-fp8-row-scales", "the FP8 head copy's per-row scales shifted by one row (head_fp8 values)",
      "mtp_cupy/refdev/twins/quantize.py",
      "dev.view(scale, np.float32, n)[:] = s", "dev.view(scale, np.float32, n)[:] = np.roll(s, 1)",
      "tests/test_glm_mtp.py::test_head_fp8_drafts_match_reference"),
    M("v4-sink-skipped", "DeepSeek-V4 attention without its per-head sinks",
      "mtp_cupy/layers/v4_attention.py", "window=self.window, sink=w.sink,", "window=self.window, sink=NULL,",
      "tests/test_deepseek_v4.py", "tests/test_deepseek_v4_cycles.py"),
    # -- what the suite caught before --------------------------------------------------------------------------
    M("concat-flipped", "the MTP front writes [hnorm(hidden) | enorm(embed)] instead of embedding first",
      "mtp_cupy/layers/mtp_front.py",
      "n.strided(self.d.enorm, self.emb, self.cat, m, D, 2 * D)\n"
      "        n.strided(self.d.hnorm, hidden, self.cat.offset(2 * D), m, D, 2 * D)",
      "n.strided(self.d.enorm, self.emb, self.cat.offset(2 * D), m, D, 2 * D)\n"
      "        n.strided(self.d.hnorm, hidden, self.cat, m, D, 2 * D)",
      "tests/test_deepseek_v3.py", "tests/test_qwen_mtp.py"),
    M("routed-scaling-dropped", "MoE weights without routed_scaling_factor (V3, GLM-5, V4)",
      "mtp_cupy/layers/moe.py", "common = dict(routed_scaling=cfg.routed_scaling_factor,",
      "common = dict(routed_scaling=1.0,", "tests/test_deepseek_v3.py", "tests/test_deepseek_v4.py"),
    M("glm-carries-pre-norm", "GLM-5 carries the hidden before shared_head.norm (V3's rule) to the next draft",
      "mtp_cupy/models/glm5.py", "return self.bufs.carry   # GLM-5", "return self.bufs.x   # GLM-5",
      "tests/test_glm_mtp.py"),
    M("chained-rope-position", "chained draft i staged at position + 2i instead of position + i",
      "mtp_cupy/runtime/arena.py", "s64[i, _POS64], s64[i, _SEQ_LEN64] = position + i, row + 1",
      "s64[i, _POS64], s64[i, _SEQ_LEN64] = position + 2 * i, row + 1", "tests/test_deepseek_v3.py",
      "tests/test_qwen_mtp.py"),
    M("batch-rope-position", "a batch's chained draft i staged at position + 2i (the B > 1 slab stager)",
      "mtp_cupy/runtime/arena.py", "self.pos[...] = rp[1]", "self.pos[...] = rp[1] + self.steps[1]",
      "tests/test_batch.py"),
    M("mirror-misses-new-block", "a block a draft crosses into is not written to the cache's table mirror",
      "mtp_cupy/cache/paged.py", "c._tables[self.row, n] = new[0]", "c._tables[self.row, n] = 0",
      "tests/test_batch.py", "tests/test_paged_cache.py"),
    M("after-verify-batch-skips-last", "after_verify_batch trims every sequence but the last",
      "mtp_cupy/speculative/base.py", "            for st, n in zip(states, acc):\n                self._trim(st, n)",
      "            for st, n in zip(states[:-1], acc):\n                self._trim(st, n)", "tests/test_batch.py"),
    M("wide-verify-skips-last", "a wide after_verify_batch trims every sequence but the last",
      "mtp_cupy/speculative/base.py", "        cols.put(self._memo.at(ROWS), rows)\n",
      "        cols.put(self._memo.at(ROWS)[:-1], rows[:-1])\n", "tests/test_batch.py"),
    M("inbox-hidden-shifted", "a host hidden lands one bf16 late in the pinned inbox the chain copies from",
      "mtp_cupy/speculative/base.py",
      "self._inbox[:src.size] = src", "self._inbox[2:2 + src.size] = src",
      "tests/test_deepseek_v3.py", "tests/test_batch.py"),
    M("v3-default-carry-pre-norm", "DeepSeek-V3 carries the pre-norm hidden unless told otherwise",
      "mtp_cupy/models/deepseek_v3.py", 'carried_hidden: str = opt("post_norm",',
      'carried_hidden: str = opt("pre_norm",', "tests/test_deepseek_v3.py", "tests/test_carried_hidden.py"),
    # -- more ---------------------------------------------------------------------------------------------------
    M("fp4-nibbles-swapped", "E2M1 packing high nibble first in our writer AND loader (self-consistent)",
      "mtp_cupy/weights/quant_host.py",
      "return ((c[..., 1::2] & 0x0F) << 4 | (c[..., 0::2] & 0x0F)).astype(np.uint8)",
      "return ((c[..., 0::2] & 0x0F) << 4 | (c[..., 1::2] & 0x0F)).astype(np.uint8)",
      "tests/test_outside_checkpoints.py",
      more=(("mtp_cupy/weights/quant_host.py", "out[..., 0::2], out[..., 1::2] = p & 0x0F, p >> 4",
             "out[..., 1::2], out[..., 0::2] = p & 0x0F, p >> 4"),)),
    M("catch-up-hidden-shifted", "generate's catch-up prefill pairs each row with the next position's hidden",
      "mtp_cupy/speculative/generate.py", "np.stack(hid[nxt:pos]), start_position=nxt)",
      "np.stack(hid[nxt + 1:pos + 1]), start_position=nxt)", "tests/test_generate.py", "tests/test_sampling.py"),
    M("resample-from-target", "after a rejection the token is drawn from p, not from norm(max(0, p - q))",
      "mtp_cupy/speculative/sampling.py", "probs = resid / s if s > 0 else p[i]", "probs = p[i]",
      "tests/test_sampling.py"),
    M("refeed-trims-first-accepted", "refeed_accepted also drops the first accepted row (built from the target)",
      "mtp_cupy/speculative/proposer.py", "refed = max(num_accepted - 1, 0) if refeed_accepted else 0",
      "refed = num_accepted if refeed_accepted else 0", "tests/test_qwen_mtp_cycles.py"),
    M("yarn-softmax-scale-dropped", "MLA softmax scale without YaRN's mscale(f, mscale_all_dim)^2",
      "mtp_cupy/layers/mla.py", "return cls(inv, float(mag), scale * m_all * m_all, interleaved)",
      "return cls(inv, float(mag), scale, interleaved)", "tests/test_deepseek_v3.py", "tests/test_outside_checkpoints.py"),
    M("dsa-topk-one-short", "the DSA indexer keeps index_topk - 1 rows",
      "mtp_cupy/layers/dsa.py", "p[\"sel\"], self.sel_stride, m, d.topk,", "p[\"sel\"], self.sel_stride, m, d.topk - 1,",
      "tests/test_glm_mtp.py"),
    M("hc-post-comb-transposed", "mHC hc_post mixes streams with C[k, j] instead of C[j, k] (NumPy twin)",
      "mtp_cupy/refdev/twins/hyper_connection.py", "acc = acc + c[:, j, k, None] * xv[:, j]",
      "acc = acc + c[:, k, j, None] * xv[:, j]", "tests/test_deepseek_v4.py"),
    M("qwen-plain-norms", "Qwen3-Next norms as plain w instead of (1 + w)",
      "mtp_cupy/models/qwen3_next.py", "Norms(gpu, weights.norms, D, self.eps, unit_offset=True)",
      "Norms(gpu, weights.norms, D, self.eps, unit_offset=False)", "tests/test_qwen_mtp.py"),
    M("sharded-tie-to-higher-rank", "the vocab-sharded argmax breaks cross-rank ties to the higher rank",
      "mtp_cupy/refdev/twins/vocab_argmax.py", "        if vals[q] > vals[best]:", "        if vals[q] >= vals[best]:",
      "tests/mpi/test_glm_sharded.py", mpi=True),
    M("train-export-norms-swapped", "the training export writes enorm under hnorm's key and back (DeepSeek-style heads)",
      "mtp_cupy/training/deepseek_v3.py", '(("enorm", self.enorm), ("hnorm", self.hnorm),',
      '(("enorm", self.hnorm), ("hnorm", self.enorm),', "tests/test_training.py"),
    M("train-export-v4-w1-w3", "the V4 training export swaps the experts' gate (w1) and up (w3) halves",
      "mtp_cupy/training/deepseek_v4.py",
      'sd[f"{P}ffn.experts.{e}.w1.weight"], sd[f"{P}ffn.experts.{e}.w3.weight"] = v[e, :inter], v[e, inter:]',
      'sd[f"{P}ffn.experts.{e}.w3.weight"], sd[f"{P}ffn.experts.{e}.w1.weight"] = v[e, :inter], v[e, inter:]',
      "tests/test_training.py"),
    M("hf-verify-multirow-glm", "GLM-5's transformers target verifies in one multi-row forward again",
      "mtp_cupy/integrations/transformers.py", 'if mt in ("glm_moe_dsa", "deepseek_v32"):',
      'if mt in ("deepseek_v32",):', "tests/test_embedded.py::test_lossless_where_a_multirow_transformers_verify_was_not"),
    # -- programmatic dependent launch: a kernel launched early must wait before it reads ---------------------
    M("pdl-kernel-without-wait", "rope starts without pdl_entry(): under PDL it may read q before its writer ends",
      "cuda_src/rope.cu", "    pdl_entry();\n", "", "tests/test_kernel_pdl.py"),
    M("pdl-gemv-reads-x-early", "the streaming GEMV reads x before its pdl_wait()",
      "cuda_src/gemv.cu", "    pdl_wait();   // the ring's first stages are weights",
      "    const uint4 x_early = __ldg((const uint4*)x);\n    pdl_wait();   // the ring's first stages are weights",
      "tests/test_kernel_pdl.py"),
    # -- the batch calls' array path (speculative/base.py, batch_inputs.py) ---------------------------------------
    M("batch-verify-keeps-run", "after_verify_batch trims a sequence's rows but keeps the run of positions they began",
      "mtp_cupy/speculative/base.py", "                states[s]._cut(int(rows[s]))\n", "                pass\n",
      "tests/test_soak.py::test_soak"),
    M("batch-verify-keeps-block", "after_verify_batch does not give back a block its trimmed rows emptied",
      "mtp_cupy/speculative/base.py",
      "                self.kv.shrink_one(idx[ones], nb[ones])\n", "                pass\n",
      "tests/test_soak.py::test_soak", "tests/test_batch.py",
      more=(("mtp_cupy/speculative/base.py", "                self.kv.shrink_one(idx, nb)\n", "                pass\n"),)),
    M("batch-finish-no-run", "a wide propose_batch at a later position does not start a run of positions",
      "mtp_cupy/speculative/base.py", "new_run = (positions != c[:, OFF] + rows0) | (rows0 == 0)",
      "new_run = rows0 == 0", "tests/test_soak.py::test_soak", "tests/test_batch.py"),
    M("batch-reserve-stale-blocks", "a wide propose_batch that grows a table scatters the old block count back",
      "mtp_cupy/speculative/base.py", "                c[ones, NBLOCKS] += 1\n",
      "                pass\n",
      "tests/test_soak.py::test_soak", "tests/test_batch.py",
      more=(("mtp_cupy/speculative/base.py", "                c[:, NBLOCKS] += 1\n", "                pass\n"),)),
    M("empty-sequence-stale-offset", "a sequence trimmed to no rows keeps a stale position offset in the mirror",
      "mtp_cupy/speculative/proposer.py", "r0, p0 = self.runs[-1] if self.runs else (0, 0)",
      "r0, p0 = self.runs[-1] if self.runs else (0, 5)", "tests/test_soak.py::test_soak"),
    M("batch-check-allows-hole", "the array check of a wide batch lets a position skip ahead with drafter context",
      "mtp_cupy/speculative/batch_inputs.py",
      "if ok and not np.count_nonzero(p != nxt if prop.drafter_context else p < nxt):",
      "if ok and not np.count_nonzero(p < nxt):", "tests/test_batch.py"),
    M("batch-memo-misses-freed", "a mirror row given back leaves the cache's row epoch as it was (a remembered batch "
      "keeps a freed state's row)", "mtp_cupy/cache/paged.py",
      "        self._rows_free.append(row)\n        self.row_epoch += 1", "        self._rows_free.append(row)",
      "tests/test_batch_memo.py"),
    # -- the shared expert fused into the routed grouped GEMMs (layers/moe.py, refdev twins) ----------------------
    M("moe-fused-shared-wrong-slot", "the fused shared expert's output is read from the last routed slot",
      "mtp_cupy/layers/moe.py", "self.y.offset(4 * K * D)", "self.y.offset(4 * (K - 1) * D)",
      "tests/test_moe.py::test_moe_layer_fused_shared"),
    M("moe-weighted-sum-shared-stride", "the weighted sum's twin reads shared rows `hidden` apart, not shared_stride",
      "mtp_cupy/refdev/twins/moe.py", "strided(dev, ys, F32, (m, hidden), (ys_stride, 1))",
      "strided(dev, ys, F32, (m, hidden), (hidden, 1))", "tests/test_moe.py"),
    M("moe-plan-shared-slot-skipped", "the plan's twin gives the fused shared slot to no expert",
      "mtp_cupy/refdev/twins/moe.py", "e = np.full((n // (K + 1), K + 1), sid, np.int64)",
      "e = np.full((n // (K + 1), K + 1), -1, np.int64)", "tests/test_moe.py"),
    M("group-table-scale-offset", "a group starting inside a 128-row scale block reads its block's first row's place",
      "mtp_cupy/ops/grouped_gemv.py", "int(W.scale) + (r // 128) * kb * ss if W.fmt != \"bf16\" else 0, r % 128)",
      "int(W.scale) + (r // 128) * kb * ss if W.fmt != \"bf16\" else 0, 0)", "tests/test_grouped_gemv.py"),
    M("mla-uv-table-row0", "MLA's W_UV table starts each head at its W_UK rows (row0 0, not qk_nope)",
      "mtp_cupy/layers/mla.py", "ops.upload_group_table(gpu, w.kv_b, H, dv, dn, dn + dv)",
      "ops.upload_group_table(gpu, w.kv_b, H, dv, 0, dn + dv)", "tests/test_deepseek_v3.py", "tests/test_glm_mtp.py"),
    M("x64-short-streams", "linear sends k-splits of fewer than X64_MIN_ROUNDS units a slice to the 64-row kernels",
      "mtp_cupy/ops/gemv.py", "    if -(-units // (ks * kb)) < X64_MIN_ROUNDS:\n        return False\n", "",
      "tests/test_gemv_batch64.py::test_linear_takes_batch64_where_it_matches"),
    M("x64-two-slice-clusters", "the 64-row planner gives two-slice blocks a cluster (no kernel instance has that)",
      "mtp_cupy/ops/gemv.py", "or cb > max_kb or (x > 1 and cb > 1):", "or cb > max_kb:",
      "tests/test_gemv_batch64.py::test_batch64_refusals"),
    M("attn-merge-no-rescale", "the merge twin adds a split's output without rescaling the running one by a",
      "mtp_cupy/refdev/twins/paged_attention.py", "O[on] = _fma32(O[on], a[on, None],",
      "O[on] = _fma32(O[on], np.float32(1),", "tests/test_paged_attention.py"),
    M("walk-window-bound-ignored", "the mode choice ignores a window's empty splits (V4 would split at every batch)",
      "mtp_cupy/ops/paged_attention.py", "n = min(bound, _REF_ROWS) if bound > 0 else _REF_ROWS",
      "n = _REF_ROWS", "tests/test_paged_attention.py"),
    M("attn-window-long-chunks", "a windowed call takes 4-tile chunks (V4's 128-row window: one split, walked at B = 1)",
      "mtp_cupy/ops/paged_attention.py", "return _MIN_CHUNK_WINDOW if window > 0 else _MIN_CHUNK",
      "return _MIN_CHUNK", "tests/test_paged_attention.py"),
    M("stack-scales-misplaced", "stack_rows copies every part's scales to the start of the stacked scale buffer",
      "mtp_cupy/weights/linear.py", "gpu.copy_d2d_async(sbuf.ptr.offset(so), p.scale, sb)",
      "gpu.copy_d2d_async(sbuf.ptr, p.scale, sb)", "tests/test_linear_stack.py"),
    M("stack-block-unaligned", "stack_rows accepts a block-format part of rows not a multiple of 128 before another",
      "mtp_cupy/weights/linear.py", "any(p.n % 128 for p in parts[:-1])", "False", "tests/test_linear_stack.py"),
    M("moe-even-grid-off", "short expert-GEMM calls keep the full resident grid (the tail of one-more-unit blocks)",
      "mtp_cupy/ops/moe.py", "if rounds <= EVEN_ROUNDS_MAX:", "if False:",
      "tests/test_moe.py::test_moe_mma_grid_spreads_short_calls"),
    # -- the fp8 expert GEMMs' x staged as f16 (ops/moe.py, refdev twins) ------------------------------------------
    M("moe-stage-scale-off-by-one", "the staged x's scale is 2^(e - 1): every fp8 expert result halves",
      "mtp_cupy/refdev/twins/moe.py", "sc = np.where(keep, F32(1), ((E - 14) << 23)",
      "sc = np.where(keep, F32(1), ((E - 15) << 23)", "tests/test_moe.py"),
    M("moe-stage-scales-inf", "a vector holding Inf is scaled like a finite one", "mtp_cupy/refdev/twins/moe.py",
      "keep = (mb == 0) | (mb >= 0x7F80)", "keep = (mb == 0) | (mb > 0x7F80)", "tests/test_moe.py::test_stage_f16"),
    M("moe-gemm-ignores-x-scale", "the fp8 GEMMs read the staged x without its scale", "mtp_cupy/refdev/twins/moe.py",
      "    if int(xsc):\n        xv = xv * strided(", "    if False:\n        xv = xv * strided(", "tests/test_moe.py"),
    M("moe-staged-x-per-row-always", "x read per pair (a slot stride) is staged one vector per row",
      "mtp_cupy/ops/moe.py", "per_row = xss == 0", "per_row = True", "tests/test_moe.py"),
]


def scratch_copy(dest: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for f in filter(None, files):
        src = ROOT / f
        if src.is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / f)


def apply(m: Mutation, dest: Path) -> str | None:
    """Apply every edit of m in dest; returns why it could not."""
    for file, old, new in m.edits:
        p = dest / file
        text = p.read_text()
        if text.count(old) != 1:
            return f"{file}: the original snippet occurs {text.count(old)} times"
        p.write_text(text.replace(old, new))
    return None


def run_tests(where: Path, tests, mpi: bool, args) -> tuple[int, str, float]:
    py = args.python
    cmd = [py, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "--color=no", *tests]
    if mpi:
        cmd = [args.mpiexec, "-n", "2", *cmd]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("PYTHONPATH", None)
    if args.seed is not None:
        env["MTP_TEST_SEED"] = str(args.seed)
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=where, env=env, capture_output=True, text=True, timeout=args.timeout)
        return p.returncode, p.stdout + p.stderr, time.perf_counter() - t0
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return -1, out + "\n[timed out]", time.perf_counter() - t0


def check(m: Mutation, args) -> tuple[str, float, str]:
    with tempfile.TemporaryDirectory(prefix=f"mut_{m.name}_") as d:
        dest = Path(d)
        scratch_copy(dest)
        why = apply(m, dest)
        if why:
            return "NOT APPLIED", 0.0, why
        rc, out, secs = run_tests(dest, m.tests, m.mpi, args)
    if rc == -1:
        return "caught (timeout)", secs, out[-2000:]
    if rc == 0:
        return "MISSED", secs, out[-2000:]
    if rc in (1,):                             # tests failed
        failed = [ln for ln in out.splitlines() if ln.startswith(("FAILED", "ERROR"))]
        return "caught", secs, failed[0] if failed else out[-500:]
    return f"caught (pytest exit {rc})", secs, out[-1000:]


def main() -> int:
    ap = Parser(__doc__)
    ap.add_argument("-k", "--only", dest="k", default="", help="only mutations whose name contains this")
    ap.add_argument("-j", "--jobs", dest="j", type=int, default=1, help="mutations run at once")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per mutation's test run")
    ap.add_argument("--seed", type=int, default=None, help="MTP_TEST_SEED for every run")
    ap.add_argument("--python", default=sys.executable, help="the Python that runs the tests")
    ap.add_argument("--mpiexec", default=str(Path(sys.executable).with_name("mpiexec")),
                    help="the mpiexec of the MPI mutations")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unmutated run of the selected tests")
    ap.add_argument("--list", action="store_true", help="list the mutations and exit")
    ap.add_argument("-v", "--verbose", dest="v", action="store_true", help="print each mutation's test output tail")
    args = ap.parse_args()
    chosen = [m for m in MUTATIONS if args.k in m.name]
    if not chosen:
        ap.error(f"no mutation name contains {args.k!r} (--list shows them)")
    if args.list:
        for m in chosen:
            print(f"{m.name:30s} {m.why}\n{'':30s} {', '.join(m.tests)}{' (mpiexec -n 2)' if m.mpi else ''}")
        return 0
    if not args.no_baseline:
        for mpi in (False, True):
            tests = sorted({t for m in chosen if m.mpi == mpi for t in m.tests})
            if not tests:
                continue
            with tempfile.TemporaryDirectory(prefix="mut_baseline_") as d:
                scratch_copy(Path(d))
                rc, out, secs = run_tests(Path(d), tests, mpi, args)
            print(f"baseline{' (mpi)' if mpi else ''}: {'pass' if rc == 0 else 'FAIL'} in {secs:.0f} s")
            if rc != 0:
                print(out[-3000:])
                return 2
    rows = []
    with ThreadPoolExecutor(max(1, args.j)) as pool:
        for m, (status, secs, detail) in zip(chosen, pool.map(lambda m: check(m, args), chosen)):
            rows.append((m, status, secs, detail))
            print(f"  {m.name}: {status} ({secs:.0f} s)", flush=True)
            if args.v or not status.startswith("caught"):
                print("    " + detail.replace("\n", "\n    "))
    w = max(len(m.name) for m, *_ in rows)
    print(f"\n| {'mutation':{w}s} | result | s | tests | bug |\n|{'-' * (w + 2)}|---|---|---|---|")
    for m, status, secs, _ in rows:
        print(f"| {m.name:{w}s} | {status} | {secs:.0f} | {' '.join(t.removeprefix('tests/') for t in m.tests)}"
              f"{' (mpi)' if m.mpi else ''} | {m.why} |")
    bad = [m.name for m, status, *_ in rows if not status.startswith("caught")]
    print(f"\n{len(rows) - len(bad)} of {len(rows)} caught" + (f"; not caught: {', '.join(bad)}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
