/* test_dense_emulated.cpp: the CUDA kernels of
 * kernels/cuda/dense_kernels.cuh (RMSNorm, RoPE, cross-entropy, the shared
 * expert's sigmoid gate), run on the CPU by tests/simt_emu.h, against the
 * CPU backend's ops on fresh random inputs: fp32 results within 1e-5 of
 * the largest, every written output poisoned first so that an element no
 * thread writes shows. Grids smaller than the rows, as a large input gets
 * on a device, make every kernel stride. test_cuda_ops checks the same ops
 * on a device. */
#include <criterion/criterion.h>

#include <cmath>
#include <vector>

#include "simt_emu.h"
#include "test_lcg.h"

extern "C" {
#include "kernels/moe_math.h"
#include "kernels/ops.h"
}

#include "kernels/cuda/dense_kernels.cuh"

#define TOL_F32 1e-5

namespace {

/* dense.cu's block size (MOE_CUDA_THREADS). */
const int THREADS = 256;

template <typename T> void expect_close(const char *what, const std::vector<T> &got, const std::vector<T> &want) {
    cr_assert_eq(got.size(), want.size());
    double scale = 0.0, worst = 0.0;
    size_t at = 0;
    for (const T &w : want) scale = std::max(scale, std::fabs((double)w));
    for (size_t i = 0; i < want.size(); i++) {
        double err = std::fabs((double)got[i] - (double)want[i]);
        if (std::isnan(err)) err = INFINITY; /* an unwritten element */
        if (err > worst) worst = err, at = i;
    }
    cr_expect(worst <= TOL_F32 * scale, "%s: |error| %.3g at [%zu] (got %.9g, want %.9g; largest %.3g)", what, worst,
              at, (double)got[at], (double)want[at], scale);
}

template <typename T> std::vector<T> poisoned(size_t n) { return std::vector<T>(n, (T)NAN); }

} // namespace

/* Rows wider than a block, a grid of 5 blocks over 37 rows; every fifth
 * row so small that eps weighs. */
Test(dense_emulated, rmsnorm_forward) {
    const int64_t N = 37, C = 300;
    lcg r{1};
    std::vector<float> x = r.fill((size_t)(N * C), 2.0f);
    const std::vector<float> w = r.fill((size_t)C, 1.0f);
    for (int64_t n = 0; n < N; n += 5)
        for (int64_t c = 0; c < C; c++) x[(size_t)(n * C + c)] *= 1e-3f;
    std::vector<float> out((size_t)(N * C)), rstd((size_t)N);
    std::vector<float> e_out = poisoned<float>(out.size()), e_rstd = poisoned<float>(rstd.size());
    moe_cpu_ops()->rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), 1e-5f, N, C);
    emu_launch(dim3{5, 1, 1}, THREADS,
               [&] { rmsnorm_forward_kernel(e_out.data(), e_rstd.data(), x.data(), w.data(), 1e-5f, N, C); });
    expect_close("rmsnorm out", e_out, out);
    expect_close("rmsnorm rstd", e_rstd, rstd);
}

/* Four parts of RMS_ROWS_PER_PART rows for the weight's gradient, the
 * last short, over a grid of 2 in y (a norm over each head of q has more
 * parts than a grid's y holds) and of 1 in x over rows wider than a block;
 * both gradients accumulate into what they held. */
Test(dense_emulated, rmsnorm_backward) {
    const int64_t N = 3 * RMS_ROWS_PER_PART + 5, C = 300;
    const int64_t parts = (N + RMS_ROWS_PER_PART - 1) / RMS_ROWS_PER_PART;
    lcg r{2};
    const std::vector<float> x = r.fill((size_t)(N * C), 2.0f), w = r.fill((size_t)C, 1.0f);
    const std::vector<float> dout = r.fill((size_t)(N * C), 1.0f);
    std::vector<float> y((size_t)(N * C)), rstd((size_t)N);
    const moe_ops *cpu = moe_cpu_ops();
    cpu->rmsnorm_forward(y.data(), rstd.data(), x.data(), w.data(), 1e-5f, N, C);
    std::vector<float> dinp = r.fill((size_t)(N * C), 0.5f), dw = r.fill((size_t)C, 0.5f);
    std::vector<float> e_dinp = dinp, e_dw = dw;
    std::vector<unsigned char> scratch(cpu->rmsnorm_scratch_bytes(N, C));
    cpu->rmsnorm_backward(dinp.data(), dw.data(), dout.data(), x.data(), w.data(), rstd.data(), scratch.data(), N, C);
    std::vector<double> e_parts = poisoned<double>((size_t)(parts * C));
    emu_launch(dim3{7, 1, 1}, THREADS, [&] {
        rmsnorm_dx_kernel(e_dinp.data(), dout.data(), x.data(), w.data(), rstd.data(), N, C);
    });
    emu_launch(dim3{1, 2, 1}, THREADS,
               [&] { rmsnorm_dw_parts_kernel(e_parts.data(), dout.data(), x.data(), rstd.data(), N, C); });
    emu_launch(dim3{1, 1, 1}, THREADS, [&] { rmsnorm_dw_sum_kernel(e_dw.data(), e_parts.data(), parts, C); });
    expect_close("rmsnorm dinp", e_dinp, dinp);
    expect_close("rmsnorm dweight", e_dw, dw);
}

