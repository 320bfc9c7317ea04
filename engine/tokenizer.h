/* tokenizer.h: a tokenizer's id -> bytes table, so that the ids a model
 * generates can be shown as text: llm.c's tokenizer file
 * (gpt2_tokenizer.bin, written by its data scripts) or a Hugging Face
 * tokenizer.json (Qwen's, OLMoE's, Llama's, Mistral's), told apart by the
 * file's first byte ('{' begins a tokenizer.json).
 *
 * A tokenizer.json gives each id its token in model.vocab (an object of
 * token -> id, or Unigram's list of [token, score] in id order) and in
 * added_tokens (whose content replaces a vocabulary token of the same id);
 * the decoder says how a token spells bytes, as transformers' tokenizers
 * decodes it one token at a time: ByteLevel (GPT-2's, Qwen's, Llama 3's)
 * maps each character back to the byte GPT-2's bytes_to_unicode gave it,
 * and keeps a token with a character outside that alphabet (an added
 * token's) as it is, whole;
 * SentencePiece's Metaspace, or a Sequence that replaces U+2581 with a
 * space (Mistral's, Llama 2's), writes that character as a space and,
 * with ByteFallback, a token <0xNN> as that byte (the space a whole
 * decode strips before its first token stays). Ids no token has print as
 * unknown; no end-of-text is read from it (the model's config names its
 * eos).
 *
 * llm.c's file: a header of 256 little-endian uint32 (magic 20240328; version
 * 1 or 2; the token count; in version 2 the end-of-text token's id, in
 * version 1 none: GPT-2's last token when it has GPT-2's count), then for each token id in order one uint8 length (>= 1)
 * and that many bytes. A token's bytes need not be valid UTF-8 on their
 * own: GPT-2's byte-level BPE splits characters between tokens. The file
 * holds no merges, so it decodes ids and cannot encode text. */
#ifndef MOE_ENGINE_TOKENIZER_H
#define MOE_ENGINE_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "moe.h"

#define MOE_TOKENIZER_MAGIC 20240328
/* GPT-2's tokens; the last, 50256, is its end-of-text. */
#define MOE_TOKENIZER_GPT2_TOKENS 50257
#define MOE_TOKENIZER_HEADER_BYTES 1024
/* The longest token llm.c's uint8 length can give, in bytes. */
#define MOE_TOKENIZER_TOKEN_BYTES_MAX 255
/* The longest token any tokenizer here decodes to, in bytes: a
 * tokenizer.json with a longer one is refused. */
#define MOE_TOKENIZER_DECODED_BYTES_MAX 1024
/* The largest tokenizer.json read (Llama 3's is 9 MB, Qwen's 11 MB). */
#define MOE_TOKENIZER_JSON_MAX_BYTES ((size_t)256 << 20)
/* More tokens than any published vocabulary holds (GPT-2 50257, Llama 3
 * 128256, Gemma 256000): a count past it is a corrupt header, refused
 * before the file is read whole. */
#define MOE_TOKENIZER_TOKENS_MAX (1 << 20)

typedef struct moe_tokenizer moe_tokenizer;

/* Reads and checks path whole. llm.c's file: its size against the header,
 * the magic, the version, the count (1 .. MOE_TOKENIZER_TOKENS_MAX), every
 * token's length (>= 1, within the file), no bytes past the last token,
 * and the end-of-text id below the count. A tokenizer.json: valid JSON,
 * ids in [0, MOE_TOKENIZER_TOKENS_MAX), none given twice, a decoder of the
 * kinds above, every token spelling bytes under it. Errors name path and
 * the fault, with its offset in llm.c's file or the token in a
 * tokenizer.json. */
moe_status moe_tokenizer_open(moe_tokenizer **tokenizer, const char *path);

/* Whether path reads as a tokenizer.json to moe_tokenizer_open: its first
 * byte after any spaces, tabs and line ends '{' (or a UTF-8 byte order
 * mark's). */
bool moe_tokenizer_file_is_json(const char *path);

void moe_tokenizer_close(moe_tokenizer *tokenizer);

/* The number of token ids it knows: 0 .. count - 1. */
int64_t moe_tokenizer_count(const moe_tokenizer *tokenizer);

/* The end-of-text token's id (version 2's; version 1's GPT-2 file, 50257
 * tokens, 50256), or -1 (any other version 1 file, and a tokenizer.json,
 * names none). */
int32_t moe_tokenizer_eot(const moe_tokenizer *tokenizer);

/* id's bytes [*n] (1 .. MOE_TOKENIZER_DECODED_BYTES_MAX of them, not
 * NUL-terminated), which live until the tokenizer is closed; NULL when the
 * tokenizer does not know id (as a model's vocabulary padded past it,
 * 50304 against GPT-2's 50257, holds). */
const unsigned char *moe_tokenizer_bytes(const moe_tokenizer *tokenizer, int64_t id, size_t *n);

/* Whether it encodes text: a tokenizer.json of a BPE model, byte-level
 * (Qwen's, Llama 3's, OLMoE's, GPT-2's: GPT-2's, Llama 3's or Qwen2's
 * pre-tokenizer, no normalizer or NFC) or SentencePiece-style (Mixtral's,
 * Mistral's, Llama 2's: a Prepend of U+2581 and a Replace of spaces by it
 * as the normalizer, or a Metaspace pre-tokenizer); else *why (may be
 * NULL) says why not. */
bool moe_tokenizer_can_encode(const moe_tokenizer *tokenizer, const char **why);

/* text, UTF-8, into ids [*n] (free() them), as transformers' tokenizers
 * encodes it: with special, the post-processor's special tokens (Llama 3's
 * begin-of-text, Llama's <s>); added tokens wherever they stand, each by
 * its content as the JSON spells it; the text between the added tokens
 * not normalized normalized (NFC, of the Unicode version tokenizers knows:
 * unicode.h; spaces as U+2581, one before), and in it the normalized ones
 * by their normalized content; the rest pre-tokenized (the patterns'
 * classes of every code point as tokenizers reads them; Metaspace's
 * U+2581) and each word merged by BPE, characters outside the vocabulary
 * as ByteFallback's <0xNN> tokens, else the unknown token. Text that is
 * not UTF-8 is refused, naming the byte. */
moe_status moe_tokenizer_encode(const moe_tokenizer *tokenizer, const char *text, bool special, int32_t **ids,
                                int64_t *n);

#endif /* MOE_ENGINE_TOKENIZER_H */
