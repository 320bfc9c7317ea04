/* test_checkpoint_grid.c: checkpoints on a grid of ranks (run under mpirun
 * -np 2 and -np 4) are one rank's checkpoints.
 *  - files: a grid (EP and/or ZeRO, pipeline stages) saving the values one
 *    rank holds writes the same bytes as that rank; every stage's layers
 *    hold their own selection biases, so the file holds the stages' biases
 *    only when every stage sends its own;
 *  - load: one rank's checkpoint loads under every grid, every value in
 *    place, bit for bit;
 *  - resume: a run saved at step 10 on one grid (data-parallel, pipeline)
 *    continues on another (fewer ranks, other EP and ZeRO, pipelines, one
 *    rank; and from one rank to the grids) with the loss curve of an
 *    unbroken one-rank run (1e-5 relative per step, as float summation
 *    order allows);
 *  - errors: a load that fails on one rank only (an expert's tensor
 *    missing; on a pipeline, a tensor of no stage that names a layer of the
 *    last), and a save that fails on rank 0 only, fail on every rank, name
 *    the rank, and change nothing.
 * A plain program (Criterion forks, which MPI does not survive); ends with
 * "N passed, M failed". */
#define _XOPEN_SOURCE 700

#include <ftw.h>
#include <string.h>

#include "engine/checkpoint.h"
#include "engine/fileio.h"
#include "engine/grid.h"
#include "engine/safetensors.h"
#include "mpi_check.h"

#define B 2 /* rows per rank of the full world */
#define T 8
#define VOCAB 32
#define STEPS 20
#define SAVE_AT 10
#define SEED 7
#define STATE_STEP 3

static char tmp[256];

/* Odd sizes (the runs are padded on every grid), shared experts (in the
 * dense run), the selection bias (kept beside the weights), a layer for
 * each of up to 4 pipeline stages, and a dense MLP layer among them (the
 * one-rank table, which the parts name, has fewer tensors there). */
static void tiny_config(moe_model_config *c) {
    mpi_tiny_config(c, VOCAB, 9, 7, 4, 4);
    c->moe_n_shared_experts = 1;
    c->moe_bias_update_rate = 1e-3;
    c->moe_dense_layers[0] = 0x4;
    c->moe_dense_intermediate_size = 5;
}

/* How a run spreads over its ranks: pipeline stages, each of ranks / pp
 * data-parallel ranks in EP groups of ep; ZeRO on or off; chunks > 1: the
 * stages interleaved, each holding that many runs of layers. */
typedef struct grid {
    int pp, ep, zero, chunks;
} grid;

static void grid_name(char *out, size_t n, grid g) {
    snprintf(out, n, "PP=%d%s EP=%d zero %d", g.pp, g.chunks > 1 ? " interleaved" : "", g.ep, g.zero);
}

typedef struct run {
    moe_model *model;
    moe_trainer *trainer;
    moe_grid grid;
    bool has_grid;
} run;

/* A model and trainer on the ranks of comm (NULL: this rank alone, g
 * ignored but for ZeRO) spread as g; rows per data-parallel rank and step,
 * an even number, in two micro-batches: an interleaved pipeline of two
 * stages takes its micro-batches in pairs, and every run splits its
 * batches alike, since the balancing losses of two halves are not the
 * whole's. */
static moe_status make_run(run *r, moe_comm *comm, grid g, int64_t rows, uint64_t seed) {
    moe_model_config cfg;
    tiny_config(&cfg);
    *r = (run){0};
    moe_status st = MOE_OK;
    const int chunks = comm ? g.chunks : 1;
    if (comm) {
        st = moe_grid_create(&r->grid, comm, g.ep, g.pp, chunks, cfg.num_hidden_layers, moe_grid_flop_costs(&cfg, T));
        r->has_grid = st == MOE_OK;
    }
    moe_optim_config oc = mpi_optim(STEPS);
    oc.zero = g.zero;
    oc.grad_accum = 2;
    rows /= 2;
    const moe_model_parallel par = r->has_grid ? moe_grid_model_parallel(&r->grid) : (moe_model_parallel){0};
    if (st == MOE_OK) st = moe_model_create_parallel(&r->model, &cfg, rows, T, seed, comm ? &par : NULL);
    if (st == MOE_OK) st = moe_trainer_create(&r->trainer, r->model, &oc);
    return st;
}

