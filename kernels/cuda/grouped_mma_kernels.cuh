/* grouped_mma_kernels.cuh: the device code of grouped_mma.cu, which says
 * what it computes. It includes nothing: the file that includes it provides
 * the device environment (kernels/cuda/common.cuh on a GPU build;
 * tests/simt_emu.h, which runs it on the CPU, in
 * tests/test_grouped_mma_emulated.cpp). */
#ifndef MOE_KERNELS_CUDA_GROUPED_MMA_KERNELS_CUH
#define MOE_KERNELS_CUDA_GROUPED_MMA_KERNELS_CUH

#define BM 128
#define BN 256
#define BK 32
#define STAGES 3
#define THREADS 256
/* Eight warps in a 2 x 4 grid of WARP_M x WARP_N tiles: per 16-wide
 * k-step a warp loads 4 A and WARP_N / 16 B fragments (ldmatrix x4) for
 * 4 x WARP_N / 8 mma. */
#define WARP_M (BM / 2)
#define WARP_N (BN / 4)
#define MI (WARP_M / 16)
#define NI (WARP_N / 8)
/* 16-byte chunks (8 bf16) of A and of B a thread moves per stage. */
#define A_CHUNKS (BM * BK / 8 / THREADS)
#define B_CHUNKS (BN * BK / 8 / THREADS)
/* Shared rows of 40 bf16 (80 bytes): the 8 rows one ldmatrix phase reads
 * land in 8 different 16-byte bank groups. */
#define SMEM_LD (BK + 8)
#define STAGE_ELEMS ((BM + BN) * SMEM_LD)
#define SMEM_BYTES (STAGES * STAGE_ELEMS * 2)

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
    MOE_DYNAMIC_SHARED(__nv_bfloat16, mma_shared);
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
    const int wm = warp >> 2, wn = warp & 3; /* the warp's tile in the 2 x 4 grid */
    const int ktiles = (int)((k + BK - 1) / BK);

    /* Chunk q of a stage is row q / (BK / 8), columns (q % (BK / 8)) 8 on. */
    auto load_stage = [&](int slot, int kt) {
        __nv_bfloat16 *sa = mma_shared + slot * STAGE_ELEMS, *sb = sa + BM * SMEM_LD;
#pragma unroll
        for (int i = 0; i < A_CHUNKS; i++) {
            const int q = tid + i * THREADS, r = q / (BK / 8), kc = (q % (BK / 8)) * 8;
            const int64_t kk = (int64_t)kt * BK + kc;
            const bool ok = r < rows && kk < k;
            moe_cp_async16(sa + r * SMEM_LD + kc, ok ? a_tile + r * k + kk : a, ok ? 16 : 0);
        }
#pragma unroll
        for (int i = 0; i < B_CHUNKS; i++) {
            const int q = tid + i * THREADS, r = q / (BK / 8), kc = (q % (BK / 8)) * 8;
            const int64_t kk = (int64_t)kt * BK + kc;
            const bool ok = n0 + r < n && kk < k;
            moe_cp_async16(sb + r * SMEM_LD + kc, ok ? b_tile + r * k + kk : b, ok ? 16 : 0);
        }
    };

    float acc[MI][NI][4];
#pragma unroll
    for (int i = 0; i < MI; i++)
#pragma unroll
        for (int j = 0; j < NI; j++)
#pragma unroll
            for (int v = 0; v < 4; v++) acc[i][j][v] = 0.0f;

#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < ktiles) load_stage(s, s);
        moe_cp_async_commit();
    }
    for (int kt = 0; kt < ktiles; kt++) {
        moe_cp_async_wait<STAGES - 2>(); /* stage kt has landed */
        __syncthreads();             /* and every warp is done with stage kt - 1 */
        const int next = kt + STAGES - 1;
        if (next < ktiles) load_stage(next % STAGES, next);
        moe_cp_async_commit();

        const __nv_bfloat16 *sa = mma_shared + (kt % STAGES) * STAGE_ELEMS;
        const __nv_bfloat16 *sb = sa + BM * SMEM_LD;
#pragma unroll
        for (int ks = 0; ks < BK; ks += 16) {
            uint32_t af[MI][4], bf[NI][2];
#pragma unroll
            for (int mi = 0; mi < MI; mi++) {
                const int r = wm * WARP_M + mi * 16 + (lane & 15), col = ks + (lane >> 4) * 8;
                moe_ldmatrix_x4(af[mi], sa + r * SMEM_LD + col);
            }
#pragma unroll
            for (int nj = 0; nj < NI / 2; nj++) {
                const int r = wn * WARP_N + nj * 16 + (lane & 7) + ((lane >> 4) << 3);
                const int col = ks + ((lane >> 3) & 1) * 8;
                uint32_t t[4];
                moe_ldmatrix_x4(t, sb + r * SMEM_LD + col);
                bf[2 * nj][0] = t[0], bf[2 * nj][1] = t[1];
                bf[2 * nj + 1][0] = t[2], bf[2 * nj + 1][1] = t[3];
            }
#pragma unroll
            for (int mi = 0; mi < MI; mi++)
#pragma unroll
                for (int ni = 0; ni < NI; ni++) moe_mma_bf16(acc[mi][ni], af[mi], bf[ni]);
        }
    }
    moe_cp_async_wait<0>();

#pragma unroll
    for (int mi = 0; mi < MI; mi++)
#pragma unroll
        for (int ni = 0; ni < NI; ni++) {
            const int r = wm * WARP_M + mi * 16 + (lane >> 2);
            const int64_t col = n0 + wn * WARP_N + ni * 8 + 2 * (lane & 3);
            if (r < rows)
                store_pair(c + (row0 + r) * n + col, col, n, acc[mi][ni][0], acc[mi][ni][1]);
            if (r + 8 < rows)
                store_pair(c + (row0 + r + 8) * n + col, col, n, acc[mi][ni][2], acc[mi][ni][3]);
        }
}

#endif /* MOE_KERNELS_CUDA_GROUPED_MMA_KERNELS_CUH */
