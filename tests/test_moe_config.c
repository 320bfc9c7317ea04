/* test_moe_config.c: bad configurations, bad arguments and calls out of
 * order give the right moe_status and a message that names the culprit;
 * status strings and the version. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "moe.h"
#include "router/plan.h"

static moe_layer_config good_cfg(void) {
    moe_layer_config c = MOE_LAYER_CONFIG_INIT;
    c.d_model = 8;
    c.d_ff = 6;
    c.n_experts = 4;
    c.top_k = 2;
    return c;
}

/* Both validate and create must refuse cfg with MOE_ERR_CONFIG and a
 * message containing field. */
static void expect_bad(const moe_layer_config *cfg, const char *field, const char *why) {
    moe_status s = moe_layer_config_validate(cfg);
    cr_expect(s == MOE_ERR_CONFIG, "validate, %s: status %d (%s), want MOE_ERR_CONFIG", why, s,
              moe_status_string(s));
    cr_expect(strstr(moe_last_error(), field) != NULL,
              "validate, %s: message \"%s\" does not name \"%s\"", why, moe_last_error(), field);
    moe_layer *l = NULL;
    s = moe_layer_create(&l, cfg);
    cr_expect(s == MOE_ERR_CONFIG, "create, %s: status %d (%s), want MOE_ERR_CONFIG", why, s,
              moe_status_string(s));
    cr_expect(strstr(moe_last_error(), field) != NULL,
              "create, %s: message \"%s\" does not name \"%s\"", why, moe_last_error(), field);
    if (s == MOE_OK) moe_layer_destroy(l);
}

/* The function gives the macro's defaults, field for field. */
Test(config, defaults_function_is_the_macro) {
    const moe_layer_config a = MOE_LAYER_CONFIG_INIT, b = moe_layer_config_defaults();
    cr_expect(a.gate == b.gate && a.renormalize == b.renormalize && a.capacity_factor == b.capacity_factor &&
                  a.aux_loss_coef == b.aux_loss_coef && a.seq_aux_loss_coef == b.seq_aux_loss_coef &&
                  a.seq_len == b.seq_len && a.z_loss_coef == b.z_loss_coef &&
                  a.bias_update_rate == b.bias_update_rate && a.n_shared_experts == b.n_shared_experts &&
                  a.jitter_eps == b.jitter_eps && a.n_groups == b.n_groups && a.top_groups == b.top_groups &&
                  a.routed_scale == b.routed_scale && a.seed == b.seed && a.d_model == b.d_model &&
                  a.d_ff == b.d_ff && a.n_experts == b.n_experts && a.top_k == b.top_k,
              "moe_layer_config_defaults differs from MOE_LAYER_CONFIG_INIT");
}

Test(config, good_config_passes) {
    moe_layer_config c = good_cfg();
    cr_expect(moe_layer_config_validate(&c) == MOE_OK, "%s", moe_last_error());
    c.top_k = c.n_experts;
    c.gate = MOE_GATE_SIGMOID;
    c.capacity_factor = 1.25;
    c.n_shared_experts = 2;
    c.jitter_eps = 0.01;
    c.bias_update_rate = 0.001;
    c.aux_loss_coef = 0.01;
    c.z_loss_coef = 0.001;
    cr_expect(moe_layer_config_validate(&c) == MOE_OK, "%s", moe_last_error());
    moe_layer *l = NULL;
    cr_assert(moe_layer_create(&l, &c) == MOE_OK, "%s", moe_last_error());
    cr_expect(l != NULL);
    moe_layer_destroy(l);
}

Test(config, sizes_and_top_k) {
    static const int64_t bad_sizes[] = {0, -1, INT64_MIN};
    for (size_t i = 0; i < sizeof bad_sizes / sizeof bad_sizes[0]; i++) {
        char why[64];
        moe_layer_config c = good_cfg();
        c.d_model = bad_sizes[i];
        snprintf(why, sizeof why, "d_model=%lld", (long long)bad_sizes[i]);
        expect_bad(&c, "d_model", why);
        c = good_cfg();
        c.d_ff = bad_sizes[i];
        snprintf(why, sizeof why, "d_ff=%lld", (long long)bad_sizes[i]);
        expect_bad(&c, "d_ff", why);
        c = good_cfg();
        c.n_experts = bad_sizes[i];
        c.top_k = 1;
        snprintf(why, sizeof why, "n_experts=%lld", (long long)bad_sizes[i]);
        expect_bad(&c, "n_experts", why);
        c = good_cfg();
        c.top_k = bad_sizes[i];
        snprintf(why, sizeof why, "top_k=%lld", (long long)bad_sizes[i]);
        expect_bad(&c, "top_k", why);
    }
    moe_layer_config c = good_cfg();
    c.top_k = c.n_experts + 1;
    expect_bad(&c, "top_k", "top_k > n_experts");
    c.n_shared_experts = -1;
    c.top_k = 1;
    expect_bad(&c, "n_shared_experts", "n_shared_experts=-1");
    /* Too wide a shared GEMM, though nothing overflows: said so, with the count. */
    c.n_shared_experts = 300000000;
    expect_bad(&c, "n_shared_experts=300000000 x d_ff=6 exceeds", "n_shared_experts=3e8");
}

