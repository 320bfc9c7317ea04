/* test_simt_emu_tma.cpp: tests/simt_emu.h's mbarriers, TMA tile loads and
 * setmaxnreg against the PTX ISA, the driver's tensor-map rules and the
 * CUDA Programming Guide's TMA swizzle, apart from any kernel. Every byte a
 * TMA load writes must sit where the 128-byte swizzle puts it
 * (sw128_offset, written once below), with zeros past the tensor's edges;
 * a two-stage producer/consumer ring must deliver each tile once, in order;
 * a wgmma must read TMA tiles with no proxy fence. The guards a device
 * lacks (reads before the wait, refills under an unfinished wgmma, phases
 * that never complete, misplaced boxes, tensor maps the driver rejects,
 * mbarriers used before their init is visible, setmaxnreg not executed
 * alike, register pools no launch has) must stop the test. */
#include <criterion/criterion.h>

#include <cmath>
#include <csignal>
#include <vector>

#include "simt_emu.h"

namespace {

constexpr uint32_t BOX_BYTES_64x128 = 64 * 2 * 128;

/* Byte offset, from the first byte of a box whose rows are 64 bf16 (128
 * bytes) and which starts at shared address box, of element x of row r in
 * the 128-byte swizzle: row r is 128 bytes after row r - 1, and its 16-byte
 * chunk x / 8 sits at chunk (x / 8) XOR bits 7-9 of the row's own shared
 * address (CUDA Programming Guide, TMA swizzle: smem[y][x] <->
 * smem[y][((y + offset) % 8) ^ x], offset = (address / 128) % 8). */
size_t sw128_offset(uint32_t box, int r, int x) {
    const uint32_t row = box + 128u * (uint32_t)r;
    return 128 * (size_t)r + 16 * (size_t)((x / 8) ^ ((row >> 7) & 7)) + 2 * (size_t)(x % 8);
}

/* Offset into dynamic shared memory of the first byte whose shared address
 * is align-aligned. */
size_t aligned(unsigned char *smem, uint32_t align) { return (align - moe_shared_address(smem) % align) % align; }

struct lcg {
    uint64_t s;
    uint32_t next() {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        return (uint32_t)(s >> 33);
    }
};

/* A row-major bf16 tensor of rows rows of row_bytes, whose dim0 elements
 * are small nonzero integers (exact in bf16, and in fp32 sums) and whose
 * padding is a value no element has. */
struct tensor {
    int64_t dim0, rows, row_bytes;
    std::vector<uint16_t> bits;
    tensor(int64_t dim0_, int64_t rows_, int64_t row_bytes_, uint64_t seed)
        : dim0(dim0_), rows(rows_), row_bytes(row_bytes_), bits((size_t)(rows_ * row_bytes_ / 2), 0x7F7F) {
        lcg g{seed};
        for (int64_t r = 0; r < rows; r++)
            for (int64_t x = 0; x < dim0; x++) {
                const int v = (int)(g.next() % 16) - 8;
                bits[(size_t)(r * row_bytes / 2 + x)] = emu_to_bf16((float)(v >= 0 ? v + 1 : v));
            }
    }
    uint16_t at(int64_t r, int64_t x) const { /* zero outside, as the map fills */
        return r < 0 || r >= rows || x < 0 || x >= dim0 ? 0 : bits[(size_t)(r * row_bytes / 2 + x)];
    }
    CUtensorMap map(uint32_t box0, uint32_t box1) const {
        return emu_tensor_map_2d(bits.data(), (uint64_t)dim0, (uint64_t)rows, (uint64_t)row_bytes, box0, box1, true);
    }
};

/* Thread 0 inits each of the mbarriers (with count), fences, and the block
 * syncs, as a kernel must before other threads use them. */
void init_barriers(uint64_t *bars, int n, int count) {
    if (threadIdx.x == 0) {
        for (int i = 0; i < n; i++) moe_mbarrier_init(&bars[i], count);
        moe_fence_mbarrier_init();
    }
    __syncthreads();
}

} // namespace

