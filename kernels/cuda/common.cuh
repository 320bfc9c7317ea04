/* common.cuh: what every .cu file of the CUDA backend shares: the one check
 * macro for CUDA and cuBLAS statuses, the context's layout, and small
 * device helpers (warp reductions, storage-type conversions). Internal to
 * kernels/cuda. */
#ifndef MOE_KERNELS_CUDA_COMMON_CUH
#define MOE_KERNELS_CUDA_COMMON_CUH

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda.h> /* CUtensorMap: a type only, no driver calls */
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "kernels/cuda/cuda_ops.h"

extern "C" {
#include "common/status.h"
}

/* ------------------------------------------------------------------ checks */

/* Sets the error detail "<call> failed at <file>:<line>: <name>: <text>" and
 * returns the status that fits the failure (out of memory, no device or
 * unsupported, else internal). Overloaded so that one macro checks both. */
moe_status moe_cuda_report(cudaError_t err, const char *call, const char *file, int line);
moe_status moe_cuda_report(cublasStatus_t err, const char *call, const char *file, int line);

/* cudaMalloc of bytes (at least 1) into *out, or MOE_ERR_OUT_OF_MEMORY
 * naming what, the size, the device and its free memory. */
moe_status moe_cuda_malloc(void **out, size_t bytes, const char *what, const moe_cuda_ctx *ctx);

static inline bool moe_cuda_failed(cudaError_t err) { return err != cudaSuccess; }
static inline bool moe_cuda_failed(cublasStatus_t err) { return err != CUBLAS_STATUS_SUCCESS; }

/* Evaluates a CUDA or cuBLAS call once; on failure records the call, file
 * and line and returns the status from the enclosing function. After a
 * kernel launch: MOE_CUDA_CHECK(cudaGetLastError()). */
