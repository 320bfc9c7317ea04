/* generate.c: greedy and sampled continuation: decoding steps through
 * the prompts, then one per token, against the keys and values the layers
 * keep (generate.h). */
#include "engine/generate.h"

#include <math.h>
#include <omp.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/rng.h"
#include "common/shortest.h"
#include "common/status.h"
#include "engine/checkpoint.h"
#include "engine/json.h"
#include "engine/run.h"
#include "engine/synthetic.h"
#include "engine/tokenizer.h"

moe_status moe_sampling_validate(const moe_sampling *s) {
    if (!s) return moe_error(MOE_ERR_INVALID_ARG, "sampling: NULL");
    char v[32]; /* the value as given, not rounded to one that would pass */
    if (!(s->temperature >= 0.0) || !isfinite(s->temperature))
        return moe_error(MOE_ERR_CONFIG, "--temperature %s must be finite and >= 0 (0: greedy)",
                         moe_shortest(v, sizeof v, s->temperature));
    if (s->top_k < 0) return moe_error(MOE_ERR_CONFIG, "--top-k %lld must be >= 0 (0: every token)", (long long)s->top_k);
    if (!(s->top_p >= 0.0 && s->top_p <= 1.0))
        return moe_error(MOE_ERR_CONFIG, "--top-p %s must be in [0, 1] (0 or 1: every token)",
                         moe_shortest(v, sizeof v, s->top_p));
    return MOE_OK;
}

/* Whether token a ranks before token b: the larger logit, then the lower id. */
static bool ranks_before(const float *logits, int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
}

static int32_t argmax(const float *logits, int64_t V) {
    int32_t best = 0;
    for (int32_t i = 1; i < (int32_t)V; i++)
        if (ranks_before(logits, i, best)) best = i;
    return best;
}

/* A token's weight at the temperature, relative to the best logit top. */
static double weight(const float *logits, int32_t id, float top, double temperature) {
    return exp(((double)logits[id] - top) / temperature);
}

/* Whether token a goes above token b in a heap with the best token
 * (ranks_before) on top, or the worst when worst_on_top. */
static bool heap_above(const float *logits, int32_t a, int32_t b, bool worst_on_top) {
    return worst_on_top ? ranks_before(logits, b, a) : ranks_before(logits, a, b);
}

/* Restores the heap order (heap_above) below ids[at] of ids [n]. */
static void sift_down(int32_t *ids, int64_t at, int64_t n, const float *logits, bool worst_on_top) {
    for (int64_t child; (child = 2 * at + 1) < n; at = child) {
        if (child + 1 < n && heap_above(logits, ids[child + 1], ids[child], worst_on_top)) child++;
        if (!heap_above(logits, ids[child], ids[at], worst_on_top)) return;
        const int32_t t = ids[at];
        ids[at] = ids[child], ids[child] = t;
    }
}

/* The k best tokens into ids [k], best first, in O(V log k) whatever k:
 * a heap of the best so far, the worst on top, then sorted by popping each
 * worst to the end. */
static void top_tokens(int32_t *ids, int64_t k, const float *logits, int64_t V) {
    for (int32_t i = 0; i < (int32_t)k; i++) ids[i] = i;
    for (int64_t i = k / 2 - 1; i >= 0; i--) sift_down(ids, i, k, logits, true);
    for (int32_t i = (int32_t)k; i < (int32_t)V; i++)
        if (ranks_before(logits, i, ids[0])) {
            ids[0] = i;
            sift_down(ids, 0, k, logits, true);
        }
    for (int64_t size = k; size > 1; size--) {
        const int32_t worst = ids[0];
        ids[0] = ids[size - 1], ids[size - 1] = worst;
        sift_down(ids, 0, size - 1, logits, true);
    }
}


/* The nucleus of the tokens ids [k]: the fewest likeliest whose weights sum
 * to at least mass, moved to the end of ids best first (a heap's pops);
 * returns how many, and *sum their weights, summed best first. */
static int64_t nucleus(int32_t *ids, int64_t k, const float *logits, float top, double temperature, double mass,
                       double *sum) {
    for (int64_t i = k / 2 - 1; i >= 0; i--) sift_down(ids, i, k, logits, false);
    int64_t size = k;
    for (*sum = 0.0; size > 0 && *sum < mass; size--) {
        const int32_t best = ids[0];
        *sum += weight(logits, best, top, temperature);
        ids[0] = ids[size - 1], ids[size - 1] = best;
        sift_down(ids, 0, size - 1, logits, false);
    }
    for (int64_t a = size, b = k - 1; a < b; a++, b--) { /* popped last-first: best first */
        const int32_t t = ids[a];
        ids[a] = ids[b], ids[b] = t;
    }
    return k - size;
}

