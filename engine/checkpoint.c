#define _XOPEN_SOURCE 700

#include "engine/checkpoint.h"

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "comm/comm.h"
#include "common/crc32c.h"
#include "common/status.h"
#include "engine/fileio.h"
#include "engine/json.h"
#include "engine/safetensors.h"

#define MODEL_FILE "model.safetensors"
#define CONFIG_FILE "config.json"
#define STATE_FILE "train_state.safetensors"
#define FORMAT_VERSION "1"
#define EXP_AVG "optimizer.exp_avg."
#define EXP_AVG_SQ "optimizer.exp_avg_sq."
/* Optimizer tensors tolerated (and skipped) in a weights file. */
#define OPTIMIZER_PREFIX "optimizer."
#define BIAS_FMT "model.layers.%lld.block_sparse_moe.gate.e_score_correction_bias"
#define EXPERT_FMT "model.layers.%lld.block_sparse_moe.experts.%lld.w%d.weight"
#define FUSED_EXPERTS_FMT "model.layers.%lld.mlp.experts.%s"
/* A dense model's MLP (Mistral's, Llama's, Qwen3's): gate_proj, up_proj,
 * down_proj, as w1, w3 and w2 (proj_of). */
#define DENSE_MLP_FMT "model.layers.%lld.mlp.%s_proj.weight"
/* Expert e's in a Qwen3-MoE, OLMoE or Qwen2-MoE file. */
#define MLP_EXPERT_FMT "model.layers.%lld.mlp.experts.%lld.%s_proj.weight"
#define MOE_BLOCK ".block_sparse_moe."
#define LAYER_FMT "model.layers.%lld."
/* The tensors outside the layers: the first pipeline stage's, the last's. */
#define EMBED_NAME "model.embed_tokens.weight"
#define FINAL_NORM_NAME "model.norm.weight"
#define HEAD_NAME "lm_head.weight"

/* Room for any name built here: a model tensor's name behind the longest
 * prefix, or a layer-numbered name. */
#define NAME_BYTES (MOE_TENSOR_NAME_BYTES + sizeof EXP_AVG_SQ)
#define PATH_BYTES 4096
/* Tag of the messages that carry a checkpoint to rank 0. */
#define GATHER_TAG 4242
/* Elements per message, within MPI's int counts. */
#define CHUNK_ELEMENTS ((int64_t)1 << 30)

/* --------------------------------------------------------- ranks agreeing */

/* Every rank of job leaves a collective call with the same outcome:
 * MOE_OK when every rank had it, else the status and message of the lowest
 * failing rank (named on the others), so that no rank goes on into a
 * collective that another has left. st itself on one rank. */
static moe_status agree(moe_comm *job, moe_status st) {
    if (!job) return st;
    const int size = moe_comm_size(job), rank = moe_comm_rank(job);
    int32_t mine = (int32_t)st, *all = malloc((size_t)size * sizeof *all);
    if (!all) return moe_error(MOE_ERR_OUT_OF_MEMORY, "checkpoint: statuses of %d ranks", size);
    moe_status comm = moe_comm_allgather(job, all, &mine, 1, MOE_COMM_I32);
    int first = -1;
    for (int r = 0; comm == MOE_OK && r < size && first < 0; r++)
        if (all[r] != MOE_OK) first = r;
    const moe_status status = first >= 0 ? (moe_status)all[first] : MOE_OK;
    free(all);
    if (comm != MOE_OK || first < 0) return comm;
    char msg[MOE_ERROR_BYTES];
    if (rank == first) snprintf(msg, sizeof msg, "%s", moe_last_error());
    comm = moe_comm_broadcast(job, msg, MOE_ERROR_BYTES, MOE_COMM_BYTES, first);
    if (comm != MOE_OK) return comm;
    if (rank == first) return st;
    msg[MOE_ERROR_BYTES - 1] = '\0';
    return moe_error(status, "rank %d: %s", first, msg);
}

/* Whether name is canonical, as the model writes it: sscanf's numbers
 * would take "01", "+1" or " 1" too, which no tensor of ours is called. */
static bool written_as(const char *name, const char *canonical) { return strcmp(name, canonical) == 0; }

/* w1, w3, w2 as a SwiGLU MLP's projections are named. */
static const char *proj_of(int w) { return w == 1 ? "gate" : w == 3 ? "up" : "down"; }

/* Whether name is an expert's weight, layer *l, expert *e, w1, w2 or w3
 * (*w), as we name it or as a Qwen3-MoE or OLMoE file does. */
static bool parse_expert(const char *name, long long *l, long long *e, int *w) {
    int end = 0;
    char again[NAME_BYTES];
    if (sscanf(name, EXPERT_FMT "%n", l, e, w, &end) == 3 && end > 0 && name[end] == '\0') {
        snprintf(again, sizeof again, EXPERT_FMT, *l, *e, *w);
        return written_as(name, again) && *w >= 1 && *w <= 3;
    }
    if (sscanf(name, "model.layers.%lld.mlp.experts.%lld.", l, e) != 2) return false;
    for (*w = 1; *w <= 3; (*w)++) {
        snprintf(again, sizeof again, MLP_EXPERT_FMT, *l, *e, proj_of(*w));
        if (written_as(name, again)) return true;
    }
    return false;
}

/* Expert e's w1, w2 or w3 in one of our layers: a tensor that some rank of
 * an expert-parallel group holds, not necessarily this one. */
static bool is_expert_weight(const char *name, int64_t layers, int64_t experts) {
    long long l, e;
    int w;
    return parse_expert(name, &l, &e, &w) && l >= 0 && l < layers && e >= 0 && e < experts;
}

/* The name of the tensor called ours in the file of a model saved as
 * qwen3_moe, olmoe or qwen2_moe (moe_model_config_model_type), hf_mlp:
 * their MoE blocks are mlp, not block_sparse_moe, with experts
 * mlp.experts.E.{gate,up,down}_proj and Qwen2-MoE's one shared expert
 * mlp.shared_expert.{gate,up,down}_proj (a model of these types has one
 * at most, so our shared_experts is that one); the rest keep theirs. */
static void file_name(char *out, const char *ours, bool hf_mlp) {
    static const char shared[] = "shared_experts.";
    long long l, e;
    int w, end = 0;
    if (hf_mlp && sscanf(ours, EXPERT_FMT "%n", &l, &e, &w, &end) == 3 && end > 0 && ours[end] == '\0') {
        snprintf(out, NAME_BYTES, MLP_EXPERT_FMT, l, e, proj_of(w));
    } else if (hf_mlp && sscanf(ours, LAYER_FMT "block_sparse_moe.%n", &l, &end) == 1 && end > 0) {
        const char *rest = ours + end;
        const bool one_shared = strncmp(rest, shared, strlen(shared)) == 0;
        snprintf(out, NAME_BYTES, LAYER_FMT "mlp.%s%s", l, one_shared ? "shared_expert." : "",
                 one_shared ? rest + strlen(shared) : rest);
    } else {
        snprintf(out, NAME_BYTES, "%s", ours);
    }
}

/* A selection bias of one of our layers. */
static bool is_bias(const char *name, int64_t layers) {
    long long l;
    int end = 0;
    char again[NAME_BYTES];
    if (sscanf(name, BIAS_FMT "%n", &l, &end) != 1 || end == 0 || name[end] != '\0') return false;
    snprintf(again, sizeof again, BIAS_FMT, l);
    return written_as(name, again) && l >= 0 && l < layers;
}

/* A tensor of the model that another pipeline stage holds: one of a layer
 * outside ours (in any layout), the embedding when we are not the first
 * stage, the final norm or the head when we are not the last. The stage
 * that holds it checks it, so a tensor no stage has is refused there. */
static bool of_other_stage(const moe_model *model, const char *name, int64_t layers) {
    const moe_model_stage stage = moe_model_get_stage(model);
    long long l;
    int end = 0;
    char prefix[NAME_BYTES];
    if (sscanf(name, LAYER_FMT "%n", &l, &end) == 1 && end > 0) {
        snprintf(prefix, sizeof prefix, LAYER_FMT, l);
        return strncmp(name, prefix, strlen(prefix)) == 0 && l >= 0 && l < layers &&
               !moe_model_holds_layer(model, l);
    }
    if (!stage.first && strcmp(name, EMBED_NAME) == 0) return true;
    return !stage.last && (strcmp(name, FINAL_NORM_NAME) == 0 || strcmp(name, HEAD_NAME) == 0);
}

