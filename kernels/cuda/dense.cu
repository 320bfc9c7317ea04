/* dense.cu: the dense ops around the MoE layers (kernels/cpu/dense.c is
 * the reference, kernels/cpu/dense.h the contract): embedding, RMSNorm,
 * linear layers, RoPE, cross-entropy, residual adds, the shared expert's
 * sigmoid gate, AdamW and the sum of squares. Every reduction has a fixed
 * order (block trees, or parts summed in order), never atomics on floats:
 * the same bits on every run. The kernels of RMSNorm, RoPE, cross-entropy
 * and the gate are dense_kernels.cuh's, which tests/test_dense_emulated.cpp
 * also runs on the CPU. */
#include <cub/device/device_radix_sort.cuh>
#include <limits.h>

#include "common/rng.h"
#include "kernels/cuda/gemm.cuh"
#include "kernels/moe_math.h"
/* After its environment: it includes nothing. */
#include "kernels/cuda/dense_kernels.cuh"

static unsigned grid_for(int64_t n, const moe_cuda_ctx *ctx) {
    return moe_cuda_grid(n, MOE_CUDA_THREADS, ctx);
}

/* ---------------------------------------------------------------- embedding */

static __global__ void embedding_forward_kernel(float *out, const int32_t *tokens, const float *wte,
                                                int64_t N, int64_t C) {
    GRID_STRIDE(i, N * C) out[i] = wte[(int64_t)tokens[i / C] * C + i % C];
}

extern "C" moe_status moe_cuda_embedding_forward(float *out, const int32_t *tokens,
                                                 const float *wte, int64_t N, int64_t C,
                                                 moe_cuda_ctx *ctx) {
    if (N * C <= 0) return MOE_OK;
    embedding_forward_kernel<<<grid_for(N * C, ctx), MOE_CUDA_THREADS, 0, ctx->stream>>>(
        out, tokens, wte, N, C);
    MOE_CUDA_CHECK(cudaGetLastError());
    return MOE_OK;
}

/* The backward sums each token's rows in row order, as the CPU does, with
 * no atomics: the rows are sorted by token with CUB's radix sort, which is
 * stable, so each token's rows form one run in row order, and one block per
 * run adds them into its row of dwte in that order. That gives distinct
 * tokens x C threads where walking the rows by column gives C. */
static __global__ void iota_kernel(int32_t *v, int64_t n) {
    GRID_STRIDE(i, n) v[i] = (int32_t)i;
}

static __global__ void embedding_backward_runs_kernel(float *dwte, const float *dout,
                                                      const int32_t *sorted_tokens,
                                                      const int32_t *sorted_rows, int64_t N,
                                                      int64_t C) {
    for (int64_t i = blockIdx.x; i < N; i += gridDim.x) {
        const int32_t v = sorted_tokens[i];
        if (i > 0 && sorted_tokens[i - 1] == v) continue; /* not a run's start: the whole block */
        float *dw = dwte + (int64_t)v * C;
        for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
            float acc = dw[c];
            for (int64_t j = i; j < N && sorted_tokens[j] == v; j++)
                acc += dout[(int64_t)sorted_rows[j] * C + c];
            dw[c] = acc;
        }
    }
}

