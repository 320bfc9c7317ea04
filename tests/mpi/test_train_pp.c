/* test_train_pp.c: pipeline parallelism (run under mpirun -np 2 and -np 4)
 * gives the loss curve and gradient norms of one rank reading the same
 * global batches. Every rank also trains the one-rank model itself, so the
 * reference never crosses the network. Grids: every rank a stage (PP = 2,
 * or 4), under 1F1B and GPipe, with more micro-batches than stages and
 * fewer; with 4 ranks PP = 2 x DP = 2 with EP = 2 and ZeRO under both, and
 * without either (the gradients all-reduced during the backward). The model
 * draws jitter noise and steers by the selection bias, so GPipe's
 * recomputed forwards must draw the noise of the first and count no load
 * twice, and 1F1B's instances (the model and its twins) must draw from and
 * add to one jitter counter and one bias load; capacity drops make the
 * routing depend on the whole batch.
 * Tolerance: 1e-5 relative per step, as float summation order allows.
 * A plain program (Criterion forks, which MPI does not survive); ends with
 * "N passed, M failed". */
#include <string.h>
#include <sys/resource.h>

#include "common/host_memory.h"
#include "engine/grid.h"
#include "mpi_check.h"

#define STEPS 12
#define B 2 /* rows per data-parallel rank */
#define T 8
#define VOCAB 32
#define LAYERS 4

/* Bit l: layer l of the runs' models is a dense MLP layer, 24 wide. */
static uint64_t dense_layers;

static void tiny_config(moe_model_config *c) {
    mpi_tiny_config(c, VOCAB, 16, 16, LAYERS, 4);
    c->moe_z_loss_coef = 0.001;
    c->moe_capacity_factor = 1.25;
    c->router_jitter_noise = 0.05;
    c->moe_bias_update_rate = 1e-3;
    c->moe_n_shared_experts = 1;
    c->moe_seq_aux_loss_coef = 0.01;
    c->moe_dense_layers[0] = dense_layers;
    if (dense_layers) c->moe_dense_intermediate_size = 24;
}

typedef struct curve {
    double loss[STEPS], norm[STEPS], ce[STEPS], aux[STEPS], idle[STEPS];
    double load[LAYERS * 4]; /* the last step's expert load */
} curve;

/* Trains STEPS steps of M micro-batches of `rows` rows per rank; grid
 * NULL: this rank alone. */
static moe_status train(curve *out, const moe_grid *grid, int64_t rows, int64_t M, moe_pipe_schedule schedule,
                        int zero, bool recompute, moe_data *data) {
    moe_model_config cfg;
    tiny_config(&cfg);
    moe_optim_config oc = mpi_optim(STEPS);
    oc.grad_accum = M;
    oc.pipe_schedule = schedule;
    oc.zero = zero;
    moe_model_parallel par = grid ? moe_grid_model_parallel(grid) : (moe_model_parallel){0};
    par.recompute = recompute;
    moe_step_metrics m[STEPS];
    const moe_status st = mpi_train_run(m, &cfg, rows, T, &par, &oc, data, STEPS, out->load);
    for (int s = 0; st == MOE_OK && s < STEPS; s++) {
        out->loss[s] = m[s].loss;
        out->norm[s] = m[s].grad_norm;
        out->ce[s] = m[s].ce_loss;
        out->aux[s] = m[s].aux_loss;
        out->idle[s] = m[s].pipeline_idle;
    }
    return st;
}

/* 1 after printing the first value of [STEPS] off the reference by more
 * than 1e-5 relative. */
static int compare(const double *got, const double *want, const char *what) {
    for (int s = 0; s < STEPS; s++)
        if (!(fabs(got[s] - want[s]) <= 1e-5 * fabs(want[s]))) {
            printf("  rank %d: %s at step %d: %.9g, one rank %.9g\n", rank, what, s + 1, got[s], want[s]);
            return 1;
        }
    return 0;
}

