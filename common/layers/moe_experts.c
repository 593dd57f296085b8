// The experts of a mixture-of-experts block in one call (CPU, float32, AVX2 + FMA). Built and loaded by
// common/layers/native.py; common/layers/moe_native.py calls it and the caller keeps
// common/layers/moe.py's grouped_experts (torch) without it.
//
// out[t] = sum_j weights[t, j] * w2[e] @ (silu(w13[e][:I] @ x[t]) * (w13[e][I:] @ x[t])), e = ids[t, j];
// x [T, H], w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I], weights [T, k], ids [T, k], out
// [T, H], all contiguous.
//
// 1. The T * k (token, choice) pairs are counting-sorted by expert (stable: a token's pairs keep their
//    order), so each expert's tokens form one run; experts nobody picked are never read.
// 2. Gate/up: the work items are (used expert, tile of TILE_I intermediate features), shared out
//    dynamically over the OpenMP team, so even one token with k experts keeps every thread busy. Within
//    an item the weight rows go in blocks (a few gate rows and the matching up rows), and each block is
//    crossed with all of the expert's tokens, up to 6 at a time (blocks of even heights, as gemm.c's row
//    blocks) with the products in registers: every weight comes from memory once and from L1 for the
//    expert's other tokens. While a block is crossed the next one is prefetched: rows are 4 KiB apart at
//    H = 1024, one page each, and the hardware prefetcher does not follow a stream into a new page in
//    time. silu(gate) * up goes to h [pairs, I] in sorted order.
// 3. Down: the work items are chunks of the H output features (whole lines of out, about four per
//    thread), each running every used expert's w2 rows of the chunk over that expert's h rows and adding
//    weight * dot into out[token]. No two threads write one element: no atomics, no per-pair output rows
//    to reduce. A token's sum takes its experts in ascending order whatever the chunking, and every dot
//    the same FMAs in the same order, so the result has the same bits on any thread count.
// Each dot product sums 8 lanes with FMA, then the lanes; the features past the last multiple of 8 come
// from a masked load (zeros beyond), so H and I need not be multiples of 8.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <math.h>
#include <omp.h>

#include "vec_math.h"

#define TILE_I 16  // intermediate features per gate/up work item (a 64-byte line of h)
#define MAX_N 6    // tokens per register block

// The pairs' working memory, per calling thread, kept between calls (a decode step calls this once per
// layer): ints first (counts, offsets, sorted pairs), then h. NULL when it cannot grow.
static void *moe_scratch(size_t bytes) {
    static __thread void *buf;
    static __thread size_t cap;
    if (bytes > cap) {
        void *grown = realloc(buf, bytes);
        if (!grown)
            return 0;
        buf = grown;
        cap = bytes;
    }
    return buf;
}

// res[r * N + n] = dot(w[r][0..len), v[n][0..len)) for R rows and N vectors (both compile-time
// constants at every call, so the accumulators live in registers).
static inline __attribute__((always_inline)) void dots(const int R, const int N, int64_t len,
                                                       const float *const *w, const float *const *v,
                                                       float *res, const float *const *pf) {
    __m256 acc[8][MAX_N];
    #pragma GCC unroll 8
    for (int r = 0; r < R; r++)
        #pragma GCC unroll 8
        for (int n = 0; n < N; n++)
            acc[r][n] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= len; i += 8) {
        if (pf && !(i & 15))
#pragma GCC unroll 8
            for (int r = 0; r < R; r++)
                _mm_prefetch((const char *)(pf[r] + i), _MM_HINT_T0);
        __m256 wv[8];
        #pragma GCC unroll 8
        for (int r = 0; r < R; r++)
            wv[r] = _mm256_loadu_ps(w[r] + i);
        #pragma GCC unroll 8
        for (int n = 0; n < N; n++) {
            const __m256 xv = _mm256_loadu_ps(v[n] + i);
            #pragma GCC unroll 8
            for (int r = 0; r < R; r++)
                acc[r][n] = _mm256_fmadd_ps(wv[r], xv, acc[r][n]);
        }
    }
    if (i < len) {
        const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(len - i)),
                                             _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        __m256 wv[8];
        #pragma GCC unroll 8
        for (int r = 0; r < R; r++)
            wv[r] = _mm256_maskload_ps(w[r] + i, m);
        #pragma GCC unroll 8
        for (int n = 0; n < N; n++) {
            const __m256 xv = _mm256_maskload_ps(v[n] + i, m);
            #pragma GCC unroll 8
            for (int r = 0; r < R; r++)
                acc[r][n] = _mm256_fmadd_ps(wv[r], xv, acc[r][n]);
        }
    }
    #pragma GCC unroll 8
    for (int r = 0; r < R; r++)
        #pragma GCC unroll 8
        for (int n = 0; n < N; n++)
            res[r * N + n] = hsum8(acc[r][n]);
}