int32_t moe_sample_token(int32_t *ids, const float *logits, int64_t V, const moe_sampling *s, uint64_t stream,
                         uint64_t draw) {
    if (s->temperature == 0.0 || s->top_k == 1) return argmax(logits, V);
    int64_t k = s->top_k > 0 && s->top_k < V ? s->top_k : V;
    if (k < V)
        top_tokens(ids, k, logits, V);
    else
        for (int32_t i = 0; i < (int32_t)V; i++) ids[i] = i;
    /* p_i proportional to exp((l_i - max) / temperature), summed in a fixed
     * order, then the first token whose running sum passes u * total. */
    const float top = logits[argmax(logits, V)];
    double total = 0.0;
    for (int64_t j = 0; j < k; j++) total += weight(logits, ids[j], top, s->temperature);
    if (s->top_p > 0.0 && s->top_p < 1.0) { /* the nucleus's total replaces theirs */
        const int64_t n = nucleus(ids, k, logits, top, s->temperature, s->top_p * total, &total);
        ids += k - n;
        k = n;
    }
    const double u = moe_rng_uniform_double(s->seed, stream, draw) * total;
    double run = 0.0;
    int32_t pick = ids[k - 1];
    for (int64_t j = 0; j < k; j++) {
        run += weight(logits, ids[j], top, s->temperature);
        if (run > u) {
            pick = ids[j];
            break;
        }
    }
    return pick;
}

static moe_status check_rows(const moe_model *model, const int64_t *len, const int64_t *end) {
    const moe_model_config *c = moe_model_get_config(model);
    const int64_t B = moe_model_batch_size(model), T = moe_model_seq_len(model);
    if (moe_model_world_size(model) != 1)
        return moe_error(MOE_ERR_UNSUPPORTED, "generation runs on one rank, not %d", moe_model_world_size(model));
    if (moe_model_config_drops_pairs(c))
        return moe_error(MOE_ERR_UNSUPPORTED,
                         "generation needs dropless routing, and this model drops past a capacity factor of %g: "
                         "the padding past each row's end would compete for the experts' slots",
                         c->moe_capacity_factor);
    for (int64_t b = 0; b < B; b++)
        if (len[b] < 1 || end[b] < len[b] || end[b] > T)
            return moe_error(MOE_ERR_INVALID_ARG,
                             "generation: row %lld holds %lld tokens and should grow to %lld, in rows of %lld "
                             "(at least 1 token to start from)",
                             (long long)b, (long long)len[b], (long long)end[b], (long long)T);
    return MOE_OK;
}

/* Logits must be finite to be sampled from: weights that overflow them
 * (finite themselves, or the loader would have refused them) are the
 * checkpoint's fault, not a draw's. */
static moe_status check_finite(const float *logits, int64_t V, int64_t row, int64_t pos) {
    for (int64_t i = 0; i < V; i++)
        if (!isfinite(logits[i]))
            return moe_error(MOE_ERR_FORMAT, "the model's weights give non-finite logits: row %lld, position %lld: "
                             "logit %lld is %g", (long long)row, (long long)pos, (long long)i, (double)logits[i]);
    return MOE_OK;
}

/* Whether token is one of stops [n]. */
static bool stops_at(const int32_t *stops, int n, int32_t token) {
    for (int i = 0; i < n; i++)
        if (stops[i] == token) return true;
    return false;
}

