/* flash_attention.cu: causal grouped-query attention (with an optional
 * sliding window, whose blocks skip the key tiles before it) on the tensor cores
 * (FlashAttention-2's algorithm; mma.sync with bf16 operands and fp32
 * sums), so the T x T scores never reach device memory.
 *
 * Every kernel runs four warps over a block of 64 rows, 16 a warp, and
 * streams the other side through shared memory in tiles of 64 rows (32 at
 * a head size of 128), converting fp32 to bf16 as it loads. The forward
 * keeps each query row's running maximum and sum. The backward recomputes the probabilities from the saved
 * log-sum-exp: one kernel for dk and dv per block of keys, looping over the
 * query heads of its group and the query tiles at or past its keys; one
 * for dq per block of queries. Each output element has one owner, so the
 * sums run in a fixed order with no atomics.
 *
 * Products S = q k^T come out of the mma in its C layout; the probabilities
 * go back in as the A operand of the next product straight from registers,
 * since a C fragment of two neighbouring 8-column blocks is the A fragment
 * of their 16 columns. */
#include <limits.h>

#include <type_traits>

#include "kernels/cuda/flash_attention.cuh"
#include "kernels/cuda/flash_attention_kernels.cuh"

/* ------------------------------------------------------------------ hosts */

extern "C" bool moe_cuda_attention_fused(int64_t T, int64_t Hq, int64_t hd,
                                         const moe_cuda_ctx *ctx) {
    return ctx->attention_path == MOE_CUDA_ATTENTION_AUTO && ctx->math == MOE_CUDA_MATH_BF16 &&
           (hd == 16 || hd == 32 || hd == 64 || hd == 128) && T > hd && Hq <= 65535;
}

/* Blocks (row blocks, heads, batch): B and the head count stay within
 * the grid's y and z limits, which moe_cuda_attention_fused and the callers'
 * size checks keep. */
static dim3 fa_grid(int64_t T, int64_t heads, int64_t B) {
    return dim3((unsigned)((T + FA_ROWS - 1) / FA_ROWS), (unsigned)heads, (unsigned)B);
}

static moe_status check_grid(int64_t B, int64_t T, const char *op) {
    if (B > 65535 || (T + FA_ROWS - 1) / FA_ROWS > INT_MAX)
        return moe_error(MOE_ERR_UNSUPPORTED, "%s: B=%lld T=%lld is past the fused kernels' grid", op,
                         (long long)B, (long long)T);
    return MOE_OK;
}

/* launch(std::integral_constant<int, hd>) for the head sizes the kernels
 * are built for (16, 32, 64, 128; the callers check hd first). */
template <typename Launch> static void with_head_dim(int64_t hd, Launch launch) {
    if (hd == 16)
        launch(std::integral_constant<int, 16>());
    else if (hd == 32)
        launch(std::integral_constant<int, 32>());
    else if (hd == 64)
        launch(std::integral_constant<int, 64>());
    else
        launch(std::integral_constant<int, 128>());
}

moe_status moe_cuda_flash_forward(float *out, float *att, const float *q, const float *k,
                                  const float *v, int64_t B, int64_t T, int64_t Hq, int64_t Hkv,
                                  int64_t hd, int64_t window, moe_cuda_ctx *ctx) {
    MOE_TRY(check_grid(B, T, "flash attention forward"));
    float *lse = att, *out_copy = att + B * Hq * T;
    const float scale = 1.0f / sqrtf((float)hd);
    const dim3 grid = fa_grid(T, Hq, B);
    with_head_dim(hd, [&](auto head_dim) {
        constexpr int HD = decltype(head_dim)::value;
        flash_forward_kernel<HD><<<grid, FA_WARPS * 32, 0, ctx->stream>>>(
            out, lse, out_copy, q, k, v, T, Hq, Hkv, window, scale);
    });
    MOE_CUDA_CHECK(cudaGetLastError());
    return MOE_OK;
}

moe_status moe_cuda_flash_backward(float *dq, float *dk, float *dv, float *datt, const float *dout,
                                   const float *q, const float *k, const float *v,
                                   const float *att, int64_t B, int64_t T, int64_t Hq,
                                   int64_t Hkv, int64_t hd, int64_t window, moe_cuda_ctx *ctx) {
    MOE_TRY(check_grid(B, T, "flash attention backward"));
    const float *lse = att, *out = att + B * Hq * T;
    float *D = datt;
    const float scale = 1.0f / sqrtf((float)hd);
    const int64_t rows = B * T * Hq;
    rowdot_kernel<<<moe_cuda_grid(rows, MOE_CUDA_THREADS / 32, ctx), MOE_CUDA_THREADS, 0,
                    ctx->stream>>>(D, dout, out, rows, T, Hq, hd);
    MOE_CUDA_CHECK(cudaGetLastError());
    const int threads = FA_WARPS * 32;
    const dim3 kv_grid = fa_grid(T, Hkv, B), q_grid = fa_grid(T, Hq, B);
    with_head_dim(hd, [&](auto head_dim) {
        constexpr int HD = decltype(head_dim)::value;
        flash_dkdv_kernel<HD><<<kv_grid, threads, 0, ctx->stream>>>(dk, dv, q, k, v, dout, lse, D,
                                                                    T, Hq, Hkv, window, scale);
        flash_dq_kernel<HD><<<q_grid, threads, 0, ctx->stream>>>(dq, q, k, v, dout, lse, D, T, Hq,
                                                                 Hkv, window, scale);
    });
    MOE_CUDA_CHECK(cudaGetLastError());
    return MOE_OK;
}
