/* Quantized matrix products on the CPU: y[M, N] = x[M, K] . W^T, W held as GGUF blocks
   repacked at load (specserve/core/quant.py, methods "q4" and "q8"; built and called by
   kernels/cpu_quant.py). x and y are float32 and contiguous.

   q4: w uint8 [N, K / 32 * 16]: each 32 columns take 16 bytes, byte j holding column j in
       its low nibble and column j + 16 in its high one (GGUF's Q4_0/Q4_1/Q4_K order);
       group 32.
   q8: w int8 [N, K]; group 16 or 32.
   Both: W[n, k] = q * scale[n, g] + offset[n, g], g = k / group, scale and offset float32
   [N, K / group]; offset may be NULL (none).

   A weight is dequantized to float32 (q * scale), then multiplied and summed in float32;
   the offsets' term is offset . (the group sums of x). Each step of the loop takes NB
   output rows and R <= 4 input rows: a weight group is decoded once and used against all
   R rows. The AVX-512 path is compiled where the machine has it (-march=native), plain
   loops (left to the compiler's vectoriser) elsewhere. */
#include <stdint.h>
#include <stdlib.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define NB 2
#define RMAX 4

/* sums[m, g] = the sum of x[m, g * group .. + group) */
static void group_sums(const float *x, int64_t M, int64_t K, int64_t group, float *sums) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < K / group; g++) {
            float t = 0.f;
            for (int64_t c = 0; c < group; c++) t += x[m * K + g * group + c];
            sums[m * (K / group) + g] = t;
        }
}

#ifdef __AVX512F__
static inline __attribute__((always_inline)) void q4_tile(const float *x, int64_t K, const uint8_t *w,
        const float *scale, const int64_t *rows, __m512 acc[NB][RMAX], int64_t m0, const int R) {
    const int64_t G = K / 32, half = K / 2;
    const __m128i low = _mm_set1_epi8(0x0f);
    __m512 acc2[NB][RMAX];
    for (int i = 0; i < NB; i++)
        for (int j = 0; j < R; j++) acc[i][j] = acc2[i][j] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m512 lo[NB], hi[NB];
        for (int i = 0; i < NB; i++) {
            __m128i b = _mm_loadu_si128((const __m128i *)(w + rows[i] * half + 16 * g));
            __m512 s = _mm512_set1_ps(scale[rows[i] * G + g]);
            lo[i] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, low))), s);
            hi[i] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), low))), s);
        }
        for (int j = 0; j < R; j++) {
            const float *xr = x + (m0 + j) * K + 32 * g;
            __m512 xl = _mm512_loadu_ps(xr), xh = _mm512_loadu_ps(xr + 16);
            for (int i = 0; i < NB; i++) {
                acc[i][j] = _mm512_fmadd_ps(lo[i], xl, acc[i][j]);
                acc2[i][j] = _mm512_fmadd_ps(hi[i], xh, acc2[i][j]);
            }
        }
    }
    for (int i = 0; i < NB; i++)
        for (int j = 0; j < R; j++) acc[i][j] = _mm512_add_ps(acc[i][j], acc2[i][j]);
}

static inline __attribute__((always_inline)) void q8_tile(const float *x, int64_t K, const int8_t *w,
        const float *scale, int64_t group, const int64_t *rows, __m512 acc[NB][RMAX], int64_t m0,
        const int R) {
    const int64_t G = K / group;
    for (int i = 0; i < NB; i++)
        for (int j = 0; j < R; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m512 s[NB];
        for (int i = 0; i < NB; i++) s[i] = _mm512_set1_ps(scale[rows[i] * G + g]);
        for (int64_t c = g * group; c < (g + 1) * group; c += 16) {
            __m512 q[NB];
            for (int i = 0; i < NB; i++)
                q[i] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                           _mm_loadu_si128((const __m128i *)(w + rows[i] * K + c)))), s[i]);
            for (int j = 0; j < R; j++) {
                __m512 xv = _mm512_loadu_ps(x + (m0 + j) * K + c);
                for (int i = 0; i < NB; i++) acc[i][j] = _mm512_fmadd_ps(q[i], xv, acc[i][j]);
            }
        }
    }
}

