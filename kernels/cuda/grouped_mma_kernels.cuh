/* grouped_mma_kernels.cuh: the device code of grouped_mma.cu, which says
 * what it computes. It includes nothing: the file that includes it provides
 * the device environment (kernels/cuda/common.cuh on a GPU build;
 * tests/simt_emu.h, which runs it on the CPU, in
 * tests/test_grouped_mma_emulated.cpp). */
#ifndef MOE_KERNELS_CUDA_GROUPED_MMA_KERNELS_CUH
#define MOE_KERNELS_CUDA_GROUPED_MMA_KERNELS_CUH

/* Both kernels compute 128 x 256 tiles of c with 256 threads; they differ
 * in how a k-slice reaches the tensor cores. */
#define BM 128
#define BN 256
#define THREADS 256

/* mma.sync (sm_80 and up): 32-wide k-slices in three stages. Eight warps
 * in a 2 x 4 grid of WARP_M x WARP_N tiles: per 16-wide k-step a warp loads
 * 4 A and WARP_N / 16 B fragments (ldmatrix x4) for 4 x WARP_N / 8 mma. */
#define MMA_BK 32
#define MMA_STAGES 3
#define WARP_M (BM / 2)
#define WARP_N (BN / 4)
#define MI (WARP_M / 16)
#define NI (WARP_N / 8)
/* Shared rows of 40 bf16 (80 bytes): the 8 rows one ldmatrix phase reads
 * land in 8 different 16-byte bank groups. */
#define MMA_LD (MMA_BK + 8)
#define MMA_STAGE_ELEMS ((BM + BN) * MMA_LD)
#define MMA_SMEM_BYTES (MMA_STAGES * MMA_STAGE_ELEMS * 2)

/* wgmma (sm_90a): 64-wide k-slices in four stages; each of the two
 * warpgroups computes 64 rows x 256 columns with m64n256k16, both operands
 * read from shared memory through descriptors. A stage row is 64 bf16 =
 * 128 bytes in the 128-byte swizzle: within each 1024-byte group of 8 rows,
 * the 16-byte chunk c of row r sits at chunk c ^ (r % 8), so the 8 rows a
 * core matrix spans hit 8 different bank groups. The hardware applies the
 * swizzle to shared addresses, so the stages start 1024-byte aligned; the
 * launch asks for 1 KB more to align them. */
#define WG_BK 64
#define WG_STAGES 4
#define WG_ROW_BYTES (WG_BK * 2)
#define WG_STAGE_ELEMS ((BM + BN) * WG_BK)
#define WG_SMEM_BYTES (WG_STAGES * WG_STAGE_ELEMS * 2 + 1024)

/* Where chunk c (8 bf16) of row r of a stage's tile starts, in elements. */
struct padded_rows {
    static __device__ __forceinline__ int at(int r, int c) { return r * MMA_LD + c * 8; }
};
struct swizzled_rows {
    static __device__ __forceinline__ int at(int r, int c) { return r * WG_BK + ((c ^ (r & 7)) * 8); }
};

/* The descriptor of a K-major operand in the 128-byte swizzle starting at
 * shared address addr (its first row; + 32 bytes per 16-wide k-step):
 * start address and the stride between 8-row groups (1024 bytes) in 16-byte
 * units, leading offset 1 (unused by swizzled K-major layouts), swizzle
 * mode 1 (128 bytes) in bits 62-63. */
static __device__ __forceinline__ uint64_t sw128_descriptor(uint32_t addr) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | (uint64_t)1 << 16 | (uint64_t)(1024 >> 4) << 32 |
           (uint64_t)1 << 62;
}

/* The expert and rows of 128-row tile number tile. */
struct expert_tile {
    int e;
    int64_t row0; /* the tile's first row of the batch */
    int rows;     /* how many of its BM rows are the expert's */
};

static __device__ __forceinline__ expert_tile find_expert_tile(const int64_t *offsets,
                                                               const int32_t *tile_offsets, int E,
                                                               int tile) {
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
    expert_tile t;
    t.e = lo;
    t.row0 = offsets[lo] + (int64_t)(tile - tile_offsets[lo]) * BM;
    t.rows = (int)min((int64_t)BM, offsets[lo + 1] - t.row0);
    return t;
}

/* Starts the copy of rows [0, ROWS) x columns [k0, k0 + BK) of src [*, k]
 * into a stage tile laid out by Layout; rows at or past valid_rows and
 * columns at or past k are zero-filled. */
