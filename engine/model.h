/* model.h: a Mixtral-style MoE transformer (what Hugging Face's
 * MixtralForCausalLM computes), forward and backward, on any backend of
 * the op table (kernels/ops.h): every array lives in the backend's memory,
 * and the host moves only tokens, losses, routing counts and the gradient
 * norm in and out.
 *
 * Parameters and gradients each live in one allocation, carved into named
 * views whose names are the Hugging Face tensor names; activations live in
 * one arena sized at creation from (config, B, T). */
#ifndef MOE_ENGINE_MODEL_H
#define MOE_ENGINE_MODEL_H

#include <stdbool.h>
#include <stdint.h>

#include "comm/comm.h"
#include "engine/model_config.h"
#include "kernels/ops.h"
#include "moe.h"

#define MOE_TENSOR_NAME_BYTES 96

typedef struct moe_model_tensor {
    char name[MOE_TENSOR_NAME_BYTES]; /* Hugging Face name */
    int ndim;                         /* 1 or 2 */
    int64_t shape[2];                 /* [rows, cols]; shape[1] = 1 when ndim = 1 */
    int64_t offset;                   /* into the parameter (and gradient) array */
    int64_t numel;
    bool decay;                       /* AdamW weight decay: every matrix, no norm or bias */
    bool bias;                        /* a projection's bias: starts at 0, where a norm's weight starts at 1 */
    int64_t init_stream;              /* its index in the one-rank table: seeds its initial values */
} moe_model_tensor;

typedef struct moe_model moe_model;

/* A pipeline stage holds at most this many chunks (moe_model_parallel): a
 * bit each in a uint64_t. */
#define MOE_MODEL_CHUNKS_MAX 64

/* Builds the model for batches of B sequences of T tokens and initialises
 * the parameters as Hugging Face does: N(0, initializer_range^2) for every
 * matrix, 1 for every norm, from seed. */
moe_status moe_model_create(moe_model **model, const moe_model_config *cfg, int64_t B, int64_t T, uint64_t seed);

/* The ranks a model is spread over. world: the data-parallel ranks (of
 * this rank's pipeline stage, on a pipeline; not every rank) whose
 * batches form the global batch (rank r reads rows r*B .. r*B + B - 1 of
 * it). ep: this rank's expert-parallel group, consecutive world ranks, each
 * holding E / |ep| experts of every layer. NULL members mean one rank. */
typedef struct moe_model_parallel {
    moe_comm *world;
    moe_comm *ep;
    const moe_ops *ops; /* the backend the model runs on; NULL: the CPU */
    /* The same ranks over communicators for backend memory (NCCL under
     * CUDA), which gradients and the MoE rows travel on; NULL: world and ep
     * carry backend memory too (host backends). Counts, losses and norms
     * always travel on world and ep. */
    moe_comm *device_world;
    moe_comm *device_ep;
    /* Pipeline parallelism. pipe: the stages of this rank's pipeline,
     * ranked by stage (the same data-parallel rank in every stage). The
     * layers are cut into pipe's size x chunks runs, virtual stages
     * v = c * stages + s, virtual stage v holding layers [stage_layers[v],
     * stage_layers[v + 1]): stage s holds chunks 0 .. chunks - 1, runs
     * s, s + stages, ... of the layers (one run, chunks = 1, unless the
     * pipeline interleaves), the first stage the embedding too, the last
     * the final norm and the head. NULL: one stage holding every layer
     * (chunks and stage_layers unused). device_pipe: the same ranks for
     * backend memory (the activations and their gradients between
     * stages); NULL: pipe. job: every rank of the grid, every stage and
     * every data-parallel rank, over which checkpoints gather and agree; a
     * pipeline needs it, and without one NULL means world. */
    moe_comm *pipe;
    moe_comm *device_pipe;
    moe_comm *job;
    int chunks;                  /* 1 to MOE_MODEL_CHUNKS_MAX */
    const int64_t *stage_layers; /* [stages * chunks + 1], the same on every rank; the model keeps no pointer */
    /* Activation recomputation: between its forward and its backward a
     * layer keeps only its input; the backward runs the layer's forward
     * again first. The layers' other activations, and their MoE
     * workspaces, are then one set for the whole stage (twins included)
     * instead of one per layer, for about one more forward of compute per
     * step. Results are the same bits. */
    bool recompute;
    /* Inference (generation): no backward. The layers share one set of
     * forward activations and keep only their keys and values (the cache
     * moe_model_decode reads); no backward scratch but decoding's. A
     * trainer refuses such a model, and it holds no gradients
     * (moe_model_grads is NULL). Not with recompute. */
    bool inference;
    /* Inference that only decodes (moe_model_decode, each row from its
     * position 0): no forward over [B, T], so every array but the cache
     * holds one position per row, and memory grows with T through the
     * cache alone (a forward's attention scores are B x heads x T x T).
     * Needs inference. */
    bool decode_only;
} moe_model_parallel;