static int run_grid(int pp, int chunks, int ep, int zero, int64_t M, moe_pipe_schedule schedule, bool recompute,
                    moe_data *data) {
    moe_model_config cfg;
    tiny_config(&cfg);
    moe_grid grid;
    curve want, got;
    moe_status st = moe_grid_create(&grid, world, ep, pp, chunks, cfg.num_hidden_layers, moe_grid_flop_costs(&cfg, T));
    if (st != MOE_OK) return mpi_fail_status(st, "grid");
    st = train(&want, NULL, (int64_t)grid.at.dp_size * B, M, MOE_PIPE_1F1B, 0, false, data);
    if (st == MOE_OK) st = train(&got, &grid, B, M, schedule, zero, recompute, data);
    int bad = mpi_fail_status(st, "train");
    if (!bad) bad = compare(got.loss, want.loss, "loss");
    if (!bad) bad = compare(got.ce, want.ce, "cross-entropy");
    if (!bad) bad = compare(got.aux, want.aux, "aux loss");
    if (!bad) bad = compare(got.norm, want.norm, "gradient norm");
    if (!bad) bad = mpi_loss_did_not_fall(want.loss, STEPS);
    /* Every stage's layers, on every rank, as one rank counts them. */
    for (int i = 0; !bad && i < LAYERS * 4; i++)
        if (got.load[i] != want.load[i]) {
            printf("  rank %d: layer %d expert %d kept %g pairs, one rank %g\n", rank, i / 4, i % 4, got.load[i],
                   want.load[i]);
            bad = 1;
        }
    /* A share of the schedule's time: none without a pipeline. */
    for (int s = 0; !bad && s < STEPS; s++)
        if (!(got.idle[s] >= 0.0 && got.idle[s] < 1.0) || want.idle[s] != 0.0) {
            printf("  rank %d: step %d: pipeline idle %g, one rank %g\n", rank, s + 1, got.idle[s], want.idle[s]);
            bad = 1;
        }
    moe_grid_destroy(&grid);
    return bad;
}

/* The stages of a grid hold the layers in order, one each at least, and
 * the model refuses a partition that does not, or that another rank was
 * not given. */
static int check_stages(void) {
    moe_model_config cfg;
    tiny_config(&cfg);
    moe_grid grid;
    moe_status st = moe_grid_create(&grid, world, 1, size, 1, cfg.num_hidden_layers, moe_grid_flop_costs(&cfg, T));
    if (st != MOE_OK) return mpi_fail_status(st, "grid");
    int bad = grid.at.stage != rank || grid.stage_layers[0] != 0 || grid.stage_layers[size] != LAYERS;
    for (int s = 0; !bad && s < size; s++) bad = grid.stage_layers[s + 1] <= grid.stage_layers[s];
    if (bad) printf("  rank %d: stage %d holds [%lld, %lld)\n", rank, grid.at.stage,
                    (long long)grid.stage_layers[rank], (long long)grid.stage_layers[rank + 1]);
    int64_t bounds[LAYERS + 1];
    moe_model_parallel par = moe_grid_model_parallel(&grid);
    par.stage_layers = bounds;
    static const char *const cases[] = {"the last stage claims a layer more, on its own", "the last stage holds no layer"};
    for (int c = 0; c < 2; c++) {
        memcpy(bounds, grid.stage_layers, (size_t)(size + 1) * sizeof *bounds);
        /* On 2 stages the last one's claim is another partition; on 4 of
         * a layer each, no partition, which the others hear of. */
        const char *want = size == 2 ? "split the layers into pipeline stages differently"
                           : rank == size - 1 ? "must hold the 4 layers in order"
                                              : "1 other ranks refused";
        if (c == 0 && rank == size - 1) bounds[size - 1]--;
        if (c == 1) bounds[size - 1] = LAYERS, want = "must hold the 4 layers in order";
        moe_model *model = NULL;
        st = moe_model_create_parallel(&model, &cfg, B, T, 7, &par);
        if (st != MOE_ERR_CONFIG || !strstr(moe_last_error(), want)) {
            printf("  rank %d: %s gave %s: %s\n", rank, cases[c], moe_status_string(st), moe_last_error());
            bad = 1;
        }
        moe_model_destroy(model);
    }
    moe_grid_destroy(&grid);
    st = moe_grid_create(&grid, world, 1, 2 * size, 1, cfg.num_hidden_layers, moe_grid_flop_costs(&cfg, T));
    if (st != MOE_ERR_CONFIG || !strstr(moe_last_error(), "--pp")) {
        printf("  rank %d: --pp %d on %d ranks gave %s\n", rank, 2 * size, size, moe_status_string(st));
        bad = 1;
    }
    if (st == MOE_OK) moe_grid_destroy(&grid);
    return bad;
}

