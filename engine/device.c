/* device.c: --device, from a name to an op table and its context. */
#include "engine/device.h"

#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm/topology.h"
#include "common/status.h"
#include "kernels/cuda/cuda_ops.h"

/* The index of name in names [n], or an error naming flag and what it expects. */
static moe_status find_name(int *index, const char *const *names, size_t n, const char *name, const char *flag,
                            const char *expected) {
    for (size_t i = 0; name && i < n; i++)
        if (strcmp(name, names[i]) == 0) {
            *index = (int)i;
            return MOE_OK;
        }
    return moe_error(MOE_ERR_CONFIG, "%s '%s': expected %s", flag, name ? name : "", expected);
}

static const char *const device_names[] = {"auto", "cpu", "cuda", "cpu-strict"};
#define N_DEVICES (sizeof device_names / sizeof *device_names)

const char *moe_device_name(moe_device d) { return (unsigned)d < N_DEVICES ? device_names[d] : "?"; }

moe_status moe_device_parse(moe_device *d, const char *name) {
    int i = 0;
    MOE_TRY(find_name(&i, device_names, N_DEVICES, name, "--device", "auto, cpu, cuda or cpu-strict"));
    *d = (moe_device)i;
    return MOE_OK;
}

#if defined(MOE_HAVE_CUDA)
/* The first of the launcher's variables that is set, as an integer, or 0. */
static int launcher_int(const char *const *vars, size_t n) {
    for (size_t i = 0; i < n; i++) {
        const char *v = getenv(vars[i]);
        if (v && *v) return atoi(v);
    }
    return 0;
}

