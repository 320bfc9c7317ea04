/* Checkpoints: bitwise save/load round trips, the files on disk, BF16/F16,
 * fused and sharded files written by others, corrupt input, and atomic
 * replacement when a save fails midway. */
#define _XOPEN_SOURCE 700

#include <criterion/criterion.h>
#include <dirent.h>
#include <errno.h>
#include <ftw.h>
#include <inttypes.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/crc32c.h"
#include "engine/checkpoint.h"
#include "engine/fileio.h"
#include "engine/safetensors.h"

#define TEST_TMPDIR_TEMPLATE "/tmp/moe_ckpt_XXXXXX"
#include "test_files.h"

#define VOCAB 11
#define D 16
#define FF 8
#define LAYERS 2
#define EXPERTS 4
#define MAX_TENSORS 128

/* ------------------------------------------------------------ temp dirs */

/* Entries of dir whose name starts with prefix. */
static int count_entries(const char *dir, const char *prefix) {
    DIR *d = opendir(dir);
    cr_assert_not_null(d, "cannot open %s", dir);
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL)
        n += strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0 &&
             strncmp(e->d_name, prefix, strlen(prefix)) == 0;
    closedir(d);
    return n;
}

/* ------------------------------------------------------------ the model */

typedef struct run {
    moe_model *model;
    moe_trainer *trainer;
} run;

/* The test's model: its sizes, experts experts, top-k. */
static moe_model_config small_config(int64_t experts, int64_t k) {
    moe_model_config c;
    moe_model_config_default_small(&c, VOCAB);
    c.hidden_size = D;
    c.intermediate_size = FF;
    c.num_hidden_layers = LAYERS;
    c.num_attention_heads = 2;
    c.num_key_value_heads = 1;
    c.head_dim = 8;
    c.num_local_experts = experts;
    c.num_experts_per_tok = k;
    return c;
}

static run run_of(const moe_model_config *c, uint64_t seed) {
    run r;
    cr_assert_eq(moe_model_create(&r.model, c, 1, 4, seed), MOE_OK, "%s", moe_last_error());
    moe_optim_config oc = MOE_OPTIM_CONFIG_INIT;
    cr_assert_eq(moe_trainer_create(&r.trainer, r.model, &oc), MOE_OK, "%s", moe_last_error());
    return r;
}

static run make_run(uint64_t seed, double bias_rate, int64_t shared) {
    moe_model_config c = small_config(EXPERTS, 2);
    c.moe_bias_update_rate = bias_rate;
    c.moe_n_shared_experts = shared;
    return run_of(&c, seed);
}

static void free_run(run *r) {
    moe_trainer_destroy(r->trainer);
    moe_model_destroy(r->model);
}

static int64_t n_params(const run *r) { return moe_model_param_count(r->model); }

static uint64_t splitmix(uint64_t *s) {
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Any finite float from random bits: both signs, subnormals, zeros. */
static float any_float(uint64_t *s) {
    uint32_t b = (uint32_t)(splitmix(s) >> 32);
    if (((b >> 23) & 0xFF) == 0xFF) b ^= 1u << 30;
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}

/* Puts values no fresh run has into everything a checkpoint holds, with
 * the trainer at `step`, and returns the matching state. */
static moe_train_state scramble(run *r, uint64_t seed, int64_t step) {
    uint64_t s = seed;
    float *p = moe_model_params(r->model), *m = moe_trainer_adam_m(r->trainer), *v = moe_trainer_adam_v(r->trainer);
    for (int64_t i = 0; i < n_params(r); i++) {
        p[i] = any_float(&s);
        m[i] = any_float(&s);
        v[i] = fabsf(any_float(&s));
    }
    for (int64_t l = 0; l < LAYERS; l++) {
        float *bias = moe_model_router_bias(r->model, l);
        for (int64_t e = 0; bias != NULL && e < EXPERTS; e++) bias[e] = any_float(&s);
    }
    moe_trainer_set_steps_done(r->trainer, step);
    moe_model_set_jitter_counter(r->model, 1000 + seed);
    return (moe_train_state){.step = step, .seed = UINT64_MAX - seed, .jitter_counter = 1000 + seed,
                             .data = {.token = 4096 + (int64_t)seed, .epoch = 3},
                             .data_tokens = 100000 + (int64_t)seed, .data_chunk = 512,
                             .data_shuffle_seed = (uint64_t)1 << 63 | seed, .data_kind = "bytes",
                             .pipe_layer_seconds = 0.1 / 3.0 + (double)seed, .pipe_head_seconds = 1e-3 / 7.0};
}

static float *copy_floats(const float *a, int64_t n) {
    float *c = malloc((size_t)n * sizeof *c);
    cr_assert_not_null(c);
    memcpy(c, a, (size_t)n * sizeof *c);
    return c;
}

/* Bitwise equality; names the first element that differs. */
static void expect_bits(const float *got, const float *want, int64_t n, const char *what) {
    for (int64_t i = 0; i < n; i++)
        if (memcmp(&got[i], &want[i], sizeof(float)) != 0)
            cr_assert_fail("%s: element %lld is %a, expected %a", what, (long long)i, got[i], want[i]);
}

static void expect_error(moe_status st, const char *a, const char *b) {
    cr_assert_neq(st, MOE_OK, "expected a failure naming '%s'", a);
    const char *e = moe_last_error();
    cr_assert(strstr(e, a) != NULL && (b == NULL || strstr(e, b) != NULL), "error \"%s\" should name '%s' and '%s'", e,
              a, b ? b : "");
}

static const char *save(char *path, size_t n, const char *out, run *r, const moe_train_state *s) {
    cr_assert_eq(moe_checkpoint_save(path, n, out, r->model, r->trainer, s), MOE_OK, "%s", moe_last_error());
    return path;
}

static void load_weights(run *r, const char *dir) {
    cr_assert_eq(moe_checkpoint_load_weights(r->model, dir), MOE_OK, "%s", moe_last_error());
}

/* b takes the checkpoint at dir, weights and state, and then holds a's
 * parameters and moments bit for bit; the state read is returned. */
static moe_train_state resume_bits(run *b, const run *a, const char *dir) {
    load_weights(b, dir);
    moe_train_state got;
    cr_assert_eq(moe_checkpoint_load_state(b->trainer, b->model, &got, dir), MOE_OK, "%s", moe_last_error());
    const int64_t n = n_params(a);
    expect_bits(moe_model_params(b->model), moe_model_params(a->model), n, "params");
    expect_bits(moe_trainer_adam_m(b->trainer), moe_trainer_adam_m(a->trainer), n, "exp_avg");
    expect_bits(moe_trainer_adam_v(b->trainer), moe_trainer_adam_v(a->trainer), n, "exp_avg_sq");
    return got;
}

/* ------------------------------------------- safetensors written by hand */

typedef struct tt {
    char name[160];
    int64_t ndim;
    int64_t shape[3];
    const float *data; /* [product of shape] */
} tt;

static int64_t tt_numel(const tt *t) {
    int64_t n = 1;
    for (int64_t i = 0; i < t->ndim; i++) n *= t->shape[i];
    return n;
}

static tt make_tt(const char *name, int64_t ndim, const int64_t *shape, const float *data) {
    tt t = {.ndim = ndim, .data = data};
    size_t len = strlen(name);
    cr_assert_lt(len, sizeof t.name, "tensor name too long: %s", name);
    memcpy(t.name, name, len + 1);
    for (int64_t i = 0; i < ndim; i++) t.shape[i] = shape[i];
    return t;
}

/* The model's tensors (1-D norms) and biases, in its order. */
static int64_t model_tts(tt *out, run *r) {
    int64_t n = 0;
    const float *p = moe_model_params(r->model);
    for (int64_t i = 0; i < moe_model_tensor_count(r->model); i++) {
        const moe_model_tensor *t = moe_model_tensor_at(r->model, i);
        out[n++] = make_tt(t->name, t->ndim, t->shape, p + t->offset);
    }
    for (int64_t l = 0; l < LAYERS; l++) {
        const float *bias = moe_model_router_bias(r->model, l);
        if (bias == NULL) continue;
        char name[128];
        snprintf(name, sizeof name, "model.layers.%lld.block_sparse_moe.gate.e_score_correction_bias", (long long)l);
        out[n++] = make_tt(name, 1, (int64_t[]){EXPERTS}, bias);
    }
    return n;
}

static int64_t drop_tt(tt *ts, int64_t n, const char *name) {
    for (int64_t i = 0; i < n; i++)
        if (strcmp(ts[i].name, name) == 0) {
            memmove(&ts[i], &ts[i + 1], (size_t)(n - i - 1) * sizeof *ts);
            return n - 1;
        }
    cr_assert_fail("no tensor %s to drop", name);
    return n;
}

static uint32_t f32_bits(float x) {
    uint32_t b;
    memcpy(&b, &x, sizeof b);
    return b;
}

/* Exact encodings only: the test values are chosen to fit. */
static uint16_t bf16_bits(float x) {
    uint32_t b = f32_bits(x);
    cr_assert_eq(b & 0xFFFF, 0, "%a is not exact in bf16", x);
    return (uint16_t)(b >> 16);
}

static uint16_t f16_bits(float x) {
    uint32_t b = f32_bits(x), sign = (b >> 16) & 0x8000, man = b & 0x7FFFFF;
    int exp = (int)((b >> 23) & 0xFF);
    if (exp == 0 && man == 0) return (uint16_t)sign;
    cr_assert(exp - 127 + 15 >= 1 && exp - 127 + 15 <= 30 && (man & 0x1FFF) == 0, "%a is not a normal f16", x);
    return (uint16_t)(sign | (uint32_t)(exp - 112) << 10 | man >> 13);
}

/* A safetensors file of ts [n] stored as dtype ("F32", "BF16", "F16"),
 * header built by hand and space-padded to 8 bytes. */
static void write_tts(const char *path, const tt *ts, int64_t n, const char *dtype) {
    const size_t esize = strcmp(dtype, "F32") == 0 ? 4 : 2;
    size_t cap = 256 + (size_t)n * 320, len = 0, data_len = 0;
    char *h = malloc(cap);
    cr_assert_not_null(h);
    len += (size_t)snprintf(h + len, cap - len, "{\"__metadata__\":{\"format\":\"pt\"}");
    for (int64_t i = 0; i < n; i++) {
        len += (size_t)snprintf(h + len, cap - len, ",\"%s\":{\"dtype\":\"%s\",\"shape\":[", ts[i].name, dtype);
        for (int64_t k = 0; k < ts[i].ndim; k++)
            len += (size_t)snprintf(h + len, cap - len, "%s%lld", k ? "," : "", (long long)ts[i].shape[k]);
        size_t bytes = (size_t)tt_numel(&ts[i]) * esize;
        len += (size_t)snprintf(h + len, cap - len, "],\"data_offsets\":[%zu,%zu]}", data_len, data_len + bytes);
        data_len += bytes;
    }
    len += (size_t)snprintf(h + len, cap - len, "}");
    while (len % 8 != 0) h[len++] = ' ';
    cr_assert_lt(len, cap);
    unsigned char *buf = malloc(8 + len + data_len), *p = buf + 8 + len;
    for (int i = 0; i < 8; i++) buf[i] = (unsigned char)((uint64_t)len >> (8 * i));
    memcpy(buf + 8, h, len);
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j < tt_numel(&ts[i]); j++) {
            float x = ts[i].data[j];
            uint32_t bits = esize == 4 ? f32_bits(x) : strcmp(dtype, "BF16") == 0 ? bf16_bits(x) : f16_bits(x);
            for (size_t k = 0; k < esize; k++) *p++ = (unsigned char)(bits >> (8 * k));
        }
    write_bytes(path, buf, 8 + len + data_len);
    free(buf);
    free(h);
}

static const char *fresh_dir(const char *name) {
    const char *dir = in_tmp(name);
    cr_assert_eq(moe_mkdir_p(dir), MOE_OK, "%s", moe_last_error());
    return dir;
}

/* ------------------------------------------------------------ round trip */