/* moe_model_create on a grid of ranks; collective over par->world (and,
 * on a pipeline, over pipe and job). Every
 * rank draws the initial values one rank would (by tensor), so the result
 * does not depend on the grid. */
moe_status moe_model_create_parallel(moe_model **model, const moe_model_config *cfg, int64_t B, int64_t T,
                                     uint64_t seed, const moe_model_parallel *par);
void moe_model_destroy(moe_model *model);

/* A twin of base: the same parameters, gradients, tensor table and ranks,
 * with activations and MoE layer state of its own for the chunks of the
 * stage it serves (bit c of chunks: chunk c; a stage that does not
 * interleave has chunk 0 alone), so that a pipeline stage keeps several
 * micro-batches' forwards for their backwards; it runs only those
 * chunks. Its layers
 * route with base's selection bias, add their load to base's, and draw
 * and advance base's jitter counters (moe_layer_share_state): forwards on
 * any twin are forwards of base. Checkpoints, the bias step and the host
 * view of the parameters are base's. Destroy twins before base.
 * Collective over the expert-parallel group, whose ranks make their twins
 * together (as a stage's ranks do). */
moe_status moe_model_create_twin(moe_model **twin, moe_model *base, uint64_t chunks);

/* Whether a model of cfg can take batches of B sequences of T tokens (what
 * moe_model_create checks first): T within max_position_embeddings, and
 * the batch's arrays within reach of int sizes. */
moe_status moe_model_check_shape(const moe_model_config *cfg, int64_t B, int64_t T);

/* Backend bytes of the model's activations, its MoE layers' workspaces
 * included; a twin counts what it adds to its base. */
int64_t moe_model_activation_bytes(const moe_model *model);

/* Bytes of expert rows this instance's MoE layers have sent to other
 * ranks since it was made (forwards, backwards, recomputations). */
int64_t moe_model_exchange_bytes(const moe_model *model);

const moe_model_config *moe_model_get_config(const moe_model *model);
int64_t moe_model_batch_size(const moe_model *model); /* B */
int64_t moe_model_seq_len(const moe_model *model);    /* T */
/* The data-parallel world (1 and 0 on one rank; its communicator NULL). */
int moe_model_world_size(const moe_model *model);
int moe_model_world_rank(const moe_model *model);
moe_comm *moe_model_world(const moe_model *model);
int64_t moe_model_tensor_count(const moe_model *model);
const moe_model_tensor *moe_model_tensor_at(const moe_model *model, int64_t index);
const moe_model_tensor *moe_model_find_tensor(const moe_model *model, const char *name);
/* The length of the parameter and gradient arrays: every tensor, plus the
 * zeros that pad the runs on several ranks (moe_model_run). */
int64_t moe_model_param_count(const moe_model *model);
/* The arrays are the backend's memory (moe_model_ops): for the op table,
 * not for the host unless the backend is host_visible. */
float *moe_model_params(moe_model *model); /* [param_count] */
float *moe_model_grads(moe_model *model);  /* [param_count] */
const moe_ops *moe_model_ops(const moe_model *model);

/* The parameters on the host: the array itself on a host-visible backend,
 * else a host copy that pull refreshes (NULL before the first pull) and
 * push writes back. Checkpoints read and write parameters here. */
