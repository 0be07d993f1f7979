/* One whole decode step of a Llama-family decoder on the CPU, in C, for a few sequences at a time.
 *
 * Why: at batch 1 a decode step reads every weight once and does little else, so its speed is the
 * speed at which the weights stream through the cores. torch (eager or inductor-compiled) spends
 * most of a small model's step between the reads: a dispatch per op, an OpenMP region and its
 * barrier per kernel, an activation tensor allocated per op. Here the step is one call: a pool of
 * threads that lives as long as the model walks the layers together, splitting each projection's
 * output rows between them, meeting at a spin barrier only where a result is needed by all
 * (about six times a layer), with every buffer allocated once.
 *
 * What one step computes, for B tokens (one new token per sequence, B <= max_batch):
 *   h = embed[ids]
 *   per layer: x = rmsnorm(h) * w_in;  q, k, v = split(x @ Wqkv^T + b);  rotary(q, k) at positions;
 *              K/V written to the paged cache at slots;  o = attention(q, paged K/V of the sequence);
 *              h += o @ Wo^T;  x = rmsnorm(h) * w_post;  a = silu(x @ Wg^T) * (x @ Wu^T);  h += a @ Wd^T
 *   logits = (rmsnorm(h) * w_final) @ Wlm^T
 * the same arithmetic as engines/model/model.py in fp32 (summation order differs; the tests
 * compare with a tolerance).
 *
 * Weights are read where they lie (torch tensors' storage): fp32 [n, k]; int8 [n, k] with one fp32
 * scale per row; int4 in groups of `group` inputs, 16 bytes per 32 weights (byte j: weight j in the
 * low nibble, weight j + 16 in the high one, GGUF's order, so one 16-byte load widens into two runs
 * of 16 consecutive weights), w = q * scale + min with fp32 scale and min per (row, group).
 * The KV cache is fp32 [kv_heads, slots, head_dim]; attention is cpu_decode_attention.c's kernel,
 * one call per (sequence, kv head).
 *
 * Vectors: GCC's vector extensions (16 floats), which the compiler lowers to AVX-512, AVX2 or SSE
 * for the machine it builds on (-march=native); the scalar tails keep any k correct.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <sched.h>

#include "cpu_decode_attention.c"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#else
#define CPU_RELAX() do { } while (0)
#endif

#define TY_MAX_BATCH 64
#define TY_MAX_THREADS 64

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

typedef struct {
    const float *in_norm, *post_norm;
    ty_linear qkv, o, gate_up, down;
    float *k_cache, *v_cache;          /* [kv_heads, slots, head_dim] */
} ty_layer;

typedef struct {
    int64_t n_layers, hidden, heads, kv_heads, head_dim, inter, vocab, slots, block_size;
    int64_t max_batch, max_len, sliding_window;   /* sliding_window 0: none */
    float eps, scale;
    const float *embed;                /* [vocab, hidden] */
    const float *final_norm;
    const float *cos, *sin;            /* [max_positions, head_dim] */
    ty_linear lm_head;
    const ty_layer *layers;            /* n_layers of them, owned by the caller */
} ty_model;

typedef struct {
    int64_t batch, width;
    const int64_t *ids, *positions, *slots, *seq_lens, *tables;   /* tables [batch, width] */
    float *logits;                                                 /* [batch, vocab] */
} ty_job;

typedef struct ty_pool ty_pool;
typedef struct {
    ty_pool *pool;
    int index;
    pthread_t thread;
    float *x;          /* private normalised input, [max_batch, max(hidden, inter)] */
    float *gsum;       /* private per-group input sums, [max_batch, max k / 32] */
    float *attn_work;  /* head_dim + group * max_len */
    float *mask;       /* [max_len] */
} ty_worker;

