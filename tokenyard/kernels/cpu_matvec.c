/* Matrix-vector products of the CPU decode step (cpu_decode_step.c #includes this file): out = W x for
 * a few input vectors (one per sequence in the step), over output rows [r0, r1) that the calling
 * thread owns.
 *
 * Weight forms (ty_linear): fp32 [n, k]; int8 [n, k] with one fp32 scale per row; int4 in groups of
 * `group` inputs, 16 bytes per 32 weights (byte j: weight j in the low nibble, weight j + 16 in the
 * high one, GGUF's order, so one 16-byte load widens into two runs of 16 consecutive weights),
 * w = q * scale + min with fp32 scale and min per (row, group).
 *
 * Form: register tiles of TR rows x TT tokens in dot-product form (the llamafile/tinyBLAS shape of
 * a CPU GEMM on row-major weights). Each step along k loads TR weight vectors and TT input vectors
 * and does TR * TT multiply-adds, into TR * TT accumulators that are reduced once per (row, token)
 * at the end of the row. Batch 1 is a TR x 1 tile: TR rows stream side by side. Quantised weights
 * are widened inside the tile while the batch is small; from TY_DEQUANT_BATCH tokens on, TR rows at
 * a time are widened once into a small fp32 panel that the fp32 tiles then read for every token.
 * From TY_PANEL_BATCH tokens on (fp32, and quantised rows once widened) the products leave this form
 * for packed panels in outer-product form (cpu_matvec_panel.c), which reuse each weight across tokens
 * better.
 *
 * Why (scratch timings on an AMD EPYC Zen 3, AVX2 with 16 vector registers, one thread, W2 shapes):
 * the forms this replaced (one row against up to eight tokens in 16-float vectors; batch 1 as one
 * row stream reduced by a scalar loop) spilled registers on AVX2 and ran at about 3.4 GFLOP/s for
 * fp32 batches and 4.8 at batch 1. tokenyard/bench/matvec_tiles.py times the current forms (bench/RESULTS.md).
 *
 * Vectors: GCC's vector extensions in the machine's width (vf: 16 floats with AVX-512, 8 with AVX2
 * and below), with x86 intrinsics where GCC would otherwise widen bytes one at a time; the scalar
 * tails keep any k correct.
 */
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#define TY_MAX_BATCH 256         /* sequences per step (the pool's buffers are sized by max_batch) */

typedef uint8_t v16u8 __attribute__((vector_size(16)));

enum { TY_F32 = 0, TY_INT8 = 1, TY_INT4 = 2, TY_INT4R16 = 3 };   /* R16: int4 in 16-row blocks (cpu_matvec_q8.c) */

typedef struct {
    int64_t kind, n, k, group;
    const void *w;          /* fp32 [n, k] | int8 [n, k] | uint8 [n, k / 2] */
    const float *scale;     /* int8: [n]; int4: [n, k / group] */
    const float *minv;      /* int4: [n, k / group] */
    const float *bias;      /* [n] or NULL */
} ty_linear;

/* a thread's working memory for the products */
typedef struct {
    float *gsum;            /* int4: per-group input sums, [batch, k / 32] */
    float *wbuf;            /* dequantised rows: [TY_WBUF_ROWS, k] */
    float *q8;              /* int4 with int8 inputs: per token, group sums, block scales and codes */
    const float *prepared;  /* the inputs whose int8 form q8 holds (the same for every chunk of a
                             * phase); NULL when stale: the step clears it after each barrier */
    float *panel;           /* packed weights for the outer-product tiles: [TY_KC, TY_PR] (cpu_matvec_panel.c) */
} ty_scratch;

/* ---------------------------------------------------------------- vectors and tile shapes */

#if defined(__AVX512F__)
#define TY_VW 16
#else
#define TY_VW 8
#endif
/* Tile shapes, rows x tokens (-D overrides: tokenyard/bench/matvec_tiles.py). AVX2 (16 registers): fp32 4 x 3
 * and int4 2 x 4 measured fastest (int4 keeps codes and scales in registers too). AVX-512 (32
 * registers): not measured here (no such machine this session); sized to fill the registers. */