float *moe_model_host_params(moe_model *model); /* [param_count] */
moe_status moe_model_pull(moe_model *model);
moe_status moe_model_push(moe_model *model);

/* The arrays hold two runs: the dense one (embedding, attention, norms,
 * routers, shared experts, dense layers' MLPs, head: those of this rank's
 * stage), the same on
 * every data-parallel rank of the stage (the world), then this rank's
 * experts, the same on the ranks of its replica group. Each run is padded
 * with zeros to a multiple of its group's size, so a reduce-scatter or an
 * all-gather over the group moves equal blocks (optimizer-state sharding);
 * no tensor lies in the padding and nothing writes there. */
typedef enum moe_model_run_id { MOE_RUN_DENSE = 0, MOE_RUN_EXPERTS, MOE_RUN_COUNT } moe_model_run_id;

typedef struct moe_model_run {
    int64_t offset;  /* its first element in the arrays */
    int64_t count;   /* its parameters, from offset */
    int64_t padded;  /* count rounded up to a multiple of the group's size */
    moe_comm *group; /* the ranks that hold the same values and sum their gradients: the
                        world (dense) or the expert replicas; NULL: this rank alone */
    moe_comm *device_group; /* the same ranks, for the arrays themselves (gradients, parameters) */
} moe_model_run;

moe_model_run moe_model_get_run(const moe_model *model, moe_model_run_id run);

/* Parameters touched by one token: the dense run (dense layers' MLPs
 * included) and top_k experts per MoE layer, on any grid. */
int64_t moe_model_active_param_count(const moe_model *model);
/* Training FLOPs of one forward + backward over B*T tokens, for MFU: 6 per
 * active parameter but the embedding (the norms' few weights counted as if
 * they were matmuls'), plus attention's two causal T x T products. */
double moe_model_step_flops(const moe_model *model);

/* This rank's pipeline stage: stage index of count (0 of 1 without a
 * pipeline), its chunks (moe_model_parallel), and whether it holds the
 * embedding (first, chunk 0's) and the head (last, the last chunk's). */
typedef struct moe_model_stage {
    int index, count, chunks;
    bool first, last;
    moe_comm *pipe;        /* NULL: one stage */
    moe_comm *device_pipe; /* pipe, for backend memory */
} moe_model_stage;

moe_model_stage moe_model_get_stage(const moe_model *model);
/* This stage's layers in the model's numbering, ascending: *count of them. */
const int64_t *moe_model_layer_ids(const moe_model *model, int64_t *count);
/* Whether this stage holds layer l of the model. */
bool moe_model_holds_layer(const moe_model *model, int64_t l);

/* Whether chunk of stage starts from the embedding (the first stage's
 * chunk 0), or ends with the head (the last stage's last chunk): the
 * pipeline's ends, which take tokens and targets instead of messages. */
static inline bool moe_stage_entry(const moe_model_stage *stage, int chunk) { return stage->first && chunk == 0; }
static inline bool moe_stage_exit(const moe_model_stage *stage, int chunk) {
    return stage->last && chunk == stage->chunks - 1;
}
/* Every rank of the grid (checkpoints gather over it); NULL on one rank. */
moe_comm *moe_model_job(const moe_model *model);

/* Per-expert statistics of the last forward, summed over layers. On a
 * pipeline stage each is this chunk's share of the whole model's value
 * (its layers' sums over the model's layer count, the cross-entropy on the
 * last stage's last chunk alone), so that the chunks' and stages' values
 * add up to the model's. */
typedef struct moe_model_stats {
    double loss;           /* CE + the coefficients times logit z, aux, seq aux and z */
    double ce_loss;        /* mean cross-entropy over this rank's counted targets (not negative) */
    double logit_z_loss;   /* mean over them of logsumexp(logits)^2, before its coefficient (with one or not) */
    double aux_loss;       /* mean over layers, before the coefficient */
    double seq_aux_loss;   /* the sequence-wise one's, the same way (0 outside training) */
    double z_loss;         /* mean over layers, before the coefficient */
    double load_imbalance; /* mean over layers of max/mean expert load */
    double rank_imbalance; /* mean over layers of max/mean rows an expert-parallel rank keeps */
    double dropped_frac;   /* dropped (token, slot) pairs / all pairs */
} moe_model_stats;

