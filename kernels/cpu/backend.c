/* backend.c: the CPU op table. */
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/dense.h"

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
    .embedding_forward = moe_cpu_embedding_forward,
    .embedding_backward = moe_cpu_embedding_backward,
    .rmsnorm_forward = moe_cpu_rmsnorm_forward,
    .rmsnorm_backward = moe_cpu_rmsnorm_backward,
    .matmul_forward = moe_cpu_matmul_forward,
    .matmul_backward = moe_cpu_matmul_backward,
    .rope_tables = moe_cpu_rope_tables,
    .rope_forward = moe_cpu_rope_forward,
    .rope_backward = moe_cpu_rope_backward,
    .attention_forward = moe_cpu_attention_forward,
    .attention_backward = moe_cpu_attention_backward,
    .crossentropy_forward = moe_cpu_crossentropy_forward,
    .crossentropy_backward = moe_cpu_crossentropy_backward,
    .residual_forward = moe_cpu_residual_forward,
    .residual_backward = moe_cpu_residual_backward,
    .adamw = moe_cpu_adamw,
    .sumsq = moe_cpu_sumsq,
};

const moe_ops *moe_cpu_ops(void) { return &cpu_ops; }
