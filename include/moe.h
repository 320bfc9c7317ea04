/* moe.h: the one public C API of libmoe, a Mixture-of-Experts training engine.
 *
 * Conventions
 *  - Every function that can fail returns moe_status; MOE_OK is 0.
 *  - On failure, moe_last_error() returns a message for the calling thread that
 *    names the field, value or file at fault. It stays valid until the next
 *    failing call on the same thread.
 *  - Handles are opaque. Buffers are the caller's: the library never keeps a
 *    pointer to one past the call that received it.
 *  - Tensors are row-major fp32 unless said otherwise; shapes are written
 *    [rows, cols] beside each pointer.
 *  - Sizes and counts are int64_t.
 */
#ifndef MOE_H
#define MOE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MOE_VERSION_MAJOR 0
#define MOE_VERSION_MINOR 1
#define MOE_VERSION_PATCH 0

typedef enum moe_status {
    MOE_OK = 0,
    MOE_ERR_INVALID_ARG,   /* a NULL pointer, a negative argument (T), buffers that overlap */
    MOE_ERR_CONFIG,        /* a configuration value that cannot work (a size out of range, an unknown gate kind) */
    MOE_ERR_OUT_OF_MEMORY, /* an allocation failed */
    MOE_ERR_IO,            /* a file could not be opened, read or written */
    MOE_ERR_FORMAT,        /* a file's contents are malformed or inconsistent */
    MOE_ERR_STATE,         /* calls made out of order (backward before forward) */
    MOE_ERR_UNSUPPORTED,   /* not built in, or no device */
    MOE_ERR_COMM,          /* a collective failed or a peer rank died */
    MOE_ERR_INTERNAL,      /* a bug in libmoe: please report it */
    MOE_STATUS_COUNT
} moe_status;

/* A short constant description of a status, e.g. "invalid configuration". */
const char *moe_status_string(moe_status status);

/* The detail of the last failure on this thread, or "" if none. */
const char *moe_last_error(void);

/* The library's version, as built: "0.1.0". */
const char *moe_version_string(void);
void moe_version(int *major, int *minor, int *patch);

/* ---------------------------------------------------------------- MoE layer */

typedef enum moe_gate_kind {
    /* p = softmax(logits) over all experts, then the k largest (Mixtral). */
    MOE_GATE_SOFTMAX_TOPK = 0,
    /* the k largest logits, then softmax over those k only. */
    MOE_GATE_TOPK_SOFTMAX = 1,
    /* s = sigmoid(logits), the k largest, weights s / sum of the k chosen
     * (DeepSeek-V3). The weights are always normalised over the chosen k. */
    MOE_GATE_SIGMOID = 2
} moe_gate_kind;

typedef struct moe_layer_config {
    int64_t d_model;   /* hidden size d */
    int64_t d_ff;      /* each routed expert's intermediate size */
    int64_t n_experts; /* E */
    int64_t top_k;     /* k, 1 <= k <= E */
    moe_gate_kind gate;
    /* Divide the k chosen probabilities by their sum (Mixtral: on). Ignored by
     * MOE_GATE_TOPK_SOFTMAX and MOE_GATE_SIGMOID, which always normalise. */
    int renormalize;
    /* 0: dropless. > 0: each expert takes at most ceil(cf * T * k / E) of the
     * (token, slot) pairs, first come in token order; the rest are dropped. */
    double capacity_factor;
    /* Switch/GShard balancing loss E * sum_e f_e * P_e, times this. */
    double aux_loss_coef;
    /* DeepSeek-V3's sequence-wise balancing loss: the same sum taken over
     * each sequence of seq_len consecutive tokens (f_e and P_e of its tokens
     * alone), averaged over the sequences of the global batch, times this.
     * Training forwards only, whose T must then be a multiple of seq_len. */
    double seq_aux_loss_coef;
    int64_t seq_len;
    /* mean over tokens of logsumexp(logits)^2, times this. */
    double z_loss_coef;
    /* Auxiliary-loss-free balancing (DeepSeek-V3): a per-expert bias added to
     * the scores for selection only, moved by this step size against the load
     * error by moe_layer_update_bias(). 0 disables the bias. */
    double bias_update_rate;
    /* Shared experts every token passes (DeepSeek style): one SwiGLU MLP of
     * width n_shared_experts * shared_d_ff (0: d_ff), added to the routed
     * output. */
    int64_t n_shared_experts;
    int64_t shared_d_ff;
    /* Qwen2-MoE's gate on the shared experts: their output times
     * sigmoid(x . w) per token, w [1, d] one more parameter of the layer.
     * Needs shared experts. */
    int shared_gate;
    /* Training-time jitter: the layer's input is multiplied elementwise by
     * U(1 - eps, 1 + eps) before the router and the experts see it, as in
     * Hugging Face Mixtral. 0 disables it. */
    double jitter_eps;
    /* Group-limited routing (DeepSeek-V3's n_group and topk_group): the
     * experts form n_groups groups of consecutive ids; a token first keeps
     * the top_groups groups whose two best selection scores (those top-k
     * ranks, with the bias; sigmoids, not log-sigmoids, for the sigmoid
     * gate) sum highest, ties to the lower group, then takes its k experts
     * among theirs. Under expert parallelism over n_groups ranks a token
     * reaches at most top_groups of them, once each (the exchange sends a
     * token once to each rank holding any of its experts). 0 or 1: no
     * groups, and top_groups must then be 0 or 1. */
    int64_t n_groups;
    int64_t top_groups;
    /* Multiplies the routed experts' weights after their normalisation
     * (DeepSeek-V3's routed_scaling_factor, 2.5 there), so that the routed
     * share keeps its size beside the shared experts' while the weights sum
     * to one. 0 or 1: none. */
    double routed_scale;
    uint64_t seed; /* seeds the initial parameters (normal, std 0.02, Mixtral's
                      initializer_range) and the jitter noise */
} moe_layer_config;

