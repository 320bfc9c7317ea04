/* test_train_run.c: whole runs through moe_run (engine/run.h) on tiny
 * models: the loss falls on the synthetic corpus and the per-kind report
 * adds up; a resumed run matches an uninterrupted one bit for bit;
 * --eval-only reproduces the training run's final evaluation exactly; llm.c
 * shards and byte-level files train; bad options fail naming the flag.
 *
 * Every run uses 2 threads (bitwise results hold for a fixed count) and a
 * given --peak-gflops, so no time goes to measuring sgemm. */
#define _XOPEN_SOURCE 700
#include <criterion/criterion.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "engine/corpus.h"
#include "engine/data.h"
#include "engine/fileio.h"
#include "engine/json.h"
#include "engine/run.h"
#include "engine/safetensors.h"

#define THREADS 2

/* ------------------------------------------------------------ fixtures */

static char tmp_dir[64];

static void make_tmp(void) {
    strcpy(tmp_dir, "/tmp/moe-run-XXXXXX");
    cr_assert(mkdtemp(tmp_dir), "mkdtemp failed");
}

static int remove_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb, (void)flag, (void)ftw;
    return remove(path);
}

static void remove_tmp(void) { nftw(tmp_dir, remove_entry, 16, FTW_DEPTH | FTW_PHYS); }

static const char *tmp_path(char *buf, const char *name) {
    snprintf(buf, 512, "%s/%s", tmp_dir, name);
    return buf;
}

/* A model small enough for a step in milliseconds, with jitter noise on so
 * that resuming must restore its counter too. */
static const char *write_tiny_config(char *path, int64_t vocab) {
    moe_model_config c;
    moe_model_config_default_small(&c, vocab);
    c.hidden_size = 32;
    c.intermediate_size = 32;
    c.num_hidden_layers = 2;
    c.num_attention_heads = 4;
    c.num_key_value_heads = 2;
    c.head_dim = 8;
    c.num_local_experts = 4;
    c.num_experts_per_tok = 2;
    c.router_jitter_noise = 0.01;
    tmp_path(path, "tiny.json");
    cr_assert_eq(moe_model_config_save(&c, path), MOE_OK, "%s", moe_last_error());
    return path;
}

static moe_run_options tiny_options(const char *config, const char *out) {
    moe_run_options o;
    moe_run_options_init(&o);
    o.config = config;
    o.out_dir = out;
    o.batch_size = 4;
    o.seq_len = 32;
    o.steps = 10;
    o.lr = 1e-2;
    o.min_lr = 1e-3;
    o.warmup = 2;
    o.eval_every = 0;
    o.eval_batches = 2;
    o.threads = THREADS;
    o.peak_gflops = 10.0;
    return o;
}

/* What the callbacks saw. */
typedef struct seen {
    int starts, steps, evals, checkpoints, ends, warnings;
    double first_val, last_val, end_val, floor;
    double last_lr; /* the last step's learning rate */
    int64_t last_step;
    int64_t saved_step;         /* of the last checkpoint */
    int64_t saved_at_last_eval; /* saved_step when the last evaluation came */
    char checkpoint[512];
    char warning[1024];
    bool kinds_ok;
    moe_run_kind_report kinds;
    double routing_sum_err; /* worst |row sum - 1| of the routing tables */
    double routing_uniform_err; /* worst |share - 1/n_experts| of the routing tables */
    int64_t uniform_worst[3];   /* where: layer, kind, expert */
    int64_t mc_examples, mc_correct; /* the last evaluation's --eval-mc */
    int64_t vocab_size, tokenizer_tokens; /* the start's */
} seen;

static void on_start(void *ctx, const moe_run_summary *s) {
    seen *v = ctx;
    v->starts++;
    v->floor = s->entropy_floor;
    v->last_step = s->start_step;
    v->vocab_size = s->config->vocab_size;
    v->tokenizer_tokens = s->tokenizer_tokens;
    /* Every parameter is active in a model without an MoE layer. */
    const bool routes = moe_model_config_has_moe_layer(s->config);
    cr_expect((routes ? s->params > s->active_params : s->params == s->active_params) && s->active_params > 0,
              "params %lld, active %lld", (long long)s->params, (long long)s->active_params);
    cr_expect(s->step_flops > 0.0 && s->peak_gflops == 10.0, "step_flops %g, peak %g", s->step_flops,
              s->peak_gflops);
}

static void on_step(void *ctx, const moe_run_step *s) {
    seen *v = ctx;
    v->steps++;
    cr_expect_eq(s->metrics.step, v->last_step + 1, "steps out of order: %lld after %lld",
                 (long long)s->metrics.step, (long long)v->last_step);
    v->last_step = s->metrics.step;
    v->last_lr = s->metrics.lr;
    cr_expect(isfinite(s->metrics.loss) && s->tokens_per_s > 0.0 && s->mfu > 0.0, "step %lld: loss %g, tok/s %g",
              (long long)s->metrics.step, s->metrics.loss, s->tokens_per_s);
}

static void on_eval(void *ctx, const moe_run_eval *e) {
    seen *v = ctx;
    if (v->evals++ == 0) v->first_val = e->val_loss;
    v->last_val = e->val_loss;
    v->saved_at_last_eval = v->saved_step;
    v->mc_examples = e->mc_examples;
    v->mc_correct = e->mc_correct;
}

static void on_checkpoint(void *ctx, int64_t step, const char *path) {
    seen *v = ctx;
    v->saved_step = step;
    v->checkpoints++;
    snprintf(v->checkpoint, sizeof v->checkpoint, "%s", path);
}

static void on_end(void *ctx, const moe_run_end *e) {
    seen *v = ctx;
    v->ends++;
    v->end_val = e->val_loss;
    v->kinds_ok = e->kinds != NULL;
    if (!e->kinds) return;
    v->kinds = *e->kinds;
    v->kinds.routing = NULL; /* valid only during the call */
    const moe_run_kind_report *r = e->kinds;
    for (int64_t l = 0; l <= r->n_layers; l++)
        for (int k = 0; k < MOE_SYNTH_KIND_COUNT; k++) {
            if (r->tokens[k] == 0) continue;
            double sum = 0.0;
            for (int64_t x = 0; x < r->n_experts; x++) {
                const double share = moe_run_routing_at(r, l, k, x), err = fabs(share - 1.0 / (double)r->n_experts);
                sum += share;
                if (err > v->routing_uniform_err) {
                    v->routing_uniform_err = err;
                    memcpy(v->uniform_worst, (int64_t[3]){l, k, x}, sizeof v->uniform_worst);
                }
            }
            v->routing_sum_err = fmax(v->routing_sum_err, fabs(sum - 1.0));
        }
}

static void on_warning(void *ctx, const char *message) {
    seen *v = ctx;
    v->warnings++;
    snprintf(v->warning, sizeof v->warning, "%s", message);
}

static moe_run_callbacks callbacks(seen *v) {
    *v = (seen){.first_val = NAN, .last_val = NAN, .end_val = NAN};
    return (moe_run_callbacks){.ctx = v, .on_start = on_start, .on_step = on_step, .on_eval = on_eval,
                               .on_checkpoint = on_checkpoint, .on_end = on_end, .on_warning = on_warning};
}

/* moe_run succeeds; the callbacks' counts are v's. */
static void run_ok_or_done(const moe_run_options *o, seen *v) {
    moe_run_callbacks cb = callbacks(v);
    cr_assert_eq(moe_run(o, &cb), MOE_OK, "moe_run: %s", moe_last_error());
}

static void run_ok(const moe_run_options *o, seen *v) {
    moe_run_callbacks cb = callbacks(v);
    cr_assert_eq(moe_run(o, &cb), MOE_OK, "moe_run: %s", moe_last_error());
    cr_assert_eq(v->starts, 1);
    cr_assert_eq(v->ends, 1);
}

static char *read_file(const char *path, size_t *size) {
    char *data;
    cr_assert_eq(moe_file_read_all(&data, size, path, (size_t)1 << 30), MOE_OK, "%s", moe_last_error());
    return data;
}

/* ------------------------------------------------------------- training */

Test(train_run, synthetic_loss_falls, .init = make_tmp, .fini = remove_tmp) {
    char cfg[512], out[512];
    moe_run_options o = tiny_options(write_tiny_config(cfg, MOE_SYNTH_VOCAB_SIZE), tmp_path(out, "out"));
    o.steps = 40;
    o.eval_every = 1; /* the first evaluation sees the nearly untrained model */
    seen v;
    run_ok(&o, &v);
    cr_assert_eq(v.steps, 40);
    cr_assert_eq(v.evals, 40);
    cr_assert_eq(v.checkpoints, 1, "only the last step is saved without --save-every");
    cr_expect(v.last_val < 0.8 * v.first_val, "val loss %.4f -> %.4f: did not fall by 20%%", v.first_val, v.last_val);
    cr_expect(v.end_val == v.last_val, "on_end val %.9g, last eval %.9g", v.end_val, v.last_val);
    /* The floor is a true lower bound up to sampling noise on 256 targets. */
    cr_expect(v.floor > 1.0 && v.last_val > 0.9 * v.floor, "floor %.4f, val %.4f", v.floor, v.last_val);

    /* The per-kind report covers every validation target once, and its
     * token-weighted means give back the overall loss and floor. */
    cr_assert(v.kinds_ok, "no per-kind report for synthetic data");
    int64_t tokens = 0;
    double loss = 0.0, floor = 0.0;
    for (int k = 0; k < MOE_SYNTH_KIND_COUNT; k++) {
        tokens += v.kinds.tokens[k];
        loss += v.kinds.loss[k] * (double)v.kinds.tokens[k];
        floor += v.kinds.floor[k] * (double)v.kinds.tokens[k];
    }
    const int64_t want = o.eval_batches * o.batch_size * o.seq_len;
    cr_expect_eq(tokens, want, "per-kind tokens %lld, want %lld", (long long)tokens, (long long)want);
    cr_expect(fabs(loss / (double)want - v.end_val) <= 1e-6 * v.end_val, "per-kind loss mean %.9g, val %.9g",
              loss / (double)want, v.end_val);
    cr_expect(fabs(floor / (double)want - v.floor) <= 1e-9 * v.floor, "per-kind floor mean %.12g, floor %.12g",
              floor / (double)want, v.floor);
    cr_expect(v.kinds.n_layers == 2 && v.kinds.n_experts == 4 && v.kinds.top_k == 2);
    cr_expect(v.routing_sum_err < 1e-12, "a routing row sums to 1 %+g", v.routing_sum_err);
    /* The greedy answers of one dropless process: what its stream holds. */
    const moe_synth_task_score *t = &v.kinds.tasks;
    cr_expect(v.kinds.tasks_measured && t->tried[MOE_SYNTH_TASK_SUM] > 0 &&
                  t->solved[MOE_SYNTH_TASK_SUM] <= t->tried[MOE_SYNTH_TASK_SUM] &&
                  t->solved[MOE_SYNTH_TASK_COPY] <= t->tried[MOE_SYNTH_TASK_COPY],
              "greedy answers: measured %d, sums %lld/%lld, copies %lld/%lld", v.kinds.tasks_measured,
              (long long)t->solved[MOE_SYNTH_TASK_SUM], (long long)t->tried[MOE_SYNTH_TASK_SUM],
              (long long)t->solved[MOE_SYNTH_TASK_COPY], (long long)t->tried[MOE_SYNTH_TASK_COPY]);

    /* metrics.jsonl: one line per step with every key, one per evaluation. */
    char path[512];
    size_t size;
    char *text = read_file(tmp_path(path, "out/metrics.jsonl"), &size);
    static const char *const step_keys[] = {"step",      "loss",         "logit_z_loss", "aux_loss",
                                            "seq_aux_loss", "z_loss",    "lr",           "grad_norm",
                                            "tokens_per_s", "mfu",       "load_imbalance", "dropped_frac"};
    int step_lines = 0, eval_lines = 0;
    for (char *line = strtok(text, "\n"); line; line = strtok(NULL, "\n")) {
        moe_json_doc *doc;
        cr_assert_eq(moe_json_parse(&doc, line, strlen(line), "metrics.jsonl"), MOE_OK, "%s", moe_last_error());
        const moe_json *root = moe_json_root(doc);
        if (moe_json_get(root, "val_loss")) {
            eval_lines++;
            cr_expect(moe_json_get(root, "entropy_floor") != NULL, "eval line without entropy_floor: %s", line);
        } else {
            step_lines++;
            for (size_t k = 0; k < sizeof step_keys / sizeof *step_keys; k++)
                cr_expect(moe_json_get(root, step_keys[k]) != NULL, "no %s in %s", step_keys[k], line);
            /* A rank is an index: an integer, not a real. */
            const moe_json *slowest = moe_json_get(root, "slowest_rank");
            cr_expect(slowest && slowest->type == MOE_JSON_NUMBER && strcmp(slowest->number.text, "0") == 0,
                      "slowest_rank in %s", line);
            /* A row per layer of every expert's kept pairs: with no
             * capacity limit, the step's batch times top_k each. */
            const moe_json *load = moe_json_get(root, "expert_load");
            cr_assert(load && load->type == MOE_JSON_ARRAY && load->array.count == 2, "expert_load in %s", line);
            for (size_t l = 0; l < 2; l++) {
                const moe_json *row = &load->array.items[l];
                cr_assert(row->type == MOE_JSON_ARRAY && row->array.count == 4, "expert_load row %zu in %s", l, line);
                double pairs = 0.0;
                for (size_t e = 0; e < 4; e++) pairs += row->array.items[e].number.value;
                cr_expect(pairs == 4.0 * 32.0 * 2.0, "layer %zu: %g pairs kept in %s", l, pairs, line);
            }
        }
        moe_json_free(doc);
    }
    free(text);
    cr_expect_eq(step_lines, 40);
    cr_expect_eq(eval_lines, 40);

    /* run.json: the config, the options and the floor. */
    text = read_file(tmp_path(path, "out/run.json"), &size);
    moe_json_doc *doc;
    cr_assert_eq(moe_json_parse(&doc, text, size, "run.json"), MOE_OK, "%s", moe_last_error());
    const moe_json *root = moe_json_root(doc);
    const moe_json *f = moe_json_get(root, "entropy_floor");
    cr_expect(f && f->type == MOE_JSON_NUMBER && f->number.value == v.floor, "run.json entropy_floor");
    const moe_json *hidden = moe_json_get(moe_json_get(root, "config"), "hidden_size");
    cr_expect(hidden && hidden->type == MOE_JSON_NUMBER && hidden->number.value == 32, "run.json config");
    const moe_json *steps = moe_json_get(moe_json_get(root, "options"), "steps");
    cr_expect(steps && steps->type == MOE_JSON_NUMBER && steps->number.value == 40, "run.json options");
    moe_json_free(doc);
    free(text);
}

/* With top_k = num_local_experts the router sends every token to every
 * expert, so each row of the routing report, every layer's and the sum
 * over layers, is exactly 1/E for every kind: what the report must show
 * whatever the weights. */
Test(train_run, routing_report_when_every_token_takes_every_expert, .init = make_tmp, .fini = remove_tmp) {
    char cfg[512], out[512];
    moe_model_config c;
    cr_assert_eq(moe_model_config_load(&c, write_tiny_config(cfg, MOE_SYNTH_VOCAB_SIZE), NULL, NULL), MOE_OK, "%s",
                 moe_last_error());
    c.num_experts_per_tok = c.num_local_experts;
    cr_assert_eq(moe_model_config_save(&c, cfg), MOE_OK, "%s", moe_last_error());
    moe_run_options o = tiny_options(cfg, tmp_path(out, "out"));
    o.steps = 2;
    seen v;
    moe_run_callbacks cb = callbacks(&v);
    cb.on_start = NULL; /* its params > active_params does not hold: every parameter is active */
    cr_assert_eq(moe_run(&o, &cb), MOE_OK, "moe_run: %s", moe_last_error());
    cr_assert(v.kinds_ok, "no per-kind report for synthetic data");
    cr_assert(v.kinds.n_layers == 2 && v.kinds.n_experts == 4 && v.kinds.top_k == 4, "report of %lld layers, %lld "
              "experts, top_k %lld", (long long)v.kinds.n_layers, (long long)v.kinds.n_experts,
              (long long)v.kinds.top_k);
    int kinds_seen = 0;
    for (int k = 0; k < MOE_SYNTH_KIND_COUNT; k++) kinds_seen += v.kinds.tokens[k] > 0;
    cr_assert(kinds_seen >= 2, "only %d kinds in the validation targets", kinds_seen);
    cr_expect(v.routing_uniform_err == 0.0, "layer block %lld, kind %lld, expert %lld: share off 1/4 by %g",
              (long long)v.uniform_worst[0], (long long)v.uniform_worst[1], (long long)v.uniform_worst[2],
              v.routing_uniform_err);
}

static bool same_file(const char *a, const char *b) {
    size_t na, nb;
    char *da = read_file(a, &na), *db = read_file(b, &nb);
    bool same = na == nb && memcmp(da, db, na) == 0;
    free(da);
    free(db);
    return same;
}

/* 10 straight steps against the same run's checkpoint at step 5 resumed for
 * 5 more: the weights and the optimizer state must match bit for bit.
 * Shuffled data and jitter noise make the data position and the jitter
 * counter matter. */
Test(train_run, resume_is_bitwise_identical, .init = make_tmp, .fini = remove_tmp) {
    char cfg[512], out_a[512], out_b[512], out_c[512], path_a[512], path_c[512];
    write_tiny_config(cfg, MOE_SYNTH_VOCAB_SIZE);
    moe_run_options o = tiny_options(cfg, tmp_path(out_a, "a"));
    o.shuffle = true;
    o.eval_every = 3; /* evaluations in between must not disturb training */
    seen v;
    run_ok(&o, &v);

    o.out_dir = tmp_path(out_b, "b");
    o.save_every = 5;
    run_ok(&o, &v);
    cr_assert_eq(v.checkpoints, 2);

    char resume[512];
    tmp_path(resume, "b/step-000005");
    o.out_dir = tmp_path(out_c, "c");
    o.save_every = 0;
    o.config = NULL;
    o.resume = resume;
    run_ok(&o, &v);
    cr_assert_eq(v.steps, 5, "resumed run took %d steps, want 5", v.steps);
    cr_assert_eq(v.last_step, 10);

    for (int i = 0; i < 2; i++) {
        const char *name = i ? "train_state.safetensors" : "model.safetensors";
        char name_a[64], name_c[64];
        snprintf(name_a, sizeof name_a, "a/step-000010/%s", name);
        snprintf(name_c, sizeof name_c, "c/step-000010/%s", name);
        tmp_path(path_a, name_a);
        tmp_path(path_c, name_c);
        cr_expect(same_file(path_a, path_c), "%s differs between 10 steps and 5 + resume + 5", name);
    }

    /* The seed picked the data and the noise: another one cannot resume. */
    o.seed += 1;
    o.overwrite = true; /* c holds the resumed run */
    moe_run_callbacks cb = callbacks(&v);
    cr_assert_neq(moe_run(&o, &cb), MOE_OK);
    cr_expect(strstr(moe_last_error(), "--seed") != NULL, "message: %s", moe_last_error());
}

/* The whole run on memory the host may touch only inside an op (--device
 * cpu-strict): training, evaluation, checkpoints and a resume all go
 * through the op table as a GPU needs, and give the CPU run's bytes. */
