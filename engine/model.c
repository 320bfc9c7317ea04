/* model.c: the Mixtral forward is a straight list of op calls and the
 * backward is its mirror, layer by layer (llm.c's shape). */
#include "engine/model.h"

#include <limits.h>
#include <stdarg.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/host_memory.h"
#include "common/rng.h"
#include "common/status.h"
#include "engine/device.h"
#include "engine/moe_layer.h"
#include "engine/rope.h"
#include "kernels/ops.h"

#define MOE_ALIGN_BYTES 64

typedef struct moe_layer_offsets {
    int64_t router, experts, shared; /* into the parameter (and gradient) arrays */
} moe_layer_offsets;

/* Where layer l's tensors sit in the tensor table: these, then with
 * moe_qk_norm QNORM and KNORM, with moe_qkv_bias q's, k's and v's biases
 * (bias_first), then the MoE layer's (moe_first). */
enum { LN1, WQ, WK, WV, WO, LN2, QNORM, KNORM };

typedef struct layer_acts {
    float *x;      /* [N, C] input of the layer (residual stream) */
    float *ln1;    /* [N, C] */
    float *rstd1;  /* [N] */
    float *q;      /* [N, Hq*hd], after RoPE */
    float *k;      /* [N, Hkv*hd], after RoPE */
    /* With moe_qk_norm: q and k before their norms, and each norm's rstd,
     * one a row of its width (moe_qk_norm_width). */
    float *q_raw;  /* [N, Hq*hd] */
    float *k_raw;  /* [N, Hkv*hd] */
    float *rstd_q; /* [N*Hq*hd / width] */
    float *rstd_k; /* [N*Hkv*hd / width] */
    float *v;      /* [N, Hkv*hd] */
    float *att;    /* [B, Hq, T, T] */
    float *atty;   /* [N, Hq*hd] */
    float *x_mid;  /* [N, C] x + attention */
    float *ln2;    /* [N, C] */
    float *rstd2;  /* [N] */
    float *moe_y;  /* [N, C] */
    /* A dense layer's MLP (moe_model_config_layer_is_dense), F its width:
     * the gate and up projections, and silu(gate) * up. */
    float *mlp_h;  /* [N, 2F] */
    float *mlp_g;  /* [N, F] */
} layer_acts;

struct moe_model {
    moe_model_config cfg;
    const moe_ops *ops;
    int64_t B, T, N; /* N = B * T */
    int64_t n_tensors;
    moe_model_tensor *tensors; /* [n_tensors] */
    int64_t nl;                /* this stage's layers; arrays [nl] below are by local index */
    int64_t moe_layers;        /* the model's MoE layers, every stage's: what the routing losses average over */
    int64_t *layer_id;         /* [nl] each local layer's number in the model, ascending */
    int chunks;                /* the stage's model chunks (interleaved pipelines), each a run of layers */
    uint64_t serves;           /* bit c: this instance holds chunk c's layers (a twin may hold some only) */
    int64_t *chunk_at;         /* [chunks + 1] chunk c is the local layers chunk_at[c] .. chunk_at[c + 1] - 1 */
    bool first, last;          /* the stage holds the embedding (chunk 0's); the final norm and the head (the last chunk's) */
    int64_t *layer_first;      /* [nl] first tensor of each layer */
    /* The last stage's final norm and head weight, in the table: the head's
     * is the embedding's when tie_word_embeddings holds. */
    int64_t final_norm, head;
    int64_t n_params;          /* length of the arrays: the dense run, then this rank's experts, each padded */
    int64_t n_dense;           /* parameters of the first run: what every rank holds */
    int64_t expert_offset;     /* where the second run starts */
    int64_t n_expert;          /* parameters of the second run: this rank's experts */
    int64_t n_init_streams;    /* tensors of the one-rank table so far */
    float *params, *grads;     /* one allocation each, backend memory */
    float *host_params;        /* the host view of params: params itself when the host sees backend memory */
    int64_t model_dense;       /* the dense run of the whole model, every stage's */
    uint64_t seed;             /* of the initial values and the jitter streams */
    bool overlap;              /* moe_model_set_overlap */
    struct moe_model *base;    /* a twin's (moe_model_create_twin): whose tables and arrays these are; NULL */
    moe_layer **moe;           /* [nl] NULL for a dense layer, and a layer a twin does not hold */
    moe_layer_offsets *moe_off; /* [nl] where each layer's MoE parameters start */
    moe_comm *world, *ep;      /* NULL: one rank */
    moe_comm *replicas;        /* the ranks holding this rank's experts (same EP rank); NULL: none */
    moe_comm *device_world, *device_ep, *device_replicas; /* the same, for backend memory */
    bool own_device_replicas;
    moe_comm *pipe, *device_pipe; /* the pipeline's stages; NULL: one stage */
    moe_comm *job;                /* every rank; NULL: one rank */
    int world_size, world_rank, ep_size, ep_rank, stage, n_stages;
    bool sync_grads;           /* the next backward all-reduces the gradients */
    moe_comm_request *sync_reqs; /* [2 nl + 2] in flight during and after that backward */
    int n_sync_reqs;

    void *arena;
    int64_t arena_bytes; /* this instance's own part of it */
    /* Recomputation (moe_model_parallel.recompute): each layer keeps its
     * input x; the rest of acts[l] is one set that every layer, of the base
     * and its twins, writes in turn, and a backward runs its layer's
     * forward again first unless the set still holds it. */
    bool recompute;
    bool inference; /* moe_model_parallel.inference: no backward, one set of activations, each layer's keys kept */
    bool decode_only; /* moe_model_parallel.decode_only: no forward, arrays of one position per row */
    int64_t *cached;  /* [B] each row's positions whose keys and values the cache holds (moe_model_decode) */
    uint64_t *jitter_at;    /* [nl] each layer's jitter counter before the last forward */
    /* [nl + 1, E] the base's: per layer, the pairs each expert kept over
     * the global batch in the training forwards (replays aside) since the
     * last moe_model_take_expert_load, the base's and its twins'; then one
     * forward's. */
    int64_t *expert_load;
    const struct moe_model *holder; /* base: the instance, and its layer, whose activations the set holds */
    int64_t holder_layer;
    layer_acts *acts; /* [nl] */
    float *x_final;   /* [N, C] output of the last layer; before the last stage, of each chunk */
    float *x_send;    /* [N, C] on the last stage of an interleaved pipeline: the other chunks' outputs */
    float *lnf;       /* [N, C] */
    float *rstdf;     /* [N] */
    float *logits;    /* [N, V], then dlogits */
    double *lse;      /* [N] */
    float *losses;    /* [N] */
    float *dloss;     /* [N] */
    float dloss_value; /* what every element of dloss holds */
    float *cos_t, *sin_t; /* [T, hd/2] */
    float *ones;          /* [rows] 1s, with moe_qkv_bias: the biases reach their rows through GEMMs */
    int32_t *inputs, *targets; /* [N] the batch's tokens, uploaded */
    double *sumsq;        /* [2] the gradient's squares: dense run, experts */
    void *norm_scratch;   /* ops->rmsnorm_scratch_bytes(N, C) */
    float *losses_host;   /* [N] the last forward's losses, downloaded */
    double *lse_host;     /* [N] their logsumexps, downloaded: the logits' z-loss */
    double logit_z_coef;  /* the base's: moe_model_set_logit_z_loss */
    float *staging;       /* [max(N, largest tensor)] host values on their way to the backend */
    /* backward scratch */
    float *dres;  /* [N, C] gradient of the residual stream */
    float *dln;   /* [N, C] */
    float *dmoe;  /* [N, C] */
    float *dmlp_h; /* [N, 2F] a dense layer's d(mlp_h) */
    float *dq, *dk, *dv, *datty; /* like q, k, v, atty */
    float *dqk_raw; /* with moe_qk_norm: the gradients of q_raw and k_raw, one array */
    float *datt;  /* [B, Hq, T, T] */
    uint64_t pending; /* bit c: chunk c's forward waits for its backward */
    bool has_targets;
    bool training;  /* moe_model_set_training */
    bool logits_valid; /* logits hold the last forward's (its backward reuses them for dlogits) */
    int64_t counted; /* the last forward's targets that count (not negative), this rank's */
};

/* ---------------------------------------------------------------- tensors */

/* A layer's first bias (q's, then k's and v's), after its norms. */
static int64_t bias_first(const moe_model_config *c) { return c->moe_qk_norm ? KNORM + 1 : LN2 + 1; }

/* A layer's first MoE tensor, after its dense ones. */
static int64_t moe_first(const moe_model_config *c) { return bias_first(c) + (c->moe_qkv_bias ? 3 : 0); }

static void add_tensor(moe_model *m, int ndim, int64_t rows, int64_t cols, bool decay, const char *fmt, ...)
    MOE_PRINTF(6, 7);

/* Without a table (m->tensors NULL) it only counts the tensor. */
static void add_tensor(moe_model *m, int ndim, int64_t rows, int64_t cols, bool decay, const char *fmt, ...) {
    const int64_t numel = rows * (ndim == 2 ? cols : 1);
    if (!m->tensors) {
        m->n_tensors++;
        m->n_params += numel;
        return;
    }
    moe_model_tensor *t = &m->tensors[m->n_tensors++];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(t->name, sizeof t->name, fmt, ap);
    va_end(ap);
    t->ndim = ndim;
    t->shape[0] = rows;
    t->shape[1] = ndim == 2 ? cols : 1;
    t->numel = numel;
    t->offset = m->n_params;
    t->decay = decay;
    t->init_stream = m->n_init_streams++;
    m->n_params += t->numel;
}

static int64_t round_up(int64_t n, int64_t multiple) { return (n + multiple - 1) / multiple * multiple; }

/* Whether local layer i is a dense MLP layer, which has no MoE layer. */
static bool dense_layer(const moe_model *m, int64_t i) { return moe_model_config_layer_is_dense(&m->cfg, m->layer_id[i]); }

/* The tensor table, and where each tensor lives. Parameters (and gradients)
 * are two runs: first everything every rank holds (embedding, attention,
 * norms, routers, shared experts, dense layers' MLPs, head), then the
 * experts this rank holds,
 * so the data-parallel reduction is one call per run. Each run is padded
 * with zeros to a multiple of the ranks that share it, so that sharding the
 * optimizer state splits it into equal blocks. A layer's MoE tensors are
 * placeholders here; the layer names them once it exists. Without a table
 * (m->tensors NULL) it only counts the tensors and parameters. */
