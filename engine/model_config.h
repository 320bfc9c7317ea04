/* model_config.h: the model's shape and routing policy, read from and written
 * to a Hugging Face Mixtral config.json (DESIGN.md 6) plus our own "moe_*"
 * keys for what Mixtral lacks. Every key means what transformers'
 * MixtralConfig makes of it. A "qwen3_moe" file is read as transformers'
 * Qwen3MoeConfig: its experts' width from moe_intermediate_size, its own
 * defaults (num_key_value_heads 4, max_position_embeddings 32768,
 * rope_theta 1e4, rms_norm_eps 1e-6, norm_topk_prob false), q and k
 * normalised per head (moe_qk_norm), sliding_window only under
 * use_sliding_window; layer l an MoE layer when mlp_only_layers does not
 * list it and (l + 1) % decoder_sparse_step == 0, as Qwen3MoeDecoderLayer
 * chooses, else a dense MLP intermediate_size wide (default 6144; kept
 * as moe_dense_layers and moe_dense_intermediate_size); no attention
 * biases, or it is refused. An "olmoe"
 * file is read as OlmoeConfig: its defaults (num_key_value_heads
 * num_attention_heads, max_position_embeddings 4096, rope_theta 1e4,
 * router_aux_loss_coef 0.01, norm_topk_prob false), q and k normalised
 * across heads, no window, no clip_qkv and no attention biases. A
 * "qwen2_moe" file is read as Qwen2MoeConfig: the experts' width from
 * moe_intermediate_size, one shared expert shared_expert_intermediate_size
 * wide behind its sigmoid gate, q, k and v biases unless qkv_bias is false,
 * its defaults (num_key_value_heads 16, max_position_embeddings 32768,
 * rope_theta 1e4, rms_norm_eps 1e-6, norm_topk_prob false), its dense MLP
 * layers chosen as Qwen3-MoE's (intermediate_size default 5632), and no
 * window (use_sliding_window false, layer_types all "full_attention"), or
 * it is refused. Our "moe_dense_layers" (a list of distinct layers) and
 * "moe_dense_intermediate_size" say the same in a file of any type; a
 * Qwen file that gives them too must agree with its own keys.
 *
 * Reading: a key we know but do not use (architectures, torch_dtype,
 * use_cache, ...) is accepted silently; an unknown key is ignored with a
 * warning passed to the caller's callback (the library never prints). Keys
 * that would change the model in ways we do not implement are errors
 * (hidden_act other than "silu" or "swish", which
 * transformers computes as silu, model_type other than "mixtral",
 * "qwen3_moe", "olmoe", "qwen2_moe", "moe" or the dense "llama",
 * "mistral", "qwen2" and "qwen3", whose every layer is a dense MLP,
 * a rope_type other than "default", "linear", "llama3", "yarn" or "dynamic", a
 * partial_rotary_factor other than 1). A wrong type or an
 * impossible value is an error naming the file, the key and the value, and
 * so is a string holding a NUL character (\u0000); an integer past int64 is
 * out of range. JSON null counts as absent for every key, as in
 * transformers, with transformers' exceptions: num_key_value_heads absent
 * is 8, null is num_attention_heads; and a token id null is no token, while
 * absent it is MixtralConfig's default (bos 1, eos 2), so both are kept as
 * given; the Qwens' decoder_sparse_step, mlp_only_layers and (with dense
 * layers) intermediate_size null, which their models cannot be built of,
 * are refused. "num_experts" stands for num_local_experts (transformers'
 * attribute_map); given both, they must agree. Limits that the MoE layer
 * imposes (moe_layer_config_validate) are checked here under the
 * config.json key.
 *
 * Writing: "model_type": "mixtral" and "architectures":
 * ["MixtralForCausalLM"] only when transformers' Mixtral computes what this
 * model computes: moe_gate "softmax_topk", moe_renormalize true, and
 * moe_capacity_factor, moe_n_shared_experts, moe_bias_update_rate 0,
 * moe_n_group 0 or 1, moe_routed_scaling_factor 1 (the loss-only keys
 * router_aux_loss_coef, moe_z_loss_coef, moe_seq_aux_loss_coef and
 * router_jitter_noise may take any value), no moe_qk_norm, no
 * moe_qkv_bias and no dense layer; with the
 * same routing (moe_renormalize either way) and moe_qk_norm "per_head"
 * "qwen3_moe" and ["Qwen3MoeForCausalLM"], with Qwen3's keys, and with
 * "across_heads", hidden_size num_attention_heads x head_dim wide and no
 * window, "olmoe" and ["OlmoeForCausalLM"], with OLMoE's; with one gated
 * shared expert, no q/k norm and no window, "qwen2_moe" and
 * ["Qwen2MoeForCausalLM"], with Qwen2-MoE's (qkv_bias as moe_qkv_bias
 * says). "olmoe" too only without dense layers; the Qwens write theirs
 * as decoder_sparse_step 1, mlp_only_layers and intermediate_size (the
 * experts' width when there are none). A model of dense layers only
 * (which has one form whatever file says it: its MoE fields at their
 * defaults, one expert of top-1, intermediate_size its MLPs' width) is
 * "llama", "mistral" (a window, or heads that do not divide hidden_size),
 * "qwen3" (q and k normalised per head) or "qwen2" (q, k and v biases),
 * with that class's keys. Otherwise
 * "model_type": "moe" and ["MoeForCausalLM"], which transformers refuses
 * rather than load as a model that gives other outputs; this library reads
 * them all. */
