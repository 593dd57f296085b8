// Matrix product over float32 weights kept as the blocks of 32 they were dequantized from (CPU, AVX2 +
// FMA). Built and loaded by common/layers/native.py; common/layers/weight_blocks.py finds and packs the
// blocks, common/layers/linear.py calls `packed_gemm_blocks`.
//
// A GGUF checkpoint's Q4_1 and Q8_0 weights (SmolLM2-135M's, `pdserve`'s default model) become float32 at
// conversion as w = d * q + m, d and m one per 32 input channels of an output row. Every such w is an
// exact float32 function of (q, d, m), so packing (q, d, m) instead of w loses nothing, and a decode step
// reads 5 (4-bit) or 8.5 (8-bit) bits a weight instead of 32. d and m are the checkpoint's float16 values,
// kept as float16 (float32 scales were a sixth of a 4-bit block's bytes).
//
// What one panel of 16 output columns (as gemm.c's float32 panels) keeps per block of 32 steps of k:
//   bits 4: scales float16 d[16], float16 m[16]; per step 8 bytes: byte j holds q of column j in its low
//           nibble and of column j + 8 in its high nibble (q in 0..15); w = d * q + m.
//   bits 8: scales float16 d[16]; per step 16 signed bytes in column order (q in -127..127); w = d * q.
// Stored by groups of 4 panels (`place`): a group's block holds its panels' scales, then, step by step,
// its panels' bytes of that step, so the one-row tile over a group reads one sequential stream.
// A tile widens a block's scales to float32 registers once, for its 32 steps.
// `pack_weight_blocks` finds a weight's blocks and `block_panels_equal` checks that they widen to its
// float32 panels; weight_blocks.py keeps blocks only when they give every weight's bits. The tiles widen each step's 16 weights the same way in
// registers and multiply-add them into float32 accumulators, each output summing over k in order as in
// gemm.c: the results are the float32 panels' bits, in any batch and either build.
//
// A tile is MR rows (at most 5) by NP panels: one row takes 4 panels at a time and two rows 2, so 8
// accumulators are in flight to hide the FMA's latency (an output's sum is one chain).
#include <omp.h>
#include <stdint.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 32
#define NR 16

void *gemm_scratch(int slot, size_t bytes);  // gemm.c
const float *gemm_pack_rows(const float *x, int64_t ldx, int64_t M, int64_t K, int64_t mr_max);
int64_t gemm_row_blocks(int64_t M, int64_t mr_max);
int64_t gemm_block_start(int64_t M, int64_t j, int64_t mr_max);

static inline int64_t scale_bytes(int64_t bits) { return bits == 4 ? 2 * NR * 2 : NR * 2; }  // float16 d (, m)
static inline int64_t block_bytes(int64_t bits) { return scale_bytes(bits) + (bits == 4 ? BLOCK * 8 : BLOCK * NR); }
static inline int64_t step_bytes(int64_t bits) { return bits == 4 ? 8 : NR; }  // one step of k of a panel

// Panels are stored by groups of GROUP (the last group may be smaller, gs panels). A group's block b holds
// the gs panels' scales, then for each step of k the gs panels' bytes of that step, so a 4-panel tile
// reads its weights as one sequential stream. Where things are, for panel p (of `panels`) and block b:
#define GROUP 4
typedef struct {
    const uint8_t *scales;  // this panel's scales in block b
    const uint8_t *q;       // its bytes of step 0 in block b; step k at q + k * step_stride
    int64_t step_stride, block_stride;  // from one step to the next; from block b to b + 1
} place_t;

static inline place_t place(const uint8_t *base, int64_t bits, int64_t panels, int64_t nb, int64_t p, int64_t b) {
    const int64_t g0 = p / GROUP * GROUP, gs = panels - g0 < GROUP ? panels - g0 : GROUP, i = p - g0;
    const int64_t bb = block_bytes(bits), sb = scale_bytes(bits);
    const uint8_t *blk = base + (g0 * nb + b * gs) * bb;
    place_t r = {blk + i * sb, blk + gs * sb + i * step_bytes(bits), gs * step_bytes(bits), gs * bb};
    return r;
}

#if defined(__AVX2__) && defined(__FMA__)
#if defined(PDSERVE_AVX512VL)
// AVX-512VL gives the 8-wide (ymm) code below 32 registers instead of 16: a one-row tile's 4 panels of
// scales, 8 accumulators and the widening's temporaries then stay in registers (1.05-1.09x on SmolLM2's
// 30 layers from DRAM, same bits). Only this file: elsewhere it was not measured to help.
#pragma GCC target("avx512vl")
#endif
#include <immintrin.h>

#define MR_MAX 5

// A block's scales (float16 at `s`) as float32 vectors for its 16 columns, widened once for its 32 steps:
// d, and m for 4 bits.
typedef struct {
    __m256 d0, d1, m0, m1;
} scales_t;

