/* device.h: choosing the backend a model runs on (--device). */
#ifndef MOE_ENGINE_DEVICE_H
#define MOE_ENGINE_DEVICE_H

#include "comm/comm.h"
#include "engine/grid.h"
#include "kernels/ops.h"
#include "moe.h"

/* AUTO: CUDA when this build has it and a device answers (and, for several
 * processes, NCCL), else the CPU. STRICT: the CPU kernels on memory the
 * host may not touch outside an op (moe_strict_ops), on one process: slow,
 * for checking that a run keeps to the op table as a GPU needs. */
typedef enum moe_device { MOE_DEVICE_AUTO = 0, MOE_DEVICE_CPU, MOE_DEVICE_CUDA, MOE_DEVICE_STRICT } moe_device;

/* "auto", "cpu", "cuda", "cpu-strict". */
const char *moe_device_name(moe_device device);
moe_status moe_device_parse(moe_device *device, const char *name);

/* How a GPU's fp32 GEMMs use its tensor cores: FP32 not at all (bit for bit
 * the fp32 products); TF32 and BF16 round each input to tf32 or bf16 inside
 * the GEMM and accumulate in fp32. Arrays stay fp32 either way. */
typedef enum moe_gemm_math { MOE_GEMM_FP32 = 0, MOE_GEMM_TF32, MOE_GEMM_BF16 } moe_gemm_math;

/* "fp32", "tf32", "bf16". */
const char *moe_gemm_math_name(moe_gemm_math math);
moe_status moe_gemm_math_parse(moe_gemm_math *math, const char *name);

#define MOE_DEVICE_DESC_BYTES 256

typedef struct moe_device_handle {
    const moe_ops *ops;                /* the table to give the model */
    void *cuda;                        /* the moe_cuda_ctx behind ops when CUDA, else NULL */
    int index;                         /* its device: the process's local rank modulo the devices */
    char desc[MOE_DEVICE_DESC_BYTES];  /* "cpu", "cuda: NVIDIA H200 (sm_90, 132 SMs)" */
    char note[MOE_DEVICE_DESC_BYTES];  /* why AUTO chose the CPU; "" when it did not */
    /* Where the GPU sits (its PCI bus id, local PUs, nearest NIC) and
     * whether the process was bound to its PUs; "" on the CPU. */
    char placement[2 * MOE_DEVICE_DESC_BYTES];
} moe_device_handle;

/* Opens want for a job of ranks processes. Several processes on CUDA need
 * NCCL for the arrays they exchange (moe_device_comms), and a GPU each;
 * without them AUTO chooses the CPU and CUDA is an error, saying so. A
 * process's device is the usable GPU (sm_80 or newer) of its local rank
 * (Open MPI's, MPICH's, Slurm's) modulo their count; with hwloc the
 * process is then bound to that GPU's local PUs, unless a launcher bound it
 * within them already (placement says what happened). A GPU that will not
 * give a context (held by another process, say) is an error under CUDA and
 * the CPU under AUTO, with the reason in note: ranks of one job then
 * settle on one backend with moe_device_agree. */
moe_status moe_device_open(moe_device_handle *device, moe_device want, int ranks);

/* One backend for the job of world's ranks: when AUTO left some on the CPU
 * (moe_device_open), the ranks on a GPU close it and join them, with a note
 * that says how many had none. Collective; a no-op on one process. */
moe_status moe_device_agree(moe_device_handle *device, moe_comm *world);

/* Communicators for the device's memory over a grid's ranks: device_world
 * over grid->dp's, device_ep over grid->ep's, device_pipe over
 * grid->pipe's (NULL without a pipeline). NCCL ones on a device backend;
 * all NULL on the CPU and on a grid of no ranks (zeroed, one process),
 * where the grid's own carry the memory. Collective over grid->world;
 * free each with moe_comm_free. */
moe_status moe_device_comms(const moe_device_handle *device, const moe_grid *grid, moe_comm **device_world,
                            moe_comm **device_ep, moe_comm **device_pipe);

/* Sets the GEMM math of an open device; only FP32 on the CPU, which has no
 * other. */
moe_status moe_device_set_gemm_math(moe_device_handle *device, moe_gemm_math math);

/* A host view of backend memory dev [bytes]. On a host-visible backend the
 * caller keeps *host = dev and pull only waits for the ops; otherwise *host
 * is a copy, allocated by the first pull (what names it in the error),
 * that pull refreshes and push writes back (MOE_ERR_STATE before a pull). */
moe_status moe_host_view_pull(const moe_ops *ops, void **host, const void *dev, size_t bytes, const char *what);
moe_status moe_host_view_push(const moe_ops *ops, void *dev, const void *host, size_t bytes, const char *what);

/* After everything allocated on it is released. */
void moe_device_close(moe_device_handle *device);

#endif /* MOE_ENGINE_DEVICE_H */
