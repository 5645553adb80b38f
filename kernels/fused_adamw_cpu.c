/* The CPU fused kernels, loaded by zerompi/fused_cpu.py through ctypes.
 *
 *   zmp_adamw_{f16,f32}      one pass over a shard slice: unscale + clip (grad_scale),
 *                            AdamW with bias correction (adamw_math.h), write master, m, v
 *                            and the parameter copy in the storage dtype
 *   zmp_grad_stats_{f16,f32} the pre-pass: sum of squares in float64 + non-finite flag
 *   zmp_sum_rows_{f16,f32}   the reduce-scatter's local sum (optim/reference.sum_rows_reference)
 *   zmp_quantize_*, zmp_dequant_sum_*   block quantization (quantize_cpu.h, included below)
 *   *_bf16                   the same on bfloat16 storage (bf16_cpu.h, included below)
 *
 * Build with -O3 -ffp-contract=off (never -ffast-math): the compiler vectorizes the
 * float32 loops, and without contraction or reassociation every element is rounded as
 * in the NumPy reference, whatever the vector width or the slice's alignment.
 * Storage dtypes: "f16" is IEEE binary16 passed as uint16_t bits.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "adamw_math.h"

#define ZMP_ABI_VERSION 4
#define ZMP_BLOCK 512       /* elements per block: the float32 scratch stays in L1 */
#define ZMP_LANES 32        /* independent float64 partial sums of the pre-pass */

/* How binary16 is converted: F16C instructions, else the compiler's _Float16, else
 * portable bit manipulation (all three round to nearest even). */
#if defined(ZMP_FP16_SOFT)
#define ZMP_FP16_PATH "soft"
#elif defined(__F16C__) && !defined(ZMP_FP16_NO_F16C)
#include <immintrin.h>
#define ZMP_USE_F16C 1
#define ZMP_FP16_PATH "f16c"
#elif defined(__FLT16_MAX__)
#define ZMP_USE_FLOAT16 1
#define ZMP_FP16_PATH "_Float16"
#else
#define ZMP_FP16_SOFT 1
#define ZMP_FP16_PATH "soft"
#endif

/* ---- binary16 <-> float32, round to nearest even, inf and NaN kept ------------------ */

static inline float bits_to_float(uint32_t b) { float f; memcpy(&f, &b, 4); return f; }
static inline uint32_t float_to_bits(float f) { uint32_t b; memcpy(&b, &f, 4); return b; }

/* Portable versions: used when neither F16C nor _Float16 is available, and tested
 * exhaustively against NumPy (tests/test_kernels.py builds them with -DZMP_FP16_SOFT). */
static inline float soft_half_to_float(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 0x1f)                                   /* inf, NaN (payload kept) */
        return bits_to_float(sign | 0x7f800000u | (man << 13));
    if (exp != 0)                                      /* normal: rebias 15 -> 127 */
        return bits_to_float(sign | ((exp + 112u) << 23) | (man << 13));
    return bits_to_float(sign | float_to_bits((float)man * 0x1p-24f));  /* subnormal: exact */
}

static inline uint16_t soft_float_to_half(float f)
{
    const uint32_t x = float_to_bits(f);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    const uint32_t ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u)                              /* NaN: quiet, top payload bits */
        return sign | 0x7e00u | (uint16_t)((ax >> 13) & 0x3ffu);
    if (ax >= 0x477ff000u)                             /* >= 65520 rounds to inf (and inf) */
        return sign | 0x7c00u;
    if (ax >= 0x38800000u) {                           /* normal half: >= 2**-14 */
        uint32_t r = ax - 0x38000000u;                 /* rebias 127 -> 15 */
        r += 0x0fffu + ((r >> 13) & 1u);               /* round to nearest even */
        return sign | (uint16_t)(r >> 13);
    }
    /* Subnormal or zero: adding 0.5 puts the value in [0.5, 1), whose float32 ulp is
     * 2**-24, the half subnormal step, so the addition itself rounds to nearest even. */
    return sign | (uint16_t)(float_to_bits(bits_to_float(ax) + 0.5f) - 0x3f000000u);
}

static inline float half_to_float(uint16_t h)
{
#if defined(ZMP_FP16_SOFT)
    return soft_half_to_float(h);
#elif defined(ZMP_USE_F16C)
    return _cvtsh_ss(h);
#else
    _Float16 x; memcpy(&x, &h, 2); return (float)x;
#endif
}

static inline uint16_t float_to_half(float f)
{
#if defined(ZMP_FP16_SOFT)
    return soft_float_to_half(f);
#elif defined(ZMP_USE_F16C)
    return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    _Float16 x = (_Float16)f; uint16_t h; memcpy(&h, &x, 2); return h;
#endif
}

/* Block conversions: F16C eight at a time (compilers do not vectorize the scalar form). */
static void halves_to_floats(float *restrict dst, const uint16_t *restrict src, int64_t n)
{
    int64_t i = 0;
#if defined(ZMP_USE_F16C)
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
#endif
    for (; i < n; i++)
        dst[i] = half_to_float(src[i]);
}

