/* A decode step's small per-token ops for float32 on the CPU, one call each instead of a dozen torch ops
 * (built by pagoda.kernels.native; semantics: pagoda.kernels.reference; wrappers: cpu_ops.py).
 * Rows are independent; a row's input may be strided (a view into a fused projection's output). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* exp of 8 floats: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by its Taylor polynomial to r^6 (error about
 * 1e-7 relative, as expf's), times 2^n built in the exponent bits; x clamped to [-87.3, 88.3]. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x); /* ln2 in two parts */
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#define PAGODA_EXP8 1
#else
#define PAGODA_EXP8 0
#endif

/* x[i] = exp(x[i] - shift) for n floats; returns their sum. */
static float exp_shifted(float *x, int64_t n, float shift) {
    float total = 0.0f;
    int64_t i = 0;
#if PAGODA_EXP8
    __m256 acc = _mm256_setzero_ps();
    const __m256 s = _mm256_set1_ps(shift);
    for (; i + 8 <= n; i += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), s));
        _mm256_storeu_ps(x + i, e);
        acc = _mm256_add_ps(acc, e);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    for (int l = 0; l < 8; l++) total += lanes[l];
#endif
    for (; i < n; i++) total += (x[i] = expf(x[i] - shift));
    return total;
}

/* out[t] = w * (x[t] / sqrt(mean(x[t]^2) + eps)); x rows of stride sx, out rows contiguous. */
void pagoda_rms_norm(const float *x, int64_t t, int64_t h, int64_t sx, const float *w, float eps, float *out) {
    for (int64_t r = 0; r < t; r++) {
        const float *xr = x + r * sx;
        float *o = out + r * h;
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < h; i++) ss += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(ss / (float)h + eps);
#pragma omp simd
        for (int64_t i = 0; i < h; i++) o[i] = w[i] * (xr[i] * inv);
    }
}

/* sum[t] = x[t] + res[t]; out[t] = rms_norm(sum[t]); every tensor contiguous [t, h]. */
void pagoda_add_rms_norm(const float *x, const float *res, int64_t t, int64_t h, const float *w, float eps,
                         float *out, float *sum) {
    for (int64_t r = 0; r < t; r++) {
        const float *xr = x + r * h, *rr = res + r * h;
        float *s = sum + r * h;
#pragma omp simd
        for (int64_t i = 0; i < h; i++) s[i] = xr[i] + rr[i];
    }
    pagoda_rms_norm(sum, t, h, h, w, eps, out);
}

/* Rotary of `heads` heads of size hs of one row x, in place: the first `rot` dims of each head rotated by the
 * cos/sin row cs (cos in its first half, sin in the second); neox: halves (x1 = first half, x2 = second),
 * else interleaved pairs; dims past rot untouched. */
static void rotate_heads(float *x, int64_t heads, int64_t hs, const float *cs, int64_t rot, int neox) {
    const int64_t half = rot / 2;
    const float *cosv = cs, *sinv = cs + half;
    for (int64_t h = 0; h < heads; h++) {
        float *xh = x + h * hs;
        if (neox) {
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float x1 = xh[i], x2 = xh[i + half];
                xh[i] = x1 * cosv[i] - x2 * sinv[i];
                xh[i + half] = x2 * cosv[i] + x1 * sinv[i];
            }
        } else {
            for (int64_t i = 0; i < half; i++) {
                const float x1 = xh[2 * i], x2 = xh[2 * i + 1];
                xh[2 * i] = x1 * cosv[i] - x2 * sinv[i];
                xh[2 * i + 1] = x2 * cosv[i] + x1 * sinv[i];
            }
        }
    }
}

/* Rotary embedding of `heads` heads of size hs per row (row stride sx) into out [t, heads * hs] (rotate_heads
 * on a copy of each row), with the cos/sin of row positions[t] of cache [P, rot]. Returns -1, or the first row
 * whose position is outside the cache's P rows (nothing read past the table: every position is checked
 * before any row is done). */
int64_t pagoda_rotary(const float *x, int64_t t, int64_t heads, int64_t hs, int64_t sx, const int64_t *positions,
                      const float *cache, int64_t npos, int64_t rot, int neox, float *out) {
    for (int64_t r = 0; r < t; r++)
        if (positions[r] < 0 || positions[r] >= npos) return r;
    for (int64_t r = 0; r < t; r++) {
        float *o = out + r * heads * hs;
        memcpy(o, x + r * sx, sizeof(float) * (size_t)(heads * hs));
        rotate_heads(o, heads, hs, cache + positions[r] * rot, rot, neox);
    }
    return -1;
}

