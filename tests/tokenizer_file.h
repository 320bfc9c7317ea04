/* tokenizer_file.h: llm.c tokenizer files for the tests, laid out byte by
 * byte here rather than by the reader under test (engine/tokenizer.h). */
#ifndef MOE_TESTS_TOKENIZER_FILE_H
#define MOE_TESTS_TOKENIZER_FILE_H

#include <criterion/criterion.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TOK_HEADER_BYTES 1024

static inline void tok_put_le32(unsigned char *b, uint32_t v) {
    for (int i = 0; i < 4; i++) b[i] = (unsigned char)(v >> (8 * i));
}

/* Token id's bytes into out [255]; returns how many. Ids below 256 are one
 * byte each, every byte once (7 is odd), NUL, '\n', '\\' and '|' among
 * them; id 256 is the longest a file holds, the others 2 to 18 bytes. */
static inline size_t tok_bytes_of(unsigned char *out, int64_t id) {
    if (id < 256) {
        out[0] = (unsigned char)(id * 7 + 3);
        return 1;
    }
    const size_t n = id == 256 ? 255 : 2 + (size_t)(id * 5 % 17);
    for (size_t j = 0; j < n; j++) out[j] = (unsigned char)(id + 31 * (int64_t)j);
    return n;
}

/* The file of count tokens (tok_bytes_of) into buf [TOK_HEADER_BYTES + 256
 * * count], with the header's four fields as given; returns its size. */
static inline size_t tok_file(unsigned char *buf, uint32_t magic, uint32_t version, uint32_t count,
                              uint32_t eot) {
    memset(buf, 0, TOK_HEADER_BYTES);
    tok_put_le32(buf, magic);
    tok_put_le32(buf + 4, version);
    tok_put_le32(buf + 8, count);
    tok_put_le32(buf + 12, eot);
    size_t at = TOK_HEADER_BYTES;
    for (uint32_t id = 0; id < count; id++) {
        const size_t n = tok_bytes_of(buf + at + 1, id);
        buf[at] = (unsigned char)n;
        at += 1 + n;
    }
    return at;
}

/* The same in a new buffer with room for count tokens at their longest (free()
 * it); its size in *size. */
static inline unsigned char *tok_file_new(size_t *size, uint32_t magic, uint32_t version, uint32_t count,
                                          uint32_t eot) {
    unsigned char *buf = malloc(TOK_HEADER_BYTES + 256 * (size_t)count + 16);
    cr_assert_not_null(buf);
    *size = tok_file(buf, magic, version, count, eot);
    return buf;
}

#endif /* MOE_TESTS_TOKENIZER_FILE_H */
