// A propose's way into and out of its draft chain without copy calls (speculative/base.py). The pinned host
// stage and outbox are mapped: under unified addressing a kernel reads and writes them over PCIe at their host
// address. So the chain's first kernel brings the call's inputs in, and its last one hands the drafts out.
// A copy call would cost the host its API time, and the GPU a copy-engine hop on each side of the graph
// (BENCHMARKS.md, twenty-second session: ~3.5 µs in, ~7 µs out on an H100, plus the stream wait).
#include "common.cuh"

// The call's control words, in host memory at the end of the stage: the call's sequence number, and the
// device rows to fetch into the chain's hidden buffer (16-byte words, 0: none).
struct CallCtl {
    u32 seq;
    u32 hidden16;
    u64 hidden_src;
};

// call_in[0, n16) = stage[0, n16) (16-byte words); hidden_dst[0, ctl.hidden16) = ctl.hidden_src[...]; *seq =
// ctl.seq. Grid-stride. It waits for the kernel ahead first: that may be the previous call's chain, which
// reads call_in, or a kernel of the caller's that writes the hidden rows.
extern "C" __global__ void call_stage_in(const uint4* __restrict__ stage, uint4* __restrict__ call_in, u32 n16,
                                         const CallCtl* __restrict__ ctl, uint4* __restrict__ hidden_dst,
                                         u32* __restrict__ seq) {
    pdl_entry();
    const u32 i0 = blockIdx.x * blockDim.x + threadIdx.x, step = gridDim.x * blockDim.x;
    const CallCtl c = *ctl;
    for (u32 i = i0; i < n16; i += step) call_in[i] = stage[i];
    const uint4* src = (const uint4*)c.hidden_src;
    for (u32 i = i0; i < c.hidden16; i += step) hidden_dst[i] = src[i];
    if (i0 == 0) *seq = c.seq;
}

// outbox (host memory), u32 words: [0] the call's seq, [1, 4) unused, then ids [n] | flags [n] | lps [n]
// (n = k * W; flags / lps only when given). Every thread fences its words system-wide before the block
// barrier, and the seq goes last: a host that reads the call's seq there reads its drafts too. One block.
extern "C" __global__ void call_publish(const u32* __restrict__ ids, const u32* __restrict__ flags,
                                        const u32* __restrict__ lps, u32 n, u32* outbox, const u32* __restrict__ seq) {
    pdl_entry();
    u32* body = outbox + 4;
    for (u32 i = threadIdx.x; i < n; i += blockDim.x) {
        body[i] = ids[i];
        if (flags) body[n + i] = flags[i];
        if (lps) body[2 * n + i] = lps[i];
    }
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) *(volatile u32*)outbox = *seq;
}