Test(checkpoint, save_then_load_is_bitwise, .init = make_tmpdir, .fini = remove_tmpdir) {
    run a = make_run(1, 0.01, 1), b = make_run(2, 0.01, 1);
    moe_train_state s = scramble(&a, 7, 7);
    char path[512];
    save(path, sizeof path, in_tmp("out/nested"), &a, &s);
    cr_assert_str_eq(path, in_tmp("out/nested/step-000007"));

    scramble(&b, 8, 1);
    const moe_train_state got = resume_bits(&b, &a, path);
    for (int64_t l = 0; l < LAYERS; l++)
        expect_bits(moe_model_router_bias(b.model, l), moe_model_router_bias(a.model, l), EXPERTS, "bias");
    cr_expect_eq(moe_trainer_steps_done(b.trainer), 7);
    cr_expect_eq(got.step, 7);
    cr_expect_eq(got.seed, UINT64_MAX - 7);
    cr_expect_eq(got.jitter_counter, 1007);
    cr_expect_eq(moe_model_jitter_counter(b.model), 1007);
    cr_expect_eq(got.data.token, 4096 + 7);
    cr_expect_eq(got.data.epoch, 3);
    cr_expect_eq(got.data_tokens, 100007);
    cr_expect_eq(got.data_chunk, 512);
    cr_expect_eq(got.data_shuffle_seed, (uint64_t)1 << 63 | 7);
    cr_expect_str_eq(got.data_kind, "bytes");
    cr_expect(got.pipe_layer_seconds == 0.1 / 3.0 + 7.0 && got.pipe_head_seconds == 1e-3 / 7.0,
              "pipeline costs %.17g, %.17g: not the bits written", got.pipe_layer_seconds, got.pipe_head_seconds);
    moe_train_state meta_only;
    cr_assert_eq(moe_checkpoint_read_state(&meta_only, path), MOE_OK, "%s", moe_last_error());
    cr_expect(meta_only.step == 7 && meta_only.data_tokens == 100007 && meta_only.data_chunk == 512 &&
                  meta_only.data.token == 4096 + 7,
              "moe_checkpoint_read_state: step %lld, stream %lld in chunks of %lld, at token %lld",
              (long long)meta_only.step, (long long)meta_only.data_tokens, (long long)meta_only.data_chunk,
              (long long)meta_only.data.token);

    moe_model_config cfg;
    cr_assert_eq(moe_checkpoint_load_config(&cfg, path, true, NULL, NULL), MOE_OK, "%s", moe_last_error());
    const moe_model_config *want = moe_model_get_config(a.model);
    cr_expect_eq(cfg.hidden_size, want->hidden_size);
    cr_expect_eq(cfg.num_local_experts, want->num_local_experts);
    cr_expect_eq(cfg.moe_n_shared_experts, 1);
    cr_expect_eq(cfg.moe_bias_update_rate, want->moe_bias_update_rate);
    free_run(&a);
    free_run(&b);
}

Test(checkpoint, files_are_hf_safetensors, .init = make_tmpdir, .fini = remove_tmpdir) {
    run a = make_run(1, 0.01, 0);
    moe_train_state s = scramble(&a, 3, 12);
    char path[512];
    save(path, sizeof path, tmpdir, &a, &s);

    /* The raw header: u64 length, '{' first, 8-byte aligned data. */
    size_t size;
    unsigned char *raw = read_bytes(in_dir(path, "model.safetensors"), &size);
    uint64_t hlen = 0;
    for (int i = 0; i < 8; i++) hlen |= (uint64_t)raw[i] << (8 * i);
    cr_assert_lt(hlen + 8, size);
    cr_expect_eq((hlen + 8) % 8, 0, "header length %llu leaves the data unaligned", (unsigned long long)hlen);
    cr_expect_eq(raw[8], '{');
    free(raw);

    moe_st_file *f;
    cr_assert_eq(moe_st_open(&f, in_dir(path, "model.safetensors")), MOE_OK, "%s", moe_last_error());
    cr_assert_str_eq(moe_st_metadata(f, "format"), "pt");
    tt want[MAX_TENSORS];
    int64_t n = model_tts(want, &a);
    cr_assert_eq(moe_st_tensor_count(f), n);
    for (int64_t i = 0; i < n; i++) {
        const moe_st_tensor *t = moe_st_tensor_at(f, i);
        cr_assert_str_eq(t->name, want[i].name, "tensor %lld", (long long)i);
        cr_assert_eq(t->dtype, MOE_ST_F32, "%s", t->name);
        cr_assert_eq(t->ndim, want[i].ndim, "%s", t->name);
        for (int64_t k = 0; k < t->ndim; k++) cr_assert_eq(t->shape[k], want[i].shape[k], "%s", t->name);
        cr_assert_eq(memcmp(t->data, want[i].data, (size_t)t->nbytes), 0, "%s: bytes differ", t->name);
    }
    cr_expect_not_null(moe_st_find(f, "model.norm.weight"));
    cr_expect_eq(moe_st_find(f, "model.layers.0.input_layernorm.weight")->ndim, 1);
    moe_st_close(f);

    cr_assert_eq(moe_st_open(&f, in_dir(path, "train_state.safetensors")), MOE_OK, "%s", moe_last_error());
    cr_assert_str_eq(moe_st_metadata(f, "format"), "pt");
    const int64_t nt = moe_model_tensor_count(a.model);
    cr_assert_eq(moe_st_tensor_count(f), 2 * nt);
    for (int64_t i = 0; i < nt; i++) {
        const moe_model_tensor *t = moe_model_tensor_at(a.model, i);
        char name[160];
        snprintf(name, sizeof name, "optimizer.exp_avg_sq.%s", t->name);
        const moe_st_tensor *st = moe_st_find(f, name);
        cr_assert_not_null(st, "%s missing", name);
        cr_assert_eq(memcmp(st->data, moe_trainer_adam_v(a.trainer) + t->offset, (size_t)st->nbytes), 0, "%s", name);
    }
    const char *meta[][2] = {{"format_version", "1"}, {"step", "12"}, {"seed", "18446744073709551612"},
                             {"jitter_counter", "1003"}, {"data_token", "4099"}, {"data_epoch", "3"},
                             {"data_tokens", "100003"}, {"data_chunk", "512"}, {"data_shuffle_seed", "9223372036854775811"},
                             {"data_kind", "bytes"}};
    for (size_t i = 0; i < sizeof meta / sizeof meta[0]; i++) {
        const char *v = moe_st_metadata(f, meta[i][0]);
        cr_assert_not_null(v, "metadata %s missing", meta[i][0]);
        cr_expect_str_eq(v, meta[i][1], "metadata %s", meta[i][0]);
    }
    moe_st_close(f);
    free_run(&a);
}

Test(checkpoint, step_names_and_bad_arguments, .init = make_tmpdir, .fini = remove_tmpdir) {
    run a = make_run(1, 0, 0);
    char path[512];
    moe_train_state s = scramble(&a, 1, 1234567);
    cr_expect_str_eq(save(path, sizeof path, tmpdir, &a, &s), in_tmp("step-1234567"));
    s = scramble(&a, 1, 0);
    cr_expect_str_eq(save(path, sizeof path, tmpdir, &a, &s), in_tmp("step-000000"));

    s.step = 5; /* the trainer says 0 */
    expect_error(moe_checkpoint_save(path, sizeof path, tmpdir, a.model, a.trainer, &s), "step 5", NULL);
    s.step = 0;
    char small[8];
    expect_error(moe_checkpoint_save(small, sizeof small, in_tmp("other"), a.model, a.trainer, &s), "step-000000",
                 NULL);
    cr_expect_neq(access(in_tmp("other"), F_OK), 0, "nothing is written when the path does not fit");
    cr_expect_eq(count_entries(tmpdir, "."), 0);
    free_run(&a);
}

/* ------------------------------------------------- other writers' files */

/* Values exact in both BF16 and F16 (k/64 for |k| <= 64: normal or 0). */
static void set_exact_params(run *r) {
    float *p = moe_model_params(r->model);
    for (int64_t i = 0; i < n_params(r); i++) p[i] = (float)((i * 37) % 129 - 64) / 64.0f;
}

Test(checkpoint, bf16_and_f16_files_convert, .init = make_tmpdir, .fini = remove_tmpdir) {
    run a = make_run(1, 0, 0), b = make_run(2, 0, 0);
    set_exact_params(&a);
    tt ts[MAX_TENSORS];
    int64_t n = model_tts(ts, &a);
    const char *dtypes[] = {"BF16", "F16"};
    for (int k = 0; k < 2; k++) {
        const char *dir = fresh_dir(dtypes[k]);
        write_tts(in_dir(dir, "model.safetensors"), ts, n, dtypes[k]);
        scramble(&b, 5, 0);
        load_weights(&b, dir);
        expect_bits(moe_model_params(b.model), moe_model_params(a.model), n_params(&a), dtypes[k]);
    }
    free_run(&a);
    free_run(&b);
}

/* transformers' fused layout of a's experts, built here from its names. */
static int64_t fused_tts(tt *ts, run *a, float *gate_up, float *down) {
    int64_t n = 0;
    const float *p = moe_model_params(a->model);
    for (int64_t i = 0; i < moe_model_tensor_count(a->model); i++) {
        const moe_model_tensor *t = moe_model_tensor_at(a->model, i);
        if (strstr(t->name, ".block_sparse_moe.") == NULL) ts[n++] = make_tt(t->name, t->ndim, t->shape, p + t->offset);
    }
    for (int64_t l = 0; l < LAYERS; l++) {
        char name[160];
        float *gu = gate_up + l * EXPERTS * 2 * FF * D, *dn = down + l * EXPERTS * D * FF; /* [E, 2ff, d], [E, d, ff] */
        for (int64_t e = 0; e < EXPERTS; e++) {
            const char *w[3] = {"w1", "w3", "w2"};
            float *dst[3] = {gu + e * 2 * FF * D, gu + e * 2 * FF * D + FF * D, dn + e * D * FF};
            for (int k = 0; k < 3; k++) {
                snprintf(name, sizeof name, "model.layers.%lld.block_sparse_moe.experts.%lld.%s.weight", (long long)l,
                         (long long)e, w[k]);
                const moe_model_tensor *t = moe_model_find_tensor(a->model, name);
                cr_assert_not_null(t, "%s", name);
                memcpy(dst[k], p + t->offset, (size_t)t->numel * sizeof(float));
            }
        }
        snprintf(name, sizeof name, "model.layers.%lld.block_sparse_moe.gate.weight", (long long)l);
        const moe_model_tensor *router = moe_model_find_tensor(a->model, name);
        snprintf(name, sizeof name, "model.layers.%lld.mlp.gate.weight", (long long)l);
        ts[n++] = make_tt(name, 2, (int64_t[]){EXPERTS, D}, p + router->offset);
        snprintf(name, sizeof name, "model.layers.%lld.mlp.experts.gate_up_proj", (long long)l);
        ts[n++] = make_tt(name, 3, (int64_t[]){EXPERTS, 2 * FF, D}, gu);
        snprintf(name, sizeof name, "model.layers.%lld.mlp.experts.down_proj", (long long)l);
        ts[n++] = make_tt(name, 3, (int64_t[]){EXPERTS, D, FF}, dn);
    }
    return n;
}

Test(checkpoint, fused_layout_loads_like_per_expert, .init = make_tmpdir, .fini = remove_tmpdir) {
    run a = make_run(1, 0, 0), b = make_run(2, 0, 0), c = make_run(3, 0, 0);
    moe_train_state s = scramble(&a, 11, 0);
    char path[512];
    save(path, sizeof path, tmpdir, &a, &s);
    load_weights(&c, path);

    float *gate_up = malloc(LAYERS * EXPERTS * 2 * FF * D * sizeof(float));
    float *down = malloc(LAYERS * EXPERTS * D * FF * sizeof(float));
    tt ts[MAX_TENSORS];
    int64_t n = fused_tts(ts, &a, gate_up, down);
    const char *dir = fresh_dir("fused");
    write_tts(in_dir(dir, "model.safetensors"), ts, n, "F32");
    load_weights(&b, dir);
    expect_bits(moe_model_params(b.model), moe_model_params(c.model), n_params(&a), "fused vs per-expert");
    expect_bits(moe_model_params(b.model), moe_model_params(a.model), n_params(&a), "fused vs saved");

    /* A fused tensor of the wrong shape is named. */
    for (int64_t i = 0; i < n; i++)
        if (strcmp(ts[i].name, "model.layers.1.mlp.experts.down_proj") == 0) {
            ts[i].shape[1] = 2 * D;
            ts[i].shape[2] = FF / 2;
        }
    write_tts(in_dir(dir, "model.safetensors"), ts, n, "F32");
    expect_error(moe_checkpoint_load_weights(b.model, dir), "model.layers.1.mlp.experts.down_proj", "[4, 32, 4]");
    free(gate_up);
    free(down);
    free_run(&a);
    free_run(&b);
    free_run(&c);
}