/* acc[i][j] += offset[row i, :] * sums[m0 + j, :], lane by lane (summed with the rest by STORE) */
static inline __attribute__((always_inline)) void add_offsets(__m512 acc[NB][RMAX], const float *offset,
        const float *sums, const int64_t *rows, int64_t m0, int64_t G, const int R) {
    for (int64_t g = 0; g < G; g += 16) {
        const __mmask16 mask = G - g >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (G - g)) - 1);
        for (int i = 0; i < NB; i++) {
            __m512 o = _mm512_maskz_loadu_ps(mask, offset + rows[i] * G + g);
            for (int j = 0; j < R; j++)
                acc[i][j] = _mm512_fmadd_ps(o, _mm512_maskz_loadu_ps(mask, sums + (m0 + j) * G + g), acc[i][j]);
        }
    }
}

#define STORE(R)                                                                                   \
    if (offset) add_offsets(acc, offset, sums, rows, m0, G, R);                                    \
    for (int i = 0; i < nb; i++)                                                                   \
        for (int j = 0; j < (R); j++) y[(m0 + j) * N + rows[i]] = _mm512_reduce_add_ps(acc[i][j]);
#define TILES(CALL)                                                                                \
    int64_t m0 = 0;                                                                                \
    for (; m0 + RMAX <= M; m0 += RMAX) { CALL(RMAX); STORE(RMAX) }                                 \
    switch (M - m0) {                                                                              \
        case 3: CALL(3); STORE(3) break;                                                           \
        case 2: CALL(2); STORE(2) break;                                                           \
        case 1: CALL(1); STORE(1) break;                                                           \
    }
#define Q4(R) q4_tile(x, K, w, scale, rows, acc, m0, R)
#define Q8(R) q8_tile(x, K, w, scale, group, rows, acc, m0, R)
#define ACC __m512 acc[NB][RMAX];
#else
/* offset[n, :] . sums[m, :] */
static inline float offset_term(const float *offset, const float *sums, int64_t n, int64_t m, int64_t G) {
    float t = 0.f;
    for (int64_t g = 0; g < G; g++) t += offset[n * G + g] * sums[m * G + g];
    return t;
}

/* plain loops: one output row by one input row */
static inline float q4_dot(const float *xr, const uint8_t *wn, const float *sn, int64_t K) {
    float acc = 0.f;
    for (int64_t g = 0; g < K / 32; g++)
        for (int t = 0; t < 16; t++)
            acc += (float)(wn[16 * g + t] & 15) * sn[g] * xr[32 * g + t]
                 + (float)(wn[16 * g + t] >> 4) * sn[g] * xr[32 * g + 16 + t];
    return acc;
}

static inline float q8_dot(const float *xr, const int8_t *wn, const float *sn, int64_t K, int64_t group) {
    float acc = 0.f;
    for (int64_t c = 0; c < K; c++) acc += (float)wn[c] * sn[c / group] * xr[c];
    return acc;
}

#define TILES(CALL)                                                                                \
    for (int i = 0; i < nb; i++)                                                                   \
        for (int64_t m = 0; m < M; m++)                                                            \
            y[m * N + rows[i]] = CALL(m, rows[i]) + (offset ? offset_term(offset, sums, rows[i], m, G) : 0.f);
#define Q4(m, n) q4_dot(x + (m) * K, w + (n) * (K / 2), scale + (n) * G, K)
#define Q8(m, n) q8_dot(x + (m) * K, w + (n) * K, scale + (n) * G, K, group)
#define ACC
#endif

#define MATMUL(Q, GROUP)                                                                           \
    const int64_t group = (GROUP), G = K / group;                                                 \
    float *sums = NULL;                                                                            \
    if (offset) {                                                                                  \
        sums = malloc(sizeof(float) * M * G);                                                      \
        if (!sums) return -1;                                                                      \
        group_sums(x, M, K, group, sums);                                                          \
    }                                                                                              \
    _Pragma("omp parallel for num_threads(threads) schedule(static)")                              \
    for (int64_t n0 = 0; n0 < N; n0 += NB) {                                                       \
        const int nb = N - n0 < NB ? (int)(N - n0) : NB;                                           \
        const int64_t rows[NB] = {n0, nb > 1 ? n0 + 1 : n0};                                       \
        ACC                                                                                        \
        TILES(Q)                                                                                   \
    }                                                                                              \
    free(sums);                                                                                    \
    return 0;

int q4_matmul(const float *x, int64_t M, int64_t K, const uint8_t *w, const float *scale, const float *offset,
              int64_t N, float *y, int threads) {
    MATMUL(Q4, 32)
}

int q8_matmul(const float *x, int64_t M, int64_t K, const int8_t *w, const float *scale, const float *offset,
              int64_t group_size, int64_t N, float *y, int threads) {
    MATMUL(Q8, group_size)
}