static inline __attribute__((always_inline)) scales_t load_scales(const int BITS, const uint8_t *s) {
    scales_t r;
    r.d0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)s));
    r.d1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + 16)));
    r.m0 = BITS == 4 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + 32))) : _mm256_setzero_ps();
    r.m1 = BITS == 4 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + 48))) : _mm256_setzero_ps();
    return r;
}

// The 16 weights of one step (of a block with scales `sc`; the step's bytes at `q`) as two float32 vectors.
static inline __attribute__((always_inline)) void widen(const int BITS, const scales_t sc, const uint8_t *q,
                                                        __m256 *w0, __m256 *w1) {
    if (BITS == 4) {
        const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q));
        const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
        const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
        *w0 = _mm256_fmadd_ps(lo, sc.d0, sc.m0);  // d * q exact: one rounding
        *w1 = _mm256_fmadd_ps(hi, sc.d1, sc.m1);
    } else {
        const __m128i v = _mm_loadu_si128((const __m128i *)q);
        *w0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), sc.d0);
        *w1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(v, v))), sc.d1);
    }
}

// `weight` [out, K] float32 as the blocks of `bits` 4 or 8 a Q4_1 or Q8_0 checkpoint would store, in this
// file's layout (rows padded to whole panels with zero blocks), at dst (`panels * K / 32` blocks of
// block_bytes). Per 32 weights of a row: Q4_1 takes m = their min and d = (max - m) / 15 rounded to float16,
// Q8_0 d = max |w| / 127 rounded to float16; q = round((w - m) / d) (to even), clamped to 0..15 or -127..127, d = 0 read as 1.
// weight_blocks.py keeps the result only when block_panels_equal finds every weight's bits. Plain
// IEEE arithmetic (no fast-math here), as the reference in tests/unit/test_weight_blocks.py computes it.
__attribute__((optimize("no-fast-math"))) void pack_weight_blocks(int64_t bits, const float *weight, int64_t out,
                                                                 int64_t K, uint8_t *dst) {
    const int64_t nb = K / BLOCK, panels = (out + NR - 1) / NR;
    const int64_t scales = scale_bytes(bits);
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        for (int64_t b = 0; b < nb; b++) {
            const place_t at = place(dst, bits, panels, nb, p, b);
            _Float16 *d = (_Float16 *)at.scales, *m = d + NR;
            uint8_t *q = (uint8_t *)at.q;
            memset((uint8_t *)at.scales, 0, scales);
            for (int k = 0; k < BLOCK; k++)
                memset(q + k * at.step_stride, 0, step_bytes(bits));
            for (int c = 0; c < NR && p * NR + c < out; c++) {
                const float *v = weight + (p * NR + c) * K + b * BLOCK;
                if (bits == 4) {
                    float lo = v[0], hi = v[0];
                    for (int k = 1; k < BLOCK; k++) {
                        lo = v[k] < lo ? v[k] : lo;
                        hi = v[k] > hi ? v[k] : hi;
                    }
                    const float dd = (float)(_Float16)((hi - lo) / 15.0f), safe = dd > 0 ? dd : 1.0f;
                    for (int k = 0; k < BLOCK; k++) {
                        float t = nearbyintf((v[k] - lo) / safe);
                        t = t < 0 ? 0 : t > 15 ? 15 : t;
                        q[k * at.step_stride + (c & 7)] |= (uint8_t)((int)t << (c < 8 ? 0 : 4));
                    }
                    d[c] = (_Float16)dd;
                    m[c] = (_Float16)lo;  // exact for a checkpoint's m; else block_panels_equal refuses it
                } else {
                    float a = 0;
                    for (int k = 0; k < BLOCK; k++)
                        a = fabsf(v[k]) > a ? fabsf(v[k]) : a;
                    const float dd = (float)(_Float16)(a / 127.0f), safe = dd > 0 ? dd : 1.0f;
                    for (int k = 0; k < BLOCK; k++) {
                        float t = nearbyintf(v[k] / safe);
                        t = t < -127 ? -127 : t > 127 ? 127 : t;
                        ((int8_t *)q)[k * at.step_stride + c] = (int8_t)t;
                    }
                    d[c] = (_Float16)dd;
                }
            }
        }
    }
}