/* a, its state scrambled, saved in tmpdir (its checkpoint into path): the
 * checkpoint's model.safetensors, open. */
static moe_st_file *save_and_open(char *path, size_t size, run *a) {
    moe_train_state s = scramble(a, 5, 5);
    save(path, size, tmpdir, a, &s);
    moe_st_file *f;
    cr_assert_eq(moe_st_open(&f, in_dir(path, "model.safetensors")), MOE_OK, "%s", moe_last_error());
    return f;
}

/* The file f holds each tensor ours[i][0] of the model as ours[i][1], with
 * its bytes; every tensor under a name of transformers' (none of
 * block_sparse_moe), and no other. */
static void expect_file_names(moe_st_file *f, const run *a, const char *const (*ours)[2], size_t n) {
    const float *p = moe_model_params(a->model);
    for (size_t i = 0; i < n; i++) {
        const moe_model_tensor *t = moe_model_find_tensor(a->model, ours[i][0]);
        const moe_st_tensor *st = moe_st_find(f, ours[i][1]);
        cr_assert(t != NULL && st != NULL, "%s as %s", ours[i][0], ours[i][1]);
        cr_expect(st->nbytes == t->numel * (int64_t)sizeof(float) && memcmp(st->data, p + t->offset, (size_t)st->nbytes) == 0,
                  "%s: not %s's bytes", ours[i][1], ours[i][0]);
    }
    for (int64_t i = 0; i < moe_st_tensor_count(f); i++)
        cr_expect(strstr(moe_st_tensor_at(f, i)->name, "block_sparse_moe") == NULL, "%s",
                  moe_st_tensor_at(f, i)->name);
    cr_expect_eq(moe_st_tensor_count(f), moe_model_tensor_count(a->model));
}

/* A model that transformers' Qwen3-MoE computes (q and k normalised) is
 * saved under that model's names: the router mlp.gate, expert E's w1, w3
 * and w2 mlp.experts.E.gate_proj, up_proj and down_proj, the norms
 * self_attn.q_norm and k_norm; and loads back bit for bit. Its file is no
 * Mixtral's: a model without the norms refuses it, naming them. */
Test(checkpoint, qwen3_moe_files_use_its_names, .init = make_tmpdir, .fini = remove_tmpdir) {
    moe_model_config c = small_config(EXPERTS, 2);
    c.moe_qk_norm = MOE_QK_NORM_PER_HEAD;
    run a = run_of(&c, 1), b = run_of(&c, 2);
    char path[512];
    moe_st_file *f = save_and_open(path, sizeof path, &a);
    static const char *const ours[][2] = {
        {"model.layers.1.block_sparse_moe.gate.weight", "model.layers.1.mlp.gate.weight"},
        {"model.layers.1.block_sparse_moe.experts.3.w1.weight", "model.layers.1.mlp.experts.3.gate_proj.weight"},
        {"model.layers.1.block_sparse_moe.experts.3.w3.weight", "model.layers.1.mlp.experts.3.up_proj.weight"},
        {"model.layers.0.block_sparse_moe.experts.0.w2.weight", "model.layers.0.mlp.experts.0.down_proj.weight"},
        {"model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.q_norm.weight"},
        {"model.layers.1.self_attn.k_norm.weight", "model.layers.1.self_attn.k_norm.weight"},
    };
    expect_file_names(f, &a, ours, sizeof ours / sizeof *ours);
    load_weights(&b, path);
    expect_bits(moe_model_params(b.model), moe_model_params(a.model), n_params(&a), "qwen3_moe names");

    /* An expert the file lacks is named by every name it may have. */
    tt ts[MAX_TENSORS];
    int64_t n = 0;
    float *copy = malloc((size_t)n_params(&a) * sizeof *copy), *at = copy; /* aligned copies of the file's data */
    cr_assert_not_null(copy);
    for (int64_t i = 0; i < moe_st_tensor_count(f); i++) {
        const moe_st_tensor *t = moe_st_tensor_at(f, i);
        if (strcmp(t->name, "model.layers.1.mlp.experts.3.up_proj.weight") == 0) continue;
        memcpy(at, t->data, (size_t)t->nbytes);
        ts[n++] = make_tt(t->name, t->ndim, t->shape, at);
        at += t->numel;
    }
    moe_st_close(f);
    const char *missing = fresh_dir("qwen3-missing");
    write_tts(in_dir(missing, "model.safetensors"), ts, n, "F32");
    expect_error(moe_checkpoint_load_weights(b.model, missing),
                 "no tensor 'model.layers.1.block_sparse_moe.experts.3.w3.weight' (nor "
                 "'model.layers.1.mlp.experts.gate_up_proj' nor 'model.layers.1.mlp.experts.3.up_proj.weight')",
                 NULL);
    free(copy);

    run mixtral = make_run(3, 0, 0);
    expect_error(moe_checkpoint_load_weights(mixtral.model, path), "model.layers.0.self_attn.k_norm.weight",
                 "not part of this model");
    free_run(&mixtral);
    free_run(&a);
    free_run(&b);
}

/* A dense MLP layer among the MoE layers is saved as transformers names a
 * Qwen3-MoE's mlp_only_layers (mlp.gate_proj, up_proj, down_proj), with no
 * router or experts; and loads back bit for bit with its moments and the
 * MoE layers' selection biases (ours: the bias takes the "moe" type). A
 * model whose layer is an MoE layer refuses the file, naming its router. */
Test(checkpoint, dense_layers_are_saved_as_mlps, .init = make_tmpdir, .fini = remove_tmpdir) {
    moe_model_config c = small_config(EXPERTS, 2);
    c.moe_qk_norm = MOE_QK_NORM_PER_HEAD;
    c.moe_dense_layers[0] = 0x1;
    c.moe_dense_intermediate_size = 3 * FF;
    run a = run_of(&c, 1), b = run_of(&c, 2);
    char path[512];
    moe_st_file *f = save_and_open(path, sizeof path, &a);
    static const char *const ours[][2] = {
        {"model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.gate_proj.weight"},
        {"model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight"},
        {"model.layers.0.mlp.down_proj.weight", "model.layers.0.mlp.down_proj.weight"},
        {"model.layers.1.block_sparse_moe.gate.weight", "model.layers.1.mlp.gate.weight"},
        {"model.layers.1.block_sparse_moe.experts.3.w2.weight", "model.layers.1.mlp.experts.3.down_proj.weight"},
    };
    expect_file_names(f, &a, ours, sizeof ours / sizeof *ours);
    const moe_st_tensor *down = moe_st_find(f, "model.layers.0.mlp.down_proj.weight");
    cr_expect(down->shape[0] == D && down->shape[1] == 3 * FF, "down_proj [%lld, %lld]", (long long)down->shape[0],
              (long long)down->shape[1]);
    moe_st_close(f);
    load_weights(&b, path);
    expect_bits(moe_model_params(b.model), moe_model_params(a.model), n_params(&a), "a dense layer's MLP");
    free_run(&b);
    c.moe_dense_layers[0] = 0;
    c.moe_dense_intermediate_size = 0;
    b = run_of(&c, 2);
    expect_error(moe_checkpoint_load_weights(b.model, path), "no tensor 'model.layers.0.block_sparse_moe.gate.weight'",
                 "'model.layers.0.mlp.gate.weight'");
    free_run(&a);
    free_run(&b);

    c = small_config(EXPERTS, 2);
    c.moe_bias_update_rate = 0.01;
    c.moe_dense_layers[0] = 0x2;
    a = run_of(&c, 3), b = run_of(&c, 4);
    moe_train_state s = scramble(&a, 9, 9);
    save(path, sizeof path, tmpdir, &a, &s);
    cr_expect(moe_model_router_bias(a.model, 0) != NULL && moe_model_router_bias(a.model, 1) == NULL,
              "a selection bias for the MoE layer 0 only");
    resume_bits(&b, &a, path);
    expect_bits(moe_model_router_bias(b.model, 0), moe_model_router_bias(a.model, 0), EXPERTS, "bias");
    moe_model_config cfg;
    cr_assert_eq(moe_checkpoint_load_config(&cfg, path, true, NULL, NULL), MOE_OK, "%s", moe_last_error());
    cr_expect(!moe_model_config_layer_is_dense(&cfg, 0) && moe_model_config_layer_is_dense(&cfg, 1),
              "the saved config's dense layers");
    free_run(&a);
    free_run(&b);
}

/* A model of dense MLP layers only (a dense baseline) has no router or
 * expert tensor, saves as the dense model type its attention makes it
 * (Llama, Mistral with a window, Qwen3 with q and k normalised per head,
 * Qwen2 with q, k and v biases; ours otherwise), whose reader builds it
 * with the dense layers' width as intermediate_size and no MoE field set,
 * and resumes bit for bit. */
Test(checkpoint, dense_layers_only, .init = make_tmpdir, .fini = remove_tmpdir) {
    static const struct {
        moe_qk_norm_kind qk_norm;
        bool qkv_bias;
        int64_t window;
        const char *type;
    } kinds[] = {
        {MOE_QK_NORM_NONE, false, 0, "llama"},         {MOE_QK_NORM_NONE, false, 3, "mistral"},
        {MOE_QK_NORM_PER_HEAD, false, 0, "qwen3"},     {MOE_QK_NORM_NONE, true, 0, "qwen2"},
        {MOE_QK_NORM_PER_HEAD, true, 0, "moe"},        {MOE_QK_NORM_ACROSS_HEADS, false, 0, "moe"},
    };
    for (size_t k = 0; k < sizeof kinds / sizeof *kinds; k++) {
        moe_model_config c = small_config(EXPERTS, 2);
        c.moe_qk_norm = kinds[k].qk_norm;
        c.moe_qkv_bias = kinds[k].qkv_bias;
        c.sliding_window = kinds[k].window;
        c.moe_dense_layers[0] = 0x3;
        c.moe_dense_intermediate_size = 2 * FF;
        cr_expect_str_eq(moe_model_config_model_type(&c), kinds[k].type);
        run a = run_of(&c, 5), b = run_of(&c, 6);
        for (int64_t i = 0; i < moe_model_tensor_count(a.model); i++) {
            const char *name = moe_model_tensor_at(a.model, i)->name;
            cr_expect(!strstr(name, "block_sparse_moe") && !strstr(name, "experts"), "tensor %s in a dense model",
                      name);
        }
        char path[512];
        moe_train_state s = scramble(&a, 11, 11);
        save(path, sizeof path, tmpdir, &a, &s);
        resume_bits(&b, &a, path);
        moe_model_config cfg;
        cr_assert_eq(moe_checkpoint_load_config(&cfg, path, true, NULL, NULL), MOE_OK, "%s", moe_last_error());
        cr_expect_str_eq(moe_model_config_model_type(&cfg), kinds[k].type);
        cr_expect_eq(moe_model_config_dense_layer_count(&cfg), 2, "the saved config's dense layers");
        cr_expect(cfg.intermediate_size == 2 * FF && cfg.moe_dense_intermediate_size == 0 &&
                      cfg.num_local_experts == 1 && cfg.num_experts_per_tok == 1,
                  "%s: intermediate_size %lld, moe_dense_intermediate_size %lld, %lld experts of top-%lld", kinds[k].type,
                  (long long)cfg.intermediate_size, (long long)cfg.moe_dense_intermediate_size,
                  (long long)cfg.num_local_experts, (long long)cfg.num_experts_per_tok);
        cr_expect(cfg.sliding_window == kinds[k].window && cfg.moe_qk_norm == kinds[k].qk_norm &&
                      cfg.moe_qkv_bias == kinds[k].qkv_bias,
                  "%s: the attention read back", kinds[k].type);
        free_run(&a);
        free_run(&b);
    }
}

/* A model that transformers' Qwen2-MoE computes (one gated shared expert,
 * q, k and v biases) is saved under its names: the shared expert
 * mlp.shared_expert.{gate,up,down}_proj, its gate mlp.shared_expert_gate,
 * the biases self_attn.{q,k,v}_proj.bias; and loads back bit for bit. A
 * model without the biases refuses the file, naming one. */