extern "C" moe_status moe_cuda_embedding_backward(float *dwte, const float *dout,
                                                  const int32_t *tokens, int64_t N, int64_t C,
                                                  moe_cuda_ctx *ctx) {
    if (N <= 0 || C <= 0) return MOE_OK;
    if (N > INT32_MAX)
        return moe_error(MOE_ERR_UNSUPPORTED, "embedding backward of %lld rows: at most %d",
                         (long long)N, INT32_MAX);
    /* Tokens are in [0, V): their 31 low bits order them. */
    const int n = (int)N, end_bit = 31;
    size_t sort_bytes = 0;
    MOE_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(NULL, sort_bytes, (const int32_t *)NULL,
                                                   (int32_t *)NULL, (const int32_t *)NULL,
                                                   (int32_t *)NULL, n, 0, end_bit, ctx->stream));
    const size_t ints = ((size_t)N * sizeof(int32_t) + 255) / 256 * 256; /* 256-aligned pieces */
    char *scratch = NULL;
    MOE_TRY(moe_cuda_scratch((void **)&scratch, 3 * ints + sort_bytes, MOE_CUDA_SCRATCH_SORT, ctx));
    int32_t *rows = (int32_t *)scratch, *sorted_rows = (int32_t *)(scratch + ints);
    int32_t *sorted_tokens = (int32_t *)(scratch + 2 * ints);
    iota_kernel<<<grid_for(N, ctx), MOE_CUDA_THREADS, 0, ctx->stream>>>(rows, N);
    MOE_CUDA_CHECK(cudaGetLastError());
    MOE_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(scratch + 3 * ints, sort_bytes, tokens,
                                                   sorted_tokens, rows, sorted_rows, n, 0, end_bit,
                                                   ctx->stream));
    embedding_backward_runs_kernel<<<moe_cuda_grid(N, 1, ctx), MOE_CUDA_THREADS, 0, ctx->stream>>>(
        dwte, dout, sorted_tokens, sorted_rows, N, C);
    MOE_CUDA_CHECK(cudaGetLastError());
    return MOE_OK;
}

/* ------------------------------------------------------------------ RMSNorm */

extern "C" moe_status moe_cuda_rmsnorm_forward(float *out, float *rstd, const float *inp,
                                               const float *weight, float eps, int64_t N, int64_t C,
                                               moe_cuda_ctx *ctx) {
    if (N <= 0) return MOE_OK;
    rmsnorm_forward_kernel<<<moe_cuda_grid(N, 1, ctx), MOE_CUDA_THREADS, 0, ctx->stream>>>(
        out, rstd, inp, weight, eps, N, C);
    MOE_CUDA_CHECK(cudaGetLastError());
    return MOE_OK;
}

extern "C" size_t moe_cuda_rmsnorm_scratch_bytes(int64_t N, int64_t C) {
    return (size_t)((N + RMS_ROWS_PER_PART - 1) / RMS_ROWS_PER_PART) * (size_t)C * sizeof(double);
}

extern "C" moe_status moe_cuda_rmsnorm_backward(float *dinp, float *dweight, const float *dout,
                                                const float *inp, const float *weight,
                                                const float *rstd, void *scratch, int64_t N,
                                                int64_t C, moe_cuda_ctx *ctx) {
    if (N <= 0 || C <= 0) return MOE_OK;
    const int64_t n_parts = (N + RMS_ROWS_PER_PART - 1) / RMS_ROWS_PER_PART;
    rmsnorm_dx_kernel<<<moe_cuda_grid(N, 1, ctx), MOE_CUDA_THREADS, 0, ctx->stream>>>(
        dinp, dout, inp, weight, rstd, N, C);
    MOE_CUDA_CHECK(cudaGetLastError());
    const dim3 grid((unsigned)((C + MOE_CUDA_THREADS - 1) / MOE_CUDA_THREADS),
                    (unsigned)(n_parts < 65535 ? n_parts : 65535));
    rmsnorm_dw_parts_kernel<<<grid, MOE_CUDA_THREADS, 0, ctx->stream>>>((double *)scratch, dout,
                                                                        inp, rstd, N, C);
    MOE_CUDA_CHECK(cudaGetLastError());
    rmsnorm_dw_sum_kernel<<<grid_for(C, ctx), MOE_CUDA_THREADS, 0, ctx->stream>>>(
        dweight, (const double *)scratch, n_parts, C);
    MOE_CUDA_CHECK(cudaGetLastError());
    return MOE_OK;
}

/* ------------------------------------------------------------------- matmul */

extern "C" moe_status moe_cuda_matmul_forward(float *out, const float *inp, const float *weight,
                                              int64_t N, int64_t C, int64_t OC, moe_cuda_ctx *ctx) {
    return moe_cuda_lt_gemm(ctx, out, MOE_CUDA_F32, inp, weight, MOE_CUDA_F32, N, OC, C, C, C, OC,
                            false, true, 1.0f, 0.0f, MOE_CUDA_LT_FIXED);
}

