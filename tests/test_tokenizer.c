/* test_tokenizer.c: llm.c's tokenizer file (engine/tokenizer.h): every id
 * of version 1 and 2 files decoded to the bytes written, and every kind of
 * malformed file refused, its error naming the file and the fault: a cut
 * at every byte of a small file, the header's fields, a token of length 0,
 * bytes past the last token. Hugging Face tokenizer.json files (ByteLevel
 * and SentencePiece-style, made by tests/data/make_tokenizers.py with
 * transformers' tokenizers): every id decoded to the bytes tokenizers
 * spells for it, text encoded to the ids tokenizers gives it, and
 * malformed ones refused. */
#define _XOPEN_SOURCE 700
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "engine/tokenizer.h"
#include "engine/unicode.h"

#ifndef MOE_TEST_DATA_DIR
#error "CMakeLists.txt defines MOE_TEST_DATA_DIR for test_tokenizer"
#endif

#define TEST_TMPDIR_TEMPLATE "/tmp/moe_tok_XXXXXX"
#include "test_files.h"
#include "tokenizer_file.h"

/* Opens path, which must be refused naming it and holding a and b. */
static void expect_refused(const char *path, const char *a, const char *b) {
    moe_tokenizer *t = (moe_tokenizer *)&t; /* not NULL: a refusal must clear it */
    const moe_status st = moe_tokenizer_open(&t, path);
    cr_assert_neq(st, MOE_OK, "%s should be refused for '%s'", path, a);
    cr_expect_null(t, "a refused file leaves no tokenizer");
    const char *e = moe_last_error();
    cr_expect(strstr(e, path) && strstr(e, a) && (!b || strstr(e, b)), "error \"%s\" should name %s, '%s' and '%s'",
              e, path, a, b ? b : "");
}

/* A file of count tokens, written to name, read back whole: every id's
 * bytes, and the end-of-text. */
