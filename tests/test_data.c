/* test_data.c: token sources (engine/data.h): batch layout against a naive
 * model of the llm.c reader, rank slicing, shuffling, resuming, byte files,
 * and llm.c shards (round trip, and every kind of corruption refused with the
 * file named). Token values are compared exactly. */
#define _POSIX_C_SOURCE 200809L

#include <criterion/criterion.h>
#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "engine/data.h"

/* ------------------------------------------------------------- helpers */

static char *make_dir(void) {
    char *dir = strdup("/tmp/moe-test-data-XXXXXX");
    cr_assert(dir != NULL && mkdtemp(dir) != NULL, "mkdtemp failed");
    return dir;
}

static void remove_dir(char *dir) {
    DIR *d = opendir(dir);
    cr_assert(d != NULL);
    char path[512];
    for (struct dirent *e; (e = readdir(d)) != NULL;) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        remove(path); /* a file, or an empty directory */
    }
    closedir(d);
    rmdir(dir);
    free(dir);
}

static void path_in(char *out, size_t size, const char *dir, const char *name) {
    snprintf(out, size, "%s/%s", dir, name);
}

static void write_bytes(const char *path, const void *data, size_t n) {
    FILE *f = fopen(path, "wb");
    cr_assert(f != NULL, "cannot create %s", path);
    cr_assert(fwrite(data, 1, n, f) == n);
    fclose(f);
}

/* The whole file, read independently of the code under test. */
static unsigned char *read_whole(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    cr_assert(f != NULL, "cannot open %s", path);
    fseek(f, 0, SEEK_END);
    *n = (size_t)ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *buf = malloc(*n + 1);
    cr_assert(buf != NULL && fread(buf, 1, *n, f) == *n);
    fclose(f);
    return buf;
}

static int32_t le32(const unsigned char *b) {
    return (int32_t)((uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 |
                     (uint32_t)b[3] << 24);
}

static void expect_error_names(moe_status st, moe_status want, const char *needle) {
    cr_assert_eq(st, want, "status %d (%s), expected %d; detail: %s", st, moe_status_string(st),
                 want, moe_last_error());
    cr_assert(strstr(moe_last_error(), needle) != NULL, "error \"%s\" does not name \"%s\"",
              moe_last_error(), needle);
}

/* tokens[i] = i: a batch's values say exactly where it was read from. */
static moe_data *iota_source(int64_t n) {
    int32_t *tokens = malloc((size_t)n * sizeof *tokens);
    cr_assert(tokens != NULL);
    for (int64_t i = 0; i < n; i++) tokens[i] = (int32_t)i;
    moe_data *d;
    cr_assert_eq(moe_data_from_tokens(&d, tokens, n, n, "iota"), MOE_OK, "%s", moe_last_error());
    free(tokens);
    return d;
}

/* Naive model of the in-order reader: where the next batch of span tokens
 * starts, wrapping to 0 when span + 1 tokens do not remain. */
typedef struct ref_reader {
    int64_t n, token, epoch;
} ref_reader;

static int64_t ref_next_start(ref_reader *r, int64_t span) {
    if (r->token + span + 1 > r->n) {
        r->token = 0;
        r->epoch++;
    }
    int64_t start = r->token;
    r->token += span;
    return start;
}

/* Inputs [rows, T] and targets [rows, T] of a batch whose first row starts
 * at stream offset start, from an iota source. */
static void expect_rows(const int32_t *in, const int32_t *tg, int64_t start, int64_t rows,
                        int64_t T, const char *what) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t t = 0; t < T; t++) {
            int64_t want = start + r * T + t;
            cr_assert_eq(in[r * T + t], want, "%s: input[%lld][%lld] = %d, expected %lld", what,
                         (long long)r, (long long)t, in[r * T + t], (long long)want);
            cr_assert_eq(tg[r * T + t], want + 1, "%s: target[%lld][%lld] = %d, expected %lld",
                         what, (long long)r, (long long)t, tg[r * T + t], (long long)want + 1);
        }
}

/* -------------------------------------------------------- batch layout */

Test(data_layout, first_batch_continuation_and_wrap) {
    const int64_t n = 100, B = 2, T = 5;
    moe_data *d = iota_source(n);
    cr_assert_eq(moe_data_vocab_size(d), n);
    cr_assert_eq(moe_data_token_count(d), n);
    int32_t in[10], tg[10];

    /* The first batch, spelled out: rows 0..4 and 5..9, targets one on. */
    cr_assert_eq(moe_data_next_batch(d, in, tg, B, 0, B, T), MOE_OK, "%s", moe_last_error());
    const int32_t in0[10] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9};
    const int32_t tg0[10] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
    cr_assert_arr_eq(in, in0, sizeof in0);
    cr_assert_arr_eq(tg, tg0, sizeof tg0);

    /* 9 batches fit in 100 tokens (the 9th reads tokens 80..90); the 10th
     * would need token 100, so it wraps to 0 in epoch 1. */
    ref_reader ref = {n, 0, 0};
    ref_next_start(&ref, B * T);
    for (int b = 1; b < 30; b++) {
        cr_assert_eq(moe_data_next_batch(d, in, tg, B, 0, B, T), MOE_OK, "%s", moe_last_error());
        int64_t start = ref_next_start(&ref, B * T);
        char what[64];
        snprintf(what, sizeof what, "batch %d", b);
        expect_rows(in, tg, start, B, T, what);
        moe_data_position p = moe_data_get_position(d);
        cr_assert(p.token == ref.token && p.epoch == ref.epoch,
                  "batch %d: position %lld epoch %lld, expected %lld epoch %lld", b,
                  (long long)p.token, (long long)p.epoch, (long long)ref.token,
                  (long long)ref.epoch);
        if (b == 9) cr_assert(start == 0 && p.epoch == 1, "batch 9 must wrap to 0");
    }
    moe_data_close(d);
}

