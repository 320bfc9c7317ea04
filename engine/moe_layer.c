/* moe_layer.c: one MoE layer, forward and backward (DESIGN.md 3).
 *
 * forward:  [jitter] -> router GEMM -> gating pass -> gather the router's
 *           per-rank totals -> plan -> permute -> [dispatch: each token
 *           once to each rank holding any of its experts, copied there to
 *           each expert's rows] -> grouped experts (+ shared experts) ->
 *           [return: one row per token, its experts there weighted and
 *           summed] -> combine
 * backward: combine -> [dispatch] -> grouped experts -> [return] ->
 *           unpermute -> gating -> router GEMM -> [jitter]
 *
 * The bracketed steps exist only with an expert-parallel group of P > 1
 * ranks; with P = 1 the same code runs and they vanish. Each expert sees its
 * rows in the order of the global batch (rank 0's tokens first), capacity
 * counts against that order, and the balancing statistics are those of the
 * global batch, so P ranks compute what one rank computes on the whole batch.
 */
#include "engine/moe_layer.h"

#include <float.h>
#include <limits.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/rng.h"
#include "comm/comm.h"
#include "common/status.h"
#include "engine/grid.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/ops.h"
#include "router/plan.h"

#define MOE_NAME_BYTES 64
#define MOE_ALIGN_BYTES 64
#define MOE_JITTER_STREAM 0x6a6974746572ull /* "jitter" */

/* Backend memory some layers carve their arrays from, sized for a number
 * of tokens (or expert rows) that only grows. Layers of one model run one
 * at a time, so they may share their backward's scratch, and, when each
 * layer's forward is recomputed just before its backward, their forward's
 * activations too (moe_layer_share_workspace). */
typedef enum block_kind {
    BLOCK_CHOICES, /* the router's choices, read after the forward: never shared */
    BLOCK_TOKENS,  /* the forward's activations by token */
    BLOCK_ROWS,    /* ... by expert row */
    BLOCK_DTOKENS, /* the backward's scratch by token */
    BLOCK_DROWS,   /* ... by expert row */
    N_BLOCKS
} block_kind;

typedef struct moe_layer_block {
    void *mem;
    int64_t size;   /* the tokens or rows it is carved for */
    int64_t bytes;
    int users;      /* layers carving it */
    const struct moe_layer *maker;  /* whose workspace bytes count it; NULL: the next user's to ask */
    const struct moe_layer *holder; /* the layer whose forward its activations are */
} moe_layer_block;

struct moe_layer {
    moe_layer_config cfg;
    const moe_ops *ops;
    int64_t shared_ff; /* S = n_shared_experts * (shared_d_ff or d_ff), 0 without shared experts */

    /* Expert parallelism: this rank holds experts first_local ..
     * first_local + n_local - 1 of E. expert_rank is the placement; the
     * plan's expert-ordered rows are contiguous per rank because each rank
     * holds a contiguous run of expert ids (checked at creation). */
    moe_comm *ep;      /* NULL: one rank */
    moe_comm *ep_rows; /* the same ranks, for the rows in backend memory */
    int ep_rank, ep_size;
    /* The ranks whose tokens form the global batch (the data-parallel world,
     * of which the EP group is a consecutive run starting at group_base):
     * routing totals and capacity are taken over it. NULL: the EP group. */
    moe_comm *batch;
    int batch_rank, batch_size, group_base;
    int64_t n_local, first_local;
    int *expert_rank; /* [E] */

    moe_layer_memory mem;  /* where the router, experts and shared experts live */
    float *params, *grads; /* [n_params] each when mem is one contiguous run, else NULL */
    int64_t n_params;
    float *owned;          /* params and grads when the layer allocated them, in ops' memory */
    void *cuda;            /* the moe_cuda_ctx of a layer made by moe_layer_create_cuda (owned) */
    moe_comm *owned_ep;    /* the duplicate of the caller's communicator (moe_layer_create_mpi) */
    int64_t n_tensors;
    moe_tensor_view *views;           /* [n_tensors] */
    char (*names)[MOE_NAME_BYTES];    /* [n_tensors] */
    float *bias;                      /* [E] selection bias on the host, or NULL */
    float *bias_sent;                 /* [E] the bias bias_dev holds */
    /* The load the next bias update answers: the global pairs per expert
     * of every training forward since the last update, so that the
     * micro-batches of one optimizer step move the bias once, from their
     * summed load, as one batch of all of them would (DeepSeek-V3 updates
     * once per step), and all route with the same bias. */
    int64_t *bias_load;               /* [E], with bias */
    int64_t bias_forwards;            /* training forwards bias_load covers */
    /* A twin (moe_layer_share_state) reads and advances its owner's bias,
     * load and jitter counter instead of its own; NULL: its own. */
    struct moe_layer *owner;

    /* Every array the ops touch is backend memory; the host keeps what it
     * decides with (counts, offsets) and mirrors of what it reads. */

    /* The arrays the ops touch, carved from backend blocks (see
     * moe_layer_block): the router's choices, the forward's activations by
     * token and by expert row, and the backward's scratch by token and by
     * row. Blocks of activations or scratch may be shared with other
     * layers (moe_layer_share_workspace); the pointers are carved again at
     * every forward and backward, so a block another layer has grown since
     * is followed. */
    moe_layer_block *blocks[N_BLOCKS];
    int64_t rows_sized;  /* expert rows the last forward sized for */
    int32_t *topk_host;  /* [T, k] host copy of topk_idx, on request */
    /* BLOCK_CHOICES: the layer's own, read after its forward */
    int32_t *topk_idx;   /* [T, k] */
    /* BLOCK_TOKENS: what the forward leaves for the backward */
    float *x_in;         /* [T, d] jittered input (jitter only) */
    float *noise;        /* [T, d] jitter factors (jitter only) */
    float *logits;       /* [T, E] */
    float *prob;         /* [T, E] router probabilities */
    float *lse;          /* [T] */
    float *topk_w;       /* [T, k] */
    double *gate_chunks; /* [ceil(T / chunk), 2E + 1] */
    int64_t *pair_row;   /* [T*k] */
    int64_t *row_token;  /* [T*k] */
    void *plan_scratch;  /* ops->plan_scratch_bytes(T, k, E) */
    /* With one rank [T*k, d] rows in plan (expert) order; under EP
     * [T*m, d], the rows sent (a token once per rank) and received back. */
    float *xp;
    float *yp;
    float *sh_h;         /* [T, 2S] shared experts */
    float *sh_g;         /* [T, S] */
    float *sh_y;         /* [T, d], times sh_gate under shared_gate */
    float *sh_logit;     /* [T] the shared experts' gate (shared_gate only): x . w */
    float *sh_gate;      /* [T] its sigmoid */
    /* The exchange (EP; m = min(top_k, P) ranks a token reaches at most): */
    float *seq_stats;    /* [T / seq_len, 2E] per sequence: pairs chosen, probability sums (seq aux only) */
    float *seq_aux_grad; /* [T / seq_len, E] aux_grad per sequence, the batch-wide one included (seq aux only) */
    int64_t *send_tok;   /* [T*m] this rank's tokens for each EP rank, rank-major, in token order */
    int64_t *tok_slot;   /* [T, P] where token t's row for rank r sits among them, -1: none */
    float *send_w;       /* [T*m, k] their gate weights */
    /* BLOCK_DTOKENS: the backward's scratch */
    float *dx_in;        /* [T, d] gradient of x_in (jitter only) */
    float *dlogits;      /* [T, E] */
    float *dweights;     /* [T, k] */
    float *dyp;          /* as xp */
    float *dxp;          /* as yp */
    float *sh_dh;        /* [T, 2S] */
    float *sh_dy;        /* [T, d] the shared experts' output gradient (shared_gate only) */
    float *sh_dlogit;    /* [T] */
    float *dw_back;      /* [T*m, k] the exchange's weight gradients per token and rank */

    /* Rows this rank's experts work on, sized for rows_sized rows. With one
     * rank xe, ye, dye and dxe are xp, yp, dyp and dxp. BLOCK_ROWS: */
    float *xe;           /* [R, d] received rows, expert-major */
    float *ye;           /* [R, d] expert outputs */
    float *h;            /* [R, 2ff] */
    float *g;            /* [R, ff] */
    /* The exchange's receiving side, U <= R tokens from the EP
     * group, source-major: */
    float *rx;           /* [R, d] their rows; then the rows sent back */
    float *recv_w;       /* [U, k] their gate weights */
    int64_t *recv_pair;  /* [U, k] the expert row of each slot, -1: not this rank's */
    int64_t *recv_row;   /* [R] the token of each expert row */
    /* BLOCK_DROWS: */
    float *dye;          /* [R, d] the gradient of ye */
    float *dxe;          /* [R, d] */
    float *dh;           /* [R, 2ff] */
    float *dw_send;      /* [U, k] the exchange's weight gradients of the received tokens */

    /* Per-expert and per-rank arrays, independent of T. The gating totals
     * are one backend block of 2E + 1 eight-byte words (assigned [E],
     * prob_sum [E], z_sum), so one download brings them to totals_host. */
    void *totals_dev, *totals_host;
    int64_t *assigned;       /* [E] this rank's pairs per expert, before capacity (host) */
    double *prob_sum;        /* [E] (host) */
    double *z_sum;           /* [1] (host) */
    int64_t *keep_dev;       /* [E] keep, backend */
    int64_t *offsets_dev;    /* [E+1] expert_offsets, backend */
    float *aux_grad_dev;     /* [E] aux_grad, backend */
    float *bias_dev;         /* [E] bias, backend; NULL without */
    double *rank_totals;     /* [N, 2E + 3] every batch rank's assigned, prob_sum, z_sum, T, seq aux sum */
    int64_t *rank_assigned;  /* [N, E] */
    int64_t *rank_kept;      /* [N] scratch: each rank's kept pairs of one expert */
    int64_t *rank_T;         /* [N] each batch rank's tokens in this forward (jitter only) */
    int64_t *global_assigned; /* [E] */
    int64_t *keep;           /* [E] this rank's kept pairs per expert */
    int64_t *recv_rows;      /* [P, n_local] rows from each source for each local expert */
    moe_comm_request *requests; /* [8 P] messages of one exchange */
    int n_requests;
    bool overlap;               /* take each source's rows as soon as they are in */
    /* The exchange's host side: tokens to and from each EP rank ([P] each,
     * the offsets [P + 1]), and its bookkeeping arrays, grown as needed. */
    int64_t *send_n, *send_off, *recv_n, *recv_off;
    void *host_mem;
    int64_t host_bytes;
    int64_t *h_pair_row;     /* [T*k] the plan's rows, then each pair's expert */
    int64_t *h_send_tok;     /* [T*m] */
    int64_t *h_tok_slot;     /* [T, P] */
    int32_t *h_send_codes;   /* [T*m, k] for each slot, the receiving rank's expert, -1: none */
    int32_t *h_recv_codes;   /* [U, k] */
    int64_t *h_recv_pair;    /* [U, k] */
    int64_t *h_recv_row;     /* [R] */
    int64_t *expert_offsets; /* [E+1] plan rows (host; the plan's own are offsets_dev) */
    int64_t *local_offsets;  /* [n_local+1] expert-major rows */
    float *aux_grad;         /* [E] (host) */
    double aux_grad_scale;   /* the loss scale aux_grad_dev was computed with */
    /* The sequence-wise balancing loss of the last forward: its sequences
     * (0: none, so backward reads aux_grad_dev), and on the host their
     * statistics [seqs, 2E] (seq_stats) then their gradient rows [seqs, E]. */
    int64_t seqs;
    float *seq_host;
    int64_t seq_host_floats;
    moe_expert_group *groups; /* [n_local + 1]: local experts, then the shared ones */

    moe_layer_stats last;   /* global statistics of the last forward */
    int64_t last_T;         /* T of the last forward (0: a rank with no tokens this time) */
    bool forward_done;      /* the last forward succeeded: backward may follow */
    /* During a forward over batch ranks: the collective the peers wait in
     * next, which a rank whose forward fails before it joins to tell them. */
    enum { PEERS_IN_TOKEN_COUNTS, PEERS_IN_TOTALS, PEERS_IN_SEND_COUNTS, PEERS_TOLD } peers;
    int64_t global_T;       /* tokens over the EP group in the last forward */
    moe_layer_timing timing;
    int training;
    bool replay;           /* forwards recompute earlier ones: no bias load counted */
    double loss_scale;     /* multiplies the aux and z gradients */
    uint64_t jitter_calls; /* advances the noise stream each training forward */
};

/* ------------------------------------------------------------- validation */

static moe_status check_size(const char *field, int64_t value, int64_t max) {
    if (value <= 0) return moe_error(MOE_ERR_CONFIG, "moe layer config: %s=%lld must be positive", field, (long long)value);
    if (value > max)
        return moe_error(MOE_ERR_CONFIG, "moe layer config: %s=%lld exceeds the limit %lld", field,
                         (long long)value, (long long)max);
    return MOE_OK;
}

static moe_status check_coef(const char *field, double value, double max) {
    if (!isfinite(value) || value < 0.0 || value > max)
        return moe_error(MOE_ERR_CONFIG, "moe layer config: %s=%g must be finite and in [0, %g]", field, value, max);
    return MOE_OK;
}

/* The sequence-wise loss's tokens per sequence; 0 when it is off. */
static int64_t seq_aux_len(const moe_layer_config *c) { return c->seq_aux_loss_coef > 0.0 ? c->seq_len : 0; }

/* a * b into *out, or false when it overflows int64. */
static bool mul_ok(int64_t a, int64_t b, int64_t *out) { return !__builtin_mul_overflow(a, b, out); }

int64_t moe_layer_shared_width(const moe_layer_config *cfg) {
    return cfg->n_shared_experts * (cfg->shared_d_ff > 0 ? cfg->shared_d_ff : cfg->d_ff);
}

int64_t moe_layer_shared_params(const moe_layer_config *cfg) {
    return 3 * moe_layer_shared_width(cfg) * cfg->d_model + (cfg->shared_gate ? cfg->d_model : 0);
}

