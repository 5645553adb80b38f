// The GPU fused AdamW step and its gradient pre-pass, loaded by zerompi/kernels_gpu.py
// through cupy.RawModule (NVRTC, --fmad=false), and compiled by the tests with nvcc.
//
//   zmp_adamw_f16 / _bf16 / _f32    one pass over a shard slice: unscale + clip
//       (grad_scale), AdamW with bias correction (adamw_math.h), write master, m, v and
//       the parameter copy. Grid-stride loop; with vec != 0 (every pointer 16-byte
//       aligned, checked on the host) 8 elements per thread step through 16-byte loads
//       and stores, then a scalar tail; correct for any n.
//   zmp_grad_sumsq_f16 / _bf16 / _f32 + zmp_sum_partials    the pre-pass: sum of squares in
//       float64 (block partials, then one block adds them in a fixed tree) and the
//       non-finite flag, from one read of the gradient.
//
// Storage "f16" is IEEE binary16 passed as unsigned short bits, "bf16" bfloat16 as a struct of
// its bits (cuda_half.h); no CUDA header is needed under NVRTC.
#include "adamw_math.h"

#define ZMP_VEC 8            // elements per vector step: 16 B of fp16, 2 x 16 B of fp32
#define ZMP_THREADS 256      // threads per block of every kernel here (a power of two)

#include "cuda_half.h"

// Eight consecutive elements starting at element 8 * c, through 16-byte accesses.
__device__ __forceinline__ void load8(const float *p, long long c, float r[ZMP_VEC])
{
    const float4 a = reinterpret_cast<const float4 *>(p)[2 * c];
    const float4 b = reinterpret_cast<const float4 *>(p)[2 * c + 1];
    r[0] = a.x; r[1] = a.y; r[2] = a.z; r[3] = a.w;
    r[4] = b.x; r[5] = b.y; r[6] = b.z; r[7] = b.w;
}

__device__ __forceinline__ void load8(const zmp_half *p, long long c, float r[ZMP_VEC])
{
    const uint4 w = reinterpret_cast<const uint4 *>(p)[c];
    const unsigned int words[4] = {w.x, w.y, w.z, w.w};
    for (int j = 0; j < 4; j++) {
        r[2 * j] = zmp_h2f((zmp_half)(words[j] & 0xffffu));       // little-endian: low half first
        r[2 * j + 1] = zmp_h2f((zmp_half)(words[j] >> 16));
    }
}

__device__ __forceinline__ void load8(const zmp_bf16 *p, long long c, float r[ZMP_VEC])
{
    const uint4 w = reinterpret_cast<const uint4 *>(p)[c];
    const unsigned int words[4] = {w.x, w.y, w.z, w.w};
    for (int j = 0; j < 4; j++) {
        r[2 * j] = __uint_as_float(words[j] << 16);
        r[2 * j + 1] = __uint_as_float(words[j] & 0xffff0000u);
    }
}

__device__ __forceinline__ void store8(float *p, long long c, const float r[ZMP_VEC])
{
    reinterpret_cast<float4 *>(p)[2 * c] = make_float4(r[0], r[1], r[2], r[3]);
    reinterpret_cast<float4 *>(p)[2 * c + 1] = make_float4(r[4], r[5], r[6], r[7]);
}

__device__ __forceinline__ void store8(zmp_half *p, long long c, const float r[ZMP_VEC])
{
    unsigned int words[4];
    for (int j = 0; j < 4; j++)
        words[j] = (unsigned int)zmp_f2h(r[2 * j]) | ((unsigned int)zmp_f2h(r[2 * j + 1]) << 16);
    reinterpret_cast<uint4 *>(p)[c] = make_uint4(words[0], words[1], words[2], words[3]);
}

__device__ __forceinline__ void store8(zmp_bf16 *p, long long c, const float r[ZMP_VEC])
{
    unsigned int words[4];
    for (int j = 0; j < 4; j++)
        words[j] = (unsigned int)zmp_f2b(r[2 * j]).bits | ((unsigned int)zmp_f2b(r[2 * j + 1]).bits << 16);
    reinterpret_cast<uint4 *>(p)[c] = make_uint4(words[0], words[1], words[2], words[3]);
}

template <typename T>
__device__ __forceinline__ void adamw_slice(float *master, float *m, float *v, const T *grad, T *param_out,
                                            long long n, int vec, const zmp_adamw_scalars s)
{
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long nvec = vec ? n / ZMP_VEC : 0;
    for (long long c = tid; c < nvec; c += stride) {
        float g[ZMP_VEC], w[ZMP_VEC], mm[ZMP_VEC], vv[ZMP_VEC], out[ZMP_VEC];
        load8(grad, c, g);
        load8(master, c, w);
        load8(m, c, mm);
        load8(v, c, vv);
        for (int j = 0; j < ZMP_VEC; j++)
            out[j] = zmp_adamw_element(g[j], &w[j], &mm[j], &vv[j], s);
        store8(master, c, w);
        store8(m, c, mm);
        store8(v, c, vv);
        store8(param_out, c, out);
    }
    for (long long i = nvec * ZMP_VEC + tid; i < n; i += stride)
        store_as(&param_out[i], zmp_adamw_element(to_float(grad[i]), &master[i], &m[i], &v[i], s));
}

