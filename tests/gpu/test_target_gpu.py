"""On the GPU, with the batch-invariant geometry the target runner turns on: a row verified beside k others
computes bit for bit what it computes alone, so greedy speculation emits exactly target-only output."""
import numpy as np
import pytest

import mtp_cupy
from mtp_cupy.speculative.generate import generate, generate_target_only
from mtp_cupy.target import DeepseekV3Target


@pytest.fixture(scope="module")
def pair():
    gpu = mtp_cupy.device("cuda")
    ck = mtp_cupy.DEFAULT_CHECKPOINT
    return DeepseekV3Target(gpu, ck, max_seq_len=512), mtp_cupy.load_proposer(ck, gpu=gpu, max_seq_len=512)


@pytest.mark.gpu
def test_rows_bitwise_equal_alone_or_batched(pair):
    target, _ = pair
    ids = list(b"def f(x):\n    return x * 2\n")
    a, b = target.alloc(), target.alloc()
    la, _ = target.forward(a, ids)
    lb = np.concatenate([target.forward(b, [t])[0] for t in ids])
    target.free(a), target.free(b)
    assert np.array_equal(la, lb)


@pytest.mark.gpu
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_speculative_equals_target_only_gpu(pair, k):
    target, drafter = pair
    for p in (b"import os\nimport sys\n\n\ndef main(", b"class Foo:\n    def __init__(self", b"    for i in range("):
        base = generate_target_only(target, list(p), 96)
        spec = generate(target, drafter, list(p), 96, num_drafts=k)
        assert spec.tokens == base.tokens, (p, k)
