/* test_status.c: the error detail behind moe_last_error(): messages that
 * fit are kept whole, longer ones keep both ends, cut between UTF-8
 * characters. */
#include <criterion/criterion.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"

/* Whether s is well-formed UTF-8 (no sequence cut short or begun midway). */
static bool valid_utf8(const char *s) {
    const unsigned char *p = (const unsigned char *)s;
    while (*p) {
        int follow = *p < 0x80 ? 0 : (*p & 0xE0) == 0xC0 ? 1 : (*p & 0xF0) == 0xE0 ? 2 : (*p & 0xF8) == 0xF0 ? 3 : -1;
        if (follow < 0) return false;
        p++;
        for (int i = 0; i < follow; i++, p++)
            if ((*p & 0xC0) != 0x80) return false;
    }
    return true;
}

static bool ends_with(const char *s, const char *tail) {
    const size_t n = strlen(s), m = strlen(tail);
    return n >= m && strcmp(s + n - m, tail) == 0;
}

/* n copies of c, for the caller to free. */
static char *repeated(char c, size_t n) {
    char *s = malloc(n + 1);
    cr_assert(s);
    memset(s, c, n);
    s[n] = '\0';
    return s;
}

Test(status, short_messages_are_kept_whole) {
    cr_expect(moe_error(MOE_ERR_CONFIG, "config.json: top_k=%d exceeds %d", 9, 8) == MOE_ERR_CONFIG);
    cr_expect_str_eq(moe_last_error(), "config.json: top_k=9 exceeds 8");
    moe_error_prefix(MOE_ERR_CONFIG, "%s: ", "run");
    cr_expect_str_eq(moe_last_error(), "run: config.json: top_k=9 exceeds 8");
}

/* Paths of 2000 and 9000 bytes: the head says what failed, the tail why. */
Test(status, long_messages_keep_their_head_and_tail) {
    static const size_t lengths[] = {2000, 9000};
    for (size_t i = 0; i < sizeof lengths / sizeof lengths[0]; i++) {
        char *path = repeated('b', lengths[i]);
        moe_error(MOE_ERR_IO, "checkpoint %s: cannot open: File name too long", path);
        const char *e = moe_last_error();
        cr_expect(strlen(e) <= MOE_ERROR_BYTES - 1, "length %zu", strlen(e));
        cr_expect(strncmp(e, "checkpoint bbb", 14) == 0, "head: %.40s", e);
        cr_expect(ends_with(e, ": cannot open: File name too long"), "%zu-byte path, tail: %s", lengths[i],
                  e + strlen(e) - 40);
        cr_expect(strstr(e, "...") != NULL, "no elision mark");
        free(path);
    }
}

/* Two-byte characters on both sides of each cut: neither leaves half of
 * one. */
Test(status, cuts_fall_between_utf8_characters) {
    char path[3 * 700 + 1] = "";
    for (int i = 0; i < 700; i++) strcat(path, i % 2 ? "\xc3\xa9" : "\xe2\x82\xac"); /* é, € */
    for (int shift = 0; shift < 3; shift++) {
        moe_error(MOE_ERR_IO, "%.*s%s: why", shift, "xx", path);
        cr_expect(valid_utf8(moe_last_error()), "shift %d: a character cut in two", shift);
        cr_expect(ends_with(moe_last_error(), ": why"), "shift %d: the reason is lost", shift);
    }
}

/* A prefix longer than the whole capacity (1500 and 9000 bytes) leaves
 * the earlier detail's reason at the end. */
Test(status, a_long_prefix_keeps_the_detail) {
    static const size_t lengths[] = {1500, 9000};
    for (size_t i = 0; i < sizeof lengths / sizeof lengths[0]; i++) {
        moe_error(MOE_ERR_IO, "write failed: No space left on device");
        char *dir = repeated('d', lengths[i]);
        moe_error_prefix(MOE_ERR_IO, "%s/model.safetensors: ", dir);
        const char *e = moe_last_error();
        cr_expect(strlen(e) <= MOE_ERROR_BYTES - 1);
        cr_expect(strncmp(e, "dddd", 4) == 0, "head: %.20s", e);
        cr_expect(ends_with(e, "model.safetensors: write failed: No space left on device"), "%zu-byte prefix, tail: %s",
                  lengths[i], e + strlen(e) - 60);
        free(dir);
    }
}
