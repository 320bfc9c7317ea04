/* checkpoint.h: a training checkpoint is a directory OUT/step-NNNNNN/ (six
 * digits) holding
 *   model.safetensors        the weights, F32, Hugging Face Mixtral names
 *   config.json              the model config (model_config.h)
 *   train_state.safetensors  AdamW moments, step, RNG and data position
 * A checkpoint directory appears whole or not at all: it is written under a
 * temporary name, every file fsynced, then renamed into place, so a failure
 * mid-write leaves every earlier checkpoint as it was.
 *
 * On a grid of ranks (a model made by moe_model_create_parallel) save and
 * both loads are collective over the model's job (moe_model_job: every
 * rank of the grid, every pipeline stage and data-parallel rank), and a
 * checkpoint is one rank's checkpoint: written under any grid (expert
 * parallelism, ZeRO, pipeline stages, any rank count), it loads under any
 * other, and files of the other tools load on a grid. Writing gathers: rank
 * 0 of the job makes the one-rank model (moe_model_create) and its two full
 * moments, receives every value straight into place from the one rank that
 * sends it (a run's parameters from the first rank of its group, so each
 * stage's dense run from its data-parallel rank 0 and each expert from its
 * EP rank in the stage's first EP group; the moments from the rank whose
 * ZeRO block holds them, or from the first of the group when they are not
 * sharded; each layer's selection bias from data-parallel rank 0 of the
 * stage that holds the layer), checks that every value arrived once, and
 * writes the files a one-rank run writes, with the same atomic swap. The
 * stages' tensors fit together because every tensor is sent under its
 * index in the one-rank table. Reading goes by name: every rank reads the
 * one checkpoint and takes its own tensors, experts, biases and block of
 * the moments; the files hold the other ranks' experts and the other
 * stages' layers, embedding, final norm and head too, which each stage
 * leaves to the stage that holds them (and which checks them).
 * The price: during a save rank 0 holds the whole one-rank model twice
 * (parameters and gradients) and its two moments; every rank must see the
 * directory (a shared file system across nodes). In exchange the format,
 * the atomicity and every reader stay those of one rank, and re-sharding is
 * free on load. A failure on any rank fails the call on every rank: the
 * ranks agree, before returning, on the status and message of the lowest
 * failing rank (named in the others' message), so none goes on alone into
 * a collective; a load that fails on any rank changes nothing on any. */
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
    /* Which stream that position is in, so that a resume reads the same
     * one: its length in tokens (0: not recorded, a checkpoint from before
     * these fields), and the tokens of each shuffled chunk (0: read in
     * order). A shuffled epoch's order depends on both (data.h). */
    int64_t data_tokens;
    int64_t data_chunk;
    /* The seed of a shuffled epoch's order (data_chunk > 0): drawn from
     * --seed on a stream of its own, so the order is no function of the
     * bits that drew the initial weights. A checkpoint that never recorded
     * it shuffled by the seed itself, which a reader gives instead. */
    uint64_t data_shuffle_seed;
    /* What the stream was read from: "synthetic", "bytes" (a file at byte
     * level), "shards" (llm.c token shards) or "text" (files a tokenizer
     * encoded); "" when not recorded. */
    char data_kind[16];
    /* The seconds of an MoE layer, of a dense MLP layer (when the model
     * has any) and of the head that --pp-balance measured cut the pipeline
     * by, so that a resume cuts alike; 0: none measured. */
    double pipe_layer_seconds, pipe_dense_layer_seconds, pipe_head_seconds;
    /* Saving only: files the checkpoint holds beside its own (the
     * tokenizer and generation files of the model the run started from,
     * moe_checkpoint_read_companions); NULL: none. */
    const struct moe_checkpoint_files *companions;
} moe_train_state;

/* The tokenizer a Hugging Face model directory, and so a checkpoint, holds. */
#define MOE_CHECKPOINT_TOKENIZER_FILE "tokenizer.json"
/* The generation settings it holds, which are no tokenizer's. */
#define MOE_CHECKPOINT_GENERATION_FILE "generation_config.json"

/* A Hugging Face model directory's tokenizer and generation files
 * (tokenizer.json, tokenizer_config.json, special_tokens_map.json,
 * generation_config.json, tokenizer.model, vocab.json, merges.txt), read
 * once, for every checkpoint of a run from it to hold, so that each reads
 * as that model with its tokenizer. */
typedef struct moe_checkpoint_files {
    int count;
    const char *name[8];
    char *data[8];
    size_t size[8];
} moe_checkpoint_files;

/* Those of the files dir has into *files (free with
 * moe_checkpoint_files_free). They shape no training, so one that cannot
 * be read (a dangling link, no regular file, past 256 MiB) is left out,
 * and warn (may be NULL) says so, naming it; only running out of memory
 * fails. */
moe_status moe_checkpoint_read_companions(moe_checkpoint_files *files, const char *dir, moe_warn_fn warn,
                                          void *warn_ctx);

void moe_checkpoint_files_free(moe_checkpoint_files *files);

/* The step a checkpoint's directory name says ("step-" and six or more
 * digits), or -1 when name is no checkpoint's. */
int64_t moe_checkpoint_step_of_name(const char *name);

