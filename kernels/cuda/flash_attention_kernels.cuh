/* flash_attention_kernels.cuh: the device code of flash_attention.cu,
 * which says what it computes. It includes nothing: the file that includes
 * it provides the device environment (kernels/cuda/common.cuh on a GPU
 * build; tests/simt_emu.h, which runs it on the CPU, in
 * tests/test_flash_emulated.cpp). */
#ifndef MOE_KERNELS_CUDA_FLASH_ATTENTION_KERNELS_CUH
#define MOE_KERNELS_CUDA_FLASH_ATTENTION_KERNELS_CUH

#define FA_WARPS 4
#define FA_ROWS (16 * FA_WARPS) /* rows a block owns: queries (forward, dq) or keys (dk, dv) */
#define FA_PAD 8                /* bf16 past each shared row: conflict-free fragment loads */

/* The streamed side's rows per tile: 64, or 32 at a head size of 128, so
 * that a block's tiles stay within the 48 KB of static shared memory and
 * its fragments and sums within the registers. */
#define FA_TILE(hd) ((hd) <= 64 ? 64 : 32)

template <int W> using bf16_rows = __nv_bfloat16 (*)[W];

static __device__ __forceinline__ uint32_t ld_pair(const __nv_bfloat16 *p) {
    return *(const uint32_t *)p;
}

static __device__ __forceinline__ uint32_t pack_pair(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *(uint32_t *)&v;
}

/* rows [N][HD] of fp32 rows at src + r * stride, rows r >= valid as zeros,
 * into dst [N][HD + FA_PAD] and, when given, transposed into
 * dst_t [HD][N + FA_PAD]. Plain 4-byte loads (neighbouring threads read
 * neighbouring floats), so no row needs more than a float's alignment. */
template <int HD, int N>
static __device__ void load_tile(bf16_rows<HD + FA_PAD> dst, bf16_rows<N + FA_PAD> dst_t,
                                 const float *src, int64_t stride, int64_t valid) {
    for (int i = threadIdx.x; i < N * HD / 2; i += FA_WARPS * 32) {
        const int r = i / (HD / 2), c = 2 * (i % (HD / 2));
        const float *p = src + r * stride + c;
        const float x = r < valid ? p[0] : 0.0f, y = r < valid ? p[1] : 0.0f;
        if (dst) *(__nv_bfloat162 *)&dst[r][c] = __floats2bfloat162_rn(x, y);
        if (dst_t) {
            dst_t[c][r] = __float2bfloat16_rn(x);
            dst_t[c + 1][r] = __float2bfloat16_rn(y);
        }
    }
}

/* p[0..1] += (x, y), or = when add is false. */
static __device__ __forceinline__ void put_pair(float *p, float x, float y, bool add) {
    p[0] = add ? p[0] + x : x;
    p[1] = add ? p[1] + y : y;
}

/* Half i of a 16-row accumulator acc [HD / 8][4] (its row lane / 4 + 8 i)
 * times scale into row, a row of HD floats: written, or added when add. */
template <int HD>
static __device__ __forceinline__ void put_acc_row(float *row, const float (*acc)[4], int i,
                                                   int lane, float scale, bool add) {
#pragma unroll
    for (int nd = 0; nd < HD / 8; nd++)
        put_pair(row + nd * 8 + (lane & 3) * 2, acc[nd][2 * i] * scale, acc[nd][2 * i + 1] * scale,
                 add);
}

/* The A fragment of rows r0.. r0 + 15, columns k0 .. k0 + 15 of a
 * row-major tile. */
template <int W>
static __device__ __forceinline__ void frag_a(uint32_t *a, bf16_rows<W> t, int r0, int k0, int lane) {
    const int g = lane >> 2, c = (lane & 3) * 2;
    a[0] = ld_pair(&t[r0 + g][k0 + c]);
    a[1] = ld_pair(&t[r0 + g + 8][k0 + c]);
    a[2] = ld_pair(&t[r0 + g][k0 + c + 8]);
    a[3] = ld_pair(&t[r0 + g + 8][k0 + c + 8]);
}

/* The B fragment (16 x 8) whose element (k, n) is t[n0 + n][k0 + k]: the
 * rows of t are B's columns. */
