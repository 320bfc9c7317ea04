/* test_gate_emulated.cpp: the CUDA gating pass of
 * kernels/cuda/gate_kernels.cuh, run on the CPU by tests/simt_emu.h,
 * against the CPU backend's gate: forward, the same experts in the same
 * slots, the same weights, probabilities and logsumexps to fp32 rounding,
 * and the chunk statistics the totals are summed from; backward, the
 * logits' gradients. test_cuda_ops checks the same on a device, with the
 * totals. */
#include <criterion/criterion.h>

#include <cmath>
#include <vector>

#include "simt_emu.h"
#include "test_lcg.h"

extern "C" {
#include "kernels/moe_math.h"
#include "kernels/ops.h"
}

#include "kernels/cuda/gate_kernels.cuh"

#define TOL_F32 1e-5

namespace {

struct gate_case {
    int E, k;
    int64_t T;
    moe_gate_kind kind;
    bool renormalize, with_bias;
    enum { PLAIN, TIES, FAR_BEHIND, NANS } logits;
    int n_groups = 0, top_groups = 0; /* group-limited routing when n_groups > 1 */
    float scale = 1.0f;               /* routed_scale */
    int64_t seq_len = 0;              /* backward: an aux gradient row per sequence of this many tokens */
};

const char *kind_name(moe_gate_kind kind) {
    return kind == MOE_GATE_SIGMOID ? "sigmoid" : kind == MOE_GATE_TOPK_SOFTMAX ? "topk_softmax" : "softmax_topk";
}

void expect_close(const gate_case &c, const char *what, const float *got, const float *want, size_t n) {
    double scale = 0.0, worst = 0.0;
    size_t at = 0;
    for (size_t i = 0; i < n; i++)
        if (std::isfinite(want[i])) scale = std::max(scale, std::fabs((double)want[i]));
    for (size_t i = 0; i < n; i++) {
        if (std::isnan(want[i]) && std::isnan(got[i])) continue;
        const double err = std::fabs((double)got[i] - want[i]);
        if (!(err <= worst)) worst = err, at = i;
    }
    cr_expect(worst <= TOL_F32 * scale, "%s E=%d k=%d T=%lld %s: |error| %.3g at [%zu] (got %.9g, want %.9g)",
              kind_name(c.kind), c.E, c.k, (long long)c.T, what, worst, at, (double)got[at], (double)want[at]);
}

void check(const gate_case &c) {
    const int64_t T = c.T, E = c.E, k = c.k;
    const int64_t chunks = (T + MOE_GATE_CHUNK_TOKENS - 1) / MOE_GATE_CHUNK_TOKENS;
    lcg r{(uint64_t)(E * 1000 + k * 10 + T)};
    std::vector<float> logits((size_t)(T * E)), bias((size_t)E);
    for (int64_t t = 0; t < T; t++)
        for (int64_t e = 0; e < E; e++) {
            float x = 3.0f * r.next();
            if (c.logits == gate_case::TIES) x = std::round(4.0f * x) / 4.0f;
            /* All but k - 1 experts far past expf's range below the best. */
            if (c.logits == gate_case::FAR_BEHIND && e >= k - 1 && e != E - 1) x -= 100.0f;
            if (c.logits == gate_case::NANS && (t + e) % 7 == 3) x = NAN;
            logits[(size_t)(t * E + e)] = x;
        }
    for (float &b : bias) b = 0.1f * r.next();
    const float *b = c.with_bias ? bias.data() : nullptr;
    const moe_gate_params p = {E, k, c.kind, c.renormalize, c.n_groups, c.top_groups, c.scale, 0};

    std::vector<int32_t> idx((size_t)(T * k)), e_idx((size_t)(T * k), -1);
    std::vector<float> w((size_t)(T * k)), prob((size_t)(T * E)), lse((size_t)T);
    std::vector<float> e_w((size_t)(T * k), NAN), e_prob((size_t)(T * E), NAN), e_lse((size_t)T, NAN);
    std::vector<int64_t> assigned((size_t)E);
    std::vector<double> prob_sum((size_t)E), z_sum(1);
    std::vector<double> rows((size_t)(chunks * (2 * E + 1))), e_rows((size_t)(chunks * (2 * E + 1)), NAN);
    moe_gate_totals totals = {assigned.data(), prob_sum.data(), z_sum.data(), rows.data()};
    moe_cpu_ops()->gate_forward(idx.data(), w.data(), prob.data(), lse.data(), &totals, logits.data(), b, &p, T);

    auto kernel = [&](auto launch) {
        emu_launch(dim3{(unsigned)chunks, 1, 1}, GATE_THREADS, launch);
    };
#define EMU_GATE(G, NPL)                                                                          \
    kernel([&] {                                                                                   \
        gate_forward_kernel<G, NPL>(e_idx.data(), e_w.data(), e_prob.data(), e_lse.data(), e_rows.data(), \
                                    logits.data(), b, T, (int)E, (int)k, c.kind, c.renormalize,   \
                                    c.n_groups > 1 ? c.n_groups : 1, c.top_groups, c.scale);       \
    })
    /* The dispatch of gate.cu. */
    if (E <= 8) EMU_GATE(8, 1);
    else if (E <= 16) EMU_GATE(8, 2);
    else if (E <= 32) EMU_GATE(8, 4);
    else if (E <= 64) EMU_GATE(8, 8);
    else if (E <= 128) EMU_GATE(8, 16);
    else if (E <= 256) EMU_GATE(8, 32);
    else EMU_GATE(32, 32);
#undef EMU_GATE

    int64_t differ = 0, first = -1;
    for (size_t i = 0; i < idx.size(); i++)
        if (idx[i] != e_idx[i] && differ++ == 0) first = (int64_t)i;
    cr_expect(differ == 0, "%s E=%d k=%d T=%lld: %lld chosen experts differ; first at token %lld slot %lld: %d, cpu %d",
              kind_name(c.kind), c.E, c.k, (long long)T, (long long)differ, (long long)(first / k),
              (long long)(first % k), first >= 0 ? e_idx[(size_t)first] : 0, first >= 0 ? idx[(size_t)first] : 0);
    expect_close(c, "weights", e_w.data(), w.data(), w.size());
    expect_close(c, "probabilities", e_prob.data(), prob.data(), prob.size());
    expect_close(c, "logsumexp", e_lse.data(), lse.data(), lse.size());
    for (int64_t ch = 0; ch < chunks; ch++) {
        const double *want = &rows[(size_t)(ch * (2 * E + 1))], *got = &e_rows[(size_t)(ch * (2 * E + 1))];
        /* A chunk with a NaN logit sums to NaN on both sides. */
        auto off = [](double g, double w) { return std::isnan(w) ? (std::isnan(g) ? 0.0 : INFINITY) : std::fabs(g - w); };
        double worst = 0.0, scale = 0.0;
        for (int64_t e = 0; e < E; e++) {
            if (std::isfinite(want[e])) scale = std::max(scale, std::fabs(want[e]));
            worst = std::max(worst, off(got[e], want[e]));
            cr_expect(got[E + e] == want[E + e], "%s E=%d chunk %lld expert %lld: %g chosen, cpu %g",
                      kind_name(c.kind), c.E, (long long)ch, (long long)e, got[E + e], want[E + e]);
        }
        cr_expect(worst <= TOL_F32 * scale, "%s E=%d chunk %lld: probability sums off by %.3g", kind_name(c.kind),
                  c.E, (long long)ch, worst);
        cr_expect(off(got[2 * E], want[2 * E]) <= TOL_F32 * std::fabs(want[2 * E]) ||
                      (std::isnan(want[2 * E]) && std::isnan(got[2 * E])),
                  "%s E=%d chunk %lld: lse^2 sum %.9g, cpu %.9g", kind_name(c.kind), c.E, (long long)ch,
                  got[2 * E], want[2 * E]);
    }
}

/* The backward of the same case: dlogits against the CPU's, from the
 * CPU forward's choices and weights, random weight gradients, an aux
 * gradient (a row per sequence with seq_len, whose statistics are checked
 * too) and the z term. */
void check_backward(const gate_case &c) {
    const int64_t T = c.T, E = c.E, k = c.k, seqs = c.seq_len ? T / c.seq_len : 1;
    const int64_t chunks = (T + MOE_GATE_CHUNK_TOKENS - 1) / MOE_GATE_CHUNK_TOKENS;
    lcg r{(uint64_t)(E * 977 + k * 13 + T)};
    std::vector<float> logits((size_t)(T * E)), dweights((size_t)(T * k)), aux((size_t)(seqs * E));
    for (float &x : logits) x = 3.0f * r.next();
    for (float &x : dweights) x = r.next();
    for (float &x : aux) x = 0.01f * r.next();
    const moe_gate_params p = {E, k, c.kind, c.renormalize, 0, 0, c.scale, c.seq_len};
    std::vector<int32_t> idx((size_t)(T * k));
    std::vector<float> w((size_t)(T * k)), prob((size_t)(T * E)), lse((size_t)T);
    std::vector<int64_t> assigned((size_t)E);
    std::vector<double> prob_sum((size_t)E), z_sum(1), rows((size_t)(chunks * (2 * E + 1)));
    moe_gate_totals totals = {assigned.data(), prob_sum.data(), z_sum.data(), rows.data()};
    const moe_ops *cpu = moe_cpu_ops();
    cpu->gate_forward(idx.data(), w.data(), prob.data(), lse.data(), &totals, logits.data(), nullptr, &p, T);
    const float z_coef_over_T = 0.001f / (float)T;
    std::vector<float> dl((size_t)(T * E)), e_dl((size_t)(T * E), NAN);
    cpu->gate_backward(dl.data(), dweights.data(), idx.data(), w.data(), prob.data(), lse.data(), logits.data(),
                       aux.data(), z_coef_over_T, &p, T);
    emu_launch(
        dim3{(unsigned)((T + GATE_WARPS - 1) / GATE_WARPS), 1, 1}, GATE_WARPS * 32,
        [&] {
            gate_backward_kernel(e_dl.data(), dweights.data(), idx.data(), w.data(), prob.data(), lse.data(),
                                 logits.data(), aux.data(), z_coef_over_T, T, (int)E, (int)k, c.kind,
                                 c.renormalize, c.scale, c.seq_len);
        },
        (size_t)(GATE_WARPS * 2 * E) * sizeof(float));
    expect_close(c, "dlogits", e_dl.data(), dl.data(), dl.size());
    if (!c.seq_len) return;
    std::vector<float> stats((size_t)(seqs * 2 * E)), e_stats((size_t)(seqs * 2 * E), NAN);
    cpu->gate_seq_stats(stats.data(), idx.data(), prob.data(), &p, T);
    emu_launch(dim3{(unsigned)seqs, 1, 1}, 64, [&] {
        gate_seq_stats_kernel(e_stats.data(), idx.data(), prob.data(), c.seq_len, (int)E, (int)k);
    });
    /* The same sums in the same order: equal, counts and probabilities. */
    int64_t differ = 0;
    for (size_t i = 0; i < stats.size(); i++) differ += !(stats[i] == e_stats[i]);
    cr_expect(differ == 0, "%s E=%d seq_len=%lld: %lld of %zu sequence statistics differ", kind_name(c.kind), c.E,
              (long long)c.seq_len, (long long)differ, stats.size());
    /* And they are what they say: each sequence's pairs add up to k per token. */
    for (int64_t q = 0; q < seqs; q++) {
        double pairs = 0.0;
        for (int64_t e = 0; e < E; e++) pairs += stats[(size_t)(q * 2 * E + e)];
        cr_expect(pairs == (double)(c.seq_len * k), "sequence %lld: %g pairs, not %lld", (long long)q, pairs,
                  (long long)(c.seq_len * k));
    }
}

} // namespace

