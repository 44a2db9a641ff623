/* Integer dot-product matmuls for GGUF weights on x86 CPUs with AVX2 (compiled at first use by
 * cpu_int8dot.py; see its docstring for why this is not a torch kernel).
 *
 * out[M, N] = x[M, K] @ W.T with W held per output row and per group of 32 (or 16) inputs as integer
 * codes c and an affine map w = S * c + O. The activations are quantized per row and per 32 inputs to
 * int8 (a = round(x / s), s = max|x| / 127), so that a group's sum of c * a is a few integer
 * multiply-adds (vpmaddubsw, vpmaddwd) and the float work is one fused multiply-add per group:
 *
 *     sum_k w_k x_k ~= sum_groups  S s (sum c a)  +  O (s sum a)
 *
 * Two weight layouts:
 *   q4: codes 0..15, two per byte, [N, K/2]; in each group of 32, byte j holds code j (low nibble)
 *       and code j + 16 (high nibble), as GGUF's Q4 blocks do; groups of 32.
 *   i8: signed codes -128..127, one per byte, [N, K]; groups of 32 or 16.
 * S and O are [N, K / group], float16 where that holds every value exactly (GGUF's own scales), else
 * float32; O is absent when every offset is 0 (Q8_0).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGODA_SIMD 1
#else
#define PAGODA_SIMD 0
#endif

int pagoda_simd(void) { return PAGODA_SIMD; }

#if PAGODA_SIMD

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline int hsum8i(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

/* One row x [K] -> int8 codes q [K], scales s [K/32], s * (sum of codes) per half-group of 16 hs [K/16]
 * and per group of 32 bs [K/32]. */
static void quantize_row(const float *x, int64_t k, int8_t *q, float *s, float *hs, float *bs) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t g = 0; g < k / 32; g++) {
        const float *xg = x + 32 * g;
        __m256 v0 = _mm256_loadu_ps(xg), v1 = _mm256_loadu_ps(xg + 8);
        __m256 v2 = _mm256_loadu_ps(xg + 16), v3 = _mm256_loadu_ps(xg + 24);
        __m256 amax = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                                    _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        m = _mm_max_ss(m, _mm_movehdup_ps(m));
        float scale = _mm_cvtss_f32(m) / 127.0f;
        __m256 inv = _mm256_set1_ps(scale > 0.0f ? 1.0f / scale : 0.0f);
        /* round to nearest (the default rounding mode) */
        __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, inv)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, inv));
        __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, inv)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, inv));
        s[g] = scale;
        hs[2 * g] = scale * (float)hsum8i(_mm256_add_epi32(i0, i1));
        hs[2 * g + 1] = scale * (float)hsum8i(_mm256_add_epi32(i2, i3));
        bs[g] = hs[2 * g] + hs[2 * g + 1];
        /* packs work within 128-bit lanes: permute the 32-bit pieces back into order */
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
        _mm256_storeu_si256((__m256i *)(q + 32 * g), _mm256_permutevar8x32_epi32(p, order));
    }
}

/* Sums of four products of unsigned bytes u and signed bytes a, per 32-bit lane: one vpdpbusd where the CPU
 * has VNNI (AVX-512 VNNI with VL, or AVX-VNNI), else vpmaddubsw then vpmaddwd. The same integers either way:
 * vpmaddubsw's 16-bit sums cannot saturate here (|u| <= 128 and |a| <= 127: at most 32,512). */
static inline __m256i udot(__m256i u, __m256i a, __m256i ones) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    (void)ones;
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, a);
#elif defined(__AVXVNNI__)
    (void)ones;
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, a);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, a), ones);
#endif
}

/* The 32 codes of group g of a q4 row, one per byte, in order. */
static inline __m256i q4_group(const uint8_t *codes, int64_t g) {
    __m128i b = _mm_loadu_si128((const __m128i *)(codes + 16 * g));
    const __m128i low = _mm_set1_epi8(0x0F);
    __m128i lo = _mm_and_si128(b, low), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
    return _mm256_set_m128i(hi, lo);
}

/* Weight scales and offsets are float32, or float16 where that holds them exactly (f16 set). */
static inline __m256 load8(const void *v, int f16, int64_t i) {
    return f16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)v + i)))
               : _mm256_loadu_ps((const float *)v + i);
}