extern "C" moe_status moe_cuda_matmul_backward(float *dinp, float *dweight, const float *dout,
                                               const float *inp, const float *weight, int64_t N,
                                               int64_t C, int64_t OC, moe_cuda_ctx *ctx) {
    if (N == 0 || OC == 0 || C == 0) return MOE_OK; /* nothing to add */
    MOE_TRY(moe_cuda_lt_gemm(ctx, dinp, MOE_CUDA_F32, dout, weight, MOE_CUDA_F32, N, C, OC, OC, C,
                             C, false, false, 1.0f, 1.0f, MOE_CUDA_LT_FIXED));
    return moe_cuda_lt_gemm(ctx, dweight, MOE_CUDA_F32, dout, inp, MOE_CUDA_F32, OC, C, N, OC, C, C,
                            true, false, 1.0f, 1.0f, MOE_CUDA_LT_FIXED);
}

/* --------------------------------------------------------------------- RoPE */

static moe_status rope(float *x, const float *cos_t, const float *sin_t, int64_t B, int64_t T,
                       int64_t H, int64_t hd, float sign, moe_cuda_ctx *ctx) {
    const int64_t n = B * T * H * (hd / 2);
    if (n <= 0) return MOE_OK;
    rope_rotate_kernel<<<grid_for(n, ctx), MOE_CUDA_THREADS, 0, ctx->stream>>>(x, cos_t, sin_t, B,
                                                                               T, H, hd, sign);
    MOE_CUDA_CHECK(cudaGetLastError());
    return MOE_OK;
}

extern "C" moe_status moe_cuda_rope_forward(float *x, const float *cos_t, const float *sin_t,
                                            int64_t B, int64_t T, int64_t H, int64_t hd,
                                            moe_cuda_ctx *ctx) {
    return rope(x, cos_t, sin_t, B, T, H, hd, 1.0f, ctx);
}

extern "C" moe_status moe_cuda_rope_backward(float *dx, const float *cos_t, const float *sin_t,
                                             int64_t B, int64_t T, int64_t H, int64_t hd,
                                             moe_cuda_ctx *ctx) {
    return rope(dx, cos_t, sin_t, B, T, H, hd, -1.0f, ctx);
}

/* ------------------------------------------------------------ cross-entropy */

extern "C" moe_status moe_cuda_crossentropy_forward(float *losses, double *lse, const float *logits,
                                                    const int32_t *targets, int64_t N, int64_t V,
                                                    moe_cuda_ctx *ctx) {
    if (N <= 0) return MOE_OK;
    crossentropy_forward_kernel<<<moe_cuda_grid(N, 1, ctx), MOE_CUDA_THREADS, 0, ctx->stream>>>(
        losses, lse, logits, targets, N, V);
    MOE_CUDA_CHECK(cudaGetLastError());
    return MOE_OK;
}

extern "C" moe_status moe_cuda_crossentropy_backward(float *dlogits, const float *logits,
                                                     const double *lse, const int32_t *targets,
                                                     const float *dloss, float z_coef, int64_t N,
                                                     int64_t V, moe_cuda_ctx *ctx) {
    if (N * V <= 0) return MOE_OK;
    crossentropy_backward_kernel<<<moe_cuda_grid(N, 1, ctx), MOE_CUDA_THREADS, 0, ctx->stream>>>(
        dlogits, logits, lse, targets, dloss, z_coef, N, V);
    MOE_CUDA_CHECK(cudaGetLastError());
    return MOE_OK;
}

/* ----------------------------------------------------------------- residual */

static __global__ void residual_forward_kernel(float *out, const float *a, const float *b,
                                               int64_t n) {
    GRID_STRIDE(i, n) out[i] = a[i] + b[i];
}

static __global__ void residual_backward_kernel(float *da, float *db, const float *dout,
                                                int64_t n) {
    GRID_STRIDE(i, n) {
        da[i] += dout[i];
        db[i] += dout[i];
    }
}

extern "C" moe_status moe_cuda_residual_forward(float *out, const float *a, const float *b,
                                                int64_t n, moe_cuda_ctx *ctx) {
    if (n <= 0) return MOE_OK;
    residual_forward_kernel<<<grid_for(n, ctx), MOE_CUDA_THREADS, 0, ctx->stream>>>(out, a, b, n);
    MOE_CUDA_CHECK(cudaGetLastError());
    return MOE_OK;
}

