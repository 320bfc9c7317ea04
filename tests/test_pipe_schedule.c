/* test_pipe_schedule.c: every stage's schedule (moe_pipe_schedule_ops),
 * played out on a model of the ranks that run it as the trainer does (an
 * op first receives what it needs, blocking; a send never blocks, as
 * MPI's buffered ones do (NCCL's may, and the trainer refuses interleaving
 * there); a
 * forward costs 1 / chunks and a backward 2 / chunks, a stage's share of a
 * micro-batch), runs each (chunk, micro-batch) forward and backward once,
 * never deadlocks, delivers each neighbour its messages in the order it
 * receives them whatever their kind (NCCL matches sends to receives in
 * order, without tags), keeps each chunk's forwards and backwards in
 * micro-batch order (the trainer's instances rely on it), and leaves the
 * bubble of the theory: (stages - 1) / (chunks M + stages - 1) of the
 * time. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine/trainer.h"

#define MAX_STAGES 8
#define MAX_OPS 512

typedef struct message {
    moe_pipe_op op; /* the op it comes from */
    double at;      /* when it was sent */
} message;

typedef struct world {
    int stages, chunks;
    int64_t M;
    moe_pipe_op ops[MAX_STAGES][MAX_OPS];
    int64_t n_ops, done[MAX_STAGES];
    double clock[MAX_STAGES];
    message queue[MAX_STAGES][MAX_STAGES][MAX_OPS]; /* [from][to], in the order sent */
    int64_t sent[MAX_STAGES][MAX_STAGES], taken[MAX_STAGES][MAX_STAGES];
} world;

/* Virtual stage v = chunk * stages + stage; the model's first takes the
 * tokens, its last the targets. */
static int virtual_stage(const world *w, int stage, const moe_pipe_op *op) { return op->chunk * w->stages + stage; }

/* Runs stage s's next op if what it receives has come; false when it waits. */
static bool step(world *w, int s) {
    const moe_pipe_op *op = &w->ops[s][w->done[s]];
    const int v = virtual_stage(w, s, op), last = w->stages * w->chunks - 1;
    const int prev = (s + w->stages - 1) % w->stages, next = (s + 1) % w->stages;
    double start = w->clock[s];
    if (op->backward ? v < last : v > 0) {
        const int from = op->backward ? next : prev;
        if (w->taken[from][s] == w->sent[from][s]) return false;
        const message *m = &w->queue[from][s][w->taken[from][s]++];
        /* What it receives is what this op needs: the same micro-batch,
         * the same direction, from the virtual stage next to it. */
        cr_assert(m->op.backward == op->backward && m->op.micro == op->micro &&
                      virtual_stage(w, from, &m->op) == (op->backward ? v + 1 : v - 1),
                  "stages %d, chunks %d, M %lld: stage %d's op %lld (%s of micro-batch %lld, chunk %d) received "
                  "the %s of micro-batch %lld, chunk %d",
                  w->stages, w->chunks, (long long)w->M, s, (long long)w->done[s], op->backward ? "backward" : "forward",
                  (long long)op->micro, op->chunk, m->op.backward ? "backward" : "forward", (long long)m->op.micro,
                  m->op.chunk);
        if (m->at > start) start = m->at;
    }
    w->clock[s] = start + (op->backward ? 2.0 : 1.0) / w->chunks;
    if (op->backward ? v > 0 : v < last) {
        const int to = op->backward ? prev : next;
        w->queue[s][to][w->sent[s][to]++] = (message){*op, w->clock[s]};
    }
    w->done[s]++;
    return true;
}

static void play(int stages, int chunks, int64_t M) {
    world *w = calloc(1, sizeof *w);
    cr_assert_not_null(w);
    *w = (world){.stages = stages, .chunks = chunks, .M = M, .n_ops = 2 * chunks * M};
    cr_assert_leq(w->n_ops, MAX_OPS);
    for (int s = 0; s < stages; s++) {
        cr_assert_eq(moe_pipe_schedule_ops(w->ops[s], MOE_PIPE_1F1B, s, stages, chunks, M), MOE_OK, "%s",
                     moe_last_error());
        /* Each (chunk, micro-batch) forward and backward once, each chunk's
         * of either kind in micro-batch order. */
        int64_t next[2][64] = {{0}};
        for (int64_t i = 0; i < w->n_ops; i++) {
            const moe_pipe_op *op = &w->ops[s][i];
            cr_assert(op->chunk >= 0 && op->chunk < chunks);
            cr_assert_eq(op->micro, next[op->backward][op->chunk]++, "stage %d op %lld: micro-batch %lld out of order",
                         s, (long long)i, (long long)op->micro);
            if (op->backward) cr_assert_lt(op->micro, next[0][op->chunk], "a backward before its forward");
        }
        for (int c = 0; c < chunks; c++) cr_assert(next[0][c] == M && next[1][c] == M);
    }
    for (bool moved = true; moved;) {
        moved = false;
        for (int s = 0; s < stages; s++)
            while (w->done[s] < w->n_ops && step(w, s)) moved = true;
    }
    double span = 0.0;
    for (int s = 0; s < stages; s++) {
        cr_assert_eq(w->done[s], w->n_ops, "stages %d, chunks %d, M %lld: deadlock, stage %d stuck at op %lld", stages,
                     chunks, (long long)M, s, (long long)w->done[s]);
        if (w->clock[s] > span) span = w->clock[s];
    }
    /* Each stage works 3 M; the rest of the span is the bubble. */
    const double idle = 1.0 - 3.0 * (double)M / span;
    const double theory = (double)(stages - 1) / ((double)chunks * (double)M + stages - 1);
    cr_assert(fabs(idle - theory) < 1e-9, "stages %d, chunks %d, M %lld: bubble %.6f, theory %.6f", stages, chunks,
              (long long)M, idle, theory);
    free(w);
}

Test(pipe_schedule, plain_1f1b) {
    for (int stages = 1; stages <= MAX_STAGES; stages++)
        for (int64_t M = 1; M <= 3 * stages; M++) play(stages, 1, M);
}

Test(pipe_schedule, interleaved) {
    for (int stages = 2; stages <= MAX_STAGES; stages++)
        for (int chunks = 2; chunks <= 4; chunks++)
            for (int64_t M = stages; 2 * chunks * M <= MAX_OPS && M <= 4 * stages; M += stages) play(stages, chunks, M);
}

Test(pipe_schedule, refusals) {
    moe_pipe_op ops[64];
    cr_assert_eq(moe_pipe_schedule_ops(ops, MOE_PIPE_1F1B, 0, 4, 2, 6), MOE_ERR_CONFIG);
    cr_assert(strstr(moe_last_error(), "--grad-accum 6") && strstr(moe_last_error(), "--pp 4"), "%s", moe_last_error());
    cr_assert_eq(moe_pipe_schedule_ops(ops, MOE_PIPE_GPIPE, 0, 2, 2, 2), MOE_ERR_CONFIG);
    cr_assert(strstr(moe_last_error(), "gpipe"), "%s", moe_last_error());
}