struct ty_pool {
    ty_model m;
    int n_threads;
    ty_worker workers[TY_MAX_THREADS];
    float *h, *qkv, *attn, *act;
    /* the step in flight: `generation` counts posted steps, `done` the threads that finished one */
    ty_job job;
    atomic_long generation;
    atomic_int done;
    atomic_int stop;
    /* sense-reversing barrier */
    atomic_int arrived;
    atomic_int sense;
    int caller_sense;
    atomic_llong *counters;   /* one per phase of a step (next_chunk), zeroed before each step */
    int64_t n_phases;
    /* sleeping between steps */
    pthread_mutex_t lock;
    pthread_cond_t wake;
    atomic_int sleepers;
    long spin_limit;
};

/* ---------------------------------------------------------------- barrier */

static void barrier(ty_pool *p, int *local_sense) {
    if (p->n_threads == 1) return;
    int s = !*local_sense;
    *local_sense = s;
    if (atomic_fetch_add_explicit(&p->arrived, 1, memory_order_acq_rel) == p->n_threads - 1) {
        atomic_store_explicit(&p->arrived, 0, memory_order_relaxed);
        atomic_store_explicit(&p->sense, s, memory_order_release);
    } else {
        long spins = 0;
        while (atomic_load_explicit(&p->sense, memory_order_acquire) != s) {
            CPU_RELAX();
            /* a descheduled partner (a loaded machine) should not cost us a whole slice of spinning */
            if (++spins > 20000) { sched_yield(); spins = 0; }
        }
    }
}

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

/* this thread's share [*lo, *hi) of n items, in multiples of `align` (the last share takes the rest) */
static void share(int64_t n, int t, int threads, int64_t align, int64_t *lo, int64_t *hi) {
    int64_t units = (n + align - 1) / align;
    int64_t a = units * t / threads, b = units * (t + 1) / threads;
    *lo = a * align < n ? a * align : n;
    *hi = b * align < n ? b * align : n;
}

/* Projections hand their rows out in chunks from one counter per phase of the step (about eight
 * chunks a thread), so a thread that runs ahead takes more: fixed halves left one core waiting at
 * every barrier for the other (on this VM one core is often slower, by up to a fifth of a step).
 * Chunks are whole multiples of `align` and runs of rows stay contiguous in memory. */
static int next_chunk(ty_pool *p, int64_t phase, int64_t n, int64_t align, int64_t *lo, int64_t *hi) {
    int64_t chunk = (n + 8 * p->n_threads - 1) / (8 * p->n_threads);
    chunk = (chunk + align - 1) / align * align;
    int64_t c = atomic_fetch_add_explicit(&p->counters[phase], 1, memory_order_relaxed);
    if (c * chunk >= n) return 0;
    *lo = c * chunk;
    *hi = *lo + chunk < n ? *lo + chunk : n;
    return 1;
}

/* ---------------------------------------------------------------- the step */

static void rmsnorm_rows(const float *h, const float *w, int64_t batch, int64_t dim, float eps, float *out) {
    for (int64_t b = 0; b < batch; b++) {
        const float *hb = h + b * dim;
        float ss = 0.0f;
        for (int64_t d = 0; d < dim; d++) ss += hb[d] * hb[d];
        float inv = 1.0f / sqrtf(ss / (float)dim + eps);
        for (int64_t d = 0; d < dim; d++) out[b * dim + d] = w[d] * (hb[d] * inv);
    }
}

