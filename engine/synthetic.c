#include "engine/synthetic.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/rng.h"
#include "common/status.h"

moe_synth_params moe_synth_default_params(void) {
    return (moe_synth_params){
        .kind_weight = {0.2, 0.2, 0.2, 0.4},
        .arith_continue = 0.6,
        /* Copies of a fixed length: the copied letter sits a fixed distance
         * back, which a small model learns in a minute; variable lengths need
         * an induction circuit that forms only after millions of tokens. */
        .copy_stop = 0.0,
        .copy_max_len = 6,
        .dyck_open = 0.4,
        .dyck_end = 0.5,
        .dyck_max_depth = 4,
        .markov_end = 0.1,
        .markov_seed = 20240520,
    };
}

static int prob_ok(double p) { return p >= 0.0 && p <= 1.0; }

moe_status moe_synth_params_validate(const moe_synth_params *p) {
    if (p == NULL) return moe_error(MOE_ERR_INVALID_ARG, "synthetic corpus: NULL params");
    double sum = 0.0;
    for (int k = 0; k < MOE_SYNTH_KIND_COUNT; k++) {
        if (!(p->kind_weight[k] >= 0.0 && isfinite(p->kind_weight[k])))
            return moe_error(MOE_ERR_CONFIG, "synthetic corpus: kind_weight[%s]=%g, need >= 0",
                             moe_synth_kind_name(k), p->kind_weight[k]);
        sum += p->kind_weight[k];
    }
    if (!(sum > 0.0))
        return moe_error(MOE_ERR_CONFIG, "synthetic corpus: every kind_weight is 0");
    /* Each document must end with probability 1, hence the strict bounds. */
    if (!(prob_ok(p->arith_continue) && p->arith_continue < 1.0))
        return moe_error(MOE_ERR_CONFIG, "synthetic corpus: arith_continue=%g, need [0, 1)",
                         p->arith_continue);
    if (!prob_ok(p->copy_stop))
        return moe_error(MOE_ERR_CONFIG, "synthetic corpus: copy_stop=%g, need [0, 1]",
                         p->copy_stop);
    if (p->copy_max_len < 1 || p->copy_max_len > MOE_SYNTH_COPY_MAX_LEN)
        return moe_error(MOE_ERR_CONFIG, "synthetic corpus: copy_max_len=%lld, need [1, %d]",
                         (long long)p->copy_max_len, MOE_SYNTH_COPY_MAX_LEN);
    if (!prob_ok(p->dyck_open))
        return moe_error(MOE_ERR_CONFIG, "synthetic corpus: dyck_open=%g, need [0, 1]",
                         p->dyck_open);
    if (!(prob_ok(p->dyck_end) && p->dyck_end > 0.0))
        return moe_error(MOE_ERR_CONFIG, "synthetic corpus: dyck_end=%g, need (0, 1]",
                         p->dyck_end);
    if (p->dyck_max_depth < 1 || p->dyck_max_depth > MOE_SYNTH_DYCK_MAX_DEPTH)
        return moe_error(MOE_ERR_CONFIG, "synthetic corpus: dyck_max_depth=%lld, need [1, %d]",
                         (long long)p->dyck_max_depth, MOE_SYNTH_DYCK_MAX_DEPTH);
    if (!(prob_ok(p->markov_end) && p->markov_end > 0.0))
        return moe_error(MOE_ERR_CONFIG, "synthetic corpus: markov_end=%g, need (0, 1]",
                         p->markov_end);
    return MOE_OK;
}

const char *moe_synth_kind_name(int kind) {
    static const char *const names[MOE_SYNTH_KIND_COUNT] = {"arithmetic", "copy", "brackets",
                                                            "markov"};
    return kind >= 0 && kind < MOE_SYNTH_KIND_COUNT ? names[kind] : "?";
}

const char *moe_synth_token_text(int32_t token) {
    /* clang-format off */
    static const char *const text[MOE_SYNTH_VOCAB_SIZE] = {
        "<arithmetic>", "<copy>", "<brackets>", "<markov>",
        "0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "+", "=", ";",
        "(", "[", ")", "]",
        "a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k", "l", "m", "n", "o", "p", ">",
        "A", "B", "C", "D", "E", "F", "G", "H", "I", "J", "K", "L", "M", "N", "O", "P"};
    /* clang-format on */
    return token >= 0 && token < MOE_SYNTH_VOCAB_SIZE ? text[token] : "?";
}