Test(train_run, strict_device_gives_the_cpu_bytes, .init = make_tmp, .fini = remove_tmp) {
    char cfg[512], out[3][512], a[512], b[512];
    write_tiny_config(cfg, MOE_SYNTH_VOCAB_SIZE);
    moe_run_options o = tiny_options(cfg, tmp_path(out[0], "cpu"));
    o.shuffle = true;
    o.eval_every = 5;
    o.save_every = 5;
    o.device = MOE_DEVICE_CPU;
    seen cpu, strict;
    run_ok(&o, &cpu);
    o.device = MOE_DEVICE_STRICT;
    o.out_dir = tmp_path(out[1], "strict");
    run_ok(&o, &strict);
    cr_expect(strict.end_val == cpu.end_val, "val_loss %.9g on cpu-strict, %.9g on cpu", strict.end_val, cpu.end_val);

    char resume[512];
    o.out_dir = tmp_path(out[2], "resumed");
    o.config = NULL;
    o.resume = tmp_path(resume, "strict/step-000005");
    run_ok(&o, &strict);
    cr_assert_eq(strict.steps, 5, "resumed run took %d steps, want 5", strict.steps);
    static const char *const runs[] = {"strict", "resumed"};
    static const char *const files[] = {"model.safetensors", "train_state.safetensors"};
    for (int r = 0; r < 2; r++)
        for (int f = 0; f < 2; f++) {
            char name_a[96], name_b[96];
            snprintf(name_a, sizeof name_a, "cpu/step-000010/%s", files[f]);
            snprintf(name_b, sizeof name_b, "%s/step-000010/%s", runs[r], files[f]);
            cr_expect(same_file(tmp_path(a, name_a), tmp_path(b, name_b)), "%s of the %s run differs from the cpu run's",
                      files[f], runs[r]);
        }
}

/* --recompute: the same checkpoints, evaluations and end-of-run report
 * (the greedy tasks, generated by a forward per token, as such a model
 * keeps no keys to decode against). */
Test(train_run, recompute_gives_the_same_bytes, .init = make_tmp, .fini = remove_tmp) {
    char cfg[512], out[2][512], a[512], b[512];
    write_tiny_config(cfg, MOE_SYNTH_VOCAB_SIZE);
    moe_run_options o = tiny_options(cfg, tmp_path(out[0], "kept"));
    o.eval_every = 5;
    seen kept, recomputed;
    run_ok(&o, &kept);
    o.recompute = true;
    o.out_dir = tmp_path(out[1], "recomputed");
    run_ok(&o, &recomputed);
    cr_expect(recomputed.end_val == kept.end_val, "val_loss %.9g recomputed, %.9g kept", recomputed.end_val,
              kept.end_val);
    cr_expect(recomputed.kinds.tasks_measured && kept.kinds.tasks_measured, "the greedy tasks were not solved");
    for (int t = 0; recomputed.kinds.tasks_measured && t < MOE_SYNTH_TASK_COUNT; t++)
        cr_expect(recomputed.kinds.tasks.solved[t] == kept.kinds.tasks.solved[t], "task %d: %lld solved recomputed, "
                  "%lld kept", t, (long long)recomputed.kinds.tasks.solved[t], (long long)kept.kinds.tasks.solved[t]);
    static const char *const files[] = {"model.safetensors", "train_state.safetensors"};
    for (int f = 0; f < 2; f++) {
        char name_a[96], name_b[96];
        snprintf(name_a, sizeof name_a, "kept/step-000010/%s", files[f]);
        snprintf(name_b, sizeof name_b, "recomputed/step-000010/%s", files[f]);
        cr_expect(same_file(tmp_path(a, name_a), tmp_path(b, name_b)), "%s differs when recomputed", files[f]);
    }
}

/* What on_end reported of the profile. */
typedef struct profile_seen {
    seen base;
    int64_t ops, steps, experts_forward, experts_backward;
    double seconds, op_seconds;
} profile_seen;

static void on_profile_end(void *ctx, const moe_run_end *e) {
    profile_seen *p = ctx;
    on_end(&p->base, e);
    cr_assert(e->profile, "no profile with --profile");
    p->ops = e->profile_ops, p->steps = e->profile_steps, p->seconds = e->profile_seconds;
    for (int64_t i = 0; i < e->profile_ops; i++) {
        p->op_seconds += e->profile[i].seconds;
        if (strcmp(e->profile[i].op, "experts_forward") == 0) p->experts_forward = e->profile[i].calls;
        if (strcmp(e->profile[i].op, "experts_backward") == 0) p->experts_backward = e->profile[i].calls;
    }
}

/* --profile times the steps after the first and nothing else (the
 * evaluations and checkpoints between them are left out), and changes no
 * result. */
Test(train_run, profile_times_the_steps_after_the_first, .init = make_tmp, .fini = remove_tmp) {
    char cfg[512], out[2][512];
    moe_run_options o = tiny_options(write_tiny_config(cfg, MOE_SYNTH_VOCAB_SIZE), tmp_path(out[0], "plain"));
    o.steps = 4;
    o.eval_every = 2;
    o.save_every = 2;
    o.grad_accum = 2;
    seen plain;
    run_ok(&o, &plain);
    o.profile = true;
    o.out_dir = tmp_path(out[1], "profiled");
    profile_seen p = {0};
    (void)callbacks(&p.base); /* its fields' starting values */
    const moe_run_callbacks cb = {.ctx = &p, .on_end = on_profile_end};
    cr_assert_eq(moe_run(&o, &cb), MOE_OK, "moe_run --profile: %s", moe_last_error());
    cr_expect(p.base.end_val == plain.end_val, "val_loss %.9g with --profile, %.9g without", p.base.end_val,
              plain.end_val);
    /* 3 steps x 2 micro-batches x 2 layers; evaluations would add more. */
    cr_expect(p.steps == 3 && p.experts_forward == 12 && p.experts_backward == 12,
              "profile of %lld steps: experts_forward %lld, experts_backward %lld calls; want 3, 12, 12",
              (long long)p.steps, (long long)p.experts_forward, (long long)p.experts_backward);
    cr_expect(p.ops > 10 && p.op_seconds > 0.0 && p.op_seconds <= p.seconds * 1.01 + 1e-3,
              "%lld ops, %.4g s of ops in %.4g s of steps", (long long)p.ops, p.op_seconds, p.seconds);
    char path[512];
    size_t size = 0;
    char *metrics = read_file(tmp_path(path, "profiled/metrics.jsonl"), &size);
    cr_expect(strstr(metrics, "{\"profile_steps\":3,") != NULL, "metrics.jsonl has no profile line");
    free(metrics);

    /* A resume keeps a profile of steps up to its checkpoint's (here all 4),
     * and drops one of steps it runs again (resumed from 2). */
    o.config = NULL;
    o.steps = 6;
    o.resume = MOE_RUN_RESUME_LATEST;
    cr_assert_eq(moe_run(&o, &cb), MOE_OK, "--resume latest: %s", moe_last_error());
    metrics = read_file(path, &size);
    char *first = strstr(metrics, "{\"profile_steps\":3,");
    cr_expect(first && strstr(first + 1, "{\"profile_steps\":1,"), "the first run's profile went: %s", metrics);
    free(metrics);
    char resume[512];
    o.resume = tmp_path(resume, "profiled/step-000002");
    o.overwrite = true;
    cr_assert_eq(moe_run(&o, &cb), MOE_OK, "--resume step 2: %s", moe_last_error());
    metrics = read_file(path, &size);
    first = strstr(metrics, "{\"profile_steps\"");
    cr_expect(first && !strstr(first + 1, "{\"profile_steps\"") && strncmp(first, "{\"profile_steps\":3,", 18) == 0,
              "a profile of steps 3 to 6 stayed: %s", metrics);
    free(metrics);
}

Test(train_run, eval_only_matches_final_eval, .init = make_tmp, .fini = remove_tmp) {
    char cfg[512], out[512];
    moe_run_options o = tiny_options(write_tiny_config(cfg, MOE_SYNTH_VOCAB_SIZE), tmp_path(out, "out"));
    seen train;
    run_ok(&o, &train);
    cr_assert(isfinite(train.end_val));

    moe_run_options e = tiny_options(NULL, tmp_path(out, "unused"));
    e.eval_only = true;
    e.init_from = train.checkpoint;
    seen eval;
    run_ok(&e, &eval);
    cr_expect_eq(eval.steps, 0);
    cr_expect_eq(eval.evals, 1);
    cr_expect(eval.end_val == train.end_val, "eval-only %.9g, training's final eval %.9g", eval.end_val,
              train.end_val);
    cr_expect(access(out, F_OK) != 0, "--eval-only wrote %s", out);
}

/* Tokens 0..vocab-1 in a fixed pseudo-random order. */
static void fill_tokens(int32_t *tokens, int64_t n, int64_t vocab, uint32_t seed) {
    for (int64_t i = 0; i < n; i++) {
        seed = seed * 1664525u + 1013904223u;
        tokens[i] = (int32_t)((seed >> 8) % (uint32_t)vocab);
    }
}

Test(train_run, llmc_shards_train, .init = make_tmp, .fini = remove_tmp) {
    char cfg[512], out[512], path[512], glob[512], val[512];
    enum { VOCAB = 64, N = 3000 };
    int32_t tokens[N];
    for (int s = 0; s < 2; s++) {
        char name[32];
        snprintf(name, sizeof name, "train_%02d.bin", s);
        fill_tokens(tokens, N, VOCAB, (uint32_t)s + 1);
        cr_assert_eq(moe_data_write_shard(tmp_path(path, name), tokens, N, 2), MOE_OK, "%s", moe_last_error());
    }
    fill_tokens(tokens, N, VOCAB, 99);
    cr_assert_eq(moe_data_write_shard(tmp_path(val, "val_00.bin"), tokens, N, 2), MOE_OK, "%s", moe_last_error());

    moe_run_options o = tiny_options(write_tiny_config(cfg, VOCAB), tmp_path(out, "out"));
    o.data = tmp_path(glob, "train_*.bin");
    o.val_data = val;
    o.steps = 5;
    seen v;
    run_ok(&o, &v);
    cr_expect_eq(v.steps, 5);
    cr_expect(isfinite(v.end_val) && !v.kinds_ok && isnan(v.floor), "val %g, floor %g", v.end_val, v.floor);
    cr_expect_eq(v.warnings, 0, "warning: %s", v.warning);
    cr_expect(access(v.checkpoint, F_OK) == 0, "no checkpoint at %s", v.checkpoint);

    /* A token past the config's vocabulary is refused with the shard named,
     * before training: where the first step reads the training data (later
     * batches are refused when read), and in the validation data. */
    write_tiny_config(cfg, VOCAB / 2);
    o.overwrite = true;
    moe_run_callbacks cb = callbacks(&v);
    cr_assert_neq(moe_run(&o, &cb), MOE_OK);
    cr_expect(strstr(moe_last_error(), "training data (the first step's): ") && strstr(moe_last_error(), "train_00.bin"),
              "message: %s", moe_last_error());
    cr_expect_eq(v.steps, 0);
    for (int s = 0; s < 2; s++) {
        char name[32];
        snprintf(name, sizeof name, "train_%02d.bin", s);
        fill_tokens(tokens, N, VOCAB / 2, (uint32_t)s + 1);
        cr_assert_eq(moe_data_write_shard(tmp_path(path, name), tokens, N, 2), MOE_OK, "%s", moe_last_error());
    }
    cr_assert_neq(moe_run(&o, &cb), MOE_OK);
    cr_expect(strstr(moe_last_error(), "--val-data") && strstr(moe_last_error(), "val_00.bin"), "message: %s",
              moe_last_error());
    cr_expect_eq(v.steps, 0);
}

/* A tokenizer.json of n ids, token i spelling "t" and i's digits (with
 * prefix before each, for another tokenizer of as many ids), into path. */
static const char *write_tokenizer(char *path, const char *name, int n, const char *prefix) {
    tmp_path(path, name);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fprintf(f, "{\"model\": {\"type\": \"BPE\", \"vocab\": {");
    for (int i = 0; i < n; i++) fprintf(f, "%s\"%st%d\": %d", i ? ", " : "", prefix, i, i);
    fprintf(f, "}, \"merges\": []}, \"decoder\": {\"type\": \"ByteLevel\"}}\n");
    cr_assert_eq(fclose(f), 0);
    return path;
}

/* --tokenizer: every checkpoint keeps it as tokenizer.json; without a
 * config its ids are the built-in model's vocabulary; a resume takes the
 * same one only; it must fit a config's vocabulary, and be the shards'. */
Test(train_run, tokenizer_kept_with_every_checkpoint, .init = make_tmp, .fini = remove_tmp) {
    char out[512], shard[512], tok[512], other[512], cfg[512], path[600], step1[600];
    enum { VOCAB = 64, N = 3000 };
    int32_t tokens[N];
    fill_tokens(tokens, N, VOCAB, 7);
    cr_assert_eq(moe_data_write_shard(tmp_path(shard, "train_00.bin"), tokens, N, 2), MOE_OK, "%s", moe_last_error());
    write_tokenizer(tok, "tokenizer.json", VOCAB, "");
    moe_run_options o = tiny_options(NULL, tmp_path(out, "out"));
    o.data = shard;
    o.tokenizer = tok;
    o.steps = 2;
    o.save_every = 1;
    seen v;
    run_ok(&o, &v);
    cr_expect(v.vocab_size == VOCAB && v.tokenizer_tokens == VOCAB, "vocab_size %lld, tokenizer %lld",
              (long long)v.vocab_size, (long long)v.tokenizer_tokens);
    for (int step = 1; step <= 2; step++) {
        snprintf(path, sizeof path, "%s/step-%06d/tokenizer.json", out, step);
        cr_expect(same_file(path, tok), "%s is not --tokenizer's", path);
    }

    /* A resume with the same tokenizer goes on; with another is refused. */
    snprintf(step1, sizeof step1, "%s/step-000001", out);
    o.resume = step1;
    o.overwrite = true;
    run_ok(&o, &v);
    cr_expect_eq(v.steps, 1);
    o.tokenizer = write_tokenizer(other, "other.json", VOCAB, "x");
    moe_run_callbacks cb = callbacks(&v);
    cr_expect_eq(moe_run(&o, &cb), MOE_ERR_CONFIG);
    cr_expect(strstr(moe_last_error(), "differs (byte for byte) from") &&
                  strstr(moe_last_error(), "step-000001/tokenizer.json, the tokenizer of the model"),
              "%s", moe_last_error());
    cr_expect_eq(v.steps, 0);

    /* --eval-only evaluates by the model's tokenizer only. */
    moe_run_options e = o;
    e.resume = NULL;
    e.overwrite = false;
    e.eval_only = true;
    e.init_from = step1;
    e.save_every = 0;
    cr_expect_eq(moe_run(&e, &cb), MOE_ERR_CONFIG);
    cr_expect(strstr(moe_last_error(), "differs (byte for byte) from"), "%s", moe_last_error());
    e.tokenizer = tok;
    run_ok_or_done(&e, &v);
    cr_expect(isfinite(v.end_val), "--eval-only gave %g", v.end_val);

    /* A source with a tokenizer of its own but no tokenizer.json. */
    char hf[600], file[700], out3[512];
    snprintf(hf, sizeof hf, "%s/step-000002", out);
    snprintf(file, sizeof file, "%s/tokenizer.json", hf);
    cr_assert_eq(unlink(file), 0);
    snprintf(file, sizeof file, "%s/vocab.json", hf);
    cr_assert_eq(moe_file_write_atomic_buffer(file, "{}", 2), MOE_OK);
    o.resume = NULL;
    o.init_from = hf;
    o.tokenizer = tok;
    o.out_dir = tmp_path(out3, "out3");
    cr_expect_eq(moe_run(&o, &cb), MOE_ERR_CONFIG);
    cr_expect(strstr(moe_last_error(), "step-000002 holds a tokenizer of its own (vocab.json)"), "%s",
              moe_last_error());
    /* Spaces before the JSON's brace, as the tokenizer reader takes them. */
    size_t plain_n;
    char *plain = read_file(tok, &plain_n), spaced[600];
    tmp_path(spaced, "spaced.json");
    FILE *sf = fopen(spaced, "w");
    cr_assert_not_null(sf);
    fprintf(sf, " \n%s", plain);
    cr_assert_eq(fclose(sf), 0);
    free(plain);
    o = tiny_options(NULL, tmp_path(out, "spaced"));
    o.data = shard;
    o.tokenizer = spaced;
    o.steps = 1;
    run_ok(&o, &v);
    cr_expect_eq(v.vocab_size, VOCAB);

    /* More ids than a config's vocabulary; data without shards; no JSON. */
    o = tiny_options(write_tiny_config(cfg, VOCAB / 2), tmp_path(out, "out2"));
    o.data = shard;
    o.tokenizer = tok;
    cr_expect_eq(moe_run(&o, &cb), MOE_ERR_CONFIG);
    cr_expect(strstr(moe_last_error(), "knows ids up to 63, and the model's vocab_size is 32"), "%s", moe_last_error());
    o.data = MOE_RUN_SYNTHETIC;
    o.config = NULL;
    cr_expect_eq(moe_run(&o, &cb), MOE_ERR_CONFIG);
    cr_expect(strstr(moe_last_error(), "the synthetic corpus, of tokens of its own"), "%s", moe_last_error());
    o.data = shard;
    tmp_path(other, "tokenizer.bin");
    FILE *f = fopen(other, "w");
    cr_assert_not_null(f);
    fputs("\x28\x22\x34\x01", f);
    cr_assert_eq(fclose(f), 0);
    o.tokenizer = other;
    cr_expect_eq(moe_run(&o, &cb), MOE_ERR_CONFIG);
    cr_expect(strstr(moe_last_error(), "is no tokenizer.json"), "%s", moe_last_error());
}

/* Text under --tokenizer (a glob of files) is encoded at the start as
 * moe-tokenize encodes it: a run on it is a run on moe-tokenize's shards
 * of it, bit for bit, and resumes as one; the shards, globbed without
 * their .bin, are still shards. */
Test(train_run, text_under_a_tokenizer_trains_as_its_shards, .init = make_tmp, .fini = remove_tmp) {
    char text[512], shards[512], glob[600], out_a[512], out_b[512], path[600], path_b[600];
    const char *tok = MOE_TEST_DATA_DIR "/tokenizer_qwen2.json";
    FILE *f = fopen(tmp_path(text, "corpus_a.jsonl"), "w");
    cr_assert_not_null(f);
    for (int i = 0; i < 60; i++)
        fprintf(f, "{\"text\": \"moe trains Mixture-of-Experts transformers from C, line %d: routers, experts, "
                   "all-to-all.\"}\n",
                i);
    cr_assert_eq(fclose(f), 0);
    f = fopen(tmp_path(text, "corpus_b.txt"), "w");
    cr_assert_not_null(f);
    fputs("A whole file is one document,\nof lines of Ünïcödé and 漢字 too.\n", f);
    cr_assert_eq(fclose(f), 0);
    tmp_path(text, "corpus_*"); /* a glob of text, as one of shards */
    moe_corpus_options c;
    moe_corpus_options_init(&c);
    c.tokenizer = tok;
    c.input = text;
    c.out = tmp_path(shards, "tok");
    moe_corpus_totals totals;
    cr_assert_eq(moe_corpus_tokenize(&c, NULL, &totals), MOE_OK, "%s", moe_last_error());

    moe_run_options o = tiny_options(NULL, tmp_path(out_a, "a"));
    snprintf(glob, sizeof glob, "%s_train_*.bin", shards);
    o.data = glob;
    o.val_tokens = 300;
    o.tokenizer = tok;
    o.steps = 4;
    o.save_every = 2;
    seen v;
    run_ok(&o, &v);
    const double shards_val = v.end_val;
    o.data = text;
    o.out_dir = tmp_path(out_b, "b");
    run_ok(&o, &v);
    cr_expect_eq(v.end_val, shards_val, "text %.9g, its shards %.9g", v.end_val, shards_val);
    snprintf(path, sizeof path, "%s/step-000004/model.safetensors", out_a);
    snprintf(path_b, sizeof path_b, "%s/step-000004/model.safetensors", out_b);
    cr_expect(same_file(path, path_b), "the weights after text and after its shards differ");

    /* A resume of the text run, and one that reads the shards instead. */
    snprintf(path, sizeof path, "%s/step-000002", out_b);
    o.resume = path;
    o.overwrite = true;
    run_ok(&o, &v);
    cr_expect_eq(v.end_val, shards_val, "resumed %.9g, uninterrupted %.9g", v.end_val, shards_val);
    snprintf(glob, sizeof glob, "%s_train_*", shards);
    o.data = glob;
    moe_run_callbacks cb = callbacks(&v);
    cr_expect_eq(moe_run(&o, &cb), MOE_ERR_CONFIG);
    cr_expect(strstr(moe_last_error(), "the checkpoint read text data; --data") &&
                  strstr(moe_last_error(), "is shards data"),
              "%s", moe_last_error());
}

