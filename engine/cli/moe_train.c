#define _POSIX_C_SOURCE 200809L
/* moe-train: trains a Mixtral-style MoE transformer (engine/run.h does the
 * work); this file parses the flags and prints what the run reports.
 * Exit status: 0 done, 1 the run failed or its stdout lost output, 2 bad
 * flags or settings the run refuses (cli_run_failed), 3 stopped before
 * --steps by a signal or --max-time, its last step checkpointed. A
 * failure on one rank of several ends the whole MPI job. */
#include <ctype.h>
#include <errno.h>
#include <signal.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "comm/comm.h"
#include "engine/cli/cli_flags.h"
#include "engine/run.h"
#include "kernels/cpu/blas.h"

#define PROGRAM "moe-train"
#define BAR_WIDTH 30
#define COMMAND_LINE_BYTES 8192

/* ------------------------------------------------------------------- help */

static void print_help(void) {
    moe_run_options d;
    moe_run_options_init(&d);
    moe_model_config m;
    moe_run_default_config(&m, MOE_SYNTH_VOCAB_SIZE);
    printf("Usage: " PROGRAM " [options]\n"
           "Trains a Mixtral-style Mixture-of-Experts transformer, on a GPU when one answers and\n"
           "on the CPU otherwise (--device). With no options it trains the default model on the\n"
           "built-in synthetic corpus until its validation loss is near the corpus's entropy\n"
           "floor (the best loss any model can reach).\n\n");
    printf("Model:\n"
           "  --config FILE        Hugging Face Mixtral, Qwen3-MoE, OLMoE or Qwen2-MoE config.json\n"
           "                       (plus moe_* keys), or a dense Llama, Mistral, Qwen2 or Qwen3 one.\n"
           "                       Default: --init-from's config.json, else the built-in model:\n"
           "                       d_model %lld, %lld layers, %lld heads (%lld KV), %lld experts of\n"
           "                       width %lld, top-%lld\n"
           "  --init-from DIR      start from DIR/model.safetensors (or its sharded index) and\n"
           "                       DIR/config.json, e.g. a checkpoint out/step-000600 (with\n"
           "                       another --out)\n"
           "  --upcycle            --init-from DIR holds a dense model (Llama's, Mistral's, Qwen2's or\n"
           "                       Qwen3's tensor names) of --config's sizes: each expert starts as a\n"
           "                       copy of its layer's MLP, the routers from scratch (sparse upcycling)\n\n",
           (long long)m.hidden_size, (long long)m.num_hidden_layers, (long long)m.num_attention_heads,
           (long long)m.num_key_value_heads, (long long)m.num_local_experts, (long long)m.intermediate_size,
           (long long)m.num_experts_per_tok);
    printf("Data:\n"
           "  --data SRC           training data (default %s): 'synthetic' for the built-in corpus\n"
           "                       (arithmetic, copying, brackets, Markov text, with a known floor);\n"
           "                       a glob or a .bin name for llm.c token shards (GPT-2's uint16 or\n"
           "                       Llama 3's uint32 tokens); any other file (or glob of them) is\n"
           "                       text that --tokenizer encodes, else read at byte level (vocab 256)\n"
           "  --val-data SRC       validation data, the same forms (default: a second synthetic\n"
           "                       stream; for file data, --data itself read from its start)\n"
           "  --val-tokens N       validate on --data's last N tokens, which training then never\n"
           "                       reads (a held-out split of file data; default 0: none)\n"
           "  --tokenizer FILE     the tokenizer.json of --data's token shards (moe-tokenize's), or\n"
           "                       one that encodes --data and --val-data given as text at the start\n"
           "                       as moe-tokenize does (a .jsonl of documents, any other file one):\n"
           "                       every checkpoint keeps it, so that moe-generate reads and writes\n"
           "                       text by it; without --config, --init-from or --resume, its ids\n"
           "                       are the built-in model's vocabulary (else GPT-2's 50257)\n"
           "  --eval-mc FILE       at every evaluation, score llm.c's multiple-choice eval file\n"
           "                       (hellaswag_val.bin, MMLU): each example's completion of least\n"
           "                       mean loss is its choice (acc_norm)\n"
           "  --batch-size B       sequences per micro-batch (default %lld)\n"
           "  --seq-len T          tokens per sequence (default %lld)\n"
           "  --shuffle            read training batches in a seeded random order (default: in order)\n\n",
           d.data, (long long)d.batch_size, (long long)d.seq_len);
    printf("Optimization (AdamW, betas 0.9/0.95, eps 1e-8):\n"
           "  --steps N            optimizer steps (default %lld)\n"
           "  --lr X               peak learning rate (default %g)\n"
           "  --min-lr X           learning rate at the last step (default: --lr / 10)\n"
           "  --warmup N           steps of linear warm-up (default %lld)\n"
           "  --lr-schedule S      cosine, linear or constant after warm-up, or wsd: lr until the\n"
           "                       last --decay-frac of those steps, then linear to --min-lr\n"
           "                       (default %s)\n"
           "  --decay-frac X       wsd's decay, a share of the steps after warm-up (default %g)\n"
           "  --weight-decay X     decoupled, on matrices only (default %g)\n"
           "  --grad-clip X        clip the global gradient norm to X; 0 = off (default %g)\n"
           "  --logit-z-loss X     add X times the mean of logsumexp(logits)^2 to the loss (PaLM's\n"
           "                       z-loss, which keeps the logits from drifting; 1e-4 there); 0 = off\n"
           "  --grad-accum N       micro-batches per step (default %lld)\n"
           "  --seed N             initial weights, synthetic data, shuffle, jitter (default %llu)\n\n",
           (long long)d.steps, d.lr, (long long)d.warmup, moe_lr_schedule_name(d.lr_schedule),
           ((moe_optim_config)MOE_OPTIM_CONFIG_INIT).decay_frac, d.weight_decay, d.grad_clip, (long long)d.grad_accum, (unsigned long long)d.seed);
    printf("Evaluation and output:\n"
           "  --eval-every N       evaluate every N steps and at the end; 0 = end only (default %lld)\n"
           "  --eval-batches N     batches per evaluation, read from the start (default %lld)\n"
           "  --eval-only          evaluate --init-from's model and print 'val_loss X' last\n"
           "  --out DIR            run.json, config.json, metrics.jsonl, checkpoints (default %s);\n"
           "                       a DIR holding another run is refused\n"
           "  --overwrite          remove the run already in --out first (its run.json,\n"
           "                       metrics.jsonl and checkpoints); with --resume of a checkpoint\n"
           "                       in --out, the checkpoints after it (refused otherwise)\n"
           "  --save-every N       checkpoint DIR/step-NNNNNN every N steps; the last step is\n"
           "                       always saved; 0 = last only (default %lld)\n"
           "  --keep-last N        after each checkpoint, remove DIR's older ones but the newest N\n"
           "                       (and, when older, the one --resume started from); 0 = keep all\n"
           "                       (default)\n"
           "  --resume DIR         continue from checkpoint DIR with the same flags otherwise\n"
           "                       (--config, if given, must match its config); the result\n"
           "                       matches an uninterrupted run bit for bit. 'latest': from --out's\n"
           "                       newest checkpoint, or a new run when --out has none (replacing\n"
           "                       a failed start's files), so that one command line starts a run\n"
           "                       and restarts it after a failure; refused when metrics.jsonl\n"
           "                       stops before that checkpoint, which only a hand-edited log leaves\n\n",
           (long long)d.eval_every, (long long)d.eval_batches, d.out_dir, (long long)d.save_every);
    printf("Performance:\n"
           "  --device D           auto: CUDA when a GPU answers, else the CPU (default); cpu;\n"
           "                       cuda (under mpirun: the GPU of each local rank, NCCL between\n"
           "                       them); cpu-strict: the CPU kernels on memory the host may\n"
           "                       touch only inside an op (one process, slow; checks that the\n"
           "                       run keeps to the op table, as a GPU needs)\n"
           "  --gemm-math M        fp32 (default): GPU GEMMs in plain fp32; tf32, bf16: the\n"
           "                       tensor cores, inputs rounded inside each GEMM, fp32 sums;\n"
           "                       bf16 also keeps the experts' operands and activations in\n"
           "                       bf16 and fuses attention (head sizes 16 to 128)\n"
           "  --recompute          keep only each layer's input between its forward and its\n"
           "                       backward, which recomputes the rest first: activations of\n"
           "                       one layer instead of every layer's, for about a third more\n"
           "                       compute per step (same results)\n"
           "  --threads N          OpenMP (and OpenBLAS) threads; 0 = OpenMP's default:\n"
           "                       OMP_NUM_THREADS, else every core (default)\n"
           "  --peak-gflops X      the MFU denominator; 0 = measure the device's GEMM in\n"
           "                       --gemm-math at start-up (default)\n"
           "  --profile            time every op of the steps after the first (on a GPU: events\n"
           "                       in its stream) and print where the time went; also in\n"
           "                       metrics.jsonl; on several ranks rank 0's ops (under --pp, the\n"
           "                       first stage's; waits for other stages count as no op's)\n\n"
           "Parallel (run under mpirun; every rank gets the same flags):\n"
           "  --pp S               split the layers over S pipeline stages (default 1): S divides\n"
           "                       the ranks, rank r is stage r/(ranks/S), a stage's ranks are\n"
           "                       data-parallel; the --grad-accum micro-batches flow through them\n"
           "  --pp-schedule K      1f1b: a stage starts backwards as soon as it can, keeping the\n"
           "                       activations of at most S - stage forwards (more under\n"
           "                       --pp-chunks); gpipe: every forward,\n"
           "                       then every backward, each forward but the last recomputed\n"
           "                       before its backward (default 1f1b)\n"
           "  --pp-chunks V        interleaved 1F1B (Megatron-LM's virtual pipeline): the layers in\n"
           "                       S x V runs, stage s holding runs s, s + S, ...; the bubble\n"
           "                       shrinks about V-fold for more activations kept and V times\n"
           "                       the messages; --grad-accum a multiple of S (default 1)\n"
           "  --pp-balance B       flops: the stages' layers balance each layer's and the head's\n"
           "                       training FLOPs (default); measured: their times, from a\n"
           "                       forward and backward of a 1- and a 2-layer model on each\n"
           "                       rank's device at start-up, averaged over the ranks (runs\n"
           "                       that cut differently agree to rounding, not bit for bit;\n"
           "                       a --resume cuts by the times its checkpoint recorded)\n"
           "  --ep P               split each layer's experts over groups of P consecutive ranks of\n"
           "                       a stage; they are data-parallel, --batch-size is per rank (default 1)\n"
           "  --zero 1             shard AdamW's state over each parameter's replicas (default 0)\n"
           "  --comm-timeout S     seconds a collective waits for a peer before the job ends with\n"
           "                       an error naming the ranks missing from it (default 300)\n"
           "  --max-time S         stop after the first step that ends S seconds or more into the\n"
           "                       run, checkpointed (exit 3; under a wall-time limit); 0 = none\n"
           "  --overlap            run the experts on their own half of the --ep group's tokens\n"
           "                       as soon as they arrive, overlapping the other half's messages\n"
           "                       (default off)\n\n"
           "  -h, --help           this text\n\n"
           "Signals: SIGUSR1 (mpirun forwards it to every rank; Slurm's --signal sends it before\n"
           "the time limit), SIGTERM, SIGINT or SIGHUP (unless ignored, as under nohup) stops a\n"
           "training run after its step in progress, which is checkpointed; the exit status is\n"
           "then 3, and --resume latest continues (under mpirun send SIGUSR1: mpirun takes SIGTERM\n"
           "and SIGINT itself and exits 1, though the ranks stop as well). A second signal ends\n"
           "the process at once. SIGPIPE is ignored: a stdout whose reader has gone fails its\n"
           "writes, and the run trains on to its end, checkpointed, then exits 1 saying so.\n\n"
           "Environment: OMP_NUM_THREADS sets the thread count when --threads is not given;\n"
           "MOE_FAULT_KILL=RANK:STEP kills that rank in STEP, before its checkpoint (a fault-\n"
           "injection test); OPENBLAS_CORETYPE chooses OpenBLAS's kernels (unset, where OpenBLAS\n"
           "takes the CPU for a Prescott, moe-train sets it by the CPU's instructions and runs\n"
           "again).\n");
}

