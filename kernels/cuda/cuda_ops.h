/* cuda_ops.h: the CUDA backend's host launchers, callable from C.
 *
 * Each op computes what the op of the same name in kernels/ops.h computes
 * (kernels/cpu is the reference), on device pointers, queued on the
 * context's stream: outputs, inputs, sizes, then the context. Launchers
 * return at once unless they say they wait; each returns a status whose
 * detail (moe_last_error) names the failing CUDA or cuBLAS call, file and
 * line. Memory comes from cudaMalloc (never managed memory), at start-up:
 * arenas, or the op table's alloc; no launcher allocates device memory.
 *
 * moe_cuda_ops (at the end) is the op table of kernels/ops.h over these
 * launchers. The launchers' signatures differ from the table's by the
 * trailing context and the returned status, plus where a size may come from
 * device memory (the row count of a dispatch plan) so that the host need not
 * wait for it; the table passes the host's sizes.
 *
 * This header needs no CUDA headers; it declares nothing when the library
 * is built without CUDA (MOE_HAVE_CUDA undefined). */
#ifndef MOE_KERNELS_CUDA_OPS_H
#define MOE_KERNELS_CUDA_OPS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "moe.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ops.h has no C++ guard of its own. */
#include "kernels/ops.h"

#if defined(MOE_HAVE_CUDA)

/* ------------------------------------------------------------ device, context */

/* True when a CUDA device of sm_80 or newer answers, with its name in
 * why[why_bytes]. Otherwise false, with the reason (no driver, no device,
 * driver older than the runtime, devices too old) in why; never fails
 * otherwise, and creates no context it keeps. */
bool moe_cuda_available(char *why, size_t why_bytes);

/* One device, one stream, one cuBLASLt and one cuBLAS handle, a GEMM
 * workspace, a cache of cuBLASLt plans, and the small scratch the launchers
 * need (pointer arrays, pinned host counts). Not thread-safe: one host
 * thread drives one context. */
typedef struct moe_cuda_ctx moe_cuda_ctx;

/* device < 0 picks the first device of sm_80 or newer. */
moe_status moe_cuda_ctx_create(moe_cuda_ctx **ctx, int device);
/* The same on the caller's stream (a cudaStream_t of that device; NULL: a
 * stream of the context's own), which the context uses and never destroys. */
moe_status moe_cuda_ctx_create_on(moe_cuda_ctx **ctx, int device, void *stream);
void moe_cuda_ctx_destroy(moe_cuda_ctx *ctx);

/* "NVIDIA H200 (sm_90, 132 SMs)". */
const char *moe_cuda_device_name(const moe_cuda_ctx *ctx);

/* The device's PCI bus id, "0000:84:00.0" (lower case, as hwloc spells it);
 * out_bytes >= 13. */
moe_status moe_cuda_pci_bus_id(char *out, size_t out_bytes, const moe_cuda_ctx *ctx);

/* How the fp32 GEMMs (moe_cuda_gemm, so every fp32 GEMM of the op table)
 * use the tensor cores. FP32 (the default, and the parity tests'): not at
 * all. TF32, BF16: each input is rounded to tf32 or bf16 inside the GEMM,
 * which accumulates in fp32; storage stays fp32. */
typedef enum moe_cuda_math { MOE_CUDA_MATH_FP32 = 0, MOE_CUDA_MATH_TF32, MOE_CUDA_MATH_BF16 } moe_cuda_math;
void moe_cuda_set_math(moe_cuda_ctx *ctx, moe_cuda_math math);

/* The context's cudaStream_t, for a library that queues on it (NCCL). */
void *moe_cuda_stream(const moe_cuda_ctx *ctx);

/* The devices of sm_80 or newer this process sees, in order, the first max
 * of them in devices [max]: how many there are (0 when none answers). */
int moe_cuda_usable_devices(int *devices, int max);

/* Waits for everything queued on the context's stream and reports the
 * first asynchronous error (a fault inside an earlier kernel). */
moe_status moe_cuda_sync(moe_cuda_ctx *ctx);

/* ----------------------------------------------------------------- memory */

/* One cudaMalloc carved by a bump pointer; every piece is
 * MOE_CUDA_ARENA_ALIGN_BYTES-aligned (what cuBLASLt's fastest kernels
 * want). reset frees every piece at once. */
