/* synth_tasks.h: what a model trained on the synthetic corpus can do, beyond
 * its loss: given the text before an answer the corpus fully determines,
 * does greedy generation write that answer?
 *
 *  sums    the two digits after "a+b=";
 *  copies  the letters after '>', which repeat the letters before it.
 *
 * Examples come from a stream (the validation stream) in order from its
 * start. Each is a row of the model's batch: the T - g tokens that end with
 * the '=' or the '>', then g tokens to generate (2 for a sum, the copy's
 * length for a copy; a sum whose "a+b=" or a copy whose source does not
 * fit before the answer in such a row is passed over). An example counts as solved when every
 * generated token is right. */
#ifndef MOE_ENGINE_SYNTH_TASKS_H
#define MOE_ENGINE_SYNTH_TASKS_H

#include <stdint.h>

#include "engine/model.h"
#include "engine/synthetic.h"
#include "moe.h"

typedef enum moe_synth_task { MOE_SYNTH_TASK_SUM = 0, MOE_SYNTH_TASK_COPY, MOE_SYNTH_TASK_COUNT } moe_synth_task;

typedef struct moe_synth_task_score {
    int64_t tried[MOE_SYNTH_TASK_COUNT];
    int64_t solved[MOE_SYNTH_TASK_COUNT];
} moe_synth_task_score;

/* Up to max_examples of each task from stream, solved greedily in batches
 * of the model's B rows (moe_generate: one rank, dropless routing). */
moe_status moe_synth_tasks_solve(moe_synth_task_score *score, moe_model *model, const moe_synth_stream *stream,
                                 int64_t max_examples);

#endif /* MOE_ENGINE_SYNTH_TASKS_H */
