#define _POSIX_C_SOURCE 200809L
#define _FILE_OFFSET_BITS 64 /* off_t for shards past 2 GiB on 32-bit hosts too */

#include "engine/data.h"

#include <errno.h>
#include <glob.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>

#include "common/rng.h"
#include "common/status.h"
#include "engine/fileio.h"

/* Bytes moved per fread or fwrite: a stack buffer, so reading a batch
 * allocates nothing. */
#define IO_CHUNK_BYTES 8192

typedef struct data_file {
    char *path;
    int64_t first;        /* stream offset of its first token */
    int64_t count;        /* tokens it holds */
    int64_t header_bytes; /* before the first token */
    int64_t token_bytes;  /* 1: raw bytes, 2 or 4: little-endian uint16 or uint32 */
} data_file;

struct moe_data {
    char *name; /* path, pattern or the caller's name, for messages */
    int64_t vocab_size;
    int64_t n_tokens; /* of the stream: the sources' tokens [base, base + n_tokens) */
    int64_t base;     /* moe_data_restrict's */
    int32_t *memory;  /* the sources' tokens, for a source in memory, else NULL */
    data_file *files; /* [n_files] in stream order, for a source on disk */
    int64_t n_files;
    FILE *open_file; /* files[open_index]: kept open between batches */
    int64_t open_index;
    int shuffle;
    uint64_t seed;
    moe_data_position pos;
    int64_t *order; /* [order_len] chunk order of epoch order_epoch */
    int64_t order_len, order_epoch;
};

static void put_le32(unsigned char *b, uint32_t v) {
    b[0] = (unsigned char)v;
    b[1] = (unsigned char)(v >> 8);
    b[2] = (unsigned char)(v >> 16);
    b[3] = (unsigned char)(v >> 24);
}

static moe_status data_new(moe_data **out, const char *name, int64_t vocab_size) {
    *out = NULL;
    moe_data *d = calloc(1, sizeof *d);
    if (d == NULL || (d->name = strdup(name)) == NULL) {
        free(d);
        return moe_error(MOE_ERR_OUT_OF_MEMORY, "%s: out of memory", name);
    }
    d->vocab_size = vocab_size;
    d->open_index = -1;
    d->order_epoch = -1;
    *out = d;
    return MOE_OK;
}

void moe_data_close(moe_data *data) {
    if (data == NULL) return;
    if (data->open_file != NULL) fclose(data->open_file);
    for (int64_t i = 0; i < data->n_files; i++) free(data->files[i].path);
    free(data->files);
    free(data->memory);
    free(data->order);
    free(data->name);
    free(data);
}

