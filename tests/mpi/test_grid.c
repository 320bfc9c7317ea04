/* test_grid.c: the rank grid and the start-up agreement check (run under
 * mpirun -np 2 and -np 4). A plain program (Criterion forks, which MPI does
 * not survive); ends with "N passed, M failed". */
#include <mpi.h>
#include <stdio.h>
#include <string.h>

#include "engine/grid.h"

static int rank, size, passed, failed;

static void report(const char *name, int bad) {
    int any = 0;
    MPI_Allreduce(&bad, &any, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (rank == 0) printf("%s: %s\n", any ? "FAIL" : "PASS", name);
    fflush(stdout);
    if (any) failed++; else passed++;
}

int main(void) {
    moe_comm *world;
    if (moe_comm_mpi_create(&world) != MOE_OK) return 1;
    rank = moe_comm_rank(world);
    size = moe_comm_size(world);

    moe_model_config cfg;
    moe_model_config_default_small(&cfg, 64);
    moe_agree_field fields[MOE_CONFIG_AGREE_FIELDS];
    int n = moe_config_agree_fields(fields, &cfg);
    report("identical configs agree", moe_grid_agree(world, fields, n) != MOE_OK);

    /* The last rank trains with two more experts: every rank must refuse,
     * naming that rank and the field. */
    if (rank == size - 1) cfg.num_local_experts += 2;
    n = moe_config_agree_fields(fields, &cfg);
    moe_status st = moe_grid_agree(world, fields, n);
    char want[64];
    snprintf(want, sizeof want, "rank %d disagrees", size - 1);
    int bad = st != MOE_ERR_CONFIG || !strstr(moe_last_error(), want) || !strstr(moe_last_error(), "num_local_experts");
    if (bad) printf("  rank %d got: %s\n", rank, moe_last_error());
    report("a differing field is named with its rank", bad);

    moe_grid grid;
    st = moe_grid_create(&grid, world, size);
    bad = st != MOE_OK || moe_comm_size(grid.ep) != size;
    if (st == MOE_OK) moe_grid_destroy(&grid);
    report("EP over all ranks", bad);
    st = moe_grid_create(&grid, world, size + 1);
    report("an EP size that does not divide the ranks is refused",
           st != MOE_ERR_CONFIG || !strstr(moe_last_error(), "--ep"));

    if (rank == 0) printf("%d passed, %d failed\n", passed, failed);
    moe_comm_free(world);
    moe_comm_mpi_finalize();
    return failed ? 1 : 0;
}
