// Helpers every module of coordinator/gpu/kernels/ shares: coordinator/gpu/kernels/__init__.py puts this file
// before each module's source, for NVRTC and tests/cuda_emulator.py alike.
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
// every thread of the block gets the total; part[] is free again when it returns
__device__ float block_sum(float v, float* part) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    if (lane == 0) part[w] = v;
    __syncthreads();
    v = warp_sum(lane < nw ? part[lane] : 0.0f);
    __syncthreads();
    return v;
}
__device__ float block_max(float v, float* part) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_max(v);
    if (lane == 0) part[w] = v;
    __syncthreads();
    v = warp_max(lane < nw ? part[lane] : __int_as_float(0xff800000));
    __syncthreads();
    return v;
}
// the integer total of v over the block, as block_sum
__device__ int block_sum_int(int v, int* part) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) part[w] = v;
    __syncthreads();
    v = lane < nw ? part[lane] : 0;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    return v;
}
