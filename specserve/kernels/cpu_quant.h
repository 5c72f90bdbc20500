/* What cpu_quant.c offers cpu_layers.c: a GGUF weight repacked at load (core/quant.py's
   "q4" and "q8") and its product with float32 rows, computed by the calling OpenMP thread
   for its share of the output columns. */
#ifndef SPECSERVE_CPU_QUANT_H
#define SPECSERVE_CPU_QUANT_H
#include <stdint.h>

enum { QW_Q4 = 0, QW_Q8 = 1 };

/* W [N, K]: W[n, k] = q * scale[n, g] + offset[n, g], g = k / group (offset NULL: none).
   q4: data uint8 [N, K / 2], 16 bytes a group of 32 (column j low nibble, j + 16 high);
   q8: data int8 [N, K]. */
typedef struct {
    int64_t method, N, K, group;
    const void *data;
    const float *scale, *offset;
} QW;

/* y[m, n] (+)= x[m, :] . W[n, :] for m < M and this thread's share of n (OpenMP's thread
   number and count; call from every thread of a parallel region, or alone). accumulate:
   add to y (a residual) instead of overwriting it. x [M, K] and y [M, N] contiguous. */
void qmm_share(const QW *w, const float *x, int64_t M, float *y, int accumulate);

#endif
