"""Validation and upload of the inputs a serving loop hands a proposer. Every check runs before any state
changes, and raises InputError naming the problem."""
from __future__ import annotations

import array
import math
from dataclasses import dataclass

import numpy as np

from ..errors import InputError
from ..runtime.backend import Backend, is_torch_bf16
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


# -- DLPack inputs (torch / cupy tensors, CPU or CUDA) ------------------------------------------------
DL_CPU, DL_CUDA, DL_CUDA_HOST, DL_CUDA_MANAGED = 1, 2, 3, 13
HIDDEN_DTYPES = ("float32", "float16", "bfloat16")


def is_device_pointer(x) -> bool:
    """A bare device address (DevicePtr or int; not a bool)."""
    return isinstance(x, (DevicePtr, int)) and not isinstance(x, (bool, np.ndarray))


def dlpack_device(x) -> tuple[int, int] | None:
    """(DLPack device type, device id) of a DLPack object; None for NumPy arrays and non-DLPack data."""
    f = None if isinstance(x, np.ndarray) else getattr(x, "__dlpack_device__", None)
    if f is None:
        return None
    try:
        t, i = f()
    except Exception as e:
        raise InputError(f"{type(x).__name__}.__dlpack_device__() failed: {e}") from None
    return int(t), int(i)


def is_cuda_tensor(x) -> bool:
    d = dlpack_device(x)
    return d is not None and d[0] in (DL_CUDA, DL_CUDA_MANAGED)


def host_array(x, what: str) -> np.ndarray:
    """A NumPy view of host data: a NumPy array, a CPU DLPack object (a torch CPU tensor, bf16 included), or
    nested sequences. A CUDA tensor raises InputError (device data takes the device path)."""
    if isinstance(x, np.ndarray):
        return x
    dev = dlpack_device(x)
    if dev is None:
        try:
            return np.asarray(x)
        except Exception as e:
            raise InputError(f"{what}: cannot read a {type(x).__name__} as an array ({e})") from None
    if dev[0] not in (DL_CPU, DL_CUDA_HOST):
        raise InputError(f"{what} is on DLPack device type {dev[0]} (device {dev[1]}); expected the host or CUDA")
    if hasattr(x, "detach"):
        x = x.detach()
    bf16 = is_torch_bf16(x)
    if bf16:   # NumPy's DLPack import has no bf16: read the raw words
        import sys
        x = x.view(sys.modules["torch"].int16)
    try:
        a = np.from_dlpack(x)
    except Exception as e:
        raise InputError(f"{what}: a {type(x).__name__} of dtype {getattr(x, 'dtype', '?')} cannot be read through "
                         f"DLPack ({e})") from None
    return a.view(BF16) if bf16 else a


def host_ints(x, gpu: Backend | None, what: str, stream=None, as_array: bool = False) -> list[int] | np.ndarray:
    """Integer ids or positions as host ints: an int, a sequence of ints, a NumPy array or a DLPack tensor (a
    CUDA one is read to the host: a wait on `stream`, never on the whole device). `as_array`: as a 1-D int64
    array instead of a list (what the batch calls check and stage with)."""
    if as_array and type(x) is list and x and type(x[0]) is not bool:
        # a batch call's plain list of ints: array.array converts them faster than NumPy's type discovery and
        # refuses what would not be an int64 array of them (floats, strings, huge ints: the general path below);
        # a list of bools, which NumPy keeps as bools, never gets here (its first element is a bool)
        try:
            return np.frombuffer(array.array("q", x), np.int64)
        except (TypeError, ValueError, OverflowError):
            pass
    if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
        v = [_int64(x, what)]
        return np.array(v, np.int64) if as_array else v
    if is_cuda_tensor(x):
        if gpu is None or not gpu.is_cuda:
            raise InputError(f"{what} is a CUDA tensor but this proposer runs on the {getattr(gpu, 'name', '?')} "
                             "device; pass host values")
        arr, kind = _import_device(gpu, x, what, stream)
        a = gpu.to_host(arr, stream)
    elif dlpack_device(x) is not None or isinstance(x, np.ndarray):
        a = host_array(x, what)
    else:
        try:
            a = np.asarray(x)
        except Exception:
            a = np.empty(0, object)
        if a.dtype == object:   # e.g. CUDA scalars in a list: one at a time
            try:
                v = [_int64(int(e), what) for e in (x if isinstance(x, (list, tuple)) else [x])]
            except (TypeError, ValueError) as e:
                raise InputError(f"{what}: expected integers, got {type(x).__name__} ({e})") from None
            return np.array(v, np.int64) if as_array else v
    if a.size == 0:
        return np.zeros(0, np.int64) if as_array else []
    if a.dtype.kind not in "iu":
        raise InputError(f"{what} must hold integers, got dtype {a.dtype}")
    if not as_array:
        return a.reshape(-1).tolist()
    if a.dtype == np.uint64 and int(a.max()) >= 1 << 63:
        raise InputError(f"{what}: {int(a.max())} does not fit int64")
    return a.reshape(-1).astype(np.int64, copy=False)   # one dtype for the callers' arithmetic and checks