#if TY_VW == 16
#define TY_TR_DEFAULT 4
#define TY_TT_DEFAULT 6
#define TY4_TR_DEFAULT 4
#else
#define TY_TR_DEFAULT 4
#define TY_TT_DEFAULT 3
#define TY4_TR_DEFAULT 2
#endif
#ifndef TY_TR
#define TY_TR TY_TR_DEFAULT
#endif
#ifndef TY_TT
#define TY_TT TY_TT_DEFAULT
#endif
#ifndef TY4_TR
#define TY4_TR TY4_TR_DEFAULT
#endif
#ifndef TY4_TT
#define TY4_TT 4
#endif
#ifndef TY_DEQUANT_BATCH         /* from this many tokens on, quantised rows go through an fp32 panel */
#define TY_DEQUANT_BATCH 8
#endif

typedef float vf __attribute__((vector_size(TY_VW * 4)));

static inline vf loadv(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void storev(float *p, vf v) { memcpy(p, &v, sizeof v); }
static inline float hsumv(vf v) {
#if defined(__AVX512F__)
    __m512 z; memcpy(&z, &v, 64); return _mm512_reduce_add_ps(z);
#elif defined(__AVX__)
    __m256 y; memcpy(&y, &v, 32);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(y), _mm256_extractf128_ps(y, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
#else
    float t = 0.0f;
    for (int i = 0; i < TY_VW; i++) t += v[i];
    return t;
#endif
}
/* the sums of four vectors, into out[0..3] (one transposing reduction instead of four) */
static inline void hsum4(vf a, vf b, vf c, vf d, float *out) {
#if defined(__AVX__)
    __m256 y[4];
#if TY_VW == 16
    const vf v[4] = {a, b, c, d};
    for (int i = 0; i < 4; i++) {
        __m512 z; memcpy(&z, &v[i], 64);
        y[i] = _mm256_add_ps(_mm512_castps512_ps256(z), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(z), 1)));
    }
#else
    memcpy(&y[0], &a, 32); memcpy(&y[1], &b, 32); memcpy(&y[2], &c, 32); memcpy(&y[3], &d, 32);
#endif
    __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(y[0], y[1]), _mm256_hadd_ps(y[2], y[3]));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
#else
    out[0] = hsumv(a); out[1] = hsumv(b); out[2] = hsumv(c); out[3] = hsumv(d);
#endif
}
/* TY_VW int8 weights at p, widened (GCC widens byte vectors one element at a time: hence intrinsics) */
static inline vf widen_i8v(const int8_t *p) {
    vf out;
#if TY_VW == 16
    __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    memcpy(&out, &f, 64);
#elif defined(__AVX2__)
    __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
    memcpy(&out, &f, 32);
#else
    for (int i = 0; i < TY_VW; i++) out[i] = (float)p[i];
#endif
    return out;
}
/* 16 codes (one per byte of c) as 16 / TY_VW vectors: part j holds codes [j * TY_VW, (j + 1) * TY_VW) */
static inline vf widen_u8v(v16u8 c, int part) {
    vf out;
#if TY_VW == 16
    (void)part;
    __m128i b; memcpy(&b, &c, 16);
    __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b));
    memcpy(&out, &f, 64);
#elif defined(__AVX2__)
    __m128i b; memcpy(&b, &c, 16);
    if (part) b = _mm_srli_si128(b, 8);
    __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
    memcpy(&out, &f, 32);
#else
    for (int i = 0; i < TY_VW; i++) out[i] = (float)c[part * TY_VW + i];
#endif
    return out;
}

/* ---------------------------------------------------------------- tiles */

/* The end of one (row, token) product s = w_r . x_t over the vectorised part of k: the scalar tail
 * of k (fp32 and int8; int4 rows are whole blocks), the int8 row scale, the int4 group minimums
 * (mn_r . the token's per-group input sums gs), the bias; then stored or added. `kind` is a
 * constant in every caller, so each tile keeps only its own branch. */
