/* test_pipe_schedule.c: every stage's schedule (moe_pipe_schedule_ops)
 * and exchange plan (moe_pipe_plan_create), played out on a model of the
 * ranks that run them as the trainer does over NCCL: a host that posts
 * each op's block of messages once the op before is done, waits for the
 * op's input, and runs it; a pipeline stream of its own that runs the
 * blocks in order, each through once every one of its messages has met
 * its peer's post in a block of the peer's under way; a pair's messages
 * meeting in the order posted, whatever their kind (no tags); the launch
 * of a group holding a pair's first message in a direction waiting for
 * the peer to reach the group with the other end (NCCL connects the pair
 * there), unless the stages were connected first, as the trainer does.
 * (MPI, whose messages progress each on its own, is freer than that.) A
 * forward costs 1 / chunks and a backward 2 / chunks, a stage's share of
 * a micro-batch; messages take no time. The plan must run each (chunk,
 * micro-batch) forward and backward once, each chunk's in micro-batch
 * order (GPipe's backwards in reverse: the trainer's instances rely on
 * it), pair every post with the message it is for, never deadlock, post
 * for a buffer again only after its last reader (a GPipe forward's input
 * is read again by its backward's replay), and leave the bubble of the
 * theory: (stages - 1) / (chunks M + stages - 1) of the time. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine/trainer.h"

#define MAX_STAGES 8
#define MAX_POSTS 1024
#define MAX_OPS 512

/* A rank under way. Its host runs the ops in order: before op i it posts
 * the plan's block of messages for i on the pipeline's stream (once op i
 * - 1, whose output it may send, is done), waits for op i's input, and
 * runs it. The pipeline's stream runs the blocks in order; a block starts
 * once posted and the one before it is through, and is through once each
 * of its messages has met its peer's post, in a block of the peer's that
 * has started. Times: -1 while unknown. */
typedef struct rank {
    moe_pipe_plan *plan;
    int64_t op;                     /* the host's next op */
    double clock;                   /* when the host is free */
    double posted[MAX_OPS + 1];     /* when the host reached block i */
    double launched[MAX_OPS + 1];   /* when block i was launched: posted, its pairs connected */
    double start[MAX_OPS + 1], done[MAX_OPS + 1];
    int64_t peer_index[MAX_POSTS];  /* post p is the k-th message of its (sender, receiver) pair */
    int64_t partner[MAX_POSTS];     /* the peer's post it meets */
} rank;

typedef struct world {
    moe_pipe_schedule kind;
    bool forward_only;
    bool connected; /* every pair of neighbour stages is, both ways, before the plan runs */
    int stages, chunks;
    int64_t M;
    rank r[MAX_STAGES];
} world;

static int peer_of(const world *w, int s, const moe_pipe_post *p, const moe_pipe_op *op) {
    const bool toward_next = p->send != op->backward; /* a forward's send, a backward's receive */
    return (s + (toward_next ? 1 : w->stages - 1)) % w->stages;
}

/* The post of stage `peer` that meets stage s's post p, or -1. */
static int64_t find_partner(const world *w, int s, int64_t p) {
    const rank *a = &w->r[s];
    const moe_pipe_post *post = &a->plan->posts[p];
    const int peer = peer_of(w, s, post, &a->plan->ops[post->op]);
    const rank *b = &w->r[peer];
    for (int64_t q = 0; q < b->plan->n_posts; q++) {
        const moe_pipe_post *other = &b->plan->posts[q];
        if (other->send != post->send && peer_of(w, peer, other, &b->plan->ops[other->op]) == s &&
            b->peer_index[q] == a->peer_index[p])
            return q;
    }
    return -1;
}