#define MOE_CUDA_ARENA_ALIGN_BYTES 256

typedef struct moe_cuda_arena {
    char *base;      /* device memory */
    size_t capacity; /* bytes */
    size_t used;     /* bytes */
} moe_cuda_arena;

/* Bytes an arena needs to hand out pieces of these sizes, alignment
 * included. */
size_t moe_cuda_arena_bytes(const size_t *piece_bytes, int n_pieces);
moe_status moe_cuda_arena_create(moe_cuda_arena *arena, size_t capacity, moe_cuda_ctx *ctx);
/* *out = a piece of `bytes`, or MOE_ERR_OUT_OF_MEMORY naming the sizes. */
moe_status moe_cuda_arena_alloc(moe_cuda_arena *arena, void **out, size_t bytes);
void moe_cuda_arena_reset(moe_cuda_arena *arena);
void moe_cuda_arena_destroy(moe_cuda_arena *arena);

/* upload returns once src may be reused: up to MOE_CUDA_STAGING_SLOT_BYTES
 * it is copied into pinned staging and queued without waiting for the
 * device (a step's small uploads: tokens, routing counts), larger ones wait
 * until the data has arrived. download returns once dst holds the data
 * (it waits on the stream). */
#define MOE_CUDA_STAGING_SLOTS 16
#define MOE_CUDA_STAGING_SLOT_BYTES ((size_t)256 << 10)
moe_status moe_cuda_upload(void *dst_device, const void *src_host, size_t bytes, moe_cuda_ctx *ctx);
moe_status moe_cuda_download(void *dst_host, const void *src_device, size_t bytes,
                             moe_cuda_ctx *ctx);
/* Asynchronous byte fill, e.g. 0xFF to poison floats with NaN. */
moe_status moe_cuda_memset(void *dst_device, int byte, size_t bytes, moe_cuda_ctx *ctx);

/* Storage types of the GEMM operands; arithmetic is always fp32. */
typedef enum moe_cuda_dtype { MOE_CUDA_F32 = 0, MOE_CUDA_BF16 = 1 } moe_cuda_dtype;

size_t moe_cuda_dtype_bytes(moe_cuda_dtype t);

/* p[i] = scale * U(-1, 1) from (seed, i) alone, on the device, in the given
 * storage type: benchmark inputs without a host copy. */
moe_status moe_cuda_fill_uniform(void *p, int64_t n, moe_cuda_dtype t, float scale, uint64_t seed,
                                 moe_cuda_ctx *ctx);

/* dst [n] = src [n] rounded to bf16 (round to nearest even), and back. */
moe_status moe_cuda_f32_to_bf16(void *dst, const float *src, int64_t n, moe_cuda_ctx *ctx);
moe_status moe_cuda_bf16_to_f32(float *dst, const void *src, int64_t n, moe_cuda_ctx *ctx);

/* ------------------------------------------------------------------- GEMM */

/* ops.h gemm: c[m, n] = alpha op(a) op(b) + beta c, row-major, through a
 * cached cuBLASLt plan, fp32 storage, in the context's math
 * (moe_cuda_set_math: fp32 by default, or TF32 / BF16 tensor cores). */
moe_status moe_cuda_gemm(float *c, const float *a, const float *b, int64_t m, int64_t n, int64_t k,
                         int64_t lda, int64_t ldb, int64_t ldc, bool trans_a, bool trans_b,
                         float alpha, float beta, moe_cuda_ctx *ctx);

/* The same in other storage types: a and b in ab_type, c in c_type. */
moe_status moe_cuda_gemm_ex(void *c, moe_cuda_dtype c_type, const void *a, const void *b,
                            moe_cuda_dtype ab_type, int64_t m, int64_t n, int64_t k, int64_t lda,
                            int64_t ldb, int64_t ldc, bool trans_a, bool trans_b, float alpha,
                            float beta, moe_cuda_ctx *ctx);

/* ------------------------------------------------------------------ gating */

/* Tokens per chunk of the totals' first level: the CPU's chunks. */
#define MOE_CUDA_GATE_CHUNK_TOKENS MOE_GATE_CHUNK_TOKENS

/* ops.h's moe_gate_totals with every field on the device. The totals are
 * deterministic: per chunk of MOE_CUDA_GATE_CHUNK_TOKENS tokens summed in
 * token order (as the CPU does), then the chunks in a fixed tree order. */
