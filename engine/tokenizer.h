/* tokenizer.h: llm.c's tokenizer file (gpt2_tokenizer.bin, written by its
 * data scripts), which gives each token id its bytes, so that ids a model
 * trained on llm.c's GPT-2 token shards generates can be shown as text.
 *
 * The file: a header of 256 little-endian uint32 (magic 20240328; version
 * 1 or 2; the token count; in version 2 the end-of-text token's id, in
 * version 1 none: GPT-2's last token when it has GPT-2's count), then for each token id in order one uint8 length (>= 1)
 * and that many bytes. A token's bytes need not be valid UTF-8 on their
 * own: GPT-2's byte-level BPE splits characters between tokens. The file
 * holds no merges, so it decodes ids and cannot encode text. */
#ifndef MOE_ENGINE_TOKENIZER_H
#define MOE_ENGINE_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

#include "moe.h"

#define MOE_TOKENIZER_MAGIC 20240328
/* GPT-2's tokens; the last, 50256, is its end-of-text. */
#define MOE_TOKENIZER_GPT2_TOKENS 50257
#define MOE_TOKENIZER_HEADER_BYTES 1024
/* The longest token a uint8 length can give, in bytes. */
#define MOE_TOKENIZER_TOKEN_BYTES_MAX 255
/* More tokens than any published vocabulary holds (GPT-2 50257, Llama 3
 * 128256, Gemma 256000): a count past it is a corrupt header, refused
 * before the file is read whole. */
#define MOE_TOKENIZER_TOKENS_MAX (1 << 20)

typedef struct moe_tokenizer moe_tokenizer;

/* Reads and checks path whole: its size against the header, the magic, the
 * version, the count (1 .. MOE_TOKENIZER_TOKENS_MAX), every token's length
 * (>= 1, within the file), no bytes past the last token, and the
 * end-of-text id below the count. Errors name path and the fault, with its
 * offset in the file. */
moe_status moe_tokenizer_open(moe_tokenizer **tokenizer, const char *path);

void moe_tokenizer_close(moe_tokenizer *tokenizer);

/* The number of token ids it knows: 0 .. count - 1. */
int64_t moe_tokenizer_count(const moe_tokenizer *tokenizer);

/* The end-of-text token's id (version 2's; version 1's GPT-2 file, 50257
 * tokens, 50256), or -1 (any other version 1 file names none). */
int32_t moe_tokenizer_eot(const moe_tokenizer *tokenizer);

/* id's bytes [*n] (1 .. 255 of them, not NUL-terminated), which live until
 * the tokenizer is closed; NULL when the tokenizer does not know id (as a
 * model's vocabulary padded past it, 50304 against GPT-2's 50257, holds). */
const unsigned char *moe_tokenizer_bytes(const moe_tokenizer *tokenizer, int64_t id, size_t *n);

#endif /* MOE_ENGINE_TOKENIZER_H */
