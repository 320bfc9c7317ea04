#include "engine/grid.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"

moe_status moe_grid_create(moe_grid *g, moe_comm *world, int ep_size) {
    *g = (moe_grid){.world = world, .rank = moe_comm_rank(world), .size = moe_comm_size(world), .ep_size = ep_size};
    if (ep_size <= 0 || g->size % ep_size != 0)
        return moe_error(MOE_ERR_CONFIG, "--ep %d must divide the number of ranks, %d", ep_size, g->size);
    return moe_comm_split(&g->ep, world, g->rank / ep_size, g->rank);
}

void moe_grid_destroy(moe_grid *g) {
    if (g->ep) moe_comm_free(g->ep);
    g->ep = NULL;
}

moe_model_parallel moe_grid_model_parallel(const moe_grid *g) {
    return (moe_model_parallel){.world = g->world, .ep = g->ep};
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
    for (int digits = 9; digits <= 17; digits++) {
        snprintf(out, size, "%.*g", digits, v);
        if (strtod(out, NULL) == v) return;
    }
}

static moe_status disagree_number(int rank, const char *name, double got, double want) {
    char a[40], b[40];
    format_value(a, sizeof a, got);
    format_value(b, sizeof b, want);
    return moe_error(MOE_ERR_CONFIG, "rank %d disagrees with rank 0 on %s: %s, rank 0 has %s", rank, name, a, b);
}

moe_status moe_grid_agree(moe_comm *world, const moe_agree_field *fields, int count) {
    const int size = moe_comm_size(world), rank = moe_comm_rank(world), n = count + 1;
    double *mine = malloc(sizeof(double) * (size_t)n), *all = malloc(sizeof(double) * (size_t)n * (size_t)size);
    if (!mine || !all) {
        free(mine);
        free(all);
        return moe_error(MOE_ERR_OUT_OF_MEMORY, "config agreement: %d fields", count);
    }
    mine[0] = moe_grid_text_hash(build_description());
    for (int i = 0; i < count; i++) mine[i + 1] = fields[i].value;
    moe_status st = moe_comm_allgather(world, all, mine, n, MOE_COMM_F64);
    for (int r = 0; st == MOE_OK && r < size; r++)
        for (int i = 0; i < n; i++) {
            const double want = all[i], got = all[(size_t)r * (size_t)n + (size_t)i];
            if (got == want || (got != got && want != want)) continue;
            st = i == 0 ? moe_error(MOE_ERR_CONFIG, "rank %d runs a different build of libmoe than rank 0 (this rank: %s)",
                                    r, r == rank ? build_description() : "see that rank")
                        : fields[i - 1].name_of
                              ? moe_error(MOE_ERR_CONFIG, "rank %d disagrees with rank 0 on %s: %s, rank 0 has %s", r,
                                          fields[i - 1].name, fields[i - 1].name_of((int)got),
                                          fields[i - 1].name_of((int)want))
                              : disagree_number(r, fields[i - 1].name, got, want);
            break;
        }
    free(mine);
    free(all);
    return st;
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
    FIELD(rope_theta);
    FIELD(rms_norm_eps);
    FIELD(router_aux_loss_coef);
    FIELD(router_jitter_noise);
    f[n++] = (moe_agree_field){"moe_gate", (double)c->moe_gate, moe_gate_kind_name};
    FIELD(moe_renormalize);
    FIELD(moe_capacity_factor);
    FIELD(moe_z_loss_coef);
    FIELD(moe_n_shared_experts);
    FIELD(moe_bias_update_rate);
#undef FIELD
    return n;
}
