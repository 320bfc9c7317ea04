/* mc_eval.c: multiple-choice evaluation on llm.c's eval files (mc_eval.h). */
#include "engine/mc_eval.h"

#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"
#include "engine/fileio.h"

/* The start of every example; its fields count in uint16s. */
#define START_EXAMPLE 65535
/* Larger than any published eval file (HellaSwag's validation set is 3.6 MB). */
#define MC_EVAL_MAX_BYTES ((size_t)1 << 30)

struct moe_mc_eval {
    unsigned char *data; /* the whole file */
    int64_t count;
    size_t *at; /* [count] where each example's label field is */
};

static unsigned u16(const unsigned char *data, size_t at) { return data[at] | (unsigned)data[at + 1] << 8; }

/* One example's fields from at (its label) to end, checked: ids below
 * vocab_size, each row context + completion at most seq_len tokens, at
 * most rows completions. */
static moe_status check_example(const unsigned char *d, size_t at, size_t end, int64_t i, const char *path,
                                int64_t vocab_size, int64_t seq_len, int64_t rows) {
    if (at + 6 > end)
        return moe_error(MOE_ERR_FORMAT, "%s: example %lld ends before its label, completion count and context",
                         path, (long long)i);
    const unsigned label = u16(d, at), n = u16(d, at + 2);
    if (n < 1 || label >= n)
        return moe_error(MOE_ERR_FORMAT, "%s: example %lld has label %u of %u completions", path, (long long)i, label,
                         n);
    if ((int64_t)n > rows)
        return moe_error(MOE_ERR_CONFIG, "%s: example %lld has %u completions, and a batch of --batch-size %lld rows "
                                         "holds an example's rows together",
                         path, (long long)i, n, (long long)rows);
    size_t p = at + 4;
    unsigned context = 0;
    for (unsigned part = 0; part <= n; part++) { /* the context, then each completion */
        if (p + 2 > end)
            return moe_error(MOE_ERR_FORMAT, "%s: example %lld ends before its %s's length", path, (long long)i,
                             part ? "completion" : "context");
        const unsigned len = u16(d, p);
        p += 2;
        if (len < 1 || p + 2 * (size_t)len > end)
            return moe_error(MOE_ERR_FORMAT, "%s: example %lld: %s %u has %u tokens, %s", path, (long long)i,
                             part ? "completion" : "context", part ? part - 1 : 0, len,
                             len < 1 ? "none" : "past the example's end");
        if (part == 0) context = len;
        if (part > 0 && (int64_t)context + len > seq_len)
            return moe_error(MOE_ERR_CONFIG, "%s: example %lld: context and completion %u take %u tokens, more than "
                                             "--seq-len %lld",
                             path, (long long)i, part - 1, context + len, (long long)seq_len);
        for (unsigned t = 0; t < len; t++, p += 2)
            if ((int64_t)u16(d, p) >= vocab_size)
                return moe_error(MOE_ERR_FORMAT, "%s: example %lld holds token %u, outside the vocabulary of %lld",
                                 path, (long long)i, u16(d, p), (long long)vocab_size);
    }
    if (p != end)
        return moe_error(MOE_ERR_FORMAT, "%s: example %lld says it takes %zu bytes, and its fields take %zu", path,
                         (long long)i, end - at + 6, p - at + 6);
    return MOE_OK;
}

