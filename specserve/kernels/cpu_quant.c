/* Quantized matrix products on the CPU: y[M, N] = x[M, K] . W^T, W a GGUF weight in the
   tile layout of cpu_quant.h (kernels/cpu_quant.py `pack`; built and called by
   kernels/cpu_quant.py, and by cpu_layers.c). x and y are float32; K is a multiple of 32.

   x is quantized first, row by row, to int16 with one scale a 32-column block (its absmax
   maps to 32767: about 2^-16 of the block's largest value, far below the weights' own
   rounding). Then for each weight group the integer dot product runs exactly (AVX-512
   VNNI's vpdpwssd, or vpmaddwd + vpaddd: 16 output rows a vector, two columns a lane), and
   the float sum takes it as

       acc = fma((float) isum, scale * x's block scale, acc);  acc = fma(offset, sum of x, acc)

   group after group in order. Every step is the same whatever M is, whichever tile or
   thread holds the row and whichever path computes it (the scalar loops below follow the
   same formulas), so a row's result does not depend on the other rows (a verify's rows
   equal decode's) nor on the thread count. */
#include <math.h>
#include <omp.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include "cpu_quant.h"

#define TINY 1e-30f /* a block scale below which 32767 / amax could overflow */

/* a float16's value (IEEE binary16 bits) */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0) {
        const float sub = ldexpf((float)man, -24);
        memcpy(&bits, &sub, sizeof bits);
        bits |= sign;
    } else {
        bits = sign | (exp == 31 ? 0x7f800000u : (exp + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* bytes of one tile's integers, of its scales (or offsets), of a chunk of nt tiles (cpu_quant.h) */
static inline int64_t tile_bytes(const QW *w) { return w->method == QW_Q4 ? TILE * 16 : TILE * w->group; }
static inline int64_t lane_bytes(const QW *w) { return TILE * (w->half ? 2 : 4); }
static inline int64_t chunk_bytes(const QW *w, int64_t nt) {
    return nt * (tile_bytes(w) + lane_bytes(w) * (w->has_offset ? 2 : 1));
}

/* super-tile s's chunk for group g, nt its tiles */
static inline const uint8_t *chunk(const QW *w, int64_t s, int64_t nt, int64_t g) {
    return w->data + s * (w->K / w->group) * chunk_bytes(w, SUPER) + g * chunk_bytes(w, nt);
}

/* lane values (scales, or offsets with which = 1) of tile tt in a chunk of nt tiles */
static inline const uint8_t *lanes_at(const QW *w, const uint8_t *c, int64_t nt, int64_t tt, int which) {
    return c + nt * tile_bytes(w) + (which * nt + tt) * lane_bytes(w);
}

/* lane i's value at p (lanes_at) */
static inline float lane_value(const QW *w, const uint8_t *p, int64_t i) {
    if (w->half) {
        uint16_t h;
        memcpy(&h, p + 2 * i, sizeof h);
        return half_to_float(h);
    }
    float f;
    memcpy(&f, p + 4 * i, sizeof f);
    return f;
}

/* the sum of x over group g's columns (group 16 or 32), from the 16-column sums */
static inline float group_sum(const float *s, int64_t group, int64_t g) {
    return group == 16 ? s[g] : s[2 * g] + s[2 * g + 1];
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

/* q = x * inv rounded to the nearest integer, ties to even (the default rounding mode, as lrintf) */
static inline void round_block(const float *v, float inv, int16_t *q) {
    const __m512 s = _mm512_set1_ps(inv);
    for (int i = 0; i < XBLOCK; i += 16)
        _mm256_storeu_si256((__m256i *)(q + i), _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(v + i), s))));
}
#else
static inline void round_block(const float *v, float inv, int16_t *q) {
    for (int i = 0; i < XBLOCK; i++) q[i] = (int16_t)lrintf(v[i] * inv);
}
#endif

void qx_rows(const float *x, int64_t begin, int64_t end, const QX *qx) {
    const int64_t K = qx->K;
    for (int64_t m = begin; m < end; m++) {
        const float *row = x + m * K;
        float *s = qx->s + m * (K / 16);
        for (int64_t c = 0; c < K / 16; c++) {
            float sum = 0.f;
            for (int i = 0; i < 16; i++) sum += row[16 * c + i];
            s[c] = sum;
        }
        for (int64_t b = 0; b < K / XBLOCK; b++) {
            const float *v = row + b * XBLOCK;
            float amax = 0.f;
            for (int i = 0; i < XBLOCK; i++) amax = fabsf(v[i]) > amax ? fabsf(v[i]) : amax;
            const int some = amax > TINY; /* else the block counts as zeros (its sums still count) */
            const float inv = some ? 32767.f / amax : 0.f;
            /* + 0 * the block's sums: NaN when x holds a NaN or an infinity, so the product is too */
            qx->d[m * (K / XBLOCK) + b] = (some ? amax / 32767.f : 0.f) + 0.f * (s[2 * b] + s[2 * b + 1]);
            round_block(v, inv, qx->q + m * K + b * XBLOCK);
        }
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define UNROLL _Pragma("GCC unroll 16")
#ifdef __AVX512VNNI__
#define DP(acc, a, b) _mm512_dpwssd_epi32(acc, a, b)
#else
#define DP(acc, a, b) _mm512_add_epi32(acc, _mm512_madd_epi16(a, b))
#endif

/* the TILE lane values at p (lanes_at) */
static inline __m512 lanes(const QW *w, const uint8_t *p) {
    return w->half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)) : _mm512_loadu_ps((const float *)p);
}

/* the int16 pair at p (columns c, c + 1) in every lane */
static inline __m512i pair(const int16_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm512_set1_epi32(v);
}

#define RM 4 /* rows a pass over a super-tile */
#define PREFETCH 4096 /* bytes: how far ahead of a chunk `tiles` fetches */

/* y rows m0 .. m0 + R against the NT = nt tiles of super-tile s; `fetch`: prefetch ahead */
static inline __attribute__((always_inline)) void tiles(const QW *w, const int q4, const QX *x, int64_t m0,
                                                        const int R, int64_t s, int64_t nt, const int NT, float *y,
                                                        int accumulate, const int fetch) {
    const int64_t K = w->K, group = w->group, G = K / group, N = w->N, tb = tile_bytes(w);
    const int64_t cb = chunk_bytes(w, nt);
    const __m512i low4 = _mm512_set1_epi16(0x000F);
    __m512 acc[4][RM];
    UNROLL for (int tt = 0; tt < NT; tt++) UNROLL for (int r = 0; r < R; r++) acc[tt][r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const int64_t c0 = g * group;
        const uint8_t *c = chunk(w, s, nt, g);
        if (fetch) /* the first pass over this chunk: its bytes PREFETCH ahead */
            for (int64_t b = 0; b < cb; b += 64) _mm_prefetch((const char *)c + PREFETCH + b, _MM_HINT_T1);
        __m512i is[4][RM];
        UNROLL for (int tt = 0; tt < NT; tt++) UNROLL for (int r = 0; r < R; r++) is[tt][r] = _mm512_setzero_si512();
        if (q4) {
            UNROLL for (int j = 0; j < 4; j++) {
                __m512i v[4];
                UNROLL for (int tt = 0; tt < NT; tt++) v[tt] = _mm512_loadu_si512(c + tt * tb + 64 * j);
                UNROLL for (int sh = 0; sh < 4; sh++) {
                    __m512i xb[RM];
                    UNROLL for (int r = 0; r < R; r++) xb[r] = pair(x->q + (m0 + r) * K + c0 + 8 * j + 2 * sh);
                    UNROLL for (int tt = 0; tt < NT; tt++) {
                        const __m512i wv = _mm512_and_si512(_mm512_srli_epi16(v[tt], 4 * sh), low4);
                        UNROLL for (int r = 0; r < R; r++) is[tt][r] = DP(is[tt][r], wv, xb[r]);
                    }
                }
            }
        } else {
            for (int64_t sp = 0; sp < group / 2; sp++) {
                __m512i xb[RM];
                UNROLL for (int r = 0; r < R; r++) xb[r] = pair(x->q + (m0 + r) * K + c0 + 2 * sp);
                UNROLL for (int tt = 0; tt < NT; tt++) {
                    const __m256i b = _mm256_loadu_si256((const __m256i *)(c + tt * tb + 32 * sp));
                    const __m512i wv = _mm512_cvtepi8_epi16(b);
                    UNROLL for (int r = 0; r < R; r++) is[tt][r] = DP(is[tt][r], wv, xb[r]);
                }
            }
        }
        UNROLL for (int tt = 0; tt < NT; tt++) {
            const __m512 scale = lanes(w, lanes_at(w, c, nt, tt, 0));
            UNROLL for (int r = 0; r < R; r++) {
                const __m512 ds = _mm512_mul_ps(scale, _mm512_set1_ps(x->d[(m0 + r) * (K / XBLOCK) + c0 / XBLOCK]));
                acc[tt][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[tt][r]), ds, acc[tt][r]);
            }
            if (w->has_offset) {
                const __m512 off = lanes(w, lanes_at(w, c, nt, tt, 1));
                UNROLL for (int r = 0; r < R; r++)
                    acc[tt][r] = _mm512_fmadd_ps(off, _mm512_set1_ps(group_sum(x->s + (m0 + r) * (K / 16), group, g)),
                                                 acc[tt][r]);
            }
        }
    }
    UNROLL for (int tt = 0; tt < NT; tt++) UNROLL for (int r = 0; r < R; r++) {
        float *out = y + (m0 + r) * N + (s * SUPER + tt) * TILE;
        _mm512_storeu_ps(out, accumulate ? _mm512_add_ps(_mm512_loadu_ps(out), acc[tt][r]) : acc[tt][r]);
    }
}

