/* synthetic.h: a built-in, seeded corpus whose true next-token probabilities
 * are known exactly, so a run can be scored against its entropy floor.
 *
 * The stream is a sequence of documents. Each starts with the BOS token of
 * its kind (token id = kind), drawn from the mixture w (kind_weight,
 * normalised), and is followed by a body:
 *
 *  arithmetic  equations "a+b=cc;" with a, b uniform digits and the sum in
 *              two digits ("7+5=12;", "3+4=07;"). After each ';' another
 *              equation follows with probability arith_continue.
 *  copy        letters from a..p, uniform; after each letter the marker '>'
 *              comes with probability copy_stop (always once copy_max_len
 *              letters are out), then the letters again, in order.
 *  brackets    a well-formed word over ( ) [ ] of depth <= dyck_max_depth.
 *              The first bracket opens. At depth 0 afterwards the document
 *              ends with probability dyck_end, else a bracket opens; at depth
 *              0 < d < max one opens with probability dyck_open, else the
 *              innermost open one closes; at the maximum depth it closes. An
 *              opening bracket's type is uniform; a closing one's is forced.
 *  markov      symbols A..P: the first uniform, each next one from a fixed
 *              transition table (moe_synth_markov_table: each symbol has
 *              MOE_SYNTH_MARKOV_SUCCESSORS successors with Dirichlet(1)
 *              weights, from markov_seed, the same for every stream); after
 *              each symbol the document ends with probability markov_end.
 *
 * logp[i] is the natural log of the exact probability of tokens[i] given
 * tokens[0 .. i-1]. The kind is known from the BOS, and every body token
 * belongs to one kind only, so the past determines the generator's state and
 * each probability is one product of the choices above. For example:
 * p(first a after BOS) = 1/10, p(a after ';') = arith_continue/10, p('+') =
 * p('=') = p(sum digits) = p(';') = 1, p(a copied letter) = 1, p(a closing
 * bracket at 0 < d < max) = 1 - dyck_open.
 *
 * Document boundaries: the first token of the stream has p = w_k. Every
 * other BOS has p = P(the previous document ends here | its tokens) * w_k:
 * the end factor is 1 - arith_continue after a ';', 1 after the last copied
 * letter (a copy's end is determined by its length), dyck_end at depth 0,
 * and markov_end after a symbol. There is no end-of-document token; the
 * next BOS is the boundary, and it is tagged with its own document's kind.
 * A stream of n tokens ends wherever the n-th token falls, mid-document if so;
 * every logp stays exact because it conditions only on the past.
 *
 * The floor conditions on the whole past of the stream. A model that sees
 * rows of T tokens cannot recover what lies before its row's first token, so
 * it pays a little more at the start of a row that begins mid-document (a
 * copy whose source is cut off, say); documents are short (mean about 10-20
 * tokens) so that this stays small for T >= 64. */
#ifndef MOE_ENGINE_SYNTHETIC_H
#define MOE_ENGINE_SYNTHETIC_H

#include <stdint.h>

#include "moe.h"

typedef enum moe_synth_kind {
    MOE_SYNTH_ARITH = 0,
    MOE_SYNTH_COPY = 1,
    MOE_SYNTH_BRACKETS = 2,
    MOE_SYNTH_MARKOV = 3,
    MOE_SYNTH_KIND_COUNT
} moe_synth_kind;

#define MOE_SYNTH_LETTERS 16
#define MOE_SYNTH_STATES 16
#define MOE_SYNTH_MARKOV_SUCCESSORS 8
#define MOE_SYNTH_COPY_MAX_LEN 64
#define MOE_SYNTH_DYCK_MAX_DEPTH 16

