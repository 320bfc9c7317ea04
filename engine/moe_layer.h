/* moe_layer.h: the parts of the MoE layer that the rest of the engine needs
 * beyond the public API: building a layer inside memory that a model owns. */
#ifndef MOE_ENGINE_MOE_LAYER_H
#define MOE_ENGINE_MOE_LAYER_H

#include "comm/comm.h"
#include "kernels/ops.h"
#include "moe.h"

/* Floats of parameters one rank of an expert-parallel group of ep_size ranks
 * holds of a layer with this (valid) config: the router, E / ep_size
 * experts, and the shared experts. */
int64_t moe_layer_config_param_count(const moe_layer_config *cfg, int ep_size);

/* The shared experts' MLP width, n_shared_experts x (shared_d_ff or d_ff);
 * 0 without them. */
int64_t moe_layer_shared_width(const moe_layer_config *cfg);

/* Floats of the shared experts' parameters, the gate's included. */
int64_t moe_layer_shared_params(const moe_layer_config *cfg);

/* Where a layer's parameters and gradients live: three runs, so that a model
 * can keep what every rank holds (router, shared experts) apart from what
 * each rank holds alone (its experts) and reduce each run with one call. */
typedef struct moe_layer_memory {
    const moe_ops *ops;            /* the backend, whose memory these are; NULL: the CPU */
    moe_comm *ep_rows;             /* the EP group's ranks over a communicator for backend memory (NCCL
                                      under CUDA), which the rows travel on; NULL: ep itself */
    float *router, *router_grad;   /* [E, d] */
    float *experts, *experts_grad; /* [E/P, 3 ff d]: per expert w1, w3, w2 */
    float *shared, *shared_grad;   /* [3 S d]: gate_proj, up_proj, down_proj; NULL without */
} moe_layer_memory;

/* Like moe_layer_create, but the parameters and gradients live in the
 * caller's memory, which must outlive the layer; they are left as they are
 * (not initialised). moe_layer_params() and moe_layer_grads() return NULL
 * for such a layer: its views say where everything is. The gradients may
 * all be NULL: the layer then runs forwards only (its views' grad NULL, a
 * backward refused), as an inference model's do.
 *
 * ep: the expert-parallel group of P ranks (NULL or P = 1: one rank). Rank r
 * holds experts r E/P .. (r+1) E/P - 1, named by their global ids. Each rank
 * passes its own tokens; forward and backward are collective over ep.
 *
 * batch: the ranks whose tokens make up the global batch, in batch order
 * (NULL: ep). The router's statistics (aux and z losses, load) and capacity
 * are those of the global batch, so any split of it computes what one rank
 * computes on all of it. The EP group must be consecutive batch ranks.
 *
 * The gradients of the router and the shared experts are this rank's
 * share, and each expert's gradient covers the EP group's tokens: the caller
 * sums the former over the batch ranks and the latter over the expert's
 * replicas (the data-parallel all-reduces do).
 *
 * On a device backend, forward waits once, for the routing totals, and
 * backward not at all: both return with ops still queued, and the owner's
 * next sync or download waits for them and reports a failure among them. */
moe_status moe_layer_create_in(moe_layer **layer, const moe_layer_config *cfg, const moe_layer_memory *mem,
                               moe_comm *ep, moe_comm *batch);

/* moe_layer_create on any backend of the op table: parameters, gradients
 * and every buffer the calls take live in ops' memory (moe_layer_create_cuda
 * is this over the CUDA table; the CPU tests use moe_strict_ops()). */
moe_status moe_layer_create_on_ops(moe_layer **layer, const moe_layer_config *cfg, const moe_ops *ops);

/* Fills the layer's parameters with N(0, std^2) draws from (seed, stream). */
moe_status moe_layer_init_params(moe_layer *layer, float std, uint64_t seed, uint64_t stream);

/* Multiplies the aux and z-loss gradients that backward adds (default 1): a
 * model that averages over layers and micro-batches scales them here. */