/* Two 128 x 64 boxes of a 150 x 200 tensor with 16 bytes of row padding,
 * one running past both far edges and one starting before both near ones,
 * into stages 384 bytes past a 1024-byte boundary (the swizzle follows the
 * address, not the stage), on one mbarrier expecting both boxes' bytes.
 * Every byte of dynamic shared memory but the mbarrier is checked. */
Test(simt_emu_tma, boxes_land_swizzled_with_zero_fill) {
    const tensor t(200, 150, 416, 1);
    const int coords[2][2] = {{160, 100}, {-24, -5}};
    const size_t smem_bytes = 1024 + 384 + 2 * BOX_BYTES_64x128 + 16;
    std::vector<unsigned char> got(smem_bytes);
    size_t stage = 0, bar_at = 0;
    uint32_t stage_address = 0;
    cr_assert((uintptr_t)t.bits.data() % 16 == 0, "the tensor's storage is not 16-byte aligned");
    emu_launch(
        dim3{1, 1, 1}, 256,
        [&] {
            MOE_DYNAMIC_SHARED(unsigned char, smem);
            const CUtensorMap map = t.map(64, 128);
            const size_t s0 = aligned(smem, 1024) + 384;
            uint64_t *bar = (uint64_t *)(smem + s0 + 2 * BOX_BYTES_64x128);
            init_barriers(bar, 1, 1);
            if (threadIdx.x == 0) {
                stage = s0, bar_at = s0 + 2 * BOX_BYTES_64x128, stage_address = moe_shared_address(smem + s0);
                moe_mbarrier_arrive_expect_tx(bar, 2 * BOX_BYTES_64x128);
                for (int b = 0; b < 2; b++)
                    moe_tma_load_2d(smem + s0 + b * BOX_BYTES_64x128, &map, coords[b][0], coords[b][1], bar);
            }
            moe_mbarrier_wait(bar, 0);
            __syncthreads();
            if (threadIdx.x == 0) memcpy(got.data(), smem, smem_bytes);
        },
        smem_bytes);

    std::vector<unsigned char> want(smem_bytes, 0xFF);
    for (int b = 0; b < 2; b++) {
        const uint32_t box = stage_address + (uint32_t)b * BOX_BYTES_64x128;
        for (int r = 0; r < 128; r++)
            for (int x = 0; x < 64; x++) {
                const uint16_t v = t.at(coords[b][1] + r, coords[b][0] + x);
                memcpy(&want[stage + b * BOX_BYTES_64x128 + sw128_offset(box, r, x)], &v, sizeof v);
            }
    }
    int64_t wrong = 0, first = -1;
    for (size_t i = 0; i < smem_bytes; i++)
        if ((i < bar_at || i >= bar_at + 8) && got[i] != want[i]) {
            wrong++;
            if (first < 0) first = (int64_t)i;
        }
    cr_expect(stage_address % 1024 == 384, "the stage is at shared address 0x%x", stage_address);
    cr_expect(wrong == 0, "%lld of %zu bytes differ; the first at dynamic shared offset %lld: got 0x%02x, want 0x%02x",
              (long long)wrong, smem_bytes, (long long)first, first < 0 ? 0 : got[(size_t)first],
              first < 0 ? 0 : want[(size_t)first]);
}

/* A load lands only when its mbarrier is waited on: the stage, written
 * with 0x11 before the load is issued, reads as 0xFF bytes from the issue
 * to the wait (neither the new box nor the old bytes a refill would rely
 * on), and as the box after it. */