#define ZMP_SCALAR_PARAMS                                                                  \
    float lr, float beta1, float one_minus_beta1, float beta2, float one_minus_beta2,     \
        float inv_bias1, float inv_bias2, float eps, float weight_decay, float grad_scale
#define ZMP_SCALARS                                                                        \
    {lr, beta1, one_minus_beta1, beta2, one_minus_beta2, inv_bias1, inv_bias2, eps,       \
     weight_decay, grad_scale}

extern "C" __global__ void zmp_adamw_f16(float *master, float *m, float *v, const zmp_half *grad,
                                         zmp_half *param_out, long long n, int vec, ZMP_SCALAR_PARAMS)
{
    const zmp_adamw_scalars s = ZMP_SCALARS;
    adamw_slice(master, m, v, grad, param_out, n, vec, s);
}

extern "C" __global__ void zmp_adamw_bf16(float *master, float *m, float *v, const zmp_bf16 *grad,
                                          zmp_bf16 *param_out, long long n, int vec, ZMP_SCALAR_PARAMS)
{
    const zmp_adamw_scalars s = ZMP_SCALARS;
    adamw_slice(master, m, v, grad, param_out, n, vec, s);
}

extern "C" __global__ void zmp_adamw_f32(float *master, float *m, float *v, const float *grad,
                                         float *param_out, long long n, int vec, ZMP_SCALAR_PARAMS)
{
    const zmp_adamw_scalars s = ZMP_SCALARS;
    adamw_slice(master, m, v, grad, param_out, n, vec, s);
}

// ---- the pre-pass ----------------------------------------------------------------------

// Adds a block's per-thread values in a fixed tree; thread 0 gets the total.
__device__ double block_sum(double x)
{
    __shared__ double part[ZMP_THREADS];
    part[threadIdx.x] = x;
    __syncthreads();
    for (int w = ZMP_THREADS / 2; w > 0; w /= 2) {
        if (threadIdx.x < w)
            part[threadIdx.x] += part[threadIdx.x + w];
        __syncthreads();
    }
    return part[0];
}

// Thread t adds chunks t, t + stride, ... of 8 elements, each chunk in index order, so the
// order depends on n and the launch configuration only: vec (alignment) changes how the
// chunk is read, not the sum. partials[blockIdx.x] receives the block's sum.
template <typename T>
__device__ __forceinline__ void sumsq_slice(const T *grad, long long n, int vec, double *partials)
{
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long nchunks = (n + ZMP_VEC - 1) / ZMP_VEC;
    double acc = 0.0;
    for (long long c = tid; c < nchunks; c += stride) {
        float g[ZMP_VEC];
        if (vec && (c + 1) * ZMP_VEC <= n) {
            load8(grad, c, g);
        } else {
            for (int j = 0; j < ZMP_VEC; j++)
                g[j] = c * ZMP_VEC + j < n ? to_float(grad[c * ZMP_VEC + j]) : 0.0f;
        }
        for (int j = 0; j < ZMP_VEC; j++)
            acc += (double)g[j] * (double)g[j];
    }
    const double total = block_sum(acc);
    if (threadIdx.x == 0)
        partials[blockIdx.x] = total;
}

extern "C" __global__ void zmp_grad_sumsq_f16(const zmp_half *grad, long long n, int vec, double *partials)
{
    sumsq_slice(grad, n, vec, partials);
}

extern "C" __global__ void zmp_grad_sumsq_bf16(const zmp_bf16 *grad, long long n, int vec, double *partials)
{
    sumsq_slice(grad, n, vec, partials);
}

extern "C" __global__ void zmp_grad_sumsq_f32(const float *grad, long long n, int vec, double *partials)
{
    sumsq_slice(grad, n, vec, partials);
}

// One block: out[0] = sum of the partials (fixed order), out[1] = 1.0 if it is inf or NaN.
extern "C" __global__ void zmp_sum_partials(const double *partials, int count, double *out)
{
    double acc = 0.0;
    for (int i = threadIdx.x; i < count; i += blockDim.x)
        acc += partials[i];
    const double total = block_sum(acc);
    if (threadIdx.x == 0) {
        out[0] = total;
        out[1] = total - total == 0.0 ? 0.0 : 1.0;   // inf - inf and NaN - NaN are NaN
    }
}