def _int64(v, what: str) -> int:
    v = int(v)
    if not -(1 << 63) <= v < 1 << 63:
        raise InputError(f"{what}: {v} is outside the 64-bit integer range")
    return v


def _check_dtype(name: str, what: str) -> None:
    if name not in HIDDEN_DTYPES:
        raise InputError(f"{what} must be float32, float16 or bfloat16, got {name}")


def _match_shape(shape: tuple[int, ...], rows: int, shapes: list[tuple[int, ...]], what: str,
                 single: bool) -> tuple[int, ...]:
    """(rows,) + the per-row shape `shape` is; `single` also accepts one row without its leading 1."""
    shape = tuple(map(int, shape))
    for s in shapes:
        if shape == (rows,) + s or (single and shape == s):
            return (rows,) + s
    want = [(rows,) + s for s in shapes] + (list(shapes) if single else [])
    raise InputError(f"{what} has shape {shape}; expected one of {want}")


_WIDE_WORDS = 1 << 16   # bf16 words from which _finite takes two max passes (B = 32 hiddens of 2048 and up)


def _finite(a) -> bool:
    """No NaN or inf in a float32 / float16 / bf16 array (host or device; bf16 words as uint16 are tested by
    their exponent bits)."""
    if a.dtype == np.uint16:   # bf16 words: NaN/inf have every exponent bit set
        if a.size < _WIDE_WORDS:
            return a.size == 0 or bool((a & 0x7F80).max() != 0x7F80)
        # +inf/NaN are 0x7F80..0x7FFF, the top of the int16 range, and -inf/NaN 0xFF80..0xFFFF, the top of the
        # uint16 range: two max passes, faster than an and pass and a max once the arrays are large
        return bool(a.max() < 0xFF80 and a.view(np.int16).max() < 0x7F80)
    xp = np if isinstance(a, np.ndarray) else __import__("cupy")
    return bool(xp.isfinite(a).all())


def _import_device(gpu: Backend, x, what: str, stream):
    dev = dlpack_device(x)
    if not gpu.is_cuda:
        raise InputError(f"{what} is a CUDA tensor but this proposer runs on the {gpu.name} device; pass a host "
                         "tensor or array")
    if dev[0] == DL_CUDA and dev[1] != getattr(gpu, "device_id", 0):
        raise InputError(f"{what} is on CUDA device {dev[1]}; this proposer runs on CUDA device {gpu.device_id}")
    if hasattr(x, "detach"):
        x = x.detach()
    try:
        return gpu.from_dlpack(x, stream)
    except InputError:
        raise
    except Exception as e:
        raise InputError(f"{what}: cannot import a {type(x).__name__} through DLPack ({type(e).__name__}: {e})") \
            from None


@dataclass
class Hidden:
    """One call's hiddens after every check: a contiguous host bf16 array, or bf16 rows on the device (the
    caller's own memory when `in_place`, else a converted copy that `keep` owns until the call's work ran)."""
    shape: tuple[int, ...]              # (rows,) + the per-row shape
    host: np.ndarray | None = None
    ptr: DevicePtr | None = None
    in_place: bool = False
    keep: object = None
    unchecked: str | None = None        # a host array whose NaN check was deferred: what to call it in the error

    @property
    def row_shape(self) -> tuple[int, ...]:
        return self.shape[1:]

    def require_finite(self) -> None:
        """The deferred NaN/inf check of a host array (take_hidden(..., defer_check=True)): InputError."""
        if self.unchecked is not None and not _finite(self.host.view(np.uint16)):
            raise InputError(f"{self.unchecked} holds NaN or inf")