#ifndef MOE_ENGINE_MODEL_CONFIG_H
#define MOE_ENGINE_MODEL_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "moe.h"

struct moe_json; /* engine/json.h */

/* The most layers a model has (num_hidden_layers). */
#define MOE_MODEL_LAYERS_MAX 65536

/* The most ids one token-id key may list (Llama 3's eos_token_id lists 3). */
#define MOE_TOKEN_IDS_MAX 16

/* How config.json gave a token id key; absent and null differ in
 * transformers (absent: the model type's default; null: no token). */
typedef enum moe_token_id_form {
    MOE_TOKEN_ID_ABSENT = 0,
    MOE_TOKEN_ID_NULL,
    MOE_TOKEN_ID_INT,  /* one integer: ids[0] */
    MOE_TOKEN_ID_LIST, /* a list of n integers, possibly empty */
} moe_token_id_form;

/* bos_token_id, eos_token_id or pad_token_id, kept as read so that a saved
 * config gives transformers' generate the same ids (it stops at eos). They
 * do not change the model. Any int64 is kept: transformers accepts ids
 * outside the vocabulary (pad_token_id -1 is common) with a warning, and so
 * does the reader. */
typedef struct moe_token_ids {
    moe_token_id_form form;
    int n;                            /* ids held: 1 for INT, 0..MOE_TOKEN_IDS_MAX for LIST */
    int64_t ids[MOE_TOKEN_IDS_MAX];
} moe_token_ids;

/* RoPE's frequency scaling, as transformers computes each rope_type
 * (modeling_rope_utils): linear divides every inverse frequency by factor;
 * llama3 divides the low frequencies (wavelength past
 * original_max_position_embeddings / low_freq_factor) by factor, keeps the
 * high ones (shorter than ... / high_freq_factor) and blends those between;
 * yarn blends each frequency with itself divided by factor over a ramp set
 * by beta_fast and beta_slow (rotations within the original context), and
 * scales cos and sin by attention_factor; dynamic (NTK) changes nothing
 * within max_position_embeddings, which a model never passes
 * (moe_model_create), and past it transformers raises the base call by
 * call. A type's unused fields are 0. */
typedef enum moe_rope_type {
    MOE_ROPE_DEFAULT = 0,
    MOE_ROPE_LINEAR,
    MOE_ROPE_LLAMA3,
    MOE_ROPE_YARN,
    MOE_ROPE_DYNAMIC
} moe_rope_type;