static void free_run(run *r) {
    moe_trainer_destroy(r->trainer);
    moe_model_destroy(r->model);
    if (r->has_grid) moe_grid_destroy(&r->grid);
}

/* A moment's value, from what it belongs to: the same on every grid. */
static float known(int kind, int64_t tensor, int64_t element) {
    const float u = moe_rng_uniform(99 + (uint64_t)kind, (uint64_t)tensor, (uint64_t)element);
    return kind == 0 ? u - 0.5f : u;
}

/* Gives the moments this rank keeps their known values, the biases of its
 * layers theirs, and the trainer STATE_STEP steps. */
static moe_train_state fill_state(run *r) {
    moe_model *m = r->model;
    for (int k = 0; k < MOE_RUN_COUNT; k++) {
        const moe_optim_shard s = moe_trainer_shard(r->trainer, (moe_model_run_id)k);
        for (int64_t i = 0; i < moe_model_tensor_count(m); i++) {
            const moe_model_tensor *t = moe_model_tensor_at(m, i);
            for (int64_t p = t->offset; p < t->offset + t->numel; p++)
                if (p >= s.begin && p < s.end) {
                    s.m[p - s.begin] = known(0, t->init_stream, p - t->offset);
                    s.v[p - s.begin] = known(1, t->init_stream, p - t->offset);
                }
        }
    }
    const moe_model_config *c = moe_model_get_config(m);
    for (int64_t l = 0; l < c->num_hidden_layers; l++) {
        float *bias = moe_model_router_bias(m, l); /* [E]; NULL: another stage's layer, or a dense one */
        for (int64_t e = 0; bias && e < c->num_local_experts; e++) bias[e] = 0.01f * (float)(l * 10 + e);
    }
    moe_trainer_set_steps_done(r->trainer, STATE_STEP);
    return (moe_train_state){.step = STATE_STEP, .seed = SEED, .jitter_counter = 0, .data = {.token = 123, .epoch = 1}};
}

static void report(int bad, const char *what) { mpi_report(bad, "%d ranks, %s", size, what); }

/* ------------------------------------------------------------------ files */

static int same_file(const char *a, const char *b) {
    char *x = NULL, *y = NULL;
    size_t nx = 0, ny = 0;
    int bad = moe_file_read_all(&x, &nx, a, (size_t)1 << 26) != MOE_OK ||
              moe_file_read_all(&y, &ny, b, (size_t)1 << 26) != MOE_OK;
    size_t at = 0;
    while (!bad && at < nx && at < ny && x[at] == y[at]) at++;
    if (!bad && (nx != ny || at < nx)) {
        printf("  %s differs from %s at byte %zu (sizes %zu and %zu)\n", b, a, at, ny, nx);
        bad = 1;
    } else if (bad) {
        printf("  cannot read %s or %s: %s\n", a, b, moe_last_error());
    }
    free(x);
    free(y);
    return bad;
}

/* One rank's checkpoint at tmp/one/step-000003, written by rank 0 alone. */
static int save_one_rank(char *path, size_t path_bytes) {
    int bad = 0;
    if (rank == 0) {
        run one;
        char out[512];
        snprintf(out, sizeof out, "%s/one", tmp);
        moe_status st = make_run(&one, NULL, (grid){1, 1, 0, 1}, B, SEED);
        const moe_train_state state = st == MOE_OK ? fill_state(&one) : (moe_train_state){0};
        if (st == MOE_OK) st = moe_checkpoint_save(path, path_bytes, out, one.model, one.trainer, &state);
        bad = mpi_fail_status(st, "one-rank save");
        free_run(&one);
    }
    MPI_Bcast(path, (int)path_bytes, MPI_CHAR, 0, MPI_COMM_WORLD);
    return bad;
}

static int test_files(grid g, const char *one_path) {
    run r;
    char out[512], path[512] = "";
    snprintf(out, sizeof out, "%s/pp%d-ep%d-zero%d", tmp, g.pp, g.ep, g.zero);
    moe_status st = make_run(&r, world, g, B, SEED);
    const moe_train_state state = st == MOE_OK ? fill_state(&r) : (moe_train_state){0};
    if (st == MOE_OK) st = moe_checkpoint_save(path, sizeof path, out, r.model, r.trainer, &state);
    int bad = mpi_fail_status(st, "grid save");
    free_run(&r);
    if (!bad && rank == 0) {
        const char *files[] = {"model.safetensors", "train_state.safetensors", "config.json"};
        for (int i = 0; i < 3; i++) {
            char a[768], b[768];
            snprintf(a, sizeof a, "%s/%s", one_path, files[i]);
            snprintf(b, sizeof b, "%s/%s", path, files[i]);
            bad |= same_file(a, b);
        }
    }
    return bad;
}