static void lay_out_tensors(moe_model *m, const moe_layer_config *lc) {
    const moe_model_config *c = &m->cfg;
    const int64_t C = c->hidden_size, V = c->vocab_size, hd = c->head_dim;
    const int64_t qdim = c->num_attention_heads * hd, kvdim = c->num_key_value_heads * hd;
    const int64_t n_local = lc->n_experts / m->ep_size;
    const int64_t shared = moe_layer_shared_width(lc) ? 3 + (lc->shared_gate ? 1 : 0) : 0;
    const int64_t moe_tensors = 1 + 3 * n_local + shared;
    const int64_t L = m->nl;
    /* Tensors of one layer in the one-rank table, which the init streams
     * count: an MoE layer's, a dense layer's (its MLP's three). */
    const int64_t layer_streams = moe_first(c) + 1 + 3 * lc->n_experts + shared;
    const int64_t fewer = layer_streams - (moe_first(c) + 3); /* a dense layer's fewer */
    int64_t dense_before = 0, counted = 0; /* dense layers among the model's first `counted` */
    const bool table = m->tensors != NULL;
    m->n_tensors = m->n_params = 0;
    m->n_init_streams = 0;
    if (m->first) add_tensor(m, 2, V, C, true, "model.embed_tokens.weight");
    for (int64_t i = 0; i < L; i++) {
        const int64_t l = m->layer_id[i];
        /* The one-rank table's stream of layer l's first tensor: the
         * embedding's, then each layer's, every expert's among them. */
        while (counted < l) dense_before += moe_model_config_layer_is_dense(c, counted++);
        m->n_init_streams = 1 + l * layer_streams - dense_before * fewer;
        if (table) m->layer_first[i] = m->n_tensors;
        add_tensor(m, 1, C, 1, false, "model.layers.%lld.input_layernorm.weight", (long long)l);
        add_tensor(m, 2, qdim, C, true, "model.layers.%lld.self_attn.q_proj.weight", (long long)l);
        add_tensor(m, 2, kvdim, C, true, "model.layers.%lld.self_attn.k_proj.weight", (long long)l);
        add_tensor(m, 2, kvdim, C, true, "model.layers.%lld.self_attn.v_proj.weight", (long long)l);
        add_tensor(m, 2, C, qdim, true, "model.layers.%lld.self_attn.o_proj.weight", (long long)l);
        add_tensor(m, 1, C, 1, false, "model.layers.%lld.post_attention_layernorm.weight", (long long)l);
        if (c->moe_qk_norm) {
            add_tensor(m, 1, moe_qk_norm_width(c, false), 1, false, "model.layers.%lld.self_attn.q_norm.weight",
                       (long long)l);
            add_tensor(m, 1, moe_qk_norm_width(c, true), 1, false, "model.layers.%lld.self_attn.k_norm.weight",
                       (long long)l);
        }
        for (int b = 0; c->moe_qkv_bias && b < 3; b++) {
            add_tensor(m, 1, b ? kvdim : qdim, 1, false, "model.layers.%lld.self_attn.%c_proj.bias", (long long)l,
                       "qkv"[b]);
            if (table) m->tensors[m->n_tensors - 1].bias = true;
        }
        if (dense_layer(m, i)) { /* its MLP in the MoE tensors' place */
            const int64_t F = moe_model_config_dense_width(c);
            add_tensor(m, 2, F, C, true, "model.layers.%lld.mlp.gate_proj.weight", (long long)l);
            add_tensor(m, 2, F, C, true, "model.layers.%lld.mlp.up_proj.weight", (long long)l);
            add_tensor(m, 2, C, F, true, "model.layers.%lld.mlp.down_proj.weight", (long long)l);
            continue;
        }
        if (table) m->moe_off[i].router = m->n_params;
        m->n_params += lc->n_experts * C;
        if (table) m->moe_off[i].shared = m->n_params;
        m->n_params += moe_layer_shared_params(lc);
        for (int64_t j = 0; j < moe_tensors; j++) add_tensor(m, 2, 0, 0, true, "%s", "");
    }
    m->n_init_streams = 1 + c->num_hidden_layers * layer_streams - moe_model_config_dense_layer_count(c) * fewer;
    if (m->last) {
        m->final_norm = m->n_tensors;
        add_tensor(m, 1, C, 1, false, "model.norm.weight");
        m->head = 0; /* the embedding, tied; a tied model is one stage, first and last */
        if (!c->tie_word_embeddings) {
            m->head = m->n_tensors;
            add_tensor(m, 2, V, C, true, "lm_head.weight");
        }
    }
    m->n_dense = m->n_params;
    m->expert_offset = round_up(m->n_dense, m->world_size);
    const int64_t layer_experts = n_local * 3 * lc->d_ff * C;
    m->n_expert = 0;
    for (int64_t l = 0; l < L; l++) {
        if (table) m->moe_off[l].experts = m->expert_offset + m->n_expert;
        if (!dense_layer(m, l)) m->n_expert += layer_experts;
    }
    m->n_params = m->expert_offset + round_up(m->n_expert, m->replicas ? moe_comm_size(m->replicas) : 1);
}

/* Per rank of the job: its pool of host memory (moe_host_memory_pool), the
 * bytes it will take, and its pool's total and available bytes. */
enum { POOL_ID, POOL_NEED, POOL_TOTAL, POOL_AVAILABLE, POOL_FIELDS };

/* On the CPU the parameters and gradients are host memory: sizes that
 * cannot fit are told from the count before any of it, or the table, is
 * taken (the table alone of a million layers is gigabytes). The ranks of a
 * pool (pipeline stages on one machine) are held to it together, and every
 * rank of the job learns every pool's verdict, so that all refuse at once. */
static moe_status check_host_memory(moe_model *m, const moe_layer_config *lc) {
    const double params = (double)m->n_params;
    const double bytes = params * sizeof(float) * (m->inference ? 1 : 2) + (double)m->n_tensors * sizeof *m->tensors;
    const moe_host_memory host = moe_host_memory_available("");
    const int n = m->job ? moe_comm_size(m->job) : 1, me = m->job ? moe_comm_rank(m->job) : 0;
    int64_t *pools = malloc((size_t)n * POOL_FIELDS * sizeof *pools);
    if (!pools) return moe_error(MOE_ERR_OUT_OF_MEMORY, "model: the memory of %d ranks", n);
    const int64_t mine[POOL_FIELDS] = {(int64_t)moe_host_memory_pool(&host), bytes < 9e18 ? (int64_t)bytes : INT64_MAX,
                                       host.total, host.available};
    memcpy(pools + (size_t)me * POOL_FIELDS, mine, sizeof mine);
    moe_status st = m->job ? moe_comm_allgather(m->job, pools, mine, POOL_FIELDS, MOE_COMM_I64) : MOE_OK;
    /* The first pool in rank order that cannot hold its ranks, ever or now. */
    int worst = -1, sharing = 0;
    bool never = false;
    double need = 0.0;
    for (int r = 0; st == MOE_OK && worst < 0 && r < n; r++) {
        const int64_t *p = pools + (size_t)r * POOL_FIELDS;
        double sum = 0.0;
        int ranks = 0, first = r;
        for (int q = 0; q < n; q++)
            if (pools[(size_t)q * POOL_FIELDS + POOL_ID] == p[POOL_ID]) {
                if (q < first) first = q;
                sum += (double)pools[(size_t)q * POOL_FIELDS + POOL_NEED];
                ranks++;
            }
        if (first != r) continue; /* the pool was judged at its first rank */
        never = p[POOL_TOTAL] >= 0 && sum > (double)p[POOL_TOTAL];
        if (never || (p[POOL_AVAILABLE] >= 0 && sum > (double)p[POOL_AVAILABLE])) worst = r, sharing = ranks, need = sum;
    }
    const bool ours = worst >= 0 && pools[(size_t)worst * POOL_FIELDS + POOL_ID] == mine[POOL_ID];
    free(pools);
    if (st != MOE_OK) return moe_error_prefix(st, "model: the ranks' memory: ");
    if (worst < 0) return MOE_OK;
    const moe_status status = never ? MOE_ERR_CONFIG : MOE_ERR_OUT_OF_MEMORY;
    if (!ours)
        return moe_error(status, "model: the ranks that share rank %d's memory need more than it %s (their errors say "
                                 "how much)",
                         worst, never ? "has" : "has available");
    char together[96] = "";
    if (sharing > 1) snprintf(together, sizeof together, ", and the %d ranks that share its memory %.3g GB together", sharing,
                              need / 1e9);
    return moe_error(status,
                     "model: %.4g parameters (vocab_size %lld, hidden_size %lld, %lld layers of %lld experts of "
                     "intermediate_size %lld here) take %.3g GB%s%s, more than the %.2f GB %s",
                     params, (long long)m->cfg.vocab_size, (long long)m->cfg.hidden_size, (long long)m->nl,
                     (long long)(lc->n_experts / m->ep_size), (long long)lc->d_ff, bytes / 1e9,
                     m->inference ? "" : " with their gradients", together,
                     (double)(never ? host.total : host.available) / 1e9, never ? host.total_by : host.bound_by);
}

static moe_status build_tensors(moe_model *m, const moe_layer_config *lc) {
    lay_out_tensors(m, lc);
    if (m->ops->host_visible) MOE_TRY(check_host_memory(m, lc));
    m->tensors = calloc((size_t)m->n_tensors, sizeof *m->tensors);
    m->layer_first = calloc((size_t)m->nl, sizeof *m->layer_first);
    m->moe_off = calloc((size_t)m->nl, sizeof *m->moe_off);
    if (!m->tensors || !m->layer_first || !m->moe_off) return moe_error(MOE_ERR_OUT_OF_MEMORY, "model: tensor table");
    lay_out_tensors(m, lc);
    return MOE_OK;
}

static moe_layer_memory moe_memory(moe_model *m, int64_t i) {
    const moe_layer_offsets *o = &m->moe_off[i];
    return (moe_layer_memory){.ops = m->ops,
                              .ep_rows = m->device_ep,
                              .router = m->params + o->router,
                              .router_grad = m->grads ? m->grads + o->router : NULL,
                              .experts = m->params + o->experts,
                              .experts_grad = m->grads ? m->grads + o->experts : NULL,
                              .shared = m->params + o->shared,
                              .shared_grad = m->grads ? m->grads + o->shared : NULL};
}

/* Copies the MoE layer's own views into the table under the HF prefix;
 * layer is the stage's index of the layer. */
static void name_moe_tensors(moe_model *m, int64_t layer) {
    moe_model_tensor *t = &m->tensors[m->layer_first[layer] + moe_first(&m->cfg)];
    for (int64_t i = 0; i < moe_layer_tensor_count(m->moe[layer]); i++, t++) {
        moe_tensor_view v;
        moe_layer_tensor(m->moe[layer], i, &v);
        snprintf(t->name, sizeof t->name, "model.layers.%lld.block_sparse_moe.%s", (long long)m->layer_id[layer], v.name);
        t->ndim = 2;
        t->shape[0] = v.rows;
        t->shape[1] = v.cols;
        t->numel = v.rows * v.cols;
        t->offset = v.param - m->params;
        t->decay = true;
        /* Router, then experts by global id, then shared, as in one rank's table. */
        const int64_t base = m->tensors[m->layer_first[layer] + moe_first(&m->cfg) - 1].init_stream + 1;
        const int64_t n_local = m->cfg.num_local_experts / m->ep_size, E = m->cfg.num_local_experts;
        t->init_stream = i == 0 ? base
                         : i <= 3 * n_local ? base + 1 + 3 * (m->ep_rank * n_local) + (i - 1)
                                            : base + 1 + 3 * E + (i - 1 - 3 * n_local);
    }
}

/* ----------------------------------------------------------------- arena */

/* Whether the instance holds local layer i: its layers, activations and
 * MoE state (a twin holds only the chunks it serves). */
static bool holds(const moe_model *m, int64_t i) {
    int c = 0;
    while (m->chunk_at[c + 1] <= i) c++;
    return m->serves >> c & 1;
}

/* Whose tables, arrays and layer state a twin uses: its base's. */
static moe_model *base_of(moe_model *m) { return m->base ? m->base : m; }

typedef struct arena_entry {
    void **ptr;
    int64_t bytes;
} arena_entry;

/* Positions per row a decode-only model's arrays hold: a prompt is read
 * this many positions of each row at a time. */
#define DECODE_CHUNK 64

/* Rows of the arrays a forward writes: a decode-only model's hold a
 * chunk of positions per row. */
static int64_t forward_rows(const moe_model *m) {
    return m->decode_only ? m->B * (m->T < DECODE_CHUNK ? m->T : DECODE_CHUNK) : m->N;
}

/* Tokens one decoding step takes at most: the rows of its scratch, the
 * backward's (an inference model keeps B of them, one position a row). */
static int64_t decode_rows(const moe_model *m) {
    return !m->inference ? m->N : m->decode_only ? forward_rows(m) : m->B;
}

/* The rows attention_inputs runs on at most: a forward's or a decoding
 * step's. */
static int64_t ones_rows(const moe_model *m) {
    const int64_t a = forward_rows(m), b = decode_rows(m);
    return a > b ? a : b;
}

/* The arrays of a layer's forward but its input; with keys, its keys and
 * values too; with mlp, a dense layer's MLP arrays. */