static void expect_decodes(const char *name, uint32_t version, uint32_t count, uint32_t eot, int32_t want_eot) {
    size_t size;
    unsigned char *buf = tok_file_new(&size, MOE_TOKENIZER_MAGIC, version, count, eot);
    write_bytes(in_tmp(name), buf, size);
    free(buf);
    moe_tokenizer *t = NULL;
    cr_assert_eq(moe_tokenizer_open(&t, in_tmp(name)), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(moe_tokenizer_eot(t), want_eot);
    cr_assert_eq(moe_tokenizer_count(t), count);
    for (int64_t id = 0; id < count; id++) {
        unsigned char want[255];
        const size_t n = tok_bytes_of(want, id);
        size_t got_n = 0;
        const unsigned char *got = moe_tokenizer_bytes(t, id, &got_n);
        cr_expect(got && got_n == n && memcmp(got, want, n) == 0, "token %lld: %zu bytes, expected %zu%s",
                  (long long)id, got ? got_n : 0, n, got ? "" : " (NULL)");
    }
    size_t n;
    cr_expect_null(moe_tokenizer_bytes(t, count, &n), "id %lld is past the file's tokens", (long long)count);
    cr_expect_null(moe_tokenizer_bytes(t, -1, &n));
    moe_tokenizer_close(t);
}

Test(tokenizer, version_2_decodes_every_id, .init = make_tmpdir, .fini = remove_tmpdir) {
    expect_decodes("tok.bin", 2, 300, 299, 299);
    expect_decodes("one.bin", 2, 1, 0, 0); /* one token, its own end-of-text */
}

Test(tokenizer, version_1_has_gpt2s_end_of_text_or_none, .init = make_tmpdir, .fini = remove_tmpdir) {
    expect_decodes("tok.bin", 1, 260, 0, -1);
    /* Its header's fourth field is not read. */
    expect_decodes("odd.bin", 1, 260, 7777, -1);
    /* GPT-2's count: its last token, as llm.c reads version 1. */
    expect_decodes("gpt2.bin", 1, MOE_TOKENIZER_GPT2_TOKENS, 0, MOE_TOKENIZER_GPT2_TOKENS - 1);
}

Test(tokenizer, refuses_a_cut_at_every_byte, .init = make_tmpdir, .fini = remove_tmpdir) {
    /* Ids 255 .. 258 include the 255-byte token. */
    size_t size;
    unsigned char *buf = tok_file_new(&size, MOE_TOKENIZER_MAGIC, 2, 259, 258);
    const char *path = in_tmp("cut.bin");
    write_bytes(path, buf, size);
    moe_tokenizer *t = NULL;
    cr_assert_eq(moe_tokenizer_open(&t, path), MOE_OK, "the whole file: %s", moe_last_error());
    moe_tokenizer_close(t);
    /* Where each token's length byte lies, walking the file independently. */
    size_t at[260];
    at[0] = TOK_HEADER_BYTES;
    for (int id = 0; id < 259; id++) at[id + 1] = at[id] + 1 + buf[at[id]];
    cr_assert_eq(at[259], size);
    for (size_t cut = 0; cut < size; cut++) {
        write_bytes(path, buf, cut);
        char a[64], b[64] = "";
        if (cut < TOK_HEADER_BYTES) {
            snprintf(a, sizeof a, "%zu bytes, shorter than the 1024-byte", cut);
        } else {
            int id = 0;
            while (at[id + 1] <= cut) id++;
            if (at[id] == cut) {
                snprintf(a, sizeof a, "ends at token %d's length (offset %zu)", id, cut);
            } else {
                snprintf(a, sizeof a, "token %d's %d bytes run past the end", id, buf[at[id]]);
                snprintf(b, sizeof b, "offset %zu, %zu bytes", at[id] + 1, cut);
            }
        }
        expect_refused(path, a, b);
    }
    free(buf);
}

/* buf [size] written to name must be refused naming a and b. */
static void expect_file_refused(const char *name, const unsigned char *buf, size_t size, const char *a,
                                const char *b) {
    write_bytes(in_tmp(name), buf, size);
    expect_refused(in_tmp(name), a, b);
}

Test(tokenizer, refuses_bad_headers_and_tokens, .init = make_tmpdir, .fini = remove_tmpdir) {
    size_t size;
    unsigned char *buf = tok_file_new(&size, 20240520, 2, 10, 9); /* a token shard's magic */
    expect_file_refused("magic.bin", buf, size, "magic 20240520 at offset 0", "expected 20240328");
    size = tok_file(buf, MOE_TOKENIZER_MAGIC, 3, 10, 9);
    expect_file_refused("v3.bin", buf, size, "version 3 at offset 4", "expected 1 or 2");
    size = tok_file(buf, MOE_TOKENIZER_MAGIC, 0, 10, 9);
    expect_file_refused("v0.bin", buf, size, "version 0", NULL);
    size = tok_file(buf, MOE_TOKENIZER_MAGIC, 2, 0, 0);
    expect_file_refused("empty.bin", buf, size, "says 0 tokens (offset 8)", "expected 1 to 1048576");
    /* An absurd count is refused from the header, whatever follows. */
    size = tok_file(buf, MOE_TOKENIZER_MAGIC, 2, 10, 9);
    tok_put_le32(buf + 8, 0xffffffffu);
    expect_file_refused("huge.bin", buf, size, "says 4294967295 tokens", NULL);
    tok_put_le32(buf + 8, MOE_TOKENIZER_TOKENS_MAX + 1);
    expect_file_refused("past.bin", buf, size, "says 1048577 tokens", NULL);

    size = tok_file(buf, MOE_TOKENIZER_MAGIC, 2, 10, 10);
    expect_file_refused("eot.bin", buf, size, "end-of-text token 10 (offset 12)", "not below the 10 tokens");
    size = tok_file(buf, MOE_TOKENIZER_MAGIC, 2, 10, 0xffffffffu);
    expect_file_refused("eot_max.bin", buf, size, "end-of-text token 4294967295", NULL);

    /* Token 4's length byte set to 0: its byte is then read as token 5's
     * length, so the zero must be caught where it stands. */
    size = tok_file(buf, MOE_TOKENIZER_MAGIC, 2, 10, 9);
    buf[TOK_HEADER_BYTES + 4 * 2] = 0;
    expect_file_refused("zero.bin", buf, size, "token 4 has length 0 (offset 1032)", NULL);

    size = tok_file(buf, MOE_TOKENIZER_MAGIC, 2, 10, 9);
    buf[size] = 'x';
    expect_file_refused("trailing.bin", buf, size + 1, "1 byte left over after the 10 tokens (offset 1044)", NULL);
    /* A count one short leaves the last token over. */
    tok_put_le32(buf + 8, 9);
    tok_put_le32(buf + 12, 8);
    expect_file_refused("short.bin", buf, size, "2 bytes left over after the 9 tokens", NULL);
    free(buf);

    expect_refused(in_tmp("absent.bin"), "cannot open", NULL);
    expect_refused(tmpdir, "not a regular file", NULL);
}

/* ---------------------------------------------------------- tokenizer.json */

/* tests/data/NAME.json, opened, and unless suffix is NULL NAME.SUFFIX, the
 * expectations of it, opened into *f. */
static moe_tokenizer *open_fixture(const char *name, const char *suffix, FILE **f) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s.json", MOE_TEST_DATA_DIR, name);
    moe_tokenizer *t = NULL;
    cr_assert_eq(moe_tokenizer_open(&t, path), MOE_OK, "%s", moe_last_error());
    if (!suffix) return t;
    snprintf(path, sizeof path, "%s/%s.%s", MOE_TEST_DATA_DIR, name, suffix);
    *f = fopen(path, "r");
    cr_assert_not_null(*f, "%s", path);
    return t;
}