/* ------------------------------------------------------------------ flags */

static moe_status parse_schedule(void *field, const char *value) { return moe_lr_schedule_parse(field, value); }
static moe_status parse_pipe(void *field, const char *value) { return moe_pipe_schedule_parse(field, value); }
static moe_status parse_balance(void *field, const char *value) { return moe_pp_balance_parse(field, value); }
static moe_status parse_device(void *field, const char *value) { return moe_device_parse(field, value); }
static moe_status parse_math(void *field, const char *value) { return moe_gemm_math_parse(field, value); }
static moe_status validate(const void *options) { return moe_run_options_validate(options); }

#define OPT(field) offsetof(moe_run_options, field)
static const cli_flag flags[] = {
    {"--config", CLI_STRING, OPT(config), NULL},         {"--init-from", CLI_STRING, OPT(init_from), NULL},
    {"--upcycle", CLI_SWITCH, OPT(upcycle), NULL},
    {"--data", CLI_STRING, OPT(data), NULL},             {"--val-data", CLI_STRING, OPT(val_data), NULL},
    {"--val-tokens", CLI_INT, OPT(val_tokens), NULL},
    {"--eval-mc", CLI_STRING, OPT(eval_mc), NULL},
    {"--tokenizer", CLI_STRING, OPT(tokenizer), NULL},
    {"--batch-size", CLI_INT, OPT(batch_size), NULL},    {"--seq-len", CLI_INT, OPT(seq_len), NULL},
    {"--steps", CLI_INT, OPT(steps), NULL},              {"--lr", CLI_REAL, OPT(lr), NULL},
    {"--min-lr", CLI_REAL, OPT(min_lr), NULL},           {"--warmup", CLI_INT, OPT(warmup), NULL},
    {"--lr-schedule", CLI_PARSED, OPT(lr_schedule), parse_schedule},
    {"--decay-frac", CLI_REAL, OPT(decay_frac), NULL},
    {"--weight-decay", CLI_REAL, OPT(weight_decay), NULL},
    {"--grad-clip", CLI_REAL, OPT(grad_clip), NULL},     {"--grad-accum", CLI_INT, OPT(grad_accum), NULL},
    {"--logit-z-loss", CLI_REAL, OPT(logit_z_loss), NULL},
    {"--seed", CLI_SEED, OPT(seed), NULL},               {"--threads", CLI_THREADS, OPT(threads), NULL},
    {"--out", CLI_STRING, OPT(out_dir), NULL},           {"--save-every", CLI_INT, OPT(save_every), NULL},
    {"--keep-last", CLI_INT, OPT(keep_last), NULL},
    {"--resume", CLI_STRING, OPT(resume), NULL},         {"--eval-every", CLI_INT, OPT(eval_every), NULL},
    {"--eval-batches", CLI_INT, OPT(eval_batches), NULL}, {"--eval-only", CLI_SWITCH, OPT(eval_only), NULL},
    {"--shuffle", CLI_SWITCH, OPT(shuffle), NULL},       {"--peak-gflops", CLI_REAL, OPT(peak_gflops), NULL},
    {"--pp", CLI_SMALL, OPT(pp), NULL},                  {"--pp-schedule", CLI_PARSED, OPT(pp_schedule), parse_pipe},
    {"--pp-balance", CLI_PARSED, OPT(pp_balance), parse_balance},
    {"--pp-chunks", CLI_SMALL, OPT(pp_chunks), NULL},
    {"--ep", CLI_SMALL, OPT(ep), NULL},                  {"--zero", CLI_SMALL, OPT(zero), NULL},
    {"--comm-timeout", CLI_REAL, OPT(comm_timeout), NULL}, {"--overlap", CLI_SWITCH, OPT(overlap), NULL},
    {"--max-time", CLI_REAL, OPT(max_time), NULL},
    {"--overwrite", CLI_SWITCH, OPT(overwrite), NULL},
    {"--device", CLI_PARSED, OPT(device), parse_device}, {"--gemm-math", CLI_PARSED, OPT(gemm_math), parse_math},
    {"--profile", CLI_SWITCH, OPT(profile), NULL},       {"--recompute", CLI_SWITCH, OPT(recompute), NULL},
};
#undef OPT

