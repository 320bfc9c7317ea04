/* test_simt_emu_wgmma.cpp: tests/simt_emu.h's wgmma against the PTX ISA,
 * apart from any kernel. A block of two warpgroups loads A [128, K] and
 * B [n, K] (bf16, K-major) into dynamic shared memory in the 128-byte
 * swizzle, each element placed at the byte the ISA's layout gives
 * (sw128_offset, written once below), steps descriptors through k16
 * slices, and every thread's accumulators, read through the ISA's fragment
 * layout of D, must match a double-precision product. The guards a device
 * lacks (a wgmma without wgmma.fence, on cp.async data not fenced to the
 * async proxy, over bytes being rewritten, outside the dynamic shared
 * memory, in another swizzle, or left pending) must stop the test. */
#include <criterion/criterion.h>

#include <csignal>
#include <cmath>
#include <vector>

#include "simt_emu.h"
#include "test_lcg.h"

namespace {

constexpr int THREADS = 256; /* two warpgroups, one per 64 rows of A */
constexpr int M = 128, K = 128;
constexpr uint32_t SBO = 2048; /* bytes from one 8-row group to the next */
constexpr size_t A_BYTES = (size_t)M / 8 * SBO, MAX_B_BYTES = (size_t)256 / 8 * SBO;
constexpr size_t SMEM_BYTES = 2048 + A_BYTES + MAX_B_BYTES; /* room to align, and to misalign */

/* Byte offset, from a 1024-byte aligned base, of element (row, k) of a
 * K-major bf16 operand in the 128-byte swizzle (PTX ISA, "Shared Memory
 * Matrix Layout", figure "K major 128B swizzling", and "Canonical
 * Layouts"): 8 rows of 128 bytes (64 k each) make a 1024-byte atom, and
 * within a row the 16-byte piece holding k 8p .. 8p + 7 of the atom lies
 * at piece p XOR (row % 8). Here the atom of rows 8g .. 8g + 7 and k
 * 64j .. 64j + 63 sits at g SBO + 1024 j: the two k atoms of a row group
 * side by side, so SBO is not the 1024 of a lone atom. */
size_t sw128_offset(int row, int k) {
    const int p = (k % 64) / 8;
    return (size_t)(row / 8) * SBO + (size_t)(k / 64) * 1024 + (size_t)(row % 8) * 128 +
           (size_t)(p ^ (row % 8)) * 16 + (size_t)(k % 8) * 2;
}

/* "Matrix Descriptor Format" for a K-major operand in the 128-byte swizzle
 * (mode 1 in bits 62-63) starting at shared address start; the leading
 * byte offset is unused by this layout and written as 1, as CUTLASS does. */
uint64_t sw128_descriptor(uint32_t start, uint32_t sbo) {
    return (uint64_t)((start & 0x3FFFF) >> 4) | (uint64_t)1 << 16 | (uint64_t)((sbo & 0x3FFFF) >> 4) << 32 |
           (uint64_t)1 << 62;
}

enum class rewrite { none, plain_stores, cp_async };

/* What a run breaks on purpose; the defaults make a correct kernel. */
struct run_options {
    int n = 256;
    int k_steps = K / 16;
    bool align = true;     /* false: tiles at the start of dynamic shared memory, as if it were 1024-aligned */
    uint32_t misalign = 0; /* bytes the tiles start past a 1024-byte boundary */
    bool wgmma_fence = true, proxy_fence = true, wait = true;
    rewrite rewrite_a = rewrite::none; /* A overwritten with a2 after the wgmma are issued, before the waits */
    uint32_t b_shift = 0;              /* bytes added to B's start address */
    uint64_t b_swizzle = 1;            /* swizzle mode in B's descriptor */
    bool uneven = false;               /* thread 200 passes another A descriptor */
    bool diverge = false;              /* thread 130 skips the first wait */
};

using wgmma_fn = void (*)(float *, uint64_t, uint64_t, int);

/* out [M, n] = a [M, K] b [n, K]^T over the first 16 k_steps k. */
void wgmma_kernel(float *out, const __nv_bfloat16 *a, const __nv_bfloat16 *a2, const __nv_bfloat16 *b,
                  const run_options &o, wgmma_fn wgmma) {
    MOE_DYNAMIC_SHARED(unsigned char, smem);
    unsigned char *ta = (o.align ? smem + (1024 - moe_shared_address(smem) % 1024) % 1024 : smem) + o.misalign;
    unsigned char *tb = ta + A_BYTES;
    const int t = (int)threadIdx.x;
    auto load = [&](unsigned char *tile, const __nv_bfloat16 *src, int rows, bool async) {
        for (int p = t; p < rows * (K / 8); p += THREADS) {
            const int row = p / (K / 8), k = 8 * (p % (K / 8));
            if (async)
                moe_cp_async16(tile + sw128_offset(row, k), src + (size_t)row * K + k, 16);
            else
                memcpy(tile + sw128_offset(row, k), src + (size_t)row * K + k, 16);
        }
    };
    load(ta, a, M, true);
    load(tb, b, o.n, true);
    moe_cp_async_commit();
    moe_cp_async_wait<0>();
    if (o.proxy_fence) moe_fence_proxy_async();
    __syncthreads();

    const int wg = t / 128, l = t % 128;
    float d[128];
    for (float &x : d) x = NAN; /* the first step's scale_d = 0 must not read it */
    if (o.wgmma_fence) moe_wgmma_fence();
    for (int s = 0; s < o.k_steps; s++) {
        /* k 16s .. 16s + 15: k atom s / 4, 32 bytes per k16 inside its rows */
        const uint32_t step = (uint32_t)(s / 4) * 1024 + (uint32_t)(s % 4) * 32;
        uint64_t da = sw128_descriptor(moe_shared_address(ta) + (uint32_t)wg * 8 * SBO + step, SBO);
        uint64_t db = sw128_descriptor(moe_shared_address(tb) + step + o.b_shift, SBO);
        db = (db & ~(3ull << 62)) | o.b_swizzle << 62;
        if (o.uneven && t == 200) da += 2;
        wgmma(d, da, db, s > 0);
        if (s % 4 == 3 || s == o.k_steps - 1) moe_wgmma_commit();
    }
    if (o.rewrite_a != rewrite::none) {
        load(ta, a2, M, o.rewrite_a == rewrite::cp_async);
        __syncthreads();
    }
    if (o.wait) {
        if (!(o.diverge && t == 130)) moe_wgmma_wait<1>();
        moe_wgmma_wait<0>();
    }
    for (int i = 0; i < o.n / 2; i++) { /* the ISA's figure of accumulator D for m64nNk16 */
        const int row = 64 * wg + 16 * (l / 32) + (l % 32) / 4 + 8 * ((i / 2) % 2);
        const int col = 8 * (i / 4) + 2 * (l % 4) + i % 2;
        out[(size_t)row * o.n + col] = d[i];
    }
}

std::vector<__nv_bfloat16> random_bf16(size_t count, uint64_t seed) {
    lcg g{seed};
    std::vector<__nv_bfloat16> v(count);
    for (auto &x : v) x = __float2bfloat16_rn(g.next());
    return v;
}

struct run_result {
    std::vector<__nv_bfloat16> a, a2, b;
    std::vector<float> out; /* [M, n] */
};

run_result run(const run_options &o, wgmma_fn wgmma = moe_wgmma_m64n256k16) {
    run_result r{random_bf16((size_t)M * K, 1), random_bf16((size_t)M * K, 2), random_bf16((size_t)o.n * K, 3),
                 std::vector<float>((size_t)M * o.n, NAN)};
    emu_launch(
        dim3{1, 1, 1}, THREADS,
        [&] { wgmma_kernel(r.out.data(), r.a.data(), r.a2.data(), r.b.data(), o, wgmma); }, SMEM_BYTES);
    return r;
}

/* fp32 sums of exact bf16 products: within 1e-5 of sum |a b| of each
 * element. Returns how many elements miss that; expect_all says whether
 * every element must be within it (else the count is the result). */
int64_t compare(const run_result &r, const std::vector<__nv_bfloat16> &a, int n, int k_steps, bool expect_all,
                const char *what) {
    double worst = 0.0, worst_got = 0.0, worst_want = 0.0;
    int at_row = -1, at_col = -1;
    int64_t wrong = 0;
    for (int row = 0; row < M; row++)
        for (int col = 0; col < n; col++) {
            double want = 0.0, size = 0.0;
            for (int k = 0; k < 16 * k_steps; k++) {
                const double p = (double)emu_from_bf16(a[(size_t)row * K + k].bits) *
                                 emu_from_bf16(r.b[(size_t)col * K + k].bits);
                want += p;
                size += std::fabs(p);
            }
            const double got = r.out[(size_t)row * n + col], err = std::fabs(got - want) / std::max(size, 1e-30);
            wrong += !(err <= 1e-5);
            if (!(err <= worst)) worst = err, worst_got = got, worst_want = want, at_row = row, at_col = col;
        }
    if (expect_all)
        cr_expect(wrong == 0,
                  "%s: %lld of %d elements off; worst at [%d, %d]: got %.7g, want %.7g (%.3g of sum |a b|)", what,
                  (long long)wrong, M * n, at_row, at_col, worst_got, worst_want, worst);
    return wrong;
}

} // namespace