/* Refused on every rank: a pipeline without the grid's communicator (the
 * checkpoints' gather), (4 ranks) data-parallel ranks of a stage that
 * hold different layers, and a tied embedding and head, which the first
 * and the last stage would share. */
static int check_layouts(void) {
    moe_model_config cfg;
    tiny_config(&cfg);
    moe_grid grid;
    int bad = 0;
    for (int c = 0; c < 3; c++) {
        if (c == 1 && size < 4) continue;
        moe_status st =
            moe_grid_create(&grid, world, 1, c ? 2 : size, 1, cfg.num_hidden_layers, moe_grid_flop_costs(&cfg, T));
        if (st != MOE_OK) return mpi_fail_status(st, "grid");
        moe_model_parallel par = moe_grid_model_parallel(&grid);
        /* Layout 1: stage 0's second rank ends stage 0 a layer early, which
         * every rank sees. */
        int64_t bounds[3];
        const char *want = "needs job";
        if (c == 0) par.job = NULL;
        if (c == 1) {
            memcpy(bounds, grid.stage_layers, sizeof bounds);
            if (grid.at.dp_rank == 1 && grid.at.stage == 0) bounds[1]--;
            par.stage_layers = bounds;
            want = "split the layers into pipeline stages differently";
        }
        if (c == 2) {
            cfg.tie_word_embeddings = true;
            want = "tie_word_embeddings true shares one tensor";
        }
        moe_model *model = NULL;
        st = moe_model_create_parallel(&model, &cfg, B, T, 7, &par);
        if (st != MOE_ERR_CONFIG || !strstr(moe_last_error(), want)) {
            printf("  rank %d: layout %d gave %s: %s (want \"%s\")\n", rank, c, moe_status_string(st),
                   moe_last_error(), want);
            bad = 1;
        }
        moe_model_destroy(model);
        moe_grid_destroy(&grid);
    }
    return bad;
}

/* Stages on one machine are held to its memory together: a vocabulary
 * whose embedding (first stage) and head (last) each take 0.6 of the
 * machine, with their gradients, is refused on every rank before any of it
 * is allocated. The address space is capped at half the machine meanwhile,
 * so that a check that let it through fails an allocation instead of the
 * machine. */
static int check_shared_memory(void) {
    if (!mpi_can_cap_memory()) return 0;
    const moe_host_memory host = moe_host_memory_available("");
    moe_model_config cfg;
    tiny_config(&cfg);
    const double vocab = 0.6 * (double)host.total / (double)(cfg.hidden_size * 2 * sizeof(float));
    if (host.total < 0 || vocab > INT32_MAX) {
        if (rank == 0) printf("  (skipped: MemTotal %lld bytes)\n", (long long)host.total);
        return 0;
    }
    cfg.vocab_size = (int64_t)vocab;
    moe_grid grid;
    moe_status st = moe_grid_create(&grid, world, 1, size, 1, cfg.num_hidden_layers, moe_grid_flop_costs(&cfg, T));
    if (st != MOE_OK) return mpi_fail_status(st, "grid");
    struct rlimit was;
    getrlimit(RLIMIT_AS, &was);
    const struct rlimit capped = {(rlim_t)(host.total / 2), was.rlim_max};
    setrlimit(RLIMIT_AS, &capped);
    const moe_model_parallel par = moe_grid_model_parallel(&grid);
    moe_model *model = NULL;
    st = moe_model_create_parallel(&model, &cfg, B, T, 7, &par);
    setrlimit(RLIMIT_AS, &was);
    char want[64];
    snprintf(want, sizeof want, "and the %d ranks that share its memory", size);
    int bad = 0;
    if (st != MOE_ERR_CONFIG || !strstr(moe_last_error(), want)) {
        printf("  rank %d: %s: %s (want \"%s\")\n", rank, moe_status_string(st), moe_last_error(), want);
        bad = 1;
    }
    moe_model_destroy(model);
    moe_grid_destroy(&grid);
    return bad;
}

