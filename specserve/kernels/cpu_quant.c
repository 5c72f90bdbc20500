/* Quantized matrix products on the CPU: y[M, N] = x[M, K] . W^T, W held as GGUF blocks
   repacked at load (cpu_quant.h; specserve/core/quant.py, methods "q4" and "q8"; built
   and called by kernels/cpu_quant.py, and by cpu_layers.c). x and y are float32; K is a
   multiple of 32.

   Each weight is dequantized to float32 exactly as core/quant.py does (q * scale, then
   + offset: two roundings, -ffp-contract=off keeps them apart), then multiplied and summed
   in float32. q4 decodes a group through a 16-entry table of its values (q * scale +
   offset for q = 0..15), indexed by the nibbles themselves. The sum for one (m, n) runs
   the same way whatever M is and whichever tile holds it: one 16-lane accumulator over the
   32-column steps in order (a step's first 16 columns, then its last 16), then reduced; so
   a row's result does not depend on the other rows (a verify's rows equal decode's) nor on
   the thread count. Tiles take NB output rows by R input rows, a step's weights decoded
   once for all R; NB and R only change speed. The AVX-512 path is compiled where the
   machine has it (-march=native), plain loops elsewhere. */
#include <omp.h>
#include <stdint.h>

#include "cpu_quant.h"

#ifdef __AVX512F__
#include <immintrin.h>

#define UNROLL _Pragma("GCC unroll 8")

/* the 32 weights of row n in step s (columns 32 s ..): lo the first 16, hi the last 16 */
static inline __attribute__((always_inline)) void q4_step(const QW *w, int64_t n, int64_t s, __m512 *lo,
                                                          __m512 *hi) {
    const int64_t G = w->K / 32;
    const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    __m512 table = _mm512_mul_ps(iota, _mm512_set1_ps(w->scale[n * G + s]));
    if (w->offset) table = _mm512_add_ps(table, _mm512_set1_ps(w->offset[n * G + s]));
    const uint8_t *b = (const uint8_t *)w->data + n * (w->K / 2) + 16 * s;
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)b));
    *lo = _mm512_permutexvar_ps(v, table);  /* the index is a lane's low 4 bits: the low nibble */
    *hi = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
}

/* the 16 weights of row n at columns c .. c + 15 (inside one group) */
static inline __attribute__((always_inline)) __m512 q8_chunk(const QW *w, int64_t n, int64_t c) {
    const int64_t G = w->K / w->group, g = c / w->group;
    const int8_t *b = (const int8_t *)w->data + n * w->K + c;
    __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)b)));
    q = _mm512_mul_ps(q, _mm512_set1_ps(w->scale[n * G + g]));
    if (w->offset) q = _mm512_add_ps(q, _mm512_set1_ps(w->offset[n * G + g]));
    return q;
}

/* y rows m0 .. m0 + R, columns n0 .. n0 + NB */
static inline __attribute__((always_inline)) void tile(const QW *w, const int q4, const float *x, int64_t m0,
                                                       const int R, int64_t n0, const int NB, float *y,
                                                       int accumulate) {
    const int64_t K = w->K, N = w->N;
    __m512 a[8][8];
    UNROLL for (int i = 0; i < NB; i++) UNROLL for (int j = 0; j < R; j++) a[i][j] = _mm512_setzero_ps();
    for (int64_t s = 0; s < K / 32; s++) {
        __m512 lo[8], hi[8];
        UNROLL for (int i = 0; i < NB; i++) {
            if (q4) {
                q4_step(w, n0 + i, s, &lo[i], &hi[i]);
            } else {
                lo[i] = q8_chunk(w, n0 + i, 32 * s);
                hi[i] = q8_chunk(w, n0 + i, 32 * s + 16);
            }
        }
        UNROLL for (int j = 0; j < R; j++) {
            const float *xr = x + (m0 + j) * K + 32 * s;
            const __m512 xl = _mm512_loadu_ps(xr), xh = _mm512_loadu_ps(xr + 16);
            UNROLL for (int i = 0; i < NB; i++) a[i][j] = _mm512_fmadd_ps(hi[i], xh, _mm512_fmadd_ps(lo[i], xl, a[i][j]));
        }
    }
    UNROLL for (int i = 0; i < NB; i++) UNROLL for (int j = 0; j < R; j++) {
        float *out = y + (m0 + j) * N + n0 + i;
        const float v = _mm512_reduce_add_ps(a[i][j]);
        *out = accumulate ? *out + v : v;
    }
}

