/* Row reductions of float32 logits on the CPU (driven by kernels/cpu_rows.py; built with
   cpu_quant.c): the greedy token of each row, and its log-probability, where torch's CPU
   argmax and logsumexp each read about one element a nanosecond and a batch-1 step takes
   them once or twice over a whole vocabulary.

   Invariant: the index is torch.argmax's, the first of the row's largest values; a row
   holding a NaN gets -1 (the caller asks torch, which ranks NaN first). The log-probability
   is -log(sum_j exp(x_j - max)), the sum over 16-lane exp (cpu_exp.h) in a fixed order:
   within float32 rounding of torch's log_softmax, not its bits. */
#include <math.h>
#include <stdint.h>

#include "cpu_exp.h"

#define LANES 4 /* vectors of 16 a step, each its own running maxima: no chain through one */

/* the first index of the largest of row[0 .. V), or -1 if one is NaN */
static int64_t row_argmax(const float *row, int64_t V) {
    int64_t j = 0, best = 0;
    float top = row[0];
    int nan = top != top;
#ifdef __AVX512F__
    if (V >= 16 * LANES) {
        const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512i step = _mm512_set1_epi32(16 * LANES);
        __m512 bv[LANES];
        __m512i bi[LANES], idx[LANES];
        __mmask16 unordered = 0;
        for (int l = 0; l < LANES; l++) {
            bv[l] = _mm512_loadu_ps(row + 16 * l);
            bi[l] = idx[l] = _mm512_add_epi32(iota, _mm512_set1_epi32(16 * l));
            unordered |= _mm512_cmp_ps_mask(bv[l], bv[l], _CMP_UNORD_Q);
        }
        for (j = 16 * LANES; j + 16 * LANES <= V; j += 16 * LANES)
            for (int l = 0; l < LANES; l++) { /* each lane keeps its first largest: only greater replaces */
                const __m512 v = _mm512_loadu_ps(row + j + 16 * l);
                idx[l] = _mm512_add_epi32(idx[l], step);
                const __mmask16 gt = _mm512_cmp_ps_mask(v, bv[l], _CMP_GT_OQ);
                bv[l] = _mm512_mask_mov_ps(bv[l], gt, v);
                bi[l] = _mm512_mask_mov_epi32(bi[l], gt, idx[l]);
                unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            }
        if (unordered) return -1;
        __m512 all = bv[0];
        for (int l = 1; l < LANES; l++) all = _mm512_max_ps(all, bv[l]);
        top = _mm512_reduce_max_ps(all);
        int64_t first = V;
        for (int l = 0; l < LANES; l++) { /* the lowest index among the lanes holding it */
            const __mmask16 at = _mm512_cmp_ps_mask(bv[l], _mm512_set1_ps(top), _CMP_EQ_OQ);
            if (at) {
                const int64_t k = _mm512_mask_reduce_min_epi32(at, bi[l]);
                first = k < first ? k : first;
            }
        }
        best = first;
    }
#endif
    for (j = j ? j : 1; j < V; j++) {
        const float v = row[j];
        nan |= v != v;
        if (v > top) {
            top = v;
            best = j;
        }
    }
    return nan ? -1 : best;
}

/* out[r] = row r's argmax (row_argmax) for the R rows of x [R, V], V >= 1 */
void rows_argmax(const float *x, int64_t R, int64_t V, int64_t *out) {
    for (int64_t r = 0; r < R; r++) out[r] = row_argmax(x + r * V, V);
}

/* sum_j exp(row[j] - max) over row[0 .. V) */
static float sum_exp(const float *row, int64_t V, float max) {
    int64_t j = 0;
    float sum = 0.f;
#ifdef __AVX512F__
    const __m512 m = _mm512_set1_ps(max);
    __m512 s[LANES];
    for (int l = 0; l < LANES; l++) s[l] = _mm512_setzero_ps();
    for (; j + 16 * LANES <= V; j += 16 * LANES)
        for (int l = 0; l < LANES; l++)
            s[l] = _mm512_add_ps(s[l], exp16(_mm512_sub_ps(_mm512_loadu_ps(row + j + 16 * l), m)));
    for (int l = 1; l < LANES; l++) s[0] = _mm512_add_ps(s[0], s[l]);
    sum = _mm512_reduce_add_ps(s[0]);
#endif
    for (; j < V; j++) sum += expf(row[j] - max);
    return sum;
}

/* idx[r] = row r's argmax (row_argmax) and logp[r] its log-probability under the row's
   softmax, for the R rows of x [R, V], V >= 1; a row with a NaN gets idx -1 */
void rows_top1(const float *x, int64_t R, int64_t V, int64_t *idx, float *logp) {
    for (int64_t r = 0; r < R; r++) {
        const float *row = x + r * V;
        idx[r] = row_argmax(row, V);
        logp[r] = idx[r] < 0 ? NAN : -logf(sum_exp(row, V, row[idx[r]]));
    }
}