int64_t moe_layer_config_param_count(const moe_layer_config *cfg, int ep_size) {
    const int64_t d = cfg->d_model, ff = cfg->d_ff, E = cfg->n_experts;
    return E * d + E / ep_size * 3 * ff * d + moe_layer_shared_params(cfg);
}

moe_layer_config moe_layer_config_defaults(void) { return (moe_layer_config)MOE_LAYER_CONFIG_INIT; }

moe_status moe_layer_config_validate(const moe_layer_config *cfg) {
    if (!cfg) return moe_error(MOE_ERR_INVALID_ARG, "moe layer config: NULL");
    /* GEMM sizes reach OpenBLAS as int; so must every row and column count. */
    MOE_TRY(check_size("d_model", cfg->d_model, INT_MAX / 2));
    MOE_TRY(check_size("d_ff", cfg->d_ff, INT_MAX / 2));
    MOE_TRY(check_size("n_experts", cfg->n_experts, MOE_EXPERTS_MAX));
    MOE_TRY(check_size("top_k", cfg->top_k, INT_MAX));
    if (cfg->top_k > cfg->n_experts)
        return moe_error(MOE_ERR_CONFIG, "moe layer config: top_k=%lld exceeds n_experts=%lld",
                         (long long)cfg->top_k, (long long)cfg->n_experts);
    if (cfg->gate != MOE_GATE_SOFTMAX_TOPK && cfg->gate != MOE_GATE_TOPK_SOFTMAX && cfg->gate != MOE_GATE_SIGMOID)
        return moe_error(MOE_ERR_CONFIG, "moe layer config: gate=%d is not a moe_gate_kind", (int)cfg->gate);
    MOE_TRY(check_coef("capacity_factor", cfg->capacity_factor, 1e6));
    MOE_TRY(check_coef("aux_loss_coef", cfg->aux_loss_coef, 1e6));
    MOE_TRY(check_coef("seq_aux_loss_coef", cfg->seq_aux_loss_coef, 1e6));
    if (cfg->seq_aux_loss_coef > 0.0) MOE_TRY(check_size("seq_len", cfg->seq_len, INT_MAX));
    MOE_TRY(check_coef("z_loss_coef", cfg->z_loss_coef, 1e6));
    MOE_TRY(check_coef("bias_update_rate", cfg->bias_update_rate, 1e6));
    MOE_TRY(check_coef("routed_scale", cfg->routed_scale, 1e6));
    if (cfg->routed_scale > 0.0 && cfg->routed_scale < FLT_MIN) /* a float 0, which the gate's backward divides by */
        return moe_error(MOE_ERR_CONFIG, "moe layer config: routed_scale=%g must be 0 (none) or at least %g",
                         cfg->routed_scale, (double)FLT_MIN);
    if (!isfinite(cfg->jitter_eps) || cfg->jitter_eps < 0.0 || cfg->jitter_eps >= 1.0)
        return moe_error(MOE_ERR_CONFIG, "moe layer config: jitter_eps=%g must be in [0, 1)", cfg->jitter_eps);
    if (cfg->n_groups < 0 || cfg->n_groups > MOE_GROUPS_MAX || cfg->n_groups > cfg->n_experts ||
        (cfg->n_groups > 1 && cfg->n_experts % cfg->n_groups))
        return moe_error(MOE_ERR_CONFIG, "moe layer config: n_groups=%lld must divide n_experts=%lld and be at most "
                         "%d (0 or 1: none)", (long long)cfg->n_groups, (long long)cfg->n_experts, MOE_GROUPS_MAX);
    if (cfg->n_groups <= 1 && (cfg->top_groups < 0 || cfg->top_groups > 1))
        return moe_error(MOE_ERR_CONFIG, "moe layer config: top_groups=%lld needs n_groups > 1 (n_groups=%lld: no "
                         "groups, and top_groups 0 or 1)", (long long)cfg->top_groups, (long long)cfg->n_groups);
    if (cfg->n_groups > 1 && (cfg->top_groups < 1 || cfg->top_groups > cfg->n_groups))
        return moe_error(MOE_ERR_CONFIG, "moe layer config: top_groups=%lld must be in [1, n_groups=%lld]",
                         (long long)cfg->top_groups, (long long)cfg->n_groups);
    if (cfg->n_groups > 1 && cfg->top_k > cfg->top_groups * (cfg->n_experts / cfg->n_groups))
        return moe_error(MOE_ERR_CONFIG, "moe layer config: top_groups=%lld groups of %lld experts cannot hold "
                         "top_k=%lld", (long long)cfg->top_groups, (long long)(cfg->n_experts / cfg->n_groups),
                         (long long)cfg->top_k);
    if (cfg->n_shared_experts < 0)
        return moe_error(MOE_ERR_CONFIG, "moe layer config: n_shared_experts=%lld must not be negative",
                         (long long)cfg->n_shared_experts);
    if (cfg->shared_d_ff < 0 || cfg->shared_d_ff > INT_MAX / 2)
        return moe_error(MOE_ERR_CONFIG, "moe layer config: shared_d_ff=%lld must be in [0, %d] (0: d_ff)",
                         (long long)cfg->shared_d_ff, INT_MAX / 2);
    const int64_t width = cfg->shared_d_ff > 0 ? cfg->shared_d_ff : cfg->d_ff;
    int64_t S, dff, n, shared;
    if (!mul_ok(cfg->n_shared_experts, width, &S) || S > INT_MAX / 2)
        return moe_error(MOE_ERR_CONFIG, "moe layer config: n_shared_experts=%lld x %s=%lld exceeds %d, the widest "
                         "shared-expert GEMM", (long long)cfg->n_shared_experts,
                         cfg->shared_d_ff > 0 ? "shared_d_ff" : "d_ff", (long long)width, INT_MAX / 2);
    if (cfg->shared_gate && S == 0)
        return moe_error(MOE_ERR_CONFIG, "moe layer config: shared_gate needs shared experts (n_shared_experts=%lld)",
                         (long long)cfg->n_shared_experts);
    if (!mul_ok(cfg->d_model, cfg->d_ff, &dff) || !mul_ok(dff, 3 * cfg->n_experts + 1, &n) ||
        !mul_ok(cfg->d_model, 3 * S + 1, &shared) || __builtin_add_overflow(n, shared, &n) ||
        !mul_ok(n, 2 * (int64_t)sizeof(float), &n))
        return moe_error(MOE_ERR_CONFIG, "moe layer config: d_model=%lld x (d_ff=%lld x n_experts=%lld + the shared "
                         "experts' width %lld) overflows", (long long)cfg->d_model, (long long)cfg->d_ff,
                         (long long)cfg->n_experts, (long long)S);
    return MOE_OK;
}

/* ------------------------------------------------------------ construction */

/* Appends a view of rows x cols at *param / *grad and advances both. */
static void add_view(moe_layer *L, float **param, float **grad, int64_t rows, int64_t cols, const char *fmt,
                     int64_t e) {
    int64_t i = L->n_tensors++;
    snprintf(L->names[i], MOE_NAME_BYTES, fmt, (long long)e);
    L->views[i] = (moe_tensor_view){.name = L->names[i], .rows = rows, .cols = cols, .param = *param, .grad = *grad};
    *param += rows * cols;
    if (*grad) *grad += rows * cols; /* a layer without gradients has none to lay out */
}

/* Views in order: the router, the local experts (w1 right before w3, so the
 * two form the [2ff, d] matrix of one GEMM), the shared experts. Experts keep
 * their global ids. */
static void build_views(moe_layer *L) {
    const int64_t d = L->cfg.d_model, ff = L->cfg.d_ff, E = L->cfg.n_experts, S = L->shared_ff;
    float *p = L->mem.router, *g = L->mem.router_grad;
    L->n_tensors = 0;
    add_view(L, &p, &g, E, d, "gate.weight", 0);
    p = L->mem.experts;
    g = L->mem.experts_grad;
    for (int64_t e = L->first_local; e < L->first_local + L->n_local; e++) {
        add_view(L, &p, &g, ff, d, "experts.%lld.w1.weight", e);
        add_view(L, &p, &g, ff, d, "experts.%lld.w3.weight", e);
        add_view(L, &p, &g, d, ff, "experts.%lld.w2.weight", e);
    }
    if (S > 0) {
        p = L->mem.shared;
        g = L->mem.shared_grad;
        add_view(L, &p, &g, S, d, "shared_experts.gate_proj.weight", 0);
        add_view(L, &p, &g, S, d, "shared_experts.up_proj.weight", 0);
        add_view(L, &p, &g, d, S, "shared_experts.down_proj.weight", 0);
        if (L->cfg.shared_gate) add_view(L, &p, &g, 1, d, "shared_expert_gate.weight", 0);
    }
}

/* Checks that the EP group is ranks group_base .. group_base + P - 1 of the
 * batch communicator, in order: capacity and the order of each expert's rows
 * follow batch ranks, and the dispatch maps EP source s to batch rank
 * group_base + s. */
static moe_status find_group_base(moe_layer *L) {
    if (!L->ep) {
        L->group_base = L->batch_rank;
        return L->ep_size == 1 ? MOE_OK : moe_error(MOE_ERR_INTERNAL, "moe layer: EP group without a communicator");
    }
    int ranks[MOE_EXPERTS_MAX];
    if (L->ep_size > MOE_EXPERTS_MAX)
        return moe_error(MOE_ERR_CONFIG, "moe layer: expert-parallel size %d exceeds %d", L->ep_size, MOE_EXPERTS_MAX);
    MOE_TRY(moe_comm_allgather(L->ep, ranks, &L->batch_rank, 1, MOE_COMM_I32));
    L->group_base = ranks[0];
    for (int s = 0; s < L->ep_size; s++)
        if (ranks[s] != ranks[0] + s)
            return moe_error(MOE_ERR_CONFIG,
                             "moe layer: expert-parallel rank %d is data-parallel rank %d, not %d: EP groups must be "
                             "consecutive ranks",
                             s, ranks[s], ranks[0] + s);
    return MOE_OK;
}

moe_status moe_layer_create_in(moe_layer **out, const moe_layer_config *cfg, const moe_layer_memory *mem,
                               moe_comm *ep, moe_comm *batch) {
    static const char op[] = "moe_layer_create_in";
    MOE_NOT_NULL(op, "layer", out);
    MOE_NOT_NULL(op, "mem", mem);
    MOE_NOT_NULL(op, "mem->router", mem->router);
    MOE_NOT_NULL(op, "mem->experts", mem->experts);
    const bool shared = cfg && moe_layer_shared_width(cfg) > 0;
    if (shared) MOE_NOT_NULL(op, "mem->shared (the config has shared experts)", mem->shared);
    /* Gradients all or none: a layer without them runs forwards only. */
    const bool grads = mem->router_grad != NULL;
    if ((mem->experts_grad != NULL) != grads || (shared && (mem->shared_grad != NULL) != grads))
        return moe_error(MOE_ERR_INVALID_ARG, "%s: mem's gradients must all be given or all be NULL (forwards only)",
                         op);
    *out = NULL;
    MOE_TRY(moe_layer_config_validate(cfg));
    const int P = ep ? moe_comm_size(ep) : 1;
    const int64_t E = cfg->n_experts;
    if (E % P != 0)
        return moe_error(MOE_ERR_CONFIG, "moe layer config: n_experts=%lld is not a multiple of the expert-parallel size %d",
                         (long long)E, P);
    moe_layer *L = calloc(1, sizeof *L);
    if (!L) return moe_error(MOE_ERR_OUT_OF_MEMORY, "moe_layer_create: layer struct");
    L->cfg = *cfg;
    L->ops = mem->ops ? mem->ops : moe_cpu_ops();
    L->shared_ff = moe_layer_shared_width(cfg);
    L->ep = P > 1 ? ep : NULL;
    L->ep_rows = L->ep && mem->ep_rows ? mem->ep_rows : L->ep;
    L->ep_size = P;
    L->ep_rank = ep ? moe_comm_rank(ep) : 0;
    if (!batch) batch = ep;
    L->batch_size = batch ? moe_comm_size(batch) : 1;
    L->batch = L->batch_size > 1 ? batch : NULL;
    L->batch_rank = batch ? moe_comm_rank(batch) : 0;
    const int64_t N = L->batch_size;
    L->n_local = E / P;
    L->first_local = L->ep_rank * L->n_local;
    L->mem = *mem;
    L->n_params = moe_layer_config_param_count(cfg, P);
    L->training = 1;
    L->loss_scale = 1.0;
    const int64_t max_tensors = 1 + 3 * L->n_local + 4; /* the router, the experts, the shared experts and their gate */
    L->views = calloc((size_t)max_tensors, sizeof *L->views);
    L->names = calloc((size_t)max_tensors, sizeof *L->names);
    L->expert_rank = calloc((size_t)E, sizeof *L->expert_rank);
    L->totals_host = calloc((size_t)(2 * E + 1), sizeof(int64_t));
    L->rank_totals = calloc((size_t)N * (size_t)(2 * E + 3), sizeof *L->rank_totals);
    L->rank_assigned = calloc((size_t)N * (size_t)E, sizeof *L->rank_assigned);
    L->rank_kept = calloc((size_t)N, sizeof *L->rank_kept);
    L->rank_T = calloc((size_t)N, sizeof *L->rank_T);
    L->global_assigned = calloc((size_t)E, sizeof *L->global_assigned);
    L->keep = calloc((size_t)E, sizeof *L->keep);
    L->recv_rows = calloc((size_t)P * (size_t)L->n_local, sizeof *L->recv_rows);
    L->requests = calloc(8 * (size_t)P, sizeof *L->requests);
    L->send_n = calloc(4 * (size_t)P + 2, sizeof *L->send_n);
    L->expert_offsets = calloc((size_t)E + 1, sizeof *L->expert_offsets);
    L->local_offsets = calloc((size_t)L->n_local + 1, sizeof *L->local_offsets);
    L->aux_grad = calloc((size_t)E, sizeof *L->aux_grad);
    L->groups = calloc((size_t)L->n_local + 1, sizeof *L->groups);
    bool blocks = true;
    for (int kind = 0; kind < N_BLOCKS; kind++) {
        if (!(L->blocks[kind] = calloc(1, sizeof *L->blocks[kind]))) {
            blocks = false;
            break;
        }
        *L->blocks[kind] = (moe_layer_block){.users = 1, .maker = L};
    }
    if (cfg->bias_update_rate > 0.0) {
        L->bias = calloc((size_t)E, sizeof *L->bias);
        L->bias_sent = calloc((size_t)E, sizeof *L->bias_sent);
        L->bias_load = calloc((size_t)E, sizeof *L->bias_load);
    }
    if (!L->views || !L->names || !L->expert_rank || !L->totals_host || !L->rank_totals || !L->rank_assigned ||
        !L->rank_kept || !L->rank_T || !L->global_assigned || !L->keep || !L->recv_rows || !L->requests ||
        !L->send_n || !L->expert_offsets || !L->local_offsets || !L->aux_grad || !L->groups || !blocks ||
        (cfg->bias_update_rate > 0.0 && (!L->bias || !L->bias_sent || !L->bias_load))) {
        moe_layer_destroy(L);
        return moe_error(MOE_ERR_OUT_OF_MEMORY, "moe_layer_create: per-expert arrays for n_experts=%lld", (long long)E);
    }
    L->send_off = L->send_n + P;
    L->recv_n = L->send_off + P + 1;
    L->recv_off = L->recv_n + P;
    L->assigned = L->totals_host;
    L->prob_sum = (double *)L->totals_host + E;
    L->z_sum = (double *)L->totals_host + 2 * E;
    const moe_ops *ops = L->ops;
    moe_status st = ops->alloc(&L->totals_dev, (size_t)(2 * E + 1) * sizeof(int64_t));
    if (st == MOE_OK) st = ops->alloc((void **)&L->keep_dev, (size_t)E * sizeof(int64_t));
    if (st == MOE_OK) st = ops->alloc((void **)&L->offsets_dev, (size_t)(E + 1) * sizeof(int64_t));
    if (st == MOE_OK) st = ops->alloc((void **)&L->aux_grad_dev, (size_t)E * sizeof(float));
    if (st == MOE_OK && L->bias) st = ops->alloc((void **)&L->bias_dev, (size_t)E * sizeof(float));
    if (st != MOE_OK) {
        moe_layer_destroy(L);
        return moe_error_prefix(st, "moe_layer_create: ");
    }
    /* Contiguous runs of expert ids per rank, in rank order: the plan's
     * expert-ordered rows then split into one contiguous range per rank. */
    for (int64_t e = 0; e < E; e++) L->expert_rank[e] = (int)(e / L->n_local);
    st = find_group_base(L);
    if (st != MOE_OK) {
        moe_layer_destroy(L);
        return st;
    }
    build_views(L);
    *out = L;
    return MOE_OK;
}

