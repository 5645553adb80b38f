/* The kernels of gpt_cpu.c for one element type: included once per type, with REAL (the
 * type), SFX(name) (the name with its suffix), EXP, TANH, SQRT and LIT (a constant in REAL,
 * rounded as NumPy rounds a Python float against an array of that type) defined.
 * Arrays are C-contiguous rows of c elements; no argument aliases another. */

#define L ZGPT_LANES
#define K_GELU LIT(0.7978845608028654)              /* sqrt(2 / pi), as the reference's _C */
#define K_CUBE LIT(0.044715)
#define K_HALF_GELU LIT(0.5 * 0.7978845608028654)   /* the reference's (0.5 * _C) */
#define K_CUBE3 LIT(3 * 0.044715)

/* The partial sums added in a fixed tree (lane l holds the row's elements l, l + L, ...). */
static inline REAL SFX(zgpt_tree)(REAL *acc)
{
    for (int w = L / 2; w >= 1; w /= 2)
        for (int l = 0; l < w; l++)
            acc[l] += acc[l + w];
    return acc[0];
}

/* ---- LayerNorm ---------------------------------------------------------------------------- */
void SFX(zgpt_layernorm_fwd)(const REAL *restrict x, const REAL *restrict g, const REAL *restrict b,
                             REAL *restrict y, REAL *restrict mean, REAL *restrict rstd,
                             int64_t rows, int64_t c, REAL eps)
{
    for (int64_t r = 0; r < rows; r++) {
        const REAL *restrict xr = x + r * c;
        REAL *restrict yr = y + r * c;
        REAL acc[L] = {0};
        int64_t j = 0;
        for (; j + L <= c; j += L)
            for (int l = 0; l < L; l++)
                acc[l] += xr[j + l];
        for (int l = 0; j + l < c; l++)
            acc[l] += xr[j + l];
        const REAL mu = SFX(zgpt_tree)(acc) / (REAL)c;
        REAL sq[L] = {0};
        for (j = 0; j + L <= c; j += L)
            for (int l = 0; l < L; l++) {
                const REAL d = xr[j + l] - mu;
                sq[l] += d * d;
            }
        for (int l = 0; j + l < c; l++) {
            const REAL d = xr[j + l] - mu;
            sq[l] += d * d;
        }
        const REAL rs = LIT(1.0) / SQRT(SFX(zgpt_tree)(sq) / (REAL)c + eps);
        for (j = 0; j < c; j++)
            yr[j] = (xr[j] - mu) * rs * g[j] + b[j];
        mean[r] = mu;
        rstd[r] = rs;
    }
}

/* dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)) [+ res], dxhat = dy * g;
 * dg = sum over rows of dy * xhat, db = sum of dy (rows in order). res, dg, db may be NULL. */
void SFX(zgpt_layernorm_bwd)(const REAL *restrict dy, const REAL *restrict x, const REAL *restrict mean,
                             const REAL *restrict rstd, const REAL *restrict g, const REAL *restrict res,
                             REAL *restrict dx, REAL *restrict dg, REAL *restrict db, int64_t rows, int64_t c)
{
    if (dg)
        for (int64_t j = 0; j < c; j++)
            dg[j] = 0;
    if (db)
        for (int64_t j = 0; j < c; j++)
            db[j] = 0;
    for (int64_t r = 0; r < rows; r++) {
        const REAL *restrict dyr = dy + r * c, *restrict xr = x + r * c;
        REAL *restrict dxr = dx + r * c;
        const REAL mu = mean[r], rs = rstd[r];
        REAL s1[L] = {0}, s2[L] = {0};
        int64_t j = 0;
        for (; j + L <= c; j += L)
            for (int l = 0; l < L; l++) {
                const REAL xhat = (xr[j + l] - mu) * rs, dxhat = dyr[j + l] * g[j + l];
                s1[l] += dxhat;
                s2[l] += dxhat * xhat;
            }
        for (int l = 0; j + l < c; l++) {
            const REAL xhat = (xr[j + l] - mu) * rs, dxhat = dyr[j + l] * g[j + l];
            s1[l] += dxhat;
            s2[l] += dxhat * xhat;
        }
        const REAL m1 = SFX(zgpt_tree)(s1) / (REAL)c, m2 = SFX(zgpt_tree)(s2) / (REAL)c;
        if (res) {
            const REAL *restrict rr = res + r * c;
            for (j = 0; j < c; j++) {
                const REAL xhat = (xr[j] - mu) * rs, dxhat = dyr[j] * g[j];
                dxr[j] = rs * (dxhat - m1 - xhat * m2) + rr[j];
            }
        } else {
            for (j = 0; j < c; j++) {
                const REAL xhat = (xr[j] - mu) * rs, dxhat = dyr[j] * g[j];
                dxr[j] = rs * (dxhat - m1 - xhat * m2);
            }
        }
        if (dg)
            for (j = 0; j < c; j++)
                dg[j] += dyr[j] * ((xr[j] - mu) * rs);
        if (db)
            for (j = 0; j < c; j++)
                db[j] += dyr[j];
    }
}

