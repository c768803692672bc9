"""Timers of the benchmarks: one cold-L2 event timer (`EventTimer`) and one back-to-back event timer
(`back_to_back_us`, with `time_phases` over a dict of phases).

`EventTimer` times a callable one call at a time. Before each timed call it writes `FLUSH_BYTES` to a
buffer on the same stream, which evicts L2 (50 MB on an H100, 60 MB on an H200), outside the event pair and
outside the wall clock (or, with `flush="read"`, sums the buffer: L2 is then full of clean lines, as after a
target's forward that mostly reads weights, not of dirty ones the first kernels must write back); then it
records an event, calls, records a second event and waits for it. The same
loop runs on three kinds of device, each giving the flush and the events:

* a CUDA device through CuPy (`EventTimer.cupy`): `cudaMemsetAsync` on the stream passed to `time`, CuPy
  events on that stream;
* torch's current CUDA stream (`EventTimer.torch("cuda")`): `Tensor.fill_` and torch events;
* the host (`EventTimer.host()`, also what `EventTimer.for_device` gives the NumPy device): no flush and no
  GPU time, the wall clock only.

With `sync_flush=True` (the draft-step benchmarks) the host waits for the flush before it starts the clock,
so the event pair also holds the host's launch time of the call (a graph-off step pays it). With
`sync_flush=False` (the kernel benchmarks) the call is launched while the flush still runs, so the events
bracket GPU time only; on CuPy timers a `SPIN_NS` busy-wait kernel follows the flush so that a launch path of
up to that much host time (ops.linear's checks and plan lookups on a slow host: ~60-80 µs, more than the
flush) still finds the GPU busy. CuPy and torch are imported when a timer of theirs is made."""
from __future__ import annotations

import time

import numpy as np

FLUSH_BYTES = 256 << 20          # > the L2 of an H100 / H200
SPIN_NS = 300_000                # the busy-wait after an unsynchronised flush (CuPy timers)
_SPIN = r"""extern "C" __global__ void spin(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}"""


def median(xs) -> float | None:
    """The median of `xs` as a float, or None when `xs` is empty.

    Parameters
    ----------
    xs : sequence of float
        Samples (µs per call, say).
    """
    return float(np.median(xs)) if len(xs) else None


FLUSHES = ("memset", "read")


def _flush_mode(flush: str) -> str:
    if flush not in FLUSHES:
        raise ValueError(f"flush must be one of {', '.join(FLUSHES)}, not {flush!r}")
    return flush


class _CupyEvents:
    """Flush and events of a CUDA device through CuPy, on the stream given to each call."""

    def __init__(self, flush: str = "memset"):
        import cupy as cp
        self.cp, self.mode = cp, _flush_mode(flush)
        self.buf = cp.empty(FLUSH_BYTES, cp.uint8)
        self.sink = cp.empty((), cp.uint64)
        self.e0, self.e1 = cp.cuda.Event(), cp.cuda.Event()
        self.spin = cp.RawKernel(_SPIN, "spin")

    def _stream(self, stream):
        return stream if stream is not None else self.cp.cuda.get_current_stream()

    def flush(self, i: int, stream, sync: bool) -> None:
        s = self._stream(stream)
        if self.mode == "read":
            with s:
                self.cp.sum(self.buf.view(self.cp.uint64), out=self.sink)
        else:
            self.cp.cuda.runtime.memsetAsync(self.buf.data.ptr, i & 0xFF, self.buf.nbytes, s.ptr)
        if sync:
            s.synchronize()
        else:
            with s:
                self.spin((1,), (1,), (self.cp.uint64(SPIN_NS),))

    def start(self, stream) -> None:
        self.e0.record(self._stream(stream))

    def stop(self, stream) -> None:
        self.e1.record(self._stream(stream))
        self.e1.synchronize()

    def elapsed_us(self) -> float:
        return 1e3 * self.cp.cuda.get_elapsed_time(self.e0, self.e1)


class _TorchEvents:
    """Flush and events on torch's current CUDA stream (the stream argument is not used)."""

    def __init__(self, device: str, flush: str = "memset"):
        import torch
        self.torch, self.mode = torch, _flush_mode(flush)
        self.buf = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device)
        self.e0 = torch.cuda.Event(enable_timing=True)
        self.e1 = torch.cuda.Event(enable_timing=True)

    def flush(self, i: int, stream, sync: bool) -> None:
        if self.mode == "read":
            self.sink = self.buf.view(self.torch.int64).sum()
        else:
            self.buf.fill_(i & 0xFF)
        if sync:
            self.torch.cuda.synchronize()

    def start(self, stream) -> None:
        self.e0.record()

    def stop(self, stream) -> None:
        self.e1.record()
        self.e1.synchronize()

    def elapsed_us(self) -> float:
        return 1e3 * self.e0.elapsed_time(self.e1)


