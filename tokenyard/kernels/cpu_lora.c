/* The adapters' products of one fused projection on the CPU, for every adapter segment of a step, in one call.
 *
 *     y[row, off_j:off_j + n_j] += scale_s * (x[row] @ A[s, j*R : j*R + r_s]^T) @ B[s, j*R : j*R + r_s, off_j:off_j + n_j]
 *
 * for each row of each segment (slot s, the adapter's rank r_s, scale_s) and each adapted module j of
 * the group (q/k/v of qkv_proj, gate/up of gate_up_proj, or the one module of o_proj / down_proj).
 *
 * Why: at decode sizes (a few rows per adapter) torch spends more on its calls than on the products:
 * the batched form (tokenyard/kernels/lora_torch.py) is five calls per fused projection, about 160 a
 * step of an 8-layer model, and they were most of the 1.47x an 8-adapter decode step cost over the
 * base's. Here a projection is one call; rows are read where they lie (perm: row indices grouped by
 * adapter, computed once per step), the rank-r intermediate lives on the stack, and only each module's
 * own block of the pool's block-diagonal B (tokenyard/engines/lora/adapter_pool.py) and the adapter's
 * own rank are touched: no padding, no zeros multiplied, no product with another adapter's weights.
 *
 * Work is cut into (segment, block of up to LR_MR rows) items, shared out over OpenMP threads: every
 * row belongs to one item, so threads write disjoint rows of y. Built with -fopenmp, the library uses
 * the OpenMP runtime torch already loaded (the same libgomp.so.1 soname), so its threads are torch's.
 * Vectors: GCC's vector extensions, 8 floats (AVX2 and below; 16 with AVX-512), FMA contracted by the
 * compiler under -march=native; scalar tails keep any k and width correct.
 *
 * The same arithmetic as lora_torch.lora_add in fp32; the summation order differs (the tests compare
 * with a tolerance).
 */
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#define LR_MR 4                 /* rows per work item: one A row's loads feed LR_MR dot products */
#define LR_MAX_W 512            /* the group's pool width G * R the intermediate may hold (the caller checks) */
#define LR_MAX_MODULES 3
/* Software prefetch distances, in floats ahead along each weight row (0: none), for A (read in order, two
 * rows at a time) and B (a column chunk of every rank row: up to 64 rows at a stride of the fused width,
 * more streams than the hardware prefetcher follows). Measured on a 2-core AMD EPYC (Zen 1) VM with the
 * weights of 8 adapters x 8 layers (out of cache, as in a decode step): see bench/RESULTS.md. */
#ifndef LR_PF_A
#define LR_PF_A 64
#endif
#ifndef LR_PF_B
#define LR_PF_B 64
#endif
#if LR_PF_A > 0
#define LR_PREFETCH_A(p) __builtin_prefetch((p) + LR_PF_A, 0, 3)
#else
#define LR_PREFETCH_A(p) do { } while (0)
#endif
#if LR_PF_B > 0
#define LR_PREFETCH_B(p) __builtin_prefetch((p) + LR_PF_B, 0, 3)
#else
#define LR_PREFETCH_B(p) do { } while (0)
#endif

#if defined(__AVX512F__)
#define LR_VW 16
#else
#define LR_VW 8
#endif
typedef float lvf __attribute__((vector_size(LR_VW * 4)));