typedef struct moe_cuda_gate_totals {
    int64_t *assigned;     /* [E] (token, slot) pairs chosen, pre-capacity */
    double *prob_sum;      /* [E] */
    double *z_sum;         /* [1] */
    double *chunk_scratch; /* [ceil(T / MOE_CUDA_GATE_CHUNK_TOKENS), 2E + 1] */
} moe_cuda_gate_totals;

/* ops.h gate_forward: a block per chunk of MOE_CUDA_GATE_CHUNK_TOKENS
 * tokens, 8 lanes a token up to 256 experts (a warp beyond), the chunk's
 * statistics from the same kernel; bias [E] or NULL. */
moe_status moe_cuda_gate_forward(int32_t *topk_idx, float *topk_w, float *prob, float *lse,
                                 const moe_cuda_gate_totals *totals, const float *logits,
                                 const float *bias, const moe_gate_params *p, int64_t T,
                                 moe_cuda_ctx *ctx);

/* ops.h gate_backward, one warp per token; aux_grad [E], [T / p->aux_seq_len, E] or NULL. */
moe_status moe_cuda_gate_backward(float *dlogits, const float *dweights, const int32_t *topk_idx,
                                  const float *topk_w, const float *prob, const float *lse,
                                  const float *logits, const float *aux_grad, float z_coef_over_T,
                                  const moe_gate_params *p, int64_t T, moe_cuda_ctx *ctx);

/* ops.h gate_seq_stats: a block per sequence, a thread per expert, each
 * summing its column in token order as the CPU does. */
moe_status moe_cuda_gate_seq_stats(float *stats, const int32_t *topk_idx, const float *prob,
                                   const moe_gate_params *p, int64_t T, moe_cuda_ctx *ctx);

/* ---------------------------------------------------------- dispatch plan */

/* router/plan.h's moe_plan_build on the device, with no host wait: pairs
 * in token order, then slot order; expert e keeps its first keep[e] pairs.
 * expert_offsets [E+1] is the exclusive prefix sum of the kept counts, so
 * expert_offsets[E] is the row count that the other ops read from the
 * device. keep [E] on the device, or NULL for dropless. Stable and
 * deterministic: ranks come from per-chunk counts and an integer scan, not
 * from the order in which atomics land. scratch holds
 * moe_cuda_plan_scratch_bytes(T, k, E) bytes. */
size_t moe_cuda_plan_scratch_bytes(int64_t T, int64_t k, int64_t E);
moe_status moe_cuda_plan_build(int64_t *pair_row, int64_t *row_token, int64_t *expert_offsets,
                               const int32_t *topk_idx, const int64_t *keep, void *scratch,
                               int64_t T, int64_t k, int64_t E, moe_cuda_ctx *ctx);

/* ops.h permute for the rows r < *n_rows, n_rows on the device (a plan's
 * expert_offsets + E); max_rows (>= *n_rows, e.g. T*k) bounds the grid.
 * n_rows NULL: all max_rows rows (the table's host count). */
moe_status moe_cuda_permute(float *xp, const float *x, const int64_t *row_token,
                            const int64_t *n_rows, int64_t max_rows, int64_t d, moe_cuda_ctx *ctx);
moe_status moe_cuda_combine(float *y, const float *yp, const float *topk_w, const int64_t *pair_row,
                            const float *shared, int64_t T, int64_t k, int64_t d,
                            moe_cuda_ctx *ctx);
moe_status moe_cuda_combine_backward(float *dyp, float *dweights, const float *dy, const float *yp,
                                     const float *topk_w, const int64_t *pair_row, int64_t T,
                                     int64_t k, int64_t d, moe_cuda_ctx *ctx);
moe_status moe_cuda_unpermute_add(float *dx, const float *dxp, const int64_t *pair_row, int64_t T,
                                  int64_t k, int64_t d, moe_cuda_ctx *ctx);

/* ---------------------------------------------------------------- experts */

