/* test_moe_ep.c: the MoE layer with expert parallelism over all ranks (run
 * under mpirun -np 2 and -np 4; with 4 ranks also as 2 EP groups of 2, each
 * expert held twice) against the same layer on one rank fed the whole global
 * batch, with the experts waiting for every source's rows and with their
 * own half of the ranks' rows taken as soon as they arrive (overlap). Every rank builds the
 * one-rank reference itself, so no result crosses the network except through
 * the code under test (and the final agreement on pass/fail). Ranks hold different token counts (7 + 3r),
 * and the cases cover every gate kind, dropless and capacity, skewed routing,
 * routing where whole ranks receive no rows, and shared experts.
 * Tolerance: |ep - ref| <= 1e-5 * max|ref| + 1e-5 * |ref| per tensor (the
 * issue's 1e-5 relative, scaled by the tensor's size so that entries near 0
 * are judged against their neighbours). A plain program, not Criterion:
 * Criterion forks, which MPI does not survive. Ends with "N passed, M failed". */
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "engine/moe_layer.h"
#include "moe.h"
#include "mpi_check.h"

#define SEED 0x65707061ull
#define D 16
#define FF 8
#define E 8

/* The EP group of the running pass (world, or consecutive pairs of ranks) and
 * the ranks holding the same experts (one per EP group). */
static moe_comm *ep_group, *replicas;
static bool overlap; /* experts run as their rows arrive */
static int failures; /* in the running case, on this rank */

typedef struct ep_case {
    const char *name;
    moe_gate_kind gate;
    int renormalize;
    double capacity_factor;
    int64_t n_shared;
    float skew; /* added to gate.weight row 0: pulls tokens to expert 0 */
    int64_t top_k;
    double jitter; /* router jitter noise, in training mode */
    int64_t seq_len; /* > 0: the sequence-wise balancing loss, each rank 2 + rank sequences this long */
} ep_case;

static void fail(const char *what, int64_t i, double got, double want) {
    if (failures++ < 4) printf("  rank %d: %s[%lld] = %.9g, want %.9g\n", rank, what, (long long)i, got, want);
}

static void compare(const char *what, const float *got, const float *want, int64_t n) {
    double scale = 0.0;
    for (int64_t i = 0; i < n; i++) scale = fmax(scale, fabs(want[i]));
    for (int64_t i = 0; i < n; i++) {
        double tol = 1e-5 * scale + 1e-5 * fabs(want[i]);
        if (!(fabs((double)got[i] - want[i]) <= tol)) fail(what, i, got[i], want[i]);
    }
}

static int check(moe_status st, const char *what) {
    if (st == MOE_OK) return 1;
    if (failures++ < 4) printf("  rank %d: %s: %s: %s\n", rank, what, moe_status_string(st), moe_last_error());
    return 0;
}

/* Over the cases: (token, remote rank) pairs and (token, remote expert)
 * pairs, summed over the EP group. The first fewer than the second means
 * some token had two experts on one rank, which the exchange sends once:
 * the byte checks below then tell it from a row per expert. */
static double merged_tokens, remote_pairs;

/* The bytes the EP layer sent to other ranks in one forward and backward,
 * summed over the EP group, of a dropless case (every pair kept): per
 * (token, remote rank holding any of its experts) 16d + 12k (the row, k
 * weights and k slot codes out and the weighted sum back; the gradient row
 * out, the input gradient and k weight gradients back), overlap or not. */
static void check_bytes(moe_layer *ep, int64_t T, int64_t k) {
    const int32_t *topk;
    if (!check(moe_layer_last_topk(ep, &topk), "last topk")) return;
    const int P = moe_comm_size(ep_group), me = moe_comm_rank(ep_group), per_rank = E / P;
    double counts[3] = {0.0, 0.0, 0.0}; /* remote (token, rank), remote (token, expert), bytes sent */
    for (int64_t t = 0; t < T; t++) {
        unsigned seen = 0;
        for (int64_t i = 0; i < k; i++) {
            const int r = topk[t * k + i] / per_rank;
            if (r == me) continue;
            counts[1] += 1.0;
            if (!(seen & 1u << r)) counts[0] += 1.0;
            seen |= 1u << r;
        }
    }
    moe_layer_timing timing;
    moe_layer_get_timing(ep, &timing);
    counts[2] = (double)timing.exchange_bytes;
    if (!check(moe_comm_allreduce_sum(ep_group, counts, 3, MOE_COMM_F64), "byte counts")) return;
    const double want = counts[0] * (16.0 * D + 12.0 * (double)k);
    if (counts[2] != want) fail("exchange_bytes (a row per rank)", 0, counts[2], want);
    merged_tokens += counts[0];
    remote_pairs += counts[1];
}