/* Appends a file of count tokens to the stream. */
static moe_status add_file(moe_data *d, const char *path, int64_t count, int64_t header_bytes,
                           int64_t token_bytes) {
    data_file *files = realloc(d->files, (size_t)(d->n_files + 1) * sizeof *files);
    if (files == NULL) return moe_error(MOE_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
    d->files = files;
    data_file *f = &files[d->n_files];
    if ((f->path = strdup(path)) == NULL)
        return moe_error(MOE_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
    f->first = d->n_tokens;
    f->count = count;
    f->header_bytes = header_bytes;
    f->token_bytes = token_bytes;
    d->n_files++;
    d->n_tokens += count;
    return MOE_OK;
}


moe_status moe_data_open_bytes(moe_data **data, const char *path) {
    if (data == NULL || path == NULL)
        return moe_error(MOE_ERR_INVALID_ARG, "moe_data_open_bytes: NULL argument");
    *data = NULL;
    FILE *file;
    int64_t size = 0;
    MOE_TRY(moe_file_open_read(&file, &size, path));
    fclose(file);
    if (size == 0) return moe_error(MOE_ERR_FORMAT, "%s: empty file, no tokens to read", path);
    moe_data *d;
    MOE_TRY(data_new(&d, path, MOE_BYTE_VOCAB_SIZE));
    const moe_status st = add_file(d, path, size, 0, 1);
    if (st != MOE_OK) {
        moe_data_close(d);
        return st;
    }
    *data = d;
    return MOE_OK;
}

/* The shard formats: llm.c's GPT-2 and Llama 3 ones. */
static const struct {
    int32_t magic, version;
    int token_bytes;
    const char *tokens;
} shard_formats[] = {
    {MOE_SHARD_MAGIC, MOE_SHARD_VERSION, 2, "uint16"},
    {MOE_SHARD32_MAGIC, MOE_SHARD32_VERSION, 4, "uint32"},
};
#define N_SHARD_FORMATS (sizeof shard_formats / sizeof *shard_formats)

/* The shard format of a header's magic, or N_SHARD_FORMATS. */
static size_t shard_format(int32_t magic) {
    size_t f = 0;
    while (f < N_SHARD_FORMATS && shard_formats[f].magic != magic) f++;
    return f;
}

bool moe_data_is_shard_magic(int32_t magic) { return shard_format(magic) < N_SHARD_FORMATS; }

/* Checks one shard's header against its size and appends it. */
static moe_status add_shard(moe_data *d, const char *path) {
    FILE *file;
    int64_t size = 0;
    MOE_TRY(moe_file_open_read(&file, &size, path));
    moe_status st = MOE_OK;
    unsigned char header[MOE_SHARD_HEADER_BYTES];
    if (st == MOE_OK && size < MOE_SHARD_HEADER_BYTES)
        st = moe_error(MOE_ERR_FORMAT,
                       "%s: %lld bytes, shorter than the %d-byte shard header (truncated?)", path,
                       (long long)size, MOE_SHARD_HEADER_BYTES);
    if (st == MOE_OK && fread(header, 1, sizeof header, file) != sizeof header)
        st = moe_error(MOE_ERR_IO, "%s: cannot read the header: %s", path,
                       ferror(file) ? strerror(errno) : "file shrank");
    fclose(file);
    MOE_TRY(st);

    int32_t magic = (int32_t)moe_get_le32(header), version = (int32_t)moe_get_le32(header + 4);
    int32_t count = (int32_t)moe_get_le32(header + 8);
    const size_t f = shard_format(magic);
    if (f == N_SHARD_FORMATS)
        return moe_error(MOE_ERR_FORMAT,
                         "%s: magic %d, expected %d or %d (an llm.c token shard of uint16 or uint32 tokens)",
                         path, magic, MOE_SHARD_MAGIC, MOE_SHARD32_MAGIC);
    if (version != shard_formats[f].version)
        return moe_error(MOE_ERR_FORMAT, "%s: version %d, expected %d (magic %d: %s tokens)", path,
                         version, shard_formats[f].version, magic, shard_formats[f].tokens);
    if (count < 0)
        return moe_error(MOE_ERR_FORMAT, "%s: header says %d tokens, a negative count", path,
                         count);
    const int64_t token_bytes = shard_formats[f].token_bytes;
    int64_t expect = MOE_SHARD_HEADER_BYTES + token_bytes * (int64_t)count;
    if (size != expect)
        return moe_error(MOE_ERR_FORMAT,
                         "%s: header says %d tokens (%lld bytes with the header), the file has "
                         "%lld bytes (%s)",
                         path, count, (long long)expect, (long long)size,
                         size < expect ? "truncated" : "trailing bytes or a wrong count");
    return add_file(d, path, count, MOE_SHARD_HEADER_BYTES, token_bytes);
}

moe_status moe_data_open_shards(moe_data **data, const char *pattern, int64_t vocab_size) {
    if (data == NULL || pattern == NULL)
        return moe_error(MOE_ERR_INVALID_ARG, "moe_data_open_shards: NULL argument");
    *data = NULL;
    if (vocab_size < 1)
        return moe_error(MOE_ERR_CONFIG, "%s: vocab_size=%lld, must be at least 1", pattern,
                         (long long)vocab_size);
    /* A regular file of that very name is the one shard, though its name
     * may also read as a glob ("notes[v2].bin" would match "notes2.bin"). */
    glob_t g = {0};
    struct stat sb;
    char *literal[1] = {(char *)pattern};
    const bool named = stat(pattern, &sb) == 0 && S_ISREG(sb.st_mode);
    int rc = named ? 0 : glob(pattern, 0, NULL, &g); /* sorted: no GLOB_NOSORT */
    if (named) g.gl_pathc = 1, g.gl_pathv = literal;
    if (rc == GLOB_NOMATCH) return moe_error(MOE_ERR_IO, "%s: no file matches", pattern);
    if (rc != 0) {
        globfree(&g);
        return moe_error(MOE_ERR_IO, "%s: glob failed (%s)", pattern,
                         rc == GLOB_NOSPACE ? "out of memory" : "read error");
    }
    moe_data *d;
    moe_status st = data_new(&d, pattern, vocab_size);
    for (size_t i = 0; st == MOE_OK && i < g.gl_pathc; i++) st = add_shard(d, g.gl_pathv[i]);
    if (!named) globfree(&g);
    if (st == MOE_OK && d->n_tokens == 0)
        st = moe_error(MOE_ERR_FORMAT, "%s: the matching shards hold no tokens", pattern);
    if (st != MOE_OK) {
        moe_data_close(d);
        return st;
    }
    *data = d;
    return MOE_OK;
}

moe_status moe_data_from_tokens(moe_data **data, const int32_t *tokens, int64_t n,
                                int64_t vocab_size, const char *name) {
    if (data == NULL || tokens == NULL || name == NULL)
        return moe_error(MOE_ERR_INVALID_ARG, "moe_data_from_tokens: NULL argument");
    *data = NULL;
    if (n < 1 || vocab_size < 1)
        return moe_error(MOE_ERR_INVALID_ARG,
                         "%s: %lld tokens with vocab_size=%lld, need >= 1 each", name,
                         (long long)n, (long long)vocab_size);
    for (int64_t i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= vocab_size)
            return moe_error(MOE_ERR_INVALID_ARG, "%s: token %lld is %d, outside [0, %lld)", name,
                             (long long)i, tokens[i], (long long)vocab_size);
    moe_data *d;
    MOE_TRY(data_new(&d, name, vocab_size));
    d->memory = malloc((size_t)n * sizeof *d->memory);
    if (d->memory == NULL) {
        moe_data_close(d);
        return moe_error(MOE_ERR_OUT_OF_MEMORY, "%s: cannot allocate %lld tokens", name,
                         (long long)n);
    }
    memcpy(d->memory, tokens, (size_t)n * sizeof *d->memory);
    d->n_tokens = n;
    *data = d;
    return MOE_OK;
}

int64_t moe_data_vocab_size(const moe_data *data) { return data->vocab_size; }

int64_t moe_data_token_count(const moe_data *data) { return data->n_tokens; }

void moe_data_set_shuffle(moe_data *data, int shuffle, uint64_t seed) {
    data->shuffle = shuffle != 0;
    data->seed = seed;
    data->pos = (moe_data_position){0, 0};
    data->order_epoch = -1;
}

moe_status moe_data_restrict(moe_data *data, int64_t begin, int64_t end) {
    if (begin < 0 || begin >= end || end > data->n_tokens)
        return moe_error(MOE_ERR_INVALID_ARG, "%s: tokens [%lld, %lld) of %lld: need 0 <= begin < end <= %lld",
                         data->name, (long long)begin, (long long)end, (long long)data->n_tokens,
                         (long long)data->n_tokens);
    data->base += begin;
    data->n_tokens = end - begin;
    data->pos = (moe_data_position){0, 0};
    data->order_epoch = -1;
    return MOE_OK;
}

moe_data_position moe_data_get_position(const moe_data *data) { return data->pos; }

moe_status moe_data_set_position(moe_data *data, moe_data_position position) {
    if (position.epoch < 0 || position.epoch > MOE_DATA_EPOCH_MAX || position.token < 0 ||
        position.token > data->n_tokens)
        return moe_error(MOE_ERR_INVALID_ARG,
                         "%s: position token=%lld epoch=%lld, need token in [0, %lld] and epoch "
                         "in [0, %lld]",
                         data->name, (long long)position.token, (long long)position.epoch,
                         (long long)data->n_tokens, (long long)MOE_DATA_EPOCH_MAX);
    data->pos = position;
    return MOE_OK;
}

/* Tokens [first, first + n) of files[fi], counted within that file. */
static moe_status read_file(moe_data *d, int32_t *out, int64_t fi, int64_t first, int64_t n) {
    const data_file *f = &d->files[fi];
    if (d->open_index != fi) {
        if (d->open_file != NULL) fclose(d->open_file);
        d->open_index = -1;
        if ((d->open_file = fopen(f->path, "rb")) == NULL)
            return moe_error(MOE_ERR_IO, "%s: cannot open: %s", f->path, strerror(errno));
        d->open_index = fi;
    }
    if (fseeko(d->open_file, (off_t)(f->header_bytes + first * f->token_bytes), SEEK_SET) != 0)
        return moe_error(MOE_ERR_IO, "%s: cannot seek to token %lld: %s", f->path,
                         (long long)first, strerror(errno));
    unsigned char buf[IO_CHUNK_BYTES];
    const int64_t per_chunk = IO_CHUNK_BYTES / f->token_bytes;
    for (int64_t done = 0; done < n;) {
        int64_t m = n - done < per_chunk ? n - done : per_chunk;
        size_t bytes = (size_t)(m * f->token_bytes);
        if (fread(buf, 1, bytes, d->open_file) != bytes)
            return moe_error(MOE_ERR_IO, "%s: cannot read tokens %lld..%lld: %s", f->path,
                             (long long)(first + done), (long long)(first + done + m - 1),
                             ferror(d->open_file) ? strerror(errno) : "file shrank");
        for (int64_t i = 0; i < m; i++) {
            const unsigned char *b = buf + i * f->token_bytes;
            const int64_t t = f->token_bytes == 1   ? b[0]
                              : f->token_bytes == 2 ? (int64_t)(b[0] | b[1] << 8)
                                                    : (int64_t)moe_get_le32(b);
            if (t >= d->vocab_size)
                return moe_error(MOE_ERR_FORMAT, "%s: the token at index %lld is %lld, not below vocab_size %lld",
                                 f->path, (long long)(first + done + i), (long long)t,
                                 (long long)d->vocab_size);
            out[done + i] = (int32_t)t; /* below vocab_size, an int32 */
        }
        done += m;
    }
    return MOE_OK;
}

/* Stream tokens [start, start + n), which the caller keeps inside [0, n_tokens). */
static moe_status read_tokens(moe_data *d, int32_t *out, int64_t start, int64_t n) {
    start += d->base;
    if (d->memory != NULL) {
        memcpy(out, d->memory + start, (size_t)n * sizeof *out);
        return MOE_OK;
    }
    /* The last file that starts at or before start; empty files share their
     * successor's first, so this one holds start. */
    int64_t lo = 0, hi = d->n_files - 1;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo + 1) / 2;
        if (d->files[mid].first <= start)
            lo = mid;
        else
            hi = mid - 1;
    }
    for (int64_t fi = lo, done = 0; done < n; fi++) {
        const data_file *f = &d->files[fi];
        int64_t offset = start + done - f->first;
        int64_t m = f->count - offset < n - done ? f->count - offset : n - done;
        if (m <= 0) continue;
        MOE_TRY(read_file(d, out + done, fi, offset, m));
        done += m;
    }
    return MOE_OK;
}