static inline lvf lr_load(const float *p) { lvf v; memcpy(&v, p, sizeof v); return v; }
static inline void lr_store(float *p, lvf v) { memcpy(p, &v, sizeof v); }
static inline float lr_hsum(lvf v) {
#if LR_VW == 8 && defined(__AVX__)
    __m256 y; memcpy(&y, &v, 32);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(y), _mm256_extractf128_ps(y, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
#else
    float t = 0.0f;
    for (int i = 0; i < LR_VW; i++) t += v[i];
    return t;
#endif
}

/* One group of one layer: the pool's tensors and where each adapted module sits in them. */
typedef struct {
    int64_t k;                   /* in_features */
    int64_t n;                   /* the fused out_features (B's row length) */
    int64_t width;               /* G * R: rows of A and B per slot */
    int64_t rank;                /* R, the pool's rank */
    int64_t n_modules;           /* adapted modules of the group, <= LR_MAX_MODULES */
    int64_t index[LR_MAX_MODULES];   /* module j's block in A / B rows: index * R */
    int64_t off[LR_MAX_MODULES];     /* its output columns: off .. off + cols */
    int64_t cols[LR_MAX_MODULES];
    const float *a;              /* [slots, width, k] */
    const float *b;              /* [slots, width, n] */
} ty_lora_group;

/* One step's rows grouped by adapter (lora_torch.LoraSegments), as plain arrays. */
typedef struct {
    int64_t n_segments;
    const int64_t *perm;         /* row indices, each segment's contiguous */
    const int64_t *starts;       /* [n_segments + 1] bounds in perm */
    const int64_t *slots;        /* [n_segments] pool slot */
    const int64_t *ranks;        /* [n_segments] the adapter's own rank (<= R) */
    const float *scales;         /* [n_segments] */
    const int64_t *item_seg;     /* [n_items] the segment of each work item */
    const int64_t *item_lo;      /* [n_items] its first position in perm (up to LR_MR rows, within the segment) */
    int64_t n_items;
} ty_lora_segments;

/* t[r][i] = sum_k x_r[k] * a_i[k] for m <= LR_MR rows (missing rows repeat row 0) and `count` rows of A */
static void shrink(const float *const *xr, const float *a, int64_t k, int64_t count, float scale,
                   float t[LR_MR][LR_MAX_W], int64_t t_off) {
    int64_t kv = k - k % LR_VW;
    int64_t i = 0;
    for (; i + 2 <= count; i += 2) {
        const float *a0 = a + i * k, *a1 = a0 + k;
        lvf acc0[LR_MR] = {0}, acc1[LR_MR] = {0};
        for (int64_t c = 0; c < kv; c += LR_VW) {
            LR_PREFETCH_A(a0 + c);
            LR_PREFETCH_A(a1 + c);
            lvf w0 = lr_load(a0 + c), w1 = lr_load(a1 + c);
            for (int r = 0; r < LR_MR; r++) {
                lvf xv = lr_load(xr[r] + c);
                acc0[r] += xv * w0;
                acc1[r] += xv * w1;
            }
        }
        for (int r = 0; r < LR_MR; r++) {
            float s0 = lr_hsum(acc0[r]), s1 = lr_hsum(acc1[r]);
            for (int64_t c = kv; c < k; c++) {
                s0 += xr[r][c] * a0[c];
                s1 += xr[r][c] * a1[c];
            }
            t[r][t_off + i] = s0 * scale;
            t[r][t_off + i + 1] = s1 * scale;
        }
    }
    for (; i < count; i++) {
        const float *a0 = a + i * k;
        lvf acc0[LR_MR] = {0};
        for (int64_t c = 0; c < kv; c += LR_VW) {
            lvf w0 = lr_load(a0 + c);
            for (int r = 0; r < LR_MR; r++) acc0[r] += lr_load(xr[r] + c) * w0;
        }
        for (int r = 0; r < LR_MR; r++) {
            float s0 = lr_hsum(acc0[r]);
            for (int64_t c = kv; c < k; c++) s0 += xr[r][c] * a0[c];
            t[r][t_off + i] = s0 * scale;
        }
    }
}

/* y_r[off + 0..cols) += sum_i t[r][t_off + i] * b[i * ldb + 0..cols), for the m real rows */
static void expand(float *const *rows, int64_t off, int m, const float *b, int64_t ldb, int64_t cols,
                   int64_t count, float t[LR_MR][LR_MAX_W], int64_t t_off) {
    float *yr[LR_MR];
    for (int r = 0; r < LR_MR; r++) yr[r] = rows[r] + off;
    int64_t c = 0;
    for (; c + 2 * LR_VW <= cols; c += 2 * LR_VW) {
        lvf acc0[LR_MR] = {0}, acc1[LR_MR] = {0};
        for (int64_t i = 0; i < count; i++) {
            const float *bi = b + i * ldb + c;
            LR_PREFETCH_B(bi);
            lvf w0 = lr_load(bi), w1 = lr_load(bi + LR_VW);
            for (int r = 0; r < LR_MR; r++) {
                float s = t[r][t_off + i];
                acc0[r] += s * w0;
                acc1[r] += s * w1;
            }
        }
        for (int r = 0; r < m; r++) {
            lr_store(yr[r] + c, lr_load(yr[r] + c) + acc0[r]);
            lr_store(yr[r] + c + LR_VW, lr_load(yr[r] + c + LR_VW) + acc1[r]);
        }
    }
    for (; c + LR_VW <= cols; c += LR_VW) {
        lvf acc0[LR_MR] = {0};
        for (int64_t i = 0; i < count; i++) {
            lvf w0 = lr_load(b + i * ldb + c);
            for (int r = 0; r < LR_MR; r++) acc0[r] += t[r][t_off + i] * w0;
        }
        for (int r = 0; r < m; r++) lr_store(yr[r] + c, lr_load(yr[r] + c) + acc0[r]);
    }
    for (; c < cols; c++) {
        for (int r = 0; r < m; r++) {
            float s = 0.0f;
            for (int64_t i = 0; i < count; i++) s += t[r][t_off + i] * b[i * ldb + c];
            yr[r][c] += s;
        }
    }
}

static void one_item(const float *x, int64_t ldx, float *y, int64_t ldy, const ty_lora_group *g,
                     const ty_lora_segments *sg, int64_t item) {
    int64_t seg = sg->item_seg[item], lo = sg->item_lo[item];
    int64_t hi = sg->starts[seg + 1];
    int m = (int)(hi - lo < LR_MR ? hi - lo : LR_MR);
    int64_t slot = sg->slots[seg], r = sg->ranks[seg];
    if (r <= 0 || r > g->rank) r = g->rank;
    const float *xr[LR_MR];
    float *yr[LR_MR];
    for (int i = 0; i < LR_MR; i++) {
        int64_t row = sg->perm[lo + (i < m ? i : 0)];
        xr[i] = x + row * ldx;
        yr[i] = y + row * ldy;
    }
    float t[LR_MR][LR_MAX_W];
    const float *a = g->a + slot * g->width * g->k;
    const float *b = g->b + slot * g->width * g->n;
    for (int64_t j = 0; j < g->n_modules; j++)
        shrink(xr, a + g->index[j] * g->rank * g->k, g->k, r, sg->scales[seg], t, j * g->rank);
    for (int64_t j = 0; j < g->n_modules; j++)
        expand(yr, g->off[j], m, b + g->index[j] * g->rank * g->n + g->off[j], g->n, g->cols[j], r, t, j * g->rank);
}

/* y [rows, ldy] += the adapters' products of x [rows, ldx], in place. 0, or -1 when the group does not
 * fit the kernel (the caller then uses the torch form). */
int tokenyard_lora_add(const float *x, int64_t ldx, float *y, int64_t ldy, const ty_lora_group *g,
                       const ty_lora_segments *sg) {
    if (g->width > LR_MAX_W || g->n_modules > LR_MAX_MODULES || g->n_modules * g->rank > LR_MAX_W) return -1;
    int64_t n_items = sg->n_items;
#pragma omp parallel for schedule(dynamic, 1) if (n_items > 1)
    for (int64_t item = 0; item < n_items; item++) one_item(x, ldx, y, ldy, g, sg, item);
    return 0;
}

int tokenyard_lora_max_width(void) { return LR_MAX_W; }
int tokenyard_lora_rows_per_item(void) { return LR_MR; }
