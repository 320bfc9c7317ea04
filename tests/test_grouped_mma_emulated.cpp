/* test_grouped_mma_emulated.cpp: our grouped GEMMs on the tensor cores
 * (kernels/cuda/grouped_mma_kernels.cuh: mma.sync and Hopper's wgmma), run
 * on the CPU by tests/simt_emu.h: c = a b_e^T over each expert's rows, fp32
 * and bf16 output, against a double-precision product of the same bf16
 * inputs, with empty experts, ragged row and column tiles, a k that is not a
 * whole number of k-slices or that wraps the stages, and nothing written
 * past the batch's rows. test_cuda_ops checks the same kernels on a device. */
#include <criterion/criterion.h>

#include <cmath>
#include <vector>

#include "simt_emu.h"
#include "test_lcg.h"

extern "C" {
#include "kernels/ops.h"
}

#include "kernels/cuda/grouped_mma_kernels.cuh"

namespace {

float as_float(float v) { return v; }
float as_float(__nv_bfloat16 v) { return emu_from_bf16(v.bits); }

/* rows [E] of the experts, n, k; max_rows > the batch, so the rows past it
 * must come back as they were. */
enum class kernel_kind { mma, wgmma, wgmma_tma };

template <typename OutT>
void check(kernel_kind kind, const std::vector<int64_t> &rows, int64_t n, int64_t k, double tol) {
    const int E = (int)rows.size();
    std::vector<int64_t> offsets(1, 0);
    std::vector<int32_t> tile_offsets(1, 0);
    for (int64_t r : rows) {
        offsets.push_back(offsets.back() + r);
        tile_offsets.push_back(tile_offsets.back() + (int32_t)((r + BM - 1) / BM));
    }
    const int64_t R = offsets.back(), max_rows = R + 5;
    lcg g{(uint64_t)(R * 31 + n * 7 + k)};
    std::vector<__nv_bfloat16> a((size_t)(max_rows * k)), b((size_t)(E * n * k));
    for (auto &x : a) x = __float2bfloat16_rn(g.next());
    for (auto &x : b) x = __float2bfloat16_rn(g.next());
    OutT poison;
    memset(&poison, 0xFF, sizeof poison);
    std::vector<OutT> c((size_t)(max_rows * n), poison);

    const dim3 grid{(unsigned)((max_rows + BM - 1) / BM + E), (unsigned)((n + BN - 1) / BN), 1};
    if (kind == kernel_kind::wgmma_tma) {
        /* As grouped_mma.cu encodes them: a [max_rows, k] in boxes of 128
         * rows, b [E n, k] in boxes of 256, 64 columns each. */
        const CUtensorMap a_map = emu_tensor_map_2d(a.data(), (uint64_t)k, (uint64_t)max_rows, (uint64_t)k * 2,
                                                    WG_BK, BM, true);
        const CUtensorMap b_map = emu_tensor_map_2d(b.data(), (uint64_t)k, (uint64_t)(E * n), (uint64_t)k * 2,
                                                    WG_BK, BN, true);
        /* Persistent: two blocks, so that each takes several tiles in turn. */
        emu_launch(
            dim3{2, 1, 1}, WS_THREADS,
            [&] {
                grouped_wgmma_tma_kernel<OutT>(c.data(), a_map, b_map, offsets.data(), tile_offsets.data(), E, n, k);
            },
            WS_SMEM_BYTES);
    } else if (kind == kernel_kind::wgmma) {
        emu_launch(
            grid, THREADS,
            [&] { grouped_wgmma_kernel<OutT>(c.data(), a.data(), b.data(), offsets.data(), tile_offsets.data(), E, n, k); },
            WG_SMEM_BYTES);
    } else {
        emu_launch(
            grid, THREADS,
            [&] { grouped_mma_kernel<OutT>(c.data(), a.data(), b.data(), offsets.data(), tile_offsets.data(), E, n, k); },
            MMA_SMEM_BYTES);
    }
    const char *kernel = kind == kernel_kind::mma ? "mma" : kind == kernel_kind::wgmma ? "wgmma" : "wgmma-tma";

    double worst = 0.0, scale = 0.0;
    int64_t at = -1, unwritten = 0, touched = 0;
    for (int e = 0; e < E; e++)
        for (int64_t r = offsets[(size_t)e]; r < offsets[(size_t)e + 1]; r++)
            for (int64_t j = 0; j < n; j++) {
                double want = 0.0;
                for (int64_t q = 0; q < k; q++)
                    want += (double)as_float(a[(size_t)(r * k + q)]) * as_float(b[(size_t)((e * n + j) * k + q)]);
                const float got = as_float(c[(size_t)(r * n + j)]);
                unwritten += std::isnan(got);
                scale = std::max(scale, std::fabs(want));
                const double err = std::fabs(got - want);
                if (!(err <= worst)) worst = err, at = r * n + j;
            }
    for (int64_t i = R * n; i < max_rows * n; i++) touched += memcmp(&c[(size_t)i], &poison, sizeof poison) != 0;
    cr_expect(unwritten == 0, "%s E=%d n=%lld k=%lld: %lld outputs never written", kernel, E, (long long)n,
              (long long)k, (long long)unwritten);
    cr_expect(touched == 0, "%s E=%d n=%lld k=%lld: %lld outputs past the batch's rows written", kernel, E,
              (long long)n, (long long)k, (long long)touched);
    cr_expect(worst <= tol * scale, "%s E=%d n=%lld k=%lld (%s output): |error| %.3g at [%lld], past %.0e of %.3g",
              kernel, E, (long long)n, (long long)k, sizeof(OutT) == 4 ? "fp32" : "bf16", worst, (long long)at, tol,
              scale);
}

} // namespace

/* fp32 output: only the order of the fp32 sums differs from the exact
 * product of the bf16 inputs; bf16 output adds its rounding (1e-2 as the
 * device tests). */
Test(grouped_mma_emulated, matches_the_exact_product) {
    check<float>(kernel_kind::mma, {0, 150, 37}, 136, 40, 1e-5);
    check<float>(kernel_kind::mma, {128, 1}, 24, 64, 1e-5);
    check<float>(kernel_kind::mma, {40, 9}, 264, 16, 1e-5); /* two column tiles, the second ragged */
    check<__nv_bfloat16>(kernel_kind::mma, {0, 150, 37}, 136, 40, 1e-2);
    check<__nv_bfloat16>(kernel_kind::mma, {3, 0, 130}, 8, 8, 1e-2);
}

/* As above, and k of 5 and 6 slices through the 4 stages: each stage is
 * refilled while the other warpgroup may still be reading its neighbour;
 * the TMA kernel's blocks take several tiles each, 9 m-tiles wide (past
 * one raster group of 8) in the last case. */
Test(grouped_mma_emulated, wgmma_matches_the_exact_product) {
    for (kernel_kind kind : {kernel_kind::wgmma, kernel_kind::wgmma_tma}) {
        check<float>(kind, {0, 150, 37}, 136, 40, 1e-5);
        check<float>(kind, {40, 9}, 264, 16, 1e-5);
        check<float>(kind, {70, 0, 3}, 40, 328, 1e-5);
        check<__nv_bfloat16>(kind, {3, 0, 130}, 8, 8, 1e-2);
        check<__nv_bfloat16>(kind, {129}, 24, 384, 1e-2);
        check<float>(kind, {600, 0, 500}, 520, 24, 1e-5);
    }
}
