/* grouped_mma.cu: a grouped GEMM on the tensor cores (mma.sync m16n8k16
 * on sm_80 and up, wgmma on Hopper; bf16 in, fp32 accumulate) that reads each expert's row
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
 * On Hopper (compute capability 9.0, built for sm_90a) the wgmma kernel
 * takes the same tiles through warpgroup MMA: 64-wide k-slices in four
 * stages of 128-byte-swizzled rows (193 KB), each warpgroup's 64 x 256
 * product one m64n256k16 per 16 of k, read by the tensor cores straight
 * from shared memory, every thread loading with cp.async. The wgmma-tma
 * kernel specializes warpgroups instead: one issues TMA tile loads (the
 * copy engine swizzles), two multiply, and per-stage mbarriers pass the
 * stages between them, so loads never wait on a block-wide barrier; its
 * blocks are persistent, one per SM, taking tiles in L2-friendly groups
 * and loading the next tile while the last one is stored. */
#include <cudaTypedefs.h> /* PFN_cuTensorMapEncodeTiled */

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

/* A 2-D bf16 tensor [rows, cols] as TMA reads it: boxes of WG_BK columns
 * by box_rows rows, in the 128-byte swizzle, zero past the edges. The
 * driver's encoder comes through the runtime, so nothing links libcuda. */
static moe_status tensor_map(CUtensorMap *map, const void *base, uint64_t rows, uint64_t cols,
                             uint32_t box_rows, moe_cuda_ctx *ctx) {
    if (!ctx->encode_tensor_map) {
        cudaDriverEntryPointQueryResult found;
        MOE_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled",
                                                        &ctx->encode_tensor_map, 12000,
                                                        cudaEnableDefault, &found));
        if (found != cudaDriverEntryPointSuccess || !ctx->encode_tensor_map) {
            ctx->encode_tensor_map = NULL;
            return moe_error(MOE_ERR_UNSUPPORTED,
                             "the driver has no cuTensorMapEncodeTiled (query result %d)",
                             (int)found);
        }
    }
    const cuuint64_t dims[2] = {cols, rows}, strides[1] = {cols * 2};
    const cuuint32_t box[2] = {WG_BK, box_rows}, element_strides[2] = {1, 1};
    const CUresult r = ((PFN_cuTensorMapEncodeTiled_v12000)ctx->encode_tensor_map)(
        map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, (void *)base, dims, strides, box,
        element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
        CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS)
        return moe_error(MOE_ERR_INTERNAL,
                         "cuTensorMapEncodeTiled failed (CUresult %d) for a [%llu, %llu] bf16 "
                         "tensor at %p, boxes of %u x %d",
                         (int)r, (unsigned long long)rows, (unsigned long long)cols, base, box_rows,
                         WG_BK);
    return MOE_OK;
}

