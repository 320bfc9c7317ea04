/* backend.c: the CPU op table. */
#include "kernels/cpu/cpu_ops.h"

static const moe_ops cpu_ops = {
    .name = "cpu",
    .gemm = moe_cpu_gemm,
    .gate_forward = moe_cpu_gate_forward,
    .gate_backward = moe_cpu_gate_backward,
    .permute = moe_cpu_permute,
    .combine = moe_cpu_combine,
    .combine_backward = moe_cpu_combine_backward,
    .unpermute_add = moe_cpu_unpermute_add,
    .experts_forward = moe_cpu_experts_forward,
    .experts_backward = moe_cpu_experts_backward,
};

const moe_ops *moe_cpu_ops(void) { return &cpu_ops; }
