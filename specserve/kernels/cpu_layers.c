/* A Llama-family decoder stack on the CPU in one call (built with cpu_quant.c; driven by
   kernels/cpu_layers.py): for each layer, RMSNorm, the fused q/k/v product (+ bias),
   RoPE, the new keys and values written into the layer's KV cache, attention over each
   query row's visible keys, o_proj added to the stream, RMSNorm, gate/up, SiLU * up and
   down_proj added to the stream. Every product reads GGUF blocks (cpu_quant.h) and takes
   its x rounded to int16 by the step before it (a norm, attention, SiLU * up).

   The stream [T, hidden] is updated in place. One OpenMP parallel region runs the whole
   stack: products split their output columns over the threads, norms split rows, RoPE
   (row, head) pairs, attention (row, KV head, pass over its heads, half of the row's keys)
   items; a barrier (cpu_quant.h's `team_wait`) separates the steps. Each row is computed
   the same way whatever the other rows are (the products' sums run one order; attention
   visits its keys in kv_index order, in two halves merged in one order where the row sees
   SPLIT_MIN keys or more: a split by the count of keys it sees, which a verify's row and
   decode's share), so a verify's rows equal decode's.

   A layer with norm0 is EAGLE-3's draft layer (models/eagle3.py): its q/k/v product reads
   the tokens' embeddings normed by norm0 beside the stream normed by norm1, and the stream
   (the draft's hidden) is the residual.

   Attention follows attention/torch_ref.py's metadata: request b's query i is packed row
   q_index[b, i] (if q_valid), its keys are the slots kv_index[b, j] for j < max_kv where
   mask[b, i, j] (no mask: all of them). Scores, softmax and the weighted sum run in float32;
   exp is a polynomial (Cephes' expf, within 2 ulp) on AVX-512, libm's elsewhere. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "cpu_exp.h"
#include "cpu_quant.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define SUB 4 /* query heads sharing a KV head that one pass over its keys serves (attend) */
#define AHEAD 16 /* keys: how far ahead attend_heads prefetches cache rows */
#define SPLIT_MIN 128 /* visible keys from which a query row's keys go in two halves (attend) */

typedef struct {
    QW qkv, o, gate_up, down;
    const float *norm1, *norm2, *qkv_bias; /* qkv_bias NULL: none */
    float *k_cache, *v_cache;              /* [slots, kv_heads, head_dim] */
    const float *norm0; /* NULL, or EAGLE-3's midlayer: q/k/v read [norm0(embed), norm1(stream)] */
} Layer;

typedef struct {
    int64_t T, hidden, heads, kv_heads, head_dim, inter;
    float eps, scale;
    const float *rope;         /* [max_positions, 2 head_dim]: cos, then signed sin */
    const int64_t *positions;  /* [T] */
    const int64_t *out_slots;  /* [T]: where each row's key and value go */
    int64_t B, max_new, max_kv;
    const int64_t *kv_index;   /* [B, max_kv] */
    const int64_t *q_index;    /* [B, max_new] */
    const uint8_t *q_valid;    /* [B * max_new] */
    const uint8_t *mask;       /* [B, max_new, max_kv], or NULL */
    const float *embed;        /* [T, hidden]: the tokens' embeddings, for a layer with norm0 */
    float *xn, *qkv, *attn, *gate_up, *act, *scores; /* scratch; xn [T, 2 hidden], scores [threads, (SUB + 2) max_kv],
                                                        then the halves' partial sums [T, heads, 2, head_dim + 2] */
    int16_t *xq;               /* [T, max(hidden, heads * head_dim, inter)]: a product's x rounded */
    float *xd, *xs;            /* its scales [T, that / 32] and sums [T, that / 16] (cpu_quant.h) */
} Batch;

/* rows [begin, end) of T split evenly over the team */
static void my_rows(int64_t T, int64_t *begin, int64_t *end) {
    const int64_t n = omp_get_num_threads(), t = omp_get_thread_num();
    *begin = T * t / n;
    *end = T * (t + 1) / n;
}

#ifdef __AVX512F__
static inline float dot(const float *a, const float *b, int64_t n) {
    __m512 s = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) s = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s);
    return _mm512_reduce_add_ps(s);
}

