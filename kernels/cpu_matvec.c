/* Matrix-vector products of the CPU decode step (cpu_decode_step.c #includes this file): out = W x for
 * a few input vectors, over output rows [r0, r1) that the calling thread owns.
 *
 * Weight forms (ty_linear): fp32 [n, k]; int8 [n, k] with one fp32 scale per row; int4 in groups of
 * `group` inputs, 16 bytes per 32 weights (byte j: weight j in the low nibble, weight j + 16 in the
 * high one, GGUF's order, so one 16-byte load widens into two runs of 16 consecutive weights),
 * w = q * scale + min with fp32 scale and min per (row, group).
 *
 * One vector (batch 1) is a read of the weights: rows stream one at a time, in order, with several
 * accumulator chains along each row. Several vectors are arithmetic: tokens run in register tiles
 * of 8, 4, 2 and 1 against each row, which is read from memory once.
 *
 * Vectors: GCC's vector extensions (16 floats), which the compiler lowers to AVX-512, AVX2 or SSE
 * for the machine it builds on (-march=native); the scalar tails keep any k correct.
 */
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#define TY_MAX_BATCH 64          /* input vectors per call */

typedef float v16f __attribute__((vector_size(64)));
typedef uint8_t v16u8 __attribute__((vector_size(16)));
typedef int8_t v16i8 __attribute__((vector_size(16)));

enum { TY_F32 = 0, TY_INT8 = 1, TY_INT4 = 2 };

typedef struct {
    int64_t kind, n, k, group;
    const void *w;          /* fp32 [n, k] | int8 [n, k] | uint8 [n, k / 2] */
    const float *scale;     /* int8: [n]; int4: [n, k / group] */
    const float *minv;      /* int4: [n, k / group] */
    const float *bias;      /* [n] or NULL */
} ty_linear;

/* ---------------------------------------------------------------- vectors */

static inline float hsum16(v16f v) {
    float s = 0.0f;
    for (int i = 0; i < 16; i++) s += v[i];
    return s;
}
static inline v16f load16(const float *p) { v16f v; memcpy(&v, p, sizeof v); return v; }
static inline v16f splat16(float f) { return (v16f){f, f, f, f, f, f, f, f, f, f, f, f, f, f, f, f}; }

/* 16 bytes widened to 16 floats. GCC lowers __builtin_convertvector on byte vectors to scalar
 * inserts, so the x86 forms say which instructions to use. */
#if defined(__AVX512F__)
static inline v16f widen_u8(v16u8 c) { __m128i b; memcpy(&b, &c, 16); return (v16f)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)); }
static inline v16f widen_i8(v16i8 c) { __m128i b; memcpy(&b, &c, 16); return (v16f)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)); }
#elif defined(__AVX2__)
static inline v16f widen_u8(v16u8 c) {
    __m128i b; memcpy(&b, &c, 16);
    __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)), hi = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)));
    v16f out; memcpy(&out, &lo, 32); memcpy((char *)&out + 32, &hi, 32); return out;
}
static inline v16f widen_i8(v16i8 c) {
    __m128i b; memcpy(&b, &c, 16);
    __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
    v16f out; memcpy(&out, &lo, 32); memcpy((char *)&out + 32, &hi, 32); return out;
}
#else
static inline v16f widen_u8(v16u8 c) { return __builtin_convertvector(c, v16f); }
static inline v16f widen_i8(v16i8 c) { return __builtin_convertvector(c, v16f); }
#endif

/* ---------------------------------------------------------------- matrix-vector products */

/* Several tokens against one weight row: NB accumulators stay in registers while the row streams
 * past once (NB a constant, so the compiler unrolls the token loop); TILES runs a batch as tiles
 * of 8, then 4, 2 and 1. The row is read from memory once and from L1 for the later tiles. */