static int layer_entries(moe_model *m, arena_entry *table, layer_acts *a, bool keys, bool mlp) {
    const moe_model_config *c = &m->cfg;
    const int64_t N = forward_rows(m), C = c->hidden_size, hd = c->head_dim, f = sizeof(float);
    const int64_t qdim = c->num_attention_heads * hd, kvdim = c->num_key_value_heads * hd;
    const int64_t attn = m->decode_only ? 0 : m->B * c->num_attention_heads * m->T * m->T;
    int n = 0;
    table[n++] = (arena_entry){(void **)&a->ln1, N * C * f};
    table[n++] = (arena_entry){(void **)&a->rstd1, N * f};
    table[n++] = (arena_entry){(void **)&a->q, N * qdim * f};
    if (keys) {
        table[n++] = (arena_entry){(void **)&a->k, N * kvdim * f};
        table[n++] = (arena_entry){(void **)&a->v, N * kvdim * f};
    }
    if (c->moe_qk_norm) {
        table[n++] = (arena_entry){(void **)&a->q_raw, N * qdim * f};
        table[n++] = (arena_entry){(void **)&a->k_raw, N * kvdim * f};
        table[n++] = (arena_entry){(void **)&a->rstd_q, N * qdim / moe_qk_norm_width(c, false) * f};
        table[n++] = (arena_entry){(void **)&a->rstd_k, N * kvdim / moe_qk_norm_width(c, true) * f};
    }
    table[n++] = (arena_entry){(void **)&a->att, attn * f};
    table[n++] = (arena_entry){(void **)&a->atty, N * qdim * f};
    table[n++] = (arena_entry){(void **)&a->x_mid, N * C * f};
    table[n++] = (arena_entry){(void **)&a->ln2, N * C * f};
    table[n++] = (arena_entry){(void **)&a->rstd2, N * f};
    table[n++] = (arena_entry){(void **)&a->moe_y, N * C * f};
    if (mlp) {
        table[n++] = (arena_entry){(void **)&a->mlp_h, N * 2 * moe_model_config_dense_width(c) * f};
        table[n++] = (arena_entry){(void **)&a->mlp_g, N * moe_model_config_dense_width(c) * f};
    }
    return n;
}

static moe_status carve_arena(moe_model *m, const arena_entry *table, int n) {
    int64_t total = 0;
    for (int i = 0; i < n; i++) total += (table[i].bytes + MOE_ALIGN_BYTES - 1) / MOE_ALIGN_BYTES * MOE_ALIGN_BYTES;
    moe_status st = m->ops->alloc(&m->arena, (size_t)total);
    if (st != MOE_OK)
        return moe_error_prefix(st, "model: %lld bytes of activations for B=%lld T=%lld: ", (long long)total,
                                (long long)m->B, (long long)m->T);
    m->arena_bytes = total;
    char *p = m->arena;
    for (int i = 0; i < n; i++) {
        *table[i].ptr = p;
        p += (table[i].bytes + MOE_ALIGN_BYTES - 1) / MOE_ALIGN_BYTES * MOE_ALIGN_BYTES;
    }
    return MOE_OK;
}

static moe_status build_arena(moe_model *m) {
    const moe_model_config *c = &m->cfg;
    const int64_t N = forward_rows(m), C = c->hidden_size, hd = c->head_dim, L = m->nl;
    const int64_t V = m->last ? c->vocab_size : 0; /* only the last stage has logits */
    const int64_t qdim = c->num_attention_heads * hd, kvdim = c->num_key_value_heads * hd;
    const int64_t attn = m->B * c->num_attention_heads * m->T * m->T;
    const int64_t f = sizeof(float);
    m->acts = calloc((size_t)L, sizeof *m->acts);
    int n_entries = 18 * (int)L + 42;
    bool any_dense = false; /* among the layers this instance holds */
    for (int64_t l = 0; l < L; l++) any_dense |= holds(m, l) && dense_layer(m, l);
    arena_entry *table = calloc((size_t)n_entries, sizeof *table);
    if (!m->acts || !table) {
        free(table);
        return moe_error(MOE_ERR_OUT_OF_MEMORY, "model: activation table");
    }
    /* Each layer's own: every array (the default), its input
     * (recomputation), or its keys and values (inference: the cache). */
    int n = 0;
    for (int64_t l = 0; l < L; l++) {
        if (!holds(m, l)) continue;
        if (m->inference) {
            table[n++] = (arena_entry){(void **)&m->acts[l].k, m->N * kvdim * f};
            table[n++] = (arena_entry){(void **)&m->acts[l].v, m->N * kvdim * f};
            continue;
        }
        table[n++] = (arena_entry){(void **)&m->acts[l].x, N * C * f};
        if (!m->recompute) n += layer_entries(m, table + n, &m->acts[l], true, dense_layer(m, l));
    }
    /* The embedding's and the head's arrays, for an instance that runs
     * their chunks (a twin may not); before the last stage x_final takes
     * every chunk's output, on it the head's input, while the other chunks
     * send theirs on from x_send. */
    const uint64_t exit_chunk = UINT64_C(1) << (m->chunks - 1);
    const bool entry = m->first && (m->serves & 1), exit = m->last && (m->serves & exit_chunk);
    const int64_t head = exit ? N : 0;
    table[n++] = (arena_entry){(void **)&m->x_final, !m->last || exit ? N * C * f : 0};
    table[n++] = (arena_entry){(void **)&m->x_send, m->last && (m->serves & ~exit_chunk) ? N * C * f : 0};
    table[n++] = (arena_entry){(void **)&m->lnf, head * C * f};
    table[n++] = (arena_entry){(void **)&m->rstdf, head * f};
    /* A decode-only model's steps with logits take a position per row. */
    table[n++] = (arena_entry){(void **)&m->logits, (m->decode_only && exit ? m->B : head) * V * f};
    table[n++] = (arena_entry){(void **)&m->lse, head * (int64_t)sizeof(double)};
    table[n++] = (arena_entry){(void **)&m->losses, head * f};
    table[n++] = (arena_entry){(void **)&m->dloss, head * f};
    table[n++] = (arena_entry){(void **)&m->inputs, entry ? N * (int64_t)sizeof(int32_t) : 0};
    table[n++] = (arena_entry){(void **)&m->targets, head * (int64_t)sizeof(int32_t)};
    /* From here on: the tables every forward reads and the scratch a
     * backward uses while it runs (its input's gradient, dres, is copied out
     * before the next op), which a base and its twins share: they run one
     * op at a time. */
    const int shared = n;
    /* Inference runs no backward: its scratch serves decoding alone
     * (moe_model_decode). */
    const int64_t rows = decode_rows(m);
    table[n++] = (arena_entry){(void **)&m->cos_t, m->T * hd / 2 * f};
    table[n++] = (arena_entry){(void **)&m->sin_t, m->T * hd / 2 * f};
    table[n++] = (arena_entry){(void **)&m->ones, c->moe_qkv_bias ? ones_rows(m) * f : 0};
    table[n++] = (arena_entry){(void **)&m->dres, rows * C * f};
    table[n++] = (arena_entry){(void **)&m->dln, rows * C * f};
    table[n++] = (arena_entry){(void **)&m->dmoe, rows * C * f};
    table[n++] = (arena_entry){(void **)&m->dmlp_h,
                               any_dense && !m->inference ? rows * 2 * moe_model_config_dense_width(c) * f : 0};
    table[n++] = (arena_entry){(void **)&m->dq, rows * qdim * f};
    table[n++] = (arena_entry){(void **)&m->dk, rows * kvdim * f};
    table[n++] = (arena_entry){(void **)&m->dv, rows * kvdim * f};
    table[n++] = (arena_entry){(void **)&m->datty, rows * qdim * f};
    table[n++] = (arena_entry){(void **)&m->datt, m->inference ? c->num_attention_heads * m->T * f : attn * f};
    table[n++] = (arena_entry){(void **)&m->dqk_raw, c->moe_qk_norm && !m->inference ? rows * (qdim + kvdim) * f : 0};
    table[n++] = (arena_entry){(void **)&m->sumsq, 2 * (int64_t)sizeof(double)};
    /* Every norm's backward: the layers', the head's, and q's and k's. */
    int64_t norm_scratch = m->inference ? 0 : (int64_t)m->ops->rmsnorm_scratch_bytes(N, C);
    for (int key = 0; !m->inference && c->moe_qk_norm && key < 2; key++) {
        const int64_t width = moe_qk_norm_width(c, key), dim = key ? kvdim : qdim;
        const int64_t bytes = (int64_t)m->ops->rmsnorm_scratch_bytes(N * dim / width, width);
        norm_scratch = bytes > norm_scratch ? bytes : norm_scratch;
    }
    table[n++] = (arena_entry){&m->norm_scratch, norm_scratch};
    /* Under recomputation and inference the layers' one set is shared too
     * (it holds no instance's state between a forward and its backward, or
     * past the forward): inference's with the input, whose layers each read
     * it before they write the next layer's in its place. */
    const int in_struct = n;
    if (m->inference) table[n++] = (arena_entry){(void **)&m->acts[0].x, N * C * f};
    if ((m->recompute || m->inference) && !m->base)
        n += layer_entries(m, table + n, &m->acts[0], !m->inference, any_dense);
    moe_status st = carve_arena(m, table, m->base ? shared : n);
    /* A twin's shared entries are its base's: the same fields of base. */
    for (int i = shared; st == MOE_OK && m->base && i < in_struct; i++)
        *table[i].ptr = *(void **)((char *)m->base + ((char *)table[i].ptr - (char *)m));
    const layer_acts set = m->base ? m->base->acts[0] : m->acts[0];
    for (int64_t l = 0; st == MOE_OK && (m->recompute || m->inference) && l < L; l++) {
        if (!holds(m, l)) continue;
        const layer_acts own = m->acts[l];
        m->acts[l] = set;
        if (m->inference)
            m->acts[l].k = own.k, m->acts[l].v = own.v;
        else
            m->acts[l].x = own.x;
    }
    free(table);
    return st;
}

/* ------------------------------------------------------------ lifecycle */

moe_status moe_model_check_shape(const moe_model_config *c, int64_t B, int64_t T) {
    if (B <= 0 || T <= 0) return moe_error(MOE_ERR_CONFIG, "model: batch B=%lld and sequence T=%lld must be positive", (long long)B, (long long)T);
    if (T > c->max_position_embeddings)
        return moe_error(MOE_ERR_CONFIG, "model: sequence length %lld exceeds max_position_embeddings=%lld", (long long)T,
                         (long long)c->max_position_embeddings);
    int64_t N, NV, att;
    if (__builtin_mul_overflow(B, T, &N) || N > INT_MAX || __builtin_mul_overflow(N, c->vocab_size, &NV) ||
        __builtin_mul_overflow(N * c->num_attention_heads, T, &att))
        return moe_error(MOE_ERR_CONFIG, "model: B=%lld x T=%lld is too large for this model", (long long)B, (long long)T);
    return MOE_OK;
}

/* The pipeline's partition, checked: its stages x chunks virtual stages
 * hold the layers in order, each at least one, and every rank of job was
 * given the same partition; every rank of job leaves with an error when
 * any found one. Collective over job. */
