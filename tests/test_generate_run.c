/* test_generate_run.c: moe_generate_run (engine/generate.h) on checkpoints
 * of tiny models with random weights, against moe_generate called directly
 * on a model holding the same weights; its samples printed as text by a
 * tokenizer file; its errors; and moe_synth_parse, the synthetic corpus's
 * text-to-tokens inverse.
 *
 * Tokens must match exactly: both sides run the same shapes on the same
 * thread count (one: the test stays fast on a busy machine), so every
 * logit is the same float. */
#define _XOPEN_SOURCE 700
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/rng.h"
#include "engine/checkpoint.h"
#include "engine/generate.h"
#include "engine/synthetic.h"
#include "engine/tokenizer.h"

#ifndef MOE_TEST_DATA_DIR
#error "CMakeLists.txt defines MOE_TEST_DATA_DIR for test_generate_run"
#endif

#define TEST_TMPDIR_TEMPLATE "/tmp/moe_gen_XXXXXX"
#include "test_files.h"
#include "tokenizer_file.h"

#define THREADS 1
#define MAX_SAMPLES 4
#define MAX_TOKENS 64
#define TEXT_BYTES 8192

/* ------------------------------------------------------------ the model */

static moe_model_config tiny_config(int64_t vocab, int64_t max_positions) {
    moe_model_config c;
    moe_model_config_default_small(&c, vocab);
    c.hidden_size = 16;
    c.intermediate_size = 16;
    c.num_hidden_layers = 2;
    c.num_attention_heads = 2;
    c.num_key_value_heads = 1;
    c.head_dim = 8;
    c.num_local_experts = 4;
    c.num_experts_per_tok = 2;
    c.max_position_embeddings = max_positions;
    return c;
}

/* A checkpoint of cfg under out, with weights uniform in [-0.5, 0.5):
 * larger than the initial N(0, 0.02), so that the logits differ enough for
 * the continuations to vary. Its directory goes to dir [768]; the weights
 * come back (free() them). */
static float *save_checkpoint(char *dir, const moe_model_config *cfg, const char *out, uint64_t seed) {
    moe_model *m = NULL;
    cr_assert_eq(moe_model_create(&m, cfg, 1, 4, seed), MOE_OK, "%s", moe_last_error());
    const int64_t n = moe_model_param_count(m);
    float *p = moe_model_params(m);
    for (int64_t i = 0; i < n; i++) p[i] = moe_rng_uniform_in(seed, 0, (uint64_t)i, -0.5f, 1.0f);
    float *weights = malloc((size_t)n * sizeof *weights);
    cr_assert_not_null(weights);
    memcpy(weights, p, (size_t)n * sizeof *weights);
    moe_trainer *t = NULL;
    moe_optim_config oc = MOE_OPTIM_CONFIG_INIT;
    cr_assert_eq(moe_trainer_create(&t, m, &oc), MOE_OK, "%s", moe_last_error());
    const moe_train_state state = {.seed = seed};
    cr_assert_eq(moe_checkpoint_save(dir, 768, out, m, t, &state), MOE_OK, "%s", moe_last_error());
    moe_trainer_destroy(t);
    moe_model_destroy(m);
    return weights;
}

/* moe_generate on a model of [samples, prompt + new] holding weights: the
 * reference. rows [samples, T] and len [samples] come back. */
static void reference(int32_t *rows, int64_t *len, const moe_model_config *cfg, const float *weights,
                      const int32_t *prompt, int64_t n_prompt, int64_t samples, int64_t new_tokens, int32_t stop,
                      const moe_sampling *s) {
    /* stop negative: none. */
    const int64_t T = n_prompt + new_tokens;
    moe_model *m = NULL;
    cr_assert_eq(moe_model_create(&m, cfg, samples, T, 99), MOE_OK, "%s", moe_last_error());
    memcpy(moe_model_params(m), weights, (size_t)moe_model_param_count(m) * sizeof *weights);
    int64_t end[MAX_SAMPLES];
    for (int64_t b = 0; b < samples; b++) {
        memcpy(rows + b * T, prompt, (size_t)n_prompt * sizeof *prompt);
        len[b] = n_prompt;
        end[b] = T;
    }
    cr_assert_eq(moe_generate(m, rows, len, end, &stop, stop >= 0, s), MOE_OK, "%s", moe_last_error());
    moe_model_destroy(m);
}

/* ------------------------------------------------------------ collecting */

typedef struct got_sample {
    int32_t tokens[MAX_TOKENS];
    int64_t n, prompt_tokens;
    bool stopped;
    char prompt_text[TEXT_BYTES], new_text[TEXT_BYTES];
} got_sample;

typedef struct collected {
    bool started;
    char warnings[1024]; /* every warning, one per line */
    moe_generate_summary summary; /* its pointers are dead after the run */
    int32_t stops[MOE_TOKEN_IDS_MAX]; /* summary.stops, copied */
    char tokenizer[1024];             /* summary.tokenizer, copied; "" for NULL */
    int64_t count;
    got_sample samples[MAX_SAMPLES];
} collected;