/* Every kind, with and without renormalisation and bias; ties, experts
 * past expf's range, NaN logits; every register width of the dispatch
 * (E from 1 to 300, the last on a whole warp); T not a multiple of the
 * chunk or of the tokens a pass takes. */
Test(gate_emulated, matches_the_cpu_gate) {
    const gate_case cases[] = {
        {8, 2, 300, MOE_GATE_SOFTMAX_TOPK, true, false, gate_case::PLAIN},
        {8, 2, 300, MOE_GATE_SOFTMAX_TOPK, false, true, gate_case::PLAIN},
        {64, 6, 200, MOE_GATE_SOFTMAX_TOPK, true, true, gate_case::TIES},
        {16, 4, 130, MOE_GATE_TOPK_SOFTMAX, true, true, gate_case::PLAIN},
        {40, 3, 65, MOE_GATE_SIGMOID, true, true, gate_case::PLAIN},
        {32, 4, 80, MOE_GATE_TOPK_SOFTMAX, true, true, gate_case::PLAIN},
        {17, 3, 50, MOE_GATE_SOFTMAX_TOPK, false, true, gate_case::TIES},
        {24, 2, 70, MOE_GATE_SIGMOID, true, false, gate_case::NANS},
        {5, 5, 33, MOE_GATE_SIGMOID, false, false, gate_case::TIES},
        {64, 8, 100, MOE_GATE_TOPK_SOFTMAX, true, false, gate_case::FAR_BEHIND},
        {64, 8, 64, MOE_GATE_SOFTMAX_TOPK, true, true, gate_case::NANS},
        {100, 7, 70, MOE_GATE_TOPK_SOFTMAX, true, true, gate_case::PLAIN},
        {256, 8, 40, MOE_GATE_SIGMOID, true, true, gate_case::PLAIN},
        {300, 8, 70, MOE_GATE_SOFTMAX_TOPK, true, true, gate_case::PLAIN},
        {1, 1, 3, MOE_GATE_SOFTMAX_TOPK, true, false, gate_case::PLAIN},
        /* Group-limited routing: DeepSeek-V3's shape scaled down (8 groups
         * keeping 4), ties, groups of one, NaNs, a whole warp a token. */
        {64, 8, 100, MOE_GATE_SIGMOID, true, true, gate_case::PLAIN, 8, 4},
        {64, 6, 80, MOE_GATE_SIGMOID, true, false, gate_case::TIES, 8, 3},
        {16, 4, 70, MOE_GATE_SOFTMAX_TOPK, true, true, gate_case::PLAIN, 16, 4},
        {24, 4, 50, MOE_GATE_TOPK_SOFTMAX, true, true, gate_case::NANS, 6, 2},
        {300, 8, 40, MOE_GATE_SOFTMAX_TOPK, false, true, gate_case::TIES, 60, 5},
        /* DeepSeek-V3's routed weights, scaled by 2.5; unnormalised ones too. */
        {64, 8, 100, MOE_GATE_SIGMOID, true, true, gate_case::PLAIN, 8, 4, 2.5f},
        {8, 2, 50, MOE_GATE_SOFTMAX_TOPK, false, false, gate_case::PLAIN, 0, 0, 2.5f},
    };
    for (const gate_case &c : cases) check(c);
}