/* argv as one shell-quoted line, for run.json. */
static void join_command_line(char *out, size_t size, int argc, char **argv) {
    size_t n = 0;
    out[0] = '\0';
    for (int a = 0; a < argc && n + 1 < size; a++) {
        const char *s = argv[a];
        const bool plain = s[0] != '\0' && strspn(s, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                                     "0123456789-_=./,:+@%") == strlen(s);
        n += (size_t)snprintf(out + n, size - n, a ? " " : "");
        if (n + 1 >= size) break;
        if (plain) {
            n += (size_t)snprintf(out + n, size - n, "%s", s);
        } else {
            n += (size_t)snprintf(out + n, size - n, "'");
            for (; *s && n + 5 < size; s++) n += (size_t)snprintf(out + n, size - n, *s == '\'' ? "'\\''" : "%c", *s);
            if (n + 1 < size) n += (size_t)snprintf(out + n, size - n, "'");
        }
    }
}

/* --------------------------------------------------------------- printing */

typedef struct printer {
    bool tty;     /* stdout is a terminal: keep a progress bar under the lines */
    bool bar_on;  /* the bar is drawn on the current line */
    bool eval_only;
    int rank;     /* under mpirun; only rank 0 prints */
    bool pipeline; /* --pp > 1: each step says how long the stages waited */
    bool grid;     /* several ranks: each step names the slowest */
    bool routes;   /* the model has an MoE layer: each step says how it routed */
    bool quiet;
    int kill_rank, kill_step; /* MOE_FAULT_KILL=RANK:STEP, or -1 */
    bool stopped;             /* before --steps: a signal or --max-time */
    int64_t start_step;       /* the checkpoint's step when resumed, else 0 */
} printer;