/* c as an error names it: 'x' when printable, else its byte value. */
static void describe_char(char out[8], unsigned char c) {
    if (c >= 0x20 && c < 0x7f)
        snprintf(out, 8, "'%c'", c);
    else
        snprintf(out, 8, "0x%02x", c);
}

moe_status moe_synth_parse(int32_t *tokens, int64_t capacity, int64_t *n, const char *text) {
    if (!tokens && capacity > 0) return moe_error(MOE_ERR_INVALID_ARG, "moe_synth_parse: NULL tokens");
    if (!n || !text) return moe_error(MOE_ERR_INVALID_ARG, "moe_synth_parse: NULL argument");
    *n = 0;
    for (size_t at = 0; text[at] != '\0';) {
        if (strchr(" \t\r\n", text[at])) {
            at++;
            continue;
        }
        int32_t best = -1;
        size_t best_len = 0;
        for (int32_t t = 0; t < MOE_SYNTH_VOCAB_SIZE; t++) {
            const char *s = moe_synth_token_text(t);
            const size_t len = strlen(s);
            if (len > best_len && strncmp(text + at, s, len) == 0) best = t, best_len = len;
        }
        char c[8];
        describe_char(c, (unsigned char)text[at]);
        if (best < 0)
            return moe_error(MOE_ERR_CONFIG,
                             "byte %zu: %s starts no token of the synthetic vocabulary (<arithmetic> <copy> "
                             "<brackets> <markov>, 0-9 + = ;, ( [ ) ], a-p >, A-P)",
                             at, c);
        if (*n == capacity)
            return moe_error(MOE_ERR_CONFIG, "more than %lld tokens: the one at byte %zu (%s) does not fit",
                             (long long)capacity, at, c);
        tokens[(*n)++] = best;
        at += best_len;
    }
    return MOE_OK;
}

/* A sequence of draws from (seed, stream) at consecutive indices. */
typedef struct synth_rng {
    uint64_t seed, stream, index;
} synth_rng;

/* Uniform in [0, 1) with 53 random bits. */
static double draw_unit(synth_rng *r) {
    return (double)(moe_rng_bits(r->seed, r->stream, r->index++) >> 11) * 0x1p-53;
}

/* Uniform in [0, n), n small: the bias is below n / 2^53. */
static int64_t draw_below(synth_rng *r, int64_t n) {
    int64_t k = (int64_t)(draw_unit(r) * (double)n);
    return k < n ? k : n - 1;
}

/* An index drawn from probs [n] (summing to 1 up to rounding); zero entries
 * are never drawn. */
static int64_t draw_from(synth_rng *r, const double *probs, int64_t n) {
    double u = draw_unit(r), cum = 0.0;
    int64_t last = 0;
    for (int64_t i = 0; i < n; i++) {
        if (probs[i] <= 0.0) continue;
        cum += probs[i];
        last = i;
        if (u < cum) return i;
    }
    return last;
}

void moe_synth_markov_table(double *table, const moe_synth_params *params) {
    synth_rng r = {params->markov_seed, 0, 0};
    const int64_t S = MOE_SYNTH_STATES;
    for (int64_t i = 0; i < S; i++) {
        double *row = table + i * S;
        int64_t perm[MOE_SYNTH_STATES];
        for (int64_t j = 0; j < S; j++) {
            row[j] = 0.0;
            perm[j] = j;
        }
        /* The first MOE_SYNTH_MARKOV_SUCCESSORS of a partial shuffle are the
         * successors; exponential draws normalised are Dirichlet(1). */
        double sum = 0.0;
        for (int64_t j = 0; j < MOE_SYNTH_MARKOV_SUCCESSORS; j++) {
            int64_t pick = j + draw_below(&r, S - j);
            int64_t t = perm[j];
            perm[j] = perm[pick];
            perm[pick] = t;
            double w = -log(1.0 - draw_unit(&r));
            row[perm[j]] = w;
            sum += w;
        }
        for (int64_t j = 0; j < S; j++) row[j] /= sum;
    }
}

/* Writes tokens into the stream until it holds n. */
typedef struct emitter {
    moe_synth_stream *s;
    int64_t i;
    uint8_t kind;
} emitter;