#define T(R, NB) tile(w, q4, x, m0, R, n, NB, y, accumulate)
/* input rows m .. m_end against output rows n .. n + NB, in tiles of at most RM rows (the
   cases past RM are constant-false and compiled away) */
#define ROWS(NB, RM)                                                                               \
    for (int64_t m0 = m; m0 < m_end; m0 += RM) {                                                   \
        switch (m_end - m0 < RM ? m_end - m0 : RM) {                                               \
            case 1: T(1, NB); break;                                                               \
            case 2: if (RM >= 2) T(2, NB); break;                                                  \
            case 3: if (RM >= 3) T(3, NB); break;                                                  \
            case 4: if (RM >= 4) T(4, NB); break;                                                  \
            case 5: if (RM >= 5) T(5, NB); break;                                                  \
            case 6: if (RM >= 6) T(6, NB); break;                                                  \
            case 7: if (RM >= 7) T(7, NB); break;                                                  \
            default: if (RM >= 8) T(8, NB); break;                                                 \
        }                                                                                          \
    }

/* Rows in chunks of MC (a chunk of x stays in L2 while the weights stream past it); in a
   chunk, a tile shape by the row count: each loaded x vector meets NB weight rows, each
   decoded weight vector R input rows, in at most 26 registers. */
#define MC 64
static inline __attribute__((always_inline)) void span(const QW *w, const int q4, const float *x, int64_t M,
                                                       float *y, int accumulate, int64_t n_begin, int64_t n_end) {
    for (int64_t m = 0; m < M; m += MC) {
        const int64_t m_end = M - m < MC ? M : m + MC, rows = m_end - m;
        int64_t n = n_begin;
        if (rows == 1) {
            for (; n + 8 <= n_end; n += 8) ROWS(8, 1)
        } else if (rows == 2) {
            for (; n + 6 <= n_end; n += 6) ROWS(6, 2)
        } else if (rows <= 4) {
            for (; n + 4 <= n_end; n += 4) ROWS(4, 4)
        } else {
            for (; n + 2 <= n_end; n += 2) ROWS(2, 8)
        }
        for (; n < n_end; n++) ROWS(1, 8)
    }
}
#undef T
#undef ROWS

static void span_q4(const QW *w, const float *x, int64_t M, float *y, int accumulate, int64_t n0, int64_t n1) {
    span(w, 1, x, M, y, accumulate, n0, n1);
}

static void span_q8(const QW *w, const float *x, int64_t M, float *y, int accumulate, int64_t n0, int64_t n1) {
    span(w, 0, x, M, y, accumulate, n0, n1);
}
#else
static inline float weight(const QW *w, int64_t n, int64_t k) {
    const int64_t G = w->K / w->group, g = k / w->group;
    float q;
    if (w->method == QW_Q4) {
        const uint8_t b = ((const uint8_t *)w->data)[n * (w->K / 2) + 16 * (k / 32) + k % 16];
        q = (float)(k % 32 < 16 ? b & 15 : b >> 4);
    } else {
        q = (float)((const int8_t *)w->data)[n * w->K + k];
    }
    q = q * w->scale[n * G + g];
    return w->offset ? q + w->offset[n * G + g] : q;
}

static void span_plain(const QW *w, const float *x, int64_t M, float *y, int accumulate, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++)
        for (int64_t m = 0; m < M; m++) {
            float a = 0.f;
            for (int64_t k = 0; k < w->K; k++) a += weight(w, n, k) * x[m * w->K + k];
            y[m * w->N + n] = accumulate ? y[m * w->N + n] + a : a;
        }
}
#define span_q4 span_plain
#define span_q8 span_plain
#endif

void qmm_share(const QW *w, const float *x, int64_t M, float *y, int accumulate) {
    const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t units = (w->N + 23) / 24;  /* shares of whole tiles of 8, 6, 4 or 2 rows */
    const int64_t n0 = 24 * (units * t / threads), n1 = 24 * (units * (t + 1) / threads);
    const int64_t end = n1 < w->N ? n1 : w->N;
    if (n0 >= end) return;
    if (w->method == QW_Q4)
        span_q4(w, x, M, y, accumulate, n0, end);
    else
        span_q8(w, x, M, y, accumulate, n0, end);
}

/* y = x . W^T on `threads` threads (kernels/cpu_quant.py's entry) */
int qmm(int64_t method, const float *x, int64_t M, int64_t K, const void *data, const float *scale,
        const float *offset, int64_t group, int64_t N, float *y, int threads) {
    const QW w = {method, N, K, group, data, scale, offset};
#pragma omp parallel num_threads(threads)
    qmm_share(&w, x, M, y, 0);
    return 0;
}
