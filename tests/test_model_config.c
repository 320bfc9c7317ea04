/* config.json: the real Mixtral-8x7B file, defaults as transformers' MixtralConfig
 * fills them, every bad field, save -> load round trips, and the model's
 * initial weights from initializer_range. */
#define _XOPEN_SOURCE 700

#include <criterion/criterion.h>
#include <ftw.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/rng.h"
#include "common/status.h"
#include "engine/fileio.h"
#include "engine/grid.h"
#include "engine/json.h"
#include "engine/model.h"
#include "engine/model_config.h"

/* mistralai/Mixtral-8x7B-v0.1 config.json, verbatim. */
static const char mixtral_8x7b[] = "{\n"
                                   "  \"architectures\": [\n"
                                   "    \"MixtralForCausalLM\"\n"
                                   "  ],\n"
                                   "  \"attention_dropout\": 0.0,\n"
                                   "  \"bos_token_id\": 1,\n"
                                   "  \"eos_token_id\": 2,\n"
                                   "  \"hidden_act\": \"silu\",\n"
                                   "  \"hidden_size\": 4096,\n"
                                   "  \"initializer_range\": 0.02,\n"
                                   "  \"intermediate_size\": 14336,\n"
                                   "  \"max_position_embeddings\": 32768,\n"
                                   "  \"model_type\": \"mixtral\",\n"
                                   "  \"num_attention_heads\": 32,\n"
                                   "  \"num_experts_per_tok\": 2,\n"
                                   "  \"num_hidden_layers\": 32,\n"
                                   "  \"num_key_value_heads\": 8,\n"
                                   "  \"num_local_experts\": 8,\n"
                                   "  \"output_router_logits\": false,\n"
                                   "  \"rms_norm_eps\": 1e-05,\n"
                                   "  \"rope_theta\": 1000000.0,\n"
                                   "  \"router_aux_loss_coef\": 0.02,\n"
                                   "  \"sliding_window\": null,\n"
                                   "  \"tie_word_embeddings\": false,\n"
                                   "  \"torch_dtype\": \"bfloat16\",\n"
                                   "  \"transformers_version\": \"4.36.0.dev0\",\n"
                                   "  \"use_cache\": true,\n"
                                   "  \"vocab_size\": 32000\n"
                                   "}\n";

typedef struct warnings {
    int count;
    char text[8][512];
} warnings;

static void collect(void *ctx, const char *message) {
    warnings *w = ctx;
    if (w->count < 8) snprintf(w->text[w->count], sizeof w->text[0], "%s", message);
    w->count++;
}

static bool warned(const warnings *w, const char *want) {
    for (int i = 0; i < w->count && i < 8; i++)
        if (strstr(w->text[i], want) != NULL) return true;
    return false;
}

static moe_status parse(moe_model_config *cfg, const char *text, warnings *w) {
    return moe_model_config_parse(cfg, text, strlen(text), "t/config.json", w != NULL ? collect : NULL, w);
}