/* Token ids; a "+" entry is the first of a run. */
enum {
    MOE_SYNTH_TOK_BOS = 0,        /* + kind */
    MOE_SYNTH_TOK_DIGIT = 4,      /* + 0..9 */
    MOE_SYNTH_TOK_PLUS = 14,      /* '+' */
    MOE_SYNTH_TOK_EQUALS = 15,    /* '=' */
    MOE_SYNTH_TOK_SEMICOLON = 16, /* ';' */
    MOE_SYNTH_TOK_OPEN = 17,      /* + type: '(' '[' */
    MOE_SYNTH_TOK_CLOSE = 19,     /* + type: ')' ']' */
    MOE_SYNTH_TOK_LETTER = 21,    /* + 0..15: a..p */
    MOE_SYNTH_TOK_MARK = 37,      /* '>' */
    MOE_SYNTH_TOK_STATE = 38,     /* + 0..15: A..P */
    MOE_SYNTH_VOCAB_SIZE = 54
};

typedef struct moe_synth_params {
    double kind_weight[MOE_SYNTH_KIND_COUNT]; /* >= 0, normalised by their sum */
    double arith_continue;                    /* [0, 1) */
    double copy_stop;                         /* [0, 1] */
    int64_t copy_max_len;                     /* [1, MOE_SYNTH_COPY_MAX_LEN] */
    double dyck_open;                         /* [0, 1] */
    double dyck_end;                          /* (0, 1] */
    int64_t dyck_max_depth;                   /* [1, MOE_SYNTH_DYCK_MAX_DEPTH] */
    double markov_end;                        /* (0, 1] */
    uint64_t markov_seed;                     /* picks the transition table */
} moe_synth_params;

/* The corpus `moe-train` uses by default (floor near 1.4 nats per token). */
moe_synth_params moe_synth_default_params(void);

/* Names the field at fault. */
moe_status moe_synth_params_validate(const moe_synth_params *params);

/* "arithmetic", "copy", "brackets", "markov"; "?" outside the enum. */
const char *moe_synth_kind_name(int kind);

/* "<copy>", "7", "+", "(", "k", ">", "C", ...; "?" outside the vocabulary. */
const char *moe_synth_token_text(int32_t token);

/* The inverse of moe_synth_token_text: text as a sequence of token texts
 * into tokens [capacity], their count in *n. The longest text that matches
 * is taken first ("<copy>" is one token, never '<' and letters); spaces,
 * tabs and newlines between tokens are skipped. A character that starts no
 * token, or a token past capacity, is an error naming its byte offset and
 * the character; tokens and *n are then unspecified. */
moe_status moe_synth_parse(int32_t *tokens, int64_t capacity, int64_t *n, const char *text);

/* P(next = j | current = i) in table [i * MOE_SYNTH_STATES + j]; each row
 * sums to 1 (markov_end is applied on top). */
void moe_synth_markov_table(double *table, const moe_synth_params *params);

typedef struct moe_synth_stream {
    int64_t n;
    int32_t *tokens; /* [n] in [0, MOE_SYNTH_VOCAB_SIZE) */
    uint8_t *kinds;  /* [n] the kind of each token's document */
    float *logp;     /* [n] ln p_true(tokens[i] | tokens[0 .. i-1]) */
} moe_synth_stream;

/* n tokens from (params, seed); the same pair always gives the same stream.
 * Use one seed for training and another for validation. */
moe_status moe_synth_generate(moe_synth_stream *stream, const moe_synth_params *params,
                              uint64_t seed, int64_t n);
void moe_synth_stream_free(moe_synth_stream *stream);

/* Mean of -logp over a set of target tokens, in nats; per kind, the mean over
 * that kind's targets (0 where it has none). */
typedef struct moe_synth_floor {
    double nats;
    int64_t tokens;
    double kind_nats[MOE_SYNTH_KIND_COUNT];
    int64_t kind_tokens[MOE_SYNTH_KIND_COUNT];
} moe_synth_floor;

/* The floor over exactly the targets that n_batches sequential, unshuffled
 * batches of rows x T read from the start of the stream (through
 * moe_data_from_tokens on stream->tokens): tokens 1 .. n_batches*rows*T. With
 * data parallelism, rows is the global batch. Refuses a count that would
 * wrap around the end of the stream, where the reader starts over. */
moe_status moe_synth_floor_of(moe_synth_floor *floor, const moe_synth_stream *stream,
                              int64_t n_batches, int64_t rows, int64_t T);

#endif /* MOE_ENGINE_SYNTHETIC_H */
