/* test_partition.c: moe_grid_partition splits the layers into contiguous
 * stages of at least one layer whose slowest stage is as fast as any split
 * can make it, checked against every split of small models (the cost model
 * rebuilt here from its definition: a layer's training FLOPs per token, an
 * MoE layer's or a dense MLP layer's, the head's on the last stage), and
 * under costs measured rather than counted. */
#include <criterion/criterion.h>
#include <math.h>
#include <string.h>

#include "engine/grid.h"
#include "engine/model_config.h"

/* Layer l's: a dense one's MLP is three hidden x width matrices. */
static double layer_cost(const moe_model_config *c, int64_t T, int64_t l) {
    const double C = (double)c->hidden_size, hd = (double)c->head_dim;
    const double q = (double)c->num_attention_heads * hd, kv = (double)c->num_key_value_heads * hd;
    const double attn_proj = C * (q + kv + kv) + q * C;
    const double router = C * (double)c->num_local_experts;
    const double ffn = (double)(c->num_experts_per_tok + c->moe_n_shared_experts) * 3.0 * C * (double)c->intermediate_size;
    const double width = (double)(c->moe_dense_intermediate_size ? c->moe_dense_intermediate_size : c->intermediate_size);
    if (c->moe_dense_layers[l / 64] >> (l % 64) & 1) return 6.0 * (attn_proj + 3.0 * C * width) + 6.0 * (double)T * q;
    return 6.0 * (attn_proj + router + ffn) + 6.0 * (double)T * q;
}

/* The slowest stage of the split bounds [stages + 1]. */
static double slowest(const int64_t *bounds, int stages, const moe_model_config *c, int64_t T) {
    double worst = 0.0;
    for (int s = 0; s < stages; s++) {
        double cost = 0.0;
        for (int64_t l = bounds[s]; l < bounds[s + 1]; l++) cost += layer_cost(c, T, l);
        if (s == stages - 1) cost += 6.0 * (double)c->hidden_size * (double)c->vocab_size;
        if (cost > worst) worst = cost;
    }
    return worst;
}

/* The best slowest stage over every split of L layers into `stages`, by
 * enumerating the cut positions. */
static double best_split(int64_t *bounds, int s, int stages, int64_t L, const moe_model_config *c, int64_t T) {
    if (s == stages) return bounds[stages] == L ? slowest(bounds, stages, c, T) : INFINITY;
    double best = INFINITY;
    const int64_t lo = bounds[s] + 1, hi = s == stages - 1 ? L : L - (stages - 1 - s);
    for (int64_t end = lo; end <= hi; end++) {
        bounds[s + 1] = end;
        const double v = best_split(bounds, s + 1, stages, L, c, T);
        if (v < best) best = v;
    }
    return best;
}

static void config(moe_model_config *c, int64_t layers, int64_t vocab) {
    moe_model_config_default_small(c, vocab);
    c->num_hidden_layers = layers;
}

static void check(const moe_model_config *c, int64_t T, int stages) {
    const int64_t L = c->num_hidden_layers;
    int64_t bounds[16], scratch[16] = {0};
    cr_assert(moe_grid_partition(bounds, c->num_hidden_layers, stages, moe_grid_flop_costs(c, T)) == MOE_OK, "%s", moe_last_error());
    cr_assert(bounds[0] == 0 && bounds[stages] == L, "L=%lld, %d stages: bounds from %lld to %lld", (long long)L,
              stages, (long long)bounds[0], (long long)bounds[stages]);
    for (int s = 0; s < stages; s++)
        cr_assert(bounds[s + 1] > bounds[s], "L=%lld, %d stages: stage %d holds [%lld, %lld)", (long long)L, stages, s,
                  (long long)bounds[s], (long long)bounds[s + 1]);
    const double got = slowest(bounds, stages, c, T), want = best_split(scratch, 0, stages, L, c, T);
    cr_expect(got <= want * (1.0 + 1e-12), "L=%lld V=%lld, %d stages: slowest stage %.6g, the best split's %.6g",
              (long long)L, (long long)c->vocab_size, stages, got, want);
}

