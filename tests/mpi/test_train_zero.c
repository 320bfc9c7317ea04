/* test_train_zero.c: training with the AdamW state sharded (--zero 1) on
 * several ranks (run under mpirun -np 2 and -np 4) gives the loss curve and
 * gradient norms of one rank reading the same global batches, with and
 * without gradient accumulation; and the optimizer state per rank shrinks
 * to its block of each run. Every rank also trains the one-rank model
 * itself, so the reference never crosses the network. Grids: EP = 1 (every
 * run sharded across all ranks), with 4 ranks EP = 2 (experts across 2
 * replicas), with 2 ranks EP = 2 (experts unsharded, one replica each).
 * Tolerance: 1e-5 relative per step, as float summation order allows. A
 * plain program (Criterion forks, which MPI does not survive); ends with
 * "N passed, M failed". */
#include "mpi_check.h"

#define STEPS 20
#define B 2 /* rows per rank and micro-batch */
#define T 8
#define VOCAB 32

/* Odd sizes, so that the runs do not divide into equal blocks and the
 * padding is exercised: with EP = 1 the dense run's for 2 and 4 ranks, the
 * experts' for 4. */
static void tiny_config(moe_model_config *c) {
    mpi_tiny_config(c, VOCAB, 9, 7, 3, 6);
    c->moe_z_loss_coef = 0.001;
}

typedef struct curve {
    double loss[STEPS], norm[STEPS];
    int64_t optimizer_bytes;
    int64_t run_count[MOE_RUN_COUNT]; /* parameters of each run on this rank */
} curve;

/* Trains STEPS steps; par NULL: one rank with the whole global batch. */
static moe_status train(curve *out, const moe_model_config *cfg, int64_t rows, int64_t accum, int zero,
                        const moe_model_parallel *par, moe_data *data) {
    moe_model *model = NULL;
    moe_trainer *trainer = NULL;
    moe_optim_config oc = mpi_optim(STEPS);
    oc.grad_accum = accum;
    oc.grad_clip = 0.5; /* below the early norms, so clipping is exercised */
    oc.zero = zero;
    moe_status st = moe_model_create_parallel(&model, cfg, rows, T, 7, par);
    if (st == MOE_OK) st = moe_trainer_create(&trainer, model, &oc);
    if (st == MOE_OK) st = moe_data_set_position(data, (moe_data_position){0, 0});
    if (st == MOE_OK) st = mpi_train_steps(out->loss, out->norm, trainer, data, 0, STEPS);
    if (st == MOE_OK) {
        out->optimizer_bytes = moe_trainer_optimizer_bytes(trainer);
        for (int r = 0; r < MOE_RUN_COUNT; r++) out->run_count[r] = moe_model_get_run(model, (moe_model_run_id)r).count;
    }
    moe_trainer_destroy(trainer);
    moe_model_destroy(model);
    return st;
}

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* Trains the one-rank reference, the grid without and with zero; compares
 * curves and the optimizer bytes. */
static int run_grid(int ep_size, int64_t accum, moe_data *data) {
    moe_model_config cfg;
    tiny_config(&cfg);
    curve want, plain, got;
    moe_comm *ep = NULL, *device_world = NULL, *device_ep = NULL;
    moe_status st = train(&want, &cfg, (int64_t)size * B, accum, 0, NULL, data);
    if (st == MOE_OK) st = moe_comm_split(&ep, world, rank / ep_size, rank);
    /* The arrays (rows, gradients, gradient blocks, parameters) move on
     * communicators of their own, as NCCL's under CUDA: the same ranks,
     * other handles. test_train_dp covers them carried by world and ep. */
    if (st == MOE_OK) st = moe_comm_split(&device_world, world, 0, rank);
    if (st == MOE_OK) st = moe_comm_split(&device_ep, device_world, rank / ep_size, rank);
    const moe_model_parallel apart = {.world = world, .ep = ep, .device_world = device_world, .device_ep = device_ep};
    if (st == MOE_OK) st = train(&plain, &cfg, B, accum, 0, &apart, data);
    if (st == MOE_OK) st = train(&got, &cfg, B, accum, 1, &apart, data);
    int bad = mpi_fail_status(st, "train");
    bool clipped = false;
    for (int s = 0; !bad && s < STEPS; s++) {
        clipped |= want.norm[s] > 0.5;
        if (!(fabs(got.loss[s] - want.loss[s]) <= 1e-5 * fabs(want.loss[s])) ||
            !(fabs(got.norm[s] - want.norm[s]) <= 1e-5 * fabs(want.norm[s]))) {
            printf("  rank %d: step %d loss %.9g grad norm %.9g, one rank %.9g and %.9g\n", rank, s + 1, got.loss[s],
                   got.norm[s], want.loss[s], want.norm[s]);
            bad = 1;
        }
    }
    if (!bad && (want.loss[STEPS - 1] >= want.loss[0] || !clipped)) {
        printf("  rank %d: the loss did not fall (%.6g -> %.6g) or was never clipped: the test would prove little\n",
               rank, want.loss[0], want.loss[STEPS - 1]);
        bad = 1;
    }
    /* Each moment: the dense run's block of W, the experts' block of R
     * replicas (the whole run when R = 1); unsharded, both runs and the
     * padding between them. */
    const int64_t R = size / ep_size, f2 = 2 * (int64_t)sizeof(float);
    const int64_t dense = got.run_count[MOE_RUN_DENSE], experts = got.run_count[MOE_RUN_EXPERTS];
    const int64_t want_bytes = f2 * (ceil_div(dense, size) + (R > 1 ? ceil_div(experts, R) : experts));
    if (!bad && ep_size == 1 && (dense % size == 0 || (size >= 4 && experts % size == 0))) {
        printf("  rank %d: runs of %lld and %lld parameters divide by %d ranks: no padding tested\n", rank,
               (long long)dense, (long long)experts, size);
        bad = 1;
    }
    if (!bad && (got.optimizer_bytes != want_bytes || plain.optimizer_bytes < f2 * (dense + experts) ||
                 (double)got.optimizer_bytes > (double)plain.optimizer_bytes / (double)R + f2 * (size + R))) {
        printf("  rank %d: optimizer bytes %lld with zero (want %lld, about 1/%lld of %lld without)\n", rank,
               (long long)got.optimizer_bytes, (long long)want_bytes, (long long)R, (long long)plain.optimizer_bytes);
        bad = 1;
    }
    if (device_ep) moe_comm_free(device_ep);
    if (device_world) moe_comm_free(device_world);
    if (ep) moe_comm_free(ep);
    return bad;
}

int main(void) {
    int32_t *tokens = NULL;
    moe_data *data = mpi_training_start(&tokens, VOCAB);
    if (!data) return 1;
    typedef struct {
        int ep;
        int64_t accum;
    } grid;
    const grid grids[] = {{1, 1}, {2, 1}, {1, 2}};
    for (size_t g = 0; g < sizeof grids / sizeof grids[0]; g++)
        mpi_report(run_grid(grids[g].ep, grids[g].accum, data), "%d ranks, EP=%d, zero 1, grad accum %lld, %d steps",
                   size, grids[g].ep, (long long)grids[g].accum, STEPS);
    moe_data_close(data);
    free(tokens);
    return mpi_check_finish();
}