/* Where view v starts among the whole layer's parameters (all E experts, in
 * view order), so every rank draws the values one rank would. */
static int64_t global_offset(const moe_layer *L, int64_t v) {
    const int64_t d = L->cfg.d_model, ff = L->cfg.d_ff, E = L->cfg.n_experts, expert = 3 * ff * d;
    if (v == 0) return 0;
    if (v <= 3 * L->n_local) {
        const int64_t j = (v - 1) / 3, t = (v - 1) % 3;
        return E * d + (L->first_local + j) * expert + t * ff * d;
    }
    return E * d + E * expert + (v - 1 - 3 * L->n_local) * L->shared_ff * d;
}

moe_status moe_layer_init_params(moe_layer *L, float std, uint64_t seed, uint64_t stream) {
    MOE_NOT_NULL("moe_layer_init_params", "layer", L);
    if (!isfinite(std))
        return moe_error(MOE_ERR_INVALID_ARG, "moe_layer_init_params: std=%g must be finite", (double)std);
    for (int64_t v = 0; v < L->n_tensors; v++) {
        const moe_tensor_view *view = &L->views[v];
        const int64_t base = global_offset(L, v), n = view->rows * view->cols;
        float *draws = malloc((size_t)(n ? n : 1) * sizeof *draws); /* [n] drawn here, then uploaded */
        if (!draws) return moe_error(MOE_ERR_OUT_OF_MEMORY, "moe layer: %lld initial values of %s", (long long)n, view->name);
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < n; i++) draws[i] = std * moe_rng_normal(seed, stream, (uint64_t)(base + i));
        moe_status st = L->ops->upload(view->param, draws, (size_t)n * sizeof *draws);
        free(draws);
        if (st != MOE_OK) return moe_error_prefix(st, "moe layer: initial values of %s: ", view->name);
    }
    return MOE_OK;
}

/* A layer that owns its parameters and gradients, in ops' memory (NULL:
 * the CPU's), initialised as Hugging Face initialises Mixtral. */
static moe_status create_owning(moe_layer **out, const moe_layer_config *cfg, const moe_ops *ops, moe_comm *ep,
                                const char *op) {
    MOE_NOT_NULL(op, "layer", out);
    *out = NULL;
    MOE_TRY(moe_layer_config_validate(cfg));
    if (!ops) ops = moe_cpu_ops();
    int64_t n = moe_layer_config_param_count(cfg, ep ? moe_comm_size(ep) : 1);
    /* Gradients start at an aligned offset so both arrays are 64-byte aligned. */
    int64_t grad_off = (n + 15) / 16 * 16;
    float *mem = NULL; /* zero-filled */
    moe_status st = ops->alloc((void **)&mem, (size_t)(grad_off + n) * sizeof(float));
    if (st != MOE_OK) return moe_error_prefix(st, "%s: %lld parameters and gradients: ", op, (long long)n);
    /* One contiguous run each for parameters and gradients, in view order. */
    const int64_t router = cfg->n_experts * cfg->d_model, experts = n - router - moe_layer_shared_params(cfg);
    const moe_layer_memory layout = {
        .ops = ops,
        .router = mem, .router_grad = mem + grad_off,
        .experts = mem + router, .experts_grad = mem + grad_off + router,
        .shared = mem + router + experts, .shared_grad = mem + grad_off + router + experts};
    st = moe_layer_create_in(out, cfg, &layout, ep, NULL);
    if (st != MOE_OK) {
        ops->release(mem);
        return st;
    }
    (*out)->owned = mem;
    (*out)->params = mem;
    (*out)->grads = mem + grad_off;
    /* Hugging Face's initializer_range for Mixtral. */
    st = moe_layer_init_params(*out, 0.02f, cfg->seed, 0);
    if (st != MOE_OK) {
        moe_layer_destroy(*out);
        *out = NULL;
    }
    return st;
}

moe_status moe_layer_create(moe_layer **out, const moe_layer_config *cfg) {
    return create_owning(out, cfg, NULL, NULL, "moe_layer_create");
}

moe_status moe_layer_create_on_ops(moe_layer **out, const moe_layer_config *cfg, const moe_ops *ops) {
    return create_owning(out, cfg, ops, NULL, "moe_layer_create_on_ops");
}

/* Whether a forward draws jitter noise, and so moves the noise stream on. */
static bool draws_jitter(const moe_layer *L) { return L->cfg.jitter_eps > 0.0 && L->training; }

/* A CUDA layer's calls run on its own context: bound to the calling thread
 * first, as the CUDA op table requires (kernels/cuda/cuda_ops.h). */
static void bind(const moe_layer *L) {
#if defined(MOE_HAVE_CUDA)
    if (L->cuda) moe_cuda_ops(L->cuda);
#else
    (void)L;
#endif
}

moe_status moe_layer_create_cuda(moe_layer **out, const moe_layer_config *cfg, int device, void *stream) {
    MOE_NOT_NULL("moe_layer_create_cuda", "layer", out);
    *out = NULL;
    MOE_TRY(moe_layer_config_validate(cfg));
#if defined(MOE_HAVE_CUDA)
    moe_cuda_ctx *ctx = NULL;
    moe_status st = moe_cuda_ctx_create_on(&ctx, device, stream);
    if (st != MOE_OK) return moe_error_prefix(st, "moe_layer_create_cuda: ");
    st = create_owning(out, cfg, moe_cuda_ops(ctx), NULL, "moe_layer_create_cuda");
    if (st != MOE_OK) {
        moe_cuda_unbind(ctx);
        moe_cuda_ctx_destroy(ctx);
        return st;
    }
    (*out)->cuda = ctx;
    return MOE_OK;
#else
    (void)device, (void)stream;
    return moe_error(MOE_ERR_UNSUPPORTED, "moe_layer_create_cuda: this libmoe was built without CUDA");
#endif
}

moe_status moe_layer_create_mpi(moe_layer **out, const moe_layer_config *cfg, const void *mpi_comm) {
    MOE_NOT_NULL("moe_layer_create_mpi", "layer", out);
    *out = NULL;
    const moe_status valid = moe_layer_config_validate(cfg);
    char why[512];
    snprintf(why, sizeof why, "%s", moe_last_error());
    moe_comm *ep = NULL;
    moe_status st = moe_comm_mpi_create_from(&ep, mpi_comm);
    if (st != MOE_OK) return moe_error_prefix(st, "moe_layer_create_mpi: ");
    /* A rank whose config is invalid still joins the others, so that
     * they fail at once, naming it, rather than wait for it until the
     * timeout. */
    const int size = moe_comm_size(ep);
    double *invalid = calloc((size_t)size, sizeof *invalid);
    const double mine = valid != MOE_OK;
    st = invalid ? moe_comm_allgather(ep, invalid, &mine, 1, MOE_COMM_F64)
                 : moe_error(MOE_ERR_OUT_OF_MEMORY, "moe_layer_create_mpi: %d ranks", size);
    int first_invalid = -1;
    for (int r = 0; st == MOE_OK && r < size && first_invalid < 0; r++)
        if (invalid[r] != 0.0) first_invalid = r;
    free(invalid);
    if (st == MOE_OK && first_invalid >= 0)
        st = valid != MOE_OK ? moe_error(valid, "%s", why)
                             : moe_error(MOE_ERR_CONFIG,
                                         "moe_layer_create_mpi: rank %d's config is invalid (its own error says why)",
                                         first_invalid);
    if (st != MOE_OK) {
        moe_comm_free(ep);
        return st;
    }
    /* Ranks of other configs would exchange rows of other shapes. Settings
     * that mean the same compare alike: renormalize matters to softmax_topk
     * alone, and 0 or 1 groups are none. */
    const bool groups = cfg->n_groups > 1;
    const moe_agree_field fields[] = {
        {"d_model", (double)cfg->d_model, NULL},
        {"d_ff", (double)cfg->d_ff, NULL},
        {"n_experts", (double)cfg->n_experts, NULL},
        {"top_k", (double)cfg->top_k, NULL},
        {"gate", (double)cfg->gate, moe_gate_kind_name},
        {"renormalize", cfg->gate == MOE_GATE_SOFTMAX_TOPK ? (double)(cfg->renormalize != 0) : 1.0, NULL},
        {"capacity_factor", cfg->capacity_factor, NULL},
        {"aux_loss_coef", cfg->aux_loss_coef, NULL},
        {"seq_aux_loss_coef", cfg->seq_aux_loss_coef, NULL},
        {"seq_len", (double)seq_aux_len(cfg), NULL},
        {"z_loss_coef", cfg->z_loss_coef, NULL},
        {"bias_update_rate", cfg->bias_update_rate, NULL},
        {"n_shared_experts", (double)cfg->n_shared_experts, NULL},
        {"shared experts' width", (double)moe_layer_shared_width(cfg), NULL},
        {"shared_gate", (double)(cfg->shared_gate != 0), NULL},
        {"jitter_eps", cfg->jitter_eps, NULL},
        {"n_groups", groups ? (double)cfg->n_groups : 0.0, NULL},
        {"top_groups", groups ? (double)cfg->top_groups : 0.0, NULL},
        {"routed_scale", cfg->routed_scale > 0.0 ? cfg->routed_scale : 1.0, NULL},
        {"seed (high 32 bits)", (double)(cfg->seed >> 32), NULL},
        {"seed (low 32 bits)", (double)(cfg->seed & 0xFFFFFFFFu), NULL},
    };
    st = moe_grid_agree(ep, fields, (int)(sizeof fields / sizeof *fields));
    if (st != MOE_OK) {
        moe_comm_free(ep);
        return moe_error_prefix(st, "moe_layer_create_mpi: ");
    }
    st = create_owning(out, cfg, NULL, ep, "moe_layer_create_mpi");
    if (st != MOE_OK) {
        moe_comm_free(ep);
        return st;
    }
    (*out)->owned_ep = ep;
    return MOE_OK;
}

/* Leaves a block: the last layer to leave frees it. */
static void drop_block(const moe_layer *L, moe_layer_block *b) {
    if (!b) return;
    if (b->maker == L) b->maker = NULL;
    if (--b->users > 0) return;
    L->ops->release(b->mem);
    free(b);
}

moe_status moe_layer_sync(moe_layer *L) {
    MOE_NOT_NULL("moe_layer_sync", "layer", L);
    bind(L);
    return L->ops->sync();
}

void moe_layer_destroy(moe_layer *L) {
    if (!L) return;
    bind(L);
    const moe_ops *ops = L->ops;
    if (L->owned) ops->release(L->owned);
    free(L->views);
    free(L->names);
    free(L->bias);
    free(L->bias_sent);
    free(L->bias_load);
    for (int kind = 0; ops && kind < N_BLOCKS; kind++) drop_block(L, L->blocks[kind]);
    if (ops) {
        ops->release(L->totals_dev);
        ops->release(L->keep_dev);
        ops->release(L->offsets_dev);
        ops->release(L->aux_grad_dev);
        ops->release(L->bias_dev);
    }
    free(L->topk_host);
    free(L->expert_rank);
    free(L->totals_host);
    free(L->rank_totals);
    free(L->rank_assigned);
    free(L->rank_kept);
    free(L->rank_T);
    free(L->global_assigned);
    free(L->keep);
    free(L->recv_rows);
    free(L->requests);
    free(L->send_n);
    free(L->host_mem);
    free(L->expert_offsets);
    free(L->local_offsets);
    free(L->aux_grad);
    free(L->seq_host);
    free(L->groups);
    if (L->owned_ep) moe_comm_free(L->owned_ep);
#if defined(MOE_HAVE_CUDA)
    if (L->cuda) {
        moe_cuda_unbind(L->cuda); /* no binding, nor a failure it kept, outlives its context */
        moe_cuda_ctx_destroy(L->cuda);
    }
#endif
    free(L);
}