moe_status moe_generate(moe_model *model, int32_t *rows, int64_t *len, const int64_t *end, const int32_t *stops,
                        int n_stops, const moe_sampling *sampling) {
    if (!model || !rows || !len || !end || (n_stops > 0 && !stops))
        return moe_error(MOE_ERR_INVALID_ARG, "moe_generate: NULL argument");
    MOE_TRY(moe_sampling_validate(sampling));
    MOE_TRY(check_rows(model, len, end));
    const int64_t B = moe_model_batch_size(model), T = moe_model_seq_len(model);
    const int64_t V = moe_model_get_config(model)->vocab_size;
    const bool decodes = moe_model_can_decode(model);
    const int64_t S = decodes ? moe_model_decode_capacity(model) : B; /* tokens a decoding step takes */
    bool *growing = malloc((size_t)B * sizeof *growing);
    float *logits = malloc((size_t)(B * V) * sizeof *logits);    /* [B, V] each row's latest */
    float *decoded = malloc((size_t)(B * V) * sizeof *decoded);  /* [n, V] a decoding step's, n <= B */
    int32_t *scratch = malloc((size_t)V * sizeof *scratch);
    int64_t *at = malloc((size_t)(2 * S) * sizeof *at); /* rows, then positions, of a decoding step */
    int32_t *tokens = malloc((size_t)S * sizeof *tokens);
    moe_status st = MOE_OK;
    if (!growing || !logits || !decoded || !scratch || !at || !tokens)
        st = moe_error(MOE_ERR_OUT_OF_MEMORY, "generation: %lld rows of %lld logits", (long long)B, (long long)V);
    for (int64_t b = 0; st == MOE_OK && b < B; b++) {
        growing[b] = len[b] < end[b];
        for (int64_t p = len[b]; p < T; p++) rows[b * T + p] = 0;
    }
    /* The prompts go through decoding steps, a chunk of positions of
     * every row at a time (as many as a step takes), each filling every
     * layer's keys and values at its positions, so that no forward over
     * [B, T] (and its B x heads x T x T scores) is ever needed; only a
     * row's last prompt position needs its logits, in a step of its own
     * after the chunk's others. Then each new token is one decoding step
     * of the rows still growing. A model that keeps no keys (it recomputes
     * its layers) runs a forward over the rows for each token instead. */
    if (st == MOE_OK) moe_model_set_training(model, false);
    int64_t longest = 0;
    for (int64_t b = 0; b < B; b++) longest = len[b] > longest ? len[b] : longest;
    const int64_t chunk = S / B;
    for (int64_t p0 = 0; decodes && p0 < longest && st == MOE_OK; p0 += chunk)
        for (int last = 0; last < 2 && st == MOE_OK; last++) {
            int64_t n = 0;
            for (int64_t b = 0; b < B; b++)
                for (int64_t p = p0; p < p0 + chunk && p < len[b]; p++)
                    if ((p == len[b] - 1) == last) at[n] = b, at[S + n] = p, tokens[n++] = rows[b * T + p];
            if (n > 0) st = moe_model_decode(model, n, at, tokens, at + S, last ? decoded : NULL);
            for (int64_t i = 0; last && i < n && st == MOE_OK; i++)
                memcpy(logits + at[i] * V, decoded + i * V, (size_t)V * sizeof *logits);
        }
    if (!decodes && st == MOE_OK) st = moe_model_forward(model, rows, NULL, NULL);
    for (int64_t b = 0; !decodes && b < B && st == MOE_OK; b++)
        if (growing[b]) st = moe_model_last_logits(model, b, len[b] - 1, logits + b * V);
    while (st == MOE_OK) {
        int64_t n = 0;
        for (int64_t b = 0; b < B && st == MOE_OK; b++) {
            if (!growing[b]) continue;
            st = check_finite(logits + b * V, V, b, len[b] - 1);
            if (st != MOE_OK) break;
            const int32_t token = moe_sample_token(scratch, logits + b * V, V, sampling, (uint64_t)b, (uint64_t)len[b]);
            rows[b * T + len[b]++] = token;
            growing[b] = len[b] < end[b] && !stops_at(stops, n_stops, token);
            if (!growing[b]) continue;
            at[n] = b;
            at[S + n] = len[b] - 1;
            tokens[n++] = token;
        }
        if (st != MOE_OK || n == 0) break;
        if (decodes) {
            st = moe_model_decode(model, n, at, tokens, at + S, decoded);
            for (int64_t i = 0; i < n && st == MOE_OK; i++)
                memcpy(logits + at[i] * V, decoded + i * V, (size_t)V * sizeof *logits);
        } else {
            st = moe_model_forward(model, rows, NULL, NULL);
            for (int64_t i = 0; i < n && st == MOE_OK; i++)
                st = moe_model_last_logits(model, at[i], at[S + i], logits + at[i] * V);
        }
    }
    free(growing);
    free(logits);
    free(decoded);
    free(scratch);
    free(at);
    free(tokens);
    return st;
}

/* ------------------------------------------- continuing a checkpoint's prompts */

static const char *const token_kind_names[] = {"auto", "synthetic", "bytes", "ids"};
#define N_TOKEN_KINDS (sizeof token_kind_names / sizeof *token_kind_names)

/* More than the longest text one token takes, separator included:
 * "<arithmetic>" (12 bytes), "\xff", or an int32 id (10 digits) and its
 * comma. */
#define TOKEN_TEXT_BYTES 24
/* The same decoded by a tokenizer: its longest token, every byte written
 * "\xNN" at worst (longer than "\<id 2147483647>"). */
#define DECODED_TEXT_BYTES (4 * MOE_TOKENIZER_DECODED_BYTES_MAX + 1)

const char *moe_token_kind_name(moe_token_kind kind) {
    return (unsigned)kind < N_TOKEN_KINDS ? token_kind_names[kind] : "?";
}

moe_status moe_token_kind_parse(moe_token_kind *kind, const char *name) {
    for (size_t i = 0; name && i < N_TOKEN_KINDS; i++)
        if (strcmp(name, token_kind_names[i]) == 0) {
            *kind = (moe_token_kind)i;
            return MOE_OK;
        }
    return moe_error(MOE_ERR_CONFIG, "--tokens '%s': expected auto, synthetic, bytes or ids", name ? name : "");
}

void moe_generate_options_init(moe_generate_options *o) {
    *o = (moe_generate_options){
        .samples = 1,
        .max_new_tokens = 32,
        .sampling = {.temperature = 0.0, .top_k = 0, .top_p = 1.0, .seed = 1337},
        .tokens = MOE_TOKENS_AUTO,
        .device = MOE_DEVICE_AUTO,
    };
}