static inline __attribute__((always_inline)) void finish(int kind, const ty_linear *L, int64_t r, float s,
                                                         const float *x, const float *gs, float *o, int accumulate) {
    const int64_t k = L->k;
    if (kind == TY_F32) {
        const float *w = (const float *)L->w + r * k;
        for (int64_t d = k - k % TY_VW; d < k; d++) s += w[d] * x[d];
    } else if (kind == TY_INT8) {
        const int8_t *w = (const int8_t *)L->w + r * k;
        for (int64_t d = k - k % TY_VW; d < k; d++) s += (float)w[d] * x[d];
        s *= L->scale[r];
    } else {
        const int64_t ng = k / L->group;
        const float *mn = L->minv + r * ng;
        for (int64_t j = 0; j < ng; j++) s += mn[j] * gs[j];
    }
    if (L->bias) s += L->bias[r];
    *o = accumulate ? *o + s : s;
}

/* Rows [r, r + R) against tokens [0, T): x points at token 0 (tokens ld_x apart), gsum at its group
 * sums (k / group apart; int4 only), out at its output row (ld_out apart). */
#define TILE_ARGS const ty_linear *L, int64_t r, const float *x, int64_t ld_x, const float *gsum, \
                  float *out, int64_t ld_out, int accumulate
#define TILE_BEGIN(R, T)                                                                                  \
    const int64_t k = L->k, kv = k - k % TY_VW;                                                         \
    vf acc[R][T];                                                                                        \
    for (int i = 0; i < R; i++) for (int t = 0; t < T; t++) acc[i][t] = (vf){0};
/* the tile's sums, four rows of a token at a time where the tile has four rows */
#define TILE_END(KIND, R, T)                                                                              \
    const int64_t ng_ = KIND == TY_INT4 ? k / L->group : 0;                                             \
    for (int t = 0; t < T; t++) {                                                                        \
        float sums[R + 4];                                                                               \
        int i = 0;                                                                                       \
        for (; i + 4 <= R; i += 4) hsum4(acc[i][t], acc[i + 1][t], acc[i + 2][t], acc[i + 3][t], sums + i); \
        for (; i < R; i++) sums[i] = hsumv(acc[i][t]);                                                   \
        for (i = 0; i < R; i++)                                                                          \
            finish(KIND, L, r + i, sums[i], x + t * ld_x, gsum + t * ng_, out + t * ld_out + r + i, accumulate); \
    }
/* the multiply-adds of one vector step: wv[i] (row i's weights) against every token's inputs at d */
#define TILE_FMA(R, T, d)                                                                                 \
    for (int t = 0; t < T; t++) {                                                                        \
        const vf xv = loadv(x + t * ld_x + (d));                                                         \
        for (int i = 0; i < R; i++) acc[i][t] += wv[i] * xv;                                             \
    }

/* fp32 and int8 tiles differ only in how a vector of weights is loaded (LOAD: from WT *) */
#define DEFINE_TILE_DENSE(NAME, KIND, WT, LOAD, R, T)                                                     \
static inline void tile_##NAME##_##R##x##T(TILE_ARGS) {                                                  \
    TILE_BEGIN(R, T)                                                                                     \
    const WT *w = (const WT *)L->w + r * k;                                                              \
    for (int64_t d = 0; d < kv; d += TY_VW) {                                                           \
        vf wv[R];                                                                                        \
        for (int i = 0; i < R; i++) wv[i] = LOAD(w + i * k + d);                                         \
        TILE_FMA(R, T, d)                                                                                \
    }                                                                                                    \
    TILE_END(KIND, R, T)                                                                                 \
}
#define DEFINE_TILE_F32_INT8(R, T)                                                                        \
    DEFINE_TILE_DENSE(f32, TY_F32, float, loadv, R, T)                                                   \
    DEFINE_TILE_DENSE(int8, TY_INT8, int8_t, widen_i8v, R, T)