/* ----------------------------------------------------------------- access */

int64_t moe_layer_tensor_count(const moe_layer *L) { return L ? L->n_tensors : 0; }

moe_status moe_layer_tensor(const moe_layer *L, int64_t index, moe_tensor_view *view) {
    MOE_NOT_NULL("moe_layer_tensor", "layer", L);
    MOE_NOT_NULL("moe_layer_tensor", "view", view);
    if (index < 0 || index >= L->n_tensors)
        return moe_error(MOE_ERR_INVALID_ARG, "moe_layer_tensor: index %lld outside [0, %lld)", (long long)index,
                         (long long)L->n_tensors);
    *view = L->views[index];
    return MOE_OK;
}

moe_status moe_layer_tensor_by_name(const moe_layer *L, const char *name, moe_tensor_view *view) {
    MOE_NOT_NULL("moe_layer_tensor_by_name", "layer", L);
    MOE_NOT_NULL("moe_layer_tensor_by_name", "name", name);
    MOE_NOT_NULL("moe_layer_tensor_by_name", "view", view);
    for (int64_t i = 0; i < L->n_tensors; i++)
        if (strcmp(L->views[i].name, name) == 0) {
            *view = L->views[i];
            return MOE_OK;
        }
    return moe_error(MOE_ERR_INVALID_ARG, "moe layer: no tensor named '%s'", name);
}

int64_t moe_layer_param_count(const moe_layer *L) { return L ? L->n_params : 0; }
float *moe_layer_params(moe_layer *L) { return L ? L->params : NULL; }
float *moe_layer_grads(moe_layer *L) { return L ? L->grads : NULL; }
/* Whose bias, load and jitter counter the layer uses. */
static moe_layer *state_of(moe_layer *L) { return L->owner ? L->owner : L; }
static const moe_layer *const_state_of(const moe_layer *L) { return L->owner ? L->owner : L; }

float *moe_layer_selection_bias(moe_layer *L) { return L ? state_of(L)->bias : NULL; }

moe_status moe_layer_share_state(moe_layer *twin, moe_layer *owner) {
    MOE_NOT_NULL("moe_layer_share_state", "twin", twin);
    MOE_NOT_NULL("moe_layer_share_state", "owner", owner);
    const moe_layer_config *a = &twin->cfg, *b = &owner->cfg;
    if (owner->owner || twin == owner || a->n_experts != b->n_experts || a->seed != b->seed ||
        a->jitter_eps != b->jitter_eps || a->bias_update_rate != b->bias_update_rate ||
        twin->mem.router != owner->mem.router)
        return moe_error(MOE_ERR_INVALID_ARG, "moe_layer_share_state: a twin is another layer over the owner's "
                                              "parameters with its config, and an owner is no twin");
    twin->owner = owner;
    return MOE_OK;
}

moe_status moe_layer_set_training(moe_layer *L, int training) {
    if (!L) return moe_error(MOE_ERR_INVALID_ARG, "moe_layer_set_training: layer is NULL");
    L->training = training != 0;
    return MOE_OK;
}

void moe_layer_set_loss_scale(moe_layer *L, double scale) { L->loss_scale = scale; }

void moe_layer_set_overlap(moe_layer *L, bool overlap) { L->overlap = overlap; }

void moe_layer_get_timing(const moe_layer *L, moe_layer_timing *timing) { *timing = L->timing; }
void moe_layer_reset_timing(moe_layer *L) { L->timing = (moe_layer_timing){0}; }

moe_status moe_layer_last_topk(moe_layer *L, const int32_t **topk) {
    if (!L->forward_done) return moe_error(MOE_ERR_STATE, "moe_layer_last_topk: no forward yet");
    const size_t bytes = (size_t)(L->last_T * L->cfg.top_k) * sizeof(int32_t);
    int32_t *host = realloc(L->topk_host, bytes ? bytes : 1);
    if (!host)
        return moe_error(MOE_ERR_OUT_OF_MEMORY, "moe_layer_last_topk: host copy of %lld router choices",
                         (long long)(L->last_T * L->cfg.top_k));
    L->topk_host = host;
    MOE_TRY(L->ops->download(L->topk_host, L->topk_idx, bytes));
    *topk = L->topk_host;
    return MOE_OK;
}
void moe_layer_set_replay(moe_layer *L, bool replay) { L->replay = replay; }
uint64_t moe_layer_jitter_counter(const moe_layer *L) { return const_state_of(L)->jitter_calls; }
void moe_layer_set_jitter_counter(moe_layer *L, uint64_t counter) { state_of(L)->jitter_calls = counter; }

/* The bias reaches the backend when it has changed: moe_layer_update_bias
 * sends it at once (a training step's end, when the device is idle), and
 * the next forward sends what a caller wrote through
 * moe_layer_selection_bias, so no forward waits for an unchanged one. */
static moe_status send_bias(moe_layer *L) {
    const size_t bytes = (size_t)L->cfg.n_experts * sizeof(float);
    const float *bias = state_of(L)->bias; /* a twin's device copy follows its owner's */
    if (memcmp(bias, L->bias_sent, bytes) == 0) return MOE_OK;
    MOE_TRY(L->ops->upload(L->bias_dev, bias, bytes));
    memcpy(L->bias_sent, bias, bytes);
    return MOE_OK;
}

moe_status moe_layer_zero_grad(moe_layer *L) {
    if (!L) return moe_error(MOE_ERR_INVALID_ARG, "moe_layer_zero_grad: layer is NULL");
    bind(L);
    for (int64_t v = 0; v < L->n_tensors && L->mem.router_grad; v++)
        L->ops->zero(L->views[v].grad, (size_t)(L->views[v].rows * L->views[v].cols) * sizeof(float));
    return L->ops->sync();
}

/* From bias_load, not the last forward's load: a step of several
 * micro-batches moves the bias once. */
moe_status moe_layer_update_bias(moe_layer *L) {
    if (!L) return moe_error(MOE_ERR_INVALID_ARG, "moe_layer_update_bias: layer is NULL");
    L = state_of(L);
    bind(L);
    if (!L->bias) return moe_error(MOE_ERR_CONFIG, "moe_layer_update_bias: bias_update_rate is 0, there is no bias");
    if (L->bias_forwards == 0)
        return moe_error(MOE_ERR_STATE, "moe_layer_update_bias: no training forward since the last update");
    moe_bias_update(L->bias, L->bias_load, L->cfg.n_experts, L->cfg.bias_update_rate);
    memset(L->bias_load, 0, (size_t)L->cfg.n_experts * sizeof *L->bias_load);
    L->bias_forwards = 0;
    return send_bias(L);
}

double moe_layer_forward_flops(const moe_layer_config *cfg, int64_t T) {
    if (!cfg || T <= 0 || cfg->d_model <= 0 || cfg->d_ff <= 0 || cfg->n_experts <= 0 || cfg->top_k <= 0 ||
        cfg->n_shared_experts < 0 || cfg->shared_d_ff < 0)
        return 0.0;
    double d = (double)cfg->d_model, ff = (double)cfg->d_ff, E = (double)cfg->n_experts;
    double k = (double)cfg->top_k, S = (double)moe_layer_shared_width(cfg), gate = cfg->shared_gate ? 1.0 : 0.0;
    return 2.0 * T * d * (E + gate) + 6.0 * T * k * d * ff + 6.0 * T * d * S;
}

/* --------------------------------------------------------------- workspace */

typedef struct ws_entry {
    void **ptr;
    int64_t count; /* elements */
    size_t size;   /* bytes per element */
} ws_entry;

static int64_t align_up(int64_t bytes) { return (bytes + MOE_ALIGN_BYTES - 1) / MOE_ALIGN_BYTES * MOE_ALIGN_BYTES; }

/* seq_host for the statistics and gradient rows of seqs sequences. */
static moe_status grow_seq_host(moe_layer *L, int64_t seqs) {
    const int64_t floats = seqs * 3 * L->cfg.n_experts;
    if (floats <= L->seq_host_floats) return MOE_OK;
    float *mem = realloc(L->seq_host, (size_t)floats * sizeof(float));
    if (!mem) return moe_error(MOE_ERR_OUT_OF_MEMORY, "moe layer: statistics of %lld sequences", (long long)seqs);
    L->seq_host = mem;
    L->seq_host_floats = floats;
    return MOE_OK;
}

/* Whether every per-token array of T tokens stays within the ops' sizes. */
static moe_status check_tokens(const moe_layer *L, int64_t T) {
    const moe_layer_config *c = &L->cfg;
    int64_t Tk, n;
    if (T > INT_MAX || !mul_ok(T, c->top_k, &Tk) || Tk > INT_MAX || !mul_ok(Tk, c->d_model, &n) ||
        !mul_ok(Tk, 2 * c->d_ff, &n) || !mul_ok(T, c->d_model, &n) || !mul_ok(T, 2 * L->shared_ff, &n) ||
        !mul_ok(T, c->n_experts, &n))
        return moe_error(MOE_ERR_INVALID_ARG, "moe_layer_forward: T=%lld tokens x top_k=%lld x d_model=%lld is too large",
                         (long long)T, (long long)c->top_k, (long long)c->d_model);
    return MOE_OK;
}

static moe_status check_rows(const moe_layer *L, int64_t R) {
    int64_t n;
    if (R > INT_MAX || !mul_ok(R, 2 * L->cfg.d_ff, &n) || !mul_ok(R, L->cfg.d_model, &n))
        return moe_error(MOE_ERR_INVALID_ARG, "moe_layer_forward: %lld expert rows are too many", (long long)R);
    return MOE_OK;
}

/* The arrays of a block of kind for n tokens (or expert rows), into t;
 * returns how many. */
static int block_arrays(moe_layer *L, block_kind kind, int64_t n, ws_entry *t) {
    const moe_layer_config *c = &L->cfg;
    const int64_t d = c->d_model, E = c->n_experts, k = c->top_k, S = L->shared_ff, ff = c->d_ff;
    const int64_t jitter = c->jitter_eps > 0.0 ? n * d : 0, ep_rows = L->ep ? n * d : 0;
    const bool gate = c->shared_gate != 0;
    /* The exchange's: m = min(k, P) ranks per token at most; with one
     * rank the plan's rows are the expert rows, k per token. */
    const int64_t P = L->ep ? L->ep_size : 0, m = k < P ? k : P, plan = L->ep ? n * m * d : n * k * d;
    const int64_t seqs = seq_aux_len(c) ? n / seq_aux_len(c) : 0;
    const size_t f = sizeof(float), i64 = sizeof(int64_t);
    int i = 0;
    switch (kind) {
    case BLOCK_CHOICES:
        t[i++] = (ws_entry){(void **)&L->topk_idx, n * k, sizeof(int32_t)};
        break;
    case BLOCK_TOKENS:
        t[i++] = (ws_entry){(void **)&L->x_in, jitter, f};
        t[i++] = (ws_entry){(void **)&L->noise, jitter, f};
        t[i++] = (ws_entry){(void **)&L->logits, n * E, f};
        t[i++] = (ws_entry){(void **)&L->prob, n * E, f};
        t[i++] = (ws_entry){(void **)&L->lse, n, f};
        t[i++] = (ws_entry){(void **)&L->topk_w, n * k, f};
        t[i++] = (ws_entry){(void **)&L->gate_chunks, (n + MOE_GATE_CHUNK_TOKENS - 1) / MOE_GATE_CHUNK_TOKENS * (2 * E + 1),
                            sizeof(double)};
        t[i++] = (ws_entry){(void **)&L->pair_row, n * k, i64};
        t[i++] = (ws_entry){(void **)&L->row_token, n * k, i64};
        t[i++] = (ws_entry){&L->plan_scratch, (int64_t)L->ops->plan_scratch_bytes(n, k, E), 1};
        t[i++] = (ws_entry){(void **)&L->xp, plan, f};
        t[i++] = (ws_entry){(void **)&L->yp, plan, f};
        t[i++] = (ws_entry){(void **)&L->sh_h, n * 2 * S, f};
        t[i++] = (ws_entry){(void **)&L->sh_g, n * S, f};
        t[i++] = (ws_entry){(void **)&L->sh_y, S > 0 ? n * d : 0, f};
        t[i++] = (ws_entry){(void **)&L->sh_logit, gate ? n : 0, f};
        t[i++] = (ws_entry){(void **)&L->sh_gate, gate ? n : 0, f};
        t[i++] = (ws_entry){(void **)&L->seq_stats, seqs * 2 * E, f};
        t[i++] = (ws_entry){(void **)&L->seq_aux_grad, seqs * E, f};
        t[i++] = (ws_entry){(void **)&L->send_tok, n * m, i64};
        t[i++] = (ws_entry){(void **)&L->tok_slot, n * P, i64};
        t[i++] = (ws_entry){(void **)&L->send_w, n * m * k, f};
        break;
    case BLOCK_DTOKENS:
        t[i++] = (ws_entry){(void **)&L->dx_in, jitter, f};
        t[i++] = (ws_entry){(void **)&L->dlogits, n * E, f};
        t[i++] = (ws_entry){(void **)&L->dweights, n * k, f};
        t[i++] = (ws_entry){(void **)&L->dyp, plan, f};
        t[i++] = (ws_entry){(void **)&L->dxp, plan, f};
        t[i++] = (ws_entry){(void **)&L->sh_dh, n * 2 * S, f};
        t[i++] = (ws_entry){(void **)&L->sh_dy, gate ? n * d : 0, f};
        t[i++] = (ws_entry){(void **)&L->sh_dlogit, gate ? n : 0, f};
        t[i++] = (ws_entry){(void **)&L->dw_back, n * m * k, f};
        break;
    case BLOCK_ROWS:
        t[i++] = (ws_entry){(void **)&L->xe, ep_rows, f};
        t[i++] = (ws_entry){(void **)&L->ye, ep_rows, f};
        t[i++] = (ws_entry){(void **)&L->h, n * 2 * ff, f};
        t[i++] = (ws_entry){(void **)&L->g, n * ff, f};
        t[i++] = (ws_entry){(void **)&L->rx, ep_rows, f};
        t[i++] = (ws_entry){(void **)&L->recv_w, P ? n * k : 0, f};
        t[i++] = (ws_entry){(void **)&L->recv_pair, P ? n * k : 0, i64};
        t[i++] = (ws_entry){(void **)&L->recv_row, P ? n : 0, i64};
        break;
    case BLOCK_DROWS:
        t[i++] = (ws_entry){(void **)&L->dye, ep_rows, f};
        t[i++] = (ws_entry){(void **)&L->dxe, ep_rows, f};
        t[i++] = (ws_entry){(void **)&L->dh, n * 2 * ff, f};
        t[i++] = (ws_entry){(void **)&L->dw_send, P ? n * k : 0, f};
        break;
    case N_BLOCKS:
        break;
    }
    return i;
}

