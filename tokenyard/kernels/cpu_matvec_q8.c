/* int4 and int8 products with int8 inputs, for small batches on AVX2 and AVX-512 machines: part of
 * cpu_matvec.c, which #includes this file after its tiles (it uses their TILE_ARGS, finish, DEFINE_TILES
 * and vectors). */

/* ---------------------------------------------------------------- int4 and int8 with int8 inputs */

/* In floats the int4 tiles above spend about twenty instructions widening, scaling and multiplying
 * each 32 weights, and an int4 step is bound by that arithmetic, not by memory: SmolLM2 decoded at
 * 0.76x llama.cpp on Zen 3 (its int8 LM head, widened 8 at a time, took a quarter of the step), and
 * at 0.48x on an AVX-512 Intel Xeon with AMX (2026-12-04), where this path was first left out on the
 * guess that 16-float vectors would be enough. So for small batches on every machine with AVX2 the
 * inputs are rounded per 32-block to int8 with one fp32 scale (llama.cpp's Q8 activations) and each
 * block of 32 weights (int4 codes or int8; k a multiple of 32) is one integer dot product (vpdpbusd
 * with VNNI, else vpmaddubsw and vpmaddwd) and one scaled float add, in 8-lane vectors on AVX-512
 * too (a block is 32 bytes). The int4 group minimums still meet the exact fp32 input sums. Error:
 * |x - xq * d| <= d / 2 with d = the block's max |x| / 127, so a product moves by at most
 * sum_j |w_j| * d_j / 2 (tests/kernels/test_cpu_matvec.py checks that bound). -DTY_Q8_INPUTS=0 keeps fp32
 * inputs. The tiles prefetch the next tile's rows: with this much arithmetic per byte the hardware
 * prefetchers alone kept too few reads in flight (scratch timings, one thread, SmolLM2's int8 LM head
 * from DRAM: 7.4 GB/s without, 14.6 with; int4 10.5 -> 14.9). */
#if defined(__AVX2__)
#ifndef TY_Q8_INPUTS
#define TY_Q8_INPUTS 1
#endif
#else
#undef TY_Q8_INPUTS
#define TY_Q8_INPUTS 0
#endif

#if TY_Q8_INPUTS
/* Sums of unsigned by signed byte products, four adjacent pairs of pairs into each of 8 int32 lanes. With
 * VNNI (AVX512-VNNI with AVX512-VL, or AVX-VNNI) one vpdpbusd; otherwise vpmaddubsw into int16 (a pair
 * sums to at most 15 * 127 * 2 for int4 codes, 127 * 127 * 2 for int8: inside int16) and vpmaddwd. */
static inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}
static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}
/* per token, what the tiles read: [group sums: k / group (int4)][block scales: k / 32][codes: k bytes] */
static inline int64_t q8_groups(const ty_linear *L) { return L->kind == TY_INT4 || L->kind == TY_INT4R16 ? L->k / L->group : 0; }
static inline int64_t q8_stride(const ty_linear *L) { return q8_groups(L) + L->k / 32 + L->k / 4; }

static void quantise_q8(const ty_linear *L, const float *x, int64_t ld_x, int64_t batch, float *rec) {
    const int64_t k = L->k, ng = q8_groups(L), g = ng ? k / ng : 0, nq = k / 32, stride = q8_stride(L);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t b = 0; b < batch; b++) {
        const float *xb = x + b * ld_x;
        float *gs = rec + b * stride, *xd = gs + ng;
        int8_t *xq = (int8_t *)(xd + nq);
        for (int64_t j = 0; j < ng; j++) {
            vf a = {0};
            for (int64_t d = 0; d < g; d += TY_VW) a += loadv(xb + j * g + d);
            gs[j] = hsumv(a);
        }
        for (int64_t q = 0; q < nq; q++) {
            __m256 v[4], m = _mm256_setzero_ps();
            for (int i = 0; i < 4; i++) {
                v[i] = _mm256_loadu_ps(xb + q * 32 + 8 * i);
                m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
            }
            __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
            xd[q] = amax / 127.0f;
            const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
            __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v[0], inv)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v[1], inv));
            __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v[2], inv)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v[3], inv));
            /* the packs work within 128-bit lanes: the permute puts the 4-byte runs back in order */
            __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
            _mm256_storeu_si256((__m256i *)(xq + q * 32), _mm256_permutevar8x32_epi32(p, order));
        }
    }
}

