/* Block quantization on the CPU (quant_math.h), included by fused_adamw_cpu.c: it shares that
 * file's binary16 conversions and is built into the same library.
 *
 *   zmp_quantize_{f16,f32,bf16}(x, n, bits, block, q, scales)
 *       x: n elements; q: n bytes (int8) or (n + 1) / 2 bytes (int4); scales: one float per
 *       block of `block` elements (the last block may be shorter)
 *   zmp_dequant_sum_{f16,f32,bf16}(q_rows, scale_rows, nrows, n, bits, block, out, scale, do_scale, accumulate)
 *       out = cast([out +] scale * sum_r dequantized(row r)), float32 in row order: the
 *       reduce-scatter's local sum (sum_rows) over quantized rows; one row dequantizes.
 *
 * Speed: every loop runs over a chunk of float32 (converted from the storage dtype eight at a
 * time, F16C where there is one) with one scale per stretch of a block, so the compiler
 * vectorizes the division, rounding, clamping, widening and sums; the absolute maximum of a
 * block is AVX2's max where there is AVX2 (a NaN in the block is noticed on the side: the block
 * then has a NaN scale and is stored as zeros, as quant_math.h says). Each element still goes
 * through the same float32 operations in the same order as zmp_q_value / zmp_q_absmax, so the
 * values and the non-NaN scales equal the NumPy reference bit for bit.
 */
#include "quant_math.h"
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define ZMP_QCHUNK 512      /* elements per chunk (a power of two: whole blocks up to 512) */

typedef void (*zmp_to_floats)(float *restrict, const void *restrict, int64_t);

static void f32s_to_floats(float *restrict dst, const void *restrict src, int64_t n)
{
    memcpy(dst, src, (size_t)n * sizeof(float));
}

static void f16s_to_floats(float *restrict dst, const void *restrict src, int64_t n)
{
    halves_to_floats(dst, (const uint16_t *)src, n);
}

static void bf16s_to_floats_any(float *restrict dst, const void *restrict src, int64_t n)
{
    bf16s_to_floats(dst, (const uint16_t *)src, n);
}

/* max |b[i]| over a stretch; NaN when one of them is NaN (the block is then stored as zeros). */
static float zmp_q_stretch_absmax(const float *restrict b, int64_t len)
{
    int64_t i = 0;
    float amax = 0.0f;
    int nan = 0;
#if defined(__AVX2__)
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 vmax = _mm256_setzero_ps(), vnan = _mm256_setzero_ps();
    for (; i + 8 <= len; i += 8) {
        const __m256 a = _mm256_and_ps(_mm256_loadu_ps(b + i), absmask);
        vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
        vmax = _mm256_max_ps(vmax, a);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, vmax);
    for (int j = 0; j < 8; j++)
        amax = lanes[j] > amax ? lanes[j] : amax;
    nan = _mm256_movemask_ps(vnan) != 0;
#endif
    for (; i < len; i++)
        amax = zmp_q_absmax(amax, b[i]);
    return nan ? NAN : amax;
}

/* The int8 values of a stretch of one block (zeros when the block's scale is not finite > 0). */
static void zmp_q_stretch_values(const float *restrict b, int64_t len, float scale, float qmax, int8_t *restrict out)
{
    if (zmp_q_zero_block(scale)) {
        memset(out, 0, (size_t)len);
        return;
    }
    for (int64_t i = 0; i < len; i++) {          /* vectorizes: division, rint, clamp, narrowing */
        float q = rintf(b[i] / scale);
        q = q > qmax ? qmax : q;
        q = q < -qmax ? -qmax : q;
        out[i] = (int8_t)(int)q;
    }
}

/* Store m int8 values at element `at` (even, or the array's start) of q, int8 or packed int4. */
static void zmp_q_store(uint8_t *restrict q, int64_t at, const int8_t *restrict v, int64_t m, int bits)
{
    if (bits == 8) {
        memcpy(q + at, v, (size_t)m);
        return;
    }
    uint8_t *restrict p = q + (at >> 1);
    const int64_t pairs = m >> 1;
    for (int64_t j = 0; j < pairs; j++)
        p[j] = (uint8_t)((v[2 * j] & 0xf) | ((v[2 * j + 1] & 0xf) << 4));
    if (m & 1)
        p[pairs] = (uint8_t)(v[m - 1] & 0xf);
}