static void rotate(float *v, const float *cos, const float *sin, int64_t hd) {
    const int64_t half = hd / 2;
    for (int64_t i = 0; i < half; i++) {
        float a = v[i], b = v[i + half];
        v[i] = a * cos[i] - b * sin[i];
        v[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

static void run_step(ty_worker *wk, int *sense) {
    ty_pool *p = wk->pool;
    const ty_model *m = &p->m;
    const ty_job *job = &p->job;
    const int t = wk->index, T = p->n_threads;
    const int64_t B = job->batch, D = m->hidden, hd = m->head_dim, H = m->heads, KVH = m->kv_heads;
    const int64_t qs = H * hd, kvs = KVH * hd, QKV = qs + 2 * kvs, I = m->inter, group = H / KVH;
    int64_t lo, hi, ph = 0;

    share(D, t, T, 16, &lo, &hi);
    for (int64_t b = 0; b < B; b++)
        memcpy(p->h + b * D + lo, m->embed + job->ids[b] * D + lo, sizeof(float) * (size_t)(hi - lo));
    barrier(p, sense);

    for (int64_t l = 0; l < m->n_layers; l++) {
        const ty_layer *L = &m->layers[l];
        /* q, k, v */
        rmsnorm_rows(p->h, L->in_norm, B, D, m->eps, wk->x);
        /* whole heads per thread, so that the thread that computed a head also rotates it and writes
         * it to the cache (no barrier between the projection and the rotation) */
        while (next_chunk(p, ph, QKV, hd, &lo, &hi)) {
        matvec(&L->qkv, wk->x, D, B, lo, hi, p->qkv, QKV, 0, wk->gsum);
        for (int64_t b = 0; b < B; b++) {
            float *row = p->qkv + b * QKV;
            const float *c = m->cos + job->positions[b] * hd, *s = m->sin + job->positions[b] * hd;
            for (int64_t head = lo / hd; head < hi / hd; head++) {
                if (head < H + KVH) rotate(row + head * hd, c, s, hd);            /* q and k heads */
                if (head >= H) {                                                   /* k and v heads */
                    int64_t kh = head < H + KVH ? head - H : head - H - KVH;
                    float *cache = head < H + KVH ? L->k_cache : L->v_cache;
                    memcpy(cache + (kh * m->slots + job->slots[b]) * hd, row + head * hd, sizeof(float) * (size_t)hd);
                }
            }
        }
        }
        ph++;
        barrier(p, sense);
        /* attention, one (sequence, kv head) at a time */
        while (next_chunk(p, ph, B * KVH, 1, &lo, &hi))
        for (int64_t u = lo; u < hi; u++) {
            int64_t b = u / KVH, kh = u % KVH, len = job->seq_lens[b];
            int64_t nb = (len + m->block_size - 1) / m->block_size, span = nb * m->block_size;
            int64_t first = m->sliding_window > 0 ? len - m->sliding_window : 0;   /* keys j >= first */
            for (int64_t j = 0; j < span; j++) wk->mask[j] = (j < len && j >= first) ? 0.0f : -INFINITY;
            tokenyard_decode_f32(p->qkv + b * QKV + kh * group * hd, L->k_cache + kh * m->slots * hd, NULL,
                                 L->v_cache + kh * m->slots * hd, NULL, job->tables + b * job->width, wk->mask,
                                 1, 1, m->slots, 1, group, hd, nb, m->block_size, m->scale,
                                 p->attn + b * qs + kh * group * hd, wk->attn_work);
        }
        ph++;
        barrier(p, sense);
        /* h += o_proj(attn) */
        while (next_chunk(p, ph, D, 16, &lo, &hi)) matvec(&L->o, p->attn, qs, B, lo, hi, p->h, D, 1, wk->gsum);
        ph++;
        barrier(p, sense);
        /* a = silu(gate) * up, row i of the gate and of the up projection by the same thread */
        rmsnorm_rows(p->h, L->post_norm, B, D, m->eps, wk->x);
        while (next_chunk(p, ph, I, 16, &lo, &hi)) {
            matvec(&L->gate_up, wk->x, D, B, lo, hi, p->act, 2 * I, 0, wk->gsum);
            matvec(&L->gate_up, wk->x, D, B, I + lo, I + hi, p->act, 2 * I, 0, wk->gsum);
            for (int64_t b = 0; b < B; b++) {
                float *gate = p->act + b * 2 * I, *up = gate + I;
                for (int64_t i = lo; i < hi; i++) gate[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
            }
        }
        ph++;
        barrier(p, sense);
        /* h += down(a) */
        while (next_chunk(p, ph, D, 16, &lo, &hi)) matvec(&L->down, p->act, 2 * I, B, lo, hi, p->h, D, 1, wk->gsum);
        ph++;
        barrier(p, sense);
    }
    rmsnorm_rows(p->h, m->final_norm, B, D, m->eps, wk->x);
    while (next_chunk(p, ph, m->vocab, 16, &lo, &hi))
        matvec(&m->lm_head, wk->x, D, B, lo, hi, job->logits, m->vocab, 0, wk->gsum);
}

/* ---------------------------------------------------------------- the pool */

static void *worker_main(void *arg) {
    ty_worker *wk = (ty_worker *)arg;
    ty_pool *p = wk->pool;
    long seen = 0;
    int sense = 0;
    for (;;) {
        long spins = 0;
        while (atomic_load_explicit(&p->generation, memory_order_acquire) == seen) {
            if (atomic_load_explicit(&p->stop, memory_order_acquire)) return NULL;
            CPU_RELAX();
            if (++spins > p->spin_limit) {
                /* idle for a while (no step in flight): sleep until the next one is posted */
                pthread_mutex_lock(&p->lock);
                atomic_fetch_add(&p->sleepers, 1);
                while (atomic_load(&p->generation) == seen && !atomic_load(&p->stop))
                    pthread_cond_wait(&p->wake, &p->lock);
                atomic_fetch_sub(&p->sleepers, 1);
                pthread_mutex_unlock(&p->lock);
                spins = 0;
            }
        }
        seen = atomic_load_explicit(&p->generation, memory_order_acquire);
        run_step(wk, &sense);
        atomic_fetch_add_explicit(&p->done, 1, memory_order_acq_rel);
    }
}

static int linear_ok(const ty_linear *L, int64_t n, int64_t k) {
    if (L->n != n || L->k != k || !L->w) return 0;
    if (L->kind == TY_INT8) return L->scale != NULL;
    if (L->kind == TY_INT4) return L->scale && L->minv && L->group % 32 == 0 && L->group > 0 && k % L->group == 0;
    return L->kind == TY_F32;
}

static void free_pool(ty_pool *p) {
    for (int t = 0; t < TY_MAX_THREADS; t++) {
        free(p->workers[t].x); free(p->workers[t].gsum); free(p->workers[t].attn_work); free(p->workers[t].mask);
    }
    free(p->h); free(p->qkv); free(p->attn); free(p->act); free((void *)p->counters);
    free(p);
}

/* A pool for `model` with n_threads threads (the caller's included); NULL on bad shapes or no memory.
 * The model's pointers must stay valid until tokenyard_step_destroy. spin_limit: how many pause
 * iterations an idle worker spins before it sleeps. */
void *tokenyard_step_create(const ty_model *model, int n_threads, long spin_limit) {
    const ty_model *m = model;
    if (n_threads < 1 || n_threads > TY_MAX_THREADS || m->max_batch < 1 || m->max_batch > TY_MAX_BATCH) return NULL;
    if (m->heads % m->kv_heads || m->head_dim % 2 || m->head_dim > 4096 || m->heads / m->kv_heads > MAX_ROWS) return NULL;
    const int64_t D = m->hidden, qs = m->heads * m->head_dim, kvs = m->kv_heads * m->head_dim, I = m->inter;
    for (int64_t l = 0; l < m->n_layers; l++) {
        const ty_layer *L = &m->layers[l];
        if (!linear_ok(&L->qkv, qs + 2 * kvs, D) || !linear_ok(&L->o, D, qs) || !linear_ok(&L->gate_up, 2 * I, D)
            || !linear_ok(&L->down, D, I) || !L->k_cache || !L->v_cache || !L->in_norm || !L->post_norm)
            return NULL;
    }
    if (!linear_ok(&m->lm_head, m->vocab, D) || !m->embed || !m->final_norm) return NULL;
    ty_pool *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->m = *m;
    p->n_threads = n_threads;
    p->spin_limit = spin_limit > 0 ? spin_limit : 1;
    const int64_t B = m->max_batch, widest = D > I ? D : I, most_groups = (qs > widest ? qs : widest) / 32 + 1;
    const int64_t span = m->max_len + m->block_size;
    p->h = malloc(sizeof(float) * (size_t)(B * D));
    p->qkv = malloc(sizeof(float) * (size_t)(B * (qs + 2 * kvs)));
    p->attn = malloc(sizeof(float) * (size_t)(B * qs));
    p->act = malloc(sizeof(float) * (size_t)(B * 2 * I));
    p->n_phases = 5 * m->n_layers + 1;
    p->counters = calloc((size_t)p->n_phases, sizeof(atomic_llong));
    int ok = p->h && p->qkv && p->attn && p->act && p->counters;
    for (int t = 0; t < n_threads && ok; t++) {
        ty_worker *wk = &p->workers[t];
        wk->pool = p;
        wk->index = t;
        wk->x = malloc(sizeof(float) * (size_t)(B * widest));
        wk->gsum = malloc(sizeof(float) * (size_t)(B * most_groups));
        wk->attn_work = malloc(sizeof(float) * (size_t)(m->head_dim + (m->heads / m->kv_heads) * span));
        wk->mask = malloc(sizeof(float) * (size_t)span);
        ok = wk->x && wk->gsum && wk->attn_work && wk->mask;
    }
    if (!ok) { free_pool(p); return NULL; }
    pthread_mutex_init(&p->lock, NULL);
    pthread_cond_init(&p->wake, NULL);
    for (int t = 1; t < n_threads; t++) {
        if (pthread_create(&p->workers[t].thread, NULL, worker_main, &p->workers[t]) != 0) {
            atomic_store(&p->stop, 1);
            pthread_mutex_lock(&p->lock);
            pthread_cond_broadcast(&p->wake);
            pthread_mutex_unlock(&p->lock);
            for (int j = 1; j < t; j++) pthread_join(p->workers[j].thread, NULL);
            free_pool(p);
            return NULL;
        }
    }
    return p;
}

/* One decode step. Returns 0, or -1 on a batch or a table wider than the pool was made for, -2 on a
 * position, slot or block outside the cache (nothing is written then). */
int tokenyard_step_run(void *handle, const ty_job *job) {
    ty_pool *p = (ty_pool *)handle;
    const ty_model *m = &p->m;
    if (job->batch < 1 || job->batch > m->max_batch || job->width < 1 || job->width * m->block_size > m->max_len + m->block_size)
        return -1;
    const int64_t blocks = m->slots / m->block_size;
    for (int64_t b = 0; b < job->batch; b++) {
        int64_t len = job->seq_lens[b];
        if (job->ids[b] < 0 || job->ids[b] >= m->vocab || job->slots[b] < 0 || job->slots[b] >= m->slots
            || len < 1 || len > job->width * m->block_size || job->positions[b] < 0 || job->positions[b] >= m->max_len)
            return -2;
        for (int64_t j = 0; j < (len + m->block_size - 1) / m->block_size; j++) {
            int64_t blk = job->tables[b * job->width + j];
            if (blk < 0 || blk >= blocks) return -2;
        }
    }
    p->job = *job;
    for (int64_t i = 0; i < p->n_phases; i++) atomic_store_explicit(&p->counters[i], 0, memory_order_relaxed);
    atomic_store_explicit(&p->done, 0, memory_order_relaxed);
    atomic_fetch_add_explicit(&p->generation, 1, memory_order_acq_rel);
    if (atomic_load(&p->sleepers) > 0) {
        pthread_mutex_lock(&p->lock);
        pthread_cond_broadcast(&p->wake);
        pthread_mutex_unlock(&p->lock);
    }
    /* the caller is thread 0, whichever OS thread it is (one step at a time per pool) */
    run_step(&p->workers[0], &p->caller_sense);
    while (atomic_load_explicit(&p->done, memory_order_acquire) < p->n_threads - 1) CPU_RELAX();
    return 0;
}

void tokenyard_step_destroy(void *handle) {
    ty_pool *p = (ty_pool *)handle;
    if (!p) return;
    atomic_store(&p->stop, 1);
    pthread_mutex_lock(&p->lock);
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->lock);
    for (int t = 1; t < p->n_threads; t++) pthread_join(p->workers[t].thread, NULL);
    pthread_mutex_destroy(&p->lock);
    pthread_cond_destroy(&p->wake);
    free_pool(p);
}

int tokenyard_step_max_batch(void) { return TY_MAX_BATCH; }