extern "C" moe_status moe_cuda_residual_backward(float *da, float *db, const float *dout, int64_t n,
                                                 moe_cuda_ctx *ctx) {
    if (n <= 0) return MOE_OK;
    residual_backward_kernel<<<grid_for(n, ctx), MOE_CUDA_THREADS, 0, ctx->stream>>>(da, db, dout,
                                                                                     n);
    MOE_CUDA_CHECK(cudaGetLastError());
    return MOE_OK;
}

static __global__ void multiply_kernel(float *out, const float *a, const float *b, int64_t n) {
    GRID_STRIDE(i, n) out[i] = a[i] * b[i];
}

extern "C" moe_status moe_cuda_multiply(float *out, const float *a, const float *b, int64_t n,
                                        moe_cuda_ctx *ctx) {
    if (n <= 0) return MOE_OK;
    multiply_kernel<<<grid_for(n, ctx), MOE_CUDA_THREADS, 0, ctx->stream>>>(out, a, b, n);
    MOE_CUDA_CHECK(cudaGetLastError());
    return MOE_OK;
}

static __global__ void uniform_kernel(float *out, uint64_t seed, uint64_t stream,
                                      uint64_t first, float lo, float span, int64_t n) {
    GRID_STRIDE(i, n) out[i] = moe_rng_uniform_in(seed, stream, first + (uint64_t)i, lo, span);
}

extern "C" moe_status moe_cuda_uniform(float *out, uint64_t seed, uint64_t stream, uint64_t first,
                                       float lo, float span, int64_t n, moe_cuda_ctx *ctx) {
    if (n <= 0) return MOE_OK;
    uniform_kernel<<<grid_for(n, ctx), MOE_CUDA_THREADS, 0, ctx->stream>>>(out, seed, stream,
                                                                             first, lo, span, n);
    MOE_CUDA_CHECK(cudaGetLastError());
    return MOE_OK;
}

/* ------------------------------------------------------ shared expert gate */

extern "C" moe_status moe_cuda_sigmoid_gate_forward(float *out, float *gate, const float *in,
                                                    const float *logits, int64_t T, int64_t d,
                                                    moe_cuda_ctx *ctx) {
    if (T <= 0) return MOE_OK;
    sigmoid_gate_forward_kernel<<<moe_cuda_grid(T, 1, ctx), MOE_CUDA_THREADS, 0, ctx->stream>>>(
        out, gate, in, logits, T, d);
    MOE_CUDA_CHECK(cudaGetLastError());
    return MOE_OK;
}

extern "C" moe_status moe_cuda_sigmoid_gate_backward(float *din, float *dlogits, const float *dout,
                                                     const float *out, const float *gate, int64_t T,
                                                     int64_t d, moe_cuda_ctx *ctx) {
    if (T <= 0) return MOE_OK;
    sigmoid_gate_backward_kernel<<<moe_cuda_grid(T, 1, ctx), MOE_CUDA_THREADS, 0, ctx->stream>>>(
        din, dlogits, dout, out, gate, T, d);
    MOE_CUDA_CHECK(cudaGetLastError());
    return MOE_OK;
}

/* ---------------------------------------------------------------- optimizer */

/* Parameters per block pass: a block finds the span of its first one by a
 * binary search, and its threads step forward from there. */
#define ADAMW_TILE 4096