/* The chunk order of an epoch: a Fisher-Yates shuffle driven by (seed,
 * epoch). j = bits % (i + 1) is biased by at most (i + 1) / 2^64, far below
 * anything a training run could notice. */
static moe_status ensure_order(moe_data *d, int64_t epoch, int64_t n_chunks) {
    if (d->order_epoch == epoch && d->order_len == n_chunks) return MOE_OK;
    int64_t *order = realloc(d->order, (size_t)n_chunks * sizeof *order);
    if (order == NULL)
        return moe_error(MOE_ERR_OUT_OF_MEMORY, "%s: cannot allocate the order of %lld chunks",
                         d->name, (long long)n_chunks);
    d->order = order;
    for (int64_t i = 0; i < n_chunks; i++) order[i] = i;
    for (int64_t i = n_chunks - 1; i > 0; i--) {
        int64_t j = (int64_t)(moe_rng_bits(d->seed, (uint64_t)epoch, (uint64_t)i) %
                              (uint64_t)(i + 1));
        int64_t t = order[i];
        order[i] = order[j];
        order[j] = t;
    }
    d->order_len = n_chunks;
    d->order_epoch = epoch;
    return MOE_OK;
}

moe_status moe_data_next_batch(moe_data *data, int32_t *inputs, int32_t *targets,
                               int64_t global_rows, int64_t first_row, int64_t n_rows, int64_t T) {
    if (data == NULL || inputs == NULL || targets == NULL)
        return moe_error(MOE_ERR_INVALID_ARG, "moe_data_next_batch: NULL argument");
    if (T < 1 || global_rows < 1 || n_rows < 1 || first_row < 0 ||
        first_row > global_rows - n_rows || global_rows > (INT64_MAX - 1) / T)
        return moe_error(MOE_ERR_INVALID_ARG,
                         "%s: batch rows %lld..%lld of %lld rows of T=%lld, need T >= 1 and 0 <= "
                         "first_row < first_row + n_rows <= global_rows",
                         data->name, (long long)first_row, (long long)(first_row + n_rows - 1),
                         (long long)global_rows, (long long)T);
    const int64_t span = global_rows * T;
    if (data->n_tokens < span + 1)
        return moe_error(MOE_ERR_CONFIG,
                         "%s: %lld tokens, fewer than the %lld that one batch of %lld rows of "
                         "%lld tokens needs (rows*T + 1)",
                         data->name, (long long)data->n_tokens, (long long)(span + 1),
                         (long long)global_rows, (long long)T);
    moe_data_position pos = data->pos;
    if (pos.token > data->n_tokens - span - 1) {
        if (pos.epoch >= MOE_DATA_EPOCH_MAX)
            return moe_error(MOE_ERR_STATE, "%s: epoch %lld is the last one counted; cannot start another",
                             data->name, (long long)pos.epoch);
        pos = (moe_data_position){0, pos.epoch + 1};
    }

    int64_t start = pos.token;
    if (data->shuffle) {
        if (pos.token % span != 0)
            return moe_error(MOE_ERR_STATE,
                             "%s: shuffled position %lld is not a multiple of the batch's %lld "
                             "tokens: keep one batch shape for a whole epoch",
                             data->name, (long long)pos.token, (long long)span);
        MOE_TRY(ensure_order(data, pos.epoch, (data->n_tokens - 1) / span));
        start = data->order[pos.token / span] * span;
    }
    start += first_row * T;
    const int64_t n = n_rows * T;
    MOE_TRY(read_tokens(data, inputs, start, n));
    memcpy(targets, inputs + 1, (size_t)(n - 1) * sizeof *targets);
    MOE_TRY(read_tokens(data, targets + n - 1, start + n, 1));
    data->pos = (moe_data_position){pos.token + span, pos.epoch};
    return MOE_OK;
}

