/* corpus.c: text into token shards (corpus.h). Documents are read a batch
 * at a time on one thread, encoded in parallel (the tokenizer is read-only
 * once open), and appended in their order, so the shards do not depend on
 * the thread count. */
#define _GNU_SOURCE /* mkdtemp, getline */
#include "engine/corpus.h"

#include <errno.h>
#include <glob.h>
#include <limits.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/status.h"
#include "engine/data.h"
#include "engine/fileio.h"
#include "engine/json.h"
#include "engine/tokenizer.h"

/* A batch ends at this much text or this many documents, whichever comes
 * first: enough work for every thread, little memory. */
#define BATCH_TEXT_BYTES ((int64_t)64 << 20)
#define BATCH_DOCUMENTS 16384
#define PATH_BYTES 4096
#define ERROR_BYTES 512
/* glob(3) of a prefix's shards: six digits, as the names are written. */
#define SHARD_DIGITS "[0-9][0-9][0-9][0-9][0-9][0-9]"
#define ENDOFTEXT "<|endoftext|>"

static const char *const split_names[2] = {"val", "train"};

void moe_corpus_options_init(moe_corpus_options *o) {
    memset(o, 0, sizeof *o);
    o->text_key = "text";
    o->out = "data/tokens";
    o->shard_tokens = MOE_CORPUS_SHARD_TOKENS_DEFAULT;
}

moe_status moe_corpus_options_validate(const moe_corpus_options *o) {
    if (!o) return moe_error(MOE_ERR_INVALID_ARG, "moe_corpus_options_validate: NULL");
    if (!o->tokenizer) return moe_error(MOE_ERR_CONFIG, "--tokenizer is required: the tokenizer.json that encodes the text");
    if (!o->input) return moe_error(MOE_ERR_CONFIG, "--input is required: the text files (a glob)");
    if (!o->text_key || !*o->text_key) return moe_error(MOE_ERR_CONFIG, "--text-key must not be empty");
    if (!o->out || !*o->out) return moe_error(MOE_ERR_CONFIG, "--out must not be empty");
    /* The prefix is globbed to find its shards: a bracket or star in it
     * would match other files. */
    if (strpbrk(o->out, "*?[\\"))
        return moe_error(MOE_ERR_CONFIG, "--out %s: a prefix without the glob characters * ? [ and \\", o->out);
    const char *base = strrchr(o->out, '/');
    base = base ? base + 1 : o->out;
    if (!*base || strcmp(base, ".") == 0 || strcmp(base, "..") == 0)
        return moe_error(MOE_ERR_CONFIG, "--out %s: a prefix ends in a file name part (data/tokens: "
                                         "data/tokens_train_000001.bin, ...)",
                         o->out);
    if (strlen(o->out) > PATH_BYTES - 64) return moe_error(MOE_ERR_CONFIG, "--out %s: the path is too long", o->out);
    /* Its names: PREFIX_train_NNNNNN.bin, and PREFIX.partial-XXXXXX. */
    if (strlen(base) + strlen("_train_000000.bin") > NAME_MAX)
        return moe_error(MOE_ERR_CONFIG, "--out %s: a shard's file name would pass %d bytes", o->out, NAME_MAX);
    if (o->shard_tokens < 1 || o->shard_tokens > INT32_MAX)
        return moe_error(MOE_ERR_CONFIG, "--shard-tokens %lld: a shard holds 1 to %d tokens (an int32 count)",
                         (long long)o->shard_tokens, INT32_MAX);
    if (o->val_tokens < 0)
        return moe_error(MOE_ERR_CONFIG, "--val-tokens %lld must not be negative", (long long)o->val_tokens);
    if (o->threads < 0) return moe_error(MOE_ERR_CONFIG, "--threads %d must not be negative", o->threads);
    return MOE_OK;
}

/* ------------------------------------------------------------- separator */

typedef enum separator_kind { SEPARATOR_NONE, SEPARATOR_SPECIAL, SEPARATOR_TOKEN } separator_kind;