// 1 when the blocks at src widen to exactly the float32 panels at `want` (`panels` panels over K), bit for
// bit, else 0: each block widened in registers as the tiles widen it, and compared, without writing it.
int block_panels_equal(int64_t bits, const uint8_t *src, int64_t panels, int64_t K, const float *want) {
    const int64_t nb = K / BLOCK, n = panels * nb;
    int equal = 1;
#pragma omp parallel for schedule(static) reduction(&& : equal)
    for (int64_t b = 0; b < n; b++) {  // the b-th block in panel order
        const place_t at = place(src, bits, panels, nb, b / nb, b % nb);
        const float *w = want + b * BLOCK * NR;
        __m256i diff = _mm256_setzero_si256();
        const scales_t sc = bits == 4 ? load_scales(4, at.scales) : load_scales(8, at.scales);
        for (int k = 0; k < BLOCK; k++, w += NR) {
            __m256 w0, w1;
            if (bits == 4)
                widen(4, sc, at.q + k * at.step_stride, &w0, &w1);
            else
                widen(8, sc, at.q + k * at.step_stride, &w0, &w1);
            diff = _mm256_or_si256(diff, _mm256_xor_si256(_mm256_castps_si256(w0), _mm256_loadu_si256((const __m256i *)w)));
            diff = _mm256_or_si256(diff, _mm256_xor_si256(_mm256_castps_si256(w1), _mm256_loadu_si256((const __m256i *)(w + 8))));
        }
        equal = equal && _mm256_testz_si256(diff, diff);
    }
    return equal;
}

// MR rows (x: k-major, [K][MR]) by NP panels of one group (the first at `at`) over the whole K; `nv` of
// the NP * 16 columns are stored, at y (rows ldy apart). Named accumulators (c<row><panel><half>), as in
// gemm.c: an array of them was kept in memory. For each step, each panel's weights are widened, then used
// by every row: with MR * NP <= 4 that is at most 8 accumulators, 2 weight vectors and the widening's
// temporaries, within AVX2's 16 registers.
#define MR_MAX 5
#define ROW(X, i) X(i, 0) X(i, 1) X(i, 2) X(i, 3)
#define EACH(X) ROW(X, 0) ROW(X, 1) ROW(X, 2) ROW(X, 3) ROW(X, 4)  // the (row, panel) pairs a tile uses
#define DECLARE(i, p) __m256 c##i##p##a = b##p##a, c##i##p##b = b##p##b;
#define BIAS(p)                                                                                 \
    const __m256 b##p##a = NP > p && bias ? _mm256_maskload_ps(bias + p * NR, mask(nv - p * NR)) \
                                          : _mm256_setzero_ps();                               \
    const __m256 b##p##b = NP > p && bias ? _mm256_maskload_ps(bias + p * NR + 8, mask(nv - p * NR - 8)) \
                                          : _mm256_setzero_ps();
#define FMA(i, p)                                                                      \
    if (MR > i && NP > p) {                                                            \
        const __m256 a = _mm256_broadcast_ss(xb + k * MR + i);                         \
        c##i##p##a = _mm256_fmadd_ps(a, w##p##a, c##i##p##a);                          \
        c##i##p##b = _mm256_fmadd_ps(a, w##p##b, c##i##p##b);                          \
    }
