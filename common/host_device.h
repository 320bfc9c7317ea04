/* host_device.h: MOE_HD marks a static inline function that CUDA kernels
 * call too, so host and device compute the same formula. */
#ifndef MOE_COMMON_HOST_DEVICE_H
#define MOE_COMMON_HOST_DEVICE_H

#if defined(__CUDACC__)
#define MOE_HD __host__ __device__ static inline
#else
#define MOE_HD static inline
#endif

#endif /* MOE_COMMON_HOST_DEVICE_H */