/* The signal that asked the run to stop (moe_run_callbacks.stop), or 0. */
static volatile sig_atomic_t stop_signal;

static const int stop_signals[] = {SIGUSR1, SIGTERM, SIGINT, SIGHUP};

/* The first of them asks for the stop and gives those it catches back
 * their default action, so that a second one, of any of them, ends the
 * process at once (sigaction is async-signal-safe). */
static void on_stop_signal(int signo) {
    stop_signal = signo;
    struct sigaction dfl, now;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    for (size_t i = 0; i < sizeof stop_signals / sizeof *stop_signals; i++)
        if (sigaction(stop_signals[i], NULL, &now) == 0 && now.sa_handler == on_stop_signal)
            sigaction(stop_signals[i], &dfl, NULL);
}

/* SIGUSR1 (which mpirun forwards to every rank, and Slurm's --signal
 * sends before a job's time is up), SIGTERM, SIGINT and SIGHUP (the
 * terminal or session gone) stop a training run after its step in
 * progress, checkpointed. A SIGHUP ignored on entry stays so: nohup asked
 * for the run to outlive its terminal. SA_RESTART: a write to a stdout
 * pipe that is full when the signal comes goes on rather than fail (and
 * lose its line). */
static void catch_stop_signals(void) {
    struct sigaction sa, was;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_stop_signal;
    sa.sa_flags = SA_RESTART;
    sigemptyset(&sa.sa_mask);
    for (size_t i = 0; i < sizeof stop_signals / sizeof *stop_signals; i++) {
        if (stop_signals[i] == SIGHUP && sigaction(SIGHUP, NULL, &was) == 0 && was.sa_handler == SIG_IGN) continue;
        sigaction(stop_signals[i], &sa, NULL);
    }
}

static const char *signal_name(int signo) {
    return signo == SIGUSR1   ? "SIGUSR1"
           : signo == SIGTERM ? "SIGTERM"
           : signo == SIGINT  ? "SIGINT"
           : signo == SIGHUP  ? "SIGHUP"
                              : "a signal";
}

static void clear_bar(printer *p) {
    if (p->bar_on) printf("\r\033[K");
    p->bar_on = false;
}

static void format_duration(char *out, size_t size, double seconds) {
    const long s = (long)(seconds + 0.5);
    if (s >= 3600)
        snprintf(out, size, "%ldh%02ldm", s / 3600, s / 60 % 60);
    else if (s >= 60)
        snprintf(out, size, "%ldm%02lds", s / 60, s % 60);
    else
        snprintf(out, size, "%lds", s);
}

/* MOE_FAULT_KILL=RANK:STEP, whole numbers and nothing else. */
static int parse_fault(printer *p, const char *text) {
    char *end;
    errno = 0;
    if (!isdigit((unsigned char)text[0])) return 1;
    const long rank = strtol(text, &end, 10);
    if (*end != ':' || errno || rank > INT_MAX) return 1;
    const char *step_text = end + 1;
    if (!isdigit((unsigned char)step_text[0])) return 1;
    const long step = strtol(step_text, &end, 10);
    if (*end != '\0' || errno || step < 1 || step > INT_MAX) return 1;
    p->kill_rank = (int)rank;
    p->kill_step = (int)step;
    return 0;
}