/* A target outside the vocabulary fails every stage at once, not the last
 * stage alone with the others left waiting for it until the timeout. */
static int check_bad_target(void) {
    moe_model_config cfg;
    tiny_config(&cfg);
    int32_t tokens[64];
    for (int i = 0; i < 64; i++) tokens[i] = i % VOCAB;
    tokens[T] = VOCAB + 3; /* the last target of the first row, never an input of it */
    moe_data *data = NULL;
    moe_grid grid;
    moe_model *model = NULL;
    moe_trainer *trainer = NULL;
    moe_optim_config oc = mpi_optim(STEPS);
    moe_status st = moe_data_from_tokens(&data, tokens, 64, 2 * VOCAB, "bad targets");
    if (st == MOE_OK) st = moe_grid_create(&grid, world, 1, size, 1, cfg.num_hidden_layers, moe_grid_flop_costs(&cfg, T));
    if (st != MOE_OK) {
        moe_data_close(data);
        return mpi_fail_status(st, "setup");
    }
    moe_model_parallel par = moe_grid_model_parallel(&grid);
    st = moe_comm_set_timeout(grid.pipe, 30.0);
    if (st == MOE_OK) st = moe_model_create_parallel(&model, &cfg, 1, T, 7, &par);
    if (st == MOE_OK) st = moe_trainer_create(&trainer, model, &oc);
    if (st == MOE_OK) st = moe_trainer_step(trainer, data, NULL);
    int bad = st != MOE_ERR_INVALID_ARG || !strstr(moe_last_error(), "target token 35");
    if (bad) printf("  rank %d: a bad target gave %s: %s\n", rank, moe_status_string(st), moe_last_error());
    moe_trainer_destroy(trainer);
    moe_model_destroy(model);
    moe_grid_destroy(&grid);
    moe_data_close(data);
    return bad;
}

/* An interleaved stage's twin holds the chunks it serves and no more:
 * one of chunk 0 alone keeps about half the activations of one of both,
 * and refuses chunk 1. */
static int check_partial_twin(void) {
    moe_model_config cfg;
    tiny_config(&cfg);
    moe_grid grid;
    moe_status st = moe_grid_create(&grid, world, 1, 2, 2, cfg.num_hidden_layers, moe_grid_flop_costs(&cfg, T));
    if (st != MOE_OK) return mpi_fail_status(st, "grid");
    moe_model_parallel par = moe_grid_model_parallel(&grid);
    moe_model *model = NULL, *both = NULL, *first = NULL;
    st = moe_model_create_parallel(&model, &cfg, B, T, 7, &par);
    if (st == MOE_OK) st = moe_model_create_twin(&both, model, 3);
    if (st == MOE_OK) st = moe_model_create_twin(&first, model, 1);
    int bad = mpi_fail_status(st, "twins");
    if (!bad) {
        const double all = (double)moe_model_activation_bytes(both), part = (double)moe_model_activation_bytes(first);
        /* A layer each: a chunk's share and no head, at most 3/4 of both chunks' with the head's. */
        if (!(part < 0.75 * all && part > 0.0)) {
            printf("  rank %d: a twin of chunk 0 keeps %.0f bytes, one of both %.0f\n", rank, part, all);
            bad = 1;
        }
        float x = 0.0f;
        st = moe_model_stage_backward(first, 1, &x, 1.0f);
        if (st != MOE_ERR_INVALID_ARG || !strstr(moe_last_error(), "does not hold chunk 1")) {
            printf("  rank %d: chunk 1 on a twin of chunk 0 gave %s: %s\n", rank, moe_status_string(st),
                   moe_last_error());
            bad = 1;
        }
    }
    moe_model_destroy(first);
    moe_model_destroy(both);
    moe_model_destroy(model);
    moe_grid_destroy(&grid);
    return bad;
}