/* Works out what stage s's stream and host can; false when nothing. */
static bool step(world *w, int s) {
    rank *a = &w->r[s];
    const moe_pipe_plan *plan = a->plan;
    bool moved = false;
    /* The stream: each block's start and end, in order. */
    double before = 0.0;
    for (int64_t p = 0; p < plan->n_posts;) {
        const int64_t i = plan->posts[p].before;
        int64_t end = p;
        while (end < plan->n_posts && plan->posts[end].before == i) end++;
        if (a->launched[i] < 0 || before < 0) break;
        if (a->start[i] < 0) a->start[i] = a->launched[i] > before ? a->launched[i] : before, moved = true;
        if (a->done[i] < 0) {
            double through = a->start[i];
            for (int64_t q = p; q < end && through >= 0; q++) {
                const int peer = peer_of(w, s, &plan->posts[q], &plan->ops[plan->posts[q].op]);
                const rank *b = &w->r[peer];
                const double met = b->start[b->plan->posts[a->partner[q]].before];
                through = met < 0 ? -1 : met > through ? met : through;
            }
            if (through >= 0) a->done[i] = through, moved = true;
        }
        before = a->done[i];
        p = end;
    }
    /* The host. */
    while (a->op <= plan->n_ops) {
        const int64_t i = a->op;
        if (a->posted[i] < 0) a->posted[i] = a->clock, moved = true;
        if (a->launched[i] < 0) {
            /* NCCL connects a pair for a direction at its first message
             * there, inside the launch, which waits for the peer to reach
             * the group with the other end. */
            double at = a->posted[i];
            for (int64_t p = 0; p < plan->n_posts && at >= 0; p++) {
                if (plan->posts[p].before != i || a->peer_index[p] != 0 || w->connected) continue;
                const int peer = peer_of(w, s, &plan->posts[p], &plan->ops[plan->posts[p].op]);
                const rank *b = &w->r[peer];
                const double there = b->posted[b->plan->posts[a->partner[p]].before];
                at = there < 0 ? -1 : there > at ? there : at;
            }
            if (at < 0) break;
            a->launched[i] = at;
            if (at > a->clock) a->clock = at;
            moved = true;
        }
        if (i == plan->n_ops) {
            a->op++;
            break;
        }
        const int64_t in = plan->input[i];
        double ready = a->clock;
        if (in >= 0) {
            const double got = a->done[plan->posts[in].before];
            if (got < 0) break;
            if (got > ready) ready = got;
        }
        a->clock = ready + (plan->ops[i].backward ? 2.0 : 1.0) / w->chunks;
        a->op++;
        moved = true;
    }
    return moved;
}

/* Each receive's buffer is posted for again only after the last op that
 * reads it (a GPipe forward's input: its backward, which replays it). */
static void check_slots(const world *w, int s) {
    const moe_pipe_plan *plan = w->r[s].plan;
    const bool keeps = w->kind == MOE_PIPE_GPIPE && !w->forward_only;
    for (int64_t p = 0; p < plan->n_posts; p++) {
        const moe_pipe_post *post = &plan->posts[p];
        if (post->send) continue;
        const moe_pipe_op *op = &plan->ops[post->op];
        cr_assert(post->slot >= 0 && post->slot < plan->slots[op->backward]);
        int64_t last_read = post->op;
        if (keeps && !op->backward)
            for (int64_t i = post->op; i < plan->n_ops; i++)
                if (plan->ops[i].backward && plan->ops[i].chunk == op->chunk && plan->ops[i].micro == op->micro)
                    last_read = i;
        for (int64_t q = p + 1; q < plan->n_posts; q++) {
            const moe_pipe_post *next = &plan->posts[q];
            if (next->send || next->slot != post->slot || plan->ops[next->op].backward != op->backward) continue;
            cr_assert_gt(next->before, last_read,
                         "stages %d, chunks %d, M %lld: stage %d's buffer %lld is posted for again before op %lld "
                         "reads it",
                         w->stages, w->chunks, (long long)w->M, s, (long long)post->slot, (long long)last_read);
            break;
        }
    }
}

/* Plays the plans out; false on a deadlock. connected: as the trainer
 * leaves the stages before its first step. */