template <int W>
static __device__ __forceinline__ void frag_b(uint32_t *b, bf16_rows<W> t, int n0, int k0, int lane) {
    const int g = lane >> 2, c = (lane & 3) * 2;
    b[0] = ld_pair(&t[n0 + g][k0 + c]);
    b[1] = ld_pair(&t[n0 + g][k0 + c + 8]);
}

/* The A fragment of the 16 columns that the C fragments lo and hi (8
 * columns each, neighbours) hold. */
static __device__ __forceinline__ void c_to_a(uint32_t *a, const float *lo, const float *hi) {
    a[0] = pack_pair(lo[0], lo[1]);
    a[1] = pack_pair(lo[2], lo[3]);
    a[2] = pack_pair(hi[0], hi[1]);
    a[3] = pack_pair(hi[2], hi[3]);
}

/* acc [16, N] = a-fragments [16, K] x the tile t's rows n0 .. n0 + N - 1
 * (B = t^T), K = 16 KS. */
template <int KS, int N, int W>
static __device__ __forceinline__ void mma_rows(float (*acc)[4], uint32_t (*a)[4], bf16_rows<W> t,
                                                int lane) {
#pragma unroll
    for (int kk = 0; kk < KS; kk++)
#pragma unroll
        for (int nb = 0; nb < N / 8; nb++) {
            uint32_t b[2];
            frag_b(b, t, nb * 8, kk * 16, lane);
            moe_mma_bf16(acc[nb], a[kk], b);
        }
}

/* acc [16, N] += p [16, K] x u [K, N], p in C fragments (K / 8 of them),
 * u given transposed: ut [N][K + FA_PAD]. */
template <int K, int N, int W>
static __device__ __forceinline__ void mma_c_by(float (*acc)[4], float (*p)[4], bf16_rows<W> ut,
                                                int lane) {
#pragma unroll
    for (int kk = 0; kk < K / 16; kk++) {
        uint32_t a[4];
        c_to_a(a, p[2 * kk], p[2 * kk + 1]);
#pragma unroll
        for (int nb = 0; nb < N / 8; nb++) {
            uint32_t b[2];
            frag_b(b, ut, nb * 8, kk * 16, lane);
            moe_mma_bf16(acc[nb], a, b);
        }
    }
}

/* f [HD / 16] = the A fragments of the warp's 16 rows of the block of
 * FA_ROWS rows at src (fp32, stride, valid rows), staged through the
 * shared tile t, which is free again on return. */
template <int HD>
static __device__ __forceinline__ void stage_a(uint32_t (*f)[4], bf16_rows<HD + FA_PAD> t, const float *src,
                                               int64_t stride, int64_t valid, int warp, int lane) {
    load_tile<HD, FA_ROWS>(t, nullptr, src, stride, valid);
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk++) frag_a(f[kk], t, warp * 16, kk * 16, lane);
    __syncthreads(); /* every warp has its fragments before t is written again */
}

/* Row and column of element e of a lane's C fragment, in its 16 x 8 block. */
static __device__ __forceinline__ int frag_row(int lane, int e) { return (lane >> 2) + (e >> 1) * 8; }
static __device__ __forceinline__ int frag_col(int lane, int e) { return (lane & 3) * 2 + (e & 1); }

/* Whether query row sees key: at or before it, within the window (window
 * keys end at the row; 0: every key), both inside the sequence. */
static __device__ __forceinline__ bool sees(int64_t row, int64_t key, int64_t T, int64_t window) {
    return key <= row && row < T && (window == 0 || row - key < window);
}

/* The first key a block of queries from q0 on needs, rounded down to a
 * whole tile of the streamed side. */
static __device__ __forceinline__ int64_t first_key_tile(int64_t q0, int64_t window, int tile) {
    const int64_t lo = window > 0 && q0 >= window ? q0 - window + 1 : 0;
    return lo / tile * tile;
}

/* Over the four lanes that share a fragment row. */
static __device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(MOE_FULL_MASK, x, 1));
    return fmaxf(x, __shfl_xor_sync(MOE_FULL_MASK, x, 2));
}

static __device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(MOE_FULL_MASK, x, 1);
    return x + __shfl_xor_sync(MOE_FULL_MASK, x, 2);
}

/* ---------------------------------------------------------------- forward */

/* Block (query tile, head, batch). lse [B, Hq, T]; out and out_copy
 * [B, T, Hq, HD]. */
