/* test_mc_eval.c: llm.c's multiple-choice eval files (engine/mc_eval.h):
 * files written here as llm.c's dev/data/data_common.py write_evalfile
 * writes them read back and scored against each completion's mean loss
 * taken from a forward of its row alone; every malformed field refused,
 * naming the file, the example and the fault. */
#define _XOPEN_SOURCE 700
#include <criterion/criterion.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/rng.h"
#include "engine/mc_eval.h"
#include "engine/model.h"
#include "engine/model_config.h"

#define TEST_TMPDIR_TEMPLATE "/tmp/moe_mc_XXXXXX"
#include "test_files.h"

#define VOCAB 40
#define B 8
#define T 16
#define EXAMPLES 30
#define MAX_WORDS 8192

/* An eval file's header and stream of uint16 words, as write_evalfile
 * builds them: each example 65535, its bytes, its index, its label, its
 * completion count, the context, then the completions, each a length and
 * tokens. */
typedef struct eval_file {
    int32_t header[256];
    uint16_t words[MAX_WORDS];
    size_t n;
} eval_file;

static void add_example(eval_file *f, int index, int label, const int *ctx, int n_ctx, int n_comp,
                        const int (*comp)[8], const int *comp_len) {
    const size_t start = f->n;
    const uint16_t head[] = {65535, 0, (uint16_t)index, (uint16_t)label, (uint16_t)n_comp, (uint16_t)n_ctx};
    for (size_t i = 0; i < sizeof head / sizeof *head; i++) f->words[f->n++] = head[i];
    for (int i = 0; i < n_ctx; i++) f->words[f->n++] = (uint16_t)ctx[i];
    for (int c = 0; c < n_comp; c++) {
        f->words[f->n++] = (uint16_t)comp_len[c];
        for (int i = 0; i < comp_len[c]; i++) f->words[f->n++] = (uint16_t)comp[c][i];
    }
    const int32_t bytes = (int32_t)(2 * (f->n - start));
    f->words[start + 1] = (uint16_t)bytes;
    f->header[2] = index + 1;
    if (bytes > f->header[3]) f->header[3] = bytes;
}

/* EXAMPLES random examples: a context of 3 to 8 tokens and 4 completions
 * of 1 to 6 (some examples of 2 completions), labels spread. */
static void random_file(eval_file *f, uint64_t seed) {
    memset(f, 0, sizeof *f);
    f->header[0] = 20240522;
    f->header[1] = 1;
    for (int e = 0; e < EXAMPLES; e++) {
        int ctx[8], comp[4][8], len[4];
        const int n_ctx = 3 + (int)(moe_rng_bits(seed, 1, (uint64_t)e) % 6), n_comp = e % 5 == 4 ? 2 : 4;
        for (int i = 0; i < n_ctx; i++) ctx[i] = (int)(moe_rng_bits(seed, 2, (uint64_t)(e * 8 + i)) % VOCAB);
        for (int c = 0; c < n_comp; c++) {
            len[c] = 1 + (int)(moe_rng_bits(seed, 3, (uint64_t)(e * 4 + c)) % 6);
            for (int i = 0; i < len[c]; i++)
                comp[c][i] = (int)(moe_rng_bits(seed, 4, (uint64_t)(e * 32 + c * 8 + i)) % VOCAB);
        }
        add_example(f, e, e % n_comp, ctx, n_ctx, n_comp, (const int (*)[8])comp, len);
    }
}

/* The file's bytes, little-endian, at path. */
static void write_eval(const char *path, const eval_file *f) {
    unsigned char *buf = malloc(1024 + 2 * f->n);
    cr_assert_not_null(buf);
    for (int i = 0; i < 256; i++)
        for (int k = 0; k < 4; k++) buf[4 * i + k] = (unsigned char)((uint32_t)f->header[i] >> (8 * k));
    for (size_t i = 0; i < f->n; i++) buf[1024 + 2 * i] = (unsigned char)f->words[i], buf[1025 + 2 * i] = (unsigned char)(f->words[i] >> 8);
    write_bytes(path, buf, 1024 + 2 * f->n);
    free(buf);
}

static moe_model *small_model(void) {
    moe_model_config cfg;
    moe_model_config_default_small(&cfg, VOCAB);
    cfg.hidden_size = 32;
    cfg.head_dim = 8;
    cfg.intermediate_size = 32;
    cfg.num_hidden_layers = 2;
    moe_model *m = NULL;
    cr_assert_eq(moe_model_create(&m, &cfg, B, T, 3), MOE_OK, "%s", moe_last_error());
    float *p = moe_model_params(m);
    for (int64_t i = 0; i < moe_model_param_count(m); i++) p[i] *= 25.0f; /* losses far apart */
    return m;
}

/* The trainer whose forwards moe_mc_eval_run runs. */
static moe_trainer *trainer_of(moe_model *m) {
    moe_trainer *t = NULL;
    const moe_optim_config oc = MOE_OPTIM_CONFIG_INIT;
    cr_assert_eq(moe_trainer_create(&t, m, &oc), MOE_OK, "%s", moe_last_error());
    return t;
}

