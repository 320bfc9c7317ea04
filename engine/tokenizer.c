/* tokenizer.c: reading llm.c's tokenizer file and Hugging Face's
 * tokenizer.json (tokenizer.h). */
#include "engine/tokenizer.h"

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"
#include "engine/fileio.h"
#include "engine/json.h"

struct moe_tokenizer {
    unsigned char *data; /* every token's bytes: llm.c's whole file, or a tokenizer.json's tokens decoded */
    int64_t *at;         /* [count] where in data each token's bytes begin */
    int32_t *len;        /* [count] how many; 0: no token has the id */
    int64_t count;
    int32_t eot;         /* -1: none */
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
    if (st == MOE_OK && !added_ids) st = moe_error(MOE_ERR_OUT_OF_MEMORY, "%s: %lld tokens", path, (long long)count);
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
    free(added_ids);
    moe_json_free(doc);
    t->data = r.data;
    t->count = count;
    t->eot = -1;
    return st;
}

/* Whether path, a regular file (else the llm.c reader names the fault),
 * begins past white space with '{' or a UTF-8 byte order mark: a
 * tokenizer.json (whose reader refuses the mark, as tokenizers does). */
static bool is_json(const char *path) {
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
    const moe_status st = is_json(path) ? open_json(t, path) : open_llmc(t, path);
    if (st != MOE_OK) {
        moe_tokenizer_close(t);
        return st;
    }
    *tokenizer = t;
    return MOE_OK;
}

void moe_tokenizer_close(moe_tokenizer *t) {
    if (!t) return;
    free(t->data);
    free(t->at);
    free(t->len);
    free(t);
}

int64_t moe_tokenizer_count(const moe_tokenizer *t) { return t->count; }

int32_t moe_tokenizer_eot(const moe_tokenizer *t) { return t->eot; }

const unsigned char *moe_tokenizer_bytes(const moe_tokenizer *t, int64_t id, size_t *n) {
    if (id < 0 || id >= t->count || t->len[id] == 0) return NULL;
    *n = (size_t)t->len[id];
    return t->data + t->at[id];
}
