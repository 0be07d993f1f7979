/* One router feature row in one pass of C: the same columns, in the same order, and the same
 * dense counts as the numpy path of tokenyard/router_models/runtime/features.py (`row_numpy`), which stays
 * the reference (tests/router/test_router_native.py checks that the two agree).
 *
 * Why C: the numpy path is about a hundred small array operations on a 512-character window, and
 * at ~2 us of dispatch each they, not the arithmetic, set the decision latency. Here an n-gram is
 * a few integer operations. Python still parses the instruction (features.instruction: a regex
 * and crc32 of a few dozen words) and lower-cases the window (Unicode rules).
 *
 * Hashing is mod 2^64 (unsigned overflow), exactly as numpy's uint64 arithmetic wraps.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define P 0x100000001B3ULL          /* polynomial base, features._P */
#define MIX 0x9E3779B97F4A7C15ULL   /* multiply-shift mixer, features._MIX */
#define SHIFT 29
#define TOKEN_LENGTH 0x2545F491ULL  /* a token's hash adds its length times this */
#define CROSS 0x100000001ULL        /* left * CROSS + size signature */
#define N_DENSE 14                  /* features.DENSE_NAMES */

/* params (uint64), per feature spec: see native.params_of */
enum { WLO, WHI, CLO, CHI, DW, DC, DX, SW, SC, SX, TOTAL, SALT_W, SALT_B, SALT_C, SALT_X, NPARAMS };
/* the dense counts, in features.DENSE_NAMES order */
enum { D_TOKENS, D_CHARS, D_WORDS, D_DIGITS, D_NUMBERS, D_LONGEST, D_OPERATORS, D_CAPITALS, D_PUNCT,
       D_DISTINCT, D_LINES, D_QUESTION, D_NOVELTY, D_NOVEL_GRAMS };

/* 0 space, 1 a-z, 2 0-9, 3 any other character (its own token) */
static inline int cls_of(uint32_t c) {
    if (c - 97u < 26u) return 1;
    if (c - 48u < 10u) return 2;
    return c == 32u ? 0 : 3;
}

/* What Python's str.split() splits on (str.isspace). */
static inline int is_space(uint32_t c) {
    if (c <= 0x20u) return c == 0x20u || (c >= 0x09u && c <= 0x0Du) || (c >= 0x1Cu && c <= 0x1Fu);
    if (c < 0x85u) return 0;
    return c == 0x85u || c == 0xA0u || c == 0x1680u || (c >= 0x2000u && c <= 0x200Au) || c == 0x2028u ||
           c == 0x2029u || c == 0x202Fu || c == 0x205Fu || c == 0x3000u;
}

/* ASCII classes of the dense counts (features._OPERATORS, _PUNCT, _CAPITALS, and '?') */
enum { C_OP = 1, C_PUNCT = 2, C_CAP = 4, C_QUESTION = 8 };
static const unsigned char ASCII_CLASS[128] = {
    ['+'] = C_OP, ['-'] = C_OP, ['*'] = C_OP, ['/'] = C_OP, ['='] = C_OP, ['<'] = C_OP, ['>'] = C_OP,
    ['^'] = C_OP, ['%'] = C_OP,
    ['.'] = C_PUNCT, [','] = C_PUNCT, [';'] = C_PUNCT, [':'] = C_PUNCT, ['!'] = C_PUNCT,
    ['?'] = C_PUNCT | C_QUESTION, ['\''] = C_PUNCT, ['"'] = C_PUNCT, ['('] = C_PUNCT, [')'] = C_PUNCT,
    ['A'] = C_CAP, ['B'] = C_CAP, ['C'] = C_CAP, ['D'] = C_CAP, ['E'] = C_CAP, ['F'] = C_CAP, ['G'] = C_CAP,
    ['H'] = C_CAP, ['I'] = C_CAP, ['J'] = C_CAP, ['K'] = C_CAP, ['L'] = C_CAP, ['M'] = C_CAP, ['N'] = C_CAP,
    ['O'] = C_CAP, ['P'] = C_CAP, ['Q'] = C_CAP, ['R'] = C_CAP, ['S'] = C_CAP, ['T'] = C_CAP, ['U'] = C_CAP,
    ['V'] = C_CAP, ['W'] = C_CAP, ['X'] = C_CAP, ['Y'] = C_CAP, ['Z'] = C_CAP,
};