void moe_layer_set_loss_scale(moe_layer *layer, double scale);

/* This rank's router choices topk_idx [T, k] of the last forward, copied
 * to the host on request (a wait for the backend); valid until the next
 * call or forward. */
moe_status moe_layer_last_topk(moe_layer *layer, const int32_t **topk);

/* Training forwards so far: it picks the jitter noise, so a resumed run
 * restores it to draw the same noise as an unbroken one. */
uint64_t moe_layer_jitter_counter(const moe_layer *layer);
void moe_layer_set_jitter_counter(moe_layer *layer, uint64_t counter);

/* Replay: the next forwards recompute earlier training forwards (the
 * caller sets the jitter counter back to theirs), so that a backward can
 * follow them again; they count no load toward the bias step, which the
 * first pass counted. */
void moe_layer_set_replay(moe_layer *layer, bool replay);

/* Twins: layers made over the same parameters and gradients (the same
 * moe_layer_memory and config), each keeping its own forward's state for
 * its backward, so that a pipeline stage holds several micro-batches in
 * flight. A twin routes with its owner's selection bias, adds its load to
 * the owner's, and draws the jitter noise of, and advances, the owner's
 * counter, so that forwards on any twin are those of one layer; the
 * owner's bias step answers them all. The owner outlives its twins. */
moe_status moe_layer_share_state(moe_layer *twin, moe_layer *owner);

/* The layer's arrays, sized for forwards of up to T tokens on every batch
 * rank, so that such forwards (and, with backward, their backwards)
 * allocate nothing (a forward of more tokens grows them). */
moe_status moe_layer_reserve(moe_layer *layer, int64_t T, bool backward);

/* Layers that run one at a time (a model's) may share memory: layer drops
 * its backward scratch (what only a backward writes and reads) for with's,
 * and with activations also its forward's activations, each forward then
 * overwriting the last one's, as when a model recomputes a layer's forward
 * just before its backward. A backward whose activations another layer's
 * forward has overwritten fails with MOE_ERR_STATE. The layers must have
 * one backend, expert-parallel size and shape (the config but for its
 * seed, coefficients and capacity; whether the sequence-wise loss is on,
 * and its seq_len, are shape); the memory lives while either does. */
moe_status moe_layer_share_workspace(moe_layer *layer, moe_layer *with, bool activations);

/* Backend bytes of the arrays the layer uses; a block that layers share
 * counts with one of them only (its maker while that lives), so the sum
 * over the layers is what they hold together. */
int64_t moe_layer_workspace_bytes(moe_layer *layer);

/* Expert parallelism: a token travels once to each rank that holds any of
 * its experts, and comes back as one row, that rank's experts' outputs
 * weighted and summed (DeepEP's dispatch and combine). By default the
 * experts wait for every source rank's tokens; with overlap they take the
 * half of the EP group holding this rank first, as soon as its tokens are
 * in, and send those results back at once, overlapping the other half's
 * messages. The weight
 * gradients then sum per half: the two agree within float summation order,
 * not to the bit. Each half's GEMMs are smaller: where the exchange is
 * cheap next to the experts, overlap costs more than it hides. */
void moe_layer_set_overlap(moe_layer *layer, bool overlap);

/* Where forward and backward spent their time since the last reset. The
 * exchange is everything that moves rows between token order and the
 * experts: permute, dispatch and return (the messages between ranks),
 * combine and unpermute, in both directions. Host clock: on a device
 * backend, whose ops return queued, only the waits on messages show. */
typedef struct moe_layer_timing {
    double exchange_seconds;
    double experts_seconds;
    int64_t exchange_bytes; /* sent by this rank to other ranks */
    int64_t calls;          /* forwards plus backwards */
} moe_layer_timing;

void moe_layer_get_timing(const moe_layer *layer, moe_layer_timing *timing);
void moe_layer_reset_timing(moe_layer *layer);

#endif /* MOE_ENGINE_MOE_LAYER_H */
