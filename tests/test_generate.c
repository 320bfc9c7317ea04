/* test_generate.c: the generation core (engine/generate.h).
 *
 * Generation rests on one property of the model: the logits at position p
 * do not depend on the tokens after p, nor on the other rows, while
 * routing is dropless. The first test checks that (up to the last bits of
 * a float sum); the decoding tests check steps against the cache against a
 * full forward; the others check moe_generate against argmax and draws
 * taken from full forwards, and the sampler's distribution against the
 * softmax it claims. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/rng.h"
#include "engine/generate.h"
#include "engine/model.h"
#include "engine/trainer.h"

#define VOCAB 32
#define B 2
#define T 16
#define SEED 7

/* What the attention of a test model does beyond plain causal attention. */
typedef struct attention_kind {
    int64_t sliding_window;
    moe_qk_norm_kind qk_norm;
    uint64_t dense; /* bit l: layer l a dense MLP layer, 40 wide */
} attention_kind;

static moe_model *small_model_of(int64_t rows, double capacity_factor, attention_kind attn, moe_model_parallel par) {
    moe_model_config cfg;
    moe_model_config_default_small(&cfg, VOCAB);
    cfg.hidden_size = 32;
    cfg.head_dim = 8;
    cfg.intermediate_size = 48;
    cfg.num_hidden_layers = 2;
    cfg.moe_capacity_factor = capacity_factor;
    cfg.sliding_window = attn.sliding_window;
    cfg.moe_qk_norm = attn.qk_norm;
    cfg.moe_dense_layers[0] = attn.dense;
    cfg.moe_dense_intermediate_size = attn.dense ? 40 : 0;
    moe_model *m = NULL;
    cr_assert_eq(moe_model_create_parallel(&m, &cfg, rows, T, SEED, &par), MOE_OK, "%s", moe_last_error());
    /* Larger weights than the N(0, 0.02) start, so that the logits differ
     * by more than rounding and argmax is not decided by ties. */
    float *p = moe_model_params(m);
    for (int64_t i = 0; i < moe_model_param_count(m); i++) p[i] *= 20.0f;
    moe_model_set_training(m, false);
    return m;
}

static moe_model *small_model(int64_t rows, double capacity_factor) {
    return small_model_of(rows, capacity_factor, (attention_kind){0}, (moe_model_parallel){0});
}

static void random_tokens(int32_t *tokens, int64_t n, uint64_t stream) {
    for (int64_t i = 0; i < n; i++) tokens[i] = (int32_t)(moe_rng_bits(SEED, stream, (uint64_t)i) % VOCAB);
}

static void all_logits(moe_model *m, int64_t rows, float *out /* [rows, T, VOCAB] */) {
    for (int64_t b = 0; b < rows; b++)
        for (int64_t p = 0; p < T; p++)
            cr_assert_eq(moe_model_last_logits(m, b, p, out + (b * T + p) * VOCAB), MOE_OK, "%s",
                         moe_last_error());
}

Test(generate, logits_at_p_ignore_later_tokens_and_other_rows) {
    moe_model *m = small_model(B, 0.0);
    int32_t tokens[B * T];
    static float before[B * T * VOCAB], after[B * T * VOCAB];
    random_tokens(tokens, B * T, 1);
    cr_assert_eq(moe_model_forward(m, tokens, NULL, NULL), MOE_OK, "%s", moe_last_error());
    all_logits(m, B, before);
    /* Row 0 changes from position 6 on, row 1 entirely. */
    const int64_t cut = 6;
    for (int64_t p = cut; p < T; p++) tokens[p] = (tokens[p] + 5) % VOCAB;
    for (int64_t p = 0; p < T; p++) tokens[T + p] = (tokens[T + p] + 3) % VOCAB;
    cr_assert_eq(moe_model_forward(m, tokens, NULL, NULL), MOE_OK, "%s", moe_last_error());
    all_logits(m, B, after);
    /* Not bit for bit: the rows each expert gets change with the other
     * tokens, and with them where a row falls in the experts' GEMM blocks,
     * so the last bits of a sum may move. Within 1e-6 of the largest logit;
     * a token that leaked through attention or routing moves the logits by
     * percents of it. */
    double worst = 0.0, scale = 0.0;
    for (int64_t i = 0; i < cut * VOCAB; i++) {
        worst = fmax(worst, fabs(before[i] - after[i]));
        scale = fmax(scale, fabs(before[i]));
    }
    cr_expect(worst <= 1e-6 * scale, "row 0's logits before position %lld moved by %g (largest %g) when later tokens "
              "or row 1 changed", (long long)cut, worst, scale);
    /* The test could not fail if nothing moved at all. */
    cr_expect_neq(memcmp(before + cut * VOCAB, after + cut * VOCAB, (size_t)(T - cut) * VOCAB * sizeof(float)), 0);
    moe_model_destroy(m);
}

