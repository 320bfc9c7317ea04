/* safetensors.h: reading and writing safetensors files, the Hugging Face
 * weight format (8-byte little-endian header length N, N bytes of JSON, then
 * the packed tensor bytes), and checkpoint directories sharded with a
 * model.safetensors.index.json.
 *
 * The reader trusts nothing in the file. It rejects, naming the file and the
 * tensor: a header length over 100,000,000 bytes or past the end of the file,
 * a header that is not a UTF-8 JSON object starting with '{', a __metadata__
 * that is not a string -> string map, duplicate names, names, field names,
 * dtypes or metadata strings holding a NUL character, dtypes other than F32,
 * BF16 and F16 (other safetensors dtypes are named as unsupported), shapes
 * that are not non-negative integers or whose element count overflows,
 * data_offsets whose length disagrees with shape x dtype, and a byte buffer
 * that the tensors do not tile exactly (a gap, an overlap, or bytes after the
 * last tensor).
 *
 * Checksums. Those checks let through a flipped bit in a tensor's data (an
 * fp32 0.9998 becomes 3.4e38, finite) and most in the metadata (a step, a
 * seed, a data position), so every file moe_st_write writes records CRC-32Cs
 * (common/crc32c.h) in two __metadata__ keys of its own:
 *   "moe_crc32c"       each tensor's bytes' CRC, as 8 lowercase hex digits,
 *                      joined by commas, in the byte order of the tensor
 *                      names (strcmp), not the order the header lists them;
 *   "moe_meta_crc32c"  the CRC of the rest of the header's text: every other
 *                      __metadata__ entry ("format" and "moe_crc32c"
 *                      included) as key, NUL, value, NUL in the byte order of
 *                      the keys, then each tensor name and a NUL in the byte
 *                      order of the names.
 * Both orders are by name, not by position, because tools that rewrite a
 * header keep the entries but not always their order (the safetensors
 * library's writer orders tensors by dtype and name, and keeps __metadata__
 * in a hash map): the checksums stay valid through any reordering. A tool
 * that keeps this metadata but changes a tensor (renames it, converts it to
 * BF16) makes a file refused as damaged: it should drop both keys. The
 * tensors' fields other than the name need no checksum: a flipped bit in a
 * dtype, a shape or data_offsets breaks the tiling or the dtype checks
 * above.
 * moe_st_open checks both keys' form and the header's checksum; a tensor's
 * data is checked when it is read for use (moe_st_verify, and the loads
 * below), once and whole, so that opening a file costs no pass over its
 * data. A file with neither key (another tool's) loads as before; one with
 * only one of them, a list of another length or form, or a checksum that
 * differs is refused (MOE_ERR_FORMAT), naming the file and the tensor or the
 * metadata. */
#ifndef MOE_ENGINE_SAFETENSORS_H
#define MOE_ENGINE_SAFETENSORS_H

#include <stdbool.h>
#include <stdint.h>

#include "moe.h"

/* Largest header accepted, as in the reference implementation. */
#define MOE_ST_MAX_HEADER_BYTES ((uint64_t)100000000)

typedef enum moe_st_dtype {
    MOE_ST_F32,
    MOE_ST_BF16,
    MOE_ST_F16,
} moe_st_dtype;

/* "F32", "BF16", "F16". */
const char *moe_st_dtype_name(moe_st_dtype dtype);
int64_t moe_st_dtype_bytes(moe_st_dtype dtype);

typedef struct moe_st_tensor {
    const char *name;
    moe_st_dtype dtype;
    int64_t ndim;
    const int64_t *shape; /* [ndim]; ndim 0 is a scalar of one element */
    int64_t numel;
    int64_t nbytes;
    int64_t offset;   /* of the first byte, from the start of the file */
    const void *data; /* [nbytes] in the file's read-only mapping; not aligned */
    bool has_crc;     /* the header records the CRC-32C of the data: */
    uint32_t crc32c;  /* ... this one */
} moe_st_tensor;

typedef struct moe_st_file moe_st_file;

/* Maps the file read-only and validates all of it; tensors then point into
 * the mapping until moe_st_close(). The file must not be truncated in place
 * while open (replacing it by rename, as moe_st_write does, is safe). */
moe_status moe_st_open(moe_st_file **file, const char *path);
void moe_st_close(moe_st_file *file);
const char *moe_st_path(const moe_st_file *file);

/* Tensors in the order the header lists them. */
int64_t moe_st_tensor_count(const moe_st_file *file);
const moe_st_tensor *moe_st_tensor_at(const moe_st_file *file, int64_t index);
/* NULL when there is no tensor of that name. */
const moe_st_tensor *moe_st_find(const moe_st_file *file, const char *name);

/* The __metadata__ value for key, or NULL. */
const char *moe_st_metadata(const moe_st_file *file, const char *key);
int64_t moe_st_metadata_count(const moe_st_file *file);
void moe_st_metadata_at(const moe_st_file *file, int64_t index, const char **key, const char **value);

