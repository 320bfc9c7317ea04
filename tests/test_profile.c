/* test_profile.c: the profiled op table (kernels/profile.h) over the CPU
 * ops: which op each interval goes to, the counts, pause, reset, and a run
 * longer than the marks. Timing claims are ratios of at least 20x between
 * a 2 * 384^3 GEMM and a copy of one float, which no noisy machine closes. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"
#include "kernels/profile.h"

#define GEMM_N 384

static const moe_ops *profiled;
static float *a, *b, *c, *x;

static void setup(void) {
    cr_assert(moe_profile_open(&profiled, moe_cpu_ops()) == MOE_OK, "%s", moe_last_error());
    a = calloc(GEMM_N * GEMM_N, sizeof *a);
    b = calloc(GEMM_N * GEMM_N, sizeof *b);
    c = calloc(GEMM_N * GEMM_N, sizeof *c);
    x = calloc(2, sizeof *x);
    cr_assert(a && b && c && x);
    for (int64_t i = 0; i < GEMM_N * GEMM_N; i++) a[i] = b[i] = 1e-3f * (float)(i % 97);
}

static void teardown(void) {
    moe_profile_close();
    free(a), free(b), free(c), free(x);
}

static void big_gemm(void) {
    profiled->gemm(c, a, b, GEMM_N, GEMM_N, GEMM_N, GEMM_N, GEMM_N, GEMM_N, false, false, 1.0f, 0.0f);
}

/* One float copied: no threads to wake, unlike the CPU's OpenMP ops. */
static void tiny_op(void) { profiled->copy(x, x + 1, sizeof *x); }

/* The row of op in rows [n], or NULL. */
static const moe_op_time *row_of(const moe_op_time *rows, int64_t n, const char *op) {
    for (int64_t i = 0; i < n; i++)
        if (strcmp(rows[i].op, op) == 0) return &rows[i];
    return NULL;
}

static int64_t read_rows(moe_op_time *rows, int64_t capacity) {
    int64_t n = -1;
    cr_assert(moe_profile_read(rows, capacity, &n) == MOE_OK, "%s", moe_last_error());
    return n;
}

TestSuite(profile, .init = setup, .fini = teardown);

/* An interval belongs to the op that began it: the GEMM's time is the
 * GEMM's, not that of the op before or after it. */
Test(profile, each_interval_goes_to_the_op_that_began_it) {
    for (int rep = 0; rep < 3; rep++) {
        tiny_op();
        big_gemm();
        tiny_op();
    }
    float host[1];
    cr_assert(profiled->upload(x, host, sizeof host) == MOE_OK);
    cr_assert(profiled->sync() == MOE_OK);
    moe_op_time rows[8];
    const int64_t n = read_rows(rows, 8);
    cr_assert(n == 3, "%lld ops listed, want gemm, copy and upload", (long long)n);
    cr_expect(strcmp(rows[0].op, "gemm") == 0, "largest time is %s's", rows[0].op);
    const moe_op_time *gemm = row_of(rows, n, "gemm"), *copy = row_of(rows, n, "copy");
    const moe_op_time *upload = row_of(rows, n, "upload");
    cr_assert(gemm && copy && upload, "gemm, copy and upload must be listed");
    cr_expect(gemm->calls == 3 && copy->calls == 6 && upload->calls == 1, "calls: gemm %lld, copy %lld, upload %lld",
              (long long)gemm->calls, (long long)copy->calls, (long long)upload->calls);
    cr_expect(gemm->seconds > 20.0 * copy->seconds, "gemm %.3g s, copy %.3g s", gemm->seconds, copy->seconds);
    cr_expect(copy->seconds >= 0.0 && upload->seconds >= 0.0);
}

/* Ops count once a wait has passed them; a download is a wait. */
Test(profile, ops_count_from_the_next_wait) {
    big_gemm();
    moe_op_time rows[4];
    cr_expect(read_rows(rows, 4) == 0, "an op before any wait is listed");
    float host[1];
    cr_assert(profiled->download(host, x, sizeof host) == MOE_OK);
    cr_expect(read_rows(rows, 4) == 1 && rows[0].calls == 1 && strcmp(rows[0].op, "gemm") == 0,
              "after a download: the gemm, once");
}

/* A pause takes its ops out, and ends the time of the op before it: the
 * tiny op before a paused GEMM does not get the GEMM's time. */