/* ------------------------------------------------------------------ paths */

static moe_status path_format(char *out, const char *fmt, const char *dir, const char *name, long pid) {
    int n = snprintf(out, PATH_BYTES, fmt, dir, name, pid);
    if (n < 0 || n >= PATH_BYTES)
        return moe_error(MOE_ERR_INVALID_ARG, "%s: path longer than %d bytes", dir, PATH_BYTES - 1);
    return MOE_OK;
}

static moe_status path_join(char *out, const char *dir, const char *name) {
    return path_format(out, "%s/%s", dir, name, 0);
}

static bool exists(const char *path) {
    struct stat sb;
    return lstat(path, &sb) == 0;
}


/* --------------------------------------------------------------- writing */

static moe_status write_weights(const char *path, moe_model *model) {
    const moe_model_config *c = moe_model_get_config(model);
    const int64_t n = moe_model_tensor_count(model), L = c->num_hidden_layers;
    const int64_t E = c->num_local_experts;
    moe_st_entry *entries = malloc((size_t)(n + L) * sizeof *entries);
    char(*bias_names)[NAME_BYTES] = malloc((size_t)L * sizeof *bias_names);
    char(*names)[NAME_BYTES] = malloc((size_t)n * sizeof *names);
    if (!entries || !bias_names || !names) {
        free(entries);
        free(bias_names);
        free(names);
        return moe_error(MOE_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
    }
    const char *type = moe_model_config_model_type(c);
    const bool hf_mlp = strcmp(type, "mixtral") != 0 && strcmp(type, "moe") != 0;
    const float *params = moe_model_host_params(model);
    for (int64_t i = 0; i < n; i++) {
        const moe_model_tensor *t = moe_model_tensor_at(model, i);
        file_name(names[i], t->name, hf_mlp);
        entries[i] = (moe_st_entry){names[i], params + t->offset, t->ndim, t->shape};
    }
    int64_t count = n;
    for (int64_t l = 0; l < L; l++) {
        const float *bias = moe_model_router_bias(model, l); /* [E] */
        if (bias == NULL) continue;
        snprintf(bias_names[l], NAME_BYTES, BIAS_FMT, (long long)l);
        entries[count++] = (moe_st_entry){bias_names[l], bias, 1, &E};
    }
    moe_status st = moe_st_write(path, entries, count, NULL, 0);
    free(entries);
    free(bias_names);
    free(names);
    return st;
}

/* m, v [param_count]: the moments, indexed like model's parameters. */
static moe_status write_state(const char *path, moe_model *model, const float *m, const float *v,
                              const moe_train_state *s, uint32_t config_crc) {
    const int64_t n = moe_model_tensor_count(model);
    moe_st_entry *entries = malloc((size_t)(2 * n) * sizeof *entries);
    char(*names)[NAME_BYTES] = malloc((size_t)(2 * n) * sizeof *names);
    if (!entries || !names) {
        free(entries);
        free(names);
        return moe_error(MOE_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
    }
    for (int64_t i = 0; i < n; i++) {
        const moe_model_tensor *t = moe_model_tensor_at(model, i);
        snprintf(names[i], NAME_BYTES, EXP_AVG "%s", t->name);
        snprintf(names[n + i], NAME_BYTES, EXP_AVG_SQ "%s", t->name);
        entries[i] = (moe_st_entry){names[i], m + t->offset, t->ndim, t->shape};
        entries[n + i] = (moe_st_entry){names[n + i], v + t->offset, t->ndim, t->shape};
    }
    char step[24], seed[24], jitter[24], token[24], epoch[24], tokens[24], chunk[24], shuffle_seed[24], layer[32],
        dense[32], head[32];
    snprintf(step, sizeof step, "%" PRId64, s->step);
    snprintf(seed, sizeof seed, "%" PRIu64, s->seed);
    snprintf(jitter, sizeof jitter, "%" PRIu64, s->jitter_counter);
    snprintf(token, sizeof token, "%" PRId64, s->data.token);
    snprintf(epoch, sizeof epoch, "%" PRId64, s->data.epoch);
    snprintf(tokens, sizeof tokens, "%" PRId64, s->data_tokens);
    snprintf(chunk, sizeof chunk, "%" PRId64, s->data_chunk);
    snprintf(shuffle_seed, sizeof shuffle_seed, "%" PRIu64, s->data_shuffle_seed);
    /* As JSON numbers: no decimal comma under a host's locale. */
    moe_json_format_number(layer, sizeof layer, s->pipe_layer_seconds);
    moe_json_format_number(dense, sizeof dense, s->pipe_dense_layer_seconds);
    moe_json_format_number(head, sizeof head, s->pipe_head_seconds);
    char config[24];
    snprintf(config, sizeof config, "%" PRIu32, config_crc);
    moe_st_meta meta[14] = {
        {"format_version", FORMAT_VERSION}, {"step", step},        {"seed", seed},
        {"jitter_counter", jitter},         {"data_token", token}, {"data_epoch", epoch},
    };
    /* The stream's keys only when known: a reader takes their absence as a
     * checkpoint that never recorded them. */
    int64_t n_meta = 6;
    meta[n_meta++] = (moe_st_meta){"config_crc32c", config};
    if (s->data_tokens > 0) {
        meta[n_meta++] = (moe_st_meta){"data_tokens", tokens};
        meta[n_meta++] = (moe_st_meta){"data_chunk", chunk};
        if (s->data_chunk > 0) meta[n_meta++] = (moe_st_meta){"data_shuffle_seed", shuffle_seed};
    }
    if (s->data_kind[0]) meta[n_meta++] = (moe_st_meta){"data_kind", s->data_kind};
    if (s->pipe_layer_seconds > 0.0) {
        meta[n_meta++] = (moe_st_meta){"pipe_layer_seconds", layer};
        meta[n_meta++] = (moe_st_meta){"pipe_head_seconds", head};
        if (s->pipe_dense_layer_seconds > 0.0) meta[n_meta++] = (moe_st_meta){"pipe_dense_layer_seconds", dense};
    }
    moe_status st = moe_st_write(path, entries, 2 * n, meta, n_meta);
    free(entries);
    free(names);
    return st;
}

/* Each file goes through the atomic writers, which fsync the file and then
 * the directory holding it, so every entry of dir is durable when this
 * returns. The train state records config.json's checksum, as the
 * safetensors files record their own: of the config as written, so that
 * a file laid out anew (another indent, keys reordered) still matches. */
static moe_status write_files(const char *dir, moe_model *model, const float *m, const float *v,
                              const moe_train_state *s) {
    char path[PATH_BYTES];
    MOE_TRY(path_join(path, dir, MODEL_FILE));
    MOE_TRY(write_weights(path, model));
    MOE_TRY(path_join(path, dir, CONFIG_FILE));
    MOE_TRY(moe_model_config_save(moe_model_get_config(model), path));
    uint32_t crc;
    MOE_TRY(moe_model_config_crc32c(moe_model_get_config(model), &crc));
    MOE_TRY(path_join(path, dir, STATE_FILE));
    MOE_TRY(write_state(path, model, m, v, s, crc));
    for (int i = 0; s->companions && i < s->companions->count; i++) {
        MOE_TRY(path_join(path, dir, s->companions->name[i]));
        MOE_TRY(moe_file_write_atomic_buffer(path, s->companions->data[i], s->companions->size[i]));
    }
    return MOE_OK;
}

/* The largest tokenizer or generation file a checkpoint holds. */
#define COMPANION_MAX_BYTES ((size_t)256 << 20)

moe_status moe_checkpoint_read_companions(moe_checkpoint_files *files, const char *dir, moe_warn_fn warn,
                                          void *warn_ctx) {
    static const char *const names[] = {MOE_CHECKPOINT_TOKENIZER_FILE, "tokenizer_config.json", "special_tokens_map.json",
                                        MOE_CHECKPOINT_GENERATION_FILE, "tokenizer.model", "vocab.json", "merges.txt"};
    _Static_assert(sizeof names / sizeof *names <= sizeof files->name / sizeof *files->name, "room for every file");
    memset(files, 0, sizeof *files);
    for (size_t i = 0; dir && i < sizeof names / sizeof *names; i++) {
        char path[PATH_BYTES];
        MOE_TRY(path_join(path, dir, names[i]));
        if (!exists(path)) continue;
        const int n = files->count;
        const moe_status st = moe_file_read_all(&files->data[n], &files->size[n], path, COMPANION_MAX_BYTES);
        if (st == MOE_ERR_OUT_OF_MEMORY) {
            moe_checkpoint_files_free(files);
            return st;
        }
        if (st != MOE_OK) {
            if (warn) {
                char message[MOE_ERROR_BYTES + 128];
                snprintf(message, sizeof message, "%s (it is not kept with the checkpoints)", moe_last_error());
                warn(warn_ctx, message);
            }
            continue;
        }
        files->name[files->count++] = names[i];
    }
    return MOE_OK;
}

void moe_checkpoint_files_free(moe_checkpoint_files *files) {
    for (int i = 0; i < files->count; i++) free(files->data[i]);
    memset(files, 0, sizeof *files);
}

/* Names with our pid can only be left over by a dead process that had the
 * same pid (containers reuse small pids). A temp directory is a write that
 * never finished. A set-aside one is the earlier copy of this step, moved
 * out of the way for a replacement: if that replacement never arrived it is
 * the only copy, so it goes back in place, to be replaced by this save. */
static moe_status clear_leftovers(const char *final_dir, const char *tmp_dir, const char *old_dir) {
    if (exists(tmp_dir)) MOE_TRY(moe_remove_tree(tmp_dir));
    if (!exists(old_dir)) return MOE_OK;
    if (exists(final_dir)) return moe_remove_tree(old_dir);
    if (rename(old_dir, final_dir) != 0)
        return moe_error(MOE_ERR_IO, "cannot move %s back to %s: %s", old_dir, final_dir, strerror(errno));
    return MOE_OK;
}

/* Puts tmp_dir at final_dir, moving a checkpoint already there to old_dir
 * (which the caller removes once the new one is durable). */
static moe_status swap_in(const char *out_dir, const char *final_dir, const char *tmp_dir, const char *old_dir) {
    bool replacing = exists(final_dir);
    if (replacing && rename(final_dir, old_dir) != 0)
        return moe_error(MOE_ERR_IO, "cannot move %s aside to %s: %s", final_dir, old_dir, strerror(errno));
    if (rename(tmp_dir, final_dir) != 0) {
        moe_status st = moe_error(MOE_ERR_IO, "cannot rename %s to %s: %s", tmp_dir, final_dir, strerror(errno));
        if (replacing && rename(old_dir, final_dir) != 0)
            st = moe_error(MOE_ERR_IO, "cannot rename %s to %s, and the earlier checkpoint is left at %s: %s",
                           tmp_dir, final_dir, old_dir, strerror(errno));
        return st;
    }
    /* Past the rename there is no undoing: if this fsync fails the new
     * checkpoint stays, and the old copy at old_dir goes with the next save
     * of this step. */
    return moe_fsync_dir(out_dir);
}

/* Writes the checkpoint into tmp_dir and renames it to final_dir; on failure
 * removes tmp_dir and leaves final_dir as it was. */
static moe_status save_dir(const char *out_dir, const char *final_dir, const char *tmp_dir, const char *old_dir,
                           moe_model *model, const float *m, const float *v, const moe_train_state *state) {
    MOE_TRY(clear_leftovers(final_dir, tmp_dir, old_dir));
    struct stat sb;
    if (stat(final_dir, &sb) == 0 && !S_ISDIR(sb.st_mode))
        return moe_error(MOE_ERR_IO, "%s exists and is not a directory", final_dir);
    if (mkdir(tmp_dir, 0777) != 0) return moe_error(MOE_ERR_IO, "cannot create %s: %s", tmp_dir, strerror(errno));
    moe_status st = write_files(tmp_dir, model, m, v, state);
    if (st == MOE_OK) st = swap_in(out_dir, final_dir, tmp_dir, old_dir);
    /* The first failure is what the caller needs; a temp directory that
     * cannot be removed is cleared by the next save of this step. */
    if (st != MOE_OK && exists(tmp_dir)) moe_remove_tree(tmp_dir);
    return st;
}

/* ------------------------------------------------------ gather on write */

/* What rank 0 writes: a one-rank model and its moments. */
typedef struct gathered {
    moe_model *model;     /* the one-rank layout */
    float *m, *v;         /* [param_count of model] each, indexed like its parameters */
    moe_model *own_model; /* created for the gather; NULL when model is the caller's */
    float *own_state;     /* [2 * param_count]: m and v when gathered */
} gathered;

static void gathered_free(gathered *g) {
    moe_model_destroy(g->own_model);
    free(g->own_state);
}

/* The values of one array that one rank holds: count elements from element
 * `first` of the tensor whose index in the one-rank table is `index` (its
 * parameters or a moment), or of layer `index`'s selection bias. */
typedef struct part {
    int64_t kind, index, first, count, numel;
    const float *src; /* [count], on the rank that holds it */
} part;

enum { PART_PARAMS, PART_EXP_AVG, PART_EXP_AVG_SQ, PART_BIAS, PART_KINDS };
#define PART_FIELDS 5 /* the integers of a part, as they travel */

static bool leads(moe_comm *group) { return !group || moe_comm_rank(group) == 0; }

static moe_model_run_id run_of(const moe_model *model, const moe_model_tensor *t) {
    return t->offset >= moe_model_get_run(model, MOE_RUN_EXPERTS).offset ? MOE_RUN_EXPERTS : MOE_RUN_DENSE;
}

static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* Fills parts [3 * tensor count + layers] with what this rank contributes,
 * so that every value has exactly one sender: a run's parameters come from
 * the first rank of its group, its moments from every rank of the group
 * when they are sharded, else from the first; the selection biases, alike
 * on a stage's data-parallel ranks, from its first. The groups are the
 * stage's, and the stages hold different tensors and layers. Returns how
 * many. */
static int64_t collect_parts(part *parts, moe_model *model, moe_trainer *trainer) {
    const float *params = moe_model_host_params(model);
    const int64_t E = moe_model_get_config(model)->num_local_experts;
    int64_t layers;
    const int64_t *layer = moe_model_layer_ids(model, &layers);
    int64_t n = 0;
    for (int64_t i = 0; i < moe_model_tensor_count(model); i++) {
        const moe_model_tensor *t = moe_model_tensor_at(model, i);
        const moe_model_run_id r = run_of(model, t);
        moe_comm *group = moe_model_get_run(model, r).group;
        const moe_optim_shard sh = moe_trainer_shard(trainer, r);
        if (leads(group)) parts[n++] = (part){PART_PARAMS, t->init_stream, 0, t->numel, t->numel, params + t->offset};
        const int64_t a = max64(t->offset, sh.begin), b = min64(t->offset + t->numel, sh.end);
        if (a >= b || (sh.shared && !leads(group))) continue;
        parts[n++] = (part){PART_EXP_AVG, t->init_stream, a - t->offset, b - a, t->numel, sh.m + (a - sh.begin)};
        parts[n++] = (part){PART_EXP_AVG_SQ, t->init_stream, a - t->offset, b - a, t->numel, sh.v + (a - sh.begin)};
    }
    for (int64_t i = 0; i < layers; i++) {
        const float *bias = moe_model_router_bias(model, layer[i]); /* [E] */
        if (bias && leads(moe_model_world(model))) parts[n++] = (part){PART_BIAS, layer[i], 0, E, E, bias};
    }
    return n;
}

/* Rank 0's destination: the one-rank model and its moments. */
static moe_status make_full(gathered *g, moe_model *model) {
    const moe_model_config *c = moe_model_get_config(model);
    MOE_TRY(moe_model_create(&g->own_model, c, 1, 1, 0));
    g->model = g->own_model;
    const int64_t n = moe_model_param_count(g->model);
    g->own_state = calloc((size_t)(2 * n), sizeof(float));
    if (!g->own_state)
        return moe_error(MOE_ERR_OUT_OF_MEMORY, "checkpoint: AdamW state of %lld parameters", (long long)n);
    g->m = g->own_state;
    g->v = g->own_state + n;
    return MOE_OK;
}

/* Where a part of kind goes on rank 0, and how long that array is
 * (*numel): the one-rank tensor `index`'s parameters or moment, or layer
 * `index`'s selection bias; NULL when no such array exists. */
static float *part_array(int64_t *numel, const gathered *g, int64_t kind, int64_t index) {
    const moe_model_config *c = moe_model_get_config(g->model);
    if (kind == PART_BIAS) {
        *numel = c->num_local_experts;
        return index >= 0 && index < c->num_hidden_layers ? moe_model_router_bias(g->model, index) : NULL;
    }
    if (kind < 0 || kind >= PART_KINDS || index < 0 || index >= moe_model_tensor_count(g->model)) return NULL;
    const moe_model_tensor *t = moe_model_tensor_at(g->model, index);
    *numel = t->numel;
    return (kind == PART_PARAMS ? moe_model_host_params(g->model) : kind == PART_EXP_AVG ? g->m : g->v) + t->offset;
}

/* Checks the parts [n] (PART_FIELDS integers each) that arrived at rank 0:
 * each must lie inside its one-rank array, and together they must cover
 * every value once (they never overlap when each has one sender). */
static moe_status check_parts(const gathered *g, const int64_t *meta, int64_t n) {
    const moe_model_config *c = moe_model_get_config(g->model);
    int64_t covered[PART_KINDS] = {0}, values = 0;
    for (int64_t i = 0; i < moe_model_tensor_count(g->model); i++) values += moe_model_tensor_at(g->model, i)->numel;
    int64_t biases = 0; /* the MoE layers' selection biases (a dense layer has none) */
    for (int64_t l = 0; l < c->num_hidden_layers; l++) biases += moe_model_router_bias(g->model, l) ? c->num_local_experts : 0;
    const int64_t want[PART_KINDS] = {values, values, values, biases};
    for (int64_t i = 0; i < n; i++) {
        const int64_t *p = meta + PART_FIELDS * i;
        int64_t numel = 0;
        if (!part_array(&numel, g, p[0], p[1]) || numel != p[4] || p[2] < 0 || p[3] <= 0 || p[3] > numel - p[2])
            return moe_error(MOE_ERR_INTERNAL,
                             "checkpoint gather: part %lld (kind %lld, array %lld, [%lld, +%lld) of %lld) does not "
                             "fit the one-rank model",
                             (long long)i, (long long)p[0], (long long)p[1], (long long)p[2], (long long)p[3],
                             (long long)p[4]);
        covered[p[0]] += p[3];
    }
    static const char *const kinds[PART_KINDS] = {"parameters", "exp_avg", "exp_avg_sq", "selection biases"};
    for (int k = 0; k < PART_KINDS; k++)
        if (covered[k] != want[k])
            return moe_error(MOE_ERR_INTERNAL, "checkpoint gather: %lld of the model's %lld %s arrived",
                             (long long)covered[k], (long long)want[k], kinds[k]);
    return MOE_OK;
}

/* A checked part's first value on rank 0. */
static float *part_destination(const gathered *g, const int64_t *p) {
    int64_t numel;
    return part_array(&numel, g, p[0], p[1]) + p[2];
}

/* Point-to-point in messages MPI can count. */
static moe_status send_floats(moe_comm *job, const float *src, int64_t n, int peer) {
    for (int64_t at = 0; at < n; at += CHUNK_ELEMENTS)
        MOE_TRY(moe_comm_send(job, src + at, min64(CHUNK_ELEMENTS, n - at), MOE_COMM_F32, peer, GATHER_TAG));
    return MOE_OK;
}

static moe_status recv_floats(moe_comm *job, float *dst, int64_t n, int peer) {
    for (int64_t at = 0; at < n; at += CHUNK_ELEMENTS)
        MOE_TRY(moe_comm_recv(job, dst + at, min64(CHUNK_ELEMENTS, n - at), MOE_COMM_F32, peer, GATHER_TAG));
    return MOE_OK;
}

/* Rank 0 learns every rank's parts [counts[q]] into all_meta and checks
 * them; the others send theirs (meta). */
static moe_status exchange_parts(int64_t **all_meta, int64_t *counts, const gathered *g, moe_comm *job,
                                 const int64_t *meta, int64_t n) {
    const int size = moe_comm_size(job), rank = moe_comm_rank(job);
    MOE_TRY(moe_comm_allgather(job, counts, &n, 1, MOE_COMM_I64));
    int64_t total = 0;
    for (int q = 0; q < size; q++) total += counts[q];
    moe_status st = MOE_OK;
    if (rank == 0) {
        *all_meta = malloc((size_t)(PART_FIELDS * total) * sizeof **all_meta);
        if (!*all_meta) st = moe_error(MOE_ERR_OUT_OF_MEMORY, "checkpoint gather: %lld parts", (long long)total);
    }
    MOE_TRY(agree(job, st));
    if (rank != 0) return moe_comm_send(job, meta, PART_FIELDS * n, MOE_COMM_I64, 0, GATHER_TAG);
    memcpy(*all_meta, meta, (size_t)(PART_FIELDS * n) * sizeof *meta);
    int64_t at = counts[0];
    for (int q = 1; q < size; q++) {
        MOE_TRY(moe_comm_recv(job, *all_meta + PART_FIELDS * at, PART_FIELDS * counts[q], MOE_COMM_I64, q,
                              GATHER_TAG));
        at += counts[q];
    }
    return check_parts(g, *all_meta, total);
}

/* Every rank's values to their place in rank 0's one-rank arrays, part by
 * part, straight from where they live to where they go. */
static moe_status exchange_values(const gathered *g, moe_comm *job, const part *parts, int64_t n,
                                  const int64_t *all_meta, const int64_t *counts) {
    const int size = moe_comm_size(job);
    if (moe_comm_rank(job) != 0) {
        for (int64_t i = 0; i < n; i++) MOE_TRY(send_floats(job, parts[i].src, parts[i].count, 0));
        return MOE_OK;
    }
    for (int64_t i = 0; i < n; i++)
        memcpy(part_destination(g, all_meta + PART_FIELDS * i), parts[i].src, (size_t)parts[i].count * sizeof(float));
    int64_t at = counts[0];
    for (int q = 1; q < size; q++)
        for (int64_t i = 0; i < counts[q]; i++, at++) {
            const int64_t *p = all_meta + PART_FIELDS * at;
            MOE_TRY(recv_floats(job, part_destination(g, p), p[3], q));
        }
    return MOE_OK;
}

/* Assembles on rank 0 the one-rank model and moments from the ranks that
 * hold each value. Collective over the model's job. */
static moe_status gather(gathered *g, moe_model *model, moe_trainer *trainer) {
    moe_comm *job = moe_model_job(model);
    int64_t layers;
    moe_model_layer_ids(model, &layers);
    const int64_t nt = moe_model_tensor_count(model), most = 3 * nt + layers;
    part *parts = malloc((size_t)most * sizeof *parts);
    int64_t *meta = malloc((size_t)(most * PART_FIELDS) * sizeof *meta);
    int64_t *counts = malloc((size_t)moe_comm_size(job) * sizeof *counts), *all_meta = NULL, n = 0;
    moe_status st = MOE_OK;
    if (!parts || !meta || !counts)
        st = moe_error(MOE_ERR_OUT_OF_MEMORY, "checkpoint gather: parts of %lld tensors", (long long)nt);
    if (st == MOE_OK) {
        n = collect_parts(parts, model, trainer);
        for (int64_t i = 0; i < n; i++) {
            int64_t *p = meta + PART_FIELDS * i;
            p[0] = parts[i].kind;
            p[1] = parts[i].index;
            p[2] = parts[i].first;
            p[3] = parts[i].count;
            p[4] = parts[i].numel;
        }
    }
    if (st == MOE_OK && moe_comm_rank(job) == 0) st = make_full(g, model);
    st = agree(job, st);
    if (st == MOE_OK) st = agree(job, exchange_parts(&all_meta, counts, g, job, meta, n));
    if (st == MOE_OK) st = exchange_values(g, job, parts, n, all_meta, counts);
    free(parts);
    free(meta);
    free(counts);
    free(all_meta);
    return st;
}

/* Rank 0's part of a save: the files and the swap into place. */
static moe_status write_checkpoint(const char *out_dir, const char *final_dir, const char *tmp_dir,
                                   const char *old_dir, const gathered *g, const moe_train_state *state) {
    MOE_TRY(moe_mkdir_p(out_dir));
    moe_status st = save_dir(out_dir, final_dir, tmp_dir, old_dir, g->model, g->m, g->v, state);
    if (st != MOE_OK) return moe_error_prefix(st, "checkpoint %s: ", final_dir);
    if (exists(old_dir) && moe_remove_tree(old_dir) != MOE_OK)
        return moe_error_prefix(MOE_ERR_IO, "checkpoint %s was written, but the copy it replaced remains: ", final_dir);
    return MOE_OK;
}

int64_t moe_checkpoint_step_of_name(const char *name) {
    if (strncmp(name, "step-", 5) != 0) return -1;
    const size_t digits = strspn(name + 5, "0123456789");
    return digits >= 6 && name[5 + digits] == '\0' ? strtoll(name + 5, NULL, 10) : -1;
}

moe_status moe_checkpoint_save(char *path, size_t path_bytes, const char *out_dir, moe_model *model,
                               moe_trainer *trainer, const moe_train_state *state) {
    if (!path || path_bytes == 0 || !out_dir || !model || !trainer || !state)
        return moe_error(MOE_ERR_INVALID_ARG, "moe_checkpoint_save: NULL argument");
    moe_comm *job = moe_model_job(model);
    moe_status st = MOE_OK;
    if (state->step < 0 || state->step != moe_trainer_steps_done(trainer))
        st = moe_error(MOE_ERR_INVALID_ARG, "moe_checkpoint_save: step %lld is not the trainer's %lld steps done",
                       (long long)state->step, (long long)moe_trainer_steps_done(trainer));
    char name[32], final_dir[PATH_BYTES], tmp_dir[PATH_BYTES], old_dir[PATH_BYTES];
    snprintf(name, sizeof name, "step-%06lld", (long long)state->step);
    const long pid = (long)getpid();
    if (st == MOE_OK) st = path_join(final_dir, out_dir, name);
    if (st == MOE_OK) st = path_format(tmp_dir, "%s/.%s.tmp-%ld", out_dir, name, pid);
    if (st == MOE_OK) st = path_format(old_dir, "%s/.%s.old-%ld", out_dir, name, pid);
    if (st == MOE_OK && strlen(final_dir) >= path_bytes)
        st = moe_error(MOE_ERR_INVALID_ARG, "%s: path does not fit in %zu bytes", final_dir, path_bytes);
    /* What is written is read on the host. */
    if (st == MOE_OK) st = moe_model_pull(model);
    if (st == MOE_OK) st = moe_trainer_pull(trainer);
    st = agree(job, st);
    if (st != MOE_OK) return st;

    /* One rank's model and moments are written as they are. */
    gathered g = {.model = model, .m = moe_trainer_adam_m(trainer), .v = moe_trainer_adam_v(trainer)};
    if (job) st = gather(&g, model, trainer);
    if (st == MOE_OK && (!job || moe_comm_rank(job) == 0))
        st = write_checkpoint(out_dir, final_dir, tmp_dir, old_dir, &g, state);
    st = agree(job, st);
    gathered_free(&g);
    if (st == MOE_OK) snprintf(path, path_bytes, "%s", final_dir);
    return st;
}

/* --------------------------------------------------------------- reading */

static const char *shape_text(char *buf, size_t size, int64_t ndim, const int64_t *shape) {
    size_t n = (size_t)snprintf(buf, size, "[");
    for (int64_t i = 0; i < ndim && n < size; i++)
        n += (size_t)snprintf(buf + n, size - n, "%s%lld", i > 0 ? ", " : "", (long long)shape[i]);
    if (n < size) snprintf(buf + n, size - n, "]");
    return buf;
}

static moe_status check_shape(const char *file, const moe_st_tensor *t, int64_t ndim, const int64_t *shape) {
    bool same = t->ndim == ndim;
    for (int64_t i = 0; same && i < ndim; i++) same = t->shape[i] == shape[i];
    if (same) return MOE_OK;
    char got[128], want[128];
    return moe_error(MOE_ERR_FORMAT, "%s: tensor '%s' has shape %s, expected %s", file, t->name,
                     shape_text(got, sizeof got, t->ndim, t->shape), shape_text(want, sizeof want, ndim, shape));
}

/* Where one destination's values come from: numel elements from element
 * `first` of src (a fused tensor holds several) in file, or zeros when src
 * is NULL. */
typedef struct source {
    float *dst; /* [numel] */
    const moe_st_tensor *src;
    int64_t first;
    int64_t numel;
    const char *file;
    bool second_moment; /* Adam's exp_avg_sq: its square root is taken */
} source;

/* The checksum of every tensor a source reads, checked whole and once
 * (several sources may read parts of one), before any value: a flipped bit
 * is as often a finite value (0.9998 -> 3.4e38) as a NaN, and the checksum
 * names it as damage. */
static moe_status check_sums(const source *s, int64_t n) {
    const moe_st_tensor **t = calloc((size_t)(n > 0 ? n : 1), sizeof *t);
    const char **file = calloc((size_t)(n > 0 ? n : 1), sizeof *file);
    moe_status st = MOE_ERR_OUT_OF_MEMORY;
    if (t && file) {
        for (int64_t i = 0; i < n; i++) t[i] = s[i].src, file[i] = s[i].file;
        st = moe_st_verify_all(t, file, n);
    } else {
        moe_error(st, "checkpoint: checksums of %lld tensors", (long long)n);
    }
    free(t);
    free(file);
    return st;
}

/* Refuses a damaged tensor (check_sums), a NaN or an infinity in any
 * source, and a negative second moment: loaded, they surface steps later as
 * a NaN loss or gradient norm, far from the file. Read-only, so that a
 * refused load changes nothing; it reads the stored bits, cheap next to the
 * copy that follows. */
static moe_status check_values(const source *s, int64_t n) {
    MOE_TRY(check_sums(s, n));
    int64_t *bad = malloc((size_t)(n > 0 ? n : 1) * sizeof *bad);
    float *value = malloc((size_t)(n > 0 ? n : 1) * sizeof *value);
    if (!bad || !value) {
        free(bad);
        free(value);
        return moe_error(MOE_ERR_OUT_OF_MEMORY, "checkpoint: value check of %lld tensors", (long long)n);
    }
#pragma omp parallel for schedule(dynamic)
    for (int64_t i = 0; i < n; i++)
        bad[i] = s[i].src ? moe_st_find_bad(&value[i], s[i].src, s[i].first, s[i].numel, s[i].second_moment) : -1;
    moe_status st = MOE_OK;
    for (int64_t i = 0; i < n && st == MOE_OK; i++) {
        if (bad[i] < 0) continue;
        char text[64];
        if (isnan(value[i]))
            snprintf(text, sizeof text, "nan");
        else
            snprintf(text, sizeof text, "%g", (double)value[i]);
        st = moe_error(MOE_ERR_FORMAT, "%s: tensor '%s' element %lld is %s%s", s[i].file, s[i].src->name,
                       (long long)bad[i], text, isfinite(value[i]) ? " (a second moment must be >= 0)" : "");
    }
    free(bad);
    free(value);
    return st;
}

/* Converts every source; nothing is written before all were found valid, so
 * a failed load leaves the destination as it was. */
static void copy_sources(const source *s, int64_t n) {
#pragma omp parallel for schedule(dynamic)
    for (int64_t i = 0; i < n; i++) {
        if (s[i].src == NULL) {
            memset(s[i].dst, 0, (size_t)s[i].numel * sizeof(float));
            continue;
        }
        moe_st_tensor part = *s[i].src;
        int64_t bytes = moe_st_dtype_bytes(part.dtype);
        part.data = (const unsigned char *)part.data + s[i].first * bytes;
        part.numel = s[i].numel;
        part.nbytes = s[i].numel * bytes;
        moe_st_read_f32(s[i].dst, &part);
    }
}

typedef struct weights_reader {
    const moe_st_dir *dir;
    const char *where; /* the file to name when a tensor is missing */
    bool *used;        /* [tensor count of dir] */
    int64_t E, d, ff;
    bool upcycle;      /* dir holds a dense model (moe_checkpoint_upcycle_weights) */
} weights_reader;

/* Index of name among the dir's tensors (sorted by name), or -1. */
static int64_t dir_index(const moe_st_dir *d, const char *name) {
    int64_t lo = 0, hi = moe_st_dir_tensor_count(d);
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        int c = strcmp(moe_st_dir_tensor_at(d, mid)->name, name);
        if (c == 0) return mid;
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return -1;
}

static const char *file_of(const moe_st_dir *d, const char *name) {
    const moe_st_file *f;
    moe_st_dir_find(d, name, &f);
    return moe_st_path(f);
}

/* Finds name with shape [ndim] and marks it used as s's source; s->src is
 * NULL when absent. */
static moe_status take(source *s, weights_reader *r, const char *name, int64_t ndim, const int64_t *shape) {
    int64_t i = dir_index(r->dir, name);
    s->src = NULL;
    if (i < 0) return MOE_OK;
    const moe_st_tensor *found = moe_st_dir_tensor_at(r->dir, i);
    s->file = file_of(r->dir, name);
    MOE_TRY(check_shape(s->file, found, ndim, shape));
    r->used[i] = true;
    s->src = found;
    return MOE_OK;
}

/* The model tensor's own name, or else Qwen3-MoE's, OLMoE's and
 * Qwen2-MoE's (file_name), or else, for an expert, its place in
 * transformers' fused layout: for expert e, mlp.experts.gate_up_proj
 * [E, 2ff, d] holding w1 in rows [0, ff) and w3 in [ff, 2ff) of e's slice,
 * and mlp.experts.down_proj [E, d, ff] holding w2. */
static moe_status resolve_weight(source *s, weights_reader *r, const moe_model_tensor *t) {
    char alt[NAME_BYTES] = "", hf[NAME_BYTES];
    long long l, e;
    int w, end = 0;
    const bool expert = sscanf(t->name, EXPERT_FMT "%n", &l, &e, &w, &end) == 3 && end > 0 && t->name[end] == '\0';
    if (r->upcycle && expert) { /* every expert from its layer's MLP */
        snprintf(alt, sizeof alt, DENSE_MLP_FMT, l, proj_of(w));
        MOE_TRY(take(s, r, alt, t->ndim, t->shape));
        if (s->src == NULL)
            return moe_error(MOE_ERR_FORMAT, "%s: no tensor '%s' (the dense MLP that --upcycle copies into each of "
                                             "layer %lld's experts)",
                             r->where, alt, l);
        return MOE_OK;
    }
    MOE_TRY(take(s, r, t->name, t->ndim, t->shape));
    if (s->src != NULL) return MOE_OK;
    file_name(hf, t->name, true);
    const bool renamed = strcmp(hf, t->name) != 0;
    if (renamed) {
        MOE_TRY(take(s, r, hf, t->ndim, t->shape));
        if (s->src != NULL) return MOE_OK;
    }
    if (expert) {
        const bool down = w == 2;
        const int64_t shape[3] = {r->E, down ? r->d : 2 * r->ff, down ? r->ff : r->d};
        snprintf(alt, sizeof alt, FUSED_EXPERTS_FMT, l, down ? "down_proj" : "gate_up_proj");
        MOE_TRY(take(s, r, alt, 3, shape));
        s->first = e * shape[1] * shape[2] + (w == 3 ? r->ff * r->d : 0);
        if (s->src != NULL) return MOE_OK;
    }
    if (expert)
        return moe_error(MOE_ERR_FORMAT, "%s: no tensor '%s' (nor '%s' nor '%s')", r->where, t->name, alt, hf);
    if (renamed) return moe_error(MOE_ERR_FORMAT, "%s: no tensor '%s' (nor '%s')", r->where, t->name, hf);
    const bool tied_file = strcmp(t->name, HEAD_NAME) == 0 && dir_index(r->dir, EMBED_NAME) >= 0;
    return moe_error(MOE_ERR_FORMAT, "%s: no tensor '%s'%s", r->where, t->name,
                     tied_file ? " (a model that ties it to " EMBED_NAME " has none: tie_word_embeddings true in "
                                 "its config.json)"
                               : "");
}

/* Whether the dir's tensor i, the head, holds the embedding's bytes, as in
 * the file of a writer that saved a tied model's one tensor twice. */
static bool head_is_embedding(const weights_reader *r, int64_t i) {
    const int64_t e = dir_index(r->dir, EMBED_NAME);
    const moe_st_tensor *head = moe_st_dir_tensor_at(r->dir, i), *embed = e >= 0 ? moe_st_dir_tensor_at(r->dir, e) : NULL;
    return embed && head->dtype == embed->dtype && head->nbytes == embed->nbytes &&
           memcmp(head->data, embed->data, (size_t)head->nbytes) == 0;
}

/* A tensor the model does not use: an error, unless it is optimizer state,
 * the selection bias of one of our layers (kept by a run with it on), an
 * expert of our layers that another expert-parallel rank holds, a tensor
 * of another pipeline stage, or a tied model's head that is a copy of its
 * embedding. Upcycled, every expert is a copy of the dense MLP, so an
 * expert in the file is a mistake: the file is no dense model. */
static moe_status check_unused(const weights_reader *r, const moe_model *model, int64_t layers) {
    const bool tied = moe_model_get_config(model)->tie_word_embeddings;
    for (int64_t i = 0; i < moe_st_dir_tensor_count(r->dir); i++) {
        if (r->used[i]) continue;
        const char *name = moe_st_dir_tensor_at(r->dir, i)->name;
        if (tied && strcmp(name, HEAD_NAME) == 0) {
            if (head_is_embedding(r, i)) continue;
            return moe_error(MOE_ERR_FORMAT, "%s: tensor '%s' is not " EMBED_NAME "'s copy, and the config ties the "
                                             "head to the embedding (tie_word_embeddings true): the weights are an "
                                             "untied model's",
                             file_of(r->dir, name), name);
        }
        if (strncmp(name, OPTIMIZER_PREFIX, strlen(OPTIMIZER_PREFIX)) == 0) continue;
        const bool expert = is_expert_weight(name, layers, r->E);
        /* An MoE's own tensors (experts, router, shared experts, bias) in the dense model's file. */
        if (r->upcycle && (expert || strstr(name, MOE_BLOCK) != NULL))
            return moe_error(MOE_ERR_FORMAT, "%s: tensor '%s' is an MoE layer's, and --upcycle starts from a dense "
                                             "model (each expert a copy of its layer's MLP)",
                             file_of(r->dir, name), name);
        if (expert || is_bias(name, layers)) continue;
        if (of_other_stage(model, name, layers)) continue;
        return moe_error(MOE_ERR_FORMAT, "%s: tensor '%s' is not part of this model (a checkpoint of another model?)",
                         file_of(r->dir, name), name);
    }
    return MOE_OK;
}

/* Fills s [*count]: the model's tensors, then the biases it has. Upcycled,
 * the MoE blocks' other tensors (routers, shared experts, biases), which a
 * dense model lacks, keep the model's values. */
static moe_status resolve_weights(source *s, int64_t *count, weights_reader *r, moe_model *model) {
    const int64_t L = moe_model_get_config(model)->num_hidden_layers;
    float *params = moe_model_host_params(model);
    int64_t n = 0;
    for (int64_t i = 0; i < moe_model_tensor_count(model); i++) {
        const moe_model_tensor *t = moe_model_tensor_at(model, i);
        long long l, e;
        int w;
        if (r->upcycle && strstr(t->name, MOE_BLOCK) && sscanf(t->name, EXPERT_FMT, &l, &e, &w) != 3) continue;
        s[n] = (source){.dst = params + t->offset, .numel = t->numel};
        MOE_TRY(resolve_weight(&s[n++], r, t));
    }
    for (int64_t l = 0; l < L && !r->upcycle; l++) {
        float *bias = moe_model_router_bias(model, l); /* [E] */
        if (bias == NULL) continue;
        char name[NAME_BYTES];
        snprintf(name, sizeof name, BIAS_FMT, (long long)l);
        s[n] = (source){.dst = bias, .numel = r->E};
        MOE_TRY(take(&s[n++], r, name, 1, &r->E));
    }
    *count = n;
    return check_unused(r, model, L);
}

/* A directory without weights that holds step-NNNNNN directories is a
 * run's (moe-train --out), whose checkpoints those are: the error st gets
 * the newest's name. */
static moe_status name_runs_checkpoint(moe_status st, const char *dir) {
    char newest[NAME_MAX + 1] = "";
    int64_t newest_step = -1;
    DIR *d = opendir(dir);
    for (struct dirent *e; d && (e = readdir(d));) {
        const int64_t step = moe_checkpoint_step_of_name(e->d_name);
        if (step > newest_step) {
            newest_step = step;
            snprintf(newest, sizeof newest, "%s", e->d_name);
        }
    }
    if (d) closedir(d);
    if (newest_step < 0) return st;
    char why[MOE_ERROR_BYTES];
    snprintf(why, sizeof why, "%s", moe_last_error());
    return moe_error(st, "%s, but checkpoints of a run: give one of them, e.g. the newest, %s/%s", why, dir, newest);
}

static moe_status load_weights(moe_model *model, const char *dir, bool upcycle) {
    if (!model || !dir) return moe_error(MOE_ERR_INVALID_ARG, "moe_checkpoint_load_weights: NULL argument");
    moe_st_dir *d = NULL;
    const moe_model_config *c = moe_model_get_config(model);
    const int64_t n = moe_model_tensor_count(model) + c->num_hidden_layers;
    weights_reader r = {.E = c->num_local_experts, .d = c->hidden_size, .ff = c->intermediate_size,
                        .upcycle = upcycle};
    source *s = NULL;
    int64_t count = 0;
    moe_status st = moe_st_dir_open(&d, dir);
    if (st != MOE_OK) st = name_runs_checkpoint(st, dir);
    if (st == MOE_OK) {
        r.dir = d;
        /* The index, when there is one, is the list of tensors. */
        r.where = moe_st_dir_index_path(d) ? moe_st_dir_index_path(d) : moe_st_path(moe_st_dir_shard(d, 0));
        r.used = calloc((size_t)moe_st_dir_tensor_count(d) + 1, sizeof(bool));
        s = malloc((size_t)n * sizeof *s);
        if (!r.used || !s) st = moe_error(MOE_ERR_OUT_OF_MEMORY, "%s: out of memory", dir);
    }
    /* The host copy starts from the model's values (the padding among them). */
    if (st == MOE_OK) st = moe_model_pull(model);
    if (st == MOE_OK) st = resolve_weights(s, &count, &r, model);
    if (st == MOE_OK) st = check_values(s, count);
    /* Every rank finds its tensors before any is changed. */
    st = agree(moe_model_job(model), st);
    if (st == MOE_OK) copy_sources(s, count);
    if (st == MOE_OK) st = agree(moe_model_job(model), moe_model_push(model));
    free(s);
    free(r.used);
    if (d) moe_st_dir_close(d);
    return st;
}

moe_status moe_checkpoint_load_weights(moe_model *model, const char *dir) { return load_weights(model, dir, false); }

moe_status moe_checkpoint_upcycle_weights(moe_model *model, const char *dir) { return load_weights(model, dir, true); }

/* A __metadata__ value of digits only, at most max. */
static moe_status meta_uint(uint64_t *out, const moe_st_file *f, const char *key, uint64_t max) {
    const char *text = moe_st_metadata(f, key);
    if (text == NULL) return moe_error(MOE_ERR_FORMAT, "%s: __metadata__ has no \"%s\"", moe_st_path(f), key);
    uint64_t v = 0;
    bool ok = text[0] != '\0';
    for (const char *p = text; ok && *p != '\0'; p++) {
        unsigned digit = (unsigned)(*p - '0');
        ok = *p >= '0' && *p <= '9' && v <= (max - digit) / 10;
        v = v * 10 + digit;
    }
    if (!ok)
        return moe_error(MOE_ERR_FORMAT, "%s: __metadata__ \"%s\" is \"%.64s\", not an integer in [0, %" PRIu64 "]",
                         moe_st_path(f), key, text, max);
    *out = v;
    return MOE_OK;
}

/* A duration in seconds: finite, positive (or zero where zero_ok). */
static moe_status meta_seconds(double *out, const moe_st_file *f, const char *key, bool zero_ok) {
    const char *text = moe_st_metadata(f, key);
    double v = NAN;
    if (!moe_json_read_number(text, &v) || v < 0.0 || (v == 0.0 && !zero_ok))
        return moe_error(MOE_ERR_FORMAT, "%s: __metadata__ \"%s\" is %s%.64s%s, not a %s number of seconds",
                         moe_st_path(f), key, text ? "\"" : "", text ? text : "missing", text ? "\"" : "",
                         zero_ok ? "finite non-negative" : "finite positive");
    *out = v;
    return MOE_OK;
}

static moe_status read_meta(moe_train_state *s, const moe_st_file *f) {
    const char *version = moe_st_metadata(f, "format_version");
    if (version == NULL || strcmp(version, FORMAT_VERSION) != 0)
        return moe_error(MOE_ERR_FORMAT, "%s: __metadata__ \"format_version\" is %s%.64s%s, expected \"" FORMAT_VERSION
                                         "\"",
                         moe_st_path(f), version ? "\"" : "", version ? version : "missing", version ? "\"" : "");
    uint64_t step, token, epoch;
    MOE_TRY(meta_uint(&step, f, "step", INT64_MAX));
    MOE_TRY(meta_uint(&s->seed, f, "seed", UINT64_MAX));
    MOE_TRY(meta_uint(&s->jitter_counter, f, "jitter_counter", UINT64_MAX));
    MOE_TRY(meta_uint(&token, f, "data_token", INT64_MAX));
    MOE_TRY(meta_uint(&epoch, f, "data_epoch", MOE_DATA_EPOCH_MAX));
    /* The stream's record comes whole, or not at all from an older writer. */
    uint64_t tokens = 0, chunk = 0;
    if (moe_st_metadata(f, "data_tokens") != NULL || moe_st_metadata(f, "data_chunk") != NULL) {
        MOE_TRY(meta_uint(&tokens, f, "data_tokens", INT64_MAX));
        MOE_TRY(meta_uint(&chunk, f, "data_chunk", INT64_MAX));
    }
    s->step = (int64_t)step;
    s->data = (moe_data_position){(int64_t)token, (int64_t)epoch};
    const char *kind = moe_st_metadata(f, "data_kind");
    static const char *const kinds[] = {"synthetic", "bytes", "shards", "text"};
    bool known = kind == NULL;
    for (size_t i = 0; !known && i < sizeof kinds / sizeof kinds[0]; i++) known = strcmp(kind, kinds[i]) == 0;
    if (!known)
        return moe_error(MOE_ERR_FORMAT, "%s: __metadata__ \"data_kind\" is \"%.32s\", not synthetic, bytes, shards or text",
                         moe_st_path(f), kind);
    s->data_tokens = (int64_t)tokens;
    s->data_chunk = (int64_t)chunk;
    s->data_shuffle_seed = s->seed;
    if (moe_st_metadata(f, "data_shuffle_seed") != NULL)
        MOE_TRY(meta_uint(&s->data_shuffle_seed, f, "data_shuffle_seed", UINT64_MAX));
    snprintf(s->data_kind, sizeof s->data_kind, "%s", kind ? kind : "");
    s->pipe_layer_seconds = s->pipe_dense_layer_seconds = s->pipe_head_seconds = 0.0;
    if (moe_st_metadata(f, "pipe_layer_seconds") != NULL || moe_st_metadata(f, "pipe_head_seconds") != NULL) {
        MOE_TRY(meta_seconds(&s->pipe_layer_seconds, f, "pipe_layer_seconds", false));
        MOE_TRY(meta_seconds(&s->pipe_head_seconds, f, "pipe_head_seconds", true));
    }
    if (moe_st_metadata(f, "pipe_dense_layer_seconds") != NULL) {
        if (s->pipe_layer_seconds == 0.0)
            return moe_error(MOE_ERR_FORMAT, "%s: __metadata__ \"pipe_dense_layer_seconds\" without \"pipe_layer_seconds\"",
                             moe_st_path(f));
        MOE_TRY(meta_seconds(&s->pipe_dense_layer_seconds, f, "pipe_dense_layer_seconds", false));
    }
    return MOE_OK;
}

moe_status moe_checkpoint_read_state(moe_train_state *state, const char *dir) {
    if (!state || !dir) return moe_error(MOE_ERR_INVALID_ARG, "moe_checkpoint_read_state: NULL argument");
    char path[PATH_BYTES];
    MOE_TRY(path_join(path, dir, STATE_FILE));
    moe_st_file *f = NULL;
    MOE_TRY(moe_st_open(&f, path));
    moe_train_state got;
    const moe_status st = read_meta(&got, f);
    moe_st_close(f);
    if (st == MOE_OK) *state = got;
    return st;
}

static int cmp_name_ptr(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* Names the first tensor of f that is not an optimizer moment of a model
 * tensor, of an expert of our layers that another expert-parallel rank
 * holds, or of a tensor of another pipeline stage; MOE_OK when there is
 * none. */
static moe_status check_unknown(const moe_st_file *f, moe_model *model) {
    const moe_model_config *c = moe_model_get_config(model);
    const int64_t n = moe_model_tensor_count(model);
    const char **names = malloc((size_t)n * sizeof *names);
    if (!names) return moe_error(MOE_ERR_OUT_OF_MEMORY, "%s: out of memory", moe_st_path(f));
    for (int64_t i = 0; i < n; i++) names[i] = moe_model_tensor_at(model, i)->name;
    qsort(names, (size_t)n, sizeof *names, cmp_name_ptr);
    moe_status st = MOE_OK;
    for (int64_t i = 0; i < moe_st_tensor_count(f); i++) {
        const char *name = moe_st_tensor_at(f, i)->name, *rest = NULL;
        if (strncmp(name, EXP_AVG, strlen(EXP_AVG)) == 0) rest = name + strlen(EXP_AVG);
        if (strncmp(name, EXP_AVG_SQ, strlen(EXP_AVG_SQ)) == 0) rest = name + strlen(EXP_AVG_SQ);
        if (rest && (bsearch(&rest, names, (size_t)n, sizeof *names, cmp_name_ptr) ||
                     is_expert_weight(rest, c->num_hidden_layers, c->num_local_experts) ||
                     of_other_stage(model, rest, c->num_hidden_layers)))
            continue;
        st = moe_error(MOE_ERR_FORMAT, "%s: tensor '%s' is not an optimizer moment of this model's tensors",
                       moe_st_path(f), name);
        break;
    }
    free(names);
    return st;
}

/* Fills s [*count] with where this rank's moments come from: for every
 * tensor, the part inside the parameters whose state this rank keeps. */
static moe_status resolve_moments(source *s, int64_t *count, const moe_st_file *f, moe_model *model,
                                  moe_trainer *trainer) {
    const int64_t n = moe_model_tensor_count(model);
    int64_t k = 0;
    for (int r = 0; r < MOE_RUN_COUNT; r++) {
        const moe_optim_shard sh = moe_trainer_shard(trainer, (moe_model_run_id)r);
        for (int64_t i = 0; i < 2 * n; i++) {
            const moe_model_tensor *t = moe_model_tensor_at(model, i % n);
            const int64_t a = max64(t->offset, sh.begin), b = min64(t->offset + t->numel, sh.end);
            if (a >= b) continue;
            char name[NAME_BYTES];
            snprintf(name, sizeof name, "%s%s", i < n ? EXP_AVG : EXP_AVG_SQ, t->name);
            const moe_st_tensor *found = moe_st_find(f, name);
            if (found == NULL) return moe_error(MOE_ERR_FORMAT, "%s: no tensor '%s'", moe_st_path(f), name);
            MOE_TRY(check_shape(moe_st_path(f), found, t->ndim, t->shape));
            s[k++] = (source){(i < n ? sh.m : sh.v) + (a - sh.begin), found, a - t->offset, b - a, moe_st_path(f),
                              i >= n};
        }
    }
    *count = k;
    /* Names are unique, so every expected one found and a larger count
     * means some tensor is not ours, or is another rank's. */
    if (moe_st_tensor_count(f) != 2 * n) return check_unknown(f, model);
    return MOE_OK;
}

moe_status moe_checkpoint_load_state(moe_trainer *trainer, moe_model *model, moe_train_state *state,
                                     const char *dir) {
    if (!trainer || !model || !state || !dir)
        return moe_error(MOE_ERR_INVALID_ARG, "moe_checkpoint_load_state: NULL argument");
    char path[PATH_BYTES];
    moe_st_file *f = NULL;
    source *s = NULL;
    int64_t count = 0;
    moe_train_state got;
    moe_status st = path_join(path, dir, STATE_FILE);
    if (st == MOE_OK) st = moe_st_open(&f, path);
    if (st == MOE_OK) {
        /* A tensor meets at most one run's state, in each moment. */
        s = malloc((size_t)(2 * moe_model_tensor_count(model)) * sizeof *s);
        st = s ? read_meta(&got, f) : moe_error(MOE_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
    }
    if (st == MOE_OK) st = moe_trainer_pull(trainer);
    if (st == MOE_OK) st = resolve_moments(s, &count, f, model, trainer);
    if (st == MOE_OK) st = check_values(s, count);
    /* Every rank finds its moments before any is changed. */
    st = agree(moe_model_job(model), st);
    if (st == MOE_OK) {
        copy_sources(s, count);
        st = agree(moe_model_job(model), moe_trainer_push(trainer));
    }
    if (st == MOE_OK) {
        moe_trainer_set_steps_done(trainer, got.step);
        moe_model_set_jitter_counter(model, got.jitter_counter);
        *state = got;
    }
    free(s);
    if (f) moe_st_close(f);
    return st;
}

moe_status moe_checkpoint_load_config(moe_model_config *cfg, const char *dir, bool resuming, moe_warn_fn warn,
                                      void *warn_ctx) {
    if (!cfg || !dir) return moe_error(MOE_ERR_INVALID_ARG, "moe_checkpoint_load_config: NULL argument");
    char path[PATH_BYTES], state[PATH_BYTES];
    MOE_TRY(path_join(path, dir, CONFIG_FILE));
    MOE_TRY(path_join(state, dir, STATE_FILE));
    MOE_TRY(moe_model_config_load(cfg, path, warn, warn_ctx));
    /* A checkpoint of ours records the checksum (a model alone, another
     * tool's or an older one's does not): one flipped digit would change
     * the model, with nothing to say so. */
    if (!exists(state)) return MOE_OK;
    moe_st_file *f;
    MOE_TRY(moe_st_open(&f, state));
    uint64_t want = 0;
    uint32_t got = 0;
    moe_status st = MOE_OK;
    if (moe_st_metadata(f, "config_crc32c")) {
        st = meta_uint(&want, f, "config_crc32c", UINT32_MAX);
        if (st == MOE_OK) st = moe_model_config_crc32c(cfg, &got);
    }
    moe_st_close(f);
    if (st != MOE_OK || got == want) return st;
    /* The file as saved, read otherwise by this build than by the one
     * that saved it (whose config.json is the checksummed rendering): a
     * model of dense layers only that an earlier moe wrote as an MoE type
     * is one form of it now. It has not changed, so a resume goes ahead,
     * on this build's reading of it. */
    char *text;
    size_t len;
    st = moe_file_read_all(&text, &len, path, MOE_MODEL_CONFIG_MAX_BYTES);
    if (st != MOE_OK) return st;
    const uint32_t as_saved = moe_crc32c(0, text, len);
    free(text);
    if (as_saved == want) {
        char note[MOE_ERROR_BYTES];
        snprintf(note, sizeof note,
                 "%.400s is the file saved with the checkpoint (CRC-32C %08" PRIx32 ", as recorded), which the "
                 "moe that saved it wrote otherwise than this one writes the model it reads (%08" PRIx32 "): it "
                 "is read as this moe reads it, which may differ from the model saved",
                 path, as_saved, got);
        if (warn) warn(warn_ctx, note);
        return MOE_OK;
    }
    char message[MOE_ERROR_BYTES];
    snprintf(message, sizeof message,
             "%.400s: the config reads otherwise than the one saved with the checkpoint (CRC-32C %08" PRIx32
             ", %.400s recorded %08" PRIx64 "): it was changed %s",
             path, got, state, want,
             resuming ? "or damaged since, and a resumed run must be the run saved (start a new one from it with "
                        "--init-from)"
                      : "since; using it as it is");
    /* Resuming, a config that reads wrongly every time, as a malformed one does. */
    if (resuming) return moe_error(MOE_ERR_CONFIG, "%s", message);
    if (warn) warn(warn_ctx, message);
    return MOE_OK;
}