static void on_start(void *ctx, const moe_generate_summary *s) {
    collected *c = ctx;
    c->started = true;
    c->summary = *s;
    cr_assert_leq(s->n_stops, MOE_TOKEN_IDS_MAX);
    memcpy(c->stops, s->stops, (size_t)s->n_stops * sizeof *s->stops);
    snprintf(c->tokenizer, sizeof c->tokenizer, "%s", s->tokenizer ? s->tokenizer : "");
}

static void on_sample(void *ctx, const moe_generate_sample *s) {
    collected *c = ctx;
    cr_assert_eq(s->index, c->count, "samples come in order");
    cr_assert_lt(c->count, MAX_SAMPLES);
    cr_assert_leq(s->n, MAX_TOKENS);
    got_sample *g = &c->samples[c->count++];
    memcpy(g->tokens, s->tokens, (size_t)s->n * sizeof *s->tokens);
    g->n = s->n;
    g->prompt_tokens = s->prompt_tokens;
    g->stopped = s->stopped;
    snprintf(g->prompt_text, TEXT_BYTES, "%s", s->prompt_text);
    snprintf(g->new_text, TEXT_BYTES, "%s", s->new_text);
}

static void on_warning(void *ctx, const char *message) {
    collected *c = ctx;
    const size_t at = strlen(c->warnings);
    snprintf(c->warnings + at, sizeof c->warnings - at, "%s\n", message);
}

static moe_generate_options options(const char *dir, const char *prompt) {
    moe_generate_options o;
    moe_generate_options_init(&o);
    o.init_from = dir;
    o.prompt = prompt;
    o.device = MOE_DEVICE_CPU;
    o.threads = THREADS;
    return o;
}

static collected run_ok(const moe_generate_options *o) {
    collected c = {0};
    const moe_generate_callbacks cb = {.ctx = &c, .on_start = on_start, .on_sample = on_sample,
                                       .on_warning = on_warning};
    cr_assert_eq(moe_generate_run(o, &cb), MOE_OK, "%s", moe_last_error());
    cr_assert(c.started);
    cr_assert_eq(c.count, o->samples);
    return c;
}

static void expect_error(const moe_generate_options *o, const char *a, const char *b) {
    collected c = {0};
    const moe_generate_callbacks cb = {.ctx = &c, .on_start = on_start, .on_sample = on_sample};
    cr_assert_neq(moe_generate_run(o, &cb), MOE_OK, "expected a failure naming '%s'", a);
    const char *e = moe_last_error();
    cr_expect(strstr(e, a) && (!b || strstr(e, b)), "error \"%s\" should name '%s' and '%s'", e, a, b ? b : "");
    cr_expect_eq(c.count, 0, "a failed run reports no sample");
}

/* Each sample's tokens against the reference rows [samples, T]; names the
 * first position that differs. */
static void expect_rows(const collected *c, const int32_t *rows, const int64_t *len, int64_t T) {
    for (int64_t b = 0; b < c->count; b++) {
        const got_sample *g = &c->samples[b];
        cr_expect_eq(g->n, len[b], "sample %lld: %lld tokens, the reference %lld", (long long)b, (long long)g->n,
                     (long long)len[b]);
        for (int64_t p = 0; p < g->n && p < len[b]; p++)
            if (g->tokens[p] != rows[b * T + p]) {
                cr_expect_fail("sample %lld, position %lld: token %d, the reference %d", (long long)b, (long long)p,
                               g->tokens[p], rows[b * T + p]);
                break;
            }
    }
}

/* ------------------------------------------------------------ generation */

Test(generate_run, greedy_synthetic_matches_moe_generate, .init = make_tmpdir, .fini = remove_tmpdir) {
    const moe_model_config cfg = tiny_config(MOE_SYNTH_VOCAB_SIZE, 4096);
    char dir[768];
    float *w = save_checkpoint(dir, &cfg, in_tmp("out"), 11);
    moe_generate_options o = options(dir, "<arithmetic> 3+4=");
    o.samples = 2;
    o.max_new_tokens = 12;
    expect_error(&o, "--samples 2 of greedy decoding", "copies of one"); /* two of one row */
    o.samples = 1;
    const collected c = run_ok(&o);
    cr_expect_eq(c.summary.tokens, MOE_TOKENS_SYNTHETIC);
    cr_expect(c.summary.tokens_from_vocab);
    cr_expect_eq(c.summary.prompt_tokens, 5);
    cr_expect_eq(c.summary.seq_len, 17);

    const int32_t prompt[] = {MOE_SYNTH_TOK_BOS + MOE_SYNTH_ARITH, MOE_SYNTH_TOK_DIGIT + 3, MOE_SYNTH_TOK_PLUS,
                              MOE_SYNTH_TOK_DIGIT + 4, MOE_SYNTH_TOK_EQUALS};
    int32_t rows[17];
    int64_t len[1];
    reference(rows, len, &cfg, w, prompt, 5, 1, 12, -1, &o.sampling);
    expect_rows(&c, rows, len, 17);
    for (int64_t b = 0; b < 1; b++) {
        const got_sample *g = &c.samples[b];
        cr_expect_eq(g->n, 17, "no stop token: every sample runs to the end");
        cr_expect_not(g->stopped);
        cr_expect_str_eq(g->prompt_text, "<arithmetic>3+4=");
        char want[TEXT_BYTES] = "";
        for (int64_t p = 5; p < len[b]; p++) strcat(want, moe_synth_token_text(rows[b * 17 + p]));
        cr_expect_str_eq(g->new_text, want);
    }
    free(w);
}