static moe_status check_file(moe_mc_eval *mc, size_t size, const char *path, int64_t vocab_size, int64_t seq_len,
                             int64_t rows) {
    const unsigned char *d = mc->data;
    if (size < MOE_MC_EVAL_HEADER_BYTES)
        return moe_error(MOE_ERR_FORMAT, "%s: %zu bytes, shorter than the %d-byte header (truncated?)", path, size,
                         MOE_MC_EVAL_HEADER_BYTES);
    const int32_t magic = (int32_t)moe_get_le32(d), version = (int32_t)moe_get_le32(d + 4);
    const int32_t count = (int32_t)moe_get_le32(d + 8), longest = (int32_t)moe_get_le32(d + 12);
    if (magic != MOE_MC_EVAL_MAGIC)
        return moe_error(MOE_ERR_FORMAT, "%s: magic %d, expected %d (an llm.c eval file, such as hellaswag_val.bin)",
                         path, magic, MOE_MC_EVAL_MAGIC);
    if (version != MOE_MC_EVAL_VERSION)
        return moe_error(MOE_ERR_FORMAT, "%s: version %d, expected %d", path, version, MOE_MC_EVAL_VERSION);
    if (count < 1 || count > START_EXAMPLE)
        return moe_error(MOE_ERR_FORMAT, "%s: the header says %d examples, expected 1 to %d", path, count,
                         START_EXAMPLE);
    if (!(mc->at = malloc((size_t)count * sizeof *mc->at)))
        return moe_error(MOE_ERR_OUT_OF_MEMORY, "%s: %d examples", path, count);
    size_t off = MOE_MC_EVAL_HEADER_BYTES, most = 0;
    for (int64_t i = 0; i < count; i++) {
        if (off + 6 > size)
            return moe_error(MOE_ERR_FORMAT, "%s: the file ends at example %lld of %d (offset %zu; truncated?)", path,
                             (long long)i, count, off);
        const unsigned start = u16(d, off), bytes = u16(d, off + 2), index = u16(d, off + 4);
        if (start != START_EXAMPLE)
            return moe_error(MOE_ERR_FORMAT, "%s: example %lld (offset %zu) begins with %u, not the delimiter %d",
                             path, (long long)i, off, start, START_EXAMPLE);
        if (index != (unsigned)i)
            return moe_error(MOE_ERR_FORMAT, "%s: example %lld (offset %zu) says it is example %u", path,
                             (long long)i, off, index);
        if (bytes % 2 || bytes < 6 || off + bytes > size)
            return moe_error(MOE_ERR_FORMAT, "%s: example %lld (offset %zu) says it takes %u bytes, %s", path,
                             (long long)i, off, bytes, bytes % 2 || bytes < 6 ? "no whole example" : "past the end");
        MOE_TRY(check_example(d, off + 6, off + bytes, i, path, vocab_size, seq_len, rows));
        mc->at[i] = off + 6;
        most = bytes > most ? bytes : most;
        off += bytes;
    }
    if (off != size)
        return moe_error(MOE_ERR_FORMAT, "%s: %zu bytes after the last of the %d examples (offset %zu)", path,
                         size - off, count, off);
    if ((size_t)longest != most)
        return moe_error(MOE_ERR_FORMAT, "%s: the header says the longest example takes %d bytes, and it takes %zu",
                         path, longest, most);
    mc->count = count;
    return MOE_OK;
}