template <int ROWS, int BK, typename Layout>
static __device__ __forceinline__ void load_slice(__nv_bfloat16 *dst, const __nv_bfloat16 *src,
                                                  int64_t valid_rows, int64_t k, int64_t k0) {
#pragma unroll
    for (int i = 0; i < ROWS * BK / 8 / THREADS; i++) {
        const int q = (int)threadIdx.x + i * THREADS, r = q / (BK / 8), c = q % (BK / 8);
        const int64_t kk = k0 + c * 8;
        const bool ok = r < valid_rows && kk < k;
        moe_cp_async16(dst + Layout::at(r, c), ok ? src + r * k + kk : src, ok ? 16 : 0);
    }
}

/* The cp.async kernels' block: its m-tile is blockIdx.x (false when that is
 * past the experts' tiles), its n-tile blockIdx.y. */
static __device__ __forceinline__ bool block_tile(expert_tile *t, const int64_t *offsets,
                                                  const int32_t *tile_offsets, int E) {
    if ((int)blockIdx.x >= tile_offsets[E]) return false;
    *t = find_expert_tile(offsets, tile_offsets, E, (int)blockIdx.x);
    return true;
}

/* Starts the copies of k-slice kt of the tile's operands into a stage: a's
 * BM rows from t.row0, then, b_offset elements on, the BN rows of expert
 * t.e's b from column n0. */
