/* tokenizer.c: reading llm.c's tokenizer file and Hugging Face's
 * tokenizer.json (tokenizer.h). */
#include "engine/tokenizer.h"

#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"
#include "engine/fileio.h"
#include "engine/json.h"
#include "engine/unicode.h"

/* A tokenizer.json's pre-tokenizers that encoding implements: of a
 * byte-level BPE, by their patterns, GPT-2's (ByteLevel's use_regex),
 * Llama 3's and Qwen2's (a Split before a ByteLevel); of a
 * SentencePiece-style one (Mistral's, Mixtral's, Llama 2's), none (the
 * text between added tokens is one word) or Metaspace. PRE_NONE: it
 * encodes no text. */
typedef enum pretokenizer { PRE_NONE, PRE_GPT2, PRE_LLAMA3, PRE_QWEN2, PRE_WORD, PRE_METASPACE } pretokenizer;

/* Where Metaspace puts U+2581 before a word: never, at the start of the
 * text only, or before every piece of text (unless there already). */
typedef enum prepend_scheme { PREPEND_NEVER, PREPEND_FIRST, PREPEND_ALWAYS } prepend_scheme;

/* U+2581, which SentencePiece-style vocabularies spell a space with. */
static const char MARK[] = "\xE2\x96\x81";

/* An open-addressing table from 64-bit keys to two int32 values. */
typedef struct table {
    uint64_t *keys; /* 0: empty; keys are stored + 1 */
    int32_t *a, *b;
    size_t cap; /* a power of two */
} table;

/* An added token as encoding matches it: by its content as the JSON
 * spells it (not as the decoder does), a normalized one (matched in
 * normalized text) normalized too. */
typedef struct added_token {
    int32_t id;
    bool normalized;
    unsigned char *form; /* [len] */
    size_t len;
} added_token;

/* What encoding text needs, for a tokenizer.json that can: see
 * moe_tokenizer_can_encode. */
typedef struct encoder {
    pretokenizer pre;
    prepend_scheme prepend; /* Metaspace's */
    bool split;             /* Metaspace's: a word begins at each U+2581 */
    bool ignore_merges;     /* a word in the vocabulary is its token, merges or not */
    bool nfc;               /* the normalizer: NFC, */
    bool spaces_to_marks;   /* Replace ' ' by U+2581, */
    bool prepend_mark;      /* Prepend U+2581 (to text between added tokens) */
    bool fuse_unk;          /* unknown characters in a row are one unk */
    int32_t unk;            /* model.unk_token's id; -1: none, an unknown character is dropped */
    int32_t byte_token[256]; /* byte_fallback's <0xNN>; -1: none */
    uint32_t byte_char[256]; /* ByteLevel's character of each byte */
    unsigned char *spelling; /* model.vocab's tokens as the JSON spells them, which BPE reads */
    int64_t *spelling_at;    /* [count] where each begins */
    int32_t *spelling_len;   /* [count] how many bytes; 0: not in model.vocab */
    table vocab;             /* a hash of a token's spelling -> its id, chained by probing */
    table merges;            /* (left id, right id) -> (rank, merged id) */
    added_token *added;  /* [n_added] matched in the text first; the normalized ones second, in the text between */
    int n_added;
    int added_from[257]; /* added [added_from[b], added_from[b + 1]): those whose form begins with byte b */
    int32_t before[4], after[4]; /* the post-processor's special tokens around the text */
    int n_before, n_after;
} encoder;

struct moe_tokenizer {
    unsigned char *data; /* every token's bytes: llm.c's whole file, or a tokenizer.json's tokens decoded */
    int64_t *at;         /* [count] where in data each token's bytes begin */
    int32_t *len;        /* [count] how many; 0: no token has the id */
    int64_t count;
    int32_t eot;         /* -1: none */
    encoder enc;         /* enc.pre PRE_NONE: it encodes no text, why_not says why */
    char why_not[256];
};

/* The file's header checked, and *count and *eot from it; size is the
 * file's. */
static moe_status check_header(int64_t *count, int32_t *eot, const unsigned char *data, size_t size,
                               const char *path) {
    if (size < MOE_TOKENIZER_HEADER_BYTES)
        return moe_error(MOE_ERR_FORMAT, "%s: %zu bytes, shorter than the %d-byte tokenizer header (truncated?)",
                         path, size, MOE_TOKENIZER_HEADER_BYTES);
    const uint32_t magic = moe_get_le32(data), version = moe_get_le32(data + 4);
    const uint32_t n = moe_get_le32(data + 8), end_of_text = moe_get_le32(data + 12);
    if (magic != MOE_TOKENIZER_MAGIC)
        return moe_error(MOE_ERR_FORMAT, "%s: magic %u at offset 0, expected %d (an llm.c tokenizer file, "
                         "gpt2_tokenizer.bin)", path, magic, MOE_TOKENIZER_MAGIC);
    if (version != 1 && version != 2)
        return moe_error(MOE_ERR_FORMAT, "%s: version %u at offset 4, expected 1 or 2", path, version);
    if (n == 0 || n > MOE_TOKENIZER_TOKENS_MAX)
        return moe_error(MOE_ERR_FORMAT, "%s: the header says %u tokens (offset 8), expected 1 to %d", path, n,
                         MOE_TOKENIZER_TOKENS_MAX);
    /* Version 1 files predate the field (their header holds 0 there), and
     * were GPT-2's, whose end-of-text is its last token, as llm.c reads them. */
    if (version == 2 && end_of_text >= n)
        return moe_error(MOE_ERR_FORMAT, "%s: end-of-text token %u (offset 12) is not below the %u tokens", path,
                         end_of_text, n);
    *count = n;
    *eot = version == 2 ? (int32_t)end_of_text : n == MOE_TOKENIZER_GPT2_TOKENS ? (int32_t)n - 1 : -1;
    return MOE_OK;
}

/* Every token's bytes into at and len [count], each length checked
 * against the file's end, and no byte left after the last token. */
static moe_status find_tokens(int64_t *at, int32_t *lens, int64_t count, const unsigned char *data, size_t size,
                              const char *path) {
    size_t off = MOE_TOKENIZER_HEADER_BYTES;
    for (int64_t id = 0; id < count; id++) {
        if (off == size)
            return moe_error(MOE_ERR_FORMAT, "%s: the file ends at token %lld's length (offset %zu), and the "
                             "header says %lld tokens (truncated?)", path, (long long)id, off, (long long)count);
        const unsigned len = data[off];
        if (len == 0)
            return moe_error(MOE_ERR_FORMAT, "%s: token %lld has length 0 (offset %zu); every token has a byte",
                             path, (long long)id, off);
        if (len > size - off - 1)
            return moe_error(MOE_ERR_FORMAT, "%s: token %lld's %u bytes run past the end of the file (offset %zu, "
                             "%zu bytes; truncated?)", path, (long long)id, len, off + 1, size);
        at[id] = (int64_t)off + 1;
        lens[id] = (int32_t)len;
        off += 1 + len;
    }
    if (off != size)
        return moe_error(MOE_ERR_FORMAT, "%s: %zu byte%s left over after the %lld tokens (offset %zu): a wrong "
                         "count or trailing bytes", path, size - off, size - off == 1 ? "" : "s", (long long)count, off);
    return MOE_OK;
}

/* ------------------------------------------------------------ tokenizer.json */

/* How a tokenizer.json's decoder spells a vocabulary token's bytes. */
typedef enum spelling { BYTE_LEVEL, METASPACE } spelling;

typedef struct json_reader {
    const char *path;
    spelling spell;
    bool byte_fallback;            /* the decoder's ByteFallback: a token <0xNN> is that byte */
    int16_t byte_of[0x100 + 0x44]; /* ByteLevel: the byte of each character below 0x144; -1: none */
    unsigned char *data;           /* the decoded tokens, appended */
    size_t used, cap;
} json_reader;