#define DEFINE_ROWS(NB)                                                                                   \
static inline void row_f32_##NB(const float *w, int64_t k, const float *x, int64_t ld_x, float *y) {    \
    const int64_t kv = k & ~(int64_t)15;                                                                \
    v16f acc[NB];                                                                                        \
    for (int b = 0; b < NB; b++) acc[b] = splat16(0);                                                   \
    for (int64_t d = 0; d < kv; d += 16) {                                                              \
        const v16f wv = load16(w + d);                                                                  \
        for (int b = 0; b < NB; b++) acc[b] += wv * load16(x + b * ld_x + d);                           \
    }                                                                                                    \
    for (int b = 0; b < NB; b++) {                                                                      \
        float t = hsum16(acc[b]);                                                                        \
        for (int64_t d = kv; d < k; d++) t += w[d] * x[b * ld_x + d];                                    \
        y[b] = t;                                                                                        \
    }                                                                                                    \
}                                                                                                        \
static inline void row_int8_##NB(const int8_t *w, int64_t k, const float *x, int64_t ld_x, float *y) {  \
    const int64_t kv = k & ~(int64_t)15;                                                                \
    v16f acc[NB];                                                                                        \
    for (int b = 0; b < NB; b++) acc[b] = splat16(0);                                                   \
    for (int64_t d = 0; d < kv; d += 16) {                                                              \
        v16i8 c;                                                                                         \
        memcpy(&c, w + d, 16);                                                                           \
        const v16f wv = widen_i8(c);                                                                     \
        for (int b = 0; b < NB; b++) acc[b] += wv * load16(x + b * ld_x + d);                           \
    }                                                                                                    \
    for (int b = 0; b < NB; b++) {                                                                      \
        float t = hsum16(acc[b]);                                                                        \
        for (int64_t d = kv; d < k; d++) t += (float)w[d] * x[b * ld_x + d];                             \
        y[b] = t;                                                                                        \
    }                                                                                                    \
}                                                                                                        \
/* int4: the block's 32 weights are unpacked and scaled once for the NB tokens */                       \
static inline void row_int4_##NB(const uint8_t *w, const float *sc, int64_t sh, int64_t k,              \
                                 const float *x, int64_t ld_x, float *y) {                               \
    const v16u8 low = {15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15};                 \
    v16f acc[NB];                                                                                        \
    for (int b = 0; b < NB; b++) acc[b] = splat16(0);                                                   \
    for (int64_t q = 0; q < k / 32; q++) {                                                              \
        v16u8 c;                                                                                         \
        memcpy(&c, w + q * 16, 16);                                                                      \
        const v16f s = splat16(sc[q >> sh]);                                                             \
        const v16f lo = widen_u8(c & low) * s, hi = widen_u8(c >> 4) * s;                                \
        for (int b = 0; b < NB; b++) {                                                                  \
            const float *xb = x + b * ld_x + q * 32;                                                     \
            acc[b] += lo * load16(xb) + hi * load16(xb + 16);                                            \
        }                                                                                                \
    }                                                                                                    \
    for (int b = 0; b < NB; b++) y[b] = hsum16(acc[b]);                                                 \
}
DEFINE_ROWS(8)
DEFINE_ROWS(4)
DEFINE_ROWS(2)
DEFINE_ROWS(1)