static void skew_router(moe_layer *layer, float skew) {
    moe_tensor_view gate;
    moe_layer_tensor_by_name(layer, "gate.weight", &gate);
    for (int64_t j = 0; j < D; j++) gate.param[j] += skew;
}

static void run_case(const ep_case *c) {
    failures = 0;
    moe_layer_config cfg = MOE_LAYER_CONFIG_INIT;
    cfg.d_model = D;
    cfg.d_ff = FF;
    cfg.n_experts = E;
    cfg.top_k = c->top_k;
    cfg.gate = c->gate;
    cfg.renormalize = c->renormalize;
    cfg.capacity_factor = c->capacity_factor;
    cfg.aux_loss_coef = 0.1;
    cfg.z_loss_coef = 0.01;
    cfg.n_shared_experts = c->n_shared;
    cfg.jitter_eps = c->jitter;
    cfg.seq_aux_loss_coef = c->seq_len ? 0.3 : 0.0;
    cfg.seq_len = c->seq_len;
    cfg.seed = SEED;

    int64_t first = 0, global_T = 0;
    for (int r = 0; r < size; r++) {
        if (r == rank) first = global_T;
        global_T += c->seq_len ? c->seq_len * (2 + r) : 7 + 3 * r;
    }
    const int64_t T = c->seq_len ? c->seq_len * (2 + rank) : 7 + 3 * rank;
    float *x = malloc(sizeof(float) * (size_t)(global_T * D));
    float *dy = malloc(sizeof(float) * (size_t)(global_T * D));
    float *y_ref = malloc(sizeof(float) * (size_t)(global_T * D));
    float *dx_ref = malloc(sizeof(float) * (size_t)(global_T * D));
    float *y = malloc(sizeof(float) * (size_t)(T * D));
    float *dx = malloc(sizeof(float) * (size_t)(T * D));
    /* Inputs with a positive mean, so the skew of row 0 pulls hard. */
    for (int64_t i = 0; i < global_T * D; i++) {
        x[i] = 0.3f + moe_rng_normal(SEED, 1, (uint64_t)i);
        dy[i] = moe_rng_normal(SEED, 2, (uint64_t)i);
    }

    moe_layer *ref = NULL, *ep = NULL;
    int64_t n = moe_layer_config_param_count(&cfg, moe_comm_size(ep_group));
    float *params = calloc((size_t)n, sizeof(float)), *grads = calloc((size_t)n, sizeof(float));
    moe_layer_stats ref_stats = {0}, ep_stats = {0};
    int64_t ref_tpe[E], ep_tpe[E];
    ref_stats.tokens_per_expert = ref_tpe;
    ep_stats.tokens_per_expert = ep_tpe;
    if (check(moe_layer_create(&ref, &cfg), "reference create") &&
        check(moe_layer_create_in(&ep, &cfg,
                                  &(moe_layer_memory){.router = params, .router_grad = grads,
                                                      .experts = params + E * D, .experts_grad = grads + E * D,
                                                      .shared = params + n - 3 * c->n_shared * FF * D,
                                                      .shared_grad = grads + n - 3 * c->n_shared * FF * D},
                                  ep_group, world),
                              "ep create")) {
        /* Larger weights than the default init, so gradients are not tiny. */
        check(moe_layer_init_params(ref, 0.3f, SEED, 0), "reference init");
        check(moe_layer_init_params(ep, 0.3f, SEED, 0), "ep init");
        skew_router(ref, c->skew);
        skew_router(ep, c->skew);
        moe_layer_set_overlap(ep, overlap);
        if (check(moe_layer_forward(ref, y_ref, x, global_T, &ref_stats), "reference forward") &&
            check(moe_layer_backward(ref, dx_ref, dy, x), "reference backward") &&
            check(moe_layer_forward(ep, y, x + first * D, T, &ep_stats), "ep forward") &&
            check(moe_layer_backward(ep, dx, dy + first * D, x + first * D), "ep backward")) {
            compare("y", y, y_ref + first * D, T * D);
            compare("dx", dx, dx_ref + first * D, T * D);
            if (ep_stats.dropped != ref_stats.dropped) fail("dropped", 0, (double)ep_stats.dropped, (double)ref_stats.dropped);
            for (int e = 0; e < E; e++)
                if (ep_tpe[e] != ref_tpe[e]) fail("tokens_per_expert", e, (double)ep_tpe[e], (double)ref_tpe[e]);
            const float got_stats[4] = {(float)ep_stats.aux_loss, (float)ep_stats.z_loss, (float)ep_stats.load_imbalance,
                                        (float)ep_stats.seq_aux_loss};
            const float want_stats[4] = {(float)ref_stats.aux_loss, (float)ref_stats.z_loss,
                                         (float)ref_stats.load_imbalance, (float)ref_stats.seq_aux_loss};
            compare("stats(aux, z, imbalance, seq aux)", got_stats, want_stats, 4);
            if (c->seq_len && !(ref_stats.seq_aux_loss > 0.0)) fail("seq aux loss taken", 0, ref_stats.seq_aux_loss, 1.0);
            /* With the EP group over every rank, its ranks keep the rows
             * of their experts over the whole batch; one rank keeps all. */
            const int P = moe_comm_size(ep_group);
            if (P == size) {
                double rows[E] = {0}, total = 0.0, busiest = 0.0;
                for (int e = 0; e < E; e++) rows[e / (E / P)] += (double)ref_tpe[e], total += (double)ref_tpe[e];
                for (int r = 0; r < P; r++) busiest = rows[r] > busiest ? rows[r] : busiest;
                const double want = busiest / (total / P);
                if (ep_stats.rank_imbalance != want) fail("rank_imbalance", 0, ep_stats.rank_imbalance, want);
            }
            if (c->capacity_factor == 0.0) check_bytes(ep, T, c->top_k);
            if (ref_stats.rank_imbalance != 1.0) fail("one rank's rank_imbalance", 0, ref_stats.rank_imbalance, 1.0);
            /* The ranks' shares add up to the gradient: over all ranks for
             * the router and shared experts, over the replicas for experts. */
            for (int64_t i = 0; i < moe_layer_tensor_count(ep); i++) {
                moe_tensor_view v, r;
                moe_layer_tensor(ep, i, &v);
                moe_layer_tensor_by_name(ref, v.name, &r);
                int64_t count = v.rows * v.cols;
                moe_comm *sum_over = strncmp(v.name, "experts.", 8) == 0 ? replicas : world;
                check(moe_comm_allreduce_sum(sum_over, v.grad, count, MOE_COMM_F32), "grad all-reduce");
                compare(v.name, v.grad, r.grad, count);
            }
        }
    }
    if (c->capacity_factor > 0.0 && ref_stats.dropped == 0) fail("capacity case drops nothing", 0, 0, 1);
    moe_layer_destroy(ref);
    moe_layer_destroy(ep);
    free(params);
    free(grads);
    free(x);
    free(dy);
    free(y_ref);
    free(dx_ref);
    free(y);
    free(dx);
}

