/* Text into token shards (engine/corpus.h): the shards read byte by byte
 * here hold each document's ids as moe_tokenizer_encode gives them (which
 * test_tokenizer checks against transformers' tokenizers), in order, with
 * their separators, cut and named as llm.c cuts and names them; whatever
 * fails leaves the shards already on disk as they were. */
#define _XOPEN_SOURCE 700
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <glob.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/corpus.h"
#include "engine/data.h"
#include "engine/tokenizer.h"

#ifndef MOE_TEST_DATA_DIR
#error "CMakeLists.txt defines MOE_TEST_DATA_DIR for test_corpus"
#endif

#define TEST_TMPDIR_TEMPLATE "/tmp/moe_corpus_XXXXXX"
#include "test_files.h"

#define FIXTURE(name) MOE_TEST_DATA_DIR "/" name ".json"

/* Documents of every kind a file gives: Unicode, escapes, extra keys, a
 * blank line, an empty text, a CRLF line, a last line without its newline
 * (of an .NDJSON file), a whole file. */
static const char *const texts[] = {
    "moe trains Mixture-of-Experts transformers from C.",
    "Ünïcödé, 漢字 and 🙂\n\ttabbed",
    "def f(x):\n    return x * 2\n",
    "routers, experts, all-to-all",
    "a whole file is one document\nof two lines\n",
    "the last line",
};

static void write_inputs(void) {
    const char a[] = "{\"text\": \"moe trains Mixture-of-Experts transformers from C.\"}\n"
                     "\n"
                     "{\"id\": 7, \"text\": \"\\u00dcn\\u00efc\\u00f6d\\u00e9, 漢字 and \\ud83d\\ude42\\n\\ttabbed\"}\n"
                     "{\"text\": \"\"}\n"
                     "{\"text\": \"def f(x):\\n    return x * 2\\n\", \"meta\": {\"x\": [1]}}\r\n"
                     "{\"text\": \"routers, experts, all-to-all\"}\n";
    write_bytes(in_tmp("in_a.jsonl"), a, strlen(a));
    write_bytes(in_tmp("in_b.txt"), texts[4], strlen(texts[4]));
    const char c[] = "{\"text\": \"the last line\"}"; /* .ndjson, in any case, is .jsonl */
    write_bytes(in_tmp("in_c.NDJSON"), c, strlen(c));
}

/* The ids of every document in order, each after sep [n_sep] (special:
 * encoded with the tokenizer's special tokens, sep unused) into *n. */
static int32_t *reference(const char *tokenizer, bool special, const int32_t *sep, int n_sep, int64_t *n) {
    moe_tokenizer *t;
    cr_assert_eq(moe_tokenizer_open(&t, tokenizer), MOE_OK, "%s", moe_last_error());
    int32_t *all = NULL;
    *n = 0;
    for (size_t d = 0; d < sizeof texts / sizeof *texts; d++) {
        int32_t *ids;
        int64_t m;
        cr_assert_eq(moe_tokenizer_encode(t, texts[d], special, &ids, &m), MOE_OK, "%s", moe_last_error());
        all = realloc(all, (size_t)(*n + n_sep + m) * sizeof *all);
        cr_assert_not_null(all);
        if (n_sep) memcpy(all + *n, sep, (size_t)n_sep * sizeof *sep);
        memcpy(all + *n + n_sep, ids, (size_t)m * sizeof *ids);
        *n += n_sep + m;
        free(ids);
    }
    moe_tokenizer_close(t);
    return all;
}

