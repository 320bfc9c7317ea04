/* test_synthetic.c: the synthetic corpus (engine/synthetic.h).
 *
 * The reference below re-derives, from the documented rules alone, the full
 * next-token distribution at every position of a generated stream by parsing
 * the tokens so far. Each distribution must sum to 1 (|sum - 1| <= 1e-12),
 * give the emitted token p > 0, and agree with the generator's logp to 2e-6
 * nats (logp is stored as float: 24 bits, so |error| <= 6e-8 |logp|, and
 * |logp| < 12 here). The generator must also sample from what it claims:
 * for every (previous token, token) pair the observed count and the sum of
 * the reference probabilities must agree within 5 standard deviations. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine/data.h"
#include "engine/synthetic.h"

#define V MOE_SYNTH_VOCAB_SIZE
#define K MOE_SYNTH_KIND_COUNT

static moe_synth_stream generate(const moe_synth_params *p, uint64_t seed, int64_t n) {
    moe_synth_stream s;
    cr_assert_eq(moe_synth_generate(&s, p, seed, n), MOE_OK, "%s", moe_last_error());
    return s;
}

/* ------------------------------------------------------------ reference */

typedef struct ref_model {
    moe_synth_params p;
    double w[K];                                       /* normalised */
    double table[MOE_SYNTH_STATES * MOE_SYNTH_STATES]; /* checked separately */
} ref_model;

/* Parser state after some prefix of the stream. */
typedef struct ref_state {
    int kind;                         /* -1 before the first token */
    int phase;                        /* arithmetic: tokens of the equation so far (0..7) */
    int a, b;                         /* arithmetic operands */
    int src[MOE_SYNTH_COPY_MAX_LEN];  /* copy: source letters */
    int len, copied, marked;          /* copy */
    int stack[MOE_SYNTH_DYCK_MAX_DEPTH], depth, started; /* brackets */
    int state;                        /* markov: last symbol, -1 after the BOS */
} ref_state;

static ref_model ref_model_of(const moe_synth_params *p) {
    ref_model m = {.p = *p};
    double sum = 0.0;
    for (int k = 0; k < K; k++) sum += p->kind_weight[k];
    for (int k = 0; k < K; k++) m.w[k] = p->kind_weight[k] / sum;
    moe_synth_markov_table(m.table, p);
    return m;
}

/* The document may end here with probability end: the BOS of kind k then
 * has end * w_k. */
static void add_boundary(double *dist, const ref_model *m, double end) {
    for (int k = 0; k < K; k++) dist[MOE_SYNTH_TOK_BOS + k] += end * m->w[k];
}