/* ---- GELU (tanh approximation) -------------------------------------------------------------- */
/* f += b (b may be NULL); y = 0.5 f (1 + tanh(sqrt(2/pi) f (1 + 0.044715 f^2))). */
void SFX(zgpt_gelu_fwd)(REAL *restrict f, const REAL *restrict b, REAL *restrict y, int64_t rows, int64_t c)
{
    for (int64_t r = 0; r < rows; r++) {
        REAL *restrict fr = f + r * c, *restrict yr = y + r * c;
        if (b)
            for (int64_t j = 0; j < c; j++)
                fr[j] = fr[j] + b[j];
        for (int64_t j = 0; j < c; j++) {
            const REAL x = fr[j];
            const REAL t = TANH(K_GELU * x * (LIT(1.0) + K_CUBE * (x * x)));
            yr[j] = LIT(0.5) * x * (LIT(1.0) + t);
        }
    }
}

/* d *= GELU'(f) in place; db = column sums of the result (rows in order; may be NULL). */
void SFX(zgpt_gelu_bwd)(REAL *restrict d, const REAL *restrict f, REAL *restrict db, int64_t rows, int64_t c)
{
    if (db)
        for (int64_t j = 0; j < c; j++)
            db[j] = 0;
    for (int64_t r = 0; r < rows; r++) {
        REAL *restrict dr = d + r * c;
        const REAL *restrict fr = f + r * c;
        for (int64_t j = 0; j < c; j++) {
            const REAL x = fr[j];
            const REAL t = TANH(K_GELU * x * (LIT(1.0) + K_CUBE * (x * x)));
            const REAL grad = LIT(0.5) * (LIT(1.0) + t) + K_HALF_GELU * x * (LIT(1.0) - t * t) * (LIT(1.0) + K_CUBE3 * (x * x));
            dr[j] = dr[j] * grad;
        }
        if (db)
            for (int64_t j = 0; j < c; j++)
                db[j] += dr[j];
    }
}

/* ---- causal softmax over mats (t x t) score matrices ---------------------------------------- */
/* Row i: s[j] <- exp(scale s[j] - max) / sum for j <= i, 0 for j > i. */
void SFX(zgpt_softmax_causal_fwd)(REAL *restrict s, int64_t mats, int64_t t, REAL scale)
{
    for (int64_t m = 0; m < mats; m++)
        for (int64_t i = 0; i < t; i++) {
            REAL *restrict row = s + (m * t + i) * t;
            const int64_t n = i + 1;
            REAL mx[L];
            for (int l = 0; l < L; l++)
                mx[l] = -INFINITY;
            int64_t j = 0;
            for (; j + L <= n; j += L)
                for (int l = 0; l < L; l++) {
                    const REAL v = row[j + l] * scale;
                    row[j + l] = v;
                    mx[l] = v > mx[l] ? v : mx[l];
                }
            for (int l = 0; j + l < n; l++) {
                const REAL v = row[j + l] * scale;
                row[j + l] = v;
                mx[l] = v > mx[l] ? v : mx[l];
            }
            REAL big = mx[0];
            for (int l = 1; l < L; l++)
                big = mx[l] > big ? mx[l] : big;
            REAL acc[L] = {0};
            for (j = 0; j + L <= n; j += L)
                for (int l = 0; l < L; l++) {
                    const REAL e = EXP(row[j + l] - big);
                    row[j + l] = e;
                    acc[l] += e;
                }
            for (int l = 0; j + l < n; l++) {
                const REAL e = EXP(row[j + l] - big);
                row[j + l] = e;
                acc[l] += e;
            }
            const REAL z = SFX(zgpt_tree)(acc);
            for (j = 0; j < n; j++)
                row[j] = row[j] / z;
            for (; j < t; j++)
                row[j] = 0;
        }
}

/* Row i: d[j] <- att[j] (d[j] - sum_k d[k] att[k]) scale for j <= i, 0 for j > i. */
void SFX(zgpt_softmax_causal_bwd)(REAL *restrict d, const REAL *restrict att, int64_t mats, int64_t t, REAL scale)
{
    for (int64_t m = 0; m < mats; m++)
        for (int64_t i = 0; i < t; i++) {
            REAL *restrict dr = d + (m * t + i) * t;
            const REAL *restrict ar = att + (m * t + i) * t;
            const int64_t n = i + 1;
            REAL acc[L] = {0};
            int64_t j = 0;
            for (; j + L <= n; j += L)
                for (int l = 0; l < L; l++)
                    acc[l] += dr[j + l] * ar[j + l];
            for (int l = 0; j + l < n; l++)
                acc[l] += dr[j + l] * ar[j + l];
            const REAL dot = SFX(zgpt_tree)(acc);
            for (j = 0; j < n; j++)
                dr[j] = ar[j] * (dr[j] - dot) * scale;
            for (; j < t; j++)
                dr[j] = 0;
        }
}

/* ---- a linear layer's bias and the residual ------------------------------------------------- */
void SFX(zgpt_bias_residual)(REAL *restrict out, const REAL *restrict res, const REAL *restrict b,
                             int64_t rows, int64_t c)
{
    for (int64_t r = 0; r < rows; r++) {
        REAL *restrict o = out + r * c;
        const REAL *restrict x = res + r * c;
        for (int64_t j = 0; j < c; j++)
            o[j] = x[j] + (o[j] + b[j]);
    }
}

#undef L
#undef K_GELU
#undef K_CUBE
#undef K_HALF_GELU
#undef K_CUBE3
