/* mc_eval.h: multiple-choice evaluation on llm.c's eval files (HellaSwag,
 * MMLU, as its dev/data scripts write them): each example is a context and
 * its completions, and the model's choice is the completion of least mean
 * loss over its own tokens, each predicted after the context and the
 * completion's tokens before it (llm.c's acc_norm).
 *
 * The file: a header of 256 little-endian int32 (magic 20240522, version 1,
 * the example count, the longest example's bytes), then every example as
 * little-endian uint16: 65535, the example's bytes (these first three
 * fields included), its index (0, 1, ... in order), its label (the right
 * completion), its completion count, the context's length and tokens, then
 * each completion's length and tokens.
 *
 * Rows follow llm.c's: a completion's row holds the context then the
 * completion (at most the model's T tokens), the targets only at the
 * positions that predict the completion's tokens. */
#ifndef MOE_ENGINE_MC_EVAL_H
#define MOE_ENGINE_MC_EVAL_H

#include <stdint.h>

#include "engine/model.h"
#include "engine/trainer.h"
#include "moe.h"

#define MOE_MC_EVAL_MAGIC 20240522
#define MOE_MC_EVAL_VERSION 1
#define MOE_MC_EVAL_HEADER_BYTES 1024

typedef struct moe_mc_eval moe_mc_eval;

/* Reads and checks path whole: the header, every example's fields, ids
 * below vocab_size, rows of at most seq_len tokens, examples of at most
 * rows completions (a batch holds an example whole), and no byte past the
 * last example. Errors name path, the example and the fault. */
moe_status moe_mc_eval_open(moe_mc_eval **mc, const char *path, int64_t vocab_size, int64_t seq_len, int64_t rows);

void moe_mc_eval_close(moe_mc_eval *mc);

int64_t moe_mc_eval_count(const moe_mc_eval *mc);

/* The forwards examples [first, end) take in batches of `rows` rows, each
 * batch holding whole examples. */
int64_t moe_mc_eval_batches(const moe_mc_eval *mc, int64_t first, int64_t end, int64_t rows);

/* Scores examples [first, end) on the trainer's model in n_batches
 * forwards (moe_trainer_forward_batches; at least moe_mc_eval_batches of
 * them: the ranks of an expert-parallel group, and a pipeline's stages,
 * run the same number, the extra ones empty) and adds the examples it
 * chose right to *correct, on a pipeline's last stage (the others add
 * none). The model is left in training mode. Collective over the grid. */
moe_status moe_mc_eval_run(const moe_mc_eval *mc, moe_trainer *trainer, int64_t first, int64_t end, int64_t n_batches,
                           int64_t *correct);

#endif /* MOE_ENGINE_MC_EVAL_H */