#define TILES(ROW, w, k, x, ld_x, batch, y)                                                               \
    do {                                                                                                 \
        int64_t b_ = 0;                                                                                  \
        for (; b_ + 8 <= (batch); b_ += 8) ROW##_8(w, k, (x) + b_ * (ld_x), ld_x, (y) + b_);            \
        if ((batch) - b_ >= 4) { ROW##_4(w, k, (x) + b_ * (ld_x), ld_x, (y) + b_); b_ += 4; }           \
        if ((batch) - b_ >= 2) { ROW##_2(w, k, (x) + b_ * (ld_x), ld_x, (y) + b_); b_ += 2; }           \
        if ((batch) - b_ >= 1) ROW##_1(w, k, (x) + b_ * (ld_x), ld_x, (y) + b_);                        \
    } while (0)
#define TILES4(w, sc, sh, k, x, ld_x, batch, y)                                                           \
    do {                                                                                                 \
        int64_t b_ = 0;                                                                                  \
        for (; b_ + 8 <= (batch); b_ += 8) row_int4_8(w, sc, sh, k, (x) + b_ * (ld_x), ld_x, (y) + b_); \
        if ((batch) - b_ >= 4) { row_int4_4(w, sc, sh, k, (x) + b_ * (ld_x), ld_x, (y) + b_); b_ += 4; }\
        if ((batch) - b_ >= 2) { row_int4_2(w, sc, sh, k, (x) + b_ * (ld_x), ld_x, (y) + b_); b_ += 2; }\
        if ((batch) - b_ >= 1) row_int4_1(w, sc, sh, k, (x) + b_ * (ld_x), ld_x, (y) + b_);             \
    } while (0)

/* out[b * ld_out + r] (+)= W[r] . x[b * ld_x] for r in [r0, r1), b < batch. accumulate: add to out. */
static void mv_f32(const ty_linear *L, const float *x, int64_t ld_x, int64_t batch, int64_t r0, int64_t r1,
                   float *out, int64_t ld_out, int accumulate) {
    const float *W = (const float *)L->w;
    const int64_t k = L->k, kv = k & ~(int64_t)15;
    int64_t r = r0;
    if (batch == 1) {
        /* one row at a time, so the weights stream through memory in order (the prefetchers follow
         * one sequential stream; four rows at once made four short streams and ran ~1.5x slower),
         * with four accumulator chains along the row */
        const int64_t k64 = k & ~(int64_t)63;
        for (; r < r1; r++) {
            const float *w = W + r * k;
            v16f a0 = splat16(0), a1 = a0, a2 = a0, a3 = a0;
            int64_t d = 0;
            for (; d < k64; d += 64) {
                a0 += load16(w + d) * load16(x + d);
                a1 += load16(w + d + 16) * load16(x + d + 16);
                a2 += load16(w + d + 32) * load16(x + d + 32);
                a3 += load16(w + d + 48) * load16(x + d + 48);
            }
            for (; d < kv; d += 16) a0 += load16(w + d) * load16(x + d);
            float y = hsum16((a0 + a1) + (a2 + a3));
            for (; d < k; d++) y += w[d] * x[d];
            y += L->bias ? L->bias[r] : 0.0f;
            out[r] = accumulate ? out[r] + y : y;
        }
    }
    for (; r < r1; r++) {
        const float *w = W + r * k;
        float y[TY_MAX_BATCH];
        TILES(row_f32, w, k, x, ld_x, batch, y);
        for (int64_t b = 0; b < batch; b++) {
            float *o = out + b * ld_out + r;
            float v = y[b] + (L->bias ? L->bias[r] : 0.0f);
            *o = accumulate ? *o + v : v;
        }
    }
}

static void mv_int8(const ty_linear *L, const float *x, int64_t ld_x, int64_t batch, int64_t r0, int64_t r1,
                    float *out, int64_t ld_out, int accumulate) {
    const int8_t *W = (const int8_t *)L->w;
    const int64_t k = L->k, kv = k & ~(int64_t)15;
    if (batch == 1) {
        /* one row at a time (one sequential stream), four accumulator chains along it */
        const int64_t k64 = k & ~(int64_t)63;
        for (int64_t r = r0; r < r1; r++) {
            const int8_t *w = W + r * k;
            v16f a0 = splat16(0), a1 = a0, a2 = a0, a3 = a0;
            int64_t d = 0;
            for (; d < k64; d += 64) {
                v16i8 c0, c1, c2, c3;
                memcpy(&c0, w + d, 16); memcpy(&c1, w + d + 16, 16);
                memcpy(&c2, w + d + 32, 16); memcpy(&c3, w + d + 48, 16);
                a0 += widen_i8(c0) * load16(x + d);
                a1 += widen_i8(c1) * load16(x + d + 16);
                a2 += widen_i8(c2) * load16(x + d + 32);
                a3 += widen_i8(c3) * load16(x + d + 48);
            }
            for (; d < kv; d += 16) { v16i8 c; memcpy(&c, w + d, 16); a0 += widen_i8(c) * load16(x + d); }
            float y = hsum16((a0 + a1) + (a2 + a3));
            for (; d < k; d++) y += (float)w[d] * x[d];
            y = y * L->scale[r] + (L->bias ? L->bias[r] : 0.0f);
            out[r] = accumulate ? out[r] + y : y;
        }
        return;
    }
    for (int64_t r = r0; r < r1; r++) {
        const int8_t *w = W + r * k;
        float y[TY_MAX_BATCH];
        TILES(row_int8, w, k, x, ld_x, batch, y);
        for (int64_t b = 0; b < batch; b++) {
            float *o = out + b * ld_out + r;
            float v = y[b] * L->scale[r] + (L->bias ? L->bias[r] : 0.0f);
            *o = accumulate ? *o + v : v;
        }
    }
}

/* int4: sum over groups g of scale[g] * (q_g . x_g) + min[g] * sum(x_g); the sums of x per group
 * (gsum) are computed once per call by the thread. k % 32 == 0 and group % 32 == 0 (checked at
 * creation). */
static void mv_int4(const ty_linear *L, const float *x, int64_t ld_x, int64_t batch, int64_t r0, int64_t r1,
                    float *out, int64_t ld_out, int accumulate, float *gsum) {
    const uint8_t *W = (const uint8_t *)L->w;
    const int64_t k = L->k, g = L->group, ng = k / g, per = g / 32;
    for (int64_t b = 0; b < batch; b++)
        for (int64_t j = 0; j < ng; j++) {
            v16f a = splat16(0);
            const float *xs = x + b * ld_x + j * g;
            for (int64_t d = 0; d < g; d += 16) a += load16(xs + d);
            gsum[b * ng + j] = hsum16(a);
        }
    const v16u8 low = {15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15};
    if (batch == 1) {
        /* one row at a time (one sequential stream), 32-weight blocks in pairs: two accumulator
         * chains in registers; block q's scale is group q >> sh's */
        const int64_t nq = k / 32, sh = __builtin_ctzll((unsigned long long)per);
        for (int64_t r = r0; r < r1; r++) {
            const uint8_t *w = W + r * (k / 2);
            const float *sc = L->scale + r * ng, *mn = L->minv + r * ng;
            v16f a0 = splat16(0), a1 = a0;
            int64_t q = 0;
            for (; q + 2 <= nq; q += 2) {
                v16u8 c0, c1;
                memcpy(&c0, w + q * 16, 16);
                memcpy(&c1, w + q * 16 + 16, 16);
                const float *xb = x + q * 32;
                v16f p0 = widen_u8(c0 & low) * load16(xb) + widen_u8(c0 >> 4) * load16(xb + 16);
                v16f p1 = widen_u8(c1 & low) * load16(xb + 32) + widen_u8(c1 >> 4) * load16(xb + 48);
                a0 += p0 * splat16(sc[q >> sh]);
                a1 += p1 * splat16(sc[(q + 1) >> sh]);
            }
            if (q < nq) {
                v16u8 c0;
                memcpy(&c0, w + q * 16, 16);
                const float *xb = x + q * 32;
                a0 += (widen_u8(c0 & low) * load16(xb) + widen_u8(c0 >> 4) * load16(xb + 16)) * splat16(sc[q >> sh]);
            }
            float off = 0.0f;
            for (int64_t j = 0; j < ng; j++) off += mn[j] * gsum[j];
            float y = hsum16(a0 + a1) + off + (L->bias ? L->bias[r] : 0.0f);
            out[r] = accumulate ? out[r] + y : y;
        }
        return;
    }
    const int64_t sh = __builtin_ctzll((unsigned long long)per);
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *w = W + r * (k / 2);
        const float *sc = L->scale + r * ng, *mn = L->minv + r * ng;
        float y[TY_MAX_BATCH];
        TILES4(w, sc, sh, k, x, ld_x, batch, y);
        for (int64_t b = 0; b < batch; b++) {
            float off = 0.0f;
            for (int64_t j = 0; j < ng; j++) off += mn[j] * gsum[b * ng + j];
            float *o = out + b * ld_out + r;
            float v = y[b] + off + (L->bias ? L->bias[r] : 0.0f);
            *o = accumulate ? *o + v : v;
        }
    }
}

static void matvec(const ty_linear *L, const float *x, int64_t ld_x, int64_t batch, int64_t r0, int64_t r1,
                   float *out, int64_t ld_out, int accumulate, float *gsum) {
    if (r0 >= r1) return;
    if (L->kind == TY_F32) mv_f32(L, x, ld_x, batch, r0, r1, out, ld_out, accumulate);
    else if (L->kind == TY_INT8) mv_int8(L, x, ld_x, batch, r0, r1, out, ld_out, accumulate);
    else mv_int4(L, x, ld_x, batch, r0, r1, out, ld_out, accumulate, gsum);
}