/* Expert groups divide the experts, at most 64, and the kept ones hold k. */
Test(config, expert_groups) {
    moe_layer_config c = good_cfg();
    c.n_experts = 8;
    c.top_k = 2;
    const int64_t bad[][2] = {{3, 1}, {-1, 1}, {16, 1}, {4, 0}, {4, 5}, {8, 1}, {1, 7}, {0, 2}, {0, -1}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        c.n_groups = bad[i][0];
        c.top_groups = bad[i][1];
        char why[48];
        snprintf(why, sizeof why, "n_groups=%lld top_groups=%lld", (long long)bad[i][0], (long long)bad[i][1]);
        expect_bad(&c, bad[i][0] == 3 || bad[i][0] < 0 || bad[i][0] > 8 ? "n_groups" : "top_groups", why);
    }
    const int64_t good[][2] = {{0, 0}, {1, 1}, {0, 1}, {4, 1}, {8, 2}, {2, 2}};
    for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
        c.n_groups = good[i][0];
        c.top_groups = good[i][1];
        cr_expect(moe_layer_config_validate(&c) == MOE_OK, "n_groups=%lld top_groups=%lld: %s", (long long)good[i][0],
                  (long long)good[i][1], moe_last_error());
    }
}

Test(config, gate_kind) {
    static const int bad[] = {-1, 3, 1000};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        moe_layer_config c = good_cfg();
        c.gate = (moe_gate_kind)bad[i];
        char why[32];
        snprintf(why, sizeof why, "gate=%d", bad[i]);
        expect_bad(&c, "gate", why);
    }
}

Test(config, coefficients) {
    static const char *fields[] = {"capacity_factor", "aux_loss_coef", "z_loss_coef", "jitter_eps",
                                   "bias_update_rate", "routed_scale"};
    const double bad[] = {NAN, INFINITY, -INFINITY, -0.5};
    for (int f = 0; f < 6; f++)
        for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
            moe_layer_config c = good_cfg();
            double *slot = f == 0   ? &c.capacity_factor
                           : f == 1 ? &c.aux_loss_coef
                           : f == 2 ? &c.z_loss_coef
                           : f == 3 ? &c.jitter_eps
                           : f == 4 ? &c.bias_update_rate
                                    : &c.routed_scale;
            *slot = bad[i];
            char why[64];
            snprintf(why, sizeof why, "%s=%g", fields[f], bad[i]);
            expect_bad(&c, fields[f], why);
        }
}

/* routed_scale 0 means none; a positive one that is a float 0 is refused
 * (the gate's backward divides by it). */
Test(config, routed_scale_below_floats_range) {
    moe_layer_config c = good_cfg();
    c.routed_scale = 0.0;
    cr_expect_eq(moe_layer_config_validate(&c), MOE_OK, "%s", moe_last_error());
    c.routed_scale = 1e-50;
    expect_bad(&c, "routed_scale", "routed_scale=1e-50");
}

/* Capacity is ceil(cf * T * k / E) of the decimal cf, not of its binary
 * neighbour: 1.1 * 100 * 2 / 10 is 22 (in doubles 22.000000000000004). */
Test(config, capacity_of_exact_quotients) {
    static const struct {
        double cf;
        int64_t T, k, E, want;
    } cases[] = {
        {1.1, 100, 2, 10, 22}, {2.2, 50, 2, 10, 22}, {0.55, 200, 2, 10, 22}, {2.45, 200, 1, 7, 70},
        {1.25, 96, 2, 8, 30},  {1.0, 7, 2, 8, 2},    {1.1, 101, 2, 10, 23},  {0.0, 100, 2, 10, -1},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const int64_t got = moe_capacity(cases[i].cf, cases[i].T, cases[i].k, cases[i].E);
        cr_expect(got == cases[i].want, "capacity(cf %g, T %lld, k %lld, E %lld) = %lld, want %lld", cases[i].cf,
                  (long long)cases[i].T, (long long)cases[i].k, (long long)cases[i].E, (long long)got,
                  (long long)cases[i].want);
    }
}

