/* context.cu: finding a device, the context (stream, cuBLAS handles,
 * workspace, scratch), device arenas, copies and fills. */
#include <stdio.h>
#include <string.h>

#include "common/rng.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/gemm.cuh"

/* ------------------------------------------------------------------ checks */

/* __FILE__ is the full path; from kernels/ on is what a reader needs. */
static const char *short_path(const char *file) {
    const char *s = strstr(file, "kernels/");
    return s ? s : file;
}

moe_status moe_cuda_report(cudaError_t err, const char *call, const char *file, int line) {
    /* A failed call also leaves its error as the thread's last one, which
     * the next launch's check would report again as its own. */
    (void)cudaGetLastError();
    moe_status st = MOE_ERR_INTERNAL;
    if (err == cudaErrorMemoryAllocation)
        st = MOE_ERR_OUT_OF_MEMORY;
    else if (err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver ||
             err == cudaErrorNoKernelImageForDevice || err == cudaErrorUnsupportedPtxVersion ||
             err == cudaErrorDevicesUnavailable)
        st = MOE_ERR_UNSUPPORTED;
    return moe_error(st, "%s failed at %s:%d: %s: %s", call, short_path(file), line,
                     cudaGetErrorName(err), cudaGetErrorString(err));
}

moe_status moe_cuda_report(cublasStatus_t err, const char *call, const char *file, int line) {
    moe_status st = MOE_ERR_INTERNAL;
    if (err == CUBLAS_STATUS_ALLOC_FAILED)
        st = MOE_ERR_OUT_OF_MEMORY;
    else if (err == CUBLAS_STATUS_NOT_SUPPORTED || err == CUBLAS_STATUS_ARCH_MISMATCH)
        st = MOE_ERR_UNSUPPORTED;
    return moe_error(st, "%s failed at %s:%d: %s: %s", call, short_path(file), line,
                     cublasGetStatusName(err), cublasGetStatusString(err));
}

/* ------------------------------------------------------------------ device */

/* The mma.sync bf16 kernels and cuBLASLt's bf16 paths need sm_80. */
#define MIN_CC_MAJOR 8

/* How many of the n devices are of sm_80 or newer, the first max of them
 * in list [max]; why names the first (its name) or, when there is none,
 * says why the last one checked is not. */
static int usable_devices(int n, int *list, int max, char *why, size_t why_bytes) {
    int count = 0;
    for (int d = 0; d < n; d++) {
        cudaDeviceProp prop;
        if (cudaGetDeviceProperties(&prop, d) != cudaSuccess) {
            const cudaError_t err = cudaGetLastError(); /* which clears it */
            if (count == 0) snprintf(why, why_bytes, "device %d does not answer (%s)", d, cudaGetErrorString(err));
            continue;
        }
        if (prop.major < MIN_CC_MAJOR) {
            if (count == 0)
                snprintf(why, why_bytes, "device %d (%s) is sm_%d%d; these kernels need sm_%d0 or newer",
                         d, prop.name, prop.major, prop.minor, MIN_CC_MAJOR);
            continue;
        }
        if (count == 0) snprintf(why, why_bytes, "%s", prop.name);
        if (count < max) list[count] = d;
        count++;
    }
    return count;
}

static int first_usable_device(int n, char *why, size_t why_bytes) {
    int first = -1;
    return usable_devices(n, &first, 1, why, why_bytes) > 0 ? first : -1;
}

extern "C" bool moe_cuda_available(char *why, size_t why_bytes) {
    char scratch[8];
    if (!why || why_bytes == 0) why = scratch, why_bytes = sizeof scratch;
    int driver = 0, runtime = 0, n = 0;
    if (cudaDriverGetVersion(&driver) != cudaSuccess || driver == 0) {
        snprintf(why, why_bytes, "no NVIDIA driver (libcuda.so.1 not found)");
        return false;
    }
    cudaRuntimeGetVersion(&runtime);
    /* A driver of the same major version runs this build (CUDA's minor
     * version compatibility: the machine code for sm_80 and sm_90 is in
     * it, so nothing needs the newer driver's PTX compiler). */
    if (driver / 1000 < runtime / 1000) {
        snprintf(why, why_bytes,
                 "the NVIDIA driver supports CUDA %d.%d, older than this build's runtime %d.%d",
                 driver / 1000, driver % 1000 / 10, runtime / 1000, runtime % 1000 / 10);
        return false;
    }
    cudaError_t err = cudaGetDeviceCount(&n);
    if (err != cudaSuccess || n == 0) {
        snprintf(why, why_bytes, "no CUDA device (%s)",
                 err != cudaSuccess ? cudaGetErrorString(err) : "the driver reports none");
        (void)cudaGetLastError(); /* not sticky: leave no error behind */
        return false;
    }
    /* Usable when one device is: each rank's context checks its own. */
    return first_usable_device(n, why, why_bytes) >= 0;
}