/* moe.h's moe_layer_create_mpi on MPI_COMM_WORLD: the same layer through
 * the public API, its initial parameters drawn by the layer itself. */
static void public_layer_case(bool rank1_idle) {
    failures = 0;
    moe_layer_config cfg = MOE_LAYER_CONFIG_INIT;
    cfg.d_model = D, cfg.d_ff = FF, cfg.n_experts = E, cfg.top_k = 2, cfg.capacity_factor = 1.0;
    cfg.aux_loss_coef = 0.1, cfg.seed = SEED;
    if (rank1_idle) { /* every path a rank with no tokens still walks */
        cfg.n_shared_experts = 1, cfg.jitter_eps = 0.1, cfg.z_loss_coef = 0.01;
    }
    int64_t first = 0, global_T = 0;
    for (int r = 0; r < size; r++) {
        if (r == rank) first = global_T;
        global_T += rank1_idle && r == 1 ? 0 : 5 + 4 * r;
    }
    const int64_t T = rank1_idle && rank == 1 ? 0 : 5 + 4 * rank;
    float *x = malloc(sizeof(float) * (size_t)(global_T * D)), *dy = malloc(sizeof(float) * (size_t)(global_T * D));
    float *y_ref = malloc(sizeof(float) * (size_t)(global_T * D)), *dx_ref = malloc(sizeof(float) * (size_t)(global_T * D));
    float *y = malloc(sizeof(float) * (size_t)(T * D)), *dx = malloc(sizeof(float) * (size_t)(T * D));
    for (int64_t i = 0; i < global_T * D; i++) {
        x[i] = moe_rng_normal(SEED, 3, (uint64_t)i);
        dy[i] = moe_rng_normal(SEED, 4, (uint64_t)i);
    }
    moe_layer *ref = NULL, *pub = NULL;
    MPI_Comm comm = MPI_COMM_WORLD;
    moe_layer_stats idle_ref = {.aux_loss = 1.0}, idle_pub = {.aux_loss = 1.0};
    if (check(moe_layer_create(&ref, &cfg), "reference create") &&
        check(moe_layer_create_mpi(&pub, &cfg, &comm), "moe_layer_create_mpi") &&
        /* A batch where every rank is idle first: it moves the jitter
         * stream alike on one rank and on several, and its stats are zeros. */
        (!rank1_idle || (check(moe_layer_forward(ref, NULL, NULL, 0, &idle_ref), "reference idle forward") &&
                         check(moe_layer_backward(ref, NULL, NULL, NULL), "reference idle backward") &&
                         check(moe_layer_forward(pub, NULL, NULL, 0, &idle_pub), "public idle forward") &&
                         check(moe_layer_backward(pub, NULL, NULL, NULL), "public idle backward"))) &&
        check(moe_layer_forward(ref, y_ref, x, global_T, NULL), "reference forward") &&
        check(moe_layer_backward(ref, dx_ref, dy, x), "reference backward") &&
        check(moe_layer_forward(pub, T ? y : NULL, T ? x + first * D : NULL, T, NULL), "public forward") &&
        check(moe_layer_backward(pub, T ? dx : NULL, T ? dy + first * D : NULL, T ? x + first * D : NULL),
              "public backward")) {
        compare("y", y, y_ref + first * D, T * D);
        compare("dx", dx, dx_ref + first * D, T * D);
        if (rank1_idle && !(idle_pub.aux_loss == 0.0 && idle_pub.z_loss == 0.0 && idle_pub.load_imbalance == 0.0 &&
                            idle_ref.aux_loss == 0.0 && idle_pub.pairs == 0))
            fail("stats of an idle batch (aux + z)", 0, idle_pub.aux_loss + idle_pub.z_loss, 0.0);
        const int64_t local = E / size;
        const int64_t want_tensors = 1 + 3 * local + (cfg.n_shared_experts ? 3 : 0);
        if (moe_layer_tensor_count(pub) != want_tensors)
            fail("tensor count", 0, (double)moe_layer_tensor_count(pub), (double)want_tensors);
        for (int64_t i = 0; i < moe_layer_tensor_count(pub); i++) {
            moe_tensor_view v, r;
            moe_layer_tensor(pub, i, &v);
            if (moe_layer_tensor_by_name(ref, v.name, &r) != MOE_OK) {
                fail(v.name, i, 0, 1);
                continue;
            }
            const int64_t count = v.rows * v.cols;
            compare(v.name, v.param, r.param, count); /* the draws of one rank's layer */
            /* The router's and shared experts' gradients are this rank's share. */
            if (strncmp(v.name, "experts.", 8) != 0)
                check(moe_comm_allreduce_sum(world, v.grad, count, MOE_COMM_F32), "grad all-reduce");
            compare(v.name, v.grad, r.grad, count);
        }
    }
    moe_layer_destroy(ref);
    moe_layer_destroy(pub);
    free(x), free(dy), free(y_ref), free(dx_ref), free(y), free(dx);
}

