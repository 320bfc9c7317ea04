#define _XOPEN_SOURCE 700

#include "engine/fileio.h"

#include <errno.h>
#include <limits.h>
#include <fcntl.h>
#include <ftw.h>
#include <stdio.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include "common/status.h"

static int remove_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb, (void)flag, (void)ftw;
    return remove(path);
}

moe_status moe_remove_tree(const char *path) {
    if (nftw(path, remove_entry, 16, FTW_DEPTH | FTW_PHYS) != 0)
        return moe_error(MOE_ERR_IO, "cannot remove %s: %s", path, strerror(errno));
    return MOE_OK;
}

/* The directory part of path ("." when there is none), in a new string. */
static moe_status dir_of(char **dir, const char *path) {
    const char *slash = strrchr(path, '/');
    size_t n = slash == NULL ? 0 : (slash == path ? 1 : (size_t)(slash - path));
    *dir = malloc(n == 0 ? 2 : n + 1);
    if (*dir == NULL) return moe_error(MOE_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
    if (n == 0) {
        strcpy(*dir, ".");
    } else {
        memcpy(*dir, path, n);
        (*dir)[n] = '\0';
    }
    return MOE_OK;
}

moe_status moe_fsync_dir(const char *path) {
    int fd = open(path, O_RDONLY | O_DIRECTORY);
    if (fd < 0) return moe_error(MOE_ERR_IO, "%s: cannot open directory: %s", path, strerror(errno));
    if (fsync(fd) != 0) {
        int err = errno;
        close(fd);
        return moe_error(MOE_ERR_IO, "%s: fsync of directory failed: %s", path, strerror(err));
    }
    close(fd);
    return MOE_OK;
}

moe_status moe_file_write_bytes(FILE *file, const void *data, size_t size) {
    if (size == 0) return MOE_OK;
    errno = 0;
    if (fwrite(data, 1, size, file) != size)
        return moe_error(MOE_ERR_IO, "write of %zu bytes failed: %s", size,
                         errno != 0 ? strerror(errno) : "short write");
    return MOE_OK;
}

/* Everything up to and including the close of the temp file; on failure the
 * caller removes it. */
static moe_status write_temp(FILE *file, const char *tmp, moe_file_writer write, void *ctx) {
    moe_status st = write(ctx, file);
    if (st != MOE_OK) {
        fclose(file);
        return st;
    }
    if (fflush(file) != 0 || ferror(file)) {
        int err = errno;
        fclose(file);
        return moe_error(MOE_ERR_IO, "%s: write failed: %s", tmp, strerror(err));
    }
    if (fsync(fileno(file)) != 0) {
        int err = errno;
        fclose(file);
        return moe_error(MOE_ERR_IO, "%s: fsync failed: %s", tmp, strerror(err));
    }
    if (fclose(file) != 0) return moe_error(MOE_ERR_IO, "%s: close failed: %s", tmp, strerror(errno));
    return MOE_OK;
}

moe_status moe_file_write_atomic(const char *path, moe_file_writer write, void *ctx) {
    if (path == NULL || write == NULL)
        return moe_error(MOE_ERR_INVALID_ARG, "moe_file_write_atomic: NULL path or writer");
    size_t n = strlen(path) + 32;
    char *tmp = malloc(n);
    if (tmp == NULL) return moe_error(MOE_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
    snprintf(tmp, n, "%s.tmp.%ld", path, (long)getpid());

    /* O_TRUNC, not O_EXCL: a file with our pid in its name can only be left
     * over from a dead process that had the same pid. */
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0666);
    if (fd < 0) {
        moe_status st = moe_error(MOE_ERR_IO, "%s: cannot create temp file %s: %s", path, tmp,
                                  strerror(errno));
        free(tmp);
        return st;
    }
    FILE *file = fdopen(fd, "wb");
    if (file == NULL) {
        moe_status st = moe_error(MOE_ERR_IO, "%s: fdopen failed: %s", tmp, strerror(errno));
        close(fd);
        unlink(tmp);
        free(tmp);
        return st;
    }
    moe_status st = write_temp(file, tmp, write, ctx);
    if (st == MOE_OK && rename(tmp, path) != 0)
        st = moe_error(MOE_ERR_IO, "rename %s -> %s failed: %s", tmp, path, strerror(errno));
    if (st != MOE_OK) {
        unlink(tmp);
        free(tmp);
        return moe_error_prefix(st, "%s: ", path);
    }
    free(tmp);

    char *dir;
    MOE_TRY(dir_of(&dir, path));
    st = moe_fsync_dir(dir);
    free(dir);
    return st;
}

typedef struct buffer_ctx {
    const void *data;
    size_t size;
} buffer_ctx;

static moe_status write_buffer(void *ctx, FILE *file) {
    const buffer_ctx *b = ctx;
    return moe_file_write_bytes(file, b->data, b->size);
}

moe_status moe_file_write_atomic_buffer(const char *path, const void *data, size_t size) {
    if (data == NULL && size > 0)
        return moe_error(MOE_ERR_INVALID_ARG, "%s: NULL data of %zu bytes", path, size);
    buffer_ctx b = {data, size};
    return moe_file_write_atomic(path, write_buffer, &b);
}

static moe_status mkdir_one(const char *path) {
    if (mkdir(path, 0777) == 0) return MOE_OK;
    int err = errno;
    struct stat sb;
    if (err == EEXIST && stat(path, &sb) == 0) {
        if (S_ISDIR(sb.st_mode)) return MOE_OK;
        return moe_error(MOE_ERR_IO, "%s: exists and is not a directory", path);
    }
    return moe_error(MOE_ERR_IO, "%s: cannot create directory: %s", path, strerror(err));
}

moe_status moe_mkdir_p(const char *path) {
    if (path == NULL || path[0] == '\0')
        return moe_error(MOE_ERR_INVALID_ARG, "moe_mkdir_p: empty path");
    char *p = strdup(path);
    if (p == NULL) return moe_error(MOE_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
    moe_status st = MOE_OK;
    /* Each '/' after a non-slash character ends a parent; create it first. */
    for (char *c = p + 1; *c != '\0' && st == MOE_OK; c++) {
        if (*c != '/' || c[-1] == '/') continue;
        *c = '\0';
        st = mkdir_one(p);
        *c = '/';
    }
    if (st == MOE_OK) st = mkdir_one(p);
    free(p);
    return st;
}

/* Whether link is a symbolic link that resolves to nothing; then why
 * [PATH_MAX + 64] says so: its target is missing, or dangles in turn. */
static bool dangles(const char *link, char *why) {
    struct stat sb;
    char target[PATH_MAX], hop[2 * PATH_MAX];
    ssize_t n;
    if (lstat(link, &sb) != 0 || !S_ISLNK(sb.st_mode) || stat(link, &sb) == 0 || errno != ENOENT ||
        (n = readlink(link, target, sizeof target - 1)) < 0)
        return false;
    target[n] = '\0';
    /* The target as seen from the link's directory. */
    const char *slash = strrchr(link, '/');
    if (target[0] == '/' || !slash)
        snprintf(hop, sizeof hop, "%s", target);
    else
        snprintf(hop, sizeof hop, "%.*s/%s", (int)(slash - link), link, target);
    snprintf(why, PATH_MAX + 64, "its target '%s' %s", target,
             lstat(hop, &sb) == 0 ? "is a dangling link too" : "does not exist");
    return true;
}

moe_status moe_file_open_error(const char *path, int err) {
    char why[PATH_MAX + 64], dir[PATH_MAX];
    if (err == ENOENT && dangles(path, why))
        return moe_error(MOE_ERR_IO, "%s: dangling symbolic link: %s", path, why);
    /* DIR/config.json where DIR (slashes after it or not) is the dangling link. */
    const char *slash = strrchr(path, '/');
    while (slash && slash > path && slash[-1] == '/') slash--;
    if (err == ENOENT && slash && slash > path && (size_t)(slash - path) < sizeof dir) {
        snprintf(dir, sizeof dir, "%.*s", (int)(slash - path), path);
        if (dangles(dir, why)) return moe_error(MOE_ERR_IO, "%s: %s is a dangling symbolic link: %s", path, dir, why);
    }
    return moe_error(MOE_ERR_IO, "%s: cannot open: %s", path, strerror(err));
}

moe_status moe_file_open_fd(int *fd, int64_t *size, const char *path) {
    *fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC); /* a FIFO is refused below, not waited on */
    if (*fd < 0) return moe_file_open_error(path, errno);
    struct stat sb;
    moe_status st = MOE_OK;
    if (fstat(*fd, &sb) != 0)
        st = moe_error(MOE_ERR_IO, "%s: stat failed: %s", path, strerror(errno));
    else if (!S_ISREG(sb.st_mode))
        st = moe_error(MOE_ERR_IO, "%s: not a regular file", path);
    if (st != MOE_OK) {
        close(*fd);
        *fd = -1;
        return st;
    }
    *size = (int64_t)sb.st_size;
    return MOE_OK;
}

moe_status moe_file_open_read(FILE **file, int64_t *size, const char *path) {
    int fd;
    MOE_TRY(moe_file_open_fd(&fd, size, path));
    if (!(*file = fdopen(fd, "rb"))) {
        const int err = errno;
        close(fd);
        return moe_error(MOE_ERR_IO, "%s: cannot open: %s", path, strerror(err));
    }
    return MOE_OK;
}

moe_status moe_file_read_all(char **data, size_t *size, const char *path, size_t max_bytes) {
    *data = NULL;
    *size = 0;
    int fd;
    int64_t bytes;
    MOE_TRY(moe_file_open_fd(&fd, &bytes, path));
    if ((uint64_t)bytes > max_bytes) {
        close(fd);
        return moe_error(MOE_ERR_FORMAT, "%s: file is %lld bytes, more than the limit of %zu", path,
                         (long long)bytes, max_bytes);
    }
    size_t n = (size_t)bytes;
    char *buf = malloc(n + 1);
    if (buf == NULL) {
        close(fd);
        return moe_error(MOE_ERR_OUT_OF_MEMORY, "%s: cannot allocate %zu bytes", path, n + 1);
    }
    size_t got = 0;
    while (got < n) {
        ssize_t r = read(fd, buf + got, n - got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
            int err = errno;
            free(buf);
            close(fd);
            if (r == 0)
                return moe_error(MOE_ERR_IO, "%s: file shrank while reading (%zu of %zu bytes)",
                                 path, got, n);
            return moe_error(MOE_ERR_IO, "%s: read failed: %s", path, strerror(err));
        }
        got += (size_t)r;
    }
    close(fd);
    buf[n] = '\0';
    *data = buf;
    *size = n;
    return MOE_OK;
}