Test(data_layout, changing_batch_shape_continues_in_order) {
    moe_data *d = iota_source(64);
    int32_t in[24], tg[24];
    cr_assert_eq(moe_data_next_batch(d, in, tg, 1, 0, 1, 7), MOE_OK);
    expect_rows(in, tg, 0, 1, 7, "T=7");
    cr_assert_eq(moe_data_next_batch(d, in, tg, 3, 0, 3, 8), MOE_OK);
    expect_rows(in, tg, 7, 3, 8, "3x8 after 7");
    moe_data_close(d);
}

Test(data_layout, bad_arguments_refused) {
    moe_data *d = iota_source(64);
    int32_t in[64], tg[64];
    cr_expect_eq(moe_data_next_batch(d, in, tg, 2, 1, 2, 4), MOE_ERR_INVALID_ARG);
    cr_expect_eq(moe_data_next_batch(d, in, tg, 2, -1, 1, 4), MOE_ERR_INVALID_ARG);
    cr_expect_eq(moe_data_next_batch(d, in, tg, 2, 0, 0, 4), MOE_ERR_INVALID_ARG);
    cr_expect_eq(moe_data_next_batch(d, in, tg, 2, 0, 2, 0), MOE_ERR_INVALID_ARG);
    expect_error_names(moe_data_next_batch(d, in, tg, 8, 0, 1, 8), MOE_ERR_CONFIG, "iota");
    cr_expect_eq(moe_data_get_position(d).token, 0, "a refused call must not move the position");
    moe_data_close(d);
}

/* --------------------------------------------------------- rank slicing */

/* R ranks reading B rows each of a global batch of R*B rows get, between
 * them, exactly what one rank reading all R*B rows gets, batch after batch
 * and across epochs, in order and shuffled. */
static void check_ranks(int shuffle) {
    enum { R = 3, B = 2, T = 4, N = 131, BATCHES = 25 };
    moe_data *whole = iota_source(N);
    moe_data *rank[R];
    for (int r = 0; r < R; r++) rank[r] = iota_source(N);
    moe_data_set_shuffle(whole, shuffle, 99);
    for (int r = 0; r < R; r++) moe_data_set_shuffle(rank[r], shuffle, 99);
    int32_t in[R * B * T], tg[R * B * T], rin[B * T], rtg[B * T];
    for (int b = 0; b < BATCHES; b++) {
        cr_assert_eq(moe_data_next_batch(whole, in, tg, R * B, 0, R * B, T), MOE_OK, "%s",
                     moe_last_error());
        for (int r = 0; r < R; r++) {
            cr_assert_eq(moe_data_next_batch(rank[r], rin, rtg, R * B, r * B, B, T), MOE_OK, "%s",
                         moe_last_error());
            for (int i = 0; i < B * T; i++) {
                cr_assert_eq(rin[i], in[r * B * T + i], "batch %d rank %d input %d: %d vs %d", b,
                             r, i, rin[i], in[r * B * T + i]);
                cr_assert_eq(rtg[i], tg[r * B * T + i], "batch %d rank %d target %d: %d vs %d", b,
                             r, i, rtg[i], tg[r * B * T + i]);
            }
            moe_data_position pw = moe_data_get_position(whole);
            moe_data_position pr = moe_data_get_position(rank[r]);
            cr_assert(pw.token == pr.token && pw.epoch == pr.epoch, "batch %d rank %d: position", b,
                      r);
        }
    }
    cr_assert(moe_data_get_position(whole).epoch >= 2, "the test must cross epochs");
    moe_data_close(whole);
    for (int r = 0; r < R; r++) moe_data_close(rank[r]);
}

Test(data_ranks, union_of_ranks_is_the_global_batch) { check_ranks(0); }
Test(data_ranks, union_of_ranks_is_the_global_batch_shuffled) { check_ranks(1); }

/* ------------------------------------------------------------ shuffling */

/* The chunk index of each batch of an epoch, checking that the batch is one
 * contiguous chunk. */
static void read_epoch(moe_data *d, int64_t *chunks, int64_t n_chunks, int64_t B, int64_t T) {
    int32_t in[64], tg[64];
    for (int64_t c = 0; c < n_chunks; c++) {
        cr_assert_eq(moe_data_next_batch(d, in, tg, B, 0, B, T), MOE_OK, "%s", moe_last_error());
        cr_assert_eq(in[0] % (B * T), 0, "batch %lld starts at %d, not a chunk boundary",
                     (long long)c, in[0]);
        expect_rows(in, tg, in[0], B, T, "shuffled chunk");
        chunks[c] = in[0] / (B * T);
    }
}

