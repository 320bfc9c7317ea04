#define _POSIX_C_SOURCE 200809L

#include "engine/model_config.h"

#include <float.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/crc32c.h"
#include "common/shortest.h"
#include "common/status.h"
#include "engine/fileio.h"
#include "engine/json.h"
#include "engine/rope.h"
#include "kernels/ops.h"

/* Sizes above this would let products such as vocab x hidden approach
 * int64 overflow in the engine's size arithmetic. */
#define MAX_DIM INT32_MAX
/* The MoE layer's own limits (moe_layer_config_validate), checked here too so
 * that the error names config.json's key rather than the layer's field: GEMM
 * row and column counts reach OpenBLAS as int, and its coefficients are
 * finite and in [0, MAX_COEF]. */
#define MAX_GEMM_DIM (INT_MAX / 2)
/* Past the deepest models by orders of magnitude. A model lays out tables
 * per layer before it can check its memory (about 9 bytes a layer, and
 * seconds per 10^8 layers): under a megabyte here, 19 GB at INT32_MAX. */
#define MAX_LAYERS MOE_MODEL_LAYERS_MAX
#define MAX_COEF 1e6
/* initializer_range's bound is a guard against slips, not a numerical
 * limit: published models use 0.006 to 0.02, and an expert's output grows as
 * the cube of the weights' std (three matrices), so 1 is already extreme;
 * 1e3 leaves experiments room and refuses 2e4 typed for 2e-2. */
#define MAX_INIT_STD 1e3

/* F_ENUM: one of the field's names, an enum of as many values.
 * F_WINDOW: a positive integer, or null (0 in the struct) for none.
 * F_TOKEN_IDS: an integer, a list of integers, or null, kept as given.
 * F_LAYERS: a list of distinct layer numbers, a set of MAX_LAYERS bits. */
typedef enum field_kind { F_INT, F_REAL, F_BOOL, F_ENUM, F_WINDOW, F_TOKEN_IDS, F_LAYERS } field_kind;

/* A set of layers: bit l % 64 of word l / 64 is layer l. */
#define LAYER_SET_WORDS (MAX_LAYERS / 64)
_Static_assert(sizeof ((moe_model_config *)0)->moe_dense_layers == LAYER_SET_WORDS * sizeof(uint64_t),
               "moe_dense_layers holds a bit per layer");

/* Defaults that depend on other fields. */
#define DERIVED (-1.0)

/* What config.json said of a field: fill_defaults tells absent from null
 * where transformers does (num_key_value_heads), and a required key given
 * as null from one left out. */
typedef enum given { ABSENT, GIVEN_NULL, GIVEN } given;

/* One config.json key stored in the struct; this table drives parsing,
 * defaults and writing, so the three cannot disagree. */
typedef struct field {
    const char *key;
    field_kind kind;
    size_t offset;
    bool required;
    double def; /* when absent and not required; DERIVED: computed */
    const char *const *names; /* F_ENUM: [n_names], each value's */
    int n_names;
} field;