static moe_status check_stages(const moe_model_config *cfg, const moe_model_parallel *par) {
    const int64_t L = cfg->num_hidden_layers;
    const int n = moe_comm_size(par->pipe), chunks = par->chunks;
    const int dp = par->world ? moe_comm_size(par->world) : 1;
    /* The head's gradient would have to travel to the first stage and the
     * weight back every step: not implemented. */
    if (cfg->tie_word_embeddings)
        return moe_error(MOE_ERR_CONFIG, "model: tie_word_embeddings true shares one tensor between the embedding, on "
                                         "the first pipeline stage, and the head, on the last: a pipeline of %d "
                                         "stages cannot hold it (untie them, or use data or expert parallelism)",
                         n);
    if (!par->job || moe_comm_size(par->job) != n * dp)
        return moe_error(MOE_ERR_CONFIG, "model: a pipeline of %d stages x %d data-parallel ranks needs job, a "
                                         "communicator of all %d ranks (%d given)",
                         n, dp, n * dp, par->job ? moe_comm_size(par->job) : 0);
    const int64_t *bounds = par->stage_layers, virtual_stages = (int64_t)n * chunks;
    moe_status layout = MOE_OK;
    if (chunks < 1 || chunks > MOE_MODEL_CHUNKS_MAX)
        layout = moe_error(MOE_ERR_CONFIG, "model: %d chunks per pipeline stage: 1 to %d", chunks,
                           MOE_MODEL_CHUNKS_MAX);
    else if (!bounds)
        layout = moe_error(MOE_ERR_CONFIG, "model: a pipeline of %d stages without its partition of the layers", n);
    for (int64_t v = 0; layout == MOE_OK && v < virtual_stages; v++) {
        const int64_t begin = bounds[v], end = bounds[v + 1];
        if ((v == 0 && begin != 0) || end <= begin || end > L || (v == virtual_stages - 1 && end != L))
            layout = moe_error(MOE_ERR_CONFIG,
                               "pipeline stage %d, chunk %d holds layers [%lld, %lld): the %d stages x %d chunks must "
                               "hold the %lld layers in order, each at least one",
                               (int)(v % n), (int)(v / n), (long long)begin, (long long)end, n, chunks, (long long)L);
    }
    /* Every rank's partition as one number, to compare. */
    uint64_t hash = 14695981039346656037ull;
    for (int64_t v = 0; layout == MOE_OK && v <= virtual_stages; v++)
        hash = (hash ^ (uint64_t)bounds[v]) * 1099511628211ull;
    const int ranks = moe_comm_size(par->job), me = moe_comm_rank(par->job);
    int64_t *all = malloc((size_t)ranks * sizeof *all);
    if (!all) return moe_error(MOE_ERR_OUT_OF_MEMORY, "model: pipeline partitions");
    const int64_t mine = layout == MOE_OK ? (int64_t)(hash >> 1) : -1;
    moe_status st = moe_comm_allgather(par->job, all, &mine, 1, MOE_COMM_I64);
    for (int r = 0; st == MOE_OK && layout == MOE_OK && r < ranks; r++)
        if (all[r] >= 0 && all[r] != mine)
            layout = moe_error(MOE_ERR_CONFIG,
                               "model: rank %d and rank %d split the layers into pipeline stages differently: every "
                               "rank needs the same partition",
                               r, me);
    free(all);
    MOE_TRY(st); /* a communicator failed: it refuses everything from now on */
    int32_t refused = layout != MOE_OK;
    MOE_TRY(moe_comm_allreduce_sum(par->job, &refused, 1, MOE_COMM_I32));
    if (layout == MOE_OK && refused)
        layout = moe_error(MOE_ERR_CONFIG, "model: %d other ranks refused the pipeline's layer ranges", (int)refused);
    return layout;
}

/* This rank's layers, in chunk order (ascending), where each chunk starts
 * among them, and the base serving every chunk. */
static moe_status place_layers(moe_model *m, const moe_model_parallel *par) {
    const int P = m->n_stages;
    m->chunks = m->pipe ? par->chunks : 1;
    m->chunk_at = calloc((size_t)m->chunks + 1, sizeof *m->chunk_at);
    m->layer_id = calloc((size_t)m->cfg.num_hidden_layers, sizeof *m->layer_id);
    if (!m->chunk_at || !m->layer_id) return moe_error(MOE_ERR_OUT_OF_MEMORY, "model: layer tables");
    m->nl = 0;
    for (int c = 0; c < m->chunks; c++) {
        const int64_t begin = m->pipe ? par->stage_layers[c * P + m->stage] : 0;
        const int64_t end = m->pipe ? par->stage_layers[c * P + m->stage + 1] : m->cfg.num_hidden_layers;
        m->chunk_at[c] = m->nl;
        for (int64_t l = begin; l < end; l++) m->layer_id[m->nl++] = l;
    }
    m->chunk_at[m->chunks] = m->nl;
    m->serves = m->chunks == MOE_MODEL_CHUNKS_MAX ? UINT64_MAX : (UINT64_C(1) << m->chunks) - 1;
    return MOE_OK;
}

/* RoPE's tables for the model's T positions, made on the host (rope.h)
 * and uploaded once: the step loop does no transcendental work; and the
 * biases' 1s. */
static moe_status upload_tables(moe_model *m) {
    const moe_model_config *cfg = &m->cfg;
    const size_t n = (size_t)(m->T * (cfg->head_dim / 2));
    float *cos_t = malloc(n * sizeof *cos_t), *sin_t = malloc(n * sizeof *sin_t);
    moe_status st = cos_t && sin_t ? MOE_OK
                                   : moe_error(MOE_ERR_OUT_OF_MEMORY, "model: RoPE tables of %zu values", 2 * n);
    if (st == MOE_OK) {
        moe_rope_tables(cos_t, sin_t, m->T, cfg->head_dim, cfg->rope_theta, &cfg->rope_scaling);
        st = m->ops->upload(m->cos_t, cos_t, n * sizeof *cos_t);
    }
    if (st == MOE_OK) st = m->ops->upload(m->sin_t, sin_t, n * sizeof *sin_t);
    free(cos_t), free(sin_t);
    /* 1 + 0 x u: exact 1s on every backend, with no fill op. */
    if (cfg->moe_qkv_bias) m->ops->uniform(m->ones, 0, 0, 0, 1.0f, 0.0f, ones_rows(m));
    return st;
}

/* The instance's first MoE layer; NULL when it holds none (dense layers only). */
static moe_layer *first_moe_layer(const moe_model *m) {
    for (int64_t i = 0; m->moe && i < m->nl; i++)
        if (m->moe[i]) return m->moe[i];
    return NULL;
}

/* What every instance of the model keeps for itself, a twin's too: its MoE
 * layers over the parameters (a twin's following the base's), its
 * activations, host arrays and RoPE tables. */
static moe_status build_instance(moe_model *m) {
    const moe_model_config *cfg = &m->cfg;
    moe_layer_config lc;
    moe_model_config_layer(&lc, cfg, m->T, m->seed);
    if (!(m->moe = calloc((size_t)m->nl, sizeof *m->moe)))
        return moe_error(MOE_ERR_OUT_OF_MEMORY, "model: %lld layers", (long long)m->nl);
    moe_layer *workspace = NULL; /* the base's first MoE layer, whose workspace the others share */
    for (int64_t i = 0; i < m->nl; i++) {
        if (!holds(m, i) || dense_layer(m, i)) continue;
        /* Each layer's jitter noise is its own stream. */
        moe_layer_config layer_cfg = lc;
        layer_cfg.seed = moe_splitmix64(m->seed + (uint64_t)m->layer_id[i]);
        const moe_layer_memory mem = moe_memory(m, i);
        MOE_TRY(moe_layer_create_in(&m->moe[i], &layer_cfg, &mem, m->ep, m->world));
        if (m->base)
            MOE_TRY(moe_layer_share_state(m->moe[i], m->base->moe[i]));
        else
            name_moe_tensors(m, i);
        /* One layer runs at a time, on the base or a twin: one backward
         * scratch serves them all, and under recomputation one set of
         * activations. The arrays are sized here, not in the step loop. */
        if (!workspace) workspace = first_moe_layer(base_of(m));
        MOE_TRY(moe_layer_share_workspace(m->moe[i], workspace, m->recompute || m->inference));
        MOE_TRY(moe_layer_reserve(m->moe[i], forward_rows(m), !m->inference));
        /* The total loss averages aux and z over the model's MoE layers. */
        moe_layer_set_loss_scale(m->moe[i], 1.0 / (double)m->moe_layers);
        moe_layer_set_overlap(m->moe[i], m->overlap);
    }
    MOE_TRY(build_arena(m));
    /* Every tensor is named and sized now, the layers' included; only the
     * base writes initial values through staging. */
    int64_t staging = forward_rows(m);
    for (int64_t i = 0; !m->base && i < m->n_tensors; i++)
        if (m->tensors[i].numel > staging) staging = m->tensors[i].numel;
    m->losses_host = calloc((size_t)forward_rows(m), sizeof *m->losses_host);
    m->lse_host = calloc((size_t)forward_rows(m), sizeof *m->lse_host);
    m->cached = calloc((size_t)m->B, sizeof *m->cached);
    m->staging = malloc((size_t)staging * sizeof *m->staging);
    m->sync_reqs = calloc((size_t)(2 * m->nl + 2), sizeof *m->sync_reqs);
    m->jitter_at = calloc((size_t)m->nl, sizeof *m->jitter_at);
    if (!m->base) m->expert_load = calloc((size_t)((m->nl + 1) * cfg->num_local_experts), sizeof *m->expert_load);
    if (!m->losses_host || !m->lse_host || !m->staging || !m->sync_reqs || !m->jitter_at || !m->expert_load ||
        !m->cached)
        return moe_error(MOE_ERR_OUT_OF_MEMORY, "model: host arrays for %lld values", (long long)staging);
    return m->base ? MOE_OK : upload_tables(m);
}

moe_status moe_model_create_twin(moe_model **out, moe_model *base, uint64_t chunks) {
    MOE_NOT_NULL("moe_model_create_twin", "out", out);
    MOE_NOT_NULL("moe_model_create_twin", "base", base);
    *out = NULL;
    if (base->base) return moe_error(MOE_ERR_INVALID_ARG, "moe_model_create_twin: a twin of a twin");
    if (!(chunks & base->serves))
        return moe_error(MOE_ERR_INVALID_ARG, "moe_model_create_twin: chunks %#llx: none of the stage's %d",
                         (unsigned long long)chunks, base->chunks);
    moe_model *m = malloc(sizeof *m);
    if (!m) return moe_error(MOE_ERR_OUT_OF_MEMORY, "model: twin");
    /* The base's shape, tables, arrays and communicators; nothing of its
     * forward state. */
    *m = *base;
    m->base = base;
    m->serves = chunks & base->serves;
    m->host_params = NULL;
    m->own_device_replicas = false;
    m->moe = NULL;
    m->arena = NULL;
    m->acts = NULL;
    m->losses_host = NULL;
    m->lse_host = NULL;
    m->cached = NULL;
    m->staging = NULL;
    m->sync_reqs = NULL;
    m->jitter_at = NULL;
    m->n_sync_reqs = 0;
    m->sync_grads = m->has_targets = m->logits_valid = false;
    m->pending = 0;
    m->training = true; /* as its new layers start */
    m->dloss_value = 0.0f;
    moe_status st = build_instance(m);
    if (st == MOE_OK) st = m->ops->sync();
    if (st != MOE_OK) {
        moe_model_destroy(m);
        return moe_error_prefix(st, "model twin: ");
    }
    *out = m;
    return MOE_OK;
}

moe_status moe_model_create(moe_model **out, const moe_model_config *cfg, int64_t B, int64_t T, uint64_t seed) {
    return moe_model_create_parallel(out, cfg, B, T, seed, NULL);
}

