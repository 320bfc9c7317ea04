/* json.h: a strict JSON (RFC 8259) parser into a read-only tree, and a small
 * writer into a growing string buffer. Used for config.json, safetensors
 * headers, checkpoint indexes and JSONL metrics.
 *
 * Parser: the whole text must be one JSON value with optional whitespace
 * around it. Rejected, with "name:line:column: reason": comments, trailing
 * commas, single quotes, NaN/Infinity, leading zeros, a leading '+', control
 * characters inside strings, invalid UTF-8 (overlong forms, encoded
 * surrogates, code points past U+10FFFF), unpaired \u surrogates, a byte order
 * mark, duplicate keys in one object, numbers that overflow a double, and
 * nesting deeper than MOE_JSON_MAX_DEPTH. Columns count characters, not bytes.
 *
 * Memory: every node and string of a document lives in one arena owned by
 * the moe_json_doc; moe_json_free() releases all of it at once. */
#ifndef MOE_ENGINE_JSON_H
#define MOE_ENGINE_JSON_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "moe.h"

#define MOE_JSON_MAX_DEPTH 128

typedef enum moe_json_type {
    MOE_JSON_NULL,
    MOE_JSON_BOOL,
    MOE_JSON_NUMBER,
    MOE_JSON_STRING,
    MOE_JSON_ARRAY,
    MOE_JSON_OBJECT,
} moe_json_type;

typedef struct moe_json moe_json;
typedef struct moe_json_member moe_json_member;

struct moe_json {
    moe_json_type type;
    union {
        bool boolean;
        struct {
            double value;
            /* The literal as written, so integers past 2^53 parse exactly. */
            const char *text; /* [text_len], NUL-terminated */
            size_t text_len;
        } number;
        struct {
            const char *data; /* [len] UTF-8, NUL-terminated; may hold \u0000 */
            size_t len;
        } string;
        struct {
            const moe_json *items; /* [count] */
            size_t count;
        } array;
        struct {
            const moe_json_member *members; /* [count], in the order written */
            size_t count;
        } object;
    };
};

struct moe_json_member {
    const char *key; /* [key_len] UTF-8, NUL-terminated */
    size_t key_len;
    moe_json value;
};

typedef struct moe_json_doc moe_json_doc;

/* Parses text [len] (need not be NUL-terminated). `name` (a file name) leads
 * every error message. */
moe_status moe_json_parse(moe_json_doc **doc, const char *text, size_t len, const char *name);

/* Reads the file at path (at most max_bytes) and parses it, path leading
 * every error. */
moe_status moe_json_parse_file(moe_json_doc **doc, const char *path, size_t max_bytes);
const moe_json *moe_json_root(const moe_json_doc *doc);
void moe_json_free(moe_json_doc *doc);

/* The member of an object with this key, or NULL (also when obj is not an
 * object). */
const moe_json *moe_json_get(const moe_json *obj, const char *key);

/* A number's value as int64_t, exact for any integer literal in range. A
 * literal with a fraction or exponent ("4096.0", "1e3") is accepted when its
 * value is a whole number below 2^53. Returns MOE_ERR_FORMAT with no detail
 * set when v is not such a number: the caller knows the key to name. */
moe_status moe_json_int64(const moe_json *v, int64_t *out);

/* The integers moe_json_int64 reads from a literal of v's form: [INT64_MIN,
 * INT64_MAX] for a plain integer, [-(2^53 - 1), 2^53 - 1] for one with a
 * fraction or exponent. A whole number it refuses lies outside this range:
 * a caller can say "out of range" rather than "not an integer". */
void moe_json_int64_range(const moe_json *v, int64_t *lo, int64_t *hi);

/* The text of a string value, or NULL when v is not a string or holds a NUL
 * character (a \u0000 escape): C string functions would stop at the NUL, so
 * "F32\u0000junk" would compare equal to "F32". Readers that compare, print
 * or keep a string's text take it from here; the caller names the file and
 * key, checking v->type first to tell a wrong type from a NUL. */
const char *moe_json_text(const moe_json *v);

/* "null", "true", "number", ... for error messages. */
const char *moe_json_type_name(moe_json_type type);

/* ------------------------------------------------------------------ writer */

/* Builds JSON text in buf. Calls may be chained without checking each one:
 * the first failure (out of memory, a NaN, a key outside an object, a value
 * where a key is due, invalid UTF-8) is kept in `status` and later calls do
 * nothing; moe_json_writer_finish() reports it. indent 0 writes one line; a
 * positive indent puts each member on its own line. */
typedef struct moe_json_writer {
    char *buf; /* [len], NUL-terminated, owned */
    size_t len, cap;
    int indent;
    int depth;
    /* Per open container: 'a' array, 'k' object awaiting a key, 'v' object
     * awaiting the value of the key just written. */
    char level[MOE_JSON_MAX_DEPTH + 1];
    bool empty[MOE_JSON_MAX_DEPTH + 1]; /* level has no item yet */
    moe_status status;
} moe_json_writer;

void moe_json_writer_init(moe_json_writer *w, int indent);
void moe_json_writer_free(moe_json_writer *w);

void moe_json_begin_object(moe_json_writer *w);
void moe_json_end_object(moe_json_writer *w);
void moe_json_begin_array(moe_json_writer *w);
void moe_json_end_array(moe_json_writer *w);
void moe_json_key(moe_json_writer *w, const char *key);
void moe_json_string(moe_json_writer *w, const char *s);
void moe_json_string_n(moe_json_writer *w, const char *s, size_t len);
/* For text from the operating system (file paths, argv), which need not be
 * UTF-8: as moe_json_string, except that each byte that does not begin a
 * valid UTF-8 sequence is written as U+FFFD instead of failing. The bytes of
 * a truncated or overlong sequence are each such a byte. */
void moe_json_string_lossy(moe_json_writer *w, const char *s);
/* v's shortest decimal text that reads back as v, into buf [size >= 32],
 * in the "C" locale whatever the process's (no decimal comma). */
void moe_json_format_number(char *buf, size_t size, double v);

/* Whether text is one JSON number (no hex, no '+', no spaces around it,
 * finite), and then its value in *v, read in the "C" locale. */
bool moe_json_read_number(const char *text, double *v);

/* The shortest decimal text that reads back to the same double, always with
 * a decimal point or an exponent ("1000000.0", "0.0", "1e-05") so that a
 * reader that tells integers from reals (Python's json) reads a real; NaN
 * and infinities have no JSON form and set an error. */
void moe_json_number(moe_json_writer *w, double v);
void moe_json_int(moe_json_writer *w, int64_t v);
void moe_json_uint(moe_json_writer *w, uint64_t v);
void moe_json_bool(moe_json_writer *w, bool v);
void moe_json_null(moe_json_writer *w);

/* Checks that the document is complete and returns the first error, if any.
 * On success w->buf [w->len] holds the text; the writer still owns it. */
moe_status moe_json_writer_finish(moe_json_writer *w);

#endif /* MOE_ENGINE_JSON_H */