Test(generate_run, sampled_ids_with_stop_match_moe_generate, .init = make_tmpdir, .fini = remove_tmpdir) {
    const moe_model_config cfg = tiny_config(11, 4096);
    char dir[768];
    float *w = save_checkpoint(dir, &cfg, in_tmp("out"), 12);
    moe_generate_options o = options(dir, " 1, 2 ,10");
    o.samples = 3;
    o.max_new_tokens = 20;
    o.sampling = (moe_sampling){.temperature = 1.5, .top_k = 6, .seed = 5};
    o.stop = "3";
    const collected c = run_ok(&o);
    cr_expect_eq(c.summary.tokens, MOE_TOKENS_IDS);
    cr_expect(c.summary.tokens_from_vocab);

    const int32_t prompt[] = {1, 2, 10};
    int32_t rows[3 * 23];
    int64_t len[3];
    reference(rows, len, &cfg, w, prompt, 3, 3, 20, 3, &o.sampling);
    expect_rows(&c, rows, len, 23);
    int64_t stopped = 0;
    for (int64_t b = 0; b < 3; b++) {
        const got_sample *g = &c.samples[b];
        const bool ends_on_stop = len[b] > 3 && rows[b * 23 + len[b] - 1] == 3;
        cr_expect_eq(g->stopped, ends_on_stop, "sample %lld", (long long)b);
        cr_expect(ends_on_stop || len[b] == 23, "sample %lld ends early without its stop token", (long long)b);
        stopped += ends_on_stop;
        cr_expect_str_eq(g->prompt_text, "1,2,10");
        char want[TEXT_BYTES] = "";
        for (int64_t p = 3; p < len[b]; p++)
            snprintf(want + strlen(want), TEXT_BYTES - strlen(want), "%s%d", p > 3 ? "," : "", rows[b * 23 + p]);
        cr_expect_str_eq(g->new_text, want);
    }
    cr_expect_gt(stopped, 0, "the seed was picked so that some sample meets the stop token");

    /* Sample 0 alone draws what it drew beside the others. */
    o.samples = 1;
    const collected one = run_ok(&o);
    cr_expect_eq(one.samples[0].n, c.samples[0].n);
    cr_expect_eq(memcmp(one.samples[0].tokens, c.samples[0].tokens, (size_t)c.samples[0].n * sizeof(int32_t)), 0,
                 "sample 0 changed with the number of samples");
    free(w);
}

/* The byte-level text of tokens [n], written without generate.c's table;
 * '|', which separates a sample's prompt from its continuation, escaped
 * too. */
static void escape_bytes(char *out, const int32_t *tokens, int64_t n) {
    out[0] = '\0';
    for (int64_t i = 0; i < n; i++) {
        const int c = tokens[i];
        char *p = out + strlen(out);
        if (c == '\n') strcpy(p, "\\n");
        else if (c == '\t') strcpy(p, "\\t");
        else if (c == '\r') strcpy(p, "\\r");
        else if (c == '\\') strcpy(p, "\\\\");
        else if (c >= ' ' && c <= '~' && c != '|') p[0] = (char)c, p[1] = '\0';
        else sprintf(p, "\\x%02x", c);
    }
}

Test(generate_run, bytes_are_escaped, .init = make_tmpdir, .fini = remove_tmpdir) {
    const moe_model_config cfg = tiny_config(256, 4096);
    char dir[768];
    float *w = save_checkpoint(dir, &cfg, in_tmp("out"), 13);
    /* Raw bytes, a backslash written as its escape; and the whole prompt
     * as printed: the same tokens. */
    moe_generate_options o = options(dir, "a\nb\x01\\\\\xff");
    o.max_new_tokens = 24;
    o.sampling = (moe_sampling){.temperature = 1.0, .seed = 3};
    const collected c = run_ok(&o);
    moe_generate_options printed = o;
    printed.prompt = "a\\nb\\x01\\\\\\xff";
    const collected again = run_ok(&printed);
    cr_expect_str_eq(again.samples[0].new_text, c.samples[0].new_text);
    printed.prompt = "a\\qb";
    expect_error(&printed, "--prompt", "'\\q' is no escape");
    printed.prompt = "ab\\x4";
    expect_error(&printed, "byte 2", "'\\x' needs two hex digits");
    /* A --stop of several bytes is shown as samples are printed. */
    printed.prompt = "a";
    printed.stop = "\n\xff";
    expect_error(&printed, "--stop '\\n\\xff' holds 2 tokens", "it takes one");
    cr_expect_eq(c.summary.tokens, MOE_TOKENS_BYTES);
    const got_sample *g = &c.samples[0];
    cr_expect_str_eq(g->prompt_text, "a\\nb\\x01\\\\\\xff");
    const int32_t prompt[] = {'a', '\n', 'b', 1, '\\', 0xff};
    int32_t rows[30];
    int64_t len[1];
    reference(rows, len, &cfg, w, prompt, 6, 1, 24, -1, &o.sampling);
    expect_rows(&c, rows, len, 30);
    char want[TEXT_BYTES];
    escape_bytes(want, rows + 6, len[0] - 6);
    cr_expect_str_eq(g->new_text, want);

    /* Named explicitly, the same kind is no longer chosen from the vocabulary. */
    o.tokens = MOE_TOKENS_BYTES;
    cr_expect_not(run_ok(&o).summary.tokens_from_vocab);
    /* The synthetic texts cannot write tokens past 53. */
    o.tokens = MOE_TOKENS_SYNTHETIC;
    o.prompt = "<copy>";
    expect_error(&o, "--tokens synthetic", "vocab_size is 256");
    free(w);
}

