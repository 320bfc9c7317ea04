/* safetensors reader/writer, sharded checkpoint directories, and the fileio
 * helpers under them (atomic replacement, mkdir -p, bounded reads). */
#define _XOPEN_SOURCE 700

#include <criterion/criterion.h>
#include <dirent.h>
#include <errno.h>
#include <ftw.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/crc32c.h"
#include "common/status.h"
#include "engine/fileio.h"
#include "engine/json.h"
#include "engine/safetensors.h"

#define TEST_TMPDIR_TEMPLATE "/tmp/moe_st_XXXXXX"
#include "test_files.h"

/* A safetensors file from a header text, its declared length and data. */
static void write_raw(const char *path, uint64_t declared, const char *header, const void *data, size_t data_len) {
    size_t h = strlen(header);
    unsigned char *buf = malloc(8 + h + data_len);
    for (int i = 0; i < 8; i++) buf[i] = (unsigned char)(declared >> (8 * i));
    memcpy(buf + 8, header, h);
    if (data_len > 0) memcpy(buf + 8 + h, data, data_len);
    write_bytes(path, buf, 8 + h + data_len);
    free(buf);
}

static void write_st(const char *path, const char *header, const void *data, size_t data_len) {
    write_raw(path, strlen(header), header, data, data_len);
}

/* Names in tmpdir that contain ".tmp.", i.e. temp files left behind. */
static int leftover_temps(void) {
    DIR *d = opendir(tmpdir);
    cr_assert_not_null(d);
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) n += strstr(e->d_name, ".tmp.") != NULL;
    closedir(d);
    return n;
}

/* ------------------------------------------------------------ conversions */

/* Independent references: the IEEE 754 formulas, in double. */
static double f16_reference(uint16_t h) {
    int sign = h >> 15, exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
    double v;
    if (exp == 0x1F)
        v = mant ? NAN : INFINITY;
    else if (exp == 0)
        v = ldexp(mant, -24);
    else
        v = ldexp(1.0 + mant / 1024.0, exp - 15);
    return sign ? -v : v;
}

static double bf16_reference(uint16_t b) {
    int sign = b >> 15, exp = (b >> 7) & 0xFF, mant = b & 0x7F;
    double v;
    if (exp == 0xFF)
        v = mant ? NAN : INFINITY;
    else if (exp == 0)
        v = ldexp(mant, -133);
    else
        v = ldexp(1.0 + mant / 128.0, exp - 127);
    return sign ? -v : v;
}

Test(conversion, f16_every_value) {
    int wrong = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        double want = f16_reference((uint16_t)h);
        float got = moe_f16_to_f32((uint16_t)h);
        bool ok = isnan(want) ? isnan(got) : ((double)got == want && !signbit(got) == !signbit(want));
        if (!ok && wrong++ == 0) cr_expect(ok, "f16 0x%04X: got %.9g, want %.17g", h, got, want);
    }
    cr_expect_eq(wrong, 0, "%d f16 values converted wrongly", wrong);
}

Test(conversion, bf16_every_value) {
    int wrong = 0;
    for (uint32_t b = 0; b < 65536; b++) {
        double want = bf16_reference((uint16_t)b);
        float got = moe_bf16_to_f32((uint16_t)b);
        bool ok = isnan(want) ? isnan(got) : ((double)got == want && !signbit(got) == !signbit(want));
        if (!ok && wrong++ == 0) cr_expect(ok, "bf16 0x%04X: got %.9g, want %.17g", b, got, want);
    }
    cr_expect_eq(wrong, 0, "%d bf16 values converted wrongly", wrong);
}

/* moe_st_find_bad against a scan of the converted values: every element
 * that is not finite, or below zero when nonnegative, in order, found by
 * restarting after each one. All BF16 and F16 bit patterns, and F32 ones
 * from random bits (every exponent) stored one byte off alignment. */
static void expect_find_bad(const moe_st_tensor *t, bool nonnegative) {
    float *ref = malloc((size_t)t->numel * sizeof *ref);
    cr_assert_not_null(ref);
    moe_st_read_f32(ref, t);
    int64_t from = 0, found = 0;
    for (int64_t i = 0; i <= t->numel; i++) {
        const bool bad = i < t->numel && (!isfinite(ref[i]) || (nonnegative && ref[i] < 0.0f));
        if (!bad && i < t->numel) continue;
        float value = 0.0f;
        const int64_t got = moe_st_find_bad(&value, t, from, t->numel - from, nonnegative);
        const int64_t want = i < t->numel ? i : -1;
        cr_assert_eq(got, want, "%s, nonnegative %d, from %lld: found %lld, want %lld (%g)", moe_st_dtype_name(t->dtype),
                     nonnegative, (long long)from, (long long)got, (long long)want, want >= 0 ? ref[want] : 0.0);
        if (want >= 0)
            cr_assert(memcmp(&value, &ref[want], sizeof value) == 0, "%s element %lld: value %a, want %a",
                      moe_st_dtype_name(t->dtype), (long long)want, value, ref[want]);
        from = i + 1;
        found += want >= 0;
    }
    cr_expect_gt(found, 0, "%s: nothing to find", moe_st_dtype_name(t->dtype));
    free(ref);
}

Test(conversion, find_bad_matches_converted_values) {
    enum { N = 65536 };
    unsigned char *bytes = malloc(4 * N + 1);
    cr_assert_not_null(bytes);
    for (uint32_t b = 0; b < N; b++) bytes[2 * b] = (unsigned char)b, bytes[2 * b + 1] = (unsigned char)(b >> 8);
    const moe_st_dtype halves[2] = {MOE_ST_BF16, MOE_ST_F16};
    for (int k = 0; k < 2; k++) {
        const moe_st_tensor t = {.name = "h", .dtype = halves[k], .numel = N, .nbytes = 2 * N, .data = bytes};
        expect_find_bad(&t, false);
        expect_find_bad(&t, true);
    }
    uint64_t s = 12345;
    for (uint32_t i = 0; i < N; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        const uint32_t b = (uint32_t)(s >> 32);
        for (int j = 0; j < 4; j++) bytes[1 + 4 * i + j] = (unsigned char)(b >> (8 * j));
    }
    const moe_st_tensor t = {.name = "f", .dtype = MOE_ST_F32, .numel = N, .nbytes = 4 * N, .data = bytes + 1};
    expect_find_bad(&t, false);
    expect_find_bad(&t, true);
    free(bytes);
}

