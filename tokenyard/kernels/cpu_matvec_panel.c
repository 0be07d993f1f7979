/* fp32 products of many tokens in outer-product form over packed weight panels (cpu_matvec.c #includes
 * this file; it uses that file's vectors and its dot-product tiles for the rows a panel does not fill).
 *
 * What: from TY_PANEL_BATCH tokens on, TY_PR rows of W (two vectors' worth) are copied, TY_KC inputs
 * at a time, into a panel laid out k-major (panel[d * TY_PR + i] = W[r + i][d0 + d]). A tile of
 * TY_PT tokens then walks the panel: at each d it loads the two weight vectors once, broadcasts each
 * token's input x[t][d], and does 2 * TY_PT multiply-adds into accumulators that already hold whole
 * outputs (TY_PR rows of one token), so nothing is reduced across lanes at the end. With AVX2's 16
 * registers that is the 6 x 16 shape of the classic CPU GEMM micro-kernels: 12 accumulators, two
 * weight vectors and one broadcast.
 *
 * Why: the dot-product tiles of cpu_matvec.c read weights where they lie, which is what a batch of
 * one wants (each weight is used once, so a copy would only add traffic). With many tokens each
 * weight is used by every token, the copy is paid once per panel, and the dot-product form loses on
 * its loads: each step along k loads TR weight vectors and TT input vectors for TR * TT multiply-adds
 * (7 loads for 12 on AVX2), plus a transposing reduction per row at the end. Scratch timings on the
 * AMD EPYC Zen 3 VM (one thread, W2 shapes, batch 96): 78-93 GFLOP/s here against 56-65 for the 4 x 3
 * dot-product tile; tokenyard/bench/matvec_tiles.py times both (bench/RESULTS.md).
 *
 * Rounding: each output is one sequential sum over k within a block of TY_KC inputs, blocks added to
 * the output in order; the dot-product tiles sum eight (or sixteen) interleaved partial sums. The two
 * forms agree to fp32 rounding, not bit for bit, so a sequence's logits can move in the last bits
 * when the batch around it crosses TY_PANEL_BATCH (as they do between eager torch steps of different
 * sizes).
 */

#define TY_PR (2 * TY_VW)        /* rows per panel: two vectors */
#ifndef TY_PT
#define TY_PT 6                  /* tokens per panel tile */
#endif
#ifndef TY_KC
#define TY_KC 512                /* inputs per panel: 16 x 512 floats is 32 KiB, about an L1 data cache */
#endif
#ifndef TY_PANEL_BATCH           /* from this many tokens on, fp32 products (and quantised panels) use panels */
#define TY_PANEL_BATCH 16
#endif

/* panel[d * TY_PR + i] = w[(r + i) * k + d0 + d] for i < TY_PR, d < kc */
static void pack_panel(const float *w, int64_t k, int64_t r, int64_t d0, int64_t kc, float *panel) {
    int64_t d = 0;
#if defined(__AVX__)
    /* 8 x 8 blocks through registers: unpack, shuffle, permute (the usual AVX transpose) */
    for (; d + 8 <= kc; d += 8)
        for (int64_t g = 0; g < TY_PR; g += 8) {
            const float *s = w + (r + g) * k + d0 + d;
            float *o = panel + d * TY_PR + g;
            __m256 r0 = _mm256_loadu_ps(s), r1 = _mm256_loadu_ps(s + k), r2 = _mm256_loadu_ps(s + 2 * k),
                   r3 = _mm256_loadu_ps(s + 3 * k), r4 = _mm256_loadu_ps(s + 4 * k), r5 = _mm256_loadu_ps(s + 5 * k),
                   r6 = _mm256_loadu_ps(s + 6 * k), r7 = _mm256_loadu_ps(s + 7 * k);
            __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1), t2 = _mm256_unpacklo_ps(r2, r3),
                   t3 = _mm256_unpackhi_ps(r2, r3), t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5),
                   t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
            __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE),
                   u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE),
                   u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE),
                   u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
            _mm256_storeu_ps(o + 0 * TY_PR, _mm256_permute2f128_ps(u0, u4, 0x20));
            _mm256_storeu_ps(o + 1 * TY_PR, _mm256_permute2f128_ps(u1, u5, 0x20));
            _mm256_storeu_ps(o + 2 * TY_PR, _mm256_permute2f128_ps(u2, u6, 0x20));
            _mm256_storeu_ps(o + 3 * TY_PR, _mm256_permute2f128_ps(u3, u7, 0x20));
            _mm256_storeu_ps(o + 4 * TY_PR, _mm256_permute2f128_ps(u0, u4, 0x31));
            _mm256_storeu_ps(o + 5 * TY_PR, _mm256_permute2f128_ps(u1, u5, 0x31));
            _mm256_storeu_ps(o + 6 * TY_PR, _mm256_permute2f128_ps(u2, u6, 0x31));
            _mm256_storeu_ps(o + 7 * TY_PR, _mm256_permute2f128_ps(u3, u7, 0x31));
        }