/* How documents are told apart (corpus.h), into plan. */
static moe_status choose_separator(separator_kind *kind, moe_corpus_plan *plan, const moe_tokenizer *t,
                                   const moe_corpus_options *o) {
    int32_t *ids = NULL;
    int64_t n = 0;
    *kind = SEPARATOR_NONE;
    plan->n_separator = 0;
    plan->separator_from_tokenizer = false;
    if (o->separator && !*o->separator) return MOE_OK;
    if (!o->separator) {
        MOE_TRY(moe_tokenizer_encode(t, "", true, &ids, &n));
        if (n > 0 && n <= (int64_t)(sizeof plan->separator / sizeof *plan->separator)) {
            memcpy(plan->separator, ids, (size_t)n * sizeof *ids);
            plan->n_separator = (int)n;
            plan->separator_from_tokenizer = true;
            *kind = SEPARATOR_SPECIAL;
            free(ids);
            return MOE_OK;
        }
        free(ids);
        if (n > 0)
            return moe_error(MOE_ERR_CONFIG, "--tokenizer %s adds %lld special tokens to every text, more than "
                                             "the %zu taken: name one that separates documents, --separator TEXT",
                             o->tokenizer, (long long)n, sizeof plan->separator / sizeof *plan->separator);
    }
    const char *text = o->separator ? o->separator : ENDOFTEXT;
    moe_status st = moe_tokenizer_encode(t, text, false, &ids, &n);
    if (st != MOE_OK) return moe_error_prefix(st, "--separator: ");
    if (n == 1) {
        plan->separator[0] = ids[0];
        plan->n_separator = 1;
        *kind = SEPARATOR_TOKEN;
    }
    free(ids);
    if (n == 1) return MOE_OK;
    if (o->separator)
        return moe_error(MOE_ERR_CONFIG, "--separator '%s' encodes to %lld tokens with --tokenizer %s, not one",
                         o->separator, (long long)n, o->tokenizer);
    return moe_error(MOE_ERR_CONFIG, "--tokenizer %s adds no special token to a text and has no " ENDOFTEXT
                                     " token: name the one that separates documents, --separator TEXT ('' for none)",
                     o->tokenizer);
}

/* ------------------------------------------------------------- documents */

typedef struct document {
    char *text; /* NUL-terminated, [len] */
    int64_t len;
    int64_t file; /* index into the input's matches */
    int64_t line; /* a .jsonl file's, from 1; 0: the whole file */
    int32_t *ids; /* [n], after encoding */
    int64_t n;
    moe_status st;
    char error[ERROR_BYTES];
} document;

typedef struct reader {
    glob_t matches;
    const char *const *files; /* [n_files]: the matches, or the one file named */
    size_t n_files;
    size_t file;       /* the one being read */
    FILE *jsonl;       /* open while a .jsonl file is read */
    int64_t line;      /* its last line read */
    char *line_buf;    /* getline's */
    size_t line_cap;
    const char *key;
    const char *input;
    bool from_stdin; /* input "-": standard input, as a .jsonl file */
} reader;

/* The files input names, as --data takes a glob: a regular file of that
 * very name is the one file, though it may also read as a glob
 * ("notes[v2].txt" would match "notes2.txt"); "-" is standard input. */