/* out [t->numel] = tensor t of file converted to fp32 (exact for all three
 * dtypes, F16 subnormals, infinities and NaNs included). */
void moe_st_read_f32(float *out, const moe_st_tensor *t);

/* The first of t's elements [first, first + count) that is a NaN or an
 * infinity or, when nonnegative, below zero (-0 is not): its index in t, or
 * -1 when every one is fine; *value receives it as fp32. Tests the stored
 * bits, converting none of the fine ones. */
int64_t moe_st_find_bad(float *value, const moe_st_tensor *t, int64_t first, int64_t count, bool nonnegative);

/* MOE_OK when t, a tensor as moe_st_open made it (whole, not a part of
 * it), records no checksum or the one of its bytes; else MOE_ERR_FORMAT,
 * naming path (its file), t and both checksums. One pass over t's bytes. */
moe_status moe_st_verify(const moe_st_tensor *t, const char *path);

/* moe_st_verify of every distinct tensor of t [n] (NULLs skipped, a tensor
 * listed twice checked once), in parallel, path [i] naming t [i]'s file;
 * the error is that of the first one listed that fails. */
moe_status moe_st_verify_all(const moe_st_tensor *const *t, const char *const *path, int64_t n);

/* Finds `name`, checks that its shape is shape [ndim] and its checksum
 * (moe_st_verify), and reads it as fp32 into out [product of shape]; the
 * error names the file, tensor and both shapes or checksums. */
moe_status moe_st_load_f32(float *out, const moe_st_file *file, const char *name, int64_t ndim,
                           const int64_t *shape);

float moe_bf16_to_f32(uint16_t bits);
float moe_f16_to_f32(uint16_t bits);

/* ----------------------------------------------------------------- writer */

typedef struct moe_st_entry {
    const char *name;
    const float *data; /* [product of shape] */
    int64_t ndim;
    const int64_t *shape; /* [ndim] */
} moe_st_entry;

typedef struct moe_st_meta {
    const char *key;
    const char *value;
} moe_st_meta;

/* Writes F32 tensors [count] to path atomically (fileio.h): __metadata__ is
 * {"format": "pt"}, then meta [meta_count], then the checksums
 * "moe_crc32c" and "moe_meta_crc32c" (above; these three keys are the
 * writer's own: moe_st_reserved_key), the header is space-padded to a
 * multiple of 8 bytes so the data starts 8-byte aligned, and the tensors
 * are packed back to back in the order given. Names must be unique,
 * non-empty UTF-8 and not "__metadata__". */
moe_status moe_st_write(const char *path, const moe_st_entry *tensors, int64_t count,
                        const moe_st_meta *meta, int64_t meta_count);

/* Whether moe_st_write writes key itself and refuses it in meta: leave
 * these out when copying a file's metadata into a new one. */
bool moe_st_reserved_key(const char *key);

/* ------------------------------------------------ checkpoint directories */

/* A directory holding either model.safetensors.index.json
 * ({"metadata": {...}, "weight_map": {tensor: shard file}}) and its shards,
 * or a single model.safetensors, not both (which one is the model is not
 * known: refused, naming both). Each shard is opened once; every tensor the
 * index names must be in the shard it names, and every tensor of a shard
 * must be one the index puts there. Shard names must be plain file names in
 * the directory. A directory that is missing, unreadable or not a
 * directory, and a weights file that is a dangling symbolic link, are
 * reported as such (with the system's reason), not as a directory without
 * weights. */
typedef struct moe_st_dir moe_st_dir;

moe_status moe_st_dir_open(moe_st_dir **dir, const char *path);
void moe_st_dir_close(moe_st_dir *dir);

/* The tensors of the checkpoint (those of the weight_map when there is an
 * index), sorted by name. */
int64_t moe_st_dir_tensor_count(const moe_st_dir *dir);
const moe_st_tensor *moe_st_dir_tensor_at(const moe_st_dir *dir, int64_t index);
/* NULL when absent; *file (may be NULL) receives the shard holding it. */
const moe_st_tensor *moe_st_dir_find(const moe_st_dir *dir, const char *name, const moe_st_file **file);
int64_t moe_st_dir_shard_count(const moe_st_dir *dir);
/* The path of the index file read, or NULL for a single model.safetensors. */
const char *moe_st_dir_index_path(const moe_st_dir *dir);
const moe_st_file *moe_st_dir_shard(const moe_st_dir *dir, int64_t index);

/* As moe_st_load_f32, looking in whichever shard holds name. */
moe_status moe_st_dir_load_f32(float *out, const moe_st_dir *dir, const char *name, int64_t ndim,
                               const int64_t *shape);

#endif /* MOE_ENGINE_SAFETENSORS_H */