template <int HD>
static __global__ void __launch_bounds__(FA_WARPS * 32)
    flash_forward_kernel(float *out, float *lse, float *out_copy, const float *q, const float *k,
                         const float *v, int64_t T, int64_t Hq, int64_t Hkv, int64_t window,
                         float scale) {
    constexpr int TILE = FA_TILE(HD);
    __shared__ __nv_bfloat16 sq[FA_ROWS][HD + FA_PAD];
    __shared__ __nv_bfloat16 sk[TILE][HD + FA_PAD];
    __shared__ __nv_bfloat16 svt[HD][TILE + FA_PAD];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t q0 = (int64_t)blockIdx.x * FA_ROWS, h = blockIdx.y, b = blockIdx.z;
    const int64_t kvh = h / (Hq / Hkv), qs = Hq * HD, ks = Hkv * HD;
    const float *qb = q + (b * T * Hq + h) * HD; /* row t at qb + t qs */
    const float *kb = k + (b * T * Hkv + kvh) * HD;
    const float *vb = v + (b * T * Hkv + kvh) * HD;

    uint32_t qf[HD / 16][4];
    stage_a<HD>(qf, sq, qb + q0 * qs, qs, T - q0, warp, lane);

    const int64_t row0 = q0 + warp * 16; /* the warp's first query */
    float o[HD / 8][4] = {};
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f}; /* rows g, g + 8 */
    const int64_t last_key = min(q0 + FA_ROWS, T) - 1;
    for (int64_t k0 = first_key_tile(q0, window, TILE); k0 <= last_key; k0 += TILE) {
        __syncthreads(); /* every warp is done with the previous tile */
        load_tile<HD, TILE>(sk, nullptr, kb + k0 * ks, ks, T - k0);
        load_tile<HD, TILE>(nullptr, svt, vb + k0 * ks, ks, T - k0);
        __syncthreads();
        float s[TILE / 8][4] = {};
        mma_rows<HD / 16, TILE>(s, qf, sk, lane);
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int nb = 0; nb < TILE / 8; nb++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int64_t row = row0 + frag_row(lane, e), key = k0 + nb * 8 + frag_col(lane, e);
                const float x = sees(row, key, T, window) ? s[nb][e] * scale : -INFINITY;
                s[nb][e] = x;
                mx[e >> 1] = fmaxf(mx[e >> 1], x);
            }
        /* A row that has seen no key yet (its window starts past this
         * tile, or it is past the end) keeps m = -inf: its exponentials
         * are then taken against 0, giving zeros, not NaN. A tile wholly
         * past a row leaves its max, and adds zeros. */
        float alpha[2], m_ref[2];
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const float m_new = fmaxf(m[i], quad_max(mx[i]));
            m_ref[i] = m_new == -INFINITY ? 0.0f : m_new;
            alpha[i] = __expf(m[i] - m_ref[i]);
            m[i] = m_new;
            l[i] *= alpha[i];
        }
#pragma unroll
        for (int nb = 0; nb < TILE / 8; nb++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const float p = __expf(s[nb][e] - m_ref[e >> 1]);
                s[nb][e] = p;
                l[e >> 1] += p;
            }
#pragma unroll
        for (int nd = 0; nd < HD / 8; nd++)
#pragma unroll
            for (int e = 0; e < 4; e++) o[nd][e] *= alpha[e >> 1];
        mma_c_by<TILE, HD>(o, s, svt, lane);
    }
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int64_t row = row0 + (lane >> 2) + i * 8;
        const float sum = quad_sum(l[i]);
        if (row >= T) continue;
        const float inv = 1.0f / sum;
        const int64_t at = (b * T + row) * qs + h * HD;
        put_acc_row<HD>(out + at, o, i, lane, inv, false);
        put_acc_row<HD>(out_copy + at, o, i, lane, inv, false);
        if ((lane & 3) == 0) lse[(b * Hq + h) * T + row] = m[i] + logf(sum);
    }
}

/* --------------------------------------------------------------- backward */

/* D [B, Hq, T] = rowsum(dout * out): a warp per (b, t, head) row. */
static __global__ void rowdot_kernel(float *D, const float *dout, const float *out, int64_t rows,
                                     int64_t T, int64_t Hq, int64_t hd) {
    const int lane = threadIdx.x & 31;
    for (int64_t r = blockIdx.x * (int64_t)(blockDim.x >> 5) + (threadIdx.x >> 5); r < rows;
         r += (int64_t)gridDim.x * (blockDim.x >> 5)) {
        float s = 0.0f;
        for (int64_t d = lane; d < hd; d += 32) s += dout[r * hd + d] * out[r * hd + d];
        s = moe_warp_sum(s);
        /* r = (b T + t) Hq + h */
        const int64_t h = r % Hq, t = (r / Hq) % T, b = r / (Hq * T);
        if (lane == 0) D[(b * Hq + h) * T + t] = s;
    }
}