static moe_status find_inputs(reader *r, const char *input) {
    struct stat sb;
    r->input = input;
    r->from_stdin = strcmp(input, "-") == 0;
    if (r->from_stdin) r->input = "stdin";
    if (r->from_stdin || (stat(input, &sb) == 0 && S_ISREG(sb.st_mode))) {
        r->files = &r->input;
        r->n_files = 1;
        return MOE_OK;
    }
    const int rc = glob(input, 0, NULL, &r->matches); /* sorted: no GLOB_NOSORT */
    if (rc == GLOB_NOMATCH) return moe_error(MOE_ERR_IO, "--input %s: no file matches", input);
    if (rc != 0)
        return moe_error(MOE_ERR_IO, "--input %s: glob failed (%s)", input,
                         rc == GLOB_NOSPACE ? "out of memory" : "read error");
    r->files = (const char *const *)r->matches.gl_pathv;
    r->n_files = r->matches.gl_pathc;
    /* Refused before any is read: no retry makes a folder a document. */
    for (size_t i = 0; i < r->n_files; i++)
        if (stat(r->files[i], &sb) == 0 && !S_ISREG(sb.st_mode))
            return moe_error(MOE_ERR_CONFIG, "--input %s matches %s, which is no file", input, r->files[i]);
    return MOE_OK;
}

static bool ends_with(const char *s, const char *suffix) {
    const size_t n = strlen(s), k = strlen(suffix);
    return n >= k && strcasecmp(s + n - k, suffix) == 0;
}

static bool is_jsonl(const char *path) { return ends_with(path, ".jsonl") || ends_with(path, ".ndjson"); }

static moe_status check_no_nul(const char *text, int64_t len, const char *where) {
    const size_t at = strlen(text);
    if ((int64_t)at < len)
        return moe_error(MOE_ERR_CONFIG, "%s: byte %zu is NUL, which no text holds (a binary file?)", where, at);
    return MOE_OK;
}

/* The document of one .jsonl line (where: PATH:LINE), or *skip for a blank
 * one. */
static moe_status parse_line(document *d, bool *skip, reader *r, const char *path, const char *where, int64_t len) {
    char *s = r->line_buf;
    while (len > 0 && (s[len - 1] == '\n' || s[len - 1] == '\r')) s[--len] = '\0';
    int64_t i = 0;
    while (i < len && (s[i] == ' ' || s[i] == '\t')) i++;
    *skip = i == len;
    if (*skip) return MOE_OK;
    if (len > MOE_CORPUS_DOCUMENT_MAX_BYTES)
        return moe_error(MOE_ERR_CONFIG, "%s: a line of %lld bytes, over the %lld read", where, (long long)len,
                         (long long)MOE_CORPUS_DOCUMENT_MAX_BYTES);
    moe_json_doc *doc;
    moe_status st = moe_json_parse(&doc, s, (size_t)len, path);
    /* A line that is no JSON is bad input, as the other faults below: the
     * same file fails the same way on every try. */
    if (st == MOE_ERR_FORMAT) st = MOE_ERR_CONFIG;
    if (st != MOE_OK) {
        /* The parser counts lines in the one it was given: path:1:COLUMN
         * becomes path:LINE:COLUMN. */
        const char *e = moe_last_error();
        const size_t k = strlen(path);
        if (strncmp(e, path, k) == 0 && strncmp(e + k, ":1:", 3) == 0) {
            char rest[ERROR_BYTES];
            snprintf(rest, sizeof rest, "%s", e + k + 3);
            return moe_error(st, "%s:%s", where, rest);
        }
        return moe_error_prefix(st, "%s: ", where);
    }
    const moe_json *root = moe_json_root(doc), *v = NULL;
    if (root->type != MOE_JSON_OBJECT)
        st = moe_error(MOE_ERR_CONFIG, "%s: a line is a JSON object, this one a %s", where, moe_json_type_name(root->type));
    else if (!(v = moe_json_get(root, r->key)))
        st = moe_error(MOE_ERR_CONFIG, "%s: no \"%s\" (--text-key)", where, r->key);
    else if (v->type != MOE_JSON_STRING)
        st = moe_error(MOE_ERR_CONFIG, "%s: \"%s\" is a %s, not a string", where, r->key, moe_json_type_name(v->type));
    else if (!moe_json_text(v))
        st = moe_error(MOE_ERR_CONFIG, "%s: \"%s\" holds a NUL (\\u0000), which no text holds", where, r->key);
    else if (!(d->text = strdup(moe_json_text(v))))
        st = moe_error(MOE_ERR_OUT_OF_MEMORY, "%s: a copy of the text", where);
    moe_json_free(doc);
    if (st != MOE_OK) return st;
    d->len = (int64_t)strlen(d->text);
    d->line = r->line;
    return MOE_OK;
}