Test(config, null_arguments) {
    moe_layer_config c = good_cfg();
    moe_layer *l = NULL;
    cr_expect(moe_layer_config_validate(NULL) == MOE_ERR_INVALID_ARG);
    cr_expect(moe_layer_create(NULL, &c) == MOE_ERR_INVALID_ARG);
    cr_expect(moe_layer_create(&l, NULL) == MOE_ERR_INVALID_ARG);
    cr_assert(moe_layer_create(&l, &c) == MOE_OK, "%s", moe_last_error());
    float x[3 * 8] = {0}, y[3 * 8], dx[3 * 8];
    moe_tensor_view v;
    cr_expect(moe_layer_forward(NULL, y, x, 3, NULL) == MOE_ERR_INVALID_ARG);
    cr_expect(moe_layer_forward(l, NULL, x, 3, NULL) == MOE_ERR_INVALID_ARG);
    cr_expect(strstr(moe_last_error(), "moe_layer_forward: y is NULL"), "%s", moe_last_error());
    cr_expect(moe_layer_forward(l, y, NULL, 3, NULL) == MOE_ERR_INVALID_ARG);
    cr_expect(strstr(moe_last_error(), "moe_layer_forward: x is NULL"), "%s", moe_last_error());
    cr_expect(moe_layer_forward(l, y, x, -1, NULL) == MOE_ERR_INVALID_ARG,
              "negative T must be refused");
    /* No tokens: nothing to do, no buffers needed, stats zero; backward too. */
    int64_t tpe[4] = {7, 7, 7, 7};
    moe_layer_stats st = {.tokens_per_expert = tpe, .pairs = 5, .aux_loss = 1.0};
    cr_expect(moe_layer_forward(l, NULL, NULL, 0, &st) == MOE_OK, "%s", moe_last_error());
    cr_expect(st.pairs == 0 && st.aux_loss == 0.0 && st.tokens_per_expert == tpe && tpe[0] == 0 && tpe[3] == 0,
              "stats of no tokens: pairs %lld aux %g tpe[0] %lld", (long long)st.pairs, st.aux_loss,
              (long long)tpe[0]);
    cr_expect(moe_layer_backward(l, NULL, NULL, NULL) == MOE_OK, "%s", moe_last_error());
    cr_expect(moe_layer_backward(NULL, dx, y, x) == MOE_ERR_INVALID_ARG);
    cr_expect(moe_layer_tensor(NULL, 0, &v) == MOE_ERR_INVALID_ARG);
    cr_expect(moe_layer_tensor(l, 0, NULL) == MOE_ERR_INVALID_ARG);
    cr_expect(moe_layer_tensor(l, -1, &v) == MOE_ERR_INVALID_ARG);
    cr_expect(moe_layer_tensor(l, moe_layer_tensor_count(l), &v) == MOE_ERR_INVALID_ARG);
    cr_expect(moe_layer_tensor_by_name(l, NULL, &v) == MOE_ERR_INVALID_ARG);
    cr_expect(moe_layer_tensor_by_name(NULL, "gate.weight", &v) == MOE_ERR_INVALID_ARG);
    cr_expect(moe_layer_tensor_by_name(l, "gate.weight", NULL) == MOE_ERR_INVALID_ARG);
    cr_expect(moe_layer_tensor_by_name(l, "experts.4.w1.weight", &v) == MOE_ERR_INVALID_ARG,
              "expert 4 of 4 does not exist");
    cr_expect(strstr(moe_last_error(), "experts.4.w1.weight") != NULL,
              "message \"%s\" does not name the tensor", moe_last_error());
    cr_expect(moe_layer_set_training(NULL, 1) == MOE_ERR_INVALID_ARG);
    cr_expect(moe_layer_zero_grad(NULL) == MOE_ERR_INVALID_ARG);
    cr_expect(moe_layer_update_bias(NULL) == MOE_ERR_INVALID_ARG);
    cr_expect(moe_layer_update_bias(l) == MOE_ERR_CONFIG, "a layer without a bias: %s", moe_last_error());
    cr_expect(moe_layer_forward(l, y, x, 3, NULL) == MOE_OK, "%s", moe_last_error());
    cr_expect(moe_layer_backward(l, NULL, y, x) == MOE_ERR_INVALID_ARG);
    cr_expect(moe_layer_backward(l, dx, NULL, x) == MOE_ERR_INVALID_ARG);
    cr_expect(strstr(moe_last_error(), "moe_layer_backward: dy is NULL"), "%s", moe_last_error());
    cr_expect(moe_layer_backward(l, dx, y, NULL) == MOE_ERR_INVALID_ARG);
    /* dx is written while dy and x are read: in place, or overlapping by
     * one float, it would give wrong gradients. */
    cr_expect(moe_layer_backward(l, y, y, x) == MOE_ERR_INVALID_ARG);
    cr_expect(strstr(moe_last_error(), "dx overlaps dy"), "%s", moe_last_error());
    float both[2 * 3 * 8] = {0};
    cr_expect(moe_layer_backward(l, both + 3 * 8 - 1, y, both) == MOE_ERR_INVALID_ARG);
    cr_expect(strstr(moe_last_error(), "dx overlaps x"), "%s", moe_last_error());
    cr_expect(moe_layer_backward(l, dx, y, x) == MOE_OK, "%s", moe_last_error());
    moe_layer_destroy(l);
    moe_layer_destroy(NULL); /* like free(NULL) */
}

