/* JSON parser conformance (RFC 8259) and the writer. */
#define _DEFAULT_SOURCE /* mkstemp */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"
#include "engine/json.h"

static moe_json_doc *parse_ok(const char *text) {
    moe_json_doc *doc = NULL;
    moe_status st = moe_json_parse(&doc, text, strlen(text), "t.json");
    cr_assert_eq(st, MOE_OK, "parse of %s failed: %s", text, moe_last_error());
    return doc;
}

/* Parses text [len], expects failure with `want` inside the message. */
static void parse_bad_n(const char *text, size_t len, const char *want) {
    moe_json_doc *doc = NULL;
    moe_status st = moe_json_parse(&doc, text, len, "t.json");
    cr_expect_eq(st, MOE_ERR_FORMAT, "accepted invalid JSON %.*s", (int)len, text);
    cr_expect_null(doc);
    cr_expect(strstr(moe_last_error(), want) != NULL, "input %.*s: message \"%s\" lacks \"%s\"", (int)len, text,
              moe_last_error(), want);
    moe_json_free(doc);
}

static void parse_bad(const char *text, const char *want) { parse_bad_n(text, strlen(text), want); }

Test(json, nesting_keeps_key_order) {
    moe_json_doc *doc = parse_ok(" {\"b\": 1, \"a\": [true, false, null, {\"x\": \"y\"}, []], \"c\": {}} ");
    const moe_json *r = moe_json_root(doc);
    cr_assert_eq(r->type, MOE_JSON_OBJECT);
    cr_assert_eq(r->object.count, 3);
    cr_expect_str_eq(r->object.members[0].key, "b");
    cr_expect_str_eq(r->object.members[1].key, "a");
    cr_expect_str_eq(r->object.members[2].key, "c");
    const moe_json *a = moe_json_get(r, "a");
    cr_assert_not_null(a);
    cr_assert_eq(a->type, MOE_JSON_ARRAY);
    cr_assert_eq(a->array.count, 5);
    cr_expect(a->array.items[0].type == MOE_JSON_BOOL && a->array.items[0].boolean);
    cr_expect(a->array.items[1].type == MOE_JSON_BOOL && !a->array.items[1].boolean);
    cr_expect_eq(a->array.items[2].type, MOE_JSON_NULL);
    cr_expect_str_eq(moe_json_get(&a->array.items[3], "x")->string.data, "y");
    cr_expect_eq(a->array.items[4].array.count, 0);
    cr_expect_eq(moe_json_get(r, "c")->object.count, 0);
    cr_expect_null(moe_json_get(r, "z"));
    cr_expect_null(moe_json_get(a, "x"), "lookup in an array must fail");
    moe_json_free(doc);
}

Test(json, scalars_at_top_level) {
    const char *ok[] = {"0", "\"s\"", "true", "false", "null", " \t\r\n[]\n"};
    for (size_t i = 0; i < sizeof ok / sizeof *ok; i++) moe_json_free(parse_ok(ok[i]));
}

Test(json, string_escapes_to_utf8) {
    moe_json_doc *doc =
        parse_ok("\"\\\"\\\\\\/\\b\\f\\n\\r\\t\\u0041\\u00e9\\u20AC\\ud83d\\ude00\\u0000end\xc3\xa9\"");
    const moe_json *r = moe_json_root(doc);
    static const char want[] = "\"\\/\b\f\n\r\tA\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80\0end\xc3\xa9";
    cr_assert_eq(r->type, MOE_JSON_STRING);
    cr_assert_eq(r->string.len, sizeof want - 1, "decoded %zu bytes, want %zu", r->string.len, sizeof want - 1);
    cr_expect(memcmp(r->string.data, want, sizeof want - 1) == 0);
    cr_expect_eq(r->string.data[r->string.len], '\0');
    moe_json_free(doc);
}

Test(json, numbers) {
    struct {
        const char *text;
        double value;
    } cases[] = {
        {"1e-5", 1e-5}, {"-0", -0.0}, {"0.5", 0.5}, {"-12.25e+2", -1225.0}, {"1E3", 1000.0},
        {"1000000.0", 1e6}, {"0.02", 0.02}, {"123456789012345678901234567890", 1.2345678901234568e29},
        /* A zero written small is zero; a subnormal is not refused as one. */
        {"0.000e-999", 0.0}, {"1e-310", 1e-310},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        moe_json_doc *doc = parse_ok(cases[i].text);
        const moe_json *r = moe_json_root(doc);
        cr_assert_eq(r->type, MOE_JSON_NUMBER);
        cr_expect_eq(r->number.value, cases[i].value, "%s parsed as %.17g", cases[i].text, r->number.value);
        cr_expect_str_eq(r->number.text, cases[i].text);
        moe_json_free(doc);
    }
    moe_json_doc *doc = parse_ok("-0");
    cr_expect(signbit(moe_json_root(doc)->number.value), "-0 lost its sign");
    moe_json_free(doc);
}

