/* simt_emu.h: runs CUDA kernel source on the CPU, for the tests of a build
 * with no GPU. Each CUDA thread of a block is a std::thread; __syncthreads
 * is a barrier over the block, and a warp's exchanges (shuffles, mma.sync)
 * meet at a barrier over its 32 threads. Blocks run one after another, so a
 * kernel's __shared__ arrays become function statics that the block's
 * threads share.
 *
 * What a kernel may use: threadIdx, blockIdx, blockDim, gridDim,
 * __syncthreads, __syncwarp, __shfl_sync and __shfl_xor_sync (with every
 * lane of the warp taking part), moe_warp_sum, moe_warp_max, atomicAdd on
 * ints, MOE_DYNAMIC_SHARED, moe_cp_async16 and its commit and wait (copies
 * land only when a wait covers them), moe_ldmatrix_x4 and moe_mma_bf16
 * (their fragment layouts are those of the PTX ISA, rebuilt here from the
 * 32 lanes' registers), float2, and bf16 conversions that round to nearest
 * even as the device does. Dynamic shared memory starts as 0xFF bytes (NaN
 * as floats, bf16 or fp32), so a read before a write shows; cp.async and
 * ldmatrix must touch 16-byte aligned pieces of it. Slow, and meant for
 * small sizes. */
#ifndef MOE_TESTS_SIMT_EMU_H
#define MOE_TESTS_SIMT_EMU_H

#include <algorithm>
#include <barrier>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <thread>
#include <vector>

using std::max;
using std::min;

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};

inline thread_local dim3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(threads)
#define __shared__ static
#define MOE_FULL_MASK 0xffffffffu

struct __nv_bfloat16 {
    uint16_t bits;
};
struct float2 {
    float x, y;
};
inline float2 make_float2(float x, float y) { return {x, y}; }
struct __nv_bfloat162 {
    __nv_bfloat16 x, y;
};

/* Round to nearest even (the inputs are finite). */
inline uint16_t emu_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

