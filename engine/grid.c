#include "engine/grid.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/shortest.h"
#include "common/status.h"
#include "engine/moe_layer.h"

/* 6 training FLOPs per matmul weight and token, plus attention's two
 * causal T x T products (less a sliding window's masked keys). */
moe_stage_costs moe_grid_flop_costs(const moe_model_config *c, int64_t T) {
    const double C = (double)c->hidden_size, hd = (double)c->head_dim;
    const double q = (double)c->num_attention_heads * hd, kv = (double)c->num_key_value_heads * hd;
    moe_layer_config lc;
    moe_model_config_layer(&lc, c, T, 0);
    const double experts = 3.0 * C * ((double)c->num_experts_per_tok * (double)c->intermediate_size +
                                      (double)moe_layer_shared_width(&lc));
    const double gate = lc.shared_gate ? C : 0.0;
    const double attention = 6.0 * C * (2.0 * q + 2.0 * kv) + 6.0 * moe_model_config_attention_span(c, T) * q;
    return (moe_stage_costs){
        .layer = attention + 6.0 * (C * (double)c->num_local_experts + gate + experts),
        .dense_layer = attention + 6.0 * 3.0 * C * (double)moe_model_config_dense_width(c),
        .head = 6.0 * C * (double)c->vocab_size,
        .dense_layers = moe_model_config_dense_layer_count(c) > 0 ? c->moe_dense_layers : NULL};
}

/* The layers' costs: an MoE layer's, a dense one's, and how many of the
 * first i layers are dense (dense_at[i]). A run's cost is counted, not
 * summed, so that runs of the same mix of layers cost the same bits and
 * tie as they should. */
typedef struct layer_costs {
    double layer, dense;
    const int64_t *dense_at; /* [L + 1] */
} layer_costs;

static double cost(const layer_costs *c, int64_t begin, int64_t end) {
    const int64_t dense = c->dense_at[end] - c->dense_at[begin];
    return (double)(end - begin - dense) * c->layer + (double)dense * c->dense;
}

/* The fewest stages that hold layers [0, n) within limit each, the stages
 * taken from the back as long as they fit; INT64_MAX when a layer alone
 * exceeds it. */
static int64_t stages_needed(const layer_costs *c, int64_t n, double limit) {
    int64_t stages = 0;
    for (int64_t end = n; end > 0; stages++) {
        if (cost(c, end - 1, end) > limit) return INT64_MAX;
        int64_t begin = end - 1;
        while (begin > 0 && cost(c, begin - 1, end) <= limit) begin--;
        end = begin;
    }
    return stages;
}

/* Whether limit holds the layers in `stages` stages, the last paying head
 * too: its longest tail within limit, the rest in stages - 1. */
static bool fits(const layer_costs *c, int64_t L, int stages, double head, double limit) {
    int64_t from = stages - 1;
    while (from < L && cost(c, from, L) + head > limit) from++;
    return from < L && stages_needed(c, from, limit) <= stages - 1;
}

/* The least limit at which fits() (head >= 0) or, head < 0, stages_needed
 * <= stages over [0, L): bisection over doubles, down to the one where it
 * turns, which is exactly a cost the test computes. */
static double least_limit(const layer_costs *c, int64_t L, int stages, double head) {
    double lo = 0.0, hi = cost(c, 0, L) + (head > 0.0 ? head : 0.0);
    for (;;) {
        const double mid = lo + (hi - lo) / 2.0;
        if (mid <= lo || mid >= hi) return hi;
        const bool ok = head >= 0.0 ? fits(c, L, stages, head, mid) : stages_needed(c, L, mid) <= stages;
        if (ok)
            hi = mid;
        else
            lo = mid;
    }
}

/* The stage that ends at layer `end` under limit, with `before` stages
 * before it: its first layer, the latest cut whose prefix those stages
 * hold within limit, so that it holds the fewest layers. The cuts from
 * which its own share (plus tail, the head's) fits start at `from`; the
 * stages a prefix needs only grow with it, so the cuts that fit the
 * prefix end where a bisection finds. limit fits, so `from` does. */
static int64_t latest_cut(const layer_costs *c, int64_t end, int before, double tail, double limit) {
    int64_t from = before;
    while (cost(c, from, end) + tail > limit) from++;
    int64_t lo = from, hi = end; /* stages_needed(lo) <= before; hi: past the last cut */
    while (hi - lo > 1) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (stages_needed(c, mid, limit) <= before)
            lo = mid;
        else
            hi = mid;
    }
    return lo;
}

/* The least limit of the slowest stage leaves the last stage a range of
 * cuts; the latest gives it the fewest layers. Then stage by stage from
 * the back, the same over the stages before it, without the head. */