Test(simt_emu_tma, a_read_before_the_wait_sees_stale_bytes) {
    const tensor t(64, 128, 128, 2);
    int64_t early_not_ff = 0, late_wrong = 0;
    emu_launch(
        dim3{1, 1, 1}, 32,
        [&] {
            MOE_DYNAMIC_SHARED(unsigned char, smem);
            const CUtensorMap map = t.map(64, 128);
            unsigned char *stage = smem + aligned(smem, 1024);
            uint64_t *bar = (uint64_t *)(stage + BOX_BYTES_64x128);
            init_barriers(bar, 1, 1);
            if (threadIdx.x != 0) return;
            memset(stage, 0x11, BOX_BYTES_64x128);
            moe_mbarrier_arrive_expect_tx(bar, BOX_BYTES_64x128);
            moe_tma_load_2d(stage, &map, 0, 0, bar);
            const uint32_t box = moe_shared_address(stage);
            std::vector<unsigned char> before(stage, stage + BOX_BYTES_64x128);
            moe_mbarrier_wait(bar, 0);
            for (int r = 0; r < 128; r++)
                for (int x = 0; x < 64; x++) {
                    const size_t at = sw128_offset(box, r, x);
                    const uint16_t v = t.at(r, x);
                    uint16_t early, late;
                    memcpy(&early, &before[at], sizeof early);
                    memcpy(&late, stage + at, sizeof late);
                    early_not_ff += early != 0xFFFF;
                    late_wrong += late != v;
                }
        },
        1024 + BOX_BYTES_64x128 + 16);
    cr_expect(early_not_ff == 0, "between the issue and the wait, %lld of 8192 elements read other than 0xFFFF",
              (long long)early_not_ff);
    cr_expect(late_wrong == 0, "after the wait, %lld elements differ from the box", (long long)late_wrong);
}

/* A warp-specialized ring: warpgroup 0 produces (thread 0 issues the loads,
 * the warpgroup gives up registers), warpgroups 1 and 2 consume. Seven
 * 32 x 64 tiles, the last running 11 rows past the tensor, pass through
 * two stages guarded by full (1 arrival + the tile's bytes) and empty (256
 * arrivals) mbarriers, the parities flipping every round; the producer's
 * first wait on each empty mbarrier is for parity 1, which a fresh mbarrier
 * passes. Consumer thread i sums (t + 1) * element e of tile t over the e
 * with e % 256 == i: a stale, skipped or repeated tile changes the sums. */
Test(simt_emu_tma, a_two_stage_ring_delivers_every_tile_once) {
    constexpr int TILES = 7, ROWS = 32, STAGE = 64 * 2 * ROWS;
    const tensor t(64, TILES * ROWS - 11, 128, 3);
    std::vector<float> got(256, NAN);
    emu_launch(
        dim3{1, 1, 1}, 384,
        [&] {
            MOE_DYNAMIC_SHARED(unsigned char, smem);
            const CUtensorMap map = t.map(64, ROWS);
            unsigned char *stages = smem + aligned(smem, 1024);
            uint64_t *full = (uint64_t *)(stages + 2 * STAGE), *empty = full + 2;
            if (threadIdx.x == 0) {
                for (int s = 0; s < 2; s++) {
                    moe_mbarrier_init(&full[s], 1);
                    moe_mbarrier_init(&empty[s], 256);
                }
                moe_fence_mbarrier_init();
            }
            __syncthreads();
            if (threadIdx.x < 128) {
                moe_setmaxnreg_dec<40>();
                if (threadIdx.x == 0)
                    for (int tile = 0; tile < TILES; tile++) {
                        const int s = tile % 2, round = tile / 2;
                        moe_mbarrier_wait(&empty[s], (round & 1) ^ 1);
                        moe_mbarrier_arrive_expect_tx(&full[s], STAGE);
                        moe_tma_load_2d(stages + s * STAGE, &map, 0, tile * ROWS, &full[s]);
                    }
                return;
            }
            moe_setmaxnreg_inc<232>();
            const int i = (int)threadIdx.x - 128;
            float sum = 0.0f;
            for (int tile = 0; tile < TILES; tile++) {
                const int s = tile % 2;
                moe_mbarrier_wait(&full[s], (tile / 2) & 1);
                const unsigned char *stage = stages + s * STAGE;
                for (int e = i; e < 64 * ROWS; e += 256) {
                    uint16_t v;
                    memcpy(&v, stage + sw128_offset(moe_shared_address(stage), e / 64, e % 64), sizeof v);
                    sum += (float)(tile + 1) * emu_from_bf16(v);
                }
                moe_mbarrier_arrive(&empty[s]);
            }
            got[(size_t)i] = sum;
        },
        1024 + 2 * STAGE + 32);
    int wrong = 0, first = -1;
    float first_got = 0.0f, first_want = 0.0f;
    for (int i = 0; i < 256; i++) {
        float want = 0.0f;
        for (int tile = 0; tile < TILES; tile++)
            for (int e = i; e < 64 * ROWS; e += 256)
                want += (float)(tile + 1) * emu_from_bf16(t.at(tile * ROWS + e / 64, e % 64));
        if (got[(size_t)i] != want && wrong++ == 0) first = i, first_got = got[(size_t)i], first_want = want;
    }
    cr_expect(wrong == 0, "%d of 256 consumer sums wrong; consumer %d: got %g, want %g", wrong, first, first_got,
              first_want);
}