/* ------------------------------------------------------------------- load */

static int expect_bits(const float *got, const float *want, int64_t n, const char *what) {
    for (int64_t i = 0; i < n; i++)
        if (memcmp(&got[i], &want[i], sizeof(float)) != 0) {
            printf("  rank %d: %s[%lld] = %.9g, expected %.9g\n", rank, what, (long long)i, got[i], want[i]);
            return 1;
        }
    return 0;
}

static int test_load(grid g, const char *one_path) {
    run r = {0}, one = {0};
    moe_status st = make_run(&r, world, g, B, SEED + 1);
    if (st == MOE_OK) st = make_run(&one, NULL, (grid){1, 1, 0, 1}, B, SEED);
    if (st == MOE_OK) st = moe_checkpoint_load_weights(r.model, one_path);
    moe_train_state state;
    if (st == MOE_OK) st = moe_checkpoint_load_state(r.trainer, r.model, &state, one_path);
    int bad = mpi_fail_status(st, "grid load");
    if (!bad) fill_state(&one); /* the biases the file holds */
    for (int64_t i = 0; !bad && i < moe_model_tensor_count(r.model); i++) {
        const moe_model_tensor *t = moe_model_tensor_at(r.model, i);
        const moe_model_tensor *w = moe_model_find_tensor(one.model, t->name);
        bad = expect_bits(moe_model_params(r.model) + t->offset, moe_model_params(one.model) + w->offset, t->numel,
                          t->name);
        for (int k = 0; !bad && k < MOE_RUN_COUNT; k++) {
            const moe_optim_shard s = moe_trainer_shard(r.trainer, (moe_model_run_id)k);
            for (int64_t p = t->offset; !bad && p < t->offset + t->numel; p++)
                if (p >= s.begin && p < s.end) {
                    const float m = known(0, t->init_stream, p - t->offset);
                    const float v = known(1, t->init_stream, p - t->offset);
                    bad = expect_bits(&s.m[p - s.begin], &m, 1, "exp_avg") ||
                          expect_bits(&s.v[p - s.begin], &v, 1, "exp_avg_sq");
                }
        }
    }
    moe_model_config c;
    tiny_config(&c);
    int64_t layers;
    const int64_t *layer = moe_model_layer_ids(r.model, &layers);
    for (int64_t i = 0; !bad && i < layers; i++) {
        const float *got = moe_model_router_bias(r.model, layer[i]), *want = moe_model_router_bias(one.model, layer[i]);
        if ((got == NULL) != moe_model_config_layer_is_dense(&c, layer[i]) || (want == NULL) != (got == NULL)) {
            printf("  rank %d: layer %lld's bias %p, one rank's %p\n", rank, (long long)layer[i], (const void *)got,
                   (const void *)want);
            bad = 1;
        }
        if (!bad && got) bad = expect_bits(got, want, c.num_local_experts, "bias");
    }
    if (!bad && (moe_trainer_steps_done(r.trainer) != STATE_STEP || state.data.token != 123)) {
        printf("  rank %d: step %lld, data token %lld after load\n", rank, (long long)moe_trainer_steps_done(r.trainer),
               (long long)state.data.token);
        bad = 1;
    }
    free_run(&r);
    free_run(&one);
    return bad;
}

/* ----------------------------------------------------------------- resume */

/* Rows per data-parallel rank of g on n ranks that read the global batch
 * of the whole world. */
static int64_t rows_of(grid g, int n) { return (int64_t)size * B * g.pp / n; }