moe_status moe_generate_options_validate(const moe_generate_options *o) {
    if (!o) return moe_error(MOE_ERR_INVALID_ARG, "moe_generate_options_validate: NULL options");
    if (!o->init_from || !o->init_from[0])
        return moe_error(MOE_ERR_CONFIG, "--init-from DIR is required: the checkpoint to continue prompts with");
    if (!o->prompt) return moe_error(MOE_ERR_CONFIG, "--prompt TEXT is required: the tokens to continue");
    if (o->tokenizer && !o->tokenizer[0]) return moe_error(MOE_ERR_CONFIG, "--tokenizer must not be empty");
    if (o->samples <= 0) return moe_error(MOE_ERR_CONFIG, "--samples %lld must be positive", (long long)o->samples);
    if (o->max_new_tokens <= 0)
        return moe_error(MOE_ERR_CONFIG, "--max-new-tokens %lld must be positive", (long long)o->max_new_tokens);
    if (o->sampling.temperature == 0.0 && o->sampling.top_k > 1)
        return moe_error(MOE_ERR_CONFIG, "--top-k %lld draws among the likeliest tokens, and --temperature 0 takes "
                         "the likeliest one: give --temperature > 0 to sample", (long long)o->sampling.top_k);
    char v[32];
    if (o->sampling.temperature == 0.0 && o->sampling.top_p > 0.0 && o->sampling.top_p < 1.0)
        return moe_error(MOE_ERR_CONFIG, "--top-p %s draws among the likeliest tokens, and --temperature 0 takes "
                         "the likeliest one: give --temperature > 0 to sample",
                         moe_shortest(v, sizeof v, o->sampling.top_p));
    if (o->samples > 1 && (o->sampling.temperature == 0.0 || o->sampling.top_k == 1))
        return moe_error(MOE_ERR_CONFIG, "--samples %lld of greedy decoding (%s) would be %lld copies of one: give "
                         "%s to sample",
                         (long long)o->samples, o->sampling.temperature == 0.0 ? "--temperature 0" : "--top-k 1",
                         (long long)o->samples,
                         o->sampling.temperature == 0.0 ? "--temperature > 0" : "--top-k 0 or above 1");
    if ((unsigned)o->tokens >= N_TOKEN_KINDS)
        return moe_error(MOE_ERR_CONFIG, "--tokens: no kind %d", (int)o->tokens);
    if (o->tokenizer && o->tokens != MOE_TOKENS_AUTO && o->tokens != MOE_TOKENS_IDS)
        return moe_error(MOE_ERR_CONFIG, "--tokenizer %s prints token ids as text, and --tokens %s writes the tokens "
                         "its own way: leave --tokens out, or give --tokens ids",
                         o->tokenizer, moe_token_kind_name(o->tokens));
    if (o->threads < 0 || o->threads > MOE_RUN_THREADS_MAX)
        return moe_error(MOE_ERR_CONFIG, "--threads %d must lie in [0, %d] (this machine has %d cores)", o->threads,
                         MOE_RUN_THREADS_MAX, omp_get_num_procs());
    return moe_sampling_validate(&o->sampling);
}

/* The bytes written as a backslash and a letter, each before its letter:
 * printed so (escape_byte) and read so (parse_tokens). */
static const char byte_escapes[] = {'\n', 'n', '\t', 't', '\r', 'r', '\\', '\\'};

/* The byte escaped by letter e, or -1. */
static int unescape(char e) {
    for (size_t i = 0; e && i < sizeof byte_escapes; i += 2)
        if (e == byte_escapes[i + 1]) return (unsigned char)byte_escapes[i];
    return -1;
}

/* c as an error or a byte-level text shows it: itself when printable, else
 * an escape; '|' too, which separates a sample's prompt from its
 * continuation. */
static void escape_byte(char out[5], unsigned char c) {
    for (size_t i = 0; i < sizeof byte_escapes; i += 2)
        if (c == (unsigned char)byte_escapes[i]) {
            snprintf(out, 5, "\\%c", byte_escapes[i + 1]);
            return;
        }
    if (c >= 0x20 && c < 0x7f && c != '|')
        snprintf(out, 5, "%c", c);
    else
        snprintf(out, 5, "\\x%02x", c);
}

/* The token kind for a vocabulary of V: want, or AUTO's choice. A kind
 * whose texts cannot write every token of the vocabulary is refused, since
 * the model may generate any of them. */
static moe_status choose_tokens(moe_token_kind *kind, moe_token_kind want, int64_t V) {
    *kind = want;
    if (want == MOE_TOKENS_AUTO)
        *kind = V == MOE_SYNTH_VOCAB_SIZE ? MOE_TOKENS_SYNTHETIC : V == MOE_BYTE_VOCAB_SIZE ? MOE_TOKENS_BYTES : MOE_TOKENS_IDS;
    const int64_t most = *kind == MOE_TOKENS_SYNTHETIC ? MOE_SYNTH_VOCAB_SIZE : *kind == MOE_TOKENS_BYTES ? MOE_BYTE_VOCAB_SIZE : V;
    if (V > most)
        return moe_error(MOE_ERR_CONFIG,
                         "--tokens %s writes %lld tokens, and the checkpoint's vocab_size is %lld: use --tokens ids",
                         moe_token_kind_name(*kind), (long long)most, (long long)V);
    return MOE_OK;
}

