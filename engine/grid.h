/* grid.h: the ranks of a job and how they are grouped (DESIGN.md 4), and
 * the start-up check that every rank runs the same build on the same
 * configuration. */
#ifndef MOE_ENGINE_GRID_H
#define MOE_ENGINE_GRID_H

#include "comm/comm.h"
#include "engine/model.h"
#include "engine/model_config.h"
#include "moe.h"

/* Where rank of size ranks sits in a grid of pp stages, stage-major
 * (below): its stage, its rank among the stage's data-parallel ranks, and
 * how many those are. Fails, naming --pp, when pp does not divide size. */
typedef struct moe_grid_coords {
    int stage, dp_rank, dp_size;
} moe_grid_coords;
moe_status moe_grid_coords_of(moe_grid_coords *at, int rank, int size, int pp);

/* world = PP x DP ranks, stage-major: rank r is stage r / DP, data-parallel
 * rank r % DP; EP divides DP and groups consecutive data-parallel ranks, so
 * an expert-parallel group's all-to-alls stay among neighbours (a node's
 * GPUs, when the launcher fills nodes in rank order). */
typedef struct moe_grid {
    moe_comm *world; /* every rank */
    moe_comm *dp;    /* this stage's data-parallel ranks, whose batches form the global batch: world when PP = 1 */
    moe_comm *ep;    /* this rank's expert-parallel group: data-parallel ranks (d / EP) * EP .. + EP - 1 */
    moe_comm *pipe;  /* this rank's pipeline: the rank of each stage with its data-parallel rank; NULL when PP = 1 */
    int rank, size, ep_size;
    moe_grid_coords at; /* this rank's stage and data-parallel rank */
    int chunks;         /* each stage's runs of layers: 1, or more on an interleaved pipeline */
    /* [stages x chunks + 1] each virtual stage's first layer (c * stages + s:
     * stage s's chunk c), then the layer count; NULL on one stage */
    int64_t *stage_layers;
} moe_grid;

/* What the pipeline partition balances: an MoE layer costs layer, a dense
 * MLP layer (bit l of dense_layers, a model config's moe_dense_layers;
 * NULL: none) dense_layer, and the last stage pays for the head on top
 * (the embedding costs nothing). */
typedef struct moe_stage_costs {
    double layer, dense_layer, head;
    const uint64_t *dense_layers;
} moe_stage_costs;

/* The costs as training FLOPs per token at sequence length seq_len: an MoE
 * layer's attention, router, top_k experts and shared ones; a dense
 * layer's attention and MLP; the head's (which, with a large vocabulary,
 * outweighs a layer). dense_layers is cfg's. */
moe_stage_costs moe_grid_flop_costs(const moe_model_config *cfg, int64_t seq_len);

/* Splits world into pp_size pipeline stages of world / pp_size
 * data-parallel ranks each, and each stage into expert-parallel groups of
 * ep_size; world stays the caller's. The layers are cut into pp_size x
 * chunks virtual stages (a balanced partition under costs,
 * moe_grid_partition), and stage s holds virtual stages s, s + pp_size, ...
 * (interleaved, Megatron-LM's virtual pipeline, when chunks > 1). pp_size
 * must divide the world size, ep_size the data-parallel size, and the
 * layers must be at least pp_size x chunks. */
moe_status moe_grid_create(moe_grid *grid, moe_comm *world, int ep_size, int pp_size, int chunks, int64_t layers,
                           moe_stage_costs costs);
void moe_grid_destroy(moe_grid *grid);

/* Layers [bounds[s], bounds[s+1]) for each of stages stages (bounds
 * [stages + 1]), contiguous, at least one each, chosen to make the slowest
 * stage under costs as fast as it can be; of equal splits, the one whose
 * last stage holds fewest layers, and before it, stage by stage from the
 * back, the one that balances the stages before it best and of those
 * gives the stage the fewest. Fails when there are fewer layers than
 * stages. */
moe_status moe_grid_partition(int64_t *bounds, int64_t layers, int stages, moe_stage_costs costs);

/* What moe_model_create_parallel takes. */
moe_model_parallel moe_grid_model_parallel(const moe_grid *grid);

/* A field that every rank must agree on. */
typedef struct moe_agree_field {
    const char *name;
    double value;
    const char *(*name_of)(int value); /* an enum's names, for the error; NULL: a number */
} moe_agree_field;

/* Compares fields [count] across all ranks of world; on a difference the
 * error names the first differing field, the rank and both values. The
 * build (library version, compiler, backends) is compared first; count 0
 * compares it alone, in a collective of one shape whatever the build, which
 * should come before any other whose shape a build may change. */
moe_status moe_grid_agree(moe_comm *world, const moe_agree_field *fields, int count);

/* Compares texts [count] (paths, say; "" for none), named names [count],
 * across all ranks of world by their hashes; on a difference the error
 * quotes both ranks' texts, which the two ranks send every rank. */
moe_status moe_grid_agree_texts(moe_comm *world, const char *const *names, const char *const *texts, int count);

/* A moe_agree_field value for text (a file name, say): FNV-1a of its
 * bytes, folded to 52 bits so a double holds it exactly. */
double moe_grid_text_hash(const char *s);

/* The model config's fields, for moe_grid_agree: fields has room for
 * MOE_CONFIG_AGREE_FIELDS entries; returns how many it filled. */
#define MOE_CONFIG_AGREE_FIELDS (36 + MOE_ROPE_SCALING_FIELDS)
int moe_config_agree_fields(moe_agree_field *fields, const moe_model_config *cfg);

#endif /* MOE_ENGINE_GRID_H */
