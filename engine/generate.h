/* generate.h: continuing token sequences with a model, greedily or by
 * sampling.
 *
 * Decoding steps (moe_model_decode) read the prompts a chunk of
 * positions at a time, each leaving every layer's keys and values at its
 * positions;
 * each new token is then one decoding step of the rows still growing, at
 * their own positions, against those keys and values. No forward over the
 * model's whole [B, T] batch runs, so a decode-only model
 * (moe_model_parallel.decode_only) serves, whose memory grows with T
 * through the cache alone (a model that recomputes its layers keeps no
 * keys, and runs one forward over the batch per token). Both rest on
 * attention being
 * causal: the logits at position p depend on tokens 0 .. p only, so
 * whatever the positions past a row's end hold changes nothing (but the
 * last bits of some sums, whose order follows how many rows there are).
 * That holds only while routing is dropless: under a capacity factor every
 * position's tokens compete for the experts' slots, padding included, so
 * generation refuses such a model.
 *
 * The B rows of a batch are independent sequences that grow together, one
 * token per row per forward; a row's draws depend on (seed, row, position)
 * only, never on the other rows. */
#ifndef MOE_ENGINE_GENERATE_H
#define MOE_ENGINE_GENERATE_H

#include <stdbool.h>
#include <stdint.h>

#include "engine/device.h"
#include "engine/model.h"
#include "moe.h"

typedef struct moe_sampling {
    double temperature; /* 0: greedy, the most likely token (the lowest id on a tie); else > 0 */
    int64_t top_k;      /* > 0: draw among the top_k most likely tokens only; 0: among all */
    /* In (0, 1): then among the fewest likeliest of those whose
     * probabilities (at the temperature) sum to top_p of theirs, the
     * nucleus; 0 or 1: all of them. */
    double top_p;
    uint64_t seed;
} moe_sampling;

/* Names the field at fault. */
moe_status moe_sampling_validate(const moe_sampling *sampling);

/* The next token after finite logits [V] (the lowest id among equal
 * logits when greedy): draw index `draw` of stream `stream` under
 * sampling, with scratch [V] to rank the tokens in. */
int32_t moe_sample_token(int32_t *scratch, const float *logits, int64_t V, const moe_sampling *sampling,
                         uint64_t stream, uint64_t draw);

/* rows [B, T] in the model's shape: row b starts with len[b] >= 1 tokens
 * (its prompt) and grows until it holds end[b] tokens (len[b] <= end[b] <=
 * T), or until it has just received one of stops [n_stops] (token ids;
 * n_stops 0: none).
 * On return len[b] says how long each row became, and the positions past
 * it hold token 0 (any token would do). The model runs on one rank, and is
 * left in eval mode (moe_model_set_training false: no jitter). */
moe_status moe_generate(moe_model *model, int32_t *rows, int64_t *len, const int64_t *end, const int32_t *stops,
                        int n_stops, const moe_sampling *sampling);

/* What ends a sample of moe_generate_run, unless max_new_tokens does. */
typedef enum moe_stop_source {
    MOE_STOP_NONE = 0,
    MOE_STOP_FLAG,      /* options->stop */
    MOE_STOP_TOKENIZER, /* llm.c's tokenizer file's end-of-text */
    /* The checkpoint's eos_token_id (each id in the vocabulary), as
     * transformers' generate has it: its generation_config.json's when that
     * file gives one (a Hugging Face model's directory), else config.json's. */
    MOE_STOP_CONFIG,
    MOE_STOP_GENERATION_CONFIG,
} moe_stop_source;

/* ------------------------------------------- continuing a checkpoint's prompts */

/* How prompts, stop tokens and results are written. */
typedef enum moe_token_kind {
    MOE_TOKENS_AUTO = 0,  /* from the vocabulary: 54 synthetic, 256 bytes, else ids */
    MOE_TOKENS_SYNTHETIC, /* the synthetic corpus's token texts (moe_synth_parse) */
    MOE_TOKENS_BYTES,     /* one token per byte; printed, and read in prompts and --stop, with \n \t \r \\
                           * and \xNN escapes ('|' printed too), so a backslash is written \\ */
    MOE_TOKENS_IDS        /* token ids, comma-separated */
} moe_token_kind;

/* "auto", "synthetic", "bytes", "ids". */
const char *moe_token_kind_name(moe_token_kind kind);
moe_status moe_token_kind_parse(moe_token_kind *kind, const char *name);