static inline void axpy(float *y, float a, const float *x, int64_t n) {
    const __m512 av = _mm512_set1_ps(a);
    for (int64_t i = 0; i < n; i += 16)
        _mm512_storeu_ps(y + i, _mm512_fmadd_ps(av, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
}

/* p[j] = exp(p[j] - max) for j < n; returns their sum (lanes summed in order, then reduced) */
static inline float exp_shift(float *p, int64_t n, float max) {
    __m512 s = _mm512_setzero_ps();
    const __m512 m = _mm512_set1_ps(max);
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(p + j), m));
        _mm512_storeu_ps(p + j, e);
        s = _mm512_add_ps(s, e);
    }
    if (j < n) {
        const __mmask16 k = (__mmask16)((1u << (n - j)) - 1);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, p + j), m));
        _mm512_mask_storeu_ps(p + j, k, e);
        s = _mm512_add_ps(s, _mm512_maskz_mov_ps(k, e));
    }
    return _mm512_reduce_add_ps(s);
}

/* x[i] * up[i] / (1 + exp(-x[i])) into out, n a multiple of 16 */
static inline void silu_mul(const float *x, const float *up, float *out, int64_t n) {
    const __m512 one = _mm512_set1_ps(1.f);
    for (int64_t i = 0; i < n; i += 16) {
        const __m512 g = _mm512_loadu_ps(x + i);
        const __m512 s = _mm512_div_ps(g, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        _mm512_storeu_ps(out + i, _mm512_mul_ps(s, _mm512_loadu_ps(up + i)));
    }
}
#define VEC_OK(n) ((n) % 16 == 0)
#else
#define VEC_OK(n) 0
static inline float dot(const float *a, const float *b, int64_t n) { (void)a; (void)b; (void)n; return 0.f; }
static inline void axpy(float *y, float a, const float *x, int64_t n) { (void)y; (void)a; (void)x; (void)n; }
static inline float exp_shift(float *p, int64_t n, float max) { (void)p; (void)n; (void)max; return 0.f; }
static inline void silu_mul(const float *x, const float *up, float *out, int64_t n) {
    (void)x; (void)up; (void)out; (void)n;
}
#endif

static float dot_any(const float *a, const float *b, int64_t n) {
    if (VEC_OK(n)) return dot(a, b, n);
    float s = 0.f;
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* the products' view of rows of K columns: b's shared buffers */
static QX qx_of(const Batch *b, int64_t K) {
    const QX qx = {b->xq, b->xd, b->xs, K};
    return qx;
}

/* x [T, K] rounded for a product (cpu_quant.h), this thread's rows */
static void round_rows(const float *x, int64_t K, const Batch *b) {
    int64_t r0, r1;
    my_rows(b->T, &r0, &r1);
    const QX qx = qx_of(b, K);
    qx_rows(x, r0, r1, &qx);
}

/* out [H] = x / rms(x) * weight */
static void rms_row(const float *x, const float *weight, float *out, int64_t H, float eps) {
    const float inv = 1.f / sqrtf(dot_any(x, x, H) / (float)H + eps);
    for (int64_t i = 0; i < H; i++) out[i] = x[i] * inv * weight[i];
}

/* xn[t] = stream[t] / rms(stream[t]) * weight, for this thread's rows, rounded for a product */
static void rms_rows(const float *stream, const float *weight, float *xn, const Batch *b) {
    int64_t r0, r1;
    my_rows(b->T, &r0, &r1);
    const int64_t H = b->hidden;
    for (int64_t t = r0; t < r1; t++) rms_row(stream + t * H, weight, xn + t * H, H, b->eps);
    round_rows(xn, H, b);
}

/* xn[t] = [embed[t] normed by w0, stream[t] normed by w1] (2 hidden wide), this thread's
   rows, rounded for a product */
static void rms_pair_rows(const float *stream, const float *w0, const float *w1, float *xn, const Batch *b) {
    int64_t r0, r1;
    my_rows(b->T, &r0, &r1);
    const int64_t H = b->hidden;
    for (int64_t t = r0; t < r1; t++) {
        rms_row(b->embed + t * H, w0, xn + t * 2 * H, H, b->eps);
        rms_row(stream + t * H, w1, xn + t * 2 * H + H, H, b->eps);
    }
    round_rows(xn, 2 * H, b);
}

/* x [D] rotated in place by the table row of `pos`: x * cos + roll(x, D / 2) * signed sin
   (two products and a sum, each rounded: the vector form computes the same) */
static void rotate(float *x, const float *table, int64_t pos, int64_t D) {
    const float *cs = table + pos * 2 * D, *sn = cs + D;
#ifdef __AVX512F__
    if (D % 32 == 0) { /* D / 2 whole vectors: the roll moves whole vectors */
        __m512 v[512 / 16];
        const int64_t C = D / 16;
        for (int64_t c = 0; c < C; c++) v[c] = _mm512_loadu_ps(x + 16 * c);
        for (int64_t c = 0; c < C; c++)
            _mm512_storeu_ps(x + 16 * c, _mm512_add_ps(_mm512_mul_ps(v[c], _mm512_loadu_ps(cs + 16 * c)),
                                                       _mm512_mul_ps(v[(c + C / 2) % C], _mm512_loadu_ps(sn + 16 * c))));
        return;
    }
#endif
    float tmp[512];
    memcpy(tmp, x, sizeof(float) * D);
    for (int64_t d = 0; d < D; d++) x[d] = tmp[d] * cs[d] + tmp[(d + D / 2) % D] * sn[d];
}

/* bias, RoPE on queries and keys, new keys and values into the cache: (row, head) pairs
   split over the team */
static void rope_store(const Layer *L, const Batch *b) {
    const int64_t D = b->head_dim, H = b->heads, KV = b->kv_heads, per = H + 2 * KV;
#pragma omp for schedule(static) nowait
    for (int64_t it = 0; it < b->T * per; it++) {
        const int64_t t = it / per, h = it % per;
        float *x = b->qkv + it * D;
        if (L->qkv_bias)
            for (int64_t i = 0; i < D; i++) x[i] += L->qkv_bias[h * D + i];
        if (h < H + KV) rotate(x, b->rope, b->positions[t], D);
        if (h >= H + KV)
            memcpy(L->v_cache + (b->out_slots[t] * KV + h - H - KV) * D, x, sizeof(float) * D);
        else if (h >= H)
            memcpy(L->k_cache + (b->out_slots[t] * KV + h - H) * D, x, sizeof(float) * D);
    }
}

/* one query row and head over its visible keys, into out [D] */
static void attend_one(const Layer *L, const Batch *b, int64_t bi, int64_t i, const float *q, int64_t kvh,
                       float *out, float *p) {
    const int64_t D = b->head_dim, KV = b->kv_heads;
    const int64_t *slots = b->kv_index + bi * b->max_kv;
    const uint8_t *visible = b->mask ? b->mask + (bi * b->max_new + i) * b->max_kv : NULL;
    int64_t n = 0;
    float max = -INFINITY;
    for (int64_t j = 0; j < b->max_kv; j++) {
        if (visible && !visible[j]) continue;
        const float s = dot_any(q, L->k_cache + (slots[j] * KV + kvh) * D, D) * b->scale;
        p[n++] = s;
        max = s > max ? s : max;
    }
    float sum = 0.f;
    if (VEC_OK(D)) {
        sum = exp_shift(p, n, max);
    } else {
        for (int64_t j = 0; j < n; j++) sum += (p[j] = expf(p[j] - max));
    }
    memset(out, 0, sizeof(float) * D);
    int64_t k = 0;
    for (int64_t j = 0; j < b->max_kv; j++) {
        if (visible && !visible[j]) continue;
        const float *v = L->v_cache + (slots[j] * KV + kvh) * D;
        if (VEC_OK(D)) {
            axpy(out, p[k++], v, D);
        } else {
            for (int64_t d = 0; d < D; d++) out[d] += p[k] * v[d];
            k++;
        }
    }
    for (int64_t d = 0; d < D; d++) out[d] /= sum;
}

#ifdef __AVX512F__
/* Query heads h0 .. h0 + G of packed row r (request bi's query i), which share KV head kvh,
   each computed as attend_one computes it (its dot, exp_shift, axpy and division, in the
   same order: the same bits), with each key and value row read once for all G, over the
   row's visible keys o0 .. o1 - 1 (counted in kv_index order). With `part` (a half of the
   keys, attend), each head's unnormalised sums, max and sum go to part + g * 2 (D + 2)
   instead of the output. D is a multiple of 64; scratch holds SUB * max_kv scores, then
   max_kv int64 cache rows. */
static inline __attribute__((always_inline)) void attend_heads(const Layer *L, const Batch *b, int64_t bi, int64_t i,
                                                               int64_t r, int64_t h0, const int G, float *scratch,
                                                               int64_t o0, int64_t o1, float *part) {
    const int64_t D = b->head_dim, KV = b->kv_heads, H = b->heads, M = b->max_kv, kvh = h0 / (H / KV);
    const int64_t *slots = b->kv_index + bi * M;
    const uint8_t *visible = b->mask ? b->mask + (bi * b->max_new + i) * M : NULL;
    int64_t *rows = (int64_t *)(scratch + SUB * M);
    const float *q = b->qkv + r * (H + 2 * KV) * D + h0 * D;
    float mx[SUB], sum[SUB];
    for (int g = 0; g < G; g++) mx[g] = -INFINITY;
    int64_t n = 0, o = visible ? 0 : o0;
    for (int64_t j = o; j < M; j++) {
        if (visible && !visible[j]) continue;
        const int64_t ord = o++; /* the key's place among the row's visible keys */
        if (ord < o0) continue;
        if (ord >= o1) break;
        const int64_t row = slots[j] * KV + kvh;
        const float *k = L->k_cache + row * D;
        if (j + AHEAD < M) /* the cache's rows come from memory: ask for a later key's early */
            for (int64_t d = 0; d < D; d += 16) _mm_prefetch((const char *)(L->k_cache + (slots[j + AHEAD] * KV + kvh) * D + d), _MM_HINT_T0);
        __m512 s[SUB];
        for (int g = 0; g < G; g++) s[g] = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d += 16) {
            const __m512 kv = _mm512_loadu_ps(k + d);
            for (int g = 0; g < G; g++) s[g] = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * D + d), kv, s[g]);
        }
        for (int g = 0; g < G; g++) {
            const float v = _mm512_reduce_add_ps(s[g]) * b->scale;
            scratch[g * M + n] = v;
            mx[g] = v > mx[g] ? v : mx[g];
        }
        rows[n++] = row;
    }
    for (int g = 0; g < G; g++) sum[g] = exp_shift(scratch + g * M, n, mx[g]);
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
        __m512 acc[SUB][4];
        for (int g = 0; g < G; g++)
            for (int c = 0; c < 4; c++) acc[g][c] = _mm512_setzero_ps();
        for (int64_t k = 0; k < n; k++) {
            const float *v = L->v_cache + rows[k] * D + d0;
            if (k + AHEAD < n)
                for (int c = 0; c < 4; c++) _mm_prefetch((const char *)(L->v_cache + rows[k + AHEAD] * D + d0 + 16 * c), _MM_HINT_T0);
            for (int c = 0; c < 4; c++) {
                const __m512 vv = _mm512_loadu_ps(v + 16 * c);
                for (int g = 0; g < G; g++) acc[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(scratch[g * M + k]), vv, acc[g][c]);
            }
        }
        if (part) { /* a half: its unnormalised sums, merged by merge_halves */
            for (int g = 0; g < G; g++)
                for (int c = 0; c < 4; c++) _mm512_storeu_ps(part + g * 2 * (D + 2) + d0 + 16 * c, acc[g][c]);
        } else {
            float *out = b->attn + r * H * D + h0 * D + d0;
            for (int g = 0; g < G; g++)
                for (int c = 0; c < 4; c++)
                    _mm512_storeu_ps(out + g * D + 16 * c, _mm512_div_ps(acc[g][c], _mm512_set1_ps(sum[g])));
        }
    }
    if (part)
        for (int g = 0; g < G; g++) {
            part[g * 2 * (D + 2) + D] = mx[g];
            part[g * 2 * (D + 2) + D + 1] = sum[g];
        }
}
#endif