template <typename OutT>
static moe_status launch(OutT *c, const __nv_bfloat16 *a, const __nv_bfloat16 *b,
                         const int64_t *offsets, int E, int64_t max_rows, int64_t n, int64_t k,
                         moe_cuda_grouped_algo algo, moe_cuda_ctx *ctx) {
    const dim3 grid((unsigned)((max_rows + BM - 1) / BM + E), (unsigned)((n + BN - 1) / BN));
    if (algo == MOE_CUDA_GROUPED_WGMMA_TMA) {
        CUtensorMap a_map, b_map;
        MOE_TRY(tensor_map(&a_map, a, (uint64_t)max_rows, (uint64_t)k, BM, ctx));
        MOE_TRY(tensor_map(&b_map, b, (uint64_t)(E * n), (uint64_t)k, BN, ctx));
        MOE_CUDA_CHECK(cudaFuncSetAttribute(grouped_wgmma_tma_kernel<OutT>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            WS_SMEM_BYTES));
        /* Persistent: a block per SM (its shared memory allows no second),
         * fewer when the worst case has fewer tiles. */
        const int64_t most_tiles = (int64_t)grid.x * grid.y;
        const unsigned blocks = (unsigned)(most_tiles < ctx->sm_count ? most_tiles : ctx->sm_count);
        grouped_wgmma_tma_kernel<OutT><<<blocks, WS_THREADS, WS_SMEM_BYTES, ctx->stream>>>(
            c, a_map, b_map, offsets, ctx->tile_offsets, E, n, k);
    } else {
        const bool wgmma = algo == MOE_CUDA_GROUPED_WGMMA;
        auto kernel = wgmma ? grouped_wgmma_kernel<OutT> : grouped_mma_kernel<OutT>;
        const int smem = wgmma ? WG_SMEM_BYTES : MMA_SMEM_BYTES;
        MOE_CUDA_CHECK(
            cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        kernel<<<grid, THREADS, smem, ctx->stream>>>(c, a, b, offsets, ctx->tile_offsets, E, n, k);
    }
    MOE_CUDA_CHECK(cudaGetLastError());
    return MOE_OK;
}

/* wgmma runs on compute capability 9.0 only, from code built for sm_90a. */
extern "C" moe_status moe_cuda_wgmma_check(const moe_cuda_ctx *ctx) {
#if defined(MOE_CUDA_SM90A)
    if (ctx->cc_major == 9 && ctx->cc_minor == 0) return MOE_OK;
    return moe_error(MOE_ERR_UNSUPPORTED,
                     "the wgmma grouped GEMMs need compute capability 9.0 (Hopper); %s is %d.%d",
                     ctx->name, ctx->cc_major, ctx->cc_minor);
#else
    return moe_error(MOE_ERR_UNSUPPORTED,
                     "the wgmma grouped GEMMs need a build for sm_90a (CMAKE_CUDA_ARCHITECTURES "
                     "with 90a) and this one has none; on %s use the mma kernel",
                     ctx->name);
#endif
}

moe_status moe_cuda_grouped_mma(void *c, moe_cuda_dtype c_type, const void *a, const void *b,
                                moe_cuda_dtype ab_type, const int64_t *offsets, int64_t E,
                                int64_t max_rows, int64_t n, int64_t k, moe_cuda_grouped_algo algo,
                                moe_cuda_ctx *ctx) {
    const char *name = moe_cuda_grouped_algo_name(algo);
    if (algo != MOE_CUDA_GROUPED_MMA) MOE_TRY(moe_cuda_wgmma_check(ctx));
    if (ab_type != MOE_CUDA_BF16)
        return moe_error(MOE_ERR_UNSUPPORTED, "the %s grouped GEMM takes bf16 inputs only", name);
    /* store_pair writes column pairs as one 2-element store. */
    const size_t pair_bytes = 2 * moe_cuda_dtype_bytes(c_type);
    if (k <= 0 || k % 8 != 0 || (uintptr_t)a % 16 != 0 || (uintptr_t)b % 16 != 0 ||
        (uintptr_t)c % pair_bytes != 0)
        return moe_error(MOE_ERR_UNSUPPORTED,
                         "the %s grouped GEMM needs k %% 8 == 0, 16-byte aligned a and b, and c "
                         "aligned to %zu bytes (k=%lld)",
                         name, pair_bytes, (long long)k);
    if (E < 1 || E > MOE_EXPERTS_MAX || n <= 0 || max_rows < 0)
        return moe_error(MOE_ERR_INVALID_ARG, "moe_cuda_grouped_mma: E=%lld n=%lld max_rows=%lld",
                         (long long)E, (long long)n, (long long)max_rows);
    /* TMA's coordinates are 32-bit: the rows of a and of b, and k, must fit. */
    if ((n + BN - 1) / BN > 65535 ||
        ((max_rows + BM - 1) / BM + E) * ((n + BN - 1) / BN) > INT32_MAX ||
        max_rows > INT32_MAX || E * n > INT32_MAX || k > INT32_MAX)
        return moe_error(MOE_ERR_UNSUPPORTED,
                         "moe_cuda_grouped_mma: n=%lld max_rows=%lld too large", (long long)n,
                         (long long)max_rows);
    if (max_rows == 0) return MOE_OK;
    const int smem = algo == MOE_CUDA_GROUPED_WGMMA_TMA ? WS_SMEM_BYTES
                     : algo == MOE_CUDA_GROUPED_WGMMA   ? WG_SMEM_BYTES
                                                        : MMA_SMEM_BYTES;
    if (ctx->smem_optin_bytes < (size_t)smem)
        return moe_error(MOE_ERR_UNSUPPORTED,
                         "the %s grouped GEMM needs %d bytes of shared memory; %s has %zu", name,
                         smem, ctx->name, ctx->smem_optin_bytes);
    tile_scan_kernel<<<1, 1024, 0, ctx->stream>>>(ctx->tile_offsets, offsets, (int)E);
    MOE_CUDA_CHECK(cudaGetLastError());
    const __nv_bfloat16 *ab = (const __nv_bfloat16 *)a, *bb = (const __nv_bfloat16 *)b;
    if (c_type == MOE_CUDA_BF16)
        return launch((__nv_bfloat16 *)c, ab, bb, offsets, (int)E, max_rows, n, k, algo, ctx);
    return launch((float *)c, ab, bb, offsets, (int)E, max_rows, n, k, algo, ctx);
}
