"""Twins of cuda_src/call_io.cu. On the NumPy device mapped host memory is a device segment (RefBackend.alloc_mapped),
so the host's stage, ctl and outbox are read and written here like any other address."""
import numpy as np

from ...runtime.ptr import DevicePtr
from ..registry import twin


@twin("call_io", "call_stage_in")
def call_stage_in(dev, stage, call_in, n16, ctl, hidden_dst, seq):
    dev.view(call_in, np.uint8, 16 * n16)[:] = dev.view(stage, np.uint8, 16 * n16)
    c = dev.view(ctl, np.uint32, 4)
    seq_v, hidden16, src = int(c[0]), int(c[1]), int(c[2]) | int(c[3]) << 32
    if hidden16:
        dev.view(hidden_dst, np.uint8, 16 * hidden16)[:] = dev.view(DevicePtr(src), np.uint8, 16 * hidden16)
    dev.view(seq, np.uint32, 1)[0] = seq_v


@twin("call_io", "call_publish")
def call_publish(dev, ids, flags, lps, n, outbox, seq):
    body = dev.view(DevicePtr(int(outbox) + 16), np.uint32, 3 * n if lps else 2 * n if flags else n)
    body[:n] = dev.view(ids, np.uint32, n)
    if flags:
        body[n:2 * n] = dev.view(flags, np.uint32, n)
    if lps:
        body[2 * n:3 * n] = dev.view(lps, np.uint32, n)
    dev.view(outbox, np.uint32, 1)[0] = dev.view(seq, np.uint32, 1)[0]
