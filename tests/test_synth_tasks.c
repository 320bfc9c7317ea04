/* test_synth_tasks.c: moe_synth_tasks_solve (engine/synth_tasks.h) on a
 * model whose greedy continuation is known in advance.
 *
 * With every weight zero but the embedding, the final norm and the head,
 * each layer adds nothing to the residual stream, so the last hidden state
 * at a position is the embedding of its token. One-hot embeddings and a
 * head whose row j is the sum of the one-hot vectors of the tokens i with
 * next(i) = j make the model a fixed bigram table: greedy generation
 * writes next(current token). Here '=' -> '1' -> '1', '>' -> 'a' -> 'a', so
 * the sums whose answer is "11" and the copies of "a..." letters alone are
 * solved. The stream is written by hand, so which examples exist, which
 * fit a row and which are solved is known exactly. */
#include <criterion/criterion.h>
#include <string.h>

#include "engine/model.h"
#include "engine/synth_tasks.h"

#define V MOE_SYNTH_VOCAB_SIZE
#define D 64 /* >= V, for one-hot embeddings */
#define B 3
#define T 16 /* the rows of the first test */

static float *tensor(moe_model *m, const char *name) {
    const moe_model_tensor *t = moe_model_find_tensor(m, name);
    cr_assert(t, "no tensor %s", name);
    return moe_model_params(m) + t->offset;
}

static moe_model *bigram_model(int64_t rows_T) {
    moe_model_config cfg;
    moe_model_config_default_small(&cfg, V);
    cfg.hidden_size = D;
    cfg.head_dim = 16;
    cfg.intermediate_size = 32;
    cfg.num_hidden_layers = 2;
    moe_model *m = NULL;
    cr_assert_eq(moe_model_create(&m, &cfg, B, rows_T, 1), MOE_OK, "%s", moe_last_error());
    memset(moe_model_params(m), 0, (size_t)moe_model_param_count(m) * sizeof(float));
    float *embed = tensor(m, "model.embed_tokens.weight"), *head = tensor(m, "lm_head.weight");
    float *norm = tensor(m, "model.norm.weight");
    for (int i = 0; i < V; i++) embed[i * D + i] = 1.0f;
    for (int c = 0; c < D; c++) norm[c] = 1.0f;
    const int32_t one = MOE_SYNTH_TOK_DIGIT + 1, a = MOE_SYNTH_TOK_LETTER;
    const int32_t next[][2] = {{MOE_SYNTH_TOK_EQUALS, one}, {one, one}, {MOE_SYNTH_TOK_MARK, a}, {a, a}};
    for (size_t r = 0; r < sizeof next / sizeof *next; r++) head[next[r][1] * D + next[r][0]] = 1.0f;
    return m;
}

/* Appends the tokens of text (token texts without separators) to s. */
static void append(moe_synth_stream *s, const char *text, moe_synth_kind kind) {
    static const char *const bos[] = {"<arithmetic>", "<copy>", "<brackets>", "<markov>"};
    while (*text) {
        int32_t tok = -1;
        for (int k = 0; k < MOE_SYNTH_KIND_COUNT; k++)
            if (strncmp(text, bos[k], strlen(bos[k])) == 0) tok = k, text += strlen(bos[k]);
        if (tok < 0) {
            for (int32_t t = MOE_SYNTH_KIND_COUNT; t < V; t++)
                if (moe_synth_token_text(t)[0] == *text) tok = t;
            text++;
        }
        cr_assert(tok >= 0, "no token for '%c'", text[-1]);
        s->tokens[s->n] = tok;
        s->kinds[s->n++] = (uint8_t)kind;
    }
}

