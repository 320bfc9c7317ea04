/* checkpoint.h: a training checkpoint is a directory OUT/step-NNNNNN/ (six
 * digits) holding
 *   model.safetensors        the weights, F32, Hugging Face Mixtral names
 *   config.json              the model config (model_config.h)
 *   train_state.safetensors  AdamW moments, step, RNG and data position
 * A checkpoint directory appears whole or not at all: it is written under a
 * temporary name, every file fsynced, then renamed into place, so a failure
 * mid-write leaves every earlier checkpoint as it was. */
#ifndef MOE_ENGINE_CHECKPOINT_H
#define MOE_ENGINE_CHECKPOINT_H

#include <stddef.h>
#include <stdint.h>

#include "engine/data.h"
#include "engine/model.h"
#include "engine/model_config.h"
#include "engine/trainer.h"
#include "moe.h"

/* What a run needs besides the tensors to continue exactly where it left. */
typedef struct moe_train_state {
    int64_t step;                /* optimizer steps done */
    uint64_t seed;               /* the run's --seed */
    uint64_t jitter_counter;     /* moe_model_jitter_counter */
    moe_data_position data;      /* of the training data */
} moe_train_state;

/* Writes OUT/step-NNNNNN for state->step (six digits, more from 10^6 on),
 * creating OUT as needed, and puts its path in path [path_bytes].
 * state->step must equal the trainer's steps done. model.safetensors holds
 * every model tensor in the model's order (norms 1-D) and, when the
 * selection bias is on, model.layers.N.block_sparse_moe.gate.
 * e_score_correction_bias [E]; train_state.safetensors holds
 * optimizer.exp_avg.<name> and optimizer.exp_avg_sq.<name> for every model
 * tensor (named per tensor, so the state can be re-sharded by name) and the
 * __metadata__ strings format_version "1", step, seed, jitter_counter,
 * data_token and data_epoch.
 *
 * The files go to OUT/.step-NNNNNN.tmp-<pid>, which is renamed into place
 * once all of them are fsynced. A checkpoint of the same step already there
 * is first moved to OUT/.step-NNNNNN.old-<pid> and removed only after the
 * new one is in place and OUT is fsynced. Either leftover of a dead process
 * with our pid is cleaned up first (a set-aside copy whose replacement never
 * arrived is moved back). On failure the temp directory is removed and
 * every existing checkpoint is left as it was. */
moe_status moe_checkpoint_save(char *path, size_t path_bytes, const char *out_dir, moe_model *model,
                               moe_trainer *trainer, const moe_train_state *state);

/* Loads weights into model from dir: dir/model.safetensors, or the shards of
 * dir/model.safetensors.index.json. Accepts F32, BF16 and F16, the
 * per-expert layout (block_sparse_moe.experts.E.w1/w2/w3) and the fused one
 * of recent transformers (mlp.experts.gate_up_proj [E, 2ff, d], w1's rows
 * first, and mlp.experts.down_proj [E, d, ff], with mlp.gate.weight), tensor
 * by tensor, the own name looked for first. Every tensor of the model must be
 * found with the right shape; a tensor the model does not have is an error
 * (a checkpoint of another model), except optimizer.* ones.
 * The selection bias e_score_correction_bias [E] is read when the model has
 * it on, and is zero when the file lacks it; a model with it off ignores the
 * file's (it only steers which experts are chosen, never the weights they
 * are mixed with, and a run may turn balancing off when fine-tuning).
 * Errors name the file and the tensor; on error the model is unchanged. */
moe_status moe_checkpoint_load_weights(moe_model *model, const char *dir);

/* Loads AdamW moments and the state written by moe_checkpoint_save from
 * dir/train_state.safetensors: sets the trainer's steps done, its moments,
 * the model's jitter counter, and *state (the caller moves its data source
 * to state->data). Every optimizer tensor must be there with its model
 * tensor's shape and no other tensor may be; the metadata integers must be
 * plain decimal digits in range. Errors name the file and the tensor or
 * key; on error nothing is changed. */
moe_status moe_checkpoint_load_state(moe_trainer *trainer, moe_model *model, moe_train_state *state,
                                     const char *dir);

/* Reads dir/config.json (model_config.h's rules). */
moe_status moe_checkpoint_load_config(moe_model_config *cfg, const char *dir, moe_warn_fn warn, void *warn_ctx);

#endif /* MOE_ENGINE_CHECKPOINT_H */