/* Comma-separated decimal ids, each below V, spaces around them skipped. */
static moe_status parse_ids(int32_t *tokens, int64_t *n, const char *text, int64_t V) {
    *n = 0;
    size_t at = strspn(text, " ");
    if (!text[at]) return MOE_OK;
    for (;;) {
        at += strspn(text + at, " ");
        const size_t start = at;
        int64_t id = 0;
        for (; text[at] >= '0' && text[at] <= '9'; at++)
            if (id < V) id = id * 10 + (text[at] - '0');
        char c[5] = "";
        escape_byte(c, (unsigned char)text[at]);
        if (at == start)
            return moe_error(MOE_ERR_CONFIG, "byte %zu: %s%s%s where a token id was expected (comma-separated ids)",
                             at, text[at] ? "'" : "", text[at] ? c : "the end", text[at] ? "'" : "");
        if (id >= V)
            return moe_error(MOE_ERR_CONFIG, "byte %zu: token id %.*s is not below the checkpoint's vocab_size %lld",
                             start, (int)(at - start), text + start, (long long)V);
        tokens[(*n)++] = (int32_t)id;
        at += strspn(text + at, " ");
        if (!text[at]) return MOE_OK;
        if (text[at] != ',') {
            escape_byte(c, (unsigned char)text[at]);
            return moe_error(MOE_ERR_CONFIG, "byte %zu: '%s' where ',' or the end was expected", at, c);
        }
        at++;
    }
}

static int hex_digit(char c) {
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
}

/* text in kind's form into *tokens (allocated, [*n]), every token below V;
 * errors go under flag. */
static moe_status parse_tokens(int32_t **tokens, int64_t *n, moe_token_kind kind, const char *text, int64_t V,
                               const char *flag) {
    const size_t bytes = strlen(text);
    /* Every token takes at least one byte of text. */
    if (!(*tokens = malloc((bytes + 1) * sizeof **tokens)))
        return moe_error(MOE_ERR_OUT_OF_MEMORY, "%s: %zu tokens", flag, bytes);
    moe_status st = MOE_OK;
    if (kind == MOE_TOKENS_SYNTHETIC) {
        st = moe_synth_parse(*tokens, (int64_t)bytes, n, text);
        for (int64_t i = 0; i < *n && st == MOE_OK; i++)
            if ((*tokens)[i] >= V)
                st = moe_error(MOE_ERR_CONFIG, "token %lld, %s, is id %d, not below the checkpoint's vocab_size %lld",
                               (long long)i, moe_synth_token_text((*tokens)[i]), (int)(*tokens)[i], (long long)V);
    } else if (kind == MOE_TOKENS_BYTES) {
        /* The escapes samples are printed with read back as their bytes. */
        *n = 0;
        for (size_t i = 0; i < bytes && st == MOE_OK; i++) {
            const size_t at = i;
            int byte = (unsigned char)text[i];
            if (byte == '\\') {
                const char e = text[++i];
                int hi, lo;
                byte = unescape(e);
                if (e == 'x' && (hi = hex_digit(text[i + 1])) >= 0 && (lo = hex_digit(text[i + 2])) >= 0)
                    byte = 16 * hi + lo, i += 2;
                if (byte < 0) {
                    st = e == 'x' ? moe_error(MOE_ERR_CONFIG, "byte %zu: '\\x' needs two hex digits", at)
                                  : moe_error(MOE_ERR_CONFIG, "byte %zu: '\\%.1s' is no escape (\\n \\t \\r \\\\ "
                                                              "\\xNN are)",
                                              at, e ? text + i : "");
                    break;
                }
            }
            (*tokens)[(*n)++] = byte;
            char c[5];
            escape_byte(c, (unsigned char)byte);
            if (byte >= V)
                st = moe_error(MOE_ERR_CONFIG, "byte %zu, '%s', is token %d, not below the checkpoint's vocab_size %lld",
                               at, c, byte, (long long)V);
        }
    } else {
        st = parse_ids(*tokens, n, text, V);
    }
    return st == MOE_OK ? MOE_OK : moe_error_prefix(st, "%s: ", flag);
}

/* tokens [n] in kind's form into out [n * TOKEN_TEXT_BYTES + 1]; with a
 * tokenizer (NULL: none) as their bytes, each written as the bytes form
 * writes it, into out [n * DECODED_TEXT_BYTES + 1]. */
static void render_tokens(char *out, moe_token_kind kind, const moe_tokenizer *tokenizer, const int32_t *tokens,
                          int64_t n) {
    size_t at = 0;
    out[0] = '\0';
    for (int64_t i = 0; i < n; i++) {
        char *p = out + at;
        size_t len = 0;
        const unsigned char *bytes = tokenizer ? moe_tokenizer_bytes(tokenizer, tokens[i], &len) : NULL;
        if (bytes)
            for (size_t j = 0; j < len; j++) escape_byte(p + strlen(p), bytes[j]);
        else if (tokenizer)
            /* A decoded backslash is written \\: no token's bytes print as this. */
            snprintf(p, TOKEN_TEXT_BYTES, "\\<id %d>", (int)tokens[i]);
        else if (kind == MOE_TOKENS_SYNTHETIC)
            snprintf(p, TOKEN_TEXT_BYTES, "%s", moe_synth_token_text(tokens[i]));
        else if (kind == MOE_TOKENS_BYTES)
            escape_byte(p, (unsigned char)tokens[i]);
        else
            snprintf(p, TOKEN_TEXT_BYTES, "%s%d", i ? "," : "", (int)tokens[i]);
        at += strlen(p);
    }
}

