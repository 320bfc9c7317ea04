/* simt_emu.h: runs CUDA kernel source on the CPU, for the tests of a build
 * with no GPU. Each CUDA thread of a block is a std::thread; __syncthreads
 * is a barrier over the block, and a warp's exchanges (shuffles, mma.sync)
 * meet at a barrier over its 32 threads. Blocks run one after another, so a
 * kernel's __shared__ arrays become function statics that the block's
 * threads share.
 *
 * What a kernel may use: threadIdx, blockIdx, blockDim, gridDim,
 * __syncthreads, __syncwarp, __shfl_sync and __shfl_xor_sync (with every
 * lane of the warp taking part), kernels/cuda/reduce.cuh's moe_warp_sum,
 * moe_warp_max and moe_block_sum, atomicAdd on
 * ints, MOE_DYNAMIC_SHARED, moe_cp_async16 and its commit and wait (copies
 * land only when a wait covers them), moe_ldmatrix_x4 and moe_mma_bf16
 * (their fragment layouts are those of the PTX ISA, rebuilt here from the
 * 32 lanes' registers), float2, and bf16 conversions that round to nearest
 * even as the device does. Dynamic shared memory starts as 0xFF bytes (NaN
 * as floats, bf16 or fp32), so a read before a write shows; cp.async and
 * ldmatrix must touch 16-byte aligned pieces of it. Slow, and meant for
 * small sizes.
 *
 * Hopper's warpgroup MMA, as the PTX ISA defines it (see the wgmma section
 * below): moe_shared_address, moe_fence_proxy_async, moe_wgmma_fence,
 * moe_wgmma_commit, moe_wgmma_wait, moe_wgmma_fence_operands and
 * moe_wgmma_m64n256k16 with both
 * operands in shared memory through matrix descriptors (the 128-byte
 * swizzle, K-major). The guards a device does not have are here: a wgmma
 * issued without wgmma.fence, one that reads cp.async data its writer has
 * not fenced to the async proxy, a cp.async into bytes that an unfinished
 * wgmma reads, a descriptor outside the dynamic shared memory or in a form
 * not modelled, threads of a warpgroup at different wgmma instructions or
 * with different descriptors, and a wgmma still pending when the block
 * ends all stop the test.
 *
 * Hopper's TMA pipeline (see the mbarrier section below): CUtensorMap and
 * emu_tensor_map_2d (a 2-D bf16 tiled tensor map, checked as
 * cuTensorMapEncodeTiled checks it), moe_mbarrier_init,
 * moe_fence_mbarrier_init, moe_mbarrier_arrive,
 * moe_mbarrier_arrive_expect_tx, moe_mbarrier_wait (try_wait.parity),
 * moe_tma_load_2d (cp.async.bulk.tensor.2d with zero fill and the 128-byte
 * swizzle) and moe_setmaxnreg_inc / _dec. A TMA load lands only when a
 * thread waits on its mbarrier, and its bytes read 0xFF until then; an
 * mbarrier phase completes only as the ISA says. The guards: an mbarrier
 * used before its init or, by another thread, before fence.mbarrier_init and
 * a __syncthreads; more arrivals than a phase expects, or an arrival in a
 * phase whose predecessor nobody waited for; a wait that makes no progress
 * for emu_wait_timeout_s; a TMA into bytes an unfinished wgmma reads or
 * another TMA is writing, or outside the dynamic shared memory, or not
 * 128-byte aligned; a wgmma or ldmatrix reading TMA bytes that have not
 * landed, or a wgmma reading TMA bytes whose mbarrier phase no thread of its
 * warpgroup has waited for (directly or through arrive/wait and
 * __syncthreads); a TMA still in flight when the block ends; setmaxnreg not
 * executed alike by the whole warpgroup, or asking for registers the block's
 * pool never has. */
#ifndef MOE_TESTS_SIMT_EMU_H
#define MOE_TESTS_SIMT_EMU_H

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <climits>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
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
#define __launch_bounds__(...) /* max threads, min blocks per SM, max blocks per cluster */
#define __shared__ static
#define __grid_constant__ /* a const kernel parameter whose address may be taken (a tensor map) */
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

/* What the wgmma and TMA guards keep per 16-byte piece of dynamic shared
 * memory. */
struct emu_shared_piece {
    std::atomic<int> unfenced_by{0};   /* 1 + the thread whose cp.async landed here and has not
                                          issued fence.proxy.async since, or 0 */
    std::atomic<int> wgmma_readers{0}; /* issued wgmma that read this piece and have not run */
    std::atomic<int> tma_writers{0};   /* TMA loads into this piece that have not landed */
    std::atomic<uint32_t> tma_barrier{0}; /* 1 + the dynamic shared offset of the mbarrier the
                                             TMA that wrote these bytes completed on, or 0 */
    std::atomic<uint64_t> tma_phase{0};   /* and the phase of that mbarrier it completed in */
    std::atomic<bool> mbarrier{false};    /* holds an initialized mbarrier object */
};

/* What a thread knows of the mbarriers: for each (by dynamic shared
 * offset), how many of its phases it knows are complete, with the writes
 * they made visible. A successful wait learns the barrier's completed phases
 * and what its arrivals released; arrivals release what the arriving thread
 * knows; __syncthreads shares what all threads know. That is the PTX memory
 * model's release/acquire order, kept only as far as the TMA guards need it. */
using emu_known_phases = std::unordered_map<uint32_t, uint64_t>;

inline void emu_learn(emu_known_phases &into, const emu_known_phases &from) {
    for (const auto &[barrier, phases] : from) {
        uint64_t &known = into[barrier];
        known = max(known, phases);
    }
}

/* An mbarrier object, as "Contents of the mbarrier object" lists it. */
struct emu_mbarrier {
    int expected, pending; /* arrivals each phase expects, and those still due in the current one */
    int64_t tx_count;      /* transactions (bytes) the current phase still waits for */
    uint64_t phase;        /* the current phase: how many phases have completed */
    bool waited;           /* a wait has returned true since the last phase completed */
    int waiters;           /* threads in moe_mbarrier_wait on it */
    int initializer;       /* the thread that ran mbarrier.init */
    unsigned fenced_at;    /* the initializer's count of __syncthreads at its fence.mbarrier_init,
                              or UINT_MAX before it */
    emu_known_phases released; /* what the threads that arrived on it knew */
};

/* A TMA load issued and not landed: the box as it will land. */
struct emu_tma {
    uint32_t dst, barrier; /* dynamic shared offsets */
    std::vector<unsigned char> bytes;
};

/* One issued wgmma.mma_async .m64nNk16 .f32 .bf16 .bf16. */
struct emu_wgmma {
    int n;
    bool scale_d;               /* d = a b + d, else d = a b */
    float *d[128];              /* each thread of the warpgroup's n / 2 accumulators */
    std::vector<uint32_t> a, b; /* [64 * 2], [n * 2]: dynamic shared offsets of the 16-byte
                                   pieces holding each row's k 0..7, then k 8..15 */
};

/* Runs when all 128 threads of a warpgroup have arrived at its barrier:
 * they must all be at the same instruction (.aligned). */
