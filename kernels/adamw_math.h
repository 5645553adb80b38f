/* The per-element AdamW math: the one definition shared by the CUDA kernel
 * (fused_adamw.cu) and the host C kernel (fused_adamw_cpu.c).
 *
 * It reproduces zerompi/optim.py's adamw_reference operation by operation, in float32
 * and in the same order. Compile it without contraction of a*b+c into an FMA
 * (gcc/clang: -ffp-contract=off; nvcc/NVRTC: --fmad=false): every operation is then
 * rounded exactly as NumPy rounds it, so the fused kernels agree with the reference to
 * 0 ulp, and an element's result does not depend on its position in the slice (which
 * keeps ZeRO stages 0-3 bit-identical: each stage updates different slice boundaries).
 */
#ifndef ZEROMPI_ADAMW_MATH_H
#define ZEROMPI_ADAMW_MATH_H

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define ZMP_HD __host__ __device__ __forceinline__ /* sqrtf, / : IEEE unless --use_fast_math */
#else
#include <math.h>
#define ZMP_HD static inline
#endif

/* The per-step constants, each already rounded to float32 on the host
 * (optim.AdamWScalars: same fields, same order). */
typedef struct zmp_adamw_scalars {
    float lr;
    float beta1;
    float one_minus_beta1;
    float beta2;
    float one_minus_beta2;
    float inv_bias1;     /* 1 / (1 - beta1**step) */
    float inv_bias2;     /* 1 / (1 - beta2**step) */
    float eps;
    float weight_decay;
    float grad_scale;    /* clip_coef / loss_scale: stored gradient -> true gradient */
} zmp_adamw_scalars;

/* One element: reads the stored gradient (already widened to float32) and the old
 * master, m and v; writes the new master, m and v. Returns the new master, which the
 * caller casts to the storage dtype of the parameter copy. */
ZMP_HD float zmp_adamw_element(float grad, float *master, float *m, float *v, const zmp_adamw_scalars s)
{
    const float g = grad * s.grad_scale;
    const float m_new = s.beta1 * *m + s.one_minus_beta1 * g;
    const float v_new = s.beta2 * *v + s.one_minus_beta2 * (g * g);
    const float denom = sqrtf(v_new * s.inv_bias2) + s.eps;
    const float update = (m_new * s.inv_bias1) / denom + s.weight_decay * *master;
    const float master_new = *master - s.lr * update;
    *m = m_new;
    *v = v_new;
    *master = master_new;
    return master_new;
}

#endif /* ZEROMPI_ADAMW_MATH_H */