moe_status moe_grid_partition(int64_t *bounds, int64_t L, int stages, moe_stage_costs costs) {
    if (stages <= 0 || L < stages)
        return moe_error(MOE_ERR_CONFIG, "--pp %d: a pipeline needs a layer per stage, and the model has %lld layers",
                         stages, (long long)L);
    const double given[3] = {costs.layer, costs.dense_layer, costs.head};
    for (int i = 0; i < 3; i++)
        if (!isfinite(given[i]) || given[i] < 0.0)
            return moe_error(MOE_ERR_INVALID_ARG, "pipeline partition: costs %g (a layer), %g (a dense layer), %g "
                                                  "(the head) must be finite and not negative",
                             costs.layer, costs.dense_layer, costs.head);
    for (int s = 0; s <= stages; s++) bounds[s] = s == stages ? L : s; /* a layer a stage: the one split */
    if (stages == 1 || stages == L) return MOE_OK;
    /* Only their ratios cut: scaled by a power of two to at most 1, exactly
     * (ties stay ties), so that no cost of a run overflows. */
    int exponent = 0;
    frexp(fmax(fmax(costs.layer, costs.dense_layer), costs.head), &exponent);
    int64_t *dense_at = malloc((size_t)(L + 1) * sizeof *dense_at);
    if (!dense_at) return moe_error(MOE_ERR_OUT_OF_MEMORY, "pipeline partition of %lld layers", (long long)L);
    dense_at[0] = 0;
    for (int64_t l = 0; l < L; l++)
        dense_at[l + 1] = dense_at[l] + (costs.dense_layers && moe_layer_set_has(costs.dense_layers, l));
    const layer_costs c = {ldexp(costs.layer, -exponent), ldexp(costs.dense_layer, -exponent), dense_at};
    const double head = ldexp(costs.head, -exponent);
    bounds[stages - 1] = latest_cut(&c, L, stages - 1, head, least_limit(&c, L, stages, head));
    for (int s = stages - 2; s > 0; s--)
        bounds[s] = latest_cut(&c, bounds[s + 1], s, 0.0, least_limit(&c, bounds[s + 1], s + 1, -1.0));
    free(dense_at);
    return MOE_OK;
}

moe_status moe_grid_coords_of(moe_grid_coords *at, int rank, int size, int pp) {
    if (pp <= 0 || size % pp != 0)
        return moe_error(MOE_ERR_CONFIG, "--pp %d must divide the number of ranks, %d%s", pp, size,
                         size == 1 ? " (start the ranks with mpirun)" : "");
    at->dp_size = size / pp;
    at->stage = rank / at->dp_size;
    at->dp_rank = rank % at->dp_size;
    return MOE_OK;
}

moe_status moe_grid_create(moe_grid *g, moe_comm *world, int ep_size, int pp_size, int chunks, int64_t layers,
                           moe_stage_costs costs) {
    *g = (moe_grid){.world = world, .dp = world, .rank = moe_comm_rank(world), .size = moe_comm_size(world),
                    .ep_size = ep_size, .chunks = chunks};
    MOE_TRY(moe_grid_coords_of(&g->at, g->rank, g->size, pp_size));
    if (chunks < 1 || chunks > MOE_MODEL_CHUNKS_MAX || (chunks > 1 && pp_size < 2))
        return moe_error(MOE_ERR_CONFIG, "--pp-chunks %d: 1 to %d, and more than 1 only on a pipeline (--pp > 1)",
                         chunks, MOE_MODEL_CHUNKS_MAX);
    if (chunks > 1 && layers < (int64_t)pp_size * chunks)
        return moe_error(MOE_ERR_CONFIG, "--pp %d x --pp-chunks %d: each chunk needs a layer, and the model has %lld",
                         pp_size, chunks, (long long)layers);
    if (ep_size <= 0 || g->at.dp_size % ep_size != 0)
        return pp_size == 1 ? moe_error(MOE_ERR_CONFIG, "--ep %d must divide the number of ranks, %d", ep_size, g->size)
                            : moe_error(MOE_ERR_CONFIG, "--ep %d must divide the data-parallel ranks, %d (%d ranks / "
                                                        "--pp %d)",
                                        ep_size, g->at.dp_size, g->size, pp_size);
    if (pp_size > 1) {
        const int virtual_stages = pp_size * chunks;
        g->stage_layers = malloc((size_t)(virtual_stages + 1) * sizeof *g->stage_layers);
        moe_status st = g->stage_layers ? moe_grid_partition(g->stage_layers, layers, virtual_stages, costs)
                                        : moe_error(MOE_ERR_OUT_OF_MEMORY, "pipeline stages");
        if (st == MOE_OK) {
            moe_comm *dp = NULL;
            st = moe_comm_split(&dp, world, g->at.stage, g->rank);
            if (st == MOE_OK) g->dp = dp;
        }
        if (st == MOE_OK) st = moe_comm_split(&g->pipe, world, g->at.dp_rank, g->at.stage);
        if (st != MOE_OK) {
            moe_grid_destroy(g);
            return st;
        }
    }
    moe_status st = moe_comm_split(&g->ep, g->dp, g->at.dp_rank / ep_size, g->at.dp_rank);
    if (st != MOE_OK) moe_grid_destroy(g);
    return st;
}