static void zmp_quantize_any(const void *x, size_t itemsize, zmp_to_floats to_floats, int64_t n, int bits,
                             int64_t block, uint8_t *restrict q, float *restrict scales)
{
    const float qmax = bits == 4 ? 7.0f : 127.0f;
    float buf[ZMP_QCHUNK];
    int8_t vals[ZMP_QCHUNK];
    const char *src = (const char *)x;
    if (block <= ZMP_QCHUNK) {                 /* whole blocks in each chunk: one conversion */
        for (int64_t c0 = 0; c0 < n; c0 += ZMP_QCHUNK) {
            const int64_t m = n - c0 < ZMP_QCHUNK ? n - c0 : ZMP_QCHUNK;
            to_floats(buf, src + (size_t)c0 * itemsize, m);
            for (int64_t b0 = 0; b0 < m; b0 += block) {
                const int64_t len = m - b0 < block ? m - b0 : block;
                const float scale = zmp_q_stretch_absmax(buf + b0, len) / qmax;
                scales[(c0 + b0) / block] = scale;
                zmp_q_stretch_values(buf + b0, len, scale, qmax, vals + b0);
            }
            zmp_q_store(q, c0, vals, m, bits);
        }
        return;
    }
    for (int64_t b0 = 0; b0 < n; b0 += block) {  /* a block over several chunks: its max first */
        const int64_t len = n - b0 < block ? n - b0 : block;
        float amax = 0.0f;
        for (int64_t c0 = 0; c0 < len; c0 += ZMP_QCHUNK) {
            const int64_t m = len - c0 < ZMP_QCHUNK ? len - c0 : ZMP_QCHUNK;
            to_floats(buf, src + (size_t)(b0 + c0) * itemsize, m);
            amax = zmp_q_absmax(amax, zmp_q_stretch_absmax(buf, m));
        }
        const float scale = amax / qmax;
        scales[b0 / block] = scale;
        for (int64_t c0 = 0; c0 < len; c0 += ZMP_QCHUNK) {
            const int64_t m = len - c0 < ZMP_QCHUNK ? len - c0 : ZMP_QCHUNK;
            to_floats(buf, src + (size_t)(b0 + c0) * itemsize, m);
            zmp_q_stretch_values(buf, m, scale, qmax, vals);
            zmp_q_store(q, b0 + c0, vals, m, bits);
        }
    }
}

void zmp_quantize_f16(const uint16_t *restrict x, int64_t n, int bits, int64_t block, uint8_t *restrict q,
                      float *restrict scales)
{
    zmp_quantize_any(x, 2, f16s_to_floats, n, bits, block, q, scales);
}

void zmp_quantize_f32(const float *restrict x, int64_t n, int bits, int64_t block, uint8_t *restrict q,
                      float *restrict scales)
{
    zmp_quantize_any(x, 4, f32s_to_floats, n, bits, block, q, scales);
}

void zmp_quantize_bf16(const uint16_t *restrict x, int64_t n, int bits, int64_t block, uint8_t *restrict q,
                       float *restrict scales)
{
    zmp_quantize_any(x, 2, bf16s_to_floats_any, n, bits, block, q, scales);
}

/* The int8 values of elements lo .. lo + m - 1 of a row (lo is a multiple of ZMP_QCHUNK: even). */
static void zmp_q_load(int8_t *restrict v, const uint8_t *restrict q, int64_t lo, int64_t m, int bits)
{
    if (bits == 8) {
        memcpy(v, q + lo, (size_t)m);
        return;
    }
    const uint8_t *restrict p = q + (lo >> 1);
    const int64_t pairs = m >> 1;
    for (int64_t j = 0; j < pairs; j++) {        /* each nibble sign-extended (zmp_q_int4) */
        v[2 * j] = (int8_t)((int8_t)(p[j] << 4) >> 4);
        v[2 * j + 1] = (int8_t)((int8_t)p[j] >> 4);
    }
    if (m & 1)
        v[m - 1] = (int8_t)((int8_t)(p[pairs] << 4) >> 4);
}