static void floats_to_halves(uint16_t *restrict dst, const float *restrict src, int64_t n)
{
    int64_t i = 0;
#if defined(ZMP_USE_F16C)
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; i < n; i++)
        dst[i] = float_to_half(src[i]);
}

/* ---- AdamW ------------------------------------------------------------------------ */

static void adamw_block(float *restrict master, float *restrict m, float *restrict v,
                        const float *restrict grad, int64_t n, const zmp_adamw_scalars s)
{
    for (int64_t i = 0; i < n; i++)
        zmp_adamw_element(grad[i], &master[i], &m[i], &v[i], s);
}

/* fp16 gradient in, fp16 parameter copy out; master, m, v float32; all n long. */
void zmp_adamw_f16(float *restrict master, float *restrict m, float *restrict v,
                   const uint16_t *restrict grad, uint16_t *restrict param_out, int64_t n,
                   const zmp_adamw_scalars *scalars)
{
    const zmp_adamw_scalars s = *scalars;
    float g[ZMP_BLOCK];
    for (int64_t lo = 0; lo < n; lo += ZMP_BLOCK) {
        const int64_t len = n - lo < ZMP_BLOCK ? n - lo : ZMP_BLOCK;
        halves_to_floats(g, grad + lo, len);
        adamw_block(master + lo, m + lo, v + lo, g, len, s);
        floats_to_halves(param_out + lo, master + lo, len);
    }
}

/* float32 gradient in, float32 parameter copy out. */
void zmp_adamw_f32(float *restrict master, float *restrict m, float *restrict v,
                   const float *restrict grad, float *restrict param_out, int64_t n,
                   const zmp_adamw_scalars *scalars)
{
    const zmp_adamw_scalars s = *scalars;
    for (int64_t i = 0; i < n; i++)
        param_out[i] = zmp_adamw_element(grad[i], &master[i], &m[i], &v[i], s);
}

/* ---- the pre-pass: sum of squares and a non-finite flag ---------------------------- */

/* Element i goes to partial sum i % ZMP_LANES, and the partial sums are added in a fixed
 * tree: the result depends on the values and their positions in the slice only, never on
 * the address (stage 0-1 slices live in the world buffer, stage 2-3 ones in the shard). */
static double combine_lanes(double *lanes)
{
    for (int w = ZMP_LANES / 2; w >= 1; w /= 2)
        for (int j = 0; j < w; j++)
            lanes[j] += lanes[j + w];
    return lanes[0];
}

/* Returns 1 when the sum of squares is inf or NaN (some element was), else 0. */
int zmp_grad_stats_f16(const uint16_t *restrict grad, int64_t n, double *sumsq)
{
    double lanes[ZMP_LANES] = {0};
    float g[ZMP_BLOCK];
    for (int64_t lo = 0; lo < n; lo += ZMP_BLOCK) {       /* ZMP_BLOCK % ZMP_LANES == 0 */
        const int64_t len = n - lo < ZMP_BLOCK ? n - lo : ZMP_BLOCK;
        halves_to_floats(g, grad + lo, len);
        int64_t i = 0;
        for (; i + ZMP_LANES <= len; i += ZMP_LANES)
            for (int j = 0; j < ZMP_LANES; j++) {
                const double x = g[i + j];
                lanes[j] += x * x;                        /* exact product: 22-bit significands */
            }
        for (int j = 0; i + j < len; j++) {
            const double x = g[i + j];
            lanes[j] += x * x;
        }
    }
    *sumsq = combine_lanes(lanes);
    return !isfinite(*sumsq);
}

int zmp_grad_stats_f32(const float *restrict grad, int64_t n, double *sumsq)
{
    double lanes[ZMP_LANES] = {0};
    int64_t i = 0;
    for (; i + ZMP_LANES <= n; i += ZMP_LANES)
        for (int j = 0; j < ZMP_LANES; j++) {
            const double x = grad[i + j];
            lanes[j] += x * x;                            /* exact product: 48 bits */
        }
    for (int j = 0; i + j < n; j++) {
        const double x = grad[i + j];
        lanes[j] += x * x;
    }
    *sumsq = combine_lanes(lanes);
    return !isfinite(*sumsq);
}

/* ---- the reduce-scatter's local sum ------------------------------------------------ */

/* out = cast([out +] scale * (rows[0] + rows[1] + ...)), float32 accumulation in row order,
 * the multiply only when do_scale (as the reference does it only when scale != 1).
 * rows: nrows pointers to k elements each, anywhere in memory (the reduce-scatter passes
 * its own slice where it lies, beside the received ones). out may be one of the rows (an
 * in-place all-reduce): every element is read from all rows before it is written.
 * With F16C (and so AVX) the rows are summed in registers, 16 elements at a time; the
 * portable form sums a block of ZMP_BLOCK elements row by row in a float32 scratch. */