/* Completion c's mean loss from a forward of its row alone (row 0 of the
 * batch, the other rows ignored). */
static double row_loss(moe_model *m, const eval_file *f, size_t at, int c) {
    int32_t inputs[B * T] = {0}, targets[B * T];
    for (int i = 0; i < B * T; i++) targets[i] = -1;
    const int n_ctx = f->words[at + 5];
    for (int i = 0; i < n_ctx; i++) inputs[i] = f->words[at + 6 + i];
    size_t p = at + 6 + (size_t)n_ctx;
    for (int k = 0; k < c; k++) p += 1 + f->words[p];
    const int len = f->words[p];
    for (int i = 0; i < len; i++) inputs[n_ctx + i] = targets[n_ctx + i - 1] = f->words[p + 1 + i];
    cr_assert_eq(moe_model_forward(m, inputs, targets, NULL), MOE_OK, "%s", moe_last_error());
    const float *losses = moe_model_last_losses(m);
    double sum = 0.0;
    for (int i = 0; i < len; i++) sum += losses[n_ctx + i - 1];
    return sum / len;
}

Test(mc_eval, scores_as_each_rows_own_forward, .init = make_tmpdir, .fini = remove_tmpdir) {
    static eval_file f;
    random_file(&f, 17);
    write_eval(in_tmp("ev.bin"), &f);
    moe_mc_eval *mc = NULL;
    cr_assert_eq(moe_mc_eval_open(&mc, in_tmp("ev.bin"), VOCAB, T, B), MOE_OK, "%s", moe_last_error());
    cr_assert_eq(moe_mc_eval_count(mc), EXAMPLES);
    moe_model *m = small_model();
    moe_trainer *t = trainer_of(m);
    /* The reference: each example's choice from its rows' own forwards,
     * decided by a clear margin (a row's losses in another batch sum in
     * another order, within rounding). */
    int64_t want = 0, clear = 0;
    size_t at = 0;
    for (int e = 0; e < EXAMPLES; e++) {
        const int n_comp = f.words[at + 4], label = f.words[at + 3];
        double best = INFINITY, second = INFINITY;
        int choice = -1;
        for (int c = 0; c < n_comp; c++) {
            const double loss = row_loss(m, &f, at, c);
            if (loss < best) second = best, best = loss, choice = c;
            else if (loss < second) second = loss;
        }
        want += choice == label;
        clear += second - best > 1e-3;
        at += f.words[at + 1] / 2;
    }
    cr_assert_geq(clear, EXAMPLES - 1, "only %lld examples decided by a clear margin", (long long)clear);
    const int64_t batches = moe_mc_eval_batches(mc, 0, EXAMPLES, B);
    cr_expect_eq(batches, 15, "examples of 4, 4, 4, 4, 2 rows packed whole into batches of 8");
    int64_t got = 0;
    cr_assert_eq(moe_mc_eval_run(mc, t, 0, EXAMPLES, batches, &got), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(got, want, "%lld right, the rows' own forwards %lld", (long long)got, (long long)want);
    cr_expect(got > 0 && got < EXAMPLES, "%lld right: the test tells nothing apart", (long long)got);
    /* Extra batches run empty (an expert-parallel group's ranks run as
     * many); a part of the examples scores that part; too few batches is
     * the caller's fault. */
    int64_t again = 0, parts = 0;
    cr_assert_eq(moe_mc_eval_run(mc, t, 0, EXAMPLES, batches + 2, &again), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(again, got);
    cr_assert_eq(moe_mc_eval_run(mc, t, 0, 11, moe_mc_eval_batches(mc, 0, 11, B), &parts), MOE_OK);
    cr_assert_eq(moe_mc_eval_run(mc, t, 11, EXAMPLES, moe_mc_eval_batches(mc, 11, EXAMPLES, B), &parts), MOE_OK);
    cr_expect_eq(parts, got, "two parts score as the whole");
    cr_expect_eq(moe_mc_eval_run(mc, t, 0, EXAMPLES, batches - 1, &again), MOE_ERR_INTERNAL);
    moe_trainer_destroy(t);
    moe_model_destroy(m);
    moe_mc_eval_close(mc);
}

/* Completions of the same tokens tie, and the first wins, as in llm.c:
 * wherever their rows sit in a batch (which moves their losses by the
 * last bits), every example of four copies of one completion, its label
 * 0, is right. */
Test(mc_eval, ties_go_to_the_first_completion, .init = make_tmpdir, .fini = remove_tmpdir) {
    static eval_file f;
    memset(&f, 0, sizeof f);
    f.header[0] = 20240522;
    f.header[1] = 1;
    for (int e = 0; e < EXAMPLES; e++) {
        int ctx[8], comp[4][8], len[4];
        const int n_ctx = 2 + e % 7;
        for (int i = 0; i < n_ctx; i++) ctx[i] = (int)(moe_rng_bits(5, 1, (uint64_t)(e * 8 + i)) % VOCAB);
        for (int c = 0; c < 4; c++) {
            len[c] = 1 + e % 5;
            for (int i = 0; i < len[c]; i++) comp[c][i] = (int)(moe_rng_bits(5, 2, (uint64_t)(e * 8 + i)) % VOCAB);
        }
        add_example(&f, e, 0, ctx, n_ctx, 4, (const int (*)[8])comp, len);
    }
    write_eval(in_tmp("ties.bin"), &f);
    moe_mc_eval *mc = NULL;
    cr_assert_eq(moe_mc_eval_open(&mc, in_tmp("ties.bin"), VOCAB, T, B), MOE_OK, "%s", moe_last_error());
    moe_model *m = small_model();
    moe_trainer *t = trainer_of(m);
    int64_t right = 0;
    cr_assert_eq(moe_mc_eval_run(mc, t, 0, EXAMPLES, moe_mc_eval_batches(mc, 0, EXAMPLES, B), &right), MOE_OK, "%s",
                 moe_last_error());
    cr_expect_eq(right, EXAMPLES, "%lld of %d ties went to the first completion", (long long)right, EXAMPLES);
    moe_trainer_destroy(t);
    moe_model_destroy(m);
    moe_mc_eval_close(mc);
}

/* f changed by one fault, which opening must refuse naming want. */
static void expect_refused(const eval_file *good, void (*fault)(eval_file *), moe_status status, const char *want) {
    static eval_file f;
    f = *good;
    fault(&f);
    write_eval(in_tmp("bad.bin"), &f);
    moe_mc_eval *mc = (moe_mc_eval *)&f;
    cr_expect_eq(moe_mc_eval_open(&mc, in_tmp("bad.bin"), VOCAB, T, B), status, "accepted; wanted '%s'", want);
    cr_expect_null(mc);
    cr_expect(strstr(moe_last_error(), want) && strstr(moe_last_error(), "bad.bin"), "'%s' lacks '%s'",
              moe_last_error(), want);
}

static void magic(eval_file *f) { f->header[0] = 20240520; }
static void version(eval_file *f) { f->header[1] = 2; }
static void no_examples(eval_file *f) { f->header[2] = 0; }
static void more_examples(eval_file *f) { f->header[2] = EXAMPLES + 1; }
static void longest(eval_file *f) { f->header[3] += 2; }
static void delimiter(eval_file *f) { f->words[0] = 65534; }
static void index_(eval_file *f) { f->words[2] = 5; }
static void label(eval_file *f) { f->words[3] = f->words[4]; }
static void odd_bytes(eval_file *f) { f->words[1] += 1; }
static void long_bytes(eval_file *f) { f->words[1] += 2; }
static void empty_context(eval_file *f) { f->words[5] = 0; }
static void big_token(eval_file *f) { f->words[6] = VOCAB; }
static void trailing(eval_file *f) { f->words[f->n++] = 7; }
static void cut(eval_file *f) { f->n -= 3; }

Test(mc_eval, malformed_files_are_refused, .init = make_tmpdir, .fini = remove_tmpdir) {
    static eval_file f;
    random_file(&f, 17);
    expect_refused(&f, magic, MOE_ERR_FORMAT, "magic 20240520, expected 20240522");
    expect_refused(&f, version, MOE_ERR_FORMAT, "version 2, expected 1");
    expect_refused(&f, no_examples, MOE_ERR_FORMAT, "the header says 0 examples");
    expect_refused(&f, more_examples, MOE_ERR_FORMAT, "the file ends at example 30 of 31");
    expect_refused(&f, longest, MOE_ERR_FORMAT, "the header says the longest example takes");
    expect_refused(&f, delimiter, MOE_ERR_FORMAT, "example 0 (offset 1024) begins with 65534");
    expect_refused(&f, index_, MOE_ERR_FORMAT, "example 0 (offset 1024) says it is example 5");
    expect_refused(&f, label, MOE_ERR_FORMAT, "example 0 has label 4 of 4 completions");
    expect_refused(&f, odd_bytes, MOE_ERR_FORMAT, "no whole example");
    expect_refused(&f, long_bytes, MOE_ERR_FORMAT, "example 0 says it takes");
    expect_refused(&f, empty_context, MOE_ERR_FORMAT, "example 0: context 0 has 0 tokens, none");
    expect_refused(&f, big_token, MOE_ERR_FORMAT, "example 0 holds token 40, outside the vocabulary of 40");
    expect_refused(&f, trailing, MOE_ERR_FORMAT, "2 bytes after the last of the 30 examples");
    expect_refused(&f, cut, MOE_ERR_FORMAT, "example 29");
    /* Rows longer than T, or more completions than a batch's rows. */
    write_eval(in_tmp("ok.bin"), &f);
    moe_mc_eval *mc = NULL;
    cr_expect_eq(moe_mc_eval_open(&mc, in_tmp("ok.bin"), VOCAB, 5, B), MOE_ERR_CONFIG);
    cr_expect(strstr(moe_last_error(), "more than --seq-len 5"), "%s", moe_last_error());
    cr_expect_eq(moe_mc_eval_open(&mc, in_tmp("ok.bin"), VOCAB, T, 3), MOE_ERR_CONFIG);
    cr_expect(strstr(moe_last_error(), "has 4 completions, and a batch of --batch-size 3 rows"), "%s",
              moe_last_error());
    cr_assert_null(mc);
}
