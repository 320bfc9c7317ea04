/* blas.h: which OpenBLAS kernels the CPU backend's GEMMs run on.
 *
 * A DYNAMIC_ARCH OpenBLAS (Debian's) picks its kernels by the CPU model
 * when it loads, and takes a model it does not know (one newer than the
 * library) for a Prescott: SSE3 kernels, 4.7x slower in SGEMM than its
 * AVX-512 ones on an Emerald Rapids Xeon under Debian 12's OpenBLAS
 * 0.3.21. Its OPENBLAS_CORETYPE, read only when it loads, chooses others;
 * moe's programs set it and run themselves again when OpenBLAS fell back
 * so and the CPU runs better kernels, unless OPENBLAS_CORETYPE was set. */
#ifndef MOE_KERNELS_CPU_BLAS_H
#define MOE_KERNELS_CPU_BLAS_H

#include <stdbool.h>
#include <stddef.h>

/* The core to run instead of core, chosen by OpenBLAS (its config string
 * config: OPENBLAS_CORETYPE works only under DYNAMIC_ARCH), on a CPU with
 * AVX-512 (F, CD, BW, DQ and VL), AVX2 and FMA, or AVX: SkylakeX,
 * Haswell or Sandybridge when core is OpenBLAS's fallback, Prescott;
 * NULL when core is its own choice or nothing fits better. */
const char *moe_blas_fitting_core(const char *core, const char *config, bool avx512, bool avx2_fma, bool avx);

/* At the start of a program (argv its own): when OpenBLAS fell back to
 * Prescott on a CPU that runs better kernels and OPENBLAS_CORETYPE is
 * not set, runs the program again with it set to them (returning only
 * when that fails, with the kernels it has). */
void moe_blas_refit(char **argv);

/* The kernels that run, into buf [n]: "OpenBLAS SkylakeX kernels", and
 * when moe_blas_refit chose them, that OpenBLAS took the CPU for a
 * Prescott. */
void moe_blas_describe(char *buf, size_t n);

#endif /* MOE_KERNELS_CPU_BLAS_H */