/* how many keys request bi's query i sees */
static int64_t visible_keys(const Batch *b, int64_t bi, int64_t i) {
    if (!b->mask) return b->max_kv;
    const uint8_t *visible = b->mask + (bi * b->max_new + i) * b->max_kv;
    int64_t n = 0;
    for (int64_t j = 0; j < b->max_kv; j++) n += visible[j] != 0;
    return n;
}

/* the halves' partial sums: [T, heads, 2, head_dim + 2], after the threads' scores */
static float *halves(const Batch *b) {
    return b->scores + omp_get_num_threads() * (SUB + 2) * b->max_kv;
}

/* Every query row and head over its visible keys. Where the vectors serve, the heads that
   share a KV head go in passes of up to SUB (fewer only where there would be fewer passes
   than threads), a KV head's passes for every query one after another, so that its cache
   rows, read from memory by the first, are in cache for the rest; a row that sees
   SPLIT_MIN keys or more takes them in two halves by their place among its visible keys
   (a split that depends on that count alone, so a verify's row splits as decode's does),
   two items the threads share, merged by merge_halves. Else head by head (attend_one). */
static void attend(const Layer *L, const Batch *b) {
    const int64_t D = b->head_dim, H = b->heads, W = (H + 2 * b->kv_heads) * D, group = H / b->kv_heads;
    const int64_t queries = b->B * b->max_new, threads = omp_get_num_threads();
    float *scratch = b->scores + omp_get_thread_num() * (SUB + 2) * b->max_kv;
#ifdef __AVX512F__
    if (D % 64 == 0) {
        int64_t sub = group < SUB ? group : SUB;
        while (sub > 1 && queries * b->kv_heads * ((group + sub - 1) / sub) < threads) sub = (sub + 1) / 2;
        const int64_t passes = (group + sub - 1) / sub, items = queries * b->kv_heads * passes * 2;
        float *part = halves(b);
#pragma omp for schedule(static) nowait
        for (int64_t it = 0; it < items; it++) {
            const int64_t bq = it % queries, half = it / queries % 2, rest = it / queries / 2;
            if (!b->q_valid[bq]) continue;
            const int64_t h0 = rest / passes * group + rest % passes * sub, r = b->q_index[bq];
            const int64_t left = (rest / passes + 1) * group - h0, G = left < sub ? left : sub;
            const int64_t bi = bq / b->max_new, i = bq % b->max_new, n = visible_keys(b, bi, i);
            if (n < SPLIT_MIN && half) continue;
            const int64_t o0 = n < SPLIT_MIN ? 0 : half * (n / 2), o1 = n < SPLIT_MIN || half ? n : n / 2;
            float *p = n < SPLIT_MIN ? NULL : part + ((r * H + h0) * 2 + half) * (D + 2);
            switch (G) {
                case 1: attend_heads(L, b, bi, i, r, h0, 1, scratch, o0, o1, p); break;
                case 2: attend_heads(L, b, bi, i, r, h0, 2, scratch, o0, o1, p); break;
                case 3: attend_heads(L, b, bi, i, r, h0, 3, scratch, o0, o1, p); break;
                default: attend_heads(L, b, bi, i, r, h0, 4, scratch, o0, o1, p); break;
            }
        }
        return;
    }
#endif
    const int64_t items = queries * H;
#pragma omp for schedule(static) nowait
    for (int64_t it = 0; it < items; it++) {
        const int64_t h = it % H, bq = it / H, bi = bq / b->max_new, i = bq % b->max_new;
        if (!b->q_valid[bq]) continue;
        const int64_t r = b->q_index[bq];
        attend_one(L, b, bi, i, b->qkv + r * W + h * D, h / group, b->attn + r * H * D + h * D, scratch);
    }
}