/* ------------------------------------------------------------ tokenizer files */

/* A tokenizer file of count tokens (tokenizer_file.h) at path. */
static void write_tokenizer(const char *path, uint32_t version, uint32_t count, uint32_t eot) {
    size_t size;
    unsigned char *buf = tok_file_new(&size, MOE_TOKENIZER_MAGIC, version, count, eot);
    write_bytes(path, buf, size);
    free(buf);
}

/* tokens [n] as a tokenizer of count tokens prints them, from the bytes
 * tokenizer_file.h gives each id: an id past count as "\\<id N>". */
static void decoded(char *out, const int32_t *tokens, int64_t n, int64_t count) {
    out[0] = '\0';
    for (int64_t i = 0; i < n; i++) {
        char *p = out + strlen(out);
        if (tokens[i] >= count) {
            sprintf(p, "\\<id %d>", tokens[i]);
            continue;
        }
        unsigned char bytes[255];
        int32_t as_tokens[255];
        const size_t len = tok_bytes_of(bytes, tokens[i]);
        for (size_t j = 0; j < len; j++) as_tokens[j] = bytes[j];
        escape_bytes(p, as_tokens, (int64_t)len);
    }
}

Test(generate_run, a_tokenizer_prints_the_ids_as_text, .init = make_tmpdir, .fini = remove_tmpdir) {
    /* A vocabulary padded past the tokenizer's 260 ids, as GPT-2's 50257
     * are to 50304. */
    const moe_model_config cfg = tiny_config(300, 4096);
    char dir[768];
    free(save_checkpoint(dir, &cfg, in_tmp("out"), 14));
    write_tokenizer(in_tmp("tok.bin"), 2, 260, 259);
    moe_generate_options o = options(dir, "1,127,256,270");
    o.samples = 3;
    o.max_new_tokens = 20;
    o.sampling = (moe_sampling){.temperature = 1.5, .seed = 4};
    /* Without the tokenizer, the same draws stop at its end-of-text only
     * when told. */
    o.stop = "259";
    const collected ids = run_ok(&o);
    o.stop = NULL;
    o.tokenizer = in_tmp("tok.bin");
    const collected text = run_ok(&o);
    cr_expect_eq(text.summary.tokens, MOE_TOKENS_IDS);
    cr_expect_not(text.summary.tokens_from_vocab, "the tokenizer chose ids, not the vocabulary");
    cr_expect_str_eq(text.tokenizer, in_tmp("tok.bin"));
    cr_expect_eq(text.summary.tokenizer_tokens, 260);
    cr_expect(text.summary.stop_source == MOE_STOP_TOKENIZER && text.summary.n_stops == 1);
    cr_expect_str_eq(text.warnings, "", "a tokenizer smaller than the vocabulary is a padded one");
    int64_t unknown = 0;
    for (int64_t b = 0; b < 3; b++) {
        const got_sample *g = &text.samples[b], *r = &ids.samples[b];
        cr_assert_eq(g->n, r->n, "sample %lld", (long long)b);
        cr_expect_eq(memcmp(g->tokens, r->tokens, (size_t)g->n * sizeof *g->tokens), 0, "sample %lld's tokens",
                     (long long)b);
        cr_expect_eq(g->stopped, r->stopped);
        /* Id 127's byte is '|' (127 * 7 + 3 = 0x37c), 256 the longest token,
         * 270 past the tokenizer. */
        char want[TEXT_BYTES];
        decoded(want, g->tokens, 4, 260);
        cr_expect_str_eq(g->prompt_text, want);
        cr_expect(strstr(g->prompt_text, "\\x7c") && strstr(g->prompt_text, "\\<id 270>"), "%s", g->prompt_text);
        decoded(want, r->tokens + 4, r->n - 4, 260);
        cr_expect_str_eq(g->new_text, want);
        for (int64_t p = 4; p < g->n; p++) unknown += g->tokens[p] >= 260;
    }
    cr_expect_gt(unknown, 0, "the seed was picked so that some sample draws an id past the tokenizer");
}

