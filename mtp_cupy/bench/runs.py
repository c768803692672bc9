"""Runs the real-dims scripts share: prefill then time propose, stage one step's metadata slab by hand, and
split one step into timed phases."""
from __future__ import annotations

import time

import numpy as np

from ..runtime.dtypes import to_bf16
from .timing import time_phases


def prefill_and_time(gpu, prop, V: int, shape: tuple, ctx: int, drafts: int, iters: int, seed: int):
    """Prefill `ctx` random rows, then time ``propose(drafts)`` + ``after_verify(0)``.

    One warm-up call first (kernel compiles, workspaces); then `iters` timed calls, wall clock around each.
    Afterwards one ``propose(k=1)`` leaves the state holding an extra drafted row at position `ctx`, for
    `phase_ms`.

    Parameters
    ----------
    gpu : mtp_cupy Backend
        The proposer's device.
    prop : MtpProposerBase
        The proposer.
    V : int
        Vocab size (random token ids below it).
    shape : tuple of int
        Shape of one target hidden (``(D,)``, or ``(hc, D)`` for V4 streams).
    ctx, drafts, iters, seed : int
        Rows prefilled, drafts per propose, timed calls, generator seed.

    Returns
    -------
    tuple
        (state, hidden, prefill seconds, list of wall seconds per call).
    """
    rng = np.random.default_rng(seed)
    st = prop.alloc_state()
    t0 = time.perf_counter()
    prop.prefill(st, rng.integers(0, V, ctx + 1), to_bf16(rng.standard_normal((ctx, *shape))))
    gpu.synchronize()
    prefill_s = time.perf_counter() - t0
    h = to_bf16(rng.standard_normal(shape))

    def call():
        prop.propose(st, int(rng.integers(V)), h, ctx, drafts)
        prop.after_verify(st, 0)
    call()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    prop.propose(st, 1, h, ctx, 1)
    return st, h, prefill_s, times


def stage_row_meta(prop, st, position: int, row: int) -> None:
    """Put the metadata slab of one step (`position`, cache `row`) at the proposer's ``meta``, as the chain
    does before each step: stage it in the pinned stage, copy slab 0 to the device."""
    prop._stage_slabs([st], [row], [position], 1, 1)
    prop.gpu.copy_h2d_async(prop.meta, prop._stage[prop._meta_off:prop._meta_off + prop.meta_stride])
    prop.gpu.synchronize()


def phase_ms(prop, st, position: int, iters: int, phases) -> dict[str, float]:
    """Milliseconds of each part of one draft step, re-run on the state's newest row in place.

    Parameters
    ----------
    prop : MtpProposerBase
        The proposer, after `prefill_and_time` (its state holds the row at `position`).
    st : ProposerState
        Its state.
    position : int
        Position of the newest row.
    iters : int
        Calls timed per phase (`time_phases`: CUDA events, or the wall clock on the NumPy device).
    phases : callable
        ``phases(prop)`` -> dict of name to callable (a family's ``phases`` in mtp_cupy.bench).
    """
    stage_row_meta(prop, st, position, st.blocks.rows - 1)
    return time_phases(prop.gpu, phases(prop), iters)