/* The next document into d, or *end after the last. */
static moe_status next_document(document *d, bool *end, reader *r) {
    memset(d, 0, sizeof *d);
    *end = false;
    for (;;) {
        if (r->file >= r->n_files) {
            *end = true;
            return MOE_OK;
        }
        const char *path = r->files[r->file];
        d->file = (int64_t)r->file;
        if (!r->from_stdin && !is_jsonl(path)) {
            int64_t size;
            FILE *f;
            MOE_TRY(moe_file_open_read(&f, &size, path)); /* a directory or a FIFO is refused, named */
            fclose(f);
            if (size > MOE_CORPUS_DOCUMENT_MAX_BYTES)
                return moe_error(MOE_ERR_CONFIG, "%s: %lld bytes, over the %lld a document may hold (split it, or "
                                                 "make it a .jsonl of documents)",
                                 path, (long long)size, (long long)MOE_CORPUS_DOCUMENT_MAX_BYTES);
            size_t n;
            MOE_TRY(moe_file_read_all(&d->text, &n, path, (size_t)MOE_CORPUS_DOCUMENT_MAX_BYTES));
            d->len = (int64_t)n;
            r->file++;
            const moe_status st = check_no_nul(d->text, d->len, path);
            if (st != MOE_OK) free(d->text);
            return st;
        }
        if (!r->jsonl) {
            int64_t size;
            if (r->from_stdin) r->jsonl = stdin;
            else MOE_TRY(moe_file_open_read(&r->jsonl, &size, path));
            r->line = 0;
        }
        errno = 0;
        const ssize_t len = getline(&r->line_buf, &r->line_cap, r->jsonl);
        if (len < 0) {
            const int err = errno;
            const bool failed = ferror(r->jsonl);
            if (r->jsonl != stdin) fclose(r->jsonl);
            r->jsonl = NULL;
            if (failed) return moe_error(MOE_ERR_IO, "%s: read after line %lld: %s", path, (long long)r->line, strerror(err));
            r->file++;
            continue;
        }
        r->line++;
        char where[PATH_BYTES + 32];
        snprintf(where, sizeof where, "%s:%lld", path, (long long)r->line);
        MOE_TRY(check_no_nul(r->line_buf, len, where));
        bool skip;
        MOE_TRY(parse_line(d, &skip, r, path, where, len));
        if (!skip) return MOE_OK;
    }
}

static void reader_close(reader *r) {
    if (r->jsonl && r->jsonl != stdin) fclose(r->jsonl);
    free(r->line_buf);
    globfree(&r->matches);
}

/* ---------------------------------------------------------------- shards */

typedef struct writer {
    const moe_corpus_options *o;
    const moe_corpus_callbacks *cb;
    char staging[PATH_BYTES]; /* the folder they are written into */
    const char *base;         /* the prefix's file name part */
    int token_bytes;
    int32_t *buf; /* [cap] the shard being filled, [n] of it so far */
    int64_t n, cap;
    int split;     /* 0 val, 1 train */
    int64_t index; /* the next shard's */
    int64_t split_tokens[2], split_shards[2];
    bool keep_staging; /* it holds old shards a failed publish could not move back */
    bool in_memory;    /* one stream in buf, no shard written */
} writer;

/* A shard's name [PATH_BYTES], in dir (the staging folder) or, dir NULL,
 * in place. */
static moe_status shard_path(char *path, const writer *w, const char *dir, int split, int64_t index) {
    const int n = dir ? snprintf(path, PATH_BYTES, "%s/%s_%s_%06lld.bin", dir, w->base, split_names[split],
                                 (long long)index)
                      : snprintf(path, PATH_BYTES, "%s_%s_%06lld.bin", w->o->out, split_names[split], (long long)index);
    if (n < 0 || n >= PATH_BYTES) return moe_error(MOE_ERR_CONFIG, "--out %s: a shard's path is too long", w->o->out);
    return MOE_OK;
}

