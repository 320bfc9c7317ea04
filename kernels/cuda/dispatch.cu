/* dispatch.cu: the dispatch plan on the device, and moving rows between
 * token order and expert order (kernels/cpu/dispatch.c is the reference).
 *
 * The plan is a stable counting sort of the T*k (token, slot) pairs by
 * expert in four launches, none of which waits for the host:
 *   count   one warp per chunk of PLAN_CHUNK_PAIRS pairs counts its experts;
 *   scan    one block per expert turns the chunk counts into each chunk's
 *           first rank within the expert (exclusive scan over chunks);
 *   offsets one block scans the kept counts into expert_offsets [E+1];
 *   place   each warp walks its chunk in order, 32 pairs at a time, and
 *           ranks equal experts among the lanes with __match_any_sync.
 * A pair's rank within its expert is the number of earlier pairs (token,
 * then slot order) of that expert, from integer counts alone: the same
 * plan as moe_plan_build, whatever order the blocks run in.
 *
 * The row movers run over destination rows with one block per row (or
 * token), so no two threads write one element and every sum over slots
 * runs in slot order: deterministic. */
#include "kernels/cuda/common.cuh"

#define PLAN_CHUNK_PAIRS 256
#define PLAN_WARPS 8 /* chunks per block; E ints each in shared memory */
#define ROW_THREADS 128

/* ------------------------------------------------------------------- plan */

static int64_t plan_chunks(int64_t T, int64_t k) {
    return (T * k + PLAN_CHUNK_PAIRS - 1) / PLAN_CHUNK_PAIRS;
}

/* scratch: int32 chunk_rank [n_chunks, E], then int64 total [E]. */
static size_t plan_rank_bytes(int64_t T, int64_t k, int64_t E) {
    size_t bytes = (size_t)plan_chunks(T, k) * (size_t)E * sizeof(int32_t);
    return (bytes + 255) / 256 * 256;
}

extern "C" size_t moe_cuda_plan_scratch_bytes(int64_t T, int64_t k, int64_t E) {
    return plan_rank_bytes(T, k, E) + (size_t)E * sizeof(int64_t);
}

