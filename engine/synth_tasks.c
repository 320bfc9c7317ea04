/* synth_tasks.c: greedy sums and copies on the synthetic corpus (see
 * synth_tasks.h). */
#include "engine/synth_tasks.h"

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"
#include "engine/generate.h"

/* The answer after stream position i, when token i ends a prompt of task:
 * its length g (0 when i ends none, or its example cannot fit a row of T). */
static int64_t answer_length(const moe_synth_stream *s, int64_t i, moe_synth_task task, int64_t T) {
    const int32_t *tok = s->tokens;
    int64_t g = 0;
    if (task == MOE_SYNTH_TASK_SUM) {
        if (tok[i] != MOE_SYNTH_TOK_EQUALS) return 0;
        g = 2;
        if (T - g < 4) return 0; /* the prompt would not hold "a+b=" */
    } else {
        if (tok[i] != MOE_SYNTH_TOK_MARK) return 0;
        /* The letters back to the copy's BOS are its source. */
        int64_t j = i - 1;
        while (j >= 0 && tok[j] != MOE_SYNTH_TOK_BOS + MOE_SYNTH_COPY) j--;
        if (j < 0) return 0; /* the stream starts inside this copy */
        g = i - j - 1;
        if (i - j >= T - g) return 0; /* the BOS and the source would not fit before the answer */
    }
    if (i + g >= s->n || i + 1 < T - g) return 0; /* the answer or the prompt runs past the stream */
    return g;
}

moe_status moe_synth_tasks_solve(moe_synth_task_score *score, moe_model *model, const moe_synth_stream *stream,
                                 int64_t max_examples) {
    if (!score || !model || !stream || max_examples < 0)
        return moe_error(MOE_ERR_INVALID_ARG, "moe_synth_tasks_solve: NULL argument or max_examples %lld",
                         (long long)max_examples);
    memset(score, 0, sizeof *score);
    const int64_t B = moe_model_batch_size(model), T = moe_model_seq_len(model);
    int32_t *rows = malloc((size_t)(B * T) * sizeof *rows);
    int64_t *len = malloc((size_t)B * sizeof *len), *end = malloc((size_t)B * sizeof *end);
    int64_t *first = malloc((size_t)B * sizeof *first); /* each row's first token in the stream */
    moe_status st = MOE_OK;
    if (!rows || !len || !end || !first)
        st = moe_error(MOE_ERR_OUT_OF_MEMORY, "synthetic tasks: a batch of %lld x %lld tokens", (long long)B,
                       (long long)T);
    const moe_sampling greedy = {0};
    for (int task = 0; task < MOE_SYNTH_TASK_COUNT && st == MOE_OK; task++) {
        int64_t next = 0; /* where the search for examples goes on */
        while (st == MOE_OK && score->tried[task] < max_examples) {
            int64_t n = 0;
            for (; n < B && score->tried[task] + n < max_examples && next < stream->n; next++) {
                const int64_t g = answer_length(stream, next, (moe_synth_task)task, T);
                if (g == 0) continue;
                first[n] = next + 1 - (T - g);
                memcpy(rows + n * T, stream->tokens + first[n], (size_t)(T - g) * sizeof *rows);
                len[n] = T - g;
                end[n++] = T;
            }
            if (n == 0) break; /* the stream holds no more */
            for (int64_t b = n; b < B; b++) { /* idle rows */
                len[b] = end[b] = 1;
                rows[b * T] = 0;
            }
            st = moe_generate(model, rows, len, end, NULL, 0, &greedy);
            /* Each row grew to T tokens: solved when it is the stream's
             * row, the prompt it was given and the answer after it. */
            for (int64_t b = 0; b < n && st == MOE_OK; b++)
                score->solved[task] += memcmp(rows + b * T, stream->tokens + first[b], (size_t)T * sizeof *rows) == 0;
            score->tried[task] += n;
        }
    }
    free(rows);
    free(len);
    free(end);
    free(first);
    return st;
}
