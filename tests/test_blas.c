#define _POSIX_C_SOURCE 200809L
/* test_blas.c: the kernels moe_blas_refit runs instead of OpenBLAS's
 * Prescott fallback, and how they are named. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/blas.h"

static const char DYNAMIC[] = "OpenBLAS 0.3.21 NO_LAPACKE DYNAMIC_ARCH NO_AFFINITY USE_OPENMP Prescott MAX_THREADS=64";

Test(blas, the_fallback_on_a_cpu_that_runs_better_kernels) {
    cr_expect_str_eq(moe_blas_fitting_core("Prescott", DYNAMIC, true, true, true), "SkylakeX");
    cr_expect_str_eq(moe_blas_fitting_core("Prescott", DYNAMIC, false, true, true), "Haswell");
    cr_expect_str_eq(moe_blas_fitting_core("Prescott", DYNAMIC, false, false, true), "Sandybridge");
}

Test(blas, openblas_keeps_its_own_choice) {
    cr_expect_null(moe_blas_fitting_core("Prescott", DYNAMIC, false, false, false), "no AVX: Prescott's are the best");
    cr_expect_null(moe_blas_fitting_core("Cooperlake", DYNAMIC, true, true, true), "a core OpenBLAS knows");
    cr_expect_null(moe_blas_fitting_core("Haswell", DYNAMIC, true, true, true), "a core OpenBLAS knows");
    cr_expect_null(moe_blas_fitting_core("Prescott", "OpenBLAS 0.3.21 NO_AFFINITY Prescott", true, true, true),
                   "built for Prescott alone: OPENBLAS_CORETYPE would change nothing");
    cr_expect_null(moe_blas_fitting_core(NULL, DYNAMIC, true, true, true));
}

/* The kernels by name, and the fallback moe replaced, only when it did
 * (its mark set beside OPENBLAS_CORETYPE). */
Test(blas, the_description_names_the_kernels_and_who_chose_them) {
    char text[160];
    unsetenv("MOE_OPENBLAS_FALLBACK");
    moe_blas_describe(text, sizeof text);
    cr_expect(strncmp(text, "OpenBLAS ", 9) == 0 && strstr(text, " kernels") && !strchr(text, '('), "%s", text);
    setenv("MOE_OPENBLAS_FALLBACK", "Prescott", 1);
    unsetenv("OPENBLAS_CORETYPE");
    moe_blas_describe(text, sizeof text);
    cr_expect(!strchr(text, '('), "the mark without OPENBLAS_CORETYPE says nothing: %s", text);
    setenv("OPENBLAS_CORETYPE", "SkylakeX", 1);
    moe_blas_describe(text, sizeof text);
    cr_expect(strstr(text, " kernels (OPENBLAS_CORETYPE set: OpenBLAS took this CPU for a Prescott)"), "%s", text);
    setenv("MOE_OPENBLAS_FALLBACK", "Zen", 1);
    moe_blas_describe(text, sizeof text);
    cr_expect(!strchr(text, '('), "a mark naming no fallback moe replaces says nothing: %s", text);
    setenv("MOE_OPENBLAS_FALLBACK", "Prescott", 1);
    char cut[12];
    moe_blas_describe(cut, sizeof cut);
    cr_expect_eq(strlen(cut), sizeof cut - 1, "cut to its buffer: %s", cut);
}