/* Distinct words among `nw` spans of `s` (exact: equal hashes are compared in full). */
static int64_t distinct_words(const uint32_t *s, const int64_t *start, const int64_t *len, int64_t nw) {
    if (nw == 0) return 0;
    int64_t size = 16;
    while (size < 2 * nw) size <<= 1;
    int64_t *slot = malloc(sizeof(int64_t) * (size_t)size);
    uint64_t *hash = malloc(sizeof(uint64_t) * (size_t)size);
    if (!slot || !hash) { free(slot); free(hash); return -1; }
    for (int64_t i = 0; i < size; i++) slot[i] = -1;
    int64_t distinct = 0;
    for (int64_t w = 0; w < nw; w++) {
        uint64_t h = 0;
        for (int64_t t = 0; t < len[w]; t++) h = h * P + s[start[w] + t];
        h += (uint64_t)len[w];
        int64_t at = (int64_t)((h * MIX) >> 40) & (size - 1);
        for (;; at = (at + 1) & (size - 1)) {
            int64_t o = slot[at];
            if (o < 0) { slot[at] = w; hash[at] = h; distinct++; break; }
            if (hash[at] == h && len[o] == len[w] &&
                memcmp(s + start[o], s + start[w], sizeof(uint32_t) * (size_t)len[w]) == 0) break;
        }
    }
    free(slot);
    free(hash);
    return distinct;
}

/* low: the window as its words are read (lower-cased), n_low code points; orig: the window as
 * written; text/n_text: the whole prompt in UTF-8 to count its newlines (NULL: `lines` holds the
 * count); left/sizes: the cross block's crc32 entries, the last tail_left of left also alone;
 * scalars: the prompt's tokens, chars, lines and its instruction's novelty (share, unseen grams);
 * norm: the dense mean[14] then scale[14]; weights (or NULL): the scorer's weights, n_weights per
 * column (row-major: column c's weights at weights[c * n_weights]).
 * out_cols must hold (3 + char_hi - char_lo) * (n_low + 2) + n_left * (n_sizes + 1) + n_sizes entries;
 * work must hold 3 * (n_low + 2) int64. out_f (double[17 + 4 * n_weights]): dense[14], factors[3], then
 * with weights each hashed block's sum of its occurrences' weights and the dense values' dot product
 * with their weights, block-major ([4][n_weights]). out_i (int64[4]): ends of the word, char
 * and cross blocks in out_cols, then the number of tokens. Returns 0, or -1 when out of memory. */