/* Write rows k[t], v[t] (nk * hs floats each, row strides sk, sv) into the flat cache slots slots[t] of
 * kc, vc ([slots_total, nk * hs] each); slots < 0 are skipped (padding). Returns the first row whose
 * slot is past the cache, or -1. */
int64_t pagoda_store_kv(const float *k, const float *v, int64_t t, int64_t width, int64_t sk, int64_t sv,
                        const int64_t *slots, float *kc, float *vc, int64_t slots_total) {
    for (int64_t r = 0; r < t; r++) {
        const int64_t slot = slots[r];
        if (slot < 0) continue;
        if (slot >= slots_total) return r;
        memcpy(kc + slot * width, k + r * sk, sizeof(float) * (size_t)width);
        memcpy(vc + slot * width, v + r * sv, sizeof(float) * (size_t)width);
    }
    return -1;
}

/* a . b over d floats (four accumulators: the multiply-adds do not wait on each other). */
static inline float dot(const float *a, const float *b, int64_t d) {
    int64_t i = 0;
    float total = 0.0f;
#if PAGODA_EXP8
    __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;
    for (; i + 32 <= d; i += 32) {
        c0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), c0);
        c1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), c1);
        c2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16), _mm256_loadu_ps(b + i + 16), c2);
        c3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 24), _mm256_loadu_ps(b + i + 24), c3);
    }
    for (; i + 8 <= d; i += 8) c0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), c0);
    __m256 c = _mm256_add_ps(_mm256_add_ps(c0, c1), _mm256_add_ps(c2, c3));
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(c), _mm256_extractf128_ps(c, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    total = _mm_cvtss_f32(h);
#endif
    for (; i < d; i++) total += a[i] * b[i];
    return total;
}

/* Decode attention straight from the paged cache, one query token per sequence: for sequence b and query
 * head h (kv head h / (nq / nk)), out[b, h] = softmax(scale * q[b, h] . k_j) . v_j over positions
 * j < lens[b] (the last `window` of them when window > 0). q rows of stride sq ([nq, d] within a row);
 * caches [slots, nk, d] with slot = tables[b, j / bs] * bs + j % bs; out [nb, nq, d] contiguous.
 * The query heads sharing a kv head are done together (each key and value read once for them), the
 * positions walked block by block. Returns 0, or -1 when scratch memory could not be had. */
int pagoda_decode_attention(const float *q, int64_t nb, int64_t nq, int64_t d, int64_t sq, const float *kc,
                            const float *vc, int64_t nk, int64_t bs, const int64_t *tables, int64_t ts,
                            const int64_t *lens, int64_t window, float scale, float *out, int threads) {
    const int64_t group = nq / nk;
    int failed = 0;
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t b = 0; b < nb; b++) {
        for (int64_t kvh = 0; kvh < nk; kvh++) {
            const int64_t len = lens[b], start = window > 0 && len > window ? len - window : 0;
            const int64_t span = len - start;
            float *scores = (float *)malloc(sizeof(float) * (size_t)(group * (span + 1)));
            if (!scores) {
                failed = 1;
                continue;
            }
            const float *qh = q + b * sq + kvh * group * d; /* the group's query heads, [group, d] */
            float *o = out + (b * nq + kvh * group) * d;
            float top[group], total[group];
            for (int64_t h = 0; h < group; h++) top[h] = -INFINITY, total[h] = 0.0f;
            /* pass 1: scores [group, span] */
            for (int64_t j0 = start - start % bs; j0 < len; j0 += bs) {
                const int64_t base = tables[b * ts + j0 / bs] * bs;
                const int64_t lo = j0 < start ? start : j0, hi = j0 + bs < len ? j0 + bs : len;
                for (int64_t j = lo; j < hi; j++) {
                    const float *kv = kc + ((base + j - j0) * nk + kvh) * d;
                    for (int64_t h = 0; h < group; h++) {
                        const float sc = dot(qh + h * d, kv, d) * scale;
                        scores[h * span + (j - start)] = sc;
                        if (sc > top[h]) top[h] = sc;
                    }
                }
            }
            for (int64_t h = 0; h < group; h++) total[h] = exp_shifted(scores + h * span, span, top[h]);
            /* pass 2: out[h] = sum_j p[h, j] v_j / total[h], 64 dims at a time held in registers */
            for (int64_t h = 0; h < group; h++) {
                const float *ph = scores + h * span;
                const float inv = total[h] > 0.0f ? 1.0f / total[h] : 0.0f;
                float *oh = o + h * d;
                for (int64_t i0 = 0; i0 < d; i0 += 64) {
                    const int64_t w = d - i0 < 64 ? d - i0 : 64;
                    float acc[64] = {0};
                    for (int64_t j0 = start - start % bs; j0 < len; j0 += bs) {
                        const int64_t base = tables[b * ts + j0 / bs] * bs;
                        const int64_t lo = j0 < start ? start : j0, hi = j0 + bs < len ? j0 + bs : len;
                        for (int64_t j = lo; j < hi; j++) {
                            const float p = ph[j - start];
                            const float *vv = vc + ((base + j - j0) * nk + kvh) * d + i0;
#pragma omp simd
                            for (int64_t i = 0; i < 64; i++) acc[i] += p * (i < w ? vv[i] : 0.0f);
                        }
                    }
                    for (int64_t i = 0; i < w; i++) oh[i0 + i] = acc[i] * inv;
                }
            }
            free(scores);
        }
    }
    return failed ? -1 : 0;
}