/* ----------------------------------------------------------------- context */

static moe_status ctx_init(moe_cuda_ctx *c, int device, cudaStream_t stream) {
    if (device < 0) {
        /* The first device of sm_80 or newer, which moe_cuda_available found. */
        int n = 0;
        if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
        char why[256];
        device = first_usable_device(n, why, sizeof why);
        (void)cudaGetLastError();
        if (device < 0) device = 0;
    }
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
    if (device >= count)
        return moe_error(MOE_ERR_INVALID_ARG, "CUDA device %d: this process sees %d device%s", device, count,
                         count == 1 ? "" : "s");
    c->device = device;
    MOE_CUDA_CHECK(cudaSetDevice(c->device));
    cudaDeviceProp prop;
    MOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, c->device));
    if (prop.major < MIN_CC_MAJOR)
        return moe_error(MOE_ERR_UNSUPPORTED,
                         "CUDA device %d (%s) is sm_%d%d; need sm_%d0 or newer", c->device,
                         prop.name, prop.major, prop.minor, MIN_CC_MAJOR);
    c->sm_count = prop.multiProcessorCount;
    c->cc_major = prop.major;
    c->cc_minor = prop.minor;
    c->smem_optin_bytes = prop.sharedMemPerBlockOptin;
    snprintf(c->name, sizeof c->name, "%s (sm_%d%d, %d SMs)", prop.name, prop.major, prop.minor,
             prop.multiProcessorCount);

    if (stream) {
        c->stream = stream;
    } else {
        MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking));
        c->own_stream = true;
    }
    MOE_CUDA_CHECK(cudaMalloc(&c->workspace, MOE_CUDA_WORKSPACE_BYTES));
    MOE_CUDA_CHECK(cudaMalloc((void **)&c->ptrs, MOE_CUDA_PTR_SLOTS * sizeof(void *)));
    MOE_CUDA_CHECK(cudaMallocHost((void **)&c->host_ptrs, MOE_CUDA_PTR_SLOTS * sizeof(void *)));
    MOE_CUDA_CHECK(
        cudaMallocHost((void **)&c->host_counts, (MOE_EXPERTS_MAX + 1) * sizeof(int64_t)));
    MOE_CUDA_CHECK(cudaMalloc((void **)&c->tile_offsets, (MOE_EXPERTS_MAX + 1) * sizeof(int32_t)));
    MOE_CUDA_CHECK(cudaMalloc((void **)&c->sumsq_parts, MOE_CUDA_SUMSQ_PARTS * sizeof(double)));
    MOE_CUDA_CHECK(cudaMallocHost((void **)&c->staging,
                                  MOE_CUDA_STAGING_SLOTS * MOE_CUDA_STAGING_SLOT_BYTES));
    for (int s = 0; s < MOE_CUDA_STAGING_SLOTS; s++)
        MOE_CUDA_CHECK(cudaEventCreateWithFlags(&c->staging_done[s], cudaEventDisableTiming));

    MOE_CUDA_CHECK(cublasLtCreate(&c->lt));
    MOE_CUDA_CHECK(cublasCreate(&c->blas));
    MOE_CUDA_CHECK(cublasSetStream(c->blas, c->stream));
    /* Both libraries run on the one stream, so they can share the workspace. */
    MOE_CUDA_CHECK(cublasSetWorkspace(c->blas, c->workspace, MOE_CUDA_WORKSPACE_BYTES));
    return MOE_OK;
}

extern "C" moe_status moe_cuda_ctx_create(moe_cuda_ctx **ctx, int device) {
    return moe_cuda_ctx_create_on(ctx, device, NULL);
}

