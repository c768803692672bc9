"""Validation and upload of the inputs a serving loop hands a proposer. Every check runs before any state
changes, and raises InputError naming the problem."""
from __future__ import annotations

import numpy as np

from ..errors import InputError
from ..runtime.backend import Backend
from ..runtime.dtypes import BF16
from ..runtime.ptr import DevicePtr


def check_token(token, vocab: int, what: str = "token") -> int:
    t = int(token)
    if not 0 <= t < vocab:
        raise InputError(f"{what} id {t} is out of range [0, {vocab})")
    return t


def check_position(position, max_seq_len: int) -> int:
    p = int(position)
    if not 0 <= p < max_seq_len:
        raise InputError(f"position {p} is past the sized context (max_seq_len {max_seq_len})")
    return p


def check_bitmask(bitmask, vocab: int) -> np.ndarray | None:
    """xgrammar layout: int32 words, bit t%32 of word t//32 set = token t allowed."""
    if bitmask is None:
        return None
    m = np.asarray(bitmask)
    if m.dtype not in (np.int32, np.uint32):
        raise InputError(f"grammar bitmask must be int32 words, got {m.dtype}")
    need = (vocab + 31) // 32
    if m.ndim != 1 or m.size < need:
        raise InputError(f"grammar bitmask has {m.size} words; {need} are needed for vocab {vocab}")
    return np.ascontiguousarray(m.astype(np.int32, copy=False)[:need])


def hidden_to_device(gpu: Backend, hidden, shape: tuple[int, ...], dst: DevicePtr, stream=None) -> None:
    """Put a hidden (host float32/bfloat16 array of `shape`, or a DevicePtr already holding bf16 of that
    shape) into `dst` as bf16. Raises InputError for a wrong size or dtype."""
    n = int(np.prod(shape))
    if isinstance(hidden, (DevicePtr, int)) and not isinstance(hidden, (bool, np.ndarray)):
        if int(hidden) == 0:
            raise InputError("hidden is a NULL device pointer")
        if int(hidden) != int(dst):
            gpu.copy_d2d_async(dst, DevicePtr(int(hidden)), 2 * n, stream)
        return
    h = np.asarray(hidden)
    if h.dtype not in (np.float32, BF16):
        raise InputError(f"hidden must be float32 or bfloat16, got {h.dtype}")
    if h.size != n or (h.ndim > 1 and tuple(h.shape) != tuple(shape) and h.shape[-1] != shape[-1]):
        raise InputError(f"hidden has shape {tuple(h.shape)}; expected {tuple(shape)}")
    if h.dtype == np.float32 and not np.all(np.isfinite(h)):
        raise InputError("hidden holds NaN or inf")
    gpu.copy_h2d_async(dst, np.ascontiguousarray(h.astype(BF16, copy=False)).reshape(-1), stream)
