/* test_train_dp.c: training on several ranks (run under mpirun -np 2 and
 * -np 4) gives the loss curve of one rank reading the same global batches.
 * Every rank also trains the one-rank model itself on the whole global batch,
 * so the reference never crosses the network. Grids: data parallel only
 * (EP = 1), EP over all ranks, and with 4 ranks EP = 2 with 2 replicas of
 * each expert; each with capacity dropping and without; and EP over all
 * ranks with group-limited routing, a group per rank, each token's experts
 * on half of them.
 * Tolerance: 1e-5 relative per step, as float summation order allows; the
 * dropped share of the pairs within 10% of the one rank's. A
 * plain program (Criterion forks, which MPI does not survive); ends with
 * "N passed, M failed". */
#include <time.h>

#include "mpi_check.h"

#define STEPS 20
#define B 2 /* rows per rank */
#define T 8
#define VOCAB 32

static void tiny_config(moe_model_config *c, double capacity, int groups, bool tied) {
    mpi_tiny_config(c, VOCAB, 16, 16, 2, 4);
    c->tie_word_embeddings = tied;
    c->moe_z_loss_coef = 0.001;
    c->moe_capacity_factor = capacity;
    c->moe_n_group = groups;
    c->moe_topk_group = groups / 2;
}

/* Trains STEPS steps and writes the loss, the dropped fraction and the
 * expert rows' bytes of each; par NULL: one rank with the whole global
 * batch. */
static moe_status train(double *losses, double *dropped, double *bytes, const moe_model_config *cfg, int64_t rows,
                        const moe_model_parallel *par, moe_data *data) {
    const moe_optim_config oc = mpi_optim(STEPS);
    moe_step_metrics m[STEPS];
    const moe_status st = mpi_train_run(m, cfg, rows, T, par, &oc, data, STEPS, NULL);
    for (int s = 0; st == MOE_OK && s < STEPS; s++) {
        losses[s] = m[s].loss;
        dropped[s] = m[s].dropped_frac;
        bytes[s] = m[s].exchange_bytes;
    }
    return st;
}

/* 1 after printing the first step whose expert rows' bytes contradict the
 * grid: none without expert parallelism, some every step with it. */
static int check_bytes(const double *bytes, int ep_size) {
    for (int s = 0; s < STEPS; s++)
        if ((bytes[s] > 0.0) != (ep_size > 1)) {
            printf("  rank %d: step %d sent %g bytes of expert rows a rank with EP=%d\n", rank, s + 1, bytes[s], ep_size);
            return 1;
        }
    return 0;
}

/* 1 after printing the first step whose dropped fraction is off the one
 * rank's by 10% of it: a share of the global batch, whichever rank counts. */
static int compare_dropped(const double *got, const double *want, double capacity) {
    double total = 0.0;
    for (int s = 0; s < STEPS; s++) {
        total += want[s];
        if (!(fabs(got[s] - want[s]) <= 0.1 * want[s])) {
            printf("  rank %d: step %d dropped %.6g of the pairs, one rank %.6g\n", rank, s + 1, got[s], want[s]);
            return 1;
        }
    }
    if (capacity > 0.0 && total == 0.0) {
        printf("  rank %d: capacity %g drops nothing: the comparison proves little\n", rank, capacity);
        return 1;
    }
    return 0;
}

static int run_grid(int ep_size, double capacity, int groups, bool tied, moe_data *data) {
    moe_model_config cfg;
    tiny_config(&cfg, capacity, groups, tied);
    double want[STEPS], got[STEPS], want_dropped[STEPS], got_dropped[STEPS], want_bytes[STEPS], got_bytes[STEPS];
    moe_comm *ep = NULL;
    moe_status st = train(want, want_dropped, want_bytes, &cfg, (int64_t)size * B, NULL, data);
    if (st == MOE_OK) st = moe_comm_split(&ep, world, rank / ep_size, rank);
    if (st == MOE_OK)
        st = train(got, got_dropped, got_bytes, &cfg, B, &(moe_model_parallel){.world = world, .ep = ep}, data);
    int bad = mpi_fail_status(st, "train");
    if (!bad) bad = mpi_compare_losses(got, want, 0, STEPS, "grid vs one rank");
    if (!bad) bad = compare_dropped(got_dropped, want_dropped, capacity);
    if (!bad) bad = check_bytes(want_bytes, 1) || check_bytes(got_bytes, ep_size);
    if (!bad) bad = mpi_loss_did_not_fall(want, STEPS);
    if (ep) moe_comm_free(ep);
    return bad;
}