#endif
    for (; d < kc; d++)
        for (int64_t i = 0; i < TY_PR; i++) panel[d * TY_PR + i] = w[(r + i) * k + d0 + d];
}

/* M tokens (M <= TY_PT, a constant in every call) against one panel of kc inputs: out[t * ld_out + i]
 * gets the TY_PR sums; `add` adds them to what out holds, else they replace it; bias (NULL or TY_PR
 * values) is added too. */
static inline __attribute__((always_inline)) void panel_tile(int M, const float *panel, int64_t kc, const float *x,
                                                             int64_t ld_x, float *out, int64_t ld_out, int add,
                                                             const float *bias) {
    vf a0[TY_PT], a1[TY_PT];
    for (int t = 0; t < M; t++) a0[t] = a1[t] = (vf){0};
    for (int64_t d = 0; d < kc; d++) {
        const vf w0 = loadv(panel + d * TY_PR), w1 = loadv(panel + d * TY_PR + TY_VW);
        for (int t = 0; t < M; t++) {
            const vf b = (vf){0} + x[t * ld_x + d];
            a0[t] += w0 * b;
            a1[t] += w1 * b;
        }
    }
    const vf b0 = bias ? loadv(bias) : (vf){0}, b1 = bias ? loadv(bias + TY_VW) : (vf){0};
    for (int t = 0; t < M; t++) {
        float *o = out + t * ld_out;
        storev(o, (add ? loadv(o) : (vf){0}) + a0[t] + b0);
        storev(o + TY_VW, (add ? loadv(o + TY_VW) : (vf){0}) + a1[t] + b1);
    }
}

/* the tiles of one packed panel over tokens [0, batch) */
static void panel_tokens(const float *panel, int64_t kc, const float *x, int64_t ld_x, int64_t batch, float *out,
                         int64_t ld_out, int add, const float *bias) {
    int64_t b = 0;
    for (; b + TY_PT <= batch; b += TY_PT) panel_tile(TY_PT, panel, kc, x + b * ld_x, ld_x, out + b * ld_out, ld_out, add, bias);
    x += b * ld_x;
    out += b * ld_out;
    switch (batch - b) {   /* the remaining tokens, with accumulators for as many as there are */
        case 5: panel_tile(5, panel, kc, x, ld_x, out, ld_out, add, bias); break;
        case 4: panel_tile(4, panel, kc, x, ld_x, out, ld_out, add, bias); break;
        case 3: panel_tile(3, panel, kc, x, ld_x, out, ld_out, add, bias); break;
        case 2: panel_tile(2, panel, kc, x, ld_x, out, ld_out, add, bias); break;
        case 1: panel_tile(1, panel, kc, x, ld_x, out, ld_out, add, bias); break;
        default: break;
    }
}

/* fp32 W (L->kind TY_F32): rows [r0, r1) against `batch` tokens, TY_PR rows a panel; the rows left
 * over (fewer than TY_PR) go through the dot-product tiles. panel: TY_PR * TY_KC floats of scratch. */
static void panels_f32(const ty_linear *L, const float *x, int64_t ld_x, int64_t batch, int64_t r0, int64_t r1,
                       float *out, int64_t ld_out, int accumulate, float *panel) {
    const int64_t k = L->k;
    const float *w = (const float *)L->w;
    int64_t r = r0;
    for (; r + TY_PR <= r1; r += TY_PR)
        for (int64_t d0 = 0; d0 < k; d0 += TY_KC) {
            const int64_t kc = k - d0 < TY_KC ? k - d0 : TY_KC;
            pack_panel(w, k, r, d0, kc, panel);
            /* the first block brings the bias and, unless accumulating, replaces the output */
            panel_tokens(panel, kc, x + d0, ld_x, batch, out + r, ld_out, d0 > 0 || accumulate,
                         d0 == 0 && L->bias ? L->bias + r : NULL);
        }
    if (r < r1) tiles_f32(L, x, ld_x, batch, r, r1, out, ld_out, accumulate, x, 0);
}