/* GPT-2's bytes_to_unicode, inverted: bytes '!'..'~', 0xA1..0xAC and
 * 0xAE..0xFF are their own characters; the other 68 are U+0100 on, in
 * order. */
static void byte_level_table(int16_t *byte_of) {
    for (int c = 0; c < 0x144; c++) byte_of[c] = -1;
    int next = 0x100;
    for (int b = 0; b < 0x100; b++) {
        const bool own = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
        byte_of[own ? b : next++] = (int16_t)b;
    }
}

/* The code point of the UTF-8 sequence at s (valid: the JSON reader
 * checked it), and its length in *n. */
static uint32_t code_point(const unsigned char *s, size_t *n) {
    if (s[0] < 0x80) return *n = 1, s[0];
    if (s[0] < 0xE0) return *n = 2, (uint32_t)(s[0] & 0x1F) << 6 | (s[1] & 0x3F);
    if (s[0] < 0xF0) return *n = 3, (uint32_t)(s[0] & 0x0F) << 12 | (uint32_t)(s[1] & 0x3F) << 6 | (s[2] & 0x3F);
    *n = 4;
    return (uint32_t)(s[0] & 0x07) << 18 | (uint32_t)(s[1] & 0x3F) << 12 | (uint32_t)(s[2] & 0x3F) << 6 | (s[3] & 0x3F);
}

static moe_status append(json_reader *r, const void *bytes, size_t n) {
    if (r->used + n > r->cap) {
        size_t cap = r->cap ? 2 * r->cap : 1 << 16;
        while (cap < r->used + n) cap *= 2;
        unsigned char *data = realloc(r->data, cap);
        if (!data) return moe_error(MOE_ERR_OUT_OF_MEMORY, "%s: out of memory", r->path);
        r->data = data;
        r->cap = cap;
    }
    memcpy(r->data + r->used, bytes, n);
    r->used += n;
    return MOE_OK;
}

static bool hex_digit(unsigned char c) {
    return (c >= '0' && c <= '9') || (c >= 'A' && c <= 'F') || (c >= 'a' && c <= 'f');
}

/* Appends the bytes token text [n] spells under the decoder, as
 * transformers' tokenizers decodes it, an added token's content too. */
static moe_status spell(json_reader *r, const char *text, size_t n) {
    const unsigned char *s = (const unsigned char *)text;
    if (r->spell == METASPACE) {
        if (r->byte_fallback && n == 6 && memcmp(s, "<0x", 3) == 0 && hex_digit(s[3]) && hex_digit(s[4]) && s[5] == '>') {
            const unsigned char b = (unsigned char)strtoul(text + 3, NULL, 16);
            return append(r, &b, 1);
        }
        for (size_t i = 0; i < n;) {
            const bool space = n - i >= 3 && memcmp(s + i, "\xE2\x96\x81", 3) == 0; /* U+2581 */
            MOE_TRY(append(r, space ? " " : (const char *)s + i, 1));
            i += space ? 3 : 1;
        }
        return MOE_OK;
    }
    /* A token with a character outside the alphabet (an added token's)
     * stays as it is, all of it, as tokenizers' ByteLevel keeps it. */
    for (size_t i = 0, len; i < n; i += len) {
        const uint32_t c = code_point(s + i, &len);
        if (c >= 0x144 || r->byte_of[c] < 0) return append(r, s, n);
    }
    for (size_t i = 0, len; i < n; i += len) {
        const unsigned char b = (unsigned char)r->byte_of[code_point(s + i, &len)];
        MOE_TRY(append(r, &b, 1));
    }
    return MOE_OK;
}

static bool type_is(const moe_json *v, const char *type) {
    const char *t = moe_json_text(moe_json_get(v, "type"));
    return t && strcmp(t, type) == 0;
}

/* r's spelling from the decoder object d: ByteLevel, Metaspace, or a
 * Sequence holding ByteLevel or a Replace of U+2581 by a space, with
 * ByteFallback, Fuse and Strip beside it. */
static moe_status read_decoder(json_reader *r, const moe_json *d) {
    const char *type = moe_json_text(moe_json_get(d, "type"));
    bool known = false;
    if (type && strcmp(type, "ByteLevel") == 0) r->spell = BYTE_LEVEL, known = true;
    if (type && strcmp(type, "Metaspace") == 0) {
        const char *with = moe_json_text(moe_json_get(d, "replacement"));
        if (with && strcmp(with, "\xE2\x96\x81") != 0)
            return moe_error(MOE_ERR_FORMAT, "%s: decoder Metaspace replaces \"%s\": only U+2581 is read", r->path,
                             with);
        r->spell = METASPACE, known = true;
    }
    const moe_json *parts = type && strcmp(type, "Sequence") == 0 ? moe_json_get(d, "decoders") : NULL;
    for (size_t i = 0; parts && parts->type == MOE_JSON_ARRAY && i < parts->array.count; i++) {
        const moe_json *p = &parts->array.items[i];
        const moe_json *pattern = moe_json_get(moe_json_get(p, "pattern"), "String");
        const char *from = moe_json_text(pattern), *to = moe_json_text(moe_json_get(p, "content"));
        if (type_is(p, "ByteLevel")) {
            r->spell = BYTE_LEVEL, known = true;
        } else if (type_is(p, "Replace") && from && to && strcmp(from, "\xE2\x96\x81") == 0 && strcmp(to, " ") == 0) {
            r->spell = METASPACE, known = true;
        } else if (type_is(p, "Metaspace")) {
            MOE_TRY(read_decoder(r, p));
            known = true;
        } else if (type_is(p, "ByteFallback")) {
            r->byte_fallback = true;
        } else if (!type_is(p, "Fuse") && !type_is(p, "Strip")) {
            const char *t = moe_json_text(moe_json_get(p, "type"));
            return moe_error(MOE_ERR_FORMAT, "%s: decoder %s's part %zu is %s, which is not read (ByteLevel, Metaspace, "
                                             "Replace U+2581, ByteFallback, Fuse and Strip are)",
                             r->path, type, i, t ? t : "no decoder");
        }
    }
    if (!known)
        return moe_error(MOE_ERR_FORMAT, "%s: decoder %s is not read (ByteLevel, Metaspace, or a Sequence of them)",
                         r->path, type ? type : "(none)");
    return MOE_OK;
}

/* id read from v into *id, checked to lie in [0, MOE_TOKENIZER_TOKENS_MAX). */
static moe_status read_id(int64_t *id, const moe_json *v, const json_reader *r, const char *what) {
    if (moe_json_int64(v, id) != MOE_OK || *id < 0 || *id >= MOE_TOKENIZER_TOKENS_MAX)
        return moe_error(MOE_ERR_FORMAT, "%s: %s has id %s, not an integer in [0, %d)", r->path, what,
                         v && v->type == MOE_JSON_NUMBER ? v->number.text : "(none)", MOE_TOKENIZER_TOKENS_MAX);
    return MOE_OK;
}

/* Token id's text [n] into t, spelled by the decoder; an added token's
 * (added true) replaces what the vocabulary gave its id. An id that two
 * vocabulary tokens, or two added tokens, share is refused; taken [count]
 * marks the ids added tokens took. */
static moe_status put_token(moe_tokenizer *t, json_reader *r, unsigned char *taken, int64_t id, const char *text,
                            size_t n, bool added) {
    if (t->len[id] > 0 && (!added || taken[id]))
        return moe_error(MOE_ERR_FORMAT, "%s: id %lld is given to two %s", r->path, (long long)id,
                         added ? "added tokens" : "tokens");
    const size_t before = r->used;
    MOE_TRY(spell(r, text, n));
    const size_t len = r->used - before;
    if (len == 0 || len > MOE_TOKENIZER_DECODED_BYTES_MAX)
        return moe_error(MOE_ERR_FORMAT, "%s: token %lld spells %zu bytes, not 1 to %d", r->path, (long long)id, len,
                         MOE_TOKENIZER_DECODED_BYTES_MAX);
    t->at[id] = (int64_t)before;
    t->len[id] = (int32_t)len;
    taken[id] |= added;
    return MOE_OK;
}

