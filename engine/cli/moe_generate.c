/* moe-generate: continues a prompt with a trained checkpoint
 * (engine/generate.h does the work); this file parses the flags and prints
 * what the generation reports.
 * Exit status: 0 done, 1 the generation failed or its stdout lost output
 * (a full disk, a pipe whose reader has gone), 2 bad flags or settings it
 * refuses (cli_run_failed). */
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/cli/cli_flags.h"
#include "engine/generate.h"
#include "engine/synthetic.h"
#include "kernels/cpu/blas.h"

#define PROGRAM "moe-generate"

static void print_help(void) {
    moe_generate_options d;
    moe_generate_options_init(&d);
    printf("Usage: " PROGRAM " --init-from DIR --prompt TEXT [options]\n"
           "Continues a prompt with a checkpoint's model, on a GPU when one answers and on the\n"
           "CPU otherwise (--device), and prints each sample as PROMPT|CONTINUATION.\n\n");
    printf("Input:\n"
           "  --init-from DIR      the checkpoint: DIR/config.json and DIR/model.safetensors (or its\n"
           "                       sharded index), e.g. out/step-002500 (required)\n"
           "  --prompt TEXT        the tokens to continue, in the --tokens form (required)\n"
           "  --tokens K           how prompts, --stop and samples are written: synthetic (the\n"
           "                       built-in corpus's token texts, e.g. '<arithmetic>3+4='; spaces\n"
           "                       between tokens are skipped), bytes (one token per byte;\n"
           "                       written and printed with \\n \\t \\r \\\\ and \\xNN escapes, '|' too), ids\n"
           "                       (comma-separated token ids) or auto (default): from the\n"
           "                       checkpoint's vocab_size, %d synthetic, 256 bytes, else ids\n"
           "  --tokenizer FILE     llm.c's tokenizer file (gpt2_tokenizer.bin) or a Hugging Face\n"
           "                       tokenizer.json (ByteLevel or SentencePiece-style decoders):\n"
           "                       samples print as text, in the bytes form's escapes (an id the\n"
           "                       file does not know as \\<id N>); a BPE tokenizer.json, byte-level\n"
           "                       (Qwen's, Llama 3's, OLMoE's, GPT-2's) or SentencePiece-style\n"
           "                       (Mixtral's, Mistral's, Llama 2's), encodes a UTF-8 prompt and\n"
           "                       --stop given as text, as transformers does, unless --tokens ids;\n"
           "                       with another, they are ids. llm.c's end-of-text token (version\n"
           "                       2's; GPT-2's 50256 in a version-1 file) ends a sample unless\n"
           "                       --stop names another. Not with --tokens synthetic or bytes.\n"
           "                       Default: --init-from's tokenizer.json, when it has one and the\n"
           "                       vocabulary takes ids\n\n",
           MOE_SYNTH_VOCAB_SIZE);
    printf("Generation:\n"
           "  --samples N          continuations of the prompt, generated together (default %lld)\n"
           "  --max-new-tokens N   tokens added to each, fewer when --stop comes (default %lld);\n"
           "                       the prompt plus these must fit max_position_embeddings\n"
           "  --temperature X      0 = greedy: the most likely token each time; else sample from\n"
           "                       the probabilities at temperature X (default %g)\n"
           "  --top-k K            sample among the K most likely tokens only; 0 = all (default %lld)\n"
           "  --top-p P            then among the fewest likeliest of those whose probabilities\n"
           "                       sum to P of theirs (nucleus sampling); 0 or 1 = all (default %g)\n"
           "  --seed N             the draws; sample K's depend on (seed, K) only, but for logits that\n"
           "                       tie to their last bits, which a step's row count can tip (default %llu)\n"
           "  --stop TEXT          one token, in the --tokens form, that ends a sample (e.g. ';');\n"
           "                       default: llm.c --tokenizer's end-of-text, else the checkpoint's\n"
           "                       eos_token_id (any of a list; generation_config.json's, else\n"
           "                       config.json's), as transformers' generate, else none\n\n",
           (long long)d.samples, (long long)d.max_new_tokens, d.sampling.temperature,
           (long long)d.sampling.top_k, d.sampling.top_p, (unsigned long long)d.sampling.seed);
    printf("Performance:\n"
           "  --device D           auto: CUDA when a GPU answers, else the CPU (default); cpu; cuda;\n"
           "                       cpu-strict (slow; checks that the model keeps to the op table)\n"
           "  --threads N          OpenMP (and OpenBLAS) threads; 0 = OpenMP's default:\n"
           "                       OMP_NUM_THREADS, else every core (default)\n\n"
           "  -h, --help           this text\n\n"
           "Environment: OMP_NUM_THREADS sets the thread count when --threads is not given;\n"
           "OPENBLAS_CORETYPE chooses OpenBLAS's kernels (unset, where OpenBLAS takes the CPU for\n"
           "a Prescott, moe-generate sets it by the CPU's instructions and runs again).\n");
}

