/* mpi_check.h: what the multi-rank test programs share: the world
 * communicator, PASS/FAIL lines agreed over MPI_COMM_WORLD (outside the code
 * under test), the "N passed, M failed" summary, and the tiny model, token
 * stream and training loop of the training tests. Plain programs, not
 * Criterion: Criterion forks, which MPI does not survive. */
#ifndef MOE_TESTS_MPI_CHECK_H
#define MOE_TESTS_MPI_CHECK_H

#include <math.h>
#include <mpi.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm/comm.h"
#include "common/rng.h"
#include "engine/data.h"
#include "engine/trainer.h"

static moe_comm *world;
static int rank, size;
static int mpi_passed, mpi_failed;

/* Creates the world communicator; false after printing why it cannot. */
static inline bool mpi_check_init(void) {
    if (moe_comm_mpi_create(&world) != MOE_OK) {
        fprintf(stderr, "mpi: %s\n", moe_last_error());
        return false;
    }
    rank = moe_comm_rank(world);
    size = moe_comm_size(world);
    return true;
}

/* Prints the summary on rank 0, frees the world and returns the exit
 * status: non-zero on any failed check or a failed finalize. */
static inline int mpi_check_finish(void) {
    if (rank == 0) printf("%d passed, %d failed\n", mpi_passed, mpi_failed);
    moe_comm_free(world);
    if (moe_comm_mpi_finalize() != MOE_OK) {
        fprintf(stderr, "rank %d: moe_comm_mpi_finalize: %s\n", rank, moe_last_error());
        return 1;
    }
    return mpi_failed ? 1 : 0;
}