static void ref_dist(double *dist, const ref_model *m, const ref_state *s) {
    for (int t = 0; t < V; t++) dist[t] = 0.0;
    const moe_synth_params *p = &m->p;
    switch (s->kind) {
    case -1: add_boundary(dist, m, 1.0); break;
    case MOE_SYNTH_ARITH:
        switch (s->phase) {
        case 0: /* after the BOS */
            for (int d = 0; d < 10; d++) dist[MOE_SYNTH_TOK_DIGIT + d] = 0.1;
            break;
        case 1: dist[MOE_SYNTH_TOK_PLUS] = 1.0; break;
        case 2:
            for (int d = 0; d < 10; d++) dist[MOE_SYNTH_TOK_DIGIT + d] = 0.1;
            break;
        case 3: dist[MOE_SYNTH_TOK_EQUALS] = 1.0; break;
        case 4: dist[MOE_SYNTH_TOK_DIGIT + (s->a + s->b) / 10] = 1.0; break;
        case 5: dist[MOE_SYNTH_TOK_DIGIT + (s->a + s->b) % 10] = 1.0; break;
        case 6: dist[MOE_SYNTH_TOK_SEMICOLON] = 1.0; break;
        default: /* after ';' */
            for (int d = 0; d < 10; d++) dist[MOE_SYNTH_TOK_DIGIT + d] = p->arith_continue / 10;
            add_boundary(dist, m, 1.0 - p->arith_continue);
        }
        break;
    case MOE_SYNTH_COPY:
        if (s->marked) {
            if (s->copied < s->len)
                dist[s->src[s->copied]] = 1.0;
            else
                add_boundary(dist, m, 1.0);
        } else if (s->len == 0) {
            for (int l = 0; l < MOE_SYNTH_LETTERS; l++) dist[MOE_SYNTH_TOK_LETTER + l] = 1.0 / 16;
        } else if (s->len == p->copy_max_len) {
            dist[MOE_SYNTH_TOK_MARK] = 1.0;
        } else {
            for (int l = 0; l < MOE_SYNTH_LETTERS; l++)
                dist[MOE_SYNTH_TOK_LETTER + l] = (1.0 - p->copy_stop) / 16;
            dist[MOE_SYNTH_TOK_MARK] = p->copy_stop;
        }
        break;
    case MOE_SYNTH_BRACKETS: {
        double open = 0.0, close = 0.0;
        if (s->depth == 0 && !s->started) {
            open = 1.0;
        } else if (s->depth == 0) {
            open = 1.0 - p->dyck_end;
            add_boundary(dist, m, p->dyck_end);
        } else if (s->depth == p->dyck_max_depth) {
            close = 1.0;
        } else {
            open = p->dyck_open;
            close = 1.0 - p->dyck_open;
        }
        dist[MOE_SYNTH_TOK_OPEN] += open / 2;
        dist[MOE_SYNTH_TOK_OPEN + 1] += open / 2;
        if (s->depth > 0) dist[MOE_SYNTH_TOK_CLOSE + s->stack[s->depth - 1]] += close;
        break;
    }
    default: /* markov */
        if (s->state < 0) {
            for (int j = 0; j < MOE_SYNTH_STATES; j++) dist[MOE_SYNTH_TOK_STATE + j] = 1.0 / 16;
        } else {
            for (int j = 0; j < MOE_SYNTH_STATES; j++)
                dist[MOE_SYNTH_TOK_STATE + j] =
                    (1.0 - p->markov_end) * m->table[s->state * MOE_SYNTH_STATES + j];
            add_boundary(dist, m, p->markov_end);
        }
    }
}

/* Moves the parser past token t, which the caller has checked has p > 0. */
static void ref_advance(ref_state *s, int t) {
    if (t < K) {
        *s = (ref_state){.kind = t, .state = -1};
        return;
    }
    switch (s->kind) {
    case MOE_SYNTH_ARITH:
        if (s->phase == 7) s->phase = 0;
        if (s->phase == 0) s->a = t - MOE_SYNTH_TOK_DIGIT;
        if (s->phase == 2) s->b = t - MOE_SYNTH_TOK_DIGIT;
        s->phase++;
        break;
    case MOE_SYNTH_COPY:
        if (s->marked)
            s->copied++;
        else if (t == MOE_SYNTH_TOK_MARK)
            s->marked = 1;
        else
            s->src[s->len++] = t;
        break;
    case MOE_SYNTH_BRACKETS:
        s->started = 1;
        if (t == MOE_SYNTH_TOK_OPEN || t == MOE_SYNTH_TOK_OPEN + 1)
            s->stack[s->depth++] = t - MOE_SYNTH_TOK_OPEN;
        else
            s->depth--;
        break;
    default: s->state = t - MOE_SYNTH_TOK_STATE;
    }
}

/* Checks every logp of the stream against the reference and the sampling
 * against the reference probabilities; returns the reference -log p of
 * tokens 1..n-1 in nll [n] (nll[0] too). */