#define MAX_BLOCK_ARRAYS 24

/* Points kind's arrays into its block, first growing the block (its
 * contents lost) for n tokens or rows when it holds fewer. */
static moe_status carve_block(moe_layer *L, block_kind kind, int64_t n) {
    static const char *const what[N_BLOCKS] = {"router choices", "activations", "expert-row activations",
                                               "backward scratch", "expert-row backward scratch"};
    moe_layer_block *b = L->blocks[kind];
    ws_entry table[MAX_BLOCK_ARRAYS];
    if (n > b->size) {
        const int count = block_arrays(L, kind, n, table);
        int64_t total = 0;
        for (int i = 0; i < count; i++) {
            int64_t bytes;
            if (!mul_ok(table[i].count, (int64_t)table[i].size, &bytes) || bytes > INT64_MAX / 4 - total)
                return moe_error(MOE_ERR_INVALID_ARG, "moe_layer_forward: %s for %lld overflow", what[kind], (long long)n);
            total += align_up(bytes);
        }
        if ((uint64_t)total > SIZE_MAX)
            return moe_error(MOE_ERR_INVALID_ARG, "moe_layer_forward: %s exceed size_t", what[kind]);
        void *mem = NULL;
        moe_status st = L->ops->alloc(&mem, (size_t)total);
        if (st != MOE_OK)
            return moe_error_prefix(st, "moe_layer_forward: %lld bytes of %s for %lld: ", (long long)total, what[kind],
                                    (long long)n);
        L->ops->release(b->mem);
        *b = (moe_layer_block){.mem = mem, .size = n, .bytes = total, .users = b->users, .maker = b->maker};
    }
    const int count = block_arrays(L, kind, b->size, table);
    int64_t off = 0;
    for (int i = 0; i < count; i++) {
        *table[i].ptr = table[i].count ? (char *)b->mem + off : NULL;
        off += align_up(table[i].count * (int64_t)table[i].size);
    }
    return MOE_OK;
}

/* With one rank the expert rows are the plan's rows. */
static void alias_rows(moe_layer *L) {
    if (L->ep) return;
    L->xe = L->xp;
    L->ye = L->yp;
    L->dye = L->dyp;
    L->dxe = L->dxp;
}

/* The arrays of T tokens: choices, tokens, the sequence statistics' host
 * rows (in evaluation too, so that training at the same T allocates
 * nothing). */
static moe_status carve_token_arrays(moe_layer *L, int64_t T) {
    MOE_TRY(check_tokens(L, T));
    if (seq_aux_len(&L->cfg)) MOE_TRY(grow_seq_host(L, T / seq_aux_len(&L->cfg)));
    MOE_TRY(carve_block(L, BLOCK_CHOICES, T));
    return carve_block(L, BLOCK_TOKENS, T);
}

/* The forward's arrays for T tokens, its activations now this layer's. A
 * layer with gradients sizes its backward's scratch here too (and by rows
 * in carve_rows), where the forward waits for the device anyway: growing
 * it in backward would make backward wait (moe.h says it never does). */
static moe_status carve_tokens(moe_layer *L, int64_t T) {
    MOE_TRY(carve_token_arrays(L, T));
    if (L->mem.router_grad) MOE_TRY(carve_block(L, BLOCK_DTOKENS, T));
    L->blocks[BLOCK_TOKENS]->holder = L;
    return MOE_OK;
}

static moe_status carve_rows(moe_layer *L, int64_t R) {
    MOE_TRY(check_rows(L, R));
    if (L->mem.router_grad) MOE_TRY(carve_block(L, BLOCK_DROWS, R));
    MOE_TRY(carve_block(L, BLOCK_ROWS, R));
    L->rows_sized = R;
    L->blocks[BLOCK_ROWS]->holder = L;
    alias_rows(L);
    return MOE_OK;
}

/* The exchange's host bookkeeping for T tokens and R expert rows. */
static moe_status carve_host(moe_layer *L, int64_t T, int64_t R) {
    const int64_t k = L->cfg.top_k, P = L->ep_size, m = k < P ? k : P;
    const ws_entry t[] = {
        {(void **)&L->h_pair_row, T * k, sizeof(int64_t)},
        {(void **)&L->h_send_tok, T * m, sizeof(int64_t)},  {(void **)&L->h_tok_slot, T * P, sizeof(int64_t)},
        {(void **)&L->h_send_codes, T * m * k, sizeof(int32_t)}, {(void **)&L->h_recv_codes, R * k, sizeof(int32_t)},
        {(void **)&L->h_recv_pair, R * k, sizeof(int64_t)}, {(void **)&L->h_recv_row, R, sizeof(int64_t)},
    };
    const int n = (int)(sizeof t / sizeof *t);
    int64_t total = 0;
    for (int i = 0; i < n; i++) total += align_up(t[i].count * (int64_t)t[i].size);
    if (total > L->host_bytes) {
        void *mem = realloc(L->host_mem, (size_t)total);
        if (!mem)
            return moe_error(MOE_ERR_OUT_OF_MEMORY, "moe layer: %lld bytes of exchange bookkeeping for %lld tokens",
                             (long long)total, (long long)T);
        L->host_mem = mem;
        L->host_bytes = total;
    }
    int64_t off = 0;
    for (int i = 0; i < n; i++) {
        *t[i].ptr = (char *)L->host_mem + off;
        off += align_up(t[i].count * (int64_t)t[i].size);
    }
    return MOE_OK;
}

/* Expert rows this rank may work on when it routes T tokens and the batch
 * global_T: its pairs with one rank; with several, every pair of the batch
 * or its experts' capacity, whichever is fewer. */
static int64_t rows_bound(const moe_layer *L, int64_t T, int64_t global_T) {
    const int64_t k = L->cfg.top_k;
    if (!L->ep) return T * k;
    const int64_t cap = moe_capacity(L->cfg.capacity_factor, global_T, k, L->cfg.n_experts);
    return cap >= 0 && L->n_local * cap < global_T * k ? L->n_local * cap : global_T * k;
}

moe_status moe_layer_reserve(moe_layer *L, int64_t T, bool backward) {
    MOE_NOT_NULL("moe_layer_reserve", "layer", L);
    if (T < 1) return moe_error(MOE_ERR_INVALID_ARG, "moe_layer_reserve: T=%lld must be positive", (long long)T);
    bind(L);
    MOE_TRY(check_tokens(L, T));
    const int64_t R = rows_bound(L, T, T * L->batch_size);
    MOE_TRY(check_rows(L, R));
    MOE_TRY(carve_token_arrays(L, T));
    MOE_TRY(carve_block(L, BLOCK_ROWS, R));
    if (L->ep) MOE_TRY(carve_host(L, T, R));
    if (!backward) return MOE_OK;
    MOE_TRY(carve_block(L, BLOCK_DTOKENS, T));
    return carve_block(L, BLOCK_DROWS, R);
}

moe_status moe_layer_share_workspace(moe_layer *L, moe_layer *with, bool activations) {
    MOE_NOT_NULL("moe_layer_share_workspace", "layer", L);
    MOE_NOT_NULL("moe_layer_share_workspace", "with", with);
    const moe_layer_config *a = &L->cfg, *b = &with->cfg;
    if (L == with) return MOE_OK;
    if (L->cuda || with->cuda || L->ops != with->ops || L->ep_size != with->ep_size || a->d_model != b->d_model ||
        a->d_ff != b->d_ff || a->n_experts != b->n_experts || a->top_k != b->top_k ||
        moe_layer_shared_width(a) != moe_layer_shared_width(b) || (a->shared_gate != 0) != (b->shared_gate != 0) ||
        (a->jitter_eps > 0.0) != (b->jitter_eps > 0.0) ||
        seq_aux_len(a) != seq_aux_len(b))
        return moe_error(MOE_ERR_INVALID_ARG, "moe_layer_share_workspace: the layers differ in d_model, d_ff, experts, "
                                              "top_k, shared experts, jitter, the sequence-wise loss or its seq_len, "
                                              "backend or expert-parallel size, or one has its own device context");
    for (int kind = BLOCK_TOKENS; kind < N_BLOCKS; kind++) {
        const bool scratch = kind == BLOCK_DTOKENS || kind == BLOCK_DROWS;
        if ((!scratch && !activations) || L->blocks[kind] == with->blocks[kind]) continue;
        drop_block(L, L->blocks[kind]);
        L->blocks[kind] = with->blocks[kind];
        L->blocks[kind]->users++;
    }
    return MOE_OK;
}

int64_t moe_layer_workspace_bytes(moe_layer *L) {
    int64_t bytes = 0;
    for (int kind = 0; L && kind < N_BLOCKS; kind++) {
        moe_layer_block *b = L->blocks[kind];
        if (!b->maker) b->maker = L; /* its maker left it: a user counts it now */
        if (b->maker == L) bytes += b->bytes;
    }
    return bytes;
}

/* ---------------------------------------------------------------- routing */

/* A forward that fails on one batch rank fails on every rank at once: the
 * failing rank joins the collective its peers wait in next (the jitter's
 * token counts, the router totals, the exchange's send counts) with a
 * count of -1 (tell_peers), and they stop there, naming it. */
static moe_status peer_refused(int r) {
    return moe_error(MOE_ERR_COMM, "moe_layer_forward: rank %d of the layer's ranks failed its forward (its own "
                                   "error says why)",
                     r);
}

static void tell_peers(moe_layer *L, moe_status st) {
    moe_kept_error kept = {0};
    moe_error_keep(&kept, st);
    if (L->peers == PEERS_IN_TOKEN_COUNTS) {
        const int64_t refused = -1;
        (void)moe_comm_allgather(L->batch, L->rank_T, &refused, 1, MOE_COMM_I64);
    } else if (L->peers == PEERS_IN_TOTALS) {
        const int64_t E = L->cfg.n_experts, W = 2 * E + 3;
        double *mine = L->rank_totals + (int64_t)L->batch_rank * W;
        memset(mine, 0, (size_t)W * sizeof *mine);
        mine[2 * E + 1] = -1.0;
        (void)moe_comm_allgather(L->batch, L->rank_totals, mine, W, MOE_COMM_F64);
    } else if (L->peers == PEERS_IN_SEND_COUNTS) {
        for (int r = 0; r < L->ep_size; r++) L->send_n[r] = -1;
        (void)moe_comm_alltoall(L->ep, L->recv_n, L->send_n, 1, MOE_COMM_I64);
    }
    L->peers = PEERS_TOLD;
    (void)moe_error_take(&kept, st); /* the cause, not the telling, is the message */
}

/* Shares every batch rank's router totals (one all-gather of 2E + 3 doubles
 * per rank; seq_sum: its sequences' sum of sum_e f_e P_e, seq_aux_sum),
 * then derives, identically on every rank: the global pairs per
 * expert, what this rank keeps under capacity, and what it receives. The
 * sums run in rank order, so they do not depend on the collective's own
 * reduction order. */