static uint32_t le32(const unsigned char *b) {
    return (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24;
}

/* The tokens of shard path, its header checked for token_bytes, appended
 * to stream [*n]; returns their count. */
static int64_t read_shard(int32_t *stream, int64_t *n, const char *path, int token_bytes) {
    size_t size;
    unsigned char *b = read_bytes(path, &size);
    cr_assert_geq(size, (size_t)MOE_SHARD_HEADER_BYTES, "%s", path);
    cr_expect_eq(le32(b), token_bytes == 2 ? MOE_SHARD_MAGIC : MOE_SHARD32_MAGIC, "%s", path);
    cr_expect_eq(le32(b + 4), token_bytes == 2 ? MOE_SHARD_VERSION : MOE_SHARD32_VERSION, "%s", path);
    const int64_t count = le32(b + 8);
    cr_assert_eq(size, MOE_SHARD_HEADER_BYTES + (size_t)(count * token_bytes), "%s: %lld tokens", path,
                 (long long)count);
    for (int64_t i = 0; i < count; i++) {
        const unsigned char *p = b + MOE_SHARD_HEADER_BYTES + i * token_bytes;
        stream[(*n)++] = token_bytes == 2 ? (int32_t)(p[0] | p[1] << 8) : (int32_t)le32(p);
    }
    free(b);
    return count;
}

/* The options of a corpus of the in_* files; out is kept (in_tmp's ring
 * of buffers moves on). */
static moe_corpus_options options(const char *tokenizer, const char *out) {
    static char input[768], prefix[768];
    snprintf(input, sizeof input, "%s", in_tmp("in_*"));
    snprintf(prefix, sizeof prefix, "%s", out);
    moe_corpus_options o;
    moe_corpus_options_init(&o);
    o.tokenizer = tokenizer;
    o.input = input;
    o.out = prefix;
    return o;
}

static size_t count_matches(const char *pattern) {
    glob_t g;
    const size_t n = glob(pattern, 0, NULL, &g) == 0 ? g.gl_pathc : 0;
    globfree(&g);
    return n;
}

/* Runs o, expects the shards of prefix o.out to hold want [n] as the
 * validation split's first documents then the training split, cut every
 * o.shard_tokens, and returns the totals. */
static moe_corpus_totals expect_shards(const moe_corpus_options *o, const int32_t *want, int64_t n, int token_bytes) {
    moe_corpus_totals t;
    cr_assert_eq(moe_corpus_tokenize(o, NULL, &t), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(t.documents, 7, "%lld documents", (long long)t.documents);
    cr_expect_eq(t.empty_documents, 1);
    cr_expect_eq(t.val_tokens + t.train_tokens, n, "%lld tokens, the reference %lld",
                 (long long)(t.val_tokens + t.train_tokens), (long long)n);
    int32_t *got = calloc((size_t)n + 1, sizeof *got);
    int64_t m = 0, index = 0;
    char path[1024];
    for (int split = 0; split < 2; split++) {
        const int64_t shards = split ? t.train_shards : t.val_shards;
        const int64_t tokens = split ? t.train_tokens : t.val_tokens;
        for (int64_t s = 0; s < shards; s++, index++) {
            snprintf(path, sizeof path, "%s_%s_%06lld.bin", o->out, split ? "train" : "val", (long long)index);
            cr_assert_leq(m + o->shard_tokens, n + o->shard_tokens, "%s: more tokens than the reference", path);
            const int64_t count = read_shard(got, &m, path, token_bytes);
            const int64_t left = tokens - s * o->shard_tokens;
            cr_expect_eq(count, left < o->shard_tokens ? left : o->shard_tokens, "%s: %lld tokens", path,
                         (long long)count);
        }
    }
    cr_expect_eq(m, n);
    for (int64_t i = 0; i < n && i < m; i++)
        cr_expect_eq(got[i], want[i], "token %lld is %d, the reference %d", (long long)i, got[i], want[i]);
    snprintf(path, sizeof path, "%s_*", o->out);
    cr_expect_eq(count_matches(path), (size_t)index, "%s: only the shards", path);
    snprintf(path, sizeof path, "%s.partial-*", o->out);
    cr_expect_eq(count_matches(path), 0, "the staging folder is gone");
    free(got);
    return t;
}

/* Qwen2's byte-level tokenizer puts <|endoftext|> (id 0) before each
 * document; the validation split ends at the first document that takes
 * it to --val-tokens; the shards do not depend on the threads. */
Test(corpus, shards_hold_the_documents_in_order, .init = make_tmpdir, .fini = remove_tmpdir) {
    write_inputs();
    int64_t n;
    int32_t *want = reference(FIXTURE("tokenizer_qwen2"), false, (const int32_t[]){0}, 1, &n);
    cr_assert_gt(n, 40);
    moe_corpus_options o = options(FIXTURE("tokenizer_qwen2"), in_tmp("one/tok"));
    o.shard_tokens = 7;
    o.val_tokens = 10;
    o.threads = 1;
    moe_corpus_totals t = expect_shards(&o, want, n, 2);
    /* Whole documents, from the first, until 10 tokens or more. */
    moe_tokenizer *tok;
    cr_assert_eq(moe_tokenizer_open(&tok, FIXTURE("tokenizer_qwen2")), MOE_OK);
    int32_t *ids;
    int64_t m0, m1;
    cr_assert_eq(moe_tokenizer_encode(tok, texts[0], false, &ids, &m0), MOE_OK);
    free(ids);
    cr_assert_eq(moe_tokenizer_encode(tok, texts[1], false, &ids, &m1), MOE_OK);
    free(ids);
    moe_tokenizer_close(tok);
    const int64_t want_val = 1 + m0 < 10 ? 2 + m0 + m1 : 1 + m0;
    cr_expect_eq(t.val_tokens, want_val, "val holds %lld tokens, whole documents to 10 or more: %lld",
                 (long long)t.val_tokens, (long long)want_val);
    cr_expect_eq(t.val_shards, (want_val + 6) / 7);

    o.out = in_tmp("two/tok");
    o.threads = 2;
    expect_shards(&o, want, n, 2);
    char path[1024];
    for (int64_t i = 0; i < t.val_shards + t.train_shards; i++) {
        const char *split = i < t.val_shards ? "val" : "train";
        size_t a_n, b_n;
        snprintf(path, sizeof path, "%s_%s_%06lld.bin", in_tmp("one/tok"), split, (long long)i);
        unsigned char *a = read_bytes(path, &a_n);
        snprintf(path, sizeof path, "%s_%s_%06lld.bin", in_tmp("two/tok"), split, (long long)i);
        unsigned char *b = read_bytes(path, &b_n);
        cr_expect(a_n == b_n && memcmp(a, b, a_n) == 0, "%s: 1 and 2 threads differ", path);
        free(a);
        free(b);
    }
    /* Without a validation split the shards count from 0 in train. */
    o.out = in_tmp("all/tok");
    o.val_tokens = 0;
    o.shard_tokens = 1000;
    t = expect_shards(&o, want, n, 2);
    cr_expect(t.val_shards == 0 && t.train_shards == 1);
    free(want);
}

/* Llama 3's tokenizer begins every text with <|begin_of_text|>, and that
 * is what tells documents apart; Mixtral's with <s>. */
Test(corpus, special_tokens_wrap_each_document, .init = make_tmpdir, .fini = remove_tmpdir) {
    write_inputs();
    const char *const fixtures[] = {FIXTURE("tokenizer_llama3"), FIXTURE("tokenizer_mixtral")};
    for (int f = 0; f < 2; f++) {
        int64_t n;
        int32_t *want = reference(fixtures[f], true, NULL, 0, &n);
        moe_corpus_options o = options(fixtures[f], in_tmp(f ? "mixtral" : "llama3"));
        o.shard_tokens = 25;
        expect_shards(&o, want, n, 2);
        free(want);
    }
}

/* A separator named, or none; a tokenizer without special tokens or
 * <|endoftext|> needs one named. */
Test(corpus, separators_named_or_none, .init = make_tmpdir, .fini = remove_tmpdir) {
    write_inputs();
    int64_t n;
    int32_t *want = reference(FIXTURE("tokenizer_qwen2"), false, (const int32_t[]){1}, 1, &n);
    moe_corpus_options o = options(FIXTURE("tokenizer_qwen2"), in_tmp("im_end"));
    o.separator = "<|im_end|>";
    expect_shards(&o, want, n, 2);
    free(want);
    want = reference(FIXTURE("tokenizer_qwen2"), false, NULL, 0, &n);
    o.out = in_tmp("none");
    o.separator = "";
    expect_shards(&o, want, n, 2);
    free(want);

    moe_corpus_totals t;
    o.out = in_tmp("two");
    o.separator = "two words";
    cr_expect_eq(moe_corpus_tokenize(&o, NULL, &t), MOE_ERR_CONFIG);
    cr_expect(strstr(moe_last_error(), "--separator 'two words' encodes to"), "%s", moe_last_error());
    o = options(FIXTURE("tokenizer_metaspace"), in_tmp("meta"));
    cr_expect_eq(moe_corpus_tokenize(&o, NULL, &t), MOE_ERR_CONFIG);
    cr_expect(strstr(moe_last_error(), "adds no special token") && strstr(moe_last_error(), "--separator"), "%s",
              moe_last_error());
    cr_expect_eq(count_matches(in_tmp("*partial*")), 0);
}

/* Ids past 65535 take llm.c's uint32 shards. */
Test(corpus, wide_ids_take_uint32_shards, .init = make_tmpdir, .fini = remove_tmpdir) {
    const char json[] = "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1, \"ab\": 2}, \"merges\": "
                        "[\"a b\"]}, \"added_tokens\": [{\"id\": 70000, \"content\": \"<|endoftext|>\", "
                        "\"special\": true}], \"pre_tokenizer\": {\"type\": \"ByteLevel\"}, "
                        "\"decoder\": {\"type\": \"ByteLevel\"}}";
    write_bytes(in_tmp("wide.json"), json, strlen(json));
    write_bytes(in_tmp("in_1.txt"), "abab", 4);
    write_bytes(in_tmp("in_2.txt"), "ba", 2);
    moe_corpus_options o = options(in_tmp("wide.json"), in_tmp("w"));
    moe_corpus_totals t;
    cr_assert_eq(moe_corpus_tokenize(&o, NULL, &t), MOE_OK, "%s", moe_last_error());
    int32_t got[16];
    int64_t m = 0;
    read_shard(got, &m, in_tmp("w_train_000000.bin"), 4);
    const int32_t want[] = {70000, 2, 2, 70000, 1, 0};
    cr_assert_eq(m, 6, "%lld tokens", (long long)m);
    for (int i = 0; i < 6; i++) cr_expect_eq(got[i], want[i], "token %d", i);
}

/* The library's rename(2) calls come here: the first move to a path
 * ending in fail_rename_to, outside the staging folder, fails (EIO). */
static const char *fail_rename_to;

int rename(const char *from, const char *to) {
    const size_t n = strlen(to), k = fail_rename_to ? strlen(fail_rename_to) : 0;
    if (fail_rename_to && n >= k && strcmp(to + n - k, fail_rename_to) == 0 && !strstr(to, ".partial-")) {
        fail_rename_to = NULL; /* once: the moves back go through */
        errno = EIO;
        return -1;
    }
    return renameat(AT_FDCWD, from, AT_FDCWD, to);
}

/* Shards made before, byte for byte. */
typedef struct snapshot {
    size_t n;
    char paths[32][1024];
    unsigned char *data[32];
    size_t size[32];
} snapshot;

static void take(snapshot *s, const char *prefix) {
    char pattern[1024];
    snprintf(pattern, sizeof pattern, "%s_*", prefix);
    glob_t g;
    cr_assert_eq(glob(pattern, 0, NULL, &g), 0);
    cr_assert_leq(g.gl_pathc, 32);
    s->n = g.gl_pathc;
    for (size_t i = 0; i < s->n; i++) {
        snprintf(s->paths[i], sizeof s->paths[i], "%s", g.gl_pathv[i]);
        s->data[i] = read_bytes(s->paths[i], &s->size[i]);
    }
    globfree(&g);
}

static void expect_unchanged(const snapshot *s, const char *prefix, const char *why) {
    char pattern[1024];
    snprintf(pattern, sizeof pattern, "%s_*", prefix);
    cr_expect_eq(count_matches(pattern), s->n, "%s: the shards are as they were", why);
    for (size_t i = 0; i < s->n; i++) {
        size_t n;
        unsigned char *b = read_bytes(s->paths[i], &n);
        cr_expect(n == s->size[i] && memcmp(b, s->data[i], n) == 0, "%s: %s changed", why, s->paths[i]);
        free(b);
    }
    cr_expect_eq(count_matches(in_tmp("*partial*")), 0, "%s: the staging folder is gone", why);
}

static void keep_warning(void *ctx, const char *message) { snprintf(ctx, 1024, "%s", message); }

static void expect_refused(const moe_corpus_options *o, moe_status status, const char *a, const char *b) {
    moe_corpus_totals t;
    cr_expect_eq(moe_corpus_tokenize(o, NULL, &t), status, "%s: status", a);
    cr_expect(strstr(moe_last_error(), a) && (!b || strstr(moe_last_error(), b)), "want '%s' and '%s': %s", a,
              b ? b : "", moe_last_error());
}

/* Bad input names the file (and line) and leaves the shards there; shards
 * there already are refused without --overwrite, and with it replaced,
 * the old ones the new corpus has no name for removed. */
Test(corpus, bad_input_leaves_the_shards_there, .init = make_tmpdir, .fini = remove_tmpdir) {
    write_inputs();
    moe_corpus_options o = options(FIXTURE("tokenizer_qwen2"), in_tmp("tok"));
    const char *inputs = o.input; /* kept: in_tmp's buffers move on */
    o.shard_tokens = 9;
    moe_corpus_totals t;
    cr_assert_eq(moe_corpus_tokenize(&o, NULL, &t), MOE_OK, "%s", moe_last_error());
    cr_assert_gt(t.train_shards, 3);
    snapshot s;
    take(&s, in_tmp("tok"));
    expect_refused(&o, MOE_ERR_CONFIG, "_train_000000.bin is there", "--overwrite");
    expect_unchanged(&s, in_tmp("tok"), "no --overwrite");

    o.overwrite = true;
    static const struct {
        const char *line;
        moe_status status;
        const char *a, *b;
    } bad[] = {
        {"{\"text\": \"caf\xe9\"}\n", MOE_ERR_CONFIG, "in_d.jsonl:2:14: invalid UTF-8 byte 0xE9", NULL},
        {"{\"text\": \"cut\n", MOE_ERR_CONFIG, "in_d.jsonl:2:", NULL},
        {"[\"text\"]\n", MOE_ERR_CONFIG, "in_d.jsonl:2: a line is a JSON object, this one a array", NULL},
        {"{\"body\": \"x\"}\n", MOE_ERR_CONFIG, "in_d.jsonl:2: no \"text\" (--text-key)", NULL},
        {"{\"text\": 5}\n", MOE_ERR_CONFIG, "in_d.jsonl:2: \"text\" is a number, not a string", NULL},
        {"{\"text\": \"a\\u0000b\"}\n", MOE_ERR_CONFIG, "in_d.jsonl:2: \"text\" holds a NUL", NULL},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        char text[256];
        snprintf(text, sizeof text, "{\"text\": \"fine\"}\n%s{\"text\": \"after\"}\n", bad[i].line);
        write_bytes(in_tmp("in_d.jsonl"), text, strlen(text));
        expect_refused(&o, bad[i].status, bad[i].a, bad[i].b);
        expect_unchanged(&s, in_tmp("tok"), bad[i].a);
    }
    remove(in_tmp("in_d.jsonl"));
    write_bytes(in_tmp("in_e.txt"), "caf\xe9", 4);
    expect_refused(&o, MOE_ERR_CONFIG, "in_e.txt: byte 3 of the text (0xe9) is not UTF-8", NULL);
    expect_unchanged(&s, in_tmp("tok"), "not UTF-8");
    write_bytes(in_tmp("in_e.txt"), "binary\0file", 11);
    expect_refused(&o, MOE_ERR_CONFIG, "in_e.txt: byte 6 is NUL", NULL);
    expect_unchanged(&s, in_tmp("tok"), "NUL");
    remove(in_tmp("in_e.txt"));
    o.val_tokens = 1000000;
    expect_refused(&o, MOE_ERR_CONFIG, "--val-tokens 1000000: the validation split took all", NULL);
    expect_unchanged(&s, in_tmp("tok"), "val takes all");
    o.val_tokens = 0;
    o.input = in_tmp("nothing*");
    expect_refused(&o, MOE_ERR_IO, "no file matches", NULL);
    write_bytes(in_tmp("empty.jsonl"), "\n{\"text\": \"\"}\n", 14);
    o.input = in_tmp("empty.jsonl");
    expect_refused(&o, MOE_ERR_CONFIG, "no document holds text", NULL);
    expect_unchanged(&s, in_tmp("tok"), "no text");
    o.input = inputs;
    o.tokenizer = in_tmp("missing.json");
    expect_refused(&o, MOE_ERR_IO, "missing.json", NULL);
    expect_unchanged(&s, in_tmp("tok"), "no tokenizer");

    o.tokenizer = FIXTURE("tokenizer_qwen2");
    /* The first fault in the input's order is the one named: a.txt's,
     * though b.jsonl's line fails as it is read, before any encoding. */
    write_bytes(in_tmp("in_a0.txt"), "caf\xe9", 4);
    write_bytes(in_tmp("in_a1.jsonl"), "{\"text\": \"x\"}\n{\"text\": 5}\n", 27);
    expect_refused(&o, MOE_ERR_CONFIG, "in_a0.txt: byte 3", NULL);
    remove(in_tmp("in_a0.txt"));
    remove(in_tmp("in_a1.jsonl"));
    /* A folder the input's glob matches, or one of a shard's name. */
    cr_assert_eq(mkdir(in_tmp("in_z"), 0700), 0);
    expect_refused(&o, MOE_ERR_CONFIG, "in_z, which is no file", NULL);
    cr_assert_eq(rmdir(in_tmp("in_z")), 0);
    cr_assert_eq(mkdir(in_tmp("tok_val_000000.bin"), 0700), 0);
    expect_refused(&o, MOE_ERR_CONFIG, "tok_val_000000.bin has a shard's name and is no file", NULL);
    cr_assert_eq(rmdir(in_tmp("tok_val_000000.bin")), 0);
    expect_unchanged(&s, in_tmp("tok"), "folders");
    /* A move into place that fails moves back every one before it. */
    fail_rename_to = "tok_train_000002.bin";
    expect_refused(&o, MOE_ERR_IO, "moving the shard", "the shards there stay as they were");
    cr_expect_null(fail_rename_to, "no move failed");
    expect_unchanged(&s, in_tmp("tok"), "a failed move");

    /* The staging folder of a run that did not finish is warned of. */
    cr_assert_eq(mkdir(in_tmp("tok.partial-left"), 0700), 0);
    char warned[1024] = "";
    const moe_corpus_callbacks cb = {.ctx = warned, .on_warning = keep_warning};
    cr_assert_eq(moe_corpus_tokenize(&o, &cb, &t), MOE_OK, "%s", moe_last_error());
    cr_expect(strstr(warned, "tok.partial-left is left by a run into --out") && strstr(warned, "old-*"), "%s",
              warned);
    cr_assert_eq(rmdir(in_tmp("tok.partial-left")), 0);
    expect_unchanged(&s, in_tmp("tok"), "the same corpus again");

    /* Replaced by fewer, larger shards: the old ones past them go. */
    o.tokenizer = FIXTURE("tokenizer_qwen2");
    o.shard_tokens = 1000;
    cr_assert_eq(moe_corpus_tokenize(&o, NULL, &t), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(count_matches(in_tmp("tok_*")), 1);
    for (size_t i = 0; i < s.n; i++) free(s.data[i]);
}

Test(corpus, options_name_the_flag) {
    static const struct {
        const char *field, *value;
        int64_t number;
        const char *want;
    } bad[] = {
        {"tokenizer", NULL, 0, "--tokenizer is required"},
        {"input", NULL, 0, "--input is required"},
        {"out", "data/tok*", 0, "--out data/tok*: a prefix without the glob characters"},
        {"out", "data/", 0, "--out data/: a prefix ends in a file name part"},
        {"out", "", 0, "--out must not be empty"},
        {"text_key", "", 0, "--text-key must not be empty"},
        {"shard_tokens", NULL, 0, "--shard-tokens 0: a shard holds 1 to"},
        {"shard_tokens", NULL, (int64_t)1 << 31, "--shard-tokens 2147483648"},
        {"val_tokens", NULL, -1, "--val-tokens -1 must not be negative"},
        {"out", "data/t234567890123456789012345678901234567890123456789012345678901234567890123456789012345678901"
                "23456789012345678901234567890123456789012345678901234567890123456789012345678901234567890123456789"
                "0123456789012345678901234567890123456789012345678901234567890",
         0, "a shard's file name would pass 255 bytes"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        moe_corpus_options o;
        moe_corpus_options_init(&o);
        o.tokenizer = "t.json";
        o.input = "*.txt";
        const char *f = bad[i].field;
        if (!strcmp(f, "tokenizer")) o.tokenizer = NULL;
        if (!strcmp(f, "input")) o.input = NULL;
        if (!strcmp(f, "out")) o.out = bad[i].value;
        if (!strcmp(f, "text_key")) o.text_key = bad[i].value;
        if (!strcmp(f, "shard_tokens")) o.shard_tokens = bad[i].number;
        if (!strcmp(f, "val_tokens")) o.val_tokens = bad[i].number;
        cr_expect_eq(moe_corpus_options_validate(&o), MOE_ERR_CONFIG, "%s", bad[i].want);
        cr_expect(strstr(moe_last_error(), bad[i].want), "want '%s': %s", bad[i].want, moe_last_error());
    }
}