typedef struct shard_ctx {
    const int32_t *tokens; /* [n], each checked to fit its format's tokens */
    int64_t n;
    size_t format; /* of shard_formats */
} shard_ctx;

static moe_status write_shard(void *ctx, FILE *file) {
    const shard_ctx *s = ctx;
    const int bytes = shard_formats[s->format].token_bytes;
    unsigned char buf[IO_CHUNK_BYTES];
    memset(buf, 0, MOE_SHARD_HEADER_BYTES);
    put_le32(buf, (uint32_t)shard_formats[s->format].magic);
    put_le32(buf + 4, (uint32_t)shard_formats[s->format].version);
    put_le32(buf + 8, (uint32_t)s->n);
    MOE_TRY(moe_file_write_bytes(file, buf, MOE_SHARD_HEADER_BYTES));
    for (int64_t done = 0; done < s->n;) {
        int64_t m = s->n - done < IO_CHUNK_BYTES / bytes ? s->n - done : IO_CHUNK_BYTES / bytes;
        for (int64_t i = 0; i < m; i++)
            for (int k = 0; k < bytes; k++) buf[i * bytes + k] = (unsigned char)((uint32_t)s->tokens[done + i] >> (8 * k));
        MOE_TRY(moe_file_write_bytes(file, buf, (size_t)(bytes * m)));
        done += m;
    }
    return MOE_OK;
}