/* A forward whose arguments the last rank refuses (x NULL) fails on every
 * rank at once, the others naming it, in the collective they wait in first
 * (the token counts under jitter, else the router totals), instead of after
 * the 300 s timeout; the layer then runs the next forward as if it had not
 * happened: the same y as a layer that never saw it. */
static int refused_forward_case(double jitter) {
    moe_layer_config cfg = MOE_LAYER_CONFIG_INIT;
    cfg.d_model = D, cfg.d_ff = FF, cfg.n_experts = E, cfg.top_k = 2, cfg.seed = SEED, cfg.jitter_eps = jitter;
    enum { T = 6 };
    float x[T * D], y[T * D], y_fresh[T * D];
    for (int64_t i = 0; i < T * D; i++) x[i] = moe_rng_normal(SEED, 5 + (uint64_t)rank, (uint64_t)i);
    MPI_Comm comm = MPI_COMM_WORLD;
    moe_layer *layer = NULL, *fresh = NULL;
    if (moe_layer_create_mpi(&layer, &cfg, &comm) != MOE_OK || moe_layer_create_mpi(&fresh, &cfg, &comm) != MOE_OK) {
        printf("  rank %d: create: %s\n", rank, moe_last_error());
        return 1;
    }
    const bool refuses = rank == size - 1;
    const double t0 = MPI_Wtime();
    const moe_status st = moe_layer_forward(layer, y, refuses ? NULL : x, T, NULL);
    const double seconds = MPI_Wtime() - t0;
    char want[64];
    snprintf(want, sizeof want, refuses ? "x is NULL" : "rank %d of the layer's ranks failed its forward", size - 1);
    int bad = 0;
    if (st != (refuses ? MOE_ERR_INVALID_ARG : MOE_ERR_COMM) || !strstr(moe_last_error(), want) || seconds > 30.0) {
        printf("  rank %d: %s after %.1f s: %s (want \"%s\")\n", rank, moe_status_string(st), seconds, moe_last_error(),
               want);
        bad = 1;
    }
    if (moe_layer_forward(layer, y, x, T, NULL) != MOE_OK || moe_layer_forward(fresh, y_fresh, x, T, NULL) != MOE_OK) {
        printf("  rank %d: the next forward: %s\n", rank, moe_last_error());
        bad = 1;
    } else if (memcmp(y, y_fresh, sizeof y) != 0) {
        printf("  rank %d: the next forward's y differs from a fresh layer's\n", rank);
        bad = 1;
    }
    moe_layer_destroy(layer);
    moe_layer_destroy(fresh);
    return bad;
}