extern "C" moe_status moe_cuda_ctx_create_on(moe_cuda_ctx **ctx, int device, void *stream) {
    if (!ctx) return moe_error(MOE_ERR_INVALID_ARG, "moe_cuda_ctx_create: ctx is NULL");
    *ctx = NULL;
    char why[256];
    if (!moe_cuda_available(why, sizeof why))
        return moe_error(MOE_ERR_UNSUPPORTED, "no usable CUDA device: %s", why);
    moe_cuda_ctx *c = (moe_cuda_ctx *)calloc(1, sizeof *c);
    if (!c) return moe_error(MOE_ERR_OUT_OF_MEMORY, "moe_cuda_ctx_create: out of host memory");
    moe_status st = ctx_init(c, device, (cudaStream_t)stream);
    if (st != MOE_OK) {
        (void)cudaGetLastError(); /* so that the next launch check does not report this failure */
        moe_cuda_ctx_destroy(c);
        return st;
    }
    *ctx = c;
    return MOE_OK;
}

extern "C" void moe_cuda_ctx_destroy(moe_cuda_ctx *c) {
    if (!c) return;
    /* Statuses are ignored from here on: there is nobody left to tell. */
    if (c->stream) cudaStreamSynchronize(c->stream);
    if (c->blas) cublasDestroy(c->blas);
    if (c->lt) cublasLtDestroy(c->lt);
    cudaFree(c->sumsq_parts);
    for (int i = 0; i < MOE_CUDA_SCRATCHES; i++) cudaFree(c->scratch[i]);
    for (int s = 0; s < MOE_CUDA_STAGING_SLOTS; s++)
        if (c->staging_done[s]) cudaEventDestroy(c->staging_done[s]);
    cudaFreeHost(c->staging);
    cudaFree(c->tile_offsets);
    cudaFreeHost(c->host_counts);
    cudaFreeHost(c->host_ptrs);
    cudaFree(c->ptrs);
    cudaFree(c->workspace);
    if (c->stream && c->own_stream) cudaStreamDestroy(c->stream);
    free(c);
}

extern "C" const char *moe_cuda_device_name(const moe_cuda_ctx *ctx) { return ctx->name; }

extern "C" void *moe_cuda_stream(const moe_cuda_ctx *ctx) { return (void *)ctx->stream; }

extern "C" void moe_cuda_set_math(moe_cuda_ctx *ctx, moe_cuda_math math) { ctx->math = math; }

extern "C" void moe_cuda_set_attention_path(moe_cuda_ctx *ctx, moe_cuda_attention_path path) {
    ctx->attention_path = path;
}

extern "C" moe_status moe_cuda_pci_bus_id(char *out, size_t out_bytes, const moe_cuda_ctx *ctx) {
    if (out_bytes > INT32_MAX) out_bytes = INT32_MAX;
    MOE_CUDA_CHECK(cudaDeviceGetPCIBusId(out, (int)out_bytes, ctx->device));
    /* hwloc and sysfs spell hex digits in lower case. */
    for (char *c = out; *c; c++)
        if (*c >= 'A' && *c <= 'F') *c = (char)(*c - 'A' + 'a');
    return MOE_OK;
}

extern "C" int moe_cuda_usable_devices(int *devices, int max) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    char why[256];
    return usable_devices(n, devices, max, why, sizeof why);
}

extern "C" moe_status moe_cuda_sync(moe_cuda_ctx *ctx) {
    MOE_CUDA_CHECK(cudaStreamSynchronize(ctx->stream));
    MOE_CUDA_CHECK(cudaGetLastError());
    return MOE_OK;
}

/* ------------------------------------------------------------------ arenas */

static size_t align_up(size_t bytes) {
    return (bytes + MOE_CUDA_ARENA_ALIGN_BYTES - 1) / MOE_CUDA_ARENA_ALIGN_BYTES *
           MOE_CUDA_ARENA_ALIGN_BYTES;
}

extern "C" size_t moe_cuda_arena_bytes(const size_t *piece_bytes, int n_pieces) {
    size_t total = 0;
    for (int i = 0; i < n_pieces; i++) total += align_up(piece_bytes[i]);
    return total;
}