/* tests/data/NAME.json read, every id's bytes against NAME.ids ("ID HEX"
 * per line, HEX empty where no token has the id). */
static void expect_json_decodes(const char *name) {
    FILE *f;
    moe_tokenizer *t = open_fixture(name, "ids", &f);
    cr_expect_eq(moe_tokenizer_eot(t), -1, "a tokenizer.json names no end-of-text");
    char line[4 * MOE_TOKENIZER_DECODED_BYTES_MAX];
    int64_t count = 0, spelled = 0;
    while (fgets(line, sizeof line, f)) {
        long long id;
        char hex[sizeof line] = "";
        cr_assert(sscanf(line, "%lld %s", &id, hex) >= 1, "%s.ids: '%s'", name, line);
        unsigned char want[MOE_TOKENIZER_DECODED_BYTES_MAX];
        const size_t n = strlen(hex) / 2;
        for (size_t i = 0; i < n; i++) {
            unsigned v;
            sscanf(hex + 2 * i, "%2x", &v);
            want[i] = (unsigned char)v;
        }
        size_t got_n = 0;
        const unsigned char *got = moe_tokenizer_bytes(t, id, &got_n);
        if (n == 0)
            cr_expect_null(got, "%s: id %lld has no token", name, id);
        else
            cr_expect(got && got_n == n && memcmp(got, want, n) == 0, "%s: id %lld: %zu bytes, expected %zu (%s)", name,
                      id, got ? got_n : 0, n, hex);
        spelled += n > 0;
        count = id + 1;
    }
    fclose(f);
    cr_expect_eq(moe_tokenizer_count(t), count);
    cr_expect(spelled > 300, "%s: %lld tokens checked", name, (long long)spelled);
    moe_tokenizer_close(t);
}

Test(tokenizer_json, byte_level_decodes_every_id) { expect_json_decodes("tokenizer_byte_level"); }
Test(tokenizer_json, sentencepiece_style_decodes_every_id) { expect_json_decodes("tokenizer_metaspace"); }

/* A tokenizer.json written to name from text. */
static const char *json_file(const char *name, const char *text) {
    write_bytes(in_tmp(name), text, strlen(text));
    return in_tmp(name);
}