/* Two k atoms side by side (SBO 2048), 8 k16 steps in two commit groups,
 * the first with scale_d = 0 over accumulators that start as NaN; n = 256
 * through moe_wgmma_m64n256k16 and n = 24 through the generic core. */
Test(simt_emu_wgmma, matches_the_exact_product) {
    run_options o;
    run_result r = run(o);
    compare(r, r.a, o.n, o.k_steps, true, "m64n256k16");
    o.n = 24;
    r = run(o, emu_wgmma_bf16<24>);
    compare(r, r.a, o.n, o.k_steps, true, "m64n24k16");
}

/* The swizzle is a function of the shared address, its pattern repeating
 * from 1024-byte boundaries (base offset 0), and dynamic shared memory does
 * not start 1024-aligned: tiles laid out from its first byte, or from a
 * 128-byte boundary that is not a 1024-byte one, read other elements than
 * the layout put there. */
Test(simt_emu_wgmma, swizzle_follows_the_shared_address) {
    uint32_t start = 0;
    emu_launch(
        dim3{1, 1, 1}, 32,
        [&] {
            MOE_DYNAMIC_SHARED(unsigned char, smem);
            if (threadIdx.x == 0) start = moe_shared_address(smem);
        },
        SMEM_BYTES);
    cr_expect(start % 16 == 0 && start % 128 != 0, "dynamic shared memory starts at shared address 0x%x", start);
    run_options o;
    o.align = false;
    o.k_steps = 1; /* past it, k16 slices would cross the 128-byte rows */
    run_result r = run(o);
    int64_t wrong = compare(r, r.a, o.n, o.k_steps, false, "");
    cr_expect(wrong > M * o.n / 2, "tiles at the start of dynamic shared memory: only %lld of %d elements off",
              (long long)wrong, M * o.n);
    o = run_options();
    o.misalign = 384;
    r = run(o);
    wrong = compare(r, r.a, o.n, o.k_steps, false, "");
    cr_expect(wrong > M * o.n / 2, "tiles 384 bytes past a 1024-byte boundary: only %lld of %d elements off",
              (long long)wrong, M * o.n);
}