static moe_status flush_shard(writer *w) {
    if (w->n == 0 || w->in_memory) return MOE_OK;
    char staged[PATH_BYTES], final[PATH_BYTES];
    MOE_TRY(shard_path(staged, w, w->staging, w->split, w->index));
    MOE_TRY(shard_path(final, w, NULL, w->split, w->index));
    MOE_TRY(moe_data_write_shard(staged, w->buf, w->n, w->token_bytes));
    if (w->cb->on_shard) w->cb->on_shard(w->cb->ctx, final, w->n);
    w->split_tokens[w->split] += w->n;
    w->split_shards[w->split]++;
    w->index++;
    w->n = 0;
    return MOE_OK;
}

static moe_status append(writer *w, const int32_t *ids, int64_t n) {
    while (n > 0) {
        if (w->n == w->cap) {
            /* Grown as tokens come: a small corpus never holds a whole
             * shard's 400 MB. */
            const int64_t cap = w->cap == 0 ? (int64_t)1 << 16 : w->cap * 2;
            const int64_t want = w->in_memory || cap < w->o->shard_tokens ? cap : w->o->shard_tokens;
            int32_t *buf = (size_t)want <= SIZE_MAX / sizeof *buf ? realloc(w->buf, (size_t)want * sizeof *buf) : NULL;
            if (!buf) return moe_error(MOE_ERR_OUT_OF_MEMORY, "%lld tokens of %s", (long long)want, w->o->input);
            w->buf = buf;
            w->cap = want;
        }
        const int64_t room = w->cap - w->n, m = n < room ? n : room;
        memcpy(w->buf + w->n, ids, (size_t)m * sizeof *ids);
        w->n += m;
        ids += m;
        n -= m;
        if (!w->in_memory && w->n == w->o->shard_tokens) MOE_TRY(flush_shard(w));
    }
    return MOE_OK;
}

/* glob's: a folder that cannot be listed might hide shards (a missing one
 * holds none). */
static int unlistable(const char *path, int err) {
    (void)path;
    return err != ENOENT && err != ENOTDIR;
}

/* The shards of prefix out already on disk, into *found (globfree it);
 * anything of a shard's name but a file (or a link) is refused. */
static moe_status find_shards(glob_t *found, const char *out) {
    char pattern[PATH_BYTES];
    memset(found, 0, sizeof *found);
    for (int split = 0; split < 2; split++) {
        snprintf(pattern, sizeof pattern, "%s_%s_" SHARD_DIGITS ".bin", out, split_names[split]);
        const int rc = glob(pattern, split ? GLOB_APPEND : 0, unlistable, found);
        if (rc != 0 && rc != GLOB_NOMATCH) {
            globfree(found);
            return moe_error(MOE_ERR_IO, "--out %s: listing its shards failed (%s)", out,
                             rc == GLOB_NOSPACE ? "out of memory" : "a folder cannot be read");
        }
    }
    for (size_t i = 0; i < found->gl_pathc; i++) {
        struct stat sb;
        if (lstat(found->gl_pathv[i], &sb) == 0 && !S_ISREG(sb.st_mode) && !S_ISLNK(sb.st_mode)) {
            const moe_status st = moe_error(MOE_ERR_CONFIG, "--out %s: %s has a shard's name and is no file", out,
                                            found->gl_pathv[i]);
            globfree(found);
            return st;
        }
    }
    return MOE_OK;
}

/* The staging folders of runs into the prefix that did not finish (or
 * still run): one killed while moving shards left a mix in place. */