/* ------------------------------------------------------------------ encoding */

static uint64_t mix(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    return x ^ (x >> 33);
}

static bool table_init(table *h, size_t n) {
    h->cap = 16;
    while (h->cap < 2 * n) h->cap *= 2;
    h->keys = calloc(h->cap, sizeof *h->keys);
    h->a = malloc(h->cap * sizeof *h->a);
    h->b = malloc(h->cap * sizeof *h->b);
    return h->keys && h->a && h->b;
}

/* Adds (key, a, b) at key's first free slot: keys may repeat (a hash of
 * bytes), and a lookup walks them all. */
static void table_add(table *h, uint64_t key, int32_t a, int32_t b) {
    size_t i = mix(key) & (h->cap - 1);
    while (h->keys[i]) i = (i + 1) & (h->cap - 1);
    h->keys[i] = key + 1;
    h->a[i] = a;
    h->b[i] = b;
}

/* The slot of key's first entry at or after probe step *i (start at
 * SIZE_MAX), or false when none is left. */
static bool table_next(const table *h, uint64_t key, size_t *i) {
    *i = *i == SIZE_MAX ? mix(key) & (h->cap - 1) : (*i + 1) & (h->cap - 1);
    for (; h->keys[*i]; *i = (*i + 1) & (h->cap - 1))
        if (h->keys[*i] == key + 1) return true;
    return false;
}

/* FNV-1a of n more bytes onto x. */
static uint64_t fnv(uint64_t x, const void *bytes, size_t n) {
    const unsigned char *p = bytes;
    for (size_t i = 0; i < n; i++) x = (x ^ p[i]) * 0x100000001b3ULL;
    return x;
}

static const uint64_t FNV_BASIS = 0xcbf29ce484222325ULL;

/* The token of model.vocab (no added one) spelled p [n] then q [m]; -1:
 * none. */
static int32_t spelled_id(const encoder *e, const void *p, size_t n, const void *q, size_t m) {
    const uint64_t key = fnv(fnv(FNV_BASIS, p, n), q, m) >> 1; /* + 1 never wraps to the empty key */
    for (size_t i = SIZE_MAX; table_next(&e->vocab, key, &i);) {
        const int32_t id = e->vocab.a[i];
        const unsigned char *s = e->spelling + e->spelling_at[id];
        if ((size_t)e->spelling_len[id] == n + m && memcmp(s, p, n) == 0 && (m == 0 || memcmp(s + n, q, m) == 0))
            return id;
    }
    return -1;
}

static int32_t vocab_id(const encoder *e, const void *p, size_t n) { return spelled_id(e, p, n, NULL, 0); }

/* The token spelled as a's then b's spelling; -1: none. */
static int32_t merged_id(const encoder *e, int32_t a, int32_t b) {
    return spelled_id(e, e->spelling + e->spelling_at[a], (size_t)e->spelling_len[a], e->spelling + e->spelling_at[b],
                      (size_t)e->spelling_len[b]);
}

static uint64_t pair_key(int32_t left, int32_t right) { return (uint64_t)(uint32_t)left << 31 | (uint32_t)right; }

/* Llama 3's and Qwen2's Split patterns, as their tokenizer.json files hold them. */
static const char LLAMA3_PATTERN[] = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+"
                                     "[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
static const char QWEN2_PATTERN[] = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+"
                                    "[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

static bool is_true(const moe_json *v) { return v && v->type == MOE_JSON_BOOL && v->boolean; }
static bool is_set(const moe_json *v) {
    return v && v->type != MOE_JSON_NULL && !(v->type == MOE_JSON_STRING && v->string.len == 0) &&
           !(v->type == MOE_JSON_BOOL && !v->boolean);
}

/* The pre-tokenizer p into e (e->pre PRE_NONE: one encoding does not
 * implement); *prefix_space: ByteLevel's add_prefix_space. */
static void read_pretokenizer(encoder *e, const moe_json *p, bool *prefix_space) {
    e->pre = PRE_NONE;
    if (!p || p->type == MOE_JSON_NULL) {
        e->pre = PRE_WORD;
        return;
    }
    if (type_is(p, "Metaspace")) {
        /* As tokenizers 0.23 reads it: prepend_scheme, always when absent,
         * add_prefix_space false only beside never; split true when absent
         * or null. */
        const char *with = moe_json_text(moe_json_get(p, "replacement"));
        const moe_json *scheme_value = moe_json_get(p, "prepend_scheme"), *add = moe_json_get(p, "add_prefix_space");
        const moe_json *split = moe_json_get(p, "split");
        const char *scheme = moe_json_text(scheme_value);
        const bool no_split = split && split->type == MOE_JSON_BOOL && !split->boolean;
        if (!with || strcmp(with, MARK) != 0 || (scheme_value && !scheme) || (add && add->type != MOE_JSON_BOOL) ||
            (split && split->type != MOE_JSON_BOOL && split->type != MOE_JSON_NULL))
            return;
        if (!scheme || strcmp(scheme, "always") == 0) e->prepend = PREPEND_ALWAYS;
        else if (strcmp(scheme, "first") == 0) e->prepend = PREPEND_FIRST;
        else if (strcmp(scheme, "never") == 0) e->prepend = PREPEND_NEVER;
        else return;
        if (add && !add->boolean && e->prepend != PREPEND_NEVER) return; /* tokenizers refuses the file */
        e->split = !no_split;
        e->pre = PRE_METASPACE;
        return;
    }
    if (type_is(p, "ByteLevel")) {
        const moe_json *regex = moe_json_get(p, "use_regex");
        *prefix_space = is_true(moe_json_get(p, "add_prefix_space"));
        e->pre = !regex || is_true(regex) ? PRE_GPT2 : PRE_NONE;
        return;
    }
    const moe_json *parts = type_is(p, "Sequence") ? moe_json_get(p, "pretokenizers") : NULL;
    if (!parts || parts->type != MOE_JSON_ARRAY || parts->array.count != 2) return;
    const moe_json *split = &parts->array.items[0], *bytes = &parts->array.items[1];
    const char *pattern = moe_json_text(moe_json_get(moe_json_get(split, "pattern"), "Regex"));
    const char *behavior = moe_json_text(moe_json_get(split, "behavior"));
    if (!type_is(split, "Split") || !pattern || !behavior || strcmp(behavior, "Isolated") != 0 ||
        is_true(moe_json_get(split, "invert")) || !type_is(bytes, "ByteLevel"))
        return;
    /* ByteLevel's use_regex is true unless it says false. */
    const moe_json *regex = moe_json_get(bytes, "use_regex");
    if (!regex || regex->type != MOE_JSON_BOOL || regex->boolean) return;
    *prefix_space = is_true(moe_json_get(bytes, "add_prefix_space"));
    e->pre = strcmp(pattern, LLAMA3_PATTERN) == 0 ? PRE_LLAMA3 : strcmp(pattern, QWEN2_PATTERN) == 0 ? PRE_QWEN2 : PRE_NONE;
}

/* Sets *flag, and whether it was clear. */
static bool set_once(bool *flag) {
    const bool was = *flag;
    *flag = true;
    return !was;
}

/* The normalizer n into e: none, NFC, Prepend U+2581, Replace ' ' by
 * U+2581, or a Sequence of them, each at most once (in any order, which
 * changes nothing); false: another. */
