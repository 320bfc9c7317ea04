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

/* Tasks are cut so that a batch makes about MOE_EXPERT_TASKS of each kind:
 * enough for the cores to balance skewed experts, while each task is large
 * enough that OpenBLAS's packing of the weights (redone per call) stays a
 * small share. Block sizes depend on the row counts only, never on the
 * thread count, so results are the same for any number of threads. */
#define MOE_EXPERT_TASKS 16
#define MOE_EXPERT_BLOCK_MIN 128
#define MOE_EXPERT_BLOCK_MAX 2048

typedef struct task_sizes {
    int64_t rows;    /* rows per row task */
    int64_t weights; /* weight rows per weight-gradient task */
} task_sizes;

static int64_t clamp_block(int64_t want) {
    want = (want + 63) / 64 * 64;
    return want < MOE_EXPERT_BLOCK_MIN ? MOE_EXPERT_BLOCK_MIN : want > MOE_EXPERT_BLOCK_MAX ? MOE_EXPERT_BLOCK_MAX : want;
}

static task_sizes plan_tasks(const moe_expert_group *groups, int64_t n_groups, int64_t d) {
    int64_t rows = 0, weight_rows = 0;
    for (int64_t g = 0; g < n_groups; g++) {
        rows += groups[g].rows;
        if (groups[g].rows) weight_rows += 2 * groups[g].d_ff + d;
    }
    return (task_sizes){clamp_block(rows / MOE_EXPERT_TASKS), clamp_block(weight_rows / MOE_EXPERT_TASKS)};
}

static int64_t blocks(int64_t n, int64_t block) { return (n + block - 1) / block; }
static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* Tasks of group g: row blocks, or (weights) blocks of dw13's 2f rows then
 * of dw2's d rows. */
static int64_t tasks_of(const moe_expert_group *g, int64_t d, int64_t block, bool weights) {
    if (!weights) return blocks(g->rows, block);
    return g->rows ? blocks(2 * g->d_ff, block) + blocks(d, block) : 0;
}

/* first[g] is the first task of group g; first[n_groups] the task count. */
static void task_offsets(int64_t *first, const moe_expert_group *groups, int64_t n_groups, int64_t d,
                         int64_t block, bool weights) {
    first[0] = 0;
    for (int64_t g = 0; g < n_groups; g++) first[g + 1] = first[g] + tasks_of(&groups[g], d, block, weights);
}

/* The last g with first[g] <= task: groups without tasks are skipped. */
static int64_t group_of(const int64_t *first, int64_t n_groups, int64_t task) {
    int64_t lo = 0, hi = n_groups - 1;
    while (lo < hi) {
        int64_t mid = (lo + hi + 1) / 2;
        if (first[mid] <= task) lo = mid; else hi = mid - 1;
    }
    return lo;
}

/* Each task runs one of these on block b of group g. */
typedef void (*block_fn)(const moe_expert_group *g, int64_t b, int64_t block, int64_t d);

static void forward_block(const moe_expert_group *g, int64_t b, int64_t block, int64_t d) {
    const int64_t f = g->d_ff, r0 = b * block, n = min64(block, g->rows - r0);
    float *h = g->h + r0 * 2 * f, *act = g->g + r0 * f; /* [n, 2f], [n, f] */
    moe_cpu_gemm(h, g->x + r0 * d, g->w13, n, 2 * f, d, d, d, 2 * f, false, true, 1.0f, 0.0f);
    for (int64_t r = 0; r < n; r++)
        for (int64_t i = 0; i < f; i++) act[r * f + i] = moe_swiglu(h[r * 2 * f + i], h[r * 2 * f + f + i]);
    moe_cpu_gemm(g->y + r0 * d, act, g->w2, n, d, f, f, f, d, false, true, 1.0f, 0.0f);
}

/* dg = dy w2 lands in the first half of each dh row, the SwiGLU backward
 * turns [dg | .] into [da | db] in place, and dx = dh [w1; w3]. */
static void backward_block(const moe_expert_group *g, int64_t b, int64_t block, int64_t d) {
    const int64_t f = g->d_ff, r0 = b * block, n = min64(block, g->rows - r0);
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
 * those of dw2 [d, f] += dy^T g, each summed over all of the group's rows. */
static void weight_block(const moe_expert_group *g, int64_t b, int64_t block, int64_t d) {
    const int64_t f = g->d_ff, n = g->rows, b13 = blocks(2 * f, block);
    if (b < b13) {
        int64_t a = b * block;
        moe_cpu_gemm(g->dw13 + a * d, g->dh + a, g->x, min64(block, 2 * f - a), d, n, 2 * f, d, d, true, false,
                     1.0f, 1.0f);
    } else {
        int64_t a = (b - b13) * block;
        moe_cpu_gemm(g->dw2 + a * f, g->dy + a, g->g, min64(block, d - a), f, n, d, f, f, true, false, 1.0f, 1.0f);
    }
}

/* Runs fn over every block of every group, the cores taking tasks in turn. */
static void run_tasks(const moe_expert_group *groups, int64_t n_groups, int64_t d, int64_t block, bool weights,
                      block_fn fn) {
    int64_t first[MOE_EXPERTS_MAX + 2];
    task_offsets(first, groups, n_groups, d, block, weights);
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t t = 0; t < first[n_groups]; t++) {
        const int64_t g = group_of(first, n_groups, t);
        fn(&groups[g], t - first[g], block, d);
    }
}

void moe_cpu_experts_forward(moe_expert_group *groups, int64_t n_groups, int64_t d) {
    const task_sizes size = plan_tasks(groups, n_groups, d);
    run_tasks(groups, n_groups, d, size.rows, false, forward_block);
}

/* The weight gradients need every row's dh, so they wait for all row tasks. */
void moe_cpu_experts_backward(moe_expert_group *groups, int64_t n_groups, int64_t d) {
    const task_sizes size = plan_tasks(groups, n_groups, d);
    run_tasks(groups, n_groups, d, size.rows, false, backward_block);
    run_tasks(groups, n_groups, d, size.weights, true, weight_block);
}