/* The rows attend took in two halves: each head's output from its halves' sums,
   (acc0 e^(m0 - m) + acc1 e^(m1 - m)) / (s0 e^(m0 - m) + s1 e^(m1 - m)), m the larger max */
static void merge_halves(const Batch *b) {
#ifdef __AVX512F__
    const int64_t D = b->head_dim, H = b->heads, queries = b->B * b->max_new;
    if (D % 64) return;
    const float *part = halves(b);
#pragma omp for schedule(static) nowait
    for (int64_t bq = 0; bq < queries; bq++) {
        if (!b->q_valid[bq] || visible_keys(b, bq / b->max_new, bq % b->max_new) < SPLIT_MIN) continue;
        const int64_t r = b->q_index[bq];
        for (int64_t h = 0; h < H; h++) {
            const float *p0 = part + (r * H + h) * 2 * (D + 2), *p1 = p0 + D + 2;
            const float m = p0[D] > p1[D] ? p0[D] : p1[D];
            const float a0 = expf(p0[D] - m), a1 = expf(p1[D] - m);
            const __m512 w0 = _mm512_set1_ps(a0), w1 = _mm512_set1_ps(a1);
            const __m512 total = _mm512_set1_ps(p0[D + 1] * a0 + p1[D + 1] * a1);
            float *out = b->attn + r * H * D + h * D;
            for (int64_t d = 0; d < D; d += 16) {
                const __m512 v = _mm512_fmadd_ps(_mm512_loadu_ps(p0 + d), w0, _mm512_mul_ps(_mm512_loadu_ps(p1 + d), w1));
                _mm512_storeu_ps(out + d, _mm512_div_ps(v, total));
            }
        }
    }
#else
    (void)b;
#endif
}