moe_status moe_model_create_parallel(moe_model **out, const moe_model_config *cfg, int64_t B, int64_t T,
                                     uint64_t seed, const moe_model_parallel *par) {
    if (!out || !cfg) return moe_error(MOE_ERR_INVALID_ARG, "moe_model_create: NULL argument");
    *out = NULL;
    MOE_TRY(moe_model_config_validate(cfg, "model config"));
    MOE_TRY(moe_model_check_shape(cfg, B, T));
    if (par && par->inference && par->recompute)
        return moe_error(MOE_ERR_INVALID_ARG, "moe_model_create: inference runs no backward for recomputation to serve");
    if (par && par->decode_only && !par->inference)
        return moe_error(MOE_ERR_INVALID_ARG, "moe_model_create: decode_only is a kind of inference (set inference)");
    const int ep_size = par && par->ep ? moe_comm_size(par->ep) : 1;
    if (moe_model_config_has_moe_layer(cfg) && cfg->num_local_experts % ep_size != 0)
        return moe_error(MOE_ERR_CONFIG, "--ep %d does not divide num_local_experts=%lld", ep_size,
                         (long long)cfg->num_local_experts);
    const bool staged = par && par->pipe && moe_comm_size(par->pipe) > 1;
    if (staged) MOE_TRY(check_stages(cfg, par));
    moe_model *m = calloc(1, sizeof *m);
    if (!m) return moe_error(MOE_ERR_OUT_OF_MEMORY, "model: struct");
    m->pipe = staged ? par->pipe : NULL;
    m->device_pipe = staged && par->device_pipe ? par->device_pipe : m->pipe;
    m->stage = staged ? moe_comm_rank(par->pipe) : 0;
    m->n_stages = staged ? moe_comm_size(par->pipe) : 1;
    m->first = m->stage == 0;
    m->last = m->stage == m->n_stages - 1;
    m->world = par && par->world && moe_comm_size(par->world) > 1 ? par->world : NULL;
    m->job = par && par->job && moe_comm_size(par->job) > 1 ? par->job : m->world;
    m->ep = par ? par->ep : NULL;
    m->ep_size = ep_size;
    m->ep_rank = m->ep ? moe_comm_rank(m->ep) : 0;
    m->world_size = m->world ? moe_comm_size(m->world) : 1;
    m->world_rank = m->world ? moe_comm_rank(m->world) : 0;
    moe_status split = MOE_OK;
    /* Each expert is held once per EP group: its replicas share an EP rank. */
    if (m->world && m->world_size > ep_size)
        split = moe_comm_split(&m->replicas, m->world, m->ep_rank, m->world_rank);
    m->device_world = m->world && par->device_world ? par->device_world : m->world;
    m->device_ep = m->ep && par->device_ep ? par->device_ep : m->ep;
    m->device_replicas = m->replicas;
    if (split == MOE_OK && m->replicas && m->device_world != m->world) {
        split = moe_comm_split(&m->device_replicas, m->device_world, m->ep_rank, m->world_rank);
        m->own_device_replicas = split == MOE_OK;
    }
    if (split != MOE_OK) {
        moe_model_destroy(m);
        return split;
    }
    m->cfg = *cfg;
    m->moe_layers = cfg->num_hidden_layers - moe_model_config_dense_layer_count(cfg);
    if ((split = place_layers(m, par)) != MOE_OK) {
        moe_model_destroy(m);
        return split;
    }
    m->ops = par && par->ops ? par->ops : moe_cpu_ops();
    m->B = B;
    m->T = T;
    m->N = B * T;
    m->seed = seed;
    m->recompute = par && par->recompute;
    m->inference = par && par->inference;
    m->decode_only = par && par->decode_only;
    m->training = true; /* as the layers start */
    moe_layer_config lc;
    moe_model_config_layer(&lc, cfg, T, seed);
    moe_status st = build_tensors(m, &lc);
    m->model_dense = m->n_dense;
    if (st == MOE_OK && m->pipe) st = moe_comm_allreduce_sum(m->pipe, &m->model_dense, 1, MOE_COMM_I64);
    if (st == MOE_OK) {
        st = m->ops->alloc((void **)&m->params, (size_t)m->n_params * sizeof(float));
        if (st != MOE_OK) st = moe_error_prefix(st, "model: %lld parameters: ", (long long)m->n_params);
    }
    /* An inference model has no gradients. */
    if (st == MOE_OK && !m->inference) {
        st = m->ops->alloc((void **)&m->grads, (size_t)m->n_params * sizeof(float));
        if (st != MOE_OK) st = moe_error_prefix(st, "model: gradients of %lld parameters: ", (long long)m->n_params);
    }
    if (st == MOE_OK && m->ops->host_visible) m->host_params = m->params;
    if (st == MOE_OK) st = build_instance(m);
    if (st != MOE_OK) {
        moe_model_destroy(m);
        return st;
    }
    /* alloc zero-fills, so the padding and the gradients start at zero. */
    const float init_std = (float)cfg->initializer_range; /* 0.02f by default, as Mixtral */
    for (int64_t i = 0; st == MOE_OK && i < m->n_tensors; i++) {
        const moe_model_tensor *t = &m->tensors[i];
        float *p = m->staging; /* [numel] */
        if (t->ndim == 1) {
            for (int64_t j = 0; j < t->numel; j++) p[j] = t->bias ? 0.0f : 1.0f;
        } else {
#pragma omp parallel for schedule(static)
            for (int64_t j = 0; j < t->numel; j++) p[j] = init_std * moe_rng_normal(seed, (uint64_t)t->init_stream, (uint64_t)j);
        }
        st = m->ops->upload(m->params + t->offset, p, (size_t)t->numel * sizeof(float));
    }
    if (st == MOE_OK) st = m->ops->sync();
    if (st != MOE_OK) {
        moe_model_destroy(m);
        return moe_error_prefix(st, "model: initial values: ");
    }
    *out = m;
    return MOE_OK;
}

void moe_model_destroy(moe_model *m) {
    if (!m) return;
    for (int64_t i = 0; m->moe && i < m->nl; i++) moe_layer_destroy(m->moe[i]);
    free(m->moe);
    free(m->sync_reqs);
    free(m->jitter_at);
    if (m->ops) m->ops->release(m->arena);
    free(m->acts);
    free(m->losses_host);
    free(m->cached);
    free(m->lse_host);
    free(m->staging);
    if (!m->base) { /* a twin's tables and arrays are its base's */
        free(m->moe_off);
        free(m->layer_id);
        free(m->chunk_at);
        free(m->expert_load);
        if (m->own_device_replicas) moe_comm_free(m->device_replicas);
        if (m->replicas) moe_comm_free(m->replicas);
        free(m->tensors);
        free(m->layer_first);
        if (m->host_params != m->params) free(m->host_params);
        if (m->ops) {
            m->ops->release(m->params);
            m->ops->release(m->grads);
        }
    }
    free(m);
}

const moe_model_config *moe_model_get_config(const moe_model *m) { return &m->cfg; }
int64_t moe_model_activation_bytes(const moe_model *m) {
    int64_t bytes = m->arena_bytes;
    for (int64_t i = 0; i < m->nl; i++)
        if (m->moe[i]) bytes += moe_layer_workspace_bytes(m->moe[i]);
    return bytes;
}
int64_t moe_model_exchange_bytes(const moe_model *m) {
    int64_t bytes = 0;
    for (int64_t i = 0; i < m->nl; i++) {
        if (!m->moe[i]) continue;
        moe_layer_timing t;
        moe_layer_get_timing(m->moe[i], &t);
        bytes += t.exchange_bytes;
    }
    return bytes;
}
int64_t moe_model_batch_size(const moe_model *m) { return m->B; }
int moe_model_world_size(const moe_model *m) { return m->world_size; }
int moe_model_world_rank(const moe_model *m) { return m->world_rank; }
moe_comm *moe_model_world(const moe_model *m) { return m->world; }
moe_comm *moe_model_job(const moe_model *m) { return m->job; }
moe_model_stage moe_model_get_stage(const moe_model *m) {
    return (moe_model_stage){.index = m->stage, .count = m->n_stages, .chunks = m->chunks, .first = m->first,
                             .last = m->last, .pipe = m->pipe, .device_pipe = m->device_pipe};
}
const int64_t *moe_model_layer_ids(const moe_model *m, int64_t *count) {
    *count = m->nl;
    return m->layer_id;
}
int64_t moe_model_seq_len(const moe_model *m) { return m->T; }
int64_t moe_model_tensor_count(const moe_model *m) { return m->n_tensors; }
const moe_model_tensor *moe_model_tensor_at(const moe_model *m, int64_t i) {
    return i >= 0 && i < m->n_tensors ? &m->tensors[i] : NULL;
}
const moe_model_tensor *moe_model_find_tensor(const moe_model *m, const char *name) {
    for (int64_t i = 0; i < m->n_tensors; i++)
        if (strcmp(m->tensors[i].name, name) == 0) return &m->tensors[i];
    return NULL;
}
int64_t moe_model_param_count(const moe_model *m) { return m->n_params; }

moe_model_run moe_model_get_run(const moe_model *m, moe_model_run_id run) {
    if (run == MOE_RUN_DENSE)
        return (moe_model_run){.offset = 0, .count = m->n_dense, .padded = m->expert_offset, .group = m->world,
                               .device_group = m->device_world};
    return (moe_model_run){.offset = m->expert_offset, .count = m->n_expert, .padded = m->n_params - m->expert_offset,
                           .group = m->replicas, .device_group = m->device_replicas};
}
float *moe_model_params(moe_model *m) { return m->params; }
/* Whether chunk c starts from the embedding; ends with the head. */
static bool entry_chunk(const moe_model *m, int c) {
    const moe_model_stage stage = moe_model_get_stage(m);
    return moe_stage_entry(&stage, c);
}
static bool exit_chunk(const moe_model *m, int c) {
    const moe_model_stage stage = moe_model_get_stage(m);
    return moe_stage_exit(&stage, c);
}

/* Where chunk c's last layer writes its output. */
static float *chunk_output(moe_model *m, int c) { return m->last && !exit_chunk(m, c) ? m->x_send : m->x_final; }

float *moe_model_stage_output(moe_model *m, int chunk) { return exit_chunk(m, chunk) ? NULL : chunk_output(m, chunk); }
float *moe_model_stage_input_grad(moe_model *m, int chunk) { return entry_chunk(m, chunk) ? NULL : m->dres; }
float *moe_model_grads(moe_model *m) { return m->grads; }

void moe_model_zero_grad(moe_model *m) {
    if (m->grads) m->ops->zero(m->grads, (size_t)m->n_params * sizeof(float));
}

const moe_ops *moe_model_ops(const moe_model *m) { return m->ops; }

float *moe_model_host_params(moe_model *m) { return base_of(m)->host_params; }

moe_status moe_model_pull(moe_model *m) {
    m = base_of(m);
    return moe_host_view_pull(m->ops, (void **)&m->host_params, m->params, (size_t)m->n_params * sizeof(float),
                              "model parameters");
}

moe_status moe_model_push(moe_model *m) {
    m = base_of(m);
    return moe_host_view_push(m->ops, m->params, m->host_params, (size_t)m->n_params * sizeof(float),
                              "model parameters");
}

void moe_model_set_training(moe_model *m, bool training) {
    m->training = training;
    for (int64_t i = 0; i < m->nl; i++)
        if (m->moe[i]) moe_layer_set_training(m->moe[i], training);
}

void moe_model_set_overlap(moe_model *m, bool overlap) {
    m->overlap = overlap;
    for (int64_t i = 0; i < m->nl; i++)
        if (m->moe[i]) moe_layer_set_overlap(m->moe[i], overlap);
}

moe_status moe_model_update_router_bias(moe_model *m) {
    for (int64_t i = 0; i < m->nl; i++)
        if (m->moe[i] && moe_layer_selection_bias(m->moe[i])) {
            moe_status st = moe_layer_update_bias(m->moe[i]);
            if (st != MOE_OK) return moe_error_prefix(st, "layer %lld: ", (long long)m->layer_id[i]);
        }
    return MOE_OK;
}

/* Layer l of the model's local index on this stage, or -1 when another stage holds it. */
static int64_t local_layer(const moe_model *m, int64_t l) {
    for (int64_t i = 0; m && i < m->nl; i++)
        if (m->layer_id[i] == l) return i;
    return -1;
}

bool moe_model_holds_layer(const moe_model *m, int64_t l) { return local_layer(m, l) >= 0; }

float *moe_model_router_bias(moe_model *m, int64_t l) {
    const int64_t i = local_layer(m, l);
    return i >= 0 && m->moe[i] ? moe_layer_selection_bias(m->moe[i]) : NULL;
}

/* The base's first layer's: a twin's layers draw from the base's counters. */
uint64_t moe_model_jitter_counter(const moe_model *m) {
    const moe_layer *layer = first_moe_layer(m->base ? m->base : m);
    return layer ? moe_layer_jitter_counter(layer) : 0;
}

void moe_model_set_logit_z_loss(moe_model *m, double coef) { base_of(m)->logit_z_coef = coef; }

void moe_model_take_expert_load(moe_model *m, int64_t *load) {
    int64_t *counts = base_of(m)->expert_load;
    const size_t bytes = (size_t)(m->nl * m->cfg.num_local_experts) * sizeof *counts;
    if (load) memcpy(load, counts, bytes);
    memset(counts, 0, bytes);
}

void moe_model_set_jitter_counter(moe_model *m, uint64_t counter) {
    for (int64_t i = 0; i < m->nl; i++)
        if (m->moe[i]) moe_layer_set_jitter_counter(m->moe[i], counter);
}

