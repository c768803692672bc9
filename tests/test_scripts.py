"""CPU smoke tests of scripts/ and mtp_cupy.bench, so the benchmarks cannot rot silently: every script's --help
exits 0 and names each flag's default, a bad flag is one line and exit status 2, every script with a NumPy
device (or CPU) mode runs end to end in seconds, and mtp_cupy.bench / mtp_cupy.testing.torch_peers import
with torch and CuPy blocked. The GPU-only paths (CUDA events, the copy probe, the GEMV benchmark, ncu
profiling) run only on a GPU machine (scripts/gpu_check.sh bench)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p.name for p in (ROOT / "scripts").glob("*.py"))
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
       "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def run(script: str, *args: str, cwd=ROOT, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / script), *args], cwd=cwd, env=ENV,
                          capture_output=True, text=True, timeout=timeout)


def ok(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 0, f"exit {r.returncode}\n--- stdout\n{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-3000:]}"
    assert "Traceback" not in r.stderr, r.stderr
    return r.stdout


def have(module: str) -> bool:
    try:
        __import__(module)
        return True
    except Exception:    # noqa: BLE001
        return False


# -- every script: --help, a bad flag ------------------------------------------------------------------------
def test_every_script_has_help_and_one_line_errors():
    assert {"bench_draft.py", "bench_kernels.py", "draft_glm.py", "profile_step.py", "run_real_dims_v3.py",
            "run_real_dims_v4.py", "run_real_dims_qwen.py", "acceptance.py", "train_tiny.py",
            "stdlib_corpus.py", "nvrtc_check.py"} <= set(SCRIPTS)
    assert "bench_common.py" not in SCRIPTS
    with ThreadPoolExecutor(4) as ex:
        helps = dict(zip(SCRIPTS, ex.map(lambda s: run(s, "--help"), SCRIPTS)))
        bads = dict(zip(SCRIPTS, ex.map(lambda s: run(s, "--no-such-flag"), SCRIPTS)))
    for s in SCRIPTS:
        out = ok(helps[s])
        assert out.startswith("usage:"), (s, out[:200])
        blocks = {}                  # flag -> its help text (a line "  --flag ...", then deeper-indented lines)
        for ln in out.split("options:", 1)[1].splitlines():
            if ln.startswith("  -"):
                flag = [w.rstrip(",") for w in ln.split() if w.startswith("--")][0]
                blocks[flag] = ln
            elif ln.startswith("   ") and blocks:
                blocks[flag] += ln
            elif ln.strip():
                break
        assert "--help" in blocks and len(blocks) > 1, (s, out)
        for flag, text in blocks.items():   # each flag explains itself, its default included
            assert flag == "--help" or "default" in text, (s, flag, text)
        r = bads[s]
        assert r.returncode == 2, (s, r.returncode, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "error:" in lines[0] and "--no-such-flag" in lines[0], (s, r.stderr)


def test_bad_values_are_one_line():
    for script, args in (("bench_draft.py", ["--ks", "0"]), ("draft_hash.py", ["--save", "/no/such/dir/x.npz"]),
                         ("run_real_dims_qwen.py", ["--batch", "65"]),
                         ("draft_glm.py", ["--checkpoint", "x", "--real-dims"]), ("stdlib_corpus.py", ["--fold", "20"]),
                         ("bench_small_kernels.py", ["--rows", "1,70000"])):
        r = run(script, *args)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, (script, r.stderr)


def test_mtp_error_is_one_line(tmp_path):
    r = run("draft_glm.py", "--device", "ref", "--checkpoint", str(tmp_path / "none"))
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines() == [f"draft_glm.py: error: ConfigError: config file not found: "
                                             f"{tmp_path / 'none'}"], r.stderr


# -- NumPy-device smoke runs --------------------------------------------------------------------------------
def test_bench_draft_tiny_ref(tmp_path):
    """Every family at batch 1 and 3, ours and (with torch) the torch peer at both widths, in the table, the JSON,
    the plot (with matplotlib) and a --from-json re-print."""
    out, png = tmp_path / "b.json", tmp_path / "b.png"
    args = ["--family", "all", "--device", "ref", "--tiny", "--ks", "1,2", "--batches", "1,3", "--iters", "1",
            "--json", str(out), "--plot", str(png)]
    torch_cpu, mpl = have("torch"), have("matplotlib")
    text = ok(run("bench_draft.py", *args, *(["--torch-cpu"] if torch_cpu else ["--no-torch"])))
    res = json.loads(out.read_text())
    assert [f["family"] for f in res["families"]] == ["deepseek_v4", "deepseek_v3", "qwen3_next", "glm5"]
    for f in res["families"]:
        assert f["error"] is None and f["torch_error"] is None, f
        assert f"### {f['title']} ({f['family']}), ctx 32" in text
        assert [(r["k"], r["batch"]) for r in f["rows"]] == [(1, 1), (2, 1), (1, 3), (2, 3)]
        block = text[text.index(f"({f['family']}), ctx 32"):]
        assert "first step at batch 1 (k = 1 against k = 2)" in block and "first step at batch 3" in block
        for r in f["rows"]:
            assert r["weight_bytes"] > 0 and r["kv_bytes"] > 0 and r["ours"]["graph_off"]["wall_us"] > 0
            assert r["experts"] >= 1
            if not torch_cpu:
                assert r["torch"] is None
                continue
            t = r["torch"]
            assert t["eager"]["wall_us"] > 0 and t["graph"] is None and t["kv_bytes"] > 0
            assert t["moe_path"] == ("gather" if r["batch"] == 1 else "grouped" if have_grouped_mm() else "gather")
            assert 1 <= t["experts"] <= r["batch"] * 8 and t["weight_bytes"] > 0
        if torch_cpu:
            assert [p["batch"] for p in f["torch_peers"]] == [1, 3]
            assert "- torch MoE path gather at batch 1" in text
    for B in (1, 3):                 # a table row per (batch, k): "| B | k | ours ..."
        assert text.count(f"\n| {B} | 1 | ") == 4 and text.count(f"\n| {B} | 2 | ") == 4, text
    assert ("# wrote" in text and png.stat().st_size > 10_000) if mpl else "--plot skipped: matplotlib" in text
    again = ok(run("bench_draft.py", "--from-json", str(out), str(out)))
    assert again.count("\n| 3 | 2 | ") == 8 and "# bench_draft" not in again


def test_bench_draft_catch_up_ref():
    """--catch-up times serving steps (the sequences rewound to ctx before each point, a row a call after):
    every family at batch 1 and 3 runs, and the header says what was timed."""
    text = ok(run("bench_draft.py", "--family", "all", "--device", "ref", "--tiny", "--ks", "2", "--batches", "1,3",
                  "--iters", "3", "--no-torch", "--catch-up"))
    assert text.count("ours timed as serving steps") == 4 and "FAILED" not in text
    for B in (1, 3):
        assert text.count(f"\n| {B} | 2 | ") == 4, text


def have_grouped_mm() -> bool:
    from mtp_cupy.testing.torch_peers import grouped_mm_works
    return grouped_mm_works("cpu")[0]


@pytest.mark.parametrize("moe", ["grouped", "gather"])
def test_batched_torch_peer_equals_one_row_peers(moe):
    """A peer of B sequences drafts, row for row, what B one-row peers with the same weights and inputs draft:
    the same ids at every step of a chain, the carried hidden close (the batching is checked, not only timed).

    Close, not equal: an M = B matmul may sum in another order than the M = 1 one (MKL's f32 sgemm vs sgemv
    does, in V4's mHC mix), and a last-bit f32 difference that flips a bf16 rounding is carried down the chain
    (one bf16 ulp of the largest element is up to 2^-7 of it). So the error is measured against the hidden's
    scale, max|diff| <= 2e-2 max|ref|; a row mixed up with another sequence's is off by O(1)."""
    torch = pytest.importorskip("torch")
    from mtp_cupy.bench.drafter import real_config
    from mtp_cupy.testing.torch_peers import PEERS
    if moe == "grouped" and not have_grouped_mm():
        pytest.skip("torch._grouped_mm does not run on this CPU")
    B, ctx, k = 3, 24, 3
    for fam, build in PEERS.items():
        cfg = real_config(fam, tiny=True)
        peer = build(cfg, ctx, k, "cpu", 0, batch=B, moe=moe)
        start = {n: t.clone() for n, t in peer.state.items()}     # the chain writes the caches
        peer.chain(k)
        assert peer.moe_path == moe and peer.batch == B and peer.experts_selected() >= cfg.get(
            "num_experts_per_tok")
        ids = torch.stack(peer.out["ids"], 1)                    # [B, k]
        assert len(set(map(tuple, ids.tolist()))) == B, (fam, ids)  # the rows really differ
        for b in range(B):
            one = build(cfg, ctx, k, "cpu", 0)
            for n, t in start.items():
                one.state[n].copy_(t[b:b + 1])
            one.chain(k)
            assert torch.stack(one.out["ids"], 1)[0].tolist() == ids[b].tolist(), (fam, b)
            ref, got = one.out["h"][0].float(), peer.out["h"][b].float()
            err = float((got - ref).abs().max() / ref.abs().max())
            assert err <= 2e-2, f"{fam} row {b}: carried hidden max|diff| / max|ref| = {err:.3g} > 2e-2"
        one = build(cfg, ctx, k, "cpu", 0)
        assert peer.dense_bytes == one.dense_bytes + (B - 1) * 2 * cfg["hidden_size"]
        assert peer.kv_bytes == B * one.kv_bytes and one.weight_bytes == one.weight_bytes_for(
            cfg.get("num_experts_per_tok"))


@pytest.mark.parametrize("script", ["run_real_dims_v3.py", "run_real_dims_v4.py"])
def test_run_real_dims_phases_ref(script):
    """The phase split re-runs the newest row on a slab staged by hand (mtp_cupy.bench.stage_row_meta)."""
    text = ok(run(script, "--device", "ref", "--tiny", "--ctx", "16", "--iters", "1"))
    assert "ms/draft step" in text
    phases = [ln for ln in text.splitlines() if ln.startswith("  ") and ln.endswith(" us")]
    assert len(phases) >= 7 and any("LM head" in ln for ln in phases), text


def test_run_real_dims_qwen_ref():
    text = ok(run("run_real_dims_qwen.py", "--device", "ref", "--tiny", "--ctx", "16", "--iters", "1", "--drafts",
                  "2", "--quant", "bf16", "--batch", "1", "2"))
    rows = [ln.split() for ln in text.splitlines() if ln.strip().startswith("bf16")]
    assert [r[1] for r in rows] == ["1", "2"], text


@pytest.mark.parametrize("args", [["--real-dims", "--tiny", "--ctx", "16", "--iters", "1"], ["--ctx", "8"]],
                         ids=["real-dims-tiny", "tiny-checkpoint"])
def test_draft_glm_one_rank_ref(args):
    text = ok(run("draft_glm.py", "--device", "ref", "--cycles", "2", *args))
    assert "1 rank(s)" in text and "ms per draft step" in text and text.count("cycle ") == 2, text


def test_draft_hash_ref(tmp_path):
    """A line per width whose fingerprints follow the weights (another seed moves them) and repeat (the same
    seed gives the same lines); --save holds the logits' first columns, which the logits hash covers."""
    args = ["--device", "ref", "--tiny", "--ctx", "16", "--batches", "1,3", "--k", "2"]
    lines = lambda text: [ln for ln in text.splitlines() if " tokens " in ln]
    a = lines(ok(run("draft_hash.py", *args, "--save", str(tmp_path / "a.npz"))))
    b = lines(ok(run("draft_hash.py", *args)))
    c = lines(ok(run("draft_hash.py", *args, "--seed", "1")))
    assert len(a) == 2 and a == b and all(x.split()[4:] != y.split()[4:] for x, y in zip(a, c)), (a, c)
    assert [ln.split()[1] for ln in a] == ["B=1", "B=3"] and all(ln.endswith("finite True") for ln in a), a
    saved = np.load(tmp_path / "a.npz")
    assert saved["B1"].shape[:2] == (1, 2) and saved["B3"].shape[:2] == (3, 2) and np.isfinite(saved["B3"]).all()


def test_ab_trees(tmp_path):
    """build: a tree per NAME=REF from `git archive` with the data linked in; run: the command in every tree,
    interleaved by rounds, with the tree as working directory and import path; bad arguments are one line."""
    repo = tmp_path / "repo"
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{ROOT}", str(repo)], check=True, timeout=120)
    shutil.copy(ROOT / "scripts" / "ab_trees.sh", repo / "scripts" / "ab_trees.sh")   # the checkout's, not HEAD's
    sh = lambda *a: subprocess.run(["bash", str(repo / "scripts" / "ab_trees.sh"), *a], cwd=repo, env=ENV,
                                   capture_output=True, text=True, timeout=120)
    r = sh("build", "x=HEAD", "y=HEAD")
    assert r.returncode == 0 and (repo / ".ab/x/mtp_cupy/data").resolve() == (repo / "mtp_cupy/data").resolve(), r
    probe = "import mtp_cupy, pathlib; print('in', pathlib.Path(mtp_cupy.__file__).parents[1].name)"
    r = sh("run", "-r", "2", "--", sys.executable, "-c", probe)
    lines = [ln.split(" (")[0] if ln.startswith("==") else ln for ln in r.stdout.splitlines()]
    assert r.returncode == 0 and lines == ["== x", "in x", "== y", "in y"] * 2, r.stdout
    for args, code in ((["build", "nameonly"], 2), (["build", "z=no-such-ref"], 1), (["run", "-r", "0", "--", "ls"], 2),
                       (["run", "ls"], 2), (["run", "-r"], 2), (["nope"], 2)):
        r = sh(*args)
        assert r.returncode == code and len(r.stderr.strip().splitlines()) == 1, (args, r.returncode, r.stderr)


def test_bench_small_kernels_ref():
    """Every timed case launches on the NumPy device as the CUDA run would (its ops' signatures, its buffers)."""
    out = ok(run("bench_small_kernels.py", "--device", "ref", "--rows", "1,3"))
    ran = [ln for ln in out.splitlines() if ln.startswith("ran ")]
    assert len(ran) == 2 * 9 + 6 and "ran hc_mix (mix 24), 3 rows" in ran, out


def test_acceptance_ref():
    text = ok(run("acceptance.py", "--device", "ref", "--prompts", "1", "--prompt-len", "16", "--new-tokens", "3",
                  "--ks", "1"))
    assert "| 1 |" in text, text


def test_train_tiny_cpu(tmp_path):
    if not (have("torch") and have("transformers")):
        pytest.skip("train_tiny needs torch and transformers")
    ok(run("train_tiny.py", "--steps", "1", "--batch", "2", "--seq", "16", "--out", str(tmp_path / "ck")))
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v3" and (tmp_path / "ck" / "model.safetensors").stat().st_size > 0


def test_profile_step_summarize(tmp_path):
    rows = ['"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"']
    for i, (name, ns) in enumerate((("gemv_a(int)", 3000), ("argmax_b(float)", 1000), ("gemv_a(int)", 2000))):
        for metric, v in (("gpu__time_duration.sum", ns), ("dram__bytes_read.sum", 4e6), ("dram__bytes_write.sum", 0)):
            rows.append(f'"{i}","{name}","{metric}","x","{v}"')
    csv = tmp_path / "p.csv"
    csv.write_text("==PROF== a log line\n" + "\n".join(rows) + "\n")
    text = ok(run("profile_step.py", "--summarize", str(csv), "--copy-gbs", "4000", "--step-us", "10"))
    assert text.startswith("3 launches, 2 kernels; sum of kernel times 6.0 µs, 12.0 MB moved"), text
    assert "| gemv_a | 2 | 5.0 |" in text and "gaps 4.0 µs" in text, text


def test_stdlib_corpus_split():
    from mtp_cupy.bench.corpus import stdlib_files
    held = ok(run("stdlib_corpus.py", "--held-out")).split()
    assert held == [str(p) for p in stdlib_files(True)] and 0 < len(held) < len(stdlib_files(False))


# -- the package -----------------------------------------------------------------------------------------------
def test_bench_imports_without_torch_or_cupy():
    code = ("import sys, importlib, pkgutil\n"
            "for m in ('torch', 'cupy', 'mpi4py', 'transformers'): sys.modules[m] = None\n"
            "import mtp_cupy.bench, mtp_cupy.testing.torch_peers as tp\n"
            "for pkg in (mtp_cupy.bench, tp):\n"
            "    for m in pkgutil.iter_modules(pkg.__path__): importlib.import_module(pkg.__name__ + '.' + m.name)\n"
            "print(sorted(tp.PEERS))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[0] == "['deepseek_v3', 'deepseek_v4', 'glm5', 'qwen3_next']"


def test_host_timer_and_phases(ref):
    from mtp_cupy.bench import EventTimer, back_to_back_us, time_phases
    calls = []
    t = EventTimer.for_device(ref, iters=3, warmup=2)
    gpu_us, wall_us = t.time(lambda: calls.append(1))
    assert gpu_us == [] and len(wall_us) == 3 and len(calls) == 5 and not t.has_gpu_time
    assert t.us(lambda: None, iters=2) >= 0
    calls.clear()
    assert back_to_back_us(ref, lambda: calls.append(1), 4) >= 0 and len(calls) == 5
    assert list(time_phases(ref, {"a": lambda: None, "b": lambda: None}, 2)) == ["a", "b"]


def test_random_device_tensors(ref):
    from mtp_cupy.bench.random_device import RandomDevice
    from mtp_cupy.runtime.dtypes import BF16
    r = RandomDevice(ref, 0)
    x = ref.read(r.bf16(4096, 0.5, 1.0), BF16, 4096).astype(np.float32)
    assert abs(x.mean() - 1.0) < 0.05 and abs(x.std() - 0.5) < 0.05
    lins = r.linears(3, 8, 64)
    assert [int(w.weight) - int(lins[0].weight) for w in lins] == [0, 2 * 8 * 64, 4 * 8 * 64]
    w = r.fp8_block(256, 128)
    assert w.fmt == "fp8_block" and (w.n, w.k) == (256, 128) and len(r.owners) == 4


def test_profile_host_ref_smoke():
    """The host-path probe on the NumPy device: the phase line for a propose and a propose_batch, and the
    cProfile listing naming the proposer's own code."""
    one = ok(run("profile_host.py", "--family", "qwen3_next", "--device", "ref", "--skip-chain", "--calls", "20"))
    assert "batch=1 k=1" in one and "phases (median µs): total" in one and "_propose" in one
    wide = ok(run("profile_host.py", "--family", "deepseek_v3", "--device", "ref", "--skip-chain", "--calls", "5",
                  "--batch", "5", "--k", "2", "--no-profile"))
    assert "batch=5 k=2" in wide and "post" in wide and "_propose" not in wide
    dev = ok(run("profile_host.py", "--family", "deepseek_v4", "--device", "ref", "--calls", "3", "--batch", "5",
                 "--hidden-on", "device", "--no-profile"))
    assert "batch=5 k=1" in dev and "hidden_on=device" in dev
    step = ok(run("profile_host.py", "--family", "glm5", "--device", "ref", "--calls", "4", "--batch", "6", "--k", "2",
                  "--catch-up", "--no-profile"))   # the rows are really written (no --skip-chain)
    assert "after_verify + catch-up prefill + propose" in step and "batch=6 k=2" in step
    bad = run("profile_host.py", "--device", "ref", "--catch-up")
    assert bad.returncode != 0 and "give --batch > 1" in bad.stderr and "Traceback" not in bad.stderr


def test_first_step_from_two_call_lengths():
    """A k-step call is the first step plus k - 1 later ones: the later step and the ratio come back exactly."""
    from mtp_cupy.bench.draft_table import first_step
    first, later = 130.0, 100.0
    for k in (2, 3, 5):
        got_later, ratio = first_step(first, (first + (k - 1) * later) / k, k)
        assert abs(got_later - later) < 1e-9 and abs(ratio - first / later) < 1e-12
    assert first_step(None, 1.0, 3) is None and first_step(1.0, 1.0, 1) is None