void moe_grid_destroy(moe_grid *g) {
    if (g->ep) moe_comm_free(g->ep);
    if (g->pipe) moe_comm_free(g->pipe);
    if (g->dp && g->dp != g->world) moe_comm_free(g->dp);
    free(g->stage_layers);
    g->ep = g->pipe = NULL;
    g->stage_layers = NULL;
    g->dp = g->world;
}

moe_model_parallel moe_grid_model_parallel(const moe_grid *g) {
    return (moe_model_parallel){.world = g->dp, .ep = g->ep, .pipe = g->pipe, .job = g->world,
                                .chunks = g->chunks, .stage_layers = g->stage_layers};
}

double moe_grid_text_hash(const char *s) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (; *s; s++) h = (h ^ (uint8_t)*s) * 0x100000001b3ull;
    return (double)(h >> 12);
}

#define MOE_STR2(x) #x
#define MOE_STR(x) MOE_STR2(x)

static const char *build_description(void) {
    return "libmoe " MOE_STR(MOE_VERSION_MAJOR) "." MOE_STR(MOE_VERSION_MINOR) "." MOE_STR(MOE_VERSION_PATCH)
#ifdef __VERSION__
           " cc " __VERSION__
#endif
#ifdef MOE_HAVE_MPI
           " mpi"
#endif
#ifdef MOE_HAVE_CUDA
           " cuda"
#endif
#ifdef MOE_HAVE_HWLOC
           " hwloc"
#endif
        ;
}

/* v as a disagreement prints it: a whole number in full, anything else in
 * the fewest digits that read back as v, so two values that differ never
 * print alike. */
static void format_value(char *out, size_t size, double v) {
    if (v == floor(v) && fabs(v) < 9007199254740992.0) {
        snprintf(out, size, "%.0f", v);
        return;
    }
    moe_shortest(out, size, v);
}

static moe_status disagree_number(int rank, const char *name, double got, double want) {
    char a[40], b[40];
    format_value(a, sizeof a, got);
    format_value(b, sizeof b, want);
    return moe_error(MOE_ERR_CONFIG, "rank %d disagrees with rank 0 on %s: %s, rank 0 has %s", rank, name, a, b);
}

/* Gathers every rank's values mine [n] and finds the first rank (then the
 * first value) that differs from rank 0's, NaN equal to NaN: *rank -1 when
 * none does; else *at, and that rank's *got and rank 0's *want. Every rank
 * finds the same. */
static moe_status first_difference(moe_comm *world, const double *mine, int n, int *rank, int *at, double *got,
                                   double *want) {
    const int size = moe_comm_size(world);
    *rank = -1;
    double *all = malloc(sizeof(double) * (size_t)(n ? n : 1) * (size_t)size);
    if (!all) return moe_error(MOE_ERR_OUT_OF_MEMORY, "rank agreement: %d values from %d ranks", n, size);
    const moe_status st = moe_comm_allgather(world, all, mine, n, MOE_COMM_F64);
    for (int r = 0; st == MOE_OK && *rank < 0 && r < size; r++)
        for (int i = 0; *rank < 0 && i < n; i++) {
            *want = all[i], *got = all[(size_t)r * (size_t)n + (size_t)i];
            if (*got != *want && !(*got != *got && *want != *want)) *rank = r, *at = i;
        }
    free(all);
    return st;
}

/* Bytes of a text that a disagreement quotes. */
#define AGREE_TEXT_BYTES 1024

moe_status moe_grid_agree_texts(moe_comm *world, const char *const *names, const char *const *texts, int count) {
    double *mine = malloc(sizeof(double) * (size_t)(count ? count : 1)), got, want;
    if (!mine) return moe_error(MOE_ERR_OUT_OF_MEMORY, "text agreement: %d texts", count);
    for (int i = 0; i < count; i++) mine[i] = texts[i][0] ? moe_grid_text_hash(texts[i]) : -1.0;
    int differs, at = 0;
    const moe_status st = first_difference(world, mine, count, &differs, &at, &got, &want);
    free(mine);
    if (st != MOE_OK || differs < 0) return st;
    /* Every rank found the same pair: the two send their texts to all. */
    char quoted[2][AGREE_TEXT_BYTES + 2];
    const int from[2] = {differs, 0};
    for (int i = 0; i < 2; i++) {
        char text[AGREE_TEXT_BYTES];
        snprintf(text, sizeof text, "%s", texts[at]);
        MOE_TRY(moe_comm_broadcast(world, text, sizeof text, MOE_COMM_BYTES, from[i]));
        text[sizeof text - 1] = '\0';
        snprintf(quoted[i], sizeof quoted[i], text[0] ? "\"%s\"" : "none", text);
    }
    return moe_error(MOE_ERR_CONFIG, "rank %d disagrees with rank 0 on %s: %s, rank 0 has %s", differs, names[at],
                     quoted[0], quoted[1]);
}