/* Trains to SAVE_AT on the ranks of comm (NULL: alone) and saves into out. */
static moe_status train_and_save(double *losses, char *path, size_t path_bytes, const char *out, moe_comm *comm,
                                 grid g, moe_data *data) {
    run r;
    const int n = comm ? moe_comm_size(comm) : 1;
    moe_status st = make_run(&r, comm, g, rows_of(g, n), SEED);
    if (st == MOE_OK) st = moe_data_set_position(data, (moe_data_position){0, 0});
    if (st == MOE_OK) st = mpi_train_steps(losses, NULL, r.trainer, data, 0, SAVE_AT);
    const moe_train_state state = {.step = SAVE_AT, .seed = SEED, .data = moe_data_get_position(data)};
    if (st == MOE_OK) st = moe_checkpoint_save(path, path_bytes, out, r.model, r.trainer, &state);
    free_run(&r);
    return st;
}

/* Loads path on the ranks of comm (NULL: alone) and trains to STEPS. */
static moe_status resume(double *losses, const char *path, moe_comm *comm, grid g, moe_data *data) {
    run r;
    const int n = comm ? moe_comm_size(comm) : 1;
    moe_train_state state;
    moe_status st = make_run(&r, comm, g, rows_of(g, n), SEED + 1);
    if (st == MOE_OK) st = moe_checkpoint_load_weights(r.model, path);
    if (st == MOE_OK) st = moe_checkpoint_load_state(r.trainer, r.model, &state, path);
    if (st == MOE_OK) st = moe_data_set_position(data, state.data);
    if (st == MOE_OK) st = mpi_train_steps(losses, NULL, r.trainer, data, SAVE_AT, STEPS);
    free_run(&r);
    return st;
}

typedef struct target {
    int ranks; /* a group of this many consecutive ranks, 1: each rank alone */
    grid g;
} target;

/* Resumes path on each of targets [n] and reports against want; bad: the
 * save failed on this rank (every target fails, on every rank). */