static void warn_leftovers(const moe_corpus_options *o, const moe_corpus_callbacks *cb) {
    char pattern[PATH_BYTES];
    glob_t g;
    snprintf(pattern, sizeof pattern, "%s.partial-*", o->out);
    if (!cb->on_warning || glob(pattern, GLOB_ONLYDIR, NULL, &g) != 0) return;
    for (size_t i = 0; i < g.gl_pathc; i++) {
        char message[PATH_BYTES + 512];
        snprintf(message, sizeof message,
                 "%s is left by a run into --out %s that did not finish, or that runs still: if it holds old-* "
                 "shards, that run was killed while moving shards into place, and those in place may mix two "
                 "corpora (--overwrite puts one whole in place); remove it once no run uses it",
                 g.gl_pathv[i], o->out);
        cb->on_warning(cb->ctx, message);
    }
    globfree(&g);
}

/* Where old shard path waits in the staging folder [PATH_BYTES]. */
static moe_status aside_path(char *aside, const writer *w, const char *path) {
    const char *base = strrchr(path, '/');
    const int n = snprintf(aside, PATH_BYTES, "%s/old-%s", w->staging, base ? base + 1 : path);
    if (n < 0 || n >= PATH_BYTES) return moe_error(MOE_ERR_CONFIG, "--out %s: a shard's path is too long", w->o->out);
    return MOE_OK;
}

/* The new shard i's staged and final names [PATH_BYTES]. */
static moe_status new_paths(char *staged, char *final, const writer *w, int64_t i) {
    const int split = i < w->split_shards[0] ? 0 : 1;
    MOE_TRY(shard_path(staged, w, w->staging, split, i));
    return shard_path(final, w, NULL, split, i);
}

static moe_status move(const char *from, const char *to, const char *what) {
    if (rename(from, to) == 0) return MOE_OK;
    return moe_error(MOE_ERR_IO, "moving %s %s to %s: %s", what, from, to, strerror(errno));
}

/* All or nothing: the old shards move into the staging folder (removed
 * with it), then the new ones into place; a failure moves back what
 * moved, the new shards out and the old ones in. */
static moe_status publish(writer *w, const glob_t *old) {
    char a[PATH_BYTES], b[PATH_BYTES];
    moe_status st = MOE_OK;
    size_t aside = 0;
    int64_t placed = 0;
    while (st == MOE_OK && aside < old->gl_pathc) {
        st = aside_path(a, w, old->gl_pathv[aside]);
        if (st == MOE_OK) st = move(old->gl_pathv[aside], a, "the old shard");
        if (st == MOE_OK) aside++;
    }
    while (st == MOE_OK && placed < w->index) {
        st = new_paths(a, b, w, placed);
        if (st == MOE_OK) st = move(a, b, "the shard");
        if (st == MOE_OK) placed++;
    }
    if (st == MOE_OK) return MOE_OK;
    char why[ERROR_BYTES];
    snprintf(why, sizeof why, "%s", moe_last_error());
    bool restored = true;
    for (int64_t i = 0; i < placed; i++)
        restored &= new_paths(a, b, w, i) == MOE_OK && rename(b, a) == 0;
    for (size_t i = 0; i < aside; i++)
        restored &= aside_path(a, w, old->gl_pathv[i]) == MOE_OK && rename(a, old->gl_pathv[i]) == 0;
    w->keep_staging = !restored;
    return moe_error(st, "%s (%s%s%s)", why,
                     restored ? "the shards there stay as they were"
                              : "and moving them back failed: the old ones left out wait in ",
                     restored ? "" : w->staging, restored ? "" : " as old-NAME");
}

/* --------------------------------------------------------------- encoding */

static void encode_batch(document *docs, int64_t n, const moe_tokenizer *t, separator_kind kind) {
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; i++) {
        document *d = &docs[i];
        if (d->len == 0) continue;
        d->st = moe_tokenizer_encode(t, d->text, kind == SEPARATOR_SPECIAL, &d->ids, &d->n);
        if (d->st != MOE_OK) snprintf(d->error, sizeof d->error, "%s", moe_last_error());
    }
}