Test(json, int64_exact) {
    struct {
        const char *text;
        int ok;
        int64_t value;
    } cases[] = {
        {"9007199254740993", 1, 9007199254740993LL}, /* 2^53 + 1: a double would round it */
        {"9223372036854775807", 1, INT64_MAX},
        {"-9223372036854775808", 1, INT64_MIN},
        {"9223372036854775808", 0, 0},
        {"-9223372036854775809", 0, 0},
        {"-0", 1, 0},
        {"4096.0", 1, 4096},
        {"1e3", 1, 1000},
        {"1.5", 0, 0},
        {"1e20", 0, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        moe_json_doc *doc = parse_ok(cases[i].text);
        int64_t v = -1;
        moe_status st = moe_json_int64(moe_json_root(doc), &v);
        cr_expect_eq(st == MOE_OK, cases[i].ok, "%s: int64 status %d", cases[i].text, st);
        if (cases[i].ok) cr_expect_eq(v, cases[i].value, "%s read as %lld", cases[i].text, (long long)v);
        moe_json_free(doc);
    }
    moe_json_doc *doc = parse_ok("\"12\"");
    int64_t v;
    cr_expect_neq(moe_json_int64(moe_json_root(doc), &v), MOE_OK, "a string is not an integer");
    moe_json_free(doc);

    /* The range a literal's form allows, which tells a whole number out of
     * range from no integer; at its ends int64 reads, one past them not. */
    const struct {
        const char *text, *inside, *outside;
        int64_t lo, hi;
    } ranges[] = {
        {"99999999999999999999", "9223372036854775807", "9223372036854775808", INT64_MIN, INT64_MAX},
        {"-99999999999999999999", "-9223372036854775808", "-9223372036854775809", INT64_MIN, INT64_MAX},
        {"1e20", "9007199254740991.0", "9007199254740992.0", -9007199254740991LL, 9007199254740991LL},
        {"-1.5e300", "-9.007199254740991e15", "-9.007199254740992e15", -9007199254740991LL, 9007199254740991LL},
    };
    for (size_t i = 0; i < sizeof ranges / sizeof *ranges; i++) {
        int64_t lo = 0, hi = 0;
        doc = parse_ok(ranges[i].text);
        moe_json_int64_range(moe_json_root(doc), &lo, &hi);
        cr_expect(lo == ranges[i].lo && hi == ranges[i].hi, "%s: range [%lld, %lld]", ranges[i].text, (long long)lo,
                  (long long)hi);
        moe_json_free(doc);
        doc = parse_ok(ranges[i].inside);
        cr_expect_eq(moe_json_int64(moe_json_root(doc), &v), MOE_OK, "%s is in range", ranges[i].inside);
        cr_expect_eq(v, ranges[i].text[0] == '-' ? ranges[i].lo : ranges[i].hi, "%s read as %lld", ranges[i].inside,
                     (long long)v);
        moe_json_free(doc);
        doc = parse_ok(ranges[i].outside);
        cr_expect_neq(moe_json_int64(moe_json_root(doc), &v), MOE_OK, "%s is out of range", ranges[i].outside);
        moe_json_free(doc);
    }
}

Test(json, invalid_inputs_name_line_and_column) {
    struct {
        const char *text;
        const char *want;
    } cases[] = {
        {"", "t.json:1:1: unexpected end of input"},
        {"   ", "t.json:1:4: unexpected end of input"},
        {"{", "t.json:1:2:"},
        {"[1,]", "t.json:1:4: unexpected character ']'"},
        {"{\"a\":1,}", "t.json:1:8: unexpected character '}'"},
        {"[1 2]", "t.json:1:4: unexpected character '2', expected ',' or ']'"},
        {"{\"a\" 1}", "t.json:1:6: unexpected character '1', expected ':'"},
        {"{1:2}", "t.json:1:2: unexpected character '1', expected a string key"},
        {"{'a':1}", "t.json:1:2:"},
        {"01", "t.json:1:1: invalid number: leading zero"},
        {"-01", "t.json:1:1: invalid number: leading zero"},
        {"+1", "t.json:1:1: unexpected character '+'"},
        {"1.", "t.json:1:1: invalid number: no digit after '.'"},
        {".5", "t.json:1:1: unexpected character '.'"},
        {"1e", "t.json:1:1: invalid number: no digit in the exponent"},
        {"-", "t.json:1:1: invalid number"},
        {"1e400", "t.json:1:1: number 1e400 is out of range"},
        {"[0, 1e-99999]", "t.json:1:5: number 1e-99999 is too small for a double (it reads as 0)"},
        {"-2.5e-400", "t.json:1:1: number -2.5e-400 is too small"},
        {"NaN", "t.json:1:1:"},
        {"Infinity", "t.json:1:1:"},
        {"-Infinity", "t.json:1:1: invalid number"},
        {"tru", "t.json:1:1:"},
        {"nul", "t.json:1:1:"},
        {"[true false]", "t.json:1:7:"},
        {"[1]\n x", "t.json:2:2: unexpected character 'x', expected end of input"},
        {"{\n  \"a\": 1,\n  \"b\": ?\n}", "t.json:3:8: unexpected character '?'"},
        {"[\"\xc3\xa9\", x]", "t.json:1:7: unexpected character 'x'"},
        {"\"abc", "t.json:1:1: unterminated string"},
        {"\"a\x01\"", "t.json:1:3: control character 0x01"},
        {"\"a\tb\"", "t.json:1:3: control character 0x09"},
        {"\"\\x\"", "t.json:1:2: invalid escape '\\x'"},
        {"\"\\u12zz\"", "t.json:1:2: \\u escape needs 4 hex digits"},
        {"\"\\u12", "t.json:1:2: truncated \\u escape"},
        {"\"\\ud800\"", "t.json:1:2: high surrogate \\uD800 not followed"},
        {"\"\\ud800x\"", "high surrogate \\uD800 not followed by a low surrogate"},
        {"\"\\udc00\"", "t.json:1:2: unpaired low surrogate \\uDC00"},
        {"\"\\ud800\\u0041\"", "followed by \\u0041, not a low surrogate"},
        {"\"\xc0\x80\"", "t.json:1:2: invalid UTF-8 byte 0xC0"},
        {"\"\xed\xa0\x80\"", "invalid UTF-8 byte 0xED"},
        {"\"\xf4\x90\x80\x80\"", "invalid UTF-8 byte 0xF4"},
        {"\"\xe2\x82\"", "invalid UTF-8 byte 0xE2"},
        {"\"\xff\"", "invalid UTF-8 byte 0xFF"},
        {"{\"a\":1,\"a\":2}", "t.json:1:8: duplicate key \"a\""},
        {"\xEF\xBB\xBF{}", "t.json:1:1: byte order mark"},
        {"/* c */ {}", "t.json:1:1: unexpected character '/'"},
        {"{} // c", "t.json:1:4:"},
        {"[1],", "t.json:1:4:"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) parse_bad(cases[i].text, cases[i].want);
    parse_bad_n("[1,\0 2]", 7, "t.json:1:4: unexpected byte 0x00");
}

static char *nested(int depth) {
    char *s = malloc(2 * (size_t)depth + 1);
    for (int i = 0; i < depth; i++) {
        s[i] = '[';
        s[2 * depth - 1 - i] = ']';
    }
    s[2 * depth] = '\0';
    return s;
}

Test(json, depth_limit) {
    char *ok = nested(MOE_JSON_MAX_DEPTH);
    moe_json_free(parse_ok(ok));
    free(ok);
    char *deep = nested(MOE_JSON_MAX_DEPTH + 1);
    parse_bad(deep, "nesting deeper than 128 levels");
    free(deep);
}

/* Many keys: the duplicate check sorts them, and names the repeat that
 * comes first in the text when several keys repeat. */
Test(json, duplicate_among_many_keys) {
    enum { N = 3000 };
    size_t cap = (size_t)N * 24 + 64;
    char *text = malloc(cap);
    size_t n = (size_t)snprintf(text, cap, "{");
    for (int i = 0; i < N; i++) n += (size_t)snprintf(text + n, cap - n, "%s\"k%d\":%d", i ? "," : "", i, i);
    snprintf(text + n, cap - n, "}");
    moe_json_doc *doc = parse_ok(text);
    const moe_json *r = moe_json_root(doc);
    cr_expect_eq(r->object.count, N);
    cr_expect_eq(moe_json_get(r, "k2999")->number.value, 2999.0);
    moe_json_free(doc);
    snprintf(text + n, cap - n, ",\"k2000\":0,\"k1234\":0,\"k1234\":1}");
    parse_bad(text, "duplicate key \"k2000\"");
    snprintf(text + n, cap - n, ",\"k1234\":0,\"k2\":0}");
    parse_bad(text, "duplicate key \"k1234\"");
    /* Keys differing only after an embedded NUL are distinct; a repeat of
     * one is named whole. */
    moe_json_free(parse_ok("{\"a\\u0000b\":1,\"a\\u0000c\":2,\"a\":3}"));
    parse_bad("{\"a\":0,\"a\\u0000b\":1,\"a\\u0000b\":2}", "duplicate key \"a\\u0000b\"");
    free(text);
}

Test(json, writer_compact) {
    moe_json_writer w;
    moe_json_writer_init(&w, 0);
    moe_json_begin_object(&w);
    moe_json_key(&w, "s");
    moe_json_string(&w, "q\"b\\n\n\x01\xc3\xa9");
    moe_json_key(&w, "i");
    moe_json_int(&w, -9007199254740993LL);
    moe_json_key(&w, "u");
    moe_json_uint(&w, UINT64_MAX);
    moe_json_key(&w, "x");
    moe_json_number(&w, 1e-5);
    moe_json_key(&w, "a");
    moe_json_begin_array(&w);
    moe_json_bool(&w, true);
    moe_json_bool(&w, false);
    moe_json_null(&w);
    moe_json_begin_object(&w);
    moe_json_end_object(&w);
    moe_json_begin_array(&w);
    moe_json_end_array(&w);
    moe_json_end_array(&w);
    moe_json_end_object(&w);
    cr_assert_eq(moe_json_writer_finish(&w), MOE_OK, "%s", moe_last_error());
    const char *want = "{\"s\":\"q\\\"b\\\\n\\n\\u0001\xc3\xa9\",\"i\":-9007199254740993,"
                       "\"u\":18446744073709551615,\"x\":1e-05,\"a\":[true,false,null,{},[]]}";
    cr_expect_str_eq(w.buf, want);
    cr_expect_eq(w.len, strlen(want));
    moe_json_writer_free(&w);
}

Test(json, writer_pretty_parses_back) {
    moe_json_writer w;
    moe_json_writer_init(&w, 2);
    moe_json_begin_object(&w);
    moe_json_key(&w, "k");
    moe_json_begin_array(&w);
    moe_json_int(&w, 1);
    moe_json_int(&w, 2);
    moe_json_end_array(&w);
    moe_json_key(&w, "e");
    moe_json_begin_object(&w);
    moe_json_end_object(&w);
    moe_json_end_object(&w);
    cr_assert_eq(moe_json_writer_finish(&w), MOE_OK);
    cr_expect_str_eq(w.buf, "{\n  \"k\": [\n    1,\n    2\n  ],\n  \"e\": {}\n}");
    moe_json_free(parse_ok(w.buf));
    moe_json_writer_free(&w);
}

/* Every double written comes back bit for bit, in the fewest digits that do,
 * and reads as a real, not an integer, in a reader that tells them apart
 * (Python's json): a whole number keeps its ".0". */
Test(json, writer_numbers_round_trip) {
    uint64_t state = 0x9E3779B97F4A7C15ull;
    for (int i = 0; i < 20000; i++) {
        state = state * 6364136223846793005ull + 1442695040888963407ull;
        uint64_t bits = state;
        double v;
        memcpy(&v, &bits, sizeof v);
        if (i % 4 == 0) v = (double)(int64_t)(bits >> 20) * 1e-7; /* ordinary-looking values too */
        if (!isfinite(v)) continue;
        moe_json_writer w;
        moe_json_writer_init(&w, 0);
        moe_json_number(&w, v);
        cr_assert_eq(moe_json_writer_finish(&w), MOE_OK);
        moe_json_doc *doc = parse_ok(w.buf);
        double back = moe_json_root(doc)->number.value;
        cr_assert(memcmp(&back, &v, sizeof v) == 0, "%.17g written as %s read back as %.17g", v, w.buf, back);
        cr_assert(strpbrk(w.buf, ".e") != NULL, "%.17g written as %s, an integer to Python", v, w.buf);
        moe_json_free(doc);
        moe_json_writer_free(&w);
    }
    const struct {
        double v;
        const char *text;
    } short_forms[] = {{0.1, "0.1"},         {0.02, "0.02"},   {1e6, "1000000.0"},   {0.0, "0.0"},
                       {-0.0, "-0.0"},       {-3.0, "-3.0"},   {1e-5, "1e-05"},      {1e16, "1e+16"},
                       {123456789012345.0, "123456789012345.0"}, {1.0 / 3.0, "0.3333333333333333"}};
    for (size_t i = 0; i < sizeof short_forms / sizeof *short_forms; i++) {
        moe_json_writer w;
        moe_json_writer_init(&w, 0);
        moe_json_number(&w, short_forms[i].v);
        cr_assert_eq(moe_json_writer_finish(&w), MOE_OK);
        cr_expect_str_eq(w.buf, short_forms[i].text);
        moe_json_writer_free(&w);
    }
}

typedef void (*misuse_fn)(moe_json_writer *w);

static void nan_value(moe_json_writer *w) { moe_json_number(w, NAN); }
static void key_at_top(moe_json_writer *w) { moe_json_key(w, "k"); }
static void value_without_key(moe_json_writer *w) {
    moe_json_begin_object(w);
    moe_json_int(w, 1);
    moe_json_end_object(w);
}
static void key_in_array(moe_json_writer *w) {
    moe_json_begin_array(w);
    moe_json_key(w, "k");
    moe_json_end_array(w);
}
static void mismatched_close(moe_json_writer *w) {
    moe_json_begin_object(w);
    moe_json_end_array(w);
}
static void key_without_value(moe_json_writer *w) {
    moe_json_begin_object(w);
    moe_json_key(w, "k");
    moe_json_end_object(w);
}
static void unclosed(moe_json_writer *w) { moe_json_begin_array(w); }
static void two_roots(moe_json_writer *w) {
    moe_json_int(w, 1);
    moe_json_int(w, 2);
}
static void bad_utf8(moe_json_writer *w) { moe_json_string(w, "a\xc0\x80"); }
static void nothing(moe_json_writer *w) { (void)w; }

Test(json, writer_misuse_is_an_error) {
    const struct {
        misuse_fn fn;
        const char *want;
    } cases[] = {
        {nan_value, "no JSON form"},
        {key_at_top, "where a key cannot go"},
        {value_without_key, "object value without a key"},
        {key_in_array, "where a key cannot go"},
        {mismatched_close, "array closed while an object is open"},
        {key_without_value, "object closed while a key awaits its value"},
        {unclosed, "document incomplete"},
        {two_roots, "second top-level value"},
        {bad_utf8, "invalid UTF-8 byte 0xC0"},
        {nothing, "document incomplete"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        moe_json_writer w;
        moe_json_writer_init(&w, 0);
        cases[i].fn(&w);
        moe_status st = moe_json_writer_finish(&w);
        cr_expect_eq(st, MOE_ERR_INVALID_ARG, "case %zu accepted", i);
        cr_expect(strstr(moe_last_error(), cases[i].want) != NULL, "case %zu: \"%s\" lacks \"%s\"", i,
                  moe_last_error(), cases[i].want);
        moe_json_writer_free(&w);
    }
}

/* The text of a string only when C string functions would see all of it. */
Test(json, text_refuses_strings_with_nul) {
    moe_json_doc *doc = parse_ok("{\"ok\":\"F32\",\"empty\":\"\",\"nul\":\"F32\\u0000garbage\",\"lead\":\"\\u0000\","
                                 "\"num\":1}");
    const moe_json *r = moe_json_root(doc);
    cr_expect_str_eq(moe_json_text(moe_json_get(r, "ok")), "F32");
    cr_expect_str_eq(moe_json_text(moe_json_get(r, "empty")), "");
    cr_expect_null(moe_json_text(moe_json_get(r, "nul")), "\"F32\\u0000garbage\" read as text");
    cr_expect_null(moe_json_text(moe_json_get(r, "lead")), "\"\\u0000\" read as text");
    cr_expect_null(moe_json_text(moe_json_get(r, "num")), "a number read as text");
    cr_expect_null(moe_json_text(moe_json_get(r, "absent")));
    moe_json_free(doc);
}

/* Each byte that does not begin a valid UTF-8 sequence becomes U+FFFD; the
 * expected texts are written out by hand. */
Test(json, lossy_string_replaces_invalid_bytes) {
#define FFFD "\xef\xbf\xbd"
    const struct {
        const char *in, *want;
    } cases[] = {
        {"plain /tmp/a b", "\"plain /tmp/a b\""},
        {"caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80", "\"caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80\""},
        {"a\xff" "b", "\"a" FFFD "b\""},
        /* continuation bytes with no lead */
        {"\x80\xbf", "\"" FFFD FFFD "\""},
        /* truncated 3- and 4-byte sequences at the end, and a lone lead byte */
        {"x\xe2\x82", "\"x" FFFD FFFD "\""},
        {"x\xf0\x9f\x98", "\"x" FFFD FFFD FFFD "\""},
        {"\xc3", "\"" FFFD "\""},
        {"\xe2\x82\xac\xe2\x82", "\"\xe2\x82\xac" FFFD FFFD "\""},
        /* overlong '/' in 2, 3 and 4 bytes */
        {"\xc0\xaf", "\"" FFFD FFFD "\""},
        {"\xe0\x80\xaf", "\"" FFFD FFFD FFFD "\""},
        {"\xf0\x80\x80\xaf", "\"" FFFD FFFD FFFD FFFD "\""},
        /* an encoded surrogate (U+D800) and a code point past U+10FFFF */
        {"\xed\xa0\x80", "\"" FFFD FFFD FFFD "\""},
        {"\xf4\x90\x80\x80", "\"" FFFD FFFD FFFD FFFD "\""},
        /* escapes as moe_json_string writes them */
        {"q\"\\\n\x01\xff", "\"q\\\"\\\\\\n\\u0001" FFFD "\""},
    };
#undef FFFD
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        moe_json_writer w;
        moe_json_writer_init(&w, 0);
        moe_json_string_lossy(&w, cases[i].in);
        cr_assert_eq(moe_json_writer_finish(&w), MOE_OK, "case %zu: %s", i, moe_last_error());
        cr_expect_str_eq(w.buf, cases[i].want, "case %zu", i);
        /* The result is valid JSON whatever the input. */
        moe_json_free(parse_ok(w.buf));
        moe_json_writer_free(&w);
    }

    /* Inside an object, as a path field; the strict writer still refuses. */
    moe_json_writer w;
    moe_json_writer_init(&w, 0);
    moe_json_begin_object(&w);
    moe_json_key(&w, "path");
    moe_json_string_lossy(&w, "/data/\xe9t\xe9");
    moe_json_key(&w, "n");
    moe_json_int(&w, 1);
    moe_json_end_object(&w);
    cr_assert_eq(moe_json_writer_finish(&w), MOE_OK, "%s", moe_last_error());
    cr_expect_str_eq(w.buf, "{\"path\":\"/data/\xef\xbf\xbdt\xef\xbf\xbd\",\"n\":1}");
    moe_json_writer_free(&w);
    moe_json_writer_init(&w, 0);
    moe_json_string(&w, "/data/\xe9t\xe9");
    cr_expect_eq(moe_json_writer_finish(&w), MOE_ERR_INVALID_ARG, "the strict writer accepted invalid UTF-8");
    cr_expect(strstr(moe_last_error(), "invalid UTF-8 byte 0xE9 at offset 6") != NULL, "%s", moe_last_error());
    moe_json_writer_free(&w);
}

/* A file read and parsed in one call: its path leads every error. */
Test(json, parse_file_names_the_file) {
    char path[] = "/tmp/moe-json-XXXXXX";
    const int fd = mkstemp(path);
    cr_assert(fd >= 0, "mkstemp failed");
    FILE *f = fdopen(fd, "w");
    cr_assert(f);
    fputs("{\"a\": [1, 2]}", f);
    fclose(f);
    moe_json_doc *doc = NULL;
    cr_assert(moe_json_parse_file(&doc, path, 1024) == MOE_OK, "%s", moe_last_error());
    const moe_json *a = moe_json_get(moe_json_root(doc), "a");
    cr_expect(a && a->type == MOE_JSON_ARRAY && a->array.count == 2, "a is not the array [1, 2]");
    moe_json_free(doc);
    cr_expect(moe_json_parse_file(&doc, path, 4) != MOE_OK && strstr(moe_last_error(), path),
              "a file over the limit: %s", moe_last_error());
    f = fopen(path, "w");
    cr_assert(f);
    fputs("{\"a\": ", f);
    fclose(f);
    cr_expect(moe_json_parse_file(&doc, path, 1024) == MOE_ERR_FORMAT && strstr(moe_last_error(), path),
              "a cut-off file: %s", moe_last_error());
    remove(path);
    cr_expect(moe_json_parse_file(&doc, path, 1024) == MOE_ERR_IO && strstr(moe_last_error(), path),
              "a missing file: %s", moe_last_error());
}
