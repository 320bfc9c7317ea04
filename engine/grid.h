/* grid.h: the ranks of a job and how they are grouped (DESIGN.md 4), and
 * the start-up check that every rank runs the same build on the same
 * configuration. */
#ifndef MOE_ENGINE_GRID_H
#define MOE_ENGINE_GRID_H

#include "comm/comm.h"
#include "engine/model.h"
#include "engine/model_config.h"
#include "moe.h"

typedef struct moe_grid {
    moe_comm *world; /* every rank: the data-parallel ranks of the global batch */
    moe_comm *ep;    /* this rank's expert-parallel group: ranks (r / P) * P .. + P - 1 */
    int rank, size, ep_size;
} moe_grid;

/* Splits world into expert-parallel groups of ep_size consecutive ranks;
 * world stays the caller's. ep_size must divide the world size. */
moe_status moe_grid_create(moe_grid *grid, moe_comm *world, int ep_size);
void moe_grid_destroy(moe_grid *grid);

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
 * build (library version, compiler, backends) is compared first. */
moe_status moe_grid_agree(moe_comm *world, const moe_agree_field *fields, int count);

/* A moe_agree_field value for text (a file name, say): FNV-1a of its
 * bytes, folded to 52 bits so a double holds it exactly. */
double moe_grid_text_hash(const char *s);

/* The model config's fields, for moe_grid_agree: fields has room for
 * MOE_CONFIG_AGREE_FIELDS entries; returns how many it filled. */
#define MOE_CONFIG_AGREE_FIELDS 24
int moe_config_agree_fields(moe_agree_field *fields, const moe_model_config *cfg);

#endif /* MOE_ENGINE_GRID_H */