int tokenyard_row(const uint32_t *low, int64_t n_low, const uint32_t *orig, int64_t n_orig,
                  const char *text, int64_t n_text, const uint64_t *left, int64_t n_left,
                  const uint64_t *sizes, int64_t n_sizes, int64_t tail_left, double tokens, double chars,
                  double lines, double novelty, double novel_grams, const uint64_t *params,
                  const double *norm, const double *weights, int64_t n_weights, int64_t *out_cols, int64_t *work,
                  double *out_f, int64_t *out_i) {
    /* words: split on whitespace, joined by single spaces, one space each side */
    int64_t *wstart = work, *wlen = work + (n_low + 2);
    uint32_t *cp = (uint32_t *)(work + 2 * (n_low + 2));   /* n_low + 2 code points fit in n_low + 2 int64 */
    int64_t n = 0, nw = 0;
    cp[n++] = 32u;
    for (int64_t i = 0; i < n_low;) {
        if (is_space(low[i])) { i++; continue; }
        int64_t j = i;
        while (j < n_low && !is_space(low[j])) j++;
        wstart[nw] = n;
        wlen[nw++] = j - i;
        memcpy(cp + n, low + i, sizeof(uint32_t) * (size_t)(j - i));
        n += j - i;
        cp[n++] = 32u;
        i = j;
    }
    if (nw == 0) cp[n++] = 32u;            /* " " + "" + " " */
    int64_t distinct = distinct_words(cp, wstart, wlen, nw);
    if (distinct < 0) return -1;

    uint64_t *tok = malloc(sizeof(uint64_t) * (size_t)n);
    int32_t *counts = calloc((size_t)params[TOTAL], sizeof(int32_t));
    if (!tok || !counts) { free(tok); free(counts); return -1; }
    int64_t ntok = 0, digits = 0, numbers = 0, longest = 0, k = 0;

    /* tokens: runs of a-z, runs of digits, or one other character; Horner hash plus length */
    for (int64_t i = 0; i < n;) {
        int c = cls_of(cp[i]);
        if (c == 0) { i++; continue; }
        int64_t j = i + 1;
        if (c != 3) while (j < n && cls_of(cp[j]) == c) j++;
        uint64_t h = 0;
        for (int64_t t = i; t < j; t++) h = h * P + cp[t];
        tok[ntok++] = h + (uint64_t)(j - i) * TOKEN_LENGTH;
        if (c == 2) { digits += j - i; numbers++; if (j - i > longest) longest = j - i; }
        i = j;
    }

    /* word 1-2-grams: unigrams in order, then bigrams */
    if (params[WLO] <= 1)
        for (int64_t t = 0; t < ntok; t++) out_cols[k++] = (int64_t)(tok[t] ^ params[SALT_W]);
    if (params[WHI] >= 2)
        for (int64_t t = 0; t + 1 < ntok; t++)
            out_cols[k++] = (int64_t)((tok[t] * P + tok[t + 1] + params[SALT_B]) ^ params[SALT_W]);
    int64_t end_word = k;

    /* character n-grams with no space inside (only at their ends), by length then position */
    if (nw)
        for (uint64_t m = params[CLO]; m <= params[CHI]; m++)
            for (int64_t i = 0; i + (int64_t)m <= n; i++) {
                if (m == 1 && cp[i] == 32u) continue;
                int inner = 0;
                for (uint64_t t = 1; t + 1 < m; t++) if (cp[i + (int64_t)t] == 32u) { inner = 1; break; }
                if (inner) continue;
                uint64_t h = 0;
                for (uint64_t t = 0; t < m; t++) h = h * P + cp[i + (int64_t)t];
                out_cols[k++] = (int64_t)((h + m) ^ params[SALT_C]);
            }
    int64_t end_char = k;

    /* crosses: every left entry with each size signature, then the last tail_left entries of left
     * alone, then the sizes alone */
    for (int64_t a = 0; a < n_left; a++)
        for (int64_t b = 0; b < n_sizes; b++)
            out_cols[k++] = (int64_t)((left[a] * CROSS + sizes[b]) ^ params[SALT_X]);
    for (int64_t a = n_left - tail_left; a < n_left; a++) out_cols[k++] = (int64_t)(left[a] ^ params[SALT_X]);
    for (int64_t b = 0; b < n_sizes; b++) out_cols[k++] = (int64_t)(sizes[b] ^ params[SALT_X]);

    /* mix, bucket into each block, count (the sum of c^2 grows by 2c + 1 per occurrence), and add
     * up the weights */
    int64_t ends[3] = {end_word, end_char, k};
    uint64_t dims[3] = {params[DW], params[DC], params[DX]};
    int64_t starts[3] = {(int64_t)params[SW], (int64_t)params[SC], (int64_t)params[SX]};
    double block_weight[3] = {1.0, 1.0, 0.0};
    memcpy(&block_weight[2], &params[NPARAMS], sizeof(double));   /* cross_weight, stored as its bits */
    double *sums = out_f + N_DENSE + 3;
    if (weights) memset(sums, 0, sizeof(double) * 4 * (size_t)n_weights);
    int64_t lo = 0;
    for (int b = 0; b < 3; b++) {
        int64_t sq = 0;
        double *sum = sums + b * n_weights;
        for (int64_t i = lo; i < ends[b]; i++) {
            int64_t col = (int64_t)((((uint64_t)out_cols[i] * MIX) >> SHIFT) % dims[b]) + starts[b];
            out_cols[i] = col;
            sq += 2 * (int64_t)counts[col] + 1;
            counts[col]++;
            if (weights)
                for (int64_t e = 0; e < n_weights; e++) sum[e] += weights[col * n_weights + e];
        }
        out_i[b] = ends[b];
        out_f[N_DENSE + b] = sq > 0 ? block_weight[b] / sqrt((double)sq) : 0.0;
        lo = ends[b];
    }
    free(tok);
    free(counts);

    if (text) {
        int64_t nl = 0;
        const char *p = text, *end = text + n_text;
        while ((p = memchr(p, '\n', (size_t)(end - p))) != NULL) { nl++; p++; }
        lines = (double)(nl + 1);
    }
    double raw[N_DENSE];
    raw[D_TOKENS] = tokens;
    raw[D_CHARS] = chars;
    raw[D_WORDS] = (double)nw;
    raw[D_DIGITS] = (double)digits;
    raw[D_NUMBERS] = (double)numbers;
    raw[D_LONGEST] = (double)longest;
    int64_t by_class[16] = {0};
    for (int64_t i = 0; i < n_orig; i++)
        if (orig[i] < 128u) by_class[ASCII_CLASS[orig[i]]]++;
    int64_t ops = 0, punct = 0, caps = 0, question = 0;
    for (int c = 1; c < 16; c++) {
        if (c & C_OP) ops += by_class[c];
        if (c & C_PUNCT) punct += by_class[c];
        if (c & C_CAP) caps += by_class[c];
        if (c & C_QUESTION) question += by_class[c];
    }
    raw[D_OPERATORS] = (double)ops;
    raw[D_CAPITALS] = (double)caps;
    raw[D_PUNCT] = (double)punct;
    raw[D_DISTINCT] = (double)distinct;
    raw[D_LINES] = lines;
    raw[D_QUESTION] = (double)question;
    raw[D_NOVELTY] = novelty;
    raw[D_NOVEL_GRAMS] = novel_grams;
    for (int i = 0; i < N_DENSE; i++) {
        out_f[i] = (log1p(raw[i]) - norm[i]) / norm[N_DENSE + i];
        if (weights)
            for (int64_t e = 0; e < n_weights; e++) sums[3 * n_weights + e] += weights[i * n_weights + e] * out_f[i];
    }
    out_i[3] = ntok;
    return 0;
}