Test(partition, the_slowest_stage_is_as_fast_as_any_split_makes_it) {
    static const int64_t vocabs[3] = {256, 32000, 262144};
    for (int v = 0; v < 3; v++)
        for (int64_t L = 1; L <= 9; L++)
            for (int stages = 1; stages <= L && stages <= 5; stages++) {
                moe_model_config c;
                config(&c, L, vocabs[v]);
                check(&c, 64, stages);
            }
}

/* Dense MLP layers among the MoE layers, cheaper or dearer than those
 * (widths 32 and 2048 against the experts' 2 x 256): every mixture of 2
 * to 8 layers, at least one an MoE layer, into 2 to 5 stages. */
Test(partition, dense_layers_weigh_their_own_cost) {
    static const int64_t widths[2] = {32, 2048};
    for (int w = 0; w < 2; w++)
        for (int64_t L = 2; L <= 8; L++)
            for (uint64_t dense = 1; dense < (UINT64_C(1) << L) - 1; dense++)
                for (int stages = 2; stages <= L && stages <= 5; stages++) {
                    moe_model_config c;
                    config(&c, L, 32000);
                    c.moe_dense_layers[0] = dense;
                    c.moe_dense_intermediate_size = widths[w];
                    check(&c, 64, stages);
                }
}

/* A head that costs more than a layer leaves the last stage fewer layers. */
Test(partition, a_heavy_head_shortens_the_last_stage) {
    moe_model_config c;
    config(&c, 8, 262144);
    int64_t bounds[3];
    cr_assert(moe_grid_partition(bounds, c.num_hidden_layers, 2, moe_grid_flop_costs(&c, 64)) == MOE_OK, "%s", moe_last_error());
    cr_expect(bounds[2] - bounds[1] < bounds[1] - bounds[0], "8 layers, vocabulary 262144: stages [0, %lld), [%lld, 8)",
              (long long)bounds[1], (long long)bounds[1]);
    config(&c, 8, 16);
    cr_assert(moe_grid_partition(bounds, c.num_hidden_layers, 2, moe_grid_flop_costs(&c, 64)) == MOE_OK, "%s", moe_last_error());
    cr_expect(bounds[1] == 4, "8 layers, a head that costs little: stages [0, %lld), [%lld, 8), want 4 each",
              (long long)bounds[1], (long long)bounds[1]);
}

/* Costs given, as a measurement gives them: a head of three layers' cost
 * takes the last stage's layers away, a free one balances the layers. */
