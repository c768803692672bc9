"""Library code of the benchmarks in scripts/. CuPy and torch are imported inside functions only, so this
package imports on a machine with neither.

| module | what it holds |
|---|---|
| `timing` | `EventTimer` (the cold-L2 event timer), `back_to_back_us`, `time_phases`, `median`, `FLUSH_BYTES` |
| `bandwidth` | `copy_bandwidth` (the device-to-device copy probe every floor uses) |
| `device` | device names, freeing device memory, torch's status, capturing a torch chain as a graph |
| `random_device` | `RandomDevice`: random device tensors in the real formats (bf16, f32, FP8, MXFP4) |
| `deepseek_v3`, `deepseek_v4`, `qwen3_next`, `glm5` | each family's `REAL` / `TINY` dims and `random_weights` (V3, V4: `phases` of a step) |
| `runs` | `prefill_and_time`, `stage_row_meta`, `phase_ms` (the real-dims scripts) |
| `drafter` | `Drafter`: a family's proposer at real dims, prefilled, with the bytes a step reads |
| `draft_bench`, `draft_table` | the draft-step benchmark of a family against its torch peer, and its report |
| `gemv`, `gemv_sweep` | the GEMV benchmark against cuBLAS, and the launch-plan sweep |
| `corpus` | the stdlib training / held-out split of the embedded model |
| `cli` | the scripts' argument parser conventions (`Parser`, `run_main`, argument types) |

The torch peers of the draft step live in `mtp_cupy.testing.torch_peers`."""
from __future__ import annotations

from .bandwidth import copy_bandwidth
from .device import device_name, free_device_memory, torch_status
from .runs import phase_ms, prefill_and_time, stage_row_meta
from .timing import FLUSH_BYTES, EventTimer, back_to_back_us, median, time_phases

__all__ = ["FLUSH_BYTES", "EventTimer", "back_to_back_us", "copy_bandwidth", "device_name", "free_device_memory",
           "median", "phase_ms", "prefill_and_time", "stage_row_meta", "time_phases", "torch_status"]