Test(generate_run, a_tokenizers_end_of_text_stops_a_sample, .init = make_tmpdir, .fini = remove_tmpdir) {
    const moe_model_config cfg = tiny_config(300, 4096);
    char dir[768];
    free(save_checkpoint(dir, &cfg, in_tmp("out"), 15));
    moe_generate_options o = options(dir, "5,6");
    o.max_new_tokens = 6;
    const collected ids = run_ok(&o);
    const int32_t first = ids.samples[0].tokens[2];
    cr_assert_lt(first, 260, "the seed was picked so that the first new token is one the tokenizer knows");
    /* Greedy, so the first token drawn is the same again: as the
     * end-of-text it ends the sample. */
    write_tokenizer(in_tmp("tok.bin"), 2, 260, (uint32_t)first);
    o.tokenizer = in_tmp("tok.bin");
    collected text = run_ok(&o);
    cr_expect(text.summary.stop_source == MOE_STOP_TOKENIZER && text.summary.n_stops == 1);
    cr_expect_eq(text.samples[0].n, 3);
    cr_expect(text.samples[0].stopped);
    /* --stop replaces it. */
    o.stop = "299";
    text = run_ok(&o);
    cr_expect(text.summary.stop_source == MOE_STOP_FLAG && text.summary.n_stops == 1);
    cr_expect_eq(text.samples[0].n, ids.samples[0].n, "--stop 299 replaced the end-of-text");
    /* A version 1 file names no end-of-text unless it is GPT-2's. */
    write_tokenizer(in_tmp("v1.bin"), 1, 260, 0);
    o.stop = NULL;
    o.tokenizer = in_tmp("v1.bin");
    text = run_ok(&o);
    cr_expect_eq(text.summary.stop_source, MOE_STOP_NONE);
    cr_expect_eq(text.samples[0].n, ids.samples[0].n);
    cr_expect_not(text.samples[0].stopped);
    /* GPT-2's, past this model's vocabulary of 300: no stop, and two warnings. */
    write_tokenizer(in_tmp("gpt2.bin"), 1, MOE_TOKENIZER_GPT2_TOKENS, 0);
    o.tokenizer = in_tmp("gpt2.bin");
    text = run_ok(&o);
    cr_expect_eq(text.summary.stop_source, MOE_STOP_NONE);
    cr_expect_not(text.samples[0].stopped);
    cr_expect(strstr(text.warnings, "holds 50257 tokens, more than the model's vocabulary of 300") &&
                  strstr(text.warnings, "its end-of-text 50256 lies outside the model's vocabulary"),
              "%s", text.warnings);
}

/* Without --stop or an llm.c end-of-text, the checkpoint's eos_token_id
 * ends a sample, as transformers' generate has it: any id of a list
 * (Llama 3 lists three), those outside the vocabulary left out; --stop
 * replaces them, and a config without one stops nowhere. */
Test(generate_run, the_configs_eos_stops_a_sample, .init = make_tmpdir, .fini = remove_tmpdir) {
    moe_model_config cfg = tiny_config(300, 4096);
    char dir[768];
    free(save_checkpoint(dir, &cfg, in_tmp("none"), 15));
    moe_generate_options o = options(dir, "5,6");
    o.max_new_tokens = 6;
    const collected ids = run_ok(&o);
    cr_expect_eq(ids.summary.stop_source, MOE_STOP_NONE);
    const int32_t second = ids.samples[0].tokens[3];
    cr_assert(second != ids.samples[0].tokens[2] && ids.samples[0].tokens[2] != 299,
              "the seed was picked so that the first new token is neither the second nor 299");
    /* Greedy: the same draws, ended by the second token drawn, a list's
     * second id; 300 and -1 name no token of this vocabulary. */
    cfg.eos_token_id = (moe_token_ids){.form = MOE_TOKEN_ID_LIST, .n = 4, .ids = {300, second, 299, -1}};
    free(save_checkpoint(dir, &cfg, in_tmp("eos"), 15));
    o.init_from = dir;
    collected c = run_ok(&o);
    cr_expect(c.summary.stop_source == MOE_STOP_CONFIG && c.summary.n_stops == 2 && c.stops[0] == second &&
                  c.stops[1] == 299,
              "source %d, %d stops", (int)c.summary.stop_source, c.summary.n_stops);
    cr_expect_eq(c.samples[0].n, 4);
    cr_expect(c.samples[0].stopped);
    o.stop = "299";
    c = run_ok(&o);
    cr_expect_eq(c.summary.stop_source, MOE_STOP_FLAG);
    cr_expect_eq(c.samples[0].n, ids.samples[0].n, "--stop 299 replaced the eos");
    /* A Hugging Face directory's generation_config.json says first, as
     * transformers' generate reads it: its eos (the first token drawn),
     * or null, none; a malformed one is refused, naming it. */
    o.stop = NULL;
    char path[1024], text[128];
    snprintf(path, sizeof path, "%s/generation_config.json", dir);
    const int n = snprintf(text, sizeof text, "{\"eos_token_id\": %d}", ids.samples[0].tokens[2]);
    write_bytes(path, text, (size_t)n);
    c = run_ok(&o);
    cr_expect(c.summary.stop_source == MOE_STOP_GENERATION_CONFIG && c.summary.n_stops == 1);
    cr_expect(c.samples[0].n == 3 && c.samples[0].stopped, "%lld tokens", (long long)c.samples[0].n);
    const char *none = "{\"eos_token_id\": null}", *bad = "{\"eos_token_id\": \"x\"}";
    write_bytes(path, none, strlen(none));
    c = run_ok(&o);
    cr_expect_eq(c.summary.stop_source, MOE_STOP_NONE);
    cr_expect_eq(c.samples[0].n, ids.samples[0].n);
    write_bytes(path, bad, strlen(bad));
    expect_error(&o, "generation_config.json", "eos_token_id");
    /* --stop says first: the file is not read. */
    o.stop = "299";
    c = run_ok(&o);
    cr_expect_eq(c.summary.stop_source, MOE_STOP_FLAG);
    /* A file without the key has none, as transformers reads it. */
    o.stop = NULL;
    write_bytes(path, "{}", 2);
    c = run_ok(&o);
    cr_expect_eq(c.summary.stop_source, MOE_STOP_NONE);
    cr_expect_eq(c.samples[0].n, ids.samples[0].n);
}