/* SiLU(gate) * up, this thread's rows, rounded for down_proj */
static void act_rows(const Batch *b) {
    int64_t r0, r1;
    my_rows(b->T, &r0, &r1);
    const int64_t I = b->inter;
    for (int64_t t = r0; t < r1; t++) {
        const float *g = b->gate_up + t * 2 * I, *u = g + I;
        float *out = b->act + t * I;
        if (VEC_OK(I)) {
            silu_mul(g, u, out, I);
        } else {
            for (int64_t i = 0; i < I; i++) out[i] = g[i] / (1.f + expf(-g[i])) * u[i];
        }
    }
    round_rows(b->act, I, b);
}

static void layer(const Layer *L, const Batch *b, float *stream, TeamBarrier *bar, int *phase) {
    const int64_t T = b->T, HD = b->heads * b->head_dim;
    const QX hidden = qx_of(b, b->hidden), heads = qx_of(b, HD), inter = qx_of(b, b->inter);
    const QX pair = qx_of(b, 2 * b->hidden);
    if (L->norm0)
        rms_pair_rows(stream, L->norm0, L->norm1, b->xn, b);
    else
        rms_rows(stream, L->norm1, b->xn, b);
    team_wait(bar, phase);
    qmm_share(&L->qkv, L->norm0 ? &pair : &hidden, T, b->qkv, 0);
    team_wait(bar, phase);
    rope_store(L, b);
    team_wait(bar, phase);
    attend(L, b);
    team_wait(bar, phase);
    merge_halves(b);
    team_wait(bar, phase);
    round_rows(b->attn, HD, b);
    team_wait(bar, phase);
    qmm_share(&L->o, &heads, T, stream, 1);
    team_wait(bar, phase);
    rms_rows(stream, L->norm2, b->xn, b);
    team_wait(bar, phase);
    qmm_share(&L->gate_up, &hidden, T, b->gate_up, 0);
    team_wait(bar, phase);
    act_rows(b);
    team_wait(bar, phase);
    qmm_share(&L->down, &inter, T, stream, 1);
    team_wait(bar, phase);
}