Test(checkpoint, qwen2_moe_files_use_its_names, .init = make_tmpdir, .fini = remove_tmpdir) {
    moe_model_config c = small_config(EXPERTS, 2);
    c.moe_n_shared_experts = 1;
    c.moe_shared_intermediate_size = 12;
    c.moe_shared_expert_gate = true;
    c.moe_qkv_bias = true;
    c.moe_renormalize = false;
    cr_assert_str_eq(moe_model_config_model_type(&c), "qwen2_moe");
    run a = run_of(&c, 1), b = run_of(&c, 2);
    char path[512];
    moe_st_file *f = save_and_open(path, sizeof path, &a);
    static const char *const ours[][2] = {
        {"model.layers.1.block_sparse_moe.gate.weight", "model.layers.1.mlp.gate.weight"},
        {"model.layers.1.block_sparse_moe.experts.3.w3.weight", "model.layers.1.mlp.experts.3.up_proj.weight"},
        {"model.layers.0.block_sparse_moe.shared_experts.gate_proj.weight",
         "model.layers.0.mlp.shared_expert.gate_proj.weight"},
        {"model.layers.1.block_sparse_moe.shared_experts.down_proj.weight",
         "model.layers.1.mlp.shared_expert.down_proj.weight"},
        {"model.layers.1.block_sparse_moe.shared_expert_gate.weight", "model.layers.1.mlp.shared_expert_gate.weight"},
        {"model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.q_proj.bias"},
        {"model.layers.1.self_attn.v_proj.bias", "model.layers.1.self_attn.v_proj.bias"},
    };
    expect_file_names(f, &a, ours, sizeof ours / sizeof *ours);
    const moe_st_tensor *gate = moe_st_find(f, "model.layers.0.mlp.shared_expert_gate.weight");
    cr_expect(gate && gate->ndim == 2 && gate->shape[0] == 1 && gate->shape[1] == c.hidden_size,
              "the gate is transformers' Linear(hidden_size, 1) weight, [1, hidden_size]");
    moe_st_close(f);
    load_weights(&b, path);
    expect_bits(moe_model_params(b.model), moe_model_params(a.model), n_params(&a), "qwen2_moe names");

    c.moe_qkv_bias = false;
    run plain = run_of(&c, 3);
    expect_error(moe_checkpoint_load_weights(plain.model, path), "model.layers.0.self_attn.k_proj.bias",
                 "not part of this model");
    free_run(&plain);
    free_run(&a);
    free_run(&b);
}

static int warned;

/* A warning callback counting into ctx, an int. */
static void count_warning(void *ctx, const char *message) {
    (void)message;
    ++*(int *)ctx;
}

/* A checkpoint of a run started from a Hugging Face directory keeps the
 * tokenizer and generation files that directory has, byte for byte, so
 * that it reads as that model with its tokenizer; the others are not
 * made up, a save without them holds none, and one that cannot be read is
 * left out with a warning. */