Test(generate, greedy_rows_are_the_argmax_of_a_full_forward) {
    moe_model *m = small_model(B, 0.0);
    int32_t rows[B * T];
    random_tokens(rows, B * T, 2);
    int64_t len[B] = {3, 5}, end[B] = {12, T};
    const moe_sampling greedy = {.temperature = 0.0, .top_k = 0, .seed = 1};
    cr_assert_eq(moe_generate(m, rows, len, end, NULL, 0, &greedy), MOE_OK, "%s", moe_last_error());
    cr_assert(len[0] == 12 && len[1] == T, "lengths %lld %lld", (long long)len[0], (long long)len[1]);
    for (int64_t p = 12; p < T; p++) cr_expect_eq(rows[p], 0, "row 0 position %lld past its end", (long long)p);

    cr_assert_eq(moe_model_forward(m, rows, NULL, NULL), MOE_OK, "%s", moe_last_error());
    const int64_t prompt[B] = {3, 5};
    float logits[VOCAB];
    for (int64_t b = 0; b < B; b++)
        for (int64_t p = prompt[b]; p < len[b]; p++) {
            cr_assert_eq(moe_model_last_logits(m, b, p - 1, logits), MOE_OK, "%s", moe_last_error());
            int32_t best = 0;
            for (int32_t i = 1; i < VOCAB; i++)
                if (logits[i] > logits[best]) best = i;
            cr_expect_eq(rows[b * T + p], best, "row %lld position %lld: generated %d, argmax %d", (long long)b,
                         (long long)p, rows[b * T + p], best);
        }
    moe_model_destroy(m);
}

/* A row's draws depend on (seed, row, position): the same prompt sampled
 * as row 0 of a batch of 2 and of a batch of 1 gives the same tokens, and
 * the same call twice gives the same rows. */
