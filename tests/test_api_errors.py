"""The Python API as a new user calls it (issue 20, item 7): device names accepted where a device is, typed
errors for a string prompt and bad counts, `mtp_cupy.target` without importing it, `import mtp_cupy` free of
mpi4py and cupy, and numpydoc docstrings on every public call."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import mtp_cupy
from mtp_cupy.errors import CollectiveTimeout, CommError, ConfigError, InputError, MtpError
from mtp_cupy.families import FAMILIES

CKPT = mtp_cupy.DEFAULT_CHECKPOINT
ROOT = Path(__file__).resolve().parents[1]


def _python(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=120)


def test_import_needs_neither_mpi4py_nor_cupy():
    p = _python("import sys\n"
                "import mtp_cupy\n"
                "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('mpi4py', 'cupy'))\n"
                "assert not loaded, loaded\n"
                "sys.modules['mpi4py'] = sys.modules['cupy'] = None   # as if not installed\n"
                "print(mtp_cupy.target.DeepseekV3Target.__name__)\n"
                "gpu = mtp_cupy.device('auto')\n"
                "prop = mtp_cupy.load_proposer(mtp_cupy.DEFAULT_CHECKPOINT, gpu=gpu, max_seq_len=64)\n"
                "import numpy as np\n"
                "st = prop.alloc_state(); prop.prefill(st, [1, 2, 3], np.ones((2, prop.hidden_size), np.float32))\n"
                "assert len(prop.propose(st, 4, np.ones(prop.hidden_size, np.float32), 2, 2).tokens) == 2\n")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "DeepseekV3Target"


def test_communicator_without_mpi4py_says_what_to_install():
    p = _python("import sys; sys.modules['mpi4py'] = None\n"
                "import mtp_cupy\n"
                "from mtp_cupy.runtime.comm import make_communicator\n"
                "try:\n"
                "    make_communicator(mtp_cupy.device('ref'))\n"
                "except mtp_cupy.CommError as e:\n"
                "    print(e)\n")
    assert p.returncode == 0, p.stderr
    assert "mpi4py" in p.stdout and "pip install 'mtp_cupy[mpi]'" in p.stdout


def test_collective_timeout_is_a_comm_error():
    assert issubclass(CollectiveTimeout, CommError) and issubclass(CommError, MtpError)
    assert mtp_cupy.CollectiveTimeout is CollectiveTimeout
    from mtp_cupy.runtime.comm import check_timeout
    assert check_timeout(2) == 2.0 and check_timeout(float("inf")) == float("inf")
    for bad in (0, -3, "x", None, True, float("nan")):
        with pytest.raises(ConfigError, match="collective_timeout_s"):
            check_timeout(bad)


def test_load_proposer_takes_a_device_name():
    prop = mtp_cupy.load_proposer(CKPT, gpu="ref", max_seq_len=64)
    assert prop.gpu.name == "ref" and not prop.gpu.is_cuda
    with pytest.raises(ConfigError, match="not int"):
        mtp_cupy.load_proposer(CKPT, gpu=3)
    with pytest.raises(ConfigError, match="unknown device 'tpu'"):
        mtp_cupy.load_proposer(CKPT, gpu="tpu")
    with pytest.raises(ConfigError, match="is a file; expected a checkpoint directory"):
        mtp_cupy.load_proposer(Path(CKPT) / "model.safetensors", gpu="ref")


@pytest.fixture(scope="module")
def pair():
    gpu = mtp_cupy.device("ref")
    target = mtp_cupy.target.DeepseekV3Target(gpu, CKPT, max_seq_len=128)
    return target, mtp_cupy.load_proposer(CKPT, gpu=gpu, max_seq_len=128, max_drafts=4)


@pytest.mark.parametrize("kw, says", [
    (dict(prompt="def f("), "prompt must be a sequence of token ids, not str; tokenize"),
    (dict(prompt=b"def f("), "not bytes"),
    (dict(prompt=[1, "x"]), "sequence of int token ids"),
    (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1, got 0"),
    (dict(max_new_tokens=2.5), "max_new_tokens must be an integer >= 1, got 2.5"),
    (dict(num_drafts=0), "num_drafts must be an integer >= 1, got 0"),
    (dict(num_drafts=9), "num_drafts 9 is more than the drafter's max_drafts 4"),
    (dict(temperature=-1), "temperature must be a finite number >= 0"),
    (dict(temperature=float("nan")), "temperature must be a finite number >= 0"),
])
def test_generate_refuses_bad_arguments(pair, kw, says):
    target, drafter = pair
    args = dict(prompt=list(b"def f("), max_new_tokens=4, num_drafts=2, temperature=0.0) | kw
    with pytest.raises(InputError, match=says.replace("(", r"\(").replace("[", r"\[")):
        mtp_cupy.generate(target, drafter, **args)
    if "num_drafts" not in kw:
        a = {k: v for k, v in args.items() if k != "num_drafts"}
        with pytest.raises(InputError, match=says.replace("(", r"\(")):
            mtp_cupy.generate_target_only(target, **a)


def test_generate_reports_where_the_time_went(pair):
    target, drafter = pair
    res = mtp_cupy.generate(target, drafter, list(b"def f("), 6, 2)
    assert len(res.tokens) == 6 and res.extra["draft_seconds"] > 0 and res.extra["verify_seconds"] > 0
    assert res.extra["draft_seconds"] + res.extra["verify_seconds"] <= res.seconds


def _doc(obj) -> str:
    return obj.__doc__ or ""


@pytest.mark.parametrize("name", ["device", "load_proposer", "generate", "generate_target_only", "target"])
def test_public_calls_have_numpydoc(name):
    obj = getattr(mtp_cupy, name)
    if name == "target":
        obj = obj.DeepseekV3Target
    doc = _doc(obj)
    for section in ("Parameters\n", "Returns\n" if name != "target" else "Methods\n", "Raises\n"):
        assert section in doc, f"{name}: no {section.strip()} section"


def test_load_proposer_documents_every_option():
    doc = _doc(mtp_cupy.load_proposer)
    for fam in FAMILIES:
        for opt in fam.options.names():
            assert f"\n        {opt} : " in doc, f"load_proposer's docstring misses {fam.name}'s option {opt}"


def test_proposer_calls_are_documented():
    prop = mtp_cupy.load_proposer(CKPT, gpu="ref", max_seq_len=64)
    for name in ("alloc_state", "prefill", "propose", "propose_batch", "after_verify", "free_state"):
        assert _doc(getattr(prop, name)).strip(), f"{name} has no docstring"
    assert "Parameters" in _doc(prop.propose_batch) and "Parameters" in _doc(prop.prefill)


def test_make_communicator_is_documented():
    from mtp_cupy.runtime.comm import make_communicator
    doc = _doc(make_communicator)
    assert all(s in doc for s in ("collective_timeout_s", "Parameters\n", "Raises\n", "CollectiveTimeout"))


def test_propose_without_catch_up_is_an_input_error():
    """The rule the demo and generate follow: after after_verify, the row of the last accepted token is caught
    up with prefill before the next propose."""
    from mtp_cupy.speculative.generate import catch_up
    prop = mtp_cupy.load_proposer(CKPT, gpu="ref", max_seq_len=64)
    D, rng = prop.hidden_size, np.random.default_rng(0)
    toks, hid = list(rng.integers(0, prop.vocab_size, 9)), list(rng.standard_normal((8, D)).astype(np.float32))
    st = prop.alloc_state()
    prop.prefill(st, toks[:8], np.stack(hid[:7]))
    res = prop.propose(st, toks[8], hid[7], 7, 3)
    prop.after_verify(st, 3)
    toks += res.tokens + [5]
    hid += list(rng.standard_normal((4, D)).astype(np.float32))
    with pytest.raises(InputError, match="hole"):
        prop.propose(st, toks[12], hid[11], 11, 3)
    assert catch_up(prop, st, toks, hid, 11) >= 1
    assert len(prop.propose(st, toks[12], hid[11], 11, 3).tokens) == 3
    assert catch_up(prop, st, toks, hid, 11) == 0


# -- the NCCL communicator's deadline logic, on stand-ins for cupy and MPI (no GPU here; the real NCCL path
#    needs `mpirun -n 2` on two GPUs: tests/mpi with CUDA) ---------------------------------------------------------
class _FakeNccl:
    NCCL_BFLOAT16, NCCL_FLOAT32, NCCL_INT32, NCCL_UINT8, NCCL_FLOAT16, NCCL_INT64 = range(6)
    NCCL_SUM, NCCL_MAX = 0, 1

    class NcclError(RuntimeError):
        pass

    def __init__(self, state):
        self.state = state
        fake = self

        class Comm:
            def __init__(self, world, uid, rank):
                assert len(uid) == 128 and all(isinstance(x, int) for x in uid)
                fake.state["comm"] = self

            def allReduce(self, *a):
                fake.state["calls"].append(("allReduce", a))

            def allGather(self, *a):
                fake.state["calls"].append(("allGather", a))

            def check_async_error(self):
                if fake.state["error"]:
                    raise fake.NcclError("NCCL_ERROR_SYSTEM_ERROR: remote process exited")

            def abort(self):
                fake.state["aborted"] = True
        self.NcclCommunicator = Comm

    @staticmethod
    def get_unique_id():
        return tuple(range(-64, 64))


def _fake_nccl_comm(monkeypatch, timeout):
    import types
    from mtp_cupy.runtime.comm import NcclCommunicator
    state = {"calls": [], "error": False, "aborted": False, "done": True, "capturing": False}
    nccl = _FakeNccl(state)
    cupy, cuda = types.ModuleType("cupy"), types.ModuleType("cupy.cuda")
    cupy.cuda, cuda.nccl = cuda, nccl
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupy.cuda", cuda)

    class Event:
        def __init__(self, **kw):
            pass

        def record(self, stream):
            pass

        @property
        def done(self):
            return state["done"]
    stream = types.SimpleNamespace(ptr=7, is_capturing=lambda: state["capturing"])
    cp = types.SimpleNamespace(cuda=types.SimpleNamespace(get_current_stream=lambda: stream, Event=Event))
    gpu = types.SimpleNamespace(cp=cp, is_cuda=True, synchronize=lambda: None)
    done = types.SimpleNamespace(Test=lambda: True)

    class Mpi:
        def Dup(self):
            return self

        def Get_rank(self):
            return 0

        def Get_size(self):
            return 2

        def Ibcast(self, buf, root):
            buf[:] = nccl.get_unique_id()
            return done

        def Ibarrier(self):
            return done
    return NcclCommunicator(gpu, Mpi(), collective_timeout_s=timeout), state


def test_nccl_deadline_logic_on_stand_ins(monkeypatch):
    import time
    comm, state = _fake_nccl_comm(monkeypatch, 0.3)
    comm.all_reduce(0x1000, 8, "bf16", "sum")                  # completes: waited for, returns
    assert state["calls"][-1] == ("allReduce", (0x1000, 0x1000, 8, 0, 0, 7))
    state["done"], state["capturing"] = False, True            # being captured into a graph: not waited for
    comm.all_gather(0x1000, 0x2000, 8, "bf16")
    assert state["calls"][-1][0] == "allGather" and not state["aborted"]
    state["capturing"] = False                                 # eager and never completes: deadline, abort
    t0 = time.monotonic()
    with pytest.raises(CollectiveTimeout, match=r"rank 0 of 2: all_reduce of 8 bf16 did not complete within "
                                                r"collective_timeout_s=0.3 s.*aborted and unusable"):
        comm.all_reduce(0x1000, 8, "bf16", "sum")
    assert 0.3 <= time.monotonic() - t0 < 3 and state["aborted"]
    n = len(state["calls"])
    with pytest.raises(CollectiveTimeout, match="unusable after all_reduce of 8 bf16 timed out"):
        comm.barrier()
    with pytest.raises(CollectiveTimeout):
        comm.all_gather(0x1000, 0x2000, 8, "bf16")
    assert len(state["calls"]) == n                            # nothing reached NCCL after the abort


def test_nccl_async_error_aborts(monkeypatch):
    comm, state = _fake_nccl_comm(monkeypatch, 60)
    state["done"], state["error"] = False, True
    with pytest.raises(CommError, match="NCCL reported .*remote process exited.*aborted") as e:
        comm.all_reduce(0x1000, 8, "bf16", "sum")
    assert not isinstance(e.value, CollectiveTimeout) and state["aborted"]
    with pytest.raises(CommError, match="unusable after all_reduce of 8 bf16 failed") as e:
        comm.all_reduce(0x1000, 8, "bf16", "sum")
    assert not isinstance(e.value, CollectiveTimeout)


def test_nccl_without_deadline_stays_asynchronous(monkeypatch):
    comm, state = _fake_nccl_comm(monkeypatch, float("inf"))
    state["done"] = False                                      # never completes, yet the call returns at once
    comm.all_reduce(0x1000, 8, "bf16", "sum")
    assert state["calls"][-1][0] == "allReduce" and not state["aborted"]