Test(data_shuffle, each_epoch_is_a_seeded_permutation) {
    enum { B = 2, T = 5, N = 207, C = (N - 1) / (B * T) }; /* 20 chunks, 6 tail tokens */
    moe_data *a = iota_source(N), *b = iota_source(N), *c = iota_source(N);
    moe_data_set_shuffle(a, 1, 1234);
    moe_data_set_shuffle(b, 1, 1234);
    moe_data_set_shuffle(c, 1, 1235);
    int64_t ea[3][C], eb[3][C], ec[C];
    for (int e = 0; e < 3; e++) {
        read_epoch(a, ea[e], C, B, T);
        read_epoch(b, eb[e], C, B, T);
        cr_assert_arr_eq(ea[e], eb[e], sizeof ea[e], "epoch %d: same seed, different order", e);
        int seen[C] = {0};
        for (int i = 0; i < C; i++) {
            cr_assert(ea[e][i] >= 0 && ea[e][i] < C, "chunk %lld out of range",
                      (long long)ea[e][i]);
            seen[ea[e][i]]++;
        }
        for (int i = 0; i < C; i++)
            cr_assert_eq(seen[i], 1, "epoch %d: chunk %d read %d times", e, i, seen[i]);
    }
    cr_assert_eq(moe_data_get_position(a).epoch, 2);
    read_epoch(c, ec, C, B, T);
    /* 20! orders: two seeds or two epochs agree with probability 1/20!. */
    cr_assert(memcmp(ea[0], ec, sizeof ec) != 0, "another seed must give another order");
    cr_assert(memcmp(ea[0], ea[1], sizeof ec) != 0, "each epoch must have its own order");
    int identity = 1;
    for (int i = 0; i < C; i++) identity &= ea[0][i] == i;
    cr_assert(!identity, "a shuffled epoch came out in order");
    moe_data_close(a);
    moe_data_close(b);
    moe_data_close(c);
}

/* Over many epochs of 4 chunks, each chunk sits at each place about equally
 * often: 24 orders of 4, 2400 epochs, 600 expected per cell, and a cell
 * beyond 5 sigma (sigma = sqrt(2400 * 1/4 * 3/4) = 21.2) fails. */
Test(data_shuffle, orders_are_uniform) {
    enum { B = 1, T = 3, C = 4, EPOCHS = 2400 };
    moe_data *d = iota_source(C * B * T + 1);
    moe_data_set_shuffle(d, 1, 8);
    int64_t order[C], count[C][C] = {{0}};
    for (int e = 0; e < EPOCHS; e++) {
        read_epoch(d, order, C, B, T);
        for (int i = 0; i < C; i++) count[order[i]][i]++;
    }
    const double mean = EPOCHS / (double)C, sigma = sqrt(EPOCHS * 0.25 * 0.75);
    for (int c = 0; c < C; c++)
        for (int i = 0; i < C; i++)
            cr_expect(fabs(count[c][i] - mean) < 5 * sigma,
                      "chunk %d at place %d %lld times, expected %.0f", c, i,
                      (long long)count[c][i], mean);
    moe_data_close(d);
}

Test(data_shuffle, batch_shape_change_mid_epoch_refused) {
    moe_data *d = iota_source(100);
    moe_data_set_shuffle(d, 1, 5);
    int32_t in[64], tg[64];
    cr_assert_eq(moe_data_next_batch(d, in, tg, 2, 0, 2, 5), MOE_OK);
    expect_error_names(moe_data_next_batch(d, in, tg, 3, 0, 3, 5), MOE_ERR_STATE, "iota");
    moe_data_close(d);
}

/* -------------------------------------------------------------- resuming */

static void check_resume(int shuffle) {
    enum { B = 3, T = 4, N = 150, BEFORE = 17, AFTER = 15 };
    moe_data *a = iota_source(N), *b = iota_source(N);
    moe_data_set_shuffle(a, shuffle, 77);
    moe_data_set_shuffle(b, shuffle, 77);
    int32_t in[B * T], tg[B * T], in2[B * T], tg2[B * T];
    for (int i = 0; i < BEFORE; i++)
        cr_assert_eq(moe_data_next_batch(a, in, tg, B, 0, B, T), MOE_OK);
    moe_data_position saved = moe_data_get_position(a);
    cr_assert(saved.epoch >= 1, "resume from mid-run, past an epoch end");
    cr_assert_eq(moe_data_set_position(b, saved), MOE_OK, "%s", moe_last_error());
    for (int i = 0; i < AFTER; i++) {
        cr_assert_eq(moe_data_next_batch(a, in, tg, B, 0, B, T), MOE_OK);
        cr_assert_eq(moe_data_next_batch(b, in2, tg2, B, 0, B, T), MOE_OK);
        cr_assert_arr_eq(in, in2, sizeof in, "batch %d after resume differs", i);
        cr_assert_arr_eq(tg, tg2, sizeof tg, "batch %d after resume differs", i);
    }
    moe_data_close(a);
    moe_data_close(b);
}

Test(data_resume, position_restores_the_stream) { check_resume(0); }
Test(data_resume, position_restores_the_shuffled_stream) { check_resume(1); }