static __global__ void adamw_kernel(float *params, float *m, float *v, const float *grads,
                                    float grad_scale, int64_t n, const moe_adamw_span *spans, int64_t n_spans,
                                    float beta1, float beta2, float eps, moe_adamw_step step) {
    __shared__ int64_t first_span;
    for (int64_t tile = blockIdx.x * (int64_t)ADAMW_TILE; tile < n;
         tile += (int64_t)gridDim.x * ADAMW_TILE) {
        if (threadIdx.x == 0) {
            int64_t lo = 0, hi = n_spans - 1; /* the first span whose end is past tile */
            while (lo < hi) {
                const int64_t mid = (lo + hi) / 2;
                if (spans[mid].end > tile)
                    hi = mid;
                else
                    lo = mid + 1;
            }
            first_span = lo;
        }
        __syncthreads();
        int64_t s = first_span;
        const int64_t end = tile + ADAMW_TILE < n ? tile + ADAMW_TILE : n;
        for (int64_t i = tile + threadIdx.x; i < end; i += blockDim.x) {
            while (s + 1 < n_spans && spans[s].end <= i) s++;
            moe_adamw_update(&params[i], &m[i], &v[i], grads[i] * grad_scale, beta1, beta2, eps,
                             spans[s].decays ? step.decay : 1.0f, step.step_size,
                             step.bc2_sqrt);
        }
        __syncthreads(); /* first_span is read before the next pass writes it */
    }
}

extern "C" moe_status moe_cuda_adamw(float *params, float *m, float *v, const float *grads,
                                     float grad_scale, int64_t n, const moe_adamw_span *spans, int64_t n_spans,
                                     float lr, float beta1, float beta2, float eps,
                                     float weight_decay, int64_t t, moe_cuda_ctx *ctx) {
    if (n <= 0) return MOE_OK;
    if (n_spans <= 0)
        return moe_error(MOE_ERR_INVALID_ARG, "adamw over %lld parameters with no spans",
                         (long long)n);
    /* The per-step scalars on the host, as the CPU computes them. */
    const moe_adamw_step step = moe_adamw_step_at(lr, beta1, beta2, weight_decay, t);
    adamw_kernel<<<moe_cuda_grid(n, ADAMW_TILE, ctx), MOE_CUDA_THREADS, 0, ctx->stream>>>(
        params, m, v, grads, grad_scale, n, spans, n_spans, beta1, beta2, eps, step);
    MOE_CUDA_CHECK(cudaGetLastError());
    return MOE_OK;
}

/* ---------------------------------------------------------------- reduction */

/* One block per part [n p / PARTS, n (p + 1) / PARTS). */
static __global__ void sumsq_parts_kernel(double *parts, const float *x, int64_t n) {
    __shared__ double partial[32];
    const int64_t p = blockIdx.x;
    const int64_t i0 = n * p / MOE_CUDA_SUMSQ_PARTS, i1 = n * (p + 1) / MOE_CUDA_SUMSQ_PARTS;
    double s = 0.0;
    for (int64_t i = i0 + threadIdx.x; i < i1; i += blockDim.x) s += (double)x[i] * x[i];
    s = moe_block_sum(s, partial);
    if (threadIdx.x == 0) parts[p] = s;
}

/* The parts staged in shared memory by the whole block, then added in
 * order by one thread. */
static __global__ void sumsq_total_kernel(double *out, const double *parts) {
    __shared__ double staged[MOE_CUDA_SUMSQ_PARTS];
    for (int p = threadIdx.x; p < MOE_CUDA_SUMSQ_PARTS; p += blockDim.x) staged[p] = parts[p];
    __syncthreads();
    if (threadIdx.x != 0) return;
    double total = 0.0;
    for (int p = 0; p < MOE_CUDA_SUMSQ_PARTS; p++) total += staged[p];
    *out = total;
}

extern "C" moe_status moe_cuda_sumsq(double *out, const float *x, int64_t n, moe_cuda_ctx *ctx) {
    if (n > INT64_MAX / MOE_CUDA_SUMSQ_PARTS)
        return moe_error(MOE_ERR_UNSUPPORTED, "moe_cuda_sumsq: n=%lld is too large", (long long)n);
    sumsq_parts_kernel<<<MOE_CUDA_SUMSQ_PARTS, MOE_CUDA_THREADS, 0, ctx->stream>>>(ctx->sumsq_parts,
                                                                                   x, n);
    MOE_CUDA_CHECK(cudaGetLastError());
    sumsq_total_kernel<<<1, MOE_CUDA_THREADS, 0, ctx->stream>>>(out, ctx->sumsq_parts);
    MOE_CUDA_CHECK(cudaGetLastError());
    return MOE_OK;
}