/* The tile's sums finished: each token's record stands in for its inputs (read only by the fp32 and
 * int8 tails along k, which k % 32 == 0 leaves empty) and for its group sums (the record's start). */
#define Q8_TILE_END(KIND, R, T)                                                                           \
    for (int t = 0; t < T; t++)                                                                          \
        for (int i = 0; i < R; i++)                                                                      \
            finish(KIND, L, r + i, hsum256(acc[i][t]), x + t * ld_x, x + t * ld_x, out + t * ld_out + r + i, accumulate);

/* x: token 0's record (q8_stride floats apart: ld_x); gsum unused */
#define DEFINE_TILE_Q8(R, T)                                                                              \
static inline void tile_q8_##R##x##T(TILE_ARGS) {                                                        \
    (void)gsum;                                                                                          \
    const int64_t k = L->k, ng = k / L->group, nq = k / 32, sh = __builtin_ctzll((unsigned long long)(L->group / 32)); \
    const uint8_t *w = (const uint8_t *)L->w + r * (k / 2);                                              \
    const float *sc = L->scale + r * ng;                                                                 \
    const __m256i low = _mm256_set1_epi8(15);                                                            \
    __m256 acc[R][T];                                                                                    \
    for (int i = 0; i < R; i++) for (int t = 0; t < T; t++) acc[i][t] = _mm256_setzero_ps();             \
    for (int64_t q = 0; q < nq; q++) {                                                                  \
        __m256i wv[R];                                                                                   \
        float s[R];                                                                                      \
        for (int i = 0; i < R; i++) {                                                                    \
            if (q % 4 == 0) _mm_prefetch((const char *)(w + (R + i) * (k / 2) + q * 16), _MM_HINT_T0);   \
            const __m128i c = _mm_loadu_si128((const __m128i *)(w + i * (k / 2) + q * 16));             \
            /* codes 0-15 (low nibbles) in the low half, 16-31 (high nibbles) in the high half */       \
            wv[i] = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(c, 4), c), low);                    \
            s[i] = sc[i * ng + (q >> sh)];                                                               \
        }                                                                                                \
        for (int t = 0; t < T; t++) {                                                                    \
            const float *rec = x + t * ld_x;                                                             \
            const __m256i xv = _mm256_loadu_si256((const __m256i *)((const int8_t *)(rec + ng + nq) + q * 32)); \
            const float d = rec[ng + q];                                                                 \
            for (int i = 0; i < R; i++) {                                                                \
                const __m256i dot = dot_u8s8(wv[i], xv);                                                 \
                acc[i][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(s[i] * d), acc[i][t]); \
            }                                                                                            \
        }                                                                                                \
    }                                                                                                    \
    Q8_TILE_END(TY_INT4, R, T)                                                                           \
}
/* int8 weights against int8 inputs: vpmaddubsw multiplies unsigned by signed bytes, so |w| meets x
 * with w's sign (|w|, |x| <= 127: a pair sums to at most 32,258, inside int16) */