/* Its fields, all doubles, as an array (moe_model_stats_to, _from): sums
 * over micro-batches and pipeline stages go field by field, whatever the
 * fields. */
#define MOE_MODEL_STATS_FIELDS (sizeof(moe_model_stats) / sizeof(double))
_Static_assert(sizeof(moe_model_stats) % sizeof(double) == 0, "moe_model_stats holds doubles only");
void moe_model_stats_to(double *v, const moe_model_stats *s);
void moe_model_stats_from(moe_model_stats *s, const double *v);

/* acc += s, and s /= d, field by field. */
void moe_model_stats_add(moe_model_stats *acc, const moe_model_stats *s);
void moe_model_stats_div(moe_model_stats *s, double d);

/* Jitter noise on (training) or off. */
void moe_model_set_training(moe_model *model, bool training);

/* Forward over inputs [B, T]; with targets [B, T] (every one in [0, vocab),
 * or negative to ignore a position) it computes the loss into stats. */
moe_status moe_model_forward(moe_model *model, const int32_t *inputs, const int32_t *targets,
                             moe_model_stats *stats);

/* Backward of the last forward (which must have had targets), accumulating
 * gradients of loss * grad_scale (1 / micro-batches under accumulation):
 * the forward's tokens and targets are the ones differentiated. */
moe_status moe_model_backward(moe_model *model, float grad_scale);

/* Whether a batch's inputs [B*T] lie in [0, vocab) and its targets [B*T]
 * below vocab (negative ones are ignored); either may be NULL. A forward
 * checks what it is given; a pipeline checks a step's batches on every
 * stage before any stage starts, so that a bad batch fails them all at
 * once rather than one, with the others left waiting for it. */
moe_status moe_model_check_batch(const moe_model *model, const int32_t *inputs, const int32_t *targets);

/* The forward and backward of one chunk of a pipeline stage (chunk 0 of
 * a stage that does not interleave); moe_model_forward and
 * moe_model_backward are these on a model of one stage. Each chunk holds
 * one forward until its backward, its own micro-batch's. A chunk but the
 * first stage's chunk 0 starts from x [N, C] (backend memory: the previous
 * virtual stage's output) and does not read inputs; one but the last
 * stage's last chunk ends at moe_model_stage_output and does not read
 * targets; but every chunk checks whichever it is given
 * (moe_model_check_batch), or either may be NULL. A backward but the last
 * stage's last chunk's starts from dy [N, C] (backend memory: the gradient
 * of the chunk's output, from the next virtual stage); one but the first
 * stage's chunk 0's ends with the gradient of its input in
 * moe_model_stage_input_grad. replay: this forward recomputes one of the
 * same step whose activations were overwritten since (its jitter counter
 * set back to that forward's), so that its backward can run: it counts no
 * load toward the bias step. */
moe_status moe_model_stage_forward(moe_model *model, int chunk, const int32_t *inputs, const float *x,
                                   const int32_t *targets, bool replay, moe_model_stats *stats);
moe_status moe_model_stage_backward(moe_model *model, int chunk, const float *dy, float grad_scale);
/* [N, C] backend memory, until the next forward of any chunk; NULL for the last stage's last chunk */
float *moe_model_stage_output(moe_model *model, int chunk);
/* [N, C] backend memory, until the next backward; NULL for the first stage's chunk 0 */
float *moe_model_stage_input_grad(moe_model *model, int chunk);

void moe_model_zero_grad(moe_model *model);

/* Data parallelism: set before the last micro-batch's backward of a step,
 * which then sums every gradient over the ranks that share it (the
 * replicated tensors over the world, each expert over its replicas), each
 * layer's as soon as that layer's backward is done, overlapping the rest of
 * the backward. finish waits for the sums. No-ops on one rank. */
void moe_model_set_grad_sync(moe_model *model, bool sync);
moe_status moe_model_finish_grad_sync(moe_model *model);

/* The squared L2 norm of the whole model's gradient, every expert counted
 * once however the experts are spread, every stage's layers summed.
 * Collective over the EP group and the pipeline. */