/* out[t] = silu(x[t, :n]) * x[t, n:2n] (x rows of stride sx), silu(a) = a / (1 + exp(-a)). */
void pagoda_silu_and_mul(const float *x, int64_t t, int64_t n, int64_t sx, float *out) {
    for (int64_t r = 0; r < t; r++) {
        const float *a = x + r * sx, *g = a + n;
        float *o = out + r * n;
        int64_t i = 0;
#if PAGODA_EXP8
        const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
        for (; i + 8 <= n; i += 8) {
            const __m256 av = _mm256_loadu_ps(a + i);
            const __m256 den = _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, av)));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(av, den), _mm256_loadu_ps(g + i)));
        }
#endif
        for (; i < n; i++) o[i] = a[i] / (1.0f + expf(-a[i])) * g[i];
    }
}

/* ---------------------------------------------------------------------------------------------------------
 * Every decoder layer of a Llama-shaped model for one decode step, in one call (cpu_decoder.py says when it
 * applies). The layers' linear maps are C functions of the quantization method that holds the weights
 * (e.g. pagoda-quant's GGUF int8 dot products), given as function pointers, so that this file knows no
 * weight format. Per layer, on x [nb, hidden], the residual stream:
 *   h = rms_norm(x, ln1); qkv = h W_qkv (+ b); per-head rms_norm of q and k (q_norm, k_norm: Qwen3);
 *   rotary on q and k; k, v into the cache at slots[b]; a = attention(q, cache); x += a W_o (+ b);
 *   h = rms_norm(x, ln2); g = h W_gate_up; x += (silu(g[:, :inter]) * g[:, inter:]) W_down.
 * The same C functions as the per-op path (pagoda_rms_norm, pagoda_decode_attention, ...), in the same
 * order: the results equal that path's up to the q/k norms (the torch reference there). */
typedef int (*pagoda_linear_fn)(const void *weight, const float *x, int64_t m, float *out, int64_t ldo,
                                int threads);

struct pagoda_linear_part { /* output columns [offset, offset + rows) of a linear map, one C call */
    pagoda_linear_fn fn;
    const void *weight;
    int64_t rows;
};

struct pagoda_decoder_layer {
    const float *ln1, *ln2, *q_norm, *k_norm, *qkv_bias, *o_bias; /* norms and biases: NULL where absent */
    const struct pagoda_linear_part *qkv, *o, *gate_up, *down;
    int64_t n_qkv, n_o, n_gate_up, n_down; /* parts of each */
    float *k_cache, *v_cache;              /* [slots, nk * hd] each */
    int64_t window;                        /* sliding window, 0: none */
};

struct pagoda_decoder_dims {
    int64_t hidden, nq, nk, hd, inter, rot, npos, slots;
    float eps, scale;
    int64_t neox;
    const float *cos_sin; /* [npos, rot] */
};

