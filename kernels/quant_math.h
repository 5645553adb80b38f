/* Block quantization, one element at a time: the math every implementation shares (the C
 * kernels in quantize_cpu.h, the CUDA ones in quantize.cu, and optim/reference.py's NumPy
 * reference, which does the same float32 operations in the same order).
 *
 *   a block of B elements x[i] (float32 after reading the storage dtype):
 *     amax  = max |x[i]|, NaN and inf propagate            (zmp_q_absmax)
 *     scale = amax / qmax, qmax = 127 (int8) or 7 (int4)    (float32 division)
 *     q[i]  = clamp(rint(x[i] / scale), -qmax, qmax)        (round half to even)
 *             0 for the whole block when scale is 0, inf or NaN
 *   dequantized: (float)q[i] * scale; 0 * inf and 0 * NaN are NaN, so a block that held a
 *   non-finite value dequantizes to NaN and the step's non-finite check still sees it.
 *
 * int4: two elements per byte, element 2j in the low nibble, 2j+1 in the high one, each as a
 * 4-bit two's complement number.
 */
#ifndef ZMP_QUANT_MATH_H
#define ZMP_QUANT_MATH_H

#ifdef __CUDACC__
#define ZMP_QD __device__ __forceinline__
#else
#define ZMP_QD static inline
#endif

/* The running max of |x| over a block, with NaN sticky (a comparison with NaN is false). */
ZMP_QD float zmp_q_absmax(float amax, float x)
{
    const float a = x < 0.0f ? -x : x;
    if (amax != amax)
        return amax;
    return (a > amax || a != a) ? a : amax;
}

/* 1 when a block of this scale is stored as zeros (scale 0, inf or NaN). */
ZMP_QD int zmp_q_zero_block(float scale)
{
    return !(scale > 0.0f && scale - scale == 0.0f);
}

ZMP_QD int zmp_q_value(float x, float scale, float qmax)
{
    float q = rintf(x / scale);
    q = q > qmax ? qmax : q;
    q = q < -qmax ? -qmax : q;
    return (int)q;
}

/* The 4-bit field of element i of a packed int4 array, sign-extended. */
ZMP_QD int zmp_q_int4(const unsigned char *q, long long i)
{
    const int nib = (q[i >> 1] >> ((i & 1) * 4)) & 0xf;
    return nib >= 8 ? nib - 16 : nib;
}

#endif