def take_hidden(gpu: Backend, x, rows: int, shapes: list[tuple[int, ...]], what: str = "hidden", stream=None,
                single: bool = False, check_device: bool = False, defer_check: bool = False) -> Hidden:
    """Check and stage hiddens for `rows` rows of one of the per-row `shapes` (the first is what a bare device
    pointer holds).

    * a device pointer: bf16 rows of `shapes[0]`, read in place (no checks possible);
    * a CUDA DLPack tensor on this proposer's GPU: a C-contiguous bf16 one is read in place (zero copy);
      float32 / float16 ones are rounded to bf16 on the device and strided ones made contiguous, once, on
      `stream`; NaN/inf are checked only with `check_device` (a wait on `stream`);
    * anything else (CPU tensors, NumPy arrays, sequences): float32 / float16 / bfloat16 (NumPy arrays: float32
      / bfloat16), finite, converted to contiguous bf16 once on the host; with `defer_check` the NaN/inf test of
      the bf16 words is left to `Hidden.require_finite` (a propose runs it after launching its chain, off the
      GPU's critical path, and rolls back on failure).
    Raises InputError naming the problem (dtype, shape, device, NaN) before any state changes."""
    if is_device_pointer(x):
        if int(x) == 0:
            raise InputError(f"{what} is a NULL device pointer")
        return Hidden((rows,) + shapes[0], ptr=DevicePtr(int(x)), in_place=True)
    if is_cuda_tensor(x):
        arr, kind = _import_device(gpu, x, what, stream)
        _check_dtype(kind, what)
        shape = _match_shape(arr.shape, rows, shapes, what, single)
        words = gpu.bf16_rows(arr, kind, stream)
        in_place = words.data.ptr == arr.data.ptr
        if check_device:
            with _on(gpu, stream):
                ok = _finite(words)
            if not ok:
                raise InputError(f"{what} holds NaN or inf")
        return Hidden(shape, ptr=DevicePtr(words.data.ptr), in_place=in_place, keep=(x, arr, words))
    if type(x) is np.ndarray and x.dtype == BF16 and x.flags.c_contiguous:   # the common host case, checked lean
        shape = _match_shape(x.shape, rows, shapes, what, single)
        if defer_check:
            return Hidden(shape, host=x.reshape(shape), unchecked=what)
        if not _finite(x.view(np.uint16)):
            raise InputError(f"{what} holds NaN or inf")
        return Hidden(shape, host=x.reshape(shape))
    h = host_array(x, what)
    if isinstance(x, np.ndarray) and h.dtype == np.float16:   # NumPy arrays keep their float32 / bfloat16 contract
        raise InputError(f"{what} must be float32 or bfloat16 (float16 is taken from tensors), got {h.dtype}")
    _check_dtype("bfloat16" if h.dtype == BF16 else h.dtype.name, what)
    shape = _match_shape(h.shape, rows, shapes, what, single)
    if h.dtype == np.float16:
        h = h.astype(np.float32)
    if not defer_check and not _finite(h.view(np.uint16) if h.dtype == BF16 else h):
        raise InputError(f"{what} holds NaN or inf")
    return Hidden(shape, host=np.ascontiguousarray(h.astype(BF16, copy=False)).reshape(shape),
                  unchecked=what if defer_check else None)


def stage_hidden(gpu: Backend, hid: Hidden, dst: DevicePtr, stream=None) -> None:
    """Put checked hiddens into `dst`: one host-to-device copy, or one device-to-device copy (none when they
    already are there)."""
    if hid.host is not None:
        gpu.copy_h2d_async(dst, hid.host.reshape(-1), stream)
    elif int(hid.ptr) != int(dst):
        gpu.copy_d2d_async(dst, hid.ptr, 2 * math.prod(hid.shape), stream)


def _on(gpu: Backend, stream):
    import contextlib
    return gpu.using(stream) if stream is not None else contextlib.nullcontext()