/* Counts one check; returns how many ranks saw it fail (bad != 0). */
static inline int mpi_agree(int bad) {
    int any = 0;
    MPI_Allreduce(&bad, &any, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (any) mpi_failed++; else mpi_passed++;
    return any;
}

/* Counts one check and prints "PASS: <what>" or "FAIL: <what>" on rank 0. */
static inline void mpi_report(int bad, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
static inline void mpi_report(int bad, const char *fmt, ...) {
    const int any = mpi_agree(bad);
    if (rank == 0) {
        va_list ap;
        va_start(ap, fmt);
        printf("%s: ", any ? "FAIL" : "PASS");
        vprintf(fmt, ap);
        printf("\n");
        va_end(ap);
    }
    fflush(stdout);
}

/* Whether a case that caps the address space (RLIMIT_AS) can run: not
 * under AddressSanitizer, whose shadow memory and allocator reserve address
 * space past any cap and abort when an allocation fails. Says so when not. */
static inline bool mpi_can_cap_memory(void) {
#if defined(__SANITIZE_ADDRESS__)
    if (rank == 0) printf("  (skipped under AddressSanitizer: it reserves address space past any cap)\n");
    return false;
#else
    return true;
#endif
}

/* 1 after printing this rank's error when st is not MOE_OK, else 0. */
static inline int mpi_fail_status(moe_status st, const char *what) {
    if (st == MOE_OK) return 0;
    printf("  rank %d: %s: %s: %s\n", rank, what, moe_status_string(st), moe_last_error());
    return 1;
}

/* ----------------------------------------------------- training tests */

/* The fields every tiny training model shares; the rest is each test's. */
static inline void mpi_tiny_config(moe_model_config *c, int64_t vocab, int64_t hidden, int64_t ff, int64_t layers,
                                   int64_t experts) {
    moe_model_config_default_small(c, vocab);
    c->hidden_size = hidden;
    c->intermediate_size = ff;
    c->num_hidden_layers = layers;
    c->num_attention_heads = 2;
    c->num_key_value_heads = 1;
    c->head_dim = 8;
    c->num_local_experts = experts;
    c->num_experts_per_tok = 2;
    c->router_aux_loss_coef = 0.01;
}

/* A warmup-then-cosine schedule over steps. */
static inline moe_optim_config mpi_optim(int64_t steps) {
    moe_optim_config oc = MOE_OPTIM_CONFIG_INIT;
    oc.lr = 1e-2;
    oc.min_lr = 1e-3;
    oc.warmup = 2;
    oc.total_steps = steps;
    return oc;
}

/* A stream with structure to learn: each token follows from the last.
 * *tokens [4096] backs the stream: free it after moe_data_close. NULL after
 * printing why when it cannot be made. */
static inline moe_data *mpi_token_stream(int32_t **tokens, int64_t vocab) {
    const int64_t n = 4096;
    int32_t *t = malloc(sizeof(int32_t) * (size_t)n);
    t[0] = 1;
    for (int64_t i = 1; i < n; i++)
        t[i] = (int32_t)((t[i - 1] * 5 + 3 + (moe_rng_bits(11, 0, (uint64_t)i) % 4 == 0)) % vocab);
    moe_data *data = NULL;
    if (moe_data_from_tokens(&data, t, n, vocab, "test stream") != MOE_OK) {
        fprintf(stderr, "data: %s\n", moe_last_error());
        free(t);
        return NULL;
    }
    *tokens = t;
    return data;
}

/* A training test's start: the world (mpi_check_init) and its token
 * stream (mpi_token_stream); NULL after printing why either failed. */
static inline moe_data *mpi_training_start(int32_t **tokens, int64_t vocab) {
    return mpi_check_init() ? mpi_token_stream(tokens, vocab) : NULL;
}

/* A model of cfg for batches of rows x T on par's ranks (NULL: this rank
 * alone), seed 7, trained with oc for steps steps from the start of data:
 * each step's metrics into out [steps], and (load non-NULL) the last step's
 * expert load [layers, E] (moe_trainer_expert_load). */
static inline moe_status mpi_train_run(moe_step_metrics *out, const moe_model_config *cfg, int64_t rows, int64_t T,
                                       const moe_model_parallel *par, const moe_optim_config *oc, moe_data *data,
                                       int steps, double *load) {
    moe_model *model = NULL;
    moe_trainer *trainer = NULL;
    moe_status st = moe_model_create_parallel(&model, cfg, rows, T, 7, par);
    if (st == MOE_OK) st = moe_trainer_create(&trainer, model, oc);
    if (st == MOE_OK) st = moe_data_set_position(data, (moe_data_position){0, 0});
    for (int s = 0; st == MOE_OK && s < steps; s++) st = moe_trainer_step(trainer, data, &out[s]);
    if (st == MOE_OK && load)
        memcpy(load, moe_trainer_expert_load(trainer),
               (size_t)(cfg->num_hidden_layers * cfg->num_local_experts) * sizeof *load);
    moe_trainer_destroy(trainer);
    moe_model_destroy(model);
    return st;
}

/* Trains steps [from, to), writing each step's loss and (norms non-NULL)
 * gradient norm at its index. */
static inline moe_status mpi_train_steps(double *losses, double *norms, moe_trainer *trainer, moe_data *data, int from,
                                         int to) {
    moe_status st = MOE_OK;
    for (int s = from; st == MOE_OK && s < to; s++) {
        moe_step_metrics m;
        st = moe_trainer_step(trainer, data, &m);
        if (st != MOE_OK) break;
        losses[s] = m.loss;
        if (norms) norms[s] = m.grad_norm;
    }
    return st;
}

/* 1 after printing the first step in [from, to) whose loss is off the
 * reference by more than 1e-5 relative (float summation order), else 0. */
static inline int mpi_compare_losses(const double *got, const double *want, int from, int to, const char *what) {
    for (int s = from; s < to; s++)
        if (!(fabs(got[s] - want[s]) <= 1e-5 * fabs(want[s]))) {
            printf("  rank %d: %s: step %d loss %.9g, %.9g\n", rank, what, s + 1, got[s], want[s]);
            return 1;
        }
    return 0;
}

/* 1 after printing when the reference curve [steps] did not fall: a test
 * comparing against it would prove little. */
static inline int mpi_loss_did_not_fall(const double *want, int steps) {
    if (want[steps - 1] < want[0]) return 0;
    printf("  rank %d: the loss did not fall (%.6g -> %.6g): the test would prove little\n", rank, want[0],
           want[steps - 1]);
    return 1;
}

#endif /* MOE_TESTS_MPI_CHECK_H */