/* The CPU table with a matmul that sleeps 10 ms after it computes: a rank
 * on it is a straggler. */
static moe_ops slow_ops;

static void slow_matmul_forward(float *out, const float *inp, const float *weight, int64_t N, int64_t C,
                                int64_t OC) {
    moe_cpu_ops()->matmul_forward(out, inp, weight, N, C, OC);
    nanosleep(&(struct timespec){.tv_nsec = 10000000}, NULL);
}

/* Every step names the slowest rank of the grid, and its busy time is the
 * most and at least the median: the last rank, slowed, in at least 6 of
 * 8 steps (its sleeps alone outlast a step of the others). */
static int check_straggler(moe_data *data) {
    moe_model_config cfg;
    tiny_config(&cfg, 0.0, 0, false);
    slow_ops = *moe_cpu_ops();
    slow_ops.matmul_forward = slow_matmul_forward;
    const moe_model_parallel par = {.world = world, .ops = rank == size - 1 ? &slow_ops : NULL};
    const moe_optim_config oc = mpi_optim(8);
    moe_step_metrics m[8];
    const moe_status st = mpi_train_run(m, &cfg, B, T, &par, &oc, data, 8, NULL);
    int bad = mpi_fail_status(st, "train");
    int named = 0;
    for (int s = 0; !bad && s < 8; s++) {
        named += m[s].slowest_rank == size - 1;
        if (!(m[s].busy_max_s >= m[s].busy_median_s && m[s].busy_median_s > 0.0 && m[s].busy_s > 0.0 &&
              m[s].busy_s <= m[s].busy_max_s)) {
            printf("  rank %d: step %d: busy %g, most %g, median %g\n", rank, s + 1, m[s].busy_s, m[s].busy_max_s,
                   m[s].busy_median_s);
            bad = 1;
        }
    }
    if (!bad && named < 6) {
        printf("  rank %d: the slowed rank %d was named the slowest in %d of 8 steps\n", rank, size - 1, named);
        bad = 1;
    }
    return bad;
}

int main(void) {
    int32_t *tokens = NULL;
    moe_data *data = mpi_training_start(&tokens, VOCAB);
    if (!data) return 1;
    const int ep_sizes[3] = {1, size, size / 2};
    const int grids = size >= 4 ? 3 : 2;
    for (int g = 0; g < grids; g++)
        for (int cap = 0; cap < 2; cap++)
            mpi_report(run_grid(ep_sizes[g], cap ? 1.0 : 0.0, 0, false, data), "%d ranks, EP=%d, %s, %d steps", size,
                       ep_sizes[g], cap ? "capacity 1.0" : "dropless", STEPS);
    for (int cap = 0; cap < 2; cap++)
        mpi_report(run_grid(size, cap ? 1.0 : 0.0, size, false, data),
                   "%d ranks, EP=%d, %d expert groups keeping %d, %s", size, size, size, size / 2,
                   cap ? "capacity 1.0" : "dropless");
    /* The head's gradient adds to the embedding's before the ranks sum it. */
    for (int g = 0; g < 2; g++)
        mpi_report(run_grid(ep_sizes[g], 0.0, 0, true, data), "%d ranks, EP=%d, tied embedding and head", size,
                   ep_sizes[g]);
    mpi_report(check_straggler(data), "a rank whose matmuls sleep is named the slowest");
    moe_data_close(data);
    free(tokens);
    return mpi_check_finish();
}