/* A checkpoint with its own tokenizer.json (a Hugging Face model's, or
 * one a run from it kept) prints ids through it without --tokenizer; a
 * vocabulary of synthetic tokens or bytes keeps its own form. */
Test(generate_run, a_checkpoints_tokenizer_json_prints_its_samples, .init = make_tmpdir, .fini = remove_tmpdir) {
    const moe_model_config cfg = tiny_config(300, 4096);
    char dir[768], path[1024];
    free(save_checkpoint(dir, &cfg, in_tmp("out"), 15));
    moe_generate_options o = options(dir, "5,6");
    o.max_new_tokens = 4;
    const collected ids = run_ok(&o);
    cr_expect_str_eq(ids.tokenizer, "");
    /* Every id a one-letter token: "a" + id % 26, so that the text is the ids'. */
    char json[16384];
    int n = snprintf(json, sizeof json, "{\"model\": {\"vocab\": {");
    for (int id = 0; id < 300; id++)
        n += snprintf(json + n, sizeof json - (size_t)n, "%s\"%c%d\": %d", id ? ", " : "", 'a' + id % 26, id / 26, id);
    snprintf(json + n, sizeof json - (size_t)n, "}}, \"decoder\": {\"type\": \"ByteLevel\"}}");
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    write_bytes(path, json, strlen(json));
    const collected text = run_ok(&o);
    cr_expect_str_eq(text.tokenizer, path);
    cr_expect_eq(text.samples[0].n, ids.samples[0].n);
    char want[64] = "";
    for (int64_t p = 2; p < text.samples[0].n; p++) {
        const int32_t id = ids.samples[0].tokens[p];
        snprintf(want + strlen(want), sizeof want - strlen(want), "%c%d", 'a' + id % 26, id / 26);
    }
    cr_expect_str_eq(text.samples[0].new_text, want);
    cr_expect(text.summary.tokenizer_found);
    /* --tokens ids asks for ids: they stay ids. */
    o.tokens = MOE_TOKENS_IDS;
    collected asked = run_ok(&o);
    cr_expect_str_eq(asked.tokenizer, "");
    cr_expect_str_eq(asked.samples[0].new_text, ids.samples[0].new_text);
    /* One it cannot read is warned about, and the samples stay ids: nobody
     * asked for it. An empty --tokenizer is no file. */
    o.tokens = MOE_TOKENS_AUTO;
    write_bytes(path, "{\"model\": {", 11);
    asked = run_ok(&o);
    cr_expect_str_eq(asked.tokenizer, "");
    cr_expect_str_eq(asked.samples[0].new_text, ids.samples[0].new_text);
    cr_expect(strstr(asked.warnings, "tokenizer.json") && strstr(asked.warnings, "the samples print as ids"), "%s",
              asked.warnings);
    o.tokenizer = "";
    expect_error(&o, "--tokenizer must not be empty", NULL);
}

/* A checkpoint with tests/data/NAME.json as its tokenizer.json reads the
 * prompt as text: the samples begin with the ids it gives (test_tokenizer
 * checks those against transformers' tokenizers), the template's
 * begin-of-text bos first; --tokens ids keeps the prompt ids. */