/* Every kind, renormalised or not, a warp per token: E up to 300 (several
 * experts a lane), k up to 8, T not a multiple of the warps a block has. */
Test(gate_emulated, backward_matches_the_cpu_gate) {
    const gate_case cases[] = {
        {8, 2, 37, MOE_GATE_SOFTMAX_TOPK, true, false, gate_case::PLAIN},
        {8, 2, 37, MOE_GATE_SOFTMAX_TOPK, false, false, gate_case::PLAIN},
        {64, 6, 21, MOE_GATE_TOPK_SOFTMAX, true, false, gate_case::PLAIN},
        {40, 3, 19, MOE_GATE_SIGMOID, true, false, gate_case::PLAIN},
        {300, 8, 9, MOE_GATE_SOFTMAX_TOPK, true, false, gate_case::PLAIN},
        {40, 3, 19, MOE_GATE_SIGMOID, true, false, gate_case::PLAIN, 0, 0, 2.5f},
        {8, 2, 37, MOE_GATE_SOFTMAX_TOPK, false, false, gate_case::PLAIN, 0, 0, 2.5f},
        /* The sequence-wise balancing loss: a gradient row per sequence;
         * more experts than the statistics kernel's 64 threads. */
        {16, 4, 36, MOE_GATE_SOFTMAX_TOPK, true, false, gate_case::PLAIN, 0, 0, 1.0f, 12},
        {96, 6, 40, MOE_GATE_SIGMOID, true, false, gate_case::PLAIN, 0, 0, 2.5f, 8},
        {8, 2, 37, MOE_GATE_TOPK_SOFTMAX, true, false, gate_case::PLAIN, 0, 0, 1.0f, 1},
    };
    for (const gate_case &c : cases) check_backward(c);
}