/* Block (key block, kv head, batch): dk, dv += the gradients of its keys,
 * over the query heads of the group and the query tiles from its first
 * key to the last query that sees one of its keys. With S^T = k q^T (keys as rows): P^T = exp(scale S^T - lse),
 * dv += P^T dout, dP^T = v dout^T, dS^T = scale P^T (dP^T - D),
 * dk += dS^T q. */
template <int HD>
static __global__ void __launch_bounds__(FA_WARPS * 32)
    flash_dkdv_kernel(float *dk, float *dv, const float *q, const float *k, const float *v,
                      const float *dout, const float *lse, const float *D, int64_t T, int64_t Hq,
                      int64_t Hkv, int64_t window, float scale) {
    constexpr int TILE = FA_TILE(HD);
    /* sq also stages the block's FA_ROWS keys and values first. */
    __shared__ __nv_bfloat16 sq[FA_ROWS > TILE ? FA_ROWS : TILE][HD + FA_PAD];
    __shared__ __nv_bfloat16 sqt[HD][TILE + FA_PAD];
    __shared__ __nv_bfloat16 sdo[TILE][HD + FA_PAD];
    __shared__ __nv_bfloat16 sdot[HD][TILE + FA_PAD];
    __shared__ float slse[TILE], sD[TILE];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t k0 = (int64_t)blockIdx.x * FA_ROWS, kvh = blockIdx.y, b = blockIdx.z;
    const int64_t group = Hq / Hkv, qs = Hq * HD, ks = Hkv * HD;
    const int64_t kv_at = (b * T * Hkv + kvh) * HD + k0 * ks; /* the block's first key row */

    /* The warp's keys and values as A fragments. */
    uint32_t kf[HD / 16][4], vf[HD / 16][4];
    stage_a<HD>(kf, sq, k + kv_at, ks, T - k0, warp, lane);
    stage_a<HD>(vf, sq, v + kv_at, ks, T - k0, warp, lane);

    const int64_t key0 = k0 + warp * 16; /* the warp's first key */
    const int64_t query_end = window > 0 ? min(T, k0 + FA_ROWS - 1 + window) : T;
    float dk_acc[HD / 8][4] = {}, dv_acc[HD / 8][4] = {};
    for (int64_t hh = 0; hh < group; hh++) {
        const int64_t h = kvh * group + hh;
        const float *qb = q + (b * T * Hq + h) * HD, *dob = dout + (b * T * Hq + h) * HD;
        for (int64_t t0 = k0; t0 < query_end; t0 += TILE) {
            __syncthreads(); /* every warp is done with the previous tile */
            load_tile<HD, TILE>(sq, sqt, qb + t0 * qs, qs, T - t0);
            load_tile<HD, TILE>(sdo, sdot, dob + t0 * qs, qs, T - t0);
            for (int i = threadIdx.x; i < TILE; i += FA_WARPS * 32) {
                const bool in = t0 + i < T;
                slse[i] = in ? lse[(b * Hq + h) * T + t0 + i] : 0.0f;
                sD[i] = in ? D[(b * Hq + h) * T + t0 + i] : 0.0f;
            }
            __syncthreads();
            float p[TILE / 8][4] = {}, ds[TILE / 8][4] = {};
            mma_rows<HD / 16, TILE>(p, kf, sq, lane);
#pragma unroll
            for (int nb = 0; nb < TILE / 8; nb++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int64_t key = key0 + frag_row(lane, e);
                    const int j = nb * 8 + frag_col(lane, e);
                    const int64_t query = t0 + j;
                    p[nb][e] = sees(query, key, T, window) ? __expf(p[nb][e] * scale - slse[j])
                                                           : 0.0f;
                }
            mma_c_by<TILE, HD>(dv_acc, p, sdot, lane);
            mma_rows<HD / 16, TILE>(ds, vf, sdo, lane);
#pragma unroll
            for (int nb = 0; nb < TILE / 8; nb++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int j = nb * 8 + frag_col(lane, e);
                    ds[nb][e] = scale * p[nb][e] * (ds[nb][e] - sD[j]);
                }
            mma_c_by<TILE, HD>(dk_acc, ds, sqt, lane);
        }
    }
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int64_t key = key0 + (lane >> 2) + i * 8;
        if (key >= T) continue;
        const int64_t at = (b * T + key) * ks + kvh * HD;
        put_acc_row<HD>(dk + at, dk_acc, i, lane, 1.0f, true);
        put_acc_row<HD>(dv + at, dv_acc, i, lane, 1.0f, true);
    }
}