static moe_status share_routing(moe_layer *L, int64_t T, double z_sum, double seq_sum) {
    const int64_t E = L->cfg.n_experts, k = L->cfg.top_k, W = 2 * E + 3, N = L->batch_size, P = L->ep_size;
    double *mine = L->rank_totals + (int64_t)L->batch_rank * W;
    for (int64_t e = 0; e < E; e++) {
        mine[e] = (double)L->assigned[e];
        mine[E + e] = L->prob_sum[e];
    }
    mine[2 * E] = z_sum;
    mine[2 * E + 1] = (double)T;
    mine[2 * E + 2] = seq_sum;
    if (L->batch) {
        L->peers = PEERS_TOLD;
        moe_status st = moe_comm_allgather(L->batch, L->rank_totals, mine, W, MOE_COMM_F64);
        if (st != MOE_OK) return moe_error_prefix(st, "moe layer dispatch (router totals): ");
        for (int64_t r = 0; r < N; r++)
            if (L->rank_totals[r * W + 2 * E + 1] < 0.0) return peer_refused((int)r);
        if (L->ep) L->peers = PEERS_IN_SEND_COUNTS; /* the exchange's plan (plan_sends) */
    }
    double z = 0.0, aux = 0.0, seq_aux = 0.0;
    L->global_T = 0;
    for (int64_t e = 0; e < E; e++) L->global_assigned[e] = 0;
    for (int64_t r = 0; r < N; r++) {
        const double *t = L->rank_totals + r * W;
        for (int64_t e = 0; e < E; e++) {
            L->rank_assigned[r * E + e] = (int64_t)t[e];
            L->global_assigned[e] += (int64_t)t[e];
        }
        z += t[2 * E];
        L->global_T += (int64_t)t[2 * E + 1];
        seq_aux += t[2 * E + 2];
    }
    const int64_t GT = L->global_T, cap = moe_capacity(L->cfg.capacity_factor, GT, k, E);
    double max_assigned = 0.0;
    int64_t kept_total = 0, rank_rows[MOE_EXPERTS_MAX] = {0}; /* [P] rows each rank of the EP group keeps */
    for (int64_t e = 0; e < E; e++) {
        double P_e = 0.0;
        for (int64_t r = 0; r < N; r++) P_e += L->rank_totals[r * W + E + e];
        if (GT) aux += ((double)L->global_assigned[e] / (double)(GT * k)) * (P_e / (double)GT);
        if ((double)L->global_assigned[e] > max_assigned) max_assigned = (double)L->global_assigned[e];
        const int64_t kept_e = moe_keep_counts(L->rank_kept, L->rank_assigned, N, e, E, cap);
        L->keep[e] = L->rank_kept[L->batch_rank];
        kept_total += kept_e;
        if (L->last.tokens_per_expert) L->last.tokens_per_expert[e] = kept_e;
        /* Rows from EP source s for this expert, when it is one of ours. */
        const int64_t j = e - L->first_local;
        if (j >= 0 && j < L->n_local)
            for (int s = 0; s < P; s++) L->recv_rows[s * L->n_local + j] = L->rank_kept[L->group_base + s];
        for (int s = 0; s < P; s++) rank_rows[e / L->n_local] += L->rank_kept[L->group_base + s];
    }
    int64_t group_rows = 0, busiest = 0;
    for (int r = 0; r < P; r++) {
        group_rows += rank_rows[r];
        if (rank_rows[r] > busiest) busiest = rank_rows[r];
    }
    L->last.rank_imbalance = group_rows ? (double)busiest / ((double)group_rows / (double)P) : 0.0;
    L->last.pairs = GT * k;
    L->last.dropped = GT * k - kept_total;
    /* A batch with no tokens at all (every rank idle) has no balance to
     * speak of: zeros, as one idle rank reports. */
    L->last.aux_loss = GT ? (double)E * aux : 0.0;
    /* Over the global batch's sequences: an idle rank reports it too. */
    const bool seq_on = seq_aux_len(&L->cfg) && L->training && GT >= L->cfg.seq_len;
    L->last.seq_aux_loss = seq_on ? seq_aux / (double)(GT / L->cfg.seq_len) : 0.0;
    L->last.z_loss = GT ? z / (double)GT : 0.0;
    L->last.load_imbalance = GT ? max_assigned / ((double)(GT * k) / (double)E) : 0.0;

    /* Where each local expert's rows land. */
    L->local_offsets[0] = 0;
    for (int64_t j = 0; j < L->n_local; j++) {
        int64_t n = 0;
        for (int s = 0; s < P; s++) n += L->recv_rows[s * L->n_local + j];
        L->local_offsets[j + 1] = L->local_offsets[j] + n;
    }
    return MOE_OK;
}

/* Where the rows from source s for local expert j sit among the expert rows:
 * each expert's rows in source order, which is the global batch's order. */
static int64_t expert_row(const moe_layer *L, int64_t s, int64_t j) {
    int64_t row = L->local_offsets[j];
    for (int64_t s2 = 0; s2 < s; s2++) row += L->recv_rows[s2 * L->n_local + j];
    return row;
}

/* Waits for requests [from, to), all of them; st: the status so far, kept
 * with its message when it is a failure. */
static moe_status wait_requests(moe_layer *L, int from, int to, moe_status st) {
    return moe_comm_wait_all(L->requests + from, to - from, st);
}

/* Runs groups [from, to) and counts their time as the experts'. */
static void run_groups(moe_layer *L, bool backward, int64_t from, int64_t to, double *compute_seconds) {
    if (from >= to) return;
    const double t = omp_get_wtime();
    (backward ? L->ops->experts_backward : L->ops->experts_forward)(&L->groups[from], to - from, L->cfg.d_model);
    *compute_seconds += omp_get_wtime() - t;
}

/* ------------------------------------------------------------ the exchange */

/* Under expert parallelism a token travels once to each rank holding any
 * of its experts, not once per expert (as DeepEP dispatches): its row, its
 * k gate weights and, for each of its k slots, which of that rank's experts
 * the slot is (-1: another rank's, or dropped). That rank copies the row to
 * each of its experts and sends back one row per token, its experts'
 * outputs weighted and summed; in backward one gradient row per token goes
 * out, and one input-gradient row and the token's k weight gradients come
 * back. With a token's experts on few ranks (grouped routing) its rows
 * cross the network fewer times than it has experts. Each rank's partial
 * sum rounds apart from one rank's sum over the slots: results agree with
 * one rank's within float summation order, not to the bit.
 *
 * The receiving rank works on its sources all at once, or with overlap in
 * two halves of the EP group, its own half first: those tokens as soon as
 * they are in, their results sent back at once while the other half's
 * rows are still in flight. The experts then take the halves' rows apart,
 * so the weight gradients sum per half: the two agree within rounding. */

enum { TAG_CODES, TAG_WEIGHTS, TAG_ROWS, TAG_RETURN, TAG_DWEIGHTS };

/* The expert of plan row `row`: the last whose rows start at or before it
 * (an empty expert starts where the next one does). */
