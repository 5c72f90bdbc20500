/* What cpu_quant.c offers cpu_layers.c: a GGUF weight in the CPU's tile layout
   (kernels/cpu_quant.py `pack`), float32 rows quantized to int16 once, and their product,
   computed by the calling OpenMP thread for its share of the output tiles. */
#ifndef SPECSERVE_CPU_QUANT_H
#define SPECSERVE_CPU_QUANT_H
#include <stdint.h>

enum { QW_Q4 = 0, QW_Q8 = 1 };
#define TILE 16  /* output rows a tile */
#define XBLOCK 32 /* input columns one activation scale covers */

/* W [N, K], N a multiple of TILE: W[n, k] = q * scale + offset for n's tile t = n / TILE,
   lane i = n % TILE and group g = k / group (no offset unless has_offset). Scales and
   offsets are float32, or float16 where `half` (where every one is exact in it, as GGUF
   stores Q4_0/Q4_1/Q8_0's).

   `data` holds super-tiles of SUPER tiles (the last may hold fewer, nt), one after
   another, each taking G = K / group chunks of SUPER tiles' size; super-tile s's chunk g
   starts at (s * G * chunk_bytes(SUPER) + g * chunk_bytes(nt)) and holds nt tiles'
   integers, then their nt * TILE scales, then their offsets: the weight is read in one
   stream. A tile's integers for group g:
   q4 (group 32): 256 bytes, four 64-byte words j = 0..3, lane i's uint32 holding 8
   nibbles: nibble p < 4 (bits 4p) is column 8j + 2p, nibble 4 + p (bits 16 + 4p) column
   8j + 2p + 1.
   q8 (group 16 or 32): 16 group bytes: for each column pair c = 2s', 2s' + 1 (s' < group /
   2), 32 bytes: lane i's two values, column c first. */
typedef struct {
    int64_t method, N, K, group, half, has_offset;
    const uint8_t *data;
} QW;

#define SUPER 4 /* tiles a super-tile */

/* x [M, K] as the products read it: q int16 [M, K], x ~= q * d with d float [M, K / XBLOCK]
   (a block's absmax / 32767); s float [M, K / 16], the sums of x's 16-column runs. */
typedef struct {
    int16_t *q;
    float *d, *s;
    int64_t K;
} QX;

/* x's rows [begin, end) into qx (rows of K columns, K a multiple of XBLOCK) */
void qx_rows(const float *x, int64_t begin, int64_t end, const QX *qx);

/* A barrier for the threads of one OpenMP team, in place of `#pragma omp barrier`: a waiter
   spins a little, then yields its core (sched_yield) until the last thread arrives. libgomp's
   barrier spins for far longer, so when another process holds one of the cores, the threads
   that arrived burn the time slices the late one needs (decode ran 4-8x slower beside one
   busy process on a 2-core machine). Zero-initialise it before the parallel region; each
   thread keeps its own `phase`, starting at 0. */
typedef struct {
    _Atomic int arrived, phase;
} TeamBarrier;
void team_wait(TeamBarrier *b, int *phase);

/* y[m, n] (+)= x[m, :] . W[n, :] for m < M and this thread's share of the tiles (OpenMP's
   thread number and count; call from every thread of a parallel region, or alone).
   accumulate: add to y (a residual) instead of overwriting it. y [M, N] contiguous. */
void qmm_share(const QW *w, const QX *x, int64_t M, float *y, int accumulate);

#endif
