/* test_flash_emulated.cpp: the fused attention kernels of
 * kernels/cuda/flash_attention_kernels.cuh, run on the CPU by
 * tests/simt_emu.h, against the CPU backend's attention, forward and
 * backward: so the kernels' tiling, masking, online softmax and fragment
 * bookkeeping are checked in every build, GPU or not. test_cuda_ops checks
 * the same on a device.
 *
 * The kernels multiply bf16 operands (fp32 sums), so the tolerance is
 * bf16's 1e-2 of each array's largest value, as for the device's bf16
 * paths. */
#include <criterion/criterion.h>

#include <cmath>
#include <cstdio>
#include <vector>

#include "simt_emu.h"
#include "test_lcg.h"

#include "kernels/cuda/flash_attention_kernels.cuh"

extern "C" {
#include "kernels/ops.h"
}

#define TOL_BF16 1e-2

namespace {

struct shape {
    int64_t B, T, Hq, Hkv, hd, window;
};

/* Small uniform values from a fixed linear congruential stream. */
std::vector<float> random_vec(size_t n, lcg *r) {
    std::vector<float> v(n);
    for (float &x : v) x = r->next();
    return v;
}

/* got - base against want - base, within tol of the largest |want - base|. */
void expect_close(const char *what, const shape &s, const std::vector<float> &got,
                  const std::vector<float> &want, const std::vector<float> &base) {
    double scale = 0.0, worst = 0.0;
    size_t at = 0;
    for (size_t i = 0; i < want.size(); i++) scale = std::max(scale, std::fabs((double)want[i] - base[i]));
    for (size_t i = 0; i < want.size(); i++) {
        const double err = std::fabs(((double)got[i] - base[i]) - ((double)want[i] - base[i]));
        if (!(err <= worst)) worst = err, at = i;
    }
    cr_expect(worst <= TOL_BF16 * scale,
              "B=%lld T=%lld Hq=%lld Hkv=%lld hd=%lld window=%lld %s: |error| %.3g at [%zu] (got %.6g, "
              "want %.6g) past %.0e of the largest %.3g",
              (long long)s.B, (long long)s.T, (long long)s.Hq, (long long)s.Hkv, (long long)s.hd,
              (long long)s.window, what,
              worst, at, (double)got[at], (double)want[at], TOL_BF16, scale);
}

template <int HD> void check(const shape &s) {
    const int64_t B = s.B, T = s.T, Hq = s.Hq, Hkv = s.Hkv, W = s.window;
    const size_t nq = (size_t)(B * T * Hq * HD), nk = (size_t)(B * T * Hkv * HD);
    const size_t na = (size_t)(B * Hq * T * T);
    lcg r{(uint64_t)(T * 131 + HD)};
    const std::vector<float> q = random_vec(nq, &r), k = random_vec(nk, &r), v = random_vec(nk, &r);
    const std::vector<float> dout = random_vec(nq, &r);
    /* Gradients start from values of their own: the kernels add to them. */
    const std::vector<float> dq0 = random_vec(nq, &r), dk0 = random_vec(nk, &r), dv0 = random_vec(nk, &r);
    const moe_ops *cpu = moe_cpu_ops();
    std::vector<float> out(nq), att(na), datt(na), dq = dq0, dk = dk0, dv = dv0;
    cpu->attention_forward(out.data(), att.data(), q.data(), k.data(), v.data(), B, T, Hq, Hkv, HD, W);
    cpu->attention_backward(dq.data(), dk.data(), dv.data(), datt.data(), dout.data(), q.data(), k.data(),
                            v.data(), att.data(), B, T, Hq, Hkv, HD, W);

    /* What the device path allocates: att holds the row log-sum-exps, then
     * a copy of out (flash_attention.cuh); datt's head holds D. */
    std::vector<float> e_out(nq, NAN), e_att(na, NAN), e_datt(na, NAN);
    std::vector<float> e_dq = dq0, e_dk = dk0, e_dv = dv0;
    float *lse = e_att.data(), *out_copy = e_att.data() + B * Hq * T, *D = e_datt.data();
    const float scale = 1.0f / std::sqrt((float)HD);
    const unsigned blocks = (unsigned)((T + FA_ROWS - 1) / FA_ROWS);
    const int threads = FA_WARPS * 32;
    emu_launch(dim3{blocks, (unsigned)Hq, (unsigned)B}, threads, [&] {
        flash_forward_kernel<HD>(e_out.data(), lse, out_copy, q.data(), k.data(), v.data(), T, Hq, Hkv,
                                 W, scale);
    });
    emu_launch(dim3{2, 1, 1}, 128, [&] { rowdot_kernel(D, dout.data(), out_copy, B * T * Hq, T, Hq, HD); });
    emu_launch(dim3{blocks, (unsigned)Hkv, (unsigned)B}, threads, [&] {
        flash_dkdv_kernel<HD>(e_dk.data(), e_dv.data(), q.data(), k.data(), v.data(), dout.data(), lse, D,
                              T, Hq, Hkv, W, scale);
    });
    emu_launch(dim3{blocks, (unsigned)Hq, (unsigned)B}, threads, [&] {
        flash_dq_kernel<HD>(e_dq.data(), q.data(), k.data(), v.data(), dout.data(), lse, D, T, Hq, Hkv,
                            W, scale);
    });
    const std::vector<float> zeros_q(nq, 0.0f);
    expect_close("out", s, e_out, out, zeros_q);
    expect_close("out saved in att", s, std::vector<float>(out_copy, out_copy + nq), out, zeros_q);
    expect_close("dq", s, e_dq, dq, dq0);
    expect_close("dk", s, e_dk, dk, dk0);
    expect_close("dv", s, e_dv, dv, dv0);
}

} // namespace

/* One query tile, T just past hd; several tiles with a ragged last one;
 * grouped kv heads (2 and 4 query heads a kv head) and a batch; every head
 * size the kernels take. */
Test(flash_emulated, matches_the_cpu_attention) {
    check<16>({1, 17, 1, 1, 16, 0});
    check<16>({1, 40, 2, 1, 16, 0});
    check<32>({2, 70, 2, 2, 32, 0});
    check<64>({1, 130, 4, 2, 64, 0});
    check<128>({1, 150, 2, 1, 128, 0}); /* tiles of 32 keys or queries */
}

/* Sliding windows: of two keys (the smallest with a gradient through the
 * softmax); shorter than a block, so that a block's first key tile lies
 * wholly before the windows of its later rows (whose running maximum must
 * stay clear of NaN); across tile edges; at tiles of 32; and wider than
 * the sequence (the same as none). */
Test(flash_emulated, sliding_window) {
    check<16>({1, 40, 2, 1, 16, 2});
    check<16>({1, 150, 2, 1, 16, 7});
    check<32>({2, 140, 2, 2, 32, 70});
    check<128>({1, 150, 2, 1, 128, 33});
    check<64>({1, 130, 4, 2, 64, 500});
}