static void resume_on(const double *want, const char *path, const char *from, const target *targets, int n,
                      int bad, moe_data *data) {
    double got[STEPS];
    MPI_Allreduce(MPI_IN_PLACE, &bad, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    for (int i = 0; i < n; i++) {
        const target *tg = &targets[i];
        moe_comm *sub = NULL;
        int b = bad;
        if (!b && tg->ranks > 1 && tg->ranks < size)
            b = mpi_fail_status(moe_comm_split(&sub, world, rank / tg->ranks, rank), "split");
        moe_comm *comm = tg->ranks == size ? world : sub;
        if (!b) b = mpi_fail_status(resume(got, path, comm, tg->g, data), "resume");
        if (!b) b = mpi_compare_losses(got, want, SAVE_AT, STEPS, "after the resume");
        if (sub) moe_comm_free(sub);
        char into[40], what[200];
        grid_name(into, sizeof into, tg->g);
        snprintf(what, sizeof what, "saved at step %d %s, resumed on %d rank%s %s", SAVE_AT, from, tg->ranks,
                 tg->ranks > 1 ? "s" : "", into);
        report(b, what);
    }
}

static void test_resume(const double *want, moe_data *data) {
    const int half = size / 2;
    /* Data-parallel grids, pipelines of every rank and, with 4 ranks,
     * PP = 2 x DP = 2 with EP and ZeRO. */
    const grid saved[] = {{1, size >= 4 ? 2 : 1, 1, 1}, {size, 1, 0, 1}, {2, 1, 0, 2}, {2, 2, 1, 1}};
    const int n_saved = size >= 4 ? 4 : 3;
    const target targets[] = {{half, {1, 1, 0, 1}},    {half, {1, half, 1, 1}}, {size, {1, size, 0, 1}},
                              {1, {1, 1, 0, 1}},       {size, {size, 1, 1, 1}}, {size, {2, 1, 1, 2}},
                              {size, {2, 2, 1, 1}},    {half, {half, 1, 0, 1}}};
    const int n_targets = size >= 4 ? 8 : 6;
    double got[STEPS];
    char out[512], path[512], from[80], name[32];

    /* The whole world saves; halves of it, single ranks and other grids
     * resume. */
    for (int i = 0; i < n_saved; i++) {
        snprintf(out, sizeof out, "%s/resume-pp%d-ep%d-zero%d-chunks%d", tmp, saved[i].pp, saved[i].ep,
                 saved[i].zero, saved[i].chunks);
        int bad = mpi_fail_status(train_and_save(got, path, sizeof path, out, world, saved[i], data), "save");
        bad = bad || mpi_compare_losses(got, want, 0, SAVE_AT, "before the save");
        grid_name(name, sizeof name, saved[i]);
        snprintf(from, sizeof from, "on %d ranks %s", size, name);
        resume_on(want, path, from, targets, n_targets, bad, data);
    }

    /* One rank saves; the whole world resumes on its grids. */
    snprintf(out, sizeof out, "%s/resume-one", tmp);
    int bad = rank == 0 ? mpi_fail_status(train_and_save(got, path, sizeof path, out, NULL, (grid){1, 1, 0, 1}, data),
                                          "save")
                        : 0;
    bad = bad || (rank == 0 && mpi_compare_losses(got, want, 0, SAVE_AT, "before the save"));
    MPI_Bcast(path, sizeof path, MPI_CHAR, 0, MPI_COMM_WORLD);
    const target into[] = {{size, {1, 2, 1, 1}}, {size, {size, 1, 0, 1}}, {size, {2, 1, 0, 2}}, {size, {2, 2, 1, 1}}};
    resume_on(want, path, "on 1 rank", into, size >= 4 ? 4 : 3, bad, data);
}

/* ----------------------------------------------------------------- errors */

static int copy_file(const char *to, const char *from) {
    char *text = NULL;
    size_t n = 0;
    int bad = moe_file_read_all(&text, &n, from, (size_t)1 << 26) != MOE_OK;
    FILE *f = bad ? NULL : fopen(to, "wb");
    bad = bad || !f || fwrite(text, 1, n, f) != n;
    if (f) bad |= fclose(f) != 0;
    free(text);
    return bad;
}

/* Rewrites the safetensors file from at to, without the tensor name (also
 * NULL) or with its values under the name also as well. */
static int copy_tensors(const char *to, const char *from, const char *name, const char *also) {
    moe_st_file *f = NULL;
    if (moe_st_open(&f, from) != MOE_OK) return 1;
    const int64_t n = moe_st_tensor_count(f), n_meta = moe_st_metadata_count(f);
    moe_st_entry *entries = calloc((size_t)n + 1, sizeof *entries);
    moe_st_meta *meta = calloc((size_t)n_meta, sizeof *meta);
    int64_t kept = 0, kept_meta = 0;
    for (int64_t j = 0; j < n; j++) {
        const moe_st_tensor *t = moe_st_tensor_at(f, j);
        const bool named = strcmp(t->name, name) == 0;
        if (named && !also) continue;
        float *data = malloc((size_t)t->numel * sizeof *data);
        moe_st_read_f32(data, t);
        entries[kept++] = (moe_st_entry){t->name, data, t->ndim, t->shape};
        if (named) {
            float *copy = malloc((size_t)t->numel * sizeof *copy);
            memcpy(copy, data, (size_t)t->numel * sizeof *copy);
            entries[kept++] = (moe_st_entry){also, copy, t->ndim, t->shape};
        }
    }
    for (int64_t j = 0; j < n_meta; j++) {
        moe_st_metadata_at(f, j, &meta[kept_meta].key, &meta[kept_meta].value);
        if (!moe_st_reserved_key(meta[kept_meta].key)) kept_meta++; /* the writer's own */
    }
    int bad = kept != (also ? n + 1 : n - 1) || moe_st_write(to, entries, kept, meta, kept_meta) != MOE_OK;
    for (int64_t j = 0; j < kept; j++) free((void *)entries[j].data);
    free(entries);
    free(meta);
    moe_st_close(f);
    return bad;
}

/* The checkpoint at src copied to dst, file changed as copy_tensors
 * changes it. Rank 0 only. */
static int copy_changed(const char *dst, const char *src, const char *file, const char *name, const char *also) {
    const char *files[] = {"model.safetensors", "train_state.safetensors", "config.json"};
    char from[768], to[768];
    int bad = moe_mkdir_p(dst) != MOE_OK;
    for (int i = 0; !bad && i < 3; i++) {
        snprintf(from, sizeof from, "%s/%s", src, files[i]);
        snprintf(to, sizeof to, "%s/%s", dst, files[i]);
        bad = strcmp(files[i], file) == 0 ? copy_tensors(to, from, name, also) : copy_file(to, from);
    }
    return bad;
}

/* Every rank failed with the same status; those but `from` name it. */
static int expect_shared_failure(moe_status st, int from, const char *detail, const char *what) {
    char rank_tag[32];
    snprintf(rank_tag, sizeof rank_tag, "rank %d: ", from);
    if (st == MOE_OK || !strstr(moe_last_error(), detail) || (rank != from && !strstr(moe_last_error(), rank_tag))) {
        printf("  rank %d: %s: %s, \"%s\"; expected a failure of rank %d about %s\n", rank, what, moe_status_string(st),
               moe_last_error(), from, detail);
        return 1;
    }
    return 0;
}

/* Loading the weights of dir/weights and the state of dir/state into r,
 * each broken for the last rank only (by the tensors weight and moment),
 * fails on every rank, names that rank and changes nothing. */
static int expect_failed_loads(run *r, const char *dir, const char *weight, const char *moment) {
    char path[600];
    const int64_t n = moe_model_param_count(r->model);
    float *before = malloc((size_t)n * sizeof *before);
    memcpy(before, moe_model_params(r->model), (size_t)n * sizeof *before);
    moe_train_state state;
    snprintf(path, sizeof path, "%s/weights", dir);
    int bad = expect_shared_failure(moe_checkpoint_load_weights(r->model, path), size - 1, weight, "weights");
    bad |= expect_bits(moe_model_params(r->model), before, n, "parameters after a failed load");
    snprintf(path, sizeof path, "%s/state", dir);
    bad |= expect_shared_failure(moe_checkpoint_load_state(r->trainer, r->model, &state, path), size - 1, moment,
                                 "state");
    bad |= moe_trainer_steps_done(r->trainer) != 0;
    for (int k = 0; k < MOE_RUN_COUNT; k++) {
        const moe_optim_shard s = moe_trainer_shard(r->trainer, (moe_model_run_id)k);
        for (int64_t i = 0; i < s.end - s.begin; i++) bad |= s.m[i] != 0.0f || s.v[i] != 0.0f;
    }
    free(before);
    return bad;
}

/* Rank 0 writes dir/weights and dir/state: one_path's checkpoint without
 * (also NULL) or with a copy of (under also_*) the tensors weight and
 * moment. */
static int write_broken(const char *dir, const char *one_path, const char *weight, const char *also_weight,
                        const char *moment, const char *also_moment) {
    char w[600], s[600];
    snprintf(w, sizeof w, "%s/weights", dir);
    snprintf(s, sizeof s, "%s/state", dir);
    int bad = rank == 0 && (copy_changed(w, one_path, "model.safetensors", weight, also_weight) ||
                            copy_changed(s, one_path, "train_state.safetensors", moment, also_moment));
    MPI_Bcast(&bad, 1, MPI_INT, 0, MPI_COMM_WORLD);
    if (bad && rank == 0) printf("  cannot write the broken checkpoints in %s\n", dir);
    return bad;
}

/* One rank's checkpoint at one_path, copied to tmp/name with weight and
 * moment left out (also_weight, also_moment added, unless NULL), fails to
 * load into r, a run made on grid g, on every rank, naming the missing or
 * unknown tensors (want_weight, want_moment); 1 after printing otherwise. */
static int broken_load_fails(run *r, const char *name, grid g, const char *one_path, const char *weight,
                             const char *also_weight, const char *moment, const char *also_moment,
                             const char *want_weight, const char *want_moment) {
    char dir[512];
    snprintf(dir, sizeof dir, "%s/%s", tmp, name);
    int bad = write_broken(dir, one_path, weight, also_weight, moment, also_moment);
    if (!bad) bad = mpi_fail_status(make_run(r, world, g, B, SEED + 1), name);
    if (!bad) bad = expect_failed_loads(r, dir, want_weight, want_moment);
    return bad;
}

static void test_errors(const char *one_path) {
    /* The last rank of EP = size holds expert 3; only it misses its tensors. */
    const char *weight = "model.layers.1.block_sparse_moe.experts.3.w2.weight";
    const char *moment = "optimizer.exp_avg.model.layers.0.block_sparse_moe.experts.3.w1.weight";
    run r = {0};
    int bad = broken_load_fails(&r, "missing", (grid){1, size, 1, 1}, one_path, weight, NULL, moment, NULL, weight, moment);
    report(bad, "a load failing on the last rank only fails everywhere and changes nothing");

    /* Layer 3 is the last stage's: the others take its tensors for another
     * stage's, and the last one knows these two are no tensors of its. */
    const char *q = "model.layers.3.self_attn.q_proj.weight";
    const char *q_moment = "optimizer.exp_avg.model.layers.3.self_attn.q_proj.weight";
    const char *extra = "model.layers.3.self_attn.q_proj.bias";
    const char *extra_moment = "optimizer.exp_avg.model.layers.3.self_attn.q_proj.bias";
    run pp = {0};
    int b = broken_load_fails(&pp, "unknown", (grid){size, 1, 0, 1}, one_path, q, extra, q_moment, extra_moment, extra,
                              extra_moment);
    free_run(&pp);
    report(b, "on a pipeline, a tensor of no stage fails the load on the stage of its layer, everywhere");

    /* Rank 0 cannot create the directory; the others learn it. */
    char blocker[512], out[600], path[600];
    snprintf(blocker, sizeof blocker, "%s/not-a-directory", tmp);
    snprintf(out, sizeof out, "%s/sub", blocker);
    if (rank == 0) {
        FILE *f = fopen(blocker, "w");
        if (f) fclose(f);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    b = bad;
    if (!b) {
        moe_trainer_set_steps_done(r.trainer, 0);
        const moe_train_state state = {.step = 0, .seed = SEED};
        b = expect_shared_failure(moe_checkpoint_save(path, sizeof path, out, r.model, r.trainer, &state), 0, blocker,
                                  "save");
    }
    report(b, "a save failing on rank 0 fails everywhere");
    free_run(&r);
}

/* ------------------------------------------------------------------- main */

static int remove_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb, (void)flag, (void)ftw;
    return remove(path);
}

int main(void) {
    if (!mpi_check_init()) return 1;
    if (rank == 0) {
        snprintf(tmp, sizeof tmp, "/tmp/moe_ckpt_grid_XXXXXX");
        if (!mkdtemp(tmp)) tmp[0] = '\0';
    }
    MPI_Bcast(tmp, sizeof tmp, MPI_CHAR, 0, MPI_COMM_WORLD);
    if (!tmp[0]) {
        fprintf(stderr, "mkdtemp failed\n");
        return 1;
    }
    int32_t *tokens = NULL;
    moe_data *data = mpi_token_stream(&tokens, VOCAB);
    if (!data) return 1;
    char one_path[512] = "", what[160], name[32];

    report(save_one_rank(one_path, sizeof one_path), "one-rank checkpoint written");
    /* Data-parallel grids, a pipeline of every rank, an interleaved one of
     * two stages, and with 4 ranks EP = 4, a pipeline of two stages and
     * PP = 2 x DP = 2 with EP and ZeRO, interleaved or not. */
    const grid grids[] = {{1, 1, 0, 1}, {1, 1, 1, 1}, {1, 2, 0, 1},  {1, 2, 1, 1},    {size, 1, 0, 1},
                          {2, 1, 0, 2}, {1, size, 1, 1}, {2, 1, 0, 1}, {2, 2, 1, 1}, {2, 2, 1, 2}};
    const int n_grids = size > 2 ? 10 : 6;
    for (int g = 0; g < n_grids; g++) {
        grid_name(name, sizeof name, grids[g]);
        snprintf(what, sizeof what, "%s writes one rank's bytes", name);
        report(test_files(grids[g], one_path), what);
        snprintf(what, sizeof what, "%s loads one rank's checkpoint bit for bit", name);
        report(test_load(grids[g], one_path), what);
    }

    /* The unbroken one-rank run, on every rank. */
    double want[STEPS];
    run one;
    int bad = mpi_fail_status(make_run(&one, NULL, (grid){1, 1, 0, 1}, (int64_t)size * B, SEED), "one rank");
    if (!bad) bad = mpi_fail_status(moe_data_set_position(data, (moe_data_position){0, 0}), "data");
    if (!bad) bad = mpi_fail_status(mpi_train_steps(want, NULL, one.trainer, data, 0, STEPS), "one rank");
    if (!bad) bad = mpi_loss_did_not_fall(want, STEPS);
    free_run(&one);
    report(bad, "unbroken one-rank run");
    if (!bad) test_resume(want, data);
    test_errors(one_path);

    MPI_Barrier(MPI_COMM_WORLD);
    if (rank == 0) nftw(tmp, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
    moe_data_close(data);
    free(tokens);
    return mpi_check_finish();
}
