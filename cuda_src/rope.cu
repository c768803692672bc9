// Rotary position embedding on bf16 heads, in place or from x into out.
//
// x[r, h, :] starts at element r * row_stride + h * head_stride; the rotary dims are
// [rot_offset, rot_offset + rot_dim) of each head (rot_offset 0: Qwen partial rotary and the DSA indexer's
// front rope; 128 / 448 / 512: MLA and V4's rope at the end) and the rest is never touched. Pair i
// (i < rot_dim / 2) is (2i, 2i + 1) when interleaved (GPT-J, DeepSeek) and (i, i + rot_dim / 2) for neox.
// Each pair is rotated by rope_pair (common.cuh): the fp32 angle float(pos_r) * inv_freq[i], accurate sincosf,
// cos and sin scaled by mscale, and -theta when `inverse`.
// The rotated dims go to out[r, h, out_offset + ...] (element r * out_row_stride + h * out_head_stride; out == x
// with x's strides and offset: in place); nothing else of out is written. One thread per (row, head, pair), so
// each pair's two values are read before either is written.
#include "common.cuh"

extern "C" __global__ void rope(const __nv_bfloat16* x, __nv_bfloat16* out, const u32* pos, u32 pos_stride, u32 rows,
                                u32 heads, u32 rot_dim, u32 rot_offset, u32 row_stride, u32 head_stride,
                                u32 out_offset, u32 out_row_stride, u32 out_head_stride, const float* inv_freq,
                                u32 interleaved, float mscale, u32 inverse) {
    pdl_entry();
    const u32 half = rot_dim >> 1, n = rows * heads * half;  // the launcher keeps n < 2^31
    for (u32 t = blockIdx.x * blockDim.x + threadIdx.x; t < n; t += gridDim.x * blockDim.x) {
        const u32 i = t % half, h = (t / half) % heads, r = t / (half * heads);
        const u32 ia = interleaved ? 2 * i : i, ib = interleaved ? 2 * i + 1 : i + half;
        const __nv_bfloat16* xh = x + (u64)r * row_stride + (u64)h * head_stride + rot_offset;
        __nv_bfloat16* oh = out + (u64)r * out_row_stride + (u64)h * out_head_stride + out_offset;
        float a = bf2f(xh[ia]), b = bf2f(xh[ib]);
        rope_pair(a, b, row_pos(pos, pos_stride, r), inv_freq[i], mscale, inverse != 0);
        oh[ia] = f2bf(a);
        oh[ib] = f2bf(b);
    }
}
