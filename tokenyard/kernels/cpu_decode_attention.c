/* Decode attention over a paged KV cache on the CPU, reading the blocks where they lie: no gather
 * into a contiguous buffer and, for an int8 cache, no widened copy. The codes are widened inside
 * the dot products, and the per-(token, kv head) scales are applied to scores and probabilities
 * (scores = (q . codes_k) * s_k * scale; out = sum_j p_j * s_v[j] * codes_v[j]), the same folding as
 * tokenyard/kernels/decode_group_torch.py's hand-written forms, which stay the reference
 * (tests/kernels/test_cpu_decode_native.py).
 *
 * Layout (tokenyard/kernels/kv_quant.py, engines' KV cache): codes [kvh, slots, hd], scales [kvh, slots];
 * a sequence's key j lives in slot blocks[j / bs] * bs + j % bs. q and out are [B, kvh, rows, hd]
 * (rows = n * group: a kv head's query heads for each of the n query tokens, token-major), mask is
 * the group's additive mask [B, n, nb * bs] (0 or -inf).
 *
 * One thread: the caller runs one call per step and layer; parallelism is the engine's business.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef __AVX2__
#include <immintrin.h>
#endif

#define MAX_ROWS 64

/* Eight codes widened to floats */
#ifdef __AVX2__
static inline __m256 widen8_int8_t(const int8_t *c) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)c)));
}
static inline __m256 widen8_float(const float *c) { return _mm256_loadu_ps(c); }
/* e^x for eight floats (Cephes' polynomial, relative error ~2e-7); e^-inf = 0 exactly */
static inline __m256 exp8(__m256 x) {
    const __m256 masked = _mm256_cmp_ps(x, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
    return _mm256_andnot_ps(masked, y);
}
/* the four horizontal sums of a0..a3, in one vector */
static inline __m128 hsum8x4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif


/* dots[r] = q[r] . codes (r < rows), and out[r] += w[r] * codes: a key's codes are widened once
 * for all the rows of its kv head */
#define DEFINE_HELPERS(CODE)                                                                          \
static inline void dots_##CODE(const float *q, const CODE *c, int64_t rows, int64_t hd, float *kf,     \
                               float *dots) {                                                          \
    int64_t d0 = 0;                                                                                    \
    VECTOR_DOTS(CODE)                                                                                  \
    for (int64_t d = d0; d < hd; d++) kf[d] = (float)c[d];                                             \
    for (int64_t r = 0; r < rows; r++) {                                                               \
        float acc = d0 ? dots[r] : 0.0f;                                                               \
        for (int64_t d = d0; d < hd; d++) acc += q[r * hd + d] * kf[d];                                \
        dots[r] = acc;                                                                                 \
    }                                                                                                  \
}                                                                                                      \
static inline void axpys_##CODE(float *out, const CODE *c, const float *w, int64_t rows, int64_t hd,   \
                                float *kf) {                                                           \
    int64_t d0 = 0;                                                                                    \
    VECTOR_AXPYS(CODE)                                                                                 \
    for (int64_t d = d0; d < hd; d++) kf[d] = (float)c[d];                                             \
    for (int64_t r = 0; r < rows; r++)                                                                 \
        for (int64_t d = d0; d < hd; d++) out[r * hd + d] += w[r] * kf[d];                             \
}

#ifdef __AVX2__
/* rows in fours: four accumulators stay in registers while one key's codes stream past */
#define VECTOR_DOTS(CODE)                                                                             \
    if (hd % 8 == 0) {                                                                                 \
        int64_t r = 0;                                                                                 \
        for (; r + 4 <= rows; r += 4) {                                                                \
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                                \
            const float *q0 = q + r * hd;                                                              \
            for (int64_t d = 0; d < hd; d += 8) {                                                      \
                __m256 k = widen8_##CODE(c + d);                                                       \
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + d), k, a0);                                  \
                a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + hd + d), k, a1);                             \
                a2 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + 2 * hd + d), k, a2);                         \
                a3 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + 3 * hd + d), k, a3);                         \
            }                                                                                          \
            _mm_storeu_ps(dots + r, hsum8x4(a0, a1, a2, a3));                                         \
        }                                                                                              \
        for (; r < rows; r++) {                                                                        \
            __m256 a0 = _mm256_setzero_ps();                                                           \
            for (int64_t d = 0; d < hd; d += 8)                                                        \
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * hd + d), widen8_##CODE(c + d), a0);       \
            dots[r] = hsum8(a0);                                                                       \
        }                                                                                              \
        return;                                                                                        \
    }
#define VECTOR_AXPYS(CODE)                                                                            \
    if (hd % 8 == 0) {                                                                                 \
        for (int64_t d = 0; d < hd; d += 8) {                                                          \
            __m256 v = widen8_##CODE(c + d);                                                           \
            for (int64_t r = 0; r < rows; r++) {                                                       \
                float *o = out + r * hd + d;                                                           \
                _mm256_storeu_ps(o, _mm256_fmadd_ps(_mm256_set1_ps(w[r]), v, _mm256_loadu_ps(o)));      \
            }                                                                                          \
        }                                                                                              \
        return;                                                                                        \
    }