moe_status moe_model_grad_sumsq(moe_model *model, double *out);

/* Per-token results of the last forward: the cross-entropy losses [B*T],
 * and layer l's router choices [B*T, k], copied from the backend on request
 * (valid until the next request or forward). */
const float *moe_model_last_losses(const moe_model *model);
moe_status moe_model_last_topk(moe_model *model, int64_t layer, const int32_t **topk);
/* The logits [V] of the last forward at (row, pos) of its [B, T] batch,
 * copied to out; a backward since then has overwritten them (an error). */
moe_status moe_model_last_logits(moe_model *model, int64_t row, int64_t pos, float *out);

/* Decoding with a key-value cache, which is the model's own keys and
 * values: n tokens (1 to moe_model_decode_capacity) each go through the
 * layers at one position: token[i] at position pos[i] of row row[i],
 * whose key and value replace that position's, attending to positions
 * 0 .. pos[i] of its row. A row's positions before pos[i] must hold keys:
 * a forward over rows [B, T] fills every position, a decoding step its
 * own, so a row may also be decoded from position 0 up without any
 * forward; a row may come more than once in a step, at rising positions
 * (a prompt, a chunk at a time). Their logits [n, V] come to the host;
 * logits NULL: the step only fills the cache (no head), which a
 * decode-only model needs for a chunk, as its steps with logits take at
 * most B tokens. The
 * logits are those a forward over rows holding these tokens would give at
 * pos[i], to rounding, while routing is dropless. Eval mode
 * (moe_model_set_training false), one rank and stage, no recomputation
 * (which keeps no keys); the last forward's activations and logits are
 * spent. */
moe_status moe_model_decode(moe_model *model, int64_t n, const int64_t *row, const int32_t *token, const int64_t *pos,
                            float *logits);
/* Whether moe_model_decode can serve the model at all: one rank and stage,
 * and no recomputation. */
bool moe_model_can_decode(const moe_model *model);
/* Tokens one moe_model_decode step takes at most: B for an inference
 * model, B x 64 (or B x T when shorter) for a decode-only one (B when
 * the step returns logits), B x T for a training one. */
int64_t moe_model_decode_capacity(const moe_model *model);
/* Whether the model was made for inference (moe_model_parallel.inference). */
bool moe_model_inference(const moe_model *model);

/* Layer l's auxiliary-loss-free selection bias [E], or NULL when off (or l
 * is not a layer of this stage);
 * checkpoints keep it under DeepSeek-V3's name
 * model.layers.N.block_sparse_moe.gate.e_score_correction_bias. */
float *moe_model_router_bias(moe_model *model, int64_t layer);

/* Training forwards so far, which pick the jitter noise; restored on
 * resume. A pipeline stage of dense MLP layers only draws none and counts
 * none: 0 (the stages that route agree). */
uint64_t moe_model_jitter_counter(const moe_model *model);

/* The logits' z-loss (PaLM's): coef times the mean over the counted
 * targets of logsumexp(logits)^2 joins the loss and its gradient, for the
 * model and its twins; 0 (the default) is none. The caller checks coef. */
void moe_model_set_logit_z_loss(moe_model *model, double coef);

/* The experts' load: per layer of this stage, the (token, slot) pairs each
 * expert kept over the global batch, summed over the training forwards of
 * the model and its twins since the last call (replays and evaluations
 * aside), into load [layers of the stage, E] (NULL: dropped); the count
 * starts again. */
void moe_model_take_expert_load(moe_model *model, int64_t *load);
void moe_model_set_jitter_counter(moe_model *model, uint64_t counter);

/* Every layer's experts take half the source ranks' tokens while the rest
 * are in flight (moe_layer_set_overlap). */
void moe_model_set_overlap(moe_model *model, bool overlap);

/* The auxiliary-loss-free bias step of every layer (no-op when off), once
 * per optimizer step: each layer answers the load summed over its training
 * forwards since the last update, all the step's micro-batches. */
moe_status moe_model_update_router_bias(moe_model *model);

#endif /* MOE_ENGINE_MODEL_H */
