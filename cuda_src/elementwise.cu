// Elementwise bf16 kernels: residual add, concat, gates, SwiGLU, embedding gathers.
#include "common.cuh"

// x[i] += r[i] over n elements, in place (fp32 add, one bf16 rounding).
extern "C" __global__ void bf16_residual_add(__nv_bfloat16* x, const __nv_bfloat16* r, u32 n) {
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        x[i] = f2bf(bf2f(x[i]) + bf2f(r[i]));
}