static void check_stream(const moe_synth_stream *st, const moe_synth_params *p, double *nll) {
    ref_model m = ref_model_of(p);
    ref_state s = {.kind = -1};
    double dist[V];
    double *expect = calloc((size_t)V * V, sizeof *expect); /* [prev, next] */
    double *var = calloc((size_t)V * V, sizeof *var);
    double *seen = calloc((size_t)V * V, sizeof *seen);
    cr_assert(expect && var && seen);
    double worst = 0.0;
    int64_t worst_i = -1;
    for (int64_t i = 0; i < st->n; i++) {
        ref_dist(dist, &m, &s);
        double sum = 0.0;
        for (int t = 0; t < V; t++) sum += dist[t];
        cr_assert(fabs(sum - 1.0) <= 1e-12, "position %lld: the distribution sums to %.17g",
                  (long long)i, sum);
        int t = st->tokens[i];
        cr_assert(t >= 0 && t < V, "position %lld: token %d outside the vocabulary", (long long)i,
                  t);
        cr_assert(dist[t] > 0.0, "position %lld: token %s has probability 0 (kind %s)",
                  (long long)i, moe_synth_token_text(t), moe_synth_kind_name(s.kind));
        double err = fabs(log(dist[t]) - (double)st->logp[i]);
        if (err > worst) {
            worst = err;
            worst_i = i;
        }
        nll[i] = -log(dist[t]);
        int kind = t < K ? t : s.kind;
        cr_assert_eq(st->kinds[i], kind, "position %lld: kind tag %d, expected %d", (long long)i,
                     st->kinds[i], kind);
        if (i > 0) {
            int prev = st->tokens[i - 1];
            for (int u = 0; u < V; u++) {
                expect[prev * V + u] += dist[u];
                var[prev * V + u] += dist[u] * (1.0 - dist[u]);
            }
            seen[prev * V + t] += 1.0;
        }
        ref_advance(&s, t);
    }
    cr_assert(worst <= 2e-6, "worst logp error %.3g at position %lld (token %s): %.9g vs %.9g",
              worst, (long long)worst_i, moe_synth_token_text(st->tokens[worst_i]),
              (double)st->logp[worst_i], -nll[worst_i]);
    /* A normal approximation needs a variance well above 1; the pairs below
     * that are too rare to test this way. */
    int64_t tested = 0;
    for (int i = 0; i < V * V; i++) {
        if (var[i] < 10.0) continue;
        double z = (seen[i] - expect[i]) / sqrt(var[i]);
        cr_expect(fabs(z) < 5.0, "pair %s -> %s: seen %.0f, expected %.1f (z = %.2f)",
                  moe_synth_token_text(i / V), moe_synth_token_text(i % V), seen[i], expect[i], z);
        tested++;
    }
    cr_assert(tested > 150, "only %lld token pairs had enough samples", (long long)tested);
    free(expect);
    free(var);
    free(seen);
}

/* ------------------------------------------------------------------ tests */

Test(synthetic, logp_is_the_true_probability) {
    moe_synth_params p = moe_synth_default_params();
    const int64_t n = 300000;
    moe_synth_stream s = generate(&p, 11, n);
    double *nll = malloc((size_t)n * sizeof *nll);
    check_stream(&s, &p, nll);
    free(nll);
    moe_synth_stream_free(&s);
}

/* Other settings reach the corners: long copies hit copy_max_len, deep
 * bracket words hit dyck_max_depth, and a zero weight removes a kind. */
Test(synthetic, logp_is_the_true_probability_in_corners) {
    moe_synth_params p = moe_synth_default_params();
    p.kind_weight[MOE_SYNTH_ARITH] = 0.0;
    p.copy_stop = 0.05;
    p.copy_max_len = 6;
    p.dyck_open = 0.8;
    p.dyck_max_depth = 3;
    p.dyck_end = 0.2;
    p.markov_end = 0.5;
    p.markov_seed = 3;
    const int64_t n = 200000;
    moe_synth_stream s = generate(&p, 12, n);
    double *nll = malloc((size_t)n * sizeof *nll);
    check_stream(&s, &p, nll);
    for (int64_t i = 0; i < n; i++)
        cr_assert_neq(s.kinds[i], MOE_SYNTH_ARITH, "a kind of weight 0 appeared at %lld",
                      (long long)i);
    free(nll);
    moe_synth_stream_free(&s);
}