typedef struct moe_generate_options {
    const char *init_from; /* a checkpoint directory: config.json and the weights */
    const char *prompt;    /* at least one token, in the tokens' form */
    int64_t samples;       /* continuations of the prompt, generated together; > 0 */
    int64_t max_new_tokens; /* > 0; fewer when stop comes */
    moe_sampling sampling;
    const char *stop;      /* one token in the prompt's form that ends a sample; NULL: the
                            * tokenizer's end-of-text, else the checkpoint's eos_token_id, else none */
    moe_token_kind tokens;
    /* llm.c's tokenizer file or a tokenizer.json (tokenizer.h); NULL: the
     * checkpoint's tokenizer.json when it has one and the vocabulary takes
     * ids (tokens AUTO), else none. With it the prompt and --stop are text
     * it encodes when it can (moe_tokenizer_can_encode) and tokens is not
     * IDS, else ids (tokens AUTO or IDS); the samples are printed as their
     * bytes, escaped as MOE_TOKENS_BYTES
     * prints them, an id the file does not know (a vocabulary padded past
     * the tokenizer's, 50304 against GPT-2's 50257) as "\<id 50300>"
     * (which no token's escaped bytes can spell); and the file's
     * end-of-text token (version 2's, or GPT-2's in a version-1 file) ends a
     * sample when stop is NULL and the model's vocabulary holds it. A
     * tokenizer larger than the vocabulary is warned about. */
    const char *tokenizer;
    moe_device device;
    int threads;           /* OpenMP (and OpenBLAS) threads; 0: OpenMP's default */
} moe_generate_options;

/* The defaults: 1 sample, 32 new tokens, greedy, seed 1337, no stop,
 * tokens and device auto, OpenMP's thread count. */
void moe_generate_options_init(moe_generate_options *options);

/* Names the flag at fault (--samples, --max-new-tokens, ...). */
moe_status moe_generate_options_validate(const moe_generate_options *options);

/* What a generation runs with, known once the model is loaded. */
typedef struct moe_generate_summary {
    const char *checkpoint;        /* options->init_from */
    const moe_model_config *config;
    const char *device;            /* moe_device_handle.desc */
    const char *device_note;       /* why auto chose the CPU; NULL when it did not */
    int threads;
    moe_token_kind tokens;         /* never AUTO */
    bool tokens_from_vocab;        /* AUTO chose it from config->vocab_size (not for a tokenizer) */
    const char *tokenizer;         /* options->tokenizer, else the checkpoint's tokenizer.json it
                                    * prints with (ids only); NULL: none */
    bool tokenizer_found;          /* it is the checkpoint's, not options->tokenizer */
    bool encodes;                  /* it encoded the prompt and --stop, given as text */
    int64_t tokenizer_tokens;      /* the ids it knows */
    const int32_t *stops;          /* [n_stops] the ids that end a sample */
    int n_stops;
    moe_stop_source stop_source;   /* where they come from */
    int64_t prompt_tokens;
    int64_t seq_len;               /* prompt_tokens + max_new_tokens: the model's T */
} moe_generate_summary;

/* One finished sample; the arrays live until the callback returns. */
typedef struct moe_generate_sample {
    int64_t index;            /* 0 .. samples - 1 */
    const int32_t *tokens;    /* [n]: the prompt's, then the new ones */
    int64_t n;
    int64_t prompt_tokens;
    bool stopped;             /* the last token is the stop token */
    const char *prompt_text;  /* tokens [0, prompt_tokens) in the tokens' form, or decoded by the tokenizer */
    const char *new_text;     /* tokens [prompt_tokens, n) in the same form */
} moe_generate_sample;

typedef struct moe_generate_callbacks {
    void *ctx;
    void (*on_start)(void *ctx, const moe_generate_summary *summary); /* before the first forward */
    void (*on_sample)(void *ctx, const moe_generate_sample *sample);   /* each in order, at the end */
    void (*on_warning)(void *ctx, const char *message);              /* e.g. config.json's unknown keys */
} moe_generate_callbacks;

/* Loads options->init_from's config and weights into a one-rank model on
 * options->device of samples rows of the prompt's length plus
 * max_new_tokens (at most the config's max_position_embeddings), puts the
 * prompt in every row and continues each (moe_generate): row b draws from
 * stream b, so a sample does not depend on how many run beside it.
 * Callbacks may be NULL. Errors name the flag, the checkpoint or the
 * tokenizer file at fault; a prompt's error names the byte or the id that
 * is wrong. */
moe_status moe_generate_run(const moe_generate_options *options, const moe_generate_callbacks *callbacks);

#endif /* MOE_ENGINE_GENERATE_H */