static int full(const emitter *e) { return e->i >= e->s->n; }

static void emit(emitter *e, int32_t token, double p) {
    if (full(e)) return;
    e->s->tokens[e->i] = token;
    e->s->kinds[e->i] = e->kind;
    e->s->logp[e->i] = (float)log(p);
    e->i++;
}

/* Each body generator returns the probability that the document ended where
 * it did, given its tokens: the factor the next BOS carries. */

static double gen_arith(emitter *e, synth_rng *r, const moe_synth_params *p) {
    double p_start = 1.0; /* after the BOS an equation surely follows */
    for (;;) {
        int64_t a = draw_below(r, 10), b = draw_below(r, 10);
        emit(e, MOE_SYNTH_TOK_DIGIT + (int32_t)a, p_start / 10.0);
        emit(e, MOE_SYNTH_TOK_PLUS, 1.0);
        emit(e, MOE_SYNTH_TOK_DIGIT + (int32_t)b, 0.1);
        emit(e, MOE_SYNTH_TOK_EQUALS, 1.0);
        emit(e, MOE_SYNTH_TOK_DIGIT + (int32_t)((a + b) / 10), 1.0);
        emit(e, MOE_SYNTH_TOK_DIGIT + (int32_t)((a + b) % 10), 1.0);
        emit(e, MOE_SYNTH_TOK_SEMICOLON, 1.0);
        if (full(e) || draw_unit(r) >= p->arith_continue) return 1.0 - p->arith_continue;
        p_start = p->arith_continue;
    }
}

static double gen_copy(emitter *e, synth_rng *r, const moe_synth_params *p) {
    int32_t src[MOE_SYNTH_COPY_MAX_LEN];
    int64_t len = 0;
    double p_letter = 1.0; /* the first letter surely comes */
    for (;;) {
        src[len] = MOE_SYNTH_TOK_LETTER + (int32_t)draw_below(r, MOE_SYNTH_LETTERS);
        emit(e, src[len++], p_letter / MOE_SYNTH_LETTERS);
        if (len == p->copy_max_len) {
            emit(e, MOE_SYNTH_TOK_MARK, 1.0);
            break;
        }
        if (draw_unit(r) < p->copy_stop) {
            emit(e, MOE_SYNTH_TOK_MARK, p->copy_stop);
            break;
        }
        p_letter = 1.0 - p->copy_stop;
    }
    for (int64_t i = 0; i < len; i++) emit(e, src[i], 1.0);
    return 1.0;
}

static double gen_brackets(emitter *e, synth_rng *r, const moe_synth_params *p) {
    int32_t stack[MOE_SYNTH_DYCK_MAX_DEPTH]; /* open types, innermost last */
    int64_t depth = 0;
    int started = 0;
    while (!full(e)) {
        int open;
        double p_move; /* of opening (either type) or of closing */
        if (depth == 0) {
            if (started && draw_unit(r) < p->dyck_end) return p->dyck_end;
            open = 1;
            p_move = started ? 1.0 - p->dyck_end : 1.0;
        } else if (depth == p->dyck_max_depth) {
            open = 0;
            p_move = 1.0;
        } else {
            open = draw_unit(r) < p->dyck_open;
            p_move = open ? p->dyck_open : 1.0 - p->dyck_open;
        }
        if (open) {
            stack[depth] = (int32_t)draw_below(r, 2);
            emit(e, MOE_SYNTH_TOK_OPEN + stack[depth++], p_move / 2.0);
            started = 1;
        } else {
            emit(e, MOE_SYNTH_TOK_CLOSE + stack[--depth], p_move);
        }
    }
    return 1.0;
}

static double gen_markov(emitter *e, synth_rng *r, const moe_synth_params *p,
                         const double *table) {
    int64_t s = draw_below(r, MOE_SYNTH_STATES);
    emit(e, MOE_SYNTH_TOK_STATE + (int32_t)s, 1.0 / MOE_SYNTH_STATES);
    while (!full(e)) {
        if (draw_unit(r) < p->markov_end) return p->markov_end;
        int64_t next = draw_from(r, table + s * MOE_SYNTH_STATES, MOE_SYNTH_STATES);
        emit(e, MOE_SYNTH_TOK_STATE + (int32_t)next,
             (1.0 - p->markov_end) * table[s * MOE_SYNTH_STATES + next]);
        s = next;
    }
    return 1.0;
}