namespace {

constexpr int WG_TILE = 64 * 2 * 64; /* 64 rows of 64 bf16 */

/* "Matrix Descriptor Format" for a K-major operand in the 128-byte swizzle
 * starting at shared address start, 8-row groups sbo bytes apart. */
uint64_t sw128_descriptor(uint32_t start, uint32_t sbo) {
    return (uint64_t)((start & 0x3FFFF) >> 4) | (uint64_t)1 << 16 | (uint64_t)((sbo & 0x3FFFF) >> 4) << 32 |
           (uint64_t)1 << 62;
}

enum class wgmma_fault { none, reload_under_wgmma, unseen_phase };

/* Warpgroup 1 first fills both tiles by cp.async with other bytes, fencing
 * nothing (only so that the proxy guard sees cp.async bytes the loads then
 * replace), then thread 128 loads A [50 rows (64 with the zero fill), 64 k]
 * and B [64 n, 64 k] by TMA, waits for them and arrives on a go mbarrier;
 * warpgroup 0 waits on go and runs out [64, 64] = A B^T through four k16
 * wgmma. The wait on go hands on what thread 128 saw, as the memory model's
 * release/acquire chain does. fault breaks it: reload_under_wgmma has thread
 * 0 load A again before the wgmma.wait_group; unseen_phase has thread 128
 * arrive on go before waiting for the loads. */
void wgmma_on_tma(float *out, const tensor &a, const tensor &b, const tensor &junk, wgmma_fault fault) {
    MOE_DYNAMIC_SHARED(unsigned char, smem);
    unsigned char *ta = smem + aligned(smem, 1024), *tb = ta + WG_TILE;
    uint64_t *full = (uint64_t *)(tb + WG_TILE), *go = full + 1, *again = full + 2;
    const CUtensorMap map_a = a.map(64, 64), map_b = b.map(64, 64);
    const int t = (int)threadIdx.x;
    if (t >= 128) {
        for (int p = t - 128; p < 2 * WG_TILE / 16; p += 128)
            moe_cp_async16(ta + 16 * p, (const unsigned char *)junk.bits.data() + 16 * p, 16);
        moe_cp_async_commit();
        moe_cp_async_wait<0>();
    }
    if (t == 128) {
        for (int i = 0; i < 3; i++) moe_mbarrier_init(&full[i], 1);
        moe_fence_mbarrier_init();
    }
    __syncthreads();
    if (t == 128) {
        moe_mbarrier_arrive_expect_tx(full, 2 * WG_TILE);
        moe_tma_load_2d(ta, &map_a, 0, 0, full);
        moe_tma_load_2d(tb, &map_b, 0, 0, full);
        if (fault == wgmma_fault::unseen_phase) moe_mbarrier_arrive(go);
        moe_mbarrier_wait(full, 0);
        if (fault != wgmma_fault::unseen_phase) moe_mbarrier_arrive(go);
    }
    if (t >= 128) return;
    moe_mbarrier_wait(go, 0);
    float d[32];
    moe_wgmma_fence();
    for (int s = 0; s < 4; s++)
        emu_wgmma_bf16<64>(d, sw128_descriptor(moe_shared_address(ta) + 32u * (uint32_t)s, 1024),
                           sw128_descriptor(moe_shared_address(tb) + 32u * (uint32_t)s, 1024), s > 0);
    moe_wgmma_commit();
    if (fault == wgmma_fault::reload_under_wgmma && t == 0) {
        moe_mbarrier_arrive_expect_tx(again, WG_TILE);
        moe_tma_load_2d(ta, &map_a, 0, 0, again);
    }
    moe_wgmma_wait<0>();
    if (fault == wgmma_fault::reload_under_wgmma && t == 0) moe_mbarrier_wait(again, 0);
    for (int i = 0; i < 32; i++) /* the ISA's figure of accumulator D for m64nNk16 */
        out[(16 * (t / 32) + (t % 32) / 4 + 8 * ((i / 2) % 2)) * 64 + 8 * (i / 4) + 2 * (t % 4) + i % 2] = d[i];
}

void run_wgmma_on_tma(std::vector<float> &out, const tensor &a, const tensor &b, wgmma_fault fault) {
    const tensor junk(64, 128, 128, 9);
    emu_launch(
        dim3{1, 1, 1}, 256, [&] { wgmma_on_tma(out.data(), a, b, junk, fault); }, 1024 + 2 * WG_TILE + 32);
}

} // namespace