/* What a generation holds, released by free_generation whatever stage it
 * reached. */
typedef struct generation {
    moe_model_config cfg;
    moe_token_kind kind;
    moe_tokenizer *tokenizer; /* NULL: none */
    char tokenizer_path[4096]; /* the checkpoint's tokenizer.json when it is the tokenizer; "" */
    char tokenizer_name[4160]; /* the tokenizer as messages name it: "--tokenizer FILE", or the file */
    bool encodes;              /* the prompt and --stop are text it encodes (not --tokens ids) */
    int32_t *prompt; /* [n_prompt] */
    int64_t n_prompt;
    int32_t stops[MOE_TOKEN_IDS_MAX]; /* [n_stops] the ids that end a sample */
    int n_stops;
    moe_stop_source stop_source;
    moe_device_handle device;
    moe_model *model;
    int32_t *rows;   /* [B, T] */
    int64_t *len;    /* [B] */
    int64_t *end;    /* [B] */
    char *prompt_text, *new_text; /* [T * (DECODED_ or TOKEN_TEXT_BYTES) + 1] each */
} generation;

static void free_generation(generation *g) {
    free(g->prompt);
    free(g->rows);
    free(g->len);
    free(g->end);
    free(g->prompt_text);
    free(g->new_text);
    moe_model_destroy(g->model);
    moe_device_close(&g->device);
    moe_tokenizer_close(g->tokenizer);
}

/* parse_tokens in g's form; under a tokenizer, text that is no list of
 * ids gets an error that says why it must be, a natural slip. */
static moe_status read_tokens(int32_t **tokens, int64_t *n, const generation *g, const char *text, const char *flag) {
    if (g->encodes) {
        /* The prompt as transformers' tokenizer gives it (Llama 3's
         * begin-of-text too); --stop alone. */
        const moe_status st = moe_tokenizer_encode(g->tokenizer, text, strcmp(flag, "--prompt") == 0, tokens, n);
        if (st != MOE_OK) return moe_error_prefix(st, "%s: %s: ", flag, g->tokenizer_name);
        for (int64_t i = 0; i < *n; i++)
            if ((*tokens)[i] >= g->cfg.vocab_size)
                return moe_error(MOE_ERR_CONFIG, "%s: %s encodes it with token %d, outside the model's vocabulary of "
                                                 "%lld",
                                 flag, g->tokenizer_name, (*tokens)[i], (long long)g->cfg.vocab_size);
        return MOE_OK;
    }
    const moe_status st = parse_tokens(tokens, n, g->kind, text, g->cfg.vocab_size, flag);
    if (st == MOE_OK || !g->tokenizer || strspn(text, "0123456789, +-") == strlen(text)) return st;
    char why[512];
    const char *cannot = "";
    moe_tokenizer_can_encode(g->tokenizer, &cannot);
    snprintf(why, sizeof why, "%s", moe_last_error());
    return moe_error(st, "%s (%.600s encodes no text, %s: prompts and --stop are ids)", why, g->tokenizer_name,
                     cannot);
}

/* A Hugging Face model directory's generation_config.json, when it has
 * one, gives the eos (an integer, a list; null or no key: none, as
 * transformers reads it) into *eos, and *source says so; else both stay
 * as they are. */
static moe_status read_generation_eos(moe_token_ids *eos, moe_stop_source *source, const char *dir) {
    char path[4096];
    struct stat sb;
    if (snprintf(path, sizeof path, "%s/generation_config.json", dir) >= (int)sizeof path || stat(path, &sb) != 0)
        return MOE_OK;
    moe_json_doc *doc;
    moe_status st = moe_json_parse_file(&doc, path, MOE_MODEL_CONFIG_MAX_BYTES);
    moe_model_config read = {0}; /* its token ids absent, to take the file's */
    if (st == MOE_OK) {
        st = moe_model_config_take_token_ids(&read, moe_json_root(doc), path);
        moe_json_free(doc);
    }
    if (st != MOE_OK) return moe_error_prefix(st, "--init-from %s: ", dir);
    *eos = read.eos_token_id;
    *source = MOE_STOP_GENERATION_CONFIG;
    return MOE_OK;
}

/* Without --tokenizer, the checkpoint's own tokenizer.json (a Hugging Face
 * model's, or one a run from it kept), when it has one, prints ids as
 * text; one that cannot be read is warned about and the samples stay ids,
 * as nobody asked for it. */
static moe_status find_tokenizer(generation *g, const char *dir, const moe_generate_callbacks *cb) {
    struct stat sb;
    const int n = snprintf(g->tokenizer_path, sizeof g->tokenizer_path, "%s/tokenizer.json", dir);
    if (n < 0 || n >= (int)sizeof g->tokenizer_path || stat(g->tokenizer_path, &sb) != 0) return MOE_OK;
    const moe_status st = moe_tokenizer_open(&g->tokenizer, g->tokenizer_path);
    if (st == MOE_ERR_OUT_OF_MEMORY) return st;
    if (st != MOE_OK && cb->on_warning) {
        char warning[MOE_ERROR_BYTES + 64];
        snprintf(warning, sizeof warning, "%s, so the samples print as ids (--tokenizer names another)",
                 moe_last_error());
        cb->on_warning(cb->ctx, warning);
    }
    snprintf(g->tokenizer_name, sizeof g->tokenizer_name, "%s", g->tokenizer_path);
    return MOE_OK;
}

