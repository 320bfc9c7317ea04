/* dense_kernels.cuh: the device code of dense.cu's RMSNorm, RoPE,
 * cross-entropy and shared-expert gate, which dense.cu launches. It
 * includes nothing: the file that includes it provides the device
 * environment (kernels/cuda/common.cuh and kernels/moe_math.h on a GPU
 * build; tests/simt_emu.h, which runs it on the CPU, in
 * tests/test_dense_emulated.cpp). */
#ifndef MOE_KERNELS_CUDA_DENSE_KERNELS_CUH
#define MOE_KERNELS_CUDA_DENSE_KERNELS_CUH

#define GRID_STRIDE(i, n)                                                                          \
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < (n);                      \
         i += (int64_t)gridDim.x * blockDim.x)

/* ------------------------------------------------------------------ RMSNorm */

static __global__ void rmsnorm_forward_kernel(float *out, float *rstd, const float *inp,
                                              const float *weight, float eps, int64_t N,
                                              int64_t C) {
    __shared__ double partial[32];
    for (int64_t n = blockIdx.x; n < N; n += gridDim.x) {
        const float *x = inp + n * C;
        double ss = 0.0;
        for (int64_t c = threadIdx.x; c < C; c += blockDim.x) ss += (double)x[c] * x[c];
        ss = moe_block_sum(ss, partial);
        const float r = (float)(1.0 / sqrt(ss / (double)C + (double)eps));
        if (threadIdx.x == 0) rstd[n] = r;
        for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
            out[n * C + c] = weight[c] * (x[c] * r);
    }
}

/* dweight's sum over rows runs in parts of this many rows, each summed in
 * row order, then the parts in order. */
#define RMS_ROWS_PER_PART 256

static __global__ void rmsnorm_dx_kernel(float *dinp, const float *dout, const float *inp,
                                         const float *weight, const float *rstd, int64_t N,
                                         int64_t C) {
    __shared__ double partial[32];
    for (int64_t n = blockIdx.x; n < N; n += gridDim.x) {
        const float *x = inp + n * C, *dy = dout + n * C;
        const float r = rstd[n];
        double dot = 0.0;
        for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
            dot += (double)(dy[c] * weight[c]) * (x[c] * r);
        dot = moe_block_sum(dot, partial);
        const float mean_gx = (float)(dot / (double)C);
        for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
            dinp[n * C + c] += r * (dy[c] * weight[c] - (x[c] * r) * mean_gx);
    }
}

/* parts [n_parts, C]: part p of column c, rows in order; the grid's y
 * strides over the parts (a norm over each head of q has many rows). */
static __global__ void rmsnorm_dw_parts_kernel(double *parts, const float *dout, const float *inp,
                                               const float *rstd, int64_t N, int64_t C) {
    const int64_t n_parts = (N + RMS_ROWS_PER_PART - 1) / RMS_ROWS_PER_PART;
    for (int64_t p = blockIdx.y; p < n_parts; p += gridDim.y) {
        const int64_t n0 = p * RMS_ROWS_PER_PART, n1 = min(n0 + RMS_ROWS_PER_PART, N);
        for (int64_t c = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; c < C;
             c += (int64_t)gridDim.x * blockDim.x) {
            double acc = 0.0;
            for (int64_t n = n0; n < n1; n++)
                acc += (double)(dout[n * C + c] * (inp[n * C + c] * rstd[n]));
            parts[p * C + c] = acc;
        }
    }
}

static __global__ void rmsnorm_dw_sum_kernel(float *dweight, const double *parts, int64_t n_parts,
                                             int64_t C) {
    GRID_STRIDE(c, C) {
        double acc = 0.0;
        for (int64_t p = 0; p < n_parts; p++) acc += parts[p * C + c];
        dweight[c] += (float)acc;
    }
}

/* --------------------------------------------------------------------- RoPE */

/* Rotates every (i, i + hd/2) pair of x [B, T, H, hd] by +angle (sign 1)
 * or -angle (sign -1), in place. */