/* How the per-expert GEMMs run.
 *  LT_LOOP: one cublasLtMatmul per expert with a cached plan (baseline 1).
 *  BATCHED: cublasGemmGroupedBatchedEx, experts of equal rows in one group
 *           (baseline 2).
 *  MMA:     our bf16 tensor-core kernel (mma.sync m16n8k16, sm_80 and up),
 *           which reads each expert's rows from device memory; forward
 *           (x w^T) shapes in bf16 only.
 *  WGMMA:   the same on Hopper's warpgroup MMA (compute capability 9.0,
 *           from a build for sm_90a), every thread loading with cp.async.
 *  WGMMA_TMA: the same, warp-specialized: a producer warpgroup loads by
 *           TMA, two consumer warpgroups multiply.
 * cuBLAS takes its shapes from host memory, so LT_LOOP and BATCHED copy the
 * E+1 offsets to the host and WAIT for the stream first: one host sync per
 * call, which also rules out graph capture. Our kernels do not wait. */
typedef enum moe_cuda_grouped_algo {
    MOE_CUDA_GROUPED_LT_LOOP = 0,
    MOE_CUDA_GROUPED_BATCHED = 1,
    MOE_CUDA_GROUPED_MMA = 2,
    MOE_CUDA_GROUPED_WGMMA = 3,
    MOE_CUDA_GROUPED_WGMMA_TMA = 4,
} moe_cuda_grouped_algo;

const char *moe_cuda_grouped_algo_name(moe_cuda_grouped_algo algo);

/* MOE_OK when WGMMA and WGMMA_TMA run on ctx's device, else MOE_ERR_UNSUPPORTED saying
 * why (another architecture, or a build without sm_90a code). */
moe_status moe_cuda_wgmma_check(const moe_cuda_ctx *ctx);

/* c [rows, n] = a [rows, k] b_e [n, k]^T for the rows of each expert e,
 * offsets [E+1] on the device, b [E, n, k]: the experts' forward GEMM.
 * a, b in ab_type; c in c_type; max_rows >= offsets[E] bounds the grid of
 * our kernels, and a holds max_rows rows (WGMMA_TMA's loads may read past
 * offsets[E], into rows whose products it drops). */
moe_status moe_cuda_grouped_gemm(void *c, moe_cuda_dtype c_type, const void *a, const void *b,
                                 moe_cuda_dtype ab_type, const int64_t *offsets, int64_t E,
                                 int64_t max_rows, int64_t n, int64_t k, moe_cuda_grouped_algo algo,
                                 moe_cuda_ctx *ctx);

/* The grouped SwiGLU experts of ops.h over an expert-major batch: the rows
 * of expert e are [offsets[e], offsets[e+1]) of every row buffer, and the
 * weights of all experts are contiguous. dtype F32: every buffer fp32.
 * dtype BF16: every buffer bf16 except the weight gradients dw13 and dw2,
 * which stay fp32 (they accumulate across steps). */
typedef struct moe_cuda_experts {
    moe_cuda_dtype dtype;
    int64_t n_experts;      /* E */
    int64_t d_model;        /* d */
    int64_t d_ff;           /* f */
    int64_t max_rows;       /* rows the row buffers hold, >= offsets[E] */
    const int64_t *offsets; /* [E+1] device */
    const void *x;          /* [rows, d] */
    const void *w13;        /* [E, 2f, d]: w1's f rows then w3's */
    const void *w2;         /* [E, d, f] */
    void *h;                /* [rows, 2f] saved for backward */
    void *g;                /* [rows, f] saved for backward */
    void *y;                /* [rows, d] */
    /* backward only */
    const void *dy; /* [rows, d] */
    void *dh;       /* [rows, 2f] scratch */
    void *dx;       /* [rows, d], written */
    float *dw13;    /* [E, 2f, d], accumulated */
    float *dw2;     /* [E, d, f], accumulated */
} moe_cuda_experts;

/* MMA serves the forward in bf16; the backward and fp32 need LT_LOOP or
 * BATCHED (MOE_ERR_UNSUPPORTED otherwise). */
moe_status moe_cuda_experts_forward(const moe_cuda_experts *b, moe_cuda_grouped_algo algo,
                                    moe_cuda_ctx *ctx);
moe_status moe_cuda_experts_backward(const moe_cuda_experts *b, moe_cuda_grouped_algo algo,
                                     moe_cuda_ctx *ctx);