/* int4: a 32-weight block's codes are unpacked and scaled once per row for the T tokens */
#define DEFINE_TILE_INT4(R, T)                                                                            \
static inline void tile_int4_##R##x##T(TILE_ARGS) {                                                      \
    TILE_BEGIN(R, T)                                                                                     \
    (void)kv;                                                                                            \
    const v16u8 low = {15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15};                 \
    const int64_t ng = k / L->group, sh = __builtin_ctzll((unsigned long long)(L->group / 32));          \
    const uint8_t *w = (const uint8_t *)L->w + r * (k / 2);                                              \
    const float *sc = L->scale + r * ng;                                                                 \
    for (int64_t q = 0; q < k / 32; q++) {                                                              \
        v16u8 c[R];                                                                                      \
        vf s[R];                                                                                         \
        for (int i = 0; i < R; i++) {                                                                    \
            memcpy(&c[i], w + i * (k / 2) + q * 16, 16);                                                 \
            s[i] = (vf){0} + sc[i * ng + (q >> sh)];                                                     \
        }                                                                                                \
        for (int j = 0; j < 32 / TY_VW; j++) {                                                          \
            vf wv[R];                                                                                    \
            for (int i = 0; i < R; i++)                                                                  \
                wv[i] = widen_u8v(j < 16 / TY_VW ? (c[i] & low) : (c[i] >> 4), j % (16 / TY_VW)) * s[i]; \
            TILE_FMA(R, T, q * 32 + j * TY_VW)                                                           \
        }                                                                                                \
    }                                                                                                    \
    TILE_END(TY_INT4, R, T)                                                                              \
}
#define DEFINE_(MACRO, R, T) MACRO(R, T)
DEFINE_(DEFINE_TILE_F32_INT8, TY_TR, TY_TT)
DEFINE_(DEFINE_TILE_F32_INT8, TY_TR, 1)
DEFINE_(DEFINE_TILE_F32_INT8, 1, TY_TT)
DEFINE_TILE_F32_INT8(1, 1)
DEFINE_(DEFINE_TILE_INT4, TY4_TR, TY4_TT)
DEFINE_(DEFINE_TILE_INT4, TY4_TR, 1)
DEFINE_(DEFINE_TILE_INT4, 1, TY4_TT)
DEFINE_TILE_INT4(1, 1)

#define TILE_NAME_(KIND, R, T) tile_##KIND##_##R##x##T
#define TILE_NAME(KIND, R, T) TILE_NAME_(KIND, R, T)
/* Rows [r0, r1) against `batch` tokens, in TR x TT tiles and 1-row / 1-token edges; ng: group sums
 * per token. A row tile runs against every token of a block before the next row tile, so its
 * weights stay in L1 while the block's inputs come from L2; blocks hold at most TY_BLOCK_BYTES of
 * inputs, so that they stay in L2 (96 tokens of the W2 down projection's 1408 inputs, 540 KB, did
 * not, and every row tile read them from L3). */
#ifndef TY_BLOCK_BYTES
#define TY_BLOCK_BYTES (192 * 1024)
#endif
#define DEFINE_TILES(KIND, TR, TT)                                                                        \
static void tiles_##KIND(const ty_linear *L, const float *x, int64_t ld_x, int64_t batch, int64_t r0,    \
                         int64_t r1, float *out, int64_t ld_out, int accumulate, const float *gsum, int64_t ng) { \
    int64_t block = TY_BLOCK_BYTES / (4 * L->k) / TT * TT;                                              \
    if (block < TT) block = TT;                                                                          \
    for (int64_t b0 = 0; b0 < batch; b0 += block) {                                                     \
        const int64_t b1 = b0 + block < batch ? b0 + block : batch;                                      \
        int64_t r = r0;                                                                                  \
        for (; r + TR <= r1; r += TR) {                                                                  \
            int64_t b = b0;                                                                              \
            for (; b + TT <= b1; b += TT)                                                                \
                TILE_NAME(KIND, TR, TT)(L, r, x + b * ld_x, ld_x, gsum + b * ng, out + b * ld_out, ld_out, accumulate); \
            for (; b < b1; b++)                                                                          \
                TILE_NAME(KIND, TR, 1)(L, r, x + b * ld_x, ld_x, gsum + b * ng, out + b * ld_out, ld_out, accumulate); \
        }                                                                                                \
        for (; r < r1; r++) {                                                                            \
            int64_t b = b0;                                                                              \
            for (; b + TT <= b1; b += TT)                                                                \
                TILE_NAME(KIND, 1, TT)(L, r, x + b * ld_x, ld_x, gsum + b * ng, out + b * ld_out, ld_out, accumulate); \
            for (; b < b1; b++)                                                                          \
                tile_##KIND##_1x1(L, r, x + b * ld_x, ld_x, gsum + b * ng, out + b * ld_out, ld_out, accumulate); \
        }                                                                                                \
    }                                                                                                    \
}
DEFINE_TILES(f32, TY_TR, TY_TT)
/* fp32 at batch 1: eight rows side by side (one thread streams weights faster from eight rows than
 * from four: 8.8 against 7.1 GFLOP/s on the W2 shapes in a scratch run of tokenyard/bench/matvec_tiles.py) */
