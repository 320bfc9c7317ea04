/* rope.h: RoPE's rotation tables for a model config's rope_theta and
 * RoPE scaling (model_config.h), as transformers computes them. */
#ifndef MOE_ENGINE_ROPE_H
#define MOE_ENGINE_ROPE_H

#include <stdint.h>

#include "engine/model_config.h"

/* The factor on cos and sin: yarn's attention_factor, derived from factor,
 * mscale and mscale_all_dim when the config leaves it 0; 1 for the others. */
double moe_rope_attention_factor(const moe_rope_scaling *scaling);

/* cos_t, sin_t [T, head_dim / 2] (host memory): the rotation of pair i at
 * position t, cos(t * inv_freq[i]) * attention_factor and likewise sin,
 * with every fp32 rounding of transformers' rotary embedding. */
void moe_rope_tables(float *cos_t, float *sin_t, int64_t T, int64_t head_dim, double theta,
                     const moe_rope_scaling *scaling);

#endif /* MOE_ENGINE_ROPE_H */