/* ops.h experts_forward / experts_backward: groups [n_groups] on the host
 * with host row counts, every array on the device, fp32. Each group runs
 * as its own cuBLASLt GEMMs (a cached plan per power-of-two bucket of rows), so the
 * groups may differ in d_ff and nothing waits for the device. Under
 * MOE_CUDA_MATH_BF16 the GEMMs read bf16 copies of x, dy and the weights
 * (made in the context's scratch, which waits for the device when it grows:
 * on the first steps, and when rows grow past half again the largest yet)
 * and h, g and dh hold bf16 in the first half of their buffers; y, dx and
 * the weight gradients stay fp32. */
moe_status moe_cuda_expert_groups_forward(const moe_expert_group *groups, int64_t n_groups,
                                          int64_t d, moe_cuda_ctx *ctx);
moe_status moe_cuda_expert_groups_backward(const moe_expert_group *groups, int64_t n_groups,
                                           int64_t d, moe_cuda_ctx *ctx);

/* ------------------------------------------------------------------ dense */

/* kernels/cpu/dense.h says what each computes; backward ops accumulate
 * there and here alike, and its exceptions are exceptions here too. */
moe_status moe_cuda_embedding_forward(float *out, const int32_t *tokens, const float *wte,
                                      int64_t N, int64_t C, moe_cuda_ctx *ctx);
/* The CPU's bits (each token's rows added in row order). Sorts the rows by
 * token in the context's sort scratch, which grows (with a device wait) the
 * first time N does. */
moe_status moe_cuda_embedding_backward(float *dwte, const float *dout, const int32_t *tokens,
                                       int64_t N, int64_t C, moe_cuda_ctx *ctx);
moe_status moe_cuda_rmsnorm_forward(float *out, float *rstd, const float *inp, const float *weight,
                                    float eps, int64_t N, int64_t C, moe_cuda_ctx *ctx);
/* scratch: moe_cuda_rmsnorm_scratch_bytes(N, C) bytes for the
 * deterministic dweight reduction. */
size_t moe_cuda_rmsnorm_scratch_bytes(int64_t N, int64_t C);
moe_status moe_cuda_rmsnorm_backward(float *dinp, float *dweight, const float *dout,
                                     const float *inp, const float *weight, const float *rstd,
                                     void *scratch, int64_t N, int64_t C, moe_cuda_ctx *ctx);
moe_status moe_cuda_matmul_forward(float *out, const float *inp, const float *weight, int64_t N,
                                   int64_t C, int64_t OC, moe_cuda_ctx *ctx);
moe_status moe_cuda_matmul_backward(float *dinp, float *dweight, const float *dout,
                                    const float *inp, const float *weight, int64_t N, int64_t C,
                                    int64_t OC, moe_cuda_ctx *ctx);
moe_status moe_cuda_rope_forward(float *x, const float *cos_t, const float *sin_t, int64_t B,
                                 int64_t T, int64_t H, int64_t hd, moe_cuda_ctx *ctx);
moe_status moe_cuda_rope_backward(float *dx, const float *cos_t, const float *sin_t, int64_t B,
                                  int64_t T, int64_t H, int64_t hd, moe_cuda_ctx *ctx);
/* Under bf16 math, attention runs fused (flash_attention.cu: no T x T
 * scores in device memory) for the sizes moe_cuda_attention_fused accepts:
 * a head size of 16, 32, 64 or 128 and T > hd. att then holds the kernels' own
 * state (the rows' log-sum-exp, then a copy of out), not the
 * probabilities; datt is the backward's scratch. A context set to
 * MOE_CUDA_ATTENTION_BATCHED (moe-bench attention's baseline) runs the
 * batched GEMMs and softmax kernels for every size; a forward and its
 * backward must run on the same path. */
typedef enum moe_cuda_attention_path {
    MOE_CUDA_ATTENTION_AUTO = 0,
    MOE_CUDA_ATTENTION_BATCHED,
} moe_cuda_attention_path;
void moe_cuda_set_attention_path(moe_cuda_ctx *ctx, moe_cuda_attention_path path);
bool moe_cuda_attention_fused(int64_t T, int64_t Hq, int64_t hd, const moe_cuda_ctx *ctx);
moe_status moe_cuda_attention_forward(float *out, float *att, const float *q, const float *k,
                                      const float *v, int64_t B, int64_t T, int64_t Hq, int64_t Hkv,
                                      int64_t hd, int64_t window, moe_cuda_ctx *ctx);