static bool play(moe_pipe_schedule kind, bool forward_only, int stages, int chunks, int64_t M, bool connected) {
    world *w = calloc(1, sizeof *w);
    cr_assert_not_null(w);
    *w = (world){.kind = kind, .forward_only = forward_only, .connected = connected, .stages = stages,
                 .chunks = chunks, .M = M};
    for (int s = 0; s < stages; s++) {
        rank *a = &w->r[s];
        cr_assert_eq(moe_pipe_plan_create(&a->plan, kind, forward_only, s, stages, chunks, M), MOE_OK, "%s",
                     moe_last_error());
        const moe_pipe_plan *plan = a->plan;
        cr_assert_eq(plan->n_ops, (forward_only ? 1 : 2) * chunks * M);
        cr_assert_leq(plan->n_posts, MAX_POSTS);
        cr_assert_leq(plan->n_ops, MAX_OPS);
        /* Each (chunk, micro-batch) forward and backward once, each chunk's
         * of either kind in micro-batch order. */
        int64_t next[2][64] = {{0}};
        for (int64_t i = 0; i < plan->n_ops; i++) {
            const moe_pipe_op *op = &plan->ops[i];
            cr_assert(op->chunk >= 0 && op->chunk < chunks);
            const int64_t want = next[op->backward][op->chunk]++;
            cr_assert_eq(op->micro, op->backward && kind == MOE_PIPE_GPIPE ? M - 1 - want : want,
                         "stage %d op %lld: micro-batch %lld out of order", s, (long long)i, (long long)op->micro);
            if (op->backward) cr_assert_lt(op->micro, next[0][op->chunk], "a backward before its forward");
        }
        for (int c = 0; c < chunks; c++) cr_assert(next[0][c] == M && next[1][c] == (forward_only ? 0 : M));
        /* Posts in order of their ops, each receive before its reader. */
        int64_t count[2][MAX_STAGES] = {{0}};
        for (int64_t p = 0; p < plan->n_posts; p++) {
            const moe_pipe_post *post = &plan->posts[p];
            if (p) cr_assert_geq(post->before, plan->posts[p - 1].before);
            cr_assert(post->send ? post->before > post->op : post->before <= post->op);
            cr_assert(post->send || plan->input[post->op] == p);
            a->peer_index[p] = count[post->send][peer_of(w, s, post, &plan->ops[post->op])]++;
        }
        for (int64_t i = 0; i <= plan->n_ops; i++) a->posted[i] = a->launched[i] = a->start[i] = a->done[i] = -1.0;
    }
    for (int s = 0; s < stages; s++) {
        rank *a = &w->r[s];
        for (int64_t p = 0; p < a->plan->n_posts; p++) {
            const int64_t q = a->partner[p] = find_partner(w, s, p);
            const moe_pipe_post *post = &a->plan->posts[p];
            const int peer = peer_of(w, s, post, &a->plan->ops[post->op]);
            cr_assert_geq(q, 0, "stages %d, chunks %d, M %lld: stage %d's post %lld meets nothing on stage %d",
                          stages, chunks, (long long)M, s, (long long)p, peer);
            /* It meets the message it is for: the same micro-batch,
             * direction and sending virtual stage. */
            const rank *b = &w->r[peer];
            const moe_pipe_post *other = &b->plan->posts[q];
            const moe_pipe_op *mine = &a->plan->ops[post->op], *theirs = &b->plan->ops[other->op];
            cr_assert(mine->backward == theirs->backward && mine->micro == theirs->micro && post->from == other->from,
                      "stages %d, chunks %d, M %lld: stage %d's %s for the %s of micro-batch %lld from virtual stage %d "
                      "meets stage %d's for the %s of micro-batch %lld from %d",
                      stages, chunks, (long long)M, s, post->send ? "send" : "receive",
                      mine->backward ? "backward" : "forward", (long long)mine->micro, post->from, peer,
                      theirs->backward ? "backward" : "forward", (long long)theirs->micro, other->from);
        }
        check_slots(w, s);
    }
    for (bool moved = true; moved;) {
        moved = false;
        for (int s = 0; s < stages; s++)
            while (step(w, s)) moved = true;
    }
    double span = 0.0;
    bool finished = true;
    for (int s = 0; s < stages; s++) {
        const rank *a = &w->r[s];
        finished &= a->op > a->plan->n_ops;
        for (int64_t p = 0; p < a->plan->n_posts; p++) {
            const double through = a->done[a->plan->posts[p].before];
            finished &= through >= 0.0;
            if (through > span) span = through;
        }
        if (a->clock > span) span = a->clock;
    }
    if (finished && !forward_only) {
        /* Each stage works 3 M; the rest of the span is the bubble. */
        const double idle = 1.0 - 3.0 * (double)M / span;
        const double theory = (double)(stages - 1) / ((double)chunks * (double)M + stages - 1);
        cr_assert(fabs(idle - theory) < 1e-9, "stages %d, chunks %d, M %lld: bubble %.6f, theory %.6f", stages,
                  chunks, (long long)M, idle, theory);
    }
    for (int s = 0; s < stages; s++) moe_pipe_plan_destroy(w->r[s].plan);
    free(w);
    return finished;
}