#define FIELD(name, kind, required, def) {#name, kind, offsetof(moe_model_config, name), required, def, NULL, 0}
#define ENUM_FIELD(name, def, names)                                                                                   \
    {#name, F_ENUM, offsetof(moe_model_config, name), false, def, names, (int)(sizeof names / sizeof *names)}

static const char *const gate_names[] = {
    [MOE_GATE_SOFTMAX_TOPK] = "softmax_topk",
    [MOE_GATE_TOPK_SOFTMAX] = "topk_softmax",
    [MOE_GATE_SIGMOID] = "sigmoid",
};

static const char *const qk_norm_names[] = {
    [MOE_QK_NORM_NONE] = "none",
    [MOE_QK_NORM_PER_HEAD] = "per_head",
    [MOE_QK_NORM_ACROSS_HEADS] = "across_heads",
};

/* F_ENUM fields are these enums, read and written as int. */
_Static_assert(sizeof(moe_gate_kind) == sizeof(int) && sizeof(moe_qk_norm_kind) == sizeof(int),
               "an F_ENUM field is an int's size");

static const field fields[] = {
    FIELD(vocab_size, F_INT, true, 0),
    FIELD(hidden_size, F_INT, true, 0),
    FIELD(intermediate_size, F_INT, true, 0),
    FIELD(num_hidden_layers, F_INT, true, 0),
    FIELD(num_attention_heads, F_INT, true, 0),
    /* transformers' default when absent; null: num_attention_heads. */
    FIELD(num_key_value_heads, F_INT, false, 8),
    FIELD(head_dim, F_INT, false, DERIVED),
    FIELD(num_local_experts, F_INT, true, 0),
    FIELD(num_experts_per_tok, F_INT, true, 0),
    FIELD(max_position_embeddings, F_INT, false, 4096 * 32),
    FIELD(sliding_window, F_WINDOW, false, 0),
    FIELD(rope_theta, F_REAL, false, 1e6),
    FIELD(rms_norm_eps, F_REAL, false, 1e-5),
    FIELD(router_aux_loss_coef, F_REAL, false, 0.001),
    FIELD(router_jitter_noise, F_REAL, false, 0.0),
    FIELD(initializer_range, F_REAL, false, 0.02),
    FIELD(tie_word_embeddings, F_BOOL, false, 0),
    /* Absent stays absent (transformers then takes MixtralConfig's default). */
    FIELD(bos_token_id, F_TOKEN_IDS, false, 0),
    FIELD(eos_token_id, F_TOKEN_IDS, false, 0),
    FIELD(pad_token_id, F_TOKEN_IDS, false, 0),
    ENUM_FIELD(moe_qk_norm, MOE_QK_NORM_NONE, qk_norm_names),
    FIELD(moe_qkv_bias, F_BOOL, false, 0),
    ENUM_FIELD(moe_gate, MOE_GATE_SOFTMAX_TOPK, gate_names),
    FIELD(moe_renormalize, F_BOOL, false, 1),
    FIELD(moe_capacity_factor, F_REAL, false, 0.0),
    FIELD(moe_z_loss_coef, F_REAL, false, 0.0),
    FIELD(moe_seq_aux_loss_coef, F_REAL, false, 0.0),
    FIELD(moe_n_shared_experts, F_INT, false, 0),
    FIELD(moe_shared_intermediate_size, F_INT, false, 0),
    FIELD(moe_shared_expert_gate, F_BOOL, false, 0),
    FIELD(moe_bias_update_rate, F_REAL, false, 0.0),
    FIELD(moe_n_group, F_INT, false, 0),
    FIELD(moe_topk_group, F_INT, false, 0),
    FIELD(moe_routed_scaling_factor, F_REAL, false, 1.0),
    FIELD(moe_dense_layers, F_LAYERS, false, 0),
    FIELD(moe_dense_intermediate_size, F_INT, false, 0),
};
#define N_FIELDS (sizeof fields / sizeof *fields)

/* Whether only an MoE layer reads field f: a model without one keeps them
 * at their defaults (canonical_dense), and a dense model type's file does
 * not have them. */
static bool moe_only(const field *f) {
    static const size_t offsets[] = {
        offsetof(moe_model_config, num_local_experts),
        offsetof(moe_model_config, num_experts_per_tok),
        offsetof(moe_model_config, router_aux_loss_coef),
        offsetof(moe_model_config, router_jitter_noise),
        offsetof(moe_model_config, moe_gate),
        offsetof(moe_model_config, moe_renormalize),
        offsetof(moe_model_config, moe_capacity_factor),
        offsetof(moe_model_config, moe_z_loss_coef),
        offsetof(moe_model_config, moe_seq_aux_loss_coef),
        offsetof(moe_model_config, moe_n_shared_experts),
        offsetof(moe_model_config, moe_shared_intermediate_size),
        offsetof(moe_model_config, moe_shared_expert_gate),
        offsetof(moe_model_config, moe_bias_update_rate),
        offsetof(moe_model_config, moe_n_group),
        offsetof(moe_model_config, moe_topk_group),
        offsetof(moe_model_config, moe_routed_scaling_factor),
        offsetof(moe_model_config, moe_dense_layers),
        offsetof(moe_model_config, moe_dense_intermediate_size),
    };
    for (size_t i = 0; i < sizeof offsets / sizeof *offsets; i++)
        if (f->offset == offsets[i]) return true;
    return false;
}

/* Hugging Face keys that do not change the model we build. */
static const char *const ignored_keys[] = {
    "architectures", "torch_dtype", "dtype",
    "output_router_logits", "use_cache", "transformers_version", "_name_or_path",
    "return_dict", "output_attentions", "output_hidden_states",
    /* transformers v4's Llama split its GEMMs in as many slices, the same sums */
    "pretraining_tp",
};

/* Keys outside the struct that read_other checks; null there is absent, as
 * everywhere in transformers, so it is accepted before any check. */
static const char *const checked_keys[] = {
    "rope_parameters", "rope_scaling", "hidden_act", "model_type", "attention_dropout",
    "num_experts", "original_max_position_embeddings", "partial_rotary_factor",
};

/* model_type and architectures: the transformers model that computes
 * what our model computes (family_of), else a type transformers refuses
 * rather than load as one and give other outputs (moe_model_config_save).
 * The last four are dense models, of dense MLP layers only. */
typedef enum family {
    FAMILY_MIXTRAL, FAMILY_QWEN3, FAMILY_OLMOE, FAMILY_QWEN2, FAMILY_OURS,
    FAMILY_LLAMA, FAMILY_MISTRAL, FAMILY_QWEN3_DENSE, FAMILY_QWEN2_DENSE, N_FAMILIES
} family;
static const char *const family_types[N_FAMILIES] = {"mixtral", "qwen3_moe", "olmoe", "qwen2_moe", "moe",
                                                     "llama",   "mistral",   "qwen3", "qwen2"};
static const char *const family_archs[N_FAMILIES] = {
    "MixtralForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM", "Qwen2MoeForCausalLM", "MoeForCausalLM",
    "LlamaForCausalLM",   "MistralForCausalLM",  "Qwen3ForCausalLM", "Qwen2ForCausalLM"};
#define FAMILY_BIT(f) (1u << (f))
#define DENSE_FAMILIES                                                                                                 \
    (FAMILY_BIT(FAMILY_LLAMA) | FAMILY_BIT(FAMILY_MISTRAL) | FAMILY_BIT(FAMILY_QWEN3_DENSE) |                          \
     FAMILY_BIT(FAMILY_QWEN2_DENSE))
static bool dense_family(family f) { return (DENSE_FAMILIES & FAMILY_BIT(f)) != 0; }

/* The keys of Qwen3MoeConfig, OlmoeConfig, Qwen2MoeConfig and the dense
 * classes beyond Mixtral's, read in a file of a type that has them (families, a
 * FAMILY_BIT mask) and in another an unknown key; FAMILY_KEY_BIT(k) marks
 * one given. */
enum {
    KEY_MOE_INTERMEDIATE, KEY_NORM_TOPK, KEY_SPARSE_STEP, KEY_MLP_ONLY, KEY_USE_WINDOW, KEY_ATTENTION_BIAS,
    KEY_MAX_WINDOW_LAYERS, KEY_CLIP_QKV, KEY_SHARED_INTERMEDIATE, KEY_QKV_BIAS, KEY_LAYER_TYPES, KEY_MLP_BIAS,
    N_FAMILY_KEYS
};
#define QWENS (FAMILY_BIT(FAMILY_QWEN3) | FAMILY_BIT(FAMILY_QWEN2))
#define DENSE_QWENS (FAMILY_BIT(FAMILY_QWEN3_DENSE) | FAMILY_BIT(FAMILY_QWEN2_DENSE))
static const struct {
    const char *key;
    unsigned families;
} family_keys[N_FAMILY_KEYS] = {
    [KEY_MOE_INTERMEDIATE] = {"moe_intermediate_size", QWENS},
    [KEY_NORM_TOPK] = {"norm_topk_prob", QWENS | FAMILY_BIT(FAMILY_OLMOE)},
    [KEY_SPARSE_STEP] = {"decoder_sparse_step", QWENS},
    [KEY_MLP_ONLY] = {"mlp_only_layers", QWENS},
    [KEY_USE_WINDOW] = {"use_sliding_window", QWENS | DENSE_QWENS},
    [KEY_ATTENTION_BIAS] = {"attention_bias", FAMILY_BIT(FAMILY_QWEN3) | FAMILY_BIT(FAMILY_OLMOE) |
                                                  FAMILY_BIT(FAMILY_LLAMA) | FAMILY_BIT(FAMILY_QWEN3_DENSE)},
    [KEY_MAX_WINDOW_LAYERS] = {"max_window_layers", QWENS | DENSE_QWENS},
    [KEY_CLIP_QKV] = {"clip_qkv", FAMILY_BIT(FAMILY_OLMOE)},
    [KEY_SHARED_INTERMEDIATE] = {"shared_expert_intermediate_size", FAMILY_BIT(FAMILY_QWEN2)},
    [KEY_QKV_BIAS] = {"qkv_bias", FAMILY_BIT(FAMILY_QWEN2)},
    /* family_bool: a layer other than "full_attention"; family_int: the count */
    [KEY_LAYER_TYPES] = {"layer_types", FAMILY_BIT(FAMILY_QWEN2) | DENSE_QWENS},
    [KEY_MLP_BIAS] = {"mlp_bias", FAMILY_BIT(FAMILY_LLAMA)},
};
#define FAMILY_KEY_BIT(k) (1u << (k))

/* The other config classes' defaults where they differ from
 * MixtralConfig's (OLMoE's and Llama's absent num_key_value_heads is
 * num_attention_heads, fill_defaults' to set), and their q and k norms. */
static const struct {
    family fam;
    const char *key;
    double def;
} family_defaults[] = {
    {FAMILY_QWEN3, "num_key_value_heads", 4},
    {FAMILY_QWEN3, "max_position_embeddings", 32768},
    {FAMILY_QWEN3, "rope_theta", 1e4},
    {FAMILY_QWEN3, "rms_norm_eps", 1e-6},
    {FAMILY_QWEN3, "moe_renormalize", 0}, /* norm_topk_prob */
    {FAMILY_QWEN3, "moe_qk_norm", MOE_QK_NORM_PER_HEAD},
    {FAMILY_OLMOE, "max_position_embeddings", 4096},
    {FAMILY_OLMOE, "rope_theta", 1e4},
    {FAMILY_OLMOE, "router_aux_loss_coef", 0.01},
    {FAMILY_OLMOE, "moe_renormalize", 0},
    {FAMILY_OLMOE, "moe_qk_norm", MOE_QK_NORM_ACROSS_HEADS},
    {FAMILY_QWEN2, "num_key_value_heads", 16},
    {FAMILY_QWEN2, "max_position_embeddings", 32768},
    {FAMILY_QWEN2, "rope_theta", 1e4},
    {FAMILY_QWEN2, "rms_norm_eps", 1e-6},
    {FAMILY_QWEN2, "moe_renormalize", 0},
    {FAMILY_LLAMA, "max_position_embeddings", 2048},
    {FAMILY_LLAMA, "rope_theta", 1e4},
    {FAMILY_LLAMA, "rms_norm_eps", 1e-6},
    {FAMILY_MISTRAL, "rope_theta", 1e4},
    {FAMILY_MISTRAL, "rms_norm_eps", 1e-6},
    {FAMILY_QWEN3_DENSE, "num_key_value_heads", 32},
    {FAMILY_QWEN3_DENSE, "max_position_embeddings", 32768},
    {FAMILY_QWEN3_DENSE, "rope_theta", 1e4},
    {FAMILY_QWEN3_DENSE, "rms_norm_eps", 1e-6},
    {FAMILY_QWEN3_DENSE, "moe_qk_norm", MOE_QK_NORM_PER_HEAD},
    {FAMILY_QWEN2_DENSE, "num_key_value_heads", 32},
    {FAMILY_QWEN2_DENSE, "max_position_embeddings", 32768},
    {FAMILY_QWEN2_DENSE, "rope_theta", 1e4},
    {FAMILY_QWEN2_DENSE, "rms_norm_eps", 1e-6},
};

/* Qwen3Config's head_dim when absent (not hidden_size // num_attention_heads). */
#define QWEN3_HEAD_DIM_DEFAULT 128
/* MistralConfig's and the Qwens' sliding_window when absent (null: none),
 * and the Qwens' max_window_layers. */
#define WINDOW_DEFAULT 4096
#define MAX_WINDOW_LAYERS_DEFAULT 28

/* Qwen3MoeConfig's and Qwen2MoeConfig's intermediate_size when absent: their
 * dense MLP layers' width (read_family_layers). */
#define QWEN3_DENSE_WIDTH_DEFAULT 6144
#define QWEN2_DENSE_WIDTH_DEFAULT 5632

const char *moe_gate_kind_name(int kind) {
    return kind >= 0 && (size_t)kind < sizeof gate_names / sizeof *gate_names ? gate_names[kind] : "?";
}

const char *moe_qk_norm_kind_name(int kind) {
    return kind >= 0 && (size_t)kind < sizeof qk_norm_names / sizeof *qk_norm_names ? qk_norm_names[kind] : "?";
}

int64_t moe_qk_norm_width(const moe_model_config *cfg, bool key) {
    const int64_t heads = key ? cfg->num_key_value_heads : cfg->num_attention_heads;
    switch (cfg->moe_qk_norm) {
    case MOE_QK_NORM_PER_HEAD: return cfg->head_dim;
    case MOE_QK_NORM_ACROSS_HEADS: return heads * cfg->head_dim;
    default: return 0;
    }
}

static void *field_ptr(moe_model_config *cfg, const field *f) { return (char *)cfg + f->offset; }
static const void *field_cptr(const moe_model_config *cfg, const field *f) { return (const char *)cfg + f->offset; }

static int enum_value(const moe_model_config *cfg, const field *f) {
    int v;
    memcpy(&v, field_cptr(cfg, f), sizeof v);
    return v;
}

static void set_enum(moe_model_config *cfg, const field *f, int v) { memcpy(field_ptr(cfg, f), &v, sizeof v); }

/* A JSON value as it would appear in the file, shortened, for messages. */
static const char *describe(char *buf, size_t size, const moe_json *v) {
    switch (v->type) {
    case MOE_JSON_NUMBER: snprintf(buf, size, "%.60s", v->number.text); break;
    case MOE_JSON_STRING: snprintf(buf, size, "\"%.60s\"", v->string.data); break;
    case MOE_JSON_BOOL: snprintf(buf, size, "%s", v->boolean ? "true" : "false"); break;
    default: snprintf(buf, size, "%s", moe_json_type_name(v->type)); break;
    }
    return buf;
}

static moe_status wrong_type(const char *name, const char *key, const char *want, const moe_json *v) {
    char got[80];
    return moe_error(MOE_ERR_CONFIG, "%s: %s must be %s, got %s", name, key, want, describe(got, sizeof got, v));
}

static void warn(moe_warn_fn fn, void *ctx, const char *fmt, ...) MOE_PRINTF(3, 4);

static void warn(moe_warn_fn fn, void *ctx, const char *fmt, ...) {
    if (fn == NULL) return;
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    fn(ctx, msg);
}

/* *text: v's text, NULL when v is not a string. A string holding a NUL is
 * an error: it would compare equal to its text before the NUL
 * ("silu\u0000gelu" to "silu"). */
static moe_status string_text(const char **text, const char *name, const char *key, const moe_json *v) {
    *text = moe_json_text(v);
    if (v->type == MOE_JSON_STRING && *text == NULL)
        return moe_error(MOE_ERR_CONFIG, "%s: %s contains a NUL character", name, key);
    return MOE_OK;
}

/* An integer into *out; want ("an integer") names what v should be when it
 * is no whole number. A whole number that moe_json_int64 cannot hold is out
 * of range instead, and the message gives the bound its form allows. */
static moe_status read_int(int64_t *out, const char *name, const char *key, const char *want, const moe_json *v) {
    if (moe_json_int64(v, out) == MOE_OK) return MOE_OK;
    if (v->type != MOE_JSON_NUMBER || v->number.value != floor(v->number.value)) return wrong_type(name, key, want, v);
    int64_t lo, hi;
    moe_json_int64_range(v, &lo, &hi);
    /* The literal while it is no longer than an int64's, else its value. */
    char text[40];
    if (v->number.text_len <= 20)
        snprintf(text, sizeof text, "%s", v->number.text);
    else
        snprintf(text, sizeof text, "%g", v->number.value);
    const bool neg = v->number.value < 0.0;
    return moe_error(MOE_ERR_CONFIG, "%s: %s=%s is out of range (at %s %lld%s)", name, key, text,
                     neg ? "least" : "most", (long long)(neg ? lo : hi),
                     hi == INT64_MAX ? "" : " written with a fraction or exponent");
}

/* A token id key as transformers types it, int | list[int] | None, into *t;
 * a list longer than MOE_TOKEN_IDS_MAX is refused rather than cut. */
static moe_status read_token_ids(moe_token_ids *t, const char *name, const char *key, const moe_json *v) {
    memset(t, 0, sizeof *t);
    if (v->type == MOE_JSON_NULL) {
        t->form = MOE_TOKEN_ID_NULL;
        return MOE_OK;
    }
    if (v->type != MOE_JSON_ARRAY) {
        t->form = MOE_TOKEN_ID_INT;
        t->n = 1;
        return read_int(&t->ids[0], name, key, "an integer, a list of integers or null", v);
    }
    if (v->array.count > MOE_TOKEN_IDS_MAX)
        return moe_error(MOE_ERR_CONFIG, "%s: %s lists %zu ids, more than the %d this reader keeps", name, key,
                         v->array.count, MOE_TOKEN_IDS_MAX);
    t->form = MOE_TOKEN_ID_LIST;
    t->n = (int)v->array.count;
    for (size_t i = 0; i < v->array.count; i++) {
        char item[64];
        snprintf(item, sizeof item, "%s[%zu]", key, i);
        MOE_TRY(read_int(&t->ids[i], name, item, "an integer", &v->array.items[i]));
    }
    return MOE_OK;
}

bool moe_layer_set_has(const uint64_t *set, int64_t layer) { return set[layer / 64] >> (layer % 64) & 1; }

void moe_layer_set_add(uint64_t *set, int64_t layer) { set[layer / 64] |= (uint64_t)1 << (layer % 64); }

static bool layer_set_empty(const uint64_t *set) {
    for (int i = 0; i < LAYER_SET_WORDS; i++)
        if (set[i] != 0) return false;
    return true;
}

/* A list of layer numbers into set [LAYER_SET_WORDS]. strict (our
 * moe_dense_layers): each in [0, MAX_LAYERS) and listed once; otherwise
 * (Qwen's mlp_only_layers, which transformers only tests with `in`) a
 * number that names no layer is ignored and a repeat is harmless. The
 * bound num_hidden_layers may come later in the file: validate checks the
 * set against it, read_family_layers ignores what lies past it. */
static moe_status read_layers(uint64_t *set, const char *name, const char *key, const moe_json *v, bool strict) {
    memset(set, 0, LAYER_SET_WORDS * sizeof *set);
    if (v->type != MOE_JSON_ARRAY) return wrong_type(name, key, "a list of layer numbers", v);
    for (size_t i = 0; i < v->array.count; i++) {
        char item[64];
        int64_t layer;
        snprintf(item, sizeof item, "%s[%zu]", key, i);
        const moe_json *at = &v->array.items[i];
        /* An integer past int64 names no layer either. */
        if (!strict && at->type == MOE_JSON_NUMBER && fabs(at->number.value) >= 0x1p63 &&
            at->number.value == floor(at->number.value))
            continue;
        MOE_TRY(read_int(&layer, name, item, "an integer", at));
        if (layer < 0 || layer >= MAX_LAYERS) {
            if (!strict) continue;
            return moe_error(MOE_ERR_CONFIG, "%s: %s=%lld is no layer number (0 to %d)", name, item, (long long)layer,
                             MAX_LAYERS - 1);
        }
        if (strict && moe_layer_set_has(set, layer))
            return moe_error(MOE_ERR_CONFIG, "%s: %s=%lld repeats an earlier entry", name, item, (long long)layer);
        moe_layer_set_add(set, layer);
    }
    return MOE_OK;
}

static moe_status read_field(moe_model_config *cfg, const field *f, const moe_json *v, const char *name) {
    switch (f->kind) {
    case F_INT: return read_int(field_ptr(cfg, f), name, f->key, "an integer", v);
    case F_TOKEN_IDS: return read_token_ids(field_ptr(cfg, f), name, f->key, v);
    case F_LAYERS: return read_layers(field_ptr(cfg, f), name, f->key, v, true);
    case F_WINDOW: {
        int64_t *w = field_ptr(cfg, f);
        MOE_TRY(read_int(w, name, f->key, "an integer or null", v));
        /* 0 would be a window of no key; transformers reads null as none. */
        if (*w < 1)
            return moe_error(MOE_ERR_CONFIG, "%s: %s=%lld must be positive, or null for none", name, f->key,
                             (long long)*w);
        return MOE_OK;
    }
    case F_REAL:
        if (v->type != MOE_JSON_NUMBER) return wrong_type(name, f->key, "a number", v);
        *(double *)field_ptr(cfg, f) = v->number.value;
        return MOE_OK;
    case F_BOOL:
        if (v->type != MOE_JSON_BOOL) return wrong_type(name, f->key, "true or false", v);
        *(bool *)field_ptr(cfg, f) = v->boolean;
        return MOE_OK;
    case F_ENUM: {
        const char *text;
        MOE_TRY(string_text(&text, name, f->key, v));
        for (int i = 0; text != NULL && i < f->n_names; i++)
            if (strcmp(text, f->names[i]) == 0) {
                set_enum(cfg, f, i);
                return MOE_OK;
            }
        char want[160];
        int at = 0;
        for (int i = 0; i < f->n_names && at >= 0 && (size_t)at < sizeof want; i++)
            at += snprintf(want + at, sizeof want - (size_t)at, "%s\"%s\"",
                           i == 0 ? "" : i == f->n_names - 1 ? " or " : ", ", f->names[i]);
        return wrong_type(name, f->key, want, v);
    }
    }
    return moe_error(MOE_ERR_INTERNAL, "%s: field %s has no kind", name, f->key);
}

/* v is the string want or, when alt is not NULL, alt. */
static moe_status require_string(const char *name, const char *key, const moe_json *v, const char *want,
                                 const char *alt) {
    const char *text;
    MOE_TRY(string_text(&text, name, key, v));
    if (text != NULL && (strcmp(text, want) == 0 || (alt != NULL && strcmp(text, alt) == 0))) return MOE_OK;
    char got[80];
    return moe_error(MOE_ERR_CONFIG, "%s: %s=%s is not supported (only \"%s\"%s%s%s)", name, key,
                     describe(got, sizeof got, v), want, alt != NULL ? " or \"" : "", alt != NULL ? alt : "",
                     alt != NULL ? "\"" : "");
}

/* lo <= v < hi, and not NaN. */
static moe_status check_real(const char *name, const char *key, double v, double lo, double hi) {
    if (isfinite(v) && v >= lo && v < hi) return MOE_OK;
    if (!isfinite(v)) return moe_error(MOE_ERR_CONFIG, "%s: %s=%g must be a finite number", name, key, v);
    return moe_error(MOE_ERR_CONFIG, "%s: %s=%g must be in [%g, %g)", name, key, v, lo, hi);
}

/* A value the engine uses in single precision: a normal positive float, so
 * that it rounds neither to zero (rope_theta 1e-50 gives infinite inverse
 * frequencies, NaN angles) nor to infinity. */
static moe_status check_float(const char *name, const char *key, double v) {
    if (v >= FLT_MIN && v <= FLT_MAX) return MOE_OK;
    if (!isfinite(v)) return moe_error(MOE_ERR_CONFIG, "%s: %s=%g must be a finite number", name, key, v);
    if (v <= 0.0) return moe_error(MOE_ERR_CONFIG, "%s: %s=%g must be > 0", name, key, v);
    return moe_error(MOE_ERR_CONFIG, "%s: %s=%g must be in [%g, %g], a normal float (it is used in single precision)",
                     name, key, v, (double)FLT_MIN, (double)FLT_MAX);
}

/* A value used in single precision, as check_float, and at most hi. */
static moe_status check_float_upto(const char *name, const char *key, double v, double hi) {
    if (v >= FLT_MIN && v <= hi) return MOE_OK;
    return moe_error(MOE_ERR_CONFIG, "%s: %s=%g must be in [%g, %g]", name, key, v, (double)FLT_MIN, hi);
}

static const char *const rope_type_names[] = {
    [MOE_ROPE_DEFAULT] = "default",
    [MOE_ROPE_LINEAR] = "linear",
    [MOE_ROPE_LLAMA3] = "llama3",
    [MOE_ROPE_YARN] = "yarn",
    [MOE_ROPE_DYNAMIC] = "dynamic",
};
#define N_ROPE_TYPES (sizeof rope_type_names / sizeof *rope_type_names)

const char *moe_rope_type_name(int type) {
    return type >= 0 && (size_t)type < N_ROPE_TYPES ? rope_type_names[type] : "?";
}

#define ROPE_TYPE_BIT(t) (1u << (t))
#define ROPE_SCALED                                                                                                    \
    (ROPE_TYPE_BIT(MOE_ROPE_LINEAR) | ROPE_TYPE_BIT(MOE_ROPE_LLAMA3) | ROPE_TYPE_BIT(MOE_ROPE_YARN) |                  \
     ROPE_TYPE_BIT(MOE_ROPE_DYNAMIC))

/* The scaling keys of a RoPE object, the types that read each, and whether
 * those types require it; this table drives reading, checking, comparing,
 * describing and writing them. */
typedef struct rope_key {
    const char *key, *field; /* field: the key under rope_scaling, for messages */
    field_kind kind;         /* F_REAL (double), F_INT (int64_t) or F_BOOL */
    size_t offset;
    unsigned types, required;
    bool zero_absent; /* 0 stands for the key left out (yarn's derived attention_factor, unset mscales) */
} rope_key;

#define ROPE_KEY(name, kind, types, required, zero_absent)                                                             \
    {#name, "rope_scaling." #name, kind, offsetof(moe_rope_scaling, name), types, required, zero_absent}

static const rope_key rope_keys[] = {
    ROPE_KEY(factor, F_REAL, ROPE_SCALED, ROPE_SCALED, false),
    ROPE_KEY(low_freq_factor, F_REAL, ROPE_TYPE_BIT(MOE_ROPE_LLAMA3), ROPE_TYPE_BIT(MOE_ROPE_LLAMA3), false),
    ROPE_KEY(high_freq_factor, F_REAL, ROPE_TYPE_BIT(MOE_ROPE_LLAMA3), ROPE_TYPE_BIT(MOE_ROPE_LLAMA3), false),
    ROPE_KEY(original_max_position_embeddings, F_INT, ROPE_TYPE_BIT(MOE_ROPE_LLAMA3) | ROPE_TYPE_BIT(MOE_ROPE_YARN),
             0, false),
    ROPE_KEY(attention_factor, F_REAL, ROPE_TYPE_BIT(MOE_ROPE_YARN), 0, true),
    ROPE_KEY(beta_fast, F_REAL, ROPE_TYPE_BIT(MOE_ROPE_YARN), 0, false),
    ROPE_KEY(beta_slow, F_REAL, ROPE_TYPE_BIT(MOE_ROPE_YARN), 0, false),
    ROPE_KEY(mscale, F_REAL, ROPE_TYPE_BIT(MOE_ROPE_YARN), 0, true),
    ROPE_KEY(mscale_all_dim, F_REAL, ROPE_TYPE_BIT(MOE_ROPE_YARN), 0, true),
    ROPE_KEY(truncate, F_BOOL, ROPE_TYPE_BIT(MOE_ROPE_YARN), 0, false),
};
#define N_ROPE_KEYS (sizeof rope_keys / sizeof *rope_keys)
_Static_assert(N_ROPE_KEYS == MOE_ROPE_SCALING_FIELDS, "model_config.h counts rope_keys");

static double rope_value(const moe_rope_scaling *s, const rope_key *r) {
    const void *at = (const char *)s + r->offset;
    return r->kind == F_REAL ? *(const double *)at : r->kind == F_INT ? (double)*(const int64_t *)at : *(const bool *)at;
}

/* Whether s leaves key r out (written so, or not written). */
static bool rope_optional_zero(const moe_rope_scaling *s, const rope_key *r) {
    return r->zero_absent && rope_value(s, r) == 0.0;
}

const char *moe_rope_scaling_field(const moe_rope_scaling *s, int i, double *value) {
    *value = rope_value(s, &rope_keys[i]);
    return rope_keys[i].field;
}

static moe_status check_size(const char *name, const char *key, int64_t v, int64_t max);

/* The values of a RoPE scaling, messages naming its keys as prefix.key
 * (prefix: the object the file gave them in). A type's unused fields must
 * be 0, so that two equal scalings compare equal field by field. */
static moe_status check_rope(const char *name, const char *prefix, const moe_rope_scaling *s) {
    char key[64];
#define ROPE_NAME(k) (snprintf(key, sizeof key, "%s.%s", prefix, k), key)
    if ((unsigned)s->type >= N_ROPE_TYPES)
        return moe_error(MOE_ERR_CONFIG, "%s: %s=%d is no RoPE type", name, ROPE_NAME("rope_type"), (int)s->type);
    const unsigned bit = ROPE_TYPE_BIT(s->type);
    for (size_t k = 0; k < N_ROPE_KEYS; k++) {
        const rope_key *r = &rope_keys[k];
        if (!(r->types & bit) && rope_value(s, r) != 0.0)
            return moe_error(MOE_ERR_CONFIG, "%s: %s is set, but rope_type \"%s\" has no such parameter", name,
                             ROPE_NAME(r->key), rope_type_names[s->type]);
    }
    if (s->type == MOE_ROPE_DEFAULT) return MOE_OK;
    MOE_TRY(check_float(name, ROPE_NAME("factor"), s->factor));
    if (s->type == MOE_ROPE_LINEAR || s->type == MOE_ROPE_DYNAMIC) return MOE_OK;
    MOE_TRY(check_size(name, ROPE_NAME("original_max_position_embeddings"), s->original_max_position_embeddings,
                       MAX_DIM));
    if (s->type == MOE_ROPE_LLAMA3) {
        MOE_TRY(check_float(name, ROPE_NAME("low_freq_factor"), s->low_freq_factor));
        MOE_TRY(check_float(name, ROPE_NAME("high_freq_factor"), s->high_freq_factor));
        /* The blend divides by their difference. */
        if (s->high_freq_factor <= s->low_freq_factor)
            return moe_error(MOE_ERR_CONFIG, "%s: %s=%g must exceed low_freq_factor=%g", name,
                             ROPE_NAME("high_freq_factor"), s->high_freq_factor, s->low_freq_factor);
        return MOE_OK;
    }
    MOE_TRY(check_float(name, ROPE_NAME("beta_fast"), s->beta_fast));
    MOE_TRY(check_float(name, ROPE_NAME("beta_slow"), s->beta_slow));
    if (!isfinite(s->mscale) || !isfinite(s->mscale_all_dim))
        return moe_error(MOE_ERR_CONFIG, "%s: %s=%g and mscale_all_dim=%g must be finite numbers", name,
                         ROPE_NAME("mscale"), s->mscale, s->mscale_all_dim);
    const double attention = moe_rope_attention_factor(s);
    if (s->attention_factor != 0.0) return check_float(name, ROPE_NAME("attention_factor"), attention);
    if (attention >= FLT_MIN && attention <= FLT_MAX) return MOE_OK;
    return moe_error(MOE_ERR_CONFIG, "%s: %s comes to %g from factor=%g, mscale=%g and mscale_all_dim=%g: it must be "
                                     "a positive normal float",
                     name, ROPE_NAME("attention_factor"), attention, s->factor, s->mscale, s->mscale_all_dim);
#undef ROPE_NAME
}

/* What a rope_parameters or rope_scaling object gave. */
typedef struct rope_read {
    bool given;       /* an object with a key: transformers reads {} as none */
    double theta;     /* its rope_theta; NaN: not given */
    double partial;   /* its partial_rotary_factor; NaN: not given */
    bool factor_null; /* yarn's factor null, which transformers derives from the context */
    moe_rope_scaling s;
} rope_read;

static const rope_key *find_rope_key(const char *key) {
    for (size_t k = 0; k < N_ROPE_KEYS; k++)
        if (strcmp(key, rope_keys[k].key) == 0) return &rope_keys[k];
    return NULL;
}

/* rope_parameters (transformers v5) or rope_scaling (v4), key naming which:
 * {"rope_type": "llama3", "factor": 8, ...}, "type" standing for
 * rope_type, a type's missing optional parameters at transformers'
 * defaults (original_max_position_embeddings is filled in later, from the
 * whole config). A key of another type's is warned about and ignored, as
 * transformers does. */
static moe_status read_rope(rope_read *out, const char *key, const moe_json *v, const char *name, moe_warn_fn wfn,
                            void *wctx) {
    if (v->type != MOE_JSON_OBJECT) return wrong_type(name, key, "an object", v);
    char sub[64];
    *out = (rope_read){.given = v->object.count > 0, .theta = NAN, .partial = NAN};
    moe_rope_scaling *s = &out->s;
    /* The type first: its keys are known only once it is. */
    const char *type_name = NULL;
    for (int alias = 0; alias < 2; alias++) {
        const char *type_key = alias ? "type" : "rope_type";
        const moe_json *t = moe_json_get(v, type_key);
        if (t == NULL || t->type == MOE_JSON_NULL) continue;
        snprintf(sub, sizeof sub, "%s.%s", key, type_key);
        const char *text;
        MOE_TRY(string_text(&text, name, sub, t));
        if (text == NULL) return wrong_type(name, sub, "a string", t);
        if (type_name != NULL && strcmp(type_name, text) != 0)
            return moe_error(MOE_ERR_CONFIG, "%s: %s.rope_type=\"%s\" disagrees with %s.type=\"%s\"", name, key,
                             type_name, key, text);
        type_name = text;
    }
    if (type_name != NULL) {
        size_t t = 0;
        while (t < N_ROPE_TYPES && strcmp(type_name, rope_type_names[t]) != 0) t++;
        if (t == N_ROPE_TYPES)
            return moe_error(MOE_ERR_CONFIG,
                             "%s: %s.rope_type=\"%.60s\" is not supported (only \"default\", \"linear\", \"llama3\", "
                             "\"yarn\" or \"dynamic\")",
                             name, key, type_name);
        s->type = (moe_rope_type)t;
    }
    const unsigned bit = ROPE_TYPE_BIT(s->type);
    const bool yarn = s->type == MOE_ROPE_YARN;
    unsigned required = 0;
    for (size_t k = 0; k < N_ROPE_KEYS; k++)
        if (rope_keys[k].required & bit) required |= 1u << k;
    s->truncate = yarn;
    for (size_t i = 0; i < v->object.count; i++) {
        const moe_json_member *m = &v->object.members[i];
        if (strlen(m->key) != m->key_len)
            return moe_error(MOE_ERR_CONFIG, "%s: key \"%s.%s...\" contains a NUL character", name, key, m->key);
        if (strcmp(m->key, "rope_type") == 0 || strcmp(m->key, "type") == 0) continue; /* read above */
        snprintf(sub, sizeof sub, "%s.%.40s", key, m->key);
        const rope_key *r = find_rope_key(m->key);
        if (r != NULL && !(r->types & bit)) r = NULL; /* another type's */
        if (m->value.type == MOE_JSON_NULL) {
            /* Null is absent, but for two of yarn's keys transformers reads
             * it as a value: truncate null is false, factor null is
             * max_position_embeddings / original_max_position_embeddings. */
            if (yarn && r && strcmp(r->key, "truncate") == 0) s->truncate = false;
            if (yarn && r && strcmp(r->key, "factor") == 0) {
                out->factor_null = true;
                required &= ~(1u << (r - rope_keys));
            }
            continue;
        }
        if (strcmp(m->key, "rope_theta") == 0 || strcmp(m->key, "partial_rotary_factor") == 0) {
            if (m->value.type != MOE_JSON_NUMBER) return wrong_type(name, sub, "a number", &m->value);
            /* Checked here, where the key it came from is known. */
            MOE_TRY(check_float(name, sub, m->value.number.value));
            *(m->key[0] == 'r' ? &out->theta : &out->partial) = m->value.number.value;
            continue;
        }
        if (r == NULL) {
            warn(wfn, wctx, "%s: unknown key '%.100s' ignored", name, sub);
            continue;
        }
        void *at = (char *)s + r->offset;
        if (r->kind == F_INT) {
            MOE_TRY(read_int(at, name, sub, "an integer", &m->value));
        } else if (r->kind == F_BOOL) {
            if (m->value.type != MOE_JSON_BOOL) return wrong_type(name, sub, "true or false", &m->value);
            *(bool *)at = m->value.boolean;
        } else {
            if (m->value.type != MOE_JSON_NUMBER) return wrong_type(name, sub, "a number", &m->value);
            *(double *)at = m->value.number.value;
            /* 0 would read as not given; transformers would scale cos and sin by it. */
            if (strcmp(r->key, "attention_factor") == 0) MOE_TRY(check_float(name, sub, m->value.number.value));
        }
        required &= ~(1u << (r - rope_keys));
    }
    for (size_t k = 0; k < N_ROPE_KEYS; k++)
        if (required & 1u << k)
            return moe_error(MOE_ERR_CONFIG, "%s: %s.%s is missing: rope_type \"%s\" needs it", name, key,
                             rope_keys[k].key, rope_type_names[s->type]);
    if (yarn) {
        /* transformers' `or`: 0 (or absent) is the default. */
        if (s->beta_fast == 0.0) s->beta_fast = 32.0;
        if (s->beta_slow == 0.0) s->beta_slow = 1.0;
    }
    return MOE_OK;
}

/* What keys outside the table said, for fill_defaults to reconcile. */
typedef struct other_values {
    rope_read params, scaling; /* rope_parameters, rope_scaling */
    int64_t original_max;      /* a top-level original_max_position_embeddings; 0: not given */
    double partial;            /* a top-level partial_rotary_factor; NaN: not given */
    bool has_num_experts;
    int64_t num_experts; /* transformers' alias of num_local_experts */
    family type;                     /* model_type's (mixtral when absent) */
    unsigned family_given;           /* FAMILY_KEY_BIT of each of family_keys given (not null) */
    int64_t family_int[N_FAMILY_KEYS]; /* the integer keys' values */
    bool family_bool[N_FAMILY_KEYS];   /* the boolean keys' */
    uint64_t mlp_only[LAYER_SET_WORDS]; /* the layers mlp_only_layers lists, below MAX_LAYERS */
    uint64_t sliding[LAYER_SET_WORDS];  /* the layers layer_types calls sliding_attention, below MAX_LAYERS */
} other_values;

#define OTHER_VALUES_INIT                                                                                              \
    {.params = {.theta = NAN, .partial = NAN}, .scaling = {.theta = NAN, .partial = NAN}, .partial = NAN}

bool moe_rope_scaling_equal(const moe_rope_scaling *a, const moe_rope_scaling *b) {
    if (a->type != b->type) return false;
    for (size_t k = 0; k < N_ROPE_KEYS; k++)
        if (rope_value(a, &rope_keys[k]) != rope_value(b, &rope_keys[k])) return false;
    return true;
}

void moe_rope_scaling_describe(char *buf, size_t size, const moe_rope_scaling *s) {
    int n = snprintf(buf, size, "%s", moe_rope_type_name(s->type));
    const char *sep = " (";
    for (size_t k = 0; k < N_ROPE_KEYS && n >= 0 && (size_t)n < size; k++) {
        const rope_key *r = &rope_keys[k];
        const bool attention = s->type == MOE_ROPE_YARN && strcmp(r->key, "attention_factor") == 0;
        if (!(r->types & ROPE_TYPE_BIT(s->type)) || (rope_optional_zero(s, r) && !attention)) continue;
        char value[48];
        if (attention) /* what applies, derived or given */
            snprintf(value, sizeof value, "%.6g%s", moe_rope_attention_factor(s),
                     s->attention_factor == 0.0 ? " (from factor)" : "");
        else if (r->kind == F_BOOL)
            snprintf(value, sizeof value, "%s", rope_value(s, r) != 0.0 ? "true" : "false");
        else
            moe_shortest(value, sizeof value, rope_value(s, r));
        n += snprintf(buf + n, size - (size_t)n, "%s%s %s", sep, r->key, value);
        sep = ", ";
    }
    if (n >= 0 && (size_t)n < size && s->type != MOE_ROPE_DEFAULT) snprintf(buf + n, size - (size_t)n, ")");
}

/* The RoPE a config's keys give (o: its rope objects and top-level
 * original_max_position_embeddings and partial_rotary_factor; top_theta:
 * its top-level rope_theta, NaN when not given; max_positions: its
 * max_position_embeddings, 0 when unknown) into *theta (left alone when no
 * key gives one) and *rope, as transformers v5 resolves them. */
static moe_status resolve_rope(double *theta, moe_rope_scaling *rope, const other_values *o, double top_theta,
                               int64_t max_positions, const char *name, moe_warn_fn wfn, void *wctx) {
    /* transformers takes a non-empty rope_scaling as its rope_parameters
     * and drops the file's own, rope_theta included: with both, which one
     * the file meant cannot be known. */
    if (o->scaling.given && o->params.given)
        return moe_error(MOE_ERR_CONFIG, "%s: rope_scaling and rope_parameters are both given, and transformers reads "
                                         "rope_scaling alone: keep one",
                         name);
    const rope_read *r = o->scaling.given ? &o->scaling : &o->params;
    const char *prefix = o->scaling.given ? "rope_scaling" : "rope_parameters";
    if (!isnan(top_theta) && !isnan(r->theta) && top_theta != r->theta)
        return moe_error(MOE_ERR_CONFIG, "%s: rope_theta=%g disagrees with %s.rope_theta=%g", name, top_theta, prefix,
                         r->theta);
    if (!isnan(r->theta) || !isnan(top_theta)) *theta = isnan(r->theta) ? top_theta : r->theta;
    *rope = r->s;
    /* The object's partial_rotary_factor, else the top level's, which
     * transformers moves into it; its Mixtral's default RoPE ignores it. */
    const double partial = isnan(r->partial) ? o->partial : r->partial;
    if (!isnan(partial) && partial != 1.0) {
        if (rope->type != MOE_ROPE_DEFAULT)
            return moe_error(MOE_ERR_CONFIG, "%s: partial_rotary_factor=%g is not supported with rope_type \"%s\" (only "
                                             "1: RoPE rotates the whole head)",
                             name, partial, rope_type_names[rope->type]);
        warn(wfn, wctx, "%s: partial_rotary_factor=%g ignored: transformers' Mixtral rotates the whole head with the "
                        "default RoPE",
             name, partial);
    }
    const bool has_context = rope->type == MOE_ROPE_LLAMA3 || rope->type == MOE_ROPE_YARN;
    if (o->original_max && !has_context)
        warn(wfn, wctx, "%s: original_max_position_embeddings=%lld ignored: rope_type \"%s\" does not use it", name,
             (long long)o->original_max, rope_type_names[rope->type]);
    /* transformers takes the top-level key first, then the object's, then
     * max_position_embeddings. */
    if (has_context && o->original_max) rope->original_max_position_embeddings = o->original_max;
    if (has_context && !rope->original_max_position_embeddings) rope->original_max_position_embeddings = max_positions;
    if (r->factor_null && !max_positions)
        return moe_error(MOE_ERR_CONFIG, "%s: %s.factor is null, which transformers takes as max_position_embeddings / "
                                         "original_max_position_embeddings, and max_position_embeddings is not given",
                         name, prefix);
    if (has_context && !rope->original_max_position_embeddings) return MOE_OK; /* unknown: the caller's to fill */
    const double implicit = (double)max_positions / (double)rope->original_max_position_embeddings;
    if (r->factor_null) rope->factor = implicit;
    if (rope->type == MOE_ROPE_YARN && max_positions && implicit != 1.0 && implicit != rope->factor)
        warn(wfn, wctx, "%s: %s.factor=%g differs from max_position_embeddings / original_max_position_embeddings = %g: "
                        "factor applies, as in transformers",
             name, prefix, rope->factor, implicit);
    return check_rope(name, prefix, rope);
}

static bool listed(const char *key, const char *const *list, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (strcmp(key, list[i]) == 0) return true;
    return false;
}

/* One of checked_keys, key, with value v: checked, what fill_defaults
 * needs kept in o. */
static moe_status check_other(const char *key, const moe_json *v, other_values *o, const char *name, moe_warn_fn wfn,
                              void *wctx) {
    char got[80];
    /* The Qwens' layer keys: transformers divides by the step and looks
     * layers up in the list, which null makes raise. */
    if (v->type == MOE_JSON_NULL &&
        (strcmp(key, family_keys[KEY_SPARSE_STEP].key) == 0 || strcmp(key, family_keys[KEY_MLP_ONLY].key) == 0))
        return moe_error(MOE_ERR_CONFIG, "%s: %s=null is no %s", name, key,
                         strcmp(key, family_keys[KEY_SPARSE_STEP].key) == 0 ? "step" : "list of layers");
    if (v->type == MOE_JSON_NULL) return MOE_OK;
    if (strcmp(key, "rope_parameters") == 0) return read_rope(&o->params, key, v, name, wfn, wctx);
    if (strcmp(key, "rope_scaling") == 0) return read_rope(&o->scaling, key, v, name, wfn, wctx);
    if (strcmp(key, "original_max_position_embeddings") == 0) {
        MOE_TRY(read_int(&o->original_max, name, key, "an integer", v));
        return check_size(name, key, o->original_max, MAX_DIM);
    }
    if (strcmp(key, "partial_rotary_factor") == 0) {
        if (v->type != MOE_JSON_NUMBER) return wrong_type(name, key, "a number", v);
        o->partial = v->number.value;
        return check_float(name, key, o->partial);
    }
    if (strcmp(key, "num_experts") == 0) {
        o->has_num_experts = true;
        return read_int(&o->num_experts, name, key, "an integer", v);
    }
    /* transformers' ACT2FN computes "swish" as nn.SiLU. */
    if (strcmp(key, "hidden_act") == 0) return require_string(name, key, v, "silu", "swish");
    if (strcmp(key, "model_type") == 0) {
        const char *text;
        MOE_TRY(string_text(&text, name, key, v));
        if (text && listed(text, family_types, N_FAMILIES)) return MOE_OK;
        char types[160] = "";
        for (int f = 0, n = 0; f < N_FAMILIES && n >= 0 && (size_t)n < sizeof types; f++)
            n += snprintf(types + n, sizeof types - (size_t)n, "%s\"%s\"", f == 0 ? "" : f + 1 < N_FAMILIES ? ", " : " or ",
                          family_types[f]);
        return moe_error(MOE_ERR_CONFIG, "%s: model_type=%s is not supported (only %s)", name,
                         describe(got, sizeof got, v), types);
    }
    for (int k = 0; k < N_FAMILY_KEYS; k++) {
        if (strcmp(key, family_keys[k].key) != 0) continue;
        o->family_given |= FAMILY_KEY_BIT(k);
        if (k == KEY_MLP_ONLY) {
            MOE_TRY(read_layers(o->mlp_only, name, key, v, false));
        } else if (k == KEY_LAYER_TYPES) {
            if (v->type != MOE_JSON_ARRAY) return wrong_type(name, key, "a list of attention kinds", v);
            for (size_t i = 0; i < v->array.count; i++) {
                const char *kind = moe_json_text(&v->array.items[i]);
                const bool sliding = kind && strcmp(kind, "sliding_attention") == 0;
                if (!kind || (!sliding && strcmp(kind, "full_attention") != 0))
                    return moe_error(MOE_ERR_CONFIG, "%s: layer_types[%zu]=%s is neither \"full_attention\" nor "
                                                     "\"sliding_attention\"",
                                     name, i, describe(got, sizeof got, &v->array.items[i]));
                o->family_bool[k] |= sliding;
                if (sliding && i < MAX_LAYERS) moe_layer_set_add(o->sliding, (int64_t)i);
            }
            o->family_int[k] = (int64_t)v->array.count;
        } else if (k == KEY_NORM_TOPK || k == KEY_USE_WINDOW || k == KEY_ATTENTION_BIAS || k == KEY_QKV_BIAS ||
                   k == KEY_MLP_BIAS) {
            if (v->type != MOE_JSON_BOOL) return wrong_type(name, key, "true or false", v);
            o->family_bool[k] = v->boolean;
        } else if (k == KEY_CLIP_QKV) { /* null (no clipping) returned above */
            return moe_error(MOE_ERR_CONFIG, "%s: clip_qkv=%s is not supported (only null: q, k and v are not "
                                             "clipped)",
                             name, describe(got, sizeof got, v));
        } else {
            MOE_TRY(read_int(&o->family_int[k], name, key, "an integer", v));
        }
        return MOE_OK;
    }
    if (strcmp(key, "attention_dropout") == 0) {
        if (v->type != MOE_JSON_NUMBER) return wrong_type(name, key, "a number", v);
        if (v->number.value != 0.0)
            warn(wfn, wctx, "%s: attention_dropout=%s ignored: attention has no dropout", name,
                 describe(got, sizeof got, v));
        return MOE_OK;
    }
    return moe_error(MOE_ERR_INTERNAL, "%s: key %s is listed as checked but has no check", name, key);
}

/* Whether key is one of family_keys that model type fam has. */
static bool family_key(const char *key, family fam) {
    for (int k = 0; k < N_FAMILY_KEYS; k++)
        if (strcmp(key, family_keys[k].key) == 0) return (family_keys[k].families & FAMILY_BIT(fam)) != 0;
    return false;
}

/* Keys outside the struct: checked, then dropped. */
static moe_status read_other(const moe_json_member *m, other_values *o, const char *name, moe_warn_fn wfn,
                             void *wctx) {
    if (listed(m->key, ignored_keys, sizeof ignored_keys / sizeof *ignored_keys)) return MOE_OK;
    /* num_experts is an MoE's key, as the fields moe_only marks are. */
    const bool moe_key = dense_family(o->type) && strcmp(m->key, "num_experts") == 0;
    if (moe_key || (!listed(m->key, checked_keys, sizeof checked_keys / sizeof *checked_keys) &&
                    !family_key(m->key, o->type))) {
        warn(wfn, wctx, "%s: unknown key '%.100s' ignored", name, m->key);
        return MOE_OK;
    }
    return check_other(m->key, &m->value, o, name, wfn, wctx);
}

static size_t field_index(const char *key) {
    size_t f = 0;
    while (f < N_FIELDS && strcmp(fields[f].key, key) != 0) f++;
    return f;
}

static void set_default(moe_model_config *cfg, const field *f) {
    switch (f->kind) {
    case F_INT:
    case F_WINDOW: *(int64_t *)field_ptr(cfg, f) = (int64_t)f->def; break;
    case F_REAL: *(double *)field_ptr(cfg, f) = f->def; break;
    case F_BOOL: *(bool *)field_ptr(cfg, f) = f->def != 0.0; break;
    case F_ENUM: set_enum(cfg, f, (int)f->def); break;
    case F_TOKEN_IDS: memset(field_ptr(cfg, f), 0, sizeof(moe_token_ids)); break; /* absent */
    case F_LAYERS: memset(field_ptr(cfg, f), 0, LAYER_SET_WORDS * sizeof(uint64_t)); break; /* none */
    }
}

/* The root object's keys into cfg and o; state [N_FIELDS] says what each
 * field was given. */
static moe_status read_keys(moe_model_config *cfg, given *state, other_values *o, const moe_json *root,
                            const char *name, moe_warn_fn wfn, void *wctx) {
    if (root->type != MOE_JSON_OBJECT)
        return moe_error(MOE_ERR_CONFIG, "%s: top level is a JSON %s, not an object", name,
                         moe_json_type_name(root->type));
    /* The type first: which keys a file may have depends on it. */
    const moe_json *type = moe_json_get(root, "model_type");
    const char *type_text = type ? moe_json_text(type) : NULL;
    o->type = FAMILY_MIXTRAL;
    for (int f = 0; type_text && f < N_FAMILIES; f++)
        if (strcmp(type_text, family_types[f]) == 0) o->type = (family)f;
    for (size_t i = 0; i < root->object.count; i++) {
        const moe_json_member *m = &root->object.members[i];
        if (strlen(m->key) != m->key_len)
            return moe_error(MOE_ERR_CONFIG, "%s: key \"%s...\" contains a NUL character", name, m->key);
        size_t f = field_index(m->key);
        if (f < N_FIELDS && dense_family(o->type) && moe_only(&fields[f])) f = N_FIELDS; /* not its key */
        if (f == N_FIELDS) {
            MOE_TRY(read_other(m, o, name, wfn, wctx));
        } else if ((m->value.type == MOE_JSON_NULL && fields[f].kind != F_TOKEN_IDS) ||
                   (FAMILY_BIT(o->type) & (FAMILY_BIT(FAMILY_QWEN2) | DENSE_QWENS) && fields[f].kind == F_WINDOW &&
                    m->value.type == MOE_JSON_NUMBER && m->value.number.value == 0.0)) {
            /* A token id's null is a value (no token), not its default;
             * Qwen2MoeConfig writes no window as 0, which Qwen2Config and
             * Qwen3Config take too. */
            state[f] = GIVEN_NULL;
        } else {
            MOE_TRY(read_field(cfg, &fields[f], &m->value, name));
            state[f] = GIVEN;
        }
    }
    return MOE_OK;
}

/* num_key_value_heads divides num_attention_heads (grouped-query
 * attention); note follows the message. */
static moe_status check_kv_heads(const char *name, int64_t heads, int64_t kv_heads, const char *note) {
    if (heads % kv_heads == 0) return MOE_OK;
    return moe_error(MOE_ERR_CONFIG, "%s: num_attention_heads=%lld is not a multiple of num_key_value_heads=%lld%s",
                     name, (long long)heads, (long long)kv_heads, note);
}

/* A Qwen family's value v of moe_* field key, which its own keys say
 * (said, for messages), into cfg; a file that gives the moe_* key too
 * must agree. The canonical form of moe_shared_intermediate_size and
 * moe_dense_intermediate_size: 0 for the routed experts' width
 * (intermediate_size, set before). */
static moe_status take_family_value(moe_model_config *cfg, given *state, const char *key, int64_t v, const char *said,
                                    const char *name) {
    const size_t f = field_index(key);
    void *at = field_ptr(cfg, &fields[f]);
    const bool flag = fields[f].kind == F_BOOL;
    const int64_t given_value = flag ? *(bool *)at : *(int64_t *)at;
    const bool width =
        strcmp(key, "moe_shared_intermediate_size") == 0 || strcmp(key, "moe_dense_intermediate_size") == 0;
    const int64_t canonical = width && given_value == cfg->intermediate_size ? 0 : given_value;
    if (state[f] == GIVEN && canonical != v) {
        char text[32];
        if (flag)
            snprintf(text, sizeof text, "%s", given_value ? "true" : "false");
        else
            snprintf(text, sizeof text, "%lld", (long long)given_value);
        return moe_error(MOE_ERR_CONFIG, "%s: %s=%s disagrees with %s", name, key, text, said);
    }
    if (flag)
        *(bool *)at = v != 0;
    else
        *(int64_t *)at = v;
    state[f] = GIVEN;
    return MOE_OK;
}

/* Qwen3-MoE's and Qwen2-MoE's layers as their decoder layers choose them:
 * layer l is an MoE layer when mlp_only_layers does not list it and
 * (l + 1) % decoder_sparse_step == 0 (num_experts > 0 is checked
 * elsewhere), else a dense MLP width wide (the file's intermediate_size,
 * or when it is absent the config class's default; null builds no MLP in
 * transformers). A file that gives moe_dense_layers or
 * moe_dense_intermediate_size too must agree. */
static moe_status read_family_layers(moe_model_config *cfg, given *state, const other_values *o, int64_t width,
                                     given width_given, const char *name) {
    const int64_t step = o->family_given & FAMILY_KEY_BIT(KEY_SPARSE_STEP) ? o->family_int[KEY_SPARSE_STEP] : 1;
    /* transformers divides by it: 0 raises there; Python's remainder of a
     * negative step is 0 where its magnitude's is. */
    if (step == 0)
        return moe_error(MOE_ERR_CONFIG,
                         "%s: decoder_sparse_step=0 is no step (layer l is an MoE layer when (l + 1) %% "
                         "decoder_sparse_step == 0)",
                         name);
    if (state[field_index("num_hidden_layers")] != GIVEN) return MOE_OK; /* fill_defaults says it is missing */
    const char *type = family_types[o->type];
    uint64_t dense[LAYER_SET_WORDS] = {0};
    int64_t n_dense = 0;
    for (int64_t l = 0; l < cfg->num_hidden_layers && l < MAX_LAYERS; l++) {
        if ((l + 1) % step == 0 && !moe_layer_set_has(o->mlp_only, l)) continue; /* C's remainder is 0 where Python's is */
        moe_layer_set_add(dense, l);
        n_dense++;
    }
    const size_t f = field_index("moe_dense_layers");
    for (int64_t l = 0; state[f] == GIVEN && l < MAX_LAYERS; l++) {
        const bool qwen = moe_layer_set_has(dense, l);
        if (moe_layer_set_has(cfg->moe_dense_layers, l) == qwen) continue;
        if (l >= cfg->num_hidden_layers)
            return moe_error(MOE_ERR_CONFIG, "%s: moe_dense_layers lists layer %lld, past num_hidden_layers=%lld", name,
                             (long long)l, (long long)cfg->num_hidden_layers);
        return moe_error(MOE_ERR_CONFIG, "%s: moe_dense_layers %s layer %lld, which model_type %s's "
                                         "decoder_sparse_step=%lld and mlp_only_layers make %s",
                         name, qwen ? "does not list" : "lists", (long long)l, type, (long long)step,
                         qwen ? "a dense MLP" : "an MoE layer");
    }
    memcpy(cfg->moe_dense_layers, dense, sizeof dense);
    state[f] = GIVEN;
    /* Without a dense layer intermediate_size is unused, and read as before. */
    if (n_dense == 0) return MOE_OK;
    if (width_given == GIVEN_NULL)
        return moe_error(MOE_ERR_CONFIG, "%s: intermediate_size=null gives model_type %s's dense MLP layers no width",
                         name, type);
    MOE_TRY(check_size(name, "intermediate_size", width, MAX_GEMM_DIM));
    char said[96];
    snprintf(said, sizeof said, "intermediate_size=%lld%s", (long long)width,
             width_given == GIVEN ? "" : " (absent: the dense layers' default width)");
    return take_family_value(cfg, state, "moe_dense_intermediate_size", width == cfg->intermediate_size ? 0 : width,
                             said, name);
}

/* A qwen3_moe or qwen2_moe file's own keys, before the defaults: the
 * experts' width is moe_intermediate_size (intermediate_size is its dense
 * MLP layers', read_family_layers); Qwen2-MoE's one shared expert is
 * shared_expert_intermediate_size wide, behind its gate, and q, k and v
 * have biases unless qkv_bias says false. */
static moe_status read_family_sizes(moe_model_config *cfg, given *state, const other_values *o, const char *name) {
    if (o->type != FAMILY_QWEN3 && o->type != FAMILY_QWEN2) return MOE_OK;
    const char *type = family_types[o->type];
    if (!(o->family_given & FAMILY_KEY_BIT(KEY_MOE_INTERMEDIATE)))
        return moe_error(MOE_ERR_CONFIG, "%s: missing required key 'moe_intermediate_size' (model_type %s: the "
                                         "experts' width)",
                         name, type);
    const size_t inter = field_index("intermediate_size");
    const given width_given = state[inter];
    const int64_t width = width_given == GIVEN      ? cfg->intermediate_size
                          : o->type == FAMILY_QWEN3 ? QWEN3_DENSE_WIDTH_DEFAULT
                                                    : QWEN2_DENSE_WIDTH_DEFAULT;
    cfg->intermediate_size = o->family_int[KEY_MOE_INTERMEDIATE];
    state[inter] = GIVEN;
    MOE_TRY(read_family_layers(cfg, state, o, width, width_given, name));
    if (o->type != FAMILY_QWEN2) return MOE_OK;
    const int64_t shared = o->family_int[KEY_SHARED_INTERMEDIATE];
    if (!(o->family_given & FAMILY_KEY_BIT(KEY_SHARED_INTERMEDIATE)))
        return moe_error(MOE_ERR_CONFIG, "%s: missing required key 'shared_expert_intermediate_size' (model_type %s: "
                                         "the shared expert's width)",
                         name, type);
    if (shared <= 0)
        return moe_error(MOE_ERR_CONFIG, "%s: shared_expert_intermediate_size=%lld is not supported (a shared expert "
                                         "of no width: only positive widths)",
                         name, (long long)shared);
    if (shared > MAX_GEMM_DIM)
        return moe_error(MOE_ERR_CONFIG, "%s: shared_expert_intermediate_size=%lld exceeds %lld", name,
                         (long long)shared, (long long)MAX_GEMM_DIM);
    char said[96];
    snprintf(said, sizeof said, "shared_expert_intermediate_size=%lld", (long long)shared);
    MOE_TRY(take_family_value(cfg, state, "moe_n_shared_experts", 1, "model_type qwen2_moe's one shared expert", name));
    MOE_TRY(take_family_value(cfg, state, "moe_shared_intermediate_size", shared == cfg->intermediate_size ? 0 : shared,
                              said, name));
    MOE_TRY(take_family_value(cfg, state, "moe_shared_expert_gate", 1, "model_type qwen2_moe's gated shared expert",
                              name));
    /* transformers v4 gives q, k and v biases always; v5 reads qkv_bias, true when absent. */
    const bool given = o->family_given & FAMILY_KEY_BIT(KEY_QKV_BIAS), bias = !given || o->family_bool[KEY_QKV_BIAS];
    return take_family_value(cfg, state, "moe_qkv_bias", bias,
                             !given ? "qkv_bias (absent: true)" : bias ? "qkv_bias=true" : "qkv_bias=false", name);
}

/* A dense model type's file: every layer a dense MLP intermediate_size
 * wide, and one expert of top-1 for the MoE layers it has none of
 * (canonical_dense's form). */
static void read_dense_family(moe_model_config *cfg, given *state, const other_values *o) {
    if (!dense_family(o->type)) return;
    const size_t experts = field_index("num_local_experts"), top_k = field_index("num_experts_per_tok");
    cfg->num_local_experts = cfg->num_experts_per_tok = 1;
    state[experts] = state[top_k] = GIVEN;
    const size_t f = field_index("moe_dense_layers");
    for (int64_t l = 0; state[field_index("num_hidden_layers")] == GIVEN && l < cfg->num_hidden_layers && l < MAX_LAYERS;
         l++)
        moe_layer_set_add(cfg->moe_dense_layers, l);
    state[f] = GIVEN;
}

/* Qwen2Config's and Qwen3Config's windows: under use_sliding_window,
 * sliding_window (4096 when absent, null none) in the layers layer_types
 * calls sliding_attention, or without layer_types in those from
 * max_window_layers on (28 when absent); the other layers, and every
 * layer without use_sliding_window, attend to every position before.
 * This model has one window for all its layers. */
static moe_status read_qwen_windows(moe_model_config *cfg, const given *state, const other_values *o,
                                    const char *name) {
    const int64_t L = cfg->num_hidden_layers;
    const bool use = o->family_bool[KEY_USE_WINDOW];
    const int64_t size = !use                                             ? 0
                         : state[field_index("sliding_window")] == ABSENT ? WINDOW_DEFAULT
                                                                          : cfg->sliding_window;
    const bool typed = o->family_given & FAMILY_KEY_BIT(KEY_LAYER_TYPES);
    if (typed && o->family_int[KEY_LAYER_TYPES] != L)
        return moe_error(MOE_ERR_CONFIG, "%s: layer_types lists %lld layers' attention, and num_hidden_layers=%lld",
                         name, (long long)o->family_int[KEY_LAYER_TYPES], (long long)L);
    /* transformers' masks refuse a sliding_attention layer without a window. */
    if (typed && o->family_bool[KEY_LAYER_TYPES] && size == 0)
        return moe_error(MOE_ERR_CONFIG, "%s: layer_types calls a layer sliding_attention, and there is no window "
                                         "(use_sliding_window false, or sliding_window null)",
                         name);
    const int64_t first =
        o->family_given & FAMILY_KEY_BIT(KEY_MAX_WINDOW_LAYERS) ? o->family_int[KEY_MAX_WINDOW_LAYERS]
                                                                : MAX_WINDOW_LAYERS_DEFAULT;
    int64_t window = 0;
    for (int64_t l = 0; l < L && l < MAX_LAYERS; l++) {
        const bool sliding = typed ? moe_layer_set_has(o->sliding, l) : l >= first;
        const int64_t w = sliding ? size : 0;
        if (l > 0 && w != window)
            return moe_error(MOE_ERR_CONFIG, "%s: layer %lld attends %s a window, layer %lld %s (model_type %s's "
                                             "use_sliding_window, max_window_layers and layer_types): layers of "
                                             "different windows are not implemented",
                             name, (long long)(l - 1), window ? "within" : "without", (long long)l,
                             w ? "within one" : "without", family_types[o->type]);
        window = w;
    }
    cfg->sliding_window = window;
    return MOE_OK;
}

/* A file's defaults and keys, after Mixtral's defaults, for a model type
 * other than mixtral and ours: what transformers' config class of that
 * type and its model make of them, or a refusal of what this model does
 * not compute. */
static moe_status read_family_function(moe_model_config *cfg, given *state, const other_values *o, const char *name,
                                       moe_warn_fn wfn, void *wctx) {
    const char *type = family_types[o->type];
    for (size_t d = 0; d < sizeof family_defaults / sizeof *family_defaults; d++) {
        const size_t f = field_index(family_defaults[d].key);
        if (family_defaults[d].fam != o->type || state[f] == GIVEN) continue;
        field def = fields[f];
        def.def = family_defaults[d].def;
        set_default(cfg, &def);
    }
    const size_t head_dim = field_index("head_dim");
    if (o->type == FAMILY_QWEN3_DENSE && state[head_dim] == GIVEN_NULL)
        return moe_error(MOE_ERR_CONFIG, "%s: head_dim is null, and model_type qwen3 takes an integer (Qwen3Config "
                                         "refuses null)",
                         name);
    if (o->type == FAMILY_QWEN3_DENSE && state[head_dim] == ABSENT) {
        cfg->head_dim = QWEN3_HEAD_DIM_DEFAULT;
        state[head_dim] = GIVEN;
    }
    const moe_qk_norm_kind qk = o->type == FAMILY_QWEN3 || o->type == FAMILY_QWEN3_DENSE ? MOE_QK_NORM_PER_HEAD
                                : o->type == FAMILY_OLMOE                                ? MOE_QK_NORM_ACROSS_HEADS
                                                                                         : MOE_QK_NORM_NONE;
    if (cfg->moe_qk_norm != qk)
        return moe_error(MOE_ERR_CONFIG, "%s: moe_qk_norm=\"%s\", and model_type %s %s", name,
                         qk_norm_names[cfg->moe_qk_norm], type,
                         qk == MOE_QK_NORM_PER_HEAD      ? "normalises q and k per head"
                         : qk == MOE_QK_NORM_ACROSS_HEADS ? "normalises q and k across heads"
                                                          : "does not normalise q and k");
    if (o->type == FAMILY_QWEN2_DENSE)
        MOE_TRY(take_family_value(cfg, state, "moe_qkv_bias", 1, "model_type qwen2's q, k and v biases", name));
    if (o->type != FAMILY_QWEN2 && o->type != FAMILY_QWEN2_DENSE && (cfg->moe_qkv_bias || cfg->moe_shared_expert_gate))
        return moe_error(MOE_ERR_CONFIG, "%s: moe_%s=true, and model_type %s has none", name,
                         cfg->moe_qkv_bias ? "qkv_bias" : "shared_expert_gate", type);
    /* transformers reads norm_topk_prob alone, false when absent. */
    const bool norm = o->family_bool[KEY_NORM_TOPK];
    if (!dense_family(o->type) && state[field_index("moe_renormalize")] == GIVEN && cfg->moe_renormalize != norm)
        return moe_error(MOE_ERR_CONFIG, "%s: moe_renormalize=%s disagrees with norm_topk_prob=%s%s, which model_type %s "
                                         "takes",
                         name, cfg->moe_renormalize ? "true" : "false", norm ? "true" : "false",
                         o->family_given & FAMILY_KEY_BIT(KEY_NORM_TOPK) ? "" : " (absent)", type);
    if (!dense_family(o->type)) cfg->moe_renormalize = norm;
    if (o->family_bool[KEY_ATTENTION_BIAS])
        return moe_error(MOE_ERR_CONFIG, "%s: attention_bias=true is not supported (q, k, v and o have no biases)",
                         name);
    if (o->family_bool[KEY_MLP_BIAS])
        return moe_error(MOE_ERR_CONFIG, "%s: mlp_bias=true is not supported (the MLPs have no biases)", name);
    if (o->type == FAMILY_OLMOE || o->type == FAMILY_LLAMA) {
        /* OlmoeConfig and LlamaConfig have no window. */
        if (cfg->sliding_window > 0)
            warn(wfn, wctx, "%s: sliding_window=%lld ignored: model_type %s attends to every position before", name,
                 (long long)cfg->sliding_window, type);
        cfg->sliding_window = 0;
        return MOE_OK;
    }
    if (o->type == FAMILY_MISTRAL) { /* its window in every layer */
        if (state[field_index("sliding_window")] == ABSENT) cfg->sliding_window = WINDOW_DEFAULT;
        return MOE_OK;
    }
    if (o->type == FAMILY_QWEN3_DENSE || o->type == FAMILY_QWEN2_DENSE) return read_qwen_windows(cfg, state, o, name);
    /* Qwen2MoeConfig windows only some layers (layer_types, or under
     * use_sliding_window those below max_window_layers). */
    if (o->type == FAMILY_QWEN2 && (o->family_bool[KEY_USE_WINDOW] || o->family_bool[KEY_LAYER_TYPES]))
        return moe_error(MOE_ERR_CONFIG, "%s: %s is not supported for model_type qwen2_moe (a window on some layers "
                                         "only: every layer attends to every position before here)",
                         name, o->family_bool[KEY_USE_WINDOW] ? "use_sliding_window=true" : "a layer_types entry other "
                                                                                           "than \"full_attention\"");
    /* Qwen3MoeConfig keeps sliding_window only under use_sliding_window,
     * 4096 when absent (null: none). */
    if (!o->family_bool[KEY_USE_WINDOW]) cfg->sliding_window = 0;
    if (o->family_bool[KEY_USE_WINDOW] && state[field_index("sliding_window")] == ABSENT)
        cfg->sliding_window = WINDOW_DEFAULT;
    return MOE_OK;
}

/* Defaults for the fields not given, including those computed from others,
 * as transformers' MixtralConfig (or Qwen3MoeConfig, or OlmoeConfig) fills them. */
static moe_status fill_defaults(moe_model_config *cfg, given *state, const other_values *o, const char *name,
                                moe_warn_fn wfn, void *wctx) {
    const size_t experts = field_index("num_local_experts");
    read_dense_family(cfg, state, o);
    MOE_TRY(read_family_sizes(cfg, state, o, name));
    if (o->has_num_experts) {
        /* transformers' attribute_map reads num_experts as num_local_experts. */
        if (state[experts] == GIVEN && cfg->num_local_experts != o->num_experts)
            return moe_error(MOE_ERR_CONFIG,
                             "%s: num_experts=%lld disagrees with num_local_experts=%lld (transformers reads "
                             "num_experts as num_local_experts)",
                             name, (long long)o->num_experts, (long long)cfg->num_local_experts);
        cfg->num_local_experts = o->num_experts;
        state[experts] = GIVEN;
    }
    for (size_t f = 0; f < N_FIELDS; f++) {
        if (state[f] == GIVEN) continue;
        /* Every required field is an integer. */
        if (fields[f].required && state[f] == GIVEN_NULL)
            return moe_error(MOE_ERR_CONFIG, "%s: %s must be an integer, got null", name, fields[f].key);
        if (fields[f].required) return moe_error(MOE_ERR_CONFIG, "%s: missing required key '%s'", name, fields[f].key);
        if (fields[f].def != DERIVED) set_default(cfg, &fields[f]);
    }
    if (o->type != FAMILY_MIXTRAL && o->type != FAMILY_OURS)
        MOE_TRY(read_family_function(cfg, state, o, name, wfn, wctx));
    /* The shared experts' and dense layers' widths in one form: the routed experts' is 0. */
    if (cfg->moe_shared_intermediate_size == cfg->intermediate_size) cfg->moe_shared_intermediate_size = 0;
    if (cfg->moe_dense_intermediate_size == cfg->intermediate_size) cfg->moe_dense_intermediate_size = 0;
    const double top_theta = state[field_index("rope_theta")] == GIVEN ? cfg->rope_theta : NAN;
    MOE_TRY(resolve_rope(&cfg->rope_theta, &cfg->rope_scaling, o, top_theta, cfg->max_position_embeddings, name, wfn,
                         wctx));
    /* MixtralConfig: 8 when absent, num_attention_heads when null;
     * OlmoeConfig and LlamaConfig: num_attention_heads either way. */
    const given kv = state[field_index("num_key_value_heads")];
    if (kv == GIVEN_NULL || (kv == ABSENT && (o->type == FAMILY_OLMOE || o->type == FAMILY_LLAMA)))
        cfg->num_key_value_heads = cfg->num_attention_heads;
    if (kv == ABSENT && cfg->num_attention_heads > 0)
        MOE_TRY(check_kv_heads(name, cfg->num_attention_heads, cfg->num_key_value_heads,
                               " (absent: transformers' default)"));
    /* transformers' Mixtral: head_dim or hidden_size // num_attention_heads,
     * rounded down; q and o are then heads x head_dim wide, narrower than
     * hidden_size when it does not divide, which the model allows. */
    if (state[field_index("head_dim")] != GIVEN && cfg->num_attention_heads > 0) {
        cfg->head_dim = cfg->hidden_size / cfg->num_attention_heads;
        if (cfg->hidden_size > 0 && (cfg->head_dim < 1 || cfg->head_dim % 2 != 0))
            return moe_error(MOE_ERR_CONFIG,
                             "%s: head_dim is not given, and hidden_size=%lld // num_attention_heads=%lld = %lld "
                             "(transformers' default) is not a positive even number (RoPE rotates pairs)",
                             name, (long long)cfg->hidden_size, (long long)cfg->num_attention_heads,
                             (long long)cfg->head_dim);
    }
    /* OLMoE's q_norm is hidden_size wide, over q's heads x head_dim. */
    if (o->type == FAMILY_OLMOE && cfg->num_attention_heads * cfg->head_dim != cfg->hidden_size)
        return moe_error(MOE_ERR_CONFIG, "%s: num_attention_heads=%lld x head_dim=%lld is not hidden_size=%lld, the "
                                         "width of model_type olmoe's q_norm",
                         name, (long long)cfg->num_attention_heads, (long long)cfg->head_dim,
                         (long long)cfg->hidden_size);
    return MOE_OK;
}

/* A config that can never be read (not JSON, or past the size limit) is
 * refused as one with a bad value: MOE_ERR_CONFIG, whose detail is st's. */
static moe_status as_config_error(moe_status st) {
    if (st != MOE_ERR_FORMAT) return st;
    char message[MOE_ERROR_BYTES];
    snprintf(message, sizeof message, "%s", moe_last_error());
    return moe_error(MOE_ERR_CONFIG, "%s", message);
}

moe_status moe_model_config_take_token_ids(moe_model_config *cfg, const moe_json *root, const char *name) {
    for (size_t f = 0; f < N_FIELDS; f++) {
        if (fields[f].kind != F_TOKEN_IDS || ((moe_token_ids *)field_ptr(cfg, &fields[f]))->form != MOE_TOKEN_ID_ABSENT)
            continue;
        const moe_json *v = root->type == MOE_JSON_OBJECT ? moe_json_get(root, fields[f].key) : NULL;
        if (v) MOE_TRY(read_field(cfg, &fields[f], v, name));
    }
    return MOE_OK;
}

/* Token ids outside the vocabulary name no token; transformers loads them
 * with a warning (configs on the Hub hold pad_token_id -1), and so does
 * this reader, keeping them as given. */
static void warn_token_ids(const moe_model_config *cfg, const char *name, moe_warn_fn wfn, void *wctx) {
    for (size_t f = 0; f < N_FIELDS; f++) {
        if (fields[f].kind != F_TOKEN_IDS) continue;
        const moe_token_ids *t = field_cptr(cfg, &fields[f]);
        for (int i = 0; i < t->n; i++) {
            if (t->ids[i] >= 0 && t->ids[i] < cfg->vocab_size) continue;
            char item[16] = "";
            if (t->form == MOE_TOKEN_ID_LIST) snprintf(item, sizeof item, "[%d]", i);
            warn(wfn, wctx, "%s: %s%s=%lld is outside the vocabulary [0, %lld) and names no token; kept as given",
                 name, fields[f].key, item, (long long)t->ids[i], (long long)cfg->vocab_size);
            break;
        }
    }
}

/* A model without an MoE layer in one form, whichever model type its file
 * is (family_of): the fields only an MoE layer reads at their defaults,
 * one expert of top-1, and intermediate_size the dense layers' width. */
static void canonical_dense(moe_model_config *cfg) {
    if (moe_model_config_has_moe_layer(cfg)) return;
    const int64_t width = moe_model_config_dense_width(cfg);
    for (size_t f = 0; f < N_FIELDS; f++) /* the dense layers, all of them, stay */
        if (moe_only(&fields[f]) && fields[f].kind != F_LAYERS) set_default(cfg, &fields[f]);
    cfg->num_local_experts = cfg->num_experts_per_tok = 1;
    cfg->intermediate_size = width;
}

moe_status moe_model_config_parse(moe_model_config *cfg, const char *text, size_t len, const char *name,
                                  moe_warn_fn wfn, void *wctx) {
    if (name == NULL) name = "config.json";
    moe_json_doc *doc;
    MOE_TRY(as_config_error(moe_json_parse(&doc, text, len, name)));
    memset(cfg, 0, sizeof *cfg);
    given state[N_FIELDS] = {ABSENT};
    other_values o = OTHER_VALUES_INIT;
    moe_status st = read_keys(cfg, state, &o, moe_json_root(doc), name, wfn, wctx);
    moe_json_free(doc);
    if (st == MOE_OK) st = fill_defaults(cfg, state, &o, name, wfn, wctx);
    if (st == MOE_OK) st = moe_model_config_validate(cfg, name);
    if (st == MOE_OK) warn_token_ids(cfg, name, wfn, wctx);
    if (st == MOE_OK) canonical_dense(cfg);
    /* Kept as computed, so that a saved config says what the model does. */
    if (st == MOE_OK && !cfg->moe_renormalize && cfg->moe_gate != MOE_GATE_SOFTMAX_TOPK) {
        warn(wfn, wctx, "%s: moe_renormalize=false ignored: the %s gate always normalises the k chosen weights", name,
             gate_names[cfg->moe_gate]);
        cfg->moe_renormalize = true;
    }
    return st;
}

moe_status moe_model_config_load(moe_model_config *cfg, const char *path, moe_warn_fn wfn, void *wctx) {
    char *text;
    size_t len;
    MOE_TRY(as_config_error(moe_file_read_all(&text, &len, path, MOE_MODEL_CONFIG_MAX_BYTES)));
    moe_status st = moe_model_config_parse(cfg, text, len, path, wfn, wctx);
    free(text);
    return st;
}

static moe_status check_size(const char *name, const char *key, int64_t v, int64_t max) {
    if (v <= 0) return moe_error(MOE_ERR_CONFIG, "%s: %s=%lld must be positive", name, key, (long long)v);
    if (v > max)
        return moe_error(MOE_ERR_CONFIG, "%s: %s=%lld exceeds %lld", name, key, (long long)v, (long long)max);
    return MOE_OK;
}

static moe_status check_coef(const char *name, const char *key, double v) {
    if (isfinite(v) && v >= 0.0 && v <= MAX_COEF) return MOE_OK;
    return moe_error(MOE_ERR_CONFIG, "%s: %s=%g must be finite and in [0, %g]", name, key, v, MAX_COEF);
}

/* *acc += a * b; false on int64 overflow. */
static bool add_product(int64_t *acc, int64_t a, int64_t b) {
    int64_t p;
    return !__builtin_mul_overflow(a, b, &p) && !__builtin_add_overflow(*acc, p, acc);
}

/* The shared experts' MLP width (moe_layer_shared_width); validated first. */
static int64_t shared_width(const moe_model_config *c) {
    return c->moe_n_shared_experts *
           (c->moe_shared_intermediate_size > 0 ? c->moe_shared_intermediate_size : c->intermediate_size);
}

/* The dense MLP layers' width; 0 when the model has none. */
static int64_t used_dense_width(const moe_model_config *c) {
    return moe_model_config_dense_layer_count(c) > 0 ? moe_model_config_dense_width(c) : 0;
}

/* The model's parameters as it lays them out, in fp32 bytes, fit int64, so
 * that no size or offset computed from them overflows: the embedding and the
 * head (vocab x d each) and the final norm; per layer two norms, q and o
 * (d x heads x head_dim each), k and v (d x kv_heads x head_dim each), and
 * per MoE layer the router (E x d), the routed and shared experts (three
 * d x ff each), per dense layer its MLP (three d x width). Each factor is
 * already bounded by its own limit. */
static moe_status check_param_bytes(const moe_model_config *c, const char *name) {
    const int64_t d = c->hidden_size, ff = c->intermediate_size, E = c->num_local_experts;
    const int64_t qdim = c->num_attention_heads * c->head_dim, kvdim = c->num_key_value_heads * c->head_dim;
    const int64_t n_dense = moe_model_config_dense_layer_count(c);
    int64_t layer = qdim + 2 * kvdim, moe = 0, dense = 0, total = 0, bytes; /* the norms' and biases' room, at most */
    bool ok = add_product(&layer, 2 + 2 * qdim + 2 * kvdim, d) && add_product(&moe, E + 1, d) &&
              add_product(&moe, 3 * E * ff, d) && add_product(&moe, 3 * shared_width(c), d) &&
              add_product(&dense, 3 * used_dense_width(c), d) && add_product(&total, layer, c->num_hidden_layers) &&
              add_product(&total, moe, c->num_hidden_layers - n_dense) && add_product(&total, dense, n_dense) &&
              add_product(&total, 2 * c->vocab_size + 1, d) &&
              !__builtin_mul_overflow(total, (int64_t)sizeof(float), &bytes);
    if (ok) return MOE_OK;
    char dense_text[80] = "";
    if (n_dense > 0)
        snprintf(dense_text, sizeof dense_text, ", %lld dense layers x the width %lld", (long long)n_dense,
                 (long long)used_dense_width(c));
    return moe_error(MOE_ERR_CONFIG,
                     "%s: the parameter bytes of num_hidden_layers=%lld layers of hidden_size=%lld, "
                     "num_attention_heads=%lld and num_key_value_heads=%lld x head_dim=%lld, num_local_experts=%lld "
                     "x intermediate_size=%lld + the shared experts' width %lld%s, and vocab_size=%lld overflow int64",
                     name, (long long)c->num_hidden_layers, (long long)d, (long long)c->num_attention_heads,
                     (long long)c->num_key_value_heads, (long long)c->head_dim, (long long)E, (long long)ff,
                     (long long)shared_width(c), dense_text, (long long)c->vocab_size);
}

/* A struct filled by hand may hold what no config.json reads as. */
static moe_status check_token_ids(const char *name, const char *key, const moe_token_ids *t) {
    switch (t->form) {
    case MOE_TOKEN_ID_ABSENT:
    case MOE_TOKEN_ID_NULL:
        if (t->n == 0) return MOE_OK;
        break;
    case MOE_TOKEN_ID_INT:
        if (t->n == 1) return MOE_OK;
        break;
    case MOE_TOKEN_ID_LIST:
        if (t->n >= 0 && t->n <= MOE_TOKEN_IDS_MAX) return MOE_OK;
        break;
    default:
        return moe_error(MOE_ERR_CONFIG, "%s: %s has form %d, not a token id form", name, key, (int)t->form);
    }
    return moe_error(MOE_ERR_CONFIG, "%s: %s holds %d ids in form %d (an integer holds 1, a list at most %d, null or "
                     "absent none)", name, key, t->n, (int)t->form, MOE_TOKEN_IDS_MAX);
}

moe_status moe_model_config_validate(const moe_model_config *c, const char *name) {
    if (name == NULL) name = "config";
    MOE_TRY(check_size(name, "vocab_size", c->vocab_size, MAX_DIM));
    MOE_TRY(check_size(name, "hidden_size", c->hidden_size, MAX_GEMM_DIM));
    MOE_TRY(check_size(name, "intermediate_size", c->intermediate_size, MAX_GEMM_DIM));
    MOE_TRY(check_size(name, "num_hidden_layers", c->num_hidden_layers, MAX_LAYERS));
    MOE_TRY(check_size(name, "num_attention_heads", c->num_attention_heads, MAX_DIM));
    MOE_TRY(check_size(name, "num_key_value_heads", c->num_key_value_heads, MAX_DIM));
    MOE_TRY(check_size(name, "head_dim", c->head_dim, MAX_DIM));
    MOE_TRY(check_size(name, "num_local_experts", c->num_local_experts, MOE_EXPERTS_MAX));
    MOE_TRY(check_size(name, "num_experts_per_tok", c->num_experts_per_tok, MAX_DIM));
    MOE_TRY(check_size(name, "max_position_embeddings", c->max_position_embeddings, MAX_DIM));
    if (c->sliding_window < 0 || c->sliding_window > MAX_DIM)
        return moe_error(MOE_ERR_CONFIG, "%s: sliding_window=%lld must be in [1, %lld], or null (0 here) for none",
                         name, (long long)c->sliding_window, (long long)MAX_DIM);
    MOE_TRY(check_kv_heads(name, c->num_attention_heads, c->num_key_value_heads, ""));
    if (c->head_dim % 2 != 0)
        return moe_error(MOE_ERR_CONFIG, "%s: head_dim=%lld must be even (RoPE rotates pairs)", name,
                         (long long)c->head_dim);
    /* q and o are GEMMs num_attention_heads x head_dim wide (each factor is
     * at most MAX_DIM, so the product fits int64); k and v are narrower, as
     * num_key_value_heads divides num_attention_heads. */
    if (c->num_attention_heads * c->head_dim > MAX_GEMM_DIM)
        return moe_error(MOE_ERR_CONFIG, "%s: num_attention_heads=%lld x head_dim=%lld = %lld exceeds %lld", name,
                         (long long)c->num_attention_heads, (long long)c->head_dim,
                         (long long)(c->num_attention_heads * c->head_dim), (long long)MAX_GEMM_DIM);
    if (c->num_experts_per_tok > c->num_local_experts)
        return moe_error(MOE_ERR_CONFIG, "%s: num_experts_per_tok=%lld exceeds num_local_experts=%lld", name,
                         (long long)c->num_experts_per_tok, (long long)c->num_local_experts);
    /* The shared experts run as one MLP of moe_n_shared_experts x
     * moe_shared_intermediate_size (or intermediate_size) columns, a GEMM
     * size too. */
    if (c->moe_shared_intermediate_size < 0 || c->moe_shared_intermediate_size > MAX_GEMM_DIM)
        return moe_error(MOE_ERR_CONFIG, "%s: moe_shared_intermediate_size=%lld must be in [0, %lld] (0: "
                                         "intermediate_size)",
                         name, (long long)c->moe_shared_intermediate_size, (long long)MAX_GEMM_DIM);
    const bool own_width = c->moe_shared_intermediate_size > 0;
    const int64_t width = own_width ? c->moe_shared_intermediate_size : c->intermediate_size;
    const int64_t max_shared = MAX_GEMM_DIM / width;
    if (c->moe_n_shared_experts < 0 || c->moe_n_shared_experts > max_shared)
        return moe_error(MOE_ERR_CONFIG,
                         "%s: moe_n_shared_experts=%lld must be in [0, %lld] (times %s=%lld, at most %lld)", name,
                         (long long)c->moe_n_shared_experts, (long long)max_shared,
                         own_width ? "moe_shared_intermediate_size" : "intermediate_size", (long long)width,
                         (long long)MAX_GEMM_DIM);
    if (c->moe_shared_intermediate_size == c->intermediate_size)
        return moe_error(MOE_ERR_CONFIG, "%s: moe_shared_intermediate_size=%lld is intermediate_size: give 0, its one "
                                         "form",
                         name, (long long)c->moe_shared_intermediate_size);
    if (c->moe_n_shared_experts == 0 && (own_width || c->moe_shared_expert_gate))
        return moe_error(MOE_ERR_CONFIG, "%s: %s needs shared experts (moe_n_shared_experts=0)", name,
                         own_width ? "moe_shared_intermediate_size" : "moe_shared_expert_gate=true");
    /* A struct filled by hand may mark layers the model does not have. */
    for (int64_t l = c->num_hidden_layers; l < MAX_LAYERS; l++)
        if (moe_model_config_layer_is_dense(c, l))
            return moe_error(MOE_ERR_CONFIG, "%s: moe_dense_layers lists layer %lld, past num_hidden_layers=%lld", name,
                             (long long)l, (long long)c->num_hidden_layers);
    const int64_t n_dense = moe_model_config_dense_layer_count(c);
    /* The dense MLP is a GEMM its width wide, as an expert is. */
    if (c->moe_dense_intermediate_size < 0 || c->moe_dense_intermediate_size > MAX_GEMM_DIM)
        return moe_error(MOE_ERR_CONFIG, "%s: moe_dense_intermediate_size=%lld must be in [0, %lld] (0: "
                                         "intermediate_size)",
                         name, (long long)c->moe_dense_intermediate_size, (long long)MAX_GEMM_DIM);
    if (c->moe_dense_intermediate_size == c->intermediate_size)
        return moe_error(MOE_ERR_CONFIG, "%s: moe_dense_intermediate_size=%lld is intermediate_size: give 0, its one "
                                         "form",
                         name, (long long)c->moe_dense_intermediate_size);
    if (n_dense == 0 && c->moe_dense_intermediate_size > 0)
        return moe_error(MOE_ERR_CONFIG, "%s: moe_dense_intermediate_size=%lld needs dense layers (moe_dense_layers "
                                         "lists none)",
                         name, (long long)c->moe_dense_intermediate_size);
    /* The layer counts its parameter and gradient bytes, three d x ff
     * matrices per routed and shared expert plus the router, in int64. */
    int64_t dff, bytes;
    int64_t shared;
    if (__builtin_mul_overflow(c->hidden_size, c->intermediate_size, &dff) ||
        __builtin_mul_overflow(dff, 3 * c->num_local_experts + 1, &bytes) ||
        __builtin_mul_overflow(c->hidden_size, 3 * shared_width(c) + 1, &shared) ||
        __builtin_add_overflow(bytes, shared, &bytes) || __builtin_mul_overflow(bytes, 2 * (int64_t)sizeof(float), &bytes))
        return moe_error(MOE_ERR_CONFIG,
                         "%s: hidden_size=%lld x (intermediate_size=%lld x num_local_experts=%lld + the shared "
                         "experts' width %lld) overflows the layer's byte count",
                         name, (long long)c->hidden_size, (long long)c->intermediate_size,
                         (long long)c->num_local_experts, (long long)shared_width(c));
    /* A dense layer's MLP, three d x width matrices, counted alike. */
    int64_t dense;
    if (__builtin_mul_overflow(c->hidden_size, 3 * used_dense_width(c), &dense) ||
        __builtin_mul_overflow(dense, 2 * (int64_t)sizeof(float), &dense))
        return moe_error(MOE_ERR_CONFIG, "%s: hidden_size=%lld x the dense layers' width %lld overflows their byte "
                                         "count",
                         name, (long long)c->hidden_size, (long long)used_dense_width(c));
    MOE_TRY(check_param_bytes(c, name));
    for (size_t f = 0; f < N_FIELDS; f++)
        if (fields[f].kind == F_TOKEN_IDS) MOE_TRY(check_token_ids(name, fields[f].key, field_cptr(c, &fields[f])));
    for (size_t f = 0; f < N_FIELDS; f++) {
        const int v = fields[f].kind == F_ENUM ? enum_value(c, &fields[f]) : 0;
        if (v < 0 || (fields[f].kind == F_ENUM && v >= fields[f].n_names))
            return moe_error(MOE_ERR_CONFIG, "%s: %s=%d is not one of its %d values", name, fields[f].key, v,
                             fields[f].n_names);
    }
    MOE_TRY(check_float(name, "rope_theta", c->rope_theta));
    MOE_TRY(check_rope(name, "rope_scaling", &c->rope_scaling));
    MOE_TRY(check_float(name, "rms_norm_eps", c->rms_norm_eps));
    MOE_TRY(check_coef(name, "router_aux_loss_coef", c->router_aux_loss_coef));
    MOE_TRY(check_real(name, "router_jitter_noise", c->router_jitter_noise, 0.0, 1.0));
    MOE_TRY(check_float_upto(name, "initializer_range", c->initializer_range, MAX_INIT_STD));
    MOE_TRY(check_coef(name, "moe_capacity_factor", c->moe_capacity_factor));
    MOE_TRY(check_coef(name, "moe_z_loss_coef", c->moe_z_loss_coef));
    MOE_TRY(check_coef(name, "moe_seq_aux_loss_coef", c->moe_seq_aux_loss_coef));
    MOE_TRY(check_coef(name, "moe_bias_update_rate", c->moe_bias_update_rate));
    /* Used in single precision, and divided by in the gate's backward. */
    MOE_TRY(check_float_upto(name, "moe_routed_scaling_factor", c->moe_routed_scaling_factor, MAX_COEF));
    const int64_t E = c->num_local_experts, groups = c->moe_n_group;
    if (groups < 0 || groups > MOE_GROUPS_MAX || groups > E || (groups > 1 && E % groups))
        return moe_error(MOE_ERR_CONFIG, "%s: moe_n_group=%lld must divide num_local_experts=%lld and be at most %d "
                         "(0 or 1: no groups)", name, (long long)groups, (long long)E, MOE_GROUPS_MAX);
    if (groups <= 1 && (c->moe_topk_group < 0 || c->moe_topk_group > 1))
        return moe_error(MOE_ERR_CONFIG, "%s: moe_topk_group=%lld needs moe_n_group > 1 (moe_n_group=%lld: no groups, "
                         "and moe_topk_group 0 or 1)", name, (long long)c->moe_topk_group, (long long)groups);
    if (groups > 1 && (c->moe_topk_group < 1 || c->moe_topk_group > groups))
        return moe_error(MOE_ERR_CONFIG, "%s: moe_topk_group=%lld must be in [1, moe_n_group=%lld]", name,
                         (long long)c->moe_topk_group, (long long)groups);
    if (groups > 1 && c->num_experts_per_tok > c->moe_topk_group * (E / groups))
        return moe_error(MOE_ERR_CONFIG, "%s: moe_topk_group=%lld groups of %lld experts cannot hold "
                         "num_experts_per_tok=%lld", name, (long long)c->moe_topk_group, (long long)(E / groups),
                         (long long)c->num_experts_per_tok);
    return MOE_OK;
}

static moe_status write_text_line(void *ctx, FILE *file) {
    const moe_json_writer *w = ctx;
    MOE_TRY(moe_file_write_bytes(file, w->buf, w->len));
    return moe_file_write_bytes(file, "\n", 1);
}

/* Mixtral's and Qwen3-MoE's routing is every moe_* key that changes the
 * outputs at the value that makes the layer theirs (Mixtral's renormalises
 * the k weights; Qwen3-MoE's under norm_topk_prob). The loss-only keys
 * (router_aux_loss_coef, moe_z_loss_coef, moe_seq_aux_loss_coef, and
 * router_jitter_noise, which perturbs training only) leave it theirs;
 * moe_bias_update_rate > 0 does not, as the saved selection bias moves
 * the routing. Qwen2-MoE's adds one gated shared expert, and q, k and v
 * biases unless qkv_bias is false (transformers v4, which has them always,
 * loads such a file with the biases it lacks at 0, the same function); the
 * others have neither. The Qwens say which layers are dense MLPs
 * (decoder_sparse_step, mlp_only_layers); Mixtral and OLMoE have none.
 * A model of dense layers only is a dense one, told by its attention:
 * Llama's (no window; LlamaConfig refuses a hidden_size that is no
 * multiple of num_attention_heads, which MistralConfig takes, its window
 * null), Mistral's (a window), Qwen3's (q and k normalised per head) or
 * Qwen2's (q, k and v biases). */
static family family_of(const moe_model_config *c) {
    if (!moe_model_config_has_moe_layer(c)) {
        if (c->moe_qk_norm == MOE_QK_NORM_NONE && !c->moe_qkv_bias)
            return c->sliding_window > 0 || (c->num_attention_heads > 0 && c->hidden_size % c->num_attention_heads)
                       ? FAMILY_MISTRAL
                       : FAMILY_LLAMA;
        if (c->moe_qk_norm == MOE_QK_NORM_PER_HEAD && !c->moe_qkv_bias) return FAMILY_QWEN3_DENSE;
        return c->moe_qk_norm == MOE_QK_NORM_NONE ? FAMILY_QWEN2_DENSE : FAMILY_OURS;
    }
    const bool routing = c->moe_gate == MOE_GATE_SOFTMAX_TOPK && c->moe_capacity_factor == 0.0 &&
                         c->moe_bias_update_rate == 0.0 && c->moe_n_group <= 1 && c->moe_routed_scaling_factor == 1.0;
    const bool dense = moe_model_config_dense_layer_count(c) > 0;
    if (!routing) return FAMILY_OURS;
    if (c->moe_n_shared_experts == 1 && c->moe_shared_expert_gate)
        return c->moe_qk_norm == MOE_QK_NORM_NONE && c->sliding_window == 0 ? FAMILY_QWEN2 : FAMILY_OURS;
    if (c->moe_n_shared_experts != 0 || c->moe_qkv_bias) return FAMILY_OURS;
    switch (c->moe_qk_norm) {
    case MOE_QK_NORM_PER_HEAD: return FAMILY_QWEN3;
    /* OLMoE's q_norm is hidden_size wide, and it has no window. */
    case MOE_QK_NORM_ACROSS_HEADS:
        return c->num_attention_heads * c->head_dim == c->hidden_size && c->sliding_window == 0 && !dense
                   ? FAMILY_OLMOE
                   : FAMILY_OURS;
    default: return c->moe_renormalize && !dense ? FAMILY_MIXTRAL : FAMILY_OURS;
    }
}

/* A layer set as a list of its layers, ascending. */
static void write_layers(moe_json_writer *w, const uint64_t *set) {
    moe_json_begin_array(w);
    for (int64_t l = 0; l < MAX_LAYERS; l++)
        if (moe_layer_set_has(set, l)) moe_json_int(w, l);
    moe_json_end_array(w);
}

/* A token id key's value as it was read: null, an integer or a list. */
static void write_token_ids(moe_json_writer *w, const moe_token_ids *t) {
    if (t->form == MOE_TOKEN_ID_NULL) {
        moe_json_null(w);
    } else if (t->form == MOE_TOKEN_ID_INT) {
        moe_json_int(w, t->ids[0]);
    } else {
        moe_json_begin_array(w);
        for (int i = 0; i < t->n; i++) moe_json_int(w, t->ids[i]);
        moe_json_end_array(w);
    }
}

const char *moe_model_config_model_type(const moe_model_config *cfg) { return family_types[family_of(cfg)]; }

/* The config as moe_model_config_save writes it, into w (initialised). */
/* Whether field f is written: the moe_* keys that a model type says in
 * its own keys (model_config.h) only in our type, and there only when
 * set, so that a configuration without them renders as before they
 * existed. */
static bool written(const moe_model_config *cfg, family fam, const field *f) {
    static const size_t ours_when_set[] = {offsetof(moe_model_config, moe_qk_norm),
                                           offsetof(moe_model_config, moe_qkv_bias),
                                           offsetof(moe_model_config, moe_shared_intermediate_size),
                                           offsetof(moe_model_config, moe_shared_expert_gate),
                                           offsetof(moe_model_config, moe_dense_layers),
                                           offsetof(moe_model_config, moe_dense_intermediate_size)};
    if (f->kind == F_TOKEN_IDS) /* as read: a reader takes its model type's default */
        return ((const moe_token_ids *)field_cptr(cfg, f))->form != MOE_TOKEN_ID_ABSENT;
    for (size_t i = 0; i < sizeof ours_when_set / sizeof *ours_when_set; i++) {
        if (f->offset != ours_when_set[i]) continue;
        const void *at = field_cptr(cfg, f);
        const bool set = f->kind == F_BOOL     ? *(const bool *)at
                         : f->kind == F_INT    ? *(const int64_t *)at != 0
                         : f->kind == F_LAYERS ? !layer_set_empty(at)
                                               : enum_value(cfg, f) != 0;
        return fam == FAMILY_OURS && set;
    }
    return true;
}

static void render(const moe_model_config *cfg, moe_json_writer *w) {
    const family fam = family_of(cfg);
    const bool qwen3 = fam == FAMILY_QWEN3, olmoe = fam == FAMILY_OLMOE, qwen2 = fam == FAMILY_QWEN2;
    const bool qwen = qwen3 || qwen2, llama = fam == FAMILY_LLAMA, dense = dense_family(fam);
    const bool qwen_window = family_keys[KEY_USE_WINDOW].families & FAMILY_BIT(fam); /* use_sliding_window's */
    moe_json_begin_object(w);
    moe_json_key(w, "architectures");
    moe_json_begin_array(w);
    moe_json_string(w, family_archs[fam]);
    moe_json_end_array(w);
    moe_json_key(w, "model_type");
    moe_json_string(w, family_types[fam]);
    moe_json_key(w, "hidden_act");
    moe_json_string(w, "silu");
    moe_json_key(w, "torch_dtype");
    moe_json_string(w, "float32");
    for (size_t f = 0; f < N_FIELDS; f++) {
        if (!written(cfg, fam, &fields[f]) || (dense && moe_only(&fields[f]))) continue;
        const size_t offset = fields[f].offset;
        if (llama && offset == offsetof(moe_model_config, sliding_window)) continue; /* LlamaConfig has none */
        /* transformers v4's Qwen3MoeConfig takes num_experts alone (v5 reads
         * it as num_local_experts), and OlmoeConfig and Qwen2MoeConfig do;
         * the Qwens' intermediate_size is their dense MLP layers' width,
         * the experts' when there are none (for a reader that wants one). */
        if (qwen && offset == offsetof(moe_model_config, intermediate_size)) {
            moe_json_key(w, family_keys[KEY_MOE_INTERMEDIATE].key);
            moe_json_int(w, cfg->intermediate_size);
            moe_json_key(w, fields[f].key);
            moe_json_int(w, moe_model_config_dense_width(cfg));
            continue;
        }
        if (qwen_window && offset == offsetof(moe_model_config, sliding_window)) {
            moe_json_key(w, family_keys[KEY_USE_WINDOW].key);
            moe_json_bool(w, cfg->sliding_window > 0);
        }
        moe_json_key(w, (qwen || olmoe) && offset == offsetof(moe_model_config, num_local_experts) ? "num_experts"
                                                                                                    : fields[f].key);
        switch (fields[f].kind) {
        case F_INT: moe_json_int(w, *(const int64_t *)field_cptr(cfg, &fields[f])); break;
        case F_REAL: moe_json_number(w, *(const double *)field_cptr(cfg, &fields[f])); break;
        case F_BOOL: moe_json_bool(w, *(const bool *)field_cptr(cfg, &fields[f])); break;
        case F_ENUM: moe_json_string(w, fields[f].names[enum_value(cfg, &fields[f])]); break;
        case F_WINDOW: {
            const int64_t v = *(const int64_t *)field_cptr(cfg, &fields[f]);
            if (v > 0)
                moe_json_int(w, v);
            else
                moe_json_null(w);
            break;
        }
        case F_TOKEN_IDS: write_token_ids(w, field_cptr(cfg, &fields[f])); break;
        case F_LAYERS: write_layers(w, field_cptr(cfg, &fields[f])); break;
        }
    }
    if (qwen || olmoe) {
        moe_json_key(w, family_keys[KEY_NORM_TOPK].key);
        moe_json_bool(w, cfg->moe_renormalize);
    }
    if (family_keys[KEY_ATTENTION_BIAS].families & FAMILY_BIT(fam)) {
        moe_json_key(w, family_keys[KEY_ATTENTION_BIAS].key);
        moe_json_bool(w, false);
    }
    if (family_keys[KEY_MLP_BIAS].families & FAMILY_BIT(fam)) {
        moe_json_key(w, family_keys[KEY_MLP_BIAS].key);
        moe_json_bool(w, false);
    }
    if (qwen2) {
        moe_json_key(w, family_keys[KEY_SHARED_INTERMEDIATE].key);
        moe_json_int(w, shared_width(cfg));
        moe_json_key(w, family_keys[KEY_QKV_BIAS].key);
        moe_json_bool(w, cfg->moe_qkv_bias);
    }
    if (qwen) {
        moe_json_key(w, family_keys[KEY_SPARSE_STEP].key);
        moe_json_int(w, 1);
        moe_json_key(w, family_keys[KEY_MLP_ONLY].key);
        write_layers(w, cfg->moe_dense_layers);
    }
    if (qwen_window) {
        /* transformers v4 windows only the layers from it on. */
        moe_json_key(w, family_keys[KEY_MAX_WINDOW_LAYERS].key);
        moe_json_int(w, 0);
    }
    if (olmoe) {
        moe_json_key(w, family_keys[KEY_CLIP_QKV].key);
        moe_json_null(w);
    }
    /* As transformers v4 writes a scaled RoPE, which v5 reads as its
     * rope_parameters; every parameter of the type explicit. */
    const moe_rope_scaling *rope = &cfg->rope_scaling;
    if (rope->type != MOE_ROPE_DEFAULT) {
        moe_json_key(w, "rope_scaling");
        moe_json_begin_object(w);
        moe_json_key(w, "rope_type");
        moe_json_string(w, rope_type_names[rope->type]);
        for (size_t k = 0; k < N_ROPE_KEYS; k++) {
            const rope_key *r = &rope_keys[k];
            /* yarn's context stays implicit when it is max_position_embeddings:
             * transformers v4.5x then takes their ratio for factor. */
            const bool implicit_context = rope->type == MOE_ROPE_YARN && r->kind == F_INT &&
                                          rope->original_max_position_embeddings == cfg->max_position_embeddings;
            if (!(r->types & ROPE_TYPE_BIT(rope->type)) || rope_optional_zero(rope, r) || implicit_context) continue;
            moe_json_key(w, r->key);
            if (r->kind == F_INT)
                moe_json_int(w, (int64_t)rope_value(rope, r));
            else if (r->kind == F_BOOL)
                moe_json_bool(w, rope_value(rope, r) != 0.0);
            else
                moe_json_number(w, rope_value(rope, r));
        }
        moe_json_end_object(w);
    }
    moe_json_end_object(w);
}

/* The text of the file moe_model_config_save writes, in w (initialised
 * here; the caller frees it), but for its last newline; name leads the
 * messages. */
static moe_status render_text(moe_json_writer *w, const moe_model_config *cfg, const char *name) {
    moe_json_writer_init(w, 2);
    moe_status st = moe_model_config_validate(cfg, name);
    moe_model_config one = *cfg; /* what a reader of the file gets */
    canonical_dense(&one);
    if (st == MOE_OK) render(&one, w);
    if (st == MOE_OK && (st = moe_json_writer_finish(w)) != MOE_OK) st = moe_error_prefix(st, "%s: ", name);
    return st;
}

moe_status moe_model_config_save(const moe_model_config *cfg, const char *path) {
    moe_json_writer w;
    moe_status st = render_text(&w, cfg, path);
    if (st == MOE_OK) st = moe_file_write_atomic(path, write_text_line, &w);
    moe_json_writer_free(&w);
    return st;
}

moe_status moe_model_config_crc32c(const moe_model_config *cfg, uint32_t *crc) {
    moe_json_writer w;
    const moe_status st = render_text(&w, cfg, "config");
    if (st == MOE_OK) *crc = moe_crc32c(moe_crc32c(0, w.buf, w.len), "\n", 1);
    moe_json_writer_free(&w);
    return st;
}

void moe_model_config_default_small(moe_model_config *cfg, int64_t vocab_size) {
    memset(cfg, 0, sizeof *cfg);
    for (size_t f = 0; f < N_FIELDS; f++)
        if (!fields[f].required && fields[f].def != DERIVED) set_default(cfg, &fields[f]);
    cfg->vocab_size = vocab_size;
    cfg->hidden_size = 128;
    cfg->intermediate_size = 256;
    cfg->num_hidden_layers = 4;
    cfg->num_attention_heads = 4;
    cfg->num_key_value_heads = 2;
    cfg->head_dim = 128 / 4;
    cfg->num_local_experts = 8;
    cfg->num_experts_per_tok = 2;
    cfg->rope_theta = 10000.0;
    cfg->rms_norm_eps = 1e-5;
    cfg->router_aux_loss_coef = 0.01;
}

double moe_attention_pairs(int64_t T, int64_t window) {
    const double t = (double)T, W = (double)window;
    if (window == 0 || window >= T) return t * (t + 1.0) / 2.0;
    return W * (W + 1.0) / 2.0 + (t - W) * W; /* query i sees min(i + 1, W) keys */
}

double moe_model_config_attention_span(const moe_model_config *cfg, int64_t T) {
    if (cfg->sliding_window == 0 || cfg->sliding_window >= T) return (double)T;
    return (double)T * moe_attention_pairs(T, cfg->sliding_window) / moe_attention_pairs(T, 0);
}

void moe_model_config_layer(moe_layer_config *layer, const moe_model_config *cfg, int64_t seq_len, uint64_t seed) {
    *layer = (moe_layer_config)MOE_LAYER_CONFIG_INIT;
    layer->d_model = cfg->hidden_size;
    layer->d_ff = cfg->intermediate_size;
    layer->n_experts = cfg->num_local_experts;
    layer->top_k = cfg->num_experts_per_tok;
    layer->gate = cfg->moe_gate;
    layer->renormalize = cfg->moe_renormalize;
    layer->capacity_factor = cfg->moe_capacity_factor;
    layer->aux_loss_coef = cfg->router_aux_loss_coef;
    layer->seq_aux_loss_coef = cfg->moe_seq_aux_loss_coef;
    layer->seq_len = seq_len;
    layer->z_loss_coef = cfg->moe_z_loss_coef;
    layer->bias_update_rate = cfg->moe_bias_update_rate;
    layer->n_shared_experts = cfg->moe_n_shared_experts;
    layer->shared_d_ff = cfg->moe_shared_intermediate_size;
    layer->shared_gate = cfg->moe_shared_expert_gate;
    layer->jitter_eps = cfg->router_jitter_noise;
    layer->n_groups = cfg->moe_n_group;
    layer->top_groups = cfg->moe_topk_group;
    layer->routed_scale = cfg->moe_routed_scaling_factor;
    layer->seed = seed;
}

bool moe_model_config_layer_is_dense(const moe_model_config *cfg, int64_t layer) {
    return layer >= 0 && layer < MAX_LAYERS && moe_layer_set_has(cfg->moe_dense_layers, layer);
}

bool moe_model_config_has_moe_layer(const moe_model_config *cfg) {
    return moe_model_config_dense_layer_count(cfg) < cfg->num_hidden_layers;
}

bool moe_model_config_drops_pairs(const moe_model_config *cfg) {
    return cfg->moe_capacity_factor > 0.0 && moe_model_config_has_moe_layer(cfg);
}

int64_t moe_model_config_dense_layer_count(const moe_model_config *cfg) {
    int64_t n = 0;
    for (int64_t l = 0; l < cfg->num_hidden_layers && l < MAX_LAYERS; l++) n += moe_model_config_layer_is_dense(cfg, l);
    return n;
}

int64_t moe_model_config_dense_width(const moe_model_config *cfg) {
    return cfg->moe_dense_intermediate_size > 0 ? cfg->moe_dense_intermediate_size : cfg->intermediate_size;
}