/* Appends the batch's documents in order; the first that failed stops it. */
static moe_status write_batch(writer *w, moe_corpus_totals *totals, const document *docs, int64_t n,
                              const reader *r, const moe_corpus_plan *plan, separator_kind kind) {
    for (int64_t i = 0; i < n; i++) {
        const document *d = &docs[i];
        const char *path = r->files[d->file];
        if (d->st != MOE_OK) {
            if (d->line) return moe_error(d->st, "%s:%lld: %s", path, (long long)d->line, d->error);
            return moe_error(d->st, "%s: %s", path, d->error);
        }
        totals->documents++;
        totals->text_bytes += d->len;
        if (d->len == 0) {
            totals->empty_documents++;
            continue;
        }
        if (w->split == 0 && w->split_tokens[0] + w->n >= w->o->val_tokens) {
            MOE_TRY(flush_shard(w));
            w->split = 1;
        }
        if (kind == SEPARATOR_TOKEN) MOE_TRY(append(w, plan->separator, 1));
        MOE_TRY(append(w, d->ids, d->n));
    }
    return MOE_OK;
}

static void free_batch(document *docs, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        free(docs[i].text);
        free(docs[i].ids);
    }
}

/* Reads, encodes and writes every document into the staging folder. */
static moe_status encode_all(writer *w, moe_corpus_totals *totals, reader *r, const moe_tokenizer *t,
                             const moe_corpus_plan *plan, separator_kind kind) {
    document *docs = calloc(BATCH_DOCUMENTS, sizeof *docs);
    if (!docs) return moe_error(MOE_ERR_OUT_OF_MEMORY, "a batch of %d documents", BATCH_DOCUMENTS);
    moe_status st = MOE_OK;
    for (bool end = false; st == MOE_OK && !end;) {
        int64_t n = 0, bytes = 0;
        moe_status read = MOE_OK;
        while (n < BATCH_DOCUMENTS && bytes < BATCH_TEXT_BYTES) {
            read = next_document(&docs[n], &end, r);
            if (read != MOE_OK || end) break;
            bytes += docs[n++].len;
        }
        /* The documents read before a fault come first: an error of
         * theirs is the first in the input's order. */
        encode_batch(docs, n, t, kind);
        st = write_batch(w, totals, docs, n, r, plan, kind);
        if (st == MOE_OK) st = read;
        free_batch(docs, n);
    }
    free(docs);
    if (st == MOE_OK) st = flush_shard(w);
    return st;
}

/* What both entry points open: the tokenizer, how documents are told
 * apart, the input's files. */
typedef struct encoder {
    moe_tokenizer *t;
    reader r;
    moe_corpus_plan plan;
    separator_kind kind;
} encoder;

static moe_status encoder_open(encoder *e, const moe_corpus_options *o) {
    *e = (encoder){.r = {.key = o->text_key}, .plan = {.threads = omp_get_max_threads()}};
    MOE_TRY(moe_tokenizer_open(&e->t, o->tokenizer));
    const char *why;
    if (!moe_tokenizer_can_encode(e->t, &why))
        return moe_error(MOE_ERR_CONFIG, "--tokenizer %s encodes no text: %s", o->tokenizer, why);
    MOE_TRY(choose_separator(&e->kind, &e->plan, e->t, o));
    MOE_TRY(find_inputs(&e->r, o->input));
    e->plan.tokenizer_tokens = moe_tokenizer_count(e->t);
    e->plan.token_bytes = e->plan.tokenizer_tokens <= (int64_t)UINT16_MAX + 1 ? 2 : 4;
    e->plan.files = (int64_t)e->r.n_files;
    return MOE_OK;
}

static void encoder_close(encoder *e) {
    reader_close(&e->r);
    moe_tokenizer_close(e->t);
}