/* This process's rank among its node's, or 0. */
static int local_rank(void) {
    static const char *const vars[] = {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"};
    return launcher_int(vars, sizeof vars / sizeof *vars);
}

/* How many ranks run on this node, or 0 when the launcher does not say. */
static int local_ranks(void) {
    static const char *const vars[] = {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"};
    return launcher_int(vars, sizeof vars / sizeof *vars);
}

/* Usable GPUs this process tells apart. */
#define MAX_GPUS 64
#endif

static const char *const math_names[] = {"fp32", "tf32", "bf16"};
#define N_MATHS (sizeof math_names / sizeof *math_names)

const char *moe_gemm_math_name(moe_gemm_math m) { return (unsigned)m < N_MATHS ? math_names[m] : "?"; }

moe_status moe_gemm_math_parse(moe_gemm_math *m, const char *name) {
    int i = 0;
    MOE_TRY(find_name(&i, math_names, N_MATHS, name, "--gemm-math", "fp32, tf32 or bf16"));
    *m = (moe_gemm_math)i;
    return MOE_OK;
}

moe_status moe_device_set_gemm_math(moe_device_handle *h, moe_gemm_math math) {
    if ((unsigned)math >= N_MATHS) return moe_error(MOE_ERR_INVALID_ARG, "gemm math %d unknown", (int)math);
    if (math == MOE_GEMM_FP32) return MOE_OK;
#if defined(MOE_HAVE_CUDA)
    if (h->cuda) {
        static const moe_cuda_math cuda_math[] = {MOE_CUDA_MATH_FP32, MOE_CUDA_MATH_TF32, MOE_CUDA_MATH_BF16};
        moe_cuda_set_math(h->cuda, cuda_math[math]);
        return MOE_OK;
    }
#endif
    return moe_error(MOE_ERR_UNSUPPORTED, "--gemm-math %s: the %s backend computes in fp32 only",
                     moe_gemm_math_name(math), h->desc);
}

/* Whether CUDA can serve a job of ranks processes; why not in why. */
static bool cuda_usable(int ranks, char *why, size_t why_bytes) {
#if defined(MOE_HAVE_CUDA)
    if (!moe_cuda_available(why, why_bytes)) return false;
#if !defined(MOE_HAVE_NCCL)
    if (ranks > 1) {
        snprintf(why, why_bytes, "%d ranks need NCCL, and this build has none", ranks);
        return false;
    }
#endif
    (void)ranks;
    return true;
#else
    (void)ranks;
    snprintf(why, why_bytes, "this build has no CUDA (%s)", MOE_NO_CUDA_WHY);
    return false;
#endif
}

#if defined(MOE_HAVE_CUDA)
/* Writes h->placement; a text too long for it (a long PU list, written
 * last) ends in "...". */
static void set_placement(moe_device_handle *h, const char *fmt, ...) MOE_PRINTF(2, 3);
static void set_placement(moe_device_handle *h, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(h->placement, sizeof h->placement, fmt, ap);
    va_end(ap);
    if (n >= (int)sizeof h->placement) memcpy(h->placement + sizeof h->placement - 4, "...", 4);
}

/* The GPU's place in this machine, and the process bound near it. Not
 * fatal: a machine hwloc cannot read still trains, saying so. The binding
 * does not wait on the description: a placement hwloc cannot describe still
 * binds. */
static void place_near(moe_device_handle *h, moe_cuda_ctx *ctx) {
    char bus[32];
    if (moe_cuda_pci_bus_id(bus, sizeof bus, ctx) != MOE_OK) {
        set_placement(h, "unknown: %s", moe_last_error());
        return;
    }
    moe_topology *topo = NULL;
    if (moe_topology_load(&topo, NULL) != MOE_OK) {
        set_placement(h, "GPU %s, not placed: %s", bus, moe_last_error());
        return;
    }
    moe_gpu_placement p;
    char why[MOE_DEVICE_DESC_BYTES] = ""; /* why the placement is not described */
    const bool described = moe_topology_gpu_placement(topo, bus, &p) == MOE_OK;
    if (!described) snprintf(why, sizeof why, "%s", moe_last_error());
    bool bound = false;
    char binding[MOE_DEVICE_DESC_BYTES] = "";
    if (moe_topology_bind_near(topo, bus, &bound) != MOE_OK)
        snprintf(binding, sizeof binding, ", not bound: %s", moe_last_error());
    else if (bound)
        snprintf(binding, sizeof binding, ", process bound to its local PUs");
    if (described)
        set_placement(h, "GPU %s%s, nearest NIC %s (%s), local PUs of %s: %s", bus, binding,
                      p.nic[0] ? p.nic : "none", moe_link_distance_name(p.nic_distance), p.near, p.cpus);
    else
        set_placement(h, "GPU %s%s, placement not described: %s", bus, binding, why);
    moe_topology_free(topo);
}
#endif

moe_status moe_device_open(moe_device_handle *h, moe_device want, int ranks) {
    *h = (moe_device_handle){.ops = moe_cpu_ops()};
    snprintf(h->desc, sizeof h->desc, "cpu");
    if (want == MOE_DEVICE_CPU) return MOE_OK;
    if (want == MOE_DEVICE_STRICT) {
        /* MPI reads and writes the arrays it moves, which this memory forbids. */
        if (ranks > 1) return moe_error(MOE_ERR_CONFIG, "--device cpu-strict runs on one process, not %d", ranks);
        h->ops = moe_strict_ops();
        snprintf(h->desc, sizeof h->desc, "cpu-strict");
        return MOE_OK;
    }
    char why[MOE_DEVICE_DESC_BYTES - 64];
    if (!cuda_usable(ranks, why, sizeof why)) {
        if (want == MOE_DEVICE_CUDA) return moe_error(MOE_ERR_UNSUPPORTED, "--device cuda: %s", why);
        snprintf(h->note, sizeof h->note, "--device auto: running on the CPU: %s", why);
        return MOE_OK;
    }
#if defined(MOE_HAVE_CUDA)
    /* Each rank takes a usable GPU of its node by its local rank (an older
     * GPU beside them is passed over); NCCL refuses two ranks on one GPU. */
    int usable[MAX_GPUS];
    int n_usable = moe_cuda_usable_devices(usable, MAX_GPUS);
    n_usable = n_usable < MAX_GPUS ? n_usable : MAX_GPUS;
    const int node_ranks = local_ranks();
    if (ranks > 1 && node_ranks > n_usable) {
        snprintf(why, sizeof why, "%d ranks on this node share %d usable GPU%s, and NCCL needs one a rank", node_ranks,
                 n_usable, n_usable == 1 ? "" : "s");
        if (want == MOE_DEVICE_CUDA) return moe_error(MOE_ERR_UNSUPPORTED, "--device cuda: %s", why);
        snprintf(h->note, sizeof h->note, "--device auto: running on the CPU: %s", why);
        return MOE_OK;
    }
    h->index = usable[local_rank() % n_usable];
    moe_cuda_ctx *ctx = NULL;
    moe_status st = moe_cuda_ctx_create(&ctx, h->index);
    if (st != MOE_OK && want == MOE_DEVICE_AUTO) {
        snprintf(h->note, sizeof h->note, "--device auto: running on the CPU: CUDA device %d: %.180s", h->index,
                 moe_last_error());
        return MOE_OK;
    }
    if (st != MOE_OK) return moe_error_prefix(st, "--device %s: ", moe_device_name(want));
    h->cuda = ctx;
    h->ops = moe_cuda_ops(ctx);
    snprintf(h->desc, sizeof h->desc, "cuda: %s", moe_cuda_device_name(ctx));
    place_near(h, ctx);
#endif
    return MOE_OK;
}

moe_status moe_device_agree(moe_device_handle *h, moe_comm *world) {
    if (!world) return MOE_OK;
    int64_t on_gpu = h->cuda != NULL;
    MOE_TRY(moe_comm_allreduce_sum(world, &on_gpu, 1, MOE_COMM_I64));
    const int ranks = moe_comm_size(world);
    if (on_gpu == 0 || on_gpu == ranks || !h->cuda) return MOE_OK;
    moe_device_close(h);
    *h = (moe_device_handle){.ops = moe_cpu_ops()};
    snprintf(h->desc, sizeof h->desc, "cpu");
    snprintf(h->note, sizeof h->note, "--device auto: running on the CPU: %lld of the %d ranks have no usable GPU",
             (long long)(ranks - on_gpu), ranks);
    return MOE_OK;
}

moe_status moe_device_comms(const moe_device_handle *h, const moe_grid *grid, moe_comm **device_world,
                            moe_comm **device_ep, moe_comm **device_pipe) {
    *device_world = *device_ep = *device_pipe = NULL;
    if (!grid->world || !h->cuda) return MOE_OK;
#if defined(MOE_HAVE_NCCL)
    /* NCCL communicators take their bootstraps' timeouts. Every rank makes
     * its stage's before its pipeline's, so each creation waits only on
     * ranks that have finished the ones before it. */
    void *stream = moe_cuda_stream(h->cuda);
    MOE_TRY(moe_comm_nccl_create(device_world, grid->dp, h->index, stream));
    moe_status st = moe_comm_split(device_ep, *device_world, grid->at.dp_rank / grid->ep_size, grid->at.dp_rank);
    /* The pipeline's messages go on a stream of their own: a receive
     * posted for a later op must not hold up the compute before it (the
     * trainer syncs the compute stream before it posts). */
    if (st == MOE_OK && grid->pipe) st = moe_comm_nccl_create(device_pipe, grid->pipe, h->index, NULL);
    if (st != MOE_OK) {
        if (*device_ep) moe_comm_free(*device_ep);
        moe_comm_free(*device_world);
        *device_world = *device_ep = NULL;
    }
    return st;
#else
    return moe_error(MOE_ERR_UNSUPPORTED, "device communicators: this build has no NCCL");
#endif
}

moe_status moe_host_view_pull(const moe_ops *ops, void **host, const void *dev, size_t bytes, const char *what) {
    if (ops->host_visible) return ops->sync();
    if (!*host && !(*host = malloc(bytes ? bytes : 1)))
        return moe_error(MOE_ERR_OUT_OF_MEMORY, "%s: host copy of %zu bytes", what, bytes);
    return ops->download(*host, dev, bytes);
}

moe_status moe_host_view_push(const moe_ops *ops, void *dev, const void *host, size_t bytes, const char *what) {
    if (ops->host_visible) return MOE_OK;
    if (!host) return moe_error(MOE_ERR_STATE, "%s: pushed before any pull", what);
    return ops->upload(dev, host, bytes);
}

void moe_device_close(moe_device_handle *h) {
#if defined(MOE_HAVE_CUDA)
    if (h->cuda) {
        moe_cuda_ops(NULL);
        moe_cuda_ctx_destroy(h->cuda);
    }
#endif
    h->cuda = NULL;
}
