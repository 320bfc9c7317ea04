#define _POSIX_C_SOURCE 200809L

#include "engine/safetensors.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/crc32c.h"
#include "common/status.h"
#include "engine/fileio.h"
#include "engine/json.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "safetensors data is little-endian; this file assumes a little-endian host"
#endif

#define INDEX_FILE "model.safetensors.index.json"
#define SINGLE_FILE "model.safetensors"
/* The writer's own __metadata__ keys (safetensors.h, "Checksums"). */
#define FORMAT_KEY "format"
#define CRC_KEY "moe_crc32c"
#define META_CRC_KEY "moe_meta_crc32c"
#define CRC_DIGITS 8 /* lowercase hex digits of one checksum in CRC_KEY's list */

const char *moe_st_dtype_name(moe_st_dtype dtype) {
    switch (dtype) {
    case MOE_ST_F32: return "F32";
    case MOE_ST_BF16: return "BF16";
    case MOE_ST_F16: return "F16";
    }
    return "?";
}

int64_t moe_st_dtype_bytes(moe_st_dtype dtype) { return dtype == MOE_ST_F32 ? 4 : 2; }

/* Every dtype the format defines (safetensors' enum Dtype), so that a file
 * with one we do not read is told apart from a corrupt one. */
static const char *const other_dtypes[] = {
    "BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ",
    "F8_E5M2FNUZ", "I16", "U16", "I32", "U32", "C64", "F64", "I64", "U64",
};