#define DEFINE_TILE_Q8I8(R, T)                                                                            \
static inline void tile_q8i8_##R##x##T(TILE_ARGS) {                                                      \
    (void)gsum;                                                                                          \
    const int64_t k = L->k, nq = k / 32;                                                                \
    const int8_t *w = (const int8_t *)L->w + r * k;                                                      \
    __m256 acc[R][T];                                                                                    \
    for (int i = 0; i < R; i++) for (int t = 0; t < T; t++) acc[i][t] = _mm256_setzero_ps();             \
    for (int64_t q = 0; q < nq; q++) {                                                                  \
        __m256i wv[R], wa[R];                                                                            \
        for (int i = 0; i < R; i++) {                                                                    \
            _mm_prefetch((const char *)(w + (R + i) * k + q * 32), _MM_HINT_T0);                         \
            wv[i] = _mm256_loadu_si256((const __m256i *)(w + i * k + q * 32));                           \
            wa[i] = _mm256_abs_epi8(wv[i]);                                                              \
        }                                                                                                \
        for (int t = 0; t < T; t++) {                                                                    \
            const float *rec = x + t * ld_x;                                                             \
            const __m256i xv = _mm256_loadu_si256((const __m256i *)((const int8_t *)(rec + nq) + q * 32)); \
            const __m256 d = _mm256_set1_ps(rec[q]);                                                     \
            for (int i = 0; i < R; i++) {                                                                \
                const __m256i dot = dot_u8s8(wa[i], _mm256_sign_epi8(xv, wv[i]));                        \
                acc[i][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), d, acc[i][t]);                      \
            }                                                                                            \
        }                                                                                                \
    }                                                                                                    \
    Q8_TILE_END(TY_INT8, R, T)                                                                           \
}
DEFINE_TILE_Q8(4, 2)
DEFINE_TILE_Q8(4, 1)
DEFINE_TILE_Q8(1, 2)
DEFINE_TILE_Q8(1, 1)
DEFINE_TILES(q8, 4, 2)
DEFINE_TILE_Q8I8(4, 2)
DEFINE_TILE_Q8I8(4, 1)
DEFINE_TILE_Q8I8(1, 2)
DEFINE_TILE_Q8I8(1, 1)
DEFINE_TILES(q8i8, 4, 2)
/* ---------------------------------------------------------------- int4 in 16-row blocks (AVX-512 VNNI) */

/* On AVX-512 machines with VNNI the int4 weights of a projection whose rows come in sixteens are stored
 * sixteen rows side by side (TY_INT4R16; Library.prepare in cpu_decode_step.py repacks them), so that a
 * 512-bit vpdpbusd multiplies four codes of each of the sixteen rows at once: one int32 lane per row,
 * nothing to reduce across lanes at the end, and the sixteen rows' scales and minimums are one vector
 * load each. The row-major form above needs about nine instructions per row per 32-block (widen, one
 * 8-lane dot product, convert, scale, add, then a horizontal sum per row); this one about two.
 * Measured (bench/RESULTS.md): SmolLM2's int4 batch-1 decode on an AVX-512 Xeon, 2 threads, about 185 tok/s
 * with the row-major form, 200 with this.
 *
 * Layout: w, per (group of 16 rows G, 32-block q), 256 bytes [h 4][row 16][i 4]: byte = code(row, 32q +
 * 4h + i) | code(row, 32q + 16 + 4h + i) << 4 (the row's GGUF-order byte 4h + i); scale and minv, per
 * (G, quantisation group j), 16 fp16 values, one per row (the pointers are typed float but hold halves):
 * 0.625 byte a weight at groups of 32 instead of 0.75, as GGUF's Q4_1, and the step streams memory.
 * Library.prepare keeps the row-major form for weights whose scales fp16 would not carry. */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define TY_ROWS16 1

static inline const uint8_t *r16_block(const ty_linear *L, int64_t G, int64_t q) {
    return (const uint8_t *)L->w + (G * (L->k / 32) + q) * 256;
}
static inline int64_t r16_vec(const ty_linear *L, int64_t G, int64_t j) { return (G * (L->k / L->group) + j) * 16; }
/* the 16 rows' scales (or minimums) of group j, stored as fp16 */
static inline __m512 r16_halves(const float *v, int64_t at) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)v + at)));
}
static inline float r16_half(const float *v, int64_t at) { return _cvtsh_ss(((const uint16_t *)v)[at]); }

/* row r's 16 GGUF-order code bytes of block q (the row-major form's bytes) */
static inline v16u8 r16_row_codes(const ty_linear *L, int64_t r, int64_t q) {
    const uint8_t *wb = r16_block(L, r / 16, q) + (r % 16) * 4;
    v16u8 c;
    for (int h = 0; h < 4; h++) memcpy((uint8_t *)&c + 4 * h, wb + h * 64, 4);
    return c;
}