/* The same for a failure after the routing totals: after a forward of a
 * few tokens (which sizes OpenBLAS's buffers), the last rank's address
 * space is capped a little above what it uses, and rank 0 brings so many
 * tokens that the expert rows every rank sizes by the global batch do not
 * fit there; its peers hear of it in the exchange's send counts. */
static int refused_rows_case(void) {
    if (!mpi_can_cap_memory()) return 0;
    moe_layer_config cfg = MOE_LAYER_CONFIG_INIT;
    cfg.d_model = D, cfg.d_ff = FF, cfg.n_experts = E, cfg.top_k = 2, cfg.seed = SEED;
    const int64_t T = rank == 0 ? 1000000 : 6;
    float *x = calloc((size_t)(T * D), sizeof *x), *y = malloc((size_t)(T * D) * sizeof *y);
    MPI_Comm comm = MPI_COMM_WORLD;
    moe_layer *layer = NULL;
    if (!x || !y || moe_layer_create_mpi(&layer, &cfg, &comm) != MOE_OK ||
        moe_layer_forward(layer, y, x, 6, NULL) != MOE_OK) {
        printf("  rank %d: create and a first forward: %s\n", rank, moe_last_error());
        return 1;
    }
    const bool refuses = rank == size - 1;
    struct rlimit was;
    getrlimit(RLIMIT_AS, &was);
    long pages = 0;
    FILE *statm = fopen("/proc/self/statm", "r");
    if (!statm || fscanf(statm, "%ld", &pages) != 1) pages = 0;
    if (statm) fclose(statm);
    const struct rlimit capped = {(rlim_t)pages * (rlim_t)sysconf(_SC_PAGESIZE) + ((rlim_t)64 << 20), was.rlim_max};
    if (refuses && pages > 0) setrlimit(RLIMIT_AS, &capped);
    const double t0 = MPI_Wtime();
    const moe_status st = moe_layer_forward(layer, y, x, T, NULL);
    const double seconds = MPI_Wtime() - t0;
    if (refuses) setrlimit(RLIMIT_AS, &was);
    char want[64];
    snprintf(want, sizeof want, refuses ? "expert-row" : "rank %d of the layer's ranks failed its forward", size - 1);
    int bad = 0;
    if (pages == 0) {
        printf("  rank %d: /proc/self/statm unread: case skipped\n", rank);
    } else if (st != (refuses ? MOE_ERR_OUT_OF_MEMORY : MOE_ERR_COMM) || !strstr(moe_last_error(), want) ||
               seconds > 30.0) {
        printf("  rank %d: %s after %.1f s: %s (want \"%s\")\n", rank, moe_status_string(st), seconds, moe_last_error(),
               want);
        bad = 1;
    }
    moe_layer_destroy(layer);
    free(x);
    free(y);
    return bad;
}