Test(synthetic, markov_table_rows) {
    moe_synth_params p = moe_synth_default_params();
    double t[MOE_SYNTH_STATES * MOE_SYNTH_STATES], t2[MOE_SYNTH_STATES * MOE_SYNTH_STATES];
    moe_synth_markov_table(t, &p);
    moe_synth_markov_table(t2, &p);
    cr_assert_arr_eq(t, t2, sizeof t, "the table must depend on markov_seed only");
    for (int i = 0; i < MOE_SYNTH_STATES; i++) {
        double sum = 0.0;
        int nonzero = 0;
        for (int j = 0; j < MOE_SYNTH_STATES; j++) {
            cr_assert(t[i * MOE_SYNTH_STATES + j] >= 0.0);
            sum += t[i * MOE_SYNTH_STATES + j];
            nonzero += t[i * MOE_SYNTH_STATES + j] > 0.0;
        }
        cr_assert(fabs(sum - 1.0) <= 1e-12, "row %d sums to %.17g", i, sum);
        cr_assert_eq(nonzero, MOE_SYNTH_MARKOV_SUCCESSORS, "row %d has %d successors", i, nonzero);
    }
    p.markov_seed++;
    moe_synth_markov_table(t2, &p);
    cr_assert(memcmp(t, t2, sizeof t) != 0, "another markov_seed must give another table");
}

Test(synthetic, deterministic_per_seed) {
    moe_synth_params p = moe_synth_default_params();
    const int64_t n = 20000;
    moe_synth_stream a = generate(&p, 5, n), b = generate(&p, 5, n), c = generate(&p, 6, n);
    cr_assert_arr_eq(a.tokens, b.tokens, (size_t)n * sizeof *a.tokens);
    cr_assert_arr_eq(a.kinds, b.kinds, (size_t)n * sizeof *a.kinds);
    cr_assert_arr_eq(a.logp, b.logp, (size_t)n * sizeof *a.logp);
    int64_t differ = 0;
    for (int64_t i = 0; i < n; i++) differ += a.tokens[i] != c.tokens[i];
    cr_assert(differ > n / 2, "seeds 5 and 6 differ at only %lld of %lld tokens", (long long)differ,
              (long long)n);
    /* A shorter stream is a prefix of a longer one from the same seed. */
    moe_synth_stream d = generate(&p, 5, n / 3);
    cr_assert_arr_eq(d.tokens, a.tokens, (size_t)(n / 3) * sizeof *d.tokens);
    moe_synth_stream_free(&a);
    moe_synth_stream_free(&b);
    moe_synth_stream_free(&c);
    moe_synth_stream_free(&d);
}

/* The floor is over exactly the targets a sequential reader returns, and its
 * value lies in the range the corpus is designed for. */
Test(synthetic, floor_over_the_targets_read) {
    moe_synth_params p = moe_synth_default_params();
    enum { B = 4, T = 64, BATCHES = 150 };
    const int64_t n = BATCHES * B * T + 1 + 1000;
    moe_synth_stream s = generate(&p, 1, n);
    double *nll = malloc((size_t)n * sizeof *nll);
    check_stream(&s, &p, nll);

    moe_data *d;
    cr_assert_eq(moe_data_from_tokens(&d, s.tokens, s.n, MOE_SYNTH_VOCAB_SIZE, "synthetic"),
                 MOE_OK, "%s", moe_last_error());
    int32_t in[B * T], tg[B * T];
    double sum = 0.0, kind_sum[K] = {0};
    int64_t count = 0, kind_count[K] = {0}, at = 1;
    for (int b = 0; b < BATCHES; b++) {
        cr_assert_eq(moe_data_next_batch(d, in, tg, B, 0, B, T), MOE_OK, "%s", moe_last_error());
        for (int i = 0; i < B * T; i++, at++) {
            cr_assert_eq(tg[i], s.tokens[at], "batch %d target %d is not stream token %lld", b, i,
                         (long long)at);
            sum += nll[at];
            kind_sum[s.kinds[at]] += nll[at];
            kind_count[s.kinds[at]]++;
            count++;
        }
    }
    moe_data_close(d);

    moe_synth_floor f;
    cr_assert_eq(moe_synth_floor_of(&f, &s, BATCHES, B, T), MOE_OK, "%s", moe_last_error());
    cr_assert_eq(f.tokens, count);
    cr_assert(fabs(f.nats - sum / count) <= 1e-6, "floor %.9f, reference %.9f", f.nats,
              sum / count);
    for (int k = 0; k < K; k++) {
        cr_assert_eq(f.kind_tokens[k], kind_count[k], "kind %s", moe_synth_kind_name(k));
        cr_assert(kind_count[k] > 1000, "kind %s has only %lld targets", moe_synth_kind_name(k),
                  (long long)kind_count[k]);
        cr_assert(fabs(f.kind_nats[k] - kind_sum[k] / kind_count[k]) <= 1e-6,
                  "kind %s floor %.9f, reference %.9f", moe_synth_kind_name(k), f.kind_nats[k],
                  kind_sum[k] / kind_count[k]);
    }
    cr_assert(f.nats >= 1.2 && f.nats <= 1.8, "floor %.4f nats outside the designed 1.2..1.8",
              f.nats);
    /* One batch too many would wrap around the end of the stream. */
    cr_assert_eq(moe_synth_floor_of(&f, &s, (n - 1) / (B * T) + 1, B, T), MOE_ERR_CONFIG);
    free(nll);
    moe_synth_stream_free(&s);
}