static __global__ void plan_count_kernel(int32_t *chunk_rank, const int32_t *topk_idx,
                                         int64_t n_pairs, int64_t n_chunks, int E) {
    extern __shared__ int plan_shared[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int *count = plan_shared + warp * E; /* [E] */
    const int64_t c = blockIdx.x * (int64_t)PLAN_WARPS + warp;
    if (c >= n_chunks) return;
    for (int e = lane; e < E; e += 32) count[e] = 0;
    __syncwarp();
    const int64_t p1 = min((c + 1) * PLAN_CHUNK_PAIRS, n_pairs);
    for (int64_t p = c * PLAN_CHUNK_PAIRS + lane; p < p1; p += 32)
        atomicAdd(&count[topk_idx[p]], 1);
    __syncwarp();
    for (int e = lane; e < E; e += 32) chunk_rank[c * E + e] = count[e];
}

/* One block per expert: chunk c's count becomes the number of the
 * expert's pairs in chunks before c; total[e] is the expert's count. */
static __global__ void plan_scan_kernel(int32_t *chunk_rank, int64_t *total, int64_t n_chunks,
                                        int E) {
    const int e = blockIdx.x;
    const int64_t per = (n_chunks + blockDim.x - 1) / blockDim.x;
    const int64_t c0 = min((int64_t)threadIdx.x * per, n_chunks), c1 = min(c0 + per, n_chunks);
    int64_t mine = 0;
    for (int64_t c = c0; c < c1; c++) mine += chunk_rank[c * E + e];
    int64_t all = 0;
    int64_t run = moe_block_exclusive_scan(mine, &all);
    for (int64_t c = c0; c < c1; c++) {
        const int32_t n = chunk_rank[c * E + e];
        chunk_rank[c * E + e] = (int32_t)run;
        run += n;
    }
    if (threadIdx.x == 0) total[e] = all;
}

/* One block: offsets[e] = sum of keep[e'] for e' < e (keep NULL: the
 * totals, dropless). */
static __global__ void plan_offsets_kernel(int64_t *offsets, const int64_t *keep,
                                           const int64_t *total, int E) {
    const int64_t per = (E + blockDim.x - 1) / blockDim.x;
    const int64_t e0 = min((int64_t)threadIdx.x * per, (int64_t)E), e1 = min(e0 + per, (int64_t)E);
    int64_t mine = 0;
    for (int64_t e = e0; e < e1; e++) mine += keep ? keep[e] : total[e];
    int64_t all = 0;
    int64_t run = moe_block_exclusive_scan(mine, &all);
    for (int64_t e = e0; e < e1; e++) {
        offsets[e] = run;
        run += keep ? keep[e] : total[e];
    }
    if (threadIdx.x == 0) offsets[E] = all;
}

static __global__ void plan_place_kernel(int64_t *pair_row, int64_t *row_token,
                                         const int32_t *chunk_rank, const int64_t *offsets,
                                         const int64_t *keep, const int32_t *topk_idx,
                                         int64_t n_pairs, int64_t n_chunks, int k, int E) {
    extern __shared__ int plan_shared[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int *rank = plan_shared + warp * E; /* [E] next rank of each expert */
    const int64_t c = blockIdx.x * (int64_t)PLAN_WARPS + warp;
    if (c >= n_chunks) return;
    for (int e = lane; e < E; e += 32) rank[e] = chunk_rank[c * E + e];
    __syncwarp();
    const unsigned lanes_below = (1u << lane) - 1u;
    const int64_t p1 = min((c + 1) * PLAN_CHUNK_PAIRS, n_pairs);
    for (int64_t p0 = c * PLAN_CHUNK_PAIRS; p0 < p1; p0 += 32) {
        const int64_t p = p0 + lane;
        const unsigned active = __ballot_sync(MOE_FULL_MASK, p < p1);
        if (p < p1) {
            const int e = topk_idx[p];
            const unsigned peers = __match_any_sync(active, e);
            const int64_t r = rank[e] + __popc(peers & lanes_below);
            __syncwarp(active); /* every peer has read rank[e] */
            if ((peers & lanes_below) == 0) rank[e] += __popc(peers);
            const int64_t kept = keep ? keep[e] : INT64_MAX;
            if (r < kept) {
                const int64_t row = offsets[e] + r;
                pair_row[p] = row;
                row_token[row] = p / k;
            } else {
                pair_row[p] = -1;
            }
        }
        __syncwarp();
    }
}

extern "C" moe_status moe_cuda_plan_build(int64_t *pair_row, int64_t *row_token,
                                          int64_t *expert_offsets, const int32_t *topk_idx,
                                          const int64_t *keep, void *scratch, int64_t T, int64_t k,
                                          int64_t E, moe_cuda_ctx *ctx) {
    if (E < 1 || E > MOE_EXPERTS_MAX || k < 1 || k > E || T < 0)
        return moe_error(MOE_ERR_INVALID_ARG, "moe_cuda_plan_build: E=%lld k=%lld T=%lld",
                         (long long)E, (long long)k, (long long)T);
    if (T * k > INT32_MAX) /* ranks are int32 in the scratch */
        return moe_error(MOE_ERR_UNSUPPORTED, "moe_cuda_plan_build: T*k=%lld pairs exceeds %d",
                         (long long)(T * k), INT32_MAX);
    const int64_t n_pairs = T * k, n_chunks = plan_chunks(T, k);
    int32_t *chunk_rank = (int32_t *)scratch;
    int64_t *total = (int64_t *)((char *)scratch + plan_rank_bytes(T, k, E));
    const unsigned blocks = (unsigned)((n_chunks + PLAN_WARPS - 1) / PLAN_WARPS);
    const size_t smem = (size_t)PLAN_WARPS * (size_t)E * sizeof(int);
    if (n_chunks > 0) {
        plan_count_kernel<<<blocks, PLAN_WARPS * 32, smem, ctx->stream>>>(
            chunk_rank, topk_idx, n_pairs, n_chunks, (int)E);
        MOE_CUDA_CHECK(cudaGetLastError());
    }
    plan_scan_kernel<<<(unsigned)E, MOE_CUDA_THREADS, 0, ctx->stream>>>(chunk_rank, total, n_chunks,
                                                                        (int)E);
    MOE_CUDA_CHECK(cudaGetLastError());
    plan_offsets_kernel<<<1, MOE_CUDA_THREADS, 0, ctx->stream>>>(expert_offsets, keep, total,
                                                                 (int)E);
    MOE_CUDA_CHECK(cudaGetLastError());
    if (n_chunks > 0) {
        plan_place_kernel<<<blocks, PLAN_WARPS * 32, smem, ctx->stream>>>(
            pair_row, row_token, chunk_rank, expert_offsets, keep, topk_idx, n_pairs, n_chunks,
            (int)k, (int)E);
        MOE_CUDA_CHECK(cudaGetLastError());
    }
    return MOE_OK;
}

/* ------------------------------------------------------------ row movers */

/* Rows move as float4 when d and the base pointers allow it. */
static bool vec4_ok(int64_t d, const void *a, const void *b) {
    return d % 4 == 0 && (uintptr_t)a % 16 == 0 && (uintptr_t)b % 16 == 0;
}

template <typename V>
static __global__ void permute_kernel(V *xp, const V *x, const int64_t *row_token,
                                      const int64_t *n_rows, int64_t max_rows, int64_t dv) {
    const int64_t rows = n_rows ? min(*n_rows, max_rows) : max_rows;
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const V *src = x + row_token[r] * dv;
        V *dst = xp + r * dv;
        for (int64_t i = threadIdx.x; i < dv; i += blockDim.x) dst[i] = src[i];
    }
}

extern "C" moe_status moe_cuda_permute(float *xp, const float *x, const int64_t *row_token,
                                       const int64_t *n_rows, int64_t max_rows, int64_t d,
                                       moe_cuda_ctx *ctx) {
    if (max_rows <= 0 || d <= 0) return MOE_OK;
    const unsigned grid = moe_cuda_grid(max_rows, 1, ctx);
    if (vec4_ok(d, xp, x))
        permute_kernel<<<grid, ROW_THREADS, 0, ctx->stream>>>((float4 *)xp, (const float4 *)x,
                                                              row_token, n_rows, max_rows, d / 4);
    else
        permute_kernel<<<grid, ROW_THREADS, 0, ctx->stream>>>(xp, x, row_token, n_rows, max_rows,
                                                              d);
    MOE_CUDA_CHECK(cudaGetLastError());
    return MOE_OK;
}

static __global__ void combine_kernel(float *y, const float *yp, const float *topk_w,
                                      const int64_t *pair_row, const float *shared, int64_t T,
                                      int64_t k, int64_t d) {
    for (int64_t t = blockIdx.x; t < T; t += gridDim.x)
        for (int64_t i = threadIdx.x; i < d; i += blockDim.x) {
            float out = shared ? shared[t * d + i] : 0.0f;
            for (int64_t j = 0; j < k; j++) {
                const int64_t r = pair_row[t * k + j];
                if (r >= 0) out += topk_w[t * k + j] * yp[r * d + i];
            }
            y[t * d + i] = out;
        }
}

extern "C" moe_status moe_cuda_combine(float *y, const float *yp, const float *topk_w,
                                       const int64_t *pair_row, const float *shared, int64_t T,
                                       int64_t k, int64_t d, moe_cuda_ctx *ctx) {
    if (T <= 0 || d <= 0) return MOE_OK;
    combine_kernel<<<moe_cuda_grid(T, 1, ctx), ROW_THREADS, 0, ctx->stream>>>(
        y, yp, topk_w, pair_row, shared, T, k, d);
    MOE_CUDA_CHECK(cudaGetLastError());
    return MOE_OK;
}

/* One block per token; each slot's dot product is a block sum in a fixed
 * tree order. */
static __global__ void combine_backward_kernel(float *dyp, float *dweights, const float *dy,
                                               const float *yp, const float *topk_w,
                                               const int64_t *pair_row, int64_t T, int64_t k,
                                               int64_t d) {
    __shared__ float partial[32];
    for (int64_t t = blockIdx.x; t < T; t += gridDim.x)
        for (int64_t j = 0; j < k; j++) {
            const int64_t r = pair_row[t * k + j];
            if (r < 0) {
                if (threadIdx.x == 0) dweights[t * k + j] = 0.0f;
                continue;
            }
            const float w = topk_w[t * k + j];
            const float *g = dy + t * d, *src = yp + r * d;
            float *dst = dyp + r * d;
            float dot = 0.0f;
            for (int64_t i = threadIdx.x; i < d; i += blockDim.x) {
                dot += g[i] * src[i];
                dst[i] = w * g[i];
            }
            dot = moe_block_sum(dot, partial);
            if (threadIdx.x == 0) dweights[t * k + j] = dot;
        }
}

extern "C" moe_status moe_cuda_combine_backward(float *dyp, float *dweights, const float *dy,
                                                const float *yp, const float *topk_w,
                                                const int64_t *pair_row, int64_t T, int64_t k,
                                                int64_t d, moe_cuda_ctx *ctx) {
    if (T <= 0) return MOE_OK;
    combine_backward_kernel<<<moe_cuda_grid(T, 1, ctx), ROW_THREADS, 0, ctx->stream>>>(
        dyp, dweights, dy, yp, topk_w, pair_row, T, k, d);
    MOE_CUDA_CHECK(cudaGetLastError());
    return MOE_OK;
}

static __global__ void unpermute_add_kernel(float *dx, const float *dxp, const int64_t *pair_row,
                                            int64_t T, int64_t k, int64_t d) {
    for (int64_t t = blockIdx.x; t < T; t += gridDim.x)
        for (int64_t i = threadIdx.x; i < d; i += blockDim.x) {
            float out = dx[t * d + i];
            for (int64_t j = 0; j < k; j++) {
                const int64_t r = pair_row[t * k + j];
                if (r >= 0) out += dxp[r * d + i];
            }
            dx[t * d + i] = out;
        }
}

extern "C" moe_status moe_cuda_unpermute_add(float *dx, const float *dxp, const int64_t *pair_row,
                                             int64_t T, int64_t k, int64_t d, moe_cuda_ctx *ctx) {
    if (T <= 0 || d <= 0) return MOE_OK;
    unpermute_add_kernel<<<moe_cuda_grid(T, 1, ctx), ROW_THREADS, 0, ctx->stream>>>(
        dx, dxp, pair_row, T, k, d);
    MOE_CUDA_CHECK(cudaGetLastError());
    return MOE_OK;
}