Test(config, backward_before_forward) {
    moe_layer_config c = good_cfg();
    moe_layer *l = NULL;
    cr_assert(moe_layer_create(&l, &c) == MOE_OK, "%s", moe_last_error());
    float x[2 * 8] = {0}, dy[2 * 8] = {0}, dx[2 * 8];
    moe_status s = moe_layer_backward(l, dx, dy, x);
    cr_expect(s == MOE_ERR_STATE, "backward before forward: status %d (%s), want MOE_ERR_STATE", s,
              moe_status_string(s));
    cr_expect(strstr(moe_last_error(), "forward") != NULL,
              "message \"%s\" does not say forward is missing", moe_last_error());
    moe_layer_destroy(l);
}

/* T * k * d (and T * d) past what size_t / int64_t hold: an error, no crash,
 * nothing written. */
Test(config, forward_size_overflow) {
    moe_layer_config c = good_cfg();
    moe_layer *l = NULL;
    cr_assert(moe_layer_create(&l, &c) == MOE_OK, "%s", moe_last_error());
    float x[8] = {0}, y[8];
    const int64_t huge[] = {INT64_MAX, INT64_MAX / 8 + 1, INT64_MAX / 16 + 1,
                            (int64_t)(SIZE_MAX / (sizeof(float) * 2 * 8)) + 1};
    for (size_t i = 0; i < sizeof huge / sizeof huge[0]; i++) {
        for (int j = 0; j < 8; j++) y[j] = 12345.0f;
        moe_status s = moe_layer_forward(l, y, x, huge[i], NULL);
        cr_expect(s != MOE_OK, "forward with T=%lld succeeded", (long long)huge[i]);
        cr_expect(moe_last_error()[0] != '\0', "T=%lld: status %d but no message",
                  (long long)huge[i], s);
        for (int j = 0; j < 8; j++)
            cr_expect(y[j] == 12345.0f, "T=%lld: failed forward wrote y[%d]", (long long)huge[i],
                      j);
    }
    /* the layer still works afterwards */
    cr_expect(moe_layer_forward(l, y, x, 1, NULL) == MOE_OK, "%s", moe_last_error());
    moe_layer_destroy(l);
}

Test(config, status_strings_and_version) {
    for (int a = 0; a < MOE_STATUS_COUNT; a++) {
        const char *sa = moe_status_string((moe_status)a);
        cr_assert(sa != NULL && sa[0] != '\0', "status %d has no string", a);
        for (int b = 0; b < a; b++)
            cr_expect(strcmp(sa, moe_status_string((moe_status)b)) != 0,
                      "statuses %d and %d share the string \"%s\"", a, b, sa);
    }
    cr_expect(moe_status_string(MOE_STATUS_COUNT) != NULL);
    cr_expect(moe_status_string((moe_status)-1) != NULL);
    int major = -1, minor = -1, patch = -1;
    moe_version(&major, &minor, &patch);
    cr_expect(major == MOE_VERSION_MAJOR && minor == MOE_VERSION_MINOR &&
              patch == MOE_VERSION_PATCH);
    char want[32];
    snprintf(want, sizeof want, "%d.%d.%d", MOE_VERSION_MAJOR, MOE_VERSION_MINOR,
             MOE_VERSION_PATCH);
    cr_expect_str_eq(moe_version_string(), want);
}
