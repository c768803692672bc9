"""Shared test helpers: uploads, poisoned outputs, relative errors that never let NaN pass."""
import numpy as np

from mtp_cupy.runtime.dtypes import BF16, dtype as _dtype

POISON = 0xFF  # 0xFFFF is a bf16 NaN, 0xFFFFFFFF an f32 NaN, 0xFF an fp8 NaN


def up(dev, arr):
    """Upload a host array; returns the DeviceBuffer (keep it alive while its pointer is used)."""
    return dev.upload(np.ascontiguousarray(arr))


def out(dev, dtype, shape, poison=True):
    """An output buffer, poisoned so a kernel that skips an element is caught."""
    dt = _dtype(dtype)
    n = int(np.prod(shape)) * dt.itemsize
    buf = dev.alloc(max(n, 1))
    dev.fill(buf.ptr, n, POISON if poison else 0)
    return buf


def get(dev, buf, dtype, shape):
    return dev.read(buf.ptr, dtype, shape)


def f32(a):
    return np.asarray(a).astype(np.float32)


def rel_err(got, ref) -> float:
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    if not np.all(np.isfinite(got)):
        return float("inf")
    den = np.linalg.norm(ref.ravel())
    num = np.linalg.norm((got - ref).ravel())
    return float(num / den) if den > 0 else float(num)


def assert_close(got, ref, tol, what=""):
    e = rel_err(got, ref)
    assert e <= tol, f"{what} relative error {e:.3e} > {tol:.1e}"


def bf16(a):
    return np.asarray(a, dtype=np.float32).astype(BF16)


def rand_bf16(rng, shape, scale=1.0):
    return bf16(rng.standard_normal(shape) * scale)


def run_on_both(run, *args):
    """`run(dev, *args)` on the NumPy device and on CUDA; returns (ref_result, cuda_result)."""
    import mtp_cupy
    return run(mtp_cupy.device("ref"), *args), run(mtp_cupy.device("cuda"), *args)


def assert_bf16_near(a, b, max_frac=0.01, atol=0.0):
    """CUDA vs twin on bf16 outputs: equal but for accumulation order, i.e. at most one bf16 ulp apart (or
    within `atol`, for outputs that are a near-cancelling sum), and on few elements."""
    a, b = f32(a), f32(b)
    assert np.all(np.isfinite(a)) and np.all(np.isfinite(b)), "NaN/inf in an output"
    d = np.abs(a - b)
    big = np.maximum(np.abs(a), np.abs(b))
    ulp = np.exp2(np.floor(np.log2(np.where(big > 0, big, 1.0))) - 7)   # bf16 spacing at the larger value
    assert np.all((d <= ulp) | (d <= atol)), f"max diff {d[d > atol].max()} (more than one bf16 ulp)"
    assert np.count_nonzero(d) <= max(2, int(a.size * max_frac)), f"{np.count_nonzero(d)} of {a.size} differ"


def check_pool(prop, states):
    """Proposer invariants over live states: rows == positions recorded, exactly the blocks those rows
    need, positions increasing, and every pool block either held by one state or free (no leak)."""
    from mtp_cupy.cache import PagedKvCache
    used = 0
    for st in states:
        assert st.seq_len == len(st.keys) and len(st.blocks.table) == PagedKvCache.blocks_for(st.seq_len)
        assert all(b > a for a, b in zip(st.keys, st.keys[1:]))
        used += len(st.blocks.table)
    assert used + prop.kv.free_count == prop.pool_blocks