/* "grid     4 ranks: PP 2 x DP 2, EP 2; 1f1b, stages hold layers 0-1 | 2; ..." */
static void print_grid(const moe_run_summary *s) {
    const moe_run_options *o = s->options;
    printf("grid     %d ranks: ", s->ranks);
    if (s->pp > 1) printf("PP %d x ", s->pp);
    printf("DP %d, EP %d", s->ranks / s->pp, s->ep);
    if (s->stage_layers) {
        if (o->pp_chunks > 1)
            printf("; interleaved %s, %d chunks, stages hold layers ", moe_pipe_schedule_name(o->pp_schedule),
                   o->pp_chunks);
        else
            printf("; %s, stages hold layers ", moe_pipe_schedule_name(o->pp_schedule));
        for (int stage = 0; stage < s->pp; stage++)
            for (int chunk = 0; chunk < o->pp_chunks; chunk++) {
                const int v = chunk * s->pp + stage;
                const long long first = (long long)s->stage_layers[v], last = (long long)s->stage_layers[v + 1] - 1;
                printf("%s%lld", chunk ? "," : stage ? " | " : "", first);
                if (last != first) printf("-%lld", last);
            }
        if (o->pp_balance == MOE_PP_BALANCE_MEASURED) {
            char layers[96];
            const int n = moe_model_config_has_moe_layer(s->config)
                              ? snprintf(layers, sizeof layers, "an MoE layer %.2f ms", 1e3 * s->stage_costs.layer)
                              : 0;
            if (s->stage_costs.dense_layers)
                snprintf(layers + n, sizeof layers - (size_t)n, "%sa dense MLP layer %.2f ms", n ? ", " : "",
                         1e3 * s->stage_costs.dense_layer);
            printf(" (measured%s: %s, the head %.2f ms)", s->stage_costs_resumed ? " by the run --resume continues" : "",
                   layers, 1e3 * s->stage_costs.head);
        }
    }
    printf("\n");
}

/* "1.25" MB, or "1.25-2.50" when the ranks differ. */
static void format_range(char *out, size_t size, int64_t least, int64_t most) {
    char a[32], b[32];
    snprintf(a, sizeof a, "%.2f", (double)least * 1e-6);
    snprintf(b, sizeof b, "%.2f", (double)most * 1e-6);
    if (strcmp(a, b) == 0)
        snprintf(out, size, "%s", b);
    else
        snprintf(out, size, "%s-%s", a, b);
}

/* "memory   AdamW state 0.80 MB, activations 3.10 MB (--recompute) per rank";
 * evaluation alone keeps no AdamW state. */
static void print_memory(const moe_run_summary *s) {
    const moe_run_options *o = s->options;
    char state[80], acts[80];
    format_range(state, sizeof state, s->optimizer_bytes_least, s->optimizer_bytes_most);
    format_range(acts, sizeof acts, s->activation_bytes_least, s->activation_bytes_most);
    if (o->eval_only)
        printf("memory   activations %s MB per rank\n", acts);
    else
        printf("memory   AdamW state %s MB%s, activations %s MB%s per rank\n", state, o->zero ? " (--zero 1)" : "",
               acts, o->recompute ? " (--recompute)" : "");
}

static void on_start(void *ctx, const moe_run_summary *s) {
    printer *p = ctx;
    const moe_model_config *c = s->config;
    const moe_run_options *o = s->options;
    p->start_step = s->start_step;
    /* The fault's step must come after a resumed run's first (main checked
     * the rest). Every rank reads the same variable, so all stop here. */
    if (p->kill_rank >= 0 && p->kill_step <= s->start_step) {
        fprintf(stderr, PROGRAM ": MOE_FAULT_KILL=%d:%d: the run resumes after step %lld\n", p->kill_rank,
                p->kill_step, (long long)s->start_step);
        exit(2);
    }
    p->rank = s->rank;
    p->grid = s->ranks > 1;
    p->routes = moe_model_config_has_moe_layer(c);
    p->quiet = s->rank != 0;
    if (p->quiet) return;
    char groups[96] = "";
    int n = 0;
    if (c->moe_n_group > 1)
        n = snprintf(groups, sizeof groups, " from %lld of %lld groups", (long long)c->moe_topk_group,
                     (long long)c->moe_n_group);
    if (c->moe_routed_scaling_factor != 1.0)
        snprintf(groups + n, sizeof groups - (size_t)n, " weighted x%g", c->moe_routed_scaling_factor);
    const int64_t dense = moe_model_config_dense_layer_count(c);
    char experts[192] = "no MoE layer";
    if (moe_model_config_has_moe_layer(c))
        snprintf(experts, sizeof experts, "%lld experts of width %lld, top-%lld%s", (long long)c->num_local_experts,
                 (long long)c->intermediate_size, (long long)c->num_experts_per_tok, groups);
    printf("model    %s: d_model %lld, %lld layers, %lld heads (%lld KV%s), %s, vocab %lld\n",
           moe_model_config_model_type(c), (long long)c->hidden_size, (long long)c->num_hidden_layers, (long long)c->num_attention_heads,
           (long long)c->num_key_value_heads, c->moe_qk_norm == MOE_QK_NORM_PER_HEAD       ? ", q and k normalised per head"
           : c->moe_qk_norm == MOE_QK_NORM_ACROSS_HEADS ? ", q and k normalised across heads"
                                                        : "",
           experts, (long long)c->vocab_size);
    if (c->rope_scaling.type != MOE_ROPE_DEFAULT) {
        char rope[256];
        moe_rope_scaling_describe(rope, sizeof rope, &c->rope_scaling);
        printf("rope     theta %g, scaled %s\n", c->rope_theta, rope);
    }
    if (dense > 0) {
        printf("dense    %lld of the layers are dense MLPs of width %lld:", (long long)dense,
               (long long)moe_model_config_dense_width(c));
        for (int64_t l = 0; l < c->num_hidden_layers; l++)
            if (moe_model_config_layer_is_dense(c, l)) printf(" %lld", (long long)l);
        printf("\n");
    }
    printf("params   %.3fM total, %.3fM active per token\n", (double)s->params * 1e-6,
           (double)s->active_params * 1e-6);
    if (s->train_data) printf("train    %s\n", s->train_data);
    printf("val      %s, %lld batches\n", s->val_data, (long long)o->eval_batches);
    if (o->tokenizer)
        printf("tokenizer %s: %lld tokens, kept with every checkpoint\n", o->tokenizer, (long long)s->tokenizer_tokens);
    if (!isnan(s->entropy_floor)) printf("floor    %.4f nats per token (the best achievable val loss)\n", s->entropy_floor);
    if (s->device_note) printf("%s\n", s->device_note);
    if (s->placement) printf("place    %s\n", s->placement);
    printf("device   %s, %s GEMMs, %d threads", s->device, moe_gemm_math_name(o->gemm_math), s->threads);
    if (strncmp(s->device, "cpu", 3) == 0) {
        char kernels[160];
        moe_blas_describe(kernels, sizeof kernels);
        printf(", %s", kernels);
    }
    if (!isnan(s->peak_gflops))
        printf(", GEMM peak %.1f GFLOP/s%s (%s)", s->peak_gflops, s->ranks > 1 ? " summed over the ranks" : "",
               s->peak_measured ? "measured" : "--peak-gflops per rank");
    printf("\n");
    if (s->ranks > 1) print_grid(s);
    print_memory(s);
    if (!p->eval_only) {
        char ranks[48] = "";
        if (s->ranks / s->pp > 1)
            snprintf(ranks, sizeof ranks, " x %d %sranks", s->ranks / s->pp, s->pp > 1 ? "data-parallel " : "");
        printf("run      steps %lld..%lld, B %lld x T %lld x accum %lld%s = %lld tokens per step, %.2f GFLOP per "
               "step, out %s\n",
               (long long)s->start_step + 1, (long long)o->steps, (long long)o->batch_size, (long long)o->seq_len,
               (long long)o->grad_accum, ranks, (long long)s->tokens_per_step, s->step_flops * 1e-9, o->out_dir);
    }
}

