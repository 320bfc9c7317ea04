/* fileio.h: whole-file reads with a size limit, directory creation, and the
 * atomic replacement of a file (temp file, fsync, rename, fsync of the
 * directory), so a crash or a failed write never leaves a half-written target
 * and never damages the file that was there before (DESIGN.md 7); and the
 * little-endian fields of binary headers. */
#ifndef MOE_ENGINE_FILEIO_H
#define MOE_ENGINE_FILEIO_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "moe.h"

/* Writes the new contents to `file`. Returns MOE_OK, or a status with the
 * detail set by moe_error(); the atomic writer adds the path in front. */
typedef moe_status (*moe_file_writer)(void *ctx, FILE *file);

/* Replaces `path` atomically with what `write` produces: the data goes to
 * "<path>.tmp.<pid>", which is flushed, fsync'ed and renamed over `path`, and
 * then the directory is fsync'ed so the rename itself is durable. If `write`
 * or any step before the rename fails, the temp file is removed and `path` is
 * left exactly as it was. */
moe_status moe_file_write_atomic(const char *path, moe_file_writer write, void *ctx);

/* The same for contents already in memory: data [size] bytes. */
moe_status moe_file_write_atomic_buffer(const char *path, const void *data, size_t size);

/* fwrite that reports a short write as MOE_ERR_IO with errno's reason; for
 * use inside a moe_file_writer. */
moe_status moe_file_write_bytes(FILE *file, const void *data, size_t size);

/* Creates `path` and every missing parent, like `mkdir -p`, mode 0777 less
 * the umask. An existing directory is fine; an existing non-directory is an
 * error. */
moe_status moe_mkdir_p(const char *path);

/* fsync on a directory, which makes the entries created or renamed in it
 * durable. */
moe_status moe_fsync_dir(const char *path);

/* rm -r path, not following links. */
moe_status moe_remove_tree(const char *path);

/* The error for an open of path that failed with errno err. A symbolic link
 * whose target is missing fails with ENOENT like a missing file; it is named
 * as what it is, with its target. */
moe_status moe_file_open_error(const char *path, int err);

/* Opens a regular file for reading into *fd (close it) and its size into
 * *size: anything else is refused naming path, a FIFO without waiting for a
 * writer (which a plain open would, for ever), a dangling link naming its
 * target. */
moe_status moe_file_open_fd(int *fd, int64_t *size, const char *path);

/* The same as a stream (fclose it). */
moe_status moe_file_open_read(FILE **file, int64_t *size, const char *path);

/* Reads a whole regular file into a new buffer of *size + 1 bytes whose last
 * byte is '\0' (so text can be handed to string functions); free() it. A
 * file larger than max_bytes is refused with MOE_ERR_FORMAT before anything
 * is allocated. */
moe_status moe_file_read_all(char **data, size_t *size, const char *path, size_t max_bytes);

/* The little-endian uint32 at b, whatever the host's byte order. */
static inline uint32_t moe_get_le32(const unsigned char *b) {
    return (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24;
}

#endif /* MOE_ENGINE_FILEIO_H */