typedef struct moe_rope_scaling {
    moe_rope_type type;
    double factor;                            /* linear, llama3, yarn, dynamic: a normal float */
    double low_freq_factor, high_freq_factor; /* llama3: 0 < low < high */
    /* llama3, yarn: the pretraining context; default max_position_embeddings
     * (a top-level original_max_position_embeddings first, as transformers
     * takes Phi-3's) */
    int64_t original_max_position_embeddings;
    double attention_factor;       /* yarn: on cos and sin, > 0; 0: from factor, mscale and mscale_all_dim */
    double beta_fast, beta_slow;   /* yarn: default 32 and 1 (0 reads as the default, as in transformers) */
    double mscale, mscale_all_dim; /* yarn: 0 when absent; used when both are set */
    bool truncate;                 /* yarn: whole dimensions for the ramp's ends (default true) */
} moe_rope_scaling;

/* The parameters of moe_rope_scaling after its type, for comparing them
 * one by one (moe_rope_scaling_field). */
#define MOE_ROPE_SCALING_FIELDS 10

/* How q and k are normalised before RoPE, if at all: Qwen3-MoE normalises
 * each head on its own, one head_dim weight vector for all heads; OLMoE
 * each token's whole projection, a weight per element. */
typedef enum moe_qk_norm_kind {
    MOE_QK_NORM_NONE = 0,
    MOE_QK_NORM_PER_HEAD,     /* "per_head": Qwen3-MoE's */
    MOE_QK_NORM_ACROSS_HEADS, /* "across_heads": OLMoE's */
} moe_qk_norm_kind;

typedef struct moe_model_config {
    /* Hugging Face MixtralConfig fields. Required in config.json: the sizes
     * down to num_experts_per_tok, except num_key_value_heads (default 8;
     * null: num_attention_heads) and head_dim (default, as transformers
     * computes it, hidden_size // num_attention_heads, rounded down). */
    int64_t vocab_size;
    int64_t hidden_size;       /* d */
    int64_t intermediate_size; /* each routed expert's ff width */
    int64_t num_hidden_layers;
    int64_t num_attention_heads;
    int64_t num_key_value_heads; /* divides num_attention_heads (GQA) */
    int64_t head_dim;            /* even, for RoPE's pairs */
    int64_t num_local_experts;   /* E */
    int64_t num_experts_per_tok; /* k */
    int64_t max_position_embeddings; /* default 131072 */
    /* Mistral's sliding window: a query sees itself and the
     * sliding_window - 1 positions before it, as transformers' masks do;
     * null in config.json (0 here, the default) for every position before. */
    int64_t sliding_window;
    double rope_theta;               /* default 1e6; also rope_parameters.rope_theta */
    /* rope_scaling (transformers v4) or rope_parameters (v5); default none */
    moe_rope_scaling rope_scaling;
    double rms_norm_eps;             /* default 1e-5 */
    double router_aux_loss_coef;     /* default 0.001 */
    double router_jitter_noise;      /* in [0, 1), default 0 */
    double initializer_range;        /* the initial weights' std, in [FLT_MIN, 1e3], default 0.02 */
    /* lm_head.weight is model.embed_tokens.weight (default false): one
     * tensor, which a checkpoint holds once, as transformers saves it. */
    bool tie_word_embeddings;
    moe_token_ids bos_token_id, eos_token_id, pad_token_id; /* as read; absent by default */
    /* q_norm and k_norm, RMSNorm on q and k before RoPE (default none). */
    moe_qk_norm_kind moe_qk_norm;
    /* q, k and v projections with biases, o's without (Qwen2's; default false). */
    bool moe_qkv_bias;
    /* Ours (moe_layer_config in moe.h says what each does). */
    moe_gate_kind moe_gate;       /* "softmax_topk" (default), "topk_softmax", "sigmoid" */
    bool moe_renormalize;         /* default true */
    double moe_capacity_factor;   /* default 0: dropless */
    double moe_z_loss_coef;       /* default 0 */
    double moe_seq_aux_loss_coef; /* default 0 (DeepSeek-V3's aux_loss_alpha with seq_aux) */
    int64_t moe_n_shared_experts; /* default 0 */
    int64_t moe_shared_intermediate_size; /* each shared expert's width; default 0: intermediate_size */
    bool moe_shared_expert_gate;  /* Qwen2-MoE's sigmoid gate on the shared experts; default false */
    double moe_bias_update_rate;  /* default 0 */
    int64_t moe_n_group;          /* default 0: no groups (DeepSeek-V3's n_group) */
    int64_t moe_topk_group;       /* groups a token's experts come from (topk_group) */
    double moe_routed_scaling_factor; /* default 1 (DeepSeek-V3's routed_scaling_factor) */
    /* Dense MLP layers among the MoE layers (Qwen2-MoE's and Qwen3-MoE's
     * decoder_sparse_step and mlp_only_layers, DeepSeek's first dense
     * layers, Switch's every other layer): bit l of the set marks layer l
     * a SwiGLU MLP moe_dense_intermediate_size wide (0: intermediate_size)
     * in place of the router and the experts (moe_model_config_layer_is_dense).
     * Default none; all of them make a dense baseline. */
    uint64_t moe_dense_layers[MOE_MODEL_LAYERS_MAX / 64];
    int64_t moe_dense_intermediate_size;
} moe_model_config;