/* The stack over `stream` [T, hidden]. captured [n_capture, T, hidden] takes the stream
   entering layer capture[c] (n_layers: leaving the last). With final_norm [hidden] (else
   NULL), normed [T, hidden] takes the stream leaving the last layer, normed by it: the
   model's own final norm, which would cost a torch op on cold caches after this call. */
int cpu_layers_forward(const Layer *layers, int64_t n_layers, const Batch *b, float *stream,
                       const int64_t *capture, int64_t n_capture, float *captured, int threads,
                       const float *final_norm, float *normed) {
    if (b->head_dim > 512) return -1;
    const int64_t size = b->T * b->hidden;
    TeamBarrier bar = {0, 0};
#pragma omp parallel num_threads(threads)
    {
        int phase = 0;
        for (int64_t l = 0; l <= n_layers; l++) {
            if (omp_get_thread_num() == 0)
                for (int64_t c = 0; c < n_capture; c++)
                    if (capture[c] == l) memcpy(captured + c * size, stream, sizeof(float) * size);
            team_wait(&bar, &phase);
            if (l < n_layers) layer(&layers[l], b, stream, &bar, &phase);
        }
        if (final_norm) {
            int64_t r0, r1;
            my_rows(b->T, &r0, &r1);
            for (int64_t t = r0; t < r1; t++)
                rms_row(stream + t * b->hidden, final_norm, normed + t * b->hidden, b->hidden, b->eps);
        }
    }
    return 0;
}