#define SCALES(p) const scales_t s##p = load_scales(NP > p ? BITS : 0, blk + (NP > p ? p : 0) * scales);
#define PANEL_STEP(p)                                                                  \
    if (NP > p) {                                                                      \
        __m256 w##p##a, w##p##b;                                                       \
        widen(BITS, s##p, qk + p * step, &w##p##a, &w##p##b);                          \
        FMA(0, p) FMA(1, p) FMA(2, p) FMA(3, p) FMA(4, p)                                      \
    }
#define STORE(i, p)                                                                              \
    if (MR > i && NP > p) {                                                                      \
        _mm256_maskstore_ps(y + i * ldy + p * NR, mask(nv - p * NR), c##i##p##a);                \
        _mm256_maskstore_ps(y + i * ldy + p * NR + 8, mask(nv - p * NR - 8), c##i##p##b);        \
    }

static inline __m256i mask(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

static inline __attribute__((always_inline)) void tile(const int MR, const int NP, const int BITS, int64_t K,
                                                       const float *x, const place_t at,
                                                       const float *bias, float *y, int64_t ldy, int nv) {
    const int64_t scales = scale_bytes(BITS), step = step_bytes(BITS);
    BIAS(0) BIAS(1) BIAS(2) BIAS(3)
    EACH(DECLARE)
    for (int64_t b = 0; b < K / BLOCK; b++) {
        const uint8_t *blk = at.scales + b * at.block_stride;  // the tile's panels are one group's, in order
        const uint8_t *qb = at.q + b * at.block_stride;
        const float *xb = x + b * BLOCK * MR;
        SCALES(0) SCALES(1) SCALES(2) SCALES(3)
#pragma GCC unroll 2
        for (int k = 0; k < BLOCK; k++) {
            const uint8_t *qk = qb + k * at.step_stride;
            PANEL_STEP(0) PANEL_STEP(1) PANEL_STEP(2) PANEL_STEP(3)
        }
    }
    EACH(STORE)
}

// `mr` rows by `np` panels (4 with one row, 2 with two, else 1).
#define TILES(BITS, ...)                                                                            \
    if (np == 4) tile(1, 4, BITS, __VA_ARGS__);                                                     \
    else if (np == 2) tile(2, 2, BITS, __VA_ARGS__);                                                \
    else if (mr == 5) tile(5, 1, BITS, __VA_ARGS__);                                                \
    else if (mr == 4) tile(4, 1, BITS, __VA_ARGS__);                                                \
    else if (mr == 3) tile(3, 1, BITS, __VA_ARGS__);                                                \
    else if (mr == 2) tile(2, 1, BITS, __VA_ARGS__);                                                \
    else tile(1, 1, BITS, __VA_ARGS__);

static void tile_rows(int mr, int np, int bits, int64_t K, const float *x, const place_t at, const float *bias,
                      float *y, int64_t ldy, int nv) {
    if (bits == 4) {
        TILES(4, K, x, at, bias, y, ldy, nv)
    } else {
        TILES(8, K, x, at, bias, y, ldy, nv)
    }
}

// The most rows for which these tiles are used instead of gemm.c's over float32 panels. Past 5 rows a second
// row block widens the weights again: on one thread float32 panels then do as well, on two the blocks still
// win up to ~10 rows, as the two threads share the DRAM stream. SmolLM2's 30 layers of projections, Q4_1
// weights (`pdserve bench kernels --layers 30`, AVX2 Zen 3; two threads / one): 1 row 2.1-2.7x / 2.2-2.5x,
// 4 rows 1.9-2.0x / 1.7x, 5 rows 1.5-1.9x / 1.5x, 6-10 rows 1.1-1.2x / 0.96-1.03x, 12 rows 0.88x, 16 rows
// 0.8-0.9x; whole decode steps at batch 6-7 1.22x faster on two threads, 0.88x on one; batch 8 1.0x on two.
int packed_gemm_blocks_rows(void) { return omp_get_max_threads() > 1 ? 8 : MR_MAX; }

// y[M, N] = x[M, K] @ W^T (+ bias), W as blocks of `bits` 4 or 8; x rows at x + m * ldx, y rows at
// y + m * ldy. Returns 0, -1 when the buffer of packed rows cannot grow, -2 for bad bits or a K that is
// not a multiple of 32.
int packed_gemm_blocks(const float *x, int64_t ldx, const uint8_t *wb, int64_t bits, const float *bias, float *y,
                       int64_t ldy, int64_t M, int64_t N, int64_t K) {
    if ((bits != 4 && bits != 8) || K % BLOCK)
        return -2;
    if (M <= 0 || N <= 0)
        return 0;
    const int64_t panels = (N + NR - 1) / NR, nb = K / BLOCK;
    const int np_max = M == 1 ? 4 : M == 2 ? 2 : 1;  // panels per tile: 8 accumulators
    const int64_t units = (panels + np_max - 1) / np_max, blocks = gemm_row_blocks(M, MR_MAX);
    const float *xp = gemm_pack_rows(x, ldx, M, K, MR_MAX);
    if (!xp)
        return -1;
#pragma omp parallel for schedule(static) if (M * N * K >= 32768)
    for (int64_t u = 0; u < units; u++) {
        const int64_t p = u * np_max;
        const int np = panels - p < np_max ? (int)(panels - p) : np_max;
        const int nv = N - p * NR < np * NR ? (int)(N - p * NR) : np * NR;
        for (int64_t j = 0; j < blocks; j++) {
            const int64_t m = gemm_block_start(M, j, MR_MAX);
            const int mr = (int)(gemm_block_start(M, j + 1, MR_MAX) - m);
            // a last unit of fewer panels runs them one at a time
            for (int64_t e = 0; e < (np == np_max ? 1 : np); e++)
                tile_rows(mr, np == np_max ? np : 1, (int)bits, K, xp + m * K, place(wb, bits, panels, nb, p + e, 0),
                          bias ? bias + (p + e) * NR : 0, y + m * ldy + (p + e) * NR, ldy, nv - (int)e * NR);
        }
    }
    return 0;
}

#else
// Without AVX2 + FMA there is no panel GEMM, and weight_blocks.py keeps float32 panels.
int packed_gemm_blocks_rows(void) { return 0; }
void pack_weight_blocks(int64_t bits, const float *weight, int64_t out, int64_t K, uint8_t *dst) {}
int block_panels_equal(int64_t bits, const uint8_t *src, int64_t panels, int64_t K, const float *want) { return 0; }
int packed_gemm_blocks(const float *x, int64_t ldx, const uint8_t *wb, int64_t bits, const float *bias, float *y,
                       int64_t ldy, int64_t M, int64_t N, int64_t K) {
    return -1;
}
#endif