#define MOE_CUDA_CHECK(call)                                                                       \
    do {                                                                                           \
        auto moe_cuda_err_ = (call);                                                               \
        if (moe_cuda_failed(moe_cuda_err_))                                                        \
            return moe_cuda_report(moe_cuda_err_, #call, __FILE__, __LINE__);                      \
    } while (0)

/* ----------------------------------------------------------------- context */

/* cuBLASLt's own recommendation for Hopper is 32 MiB; smaller cards take
 * the same without harm. */
#define MOE_CUDA_WORKSPACE_BYTES ((size_t)32 << 20)

/* Device pointer arrays for batched cuBLAS calls: the grouped GEMM's three
 * arrays of E pointers and attention's three of B * Hq. */
#define MOE_CUDA_PTR_SLOTS (3 * 65536)

/* cuBLASLt plans kept. Expert GEMMs, whose row counts change with every
 * step's routing, share one plan per power-of-two bucket of rows, so a
 * model's plans settle after a few steps; past this many, the oldest plan
 * makes room. */
#define MOE_CUDA_LT_PLANS 256

/* Device scratch that an op sizes from its arguments: each op that needs
 * some has its own, so one op's growth never frees another's. */
typedef enum moe_cuda_scratch_use {
    MOE_CUDA_SCRATCH_SORT = 0, /* the embedding backward's sort */
    MOE_CUDA_SCRATCH_EXPERTS,  /* bf16 copies of the expert groups' operands */
    MOE_CUDA_SCRATCHES
} moe_cuda_scratch_use;

/* Everything that decides which cuBLASLt algorithm fits a GEMM, the
 * operand alignments included (cuBLASLt assumes 256 bytes unless told). */
typedef struct moe_cuda_lt_key {
    int64_t m, n, k, lda, ldb, ldc;
    int32_t trans_a, trans_b, ab_type, c_type;
    int32_t align_a, align_b, align_c;
    int32_t compute; /* cublasComputeType_t */
} moe_cuda_lt_key;

/* Descriptors in place (no create or destroy), for the key's sizes. */
typedef struct moe_cuda_lt_plan {
    moe_cuda_lt_key key;
    cublasLtMatmulDescOpaque_t desc;
    cublasLtMatrixLayoutOpaque_t layouts[3]; /* cuBLAS's A (our b), B (our a), C and D */
    cublasLtMatmulAlgo_t algo;
    bool used;
    bool misfits; /* a row bucket's plan whose algorithm some count in it could not use */
} moe_cuda_lt_plan;

struct moe_cuda_ctx {
    int device;
    int sm_count;
    int cc_major, cc_minor;
    size_t smem_optin_bytes; /* the most dynamic shared memory a block may ask for */
    char name[320];
    cudaStream_t stream;
    bool own_stream; /* created here (else the caller's, left to them) */
    cublasLtHandle_t lt;
    cublasHandle_t blas;
    void *workspace;       /* [MOE_CUDA_WORKSPACE_BYTES] */
    void **ptrs;           /* [MOE_CUDA_PTR_SLOTS] device */
    void **host_ptrs;      /* [MOE_CUDA_PTR_SLOTS] pinned host, staged for ptrs */
    int64_t *host_counts;  /* [MOE_EXPERTS_MAX + 1] pinned host */
    int32_t *tile_offsets; /* [MOE_EXPERTS_MAX + 1] device, the MMA grouped GEMM's tiles */
    void *encode_tensor_map; /* the driver's cuTensorMapEncodeTiled, found on first use */
    double *sumsq_parts;   /* [MOE_CUDA_SUMSQ_PARTS] device */
    char *staging;         /* [MOE_CUDA_STAGING_SLOTS][MOE_CUDA_STAGING_SLOT_BYTES] pinned host */
    cudaEvent_t staging_done[MOE_CUDA_STAGING_SLOTS]; /* each slot's last copy has finished */
    int next_staging;
    void *scratch[MOE_CUDA_SCRATCHES]; /* [scratch_bytes[i]] device, grown on first need */
    size_t scratch_bytes[MOE_CUDA_SCRATCHES];
    moe_cuda_lt_plan plans[MOE_CUDA_LT_PLANS];
    int next_plan;        /* round-robin victim once every slot is used */
    moe_cuda_math math;   /* how fp32 GEMMs use the tensor cores (moe_cuda_set_math) */
    moe_cuda_attention_path attention_path; /* moe_cuda_set_attention_path */
    moe_kept_error kept; /* the first failure of an op entry on it not yet reported (backend.cu) */
};

/* *out = the context's scratch for use, at least bytes long. It grows
 * (with a device wait) when a call needs more, by half again at least: the
 * old one is freed after the work queued so far, which may still use it. */
moe_status moe_cuda_scratch(void **out, size_t bytes, moe_cuda_scratch_use use, moe_cuda_ctx *ctx);

/* ------------------------------------------------------------ launch shape */

#define MOE_CUDA_THREADS 256

/* Blocks for a grid-stride loop over n items: enough to fill the device a
 * few times over, never more than the items need. */
static inline unsigned moe_cuda_grid(int64_t n, int threads, const moe_cuda_ctx *ctx) {
    int64_t want = (n + threads - 1) / threads, cap = (int64_t)ctx->sm_count * 32;
    if (want > cap) want = cap;
    return (unsigned)(want > 0 ? want : 1);
}

/* --------------------------------------------------------- device helpers */

#define MOE_FULL_MASK 0xffffffffu

#include "kernels/cuda/reduce.cuh"

/* c [16x8] += a [16x16] b [16x8] on the tensor cores: bf16 in, fp32 sums
 * (sm_80 and up). With g = lane / 4 and c = 2 (lane % 4), a lane holds
 *   a: {A[g][c..c+1], A[g+8][c..c+1], A[g][c+8..c+9], A[g+8][c+8..c+9]},
 *   b: {B[c..c+1][g], B[c+8..c+9][g]},
 *   c: {C[g][c], C[g][c+1], C[g+8][c], C[g+8][c+1]},
 * each pair packed low element first. */
__device__ __forceinline__ void moe_mma_bf16(float *c, const uint32_t *a, const uint32_t *b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
                 "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

/* The dynamic shared memory of a launch, as an array of type. */
#define MOE_DYNAMIC_SHARED(type, name) extern __shared__ __align__(16) type name[]

/* 16 bytes global -> shared, asynchronously (sm_80 and up); src_bytes 0
 * writes zeros and reads nothing. Complete after moe_cp_async_commit and a
 * moe_cp_async_wait<N> that leaves at most N newer groups in flight. */
__device__ __forceinline__ void moe_cp_async16(void *dst_shared, const void *src, int src_bytes) {
    const uint32_t dst = (uint32_t)__cvta_generic_to_shared(dst_shared);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}

__device__ __forceinline__ void moe_cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N> __device__ __forceinline__ void moe_cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

/* Four 8 x 8 matrices of b16 from shared memory: lanes 8i .. 8i + 7 name
 * the rows of matrix i, and lane l gets r[i] = its row l / 4, columns
 * 2 (l % 4) and 2 (l % 4) + 1 (the mma fragments' layout). */
__device__ __forceinline__ void moe_ldmatrix_x4(uint32_t *r, const void *row_shared) {
    const uint32_t addr = (uint32_t)__cvta_generic_to_shared(row_shared);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

/* The .shared window address of p, a pointer into shared memory. */
__device__ __forceinline__ uint32_t moe_shared_address(const void *p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

/* Hopper's warpgroup MMA (wgmma), in sm_90a code only: the kernels that
 * use it run where the context says the device and the build have it, so
 * elsewhere these trap rather than compile to something else. Every thread
 * of the warpgroup (4 consecutive warps) calls each. */
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MOE_SM90A_ASM(...) asm volatile(__VA_ARGS__)
#else
#define MOE_SM90A_ASM(...) __trap()
#endif

/* Makes this thread's shared-memory writes (stores, landed cp.async)
 * visible to the async proxy through which wgmma reads its operands. */
__device__ __forceinline__ void moe_fence_proxy_async() {
    MOE_SM90A_ASM("fence.proxy.async.shared::cta;\n" ::: "memory");
}

/* Orders this thread's accesses to accumulator registers before the
 * wgmma that follows. */
__device__ __forceinline__ void moe_wgmma_fence() {
    MOE_SM90A_ASM("wgmma.fence.sync.aligned;\n" ::: "memory");
}

/* Closes the group of wgmma issued since the last commit. */
__device__ __forceinline__ void moe_wgmma_commit() {
    MOE_SM90A_ASM("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

/* Waits until at most N committed groups are still running. */
template <int N> __device__ __forceinline__ void moe_wgmma_wait() {
    MOE_SM90A_ASM("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

/* Keeps the compiler from moving accesses to d [n] across the wait before
 * it: the registers change under it without its knowing. */
__device__ __forceinline__ void moe_wgmma_fence_operands(float *d, int n) {
    for (int i = 0; i < n; i++) asm volatile("" : "+f"(d[i])::"memory");
}

/* d [64 x 256] (+)= A [64 x 16] B [16 x 256]^T, bf16 in shared memory
 * through the descriptors desc_a and desc_b (both K-major), fp32 sums;
 * scale_d 0 drops d's old value. Thread t of the warpgroup holds rows
 * 16 (t / 32) + (t % 32) / 4 (+ 8) in the layout of mma.sync's 16 x 8
 * accumulator, d[4j .. 4j + 3] for columns 8j .. 8j + 7. Asynchronous:
 * d is valid after moe_wgmma_commit and a moe_wgmma_wait that covers it. */
#define D8(i)                                                                                      \
    "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]),    \
        "+f"(d[i + 6]), "+f"(d[i + 7])
__device__ __forceinline__ void moe_wgmma_m64n256k16(float *d, uint64_t desc_a, uint64_t desc_b,
                                                     int scale_d) {
    MOE_SM90A_ASM("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
                  "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
                  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
                  "%12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, "
                  "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "
                  "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
                  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, "
                  "%60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, "
                  "%72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, "
                  "%84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
                  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, "
                  "%108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, "
                  "%120, %121, %122, %123, %124, %125, %126, %127"
                  "}, %128, %129, p, 1, 1, 0, 0;\n}\n"
                  : D8(0), D8(8), D8(16), D8(24), D8(32), D8(40), D8(48), D8(56),
                    D8(64), D8(72), D8(80), D8(88), D8(96), D8(104), D8(112), D8(120)
                  : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}
#undef D8

/* mbarriers in shared memory (sm_90a here: the TMA kernel alone uses
 * them). A phase completes when its pending arrivals and its expected
 * transaction bytes have both come to zero; then the phase bit flips. */
__device__ __forceinline__ void moe_mbarrier_init(uint64_t *bar, int count) {
    MOE_SM90A_ASM("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(moe_shared_address(bar)),
                  "r"(count)
                  : "memory");
}

/* Makes the barriers just initialised visible to the async proxy (TMA). */
__device__ __forceinline__ void moe_fence_mbarrier_init() {
    MOE_SM90A_ASM("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

__device__ __forceinline__ void moe_mbarrier_arrive(uint64_t *bar) {
    MOE_SM90A_ASM("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(moe_shared_address(bar))
                  : "memory");
}

/* Arrives, and adds bytes to what the phase waits to see land. */
__device__ __forceinline__ void moe_mbarrier_arrive_expect_tx(uint64_t *bar, uint32_t bytes) {
    MOE_SM90A_ASM("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(
                      moe_shared_address(bar)),
                  "r"(bytes)
                  : "memory");
}

/* Returns once the phase of this parity has completed. */
__device__ __forceinline__ void moe_mbarrier_wait(uint64_t *bar, int parity) {
    MOE_SM90A_ASM("{\n.reg .pred done;\nWAIT:\n"
                  "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                  "@!done bra WAIT;\n}\n" ::"r"(moe_shared_address(bar)),
                  "r"(parity)
                  : "memory");
}

/* The box of map at element coordinates (c0 inner, c1 outer) into shared
 * memory at dst, by the copy engine, its bytes completing on bar. */
__device__ __forceinline__ void moe_tma_load_2d(void *dst, const CUtensorMap *map, int c0, int c1,
                                                uint64_t *bar) {
    MOE_SM90A_ASM("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes "
                  "[%0], [%1, {%3, %4}], [%2];\n" ::"r"(moe_shared_address(dst)),
                  "l"((uint64_t)(uintptr_t)map), "r"(moe_shared_address(bar)), "r"(c0), "r"(c1)
                  : "memory");
}

/* The warpgroup's registers per thread, lowered or raised to N. */
template <int N> __device__ __forceinline__ void moe_setmaxnreg_dec() {
    MOE_SM90A_ASM("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N> __device__ __forceinline__ void moe_setmaxnreg_inc() {
    MOE_SM90A_ASM("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

/* Exclusive prefix sum over a block (size a multiple of 32) of one value
 * per thread, in thread order; *total gets the block's sum. Integers here,
 * so the result is exact. Ends with a barrier. */
template <typename T> __device__ T moe_block_exclusive_scan(T v, T *total) {
    __shared__ T warp_sums[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    T incl = v;
    for (int o = 1; o < 32; o <<= 1) {
        const T up = __shfl_up_sync(MOE_FULL_MASK, incl, o);
        if (lane >= o) incl += up;
    }
    if (lane == 31) warp_sums[warp] = incl;
    __syncthreads();
    T before = 0, all = 0;
    for (int w = 0; w < n_warps; w++) {
        if (w < warp) before += warp_sums[w];
        all += warp_sums[w];
    }
    __syncthreads();
    *total = all;
    return before + incl - v;
}

__device__ __forceinline__ float moe_to_float(float v) { return v; }
__device__ __forceinline__ float moe_to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T moe_from_float(float v);
template <> __device__ __forceinline__ float moe_from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 moe_from_float<__nv_bfloat16>(float v) {
    return __float2bfloat16_rn(v);
}

static inline cudaDataType_t moe_cuda_data_type(moe_cuda_dtype t) {
    return t == MOE_CUDA_BF16 ? CUDA_R_16BF : CUDA_R_32F;
}

#endif /* MOE_KERNELS_CUDA_COMMON_CUH */