Test(checkpoint, companions_are_copied, .init = make_tmpdir, .fini = remove_tmpdir) {
    run a = make_run(1, 0, 0);
    moe_train_state s = scramble(&a, 3, 3);
    const char *from = fresh_dir("hf");
    const char tok[] = "{\"model\": {\"vocab\": {\"a\": 0}}, \"decoder\": {\"type\": \"ByteLevel\"}}";
    const char gen[] = "{\"eos_token_id\": [1, 2]}";
    write_bytes(in_dir(from, "tokenizer.json"), tok, sizeof tok - 1);
    write_bytes(in_dir(from, "generation_config.json"), gen, sizeof gen - 1);
    moe_checkpoint_files files;
    cr_assert_eq(moe_checkpoint_read_companions(&files, from, NULL, NULL), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(files.count, 2);
    s.companions = &files;
    char path[512];
    save(path, sizeof path, in_tmp("out"), &a, &s);
    size_t n;
    unsigned char *got = read_bytes(in_dir(path, "tokenizer.json"), &n);
    cr_expect(n == sizeof tok - 1 && memcmp(got, tok, n) == 0, "tokenizer.json is not the source's");
    free(got);
    got = read_bytes(in_dir(path, "generation_config.json"), &n);
    cr_expect(n == sizeof gen - 1 && memcmp(got, gen, n) == 0, "generation_config.json is not the source's");
    free(got);
    cr_expect_neq(access(in_dir(path, "tokenizer_config.json"), F_OK), 0, "a file the source lacks was made");
    s = scramble(&a, 4, 4);
    save(path, sizeof path, in_tmp("out"), &a, &s);
    cr_expect_neq(access(in_dir(path, "tokenizer.json"), F_OK), 0, "a save from no directory copied one");
    moe_checkpoint_files_free(&files);
    /* One that cannot be read (a dangling link here) is left out with a
     * warning, the others kept. */
    cr_assert_eq(symlink("/nonexistent/tokenizer.model", in_dir(from, "tokenizer.model")), 0);
    warned = 0;
    cr_assert_eq(moe_checkpoint_read_companions(&files, from, count_warning, &warned), MOE_OK, "%s",
                 moe_last_error());
    cr_expect(files.count == 2 && warned == 1, "%d files, %d warnings", files.count, warned);
    moe_checkpoint_files_free(&files);
    free_run(&a);
}

/* A tied model's head is its embedding: saved once, as transformers saves
 * it. A file that also holds lm_head.weight loads when it is the
 * embedding's copy and is refused when it differs (an untied model's);
 * an untied model refuses a tied model's file, saying why. */
Test(checkpoint, tied_head_is_the_embedding, .init = make_tmpdir, .fini = remove_tmpdir) {
    moe_model_config c = small_config(EXPERTS, 2);
    c.tie_word_embeddings = true;
    run a = run_of(&c, 1), b = run_of(&c, 2), untied = make_run(3, 0, 0);
    cr_assert_null(moe_model_find_tensor(a.model, "lm_head.weight"));
    cr_assert_eq(moe_model_param_count(a.model) + VOCAB * D, moe_model_param_count(untied.model));
    moe_train_state s = scramble(&a, 5, 0);
    char path[512];
    save(path, sizeof path, tmpdir, &a, &s);
    moe_st_file *f;
    cr_assert_eq(moe_st_open(&f, in_dir(path, "model.safetensors")), MOE_OK, "%s", moe_last_error());
    cr_expect_null(moe_st_find(f, "lm_head.weight"));
    cr_expect_not_null(moe_st_find(f, "model.embed_tokens.weight"));
    moe_st_close(f);
    load_weights(&b, path);
    expect_bits(moe_model_params(b.model), moe_model_params(a.model), n_params(&a), "tied, saved and loaded");
    expect_error(moe_checkpoint_load_weights(untied.model, path), "no tensor 'lm_head.weight'",
                 "tie_word_embeddings true");

    tt ts[MAX_TENSORS + 1];
    int64_t n = model_tts(ts, &a);
    const moe_model_tensor *embed = moe_model_find_tensor(a.model, "model.embed_tokens.weight");
    float *head = malloc((size_t)embed->numel * sizeof *head);
    cr_assert_not_null(head);
    memcpy(head, moe_model_params(a.model) + embed->offset, (size_t)embed->numel * sizeof *head);
    ts[n++] = make_tt("lm_head.weight", 2, embed->shape, head);
    const char *dir = fresh_dir("both");
    write_tts(in_dir(dir, "model.safetensors"), ts, n, "F32");
    moe_model_zero_grad(b.model);
    memset(moe_model_params(b.model), 0, (size_t)n_params(&b) * sizeof(float));
    load_weights(&b, dir);
    expect_bits(moe_model_params(b.model), moe_model_params(a.model), n_params(&a), "with the head's copy");
    uint32_t last = f32_bits(head[VOCAB * D - 1]) ^ 1u; /* its lowest bit */
    memcpy(&head[VOCAB * D - 1], &last, sizeof last);
    write_tts(in_dir(dir, "model.safetensors"), ts, n, "F32");
    expect_error(moe_checkpoint_load_weights(b.model, dir), "'lm_head.weight' is not model.embed_tokens.weight's copy",
                 "tie_word_embeddings true");
    free(head);
    free_run(&a);
    free_run(&b);
    free_run(&untied);
}

/* A model of the test's sizes with experts experts, top-k, batches of 2 x 8. */
static moe_model *model_of(int64_t experts, int64_t k, uint64_t seed) {
    const moe_model_config c = small_config(experts, k);
    moe_model *m;
    cr_assert_eq(moe_model_create(&m, &c, 2, 8, seed), MOE_OK, "%s", moe_last_error());
    return m;
}

/* A dense model in Mistral's names: a MoE of one expert, top-1 (its one
 * routing weight is 1), with each layer's expert written as its MLP and
 * no router. */
static int64_t dense_tts(tt *ts, moe_model *dense) {
    int64_t n = 0;
    const float *p = moe_model_params(dense);
    static const char *const proj[4] = {[1] = "gate", [2] = "down", [3] = "up"};
    for (int64_t i = 0; i < moe_model_tensor_count(dense); i++) {
        const moe_model_tensor *t = moe_model_tensor_at(dense, i);
        long long l, e;
        int w;
        char name[160];
        if (sscanf(t->name, "model.layers.%lld.block_sparse_moe.experts.%lld.w%d.weight", &l, &e, &w) == 3)
            snprintf(name, sizeof name, "model.layers.%lld.mlp.%s_proj.weight", l, proj[w]);
        else if (strstr(t->name, ".block_sparse_moe."))
            continue;
        else
            snprintf(name, sizeof name, "%s", t->name);
        ts[n++] = make_tt(name, t->ndim, t->shape, p + t->offset);
    }
    return n;
}

/* Sparse upcycling: every expert of a 4-expert top-2 model is a copy of
 * the dense model's MLP, the routers keep their initial values, and with
 * renormalised routing weights (which sum to 1) the upcycled model's loss
 * is the dense model's, whatever the routers choose. A dense file without
 * a layer's MLP, of other sizes, with a router, or a MoE checkpoint, is
 * refused, naming the tensor, and the model is left as it was. */
Test(checkpoint, upcycled_experts_copy_the_dense_mlp, .init = make_tmpdir, .fini = remove_tmpdir) {
    moe_model *dense = model_of(1, 1, 5), *moe = model_of(EXPERTS, 2, 6), *fresh = model_of(EXPERTS, 2, 6);
    float *p = moe_model_params(dense);
    for (int64_t i = 0; i < moe_model_param_count(dense); i++) p[i] *= 10.0f; /* logits far from uniform */
    tt ts[MAX_TENSORS];
    const int64_t n = dense_tts(ts, dense);
    const char *dir = fresh_dir("dense");
    write_tts(in_dir(dir, "model.safetensors"), ts, n, "F32");
    cr_assert_eq(moe_checkpoint_upcycle_weights(moe, dir), MOE_OK, "%s", moe_last_error());

    for (int64_t i = 0; i < moe_model_tensor_count(moe); i++) {
        const moe_model_tensor *t = moe_model_tensor_at(moe, i);
        const float *got = moe_model_params(moe) + t->offset;
        long long l, e;
        int w;
        const float *want = NULL;
        if (sscanf(t->name, "model.layers.%lld.block_sparse_moe.experts.%lld.w%d.weight", &l, &e, &w) == 3) {
            char name[160];
            snprintf(name, sizeof name, "model.layers.%lld.block_sparse_moe.experts.0.w%d.weight", l, w);
            for (int64_t j = 0; j < moe_model_tensor_count(dense); j++)
                if (strcmp(moe_model_tensor_at(dense, j)->name, name) == 0)
                    want = moe_model_params(dense) + moe_model_tensor_at(dense, j)->offset;
        } else if (strstr(t->name, ".block_sparse_moe.")) {
            want = moe_model_params(fresh) + t->offset; /* the router, as initialised */
        } else {
            for (int64_t j = 0; j < moe_model_tensor_count(dense); j++)
                if (strcmp(moe_model_tensor_at(dense, j)->name, t->name) == 0)
                    want = moe_model_params(dense) + moe_model_tensor_at(dense, j)->offset;
        }
        cr_assert_not_null(want, "%s: no counterpart", t->name);
        expect_bits(got, want, t->numel, t->name);
    }

    int32_t inputs[16], targets[16];
    for (int i = 0; i < 16; i++) inputs[i] = (i * 7 + 3) % VOCAB, targets[i] = (i * 5 + 1) % VOCAB;
    moe_model_stats a, b;
    cr_assert_eq(moe_model_forward(dense, inputs, targets, &a), MOE_OK, "%s", moe_last_error());
    cr_assert_eq(moe_model_forward(moe, inputs, targets, &b), MOE_OK, "%s", moe_last_error());
    cr_expect(fabs(a.ce_loss - b.ce_loss) <= 1e-6 * a.ce_loss, "dense loss %.9g, upcycled %.9g", a.ce_loss,
              b.ce_loss);
    cr_expect(a.ce_loss > 3.0, "dense loss %g: the test's logits are too tame to tell", a.ce_loss);
    /* A dense MLP layer of the MoE takes its layer's MLP as it is. */
    moe_model_config mixed_cfg = small_config(EXPERTS, 2);
    mixed_cfg.moe_dense_layers[0] = 0x2;
    moe_model *mixed;
    cr_assert_eq(moe_model_create(&mixed, &mixed_cfg, 2, 8, 6), MOE_OK, "%s", moe_last_error());
    cr_assert_eq(moe_checkpoint_upcycle_weights(mixed, dir), MOE_OK, "%s", moe_last_error());
    const moe_model_tensor *mlp = moe_model_find_tensor(mixed, "model.layers.1.mlp.down_proj.weight");
    const moe_model_tensor *expert = moe_model_find_tensor(dense, "model.layers.1.block_sparse_moe.experts.0.w2.weight");
    cr_assert(mlp && expert);
    expect_bits(moe_model_params(mixed) + mlp->offset, moe_model_params(dense) + expert->offset, mlp->numel,
                "a dense layer's MLP");
    cr_assert_eq(moe_model_forward(mixed, inputs, targets, &b), MOE_OK, "%s", moe_last_error());
    cr_expect(fabs(a.ce_loss - b.ce_loss) <= 1e-6 * a.ce_loss, "dense loss %.9g, upcycled with a dense layer %.9g",
              a.ce_loss, b.ce_loss);
    moe_model_destroy(mixed);

    /* Refusals name the tensor; the model keeps its values. */
    const size_t bytes = (size_t)moe_model_param_count(moe) * sizeof(float);
    float *before = malloc(bytes);
    cr_assert_not_null(before);
    memcpy(before, moe_model_params(moe), bytes);
    tt bad[MAX_TENSORS];
    int64_t m = 0;
    for (int64_t i = 0; i < n; i++)
        if (strcmp(ts[i].name, "model.layers.1.mlp.up_proj.weight") != 0) bad[m++] = ts[i];
    write_tts(in_dir(dir, "model.safetensors"), bad, m, "F32");
    expect_error(moe_checkpoint_upcycle_weights(moe, dir), "no tensor 'model.layers.1.mlp.up_proj.weight'",
                 "--upcycle");
    memcpy(bad, ts, (size_t)n * sizeof *ts);
    for (int64_t i = 0; i < n; i++)
        if (strcmp(bad[i].name, "model.layers.0.mlp.down_proj.weight") == 0) bad[i].shape[1] = FF / 2;
    write_tts(in_dir(dir, "model.safetensors"), bad, n, "F32");
    expect_error(moe_checkpoint_upcycle_weights(moe, dir), "model.layers.0.mlp.down_proj.weight", NULL);
    memcpy(bad, ts, (size_t)n * sizeof *ts);
    const float router[EXPERTS * D] = {0};
    bad[n] = make_tt("model.layers.0.block_sparse_moe.gate.weight", 2, (int64_t[]){EXPERTS, D}, router);
    write_tts(in_dir(dir, "model.safetensors"), bad, n + 1, "F32");
    expect_error(moe_checkpoint_upcycle_weights(moe, dir), "model.layers.0.block_sparse_moe.gate.weight",
                 "is an MoE layer's, and --upcycle starts from a dense model");
    /* An expert beside the dense MLP: the file is no dense model, and the
     * expert would be dropped for the MLP's copy. */
    const float w1[FF * D] = {0};
    bad[n] = make_tt("model.layers.0.block_sparse_moe.experts.0.w1.weight", 2, (int64_t[]){FF, D}, w1);
    write_tts(in_dir(dir, "model.safetensors"), bad, n + 1, "F32");
    expect_error(moe_checkpoint_upcycle_weights(moe, dir), "model.layers.0.block_sparse_moe.experts.0.w1.weight",
                 "--upcycle starts from a dense model");
    run r = make_run(7, 0, 0);
    moe_train_state st = scramble(&r, 3, 0);
    char saved[512];
    save(saved, sizeof saved, tmpdir, &r, &st);
    expect_error(moe_checkpoint_upcycle_weights(moe, saved), "no tensor 'model.layers.0.mlp.gate_proj.weight'", NULL);
    expect_bits(moe_model_params(moe), before, moe_model_param_count(moe), "a refused upcycling");
    free(before);
    free_run(&r);
    moe_model_destroy(dense);
    moe_model_destroy(moe);
    moe_model_destroy(fresh);
}

/* ts [n] as two shards (the first `half` tensors, then the rest) and an
 * index whose weight_map lists listed [n_listed], each in the shard that
 * holds it by position in ts, or in the second one when ts lacks it. */
static void write_sharded(const char *dir, const tt *ts, int64_t n, int64_t half, const char *const *listed,
                          int64_t n_listed) {
    const char *shard[2] = {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"};
    write_tts(in_dir(dir, shard[0]), ts, half, "F32");
    write_tts(in_dir(dir, shard[1]), ts + half, n - half, "F32");
    FILE *f = fopen(in_dir(dir, "model.safetensors.index.json"), "w");
    cr_assert_not_null(f);
    fprintf(f, "{\"metadata\": {}, \"weight_map\": {");
    for (int64_t i = 0; i < n_listed; i++) {
        int64_t at = 0;
        while (at < n && strcmp(ts[at].name, listed[i]) != 0) at++;
        fprintf(f, "%s\"%s\": \"%s\"", i ? ", " : "", listed[i], shard[at < half ? 0 : 1]);
    }
    fprintf(f, "}}\n");
    cr_assert_eq(fclose(f), 0);
}

Test(checkpoint, sharded_index_loads, .init = make_tmpdir, .fini = remove_tmpdir) {
    run a = make_run(1, 0, 1), b = make_run(2, 0, 1);
    scramble(&a, 4, 0);
    tt ts[MAX_TENSORS];
    const int64_t n = model_tts(ts, &a);
    const char *names[MAX_TENSORS];
    for (int64_t i = 0; i < n; i++) names[i] = ts[i].name;
    const char *dir = fresh_dir("sharded");
    write_sharded(dir, ts, n, n / 2, names, n);
    load_weights(&b, dir);
    expect_bits(moe_model_params(b.model), moe_model_params(a.model), n_params(&a), "sharded");
    free_run(&a);
    free_run(&b);
}

/* The weight_map is the list of tensors: one it leaves out is reported
 * against the index (not against a shard that lacks it), and a shard tensor
 * it does not list is refused, as the same tensor in a single file is. */
Test(checkpoint, sharded_index_is_the_list, .init = make_tmpdir, .fini = remove_tmpdir) {
    run a = make_run(1, 0, 0), b = make_run(2, 0, 0);
    scramble(&a, 5, 0);
    scramble(&b, 6, 0);
    float *before = copy_floats(moe_model_params(b.model), n_params(&b));
    tt ts[MAX_TENSORS];
    int64_t n = model_tts(ts, &a);
    const char *names[MAX_TENSORS + 1];
    for (int64_t i = 0; i < n; i++) names[i] = ts[i].name;
    const char *dir = fresh_dir("sharded");
    char index[768], first[768], second[768]; /* in_dir's ring is reused by write_sharded */
    snprintf(index, sizeof index, "%s", in_dir(dir, "model.safetensors.index.json"));
    snprintf(first, sizeof first, "%s", in_dir(dir, "model-00001-of-00002.safetensors"));
    snprintf(second, sizeof second, "%s", in_dir(dir, "model-00002-of-00002.safetensors"));

    /* model.norm.weight (in the second shard) left out of the map. */
    int64_t norm = 0;
    while (strcmp(names[norm], "model.norm.weight") != 0) norm++;
    cr_assert_geq(norm, n / 2, "model.norm.weight should be in the second shard");
    const char *without[MAX_TENSORS];
    for (int64_t i = 0, k = 0; i < n; i++)
        if (i != norm) without[k++] = names[i];
    write_sharded(dir, ts, n, n / 2, without, n - 1);
    expect_error(moe_checkpoint_load_weights(b.model, dir), second, "tensor 'model.norm.weight' is not in the weight_map");
    cr_assert(strstr(moe_last_error(), index) != NULL, "%s", moe_last_error());

    /* Left out of the map and of the shards too: the index is named, also
     * when the map names one shard only. */
    tt fewer[MAX_TENSORS];
    memcpy(fewer, ts, sizeof ts);
    const int64_t nf = drop_tt(fewer, n, "model.norm.weight");
    for (int shards = 2; shards >= 1; shards--) {
        write_sharded(dir, fewer, nf, shards == 2 ? n / 2 : nf, without, n - 1);
        expect_error(moe_checkpoint_load_weights(b.model, dir), index, "no tensor 'model.norm.weight'");
    }

    /* A shard tensor the map does not list, and one the model lacks that
     * the map does list: each refused, naming the shard. */
    float junk[4] = {0};
    ts[n] = make_tt("zzz.extra", 1, (int64_t[]){4}, junk);
    write_sharded(dir, ts, n + 1, n / 2, names, n);
    expect_error(moe_checkpoint_load_weights(b.model, dir), second, "tensor 'zzz.extra' is not in the weight_map");
    names[n] = "zzz.extra";
    write_sharded(dir, ts, n + 1, n / 2, names, n + 1);
    expect_error(moe_checkpoint_load_weights(b.model, dir), second, "tensor 'zzz.extra' is not part of this model");

    /* A tensor in both shards, the map naming the first. */
    tt twice[MAX_TENSORS];
    twice[0] = ts[norm];
    memcpy(&twice[1], ts, (size_t)n * sizeof *ts);
    write_sharded(dir, twice, n + 1, n / 2 + 1, names, n);
    expect_error(moe_checkpoint_load_weights(b.model, dir), second,
                 "tensor 'model.norm.weight' is there too, but the weight_map");
    cr_assert(strstr(moe_last_error(), first) != NULL, "%s", moe_last_error());

    expect_bits(moe_model_params(b.model), before, n_params(&b), "params after failed loads");
    free(before);
    free_run(&a);
    free_run(&b);
}

/* A NaN or an infinity in the weights is refused at load, naming the file,
 * the tensor and the element; it used to load and show only as a NaN loss. */
Test(checkpoint, non_finite_weights_are_refused, .init = make_tmpdir, .fini = remove_tmpdir) {
    run a = make_run(1, 0, 0), b = make_run(2, 0, 0);
    scramble(&a, 7, 0);
    scramble(&b, 8, 0);
    set_exact_params(&a);
    float *before = copy_floats(moe_model_params(b.model), n_params(&b));
    tt ts[MAX_TENSORS];
    const int64_t n = model_tts(ts, &a);
    const char *dir = fresh_dir("nonfinite");
    const char *file = in_dir(dir, "model.safetensors");
    const struct {
        const char *tensor, *dtype;
        int64_t element;
        float value;
        const char *want;
    } cases[] = {
        {"model.embed_tokens.weight", "F32", 5, NAN, "tensor 'model.embed_tokens.weight' element 5 is nan"},
        {"model.embed_tokens.weight", "F32", 0, -NAN, "tensor 'model.embed_tokens.weight' element 0 is nan"},
        {"lm_head.weight", "BF16", VOCAB * D - 1, -INFINITY, "tensor 'lm_head.weight' element 175 is -inf"},
        {"model.layers.1.block_sparse_moe.experts.3.w2.weight", "BF16", 17, INFINITY,
         "tensor 'model.layers.1.block_sparse_moe.experts.3.w2.weight' element 17 is inf"},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        int64_t i = 0;
        while (strcmp(ts[i].name, cases[c].tensor) != 0) i++;
        float *bad = copy_floats(ts[i].data, tt_numel(&ts[i]));
        bad[cases[c].element] = cases[c].value;
        const float *good = ts[i].data;
        ts[i].data = bad;
        write_tts(file, ts, n, cases[c].dtype);
        ts[i].data = good;
        free(bad);
        expect_error(moe_checkpoint_load_weights(b.model, dir), file, cases[c].want);
    }
    expect_bits(moe_model_params(b.model), before, n_params(&b), "params after failed loads");
    /* Negative weights are fine, and the same file without the bad value loads. */
    write_tts(file, ts, n, "BF16");
    load_weights(&b, dir);
    expect_bits(moe_model_params(b.model), moe_model_params(a.model), n_params(&a), "clean file");
    free(before);
    free_run(&a);
    free_run(&b);
}

Test(checkpoint, selection_bias_missing_or_unused, .init = make_tmpdir, .fini = remove_tmpdir) {
    run off = make_run(1, 0, 0), on = make_run(2, 0.01, 0);
    char path[512];

    /* Saved without a bias, loaded with one on: the bias is zero. */
    moe_train_state s = scramble(&off, 21, 0);
    save(path, sizeof path, in_tmp("from_off"), &off, &s);
    scramble(&on, 22, 0);
    load_weights(&on, path);
    expect_bits(moe_model_params(on.model), moe_model_params(off.model), n_params(&off), "params");
    const float zeros[EXPERTS] = {0};
    for (int64_t l = 0; l < LAYERS; l++) expect_bits(moe_model_router_bias(on.model, l), zeros, EXPERTS, "bias");

    /* Saved with one, loaded without: ignored. */
    s = scramble(&on, 23, 0);
    save(path, sizeof path, in_tmp("from_on"), &on, &s);
    load_weights(&off, path);
    expect_bits(moe_model_params(off.model), moe_model_params(on.model), n_params(&off), "params");

    /* A bias of the wrong shape, or of a layer the model lacks. */
    tt ts[MAX_TENSORS];
    int64_t n = model_tts(ts, &on);
    const char *dir = fresh_dir("bad_bias");
    float wide[EXPERTS + 1] = {0};
    ts[n - 1] = make_tt(ts[n - 1].name, 1, (int64_t[]){EXPERTS + 1}, wide);
    write_tts(in_dir(dir, "model.safetensors"), ts, n, "F32");
    expect_error(moe_checkpoint_load_weights(on.model, dir),
                 "model.layers.1.block_sparse_moe.gate.e_score_correction_bias", "[5]");
    ts[n - 1] = make_tt("model.layers.2.block_sparse_moe.gate.e_score_correction_bias", 1, (int64_t[]){EXPERTS}, wide);
    write_tts(in_dir(dir, "model.safetensors"), ts, n, "F32");
    expect_error(moe_checkpoint_load_weights(off.model, dir),
                 "model.layers.2.block_sparse_moe.gate.e_score_correction_bias", "not part of this model");
    /* Numbers written otherwise than the model writes them name no tensor
     * of it, however sscanf reads them. */
    static const char *const odd[] = {"model.layers.+0.block_sparse_moe.gate.e_score_correction_bias",
                                      "model.layers.0.block_sparse_moe.experts.01.w1.weight",
                                      "model.layers. 1.block_sparse_moe.experts.1.w2.weight"};
    for (size_t i = 0; i < sizeof odd / sizeof *odd; i++) {
        ts[n - 1] = make_tt(odd[i], 1, (int64_t[]){EXPERTS}, wide);
        write_tts(in_dir(dir, "model.safetensors"), ts, n, "F32");
        expect_error(moe_checkpoint_load_weights(off.model, dir), odd[i], "not part of this model");
    }
    free_run(&off);
    free_run(&on);
}

/* ---------------------------------------------------------- bad input */

Test(checkpoint, corrupt_weights_are_refused, .init = make_tmpdir, .fini = remove_tmpdir) {
    run a = make_run(1, 0, 0), b = make_run(2, 0, 0);
    scramble(&a, 31, 0);
    scramble(&b, 32, 0);
    float *before = copy_floats(moe_model_params(b.model), n_params(&b));
    tt base[MAX_TENSORS], ts[MAX_TENSORS];
    const int64_t n = model_tts(base, &a);
    const char *dir = fresh_dir("bad");
    const char *file = in_dir(dir, "model.safetensors");
    float big[64] = {0};

    memcpy(ts, base, sizeof base);
    write_tts(file, ts, drop_tt(ts, n, "lm_head.weight"), "F32");
    expect_error(moe_checkpoint_load_weights(b.model, dir), "lm_head.weight", file);

    memcpy(ts, base, sizeof base);
    write_tts(file, ts, drop_tt(ts, n, "model.layers.1.block_sparse_moe.experts.2.w3.weight"), "F32");
    expect_error(moe_checkpoint_load_weights(b.model, dir), "model.layers.1.block_sparse_moe.experts.2.w3.weight",
                 file);

    memcpy(ts, base, sizeof base);
    for (int64_t i = 0; i < n; i++)
        if (strcmp(ts[i].name, "model.norm.weight") == 0) ts[i] = make_tt(ts[i].name, 1, (int64_t[]){D + 1}, big);
    write_tts(file, ts, n, "F32");
    expect_error(moe_checkpoint_load_weights(b.model, dir), "model.norm.weight", "[17]");

    memcpy(ts, base, sizeof base);
    for (int64_t i = 0; i < n; i++) /* [d, 1]: the same elements, but 2-D */
        if (strcmp(ts[i].name, "model.layers.0.input_layernorm.weight") == 0)
            ts[i] = make_tt(ts[i].name, 2, (int64_t[]){D, 1}, big);
    write_tts(file, ts, n, "F32");
    expect_error(moe_checkpoint_load_weights(b.model, dir), "model.layers.0.input_layernorm.weight", "[16, 1]");

    memcpy(ts, base, sizeof base);
    ts[n] = make_tt("model.layers.7.self_attn.q_proj.weight", 2, (int64_t[]){2, 2}, big);
    write_tts(file, ts, n + 1, "F32");
    expect_error(moe_checkpoint_load_weights(b.model, dir), "model.layers.7.self_attn.q_proj.weight", file);

    /* An optimizer tensor in the weights file is tolerated. */
    ts[n] = make_tt("optimizer.exp_avg.model.norm.weight", 1, (int64_t[]){D}, big);
    write_tts(file, ts, n + 1, "F32");
    scramble(&b, 32, 0);
    load_weights(&b, dir);
    expect_bits(moe_model_params(b.model), moe_model_params(a.model), n_params(&a), "with optimizer tensor");
    scramble(&b, 32, 0);

    /* Truncated: the last 4 bytes cut off. */
    size_t size;
    unsigned char *bytes = read_bytes(file, &size);
    write_bytes(file, bytes, size - 4);
    free(bytes);
    expect_error(moe_checkpoint_load_weights(b.model, dir), file, NULL);

    cr_assert_eq(remove(file), 0);
    expect_error(moe_checkpoint_load_weights(b.model, dir), dir, "holds neither");
    cr_expect(strstr(moe_last_error(), "checkpoints of a run") == NULL, "%s", moe_last_error());
    /* A run's folder: its checkpoints are named, the newest by its step
     * (step-1000000 after step-999999, whatever their names' order). */
    static const char *const steps[] = {"step-000100", "step-999999", "step-1000000", "step-12"};
    for (size_t i = 0; i < sizeof steps / sizeof *steps; i++) cr_assert_eq(mkdir(in_dir(dir, steps[i]), 0755), 0);
    expect_error(moe_checkpoint_load_weights(b.model, dir), "but checkpoints of a run: give one of them, e.g. the newest",
                 "/step-1000000");

    /* A directory that is not there, or a weights file linked to nothing,
     * is reported as that. */
    const char *absent = in_tmp("absent");
    expect_error(moe_checkpoint_load_weights(b.model, absent), absent, strerror(ENOENT));
    cr_assert_eq(symlink("gone.safetensors", file), 0);
    expect_error(moe_checkpoint_load_weights(b.model, dir), file, "dangling symbolic link");

    expect_bits(moe_model_params(b.model), before, n_params(&b), "params after failed loads");
    free(before);
    free_run(&a);
    free_run(&b);
}

typedef struct meta_case {
    const char *key;
    const char *value; /* NULL: the key is left out */
    const char *expect;
} meta_case;

/* train_state.safetensors of r's moments with meta, one key replaced or
 * dropped, and extra [n_extra] tensors; drop names a tensor to leave out. */
static void write_state(const char *path, run *r, const meta_case *change, const char *drop, const tt *extra,
                        int64_t n_extra) {
    const moe_st_meta base[] = {{"format_version", "1"}, {"step", "9"},       {"seed", "18446744073709551615"},
                                {"jitter_counter", "5"}, {"data_token", "64"}, {"data_epoch", "2"},
                                {"data_tokens", "4097"}, {"data_chunk", "64"}, {"data_shuffle_seed", "31"},
                                {"data_kind", "shards"},
                                {"pipe_layer_seconds", "0.0125"}, {"pipe_head_seconds", "0"}};
    enum { N_BASE = sizeof base / sizeof base[0] };
    moe_st_meta meta[N_BASE];
    int64_t nm = 0;
    for (int i = 0; i < N_BASE; i++) {
        if (change != NULL && strcmp(change->key, base[i].key) == 0) {
            if (change->value != NULL) meta[nm++] = (moe_st_meta){base[i].key, change->value};
        } else {
            meta[nm++] = base[i];
        }
    }
    const int64_t nt = moe_model_tensor_count(r->model);
    static char names[2 * MAX_TENSORS][160];
    moe_st_entry entries[2 * MAX_TENSORS + 4];
    int64_t n = 0;
    for (int64_t i = 0; i < 2 * nt; i++) {
        const moe_model_tensor *t = moe_model_tensor_at(r->model, i % nt);
        snprintf(names[i], sizeof names[i], "optimizer.%s.%s", i < nt ? "exp_avg" : "exp_avg_sq", t->name);
        if (drop != NULL && strcmp(names[i], drop) == 0) continue;
        const float *src = (i < nt ? moe_trainer_adam_m(r->trainer) : moe_trainer_adam_v(r->trainer)) + t->offset;
        entries[n++] = (moe_st_entry){names[i], src, t->ndim, t->shape};
    }
    for (int64_t i = 0; i < n_extra; i++)
        entries[n++] = (moe_st_entry){extra[i].name, extra[i].data, extra[i].ndim, extra[i].shape};
    cr_assert_eq(moe_st_write(path, entries, n, meta, nm), MOE_OK, "%s", moe_last_error());
}

Test(checkpoint, corrupt_state_is_refused, .init = make_tmpdir, .fini = remove_tmpdir) {
    run a = make_run(1, 0, 0), b = make_run(2, 0, 0);
    scramble(&a, 41, 9);
    scramble(&b, 42, 1);
    float *m_before = copy_floats(moe_trainer_adam_m(b.trainer), n_params(&b));
    const char *dir = fresh_dir("state");
    const char *file = in_dir(dir, "train_state.safetensors");
    moe_train_state got = {0};

    /* The writer here gives a valid file first: the cases below differ from
     * it by one thing each. */
    write_state(file, &a, NULL, NULL, NULL, 0);
    cr_assert_eq(moe_checkpoint_load_state(b.trainer, b.model, &got, dir), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(got.seed, UINT64_MAX);
    cr_expect_eq(got.step, 9);
    cr_expect_eq(got.data_shuffle_seed, 31);
    cr_expect(got.pipe_layer_seconds == 0.0125 && got.pipe_head_seconds == 0.0, "pipeline costs %g, %g",
              got.pipe_layer_seconds, got.pipe_head_seconds);
    expect_bits(moe_trainer_adam_m(b.trainer), moe_trainer_adam_m(a.trainer), n_params(&a), "exp_avg");
    /* A writer that never recorded the shuffle's seed shuffled by the seed. */
    const meta_case seed_shuffled = {"data_shuffle_seed", NULL, NULL};
    write_state(file, &a, &seed_shuffled, NULL, NULL, 0);
    cr_assert_eq(moe_checkpoint_load_state(b.trainer, b.model, &got, dir), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(got.data_shuffle_seed, UINT64_MAX);
    const meta_case last_epoch = {"data_epoch", "9223372036854775806", NULL};
    write_state(file, &a, &last_epoch, NULL, NULL, 0);
    cr_assert_eq(moe_checkpoint_load_state(b.trainer, b.model, &got, dir), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(got.data.epoch, MOE_DATA_EPOCH_MAX);
    memcpy(moe_trainer_adam_m(b.trainer), m_before, (size_t)n_params(&b) * sizeof(float));
    moe_trainer_set_steps_done(b.trainer, 1);

    const meta_case cases[] = {
        {"step", "12x", "\"step\""},
        {"step", "-1", "\"step\""},
        {"step", "", "\"step\""},
        {"step", "9223372036854775808", "\"step\""},
        {"seed", "18446744073709551616", "\"seed\""},
        {"data_epoch", " 3", "\"data_epoch\""},
        /* The next epoch would overflow the count. */
        {"data_epoch", "9223372036854775807", "\"data_epoch\" is \"9223372036854775807\", not an integer in [0, "
                                              "9223372036854775806]"},
        {"data_token", "0x10", "\"data_token\""},
        {"jitter_counter", NULL, "\"jitter_counter\""},
        {"format_version", "2", "\"format_version\""},
        {"format_version", NULL, "\"format_version\""},
        /* The stream's record comes whole or not at all (an older writer). */
        {"data_chunk", NULL, "\"data_chunk\""},
        {"data_tokens", NULL, "\"data_tokens\""},
        {"data_tokens", "-1", "\"data_tokens\""},
        {"data_kind", "tokens", "\"data_kind\""},
        {"data_shuffle_seed", "-3", "\"data_shuffle_seed\""},
        {"data_shuffle_seed", "18446744073709551616", "\"data_shuffle_seed\""},
        /* The pipeline's measured costs come whole, as finite seconds. */
        {"pipe_head_seconds", NULL, "\"pipe_head_seconds\" is missing"},
        {"pipe_layer_seconds", "0", "\"pipe_layer_seconds\" is \"0\", not a finite positive number of seconds"},
        {"pipe_layer_seconds", "nan", "\"pipe_layer_seconds\""},
        {"pipe_layer_seconds", "1e999", "\"pipe_layer_seconds\""},
        {"pipe_head_seconds", "-0.5", "\"pipe_head_seconds\""},
        {"pipe_head_seconds", "2ms", "\"pipe_head_seconds\""},
        {"pipe_layer_seconds", " 0.5", "\"pipe_layer_seconds\""},
        {"pipe_layer_seconds", "0.5 ", "\"pipe_layer_seconds\""},
        {"pipe_layer_seconds", "0x1p-4", "\"pipe_layer_seconds\" is \"0x1p-4\""},
        {"pipe_head_seconds", "+0.5", "\"pipe_head_seconds\" is \"+0.5\""},
        {"pipe_head_seconds", "[0.5]", "\"pipe_head_seconds\""},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        write_state(file, &a, &cases[i], NULL, NULL, 0);
        expect_error(moe_checkpoint_load_state(b.trainer, b.model, &got, dir), cases[i].expect, file);
    }

    write_state(file, &a, NULL, "optimizer.exp_avg_sq.model.norm.weight", NULL, 0);
    expect_error(moe_checkpoint_load_state(b.trainer, b.model, &got, dir), "optimizer.exp_avg_sq.model.norm.weight",
                 file);

    float junk[D * VOCAB] = {0};
    const tt extra[] = {make_tt("optimizer.exp_avg.model.layers.5.self_attn.q_proj.weight", 1, (int64_t[]){4}, junk),
                        make_tt("step_counter", 1, (int64_t[]){1}, junk)};
    for (int i = 0; i < 2; i++) {
        write_state(file, &a, NULL, NULL, &extra[i], 1);
        expect_error(moe_checkpoint_load_state(b.trainer, b.model, &got, dir), extra[i].name, file);
    }

    /* lm_head's moments transposed: same size, wrong shape. */
    const tt wrong = make_tt("optimizer.exp_avg.lm_head.weight", 2, (int64_t[]){D, VOCAB}, junk);
    write_state(file, &a, NULL, "optimizer.exp_avg.lm_head.weight", &wrong, 1);
    expect_error(moe_checkpoint_load_state(b.trainer, b.model, &got, dir), "optimizer.exp_avg.lm_head.weight",
                 "[16, 11]");

    write_state(file, &a, NULL, NULL, NULL, 0);
    size_t size;
    unsigned char *bytes = read_bytes(file, &size);
    write_bytes(file, bytes, size - 1);
    free(bytes);
    expect_error(moe_checkpoint_load_state(b.trainer, b.model, &got, dir), file, NULL);

    cr_expect_eq(moe_trainer_steps_done(b.trainer), 1, "steps changed by a failed load");
    expect_bits(moe_trainer_adam_m(b.trainer), m_before, n_params(&b), "exp_avg after failed loads");
    free(m_before);
    free_run(&a);
    free_run(&b);
}

/* A NaN or an infinity in either moment, or a negative second moment, is
 * refused at load, naming the element; they used to load and stop the run
 * steps later with a NaN gradient norm. -0 is a valid second moment. */
Test(checkpoint, bad_moments_are_refused, .init = make_tmpdir, .fini = remove_tmpdir) {
    run a = make_run(1, 0, 0), b = make_run(2, 0, 0);
    scramble(&a, 43, 9);
    scramble(&b, 44, 1);
    float *m_before = copy_floats(moe_trainer_adam_m(b.trainer), n_params(&b));
    float *v_before = copy_floats(moe_trainer_adam_v(b.trainer), n_params(&b));
    const char *dir = fresh_dir("moments");
    const char *file = in_dir(dir, "train_state.safetensors");
    moe_train_state got = {0};
    const moe_model_tensor *norm = NULL;
    for (int64_t i = 0; i < moe_model_tensor_count(a.model); i++)
        if (strcmp(moe_model_tensor_at(a.model, i)->name, "model.norm.weight") == 0) norm = moe_model_tensor_at(a.model, i);
    cr_assert_not_null(norm);
    const struct {
        const char *tensor;
        float value;
        const char *want; /* NULL: loads */
    } cases[] = {
        {"optimizer.exp_avg_sq.model.norm.weight", -1.0f,
         "tensor 'optimizer.exp_avg_sq.model.norm.weight' element 3 is -1 (a second moment must be >= 0)"},
        {"optimizer.exp_avg_sq.model.norm.weight", -INFINITY,
         "tensor 'optimizer.exp_avg_sq.model.norm.weight' element 3 is -inf"},
        {"optimizer.exp_avg_sq.model.norm.weight", NAN, "tensor 'optimizer.exp_avg_sq.model.norm.weight' element 3 is nan"},
        {"optimizer.exp_avg_sq.model.norm.weight", 0x1p-149f * -1.0f,
         "element 3 is -1.4013e-45 (a second moment must be >= 0)"},
        {"optimizer.exp_avg.model.norm.weight", INFINITY, "tensor 'optimizer.exp_avg.model.norm.weight' element 3 is inf"},
        {"optimizer.exp_avg.model.norm.weight", -5.0f, NULL},
        {"optimizer.exp_avg_sq.model.norm.weight", -0.0f, NULL},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const bool second = strstr(cases[c].tensor, "exp_avg_sq") != NULL;
        float values[D];
        memcpy(values, (second ? moe_trainer_adam_v(a.trainer) : moe_trainer_adam_m(a.trainer)) + norm->offset,
               sizeof values);
        values[3] = cases[c].value;
        const tt bad = make_tt(cases[c].tensor, 1, (int64_t[]){D}, values);
        write_state(file, &a, NULL, cases[c].tensor, &bad, 1);
        const moe_status st = moe_checkpoint_load_state(b.trainer, b.model, &got, dir);
        if (cases[c].want != NULL) {
            expect_error(st, file, cases[c].want);
            continue;
        }
        cr_assert_eq(st, MOE_OK, "%s: %s", cases[c].tensor, moe_last_error());
        const float *loaded = (second ? moe_trainer_adam_v(b.trainer) : moe_trainer_adam_m(b.trainer)) + norm->offset;
        expect_bits(loaded, values, D, cases[c].tensor);
        memcpy(moe_trainer_adam_m(b.trainer), m_before, (size_t)n_params(&b) * sizeof(float));
        memcpy(moe_trainer_adam_v(b.trainer), v_before, (size_t)n_params(&b) * sizeof(float));
        moe_trainer_set_steps_done(b.trainer, 1);
    }
    cr_expect_eq(moe_trainer_steps_done(b.trainer), 1, "steps changed by a failed load");
    expect_bits(moe_trainer_adam_m(b.trainer), m_before, n_params(&b), "exp_avg after failed loads");
    expect_bits(moe_trainer_adam_v(b.trainer), v_before, n_params(&b), "exp_avg_sq after failed loads");
    free(m_before);
    free(v_before);
    free_run(&a);
    free_run(&b);
}

/* Byte `byte` of path with `mask` xored into it, returning the byte as it
 * was. */
static unsigned char flip_byte(const char *path, int64_t byte, unsigned char mask) {
    size_t size;
    unsigned char *raw = read_bytes(path, &size);
    cr_assert_lt((size_t)byte, size);
    const unsigned char was = raw[byte];
    raw[byte] ^= mask;
    write_bytes(path, raw, size);
    free(raw);
    return was;
}

/* Where tensor name's element `element` starts in path. */
static int64_t element_offset(const char *path, const char *name, int64_t element) {
    moe_st_file *f;
    cr_assert_eq(moe_st_open(&f, path), MOE_OK, "%s", moe_last_error());
    const moe_st_tensor *t = moe_st_find(f, name);
    cr_assert_not_null(t, "%s has no %s", path, name);
    cr_assert(t->has_crc, "%s: '%s' has no checksum", path, name);
    const int64_t at = t->offset + 4 * element;
    moe_st_close(f);
    return at;
}

/* One flipped bit in a saved checkpoint is refused at load, naming the file
 * and the tensor or the metadata, and changes nothing: a weight 0.9998 that
 * became 3.4e38 (finite, so no value check sees it, and the run would have
 * died later of a NaN loss), a second moment's lowest bit, a digit of the
 * seed. The file put back loads. */
Test(checkpoint, flipped_bits_are_refused, .init = make_tmpdir, .fini = remove_tmpdir) {
    run a = make_run(1, 0, 0), b = make_run(2, 0, 0);
    const moe_train_state s = scramble(&a, 51, 3);
    scramble(&b, 52, 1);
    const moe_model_tensor *norm = NULL;
    for (int64_t i = 0; i < moe_model_tensor_count(a.model); i++)
        if (strcmp(moe_model_tensor_at(a.model, i)->name, "model.norm.weight") == 0) norm = moe_model_tensor_at(a.model, i);
    cr_assert_not_null(norm);
    moe_model_params(a.model)[norm->offset + 5] = 0.9998f;
    char path[512], model[768], state[768];
    save(path, sizeof path, tmpdir, &a, &s);
    snprintf(model, sizeof model, "%s", in_dir(path, "model.safetensors"));
    snprintf(state, sizeof state, "%s", in_dir(path, "train_state.safetensors"));
    float *p_before = copy_floats(moe_model_params(b.model), n_params(&b));
    float *v_before = copy_floats(moe_trainer_adam_v(b.trainer), n_params(&b));

    /* Bit 30 of 0.9998f (0x3F7FF2E5) is in its last byte. */
    const int64_t weight = element_offset(model, "model.norm.weight", 5);
    flip_byte(model, weight + 3, 0x40);
    size_t size;
    unsigned char *raw = read_bytes(model, &size);
    float damaged;
    memcpy(&damaged, raw + weight, sizeof damaged);
    free(raw);
    cr_assert(isfinite(damaged) && damaged > 1e38f, "the flipped weight is %g", damaged);
    expect_error(moe_checkpoint_load_weights(b.model, path), model,
                 "tensor 'model.norm.weight': its bytes' checksum is 0x");
    expect_bits(moe_model_params(b.model), p_before, n_params(&b), "params after a refused load");
    flip_byte(model, weight + 3, 0x40);
    load_weights(&b, path);
    expect_bits(moe_model_params(b.model), moe_model_params(a.model), n_params(&a), "params of the file put back");

    moe_train_state got = {0};
    const char *moment = "optimizer.exp_avg_sq.lm_head.weight";
    const int64_t at = element_offset(state, moment, 7);
    flip_byte(state, at, 0x01);
    char want[256];
    snprintf(want, sizeof want, "tensor '%s': its bytes' checksum is 0x", moment);
    expect_error(moe_checkpoint_load_state(b.trainer, b.model, &got, path), state, want);
    flip_byte(state, at, 0x01);

    /* The seed's first digit, one bit off, is still a digit: only the
     * header's checksum sees it. */
    raw = read_bytes(state, &size);
    const char *key = "\"seed\":\"";
    int64_t digit = -1;
    for (size_t i = 8; digit < 0 && i + strlen(key) < size; i++)
        if (memcmp(raw + i, key, strlen(key)) == 0) digit = (int64_t)(i + strlen(key));
    free(raw);
    cr_assert_geq(digit, 0, "no seed in %s", state);
    flip_byte(state, digit, 0x01);
    expect_error(moe_checkpoint_read_state(&got, path), state, "the header's checksum is 0x");
    expect_error(moe_checkpoint_load_state(b.trainer, b.model, &got, path), state, "metadata or a tensor name");
    cr_expect_eq(moe_trainer_steps_done(b.trainer), 1, "steps changed by a refused load");
    expect_bits(moe_trainer_adam_v(b.trainer), v_before, n_params(&b), "exp_avg_sq after refused loads");
    flip_byte(state, digit, 0x01);
    cr_assert_eq(moe_checkpoint_load_state(b.trainer, b.model, &got, path), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(got.seed, s.seed);
    expect_bits(moe_trainer_adam_v(b.trainer), moe_trainer_adam_v(a.trainer), n_params(&a), "exp_avg_sq put back");

    /* config.json's checksum is the train state's: a digit one bit off
     * (rms_norm_eps 1e-05 to 1e-04) is still a config, of another model. */
    char config[768];
    snprintf(config, sizeof config, "%s", in_dir(path, "config.json"));
    raw = read_bytes(config, &size);
    const char *eps = "1e-05";
    int64_t e = -1;
    for (size_t i = 0; e < 0 && i + strlen(eps) <= size; i++)
        if (memcmp(raw + i, eps, strlen(eps)) == 0) e = (int64_t)(i + strlen(eps) - 1);
    free(raw);
    cr_assert_geq(e, 0, "no rms_norm_eps 1e-05 in %s", config);
    moe_model_config cfg;
    cr_assert_eq(moe_checkpoint_load_config(&cfg, path, true, NULL, NULL), MOE_OK, "%s", moe_last_error());
    flip_byte(config, e, '5' ^ '4');
    expect_error(moe_checkpoint_load_config(&cfg, path, true, NULL, NULL), config, "train_state.safetensors recorded");
    cr_expect_eq(moe_model_config_load(&cfg, config, NULL, NULL), MOE_OK, "the damage is a valid config: %s",
                 moe_last_error());
    /* Not resuming, the config is used as it is, with a warning. */
    int warnings = 0;
    cr_expect_eq(moe_checkpoint_load_config(&cfg, path, false, count_warning, &warnings), MOE_OK, "%s",
                 moe_last_error());
    cr_expect_eq(warnings, 1, "a changed config was not warned about");
    cr_expect_eq(cfg.rms_norm_eps, 1e-4);
    flip_byte(config, e, '5' ^ '4');
    cr_expect_eq(moe_checkpoint_load_config(&cfg, path, true, NULL, NULL), MOE_OK, "%s", moe_last_error());
    /* The same config laid out anew (a tool's rewrite) reads alike. */
    raw = read_bytes(config, &size);
    for (size_t i = 0; i < size; i++)
        if (raw[i] == '\n') raw[i] = ' ';
    write_bytes(config, raw, size);
    free(raw);
    cr_expect_eq(moe_checkpoint_load_config(&cfg, path, true, count_warning, &warnings), MOE_OK, "%s",
                 moe_last_error());
    cr_expect_eq(warnings, 1, "a config laid out anew was warned about");
    /* Without the state (a model alone) there is nothing to check against. */
    flip_byte(config, e, '5' ^ '4');
    cr_assert_eq(unlink(state), 0);
    cr_expect_eq(moe_checkpoint_load_config(&cfg, path, true, NULL, NULL), MOE_OK, "%s", moe_last_error());
    free(p_before);
    free(v_before);
    free_run(&a);
    free_run(&b);
}

/* A config.json that an earlier moe wrote otherwise than this one writes
 * the model it reads (a model of dense layers only, saved as type moe,
 * is a Llama now): the file is the one saved, so a resume reads it, with
 * a note; once changed it is refused as before. */
Test(checkpoint, config_written_by_an_earlier_moe_resumes, .init = make_tmpdir, .fini = remove_tmpdir) {
    const char *dir = fresh_dir("earlier");
    char config[768], state[768];
    snprintf(config, sizeof config, "%s", in_dir(dir, "config.json"));
    snprintf(state, sizeof state, "%s", in_dir(dir, "train_state.safetensors"));
    const char text[] = "{\n  \"model_type\": \"moe\",\n  \"vocab_size\": 100,\n  \"hidden_size\": 64,\n"
                        "  \"intermediate_size\": 32,\n  \"moe_dense_intermediate_size\": 96,\n"
                        "  \"num_hidden_layers\": 2,\n  \"moe_dense_layers\": [0, 1],\n"
                        "  \"num_attention_heads\": 4,\n  \"num_key_value_heads\": 2,\n"
                        "  \"num_local_experts\": 8,\n  \"num_experts_per_tok\": 2,\n"
                        "  \"max_position_embeddings\": 2048,\n  \"rms_norm_eps\": 1e-05\n}\n";
    write_bytes(config, text, strlen(text));
    char crc[16];
    snprintf(crc, sizeof crc, "%" PRIu32, moe_crc32c(0, text, strlen(text)));
    const moe_st_meta meta[] = {{"config_crc32c", crc}};
    cr_assert_eq(moe_st_write(state, NULL, 0, meta, 1), MOE_OK, "%s", moe_last_error());

    moe_model_config cfg, plain;
    cr_assert_eq(moe_model_config_load(&plain, config, NULL, NULL), MOE_OK, "%s", moe_last_error());
    uint32_t now, read;
    cr_assert_eq(moe_model_config_crc32c(&plain, &now), MOE_OK);
    cr_assert_neq(now, moe_crc32c(0, text, strlen(text)), "this moe writes the model as the file has it");
    int warnings = 0;
    cr_assert_eq(moe_checkpoint_load_config(&cfg, dir, true, count_warning, &warnings), MOE_OK, "%s",
                 moe_last_error());
    cr_expect_eq(warnings, 1, "the other form goes unsaid");
    cr_assert_eq(moe_model_config_crc32c(&cfg, &read), MOE_OK);
    cr_expect_eq(read, now, "read otherwise than moe_model_config_load reads it");
    cr_expect_str_eq(moe_model_config_model_type(&cfg), "llama");

    /* rms_norm_eps 1e-05 to 1e-04: changed since. */
    const char *eps = strstr(text, "1e-05");
    flip_byte(config, (int64_t)(eps - text) + 4, '5' ^ '4');
    expect_error(moe_checkpoint_load_config(&cfg, dir, true, NULL, NULL), config, "train_state.safetensors recorded");
}

/* ------------------------------------------------------------- atomicity */

typedef struct snapshot {
    unsigned char *bytes[3];
    size_t size[3];
} snapshot;

static const char *const files[3] = {"model.safetensors", "config.json", "train_state.safetensors"};

static snapshot take_snapshot(const char *dir) {
    snapshot s;
    for (int i = 0; i < 3; i++) s.bytes[i] = read_bytes(in_dir(dir, files[i]), &s.size[i]);
    return s;
}

static void expect_snapshot(const char *dir, snapshot *want) {
    for (int i = 0; i < 3; i++) {
        size_t size;
        unsigned char *got = read_bytes(in_dir(dir, files[i]), &size);
        cr_expect(size == want->size[i] && memcmp(got, want->bytes[i], size) == 0, "%s/%s changed", dir, files[i]);
        free(got);
        free(want->bytes[i]);
    }
}

/* Makes every write past `bytes` of a file fail with EFBIG, even for root
 * (RLIMIT_FSIZE binds everyone; only raising it needs privilege, and the
 * hard limit is untouched). */
static void limit_file_size(rlim_t bytes) {
    struct rlimit rl;
    cr_assert_eq(getrlimit(RLIMIT_FSIZE, &rl), 0);
    rl.rlim_cur = bytes;
    signal(SIGXFSZ, SIG_IGN);
    cr_assert_eq(setrlimit(RLIMIT_FSIZE, &rl), 0);
}

static void unlimit_file_size(void) {
    struct rlimit rl;
    cr_assert_eq(getrlimit(RLIMIT_FSIZE, &rl), 0);
    rl.rlim_cur = rl.rlim_max;
    cr_assert_eq(setrlimit(RLIMIT_FSIZE, &rl), 0);
}

/* The model and config files fit under the limit, train_state (twice the
 * weights) does not: the save fails on its last file. */
static void fail_after_weights(const char *ckpt) {
    struct stat sb;
    cr_assert_eq(stat(in_dir(ckpt, "model.safetensors"), &sb), 0);
    limit_file_size((rlim_t)sb.st_size + 64);
}

Test(checkpoint, failed_save_keeps_previous, .init = make_tmpdir, .fini = remove_tmpdir) {
    run a = make_run(1, 0, 0), b = make_run(2, 0, 0);
    const char *out = in_tmp("out");
    char path[512], p3[512];
    moe_train_state s = scramble(&a, 51, 3);
    save(p3, sizeof p3, out, &a, &s);
    float *saved = copy_floats(moe_model_params(a.model), n_params(&a));
    snapshot snap = take_snapshot(p3);

    fail_after_weights(p3);
    s = scramble(&a, 52, 3);
    expect_error(moe_checkpoint_save(path, sizeof path, out, a.model, a.trainer, &s), "train_state.safetensors",
                 "step-000003");
    s = scramble(&a, 53, 4);
    expect_error(moe_checkpoint_save(path, sizeof path, out, a.model, a.trainer, &s), "train_state.safetensors",
                 "step-000004");
    unlimit_file_size();

    expect_snapshot(p3, &snap);
    cr_expect_eq(count_entries(out, "."), 0, "a temp directory was left in %s", out);
    cr_expect_eq(count_entries(out, "step-"), 1);
    load_weights(&b, p3);
    expect_bits(moe_model_params(b.model), saved, n_params(&a), "previous checkpoint");

    /* A regular file where the step directory goes is refused, untouched. */
    write_bytes(in_dir(out, "step-000004"), "keep", 4);
    expect_error(moe_checkpoint_save(path, sizeof path, out, a.model, a.trainer, &s), "step-000004",
                 "not a directory");
    size_t size;
    unsigned char *bytes = read_bytes(in_dir(out, "step-000004"), &size);
    cr_expect(size == 4 && memcmp(bytes, "keep", 4) == 0);
    free(bytes);
    cr_expect_eq(count_entries(out, "."), 0);
    free(saved);
    free_run(&a);
    free_run(&b);
}

Test(checkpoint, resave_replaces_and_clears_leftovers, .init = make_tmpdir, .fini = remove_tmpdir) {
    run a = make_run(1, 0, 0), b = make_run(2, 0, 0);
    const char *out = in_tmp("out");
    char path[512], leftover[512];
    const long pid = (long)getpid();

    /* The same step saved twice: the second replaces the first. */
    moe_train_state s = scramble(&a, 61, 2);
    save(path, sizeof path, out, &a, &s);
    s = scramble(&a, 62, 2);
    save(path, sizeof path, out, &a, &s);
    load_weights(&b, path);
    expect_bits(moe_model_params(b.model), moe_model_params(a.model), n_params(&a), "re-saved step");
    cr_expect_eq(count_entries(out, ""), 1);

    /* A temp directory left by a dead process with our pid. */
    snprintf(leftover, sizeof leftover, "%s/.step-000005.tmp-%ld", out, pid);
    cr_assert_eq(moe_mkdir_p(leftover), MOE_OK);
    write_bytes(in_dir(leftover, "model.safetensors"), "half", 4);
    s = scramble(&a, 63, 5);
    save(path, sizeof path, out, &a, &s);
    cr_expect_eq(count_entries(out, "."), 0);

    /* A copy set aside by a process that died before its replacement was in
     * place is moved back, and survives a failed save. */
    s = scramble(&a, 64, 6);
    save(path, sizeof path, out, &a, &s);
    float *saved = copy_floats(moe_model_params(a.model), n_params(&a));
    snapshot snap = take_snapshot(path);
    snprintf(leftover, sizeof leftover, "%s/.step-000006.old-%ld", out, pid);
    cr_assert_eq(rename(path, leftover), 0);
    fail_after_weights(leftover);
    s = scramble(&a, 65, 6);
    cr_expect_neq(moe_checkpoint_save(path, sizeof path, out, a.model, a.trainer, &s), MOE_OK);
    unlimit_file_size();
    const char *step6 = in_dir(out, "step-000006");
    expect_snapshot(step6, &snap);
    cr_expect_eq(count_entries(out, "."), 0);
    load_weights(&b, step6);
    expect_bits(moe_model_params(b.model), saved, n_params(&a), "restored step");

    /* With the limit gone the save goes through and replaces it. */
    save(path, sizeof path, out, &a, &s);
    load_weights(&b, path);
    expect_bits(moe_model_params(b.model), moe_model_params(a.model), n_params(&a), "replaced step");
    cr_expect_eq(count_entries(out, "."), 0);
    cr_expect_eq(count_entries(out, "step-"), 3);
    free(saved);
    free_run(&a);
    free_run(&b);
}