// The rows per register block for N vectors: the accumulators (R * N) plus the R rows and one vector
// fit AVX2's 16 registers, with at least 8 independent sums to cover the FMA latency.
static inline int rows_for(int n) { return n == 1 ? 8 : n <= 3 ? 4 : 2; }

// R x N for the shapes rows_for allows (R a power of two up to rows_for(N)); others are not instantiated.
static void dots_any(int R, int N, int64_t len, const float *const *w, const float *const *v, float *res,
                     const float *const *pf) {
#define UP_TO_4(N)                                  \
    switch (R) {                                    \
    case 4: dots(4, N, len, w, v, res, pf); break;      \
    case 2: dots(2, N, len, w, v, res, pf); break;      \
    default: dots(1, N, len, w, v, res, pf); break;     \
    }
#define UP_TO_2(N)                                  \
    if (R == 2)                                     \
        dots(2, N, len, w, v, res, pf);                 \
    else                                            \
        dots(1, N, len, w, v, res, pf);
    switch (N) {
    case 1:
        if (R == 8)
            dots(8, 1, len, w, v, res, pf);
        else
            UP_TO_4(1)
        break;
    case 2: UP_TO_4(2) break;
    case 3: UP_TO_4(3) break;
    case 4: UP_TO_2(4) break;
    case 5: UP_TO_2(5) break;
    default: UP_TO_2(6) break;
    }
#undef UP_TO_4
#undef UP_TO_2
}

// n tokens in as few blocks of at most MAX_N as fit, of heights that differ by at most one; block b
// starts at block_start(n, b), block_start(n, blocks(n)) = n.
static inline int64_t blocks(int64_t n) { return (n + MAX_N - 1) / MAX_N; }
static inline int64_t block_start(int64_t n, int64_t b) {
    const int64_t c = blocks(n), base = n / c, extra = n % c;
    return b * base + (b < extra ? b : extra);
}

// The rows per register block of an expert's n tokens: its blocks (below) are at most one token apart,
// so one row count fits them all.
static inline int rows_for_expert(int64_t n) { return rows_for((int)(n < MAX_N ? n : (n + blocks(n) - 1) / blocks(n))); }

// Gate/up of one expert's `n` pairs (sorted positions p0..p0+n-1; tok[p] their tokens) for the features
// i0..i1-1: h[p, i] = silu(gate_i . x) * (up_i . x). Feature blocks outer, token blocks inner: a block's
// rows come from memory once and from L1 for its other token blocks.
static void gate_up(const float *x, int64_t H, const float *w13e, int64_t I, const int64_t *tok, int64_t p0,
                    int64_t n, int64_t i0, int64_t i1, float *h) {
    const int want = rows_for_expert(n) / 2;  // features per block: a gate and an up row each
    for (int64_t i = i0; i < i1;) {
        const int f = i1 - i < want ? (i1 - i >= 2 ? 2 : 1) : want;
        const float *w[8];
        // the next block's rows (as many as the item has left), prefetched while this one is crossed
        const float *pf[8];
        const int64_t next = i + f, left = i1 - next;
        for (int r = 0; r < f; r++) {
            w[r] = w13e + (i + r) * H;
            w[f + r] = w13e + (I + i + r) * H;
            pf[r] = w13e + (next + (r < left ? r : 0)) * H;
            pf[f + r] = pf[r] + I * H;
        }
        for (int64_t b = 0; b < blocks(n); b++) {
            const int64_t q0 = p0 + block_start(n, b);
            const int N = (int)(p0 + block_start(n, b + 1) - q0);
            const float *v[MAX_N];
            float res[8 * MAX_N];
            for (int j = 0; j < N; j++)
                v[j] = x + tok[q0 + j] * H;
            dots_any(2 * f, N, H, w, v, res, b == 0 && left > 0 ? pf : 0);
            for (int r = 0; r < f; r++)
                for (int j = 0; j < N; j++) {
                    const float g = res[r * N + j], u = res[(f + r) * N + j];
                    h[(q0 + j) * I + i + r] = g / (1.0f + expf(-g)) * u;
                }
        }
        i += f;
    }
}

// Down projection of one expert's pairs for the output features c0..c1-1, added into out:
// out[tok, c] += weight * (w2e[c] . h[p]).
static void down(const float *w2e, int64_t H, int64_t I, const float *h, const int64_t *tok, const float *wt,
                 int64_t p0, int64_t n, int64_t c0, int64_t c1, float *out) {
    const int want = rows_for_expert(n);
    for (int64_t c = c0; c < c1;) {
        int R = want;
        while (R > c1 - c)
            R /= 2;
        const float *w[8];
        const float *pf[8];
        const int64_t next = c + R, left = c1 - next;
        for (int r = 0; r < R; r++) {
            w[r] = w2e + (c + r) * I;
            pf[r] = w2e + (next + (r < left ? r : 0)) * I;
        }
        for (int64_t b = 0; b < blocks(n); b++) {
            const int64_t q0 = p0 + block_start(n, b);
            const int N = (int)(p0 + block_start(n, b + 1) - q0);
            const float *v[MAX_N];
            float res[8 * MAX_N];
            for (int j = 0; j < N; j++)
                v[j] = h + (q0 + j) * I;
            dots_any(R, N, I, w, v, res, b == 0 && left > 0 ? pf : 0);
            for (int j = 0; j < N; j++) {
                float *o = out + tok[q0 + j] * H + c;
                const float s = wt[q0 + j];
                for (int r = 0; r < R; r++)
                    o[r] += s * res[r * N + j];
            }
        }
        c += R;
    }
}