#if TY_TR != 8
DEFINE_TILE_F32_INT8(8, 1)
#endif
static void rows_f32_b1(const ty_linear *L, const float *x, int64_t r0, int64_t r1, float *out, int accumulate) {
    int64_t r = r0;
    for (; r + 8 <= r1; r += 8) tile_f32_8x1(L, r, x, 0, x, out, 0, accumulate);
    if (r < r1) tiles_f32(L, x, L->k, 1, r, r1, out, 0, accumulate, x, 0);
}
DEFINE_TILES(int8, TY_TR, TY_TT)
DEFINE_TILES(int4, TY4_TR, TY4_TT)

#include "cpu_matvec_q8.c"
#ifndef TY_ROWS16
#define TY_ROWS16 0
#endif
#include "cpu_matvec_panel.c"
#define TY_WBUF_ROWS (TY_PR > TY_TR ? TY_PR : TY_TR)   /* rows of quantised weights widened at a time */

/* ---------------------------------------------------------------- products */

/* rows [r, r + rows) of a quantised projection as fp32 [rows, k] (w = q * scale, or q * scale + min) */
static void dequantise_rows(const ty_linear *L, int64_t r, int64_t rows, float *buf) {
    const int64_t k = L->k;
    if (L->kind == TY_INT8) {
        for (int64_t i = 0; i < rows; i++) {
            const int8_t *w = (const int8_t *)L->w + (r + i) * k;
            const vf s = (vf){0} + L->scale[r + i];
            int64_t d = 0;
            for (; d + TY_VW <= k; d += TY_VW) storev(buf + i * k + d, widen_i8v(w + d) * s);
            for (; d < k; d++) buf[i * k + d] = (float)w[d] * L->scale[r + i];
        }
        return;
    }
    const v16u8 low = {15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15};
    const int64_t ng = k / L->group, sh = __builtin_ctzll((unsigned long long)(L->group / 32));
    for (int64_t i = 0; i < rows; i++) {
        const int64_t row = r + i;
        const uint8_t *w = (const uint8_t *)L->w + row * (k / 2);
        for (int64_t q = 0; q < k / 32; q++) {
            v16u8 c;
            float sv, mv;                        /* this block's scale and minimum */
#if TY_ROWS16
            if (L->kind == TY_INT4R16) {
                c = r16_row_codes(L, row, q);
                const int64_t at = r16_vec(L, row / 16, q >> sh) + row % 16;
                sv = r16_half(L->scale, at);
                mv = r16_half(L->minv, at);
            } else
#endif
            {
                memcpy(&c, w + q * 16, 16);
                sv = L->scale[row * ng + (q >> sh)];
                mv = L->minv[row * ng + (q >> sh)];
            }
            const vf s = (vf){0} + sv, m = (vf){0} + mv;
            float *o = buf + i * k + q * 32;
            for (int j = 0; j < 32 / TY_VW; j++)
                storev(o + j * TY_VW, widen_u8v(j < 16 / TY_VW ? (c & low) : (c >> 4), j % (16 / TY_VW)) * s + m);
        }
    }
}

