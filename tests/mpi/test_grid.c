/* test_grid.c: the rank grid and the start-up agreement check (run under
 * mpirun -np 2 and -np 4). A plain program (Criterion forks, which MPI does
 * not survive); ends with "N passed, M failed". */
#include <string.h>

#include "engine/grid.h"
#include "mpi_check.h"

int main(void) {
    if (!mpi_check_init()) return 1;

    moe_model_config cfg;
    moe_model_config_default_small(&cfg, 64);
    moe_agree_field fields[MOE_CONFIG_AGREE_FIELDS];
    int n = moe_config_agree_fields(fields, &cfg);
    mpi_report(moe_grid_agree(world, fields, n) != MOE_OK, "identical configs agree");

    /* The last rank trains with two more experts: every rank must refuse,
     * naming that rank and the field. */
    if (rank == size - 1) cfg.num_local_experts += 2;
    n = moe_config_agree_fields(fields, &cfg);
    moe_status st = moe_grid_agree(world, fields, n);
    char want[160];
    snprintf(want, sizeof want, "rank %d disagrees", size - 1);
    int bad = st != MOE_ERR_CONFIG || !strstr(moe_last_error(), want) || !strstr(moe_last_error(), "num_local_experts");
    if (bad) printf("  rank %d got: %s\n", rank, moe_last_error());
    mpi_report(bad, "a differing field is named with its rank");

    /* An enum by its names, a number in its shortest faithful form. */
    moe_model_config_default_small(&cfg, 64);
    if (rank == size - 1) cfg.moe_gate = MOE_GATE_SIGMOID;
    n = moe_config_agree_fields(fields, &cfg);
    st = moe_grid_agree(world, fields, n);
    bad = st != MOE_ERR_CONFIG || !strstr(moe_last_error(), "moe_gate: sigmoid, rank 0 has softmax_topk");
    if (bad) printf("  rank %d got: %s\n", rank, moe_last_error());
    mpi_report(bad, "an enum is named by its value's name");
    cfg.moe_gate = MOE_GATE_SOFTMAX_TOPK;
    /* No sliding window as config.json writes it, and a window as a number. */
    if (rank == size - 1) cfg.sliding_window = 4096;
    n = moe_config_agree_fields(fields, &cfg);
    st = moe_grid_agree(world, fields, n);
    bad = st != MOE_ERR_CONFIG || !strstr(moe_last_error(), "sliding_window: 4096, rank 0 has null");
    if (bad) printf("  rank %d got: %s\n", rank, moe_last_error());
    mpi_report(bad, "no sliding window is null, a window its size");
    cfg.sliding_window = 0;
    if (rank == size - 1) cfg.router_aux_loss_coef = 0.03;
    n = moe_config_agree_fields(fields, &cfg);
    st = moe_grid_agree(world, fields, n);
    bad = st != MOE_ERR_CONFIG || !strstr(moe_last_error(), "router_aux_loss_coef: 0.03, rank 0 has 0.01");
    if (bad) printf("  rank %d got: %s\n", rank, moe_last_error());
    mpi_report(bad, "a number is printed as written");
    /* Values that differ never print alike. */
    cfg.router_aux_loss_coef = 0.01;
    if (rank == size - 1) cfg.rms_norm_eps = 1.0000000001e-5;
    n = moe_config_agree_fields(fields, &cfg);
    st = moe_grid_agree(world, fields, n);
    bad = st != MOE_ERR_CONFIG || !strstr(moe_last_error(), "rms_norm_eps: 1.0000000001e-05, rank 0 has 1e-05");
    if (bad) printf("  rank %d got: %s\n", rank, moe_last_error());
    mpi_report(bad, "values that differ in their tenth digit print apart");

    /* Texts agree by their bytes; a difference quotes both ranks' texts on
     * every rank, and an empty text is none. */
    const char *const names[] = {"--resume", "--out"};
    const char *texts[] = {"/ckpt/step-000004", "/runs/a"};
    mpi_report(moe_grid_agree_texts(world, names, texts, 2) != MOE_OK, "identical texts agree");
    if (rank == size - 1) texts[1] = "/runs/b";
    st = moe_grid_agree_texts(world, names, texts, 2);
    snprintf(want, sizeof want, "rank %d disagrees with rank 0 on --out: \"/runs/b\", rank 0 has \"/runs/a\"",
             size - 1);
    bad = st != MOE_ERR_CONFIG || !strstr(moe_last_error(), want);
    if (bad) printf("  rank %d got: %s\n", rank, moe_last_error());
    mpi_report(bad, "a differing text is quoted from both ranks");
    if (rank == size - 1) texts[0] = "";
    st = moe_grid_agree_texts(world, names, texts, 2);
    bad = st != MOE_ERR_CONFIG || !strstr(moe_last_error(), "on --resume: none, rank 0 has \"/ckpt/step-000004\"");
    if (bad) printf("  rank %d got: %s\n", rank, moe_last_error());
    mpi_report(bad, "the first differing text is named, an empty one as none");

    moe_grid grid;
    st = moe_grid_create(&grid, world, size, 1, 1, cfg.num_hidden_layers, moe_grid_flop_costs(&cfg, 8));
    bad = st != MOE_OK || moe_comm_size(grid.ep) != size;
    if (st == MOE_OK) moe_grid_destroy(&grid);
    mpi_report(bad, "EP over all ranks");
    st = moe_grid_create(&grid, world, size + 1, 1, 1, cfg.num_hidden_layers, moe_grid_flop_costs(&cfg, 8));
    mpi_report(st != MOE_ERR_CONFIG || !strstr(moe_last_error(), "--ep"),
               "an EP size that does not divide the ranks is refused");
    /* Interleaved: every chunk a layer at least, and a pipeline to interleave. */
    st = moe_grid_create(&grid, world, 1, size, (int)cfg.num_hidden_layers / size + 1, cfg.num_hidden_layers,
                         moe_grid_flop_costs(&cfg, 8));
    mpi_report(st != MOE_ERR_CONFIG || !strstr(moe_last_error(), "each chunk needs a layer"),
               "more chunks than layers are refused");
    st = moe_grid_create(&grid, world, 1, 1, 2, cfg.num_hidden_layers, moe_grid_flop_costs(&cfg, 8));
    mpi_report(st != MOE_ERR_CONFIG || !strstr(moe_last_error(), "only on a pipeline"),
               "chunks without a pipeline are refused");
    st = moe_grid_create(&grid, world, 1, size, 2, 2 * size, moe_grid_flop_costs(&cfg, 8));
    bad = st != MOE_OK;
    /* Stage s holds virtual stages s and s + size, a layer each. */
    for (int v = 0; !bad && v <= 2 * size; v++) bad = grid.stage_layers[v] != v;
    if (st == MOE_OK) moe_grid_destroy(&grid);
    mpi_report(bad, "2 chunks of %d stages hold a layer each", size);
    return mpi_check_finish();
}