Test(safetensors, reads_bf16_and_f16_known_values, .init = make_tmpdir, .fini = remove_tmpdir) {
    static const uint16_t f16[] = {0x3C00, 0xC000, 0x7BFF, 0x0001, 0x03FF, 0x0400, 0x8000, 0x7C00, 0xFC00, 0x3555};
    static const float f16_want[] = {1.0f, -2.0f, 65504.0f, 5.9604644775390625e-08f, 6.097555160522461e-05f,
                                     6.103515625e-05f, -0.0f, INFINITY, -INFINITY, 0.333251953125f};
    static const uint16_t bf16[] = {0x3F80, 0xC040, 0x7F80, 0x0001, 0x3EAB, 0x8000};
    static const float bf16_want[] = {1.0f, -3.0f, INFINITY, 9.18354961579912e-41f, 0.333984375f, -0.0f};
    unsigned char data[2 * 10 + 2 * 6 + 2];
    size_t n = 0;
    for (int i = 0; i < 10; i++) data[n++] = (unsigned char)f16[i], data[n++] = (unsigned char)(f16[i] >> 8);
    for (int i = 0; i < 6; i++) data[n++] = (unsigned char)bf16[i], data[n++] = (unsigned char)(bf16[i] >> 8);
    data[n++] = 0x00, data[n++] = 0x7E; /* F16 NaN */
    const char *path = in_tmp("half.safetensors");
    write_st(path,
             "{\"h\":{\"dtype\":\"F16\",\"shape\":[2,5],\"data_offsets\":[0,20]},"
             "\"b\":{\"dtype\":\"BF16\",\"shape\":[6],\"data_offsets\":[20,32]},"
             "\"n\":{\"dtype\":\"F16\",\"shape\":[],\"data_offsets\":[32,34]}}",
             data, n);
    moe_st_file *f;
    cr_assert_eq(moe_st_open(&f, path), MOE_OK, "%s", moe_last_error());
    float out[10];
    cr_assert_eq(moe_st_load_f32(out, f, "h", 2, (const int64_t[]){2, 5}), MOE_OK, "%s", moe_last_error());
    for (int i = 0; i < 10; i++)
        cr_expect(out[i] == f16_want[i] && !signbit(out[i]) == !signbit(f16_want[i]), "F16 [%d] = %.9g, want %.9g", i,
                  out[i], f16_want[i]);
    cr_assert_eq(moe_st_load_f32(out, f, "b", 1, (const int64_t[]){6}), MOE_OK, "%s", moe_last_error());
    for (int i = 0; i < 6; i++)
        cr_expect(out[i] == bf16_want[i] && !signbit(out[i]) == !signbit(bf16_want[i]), "BF16 [%d] = %.9g, want %.9g",
                  i, out[i], bf16_want[i]);
    const moe_st_tensor *t = moe_st_find(f, "n");
    cr_assert_not_null(t);
    cr_expect_eq(t->ndim, 0);
    cr_expect_eq(t->numel, 1);
    moe_st_read_f32(out, t);
    cr_expect(isnan(out[0]), "F16 0x7E00 read as %g", out[0]);
    cr_expect_null(moe_st_metadata(f, "format"), "this file has no metadata");
    moe_st_close(f);
}

/* ------------------------------------------------------------- round trip */

Test(safetensors, write_then_read_is_bitwise_equal, .init = make_tmpdir, .fini = remove_tmpdir) {
    float a[2 * 3], scalar[1] = {-0.0f}, c[4 * 2 * 3];
    uint32_t special[] = {0x7FC00001u, 0xFF800000u, 0x00000001u, 0x80000000u, 0x7F7FFFFFu, 0x3F800000u};
    memcpy(a, special, sizeof a);
    for (int i = 0; i < 24; i++) c[i] = (float)i * 0.37f - 3.0f;
    const moe_st_entry entries[] = {
        {"model.layers.0.block_sparse_moe.experts.7.w1.weight", a, 2, (const int64_t[]){2, 3}},
        {"scalar", scalar, 0, NULL},
        {"empty", NULL, 2, (const int64_t[]){0, 5}},
        {"c \"quoted\" \xc3\xa9", c, 3, (const int64_t[]){4, 2, 3}},
    };
    const moe_st_meta meta[] = {{"step", "12"}, {"note", "line\nbreak \"q\""}};
    const char *path = in_tmp("model.safetensors");
    cr_assert_eq(moe_st_write(path, entries, 4, meta, 2), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(leftover_temps(), 0);

    size_t size;
    unsigned char *raw = read_bytes(path, &size);
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) n = n << 8 | raw[i];
    cr_expect_eq(n % 8, 0, "header length %llu is not a multiple of 8", (unsigned long long)n);
    cr_expect(memcmp(raw + 8, "{\"__metadata__\":{\"format\":\"pt\",\"step\":\"12\"", 42) == 0,
              "header begins %.60s", raw + 8);
    cr_expect_eq(size, 8 + n + sizeof a + sizeof scalar + sizeof c);
    /* tensors packed back to back in the order given */
    cr_expect(memcmp(raw + 8 + n, a, sizeof a) == 0);
    cr_expect(memcmp(raw + 8 + n + sizeof a, scalar, sizeof scalar) == 0);
    cr_expect(memcmp(raw + 8 + n + sizeof a + sizeof scalar, c, sizeof c) == 0);
    free(raw);

    moe_st_file *f;
    cr_assert_eq(moe_st_open(&f, path), MOE_OK, "%s", moe_last_error());
    cr_assert_eq(moe_st_tensor_count(f), 4);
    for (int64_t i = 0; i < 4; i++) {
        const moe_st_tensor *t = moe_st_tensor_at(f, i);
        cr_expect_str_eq(t->name, entries[i].name);
        cr_expect_eq(t->dtype, MOE_ST_F32);
        cr_assert_eq(t->ndim, entries[i].ndim);
        for (int64_t d = 0; d < t->ndim; d++) cr_expect_eq(t->shape[d], entries[i].shape[d]);
        cr_expect_eq(moe_st_find(f, entries[i].name), t);
    }
    cr_expect_eq(moe_st_tensor_at(f, 0)->offset % 8, 0, "data does not start 8-byte aligned");
    cr_expect_null(moe_st_find(f, "absent"));
    cr_expect_null(moe_st_tensor_at(f, 4));
    cr_expect_str_eq(moe_st_metadata(f, "format"), "pt");
    cr_expect_str_eq(moe_st_metadata(f, "step"), "12");
    cr_expect_str_eq(moe_st_metadata(f, "note"), "line\nbreak \"q\"");
    cr_expect_eq(moe_st_metadata_count(f), 5);
    /* The checksums of the data, in the order of the names: c..., empty,
     * model..., scalar (strcmp). */
    char want[64];
    snprintf(want, sizeof want, "%08x,00000000,%08x,%08x", moe_crc32c(0, c, sizeof c), moe_crc32c(0, a, sizeof a),
             moe_crc32c(0, scalar, sizeof scalar));
    cr_expect_str_eq(moe_st_metadata(f, "moe_crc32c"), want);
    cr_expect_not_null(moe_st_metadata(f, "moe_meta_crc32c"));
    for (int64_t i = 0; i < 4; i++) {
        cr_expect(moe_st_tensor_at(f, i)->has_crc, "tensor %lld has no checksum", (long long)i);
        cr_expect_eq(moe_st_verify(moe_st_tensor_at(f, i), path), MOE_OK, "%s", moe_last_error());
    }

    float back[24];
    cr_assert_eq(moe_st_load_f32(back, f, entries[0].name, 2, (const int64_t[]){2, 3}), MOE_OK);
    cr_expect(memcmp(back, a, sizeof a) == 0, "tensor a changed in the round trip");
    cr_assert_eq(moe_st_load_f32(back, f, "scalar", 0, NULL), MOE_OK);
    cr_expect(memcmp(back, scalar, sizeof scalar) == 0);
    cr_assert_eq(moe_st_load_f32(back, f, entries[3].name, 3, (const int64_t[]){4, 2, 3}), MOE_OK);
    for (int i = 0; i < 24; i++) cr_expect(memcmp(&back[i], &c[i], 4) == 0, "c[%d]: %.9g != %.9g", i, back[i], c[i]);
    cr_expect_eq(moe_st_find(f, "empty")->numel, 0);

    cr_expect_eq(moe_st_load_f32(back, f, entries[0].name, 2, (const int64_t[]){3, 2}), MOE_ERR_FORMAT);
    cr_expect(strstr(moe_last_error(), "has shape [2, 3], expected [3, 2]") != NULL, "%s", moe_last_error());
    cr_expect(strstr(moe_last_error(), path) != NULL, "%s", moe_last_error());
    cr_expect_eq(moe_st_load_f32(back, f, "nope", 1, (const int64_t[]){1}), MOE_ERR_FORMAT);
    cr_expect(strstr(moe_last_error(), "no tensor named 'nope'") != NULL, "%s", moe_last_error());
    moe_st_close(f);
}

