/* corpus.h: text encoded into llm.c token shards (data.h) with a
 * tokenizer.json (tokenizer.h), the step before moe-train --data on a
 * corpus of one's own, as llm.c's dev/data scripts take it with tiktoken.
 *
 * Documents: a .jsonl (or .ndjson) file holds one per line, the string under a key
 * ("text" by default: FineWeb's, The Pile's, most corpora's); any other
 * file is one document; "-" is standard input, read as a .jsonl file (a
 * decompressor's output, say). Empty documents (and blank lines) add
 * nothing. Files are read in glob's sorted order, lines in
 * file order, and the shards hold the documents in that order, each
 * document's tokens after its separator: the tokenizer's own special tokens
 * (its post-processor's, as transformers' tokenizer(text) adds them: Llama
 * 3's <|begin_of_text|>, Llama's and Mixtral's <s>) when it adds any, else
 * <|endoftext|> when that is one token (GPT-2's, Qwen's, OLMoE's, as llm.c
 * puts GPT-2's before each document), unless the caller names a separator
 * (or none), which replaces them. Each
 * document is encoded as moe_tokenizer_encode encodes text: added tokens
 * wherever they stand in it.
 *
 * Shards: PREFIX_val_NNNNNN.bin first, then PREFIX_train_NNNNNN.bin, one
 * index counting through both (llm.c's fineweb_val_000000.bin,
 * fineweb_train_000001.bin, ...), each of shard_tokens tokens but a split's
 * last; uint16 tokens when the tokenizer's ids fit, else uint32 (llm.c's
 * Llama 3 shards). The validation split is the first documents, whole,
 * until it holds val_tokens or more.
 *
 * Nothing that was there is lost or half-replaced by a run that fails: the
 * shards are written into a folder PREFIX.partial-XXXXXX beside them, and
 * once every one is written the old shards (a prefix that has any is
 * refused unless overwrite) move into it, as old-NAME, and the new ones
 * into place, all or none: a failure moves back what moved. The folder is
 * removed at the end, old shards and all. A process killed leaves it, and
 * when killed while the shards move, a mix of both corpora in place: the
 * next run into the prefix warns of such a folder. */
#ifndef MOE_ENGINE_CORPUS_H
#define MOE_ENGINE_CORPUS_H

#include <stdbool.h>
#include <stdint.h>

#include "moe.h"

/* llm.c's shard size (fineweb.py's shard_size). */
#define MOE_CORPUS_SHARD_TOKENS_DEFAULT 100000000LL
/* The longest document read, in bytes: a file past it is refused, naming
 * it, rather than held whole in memory with its tokens. */
#define MOE_CORPUS_DOCUMENT_MAX_BYTES ((int64_t)1 << 30)

typedef struct moe_corpus_options {
    const char *tokenizer; /* a tokenizer.json that encodes text (required) */
    const char *input;     /* glob(3) pattern of the text files, or "-" (required) */
    const char *text_key;  /* the key of a .jsonl line's document */
    /* The text of the one token before every document; NULL: the default
     * above; "": none. */
    const char *separator;
    const char *out;      /* the shards' path prefix */
    int64_t shard_tokens; /* 1 .. INT32_MAX */
    int64_t val_tokens;   /* >= 0; 0: no validation split */
    bool overwrite;
    int threads; /* OpenMP threads; 0: OpenMP's default */
} moe_corpus_options;

/* The defaults: text_key "text", out "data/tokens", shard_tokens
 * MOE_CORPUS_SHARD_TOKENS_DEFAULT, the rest 0, false or NULL. */
void moe_corpus_options_init(moe_corpus_options *options);

/* Names the field at fault (MOE_ERR_CONFIG). */
moe_status moe_corpus_options_validate(const moe_corpus_options *options);

typedef struct moe_corpus_plan {
    int64_t tokenizer_tokens; /* ids 0 .. tokenizer_tokens - 1 */
    int token_bytes;          /* 2 (uint16) or 4 (uint32) */
    int64_t files;            /* that input matched */
    /* What each document's tokens come with: the one separator before it,
     * or (separator_from_tokenizer) the special tokens the tokenizer wraps
     * every text in, as they stand around an empty one. */
    int32_t separator[8];
    int n_separator;
    bool separator_from_tokenizer;
    int threads;
} moe_corpus_plan;

typedef struct moe_corpus_totals {
    int64_t documents, empty_documents; /* empty ones add nothing */
    int64_t text_bytes;
    int64_t val_tokens, train_tokens;
    int64_t val_shards, train_shards;
    double seconds;
} moe_corpus_totals;

typedef struct moe_corpus_callbacks {
    void *ctx;
    void (*on_start)(void *ctx, const moe_corpus_plan *plan);
    /* A shard written (into the staging folder; path is its final name). */
    void (*on_shard)(void *ctx, const char *path, int64_t tokens);
    void (*on_warning)(void *ctx, const char *message);
} moe_corpus_callbacks;

/* Encodes options' input into shards, as above. Errors name the file (and
 * the .jsonl line) at fault; MOE_ERR_CONFIG for what no retry mends (text
 * that is not UTF-8, a line that is no JSON object with a string under the
 * key or no JSON at all, shards already there, a split that leaves no
 * training tokens). */
moe_status moe_corpus_tokenize(const moe_corpus_options *options, const moe_corpus_callbacks *callbacks,
                               moe_corpus_totals *totals);

/* The documents input names (a file or a glob, as --input; the text key
 * "text", the default separator) encoded by tokenizer into one stream of
 * ids [*n] in memory (free() it): the tokens moe_corpus_tokenize's shards
 * hold without a validation split. */
moe_status moe_corpus_encode(int32_t **tokens, int64_t *n, const char *tokenizer, const char *input);

#endif /* MOE_ENGINE_CORPUS_H */