Test(profile, paused_ops_are_nobodys) {
    tiny_op();
    moe_profile_pause(true);
    big_gemm();
    big_gemm();
    moe_profile_pause(false);
    tiny_op();
    cr_assert(profiled->sync() == MOE_OK);
    moe_op_time rows[4];
    const int64_t n = read_rows(rows, 4);
    cr_assert(n == 1 && strcmp(rows[0].op, "copy") == 0 && rows[0].calls == 2, "want only copy, twice");
    /* Two GEMMs of about a millisecond or more each went to nobody. */
    big_gemm();
    cr_assert(profiled->sync() == MOE_OK);
    const int64_t m = read_rows(rows, 4);
    const moe_op_time *gemm = row_of(rows, m, "gemm"), *copy = row_of(rows, m, "copy");
    cr_assert(gemm && copy);
    cr_expect(gemm->seconds > 20.0 * copy->seconds, "copy %.3g s holds paused time (gemm %.3g s)", copy->seconds,
              gemm->seconds);
}

Test(profile, reset_forgets_sums_and_pending_ops) {
    big_gemm();
    cr_assert(profiled->sync() == MOE_OK);
    tiny_op(); /* pending at the reset */
    moe_profile_reset();
    cr_assert(profiled->sync() == MOE_OK);
    moe_op_time rows[4];
    cr_expect(read_rows(rows, 4) == 0, "sums or pending ops survive a reset");
    tiny_op();
    cr_assert(profiled->sync() == MOE_OK);
    cr_expect(read_rows(rows, 4) == 1 && rows[0].calls == 1, "after the reset: one copy");
}

/* More ops than marks between two waits: every call still counts. */
Test(profile, a_run_longer_than_the_marks) {
    const int64_t n_ops = 2 * MOE_PROFILE_MARKS + 7;
    for (int64_t i = 0; i < n_ops; i++) tiny_op();
    cr_assert(profiled->sync() == MOE_OK);
    moe_op_time rows[2];
    cr_expect(read_rows(rows, 2) == 1 && rows[0].calls == n_ops, "copy calls %lld, want %lld",
              (long long)rows[0].calls, (long long)n_ops);
}

/* rows gets at most capacity entries, the largest first. */
Test(profile, rows_are_capped_largest_first) {
    tiny_op();
    big_gemm();
    cr_assert(profiled->sync() == MOE_OK);
    moe_op_time rows[1];
    cr_expect(read_rows(rows, 1) == 1 && strcmp(rows[0].op, "gemm") == 0);
    cr_expect(moe_profile_op_count() > 30, "every queued op and upload: %lld", (long long)moe_profile_op_count());
}

/* A backend whose sync fails while sync_fails is set: the profile must
 * hand that failure to the caller, whichever sync meets it. */
static bool sync_fails;
static int failing_syncs;

static moe_status failing_sync(void) {
    if (!sync_fails) return MOE_OK;
    failing_syncs++;
    return moe_error(MOE_ERR_INTERNAL, "device fault %d", failing_syncs);
}

static const moe_ops *failing_backend(void) {
    static moe_ops t;
    t = *moe_cpu_ops();
    t.sync = failing_sync;
    return &t;
}

/* The profile's own sync (a run longer than its marks) meets a failure: it
 * is the caller's, reported at its next wait with its own message. */
Test(profile, a_failure_met_by_the_profiles_own_sync_reaches_the_caller) {
    cr_assert(moe_profile_open(&profiled, failing_backend()) == MOE_OK, "%s", moe_last_error());
    sync_fails = true, failing_syncs = 0;
    for (int64_t i = 0; i < MOE_PROFILE_MARKS; i++) tiny_op();
    sync_fails = false;
    cr_assert(failing_syncs == 1, "the profile's own sync ran %d times", failing_syncs);
    cr_expect(profiled->sync() == MOE_ERR_INTERNAL, "the caller's sync hides the failure");
    cr_expect(strstr(moe_last_error(), "device fault 1") != NULL, "message: %s", moe_last_error());
    cr_expect(profiled->sync() == MOE_OK, "the failure is reported once: %s", moe_last_error());
}

/* After a failed wait its marks are dropped, not read: a device may never
 * have stamped them. The ops after it count as usual. */
Test(profile, marks_before_a_failed_wait_are_dropped) {
    cr_assert(moe_profile_open(&profiled, failing_backend()) == MOE_OK, "%s", moe_last_error());
    big_gemm();
    sync_fails = true;
    cr_expect(profiled->sync() == MOE_ERR_INTERNAL);
    sync_fails = false;
    moe_op_time rows[4];
    cr_expect(read_rows(rows, 4) == 0, "ops before a failed wait are listed");
    tiny_op();
    cr_assert(profiled->sync() == MOE_OK);
    cr_expect(read_rows(rows, 4) == 1 && rows[0].calls == 1 && strcmp(rows[0].op, "copy") == 0);
}