const float *moe_model_last_losses(const moe_model *m) { return m->losses_host; }
moe_status moe_model_last_topk(moe_model *m, int64_t l, const int32_t **topk) {
    const int64_t i = local_layer(m, l);
    if (i < 0 || !m->moe[i] || !topk)
        return moe_error(MOE_ERR_INVALID_ARG, "moe_model_last_topk: layer %lld %s, topk %p", (long long)l,
                         i < 0                ? "not among this stage's"
                         : dense_layer(m, i) ? "a dense MLP layer, which routes nothing"
                                             : "of a chunk this twin does not hold",
                         (const void *)topk);
    return moe_layer_last_topk(m->moe[i], topk);
}

moe_status moe_model_last_logits(moe_model *m, int64_t row, int64_t pos, float *out) {
    MOE_NOT_NULL("moe_model_last_logits", "model", m);
    MOE_NOT_NULL("moe_model_last_logits", "out", out);
    if (row < 0 || row >= m->B || pos < 0 || pos >= m->T)
        return moe_error(MOE_ERR_INVALID_ARG, "moe_model_last_logits: row %lld of %lld, position %lld of %lld",
                         (long long)row, (long long)m->B, (long long)pos, (long long)m->T);
    if (!m->last) return moe_error(MOE_ERR_STATE, "moe_model_last_logits: pipeline stage %d holds no head", m->stage);
    if (!m->logits_valid)
        return moe_error(MOE_ERR_STATE, "moe_model_last_logits: no forward yet, or a backward since the last");
    const int64_t V = m->cfg.vocab_size;
    return m->ops->download(out, m->logits + (row * m->T + pos) * V, (size_t)V * sizeof(float));
}

int64_t moe_model_active_param_count(const moe_model *m) {
    const moe_model_config *c = &m->cfg;
    /* The dense run and top_k experts per MoE layer, whichever rank or stage holds them. */
    int64_t per_expert = 3 * c->hidden_size * c->intermediate_size;
    return m->model_dense + m->moe_layers * c->num_experts_per_tok * per_expert;
}

double moe_model_step_flops(const moe_model *m) {
    const moe_model_config *c = &m->cfg;
    /* 6 FLOPs per active parameter per token (2 forward, 4 backward), less
     * the embedding, which is a lookup (tied, its one tensor is the head's
     * matmul too, and stays); plus attention's q k^T and att v:
     * 2 * 2 * T * hd * Hq per token forward, halved by the causal mask, x3
     * (T less a sliding window's masked keys). */
    const int64_t lookup = c->tie_word_embeddings ? 0 : c->vocab_size * c->hidden_size;
    double matmul_params = (double)(moe_model_active_param_count(m) - lookup);
    double attention = 6.0 * (double)c->num_hidden_layers * moe_model_config_attention_span(c, m->T) *
                       (double)(c->num_attention_heads * c->head_dim);
    return (double)m->N * (6.0 * matmul_params + attention);
}

/* ----------------------------------------------------------------- forward */

static float *param(moe_model *m, int64_t tensor) { return m->params + m->tensors[tensor].offset; }
static float *grad(moe_model *m, int64_t tensor) { return m->grads + m->tensors[tensor].offset; }

void moe_model_stats_to(double *v, const moe_model_stats *s) { memcpy(v, s, sizeof *s); }
void moe_model_stats_from(moe_model_stats *s, const double *v) { memcpy(s, v, sizeof *s); }

void moe_model_stats_add(moe_model_stats *acc, const moe_model_stats *s) {
    double x[MOE_MODEL_STATS_FIELDS], y[MOE_MODEL_STATS_FIELDS];
    moe_model_stats_to(x, acc);
    moe_model_stats_to(y, s);
    for (size_t i = 0; i < MOE_MODEL_STATS_FIELDS; i++) x[i] += y[i];
    moe_model_stats_from(acc, x);
}

void moe_model_stats_div(moe_model_stats *s, double d) {
    double x[MOE_MODEL_STATS_FIELDS];
    moe_model_stats_to(x, s);
    for (size_t i = 0; i < MOE_MODEL_STATS_FIELDS; i++) x[i] /= d;
    moe_model_stats_from(s, x);
}

moe_status moe_model_forward(moe_model *m, const int32_t *inputs, const int32_t *targets, moe_model_stats *stats) {
    if (m && m->n_stages > 1)
        return moe_error(MOE_ERR_STATE, "moe_model_forward: a pipeline stage runs moe_model_stage_forward");
    return moe_model_stage_forward(m, 0, inputs, NULL, targets, false, stats);
}

moe_status moe_model_check_batch(const moe_model *m, const int32_t *inputs, const int32_t *targets) {
    const int64_t N = m->N, V = m->cfg.vocab_size;
    for (int64_t i = 0; inputs && i < N; i++)
        if (inputs[i] < 0 || inputs[i] >= V)
            return moe_error(MOE_ERR_INVALID_ARG, "model: input token %d at position %lld outside the vocabulary [0, %lld)",
                             inputs[i], (long long)i, (long long)V);
    for (int64_t i = 0; targets && i < N; i++)
        if (targets[i] >= V)
            return moe_error(MOE_ERR_INVALID_ARG, "model: target token %d at position %lld outside the vocabulary [0, %lld)",
                             targets[i], (long long)i, (long long)V);
    return MOE_OK;
}

/* Layer l's forward over n rows of the residual stream x, in two halves
 * around the attention, which differs between a batch (layer_forward) and
 * a decoding step (moe_model_decode): ln = norm(x) and its q, k, v, which
 * under moe_qk_norm are the projections (into a's q_raw, k_raw) normalised
 * in rows of moe_qk_norm_width (their rstds into a's) ... */
static void attention_inputs(moe_model *m, int64_t l, int64_t n, const float *x, float *ln, float *rstd, float *q,
                             float *k, float *v, const layer_acts *a) {
    const moe_model_config *c = &m->cfg;
    const int64_t t0 = m->layer_first[l], C = c->hidden_size, hd = c->head_dim;
    const int64_t Hq = c->num_attention_heads, Hkv = c->num_key_value_heads;
    const float eps = (float)c->rms_norm_eps;
    const bool qk_norm = c->moe_qk_norm != MOE_QK_NORM_NONE;
    m->ops->rmsnorm_forward(ln, rstd, x, param(m, t0 + LN1), eps, n, C);
    m->ops->matmul_forward(qk_norm ? a->q_raw : q, ln, param(m, t0 + WQ), n, C, Hq * hd);
    m->ops->matmul_forward(qk_norm ? a->k_raw : k, ln, param(m, t0 + WK), n, C, Hkv * hd);
    m->ops->matmul_forward(v, ln, param(m, t0 + WV), n, C, Hkv * hd);
    if (c->moe_qkv_bias) {
        /* out [n, width] += 1s [n, 1] x bias [1, width] */
        float *out[3] = {qk_norm ? a->q_raw : q, qk_norm ? a->k_raw : k, v};
        for (int b = 0; b < 3; b++) {
            const int64_t width = (b ? Hkv : Hq) * hd;
            m->ops->gemm(out[b], m->ones, param(m, t0 + bias_first(c) + b), n, width, 1, 1, width, width, false, false,
                         1.0f, 1.0f);
        }
    }
    if (!qk_norm) return;
    const int64_t wq = moe_qk_norm_width(c, false), wk = moe_qk_norm_width(c, true);
    m->ops->rmsnorm_forward(q, a->rstd_q, a->q_raw, param(m, t0 + QNORM), eps, n * Hq * hd / wq, wq);
    m->ops->rmsnorm_forward(k, a->rstd_k, a->k_raw, param(m, t0 + KNORM), eps, n * Hkv * hd / wk, wk);
}

/* A dense layer's MLP over n rows, as one group of the experts' op: its
 * gate and up projections are consecutive, the [2F, C] matrix it takes;
 * their gradients too, when the model has them. */
static moe_expert_group dense_mlp(moe_model *m, int64_t l, int64_t n, const float *ln, const layer_acts *a, float *y) {
    const int64_t w = m->layer_first[l] + moe_first(&m->cfg);
    return (moe_expert_group){.rows = n, .d_ff = moe_model_config_dense_width(&m->cfg), .x = ln, .w13 = param(m, w),
                              .w2 = param(m, w + 2), .h = a->mlp_h, .g = a->mlp_g, .y = y,
                              .dw13 = m->grads ? grad(m, w) : NULL, .dw2 = m->grads ? grad(m, w + 2) : NULL};
}

/* ... then x_mid = x + o(atty), ln = norm(x_mid), y = moe(ln) (a dense
 * layer's MLP, its arrays a's), and unless out is NULL out = x_mid + y
 * (out may be x). */
static moe_status moe_half(moe_model *m, int64_t l, int64_t n, const float *x, const float *atty, float *x_mid,
                           float *ln, float *rstd, float *y, float *out, const layer_acts *a, moe_layer_stats *ls) {
    const moe_model_config *c = &m->cfg;
    const int64_t t0 = m->layer_first[l], C = c->hidden_size;
    m->ops->matmul_forward(x_mid, atty, param(m, t0 + WO), n, c->num_attention_heads * c->head_dim, C);
    m->ops->residual_forward(x_mid, x_mid, x, n * C);
    m->ops->rmsnorm_forward(ln, rstd, x_mid, param(m, t0 + LN2), (float)c->rms_norm_eps, n, C);
    if (m->moe[l]) {
        MOE_TRY(moe_layer_forward(m->moe[l], y, ln, n, ls));
    } else {
        moe_expert_group mlp = dense_mlp(m, l, n, ln, a, y);
        m->ops->experts_forward(&mlp, 1, C);
    }
    if (out) m->ops->residual_forward(out, x_mid, y, n * C);
    return MOE_OK;
}

/* Layer l's forward, from acts[l].x into out (the next layer's input, or
 * its chunk's output), unless this is a recomputation (out NULL), which
 * needs only what the layer's backward reads. */
static moe_status layer_forward(moe_model *m, int64_t l, float *out, moe_layer_stats *ls) {
    const moe_model_config *c = &m->cfg;
    const int64_t B = m->B, T = m->T, N = m->N, hd = c->head_dim;
    const int64_t Hq = c->num_attention_heads, Hkv = c->num_key_value_heads;
    layer_acts *a = &m->acts[l];
    if (m->moe[l]) m->jitter_at[l] = moe_layer_jitter_counter(m->moe[l]);
    base_of(m)->holder = m;
    base_of(m)->holder_layer = l;
    attention_inputs(m, l, N, a->x, a->ln1, a->rstd1, a->q, a->k, a->v, a);
    m->ops->rope_forward(a->q, m->cos_t, m->sin_t, B, T, Hq, hd);
    m->ops->rope_forward(a->k, m->cos_t, m->sin_t, B, T, Hkv, hd);
    m->ops->attention_forward(a->atty, a->att, a->q, a->k, a->v, B, T, Hq, Hkv, hd, c->sliding_window);
    return moe_half(m, l, N, a->x, a->atty, a->x_mid, a->ln2, a->rstd2, a->moe_y, out, a, ls);
}

/* Runs layer l's forward again for its backward, when the shared set of
 * activations holds another's: with the jitter noise of its last forward,
 * and no load counted twice toward the bias step. */
static moe_status recompute_layer(moe_model *m, int64_t l) {
    const moe_model *base = base_of(m);
    if (!m->recompute || (base->holder == m && base->holder_layer == l)) return MOE_OK;
    moe_layer *layer = m->moe[l]; /* NULL: a dense layer, which draws no noise */
    const uint64_t latest = layer ? moe_layer_jitter_counter(layer) : 0;
    if (layer) {
        moe_layer_set_jitter_counter(layer, m->jitter_at[l]);
        moe_layer_set_replay(layer, true);
    }
    moe_status st = layer_forward(m, l, NULL, NULL);
    if (layer) {
        moe_layer_set_replay(layer, false);
        moe_layer_set_jitter_counter(layer, latest);
    }
    return st == MOE_OK ? MOE_OK : moe_error_prefix(st, "layer %lld recomputed: ", (long long)m->layer_id[l]);
}

/* Every layer of chunk c replays (or not) its forward. */
static void set_replay(moe_model *m, int c, bool replay) {
    for (int64_t i = m->chunk_at[c]; i < m->chunk_at[c + 1]; i++)
        if (m->moe[i]) moe_layer_set_replay(m->moe[i], replay);
}

