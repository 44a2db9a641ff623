/* A decode step's small per-token ops for float32 on the CPU, one call each instead of a dozen torch ops
 * (built by pagoda.kernels.native; semantics: pagoda.kernels.reference; wrappers: cpu_ops.py).
 * Rows are independent; a row's input may be strided (a view into a fused projection's output). */
#include <math.h>
#include <stdint.h>
#include <string.h>

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

/* Rotary embedding of `heads` heads of size hs per row (row stride sx) into out [t, heads * hs]: the first
 * `rot` dims of each head rotated by the cos/sin of row positions[t] of cache [P, rot] (cos in the first
 * half, sin in the second); neox: halves (x1 = first half, x2 = second), else interleaved pairs; dims past
 * rot copied. */
void pagoda_rotary(const float *x, int64_t t, int64_t heads, int64_t hs, int64_t sx, const int64_t *positions,
                   const float *cache, int64_t rot, int neox, float *out) {
    const int64_t half = rot / 2;
    for (int64_t r = 0; r < t; r++) {
        const float *cs = cache + positions[r] * rot;
        const float *cosv = cs, *sinv = cs + half;
        for (int64_t h = 0; h < heads; h++) {
            const float *xh = x + r * sx + h * hs;
            float *o = out + (r * heads + h) * hs;
            if (neox) {
#pragma omp simd
                for (int64_t i = 0; i < half; i++) {
                    const float x1 = xh[i], x2 = xh[i + half];
                    o[i] = x1 * cosv[i] - x2 * sinv[i];
                    o[i + half] = x2 * cosv[i] + x1 * sinv[i];
                }
            } else {
                for (int64_t i = 0; i < half; i++) {
                    const float x1 = xh[2 * i], x2 = xh[2 * i + 1];
                    o[2 * i] = x1 * cosv[i] - x2 * sinv[i];
                    o[2 * i + 1] = x2 * cosv[i] + x1 * sinv[i];
                }
            }
            if (rot < hs) memcpy(o + rot, xh + rot, sizeof(float) * (size_t)(hs - rot));
        }
    }
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