/* One block of 64 threads over 120 pairs; the backward rotates back. */
Test(dense_emulated, rope_forward_and_backward) {
    const int64_t B = 2, T = 5, H = 3, hd = 8;
    lcg r{3};
    const std::vector<float> x = r.fill((size_t)(B * T * H * hd), 1.0f);
    const std::vector<float> cos_t = r.fill((size_t)(T * hd / 2), 1.0f), sin_t = r.fill((size_t)(T * hd / 2), 1.0f);
    for (float sign : {1.0f, -1.0f}) {
        std::vector<float> want = x, got = x;
        if (sign > 0)
            moe_cpu_ops()->rope_forward(want.data(), cos_t.data(), sin_t.data(), B, T, H, hd);
        else
            moe_cpu_ops()->rope_backward(want.data(), cos_t.data(), sin_t.data(), B, T, H, hd);
        emu_launch(dim3{1, 1, 1}, 64,
                   [&] { rope_rotate_kernel(got.data(), cos_t.data(), sin_t.data(), B, T, H, hd, sign); });
        expect_close(sign > 0 ? "rope forward" : "rope backward", got, want);
    }
}

/* Rows wider than a block, an ignored target, a row of logits near 100
 * (whose exponentials overflow but for the row's maximum), a grid of 4 over
 * 9 rows; the backward with the z-loss term, and in place over the logits. */
Test(dense_emulated, crossentropy) {
    const int64_t N = 9, V = 300;
    lcg r{4};
    std::vector<float> logits = r.fill((size_t)(N * V), 4.0f);
    const std::vector<float> dloss = r.fill((size_t)N, 1.0f);
    for (int64_t j = 0; j < V; j++) logits[(size_t)(5 * V + j)] += 100.0f;
    std::vector<int32_t> targets((size_t)N);
    for (int64_t n = 0; n < N; n++) targets[(size_t)n] = n == 3 ? -1 : (int32_t)((n * 37) % V);
    std::vector<float> losses((size_t)N);
    std::vector<double> lse((size_t)N);
    std::vector<float> e_losses = poisoned<float>(losses.size());
    std::vector<double> e_lse = poisoned<double>(lse.size());
    const moe_ops *cpu = moe_cpu_ops();
    cpu->crossentropy_forward(losses.data(), lse.data(), logits.data(), targets.data(), N, V);
    emu_launch(dim3{4, 1, 1}, THREADS, [&] {
        crossentropy_forward_kernel(e_losses.data(), e_lse.data(), logits.data(), targets.data(), N, V);
    });
    expect_close("cross-entropy losses", e_losses, losses);
    expect_close("cross-entropy lse", e_lse, lse);
    cr_expect_eq(e_losses[3], 0.0f, "an ignored target's loss is 0");
    std::vector<float> dl((size_t)(N * V));
    std::vector<float> e_dl = poisoned<float>(dl.size());
    cpu->crossentropy_backward(dl.data(), logits.data(), lse.data(), targets.data(), dloss.data(), 1e-3f, N, V);
    emu_launch(dim3{4, 1, 1}, THREADS, [&] {
        crossentropy_backward_kernel(e_dl.data(), logits.data(), lse.data(), targets.data(), dloss.data(), 1e-3f, N,
                                     V);
    });
    expect_close("cross-entropy dlogits", e_dl, dl);
    std::vector<float> in_place = logits;
    emu_launch(dim3{4, 1, 1}, THREADS, [&] {
        crossentropy_backward_kernel(in_place.data(), in_place.data(), lse.data(), targets.data(), dloss.data(),
                                     1e-3f, N, V);
    });
    expect_close("cross-entropy dlogits in place", in_place, dl);
}

/* Qwen2-MoE's shared-expert gate: tokens wider than a block, a grid of 4
 * over 11 tokens; out over in and din over dout as the model runs them. */
Test(dense_emulated, sigmoid_gate) {
    const int64_t T = 11, d = 300;
    lcg r{5};
    const std::vector<float> in = r.fill((size_t)(T * d), 2.0f), logits = r.fill((size_t)T, 6.0f);
    const std::vector<float> dout = r.fill((size_t)(T * d), 1.0f);
    std::vector<float> out((size_t)(T * d)), gate((size_t)T);
    const moe_ops *cpu = moe_cpu_ops();
    cpu->sigmoid_gate_forward(out.data(), gate.data(), in.data(), logits.data(), T, d);
    std::vector<float> e_out = poisoned<float>(out.size()), e_gate = poisoned<float>(gate.size());
    emu_launch(dim3{4, 1, 1}, THREADS,
               [&] { sigmoid_gate_forward_kernel(e_out.data(), e_gate.data(), in.data(), logits.data(), T, d); });
    expect_close("gate out", e_out, out);
    expect_close("gate", e_gate, gate);
    std::vector<float> over = in;
    emu_launch(dim3{4, 1, 1}, THREADS,
               [&] { sigmoid_gate_forward_kernel(over.data(), e_gate.data(), over.data(), logits.data(), T, d); });
    expect_close("gate out over in", over, out);

    std::vector<float> din((size_t)(T * d)), dlogits((size_t)T);
    cpu->sigmoid_gate_backward(din.data(), dlogits.data(), dout.data(), out.data(), gate.data(), T, d);
    std::vector<float> e_din = poisoned<float>(din.size()), e_dlogits = poisoned<float>(dlogits.size());
    emu_launch(dim3{4, 1, 1}, THREADS, [&] {
        sigmoid_gate_backward_kernel(e_din.data(), e_dlogits.data(), dout.data(), out.data(), gate.data(), T, d);
    });
    expect_close("gate din", e_din, din);
    expect_close("gate dlogits", e_dlogits, dlogits);
    std::vector<float> din_over = dout;
    emu_launch(dim3{4, 1, 1}, THREADS, [&] {
        sigmoid_gate_backward_kernel(din_over.data(), e_dlogits.data(), din_over.data(), out.data(), gate.data(), T,
                                     d);
    });
    expect_close("gate din over dout", din_over, din);
    expect_close("gate dlogits, din over dout", e_dlogits, dlogits);
}