struct emu_warpgroup;
struct emu_same_instruction {
    emu_warpgroup *g;
    int first; /* its first thread */
    void operator()() noexcept;
};

/* The wgmma state of 4 consecutive warps. */
struct emu_warpgroup {
    std::barrier<emu_same_instruction> *sync;
    const char *instruction[128]; /* where each thread meets the others */
    int operand[128];             /* wait_group's N */
    float *d[128];                /* what each thread passed to the wgmma being issued */
    uint64_t desc_a[128], desc_b[128];
    bool scale_d[128];
    std::vector<emu_wgmma> open;                  /* issued, not committed */
    std::deque<std::vector<emu_wgmma>> committed; /* oldest first */
    const emu_known_phases *known[128];           /* what each thread knows, at a wgmma issue */
    int registers = 0;                            /* per thread after setmaxnreg, 0 before */
};

/* What the threads of the running block share. */
struct emu_block {
    std::vector<unsigned char> shared_storage; /* holds the dynamic shared memory at the offset
                                                  moe_shared_address implies */
    unsigned char *dynamic_shared;             /* the launch's, 0xFF before the kernel runs */
    size_t dynamic_shared_bytes;
    std::unique_ptr<emu_shared_piece[]> shared_pieces; /* [dynamic_shared_bytes / 16, rounded up] */
    std::barrier<> *block;
    std::vector<std::barrier<> *> warp;
    std::vector<emu_warpgroup> warpgroup; /* when the block is a whole number of warpgroups */
    std::vector<uint64_t> lane_bits;   /* [warps * 32] shuffled values */
    std::vector<uint32_t> lane_a;      /* [warps * 32 * 4] */
    std::vector<uint32_t> lane_b;      /* [warps * 32 * 2] */
    int launch_registers;              /* the most per thread a launch of this size can hold */

    /* The asynchronous state below changes under async_mutex, and every
     * change counts as progress for the waits' timeout. */
    std::mutex async_mutex;
    std::condition_variable async_changed;
    std::unordered_map<uint32_t, emu_mbarrier> mbarriers; /* by dynamic shared offset */
    std::vector<emu_tma> tmas;                            /* in flight, in issue order */
    emu_known_phases synced;                              /* what threads knew at __syncthreads */
    std::atomic<bool> uses_mbarriers{false};
    uint64_t progress = 0;
};

inline emu_block *emu_running;

inline int emu_lane() { return (int)(threadIdx.x & 31); }
inline int emu_warp() { return (int)(threadIdx.x >> 5); }

inline thread_local emu_known_phases emu_known;
inline thread_local unsigned emu_syncthreads_count; /* __syncthreads this thread has passed */

inline void __syncthreads() {
    emu_block &b = *emu_running;
    if (!emu_known.empty()) {
        std::lock_guard<std::mutex> lock(b.async_mutex);
        emu_learn(b.synced, emu_known);
    }
    b.block->arrive_and_wait();
    emu_syncthreads_count++;
    if (b.uses_mbarriers.load()) {
        std::lock_guard<std::mutex> lock(b.async_mutex);
        emu_learn(emu_known, b.synced);
    }
}
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

#include "kernels/cuda/reduce.cuh"

inline int atomicAdd(int *p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }

#define MOE_DYNAMIC_SHARED(type, name) type *name = (type *)emu_running->dynamic_shared

/* The .shared window address (what cvta.to.shared gives) of the first byte
 * of dynamic shared memory: 16-byte but deliberately not 128- or 1024-byte
 * aligned. The 128-byte swizzle of wgmma operands is a function of the
 * shared address, so a kernel must align its tiles itself, not count on
 * where its dynamic shared memory happens to start. The host bytes sit at
 * the same offset modulo 4096, so aligning the generic pointer aligns the
 * shared address too, as on a device. */
constexpr uint32_t emu_shared_window_start = 0x430;

inline uint32_t moe_shared_address(const void *p) {
    const unsigned char *base = emu_running->dynamic_shared, *b = (const unsigned char *)p;
    if (b < base || b > base + emu_running->dynamic_shared_bytes) {
        fprintf(stderr, "simt_emu: moe_shared_address of %p, which is not in the dynamic shared memory\n", p);
        abort();
    }
    const size_t address = emu_shared_window_start + (size_t)(b - base);
    if (address >= (size_t)1 << 18) { /* a descriptor keeps address bits 4-17 */
        fprintf(stderr, "simt_emu: shared address 0x%zx is past the 256 KiB a wgmma descriptor can name\n", address);
        abort();
    }
    return (uint32_t)address;
}

inline emu_shared_piece &emu_piece_at(const void *p) {
    return emu_running->shared_pieces[(size_t)((const unsigned char *)p - emu_running->dynamic_shared) / 16];
}

/* A 16-byte access into shared memory must be aligned and inside the
 * launch's dynamic shared memory (where the kernels keep what cp.async and
 * ldmatrix touch); anything else stops the test, as it would fault or read
 * garbage on a device. */