moe_status moe_cuda_attention_backward(float *dq, float *dk, float *dv, float *datt,
                                       const float *dout, const float *q, const float *k,
                                       const float *v, const float *att, int64_t B, int64_t T,
                                       int64_t Hq, int64_t Hkv, int64_t hd, int64_t window,
                                       moe_cuda_ctx *ctx);
moe_status moe_cuda_attention_decode(float *out, float *att, const float *q, const float *k,
                                     const float *v, int64_t T, int64_t Hq, int64_t Hkv, int64_t hd,
                                     moe_cuda_ctx *ctx);
moe_status moe_cuda_crossentropy_forward(float *losses, double *lse, const float *logits,
                                         const int32_t *targets, int64_t N, int64_t V,
                                         moe_cuda_ctx *ctx);
moe_status moe_cuda_crossentropy_backward(float *dlogits, const float *logits, const double *lse,
                                          const int32_t *targets, const float *dloss, float z_coef,
                                          int64_t N, int64_t V, moe_cuda_ctx *ctx);
moe_status moe_cuda_residual_forward(float *out, const float *a, const float *b, int64_t n,
                                     moe_cuda_ctx *ctx);
moe_status moe_cuda_residual_backward(float *da, float *db, const float *dout, int64_t n,
                                      moe_cuda_ctx *ctx);
moe_status moe_cuda_uniform(float *out, uint64_t seed, uint64_t stream, uint64_t first, float lo,
                            float span, int64_t n, moe_cuda_ctx *ctx);
moe_status moe_cuda_multiply(float *out, const float *a, const float *b, int64_t n,
                             moe_cuda_ctx *ctx);
/* A block per token, rows over the grid's x (any T); the backward's dot in
 * double, in a fixed tree: the same bits on every run. The backward writes
 * din and dlogits, as the CPU's does. */
moe_status moe_cuda_sigmoid_gate_forward(float *out, float *gate, const float *in,
                                         const float *logits, int64_t T, int64_t d,
                                         moe_cuda_ctx *ctx);
moe_status moe_cuda_sigmoid_gate_backward(float *din, float *dlogits, const float *dout,
                                          const float *out, const float *gate, int64_t T, int64_t d,
                                          moe_cuda_ctx *ctx);
/* One launch for every tensor: spans [n_spans] on the device (ops.h). */
moe_status moe_cuda_adamw(float *params, float *m, float *v, const float *grads,
                          float grad_scale, int64_t n, const moe_adamw_span *spans,
                          int64_t n_spans, float lr, float beta1, float beta2, float eps,
                          float weight_decay, int64_t t, moe_cuda_ctx *ctx);
/* *out (device) = sum of x[i]^2 in double, in MOE_CUDA_SUMSQ_PARTS fixed
 * parts summed in order: the same bits on every run. A block per part:
 * enough blocks to keep a large GPU's memory busy over 1e9 gradients. */
#define MOE_CUDA_SUMSQ_PARTS 2048
moe_status moe_cuda_sumsq(double *out, const float *x, int64_t n, moe_cuda_ctx *ctx);

/* --------------------------------------------------------------- op table */

/* The CUDA op table, its entries bound to ctx for the calling thread. The
 * table's entries take no context, so the binding is per-thread state, as
 * CUDA's current device is (this call also makes ctx's device current):
 * each thread that calls the table binds its context first, and binding
 * another context on the same thread rebinds it (NULL unbinds). An entry
 * on a thread with no context bound fails with MOE_ERR_STATE.
 *
 * Entries queue their launcher on the bound context's stream. A failing
 * entry's status and moe_last_error detail are kept (per thread) and
 * returned by the next sync, upload or download, which clears them; until
 * then the other entries do nothing, since their inputs may come from the
 * failed op; alloc, release, upload and download still run. alloc is a
 * cudaMalloc, zero-filled, that waits for the device, and release waits for
 * the stream before cudaFree: the engine allocates when it is created,
 * never per step. upload and download wait; copy and zero are queued. */
const moe_ops *moe_cuda_ops(moe_cuda_ctx *ctx);

/* Unbinds ctx from the calling thread if it is the one bound there: for a
 * context about to be destroyed, whose kept failure goes with it. */
void moe_cuda_unbind(moe_cuda_ctx *ctx);

#endif /* MOE_HAVE_CUDA */

#ifdef __cplusplus
}
#endif

#endif /* MOE_KERNELS_CUDA_OPS_H */