#define T(R, NT) tiles(w, q4, x, m0, R, s, nt, NT, y, accumulate, m0 == m)
/* input rows m .. m_end against the nt tiles of super-tile s, RM rows at a time */
#define ROWS(NT)                                                                                   \
    for (int64_t m0 = m; m0 < m_end; m0 += RM) {                                                   \
        switch (m_end - m0 < RM ? m_end - m0 : RM) {                                               \
            case 1: T(1, NT); break;                                                               \
            case 2: T(2, NT); break;                                                               \
            case 3: T(3, NT); break;                                                               \
            default: T(4, NT); break;                                                              \
        }                                                                                          \
    }

/* Rows in chunks of MC (a chunk of x stays in cache while the weights stream past it); in
   a chunk, each super-tile is read from memory once, all its tiles together for RM rows at
   a time, and again from the cache for the next RM rows (reading some of a super-tile's
   tiles from memory, then the rest, strided, ran a 3-row product at twice a 2-row one's
   time). The reads are prefetched PREFETCH bytes ahead into L2. */
#define MC 64
static inline __attribute__((always_inline)) void span(const QW *w, const int q4, const QX *x, int64_t M, float *y,
                                                       int accumulate, int64_t s_begin, int64_t s_end) {
    const int64_t tiles_all = w->N / TILE;
    for (int64_t m = 0; m < M; m += MC) {
        const int64_t m_end = M - m < MC ? M : m + MC;
        for (int64_t s = s_begin; s < s_end; s++) {
            const int64_t nt = tiles_all - s * SUPER < SUPER ? tiles_all - s * SUPER : SUPER;
            switch (nt) {
                case 4: ROWS(4) break;
                case 3: ROWS(3) break;
                case 2: ROWS(2) break;
                default: ROWS(1) break;
            }
        }
    }
}
#undef T
#undef ROWS