#define VECTOR_EXP                                                                                    \
    {                                                                                                  \
        __m256 acc = _mm256_setzero_ps(), t = _mm256_set1_ps(top);                                     \
        for (; j + 8 <= len; j += 8) {                                                                 \
            __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sr + j), t));                                \
            _mm256_storeu_ps(sr + j, e);                                                               \
            acc = _mm256_add_ps(acc, e);                                                               \
        }                                                                                              \
        sum = hsum8(acc);                                                                              \
    }
#else
#define VECTOR_EXP
#define VECTOR_DOTS(CODE)
#define VECTOR_AXPYS(CODE)
#endif

DEFINE_HELPERS(int8_t)
DEFINE_HELPERS(float)
#define DOTS_int8_t dots_int8_t
#define DOTS_float dots_float
#define AXPYS_int8_t axpys_int8_t
#define AXPYS_float axpys_float


#ifdef __AVX2__
/* Pass 2 with the output tile in registers: for 16 output columns and 4 rows, 8 accumulators
 * stay in registers while every key's 16 codes stream past (instead of loading and storing the
 * rows' outputs once per key). ws: [rows][len] softmax numerators times the value scales. */
#define DEFINE_PV(CODE)                                                                               \
static void pv_tiles_##CODE(float *oh, const CODE *v_codes, const int64_t *table, int64_t h,            \
                            int64_t slots, int64_t bs, const float *ws, int64_t rows, int64_t len,      \
                            int64_t hd) {                                                              \
    const int64_t nb = (len + bs - 1) / bs;                                                            \
    for (int64_t d = 0; d < hd; d += 16) {                                                             \
        int64_t r = 0;                                                                                 \
        for (; r + 4 <= rows; r += 4) {                                                                \
            __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00,   \
                   a30 = a00, a31 = a00;                                                               \
            const float *w0 = ws + r * len, *w1 = w0 + len, *w2 = w1 + len, *w3 = w2 + len;            \
            for (int64_t jb = 0; jb < nb; jb++) {                                                      \
                const CODE *base = v_codes + (h * slots + table[jb] * bs) * hd + d;                    \
                int64_t j0 = jb * bs, end = j0 + bs < len ? bs : len - j0;                             \
                for (int64_t t = 0; t < end; t++) {                                                    \
                    __m256 v0 = widen8_##CODE(base + t * hd), v1 = widen8_##CODE(base + t * hd + 8);   \
                    __m256 w = _mm256_broadcast_ss(w0 + j0 + t);                                       \
                    a00 = _mm256_fmadd_ps(w, v0, a00); a01 = _mm256_fmadd_ps(w, v1, a01);              \
                    w = _mm256_broadcast_ss(w1 + j0 + t);                                              \
                    a10 = _mm256_fmadd_ps(w, v0, a10); a11 = _mm256_fmadd_ps(w, v1, a11);              \
                    w = _mm256_broadcast_ss(w2 + j0 + t);                                              \
                    a20 = _mm256_fmadd_ps(w, v0, a20); a21 = _mm256_fmadd_ps(w, v1, a21);              \
                    w = _mm256_broadcast_ss(w3 + j0 + t);                                              \
                    a30 = _mm256_fmadd_ps(w, v0, a30); a31 = _mm256_fmadd_ps(w, v1, a31);              \
                }                                                                                      \
            }                                                                                          \
            float *o = oh + r * hd + d;                                                                \
            _mm256_storeu_ps(o, a00); _mm256_storeu_ps(o + 8, a01);                                    \
            _mm256_storeu_ps(o + hd, a10); _mm256_storeu_ps(o + hd + 8, a11);                          \
            _mm256_storeu_ps(o + 2 * hd, a20); _mm256_storeu_ps(o + 2 * hd + 8, a21);                  \
            _mm256_storeu_ps(o + 3 * hd, a30); _mm256_storeu_ps(o + 3 * hd + 8, a31);                  \
        }                                                                                              \
        for (; r < rows; r++) {                                                                        \
            __m256 a0 = _mm256_setzero_ps(), a1 = a0;                                                  \
            const float *w0 = ws + r * len;                                                            \
            for (int64_t j = 0; j < len; j++) {                                                        \
                const CODE *vc = v_codes + (h * slots + table[j / bs] * bs + j % bs) * hd + d;         \
                __m256 w = _mm256_broadcast_ss(w0 + j);                                                \
                a0 = _mm256_fmadd_ps(w, widen8_##CODE(vc), a0);                                        \
                a1 = _mm256_fmadd_ps(w, widen8_##CODE(vc + 8), a1);                                    \
            }                                                                                          \
            _mm256_storeu_ps(oh + r * hd + d, a0); _mm256_storeu_ps(oh + r * hd + d + 8, a1);          \
        }                                                                                              \
    }                                                                                                  \
}
DEFINE_PV(int8_t)
DEFINE_PV(float)
#define PV_TILES(CODE, ...) do { if (hd % 16 == 0) { pv_tiles_##CODE(__VA_ARGS__); goto scaled; } } while (0)
#else
#define PV_TILES(CODE, ...) do { } while (0)
#endif

/* scores[r][j] for the rows of one (sequence, kv head); returns 0, or -1 if rows > MAX_ROWS */
#define DEFINE_KERNEL(NAME, CODE)                                                                     \
int NAME(const float *q, const CODE *k_codes, const float *k_scale, const CODE *v_codes,              \
         const float *v_scale, const int64_t *blocks, const float *mask, int64_t batch, int64_t kvh,   \
         int64_t slots, int64_t n, int64_t group, int64_t hd, int64_t nb, int64_t bs, float scale,     \
         float *out, float *work) {                                                                    \
    const int64_t rows = n * group, len = nb * bs;                                                     \
    if (rows > MAX_ROWS) return -1;                                                                    \
    float *kf = work, *scores = work + hd;                     /* hd + rows * len floats */          \
    for (int64_t b = 0; b < batch; b++) {                                                              \
        const int64_t *table = blocks + b * nb;                                                        \
        const float *mb = mask + b * n * len;                                                          \
        for (int64_t h = 0; h < kvh; h++) {                                                            \
            const float *qh = q + (b * kvh + h) * rows * hd;                                           \
            float *oh = out + (b * kvh + h) * rows * hd;                                               \
            float best[MAX_ROWS], total[MAX_ROWS];                                                     \
            for (int64_t r = 0; r < rows; r++) best[r] = -INFINITY;                                   \
            /* pass 1: scores, and each row's maximum */                                               \
            for (int64_t j = 0; j < len; j++) {                                                        \
                int64_t slot = table[j / bs] * bs + j % bs;                                            \
                const CODE *kc = k_codes + (h * slots + slot) * hd;                                    \
                float sk = (k_scale ? k_scale[h * slots + slot] : 1.0f) * scale;                       \
                float dots[MAX_ROWS];                                                                  \
                DOTS_##CODE(qh, kc, rows, hd, kf, dots);                                               \
                for (int64_t r = 0; r < rows; r++) {                                                   \
                    float m = mb[(r / group) * len + j];                                               \
                    float s = m == -INFINITY ? -INFINITY : dots[r] * sk + m;                           \
                    scores[r * len + j] = s;                                                           \
                    if (s > best[r]) best[r] = s;                                                      \
                }                                                                                      \
            }                                                                                          \
            /* softmax numerators, folded with the value scales */                                     \
            for (int64_t r = 0; r < rows; r++) {                                                       \
                float *sr = scores + r * len, sum = 0.0f, top = best[r];                               \
                int64_t j = 0;                                                                         \
                if (top == -INFINITY) top = 0.0f;            /* every key masked: all weights 0 */   \
                VECTOR_EXP                                                                             \
                for (; j < len; j++) {                                                                 \
                    float e = sr[j] == -INFINITY ? 0.0f : expf(sr[j] - top);                           \
                    sum += e;                                                                          \
                    sr[j] = e;                                                                         \
                }                                                                                      \
                total[r] = sum;                                                                        \
                memset(oh + r * hd, 0, sizeof(float) * (size_t)hd);                                    \
            }                                                                                          \
            /* pass 2: out = sum_j p_j * s_v[j] * codes_v[j], then / sum */                           \
            if (v_scale)                                                                               \
                for (int64_t j = 0; j < len; j++) {                                                    \
                    float sv = v_scale[h * slots + table[j / bs] * bs + j % bs];                       \
                    for (int64_t r = 0; r < rows; r++) scores[r * len + j] *= sv;                      \
                }                                                                                      \
            PV_TILES(CODE, oh, v_codes, table, h, slots, bs, scores, rows, len, hd);                   \
            for (int64_t j = 0; j < len; j++) {                                                        \
                int64_t slot = table[j / bs] * bs + j % bs;                                            \
                const CODE *vc = v_codes + (h * slots + slot) * hd;                                    \
                float ws[MAX_ROWS];                                                                    \
                for (int64_t r = 0; r < rows; r++) ws[r] = scores[r * len + j];                      \
                AXPYS_##CODE(oh, vc, ws, rows, hd, kf);                                                \
            }                                                                                          \
        scaled:                                                                                        \
            for (int64_t r = 0; r < rows; r++) {                                                       \
                float inv = total[r] > 0.0f ? 1.0f / total[r] : 0.0f;                                  \
                for (int64_t d = 0; d < hd; d++) oh[r * hd + d] *= inv;                                \
            }                                                                                          \
        }                                                                                              \
    }                                                                                                  \
    return 0;                                                                                          \
}

DEFINE_KERNEL(tokenyard_decode_int8, int8_t)
DEFINE_KERNEL(tokenyard_decode_f32, float)