template <int BK, typename Layout>
static __device__ __forceinline__ void load_stage(__nv_bfloat16 *stage, int b_offset,
                                                  const expert_tile &t, const __nv_bfloat16 *a,
                                                  const __nv_bfloat16 *b, int64_t n0, int64_t n,
                                                  int64_t k, int kt) {
    load_slice<BM, BK, Layout>(stage, a + t.row0 * k, t.rows, k, (int64_t)kt * BK);
    load_slice<BN, BK, Layout>(stage + b_offset, b + ((int64_t)t.e * n + n0) * k, n - n0, k,
                               (int64_t)kt * BK);
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

/* A 16 x 8 accumulator fragment v (mma.sync's and, per 8 columns, wgmma's
 * layout): {c[r][col], c[r][col + 1], c[r + 8][col], c[r + 8][col + 1]}
 * into c [rows, n], rows past rows left alone. */
template <typename OutT>
static __device__ __forceinline__ void store_fragment(OutT *c, int rows, int r, int64_t col,
                                                      int64_t n, const float *v) {
    if (r < rows) store_pair(c + r * n + col, col, n, v[0], v[1]);
    if (r + 8 < rows) store_pair(c + (r + 8) * n + col, col, n, v[2], v[3]);
}

template <typename OutT>
static __global__ void __launch_bounds__(THREADS)
    grouped_mma_kernel(OutT *c, const __nv_bfloat16 *a, const __nv_bfloat16 *b,
                       const int64_t *offsets, const int32_t *tile_offsets, int E, int64_t n,
                       int64_t k) {
    MOE_DYNAMIC_SHARED(__nv_bfloat16, mma_shared);
    expert_tile t;
    if (!block_tile(&t, offsets, tile_offsets, E)) return;
    const int64_t n0 = (int64_t)blockIdx.y * BN;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int wm = warp >> 2, wn = warp & 3; /* the warp's tile in the 2 x 4 grid */
    const int ktiles = (int)((k + MMA_BK - 1) / MMA_BK);
    auto load = [&](int slot, int kt) {
        load_stage<MMA_BK, padded_rows>(mma_shared + slot * MMA_STAGE_ELEMS, BM * MMA_LD, t, a, b,
                                        n0, n, k, kt);
    };

    float acc[MI][NI][4];
#pragma unroll
    for (int i = 0; i < MI; i++)
#pragma unroll
        for (int j = 0; j < NI; j++)
#pragma unroll
            for (int v = 0; v < 4; v++) acc[i][j][v] = 0.0f;

#pragma unroll
    for (int s = 0; s < MMA_STAGES - 1; s++) {
        if (s < ktiles) load(s, s);
        moe_cp_async_commit();
    }
    for (int kt = 0; kt < ktiles; kt++) {
        moe_cp_async_wait<MMA_STAGES - 2>(); /* stage kt has landed */
        __syncthreads();                     /* and every warp is done with stage kt - 1 */
        const int next = kt + MMA_STAGES - 1;
        if (next < ktiles) load(next % MMA_STAGES, next);
        moe_cp_async_commit();

        const __nv_bfloat16 *sa = mma_shared + (kt % MMA_STAGES) * MMA_STAGE_ELEMS;
        const __nv_bfloat16 *sb = sa + BM * MMA_LD;
#pragma unroll
        for (int ks = 0; ks < MMA_BK; ks += 16) {
            uint32_t af[MI][4], bf[NI][2];
#pragma unroll
            for (int mi = 0; mi < MI; mi++) {
                const int r = wm * WARP_M + mi * 16 + (lane & 15), col = ks + (lane >> 4) * 8;
                moe_ldmatrix_x4(af[mi], sa + r * MMA_LD + col);
            }
#pragma unroll
            for (int nj = 0; nj < NI / 2; nj++) {
                const int r = wn * WARP_N + nj * 16 + (lane & 7) + ((lane >> 4) << 3);
                const int col = ks + ((lane >> 3) & 1) * 8;
                uint32_t q[4];
                moe_ldmatrix_x4(q, sb + r * MMA_LD + col);
                bf[2 * nj][0] = q[0], bf[2 * nj][1] = q[1];
                bf[2 * nj + 1][0] = q[2], bf[2 * nj + 1][1] = q[3];
            }
#pragma unroll
            for (int mi = 0; mi < MI; mi++)
#pragma unroll
                for (int ni = 0; ni < NI; ni++) moe_mma_bf16(acc[mi][ni], af[mi], bf[ni]);
        }
    }
    moe_cp_async_wait<0>();

    OutT *c_tile = c + t.row0 * n;
#pragma unroll
    for (int mi = 0; mi < MI; mi++)
#pragma unroll
        for (int ni = 0; ni < NI; ni++)
            store_fragment(c_tile, t.rows, wm * WARP_M + mi * 16 + (lane >> 2),
                           n0 + wn * WARP_N + ni * 8 + 2 * (lane & 3), n, acc[mi][ni]);
}

/* The same product on Hopper's warpgroup MMA. Per k-slice: every thread
 * lands its copies, fences them to the async proxy that wgmma reads
 * through, and the block meets; each warpgroup issues four m64n256k16 on
 * the slice and waits for the previous slice's, and once the block meets
 * again that slice's stage is refilled. So one slice's MMA runs while the
 * copies of the next three are in flight. */
template <typename OutT>
static __global__ void __launch_bounds__(THREADS)
    grouped_wgmma_kernel(OutT *c, const __nv_bfloat16 *a, const __nv_bfloat16 *b,
                         const int64_t *offsets, const int32_t *tile_offsets, int E, int64_t n,
                         int64_t k) {
    MOE_DYNAMIC_SHARED(__nv_bfloat16, wgmma_shared);
    expert_tile t;
    if (!block_tile(&t, offsets, tile_offsets, E)) return;
    const int64_t n0 = (int64_t)blockIdx.y * BN;
    const uint32_t misalign = moe_shared_address(wgmma_shared) % 1024;
    __nv_bfloat16 *stages = wgmma_shared + (misalign ? (1024 - misalign) / 2 : 0);
    const uint32_t stages_addr = moe_shared_address(stages);
    const int wg = threadIdx.x / 128, lane = threadIdx.x & 31, warp = (threadIdx.x / 32) & 3;
    const int ktiles = (int)((k + WG_BK - 1) / WG_BK);
    auto load = [&](int slot, int kt) {
        load_stage<WG_BK, swizzled_rows>(stages + slot * WG_STAGE_ELEMS, BM * WG_BK, t, a, b, n0,
                                         n, k, kt);
    };

    /* d[4j .. 4j + 3] is the 16 x 8 fragment of columns 8j of the warp's 16 rows. */
    float acc[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; i++) acc[i] = 0.0f;
    moe_wgmma_fence_operands(acc, BN / 2); /* zeroed before the first wgmma.fence */

#pragma unroll
    for (int s = 0; s < WG_STAGES - 1; s++) {
        if (s < ktiles) load(s, s);
        moe_cp_async_commit();
    }
    for (int kt = 0; kt < ktiles; kt++) {
        moe_cp_async_wait<WG_STAGES - 2>(); /* my copies of stage kt have landed */
        moe_fence_proxy_async();            /* where wgmma's reads see them */
        __syncthreads();                    /* and everyone's have */
        const uint32_t sa = stages_addr + (uint32_t)((kt % WG_STAGES) * WG_STAGE_ELEMS * 2);
        const uint32_t a_rows = sa + wg * 64 * WG_ROW_BYTES, b_rows = sa + BM * WG_ROW_BYTES;
        moe_wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < WG_BK / 16; ks++)
            moe_wgmma_m64n256k16(acc, sw128_descriptor(a_rows + 32 * ks),
                                 sw128_descriptor(b_rows + 32 * ks), 1);
        moe_wgmma_commit();
        moe_wgmma_wait<1>(); /* this warpgroup is done with stage kt - 1 */
        __syncthreads();     /* and so is the other */
        const int next = kt + WG_STAGES - 1;
        if (next < ktiles) load(next % WG_STAGES, next);
        moe_cp_async_commit();
    }
    moe_wgmma_wait<0>();
    moe_wgmma_fence_operands(acc, BN / 2);
    moe_cp_async_wait<0>();

    OutT *c_tile = c + t.row0 * n;
    const int r = wg * 64 + warp * 16 + (lane >> 2);
#pragma unroll
    for (int j = 0; j < BN / 8; j++)
        store_fragment(c_tile, t.rows, r, n0 + 8 * j + 2 * (lane & 3), n, acc + 4 * j);
}