inline void emu_check_shared16(const void *p, const char *what) {
    const unsigned char *base = emu_running->dynamic_shared, *b = (const unsigned char *)p;
    if ((uintptr_t)p % 16 != 0 || b < base || b + 16 > base + emu_running->dynamic_shared_bytes) {
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
inline thread_local std::vector<size_t> emu_unfenced_pieces; /* where this thread's copies landed
                                                                since its last fence.proxy.async */

/* A write into bytes that an issued wgmma reads, before a wait has run that
 * wgmma: on a device the write may land while the tensor cores read, so the
 * product would mix old and new bytes. */
inline void emu_check_no_wgmma_reads(const void *p, const char *what) {
    if (emu_piece_at(p).wgmma_readers.load() > 0) {
        fprintf(stderr,
                "simt_emu: %s shared address 0x%x, which an issued wgmma reads and no wgmma.wait_group has "
                "completed yet\n",
                what, moe_shared_address(p));
        abort();
    }
}

/* A write into bytes that a TMA load in flight also writes (the two land
 * in no defined order), or into an initialized mbarrier object ("mbarrier":
 * any other operation on one is undefined behaviour). */
inline void emu_check_no_tma_writes(const void *p, const char *what) {
    const emu_shared_piece &s = emu_piece_at(p);
    if (s.tma_writers.load() > 0 || s.mbarrier.load()) {
        fprintf(stderr, "simt_emu: %s shared address 0x%x, %s\n", what, moe_shared_address(p),
                s.mbarrier.load() ? "which holds an initialized mbarrier"
                                  : "which a TMA load writes that has not landed (no thread has waited on its "
                                    "mbarrier since it was issued)");
        abort();
    }
}

/* A read of bytes a TMA load has not landed yet: on a device they may be
 * old, new or a mix. */
inline void emu_check_tma_landed(const void *p, const char *what) {
    if (emu_piece_at(p).tma_writers.load() > 0) {
        fprintf(stderr,
                "simt_emu: %s shared address 0x%x, which a TMA load writes that has not landed: no thread has "
                "waited on its mbarrier since it was issued\n",
                what, moe_shared_address(p));
        abort();
    }
}

inline void moe_cp_async16(void *dst, const void *src, int src_bytes) {
    if (src_bytes != 0 && src_bytes != 16) {
        fprintf(stderr, "simt_emu: cp.async of %d bytes (the kernels copy 16 or zero-fill)\n", src_bytes);
        abort();
    }
    emu_check_shared16(dst, "cp.async destination");
    emu_check_no_wgmma_reads(dst, "cp.async into");
    emu_check_no_tma_writes(dst, "cp.async into");
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

/* Lands every committed group but the newest N. The bytes are the
 * generic proxy's until this thread's fence.proxy.async. */
template <int N> void moe_cp_async_wait() {
    const int me = (int)threadIdx.x + 1;
    while (emu_committed_copies.size() > (size_t)N) {
        for (const emu_copy &c : emu_committed_copies.front()) {
            emu_check_no_wgmma_reads(c.dst, "a cp.async issued before a wgmma landed in");
            emu_check_no_tma_writes(c.dst, "a cp.async landed in");
            memcpy(c.dst, c.bytes, sizeof c.bytes);
            emu_piece_at(c.dst).tma_barrier.store(0);
            if (emu_piece_at(c.dst).unfenced_by.exchange(me) != me)
                emu_unfenced_pieces.push_back((size_t)(c.dst - emu_running->dynamic_shared) / 16);
        }
        emu_committed_copies.pop_front();
    }
}

/* fence.proxy.async.shared::cta: this thread's earlier generic-proxy
 * writes to shared memory (here, its landed cp.async copies) become visible
 * to the async proxy, through which wgmma reads its operands (PTX ISA,
 * wgmma chapter, "Async Proxy": crossing proxies needs fence.proxy.async).
 * Plain stores are not tracked. */
inline void moe_fence_proxy_async() {
    const int me = (int)threadIdx.x + 1;
    for (size_t i : emu_unfenced_pieces) {
        int mine = me;
        emu_running->shared_pieces[i].unfenced_by.compare_exchange_strong(mine, 0);
    }
    emu_unfenced_pieces.clear();
}

/* ldmatrix .x4: lanes 8i .. 8i + 7 name the rows of matrix i; lane l gets
 * the pair at row l / 4, columns 2 (l % 4) of each. */
inline void moe_ldmatrix_x4(uint32_t *r, const void *row) {
    emu_check_shared16(row, "ldmatrix row");
    emu_check_tma_landed(row, "ldmatrix reads");
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

/* wgmma, from the PTX ISA's "Asynchronous Warpgroup Level Matrix
 * Multiply-Accumulate Instructions". A warpgroup is 4 consecutive warps
 * (threads 128g .. 128g + 127); its threads all execute each wgmma
 * instruction together (.sync.aligned), meeting here at a barrier over the
 * warpgroup that checks they are at the same one. As on the device the work is asynchronous: wgmma.mma_async
 * only records the operation in the warpgroup's open group, commit_group
 * closes that group ("wgmma.commit_group": an empty one if nothing is
 * open), and wait_group N ("wgmma.wait_group": until only the newest N
 * groups are pending) runs the older committed groups in issue order, and
 * only then reads the operands from shared memory and writes each thread's
 * d. So a kernel that reads d before its wait, or rewrites a stage before
 * the wait of the wgmma that reads it, gets wrong numbers here too. */

/* "wgmma.fence": needed before the first wgmma and between a thread's
 * access to d and a later wgmma on d (not between wgmma of one shape
 * chaining the same accumulator). The kernel touches d after a wait, so a
 * wait clears the flag and the next wgmma needs a fence again; that is
 * stricter than the ISA only for a kernel that issues after a wait without
 * touching d in between. */
inline thread_local bool emu_wgmma_fenced;

inline void emu_same_instruction::operator()() noexcept {
    for (int q = 1; q < 128; q++)
        if (strcmp(g->instruction[q], g->instruction[0]) != 0 || g->operand[q] != g->operand[0]) {
            fprintf(stderr,
                    "simt_emu: thread %d is at %s %d and thread %d of its warpgroup at %s %d; .sync.aligned "
                    "instructions are executed by the whole warpgroup together\n",
                    first + q, g->instruction[q], g->operand[q], first, g->instruction[0], g->operand[0]);
            abort();
        }
}

inline emu_warpgroup &emu_my_warpgroup(const char *instruction) {
    if (blockDim.x % 128 != 0) {
        fprintf(stderr, "simt_emu: %s in a block of %u threads, not a whole number of warpgroups\n", instruction,
                blockDim.x);
        abort();
    }
    return emu_running->warpgroup[threadIdx.x / 128];
}

/* Waits until every thread of g is at instruction. */
inline void emu_meet(emu_warpgroup &g, const char *instruction, int operand = 0) {
    g.instruction[threadIdx.x % 128] = instruction;
    g.operand[threadIdx.x % 128] = operand;
    g.sync->arrive_and_wait();
}

inline void moe_wgmma_fence() {
    emu_wgmma_fenced = true;
    emu_meet(emu_my_warpgroup("wgmma.fence"), "wgmma.fence");
}

/* Appends to pieces the dynamic shared offsets of the 16-byte pieces of a
 * K-major bf16 operand of rows rows, k 0..15, that desc names.
 *
 * "Matrix Descriptor Format": bits 0-13 start address, 16-29 leading
 * dimension byte offset, 32-45 stride dimension byte offset (each as
 * (x & 0x3FFFF) >> 4, so 16-byte aligned by construction), 49-51 matrix base
 * offset, 62-63 swizzle mode (1: 128-byte swizzle); the other bits are not
 * defined. Modelled: the 128-byte swizzle with base offset 0 (the pattern
 * repeats from 1024-byte boundaries of the address) and K-major operands
 * (imm-trans 0, all that the wrappers below issue). Anything else stops the
 * test rather than compute something else.
 *
 * "Canonical Layouts", K-major 128B swizzling:
 * Swizzle<3,4,3> o ((8,m),(T,2k)):((8T,SBO),(1,T)) with T = 16 bytes. Row r
 * is 128 bytes after row r - 1 within a group of 8 rows, a group lies SBO
 * ("Stride Dimension Byte Offset": from the first 8 rows to the next 8) after
 * the previous one, and k runs on from the start address:
 *   linear = start + 128 (r % 8) + SBO (r / 8) + 2 k.
 * The leading dimension byte offset is "not used" for K-major swizzled
 * layouts ("Leading Dimension Byte Offset"). The swizzle then XORs the
 * address's bits 4-6 (the 16-byte piece within a 128-byte row) with its
 * bits 7-9 (the row within the 1024-byte pattern): it is a function of the
 * shared ADDRESS, which is what lets a kernel step the start address by 32
 * bytes per k16 inside the 128-byte row. A k16 slice that would run past
 * the end of its row is not modelled. CUTLASS reads the descriptor and the
 * layout the same way (GmmaDescriptor in cute/arch/mma_sm90_desc.hpp;
 * make_gmma_desc and Layout_K_SW128_Atom in cute/atom/mma_traits_sm90_gmma.hpp). */
inline void emu_wgmma_pieces(std::vector<uint32_t> &pieces, uint64_t desc, int rows, const char *which) {
    const unsigned swizzle = (unsigned)(desc >> 62), base_offset = (unsigned)(desc >> 49) & 7u;
    const uint64_t undefined = (3ull << 14) | (3ull << 30) | (7ull << 46) | (0x3FFull << 52);
    if (swizzle != 1 || base_offset != 0 || (desc & undefined) != 0) {
        fprintf(stderr,
                "simt_emu: wgmma %s descriptor 0x%016llx has swizzle mode %u, matrix base offset %u and undefined "
                "bits 0x%llx; only the 128-byte swizzle (mode 1) with base offset 0 and nothing else set is "
                "modelled\n",
                which, (unsigned long long)desc, swizzle, base_offset, (unsigned long long)(desc & undefined));
        abort();
    }
    const uint32_t start = (uint32_t)(desc & 0x3FFF) << 4, sbo = (uint32_t)((desc >> 32) & 0x3FFF) << 4;
    if (((start >> 4) & 7u) == 7u) {
        fprintf(stderr,
                "simt_emu: wgmma %s descriptor 0x%016llx starts at shared address 0x%x, the last 16 bytes of a "
                "128-byte swizzle row, so its k16 slice would run into the next row (not modelled)\n",
                which, (unsigned long long)desc, start);
        abort();
    }
    const uint32_t lo = emu_shared_window_start, hi = lo + (uint32_t)emu_running->dynamic_shared_bytes;
    for (int r = 0; r < rows; r++)
        for (uint32_t h = 0; h < 2; h++) {
            const uint32_t linear = start + 128u * (uint32_t)(r % 8) + sbo * (uint32_t)(r / 8) + 16u * h;
            const uint32_t address = linear ^ (((linear >> 7) & 7u) << 4);
            if (address < lo || address + 16 > hi) {
                fprintf(stderr,
                        "simt_emu: wgmma %s descriptor 0x%016llx names shared address 0x%x (row %d, k %u..%u), "
                        "outside the dynamic shared memory [0x%x, 0x%x)\n",
                        which, (unsigned long long)desc, address, r, 8 * h, 8 * h + 7, lo, hi);
                abort();
            }
            pieces.push_back(address - lo);
        }
}

/* Runs op: d = a b (+ d). Products of bf16 are exact in fp32 and summed in
 * fp32, in an order of this emulator's own ("wgmma.mma_async": the
 * accumulation order is unspecified). Thread t of the warpgroup holds in
 * d[i], i < N / 2, the element ("Matrix Fragments for
 * wgmma.mma_async.m64nNk16", the figure of accumulator D)
 *   row = 16 (t / 32) + (t % 32) / 4 + 8 ((i / 2) % 2),
 *   col = 8 (i / 4) + 2 (t % 4) + i % 2:
 * warp w of the warpgroup owns rows 16w .. 16w + 15, and each lane holds the
 * pattern of mma.m16n8k16's accumulator again for every 8 columns (CUTLASS's
 * CLayout_64xN in cute/atom/mma_traits_sm90_gmma.hpp says the same). */
inline void emu_wgmma_run(const emu_wgmma &op) {
    float a[64][16], b[256][16];
    auto load = [](float (*m)[16], const std::vector<uint32_t> &pieces) {
        for (size_t p = 0; p < pieces.size(); p++) {
            const unsigned char *src = emu_running->dynamic_shared + pieces[p];
            for (int e = 0; e < 8; e++) {
                uint16_t h;
                memcpy(&h, src + 2 * e, sizeof h);
                m[p / 2][8 * (p % 2) + (size_t)e] = emu_from_bf16(h);
            }
            emu_running->shared_pieces[pieces[p] / 16].wgmma_readers.fetch_sub(1);
        }
    };
    load(a, op.a);
    load(b, op.b);
    for (int t = 0; t < 128; t++)
        for (int i = 0; i < op.n / 2; i++) {
            const int row = 16 * (t / 32) + (t % 32) / 4 + 8 * ((i / 2) % 2), col = 8 * (i / 4) + 2 * (t % 4) + i % 2;
            float s = 0.0f;
            for (int k = 0; k < 16; k++) s += a[row][k] * b[col][k];
            op.d[t][i] = op.scale_d ? op.d[t][i] + s : s;
        }
}

/* wgmma.mma_async.sync.aligned.m64nNk16.f32.bf16.bf16 d, desc_a, desc_b,
 * scale_d, 1, 1, 0, 0: recorded now, run by the wait that covers it. The
 * descriptors and scale_d must agree across the warpgroup ("The contents
 * of a matrix descriptor must be same across all the warps"). */
template <int N> void emu_wgmma_bf16(float *d, uint64_t desc_a, uint64_t desc_b, int scale_d) {
    static_assert(N % 8 == 0 && N >= 8 && N <= 256, "wgmma .m64nNk16 has N = 8, 16, .., 256");
    if (!emu_wgmma_fenced) {
        fprintf(stderr, "simt_emu: thread %u issued a wgmma with no wgmma.fence since its last wgmma.wait_group\n",
                threadIdx.x);
        abort();
    }
    emu_warpgroup &g = emu_my_warpgroup("wgmma.mma_async");
    const unsigned r = threadIdx.x % 128;
    g.d[r] = d;
    g.desc_a[r] = desc_a;
    g.desc_b[r] = desc_b;
    g.scale_d[r] = scale_d != 0;
    g.known[r] = &emu_known;
    emu_meet(g, "wgmma.mma_async", N);
    if (r == 0) {
        for (int q = 1; q < 128; q++)
            if (g.desc_a[q] != desc_a || g.desc_b[q] != desc_b || g.scale_d[q] != g.scale_d[0]) {
                fprintf(stderr,
                        "simt_emu: thread %u issued a wgmma with descriptors 0x%016llx 0x%016llx and scale_d %d, "
                        "thread %u of its warpgroup with 0x%016llx 0x%016llx and %d\n",
                        threadIdx.x, (unsigned long long)desc_a, (unsigned long long)desc_b, g.scale_d[0],
                        threadIdx.x + q, (unsigned long long)g.desc_a[q], (unsigned long long)g.desc_b[q],
                        g.scale_d[q]);
                abort();
            }
        emu_wgmma op;
        op.n = N;
        op.scale_d = g.scale_d[0];
        memcpy(op.d, g.d, sizeof op.d);
        emu_wgmma_pieces(op.a, desc_a, 64, "A");
        emu_wgmma_pieces(op.b, desc_b, N, "B");
        emu_known_phases known; /* by any thread of the warpgroup */
        for (int q = 0; q < 128; q++) emu_learn(known, *g.known[q]);
        for (const std::vector<uint32_t> *pieces : {&op.a, &op.b})
            for (uint32_t p : *pieces) {
                emu_shared_piece &s = emu_running->shared_pieces[p / 16];
                const int writer = s.unfenced_by.load();
                if (writer != 0) {
                    fprintf(stderr,
                            "simt_emu: a wgmma reads shared address 0x%x, where thread %d landed a cp.async and "
                            "has issued no fence.proxy.async since (wgmma reads through the async proxy)\n",
                            emu_shared_window_start + p, writer - 1);
                    abort();
                }
                emu_check_tma_landed(emu_running->dynamic_shared + p, "a wgmma reads");
                /* TMA bytes need no proxy fence (both are the async proxy's), but
                 * they are the reader's only once it has seen their mbarrier phase
                 * complete. */
                const uint32_t barrier = s.tma_barrier.load();
                if (barrier != 0) {
                    const auto seen = known.find(barrier - 1);
                    const uint64_t phase = s.tma_phase.load();
                    if (seen == known.end() || seen->second <= phase) {
                        fprintf(stderr,
                                "simt_emu: a wgmma reads shared address 0x%x, which a TMA load wrote in phase %llu "
                                "of the mbarrier at shared address 0x%x, and no thread of the warpgroup has seen "
                                "that phase complete (by its own wait, or an arrive/wait or __syncthreads chain "
                                "from one)\n",
                                emu_shared_window_start + p, (unsigned long long)phase,
                                emu_shared_window_start + barrier - 1);
                        abort();
                    }
                }
                s.wgmma_readers.fetch_add(1);
            }
        g.open.push_back(std::move(op));
    }
    emu_meet(g, "wgmma.mma_async (recorded)", N); /* the slots are read */
}

/* wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 d, desc_a, desc_b, p, 1, 1, 0, 0 */
inline void moe_wgmma_m64n256k16(float *d, uint64_t desc_a, uint64_t desc_b, int scale_d) {
    emu_wgmma_bf16<256>(d, desc_a, desc_b, scale_d);
}

inline void moe_wgmma_commit() {
    emu_warpgroup &g = emu_my_warpgroup("wgmma.commit_group");
    emu_meet(g, "wgmma.commit_group");
    if (threadIdx.x % 128 == 0) {
        g.committed.push_back(std::move(g.open));
        g.open.clear();
    }
}

template <int N> void moe_wgmma_wait() {
    emu_warpgroup &g = emu_my_warpgroup("wgmma.wait_group");
    emu_meet(g, "wgmma.wait_group", N); /* no thread touches its d while it is written */
    if (threadIdx.x % 128 == 0)
        while (g.committed.size() > (size_t)N) {
            for (const emu_wgmma &op : g.committed.front()) emu_wgmma_run(op);
            g.committed.pop_front();
        }
    emu_meet(g, "wgmma.wait_group (done)", N);
    emu_wgmma_fenced = false;
}

/* A compiler-only fence on a device (the registers change under it): the
 * accumulators here are plain memory that the wait has already written. */
inline void moe_wgmma_fence_operands(float *, int) {}

/* Hopper's TMA pipeline, from the PTX ISA's "Parallel Synchronization and
 * Communication Instructions: mbarrier" (9.7.13.15 in ISA 8.x),
 * "cp.async.bulk.tensor", "Tensors" (5.5: bounding box, out of boundary
 * access, swizzling modes) and "setmaxnreg", the CUDA driver API's
 * cuTensorMapEncodeTiled, and the CUDA Programming Guide's TMA swizzle
 * section. One thread issues a TMA load; it lands (its box is written, then
 * its complete-tx is performed on its mbarrier) only when a thread waits on
 * that mbarrier, and until then its destination reads as 0xFF bytes. So a
 * kernel that reads a stage before waiting for it, or refills a stage its
 * readers have not released, reads wrong numbers here too. */

/* How long a wait (on an mbarrier phase, or setmaxnreg.inc on registers)
 * may see no change to the block's mbarriers, TMA loads and register pool
 * before the test stops: a phase that can never complete hangs a device.
 * The tests of that guard shorten it. */
inline double emu_wait_timeout_s = 10.0;

/* Waits, holding lock (the block's async_mutex) on entry and on return,
 * until done(); with no progress for emu_wait_timeout_s, prints stuck() and
 * stops the test. */
template <typename Done, typename Stuck>
void emu_wait_until(std::unique_lock<std::mutex> &lock, Done done, Stuck stuck) {
    emu_block &b = *emu_running;
    const std::chrono::duration<double> limit(emu_wait_timeout_s);
    uint64_t progress = b.progress;
    auto since = std::chrono::steady_clock::now();
    while (!done()) {
        b.async_changed.wait_for(lock, std::chrono::milliseconds(20));
        const auto now = std::chrono::steady_clock::now();
        if (b.progress != progress) {
            progress = b.progress;
            since = now;
        } else if (now - since > limit) {
            stuck();
            abort();
        }
    }
}

/* The emulator's stand-in for the driver's opaque CUtensorMap: a 2-D tiled
 * map of bf16 elements, dimension 0 the contiguous one. */
struct CUtensorMap {
    const unsigned char *base;
    uint64_t dim0, dim1;  /* globalDim, elements */
    uint64_t row_bytes;   /* globalStrides[0] */
    uint32_t box0, box1;  /* boxDim, elements */
    bool swizzle128;      /* CU_TENSOR_MAP_SWIZZLE_128B, else _NONE */
};

/* What cuTensorMapEncodeTiled(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2,
 * base, {dim0, dim1}, {row_bytes}, {box0, box1}, {1, 1},
 * CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, any L2 promotion,
 * CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) builds; what the driver rejects
 * (CUDA_ERROR_INVALID_VALUE) stops the test. The driver API's "Tensor Map
 * Object Management": globalAddress 16-byte aligned (CUTLASS's make_tma_copy
 * asserts the same; the Programming Guide's swizzle table asks 128 bytes of
 * global memory, which neither the driver nor CUTLASS checks); each
 * globalDim in 1..2^32; globalStrides multiples of 16 below 2^40, and as
 * globalStrides[0] = globalDim[0] * elementSize + padding, at least a row;
 * boxDim in 1..256, boxDim[0] * elementSize a multiple of 16 without
 * interleave; with CU_TENSOR_MAP_SWIZZLE_128B that inner dimension at most
 * 128 bytes. An inner box under 128 bytes in the 128-byte swizzle is legal
 * but not modelled. OOB_FILL_NONE is the ISA's zero fill mode. */
inline CUtensorMap emu_tensor_map_2d(const void *base, uint64_t dim0, uint64_t dim1, uint64_t row_bytes,
                                     uint32_t box0, uint32_t box1, bool swizzle128) {
    const uint64_t inner = (uint64_t)box0 * 2, most = (uint64_t)1 << 32;
    const char *broken = nullptr;
    if ((uintptr_t)base % 16 != 0)
        broken = "globalAddress must be 16-byte aligned";
    else if (dim0 == 0 || dim1 == 0 || dim0 > most || dim1 > most)
        broken = "each globalDim must be in 1..2^32";
    else if (row_bytes % 16 != 0 || row_bytes >= (uint64_t)1 << 40)
        broken = "globalStrides must be multiples of 16 below 2^40";
    else if (row_bytes < dim0 * 2)
        broken = "globalStrides[0] must hold a row of globalDim[0] elements";
    else if (box0 == 0 || box1 == 0 || box0 > 256 || box1 > 256)
        broken = "each boxDim must be in 1..256";
    else if (inner % 16 != 0)
        broken = "boxDim[0] * the element size must be a multiple of 16 bytes";
    else if (swizzle128 && inner > 128)
        broken = "CU_TENSOR_MAP_SWIZZLE_128B needs an inner box dimension of at most 128 bytes";
    if (broken == nullptr && swizzle128 && inner != 128)
        broken = "an inner box dimension under 128 bytes in the 128-byte swizzle is not modelled";
    if (broken != nullptr) {
        fprintf(stderr,
                "simt_emu: cuTensorMapEncodeTiled(bf16, base %p, globalDim {%llu, %llu}, globalStrides {%llu}, "
                "boxDim {%u, %u}, %s): %s\n",
                base, (unsigned long long)dim0, (unsigned long long)dim1, (unsigned long long)row_bytes, box0, box1,
                swizzle128 ? "CU_TENSOR_MAP_SWIZZLE_128B" : "CU_TENSOR_MAP_SWIZZLE_NONE", broken);
        abort();
    }
    return {(const unsigned char *)base, dim0, dim1, row_bytes, box0, box1, swizzle128};
}

/* The dynamic shared offset of the mbarrier object at bar. "Size and
 * alignment of mbarrier object": .b64, 8-byte aligned, in shared memory;
 * the kernels keep theirs in the dynamic shared memory. */
inline uint32_t emu_mbarrier_offset(const uint64_t *bar, const char *what) {
    const unsigned char *base = emu_running->dynamic_shared, *p = (const unsigned char *)bar;
    if (p < base || p + 8 > base + emu_running->dynamic_shared_bytes ||
        (emu_shared_window_start + (size_t)(p - base)) % 8 != 0) {
        fprintf(stderr, "simt_emu: %s on %p, not an 8-byte aligned mbarrier in the dynamic shared memory\n", what,
                (const void *)bar);
        abort();
    }
    return (uint32_t)(p - base);
}

/* The mbarrier at offset, for the calling thread to use (the block's
 * async_mutex held). "mbarrier": any operation but init on an uninitialized
 * mbarrier is undefined. Other threads see an init only once its thread's
 * fence.mbarrier_init (ordering the init before what follows) and then a
 * __syncthreads stand between them, as CUTLASS's pipelines do
 * (fence_barrier_init, then a block or cluster sync). */
inline emu_mbarrier &emu_mbarrier_at(uint32_t offset, const char *what) {
    const auto found = emu_running->mbarriers.find(offset);
    if (found == emu_running->mbarriers.end()) {
        fprintf(stderr, "simt_emu: thread %u: %s on the mbarrier at shared address 0x%x, which no mbarrier.init has "
                "initialized\n", threadIdx.x, what, emu_shared_window_start + offset);
        abort();
    }
    emu_mbarrier &m = found->second;
    if ((int)threadIdx.x != m.initializer && !(m.fenced_at != UINT_MAX && emu_syncthreads_count > m.fenced_at)) {
        fprintf(stderr,
                "simt_emu: thread %u: %s on the mbarrier at shared address 0x%x, which thread %d initialized %s\n",
                threadIdx.x, what, emu_shared_window_start + offset, m.initializer,
                m.fenced_at == UINT_MAX ? "and has not fenced (fence.mbarrier_init) yet"
                                        : "and fenced, with no __syncthreads since");
        abort();
    }
    return m;
}

/* "Contents of the mbarrier object": tx-count lies in [-(2^20 - 1), 2^20 - 1]. */
inline void emu_check_tx_count(const emu_mbarrier &m, uint32_t offset, const char *what) {
    if (m.tx_count > (1 << 20) - 1 || m.tx_count < -((1 << 20) - 1)) {
        fprintf(stderr, "simt_emu: %s takes the tx-count of the mbarrier at shared address 0x%x to %lld, outside "
                "+-(2^20 - 1)\n", what, emu_shared_window_start + offset, (long long)m.tx_count);
        abort();
    }
}

/* "Phase Completion of the mbarrier object": the current phase completes
 * when its pending arrivals and its tx-count have both reached zero; then,
 * atomically, the mbarrier moves to the next phase and the pending count is
 * reloaded with the expected count. Returns whether it completed. */
inline bool emu_mbarrier_complete(emu_mbarrier &m) {
    if (m.pending != 0 || m.tx_count != 0) return false;
    m.phase++;
    m.pending = m.expected;
    m.waited = false;
    emu_running->async_changed.notify_all();
    return true;
}

/* mbarrier.init.shared::cta.b64 [bar], count ("mbarrier.init"): phase 0,
 * count arrivals expected and pending, tx-count 0. count lies in
 * [1, 2^20 - 1]; an init over a live mbarrier object is undefined (it wants
 * mbarrier.inval first). */
inline void moe_mbarrier_init(uint64_t *bar, int count) {
    emu_block &b = *emu_running;
    const uint32_t offset = emu_mbarrier_offset(bar, "mbarrier.init");
    if (count < 1 || count > (1 << 20) - 1) {
        fprintf(stderr, "simt_emu: mbarrier.init with count %d, outside 1..2^20 - 1\n", count);
        abort();
    }
    std::lock_guard<std::mutex> lock(b.async_mutex);
    const emu_mbarrier m{count, count, 0, 0, false, 0, (int)threadIdx.x, UINT_MAX, {}};
    if (!b.mbarriers.emplace(offset, m).second) {
        fprintf(stderr, "simt_emu: mbarrier.init on the live mbarrier at shared address 0x%x\n",
                emu_shared_window_start + offset);
        abort();
    }
    b.shared_pieces[offset / 16].mbarrier.store(true);
    b.uses_mbarriers.store(true);
    b.progress++;
}

/* fence.mbarrier_init.release.cluster: this thread's earlier inits come
 * before what it does next. */
inline void moe_fence_mbarrier_init() {
    emu_block &b = *emu_running;
    std::lock_guard<std::mutex> lock(b.async_mutex);
    for (auto &[offset, m] : b.mbarriers)
        if (m.initializer == (int)threadIdx.x && m.fenced_at == UINT_MAX) m.fenced_at = emu_syncthreads_count;
}

/* The arrive-on operation, after an expect-tx of tx bytes ("Arrive-on
 * operation on mbarrier object", "expect-tx operation";
 * mbarrier.arrive.expect_tx does the expect-tx first). Two rules of the
 * ISA a device does not check: the pending count cannot go below zero, so a
 * phase takes no more arrivals than it expects; and ("Phase of the mbarrier
 * object") each phase needs a test_wait or try_wait returning true before an
 * arrive-on in the next one. A thread that completes a phase others wait on
 * gives them a millisecond's head start: a kernel that releases a stage
 * before it is done with it (say, before its wgmma.wait_group) then finds
 * the refill already issued over it. */
inline void emu_mbarrier_arrive(uint64_t *bar, uint32_t tx, const char *what) {
    emu_block &b = *emu_running;
    const uint32_t offset = emu_mbarrier_offset(bar, what);
    bool released_waiters;
    {
        std::lock_guard<std::mutex> lock(b.async_mutex);
        emu_mbarrier &m = emu_mbarrier_at(offset, what);
        if (m.pending == 0 || (m.phase > 0 && !m.waited)) {
            fprintf(stderr, "simt_emu: thread %u: %s on the mbarrier at shared address 0x%x in its phase %llu, %s\n",
                    threadIdx.x, what, emu_shared_window_start + offset, (unsigned long long)m.phase,
                    m.pending == 0 ? "which has had all the arrivals its init count expects"
                                   : "and no wait has returned true for the phase before");
            abort();
        }
        m.tx_count += tx;
        emu_check_tx_count(m, offset, what);
        m.pending--;
        emu_learn(m.released, emu_known);
        b.progress++;
        released_waiters = emu_mbarrier_complete(m) && m.waiters > 0;
    }
    if (released_waiters) std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

/* mbarrier.arrive.shared::cta.b64 _, [bar] */
inline void moe_mbarrier_arrive(uint64_t *bar) { emu_mbarrier_arrive(bar, 0, "mbarrier.arrive"); }

/* mbarrier.arrive.expect_tx.shared::cta.b64 _, [bar], bytes */
inline void moe_mbarrier_arrive_expect_tx(uint64_t *bar, uint32_t bytes) {
    emu_mbarrier_arrive(bar, bytes, "mbarrier.arrive.expect_tx");
}

/* Lands the TMA loads in flight that complete on the mbarrier m at offset,
 * in issue order (async_mutex held): each writes its box, then performs
 * complete-tx ("complete-tx operation": tx-count decremented by the bytes,
 * which may complete the phase). The bytes are the async proxy's, so a
 * cp.async that wrote there before no longer needs a proxy fence. */
inline void emu_land_tmas(emu_block &b, uint32_t offset, emu_mbarrier &m) {
    for (size_t i = 0; i < b.tmas.size();) {
        emu_tma &t = b.tmas[i];
        if (t.barrier != offset) {
            i++;
            continue;
        }
        memcpy(b.dynamic_shared + t.dst, t.bytes.data(), t.bytes.size());
        for (size_t p = t.dst / 16; p < (t.dst + t.bytes.size()) / 16; p++) {
            emu_shared_piece &s = b.shared_pieces[p];
            s.tma_writers.fetch_sub(1);
            s.unfenced_by.store(0);
            s.tma_barrier.store(offset + 1);
            s.tma_phase.store(m.phase);
        }
        m.tx_count -= (int64_t)t.bytes.size();
        emu_check_tx_count(m, offset, "a TMA load's complete-tx");
        b.tmas.erase(b.tmas.begin() + (ptrdiff_t)i);
        b.progress++;
        emu_mbarrier_complete(m);
    }
}

/* A loop on mbarrier.try_wait.parity.shared::cta.b64 until it returns true.
 * "mbarrier.test_wait / mbarrier.try_wait": phaseParity names the current
 * phase or the one before it (an even phase has parity 0), and the wait
 * succeeds when the phase it names has completed: when the current phase's
 * parity differs from it. A fresh mbarrier (phase 0) so passes a wait on
 * parity 1 at once, and a wait on parity 0 waits for phase 0. Waiting lands
 * the TMA loads that complete on this mbarrier. */
inline void moe_mbarrier_wait(uint64_t *bar, int parity) {
    emu_block &b = *emu_running;
    const char *what = "mbarrier.try_wait.parity";
    const uint32_t offset = emu_mbarrier_offset(bar, what);
    if (parity != 0 && parity != 1) {
        fprintf(stderr, "simt_emu: %s with parity %d; the valid values are 0 and 1\n", what, parity);
        abort();
    }
    std::unique_lock<std::mutex> lock(b.async_mutex);
    emu_mbarrier &m = emu_mbarrier_at(offset, what);
    const auto passed = [&] { return (m.phase & 1) != (uint64_t)parity; };
    m.waiters++;
    emu_wait_until(
        lock,
        [&] {
            if (!passed()) emu_land_tmas(b, offset, m);
            return passed();
        },
        [&] {
            fprintf(stderr,
                    "simt_emu: thread %u waits on the mbarrier at shared address 0x%x for parity %d, and nothing has "
                    "happened for %g s: it is in phase %llu with %d of %d arrivals and %lld tx bytes pending\n",
                    threadIdx.x, emu_shared_window_start + offset, parity, emu_wait_timeout_s,
                    (unsigned long long)m.phase, m.pending, m.expected, (long long)m.tx_count);
        });
    m.waiters--;
    if (m.phase > 0) m.waited = true;
    emu_learn(emu_known, m.released);
    uint64_t &known = emu_known[offset];
    known = max(known, m.phase);
}

/* cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes
 * [dst], [map, {c0, c1}], [bar]: the box of map->box1 rows of map->box0
 * elements from element (c0, c1) ("Bounding Box"; the coordinates are .s32
 * and may start outside the tensor). Elements outside [0, dim0) x [0, dim1)
 * land as zeros ("Out of Boundary Access", zero fill), and complete-tx
 * counts the whole box ("amount of data copied": the box written to shared
 * memory, zeros included; CUTLASS's TmaTransactionBytes is the full tile
 * whatever the residue). Row r of the box lands box0 * 2 bytes after row
 * r - 1; in the 128-byte swizzle the 16-byte chunk j of a row lands at chunk
 * j ^ (bits 7-9 of the row's shared address): the Programming Guide's
 * "smem[y][x] <-> smem[y][((y + offset) % 8) ^ x]" with offset =
 * (address / 128) % 8, the pattern repeating every 1024 bytes of ADDRESS.
 * The destination must be 128-byte aligned ("When using TMA, the shared
 * memory is required to be aligned to 128 bytes", for every swizzle mode)
 * and lie in the dynamic shared memory. The source is read at issue; the
 * box lands when a thread waits on bar, and reads 0xFF until then. */
inline void moe_tma_load_2d(void *dst, const CUtensorMap *map, int c0, int c1, uint64_t *bar) {
    emu_block &b = *emu_running;
    const char *what = "cp.async.bulk.tensor";
    const size_t row = (size_t)map->box0 * 2, bytes = row * map->box1;
    unsigned char *d = (unsigned char *)dst;
    if (d < b.dynamic_shared || d + bytes > b.dynamic_shared + b.dynamic_shared_bytes) {
        fprintf(stderr, "simt_emu: %s of a %zu-byte box to %p, not inside the dynamic shared memory\n", what, bytes,
                dst);
        abort();
    }
    const uint32_t address = moe_shared_address(dst), offset = emu_mbarrier_offset(bar, what);
    if (address % 128 != 0) {
        fprintf(stderr, "simt_emu: %s to shared address 0x%x, which is not 128-byte aligned\n", what, address);
        abort();
    }
    std::vector<unsigned char> box(bytes);
    for (uint32_t r = 0; r < map->box1; r++) {
        const int64_t y = (int64_t)c1 + r;
        const size_t swizzle = map->swizzle128 ? (((address + r * row) >> 7) & 7u) << 4 : 0;
        for (uint32_t x = 0; x < map->box0; x++) {
            const int64_t e = (int64_t)c0 + x;
            uint16_t v = 0;
            if (y >= 0 && y < (int64_t)map->dim1 && e >= 0 && e < (int64_t)map->dim0)
                memcpy(&v, map->base + (uint64_t)y * map->row_bytes + (uint64_t)e * 2, sizeof v);
            memcpy(&box[(r * row + 2 * x) ^ swizzle], &v, sizeof v);
        }
    }
    std::lock_guard<std::mutex> lock(b.async_mutex);
    emu_mbarrier_at(offset, what);
    for (size_t i = 0; i < bytes; i += 16) {
        emu_check_no_wgmma_reads(d + i, "a TMA load into");
        emu_check_no_tma_writes(d + i, "a TMA load into");
    }
    memset(d, 0xFF, bytes);
    for (size_t i = 0; i < bytes; i += 16) emu_piece_at(d + i).tma_writers.fetch_add(1);
    b.tmas.push_back({(uint32_t)(d - b.dynamic_shared), offset, std::move(box)});
    b.progress++;
    b.async_changed.notify_all();
}

/* setmaxnreg.{inc,dec}.sync.aligned.u32 n ("setmaxnreg"): every warp of the
 * warpgroup executes the same one (n in 24..256, a multiple of 8). .dec
 * must not raise the warp's count nor .inc lower it; .inc blocks until the
 * CTA's pool has the registers. The pool is taken as the most a launch of
 * this size can hold (launch_registers for every thread), so only a request
 * no launch could grant waits forever and stops the test. Otherwise
 * registers are not modelled. */
inline void emu_setmaxnreg(int n, bool inc) {
    const char *name = inc ? "setmaxnreg.inc.sync.aligned.u32" : "setmaxnreg.dec.sync.aligned.u32";
    emu_warpgroup &g = emu_my_warpgroup(name);
    emu_meet(g, name, n);
    if (threadIdx.x % 128 == 0) {
        emu_block &b = *emu_running;
        std::unique_lock<std::mutex> lock(b.async_mutex);
        if (inc ? g.registers != 0 && n < g.registers : n > (g.registers != 0 ? g.registers : b.launch_registers)) {
            fprintf(stderr, "simt_emu: warpgroup %u: %s %d from %d registers (at most %d at launch)\n",
                    threadIdx.x / 128, name, n, g.registers, b.launch_registers);
            abort();
        }
        const auto holding = [&] {
            int total = n;
            for (const emu_warpgroup &w : b.warpgroup)
                if (&w != &g) total += w.registers != 0 ? w.registers : b.launch_registers;
            return total;
        };
        const int pool = b.launch_registers * (int)b.warpgroup.size();
        if (inc)
            emu_wait_until(
                lock, [&] { return holding() <= pool; },
                [&] {
                    fprintf(stderr,
                            "simt_emu: warpgroup %u: %s %d waits for registers: the warpgroups would hold %d per "
                            "thread of a warpgroup, and a block of %u threads has at most %d\n",
                            threadIdx.x / 128, name, n, holding(), blockDim.x, pool);
                });
        g.registers = n;
        b.progress++;
        b.async_changed.notify_all();
    }
    emu_meet(g, inc ? "setmaxnreg.inc (done)" : "setmaxnreg.dec (done)", n);
}

template <int N> void moe_setmaxnreg_inc() {
    static_assert(N >= 24 && N <= 256 && N % 8 == 0, "setmaxnreg takes 24..256, a multiple of 8");
    emu_setmaxnreg(N, true);
}

template <int N> void moe_setmaxnreg_dec() {
    static_assert(N >= 24 && N <= 256 && N % 8 == 0, "setmaxnreg takes 24..256, a multiple of 8");
    emu_setmaxnreg(N, false);
}

/* kernel() as a launch over grid with threads per block (a multiple of
 * 32) and shared_bytes of dynamic shared memory: kernel is a callable that
 * calls the __global__ function with its arguments. A wgmma still pending,
 * or a TMA load still in flight, when a block's threads have finished stops
 * the test: its d would never be written on a device either, or its bytes
 * would land after the block. */
template <typename Kernel> void emu_launch(dim3 grid, int threads, Kernel kernel, size_t shared_bytes = 0) {
    gridDim = grid;
    blockDim = dim3{(unsigned)threads, 1, 1};
    const int warps = threads / 32, warpgroups = threads % 128 == 0 ? threads / 128 : 0;
    for (unsigned z = 0; z < grid.z; z++)
        for (unsigned y = 0; y < grid.y; y++)
            for (unsigned x = 0; x < grid.x; x++) {
                std::barrier<> block(threads);
                std::deque<std::barrier<>> warp_barriers; /* barriers do not move */
                std::deque<std::barrier<emu_same_instruction>> warpgroup_barriers;
                emu_block shared;
                shared.shared_storage.assign(shared_bytes + 4096, 0xFF);
                const uintptr_t storage = (uintptr_t)shared.shared_storage.data();
                shared.dynamic_shared =
                    shared.shared_storage.data() + ((uintptr_t)emu_shared_window_start - storage) % 4096;
                shared.dynamic_shared_bytes = shared_bytes;
                shared.shared_pieces.reset(new emu_shared_piece[(shared_bytes + 15) / 16]);
                shared.block = &block;
                for (int w = 0; w < warps; w++) {
                    warp_barriers.emplace_back(32);
                    shared.warp.push_back(&warp_barriers.back());
                }
                shared.warpgroup.resize((size_t)warpgroups);
                for (int g = 0; g < warpgroups; g++) {
                    warpgroup_barriers.emplace_back(128, emu_same_instruction{&shared.warpgroup[(size_t)g], 128 * g});
                    shared.warpgroup[(size_t)g].sync = &warpgroup_barriers.back();
                }
                shared.lane_bits.resize((size_t)warps * 32);
                shared.lane_a.resize((size_t)warps * 32 * 4);
                shared.lane_b.resize((size_t)warps * 32 * 2);
                /* 64K 32-bit registers per SM, given to warps 8 per thread at a time */
                shared.launch_registers = min(256, 65536 / threads / 8 * 8);
                emu_running = &shared;
                std::vector<std::thread> team;
                for (int t = 0; t < threads; t++)
                    team.emplace_back([=] {
                        threadIdx = dim3{(unsigned)t, 0, 0};
                        blockIdx = dim3{x, y, z};
                        kernel();
                    });
                for (std::thread &t : team) t.join();
                if (!shared.tmas.empty()) {
                    fprintf(stderr,
                            "simt_emu: block (%u, %u, %u) ended with %zu TMA loads in flight: no thread waited on "
                            "their mbarriers, and they would land in the shared memory of an exited block\n",
                            x, y, z, shared.tmas.size());
                    abort();
                }
                for (size_t g = 0; g < shared.warpgroup.size(); g++) {
                    size_t pending = shared.warpgroup[g].open.size();
                    for (const std::vector<emu_wgmma> &group : shared.warpgroup[g].committed) pending += group.size();
                    if (pending > 0) {
                        fprintf(stderr,
                                "simt_emu: block (%u, %u, %u) ended with %zu wgmma of warpgroup %zu never run: no "
                                "wgmma.wait_group covered them\n",
                                x, y, z, pending, g);
                        abort();
                    }
                }
                emu_running = nullptr;
            }
}

#endif /* MOE_TESTS_SIMT_EMU_H */
