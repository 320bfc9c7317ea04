/* grouped_mma.cu: a grouped GEMM on the tensor cores (mma.sync m16n8k16,
 * bf16 in, fp32 accumulate; sm_80 and up) that reads each expert's row
 * range from device memory, so routing never waits for the host.
 *
 * Work is cut into 128x256 output tiles (BM x BN). A tiny kernel scans the
 * experts' row counts into tile_offsets (expert e owns m-tiles
 * [tile_offsets[e], tile_offsets[e+1])); the main grid has one x-slot per
 * m-tile the worst case can need (ceil(max_rows / BM) + E), and slots past
 * the real count return at once. A block finds its expert by binary
 * search, then streams 32-wide k-slices of its A rows and of the expert's
 * B rows through three shared-memory stages with cp.async (zero-filled
 * past the edges; 90 KB, within the opt-in of every sm_80+ part), and
 * eight warps each compute a 64x64 piece with ldmatrix + mma.sync (a 64x32
 * piece on 128x128 tiles measured 0.32-0.34 of dense cuBLASLt on an H200:
 * the wider warp tile uses each A fragment for twice the mma).
 *
 * It uses none of Hopper's own instructions (wgmma, TMA): on an H100/H200
 * it runs on the sm_80 path, which is the gap to cuBLASLt's sm_90 kernels. */
#include "kernels/cuda/grouped_mma.cuh"
#include "kernels/cuda/grouped_mma_kernels.cuh"

/* tile_offsets [E+1]: exclusive scan of ceil(rows_e / BM). One block. */
static __global__ void tile_scan_kernel(int32_t *tile_offsets, const int64_t *offsets, int E) {
    const int per = (E + (int)blockDim.x - 1) / (int)blockDim.x;
    const int e0 = min((int)threadIdx.x * per, E), e1 = min(e0 + per, E);
    int32_t mine = 0;
    for (int e = e0; e < e1; e++) mine += (int32_t)((offsets[e + 1] - offsets[e] + BM - 1) / BM);
    int32_t all = 0;
    int32_t run = moe_block_exclusive_scan(mine, &all);
    for (int e = e0; e < e1; e++) {
        tile_offsets[e] = run;
        run += (int32_t)((offsets[e + 1] - offsets[e] + BM - 1) / BM);
    }
    if (threadIdx.x == 0) tile_offsets[E] = all;
}

template <typename OutT>
static moe_status launch(OutT *c, const __nv_bfloat16 *a, const __nv_bfloat16 *b,
                         const int64_t *offsets, int E, int64_t max_rows, int64_t n, int64_t k,
                         moe_cuda_ctx *ctx) {
    MOE_CUDA_CHECK(cudaFuncSetAttribute(grouped_mma_kernel<OutT>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_BYTES));
    const dim3 grid((unsigned)((max_rows + BM - 1) / BM + E), (unsigned)((n + BN - 1) / BN));
    grouped_mma_kernel<OutT>
        <<<grid, THREADS, SMEM_BYTES, ctx->stream>>>(c, a, b, offsets, ctx->tile_offsets, E, n, k);
    MOE_CUDA_CHECK(cudaGetLastError());
    return MOE_OK;
}

moe_status moe_cuda_grouped_mma(void *c, moe_cuda_dtype c_type, const void *a, const void *b,
                                moe_cuda_dtype ab_type, const int64_t *offsets, int64_t E,
                                int64_t max_rows, int64_t n, int64_t k, moe_cuda_ctx *ctx) {
    if (ab_type != MOE_CUDA_BF16)
        return moe_error(MOE_ERR_UNSUPPORTED, "the mma grouped GEMM takes bf16 inputs only");
    /* store_pair writes column pairs as one 2-element store. */
    const size_t pair_bytes = 2 * moe_cuda_dtype_bytes(c_type);
    if (k <= 0 || k % 8 != 0 || (uintptr_t)a % 16 != 0 || (uintptr_t)b % 16 != 0 ||
        (uintptr_t)c % pair_bytes != 0)
        return moe_error(MOE_ERR_UNSUPPORTED,
                         "the mma grouped GEMM needs k %% 8 == 0, 16-byte aligned a and b, and c "
                         "aligned to %zu bytes (k=%lld)",
                         pair_bytes, (long long)k);
    if (E < 1 || E > MOE_EXPERTS_MAX || n <= 0 || max_rows < 0)
        return moe_error(MOE_ERR_INVALID_ARG, "moe_cuda_grouped_mma: E=%lld n=%lld max_rows=%lld",
                         (long long)E, (long long)n, (long long)max_rows);
    if ((n + BN - 1) / BN > 65535 || (max_rows + BM - 1) / BM + E > INT32_MAX)
        return moe_error(MOE_ERR_UNSUPPORTED,
                         "moe_cuda_grouped_mma: n=%lld max_rows=%lld too large", (long long)n,
                         (long long)max_rows);
    if (max_rows == 0) return MOE_OK;
    if (ctx->smem_optin_bytes < SMEM_BYTES)
        return moe_error(MOE_ERR_UNSUPPORTED,
                         "the mma grouped GEMM needs %d bytes of shared memory; %s has %zu",
                         SMEM_BYTES, ctx->name, ctx->smem_optin_bytes);
    tile_scan_kernel<<<1, 1024, 0, ctx->stream>>>(ctx->tile_offsets, offsets, (int)E);
    MOE_CUDA_CHECK(cudaGetLastError());
    const __nv_bfloat16 *ab = (const __nv_bfloat16 *)a, *bb = (const __nv_bfloat16 *)b;
    if (c_type == MOE_CUDA_BF16)
        return launch((__nv_bfloat16 *)c, ab, bb, offsets, (int)E, max_rows, n, k, ctx);
    return launch((float *)c, ab, bb, offsets, (int)E, max_rows, n, k, ctx);
}