moe_status moe_data_write_shard(const char *path, const int32_t *tokens, int64_t n, int token_bytes) {
    if (path == NULL || (tokens == NULL && n > 0))
        return moe_error(MOE_ERR_INVALID_ARG, "moe_data_write_shard: NULL argument");
    size_t format = 0;
    while (format < N_SHARD_FORMATS && shard_formats[format].token_bytes != token_bytes) format++;
    if (format == N_SHARD_FORMATS)
        return moe_error(MOE_ERR_INVALID_ARG, "%s: %d-byte tokens, a shard holds 2 (uint16) or 4 (uint32)", path,
                         token_bytes);
    if (n < 0 || n > INT32_MAX)
        return moe_error(MOE_ERR_INVALID_ARG,
                         "%s: %lld tokens, a shard holds 0 to 2^31 - 1 (an int32 count)", path,
                         (long long)n);
    const int64_t max = token_bytes == 2 ? UINT16_MAX : INT32_MAX;
    for (int64_t i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] > max)
            return moe_error(MOE_ERR_INVALID_ARG, "%s: token %lld is %d, outside %s [0, %lld]", path,
                             (long long)i, tokens[i], shard_formats[format].tokens, (long long)max);
    shard_ctx ctx = {tokens, n, format};
    return moe_file_write_atomic(path, write_shard, &ctx);
}