float moe_bf16_to_f32(uint16_t bits) {
    uint32_t u = (uint32_t)bits << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

float moe_f16_to_f32(uint16_t bits) {
    uint32_t sign = (uint32_t)(bits & 0x8000) << 16;
    uint32_t exp = (bits >> 10) & 0x1F;
    uint32_t mant = bits & 0x3FF;
    uint32_t u;
    if (exp == 0x1F) {
        u = sign | 0x7F800000u | (mant << 13); /* inf, or NaN keeping its payload */
    } else if (exp != 0) {
        u = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    } else {
        /* zero or subnormal: mant * 2^-24, exact in fp32 */
        float f = ldexpf((float)mant, -24);
        return sign ? -f : f;
    }
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* ----------------------------------------------------------------- reader */

struct moe_st_file {
    char *path;
    const unsigned char *map; /* [map_bytes] */
    size_t map_bytes;
    moe_json_doc *header;
    moe_st_tensor *tensors; /* [count], header order */
    int64_t count;
    int64_t *dims;     /* all shapes, back to back */
    const moe_st_tensor **by_name; /* [count] sorted by name */
    const char **meta; /* [2 * meta_count]: key, value, ... */
    int64_t meta_count;
};

void moe_st_close(moe_st_file *f) {
    if (f == NULL) return;
    if (f->map != NULL) munmap((void *)f->map, f->map_bytes);
    moe_json_free(f->header);
    free(f->tensors);
    free(f->dims);
    free(f->by_name);
    free(f->meta);
    free(f->path);
    free(f);
}

const char *moe_st_path(const moe_st_file *f) { return f->path; }
int64_t moe_st_tensor_count(const moe_st_file *f) { return f->count; }

const moe_st_tensor *moe_st_tensor_at(const moe_st_file *f, int64_t index) {
    return index >= 0 && index < f->count ? &f->tensors[index] : NULL;
}

int64_t moe_st_metadata_count(const moe_st_file *f) { return f->meta_count; }

void moe_st_metadata_at(const moe_st_file *f, int64_t index, const char **key, const char **value) {
    *key = f->meta[2 * index];
    *value = f->meta[2 * index + 1];
}

const char *moe_st_metadata(const moe_st_file *f, const char *key) {
    for (int64_t i = 0; i < f->meta_count; i++)
        if (strcmp(f->meta[2 * i], key) == 0) return f->meta[2 * i + 1];
    return NULL;
}

/* Comparators over arrays of tensor pointers. */
static int cmp_name(const void *a, const void *b) {
    return strcmp((*(const moe_st_tensor *const *)a)->name, (*(const moe_st_tensor *const *)b)->name);
}

/* By data_offsets as the reference reader sorts them; ties (empty tensors
 * at one offset) in header order, so the first error found is stable. */
static int cmp_offset(const void *a, const void *b) {
    const moe_st_tensor *x = *(const moe_st_tensor *const *)a, *y = *(const moe_st_tensor *const *)b;
    if (x->offset != y->offset) return x->offset < y->offset ? -1 : 1;
    if (x->nbytes != y->nbytes) return x->nbytes < y->nbytes ? -1 : 1;
    return x < y ? -1 : x > y;
}

const moe_st_tensor *moe_st_find(const moe_st_file *f, const char *name) {
    int64_t lo = 0, hi = f->count;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        int c = strcmp(f->by_name[mid]->name, name);
        if (c == 0) return f->by_name[mid];
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return NULL;
}

/* A JSON non-negative integer literal (no sign, fraction or exponent). */
static bool json_count(const moe_json *v, int64_t *out) {
    if (v->type != MOE_JSON_NUMBER || strpbrk(v->number.text, "-.eE") != NULL) return false;
    return moe_json_int64(v, out) == MOE_OK;
}

static bool checked_mul(int64_t a, int64_t b, int64_t *out) {
    if (a != 0 && b > INT64_MAX / a) return false;
    *out = a * b;
    return true;
}

/* One header entry -> t, its shape written to dims. Offsets are relative to
 * the byte buffer here; the caller adds the buffer's file offset. */
static moe_status parse_tensor(moe_st_tensor *t, int64_t *dims, const char *path, const moe_json_member *m) {
    const char *name = m->key;
    if (m->key_len == 0) return moe_error(MOE_ERR_FORMAT, "%s: a tensor has an empty name", path);
    if (strlen(name) != m->key_len)
        return moe_error(MOE_ERR_FORMAT, "%s: tensor name \"%s...\" contains a NUL character", path, name);
    const moe_json *e = &m->value;
    if (e->type != MOE_JSON_OBJECT)
        return moe_error(MOE_ERR_FORMAT, "%s: tensor '%s': entry is a JSON %s, not an object", path, name,
                         moe_json_type_name(e->type));
    const moe_json *dtype = NULL, *shape = NULL, *offsets = NULL;
    for (size_t i = 0; i < e->object.count; i++) {
        const moe_json_member *f = &e->object.members[i];
        if (strlen(f->key) != f->key_len)
            return moe_error(MOE_ERR_FORMAT, "%s: tensor '%s': field \"%.100s...\" contains a NUL character", path,
                             name, f->key);
        if (strcmp(f->key, "dtype") == 0)
            dtype = &f->value;
        else if (strcmp(f->key, "shape") == 0)
            shape = &f->value;
        else if (strcmp(f->key, "data_offsets") == 0)
            offsets = &f->value;
        else
            return moe_error(MOE_ERR_FORMAT, "%s: tensor '%s': unexpected field \"%.100s\"", path, name, f->key);
    }
    if (dtype == NULL || shape == NULL || offsets == NULL)
        return moe_error(MOE_ERR_FORMAT, "%s: tensor '%s': missing \"%s\"", path, name,
                         dtype == NULL ? "dtype" : shape == NULL ? "shape" : "data_offsets");

    if (dtype->type != MOE_JSON_STRING)
        return moe_error(MOE_ERR_FORMAT, "%s: tensor '%s': dtype is a JSON %s, not a string", path, name,
                         moe_json_type_name(dtype->type));
    const char *d = moe_json_text(dtype);
    if (d == NULL)
        return moe_error(MOE_ERR_FORMAT, "%s: tensor '%s': dtype \"%.40s...\" contains a NUL character", path, name,
                         dtype->string.data);
    if (strcmp(d, "F32") == 0) {
        t->dtype = MOE_ST_F32;
    } else if (strcmp(d, "BF16") == 0) {
        t->dtype = MOE_ST_BF16;
    } else if (strcmp(d, "F16") == 0) {
        t->dtype = MOE_ST_F16;
    } else {
        for (size_t i = 0; i < sizeof other_dtypes / sizeof *other_dtypes; i++)
            if (strcmp(d, other_dtypes[i]) == 0)
                return moe_error(MOE_ERR_UNSUPPORTED,
                                 "%s: tensor '%s' has dtype %s; only F32, BF16 and F16 are supported", path,
                                 name, d);
        return moe_error(MOE_ERR_FORMAT, "%s: tensor '%s' has unknown dtype \"%.40s\"", path, name, d);
    }

    if (shape->type != MOE_JSON_ARRAY)
        return moe_error(MOE_ERR_FORMAT, "%s: tensor '%s': shape is a JSON %s, not an array", path, name,
                         moe_json_type_name(shape->type));
    int64_t numel = 1;
    for (size_t i = 0; i < shape->array.count; i++) {
        const moe_json *v = &shape->array.items[i];
        if (!json_count(v, &dims[i]))
            return moe_error(MOE_ERR_FORMAT, "%s: tensor '%s': shape[%zu] = %s is not a non-negative integer",
                             path, name, i, v->type == MOE_JSON_NUMBER ? v->number.text : moe_json_type_name(v->type));
        if (!checked_mul(numel, dims[i], &numel))
            return moe_error(MOE_ERR_FORMAT, "%s: tensor '%s': the element count of its shape overflows", path,
                             name);
    }
    int64_t nbytes;
    if (!checked_mul(numel, moe_st_dtype_bytes(t->dtype), &nbytes))
        return moe_error(MOE_ERR_FORMAT, "%s: tensor '%s': its byte size overflows", path, name);

    int64_t begin, end;
    if (offsets->type != MOE_JSON_ARRAY || offsets->array.count != 2 ||
        !json_count(&offsets->array.items[0], &begin) || !json_count(&offsets->array.items[1], &end))
        return moe_error(MOE_ERR_FORMAT, "%s: tensor '%s': data_offsets is not [begin, end] of non-negative integers",
                         path, name);
    if (end < begin)
        return moe_error(MOE_ERR_FORMAT, "%s: tensor '%s': data_offsets [%lld, %lld] end before they begin", path,
                         name, (long long)begin, (long long)end);
    if (end - begin != nbytes)
        return moe_error(MOE_ERR_FORMAT,
                         "%s: tensor '%s': data_offsets [%lld, %lld] hold %lld bytes, but %s with %lld elements "
                         "needs %lld",
                         path, name, (long long)begin, (long long)end, (long long)(end - begin), d,
                         (long long)numel, (long long)nbytes);
    t->name = name;
    t->ndim = (int64_t)shape->array.count;
    t->shape = dims;
    t->numel = numel;
    t->nbytes = nbytes;
    t->offset = begin;
    return MOE_OK;
}

static moe_status parse_metadata(moe_st_file *f, const moe_json *m) {
    if (m->type != MOE_JSON_OBJECT)
        return moe_error(MOE_ERR_FORMAT, "%s: __metadata__ is a JSON %s, not an object of strings", f->path,
                         moe_json_type_name(m->type));
    f->meta_count = (int64_t)m->object.count;
    f->meta = malloc((2 * m->object.count + 1) * sizeof *f->meta);
    if (f->meta == NULL) return moe_error(MOE_ERR_OUT_OF_MEMORY, "%s: out of memory", f->path);
    for (size_t i = 0; i < m->object.count; i++) {
        const moe_json_member *kv = &m->object.members[i];
        if (kv->value.type != MOE_JSON_STRING)
            return moe_error(MOE_ERR_FORMAT, "%s: __metadata__[\"%.100s\"] is a JSON %s, not a string", f->path,
                             kv->key, moe_json_type_name(kv->value.type));
        const char *value = moe_json_text(&kv->value);
        if (strlen(kv->key) != kv->key_len || value == NULL)
            return moe_error(MOE_ERR_FORMAT, "%s: __metadata__ entry \"%.100s\" contains a NUL character",
                             f->path, kv->key);
        f->meta[2 * i] = kv->key;
        f->meta[2 * i + 1] = value;
    }
    return MOE_OK;
}

/* Tensors sorted by offset must tile [0, buffer_bytes) exactly. */
static moe_status check_tiling(moe_st_file *f, uint64_t header_bytes, int64_t buffer_bytes) {
    const moe_st_tensor **order = malloc((size_t)(f->count > 0 ? f->count : 1) * sizeof *order);
    if (order == NULL) return moe_error(MOE_ERR_OUT_OF_MEMORY, "%s: out of memory", f->path);
    for (int64_t i = 0; i < f->count; i++) order[i] = &f->tensors[i];
    qsort(order, (size_t)f->count, sizeof *order, cmp_offset);
    moe_status st = MOE_OK;
    int64_t pos = 0;
    const moe_st_tensor *prev = NULL;
    for (int64_t k = 0; k < f->count && st == MOE_OK; k++) {
        const moe_st_tensor *t = order[k];
        if (t->offset > pos)
            st = moe_error(MOE_ERR_FORMAT, "%s: tensor '%s' begins at byte %lld of the data, leaving a gap of %lld "
                                           "bytes after %s%s%s",
                           f->path, t->name, (long long)t->offset, (long long)(t->offset - pos),
                           prev ? "tensor '" : "the start", prev ? prev->name : "", prev ? "'" : "");
        else if (t->offset < pos)
            st = moe_error(MOE_ERR_FORMAT, "%s: tensor '%s' at data bytes [%lld, %lld) overlaps tensor '%s' at [%lld, "
                                           "%lld)",
                           f->path, t->name, (long long)t->offset, (long long)(t->offset + t->nbytes), prev->name,
                           (long long)prev->offset, (long long)(prev->offset + prev->nbytes));
        pos = t->offset + t->nbytes;
        prev = t;
    }
    free(order);
    if (st != MOE_OK) return st;
    if (pos < buffer_bytes)
        return moe_error(MOE_ERR_FORMAT, "%s: %lld bytes after the end of the last tensor%s%s%s", f->path,
                         (long long)(buffer_bytes - pos), prev ? " '" : "", prev ? prev->name : "", prev ? "'" : "");
    if (pos > buffer_bytes)
        return moe_error(MOE_ERR_FORMAT, "%s: truncated: tensor '%s' ends at data byte %lld but the file holds %lld "
                                         "data bytes after its %llu-byte header",
                         f->path, prev->name, (long long)pos, (long long)buffer_bytes,
                         (unsigned long long)header_bytes);
    return MOE_OK;
}

static int cmp_meta_key(const void *a, const void *b) {
    return strcmp(((const moe_st_meta *)a)->key, ((const moe_st_meta *)b)->key);
}

/* What META_CRC_KEY records: the CRC of meta [n] (sorted here by key) as
 * key, NUL, value, NUL each, then of names [count] (sorted) with a NUL
 * each. Keys and names are unique and hold no NUL, so the text is the
 * header's and nothing else's. */
static uint32_t header_crc(moe_st_meta *meta, int64_t n, const char *const *names, int64_t count) {
    qsort(meta, (size_t)n, sizeof *meta, cmp_meta_key);
    uint32_t crc = 0;
    for (int64_t i = 0; i < n; i++) {
        crc = moe_crc32c(crc, meta[i].key, strlen(meta[i].key) + 1);
        crc = moe_crc32c(crc, meta[i].value, strlen(meta[i].value) + 1);
    }
    for (int64_t i = 0; i < count; i++) crc = moe_crc32c(crc, names[i], strlen(names[i]) + 1);
    return crc;
}

/* text's first CRC_DIGITS characters as lowercase hex: the form the writer
 * gives, so any other (capitals, a sign, a space) is damage. */
static bool parse_crc(uint32_t *out, const char *text) {
    uint32_t v = 0;
    for (int i = 0; i < CRC_DIGITS; i++) {
        const char c = text[i];
        if (c >= '0' && c <= '9')
            v = v << 4 | (uint32_t)(c - '0');
        else if (c >= 'a' && c <= 'f')
            v = v << 4 | (uint32_t)(c - 'a' + 10);
        else
            return false;
    }
    *out = v;
    return true;
}

/* CRC_KEY's list, one checksum per tensor in the order of f->by_name, into
 * the tensors. */
static moe_status parse_crc_list(moe_st_file *f, const char *list) {
    int64_t listed = list[0] != '\0';
    for (const char *c = list; *c != '\0'; c++) listed += *c == ',';
    if (listed != f->count)
        return moe_error(MOE_ERR_FORMAT, "%s: __metadata__ \"" CRC_KEY "\" lists %lld checksum%s for %lld tensors: "
                                         "the header is damaged",
                         f->path, (long long)listed, listed == 1 ? "" : "s", (long long)f->count);
    /* Each entry is read only once the ones before it proved whole, so
     * `at` never passes the end of list. */
    for (int64_t i = 0; i < f->count; i++) {
        const char *at = list + i * (CRC_DIGITS + 1);
        uint32_t crc;
        if (!parse_crc(&crc, at) || at[CRC_DIGITS] != (i + 1 < f->count ? ',' : '\0'))
            return moe_error(MOE_ERR_FORMAT, "%s: __metadata__ \"" CRC_KEY "\" entry %lld, \"%.12s\", is not %d "
                                             "lowercase hex digits: the header is damaged",
                             f->path, (long long)i, at, CRC_DIGITS);
        moe_st_tensor *t = &f->tensors[f->by_name[i] - f->tensors];
        t->has_crc = true;
        t->crc32c = crc;
    }
    return MOE_OK;
}

/* The writer's checksums, when the file has them: their form, and the
 * header's against META_CRC_KEY. The tensors' data waits for moe_st_verify.
 * Needs f->by_name. */
static moe_status check_header_crc(moe_st_file *f) {
    const char *list = moe_st_metadata(f, CRC_KEY), *recorded = moe_st_metadata(f, META_CRC_KEY);
    if (list == NULL && recorded == NULL) return MOE_OK; /* another tool's file */
    /* The writer puts both: one alone is a key whose name was damaged,
     * which must not turn the checks off. */
    if (list == NULL || recorded == NULL)
        return moe_error(MOE_ERR_FORMAT, "%s: __metadata__ has \"%s\" but not \"%s\", which is written with it: "
                                         "the header is damaged",
                         f->path, list ? CRC_KEY : META_CRC_KEY, list ? META_CRC_KEY : CRC_KEY);
    uint32_t want;
    if (strlen(recorded) != CRC_DIGITS || !parse_crc(&want, recorded))
        return moe_error(MOE_ERR_FORMAT, "%s: __metadata__ \"" META_CRC_KEY "\" is \"%.32s\", not %d lowercase hex "
                                         "digits: the header is damaged",
                         f->path, recorded, CRC_DIGITS);
    MOE_TRY(parse_crc_list(f, list));
    moe_st_meta *meta = malloc((size_t)(f->meta_count > 0 ? f->meta_count : 1) * sizeof *meta);
    const char **names = malloc((size_t)(f->count > 0 ? f->count : 1) * sizeof *names);
    if (meta == NULL || names == NULL) {
        free(meta);
        free(names);
        return moe_error(MOE_ERR_OUT_OF_MEMORY, "%s: out of memory", f->path);
    }
    int64_t n = 0;
    for (int64_t i = 0; i < f->meta_count; i++)
        if (strcmp(f->meta[2 * i], META_CRC_KEY) != 0) meta[n++] = (moe_st_meta){f->meta[2 * i], f->meta[2 * i + 1]};
    for (int64_t i = 0; i < f->count; i++) names[i] = f->by_name[i]->name;
    const uint32_t got = header_crc(meta, n, names, f->count);
    free(meta);
    free(names);
    if (got != want)
        return moe_error(MOE_ERR_FORMAT, "%s: the header's checksum is 0x%08x, not the 0x%08x its \"" META_CRC_KEY
                                         "\" records: its metadata or a tensor name is damaged",
                         f->path, got, want);
    return MOE_OK;
}

static moe_status parse_header(moe_st_file *f, uint64_t header_bytes) {
    const char *text = (const char *)f->map + 8;
    if (header_bytes == 0 || text[0] != '{')
        return moe_error(MOE_ERR_FORMAT, "%s: the header does not start with '{'", f->path);
    MOE_TRY(moe_json_parse(&f->header, text, header_bytes, f->path));
    const moe_json *root = moe_json_root(f->header);
    if (root->type != MOE_JSON_OBJECT)
        return moe_error(MOE_ERR_FORMAT, "%s: the header is a JSON %s, not an object", f->path,
                         moe_json_type_name(root->type));

    size_t n = root->object.count, total_dims = 0;
    for (size_t i = 0; i < n; i++) {
        const moe_json *shape = moe_json_get(&root->object.members[i].value, "shape");
        if (shape != NULL && shape->type == MOE_JSON_ARRAY) total_dims += shape->array.count;
    }
    f->tensors = calloc(n > 0 ? n : 1, sizeof *f->tensors);
    f->dims = malloc((total_dims > 0 ? total_dims : 1) * sizeof *f->dims);
    f->by_name = malloc((n > 0 ? n : 1) * sizeof *f->by_name);
    if (f->tensors == NULL || f->dims == NULL || f->by_name == NULL)
        return moe_error(MOE_ERR_OUT_OF_MEMORY, "%s: out of memory for %zu tensors", f->path, n);

    int64_t *dims = f->dims;
    for (size_t i = 0; i < n; i++) {
        const moe_json_member *m = &root->object.members[i];
        if (strcmp(m->key, "__metadata__") == 0 && m->key_len == strlen("__metadata__")) {
            MOE_TRY(parse_metadata(f, &m->value));
            continue;
        }
        moe_st_tensor *t = &f->tensors[f->count];
        MOE_TRY(parse_tensor(t, dims, f->path, m));
        dims += t->ndim;
        f->count++;
    }
    if (f->meta == NULL) {
        f->meta = malloc(sizeof *f->meta);
        if (f->meta == NULL) return moe_error(MOE_ERR_OUT_OF_MEMORY, "%s: out of memory", f->path);
    }

    int64_t buffer_bytes = (int64_t)(f->map_bytes - 8 - header_bytes);
    MOE_TRY(check_tiling(f, header_bytes, buffer_bytes));
    int64_t data_start = 8 + (int64_t)header_bytes;
    for (int64_t i = 0; i < f->count; i++) {
        f->tensors[i].offset += data_start;
        f->tensors[i].data = f->map + f->tensors[i].offset;
        f->by_name[i] = &f->tensors[i];
    }
    qsort(f->by_name, (size_t)f->count, sizeof *f->by_name, cmp_name);
    return check_header_crc(f);
}

moe_status moe_st_open(moe_st_file **file, const char *path) {
    *file = NULL;
    moe_st_file *f = calloc(1, sizeof *f);
    if (f == NULL || (f->path = strdup(path)) == NULL) {
        free(f);
        return moe_error(MOE_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
    }
    int fd;
    int64_t size;
    moe_status st = moe_file_open_fd(&fd, &size, path);
    if (st != MOE_OK) {
        moe_st_close(f);
        return st;
    }
    if (size < 8)
        st = moe_error(MOE_ERR_FORMAT, "%s: file is %lld bytes, too short for the 8-byte header length", path,
                       (long long)size);
    if (st == MOE_OK) {
        void *map = mmap(NULL, (size_t)size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (map == MAP_FAILED) {
            st = moe_error(MOE_ERR_IO, "%s: mmap of %lld bytes failed: %s", path, (long long)size, strerror(errno));
        } else {
            f->map = map;
            f->map_bytes = (size_t)size;
        }
    }
    close(fd);
    if (st == MOE_OK) {
        uint64_t header_bytes = 0;
        for (int i = 7; i >= 0; i--) header_bytes = header_bytes << 8 | f->map[i];
        if (header_bytes > MOE_ST_MAX_HEADER_BYTES)
            st = moe_error(MOE_ERR_FORMAT, "%s: header length %llu exceeds the limit of %llu bytes", path,
                           (unsigned long long)header_bytes, (unsigned long long)MOE_ST_MAX_HEADER_BYTES);
        else if (header_bytes > f->map_bytes - 8)
            st = moe_error(MOE_ERR_FORMAT, "%s: header length %llu runs past the end of the %zu-byte file", path,
                           (unsigned long long)header_bytes, f->map_bytes);
        else
            st = parse_header(f, header_bytes);
    }
    if (st != MOE_OK) {
        moe_st_close(f);
        return st;
    }
    *file = f;
    return MOE_OK;
}

void moe_st_read_f32(float *out, const moe_st_tensor *t) {
    const unsigned char *p = t->data;
    switch (t->dtype) {
    case MOE_ST_F32:
        memcpy(out, p, (size_t)t->nbytes);
        break;
    case MOE_ST_BF16:
        for (int64_t i = 0; i < t->numel; i++) out[i] = moe_bf16_to_f32((uint16_t)(p[2 * i] | p[2 * i + 1] << 8));
        break;
    case MOE_ST_F16:
        for (int64_t i = 0; i < t->numel; i++) out[i] = moe_f16_to_f32((uint16_t)(p[2 * i] | p[2 * i + 1] << 8));
        break;
    }
}

int64_t moe_st_find_bad(float *value, const moe_st_tensor *t, int64_t first, int64_t count, bool nonnegative) {
    const int64_t width = moe_st_dtype_bytes(t->dtype);
    /* An exponent field of all ones is an infinity or a NaN; the sign bit
     * with any other bit is below zero (the sign alone is -0). */
    const uint32_t sign = width == 4 ? 0x80000000u : 0x8000u;
    const uint32_t exponent = t->dtype == MOE_ST_F32 ? 0x7f800000u : t->dtype == MOE_ST_BF16 ? 0x7f80u : 0x7c00u;
    const unsigned char *p = (const unsigned char *)t->data + first * width;
    for (int64_t i = 0; i < count; i++, p += width) {
        uint32_t bits = (uint32_t)p[0] | (uint32_t)p[1] << 8;
        if (width == 4) bits |= (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
        if ((bits & exponent) == exponent || (nonnegative && (bits & sign) != 0 && bits != sign)) {
            moe_st_tensor one = *t;
            one.data = p;
            one.numel = 1;
            one.nbytes = width;
            moe_st_read_f32(value, &one);
            return first + i;
        }
    }
    return -1;
}

/* The error for t, whose bytes' checksum is crc. */
static moe_status crc_mismatch(const moe_st_tensor *t, const char *path, uint32_t crc) {
    return moe_error(MOE_ERR_FORMAT, "%s: tensor '%s': its bytes' checksum is 0x%08x, not the 0x%08x its header "
                                     "records: the file is damaged",
                     path, t->name, crc, t->crc32c);
}

moe_status moe_st_verify(const moe_st_tensor *t, const char *path) {
    if (!t->has_crc) return MOE_OK;
    const uint32_t crc = moe_crc32c(0, t->data, (size_t)t->nbytes);
    return crc == t->crc32c ? MOE_OK : crc_mismatch(t, path, crc);
}

static int cmp_ptr(const void *a, const void *b) {
    const uintptr_t x = (uintptr_t)*(const void *const *)a;
    const uintptr_t y = (uintptr_t)*(const void *const *)b;
    return (x > y) - (x < y);
}

moe_status moe_st_verify_all(const moe_st_tensor *const *t, const char *const *path, int64_t n) {
    /* Distinct tensors with a checksum, each once, in parallel: the
     * messages are made after, on this thread, whose error they set. */
    const moe_st_tensor **each = malloc((size_t)(n > 0 ? n : 1) * sizeof *each);
    uint32_t *crc = malloc((size_t)(n > 0 ? n : 1) * sizeof *crc);
    if (each == NULL || crc == NULL) {
        free(each);
        free(crc);
        return moe_error(MOE_ERR_OUT_OF_MEMORY, "checksums of %lld tensors: out of memory", (long long)n);
    }
    int64_t m = 0;
    for (int64_t i = 0; i < n; i++)
        if (t[i] != NULL && t[i]->has_crc) each[m++] = t[i];
    qsort(each, (size_t)m, sizeof *each, cmp_ptr);
    int64_t k = 0;
    for (int64_t i = 0; i < m; i++)
        if (k == 0 || each[i] != each[k - 1]) each[k++] = each[i];
#pragma omp parallel for schedule(dynamic)
    for (int64_t i = 0; i < k; i++) crc[i] = moe_crc32c(0, each[i]->data, (size_t)each[i]->nbytes);
    moe_status st = MOE_OK;
    for (int64_t i = 0; i < n && st == MOE_OK; i++) {
        if (t[i] == NULL || !t[i]->has_crc) continue;
        const moe_st_tensor **found = bsearch(&t[i], each, (size_t)k, sizeof *each, cmp_ptr);
        const uint32_t got = crc[found - each];
        if (got != t[i]->crc32c) st = crc_mismatch(t[i], path[i], got);
    }
    free(each);
    free(crc);
    return st;
}

/* "[a, b, c]" into buf. */
static const char *shape_text(char *buf, size_t size, int64_t ndim, const int64_t *shape) {
    size_t n = (size_t)snprintf(buf, size, "[");
    for (int64_t i = 0; i < ndim && n < size; i++)
        n += (size_t)snprintf(buf + n, size - n, "%s%lld", i > 0 ? ", " : "", (long long)shape[i]);
    if (n < size) snprintf(buf + n, size - n, "]");
    return buf;
}

static moe_status load_checked(float *out, const moe_st_tensor *t, const char *where, const char *name,
                               int64_t ndim, const int64_t *shape) {
    if (t == NULL) return moe_error(MOE_ERR_FORMAT, "%s: no tensor named '%s'", where, name);
    bool same = t->ndim == ndim;
    for (int64_t i = 0; same && i < ndim; i++) same = t->shape[i] == shape[i];
    if (!same) {
        char got[256], want[256];
        return moe_error(MOE_ERR_FORMAT, "%s: tensor '%s' has shape %s, expected %s", where, name,
                         shape_text(got, sizeof got, t->ndim, t->shape), shape_text(want, sizeof want, ndim, shape));
    }
    MOE_TRY(moe_st_verify(t, where));
    moe_st_read_f32(out, t);
    return MOE_OK;
}

moe_status moe_st_load_f32(float *out, const moe_st_file *f, const char *name, int64_t ndim,
                           const int64_t *shape) {
    return load_checked(out, moe_st_find(f, name), f->path, name, ndim, shape);
}

/* ----------------------------------------------------------------- writer */

typedef struct write_job {
    const char *header; /* [header_len] JSON text */
    size_t header_len;
    size_t pad; /* spaces after the JSON so that 8 + header bytes is a multiple of 8 */
    const moe_st_entry *tensors;
    const int64_t *nbytes; /* [count] */
    int64_t count;
} write_job;

static moe_status write_file(void *ctx, FILE *file) {
    const write_job *job = ctx;
    uint64_t header_bytes = (uint64_t)(job->header_len + job->pad);
    unsigned char len[8];
    for (int i = 0; i < 8; i++) len[i] = (unsigned char)(header_bytes >> (8 * i));
    MOE_TRY(moe_file_write_bytes(file, len, sizeof len));
    MOE_TRY(moe_file_write_bytes(file, job->header, job->header_len));
    MOE_TRY(moe_file_write_bytes(file, "        ", job->pad));
    for (int64_t i = 0; i < job->count; i++)
        MOE_TRY(moe_file_write_bytes(file, job->tensors[i].data, (size_t)job->nbytes[i]));
    return MOE_OK;
}

static int cmp_str_ptr(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* The first string that appears twice in names [n] (sorted in place), or
 * NULL. */
static const char *find_repeat(const char **names, int64_t n) {
    qsort(names, (size_t)n, sizeof *names, cmp_str_ptr);
    for (int64_t i = 1; i < n; i++)
        if (strcmp(names[i - 1], names[i]) == 0) return names[i];
    return NULL;
}

static moe_status check_entries(int64_t *nbytes, const char *path, const moe_st_entry *tensors, int64_t count,
                                const moe_st_meta *meta, int64_t meta_count) {
    for (int64_t i = 0; i < count; i++) {
        const moe_st_entry *e = &tensors[i];
        if (e->name == NULL || e->name[0] == '\0')
            return moe_error(MOE_ERR_INVALID_ARG, "%s: tensor %lld has no name", path, (long long)i);
        if (strcmp(e->name, "__metadata__") == 0)
            return moe_error(MOE_ERR_INVALID_ARG, "%s: \"__metadata__\" cannot name a tensor", path);
        if (e->ndim < 0 || (e->ndim > 0 && e->shape == NULL))
            return moe_error(MOE_ERR_INVALID_ARG, "%s: tensor '%s': bad shape (ndim %lld)", path, e->name,
                             (long long)e->ndim);
        int64_t numel = 1;
        for (int64_t d = 0; d < e->ndim; d++) {
            if (e->shape[d] < 0)
                return moe_error(MOE_ERR_INVALID_ARG, "%s: tensor '%s': shape[%lld] = %lld is negative", path,
                                 e->name, (long long)d, (long long)e->shape[d]);
            if (!checked_mul(numel, e->shape[d], &numel))
                return moe_error(MOE_ERR_INVALID_ARG, "%s: tensor '%s': element count overflows", path, e->name);
        }
        if (!checked_mul(numel, 4, &nbytes[i]))
            return moe_error(MOE_ERR_INVALID_ARG, "%s: tensor '%s': byte size overflows", path, e->name);
        if (e->data == NULL && numel > 0)
            return moe_error(MOE_ERR_INVALID_ARG, "%s: tensor '%s': NULL data", path, e->name);
    }
    for (int64_t i = 0; i < meta_count; i++) {
        if (meta[i].key == NULL || meta[i].value == NULL)
            return moe_error(MOE_ERR_INVALID_ARG, "%s: metadata entry %lld has a NULL key or value", path,
                             (long long)i);
        if (moe_st_reserved_key(meta[i].key))
            return moe_error(MOE_ERR_INVALID_ARG, "%s: metadata key \"%s\" is reserved (the writer writes it)", path,
                             meta[i].key);
    }
    int64_t most = count > meta_count ? count : meta_count;
    const char **names = malloc((size_t)(most > 0 ? most : 1) * sizeof *names);
    if (names == NULL) return moe_error(MOE_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
    for (int64_t i = 0; i < count; i++) names[i] = tensors[i].name;
    const char *repeat = find_repeat(names, count);
    moe_status st = MOE_OK;
    if (repeat != NULL) {
        st = moe_error(MOE_ERR_INVALID_ARG, "%s: tensor name '%s' given twice", path, repeat);
    } else {
        for (int64_t i = 0; i < meta_count; i++) names[i] = meta[i].key;
        repeat = find_repeat(names, meta_count);
        if (repeat != NULL) st = moe_error(MOE_ERR_INVALID_ARG, "%s: metadata key '%s' given twice", path, repeat);
    }
    free(names);
    return st;
}

bool moe_st_reserved_key(const char *key) {
    return strcmp(key, FORMAT_KEY) == 0 || strcmp(key, CRC_KEY) == 0 || strcmp(key, META_CRC_KEY) == 0;
}

static int cmp_entry_name(const void *a, const void *b) {
    return strcmp((*(const moe_st_entry *const *)a)->name, (*(const moe_st_entry *const *)b)->name);
}

/* The writer's checksum keys (safetensors.h) for tensors [count] of nbytes
 * [count] under meta [meta_count]: crc_list [9 * count + 1] receives
 * CRC_KEY's value, meta_crc [9] META_CRC_KEY's (CRC_DIGITS digits each, and
 * a comma or the NUL). */
static moe_status make_checksums(char *crc_list, char *meta_crc, const char *path, const moe_st_entry *tensors,
                                 const int64_t *nbytes, int64_t count, const moe_st_meta *meta, int64_t meta_count) {
    uint32_t *crc = malloc((size_t)(count > 0 ? count : 1) * sizeof *crc);
    const moe_st_entry **sorted = malloc((size_t)(count > 0 ? count : 1) * sizeof *sorted);
    const char **names = malloc((size_t)(count > 0 ? count : 1) * sizeof *names);
    moe_st_meta *all = malloc((size_t)(meta_count + 2) * sizeof *all);
    moe_status st = MOE_OK;
    if (crc == NULL || sorted == NULL || names == NULL || all == NULL) {
        st = moe_error(MOE_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
    } else {
        /* The bytes written are the floats' own (a little-endian host). */
#pragma omp parallel for schedule(dynamic)
        for (int64_t i = 0; i < count; i++) crc[i] = moe_crc32c(0, tensors[i].data, (size_t)nbytes[i]);
        for (int64_t i = 0; i < count; i++) sorted[i] = &tensors[i];
        qsort(sorted, (size_t)count, sizeof *sorted, cmp_entry_name);
        /* 8 digits a checksum, each after the first behind a comma. */
        crc_list[0] = '\0';
        for (int64_t i = 0; i < count; i++) {
            names[i] = sorted[i]->name;
            snprintf(crc_list + (i > 0 ? 9 * i - 1 : 0), 10, "%s%08x", i > 0 ? "," : "", crc[sorted[i] - tensors]);
        }
        all[0] = (moe_st_meta){FORMAT_KEY, "pt"};
        if (meta_count > 0) memcpy(all + 1, meta, (size_t)meta_count * sizeof *meta);
        all[meta_count + 1] = (moe_st_meta){CRC_KEY, crc_list};
        snprintf(meta_crc, 9, "%08x", header_crc(all, meta_count + 2, names, count));
    }
    free(crc);
    free(sorted);
    free(names);
    free(all);
    return st;
}

static moe_status build_header(moe_json_writer *w, const char *path, const moe_st_entry *tensors,
                               const int64_t *nbytes, int64_t count, const moe_st_meta *meta, int64_t meta_count,
                               const char *crc_list, const char *meta_crc) {
    moe_json_begin_object(w);
    moe_json_key(w, "__metadata__");
    moe_json_begin_object(w);
    moe_json_key(w, FORMAT_KEY);
    moe_json_string(w, "pt");
    for (int64_t i = 0; i < meta_count; i++) {
        moe_json_key(w, meta[i].key);
        moe_json_string(w, meta[i].value);
    }
    moe_json_key(w, CRC_KEY);
    moe_json_string(w, crc_list);
    moe_json_key(w, META_CRC_KEY);
    moe_json_string(w, meta_crc);
    moe_json_end_object(w);
    int64_t offset = 0;
    for (int64_t i = 0; i < count; i++) {
        moe_json_key(w, tensors[i].name);
        moe_json_begin_object(w);
        moe_json_key(w, "dtype");
        moe_json_string(w, "F32");
        moe_json_key(w, "shape");
        moe_json_begin_array(w);
        for (int64_t d = 0; d < tensors[i].ndim; d++) moe_json_int(w, tensors[i].shape[d]);
        moe_json_end_array(w);
        moe_json_key(w, "data_offsets");
        moe_json_begin_array(w);
        moe_json_int(w, offset);
        if (nbytes[i] > INT64_MAX - offset)
            return moe_error(MOE_ERR_INVALID_ARG, "%s: total tensor bytes overflow", path);
        offset += nbytes[i];
        moe_json_int(w, offset);
        moe_json_end_array(w);
        moe_json_end_object(w);
    }
    moe_json_end_object(w);
    moe_status st = moe_json_writer_finish(w);
    if (st != MOE_OK) return moe_error_prefix(st, "%s: ", path);
    return MOE_OK;
}

moe_status moe_st_write(const char *path, const moe_st_entry *tensors, int64_t count, const moe_st_meta *meta,
                        int64_t meta_count) {
    if (path == NULL || count < 0 || meta_count < 0 || (count > 0 && tensors == NULL) ||
        (meta_count > 0 && meta == NULL))
        return moe_error(MOE_ERR_INVALID_ARG, "moe_st_write: NULL path, or bad tensor or metadata list");
    int64_t *nbytes = malloc((size_t)(count > 0 ? count : 1) * sizeof *nbytes);
    char *crc_list = malloc((size_t)count * (CRC_DIGITS + 1) + 1), meta_crc[CRC_DIGITS + 1];
    if (nbytes == NULL || crc_list == NULL) {
        free(nbytes);
        free(crc_list);
        return moe_error(MOE_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
    }
    moe_json_writer w;
    moe_json_writer_init(&w, 0);
    moe_status st = check_entries(nbytes, path, tensors, count, meta, meta_count);
    if (st == MOE_OK) st = make_checksums(crc_list, meta_crc, path, tensors, nbytes, count, meta, meta_count);
    if (st == MOE_OK) st = build_header(&w, path, tensors, nbytes, count, meta, meta_count, crc_list, meta_crc);
    if (st == MOE_OK && (w.len + 7) / 8 * 8 > MOE_ST_MAX_HEADER_BYTES)
        st = moe_error(MOE_ERR_INVALID_ARG, "%s: header of %zu bytes exceeds the limit of %llu", path, w.len,
                       (unsigned long long)MOE_ST_MAX_HEADER_BYTES);
    if (st == MOE_OK) {
        write_job job = {w.buf, w.len, (8 - w.len % 8) % 8, tensors, nbytes, count};
        st = moe_file_write_atomic(path, write_file, &job);
    }
    moe_json_writer_free(&w);
    free(nbytes);
    free(crc_list);
    return st;
}

/* ---------------------------------------------------------- directories */

typedef struct dir_entry {
    const char *name;
    const moe_st_tensor *tensor;
    int64_t shard;
} dir_entry;

struct moe_st_dir {
    char *path;
    char *index_path; /* NULL for a single model.safetensors */
    moe_st_file **shards; /* [shard_count] */
    int64_t shard_count;
    dir_entry *entries; /* [count], sorted by name */
    int64_t count;
};

void moe_st_dir_close(moe_st_dir *d) {
    if (d == NULL) return;
    for (int64_t i = 0; i < d->shard_count; i++) moe_st_close(d->shards[i]);
    free(d->shards);
    free(d->entries);
    free(d->index_path);
    free(d->path);
    free(d);
}

int64_t moe_st_dir_tensor_count(const moe_st_dir *d) { return d->count; }
int64_t moe_st_dir_shard_count(const moe_st_dir *d) { return d->shard_count; }
const char *moe_st_dir_index_path(const moe_st_dir *d) { return d->index_path; }

const moe_st_file *moe_st_dir_shard(const moe_st_dir *d, int64_t index) {
    return index >= 0 && index < d->shard_count ? d->shards[index] : NULL;
}

const moe_st_tensor *moe_st_dir_tensor_at(const moe_st_dir *d, int64_t index) {
    return index >= 0 && index < d->count ? d->entries[index].tensor : NULL;
}

const moe_st_tensor *moe_st_dir_find(const moe_st_dir *d, const char *name, const moe_st_file **file) {
    int64_t lo = 0, hi = d->count;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        int c = strcmp(d->entries[mid].name, name);
        if (c == 0) {
            if (file != NULL) *file = d->shards[d->entries[mid].shard];
            return d->entries[mid].tensor;
        }
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (file != NULL) *file = NULL;
    return NULL;
}

moe_status moe_st_dir_load_f32(float *out, const moe_st_dir *d, const char *name, int64_t ndim,
                               const int64_t *shape) {
    const moe_st_file *file;
    const moe_st_tensor *t = moe_st_dir_find(d, name, &file);
    return load_checked(out, t, t != NULL ? file->path : d->path, name, ndim, shape);
}

static int cmp_entry(const void *a, const void *b) {
    return strcmp(((const dir_entry *)a)->name, ((const dir_entry *)b)->name);
}

static char *join_path(const char *dir, const char *file) {
    size_t n = strlen(dir) + strlen(file) + 2;
    char *p = malloc(n);
    if (p != NULL) snprintf(p, n, "%s/%s", dir, file);
    return p;
}

static moe_status open_shard(moe_st_dir *d, const char *file) {
    char *p = join_path(d->path, file);
    if (p == NULL) return moe_error(MOE_ERR_OUT_OF_MEMORY, "%s: out of memory", d->path);
    moe_status st = moe_st_open(&d->shards[d->shard_count], p);
    free(p);
    if (st == MOE_OK) d->shard_count++;
    return st;
}

static moe_status open_single(moe_st_dir *d) {
    d->shards = malloc(sizeof *d->shards);
    if (d->shards == NULL) return moe_error(MOE_ERR_OUT_OF_MEMORY, "%s: out of memory", d->path);
    MOE_TRY(open_shard(d, SINGLE_FILE));
    const moe_st_file *f = d->shards[0];
    d->entries = malloc((size_t)(f->count > 0 ? f->count : 1) * sizeof *d->entries);
    if (d->entries == NULL) return moe_error(MOE_ERR_OUT_OF_MEMORY, "%s: out of memory", d->path);
    for (int64_t i = 0; i < f->count; i++) d->entries[i] = (dir_entry){f->tensors[i].name, &f->tensors[i], 0};
    d->count = f->count;
    return MOE_OK;
}

/* s is NULL when the name held a NUL. */
static bool plain_file_name(const char *s) {
    return s != NULL && s[0] != '\0' && strchr(s, '/') == NULL && strcmp(s, ".") != 0 && strcmp(s, "..") != 0;
}

static moe_status open_indexed(moe_st_dir *d, const char *index_path, const moe_json *root) {
    if (root->type != MOE_JSON_OBJECT)
        return moe_error(MOE_ERR_FORMAT, "%s: top level is a JSON %s, not an object", index_path,
                         moe_json_type_name(root->type));
    const moe_json *map = moe_json_get(root, "weight_map");
    if (map == NULL || map->type != MOE_JSON_OBJECT)
        return moe_error(MOE_ERR_FORMAT, "%s: \"weight_map\" is %s, not an object", index_path,
                         map == NULL ? "missing" : moe_json_type_name(map->type));
    const moe_json *meta = moe_json_get(root, "metadata");
    if (meta != NULL && meta->type != MOE_JSON_OBJECT && meta->type != MOE_JSON_NULL)
        return moe_error(MOE_ERR_FORMAT, "%s: \"metadata\" is a JSON %s, not an object", index_path,
                         moe_json_type_name(meta->type));

    size_t n = map->object.count;
    d->entries = malloc((n > 0 ? n : 1) * sizeof *d->entries);
    d->shards = malloc((n > 0 ? n : 1) * sizeof *d->shards);
    const char **files = malloc((n > 0 ? n : 1) * sizeof *files);
    if (d->entries == NULL || d->shards == NULL || files == NULL) {
        free(files);
        return moe_error(MOE_ERR_OUT_OF_MEMORY, "%s: out of memory", index_path);
    }
    moe_status st = MOE_OK;
    for (size_t i = 0; i < n && st == MOE_OK; i++) {
        const moe_json_member *m = &map->object.members[i];
        if (m->value.type != MOE_JSON_STRING)
            st = moe_error(MOE_ERR_FORMAT, "%s: weight_map[\"%.100s\"] is a JSON %s, not a file name", index_path,
                           m->key, moe_json_type_name(m->value.type));
        else if (!plain_file_name(moe_json_text(&m->value)))
            st = moe_error(MOE_ERR_FORMAT, "%s: weight_map[\"%.100s\"] = \"%.100s\" is not a file name in the "
                                           "directory",
                           index_path, m->key, m->value.string.data);
        else if (strlen(m->key) != m->key_len || m->key_len == 0)
            st = moe_error(MOE_ERR_FORMAT, "%s: weight_map has an empty tensor name or one with a NUL", index_path);
        files[i] = m->value.string.data;
    }
    /* Open each distinct shard once, in sorted order. */
    if (st == MOE_OK) qsort(files, n, sizeof *files, cmp_str_ptr);
    for (size_t i = 0; i < n && st == MOE_OK; i++)
        if (i == 0 || strcmp(files[i], files[i - 1]) != 0) st = open_shard(d, files[i]);
    free(files);
    for (size_t i = 0; i < n && st == MOE_OK; i++) {
        const moe_json_member *m = &map->object.members[i];
        int64_t s = 0;
        while (strcmp(strrchr(d->shards[s]->path, '/') + 1, m->value.string.data) != 0) s++;
        const moe_st_tensor *t = moe_st_find(d->shards[s], m->key);
        if (t == NULL)
            st = moe_error(MOE_ERR_FORMAT, "%s: weight_map puts tensor '%s' in %s, which does not hold it",
                           index_path, m->key, m->value.string.data);
        d->entries[i] = (dir_entry){t != NULL ? t->name : NULL, t, s};
    }
    if (st != MOE_OK) return st;
    d->count = (int64_t)n;
    return MOE_OK;
}

/* Whether dir holds an entry named by path; a dangling symbolic link counts,
 * so that opening it reports it rather than its absence. */
static moe_status has_entry(bool *found, const char *path) {
    struct stat sb;
    *found = lstat(path, &sb) == 0;
    if (*found || errno == ENOENT) return MOE_OK;
    return moe_error(MOE_ERR_IO, "%s: cannot access: %s", path, strerror(errno));
}

/* The directory itself, so that a missing or unreadable one is reported as
 * such instead of as one without weights files. */
static moe_status check_dir(const char *path) {
    struct stat sb;
    if (stat(path, &sb) != 0) {
        int err = errno;
        if (err == ENOENT && lstat(path, &sb) == 0) return moe_file_open_error(path, err);
        return moe_error(MOE_ERR_IO, "%s: cannot open the checkpoint directory: %s", path, strerror(err));
    }
    if (!S_ISDIR(sb.st_mode)) return moe_error(MOE_ERR_IO, "%s: not a directory", path);
    if (access(path, R_OK | X_OK) != 0)
        return moe_error(MOE_ERR_IO, "%s: cannot read the checkpoint directory: %s", path, strerror(errno));
    return MOE_OK;
}

static moe_status read_index(moe_st_dir *d, const char *index_path) {
    struct stat sb;
    if (stat(index_path, &sb) != 0) return moe_file_open_error(index_path, errno);
    moe_json_doc *doc;
    MOE_TRY(moe_json_parse_file(&doc, index_path, (size_t)MOE_ST_MAX_HEADER_BYTES));
    const moe_status st = open_indexed(d, index_path, moe_json_root(doc));
    moe_json_free(doc);
    return st;
}

/* Every tensor of every shard is one the weight_map puts in that shard:
 * the map is the list of the checkpoint's tensors, so one it leaves out
 * would be passed over unseen. d's entries are sorted. */
static moe_status check_listed(const moe_st_dir *d) {
    for (int64_t s = 0; s < d->shard_count; s++) {
        const moe_st_file *shard = d->shards[s];
        for (int64_t i = 0; i < shard->count; i++) {
            const char *name = shard->tensors[i].name;
            const moe_st_file *holder;
            if (moe_st_dir_find(d, name, &holder) == NULL)
                return moe_error(MOE_ERR_FORMAT, "%s: tensor '%s' is not in the weight_map of %s", shard->path, name,
                                 d->index_path);
            if (holder != shard)
                return moe_error(MOE_ERR_FORMAT, "%s: tensor '%s' is there too, but the weight_map of %s puts it in %s",
                                 shard->path, name, d->index_path, holder->path);
        }
    }
    return MOE_OK;
}

moe_status moe_st_dir_open(moe_st_dir **dir, const char *path) {
    *dir = NULL;
    MOE_TRY(check_dir(path));
    moe_st_dir *d = calloc(1, sizeof *d);
    if (d == NULL || (d->path = strdup(path)) == NULL) {
        free(d);
        return moe_error(MOE_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
    }
    char *index_path = join_path(path, INDEX_FILE);
    char *single_path = join_path(path, SINGLE_FILE);
    bool indexed = false, single = false;
    moe_status st = MOE_OK;
    if (index_path == NULL || single_path == NULL) st = moe_error(MOE_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
    if (st == MOE_OK) st = has_entry(&indexed, index_path);
    if (st == MOE_OK) st = has_entry(&single, single_path);
    /* Either could be the model meant, and their weights may differ: no
     * save here writes both, so one is left from something else (a copy,
     * a download), and which one only the user knows. */
    if (st == MOE_OK && indexed && single)
        st = moe_error(MOE_ERR_CONFIG, "%s: holds both %s and %s, whose weights may differ: move out the one that "
                                       "is not the model to load",
                       path, INDEX_FILE, SINGLE_FILE);
    if (st == MOE_OK) {
        if (indexed)
            st = read_index(d, index_path);
        else if (single)
            st = open_single(d);
        else
            st = moe_error(MOE_ERR_IO, "%s: holds neither %s nor %s", path, INDEX_FILE, SINGLE_FILE);
    }
    if (indexed) {
        d->index_path = index_path;
        index_path = NULL;
    }
    free(index_path);
    free(single_path);
    if (st == MOE_OK) qsort(d->entries, (size_t)d->count, sizeof *d->entries, cmp_entry);
    if (st == MOE_OK && indexed) st = check_listed(d);
    if (st != MOE_OK) {
        moe_st_dir_close(d);
        return st;
    }
    *dir = d;
    return MOE_OK;
}