/* Receives each warning, e.g. "config.json: unknown key 'foo' ignored". */
typedef void (*moe_warn_fn)(void *ctx, const char *message);

/* A moe_gate value as config.json writes it ("softmax_topk", ...); "?"
 * outside the enum. */
const char *moe_gate_kind_name(int kind);

/* A moe_qk_norm value as config.json writes it ("none", "per_head",
 * "across_heads"); "?" outside the enum. */
const char *moe_qk_norm_kind_name(int kind);

/* The width of the rows q's (k's when key) norm runs over: head_dim, or
 * the whole projection's (num_attention_heads or num_key_value_heads x
 * head_dim); 0 without one. Its weight has that many elements. */
int64_t moe_qk_norm_width(const moe_model_config *cfg, bool key);

/* The largest config.json read. */
#define MOE_MODEL_CONFIG_MAX_BYTES ((size_t)16 << 20)

/* Reads and validates a config.json; warn may be NULL. On failure *cfg is
 * unspecified. A file that cannot be opened or read is MOE_ERR_IO; one
 * that can never be a config (not JSON, past 16 MiB, a bad value) is
 * MOE_ERR_CONFIG. */
moe_status moe_model_config_load(moe_model_config *cfg, const char *path, moe_warn_fn warn, void *warn_ctx);

/* The same from text [len]; name (a file name) leads every message. */
moe_status moe_model_config_parse(moe_model_config *cfg, const char *text, size_t len, const char *name,
                                  moe_warn_fn warn, void *warn_ctx);

/* A rope_type as config.json writes it ("default", "llama3", ...); "?"
 * outside the enum. */
const char *moe_rope_type_name(int type);

/* Parameter i < MOE_ROPE_SCALING_FIELDS of s: its name under rope_scaling
 * ("rope_scaling.factor") and, in *value, its value. */
const char *moe_rope_scaling_field(const moe_rope_scaling *s, int i, double *value);

/* Whether a and b scale alike, field by field. */
bool moe_rope_scaling_equal(const moe_rope_scaling *a, const moe_rope_scaling *b);

/* The scaling as a line for messages: "llama3 (factor 8, low_freq_factor 1,
 * high_freq_factor 4, original_max_position_embeddings 8192)". */
void moe_rope_scaling_describe(char *buf, size_t size, const moe_rope_scaling *rope);