static void span_q4(const QW *w, const QX *x, int64_t M, float *y, int accumulate, int64_t s0, int64_t s1) {
    span(w, 1, x, M, y, accumulate, s0, s1);
}

static void span_q8(const QW *w, const QX *x, int64_t M, float *y, int accumulate, int64_t s0, int64_t s1) {
    span(w, 0, x, M, y, accumulate, s0, s1);
}
#else
/* weight (n, k)'s integer, read from the layout (cpu_quant.h) */
static inline int32_t weight_q(const QW *w, const uint8_t *c, int64_t tt, int64_t i, int64_t col) {
    const uint8_t *t = c + tt * tile_bytes(w);
    if (w->method == QW_Q4) {
        const int64_t j = col / 8, p = (col % 8) / 2, hi = col % 2;
        uint32_t word;
        memcpy(&word, t + 64 * j + 4 * i, sizeof word);
        return (int32_t)((word >> (16 * hi + 4 * p)) & 15u);
    }
    return ((const int8_t *)t)[32 * (col / 2) + 2 * i + col % 2];
}

static void span_plain(const QW *w, const QX *x, int64_t M, float *y, int accumulate, int64_t s0, int64_t s1) {
    const int64_t K = w->K, group = w->group, G = K / group, tiles_all = w->N / TILE;
    for (int64_t s = s0; s < s1; s++) {
        const int64_t nt = tiles_all - s * SUPER < SUPER ? tiles_all - s * SUPER : SUPER;
        for (int64_t tt = 0; tt < nt; tt++)
            for (int64_t i = 0; i < TILE; i++)
                for (int64_t m = 0; m < M; m++) {
                    float acc = 0.f;
                    for (int64_t g = 0; g < G; g++) {
                        const uint8_t *c = chunk(w, s, nt, g);
                        int32_t isum = 0;
                        for (int64_t col = 0; col < group; col++)
                            isum += weight_q(w, c, tt, i, col) * x->q[m * K + g * group + col];
                        const float ds = lane_value(w, lanes_at(w, c, nt, tt, 0), i) * x->d[m * (K / XBLOCK) + g * group / XBLOCK];
                        acc = fmaf((float)isum, ds, acc);
                        if (w->has_offset)
                            acc = fmaf(lane_value(w, lanes_at(w, c, nt, tt, 1), i), group_sum(x->s + m * (K / 16), group, g),
                                       acc);
                    }
                    float *out = y + m * w->N + (s * SUPER + tt) * TILE + i;
                    *out = accumulate ? *out + acc : acc;
                }
    }
}
#define span_q4 span_plain
#define span_q8 span_plain
#endif