static int linear_apply(const struct pagoda_linear_part *parts, int64_t n, const float *x, int64_t m, float *out,
                        int64_t ldo, const float *bias, int threads) {
    int64_t offset = 0;
    for (int64_t p = 0; p < n; p++) {
        if (parts[p].fn(parts[p].weight, x, m, out + offset, ldo, threads)) return -1;
        offset += parts[p].rows;
    }
    if (bias)
        for (int64_t r = 0; r < m; r++)
            for (int64_t i = 0; i < ldo; i++) out[r * ldo + i] += bias[i];
    return 0;
}

/* x [nb, hidden] in and out; positions, slots [nb]; tables [nb, ts], lens [nb] as pagoda_decode_attention's.
 * Returns 0; -1 when memory could not be had or a linear map failed; -2 - r when row r's position is outside
 * the cos/sin table or its slot past the cache (nothing written then). */
int64_t pagoda_decoder_decode(const struct pagoda_decoder_dims *d, const struct pagoda_decoder_layer *layers,
                              int64_t nlayers, float *x, int64_t nb, const int64_t *positions, const int64_t *slots,
                              int64_t bs, const int64_t *tables, int64_t ts, const int64_t *lens, int threads) {
    for (int64_t r = 0; r < nb; r++)
        if (positions[r] < 0 || positions[r] >= d->npos || slots[r] >= d->slots) return -2 - r;
    const int64_t hid = d->hidden, hd = d->hd, qw = d->nq * hd, kw = d->nk * hd, wqkv = qw + 2 * kw;
    float *h = (float *)malloc(sizeof(float) * (size_t)(nb * hid));
    float *qkv = (float *)malloc(sizeof(float) * (size_t)(nb * wqkv));
    float *attn = (float *)malloc(sizeof(float) * (size_t)(nb * qw));
    float *gu = (float *)malloc(sizeof(float) * (size_t)(nb * 2 * d->inter));
    float *act = (float *)malloc(sizeof(float) * (size_t)(nb * d->inter));
    float *y = (float *)malloc(sizeof(float) * (size_t)(nb * hid));
    int rc = (h && qkv && attn && gu && act && y) ? 0 : -1;
    for (int64_t l = 0; l < nlayers && !rc; l++) {
        const struct pagoda_decoder_layer *L = layers + l;
        pagoda_rms_norm(x, nb, hid, hid, L->ln1, d->eps, h);
        if ((rc = linear_apply(L->qkv, L->n_qkv, h, nb, qkv, wqkv, L->qkv_bias, threads))) break;
        for (int64_t r = 0; r < nb; r++) {
            float *q = qkv + r * wqkv, *k = q + qw;
            if (L->q_norm) {
                pagoda_rms_norm(q, d->nq, hd, hd, L->q_norm, d->eps, q);
                pagoda_rms_norm(k, d->nk, hd, hd, L->k_norm, d->eps, k);
            }
            const float *cs = d->cos_sin + positions[r] * d->rot;
            rotate_heads(q, d->nq, hd, cs, d->rot, (int)d->neox);
            rotate_heads(k, d->nk, hd, cs, d->rot, (int)d->neox);
        }
        pagoda_store_kv(qkv + qw, qkv + qw + kw, nb, kw, wqkv, wqkv, slots, L->k_cache, L->v_cache, d->slots);
        if ((rc = pagoda_decode_attention(qkv, nb, d->nq, hd, wqkv, L->k_cache, L->v_cache, d->nk, bs, tables, ts,
                                          lens, L->window, d->scale, attn, threads)))
            break;
        if ((rc = linear_apply(L->o, L->n_o, attn, nb, y, hid, L->o_bias, threads))) break;
        pagoda_add_rms_norm(y, x, nb, hid, L->ln2, d->eps, h, x);
        if ((rc = linear_apply(L->gate_up, L->n_gate_up, h, nb, gu, 2 * d->inter, NULL, threads))) break;
        pagoda_silu_and_mul(gu, nb, d->inter, 2 * d->inter, act);
        if ((rc = linear_apply(L->down, L->n_down, act, nb, y, hid, NULL, threads))) break;
        for (int64_t i = 0; i < nb * hid; i++) x[i] += y[i];
    }
    free(h);
    free(qkv);
    free(attn);
    free(gu);
    free(act);
    free(y);
    return rc ? -1 : 0;
}