/* The wgmma product again, warp-specialized: warpgroup 0 only loads, one
 * thread issuing two TMA tile copies per k-slice (A's 128 and B's 256 rows
 * of 64 k, landed in the 128-byte swizzle by the copy engine itself), and
 * warpgroups 1 and 2 only multiply, 64 rows each. Each stage has two
 * mbarriers: full completes when its copies' bytes have landed, empty when
 * both consumers are done reading it, so neither side waits on the other's
 * instructions, only on data. setmaxnreg moves registers from the producer
 * (which needs few) to the consumers' accumulators. TMA rows past a
 * tensor's end come back zero; rows of the next expert or columns of the
 * next expert's weights are read and their results dropped.
 *
 * Persistent: a block takes tiles gridDim.x apart until none is left, the
 * stages and their barrier phases running on from tile to tile, so the
 * producer loads the next tile while the consumers store the last one.
 * Tiles go in groups of RASTER_M m-tiles, every n-tile of a group before
 * the next group, so the blocks at work at once share a few row tiles of
 * a and the weight tiles of few experts in L2. */
#define WS_THREADS 384
#define WS_STAGE_BYTES (WG_STAGE_ELEMS * 2)
#define WS_SMEM_BYTES (WG_STAGES * WS_STAGE_BYTES + 1024 + 2 * WG_STAGES * 8)
#define RASTER_M 8

/* Tile number tile of m_tiles x n_tiles in the grouped order above. */
static __device__ __forceinline__ void raster_tile(int *m_tile, int *n_tile, int tile, int m_tiles,
                                                   int n_tiles) {
    const int group = tile / (RASTER_M * n_tiles), first = group * RASTER_M;
    const int rows = min(RASTER_M, m_tiles - first), in = tile - group * RASTER_M * n_tiles;
    *m_tile = first + in % rows;
    *n_tile = in / rows;
}

