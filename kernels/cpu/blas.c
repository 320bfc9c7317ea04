#define _POSIX_C_SOURCE 200809L
/* blas.c: OpenBLAS's kernels (blas.h). */
#include "kernels/cpu/blas.h"

#include <cblas.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/auxv.h>
#include <unistd.h>

/* Set in the environment of the program moe_blas_refit runs again: the
 * core OpenBLAS had fallen back to. */
static const char REFIT_FROM[] = "MOE_OPENBLAS_FALLBACK";

/* The core DYNAMIC_ARCH OpenBLAS takes a CPU it does not know for. */
static const char FALLBACK[] = "Prescott";

const char *moe_blas_fitting_core(const char *core, const char *config, bool avx512, bool avx2_fma, bool avx) {
    if (!core || !config || strcmp(core, FALLBACK) != 0 || !strstr(config, "DYNAMIC_ARCH")) return NULL;
    return avx512 ? "SkylakeX" : avx2_fma ? "Haswell" : avx ? "Sandybridge" : NULL;
}

void moe_blas_refit(char **argv) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512cd") &&
                        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
                        __builtin_cpu_supports("avx512vl");
    const bool avx2_fma = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    const char *from = openblas_get_corename();
    const char *core = moe_blas_fitting_core(from, openblas_get_config(), avx512, avx2_fma, __builtin_cpu_supports("avx"));
    const char *asked = getenv("OPENBLAS_CORETYPE");
    /* No interpreter: the dynamic loader itself was run, naming the
     * program, and /proc/self/exe is the loader (or the program is static). */
    if (!core || (asked && *asked) || getenv(REFIT_FROM) || getauxval(AT_BASE) == 0) return;
    /* The program's own path, so that it keeps its name (ps, pkill), which
     * /proc/self/exe would make "exe". */
    char self[4096];
    const ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
    if (len > 0 && (size_t)len < sizeof self - 1) {
        self[len] = '\0';
        if (setenv("OPENBLAS_CORETYPE", core, 1) == 0 && setenv(REFIT_FROM, from, 1) == 0) execv(self, argv);
    }
    fprintf(stderr, "%s: OpenBLAS took this CPU for a %s, and running again with OPENBLAS_CORETYPE=%s failed (%s): "
                    "its %s kernels run\n",
            argv[0], from, core, strerror(errno), from);
    unsetenv("OPENBLAS_CORETYPE");
    unsetenv(REFIT_FROM);
#else
    (void)argv;
#endif
}

void moe_blas_describe(char *buf, size_t n) {
    /* The mark counts beside OPENBLAS_CORETYPE, naming the one fallback
     * moe_blas_refit replaces. */
    const char *from = getenv(REFIT_FROM);
    const bool refit = getenv("OPENBLAS_CORETYPE") && from && strcmp(from, FALLBACK) == 0;
    snprintf(buf, n, "OpenBLAS %s kernels%s%s%s", openblas_get_corename(),
             refit ? " (OPENBLAS_CORETYPE set: OpenBLAS took this CPU for a " : "", refit ? FALLBACK : "", refit ? ")" : "");
}