/* The checkpoint's config, the token kind, the tokenizer, the prompt and
 * the stop token: everything that can be refused before a model exists. */
static moe_status read_inputs(generation *g, const moe_generate_options *o, const moe_generate_callbacks *cb) {
    moe_status st = moe_checkpoint_load_config(&g->cfg, o->init_from, false, cb->on_warning, cb->ctx);
    if (st != MOE_OK) return moe_error_prefix(st, "--init-from %s: ", o->init_from);
    const int64_t V = g->cfg.vocab_size;
    g->n_stops = 0; /* none, unless --stop, the tokenizer's end-of-text or the config's eos */
    /* The tokenizer cannot encode text: with it, prompts are ids. */
    MOE_TRY(choose_tokens(&g->kind, o->tokenizer ? MOE_TOKENS_IDS : o->tokens, V));
    if (o->tokenizer) {
        st = moe_tokenizer_open(&g->tokenizer, o->tokenizer);
        if (st != MOE_OK) return moe_error_prefix(st, "--tokenizer: ");
        snprintf(g->tokenizer_name, sizeof g->tokenizer_name, "--tokenizer %s", o->tokenizer);
    } else if (o->tokens == MOE_TOKENS_AUTO && g->kind == MOE_TOKENS_IDS) {
        MOE_TRY(find_tokenizer(g, o->init_from, cb));
    }
    if (g->tokenizer) {
        char warning[MOE_ERROR_BYTES];
        const int64_t count = moe_tokenizer_count(g->tokenizer);
        const int32_t eot = moe_tokenizer_eot(g->tokenizer);
        /* Fewer tokens than the vocabulary is a padded one; more is another model's. */
        if (count > V && cb->on_warning) {
            snprintf(warning, sizeof warning,
                     "%.900s holds %lld tokens, more than the model's vocabulary of %lld: another model's tokenizer?",
                     g->tokenizer_name, (long long)count, (long long)V);
            cb->on_warning(cb->ctx, warning);
        }
        if (eot >= V && !o->stop && cb->on_warning) {
            snprintf(warning, sizeof warning,
                     "%.900s: its end-of-text %d lies outside the model's vocabulary of %lld, so no sample ends on it",
                     g->tokenizer_name, (int)eot, (long long)V);
            cb->on_warning(cb->ctx, warning);
        }
        /* Its end-of-text ends a sample unless --stop (below) names another. */
        if (eot >= 0 && eot < V) g->stops[g->n_stops++] = eot, g->stop_source = MOE_STOP_TOKENIZER;
    }
    /* Else the checkpoint's eos, as transformers' generate stops there. */
    moe_token_ids eos = g->cfg.eos_token_id;
    moe_stop_source source = MOE_STOP_CONFIG;
    if (g->stop_source == MOE_STOP_NONE && !o->stop) MOE_TRY(read_generation_eos(&eos, &source, o->init_from));
    for (int i = 0; g->stop_source == MOE_STOP_NONE && i < eos.n; i++)
        if (eos.ids[i] >= 0 && eos.ids[i] < V) g->stops[g->n_stops++] = (int32_t)eos.ids[i];
    if (g->stop_source == MOE_STOP_NONE && g->n_stops > 0) g->stop_source = source;
    /* A tokenizer that encodes reads the prompt as text, unless --tokens ids says. */
    g->encodes = g->tokenizer && o->tokens != MOE_TOKENS_IDS && moe_tokenizer_can_encode(g->tokenizer, NULL);
    MOE_TRY(read_tokens(&g->prompt, &g->n_prompt, g, o->prompt, "--prompt"));
    if (g->n_prompt == 0)
        return moe_error(MOE_ERR_CONFIG, "--prompt holds no token, and generation needs one to start from%s",
                         g->kind == MOE_TOKENS_SYNTHETIC
                             ? ": begin with a document's kind, <arithmetic>, <copy>, <brackets> or <markov>"
                             : "");
    if (moe_model_config_drops_pairs(&g->cfg))
        return moe_error(MOE_ERR_UNSUPPORTED,
                         "--init-from %s: generation needs dropless routing, and this model drops past a capacity "
                         "factor of %g (moe_capacity_factor in its config.json)",
                         o->init_from, g->cfg.moe_capacity_factor);
    if (o->stop) {
        int32_t *stop = NULL;
        int64_t n = 0;
        st = read_tokens(&stop, &n, g, o->stop, "--stop");
        if (st == MOE_OK && n != 1) {
            char shown[16 * TOKEN_TEXT_BYTES + 1]; /* its first 16, written as samples are */
            render_tokens(shown, g->kind, NULL, stop, n < 16 ? n : 16);
            st = moe_error(MOE_ERR_CONFIG, "--stop '%s%s' holds %lld tokens; it takes one", shown, n > 16 ? "..." : "",
                           (long long)n);
        }
        if (st == MOE_OK) g->stops[0] = stop[0], g->n_stops = 1, g->stop_source = MOE_STOP_FLAG;
        free(stop);
        MOE_TRY(st);
    }
    if (o->max_new_tokens > g->cfg.max_position_embeddings - g->n_prompt)
        return moe_error(MOE_ERR_CONFIG,
                         "--prompt (%lld tokens) + --max-new-tokens %lld exceed the checkpoint's "
                         "max_position_embeddings %lld (%s/config.json)",
                         (long long)g->n_prompt, (long long)o->max_new_tokens,
                         (long long)g->cfg.max_position_embeddings, o->init_from);
    st = moe_model_check_shape(&g->cfg, o->samples, g->n_prompt + o->max_new_tokens);
    if (st != MOE_OK)
        return moe_error_prefix(st, "--samples %lld of --prompt (%lld tokens) + --max-new-tokens %lld: ",
                                (long long)o->samples, (long long)g->n_prompt, (long long)o->max_new_tokens);
    return MOE_OK;
}