/* TMA writes through the async proxy, as wgmma reads: the tiles need no
 * fence.proxy.async, and the cp.async bytes they replace must not trip the
 * proxy guard. Sums of small integers are exact, rows 50..63 of A zeros. */
Test(simt_emu_tma, a_wgmma_reads_tma_tiles_without_a_proxy_fence) {
    const tensor a(64, 50, 128, 4), b(64, 64, 128, 5);
    std::vector<float> out(64 * 64, NAN);
    run_wgmma_on_tma(out, a, b, wgmma_fault::none);
    int wrong = 0, first = -1;
    for (int m = 0; m < 64; m++)
        for (int n = 0; n < 64; n++) {
            double want = 0.0;
            for (int k = 0; k < 64; k++) want += (double)emu_from_bf16(a.at(m, k)) * emu_from_bf16(b.at(n, k));
            if (out[(size_t)(m * 64 + n)] != want && wrong++ == 0) first = m * 64 + n;
        }
    cr_expect(wrong == 0, "%d of 4096 outputs wrong, the first [%d, %d]: got %g", wrong, first / 64, first % 64,
              first < 0 ? 0.0 : out[(size_t)first]);
}

Test(simt_emu_tma, a_tma_into_a_stage_an_unwaited_wgmma_reads_aborts, .signal = SIGABRT) {
    const tensor a(64, 64, 128, 4), b(64, 64, 128, 5);
    std::vector<float> out(64 * 64);
    run_wgmma_on_tma(out, a, b, wgmma_fault::reload_under_wgmma);
}

Test(simt_emu_tma, a_wgmma_on_tma_bytes_of_a_phase_its_warpgroup_has_not_seen_aborts, .signal = SIGABRT) {
    const tensor a(64, 64, 128, 4), b(64, 64, 128, 5);
    std::vector<float> out(64 * 64);
    run_wgmma_on_tma(out, a, b, wgmma_fault::unseen_phase);
}

namespace {

enum class fault {
    expect_too_many, /* expect_tx of 16 bytes more than the box */
    misaligned,      /* the box 64 bytes past a 128-byte boundary */
    past_the_end,    /* the box runs past the dynamic shared memory */
    never_waited,    /* nobody waits for the load */
    no_fence,        /* another thread uses the mbarrier, init not fenced */
    no_sync,         /* fenced, no __syncthreads before another thread uses it */
    uninitialized,   /* a wait on an mbarrier no init has touched */
    extra_arrival,   /* a second arrival in a phase expecting one */
    skipped_wait,    /* an arrival in phase 1 before any wait on phase 0 */
};

/* One load of a 64 x 64 box on one mbarrier in a block of 64 threads, with
 * fault in it. */
void one_load(fault f) {
    const tensor t(64, 64, 128, 6);
    std::atomic<bool> initialized{false}; /* orders no_sync's use after the init, and nothing else */
    emu_wait_timeout_s = 0.2;
    emu_launch(
        dim3{1, 1, 1}, 64,
        [&] {
            MOE_DYNAMIC_SHARED(unsigned char, smem);
            const CUtensorMap map = t.map(64, 64);
            unsigned char *base = smem + aligned(smem, 1024);
            unsigned char *stage = base + (f == fault::misaligned ? 64 : f == fault::past_the_end ? 2048 : 0);
            uint64_t *bar = (uint64_t *)(base + WG_TILE + 128);
            if (threadIdx.x == 0 && f != fault::uninitialized) {
                moe_mbarrier_init(bar, 1);
                if (f != fault::no_fence) moe_fence_mbarrier_init();
                initialized.store(true);
            }
            if (f != fault::no_sync) __syncthreads();
            if (threadIdx.x == 32) {
                while (f == fault::no_sync && !initialized.load()) std::this_thread::yield();
                if (f == fault::extra_arrival || f == fault::skipped_wait) {
                    moe_mbarrier_arrive_expect_tx(bar, f == fault::extra_arrival ? 16 : 0);
                    moe_mbarrier_arrive(bar);
                    return;
                }
                moe_mbarrier_arrive_expect_tx(bar, WG_TILE + (f == fault::expect_too_many ? 16 : 0));
                moe_tma_load_2d(stage, &map, 0, 0, bar);
                if (f != fault::never_waited) moe_mbarrier_wait(bar, 0);
            }
        },
        1024 + WG_TILE + 256);
}

} // namespace