/* The token id keys (bos_token_id, eos_token_id, pad_token_id) of a
 * Hugging Face config.json of any model_type (root, its top-level object)
 * into those of cfg that are absent: a model made from another (sparse
 * upcycling) keeps its tokenizer's ids unless its own config says. */
moe_status moe_model_config_take_token_ids(moe_model_config *cfg, const struct moe_json *root, const char *name);

/* Checks every field; the error names `name`, the field and its value:
 * "config.json: num_experts_per_tok=9 exceeds num_local_experts=8". */
moe_status moe_model_config_validate(const moe_model_config *cfg, const char *name);

/* Writes the config atomically as Hugging Face Mixtral JSON (every field
 * explicit, so the file means the same to any reader) plus the moe_* keys,
 * and the token ids as they were read (an integer, a list, null, or left
 * out when absent, which a reader then takes as its model type's default);
 * loading it gives back an equal struct (for a model of dense layers only,
 * its one form). */
moe_status moe_model_config_save(const moe_model_config *cfg, const char *path);

/* The model_type moe_model_config_save writes for cfg: "mixtral",
 * "qwen3_moe", "olmoe", "qwen2_moe", "llama", "mistral", "qwen3", "qwen2"
 * or "moe"; a checkpoint's tensors take that type's names. */
const char *moe_model_config_model_type(const moe_model_config *cfg);

/* The CRC-32C of the bytes moe_model_config_save writes for cfg: two
 * configs that read alike have the same, however their files were laid out. */
moe_status moe_model_config_crc32c(const moe_model_config *cfg, uint32_t *crc);

/* A small model for tests and first runs: d 128, ff 256, 4 layers, 4 heads
 * (2 KV), 8 experts, top-2, rope_theta 1e4, eps 1e-5, aux coef 0.01, the
 * rest Mixtral's defaults (initializer_range 0.02). */
void moe_model_config_default_small(moe_model_config *cfg, int64_t vocab_size);

/* The (query, key) pairs of a sequence of T that causal attention with
 * this sliding window (0: none) computes: T (T + 1) / 2 without one. */
double moe_attention_pairs(int64_t T, int64_t window);

/* The sequence length attention's FLOP counts use (6 T heads x head_dim
 * a token and layer for the causal products): T, scaled by the share of
 * the causal pairs that the model's sliding window keeps. */
double moe_model_config_attention_span(const moe_model_config *cfg, int64_t T);

/* A set of layers as moe_dense_layers holds them, bit l % 64 of word
 * l / 64 for layer l (0 .. MOE_MODEL_LAYERS_MAX - 1): whether it has
 * layer, and layer added. */
bool moe_layer_set_has(const uint64_t *set, int64_t layer);
void moe_layer_set_add(uint64_t *set, int64_t layer);

/* Whether layer (0 .. num_hidden_layers - 1) is a dense MLP layer, not an
 * MoE layer; how many of the model's layers are; their MLP's width. */
bool moe_model_config_layer_is_dense(const moe_model_config *cfg, int64_t layer);
int64_t moe_model_config_dense_layer_count(const moe_model_config *cfg);
int64_t moe_model_config_dense_width(const moe_model_config *cfg);

/* Whether any layer is an MoE layer (not every one a dense MLP). */
bool moe_model_config_has_moe_layer(const moe_model_config *cfg);

/* Whether the model drops (token, slot) pairs past a capacity, so that a
 * token's output depends on the rest of its batch: a capacity factor and
 * an MoE layer to apply it. */
bool moe_model_config_drops_pairs(const moe_model_config *cfg);

/* The per-layer MoE settings of this model, whose sequences are seq_len
 * tokens (the sequence-wise balancing loss's); seed seeds the router jitter. */
void moe_model_config_layer(moe_layer_config *layer, const moe_model_config *cfg, int64_t seq_len, uint64_t seed);

#endif /* MOE_ENGINE_MODEL_CONFIG_H */