class _HostEvents:
    """No GPU: nothing to flush, no events (the timer keeps the wall clock)."""
    buf = None

    def flush(self, i: int, stream, sync: bool) -> None:
        pass

    def start(self, stream) -> None:
        pass

    def stop(self, stream) -> None:
        pass

    def elapsed_us(self) -> None:
        return None


class EventTimer:
    """The cold-L2 timer: flush, event, call, event, per timed call (see the module docstring).

    Parameters
    ----------
    events : object
        The device's flush and events; make a timer with `cupy`, `torch`, `host` or `for_device` instead.
    iters : int, default 20
        Timed calls when `time` / `us` are not given a count.
    warmup : int, default 0
        Untimed calls made first by every `time` / `us` call.
    sync_flush : bool, default True
        Wait for the flush before the clock starts (the events then hold the call's launch time too).
    """

    def __init__(self, events, iters: int = 20, warmup: int = 0, sync_flush: bool = True):
        self.events, self.iters, self.warmup, self.sync_flush = events, int(iters), int(warmup), bool(sync_flush)

    @classmethod
    def cupy(cls, flush: str = "memset", **kw) -> "EventTimer":
        """A timer on a CUDA device through CuPy (CuPy events; the flush a cudaMemsetAsync, or a sum of the
        buffer with flush="read"); `kw` as the class."""
        return cls(_CupyEvents(flush), **kw)

    @classmethod
    def torch(cls, device: str, flush: str = "memset", **kw) -> "EventTimer":
        """A timer of torch work on `device` ("cuda...": torch events on the current stream, the flush as in
        `cupy`; else the host)."""
        return cls(_TorchEvents(device, flush) if device.startswith("cuda") else _HostEvents(), **kw)

    @classmethod
    def host(cls, **kw) -> "EventTimer":
        """A wall-clock-only timer (no GPU)."""
        return cls(_HostEvents(), **kw)

    @classmethod
    def for_device(cls, gpu, flush: str = "memset", **kw) -> "EventTimer":
        """The timer of an mtp_cupy device: `cupy` (with `flush`) on CUDA, `host` on the NumPy device."""
        return cls.cupy(flush, **kw) if gpu.is_cuda else cls.host(**kw)

    @property
    def has_gpu_time(self) -> bool:
        return not isinstance(self.events, _HostEvents)

    def time(self, fn, iters: int | None = None, stream=None) -> tuple[list[float], list[float]]:
        """Time `fn()` `iters` times after the warm-up calls.

        Parameters
        ----------
        fn : callable
            The work; it launches on `stream` (CuPy), on torch's current stream (torch), or runs on the host.
        iters : int, optional
            Timed calls (default: the timer's `iters`).
        stream : cupy.cuda.Stream, optional
            The stream the flush and events go on (CuPy timers; default: the current stream).

        Returns
        -------
        gpu_us : list of float
            Event time of each call in µs (empty on the host).
        wall_us : list of float
            Wall time of each call in µs, from before the first event to after the second is reached.
        """
        ev = self.events
        for _ in range(self.warmup):
            fn()
        gpu, wall = [], []
        for i in range(self.iters if iters is None else int(iters)):
            ev.flush(i, stream, self.sync_flush)
            t0 = time.perf_counter()
            ev.start(stream)
            fn()
            ev.stop(stream)
            wall.append(1e6 * (time.perf_counter() - t0))
            g = ev.elapsed_us()
            if g is not None:
                gpu.append(g)
        return gpu, wall

    def us(self, fn, iters: int | None = None, stream=None) -> float:
        """Median µs per call of `fn`: event time, or wall time on the host (arguments as `time`)."""
        gpu, wall = self.time(fn, iters, stream)
        return median(gpu if gpu else wall)

    def close(self) -> None:
        """Give back the flush buffer."""
        self.events.buf = None


def back_to_back_us(gpu, fn, iters: int) -> float:
    """Mean µs per call of `fn` run `iters` times back to back, L2 warm.

    One warm call, a synchronize, then an event, `iters` calls and an event on the current stream (CUDA), or
    the wall clock around the same calls (the NumPy device).

    Parameters
    ----------
    gpu : mtp_cupy Backend
        The device `fn` launches on.
    fn : callable
        The work.
    iters : int
        Calls between the two events.
    """
    fn()
    gpu.synchronize()
    if gpu.is_cuda:
        e0, e1 = gpu.new_event(), gpu.new_event()
        gpu.record(e0)
        for _ in range(iters):
            fn()
        gpu.record(e1)
        gpu.synchronize()
        return 1e3 * gpu.elapsed_ms(e0, e1) / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return 1e6 * (time.perf_counter() - t0) / iters


def time_phases(gpu, phases: dict, iters: int) -> dict[str, float]:
    """Milliseconds per call of each phase (`back_to_back_us` of each, in order).

    Parameters
    ----------
    gpu : mtp_cupy Backend
        The device the phases launch on.
    phases : dict of str to callable
        Name -> the launches of that phase.
    iters : int
        Calls timed per phase.
    """
    return {name: back_to_back_us(gpu, fn, iters) / 1e3 for name, fn in phases.items()}
