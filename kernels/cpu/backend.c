/* backend.c: the CPU op table, on host memory. */
#include <omp.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/host_memory.h"
#include "common/status.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/dense.h"

#define CPU_ALIGN_BYTES 256

/* Blocks this large are checked against the memory available first: they
 * are zeroed, so every page is touched at once, and past the memory the
 * machine or the process's cgroup allows that would not fail here but bring
 * the kernel's out-of-memory killer, without a word. A block past the total
 * memory less what this process holds already (its earlier blocks) can
 * never be had on this machine (a setting at fault, which no retry helps);
 * one past what is available now may be once others free theirs (as
 * check_host_memory in engine/model.c tells the two apart). */
#define CPU_CHECKED_BYTES ((size_t)64 << 20)

static moe_status cpu_alloc(void **out, size_t bytes) {
    *out = NULL;
    if (bytes > SIZE_MAX - CPU_ALIGN_BYTES) return moe_error(MOE_ERR_OUT_OF_MEMORY, "cpu backend: %zu bytes", bytes);
    const size_t rounded = (bytes + CPU_ALIGN_BYTES - 1) / CPU_ALIGN_BYTES * CPU_ALIGN_BYTES;
    if (rounded >= CPU_CHECKED_BYTES) {
        const moe_host_memory m = moe_host_memory_available("");
        const int64_t held = m.resident > 0 ? m.resident : 0;
        const bool never = m.total >= 0 && (uint64_t)rounded + (uint64_t)held > (uint64_t)m.total;
        if (never || (m.available >= 0 && (uint64_t)rounded > (uint64_t)m.available))
            return moe_error(never ? MOE_ERR_CONFIG : MOE_ERR_OUT_OF_MEMORY,
                             "cpu backend: %zu bytes, more than the %.2f GB %s%s", bytes,
                             (double)(never ? m.total - held : m.available) / 1e9, never ? m.total_by : m.bound_by,
                             never && held ? " less what this process holds already" : "");
    }
    *out = aligned_alloc(CPU_ALIGN_BYTES, rounded ? rounded : CPU_ALIGN_BYTES);
    if (!*out) return moe_error(MOE_ERR_OUT_OF_MEMORY, "cpu backend: %zu bytes", bytes);
    memset(*out, 0, rounded);
    return MOE_OK;
}

static void cpu_release(void *p) { free(p); }

static moe_status cpu_upload(void *dst, const void *src, size_t bytes) {
    if (bytes) memcpy(dst, src, bytes);
    return MOE_OK;
}

static void cpu_copy(void *dst, const void *src, size_t bytes) {
    if (bytes && dst != src) memcpy(dst, src, bytes);
}

static void cpu_zero(void *dst, size_t bytes) {
    if (bytes) memset(dst, 0, bytes);
}

static moe_status cpu_sync(void) { return MOE_OK; }

/* An op has finished when it returns: its marks are the wall clock. */
static moe_status cpu_marks_create(void **marks, int64_t n) {
    *marks = calloc((size_t)(n > 0 ? n : 1), sizeof(double));
    if (!*marks) return moe_error(MOE_ERR_OUT_OF_MEMORY, "cpu backend: %lld profile marks", (long long)n);
    return MOE_OK;
}

static void cpu_marks_destroy(void *marks) { free(marks); }

static void cpu_mark(void *marks, int64_t i) { ((double *)marks)[i] = omp_get_wtime(); }

static moe_status cpu_mark_seconds(double *seconds, const void *marks, int64_t from, int64_t to) {
    *seconds = ((const double *)marks)[to] - ((const double *)marks)[from];
    return MOE_OK;
}

/* The CPU's dweight sum runs over column blocks and needs no scratch. */
static size_t cpu_rmsnorm_scratch_bytes(int64_t N, int64_t C) {
    (void)N, (void)C;
    return 0;
}

static void cpu_rmsnorm_backward(float *dinp, float *dweight, const float *dout, const float *inp,
                                 const float *weight, const float *rstd, void *scratch, int64_t N, int64_t C) {
    (void)scratch;
    moe_cpu_rmsnorm_backward(dinp, dweight, dout, inp, weight, rstd, N, C);
}

static const moe_ops cpu_ops = {
    .name = "cpu",
    .host_visible = true,
    .alloc = cpu_alloc,
    .release = cpu_release,
    .upload = cpu_upload,
    .download = cpu_upload,
    .copy = cpu_copy,
    .zero = cpu_zero,
    .sync = cpu_sync,
    .marks_create = cpu_marks_create,
    .marks_destroy = cpu_marks_destroy,
    .mark = cpu_mark,
    .mark_seconds = cpu_mark_seconds,
    .gemm = moe_cpu_gemm_split,
    .gate_forward = moe_cpu_gate_forward,
    .gate_backward = moe_cpu_gate_backward,
    .gate_seq_stats = moe_cpu_gate_seq_stats,
    .plan_scratch_bytes = moe_cpu_plan_scratch_bytes,
    .plan_build = moe_cpu_plan_build,
    .permute = moe_cpu_permute,
    .combine = moe_cpu_combine,
    .combine_backward = moe_cpu_combine_backward,
    .unpermute_add = moe_cpu_unpermute_add,
    .experts_forward = moe_cpu_experts_forward,
    .experts_backward = moe_cpu_experts_backward,
    .embedding_forward = moe_cpu_embedding_forward,
    .embedding_backward = moe_cpu_embedding_backward,
    .rmsnorm_forward = moe_cpu_rmsnorm_forward,
    .rmsnorm_scratch_bytes = cpu_rmsnorm_scratch_bytes,
    .rmsnorm_backward = cpu_rmsnorm_backward,
    .matmul_forward = moe_cpu_matmul_forward,
    .matmul_backward = moe_cpu_matmul_backward,
    .rope_forward = moe_cpu_rope_forward,
    .rope_backward = moe_cpu_rope_backward,
    .attention_forward = moe_cpu_attention_forward,
    .attention_backward = moe_cpu_attention_backward,
    .attention_decode = moe_cpu_attention_decode,
    .crossentropy_forward = moe_cpu_crossentropy_forward,
    .crossentropy_backward = moe_cpu_crossentropy_backward,
    .residual_forward = moe_cpu_residual_forward,
    .residual_backward = moe_cpu_residual_backward,
    .multiply = moe_cpu_multiply,
    .sigmoid_gate_forward = moe_cpu_sigmoid_gate_forward,
    .sigmoid_gate_backward = moe_cpu_sigmoid_gate_backward,
    .uniform = moe_cpu_uniform,
    .adamw = moe_cpu_adamw,
    .sumsq = moe_cpu_sumsq,
};

const moe_ops *moe_cpu_ops(void) { return &cpu_ops; }
