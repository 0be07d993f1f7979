/* Greedy choice under a grammar mask, read straight from xgrammar's bitmask words.
 *
 * out[r] = the first token t < vocab whose bit (bit t % 32 of word t / 32 of mask row r) is set and
 * whose logit is the largest of the allowed ones in logits row rows[r]; a NaN among the allowed ones
 * wins at once (numpy's argmax takes the first NaN); 0 when no allowed token beats -inf. These are
 * the tokens of numpy's argmax over torch.where(allowed, logits, -inf), which this replaces: that
 * select writes a whole masked copy of the batch's logits (32 x 49,152 floats, 1-4 ms a step on a
 * 2-core VM), where this reads only the allowed logits once and writes nothing.
 */
#include <stdint.h>
#include <math.h>

void tokenyard_masked_argmax(const float *logits, int64_t row_stride, const int64_t *rows,
                             const int32_t *mask, int64_t words, int64_t nrows, int64_t vocab,
                             int64_t *out) {
    for (int64_t r = 0; r < nrows; r++) {
        const float *x = logits + rows[r] * row_stride;
        const uint32_t *m = (const uint32_t *)(mask + r * words);
        float best = -INFINITY;
        int64_t pick = 0;
        for (int64_t w = 0; w < words; w++) {
            uint32_t bits = m[w];
            int64_t base = w * 32;
            while (bits) {
                int64_t t = base + __builtin_ctz(bits);
                if (t >= vocab) { bits = 0; break; }
                float v = x[t];
                if (isnan(v)) { pick = t; goto done; }
                if (v > best) { best = v; pick = t; }
                bits &= bits - 1;
            }
        }
    done:
        out[r] = pick;
    }
}