/* Whether chunk is one of the model's; the error names op. */
static moe_status check_chunk(const moe_model *m, int chunk, const char *op) {
    if (chunk < 0 || chunk >= m->chunks)
        return moe_error(MOE_ERR_INVALID_ARG, "%s: chunk %d of a stage of %d", op, chunk, m->chunks);
    if (!(m->serves >> chunk & 1))
        return moe_error(MOE_ERR_INVALID_ARG, "%s: a twin that does not hold chunk %d", op, chunk);
    return MOE_OK;
}

moe_status moe_model_stage_forward(moe_model *m, int chunk, const int32_t *inputs, const float *x,
                                   const int32_t *targets, bool replay, moe_model_stats *stats) {
    MOE_NOT_NULL("moe_model_stage_forward", "model", m);
    MOE_TRY(check_chunk(m, chunk, "moe_model_stage_forward"));
    if (m->decode_only)
        return moe_error(MOE_ERR_STATE, "moe_model_stage_forward: a decode-only model (moe_model_parallel.decode_only) "
                                        "runs moe_model_decode alone");
    const bool entry = entry_chunk(m, chunk), exit = exit_chunk(m, chunk);
    /* Its keys replace the cache's, which a failure leaves half done. */
    for (int64_t b = 0; b < m->B; b++) m->cached[b] = 0;
    if (entry) MOE_NOT_NULL("moe_model_stage_forward", "inputs", inputs);
    if (!entry) MOE_NOT_NULL("moe_model_stage_forward", "x", x);
    const moe_model_config *c = &m->cfg;
    const moe_ops *ops = m->ops;
    const int64_t N = m->N, C = c->hidden_size, V = c->vocab_size;
    const int64_t lo = m->chunk_at[chunk], hi = m->chunk_at[chunk + 1];
    /* What the routing statistics average over; a model of dense MLP layers
     * only has none, and its statistics stay 0. */
    const double model_layers = m->moe_layers ? (double)m->moe_layers : 1.0;
    const float eps = (float)c->rms_norm_eps;
    MOE_TRY(moe_model_check_batch(m, inputs, targets));
    /* Only the head reads the targets; another chunk's forward leaves the
     * uploaded ones to the head's backward still to come. */
    if (!exit) targets = NULL;
    int64_t counted = 0; /* targets that count: not negative */
    for (int64_t i = 0; targets && i < N; i++) counted += targets[i] >= 0;
    m->pending &= ~(UINT64_C(1) << chunk);
    if (exit) m->logits_valid = false;
    double aux = 0.0, seq_aux = 0.0, z = 0.0, imbalance = 0.0, rank_imbalance = 0.0, dropped = 0.0, pairs = 0.0;

    /* Both token arrays go up before any op is queued: an upload waits for
     * the device, which has nothing to finish yet. */
    if (entry) MOE_TRY(ops->upload(m->inputs, inputs, (size_t)N * sizeof(int32_t)));
    if (targets) MOE_TRY(ops->upload(m->targets, targets, (size_t)N * sizeof(int32_t)));
    if (entry)
        ops->embedding_forward(m->acts[lo].x, m->inputs, param(m, 0), N, C);
    else
        ops->copy(m->acts[lo].x, x, (size_t)(N * C) * sizeof(float));
    set_replay(m, chunk, replay);
    moe_status st = MOE_OK;
    const int64_t E = c->num_local_experts;
    int64_t *load = base_of(m)->expert_load, *one = load + m->nl * E;
    for (int64_t l = lo; l < hi && st == MOE_OK; l++) {
        moe_layer_stats ls = {.tokens_per_expert = m->training && !replay && m->moe[l] ? one : NULL};
        st = layer_forward(m, l, l + 1 < hi ? m->acts[l + 1].x : chunk_output(m, chunk), &ls);
        if (st != MOE_OK) break;
        for (int64_t e = 0; ls.tokens_per_expert && e < E; e++) load[l * E + e] += one[e];
        aux += ls.aux_loss;
        seq_aux += ls.seq_aux_loss;
        z += ls.z_loss;
        imbalance += ls.load_imbalance;
        rank_imbalance += ls.rank_imbalance;
        dropped += (double)ls.dropped;
        pairs += (double)ls.pairs;
    }
    set_replay(m, chunk, false);
    MOE_TRY(st);
    if (exit) {
        ops->rmsnorm_forward(m->lnf, m->rstdf, m->x_final, param(m, m->final_norm), eps, N, C);
        ops->matmul_forward(m->logits, m->lnf, param(m, m->head), N, C, V);
        m->has_targets = targets != NULL;
        m->counted = counted;
    }

    const double logit_z_coef = base_of(m)->logit_z_coef;
    if (targets) {
        ops->crossentropy_forward(m->losses, m->lse, m->logits, m->targets, N, V);
        MOE_TRY(ops->download(m->losses_host, m->losses, (size_t)N * sizeof(float)));
        MOE_TRY(ops->download(m->lse_host, m->lse, (size_t)N * sizeof(double)));
    }
    if (stats) {
        double ce = 0.0, lse2 = 0.0;
        for (int64_t i = 0; targets && i < N; i++)
            if (targets[i] >= 0) {
                ce += m->losses_host[i];
                lse2 += m->lse_host[i] * m->lse_host[i];
            }
        stats->ce_loss = counted ? ce / (double)counted : 0.0;
        stats->logit_z_loss = counted ? lse2 / (double)counted : 0.0;
        stats->aux_loss = aux / model_layers;
        stats->seq_aux_loss = seq_aux / model_layers;
        stats->z_loss = z / model_layers;
        stats->loss = stats->ce_loss + logit_z_coef * stats->logit_z_loss + c->router_aux_loss_coef * stats->aux_loss +
                      c->moe_seq_aux_loss_coef * stats->seq_aux_loss + c->moe_z_loss_coef * stats->z_loss;
        stats->load_imbalance = imbalance / model_layers;
        stats->rank_imbalance = rank_imbalance / model_layers;
        /* Both over the global batch; every MoE layer routes as many pairs. */
        int64_t chunk_moe_layers = 0;
        for (int64_t l = lo; l < hi; l++) chunk_moe_layers += m->moe[l] != NULL;
        stats->dropped_frac = pairs > 0.0 ? dropped / pairs * (double)chunk_moe_layers / model_layers : 0.0;
    }
    MOE_TRY(ops->sync());
    m->pending |= UINT64_C(1) << chunk;
    if (exit) m->logits_valid = true;
    for (int64_t b = 0; b < m->B; b++) m->cached[b] = m->recompute ? 0 : m->T;
    return MOE_OK;
}

bool moe_model_inference(const moe_model *m) { return m->inference; }

int64_t moe_model_decode_capacity(const moe_model *m) { return decode_rows(m); }

bool moe_model_can_decode(const moe_model *m) {
    return m->n_stages == 1 && !m->world && m->ep_size == 1 && !m->recompute;
}

static moe_status check_decode(const moe_model *m, int64_t n, const int64_t *row, const int32_t *token,
                               const int64_t *pos) {
    static const char op[] = "moe_model_decode";
    if (m->training) return moe_error(MOE_ERR_STATE, "%s: inference only (moe_model_set_training false)", op);
    if (m->n_stages > 1 || m->world || m->ep_size > 1)
        return moe_error(MOE_ERR_UNSUPPORTED, "%s: one rank and one stage, not a grid", op);
    if (m->recompute) return moe_error(MOE_ERR_STATE, "%s: the model recomputes its layers: it keeps no keys", op);
    if (n < 1 || n > decode_rows(m))
        return moe_error(MOE_ERR_INVALID_ARG, "%s: %lld tokens, 1 to %lld a step", op, (long long)n,
                         (long long)decode_rows(m));
    for (int64_t i = 0; i < n; i++) {
        if (row[i] < 0 || row[i] >= m->B || pos[i] < 0 || pos[i] >= m->T || token[i] < 0 ||
            token[i] >= m->cfg.vocab_size)
            return moe_error(MOE_ERR_INVALID_ARG, "%s: token %d at row %lld, position %lld: rows [0, %lld), "
                                                  "positions [0, %lld), vocabulary [0, %lld)",
                             op, token[i], (long long)row[i], (long long)pos[i], (long long)m->B, (long long)m->T,
                             (long long)m->cfg.vocab_size);
        /* The positions before it hold keys: a forward's, decoded, or the
         * step's earlier tokens of its row, which rise in position. */
        int64_t have = m->cached[row[i]], last = -1;
        for (int64_t j = 0; j < i; j++)
            if (row[j] == row[i]) last = pos[j], have = pos[j] + 1 > have ? pos[j] + 1 : have;
        if (last >= 0 && pos[i] <= last)
            return moe_error(MOE_ERR_INVALID_ARG, "%s: row %lld at position %lld after its position %lld: a row's "
                                                  "tokens in one step rise in position",
                             op, (long long)row[i], (long long)pos[i], (long long)last);
        if (pos[i] > have)
            return moe_error(MOE_ERR_STATE, "%s: position %lld of row %lld: the cache holds its positions [0, %lld) "
                                            "(a forward fills them all, a decoding step its own)",
                             op, (long long)pos[i], (long long)row[i], (long long)have);
    }
    return MOE_OK;
}

/* The forward's op list for n tokens of one position each; the backward's
 * scratch holds them, and each layer's k and v are the cache. */
moe_status moe_model_decode(moe_model *m, int64_t n, const int64_t *row, const int32_t *token, const int64_t *pos,
                            float *logits) {
    MOE_NOT_NULL("moe_model_decode", "model", m);
    MOE_NOT_NULL("moe_model_decode", "row", row);
    MOE_NOT_NULL("moe_model_decode", "token", token);
    MOE_NOT_NULL("moe_model_decode", "pos", pos);
    MOE_TRY(check_decode(m, n, row, token, pos));
    if (logits && m->decode_only && n > m->B)
        return moe_error(MOE_ERR_INVALID_ARG, "moe_model_decode: %lld tokens with logits: a decode-only model's steps "
                                              "with logits take at most %lld (one a row)",
                         (long long)n, (long long)m->B);
    const moe_model_config *c = &m->cfg;
    const moe_ops *ops = m->ops;
    const int64_t T = m->T, C = c->hidden_size, V = c->vocab_size, hd = c->head_dim;
    const int64_t Hq = c->num_attention_heads, Hkv = c->num_key_value_heads, qdim = Hq * hd, kvdim = Hkv * hd;
    const float eps = (float)c->rms_norm_eps;
    float *x = m->dres, *ln = m->dln, *q = m->dq, *k = m->dk, *v = m->dv, *atty = m->datty, *y = m->dmoe;
    float *x_mid = m->acts[0].x; /* [n, C] each */
    m->pending = 0;
    m->logits_valid = false;
    MOE_TRY(ops->upload(m->inputs, token, (size_t)n * sizeof(int32_t)));
    ops->embedding_forward(x, m->inputs, param(m, 0), n, C);
    for (int64_t l = 0; l < m->nl; l++) {
        const layer_acts *a = &m->acts[l];
        attention_inputs(m, l, n, x, ln, a->rstd1, q, k, v, a);
        for (int64_t i = 0; i < n; i++) {
            const int64_t at = row[i] * T, half = pos[i] * hd / 2; /* the row's cache; its position's rotation */
            ops->rope_forward(q + i * qdim, m->cos_t + half, m->sin_t + half, 1, 1, Hq, hd);
            ops->rope_forward(k + i * kvdim, m->cos_t + half, m->sin_t + half, 1, 1, Hkv, hd);
            ops->copy(a->k + (at + pos[i]) * kvdim, k + i * kvdim, (size_t)kvdim * sizeof(float));
            ops->copy(a->v + (at + pos[i]) * kvdim, v + i * kvdim, (size_t)kvdim * sizeof(float));
            /* The window's keys, a suffix of the row's cache. */
            const int64_t first = c->sliding_window > 0 && pos[i] >= c->sliding_window
                                      ? pos[i] + 1 - c->sliding_window
                                      : 0;
            ops->attention_decode(atty + i * qdim, m->datt, q + i * qdim, a->k + (at + first) * kvdim,
                                  a->v + (at + first) * kvdim, pos[i] + 1 - first, Hq, Hkv, hd);
        }
        moe_status st = moe_half(m, l, n, x, atty, x_mid, ln, a->rstd2, y, x, a, NULL);
        if (st != MOE_OK) return moe_error_prefix(st, "moe_model_decode: layer %lld: ", (long long)l);
    }
    for (int64_t i = 0; i < n; i++)
        if (pos[i] + 1 > m->cached[row[i]]) m->cached[row[i]] = pos[i] + 1;
    if (!logits) return ops->sync(); /* the cache alone */
    ops->rmsnorm_forward(ln, m->rstdf, x, param(m, m->final_norm), eps, n, C);
    ops->matmul_forward(m->logits, ln, param(m, m->head), n, C, V);
    return ops->download(logits, m->logits, (size_t)(n * V) * sizeof(float));
}