moe_status moe_cuda_malloc(void **out, size_t bytes, const char *what, const moe_cuda_ctx *ctx) {
    *out = NULL;
    cudaError_t err = cudaMalloc(out, bytes ? bytes : 1);
    if (err == cudaSuccess) return MOE_OK;
    (void)cudaGetLastError();
    *out = NULL;
    size_t free_bytes = 0, total_bytes = 0;
    cudaMemGetInfo(&free_bytes, &total_bytes);
    /* Past the device's whole memory no retry helps: a setting at fault, as
     * the CPU backend tells it apart. */
    const bool oom = err == cudaErrorMemoryAllocation, never = oom && total_bytes > 0 && bytes > total_bytes;
    return moe_error(never ? MOE_ERR_CONFIG : oom ? MOE_ERR_OUT_OF_MEMORY : MOE_ERR_INTERNAL,
                     "%s of %.3f GiB on %s: cudaMalloc: %s (%.3f of %.3f GiB free%s)", what,
                     (double)bytes / (1 << 30), ctx->name, cudaGetErrorString(err),
                     (double)free_bytes / (1 << 30), (double)total_bytes / (1 << 30),
                     never ? ": more than the device has" : "");
}

moe_status moe_cuda_scratch(void **out, size_t bytes, moe_cuda_scratch_use use, moe_cuda_ctx *ctx) {
    static const char *const what[MOE_CUDA_SCRATCHES] = {"embedding backward sort scratch",
                                                          "expert groups' bf16 scratch"};
    if (bytes > ctx->scratch_bytes[use]) {
        /* By half again at least: sizes that creep up with the routing
         * (the expert groups' rows) regrow a few times, not every step. */
        const size_t grown = ctx->scratch_bytes[use] + ctx->scratch_bytes[use] / 2;
        if (bytes < grown) bytes = grown;
        MOE_CUDA_CHECK(cudaStreamSynchronize(ctx->stream));
        MOE_CUDA_CHECK(cudaFree(ctx->scratch[use]));
        ctx->scratch[use] = NULL;
        ctx->scratch_bytes[use] = 0;
        MOE_TRY(moe_cuda_malloc(&ctx->scratch[use], bytes, what[use], ctx));
        ctx->scratch_bytes[use] = bytes;
    }
    *out = ctx->scratch[use];
    return MOE_OK;
}

extern "C" moe_status moe_cuda_arena_create(moe_cuda_arena *arena, size_t capacity,
                                            moe_cuda_ctx *ctx) {
    *arena = (moe_cuda_arena){NULL, 0, 0};
    MOE_CUDA_CHECK(cudaSetDevice(ctx->device));
    void *base = NULL;
    MOE_TRY(moe_cuda_malloc(&base, capacity, "device arena", ctx));
    arena->base = (char *)base;
    arena->capacity = capacity;
    return MOE_OK;
}

extern "C" moe_status moe_cuda_arena_alloc(moe_cuda_arena *arena, void **out, size_t bytes) {
    *out = NULL;
    size_t need = align_up(bytes);
    if (need < bytes || need > arena->capacity - arena->used)
        return moe_error(MOE_ERR_OUT_OF_MEMORY,
                         "device arena: %zu bytes asked with %zu of %zu bytes left", bytes,
                         arena->capacity - arena->used, arena->capacity);
    *out = arena->base + arena->used;
    arena->used += need;
    return MOE_OK;
}

extern "C" void moe_cuda_arena_reset(moe_cuda_arena *arena) { arena->used = 0; }

extern "C" void moe_cuda_arena_destroy(moe_cuda_arena *arena) {
    cudaFree(arena->base);
    *arena = (moe_cuda_arena){NULL, 0, 0};
}

/* ------------------------------------------------------------------ copies */