static void draw_bar(printer *p, const moe_run_step *s) {
    const double done = (double)s->metrics.step / (double)s->total_steps;
    const int filled = (int)(done * BAR_WIDTH);
    char bar[BAR_WIDTH + 1];
    for (int i = 0; i < BAR_WIDTH; i++) bar[i] = i < filled ? '#' : '.';
    bar[BAR_WIDTH] = '\0';
    char eta[32];
    format_duration(eta, sizeof eta,
                    s->elapsed_seconds / (double)s->steps_timed * (double)(s->total_steps - s->metrics.step));
    printf("[%s] %5.1f%%  step %lld/%lld  loss %.4f  ETA %s", bar, 100.0 * done, (long long)s->metrics.step,
           (long long)s->total_steps, s->metrics.loss, eta);
    p->bar_on = true;
}

static void on_step(void *ctx, const moe_run_step *s) {
    printer *p = ctx;
    const moe_step_metrics *m = &s->metrics;
    if (p->rank == p->kill_rank && m->step == p->kill_step) {
        /* Fault injection: this rank dies before the step is over (its
         * evaluation and checkpoint never happen), so its peers are left
         * waiting inside collectives. */
        fprintf(stderr, PROGRAM ": rank %d: MOE_FAULT_KILL: killing this rank in step %d\n", p->rank, p->kill_step);
        raise(SIGKILL);
    }
    if (p->quiet) return;
    clear_bar(p);
    printf("step %5lld/%lld | loss %.4f", (long long)m->step, (long long)s->total_steps, m->loss);
    if (p->routes) printf(" | aux %.4f", m->aux_loss);
    printf(" | lr %.2e | norm %6.3f | %7.0f tok/s | MFU %5.1f%%", m->lr, m->grad_norm, s->tokens_per_s,
           100.0 * s->mfu);
    if (p->routes) printf(" | imbalance %.2f | dropped %.1f%%", m->load_imbalance, 100.0 * m->dropped_frac);
    printf("\n");
    if (p->grid) {
        printf("         slowest rank %d, busy %.1f%% over the ranks' median", m->slowest_rank,
               100.0 * (m->busy_median_s > 0.0 ? m->busy_max_s / m->busy_median_s - 1.0 : 0.0));
        if (p->pipeline) printf("; pipeline idle %.1f%% of the schedule (stages' mean)", 100.0 * m->pipeline_idle);
        if (m->exchange_bytes > 0.0)
            printf("; expert rows %.2f MB sent a rank, the busiest rank's experts keep %.2fx the mean",
                   m->exchange_bytes * 1e-6, m->rank_imbalance);
        printf("\n");
    }
    if (p->tty) draw_bar(p, s);
    fflush(stdout);
}

static void on_eval(void *ctx, const moe_run_eval *e) {
    printer *p = ctx;
    if (p->quiet) return;
    clear_bar(p);
    char mc[96] = "";
    if (e->mc_examples)
        snprintf(mc, sizeof mc, "mc %lld/%lld = %.4f", (long long)e->mc_correct, (long long)e->mc_examples,
                 (double)e->mc_correct / (double)e->mc_examples);
    /* The result line comes last, from on_end. */
    if (p->eval_only) {
        if (mc[0]) printf("%s\n", mc);
        return;
    }
    if (isnan(e->entropy_floor))
        printf("eval step %lld | val_loss %.4f%s%s\n", (long long)e->step, e->val_loss, mc[0] ? " | " : "", mc);
    else
        printf("eval step %lld | val_loss %.4f | floor %.4f | ratio %.3f%s%s\n", (long long)e->step, e->val_loss,
               e->entropy_floor, e->val_loss / e->entropy_floor, mc[0] ? " | " : "", mc);
}