static bool read_normalizer(encoder *e, const moe_json *n) {
    if (!n || n->type == MOE_JSON_NULL) return true;
    if (type_is(n, "NFC")) return set_once(&e->nfc);
    if (type_is(n, "Prepend")) {
        const char *with = moe_json_text(moe_json_get(n, "prepend"));
        return with && strcmp(with, MARK) == 0 && set_once(&e->prepend_mark);
    }
    if (type_is(n, "Replace")) {
        const char *from = moe_json_text(moe_json_get(moe_json_get(n, "pattern"), "String"));
        const char *to = moe_json_text(moe_json_get(n, "content"));
        return from && to && strcmp(from, " ") == 0 && strcmp(to, MARK) == 0 && set_once(&e->spaces_to_marks);
    }
    const moe_json *parts = type_is(n, "Sequence") ? moe_json_get(n, "normalizers") : NULL;
    for (size_t i = 0; parts && parts->type == MOE_JSON_ARRAY && i < parts->array.count; i++)
        if (!read_normalizer(e, &parts->array.items[i])) return false;
    return parts && parts->type == MOE_JSON_ARRAY;
}

/* The special tokens a TemplateProcessing's single template puts around
 * the text, into before and after. */
static bool read_template(encoder *e, const moe_json *p) {
    const moe_json *single = moe_json_get(p, "single"), *specials = moe_json_get(p, "special_tokens");
    if (!single || single->type != MOE_JSON_ARRAY) return false;
    bool text = false;
    for (size_t i = 0; i < single->array.count; i++) {
        const moe_json *item = &single->array.items[i], *special = moe_json_get(item, "SpecialToken");
        if (moe_json_get(item, "Sequence")) {
            if (text) return false; /* the text twice */
            text = true;
            continue;
        }
        const char *name = moe_json_text(moe_json_get(special, "id"));
        const moe_json *ids = name ? moe_json_get(moe_json_get(specials, name), "ids") : NULL;
        for (size_t k = 0; ids && ids->type == MOE_JSON_ARRAY && k < ids->array.count; k++) {
            int64_t id;
            int *n = text ? &e->n_after : &e->n_before;
            if (moe_json_int64(&ids->array.items[k], &id) != MOE_OK || id < 0 || id > INT32_MAX || *n == 4) return false;
            (text ? e->after : e->before)[(*n)++] = (int32_t)id;
        }
        if (!ids) return false;
    }
    return text;
}

/* Whether the post-processor (null, ByteLevel, TemplateProcessing or a
 * Sequence of them) is one encoding implements, its tokens into e. */
static bool read_post(encoder *e, const moe_json *p) {
    if (!p || p->type == MOE_JSON_NULL || type_is(p, "ByteLevel")) return true;
    if (type_is(p, "TemplateProcessing")) return read_template(e, p);
    const moe_json *parts = type_is(p, "Sequence") ? moe_json_get(p, "processors") : NULL;
    for (size_t i = 0; parts && parts->type == MOE_JSON_ARRAY && i < parts->array.count; i++)
        if (!read_post(e, &parts->array.items[i])) return false;
    return parts && parts->type == MOE_JSON_ARRAY;
}

/* How many bytes s [n] begins with that are UTF-8 (n: all). */
static size_t utf8_length(const char *s, size_t n) {
    size_t i = 0;
    for (size_t len; i < n && moe_utf8_decode((const unsigned char *)s + i, n - i, &len) >= 0;) i += len;
    return i;
}

/* The UTF-8 of the NFC of s [n] (valid UTF-8) into *out [*m] (free() it). */
static moe_status to_nfc(const unsigned char *s, size_t n, unsigned char **out, size_t *m) {
    uint32_t *in = malloc(n * sizeof *in), *nfc = malloc(8 * n * sizeof *nfc);
    unsigned char *bytes = malloc(16 * n);
    if (!in || !nfc || !bytes) {
        free(in), free(nfc), free(bytes);
        return moe_error(MOE_ERR_OUT_OF_MEMORY, "encoding: the NFC of %zu bytes", n);
    }
    size_t count = 0;
    for (size_t i = 0, len; i < n; i += len) in[count++] = (uint32_t)moe_utf8_decode(s + i, n - i, &len);
    const size_t k = moe_unicode_nfc(in, count, nfc, nfc + 4 * n);
    size_t b = 0;
    for (size_t i = 0; i < k; i++) b += moe_utf8_encode(nfc[i], bytes + b);
    free(in), free(nfc);
    *out = bytes;
    *m = b;
    return MOE_OK;
}

/* s [n] with each space as U+2581 (when spaces), after a U+2581 (when
 * mark_first), into out (3 n + 3 bytes); its length. */
static size_t mark_spaces(const unsigned char *s, size_t n, bool mark_first, bool spaces, unsigned char *out) {
    size_t k = 0;
    if (mark_first) memcpy(out, MARK, 3), k = 3;
    for (size_t i = 0; i < n; i++) {
        if (spaces && s[i] == ' ')
            memcpy(out + k, MARK, 3), k += 3;
        else
            out[k++] = s[i];
    }
    return k;
}

/* s [n] (valid UTF-8, n > 0) as e's normalizer gives it, into *out [*m]
 * (free() it); *out NULL, and s as it is, when it has none. */
static moe_status normalize(const encoder *e, const unsigned char *s, size_t n, unsigned char **out, size_t *m) {
    *out = NULL, *m = n;
    if (e->nfc) {
        MOE_TRY(to_nfc(s, n, out, m));
        s = *out, n = *m;
    }
    if (!e->spaces_to_marks && !e->prepend_mark) return MOE_OK;
    unsigned char *marked = malloc(3 * n + 3);
    if (!marked) {
        free(*out), *out = NULL;
        return moe_error(MOE_ERR_OUT_OF_MEMORY, "encoding: %zu bytes", n);
    }
    *m = mark_spaces(s, n, e->prepend_mark, e->spaces_to_marks, marked);
    free(*out);
    *out = marked;
    return MOE_OK;
}

/* e->added ordered by the first byte of their forms (in JSON order among
 * those of one byte) and added_from set, so that a place in the text
 * looks only at those that begin with its byte: tokenizers matches
 * hundreds of added tokens (Llama 3's 256, Mistral's 771) at no cost a
 * byte. */
static moe_status index_added(encoder *e) {
    added_token *ordered = malloc(((size_t)e->n_added + 1) * sizeof *ordered);
    if (!ordered) return moe_error(MOE_ERR_OUT_OF_MEMORY, "encoding: %d added tokens", e->n_added);
    memset(e->added_from, 0, sizeof e->added_from);
    for (int i = 0; i < e->n_added; i++) e->added_from[e->added[i].form[0] + 1]++;
    for (int b = 0; b < 256; b++) e->added_from[b + 1] += e->added_from[b];
    int next[256];
    memcpy(next, e->added_from, sizeof next);
    for (int i = 0; i < e->n_added; i++) ordered[next[e->added[i].form[0]]++] = e->added[i];
    free(e->added);
    e->added = ordered;
    return MOE_OK;
}

/* t encodes no text, for the reason fmt gives. */
static moe_status cannot_encode(moe_tokenizer *t, const char *fmt, ...) {
    va_list args;
    va_start(args, fmt);
    vsnprintf(t->why_not, sizeof t->why_not, fmt, args);
    va_end(args);
    t->enc.pre = PRE_NONE;
    return MOE_OK;
}

/* The encoder of a BPE tokenizer.json (root) with a byte-level or a
 * SentencePiece-style vocabulary (spelled by r's decoder; added [count]
 * marks the ids of its added tokens), or a reason in t->why_not that it
 * encodes no text; only running out of memory fails. */