/* Mixtral's defaults for everything but the sizes. */
#define MOE_LAYER_CONFIG_INIT                                                    \
    {                                                                            \
        .d_model = 0, .d_ff = 0, .n_experts = 0, .top_k = 0,                     \
        .gate = MOE_GATE_SOFTMAX_TOPK, .renormalize = 1, .capacity_factor = 0.0, \
        .aux_loss_coef = 0.0, .seq_aux_loss_coef = 0.0, .seq_len = 0,            \
        .z_loss_coef = 0.0, .bias_update_rate = 0.0,                             \
        .n_shared_experts = 0, .shared_d_ff = 0, .shared_gate = 0,              \
        .jitter_eps = 0.0, .n_groups = 0, .top_groups = 0,                       \
        .routed_scale = 1.0, .seed = 0                                           \
    }

/* The same as a function, for C++ before C++20, which has no designated
 * initialisers. */
moe_layer_config moe_layer_config_defaults(void);

/* Checks a config without creating anything; the error names the field. */
moe_status moe_layer_config_validate(const moe_layer_config *cfg);

typedef struct moe_layer moe_layer;

moe_status moe_layer_create(moe_layer **layer, const moe_layer_config *cfg);
void moe_layer_destroy(moe_layer *layer);

/* The same layer on a CUDA device (device < 0: the first of sm_80 or
 * newer), its work queued on the caller's stream (a cudaStream_t of that
 * device; NULL: a stream of the layer's own). Then every array the calls
 * take or return is device memory: x, y, dx, dy, the views' param and grad,
 * moe_layer_params() and moe_layer_grads() (stats and the selection bias
 * stay on the host). Calls return with work still queued: forward waits
 * once for the stream (everything queued on it so far), for the routing
 * counts (capacity and the experts' row counts are decided on the host),
 * backward not at all, so y and dx are ready when the stream reaches them.
 * Each call binds the layer's device and context to the calling thread; a
 * failure inside queued work is kept for that thread (as CUDA keeps its
 * errors) and reported by its next call that waits, on any CUDA layer, or
 * by moe_layer_sync: drive a layer from one thread at a time. The stream
 * must outlive the layer; destroying the layer waits for it. A device
 * index the process does not see is MOE_ERR_INVALID_ARG; MOE_ERR_UNSUPPORTED
 * when this libmoe was built without CUDA or no device answers. */
moe_status moe_layer_create_cuda(moe_layer **layer, const moe_layer_config *cfg, int device, void *stream);

/* An expert-parallel layer over the ranks of the caller's MPI communicator
 * (mpi_comm points to an MPI_Comm; MPI initialised), which it duplicates so
 * that its messages never match the caller's. Each of the P ranks holds
 * n_experts / P experts (rank r: experts r E/P .. (r+1) E/P - 1, named by
 * their global ids in the views) and passes its own tokens, any count;
 * create, forward and backward are collective over the communicator, and
 * create refuses ranks whose configs differ, naming the field and rank. The router's statistics and capacity are those of all the
 * ranks' tokens, so P ranks compute what one rank computes on the whole
 * batch: y and dx are this rank's rows, each expert's gradient covers every
 * rank's tokens, and the router's (and shared experts') gradients are this
 * rank's share, which the caller sums over the ranks (as data parallelism
 * does). The initial parameters are those moe_layer_create draws for the
 * same seed. Every rank must call forward and backward, with T >= 0 tokens
 * (0 on a rank that has none this time: it still serves its experts). A
 * peer that stops answering fails forward or backward with MOE_ERR_COMM
 * after 300 s, naming it (create says only that not every rank joined).
 * A forward that fails on one rank before the ranks exchange their token
 * rows (a NULL buffer, a bad T, memory) fails on every rank at once, the others
 * with MOE_ERR_COMM naming it, and the layer goes on as if it had not
 * been called; a backward's arguments are checked on each rank alone, and
 * the peers of a rank that refuses them wait for it until the timeout. After
 * a timeout the layer refuses every call but destroy. Destroy the layer
 * before MPI_Finalize (after it, only host memory is
 * freed). MPI_COMM_NULL and intercommunicators are MOE_ERR_INVALID_ARG;
 * MOE_ERR_UNSUPPORTED when this libmoe was built without MPI. */