/* acc[0..m) = [acc +] the dequantized elements lo .. lo + m - 1 of rows 0 .. nrows-1, in row order. */
static void dequant_sum_f32acc(float *restrict acc, const uint8_t *const *q_rows, const float *const *scale_rows,
                               int64_t nrows, int64_t lo, int64_t m, int bits, int64_t block)
{
    int8_t v[ZMP_QCHUNK];
    for (int64_t r = 0; r < nrows; r++) {
        zmp_q_load(v, q_rows[r], lo, m, bits);
        for (int64_t s0 = 0; s0 < m;) {          /* stretches of one block: one scale each */
            const int64_t bi = (lo + s0) / block;
            const int64_t end = (bi + 1) * block - lo < m ? (bi + 1) * block - lo : m;
            const float s = scale_rows[r][bi];
            if (r == 0)
                for (int64_t i = s0; i < end; i++)
                    acc[i] = (float)v[i] * s;
            else
                for (int64_t i = s0; i < end; i++)
                    acc[i] = acc[i] + (float)v[i] * s;
            s0 = end;
        }
    }
}

/* acc = [prev +] scale * acc, elementwise, as the reference does it. */
static void zmp_q_finish(float *restrict acc, const float *restrict prev, int64_t m, float scale, int do_scale,
                         int accumulate)
{
    if (do_scale)
        for (int64_t i = 0; i < m; i++)
            acc[i] = acc[i] * scale;
    if (accumulate)
        for (int64_t i = 0; i < m; i++)
            acc[i] = acc[i] + prev[i];
}

void zmp_dequant_sum_f16(const uint8_t *const *q_rows, const float *const *scale_rows, int64_t nrows, int64_t n,
                         int bits, int64_t block, uint16_t *out, float scale, int do_scale, int accumulate)
{
    float acc[ZMP_QCHUNK], prev[ZMP_QCHUNK];
    for (int64_t lo = 0; lo < n; lo += ZMP_QCHUNK) {
        const int64_t m = n - lo < ZMP_QCHUNK ? n - lo : ZMP_QCHUNK;
        dequant_sum_f32acc(acc, q_rows, scale_rows, nrows, lo, m, bits, block);
        if (accumulate)
            halves_to_floats(prev, out + lo, m);
        zmp_q_finish(acc, prev, m, scale, do_scale, accumulate);
        floats_to_halves(out + lo, acc, m);
    }
}

void zmp_dequant_sum_f32(const uint8_t *const *q_rows, const float *const *scale_rows, int64_t nrows, int64_t n,
                         int bits, int64_t block, float *out, float scale, int do_scale, int accumulate)
{
    float acc[ZMP_QCHUNK];
    for (int64_t lo = 0; lo < n; lo += ZMP_QCHUNK) {
        const int64_t m = n - lo < ZMP_QCHUNK ? n - lo : ZMP_QCHUNK;
        dequant_sum_f32acc(acc, q_rows, scale_rows, nrows, lo, m, bits, block);
        zmp_q_finish(acc, out + lo, m, scale, do_scale, accumulate);
        memcpy(out + lo, acc, (size_t)m * sizeof(float));
    }
}

void zmp_dequant_sum_bf16(const uint8_t *const *q_rows, const float *const *scale_rows, int64_t nrows, int64_t n,
                          int bits, int64_t block, uint16_t *out, float scale, int do_scale, int accumulate)
{
    float acc[ZMP_QCHUNK], prev[ZMP_QCHUNK];
    for (int64_t lo = 0; lo < n; lo += ZMP_QCHUNK) {
        const int64_t m = n - lo < ZMP_QCHUNK ? n - lo : ZMP_QCHUNK;
        dequant_sum_f32acc(acc, q_rows, scale_rows, nrows, lo, m, bits, block);
        if (accumulate)
            bf16s_to_floats(prev, out + lo, m);
        zmp_q_finish(acc, prev, m, scale, do_scale, accumulate);
        floats_to_bf16s(out + lo, acc, m);
    }
}
