/* test_train_dp.c: training on several ranks (run under mpirun -np 2 and
 * -np 4) gives the loss curve of one rank reading the same global batches.
 * Every rank also trains the one-rank model itself on the whole global batch,
 * so the reference never crosses the network. Grids: data parallel only
 * (EP = 1), EP over all ranks, and with 4 ranks EP = 2 with 2 replicas of
 * each expert; each with capacity dropping and without.
 * Tolerance: 1e-5 relative per step, as float summation order allows. A
 * plain program (Criterion forks, which MPI does not survive); ends with
 * "N passed, M failed". */
#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

#include "comm/comm.h"
#include "common/rng.h"
#include "engine/data.h"
#include "engine/trainer.h"

#define STEPS 20
#define B 2 /* rows per rank */
#define T 8
#define VOCAB 32

static moe_comm *world;
static int rank, size;

static void tiny_config(moe_model_config *c, double capacity) {
    moe_model_config_default_small(c, VOCAB);
    c->hidden_size = 16;
    c->intermediate_size = 16;
    c->num_hidden_layers = 2;
    c->num_attention_heads = 2;
    c->num_key_value_heads = 1;
    c->head_dim = 8;
    c->num_local_experts = 4;
    c->num_experts_per_tok = 2;
    c->router_aux_loss_coef = 0.01;
    c->moe_z_loss_coef = 0.001;
    c->moe_capacity_factor = capacity;
}

/* Trains STEPS steps and writes the loss of each; par NULL: one rank with
 * the whole global batch. */
static moe_status train(double *losses, const moe_model_config *cfg, int64_t rows, const moe_model_parallel *par,
                        moe_data *data) {
    moe_model *model = NULL;
    moe_trainer *trainer = NULL;
    moe_optim_config oc = MOE_OPTIM_CONFIG_INIT;
    oc.lr = 1e-2;
    oc.min_lr = 1e-3;
    oc.warmup = 2;
    oc.total_steps = STEPS;
    moe_status st = moe_model_create_parallel(&model, cfg, rows, T, 7, par);
    if (st == MOE_OK) st = moe_trainer_create(&trainer, model, &oc);
    if (st == MOE_OK) st = moe_data_set_position(data, (moe_data_position){0, 0});
    for (int s = 0; st == MOE_OK && s < STEPS; s++) {
        moe_step_metrics m;
        st = moe_trainer_step(trainer, data, &m);
        losses[s] = m.loss;
    }
    moe_trainer_destroy(trainer);
    moe_model_destroy(model);
    return st;
}

static int run_grid(int ep_size, double capacity, moe_data *data) {
    moe_model_config cfg;
    tiny_config(&cfg, capacity);
    double want[STEPS], got[STEPS];
    moe_comm *ep = NULL;
    int bad = 0;
    moe_status st = train(want, &cfg, (int64_t)size * B, NULL, data);
    if (st == MOE_OK) st = moe_comm_split(&ep, world, rank / ep_size, rank);
    if (st == MOE_OK) st = train(got, &cfg, B, &(moe_model_parallel){.world = world, .ep = ep}, data);
    if (st != MOE_OK) {
        printf("  rank %d: %s: %s\n", rank, moe_status_string(st), moe_last_error());
        bad = 1;
    }
    for (int s = 0; !bad && s < STEPS; s++)
        if (!(fabs(got[s] - want[s]) <= 1e-5 * fabs(want[s]))) {
            printf("  rank %d: step %d loss %.9g, one rank %.9g\n", rank, s + 1, got[s], want[s]);
            bad = 1;
        }
    if (!bad && want[STEPS - 1] >= want[0]) {
        printf("  rank %d: the loss did not fall (%.6g -> %.6g): the test would prove little\n", rank, want[0],
               want[STEPS - 1]);
        bad = 1;
    }
    if (ep) moe_comm_free(ep);
    return bad;
}

int main(void) {
    if (moe_comm_mpi_create(&world) != MOE_OK) {
        fprintf(stderr, "mpi: %s\n", moe_last_error());
        return 1;
    }
    rank = moe_comm_rank(world);
    size = moe_comm_size(world);
    /* A stream with structure to learn: each token follows from the last. */
    const int64_t n = 4096;
    int32_t *tokens = malloc(sizeof(int32_t) * (size_t)n);
    tokens[0] = 1;
    for (int64_t i = 1; i < n; i++)
        tokens[i] = (int32_t)((tokens[i - 1] * 5 + 3 + (moe_rng_bits(11, 0, (uint64_t)i) % 4 == 0)) % VOCAB);
    moe_data *data = NULL;
    if (moe_data_from_tokens(&data, tokens, n, VOCAB, "test stream") != MOE_OK) {
        fprintf(stderr, "data: %s\n", moe_last_error());
        return 1;
    }
    const int ep_sizes[3] = {1, size, size / 2};
    const int grids = size >= 4 ? 3 : 2;
    int passed = 0, failed = 0;
    for (int g = 0; g < grids; g++)
        for (int cap = 0; cap < 2; cap++) {
            int bad = run_grid(ep_sizes[g], cap ? 1.0 : 0.0, data), any = 0;
            MPI_Allreduce(&bad, &any, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
            if (rank == 0)
                printf("%s: %d ranks, EP=%d, %s, %d steps\n", any ? "FAIL" : "PASS", size, ep_sizes[g],
                       cap ? "capacity 1.0" : "dropless", STEPS);
            fflush(stdout);
            if (any) failed++; else passed++;
        }
    if (rank == 0) printf("%d passed, %d failed\n", passed, failed);
    moe_data_close(data);
    free(tokens);
    moe_comm_free(world);
    moe_comm_mpi_finalize();
    return failed ? 1 : 0;
}