static void on_checkpoint(void *ctx, int64_t step, const char *path) {
    printer *p = ctx;
    if (p->quiet) return;
    clear_bar(p);
    printf("saved step %lld to %s\n", (long long)step, path);
}

static void on_warning(void *ctx, const char *message) {
    printer *p = ctx;
    if (p->quiet) return;
    clear_bar(p);
    cli_warning(message);
}

/* A shade for a routing share relative to the uniform one (1/E). */
static const char *shade(double share, int64_t n_experts) {
    const double rel = share * (double)n_experts;
    return rel < 0.5 ? " " : rel < 1.0 ? "\u2591" : rel < 2.0 ? "\u2592" : rel < 3.0 ? "\u2593" : "\u2588";
}

static void print_routing(const moe_run_kind_report *r, int64_t layer, const char *title) {
    printf("\n%s: share of each kind's (token, slot) assignments per expert\n%-11s", title, "kind");
    for (int64_t e = 0; e < r->n_experts; e++) {
        char name[24];
        snprintf(name, sizeof name, "e%lld", (long long)e);
        printf(" %6s", name);
    }
    printf("\n");
    for (int kind = 0; kind < MOE_SYNTH_KIND_COUNT; kind++) {
        printf("%-11s", moe_synth_kind_name(kind));
        for (int64_t e = 0; e < r->n_experts; e++) {
            const double share = moe_run_routing_at(r, layer, kind, e);
            printf(" %s%s%3.0f%%", shade(share, r->n_experts), shade(share, r->n_experts), 100.0 * share);
        }
        printf("\n");
    }
}

static void print_kinds(const moe_run_kind_report *r) {
    printf("\nper kind (validation):\n%-11s %8s %8s %8s %10s\n", "kind", "tokens", "loss", "floor", "loss/floor");
    for (int kind = 0; kind < MOE_SYNTH_KIND_COUNT; kind++)
        printf("%-11s %8lld %8.4f %8.4f %10.3f\n", moe_synth_kind_name(kind), (long long)r->tokens[kind],
               r->loss[kind], r->floor[kind], r->floor[kind] > 0.0 ? r->loss[kind] / r->floor[kind] : NAN);
    const moe_synth_task_score *t = &r->tasks;
    if (!r->tasks_measured) {
        printf("\ngreedy answers: not measured (generation needs one process and dropless routing)\n");
    } else if (t->tried[MOE_SYNTH_TASK_SUM] + t->tried[MOE_SYNTH_TASK_COPY] == 0) {
        printf("\ngreedy answers: no sum or copy fits a row of the validation stream (--seq-len)\n");
    } else {
        printf("\ngreedy answers (validation): ");
        const char *what[MOE_SYNTH_TASK_COUNT] = {"sums", "copies"};
        for (int k = 0; k < MOE_SYNTH_TASK_COUNT; k++)
            printf("%s%s %lld/%lld right (%.1f%%)", k ? ", " : "", what[k], (long long)t->solved[k],
                   (long long)t->tried[k], t->tried[k] ? 100.0 * (double)t->solved[k] / (double)t->tried[k] : 0.0);
        printf("\n");
    }
    if (r->last_moe_layer < 0) {
        printf("\nrouting: none (every layer is a dense MLP)\n");
        return;
    }
    char title[64];
    snprintf(title, sizeof title, "routing, layer %lld (the last%s)", (long long)r->last_moe_layer,
             r->last_moe_layer < r->n_layers - 1 ? " MoE layer" : "");
    print_routing(r, r->last_moe_layer, title);
    print_routing(r, r->n_layers, "routing, all layers");
    printf("(shade: share against the uniform 1/E: ' ' < 0.5x, \u2591 < 1x, \u2592 < 2x, \u2593 < 3x, \u2588 >= 3x)\n");
}

/* Where the profiled steps' time went, op by op. */
static void print_profile(const moe_run_end *e) {
    if (e->profile_steps == 0) {
        printf("\nprofile: no step after the first to time\n");
        return;
    }
    double busy = 0.0;
    for (int64_t i = 0; i < e->profile_ops; i++) busy += e->profile[i].seconds;
    printf("\nprofile of %lld steps (%.3f s): ops %.3f s, %.1f%% of the wall time\n", (long long)e->profile_steps,
           e->profile_seconds, busy, 100.0 * busy / e->profile_seconds);
    printf("  %-22s %10s %12s %12s %7s\n", "op", "calls", "seconds", "us per call", "share");
    for (int64_t i = 0; i < e->profile_ops; i++) {
        const moe_op_time *t = &e->profile[i];
        printf("  %-22s %10lld %12.4f %12.1f %6.1f%%\n", t->op, (long long)t->calls, t->seconds,
               1e6 * t->seconds / (double)t->calls, busy > 0.0 ? 100.0 * t->seconds / busy : 0.0);
    }
}