Test(data_resume, bad_position_refused) {
    moe_data *d = iota_source(50);
    cr_expect_eq(moe_data_set_position(d, (moe_data_position){51, 0}), MOE_ERR_INVALID_ARG);
    cr_expect_eq(moe_data_set_position(d, (moe_data_position){-1, 0}), MOE_ERR_INVALID_ARG);
    cr_expect_eq(moe_data_set_position(d, (moe_data_position){0, -1}), MOE_ERR_INVALID_ARG);
    cr_expect_eq(moe_data_set_position(d, (moe_data_position){50, 3}), MOE_OK);
    cr_expect_eq(moe_data_set_position(d, (moe_data_position){0, INT64_MAX}), MOE_ERR_INVALID_ARG);
    cr_expect(strstr(moe_last_error(), "epoch=9223372036854775807, need token in [0, 50] and epoch in [0, "
                                       "9223372036854775806]") != NULL,
              "%s", moe_last_error());
    moe_data_close(d);
}

/* The last epoch reads to its end; starting the one after it would overflow
 * the count, so it is refused and the position left where it was. */
Test(data_resume, last_epoch_does_not_wrap) {
    for (int shuffle = 0; shuffle <= 1; shuffle++) {
        moe_data *d = iota_source(50);
        moe_data_set_shuffle(d, shuffle, 5);
        int32_t in[10], tg[10];
        cr_assert_eq(moe_data_set_position(d, (moe_data_position){30, MOE_DATA_EPOCH_MAX}), MOE_OK, "%s",
                     moe_last_error());
        /* Of 50 tokens, a batch of 10 (+1 target) starts at 30 but not at 40. */
        cr_assert_eq(moe_data_next_batch(d, in, tg, 2, 0, 2, 5), MOE_OK, "%s", moe_last_error());
        moe_data_position p = moe_data_get_position(d);
        cr_assert(p.token == 40 && p.epoch == MOE_DATA_EPOCH_MAX, "shuffle %d: position %lld epoch %lld", shuffle,
                  (long long)p.token, (long long)p.epoch);
        moe_status st = moe_data_next_batch(d, in, tg, 2, 0, 2, 5);
        cr_expect_eq(st, MOE_ERR_STATE, "shuffle %d: wrapped past the last epoch (%s)", shuffle,
                     moe_status_string(st));
        cr_expect(strstr(moe_last_error(), "epoch 9223372036854775806 is the last one counted") != NULL, "%s",
                  moe_last_error());
        p = moe_data_get_position(d);
        cr_expect(p.token == 40 && p.epoch == MOE_DATA_EPOCH_MAX, "shuffle %d: a refused batch moved to %lld epoch %lld",
                  shuffle, (long long)p.token, (long long)p.epoch);
        moe_data_close(d);
    }
}

Test(data_memory, tokens_outside_vocab_refused) {
    const int32_t bad[4] = {0, 1, 7, 2};
    moe_data *d;
    expect_error_names(moe_data_from_tokens(&d, bad, 4, 7, "mine"), MOE_ERR_INVALID_ARG, "mine");
    cr_assert(strstr(moe_last_error(), "token 2") != NULL, "%s", moe_last_error());
}

/* ------------------------------------------------------------ byte files */

Test(data_bytes, bytes_are_tokens) {
    char *dir = make_dir(), path[512];
    path_in(path, sizeof path, dir, "text.bin");
    unsigned char bytes[600];
    for (int i = 0; i < 600; i++) bytes[i] = (unsigned char)(i * 7 + 3);
    write_bytes(path, bytes, sizeof bytes);
    moe_data *d;
    cr_assert_eq(moe_data_open_bytes(&d, path), MOE_OK, "%s", moe_last_error());
    cr_assert_eq(moe_data_vocab_size(d), 256);
    cr_assert_eq(moe_data_token_count(d), 600);
    int32_t in[4 * 16], tg[4 * 16];
    for (int b = 0; b < 12; b++) { /* 9 batches per epoch: crosses a wrap */
        cr_assert_eq(moe_data_next_batch(d, in, tg, 4, 0, 4, 16), MOE_OK, "%s", moe_last_error());
        int64_t start = (b % 9) * 64;
        for (int i = 0; i < 64; i++) {
            cr_assert_eq(in[i], bytes[start + i], "batch %d input %d", b, i);
            cr_assert_eq(tg[i], bytes[start + i + 1], "batch %d target %d", b, i);
        }
    }
    moe_data_close(d);
    remove_dir(dir);
}

Test(data_bytes, too_small_and_empty_files_named) {
    char *dir = make_dir(), small[512], empty[512];
    path_in(small, sizeof small, dir, "small.txt");
    path_in(empty, sizeof empty, dir, "empty.txt");
    write_bytes(small, "0123456789", 10);
    write_bytes(empty, "", 0);
    moe_data *d;
    cr_assert_eq(moe_data_open_bytes(&d, small), MOE_OK, "%s", moe_last_error());
    int32_t in[16], tg[16];
    /* 10 bytes: a batch of 3 x 3 needs 10 and is fine, 2 x 5 needs 11. */
    cr_assert_eq(moe_data_next_batch(d, in, tg, 3, 0, 3, 3), MOE_OK, "%s", moe_last_error());
    expect_error_names(moe_data_next_batch(d, in, tg, 2, 0, 2, 5), MOE_ERR_CONFIG, small);
    moe_data_close(d);
    expect_error_names(moe_data_open_bytes(&d, empty), MOE_ERR_FORMAT, empty);
    path_in(empty, sizeof empty, dir, "missing.txt");
    expect_error_names(moe_data_open_bytes(&d, empty), MOE_ERR_IO, empty);
    remove_dir(dir);
}

