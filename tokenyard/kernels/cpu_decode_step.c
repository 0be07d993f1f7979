/* One whole decode step of a Llama-family decoder on the CPU, in C, for a few sequences at a time.
 *
 * Why: at batch 1 a decode step reads every weight once and does little else, so its speed is the
 * speed at which the weights stream through the cores. torch (eager or inductor-compiled) spends
 * most of a small model's step between the reads: a dispatch per op, an OpenMP region and its
 * barrier per kernel, an activation tensor allocated per op. Here the step is one call: a pool of
 * threads that lives as long as the model walks the layers together, taking each projection's
 * output rows in chunks, meeting at a spin barrier only where a result is needed by all (five
 * times a layer), with every buffer allocated once.
 *
 * What one step computes, for B tokens (one new token per sequence, B <= max_batch):
 *   h = embed[ids]
 *   per layer: x = rmsnorm(h) * w_in;  q, k, v = split(x @ Wqkv^T + b);  rotary(q, k) at positions;
 *              K/V written to the paged cache at slots;  o = attention(q, paged K/V of the sequence);
 *              h += o @ Wo^T;  x = rmsnorm(h) * w_post;  a = silu(x @ Wg^T) * (x @ Wu^T);  h += a @ Wd^T
 *   logits = (rmsnorm(h) * w_final) @ Wlm^T
 * the same arithmetic as tokenyard/engines/model/model.py in fp32 (summation order differs; the tests
 * compare with a tolerance).
 *
 * Weights are read where they lie (torch tensors' storage), in the forms cpu_matvec.c describes.
 * The KV cache is fp32 [kv_heads, slots, head_dim]; attention is cpu_decode_attention.c's kernel,
 * one call per (sequence, kv head).
 *
 * The projections are cpu_matvec.c's (one translation unit: both files are #included here).
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <sched.h>

#include "cpu_decode_attention.c"
#include "cpu_matvec.c"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#else
#define CPU_RELAX() do { } while (0)
#endif

#define TY_MAX_THREADS 64

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
    ty_scratch scratch;  /* private: per-group input sums [max_batch, max k / 32], widened rows [TY_WBUF_ROWS, max k],
                          * a packed panel [TY_KC, TY_PR] */
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

/* gate[i] = silu(gate[i]) * up[i]; eight at a time with the attention kernel's vector exp (expf one
 * element at a time was a fifth of a 96-sequence step) */
static void silu_mul(float *gate, const float *up, int64_t n) {
    int64_t i = 0;
#ifdef __AVX2__
    for (; i + 8 <= n; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
        _mm256_storeu_ps(gate + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)),
                                                 _mm256_loadu_ps(up + i)));
    }
#endif
    for (; i < n; i++) gate[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

static void run_step(ty_worker *wk, int *sense) {
    ty_pool *p = wk->pool;
    const ty_model *m = &p->m;
    const ty_job *job = &p->job;
    const int t = wk->index, T = p->n_threads;
    const int64_t B = job->batch, D = m->hidden, hd = m->head_dim, H = m->heads, KVH = m->kv_heads;
    const int64_t qs = H * hd, kvs = KVH * hd, QKV = qs + 2 * kvs, I = m->inter, group = H / KVH;
    int64_t lo, hi, ph = 0;

    wk->scratch.prepared = NULL;
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
        matvec(&L->qkv, wk->x, D, B, lo, hi, p->qkv, QKV, 0, &wk->scratch);
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
        wk->scratch.prepared = NULL;
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
        wk->scratch.prepared = NULL;
        /* h += o_proj(attn) */
        while (next_chunk(p, ph, D, 16, &lo, &hi)) matvec(&L->o, p->attn, qs, B, lo, hi, p->h, D, 1, &wk->scratch);
        ph++;
        barrier(p, sense);
        wk->scratch.prepared = NULL;
        /* a = silu(gate) * up, row i of the gate and of the up projection by the same thread */
        rmsnorm_rows(p->h, L->post_norm, B, D, m->eps, wk->x);
        while (next_chunk(p, ph, I, 16, &lo, &hi)) {
            matvec(&L->gate_up, wk->x, D, B, lo, hi, p->act, 2 * I, 0, &wk->scratch);
            matvec(&L->gate_up, wk->x, D, B, I + lo, I + hi, p->act, 2 * I, 0, &wk->scratch);
            for (int64_t b = 0; b < B; b++) silu_mul(p->act + b * 2 * I + lo, p->act + b * 2 * I + I + lo, hi - lo);
        }
        ph++;
        barrier(p, sense);
        wk->scratch.prepared = NULL;
        /* h += down(a) */
        while (next_chunk(p, ph, D, 16, &lo, &hi)) matvec(&L->down, p->act, 2 * I, B, lo, hi, p->h, D, 1, &wk->scratch);
        ph++;
        barrier(p, sense);
        wk->scratch.prepared = NULL;
    }
    rmsnorm_rows(p->h, m->final_norm, B, D, m->eps, wk->x);
    while (next_chunk(p, ph, m->vocab, 16, &lo, &hi))
        matvec(&m->lm_head, wk->x, D, B, lo, hi, job->logits, m->vocab, 0, &wk->scratch);
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
    if (L->kind == TY_INT4 || L->kind == TY_INT4R16)
        return L->scale && L->minv && L->group % 32 == 0 && L->group > 0 && k % L->group == 0
               && (L->kind == TY_INT4 || (TY_ROWS16 && n % 16 == 0));
    return L->kind == TY_F32;
}