// Returns 0; -1 when the working memory cannot grow, -2 when an id is outside [0, E) (out is then not
// written).
int moe_experts_f32(const float *x, int64_t T, int64_t H, const float *w13, const float *w2, int64_t E,
                    int64_t I, const float *weights, const int64_t *ids, int64_t k, float *out) {
    const int64_t P = T * k;
    for (int64_t p = 0; p < P; p++)
        if (ids[p] < 0 || ids[p] >= E)
            return -2;
    if (P == 0 || H <= 0) {
        if (T > 0 && H > 0)
            memset(out, 0, (size_t)(T * H) * sizeof(float));
        return 0;
    }
    // ints: count/offset per expert (E + 1), the used experts (E), tokens and weights in sorted order (P
    // each, the weights as floats), then h (P x I floats), 64-byte aligned
    const size_t ints = (size_t)(2 * E + 1 + P) * sizeof(int64_t) + (size_t)P * sizeof(float);
    const size_t h_at = (ints + 63) / 64 * 64;
    char *mem = moe_scratch(h_at + (size_t)(P * (I > 0 ? I : 1)) * sizeof(float) + 64);
    if (!mem)
        return -1;
    mem += (64 - (uintptr_t)mem % 64) % 64;
    int64_t *start = (int64_t *)mem, *used = start + E + 1, *tok = used + E;
    float *wt = (float *)(tok + P), *h = (float *)(mem + h_at);
    memset(start, 0, (size_t)(E + 1) * sizeof(int64_t));
    for (int64_t p = 0; p < P; p++)
        start[ids[p] + 1]++;
    int64_t nused = 0;
    for (int64_t e = 0; e < E; e++) {
        if (start[e + 1])
            used[nused++] = e;
        start[e + 1] += start[e];
    }
    // scatter (start[e] is advanced as expert e's pairs are placed, then ends where e + 1 starts)
    for (int64_t p = 0; p < P; p++) {
        const int64_t q = start[ids[p]]++;
        tok[q] = p / k;
        wt[q] = weights[p];
    }
    for (int64_t e = E; e > 0; e--)
        start[e] = start[e - 1];
    start[0] = 0;

    const int64_t tiles = (I + TILE_I - 1) / TILE_I, items = nused * tiles;
    const double work = (double)P * (double)I * (double)H;  // multiply-adds / 3
#pragma omp parallel if (work >= 65536)
    {
        // down: chunks of output features (whole lines of out), a few per thread, so that a thread the
        // OS preempts holds back only its chunk
        const int64_t nt = omp_get_num_threads(), per = (H + 4 * nt - 1) / (4 * nt);
        const int64_t rows = per < 16 ? 16 : (per + 15) / 16 * 16, chunks = (H + rows - 1) / rows;
#pragma omp for schedule(dynamic)
        for (int64_t it = 0; it < items; it++) {
            const int64_t e = used[it / tiles], i0 = it % tiles * TILE_I;
            const int64_t i1 = i0 + TILE_I < I ? i0 + TILE_I : I;
            gate_up(x, H, w13 + e * 2 * I * H, I, tok, start[e], start[e + 1] - start[e], i0, i1, h);
        }
        // (the implicit barrier: every h row is complete before any thread reads it)
#pragma omp for schedule(dynamic)
        for (int64_t ch = 0; ch < chunks; ch++) {
            const int64_t c0 = ch * rows, c1 = c0 + rows < H ? c0 + rows : H;
            for (int64_t t = 0; t < T; t++)
                memset(out + t * H + c0, 0, (size_t)(c1 - c0) * sizeof(float));
            for (int64_t u = 0; u < nused && I > 0; u++) {
                const int64_t e = used[u];
                down(w2 + e * H * I, H, I, h, tok, wt, start[e], start[e + 1] - start[e], c0, c1, out);
            }
        }
    }
    return 0;
}

#else
// Without AVX2 + FMA the caller keeps the torch path.
int moe_experts_f32(const float *x, int64_t T, int64_t H, const float *w13, const float *w2, int64_t E,
                    int64_t I, const float *weights, const int64_t *ids, int64_t k, float *out) {
    return -1;
}
#endif