Test(safetensors, writer_rejects_bad_arguments, .init = make_tmpdir, .fini = remove_tmpdir) {
    float x[4] = {0};
    const char *path = in_tmp("w.safetensors");
    const struct {
        moe_st_entry e[2];
        int64_t n;
        moe_st_meta m[2];
        int64_t nm;
        const char *want;
    } cases[] = {
        {{{"a", x, 1, (const int64_t[]){2}}, {"a", x, 1, (const int64_t[]){2}}}, 2, {{0}}, 0, "'a' given twice"},
        {{{"a", x, 1, (const int64_t[]){-2}}}, 1, {{0}}, 0, "shape[0] = -2 is negative"},
        {{{"__metadata__", x, 1, (const int64_t[]){2}}}, 1, {{0}}, 0, "cannot name a tensor"},
        {{{"", x, 1, (const int64_t[]){2}}}, 1, {{0}}, 0, "has no name"},
        {{{"a", NULL, 1, (const int64_t[]){2}}}, 1, {{0}}, 0, "'a': NULL data"},
        {{{"a", x, 3, (const int64_t[]){1LL << 40, 1LL << 40, 1LL << 40}}}, 1, {{0}}, 0, "overflows"},
        {{{"a", x, 1, (const int64_t[]){2}}}, 1, {{"format", "tf"}}, 1, "\"format\" is reserved"},
        {{{"a", x, 1, (const int64_t[]){2}}}, 1, {{"k", "1"}, {"moe_crc32c", "0"}}, 2, "\"moe_crc32c\" is reserved"},
        {{{"a", x, 1, (const int64_t[]){2}}}, 1, {{"moe_meta_crc32c", "0"}}, 1, "\"moe_meta_crc32c\" is reserved"},
        {{{"a", x, 1, (const int64_t[]){2}}}, 1, {{"k", "1"}, {"k", "2"}}, 2, "metadata key 'k' given twice"},
        {{{"a\xff", x, 1, (const int64_t[]){2}}}, 1, {{0}}, 0, "invalid UTF-8"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        moe_status st = moe_st_write(path, cases[i].e, cases[i].n, cases[i].m, cases[i].nm);
        cr_expect_eq(st, MOE_ERR_INVALID_ARG, "case %zu accepted", i);
        cr_expect(strstr(moe_last_error(), cases[i].want) != NULL, "case %zu: \"%s\" lacks \"%s\"", i,
                  moe_last_error(), cases[i].want);
        cr_expect(strstr(moe_last_error(), path) != NULL, "case %zu: \"%s\" does not name the file", i,
                  moe_last_error());
        cr_expect_neq(access(path, F_OK), 0, "case %zu left a file", i);
    }
    cr_expect_eq(leftover_temps(), 0);
}

/* ------------------------------------------------------------- corruption */

typedef struct bad_case {
    const char *what;
    uint64_t declared; /* 0: the header's real length */
    const char *header;
    size_t data_len; /* bytes of zero data after the header */
    moe_status status;
    const char *want;
} bad_case;

/* One header entry: "name":{"dtype":..,"shape":..,"data_offsets":[b,e]} */
#define T(name, dtype, shape, b, e)                                                                                \
    "\"" name "\":{\"dtype\":\"" dtype "\",\"shape\":" shape ",\"data_offsets\":[" #b "," #e "]}"

static const bad_case bad_cases[] = {
    {"bad JSON", 0, "{\"a\":{\"dtype\":\"F32\",}}", 0, MOE_ERR_FORMAT, ":1:21: unexpected character '}'"},
    {"non-object header", 0, "[1, 2]", 0, MOE_ERR_FORMAT, "the header does not start with '{'"},
    {"empty header", 0, "", 0, MOE_ERR_FORMAT, "the header does not start with '{'"},
    {"unknown dtype", 0, "{" T("w", "Q9", "[1]", 0, 4) "}", 4, MOE_ERR_FORMAT, "tensor 'w' has unknown dtype \"Q9\""},
    {"unsupported dtype", 0, "{" T("w", "I64", "[1]", 0, 8) "}", 8, MOE_ERR_UNSUPPORTED,
     "tensor 'w' has dtype I64; only F32, BF16 and F16"},
    {"shape/offset mismatch", 0, "{" T("w", "F32", "[2,2]", 0, 12) "}", 12, MOE_ERR_FORMAT,
     "tensor 'w': data_offsets [0, 12] hold 12 bytes, but F32 with 4 elements needs 16"},
    {"overlap", 0, "{" T("a", "F32", "[2]", 0, 8) "," T("b", "F32", "[2]", 4, 12) "}", 12, MOE_ERR_FORMAT,
     "tensor 'b' at data bytes [4, 12) overlaps tensor 'a' at [0, 8)"},
    {"gap", 0, "{" T("a", "F32", "[2]", 0, 8) "," T("b", "F32", "[2]", 12, 20) "}", 20, MOE_ERR_FORMAT,
     "tensor 'b' begins at byte 12 of the data, leaving a gap of 4 bytes after tensor 'a'"},
    {"gap at start", 0, "{" T("a", "F32", "[2]", 4, 12) "}", 12, MOE_ERR_FORMAT,
     "tensor 'a' begins at byte 4 of the data, leaving a gap of 4 bytes after the start"},
    {"trailing bytes", 0, "{" T("a", "F32", "[2]", 0, 8) "," T("b", "F16", "[2]", 8, 12) "}", 15, MOE_ERR_FORMAT,
     "3 bytes after the end of the last tensor 'b'"},
    {"truncated", 0, "{" T("a", "F32", "[2]", 0, 8) "," T("b", "F32", "[2]", 8, 16) "}", 13, MOE_ERR_FORMAT,
     "truncated: tensor 'b' ends at data byte 16 but the file holds 13"},
    {"duplicate name", 0, "{" T("a", "F32", "[1]", 0, 4) "," T("a", "F32", "[1]", 4, 8) "}", 8, MOE_ERR_FORMAT,
     "duplicate key \"a\""},
    {"negative shape", 0, "{" T("w", "F32", "[-2]", 0, 8) "}", 8, MOE_ERR_FORMAT,
     "tensor 'w': shape[0] = -2 is not a non-negative integer"},
    {"fractional shape", 0, "{" T("w", "F32", "[2.0]", 0, 8) "}", 8, MOE_ERR_FORMAT,
     "tensor 'w': shape[0] = 2.0 is not a non-negative integer"},
    {"shape overflow", 0, "{" T("w", "F32", "[4294967296,4294967296,4]", 0, 8) "}", 8, MOE_ERR_FORMAT,
     "tensor 'w': the element count of its shape overflows"},
    {"byte size overflow", 0, "{" T("w", "F32", "[4294967296,1073741824]", 0, 8) "}", 8, MOE_ERR_FORMAT,
     "tensor 'w': its byte size overflows"},
    {"end before begin", 0, "{" T("w", "F32", "[0]", 8, 0) "}", 8, MOE_ERR_FORMAT,
     "tensor 'w': data_offsets [8, 0] end before they begin"},
    {"offsets not a pair", 0, "{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0]}}", 4, MOE_ERR_FORMAT,
     "tensor 'w': data_offsets is not [begin, end]"},
    {"missing field", 0, "{\"w\":{\"dtype\":\"F32\",\"shape\":[1]}}", 4, MOE_ERR_FORMAT,
     "tensor 'w': missing \"data_offsets\""},
    {"extra field", 0, "{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4],\"x\":1}}", 4,
     MOE_ERR_FORMAT, "tensor 'w': unexpected field \"x\""},
    {"entry not an object", 0, "{\"w\":[1]}", 0, MOE_ERR_FORMAT, "tensor 'w': entry is a JSON array"},
    {"dtype not a string", 0, "{\"w\":{\"dtype\":4,\"shape\":[1],\"data_offsets\":[0,4]}}", 4, MOE_ERR_FORMAT,
     "tensor 'w': dtype is a JSON number"},
    {"metadata value not a string", 0, "{\"__metadata__\":{\"format\":\"pt\",\"n\":1}}", 0, MOE_ERR_FORMAT,
     "__metadata__[\"n\"] is a JSON number, not a string"},
    {"metadata not an object", 0, "{\"__metadata__\":\"pt\"}", 0, MOE_ERR_FORMAT,
     "__metadata__ is a JSON string, not an object"},
    {"NUL in a name", 0, "{\"a\\u0000b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4,
     MOE_ERR_FORMAT, "contains a NUL character"},
    {"NUL in dtype", 0, "{\"w\":{\"dtype\":\"F32\\u0000garbage\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4,
     MOE_ERR_FORMAT, "tensor 'w': dtype \"F32...\" contains a NUL character"},
    {"NUL in a field name", 0,
     "{\"w\":{\"dtype\\u0000x\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4, MOE_ERR_FORMAT,
     "tensor 'w': field \"dtype...\" contains a NUL character"},
    {"NUL in a metadata value", 0, "{\"__metadata__\":{\"format\":\"pt\\u0000x\"}}", 0, MOE_ERR_FORMAT,
     "__metadata__ entry \"format\" contains a NUL character"},
    {"invalid UTF-8 name", 0, "{\"a\xc0\xaf\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4,
     MOE_ERR_FORMAT, ":1:4: invalid UTF-8 byte 0xC0"},
    {"header length past end", 1000, "{}", 0, MOE_ERR_FORMAT,
     "header length 1000 runs past the end of the 10-byte file"},
    {"header length huge", 1ull << 40, "{}", 0, MOE_ERR_FORMAT, "header length 1099511627776 exceeds the limit"},
    {"header length over 100 MB", 100000001, "{}", 0, MOE_ERR_FORMAT, "exceeds the limit of 100000000 bytes"},
};

Test(safetensors, every_corruption_is_rejected_naming_it, .init = make_tmpdir, .fini = remove_tmpdir) {
    const char *path = in_tmp("bad.safetensors");
    static const unsigned char zeros[64];
    for (size_t i = 0; i < sizeof bad_cases / sizeof *bad_cases; i++) {
        const bad_case *c = &bad_cases[i];
        write_raw(path, c->declared ? c->declared : strlen(c->header), c->header, zeros, c->data_len);
        moe_st_file *f = (moe_st_file *)1;
        moe_status st = moe_st_open(&f, path);
        cr_expect_eq(st, c->status, "%s: status %d (%s)", c->what, st, moe_last_error());
        cr_expect_null(f, "%s: handle not cleared", c->what);
        cr_expect(strstr(moe_last_error(), c->want) != NULL, "%s: \"%s\" lacks \"%s\"", c->what, moe_last_error(),
                  c->want);
        cr_expect(strncmp(moe_last_error(), path, strlen(path)) == 0, "%s: \"%s\" does not start with the file",
                  c->what, moe_last_error());
        if (st == MOE_OK) moe_st_close(f);
    }
}

Test(safetensors, short_and_missing_files, .init = make_tmpdir, .fini = remove_tmpdir) {
    const char *path = in_tmp("short.safetensors");
    write_bytes(path, "\x02\0\0", 3);
    moe_st_file *f;
    cr_expect_eq(moe_st_open(&f, path), MOE_ERR_FORMAT);
    cr_expect(strstr(moe_last_error(), "file is 3 bytes, too short") != NULL, "%s", moe_last_error());
    cr_expect_eq(moe_st_open(&f, in_tmp("absent.safetensors")), MOE_ERR_IO);
    cr_expect(strstr(moe_last_error(), "absent.safetensors: cannot open") != NULL, "%s", moe_last_error());
    cr_expect_eq(moe_st_open(&f, tmpdir), MOE_ERR_IO, "a directory opened as a file");

    /* A valid file cut short by 4 bytes. */
    float x[4] = {1, 2, 3, 4};
    const moe_st_entry e = {"x", x, 1, (const int64_t[]){4}};
    cr_assert_eq(moe_st_write(path, &e, 1, NULL, 0), MOE_OK, "%s", moe_last_error());
    struct stat sb;
    cr_assert_eq(stat(path, &sb), 0);
    cr_assert_eq(truncate(path, sb.st_size - 4), 0);
    cr_assert_eq(moe_st_open(&f, path), MOE_ERR_FORMAT, "a truncated file opened");
    cr_expect(strstr(moe_last_error(), "truncated: tensor 'x' ends at data byte 16 but the file holds 12") != NULL,
              "%s", moe_last_error());
}

/* Zero tensors is a valid file; so is a header padded with spaces. */
Test(safetensors, empty_and_padded, .init = make_tmpdir, .fini = remove_tmpdir) {
    const char *path = in_tmp("e.safetensors");
    cr_assert_eq(moe_st_write(path, NULL, 0, NULL, 0), MOE_OK, "%s", moe_last_error());
    moe_st_file *f;
    cr_assert_eq(moe_st_open(&f, path), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(moe_st_tensor_count(f), 0);
    cr_expect_str_eq(moe_st_metadata(f, "format"), "pt");
    moe_st_close(f);
    float v = 5.0f;
    write_st(path, "{" T("v", "F32", "[1]", 0, 4) "}     ", &v, 4);
    cr_assert_eq(moe_st_open(&f, path), MOE_OK, "%s", moe_last_error());
    float out;
    moe_st_read_f32(&out, moe_st_find(f, "v"));
    cr_expect_eq(out, 5.0f);
    moe_st_close(f);
    /* Empty tensors share offsets with their neighbours without overlapping. */
    write_st(path, "{" T("e1", "F32", "[0]", 4, 4) "," T("v", "F32", "[1]", 0, 4) "," T("e0", "BF16", "[3,0]", 0, 0)
             "," T("e2", "F16", "[0,2]", 0, 0) "}", &v, 4);
    cr_assert_eq(moe_st_open(&f, path), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(moe_st_tensor_count(f), 4);
    cr_expect_eq(moe_st_find(f, "e0")->numel, 0);
    moe_st_close(f);
}

/* -------------------------------------------------------------- checksums */

static uint64_t header_length(const unsigned char *raw) {
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) n = n << 8 | raw[i];
    return n;
}

/* path with bit `bit` of raw [size] flipped. */
static void write_flipped(const char *path, unsigned char *raw, size_t size, size_t bit) {
    raw[bit / 8] ^= (unsigned char)(1u << (bit % 8));
    write_bytes(path, raw, size);
    raw[bit / 8] ^= (unsigned char)(1u << (bit % 8));
}

static const float small_w[3 * 5] = {0.9998f, -1.0f, 2.0f, 0.5f, -0.25f, 3.0f, 1e-3f, 7.0f,
                                     -8.0f,   9.5f,  0.0f, 1.0f, 2.0f,   3.0f, 4.0f};
static const float small_b[4] = {0.1f, 0.2f, 0.3f, 0.4f}, small_s[1] = {42.0f};

/* Three tensors and a metadata entry, written by moe_st_write to path:
 * its bytes [*size] (free() them), the data from *data_start on. */
static unsigned char *write_small(const char *path, size_t *size, size_t *data_start) {
    const moe_st_entry e[] = {
        {"w", small_w, 2, (const int64_t[]){3, 5}}, {"b", small_b, 1, (const int64_t[]){4}}, {"s", small_s, 0, NULL}};
    const moe_st_meta meta[] = {{"step", "12"}};
    cr_assert_eq(moe_st_write(path, e, 3, meta, 1), MOE_OK, "%s", moe_last_error());
    unsigned char *raw = read_bytes(path, size);
    *data_start = 8 + (size_t)header_length(raw);
    return raw;
}

/* Every single-bit flip anywhere in a file we wrote is refused: in the
 * header by moe_st_open (the structure checks or the header's checksum),
 * in the data by the load of the tensor holding it, naming the file and
 * that tensor, while the others still load. */
Test(safetensors, every_single_bit_flip_is_refused, .init = make_tmpdir, .fini = remove_tmpdir) {
    const char *bad = in_tmp("flipped.safetensors");
    size_t size, data_start;
    unsigned char *raw = write_small(in_tmp("small.safetensors"), &size, &data_start);
    cr_assert_eq(size, data_start + sizeof small_w + sizeof small_b + sizeof small_s);
    int header_flips = 0, data_flips = 0;
    for (size_t bit = 0; bit < 8 * size; bit++) {
        write_flipped(bad, raw, size, bit);
        moe_st_file *f = NULL;
        const moe_status st = moe_st_open(&f, bad);
        if (bit / 8 < data_start) {
            cr_assert_neq(st, MOE_OK, "bit %zu of %zu in the header was flipped and the file opened", bit % 8,
                          bit / 8);
            cr_assert(strstr(moe_last_error(), bad) != NULL, "bit %zu: \"%s\" does not name the file", bit,
                      moe_last_error());
            header_flips++;
            continue;
        }
        cr_assert_eq(st, MOE_OK, "bit %zu of data byte %zu: %s", bit % 8, bit / 8 - data_start, moe_last_error());
        int refused = 0;
        for (int64_t i = 0; i < moe_st_tensor_count(f); i++) {
            const moe_st_tensor *t = moe_st_tensor_at(f, i);
            float out[15];
            const bool holds = (int64_t)(bit / 8) >= t->offset && (int64_t)(bit / 8) < t->offset + t->nbytes;
            const moe_status got = moe_st_load_f32(out, f, t->name, t->ndim, t->shape);
            if (!holds) {
                cr_assert_eq(got, MOE_OK, "bit %zu flipped outside '%s': %s", bit, t->name, moe_last_error());
                continue;
            }
            refused++;
            char want[640];
            snprintf(want, sizeof want, "%s: tensor '%s': its bytes' checksum is 0x", bad, t->name);
            cr_assert_eq(got, MOE_ERR_FORMAT, "bit %zu flipped in '%s' loaded", bit, t->name);
            cr_assert(strstr(moe_last_error(), want) != NULL && strstr(moe_last_error(), "the file is damaged"),
                      "bit %zu: \"%s\" lacks \"%s\"", bit, moe_last_error(), want);
            cr_assert_eq(moe_st_verify(t, bad), MOE_ERR_FORMAT);
        }
        cr_assert_eq(refused, 1, "bit %zu: %d tensors refused", bit, refused);
        data_flips++;
        moe_st_close(f);
    }
    cr_expect_eq(data_flips, 8 * 80, "the data's last byte must be among the flips");
    cr_expect_gt(header_flips, 8 * 100);
    free(raw);
}

/* The header's checksum covers the metadata values, the checksum list and
 * the tensor names, which no structure check would catch. */
Test(safetensors, damaged_metadata_is_named, .init = make_tmpdir, .fini = remove_tmpdir) {
    const char *bad = in_tmp("flipped.safetensors");
    size_t size, header_end;
    unsigned char *raw = write_small(in_tmp("small.safetensors"), &size, &header_end);
    /* step "12" -> "13"; a decimal digit of the checksum list (the lowest
     * bit keeps it a digit); the name "w" -> "v"; the list's key name
     * ("moe_arc32c"), leaving the other key alone. */
    const struct {
        const char *find; /* in the header text */
        size_t at;        /* the byte of it to flip, or from where to look for a digit */
        int bit;
        const char *want;
    } cases[] = {
        {"\"step\":\"12\"", 9, 0, "not the 0x"},
        {"\"moe_crc32c\":\"", 14, 0, "not the 0x"},
        {"\"w\":{", 1, 0, "not the 0x"},
        {"\"moe_crc32c\"", 5, 1, "__metadata__ has \"moe_meta_crc32c\" but not \"moe_crc32c\""},
    };
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        size_t at = 0;
        for (size_t i = 8; at == 0 && i + strlen(cases[c].find) <= header_end; i++)
            if (memcmp(raw + i, cases[c].find, strlen(cases[c].find)) == 0) at = i + cases[c].at;
        cr_assert_neq(at, 0, "no %s in the header", cases[c].find);
        if (c == 1)
            while (raw[at] < '0' || raw[at] > '9') at++;
        write_flipped(bad, raw, size, 8 * at + (size_t)cases[c].bit);
        moe_st_file *f = (moe_st_file *)1;
        cr_expect_eq(moe_st_open(&f, bad), MOE_ERR_FORMAT, "case %zu opened", c);
        cr_expect_null(f);
        cr_expect(strstr(moe_last_error(), bad) != NULL && strstr(moe_last_error(), cases[c].want) != NULL &&
                      strstr(moe_last_error(), "damaged") != NULL,
                  "case %zu: \"%s\" lacks \"%s\"", c, moe_last_error(), cases[c].want);
    }
    free(raw);
}

/* text [*n] += s and a NUL: safetensors.h's text under "moe_meta_crc32c". */
static void append_z(char *text, size_t *n, const char *s) {
    memcpy(text + *n, s, strlen(s) + 1);
    *n += strlen(s) + 1;
}

/* A header rewritten by another tool, its tensors and metadata in another
 * order, keeps its checksums (they go by name; computed here from the
 * documented text, apart from the writer), and a flipped bit is still
 * blamed on the tensor that holds it. */
Test(safetensors, checksums_go_by_name_not_order, .init = make_tmpdir, .fini = remove_tmpdir) {
    const float a[3] = {1.0f, 0.9998f, -2.5f}, b[2] = {3.0f, 4.0f};
    char list[32], text[256], header[640];
    snprintf(list, sizeof list, "%08x,%08x", moe_crc32c(0, a, sizeof a), moe_crc32c(0, b, sizeof b));
    size_t n = 0;
    const char *const parts[] = {"format", "pt", "moe_crc32c", list, "step", "7", "a", "b"};
    for (size_t i = 0; i < sizeof parts / sizeof *parts; i++) append_z(text, &n, parts[i]);
    snprintf(header, sizeof header,
             "{\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
             "\"__metadata__\":{\"step\":\"7\",\"moe_meta_crc32c\":\"%08x\",\"moe_crc32c\":\"%s\",\"format\":\"pt\"},"
             "\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[8,20]}}",
             moe_crc32c(0, text, n), list);
    unsigned char data[20];
    memcpy(data, b, sizeof b);
    memcpy(data + sizeof b, a, sizeof a);
    const char *path = in_tmp("reordered.safetensors");
    write_st(path, header, data, sizeof data);
    moe_st_file *f;
    cr_assert_eq(moe_st_open(&f, path), MOE_OK, "%s", moe_last_error());
    float out[3];
    cr_expect_eq(moe_st_load_f32(out, f, "a", 1, (const int64_t[]){3}), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(moe_st_load_f32(out, f, "b", 1, (const int64_t[]){2}), MOE_OK, "%s", moe_last_error());
    cr_expect(moe_st_find(f, "a")->has_crc && moe_st_find(f, "a")->crc32c == moe_crc32c(0, a, sizeof a));
    moe_st_close(f);

    data[sizeof b + 7] ^= 0x40; /* bit 30 of a's second element: 0.9998 -> 3.4e38 */
    write_st(path, header, data, sizeof data);
    cr_assert_eq(moe_st_open(&f, path), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(moe_st_load_f32(out, f, "b", 1, (const int64_t[]){2}), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(moe_st_load_f32(out, f, "a", 1, (const int64_t[]){3}), MOE_ERR_FORMAT);
    cr_expect(strstr(moe_last_error(), "tensor 'a': its bytes' checksum is 0x") != NULL, "%s", moe_last_error());

    /* moe_st_verify_all: NULLs skipped, repeats checked once, the error
     * that of the first listed. */
    const moe_st_tensor *ta = moe_st_find(f, "a"), *tb = moe_st_find(f, "b");
    const char *paths[] = {"one", "two", "three", "four", "five"};
    cr_expect_eq(moe_st_verify_all((const moe_st_tensor *[]){tb, NULL, tb, ta, ta}, paths, 5), MOE_ERR_FORMAT);
    cr_expect(strstr(moe_last_error(), "four: tensor 'a'") != NULL, "%s", moe_last_error());
    cr_expect_eq(moe_st_verify_all((const moe_st_tensor *[]){tb, NULL, tb}, paths, 3), MOE_OK, "%s",
                 moe_last_error());
    cr_expect_eq(moe_st_verify_all(NULL, NULL, 0), MOE_OK);
    moe_st_close(f);
}

/* Another tool's file has no checksums: it loads as before, unchecked. */
Test(safetensors, files_without_checksums_load, .init = make_tmpdir, .fini = remove_tmpdir) {
    const float a[3] = {1.0f, 3.4e38f, -2.5f};
    const char *path = in_tmp("theirs.safetensors");
    write_st(path, "{\"__metadata__\":{\"format\":\"pt\"},\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,12]}}",
             a, sizeof a);
    moe_st_file *f;
    cr_assert_eq(moe_st_open(&f, path), MOE_OK, "%s", moe_last_error());
    cr_expect_not(moe_st_find(f, "a")->has_crc);
    cr_expect_eq(moe_st_verify(moe_st_find(f, "a"), path), MOE_OK);
    float out[3];
    cr_expect_eq(moe_st_load_f32(out, f, "a", 1, (const int64_t[]){3}), MOE_OK, "%s", moe_last_error());
    cr_expect(memcmp(out, a, sizeof a) == 0);
    moe_st_close(f);
}

/* Checksum keys of the wrong form, count or value are refused at open. */
Test(safetensors, malformed_checksums_are_refused, .init = make_tmpdir, .fini = remove_tmpdir) {
    const float data[2] = {1.0f, 2.0f};
    char list[32], text[128], good[16];
    snprintf(list, sizeof list, "%08x,%08x", moe_crc32c(0, &data[0], 4), moe_crc32c(0, &data[1], 4));
    size_t n = 0;
    const char *const parts[] = {"format", "pt", "moe_crc32c", list, "a", "b"};
    for (size_t i = 0; i < sizeof parts / sizeof *parts; i++) append_z(text, &n, parts[i]);
    snprintf(good, sizeof good, "%08x", moe_crc32c(0, text, n));
    const struct {
        const char *list, *meta; /* NULL: the key is left out */
        const char *want;
    } cases[] = {
        {list, NULL, "__metadata__ has \"moe_crc32c\" but not \"moe_meta_crc32c\""},
        {NULL, good, "__metadata__ has \"moe_meta_crc32c\" but not \"moe_crc32c\""},
        {list, "0000000", "\"moe_meta_crc32c\" is \"0000000\", not 8 lowercase hex digits"},
        {list, "0000000g", "\"moe_meta_crc32c\" is \"0000000g\", not 8 lowercase hex digits"},
        {list, "000000000", "\"moe_meta_crc32c\" is \"000000000\", not 8 lowercase hex digits"},
        {"", good, "\"moe_crc32c\" lists 0 checksums for 2 tensors"},
        {"00000000", good, "\"moe_crc32c\" lists 1 checksum for 2 tensors"},
        {"00000000,00000000,00000000", good, "\"moe_crc32c\" lists 3 checksums for 2 tensors"},
        {"00000000;00000000", good, "\"moe_crc32c\" lists 1 checksum for 2 tensors"},
        {"0000000A,00000000", good, "\"moe_crc32c\" entry 0, \"0000000A,000\", is not 8 lowercase hex digits"},
        {"00000000,0000000x", good, "\"moe_crc32c\" entry 1, \"0000000x\", is not 8 lowercase hex digits"},
        {"0000000,000000000", good, "\"moe_crc32c\" entry 0"},
        {"00000000,000000001", good, "\"moe_crc32c\" entry 1, \"000000001\""},
        {"00000000, 0000000", good, "\"moe_crc32c\" entry 1"},
        {"-0000000,00000000", good, "\"moe_crc32c\" entry 0"},
        {list, "00000000", "the header's checksum is 0x"},
    };
    const char *path = in_tmp("crc.safetensors");
    for (size_t c = 0; c < sizeof cases / sizeof *cases + 1; c++) {
        const bool last = c == sizeof cases / sizeof *cases; /* the good file */
        char meta[160] = "", header[512];
        const char *l = last ? list : cases[c].list, *m = last ? good : cases[c].meta;
        size_t k = 0;
        if (l) k += (size_t)snprintf(meta + k, sizeof meta - k, ",\"moe_crc32c\":\"%s\"", l);
        if (m) k += (size_t)snprintf(meta + k, sizeof meta - k, ",\"moe_meta_crc32c\":\"%s\"", m);
        snprintf(header, sizeof header,
                 "{\"__metadata__\":{\"format\":\"pt\"%s},\"a\":{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[0,4]},"
                 "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}",
                 meta);
        write_st(path, header, data, sizeof data);
        moe_st_file *f = (moe_st_file *)1;
        const moe_status st = moe_st_open(&f, path);
        if (last) {
            cr_expect_eq(st, MOE_OK, "the well-formed file: %s", moe_last_error());
            moe_st_close(f);
            continue;
        }
        cr_expect_eq(st, MOE_ERR_FORMAT, "case %zu opened", c);
        cr_expect_null(f);
        cr_expect(strstr(moe_last_error(), path) != NULL && strstr(moe_last_error(), cases[c].want) != NULL,
                  "case %zu: \"%s\" lacks \"%s\"", c, moe_last_error(), cases[c].want);
    }
}

/* A damaged shard is named with the tensor, through the directory's load. */
Test(safetensors, damaged_shard_is_named, .init = make_tmpdir, .fini = remove_tmpdir) {
    cr_assert_eq(moe_mkdir_p(in_tmp("one")), MOE_OK);
    const float z[3] = {1.0f, 2.0f, 0.9998f};
    const moe_st_entry e = {"z", z, 1, (const int64_t[]){3}};
    const char *path = in_tmp("one/model.safetensors");
    cr_assert_eq(moe_st_write(path, &e, 1, NULL, 0), MOE_OK, "%s", moe_last_error());
    size_t size;
    unsigned char *raw = read_bytes(path, &size);
    write_flipped(path, raw, size, 8 * size - 2); /* 0.9998 -> 3.4e38 */
    free(raw);
    moe_st_dir *d;
    cr_assert_eq(moe_st_dir_open(&d, in_tmp("one")), MOE_OK, "%s", moe_last_error());
    float out[3];
    cr_expect_eq(moe_st_dir_load_f32(out, d, "z", 1, (const int64_t[]){3}), MOE_ERR_FORMAT);
    char want[640];
    snprintf(want, sizeof want, "%s: tensor 'z': its bytes' checksum is 0x", path);
    cr_expect(strstr(moe_last_error(), want) != NULL, "\"%s\" lacks \"%s\"", moe_last_error(), want);
    moe_st_dir_close(d);
}

/* ---------------------------------------------------- sharded directories */

static void write_index(const char *dir_name, const char *text) {
    char path[600];
    snprintf(path, sizeof path, "%s/%s/model.safetensors.index.json", tmpdir, dir_name);
    cr_assert_eq(moe_file_write_atomic_buffer(path, text, strlen(text)), MOE_OK, "%s", moe_last_error());
}

static void write_shard(const char *dir_name, const char *file, const char *const *names, int n) {
    static float data[4][3];
    static const int64_t shape[] = {3};
    moe_st_entry e[4];
    for (int i = 0; i < n; i++) {
        data[i][0] = (float)i + (float)strlen(file);
        data[i][1] = 1.5f;
        data[i][2] = 2.5f;
        e[i] = (moe_st_entry){names[i], data[i], 1, shape};
    }
    char path[600];
    snprintf(path, sizeof path, "%s/%s/%s", tmpdir, dir_name, file);
    cr_assert_eq(moe_st_write(path, e, n, NULL, 0), MOE_OK, "%s", moe_last_error());
}

Test(safetensors, sharded_directory, .init = make_tmpdir, .fini = remove_tmpdir) {
    const char *dir = in_tmp("ckpt/sharded");
    cr_assert_eq(moe_mkdir_p(dir), MOE_OK, "%s", moe_last_error());
    write_shard("ckpt/sharded", "model-00001-of-00002.safetensors", (const char *[]){"a", "c"}, 2);
    write_shard("ckpt/sharded", "model-00002-of-00002.safetensors", (const char *[]){"b", "d"}, 2);
    write_index("ckpt/sharded", "{\"metadata\":{\"total_size\":48},\"weight_map\":{"
                                "\"d\":\"model-00002-of-00002.safetensors\","
                                "\"a\":\"model-00001-of-00002.safetensors\","
                                "\"b\":\"model-00002-of-00002.safetensors\","
                                "\"c\":\"model-00001-of-00002.safetensors\"}}");
    moe_st_dir *d;
    cr_assert_eq(moe_st_dir_open(&d, dir), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(moe_st_dir_shard_count(d), 2, "each shard opened once");
    cr_assert_eq(moe_st_dir_tensor_count(d), 4);
    const char *sorted[] = {"a", "b", "c", "d"};
    for (int i = 0; i < 4; i++) cr_expect_str_eq(moe_st_dir_tensor_at(d, i)->name, sorted[i]);
    const moe_st_file *file;
    const moe_st_tensor *t = moe_st_dir_find(d, "d", &file);
    cr_assert_not_null(t);
    cr_expect(strstr(moe_st_path(file), "model-00002-of-00002.safetensors") != NULL);
    float out[3];
    cr_assert_eq(moe_st_dir_load_f32(out, d, "d", 1, (const int64_t[]){3}), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(out[0], 1.0f + 32.0f, "got %g", out[0]);
    cr_expect_eq(out[2], 2.5f);
    cr_expect_eq(moe_st_dir_load_f32(out, d, "zz", 1, (const int64_t[]){3}), MOE_ERR_FORMAT);
    cr_expect(strstr(moe_last_error(), "no tensor named 'zz'") != NULL, "%s", moe_last_error());
    cr_expect_str_eq(moe_st_dir_index_path(d), in_dir(dir, "model.safetensors.index.json"));
    moe_st_dir_close(d);

    /* A shard tensor the weight_map leaves out, or puts in another shard,
     * would be passed over unseen: refused, naming the shard and tensor. */
    write_shard("ckpt/sharded", "model-00002-of-00002.safetensors", (const char *[]){"b", "d", "unlisted"}, 3);
    d = (moe_st_dir *)1;
    cr_expect_eq(moe_st_dir_open(&d, dir), MOE_ERR_FORMAT);
    cr_expect_null(d);
    char want[1024];
    snprintf(want, sizeof want, "%s: tensor 'unlisted' is not in the weight_map of %s",
             in_dir(dir, "model-00002-of-00002.safetensors"), in_dir(dir, "model.safetensors.index.json"));
    cr_expect(strstr(moe_last_error(), want) != NULL, "\"%s\" lacks \"%s\"", moe_last_error(), want);
    write_shard("ckpt/sharded", "model-00002-of-00002.safetensors", (const char *[]){"b", "d", "a"}, 3);
    cr_expect_eq(moe_st_dir_open(&d, dir), MOE_ERR_FORMAT);
    snprintf(want, sizeof want, "%s: tensor 'a' is there too, but the weight_map of %s puts it in %s",
             in_dir(dir, "model-00002-of-00002.safetensors"), in_dir(dir, "model.safetensors.index.json"),
             in_dir(dir, "model-00001-of-00002.safetensors"));
    cr_expect(strstr(moe_last_error(), want) != NULL, "\"%s\" lacks \"%s\"", moe_last_error(), want);
}

Test(safetensors, single_file_directory, .init = make_tmpdir, .fini = remove_tmpdir) {
    cr_assert_eq(moe_mkdir_p(in_tmp("one")), MOE_OK);
    write_shard("one", "model.safetensors", (const char *[]){"z", "y"}, 2);
    moe_st_dir *d;
    cr_assert_eq(moe_st_dir_open(&d, in_tmp("one")), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(moe_st_dir_tensor_count(d), 2);
    cr_expect_str_eq(moe_st_dir_tensor_at(d, 0)->name, "y");
    cr_expect_not_null(moe_st_dir_find(d, "z", NULL));
    cr_expect_null(moe_st_dir_index_path(d), "no index was read");
    moe_st_dir_close(d);

    /* With an index beside it, either may be the model: refused, naming
     * both, rather than one of them read without a word. */
    write_shard("one", "s1.safetensors", (const char *[]){"z", "y"}, 2);
    write_index("one", "{\"weight_map\":{\"z\":\"s1.safetensors\",\"y\":\"s1.safetensors\"}}");
    d = (moe_st_dir *)1;
    /* Only the user can tell which is the model: a config error, no retry. */
    cr_expect_eq(moe_st_dir_open(&d, in_tmp("one")), MOE_ERR_CONFIG);
    cr_expect_null(d);
    char want[1024];
    snprintf(want, sizeof want, "%s: holds both model.safetensors.index.json and model.safetensors", in_tmp("one"));
    cr_expect(strstr(moe_last_error(), want) != NULL, "\"%s\" lacks \"%s\"", moe_last_error(), want);
}

Test(safetensors, bad_directories, .init = make_tmpdir, .fini = remove_tmpdir) {
    const struct {
        const char *index;
        const char *want;
    } cases[] = {
        {"{\"weight_map\":{\"a\":\"s1.safetensors\",\"x\":\"s1.safetensors\"}}",
         "weight_map puts tensor 'x' in s1.safetensors, which does not hold it"},
        {"{\"weight_map\":{\"a\":\"../s1.safetensors\"}}", "is not a file name in the directory"},
        {"{\"weight_map\":{\"a\":\"missing.safetensors\"}}", "missing.safetensors: cannot open"},
        {"{\"weight_map\":{\"a\":1}}", "weight_map[\"a\"] is a JSON number"},
        {"{\"metadata\":{}}", "\"weight_map\" is missing"},
        {"[]", "top level is a JSON array"},
        {"{\"weight_map\":{", "model.safetensors.index.json:1:16: unexpected end of input"},
    };
    cr_assert_eq(moe_mkdir_p(in_tmp("bad")), MOE_OK);
    write_shard("bad", "s1.safetensors", (const char *[]){"a"}, 1);
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        write_index("bad", cases[i].index);
        moe_st_dir *d = (moe_st_dir *)1;
        cr_expect_neq(moe_st_dir_open(&d, in_tmp("bad")), MOE_OK, "case %zu accepted", i);
        cr_expect_null(d);
        cr_expect(strstr(moe_last_error(), cases[i].want) != NULL, "case %zu: \"%s\" lacks \"%s\"", i,
                  moe_last_error(), cases[i].want);
    }
    moe_st_dir *d;
    cr_expect_eq(moe_st_dir_open(&d, tmpdir), MOE_ERR_IO);
    cr_expect(strstr(moe_last_error(), "holds neither model.safetensors.index.json nor model.safetensors") != NULL,
              "%s", moe_last_error());
}

/* A directory that is not there, not a directory, or whose weights file is a
 * link to nothing is reported as that, not as one without weights files. */
Test(safetensors, missing_directory_and_dangling_links, .init = make_tmpdir, .fini = remove_tmpdir) {
    moe_st_dir *d = (moe_st_dir *)1;
    char want[1024];
    const char *absent = in_tmp("absent");
    cr_expect_eq(moe_st_dir_open(&d, absent), MOE_ERR_IO);
    cr_expect_null(d);
    snprintf(want, sizeof want, "%s: cannot open the checkpoint directory: %s", absent, strerror(ENOENT));
    cr_expect(strstr(moe_last_error(), want) != NULL, "\"%s\" lacks \"%s\"", moe_last_error(), want);

    write_bytes(in_tmp("file"), "x", 1);
    cr_expect_eq(moe_st_dir_open(&d, in_tmp("file")), MOE_ERR_IO);
    cr_expect(strstr(moe_last_error(), "file: not a directory") != NULL, "%s", moe_last_error());

    cr_assert_eq(symlink("absent", in_tmp("dir-link")), 0);
    cr_expect_eq(moe_st_dir_open(&d, in_tmp("dir-link")), MOE_ERR_IO);
    cr_expect(strstr(moe_last_error(), "dir-link: dangling symbolic link: its target 'absent' does not exist") !=
                  NULL,
              "%s", moe_last_error());
    /* A link to that link: it exists, the chain dangles. */
    cr_assert_eq(symlink("dir-link", in_tmp("to-link")), 0);
    cr_expect_eq(moe_st_dir_open(&d, in_tmp("to-link")), MOE_ERR_IO);
    cr_expect(strstr(moe_last_error(), "to-link: dangling symbolic link: its target 'dir-link' is a dangling link too"),
              "%s", moe_last_error());
    /* A file in it, as a config.json is read first: the link is named. */
    char *text;
    size_t n;
    cr_expect_eq(moe_file_read_all(&text, &n, in_dir(in_tmp("dir-link"), "config.json"), 1024), MOE_ERR_IO);
    cr_expect(strstr(moe_last_error(), "dir-link is a dangling symbolic link: its target 'absent' does not exist") !=
                  NULL,
              "%s", moe_last_error());

    const struct {
        const char *dir, *link, *index; /* index NULL: none written */
    } cases[] = {
        {"single", "model.safetensors", NULL},
        {"indexed", "model.safetensors.index.json", NULL},
        {"shard", "s1.safetensors", "{\"weight_map\":{\"a\":\"s1.safetensors\"}}"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        cr_assert_eq(moe_mkdir_p(in_tmp(cases[i].dir)), MOE_OK, "%s", moe_last_error());
        if (cases[i].index != NULL) write_index(cases[i].dir, cases[i].index);
        const char *link = in_dir(in_tmp(cases[i].dir), cases[i].link);
        cr_assert_eq(symlink("gone.safetensors", link), 0, "%s", link);
        cr_expect_eq(moe_st_dir_open(&d, in_tmp(cases[i].dir)), MOE_ERR_IO, "%s accepted", cases[i].dir);
        snprintf(want, sizeof want, "%s: dangling symbolic link: its target 'gone.safetensors' does not exist",
                 link);
        cr_expect(strstr(moe_last_error(), want) != NULL, "\"%s\" lacks \"%s\"", moe_last_error(), want);
    }

    /* Permissions do not bind root, so this part needs another user. */
    if (geteuid() != 0) {
        cr_assert_eq(moe_mkdir_p(in_tmp("locked")), MOE_OK);
        cr_assert_eq(chmod(in_tmp("locked"), 0), 0);
        cr_expect_eq(moe_st_dir_open(&d, in_tmp("locked")), MOE_ERR_IO);
        snprintf(want, sizeof want, "locked: cannot read the checkpoint directory: %s", strerror(EACCES));
        cr_expect(strstr(moe_last_error(), want) != NULL, "\"%s\" lacks \"%s\"", moe_last_error(), want);
        chmod(in_tmp("locked"), 0700);
    }
}

/* ------------------------------------------------------------------ fileio */

typedef struct failing_writer {
    int calls;
} failing_writer;

/* Writes half a new file, then fails as a full disk would. */
static moe_status write_then_fail(void *ctx, FILE *file) {
    failing_writer *fw = ctx;
    fw->calls++;
    MOE_TRY(moe_file_write_bytes(file, "NEW CONTENTS", 12));
    return moe_error(MOE_ERR_IO, "injected failure after 12 bytes");
}

Test(fileio, failed_write_leaves_old_file_intact, .init = make_tmpdir, .fini = remove_tmpdir) {
    const char *path = in_tmp("model.safetensors");
    float old[2] = {1.0f, 2.0f};
    const moe_st_entry e = {"w", old, 1, (const int64_t[]){2}};
    cr_assert_eq(moe_st_write(path, &e, 1, NULL, 0), MOE_OK, "%s", moe_last_error());
    size_t before_size;
    unsigned char *before = read_bytes(path, &before_size);

    failing_writer fw = {0};
    moe_status st = moe_file_write_atomic(path, write_then_fail, &fw);
    cr_expect_eq(st, MOE_ERR_IO);
    cr_expect_eq(fw.calls, 1);
    cr_expect(strstr(moe_last_error(), path) != NULL && strstr(moe_last_error(), "injected failure") != NULL,
              "%s", moe_last_error());
    size_t after_size;
    unsigned char *after = read_bytes(path, &after_size);
    cr_expect(after_size == before_size && memcmp(before, after, before_size) == 0, "the old file changed");
    cr_expect_eq(leftover_temps(), 0, "a temp file was left behind");
    moe_st_file *f;
    cr_expect_eq(moe_st_open(&f, path), MOE_OK, "%s", moe_last_error());
    moe_st_close(f);
    free(before);
    free(after);

    /* A rename that fails (the target is a directory) also leaves no temp. */
    const char *dir = in_tmp("adir");
    cr_assert_eq(moe_mkdir_p(dir), MOE_OK);
    cr_expect_neq(moe_file_write_atomic_buffer(dir, "x", 1), MOE_OK);
    cr_expect(strstr(moe_last_error(), "rename") != NULL, "%s", moe_last_error());
    cr_expect_eq(leftover_temps(), 0);
    struct stat sb;
    cr_expect(stat(dir, &sb) == 0 && S_ISDIR(sb.st_mode), "the directory was replaced");

    /* A missing parent directory fails cleanly. */
    cr_expect_eq(moe_file_write_atomic_buffer(in_tmp("no/such/file"), "x", 1), MOE_ERR_IO);
    cr_expect(strstr(moe_last_error(), "cannot create temp file") != NULL, "%s", moe_last_error());
}

Test(fileio, atomic_replace_and_read_back, .init = make_tmpdir, .fini = remove_tmpdir) {
    const char *path = in_tmp("f.txt");
    cr_assert_eq(moe_file_write_atomic_buffer(path, "first", 5), MOE_OK, "%s", moe_last_error());
    cr_assert_eq(moe_file_write_atomic_buffer(path, "second!", 7), MOE_OK, "%s", moe_last_error());
    char *data;
    size_t n;
    cr_assert_eq(moe_file_read_all(&data, &n, path, 7), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(n, 7);
    cr_expect_str_eq(data, "second!");
    free(data);
    cr_expect_eq(moe_file_read_all(&data, &n, path, 6), MOE_ERR_FORMAT);
    cr_expect(strstr(moe_last_error(), "file is 7 bytes, more than the limit of 6") != NULL, "%s", moe_last_error());
    cr_expect_null(data);
    cr_expect_eq(moe_file_read_all(&data, &n, in_tmp("nope"), 6), MOE_ERR_IO);
    cr_expect_eq(moe_file_read_all(&data, &n, tmpdir, 6), MOE_ERR_IO, "a directory read as a file");
    cr_expect_eq(leftover_temps(), 0);
}

Test(fileio, mkdir_p, .init = make_tmpdir, .fini = remove_tmpdir) {
    const char *deep = in_tmp("a//b/c/");
    cr_assert_eq(moe_mkdir_p(deep), MOE_OK, "%s", moe_last_error());
    struct stat sb;
    cr_expect(stat(in_tmp("a/b/c"), &sb) == 0 && S_ISDIR(sb.st_mode));
    cr_expect_eq(moe_mkdir_p(deep), MOE_OK, "an existing directory is fine");
    cr_assert_eq(moe_file_write_atomic_buffer(in_tmp("a/file"), "x", 1), MOE_OK);
    cr_expect_eq(moe_mkdir_p(in_tmp("a/file/d")), MOE_ERR_IO);
    cr_expect(strstr(moe_last_error(), "a/file: exists and is not a directory") != NULL, "%s", moe_last_error());
    cr_expect_eq(moe_fsync_dir(in_tmp("a/b")), MOE_OK);
    cr_expect_eq(moe_fsync_dir(in_tmp("zzz")), MOE_ERR_IO);
}
