#define _POSIX_C_SOURCE 200809L

#include "engine/json.h"
#include "engine/unicode.h"

#include <locale.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdalign.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/shortest.h"
#include "common/status.h"
#include "engine/fileio.h"

/* strtod and printf follow LC_NUMERIC, and a host program that called
 * setlocale(LC_ALL, "") under a locale with a decimal comma would read "0.02"
 * as 0. Numbers therefore go through a "C" locale made once per process. */
static locale_t c_numeric_locale;
static pthread_once_t c_numeric_once = PTHREAD_ONCE_INIT;

static void make_c_locale(void) { c_numeric_locale = newlocale(LC_NUMERIC_MASK, "C", (locale_t)0); }

static locale_t enter_c_locale(void) {
    pthread_once(&c_numeric_once, make_c_locale);
    /* Without the locale object (out of memory) the current locale is used. */
    return c_numeric_locale == (locale_t)0 ? (locale_t)0 : uselocale(c_numeric_locale);
}

static void leave_c_locale(locale_t old) {
    if (old != (locale_t)0) uselocale(old);
}

/* Length of the valid UTF-8 sequence at s [n], or 0 if it is not one
 * (Unicode 15, table 3-7: no overlong forms, no surrogates, <= U+10FFFF). */
static size_t utf8_sequence(const unsigned char *s, size_t n) {
    unsigned c = s[0];
    if (c < 0x80) return 1;
    size_t len;
    unsigned lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) {
        len = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
        len = 3;
        if (c == 0xE0) lo = 0xA0;
        if (c == 0xED) hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
        len = 4;
        if (c == 0xF0) lo = 0x90;
        if (c == 0xF4) hi = 0x8F;
    } else {
        return 0;
    }
    if (n < len) return 0;
    if (s[1] < lo || s[1] > hi) return 0;
    for (size_t i = 2; i < len; i++)
        if (s[i] < 0x80 || s[i] > 0xBF) return 0;
    return len;
}

/* ------------------------------------------------------------------ arena */

#define ARENA_BLOCK_BYTES ((size_t)64 * 1024)

typedef struct arena_block {
    struct arena_block *next;
    size_t used, cap;
    alignas(max_align_t) unsigned char data[];
} arena_block;

struct moe_json_doc {
    arena_block *blocks;
    moe_json root;
};

static void *arena_alloc(moe_json_doc *doc, size_t size) {
    const size_t align = alignof(max_align_t);
    size = (size + align - 1) / align * align;
    arena_block *b = doc->blocks;
    if (b == NULL || b->cap - b->used < size) {
        size_t cap = size > ARENA_BLOCK_BYTES ? size : ARENA_BLOCK_BYTES;
        b = malloc(sizeof *b + cap);
        if (b == NULL) return NULL;
        b->used = 0;
        b->cap = cap;
        b->next = doc->blocks;
        doc->blocks = b;
    }
    void *p = b->data + b->used;
    b->used += size;
    return p;
}

void moe_json_free(moe_json_doc *doc) {
    if (doc == NULL) return;
    arena_block *b = doc->blocks;
    while (b != NULL) {
        arena_block *next = b->next;
        free(b);
        b = next;
    }
    free(doc);
}

const moe_json *moe_json_root(const moe_json_doc *doc) { return &doc->root; }

/* ----------------------------------------------------------------- parser */

typedef struct pending {
    moe_json_member m;
    size_t key_pos; /* where the key starts in the text, for duplicate errors */
} pending;

typedef struct parser {
    const char *text; /* [len] */
    size_t len, pos;
    const char *name;
    moe_json_doc *doc;
    int depth;
    /* Items of the containers being parsed, innermost last; a container's
     * items move to the arena when it closes, so they end up contiguous. */
    pending *stack;
    size_t stack_len, stack_cap;
    char *sbuf; /* decoded string being built */
    size_t sbuf_len, sbuf_cap;
    const pending **keys; /* an object's items, sorted by key: duplicates sit together */
    size_t keys_cap;
} parser;

static moe_status parse_error(parser *p, size_t pos, const char *fmt, ...) MOE_PRINTF(3, 4);