static void free_pool(ty_pool *p) {
    for (int t = 0; t < TY_MAX_THREADS; t++) {
        free(p->workers[t].x); free(p->workers[t].scratch.gsum); free(p->workers[t].scratch.wbuf); free(p->workers[t].scratch.q8); free(p->workers[t].scratch.panel); free(p->workers[t].attn_work); free(p->workers[t].mask);
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
    const int64_t B = m->max_batch, widest = D > I ? D : I, widest_k = qs > widest ? qs : widest;
    const int64_t most_groups = widest_k / 32 + 1;
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
        wk->scratch.gsum = malloc(sizeof(float) * (size_t)(B * most_groups));
        wk->scratch.wbuf = malloc(sizeof(float) * (size_t)(TY_WBUF_ROWS * widest_k));
        wk->scratch.panel = malloc(sizeof(float) * (size_t)(TY_PR * TY_KC));
        wk->scratch.q8 = malloc(sizeof(float) * (size_t)(B * (widest_k / 16 + widest_k / 4 + 2)));
        wk->attn_work = malloc(sizeof(float) * (size_t)(m->head_dim + (m->heads / m->kv_heads) * span));
        wk->mask = malloc(sizeof(float) * (size_t)span);
        ok = wk->x && wk->scratch.gsum && wk->scratch.wbuf && wk->scratch.q8 && wk->scratch.panel && wk->attn_work
             && wk->mask;
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

/* out[b * ld_out + r] (+)= W[r] . x[b * ld_x] for rows [r0, r1) of one projection, b < batch: the
 * step's own products, alone (tests compare them with numpy; tokenyard/bench/matvec_tiles.py times them).
 * Returns -1 on bad arguments (nothing written). */
int tokenyard_matvec(const ty_linear *L, const float *x, int64_t ld_x, int64_t batch, int64_t r0, int64_t r1,
                     float *out, int64_t ld_out, int accumulate) {
    if (!linear_ok(L, L->n, L->k) || batch < 1 || r0 < 0 || r0 > r1 || r1 > L->n || ld_x < L->k || ld_out < r1)
        return -1;
    ty_scratch scratch = {malloc(sizeof(float) * (size_t)(batch * (L->k / 32 + 1))),
                          malloc(sizeof(float) * (size_t)(TY_WBUF_ROWS * L->k)),
                          malloc(sizeof(float) * (size_t)(batch * (L->k / 16 + L->k / 4 + 2))), NULL,
                          malloc(sizeof(float) * (size_t)(TY_PR * TY_KC))};
    int rc = scratch.gsum && scratch.wbuf && scratch.q8 && scratch.panel ? 0 : -1;
    if (!rc) matvec(L, x, ld_x, batch, r0, r1, out, ld_out, accumulate, &scratch);
    free(scratch.gsum);
    free(scratch.wbuf);
    free(scratch.q8);
    free(scratch.panel);
    return rc;
}

/* 1 when this build rounds the inputs of int4 and int8 products to int8 for small batches (cpu_matvec_q8.c, AVX2) */
int tokenyard_int8_inputs(void) { return TY_Q8_INPUTS; }

/* 1 when this build reads int4 weights in 16-row blocks (TY_INT4R16: AVX-512 with VNNI, cpu_matvec_q8.c) */
int tokenyard_int4_rows16(void) { return TY_ROWS16; }

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

