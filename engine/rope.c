/* rope.c: RoPE's tables, rounding as transformers' modeling_rope_utils
 * does in PyTorch: its tensors are fp32, and a Python number meeting one is
 * rounded to fp32 first; a number divided by a tensor is the tensor's
 * reciprocal times the number (Tensor.__rtruediv__); the numbers between
 * (yarn's correction range, its attention factor) are doubles. A
 * checkpoint trained here then computes what transformers computes from
 * it, up to pow, cos and sin: correctly rounded here, within an ulp or two
 * in torch's fp32 (which gives, say, one of Mixtral's 64 frequencies an
 * ulp apart). CMakeLists.txt builds this file without FMA contraction,
 * which would fuse a product into a sum that torch rounds twice. */
#include "engine/rope.h"

#include <math.h>

#define TWO_PI 6.283185307179586

/* theta^(float(2i) / hd), the unscaled wavelength over 2 pi of pair i:
 * pow in double, rounded once, as a correctly rounded powf gives it. */
static float base_pow(int64_t i, int64_t hd, float theta) {
    const float expo = (float)(2 * i) / (float)hd;
    return (float)pow((double)theta, (double)expo);
}

/* transformers' _compute_llama3_parameters for one frequency. */
static float llama3_inv_freq(float inv, const moe_rope_scaling *s) {
    const float factor = (float)s->factor;
    const double context = (double)s->original_max_position_embeddings;
    const float low_wavelen = (float)(context / s->low_freq_factor);
    const float high_wavelen = (float)(context / s->high_freq_factor);
    const float wavelen = (1.0f / inv) * (float)TWO_PI;
    const float scaled = wavelen > low_wavelen ? inv / factor : inv;
    const float smooth = ((1.0f / wavelen) * (float)context - (float)s->low_freq_factor) /
                         (float)(s->high_freq_factor - s->low_freq_factor);
    const float smoothed = (1.0f - smooth) * scaled / factor + smooth * scaled;
    const bool medium = !(wavelen < high_wavelen) && !(wavelen > low_wavelen);
    return medium ? smoothed : scaled;
}

/* yarn's correction dimension for num_rotations within the original
 * context (find_correction_dim). */
static double yarn_correction_dim(double num_rotations, int64_t hd, double theta, int64_t context) {
    return ((double)hd * log((double)context / (num_rotations * TWO_PI))) / (2.0 * log(theta));
}

/* transformers' _compute_yarn_parameters for pair i: the interpolated
 * (divided by factor) and the original frequency blended by a ramp over
 * the pairs between the correction range's ends. */
static float yarn_inv_freq(int64_t i, int64_t hd, double theta, const moe_rope_scaling *s) {
    double low = yarn_correction_dim(s->beta_fast, hd, theta, s->original_max_position_embeddings);
    double high = yarn_correction_dim(s->beta_slow, hd, theta, s->original_max_position_embeddings);
    if (s->truncate) low = floor(low), high = ceil(high);
    low = fmax(low, 0.0), high = fmin(high, (double)(hd - 1));
    if (low == high) high += 0.001; /* transformers' guard against a zero-width ramp */
    const float pos = base_pow(i, hd, (float)theta);
    const float extrapolated = 1.0f / pos, interpolated = 1.0f / ((float)s->factor * pos);
    const float ramp = fminf(fmaxf(((float)i - (float)low) / (float)(high - low), 0.0f), 1.0f);
    const float keep = 1.0f - ramp; /* the share of the original frequency */
    return interpolated * (1.0f - keep) + extrapolated * keep;
}

double moe_rope_attention_factor(const moe_rope_scaling *s) {
    if (s->type != MOE_ROPE_YARN) return 1.0;
    if (s->attention_factor != 0.0) return s->attention_factor;
    /* get_mscale */
    const double log_factor = s->factor <= 1.0 ? 0.0 : log(s->factor);
    if (s->mscale != 0.0 && s->mscale_all_dim != 0.0)
        return (0.1 * s->mscale * log_factor + 1.0) / (0.1 * s->mscale_all_dim * log_factor + 1.0);
    return 0.1 * log_factor + 1.0;
}

static float inv_freq(int64_t i, int64_t hd, double theta, const moe_rope_scaling *s) {
    const float inv = 1.0f / base_pow(i, hd, (float)theta);
    switch (s->type) {
    case MOE_ROPE_LINEAR: return inv / (float)s->factor;
    case MOE_ROPE_LLAMA3: return llama3_inv_freq(inv, s);
    case MOE_ROPE_YARN: return yarn_inv_freq(i, hd, theta, s);
    case MOE_ROPE_DYNAMIC: /* unscaled within max_position_embeddings, which a model never passes */
    case MOE_ROPE_DEFAULT: break;
    }
    return inv;
}

void moe_rope_tables(float *cos_t, float *sin_t, int64_t T, int64_t hd, double theta, const moe_rope_scaling *s) {
    const int64_t half = hd / 2;
    const float attention = (float)moe_rope_attention_factor(s);
    for (int64_t i = 0; i < half; i++) {
        const float f = inv_freq(i, hd, theta, s);
        for (int64_t t = 0; t < T; t++) {
            const double angle = (double)((float)t * f);
            cos_t[t * half + i] = (float)cos(angle) * attention;
            sin_t[t * half + i] = (float)sin(angle) * attention;
        }
    }
}
