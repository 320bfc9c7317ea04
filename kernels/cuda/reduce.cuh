/* reduce.cuh: sums and maxima over a warp and over a block. It includes
 * nothing: the file that includes it provides the device environment
 * (kernels/cuda/common.cuh on a GPU build, tests/simt_emu.h on the CPU),
 * MOE_FULL_MASK and __shfl_xor_sync among it. */
#ifndef MOE_KERNELS_CUDA_REDUCE_CUH
#define MOE_KERNELS_CUDA_REDUCE_CUH

/* Over each aligned group of G lanes (the whole warp by default); every
 * lane of the warp takes part. */
template <typename T, int G = 32> __device__ __forceinline__ T moe_warp_sum(T v) {
    for (int o = G / 2; o > 0; o >>= 1) v += __shfl_xor_sync(MOE_FULL_MASK, v, o);
    return v;
}

template <int G = 32> __device__ __forceinline__ float moe_warp_max(float v) {
    for (int o = G / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(MOE_FULL_MASK, v, o));
    return v;
}

/* Sum over a block whose size is a multiple of 32 (at most 1024), in a
 * fixed tree order: the same bits on every run. Every thread gets the
 * result. shared holds 32 values; the call ends with a barrier so shared can
 * be reused at once. */
template <typename T> __device__ T moe_block_sum(T v, T *shared) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    v = moe_warp_sum(v);
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    T total = lane < n_warps ? shared[lane] : T(0);
    total = moe_warp_sum(total);
    __syncthreads();
    return total;
}

#endif /* MOE_KERNELS_CUDA_REDUCE_CUH */