static moe_status parse_error(parser *p, size_t pos, const char *fmt, ...) {
    size_t line = 1, column = 1;
    for (size_t i = 0; i < pos && i < p->len; i++) {
        unsigned char c = (unsigned char)p->text[i];
        if (c == '\n') {
            line++;
            column = 1;
        } else if ((c & 0xC0) != 0x80) {
            column++;
        }
    }
    char reason[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(reason, sizeof reason, fmt, ap);
    va_end(ap);
    return moe_error(MOE_ERR_FORMAT, "%s:%zu:%zu: %s", p->name, line, column, reason);
}

static moe_status oom(parser *p) {
    return moe_error(MOE_ERR_OUT_OF_MEMORY, "%s: out of memory while parsing JSON", p->name);
}

/* A description of the byte at pos for "unexpected ..." messages. */
static moe_status unexpected(parser *p, const char *wanted) {
    if (p->pos >= p->len) return parse_error(p, p->pos, "unexpected end of input, expected %s", wanted);
    unsigned char c = (unsigned char)p->text[p->pos];
    if (c >= 0x20 && c < 0x7F)
        return parse_error(p, p->pos, "unexpected character '%c', expected %s", c, wanted);
    return parse_error(p, p->pos, "unexpected byte 0x%02X, expected %s", c, wanted);
}

static void skip_ws(parser *p) {
    while (p->pos < p->len) {
        char c = p->text[p->pos];
        if (c != ' ' && c != '\t' && c != '\n' && c != '\r') break;
        p->pos++;
    }
}

static moe_status sbuf_put(parser *p, const char *s, size_t n) {
    if (p->sbuf_cap - p->sbuf_len < n) {
        size_t cap = p->sbuf_cap == 0 ? 256 : p->sbuf_cap;
        while (cap - p->sbuf_len < n) cap *= 2;
        char *b = realloc(p->sbuf, cap);
        if (b == NULL) return oom(p);
        p->sbuf = b;
        p->sbuf_cap = cap;
    }
    memcpy(p->sbuf + p->sbuf_len, s, n);
    p->sbuf_len += n;
    return MOE_OK;
}

static int hex_value(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* The 4 hex digits after "\u" at p->pos (which points at the 'u'). */
static moe_status read_hex4(parser *p, unsigned *out) {
    if (p->len - p->pos < 5) return parse_error(p, p->pos - 1, "truncated \\u escape");
    unsigned v = 0;
    for (size_t i = 1; i <= 4; i++) {
        int h = hex_value(p->text[p->pos + i]);
        if (h < 0) return parse_error(p, p->pos - 1, "\\u escape needs 4 hex digits");
        v = v * 16 + (unsigned)h;
    }
    p->pos += 5;
    *out = v;
    return MOE_OK;
}

static moe_status put_code_point(parser *p, unsigned cp) {
    unsigned char u[4];
    return sbuf_put(p, (const char *)u, moe_utf8_encode(cp, u));
}

/* An escape; p->pos is just past the backslash. */
static moe_status parse_escape(parser *p) {
    size_t start = p->pos - 1;
    if (p->pos >= p->len) return parse_error(p, start, "unterminated string");
    char c = p->text[p->pos];
    static const char from[] = "\"\\/bfnrt";
    static const char to[] = "\"\\/\b\f\n\r\t";
    const char *hit = c != '\0' ? strchr(from, c) : NULL;
    if (hit != NULL) {
        p->pos++;
        return sbuf_put(p, &to[hit - from], 1);
    }
    if (c != 'u') {
        if (c >= 0x20 && c < 0x7F) return parse_error(p, start, "invalid escape '\\%c'", c);
        return parse_error(p, start, "invalid escape");
    }
    unsigned cp;
    MOE_TRY(read_hex4(p, &cp));
    if (cp >= 0xDC00 && cp <= 0xDFFF)
        return parse_error(p, start, "unpaired low surrogate \\u%04X", cp);
    if (cp >= 0xD800 && cp <= 0xDBFF) {
        if (p->len - p->pos < 2 || p->text[p->pos] != '\\' || p->text[p->pos + 1] != 'u')
            return parse_error(p, start, "high surrogate \\u%04X not followed by a low surrogate", cp);
        p->pos += 1;
        unsigned lo;
        MOE_TRY(read_hex4(p, &lo));
        if (lo < 0xDC00 || lo > 0xDFFF)
            return parse_error(p, start, "high surrogate \\u%04X followed by \\u%04X, not a low surrogate",
                               cp, lo);
        cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
    }
    return put_code_point(p, cp);
}

/* A string starting at the quote at p->pos, copied into the arena. */
static moe_status parse_string(parser *p, const char **out, size_t *out_len) {
    size_t start = p->pos;
    p->pos++;
    p->sbuf_len = 0;
    for (;;) {
        if (p->pos >= p->len) return parse_error(p, start, "unterminated string");
        unsigned char c = (unsigned char)p->text[p->pos];
        if (c == '"') {
            p->pos++;
            break;
        }
        if (c == '\\') {
            p->pos++;
            MOE_TRY(parse_escape(p));
            continue;
        }
        if (c < 0x20) return parse_error(p, p->pos, "control character 0x%02X in string", c);
        /* Copy the run of plain characters up to the next quote, backslash or
         * non-ASCII byte in one piece. */
        size_t run = p->pos;
        while (run < p->len) {
            unsigned char r = (unsigned char)p->text[run];
            if (r == '"' || r == '\\' || r < 0x20) break;
            if (r < 0x80) {
                run++;
                continue;
            }
            size_t n = utf8_sequence((const unsigned char *)p->text + run, p->len - run);
            if (n == 0) return parse_error(p, run, "invalid UTF-8 byte 0x%02X in string", r);
            run += n;
        }
        MOE_TRY(sbuf_put(p, p->text + p->pos, run - p->pos));
        p->pos = run;
    }
    char *s = arena_alloc(p->doc, p->sbuf_len + 1);
    if (s == NULL) return oom(p);
    if (p->sbuf_len > 0) memcpy(s, p->sbuf, p->sbuf_len);
    s[p->sbuf_len] = '\0';
    *out = s;
    *out_len = p->sbuf_len;
    return MOE_OK;
}

static bool is_digit(char c) { return c >= '0' && c <= '9'; }

static moe_status parse_number(parser *p, moe_json *v) {
    size_t start = p->pos, i = p->pos;
    const char *t = p->text;
    if (i < p->len && t[i] == '-') i++;
    if (i >= p->len || !is_digit(t[i])) return parse_error(p, start, "invalid number: no digit after '-'");
    if (t[i] == '0') {
        i++;
        if (i < p->len && is_digit(t[i])) return parse_error(p, start, "invalid number: leading zero");
    } else {
        while (i < p->len && is_digit(t[i])) i++;
    }
    if (i < p->len && t[i] == '.') {
        i++;
        if (i >= p->len || !is_digit(t[i]))
            return parse_error(p, start, "invalid number: no digit after '.'");
        while (i < p->len && is_digit(t[i])) i++;
    }
    if (i < p->len && (t[i] == 'e' || t[i] == 'E')) {
        i++;
        if (i < p->len && (t[i] == '+' || t[i] == '-')) i++;
        if (i >= p->len || !is_digit(t[i]))
            return parse_error(p, start, "invalid number: no digit in the exponent");
        while (i < p->len && is_digit(t[i])) i++;
    }
    size_t n = i - start;
    char *text = arena_alloc(p->doc, n + 1);
    if (text == NULL) return oom(p);
    memcpy(text, t + start, n);
    text[n] = '\0';
    locale_t old = enter_c_locale();
    double value = strtod(text, NULL);
    leave_c_locale(old);
    if (!isfinite(value)) return parse_error(p, start, "number %s is out of range for a double", text);
    /* A non-zero literal read as 0 would be reported as a 0 it never said. */
    bool nonzero = false;
    for (size_t k = 0; k < n && text[k] != 'e' && text[k] != 'E'; k++) nonzero |= text[k] >= '1' && text[k] <= '9';
    if (value == 0.0 && nonzero) return parse_error(p, start, "number %s is too small for a double (it reads as 0)", text);
    v->type = MOE_JSON_NUMBER;
    v->number.value = value;
    v->number.text = text;
    v->number.text_len = n;
    p->pos = i;
    return MOE_OK;
}

static moe_status push_item(parser *p, pending **item) {
    if (p->stack_len == p->stack_cap) {
        size_t cap = p->stack_cap == 0 ? 64 : p->stack_cap * 2;
        pending *s = realloc(p->stack, cap * sizeof *s);
        if (s == NULL) return oom(p);
        p->stack = s;
        p->stack_cap = cap;
    }
    *item = &p->stack[p->stack_len++];
    memset(*item, 0, sizeof **item);
    return MOE_OK;
}

/* Items by key (length, then bytes), then by position. */
static int compare_keys(const void *a, const void *b) {
    const pending *x = *(const pending *const *)a, *y = *(const pending *const *)b;
    if (x->m.key_len != y->m.key_len) return x->m.key_len < y->m.key_len ? -1 : 1;
    const int c = memcmp(x->m.key, y->m.key, x->m.key_len);
    if (c) return c;
    return (x->key_pos > y->key_pos) - (x->key_pos < y->key_pos);
}

/* Rejects the first key of stack [base, stack_len) that repeats an earlier
 * one, pointing at the repeat. By sorting, O(n log n) whatever the keys (a
 * hash table of an unseeded hash let a file of colliding keys take hours). */
static moe_status check_duplicates(parser *p, size_t base) {
    size_t count = p->stack_len - base;
    if (count < 2) return MOE_OK;
    if (count > p->keys_cap) {
        const pending **k = realloc(p->keys, count * sizeof *k);
        if (k == NULL) return oom(p);
        p->keys = k;
        p->keys_cap = count;
    }
    for (size_t i = 0; i < count; i++) p->keys[i] = &p->stack[base + i];
    qsort(p->keys, count, sizeof *p->keys, compare_keys);
    const pending *repeat = NULL; /* the repeat earliest in the text */
    for (size_t i = 1; i < count; i++) {
        const pending *a = p->keys[i - 1], *b = p->keys[i];
        if (a->m.key_len == b->m.key_len && memcmp(a->m.key, b->m.key, a->m.key_len) == 0 &&
            (!repeat || b->key_pos < repeat->key_pos))
            repeat = b;
    }
    if (!repeat) return MOE_OK;
    char shown[256]; /* the key's first bytes, a NUL among them as its escape */
    size_t n = 0;
    for (size_t i = 0; i < repeat->m.key_len && n + 7 < sizeof shown && i < 200; i++) {
        if (repeat->m.key[i] == '\0')
            n += (size_t)snprintf(shown + n, sizeof shown - n, "\\u0000");
        else
            shown[n++] = repeat->m.key[i];
    }
    shown[n] = '\0';
    return parse_error(p, repeat->key_pos, "duplicate key \"%s\"", shown);
}

static moe_status parse_value(parser *p, moe_json *v);

/* An array or object whose opening bracket is at p->pos. */
static moe_status parse_container(parser *p, moe_json *v, bool object) {
    size_t open = p->pos;
    if (++p->depth > MOE_JSON_MAX_DEPTH)
        return parse_error(p, open, "nesting deeper than %d levels", MOE_JSON_MAX_DEPTH);
    const char close = object ? '}' : ']';
    size_t base = p->stack_len;
    p->pos++;
    skip_ws(p);
    if (p->pos < p->len && p->text[p->pos] == close) {
        p->pos++;
    } else {
        for (;;) {
            pending *item;
            MOE_TRY(push_item(p, &item));
            size_t index = p->stack_len - 1;
            skip_ws(p);
            if (object) {
                if (p->pos >= p->len || p->text[p->pos] != '"') return unexpected(p, "a string key");
                size_t key_pos = p->pos;
                const char *key;
                size_t key_len;
                MOE_TRY(parse_string(p, &key, &key_len));
                item = &p->stack[index];
                item->key_pos = key_pos;
                item->m.key = key;
                item->m.key_len = key_len;
                skip_ws(p);
                if (p->pos >= p->len || p->text[p->pos] != ':') return unexpected(p, "':'");
                p->pos++;
            }
            moe_json value;
            MOE_TRY(parse_value(p, &value));
            /* parse_value may have grown (moved) the stack. */
            p->stack[index].m.value = value;
            skip_ws(p);
            if (p->pos < p->len && p->text[p->pos] == ',') {
                p->pos++;
                continue;
            }
            if (p->pos < p->len && p->text[p->pos] == close) {
                p->pos++;
                break;
            }
            return unexpected(p, object ? "',' or '}'" : "',' or ']'");
        }
    }
    size_t count = p->stack_len - base;
    if (object) {
        MOE_TRY(check_duplicates(p, base));
        moe_json_member *members = NULL;
        if (count > 0) {
            members = arena_alloc(p->doc, count * sizeof *members);
            if (members == NULL) return oom(p);
            for (size_t i = 0; i < count; i++) members[i] = p->stack[base + i].m;
        }
        v->type = MOE_JSON_OBJECT;
        v->object.members = members;
        v->object.count = count;
    } else {
        moe_json *items = NULL;
        if (count > 0) {
            items = arena_alloc(p->doc, count * sizeof *items);
            if (items == NULL) return oom(p);
            for (size_t i = 0; i < count; i++) items[i] = p->stack[base + i].m.value;
        }
        v->type = MOE_JSON_ARRAY;
        v->array.items = items;
        v->array.count = count;
    }
    p->stack_len = base;
    p->depth--;
    return MOE_OK;
}

static bool match_literal(parser *p, const char *lit) {
    size_t n = strlen(lit);
    if (p->len - p->pos < n || memcmp(p->text + p->pos, lit, n) != 0) return false;
    p->pos += n;
    return true;
}

static moe_status parse_value(parser *p, moe_json *v) {
    memset(v, 0, sizeof *v);
    skip_ws(p);
    if (p->pos >= p->len) return unexpected(p, "a value");
    char c = p->text[p->pos];
    switch (c) {
    case '{':
        return parse_container(p, v, true);
    case '[':
        return parse_container(p, v, false);
    case '"':
        v->type = MOE_JSON_STRING;
        return parse_string(p, &v->string.data, &v->string.len);
    case 't':
    case 'f':
    case 'n':
        if (match_literal(p, "true")) {
            v->type = MOE_JSON_BOOL;
            v->boolean = true;
        } else if (match_literal(p, "false")) {
            v->type = MOE_JSON_BOOL;
            v->boolean = false;
        } else if (match_literal(p, "null")) {
            v->type = MOE_JSON_NULL;
        } else {
            return unexpected(p, "a value");
        }
        return MOE_OK;
    default:
        if (c == '-' || is_digit(c)) return parse_number(p, v);
        return unexpected(p, "a value");
    }
}

moe_status moe_json_parse(moe_json_doc **doc, const char *text, size_t len, const char *name) {
    *doc = NULL;
    if (name == NULL) name = "<json>";
    if (text == NULL && len > 0) return moe_error(MOE_ERR_INVALID_ARG, "%s: NULL JSON text", name);
    parser p = {.text = text, .len = len, .name = name};
    p.doc = calloc(1, sizeof *p.doc);
    if (p.doc == NULL) return oom(&p);
    moe_status st;
    if (len >= 3 && memcmp(text, "\xEF\xBB\xBF", 3) == 0) {
        st = parse_error(&p, 0, "byte order mark at the start of JSON text");
    } else {
        st = parse_value(&p, &p.doc->root);
        if (st == MOE_OK) {
            skip_ws(&p);
            if (p.pos < p.len) st = unexpected(&p, "end of input after the value");
        }
    }
    free(p.stack);
    free(p.sbuf);
    free(p.keys);
    if (st != MOE_OK) {
        moe_json_free(p.doc);
        return st;
    }
    *doc = p.doc;
    return MOE_OK;
}

moe_status moe_json_parse_file(moe_json_doc **doc, const char *path, size_t max_bytes) {
    char *text;
    size_t len;
    MOE_TRY(moe_file_read_all(&text, &len, path, max_bytes));
    const moe_status st = moe_json_parse(doc, text, len, path);
    free(text);
    return st;
}

const moe_json *moe_json_get(const moe_json *obj, const char *key) {
    if (obj == NULL || obj->type != MOE_JSON_OBJECT) return NULL;
    size_t n = strlen(key);
    for (size_t i = 0; i < obj->object.count; i++) {
        const moe_json_member *m = &obj->object.members[i];
        if (m->key_len == n && memcmp(m->key, key, n) == 0) return &m->value;
    }
    return NULL;
}

/* 2^53 - 1: past it a double no longer holds every integer, so a literal
 * with a fraction or exponent, read through strtod, may have been rounded. */
#define EXACT_INT_MAX ((int64_t)9007199254740991)

moe_status moe_json_int64(const moe_json *v, int64_t *out) {
    if (v == NULL || v->type != MOE_JSON_NUMBER) return MOE_ERR_FORMAT;
    const char *t = v->number.text;
    if (strpbrk(t, ".eE") == NULL) {
        bool neg = t[0] == '-';
        /* Accumulate negatively so INT64_MIN fits. */
        int64_t acc = 0;
        for (const char *c = t + neg; *c != '\0'; c++) {
            int d = *c - '0';
            if (acc < (INT64_MIN + d) / 10) return MOE_ERR_FORMAT;
            acc = acc * 10 - d;
        }
        if (!neg && acc == INT64_MIN) return MOE_ERR_FORMAT;
        *out = neg ? acc : -acc;
        return MOE_OK;
    }
    double x = v->number.value;
    if (x != floor(x) || fabs(x) > (double)EXACT_INT_MAX) return MOE_ERR_FORMAT;
    *out = (int64_t)x;
    return MOE_OK;
}

void moe_json_int64_range(const moe_json *v, int64_t *lo, int64_t *hi) {
    const bool plain = v != NULL && v->type == MOE_JSON_NUMBER && strpbrk(v->number.text, ".eE") == NULL;
    *lo = plain ? INT64_MIN : -EXACT_INT_MAX;
    *hi = plain ? INT64_MAX : EXACT_INT_MAX;
}

const char *moe_json_text(const moe_json *v) {
    if (v == NULL || v->type != MOE_JSON_STRING || memchr(v->string.data, '\0', v->string.len) != NULL) return NULL;
    return v->string.data;
}

const char *moe_json_type_name(moe_json_type type) {
    switch (type) {
    case MOE_JSON_NULL: return "null";
    case MOE_JSON_BOOL: return "boolean";
    case MOE_JSON_NUMBER: return "number";
    case MOE_JSON_STRING: return "string";
    case MOE_JSON_ARRAY: return "array";
    case MOE_JSON_OBJECT: return "object";
    }
    return "unknown";
}

/* ----------------------------------------------------------------- writer */

void moe_json_writer_init(moe_json_writer *w, int indent) {
    memset(w, 0, sizeof *w);
    w->indent = indent < 0 ? 0 : indent;
    w->status = MOE_OK;
}

void moe_json_writer_free(moe_json_writer *w) {
    free(w->buf);
    w->buf = NULL;
    w->len = w->cap = 0;
}

static bool writer_fail(moe_json_writer *w, moe_status st) {
    if (w->status == MOE_OK) w->status = st;
    return false;
}

static bool put(moe_json_writer *w, const char *s, size_t n) {
    if (w->status != MOE_OK) return false;
    if (w->cap - w->len < n + 1) {
        size_t cap = w->cap == 0 ? 256 : w->cap;
        while (cap - w->len < n + 1) cap *= 2;
        char *b = realloc(w->buf, cap);
        if (b == NULL)
            return writer_fail(w, moe_error(MOE_ERR_OUT_OF_MEMORY, "JSON writer: out of memory"));
        w->buf = b;
        w->cap = cap;
    }
    memcpy(w->buf + w->len, s, n);
    w->len += n;
    w->buf[w->len] = '\0';
    return true;
}

static bool put_str(moe_json_writer *w, const char *s) { return put(w, s, strlen(s)); }

static void newline_indent(moe_json_writer *w, int depth) {
    if (w->indent == 0) return;
    put(w, "\n", 1);
    for (int i = 0; i < depth * w->indent; i++) put(w, " ", 1);
}

/* The separator and indentation due before a value; false when a value
 * cannot go here. */
static bool before_value(moe_json_writer *w) {
    if (w->status != MOE_OK) return false;
    if (w->depth == 0) {
        if (w->len > 0)
            return writer_fail(w, moe_error(MOE_ERR_INVALID_ARG, "JSON writer: second top-level value"));
        return true;
    }
    char *level = &w->level[w->depth];
    if (*level == 'k')
        return writer_fail(w, moe_error(MOE_ERR_INVALID_ARG, "JSON writer: object value without a key"));
    if (*level == 'v') {
        *level = 'k';
        return true;
    }
    if (!w->empty[w->depth]) put(w, ",", 1);
    w->empty[w->depth] = false;
    newline_indent(w, w->depth);
    return w->status == MOE_OK;
}

/* s [n] as a quoted JSON string. An invalid UTF-8 byte fails the writer, or
 * when lossy is written as U+FFFD (EF BF BD). */
static void write_escaped(moe_json_writer *w, const char *s, size_t n, bool lossy) {
    if (!put(w, "\"", 1)) return;
    size_t i = 0;
    while (i < n) {
        size_t run = i;
        bool invalid = false;
        while (run < n) {
            unsigned char c = (unsigned char)s[run];
            if (c < 0x20 || c == '"' || c == '\\') break;
            if (c < 0x80) {
                run++;
                continue;
            }
            size_t k = utf8_sequence((const unsigned char *)s + run, n - run);
            if (k == 0) {
                invalid = true;
                break;
            }
            run += k;
        }
        put(w, s + i, run - i);
        if (run == n) break;
        unsigned char c = (unsigned char)s[run];
        i = run + 1;
        if (invalid) {
            if (!lossy) {
                writer_fail(w, moe_error(MOE_ERR_INVALID_ARG,
                                         "JSON writer: invalid UTF-8 byte 0x%02X at offset %zu of a string",
                                         c, run));
                return;
            }
            put(w, "\xEF\xBF\xBD", 3);
            continue;
        }
        char esc[8];
        switch (c) {
        case '"': strcpy(esc, "\\\""); break;
        case '\\': strcpy(esc, "\\\\"); break;
        case '\b': strcpy(esc, "\\b"); break;
        case '\f': strcpy(esc, "\\f"); break;
        case '\n': strcpy(esc, "\\n"); break;
        case '\r': strcpy(esc, "\\r"); break;
        case '\t': strcpy(esc, "\\t"); break;
        default: snprintf(esc, sizeof esc, "\\u%04X", c); break;
        }
        put_str(w, esc);
    }
    put(w, "\"", 1);
}

static void open_container(moe_json_writer *w, char level) {
    if (!before_value(w)) return;
    if (w->depth == MOE_JSON_MAX_DEPTH) {
        writer_fail(w, moe_error(MOE_ERR_INVALID_ARG, "JSON writer: nesting deeper than %d levels",
                                 MOE_JSON_MAX_DEPTH));
        return;
    }
    put(w, level == 'a' ? "[" : "{", 1);
    w->depth++;
    w->level[w->depth] = level;
    w->empty[w->depth] = true;
}

static void close_container(moe_json_writer *w, bool object) {
    if (w->status != MOE_OK) return;
    char level = w->depth > 0 ? w->level[w->depth] : 0;
    if (object ? level != 'k' : level != 'a') {
        const char *state = level == 'v'   ? "a key awaits its value"
                            : level == 'k' ? "an object is open"
                            : level == 'a' ? "an array is open"
                                           : "nothing is open";
        writer_fail(w, moe_error(MOE_ERR_INVALID_ARG, "JSON writer: %s closed while %s", object ? "object" : "array",
                                 state));
        return;
    }
    if (!w->empty[w->depth]) newline_indent(w, w->depth - 1);
    w->depth--;
    put(w, object ? "}" : "]", 1);
}

void moe_json_begin_object(moe_json_writer *w) { open_container(w, 'k'); }
void moe_json_end_object(moe_json_writer *w) { close_container(w, true); }
void moe_json_begin_array(moe_json_writer *w) { open_container(w, 'a'); }
void moe_json_end_array(moe_json_writer *w) { close_container(w, false); }

void moe_json_key(moe_json_writer *w, const char *key) {
    if (w->status != MOE_OK) return;
    if (w->depth == 0 || w->level[w->depth] != 'k') {
        writer_fail(w, moe_error(MOE_ERR_INVALID_ARG, "JSON writer: key \"%.100s\" where a key cannot go", key));
        return;
    }
    if (!w->empty[w->depth]) put(w, ",", 1);
    w->empty[w->depth] = false;
    newline_indent(w, w->depth);
    write_escaped(w, key, strlen(key), false);
    put_str(w, w->indent > 0 ? ": " : ":");
    w->level[w->depth] = 'v';
}

void moe_json_string_n(moe_json_writer *w, const char *s, size_t len) {
    if (before_value(w)) write_escaped(w, s, len, false);
}

void moe_json_string(moe_json_writer *w, const char *s) { moe_json_string_n(w, s, strlen(s)); }

void moe_json_string_lossy(moe_json_writer *w, const char *s) {
    if (before_value(w)) write_escaped(w, s, strlen(s), true);
}

void moe_json_format_number(char *buf, size_t size, double v) {
    locale_t old = enter_c_locale();
    moe_shortest(buf, size, v);
    leave_c_locale(old);
}

bool moe_json_read_number(const char *text, double *v) {
    moe_json_doc *doc;
    const size_t n = text ? strlen(text) : 0;
    /* The grammar's digits alone: JSON would also take spaces around them. */
    if (n == 0 || strchr(" \t\r\n", text[0]) || strchr(" \t\r\n", text[n - 1])) return false;
    if (moe_json_parse(&doc, text, n, "number") != MOE_OK) return false;
    const moe_json *root = moe_json_root(doc);
    const bool number = root->type == MOE_JSON_NUMBER;
    if (number) *v = root->number.value;
    moe_json_free(doc);
    return number;
}

void moe_json_number(moe_json_writer *w, double v) {
    if (w->status != MOE_OK) return;
    if (!isfinite(v)) {
        writer_fail(w, moe_error(MOE_ERR_INVALID_ARG, "JSON writer: %f has no JSON form", v));
        return;
    }
    if (!before_value(w)) return;
    char text[32];
    moe_json_format_number(text, sizeof text, v);
    put_str(w, text);
    /* %g drops the point of a whole number, and Python's json reads "0" as
     * an int, which a reader that declares the field float (transformers
     * v5's strict configs) refuses. An exponent already reads as float. */
    if (strpbrk(text, ".e") == NULL) put_str(w, ".0");
}

void moe_json_int(moe_json_writer *w, int64_t v) {
    if (!before_value(w)) return;
    char text[32];
    snprintf(text, sizeof text, "%lld", (long long)v);
    put_str(w, text);
}

void moe_json_uint(moe_json_writer *w, uint64_t v) {
    if (!before_value(w)) return;
    char text[32];
    snprintf(text, sizeof text, "%llu", (unsigned long long)v);
    put_str(w, text);
}

void moe_json_bool(moe_json_writer *w, bool v) {
    if (before_value(w)) put_str(w, v ? "true" : "false");
}

void moe_json_null(moe_json_writer *w) {
    if (before_value(w)) put_str(w, "null");
}

moe_status moe_json_writer_finish(moe_json_writer *w) {
    if (w->status != MOE_OK) return w->status;
    if (w->depth != 0 || w->len == 0)
        writer_fail(w, moe_error(MOE_ERR_INVALID_ARG, "JSON writer: document incomplete (%d open containers)",
                                 w->depth));
    return w->status;
}
