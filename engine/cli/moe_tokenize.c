/* moe-tokenize: encodes text files into llm.c token shards for moe-train
 * --data (engine/corpus.h does the work); this file parses the flags and
 * prints what the encoding reports.
 * Exit status: 0 done, 1 a failure another try may survive (a file that
 * cannot be read or written), 2 bad flags or input that can never encode
 * (cli_run_failed). */
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "engine/cli/cli_flags.h"
#include "engine/corpus.h"

#define PROGRAM "moe-tokenize"

static void print_help(void) {
    moe_corpus_options d;
    moe_corpus_options_init(&d);
    printf("Usage: " PROGRAM " --tokenizer FILE --input GLOB [options]\n"
           "Encodes text into llm.c token shards, which moe-train --data and --val-data read.\n\n");
    printf("Input:\n"
           "  --tokenizer FILE     a Hugging Face tokenizer.json of a BPE model, byte-level (Qwen's,\n"
           "                       Llama 3's, OLMoE's, GPT-2's) or SentencePiece-style (Mixtral's,\n"
           "                       Mistral's, Llama 2's), which encodes as transformers does\n"
           "                       (required)\n"
           "  --input GLOB         the text files, in sorted order (required): a .jsonl (.ndjson)\n"
           "                       file holds one document per line (a JSON object, the document\n"
           "                       its string under --text-key), any other file is one document\n"
           "                       (UTF-8); - reads standard input as a .jsonl file\n"
           "                       (zstd -dc x.jsonl.zst | " PROGRAM " --input - ...)\n"
           "  --text-key K         the key of a .jsonl line's text (default %s)\n"
           "  --separator TEXT     the token before every document ('' for none). Default: the\n"
           "                       special tokens the tokenizer adds to a text (Llama 3's\n"
           "                       <|begin_of_text|>, Llama's and Mixtral's <s>) when it adds any,\n"
           "                       else <|endoftext|> when that is one token (GPT-2's, Qwen's)\n\n",
           d.text_key);
    printf("Output:\n"
           "  --out PREFIX         PREFIX_val_000000.bin ..., then PREFIX_train_NNNNNN.bin, one index\n"
           "                       through both, as llm.c names FineWeb's (default %s); uint16\n"
           "                       tokens when the tokenizer's ids fit, else uint32\n"
           "  --shard-tokens N     tokens per shard, a split's last fewer (default %lld)\n"
           "  --val-tokens N       the first documents, whole, until they hold N tokens or more,\n"
           "                       are the validation split (default 0: none)\n"
           "  --overwrite          replace the shards PREFIX has already (refused otherwise)\n"
           "  --threads N          encoding threads; 0 = OpenMP's default: OMP_NUM_THREADS, else\n"
           "                       every core (default)\n\n"
           "  -h, --help           this text\n\n"
           "The shards are written into PREFIX.partial-XXXXXX; once all are, the old ones move into\n"
           "it (as old-NAME) and the new ones into place, all or none on any failure the run sees.\n"
           "A run killed while they move leaves the folder and both corpora's shards in place: run\n"
           "it again with --overwrite, then remove the folder (the next run warns of it).\n",
           d.out, (long long)d.shard_tokens);
}

static moe_status validate(const void *options) { return moe_corpus_options_validate(options); }

#define OPT(field) offsetof(moe_corpus_options, field)
static const cli_flag flags[] = {
    {"--tokenizer", CLI_STRING, OPT(tokenizer), NULL},
    {"--input", CLI_STRING, OPT(input), NULL},
    {"--text-key", CLI_STRING, OPT(text_key), NULL},
    {"--separator", CLI_STRING, OPT(separator), NULL},
    {"--out", CLI_STRING, OPT(out), NULL},
    {"--shard-tokens", CLI_INT, OPT(shard_tokens), NULL},
    {"--val-tokens", CLI_INT, OPT(val_tokens), NULL},
    {"--overwrite", CLI_SWITCH, OPT(overwrite), NULL},
    {"--threads", CLI_THREADS, OPT(threads), NULL},
};
#undef OPT

typedef struct printer {
    const moe_corpus_options *o;
    int64_t tokenizer_tokens;
} printer;

static void on_start(void *ctx, const moe_corpus_plan *plan) {
    printer *p = ctx;
    const moe_corpus_options *o = p->o;
    p->tokenizer_tokens = plan->tokenizer_tokens;
    printf("tokenizer %s: %lld tokens, shards of uint%d tokens, %d threads\n", o->tokenizer,
           (long long)plan->tokenizer_tokens, 8 * plan->token_bytes, plan->threads);
    if (strcmp(o->input, "-") == 0)
        printf("input     standard input, as a .jsonl file\n");
    else
        printf("input     %s: %lld file%s\n", o->input, (long long)plan->files, plan->files == 1 ? "" : "s");
    if (plan->n_separator == 0) {
        printf("documents run together (--separator '')\n");
        return;
    }
    printf("documents each %s id", plan->separator_from_tokenizer ? "wrapped in the tokenizer's special tokens,"
                                                                   : "after the separator,");
    for (int i = 0; i < plan->n_separator; i++) printf("%s%d", i ? " " : " ", (int)plan->separator[i]);
    printf("\n");
}

static void on_warning(void *ctx, const char *message) {
    (void)ctx;
    cli_warning(message);
}

static void on_shard(void *ctx, const char *path, int64_t tokens) {
    (void)ctx;
    printf("shard     %s: %lld tokens\n", path, (long long)tokens);
    fflush(stdout);
}

int main(int argc, char **argv) {
    moe_corpus_options o;
    moe_corpus_options_init(&o);
    const int rc = cli_start(PROGRAM, &o, flags, sizeof flags / sizeof *flags, argc, argv, print_help, validate);
    if (rc >= 0) return rc;
    printer p = {.o = &o};
    const moe_corpus_callbacks cb = {.ctx = &p, .on_start = on_start, .on_shard = on_shard,
                                     .on_warning = on_warning};
    moe_corpus_totals t;
    const moe_status st = moe_corpus_tokenize(&o, &cb, &t);
    if (st != MOE_OK) return cli_run_failed(st, NULL);
    const int64_t tokens = t.val_tokens + t.train_tokens;
    printf("done      %lld documents (%lld empty), %.1f MB of text, %lld tokens (%.2f bytes per token): val %lld "
           "in %lld shard%s, train %lld in %lld shard%s; %.1f s, %.1f MB/s\n",
           (long long)t.documents, (long long)t.empty_documents, t.text_bytes / 1e6, (long long)tokens,
           (double)t.text_bytes / (double)tokens, (long long)t.val_tokens, (long long)t.val_shards,
           t.val_shards == 1 ? "" : "s", (long long)t.train_tokens, (long long)t.train_shards,
           t.train_shards == 1 ? "" : "s", t.seconds, t.text_bytes / 1e6 / (t.seconds > 0 ? t.seconds : 1e-9));
    printf("train     moe-train --data '%s_train_*.bin'%s%s%s --tokenizer '%s' (a --config's vocab_size at least "
           "%lld)\n",
           o.out, t.val_tokens ? " --val-data '" : "", t.val_tokens ? o.out : "", t.val_tokens ? "_val_*.bin'" : "",
           o.tokenizer, (long long)p.tokenizer_tokens);
    return cli_stdout_written();
}