static void on_end(void *ctx, const moe_run_end *e) {
    printer *p = ctx;
    p->stopped = e->stopped_by != NULL;
    if (p->quiet) return;
    clear_bar(p);
    if (e->kinds) print_kinds(e->kinds);
    if (!p->eval_only) {
        char took[32];
        format_duration(took, sizeof took, e->seconds);
        /* A resumed run took only the steps after its checkpoint's. */
        if (p->start_step > 0)
            printf("\nsteps %lld..%lld (%lld) in %s", (long long)p->start_step + 1, (long long)e->steps_done,
                   (long long)(e->steps_done - p->start_step), took);
        else
            printf("\n%lld steps in %s", (long long)e->steps_done, took);
        if (e->last_checkpoint[0]) printf(", last checkpoint %s", e->last_checkpoint);
        printf("\n");
    }
    if (p->grid && e->straggler_steps) {
        char ties[64] = "";
        if (e->straggler_ties)
            snprintf(ties, sizeof ties, " (and %d other rank%s as often)", e->straggler_ties,
                     e->straggler_ties > 1 ? "s" : "");
        printf("stragglers: rank %d was the slowest in %lld of the %lld steps run%s; the slowest rank was busy "
               "%.1f%% over the ranks' median on average\n",
               e->straggler_rank, (long long)e->straggler_count, (long long)e->straggler_steps, ties,
               100.0 * e->straggler_excess);
    }
    if (e->profile) print_profile(e);
    if (e->stopped_by) {
        /* The rank that saw no signal stops for the one that did. */
        printf("stopped after step %lld by %s: the same command with --resume latest continues the run\n",
               (long long)e->steps_done, strcmp(e->stopped_by, "--max-time") == 0 ? "--max-time"
                                         : stop_signal                        ? signal_name(stop_signal)
                                                                              : "another rank's signal");
        return;
    }
    if (!isnan(e->entropy_floor))
        printf("val_loss %.4f vs floor %.4f: %.1f%% above the floor\n", e->val_loss, e->entropy_floor,
               100.0 * (e->val_loss / e->entropy_floor - 1.0));
    printf("val_loss %.9g\n", e->val_loss);
}

/* This process's rank as mpirun's environment gives it when the job has
 * more than one rank, else NULL (one process, perhaps an MPI singleton,
 * which sets PMIx variables only). Known before the run says it. */
static int launcher_size(void) {
    const char *size = getenv("OMPI_COMM_WORLD_SIZE") ? getenv("OMPI_COMM_WORLD_SIZE") : getenv("PMI_SIZE");
    return size ? atoi(size) : 0;
}

static const char *launcher_rank(void) {
    const char *rank = getenv("OMPI_COMM_WORLD_RANK") ? getenv("OMPI_COMM_WORLD_RANK") : getenv("PMI_RANK");
    return rank && launcher_size() > 1 ? rank : NULL;
}

int main(int argc, char **argv) {
    moe_blas_refit(argv);
    moe_run_options o;
    moe_run_options_init(&o);
    const int rc = cli_start(PROGRAM, &o, flags, sizeof flags / sizeof *flags, argc, argv, print_help, validate);
    if (rc >= 0) return rc;
    static char command_line[COMMAND_LINE_BYTES];
    join_command_line(command_line, sizeof command_line, argc, argv);
    o.command_line = command_line;

    /* Only rank 0 prints, also the warnings that come before on_start. */
    const char *rank = launcher_rank();
    /* A launcher gives each rank a terminal of its own that may end in a
     * log, which a progress bar would fill with redraws. */
    printer p = {.tty = isatty(STDOUT_FILENO) && !rank, .eval_only = o.eval_only, .rank = rank ? atoi(rank) : 0,
                 .pipeline = o.pp > 1, .quiet = rank && atoi(rank) != 0, .kill_rank = -1, .kill_step = -1};
    const char *fault = getenv("MOE_FAULT_KILL");
    if (fault && parse_fault(&p, fault) != 0)
        return cli_usage_error("MOE_FAULT_KILL=%s: expected RANK:STEP, RANK >= 0 and STEP >= 1", fault);
    /* A fault that cannot happen would let a fault-injection test pass
     * without one: refused before anything is written (a resume's first
     * step, known only from its checkpoint, is checked at the start). */
    if (fault) {
        const int ranks = launcher_rank() ? launcher_size() : 1;
        if (o.eval_only) return cli_usage_error("MOE_FAULT_KILL=%s: --eval-only takes no steps to kill", fault);
        if (p.kill_rank >= ranks)
            return cli_usage_error("MOE_FAULT_KILL=%s: no rank %d among %d", fault, p.kill_rank, ranks);
        if (p.kill_step > o.steps)
            return cli_usage_error("MOE_FAULT_KILL=%s: no step %d in --steps %lld", fault, p.kill_step,
                                   (long long)o.steps);
    }
    const moe_run_callbacks cb = {
        .ctx = &p,
        .on_start = on_start,
        .on_step = on_step,
        .on_eval = on_eval,
        .on_checkpoint = on_checkpoint,
        .on_end = on_end,
        .on_warning = on_warning,
        .stop = &stop_signal,
    };
    if (!o.eval_only) catch_stop_signals(); /* an evaluation has no step to stop after */
    moe_status st = moe_run(&o, &cb);
    if (st != MOE_OK) {
        clear_bar(&p);
        const int rc = cli_run_failed(st, rank);
        /* Whatever failed, the other ranks may be waiting for this one in a
         * collective, or be stuck themselves; a launcher that keeps the job
         * alive after one process exits non-zero would leave them there. */
        if (rank) moe_comm_mpi_abort_job(rc);
        return rc;
    }
    const int written = cli_stdout_written();
    return written ? written : p.stopped ? 3 : 0;
}