int main(void) {
    if (!mpi_check_init()) return 1;
    mpi_report(refused_rows_case(), "a forward short of memory for its expert rows fails every rank at once");
    mpi_report(refused_forward_case(0.0), "a forward refused on one rank fails every rank at once, naming it");
    mpi_report(refused_forward_case(0.1), "the same under jitter (refused in the token counts)");
    public_layer_case(false);
    mpi_report(failures, "moe_layer_create_mpi on MPI_COMM_WORLD (%d ranks)", size);
    public_layer_case(true);
    mpi_report(failures, "moe_layer_create_mpi with no tokens on rank 1 (%d ranks)", size);
    {
        moe_layer_config cfg = MOE_LAYER_CONFIG_INIT;
        cfg.d_model = D, cfg.d_ff = FF, cfg.n_experts = E, cfg.top_k = 2;
        /* Ranks of other configs would exchange rows of other shapes. */
        MPI_Comm all = MPI_COMM_WORLD;
        moe_layer_config other = cfg;
        if (rank == size - 1) other.top_k = 1;
        moe_layer *mixed = NULL;
        moe_status mst = moe_layer_create_mpi(&mixed, &other, &all);
        char want[64];
        snprintf(want, sizeof want, "rank %d disagrees with rank 0 on top_k", size - 1);
        mpi_report(mst != MOE_ERR_CONFIG || mixed != NULL || !strstr(moe_last_error(), want),
                   "moe_layer_create_mpi refuses ranks of other configs on every rank");
        /* A config invalid on one rank fails every rank at once, naming
         * it, instead of leaving the others waiting for it. */
        moe_layer_config invalid = cfg;
        if (rank == size - 1) invalid.top_k = 99;
        mst = moe_layer_create_mpi(&mixed, &invalid, &all);
        snprintf(want, sizeof want, rank == size - 1 ? "top_k=99" : "rank %d's config is invalid", size - 1);
        mpi_report(mst != MOE_ERR_CONFIG || mixed != NULL || !strstr(moe_last_error(), want),
                   "moe_layer_create_mpi fails every rank when one rank's config is invalid (%s)", moe_last_error());
        /* Settings that mean the same are no disagreement: 0 or 1 groups,
         * renormalize under the sigmoid gate, routed_scale 0 or 1. */
        moe_layer_config same = cfg;
        same.gate = MOE_GATE_SIGMOID;
        if (rank == size - 1) same.n_groups = same.top_groups = 1, same.renormalize = 0, same.routed_scale = 0.0;
        mst = moe_layer_create_mpi(&mixed, &same, &all);
        mpi_report(mst != MOE_OK, "moe_layer_create_mpi takes equivalent configs (%s)", moe_last_error());
        moe_layer_destroy(mixed);
        MPI_Comm none = MPI_COMM_NULL;
        moe_layer *l = NULL;
        const moe_status st = moe_layer_create_mpi(&l, &cfg, &none);
        mpi_report(st != MOE_ERR_INVALID_ARG || l != NULL || !strstr(moe_last_error(), "MPI_COMM_NULL"),
                   "moe_layer_create_mpi refuses MPI_COMM_NULL (%s)", moe_last_error());
    }
    const ep_case cases[] = {
        {"softmax_topk dropless", MOE_GATE_SOFTMAX_TOPK, 1, 0.0, 0, 0.0f, 2, 0.0, 0},
        {"softmax_topk no renormalize", MOE_GATE_SOFTMAX_TOPK, 0, 0.0, 0, 0.0f, 2, 0.0, 0},
        {"topk_softmax dropless", MOE_GATE_TOPK_SOFTMAX, 1, 0.0, 0, 0.0f, 2, 0.0, 0},
        {"sigmoid dropless", MOE_GATE_SIGMOID, 1, 0.0, 0, 0.0f, 2, 0.0, 0},
        {"softmax_topk capacity 1.0", MOE_GATE_SOFTMAX_TOPK, 1, 1.0, 0, 0.0f, 2, 0.0, 0},
        {"sigmoid capacity 1.25 skewed", MOE_GATE_SIGMOID, 1, 1.25, 0, 0.4f, 2, 0.0, 0},
        {"skewed dropless", MOE_GATE_SOFTMAX_TOPK, 1, 0.0, 0, 0.4f, 2, 0.0, 0},
        {"all tokens to expert 0, k=1 (ranks receive nothing)", MOE_GATE_SOFTMAX_TOPK, 1, 0.0, 0, 30.0f, 1, 0.0, 0},
        {"capacity with everything on expert 0", MOE_GATE_TOPK_SOFTMAX, 1, 2.0, 0, 30.0f, 1, 0.0, 0},
        {"shared experts, k=E", MOE_GATE_SOFTMAX_TOPK, 1, 0.0, 1, 0.0f, E, 0.0, 0},
        {"jitter 0.3, capacity 1.0", MOE_GATE_SOFTMAX_TOPK, 1, 1.0, 0, 0.0f, 2, 0.3, 0},
        {"sequence-wise balancing, sequences of 5", MOE_GATE_SIGMOID, 1, 0.0, 0, 0.2f, 2, 0.0, 5},
        {"sequence-wise balancing with capacity and shared experts", MOE_GATE_SOFTMAX_TOPK, 1, 1.0, 1, 0.0f, 2, 0.0, 3},
    };
    /* EP over all ranks; from 4 ranks on also EP = size/2 with 2 replicas. */
    const int ep_sizes[2] = {size, size / 2};
    const int passes = size >= 4 && size % 2 == 0 ? 2 : 1;
    for (int pass = 0; pass < passes; pass++) {
        const int P = ep_sizes[pass];
        if (moe_comm_split(&ep_group, world, rank / P, rank) != MOE_OK ||
            moe_comm_split(&replicas, world, rank % P, rank) != MOE_OK) {
            fprintf(stderr, "split: %s\n", moe_last_error());
            return 1;
        }
        for (int o = 0; o < 2; o++)
            for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
                overlap = o;
                run_case(&cases[i]);
                mpi_report(failures, "%s (%d ranks, EP=%d%s)", cases[i].name, size, P, o ? ", overlap" : "");
            }
        moe_comm_free(ep_group);
        moe_comm_free(replicas);
    }
    mpi_report(!(merged_tokens < remote_pairs),
               "some token has two experts on one rank (%g remote tokens per rank, %g remote pairs)", merged_tokens,
               remote_pairs);
    return mpi_check_finish();
}