/* The operands are read when the wait runs the wgmma: A rewritten (by
 * plain stores, which the guards do not track) after the issue and before
 * the wait is what the product sees, as it may be on a device. */
Test(simt_emu_wgmma, operands_are_read_at_the_wait) {
    run_options o;
    o.rewrite_a = rewrite::plain_stores;
    const run_result r = run(o);
    compare(r, r.a2, o.n, o.k_steps, true, "A rewritten before the wait");
}

Test(simt_emu_wgmma, a_wgmma_without_wgmma_fence_aborts, .signal = SIGABRT) {
    run_options o;
    o.wgmma_fence = false;
    run(o);
}

Test(simt_emu_wgmma, a_wgmma_on_cp_async_data_without_fence_proxy_async_aborts, .signal = SIGABRT) {
    run_options o;
    o.proxy_fence = false;
    run(o);
}

Test(simt_emu_wgmma, a_cp_async_into_bytes_an_unfinished_wgmma_reads_aborts, .signal = SIGABRT) {
    run_options o;
    o.rewrite_a = rewrite::cp_async;
    run(o);
}

/* B starts 4096 bytes late, so its last 32 rows lie past the end. */
Test(simt_emu_wgmma, a_descriptor_past_the_dynamic_shared_memory_aborts, .signal = SIGABRT) {
    run_options o;
    o.b_shift = 4096;
    run(o);
}

Test(simt_emu_wgmma, a_descriptor_in_the_64_byte_swizzle_aborts, .signal = SIGABRT) {
    run_options o;
    o.b_swizzle = 2;
    run(o);
}

Test(simt_emu_wgmma, descriptors_that_differ_within_a_warpgroup_abort, .signal = SIGABRT) {
    run_options o;
    o.uneven = true;
    run(o);
}

Test(simt_emu_wgmma, a_wait_group_not_executed_by_the_whole_warpgroup_aborts, .signal = SIGABRT) {
    run_options o;
    o.diverge = true;
    run(o);
}

Test(simt_emu_wgmma, a_wgmma_never_waited_for_aborts, .signal = SIGABRT) {
    run_options o;
    o.wait = false;
    run(o);
}