moe_status moe_layer_create_mpi(moe_layer **layer, const moe_layer_config *cfg, const void *mpi_comm);

/* Waits for the layer's queued work and reports a failure in it (on the
 * CPU, where calls return finished, MOE_OK at once). */
moe_status moe_layer_sync(moe_layer *layer);

/* Named tensors: parameters and their gradients share one name and shape.
 * Names follow Hugging Face Mixtral's block_sparse_moe:
 *   gate.weight [E, d], experts.{e}.w1.weight [ff, d],
 *   experts.{e}.w3.weight [ff, d], experts.{e}.w2.weight [d, ff],
 * and with shared experts (width S = n_shared_experts * (shared_d_ff or
 * ff)):
 *   shared_experts.gate_proj.weight [S, d], shared_experts.up_proj.weight
 *   [S, d], shared_experts.down_proj.weight [d, S], and under shared_gate
 *   shared_expert_gate.weight [1, d].
 * Views point into one allocation each for parameters and gradients, valid
 * until moe_layer_destroy. */
typedef struct moe_tensor_view {
    const char *name;
    int64_t rows, cols; /* 2-D, row-major */
    float *param;       /* [rows, cols] */
    float *grad;        /* [rows, cols] */
} moe_tensor_view;

int64_t moe_layer_tensor_count(const moe_layer *layer);
moe_status moe_layer_tensor(const moe_layer *layer, int64_t index, moe_tensor_view *view);
moe_status moe_layer_tensor_by_name(const moe_layer *layer, const char *name, moe_tensor_view *view);

/* All parameters (or gradients) as one flat array, in tensor order. */
int64_t moe_layer_param_count(const moe_layer *layer);
float *moe_layer_params(moe_layer *layer);
float *moe_layer_grads(moe_layer *layer);

/* The aux-loss-free selection bias [E], or NULL when bias_update_rate is 0. */
float *moe_layer_selection_bias(moe_layer *layer);

/* Over the global batch: every rank's tokens when the layer spans ranks. */
typedef struct moe_layer_stats {
    int64_t *tokens_per_expert; /* [E], caller's array or NULL: pairs kept */
    int64_t pairs;              /* (token, slot) pairs routed: T * top_k over the ranks */
    int64_t dropped;            /* of those, pairs over capacity */
    double aux_loss;            /* E * sum f_e P_e, before the coefficient */
    /* the sequence-wise one's mean over sequences, before its coefficient
     * (0 without it or outside training) */
    double seq_aux_loss;
    double z_loss;              /* mean logsumexp^2, before the coefficient */
    double load_imbalance;      /* max over experts of assigned pairs / mean */
    /* max over the expert-parallel group's ranks of the rows their experts
     * keep / the mean: the busiest rank's share of the experts' work (1 on
     * one rank; 0 with no rows) */
    double rank_imbalance;
} moe_layer_stats;

/* Training mode turns on jitter noise; the default is training. */
moe_status moe_layer_set_training(moe_layer *layer, int training);

/* y = MoE(x). x [T, d] and y [T, d] are the caller's. The layer keeps what
 * backward needs (and a copy of nothing larger than its own activations) in a
 * workspace that grows only when T exceeds every earlier T; the same or a
 * smaller T allocates nothing of the layer's (the CPU's OpenBLAS may take
 * small buffers of its own; across ranks, the expert rows a rank receives
 * follow its peers' T too, so a peer's larger T may grow them). A forward
 * that fails leaves no forward for backward to differentiate. stats may be
 * NULL. */
moe_status moe_layer_forward(moe_layer *layer, float *y, const float *x, int64_t T,
                             moe_layer_stats *stats);

/* Backward of the most recent forward. dx [T, d] is written (not accumulated);
 * parameter gradients are accumulated into moe_layer_grads(). The aux and z
 * losses enter with their coefficients, as if added to the caller's loss. x
 * must be the same buffer contents as given to forward. dx may overlap
 * neither dy nor x (MOE_ERR_INVALID_ARG): backward writes it while it
 * still reads them. A second backward of the same forward adds its
 * gradients again (the aux and z losses' too), as a second loss would. */
moe_status moe_layer_backward(moe_layer *layer, float *dx, const float *dy, const float *x);

moe_status moe_layer_zero_grad(moe_layer *layer);

/* Nudges the selection bias against the load error of the training
 * forwards since the last update (an optimizer step's micro-batches,
 * summed): b_e += rate * sign(mean load - load_e). MOE_ERR_STATE when there
 * was no training forward since; MOE_ERR_CONFIG on a layer without a bias
 * (bias_update_rate 0). */
moe_status moe_layer_update_bias(moe_layer *layer);

/* Floating-point operations of one forward at T, counting only the work done
 * by the experts that were active (2 per multiply-add) plus the router; 0
 * for a NULL config, a size in it that is not positive (a negative
 * n_shared_experts), or T <= 0. */
double moe_layer_forward_flops(const moe_layer_config *cfg, int64_t T);

#ifdef __cplusplus
}
#endif

#endif /* MOE_H */