static inline float load1(const void *v, int f16, int64_t i) {
    return f16 ? _cvtsh_ss(((const uint16_t *)v)[i]) : ((const float *)v)[i];
}

/* prod[g] = S[g] * s[g] for n groups: the float factor of each group's integer sum. */
static inline void scale_products(const void *S, int f16, const float *s, int64_t n, float *prod) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(prod + i, _mm256_mul_ps(load8(S, f16, i), _mm256_loadu_ps(s + i)));
    for (; i < n; i++) prod[i] = load1(S, f16, i) * s[i];
}

/* The offsets' term O . b over n groups (0 without offsets: O NULL). */
static inline float offset_dot(const void *O, int f16, const float *b, int64_t n) {
    if (!O) return 0.0f;
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(load8(O, f16, i), _mm256_loadu_ps(b + i), acc);
    float rest = 0.0f;
    for (; i < n; i++) rest += load1(O, f16, i) * b[i];
    return hsum8(acc) + rest;
}

enum { Q4 = 0, I8 = 1 }; /* the weight layouts */

/* Rows r0..r0+R-1 of x (quantized: codes q, scales s [K/32], s * sum of codes per group of 32 bs [K/32]
 * and of 16 hs [K/16]) against one weight row (codes, scales S, offsets O): out[r * n]. R, layout and
 * group are compile-time constants in each instantiation (the callers below), so that the accumulators
 * stay in registers and no layout test is left in the loop over groups. Per group, the integer sum of c * a
 * is vpmaddubsw (unsigned by signed bytes) then vpmaddwd: q4's codes are unsigned already; i8's signed
 * codes go in as |c| (-128 stays 0x80: 128 as unsigned) with c's sign moved onto a. The offsets' term is a
 * float dot product, O . bs (groups of 32) or O . hs (groups of 16). */
static inline __attribute__((always_inline)) void dot_rows(int R, int layout, int group, const int8_t *q,
                                                          const float *s, const float *bs, const float *hs,
                                                          int64_t k, const uint8_t *codes, const void *S,
                                                          const void *O, int f16, float *out, int64_t n) {
    const __m256i ones = _mm256_set1_epi16(1);
    const int64_t groups = k / 32;
    float prod[R][group == 32 ? groups : 1];
    /* two accumulators per row, even and odd groups, so that consecutive groups' multiply-adds do not
     * wait on each other; every R sums in the same order (a row's result does not depend on its batch) */
    __m256 acc[4][2];
    for (int r = 0; r < R; r++) {
        acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        if (group == 32) scale_products(S, f16, s + r * groups, groups, prod[r]);
    }
    float Sf[group == 16 ? 2 * groups : 1]; /* groups of 16: this row's scales as float32 */
    if (group == 16)
        for (int64_t i = 0; i < 2 * groups; i++) Sf[i] = load1(S, f16, i);
#define DOT_STEP(g, half)                                                                                  \
    {                                                                                                      \
        const __m256i c = layout == Q4 ? q4_group(codes, g)                                                \
                                       : _mm256_loadu_si256((const __m256i *)(codes + 32 * (g)));          \
        const __m256i u = layout == Q4 ? c : _mm256_sign_epi8(c, c);                                       \
        const __m256 sw = group == 16                                                                      \
                              ? _mm256_set_m128(_mm_set1_ps(Sf[2 * (g) + 1]), _mm_set1_ps(Sf[2 * (g)]))    \
                              : _mm256_setzero_ps();                                                       \
        for (int r = 0; r < R; r++) {                                                                      \
            __m256i a = _mm256_loadu_si256((const __m256i *)(q + r * k + 32 * (g)));                       \
            if (layout == I8) a = _mm256_sign_epi8(a, c);                                                  \
            const __m256i p = udot(u, a, ones);                                                            \
            const __m256 f = group == 32 ? _mm256_broadcast_ss(&prod[r][g])                                \
                                         : _mm256_mul_ps(sw, _mm256_set1_ps(s[r * groups + (g)]));         \
            acc[r][half] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), f, acc[r][half]);                        \
        }                                                                                                  \
    }
    int64_t g = 0;
    for (; g + 1 < groups; g += 2) {
        DOT_STEP(g, 0)
        DOT_STEP(g + 1, 1)
    }
    if (g < groups) DOT_STEP(g, 0)
