/* The GPT's elementwise work on the CPU, loaded by zerompi/train/model_kernels.py through ctypes.
 *
 *   zgpt_layernorm_fwd_*     y = (x - mean) * rstd * g + b per row; keeps mean and rstd
 *   zgpt_layernorm_bwd_*     dx (+ a residual gradient), dg and db, xhat recomputed from x
 *   zgpt_gelu_fwd_*          f += bias, y = tanh-GELU(f): one pass
 *   zgpt_gelu_bwd_*          dz = dy * GELU'(f) in place, and db = column sums of dz: one pass
 *   zgpt_softmax_causal_fwd_*  scores -> causal softmax(scale * scores) in place, zeros above
 *                            the diagonal (only the lower triangle is computed)
 *   zgpt_softmax_causal_bwd_*  d scores = scale * att * (datt - rowsum(att * datt)) in place
 *   zgpt_bias_residual_*     out = res + (out + b): a linear layer's bias and the residual add
 *
 * Suffix _f32 (float) or _f64 (double). Every operation is the NumPy reference's
 * (zerompi/train/models/gpt_numpy.py), in its order, so the results differ from it only where
 * a sum runs in another order, or (float) where exp and tanh are this file's polynomial
 * rather than libm's: a few float32 ulp. float64 uses libm's exp and tanh (the float64
 * finite-difference tests run through this file).
 *
 * Build with -O3 -ffp-contract=off (never -ffast-math). Row sums go to ZGPT_LANES partial
 * sums by index within the row, added in a fixed tree, so the compiler vectorizes them and
 * every result depends on the values only, never on where the rows lie in memory.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define ZGPT_ABI_VERSION 1
#define ZGPT_LANES 16

int zgpt_abi_version(void) { return ZGPT_ABI_VERSION; }

/* exp for float32 inputs in [-87, 88] (clamped): Cephes' expf, about 1 ulp. Written so that
 * the compiler vectorizes it (no branches, no libm call). */
static inline float zgpt_expf(float x)
{
    x = x < -87.0f ? -87.0f : x;
    x = x > 88.0f ? 88.0f : x;
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;   /* round(x / ln 2): 1.5 * 2^23 */
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* tanh(u) = sign(u) (1 - 2 / (1 + exp(2|u|))): near +-1, where the GELU gradient reads
 * 1 - t^2, the result is within an ulp of 1 on both sides. |u| >= 10 gives +-1 exactly, as
 * float32 tanh does (at 9, 1 - tanh is still above half an ulp of 1). Absolute error about
 * 1e-7 near 0, where GELU adds 1 to it. */
static inline float zgpt_tanhf(float u)
{
    float a = fabsf(u);
    a = a > 10.0f ? 10.0f : a;
    return copysignf(1.0f - 2.0f / (1.0f + zgpt_expf(2.0f * a)), u);
}

/* ---- float32 ----------------------------------------------------------------------------- */
#define REAL float
#define SFX(name) name##_f32
#define EXP(x) zgpt_expf(x)
#define TANH(x) zgpt_tanhf(x)
#define SQRT(x) sqrtf(x)
#define LIT(x) ((float)(x))
#include "gpt_cpu_body.h"
#undef REAL
#undef SFX
#undef EXP
#undef TANH
#undef SQRT
#undef LIT

/* ---- float64 ----------------------------------------------------------------------------- */
#define REAL double
#define SFX(name) name##_f64
#define EXP(x) exp(x)
#define TANH(x) tanh(x)
#define SQRT(x) sqrt(x)
#define LIT(x) ((double)(x))
#include "gpt_cpu_body.h"