/* Block (query tile, head, batch): dq += scale dS k over the key tiles its
 * queries see, with dS = P (dP - D), P = exp(scale q k^T - lse),
 * dP = dout v^T. */
template <int HD>
static __global__ void __launch_bounds__(FA_WARPS * 32)
    flash_dq_kernel(float *dq, const float *q, const float *k, const float *v, const float *dout,
                    const float *lse, const float *D, int64_t T, int64_t Hq, int64_t Hkv,
                    int64_t window, float scale) {
    constexpr int TILE = FA_TILE(HD);
    /* sk also stages the block's FA_ROWS queries and output gradients first. */
    __shared__ __nv_bfloat16 sk[FA_ROWS > TILE ? FA_ROWS : TILE][HD + FA_PAD];
    __shared__ __nv_bfloat16 skt[HD][TILE + FA_PAD];
    __shared__ __nv_bfloat16 sv[TILE][HD + FA_PAD];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t q0 = (int64_t)blockIdx.x * FA_ROWS, h = blockIdx.y, b = blockIdx.z;
    const int64_t kvh = h / (Hq / Hkv), qs = Hq * HD, ks = Hkv * HD;
    const int64_t q_at = (b * T * Hq + h) * HD + q0 * qs;
    const float *kb = k + (b * T * Hkv + kvh) * HD, *vb = v + (b * T * Hkv + kvh) * HD;

    /* The warp's queries and output gradients as A fragments. */
    uint32_t qf[HD / 16][4], dof[HD / 16][4];
    stage_a<HD>(qf, sk, q + q_at, qs, T - q0, warp, lane);
    stage_a<HD>(dof, sk, dout + q_at, qs, T - q0, warp, lane);

    const int64_t row0 = q0 + warp * 16;
    float row_lse[2], row_D[2];
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int64_t row = row0 + (lane >> 2) + i * 8;
        row_lse[i] = row < T ? lse[(b * Hq + h) * T + row] : 0.0f;
        row_D[i] = row < T ? D[(b * Hq + h) * T + row] : 0.0f;
    }
    float dq_acc[HD / 8][4] = {};
    const int64_t last_key = min(q0 + FA_ROWS, T) - 1;
    for (int64_t k0 = first_key_tile(q0, window, TILE); k0 <= last_key; k0 += TILE) {
        __syncthreads(); /* every warp is done with the previous tile */
        load_tile<HD, TILE>(sk, skt, kb + k0 * ks, ks, T - k0);
        load_tile<HD, TILE>(sv, nullptr, vb + k0 * ks, ks, T - k0);
        __syncthreads();
        float p[TILE / 8][4] = {}, ds[TILE / 8][4] = {};
        mma_rows<HD / 16, TILE>(p, qf, sk, lane);
        mma_rows<HD / 16, TILE>(ds, dof, sv, lane);
#pragma unroll
        for (int nb = 0; nb < TILE / 8; nb++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int64_t row = row0 + frag_row(lane, e), key = k0 + nb * 8 + frag_col(lane, e);
                const float pe = sees(row, key, T, window)
                                     ? __expf(p[nb][e] * scale - row_lse[e >> 1])
                                     : 0.0f;
                ds[nb][e] = scale * pe * (ds[nb][e] - row_D[e >> 1]);
            }
        mma_c_by<TILE, HD>(dq_acc, ds, skt, lane);
    }
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int64_t row = row0 + (lane >> 2) + i * 8;
        if (row >= T) continue;
        put_acc_row<HD>(dq + (b * T + row) * qs + h * HD, dq_acc, i, lane, 1.0f, true);
    }
}

#endif /* MOE_KERNELS_CUDA_FLASH_ATTENTION_KERNELS_CUH */