Test(synth_tasks, solves_exactly_what_the_bigram_model_can) {
    moe_model *m = bigram_model(T);
    static int32_t tokens[4096];
    static uint8_t kinds[4096];
    moe_synth_stream s = {.n = 0, .tokens = tokens, .kinds = kinds};
    /* The first sum's prompt would start before the stream: passed over. */
    append(&s, "<arithmetic>5+6=11;", MOE_SYNTH_ARITH);
    append(&s, "<markov>ABCDEFGHIJKLMNOP", MOE_SYNTH_MARKOV);
    for (int i = 0; i < 4; i++) {
        append(&s, "<arithmetic>5+6=11;3+4=07;9+2=11;", MOE_SYNTH_ARITH); /* 2 of 3 solvable */
        append(&s, "<copy>aaa>aaa", MOE_SYNTH_COPY);                    /* solvable */
        append(&s, "<copy>ab>ab", MOE_SYNTH_COPY);                      /* not */
        /* 8 letters need 8 + 1 before the '>' and 8 after: 17 > T, passed over. */
        append(&s, "<copy>aaaaaaaa>aaaaaaaa", MOE_SYNTH_COPY);
        append(&s, "<brackets>([])", MOE_SYNTH_BRACKETS);
    }
    /* The last sum's answer would run past the stream: passed over. */
    append(&s, "<arithmetic>1+1=0", MOE_SYNTH_ARITH);

    moe_synth_task_score score;
    cr_assert_eq(moe_synth_tasks_solve(&score, m, &s, 100), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(score.tried[MOE_SYNTH_TASK_SUM], 12, "sums tried %lld", (long long)score.tried[MOE_SYNTH_TASK_SUM]);
    cr_expect_eq(score.solved[MOE_SYNTH_TASK_SUM], 8, "sums solved %lld",
                 (long long)score.solved[MOE_SYNTH_TASK_SUM]);
    cr_expect_eq(score.tried[MOE_SYNTH_TASK_COPY], 8, "copies tried %lld",
                 (long long)score.tried[MOE_SYNTH_TASK_COPY]);
    cr_expect_eq(score.solved[MOE_SYNTH_TASK_COPY], 4, "copies solved %lld",
                 (long long)score.solved[MOE_SYNTH_TASK_COPY]);

    /* A cap takes the first examples: 11, 07, 11, 11, 07 for the sums; aaa,
     * ab, aaa, ab, aaa for the copies. */
    cr_assert_eq(moe_synth_tasks_solve(&score, m, &s, 5), MOE_OK, "%s", moe_last_error());
    cr_expect(score.tried[MOE_SYNTH_TASK_SUM] == 5 && score.solved[MOE_SYNTH_TASK_SUM] == 3,
              "capped sums: %lld of %lld", (long long)score.solved[MOE_SYNTH_TASK_SUM],
              (long long)score.tried[MOE_SYNTH_TASK_SUM]);
    cr_expect(score.tried[MOE_SYNTH_TASK_COPY] == 5 && score.solved[MOE_SYNTH_TASK_COPY] == 3,
              "capped copies: %lld of %lld", (long long)score.solved[MOE_SYNTH_TASK_COPY],
              (long long)score.tried[MOE_SYNTH_TASK_COPY]);
    moe_model_destroy(m);
}

/* Rows too short for "a+b=" before the answer pass every sum over (and
 * rows of one or two tokens pass everything over without a fault). */
Test(synth_tasks, short_rows_pass_over_what_they_cannot_hold) {
    static int32_t tokens[256];
    static uint8_t kinds[256];
    moe_synth_stream s = {.n = 0, .tokens = tokens, .kinds = kinds};
    for (int i = 0; i < 8; i++) {
        append(&s, "<arithmetic>5+6=11;", MOE_SYNTH_ARITH);
        append(&s, "<copy>a>a", MOE_SYNTH_COPY);
    }
    const int64_t lengths[] = {1, 2, 5, 6};
    const int64_t sums[] = {0, 0, 0, 8}, copies[] = {0, 0, 8, 8};
    for (size_t i = 0; i < sizeof lengths / sizeof *lengths; i++) {
        moe_model *m = bigram_model(lengths[i]);
        moe_synth_task_score score;
        cr_assert_eq(moe_synth_tasks_solve(&score, m, &s, 100), MOE_OK, "T %lld: %s", (long long)lengths[i],
                     moe_last_error());
        cr_expect(score.tried[MOE_SYNTH_TASK_SUM] == sums[i] && score.tried[MOE_SYNTH_TASK_COPY] == copies[i],
                  "T %lld: %lld sums and %lld copies tried, want %lld and %lld", (long long)lengths[i],
                  (long long)score.tried[MOE_SYNTH_TASK_SUM], (long long)score.tried[MOE_SYNTH_TASK_COPY],
                  (long long)sums[i], (long long)copies[i]);
        cr_expect(score.solved[MOE_SYNTH_TASK_SUM] == score.tried[MOE_SYNTH_TASK_SUM] &&
                      score.solved[MOE_SYNTH_TASK_COPY] == score.tried[MOE_SYNTH_TASK_COPY],
                  "T %lld: the bigram model solves every one of these", (long long)lengths[i]);
        moe_model_destroy(m);
    }
}