Test(simt_emu_tma, a_phase_that_never_completes_times_out, .signal = SIGABRT) { one_load(fault::expect_too_many); }
Test(simt_emu_tma, a_box_not_128_byte_aligned_aborts, .signal = SIGABRT) { one_load(fault::misaligned); }
Test(simt_emu_tma, a_box_past_the_dynamic_shared_memory_aborts, .signal = SIGABRT) { one_load(fault::past_the_end); }
Test(simt_emu_tma, a_load_never_waited_for_aborts, .signal = SIGABRT) { one_load(fault::never_waited); }
Test(simt_emu_tma, an_mbarrier_used_before_its_init_is_fenced_aborts, .signal = SIGABRT) { one_load(fault::no_fence); }
Test(simt_emu_tma, an_mbarrier_used_before_a_sync_after_its_init_aborts, .signal = SIGABRT) {
    one_load(fault::no_sync);
}
Test(simt_emu_tma, an_uninitialized_mbarrier_aborts, .signal = SIGABRT) { one_load(fault::uninitialized); }
Test(simt_emu_tma, more_arrivals_than_a_phase_expects_abort, .signal = SIGABRT) { one_load(fault::extra_arrival); }
Test(simt_emu_tma, an_arrival_in_a_phase_after_one_nobody_waited_for_aborts, .signal = SIGABRT) {
    one_load(fault::skipped_wait);
}

/* The checks run on the host side too, like the driver's. */
Test(simt_emu_tma, a_128_byte_swizzle_box_wider_than_128_bytes_is_rejected, .signal = SIGABRT) {
    const tensor t(256, 8, 512, 7);
    emu_tensor_map_2d(t.bits.data(), 256, 8, 512, 128, 8, true);
}

Test(simt_emu_tma, a_row_stride_not_a_multiple_of_16_is_rejected, .signal = SIGABRT) {
    const tensor t(60, 8, 120, 7);
    emu_tensor_map_2d(t.bits.data(), 60, 8, 120, 64, 8, true);
}

Test(simt_emu_tma, setmaxnreg_with_different_counts_in_a_warpgroup_aborts, .signal = SIGABRT) {
    emu_launch(dim3{1, 1, 1}, 128, [] {
        if (threadIdx.x == 5)
            moe_setmaxnreg_inc<240>();
        else
            moe_setmaxnreg_inc<232>();
    });
}

/* 384 threads can hold 168 registers each at launch: 40 + 2 x 240 per
 * warpgroup thread is more than 3 x 168, so the .inc waits forever. */
Test(simt_emu_tma, setmaxnreg_beyond_the_register_pool_aborts, .signal = SIGABRT) {
    emu_wait_timeout_s = 0.2;
    emu_launch(dim3{1, 1, 1}, 384, [] {
        if (threadIdx.x < 128)
            moe_setmaxnreg_dec<40>();
        else
            moe_setmaxnreg_inc<240>();
    });
}