Test(tokenizer_json, malformed_files_are_refused, .init = make_tmpdir, .fini = remove_tmpdir) {
    static const char byte_level[] = "\"decoder\": {\"type\": \"ByteLevel\"}";
    char text[1024];
    const struct {
        const char *model, *rest, *want;
    } bad[] = {
        {"{}", byte_level, "no model.vocab"},
        {"{\"vocab\": {\"a\": 0, \"b\": 0}}", byte_level, "id 0 is given to two tokens"},
        {"{\"vocab\": {\"a\": -1}}", byte_level, "a has id -1, not an integer in [0, 1048576)"},
        {"{\"vocab\": {\"a\": 1.5}}", byte_level, "a has id 1.5"},
        {"{\"vocab\": {\"a\": 0}}", "\"decoder\": {\"type\": \"WordPiece\"}", "decoder WordPiece is not read"},
        {"{\"vocab\": {\"a\": 0}}", "\"decoder\": null", "decoder (none) is not read"},
        {"{\"vocab\": {\"a\": 0}}", "\"decoder\": {\"type\": \"Sequence\", \"decoders\": [{\"type\": \"CTC\"}]}",
         "decoder Sequence's part 0 is CTC"},
        {"{\"vocab\": [[\"a\", 0.0], 7]}", "\"decoder\": {\"type\": \"Metaspace\"}", "model.vocab[1] is no [token, score] pair"},
        {"{\"vocab\": {\"a\": 0}}", "\"decoder\": {\"type\": \"ByteLevel\"}, \"added_tokens\": [{\"id\": 3}]",
         "added token 3 has no content string"},
        {"{\"vocab\": {\"a\": 0}}", "\"decoder\": {\"type\": \"ByteLevel\"}, \"added_tokens\": [{\"id\": 1, \"content\": "
                                     "\"x\"}, {\"id\": 1, \"content\": \"y\"}]",
         "id 1 is given to two added tokens"},
        {"{\"vocab\": {\"a\": 0, \"\": 1}}", byte_level, "token 1 spells 0 bytes"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        snprintf(text, sizeof text, "{\"model\": %s, %s}", bad[i].model, bad[i].rest);
        expect_refused(json_file("bad.json", text), bad[i].want, NULL);
    }
    expect_refused(json_file("cut.json", "{\"model\": {\"vocab\": {\"a\": 0}"), "unexpected end of input", NULL);
    /* A byte order mark is read as the JSON it begins, and refused there,
     * as tokenizers refuses it; a FIFO is no regular file (never waited on). */
    snprintf(text, sizeof text, "\xEF\xBB\xBF{\"model\": {\"vocab\": {\"a\": 0}}, %s}", byte_level);
    expect_refused(json_file("bom.json", text), "bom.json:1:1", NULL);
    const char *fifo = in_tmp("fifo");
    cr_assert_eq(mkfifo(fifo, 0600), 0);
    expect_refused(fifo, "not a regular file", NULL);
}

/* Ids the file gives no token print as unknown; an added token's content
 * replaces what the vocabulary spells for its id, and goes through the
 * decoder, as in transformers' tokenizers: a token with a character
 * outside ByteLevel's alphabet stays as it is. */
Test(tokenizer_json, holes_and_added_tokens, .init = make_tmpdir, .fini = remove_tmpdir) {
    const char *path = json_file("t.json", "{\"model\": {\"vocab\": {\"\\u0120a\": 0, \"b\": 4}}, "
                                           "\"added_tokens\": [{\"id\": 4, \"content\": \"<|x|>\"}, "
                                           "{\"id\": 2, \"content\": \"\\u0120\\u6f22\"}], "
                                           "\"decoder\": {\"type\": \"ByteLevel\"}}");
    moe_tokenizer *t = NULL;
    cr_assert_eq(moe_tokenizer_open(&t, path), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(moe_tokenizer_count(t), 5);
    size_t n = 0;
    const unsigned char *b = moe_tokenizer_bytes(t, 0, &n);
    cr_expect(b && n == 2 && memcmp(b, " a", 2) == 0, "id 0: U+0120 is the space byte");
    cr_expect_null(moe_tokenizer_bytes(t, 1, &n));
    cr_expect_null(moe_tokenizer_bytes(t, 3, &n));
    b = moe_tokenizer_bytes(t, 2, &n);
    cr_expect(b && n == 5 && memcmp(b, "\xC4\xA0\xE6\xBC\xA2", 5) == 0,
              "id 2: with U+6F22, outside the alphabet, the whole token stays as it is, its U+0120 too");
    b = moe_tokenizer_bytes(t, 4, &n);
    cr_expect(b && n == 5 && memcmp(b, "<|x|>", 5) == 0, "id 4: the added token's content");
    moe_tokenizer_close(t);
    /* ByteFallback reads hex digits of either case, as tokenizers does. */
    path = json_file("f.json", "{\"model\": {\"vocab\": {\"<0x6a>\": 0, \"<0x4A>\": 1, \"\\u2581b\": 2}}, "
                               "\"decoder\": {\"type\": \"Sequence\", \"decoders\": [{\"type\": \"Replace\", "
                               "\"pattern\": {\"String\": \"\\u2581\"}, \"content\": \" \"}, {\"type\": \"ByteFallback\"}]}}");
    cr_assert_eq(moe_tokenizer_open(&t, path), MOE_OK, "%s", moe_last_error());
    const char *want[3] = {"j", "J", " b"};
    for (int id = 0; id < 3; id++) {
        b = moe_tokenizer_bytes(t, id, &n);
        cr_expect(b && n == strlen(want[id]) && memcmp(b, want[id], n) == 0, "id %d", id);
    }
    moe_tokenizer_close(t);
}

/* ---------------------------------------------------------------- encoding */

Test(tokenizer_json, split_tokenizers_decode_every_id) {
    expect_json_decodes("tokenizer_llama3");
    expect_json_decodes("tokenizer_qwen2");
}

/* tests/data/NAME.json encodes each text of NAME.enc ("HEX IDS" per line:
 * ASCII, and text of many scripts, planes and classes, and text that NFC
 * changes) to the ids transformers' tokenizers gave it. */
static void expect_encodes(const char *name) {
    FILE *f;
    moe_tokenizer *t = open_fixture(name, "enc", &f);
    const char *why = NULL;
    cr_assert(moe_tokenizer_can_encode(t, &why), "%s: %s", name, why);
    static char line[1 << 16], text[1 << 15];
    int checked = 0, unicode = 0;
    while (fgets(line, sizeof line, f)) {
        char *ids = strchr(line, ' ');
        cr_assert_not_null(ids, "%s.enc: '%s'", name, line);
        const size_t n = (size_t)(ids - line) / 2;
        bool ascii = true;
        for (size_t i = 0; i < n; i++) {
            unsigned v;
            sscanf(line + 2 * i, "%2x", &v);
            text[i] = (char)v;
            ascii &= v < 0x80;
        }
        text[n] = '\0';
        int32_t *got = NULL;
        int64_t count = 0;
        cr_assert_eq(moe_tokenizer_encode(t, text, true, &got, &count), MOE_OK, "%s: %s", name, moe_last_error());
        int64_t k = 0;
        for (char *p = ids + 1; *p && *p != '\n'; k++) {
            const long want = strtol(p, &p, 10);
            cr_expect(k < count && got[k] == want, "%s: '%s': token %lld is %d, transformers' %ld", name, text,
                      (long long)k, k < count ? got[k] : -1, want);
            if (*p == ',') p++;
        }
        cr_expect_eq(count, k, "%s: '%s': %lld tokens, transformers' %lld", name, text, (long long)count, (long long)k);
        free(got);
        checked++;
        unicode += !ascii;
    }
    fclose(f);
    cr_expect(checked >= 400 && unicode >= 150, "%s: %d texts encoded, %d of them not ASCII", name, checked, unicode);
    moe_tokenizer_close(t);
}

Test(tokenizer_json, byte_level_bpe_encodes_as_tokenizers) {
    expect_encodes("tokenizer_byte_level");
    expect_encodes("tokenizer_llama3");
    expect_encodes("tokenizer_qwen2");
}

/* The tables lookups search: each sorted, its ranges disjoint; and
 * landmarks of each class, and of NFC. */
Test(tokenizer_json, unicode_tables_are_sorted) {
    const struct {
        const moe_unicode_range *r;
        size_t n;
    } tables[] = {{moe_unicode_classes, moe_unicode_class_count}, {moe_unicode_combining, moe_unicode_combining_count}};
    for (size_t t = 0; t < sizeof tables / sizeof *tables; t++)
        for (size_t i = 0; i < tables[t].n; i++)
            cr_expect(tables[t].r[i].first <= tables[t].r[i].last && (i == 0 || tables[t].r[i - 1].last < tables[t].r[i].first),
                      "table %zu, range %zu", t, i);
    for (size_t i = 1; i < moe_unicode_decomposition_count; i++)
        cr_expect(moe_unicode_decompositions[i - 1].code_point < moe_unicode_decompositions[i].code_point, "decomposition %zu", i);
    for (size_t i = 1; i < moe_unicode_composition_count; i++) {
        const moe_unicode_composition *p = &moe_unicode_compositions[i - 1], *q = &moe_unicode_compositions[i];
        cr_expect(p->first < q->first || (p->first == q->first && p->second < q->second), "composition %zu", i);
    }
    const struct {
        uint32_t c;
        moe_unicode_class want;
    } marks[] = {{'a', MOE_UNICODE_LETTER}, {0x6F22, MOE_UNICODE_LETTER}, {0x20000, MOE_UNICODE_LETTER},
                 {'7', MOE_UNICODE_NUMBER}, {0xBD, MOE_UNICODE_NUMBER},   {0x2167, MOE_UNICODE_NUMBER},
                 {' ', MOE_UNICODE_SPACE},  {0x3000, MOE_UNICODE_SPACE},  {0x85, MOE_UNICODE_SPACE},
                 {'!', MOE_UNICODE_OTHER},  {0x1F642, MOE_UNICODE_OTHER}, {0x10FFFF, MOE_UNICODE_OTHER}};
    for (size_t i = 0; i < sizeof marks / sizeof *marks; i++)
        cr_expect_eq(moe_unicode_class_of(marks[i].c), marks[i].want, "U+%04X", (unsigned)marks[i].c);
    cr_expect(moe_unicode_fold_letter(0x17F) == 's' && moe_unicode_fold_letter('L') == 'l' && !moe_unicode_fold_letter(0xDF));
    cr_expect_eq(moe_unicode_combining_class(0x301), 230);
    /* NFC as tokenizers gives it: composed, mapped, reordered, Hangul by
     * formula, an exclusion decomposed, a mark newer than its Unicode
     * version left in place. */
    static const struct {
        uint32_t in[4], want[4];
    } nfc[] = {{{0x65, 0x301}, {0xE9}},
               {{0x212A}, {0x4B}},
               {{0x5D0, 0x5B4, 0x5B0}, {0x5D0, 0x5B0, 0x5B4}},
               {{0x1100, 0x1161, 0x11A8}, {0xAC01}},
               {{0xAC00, 0x11A8}, {0xAC01}},
               {{0x61, 0x323, 0x302}, {0x1EAD}},
               {{0x1EA5, 0x323}, {0x1EAD, 0x301}},
               {{0x958}, {0x915, 0x93C}},
               {{0x89F, 0xB4D}, {0x89F, 0xB4D}}};
    for (size_t i = 0; i < sizeof nfc / sizeof *nfc; i++) {
        size_t n = 0, want = 0;
        while (n < 4 && nfc[i].in[n]) n++;
        while (want < 4 && nfc[i].want[want]) want++;
        uint32_t out[16], scratch[16];
        const size_t m = moe_unicode_nfc(nfc[i].in, n, out, scratch);
        cr_expect(m == want && memcmp(out, nfc[i].want, m * sizeof *out) == 0, "case %zu: %zu code points, U+%04X first",
                  i, m, (unsigned)out[0]);
    }
    /* A run of marks too long to sort by insertion: a, then acute and
     * grave below (class 230, 220) 10 times, is a-acute, the 10 graves
     * below and 9 acutes. */
    uint32_t in[21] = {'a'}, out[84], scratch[84];
    for (int i = 0; i < 10; i++) in[1 + 2 * i] = 0x301, in[2 + 2 * i] = 0x316;
    const size_t m = moe_unicode_nfc(in, 21, out, scratch);
    cr_assert_eq(m, 20);
    cr_expect_eq(out[0], 0xE1);
    for (size_t i = 1; i < m; i++) cr_expect_eq(out[i], i <= 10 ? 0x316u : 0x301u, "code point %zu: U+%04X", i, (unsigned)out[i]);
}

/* Text that is not UTF-8 is refused, naming the byte, with and without an
 * NFC normalizer. */
Test(tokenizer_json, text_that_is_not_utf8_is_refused) {
    static const struct {
        const char *text, *want;
    } cases[] = {
        {"ab\xc3", "byte 2 of the text (0xc3) is not UTF-8"},
        {"a\xc0\xaf" "b", "byte 1 of the text (0xc0) is not UTF-8"},      /* overlong '/' */
        {"a\xed\xa0\x80", "byte 1 of the text (0xed) is not UTF-8"},  /* a surrogate */
        {"\xf4\x90\x80\x80", "byte 0 of the text (0xf4) is not UTF-8"}, /* past U+10FFFF */
        {"x\x80", "byte 1 of the text (0x80) is not UTF-8"},
    };
    moe_tokenizer *both[] = {open_fixture("tokenizer_llama3", NULL, NULL), open_fixture("tokenizer_qwen2", NULL, NULL)};
    for (size_t t = 0; t < 2; t++) {
        for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
            int32_t *ids = NULL;
            int64_t n = 0;
            cr_expect_eq(moe_tokenizer_encode(both[t], cases[i].text, true, &ids, &n), MOE_ERR_CONFIG, "case %zu encoded", i);
            cr_expect(strstr(moe_last_error(), cases[i].want) != NULL, "case %zu: %s", i, moe_last_error());
        }
        moe_tokenizer_close(both[t]);
    }
}

/* SentencePiece-style vocabularies: Mixtral's Prepend and Replace
 * normalizer, Metaspace (scheme always and split; first and whole),
 * ByteFallback and the unknown token, fused or not; special tokens, and
 * normalized added tokens by their normalized content. */
Test(tokenizer_json, sentencepiece_bpe_encodes_as_tokenizers) {
    expect_encodes("tokenizer_metaspace");
    expect_encodes("tokenizer_mixtral");
    expect_encodes("tokenizer_llama_first");
}

/* llm.c's file, and tokenizer.json files of another model or of parts
 * encoding does not implement, encode nothing, saying why. */
Test(tokenizer_json, other_tokenizers_say_why_they_do_not_encode, .init = make_tmpdir, .fini = remove_tmpdir) {
    static const char sentencepiece[] = "\"decoder\": {\"type\": \"Metaspace\", \"replacement\": \"\\u2581\"}";
    static const char byte_level[] = "\"decoder\": {\"type\": \"ByteLevel\"}";
    const struct {
        const char *model, *rest, *decoder, *why;
    } cases[] = {
        {"\"type\": \"Unigram\", \"vocab\": [[\"a\", 0.0]]", "", sentencepiece, "its model is Unigram, not BPE"},
        {"\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": []",
         "\"normalizer\": {\"type\": \"NFKC\"}, ", sentencepiece, "normalizer"},
        {"\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": []",
         "\"normalizer\": {\"type\": \"Sequence\", \"normalizers\": [{\"type\": \"Prepend\", \"prepend\": "
         "\"\\u2581\"}, {\"type\": \"Prepend\", \"prepend\": \"\\u2581\"}]}, ",
         sentencepiece, "normalizer"},
        {"\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": []",
         "\"normalizer\": {\"type\": \"Replace\", \"pattern\": {\"String\": \" \"}, \"content\": \"\\u2581\"}, "
         "\"pre_tokenizer\": {\"type\": \"ByteLevel\"}, ",
         byte_level, "normalizer"},
        {"\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": []", "\"pre_tokenizer\": {\"type\": \"ByteLevel\"}, ",
         sentencepiece, "pre-tokenizer"},
        {"\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": []",
         "\"pre_tokenizer\": {\"type\": \"Metaspace\", \"replacement\": \"_\"}, ", sentencepiece, "pre-tokenizer"},
        {"\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": []",
         "\"pre_tokenizer\": {\"type\": \"Metaspace\", \"replacement\": \"\\u2581\", \"prepend_scheme\": \"first\", "
         "\"add_prefix_space\": false}, ",
         sentencepiece, "pre-tokenizer"},
        {"\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": []",
         "\"pre_tokenizer\": {\"type\": \"Metaspace\", \"replacement\": \"\\u2581\", \"add_prefix_space\": false}, ",
         sentencepiece, "pre-tokenizer"},
        {"\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": []", "", byte_level, "pre-tokenizer"},
        {"\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": []",
         "\"post_processor\": {\"type\": \"Sequence\", \"processors\": 5}, ", sentencepiece, "post-processor"},
        {"\"type\": \"BPE\", \"vocab\": [[\"a\", 0.0]], \"merges\": []", "", sentencepiece,
         "its BPE model's vocab is a list"},
        {"\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": [], \"unk_token\": \"<unk>\"", "", sentencepiece,
         "its unk_token \"<unk>\" is not in model.vocab"},
        {"\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": [\"a b\"]", "", sentencepiece,
         "its merge 0 names a token that is not in the vocabulary"},
    };
    char text[1024];
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        snprintf(text, sizeof text, "{\"model\": {%s}, %s%s}", cases[i].model, cases[i].rest, cases[i].decoder);
        moe_tokenizer *t = NULL;
        cr_assert_eq(moe_tokenizer_open(&t, json_file("t.json", text)), MOE_OK, "case %zu: %s", i, moe_last_error());
        const char *why = NULL;
        cr_expect_not(moe_tokenizer_can_encode(t, &why), "case %zu", i);
        cr_expect(why && strstr(why, cases[i].why), "case %zu: %s", i, why ? why : "(null)");
        int32_t *ids = NULL;
        int64_t n = 0;
        cr_expect_eq(moe_tokenizer_encode(t, "a", true, &ids, &n), MOE_ERR_CONFIG, "case %zu", i);
        moe_tokenizer_close(t);
    }
    size_t size;
    unsigned char *buf = tok_file_new(&size, MOE_TOKENIZER_MAGIC, 2, 300, 299);
    write_bytes(in_tmp("tok.bin"), buf, size);
    free(buf);
    moe_tokenizer *t = NULL;
    cr_assert_eq(moe_tokenizer_open(&t, in_tmp("tok.bin")), MOE_OK, "%s", moe_last_error());
    const char *why = NULL;
    cr_expect_not(moe_tokenizer_can_encode(t, &why));
    cr_expect(why && strstr(why, "llm.c's file holds no merges"), "%s", why ? why : "(null)");
    moe_tokenizer_close(t);
}

/* ids of text under the tokenizer at path equal want [n], as
 * transformers' tokenizers 0.22 gave them. */
static void expect_ids(const char *path, const char *text, const int32_t *want, int64_t n) {
    moe_tokenizer *t = NULL;
    cr_assert_eq(moe_tokenizer_open(&t, path), MOE_OK, "%s", moe_last_error());
    int32_t *got = NULL;
    int64_t count = 0;
    cr_assert_eq(moe_tokenizer_encode(t, text, true, &got, &count), MOE_OK, "'%s': %s", text, moe_last_error());
    cr_expect_eq(count, n, "'%s': %lld tokens, tokenizers' %lld", text, (long long)count, (long long)n);
    for (int64_t i = 0; i < n && i < count; i++)
        cr_expect_eq(got[i], want[i], "'%s': token %lld is %d, tokenizers' %d", text, (long long)i, got[i], want[i]);
    free(got);
    moe_tokenizer_close(t);
}

/* The last of two equal merges ranks the pair; a byte with no token is
 * dropped; added tokens not normalized split the text first, the
 * normalized ones the text between them. */
Test(tokenizer_json, merges_bytes_and_added_tokens_as_tokenizers, .init = make_tmpdir, .fini = remove_tmpdir) {
    const char *path = json_file(
        "t.json", "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1, \"c\": 2, \"ab\": 3, \"bc\": 4, "
                  "\">\": 5}, \"merges\": [\"a b\", \"b c\", \"a b\"]}, \"added_tokens\": ["
                  "{\"id\": 6, \"content\": \"<x>\", \"special\": true, \"normalized\": false}, "
                  "{\"id\": 7, \"content\": \"b<x\", \"special\": false, \"normalized\": true}], "
                  "\"pre_tokenizer\": {\"type\": \"ByteLevel\"}, \"decoder\": {\"type\": \"ByteLevel\"}}");
    expect_ids(path, "abc", (const int32_t[]){0, 4}, 2);
    expect_ids(path, "abcxab", (const int32_t[]){0, 4, 3}, 3);
    expect_ids(path, "ab<x>", (const int32_t[]){3, 6}, 2);
    expect_ids(path, "ab<x>>b<xa", (const int32_t[]){3, 6, 5, 7, 0}, 5);
}

/* A character outside the vocabulary: ByteFallback's tokens where each
 * of its bytes has one, else the unknown token, one for a run under
 * fuse_unk; as tokenizers, an unknown token waiting when byte tokens come
 * goes after them. */
Test(tokenizer_json, unknown_characters_as_tokenizers, .init = make_tmpdir, .fini = remove_tmpdir) {
    static const char format[] =
        "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"<unk>\": 0, \"a\": 1, \"b\": 2, \"<0xC3>\": 3, "
        "\"<0xA9>\": 4, \"\\u2581\": 5}, \"merges\": [], \"unk_token\": \"<unk>\", \"byte_fallback\": true, "
        "\"fuse_unk\": %s}, \"decoder\": {\"type\": \"Metaspace\", \"replacement\": \"\\u2581\"}}";
    char text[1024];
    const char *chars = "a\u6f22\u5b57\u00e9b\U0001F642\U0001F642a"; /* a, two unknowns, e-acute, b, two emoji, a */
    snprintf(text, sizeof text, format, "true");
    expect_ids(json_file("fused.json", text), chars, (const int32_t[]){1, 3, 4, 0, 2, 0, 1}, 7);
    snprintf(text, sizeof text, format, "false");
    expect_ids(json_file("apart.json", text), chars, (const int32_t[]){1, 0, 3, 4, 0, 2, 0, 0, 1}, 9);
}

/* Added tokens matched with spaces stripped or as whole words, and
 * templates with the text twice or an item of no kind, are not encoded. */
Test(tokenizer_json, unimplemented_options_say_why, .init = make_tmpdir, .fini = remove_tmpdir) {
    static const char model[] = "\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"<s>\": 1}, \"merges\": []}, "
                                "\"pre_tokenizer\": {\"type\": \"ByteLevel\"}, \"decoder\": {\"type\": \"ByteLevel\"}";
    const struct {
        const char *rest, *why;
    } cases[] = {
        {"\"added_tokens\": [{\"id\": 1, \"content\": \"<s>\", \"lstrip\": true}]", "strips spaces"},
        {"\"added_tokens\": [{\"id\": 1, \"content\": \"<s>\", \"single_word\": true}]", "whole words"},
        {"\"post_processor\": {\"type\": \"TemplateProcessing\", \"single\": [{\"Sequence\": {\"id\": \"A\"}}, "
         "{\"Sequence\": {\"id\": \"A\"}}], \"special_tokens\": {}}",
         "post-processor"},
        {"\"post_processor\": {\"type\": \"TemplateProcessing\", \"single\": [{}, {\"Sequence\": {\"id\": \"A\"}}], "
         "\"special_tokens\": {}}",
         "post-processor"},
    };
    char text[1024];
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        snprintf(text, sizeof text, "{%s, %s}", model, cases[i].rest);
        moe_tokenizer *t = NULL;
        cr_assert_eq(moe_tokenizer_open(&t, json_file("t.json", text)), MOE_OK, "%s", moe_last_error());
        const char *why = NULL;
        cr_expect_not(moe_tokenizer_can_encode(t, &why), "case %zu", i);
        cr_expect(why && strstr(why, cases[i].why), "case %zu: %s", i, why ? why : "(null)");
        moe_tokenizer_close(t);
    }
}