moe_status moe_mc_eval_open(moe_mc_eval **out, const char *path, int64_t vocab_size, int64_t seq_len, int64_t rows) {
    if (!out || !path) return moe_error(MOE_ERR_INVALID_ARG, "moe_mc_eval_open: NULL argument");
    *out = NULL;
    moe_mc_eval *mc = calloc(1, sizeof *mc);
    if (!mc) return moe_error(MOE_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
    char *data = NULL;
    size_t size = 0;
    moe_status st = moe_file_read_all(&data, &size, path, MC_EVAL_MAX_BYTES);
    mc->data = (unsigned char *)data;
    if (st == MOE_OK) st = check_file(mc, size, path, vocab_size, seq_len, rows);
    if (st != MOE_OK) {
        moe_mc_eval_close(mc);
        return st;
    }
    *out = mc;
    return MOE_OK;
}

void moe_mc_eval_close(moe_mc_eval *mc) {
    if (!mc) return;
    free(mc->data);
    free(mc->at);
    free(mc);
}

int64_t moe_mc_eval_count(const moe_mc_eval *mc) { return mc->count; }

static unsigned completions(const moe_mc_eval *mc, int64_t i) { return u16(mc->data, mc->at[i] + 2); }

int64_t moe_mc_eval_batches(const moe_mc_eval *mc, int64_t first, int64_t end, int64_t rows) {
    int64_t batches = 0;
    for (int64_t i = first, used = rows; i < end; i++) {
        if (used + completions(mc, i) > rows) batches++, used = 0;
        used += completions(mc, i);
    }
    return batches;
}

/* Example i's rows from row r of inputs and targets [rows, T]. */
static void place(const moe_mc_eval *mc, int64_t i, int32_t *inputs, int32_t *targets, int64_t r, int64_t T) {
    const unsigned char *d = mc->data;
    size_t p = mc->at[i] + 4;
    const unsigned n = u16(d, p - 2), context = u16(d, p);
    const size_t ctx_at = p + 2;
    p = ctx_at + 2 * (size_t)context;
    for (unsigned c = 0; c < n; c++, r++) {
        const unsigned len = u16(d, p);
        p += 2;
        for (unsigned t = 0; t < context; t++) inputs[r * T + t] = (int32_t)u16(d, ctx_at + 2 * t);
        for (unsigned t = 0; t < len; t++, p += 2) {
            inputs[r * T + context + t] = (int32_t)u16(d, p);
            targets[r * T + context + t - 1] = (int32_t)u16(d, p); /* predicted by the token before it */
        }
    }
}

/* Whether example i, from row r, chose its label: the completion of least
 * mean loss over its tokens, the first of equal ones; equal within
 * TIE_RTOL, as two rows of the same tokens differ in their last bits by
 * where in the batch they sit (by 3e-6 at most in the tests, with
 * OpenBLAS's Haswell kernels; 1e-6 with its SkylakeX ones). */
#define TIE_RTOL 1e-5
static bool chose_right(const moe_mc_eval *mc, int64_t i, const float *losses, int64_t r, int64_t T) {
    const unsigned char *d = mc->data;
    size_t p = mc->at[i];
    const unsigned label = u16(d, p), n = u16(d, p + 2), context = u16(d, p + 4);
    p += 6 + 2 * (size_t)context;
    double best = 0.0;
    unsigned choice = 0;
    for (unsigned c = 0; c < n; c++, r++) {
        const unsigned len = u16(d, p);
        p += 2 + 2 * (size_t)len;
        double sum = 0.0;
        for (unsigned t = 0; t < len; t++) sum += losses[r * T + context + t - 1];
        const double mean = sum / len;
        if (c == 0 || mean < best - TIE_RTOL * fabs(best)) best = mean, choice = c;
    }
    return choice == label;
}

/* Where a moe_mc_eval_run stands: its examples up to end, the batch's
 * [batch_first, next). */
typedef struct mc_run {
    const moe_mc_eval *mc;
    int64_t end, batch_first, next, rows, T;
    int64_t *correct;
} mc_run;

/* The examples that fit the batch's rows whole, in order. A batch with no
 * example still runs: the expert-parallel group's exchanges and the
 * pipeline's stages need every rank. */
static moe_status fill_examples(void *ctx, int64_t batch, int32_t *inputs, int32_t *targets) {
    mc_run *r = ctx;
    (void)batch;
    memset(inputs, 0, (size_t)(r->rows * r->T) * sizeof *inputs);
    for (int64_t j = 0; j < r->rows * r->T; j++) targets[j] = -1;
    r->batch_first = r->next;
    for (int64_t used = 0; r->next < r->end && used + completions(r->mc, r->next) <= r->rows; r->next++) {
        place(r->mc, r->next, inputs, targets, used, r->T);
        used += completions(r->mc, r->next);
    }
    return MOE_OK;
}

/* The last stage holds the batch's losses; the others count nothing. */
static moe_status score_examples(void *ctx, moe_model *model, const int32_t *targets, int64_t batch) {
    mc_run *r = ctx;
    (void)targets, (void)batch;
    if (!moe_model_get_stage(model).last) return MOE_OK;
    for (int64_t i = r->batch_first, row = 0; i < r->next; row += completions(r->mc, i), i++)
        *r->correct += chose_right(r->mc, i, moe_model_last_losses(model), row, r->T);
    return MOE_OK;
}

moe_status moe_mc_eval_run(const moe_mc_eval *mc, moe_trainer *trainer, int64_t first, int64_t end, int64_t n_batches,
                           int64_t *correct) {
    const moe_model *model = moe_trainer_model(trainer);
    mc_run r = {.mc = mc, .end = end, .next = first, .rows = moe_model_batch_size(model),
                .T = moe_model_seq_len(model), .correct = correct};
    MOE_TRY(moe_trainer_forward_batches(trainer, n_batches, fill_examples, score_examples, &r));
    if (r.next < end)
        return moe_error(MOE_ERR_INTERNAL, "multiple-choice evaluation: %lld batches hold examples %lld..%lld only",
                         (long long)n_batches, (long long)first, (long long)r.next);
    return MOE_OK;
}