#define TEAM_SPINS 1000 /* spins before a waiter yields its core */

void team_wait(TeamBarrier *b, int *phase) {
    const int n = omp_get_num_threads(), next = *phase + 1;
    *phase = next;
    if (n == 1) return;
    if (atomic_fetch_add_explicit(&b->arrived, 1, memory_order_acq_rel) == n - 1) {
        atomic_store_explicit(&b->arrived, 0, memory_order_relaxed); /* published by the release below */
        atomic_store_explicit(&b->phase, next, memory_order_release);
        return;
    }
    for (int spins = 0; atomic_load_explicit(&b->phase, memory_order_acquire) != next; spins++) {
        if (spins >= TEAM_SPINS)
            sched_yield();
#if defined(__x86_64__) || defined(__i386__)
        else
            __builtin_ia32_pause();
#endif
    }
}

void qmm_share(const QW *w, const QX *x, int64_t M, float *y, int accumulate) {
    const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t supers = (w->N / TILE + SUPER - 1) / SUPER;
    const int64_t s0 = supers * t / threads, s1 = supers * (t + 1) / threads;
    if (s0 >= s1) return;
    if (w->method == QW_Q4)
        span_q4(w, x, M, y, accumulate, s0, s1);
    else
        span_q8(w, x, M, y, accumulate, s0, s1);
}

/* y = x . W^T on `threads` threads (kernels/cpu_quant.py's entry); qx: room for x's
   quantized rows (cpu_quant.h) */
int qmm(int64_t method, const float *x, int64_t M, int64_t K, const uint8_t *data, int64_t group, int64_t half,
        int64_t has_offset, int64_t N, float *y, int threads, int16_t *xq, float *xd, float *xs) {
    const QW w = {method, N, K, group, half, has_offset, data};
    const QX qx = {xq, xd, xs, K};
    TeamBarrier bar = {0, 0};
#pragma omp parallel num_threads(threads)
    {
        const int64_t n = omp_get_num_threads(), t = omp_get_thread_num();
        int phase = 0;
        qx_rows(x, M * t / n, M * (t + 1) / n, &qx);
        team_wait(&bar, &phase);
        qmm_share(&w, &qx, M, y, 0);
    }
    return 0;
}