#undef DOT_STEP
    const int64_t sgroups = k / group;
    const float *sums = group == 32 ? bs : hs;
    for (int r = 0; r < R; r++)
        out[r * n] = hsum8(_mm256_add_ps(acc[r][0], acc[r][1])) + offset_dot(O, f16, sums + r * sgroups, sgroups);
}

/* dot_rows for `rows` (1..4) activation rows, with R a constant in each case. */
static inline __attribute__((always_inline)) void dot_tile(int rows, int layout, int group, const int8_t *q,
                                                          const float *s, const float *bs, const float *hs,
                                                          int64_t k, const uint8_t *codes, const void *S,
                                                          const void *O, int f16, float *out, int64_t n) {
    switch (rows) {
        case 4: dot_rows(4, layout, group, q, s, bs, hs, k, codes, S, O, f16, out, n); break;
        case 3: dot_rows(3, layout, group, q, s, bs, hs, k, codes, S, O, f16, out, n); break;
        case 2: dot_rows(2, layout, group, q, s, bs, hs, k, codes, S, O, f16, out, n); break;
        default: dot_rows(1, layout, group, q, s, bs, hs, k, codes, S, O, f16, out, n); break;
    }
}

#define ROW_TILE 4   /* activation rows sharing one pass over a weight row */
#define COL_TILE 16  /* weight rows per task: they stay in cache while every row tile passes */
#ifndef PREFETCH_ROWS
#define PREFETCH_ROWS 4 /* weight rows prefetched ahead of the one being multiplied (first row tile only) */
#endif

/* pagoda_int8dot_linear with out's rows ldo floats apart (a part of a wider output). */
static int int8dot_linear(const float *x, int64_t m, int64_t k, int64_t n, int layout, int group, const void *codes,
                          const void *S, const void *O, int f16, float *out, int64_t ldo, int threads) {
    const int64_t esize = f16 ? 2 : 4;
    const int64_t groups = k / 32;
    int8_t *q = (int8_t *)malloc((size_t)(m * k));
    float *s = (float *)malloc(sizeof(float) * (size_t)(m * groups));
    float *hs = (float *)malloc(sizeof(float) * (size_t)(m * 2 * groups));
    float *bs = (float *)malloc(sizeof(float) * (size_t)(m * groups));
    if (!q || !s || !hs || !bs) {
        free(q);
        free(s);
        free(hs);
        free(bs);
        return -1;
    }
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && m > 1)
    for (int64_t r = 0; r < m; r++)
        quantize_row(x + r * k, k, q + r * k, s + r * groups, hs + r * 2 * groups, bs + r * groups);

    const int64_t tasks = (n + COL_TILE - 1) / COL_TILE;
    const int64_t sgroups = layout == Q4 ? groups : k / group; /* weight scales per row */
    const int64_t row_bytes = layout == Q4 ? k / 2 : k;        /* weight code bytes per row */
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t j1 = (t + 1) * COL_TILE < n ? (t + 1) * COL_TILE : n;
        for (int64_t r0 = 0; r0 < m; r0 += ROW_TILE) {
            const int64_t rows = m - r0 < ROW_TILE ? m - r0 : ROW_TILE;
            const int8_t *qr = q + r0 * k;
            const float *sr = s + r0 * groups, *hr = hs + r0 * 2 * groups, *br = bs + r0 * groups;
            for (int64_t j = t * COL_TILE; j < j1; j++) {
                float *o = out + r0 * ldo + j;
                const uint8_t *c = (const uint8_t *)codes + j * row_bytes;
                const char *Sj = (const char *)S + j * sgroups * esize;
                const char *Oj = O ? (const char *)O + j * sgroups * esize : NULL;
                if (PREFETCH_ROWS > 0 && r0 == 0 && j + PREFETCH_ROWS < n) { /* the weight row a few ahead, into cache meanwhile */
                    const char *next = (const char *)c + PREFETCH_ROWS * row_bytes;
                    for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch(next + b, _MM_HINT_T0);
                    const char *ns = Sj + PREFETCH_ROWS * sgroups * esize;
                    for (int64_t b = 0; b < sgroups * esize; b += 64) _mm_prefetch(ns + b, _MM_HINT_T0);
                    if (Oj) {
                        const char *no = Oj + PREFETCH_ROWS * sgroups * esize;
                        for (int64_t b = 0; b < sgroups * esize; b += 64) _mm_prefetch(no + b, _MM_HINT_T0);
                    }
                }
                /* each call a constant layout and group: its own instantiation of dot_rows */
                if (layout == Q4)
                    dot_tile((int)rows, Q4, 32, qr, sr, br, hr, k, c, Sj, Oj, f16, o, ldo);
                else if (group == 32)
                    dot_tile((int)rows, I8, 32, qr, sr, br, hr, k, c, Sj, Oj, f16, o, ldo);
                else
                    dot_tile((int)rows, I8, 16, qr, sr, br, hr, k, c, Sj, Oj, f16, o, ldo);
            }
        }
    }
    free(q);
    free(s);
    free(hs);
    free(bs);
    return 0;
}