inline float emu_from_bf16(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

inline __nv_bfloat16 __float2bfloat16_rn(float f) { return {emu_to_bf16(f)}; }
inline __nv_bfloat162 __floats2bfloat162_rn(float lo, float hi) {
    return {{emu_to_bf16(lo)}, {emu_to_bf16(hi)}};
}
inline float __expf(float x) { return expf(x); }

/* What the threads of the running block share. */
struct emu_block {
    std::vector<unsigned char> dynamic_shared; /* the launch's, 0xFF before the kernel runs */
    std::barrier<> *block;
    std::vector<std::barrier<> *> warp;
    std::vector<uint64_t> lane_bits;   /* [warps * 32] shuffled values */
    std::vector<uint32_t> lane_a;      /* [warps * 32 * 4] */
    std::vector<uint32_t> lane_b;      /* [warps * 32 * 2] */
};

inline emu_block *emu_running;

inline int emu_lane() { return (int)(threadIdx.x & 31); }
inline int emu_warp() { return (int)(threadIdx.x >> 5); }

inline void __syncthreads() { emu_running->block->arrive_and_wait(); }
inline void __syncwarp() { emu_running->warp[emu_warp()]->arrive_and_wait(); }

/* x of lane src (of the calling lane's warp), each lane naming its own. */
template <typename T> T __shfl_sync(unsigned, T x, int src) {
    static_assert(sizeof(T) <= sizeof(uint64_t), "a shuffle moves at most 8 bytes");
    uint64_t *lanes = &emu_running->lane_bits[emu_warp() * 32];
    memcpy(&lanes[emu_lane()], &x, sizeof x);
    __syncwarp();
    T got;
    memcpy(&got, &lanes[src & 31], sizeof got);
    __syncwarp();
    return got;
}

template <typename T> T __shfl_xor_sync(unsigned mask, T x, int lane_mask) {
    return __shfl_sync(mask, x, emu_lane() ^ lane_mask);
}

template <typename T, int G = 32> T moe_warp_sum(T v) {
    for (int o = G / 2; o > 0; o >>= 1) v += __shfl_xor_sync(MOE_FULL_MASK, v, o);
    return v;
}

template <int G = 32> float moe_warp_max(float v) {
    for (int o = G / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(MOE_FULL_MASK, v, o));
    return v;
}

inline int atomicAdd(int *p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }

#define MOE_DYNAMIC_SHARED(type, name) type *name = (type *)emu_running->dynamic_shared.data()

/* A 16-byte access into shared memory must be aligned and inside the
 * launch's dynamic shared memory (where the kernels keep what cp.async and
 * ldmatrix touch); anything else stops the test, as it would fault or read
 * garbage on a device. */
inline void emu_check_shared16(const void *p, const char *what) {
    const unsigned char *base = emu_running->dynamic_shared.data(), *b = (const unsigned char *)p;
    if ((uintptr_t)p % 16 != 0 || b < base || b + 16 > base + emu_running->dynamic_shared.size()) {
        fprintf(stderr, "simt_emu: %s at %p is not a 16-byte aligned piece of the dynamic shared memory\n", what, p);
        abort();
    }
}

/* cp.async as the device orders it: a copy reads its source when issued
 * and lands only when a wait covers its group, so a kernel that reads a
 * stage before waiting for it reads the stage's old bytes here too. */
struct emu_copy {
    unsigned char *dst;
    unsigned char bytes[16];
};
inline thread_local std::vector<emu_copy> emu_open_copies;                 /* not committed yet */
inline thread_local std::deque<std::vector<emu_copy>> emu_committed_copies; /* oldest first */

inline void moe_cp_async16(void *dst, const void *src, int src_bytes) {
    if (src_bytes != 0 && src_bytes != 16) {
        fprintf(stderr, "simt_emu: cp.async of %d bytes (the kernels copy 16 or zero-fill)\n", src_bytes);
        abort();
    }
    emu_check_shared16(dst, "cp.async destination");
    if (src_bytes > 0 && (uintptr_t)src % 16 != 0) {
        fprintf(stderr, "simt_emu: cp.async source %p is not 16-byte aligned\n", src);
        abort();
    }
    emu_copy c = {(unsigned char *)dst, {0}};
    if (src_bytes > 0) memcpy(c.bytes, src, 16);
    emu_open_copies.push_back(c);
}

inline void moe_cp_async_commit() {
    emu_committed_copies.push_back(std::move(emu_open_copies));
    emu_open_copies.clear();
}

/* Lands every committed group but the newest N. */
template <int N> void moe_cp_async_wait() {
    while (emu_committed_copies.size() > (size_t)N) {
        for (const emu_copy &c : emu_committed_copies.front()) memcpy(c.dst, c.bytes, sizeof c.bytes);
        emu_committed_copies.pop_front();
    }
}

/* ldmatrix .x4: lanes 8i .. 8i + 7 name the rows of matrix i; lane l gets
 * the pair at row l / 4, columns 2 (l % 4) of each. */
inline void moe_ldmatrix_x4(uint32_t *r, const void *row) {
    emu_check_shared16(row, "ldmatrix row");
    uint64_t *lanes = &emu_running->lane_bits[emu_warp() * 32];
    const uint64_t mine = (uint64_t)(uintptr_t)row;
    lanes[emu_lane()] = mine;
    __syncwarp();
    for (int i = 0; i < 4; i++) {
        const unsigned char *p = (const unsigned char *)(uintptr_t)lanes[8 * i + emu_lane() / 4];
        memcpy(&r[i], p + 4 * (emu_lane() % 4), sizeof r[i]);
    }
    __syncwarp();
}

/* c [16x8] += a [16x16] b [16x8], bf16 products summed in fp32 (in an
 * order of its own, as the tensor cores have theirs). */
inline void moe_mma_bf16(float *c, const uint32_t *a, const uint32_t *b) {
    uint32_t *la = &emu_running->lane_a[emu_warp() * 32 * 4];
    uint32_t *lb = &emu_running->lane_b[emu_warp() * 32 * 2];
    memcpy(la + emu_lane() * 4, a, 4 * sizeof *a);
    memcpy(lb + emu_lane() * 2, b, 2 * sizeof *b);
    __syncwarp();
    float A[16][16], B[16][8];
    for (int t = 0; t < 32; t++) {
        const int g = t >> 2, c2 = (t & 3) * 2;
        const uint32_t *ra = la + t * 4, *rb = lb + t * 2;
        const int a_row[4] = {g, g + 8, g, g + 8}, a_col[4] = {c2, c2, c2 + 8, c2 + 8};
        for (int r = 0; r < 4; r++) {
            A[a_row[r]][a_col[r]] = emu_from_bf16((uint16_t)(ra[r] & 0xFFFFu));
            A[a_row[r]][a_col[r] + 1] = emu_from_bf16((uint16_t)(ra[r] >> 16));
        }
        for (int r = 0; r < 2; r++) {
            B[c2 + 8 * r][g] = emu_from_bf16((uint16_t)(rb[r] & 0xFFFFu));
            B[c2 + 8 * r + 1][g] = emu_from_bf16((uint16_t)(rb[r] >> 16));
        }
    }
    __syncwarp();
    const int g = emu_lane() >> 2, c2 = (emu_lane() & 3) * 2;
    const int row[4] = {g, g, g + 8, g + 8}, col[4] = {c2, c2 + 1, c2, c2 + 1};
    for (int e = 0; e < 4; e++) {
        float s = 0.0f;
        for (int k = 0; k < 16; k++) s += A[row[e]][k] * B[k][col[e]];
        c[e] += s;
    }
}

/* kernel() as a launch over grid with threads per block (a multiple of
 * 32) and shared_bytes of dynamic shared memory: kernel is a callable that
 * calls the __global__ function with its arguments. */
template <typename Kernel> void emu_launch(dim3 grid, int threads, Kernel kernel, size_t shared_bytes = 0) {
    gridDim = grid;
    blockDim = dim3{(unsigned)threads, 1, 1};
    const int warps = threads / 32;
    for (unsigned z = 0; z < grid.z; z++)
        for (unsigned y = 0; y < grid.y; y++)
            for (unsigned x = 0; x < grid.x; x++) {
                std::barrier<> block(threads);
                std::deque<std::barrier<>> warp_barriers; /* barriers do not move */
                emu_block shared;
                shared.dynamic_shared.assign(shared_bytes, 0xFF);
                shared.block = &block;
                for (int w = 0; w < warps; w++) {
                    warp_barriers.emplace_back(32);
                    shared.warp.push_back(&warp_barriers.back());
                }
                shared.lane_bits.resize((size_t)warps * 32);
                shared.lane_a.resize((size_t)warps * 32 * 4);
                shared.lane_b.resize((size_t)warps * 32 * 2);
                emu_running = &shared;
                std::vector<std::thread> team;
                for (int t = 0; t < threads; t++)
                    team.emplace_back([=] {
                        threadIdx = dim3{(unsigned)t, 0, 0};
                        blockIdx = dim3{x, y, z};
                        kernel();
                    });
                for (std::thread &t : team) t.join();
                emu_running = nullptr;
            }
}

#endif /* MOE_TESTS_SIMT_EMU_H */