Test(synthetic, stream_starts_with_a_document_and_names) {
    moe_synth_params p = moe_synth_default_params();
    moe_synth_stream s = generate(&p, 3, 100);
    cr_assert(s.tokens[0] < K, "the stream must start with a BOS, got %s",
              moe_synth_token_text(s.tokens[0]));
    cr_assert(fabs(s.logp[0] - log(p.kind_weight[s.tokens[0]])) < 1e-6);
    moe_synth_stream_free(&s);
    cr_assert(MOE_SYNTH_VOCAB_SIZE <= 64);
    for (int t = 0; t < V; t++) cr_assert_str_neq(moe_synth_token_text(t), "?", "token %d", t);
    cr_assert_str_eq(moe_synth_token_text(V), "?");
    cr_assert_str_eq(moe_synth_token_text(MOE_SYNTH_TOK_BOS + MOE_SYNTH_COPY), "<copy>");
    cr_assert_str_eq(moe_synth_token_text(MOE_SYNTH_TOK_DIGIT + 7), "7");
    cr_assert_str_eq(moe_synth_token_text(MOE_SYNTH_TOK_CLOSE + 1), "]");
    cr_assert_str_eq(moe_synth_token_text(MOE_SYNTH_TOK_LETTER + 15), "p");
    cr_assert_str_eq(moe_synth_token_text(MOE_SYNTH_TOK_STATE), "A");
    for (int k = 0; k < K; k++) cr_assert_str_neq(moe_synth_kind_name(k), "?");
}

Test(synthetic, bad_params_named) {
    moe_synth_params p = moe_synth_default_params();
    cr_assert_eq(moe_synth_params_validate(&p), MOE_OK, "%s", moe_last_error());
    p.arith_continue = 1.0;
    cr_assert_eq(moe_synth_params_validate(&p), MOE_ERR_CONFIG);
    cr_assert(strstr(moe_last_error(), "arith_continue") != NULL, "%s", moe_last_error());
    p = moe_synth_default_params();
    p.dyck_max_depth = MOE_SYNTH_DYCK_MAX_DEPTH + 1;
    cr_assert_eq(moe_synth_params_validate(&p), MOE_ERR_CONFIG);
    cr_assert(strstr(moe_last_error(), "dyck_max_depth") != NULL, "%s", moe_last_error());
    p = moe_synth_default_params();
    for (int k = 0; k < K; k++) p.kind_weight[k] = 0.0;
    moe_synth_stream s;
    cr_assert_eq(moe_synth_generate(&s, &p, 1, 10), MOE_ERR_CONFIG);
    cr_assert(strstr(moe_last_error(), "kind_weight") != NULL, "%s", moe_last_error());
}
