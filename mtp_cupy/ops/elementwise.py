"""Launchers for cuda_src/elementwise.cu."""
from ._util import THREADS, blocks_for, launch

__all__ = ["bf16_residual_add"]


def bf16_residual_add(gpu, x, r, n, stream=None):
    """x += r over n bf16 elements (in place)."""
    launch(gpu, "elementwise", "bf16_residual_add").grid(blocks_for(n)).block(THREADS) \
        .arg_ptr(x).arg_ptr(r).arg_u32(n).launch(stream)