/* The file's name is not UTF-8 (Latin-1 e-acute): run.json records it with
 * U+FFFD for that byte. */
Test(train_run, byte_file_trains, .init = make_tmp, .fini = remove_tmp) {
    char cfg[512], out[512], text_path[512];
    static const char line[] = "The quick brown fox jumps over the lazy dog; 0123456789.\n";
    FILE *f = fopen(tmp_path(text_path, "caf\xe9.txt"), "w");
    cr_assert(f);
    for (int i = 0; i < 100; i++) fputs(line, f);
    fclose(f);

    moe_run_options o = tiny_options(write_tiny_config(cfg, MOE_BYTE_VOCAB_SIZE), tmp_path(out, "out"));
    o.data = text_path;
    o.steps = 5;
    seen v;
    run_ok(&o, &v);
    cr_expect_eq(v.steps, 5);
    cr_expect(isfinite(v.end_val), "val %g", v.end_val);
    /* Without --val-data the run says it validates on its training data. */
    cr_expect(v.warnings == 1 && strstr(v.warning, "--val-data"), "warnings %d: %s", v.warnings, v.warning);
    char run_json[512];
    size_t size = 0;
    char *text = read_file(tmp_path(run_json, "out/run.json"), &size);
    cr_expect(strstr(text, "caf\xEF\xBF\xBD.txt") != NULL, "run.json does not name the data file");
    free(text);

    /* Bytes need a vocabulary of 256. */
    write_tiny_config(cfg, 100);
    o.overwrite = true;
    moe_run_callbacks cb = callbacks(&v);
    cr_assert_eq(moe_run(&o, &cb), MOE_ERR_CONFIG);
    cr_expect(strstr(moe_last_error(), "--data") && strstr(moe_last_error(), "vocab_size"), "message: %s",
              moe_last_error());
}

/* ------------------------------------------------- data checked up front */

static const char *write_text(char *path, const char *name, const char *text, int copies) {
    FILE *f = fopen(tmp_path(path, name), "w");
    cr_assert(f, "cannot create %s", path);
    for (int i = 0; i < copies; i++) fputs(text, f);
    cr_assert_eq(fclose(f), 0);
    return path;
}

/* --val-tokens N holds out --data's last N tokens: a run on one file with
 * it trains and validates as a run on the file's head with --val-data its
 * tail, bit for bit (same weights, same validation loss); too many held
 * out, or too few for the evaluation, are refused naming the flag. */
Test(train_run, val_tokens_hold_out_the_tail, .init = make_tmp, .fini = remove_tmp) {
    enum { ALL = 3000, HELD = 600 };
    char text[ALL + 1];
    uint64_t x = 7;
    for (int i = 0; i < ALL; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        text[i] = (char)('a' + (x >> 59));
    }
    char all[512], head[512], tail[512], cfg[512], out[2][512], a[512], b[512];
    text[ALL] = '\0';
    write_text(all, "all.txt", text, 1);
    write_text(tail, "tail.txt", text + ALL - HELD, 1);
    text[ALL - HELD] = '\0';
    write_text(head, "head.txt", text, 1);

    moe_run_options o = tiny_options(write_tiny_config(cfg, MOE_BYTE_VOCAB_SIZE), tmp_path(out[0], "held"));
    o.data = all;
    o.val_tokens = HELD;
    o.steps = 4;
    seen held, split;
    run_ok(&o, &held);
    cr_expect_eq(held.warnings, 0, "warned: %s", held.warning);
    o.out_dir = tmp_path(out[1], "split");
    o.data = head;
    o.val_data = tail;
    o.val_tokens = 0;
    run_ok(&o, &split);
    cr_expect(held.end_val == split.end_val, "validation loss %.17g held out, %.17g from the tail's file",
              held.end_val, split.end_val);
    cr_expect(same_file(tmp_path(a, "held/step-000004/model.safetensors"),
                        tmp_path(b, "split/step-000004/model.safetensors")),
              "the held-out run trained on other tokens than the head's");

    o.val_data = NULL;
    o.data = all;
    o.overwrite = true;
    o.val_tokens = ALL;
    moe_run_callbacks cb = callbacks(&held);
    cr_expect_eq(moe_run(&o, &cb), MOE_ERR_CONFIG);
    cr_expect(strstr(moe_last_error(), "--val-tokens 3000 holds out every token"), "message: %s", moe_last_error());
    o.val_tokens = ALL - 100; /* a batch reads 4 x 32 + 1 */
    cr_expect_eq(moe_run(&o, &cb), MOE_ERR_CONFIG);
    cr_expect(strstr(moe_last_error(), "--data (less --val-tokens)") && strstr(moe_last_error(), "holds 100 tokens"),
              "message: %s", moe_last_error());
    o.val_tokens = 100; /* the evaluation reads 2 x 4 x 32 + 1 */
    cr_expect_eq(moe_run(&o, &cb), MOE_ERR_CONFIG);
    cr_expect(strstr(moe_last_error(), "--val-tokens of --data") && strstr(moe_last_error(), "holds 100 tokens"),
              "message: %s", moe_last_error());
}

/* metrics.jsonl's expert_load has a null row for a dense MLP layer, and a
 * model without an MoE layer logs its routing values as null. */
Test(train_run, dense_layers_log_no_routing, .init = make_tmp, .fini = remove_tmp) {
    char cfg[512], out[512], dense_cfg[512], path[600];
    moe_model_config c;
    cr_assert_eq(moe_model_config_load(&c, write_tiny_config(cfg, MOE_SYNTH_VOCAB_SIZE), NULL, NULL), MOE_OK, "%s",
                 moe_last_error());
    static const char *const routing[] = {"aux_loss", "seq_aux_loss", "z_loss", "load_imbalance",
                                          "dropped_frac", "exchange_bytes", "rank_imbalance"};
    for (uint64_t dense = 1; dense <= 3; dense += 2) { /* layer 0 dense; both */
        c.moe_dense_layers[0] = dense;
        cr_assert_eq(moe_model_config_save(&c, tmp_path(dense_cfg, "dense.json")), MOE_OK, "%s", moe_last_error());
        moe_run_options o = tiny_options(dense_cfg, tmp_path(out, dense == 3 ? "out_dense" : "out_mixed"));
        o.steps = 2;
        seen v;
        run_ok(&o, &v);
        snprintf(path, sizeof path, "%s/metrics.jsonl", out);
        size_t size;
        char *text = read_file(path, &size);
        char *line = strtok(text, "\n"); /* step 1 */
        moe_json_doc *doc;
        cr_assert_eq(moe_json_parse(&doc, line, strlen(line), "metrics.jsonl"), MOE_OK, "%s", moe_last_error());
        const moe_json *root = moe_json_root(doc), *load = moe_json_get(root, "expert_load");
        cr_assert(load && load->type == MOE_JSON_ARRAY && load->array.count == 2, "expert_load in %s", line);
        cr_expect(load->array.items[0].type == MOE_JSON_NULL, "a dense layer's row in %s", line);
        cr_expect(load->array.items[1].type == (dense == 3 ? MOE_JSON_NULL : MOE_JSON_ARRAY), "layer 1's row in %s",
                  line);
        for (size_t k = 0; k < sizeof routing / sizeof *routing; k++) {
            const moe_json *value = moe_json_get(root, routing[k]);
            cr_expect(value && value->type == (dense == 3 ? MOE_JSON_NULL : MOE_JSON_NUMBER), "%s in %s", routing[k],
                      line);
        }
        moe_json_free(doc);
        free(text);
    }
}

/* --upcycle reads the dense model's config.json as its model type's
 * config class reads it (defaults included): a field it shares with
 * --config that differs (rope_theta also where transformers v5 writes it,
 * in rope_parameters), a head tied where --config's is not, a RoPE scaled
 * otherwise, or what the reader refuses (a RoPE type moe does not
 * implement, an activation other than SiLU, attention biases, layers of
 * different windows) is refused before any weight is read, naming the
 * file and the key, and so is an MoE; a matching one goes on to the
 * weights. A qwen3 model normalises q and k, and a qwen2 model's q, k and
 * v have biases, which --config must have too (and not for another
 * model); the windows are compared as transformers reads them (Mistral's
 * 4096 when absent, Llama's none, Qwen2's and Qwen3's under
 * use_sliding_window from layer max_window_layers on, or as layer_types
 * says). */
#define QWEN2_BIASES "dense/config.json's q, k and v projections have biases (a qwen2's), and --config"

/* A dense model's config.json of the tiny config's sizes (llama unless
 * extra gives a model_type), without the keys extra gives. */
static int dense_config_text(char *text, size_t size, const char *extra) {
    char vocab[16];
    snprintf(vocab, sizeof vocab, "%d", MOE_SYNTH_VOCAB_SIZE);
    const char *const base[][2] = {
        {"model_type", "\"llama\""},  {"vocab_size", vocab},        {"hidden_size", "32"},
        {"intermediate_size", "32"},  {"num_hidden_layers", "2"},   {"num_attention_heads", "4"},
        {"num_key_value_heads", "2"}, {"head_dim", "8"},            {"rope_theta", "10000.0"},
        {"rms_norm_eps", "1e-05"},    {"tie_word_embeddings", "false"}, {"hidden_act", "\"silu\""},
    };
    int n = snprintf(text, size, "{");
    const char *sep = "";
    for (size_t k = 0; k < sizeof base / sizeof *base; k++) {
        char quoted[48];
        snprintf(quoted, sizeof quoted, "\"%s\"", base[k][0]);
        if (strstr(extra, quoted)) continue;
        n += snprintf(text + n, size - (size_t)n, "%s%s: %s", sep, quoted, base[k][1]);
        sep = ", ";
    }
    return n + snprintf(text + n, size - (size_t)n, "%s}", extra);
}

