/* bfloat16 on the CPU, included by fused_adamw_cpu.c: it shares that file's helpers and is built
 * into the same library. bfloat16 is passed as uint16_t bits: the top half of a float32.
 *
 *   float -> bf16: round to nearest even; NaN becomes the quiet NaN 0x7fc0 with its sign (as
 *   ml_dtypes, the NumPy reference's bfloat16, converts); bf16 -> float: exact (a shift).
 *
 *   zmp_adamw_bf16, zmp_grad_stats_bf16, zmp_sum_rows_bf16, zmp_quantize_bf16,
 *   zmp_dequant_sum_bf16: the f16 kernels' contracts, on bfloat16 storage, through float32
 *   blocks (the same per-element float32 arithmetic, so the same bits as the reference).
 */

static inline float bf16_to_float(uint16_t h) { return bits_to_float((uint32_t)h << 16); }

static inline uint16_t float_to_bf16(float f)
{
    uint32_t u = float_to_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)(((u >> 16) & 0x8000u) | 0x7fc0u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static void bf16s_to_floats(float *restrict dst, const uint16_t *restrict src, int64_t n)
{
    for (int64_t i = 0; i < n; i++)      /* vectorizes: a widening shift */
        dst[i] = bf16_to_float(src[i]);
}

static void floats_to_bf16s(uint16_t *restrict dst, const float *restrict src, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        dst[i] = float_to_bf16(src[i]);
}

void zmp_adamw_bf16(float *restrict master, float *restrict m, float *restrict v,
                    const uint16_t *restrict grad, uint16_t *restrict param_out, int64_t n,
                    const zmp_adamw_scalars *scalars)
{
    const zmp_adamw_scalars s = *scalars;
    float g[ZMP_BLOCK];
    for (int64_t lo = 0; lo < n; lo += ZMP_BLOCK) {
        const int64_t len = n - lo < ZMP_BLOCK ? n - lo : ZMP_BLOCK;
        bf16s_to_floats(g, grad + lo, len);
        adamw_block(master + lo, m + lo, v + lo, g, len, s);
        floats_to_bf16s(param_out + lo, master + lo, len);
    }
}

int zmp_grad_stats_bf16(const uint16_t *restrict grad, int64_t n, double *sumsq)
{
    double lanes[ZMP_LANES] = {0};
    float g[ZMP_BLOCK];
    for (int64_t lo = 0; lo < n; lo += ZMP_BLOCK) {
        const int64_t len = n - lo < ZMP_BLOCK ? n - lo : ZMP_BLOCK;
        bf16s_to_floats(g, grad + lo, len);
        int64_t i = 0;
        for (; i + ZMP_LANES <= len; i += ZMP_LANES)
            for (int j = 0; j < ZMP_LANES; j++) {
                const double x = g[i + j];
                lanes[j] += x * x;                        /* exact product: 8-bit significands */
            }
        for (int j = 0; i + j < len; j++) {
            const double x = g[i + j];
            lanes[j] += x * x;
        }
    }
    *sumsq = combine_lanes(lanes);
    return !isfinite(*sumsq);
}

void zmp_sum_rows_bf16(const uint16_t *const *rows, int64_t nrows, int64_t k, uint16_t *out,
                       float scale, int do_scale, int accumulate)
{
    float acc[ZMP_BLOCK], t[ZMP_BLOCK];
    for (int64_t i = 0; i < k; i += ZMP_BLOCK) {
        const int64_t len = k - i < ZMP_BLOCK ? k - i : ZMP_BLOCK;
        bf16s_to_floats(acc, rows[0] + i, len);
        for (int64_t r = 1; r < nrows; r++) {
            bf16s_to_floats(t, rows[r] + i, len);
            for (int64_t j = 0; j < len; j++)
                acc[j] = acc[j] + t[j];
        }
        if (do_scale)
            for (int64_t j = 0; j < len; j++)
                acc[j] = acc[j] * scale;
        if (accumulate) {
            bf16s_to_floats(t, out + i, len);
            for (int64_t j = 0; j < len; j++)
                acc[j] = acc[j] + t[j];
        }
        floats_to_bf16s(out + i, acc, len);
    }
}