static moe_status generate_body(generation *g, const moe_generate_options *o, const moe_generate_callbacks *cb) {
    MOE_TRY(read_inputs(g, o, cb));
    const int64_t B = o->samples, T = g->n_prompt + o->max_new_tokens;
    MOE_TRY(moe_device_open(&g->device, o->device, 1));
    const moe_model_parallel par = {.ops = g->device.ops, .inference = true, .decode_only = true};
    /* The seed draws initial values the checkpoint then replaces. */
    MOE_TRY(moe_model_create_parallel(&g->model, &g->cfg, B, T, 0, &par));
    moe_status st = moe_checkpoint_load_weights(g->model, o->init_from);
    if (st != MOE_OK) return moe_error_prefix(st, "--init-from %s: ", o->init_from);

    g->rows = malloc((size_t)(B * T) * sizeof *g->rows);
    g->len = malloc((size_t)B * sizeof *g->len);
    g->end = malloc((size_t)B * sizeof *g->end);
    const size_t text_bytes = (size_t)T * (g->tokenizer ? DECODED_TEXT_BYTES : TOKEN_TEXT_BYTES) + 1;
    g->prompt_text = malloc(text_bytes);
    g->new_text = malloc(text_bytes);
    if (!g->rows || !g->len || !g->end || !g->prompt_text || !g->new_text)
        return moe_error(MOE_ERR_OUT_OF_MEMORY, "generation: %lld rows of %lld tokens", (long long)B, (long long)T);
    for (int64_t b = 0; b < B; b++) {
        memcpy(g->rows + b * T, g->prompt, (size_t)g->n_prompt * sizeof *g->prompt);
        g->len[b] = g->n_prompt;
        g->end[b] = T;
    }
    const moe_generate_summary summary = {
        .checkpoint = o->init_from,
        .config = &g->cfg,
        .device = g->device.desc,
        .device_note = g->device.note[0] ? g->device.note : NULL,
        .threads = omp_get_max_threads(),
        .tokens = g->kind,
        .tokens_from_vocab = o->tokens == MOE_TOKENS_AUTO && !g->tokenizer,
        .tokenizer = o->tokenizer ? o->tokenizer : g->tokenizer ? g->tokenizer_path : NULL,
        .tokenizer_found = g->tokenizer && !o->tokenizer,
        .encodes = g->encodes,
        .tokenizer_tokens = g->tokenizer ? moe_tokenizer_count(g->tokenizer) : 0,
        .stops = g->stops,
        .n_stops = g->n_stops,
        .stop_source = g->stop_source,
        .prompt_tokens = g->n_prompt,
        .seq_len = T,
    };
    if (cb->on_start) cb->on_start(cb->ctx, &summary);
    st = moe_generate(g->model, g->rows, g->len, g->end, g->stops, g->n_stops, &o->sampling);
    if (st != MOE_OK) return moe_error_prefix(st, "--init-from %s: ", o->init_from);

    for (int64_t b = 0; b < B; b++) {
        const int32_t *row = g->rows + b * T;
        render_tokens(g->prompt_text, g->kind, g->tokenizer, row, g->n_prompt);
        render_tokens(g->new_text, g->kind, g->tokenizer, row + g->n_prompt, g->len[b] - g->n_prompt);
        const moe_generate_sample sample = {
            .index = b,
            .tokens = row,
            .n = g->len[b],
            .prompt_tokens = g->n_prompt,
            .stopped = g->len[b] > g->n_prompt && stops_at(g->stops, g->n_stops, row[g->len[b] - 1]),
            .prompt_text = g->prompt_text,
            .new_text = g->new_text,
        };
        if (cb->on_sample) cb->on_sample(cb->ctx, &sample);
    }
    return MOE_OK;
}

moe_status moe_generate_run(const moe_generate_options *o, const moe_generate_callbacks *callbacks) {
    MOE_TRY(moe_generate_options_validate(o));
    if (o->threads > 0) omp_set_num_threads(o->threads);
    const moe_generate_callbacks none = {0};
    generation g = {0};
    const moe_status st = generate_body(&g, o, callbacks ? callbacks : &none);
    free_generation(&g);
    return st;
}