static moe_status build_encoder(moe_tokenizer *t, const json_reader *r, const moe_json *root, const unsigned char *added) {
    encoder *e = &t->enc;
    const moe_json *model = moe_json_get(root, "model"), *merges = moe_json_get(model, "merges");
    const moe_json *vocab = moe_json_get(model, "vocab");
    const char *type = moe_json_text(moe_json_get(model, "type")), *unk = moe_json_text(moe_json_get(model, "unk_token"));
    bool prefix = false;
    read_pretokenizer(e, moe_json_get(root, "pre_tokenizer"), &prefix);
    const bool byte_level = r->spell == BYTE_LEVEL, normalizer = read_normalizer(e, moe_json_get(root, "normalizer"));
    if (!type || strcmp(type, "BPE") != 0) return cannot_encode(t, "its model is %s, not BPE", type ? type : "of no type");
    if (vocab->type != MOE_JSON_OBJECT) return cannot_encode(t, "its BPE model's vocab is a list, not an object");
    if (!merges || merges->type != MOE_JSON_ARRAY) return cannot_encode(t, "it has no merges");
    if (is_set(moe_json_get(model, "continuing_subword_prefix")) || is_set(moe_json_get(model, "end_of_word_suffix")) ||
        is_set(moe_json_get(model, "dropout")))
        return cannot_encode(t, "its BPE model has options encoding does not implement");
    if (!normalizer || (byte_level && (e->spaces_to_marks || e->prepend_mark)))
        return cannot_encode(t, "its normalizer is not one encoding implements (none or NFC; with a "
                                "SentencePiece-style vocabulary also Prepend and Replace of spaces by U+2581)");
    if (e->pre == PRE_NONE || byte_level != (e->pre < PRE_WORD))
        return cannot_encode(t, "its pre-tokenizer is not one encoding implements (GPT-2's, Llama 3's or Qwen2's "
                                "with a byte-level vocabulary, none or Metaspace with a SentencePiece-style one)");
    if (prefix) return cannot_encode(t, "its pre-tokenizer adds a prefix space");
    if (!read_post(e, moe_json_get(root, "post_processor")))
        return cannot_encode(t, "its post-processor is not one encoding implements");
    e->ignore_merges = is_true(moe_json_get(model, "ignore_merges"));
    e->fuse_unk = is_true(moe_json_get(model, "fuse_unk"));
    /* model.vocab as the JSON spells it, which BPE reads (and a decoded
     * token may not tell apart: ByteFallback's <0x41> and A). */
    size_t bytes = 1;
    for (size_t i = 0; i < vocab->object.count; i++) bytes += vocab->object.members[i].key_len;
    const moe_json *list = moe_json_get(root, "added_tokens");
    const size_t n_list = list && list->type == MOE_JSON_ARRAY ? list->array.count : 0;
    if (!(e->spelling = malloc(bytes)) || !(e->spelling_at = calloc((size_t)t->count, sizeof *e->spelling_at)) ||
        !(e->spelling_len = calloc((size_t)t->count, sizeof *e->spelling_len)) ||
        !table_init(&e->vocab, vocab->object.count) || !table_init(&e->merges, merges->array.count) ||
        !(e->added = calloc(n_list + 1, sizeof *e->added)))
        return moe_error(MOE_ERR_OUT_OF_MEMORY, "%s: the encoding tables", r->path);
    size_t used = 0;
    for (size_t i = 0; i < vocab->object.count; i++) {
        const moe_json_member *m = &vocab->object.members[i];
        int64_t id;
        moe_json_int64(&m->value, &id); /* checked at open */
        memcpy(e->spelling + used, m->key, m->key_len);
        e->spelling_at[id] = (int64_t)used, e->spelling_len[id] = (int32_t)m->key_len;
        used += m->key_len;
        table_add(&e->vocab, fnv(FNV_BASIS, m->key, m->key_len) >> 1, (int32_t)id, 0);
    }
    e->unk = unk ? vocab_id(e, unk, strlen(unk)) : -1;
    if (unk && e->unk < 0) return cannot_encode(t, "its unk_token \"%s\" is not in model.vocab", unk);
    const bool byte_fallback = is_true(moe_json_get(model, "byte_fallback"));
    for (int b = 0; b < 256; b++) {
        char name[8];
        snprintf(name, sizeof name, "<0x%02X>", b); /* tokenizers' spelling: upper case */
        e->byte_token[b] = byte_fallback ? vocab_id(e, name, 6) : -1;
    }
    for (int c = 0; c < 0x144; c++)
        if (r->byte_of[c] >= 0) e->byte_char[r->byte_of[c]] = (uint32_t)c;
    /* Added tokens, checked at open: an id and a content each. One that
     * strips spaces or matches whole words only is matched otherwise than
     * here. Unless it says, a special token is matched before normalizing,
     * another after, by its content normalized. */
    for (size_t i = 0; i < n_list; i++) {
        const moe_json *a = &list->array.items[i];
        int64_t id;
        moe_json_int64(moe_json_get(a, "id"), &id);
        if (is_true(moe_json_get(a, "lstrip")) || is_true(moe_json_get(a, "rstrip")) ||
            is_true(moe_json_get(a, "single_word")))
            return cannot_encode(t, "added token %lld strips spaces or matches whole words only", (long long)id);
        if (!added[id] || t->len[id] == 0) continue;
        const moe_json *normalized = moe_json_get(a, "normalized"), *content = moe_json_get(a, "content");
        added_token *token = &e->added[e->n_added];
        token->id = (int32_t)id;
        token->normalized = normalized && normalized->type == MOE_JSON_BOOL ? normalized->boolean
                                                                            : !is_true(moe_json_get(a, "special"));
        token->len = content->string.len;
        if (token->normalized && utf8_length(content->string.data, token->len) == token->len)
            MOE_TRY(normalize(e, (const unsigned char *)content->string.data, token->len, &token->form, &token->len));
        if (!token->form) {
            if (!(token->form = malloc(token->len))) return moe_error(MOE_ERR_OUT_OF_MEMORY, "%s: added tokens", r->path);
            memcpy(token->form, content->string.data, token->len);
        }
        e->n_added++;
    }
    MOE_TRY(index_added(e));
    for (size_t i = 0; i < merges->array.count; i++) {
        const moe_json *m = &merges->array.items[i];
        const char *left = NULL, *right = NULL;
        size_t left_len = 0, right_len = 0;
        if (m->type == MOE_JSON_STRING) {
            const char *space = memchr(m->string.data, ' ', m->string.len);
            if (space) left = m->string.data, left_len = (size_t)(space - left), right = space + 1,
                       right_len = m->string.len - left_len - 1;
        } else if (m->type == MOE_JSON_ARRAY && m->array.count == 2 && m->array.items[0].type == MOE_JSON_STRING &&
                   m->array.items[1].type == MOE_JSON_STRING) {
            left = m->array.items[0].string.data, left_len = m->array.items[0].string.len;
            right = m->array.items[1].string.data, right_len = m->array.items[1].string.len;
        }
        const int32_t a = left ? vocab_id(e, left, left_len) : -1, b = left ? vocab_id(e, right, right_len) : -1;
        const int32_t ab = a >= 0 && b >= 0 ? merged_id(e, a, b) : -1;
        if (ab < 0) return cannot_encode(t, "its merge %zu names a token that is not in the vocabulary", i);
        size_t slot = SIZE_MAX; /* the last merge of a pair ranks it, as in tokenizers */
        if (table_next(&e->merges, pair_key(a, b), &slot))
            e->merges.a[slot] = (int32_t)i, e->merges.b[slot] = ab;
        else
            table_add(&e->merges, pair_key(a, b), (int32_t)i, ab);
    }
    return MOE_OK;
}

