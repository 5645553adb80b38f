/* Block quantization on the CPU (quant_math.h), included by fused_adamw_cpu.c: it shares that
 * file's binary16 conversions and is built into the same library.
 *
 *   zmp_quantize_{f16,f32}(x, n, bits, block, q, scales)
 *       x: n elements; q: n bytes (int8) or (n + 1) / 2 bytes (int4); scales: one float per
 *       block of `block` elements (the last block may be shorter)
 *   zmp_dequant_sum_{f16,f32}(q_rows, scale_rows, nrows, n, bits, block, out, scale, do_scale, accumulate)
 *       out = cast([out +] scale * sum_r dequantized(row r)), float32 in row order: the
 *       reduce-scatter's local sum (sum_rows) over quantized rows; one row dequantizes.
 */
#include "quant_math.h"

#define ZMP_QCHUNK 512

static inline float load_f16(const uint16_t *x, int64_t i) { return half_to_float(x[i]); }
static inline float load_bf16(const uint16_t *x, int64_t i) { return bf16_to_float(x[i]); }
static inline float load_f32(const float *x, int64_t i) { return x[i]; }

#define ZMP_QUANTIZE(NAME, T, LOAD)                                                          \
void NAME(const T *restrict x, int64_t n, int bits, int64_t block, uint8_t *restrict q,        \
          float *restrict scales)                                                              \
{                                                                                              \
    const float qmax = bits == 4 ? 7.0f : 127.0f;                                             \
    float buf[ZMP_QCHUNK];                                                                     \
    for (int64_t b0 = 0, bi = 0; b0 < n; b0 += block, bi++) {                                  \
        const int64_t len = n - b0 < block ? n - b0 : block;                                   \
        float amax = 0.0f;                                                                     \
        for (int64_t i = 0; i < len; i++)                                                      \
            amax = zmp_q_absmax(amax, LOAD(x, b0 + i));                                       \
        const float scale = amax / qmax;                                                       \
        scales[bi] = scale;                                                                    \
        const int zero = zmp_q_zero_block(scale);                                              \
        for (int64_t c0 = 0; c0 < len; c0 += ZMP_QCHUNK) {                                     \
            const int64_t m = len - c0 < ZMP_QCHUNK ? len - c0 : ZMP_QCHUNK;                   \
            for (int64_t i = 0; i < m; i++)       /* vectorizes: division, rint, clamp */     \
                buf[i] = zero ? 0.0f : (float)zmp_q_value(LOAD(x, b0 + c0 + i), scale, qmax);  \
            const int64_t at = b0 + c0;                                                        \
            if (bits == 8) {                                                                   \
                for (int64_t i = 0; i < m; i++)                                                \
                    q[at + i] = (uint8_t)(int8_t)buf[i];                                       \
            } else {                                                                           \
                for (int64_t i = 0; i < m; i++) {                                              \
                    const int64_t e = at + i;                                                  \
                    const uint8_t nib = (uint8_t)((int)buf[i] & 0xf);                          \
                    if (e & 1)                                                                 \
                        q[e >> 1] = (uint8_t)((q[e >> 1] & 0x0f) | (nib << 4));                \
                    else                                                                       \
                        q[e >> 1] = nib;                                                       \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
}

ZMP_QUANTIZE(zmp_quantize_f16, uint16_t, load_f16)
ZMP_QUANTIZE(zmp_quantize_f32, float, load_f32)
ZMP_QUANTIZE(zmp_quantize_bf16, uint16_t, load_bf16)

/* The dequantized value of element i of row (q, scales). */
static inline float zmp_deq(const uint8_t *q, const float *scales, int64_t i, int bits, int64_t block)
{
    const int v = bits == 4 ? zmp_q_int4(q, i) : (int)(int8_t)q[i];
    return (float)v * scales[i / block];
}

static void dequant_sum_f32acc(float *restrict acc, const uint8_t *const *q_rows, const float *const *scale_rows,
                               int64_t nrows, int64_t lo, int64_t m, int bits, int64_t block)
{
    for (int64_t i = 0; i < m; i++)
        acc[i] = zmp_deq(q_rows[0], scale_rows[0], lo + i, bits, block);
    for (int64_t r = 1; r < nrows; r++)
        for (int64_t i = 0; i < m; i++)
            acc[i] = acc[i] + zmp_deq(q_rows[r], scale_rows[r], lo + i, bits, block);
}

void zmp_dequant_sum_f16(const uint8_t *const *q_rows, const float *const *scale_rows, int64_t nrows, int64_t n,
                         int bits, int64_t block, uint16_t *out, float scale, int do_scale, int accumulate)
{
    float acc[ZMP_QCHUNK];
    for (int64_t lo = 0; lo < n; lo += ZMP_QCHUNK) {
        const int64_t m = n - lo < ZMP_QCHUNK ? n - lo : ZMP_QCHUNK;
        dequant_sum_f32acc(acc, q_rows, scale_rows, nrows, lo, m, bits, block);
        for (int64_t i = 0; i < m; i++) {
            float a = acc[i];
            if (do_scale)
                a = a * scale;
            if (accumulate)
                a = a + half_to_float(out[lo + i]);
            out[lo + i] = float_to_half(a);
        }
    }
}

void zmp_dequant_sum_f32(const uint8_t *const *q_rows, const float *const *scale_rows, int64_t nrows, int64_t n,
                         int bits, int64_t block, float *out, float scale, int do_scale, int accumulate)
{
    float acc[ZMP_QCHUNK];
    for (int64_t lo = 0; lo < n; lo += ZMP_QCHUNK) {
        const int64_t m = n - lo < ZMP_QCHUNK ? n - lo : ZMP_QCHUNK;
        dequant_sum_f32acc(acc, q_rows, scale_rows, nrows, lo, m, bits, block);
        for (int64_t i = 0; i < m; i++) {
            float a = acc[i];
            if (do_scale)
                a = a * scale;
            if (accumulate)
                a = a + out[lo + i];
            out[lo + i] = a;
        }
    }
}

void zmp_dequant_sum_bf16(const uint8_t *const *q_rows, const float *const *scale_rows, int64_t nrows, int64_t n,
                          int bits, int64_t block, uint16_t *out, float scale, int do_scale, int accumulate)
{
    float acc[ZMP_QCHUNK];
    for (int64_t lo = 0; lo < n; lo += ZMP_QCHUNK) {
        const int64_t m = n - lo < ZMP_QCHUNK ? n - lo : ZMP_QCHUNK;
        dequant_sum_f32acc(acc, q_rows, scale_rows, nrows, lo, m, bits, block);
        for (int64_t i = 0; i < m; i++) {
            float a = acc[i];
            if (do_scale)
                a = a * scale;
            if (accumulate)
                a = a + bf16_to_float(out[lo + i]);
            out[lo + i] = float_to_bf16(a);
        }
    }
}