/* fopen reads a directory, whose end lies INT64_MAX bytes in: without a
 * check it opened as a stream of that many bytes and failed only when read. */
Test(data_bytes, directory_refused_at_open) {
    char *dir = make_dir(), sub[512];
    path_in(sub, sizeof sub, dir, "train_000.bin");
    cr_assert_eq(mkdir(sub, 0700), 0);
    moe_data *d = (moe_data *)1;
    expect_error_names(moe_data_open_bytes(&d, sub), MOE_ERR_IO, sub);
    cr_assert(strstr(moe_last_error(), "not a regular file") != NULL, "%s", moe_last_error());
    cr_assert(d == NULL, "a refused open must leave no handle");
    /* A glob of shards that matches the directory too. */
    char pattern[512];
    path_in(pattern, sizeof pattern, dir, "train_*.bin");
    expect_error_names(moe_data_open_shards(&d, pattern, 100), MOE_ERR_IO, sub);
    cr_assert(strstr(moe_last_error(), "not a regular file") != NULL, "%s", moe_last_error());
    cr_assert(d == NULL, "a refused open must leave no handle");
    remove_dir(dir);
}

/* A FIFO is refused at once: a plain open would wait for a writer for ever. */
Test(data_bytes, fifo_refused_without_waiting, .timeout = 20) {
    char *dir = make_dir(), fifo[512], pattern[512];
    path_in(fifo, sizeof fifo, dir, "train_000.bin");
    cr_assert_eq(mkfifo(fifo, 0600), 0);
    moe_data *d = (moe_data *)1;
    expect_error_names(moe_data_open_bytes(&d, fifo), MOE_ERR_IO, fifo);
    cr_assert(strstr(moe_last_error(), "not a regular file") != NULL, "%s", moe_last_error());
    path_in(pattern, sizeof pattern, dir, "train_*.bin");
    expect_error_names(moe_data_open_shards(&d, pattern, 100), MOE_ERR_IO, fifo);
    cr_assert(d == NULL, "a refused open must leave no handle");
    remove_dir(dir);
}

/* ---------------------------------------------------------------- shards */

static int32_t shard_token(int64_t i) { return (int32_t)((i * 2654435761u) % 50000); }

/* A batch of n inputs and targets read from stream offset start of the
 * three shards below. */
static void expect_shard_batch(const int32_t *in, const int32_t *tg, int64_t start, int n, int b) {
    for (int i = 0; i < n; i++) {
        cr_assert_eq(in[i], shard_token(start + i), "batch %d input %d", b, i);
        cr_assert_eq(tg[i], shard_token(start + i + 1), "batch %d target %d", b, i);
    }
}

/* Three shards of 700, 0 and 1301 tokens (an empty one between), written
 * with moe_data_write_shard, named so that glob order is stream order. */
static char *write_three_shards(int64_t *total) {
    char *dir = make_dir(), path[512];
    const int64_t counts[3] = {700, 0, 1301};
    int32_t *buf = malloc(2001 * sizeof *buf);
    int64_t at = 0;
    for (int s = 0; s < 3; s++) {
        for (int64_t i = 0; i < counts[s]; i++) buf[i] = shard_token(at + i);
        snprintf(path, sizeof path, "%s/train_%06d.bin", dir, s);
        cr_assert_eq(moe_data_write_shard(path, buf, counts[s], 2), MOE_OK, "%s", moe_last_error());
        at += counts[s];
    }
    free(buf);
    *total = at;
    return dir;
}

/* The three shards' glob, into pattern [512], opened as one stream. */
static moe_data *open_three_shards(char **dir, char *pattern, int64_t *total) {
    *dir = write_three_shards(total);
    path_in(pattern, 512, *dir, "train_*.bin");
    moe_data *d;
    cr_assert_eq(moe_data_open_shards(&d, pattern, 50257), MOE_OK, "%s", moe_last_error());
    return d;
}

/* A shard whose very name reads as a glob is that file, not what the glob
 * matches ("train[1].bin" would match "train1.bin"). */