static moe_status open_json(moe_tokenizer *t, const char *path) {
    json_reader r = {.path = path};
    byte_level_table(r.byte_of);
    moe_json_doc *doc;
    MOE_TRY(moe_json_parse_file(&doc, path, MOE_TOKENIZER_JSON_MAX_BYTES));
    const moe_json *root = moe_json_root(doc), *model = moe_json_get(root, "model");
    const moe_json *vocab = moe_json_get(model, "vocab"), *added = moe_json_get(root, "added_tokens");
    moe_status st = MOE_OK;
    if (!vocab || (vocab->type != MOE_JSON_OBJECT && vocab->type != MOE_JSON_ARRAY))
        st = moe_error(MOE_ERR_FORMAT, "%s: no model.vocab object or list (a tokenizer.json?)", path);
    if (st == MOE_OK && added && added->type != MOE_JSON_ARRAY)
        st = moe_error(MOE_ERR_FORMAT, "%s: added_tokens is a %s, not a list", path, moe_json_type_name(added->type));
    if (st == MOE_OK) st = read_decoder(&r, moe_json_get(root, "decoder"));
    /* The count: one past the largest id. */
    const bool listed = st == MOE_OK && vocab->type == MOE_JSON_ARRAY;
    int64_t count = st == MOE_OK ? (int64_t)(listed ? vocab->array.count : 0) : 0;
    for (size_t i = 0; st == MOE_OK && !listed && i < vocab->object.count; i++) {
        int64_t id;
        st = read_id(&id, &vocab->object.members[i].value, &r, vocab->object.members[i].key);
        if (st == MOE_OK && id + 1 > count) count = id + 1;
    }
    for (size_t i = 0; st == MOE_OK && added && i < added->array.count; i++) {
        int64_t id;
        st = read_id(&id, moe_json_get(&added->array.items[i], "id"), &r, "an added token");
        if (st == MOE_OK && id + 1 > count) count = id + 1;
    }
    if (st == MOE_OK && (count < 1 || count > MOE_TOKENIZER_TOKENS_MAX))
        st = moe_error(MOE_ERR_FORMAT, "%s: %lld tokens, expected 1 to %d", path, (long long)count,
                       MOE_TOKENIZER_TOKENS_MAX);
    if (st == MOE_OK &&
        (!(t->at = calloc((size_t)count, sizeof *t->at)) || !(t->len = calloc((size_t)count, sizeof *t->len))))
        st = moe_error(MOE_ERR_OUT_OF_MEMORY, "%s: %lld tokens", path, (long long)count);
    unsigned char *added_ids = st == MOE_OK ? calloc((size_t)count, 1) : NULL;
    if (st == MOE_OK && !added_ids)
        st = moe_error(MOE_ERR_OUT_OF_MEMORY, "%s: %lld tokens", path, (long long)count);
    for (size_t i = 0; st == MOE_OK && i < (listed ? vocab->array.count : vocab->object.count); i++) {
        const moe_json *piece = listed ? &vocab->array.items[i] : NULL;
        const moe_json *text =
            listed && piece->type == MOE_JSON_ARRAY && piece->array.count > 0 ? &piece->array.items[0] : NULL;
        const moe_json_member *m = listed ? NULL : &vocab->object.members[i];
        int64_t id = (int64_t)i;
        if (listed && (!text || text->type != MOE_JSON_STRING))
            st = moe_error(MOE_ERR_FORMAT, "%s: model.vocab[%zu] is no [token, score] pair", path, i);
        if (st == MOE_OK && !listed) st = read_id(&id, &m->value, &r, m->key);
        if (st == MOE_OK)
            st = listed ? put_token(t, &r, added_ids, id, text->string.data, text->string.len, false)
                        : put_token(t, &r, added_ids, id, m->key, m->key_len, false);
    }
    for (size_t i = 0; st == MOE_OK && added && i < added->array.count; i++) {
        const moe_json *a = &added->array.items[i], *content = moe_json_get(a, "content");
        int64_t id;
        st = read_id(&id, moe_json_get(a, "id"), &r, "an added token");
        if (st == MOE_OK && (!content || content->type != MOE_JSON_STRING))
            st = moe_error(MOE_ERR_FORMAT, "%s: added token %lld has no content string", path, (long long)id);
        if (st == MOE_OK) st = put_token(t, &r, added_ids, id, content->string.data, content->string.len, true);
    }
    t->data = r.data;
    t->count = count;
    t->eot = -1;
    if (st == MOE_OK) st = build_encoder(t, &r, root, added_ids);
    free(added_ids);
    moe_json_free(doc);
    return st;
}

/* Whether path, a regular file (else the llm.c reader names the fault),
 * begins past white space with '{' or a UTF-8 byte order mark: a
 * tokenizer.json (whose reader refuses the mark, as tokenizers does). */
bool moe_tokenizer_file_is_json(const char *path) {
    FILE *f = NULL;
    int64_t size;
    int c = ' ';
    if (moe_file_open_read(&f, &size, path) != MOE_OK) return false;
    while (c == ' ' || c == '\t' || c == '\n' || c == '\r') c = fgetc(f);
    fclose(f);
    return c == '{' || c == 0xEF;
}

static moe_status open_llmc(moe_tokenizer *t, const char *path) {
    char *data = NULL;
    size_t size = 0;
    /* Every token at its longest, after the header. */
    const size_t most =
        MOE_TOKENIZER_HEADER_BYTES + (size_t)MOE_TOKENIZER_TOKENS_MAX * (1 + MOE_TOKENIZER_TOKEN_BYTES_MAX);
    moe_status st = moe_file_read_all(&data, &size, path, most);
    t->data = (unsigned char *)data;
    if (st == MOE_OK) st = check_header(&t->count, &t->eot, t->data, size, path);
    if (st == MOE_OK && (!(t->at = malloc((size_t)t->count * sizeof *t->at)) ||
                         !(t->len = malloc((size_t)t->count * sizeof *t->len))))
        st = moe_error(MOE_ERR_OUT_OF_MEMORY, "%s: %lld tokens", path, (long long)t->count);
    if (st == MOE_OK) st = find_tokens(t->at, t->len, t->count, t->data, size, path);
    return st;
}

