/* test_files.h: a temp directory per test and small file helpers, for the
 * Criterion tests that write files. Define TEST_TMPDIR_TEMPLATE (a mkdtemp
 * template) before including it. Needs _XOPEN_SOURCE 700 (nftw, mkdtemp). */
#ifndef MOE_TESTS_TEST_FILES_H
#define MOE_TESTS_TEST_FILES_H

#include <criterion/criterion.h>
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>

#include "common/status.h"
#include "engine/fileio.h"

static char tmpdir[256];

/* For .init: a fresh directory in tmpdir. */
static inline void make_tmpdir(void) {
    snprintf(tmpdir, sizeof tmpdir, "%s", TEST_TMPDIR_TEMPLATE);
    cr_assert_not_null(mkdtemp(tmpdir), "mkdtemp failed");
}

static inline int remove_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb, (void)flag, (void)ftw;
    return remove(path);
}

/* For .fini: removes tmpdir and everything in it. */
static inline void remove_tmpdir(void) { nftw(tmpdir, remove_entry, 16, FTW_DEPTH | FTW_PHYS); }

/* dir/name into the next of a ring of 8 buffers, so a few results can be
 * live at once. */
static inline const char *join_in_ring(char ring[8][768], int *which, const char *dir, const char *name) {
    *which = (*which + 1) % 8;
    snprintf(ring[*which], sizeof ring[*which], "%s/%s", dir, name);
    return ring[*which];
}

/* Rings of their own, so in_dir(in_tmp(a), b) never writes where it reads. */
static inline const char *in_dir(const char *dir, const char *name) {
    static char ring[8][768];
    static int which;
    return join_in_ring(ring, &which, dir, name);
}

static inline const char *in_tmp(const char *name) {
    static char ring[8][768];
    static int which;
    return join_in_ring(ring, &which, tmpdir, name);
}

/* The whole file; free() it. */
static inline unsigned char *read_bytes(const char *path, size_t *n) {
    char *data;
    cr_assert_eq(moe_file_read_all(&data, n, path, (size_t)1 << 30), MOE_OK, "%s", moe_last_error());
    return (unsigned char *)data;
}

static inline void write_bytes(const char *path, const void *data, size_t n) {
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f, "cannot create %s", path);
    cr_assert_eq(fwrite(data, 1, n, f), n);
    cr_assert_eq(fclose(f), 0);
}

#endif /* MOE_TESTS_TEST_FILES_H */