moe_status moe_grid_agree(moe_comm *world, const moe_agree_field *fields, int count) {
    const int rank = moe_comm_rank(world), n = count + 1;
    double *mine = malloc(sizeof(double) * (size_t)n), got, want;
    if (!mine) return moe_error(MOE_ERR_OUT_OF_MEMORY, "config agreement: %d fields", count);
    mine[0] = moe_grid_text_hash(build_description());
    for (int i = 0; i < count; i++) mine[i + 1] = fields[i].value;
    int r, i = 0;
    moe_status st = first_difference(world, mine, n, &r, &i, &got, &want);
    free(mine);
    if (st != MOE_OK || r < 0) return st;
    if (i == 0)
        return moe_error(MOE_ERR_CONFIG, "rank %d runs a different build of libmoe than rank 0 (this rank: %s)", r,
                         r == rank ? build_description() : "see that rank");
    const moe_agree_field *f = &fields[i - 1];
    if (f->name_of)
        return moe_error(MOE_ERR_CONFIG, "rank %d disagrees with rank 0 on %s: %s, rank 0 has %s", r, f->name,
                         f->name_of((int)got), f->name_of((int)want));
    return disagree_number(r, f->name, got, want);
}

/* sliding_window as config.json writes it: null for none. Two buffers in
 * turn, as a message names two values. */
static const char *window_name(int value) {
    static _Thread_local char text[2][24];
    static _Thread_local int turn;
    if (value == 0) return "null";
    turn ^= 1;
    snprintf(text[turn], sizeof text[turn], "%d", value);
    return text[turn];
}

/* The dense layers' numbers, FNV-1a'd and folded as moe_grid_text_hash does. */
static double dense_layers_hash(const moe_model_config *c) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (int64_t l = 0; l < c->num_hidden_layers; l++)
        if (moe_model_config_layer_is_dense(c, l)) h = (h ^ (uint64_t)l) * 0x100000001b3ull;
    return (double)(h >> 12);
}

int moe_config_agree_fields(moe_agree_field *f, const moe_model_config *c) {
    int n = 0;
#define FIELD(x) f[n++] = (moe_agree_field){.name = #x, .value = (double)c->x}
    FIELD(vocab_size);
    FIELD(hidden_size);
    FIELD(intermediate_size);
    FIELD(num_hidden_layers);
    FIELD(num_attention_heads);
    FIELD(num_key_value_heads);
    FIELD(head_dim);
    FIELD(num_local_experts);
    FIELD(num_experts_per_tok);
    FIELD(max_position_embeddings);
    f[n++] = (moe_agree_field){"sliding_window", (double)c->sliding_window, window_name};
    FIELD(rope_theta);
    f[n++] = (moe_agree_field){"rope_scaling.rope_type", (double)c->rope_scaling.type, moe_rope_type_name};
    for (int i = 0; i < MOE_ROPE_SCALING_FIELDS; i++) {
        double value;
        const char *name = moe_rope_scaling_field(&c->rope_scaling, i, &value);
        f[n++] = (moe_agree_field){.name = name, .value = value};
    }
    FIELD(rms_norm_eps);
    FIELD(router_aux_loss_coef);
    FIELD(router_jitter_noise);
    FIELD(initializer_range);
    FIELD(tie_word_embeddings);
    f[n++] = (moe_agree_field){"moe_qk_norm", (double)c->moe_qk_norm, moe_qk_norm_kind_name};
    FIELD(moe_qkv_bias);
    f[n++] = (moe_agree_field){"moe_gate", (double)c->moe_gate, moe_gate_kind_name};
    FIELD(moe_renormalize);
    FIELD(moe_capacity_factor);
    FIELD(moe_z_loss_coef);
    FIELD(moe_seq_aux_loss_coef);
    FIELD(moe_n_shared_experts);
    FIELD(moe_shared_intermediate_size);
    FIELD(moe_shared_expert_gate);
    FIELD(moe_bias_update_rate);
    FIELD(moe_n_group);
    FIELD(moe_topk_group);
    FIELD(moe_routed_scaling_factor);
    f[n++] = (moe_agree_field){"the number of moe_dense_layers", (double)moe_model_config_dense_layer_count(c), NULL};
    f[n++] = (moe_agree_field){"moe_dense_layers (a hash of the set)", dense_layers_hash(c), NULL};
    FIELD(moe_dense_intermediate_size);
#undef FIELD
    return n;
}