Test(train_run, upcycle_checks_the_dense_config, .init = make_tmp, .fini = remove_tmp) {
    char cfg[512], out[512], dense[512], path[600];
    moe_run_options o = tiny_options(write_tiny_config(cfg, MOE_SYNTH_VOCAB_SIZE), tmp_path(out, "out"));
    o.upcycle = true;
    o.init_from = tmp_path(dense, "dense");
    cr_assert_eq(moe_mkdir_p(dense), MOE_OK, "%s", moe_last_error());
    snprintf(path, sizeof path, "%s/config.json", dense);
    static const struct {
        const char *extra, *want;
    } cases[] = {
        {", \"rope_theta\": 500000.0", "config.json has rope_theta=500000, and --config"},
        {", \"num_attention_heads\": 8, \"head_dim\": 4", "config.json has num_attention_heads=8"},
        {", \"rms_norm_eps\": 1e-06", "config.json has rms_norm_eps=1e-06, and --config"},
        /* LlamaConfig's rms_norm_eps when absent, not the MoE's. */
        {", \"model_type\": \"llama\", \"rms_norm_eps\": null", "config.json has rms_norm_eps=1e-06"},
        {", \"intermediate_size\": 64", "config.json has intermediate_size=64, and --config"},
        /* Mistral's window is every layer's, 4096 when absent; Llama has none. */
        {", \"model_type\": \"mistral\", \"sliding_window\": 4096", "config.json has sliding_window=4096, and --config"},
        {", \"model_type\": \"mistral\"", "config.json has sliding_window=4096, and --config"},
        {", \"model_type\": \"mistral\", \"sliding_window\": 8", "config.json has sliding_window=8, and --config"},
        {", \"model_type\": \"mistral\", \"sliding_window\": null", "model.safetensors"},
        {", \"sliding_window\": 8", "model.safetensors"},
        {", \"tie_word_embeddings\": true", "ties the embedding and the head (tie_word_embeddings true), and --config"},
        {", \"tie_word_embeddings\": \"yes\"", "tie_word_embeddings must be true or false, got \"yes\""},
        {", \"rope_parameters\": {\"rope_theta\": 500000.0, \"rope_type\": \"default\"}",
         "config.json has rope_theta=500000, and --config"},
        {", \"rope_parameters\": {\"factor\": 8.0, \"rope_theta\": 10000.0, \"rope_type\": \"llama3\", "
         "\"low_freq_factor\": 1, \"high_freq_factor\": 4, \"original_max_position_embeddings\": 64}",
         "dense/config.json scales RoPE as llama3 (factor 8, low_freq_factor 1, high_freq_factor 4, "
         "original_max_position_embeddings 64), and --config"},
        {", \"rope_scaling\": {\"type\": \"linear\", \"factor\": 2.0}",
         "dense/config.json scales RoPE as linear (factor 2), and --config"},
        {", \"rope_scaling\": {\"type\": \"longrope\", \"factor\": 2.0}",
         "dense/config.json: rope_scaling.rope_type=\"longrope\" is not supported"},
        {", \"rope_scaling\": {\"type\": \"linear\", \"factor\": 2.0, \"rope_theta\": 500000.0}",
         "config.json has rope_theta=500000, and --config"},
        /* Its context LlamaConfig's max_position_embeddings, 2048. */
        {", \"rope_scaling\": {\"type\": \"yarn\", \"factor\": 4.0}",
         "scales RoPE as yarn (factor 4, original_max_position_embeddings 2048"},
        {", \"hidden_act\": \"gelu\"", "dense/config.json: hidden_act=\"gelu\" is not supported"},
        {", \"attention_bias\": true", "dense/config.json: attention_bias=true is not supported"},
        {", \"model_type\": \"qwen2\", \"use_sliding_window\": true, \"sliding_window\": 16, "
         "\"layer_types\": [\"full_attention\", \"sliding_attention\"]",
         "layer 0 attends without a window, layer 1 within one"},
        {", \"model_type\": \"qwen2\", \"layer_types\": [\"full_attention\", \"chunked_attention\"]",
         "layer_types[1]=\"chunked_attention\" is neither \"full_attention\" nor \"sliding_attention\""},
        {", \"model_type\": \"qwen2\", \"layer_types\": [\"full_attention\"]",
         "layer_types lists 1 layers' attention, and num_hidden_layers=2"},
        /* Qwen2's and Qwen3's window: under use_sliding_window, from layer
         * max_window_layers (28) on, 4096 positions unless sliding_window
         * says. */
        {", \"model_type\": \"qwen2\", \"use_sliding_window\": true, \"max_window_layers\": 0",
         "config.json has sliding_window=4096, and --config"},
        {", \"model_type\": \"qwen2\", \"use_sliding_window\": true, \"sliding_window\": 16, \"max_window_layers\": 1",
         "layer 0 attends without a window, layer 1 within one"},
        {", \"model_type\": \"qwen3\"",
         "dense/config.json's attention normalises q and k per head (a qwen3's), and --config"},
        /* An MoE is no dense model, whatever its type; an MoE family's
         * file of dense layers only is one. */
        {", \"model_type\": \"qwen3_moe\", \"moe_intermediate_size\": 16, \"num_experts\": 4, "
         "\"num_experts_per_tok\": 2, \"mlp_only_layers\": [0]",
         "dense/config.json is an MoE (model_type qwen3_moe, 1 of its 2 layers MoE layers): --upcycle starts from a "
         "dense model"},
        {", \"model_type\": \"mixtral\", \"num_local_experts\": 4, \"num_experts_per_tok\": 2",
         "dense/config.json is an MoE (model_type mixtral, 2 of its 2 layers MoE layers)"},
        {", \"model_type\": \"qwen3_moe\", \"moe_intermediate_size\": 16, \"num_experts\": 4, "
         "\"num_experts_per_tok\": 2, \"mlp_only_layers\": [0, 1]",
         "dense/config.json's attention normalises q and k per head (a qwen3's), and --config"},
        /* Windows that are not used are none. */
        {", \"model_type\": \"qwen2\", \"sliding_window\": 16", QWEN2_BIASES},
        {", \"model_type\": \"qwen2\", \"use_sliding_window\": true, \"sliding_window\": 16", QWEN2_BIASES},
        /* The config matches (null: no window): on to the missing weights. */
        {", \"sliding_window\": null", "model.safetensors"},
        {", \"rope_parameters\": {\"rope_theta\": 10000.0, \"rope_type\": \"default\"}, \"hidden_act\": \"silu\", "
         "\"rope_scaling\": null",
         "model.safetensors"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        char text[1024];
        const int n = dense_config_text(text, sizeof text, cases[i].extra);
        cr_assert_eq(moe_file_write_atomic_buffer(path, text, (size_t)n), MOE_OK, "%s", moe_last_error());
        seen v;
        moe_run_callbacks cb = callbacks(&v);
        cr_expect_neq(moe_run(&o, &cb), MOE_OK, "case %zu ran", i);
        cr_expect(strstr(moe_last_error(), cases[i].want), "case %zu: %s\n  lacks %s", i, moe_last_error(),
                  cases[i].want);
        cr_expect_eq(v.steps, 0);
    }
    /* Without a model_type the file reads as a Mixtral's, which lacks its
     * experts: the message says why. */
    {
        static const char named[] = "\"model_type\": \"llama\", ";
        char text[1024];
        dense_config_text(text, sizeof text, "");
        char *type = strstr(text, named);
        cr_assert_not_null(type);
        memmove(type, type + strlen(named), strlen(type + strlen(named)) + 1);
        cr_assert_eq(moe_file_write_atomic_buffer(path, text, strlen(text)), MOE_OK, "%s", moe_last_error());
        seen v;
        moe_run_callbacks cb = callbacks(&v);
        cr_expect_eq(moe_run(&o, &cb), MOE_ERR_CONFIG);
        cr_expect(strstr(moe_last_error(), "missing required key 'num_local_experts'") &&
                      strstr(moe_last_error(), "config.json has no model_type, which makes it a Mixtral's"),
                  "%s", moe_last_error());
    }
    /* An MoE that normalises q and k from a model that does not. */
    char qk_cfg[512], text[1024];
    moe_model_config c;
    cr_assert_eq(moe_model_config_load(&c, cfg, NULL, NULL), MOE_OK, "%s", moe_last_error());
    c.moe_qk_norm = MOE_QK_NORM_PER_HEAD;
    o.config = tmp_path(qk_cfg, "qk.json");
    cr_assert_eq(moe_model_config_save(&c, qk_cfg), MOE_OK, "%s", moe_last_error());
    int n = dense_config_text(text, sizeof text, ", \"model_type\": \"mistral\", \"sliding_window\": null");
    cr_assert_eq(moe_file_write_atomic_buffer(path, text, (size_t)n), MOE_OK, "%s", moe_last_error());
    seen v;
    moe_run_callbacks cb = callbacks(&v);
    cr_expect_neq(moe_run(&o, &cb), MOE_OK, "a qk-normalising MoE upcycled from a mistral model");
    cr_expect(strstr(moe_last_error(), "'s attention does not normalise q and k, and --config") &&
                  strstr(moe_last_error(), "has moe_qk_norm \"per_head\""),
              "%s", moe_last_error());
    /* An MoE with q, k and v biases from a model without them, and from a
     * qwen2 model, whose config matches: on to the weights. */
    c.moe_qk_norm = MOE_QK_NORM_NONE;
    c.moe_qkv_bias = true;
    cr_assert_eq(moe_model_config_save(&c, qk_cfg), MOE_OK, "%s", moe_last_error());
    n = dense_config_text(text, sizeof text, "");
    cr_assert_eq(moe_file_write_atomic_buffer(path, text, (size_t)n), MOE_OK, "%s", moe_last_error());
    cr_expect_neq(moe_run(&o, &cb), MOE_OK, "an MoE with biases upcycled from a llama model");
    cr_expect(strstr(moe_last_error(), "'s q, k and v projections have no biases, and --config") &&
                  strstr(moe_last_error(), "has moe_qkv_bias true"),
              "%s", moe_last_error());
    n = dense_config_text(text, sizeof text, ", \"model_type\": \"qwen2\"");
    cr_assert_eq(moe_file_write_atomic_buffer(path, text, (size_t)n), MOE_OK, "%s", moe_last_error());
    cr_expect_neq(moe_run(&o, &cb), MOE_OK, "upcycled without weights");
    cr_expect(strstr(moe_last_error(), "model.safetensors"), "%s", moe_last_error());
    /* Into a model of dense layers only: nothing to upcycle. */
    c.moe_qkv_bias = false;
    c.moe_dense_layers[0] = 0x3;
    cr_assert_eq(moe_model_config_save(&c, qk_cfg), MOE_OK, "%s", moe_last_error());
    cr_expect_neq(moe_run(&o, &cb), MOE_OK, "upcycled into dense layers only");
    cr_expect(strstr(moe_last_error(), "qk.json has no MoE layer (every layer a dense MLP): nothing to upcycle"), "%s",
              moe_last_error());
    cr_expect_eq(v.steps, 0);
}

/* The files of an earlier run in an --out directory, which a refused run
 * must leave as they were (DESIGN.md 7). */
static const char *const earlier_files[] = {"run.json", "config.json", "metrics.jsonl"};

static void write_earlier_run(const char *out) {
    cr_assert_eq(moe_mkdir_p(out), MOE_OK, "%s", moe_last_error());
    for (size_t i = 0; i < sizeof earlier_files / sizeof *earlier_files; i++) {
        char path[600], text[64];
        snprintf(path, sizeof path, "%s/%s", out, earlier_files[i]);
        const int n = snprintf(text, sizeof text, "the earlier run's %s\n", earlier_files[i]);
        cr_assert_eq(moe_file_write_atomic_buffer(path, text, (size_t)n), MOE_OK, "%s", moe_last_error());
    }
}

static void expect_earlier_run(const char *out, const char *why) {
    for (size_t i = 0; i < sizeof earlier_files / sizeof *earlier_files; i++) {
        char path[600], want[64];
        snprintf(path, sizeof path, "%s/%s", out, earlier_files[i]);
        snprintf(want, sizeof want, "the earlier run's %s\n", earlier_files[i]);
        size_t size;
        char *text = read_file(path, &size);
        cr_expect(strcmp(text, want) == 0, "%s: %s was rewritten: '%.60s'", why, earlier_files[i], text);
        free(text);
    }
}

/* Runs o, which must fail before its first step with a message holding
 * every string of want (NULL-terminated), and leave out's files alone:
 * even with --overwrite, which removes an earlier run only once nothing
 * can be refused. */
static void expect_refused(const moe_run_options *given, const char *why, const char *const *want) {
    seen v;
    moe_run_callbacks cb = callbacks(&v);
    moe_run_options o_copy = *given;
    o_copy.overwrite = true;
    const moe_run_options *o = &o_copy;
    cr_assert_neq(moe_run(o, &cb), MOE_OK, "%s: the run succeeded", why);
    const char *msg = moe_last_error();
    cr_expect_eq(v.steps, 0, "%s: found after %d steps: %s", why, v.steps, msg);
    for (; *want; want++) cr_expect(strstr(msg, *want) != NULL, "%s: '%s' does not name %s", why, msg, *want);
    expect_earlier_run(o->out_dir, why);
}

/* An --out holding another run is refused, naming it, and its files stay;
 * --overwrite replaces that run (the new one's files alone remain); a
 * --resume of a checkpoint in --out continues it in place, and one from
 * elsewhere into it is refused. A file where a checkpoint would go is
 * refused up front, --overwrite or not. */
Test(train_run, an_out_holding_another_run_is_refused, .init = make_tmp, .fini = remove_tmp) {
    char cfg[512], out[512], elsewhere[512], ckpt[600], path[600];
    write_tiny_config(cfg, MOE_SYNTH_VOCAB_SIZE);
    moe_run_options o = tiny_options(cfg, tmp_path(out, "out"));
    o.steps = 4;
    o.save_every = 2;
    seen v;
    run_ok(&o, &v);
    moe_run_callbacks cb = callbacks(&v);
    o.seed = 7;
    cr_expect_eq(moe_run(&o, &cb), MOE_ERR_CONFIG, "a second run into a run's --out");
    cr_expect(strstr(moe_last_error(), "holds another run") && strstr(moe_last_error(), "--overwrite"), "%s",
              moe_last_error());
    snprintf(path, sizeof path, "%s/step-000002", out);
    cr_expect(access(path, F_OK) == 0, "the refused run removed %s", path);

    o.overwrite = true;
    o.steps = 3;
    o.save_every = 0;
    run_ok(&o, &v);
    cr_expect(access(path, F_OK) != 0, "--overwrite left the earlier run's %s", path);
    snprintf(path, sizeof path, "%s/step-000003", out);
    cr_expect(access(path, F_OK) == 0, "the new run's checkpoint is missing");

    /* Continuing in place, then from elsewhere. */
    o.overwrite = false;
    o.steps = 5;
    snprintf(ckpt, sizeof ckpt, "%s/step-000003", out);
    o.resume = ckpt;
    o.config = NULL;
    run_ok(&o, &v);
    o.out_dir = tmp_path(elsewhere, "elsewhere");
    o.resume = NULL;
    o.config = cfg;
    run_ok(&o, &v);
    o.resume = ckpt;
    o.config = NULL;
    cr_expect_eq(moe_run(&o, &cb), MOE_ERR_CONFIG, "a resume from elsewhere into a run's --out");
    cr_expect(strstr(moe_last_error(), "--resume's checkpoint is not in it"), "%s", moe_last_error());

    /* In place through a link to the checkpoint: the run's own. Its later
     * checkpoint (step 5 of the last resume), which a resume to step 4
     * would not write again, is the run's abandoned future: refused, then
     * removed under --overwrite. */
    char link[512];
    cr_assert_eq(symlink(ckpt, tmp_path(link, "latest")), 0);
    o.out_dir = out;
    o.resume = link;
    o.steps = 4;
    cr_expect_eq(moe_run(&o, &cb), MOE_ERR_CONFIG, "a resume in place beside a later checkpoint");
    cr_expect(strstr(moe_last_error(), "step-000005, later than the checkpoint"), "%s", moe_last_error());
    /* The same under another name: the step is the checkpoint's own. */
    char renamed[600];
    snprintf(renamed, sizeof renamed, "%s/best", out);
    cr_assert_eq(rename(ckpt, renamed), 0);
    o.resume = renamed;
    cr_expect_eq(moe_run(&o, &cb), MOE_ERR_CONFIG, "a resume in place from a renamed checkpoint");
    cr_expect(strstr(moe_last_error(), "step-000005, later than the checkpoint"), "%s", moe_last_error());
    cr_assert_eq(rename(renamed, ckpt), 0);
    /* A checkpoint that is not there is named as missing. */
    snprintf(renamed, sizeof renamed, "%s/step-000009", out);
    o.resume = renamed;
    cr_expect_eq(moe_run(&o, &cb), MOE_ERR_IO, "a resume of a missing checkpoint");
    cr_expect(strstr(moe_last_error(), "step-000009: No such file"), "%s", moe_last_error());
    /* A later checkpoint the resumed run would write again is refused too,
     * and stays: removed at the start, it was lost when the run died
     * before its step came. */
    o.resume = link;
    o.steps = 5;
    cr_expect_eq(moe_run(&o, &cb), MOE_ERR_CONFIG, "a resume in place that would write a later checkpoint again");
    cr_expect(strstr(moe_last_error(), "step-000005, later than the checkpoint") &&
                  strstr(moe_last_error(), "--overwrite"),
              "%s", moe_last_error());
    snprintf(path, sizeof path, "%s/step-000005", out);
    cr_expect(access(path, F_OK) == 0, "the refused resume removed %s", path);
    o.steps = 4;
    o.overwrite = true;
    run_ok(&o, &v);
    snprintf(path, sizeof path, "%s/step-000005", out);
    cr_expect(access(path, F_OK) != 0, "--overwrite left the later checkpoint %s", path);
    cr_expect(access(ckpt, F_OK) == 0, "--overwrite removed the checkpoint resumed from");

    /* A checkpoint is a model, not a run to write into. */
    o.overwrite = true;
    o.resume = NULL;
    o.config = cfg;
    o.out_dir = ckpt;
    cr_expect_eq(moe_run(&o, &cb), MOE_ERR_CONFIG, "a run into a checkpoint");
    cr_expect(strstr(moe_last_error(), "holds a model (model.safetensors)"), "%s", moe_last_error());

    char odd[512];
    seen none;
    cb = callbacks(&none);
    o = tiny_options(cfg, tmp_path(odd, "odd"));
    o.overwrite = true;
    cr_assert_eq(moe_mkdir_p(odd), MOE_OK);
    snprintf(path, sizeof path, "%s/step-000010", odd);
    cr_assert_eq(moe_file_write_atomic_buffer(path, "note\n", 5), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(moe_run(&o, &cb), MOE_ERR_IO, "a file where the last checkpoint goes");
    cr_expect(strstr(moe_last_error(), "is not a directory"), "%s", moe_last_error());
    cr_expect_eq(none.steps, 0, "the run trained %d steps before the refusal", none.steps);
}

static const char text_line[] = "The quick brown fox jumps over the lazy dog; 0123456789.\n";

/* Training data shorter than one batch (4 x 32 + 1 tokens) is refused before
 * the earlier run's files are touched. */
Test(train_run, short_training_data_is_refused_up_front, .init = make_tmp, .fini = remove_tmp) {
    char cfg[512], out[512], tiny[512];
    moe_run_options o = tiny_options(write_tiny_config(cfg, MOE_BYTE_VOCAB_SIZE), tmp_path(out, "out"));
    o.data = write_text(tiny, "tiny.txt", "0123456789", 1);
    write_earlier_run(out);
    expect_refused(&o, "10-byte --data", (const char *const[]){"--data", tiny, NULL});
}

/* A --seq-len past the config's max_position_embeddings is refused before
 * any data is built or file touched, naming the flags and the config. */
Test(train_run, sequence_past_the_positions_is_refused_up_front, .init = make_tmp, .fini = remove_tmp) {
    char cfg[512], out[512];
    moe_model_config c;
    moe_model_config_default_small(&c, MOE_SYNTH_VOCAB_SIZE);
    c.max_position_embeddings = 16;
    cr_assert_eq(moe_model_config_save(&c, tmp_path(cfg, "short.json")), MOE_OK, "%s", moe_last_error());
    moe_run_options o = tiny_options(cfg, tmp_path(out, "out"));
    write_earlier_run(out);
    expect_refused(&o, "--seq-len 32 with 16 positions",
                   (const char *const[]){"--seq-len 32", cfg, "max_position_embeddings=16", NULL});
}

/* An epoch reads whole batches of 4 x 32 tokens plus one target, so 256
 * tokens are one batch and a tail of 127 never trained on, which a warning
 * says; 257 tokens are two whole batches, and nothing is said. */
Test(train_run, an_unread_tail_is_warned_about, .init = make_tmp, .fini = remove_tmp) {
    enum { VOCAB = 64, N = 257 };
    int32_t tokens[N];
    char cfg[512], out[512], shard[512];
    fill_tokens(tokens, N, VOCAB, 3);
    moe_run_options o = tiny_options(write_tiny_config(cfg, VOCAB), tmp_path(out, "out"));
    o.data = o.val_data = tmp_path(shard, "train_00.bin"); /* given: no warning that --data validates */
    o.steps = 2;
    o.eval_batches = 1;
    for (int n = N - 1; n <= N; n++) {
        cr_assert_eq(moe_data_write_shard(shard, tokens, n, 2), MOE_OK, "%s", moe_last_error());
        o.overwrite = true;
        seen v;
        run_ok(&o, &v);
        const char *said = strstr(v.warning, "never trained on");
        if (n == N - 1)
            cr_expect(said && strstr(v.warning, "its last 127 of 256 tokens (50%)"), "warning: '%s'", v.warning);
        else
            cr_expect(!said, "257 tokens, two whole batches: '%s'", v.warning);
    }
}

/* --eval-mc scores llm.c's multiple-choice file at every evaluation, all
 * of its examples, and logs the count beside val_loss. */
Test(train_run, eval_mc_is_scored_and_logged, .init = make_tmp, .fini = remove_tmp) {
    enum { N = 9 };
    /* Each example a context of 3 tokens and completions of 1 and 2. */
    unsigned char buf[1024 + N * 2 * 14] = {0};
    const int32_t header[4] = {20240522, 1, N, 2 * 14};
    for (int i = 0; i < 4; i++)
        for (int k = 0; k < 4; k++) buf[4 * i + k] = (unsigned char)((uint32_t)header[i] >> (8 * k));
    for (int e = 0; e < N; e++) {
        const uint16_t words[14] = {65535, 28, (uint16_t)e, (uint16_t)(e % 2), 2, 3, (uint16_t)(e + 1), 7, 8, 1,
                                    (uint16_t)(e + 10), 2, 5, 6};
        for (int w = 0; w < 14; w++) {
            buf[1024 + e * 28 + 2 * w] = (unsigned char)words[w];
            buf[1024 + e * 28 + 2 * w + 1] = (unsigned char)(words[w] >> 8);
        }
    }
    char cfg[512], out[512], mc[512], path[600];
    cr_assert_eq(moe_file_write_atomic_buffer(tmp_path(mc, "mc.bin"), buf, sizeof buf), MOE_OK, "%s",
                 moe_last_error());
    moe_run_options o = tiny_options(write_tiny_config(cfg, MOE_SYNTH_VOCAB_SIZE), tmp_path(out, "out"));
    o.steps = 2;
    o.eval_mc = mc;
    seen v;
    run_ok(&o, &v);
    cr_expect_eq(v.mc_examples, N);
    cr_expect(v.mc_correct >= 0 && v.mc_correct <= N, "%lld right", (long long)v.mc_correct);
    snprintf(path, sizeof path, "%s/metrics.jsonl", out);
    size_t size;
    char *log = read_file(path, &size);
    cr_expect(strstr(log, "\"mc_examples\":9"), "%s", log);
    free(log);
    /* A token outside the model's vocabulary is refused before any step. */
    buf[1024 + 2 * 6] = 200;
    cr_assert_eq(moe_file_write_atomic_buffer(mc, buf, sizeof buf), MOE_OK, "%s", moe_last_error());
    o.overwrite = true;
    moe_run_callbacks cb = callbacks(&v);
    cr_expect_eq(moe_run(&o, &cb), MOE_ERR_FORMAT);
    cr_expect(strstr(moe_last_error(), "--eval-mc: ") && strstr(moe_last_error(), "example 0 holds token 200"), "%s",
              moe_last_error());
}

/* A token shard named without .bin is read at byte level (its header
 * trains as text): allowed, and warned about. */
Test(train_run, a_shard_read_as_bytes_is_warned_about, .init = make_tmp, .fini = remove_tmp) {
    enum { N = 1000 };
    int32_t tokens[N];
    char cfg[512], out[512], shard[512];
    fill_tokens(tokens, N, 64, 5);
    cr_assert_eq(moe_data_write_shard(tmp_path(shard, "train_00"), tokens, N, 2), MOE_OK, "%s", moe_last_error());
    moe_run_options o = tiny_options(write_tiny_config(cfg, MOE_BYTE_VOCAB_SIZE), tmp_path(out, "out"));
    o.data = o.val_data = shard;
    o.steps = 1;
    o.eval_batches = 1;
    seen v;
    run_ok(&o, &v);
    cr_expect(strstr(v.warning, "begins with llm.c's shard magic 20240520 but is read at byte level"), "warning: '%s'",
              v.warning);
}

/* Tokens of another kind than the model's are valid ids and give a loss,
 * a meaningless one: validation on another kind than training, an
 * --init-from checkpoint's recorded kind against this run's, and data
 * whose ids are not the vocabulary of a model without a train state, are
 * warned about; a fresh model of another vocabulary, or its resume, is not. */
Test(train_run, data_of_other_tokens_is_warned_about, .init = make_tmp, .fini = remove_tmp) {
    char cfg[512], out[512], text[512], from[512];
    moe_run_options o = tiny_options(write_tiny_config(cfg, MOE_BYTE_VOCAB_SIZE), tmp_path(out, "bytes"));
    o.data = write_text(text, "text.txt", text_line, 100);
    o.val_data = MOE_RUN_SYNTHETIC;
    seen v;
    run_ok(&o, &v);
    cr_expect(strstr(v.warning, "--val-data synthetic is synthetic data and --data") &&
                  strstr(v.warning, "is bytes data: the model is evaluated on other tokens than it trains on"),
              "warning: '%s'", v.warning);

    moe_run_options e = tiny_options(NULL, tmp_path(out, "eval"));
    e.eval_only = true;
    e.init_from = tmp_path(from, "bytes/step-000010");
    run_ok(&e, &v);
    cr_expect(strstr(v.warning, "bytes/step-000010 was trained on bytes data, and --data synthetic is synthetic data"),
              "warning: '%s'", v.warning);

    /* The same weights without their train state: another trainer's. */
    char state[600];
    snprintf(state, sizeof state, "%s/train_state.safetensors", from);
    cr_assert_eq(remove(state), 0);
    e.out_dir = tmp_path(out, "eval2");
    run_ok(&e, &v);
    cr_expect(strstr(v.warning, "--data synthetic is synthetic data of 54 token ids, and the vocabulary of "
                                "--init-from") &&
                  strstr(v.warning, "has 256: the model was made for other data"),
              "warning: '%s'", v.warning);

    o.val_data = NULL;
    o.data = MOE_RUN_SYNTHETIC;
    o.out_dir = tmp_path(out, "synthetic");
    o.save_every = 5;
    run_ok(&o, &v);
    cr_expect_eq(v.warnings, 0, "a fresh model of 256 ids on the synthetic corpus: '%s'", v.warning);
    o.config = NULL;
    o.save_every = 0;
    o.resume = tmp_path(from, "synthetic/step-000005");
    o.out_dir = tmp_path(out, "resumed");
    run_ok(&o, &v);
    cr_expect_eq(v.warnings, 0, "its resume: '%s'", v.warning);
}

/* Validation data too short for --eval-batches, or holding a token outside
 * the vocabulary where an evaluation reads, is refused before training (it
 * used to fail at the first evaluation, after every step, with the final
 * checkpoint unwritten). A bad token that no evaluation reads is fine. */
Test(train_run, bad_validation_data_is_refused_up_front, .init = make_tmp, .fini = remove_tmp) {
    char cfg[512], out[512], text[512], tiny[512];
    moe_run_options o = tiny_options(write_tiny_config(cfg, MOE_BYTE_VOCAB_SIZE), tmp_path(out, "out"));
    o.data = write_text(text, "text.txt", text_line, 100);
    o.val_data = write_text(tiny, "tiny.txt", "0123456789", 1);
    write_earlier_run(out);
    expect_refused(&o, "10-byte --val-data", (const char *const[]){"--val-data", tiny, "--eval-batches", NULL});
    /* Without --val-data, --data validates too: 2 batches need 257 tokens. */
    o.val_data = NULL;
    o.data = write_text(text, "short.txt", text_line, 4); /* 228 bytes: a batch, not two */
    expect_refused(&o, "228-byte --data validating",
                   (const char *const[]){"validation data (--data)", text, "--eval-batches", NULL});

    enum { VOCAB = 64, N = 1000 };
    int32_t tokens[N];
    char shard[512], val[512];
    fill_tokens(tokens, N, VOCAB, 1);
    cr_assert_eq(moe_data_write_shard(tmp_path(shard, "train_00.bin"), tokens, N, 2), MOE_OK, "%s", moe_last_error());
    o = tiny_options(write_tiny_config(cfg, VOCAB), out);
    o.data = shard;
    o.val_data = tmp_path(val, "val_00.bin");
    o.steps = 2;
    tokens[200] = VOCAB; /* read by the second evaluation batch */
    cr_assert_eq(moe_data_write_shard(val, tokens, N, 2), MOE_OK, "%s", moe_last_error());
    expect_refused(&o, "a token >= vocab_size in --val-data", (const char *const[]){"--val-data", "val_00.bin", NULL});

    tokens[200] = 0;
    tokens[N - 1] = VOCAB; /* past the 2 x 4 x 32 + 1 tokens an evaluation reads */
    cr_assert_eq(moe_data_write_shard(val, tokens, N, 2), MOE_OK, "%s", moe_last_error());
    seen v;
    o.overwrite = true; /* the earlier run is still there */
    run_ok(&o, &v);
    cr_expect_eq(v.steps, 2);

    /* A bad token where the first step reads the training data is refused
     * before --overwrite removes the run already in --out. */
    tokens[N - 1] = 0;
    tokens[5] = VOCAB;
    cr_assert_eq(moe_data_write_shard(shard, tokens, N, 2), MOE_OK, "%s", moe_last_error());
    write_earlier_run(out);
    expect_refused(&o, "a token >= vocab_size in the first step's --data",
                   (const char *const[]){"first step", "train_00.bin", NULL});
}

/* A token outside the vocabulary deep in the training data fails the run
 * at the step that reads it, but the steps before it are saved first, with
 * the data position before that step: once the data are fixed, the run
 * resumes from that checkpoint and ends with the bits of a run that never
 * met the bad token. */
Test(train_run, a_bad_token_mid_run_keeps_the_steps_before_it, .init = make_tmp, .fini = remove_tmp) {
    enum { VOCAB = 64, N = 3000 };
    int32_t tokens[N];
    char cfg[512], out[2][512], shard[512], val[512], resume[512], model[2][600];
    fill_tokens(tokens, N, VOCAB, 5);
    cr_assert_eq(moe_data_write_shard(tmp_path(val, "val_00.bin"), tokens, N, 2), MOE_OK, "%s", moe_last_error());
    /* A step reads 4 x 32 tokens: token 1000 is step 8's. */
    tokens[1000] = VOCAB;
    cr_assert_eq(moe_data_write_shard(tmp_path(shard, "train_00.bin"), tokens, N, 2), MOE_OK, "%s", moe_last_error());
    moe_run_options o = tiny_options(write_tiny_config(cfg, VOCAB), tmp_path(out[0], "cut"));
    o.data = shard;
    o.val_data = val;
    o.save_every = 5;
    seen v;
    moe_run_callbacks cb = callbacks(&v);
    cr_assert_neq(moe_run(&o, &cb), MOE_OK, "a token >= vocab_size at step 8 went through");
    const char *msg = moe_last_error();
    cr_expect(strstr(msg, "train_00.bin") && strstr(msg, "vocab_size") && strstr(msg, "step-000007"), "%s", msg);
    cr_expect_eq(v.steps, 7);
    tokens[1000] = 0;
    cr_assert_eq(moe_data_write_shard(shard, tokens, N, 2), MOE_OK, "%s", moe_last_error());
    o.resume = tmp_path(resume, "cut/step-000007");
    o.config = NULL; /* the checkpoint's */
    run_ok_or_done(&o, &v);
    o.resume = NULL;
    o.config = cfg;
    o.out_dir = tmp_path(out[1], "whole");
    run_ok(&o, &v);
    size_t sizes[2];
    char *bytes[2];
    for (int i = 0; i < 2; i++) {
        snprintf(model[i], sizeof model[i], "%s/step-000010/model.safetensors", out[i]);
        bytes[i] = read_file(model[i], &sizes[i]);
    }
    cr_expect(sizes[0] == sizes[1] && memcmp(bytes[0], bytes[1], sizes[0]) == 0,
              "the resumed run ends elsewhere than the unbroken one");
    free(bytes[0]), free(bytes[1]);
}

/* Training data that changed length since the checkpoint (in order too) is
 * another stream: the position the checkpoint records would read other
 * tokens. */
Test(train_run, resume_refuses_changed_training_data, .init = make_tmp, .fini = remove_tmp) {
    char cfg[512], out[2][512], text[512], resume[512];
    moe_run_options o = tiny_options(write_tiny_config(cfg, MOE_BYTE_VOCAB_SIZE), tmp_path(out[0], "a"));
    o.data = write_text(text, "text.txt", text_line, 100);
    o.steps = 4;
    o.save_every = 2;
    seen v;
    run_ok(&o, &v);
    write_text(text, "text.txt", text_line, 101);
    o.config = NULL;
    o.resume = tmp_path(resume, "a/step-000002");
    o.out_dir = tmp_path(out[1], "b");
    moe_run_callbacks cb = callbacks(&v);
    cr_expect_eq(moe_run(&o, &cb), MOE_ERR_CONFIG);
    cr_expect(strstr(moe_last_error(), "5700") && strstr(moe_last_error(), "5757") &&
                  strstr(moe_last_error(), "text.txt"),
              "message: %s", moe_last_error());
}

/* The last step's checkpoint is written before its evaluation, so a failing
 * evaluation cannot lose the training; evaluations change nothing the
 * checkpoint holds. */
/* A step's evaluation comes before its checkpoint, so that a run killed
 * between the two resumes from an earlier checkpoint and evaluates the
 * step again (one killed after the checkpoint, with the evaluation not yet
 * logged, would resume past it and never log it); it changes nothing the
 * checkpoint holds. */
Test(train_run, evaluation_precedes_its_steps_checkpoint, .init = make_tmp, .fini = remove_tmp) {
    char cfg[512], out[2][512], a[512], b[512];
    write_tiny_config(cfg, MOE_SYNTH_VOCAB_SIZE);
    moe_run_options o = tiny_options(cfg, tmp_path(out[0], "end"));
    o.steps = 4;
    o.shuffle = true;
    seen end, every;
    run_ok(&o, &end);
    cr_expect(end.evals == 1 && end.saved_at_last_eval == 0 && end.saved_step == 4,
              "%d evaluations, the last one after the checkpoint of step %lld; want 1 before step 4's", end.evals,
              (long long)end.saved_at_last_eval);
    o.out_dir = tmp_path(out[1], "every");
    o.eval_every = 1;
    run_ok(&o, &every);
    cr_expect_eq(every.evals, 4);
    static const char *const files[] = {"model.safetensors", "train_state.safetensors"};
    for (int f = 0; f < 2; f++) {
        char name_a[96], name_b[96];
        snprintf(name_a, sizeof name_a, "end/step-000004/%s", files[f]);
        snprintf(name_b, sizeof name_b, "every/step-000004/%s", files[f]);
        cr_expect(same_file(tmp_path(a, name_a), tmp_path(b, name_b)), "%s differs with an evaluation every step",
                  files[f]);
    }
}

/* A pid no process has: a child's, reaped. */
static pid_t dead_pid(void) {
    const pid_t child = fork();
    cr_assert(child >= 0, "fork failed");
    if (child == 0) _exit(0);
    cr_assert_eq(waitpid(child, NULL, 0), child);
    return child;
}

/* What a save or a pruning killed midway leaves in --out (each as large as
 * a checkpoint) goes at the next start that owns --out: a half-written
 * checkpoint, a half-removed one, a set-aside copy whose checkpoint
 * stands. A set-aside copy without its checkpoint is that step's only
 * copy: it stays, and the run says so, under --overwrite too. Files only
 * named like them stay, and so does a leftover that --resume reads, and
 * what a process alive on this host is writing (the test's parent stands
 * for another run at work there). */
Test(train_run, dead_saves_are_cleared_at_the_next_start, .init = make_tmp, .fini = remove_tmp) {
    char cfg[512], out[512], path[600];
    write_tiny_config(cfg, MOE_SYNTH_VOCAB_SIZE);
    moe_run_options o = tiny_options(cfg, tmp_path(out, "out"));
    o.steps = 2;
    o.save_every = 2;
    seen v;
    run_ok(&o, &v);
    /* Checkpoint directories a save or a pruning left, then what writes of
     * the run's files left, each as its pid's (look-alikes take none). */
    /* This process's pid is an earlier process's: it has saved nothing yet. */
    const int dead = (int)dead_pid(), live = (int)getppid(), self = (int)getpid();
    const struct {
        const char *format;
        int pid;
        bool dir, stays;
    } entries[] = {
        {".step-000004.tmp-%d", dead, true, false},  {".step-000002.pruned-%d", dead, true, false},
        {".step-000002.old-%d", dead, true, false},  {".step-000006.old-%d", dead, true, true},
        {".step-000004.tmp-12x", 0, true, true},     {".step-04.tmp-3", 0, true, true},
        {".step-000004.tmp-%d", live, true, true},   {"metrics.jsonl.tmp.%d", dead, false, false},
        {"run.json.tmp.%d", dead, false, false},     {"config.json.tmp.%d", dead, false, false},
        {"metrics.jsonl.tmp.63x", 0, false, true},   {"notes.txt.tmp.5", 0, false, true},
        {"run.json.tmp.", 0, false, true},           {"metrics.jsonl.tmp.%d", live, false, true},
        {".step-000002.pruned-%d", self, true, false},
    };
    enum { N_ENTRIES = sizeof entries / sizeof *entries, ONLY_COPY = 3 };
    char names[N_ENTRIES][64], only_copy[128];
    for (int i = 0; i < N_ENTRIES; i++) {
        snprintf(names[i], sizeof names[i], entries[i].format, entries[i].pid);
        snprintf(path, sizeof path, "%s/%.63s", out, names[i]);
        if (entries[i].dir) {
            cr_assert_eq(mkdir(path, 0777), 0, "%s", path);
            snprintf(path, sizeof path, "%s/%.63s/model.safetensors", out, names[i]);
        }
        cr_assert_eq(moe_file_write_atomic_buffer(path, "x", 1), MOE_OK, "%s", moe_last_error());
    }
    o.steps = 4;
    o.resume = MOE_RUN_RESUME_LATEST;
    run_ok(&o, &v);
    struct stat sb;
    for (int i = 0; i < N_ENTRIES; i++) {
        snprintf(path, sizeof path, "%s/%.63s", out, names[i]);
        cr_expect_eq(stat(path, &sb) == 0, entries[i].stays, "%s %s", names[i],
                     entries[i].stays ? "was removed" : "is still there");
    }
    snprintf(only_copy, sizeof only_copy, "%s is the only copy of step-000006", names[ONLY_COPY]);
    cr_expect(v.warnings == 1 && strstr(v.warning, only_copy), "%d: %s", v.warnings, v.warning);
    o.resume = NULL;
    o.overwrite = true;
    run_ok(&o, &v);
    snprintf(path, sizeof path, "%s/%s", out, names[ONLY_COPY]);
    cr_expect(stat(path, &sb) == 0 && v.warnings == 1, "--overwrite removed %s, the only copy of its step",
              names[ONLY_COPY]);
    /* A set-aside copy of a checkpoint that stands, cut by an in-place
     * resume of an earlier one (under --overwrite, which removes the later
     * checkpoints): removed as a copy, not named as the only one. */
    char at4[600];
    snprintf(at4, sizeof at4, "%s/step-000004", out);
    snprintf(path, sizeof path, "%s/.step-000004.old-%d", out, dead);
    cr_assert_eq(rename(at4, path), 0);
    cr_assert_eq(mkdir(at4, 0777), 0);
    snprintf(at4, sizeof at4, "%s/step-000002", out);
    o.resume = at4;
    o.config = NULL;
    run_ok(&o, &v);
    cr_expect(stat(path, &sb) != 0, "the set-aside copy of a standing checkpoint stayed");
    cr_expect(v.warnings == 1 && strstr(v.warning, "step-000006"), "%d warnings: %s", v.warnings, v.warning);
}

/* A run of 3 steps into tmp's out by --resume latest, each checkpointed. */
static moe_run_options three_steps_latest(char *cfg, char *out, seen *v) {
    moe_run_options o = tiny_options(write_tiny_config(cfg, MOE_SYNTH_VOCAB_SIZE), tmp_path(out, "out"));
    o.steps = 3;
    o.save_every = 1;
    o.resume = MOE_RUN_RESUME_LATEST;
    run_ok(&o, v);
    return o;
}

/* --resume latest reads metrics.jsonl's last whole line with a step as
 * bytes: a NUL inside an earlier line does not end the file there (it
 * resumed from that line's step, throwing away the later checkpoints). */
Test(train_run, resume_latest_reads_past_a_nul_byte, .init = make_tmp, .fini = remove_tmp) {
    char cfg[512], out[512], log[600];
    seen v;
    moe_run_options o = three_steps_latest(cfg, out, &v);
    snprintf(log, sizeof log, "%s/metrics.jsonl", out);
    size_t size;
    char *text = read_file(log, &size);
    char *second = strchr(text, '\n') + 1;
    second[2] = '\0'; /* inside the key "step" of step 2's line */
    cr_assert_eq(moe_file_write_atomic_buffer(log, text, size), MOE_OK, "%s", moe_last_error());
    free(text);
    o.steps = 4;
    run_ok(&o, &v);
    cr_expect_eq(v.steps, 1, "resumed for %d steps, not from step 3's checkpoint", v.steps);
}

/* A stop request (a signal, in moe-train) ends the run after the step in
 * progress, checkpointed, without the final evaluation; --resume latest
 * then continues it to the same bits as a run never stopped. --max-time
 * stops after the first step past it. */
static volatile sig_atomic_t stop_flag;
static int64_t stop_after;

static void stop_at_step(void *ctx, const moe_run_step *s) {
    on_step(ctx, s);
    if (s->metrics.step == stop_after) stop_flag = 1;
}

Test(train_run, stop_request_checkpoints_and_resumes, .init = make_tmp, .fini = remove_tmp) {
    char cfg[512], out[2][512], a[512], b[512];
    moe_run_options o = tiny_options(write_tiny_config(cfg, MOE_SYNTH_VOCAB_SIZE), tmp_path(out[0], "stopped"));
    o.steps = 6;
    o.save_every = 4;
    o.eval_every = 2;
    o.resume = MOE_RUN_RESUME_LATEST;
    seen v;
    moe_run_callbacks cb = callbacks(&v);
    cb.on_step = stop_at_step;
    cb.stop = &stop_flag;
    stop_flag = 0;
    stop_after = 3;
    cr_assert_eq(moe_run(&o, &cb), MOE_OK, "%s", moe_last_error());
    cr_expect(v.steps == 3 && v.saved_step == 3 && v.evals == 1 && v.ends == 1, "%d steps, saved %lld, %d evals",
              v.steps, (long long)v.saved_step, v.evals);
    cr_expect(isnan(v.end_val) && !v.kinds_ok, "a stopped run reports the last evaluation (%g) as its end's",
              v.end_val);
    stop_flag = 0;
    stop_after = -1;
    cb = callbacks(&v);
    cb.stop = &stop_flag;
    cr_assert_eq(moe_run(&o, &cb), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(v.steps, 3, "the resumed run took %d steps", v.steps);
    o.out_dir = tmp_path(out[1], "whole");
    run_ok(&o, &v);
    cr_expect(same_file(tmp_path(a, "stopped/step-000006/model.safetensors"),
                        tmp_path(b, "whole/step-000006/model.safetensors")),
              "stopped and resumed differs from a run never stopped");

    o.out_dir = out[0];
    o.resume = NULL;
    o.overwrite = true;
    o.max_time = 1e-9;
    run_ok(&o, &v);
    cr_expect(v.steps == 1 && v.saved_step == 1, "--max-time 1e-9: %d steps, saved %lld", v.steps,
              (long long)v.saved_step);
}

/* After a crash past the checkpoint of step 5, the resumed run's
 * metrics.jsonl holds each step once: the records after step 5 (and a
 * half-written last line) are dropped before the steps are logged again. */
Test(train_run, resume_logs_each_step_once, .init = make_tmp, .fini = remove_tmp) {
    char cfg[512], out[512], path[512], resume[512];
    moe_run_options o = tiny_options(write_tiny_config(cfg, MOE_SYNTH_VOCAB_SIZE), tmp_path(out, "out"));
    o.eval_every = 5;
    o.save_every = 5;
    seen v;
    run_ok(&o, &v);
    FILE *f = fopen(tmp_path(path, "out/metrics.jsonl"), "a");
    cr_assert(f);
    fputs("{\"step\":11,\"loss\":1.0", f); /* cut off by the crash */
    cr_assert_eq(fclose(f), 0);

    o.config = NULL;
    o.resume = tmp_path(resume, "out/step-000005");
    o.overwrite = true; /* step 10's checkpoint, which the resumed run writes again */
    run_ok(&o, &v);
    cr_assert_eq(v.steps, 5);
    size_t size;
    char *text = read_file(path, &size);
    int step_lines[12] = {0}, eval_lines[12] = {0}, other = 0;
    for (char *line = strtok(text, "\n"); line; line = strtok(NULL, "\n")) {
        moe_json_doc *doc;
        int64_t step = -1;
        if (moe_json_parse(&doc, line, strlen(line), "metrics.jsonl") != MOE_OK) {
            other++;
            continue;
        }
        const moe_json *root = moe_json_root(doc);
        const moe_json *s = moe_json_get(root, "step");
        if (s && moe_json_int64(s, &step) == MOE_OK && step >= 1 && step <= 11)
            (moe_json_get(root, "val_loss") ? eval_lines : step_lines)[step]++;
        else
            other++;
        moe_json_free(doc);
    }
    free(text);
    for (int s = 1; s <= 11; s++) {
        cr_expect_eq(step_lines[s], s <= 10, "step %d logged %d times", s, step_lines[s]);
        cr_expect_eq(eval_lines[s], s == 5 || s == 10, "step %d evaluated %d times", s, eval_lines[s]);
    }
    cr_expect_eq(other, 0, "%d lines without a step", other);
}

/* A resume cuts metrics.jsonl at its end only, after the checkpoint's
 * step: a damaged line before it stays byte for byte, named in a warning,
 * and one after it goes with the rest. A log cut off before its first
 * whole line stops before the checkpoint: --resume latest refuses it and
 * leaves it as it was. */
Test(train_run, resume_cuts_only_the_end_of_metrics, .init = make_tmp, .fini = remove_tmp) {
    char cfg[512], out[512], log[512], at3[512];
    seen v;
    moe_run_options o = three_steps_latest(cfg, out, &v);
    cr_assert_eq(moe_remove_tree(tmp_path(at3, "out/step-000003")), MOE_OK, "%s", moe_last_error());
    size_t size;
    char *text = read_file(tmp_path(log, "out/metrics.jsonl"), &size);
    char *second = strchr(text, '\n') + 1, *third = strchr(second, '\n') + 1;
    cr_assert(strstr(text, "\"loss\":") < second && strstr(third, "\"loss\":"), "%s", text);
    strstr(text, "\"loss\":")[6] = 'x';  /* step 1's line, before the checkpoint */
    strstr(third, "\"loss\":")[6] = 'x'; /* step 3's, after it, whose start still says its step */
    /* A stray copy of step 1's line at the end goes with what follows step 2. */
    char *stray = malloc(size + (size_t)(second - text));
    memcpy(stray, text, size);
    memcpy(stray + size, text, (size_t)(second - text));
    cr_assert_eq(moe_file_write_atomic_buffer(log, stray, size + (size_t)(second - text)), MOE_OK, "%s",
                 moe_last_error());
    free(stray);
    run_ok(&o, &v);
    cr_expect_eq(v.steps, 1, "resumed for %d steps", v.steps);
    cr_expect(strstr(v.warning, "1 line before step 2's checkpoint does not parse") &&
                  strstr(v.warning, "line 1") && !strstr(v.warning, "line 3"),
              "%d warnings: %s", v.warnings, v.warning);
    size_t after_size;
    char *after = read_file(log, &after_size);
    const size_t head = (size_t)(third - text);
    cr_expect(after_size > head && memcmp(after, text, head) == 0, "the lines up to step 2 changed:\n%.*s", (int)head,
              after);
    int lines = 0;
    for (const char *c = after; (c = strchr(c, '\n')); c++) lines++;
    cr_expect_eq(lines, 4, "%d lines, not steps 1 to 3 and step 3's evaluation:\n%s", lines, after);
    free(after);
    free(text);

    static const char cut[] = "{\"step\":1,\"lo";
    cr_assert_eq(moe_file_write_atomic_buffer(log, cut, sizeof cut - 1), MOE_OK, "%s", moe_last_error());
    o.steps = 4;
    moe_run_callbacks cb = callbacks(&v);
    cr_expect_eq(moe_run(&o, &cb), MOE_ERR_CONFIG);
    cr_expect(strstr(moe_last_error(), "step-000003, later than the last step its metrics.jsonl logged, none"),
              "message: %s", moe_last_error());
    after = read_file(log, &after_size);
    cr_expect(after_size == sizeof cut - 1 && memcmp(after, cut, after_size) == 0,
              "the refused resume changed the log");
    free(after);
}

/* --resume latest with no checkpoint in --out starts the run over,
 * replacing the files of a start that died before its first checkpoint,
 * and names the last logged step that replaces. */
Test(train_run, resume_latest_without_a_checkpoint_says_what_it_replaces, .init = make_tmp, .fini = remove_tmp) {
    char cfg[512], out[512], path[600];
    seen v;
    moe_run_options o = three_steps_latest(cfg, out, &v);
    for (int step = 1; step <= 3; step++) {
        snprintf(path, sizeof path, "%s/step-%06d", out, step);
        cr_assert_eq(moe_remove_tree(path), MOE_OK, "%s", moe_last_error());
    }
    run_ok(&o, &v);
    cr_expect_eq(v.steps, 3, "started over for %d steps", v.steps);
    cr_expect(v.warnings == 1 && strstr(v.warning, "holds no checkpoint: the run starts over, replacing its "
                                                   "metrics.jsonl, which logged steps up to 3"),
              "%d warnings: %s", v.warnings, v.warning);
}

/* A metrics.jsonl write that fails says why, as a checkpoint's does. The
 * file size limit stands for a full disk: run.json fits under it, and the
 * log passes it long before the run's one checkpoint. */
Test(train_run, a_failed_metrics_write_says_why, .init = make_tmp, .fini = remove_tmp) {
    char cfg[512], out[512];
    moe_run_options o = tiny_options(write_tiny_config(cfg, MOE_SYNTH_VOCAB_SIZE), tmp_path(out, "out"));
    o.steps = 200;
    o.warmup = 1;
    signal(SIGXFSZ, SIG_IGN); /* the write fails with EFBIG instead */
    const struct rlimit limit = {.rlim_cur = 16 << 10, .rlim_max = RLIM_INFINITY};
    cr_assert_eq(setrlimit(RLIMIT_FSIZE, &limit), 0);
    seen v;
    moe_run_callbacks cb = callbacks(&v);
    cr_expect_eq(moe_run(&o, &cb), MOE_ERR_IO);
    char want[600];
    snprintf(want, sizeof want, "%s/metrics.jsonl: write failed: %s", out, strerror(EFBIG));
    cr_expect(strstr(moe_last_error(), want), "\"%s\" lacks \"%s\"", moe_last_error(), want);
    cr_expect(v.steps > 0 && v.steps < o.steps, "failed after %d steps", v.steps);
}

/* A resumed run that fails before its first step leaves metrics.jsonl as
 * it was: the lines past the checkpoint describe checkpoints still on
 * disk. */
Test(train_run, failed_resume_keeps_the_metrics, .init = make_tmp, .fini = remove_tmp) {
    char cfg[512], out[512], path[512], resume[512];
    moe_run_options o = tiny_options(write_tiny_config(cfg, MOE_SYNTH_VOCAB_SIZE), tmp_path(out, "out"));
    o.save_every = 5;
    seen v;
    run_ok(&o, &v);
    size_t before_size, after_size;
    char *before = read_file(tmp_path(path, "out/metrics.jsonl"), &before_size);
    /* The resumed run's training data cannot hold one batch. */
    o.config = NULL;
    o.resume = tmp_path(resume, "out/step-000005");
    o.batch_size = 4000;
    moe_run_callbacks cb = callbacks(&v);
    cr_assert_neq(moe_run(&o, &cb), MOE_OK, "the resumed run succeeded");
    char *after = read_file(path, &after_size);
    cr_expect(before_size == after_size && memcmp(before, after, before_size) == 0,
              "metrics.jsonl changed from %zu to %zu bytes", before_size, after_size);
    free(before);
    free(after);
}

/* The __metadata__ value of key in tmp's file name, copied into value [64]. */
static const char *state_meta(char *value, const char *name, const char *key) {
    char path[512];
    moe_st_file *f;
    cr_assert_eq(moe_st_open(&f, tmp_path(path, name)), MOE_OK, "%s", moe_last_error());
    const char *v = moe_st_metadata(f, key);
    snprintf(value, 64, "%s", v ? v : "(none)");
    moe_st_close(f);
    return value;
}

static void expect_same_checkpoints(const char *a, const char *b, const char *why) {
    static const char *const files[] = {"model.safetensors", "train_state.safetensors"};
    for (int f = 0; f < 2; f++) {
        char name_a[96], name_b[96], path_a[512], path_b[512];
        snprintf(name_a, sizeof name_a, "%s/%s", a, files[f]);
        snprintf(name_b, sizeof name_b, "%s/%s", b, files[f]);
        cr_expect(same_file(tmp_path(path_a, name_a), tmp_path(path_b, name_b)), "%s: %s differs", why, files[f]);
    }
}

/* A shuffled run of 5 steps resumed with --steps 10 reads on in its own
 * corpus of 5 batches, into epoch 1 (reshuffled), rather than in the order
 * of a 10-batch corpus, which read some of the first 5 batches again and
 * others never: the checkpoint of step 10 records the corpus of 5 x 4 x 32
 * + 1 tokens and stands 5 batches into its epoch 1. And 5 + 5 steps give
 * the bytes of 5 + 2 + 3, which read the same stream. The schedule is
 * constant after the warm-up, so --steps changes nothing else. */
Test(train_run, resume_with_more_steps_reads_the_checkpoints_stream, .init = make_tmp, .fini = remove_tmp) {
    char cfg[512], out[3][512], resume[512], value[64];
    moe_run_options o = tiny_options(write_tiny_config(cfg, MOE_SYNTH_VOCAB_SIZE), tmp_path(out[0], "five"));
    o.shuffle = true;
    o.steps = 5;
    o.lr_schedule = MOE_LR_CONSTANT;
    o.min_lr = NAN;
    seen v;
    run_ok(&o, &v);

    o.config = NULL;
    o.resume = tmp_path(resume, "five/step-000005");
    o.steps = 10;
    o.out_dir = tmp_path(out[1], "ten");
    run_ok(&o, &v);
    cr_assert_eq(v.steps, 5);
    o.steps = 7;
    o.out_dir = tmp_path(out[2], "seven");
    run_ok(&o, &v);
    o.resume = tmp_path(resume, "seven/step-000007");
    o.steps = 10;
    run_ok(&o, &v);
    cr_assert_eq(v.steps, 3);
    expect_same_checkpoints("ten/step-000010", "seven/step-000010", "5 + 5 steps against 5 + 2 + 3");
    cr_expect_str_eq(state_meta(value, "ten/step-000010/train_state.safetensors", "data_epoch"), "1");
    cr_expect_str_eq(state_meta(value, "ten/step-000010/train_state.safetensors", "data_token"), "640");
    cr_expect_str_eq(state_meta(value, "ten/step-000010/train_state.safetensors", "data_tokens"), "641");
}

/* Rewrites a safetensors file without the metadata keys in drop
 * (NULL-terminated), with set_key's value replaced by set_value (set_key
 * NULL: none) and the first element of tensor set to value (tensor NULL:
 * none). Returns how many keys and tensors it dropped or replaced. */
static int64_t rewrite_safetensors(const char *path, const char *const *drop, const char *set_key,
                                   const char *set_value, const char *tensor, float value) {
    moe_st_file *f;
    cr_assert_eq(moe_st_open(&f, path), MOE_OK, "%s", moe_last_error());
    const int64_t nt = moe_st_tensor_count(f), nm = moe_st_metadata_count(f);
    moe_st_entry *entries = calloc((size_t)nt, sizeof *entries);
    moe_st_meta *meta = calloc((size_t)nm, sizeof *meta);
    float **values = calloc((size_t)nt, sizeof *values);
    cr_assert(entries && meta && values);
    for (int64_t i = 0; i < nt; i++) {
        const moe_st_tensor *t = moe_st_tensor_at(f, i);
        values[i] = malloc((size_t)t->numel * sizeof(float));
        cr_assert(values[i]);
        moe_st_read_f32(values[i], t);
        entries[i] = (moe_st_entry){t->name, values[i], t->ndim, t->shape};
    }
    int64_t kept = 0, changed = 0;
    for (int64_t i = 0; tensor && i < nt; i++)
        if (strcmp(entries[i].name, tensor) == 0) values[i][0] = value, changed++;
    for (int64_t i = 0; i < nm; i++) {
        moe_st_metadata_at(f, i, &meta[kept].key, &meta[kept].value);
        const char *key = meta[kept].key;
        bool dropped = false;
        for (const char *const *d = drop; *d; d++) dropped = dropped || strcmp(key, *d) == 0;
        if (set_key && strcmp(key, set_key) == 0) meta[kept].value = set_value, changed++;
        if (dropped)
            changed++;
        else if (!moe_st_reserved_key(key)) /* moe_st_write writes its own */
            kept++;
    }
    cr_assert_eq(moe_st_write(path, entries, nt, meta, kept), MOE_OK, "%s", moe_last_error());
    for (int64_t i = 0; i < nt; i++) free(values[i]);
    free(values), free(meta), free(entries);
    moe_st_close(f);
    return changed;
}

/* A recorded position outside the data is named as the checkpoint's. */
Test(train_run, resume_names_a_bad_data_position, .init = make_tmp, .fini = remove_tmp) {
    char cfg[512], out[2][512], text[512], resume[512], path[512];
    moe_run_options o = tiny_options(write_tiny_config(cfg, MOE_BYTE_VOCAB_SIZE), tmp_path(out[0], "a"));
    o.data = write_text(text, "text.txt", text_line, 100);
    o.steps = 2;
    o.save_every = 1;
    seen v;
    run_ok(&o, &v);
    cr_assert_eq(rewrite_safetensors(tmp_path(path, "a/step-000001/train_state.safetensors"),
                                     (const char *const[]){NULL}, "data_token", "9999999", NULL, 0.0f),
                 1);
    o.config = NULL;
    o.resume = tmp_path(resume, "a/step-000001");
    o.out_dir = tmp_path(out[1], "b");
    moe_run_callbacks cb = callbacks(&v);
    cr_expect_neq(moe_run(&o, &cb), MOE_OK);
    cr_expect(strstr(moe_last_error(), "--resume") && strstr(moe_last_error(), "data position"), "message: %s",
              moe_last_error());
}

/* A checkpoint whose state records another step than its name is refused,
 * by name and as --resume latest: resumed, it would skip steps 4 to 7 (and
 * the learning rate's schedule with them). */
Test(train_run, resume_refuses_a_step_its_name_denies, .init = make_tmp, .fini = remove_tmp) {
    char cfg[512], out[512], resume[512], path[512];
    moe_run_options o = tiny_options(write_tiny_config(cfg, MOE_SYNTH_VOCAB_SIZE), tmp_path(out, "a"));
    o.steps = 3;
    o.save_every = 1;
    seen v;
    run_ok(&o, &v);
    cr_assert_eq(rewrite_safetensors(tmp_path(path, "a/step-000003/train_state.safetensors"),
                                     (const char *const[]){NULL}, "step", "7", NULL, 0.0f),
                 1);
    o.config = NULL;
    o.steps = 9;
    moe_run_callbacks cb = callbacks(&v);
    const char *resumes[] = {MOE_RUN_RESUME_LATEST, tmp_path(resume, "a/step-000003")};
    for (int i = 0; i < 2; i++) {
        o.resume = resumes[i];
        cr_expect_eq(moe_run(&o, &cb), MOE_ERR_FORMAT, "--resume %s", resumes[i]);
        cr_expect(strstr(moe_last_error(), "step-000003") && strstr(moe_last_error(), "says step 7"),
                  "message: %s", moe_last_error());
    }
}

/* Weights that are finite but overflow the model (one flipped exponent bit
 * makes a norm's weight 3e38) give a non-finite validation loss, which
 * --eval-only blames on --init-from's file rather than printing it. */
Test(train_run, eval_only_refuses_weights_that_overflow, .init = make_tmp, .fini = remove_tmp) {
    char cfg[512], out[512], path[1024];
    moe_run_options o = tiny_options(write_tiny_config(cfg, MOE_SYNTH_VOCAB_SIZE), tmp_path(out, "out"));
    o.steps = 2;
    seen v, ev;
    run_ok(&o, &v);
    snprintf(path, sizeof path, "%s/model.safetensors", v.checkpoint);
    cr_assert_eq(rewrite_safetensors(path, (const char *const[]){NULL}, NULL, NULL, "model.norm.weight", 3e38f), 1);
    moe_run_options e = tiny_options(NULL, tmp_path(out, "unused"));
    e.eval_only = true;
    e.init_from = v.checkpoint;
    moe_run_callbacks cb = callbacks(&ev);
    cr_expect_eq(moe_run(&e, &cb), MOE_ERR_FORMAT);
    cr_expect(strstr(moe_last_error(), v.checkpoint) && strstr(moe_last_error(), "overflow"), "message: %s",
              moe_last_error());
}

/* Old checkpoints (without the stream's length) resume as they always did:
 * at the length of this run, right when --steps is the one they were
 * written with, which a warning says; one whose shuffled position falls
 * between this run's batches is refused up front. */
Test(train_run, resume_of_a_checkpoint_without_its_stream, .init = make_tmp, .fini = remove_tmp) {
    char cfg[512], out[2][512], resume[512], path[512];
    moe_run_options o = tiny_options(write_tiny_config(cfg, MOE_SYNTH_VOCAB_SIZE), tmp_path(out[0], "straight"));
    o.shuffle = true;
    o.save_every = 5;
    seen v;
    run_ok(&o, &v);

    /* train_state.safetensors as an older version wrote it (the shuffle's
     * seed kept: a checkpoint without it is the next test's). */
    cr_assert_eq(rewrite_safetensors(tmp_path(path, "straight/step-000005/train_state.safetensors"),
                                     (const char *const[]){"data_tokens", "data_chunk", NULL}, NULL, NULL, NULL,
                                     0.0f),
                 2, "the checkpoint should record its stream");

    o.config = NULL;
    o.save_every = 0;
    o.resume = tmp_path(resume, "straight/step-000005");
    o.out_dir = tmp_path(out[1], "resumed");
    run_ok(&o, &v);
    cr_assert_eq(v.steps, 5);
    expect_same_checkpoints("straight/step-000010", "resumed/step-000010", "10 steps against an old 5 + 5");
    cr_expect(v.warnings == 1 && strstr(v.warning, "--steps (10 here)"), "warnings %d: %s", v.warnings, v.warning);

    /* Its shuffled position (5 batches of 4 rows) falls between two batches
     * of 3 rows: refused up front, not at the first step after the run's
     * files were rewritten. */
    o.batch_size = 3;
    o.out_dir = tmp_path(out[1], "again");
    write_earlier_run(o.out_dir);
    expect_refused(&o, "an old shuffled checkpoint with another batch shape",
                   (const char *const[]){"--resume", "--batch-size", NULL});
}

/* A shuffled checkpoint resumes in the order of the seed it records, and
 * one that records none (an older writer's) in the order of --seed itself,
 * which is not the order of a fresh run: that would draw from the bits of
 * the initial weights. */
Test(train_run, resume_shuffles_by_the_recorded_seed, .init = make_tmp, .fini = remove_tmp) {
    char cfg[512], out[512], resume[512], path[512], name[96], value[64], seed[24];
    moe_run_options o = tiny_options(write_tiny_config(cfg, MOE_SYNTH_VOCAB_SIZE), NULL);
    o.shuffle = true;
    o.save_every = 5;
    seen v;
    static const char *const runs[] = {"unrecorded", "recorded"};
    for (int i = 0; i < 2; i++) {
        o.out_dir = tmp_path(out, runs[i]);
        run_ok(&o, &v);
    }
    snprintf(seed, sizeof seed, "%llu", (unsigned long long)o.seed);
    cr_expect_str_neq(state_meta(value, "recorded/step-000005/train_state.safetensors", "data_shuffle_seed"), seed);
    cr_assert_eq(rewrite_safetensors(tmp_path(path, "unrecorded/step-000005/train_state.safetensors"),
                                     (const char *const[]){"data_shuffle_seed", NULL}, NULL, NULL, NULL, 0.0f),
                 1);
    cr_assert_eq(rewrite_safetensors(tmp_path(path, "recorded/step-000005/train_state.safetensors"),
                                     (const char *const[]){NULL}, "data_shuffle_seed", seed, NULL, 0.0f),
                 1);
    o.config = NULL;
    o.save_every = 0;
    for (int i = 0; i < 2; i++) {
        snprintf(name, sizeof name, "%s/step-000005", runs[i]);
        o.resume = tmp_path(resume, name);
        snprintf(name, sizeof name, "%s-resumed", runs[i]);
        o.out_dir = tmp_path(out, name);
        run_ok(&o, &v);
        cr_assert_eq(v.steps, 5);
        snprintf(name, sizeof name, "%s-resumed/step-000010/train_state.safetensors", runs[i]);
        cr_expect_str_eq(state_meta(value, name, "data_shuffle_seed"), seed, "%s", name);
    }
    char a[512], b[512];
    cr_expect(same_file(tmp_path(a, "unrecorded-resumed/step-000010/model.safetensors"),
                        tmp_path(b, "recorded-resumed/step-000010/model.safetensors")),
              "a checkpoint without data_shuffle_seed is not resumed in the order of --seed");
    cr_expect(!same_file(tmp_path(a, "recorded/step-000010/model.safetensors"),
                         tmp_path(b, "recorded-resumed/step-000010/model.safetensors")),
              "the recorded seed changed nothing: the resume did not read it");
}

/* A model whose head is its embedding trains, saves the one tensor once
 * (as transformers saves a tied model) with a config that says so, and
 * resumes bit for bit. */
Test(train_run, tied_embeddings_train_save_and_resume, .init = make_tmp, .fini = remove_tmp) {
    char cfg[512], out[512], resume[512], a[512];
    moe_model_config c;
    cr_assert_eq(moe_model_config_load(&c, write_tiny_config(cfg, MOE_SYNTH_VOCAB_SIZE), NULL, NULL), MOE_OK);
    c.tie_word_embeddings = true;
    cr_assert_eq(moe_model_config_save(&c, tmp_path(cfg, "tied.json")), MOE_OK, "%s", moe_last_error());
    moe_run_options o = tiny_options(cfg, tmp_path(out, "straight"));
    o.save_every = 5;
    o.eval_every = 5;
    seen v;
    run_ok(&o, &v);
    cr_expect(v.end_val < v.first_val, "val_loss %g -> %g", v.first_val, v.end_val);
    moe_st_file *f;
    cr_assert_eq(moe_st_open(&f, tmp_path(a, "straight/step-000010/model.safetensors")), MOE_OK, "%s",
                 moe_last_error());
    cr_expect_null(moe_st_find(f, "lm_head.weight"));
    cr_expect_not_null(moe_st_find(f, "model.embed_tokens.weight"));
    moe_st_close(f);
    moe_model_config saved;
    cr_assert_eq(moe_model_config_load(&saved, tmp_path(a, "straight/step-000010/config.json"), NULL, NULL), MOE_OK,
                 "%s", moe_last_error());
    cr_expect(saved.tie_word_embeddings);

    o.config = NULL;
    o.save_every = 0;
    o.resume = tmp_path(resume, "straight/step-000005");
    o.out_dir = tmp_path(out, "resumed");
    run_ok(&o, &v);
    cr_assert_eq(v.steps, 5);
    expect_same_checkpoints("straight/step-000010", "resumed/step-000010", "10 steps against 5 + 5");
}

/* A resume under which the checkpoint's position would read another
 * stream is refused, naming the flag, before anything is written: the
 * shuffle turned off or on, a shuffled batch shape changed (the shuffled
 * chunks are the batches), a shuffled file of another length, another kind
 * of data. */
Test(train_run, resume_refuses_another_stream, .init = make_tmp, .fini = remove_tmp) {
    char cfg[512], out[4][512], resume[512], text[512];
    moe_run_options o = tiny_options(write_tiny_config(cfg, MOE_SYNTH_VOCAB_SIZE), tmp_path(out[0], "shuffled"));
    o.steps = 2;
    o.shuffle = true;
    seen v;
    run_ok(&o, &v);
    o.out_dir = tmp_path(out[1], "ordered");
    o.shuffle = false;
    run_ok(&o, &v);
    o.config = write_tiny_config(cfg, MOE_BYTE_VOCAB_SIZE);
    o.data = write_text(text, "text.txt", text_line, 20);
    o.out_dir = tmp_path(out[2], "file");
    o.shuffle = true;
    run_ok(&o, &v);

    o.config = NULL;
    o.steps = 4;
    o.out_dir = tmp_path(out[3], "again");
    write_earlier_run(o.out_dir);
    o.resume = tmp_path(resume, "file/step-000002");
    write_text(text, "text.txt", text_line, 21);
    expect_refused(&o, "a shuffled file that grew", (const char *const[]){"--data", text, "1140", "1197", NULL});

    /* A synthetic checkpoint on a file. */
    o.resume = tmp_path(resume, "shuffled/step-000002");
    expect_refused(&o, "a synthetic checkpoint on a text file",
                   (const char *const[]){"--data", "synthetic data", "bytes data", NULL});

    o.data = MOE_RUN_SYNTHETIC;
    o.shuffle = false;
    expect_refused(&o, "a shuffled checkpoint without --shuffle", (const char *const[]){"--shuffle", NULL});
    o.shuffle = true;
    o.batch_size = 2;
    expect_refused(&o, "a shuffled checkpoint with half the batch", (const char *const[]){"--batch-size", NULL});
    o.batch_size = 4;
    o.resume = tmp_path(resume, "ordered/step-000002");
    expect_refused(&o, "an ordered checkpoint with --shuffle", (const char *const[]){"--shuffle", NULL});
    o.batch_size = 3; /* its position is between two of these batches: the cause is still --shuffle */
    expect_refused(&o, "an ordered checkpoint with --shuffle and another batch", (const char *const[]){"--shuffle", NULL});
}

/* A recorded synthetic stream shorter than one batch (only an edited or
 * damaged checkpoint holds one) is blamed on the checkpoint, not --data. */
Test(train_run, resume_refuses_a_stream_shorter_than_a_batch, .init = make_tmp, .fini = remove_tmp) {
    char cfg[512], out[2][512], resume[512], path[512];
    moe_run_options o = tiny_options(write_tiny_config(cfg, MOE_SYNTH_VOCAB_SIZE), tmp_path(out[0], "first"));
    o.steps = 2;
    seen v;
    run_ok(&o, &v);
    cr_assert_eq(rewrite_safetensors(tmp_path(path, "first/step-000002/train_state.safetensors"),
                                     (const char *const[]){NULL}, "data_tokens", "5", NULL, 0.0f),
                 1, "the checkpoint should record its stream");

    o.config = NULL;
    o.steps = 4;
    o.resume = tmp_path(resume, "first/step-000002");
    o.out_dir = tmp_path(out[1], "again");
    write_earlier_run(o.out_dir);
    expect_refused(&o, "a recorded stream of 5 tokens", (const char *const[]){"--resume", resume, "5 tokens", NULL});
}

/* ------------------------------------------------------------- lr schedule */

/* moe_lr_at at the edges: warm-up from lr / warmup up to lr, then the decay
 * ends at min_lr on the last step, also when the decay is one step long.
 * Mid-decay, where cosine and linear differ (not at progress 1/2, where
 * they agree): known values at progress 1/3 and 2/3 (cosine 3/4 and 1/4 of
 * the way from min_lr to lr), then every step of a longer decay against
 * the formula. */
Test(train_run, lr_schedule_edges, .init = make_tmp, .fini = remove_tmp) {
    static const struct {
        moe_lr_schedule schedule;
        int64_t warmup, total, step;
        double want;
    } cases[] = {
        {MOE_LR_COSINE, 2, 3, 0, 0.5},   {MOE_LR_COSINE, 2, 3, 1, 1.0},    {MOE_LR_COSINE, 2, 3, 2, 0.1},
        {MOE_LR_LINEAR, 2, 3, 2, 0.1},   {MOE_LR_CONSTANT, 2, 3, 2, 1.0},  {MOE_LR_COSINE, 0, 1, 0, 0.1},
        {MOE_LR_LINEAR, 0, 1, 0, 0.1},   {MOE_LR_COSINE, 0, 2, 0, 1.0},    {MOE_LR_COSINE, 0, 2, 1, 0.1},
        {MOE_LR_COSINE, 2, 10, 2, 1.0},  {MOE_LR_COSINE, 2, 10, 9, 0.1},   {MOE_LR_LINEAR, 2, 10, 9, 0.1},
        {MOE_LR_LINEAR, 2, 10, 5, 1.0 - 0.9 * 3.0 / 7.0},                  {MOE_LR_COSINE, 4, 4, 3, 1.0},
        {MOE_LR_COSINE, 8, 4, 3, 0.5},
        {MOE_LR_COSINE, 2, 6, 3, 0.1 + 0.9 * 0.75},  {MOE_LR_COSINE, 2, 6, 4, 0.1 + 0.9 * 0.25},
        {MOE_LR_LINEAR, 2, 6, 3, 0.1 + 0.9 * 2.0 / 3.0}, {MOE_LR_LINEAR, 2, 6, 4, 0.1 + 0.9 / 3.0},
        /* wsd (decay_frac 0.2): stable until the last 2 of the 10 steps
         * after warm-up, each lower, the last at min_lr; a decay of one step. */
        {MOE_LR_WSD, 2, 12, 1, 1.0},     {MOE_LR_WSD, 2, 12, 9, 1.0},      {MOE_LR_WSD, 2, 12, 10, 0.55},
        {MOE_LR_WSD, 2, 12, 11, 0.1},    {MOE_LR_WSD, 2, 3, 2, 0.1},       {MOE_LR_WSD, 0, 1, 0, 0.1},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        moe_optim_config c = MOE_OPTIM_CONFIG_INIT;
        c.lr = 1.0;
        c.min_lr = 0.1;
        c.schedule = cases[i].schedule;
        c.warmup = cases[i].warmup;
        c.total_steps = cases[i].total;
        const double got = moe_lr_at(&c, cases[i].step);
        cr_expect(fabs(got - cases[i].want) <= 1e-12, "%s, warmup %lld of %lld steps: step %lld lr %.15g, want %.15g",
                  moe_lr_schedule_name(c.schedule), (long long)c.warmup, (long long)c.total_steps,
                  (long long)cases[i].step, got, cases[i].want);
    }
    /* wsd decaying over half: the last 5 of 10 steps, linear, every one
     * of them below lr (a first decay step at lr would decay over 4). */
    moe_optim_config wsd = MOE_OPTIM_CONFIG_INIT;
    wsd.lr = 1.0, wsd.min_lr = 0.1, wsd.schedule = MOE_LR_WSD, wsd.decay_frac = 0.5;
    wsd.warmup = 2, wsd.total_steps = 12;
    const double wsd_want[12] = {0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.82, 0.64, 0.46, 0.28, 0.1};
    for (int64_t s = 0; s < 12; s++)
        cr_expect(fabs(moe_lr_at(&wsd, s) - wsd_want[s]) <= 1e-12, "wsd over half: step %lld lr %.15g, want %.15g",
                  (long long)s, moe_lr_at(&wsd, s), wsd_want[s]);
    /* 0.07 of 100 steps is 7 (the product rounds to 7.000000000000001). */
    wsd.decay_frac = 0.07, wsd.warmup = 0, wsd.total_steps = 100;
    cr_expect(moe_lr_at(&wsd, 92) == 1.0 && moe_lr_at(&wsd, 93) < 1.0 && moe_lr_at(&wsd, 99) == 0.1,
              "wsd 0.07 of 100 steps: lr %.15g, %.15g, %.15g at steps 92, 93, 99; want the decay to start at 93",
              moe_lr_at(&wsd, 92), moe_lr_at(&wsd, 93), moe_lr_at(&wsd, 99));
    /* A decay of 2 steps is not one of 1. */
    wsd.decay_frac = 0.02;
    cr_expect(fabs(moe_lr_at(&wsd, 98) - 0.55) <= 1e-12 && moe_lr_at(&wsd, 99) == 0.1, "wsd 2 of 100 steps: lr %.15g, %.15g",
              moe_lr_at(&wsd, 98), moe_lr_at(&wsd, 99));
    wsd.decay_frac = 0.0;
    cr_expect_eq(moe_optim_config_validate(&wsd), MOE_ERR_CONFIG, "decay_frac 0 accepted");
    cr_expect(strstr(moe_last_error(), "--decay-frac") != NULL, "%s", moe_last_error());
    const double pi = 3.14159265358979323846;
    for (int cosine = 0; cosine < 2; cosine++) {
        moe_optim_config c = MOE_OPTIM_CONFIG_INIT;
        c.lr = 1.0;
        c.min_lr = 0.1;
        c.schedule = cosine ? MOE_LR_COSINE : MOE_LR_LINEAR;
        c.warmup = 3;
        c.total_steps = 12;
        for (int64_t s = c.warmup; s < c.total_steps; s++) {
            const double progress = (double)(s - c.warmup) / (double)(c.total_steps - c.warmup - 1);
            const double frac = cosine ? 0.5 * (1.0 + cos(pi * progress)) : 1.0 - progress;
            const double want = c.min_lr + (c.lr - c.min_lr) * frac, got = moe_lr_at(&c, s);
            cr_expect(fabs(got - want) <= 1e-12, "%s, warmup 3 of 12 steps: step %lld lr %.15g, want %.15g",
                      moe_lr_schedule_name(c.schedule), (long long)s, got, want);
        }
    }

    /* Without --min-lr the last step's rate is --lr / 10, whatever --lr;
     * the wsd flag is taken with wsd, and the constant schedule without
     * --min-lr. */
    moe_run_options d;
    moe_run_options_init(&d);
    d.lr = 1e-5;
    cr_expect_eq(moe_run_options_validate(&d), MOE_OK, "--lr 1e-5 alone: %s", moe_last_error());
    d.lr_schedule = MOE_LR_WSD;
    d.decay_frac = 0.5;
    cr_expect_eq(moe_run_options_validate(&d), MOE_OK, "wsd with --decay-frac: %s", moe_last_error());
    d.lr_schedule = MOE_LR_CONSTANT;
    d.decay_frac = NAN;
    cr_expect_eq(moe_run_options_validate(&d), MOE_OK, "constant: %s", moe_last_error());

    /* A warm-up as long as the run is allowed (short test runs) and said. */
    char cfg[512], out[512];
    moe_run_options o = tiny_options(write_tiny_config(cfg, MOE_SYNTH_VOCAB_SIZE), tmp_path(out, "out"));
    o.steps = 2;
    o.warmup = 3;
    o.eval_batches = 1;
    seen v;
    run_ok(&o, &v);
    cr_expect(v.warnings == 1 && strstr(v.warning, "--warmup") && strstr(v.warning, "--steps"), "warnings %d: %s",
              v.warnings, v.warning);
    o.warmup = 0;
    o.lr = 0.03;
    o.min_lr = NAN;
    o.overwrite = true;
    run_ok(&o, &v);
    cr_expect(fabs(v.last_lr - 0.003) <= 1e-15, "the last step's lr %.17g without --min-lr; want --lr / 10", v.last_lr);
}

/* ------------------------------------------------------------- bad options */

typedef struct bad_option {
    const char *flag; /* must appear in the message */
    void (*spoil)(moe_run_options *o);
} bad_option;

/* An otherwise valid --eval-only run: a checkpoint's weights and config. */
static void eval_only_of(moe_run_options *o) {
    o->eval_only = true;
    o->init_from = "somewhere";
    o->config = NULL;
}

static void zero_batch(moe_run_options *o) { o->batch_size = 0; }
static void negative_seq(moe_run_options *o) { o->seq_len = -3; }
static void zero_steps(moe_run_options *o) { o->steps = 0; }
static void negative_lr(moe_run_options *o) { o->lr = -1e-3; }
static void min_above_lr(moe_run_options *o) { o->min_lr = 2.0 * o->lr; }
static void negative_warmup(moe_run_options *o) { o->warmup = -1; }
static void zero_accum(moe_run_options *o) { o->grad_accum = 0; }
static void nan_clip(moe_run_options *o) { o->grad_clip = NAN; }
static void negative_decay(moe_run_options *o) { o->weight_decay = -0.1; }
static void zero_eval_batches(moe_run_options *o) { o->eval_batches = 0; }
static void negative_eval_every(moe_run_options *o) { o->eval_every = -1; }
static void negative_save_every(moe_run_options *o) { o->save_every = -5; }
static void negative_keep_last(moe_run_options *o) { o->keep_last = -1; }
static void nan_logit_z(moe_run_options *o) { o->logit_z_loss = NAN; }
static void min_lr_constant(moe_run_options *o) { o->lr_schedule = MOE_LR_CONSTANT; }
static void upcycle_alone(moe_run_options *o) { o->upcycle = true; }
static void eval_mc_empty(moe_run_options *o) { o->eval_mc = ""; }
static void negative_max_time(moe_run_options *o) { o->max_time = -1.0; }
static void max_time_eval_only(moe_run_options *o) {
    eval_only_of(o);
    o->max_time = 60.0;
}
static void negative_val_tokens(moe_run_options *o) { o->val_tokens = -1; }
static void val_tokens_and_data(moe_run_options *o) {
    o->val_tokens = 10;
    o->data = o->val_data = "corpus.txt";
}
static void val_tokens_synthetic(moe_run_options *o) { o->val_tokens = 10; }
static void upcycle_without_config(moe_run_options *o) {
    o->upcycle = true;
    o->init_from = "dense";
    o->config = NULL;
}
static void upcycle_eval_only(moe_run_options *o) {
    o->upcycle = o->eval_only = true;
    o->init_from = "dense";
}
static void decay_frac_cosine(moe_run_options *o) { o->decay_frac = 0.3; }
static void decay_flips_weights(moe_run_options *o) { o->weight_decay = 1.0 / o->lr; }
static void save_eval_only(moe_run_options *o) {
    eval_only_of(o);
    o->save_every = 5;
}
static void shuffle_eval_only(moe_run_options *o) {
    eval_only_of(o);
    o->shuffle = true;
}
static void latest_overwrite(moe_run_options *o) {
    o->resume = MOE_RUN_RESUME_LATEST;
    o->overwrite = true;
}
static void keep_last_eval_only(moe_run_options *o) {
    eval_only_of(o);
    o->keep_last = 2;
}
static void negative_threads(moe_run_options *o) { o->threads = -2; }
static void too_many_threads(moe_run_options *o) { o->threads = MOE_RUN_THREADS_MAX + 1; }
static void negative_peak(moe_run_options *o) { o->peak_gflops = -1.0; }
static void denormal_peak(moe_run_options *o) { o->peak_gflops = 1e-320; } /* MFU would be inf */
static void empty_out(moe_run_options *o) { o->out_dir = ""; }
static void empty_data(moe_run_options *o) { o->data = ""; }
static void eval_only_alone(moe_run_options *o) { o->eval_only = true; }
static void resume_and_init(moe_run_options *o) { o->resume = o->init_from = "somewhere"; }
static void huge_steps(moe_run_options *o) { o->steps = INT64_MAX; }
static void huge_batch(moe_run_options *o) {
    o->batch_size = (int64_t)1 << 62;
    o->seq_len = 4;
}
static void huge_accum(moe_run_options *o) { o->grad_accum = (int64_t)1 << 60; }
static void huge_eval_batches(moe_run_options *o) { o->eval_batches = 100000000000; }
static void overwrite_eval_only(moe_run_options *o) {
    eval_only_of(o);
    o->overwrite = true;
}
static void profile_eval_only(moe_run_options *o) {
    eval_only_of(o);
    o->profile = true;
}

static void recompute_eval_only(moe_run_options *o) {
    eval_only_of(o);
    o->recompute = true;
}

Test(train_run, bad_options_name_the_flag) {
    static const bad_option cases[] = {
        {"--batch-size", zero_batch},     {"--seq-len", negative_seq},
        {"--steps", zero_steps},          {"--lr", negative_lr},
        {"--min-lr", min_above_lr},       {"--warmup", negative_warmup},
        {"--grad-accum", zero_accum},     {"--grad-clip", nan_clip},
        {"--weight-decay", negative_decay}, {"--eval-batches", zero_eval_batches},
        {"--eval-every", negative_eval_every}, {"--save-every", negative_save_every},
        {"--threads", negative_threads},  {"--threads", too_many_threads},
        {"--peak-gflops", negative_peak}, {"--peak-gflops", denormal_peak},
        {"--out", empty_out},             {"--data", empty_data},
        {"--init-from", eval_only_alone}, {"--resume", resume_and_init},
        {"--profile", profile_eval_only}, {"--recompute", recompute_eval_only},
        {"--overwrite", overwrite_eval_only}, {"--keep-last", negative_keep_last},
        {"--keep-last", keep_last_eval_only}, {"--overwrite", latest_overwrite},
        {"--logit-z-loss", nan_logit_z},  {"--shuffle", shuffle_eval_only},
        {"--save-every", save_eval_only}, {"--min-lr", min_lr_constant},
        {"--decay-frac", decay_frac_cosine}, {"--weight-decay", decay_flips_weights},
        {"--upcycle", upcycle_alone},     {"--config", upcycle_without_config},
        {"--eval-only", upcycle_eval_only}, {"--val-tokens", negative_val_tokens},
        {"--max-time", negative_max_time}, {"--max-time", max_time_eval_only},
        {"--val-data", val_tokens_and_data}, {"synthetic", val_tokens_synthetic},
        {"--steps", huge_steps},          {"--batch-size", huge_batch},
        {"--grad-accum", huge_accum},     {"--eval-batches", huge_eval_batches},
        {"--eval-mc", eval_mc_empty},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        moe_run_options o = tiny_options("tiny.json", "/nonexistent/out");
        cr_assert_eq(moe_run_options_validate(&o), MOE_OK, "the base options: %s", moe_last_error());
        cases[i].spoil(&o);
        cr_expect_eq(moe_run_options_validate(&o), MOE_ERR_CONFIG, "case %zu (%s) accepted", i, cases[i].flag);
        cr_expect(strstr(moe_last_error(), cases[i].flag) != NULL, "case %zu: '%s' does not name %s", i,
                  moe_last_error(), cases[i].flag);
        /* moe_run checks the same before touching anything. */
        cr_expect_eq(moe_run(&o, NULL), MOE_ERR_CONFIG, "case %zu: moe_run accepted", i);
    }
    moe_lr_schedule s;
    cr_expect_eq(moe_lr_schedule_parse(&s, "cosin"), MOE_ERR_CONFIG);
    cr_expect(strstr(moe_last_error(), "--lr-schedule") != NULL, "message: %s", moe_last_error());
    cr_expect(moe_lr_schedule_parse(&s, "linear") == MOE_OK && s == MOE_LR_LINEAR);
}

/* The names in dir, sorted, joined by spaces, into buf. */
static const char *listing(char *buf, size_t size, const char *dir) {
    struct dirent **names;
    const int n = scandir(dir, &names, NULL, alphasort);
    cr_assert(n >= 0, "cannot list %s", dir);
    size_t used = 0;
    buf[0] = '\0';
    for (int i = 0; i < n; i++) {
        if (strcmp(names[i]->d_name, ".") != 0 && strcmp(names[i]->d_name, "..") != 0)
            used += (size_t)snprintf(buf + used, size - used, "%s%s", used ? " " : "", names[i]->d_name);
        free(names[i]);
    }
    free(names);
    return buf;
}

/* An in-place resume whose log cannot be read is refused before it
 * removes the later checkpoints (a FIFO there hung it, after the step). */
Test(train_run, in_place_resume_checks_its_log_first, .init = make_tmp, .fini = remove_tmp, .timeout = 60) {
    char cfg[512], out[512], resume[512], log[512], names[1024];
    moe_run_options o = tiny_options(write_tiny_config(cfg, MOE_SYNTH_VOCAB_SIZE), tmp_path(out, "out"));
    o.steps = 4;
    o.save_every = 2;
    seen v;
    run_ok(&o, &v);
    cr_assert_eq(unlink(tmp_path(log, "out/metrics.jsonl")), 0);
    cr_assert_eq(mkfifo(log, 0600), 0);
    o.config = NULL;
    o.resume = tmp_path(resume, "out/step-000002");
    moe_run_callbacks cb = callbacks(&v);
    cr_expect_eq(moe_run(&o, &cb), MOE_ERR_IO);
    cr_expect(strstr(moe_last_error(), "not a regular file"), "message: %s", moe_last_error());
    cr_expect_str_eq(listing(names, sizeof names, out),
                     ".lock config.json metrics.jsonl run.json step-000002 step-000004");
}

/* A copy of checkpoint dir's weights and config in tmp's name, as other
 * tools leave a model: without train_state. */
static const char *copy_weights(char *to, const char *name, const char *dir) {
    static const char *const files[] = {"model.safetensors", "config.json"};
    cr_assert_eq(moe_mkdir_p(tmp_path(to, name)), MOE_OK, "%s", moe_last_error());
    for (int i = 0; i < 2; i++) {
        char from[1024], copy[1024];
        size_t size;
        snprintf(from, sizeof from, "%s/%s", dir, files[i]);
        snprintf(copy, sizeof copy, "%s/%s", to, files[i]);
        char *bytes = read_file(from, &size);
        cr_assert_eq(moe_file_write_atomic_buffer(copy, bytes, size), MOE_OK, "%s", moe_last_error());
        free(bytes);
    }
    return to;
}

/* Weights that overflow the model are refused before --overwrite removes
 * the run they were to replace, naming their file: as --init-from, and as
 * an in-place --resume, whose later checkpoint stays. The check is one
 * forward, which a router weight that overflows only under the training's
 * jitter passes: the divergence of the first step on it names the file
 * beside --lr. */
Test(train_run, overflowing_weights_are_refused_before_overwrite, .init = make_tmp, .fini = remove_tmp) {
    char cfg[512], out[512], from[512], resume[512], fresh[512], path[1024], names[1024], before[1024];
    moe_run_options o = tiny_options(write_tiny_config(cfg, MOE_SYNTH_VOCAB_SIZE), tmp_path(out, "out"));
    o.steps = 4;
    o.save_every = 2;
    seen v;
    run_ok(&o, &v);
    copy_weights(from, "from", v.checkpoint);
    snprintf(path, sizeof path, "%s/model.safetensors", from);
    cr_assert_eq(rewrite_safetensors(path, (const char *const[]){NULL}, NULL, NULL, "model.norm.weight", 3e38f), 1);
    size_t log_size, log_after;
    char *log = read_file(tmp_path(path, "out/metrics.jsonl"), &log_size);
    listing(before, sizeof before, out);
    moe_run_options e = o;
    e.config = NULL;
    e.init_from = from;
    e.overwrite = true;
    moe_run_callbacks cb = callbacks(&v);
    cr_expect_eq(moe_run(&e, &cb), MOE_ERR_FORMAT);
    cr_expect(strstr(moe_last_error(), from) && strstr(moe_last_error(), "overflow"), "message: %s", moe_last_error());
    cr_expect_eq(v.starts, 0, "the refused run started");
    cr_expect_str_eq(listing(names, sizeof names, out), before);
    char *after = read_file(path, &log_after);
    cr_expect(log_size == log_after && memcmp(log, after, log_size) == 0, "metrics.jsonl went from %zu to %zu bytes",
              log_size, log_after);
    free(after);
    free(log);

    snprintf(path, sizeof path, "%s/step-000002/model.safetensors", out);
    cr_assert_eq(rewrite_safetensors(path, (const char *const[]){NULL}, NULL, NULL, "model.norm.weight", 3e38f), 1);
    e.init_from = NULL;
    e.resume = tmp_path(resume, "out/step-000002");
    cr_expect_eq(moe_run(&e, &cb), MOE_ERR_FORMAT);
    cr_expect(strstr(moe_last_error(), "--resume") && strstr(moe_last_error(), resume), "message: %s",
              moe_last_error());
    cr_expect_str_eq(listing(names, sizeof names, out), before);

    /* Jitter scales the router's inputs by up to 1.01 in training only:
     * this weight overflows the step's router logits, not the check's. */
    copy_weights(from, "jitter", tmp_path(path, "out/step-000004"));
    snprintf(path, sizeof path, "%s/model.safetensors", from);
    cr_assert_eq(rewrite_safetensors(path, (const char *const[]){NULL}, NULL, NULL,
                                     "model.layers.0.block_sparse_moe.gate.weight", -1.7e38f),
                 1);
    e.resume = NULL;
    e.init_from = from;
    e.out_dir = tmp_path(fresh, "fresh");
    cr_expect_eq(moe_run(&e, &cb), MOE_ERR_CONFIG);
    snprintf(path, sizeof path, "--init-from %s: the first step on its weights diverged", from);
    cr_expect(strstr(moe_last_error(), path) && strstr(moe_last_error(), "step 1: gradient norm"), "message: %s",
              moe_last_error());
}

/* Two runs never share an --out: a run holds OUT/.lock, its pid written
 * there, and a second one, resumed or under --overwrite, is refused
 * naming that pid and leaves --out as it was; once the first has ended,
 * the same command runs. */
Test(train_run, a_second_run_into_a_locked_out_is_refused, .init = make_tmp, .fini = remove_tmp) {
    char cfg[512], out[512], lock[512], log[512], names[1024], before[1024], want[64];
    moe_run_options o = tiny_options(write_tiny_config(cfg, MOE_SYNTH_VOCAB_SIZE), tmp_path(out, "out"));
    o.steps = 2;
    o.save_every = 1;
    seen v;
    run_ok(&o, &v);
    size_t size, log_size, log_after;
    char *pid = read_file(tmp_path(lock, "out/.lock"), &size);
    snprintf(want, sizeof want, "%ld\n", (long)getpid());
    cr_expect_str_eq(pid, want, "the lock file holds '%s'", pid);
    free(pid);
    /* Another process at work in --out holds the lock as a run does. */
    const int held = open(lock, O_RDWR);
    cr_assert(held >= 0 && flock(held, LOCK_EX | LOCK_NB) == 0, "cannot lock %s", lock);
    cr_assert(ftruncate(held, 0) == 0 && pwrite(held, "4242\n", 5, 0) == 5);
    listing(before, sizeof before, out);
    char *log_before = read_file(tmp_path(log, "out/metrics.jsonl"), &log_size);
    moe_run_callbacks cb = callbacks(&v);
    o.steps = 4;
    for (int overwrite = 0; overwrite < 2; overwrite++) {
        o.resume = overwrite ? NULL : MOE_RUN_RESUME_LATEST;
        o.overwrite = overwrite;
        cr_expect_eq(moe_run(&o, &cb), MOE_ERR_CONFIG, "overwrite %d", overwrite);
        cr_expect(strstr(moe_last_error(), "in use by another run (pid 4242"), "message: %s", moe_last_error());
        cr_expect_eq(v.starts, 0, "the refused run started");
        cr_expect_str_eq(listing(names, sizeof names, out), before);
        char *log_now = read_file(log, &log_after);
        cr_expect(log_size == log_after && memcmp(log_before, log_now, log_size) == 0,
                  "metrics.jsonl went from %zu to %zu bytes", log_size, log_after);
        free(log_now);
    }
    /* Refused before --out is read: a checkpoint that is not there is not looked for. */
    char missing[600];
    snprintf(missing, sizeof missing, "%s/step-000009", out);
    o.resume = missing;
    o.overwrite = false;
    cr_expect_eq(moe_run(&o, &cb), MOE_ERR_CONFIG);
    cr_expect(strstr(moe_last_error(), "in use by another run (pid 4242"), "message: %s", moe_last_error());
    free(log_before);
    cr_assert_eq(close(held), 0);
    /* A lock that is no regular file is refused; a link's target is not written. */
    char victim[512];
    cr_assert_eq(moe_file_write_atomic_buffer(tmp_path(victim, "victim"), "keep", 4), MOE_OK, "%s", moe_last_error());
    cr_assert_eq(unlink(lock), 0);
    cr_assert_eq(symlink(victim, lock), 0);
    o.resume = MOE_RUN_RESUME_LATEST;
    cr_expect_eq(moe_run(&o, &cb), MOE_ERR_CONFIG);
    cr_expect(strstr(moe_last_error(), "is not a regular file"), "message: %s", moe_last_error());
    char *kept = read_file(victim, &size);
    cr_expect(size == 4 && memcmp(kept, "keep", 4) == 0, "the link's target was written");
    free(kept);
    cr_assert_eq(unlink(lock), 0);
    o.resume = MOE_RUN_RESUME_LATEST;
    o.overwrite = false;
    run_ok(&o, &v);
    cr_expect_eq(v.steps, 2, "resumed for %d steps", v.steps);
}

/* What --out held when step 7's checkpoint was saved (before its pruning). */
static char listed_at_7[1024];
static void list_at_step_7(void *ctx, int64_t step, const char *path) {
    (void)ctx;
    if (step != 7) return;
    char dir[512];
    snprintf(dir, sizeof dir, "%.*s", (int)(strrchr(path, '/') - path), path);
    listing(listed_at_7, sizeof listed_at_7, dir);
}

/* --keep-last keeps the newest checkpoints and leaves nothing aside; a
 * resumed run keeps the one it resumed from as well, counted when it is
 * among the newest. The lock file (.lock) stays through both. */
Test(train_run, keep_last_removes_older_checkpoints, .init = make_tmp, .fini = remove_tmp) {
    char cfg[512], out[512], resume[512], names[1024];
    moe_run_options o = tiny_options(write_tiny_config(cfg, MOE_SYNTH_VOCAB_SIZE), tmp_path(out, "out"));
    o.steps = 5;
    o.eval_every = 0;
    o.save_every = 1;
    o.keep_last = 2;
    seen v;
    run_ok(&o, &v);
    cr_expect_eq(v.checkpoints, 5);
    cr_expect_str_eq(listing(names, sizeof names, out),
                     ".lock config.json metrics.jsonl run.json step-000004 step-000005");
    o.config = NULL;
    o.resume = tmp_path(resume, "out/step-000005");
    o.steps = 8;
    run_ok(&o, &v);
    cr_expect_str_eq(listing(names, sizeof names, out),
                     ".lock config.json metrics.jsonl run.json step-000005 step-000007 step-000008");
    /* Resumed in place from step 5 with 7 and 8 still there: --overwrite
     * removes them at the start, being the trajectory the resume cuts (no
     * other run's step may stand among this one's); keeping one, the save
     * of step 6 keeps itself and the checkpoint resumed from. */
    o.keep_last = 1;
    o.overwrite = true;
    moe_run_callbacks cb = callbacks(&v);
    cb.on_checkpoint = list_at_step_7;
    listed_at_7[0] = '\0';
    cr_assert_eq(moe_run(&o, &cb), MOE_OK, "%s", moe_last_error());
    cr_expect_str_eq(listed_at_7, ".lock config.json metrics.jsonl run.json step-000005 step-000006 step-000007");
    cr_expect_str_eq(listing(names, sizeof names, out),
                     ".lock config.json metrics.jsonl run.json step-000005 step-000008");
    /* The checkpoint resumed from counts among the newest it is one of:
     * resumed from 8 every 2 steps, keeping 2, the save of 10 leaves 8 and
     * 10, not 5 as well. */
    o.keep_last = 2;
    o.overwrite = false;
    o.save_every = 2;
    o.resume = tmp_path(resume, "out/step-000008");
    o.steps = 10;
    run_ok(&o, &v);
    cr_expect_str_eq(listing(names, sizeof names, out),
                     ".lock config.json metrics.jsonl run.json step-000008 step-000010");
}

/* --init-from a checkpoint in --out is refused, and the checkpoint kept:
 * this run (now, or resumed further) would save over it, and --resume
 * latest could take it for this run's. */
Test(train_run, init_from_in_out_is_refused, .init = make_tmp, .fini = remove_tmp) {
    char cfg[512], out[512], from[512], model[512], copy[512];
    moe_run_options o = tiny_options(write_tiny_config(cfg, MOE_SYNTH_VOCAB_SIZE), tmp_path(out, "out"));
    o.steps = 4;
    o.save_every = 2;
    seen v;
    run_ok(&o, &v);
    tmp_path(model, "out/step-000002/model.safetensors");
    size_t size;
    char *bytes = read_file(model, &size);
    cr_assert_eq(moe_file_write_atomic_buffer(tmp_path(copy, "before.safetensors"), bytes, size), MOE_OK, "%s",
                 moe_last_error());
    free(bytes);
    o.config = NULL;
    o.overwrite = true;
    o.init_from = tmp_path(from, "out/step-000002");
    moe_run_callbacks cb = callbacks(&v);
    for (int every = 2; every <= 3; every++) { /* saving step 2, or not */
        o.save_every = every;
        cr_expect_eq(moe_run(&o, &cb), MOE_ERR_CONFIG);
        cr_expect(strstr(moe_last_error(), "--init-from") && strstr(moe_last_error(), "lies in --out"), "message: %s",
                  moe_last_error());
        cr_expect(same_file(model, copy), "the refused run changed %s", model);
    }
}

/* Keeps the first `lines` lines of path. */
static void keep_lines(const char *path, int lines) {
    size_t size;
    char *text = read_file(path, &size), *at = text;
    for (int i = 0; i < lines && at; i++) at = strchr(at, '\n'), at = at ? at + 1 : NULL;
    cr_assert(at, "%s has fewer than %d lines", path, lines);
    FILE *f = fopen(path, "wb");
    cr_assert(f && fwrite(text, 1, (size_t)(at - text), f) == (size_t)(at - text) && fclose(f) == 0);
    free(text);
}

/* --resume latest: a new run while --out has no checkpoint, then each
 * launch continues from the newest, bit for bit as one uninterrupted run;
 * a --config other than the checkpoint's is refused naming the field. */
Test(train_run, resume_latest_restarts_from_the_newest, .init = make_tmp, .fini = remove_tmp) {
    char cfg[512], other[512], once[512], out[512], a[512], b[512];
    moe_run_options o = tiny_options(write_tiny_config(cfg, MOE_SYNTH_VOCAB_SIZE), tmp_path(once, "once"));
    o.steps = 6;
    o.eval_every = 0;
    o.shuffle = true;
    seen v;
    run_ok(&o, &v);
    o.out_dir = tmp_path(out, "out");
    o.resume = MOE_RUN_RESUME_LATEST;
    o.save_every = 2;
    run_ok(&o, &v);
    cr_expect(v.steps == 6 && v.last_step == 6, "a new run: %d steps, to %lld", v.steps, (long long)v.last_step);
    /* A job that died after step 4's checkpoint. */
    cr_assert_eq(moe_remove_tree(tmp_path(a, "out/step-000006")), MOE_OK, "%s", moe_last_error());
    run_ok(&o, &v);
    cr_expect(v.steps == 2 && v.last_step == 6, "restarted: %d steps, to %lld", v.steps, (long long)v.last_step);
    cr_expect(same_file(tmp_path(a, "once/step-000006/model.safetensors"),
                        tmp_path(b, "out/step-000006/model.safetensors")),
              "4 steps + latest + 2 differ from 6 steps");
    /* Another config: named, and the run left as it was. */
    moe_model_config c;
    cr_assert_eq(moe_model_config_load(&c, cfg, NULL, NULL), MOE_OK, "%s", moe_last_error());
    c.moe_z_loss_coef = 0.25;
    cr_assert_eq(moe_model_config_save(&c, tmp_path(other, "other.json")), MOE_OK, "%s", moe_last_error());
    o.config = other;
    o.steps = 8;
    moe_run_callbacks cb = callbacks(&v);
    cr_expect_eq(moe_run(&o, &cb), MOE_ERR_CONFIG);
    cr_expect(strstr(moe_last_error(), "moe_z_loss_coef") && strstr(moe_last_error(), "step-000006"), "message: %s",
              moe_last_error());

    /* Past the checkpoint's step, as an explicit --resume. */
    o.config = cfg;
    o.steps = 5;
    cr_expect_eq(moe_run(&o, &cb), MOE_ERR_CONFIG);
    cr_expect(strstr(moe_last_error(), "step-000006: the checkpoint is at step 6, --steps 5 leaves nothing to do"),
              "message: %s", moe_last_error());

    /* Restarted after it finished: nothing to do, and said so. */
    o.config = cfg;
    o.steps = 6;
    run_ok_or_done(&o, &v);
    cr_expect(v.starts == 0 && v.steps == 0 && strstr(v.warning, "nothing to do"), "a finished run: %d steps, '%s'",
              v.steps, v.warning);

    /* The log ends at step 5, and step 6's checkpoint stands: it is not
     * the run the log tells, nor can the restart remove it (--overwrite
     * is refused with latest): refused, naming it, and left; resumed by
     * name under --overwrite, from step 4, the log's. */
    keep_lines(tmp_path(a, "out/metrics.jsonl"), 5);
    cr_expect_eq(moe_run(&o, &cb), MOE_ERR_CONFIG);
    cr_expect(strstr(moe_last_error(), "step-000006, later than the last step its metrics.jsonl logged, 5"),
              "message: %s", moe_last_error());
    cr_expect(access(tmp_path(b, "out/step-000006"), F_OK) == 0, "the refused restart removed step 6");
    /* By name, --config is checked as with latest: another is refused,
     * the run's own (the command line that started it) taken. */
    o.resume = tmp_path(b, "out/step-000004");
    o.config = other;
    o.overwrite = true;
    cr_expect_eq(moe_run(&o, &cb), MOE_ERR_CONFIG);
    cr_expect(strstr(moe_last_error(), "--resume ") && strstr(moe_last_error(), "step-000004 was trained with "
                                                                                "moe_z_loss_coef"),
              "message: %s", moe_last_error());
    /* Token ids change no step, but the run would drop them unseen. */
    cr_assert_eq(moe_model_config_load(&c, cfg, NULL, NULL), MOE_OK, "%s", moe_last_error());
    c.eos_token_id = (moe_token_ids){.form = MOE_TOKEN_ID_INT, .n = 1, .ids = {7}};
    cr_assert_eq(moe_model_config_save(&c, tmp_path(other, "ids.json")), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(moe_run(&o, &cb), MOE_ERR_CONFIG);
    cr_expect(strstr(moe_last_error(), "another eos_token_id than --config"), "message: %s", moe_last_error());
    /* Nor do q, k and v biases go unseen. */
    cr_assert_eq(moe_model_config_load(&c, cfg, NULL, NULL), MOE_OK, "%s", moe_last_error());
    c.moe_qkv_bias = true;
    cr_assert_eq(moe_model_config_save(&c, tmp_path(other, "bias.json")), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(moe_run(&o, &cb), MOE_ERR_CONFIG);
    cr_expect(strstr(moe_last_error(), "step-000004 was trained with moe_qkv_bias"), "message: %s", moe_last_error());
    o.config = cfg;
    run_ok(&o, &v);
    cr_expect(v.steps == 2 && v.last_step == 6, "after the log's step 5: %d steps, to %lld", v.steps,
              (long long)v.last_step);
    o.resume = MOE_RUN_RESUME_LATEST;
    o.config = cfg;
    o.overwrite = false;

    /* A start that died before its first checkpoint left its run files: the
     * restart replaces them. */
    char fresh[512];
    o.out_dir = tmp_path(fresh, "fresh");
    write_earlier_run(fresh);
    run_ok(&o, &v);
    cr_expect(v.steps == 6, "a restart with no checkpoint: %d steps", v.steps);
}

Test(train_run, missing_data_names_flag_and_file, .init = make_tmp, .fini = remove_tmp) {
    char cfg[512], out[512];
    moe_run_options o = tiny_options(write_tiny_config(cfg, MOE_BYTE_VOCAB_SIZE), tmp_path(out, "out"));
    o.data = "/nonexistent/corpus.txt";
    cr_expect_neq(moe_run(&o, NULL), MOE_OK);
    cr_expect(strstr(moe_last_error(), "--data") && strstr(moe_last_error(), "/nonexistent/corpus.txt"),
              "message: %s", moe_last_error());
    o.data = MOE_RUN_SYNTHETIC;
    o.val_data = "/nonexistent/val_*.bin";
    cr_expect_neq(moe_run(&o, NULL), MOE_OK);
    cr_expect(strstr(moe_last_error(), "--val-data") != NULL, "message: %s", moe_last_error());
}

Test(train_run, sgemm_peak_is_measured) {
    double gflops = 0.0;
    cr_assert_eq(moe_measure_gemm_gflops(moe_cpu_ops(), &gflops), MOE_OK, "%s", moe_last_error());
    cr_expect(gflops > 0.1 && gflops < 1e6, "sgemm peak %g GFLOP/s", gflops);
}