moe_status moe_tokenizer_open(moe_tokenizer **tokenizer, const char *path) {
    if (!tokenizer || !path) return moe_error(MOE_ERR_INVALID_ARG, "moe_tokenizer_open: NULL argument");
    *tokenizer = NULL;
    moe_tokenizer *t = calloc(1, sizeof *t);
    if (!t) return moe_error(MOE_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
    const moe_status st = moe_tokenizer_file_is_json(path) ? open_json(t, path) : open_llmc(t, path);
    if (st != MOE_OK) {
        moe_tokenizer_close(t);
        return st;
    }
    *tokenizer = t;
    return MOE_OK;
}

static void table_free(table *h) {
    free(h->keys);
    free(h->a);
    free(h->b);
}

void moe_tokenizer_close(moe_tokenizer *t) {
    if (!t) return;
    free(t->data);
    free(t->at);
    free(t->len);
    free(t->enc.spelling);
    free(t->enc.spelling_at);
    free(t->enc.spelling_len);
    table_free(&t->enc.vocab);
    table_free(&t->enc.merges);
    for (int i = 0; i < t->enc.n_added; i++) free(t->enc.added[i].form);
    free(t->enc.added);
    free(t);
}

int64_t moe_tokenizer_count(const moe_tokenizer *t) { return t->count; }

int32_t moe_tokenizer_eot(const moe_tokenizer *t) { return t->eot; }

const unsigned char *moe_tokenizer_bytes(const moe_tokenizer *t, int64_t id, size_t *n) {
    if (id < 0 || id >= t->count || t->len[id] == 0) return NULL;
    *n = (size_t)t->len[id];
    return t->data + t->at[id];
}

/* --------------------------------------------------------------- encoding */

bool moe_tokenizer_can_encode(const moe_tokenizer *t, const char **why) {
    if (why) *why = t->enc.pre != PRE_NONE ? NULL : t->why_not[0] ? t->why_not : "llm.c's file holds no merges";
    return t->enc.pre != PRE_NONE;
}

/* The class of the code point at s [n] (valid UTF-8: checked before
 * encoding), as the patterns' \p{L}, \p{N} and \s read it; its bytes in
 * *len. */
static moe_unicode_class class_at(const unsigned char *s, size_t n, size_t *len) {
    return moe_unicode_class_of((uint32_t)moe_utf8_decode(s, n, len));
}

static bool is_letter(moe_unicode_class c) { return c == MOE_UNICODE_LETTER; }
static bool is_number(moe_unicode_class c) { return c == MOE_UNICODE_NUMBER; }
static bool is_space(moe_unicode_class c) { return c == MOE_UNICODE_SPACE; }
static bool is_other(moe_unicode_class c) { return c == MOE_UNICODE_OTHER; }

/* The length of the contraction ('s, 't, 're, 've, 'm, 'll, 'd) at s [n],
 * under (?i:...) when fold (its letters in any case, and those that fold
 * onto them); 0: none. */
static size_t contraction(const unsigned char *s, size_t n, bool fold) {
    static const char *const tails[] = {"s", "t", "re", "ve", "m", "ll", "d"};
    if (n < 2 || s[0] != '\'') return 0;
    for (size_t k = 0; k < sizeof tails / sizeof *tails; k++) {
        size_t at = 1, len;
        bool same = true;
        for (const char *letter = tails[k]; same && *letter; letter++, at += len) {
            const int32_t c = at < n ? moe_utf8_decode(s + at, n - at, &len) : -1;
            same = c >= 0 && (fold ? moe_unicode_fold_letter((uint32_t)c) == *letter : c == *letter);
        }
        if (same) return at;
    }
    return 0;
}

/* The end of the run of s [n] from i whose code points pass test; the
 * start of its last one in *last (i when the run is empty), and how many
 * it holds in *count. */
static size_t run_of(const unsigned char *s, size_t n, size_t i, bool (*test)(moe_unicode_class), size_t *last,
                     size_t *count) {
    size_t len;
    *last = i, *count = 0;
    while (i < n && test(class_at(s + i, n - i, &len))) *last = i, i += len, ++*count;
    return i;
}

static size_t run(const unsigned char *s, size_t n, size_t i, bool (*test)(moe_unicode_class)) {
    size_t last, count;
    return run_of(s, n, i, test, &last, &count);
}

/* \s+(?!\S) then \s+, at a run of white space: the run, but for its last
 * code point when a non-space follows and the run holds more than one. */
static size_t spaces(const unsigned char *s, size_t n, size_t i) {
    size_t last, count;
    const size_t end = run_of(s, n, i, is_space, &last, &count);
    return end < n && count > 1 ? last : end;
}

/* The length of the pre-token at s [n] (n > 0) under the pattern. */
static size_t pretoken(pretokenizer pre, const unsigned char *s, size_t n) {
    size_t k = contraction(s, n, pre != PRE_GPT2), len, next;
    if (k) return k;
    const size_t past_space = s[0] == ' ' && n > 1 ? 1 : 0;
    const moe_unicode_class first = class_at(s, n, &len);
    if (pre == PRE_GPT2) {
        /* ' ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+' */
        const moe_unicode_class c = class_at(s + past_space, n - past_space, &next);
        if (is_letter(c)) return run(s, n, past_space, is_letter);
        if (is_number(c)) return run(s, n, past_space, is_number);
        if (is_other(c)) return run(s, n, past_space, is_other);
        return spaces(s, n, 0);
    }
    /* '[^\r\n\p{L}\p{N}]?\p{L}+' */
    if (is_letter(first)) return run(s, n, 0, is_letter);
    if (len < n && s[0] != '\r' && s[0] != '\n' && !is_number(first) && is_letter(class_at(s + len, n - len, &next)))
        return run(s, n, len, is_letter);
    /* '\p{N}{1,3}' (Llama 3) or '\p{N}' (Qwen2) */
    if (is_number(first)) {
        const int most = pre == PRE_LLAMA3 ? 3 : 1;
        k = len;
        for (int digits = 1; digits < most && k < n && is_number(class_at(s + k, n - k, &next)); digits++) k += next;
        return k;
    }
    /* ' ?[^\s\p{L}\p{N}]+[\r\n]*' */
    if (is_other(class_at(s + past_space, n - past_space, &next))) {
        k = run(s, n, past_space, is_other);
        while (k < n && (s[k] == '\r' || s[k] == '\n')) k++;
        return k;
    }
    /* '\s*[\r\n]+': the white space up to its last line break */
    const size_t end = run(s, n, 0, is_space);
    for (k = end; k > 0; k--)
        if (s[k - 1] == '\r' || s[k - 1] == '\n') return k;
    return spaces(s, n, 0);
}

/* Appends id to ids [*n, *cap]. */
static moe_status push(int32_t **ids, int64_t *n, int64_t *cap, int32_t id) {
    if (*n == *cap) {
        const int64_t more = *cap ? 2 * *cap : 64;
        int32_t *grown = realloc(*ids, (size_t)more * sizeof *grown);
        if (!grown) return moe_error(MOE_ERR_OUT_OF_MEMORY, "encoding: %lld tokens", (long long)more);
        *ids = grown, *cap = more;
    }
    (*ids)[(*n)++] = id;
    return MOE_OK;
}

/* The rank of the merge of left and right, its token into *merged; -1
 * when none. */
static int32_t merge_rank(const encoder *e, int32_t left, int32_t right, int32_t *merged) {
    size_t slot = SIZE_MAX;
    if (!table_next(&e->merges, pair_key(left, right), &slot)) return -1;
    *merged = e->merges.b[slot];
    return e->merges.a[slot];
}

/* A min-heap of candidate merges, each (rank << 32 | position of its left
 * symbol): the lowest rank first, the leftmost of equal ones. */
static void heap_push(uint64_t *heap, size_t *n, uint64_t key) {
    size_t i = (*n)++;
    for (; i > 0 && heap[(i - 1) / 2] > key; i = (i - 1) / 2) heap[i] = heap[(i - 1) / 2];
    heap[i] = key;
}

static uint64_t heap_pop(uint64_t *heap, size_t *n) {
    const uint64_t top = heap[0], last = heap[--*n];
    size_t i = 0;
    for (size_t c; (c = 2 * i + 1) < *n; i = c) {
        if (c + 1 < *n && heap[c + 1] < heap[c]) c++;
        if (heap[c] >= last) break;
        heap[i] = heap[c];
    }
    heap[i] = last;
    return top;
}

/* A word's ids, by BPE: a symbol for each of its characters (the token
 * spelled so; else, under byte_fallback, a <0xNN> for each of its bytes;
 * else the unknown token, one for a run under fuse_unk; else none, as
 * tokenizers drops it), then the lowest-ranked merge of two neighbours,
 * the leftmost of equal ones, until none applies. The symbols form a list
 * and the candidate merges a heap, so a long word costs n log n, not n^2;
 * a candidate whose symbols have changed since it was pushed is skipped
 * when it comes up. */
static moe_status bpe(const encoder *e, const unsigned char *w, size_t len, int32_t **ids, int64_t *n, int64_t *cap) {
    const int32_t whole = e->ignore_merges ? vocab_id(e, w, len) : -1;
    if (whole >= 0) return push(ids, n, cap, whole);
    if (len > INT32_MAX) return moe_error(MOE_ERR_CONFIG, "encoding: a word of %zu bytes, over 2^31", len);
    /* At most a symbol a byte; each merge pushes at most two candidates
     * onto the len - 1 first. */
    int32_t *sym = malloc(3 * len * sizeof *sym);
    uint64_t *heap = malloc(3 * len * sizeof *heap);
    if (!sym || !heap) {
        free(sym), free(heap);
        return moe_error(MOE_ERR_OUT_OF_MEMORY, "encoding: a word of %zu bytes", len);
    }
    int32_t *prev = sym + len, *next = prev + len;
    int32_t m = 0;
    bool unknown = false; /* an unknown token waits: tokenizers adds it before the next known character */
    for (size_t i = 0, k; i < len; i += k) {
        moe_utf8_decode(w + i, len - i, &k);
        const int32_t id = vocab_id(e, w + i, k);
        bool bytes = id < 0;
        for (size_t j = 0; bytes && j < k; j++) bytes = e->byte_token[w[i + j]] >= 0;
        if (id >= 0 && unknown) sym[m++] = e->unk, unknown = false;
        if (id >= 0) sym[m++] = id;
        for (size_t j = 0; bytes && j < k; j++) sym[m++] = e->byte_token[w[i + j]];
        if (id >= 0 || bytes || e->unk < 0) continue;
        if (unknown && !e->fuse_unk) sym[m++] = e->unk;
        unknown = true;
    }
    if (unknown) sym[m++] = e->unk;
    for (int32_t i = 0; i < m; i++) prev[i] = i - 1, next[i] = i + 1 < m ? i + 1 : -1;
    size_t queued = 0;
    int32_t merged, rank;
    for (int32_t i = 0; i + 1 < m; i++)
        if ((rank = merge_rank(e, sym[i], sym[i + 1], &merged)) >= 0)
            heap_push(heap, &queued, (uint64_t)rank << 32 | (uint32_t)i);
    while (queued) {
        const uint64_t key = heap_pop(heap, &queued);
        const int32_t at = (int32_t)(uint32_t)key, right = next[at];
        if (sym[at] < 0 || right < 0 || merge_rank(e, sym[at], sym[right], &merged) != (int32_t)(key >> 32)) continue;
        sym[at] = merged, sym[right] = -1;
        next[at] = next[right];
        if (next[at] >= 0) prev[next[at]] = at;
        if (prev[at] >= 0 && (rank = merge_rank(e, sym[prev[at]], sym[at], &merged)) >= 0)
            heap_push(heap, &queued, (uint64_t)rank << 32 | (uint32_t)prev[at]);
        if (next[at] >= 0 && (rank = merge_rank(e, sym[at], sym[next[at]], &merged)) >= 0)
            heap_push(heap, &queued, (uint64_t)rank << 32 | (uint32_t)at);
    }
    moe_status st = MOE_OK;
    for (int32_t k = m ? 0 : -1; st == MOE_OK && k >= 0; k = next[k]) st = push(ids, n, cap, sym[k]);
    free(sym), free(heap);
    return st;
}

/* The ids of s [n], normalized text between added tokens, its words each
 * by BPE: the pre-tokenizer's pieces of a byte-level vocabulary, their
 * bytes as ByteLevel's characters; Metaspace's, its spaces as U+2581
 * (and one before, by its scheme: first, only where s begins the text,
 * at_start), split before each U+2581 under split; or s whole. */
static moe_status encode_words(const encoder *e, const unsigned char *s, size_t n, bool at_start, int32_t **ids,
                               int64_t *count, int64_t *cap) {
    if (e->pre == PRE_WORD) return bpe(e, s, n, ids, count, cap);
    unsigned char *w = malloc(3 * n + 3);
    if (!w) return moe_error(MOE_ERR_OUT_OF_MEMORY, "encoding: %zu bytes", n);
    moe_status st = MOE_OK;
    if (e->pre == PRE_METASPACE) {
        const bool marked = s[0] == ' ' || (n >= 3 && memcmp(s, MARK, 3) == 0);
        const bool mark_first = !marked && (e->prepend == PREPEND_ALWAYS || (e->prepend == PREPEND_FIRST && at_start));
        const size_t m = mark_spaces(s, n, mark_first, true, w);
        for (size_t i = 0, end = m; st == MOE_OK && i < m; i = end) {
            if (e->split)
                for (end = i + 1; end < m && !(m - end >= 3 && memcmp(w + end, MARK, 3) == 0);) end++;
            st = bpe(e, w + i, end - i, ids, count, cap);
        }
    } else {
        for (size_t k = 0; st == MOE_OK && k < n;) {
            const size_t piece = pretoken(e->pre, s + k, n - k);
            size_t m = 0;
            for (size_t i = k; i < k + piece; i++) m += moe_utf8_encode(e->byte_char[s[i]], w + m);
            st = bpe(e, w, m, ids, count, cap);
            k += piece;
        }
    }
    free(w);
    return st;
}

/* The added token of the kind (normalized or not) that matches text [n]
 * at its start, the longest; NULL: none. */
static const added_token *added_at(const moe_tokenizer *t, const unsigned char *text, size_t n, bool normalized) {
    const added_token *found = NULL;
    for (int i = t->enc.added_from[text[0]]; i < t->enc.added_from[text[0] + 1]; i++) {
        const added_token *a = &t->enc.added[i];
        if (a->normalized == normalized && a->len <= n && memcmp(text, a->form, a->len) == 0 &&
            (!found || found->len < a->len))
            found = a;
    }
    return found;
}

/* text [len]: the added tokens of one kind, leftmost and longest, as
 * tokens, and the text between them; as tokenizers splits on the added
 * tokens not normalized first, then normalizes the text between, then
 * splits it on the normalized ones (matched by their normalized content),
 * then pre-tokenizes what is left. at_start: s begins the text. */
static moe_status encode_part(const moe_tokenizer *t, const unsigned char *s, size_t len, bool normalized,
                              bool at_start, int32_t **ids, int64_t *n, int64_t *cap) {
    unsigned char *form = NULL; /* the normalized text between the tokens not normalized */
    if (normalized) {
        MOE_TRY(normalize(&t->enc, s, len, &form, &len));
        if (form) s = form;
    }
    moe_status st = MOE_OK;
    for (size_t i = 0, plain = 0; st == MOE_OK && i <= len;) {
        const added_token *token = i < len ? added_at(t, s + i, len - i, normalized) : NULL;
        if (!token && i < len) {
            i++;
            continue;
        }
        if (plain < i)
            st = normalized ? encode_words(&t->enc, s + plain, i - plain, at_start && plain == 0, ids, n, cap)
                            : encode_part(t, s + plain, i - plain, true, at_start && plain == 0, ids, n, cap);
        if (!token) break;
        if (st == MOE_OK) st = push(ids, n, cap, token->id);
        i += token->len;
        plain = i;
    }
    free(form);
    return st;
}

/* Whether the text is UTF-8. */
static moe_status check_utf8(const unsigned char *s, size_t n) {
    const size_t i = utf8_length((const char *)s, n);
    if (i < n)
        return moe_error(MOE_ERR_CONFIG, "byte %zu of the text (0x%02x) is not UTF-8: encoding reads UTF-8 text "
                                         "(give other text as ids)",
                         i, s[i]);
    return MOE_OK;
}

moe_status moe_tokenizer_encode(const moe_tokenizer *t, const char *text, bool special, int32_t **ids_out,
                                int64_t *n_out) {
    const char *why;
    if (!moe_tokenizer_can_encode(t, &why)) return moe_error(MOE_ERR_CONFIG, "the tokenizer encodes no text: %s", why);
    const unsigned char *s = (const unsigned char *)text;
    const size_t len = strlen(text);
    MOE_TRY(check_utf8(s, len));
    int32_t *ids = NULL;
    int64_t n = 0, cap = 0;
    moe_status st = MOE_OK;
    for (int i = 0; special && st == MOE_OK && i < t->enc.n_before; i++) st = push(&ids, &n, &cap, t->enc.before[i]);
    if (st == MOE_OK) st = encode_part(t, s, len, false, true, &ids, &n, &cap);
    for (int i = 0; special && st == MOE_OK && i < t->enc.n_after; i++) st = push(&ids, &n, &cap, t->enc.after[i]);
    if (st != MOE_OK) {
        free(ids);
        return st;
    }
    *ids_out = ids;
    *n_out = n;
    return MOE_OK;
}