static int64_t expert_of_row(const moe_layer *L, int64_t row) {
    int64_t lo = 0, hi = L->cfg.n_experts - 1;
    while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (L->expert_offsets[mid] <= row)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

/* Which of its T tokens this rank sends to each rank of the EP group, each
 * once, in token order (send_tok), with the slot codes of each, and where
 * token t's row for rank r sits among them (tok_slot); then every rank
 * learns how many tokens each source sends it. */
static moe_status plan_sends(moe_layer *L, int64_t T) {
    const int64_t k = L->cfg.top_k, P = L->ep_size, nl = L->n_local;
    MOE_TRY(carve_host(L, T, L->rows_sized));
    /* The plan's rows say each kept pair's expert too: one download, each
     * row then turned into its expert (-1: dropped) in place. */
    int64_t *expert = L->h_pair_row;
    MOE_TRY(L->ops->download(expert, L->pair_row, (size_t)(T * k) * sizeof(int64_t)));
    for (int64_t p = 0; p < T * k; p++) expert[p] = expert[p] >= 0 ? expert_of_row(L, expert[p]) : -1;
    int64_t *slot = L->h_tok_slot;
    for (int64_t r = 0; r < P; r++) L->send_n[r] = 0;
    for (int64_t t = 0; t < T; t++) { /* each token's place in its ranks' lists */
        for (int64_t r = 0; r < P; r++) slot[t * P + r] = -1;
        for (int64_t i = 0; i < k; i++) {
            const int64_t r = expert[t * k + i] >= 0 ? expert[t * k + i] / nl : -1;
            if (r >= 0 && slot[t * P + r] < 0) slot[t * P + r] = L->send_n[r]++;
        }
    }
    for (int64_t r = 0; r <= P; r++) L->send_off[r] = r ? L->send_off[r - 1] + L->send_n[r - 1] : 0;
    for (int64_t t = 0; t < T; t++)
        for (int64_t r = 0; r < P; r++) {
            if (slot[t * P + r] < 0) continue;
            const int64_t u = L->send_off[r] + slot[t * P + r];
            slot[t * P + r] = u;
            L->h_send_tok[u] = t;
            for (int64_t i = 0; i < k; i++) {
                const int64_t e = expert[t * k + i];
                L->h_send_codes[u * k + i] = e >= 0 && e / nl == r ? (int32_t)(e % nl) : -1;
            }
        }
    L->peers = PEERS_TOLD;
    moe_status st = moe_comm_alltoall(L->ep, L->recv_n, L->send_n, 1, MOE_COMM_I64);
    if (st != MOE_OK) return moe_error_prefix(st, "moe layer dispatch (token counts): ");
    for (int64_t s = 0; s < P; s++)
        if (L->recv_n[s] == -1) return peer_refused((int)s);
    int64_t received = 0;
    for (int64_t s = 0; s < P; s++) {
        L->recv_off[s] = received;
        if (L->recv_n[s] < 0 || L->recv_n[s] > L->local_offsets[nl] - received)
            return moe_error(MOE_ERR_COMM, "moe layer dispatch: EP rank %lld sends %lld tokens, more than the %lld "
                                           "rows the routing totals give this rank's experts",
                             (long long)s, (long long)L->recv_n[s], (long long)L->local_offsets[nl]);
        received += L->recv_n[s];
    }
    L->recv_off[P] = received;
    const int64_t sent = L->send_off[P];
    MOE_TRY(L->ops->upload(L->send_tok, L->h_send_tok, (size_t)sent * sizeof(int64_t)));
    return L->ops->upload(L->tok_slot, slot, (size_t)(T * P) * sizeof(int64_t));
}

/* Uploads rows [from, to) of the host array host into dev, of width
 * elements of size bytes each. */
static moe_status upload_rows(const moe_layer *L, void *dev, const void *host, int64_t from, int64_t to,
                              size_t bytes) {
    if (to <= from) return MOE_OK;
    return L->ops->upload((char *)dev + from * (int64_t)bytes, (const char *)host + from * (int64_t)bytes,
                          (size_t)(to - from) * bytes);
}

/* From the slot codes received from sources [s0, s1), the expert row of
 * each of their tokens' slots (recv_pair) and the token of each of those
 * expert rows (recv_row): each expert's rows from source s in s's token
 * order, as the routing totals placed them. Codes that do not fill those
 * rows exactly are refused. */
static moe_status plan_receives(moe_layer *L, int64_t s0, int64_t s1) {
    const int64_t k = L->cfg.top_k, nl = L->n_local;
    /* [P, nl]: the next row of expert j from source s, and where its rows end */
    int64_t next[MOE_EXPERTS_MAX], end[MOE_EXPERTS_MAX];
    for (int64_t s = s0; s < s1; s++)
        for (int64_t j = 0; j < nl; j++) {
            next[s * nl + j] = expert_row(L, s, j);
            end[s * nl + j] = next[s * nl + j] + L->recv_rows[s * nl + j];
        }
    for (int64_t s = s0; s < s1; s++)
        for (int64_t u = L->recv_off[s]; u < L->recv_off[s] + L->recv_n[s]; u++) {
            bool any = false;
            for (int64_t i = 0; i < k; i++) {
                const int32_t j = L->h_recv_codes[u * k + i];
                int64_t row = -1;
                if (j >= 0) {
                    if (j >= nl || next[s * nl + j] == end[s * nl + j])
                        return moe_error(MOE_ERR_COMM, "moe layer dispatch: EP rank %lld sends a token for expert %d "
                                                       "beyond the rows the routing totals give it",
                                         (long long)s, (int)(L->first_local + j));
                    row = next[s * nl + j]++;
                    L->h_recv_row[row] = u;
                    any = true;
                }
                L->h_recv_pair[u * k + i] = row;
            }
            if (!any)
                return moe_error(MOE_ERR_COMM, "moe layer dispatch: EP rank %lld sends a token for none of this rank's "
                                               "experts", (long long)s);
        }
    for (int64_t s = s0; s < s1; s++)
        for (int64_t j = 0; j < nl; j++)
            if (next[s * nl + j] != end[s * nl + j])
                return moe_error(MOE_ERR_COMM, "moe layer dispatch: EP rank %lld sends %lld tokens for expert %lld, "
                                               "the routing totals %lld",
                                 (long long)s,
                                 (long long)(next[s * nl + j] - end[s * nl + j] + L->recv_rows[s * nl + j]),
                                 (long long)(L->first_local + j), (long long)L->recv_rows[s * nl + j]);
    MOE_TRY(upload_rows(L, L->recv_pair, L->h_recv_pair, L->recv_off[s0] * k, L->recv_off[s1] * k,
                        sizeof(int64_t)));
    /* Each expert's rows from these sources, adjacent ones in one copy. */
    int64_t from = 0, to = 0;
    for (int64_t j = 0; j < nl; j++) {
        const int64_t a = expert_row(L, s0, j), b = expert_row(L, s1, j);
        if (a != to) {
            MOE_TRY(upload_rows(L, L->recv_row, L->h_recv_row, from, to, sizeof(int64_t)));
            from = a;
        }
        to = b;
    }
    return upload_rows(L, L->recv_row, L->h_recv_row, from, to, sizeof(int64_t));
}

/* One array the exchange moves: width elements per token, from the sending
 * side's array to the receiving side's; host arrays go over the EP
 * communicator, backend ones over the one for rows. */
typedef struct exchange_part {
    const void *from;
    void *to;
    int64_t width;
    moe_comm_dtype dtype;
    int tag;
    bool host;
} exchange_part;

/* Posts the messages of parts with peers [p0, p1), this rank's own share
 * copied: outward, from this rank's tokens to their experts' ranks (send
 * counts out, receive counts in), else back. sends/recvs: which to post.
 * first [P + 1], when given: where each peer's requests start. */
static moe_status post_parts(moe_layer *L, const exchange_part *parts, int n_parts, bool outward, bool sends,
                             bool recvs, int64_t p0, int64_t p1, int *first) {
    const int64_t *out_n = outward ? L->send_n : L->recv_n, *out_off = outward ? L->send_off : L->recv_off;
    const int64_t *in_n = outward ? L->recv_n : L->send_n, *in_off = outward ? L->recv_off : L->send_off;
    for (int64_t peer = p0; peer < p1; peer++) {
        if (first) first[peer] = L->n_requests;
        for (int p = 0; p < n_parts; p++) {
            const exchange_part *m = &parts[p];
            const int64_t unit = m->width * moe_comm_dtype_size(m->dtype);
            moe_comm *comm = m->host ? L->ep : L->ep_rows;
            const char *from = (const char *)m->from + out_off[peer] * unit;
            char *to = (char *)m->to + in_off[peer] * unit;
            if (peer == L->ep_rank) {
                const size_t bytes = (size_t)(out_n[peer] * unit);
                if (sends && bytes && m->host)
                    memcpy(to, from, bytes);
                else if (sends && bytes)
                    L->ops->copy(to, from, bytes);
                continue;
            }
            if (recvs && in_n[peer] > 0) {
                moe_comm_request *req = &L->requests[L->n_requests++];
                *req = (moe_comm_request)MOE_COMM_REQUEST_INIT;
                MOE_TRY(moe_comm_irecv(comm, req, to, in_n[peer] * m->width, m->dtype, (int)peer, m->tag));
            }
            if (sends && out_n[peer] > 0) {
                moe_comm_request *req = &L->requests[L->n_requests++];
                *req = (moe_comm_request)MOE_COMM_REQUEST_INIT;
                MOE_TRY(moe_comm_isend(comm, req, from, out_n[peer] * m->width, m->dtype, (int)peer, m->tag));
                L->timing.exchange_bytes += out_n[peer] * unit;
            }
        }
    }
    if (first) first[p1] = L->n_requests;
    return MOE_OK;
}

/* Points the local expert groups at the rows from sources [s0, s1): each
 * expert's are adjacent. */
static void point_groups(moe_layer *L, int64_t s0, int64_t s1) {
    const int64_t d = L->cfg.d_model, ff = L->cfg.d_ff;
    /* Row r0 of an array, which a forward with no backward scratch (an
     * inference model's) or no rows may not have. */
#define ROW_OF(a, r0, width) ((a) ? (a) + (r0) * (width) : NULL)
    for (int64_t j = 0; j < L->n_local; j++) {
        const int64_t r0 = expert_row(L, s0, j);
        const moe_tensor_view *w = &L->views[1 + 3 * j]; /* w1, w3, w2 */
        L->groups[j] = (moe_expert_group){
            .rows = expert_row(L, s1, j) - r0, .d_ff = ff, .x = ROW_OF(L->xe, r0, d), .w13 = w[0].param,
            .w2 = w[2].param, .h = ROW_OF(L->h, r0, 2 * ff), .g = ROW_OF(L->g, r0, ff), .y = ROW_OF(L->ye, r0, d),
            .dy = ROW_OF(L->dye, r0, d), .dh = ROW_OF(L->dh, r0, 2 * ff), .dx = ROW_OF(L->dxe, r0, d),
            .dw13 = w[0].grad, .dw2 = w[2].grad};
    }
#undef ROW_OF
}

/* Sources [from, to), which the receiving side takes together. */
typedef struct source_batch {
    int64_t from, to;
} source_batch;

/* The batches the receiving side takes its sources in, in order, into b
 * [2]; returns how many. All at once, or with overlap in two halves, this
 * rank's own half first, its own rows there at once (tags match the
 * messages then; the driver refuses overlap otherwise). Halves, not one
 * source at a time: each batch splits every expert's GEMMs, and smaller
 * GEMMs run slower (on the CPU each packs the weights again). */
static int source_batches(const moe_layer *L, source_batch *b) {
    const int64_t P = L->ep_size, half = P / 2;
    if (!L->overlap) {
        b[0] = (source_batch){0, P};
        return 1;
    }
    const source_batch lower = {0, half}, upper = {half, P};
    b[0] = L->ep_rank < half ? lower : upper;
    b[1] = L->ep_rank < half ? upper : lower;
    return 2;
}

/* The views of the shared experts: gate_proj, up_proj, down_proj, then
 * the gate's weight under shared_gate. */
static const moe_tensor_view *shared_views(const moe_layer *L) { return &L->views[1 + 3 * L->n_local]; }

/* Under shared_gate, after the shared experts' forward: sh_y times
 * sigmoid(x_in . w) per token, in place (their backward does not read
 * their output, and the gate's reads only the product); its time counts
 * as the experts'. */
static void gate_shared(moe_layer *L, const float *x_in, int64_t T, double *compute_seconds) {
    if (!L->cfg.shared_gate || T == 0) return;
    const double t0 = omp_get_wtime();
    const int64_t d = L->cfg.d_model;
    L->ops->gemm(L->sh_logit, x_in, shared_views(L)[3].param, T, 1, d, d, d, 1, false, true, 1.0f, 0.0f);
    L->ops->sigmoid_gate_forward(L->sh_y, L->sh_gate, L->sh_y, L->sh_logit, T, d);
    *compute_seconds += omp_get_wtime() - t0;
}

/* Under shared_gate, the gate's backward in two parts: before the shared
 * experts' backward, their output gradient sh_dy and the gate logits'
 * sh_dlogit from dy; after it (dx_in written), the gate weight's gradient
 * and its share of dx_in. */
static void gate_shared_backward(moe_layer *L, const float *dy, int64_t T) {
    if (!L->cfg.shared_gate || T == 0) return;
    L->ops->sigmoid_gate_backward(L->sh_dy, L->sh_dlogit, dy, L->sh_y, L->sh_gate, T, L->cfg.d_model);
}

static void gate_shared_finish(moe_layer *L, float *dx_in, const float *x_in, int64_t T) {
    if (!L->cfg.shared_gate || T == 0) return;
    const int64_t d = L->cfg.d_model;
    const moe_tensor_view *w = &shared_views(L)[3];
    L->ops->gemm(w->grad, L->sh_dlogit, x_in, 1, d, T, 1, d, d, true, false, 1.0f, 1.0f);
    L->ops->gemm(dx_in, L->sh_dlogit, w->param, T, d, 1, 1, d, d, false, false, 1.0f, 1.0f);
}

/* The exchange's forward: y [T, d] from this rank's tokens x_in, the
 * shared experts' group (when n_groups > n_local) set up. */
static moe_status forward_exchange(moe_layer *L, float *y, const float *x_in, int64_t T, int64_t n_groups,
                                   double *compute_seconds) {
    const moe_ops *ops = L->ops;
    const int64_t d = L->cfg.d_model, k = L->cfg.top_k, P = L->ep_size, nl = L->n_local;
    MOE_TRY(plan_sends(L, T));
    const int64_t sent = L->send_off[P];
    ops->permute(L->xp, x_in, L->send_tok, sent, d);
    ops->permute(L->send_w, L->topk_w, L->send_tok, sent, k);
    const exchange_part out[] = {{L->h_send_codes, L->h_recv_codes, k, MOE_COMM_I32, TAG_CODES, true},
                                 {L->send_w, L->recv_w, k, MOE_COMM_F32, TAG_WEIGHTS, false},
                                 {L->xp, L->rx, d, MOE_COMM_F32, TAG_ROWS, false}};
    const exchange_part back = {L->rx, L->yp, d, MOE_COMM_F32, TAG_RETURN, false};
    /* Where tags match the messages, the returns' receives go first. */
    const bool early_returns = moe_comm_matches_by_tag(L->ep_rows);
    int first[MOE_EXPERTS_MAX + 1]; /* each source's dispatch requests */
    L->n_requests = 0;
    moe_status st = early_returns ? post_parts(L, &back, 1, false, false, true, 0, P, NULL) : MOE_OK;
    if (st == MOE_OK) st = post_parts(L, out, 3, true, true, true, 0, P, first);
    run_groups(L, false, nl, n_groups, compute_seconds); /* the shared experts fill the wait */
    gate_shared(L, x_in, T, compute_seconds);
    source_batch batches[2];
    const int n_batches = source_batches(L, batches);
    for (int b = 0; st == MOE_OK && b < n_batches; b++) {
        const int64_t s0 = batches[b].from, s1 = batches[b].to;
        st = wait_requests(L, first[s0], first[s1], MOE_OK);
        if (st == MOE_OK) st = plan_receives(L, s0, s1);
        if (st != MOE_OK) break;
        for (int64_t j = 0; j < nl; j++) {
            const int64_t r0 = expert_row(L, s0, j);
            ops->permute(L->xe + r0 * d, L->rx, L->recv_row + r0, expert_row(L, s1, j) - r0, d);
        }
        point_groups(L, s0, s1);
        run_groups(L, false, 0, nl, compute_seconds);
        const int64_t u0 = L->recv_off[s0];
        ops->combine(L->rx + u0 * d, L->ye, L->recv_w + u0 * k, L->recv_pair + u0 * k, NULL,
                     L->recv_off[s1] - u0, k, d);
        st = post_parts(L, &back, 1, false, true, !early_returns, s0, s1, NULL);
    }
    st = wait_requests(L, 0, L->n_requests, st);
    if (st != MOE_OK) return moe_error_prefix(st, "moe layer exchange of rows: ");
    if (T == 0) return MOE_OK;
    if (L->shared_ff)
        ops->copy(y, L->sh_y, (size_t)(T * d) * sizeof(float));
    else
        ops->zero(y, (size_t)(T * d) * sizeof(float));
    ops->unpermute_add(y, L->yp, L->tok_slot, T, P, d);
    return MOE_OK;
}

/* The exchange's backward: dx_in [T, d] (holding the shared experts' share
 * or zeros) gains the routed experts' share, and dweights the gate
 * weights' gradients, from dy. */
static moe_status backward_exchange(moe_layer *L, float *dx_in, const float *dy, int64_t T, int64_t n_groups,
                                    double *compute_seconds) {
    const moe_ops *ops = L->ops;
    const int64_t d = L->cfg.d_model, k = L->cfg.top_k, P = L->ep_size, nl = L->n_local;
    const int64_t sent = L->send_off[P];
    ops->permute(L->dyp, dy, L->send_tok, sent, d);
    const exchange_part out = {L->dyp, L->rx, d, MOE_COMM_F32, TAG_ROWS, false};
    const exchange_part back[] = {{L->rx, L->dxp, d, MOE_COMM_F32, TAG_RETURN, false},
                                  {L->dw_send, L->dw_back, k, MOE_COMM_F32, TAG_DWEIGHTS, false}};
    const bool early_returns = moe_comm_matches_by_tag(L->ep_rows);
    int first[MOE_EXPERTS_MAX + 1];
    L->n_requests = 0;
    moe_status st = early_returns ? post_parts(L, back, 2, false, false, true, 0, P, NULL) : MOE_OK;
    if (st == MOE_OK) st = post_parts(L, &out, 1, true, true, true, 0, P, first);
    run_groups(L, true, nl, n_groups, compute_seconds);
    source_batch batches[2];
    const int n_batches = source_batches(L, batches);
    for (int b = 0; st == MOE_OK && b < n_batches; b++) {
        const int64_t s0 = batches[b].from, s1 = batches[b].to;
        st = wait_requests(L, first[s0], first[s1], MOE_OK);
        if (st != MOE_OK) break;
        const int64_t u0 = L->recv_off[s0], n = L->recv_off[s1] - u0;
        ops->combine_backward(L->dye, L->dw_send + u0 * k, L->rx + u0 * d, L->ye, L->recv_w + u0 * k,
                              L->recv_pair + u0 * k, n, k, d);
        point_groups(L, s0, s1);
        run_groups(L, true, 0, nl, compute_seconds);
        ops->zero(L->rx + u0 * d, (size_t)(n * d) * sizeof(float));
        ops->unpermute_add(L->rx + u0 * d, L->dxe, L->recv_pair + u0 * k, n, k, d);
        st = post_parts(L, back, 2, false, true, !early_returns, s0, s1, NULL);
    }
    st = wait_requests(L, 0, L->n_requests, st);
    if (st != MOE_OK) return moe_error_prefix(st, "moe layer exchange of gradients: ");
    if (T == 0) return MOE_OK;
    ops->unpermute_add(dx_in, L->dxp, L->tok_slot, T, P, d);
    ops->zero(L->dweights, (size_t)(T * k) * sizeof(float));
    ops->unpermute_add(L->dweights, L->dw_back, L->tok_slot, T, P, k);
    return MOE_OK;
}

/* ----------------------------------------------------------------- forward */

/* The gate's parameters; aux_seq_len set when the last forward took the
 * sequence-wise loss. */
static moe_gate_params gate_params(const moe_layer *L) {
    const moe_layer_config *c = &L->cfg;
    return (moe_gate_params){.n_experts = c->n_experts, .top_k = c->top_k, .kind = c->gate,
                             .renormalize = c->renormalize != 0, .n_groups = c->n_groups,
                             .top_groups = c->top_groups,
                             .routed_scale = c->routed_scale > 0.0 ? (float)c->routed_scale : 1.0f,
                             .aux_seq_len = L->seqs ? c->seq_len : 0};
}

/* The sum over this rank's sequences of sum_e f_e P_e, from their
 * statistics in seq_host: for sequence q of n tokens, f_e = E c_qe / (k n)
 * of its c_qe pairs on e, P_e = p_qe / n of its probability sum p_qe. */
static double seq_aux_sum(const moe_layer *L) {
    const int64_t E = L->cfg.n_experts, n = L->cfg.seq_len;
    double sum = 0.0;
    for (int64_t q = 0; q < L->seqs; q++) {
        const float *assigned = L->seq_host + q * 2 * E, *prob_sum = assigned + E;
        for (int64_t e = 0; e < E; e++) sum += (double)assigned[e] * (double)prob_sum[e];
    }
    return (double)E / ((double)L->cfg.top_k * (double)n * (double)n) * sum;
}

/* The balancing losses' gradient for backward at the current loss scale:
 * the batch-wide one's over the global batch (its counts and size); with
 * the sequence-wise one, a row per sequence, d/dP[t, e] = coef E c_qe /
 * (k n^2 S) for sequence q's c_qe pairs on e, n tokens and S sequences in
 * the global batch, plus the batch-wide row. */
static moe_status send_aux_grad(moe_layer *L) {
    const moe_layer_config *c = &L->cfg;
    const int64_t E = c->n_experts;
    if (c->aux_loss_coef > 0.0)
        moe_aux_grad(L->aux_grad, L->global_assigned, L->global_T, c->top_k, E, c->aux_loss_coef * L->loss_scale);
    L->aux_grad_scale = L->loss_scale;
    if (L->seqs) {
        const double n = (double)c->seq_len, S = (double)(L->global_T / c->seq_len);
        const double scale = c->seq_aux_loss_coef * L->loss_scale * (double)E / ((double)c->top_k * n * n * S);
        float *grad = L->seq_host + L->seqs * 2 * E;
        for (int64_t q = 0; q < L->seqs; q++)
            for (int64_t e = 0; e < E; e++)
                grad[q * E + e] = (float)(scale * L->seq_host[q * 2 * E + e]) +
                                  (c->aux_loss_coef > 0.0 ? L->aux_grad[e] : 0.0f);
        return L->ops->upload(L->seq_aux_grad, grad, (size_t)(L->seqs * E) * sizeof(float));
    }
    if (c->aux_loss_coef == 0.0) return MOE_OK; /* backward passes no aux gradient */
    return L->ops->upload(L->aux_grad_dev, L->aux_grad, (size_t)E * sizeof(float));
}

/* The sequence-wise loss's statistics of this training forward's T tokens
 * into seq_host; L->seqs = 0 when the loss is off or the layer evaluates. */
static moe_status seq_aux_stats(moe_layer *L, int64_t T) {
    const moe_layer_config *c = &L->cfg;
    const int64_t E = c->n_experts;
    L->seqs = seq_aux_len(c) && L->training ? T / c->seq_len : 0;
    if (!L->seqs) return MOE_OK; /* seq_host is carve_tokens' */
    const moe_gate_params gp = gate_params(L);
    L->ops->gate_seq_stats(L->seq_stats, L->topk_idx, L->prob, &gp, T);
    return L->ops->download(L->seq_host, L->seq_stats, (size_t)(L->seqs * 2 * E) * sizeof(float));
}

/* Points the expert groups at this step's rows; the shared experts, when
 * present, are one more group over this rank's T tokens. */
static int64_t setup_groups(moe_layer *L, int64_t T, const float *x_in, const float *dy) {
    point_groups(L, 0, L->ep_size);
    if (L->shared_ff == 0) return L->n_local;
    const moe_tensor_view *sv = shared_views(L);
    L->groups[L->n_local] = (moe_expert_group){
        .rows = T, .d_ff = L->shared_ff, .x = x_in, .w13 = sv[0].param, .w2 = sv[2].param,
        .h = L->sh_h, .g = L->sh_g, .y = L->sh_y, .dy = dy && L->cfg.shared_gate ? L->sh_dy : dy, .dh = L->sh_dh,
        .dx = NULL, /* set by backward */
        .dw13 = sv[0].grad, .dw2 = sv[2].grad};
    return L->n_local + 1;
}

static moe_status forward(moe_layer *L, float *y, const float *x, int64_t T, moe_layer_stats *stats);

moe_status moe_layer_forward(moe_layer *L, float *y, const float *x, int64_t T, moe_layer_stats *stats) {
    MOE_NOT_NULL("moe_layer_forward", "layer", L);
    /* Until this forward succeeds, no backward may differentiate the last
     * one: carving may already replace its router choices. */
    L->forward_done = false;
    L->peers = !L->batch ? PEERS_TOLD : L->cfg.jitter_eps > 0.0 ? PEERS_IN_TOKEN_COUNTS : PEERS_IN_TOTALS;
    const moe_status st = forward(L, y, x, T, stats);
    if (st != MOE_OK && L->peers != PEERS_TOLD) tell_peers(L, st);
    return st;
}

static moe_status forward(moe_layer *L, float *y, const float *x, int64_t T, moe_layer_stats *stats) {
    if (T < 0) return moe_error(MOE_ERR_INVALID_ARG, "moe_layer_forward: T=%lld must not be negative", (long long)T);
    if (T > 0) { /* a rank with no tokens may pass no buffers */
        MOE_NOT_NULL("moe_layer_forward", "y", y);
        MOE_NOT_NULL("moe_layer_forward", "x", x);
    }
    if (L->training && seq_aux_len(&L->cfg) && T % L->cfg.seq_len)
        return moe_error(MOE_ERR_INVALID_ARG,
                         "moe_layer_forward: T=%lld is not a multiple of seq_len=%lld, which the sequence-wise "
                         "balancing loss (seq_aux_loss_coef) needs in training",
                         (long long)T, (long long)L->cfg.seq_len);
    bind(L);
    if (T == 0 && !L->batch) { /* nothing to route, and no peer waiting for this rank */
        /* Counted as a forward of ranks that are all idle counts it: its
         * jitter draw and its (empty) load for the bias step. */
        if (draws_jitter(L)) state_of(L)->jitter_calls++;
        if (L->bias && L->training && !L->replay) state_of(L)->bias_forwards++;
        if (stats) {
            int64_t *tpe = stats->tokens_per_expert;
            *stats = (moe_layer_stats){.tokens_per_expert = tpe};
            if (tpe) memset(tpe, 0, (size_t)L->cfg.n_experts * sizeof *tpe);
        }
        L->last_T = 0;
        L->forward_done = true;
        return MOE_OK;
    }
    MOE_TRY(carve_tokens(L, T > 0 ? T : 1)); /* with no tokens, the per-expert arrays still */
    const moe_layer_config *c = &L->cfg;
    const moe_ops *ops = L->ops;
    const int64_t d = c->d_model, E = c->n_experts, k = c->top_k;

    const float *x_in = x;
    if (c->jitter_eps > 0.0) {
        /* Eval mode keeps the factors at 1 so backward needs no second path. */
        const float eps = (float)c->jitter_eps;
        const uint64_t call = state_of(L)->jitter_calls;
        const int on = L->training;
        /* Noise indexed by the token's place in the global batch (rank 0's
         * tokens first), so P ranks draw what one rank draws for the whole
         * batch. Every backend draws the same bits (ops.h uniform), on the
         * backend. */
        int64_t before = 0; /* tokens of the batch ranks before this one */
        if (L->batch) {
            L->peers = PEERS_TOLD;
            moe_status st = moe_comm_allgather(L->batch, L->rank_T, &T, 1, MOE_COMM_I64);
            if (st != MOE_OK) return moe_error_prefix(st, "moe layer jitter (token counts): ");
            for (int r = 0; r < L->batch_size; r++)
                if (L->rank_T[r] < 0) return peer_refused(r);
            L->peers = PEERS_IN_TOTALS;
            for (int r = 0; r < L->batch_rank; r++) before += L->rank_T[r];
        }
        const uint64_t stream = MOE_JITTER_STREAM + call, first = (uint64_t)(before * d);
        ops->uniform(L->noise, c->seed, stream, first, on ? 1.0f - eps : 1.0f, on ? 2.0f * eps : 0.0f, T * d);
        ops->multiply(L->x_in, x, L->noise, T * d);
        if (draws_jitter(L)) state_of(L)->jitter_calls++;
        x_in = L->x_in;
    }
    if (L->bias) MOE_TRY(send_bias(L));

    const float *wg = L->views[0].param; /* [E, d] */
    ops->gemm(L->logits, x_in, wg, T, E, d, d, d, E, false, true, 1.0f, 0.0f);
    L->seqs = 0;
    const moe_gate_params gp = gate_params(L);
    moe_gate_totals totals = {.assigned = L->totals_dev,
                              .prob_sum = (double *)L->totals_dev + E,
                              .z_sum = (double *)L->totals_dev + 2 * E,
                              .chunk_scratch = L->gate_chunks};
    ops->gate_forward(L->topk_idx, L->topk_w, L->prob, L->lse, &totals, L->logits, L->bias_dev, &gp, T);
    /* THE HOST WAIT, the layer's only one on one rank: the host decides
     * capacity and the exchange, so it needs the counts. While the device
     * is idle, the host also sends what the plan and backward need from
     * it. (Under expert parallelism the exchange's plan waits once more,
     * for the plan's rows: plan_sends. With the sequence-wise loss, the
     * wait is its statistics' download, and the totals follow from a
     * device with nothing left to finish.) */
    MOE_TRY(seq_aux_stats(L, T));
    MOE_TRY(ops->download(L->totals_host, L->totals_dev, (size_t)(2 * E + 1) * sizeof(int64_t)));
    L->last.tokens_per_expert = stats ? stats->tokens_per_expert : NULL;
    MOE_TRY(share_routing(L, T, *L->z_sum, L->seqs ? seq_aux_sum(L) : 0.0));
    if (L->bias && L->training && !L->replay) {
        moe_layer *owner = state_of(L);
        for (int64_t e = 0; e < E; e++) owner->bias_load[e] += L->global_assigned[e];
        owner->bias_forwards++;
    }
    MOE_TRY(ops->upload(L->keep_dev, L->keep, (size_t)E * sizeof(int64_t)));
    MOE_TRY(send_aux_grad(L));
    ops->plan_build(L->pair_row, L->row_token, L->offsets_dev, L->topk_idx, L->keep_dev, L->plan_scratch, T, k, E);
    /* The plan's offsets are the prefix sums of keep: no wait for them. */
    L->expert_offsets[0] = 0;
    for (int64_t e = 0; e < E; e++) L->expert_offsets[e + 1] = L->expert_offsets[e] + L->keep[e];
    MOE_TRY(carve_rows(L, rows_bound(L, T, L->global_T)));
    const double t0 = omp_get_wtime();
    const int64_t n_groups = setup_groups(L, T, x_in, NULL);
    double compute = 0.0;
    if (L->ep) {
        MOE_TRY(forward_exchange(L, y, x_in, T, n_groups, &compute));
    } else {
        ops->permute(L->xp, x_in, L->row_token, L->expert_offsets[E], d);
        run_groups(L, false, 0, n_groups, &compute);
        gate_shared(L, x_in, T, &compute);
        ops->combine(y, L->yp, L->topk_w, L->pair_row, L->shared_ff ? L->sh_y : NULL, T, k, d);
    }
    L->timing.exchange_seconds += omp_get_wtime() - t0 - compute;
    L->timing.experts_seconds += compute;
    L->timing.calls++;

    L->last.tokens_per_expert = NULL; /* the caller's array, filled above */
    if (stats) {
        int64_t *tpe = stats->tokens_per_expert;
        *stats = L->last;
        stats->tokens_per_expert = tpe;
    }
    L->last_T = T;
    L->forward_done = true;
    return MOE_OK;
}

/* ---------------------------------------------------------------- backward */

moe_status moe_layer_backward(moe_layer *L, float *dx, const float *dy, const float *x) {
    MOE_NOT_NULL("moe_layer_backward", "layer", L);
    if (!L->forward_done) return moe_error(MOE_ERR_STATE, "moe_layer_backward: no forward to differentiate");
    if (L->last_T > 0) {
        MOE_NOT_NULL("moe_layer_backward", "dx", dx);
        MOE_NOT_NULL("moe_layer_backward", "dy", dy);
        MOE_NOT_NULL("moe_layer_backward", "x", x);
        /* dx is written while dy and x are still read. */
        const size_t bytes = (size_t)(L->last_T * L->cfg.d_model) * sizeof(float);
        const uintptr_t out = (uintptr_t)dx;
        const struct {
            const char *name;
            uintptr_t at;
        } reads[] = {{"dy", (uintptr_t)dy}, {"x", (uintptr_t)x}};
        for (size_t i = 0; i < sizeof reads / sizeof *reads; i++)
            if (out < reads[i].at + bytes && reads[i].at < out + bytes)
                return moe_error(MOE_ERR_INVALID_ARG,
                                 "moe_layer_backward: dx overlaps %s (T %lld x d %lld floats each): give dx a buffer "
                                 "of its own",
                                 reads[i].name, (long long)L->last_T, (long long)L->cfg.d_model);
    }
    bind(L);
    if (!L->mem.router_grad)
        return moe_error(MOE_ERR_STATE, "moe_layer_backward: the layer was made without gradients (forwards only)");
    if (L->last_T == 0 && !L->batch) return MOE_OK; /* no tokens, no peers: nothing to add */
    if (L->blocks[BLOCK_TOKENS]->holder != L || L->blocks[BLOCK_ROWS]->holder != L)
        return moe_error(MOE_ERR_STATE, "moe_layer_backward: another layer's forward has overwritten this layer's "
                                        "activations since (a shared workspace): run its forward again first");
    MOE_TRY(carve_block(L, BLOCK_TOKENS, 0));
    MOE_TRY(carve_block(L, BLOCK_ROWS, 0));
    MOE_TRY(carve_block(L, BLOCK_DTOKENS, L->last_T > 0 ? L->last_T : 1));
    MOE_TRY(carve_block(L, BLOCK_DROWS, L->rows_sized));
    alias_rows(L);
    const moe_layer_config *c = &L->cfg;
    const moe_ops *ops = L->ops;
    const int64_t T = L->last_T, d = c->d_model, E = c->n_experts, k = c->top_k;
    const bool jitter = c->jitter_eps > 0.0;
    const float *x_in = jitter ? L->x_in : x;
    float *dx_in = jitter ? L->dx_in : dx; /* [T, d] */

    const double t0 = omp_get_wtime();
    gate_shared_backward(L, dy, T);
    const int64_t n_groups = setup_groups(L, T, x_in, dy);
    if (L->shared_ff)
        L->groups[L->n_local].dx = dx_in; /* written: the shared experts start the sum */
    else if (T > 0)
        ops->zero(dx_in, (size_t)(T * d) * sizeof(float));
    double compute = 0.0;
    if (L->ep) {
        MOE_TRY(backward_exchange(L, dx_in, dy, T, n_groups, &compute));
    } else {
        ops->combine_backward(L->dyp, L->dweights, dy, L->yp, L->topk_w, L->pair_row, T, k, d);
        run_groups(L, true, 0, n_groups, &compute);
        ops->unpermute_add(dx_in, L->dxp, L->pair_row, T, k, d);
    }
    L->timing.exchange_seconds += omp_get_wtime() - t0 - compute;
    L->timing.experts_seconds += compute;
    L->timing.calls++;

    /* Forward sent the aux gradient with the loss scale of its time; a
     * scale set since then (a model's first step) costs a wait here. */
    if (L->aux_grad_scale != L->loss_scale) MOE_TRY(send_aux_grad(L));
    const int64_t GT = L->global_T;
    const moe_gate_params gp = gate_params(L);
    const float *aux_grad = L->seqs ? L->seq_aux_grad : c->aux_loss_coef > 0.0 ? L->aux_grad_dev : NULL;
    ops->gate_backward(L->dlogits, L->dweights, L->topk_idx, L->topk_w, L->prob, L->lse, L->logits, aux_grad,
                       (float)(c->z_loss_coef * L->loss_scale / (double)GT), &gp, T);
    const moe_tensor_view *gate = &L->views[0];
    ops->gemm(gate->grad, L->dlogits, x_in, E, d, T, E, d, d, true, false, 1.0f, 1.0f);
    ops->gemm(dx_in, L->dlogits, gate->param, T, d, E, E, d, d, false, false, 1.0f, 1.0f);
    gate_shared_finish(L, dx_in, x_in, T);

    if (jitter) ops->multiply(dx, dx_in, L->noise, T * d);
    return MOE_OK;
}