Test(partition, measured_costs_move_the_cuts) {
    int64_t bounds[3];
    cr_assert(moe_grid_partition(bounds, 8, 2, (moe_stage_costs){.layer = 1.0, .head = 3.0}) == MOE_OK, "%s",
              moe_last_error());
    cr_expect(bounds[1] == 6, "8 layers, a head of 3 layers: stages [0, %lld), [%lld, 8), want 6 and 2",
              (long long)bounds[1], (long long)bounds[1]);
    cr_assert(moe_grid_partition(bounds, 8, 2, (moe_stage_costs){.layer = 1.0, .head = 0.0}) == MOE_OK, "%s",
              moe_last_error());
    cr_expect(bounds[1] == 4, "8 layers, a free head: stages [0, %lld), [%lld, 8), want 4 each", (long long)bounds[1],
              (long long)bounds[1]);
    /* Of equal splits, the one whose last stage holds fewest layers: a head
     * of 5 layers makes 0-6 | 7 (bottleneck 7) and 0-5 | 6-7 (7) tie. */
    cr_assert(moe_grid_partition(bounds, 8, 2, (moe_stage_costs){.layer = 3.0, .head = 15.0}) == MOE_OK, "%s",
              moe_last_error());
    cr_expect(bounds[1] == 7, "8 layers, a head of 5: stages [0, %lld), want [0, 7) of the tied splits",
              (long long)bounds[1]);
    /* Only the ratio counts: costs near double's range cut as small ones. */
    cr_assert(moe_grid_partition(bounds, 8, 2, (moe_stage_costs){.layer = 4e307, .head = 1e308}) == MOE_OK, "%s",
              moe_last_error());
    cr_expect(bounds[1] == 5, "8 layers of 4e307, a head of 2.5 of them: stages [0, %lld), want 5",
              (long long)bounds[1]);
    /* Four dense layers of a quarter first: 0-5 | 6-7 and 0-4 | 5-7 both
     * cost 3 at most, and the last stage takes the fewer layers. */
    const uint64_t first_four = 0xF;
    cr_assert(moe_grid_partition(bounds, 8, 2,
                                 (moe_stage_costs){.layer = 1.0, .dense_layer = 0.25, .dense_layers = &first_four}) ==
                  MOE_OK,
              "%s", moe_last_error());
    cr_expect(bounds[1] == 6, "8 layers, the first 4 a quarter of the others: stages [0, %lld), want [0, 6)",
              (long long)bounds[1]);
    /* Of 3 stages over 1 1 1 1 1 4 with a head of 1: the slowest is the
     * last (4 + 1), the first two balance 5 layers as 3 | 2. */
    const uint64_t dear_last = 0x20;
    int64_t three[4];
    cr_assert(moe_grid_partition(three, 6, 3,
                                 (moe_stage_costs){.layer = 1.0, .dense_layer = 4.0, .head = 1.0,
                                                   .dense_layers = &dear_last}) == MOE_OK,
              "%s", moe_last_error());
    cr_expect(three[1] == 3 && three[2] == 5, "stages [0, %lld), [%lld, %lld), want [0, 3), [3, 5), [5, 6)",
              (long long)three[1], (long long)three[1], (long long)three[2]);
}

/* Costs of any mantissa (measured seconds) tie as whole layers do: of the
 * splits whose slowest stage is 8 layers, the last stage takes one, the
 * stages before it 9 each but the last of them. */
Test(partition, ties_of_measured_costs_go_as_the_layer_counts_say) {
    int64_t bounds[9];
    cr_assert(moe_grid_partition(bounds, 62, 8,
                                 (moe_stage_costs){.layer = 0.90730383220286892, .head = 4.5211126454711916}) == MOE_OK,
              "%s", moe_last_error());
    const int64_t want[9] = {0, 9, 18, 27, 36, 45, 54, 61, 62};
    for (int s = 0; s <= 8; s++)
        cr_expect_eq(bounds[s], want[s], "62 layers, 8 stages: bound %d is %lld, want %lld", s, (long long)bounds[s],
                     (long long)want[s]);
    /* A layer a stage is the one split; costs that are no costs are refused. */
    cr_assert(moe_grid_partition(bounds, 8, 8, (moe_stage_costs){.layer = 1.0, .head = 1.0}) == MOE_OK);
    for (int s = 0; s <= 8; s++) cr_expect_eq(bounds[s], s);
    cr_expect(moe_grid_partition(bounds, 8, 3, (moe_stage_costs){.layer = NAN, .head = 1.0}) == MOE_ERR_INVALID_ARG);
    cr_expect(strstr(moe_last_error(), "must be finite and not negative"), "%s", moe_last_error());
    cr_expect(moe_grid_partition(bounds, 8, 3, (moe_stage_costs){.layer = 1.0, .head = -1.0}) == MOE_ERR_INVALID_ARG);
}

Test(partition, fewer_layers_than_stages_is_refused) {
    moe_model_config c;
    config(&c, 3, 256);
    int64_t bounds[5];
    cr_expect(moe_grid_partition(bounds, c.num_hidden_layers, 4, moe_grid_flop_costs(&c, 64)) == MOE_ERR_CONFIG);
    cr_expect(strstr(moe_last_error(), "--pp 4") && strstr(moe_last_error(), "3 layers"), "%s", moe_last_error());
    cr_expect(moe_grid_partition(bounds, c.num_hidden_layers, 0, moe_grid_flop_costs(&c, 64)) == MOE_ERR_CONFIG);
}
