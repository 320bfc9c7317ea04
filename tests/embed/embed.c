/* embed.c: a program that uses libmoe as an embedder does, through moe.h
 * alone, built against an installed copy (tests/embed_check.sh): a layer
 * forward and backward on the caller's buffers, whose gradient of
 * sum(y * dy) agrees with a central difference through x. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <moe.h>

#define T 6
#define D 8

static int fail(const char *what, moe_status st) {
    fprintf(stderr, "embed: %s: %s: %s\n", what, moe_status_string(st), moe_last_error());
    return 1;
}

static double loss(moe_layer *layer, float *y, const float *x, const float *dy) {
    double s = 0.0;
    if (moe_layer_forward(layer, y, x, T, NULL) != MOE_OK) return NAN;
    for (int i = 0; i < T * D; i++) s += (double)y[i] * dy[i];
    return s;
}

int main(void) {
    int major, minor, patch;
    moe_version(&major, &minor, &patch);
    if (major != MOE_VERSION_MAJOR || minor != MOE_VERSION_MINOR || patch != MOE_VERSION_PATCH) {
        fprintf(stderr, "embed: libmoe %s under moe.h %d.%d.%d\n", moe_version_string(), MOE_VERSION_MAJOR,
                MOE_VERSION_MINOR, MOE_VERSION_PATCH);
        return 1;
    }
    moe_layer_config cfg = moe_layer_config_defaults();
    cfg.d_model = D, cfg.d_ff = 12, cfg.n_experts = 4, cfg.top_k = 2;
    cfg.aux_loss_coef = 0.0;
    moe_layer *layer = NULL;
    moe_status st = moe_layer_create(&layer, &cfg);
    if (st != MOE_OK) return fail("moe_layer_create", st);
    /* Weights of order one, so that the gradient is too. */
    float *params = moe_layer_params(layer);
    for (int64_t i = 0; i < moe_layer_param_count(layer); i++) params[i] = 0.5f * (float)sin(0.37 * (double)i + 1.0);
    float x[T * D], y[T * D], dy[T * D], dx[T * D];
    for (int i = 0; i < T * D; i++) x[i] = (float)sin(0.7 * i), dy[i] = (float)cos(0.3 * i);
    if ((st = moe_layer_forward(layer, y, x, T, NULL)) != MOE_OK) return fail("moe_layer_forward", st);
    if ((st = moe_layer_backward(layer, dx, dy, x)) != MOE_OK) return fail("moe_layer_backward", st);
    /* Away from routing ties, the loss is smooth in x. */
    double worst = 0.0, largest = 0.0;
    for (int i = 0; i < T * D; i++) largest = fabs(dx[i]) > largest ? fabs(dx[i]) : largest;
    if (!(largest > 0.1)) {
        fprintf(stderr, "embed: dx is %g at most: no gradient reached x\n", largest);
        return 1;
    }
    for (int i = 0; i < T * D; i += 5) {
        const float keep = x[i], h = 1e-3f;
        x[i] = keep + h;
        const double up = loss(layer, y, x, dy);
        x[i] = keep - h;
        const double down = loss(layer, y, x, dy);
        x[i] = keep;
        const double numeric = (up - down) / (2.0 * h), err = fabs(numeric - dx[i]) / (fabs(numeric) + 0.1 * largest);
        if (!(err <= worst)) worst = err;
    }
    moe_layer_destroy(layer);
    if (!(worst < 5e-3)) {
        fprintf(stderr, "embed: dx against a central difference: relative error %g\n", worst);
        return 1;
    }
    printf("embed: libmoe %s, layer forward and backward, dx within %.1e of a central difference\n",
           moe_version_string(), worst);
    return 0;
}