void moe_synth_stream_free(moe_synth_stream *stream) {
    if (stream == NULL) return;
    free(stream->tokens);
    free(stream->kinds);
    free(stream->logp);
    *stream = (moe_synth_stream){0};
}

moe_status moe_synth_generate(moe_synth_stream *stream, const moe_synth_params *params,
                              uint64_t seed, int64_t n) {
    if (stream == NULL) return moe_error(MOE_ERR_INVALID_ARG, "synthetic corpus: NULL stream");
    *stream = (moe_synth_stream){0};
    MOE_TRY(moe_synth_params_validate(params));
    if (n < 1)
        return moe_error(MOE_ERR_INVALID_ARG, "synthetic corpus: n=%lld tokens, need >= 1",
                         (long long)n);
    stream->n = n;
    stream->tokens = malloc((size_t)n * sizeof *stream->tokens);
    stream->kinds = malloc((size_t)n * sizeof *stream->kinds);
    stream->logp = malloc((size_t)n * sizeof *stream->logp);
    if (stream->tokens == NULL || stream->kinds == NULL || stream->logp == NULL) {
        moe_synth_stream_free(stream);
        return moe_error(MOE_ERR_OUT_OF_MEMORY, "synthetic corpus: cannot allocate %lld tokens",
                         (long long)n);
    }
    double weight[MOE_SYNTH_KIND_COUNT], sum = 0.0;
    for (int k = 0; k < MOE_SYNTH_KIND_COUNT; k++) sum += params->kind_weight[k];
    for (int k = 0; k < MOE_SYNTH_KIND_COUNT; k++) weight[k] = params->kind_weight[k] / sum;
    double table[MOE_SYNTH_STATES * MOE_SYNTH_STATES];
    moe_synth_markov_table(table, params);

    synth_rng r = {seed, 1, 0};
    emitter e = {stream, 0, 0};
    double end = 1.0; /* the stream starts with a document */
    while (!full(&e)) {
        int64_t kind = draw_from(&r, weight, MOE_SYNTH_KIND_COUNT);
        e.kind = (uint8_t)kind;
        emit(&e, MOE_SYNTH_TOK_BOS + (int32_t)kind, end * weight[kind]);
        switch (kind) {
        case MOE_SYNTH_ARITH: end = gen_arith(&e, &r, params); break;
        case MOE_SYNTH_COPY: end = gen_copy(&e, &r, params); break;
        case MOE_SYNTH_BRACKETS: end = gen_brackets(&e, &r, params); break;
        default: end = gen_markov(&e, &r, params, table); break;
        }
    }
    return MOE_OK;
}

moe_status moe_synth_floor_of(moe_synth_floor *floor, const moe_synth_stream *stream,
                              int64_t n_batches, int64_t rows, int64_t T) {
    if (floor == NULL || stream == NULL || stream->logp == NULL)
        return moe_error(MOE_ERR_INVALID_ARG, "synthetic floor: NULL argument");
    if (n_batches < 1 || rows < 1 || T < 1 || rows > INT64_MAX / T ||
        n_batches > (stream->n - 1) / (rows * T))
        return moe_error(MOE_ERR_CONFIG,
                         "synthetic floor: %lld batches of %lld rows x %lld need that many "
                         "targets plus one token, the stream has %lld tokens",
                         (long long)n_batches, (long long)rows, (long long)T,
                         (long long)stream->n);
    const int64_t m = n_batches * rows * T;
    double total = 0.0, kind_total[MOE_SYNTH_KIND_COUNT] = {0};
    *floor = (moe_synth_floor){0};
    for (int64_t i = 1; i <= m; i++) {
        total -= stream->logp[i];
        kind_total[stream->kinds[i]] -= stream->logp[i];
        floor->kind_tokens[stream->kinds[i]]++;
    }
    floor->tokens = m;
    floor->nats = total / (double)m;
    for (int k = 0; k < MOE_SYNTH_KIND_COUNT; k++)
        floor->kind_nats[k] =
            floor->kind_tokens[k] > 0 ? kind_total[k] / (double)floor->kind_tokens[k] : 0.0;
    return MOE_OK;
}