moe_status moe_corpus_encode(int32_t **tokens, int64_t *n, const char *tokenizer, const char *input) {
    moe_corpus_options o;
    moe_corpus_options_init(&o);
    o.tokenizer = tokenizer;
    o.input = input;
    moe_corpus_totals totals = {0};
    const moe_corpus_callbacks none = {0};
    writer w = {.o = &o, .cb = &none, .split = 1, .in_memory = true};
    encoder e;
    moe_status st = encoder_open(&e, &o);
    if (st == MOE_OK) st = encode_all(&w, &totals, &e.r, e.t, &e.plan, e.kind);
    if (st == MOE_OK && w.n == 0) st = moe_error(MOE_ERR_CONFIG, "%s: no document holds text", input);
    encoder_close(&e);
    if (st != MOE_OK) {
        free(w.buf);
        return st;
    }
    *tokens = w.buf;
    *n = w.n;
    return MOE_OK;
}

moe_status moe_corpus_tokenize(const moe_corpus_options *o, const moe_corpus_callbacks *callbacks,
                               moe_corpus_totals *totals) {
    const double start = moe_monotonic_seconds();
    MOE_TRY(moe_corpus_options_validate(o));
    const moe_corpus_callbacks none = {0}, *cb = callbacks ? callbacks : &none;
    memset(totals, 0, sizeof *totals);
    if (o->threads > 0) omp_set_num_threads(o->threads);

    glob_t old;
    MOE_TRY(find_shards(&old, o->out));
    if (old.gl_pathc > 0 && !o->overwrite) {
        const moe_status st = moe_error(MOE_ERR_CONFIG, "--out %s: %s is there (a corpus written before): "
                                                        "--overwrite replaces its shards",
                                        o->out, old.gl_pathv[0]);
        globfree(&old);
        return st;
    }
    warn_leftovers(o, cb);
    encoder e;
    moe_status st = encoder_open(&e, o);
    writer w = {.o = o, .cb = cb, .split = o->val_tokens > 0 ? 0 : 1, .token_bytes = e.plan.token_bytes};
    w.base = strrchr(o->out, '/') ? strrchr(o->out, '/') + 1 : o->out;
    const int64_t *tokens = w.split_tokens;
    char dir[PATH_BYTES]; /* the prefix's folder; "" for the working one */
    snprintf(dir, sizeof dir, "%.*s", (int)(w.base - o->out), o->out);
    if (st == MOE_OK) {
        if (cb->on_start) cb->on_start(cb->ctx, &e.plan);
        if (*dir) st = moe_mkdir_p(dir);
    }
    bool staged = false;
    if (st == MOE_OK) {
        snprintf(w.staging, sizeof w.staging, "%s.partial-XXXXXX", o->out);
        staged = mkdtemp(w.staging) != NULL;
        if (!staged) st = moe_error(MOE_ERR_IO, "creating %s: %s", w.staging, strerror(errno));
    }
    if (st == MOE_OK) st = encode_all(&w, totals, &e.r, e.t, &e.plan, e.kind);
    if (st == MOE_OK && tokens[0] + tokens[1] == 0)
        st = moe_error(MOE_ERR_CONFIG, "--input %s: no document holds text", o->input);
    else if (st == MOE_OK && tokens[1] == 0)
        st = moe_error(MOE_ERR_CONFIG, "--val-tokens %lld: the validation split took all %lld tokens, none is left "
                                       "to train on",
                       (long long)o->val_tokens, (long long)tokens[0]);
    if (st == MOE_OK) st = publish(&w, &old);
    if (st == MOE_OK) st = moe_fsync_dir(*dir ? dir : ".");
    if (staged && !w.keep_staging) {
        const moe_status removed = moe_remove_tree(w.staging);
        if (st == MOE_OK) st = removed;
    }
    free(w.buf);
    encoder_close(&e);
    globfree(&old);
    totals->val_tokens = tokens[0];
    totals->train_tokens = tokens[1];
    totals->val_shards = w.split_shards[0];
    totals->train_shards = w.split_shards[1];
    totals->seconds = moe_monotonic_seconds() - start;
    return st;
}
