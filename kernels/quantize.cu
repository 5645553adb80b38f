// Block quantization on the GPU (quant_math.h), loaded by zerompi/optim/cuda.py through
// cupy.RawModule (NVRTC, --fmad=false), and compiled by the tests with nvcc.
//
//   zmp_quantize_f16 / _bf16 / _f32    one CUDA block per quantization block: the block's max |x|
//       (NaN sticky) by a shared-memory tree, then every thread quantizes its elements
//       (int4: a pair per byte). The same bits as the C kernels and the NumPy reference:
//       a max is exact in any order, the rest is per element.
//   zmp_dequant_sum_f16 / _bf16 / _f32 out = cast([out +] scale * sum_r dequantized(row r)), float32
//       in row order, one element per thread (grid-stride); rows given as pointer arrays.
#include "cuda_half.h"
#include "quant_math.h"

#define ZMP_QTHREADS 256     // threads per block (a power of two: the max tree assumes it)

template <typename T>
__device__ __forceinline__ void quantize_block(const T *x, long long n, int bits, long long block,
                                               unsigned char *q, float *scales)
{
    __shared__ float part[ZMP_QTHREADS];
    const long long b0 = (long long)blockIdx.x * block;
    const long long len = n - b0 < block ? n - b0 : block;
    float amax = 0.0f;
    for (long long i = threadIdx.x; i < len; i += blockDim.x)
        amax = zmp_q_absmax(amax, to_float(x[b0 + i]));
    part[threadIdx.x] = amax;
    __syncthreads();
    for (int w = ZMP_QTHREADS / 2; w > 0; w /= 2) {
        if (threadIdx.x < w)
            part[threadIdx.x] = zmp_q_absmax(part[threadIdx.x], part[threadIdx.x + w]);
        __syncthreads();
    }
    const float qmax = bits == 4 ? 7.0f : 127.0f;
    const float scale = part[0] / qmax;
    if (threadIdx.x == 0)
        scales[blockIdx.x] = scale;
    const int zero = zmp_q_zero_block(scale);
    if (bits == 8) {
        for (long long i = threadIdx.x; i < len; i += blockDim.x)
            q[b0 + i] = (unsigned char)(signed char)(zero ? 0 : zmp_q_value(to_float(x[b0 + i]), scale, qmax));
    } else {                 // block is even: a block's pairs are whole bytes
        for (long long j = threadIdx.x; 2 * j < len; j += blockDim.x) {
            const long long e = b0 + 2 * j;
            const int lo = zero ? 0 : zmp_q_value(to_float(x[e]), scale, qmax);
            const int hi = (zero || 2 * j + 1 >= len) ? 0 : zmp_q_value(to_float(x[e + 1]), scale, qmax);
            q[e >> 1] = (unsigned char)((lo & 0xf) | ((hi & 0xf) << 4));
        }
    }
}

extern "C" __global__ void zmp_quantize_f16(const zmp_half *x, long long n, int bits, long long block,
                                            unsigned char *q, float *scales)
{
    quantize_block(x, n, bits, block, q, scales);
}

extern "C" __global__ void zmp_quantize_bf16(const zmp_bf16 *x, long long n, int bits, long long block,
                                             unsigned char *q, float *scales)
{
    quantize_block(x, n, bits, block, q, scales);
}

extern "C" __global__ void zmp_quantize_f32(const float *x, long long n, int bits, long long block,
                                            unsigned char *q, float *scales)
{
    quantize_block(x, n, bits, block, q, scales);
}

__device__ __forceinline__ float deq(const unsigned char *q, const float *scales, long long i, int bits,
                                     long long block)
{
    const int v = bits == 4 ? zmp_q_int4(q, i) : (int)(signed char)q[i];
    return (float)v * scales[i / block];
}

template <typename T>
__device__ __forceinline__ void dequant_sum(const unsigned long long *q_rows, const unsigned long long *scale_rows,
                                            int nrows, long long n, int bits, long long block, T *out,
                                            float scale, int do_scale, int accumulate)
{
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float acc = deq((const unsigned char *)q_rows[0], (const float *)scale_rows[0], i, bits, block);
        for (int r = 1; r < nrows; r++)
            acc = acc + deq((const unsigned char *)q_rows[r], (const float *)scale_rows[r], i, bits, block);
        if (do_scale)
            acc = acc * scale;
        if (accumulate)
            acc = acc + to_float(out[i]);
        store_as(&out[i], acc);
    }
}

extern "C" __global__ void zmp_dequant_sum_f16(const unsigned long long *q_rows, const unsigned long long *scale_rows,
                                               int nrows, long long n, int bits, long long block, zmp_half *out,
                                               float scale, int do_scale, int accumulate)
{
    dequant_sum(q_rows, scale_rows, nrows, n, bits, block, out, scale, do_scale, accumulate);
}

extern "C" __global__ void zmp_dequant_sum_bf16(const unsigned long long *q_rows, const unsigned long long *scale_rows,
                                                int nrows, long long n, int bits, long long block, zmp_bf16 *out,
                                                float scale, int do_scale, int accumulate)
{
    dequant_sum(q_rows, scale_rows, nrows, n, bits, block, out, scale, do_scale, accumulate);
}

extern "C" __global__ void zmp_dequant_sum_f32(const unsigned long long *q_rows, const unsigned long long *scale_rows,
                                               int nrows, long long n, int bits, long long block, float *out,
                                               float scale, int do_scale, int accumulate)
{
    dequant_sum(q_rows, scale_rows, nrows, n, bits, block, out, scale, do_scale, accumulate);
}