/* rows [16G, 16G + 16) against `batch` tokens' int8 records (q8_stride floats apart) */
static void group_r16(const ty_linear *L, int64_t G, const float *x, int64_t ld_x, int64_t batch, float *out,
                      int64_t ld_out, int accumulate) {
    const int64_t k = L->k, nq = k / 32, ng = k / L->group, sh = __builtin_ctzll((unsigned long long)(L->group / 32));
    const __m512i low = _mm512_set1_epi8(15);
    for (int64_t t = 0; t < batch; t++) {
        const float *gs = x + t * ld_x, *xd = gs + ng;
        const int8_t *xq = (const int8_t *)(xd + nq);
        __m512 acc = _mm512_setzero_ps();
        for (int64_t q = 0; q < nq; q++) {
            const uint8_t *wb = r16_block(L, G, q);
            /* sixteen blocks (4 KB) ahead, into the next 16 rows near a row's end (they follow in memory and
             * are usually this thread's next): SmolLM2 int4, 2 threads, three interleaved rounds, about
             * 160-180 tok/s two blocks ahead, 185-200 eight, 185-237 sixteen */
            for (int h = 0; h < 4; h++) _mm_prefetch((const char *)(wb + 4096 + h * 64), _MM_HINT_T0);
            int32_t xv[8];
            memcpy(xv, xq + q * 32, 32);
            __m512i ia = _mm512_setzero_si512();
            for (int h = 0; h < 4; h++) {
                const __m512i c = _mm512_loadu_si512((const void *)(wb + h * 64));
                ia = _mm512_dpbusd_epi32(ia, _mm512_and_si512(c, low), _mm512_set1_epi32(xv[h]));
                ia = _mm512_dpbusd_epi32(ia, _mm512_and_si512(_mm512_srli_epi16(c, 4), low), _mm512_set1_epi32(xv[h + 4]));
            }
            const __m512 s = _mm512_mul_ps(r16_halves(L->scale, r16_vec(L, G, q >> sh)), _mm512_set1_ps(xd[q]));
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia), s, acc);
        }
        for (int64_t j = 0; j < ng; j++)
            acc = _mm512_fmadd_ps(r16_halves(L->minv, r16_vec(L, G, j)), _mm512_set1_ps(gs[j]), acc);
        if (L->bias) acc = _mm512_add_ps(acc, _mm512_loadu_ps(L->bias + G * 16));
        float *o = out + t * ld_out + G * 16;
        if (accumulate) acc = _mm512_add_ps(acc, _mm512_loadu_ps(o));
        _mm512_storeu_ps(o, acc);
    }
}

/* one row of a 16-row group (the edges of a row range that does not start or end on a group) */
static void row_r16(const ty_linear *L, int64_t r, const float *x, int64_t ld_x, int64_t batch, float *out,
                    int64_t ld_out, int accumulate) {
    const int64_t k = L->k, nq = k / 32, ng = k / L->group, sh = __builtin_ctzll((unsigned long long)(L->group / 32));
    const int64_t G = r / 16, rr = r % 16;
    for (int64_t t = 0; t < batch; t++) {
        const float *gs = x + t * ld_x, *xd = gs + ng;
        const int8_t *xq = (const int8_t *)(xd + nq);
        float s = 0.0f;
        for (int64_t q = 0; q < nq; q++) {
            const v16u8 c = r16_row_codes(L, r, q);
            int32_t isum = 0;
            for (int j = 0; j < 16; j++) isum += (c[j] & 15) * xq[q * 32 + j] + (c[j] >> 4) * xq[q * 32 + 16 + j];
            s += (float)isum * r16_half(L->scale, r16_vec(L, G, q >> sh) + rr) * xd[q];
        }
        for (int64_t j = 0; j < ng; j++) s += r16_half(L->minv, r16_vec(L, G, j) + rr) * gs[j];
        if (L->bias) s += L->bias[r];
        float *o = out + t * ld_out + r;
        *o = accumulate ? *o + s : s;
    }
}

static void rows_r16(const ty_linear *L, const float *x, int64_t ld_x, int64_t batch, int64_t r0, int64_t r1,
                     float *out, int64_t ld_out, int accumulate) {
    int64_t r = r0;
    for (; r < r1 && r % 16; r++) row_r16(L, r, x, ld_x, batch, out, ld_out, accumulate);
    for (; r + 16 <= r1; r += 16) group_r16(L, r / 16, x, ld_x, batch, out, ld_out, accumulate);
    for (; r < r1; r++) row_r16(L, r, x, ld_x, batch, out, ld_out, accumulate);
}
#else
#define TY_ROWS16 0
#endif
#endif
