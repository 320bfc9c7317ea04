/* moe_layer.h: the parts of the MoE layer that the rest of the engine needs
 * beyond the public API: building a layer inside memory that a model owns. */
#ifndef MOE_ENGINE_MOE_LAYER_H
#define MOE_ENGINE_MOE_LAYER_H

#include "moe.h"

/* Floats of parameters one layer with this (valid) config holds. */
int64_t moe_layer_config_param_count(const moe_layer_config *cfg);

/* Like moe_layer_create, but the parameters and gradients live in the
 * caller's arrays of moe_layer_config_param_count(cfg) floats each, which
 * must outlive the layer. Parameters are left as they are (not initialised). */
moe_status moe_layer_create_in(moe_layer **layer, const moe_layer_config *cfg, float *params,
                               float *grads);

/* Fills the layer's parameters with N(0, std^2) draws from (seed, stream). */
void moe_layer_init_params(moe_layer *layer, float std, uint64_t seed, uint64_t stream);

/* Multiplies the aux and z-loss gradients that backward adds (default 1): a
 * model that averages over layers and micro-batches scales them here. */
void moe_layer_set_loss_scale(moe_layer *layer, double scale);

/* Of the last forward: the (token, slot) pairs the router assigned to each
 * expert before capacity [E], and its choices topk_idx [T, k]. */
const int64_t *moe_layer_last_assigned(const moe_layer *layer);
const int32_t *moe_layer_last_topk(const moe_layer *layer);

/* Training forwards so far: it picks the jitter noise, so a resumed run
 * restores it to draw the same noise as an unbroken one. */
uint64_t moe_layer_jitter_counter(const moe_layer *layer);
void moe_layer_set_jitter_counter(moe_layer *layer, uint64_t counter);

#endif /* MOE_ENGINE_MOE_LAYER_H */
