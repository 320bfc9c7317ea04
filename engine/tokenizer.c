/* tokenizer.c: reading llm.c's tokenizer file (tokenizer.h). */
#include "engine/tokenizer.h"

#include <stdlib.h>

#include "common/status.h"
#include "engine/fileio.h"

struct moe_tokenizer {
    unsigned char *data; /* the whole file */
    int64_t *at;         /* [count] offset in data of each token's length byte; its bytes follow */
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

/* Every token's length byte into at [count], each length checked against
 * the file's end, and no byte left after the last token. */
static moe_status find_tokens(int64_t *at, int64_t count, const unsigned char *data, size_t size,
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
        at[id] = (int64_t)off;
        off += 1 + len;
    }
    if (off != size)
        return moe_error(MOE_ERR_FORMAT, "%s: %zu byte%s left over after the %lld tokens (offset %zu): a wrong "
                         "count or trailing bytes", path, size - off, size - off == 1 ? "" : "s", (long long)count, off);
    return MOE_OK;
}

moe_status moe_tokenizer_open(moe_tokenizer **tokenizer, const char *path) {
    if (!tokenizer || !path) return moe_error(MOE_ERR_INVALID_ARG, "moe_tokenizer_open: NULL argument");
    *tokenizer = NULL;
    moe_tokenizer *t = calloc(1, sizeof *t);
    if (!t) return moe_error(MOE_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
    char *data = NULL;
    size_t size = 0;
    /* Every token at its longest, after the header. */
    const size_t most =
        MOE_TOKENIZER_HEADER_BYTES + (size_t)MOE_TOKENIZER_TOKENS_MAX * (1 + MOE_TOKENIZER_TOKEN_BYTES_MAX);
    moe_status st = moe_file_read_all(&data, &size, path, most);
    t->data = (unsigned char *)data;
    if (st == MOE_OK) st = check_header(&t->count, &t->eot, t->data, size, path);
    if (st == MOE_OK && !(t->at = malloc((size_t)t->count * sizeof *t->at)))
        st = moe_error(MOE_ERR_OUT_OF_MEMORY, "%s: %lld tokens", path, (long long)t->count);
    if (st == MOE_OK) st = find_tokens(t->at, t->count, t->data, size, path);
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
    free(t);
}

int64_t moe_tokenizer_count(const moe_tokenizer *t) { return t->count; }

int32_t moe_tokenizer_eot(const moe_tokenizer *t) { return t->eot; }

const unsigned char *moe_tokenizer_bytes(const moe_tokenizer *t, int64_t id, size_t *n) {
    if (id < 0 || id >= t->count) return NULL;
    *n = t->data[t->at[id]];
    return t->data + t->at[id] + 1;
}
