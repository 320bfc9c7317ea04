/* experts.c: the grouped SwiGLU experts.
 *
 * The work is cut into tasks that the cores take one at a time: blocks of
 * rows for everything row-independent (the forward, dg, dx), and blocks of
 * weight rows for the weight gradients, which sum over all of an expert's
 * rows. Each task is a few single-threaded OpenBLAS calls (inside an OpenMP
 * region the OpenMP build of OpenBLAS runs on the calling thread), so small
 * experts cost no fork-join per GEMM, skewed routing spreads evenly, and each
 * block's h stays in cache between its GEMMs and the SwiGLU pass. Every
 * output element is written by exactly one task with a fixed summation order:
 * the results do not depend on the number of threads.
 *
 * w1 and w3 are adjacent in memory, so h = x [w1; w3]^T is a single GEMM. */
#include "kernels/cpu/cpu_ops.h"
#include "kernels/moe_math.h"

/* Rows per task: large enough for OpenBLAS to reach its speed on one core,
 * small enough for a few tasks per core on a 4096-token batch. */
#define MOE_EXPERT_ROW_BLOCK 256
/* Weight rows per weight-gradient task. */
#define MOE_EXPERT_WEIGHT_BLOCK 128

static int64_t blocks(int64_t n, int64_t block) { return (n + block - 1) / block; }

/* first[g] is the first task of group g; first[n_groups] the task count. */
static void task_offsets(int64_t *first, const moe_expert_group *groups, int64_t n_groups,
                         int64_t (*tasks_of)(const moe_expert_group *, int64_t), int64_t d) {
    first[0] = 0;
    for (int64_t g = 0; g < n_groups; g++) first[g + 1] = first[g] + tasks_of(&groups[g], d);
}

static int64_t group_of(const int64_t *first, int64_t n_groups, int64_t task) {
    int64_t lo = 0, hi = n_groups - 1; /* the last g with first[g] <= task */
    while (lo < hi) {
        int64_t mid = (lo + hi + 1) / 2;
        if (first[mid] <= task) lo = mid; else hi = mid - 1;
    }
    return lo;
}

static int64_t row_tasks(const moe_expert_group *g, int64_t d) {
    (void)d;
    return blocks(g->rows, MOE_EXPERT_ROW_BLOCK);
}

static int64_t weight_tasks(const moe_expert_group *g, int64_t d) {
    return g->rows ? blocks(2 * g->d_ff, MOE_EXPERT_WEIGHT_BLOCK) + blocks(d, MOE_EXPERT_WEIGHT_BLOCK) : 0;
}

static void forward_block(const moe_expert_group *g, int64_t r0, int64_t d) {
    const int64_t f = g->d_ff, n = g->rows - r0 < MOE_EXPERT_ROW_BLOCK ? g->rows - r0 : MOE_EXPERT_ROW_BLOCK;
    float *h = g->h + r0 * 2 * f, *act = g->g + r0 * f; /* [n, 2f], [n, f] */
    moe_cpu_gemm(h, g->x + r0 * d, g->w13, n, 2 * f, d, d, d, 2 * f, false, true, 1.0f, 0.0f);
    for (int64_t r = 0; r < n; r++)
        for (int64_t i = 0; i < f; i++) act[r * f + i] = moe_swiglu(h[r * 2 * f + i], h[r * 2 * f + f + i]);
    moe_cpu_gemm(g->y + r0 * d, act, g->w2, n, d, f, f, f, d, false, true, 1.0f, 0.0f);
}

/* dg = dy w2 lands in the first half of each dh row, the SwiGLU backward
 * turns [dg | .] into [da | db] in place, and dx = dh [w1; w3]. */
static void backward_block(const moe_expert_group *g, int64_t r0, int64_t d) {
    const int64_t f = g->d_ff, n = g->rows - r0 < MOE_EXPERT_ROW_BLOCK ? g->rows - r0 : MOE_EXPERT_ROW_BLOCK;
    const float *h = g->h + r0 * 2 * f;
    float *dh = g->dh + r0 * 2 * f; /* [n, 2f] */
    moe_cpu_gemm(dh, g->dy + r0 * d, g->w2, n, f, d, d, f, 2 * f, false, false, 1.0f, 0.0f);
    for (int64_t r = 0; r < n; r++)
        for (int64_t i = 0; i < f; i++) {
            float *row = dh + r * 2 * f;
            moe_swiglu_backward(&row[i], &row[f + i], row[i], h[r * 2 * f + i], h[r * 2 * f + f + i]);
        }
    moe_cpu_gemm(g->dx + r0 * d, dh, g->w13, n, d, 2 * f, 2 * f, d, d, false, false, 1.0f, 0.0f);
}

/* Block b of the weight rows: first those of dw13 [2f, d] += dh^T x, then
 * those of dw2 [d, f] += dy^T g, each over all of the group's rows. */
static void weight_block(const moe_expert_group *g, int64_t b, int64_t d) {
    const int64_t f = g->d_ff, n = g->rows, b13 = blocks(2 * f, MOE_EXPERT_WEIGHT_BLOCK);
    if (b < b13) {
        int64_t a = b * MOE_EXPERT_WEIGHT_BLOCK, m = 2 * f - a < MOE_EXPERT_WEIGHT_BLOCK ? 2 * f - a : MOE_EXPERT_WEIGHT_BLOCK;
        moe_cpu_gemm(g->dw13 + a * d, g->dh + a, g->x, m, d, n, 2 * f, d, d, true, false, 1.0f, 1.0f);
    } else {
        int64_t a = (b - b13) * MOE_EXPERT_WEIGHT_BLOCK, m = d - a < MOE_EXPERT_WEIGHT_BLOCK ? d - a : MOE_EXPERT_WEIGHT_BLOCK;
        moe_cpu_gemm(g->dw2 + a * f, g->dy + a, g->g, m, f, n, d, f, f, true, false, 1.0f, 1.0f);
    }
}

void moe_cpu_experts_forward(moe_expert_group *groups, int64_t n_groups, int64_t d) {
    int64_t first[MOE_EXPERTS_MAX + 2];
    task_offsets(first, groups, n_groups, row_tasks, d);
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t t = 0; t < first[n_groups]; t++) {
        int64_t g = group_of(first, n_groups, t);
        forward_block(&groups[g], (t - first[g]) * MOE_EXPERT_ROW_BLOCK, d);
    }
}

void moe_cpu_experts_backward(moe_expert_group *groups, int64_t n_groups, int64_t d) {
    int64_t first[MOE_EXPERTS_MAX + 2];
    task_offsets(first, groups, n_groups, row_tasks, d);
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t t = 0; t < first[n_groups]; t++) {
        int64_t g = group_of(first, n_groups, t);
        backward_block(&groups[g], (t - first[g]) * MOE_EXPERT_ROW_BLOCK, d);
    }
    task_offsets(first, groups, n_groups, weight_tasks, d);
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t t = 0; t < first[n_groups]; t++) {
        int64_t g = group_of(first, n_groups, t);
        weight_block(&groups[g], t - first[g], d);
    }
}