/* x [M, K] float32 -> out [M, N] float32; layout 0: q4 (codes uint8 [N, K/2]), 1: i8 (int8 [N, K]);
 * S, O [N, K / group] float16 when f16 is set, else float32; O may be NULL (no offsets).
 * Returns 0, or -1 when the scratch memory could not be allocated. */
int pagoda_int8dot_linear(const float *x, int64_t m, int64_t k, int64_t n, int layout, int group,
                          const void *codes, const void *S, const void *O, int f16, float *out, int threads) {
    return int8dot_linear(x, m, k, n, layout, group, codes, S, O, f16, out, n, threads);
}

/* One weight, as DotWeight.native() describes it for the core's fused decode (cpu_ops.c's pagoda_linear_fn):
 * out rows [M, N] of row stride ldo. */
struct pagoda_dot_weight {
    const void *codes, *S, *O;
    int64_t k, n, layout, group, f16;
};

int pagoda_int8dot_apply(const void *weight, const float *x, int64_t m, float *out, int64_t ldo, int threads) {
    const struct pagoda_dot_weight *w = (const struct pagoda_dot_weight *)weight;
    return int8dot_linear(x, m, w->k, w->n, (int)w->layout, (int)w->group, w->codes, w->S, w->O, (int)w->f16, out,
                          ldo, threads);
}

/* w[N, K] float32 = S * c + O, as torch computes it (a product, then a sum: not contracted into one fused
 * multiply-add, so the result is bit-identical to DotWeight.widen's torch reference): a prefill's float GEMM
 * needs each weight widened once per call, which in torch ops cost about 8 ns per weight. */
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off")))
#endif
void pagoda_int8dot_widen(int64_t k, int64_t n, int layout, int group, const void *codes, const void *S,
                          const void *O, int f16, float *out, int threads) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
    const int64_t sgroups = k / group, row_bytes = layout == Q4 ? k / 2 : k;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t j = 0; j < n; j++) {
        const uint8_t *c = (const uint8_t *)codes + j * row_bytes;
        float *w = out + j * k;
        for (int64_t g = 0; g < sgroups; g++) {
            const float scale = load1(S, f16, j * sgroups + g), offset = O ? load1(O, f16, j * sgroups + g) : 0.0f;
            float *wg = w + g * group;
            if (layout == Q4) { /* codes 0..15 then 16..31 (q4_group), eight at a time */
                const __m256i q = q4_group(c, g);
                const __m128i halves[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
                const __m256 s8 = _mm256_set1_ps(scale);
                for (int h = 0; h < 4; h++) {
                    __m128i part = h & 1 ? _mm_srli_si128(halves[h >> 1], 8) : halves[h >> 1];
                    __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(part)), s8);
                    _mm256_storeu_ps(wg + 8 * h, v);
                }
            } else {
                const int8_t *b = (const int8_t *)c + g * group;
                for (int i = 0; i < group; i++) wg[i] = (float)b[i] * scale;
            }
            if (O)
                for (int i = 0; i < group; i++) wg[i] += offset;
        }
    }
}

#else

void pagoda_int8dot_widen(int64_t k, int64_t n, int layout, int group, const void *codes, const void *S,
                          const void *O, int f16, float *out, int threads) {}

int pagoda_int8dot_linear(const float *x, int64_t m, int64_t k, int64_t n, int layout, int group,
                          const void *codes, const void *S, const void *O, int f16, float *out, int threads) {
    return -2; /* built without AVX2/FMA: the caller uses torch's kernels */
}

int pagoda_int8dot_apply(const void *weight, const float *x, int64_t m, float *out, int64_t ldo, int threads) {
    return -2;
}

#endif