/* ---------------------------------------------------------------- backward */

void moe_model_set_grad_sync(moe_model *m, bool sync) { m->sync_grads = sync; }

/* Starts the sum over comm of gradients [begin, end), when this backward
 * synchronises and comm has other ranks; moe_model_finish_grad_sync waits. */
static moe_status sync_range(moe_model *m, moe_comm *comm, int64_t begin, int64_t end) {
    if (!m->sync_grads || !comm || end <= begin) return MOE_OK;
    moe_comm_request *req = &m->sync_reqs[m->n_sync_reqs++];
    *req = (moe_comm_request)MOE_COMM_REQUEST_INIT;
    moe_status st = moe_comm_iallreduce_sum(comm, req, m->grads + begin, end - begin, MOE_COMM_F32);
    return st == MOE_OK ? MOE_OK : moe_error_prefix(st, "gradient all-reduce: ");
}

moe_status moe_model_backward(moe_model *m, float grad_scale) {
    if (m && m->n_stages > 1)
        return moe_error(MOE_ERR_STATE, "moe_model_backward: a pipeline stage runs moe_model_stage_backward");
    return moe_model_stage_backward(m, 0, NULL, grad_scale);
}

/* The head's backward, from the loss to d(x_final) in dres. */
static moe_status head_backward(moe_model *m, float grad_scale) {
    const moe_model_config *c = &m->cfg;
    const moe_ops *ops = m->ops;
    const int64_t N = m->N, C = c->hidden_size, V = c->vocab_size;

    /* The loss is the mean over the global batch's counted targets, so each
     * rank's share of the gradient is normalised by the global count and the
     * shares simply add up. */
    int64_t counted = m->counted;
    if (m->world) MOE_TRY(moe_comm_allreduce_sum(m->world, &counted, 1, MOE_COMM_I64));
    const float w = counted ? grad_scale / (float)counted : 0.0f;
    /* Sent only when it changes (rarely: a new count of targets, a new
     * scale), since an upload waits for the device. */
    if (w != m->dloss_value) {
        for (int64_t i = 0; i < N; i++) m->staging[i] = w;
        MOE_TRY(ops->upload(m->dloss, m->staging, (size_t)N * sizeof(float)));
        m->dloss_value = w;
    }

    /* The logits' memory takes their gradient: nothing else reads them. */
    float *dlogits = m->logits;
    m->logits_valid = false;
    ops->crossentropy_backward(dlogits, m->logits, m->lse, m->targets, m->dloss, (float)base_of(m)->logit_z_coef, N,
                               V);
    ops->zero(m->dln, (size_t)(N * C) * sizeof(float));
    /* Tied, the head's gradient adds to the embedding's, which is summed
     * over the ranks once the embedding's own backward has added to it. */
    ops->matmul_backward(m->dln, grad(m, m->head), dlogits, m->lnf, param(m, m->head), N, C, V);
    ops->zero(m->dres, (size_t)(N * C) * sizeof(float));
    ops->rmsnorm_backward(m->dres, grad(m, m->final_norm), m->dln, m->x_final, param(m, m->final_norm), m->rstdf,
                          m->norm_scratch, N, C);
    return sync_range(m, m->device_world, m->tensors[m->final_norm].offset, m->n_dense);
}

moe_status moe_model_stage_backward(moe_model *m, int chunk, const float *dy, float grad_scale) {
    MOE_NOT_NULL("moe_model_stage_backward", "model", m);
    if (m->inference)
        return moe_error(MOE_ERR_STATE, "moe_model_stage_backward: an inference model (moe_model_parallel.inference) "
                                        "keeps nothing to differentiate");
    MOE_TRY(check_chunk(m, chunk, "moe_model_stage_backward"));
    const bool entry = entry_chunk(m, chunk), exit = exit_chunk(m, chunk);
    if (!exit) MOE_NOT_NULL("moe_model_stage_backward", "dy", dy);
    if (!(m->pending & (UINT64_C(1) << chunk)) || (exit && !m->has_targets))
        return moe_error(MOE_ERR_STATE, "moe_model_stage_backward: no forward %s",
                         exit ? "with targets to differentiate" : "since the last backward");
    const moe_model_config *c = &m->cfg;
    const moe_ops *ops = m->ops;
    const int64_t B = m->B, T = m->T, N = m->N, C = c->hidden_size, hd = c->head_dim;
    const int64_t Hq = c->num_attention_heads, Hkv = c->num_key_value_heads;
    const int64_t lo = m->chunk_at[chunk], hi = m->chunk_at[chunk + 1];
    for (int64_t l = lo; l < hi; l++)
        if (m->moe[l]) moe_layer_set_loss_scale(m->moe[l], (double)grad_scale / (double)m->moe_layers);
    if (exit)
        MOE_TRY(head_backward(m, grad_scale));
    else
        ops->copy(m->dres, dy, (size_t)(N * C) * sizeof(float));
    m->pending &= ~(UINT64_C(1) << chunk); /* the logits, or the layers' state, are spent */
    /* Where the dense parameters after layer l's start: the next layer's, the head's, or the run's end. */
    const int64_t dense_end = m->last ? m->tensors[m->final_norm].offset : m->n_dense;

    for (int64_t l = hi - 1; l >= lo; l--) {
        layer_acts *a = &m->acts[l];
        const int64_t t0 = m->layer_first[l];
        MOE_TRY(recompute_layer(m, l));
        /* The backward spends what it reads (the experts' outputs take
         * their gradient): the set holds no forward after it. */
        base_of(m)->holder = NULL;
        /* dres holds d(x_out); x_out = x_mid + moe(ln2(x_mid)). */
        if (m->moe[l]) {
            MOE_TRY(moe_layer_backward(m->moe[l], m->dmoe, m->dres, a->ln2));
        } else {
            moe_expert_group mlp = dense_mlp(m, l, N, a->ln2, a, a->moe_y);
            mlp.dy = m->dres;
            mlp.dh = m->dmlp_h;
            mlp.dx = m->dmoe;
            ops->experts_backward(&mlp, 1, C);
        }
        ops->rmsnorm_backward(m->dres, grad(m, t0 + LN2), m->dmoe, a->x_mid, param(m, t0 + LN2), a->rstd2,
                              m->norm_scratch, N, C);
        /* dres now holds d(x_mid); x_mid = x + o(attention(ln1(x))). */
        ops->zero(m->datty, (size_t)(N * Hq * hd) * sizeof(float));
        ops->matmul_backward(m->datty, grad(m, t0 + WO), m->dres, a->atty, param(m, t0 + WO), N, Hq * hd, C);
        ops->zero(m->dq, (size_t)(N * Hq * hd) * sizeof(float));
        ops->zero(m->dk, (size_t)(N * Hkv * hd) * sizeof(float));
        ops->zero(m->dv, (size_t)(N * Hkv * hd) * sizeof(float));
        ops->attention_backward(m->dq, m->dk, m->dv, m->datt, m->datty, a->q, a->k, a->v, a->att, B, T, Hq, Hkv, hd,
                                c->sliding_window);
        ops->rope_backward(m->dq, m->cos_t, m->sin_t, B, T, Hq, hd);
        ops->rope_backward(m->dk, m->cos_t, m->sin_t, B, T, Hkv, hd);
        float *dq = m->dq, *dk = m->dk; /* the projections' gradients */
        if (c->moe_qk_norm) {
            dq = m->dqk_raw;
            dk = m->dqk_raw + N * Hq * hd;
            ops->zero(m->dqk_raw, (size_t)(N * (Hq + Hkv) * hd) * sizeof(float));
            const int64_t wq = moe_qk_norm_width(c, false), wk = moe_qk_norm_width(c, true);
            ops->rmsnorm_backward(dq, grad(m, t0 + QNORM), m->dq, a->q_raw, param(m, t0 + QNORM), a->rstd_q,
                                  m->norm_scratch, N * Hq * hd / wq, wq);
            ops->rmsnorm_backward(dk, grad(m, t0 + KNORM), m->dk, a->k_raw, param(m, t0 + KNORM), a->rstd_k,
                                  m->norm_scratch, N * Hkv * hd / wk, wk);
        }
        if (c->moe_qkv_bias) {
            /* dbias [1, width] += 1s [N, 1]^T x dout [N, width] */
            const float *dout[3] = {dq, dk, m->dv};
            for (int b = 0; b < 3; b++) {
                const int64_t width = (b ? Hkv : Hq) * hd;
                ops->gemm(grad(m, t0 + bias_first(c) + b), m->ones, dout[b], 1, width, N, 1, width, width, true, false,
                          1.0f, 1.0f);
            }
        }
        ops->zero(m->dln, (size_t)(N * C) * sizeof(float));
        ops->matmul_backward(m->dln, grad(m, t0 + WQ), dq, a->ln1, param(m, t0 + WQ), N, C, Hq * hd);
        ops->matmul_backward(m->dln, grad(m, t0 + WK), dk, a->ln1, param(m, t0 + WK), N, C, Hkv * hd);
        ops->matmul_backward(m->dln, grad(m, t0 + WV), m->dv, a->ln1, param(m, t0 + WV), N, C, Hkv * hd);
        ops->rmsnorm_backward(m->dres, grad(m, t0 + LN1), m->dln, a->x, param(m, t0 + LN1), a->rstd1,
                              m->norm_scratch, N, C);
        /* Layer l's gradients are final: its replicated run and its experts. */
        const int64_t next = l + 1 < m->nl ? m->tensors[m->layer_first[l + 1]].offset : dense_end;
        const int64_t experts = m->moe_off[l].experts;
        const int64_t n_experts = m->moe[l] ? c->num_local_experts / m->ep_size * 3 * c->intermediate_size * C : 0;
        MOE_TRY(sync_range(m, m->device_world, m->tensors[t0].offset, next));
        MOE_TRY(sync_range(m, m->device_replicas, experts, experts + n_experts));
    }
    if (entry) {
        ops->embedding_backward(grad(m, 0), m->dres, m->inputs, N, C);
        MOE_TRY(sync_range(m, m->device_world, 0, m->tensors[m->layer_first[0]].offset));
    }
    return ops->sync();
}

moe_status moe_model_finish_grad_sync(moe_model *m) {
    moe_status st = moe_comm_wait_all(m->sync_reqs, m->n_sync_reqs, MOE_OK);
    m->n_sync_reqs = 0;
    m->sync_grads = false;
    return st == MOE_OK ? MOE_OK : moe_error_prefix(st, "gradient all-reduce: ");
}

moe_status moe_model_grad_sumsq(moe_model *m, double *out) {
    double sums[2]; /* dense run, experts */
    if (!m->grads) return moe_error(MOE_ERR_STATE, "moe_model_grad_sumsq: an inference model has no gradients");
    m->ops->sumsq(&m->sumsq[0], m->grads, m->n_dense);
    m->ops->sumsq(&m->sumsq[1], m->grads + m->expert_offset, m->n_expert);
    MOE_TRY(m->ops->download(sums, m->sumsq, sizeof sums));
    double dense = sums[0], experts = sums[1];
    /* Each EP rank holds different experts, each stage different layers: their squares add up. */
    if (m->ep && moe_comm_size(m->ep) > 1) MOE_TRY(moe_comm_allreduce_sum(m->ep, &experts, 1, MOE_COMM_F64));
    *out = dense + experts;
    if (m->pipe) MOE_TRY(moe_comm_allreduce_sum(m->pipe, out, 1, MOE_COMM_F64));
    return MOE_OK;
}
