/* grouped_mma.cu: a grouped GEMM on the tensor cores (mma.sync m16n8k16,
 * bf16 in, fp32 accumulate; sm_80 and up) that reads each expert's row
 * range from device memory, so routing never waits for the host.
 *
 * Work is cut into 128x128 output tiles. A tiny kernel scans the experts'
 * row counts into tile_offsets (expert e owns m-tiles [tile_offsets[e],
 * tile_offsets[e+1])); the main grid has one x-slot per m-tile the worst
 * case can need (ceil(max_rows / 128) + E), and slots past the real count
 * return at once. A block finds its expert by binary search, then streams
 * 32-wide k-slices of its A rows and of the expert's B rows through three
 * shared-memory stages with cp.async (zero-filled past the edges), and
 * eight warps each compute a 64x32 piece with ldmatrix + mma.sync.
 *
 * It uses none of Hopper's own instructions (wgmma, TMA): on an H100/H200
 * it runs on the sm_80 path, which is the gap to cuBLASLt's sm_90 kernels. */
#include "kernels/cuda/grouped_mma.cuh"

#define BM 128
#define BN 128
#define BK 32
#define STAGES 3
#define THREADS 256
/* Shared rows of 40 bf16 (80 bytes): the 8 rows one ldmatrix phase reads
 * land in 8 different 16-byte bank groups. */
#define SMEM_LD (BK + 8)
#define STAGE_ELEMS ((BM + BN) * SMEM_LD)
#define SMEM_BYTES (STAGES * STAGE_ELEMS * 2)

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

static __device__ __forceinline__ uint32_t smem_addr(const void *p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

/* 16 bytes global -> shared; src_bytes 0 writes zeros and reads nothing. */
static __device__ __forceinline__ void cp_async16(uint32_t dst, const void *src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(src_bytes));
}

static __device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::);
}

template <int N> static __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

static __device__ __forceinline__ void ldmatrix_x4(uint32_t *r, uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

/* Stores the pair (v0, v1) at columns col, col + 1 of a row. */
static __device__ __forceinline__ void store_pair(float *p, int64_t col, int64_t n, float v0,
                                                  float v1) {
    if (col + 1 < n && n % 2 == 0) {
        *(float2 *)p = make_float2(v0, v1);
    } else {
        if (col < n) p[0] = v0;
        if (col + 1 < n) p[1] = v1;
    }
}

static __device__ __forceinline__ void store_pair(__nv_bfloat16 *p, int64_t col, int64_t n,
                                                  float v0, float v1) {
    if (col + 1 < n && n % 2 == 0) {
        *(__nv_bfloat162 *)p = __floats2bfloat162_rn(v0, v1);
    } else {
        if (col < n) p[0] = __float2bfloat16_rn(v0);
        if (col + 1 < n) p[1] = __float2bfloat16_rn(v1);
    }
}

template <typename OutT>
static __global__ void __launch_bounds__(THREADS)
    grouped_mma_kernel(OutT *c, const __nv_bfloat16 *a, const __nv_bfloat16 *b,
                       const int64_t *offsets, const int32_t *tile_offsets, int E, int64_t n,
                       int64_t k) {
    extern __shared__ __align__(16) __nv_bfloat16 mma_shared[];
    const int tile = blockIdx.x;
    if (tile >= tile_offsets[E]) return;
    /* The last expert whose first tile is at or before ours: experts with
     * no rows share their first tile with the next one and lose the tie. */
    int lo = 0, hi = E - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (tile_offsets[mid] <= tile)
            lo = mid;
        else
            hi = mid - 1;
    }
    const int e = lo;
    const int64_t row0 = offsets[e] + (int64_t)(tile - tile_offsets[e]) * BM;
    const int rows = (int)min((int64_t)BM, offsets[e + 1] - row0);
    const int64_t n0 = (int64_t)blockIdx.y * BN;
    const __nv_bfloat16 *a_tile = a + row0 * k;                  /* [rows, k] */
    const __nv_bfloat16 *b_tile = b + ((int64_t)e * n + n0) * k; /* [<= BN, k] */

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp >> 2, wn = warp & 3; /* a 2 x 4 grid of 64 x 32 warp tiles */
    const int ktiles = (int)((k + BK - 1) / BK);

    /* Each thread moves two 16-byte chunks of A and two of B per stage. */
    auto load_stage = [&](int slot, int kt) {
        __nv_bfloat16 *sa = mma_shared + slot * STAGE_ELEMS, *sb = sa + BM * SMEM_LD;
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const int q = tid + i * THREADS, r = q >> 2, kc = (q & 3) * 8;
            const int64_t kk = (int64_t)kt * BK + kc;
            const bool a_ok = r < rows && kk < k, b_ok = n0 + r < n && kk < k;
            cp_async16(smem_addr(sa + r * SMEM_LD + kc), a_ok ? a_tile + r * k + kk : a,
                       a_ok ? 16 : 0);
            cp_async16(smem_addr(sb + r * SMEM_LD + kc), b_ok ? b_tile + r * k + kk : b,
                       b_ok ? 16 : 0);
        }
    };

    float acc[4][4][4];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int v = 0; v < 4; v++) acc[i][j][v] = 0.0f;

#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < ktiles) load_stage(s, s);
        cp_async_commit();
    }
    for (int kt = 0; kt < ktiles; kt++) {
        cp_async_wait<STAGES - 2>(); /* stage kt has landed */
        __syncthreads();             /* and every warp is done with stage kt - 1 */
        const int next = kt + STAGES - 1;
        if (next < ktiles) load_stage(next % STAGES, next);
        cp_async_commit();

        const __nv_bfloat16 *sa = mma_shared + (kt % STAGES) * STAGE_ELEMS;
        const __nv_bfloat16 *sb = sa + BM * SMEM_LD;
#pragma unroll
        for (int ks = 0; ks < BK; ks += 16) {
            uint32_t af[4][4], bf[4][2];
#pragma unroll
            for (int mi = 0; mi < 4; mi++) {
                const int r = wm * 64 + mi * 16 + (lane & 15), col = ks + (lane >> 4) * 8;
                ldmatrix_x4(af[mi], smem_addr(sa + r * SMEM_LD + col));
            }
#pragma unroll
            for (int nj = 0; nj < 2; nj++) {
                const int r = wn * 32 + nj * 16 + (lane & 7) + ((lane >> 4) << 3);
                const int col = ks + ((lane >> 3) & 1) * 8;
                uint32_t t[4];
                ldmatrix_x4(t, smem_addr(sb + r * SMEM_LD + col));
                bf[2 * nj][0] = t[0], bf[2 * nj][1] = t[1];
                bf[2 * nj + 1][0] = t[2], bf[2 * nj + 1][1] = t[3];
            }
#pragma unroll
            for (int mi = 0; mi < 4; mi++)
#pragma unroll
                for (int ni = 0; ni < 4; ni++) moe_mma_bf16(acc[mi][ni], af[mi], bf[ni]);
        }
    }
    cp_async_wait<0>();

#pragma unroll
    for (int mi = 0; mi < 4; mi++)
#pragma unroll
        for (int ni = 0; ni < 4; ni++) {
            const int r = wm * 64 + mi * 16 + (lane >> 2);
            const int64_t col = n0 + wn * 32 + ni * 8 + 2 * (lane & 3);
            if (r < rows)
                store_pair(c + (row0 + r) * n + col, col, n, acc[mi][ni][0], acc[mi][ni][1]);
            if (r + 8 < rows)
                store_pair(c + (row0 + r + 8) * n + col, col, n, acc[mi][ni][2], acc[mi][ni][3]);
        }
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