static void expect_prompt_as_text(const char *name, const char *prompt, int32_t bos, uint64_t seed) {
    const moe_model_config cfg = tiny_config(448, 4096);
    char dir[768], src[1024], dst[1024];
    free(save_checkpoint(dir, &cfg, in_tmp(name), seed));
    snprintf(src, sizeof src, "%s/%s.json", MOE_TEST_DATA_DIR, name);
    snprintf(dst, sizeof dst, "%s/tokenizer.json", dir);
    size_t size;
    unsigned char *json = read_bytes(src, &size);
    write_bytes(dst, json, size);
    free(json);
    moe_tokenizer *t = NULL;
    cr_assert_eq(moe_tokenizer_open(&t, src), MOE_OK, "%s", moe_last_error());
    int32_t *want = NULL;
    int64_t n = 0;
    cr_assert_eq(moe_tokenizer_encode(t, prompt, true, &want, &n), MOE_OK, "%s", moe_last_error());
    moe_tokenizer_close(t);
    moe_generate_options o = options(dir, prompt);
    o.max_new_tokens = 3;
    const collected c = run_ok(&o);
    cr_expect(c.summary.encodes, "%s", name);
    cr_assert_eq(c.samples[0].prompt_tokens, n, "%s", name);
    for (int64_t i = 0; i < n; i++) cr_expect_eq(c.samples[0].tokens[i], want[i], "%s: prompt token %lld", name, (long long)i);
    cr_expect_eq(c.samples[0].tokens[0], bos, "%s: the template's begin-of-text", name);
    free(want);
    o.tokens = MOE_TOKENS_IDS;
    expect_error(&o, "--prompt", "token id");
}

/* Llama 3's kind (byte-level) and Mixtral's (SentencePiece-style, its
 * [INST] an added token). */
Test(generate_run, a_tokenizer_that_encodes_reads_the_prompt_as_text, .init = make_tmpdir, .fini = remove_tmpdir) {
    expect_prompt_as_text("tokenizer_llama3", "Hello world! It's 2026.", 2, 15);
    expect_prompt_as_text("tokenizer_mixtral", "[INST] Hello world! It's 2026. [/INST]", 1, 17);
}

Test(generate_run, a_tokenizer_refuses_other_token_forms_and_bad_files, .init = make_tmpdir,
     .fini = remove_tmpdir) {
    const moe_model_config cfg = tiny_config(256, 4096);
    char dir[768];
    free(save_checkpoint(dir, &cfg, in_tmp("out"), 16));
    write_tokenizer(in_tmp("tok.bin"), 2, 256, 255);
    moe_generate_options o = options(dir, "97,98");
    o.tokenizer = in_tmp("tok.bin");
    /* A vocabulary of 256 would be read as bytes; the tokenizer makes it ids. */
    cr_expect_eq(run_ok(&o).summary.tokens, MOE_TOKENS_IDS);
    o.tokens = MOE_TOKENS_IDS;
    cr_expect_eq(run_ok(&o).summary.tokens, MOE_TOKENS_IDS);
    o.tokens = MOE_TOKENS_BYTES;
    expect_error(&o, "--tokenizer", "--tokens bytes");
    o.tokens = MOE_TOKENS_SYNTHETIC;
    expect_error(&o, "--tokenizer", "--tokens synthetic");
    o.tokens = MOE_TOKENS_AUTO;
    o.tokenizer = in_tmp("absent.bin");
    expect_error(&o, "--tokenizer", in_tmp("absent.bin"));
    write_bytes(in_tmp("cut.bin"), "abc", 3);
    o.tokenizer = in_tmp("cut.bin");
    expect_error(&o, in_tmp("cut.bin"), "shorter than the 1024-byte tokenizer header");
}

Test(generate_run, errors_name_what_is_wrong, .init = make_tmpdir, .fini = remove_tmpdir) {
    char synth[768], ids[768];
    const moe_model_config cs = tiny_config(MOE_SYNTH_VOCAB_SIZE, 16), ci = tiny_config(11, 4096);
    free(save_checkpoint(synth, &cs, in_tmp("synth"), 1));
    free(save_checkpoint(ids, &ci, in_tmp("ids"), 2));

    moe_generate_options o = options(in_tmp("absent"), "<copy>a");
    expect_error(&o, "--init-from", in_tmp("absent"));
    o = options(synth, "<arithmetic>3?4");
    expect_error(&o, "byte 13", "'?'");
    o = options(synth, "<arith>");
    expect_error(&o, "byte 0", "'<'");
    o = options(synth, " ");
    expect_error(&o, "--prompt", "<arithmetic>");

    /* 5 + 11 positions fit max_position_embeddings 16, 5 + 12 do not. */
    o = options(synth, "<arithmetic>3+4=");
    o.max_new_tokens = 11;
    cr_expect_eq(run_ok(&o).summary.seq_len, 16);
    o.max_new_tokens = 12;
    expect_error(&o, "max_position_embeddings 16", "--max-new-tokens 12");

    o = options(ids, "1,11");
    expect_error(&o, "token id 11", "vocab_size 11");
    o = options(ids, "1,x");
    expect_error(&o, "byte 2", "'x'");
    o = options(ids, "1,");
    expect_error(&o, "byte 2", "the end");
    o = options(ids, "4");
    o.stop = "1,2";
    expect_error(&o, "--stop", "2 tokens");
    o = options(ids, "4");
    o.tokens = MOE_TOKENS_SYNTHETIC;
    o.prompt = "<copy>a";
    expect_error(&o, "id 21", "vocab_size 11");
    o = options(synth, "<copy>");
    o.tokens = MOE_TOKENS_BYTES;
    o.prompt = "a";
    expect_error(&o, "'a'", "vocab_size 54");
    o = options(ids, "4");
    o.samples = 0;
    expect_error(&o, "--samples", NULL);
    o = options(ids, "4");
    o.max_new_tokens = 0;
    expect_error(&o, "--max-new-tokens", NULL);
    o = options(ids, "4");
    o.sampling.temperature = -1.0;
    expect_error(&o, "--temperature", NULL);
    /* Greedy draws nothing for --top-k to limit. */
    o = options(ids, "4");
    o.sampling.top_k = 3;
    expect_error(&o, "--top-k 3", "--temperature 0");
}