Test(data_shards, a_file_named_like_a_glob_is_itself) {
    char *dir = make_dir(), literal[512], other[512];
    int32_t tokens[7] = {1, 2, 3, 4, 5, 6, 7};
    path_in(literal, sizeof literal, dir, "train[1].bin");
    path_in(other, sizeof other, dir, "train1.bin");
    cr_assert_eq(moe_data_write_shard(literal, tokens, 7, 2), MOE_OK, "%s", moe_last_error());
    cr_assert_eq(moe_data_write_shard(other, tokens, 5, 2), MOE_OK, "%s", moe_last_error());
    moe_data *d = NULL;
    cr_assert_eq(moe_data_open_shards(&d, literal, 100), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(moe_data_token_count(d), 7);
    moe_data_close(d);
    /* A directory of such a name is no shard: the glob reads what it matches. */
    remove(literal);
    cr_assert_eq(mkdir(literal, 0700), 0);
    cr_assert_eq(moe_data_open_shards(&d, literal, 100), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(moe_data_token_count(d), 5);
    moe_data_close(d);
    rmdir(literal), remove(other);
    remove_dir(dir);
}

Test(data_shards, writer_bytes_follow_llmc) {
    char *dir = make_dir(), path[512];
    path_in(path, sizeof path, dir, "one.bin");
    const int32_t tokens[5] = {0, 1, 258, 65535, 50256};
    cr_assert_eq(moe_data_write_shard(path, tokens, 5, 2), MOE_OK, "%s", moe_last_error());
    size_t n;
    unsigned char *b = read_whole(path, &n);
    cr_assert_eq(n, 1024 + 2 * 5);
    cr_assert_eq(le32(b), 20240520);
    cr_assert_eq(le32(b + 4), 1);
    cr_assert_eq(le32(b + 8), 5);
    for (int i = 12; i < 1024; i++) cr_assert_eq(b[i], 0, "header byte %d not zero", i);
    for (int i = 0; i < 5; i++)
        cr_assert_eq(b[1024 + 2 * i] | b[1024 + 2 * i + 1] << 8, tokens[i], "token %d", i);
    free(b);
    remove_dir(dir);
}

Test(data_shards, glob_of_shards_is_one_stream) {
    int64_t total;
    char *dir, pattern[512];
    moe_data *d = open_three_shards(&dir, pattern, &total);
    cr_assert_eq(moe_data_token_count(d), total);
    cr_assert_eq(moe_data_vocab_size(d), 50257);
    /* Batches of 3 x 50 rows cross the shard boundary at 700 mid-row. */
    enum { B = 3, T = 50 };
    int32_t in[B * T], tg[B * T];
    ref_reader ref = {total, 0, 0};
    for (int b = 0; b < 20; b++) {
        cr_assert_eq(moe_data_next_batch(d, in, tg, B, 0, B, T), MOE_OK, "%s", moe_last_error());
        expect_shard_batch(in, tg, ref_next_start(&ref, B * T), B * T, b);
    }
    cr_assert_eq(moe_data_get_position(d).epoch, 1, "20 batches of 150 pass the end of 2001");
    moe_data_close(d);
    remove_dir(dir);
}

/* A narrowed stream reads only its tokens: in order it wraps at its own
 * end; across shard boundaries; shuffled, its chunks are its own; a range
 * outside the stream is refused, and a second narrowing is within the
 * first. */
Test(data_shards, restrict_reads_a_part_of_the_stream) {
    int64_t total;
    char *dir, pattern[512];
    moe_data *d = open_three_shards(&dir, pattern, &total);
    enum { B = 2, T = 50, FROM = 650, TO = 1400 }; /* across the boundary at 700 */
    cr_assert_eq(moe_data_restrict(d, FROM, TO), MOE_OK, "%s", moe_last_error());
    cr_assert_eq(moe_data_token_count(d), TO - FROM);
    int32_t in[B * T], tg[B * T];
    ref_reader ref = {TO - FROM, 0, 0};
    for (int b = 0; b < 12; b++) {
        cr_assert_eq(moe_data_next_batch(d, in, tg, B, 0, B, T), MOE_OK, "%s", moe_last_error());
        expect_shard_batch(in, tg, FROM + ref_next_start(&ref, B * T), B * T, b);
    }
    cr_assert_eq(moe_data_get_position(d).epoch, 1, "12 batches of 100 pass the end of 750");
    moe_data_set_shuffle(d, 1, 5);
    for (int b = 0; b < 7; b++) { /* an epoch: 7 chunks of 100 in 749 */
        cr_assert_eq(moe_data_next_batch(d, in, tg, B, 0, B, T), MOE_OK, "%s", moe_last_error());
        int64_t chunk = 0;
        while (chunk < 7 && in[0] != shard_token(FROM + chunk * B * T)) chunk++;
        cr_assert(chunk < 7, "shuffled batch %d starts at no chunk of the part", b);
        expect_shard_batch(in, tg, FROM + chunk * B * T, B * T, b);
    }
    cr_assert_eq(moe_data_restrict(d, 100, 200), MOE_OK);
    cr_assert_eq(moe_data_token_count(d), 100);
    moe_data_set_shuffle(d, 0, 0);
    cr_assert_eq(moe_data_next_batch(d, in, tg, 1, 0, 1, T), MOE_OK, "%s", moe_last_error());
    cr_assert_eq(in[0], shard_token(FROM + 100), "a second narrowing is within the first");
    expect_error_names(moe_data_restrict(d, 0, 101), MOE_ERR_INVALID_ARG, pattern);
    expect_error_names(moe_data_restrict(d, 5, 5), MOE_ERR_INVALID_ARG, pattern);
    expect_error_names(moe_data_restrict(d, -1, 5), MOE_ERR_INVALID_ARG, pattern);
    moe_data_close(d);
    remove_dir(dir);
}

/* A valid one-shard stream of 100 tokens, then `corrupt` applied to it. */
static char *bad_shard(char *path, size_t size, void (*corrupt)(const char *path)) {
    char *dir = make_dir();
    path_in(path, size, dir, "bad_000.bin");
    int32_t tokens[100];
    for (int i = 0; i < 100; i++) tokens[i] = i;
    cr_assert_eq(moe_data_write_shard(path, tokens, 100, 2), MOE_OK, "%s", moe_last_error());
    corrupt(path);
    return dir;
}

/* Overwrites the low `bytes` bytes of value, little-endian, at offset. */
static void patch_le(const char *path, long offset, int32_t value, size_t bytes) {
    FILE *f = fopen(path, "r+b");
    cr_assert(f != NULL);
    unsigned char b[4] = {(unsigned char)value, (unsigned char)(value >> 8),
                          (unsigned char)(value >> 16), (unsigned char)(value >> 24)};
    fseek(f, offset, SEEK_SET);
    cr_assert(fwrite(b, 1, bytes, f) == bytes);
    fclose(f);
}

/* Shards of uint32 tokens (llm.c's Llama 3 format: magic 20240801,
 * version 7) hold ids past 65535, as Qwen's 151936-token vocabulary needs;
 * a glob may mix them with uint16 shards into one stream. Their header,
 * size and ids are checked as a uint16 shard's are. */
Test(data_shards, uint32_shards_hold_large_vocabularies) {
    enum { N16 = 300, N32 = 500, V = 151936 };
    char *dir = make_dir(), a[512], b[512], pattern[512];
    int32_t all[N16 + N32], largest = 0;
    for (int64_t i = 0; i < N16 + N32; i++) {
        all[i] = (int32_t)((i * 2654435761u) % (i < N16 ? 65536u : (unsigned)V));
        if (i >= N16 && all[i] > largest) largest = all[i];
    }
    cr_assert(largest > 65535, "the uint32 shard holds no id past uint16");
    path_in(a, sizeof a, dir, "mix_000.bin");
    path_in(b, sizeof b, dir, "mix_001.bin");
    cr_assert_eq(moe_data_write_shard(a, all, N16, 2), MOE_OK, "%s", moe_last_error());
    cr_assert_eq(moe_data_write_shard(b, all + N16, N32, 4), MOE_OK, "%s", moe_last_error());
    size_t n;
    unsigned char *raw = read_whole(b, &n);
    cr_assert_eq(n, 1024 + 4 * N32);
    cr_expect(le32(raw) == 20240801 && le32(raw + 4) == 7 && le32(raw + 8) == N32, "header %d %d %d", le32(raw),
              le32(raw + 4), le32(raw + 8));
    for (int i = 0; i < N32; i++) cr_assert_eq(le32(raw + 1024 + 4 * i), all[N16 + i], "token %d", i);
    free(raw);

    moe_data *d;
    path_in(pattern, sizeof pattern, dir, "mix_*.bin");
    cr_assert_eq(moe_data_open_shards(&d, pattern, V), MOE_OK, "%s", moe_last_error());
    cr_assert_eq(moe_data_token_count(d), N16 + N32);
    static int32_t in[N16 + N32 - 1], tg[N16 + N32 - 1];
    cr_assert_eq(moe_data_next_batch(d, in, tg, 1, 0, 1, N16 + N32 - 1), MOE_OK, "%s", moe_last_error());
    for (int i = 0; i < N16 + N32 - 1; i++) {
        cr_assert_eq(in[i], all[i], "input %d", i);
        cr_assert_eq(tg[i], all[i + 1], "target %d", i);
    }
    moe_data_close(d);
    /* An id at vocab_size is refused as it is read. */
    cr_assert_eq(moe_data_open_shards(&d, b, largest), MOE_OK, "%s", moe_last_error());
    expect_error_names(moe_data_next_batch(d, in, tg, 1, 0, 1, N32 - 1), MOE_ERR_FORMAT, b);
    char want[64];
    snprintf(want, sizeof want, "is %d, not below vocab_size %d", largest, largest);
    cr_expect(strstr(moe_last_error(), want) != NULL, "%s", moe_last_error());
    moe_data_close(d);

    /* A uint32 shard's version and size are its own. */
    patch_le(b, 4, 1, 4);
    expect_error_names(moe_data_open_shards(&d, b, V), MOE_ERR_FORMAT, b);
    cr_expect(strstr(moe_last_error(), "version 1, expected 7 (magic 20240801: uint32 tokens)"), "%s",
              moe_last_error());
    patch_le(b, 4, 7, 4);
    cr_assert(truncate(b, 1024 + 4 * N32 - 2) == 0);
    expect_error_names(moe_data_open_shards(&d, b, V), MOE_ERR_FORMAT, b);
    cr_expect(strstr(moe_last_error(), "truncated"), "%s", moe_last_error());
    /* The writer takes 2- and 4-byte tokens only, and no negative id. */
    const int32_t negative[2] = {5, -1};
    expect_error_names(moe_data_write_shard(b, all, 4, 3), MOE_ERR_INVALID_ARG, b);
    expect_error_names(moe_data_write_shard(b, negative, 2, 4), MOE_ERR_INVALID_ARG, b);
    cr_expect(strstr(moe_last_error(), "token 1 is -1, outside uint32"), "%s", moe_last_error());
    remove_dir(dir);
}

static void cut_body(const char *path) { cr_assert(truncate(path, 1024 + 2 * 99) == 0); }
static void cut_header(const char *path) { cr_assert(truncate(path, 600) == 0); }
static void bad_magic(const char *path) { patch_le(path, 0, 20240326, 4); }
static void bad_version(const char *path) { patch_le(path, 4, 7, 4); }
static void low_count(const char *path) { patch_le(path, 8, 90, 4); }
static void negative_count(const char *path) { patch_le(path, 8, -4, 4); }
static void big_token(const char *path) { patch_le(path, 1024 + 2 * 42, 60000, 2); }

static void expect_open_refused(void (*corrupt)(const char *path), moe_status want,
                                const char *detail) {
    char path[512];
    char *dir = bad_shard(path, sizeof path, corrupt);
    moe_data *d = (moe_data *)1;
    expect_error_names(moe_data_open_shards(&d, path, 1000), want, path);
    cr_assert(strstr(moe_last_error(), detail) != NULL, "error \"%s\" lacks \"%s\"",
              moe_last_error(), detail);
    cr_assert(d == NULL, "a refused open must leave no handle");
    remove_dir(dir);
}

Test(data_shards, truncated_body_refused) {
    expect_open_refused(cut_body, MOE_ERR_FORMAT, "truncated");
}
Test(data_shards, truncated_header_refused) {
    expect_open_refused(cut_header, MOE_ERR_FORMAT, "600 bytes");
}
Test(data_shards, bad_magic_refused) {
    expect_open_refused(bad_magic, MOE_ERR_FORMAT, "magic 20240326");
}
Test(data_shards, wrong_version_refused) {
    expect_open_refused(bad_version, MOE_ERR_FORMAT, "version 7");
}
Test(data_shards, count_mismatch_refused) {
    expect_open_refused(low_count, MOE_ERR_FORMAT, "90 tokens");
}
Test(data_shards, negative_count_refused) {
    expect_open_refused(negative_count, MOE_ERR_FORMAT, "-4");
}

Test(data_shards, token_at_or_above_vocab_refused_when_read) {
    char path[512];
    char *dir = bad_shard(path, sizeof path, big_token);
    moe_data *d;
    /* Token 42 is 60000: exactly vocab_size, one past the largest valid id. */
    cr_assert_eq(moe_data_open_shards(&d, path, 60000), MOE_OK, "%s", moe_last_error());
    int32_t in[40], tg[40];
    cr_assert_eq(moe_data_next_batch(d, in, tg, 2, 0, 2, 20), MOE_OK, "tokens 0..40 are fine");
    expect_error_names(moe_data_next_batch(d, in, tg, 2, 0, 2, 20), MOE_ERR_FORMAT, path);
    cr_assert(strstr(moe_last_error(), "the token at index 42 is 60000") != NULL, "%s", moe_last_error());
    cr_assert_eq(moe_data_get_position(d).token, 40, "a failed read must not move the position");
    moe_data_close(d);
    /* With a vocab that holds it, the same shard reads. */
    cr_assert_eq(moe_data_open_shards(&d, path, 60001), MOE_OK, "%s", moe_last_error());
    cr_assert_eq(moe_data_next_batch(d, in, tg, 1, 0, 1, 40), MOE_OK);
    cr_assert_eq(moe_data_next_batch(d, in, tg, 1, 0, 1, 40), MOE_OK, "%s", moe_last_error());
    cr_assert_eq(in[2], 60000);
    moe_data_close(d);
    remove_dir(dir);
}

Test(data_shards, empty_glob_and_empty_stream_refused) {
    char *dir = make_dir(), pattern[512], path[512];
    path_in(pattern, sizeof pattern, dir, "nothing_*.bin");
    moe_data *d;
    expect_error_names(moe_data_open_shards(&d, pattern, 100), MOE_ERR_IO, pattern);
    path_in(path, sizeof path, dir, "nothing_0.bin");
    cr_assert_eq(moe_data_write_shard(path, NULL, 0, 2), MOE_OK, "%s", moe_last_error());
    expect_error_names(moe_data_open_shards(&d, pattern, 100), MOE_ERR_FORMAT, pattern);
    remove_dir(dir);
}

Test(data_shards, writer_refuses_non_uint16_and_keeps_old_file) {
    char *dir = make_dir(), path[512];
    path_in(path, sizeof path, dir, "keep.bin");
    const int32_t good[3] = {1, 2, 3}, high[3] = {1, 65536, 3}, low[3] = {-1, 2, 3};
    cr_assert_eq(moe_data_write_shard(path, good, 3, 2), MOE_OK, "%s", moe_last_error());
    size_t n0, n1;
    unsigned char *before = read_whole(path, &n0);
    expect_error_names(moe_data_write_shard(path, high, 3, 2), MOE_ERR_INVALID_ARG, path);
    cr_assert(strstr(moe_last_error(), "65536") != NULL, "%s", moe_last_error());
    expect_error_names(moe_data_write_shard(path, low, 3, 2), MOE_ERR_INVALID_ARG, path);
    unsigned char *after = read_whole(path, &n1);
    cr_assert(n0 == n1 && memcmp(before, after, n0) == 0, "a refused write changed the file");
    free(before);
    free(after);
    remove_dir(dir);
}