/* ------------------------------------------------------------------ flags */

static moe_status parse_tokens(void *field, const char *value) { return moe_token_kind_parse(field, value); }
static moe_status parse_device(void *field, const char *value) { return moe_device_parse(field, value); }
static moe_status validate(const void *options) { return moe_generate_options_validate(options); }

#define OPT(field) offsetof(moe_generate_options, field)
static const cli_flag flags[] = {
    {"--init-from", CLI_STRING, OPT(init_from), NULL},
    {"--prompt", CLI_STRING, OPT(prompt), NULL},
    {"--samples", CLI_INT, OPT(samples), NULL},
    {"--max-new-tokens", CLI_INT, OPT(max_new_tokens), NULL},
    {"--temperature", CLI_REAL, OPT(sampling.temperature), NULL},
    {"--top-k", CLI_INT, OPT(sampling.top_k), NULL},
    {"--top-p", CLI_REAL, OPT(sampling.top_p), NULL},
    {"--seed", CLI_SEED, OPT(sampling.seed), NULL},
    {"--stop", CLI_STRING, OPT(stop), NULL},
    {"--tokens", CLI_PARSED, OPT(tokens), parse_tokens},
    {"--tokenizer", CLI_STRING, OPT(tokenizer), NULL},
    {"--device", CLI_PARSED, OPT(device), parse_device},
    {"--threads", CLI_THREADS, OPT(threads), NULL},
};
#undef OPT

/* --------------------------------------------------------------- printing */

static void on_start(void *ctx, const moe_generate_summary *s) {
    (void)ctx;
    if (s->device_note) printf("%s\n", s->device_note);
    printf("checkpoint %s | device %s, %d threads | tokens %s", s->checkpoint, s->device, s->threads,
           moe_token_kind_name(s->tokens));
    if (s->tokenizer) {
        printf(", printed as text by %s%s (%lld tokens", s->tokenizer_found ? "" : "--tokenizer ", s->tokenizer,
               (long long)s->tokenizer_tokens);
        if (s->encodes) printf("; it encoded the prompt, %lld tokens", (long long)s->prompt_tokens);
        if (s->stop_source == MOE_STOP_TOKENIZER) printf("; its end-of-text %d ends a sample", (int)s->stops[0]);
        printf(")");
    } else if (s->tokens_from_vocab) {
        printf(" (from vocab_size %lld)", (long long)s->config->vocab_size);
    } else {
        printf(" (--tokens)");
    }
    const bool eos = s->stop_source == MOE_STOP_CONFIG || s->stop_source == MOE_STOP_GENERATION_CONFIG;
    for (int i = 0; eos && i < s->n_stops; i++)
        printf("%s%d", i ? " or " : s->stop_source == MOE_STOP_CONFIG ? " | config.json's eos " : " | generation_config.json's eos ",
               (int)s->stops[i]);
    if (eos) printf(" ends a sample");
    printf("\n");
}

static void on_sample(void *ctx, const moe_generate_sample *s) {
    (void)ctx;
    printf("sample %lld: %s|%s\n", (long long)s->index, s->prompt_text, s->new_text);
}

static void on_warning(void *ctx, const char *message) {
    (void)ctx;
    cli_warning(message);
}

int main(int argc, char **argv) {
    moe_blas_refit(argv);
    moe_generate_options o;
    moe_generate_options_init(&o);
    const int rc = cli_start(PROGRAM, &o, flags, sizeof flags / sizeof *flags, argc, argv, print_help, validate);
    if (rc >= 0) return rc;
    const moe_generate_callbacks cb = {.on_start = on_start, .on_sample = on_sample, .on_warning = on_warning};
    const moe_status st = moe_generate_run(&o, &cb);
    return st == MOE_OK ? cli_stdout_written() : cli_run_failed(st, NULL);
}