static void expect_runs(moe_pipe_schedule kind, bool forward_only, int stages, int chunks, int64_t M) {
    cr_assert(play(kind, forward_only, stages, chunks, M, true), "%s%s, stages %d, chunks %d, M %lld: deadlock",
              kind == MOE_PIPE_GPIPE ? "gpipe" : "1f1b", forward_only ? " forwards" : "", stages, chunks,
              (long long)M);
}

Test(pipe_schedule, plain_1f1b) {
    for (int stages = 1; stages <= MAX_STAGES; stages++)
        for (int64_t M = 1; M <= 3 * stages; M++) expect_runs(MOE_PIPE_1F1B, false, stages, 1, M);
}

Test(pipe_schedule, gpipe) {
    for (int stages = 1; stages <= MAX_STAGES; stages++)
        for (int64_t M = 1; M <= 3 * stages; M++) expect_runs(MOE_PIPE_GPIPE, false, stages, 1, M);
}

Test(pipe_schedule, interleaved) {
    for (int stages = 2; stages <= MAX_STAGES; stages++)
        for (int chunks = 2; chunks <= 4; chunks++)
            for (int64_t M = stages; 2 * chunks * M <= MAX_OPS && M <= 4 * stages; M += stages)
                expect_runs(MOE_PIPE_1F1B, false, stages, chunks, M);
}

/* An evaluation's forwards, one micro-batch at a time. */
Test(pipe_schedule, forward_only) {
    for (int stages = 1; stages <= MAX_STAGES; stages++)
        for (int chunks = 1; chunks <= (stages > 1 ? 4 : 1); chunks++)
            for (int64_t M = 1; M <= 3; M++) {
                expect_runs(MOE_PIPE_1F1B, true, stages, chunks, M);
                expect_runs(MOE_PIPE_GPIPE, true, stages, chunks, M);
            }
}

/* Why the trainer connects the stages before its first step: left to
 * connect at their first messages, GPipe on 2 stages and 1F1B on 3 wait
 * on each other for ever (a group holding a pair's first message beside
 * one its peer needs before it reaches the other end). */
Test(pipe_schedule, stages_connect_first) {
    cr_expect(!play(MOE_PIPE_GPIPE, false, 2, 1, 2, false), "gpipe, 2 stages, M 2, unconnected: no deadlock");
    cr_expect(!play(MOE_PIPE_1F1B, false, 3, 1, 4, false), "1f1b, 3 stages, M 4, unconnected: no deadlock");
    cr_expect(play(MOE_PIPE_GPIPE, false, 2, 1, 2, true) && play(MOE_PIPE_1F1B, false, 3, 1, 4, true));
}

Test(pipe_schedule, refusals) {
    moe_pipe_op ops[64];
    cr_assert_eq(moe_pipe_schedule_ops(ops, MOE_PIPE_1F1B, 0, 4, 2, 6), MOE_ERR_CONFIG);
    cr_assert(strstr(moe_last_error(), "--grad-accum 6") && strstr(moe_last_error(), "--pp 4"), "%s", moe_last_error());
    cr_assert_eq(moe_pipe_schedule_ops(ops, MOE_PIPE_GPIPE, 0, 2, 2, 2), MOE_ERR_CONFIG);
    cr_assert(strstr(moe_last_error(), "gpipe"), "%s", moe_last_error());
}