Test(generate, sampled_rows_depend_on_seed_row_and_position_only) {
    const moe_sampling s = {.temperature = 1.5, .top_k = 0, .seed = 99};
    moe_model *two = small_model(2, 0.0), *one = small_model(1, 0.0);
    int32_t a[2 * T], again[2 * T], single[T];
    random_tokens(a, 2 * T, 3);
    memcpy(again, a, sizeof a);
    memcpy(single, a, sizeof single);
    int64_t len_a[2] = {4, 2}, len_again[2] = {4, 2}, len_single[1] = {4};
    const int64_t end[2] = {T, T};
    cr_assert_eq(moe_generate(two, a, len_a, end, NULL, 0, &s), MOE_OK, "%s", moe_last_error());
    cr_assert_eq(moe_generate(two, again, len_again, end, NULL, 0, &s), MOE_OK, "%s", moe_last_error());
    cr_assert_eq(moe_generate(one, single, len_single, end, NULL, 0, &s), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(memcmp(a, again, sizeof a), 0, "the same call gave other rows");
    cr_expect_eq(memcmp(a, single, sizeof single), 0, "row 0 depends on the batch it is in");
    moe_model_destroy(two);
    moe_model_destroy(one);
}

Test(generate, a_row_stops_after_the_stop_token) {
    moe_model *m = small_model(B, 0.0);
    int32_t rows[B * T];
    random_tokens(rows, B * T, 4);
    int64_t len[B] = {2, 2}, end[B] = {T, T};
    const moe_sampling greedy = {0};
    cr_assert_eq(moe_generate(m, rows, len, end, NULL, 0, &greedy), MOE_OK, "%s", moe_last_error());
    /* Stop at the token greedy wrote at position 4 of row 0. */
    const int32_t stop = rows[4];
    int64_t first = 2;
    while (rows[first] != stop) first++;
    random_tokens(rows, B * T, 4);
    int64_t len2[B] = {2, 2};
    cr_assert_eq(moe_generate(m, rows, len2, end, &stop, 1, &greedy), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(len2[0], first + 1, "row 0 ended at %lld, the stop token first comes at %lld", (long long)len2[0],
                 (long long)first);
    cr_expect_eq(rows[first], stop);
    moe_model_destroy(m);
}

Test(generate, refuses_capacity_bad_lengths_and_bad_sampling) {
    int32_t rows[B * T] = {0};
    int64_t len[B] = {1, 1}, end[B] = {T, T};
    const moe_sampling greedy = {0};
    moe_model *dropping = small_model(B, 1.25);
    cr_expect_eq(moe_generate(dropping, rows, len, end, NULL, 0, &greedy), MOE_ERR_UNSUPPORTED);
    cr_expect(strstr(moe_last_error(), "capacity factor of 1.25"), "%s", moe_last_error());
    moe_model_destroy(dropping);

    moe_model *m = small_model(B, 0.0);
    int64_t empty[B] = {1, 0};
    cr_expect_eq(moe_generate(m, rows, empty, end, NULL, 0, &greedy), MOE_ERR_INVALID_ARG);
    cr_expect(strstr(moe_last_error(), "row 1 holds 0 tokens"), "%s", moe_last_error());
    int64_t too_far[B] = {T, T + 1};
    cr_expect_eq(moe_generate(m, rows, len, too_far, NULL, 0, &greedy), MOE_ERR_INVALID_ARG);
    const moe_sampling cold = {.temperature = -1.0}, nan_t = {.temperature = NAN}, neg_k = {.top_k = -2};
    cr_expect_eq(moe_generate(m, rows, len, end, NULL, 0, &cold), MOE_ERR_CONFIG);
    cr_expect_eq(moe_generate(m, rows, len, end, NULL, 0, &nan_t), MOE_ERR_CONFIG);
    cr_expect_eq(moe_generate(m, rows, len, end, NULL, 0, &neg_k), MOE_ERR_CONFIG);
    cr_expect(strstr(moe_last_error(), "--top-k -2"), "%s", moe_last_error());
    moe_model_destroy(m);
}

Test(generate, last_logits_refused_after_a_backward) {
    moe_model *m = small_model(B, 0.0);
    int32_t tokens[B * T], targets[B * T];
    random_tokens(tokens, B * T, 5);
    random_tokens(targets, B * T, 6);
    float logits[VOCAB];
    cr_assert_eq(moe_model_forward(m, tokens, targets, NULL), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(moe_model_last_logits(m, 1, T - 1, logits), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(moe_model_last_logits(m, B, 0, logits), MOE_ERR_INVALID_ARG);
    cr_expect_eq(moe_model_last_logits(m, 0, T, logits), MOE_ERR_INVALID_ARG);
    cr_assert_eq(moe_model_backward(m, 1.0f), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(moe_model_last_logits(m, 0, 0, logits), MOE_ERR_STATE);
    moe_model_destroy(m);
}

/* A model that recomputes its layers keeps no keys to decode against: it
 * generates by a forward over the rows per token, the same rows. */
Test(generate, a_recomputing_model_generates_the_same_rows) {
    int32_t rows[2][B * T];
    for (int recompute = 0; recompute < 2; recompute++) {
        moe_model *m = small_model_of(B, 0.0, (attention_kind){0}, (moe_model_parallel){.recompute = recompute});
        random_tokens(rows[recompute], B * T, 3);
        int64_t len[B] = {2, 6}, end[B] = {T, 11};
        const moe_sampling greedy = {.temperature = 0.0, .top_k = 0, .seed = 1};
        cr_assert_eq(moe_generate(m, rows[recompute], len, end, NULL, 0, &greedy), MOE_OK, "%s", moe_last_error());
        cr_expect(moe_model_can_decode(m) == !recompute);
        moe_model_destroy(m);
    }
    cr_expect(memcmp(rows[0], rows[1], sizeof rows[0]) == 0, "recomputing and keeping models generated other rows");
}

/* An inference model (no backward; one set of activations, the layers'
 * keys and values kept) generates the same rows as a training one, in a
 * fraction of the memory, and refuses a backward. */
Test(generate, an_inference_model_generates_the_same_rows_in_less_memory) {
    int32_t rows[2][B * T];
    int64_t bytes[2];
    for (int inference = 0; inference < 2; inference++) {
        moe_model *m = small_model_of(B, 0.0, (attention_kind){0}, (moe_model_parallel){.inference = inference});
        random_tokens(rows[inference], B * T, 4);
        int64_t len[B] = {3, 1}, end[B] = {T, 12};
        const moe_sampling sampled = {.temperature = 0.8, .top_k = 0, .seed = 5};
        cr_assert_eq(moe_generate(m, rows[inference], len, end, NULL, 0, &sampled), MOE_OK, "%s", moe_last_error());
        bytes[inference] = moe_model_activation_bytes(m);
        if (inference) {
            cr_expect(moe_model_grads(m) == NULL, "an inference model holds gradients");
            cr_expect_eq(moe_model_backward(m, 1.0f), MOE_ERR_STATE, "an inference model ran a backward");
            cr_expect(strstr(moe_last_error(), "inference"), "%s", moe_last_error());
            moe_trainer *t = NULL;
            moe_optim_config oc = MOE_OPTIM_CONFIG_INIT;
            oc.total_steps = 1;
            cr_assert_eq(moe_trainer_create(&t, m, &oc), MOE_OK, "%s", moe_last_error());
            cr_expect_eq(moe_trainer_optimizer_bytes(t), 0, "an evaluating trainer keeps AdamW state");
            cr_expect_eq(moe_trainer_step(t, NULL, NULL), MOE_ERR_STATE, "an inference model took a step");
            moe_trainer_destroy(t);
        }
        moe_model_destroy(m);
    }
    cr_expect(memcmp(rows[0], rows[1], sizeof rows[0]) == 0, "the inference model generated other rows");
    cr_expect(2 * bytes[1] < bytes[0], "inference holds %lld bytes of activations, training %lld", (long long)bytes[1],
              (long long)bytes[0]);
    moe_model *both = NULL;
    moe_model_config cfg;
    moe_model_config_default_small(&cfg, VOCAB);
    cr_expect_eq(moe_model_create_parallel(&both, &cfg, B, T, SEED,
                                           &(moe_model_parallel){.inference = true, .recompute = true}),
                 MOE_ERR_INVALID_ARG, "inference with recomputation");
}

/* ------------------------------------------------------------ decoding */

/* Decoding steps against the layers' keys and values give the logits of a
 * full forward over the same tokens: row 0 from position 4 on and row 1
 * from position 9 on, one token a step, both rows in one call while both
 * grow (so they sit at different positions), the cache past each row's
 * start holding other tokens of the first forward until the steps
 * overwrite them. Not bit for bit (the attention and the experts' GEMMs
 * sum in another order for one row than for the batch): within 1e-4 of
 * the largest logit (seen: 2.5e-6 with OpenBLAS's SkylakeX kernels, 1.7e-5
 * with the Haswell ones it runs on AMD's Zen), where a wrong position,
 * rotation or cache row moves them by percents of it. With a sliding
 * window of 3, the rows pass it (the steps must read only its keys); with
 * q and k normalised, the steps normalise theirs. */
/* A forward's logits at every position of both rows into want; returns
 * the largest's size. */
static double forward_logits(moe_model *m, const int32_t *tokens, float *want) {
    cr_assert_eq(moe_model_forward(m, tokens, NULL, NULL), MOE_OK, "%s", moe_last_error());
    all_logits(m, B, want);
    double scale = 0.0;
    for (int64_t i = 0; i < B * T * VOCAB; i++) scale = fmax(scale, fabs(want[i]));
    return scale;
}

/* A decoding step's logits for (row, pos) within 1e-4 of the largest of
 * the forward's. */
static void expect_decoded(const float *got, const float *want, double scale, int64_t row, int64_t pos,
                           attention_kind attn) {
    const float *w = want + (row * T + pos) * VOCAB;
    double worst = 0.0;
    for (int64_t j = 0; j < VOCAB; j++) worst = fmax(worst, fabs(got[j] - w[j]));
    cr_expect(worst <= 1e-4 * scale, "window %lld, qk_norm %s, row %lld, position %lld: logits off by %g (largest %g)",
              (long long)attn.sliding_window, moe_qk_norm_kind_name(attn.qk_norm), (long long)row, (long long)pos,
              worst, scale);
}

static void check_decode(attention_kind attn) {
    moe_model *m = small_model_of(B, 0.0, attn, (moe_model_parallel){0});
    int32_t tokens[B * T], prefix[B * T];
    static float want[B * T * VOCAB];
    float got[B * VOCAB];
    random_tokens(tokens, B * T, 8);
    const double scale = forward_logits(m, tokens, want);
    const int64_t start[B] = {4, 9};
    random_tokens(prefix, B * T, 9);
    for (int64_t b = 0; b < B; b++) memcpy(prefix + b * T, tokens + b * T, (size_t)start[b] * sizeof *prefix);
    cr_assert_eq(moe_model_forward(m, prefix, NULL, NULL), MOE_OK, "%s", moe_last_error());
    int64_t steps = 0;
    for (int64_t s = 0; s < T - start[0]; s++) {
        int64_t row[B], pos[B], n = 0;
        int32_t tok[B];
        for (int64_t b = 0; b < B; b++)
            if (start[b] + s < T) {
                row[n] = b;
                pos[n] = start[b] + s;
                tok[n++] = tokens[b * T + start[b] + s];
            }
        cr_assert_eq(moe_model_decode(m, n, row, tok, pos, got), MOE_OK, "%s", moe_last_error());
        for (int64_t i = 0; i < n; i++) {
            expect_decoded(got + i * VOCAB, want, scale, row[i], pos[i], attn);
            steps++;
        }
    }
    cr_expect_eq(steps, (T - start[0]) + (T - start[1]));
    moe_model_destroy(m);
}

Test(decode, steps_give_the_logits_of_a_full_forward) { check_decode((attention_kind){0}); }

/* A decode-only model reads whole rows by decoding steps from position 0,
 * no forward at all, a chunk of 5 positions of each row at a time (as
 * moe_generate reads prompts): the first 4 of each row in a step that
 * only fills the cache, the 5th in one with logits, which are a full
 * forward's within 1e-4 of the largest logit as above. A step with logits
 * takes one token a row; a row may not skip a position nor go back in
 * one step, and a forward is refused. */
static void check_decode_only(attention_kind attn) {
    moe_model *m = small_model_of(B, 0.0, attn, (moe_model_parallel){0});
    moe_model *d = small_model_of(B, 0.0, attn, (moe_model_parallel){.inference = true, .decode_only = true});
    int32_t tokens[B * T];
    static float want[B * T * VOCAB];
    static float got[B * T * VOCAB];
    random_tokens(tokens, B * T, 11);
    const double scale = forward_logits(m, tokens, want);
    int64_t row[B * T], pos[B * T];
    int32_t tok[B * T] = {1, 2};
    const int64_t skip[B] = {1, 1}, back[B] = {0, 0}, same[B] = {0, 0};
    cr_expect_eq(moe_model_decode(d, 2, same, tok, skip, got), MOE_ERR_STATE);
    cr_expect_eq(moe_model_decode(d, 2, same, tok, back, got), MOE_ERR_INVALID_ARG);
    cr_expect(strstr(moe_last_error(), "row 0 at position 0 after its position 0"), "%s", moe_last_error());
    const int64_t chunk = 5;
    for (int64_t p0 = 0; p0 < T; p0 += chunk) {
        const int64_t end = p0 + chunk < T ? p0 + chunk : T;
        int64_t n = 0;
        for (int64_t b = 0; b < B; b++)
            for (int64_t p = p0; p < end - 1; p++) row[n] = b, pos[n] = p, tok[n++] = tokens[b * T + p];
        if (n > 0) {
            cr_expect_eq(moe_model_decode(d, n, row, tok, pos, got), MOE_ERR_INVALID_ARG, "%lld logits", (long long)n);
            cr_assert_eq(moe_model_decode(d, n, row, tok, pos, NULL), MOE_OK, "%s", moe_last_error());
        }
        for (int64_t b = 0; b < B; b++) row[b] = b, pos[b] = end - 1, tok[b] = tokens[b * T + end - 1];
        cr_assert_eq(moe_model_decode(d, B, row, tok, pos, got), MOE_OK, "%s", moe_last_error());
        for (int64_t b = 0; b < B; b++) expect_decoded(got + b * VOCAB, want, scale, b, end - 1, attn);
    }
    cr_expect_eq(moe_model_forward(d, tokens, NULL, NULL), MOE_ERR_STATE);
    cr_expect(strstr(moe_last_error(), "decode-only"), "%s", moe_last_error());
    moe_model_destroy(m);
    moe_model_destroy(d);
}

Test(decode, a_decode_only_model_reads_rows_from_position_0) { check_decode_only((attention_kind){0}); }
Test(decode, a_decode_only_model_with_q_and_k_normalised_reads_rows_from_position_0) {
    check_decode_only((attention_kind){.qk_norm = MOE_QK_NORM_PER_HEAD});
    check_decode_only((attention_kind){.qk_norm = MOE_QK_NORM_ACROSS_HEADS});
}

/* Past a chunk of positions, a decode-only model's memory grows with T
 * through its cache alone, while an inference model's forward keeps B x
 * heads x T x T attention scores and B x T x vocab logits: at T 1024 it
 * holds under a tenth. */
Test(decode, a_decode_only_model_holds_the_cache_and_a_chunk) {
    moe_model_config cfg;
    moe_model_config_default_small(&cfg, VOCAB);
    cfg.max_position_embeddings = 1024;
    int64_t bytes[2];
    for (int only = 0; only < 2; only++) {
        moe_model *m = NULL;
        const moe_model_parallel par = {.inference = true, .decode_only = only};
        cr_assert_eq(moe_model_create_parallel(&m, &cfg, B, 1024, SEED, &par), MOE_OK, "%s", moe_last_error());
        bytes[only] = moe_model_activation_bytes(m);
        cr_expect_eq(moe_model_decode_capacity(m), only ? B * 64 : B);
        moe_model_destroy(m);
    }
    cr_expect(10 * bytes[1] < bytes[0], "decode-only %lld bytes, an inference model %lld", (long long)bytes[1],
              (long long)bytes[0]);
    /* Its logits hold one position a row, not a chunk's: a larger
     * vocabulary adds B rows of it. */
    cfg.vocab_size = 8192;
    moe_model *wide = NULL;
    const moe_model_parallel only = {.inference = true, .decode_only = true};
    cr_assert_eq(moe_model_create_parallel(&wide, &cfg, B, 1024, SEED, &only), MOE_OK, "%s", moe_last_error());
    const int64_t more = moe_model_activation_bytes(wide) - bytes[1], rows = more / ((8192 - VOCAB) * 4);
    cr_expect(rows <= B, "vocabulary 8192 adds %lld bytes: %lld rows of logits", (long long)more, (long long)rows);
    moe_model_destroy(wide);
}

Test(decode, steps_in_a_sliding_window_give_the_logits_of_a_full_forward) {
    check_decode((attention_kind){.sliding_window = 3});
}
Test(decode, steps_with_q_and_k_normalised_give_the_logits_of_a_full_forward) {
    check_decode((attention_kind){.qk_norm = MOE_QK_NORM_PER_HEAD});
    check_decode((attention_kind){.qk_norm = MOE_QK_NORM_ACROSS_HEADS});
}
Test(decode, steps_through_a_dense_mlp_layer_give_the_logits_of_a_full_forward) {
    check_decode((attention_kind){.dense = 0x1});
    check_decode_only((attention_kind){.dense = 0x2});
}

Test(decode, refuses_training_grids_without_keys_and_bad_tokens) {
    moe_model *m = small_model(B, 0.0);
    int32_t tokens[B * T];
    random_tokens(tokens, B * T, 10);
    float logits[B * VOCAB];
    int64_t row[B] = {0, 1}, pos[B] = {3, 3};
    int32_t tok[B] = {1, 2};
    /* A new model trains, as its layers do, until told otherwise. */
    moe_model *fresh = NULL;
    moe_model_config fresh_cfg;
    moe_model_config_default_small(&fresh_cfg, VOCAB);
    cr_assert_eq(moe_model_create(&fresh, &fresh_cfg, B, T, SEED), MOE_OK, "%s", moe_last_error());
    cr_assert_eq(moe_model_forward(fresh, tokens, NULL, NULL), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(moe_model_decode(fresh, 2, row, tok, pos, logits), MOE_ERR_STATE, "a new model, in training mode");
    moe_model_destroy(fresh);
    cr_expect_eq(moe_model_decode(m, 2, row, tok, pos, logits), MOE_ERR_STATE, "past the cache, before any forward");
    cr_expect(strstr(moe_last_error(), "position 3 of row 0: the cache holds its positions [0, 0)"), "%s",
              moe_last_error());
    cr_assert_eq(moe_model_forward(m, tokens, NULL, NULL), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(moe_model_decode(m, 2, row, tok, pos, logits), MOE_OK, "%s", moe_last_error());
    int64_t same[B] = {1, 1}, past[B] = {0, T};
    int32_t outside[B] = {0, VOCAB};
    cr_expect_eq(moe_model_decode(m, 2, same, tok, pos, logits), MOE_ERR_INVALID_ARG);
    cr_expect(strstr(moe_last_error(), "row 1 at position 3 after its position 3"), "%s", moe_last_error());
    cr_expect_eq(moe_model_decode(m, 2, row, tok, past, logits), MOE_ERR_INVALID_ARG);
    cr_expect_eq(moe_model_decode(m, 2, row, outside, pos, logits), MOE_ERR_INVALID_ARG);
    cr_expect_eq(moe_model_decode_capacity(m), B * T);
    cr_expect_eq(moe_model_decode(m, B * T + 1, row, tok, pos, logits), MOE_ERR_INVALID_ARG);
    moe_model_set_training(m, true);
    cr_expect_eq(moe_model_decode(m, 2, row, tok, pos, logits), MOE_ERR_STATE, "in training mode");
    cr_expect(strstr(moe_last_error(), "inference only"), "%s", moe_last_error());
    moe_model_destroy(m);

    /* Recomputation keeps no layer's keys. */
    moe_model_config cfg;
    moe_model_config_default_small(&cfg, VOCAB);
    cr_assert_eq(moe_model_create_parallel(&m, &cfg, B, T, SEED, &(moe_model_parallel){.recompute = true}), MOE_OK,
                 "%s", moe_last_error());
    moe_model_set_training(m, false);
    cr_assert_eq(moe_model_forward(m, tokens, NULL, NULL), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(moe_model_decode(m, 2, row, tok, pos, logits), MOE_ERR_STATE);
    cr_expect(strstr(moe_last_error(), "recomputes"), "%s", moe_last_error());
    moe_model_destroy(m);
}

/* ------------------------------------------------------------- the sampler */

#define SV 6

Test(sample_token, greedy_and_top1_take_the_lowest_id_among_the_best) {
    const float logits[SV] = {0.5f, 2.0f, -1.0f, 2.0f, 1.9f, 0.0f};
    int32_t scratch[SV];
    const moe_sampling greedy = {0}, top1 = {.temperature = 3.0, .top_k = 1, .seed = 5};
    for (uint64_t d = 0; d < 50; d++) {
        cr_expect_eq(moe_sample_token(scratch, logits, SV, &greedy, 0, d), 1);
        cr_expect_eq(moe_sample_token(scratch, logits, SV, &top1, 0, d), 1);
    }
}

/* Frequencies over DRAWS draws against softmax(l / temperature) over the
 * allowed tokens: each within 5 standard deviations of its expectation
 * (a false failure about once in 10^6 runs per token; the draws are fixed
 * by the seed, so a pass is repeatable). */
#define DRAWS 40000

static void expect_frequencies(const float *logits, const moe_sampling *s) {
    int32_t scratch[SV];
    int64_t count[SV] = {0};
    for (uint64_t d = 0; d < DRAWS; d++) count[moe_sample_token(scratch, logits, SV, s, 3, d)]++;
    /* The allowed tokens: the top_k by (logit, then lower id), then of
     * those the fewest best whose weights reach top_p of theirs. */
    bool allowed[SV];
    int rank_of[SV];
    double top_k_z = 0.0;
    for (int i = 0; i < SV; i++) {
        int better = 0;
        for (int j = 0; j < SV; j++) better += logits[j] > logits[i] || (logits[j] == logits[i] && j < i);
        rank_of[i] = better;
        allowed[i] = s->top_k == 0 || better < s->top_k;
        if (allowed[i]) top_k_z += exp(logits[i] / s->temperature);
    }
    if (s->top_p > 0.0 && s->top_p < 1.0) {
        double before[SV] = {0}; /* the weight of the allowed tokens ranked better */
        for (int i = 0; i < SV; i++)
            for (int j = 0; j < SV; j++)
                if (allowed[i] && allowed[j] && rank_of[j] < rank_of[i]) before[i] += exp(logits[j] / s->temperature);
        for (int i = 0; i < SV; i++) allowed[i] = allowed[i] && before[i] < s->top_p * top_k_z;
    }
    double z = 0.0;
    for (int i = 0; i < SV; i++) z += allowed[i] ? exp(logits[i] / s->temperature) : 0.0;
    for (int i = 0; i < SV; i++) {
        const double p = allowed[i] ? exp(logits[i] / s->temperature) / z : 0.0;
        const double mean = p * DRAWS, sd = sqrt(DRAWS * p * (1.0 - p));
        if (p == 0.0)
            cr_expect_eq(count[i], 0, "token %d is outside the top %lld but was drawn %lld times", i,
                         (long long)s->top_k, (long long)count[i]);
        else
            cr_expect(fabs((double)count[i] - mean) <= 5.0 * sd,
                      "token %d: %lld draws, expected %.1f +- %.1f (temperature %g, top_k %lld)", i,
                      (long long)count[i], mean, sd, s->temperature, (long long)s->top_k);
    }
}

Test(sample_token, draws_follow_the_tempered_softmax) {
    const float logits[SV] = {0.5f, 2.0f, -1.0f, 1.0f, 1.9f, 0.0f};
    expect_frequencies(logits, &(moe_sampling){.temperature = 1.0, .top_k = 0, .seed = 11});
    expect_frequencies(logits, &(moe_sampling){.temperature = 0.5, .top_k = 0, .seed = 12});
    expect_frequencies(logits, &(moe_sampling){.temperature = 2.0, .top_k = 3, .seed = 13});
}

/* The nucleus: probabilities 0.42, 0.25, 0.15, ... at temperature 1 (token
 * 1, then 4, then 3): top_p 0.5 takes tokens 1 and 4, 0.8 adds 3, and after
 * a top_k of 2 the nucleus of 0.9 is those two. */
Test(sample_token, top_p_draws_from_the_nucleus) {
    const float logits[SV] = {0.5f, 2.0f, -1.0f, 1.0f, 1.5f, 0.0f};
    expect_frequencies(logits, &(moe_sampling){.temperature = 1.0, .top_p = 0.5, .seed = 15});
    expect_frequencies(logits, &(moe_sampling){.temperature = 1.0, .top_p = 0.8, .seed = 16});
    expect_frequencies(logits, &(moe_sampling){.temperature = 0.7, .top_k = 2, .top_p = 0.9, .seed = 17});
    expect_frequencies(logits, &(moe_sampling){.temperature = 2.0, .top_p = 0.999, .seed = 18});
}

Test(sample_token, top_k_breaks_ties_by_lower_id) {
    /* Tokens 1, 3 and 4 tie for best; top 2 allows 1 and 3 only. */
    const float logits[SV] = {0.0f, 1.0f, 0.0f, 1.0f, 1.0f, 0.0f};
    expect_frequencies(logits, &(moe_sampling){.temperature = 1.0, .top_k = 2, .seed = 14});
}

/* The top k, for every k below V (k = V draws from every token in id
 * order), are the k best by (logit, then lower id), in that order: the
 * draws equal a reference that sorts all V tokens and sums the weights best
 * first with the same uniform, bit for bit. The logits take 7 values over
 * 300 tokens, so ties cross every cut. */
static const float *ranked_logits;

static int by_rank(const void *a, const void *b) {
    const int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    const float lx = ranked_logits[x], ly = ranked_logits[y];
    return lx > ly ? -1 : lx < ly ? 1 : (x > y) - (x < y);
}

Test(sample_token, top_k_of_any_size_draws_as_a_full_sort) {
    enum { V = 300 };
    float logits[V];
    int32_t scratch[V], sorted[V];
    for (int i = 0; i < V; i++) logits[i] = (float)((i * 37 + 11) % 7) * 0.5f, sorted[i] = i;
    ranked_logits = logits;
    qsort(sorted, V, sizeof *sorted, by_rank);
    const float top = logits[sorted[0]];
    static const int64_t ks[] = {2, 3, 43, 44, 150, 298, V - 1};
    for (size_t c = 0; c < sizeof ks / sizeof *ks; c++) {
        const moe_sampling s = {.temperature = 0.8, .top_k = ks[c], .seed = 21};
        for (uint64_t d = 0; d < 200; d++) {
            double total = 0.0, run = 0.0;
            for (int64_t j = 0; j < ks[c]; j++) total += exp(((double)logits[sorted[j]] - top) / s.temperature);
            const double u = moe_rng_uniform_double(s.seed, 4, d) * total;
            int32_t want = sorted[ks[c] - 1];
            for (int64_t j = 0; j < ks[c]; j++)
                if ((run += exp(((double)logits[sorted[j]] - top) / s.temperature)) > u) {
                    want = sorted[j];
                    break;
                }
            cr_assert_eq(moe_sample_token(scratch, logits, V, &s, 4, d), want, "top_k %lld, draw %llu",
                         (long long)ks[c], (unsigned long long)d);
        }
    }
}