/* Writes OUT/step-NNNNNN for state->step (six digits, more from 10^6 on),
 * creating OUT as needed, and puts its path in path [path_bytes] (on every
 * rank; rank 0 of the job writes). state->step must equal the trainer's steps done;
 * state must be the same on every rank. model.safetensors holds
 * every model tensor in the model's order (norms 1-D) and, when the
 * selection bias is on, model.layers.N.block_sparse_moe.gate.
 * e_score_correction_bias [E]; train_state.safetensors holds
 * optimizer.exp_avg.<name> and optimizer.exp_avg_sq.<name> for every model
 * tensor (named per tensor, so the state can be re-sharded by name) and the
 * __metadata__ strings format_version "1", step, seed, jitter_counter,
 * data_token and data_epoch, data_tokens and data_chunk when
 * state->data_tokens > 0, data_shuffle_seed when data_chunk is > 0 too, data_kind when it is set, and pipe_layer_seconds
 * and pipe_head_seconds (JSON numbers, whatever the locale) when
 * state->pipe_layer_seconds > 0, with pipe_dense_layer_seconds when that
 * is > 0 too (older readers ignore these).
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
 * (a checkpoint of another model), except optimizer.* ones, the experts
 * of our layers that other expert-parallel ranks hold, and on a pipeline
 * stage the tensors of the other stages: those of the layers outside the
 * stage's and the embedding, final norm and head when the stage lacks them
 * (a tensor no stage has still fails the load: the stage holding the layer
 * it names refuses it, every stage one that names no layer).
 * The selection bias e_score_correction_bias [E] of each of the model's
 * layers is read when the model has it on, and is zero when the file lacks
 * it; a model with it off ignores the
 * file's (it only steers which experts are chosen, never the weights they
 * are mixed with, and a run may turn balancing off when fine-tuning).
 * A NaN or an infinity in a tensor read is an error, and so is a tensor
 * read whose bytes do not match the checksum its file records
 * (safetensors.h; each such tensor checked whole, once). With an index, every
 * tensor of a shard must be in its weight_map, and a tensor missing from
 * both is reported against the index.
 * Errors name the file and the tensor; on error the model is unchanged. */
moe_status moe_checkpoint_load_weights(moe_model *model, const char *dir);

/* Sparse upcycling (Komatsuzaki et al., 2022): loads a dense model of the
 * same sizes (Mistral's or Llama's names, each layer's MLP as
 * mlp.gate_proj, up_proj and down_proj [intermediate_size x hidden_size,
 * ..., hidden_size x intermediate_size]) into model, every expert of a
 * layer a copy of that layer's MLP (w1 gate_proj, w3 up_proj, w2
 * down_proj); the routers, shared experts and selection biases, which the
 * dense model lacks, keep the model's values. Everything else as
 * moe_checkpoint_load_weights, whose errors a missing MLP gives too. With
 * renormalised top-k weights the upcycled model computes what the dense one
 * does, whatever its routers choose. */
moe_status moe_checkpoint_upcycle_weights(moe_model *model, const char *dir);

/* Loads AdamW moments and the state written by moe_checkpoint_save from
 * dir/train_state.safetensors: sets the trainer's steps done, its moments,
 * the model's jitter counter, and *state (the caller moves its data source
 * to state->data). Every optimizer tensor of the parameters whose state the
 * trainer keeps (moe_trainer_shard) must be there with its model tensor's
 * shape, and no tensor but the moments of the model's tensors, of the
 * other ranks' experts and of the other pipeline stages' tensors may be; the metadata integers must be plain decimal
 * digits in range (data_epoch at most MOE_DATA_EPOCH_MAX). A moment read
 * whose checksum does not match (safetensors.h), a NaN or an infinity in
 * one, or a negative exp_avg_sq, is an error (the element is named). A file without
 * data_tokens (written before it existed) gives data_tokens = data_chunk =
 * 0; one with data_tokens must have data_chunk too; a file without
 * data_shuffle_seed gives data_shuffle_seed = seed; a data_kind, when
 * there, is one of the three state->data_kind names; pipe_layer_seconds
 * and pipe_head_seconds come together or not at all, finite decimal
 * numbers, the layer's positive and the head's not negative (absent: both
 * 0), and pipe_dense_layer_seconds, positive, only with them (absent: 0).
 * Errors name the file
 * and the tensor or key; on error nothing is changed. */
moe_status moe_checkpoint_load_state(moe_trainer *trainer, moe_model *model, moe_train_state *state,
                                     const char *dir);

/* The metadata of dir/train_state.safetensors alone, checked as
 * moe_checkpoint_load_state checks it: what a run must know before it
 * builds its data sources and model (which stream to read, which seed).
 * Not collective. */
moe_status moe_checkpoint_read_state(moe_train_state *state, const char *dir);

/* Reads dir/config.json (model_config.h's rules). When
 * dir/train_state.safetensors records the config's CRC-32C (every
 * checkpoint saved here does), a config that reads otherwise (a value
 * changed, not the file laid out anew: moe_model_config_crc32c) is
 * MOE_ERR_FORMAT when resuming, naming both files, and a warning
 * otherwise. Not collective: each rank reads it before its model exists
 * (moe_grid_agree then compares them). */
moe_status moe_checkpoint_load_config(moe_model_config *cfg, const char *dir, bool resuming, moe_warn_fn warn,
                                      void *warn_ctx);

#endif /* MOE_ENGINE_CHECKPOINT_H */