int main(void) {
    int32_t *tokens = NULL;
    moe_data *data = mpi_training_start(&tokens, VOCAB);
    if (!data) return 1;
    mpi_report(check_stages(), "%d stages hold the layers in order; overlapping stages are refused", size);
    mpi_report(check_layouts(), "a pipeline without the grid's communicator%s, or of a tied embedding and head, is "
               "refused on every rank", size >= 4 ? ", with a stage's ranks on different layers" : "");
    mpi_report(check_bad_target(), "a bad target fails every stage at once");
    mpi_report(check_shared_memory(), "stages that together exceed their machine's memory are refused on every rank");
    mpi_report(check_partial_twin(), "a twin of an interleaved stage holds the chunks it serves");
    static const char *const names[] = {"1F1B", "GPipe"};
    for (int sched = 0; sched < 2; sched++)
        for (int64_t M = 1; M <= 2 * size; M += size + 1) /* fewer micro-batches than stages, then more */
            mpi_report(run_grid(size, 1, 1, 0, M, (moe_pipe_schedule)sched, false, data), "PP=%d, %s, %lld micro-batches",
                       size, names[sched], (long long)M);
    /* Recomputation: every instance (1F1B's twins) and GPipe's replays
     * share one set of layer activations, each backward recomputing its
     * layer first. */
    for (int sched = 0; sched < 2; sched++)
        mpi_report(run_grid(size, 1, 1, 0, 2 * size + 1, (moe_pipe_schedule)sched, true, data),
                   "PP=%d, %s, %d micro-batches, recomputed", size, names[sched], 2 * size + 1);
    if (size >= 4) {
        for (int sched = 0; sched < 2; sched++)
            mpi_report(run_grid(2, 1, 2, 1, 3, (moe_pipe_schedule)sched, false, data),
                       "PP=2 x DP=2, EP=2, ZeRO, %s, 3 micro-batches", names[sched]);
        /* The gradients all-reduced layer by layer during the last backward. */
        mpi_report(run_grid(2, 1, 1, 0, 3, MOE_PIPE_1F1B, false, data), "PP=2 x DP=2, EP=1, 1F1B, 3 micro-batches");
        /* The recomputed forwards exchange their rows again. */
        mpi_report(run_grid(2, 1, 2, 0, 3, MOE_PIPE_1F1B, true, data), "PP=2 x DP=2, EP=2, 1F1B, 3 micro-batches, recomputed");
    }
    /* Interleaved 1F1B: 2 stages of 2 chunks of a layer each; the chunks
     * of a stage send to and receive from both neighbours, one message
     * stream each way, and keep their forwards on the instances apart. */
    for (int64_t M = 2; M <= 6; M += 4)
        mpi_report(run_grid(2, 2, 1, 0, M, MOE_PIPE_1F1B, false, data), "PP=2 interleaved (2 chunks)%s, %lld micro-batches",
                   size >= 4 ? " x DP=2" : "", (long long)M);
    mpi_report(run_grid(2, 2, 1, 0, 4, MOE_PIPE_1F1B, true, data), "PP=2 interleaved (2 chunks)%s, 4 micro-batches, recomputed",
               size >= 4 ? " x DP=2" : "");
    /* Dense MLP layers 0 and 2 among the MoE layers: in the dense run, all-reduced over the data-parallel ranks (expert
     * parallel ones too), with no routing statistics; on 4 stages two hold a dense layer alone, and draw no jitter
     * noise. */
    dense_layers = 0x5;
    mpi_report(run_grid(size, 1, 1, 0, 3, MOE_PIPE_1F1B, false, data), "PP=%d, dense layers 0 and 2, 3 micro-batches",
               size);
    mpi_report(run_grid(2, 2, 1, 0, 4, MOE_PIPE_1F1B, true, data),
               "PP=2 interleaved (2 chunks)%s, dense layers 0 and 2, 4 micro-batches, recomputed", size >= 4 ? " x DP=2" : "");
    if (size >= 4)
        mpi_report(run_grid(2, 1, 2, 1, 3, MOE_PIPE_GPIPE, true, data),
                   "PP=2 x DP=2, EP=2, ZeRO, GPipe, dense layers 0 and 2, 3 micro-batches, recomputed");
    dense_layers = 0;
    if (size >= 4)
        mpi_report(run_grid(2, 2, 2, 1, 2, MOE_PIPE_1F1B, false, data), "PP=2 interleaved (2 chunks) x DP=2, EP=2, ZeRO, 2 micro-batches");
    moe_data_close(data);
    free(tokens);
    return mpi_check_finish();
}
