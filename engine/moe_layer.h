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

#endif /* MOE_ENGINE_MOE_LAYER_H */
