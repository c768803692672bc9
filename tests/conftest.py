import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", help="also run the tests marked slow (as does -m slow)")


def pytest_collection_modifyitems(config, items):
    """`slow` tests run only when asked for (`-m slow`, or `--slow` with the rest); `gpu` tests skip without
    CUDA."""
    if not (config.getoption("--slow") or "slow" in (config.getoption("-m") or "")):
        skip_slow = pytest.mark.skip(reason="slow: run with -m slow or --slow")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(skip_slow)
    from mtp_cupy.runtime.cupy_backend import cuda_available
    if cuda_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


_DEVS = {}


def _device(kind):
    if kind not in _DEVS:
        import mtp_cupy
        _DEVS[kind] = mtp_cupy.device(kind)
    return _DEVS[kind]


@pytest.fixture(params=["ref", pytest.param("cuda", marks=pytest.mark.gpu)])
def dev(request):
    """Each test that takes `dev` runs on the NumPy device and, where CUDA exists, on the GPU."""
    return _device(request.param)


@pytest.fixture
def ref():
    return _device("ref")


@pytest.fixture
def cuda():
    return _device("cuda")


@pytest.fixture
def rng(request):
    """Fresh inputs every run; the seed is printed so a failure can be replayed (MTP_TEST_SEED)."""
    seed = int(os.environ.get("MTP_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
    print(f"[seed {seed}]")
    return np.random.default_rng(seed)