#if defined(ZMP_USE_F16C)
static inline __m256 load8_f16(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline void store8_f16(uint16_t *p, __m256 x)
{
    _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
}
#endif

void zmp_sum_rows_f16(const uint16_t *const *rows, int64_t nrows, int64_t k, uint16_t *out,
                      float scale, int do_scale, int accumulate)
{
    int64_t i = 0;
#if defined(ZMP_USE_F16C)
    const __m256 s = _mm256_set1_ps(scale);
    for (; i + 16 <= k; i += 16) {
        __m256 a = load8_f16(rows[0] + i), b = load8_f16(rows[0] + i + 8);
        for (int64_t r = 1; r < nrows; r++) {
            a = _mm256_add_ps(a, load8_f16(rows[r] + i));
            b = _mm256_add_ps(b, load8_f16(rows[r] + i + 8));
        }
        if (do_scale) {
            a = _mm256_mul_ps(a, s);
            b = _mm256_mul_ps(b, s);
        }
        if (accumulate) {
            a = _mm256_add_ps(a, load8_f16(out + i));
            b = _mm256_add_ps(b, load8_f16(out + i + 8));
        }
        store8_f16(out + i, a);
        store8_f16(out + i + 8, b);
    }
    for (; i < k; i++) {
        float acc = half_to_float(rows[0][i]);
        for (int64_t r = 1; r < nrows; r++)
            acc = acc + half_to_float(rows[r][i]);
        if (do_scale)
            acc = acc * scale;
        if (accumulate)
            acc = acc + half_to_float(out[i]);
        out[i] = float_to_half(acc);
    }
#else
    float acc[ZMP_BLOCK], t[ZMP_BLOCK];
    for (; i < k; i += ZMP_BLOCK) {
        const int64_t len = k - i < ZMP_BLOCK ? k - i : ZMP_BLOCK;
        halves_to_floats(acc, rows[0] + i, len);
        for (int64_t r = 1; r < nrows; r++) {
            halves_to_floats(t, rows[r] + i, len);
            for (int64_t j = 0; j < len; j++)
                acc[j] = acc[j] + t[j];
        }
        if (do_scale)
            for (int64_t j = 0; j < len; j++)
                acc[j] = acc[j] * scale;
        if (accumulate) {
            halves_to_floats(t, out + i, len);
            for (int64_t j = 0; j < len; j++)
                acc[j] = acc[j] + t[j];
        }
        floats_to_halves(out + i, acc, len);
    }
#endif
}

void zmp_sum_rows_f32(const float *const *rows, int64_t nrows, int64_t k, float *out,
                      float scale, int do_scale, int accumulate)
{
    int64_t i = 0;
#if defined(ZMP_USE_F16C)
    const __m256 s = _mm256_set1_ps(scale);
    for (; i + 16 <= k; i += 16) {
        __m256 a = _mm256_loadu_ps(rows[0] + i), b = _mm256_loadu_ps(rows[0] + i + 8);
        for (int64_t r = 1; r < nrows; r++) {
            a = _mm256_add_ps(a, _mm256_loadu_ps(rows[r] + i));
            b = _mm256_add_ps(b, _mm256_loadu_ps(rows[r] + i + 8));
        }
        if (do_scale) {
            a = _mm256_mul_ps(a, s);
            b = _mm256_mul_ps(b, s);
        }
        if (accumulate) {
            a = _mm256_add_ps(a, _mm256_loadu_ps(out + i));
            b = _mm256_add_ps(b, _mm256_loadu_ps(out + i + 8));
        }
        _mm256_storeu_ps(out + i, a);
        _mm256_storeu_ps(out + i + 8, b);
    }
    for (; i < k; i++) {
        float acc = rows[0][i];
        for (int64_t r = 1; r < nrows; r++)
            acc = acc + rows[r][i];
        if (do_scale)
            acc = acc * scale;
        if (accumulate)
            acc = acc + out[i];
        out[i] = acc;
    }
#else
    float acc[ZMP_BLOCK];
    for (; i < k; i += ZMP_BLOCK) {
        const int64_t len = k - i < ZMP_BLOCK ? k - i : ZMP_BLOCK;
        memcpy(acc, rows[0] + i, (size_t)len * sizeof(float));
        for (int64_t r = 1; r < nrows; r++)
            for (int64_t j = 0; j < len; j++)
                acc[j] = acc[j] + rows[r][i + j];
        if (do_scale)
            for (int64_t j = 0; j < len; j++)
                acc[j] = acc[j] * scale;
        if (accumulate)
            for (int64_t j = 0; j < len; j++)
                acc[j] = acc[j] + out[i + j];
        memcpy(out + i, acc, (size_t)len * sizeof(float));
    }
#endif
}

/* ---- for tests and the banner ------------------------------------------------------ */

int zmp_abi_version(void) { return ZMP_ABI_VERSION; }

const char *zmp_fp16_path(void) { return ZMP_FP16_PATH; }

void zmp_halves_to_floats(float *dst, const uint16_t *src, int64_t n) { halves_to_floats(dst, src, n); }

void zmp_floats_to_halves(uint16_t *dst, const float *src, int64_t n) { floats_to_halves(dst, src, n); }

#include "bf16_cpu.h"
#include "quantize_cpu.h"