static __global__ void rope_rotate_kernel(float *x, const float *cos_t, const float *sin_t,
                                          int64_t B, int64_t T, int64_t H, int64_t hd, float sign) {
    const int64_t half = hd / 2;
    GRID_STRIDE(idx, B * T * H * half) {
        const int64_t i = idx % half, bth = idx / half, t = (bth / H) % T;
        float *x1 = x + bth * hd, *x2 = x1 + half;
        const float c = cos_t[t * half + i], s = sign * sin_t[t * half + i];
        const float a = x1[i], b = x2[i];
        x1[i] = a * c - b * s;
        x2[i] = b * c + a * s;
    }
}

/* ------------------------------------------------------------ cross-entropy */

/* One block per row: the max, then the sum of exponentials in double, each a
 * fixed block tree. */
static __global__ void crossentropy_forward_kernel(float *losses, double *lse, const float *logits,
                                                   const int32_t *targets, int64_t N, int64_t V) {
    __shared__ float max_part[32];
    __shared__ double sum_part[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int64_t n = blockIdx.x; n < N; n += gridDim.x) {
        const float *z = logits + n * V;
        float mx = -INFINITY;
        for (int64_t j = threadIdx.x; j < V; j += blockDim.x) mx = fmaxf(mx, z[j]);
        mx = moe_warp_max(mx);
        if (lane == 0) max_part[warp] = mx;
        __syncthreads();
        mx = lane < (int)(blockDim.x >> 5) ? max_part[lane] : -INFINITY;
        mx = moe_warp_max(mx);
        double sum = 0.0;
        for (int64_t j = threadIdx.x; j < V; j += blockDim.x) sum += (double)moe_expf(z[j] - mx);
        sum = moe_block_sum(sum, sum_part); /* its barrier also frees max_part */
        if (threadIdx.x == 0) {
            const double l = (double)mx + log(sum);
            lse[n] = l;
            losses[n] = targets[n] < 0 ? 0.0f : (float)(l - (double)z[targets[n]]);
        }
    }
}

/* A block per row, so no element divides its index by V. dlogits may be
 * logits: each element is read, then written, by one thread. */
static __global__ void crossentropy_backward_kernel(float *dlogits, const float *logits,
                                                    const double *lse, const int32_t *targets,
                                                    const float *dloss, float z_coef, int64_t N,
                                                    int64_t V) {
    for (int64_t n = blockIdx.x; n < N; n += gridDim.x) {
        const int32_t tgt = targets[n];
        const float w = tgt < 0 ? 0.0f : dloss[n];
        const double l = lse[n];
        const float wp = w * (1.0f + 2.0f * z_coef * (float)l); /* as on the CPU */
        const float *z = logits + n * V;
        float *dz = dlogits + n * V;
        for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
            float g = wp * moe_expf((float)((double)z[j] - l));
            if (j == tgt) g -= w;
            dz[j] = g;
        }
    }
}

/* ------------------------------------------------------ shared expert gate */

/* A block per token, so no element divides its index by d; every thread
 * makes the gate (one exponential), so no barrier waits for it. out may be
 * in: each element is read, then written, by one thread. */
static __global__ void sigmoid_gate_forward_kernel(float *out, float *gate, const float *in,
                                                   const float *logits, int64_t T, int64_t d) {
    for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
        const float g = moe_sigmoidf(logits[t]);
        for (int64_t j = threadIdx.x; j < d; j += blockDim.x) out[t * d + j] = g * in[t * d + j];
        if (threadIdx.x == 0) gate[t] = g;
    }
}

/* The dot sums in double, as the CPU's does: the two add in different
 * orders, and in double that shows far below the float result's rounding.
 * The kernel reads two floats per product and is bound by memory, so the
 * double adds cost nothing that shows. din may be dout: each element is
 * read, then written, by one thread, and the gate is known before the sum. */
static __global__ void sigmoid_gate_backward_kernel(float *din, float *dlogits, const float *dout,
                                                    const float *out, const float *gate, int64_t T,
                                                    int64_t d) {
    __shared__ double partial[32];
    for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
        const float g = gate[t];
        double dot = 0.0;
        for (int64_t j = threadIdx.x; j < d; j += blockDim.x) {
            const float dy = dout[t * d + j];
            dot += (double)dy * out[t * d + j];
            din[t * d + j] = g * dy;
        }
        dot = moe_block_sum(dot, partial);
        if (threadIdx.x == 0) dlogits[t] = (float)((1.0 - (double)g) * dot);
    }
}

#endif /* MOE_KERNELS_CUDA_DENSE_KERNELS_CUH */