extern "C" moe_status moe_cuda_upload(void *dst, const void *src, size_t bytes, moe_cuda_ctx *ctx) {
    if (bytes == 0) return MOE_OK;
    if (bytes <= MOE_CUDA_STAGING_SLOT_BYTES) {
        /* The slots in turn; a slot is written again once its last copy is
         * done, which with 16 of them has long happened. */
        const int s = ctx->next_staging;
        char *slot = ctx->staging + (size_t)s * MOE_CUDA_STAGING_SLOT_BYTES;
        MOE_CUDA_CHECK(cudaEventSynchronize(ctx->staging_done[s]));
        memcpy(slot, src, bytes);
        MOE_CUDA_CHECK(cudaMemcpyAsync(dst, slot, bytes, cudaMemcpyHostToDevice, ctx->stream));
        MOE_CUDA_CHECK(cudaEventRecord(ctx->staging_done[s], ctx->stream));
        /* Only a slot whose event follows its copy is passed over. */
        ctx->next_staging = (s + 1) % MOE_CUDA_STAGING_SLOTS;
        return MOE_OK;
    }
    MOE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, ctx->stream));
    MOE_CUDA_CHECK(cudaStreamSynchronize(ctx->stream));
    return MOE_OK;
}

extern "C" moe_status moe_cuda_download(void *dst, const void *src, size_t bytes,
                                        moe_cuda_ctx *ctx) {
    if (bytes == 0) return MOE_OK;
    MOE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, ctx->stream));
    MOE_CUDA_CHECK(cudaStreamSynchronize(ctx->stream));
    return MOE_OK;
}

extern "C" moe_status moe_cuda_memset(void *dst, int byte, size_t bytes, moe_cuda_ctx *ctx) {
    if (bytes == 0) return MOE_OK;
    MOE_CUDA_CHECK(cudaMemsetAsync(dst, byte, bytes, ctx->stream));
    return MOE_OK;
}

extern "C" size_t moe_cuda_dtype_bytes(moe_cuda_dtype t) { return t == MOE_CUDA_BF16 ? 2 : 4; }

/* ------------------------------------------------------------------- fills */

/* splitmix64 of (seed, i): any element from its index alone, so the fill
 * is the same for every grid shape. */
template <typename T>
static __global__ void fill_uniform_kernel(T *p, int64_t n, float scale, uint64_t seed) {
    const uint64_t key = moe_splitmix64(seed);
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        float u = (float)(moe_splitmix64(key + (uint64_t)i) >> 40) * (1.0f / 16777216.0f); /* [0, 1) */
        p[i] = moe_from_float<T>(scale * (2.0f * u - 1.0f));
    }
}

extern "C" moe_status moe_cuda_fill_uniform(void *p, int64_t n, moe_cuda_dtype t, float scale,
                                            uint64_t seed, moe_cuda_ctx *ctx) {
    if (n <= 0) return MOE_OK;
    unsigned grid = moe_cuda_grid(n, MOE_CUDA_THREADS, ctx);
    if (t == MOE_CUDA_BF16)
        fill_uniform_kernel<<<grid, MOE_CUDA_THREADS, 0, ctx->stream>>>((__nv_bfloat16 *)p, n,
                                                                        scale, seed);
    else
        fill_uniform_kernel<<<grid, MOE_CUDA_THREADS, 0, ctx->stream>>>((float *)p, n, scale, seed);
    MOE_CUDA_CHECK(cudaGetLastError());
    return MOE_OK;
}

template <typename D, typename S>
static __global__ void convert_kernel(D *dst, const S *src, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        dst[i] = moe_from_float<D>(moe_to_float(src[i]));
}

extern "C" moe_status moe_cuda_f32_to_bf16(void *dst, const float *src, int64_t n,
                                           moe_cuda_ctx *ctx) {
    if (n <= 0) return MOE_OK;
    convert_kernel<<<moe_cuda_grid(n, MOE_CUDA_THREADS, ctx), MOE_CUDA_THREADS, 0, ctx->stream>>>(
        (__nv_bfloat16 *)dst, src, n);
    MOE_CUDA_CHECK(cudaGetLastError());
    return MOE_OK;
}

extern "C" moe_status moe_cuda_bf16_to_f32(float *dst, const void *src, int64_t n,
                                           moe_cuda_ctx *ctx) {
    if (n <= 0) return MOE_OK;
    convert_kernel<<<moe_cuda_grid(n, MOE_CUDA_THREADS, ctx), MOE_CUDA_THREADS, 0, ctx->stream>>>(
        dst, (const __nv_bfloat16 *)src, n);
    MOE_CUDA_CHECK(cudaGetLastError());
    return MOE_OK;
}