Test(model_config, mixtral_8x7b) {
    moe_model_config c;
    warnings w = {0};
    cr_assert_eq(parse(&c, mixtral_8x7b, &w), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(w.count, 0, "warned: %s", w.text[0]);
    cr_expect_eq(c.vocab_size, 32000);
    cr_expect_eq(c.hidden_size, 4096);
    cr_expect_eq(c.intermediate_size, 14336);
    cr_expect_eq(c.num_hidden_layers, 32);
    cr_expect_eq(c.num_attention_heads, 32);
    cr_expect_eq(c.num_key_value_heads, 8);
    cr_expect_eq(c.head_dim, 128, "head_dim = hidden / heads");
    cr_expect_eq(c.num_local_experts, 8);
    cr_expect_eq(c.num_experts_per_tok, 2);
    cr_expect_eq(c.max_position_embeddings, 32768);
    cr_expect_eq(c.sliding_window, 0, "null: none");
    cr_expect_eq(c.rope_theta, 1e6);
    cr_expect_eq(c.rms_norm_eps, 1e-5);
    cr_expect_eq(c.router_aux_loss_coef, 0.02);
    cr_expect_eq(c.router_jitter_noise, 0.0);
    cr_expect_eq(c.initializer_range, 0.02);
    cr_expect_eq(c.moe_gate, MOE_GATE_SOFTMAX_TOPK);
    cr_expect(c.moe_renormalize);
    cr_expect_eq(c.moe_capacity_factor, 0.0);
    cr_expect_eq(c.moe_z_loss_coef, 0.0);
    cr_expect_eq(c.moe_n_shared_experts, 0);
    cr_expect_eq(c.moe_bias_update_rate, 0.0);

    moe_layer_config l;
    moe_model_config_layer(&l, &c, 64, 77);
    cr_expect_eq(l.d_model, 4096);
    cr_expect_eq(l.d_ff, 14336);
    cr_expect_eq(l.n_experts, 8);
    cr_expect_eq(l.top_k, 2);
    cr_expect_eq(l.gate, MOE_GATE_SOFTMAX_TOPK);
    cr_expect_eq(l.renormalize, 1);
    cr_expect_eq(l.aux_loss_coef, 0.02);
    cr_expect_eq(l.jitter_eps, 0.0);
    cr_expect_eq(l.seed, 77);
}

/* The keys every test config has; one case replaces, removes or adds one.
 * num_key_value_heads is given: absent, transformers' default is 8. */
static const char *const base_keys[][2] = {
    {"vocab_size", "100"},          {"hidden_size", "64"},       {"intermediate_size", "128"},
    {"num_hidden_layers", "2"},     {"num_attention_heads", "4"}, {"num_key_value_heads", "4"},
    {"num_local_experts", "8"},     {"num_experts_per_tok", "2"},
};
#define N_BASE (sizeof base_keys / sizeof *base_keys)

/* The base config with key set to value (NULL: removed), in a static buffer. */
static const char *config_with(const char *key, const char *value) {
    static char buf[2048];
    size_t n = (size_t)snprintf(buf, sizeof buf, "{");
    bool replaced = false;
    for (size_t i = 0; i < N_BASE; i++) {
        const char *v = base_keys[i][1];
        if (key != NULL && strcmp(key, base_keys[i][0]) == 0) {
            replaced = true;
            v = value;
            if (v == NULL) continue;
        }
        n += (size_t)snprintf(buf + n, sizeof buf - n, "%s\"%s\": %s", n > 1 ? ", " : "", base_keys[i][0], v);
    }
    if (key != NULL && !replaced) n += (size_t)snprintf(buf + n, sizeof buf - n, ", \"%s\": %s", key, value);
    snprintf(buf + n, sizeof buf - n, "}");
    return buf;
}

Test(model_config, defaults) {
    moe_model_config c;
    warnings w = {0};
    cr_assert_eq(parse(&c, config_with(NULL, NULL), &w), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(w.count, 0);
    cr_expect_eq(c.head_dim, 16);
    cr_expect_eq(c.max_position_embeddings, 131072);
    cr_expect_eq(c.rope_theta, 1e6);
    cr_expect_eq(c.rms_norm_eps, 1e-5);
    cr_expect_eq(c.router_aux_loss_coef, 0.001);
    cr_expect(c.moe_renormalize);
    cr_expect_eq(c.moe_routed_scaling_factor, 1.0);
    cr_expect_eq(c.moe_seq_aux_loss_coef, 0.0);
    cr_expect_eq(c.initializer_range, 0.02);
    cr_expect(!c.tie_word_embeddings);
    cr_assert_eq(parse(&c, config_with("tie_word_embeddings", "true"), &w), MOE_OK, "%s", moe_last_error());
    cr_expect(c.tie_word_embeddings);
    /* Gates that always normalise take moe_renormalize false as true, saying so. */
    cr_assert_eq(parse(&c, config_with("moe_renormalize", "false"), &w), MOE_OK, "%s", moe_last_error());
    cr_expect(!c.moe_renormalize && w.count == 0);
    const char *sigmoid = "{\"vocab_size\": 100, \"hidden_size\": 64, \"intermediate_size\": 128, "
                          "\"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"num_local_experts\": 8, "
                          "\"num_experts_per_tok\": 2, \"num_key_value_heads\": 4, \"moe_gate\": \"sigmoid\", "
                          "\"moe_renormalize\": false}";
    cr_assert_eq(parse(&c, sigmoid, &w), MOE_OK, "%s", moe_last_error());
    cr_expect(c.moe_renormalize);
    cr_expect(w.count == 1 && warned(&w, "moe_renormalize=false ignored: the sigmoid gate always normalises"),
              "%d warnings: %s", w.count, w.text[0]);
    w.count = 0;

    /* null means absent, as in transformers */
    cr_assert_eq(parse(&c, config_with("head_dim", "null"), &w), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(c.head_dim, 16);
    /* an explicit head_dim need not be hidden_size / num_attention_heads */
    const char *text = "{\"vocab_size\": 100, \"hidden_size\": 66, \"head_dim\": 24, \"intermediate_size\": 128, "
                       "\"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"num_key_value_heads\": 4, "
                       "\"num_local_experts\": 8, \"num_experts_per_tok\": 8, \"hidden_size_note\": 1}";
    cr_assert_eq(parse(&c, text, &w), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(c.head_dim, 24);
    cr_expect_eq(c.num_experts_per_tok, 8, "k = E is allowed");
    cr_expect_eq(w.count, 1);
    cr_expect(warned(&w, "t/config.json: unknown key 'hidden_size_note' ignored"), "%s", w.text[0]);
}

Test(model_config, rope_parameters_and_warnings) {
    moe_model_config c;
    warnings w = {0};
    cr_assert_eq(parse(&c, config_with("rope_parameters", "{\"rope_type\": \"default\", \"rope_theta\": 500000.0, "
                                                          "\"factor\": 2}"),
                       &w),
                 MOE_OK, "%s", moe_last_error());
    cr_expect_eq(c.rope_theta, 5e5);
    cr_expect(warned(&w, "unknown key 'rope_parameters.factor' ignored"), "%s", w.text[0]);

    w.count = 0;
    const char *both = "{\"vocab_size\": 100, \"hidden_size\": 64, \"intermediate_size\": 128, "
                       "\"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"num_key_value_heads\": 4, "
                       "\"num_local_experts\": 8, "
                       "\"num_experts_per_tok\": 2, \"rope_theta\": 10000, \"rope_parameters\": {\"rope_theta\": %s}, "
                       "\"attention_dropout\": 0.1, \"sliding_window\": 4096}";
    char text[1024];
    snprintf(text, sizeof text, both, "10000.0");
    cr_assert_eq(parse(&c, text, &w), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(c.rope_theta, 1e4);
    cr_expect_eq(w.count, 1);
    cr_expect(warned(&w, "attention_dropout=0.1 ignored"));
    cr_expect_eq(c.sliding_window, 4096, "Mistral's window is honoured, not ignored");
    snprintf(text, sizeof text, both, "20000");
    cr_expect_eq(parse(&c, text, &w), MOE_ERR_CONFIG);
    cr_expect(strstr(moe_last_error(), "rope_theta=10000 disagrees with rope_parameters.rope_theta=20000") != NULL,
              "%s", moe_last_error());

    /* Without a callback the warnings go nowhere, and parsing still works. */
    cr_expect_eq(moe_model_config_parse(&c, text, 0, NULL, NULL, NULL), MOE_ERR_CONFIG);
    cr_expect(strstr(moe_last_error(), "config.json:1:1: unexpected end of input") != NULL, "%s", moe_last_error());
    const char *unknown = config_with("zzz", "[1]");
    cr_expect_eq(moe_model_config_parse(&c, unknown, strlen(unknown), NULL, NULL, NULL), MOE_OK);
}

Test(model_config, every_bad_field_is_named) {
    const struct {
        const char *key, *value; /* value NULL: key removed */
        const char *want;
    } cases[] = {
        {"num_experts_per_tok", "9", "t/config.json: num_experts_per_tok=9 exceeds num_local_experts=8"},
        {"num_experts_per_tok", "0", "t/config.json: num_experts_per_tok=0 must be positive"},
        /* head_dim absent: hidden_size // num_attention_heads, which must
         * be positive and even. */
        {"hidden_size", "60",
         "t/config.json: head_dim is not given, and hidden_size=60 // num_attention_heads=4 = 15 (transformers' "
         "default) is not a positive even number"},
        {"hidden_size", "3", "hidden_size=3 // num_attention_heads=4 = 0 (transformers' default) is not a positive"},
        {"num_key_value_heads", "3", "num_attention_heads=4 is not a multiple of num_key_value_heads=3"},
        {"num_key_value_heads", NULL,
         "t/config.json: num_attention_heads=4 is not a multiple of num_key_value_heads=8 (absent: transformers' "
         "default)"},
        {"hidden_size", "0", "t/config.json: hidden_size=0 must be positive"},
        {"vocab_size", "-5", "t/config.json: vocab_size=-5 must be positive"},
        {"vocab_size", "3000000000", "vocab_size=3000000000 exceeds 2147483647"},
        {"vocab_size", "99999999999999999999",
         "t/config.json: vocab_size=99999999999999999999 is out of range (at most 9223372036854775807)"},
        {"vocab_size", "1000000000000000000000000000000",
         "t/config.json: vocab_size=1e+30 is out of range (at most 9223372036854775807)"},
        {"vocab_size", "9223372036854775808", "vocab_size=9223372036854775808 is out of range (at most"},
        {"num_hidden_layers", "-9223372036854775809",
         "t/config.json: num_hidden_layers=-9223372036854775809 is out of range (at least -9223372036854775808)"},
        {"vocab_size", "1e20",
         "t/config.json: vocab_size=1e20 is out of range (at most 9007199254740991 written with a fraction or "
         "exponent)"},
        {"sliding_window", "123456789012345678901234567890",
         "t/config.json: sliding_window=1.23457e+29 is out of range (at most 9223372036854775807)"},
        {"num_experts", "99999999999999999999", "t/config.json: num_experts=99999999999999999999 is out of range"},
        {"num_hidden_layers", "\"2\"", "t/config.json: num_hidden_layers must be an integer, got \"2\""},
        {"num_hidden_layers", "65537", "t/config.json: num_hidden_layers=65537 exceeds 65536"},
        {"intermediate_size", "128.5", "intermediate_size must be an integer, got 128.5"},
        {"hidden_size", "null", "hidden_size must be an integer, got null"},
        {"num_local_experts", NULL, "t/config.json: missing required key 'num_local_experts'"},
        {"vocab_size", NULL, "missing required key 'vocab_size'"},
        {"head_dim", "15", "head_dim=15 must be even"},
        {"max_position_embeddings", "0", "max_position_embeddings=0 must be positive"},
        {"rms_norm_eps", "0", "rms_norm_eps=0 must be > 0"},
        {"rms_norm_eps", "-1e-05", "rms_norm_eps=-1e-05 must be > 0"},
        {"rope_theta", "\"big\"", "rope_theta must be a number, got \"big\""},
        {"rope_theta", "0", "rope_theta=0 must be > 0"},
        {"router_aux_loss_coef", "-0.1", "router_aux_loss_coef=-0.1 must be finite and in [0, 1e+06]"},
        {"router_jitter_noise", "1.0", "router_jitter_noise=1 must be in [0, 1)"},
        {"tie_word_embeddings", "\"no\"", "tie_word_embeddings must be true or false, got \"no\""},
        {"hidden_act", "\"gelu\"", "hidden_act=\"gelu\" is not supported (only \"silu\" or \"swish\")"},
        {"hidden_act", "\"relu\"", "t/config.json: hidden_act=\"relu\" is not supported"},
        {"eos_token_id", "\"2\"", "t/config.json: eos_token_id must be an integer, a list of integers or null, got "
                                   "\"2\""},
        {"bos_token_id", "true", "t/config.json: bos_token_id must be an integer, a list of integers or null, got true"},
        {"eos_token_id", "[1, 2.5]", "t/config.json: eos_token_id[1] must be an integer, got 2.5"},
        {"eos_token_id", "[1, null]", "t/config.json: eos_token_id[1] must be an integer, got null"},
        {"pad_token_id", "{}", "pad_token_id must be an integer, a list of integers or null, got object"},
        {"pad_token_id", "99999999999999999999", "t/config.json: pad_token_id=99999999999999999999 is out of range"},
        {"model_type", "\"deepseek_v3\"", "model_type=\"deepseek_v3\" is not supported (only \"mixtral\", \"qwen3_moe\", "
                                           "\"olmoe\", \"qwen2_moe\", \"moe\", \"llama\", \"mistral\", \"qwen3\" or \"qwen2\")"},
        {"rope_scaling", "{\"type\": \"longrope\", \"factor\": 2}",
         "t/config.json: rope_scaling.rope_type=\"longrope\" is not supported (only \"default\", \"linear\", \"llama3\", "
         "\"yarn\" or \"dynamic\")"},
        {"rope_scaling", "{\"type\": \"dynamic\"}", "t/config.json: rope_scaling.factor is missing: rope_type \"dynamic\" needs it"},
        {"rope_parameters", "{\"rope_type\": \"yarn\"}",
         "t/config.json: rope_parameters.factor is missing: rope_type \"yarn\" needs it"},
        {"rope_scaling", "{\"rope_type\": \"llama3\", \"factor\": 8, \"low_freq_factor\": 1}",
         "t/config.json: rope_scaling.high_freq_factor is missing: rope_type \"llama3\" needs it"},
        {"rope_scaling", "{\"rope_type\": \"llama3\", \"factor\": 8, \"low_freq_factor\": 4, \"high_freq_factor\": 4}",
         "t/config.json: rope_scaling.high_freq_factor=4 must exceed low_freq_factor=4"},
        {"rope_scaling", "{\"rope_type\": \"linear\", \"factor\": 0}", "t/config.json: rope_scaling.factor=0 must be > 0"},
        {"rope_scaling", "{\"rope_type\": \"linear\", \"factor\": \"2\"}",
         "t/config.json: rope_scaling.factor must be a number, got \"2\""},
        {"rope_scaling", "{\"rope_type\": \"yarn\", \"factor\": 4, \"original_max_position_embeddings\": -1}",
         "t/config.json: rope_scaling.original_max_position_embeddings=-1 must be positive"},
        {"rope_scaling", "{\"rope_type\": \"yarn\", \"factor\": 4, \"truncate\": 1}",
         "t/config.json: rope_scaling.truncate must be true or false, got 1"},
        {"rope_scaling", "{\"rope_type\": \"yarn\", \"factor\": 4, \"mscale\": 1, \"mscale_all_dim\": -100}",
         "t/config.json: rope_scaling.attention_factor comes to"},
        {"rope_scaling", "{\"rope_type\": \"linear\", \"type\": \"yarn\", \"factor\": 2}",
         "t/config.json: rope_scaling.rope_type=\"linear\" disagrees with rope_scaling.type=\"yarn\""},
        {"rope_scaling", "{\"rope_type\": 3}", "t/config.json: rope_scaling.rope_type must be a string, got 3"},
        {"rope_parameters", "{\"rope_type\": \"linear\", \"factor\": 2, \"partial_rotary_factor\": 0.5}",
         "t/config.json: partial_rotary_factor=0.5 is not supported with rope_type \"linear\" (only 1: RoPE rotates "
         "the whole head)"},
        {"rope_scaling", "{\"rope_type\": \"yarn\", \"factor\": 4, \"attention_factor\": 0}",
         "t/config.json: rope_scaling.attention_factor=0 must be > 0"},
        {"original_max_position_embeddings", "0", "t/config.json: original_max_position_embeddings=0 must be positive"},
        {"rope_parameters", "5", "rope_parameters must be an object, got 5"},
        {"rope_parameters", "{\"rope_theta\": \"x\"}", "rope_parameters.rope_theta must be a number, got \"x\""},
        {"attention_dropout", "\"x\"", "attention_dropout must be a number"},
        {"sliding_window", "[]", "sliding_window must be an integer or null, got array"},
        {"sliding_window", "0", "t/config.json: sliding_window=0 must be positive, or null for none"},
        {"sliding_window", "-4096", "sliding_window=-4096 must be positive, or null for none"},
        {"sliding_window", "4096.5", "sliding_window must be an integer or null, got 4096.5"},
        {"moe_gate", "\"softmax\"",
         "moe_gate must be \"softmax_topk\", \"topk_softmax\" or \"sigmoid\", got \"softmax\""},
        {"moe_renormalize", "1", "moe_renormalize must be true or false, got 1"},
        {"moe_capacity_factor", "-1", "moe_capacity_factor=-1 must be finite and in [0, 1e+06]"},
        {"moe_z_loss_coef", "-1", "moe_z_loss_coef=-1 must be finite and in [0, 1e+06]"},
        {"moe_seq_aux_loss_coef", "-0.1", "moe_seq_aux_loss_coef=-0.1 must be finite and in [0, 1e+06]"},
        {"moe_seq_aux_loss_coef", "\"x\"", "moe_seq_aux_loss_coef must be a number"},
        {"moe_n_shared_experts", "-1", "moe_n_shared_experts=-1 must be in [0, 8388607]"},
        {"moe_bias_update_rate", "-0.5", "moe_bias_update_rate=-0.5 must be finite and in [0, 1e+06]"},
        {"moe_routed_scaling_factor", "0", "t/config.json: moe_routed_scaling_factor=0 must be in [1.17549e-38, 1e+06]"},
        {"moe_routed_scaling_factor", "-2.5", "moe_routed_scaling_factor=-2.5 must be in [1.17549e-38, 1e+06]"},
        {"moe_routed_scaling_factor", "1e-50", "moe_routed_scaling_factor=1e-50 must be in [1.17549e-38, 1e+06]"},
        {"moe_routed_scaling_factor", "1e7", "moe_routed_scaling_factor=1e+07 must be in [1.17549e-38, 1e+06]"},
        {"initializer_range", "0", "t/config.json: initializer_range=0 must be in [1.17549e-38, 1000]"},
        {"initializer_range", "-0.02", "t/config.json: initializer_range=-0.02 must be in [1.17549e-38, 1000]"},
        {"initializer_range", "1e-40", "t/config.json: initializer_range=1e-40 must be in [1.17549e-38, 1000]"},
        {"initializer_range", "2e4", "t/config.json: initializer_range=20000 must be in [1.17549e-38, 1000]"},
        {"initializer_range", "\"0.02\"", "t/config.json: initializer_range must be a number, got \"0.02\""},
        {"num_experts", "4", "t/config.json: num_experts=4 disagrees with num_local_experts=8"},
        {"num_experts", "\"8\"", "t/config.json: num_experts must be an integer, got \"8\""},
        {"num_experts", "8.5", "t/config.json: num_experts must be an integer, got 8.5"},
        {"moe_n_group", "3", "t/config.json: moe_n_group=3 must divide num_local_experts=8 and be at most 64"},
        {"moe_n_group", "-1", "t/config.json: moe_n_group=-1 must divide num_local_experts=8"},
        {"moe_n_group", "16", "t/config.json: moe_n_group=16 must divide num_local_experts=8"},
        /* The second key rides in the first one's value. */
        {"moe_n_group", "4, \"moe_topk_group\": 0", "t/config.json: moe_topk_group=0 must be in [1, moe_n_group=4]"},
        {"moe_n_group", "4, \"moe_topk_group\": 5", "moe_topk_group=5 must be in [1, moe_n_group=4]"},
        {"moe_n_group", "8, \"moe_topk_group\": 1",
         "t/config.json: moe_topk_group=1 groups of 1 experts cannot hold num_experts_per_tok=2"},
        {"moe_n_group", "1, \"moe_topk_group\": -5", "t/config.json: moe_topk_group=-5 needs moe_n_group > 1"},
        {"moe_topk_group", "4", "t/config.json: moe_topk_group=4 needs moe_n_group > 1 (moe_n_group=0: no groups"},
        {"rope_theta", "NaN", "t/config.json:1:"},
        /* Used as floats: 1e-50 rounds to 0 (NaN RoPE angles), 1e39 to infinity. */
        {"rope_theta", "1e-50", "t/config.json: rope_theta=1e-50 must be in [1.17549e-38, 3.40282e+38], a normal float"},
        {"rope_theta", "1e39", "t/config.json: rope_theta=1e+39 must be in [1.17549e-38, 3.40282e+38]"},
        {"rope_parameters", "{\"rope_theta\": 1e-40}",
         "t/config.json: rope_parameters.rope_theta=1e-40 must be in [1.17549e-38, 3.40282e+38]"},
        {"rms_norm_eps", "1e-50", "t/config.json: rms_norm_eps=1e-50 must be in [1.17549e-38, 3.40282e+38]"},
        {"hidden_size", "1e999", "number 1e999 is out of range"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        moe_model_config c;
        warnings w = {0};
        const char *text = config_with(cases[i].key, cases[i].value);
        moe_status st = parse(&c, text, &w);
        cr_expect_neq(st, MOE_OK, "accepted %s", text);
        cr_expect(strstr(moe_last_error(), cases[i].want) != NULL, "%s:\n  \"%s\"\n  lacks \"%s\"", text,
                  moe_last_error(), cases[i].want);
    }
    moe_model_config c;
    cr_expect_eq(parse(&c, "[]", NULL), MOE_ERR_CONFIG);
    cr_expect(strstr(moe_last_error(), "t/config.json: top level is a JSON array, not an object") != NULL, "%s",
              moe_last_error());
    cr_expect_eq(parse(&c, "{\"vocab_size\": 1, \"vocab_size\": 2}", NULL), MOE_ERR_CONFIG);
    cr_expect(strstr(moe_last_error(), "t/config.json:1:19: duplicate key \"vocab_size\"") != NULL, "%s",
              moe_last_error());
}

/* A string with a NUL would compare equal to its text before the NUL. */
Test(model_config, strings_with_nul_are_refused) {
    const struct {
        const char *key, *value, *want;
    } cases[] = {
        {"moe_gate", "\"sigmoid\\u0000junk\"", "t/config.json: moe_gate contains a NUL character"},
        {"hidden_act", "\"silu\\u0000gelu\"", "t/config.json: hidden_act contains a NUL character"},
        {"model_type", "\"mixtral\\u0000x\"", "t/config.json: model_type contains a NUL character"},
        {"rope_parameters", "{\"rope_type\": \"default\\u0000x\"}",
         "t/config.json: rope_parameters.rope_type contains a NUL character"},
        {"rope_parameters", "{\"rope_theta\\u0000x\": 10000}",
         "t/config.json: key \"rope_parameters.rope_theta...\" contains a NUL character"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        moe_model_config c;
        const char *text = config_with(cases[i].key, cases[i].value);
        moe_status st = parse(&c, text, NULL);
        cr_expect_eq(st, MOE_ERR_CONFIG, "%s: got %s (%s)", text, moe_status_string(st), moe_last_error());
        cr_expect(strstr(moe_last_error(), cases[i].want) != NULL, "%s:\n  \"%s\"\n  lacks \"%s\"", text,
                  moe_last_error(), cases[i].want);
    }
    /* The same strings without the NUL still read. */
    moe_model_config c;
    cr_expect_eq(parse(&c, config_with("moe_gate", "\"sigmoid\""), NULL), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(c.moe_gate, MOE_GATE_SIGMOID);
}

/* A bad rope_parameters.rope_theta is named by its own key, not by the
 * top-level rope_theta it is stored in. */
Test(model_config, rope_parameters_theta_is_named) {
    const char *values[] = {"-1", "0"};
    for (size_t i = 0; i < sizeof values / sizeof *values; i++) {
        char obj[64], want[96];
        snprintf(obj, sizeof obj, "{\"rope_theta\": %s}", values[i]);
        snprintf(want, sizeof want, "t/config.json: rope_parameters.rope_theta=%s must be > 0", values[i]);
        moe_model_config c;
        const char *text = config_with("rope_parameters", obj);
        cr_expect_eq(parse(&c, text, NULL), MOE_ERR_CONFIG, "accepted %s", text);
        cr_expect(strstr(moe_last_error(), want) != NULL, "%s:\n  \"%s\"\n  lacks \"%s\"", text, moe_last_error(),
                  want);
    }
}

/* transformers' ACT2FN computes "swish" as nn.SiLU: the same model as
 * "silu", read with no warning (it was refused). */
Test(model_config, swish_is_silu) {
    moe_model_config base, c;
    cr_assert_eq(parse(&base, config_with("hidden_act", "\"silu\""), NULL), MOE_OK, "%s", moe_last_error());
    warnings w = {0};
    cr_assert_eq(parse(&c, config_with("hidden_act", "\"swish\""), &w), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(w.count, 0, "warned: %s", w.text[0]);
    cr_expect(memcmp(&c, &base, sizeof c) == 0, "swish does not read as silu");
}

/* head_dim absent or null: transformers' Mixtral takes hidden_size //
 * num_attention_heads, rounded down (hidden_size 36 over 8 heads: 4), and
 * the model is then 8 x 4 wide in q and o; it was refused as not
 * divisible. */
Test(model_config, head_dim_rounds_down_as_transformers) {
    const char *const values[] = {NULL, "null"};
    for (size_t i = 0; i < sizeof values / sizeof *values; i++) {
        char text[512];
        snprintf(text, sizeof text,
                 "{\"vocab_size\": 100, \"hidden_size\": 36, \"intermediate_size\": 128, \"num_hidden_layers\": 2, "
                 "\"num_attention_heads\": 8, \"num_key_value_heads\": 4, \"num_local_experts\": 8, "
                 "\"num_experts_per_tok\": 2%s%s}",
                 values[i] ? ", \"head_dim\": " : "", values[i] ? values[i] : "");
        moe_model_config c;
        cr_assert_eq(parse(&c, text, NULL), MOE_OK, "%s: %s", text, moe_last_error());
        cr_expect_eq(c.head_dim, 4, "%s: head_dim %lld", text, (long long)c.head_dim);
        cr_expect_eq(c.hidden_size, 36);
    }
    moe_model_config c;
    cr_assert_eq(parse(&c, config_with("hidden_size", "66"), NULL), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(c.head_dim, 16, "66 // 4");
}

/* A RoPE type moe does not implement is refused by its rope_type alone:
 * transformers v5 writes rope_parameters' keys sorted, so "factor" comes
 * first, and would be warned about as unknown before the refusal. */
Test(model_config, rope_type_is_refused_before_any_warning) {
    const char *const params[] = {
        "{\"factor\": 2.0, \"rope_theta\": 10000.0, \"rope_type\": \"proportional\"}",
        "{\"factor\": 8.0, \"long_factor\": [1.0], \"original_max_position_embeddings\": 4096, "
        "\"rope_theta\": 10000.0, \"rope_type\": \"longrope\", \"short_factor\": [1.0]}",
    };
    const char *const want[] = {"t/config.json: rope_parameters.rope_type=\"proportional\" is not supported",
                                "t/config.json: rope_parameters.rope_type=\"longrope\" is not supported"};
    for (size_t i = 0; i < sizeof params / sizeof *params; i++) {
        moe_model_config c;
        warnings w = {0};
        const char *text = config_with("rope_parameters", params[i]);
        cr_expect_eq(parse(&c, text, &w), MOE_ERR_CONFIG, "accepted %s", text);
        cr_expect(strstr(moe_last_error(), want[i]) != NULL, "%s: %s", text, moe_last_error());
        cr_expect_eq(w.count, 0, "%s: warned before the refusal: %s", text, w.text[0]);
    }
}

/* Scaled RoPE as transformers reads it: rope_scaling (v4, "type" or
 * "rope_type") or rope_parameters (v5); original_max_position_embeddings
 * from a top-level key first, then the object's, then
 * max_position_embeddings; yarn's betas and truncate at their defaults; a
 * parameter of another type's warned about and ignored; the two objects
 * must agree where both are given. */
Test(model_config, scaled_rope_as_transformers_reads_it) {
    const struct {
        const char *key, *value, *extra; /* extra: more top-level keys */
        moe_rope_scaling want;
        const char *warning; /* NULL: none */
    } cases[] = {
        {"rope_scaling",
         "{\"factor\": 8.0, \"low_freq_factor\": 1.0, \"high_freq_factor\": 4.0, "
         "\"original_max_position_embeddings\": 8192, \"rope_type\": \"llama3\"}",
         "",
         {.type = MOE_ROPE_LLAMA3, .factor = 8, .low_freq_factor = 1, .high_freq_factor = 4,
          .original_max_position_embeddings = 8192},
         NULL},
        {"rope_parameters", "{\"rope_type\": \"yarn\", \"factor\": 4.0, \"rope_theta\": 1000000.0}",
         "\"max_position_embeddings\": 131072",
         {.type = MOE_ROPE_YARN, .factor = 4, .original_max_position_embeddings = 131072, .beta_fast = 32,
          .beta_slow = 1, .truncate = true},
         NULL},
        {"rope_scaling",
         "{\"type\": \"yarn\", \"factor\": 40, \"beta_fast\": 0, \"beta_slow\": 2, \"mscale\": 0.707, "
         "\"mscale_all_dim\": 1.0, \"truncate\": false, \"attention_factor\": null, "
         "\"original_max_position_embeddings\": 4096}",
         "\"original_max_position_embeddings\": 2048, \"max_position_embeddings\": 81920",
         {.type = MOE_ROPE_YARN, .factor = 40, .original_max_position_embeddings = 2048, .beta_fast = 32,
          .beta_slow = 2, .mscale = 0.707, .mscale_all_dim = 1.0},
         NULL},
        {"rope_scaling", "{\"type\": \"dynamic\", \"factor\": 2.0}", "", {.type = MOE_ROPE_DYNAMIC, .factor = 2}, NULL},
        {"rope_scaling", "{\"type\": \"linear\", \"factor\": 2.0, \"low_freq_factor\": 1.0}", "",
         {.type = MOE_ROPE_LINEAR, .factor = 2}, "unknown key 'rope_scaling.low_freq_factor' ignored"},
        {"rope_parameters", "{\"rope_type\": \"default\", \"partial_rotary_factor\": 1.0}",
         "\"original_max_position_embeddings\": 4096", {.type = MOE_ROPE_DEFAULT},
         "original_max_position_embeddings=4096 ignored: rope_type \"default\" does not use it"},
        /* transformers reads yarn's null truncate as false and derives a null factor from the context. */
        {"rope_scaling",
         "{\"type\": \"yarn\", \"factor\": null, \"truncate\": null, \"original_max_position_embeddings\": 1024}",
         "\"max_position_embeddings\": 4096",
         {.type = MOE_ROPE_YARN, .factor = 4, .original_max_position_embeddings = 1024, .beta_fast = 32,
          .beta_slow = 1},
         NULL},
        {"rope_scaling", "{\"type\": \"yarn\", \"factor\": 8, \"original_max_position_embeddings\": 1024}",
         "\"max_position_embeddings\": 4096",
         {.type = MOE_ROPE_YARN, .factor = 8, .original_max_position_embeddings = 1024, .beta_fast = 32,
          .beta_slow = 1, .truncate = true},
         "rope_scaling.factor=8 differs from max_position_embeddings / original_max_position_embeddings = 4"},
        /* {} is none, as in transformers; the top level's partial_rotary_factor is moved in. */
        {"rope_scaling", "{}", "\"rope_parameters\": {\"rope_type\": \"linear\", \"factor\": 2}",
         {.type = MOE_ROPE_LINEAR, .factor = 2}, NULL},
        {"rope_scaling", "null", "\"partial_rotary_factor\": 0.5",
         {.type = MOE_ROPE_DEFAULT},
         "partial_rotary_factor=0.5 ignored: transformers' Mixtral rotates the whole head with the default RoPE"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        char text[2048];
        snprintf(text, sizeof text, "%.*s%s%s}", (int)strlen(config_with(cases[i].key, cases[i].value)) - 1,
                 config_with(cases[i].key, cases[i].value), cases[i].extra[0] ? ", " : "", cases[i].extra);
        moe_model_config c;
        warnings w = {0};
        cr_assert_eq(parse(&c, text, &w), MOE_OK, "%s: %s", text, moe_last_error());
        char got[256], want[256];
        moe_rope_scaling_describe(got, sizeof got, &c.rope_scaling);
        moe_rope_scaling_describe(want, sizeof want, &cases[i].want);
        cr_expect(moe_rope_scaling_equal(&c.rope_scaling, &cases[i].want), "%s:\n  read %s\n  want %s", text, got,
                  want);
        if (cases[i].warning)
            cr_expect(w.count == 1 && warned(&w, cases[i].warning), "%s: warned %d: %s", text, w.count, w.text[0]);
        else
            cr_expect_eq(w.count, 0, "%s warned: %s", text, w.text[0]);
    }
    /* Where both objects are given, they name one scaling and one theta. */
    const char *const disagree[][2] = {
        {"\"rope_scaling\": {\"type\": \"linear\", \"factor\": 2.0}, \"rope_parameters\": {\"rope_type\": \"linear\", "
         "\"factor\": 2.0}",
         "rope_scaling and rope_parameters are both given, and transformers reads rope_scaling alone: keep one"},
        {"\"rope_scaling\": {\"type\": \"yarn\", \"factor\": 2.0}, \"partial_rotary_factor\": 0.5",
         "partial_rotary_factor=0.5 is not supported with rope_type \"yarn\""},
        {"\"rope_scaling\": {\"type\": \"linear\", \"factor\": 2.0, \"rope_theta\": 5.0}, \"rope_theta\": 10000.0",
         "rope_theta=10000 disagrees with rope_scaling.rope_theta=5"},
    };
    for (size_t i = 0; i < sizeof disagree / sizeof *disagree; i++) {
        char text[2048];
        const char *base = config_with(NULL, NULL);
        snprintf(text, sizeof text, "%.*s, %s}", (int)strlen(base) - 1, base, disagree[i][0]);
        moe_model_config c;
        cr_expect_eq(parse(&c, text, NULL), MOE_ERR_CONFIG, "accepted %s", text);
        cr_expect(strstr(moe_last_error(), disagree[i][1]) != NULL, "%s: %s", text, moe_last_error());
    }
    /* A dense Llama 3.1's file, as --upcycle reads it. */
    const char *llama = "{\"model_type\": \"llama\", \"vocab_size\": 100, \"hidden_size\": 64, "
                        "\"intermediate_size\": 96, \"num_hidden_layers\": 2, \"num_attention_heads\": 4, "
                        "\"max_position_embeddings\": 131072, \"rope_scaling\": {\"factor\": 8.0, "
                        "\"high_freq_factor\": 4.0, \"low_freq_factor\": 1.0, \"original_max_position_embeddings\": "
                        "8192, \"rope_type\": \"llama3\"}, \"rope_theta\": 500000.0}";
    moe_model_config c;
    cr_assert_eq(parse(&c, llama, NULL), MOE_OK, "%s", moe_last_error());
    const moe_rope_scaling want = {.type = MOE_ROPE_LLAMA3, .factor = 8, .low_freq_factor = 1,
                                   .high_freq_factor = 4, .original_max_position_embeddings = 8192};
    cr_expect(moe_rope_scaling_equal(&c.rope_scaling, &want), "the dense file's llama3 scaling was not read");
    cr_expect_eq(c.rope_theta, 5e5);
}

/* Whatever config.json accepts, the MoE layer built from it accepts too (the
 * reference is moe_layer_config_validate itself), and what the layer would
 * refuse is refused here under the config.json key. */
Test(model_config, limits_match_the_moe_layer) {
    const struct {
        const char *key, *value;
        const char *want; /* NULL: accepted */
    } cases[] = {
        {"moe_capacity_factor", "1e6", NULL},
        {"moe_capacity_factor", "2e6", "t/config.json: moe_capacity_factor=2e+06 must be finite and in [0, 1e+06]"},
        {"router_aux_loss_coef", "1e6", NULL},
        {"router_aux_loss_coef", "1e300", "t/config.json: router_aux_loss_coef=1e+300 must be finite and in"},
        {"moe_z_loss_coef", "1e6", NULL},
        {"moe_z_loss_coef", "1000000.5", "t/config.json: moe_z_loss_coef=1e+06 must be finite and in [0, 1e+06]"},
        {"moe_bias_update_rate", "1e6", NULL},
        {"moe_bias_update_rate", "3e6", "t/config.json: moe_bias_update_rate=3e+06 must be finite and in"},
        {"num_local_experts", "1024", NULL},
        {"num_local_experts", "1025", "t/config.json: num_local_experts=1025 exceeds 1024"},
        /* The largest <= INT_MAX / 2 with an even head_dim over 4 heads: the
         * layer takes it, but two layers of q, k, v and o 2^30 x 2^30 each
         * are more than 2^63 parameters. */
        {"hidden_size", "1073741816",
         "t/config.json: the parameter bytes of num_hidden_layers=2 layers of hidden_size=1073741816, "
         "num_attention_heads=4 and num_key_value_heads=4 x head_dim=268435454, num_local_experts=8 x "
         "intermediate_size=128 + the shared experts' width 0, and vocab_size=100 overflow int64"},
        {"hidden_size", "500000000", NULL},
        {"hidden_size", "1073741824", "t/config.json: hidden_size=1073741824 exceeds 1073741823"},
        {"intermediate_size", "1073741823", NULL},
        {"intermediate_size", "1073741824", "t/config.json: intermediate_size=1073741824 exceeds 1073741823"},
        /* intermediate_size 128: the shared MLP is n x 128 wide, at most INT_MAX / 2. */
        {"moe_n_shared_experts", "8388607", NULL},
        {"moe_n_shared_experts", "8388608", "t/config.json: moe_n_shared_experts=8388608 must be in [0, 8388607]"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        moe_model_config c;
        const char *text = config_with(cases[i].key, cases[i].value);
        moe_status st = parse(&c, text, NULL);
        if (cases[i].want != NULL) {
            cr_expect_eq(st, MOE_ERR_CONFIG, "accepted %s", text);
            cr_expect(strstr(moe_last_error(), cases[i].want) != NULL, "%s:\n  \"%s\"\n  lacks \"%s\"", text,
                      moe_last_error(), cases[i].want);
            continue;
        }
        cr_expect_eq(st, MOE_OK, "%s: %s", text, moe_last_error());
        if (st != MOE_OK) continue;
        moe_layer_config layer;
        moe_model_config_layer(&layer, &c, 64, 1);
        cr_expect_eq(moe_layer_config_validate(&layer), MOE_OK, "%s: the config accepts it, the layer says: %s", text,
                     moe_last_error());
    }

    /* Sizes each in range whose product overflows the layer's byte count. */
    moe_model_config c;
    moe_model_config_default_small(&c, 256);
    c.hidden_size = c.intermediate_size = 1073741823;
    c.head_dim = 2;
    c.num_attention_heads = c.num_key_value_heads = 2;
    c.num_local_experts = 1024;
    cr_expect_eq(moe_model_config_validate(&c, "big"), MOE_ERR_CONFIG);
    cr_expect(strstr(moe_last_error(), "big: hidden_size=1073741823 x (intermediate_size=1073741823 x "
                                       "num_local_experts=1024 + the shared experts' width 0) overflows") != NULL,
              "%s", moe_last_error());
    moe_layer_config layer;
    moe_model_config_layer(&layer, &c, 64, 1);
    cr_expect_eq(moe_layer_config_validate(&layer), MOE_ERR_CONFIG, "the layer accepts what the config refuses");
}

/* Each size in range, but heads x head_dim was never bounded: the model's
 * tensor sizes overflowed int64 (signed overflow) and asked for 2^64 bytes. */
Test(model_config, attention_width_is_bounded) {
    const char *text = "{\"vocab_size\": 100, \"hidden_size\": 64, \"intermediate_size\": 128, "
                       "\"num_hidden_layers\": 2, \"num_attention_heads\": 2147483647, \"num_key_value_heads\": 1, "
                       "\"head_dim\": 2147483646, \"num_local_experts\": 8, \"num_experts_per_tok\": 2}";
    moe_model_config c;
    cr_expect_eq(parse(&c, text, NULL), MOE_ERR_CONFIG, "accepted %s", text);
    cr_expect(strstr(moe_last_error(), "t/config.json: num_attention_heads=2147483647 x head_dim=2147483646 = "
                                       "4611686011984936962 exceeds 1073741823") != NULL,
              "%s", moe_last_error());

    /* At the limit and one step past it (head_dim stays even). */
    moe_model_config_default_small(&c, 256);
    c.num_attention_heads = c.num_key_value_heads = 1;
    c.head_dim = 1073741822;
    cr_expect_eq(moe_model_config_validate(&c, "wide"), MOE_OK, "%s", moe_last_error());
    c.head_dim = 1073741824;
    cr_expect_eq(moe_model_config_validate(&c, "wide"), MOE_ERR_CONFIG);
    cr_expect(strstr(moe_last_error(), "wide: num_attention_heads=1 x head_dim=1073741824 = 1073741824 exceeds "
                                       "1073741823") != NULL,
              "%s", moe_last_error());
}

/* Every size and product in range, and the layer's own bytes too, but the
 * whole model's parameter count is not: 2^20 layers of 2^60 parameters. The
 * reference count is done here in long double, independently. */
Test(model_config, parameter_count_overflow_refused) {
    moe_model_config c;
    moe_model_config_default_small(&c, 256);
    c.hidden_size = c.head_dim = (int64_t)1 << 29;
    c.num_attention_heads = c.num_key_value_heads = 1;
    c.intermediate_size = 1;
    c.num_local_experts = c.num_experts_per_tok = 1;
    const int64_t layers[2] = {1, (int64_t)1 << 16};
    for (int i = 0; i < 2; i++) {
        c.num_hidden_layers = layers[i];
        const long double d = (long double)c.hidden_size;
        const long double params =
            (long double)c.num_hidden_layers * (2 * d + 4 * d * d + 1 * d + 3 * d) + (2 * 256 + 1) * d;
        const bool fits = params * 4 <= (long double)INT64_MAX;
        cr_expect_eq(fits, i == 0, "the reference count: %Lg parameters", params);
        moe_layer_config layer;
        moe_model_config_layer(&layer, &c, 64, 1);
        cr_expect_eq(moe_layer_config_validate(&layer), MOE_OK, "the layer alone is fine: %s", moe_last_error());
        const moe_status st = moe_model_config_validate(&c, "deep");
        cr_expect_eq(st, fits ? MOE_OK : MOE_ERR_CONFIG, "%lld layers: %Lg parameters, got %s (%s)",
                     (long long)c.num_hidden_layers, params, moe_status_string(st), moe_last_error());
        if (!fits)
            cr_expect(strstr(moe_last_error(), "deep: the parameter bytes of num_hidden_layers=65536 layers of "
                                               "hidden_size=536870912") != NULL,
                      "%s", moe_last_error());
    }
}

Test(model_config, validate_struct) {
    moe_model_config c;
    moe_model_config_default_small(&c, 256);
    cr_assert_eq(moe_model_config_validate(&c, "small"), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(c.vocab_size, 256);
    cr_expect_eq(c.hidden_size, 128);
    cr_expect_eq(c.intermediate_size, 256);
    cr_expect_eq(c.num_hidden_layers, 4);
    cr_expect_eq(c.num_attention_heads, 4);
    cr_expect_eq(c.num_key_value_heads, 2);
    cr_expect_eq(c.head_dim, 32);
    cr_expect_eq(c.num_local_experts, 8);
    cr_expect_eq(c.num_experts_per_tok, 2);
    cr_expect_eq(c.rope_theta, 1e4);
    cr_expect_eq(c.rms_norm_eps, 1e-5);
    cr_expect_eq(c.router_aux_loss_coef, 0.01);
    cr_expect_eq(c.moe_gate, MOE_GATE_SOFTMAX_TOPK);
    cr_expect(c.moe_renormalize);

    moe_model_config bad = c;
    bad.rope_theta = NAN;
    cr_expect_eq(moe_model_config_validate(&bad, "small"), MOE_ERR_CONFIG);
    cr_expect(strstr(moe_last_error(), "small: rope_theta=nan must be a finite number") != NULL, "%s",
              moe_last_error());
    bad = c;
    bad.moe_gate = (moe_gate_kind)7;
    cr_expect_eq(moe_model_config_validate(&bad, "small"), MOE_ERR_CONFIG);
    cr_expect(strstr(moe_last_error(), "moe_gate=7 is not one of its 3 values") != NULL, "%s", moe_last_error());
    bad = c;
    bad.router_aux_loss_coef = INFINITY;
    cr_expect_eq(moe_model_config_validate(&bad, "small"), MOE_ERR_CONFIG);
}

static char tmpdir[256];

static void make_tmpdir(void) {
    snprintf(tmpdir, sizeof tmpdir, "/tmp/moe_cfg_XXXXXX");
    cr_assert_not_null(mkdtemp(tmpdir));
}

static int remove_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb, (void)flag, (void)ftw;
    return remove(path);
}

static void remove_tmpdir(void) { nftw(tmpdir, remove_entry, 16, FTW_DEPTH | FTW_PHYS); }

static void expect_same(const moe_model_config *a, const moe_model_config *b) {
#define SAME(f) cr_expect(a->f == b->f, #f " changed in the round trip")
    SAME(vocab_size);
    SAME(hidden_size);
    SAME(intermediate_size);
    SAME(num_hidden_layers);
    SAME(num_attention_heads);
    SAME(num_key_value_heads);
    SAME(head_dim);
    SAME(sliding_window);
    SAME(num_local_experts);
    SAME(num_experts_per_tok);
    SAME(max_position_embeddings);
    SAME(rope_theta);
    cr_expect(moe_rope_scaling_equal(&a->rope_scaling, &b->rope_scaling), "rope_scaling changed in the round trip");
    SAME(rms_norm_eps);
    SAME(router_aux_loss_coef);
    SAME(router_jitter_noise);
    SAME(initializer_range);
    SAME(tie_word_embeddings);
    SAME(moe_qk_norm);
    SAME(moe_gate);
    SAME(moe_renormalize);
    SAME(moe_capacity_factor);
    SAME(moe_z_loss_coef);
    SAME(moe_seq_aux_loss_coef);
    SAME(moe_n_shared_experts);
    SAME(moe_shared_intermediate_size);
    SAME(moe_shared_expert_gate);
    SAME(moe_qkv_bias);
    SAME(moe_bias_update_rate);
    SAME(moe_n_group);
    SAME(moe_topk_group);
    SAME(moe_routed_scaling_factor);
    SAME(moe_dense_intermediate_size);
#undef SAME
    cr_expect(memcmp(a->moe_dense_layers, b->moe_dense_layers, sizeof a->moe_dense_layers) == 0,
              "moe_dense_layers changed in the round trip");
    const moe_token_ids *ta[] = {&a->bos_token_id, &a->eos_token_id, &a->pad_token_id};
    const moe_token_ids *tb[] = {&b->bos_token_id, &b->eos_token_id, &b->pad_token_id};
    for (int i = 0; i < 3; i++) {
        bool same = ta[i]->form == tb[i]->form && ta[i]->n == tb[i]->n;
        for (int j = 0; same && j < ta[i]->n; j++) same = ta[i]->ids[j] == tb[i]->ids[j];
        cr_expect(same, "token id key %d changed in the round trip", i);
    }
}

/* c saved to path loads back equal, with no warning. */
static void expect_round_trip(const moe_model_config *c, const char *path) {
    cr_assert_eq(moe_model_config_save(c, path), MOE_OK, "%s", moe_last_error());
    moe_model_config back;
    warnings w = {0};
    cr_assert_eq(moe_model_config_load(&back, path, collect, &w), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(w.count, 0, "saved file warns: %s", w.text[0]);
    expect_same(c, &back);
}

Test(model_config, save_then_load_is_identical, .init = make_tmpdir, .fini = remove_tmpdir) {
    char path[512];
    snprintf(path, sizeof path, "%s/config.json", tmpdir);
    moe_model_config c;
    moe_model_config_default_small(&c, 50257);
    c.head_dim = 48; /* not hidden / heads: must survive */
    c.sliding_window = 4096;
    c.rope_theta = 0.1 + 0.2;
    c.rms_norm_eps = 1e-6;
    c.router_aux_loss_coef = 1.0 / 3.0;
    c.router_jitter_noise = 0.01;
    c.initializer_range = 0.5;
    c.tie_word_embeddings = true;
    c.moe_gate = MOE_GATE_SIGMOID; /* which normalises: moe_renormalize stays true */
    c.moe_capacity_factor = 1.25;
    c.moe_z_loss_coef = 1e-3;
    c.moe_seq_aux_loss_coef = 1e-4;
    c.moe_n_shared_experts = 1;
    c.moe_bias_update_rate = 1e-3;
    c.moe_n_group = 4;
    c.moe_topk_group = 2;
    c.moe_routed_scaling_factor = 2.5;
    expect_round_trip(&c, path);

    /* The file reads as a Hugging Face config, of a type transformers does
     * not load as Mixtral: the sigmoid gate and the rest are not Mixtral's. */
    char *text;
    size_t n;
    cr_assert_eq(moe_file_read_all(&text, &n, path, 1 << 20), MOE_OK);
    moe_json_doc *doc;
    cr_assert_eq(moe_json_parse(&doc, text, n, path), MOE_OK, "%s", moe_last_error());
    const moe_json *r = moe_json_root(doc);
    cr_expect_str_eq(moe_json_get(r, "model_type")->string.data, "moe");
    cr_expect_str_eq(moe_json_get(r, "architectures")->array.items[0].string.data, "MoeForCausalLM");
    cr_expect_eq(moe_json_get(r, "initializer_range")->number.value, 0.5);
    cr_expect_str_eq(moe_json_get(r, "hidden_act")->string.data, "silu");
    cr_expect_eq(moe_json_get(r, "tie_word_embeddings")->boolean, true);
    cr_expect_str_eq(moe_json_get(r, "moe_gate")->string.data, "sigmoid");
    cr_expect_eq(moe_json_get(r, "sliding_window")->number.value, 4096.0);
    cr_expect_eq(text[n - 1], '\n');
    moe_json_free(doc);
    free(text);

    /* The Mixtral file survives the trip too. */
    moe_model_config m, m2;
    cr_assert_eq(parse(&m, mixtral_8x7b, NULL), MOE_OK);
    cr_assert_eq(moe_model_config_save(&m, path), MOE_OK, "%s", moe_last_error());
    cr_assert_eq(moe_model_config_load(&m2, path, NULL, NULL), MOE_OK, "%s", moe_last_error());
    expect_same(&m, &m2);
    /* No window is written as transformers writes it: null; reals as
     * reals, whole or not (transformers v5 refuses an int for a float). */
    cr_assert_eq(moe_file_read_all(&text, &n, path, 1 << 20), MOE_OK);
    const char *written[] = {"\"sliding_window\": null", "\"model_type\": \"mixtral\"",
                             "\"MixtralForCausalLM\"", "\"rope_theta\": 1000000.0", "\"router_jitter_noise\": 0.0",
                             "\"initializer_range\": 0.02", "\"moe_capacity_factor\": 0.0",
                             "\"moe_routed_scaling_factor\": 1.0", "\"num_key_value_heads\": 8"};
    for (size_t i = 0; i < sizeof written / sizeof *written; i++)
        cr_expect(strstr(text, written[i]) != NULL, "lacks %s:\n%s", written[i], text);
    free(text);

    /* An invalid config is refused before anything is written. */
    moe_model_config bad = c;
    bad.num_experts_per_tok = 9;
    cr_expect_eq(moe_model_config_save(&bad, path), MOE_ERR_CONFIG);
    cr_expect(strstr(moe_last_error(), "config.json: num_experts_per_tok=9 exceeds num_local_experts=8") != NULL,
              "%s", moe_last_error());
    cr_assert_eq(moe_model_config_load(&m2, path, NULL, NULL), MOE_OK, "%s", moe_last_error());
    expect_same(&m, &m2);

    char missing[600];
    snprintf(missing, sizeof missing, "%s/none.json", tmpdir);
    cr_expect_eq(moe_model_config_load(&m2, missing, NULL, NULL), MOE_ERR_IO);
    cr_expect(strstr(moe_last_error(), "none.json: cannot open") != NULL, "%s", moe_last_error());
    /* Past the size limit it can never be read, as one that is not JSON: a
     * config error (moe-train's exit 2), not one another try may fix. */
    cr_assert_eq(truncate(path, ((off_t)16 << 20) + 1), 0);
    cr_expect_eq(moe_model_config_load(&m2, path, NULL, NULL), MOE_ERR_CONFIG);
    cr_expect(strstr(moe_last_error(), "is 16777217 bytes, more than the limit") != NULL, "%s", moe_last_error());
}

/* A scaled RoPE saves as rope_scaling, every parameter of its type
 * explicit, and loads back equal; validate refuses a parameter its type
 * does not have. */
Test(model_config, scaled_rope_round_trip, .init = make_tmpdir, .fini = remove_tmpdir) {
    char path[512];
    snprintf(path, sizeof path, "%s/config.json", tmpdir);
    const moe_rope_scaling scalings[] = {
        {.type = MOE_ROPE_LINEAR, .factor = 2.5},
        {.type = MOE_ROPE_LLAMA3, .factor = 32, .low_freq_factor = 1, .high_freq_factor = 4,
         .original_max_position_embeddings = 8192},
        {.type = MOE_ROPE_YARN, .factor = 32, .original_max_position_embeddings = 4096, .beta_fast = 32,
         .beta_slow = 1, .mscale = 0.707, .mscale_all_dim = 1, .truncate = false},
        /* The context of max_position_embeddings stays implicit (transformers v4.5x would read factor from it). */
        {.type = MOE_ROPE_YARN, .factor = 1, .original_max_position_embeddings = 131072, .beta_fast = 32,
         .beta_slow = 1, .truncate = true},
        {.type = MOE_ROPE_YARN, .factor = 4, .original_max_position_embeddings = 32768, .attention_factor = 1.25,
         .beta_fast = 16, .beta_slow = 2, .truncate = true},
        {.type = MOE_ROPE_DYNAMIC, .factor = 2},
    };
    const char *const written[] = {"\"rope_type\": \"linear\"", "\"high_freq_factor\": 4.0",
                                   "\"mscale_all_dim\": 1.0", "\"truncate\": true",
                                   "\"attention_factor\": 1.25", "\"rope_type\": \"dynamic\""};
    for (size_t i = 0; i < sizeof scalings / sizeof *scalings; i++) {
        moe_model_config c;
        moe_model_config_default_small(&c, 256);
        c.rope_scaling = scalings[i];
        expect_round_trip(&c, path);
        char *text;
        size_t n;
        cr_assert_eq(moe_file_read_all(&text, &n, path, 1 << 20), MOE_OK);
        cr_expect(strstr(text, written[i]) != NULL, "lacks %s:\n%s", written[i], text);
        if (scalings[i].original_max_position_embeddings == c.max_position_embeddings)
            cr_expect(strstr(text, "original_max_position_embeddings") == NULL, "the context is written:\n%s", text);
        free(text);
    }
    moe_model_config bad;
    moe_model_config_default_small(&bad, 256);
    bad.rope_scaling = (moe_rope_scaling){.type = MOE_ROPE_LINEAR, .factor = 2, .beta_fast = 32};
    cr_expect_eq(moe_model_config_validate(&bad, "small"), MOE_ERR_CONFIG);
    cr_expect(strstr(moe_last_error(), "small: rope_scaling.beta_fast is set, but rope_type \"linear\" has no such "
                                       "parameter") != NULL,
              "%s", moe_last_error());
    bad.rope_scaling = (moe_rope_scaling){.type = (moe_rope_type)9};
    cr_expect_eq(moe_model_config_validate(&bad, "small"), MOE_ERR_CONFIG);
    cr_expect(strstr(moe_last_error(), "small: rope_scaling.rope_type=9 is no RoPE type") != NULL, "%s",
              moe_last_error());
}

/* The base config without the keys in drop (a NULL-terminated list), with
 * extra (a JSON member list, or "") appended, into buf [size]. */
static const char *config_without(char *buf, size_t size, const char *const *drop, const char *extra) {
    size_t n = (size_t)snprintf(buf, size, "{");
    for (size_t i = 0; i < N_BASE; i++) {
        bool dropped = false;
        for (const char *const *d = drop; *d != NULL; d++) dropped |= strcmp(*d, base_keys[i][0]) == 0;
        if (!dropped)
            n += (size_t)snprintf(buf + n, size - n, "%s\"%s\": %s", n > 1 ? ", " : "", base_keys[i][0],
                                  base_keys[i][1]);
    }
    snprintf(buf + n, size - n, "%s%s}", extra[0] != '\0' ? ", " : "", extra);
    return buf;
}

/* transformers' MixtralConfig: num_key_value_heads=8 in the signature, and
 * num_attention_heads only when it is given as None (null). */
Test(model_config, num_key_value_heads_as_transformers) {
    const char *const drop[] = {"num_key_value_heads", "num_attention_heads", NULL};
    char buf[1024];
    moe_model_config c;
    cr_assert_eq(parse(&c, config_without(buf, sizeof buf, drop, "\"num_attention_heads\": 16"), NULL), MOE_OK,
                 "%s", moe_last_error());
    cr_expect_eq(c.num_key_value_heads, 8, "absent: transformers' default 8, not num_attention_heads");
    cr_assert_eq(parse(&c, config_without(buf, sizeof buf, drop,
                                          "\"num_attention_heads\": 16, \"num_key_value_heads\": null"),
                       NULL),
                 MOE_OK, "%s", moe_last_error());
    cr_expect_eq(c.num_key_value_heads, 16, "null: num_attention_heads");
    cr_assert_eq(parse(&c, config_with("num_key_value_heads", "null"), NULL), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(c.num_key_value_heads, 4, "null: num_attention_heads");
    cr_assert_eq(parse(&c, config_with("num_key_value_heads", "2"), NULL), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(c.num_key_value_heads, 2);
    /* Only the default is called the default. */
    cr_expect_eq(parse(&c, config_with("num_key_value_heads", "8"), NULL), MOE_ERR_CONFIG);
    cr_expect(strstr(moe_last_error(), "t/config.json: num_attention_heads=4 is not a multiple of "
                                       "num_key_value_heads=8") != NULL &&
                  strstr(moe_last_error(), "default") == NULL,
              "%s", moe_last_error());
}

/* transformers' attribute_map: "num_experts" sets num_local_experts. */
Test(model_config, num_experts_is_num_local_experts) {
    const char *const drop[] = {"num_local_experts", NULL};
    const struct {
        const char *extra;
        int64_t experts; /* 0: refused */
        const char *want;
    } cases[] = {
        {"\"num_experts\": 4", 4, NULL},
        {"\"num_experts\": 4, \"num_local_experts\": 4", 4, NULL},
        {"\"num_local_experts\": 4, \"num_experts\": 4", 4, NULL},
        {"\"num_local_experts\": null, \"num_experts\": 4", 4, NULL},
        {"\"num_experts\": null, \"num_local_experts\": 6", 6, NULL},
        {"\"num_experts\": 4, \"num_local_experts\": 6", 0,
         "t/config.json: num_experts=4 disagrees with num_local_experts=6"},
        {"\"num_local_experts\": 6, \"num_experts\": 4", 0,
         "t/config.json: num_experts=4 disagrees with num_local_experts=6"},
        {"\"num_experts\": null", 0, "t/config.json: missing required key 'num_local_experts'"},
        {"\"num_local_experts\": null", 0, "t/config.json: num_local_experts must be an integer, got null"},
        {"\"num_experts\": 1", 0, "t/config.json: num_experts_per_tok=2 exceeds num_local_experts=1"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        char buf[1024];
        const char *text = config_without(buf, sizeof buf, drop, cases[i].extra);
        moe_model_config c;
        warnings w = {0};
        const moe_status st = parse(&c, text, &w);
        if (cases[i].experts == 0) {
            cr_expect_eq(st, MOE_ERR_CONFIG, "accepted %s", text);
            cr_expect(strstr(moe_last_error(), cases[i].want) != NULL, "%s:\n  \"%s\"\n  lacks \"%s\"", text,
                      moe_last_error(), cases[i].want);
            continue;
        }
        cr_expect_eq(st, MOE_OK, "%s: %s", text, moe_last_error());
        cr_expect_eq(c.num_local_experts, cases[i].experts, "%s: %lld experts", text, (long long)c.num_local_experts);
        cr_expect_eq(w.count, 0, "%s warned: %s", text, w.text[0]);
    }
}

/* null is absent for every key, as in transformers: the config reads as if
 * the key were not there (num_key_value_heads null is num_attention_heads,
 * which the base config gives it anyway), with no warning. */
Test(model_config, null_is_absent_for_every_key) {
    const char *const keys[] = {
        "num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window", "rope_theta",
        "rms_norm_eps", "router_aux_loss_coef", "router_jitter_noise", "initializer_range", "moe_gate",
        "moe_renormalize", "moe_capacity_factor", "moe_z_loss_coef", "moe_seq_aux_loss_coef",
        "moe_n_shared_experts", "moe_bias_update_rate", "moe_n_group", "moe_topk_group",
        "moe_routed_scaling_factor", "rope_parameters", "rope_scaling", "tie_word_embeddings", "hidden_act",
        "model_type", "attention_dropout", "num_experts", "architectures", "torch_dtype", "use_cache",
        "original_max_position_embeddings",
    };
    moe_model_config base;
    cr_assert_eq(parse(&base, config_with(NULL, NULL), NULL), MOE_OK, "%s", moe_last_error());
    for (size_t i = 0; i < sizeof keys / sizeof *keys; i++) {
        moe_model_config c;
        warnings w = {0};
        const char *text = config_with(keys[i], "null");
        cr_expect_eq(parse(&c, text, &w), MOE_OK, "%s: %s", text, moe_last_error());
        cr_expect_eq(w.count, 0, "%s warned: %s", text, w.text[0]);
        cr_expect(memcmp(&c, &base, sizeof c) == 0, "%s does not read as the base config", text);
    }
}

/* The written model_type is "mixtral" exactly when transformers' Mixtral
 * computes what the model computes: each key that changes the outputs makes
 * it "moe", each loss-only key leaves it "mixtral"; either reads back equal. */
Test(model_config, model_type_says_whether_transformers_computes_the_same, .init = make_tmpdir,
     .fini = remove_tmpdir) {
    const struct {
        const char *key, *value; /* key NULL: the base config */
        const char *type; /* the type written */
    } cases[] = {
        {NULL, NULL, "mixtral"},
        {"moe_gate", "\"topk_softmax\"", "moe"},
        {"moe_gate", "\"sigmoid\"", "moe"},
        {"moe_renormalize", "false", "moe"},
        {"moe_capacity_factor", "1.25", "moe"},
        {"moe_n_shared_experts", "1", "moe"},
        {"moe_bias_update_rate", "0.001", "moe"},
        {"moe_n_group", "4, \"moe_topk_group\": 2", "moe"},
        {"moe_routed_scaling_factor", "2.5", "moe"},
        {"moe_routed_scaling_factor", "1.0000001", "moe"},
        /* One group is no groups. */
        {"moe_n_group", "1", "mixtral"},
        {"router_aux_loss_coef", "0.1", "mixtral"},
        {"moe_z_loss_coef", "0.001", "mixtral"},
        {"moe_seq_aux_loss_coef", "0.0001", "mixtral"},
        {"router_jitter_noise", "0.01", "mixtral"},
        {"initializer_range", "0.5", "mixtral"},
        {"sliding_window", "16", "mixtral"},
        /* The type read does not decide the type written; the model does. */
        {"model_type", "\"moe\"", "mixtral"},
        {"model_type", "\"mixtral\", \"moe_gate\": \"sigmoid\"", "moe"},
        /* q and k normalised per head: Qwen3-MoE's, with or without
         * norm_topk_prob; across heads: OLMoE's, without a window. */
        {"moe_qk_norm", "\"none\"", "mixtral"},
        {"moe_qk_norm", "\"per_head\"", "qwen3_moe"},
        {"moe_qk_norm", "\"per_head\", \"moe_renormalize\": false", "qwen3_moe"},
        {"moe_qk_norm", "\"per_head\", \"sliding_window\": 16", "qwen3_moe"},
        {"moe_qk_norm", "\"per_head\", \"moe_gate\": \"sigmoid\"", "moe"},
        {"moe_qk_norm", "\"per_head\", \"moe_capacity_factor\": 1.25", "moe"},
        {"model_type", "\"qwen3_moe\", \"moe_intermediate_size\": 128", "qwen3_moe"},
        {"moe_qk_norm", "\"across_heads\"", "olmoe"},
        {"moe_qk_norm", "\"across_heads\", \"moe_renormalize\": false", "olmoe"},
        {"moe_qk_norm", "\"across_heads\", \"sliding_window\": 16", "moe"},
        {"moe_qk_norm", "\"across_heads\", \"head_dim\": 8", "moe"},
        {"model_type", "\"olmoe\"", "olmoe"},
        /* One shared expert behind its gate, with or without q, k and v
         * biases: Qwen2-MoE's, of any width; without the gate, ours. */
        {"moe_n_shared_experts", "1, \"moe_shared_expert_gate\": true, \"moe_qkv_bias\": true", "qwen2_moe"},
        {"moe_n_shared_experts", "1, \"moe_shared_expert_gate\": true, \"moe_qkv_bias\": true, "
                                 "\"moe_shared_intermediate_size\": 48, \"moe_renormalize\": false", "qwen2_moe"},
        {"moe_n_shared_experts", "1, \"moe_shared_expert_gate\": true", "qwen2_moe"},
        {"moe_n_shared_experts", "2, \"moe_shared_expert_gate\": true, \"moe_qkv_bias\": true", "moe"},
        {"moe_n_shared_experts", "1, \"moe_shared_intermediate_size\": 48", "moe"},
        {"moe_qkv_bias", "true", "moe"},
        {"moe_qkv_bias", "false", "mixtral"},
        {"moe_n_shared_experts", "1, \"moe_shared_expert_gate\": true, \"moe_qkv_bias\": true, \"sliding_window\": 16",
         "moe"},
        {"moe_n_shared_experts", "1, \"moe_shared_expert_gate\": true, \"moe_qkv_bias\": true, "
                                 "\"moe_qk_norm\": \"per_head\"", "moe"},
        {"model_type", "\"qwen2_moe\", \"moe_intermediate_size\": 128, \"shared_expert_intermediate_size\": 64",
         "qwen2_moe"},
        /* Dense MLP layers: the Qwens say them (mlp_only_layers), Mixtral
         * and OLMoE cannot. */
        {"moe_dense_layers", "[1]", "moe"},
        {"moe_dense_layers", "[0], \"moe_dense_intermediate_size\": 96", "moe"},
        {"moe_dense_layers", "[]", "mixtral"},
        {"moe_dense_layers", "null", "mixtral"},
        {"moe_qk_norm", "\"across_heads\", \"moe_dense_layers\": [0]", "moe"},
        {"moe_qk_norm", "\"per_head\", \"moe_dense_layers\": [0], \"moe_dense_intermediate_size\": 96", "qwen3_moe"},
        {"moe_n_shared_experts", "1, \"moe_shared_expert_gate\": true, \"moe_dense_layers\": [1]", "qwen2_moe"},
    };
    char path[512];
    snprintf(path, sizeof path, "%s/config.json", tmpdir);
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        const char *text = config_with(cases[i].key, cases[i].value);
        moe_model_config c, back;
        cr_assert_eq(parse(&c, text, NULL), MOE_OK, "%s: %s", text, moe_last_error());
        cr_assert_eq(moe_model_config_save(&c, path), MOE_OK, "%s", moe_last_error());
        moe_json_doc *doc;
        cr_assert_eq(moe_json_parse_file(&doc, path, 1 << 20), MOE_OK, "%s", moe_last_error());
        const moe_json *r = moe_json_root(doc);
        const char *type = moe_json_text(moe_json_get(r, "model_type"));
        const moe_json *arch = moe_json_get(r, "architectures");
        cr_assert(type != NULL && arch != NULL && arch->type == MOE_JSON_ARRAY && arch->array.count == 1, "%s",
                  text);
        const bool qwen3 = strcmp(cases[i].type, "qwen3_moe") == 0, olmoe = strcmp(cases[i].type, "olmoe") == 0;
        const bool qwen2 = strcmp(cases[i].type, "qwen2_moe") == 0, ours = strcmp(cases[i].type, "moe") == 0;
        cr_expect_str_eq(type, cases[i].type, "%s", text);
        cr_expect_str_eq(moe_model_config_model_type(&c), cases[i].type, "%s", text);
        cr_expect_str_eq(moe_json_text(&arch->array.items[0]),
                         qwen3   ? "Qwen3MoeForCausalLM"
                         : olmoe ? "OlmoeForCausalLM"
                         : qwen2 ? "Qwen2MoeForCausalLM"
                         : ours  ? "MoeForCausalLM"
                                 : "MixtralForCausalLM",
                         "%s", text);
        /* Written only where the type does not say it, so that a config of
         * none renders (and checksums) as before the key existed. */
        const struct {
            const char *key;
            bool set;
        } ours_when_set[] = {{"moe_qk_norm", c.moe_qk_norm != MOE_QK_NORM_NONE},
                             {"moe_qkv_bias", c.moe_qkv_bias},
                             {"moe_shared_intermediate_size", c.moe_shared_intermediate_size != 0},
                             {"moe_shared_expert_gate", c.moe_shared_expert_gate},
                             {"moe_dense_layers", moe_model_config_dense_layer_count(&c) > 0},
                             {"moe_dense_intermediate_size", c.moe_dense_intermediate_size != 0}};
        for (size_t k = 0; k < sizeof ours_when_set / sizeof *ours_when_set; k++)
            cr_expect((moe_json_get(r, ours_when_set[k].key) != NULL) == (ours && ours_when_set[k].set), "%s: %s",
                      text, ours_when_set[k].key);
        /* Qwen3MoeConfig's, OlmoeConfig's and Qwen2MoeConfig's own keys,
         * which transformers v4 reads too: num_experts, not
         * num_local_experts. */
        const struct {
            const char *key;
            bool qwen3, olmoe, qwen2;
        } own[] = {{"num_experts", true, true, true},
                   {"norm_topk_prob", true, true, true},
                   {"attention_bias", true, true, false},
                   {"moe_intermediate_size", true, false, true},
                   {"use_sliding_window", true, false, true},
                   {"decoder_sparse_step", true, false, true},
                   {"mlp_only_layers", true, false, true},
                   {"clip_qkv", false, true, false},
                   {"max_window_layers", true, false, true},
                   {"shared_expert_intermediate_size", false, false, true},
                   {"qkv_bias", false, false, true},
                   {"num_local_experts", false, false, false}};
        for (size_t k = 0; k < sizeof own / sizeof *own; k++) {
            const bool want = qwen3   ? own[k].qwen3
                              : olmoe ? own[k].olmoe
                              : qwen2 ? own[k].qwen2
                                      : strcmp(own[k].key, "num_local_experts") == 0;
            cr_expect((moe_json_get(r, own[k].key) != NULL) == want, "%s: %s", text, own[k].key);
        }
        moe_json_free(doc);
        warnings w = {0};
        cr_assert_eq(moe_model_config_load(&back, path, collect, &w), MOE_OK, "%s: %s", text, moe_last_error());
        cr_expect_eq(w.count, 0, "%s: the saved file warns: %s", text, w.text[0]);
        expect_same(&c, &back);
    }
}

/* Shaped like Qwen3-30B-A3B's published config.json (its keys, Qwen3's
 * sizes): read as transformers' Qwen3MoeConfig reads it. */
static const char qwen3_moe_config[] = "{\"architectures\": [\"Qwen3MoeForCausalLM\"], \"attention_bias\": false, "
                                       "\"attention_dropout\": 0.0, \"bos_token_id\": 151643, "
                                       "\"decoder_sparse_step\": 1, \"eos_token_id\": 151645, \"head_dim\": 128, "
                                       "\"hidden_act\": \"silu\", \"hidden_size\": 2048, \"initializer_range\": 0.02, "
                                       "\"intermediate_size\": 6144, \"max_position_embeddings\": 40960, "
                                       "\"max_window_layers\": 48, \"mlp_only_layers\": [], "
                                       "\"model_type\": \"qwen3_moe\", \"moe_intermediate_size\": 768, "
                                       "\"norm_topk_prob\": true, \"num_attention_heads\": 32, "
                                       "\"num_experts\": 128, \"num_experts_per_tok\": 8, "
                                       "\"num_hidden_layers\": 48, \"num_key_value_heads\": 4, "
                                       "\"output_router_logits\": false, \"rms_norm_eps\": 1e-06, "
                                       "\"rope_scaling\": null, \"rope_theta\": 1000000.0, "
                                       "\"router_aux_loss_coef\": 0.001, \"sliding_window\": null, "
                                       "\"tie_word_embeddings\": false, \"torch_dtype\": \"bfloat16\", "
                                       "\"transformers_version\": \"4.51.0\", \"use_cache\": true, "
                                       "\"use_sliding_window\": false, \"vocab_size\": 151936}";

/* The smallest file of a model type (qwen3_moe, olmoe or qwen2_moe) of
 * that many layers: its sizes, the experts 32 wide (qwen2_moe's shared
 * expert 48, the Qwens' dense MLP layers 256), then extra keys (a JSON
 * tail); 16 heads for qwen2_moe, whose absent num_key_value_heads is 16. */
static const char *family_layers_with(const char *type, int layers, const char *extra) {
    static char buf[1024];
    const bool qwen3 = strcmp(type, "qwen3_moe") == 0, qwen2 = strcmp(type, "qwen2_moe") == 0;
    snprintf(buf, sizeof buf,
             "{\"model_type\": \"%s\", \"vocab_size\": 100, \"hidden_size\": 64, \"intermediate_size\": %s, "
             "\"num_hidden_layers\": %d, \"num_attention_heads\": %d, \"num_experts\": 8, "
             "\"num_experts_per_tok\": 2%s}",
             type,
             qwen3   ? "256, \"moe_intermediate_size\": 32"
             : qwen2 ? "256, \"moe_intermediate_size\": 32, \"shared_expert_intermediate_size\": 48"
                     : "32",
             layers, qwen2 ? 16 : 4, extra);
    return buf;
}

static const char *family_with(const char *type, const char *extra) { return family_layers_with(type, 2, extra); }

static const char *qwen3_with(const char *extra) { return family_with("qwen3_moe", extra); }

typedef struct refused_case {
    const char *extra, *want; /* a JSON tail; what the message holds */
} refused_case;

/* text is refused, its message holding want. */
static void expect_refused(const char *text, const char *want) {
    moe_model_config c;
    cr_expect_eq(parse(&c, text, NULL), MOE_ERR_CONFIG, "%s was accepted", text);
    cr_expect(strstr(moe_last_error(), want) != NULL, "%s:\n  %s\n  lacks %s", text, moe_last_error(), want);
}

/* Each case's file of the model type is refused, its message holding want. */
static void expect_refused_configs(const char *type, const refused_case *bad, size_t n) {
    for (size_t i = 0; i < n; i++) expect_refused(family_with(type, bad[i].extra), bad[i].want);
}

Test(model_config, qwen3_moe_as_transformers_reads_it) {
    moe_model_config c;
    warnings w = {0};
    cr_assert_eq(parse(&c, qwen3_moe_config, &w), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(w.count, 0, "warned: %s", w.text[0]);
    cr_expect_eq(c.intermediate_size, 768, "the experts' width is moe_intermediate_size");
    cr_expect_eq(c.num_local_experts, 128);
    cr_expect_eq(c.num_experts_per_tok, 8);
    cr_expect_eq(c.num_key_value_heads, 4);
    cr_expect_eq(c.head_dim, 128);
    cr_expect_eq(c.max_position_embeddings, 40960);
    cr_expect_eq(c.rope_theta, 1e6);
    cr_expect_eq(c.rms_norm_eps, 1e-6);
    cr_expect_eq(c.sliding_window, 0);
    cr_expect(c.moe_qk_norm == MOE_QK_NORM_PER_HEAD && c.moe_renormalize && c.moe_gate == MOE_GATE_SOFTMAX_TOPK);
    cr_expect_str_eq(moe_model_config_model_type(&c), "qwen3_moe");

    /* Qwen3MoeConfig's defaults, not MixtralConfig's. */
    cr_assert_eq(parse(&c, qwen3_with(""), &w), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(w.count, 0, "warned: %s", w.text[0]);
    cr_expect_eq(c.num_key_value_heads, 4);
    cr_expect_eq(c.max_position_embeddings, 32768);
    cr_expect_eq(c.rope_theta, 1e4);
    cr_expect_eq(c.rms_norm_eps, 1e-6);
    cr_expect(!c.moe_renormalize, "norm_topk_prob defaults to false");
    cr_expect_eq(c.moe_qk_norm, MOE_QK_NORM_PER_HEAD);
    cr_expect_eq(c.head_dim, 16);
    /* sliding_window counts only under use_sliding_window. */
    cr_assert_eq(parse(&c, qwen3_with(", \"sliding_window\": 4096"), &w), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(c.sliding_window, 0);
    cr_assert_eq(parse(&c, qwen3_with(", \"sliding_window\": 64, \"use_sliding_window\": true"), &w), MOE_OK, "%s",
                 moe_last_error());
    cr_expect_eq(c.sliding_window, 64);
    cr_assert_eq(parse(&c, qwen3_with(", \"use_sliding_window\": true"), &w), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(c.sliding_window, 4096, "Qwen3MoeConfig's default window");
    cr_assert_eq(parse(&c, qwen3_with(", \"use_sliding_window\": true, \"sliding_window\": null"), &w), MOE_OK, "%s",
                 moe_last_error());
    cr_expect_eq(c.sliding_window, 0);
    /* Layers past the model's are no layers of it, as in transformers. */
    cr_assert_eq(parse(&c, qwen3_with(", \"mlp_only_layers\": [2, 99, -1]"), &w), MOE_OK, "%s", moe_last_error());
    cr_expect(moe_model_config_dense_layer_count(&c) == 0 && c.moe_dense_intermediate_size == 0,
              "%lld dense layers %lld wide", (long long)moe_model_config_dense_layer_count(&c),
              (long long)c.moe_dense_intermediate_size);
    cr_assert_eq(parse(&c, qwen3_with(", \"norm_topk_prob\": true, \"moe_renormalize\": true"), &w), MOE_OK, "%s",
                 moe_last_error());
    cr_expect(c.moe_renormalize);
    cr_expect_eq(w.count, 0, "warned: %s", w.text[0]);

    const refused_case bad[] = {
        {", \"mlp_only_layers\": [\"a\"]", "mlp_only_layers[0] must be an integer"},
        {", \"mlp_only_layers\": 1", "mlp_only_layers must be a list of layer numbers"},
        {", \"attention_bias\": true", "attention_bias=true is not supported"},
        {", \"use_sliding_window\": 1", "use_sliding_window must be true or false"},
        {", \"moe_qk_norm\": \"across_heads\"",
         "moe_qk_norm=\"across_heads\", and model_type qwen3_moe normalises q and k per head"},
        {", \"moe_qk_norm\": true", "moe_qk_norm must be \"none\", \"per_head\" or \"across_heads\", got true"},
        {", \"norm_topk_prob\": true, \"moe_renormalize\": false",
         "moe_renormalize=false disagrees with norm_topk_prob=true, which model_type qwen3_moe takes"},
        {", \"moe_renormalize\": true", "moe_renormalize=true disagrees with norm_topk_prob=false (absent)"},
    };
    expect_refused_configs("qwen3_moe", bad, sizeof bad / sizeof *bad);
    const char *no_width = "{\"model_type\": \"qwen3_moe\", \"vocab_size\": 100, \"hidden_size\": 64, "
                           "\"intermediate_size\": 256, \"num_hidden_layers\": 2, \"num_attention_heads\": 4, "
                           "\"num_experts\": 8, \"num_experts_per_tok\": 2}";
    cr_expect_eq(parse(&c, no_width, NULL), MOE_ERR_CONFIG);
    cr_expect(strstr(moe_last_error(), "missing required key 'moe_intermediate_size'") != NULL, "%s",
              moe_last_error());

    /* In another model type's file they are no keys of its. */
    w.count = 0;
    cr_assert_eq(parse(&c, config_with("norm_topk_prob", "false"), &w), MOE_OK, "%s", moe_last_error());
    cr_expect(c.moe_renormalize && c.moe_qk_norm == MOE_QK_NORM_NONE);
    cr_expect(w.count == 1 && warned(&w, "unknown key 'norm_topk_prob' ignored"), "%d: %s", w.count, w.text[0]);
    w.count = 0;
    cr_assert_eq(parse(&c, config_with("moe_intermediate_size", "\"x\""), &w), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(c.intermediate_size, 128);
    cr_expect(w.count == 1 && warned(&w, "unknown key 'moe_intermediate_size' ignored"), "%d: %s", w.count,
              w.text[0]);
}

/* Shaped like OLMoE-1B-7B's published config.json: read as transformers'
 * OlmoeConfig reads it. */
static const char olmoe_config[] = "{\"architectures\": [\"OlmoeForCausalLM\"], \"attention_bias\": false, "
                                   "\"attention_dropout\": 0.0, \"clip_qkv\": null, \"eos_token_id\": 50279, "
                                   "\"hidden_act\": \"silu\", \"hidden_size\": 2048, \"initializer_range\": 0.02, "
                                   "\"intermediate_size\": 1024, \"max_position_embeddings\": 4096, "
                                   "\"model_type\": \"olmoe\", \"norm_topk_prob\": false, "
                                   "\"num_attention_heads\": 16, \"num_experts\": 64, \"num_experts_per_tok\": 8, "
                                   "\"num_hidden_layers\": 16, \"num_key_value_heads\": 16, "
                                   "\"output_router_logits\": false, \"pad_token_id\": 1, \"rms_norm_eps\": 1e-05, "
                                   "\"rope_scaling\": null, \"rope_theta\": 10000.0, \"router_aux_loss_coef\": 0.01, "
                                   "\"tie_word_embeddings\": false, \"torch_dtype\": \"bfloat16\", "
                                   "\"transformers_version\": \"4.43.0.dev0\", \"use_cache\": true, "
                                   "\"vocab_size\": 50304}";

static const char *olmoe_with(const char *extra) { return family_with("olmoe", extra); }

Test(model_config, olmoe_as_transformers_reads_it) {
    moe_model_config c;
    warnings w = {0};
    cr_assert_eq(parse(&c, olmoe_config, &w), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(w.count, 0, "warned: %s", w.text[0]);
    cr_expect_eq(c.intermediate_size, 1024);
    cr_expect_eq(c.num_local_experts, 64);
    cr_expect_eq(c.num_experts_per_tok, 8);
    cr_expect_eq(c.num_key_value_heads, 16);
    cr_expect_eq(c.head_dim, 128);
    cr_expect_eq(c.max_position_embeddings, 4096);
    cr_expect_eq(c.rope_theta, 1e4);
    cr_expect_eq(c.router_aux_loss_coef, 0.01);
    cr_expect(c.moe_qk_norm == MOE_QK_NORM_ACROSS_HEADS && !c.moe_renormalize);
    cr_expect_eq(moe_qk_norm_width(&c, false), 2048);
    cr_expect_eq(moe_qk_norm_width(&c, true), 2048);
    cr_expect_str_eq(moe_model_config_model_type(&c), "olmoe");

    /* OlmoeConfig's defaults, not MixtralConfig's. */
    cr_assert_eq(parse(&c, olmoe_with(""), &w), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(w.count, 0, "warned: %s", w.text[0]);
    cr_expect_eq(c.num_key_value_heads, 4, "absent: num_attention_heads");
    cr_expect_eq(c.max_position_embeddings, 4096);
    cr_expect_eq(c.rope_theta, 1e4);
    cr_expect_eq(c.rms_norm_eps, 1e-5);
    cr_expect_eq(c.router_aux_loss_coef, 0.01);
    cr_expect(!c.moe_renormalize && c.moe_qk_norm == MOE_QK_NORM_ACROSS_HEADS);
    cr_assert_eq(parse(&c, olmoe_with(", \"num_key_value_heads\": 2, \"norm_topk_prob\": true"), &w), MOE_OK, "%s",
                 moe_last_error());
    cr_expect(c.moe_renormalize);
    cr_expect_eq(moe_qk_norm_width(&c, true), 32, "k_norm: num_key_value_heads x head_dim");
    /* OlmoeConfig has no window. */
    cr_assert_eq(parse(&c, olmoe_with(", \"sliding_window\": 16"), &w), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(c.sliding_window, 0);
    cr_expect(w.count == 1 && warned(&w, "sliding_window=16 ignored: model_type olmoe attends to every position"),
              "%d: %s", w.count, w.text[0]);

    const refused_case bad[] = {
        {", \"clip_qkv\": 8.0", "clip_qkv=8.0 is not supported"},
        {", \"attention_bias\": true", "attention_bias=true is not supported"},
        {", \"head_dim\": 8", "num_attention_heads=4 x head_dim=8 is not hidden_size=64"},
        {", \"moe_qk_norm\": \"per_head\"",
         "moe_qk_norm=\"per_head\", and model_type olmoe normalises q and k across heads"},
    };
    expect_refused_configs("olmoe", bad, sizeof bad / sizeof *bad);
    const char *uneven = "{\"model_type\": \"olmoe\", \"vocab_size\": 100, \"hidden_size\": 66, \"intermediate_size\": "
                         "32, \"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"num_experts\": 8, "
                         "\"num_experts_per_tok\": 2}";
    cr_expect_eq(parse(&c, uneven, NULL), MOE_ERR_CONFIG);
    cr_expect(strstr(moe_last_error(), "num_attention_heads=4 x head_dim=16 is not hidden_size=66"), "%s",
              moe_last_error());

    /* Its keys are no other model type's: a qwen3_moe file's clip_qkv and
     * a Mixtral's are unknown. */
    w.count = 0;
    cr_assert_eq(parse(&c, qwen3_with(", \"clip_qkv\": 8.0"), &w), MOE_OK, "%s", moe_last_error());
    cr_expect(w.count == 1 && warned(&w, "unknown key 'clip_qkv' ignored"), "%d: %s", w.count, w.text[0]);
    w.count = 0;
    cr_assert_eq(parse(&c, config_with("clip_qkv", "8.0"), &w), MOE_OK, "%s", moe_last_error());
    cr_expect(w.count == 1 && warned(&w, "unknown key 'clip_qkv' ignored"), "%d: %s", w.count, w.text[0]);
}

/* As transformers 5.24 writes a LlamaConfig, MistralConfig, Qwen2Config and
 * Qwen3Config (save_pretrained; 64 wide, an MLP 96 wide, 4 heads of 16, 2
 * of k and v, 2 layers; Mistral's window 16): dense models, every layer a
 * dense MLP, read as those classes read them. */
static const char llama_config[] =
    "{\"attention_bias\": false, \"attention_dropout\": 0.0, \"bos_token_id\": 1, \"eos_token_id\": 2, \""
    "head_dim\": 16, \"hidden_act\": \"silu\", \"hidden_size\": 64, \"initializer_range\": 0.02, \"interm"
    "ediate_size\": 96, \"max_position_embeddings\": 2048, \"mlp_bias\": false, \"model_type\": \"llama\""
    ", \"num_attention_heads\": 4, \"num_hidden_layers\": 2, \"num_key_value_heads\": 2, \"pad_token_id\""
    ": null, \"pretraining_tp\": 1, \"rms_norm_eps\": 1e-06, \"rope_parameters\": {\"rope_theta\": 10000."
    "0, \"rope_type\": \"default\"}, \"tie_word_embeddings\": false, \"transformers_version\": \"5.24.0\""
    ", \"use_cache\": true, \"vocab_size\": 100}";

static const char mistral_config[] =
    "{\"attention_dropout\": 0.0, \"bos_token_id\": 1, \"eos_token_id\": 2, \"head_dim\": 16, \"hidden_ac"
    "t\": \"silu\", \"hidden_size\": 64, \"initializer_range\": 0.02, \"intermediate_size\": 96, \"max_po"
    "sition_embeddings\": 131072, \"model_type\": \"mistral\", \"num_attention_heads\": 4, \"num_hidden_l"
    "ayers\": 2, \"num_key_value_heads\": 2, \"pad_token_id\": null, \"rms_norm_eps\": 1e-06, \"rope_para"
    "meters\": {\"rope_theta\": 10000.0, \"rope_type\": \"default\"}, \"sliding_window\": 16, \"tie_word_"
    "embeddings\": false, \"transformers_version\": \"5.24.0\", \"use_cache\": true, \"vocab_size\": 100}";

static const char qwen2_config[] =
    "{\"attention_dropout\": 0.0, \"bos_token_id\": null, \"eos_token_id\": null, \"hidden_act\": \"silu"
    "\", \"hidden_size\": 64, \"initializer_range\": 0.02, \"intermediate_size\": 96, \"layer_types\": ["
    "\"full_attention\", \"full_attention\"], \"max_position_embeddings\": 32768, \"max_window_layers\": "
    "28, \"model_type\": \"qwen2\", \"num_attention_heads\": 4, \"num_hidden_layers\": 2, \"num_key_value"
    "_heads\": 2, \"pad_token_id\": null, \"rms_norm_eps\": 1e-06, \"rope_parameters\": {\"rope_theta\": "
    "10000.0, \"rope_type\": \"default\"}, \"sliding_window\": null, \"tie_word_embeddings\": false, \"tr"
    "ansformers_version\": \"5.24.0\", \"use_cache\": true, \"use_sliding_window\": false, \"vocab_size\""
    ": 100}";

static const char qwen3_config[] =
    "{\"attention_bias\": false, \"attention_dropout\": 0.0, \"bos_token_id\": null, \"eos_token_id\": nu"
    "ll, \"head_dim\": 16, \"hidden_act\": \"silu\", \"hidden_size\": 64, \"initializer_range\": 0.02, \""
    "intermediate_size\": 96, \"layer_types\": [\"full_attention\", \"full_attention\"], \"max_position_e"
    "mbeddings\": 32768, \"max_window_layers\": 28, \"model_type\": \"qwen3\", \"num_attention_heads\": 4"
    ", \"num_hidden_layers\": 2, \"num_key_value_heads\": 2, \"pad_token_id\": null, \"rms_norm_eps\": 1e"
    "-06, \"rope_parameters\": {\"rope_theta\": 10000.0, \"rope_type\": \"default\"}, \"sliding_window\":"
    " null, \"tie_word_embeddings\": false, \"transformers_version\": \"5.24.0\", \"use_cache\": true, \""
    "use_sliding_window\": false, \"vocab_size\": 100}";

/* A dense model type's file of 2 layers, an MLP 96 wide, heads of
 * hidden / heads when head_dim is not given (but Qwen3's). */
static const char *dense_sized(const char *type, int hidden, int heads, const char *extra) {
    static char buf[512];
    snprintf(buf, sizeof buf,
             "{\"model_type\": \"%s\", \"vocab_size\": 100, \"hidden_size\": %d, \"intermediate_size\": 96, "
             "\"num_hidden_layers\": 2, \"num_attention_heads\": %d%s}",
             type, hidden, heads, extra);
    return buf;
}

static const char *dense_with(const char *type, const char *extra) { return dense_sized(type, 4096, 32, extra); }

/* A dense config's model: every layer a dense MLP intermediate_size wide,
 * one expert of top-1 and no other MoE field set (the form of every model
 * without an MoE layer), attention as given. */
static void expect_dense(const moe_model_config *c, const char *type, int64_t width, int64_t window,
                         moe_qk_norm_kind qk_norm, bool qkv_bias) {
    cr_expect(!moe_model_config_has_moe_layer(c) && moe_model_config_dense_layer_count(c) == c->num_hidden_layers,
              "%s: every layer dense", type);
    cr_expect(c->intermediate_size == width && moe_model_config_dense_width(c) == width &&
                  c->moe_dense_intermediate_size == 0,
              "%s: dense width %lld", type, (long long)c->intermediate_size);
    cr_expect(c->num_local_experts == 1 && c->num_experts_per_tok == 1 && c->router_aux_loss_coef == 0.001 &&
                  c->moe_gate == MOE_GATE_SOFTMAX_TOPK && c->moe_renormalize && c->moe_n_shared_experts == 0,
              "%s: the MoE fields at their defaults", type);
    cr_expect_eq(c->sliding_window, window, "%s: window %lld", type, (long long)c->sliding_window);
    cr_expect(c->moe_qk_norm == qk_norm && c->moe_qkv_bias == qkv_bias, "%s: q/k norm and biases", type);
    cr_expect_str_eq(moe_model_config_model_type(c), type);
}

Test(model_config, dense_model_types_as_transformers_read_them, .init = make_tmpdir, .fini = remove_tmpdir) {
    static const struct {
        const char *type, *text;
        int64_t window;
        moe_qk_norm_kind qk_norm;
        bool qkv_bias;
    } files[] = {
        {"llama", llama_config, 0, MOE_QK_NORM_NONE, false},
        {"mistral", mistral_config, 16, MOE_QK_NORM_NONE, false},
        {"qwen2", qwen2_config, 0, MOE_QK_NORM_NONE, true},
        {"qwen3", qwen3_config, 0, MOE_QK_NORM_PER_HEAD, false},
    };
    char path[512];
    snprintf(path, sizeof path, "%s/config.json", tmpdir);
    moe_model_config c;
    warnings w = {0};
    for (size_t i = 0; i < sizeof files / sizeof *files; i++) {
        w.count = 0;
        cr_assert_eq(parse(&c, files[i].text, &w), MOE_OK, "%s: %s", files[i].type, moe_last_error());
        cr_expect_eq(w.count, 0, "%s warned: %s", files[i].type, w.text[0]);
        expect_dense(&c, files[i].type, 96, files[i].window, files[i].qk_norm, files[i].qkv_bias);
        cr_expect(c.hidden_size == 64 && c.num_attention_heads == 4 && c.num_key_value_heads == 2 && c.head_dim == 16 &&
                      c.rope_theta == 1e4 && c.rms_norm_eps == 1e-6,
                  "%s: the attention's sizes", files[i].type);
        expect_round_trip(&c, path);
    }

    /* Their classes' defaults. */
    cr_assert_eq(parse(&c, dense_with("llama", ""), &w), MOE_OK, "%s", moe_last_error());
    cr_expect(c.num_key_value_heads == 32 && c.max_position_embeddings == 2048 && c.head_dim == 128 &&
                  c.rope_theta == 1e4 && c.rms_norm_eps == 1e-6 && c.sliding_window == 0,
              "LlamaConfig's defaults");
    cr_assert_eq(parse(&c, dense_with("mistral", ""), &w), MOE_OK, "%s", moe_last_error());
    cr_expect(c.num_key_value_heads == 8 && c.max_position_embeddings == 131072 && c.sliding_window == 4096,
              "MistralConfig's defaults");
    cr_assert_eq(parse(&c, dense_with("mistral", ", \"sliding_window\": null"), &w), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(c.sliding_window, 0, "null: no window");
    cr_expect_str_eq(moe_model_config_model_type(&c), "llama");
    cr_assert_eq(parse(&c, dense_sized("qwen3", 64, 32, ""), &w), MOE_OK, "%s", moe_last_error());
    cr_expect(c.num_key_value_heads == 32 && c.max_position_embeddings == 32768 && c.head_dim == 128,
              "Qwen3Config's defaults: head_dim 128, not hidden_size // num_attention_heads");
    cr_assert_eq(parse(&c, dense_sized("qwen2", 64, 4, ", \"num_key_value_heads\": null"), &w), MOE_OK, "%s",
                 moe_last_error());
    cr_expect(c.num_key_value_heads == 4 && c.head_dim == 16, "null: num_attention_heads; head_dim derived");

    /* The Qwens' windows: under use_sliding_window, in the layers from
     * max_window_layers (28 when absent) on, or those layer_types says. */
    static const struct {
        const char *extra;
        int64_t window;
    } windows[] = {
        {", \"use_sliding_window\": true", 0},
        {", \"use_sliding_window\": true, \"max_window_layers\": 0", 4096},
        {", \"use_sliding_window\": true, \"max_window_layers\": 0, \"sliding_window\": 64", 64},
        {", \"use_sliding_window\": true, \"max_window_layers\": 0, \"sliding_window\": null", 0},
        {", \"use_sliding_window\": false, \"max_window_layers\": 0, \"sliding_window\": 64", 0},
        {", \"use_sliding_window\": true, \"sliding_window\": 64, \"layer_types\": [\"sliding_attention\", "
         "\"sliding_attention\"]",
         64},
    };
    for (size_t i = 0; i < sizeof windows / sizeof *windows; i++) {
        for (int q = 0; q < 2; q++) {
            const char *text = dense_with(q ? "qwen3" : "qwen2", windows[i].extra);
            cr_assert_eq(parse(&c, text, &w), MOE_OK, "%s: %s", text, moe_last_error());
            cr_expect_eq(c.sliding_window, windows[i].window, "%s: window %lld", text, (long long)c.sliding_window);
        }
    }

    /* Keys of an MoE are not a dense type's; Llama has no window. */
    w.count = 0;
    cr_assert_eq(parse(&c, dense_with("llama", ", \"num_local_experts\": 8, \"sliding_window\": 64"), &w), MOE_OK,
                 "%s", moe_last_error());
    cr_expect(w.count == 2 && warned(&w, "unknown key 'num_local_experts' ignored") &&
                  warned(&w, "sliding_window=64 ignored: model_type llama attends to every position before"),
              "%d: %s", w.count, w.text[0]);
    cr_expect(c.num_local_experts == 1 && c.sliding_window == 0);
    w.count = 0;
    cr_assert_eq(parse(&c, dense_with("llama", ", \"num_experts\": 8"), &w), MOE_OK, "%s", moe_last_error());
    cr_expect(w.count == 1 && warned(&w, "unknown key 'num_experts' ignored") && c.num_local_experts == 1, "%d: %s",
              w.count, w.text[0]);
    /* Qwen2Config and Qwen3Config take a window of 0 as none. */
    cr_assert_eq(parse(&c, dense_with("qwen2", ", \"sliding_window\": 0"), &w), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(c.sliding_window, 0);
    /* LlamaConfig refuses heads that do not divide hidden_size: such a
     * model is saved as a Mistral without a window. */
    cr_assert_eq(parse(&c, dense_sized("llama", 66, 4, ", \"head_dim\": 16"), &w), MOE_OK, "%s", moe_last_error());
    cr_expect_str_eq(moe_model_config_model_type(&c), "mistral");
    expect_round_trip(&c, path);

    const struct {
        const char *type;
        refused_case refused;
    } bad[] = {
        {"llama", {", \"attention_bias\": true", "attention_bias=true is not supported"}},
        {"llama", {", \"mlp_bias\": true", "mlp_bias=true is not supported"}},
        {"qwen3", {", \"attention_bias\": true", "attention_bias=true is not supported"}},
        {"qwen3", {", \"moe_qk_norm\": \"none\"", "model_type qwen3 normalises q and k per head"}},
        {"qwen2", {", \"moe_qkv_bias\": false", "moe_qkv_bias=false disagrees with model_type qwen2's q, k and v "
                                                 "biases"}},
        {"mistral", {", \"moe_qk_norm\": \"per_head\"", "model_type mistral does not normalise q and k"}},
        {"qwen2", {", \"use_sliding_window\": true, \"max_window_layers\": 1",
                   "layer 0 attends without a window, layer 1 within one"}},
        {"qwen3", {", \"layer_types\": [\"full_attention\"]",
                   "layer_types lists 1 layers' attention, and num_hidden_layers=2"}},
        {"qwen3", {", \"layer_types\": [\"full_attention\", \"chunked_attention\"]",
                   "layer_types[1]=\"chunked_attention\" is neither"}},
        {"qwen3", {", \"layer_types\": [\"sliding_attention\", \"sliding_attention\"]",
                   "layer_types calls a layer sliding_attention, and there is no window"}},
        {"qwen3", {", \"head_dim\": null", "head_dim is null, and model_type qwen3 takes an integer"}},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++)
        expect_refused(dense_with(bad[i].type, bad[i].refused.extra), bad[i].refused.want);

    /* Our own file of dense layers only reads as the Llama it is: the MoE
     * fields it gives change nothing the model computes. */
    moe_model_config llama;
    cr_assert_eq(parse(&llama, llama_config, NULL), MOE_OK, "%s", moe_last_error());
    const char *ours = "{\"model_type\": \"moe\", \"vocab_size\": 100, \"hidden_size\": 64, "
                       "\"intermediate_size\": 32, \"moe_dense_intermediate_size\": 96, \"num_hidden_layers\": 2, "
                       "\"moe_dense_layers\": [0, 1], \"num_attention_heads\": 4, \"num_key_value_heads\": 2, "
                       "\"num_local_experts\": 16, \"num_experts_per_tok\": 4, \"moe_gate\": \"sigmoid\", "
                       "\"moe_n_shared_experts\": 2, \"router_aux_loss_coef\": 0.5, \"max_position_embeddings\": "
                       "2048, \"rope_theta\": 10000.0, \"rms_norm_eps\": 1e-06, \"bos_token_id\": 1, "
                       "\"eos_token_id\": 2, \"pad_token_id\": null}";
    cr_assert_eq(parse(&c, ours, NULL), MOE_OK, "%s", moe_last_error());
    expect_same(&c, &llama);
}

/* As transformers 5.24 writes a Qwen2MoeConfig (save_pretrained), the
 * sizes of Qwen1.5-MoE-A2.7B's: read as Qwen2MoeConfig reads it. */
static const char qwen2_moe_config[] =
    "{\"architectures\": [\"Qwen2MoeForCausalLM\"], \"attention_dropout\": 0.0, \"bos_token_id\": 151643, "
    "\"decoder_sparse_step\": 1, \"dtype\": \"bfloat16\", \"eos_token_id\": 151643, \"hidden_act\": \"silu\", "
    "\"hidden_size\": 2048, \"initializer_range\": 0.02, \"intermediate_size\": 5632, "
    "\"layer_types\": [\"full_attention\", \"full_attention\"], \"max_position_embeddings\": 8192, "
    "\"max_window_layers\": 21, \"mlp_only_layers\": [], \"model_type\": \"qwen2_moe\", "
    "\"moe_intermediate_size\": 1408, \"norm_topk_prob\": false, \"num_attention_heads\": 16, "
    "\"num_experts\": 60, \"num_experts_per_tok\": 4, \"num_hidden_layers\": 2, \"num_key_value_heads\": 16, "
    "\"output_router_logits\": false, \"pad_token_id\": null, \"qkv_bias\": true, \"rms_norm_eps\": 1e-06, "
    "\"rope_parameters\": {\"rope_theta\": 1000000.0, \"rope_type\": \"default\"}, "
    "\"router_aux_loss_coef\": 0.001, \"shared_expert_intermediate_size\": 5632, \"sliding_window\": 0, "
    "\"tie_word_embeddings\": false, \"transformers_version\": \"5.24.0\", \"use_cache\": true, "
    "\"use_sliding_window\": false, \"vocab_size\": 151936}";

static const char *qwen2_with(const char *extra) { return family_with("qwen2_moe", extra); }

Test(model_config, qwen2_moe_as_transformers_reads_it) {
    moe_model_config c;
    warnings w = {0};
    cr_assert_eq(parse(&c, qwen2_moe_config, &w), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(w.count, 0, "warned: %s", w.text[0]);
    cr_expect_eq(c.intermediate_size, 1408, "the experts' width is moe_intermediate_size");
    cr_expect(c.moe_n_shared_experts == 1 && c.moe_shared_intermediate_size == 5632 && c.moe_shared_expert_gate,
              "one gated shared expert shared_expert_intermediate_size wide");
    cr_expect(c.moe_qkv_bias && c.moe_qk_norm == MOE_QK_NORM_NONE && !c.moe_renormalize);
    cr_expect_eq(c.num_local_experts, 60);
    cr_expect_eq(c.num_experts_per_tok, 4);
    cr_expect_eq(c.rope_theta, 1e6);
    cr_expect_eq(c.sliding_window, 0);
    cr_expect_str_eq(moe_model_config_model_type(&c), "qwen2_moe");
    moe_layer_config lc;
    moe_model_config_layer(&lc, &c, 16, 1);
    cr_expect(lc.n_shared_experts == 1 && lc.shared_d_ff == 5632 && lc.shared_gate);

    /* Qwen2MoeConfig's defaults, not MixtralConfig's. */
    cr_assert_eq(parse(&c, qwen2_with(""), &w), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(w.count, 0, "warned: %s", w.text[0]);
    cr_expect_eq(c.num_key_value_heads, 16);
    cr_expect_eq(c.max_position_embeddings, 32768);
    cr_expect_eq(c.rope_theta, 1e4);
    cr_expect_eq(c.rms_norm_eps, 1e-6);
    cr_expect(!c.moe_renormalize && c.moe_qkv_bias, "norm_topk_prob false, qkv_bias true");
    /* transformers v5's qkv_bias false: no biases; still a Qwen2-MoE (v4,
     * which has them always, loads it with the biases at 0). */
    cr_assert_eq(parse(&c, qwen2_with(", \"qkv_bias\": false, \"norm_topk_prob\": true"), &w), MOE_OK, "%s",
                 moe_last_error());
    cr_expect(!c.moe_qkv_bias && c.moe_renormalize);
    cr_expect_str_eq(moe_model_config_model_type(&c), "qwen2_moe");
    cr_assert_eq(parse(&c, qwen2_with(", \"moe_n_shared_experts\": 1, \"moe_qkv_bias\": true"), &w), MOE_OK, "%s",
                 moe_last_error());
    cr_assert_eq(parse(&c, qwen2_with(", \"sliding_window\": 64, \"max_window_layers\": 1"), &w), MOE_OK, "%s",
                 moe_last_error());
    cr_expect_eq(c.sliding_window, 0, "a window only under use_sliding_window");

    const refused_case bad[] = {
        {", \"use_sliding_window\": true", "use_sliding_window=true is not supported for model_type qwen2_moe"},
        {", \"layer_types\": [\"full_attention\", \"sliding_attention\"]",
         "a layer_types entry other than \"full_attention\" is not supported"},
        {", \"layer_types\": [1]", "layer_types[0]=1 is neither \"full_attention\" nor \"sliding_attention\""},
        {", \"moe_n_shared_experts\": 2", "moe_n_shared_experts=2 disagrees with model_type qwen2_moe's one shared expert"},
        {", \"moe_shared_expert_gate\": false",
         "moe_shared_expert_gate=false disagrees with model_type qwen2_moe's gated shared expert"},
        {", \"moe_shared_intermediate_size\": 40",
         "moe_shared_intermediate_size=40 disagrees with shared_expert_intermediate_size=48"},
        {", \"moe_shared_intermediate_size\": 0",
         "moe_shared_intermediate_size=0 disagrees with shared_expert_intermediate_size=48"},
        {", \"qkv_bias\": false, \"moe_qkv_bias\": true", "moe_qkv_bias=true disagrees with qkv_bias=false"},
        {", \"moe_qkv_bias\": false", "moe_qkv_bias=false disagrees with qkv_bias (absent: true)"},
        {", \"qkv_bias\": 1", "qkv_bias must be true or false"},
        {", \"moe_qk_norm\": \"per_head\"", "model_type qwen2_moe does not normalise q and k"},
    };
    expect_refused_configs("qwen2_moe", bad, sizeof bad / sizeof *bad);
    const char *no_shared = "{\"model_type\": \"qwen2_moe\", \"vocab_size\": 100, \"hidden_size\": 64, "
                            "\"intermediate_size\": 256, \"moe_intermediate_size\": 32, \"num_hidden_layers\": 2, "
                            "\"num_attention_heads\": 4, \"num_experts\": 8, \"num_experts_per_tok\": 2}";
    cr_expect_eq(parse(&c, no_shared, NULL), MOE_ERR_CONFIG);
    cr_expect(strstr(moe_last_error(), "missing required key 'shared_expert_intermediate_size'") != NULL, "%s",
              moe_last_error());
    char no_width[512];
    snprintf(no_width, sizeof no_width, "%.*s, \"shared_expert_intermediate_size\": 0}", (int)strlen(no_shared) - 1,
             no_shared);
    cr_expect_eq(parse(&c, no_width, NULL), MOE_ERR_CONFIG);
    cr_expect(strstr(moe_last_error(), "shared_expert_intermediate_size=0 is not supported") != NULL, "%s",
              moe_last_error());
    snprintf(no_width, sizeof no_width, "%.*s, \"shared_expert_intermediate_size\": 9223372036854775806}",
             (int)strlen(no_shared) - 1, no_shared);
    cr_expect_eq(parse(&c, no_width, NULL), MOE_ERR_CONFIG);
    cr_expect(strstr(moe_last_error(), "shared_expert_intermediate_size=9223372036854775806 exceeds 1073741823") !=
                  NULL,
              "%s", moe_last_error());
    /* Its keys are no other type's; a Qwen3-MoE has no gate nor biases. */
    w.count = 0;
    cr_assert_eq(parse(&c, qwen3_with(", \"qkv_bias\": true, \"shared_expert_intermediate_size\": 8"), &w), MOE_OK,
                 "%s", moe_last_error());
    cr_expect(!c.moe_qkv_bias && c.moe_n_shared_experts == 0);
    cr_expect_eq(w.count, 2, "%d warnings", w.count);
    cr_expect_eq(parse(&c, qwen3_with(", \"moe_qkv_bias\": true"), NULL), MOE_ERR_CONFIG);
    cr_expect(strstr(moe_last_error(), "moe_qkv_bias=true, and model_type qwen3_moe has none") != NULL, "%s",
              moe_last_error());
    /* Our own keys: a width or a gate without shared experts is refused. */
    cr_expect_eq(parse(&c, config_with("moe_shared_expert_gate", "true"), NULL), MOE_ERR_CONFIG);
    cr_expect(strstr(moe_last_error(), "moe_shared_expert_gate=true needs shared experts") != NULL, "%s",
              moe_last_error());
    cr_expect_eq(parse(&c, config_with("moe_shared_intermediate_size", "16"), NULL), MOE_ERR_CONFIG);
    cr_expect(strstr(moe_last_error(), "moe_shared_intermediate_size needs shared experts") != NULL, "%s",
              moe_last_error());
    /* One width, one form: the routed experts' width is 0, read so from a
     * file, refused in a struct, which would save as another config. */
    cr_assert_eq(parse(&c, config_with("moe_n_shared_experts", "1, \"moe_shared_intermediate_size\": 128"), NULL),
                 MOE_OK, "%s", moe_last_error());
    cr_expect_eq(c.moe_shared_intermediate_size, 0);
    c.moe_shared_intermediate_size = c.intermediate_size;
    cr_expect_eq(moe_model_config_validate(&c, "api"), MOE_ERR_CONFIG);
    cr_expect(strstr(moe_last_error(), "api: moe_shared_intermediate_size=128 is intermediate_size: give 0") != NULL,
              "%s", moe_last_error());
}

/* Shaped like Qwen3-30B-A3B's config.json, but six layers, every other one
 * a dense MLP (decoder_sparse_step 2) and layer 0 one by mlp_only_layers
 * too: read as transformers' Qwen3MoeDecoderLayer builds the layers. */
static const char qwen3_moe_dense_config[] =
    "{\"architectures\": [\"Qwen3MoeForCausalLM\"], \"attention_bias\": false, \"attention_dropout\": 0.0, "
    "\"bos_token_id\": 151643, \"decoder_sparse_step\": 2, \"eos_token_id\": 151645, \"head_dim\": 128, "
    "\"hidden_act\": \"silu\", \"hidden_size\": 2048, \"initializer_range\": 0.02, \"intermediate_size\": 6144, "
    "\"max_position_embeddings\": 40960, \"max_window_layers\": 6, \"mlp_only_layers\": [0], "
    "\"model_type\": \"qwen3_moe\", \"moe_intermediate_size\": 768, \"norm_topk_prob\": true, "
    "\"num_attention_heads\": 32, \"num_experts\": 128, \"num_experts_per_tok\": 8, \"num_hidden_layers\": 6, "
    "\"num_key_value_heads\": 4, \"output_router_logits\": false, \"rms_norm_eps\": 1e-06, \"rope_scaling\": null, "
    "\"rope_theta\": 1000000.0, \"router_aux_loss_coef\": 0.001, \"sliding_window\": null, "
    "\"tie_word_embeddings\": false, \"torch_dtype\": \"bfloat16\", \"transformers_version\": \"4.51.0\", "
    "\"use_cache\": true, \"use_sliding_window\": false, \"vocab_size\": 151936}";

/* transformers' Qwen3MoeDecoderLayer and Qwen2MoeDecoderLayer: layer l is
 * an MoE layer iff l not in mlp_only_layers and (l + 1) %
 * decoder_sparse_step == 0 (num_experts > 0 in every file here). */
static bool qwen_moe_layer(int64_t l, int64_t step, const int64_t *mlp_only, int n_mlp_only) {
    for (int i = 0; i < n_mlp_only; i++)
        if (mlp_only[i] == l) return false;
    return (l + 1) % step == 0;
}

/* c's layers are dense MLPs exactly where that rule says they are not MoE
 * layers, and none is past num_hidden_layers. */
static void expect_qwen_layers(const moe_model_config *c, int64_t step, const int64_t *mlp_only, int n_mlp_only,
                               const char *text) {
    int64_t dense = 0;
    for (int64_t l = 0; l < c->num_hidden_layers; l++) {
        const bool moe = qwen_moe_layer(l, step, mlp_only, n_mlp_only);
        dense += !moe;
        cr_expect_eq(moe_model_config_layer_is_dense(c, l), !moe, "%s: layer %lld", text, (long long)l);
    }
    cr_expect_eq(moe_model_config_dense_layer_count(c), dense, "%s", text);
    cr_expect(!moe_model_config_layer_is_dense(c, c->num_hidden_layers), "%s: a layer past the model's", text);
}

Test(model_config, qwen_dense_layers_as_transformers_reads_them) {
    moe_model_config c;
    warnings w = {0};
    cr_assert_eq(parse(&c, qwen3_moe_dense_config, &w), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(w.count, 0, "warned: %s", w.text[0]);
    const int64_t first[] = {0};
    expect_qwen_layers(&c, 2, first, 1, "Qwen3 dense");
    cr_expect(moe_model_config_layer_is_dense(&c, 0) && !moe_model_config_layer_is_dense(&c, 1) &&
                  moe_model_config_layer_is_dense(&c, 4) && !moe_model_config_layer_is_dense(&c, 5),
              "layers 0, 2 and 4 dense, 1, 3 and 5 MoE");
    cr_expect_eq(c.intermediate_size, 768, "the experts' width is moe_intermediate_size");
    cr_expect_eq(c.moe_dense_intermediate_size, 6144, "the dense layers' width is intermediate_size");
    cr_expect_eq(moe_model_config_dense_width(&c), 6144);
    cr_expect_eq(c.num_local_experts, 128);
    cr_expect_str_eq(moe_model_config_model_type(&c), "qwen3_moe");
    moe_layer_config lc;
    moe_model_config_layer(&lc, &c, 16, 1);
    cr_expect_eq(lc.d_ff, 768, "the MoE layers' experts");

    /* The whole of mlp_only_layers counts (entries that name no layer
     * ignored, a repeat harmless), with decoder_sparse_step; Qwen2-MoE's
     * dense layers replace the shared expert too, its MoE layers keep it. */
    const struct {
        const char *type, *extra;
        int64_t step, mlp_only[2];
        int n_mlp_only;
    } cases[] = {
        {"qwen3_moe", ", \"mlp_only_layers\": [5, 3, 99, -1, 3, 1180591620717411303424]", 1, {5, 3}, 2},
        {"qwen3_moe", ", \"decoder_sparse_step\": 2, \"mlp_only_layers\": [0, 3]", 2, {0, 3}, 2},
        {"qwen3_moe", ", \"decoder_sparse_step\": 3", 3, {0}, 0},
        {"qwen3_moe", ", \"decoder_sparse_step\": 1, \"mlp_only_layers\": []", 1, {0}, 0},
        {"qwen3_moe", ", \"decoder_sparse_step\": -2", 2, {0}, 0}, /* Python's (l + 1) % -2 is 0 where % 2 is */
        {"qwen2_moe", ", \"decoder_sparse_step\": 3, \"mlp_only_layers\": [0]", 3, {0}, 1},
        {"qwen2_moe", ", \"mlp_only_layers\": [1, 4]", 1, {1, 4}, 2},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        const char *text = family_layers_with(cases[i].type, 6, cases[i].extra);
        w.count = 0;
        cr_assert_eq(parse(&c, text, &w), MOE_OK, "%s: %s", text, moe_last_error());
        cr_expect_eq(w.count, 0, "%s warned: %s", text, w.text[0]);
        expect_qwen_layers(&c, cases[i].step, cases[i].mlp_only, cases[i].n_mlp_only, text);
        const bool dense = moe_model_config_dense_layer_count(&c) > 0;
        cr_expect_eq(c.intermediate_size, 32, "%s", text);
        cr_expect_eq(c.moe_dense_intermediate_size, dense ? 256 : 0, "%s: the file's intermediate_size when used",
                     text);
        cr_expect_str_eq(moe_model_config_model_type(&c), cases[i].type, "%s", text);
        if (strcmp(cases[i].type, "qwen2_moe") == 0)
            cr_expect(c.moe_n_shared_experts == 1 && c.moe_shared_intermediate_size == 48, "%s", text);
    }

    /* intermediate_size absent: Qwen3MoeConfig's default 6144,
     * Qwen2MoeConfig's 5632; the experts' width: 0, its one form. */
    const struct {
        const char *type, *width; /* width NULL: absent */
        int64_t stored, dense_width;
    } widths[] = {
        {"qwen3_moe", NULL, 6144, 6144}, {"qwen2_moe", NULL, 5632, 5632},
        {"qwen3_moe", "32", 0, 32},      {"qwen2_moe", "96", 96, 96},
    };
    for (size_t i = 0; i < sizeof widths / sizeof *widths; i++) {
        const bool qwen2 = strcmp(widths[i].type, "qwen2_moe") == 0;
        char text[512], width[48] = "";
        if (widths[i].width != NULL) snprintf(width, sizeof width, "\"intermediate_size\": %s, ", widths[i].width);
        snprintf(text, sizeof text,
                 "{\"model_type\": \"%s\", \"vocab_size\": 100, \"hidden_size\": 64, %s\"moe_intermediate_size\": 32, "
                 "%s\"num_hidden_layers\": 2, \"num_attention_heads\": %d, \"num_experts\": 8, "
                 "\"num_experts_per_tok\": 2, \"mlp_only_layers\": [1]}",
                 widths[i].type, width, qwen2 ? "\"shared_expert_intermediate_size\": 48, " : "", qwen2 ? 16 : 4);
        cr_assert_eq(parse(&c, text, NULL), MOE_OK, "%s: %s", text, moe_last_error());
        cr_expect(!moe_model_config_layer_is_dense(&c, 0) && moe_model_config_layer_is_dense(&c, 1), "%s", text);
        cr_expect_eq(c.moe_dense_intermediate_size, widths[i].stored, "%s", text);
        cr_expect_eq(moe_model_config_dense_width(&c), widths[i].dense_width, "%s", text);
    }
    /* Without a dense layer intermediate_size is unused, as before; with one
     * it is a width. */
    const char *no_width = "{\"model_type\": \"qwen3_moe\", \"vocab_size\": 100, \"hidden_size\": 64, "
                           "\"intermediate_size\": 0, \"moe_intermediate_size\": 32, \"num_hidden_layers\": 2, "
                           "\"num_attention_heads\": 4, \"num_experts\": 8, \"num_experts_per_tok\": 2%s}";
    char text[512];
    snprintf(text, sizeof text, no_width, "");
    cr_assert_eq(parse(&c, text, NULL), MOE_OK, "%s: %s", text, moe_last_error());
    cr_expect(moe_model_config_dense_layer_count(&c) == 0 && c.moe_dense_intermediate_size == 0);
    snprintf(text, sizeof text, no_width, ", \"mlp_only_layers\": [0]");
    cr_expect_eq(parse(&c, text, NULL), MOE_ERR_CONFIG, "%s was accepted", text);
    cr_expect(strstr(moe_last_error(), "t/config.json: intermediate_size=0 must be positive") != NULL, "%s",
              moe_last_error());

    /* Our keys beside the Qwen ones: accepted when they agree. */
    const char *agree[] = {
        ", \"mlp_only_layers\": [0], \"moe_dense_layers\": [0], \"moe_dense_intermediate_size\": 256",
        ", \"moe_dense_layers\": []",
        ", \"moe_dense_layers\": null",
        ", \"decoder_sparse_step\": 2, \"moe_dense_layers\": [0], \"moe_dense_intermediate_size\": 256",
    };
    for (size_t i = 0; i < sizeof agree / sizeof *agree; i++)
        cr_expect_eq(parse(&c, qwen3_with(agree[i]), NULL), MOE_OK, "%s: %s", agree[i], moe_last_error());
    cr_expect(moe_model_config_layer_is_dense(&c, 0) && c.moe_dense_intermediate_size == 256,
              "the dense layers stay intermediate_size=256 wide");

    /* Every layer dense: a dense baseline, as transformers builds it. */
    const char *all_dense[] = {", \"mlp_only_layers\": [0, 1]", ", \"decoder_sparse_step\": 3"};
    for (size_t i = 0; i < sizeof all_dense / sizeof *all_dense; i++) {
        cr_expect_eq(parse(&c, qwen3_with(all_dense[i]), NULL), MOE_OK, "%s: %s", all_dense[i], moe_last_error());
        cr_expect_eq(moe_model_config_dense_layer_count(&c), 2, "%s: every layer dense", all_dense[i]);
    }

    const refused_case bad[] = {
        {", \"decoder_sparse_step\": 0", "t/config.json: decoder_sparse_step=0 is no step"},
        {", \"decoder_sparse_step\": null", "t/config.json: decoder_sparse_step=null is no step"},
        {", \"mlp_only_layers\": null", "t/config.json: mlp_only_layers=null is no list of layers"},
        {", \"decoder_sparse_step\": 1.5", "t/config.json: decoder_sparse_step must be an integer, got 1.5"},
        {", \"mlp_only_layers\": [0, 1.5]", "t/config.json: mlp_only_layers[1] must be an integer, got 1.5"},
        {", \"moe_dense_layers\": [1]",
         "t/config.json: moe_dense_layers lists layer 1, which model_type qwen3_moe's decoder_sparse_step=1 and "
         "mlp_only_layers make an MoE layer"},
        {", \"mlp_only_layers\": [0], \"moe_dense_layers\": []",
         "t/config.json: moe_dense_layers does not list layer 0, which model_type qwen3_moe's decoder_sparse_step=1 "
         "and mlp_only_layers make a dense MLP"},
        {", \"mlp_only_layers\": [0], \"moe_dense_layers\": [0, 5]",
         "t/config.json: moe_dense_layers lists layer 5, past num_hidden_layers=2"},
        {", \"mlp_only_layers\": [0], \"moe_dense_intermediate_size\": 100",
         "t/config.json: moe_dense_intermediate_size=100 disagrees with intermediate_size=256"},
        {", \"mlp_only_layers\": [0], \"moe_dense_intermediate_size\": 32",
         "t/config.json: moe_dense_intermediate_size=32 disagrees with intermediate_size=256"},
        {", \"moe_dense_intermediate_size\": 100",
         "t/config.json: moe_dense_intermediate_size=100 needs dense layers (moe_dense_layers lists none)"},
    };
    expect_refused_configs("qwen3_moe", bad, sizeof bad / sizeof *bad);
    const refused_case bad2[] = {
        {", \"decoder_sparse_step\": 0", "t/config.json: decoder_sparse_step=0 is no step"},
        {", \"decoder_sparse_step\": 2, \"moe_dense_layers\": [1]",
         "t/config.json: moe_dense_layers does not list layer 0, which model_type qwen2_moe's decoder_sparse_step=2 "
         "and mlp_only_layers make a dense MLP"},
    };
    expect_refused_configs("qwen2_moe", bad2, sizeof bad2 / sizeof *bad2);
    /* intermediate_size null: absent would be the default width, but
     * transformers builds no MLP of null. */
    static const char null_width[] =
        "{\"model_type\": \"qwen3_moe\", \"vocab_size\": 100, \"hidden_size\": 64, \"intermediate_size\": null, "
        "\"moe_intermediate_size\": 32, \"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"num_experts\": 8, "
        "\"num_experts_per_tok\": 2, \"mlp_only_layers\": [1]}";
    cr_expect_eq(parse(&c, null_width, NULL), MOE_ERR_CONFIG, "intermediate_size null with a dense layer accepted");
    cr_expect(strstr(moe_last_error(),
                     "t/config.json: intermediate_size=null gives model_type qwen3_moe's dense MLP layers no width"),
              "%s", moe_last_error());
}

/* moe_dense_layers and moe_dense_intermediate_size in a file of any type. */
Test(model_config, dense_layers_of_our_keys) {
    moe_model_config c;
    warnings w = {0};
    cr_assert_eq(parse(&c, config_with("moe_dense_layers", "[1]"), &w), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(w.count, 0, "warned: %s", w.text[0]);
    cr_expect(!moe_model_config_layer_is_dense(&c, 0) && moe_model_config_layer_is_dense(&c, 1));
    cr_expect_eq(moe_model_config_dense_layer_count(&c), 1);
    cr_expect_eq(c.moe_dense_intermediate_size, 0);
    cr_expect_eq(moe_model_config_dense_width(&c), 128, "0: intermediate_size");
    cr_expect_str_eq(moe_model_config_model_type(&c), "moe", "Mixtral has no dense layers");
    cr_assert_eq(parse(&c, config_with("num_hidden_layers", "6, \"moe_dense_layers\": [5, 0, 3]"), &w), MOE_OK, "%s",
                 moe_last_error());
    for (int64_t l = 0; l < 6; l++)
        cr_expect_eq(moe_model_config_layer_is_dense(&c, l), l == 0 || l == 3 || l == 5, "layer %lld", (long long)l);
    const struct {
        const char *width;
        int64_t stored;
    } widths[] = {{"96", 96}, {"128", 0}, {"0", 0}};
    for (size_t i = 0; i < sizeof widths / sizeof *widths; i++) {
        char value[64];
        snprintf(value, sizeof value, "[0], \"moe_dense_intermediate_size\": %s", widths[i].width);
        cr_assert_eq(parse(&c, config_with("moe_dense_layers", value), &w), MOE_OK, "%s", moe_last_error());
        cr_expect_eq(c.moe_dense_intermediate_size, widths[i].stored, "%s", value);
    }
    cr_assert_eq(parse(&c, config_with("moe_dense_layers", "null"), &w), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(moe_model_config_dense_layer_count(&c), 0);
    cr_assert_eq(parse(&c, config_with("moe_dense_layers", "[1, 0]"), &w), MOE_OK, "every layer: %s",
                 moe_last_error());
    cr_expect_eq(moe_model_config_dense_layer_count(&c), 2);

    const struct {
        const char *key, *value, *want;
    } bad[] = {
        {"moe_dense_layers", "[0, 0]", "t/config.json: moe_dense_layers[1]=0 repeats an earlier entry"},
        {"moe_dense_layers", "[2]", "t/config.json: moe_dense_layers lists layer 2, past num_hidden_layers=2"},
        {"moe_dense_layers", "[-1]", "t/config.json: moe_dense_layers[0]=-1 is no layer number (0 to 65535)"},
        {"moe_dense_layers", "[0, 65536]", "t/config.json: moe_dense_layers[1]=65536 is no layer number (0 to 65535)"},
        {"moe_dense_layers", "[0.5]", "t/config.json: moe_dense_layers[0] must be an integer, got 0.5"},
        {"moe_dense_layers", "[\"0\"]", "t/config.json: moe_dense_layers[0] must be an integer, got \"0\""},
        {"moe_dense_layers", "1", "t/config.json: moe_dense_layers must be a list of layer numbers, got 1"},
        {"moe_dense_intermediate_size", "96",
         "t/config.json: moe_dense_intermediate_size=96 needs dense layers (moe_dense_layers lists none)"},
        {"moe_dense_layers", "[0], \"moe_dense_intermediate_size\": -1",
         "t/config.json: moe_dense_intermediate_size=-1 must be in [0, 1073741823] (0: intermediate_size)"},
        {"moe_dense_layers", "[0], \"moe_dense_intermediate_size\": 1073741824",
         "t/config.json: moe_dense_intermediate_size=1073741824 must be in [0, 1073741823]"},
        {"moe_dense_intermediate_size", "\"96\"",
         "t/config.json: moe_dense_intermediate_size must be an integer, got \"96\""},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        const char *text = config_with(bad[i].key, bad[i].value);
        cr_expect_eq(parse(&c, text, NULL), MOE_ERR_CONFIG, "accepted %s", text);
        cr_expect(strstr(moe_last_error(), bad[i].want) != NULL, "%s:\n  \"%s\"\n  lacks \"%s\"", text,
                  moe_last_error(), bad[i].want);
    }
}

/* A capacity factor drops pairs only where a layer routes: a model of
 * dense layers only generates and scores alone whatever its factor. */
Test(model_config, capacity_drops_only_in_moe_layers) {
    moe_model_config c;
    moe_model_config_default_small(&c, 256);
    cr_expect(!moe_model_config_drops_pairs(&c), "dropless by default");
    c.moe_capacity_factor = 1.25;
    cr_expect(moe_model_config_drops_pairs(&c), "a factor on MoE layers");
    c.moe_dense_layers[0] = 0x7;
    cr_expect(moe_model_config_drops_pairs(&c), "one MoE layer left");
    c.moe_dense_layers[0] = 0xf;
    cr_expect(!moe_model_config_drops_pairs(&c), "every layer dense");
}

/* A struct filled by hand is checked as a file is, and the dense layers'
 * bytes count against int64 as the experts' do. */
Test(model_config, dense_layers_validated_in_the_struct) {
    moe_model_config c;
    moe_model_config_default_small(&c, 256);
    cr_assert_eq(moe_model_config_dense_layer_count(&c), 0);
    const struct {
        int word;
        uint64_t bits;
        int64_t width;
        const char *want; /* NULL: valid */
    } cases[] = {
        {0, 0x5, 0, NULL},
        {0, 0x5, 96, NULL},
        {0, 0x10, 0, "small: moe_dense_layers lists layer 4, past num_hidden_layers=4"},
        {1023, (uint64_t)1 << 63, 0, "small: moe_dense_layers lists layer 65535, past num_hidden_layers=4"},
        {0, 0xf, 0, NULL}, /* every layer: a dense baseline */
        {0, 0x5, 256, "small: moe_dense_intermediate_size=256 is intermediate_size: give 0, its one form"},
        {0, 0x0, 96, "small: moe_dense_intermediate_size=96 needs dense layers (moe_dense_layers lists none)"},
        {0, 0x5, -1, "small: moe_dense_intermediate_size=-1 must be in [0, 1073741823]"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        moe_model_config b = c;
        b.moe_dense_layers[cases[i].word] = cases[i].bits;
        b.moe_dense_intermediate_size = cases[i].width;
        const moe_status st = moe_model_config_validate(&b, "small");
        cr_expect_eq(st, cases[i].want ? MOE_ERR_CONFIG : MOE_OK, "case %zu: %s", i, moe_last_error());
        if (cases[i].want)
            cr_expect(strstr(moe_last_error(), cases[i].want) != NULL, "case %zu: %s\n  lacks %s", i, moe_last_error(),
                      cases[i].want);
    }

    /* One dense layer 2^30 - 1 wide on a d of 2^30 - 1: the MoE layers'
     * bytes fit, the dense layer's three matrices do not. */
    moe_model_config big = c;
    big.hidden_size = 1073741823;
    big.head_dim = 2;
    big.num_attention_heads = big.num_key_value_heads = 1;
    big.intermediate_size = 1;
    big.num_local_experts = big.num_experts_per_tok = 1;
    cr_expect_eq(moe_model_config_validate(&big, "big"), MOE_OK, "without the dense layer: %s", moe_last_error());
    big.moe_dense_layers[0] = 0x1;
    big.moe_dense_intermediate_size = 1073741823;
    cr_expect_eq(moe_model_config_validate(&big, "big"), MOE_ERR_CONFIG);
    cr_expect(strstr(moe_last_error(), "big: hidden_size=1073741823 x the dense layers' width 1073741823 overflows "
                                       "their byte count") != NULL,
              "%s", moe_last_error());

    /* 17 layers of d 2^28: one dense MLP 2^30 - 1 wide fits, sixteen are
     * more than 2^63 bytes. The reference count, in long double, counts
     * each layer as what it is. */
    moe_model_config deep = big;
    deep.hidden_size = (int64_t)1 << 28;
    deep.num_hidden_layers = 17;
    const int dense_layers[2] = {1, 16};
    for (int i = 0; i < 2; i++) {
        deep.moe_dense_layers[0] = ((uint64_t)1 << dense_layers[i]) - 1;
        const long double d = (long double)deep.hidden_size, n_dense = dense_layers[i];
        const long double attention = 2 * d + 4 * 2 * d + 4;
        const long double params = 17 * attention + (17 - n_dense) * (2 * d + 3 * d) +
                                   n_dense * 3 * d * (long double)deep.moe_dense_intermediate_size + (2 * 256 + 1) * d;
        const bool fits = params * 4 <= (long double)INT64_MAX;
        cr_expect_eq(fits, i == 0, "the reference count: %Lg parameters", params);
        const moe_status st = moe_model_config_validate(&deep, "deep");
        cr_expect_eq(st, fits ? MOE_OK : MOE_ERR_CONFIG, "%d dense layers: %Lg parameters, got %s (%s)",
                     dense_layers[i], params, moe_status_string(st), moe_last_error());
        if (!fits)
            cr_expect(strstr(moe_last_error(), "deep: the parameter bytes of num_hidden_layers=17 layers of "
                                               "hidden_size=268435456") != NULL &&
                          strstr(moe_last_error(), "16 dense layers x the width 1073741823, and vocab_size=256 "
                                                   "overflow int64") != NULL,
                      "%s", moe_last_error());
    }
}

/* The integers of list key in the saved file's root r are want [n]. */
static void expect_int_list(const moe_json *r, const char *key, const int64_t *want, size_t n, const char *what) {
    const moe_json *v = moe_json_get(r, key);
    cr_assert(v != NULL && v->type == MOE_JSON_ARRAY, "%s: %s is no list", what, key);
    cr_expect_eq(v->array.count, n, "%s: %s holds %zu entries", what, key, v->array.count);
    for (size_t i = 0; i < n && i < v->array.count; i++) {
        int64_t got = -1;
        cr_expect(moe_json_int64(&v->array.items[i], &got) == MOE_OK && got == want[i], "%s: %s[%zu] is %lld, not %lld",
                  what, key, i, (long long)got, (long long)want[i]);
    }
}

/* The saved file's key is the integer want; want -1: absent. */
static void expect_int_key(const moe_json *r, const char *key, int64_t want, const char *what) {
    const moe_json *v = moe_json_get(r, key);
    int64_t got = -1;
    if (v != NULL) cr_expect_eq(moe_json_int64(v, &got), MOE_OK, "%s: %s is no integer", what, key);
    cr_expect_eq(got, want, "%s: %s is %lld, not %lld", what, key, (long long)got, (long long)want);
}

/* Dense layers save as their model type says them and load back equal: a
 * Qwen's as decoder_sparse_step 1, mlp_only_layers and intermediate_size,
 * ours (Mixtral's and OLMoE's cannot) as moe_dense_layers. */
Test(model_config, dense_layers_round_trip, .init = make_tmpdir, .fini = remove_tmpdir) {
    char path[512];
    snprintf(path, sizeof path, "%s/config.json", tmpdir);
    moe_model_config qwen3, qwen2, qwen3_narrow, ours, mixtral, olmoe;
    cr_assert_eq(parse(&qwen3, qwen3_moe_dense_config, NULL), MOE_OK, "%s", moe_last_error());
    cr_assert_eq(parse(&qwen2, family_layers_with("qwen2_moe", 6, ", \"decoder_sparse_step\": 3"), NULL), MOE_OK, "%s",
                 moe_last_error());
    moe_model_config_default_small(&qwen3_narrow, 256);
    qwen3_narrow.moe_qk_norm = MOE_QK_NORM_PER_HEAD;
    qwen3_narrow.moe_dense_layers[0] = 0x2;
    moe_model_config_default_small(&ours, 256);
    ours.moe_dense_layers[0] = 0x5;
    ours.moe_dense_intermediate_size = 96;
    cr_assert_eq(parse(&mixtral, config_with("moe_dense_layers", "[1]"), NULL), MOE_OK, "%s", moe_last_error());
    moe_model_config_default_small(&olmoe, 256);
    olmoe.moe_qk_norm = MOE_QK_NORM_ACROSS_HEADS;
    olmoe.moe_dense_layers[0] = 0x8;
    const int64_t qwen3_layers[] = {0, 2, 4}, qwen2_layers[] = {0, 1, 3, 4}, one[] = {1}, two[] = {0, 2}, three[] = {3};
    const struct {
        const char *what;
        const moe_model_config *c;
        const char *type;
        const int64_t *layers;
        size_t n;
        int64_t width, experts; /* intermediate_size and moe_intermediate_size, or moe_dense_intermediate_size and -1 */
    } cases[] = {
        {"qwen3_moe", &qwen3, "qwen3_moe", qwen3_layers, 3, 6144, 768},
        {"qwen2_moe", &qwen2, "qwen2_moe", qwen2_layers, 4, 256, 32},
        {"qwen3_moe of the experts' width", &qwen3_narrow, "qwen3_moe", one, 1, 256, 256},
        {"ours", &ours, "moe", two, 2, 96, -1},
        {"mixtral's file", &mixtral, "moe", one, 1, -1, -1},
        {"olmoe's", &olmoe, "moe", three, 1, -1, -1},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        const char *what = cases[i].what;
        expect_round_trip(cases[i].c, path);
        moe_json_doc *doc;
        cr_assert_eq(moe_json_parse_file(&doc, path, 1 << 20), MOE_OK, "%s", moe_last_error());
        const moe_json *r = moe_json_root(doc);
        cr_expect_str_eq(moe_json_text(moe_json_get(r, "model_type")), cases[i].type, "%s", what);
        const bool qwen = cases[i].experts >= 0;
        if (qwen) {
            expect_int_key(r, "decoder_sparse_step", 1, what);
            expect_int_list(r, "mlp_only_layers", cases[i].layers, cases[i].n, what);
            expect_int_key(r, "intermediate_size", cases[i].width, what);
            expect_int_key(r, "moe_intermediate_size", cases[i].experts, what);
            expect_int_key(r, "moe_dense_intermediate_size", -1, what);
            cr_expect_null(moe_json_get(r, "moe_dense_layers"), "%s", what);
        } else {
            expect_int_list(r, "moe_dense_layers", cases[i].layers, cases[i].n, what);
            expect_int_key(r, "moe_dense_intermediate_size", cases[i].width, what);
            cr_expect_null(moe_json_get(r, "mlp_only_layers"), "%s", what);
        }
        moe_json_free(doc);
    }
}

/* What moe_model_config_save wrote for moe_model_config_default_small(256)
 * before dense layers existed. */
static const char small_config_text[] = "{\n"
                                        "  \"architectures\": [\n"
                                        "    \"MixtralForCausalLM\"\n"
                                        "  ],\n"
                                        "  \"model_type\": \"mixtral\",\n"
                                        "  \"hidden_act\": \"silu\",\n"
                                        "  \"torch_dtype\": \"float32\",\n"
                                        "  \"vocab_size\": 256,\n"
                                        "  \"hidden_size\": 128,\n"
                                        "  \"intermediate_size\": 256,\n"
                                        "  \"num_hidden_layers\": 4,\n"
                                        "  \"num_attention_heads\": 4,\n"
                                        "  \"num_key_value_heads\": 2,\n"
                                        "  \"head_dim\": 32,\n"
                                        "  \"num_local_experts\": 8,\n"
                                        "  \"num_experts_per_tok\": 2,\n"
                                        "  \"max_position_embeddings\": 131072,\n"
                                        "  \"sliding_window\": null,\n"
                                        "  \"rope_theta\": 10000.0,\n"
                                        "  \"rms_norm_eps\": 1e-05,\n"
                                        "  \"router_aux_loss_coef\": 0.01,\n"
                                        "  \"router_jitter_noise\": 0.0,\n"
                                        "  \"initializer_range\": 0.02,\n"
                                        "  \"tie_word_embeddings\": false,\n"
                                        "  \"moe_gate\": \"softmax_topk\",\n"
                                        "  \"moe_renormalize\": true,\n"
                                        "  \"moe_capacity_factor\": 0.0,\n"
                                        "  \"moe_z_loss_coef\": 0.0,\n"
                                        "  \"moe_seq_aux_loss_coef\": 0.0,\n"
                                        "  \"moe_n_shared_experts\": 0,\n"
                                        "  \"moe_bias_update_rate\": 0.0,\n"
                                        "  \"moe_n_group\": 0,\n"
                                        "  \"moe_topk_group\": 0,\n"
                                        "  \"moe_routed_scaling_factor\": 1.0\n"
                                        "}\n";

/* A config without dense layers saves byte for byte as before they
 * existed, so that a checkpoint keeps its config's checksum: the small
 * config's text, and the CRC-32C of one config of each model type as the
 * writer without dense layers computed them. */
Test(model_config, configs_without_dense_layers_render_as_before, .init = make_tmpdir, .fini = remove_tmpdir) {
    char path[512];
    snprintf(path, sizeof path, "%s/config.json", tmpdir);
    moe_model_config c;
    moe_model_config_default_small(&c, 256);
    cr_assert_eq(moe_model_config_save(&c, path), MOE_OK, "%s", moe_last_error());
    char *text;
    size_t n;
    cr_assert_eq(moe_file_read_all(&text, &n, path, 1 << 20), MOE_OK);
    cr_expect(n == strlen(small_config_text) && memcmp(text, small_config_text, n) == 0, "wrote:\n%.*s", (int)n, text);
    free(text);
    const struct {
        const char *type;
        uint32_t crc;
    } before[] = {{"mixtral", 0xe6ba2e7d}, {"qwen3_moe", 0xc0f29545}, {"qwen2_moe", 0x97968a35},
                  {"olmoe", 0xa17e9443},   {"moe", 0xb0505b28}};
    for (size_t i = 0; i < sizeof before / sizeof *before; i++) {
        moe_model_config_default_small(&c, 256);
        if (i == 1) c.moe_qk_norm = MOE_QK_NORM_PER_HEAD;
        if (i == 2) {
            c.moe_n_shared_experts = 1;
            c.moe_shared_expert_gate = c.moe_qkv_bias = true;
            c.moe_shared_intermediate_size = 96;
        }
        if (i == 3) c.moe_qk_norm = MOE_QK_NORM_ACROSS_HEADS;
        if (i == 4) {
            c.moe_gate = MOE_GATE_SIGMOID;
            c.moe_n_shared_experts = 2;
        }
        uint32_t crc = 0;
        cr_assert_eq(moe_model_config_crc32c(&c, &crc), MOE_OK, "%s", moe_last_error());
        cr_expect_str_eq(moe_model_config_model_type(&c), before[i].type);
        cr_expect_eq(crc, before[i].crc, "%s: crc32c 0x%08x, before 0x%08x", before[i].type, crc, before[i].crc);
    }
}

/* Ranks and --resume compare the configs field by field
 * (moe_config_agree_fields): each field that makes another model is one. */
Test(model_config, every_model_field_is_compared) {
    moe_model_config a;
    moe_model_config_default_small(&a, 64);
    a.moe_n_shared_experts = 1;
    for (int i = 0; i < 3; i++) {
        moe_model_config b = a;
        if (i == 0) b.moe_qkv_bias = true;
        if (i == 1) b.moe_shared_expert_gate = true;
        if (i == 2) b.moe_shared_intermediate_size = 7;
        cr_assert_eq(moe_model_config_validate(&b, "b"), MOE_OK, "%s", moe_last_error());
        moe_agree_field fa[MOE_CONFIG_AGREE_FIELDS], fb[MOE_CONFIG_AGREE_FIELDS];
        const int n = moe_config_agree_fields(fa, &a);
        cr_assert_eq(moe_config_agree_fields(fb, &b), n);
        cr_assert(n <= MOE_CONFIG_AGREE_FIELDS);
        int differ = 0;
        for (int k = 0; k < n; k++) differ += fa[k].value != fb[k].value;
        cr_expect_eq(differ, 1, "case %d: %d fields differ", i, differ);
    }
}

/* The population std of the model's matrices (every 2-D tensor), from its
 * host parameters; *ones: whether every norm weight is 1. */
static double matrix_std(moe_model *m, bool *ones) {
    const float *p = moe_model_host_params(m);
    double sum = 0.0, sumsq = 0.0;
    int64_t n = 0;
    *ones = true;
    for (int64_t i = 0; i < moe_model_tensor_count(m); i++) {
        const moe_model_tensor *t = moe_model_tensor_at(m, i);
        for (int64_t j = 0; j < t->numel; j++) {
            const double x = p[t->offset + j];
            if (t->ndim == 1) {
                *ones &= x == 1.0;
                continue;
            }
            sum += x, sumsq += x * x, n++;
        }
    }
    const double mean = sum / (double)n;
    return sqrt(sumsq / (double)n - mean * mean);
}

/* initializer_range is the std of the initial weights, as in transformers;
 * the default, 0.02, gives bit for bit the weights the fixed 0.02f gave. */
Test(model_config, initializer_range_sets_the_initial_std) {
    moe_model_config c;
    moe_model_config_default_small(&c, 256);
    c.hidden_size = 64, c.intermediate_size = 64, c.num_hidden_layers = 2, c.head_dim = 16;
    const uint64_t seed = 7;
    /* About 200k weights: the sample std is within 0.3% of the true one
     * (relative standard error 1 / sqrt(2 n)), so 2% cannot fail by chance. */
    const double stds[] = {0.02, 0.5, 1e-3};
    for (size_t k = 0; k < sizeof stds / sizeof *stds; k++) {
        c.initializer_range = stds[k];
        moe_model *m = NULL;
        cr_assert_eq(moe_model_create(&m, &c, 1, 8, seed), MOE_OK, "%s", moe_last_error());
        cr_assert_not_null(moe_model_host_params(m), "the CPU model's parameters are on the host");
        bool ones;
        const double got = matrix_std(m, &ones);
        cr_expect(fabs(got / stds[k] - 1.0) < 0.02, "initializer_range %g: the weights' std is %g", stds[k], got);
        cr_expect(ones, "initializer_range %g: a norm weight is not 1", stds[k]);
        cr_expect_eq(moe_model_get_config(m)->initializer_range, stds[k]);
        if (k == 0) {
            /* The default's weights are 0.02f x the seeded normal draws. */
            const float *p = moe_model_host_params(m);
            int64_t wrong = 0, first = -1;
            for (int64_t i = 0; i < moe_model_tensor_count(m); i++) {
                const moe_model_tensor *t = moe_model_tensor_at(m, i);
                for (int64_t j = 0; t->ndim == 2 && j < t->numel; j++) {
                    const float want = 0.02f * moe_rng_normal(seed, (uint64_t)t->init_stream, (uint64_t)j);
                    if (p[t->offset + j] != want && wrong++ == 0) first = t->offset + j;
                }
            }
            cr_expect_eq(wrong, 0, "%lld weights differ from 0.02f x N(0, 1), the first at %lld", (long long)wrong,
                         (long long)first);
        }
        moe_model_destroy(m);
    }
}

/* One token id key as a test expects it: form, then the ids. */
typedef struct token_ids_want {
    moe_token_id_form form;
    int n;
    int64_t ids[4];
} token_ids_want;

static void expect_token_ids(const moe_token_ids *got, const token_ids_want *want, const char *key,
                             const char *text) {
    cr_expect_eq(got->form, want->form, "%s: %s read as form %d, not %d", text, key, (int)got->form, (int)want->form);
    cr_expect_eq(got->n, want->n, "%s: %s holds %d ids, not %d", text, key, got->n, want->n);
    for (int i = 0; i < want->n && i < got->n; i++)
        cr_expect_eq(got->ids[i], want->ids[i], "%s: %s[%d] is %lld, not %lld", text, key, i, (long long)got->ids[i],
                     (long long)want->ids[i]);
}

/* The written file's value of key as its form says: left out when absent,
 * null, an integer literal, or a list of integer literals. */
static void expect_written(const moe_json *root, const char *key, const token_ids_want *want, const char *text) {
    const moe_json *v = moe_json_get(root, key);
    if (want->form == MOE_TOKEN_ID_ABSENT) {
        cr_expect_null(v, "%s: %s was absent and is written", text, key);
        return;
    }
    cr_assert_not_null(v, "%s: %s is not written", text, key);
    if (want->form == MOE_TOKEN_ID_NULL) {
        cr_expect_eq(v->type, MOE_JSON_NULL, "%s: %s null is written as a %s", text, key, moe_json_type_name(v->type));
        return;
    }
    const moe_json *items = v;
    size_t count = 1;
    if (want->form == MOE_TOKEN_ID_LIST) {
        cr_assert_eq(v->type, MOE_JSON_ARRAY, "%s: %s, a list, is written as a %s", text, key,
                     moe_json_type_name(v->type));
        items = v->array.items;
        count = v->array.count;
    }
    cr_assert_eq(count, (size_t)want->n, "%s: %s is written with %zu ids", text, key, count);
    for (size_t i = 0; i < count; i++) {
        char literal[32];
        snprintf(literal, sizeof literal, "%lld", (long long)want->ids[i]);
        cr_expect(items[i].type == MOE_JSON_NUMBER && strcmp(items[i].number.text, literal) == 0,
                  "%s: %s's id %zu is written as %s, not %s", text, key, i,
                  items[i].type == MOE_JSON_NUMBER ? items[i].number.text : moe_json_type_name(items[i].type),
                  literal);
    }
}

/* A model made from a dense one (--upcycle) takes the dense config's token
 * ids where its own config gives none: its tokenizer is the dense model's.
 * Ids the MoE's config gives (null included) stay; a bad one is named. */
Test(model_config, token_ids_taken_from_another_config) {
    moe_model_config c;
    moe_model_config_default_small(&c, 64);
    c.pad_token_id = (moe_token_ids){.form = MOE_TOKEN_ID_NULL};
    const char *text = "{\"model_type\": \"mistral\", \"bos_token_id\": 1, \"eos_token_id\": [2, 7], "
                       "\"pad_token_id\": 0}";
    moe_json_doc *doc;
    cr_assert_eq(moe_json_parse(&doc, text, strlen(text), "d"), MOE_OK, "%s", moe_last_error());
    cr_assert_eq(moe_model_config_take_token_ids(&c, moe_json_root(doc), "d/config.json"), MOE_OK, "%s",
                 moe_last_error());
    moe_json_free(doc);
    cr_expect(c.bos_token_id.form == MOE_TOKEN_ID_INT && c.bos_token_id.ids[0] == 1);
    cr_expect(c.eos_token_id.form == MOE_TOKEN_ID_LIST && c.eos_token_id.n == 2 && c.eos_token_id.ids[1] == 7);
    cr_expect(c.pad_token_id.form == MOE_TOKEN_ID_NULL, "the MoE's own null pad_token_id was replaced");
    moe_model_config_default_small(&c, 64);
    text = "{\"eos_token_id\": \"two\"}";
    cr_assert_eq(moe_json_parse(&doc, text, strlen(text), "d"), MOE_OK, "%s", moe_last_error());
    cr_expect_eq(moe_model_config_take_token_ids(&c, moe_json_root(doc), "d/config.json"), MOE_ERR_CONFIG);
    cr_expect(strstr(moe_last_error(), "d/config.json: eos_token_id must be"), "message: %s", moe_last_error());
    moe_json_free(doc);
}

/* bos/eos/pad_token_id are kept as read and written back the same way (an
 * integer as an integer, a list as a list, null as null, absent left out):
 * transformers' generate stops at the config's eos, and they were dropped.
 * Ids outside the vocabulary are kept with a warning, as transformers does;
 * a list past MOE_TOKEN_IDS_MAX is refused naming the key. */
Test(model_config, token_ids_round_trip, .init = make_tmpdir, .fini = remove_tmpdir) {
    const token_ids_want absent = {MOE_TOKEN_ID_ABSENT, 0, {0}}, null = {MOE_TOKEN_ID_NULL, 0, {0}};
    const struct {
        const char *extra; /* members after vocab_size's value */
        token_ids_want bos, eos, pad;
        const char *warning; /* NULL: none */
    } cases[] = {
        /* Mixtral's */
        {", \"bos_token_id\": 1, \"eos_token_id\": 2", {MOE_TOKEN_ID_INT, 1, {1}}, {MOE_TOKEN_ID_INT, 1, {2}}, absent,
         NULL},
        {", \"bos_token_id\": 10, \"eos_token_id\": 32, \"pad_token_id\": 0", {MOE_TOKEN_ID_INT, 1, {10}},
         {MOE_TOKEN_ID_INT, 1, {32}}, {MOE_TOKEN_ID_INT, 1, {0}}, NULL},
        /* Llama 3's list, in a vocabulary that holds it */
        {"0000, \"bos_token_id\": 128000, \"eos_token_id\": [128001, 128008, 128009]", {MOE_TOKEN_ID_INT, 1, {128000}},
         {MOE_TOKEN_ID_LIST, 3, {128001, 128008, 128009}}, absent, NULL},
        {", \"eos_token_id\": [7]", absent, {MOE_TOKEN_ID_LIST, 1, {7}}, absent, NULL},
        {", \"eos_token_id\": []", absent, {MOE_TOKEN_ID_LIST, 0, {0}}, absent, NULL},
        {"", absent, absent, absent, NULL},
        {", \"bos_token_id\": null, \"eos_token_id\": null, \"pad_token_id\": null", null, null, null, NULL},
        {", \"pad_token_id\": -1", absent, absent, {MOE_TOKEN_ID_INT, 1, {-1}},
         "t/config.json: pad_token_id=-1 is outside the vocabulary [0, 100)"},
        {", \"eos_token_id\": [2, 100]", absent, {MOE_TOKEN_ID_LIST, 2, {2, 100}}, absent,
         "t/config.json: eos_token_id[1]=100 is outside the vocabulary [0, 100)"},
    };
    char path[512];
    snprintf(path, sizeof path, "%s/config.json", tmpdir);
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        char value[256];
        snprintf(value, sizeof value, "100%s", cases[i].extra);
        const char *text = config_with("vocab_size", value);
        moe_model_config c, back;
        warnings w = {0};
        cr_assert_eq(parse(&c, text, &w), MOE_OK, "%s: %s", text, moe_last_error());
        expect_token_ids(&c.bos_token_id, &cases[i].bos, "bos_token_id", text);
        expect_token_ids(&c.eos_token_id, &cases[i].eos, "eos_token_id", text);
        expect_token_ids(&c.pad_token_id, &cases[i].pad, "pad_token_id", text);
        if (cases[i].warning) {
            cr_expect_eq(w.count, 1, "%s: %d warnings", text, w.count);
            cr_expect(warned(&w, cases[i].warning), "%s: %s", text, w.text[0]);
        } else {
            cr_expect_eq(w.count, 0, "%s warned: %s", text, w.text[0]);
        }

        cr_assert_eq(moe_model_config_save(&c, path), MOE_OK, "%s", moe_last_error());
        moe_json_doc *doc;
        cr_assert_eq(moe_json_parse_file(&doc, path, 1 << 20), MOE_OK, "%s", moe_last_error());
        expect_written(moe_json_root(doc), "bos_token_id", &cases[i].bos, text);
        expect_written(moe_json_root(doc), "eos_token_id", &cases[i].eos, text);
        expect_written(moe_json_root(doc), "pad_token_id", &cases[i].pad, text);
        moe_json_free(doc);
        cr_assert_eq(moe_model_config_load(&back, path, NULL, NULL), MOE_OK, "%s", moe_last_error());
        expect_same(&c, &back);
        cr_expect(memcmp(&c, &back, sizeof c) == 0, "%s: the struct changed in the round trip", text);
    }

    /* At the bound, and one past it. */
    for (int n = MOE_TOKEN_IDS_MAX; n <= MOE_TOKEN_IDS_MAX + 1; n++) {
        char list[256] = "100";
        size_t len = strlen(list);
        len += (size_t)snprintf(list + len, sizeof list - len, ", \"eos_token_id\": [");
        for (int j = 0; j < n; j++) len += (size_t)snprintf(list + len, sizeof list - len, "%s%d", j ? ", " : "", j);
        snprintf(list + len, sizeof list - len, "]");
        const char *text = config_with("vocab_size", list);
        moe_model_config c;
        const moe_status st = parse(&c, text, NULL);
        if (n == MOE_TOKEN_IDS_MAX) {
            cr_expect_eq(st, MOE_OK, "%s: %s", text, moe_last_error());
            cr_expect_eq(c.eos_token_id.n, n);
            cr_expect_eq(c.eos_token_id.ids[n - 1], n - 1);
            continue;
        }
        cr_expect_eq(st, MOE_ERR_CONFIG, "accepted %s", text);
        cr_expect(strstr(moe_last_error(), "t/config.json: eos_token_id lists 17 ids, more than the 16 this reader "
                                           "keeps") != NULL,
                  "%s", moe_last_error());
    }
}