/* out[b * ld_out + r] (+)= W[r] . x[b * ld_x] for r in [r0, r1), b < batch. accumulate: add to out. */
static void matvec(const ty_linear *L, const float *x, int64_t ld_x, int64_t batch, int64_t r0, int64_t r1,
                   float *out, int64_t ld_out, int accumulate, ty_scratch *scratch) {
    if (r0 >= r1) return;
    if (L->kind == TY_F32) {
        if (batch == 1) rows_f32_b1(L, x, r0, r1, out, accumulate);
        else if (batch >= TY_PANEL_BATCH) panels_f32(L, x, ld_x, batch, r0, r1, out, ld_out, accumulate, scratch->panel);
        else tiles_f32(L, x, ld_x, batch, r0, r1, out, ld_out, accumulate, x, 0);
        return;
    }
    if (batch >= TY_PANEL_BATCH) {
        /* TY_PR rows at a time widened into fp32 rows, then packed into panels like fp32 weights */
        for (int64_t r = r0; r < r1; r += TY_PR) {
            const int64_t rows = r1 - r < TY_PR ? r1 - r : TY_PR;
            dequantise_rows(L, r, rows, scratch->wbuf);
            const ty_linear panel = {TY_F32, rows, L->k, 0, scratch->wbuf, NULL, NULL, L->bias ? L->bias + r : NULL};
            panels_f32(&panel, x, ld_x, batch, 0, rows, out + r, ld_out, accumulate, scratch->panel);
        }
        return;
    }
    if (batch >= TY_DEQUANT_BATCH) {
        /* TY_TR rows at a time widened once into an fp32 panel (the weights including scale and min,
         * so only the bias is left), then the fp32 tiles over every token */
        for (int64_t r = r0; r < r1; r += TY_TR) {
            const int64_t rows = r1 - r < TY_TR ? r1 - r : TY_TR;
            dequantise_rows(L, r, rows, scratch->wbuf);
            const ty_linear panel = {TY_F32, rows, L->k, 0, scratch->wbuf, NULL, NULL, L->bias ? L->bias + r : NULL};
            tiles_f32(&panel, x, ld_x, batch, 0, rows, out + r, ld_out, accumulate, x, 0);
        }
        return;
    }
#if TY_Q8_INPUTS
    if (L->k % 32 == 0) {
        if (scratch->prepared != x) {   /* once per phase, not once per chunk of rows */
            quantise_q8(L, x, ld_x, batch, scratch->q8);
            scratch->prepared = x;
        }
        if (L->kind == TY_INT8)
            tiles_q8i8(L, scratch->q8, q8_stride(L), batch, r0, r1, out, ld_out, accumulate, scratch->q8, 0);
#if TY_ROWS16
        else if (L->kind == TY_INT4R16)
            rows_r16(L, scratch->q8, q8_stride(L), batch, r0, r1, out, ld_out, accumulate);
#endif
        else
            tiles_q8(L, scratch->q8, q8_stride(L), batch, r0, r1, out, ld_out, accumulate, scratch->q8, 0);
        return;
    }
#endif
    if (L->kind == TY_INT8) {
        tiles_int8(L, x, ld_x, batch, r0, r1, out, ld_out, accumulate, x, 0);
        return;
    }
    /* int4: sum over groups g of scale[g] * (q_g . x_g) + min[g] * sum(x_g); the sums of x per group
     * are computed once per call. k % 32 == 0 and group % 32 == 0 (checked at creation). */
    const int64_t k = L->k, g = L->group, ng = k / g;
    for (int64_t b = 0; b < batch; b++)
        for (int64_t j = 0; j < ng; j++) {
            vf a = {0};
            const float *xs = x + b * ld_x + j * g;
            for (int64_t d = 0; d < g; d += TY_VW) a += loadv(xs + d);
            scratch->gsum[b * ng + j] = hsumv(a);
        }
    tiles_int4(L, x, ld_x, batch, r0, r1, out, ld_out, accumulate, scratch->gsum, ng);
}