template <typename OutT>
static __global__ void __launch_bounds__(WS_THREADS, 1)
    grouped_wgmma_tma_kernel(OutT *c, const __grid_constant__ CUtensorMap a_map,
                             const __grid_constant__ CUtensorMap b_map, const int64_t *offsets,
                             const int32_t *tile_offsets, int E, int64_t n, int64_t k) {
    MOE_DYNAMIC_SHARED(__nv_bfloat16, ws_shared);
    const int m_tiles = tile_offsets[E], n_tiles = (int)((n + BN - 1) / BN);
    const int tiles = m_tiles * n_tiles;
    if ((int)blockIdx.x >= tiles) return;

    const uint32_t misalign = moe_shared_address(ws_shared) % 1024;
    __nv_bfloat16 *stages = ws_shared + (misalign ? (1024 - misalign) / 2 : 0);
    uint64_t *full = (uint64_t *)(stages + WG_STAGES * WG_STAGE_ELEMS), *empty = full + WG_STAGES;
    const int wg = threadIdx.x / 128, lane = threadIdx.x & 31, warp = (threadIdx.x / 32) & 3;
    const int ktiles = (int)((k + WG_BK - 1) / WG_BK);

    if (threadIdx.x == 0) {
        for (int s = 0; s < WG_STAGES; s++) {
            moe_mbarrier_init(&full[s], 1);  /* the producer's arrive, with the bytes */
            moe_mbarrier_init(&empty[s], 2); /* one arrive per consumer warpgroup */
        }
        moe_fence_mbarrier_init();
    }
    __syncthreads();

    /* it counts k-slices over the block's tiles: slice it uses stage
     * it % WG_STAGES for the (it / WG_STAGES)-th time. */
    if (wg == 0) {
        moe_setmaxnreg_dec<40>();
        if (threadIdx.x == 0)
            for (int tile = blockIdx.x, it = 0; tile < tiles; tile += gridDim.x) {
                int m_tile, n_tile;
                raster_tile(&m_tile, &n_tile, tile, m_tiles, n_tiles);
                const expert_tile t = find_expert_tile(offsets, tile_offsets, E, m_tile);
                const int b_row = (int)(t.e * n + (int64_t)n_tile * BN);
                for (int kt = 0; kt < ktiles; kt++, it++) {
                    const int s = it % WG_STAGES;
                    /* Use u of a stage waits for the consumers' release of use u - 1. */
                    if (it >= WG_STAGES) moe_mbarrier_wait(&empty[s], (it / WG_STAGES - 1) & 1);
                    moe_mbarrier_arrive_expect_tx(&full[s], WS_STAGE_BYTES);
                    __nv_bfloat16 *sa = stages + s * WG_STAGE_ELEMS;
                    moe_tma_load_2d(sa, &a_map, kt * WG_BK, (int)t.row0, &full[s]);
                    moe_tma_load_2d(sa + BM * WG_BK, &b_map, kt * WG_BK, b_row, &full[s]);
                }
            }
        return;
    }

    moe_setmaxnreg_inc<232>();
    const int cw = wg - 1; /* the consumer's 64 rows */
    const uint32_t stages_addr = moe_shared_address(stages);
    const bool releases = threadIdx.x % 128 == 0; /* one arrive per warpgroup */
    float acc[BN / 2]; /* as in grouped_wgmma_kernel */
    for (int tile = blockIdx.x, it = 0; tile < tiles; tile += gridDim.x) {
        int m_tile, n_tile;
        raster_tile(&m_tile, &n_tile, tile, m_tiles, n_tiles);
        const expert_tile t = find_expert_tile(offsets, tile_offsets, E, m_tile);
#pragma unroll
        for (int i = 0; i < BN / 2; i++) acc[i] = 0.0f;
        moe_wgmma_fence_operands(acc, BN / 2);
        for (int kt = 0; kt < ktiles; kt++, it++) {
            const int s = it % WG_STAGES;
            moe_mbarrier_wait(&full[s], (it / WG_STAGES) & 1);
            const uint32_t sa = stages_addr + (uint32_t)(s * WS_STAGE_BYTES);
            const uint32_t a_rows = sa + cw * 64 * WG_ROW_BYTES, b_rows = sa + BM * WG_ROW_BYTES;
            moe_wgmma_fence();
#pragma unroll
            for (int ks = 0; ks < WG_BK / 16; ks++)
                moe_wgmma_m64n256k16(acc, sw128_descriptor(a_rows + 32 * ks),
                                     sw128_descriptor(b_rows + 32 * ks), 1);
            moe_wgmma_commit();
            moe_wgmma_wait<1>(); /* slice it - 1 is done: its stage goes back */
            if (kt > 0 && releases) moe_mbarrier_arrive(&empty[(it - 1) % WG_STAGES]);
        }
        moe_wgmma_wait<0>();
        moe_wgmma_fence_operands(acc, BN / 2);
        /* The tile's last stage goes back before the stores, so the
         * producer fills it for the next tile meanwhile. */
        if (releases) moe_mbarrier_arrive(&empty[(it - 1) % WG_STAGES]);

        OutT *c_tile = c + t.row0 * n;
        const int r = cw * 64 + warp * 16 + (lane >> 2);
        const int64_t n0 = (int64_t)n_tile * BN;
#pragma unroll
        for (int j = 0; j < BN / 8; j++)
            store_fragment(c_tile, t.rows, r, n0 + 8 * j + 2 * (lane & 3), n, acc + 4 * j);
    }
}

#endif /* MOE_KERNELS_CUDA_GROUPED_MMA_KERNELS_CUH */