Test(generate_run, token_kind_names) {
    for (int k = MOE_TOKENS_AUTO; k <= MOE_TOKENS_IDS; k++) {
        moe_token_kind got = MOE_TOKENS_AUTO;
        cr_expect_eq(moe_token_kind_parse(&got, moe_token_kind_name((moe_token_kind)k)), MOE_OK);
        cr_expect_eq(got, k);
    }
    moe_token_kind got;
    cr_expect_neq(moe_token_kind_parse(&got, "text"), MOE_OK);
    cr_expect(strstr(moe_last_error(), "--tokens 'text'"), "%s", moe_last_error());
}

/* ------------------------------------------------------------ moe_synth_parse */

Test(synth_parse, every_token_round_trips) {
    int32_t tokens[2 * MOE_SYNTH_VOCAB_SIZE];
    int64_t n = -1;
    char all[1024] = "";
    for (int32_t t = 0; t < MOE_SYNTH_VOCAB_SIZE; t++) {
        const char *text = moe_synth_token_text(t);
        cr_assert_eq(moe_synth_parse(tokens, 4, &n, text), MOE_OK, "'%s': %s", text, moe_last_error());
        cr_expect(n == 1 && tokens[0] == t, "'%s' parsed as %lld tokens, the first %d; expected token %d", text,
                  (long long)n, tokens[0], t);
        strcat(all, text);
        if (t % 3 == 0) strcat(all, t % 2 ? " " : "\t\n");
    }
    /* Run together, "<copy>" stays one token next to letters, '>' next to '<'. */
    cr_assert_eq(moe_synth_parse(tokens, 2 * MOE_SYNTH_VOCAB_SIZE, &n, all), MOE_OK, "%s", moe_last_error());
    cr_assert_eq(n, MOE_SYNTH_VOCAB_SIZE, "'%s' parsed as %lld tokens", all, (long long)n);
    for (int32_t t = 0; t < MOE_SYNTH_VOCAB_SIZE; t++) cr_expect_eq(tokens[t], t, "token %d of '%s'", t, all);

    const int32_t want[] = {MOE_SYNTH_TOK_BOS + MOE_SYNTH_COPY, MOE_SYNTH_TOK_LETTER + 0, MOE_SYNTH_TOK_MARK,
                            MOE_SYNTH_TOK_BOS + MOE_SYNTH_MARKOV, MOE_SYNTH_TOK_STATE + 0};
    cr_assert_eq(moe_synth_parse(tokens, 8, &n, "<copy>a><markov>A"), MOE_OK, "%s", moe_last_error());
    cr_assert_eq(n, 5);
    for (int i = 0; i < 5; i++) cr_expect_eq(tokens[i], want[i], "token %d", i);
    cr_expect_eq(moe_synth_parse(tokens, 0, &n, "  "), MOE_OK);
    cr_expect_eq(n, 0);
}

static void expect_parse_error(const char *text, int64_t capacity, const char *a, const char *b) {
    int32_t tokens[16];
    int64_t n;
    cr_assert_neq(moe_synth_parse(tokens, capacity, &n, text), MOE_OK, "'%s' should be refused", text);
    const char *e = moe_last_error();
    cr_expect(strstr(e, a) && strstr(e, b), "'%s': error \"%s\" should name '%s' and '%s'", text, e, a, b);
}

Test(synth_parse, refuses_unknown_characters_and_overflow) {
    expect_parse_error("3+4=x", 16, "byte 4", "'x'");
    expect_parse_error("<arithmetic", 16, "byte 0", "'<'");
    expect_parse_error("ab<cop>", 16, "byte 2", "'<'");
    expect_parse_error("aq", 16, "byte 1", "'q'");
    expect_parse_error("1 \x01", 16, "byte 2", "0x01");
    expect_parse_error("Z\xc3\xa9", 16, "byte 0", "'Z'");
    expect_parse_error("A\xc3\xa9", 16, "byte 1", "0xc3");
    expect_parse_error("12 3", 2, "more than 2 tokens", "byte 3 ('3')");
}
