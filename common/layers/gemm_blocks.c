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
// What one panel of 16 output columns (as gemm.c's float32 panels) keeps per block of 32 steps of k, as
// lines of 16 bytes:
//   bits 4: scales float16 d[16], float16 m[16]; 16 lines, one per pair of steps: byte c holds column c's q
//           at the pair's first step in its low nibble and at its second in the high one (q in 0..15);
//           w = d * q + m.
//   bits 8: scales float16 d[16]; 32 lines, one per step: 16 signed bytes in column order (q in
//           -127..127); w = d * q.
// Stored by groups of 4 panels (`place`): a group's block holds its panels' scales, then, line by line, its
// panels' lines (one 64-byte cache line), so a tile over a group reads one sequential stream, and
// prefetches it a few blocks ahead (from DRAM the hardware alone kept a 1-row tile at ~25 GB/s here).
// A tile widens a block's scales to float32 registers once, for its 32 steps.
// `pack_weight_blocks` finds a weight's blocks and `block_panels_equal` checks that they widen to its
// float32 panels; weight_blocks.py keeps blocks only when they give every weight's bits. The tiles widen each
// step's 16 weights the same way in registers and multiply-add them into float32 accumulators, each output
// summing over k in order as in gemm.c: the results are the float32 panels' bits, in any batch and either
// build. With AVX-512 a panel's 16 columns are one register, and a 4-bit line widens with one byte-to-dword
// move for both its steps: 4.5 vector instructions per step of a panel, where AVX2 takes 9.
//
// A tile is MR rows (at most 5) by NP panels (AVX-512: 4 for one or two rows, 2 beyond; AVX2: 2, then 1),
// so several accumulators are in flight to hide the FMA's latency (an output's sum is one chain).
#include <omp.h>
#include <stdint.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 32
#define NR 16
#define LINE 16  // bytes of a panel per line: a pair of steps of k (4 bits) or one step (8 bits)

void *gemm_scratch(int slot, size_t bytes);  // gemm.c
const float *gemm_pack_rows(const float *x, int64_t ldx, int64_t M, int64_t K, int64_t mr_max);
int64_t gemm_row_blocks(int64_t M, int64_t mr_max);
int64_t gemm_block_start(int64_t M, int64_t j, int64_t mr_max);

static inline int64_t scale_bytes(int64_t bits) { return bits == 4 ? 2 * NR * 2 : NR * 2; }  // float16 d (, m)
static inline int64_t block_lines(int64_t bits) { return bits == 4 ? BLOCK / 2 : BLOCK; }
static inline int64_t block_bytes(int64_t bits) { return scale_bytes(bits) + block_lines(bits) * LINE; }

// Panels are stored by groups of GROUP (the last group may be smaller, gs panels). A group's block b holds
// the gs panels' scales, then for each line the gs panels' bytes of that line, so a tile over one group
// reads its weights as one sequential stream. Where things are, for panel p (of `panels`) and block b:
#define GROUP 4
#define AHEAD 4  // blocks of a tile's stream prefetched ahead of it (the first row block's tile)
typedef struct {
    const uint8_t *scales;  // this panel's scales in block 0
    const uint8_t *q;       // its line 0 in block 0; line l at q + l * line_stride
    int64_t line_stride, block_stride;  // from one line to the next; from block b to b + 1
} place_t;

static inline place_t place(const uint8_t *base, int64_t bits, int64_t panels, int64_t nb, int64_t p) {
    const int64_t g0 = p / GROUP * GROUP, gs = panels - g0 < GROUP ? panels - g0 : GROUP, i = p - g0;
    const int64_t bb = block_bytes(bits), sb = scale_bytes(bits);
    const uint8_t *blk = base + g0 * nb * bb;
    place_t r = {blk + i * sb, blk + gs * sb + i * LINE, gs * LINE, gs * bb};
    return r;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#define MR_MAX 5

#if defined(__AVX512F__)
typedef __m512 col16;  // 16 columns of one step, or of one tile row's accumulators
typedef struct {
    __m512 d, m;
} scales_t;

static inline __attribute__((always_inline)) scales_t load_scales(const int BITS, const uint8_t *s) {
    scales_t r;
    r.d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)s));
    r.m = BITS == 4 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(s + 32))) : _mm512_setzero_ps();
    return r;
}

// A line's weights: 4 bits, its two steps (w0 the first); 8 bits, its one step (w0).
static inline __attribute__((always_inline)) void widen(const int BITS, const scales_t sc, const uint8_t *q,
                                                        col16 *w0, col16 *w1) {
    if (BITS == 4) {
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
        *w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15))), sc.d, sc.m);
        *w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), sc.d, sc.m);  // d * q exact
    } else {
        const __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q));
        *w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(v), sc.d);
        *w1 = *w0;
    }
}

static inline col16 fma16(float a, col16 w, col16 c) { return _mm512_fmadd_ps(_mm512_set1_ps(a), w, c); }

static inline __mmask16 cols_mask(int n) {
    return n >= NR ? (__mmask16)0xFFFF : n <= 0 ? 0 : (__mmask16)((1u << n) - 1);
}
static inline col16 load16(const float *p, int n) {
    return p ? _mm512_maskz_loadu_ps(cols_mask(n), p) : _mm512_setzero_ps();
}
static inline void store16(float *p, int n, col16 v) { _mm512_mask_storeu_ps(p, cols_mask(n), v); }
static inline __m512i bits16(col16 w, const float *want) {
    return _mm512_xor_si512(_mm512_castps_si512(w), _mm512_loadu_si512(want));
}
static inline __m512i or16(__m512i a, __m512i b) { return _mm512_or_si512(a, b); }
static inline int none16(__m512i v) { return _mm512_test_epi32_mask(v, v) == 0; }
static inline __m512i zero_bits(void) { return _mm512_setzero_si512(); }

// Panels per tile for tiles of `mr` rows: up to 4 x 4 accumulators and 4 panels' scales in 32 registers.
static inline int tile_panels(int64_t mr) { return mr <= 2 ? 4 : 2; }
#else
// AVX2: a panel's 16 columns are two ymm.
typedef struct {
    __m256 a, b;
} col16;
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

static inline __attribute__((always_inline)) void widen(const int BITS, const scales_t sc, const uint8_t *q,
                                                        col16 *w0, col16 *w1) {
    if (BITS == 4) {
        const __m256i v0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q));
        const __m256i v1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8)));
        const __m256i low = _mm256_set1_epi32(15);
        w0->a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v0, low)), sc.d0, sc.m0);
        w0->b = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v1, low)), sc.d1, sc.m1);
        w1->a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v0, 4)), sc.d0, sc.m0);
        w1->b = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v1, 4)), sc.d1, sc.m1);
    } else {
        const __m128i v = _mm_loadu_si128((const __m128i *)q);
        w0->a = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), sc.d0);
        w0->b = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(v, v))), sc.d1);
        *w1 = *w0;
    }
}

static inline col16 fma16(float a, col16 w, col16 c) {
    const __m256 v = _mm256_set1_ps(a);
    c.a = _mm256_fmadd_ps(v, w.a, c.a);
    c.b = _mm256_fmadd_ps(v, w.b, c.b);
    return c;
}

static inline __m256i mask8(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
static inline col16 load16(const float *p, int n) {
    col16 r = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    if (p) {
        r.a = _mm256_maskload_ps(p, mask8(n));
        r.b = _mm256_maskload_ps(p + 8, mask8(n - 8));
    }
    return r;
}
static inline void store16(float *p, int n, col16 v) {
    _mm256_maskstore_ps(p, mask8(n), v.a);
    _mm256_maskstore_ps(p + 8, mask8(n - 8), v.b);
}
static inline __m256i bits16(col16 w, const float *want) {
    const __m256i a = _mm256_xor_si256(_mm256_castps_si256(w.a), _mm256_loadu_si256((const __m256i *)want));
    return _mm256_or_si256(a, _mm256_xor_si256(_mm256_castps_si256(w.b), _mm256_loadu_si256((const __m256i *)(want + 8))));
}
static inline __m256i or16(__m256i a, __m256i b) { return _mm256_or_si256(a, b); }
static inline int none16(__m256i v) { return _mm256_testz_si256(v, v); }
static inline __m256i zero_bits(void) { return _mm256_setzero_si256(); }

// AVX2's 16 registers: two panels for one or two rows, one beyond (wider tiles spilled their scales and
// weights: 1.25x slower from DRAM with 4 panels for one row).
static inline int tile_panels(int64_t mr) { return mr <= 2 ? 2 : 1; }
#endif

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
        const place_t at = place(dst, bits, panels, nb, p);
        for (int64_t b = 0; b < nb; b++) {
            _Float16 *d = (_Float16 *)(at.scales + b * at.block_stride), *m = d + NR;
            uint8_t *q = (uint8_t *)at.q + b * at.block_stride;
            memset(d, 0, scales);
            for (int l = 0; l < block_lines(bits); l++)
                memset(q + l * at.line_stride, 0, LINE);
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
                        q[k / 2 * at.line_stride + c] |= (uint8_t)((int)t << (k % 2 ? 4 : 0));
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
                        ((int8_t *)q)[k * at.line_stride + c] = (int8_t)t;
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
    const int64_t nb = K / BLOCK, n = panels * nb, per_line = bits == 4 ? 2 : 1;
    int equal = 1;
#pragma omp parallel for schedule(static) reduction(&& : equal)
    for (int64_t b = 0; b < n; b++) {  // the b-th block in panel order
        const place_t at = place(src, bits, panels, nb, b / nb);
        const int64_t off = b % nb * at.block_stride;
        const float *w = want + b * BLOCK * NR;
        const scales_t sc = bits == 4 ? load_scales(4, at.scales + off) : load_scales(8, at.scales + off);
        __typeof__(zero_bits()) diff = zero_bits();
        for (int l = 0; l < block_lines(bits); l++, w += per_line * NR) {
            col16 w0, w1;
            if (bits == 4) {
                widen(4, sc, at.q + off + l * at.line_stride, &w0, &w1);
                diff = or16(diff, bits16(w1, w + NR));
            } else {
                widen(8, sc, at.q + off + l * at.line_stride, &w0, &w1);
            }
            diff = or16(diff, bits16(w0, w));
        }
        equal = equal && none16(diff);
    }
    return equal;
}

// MR rows (x: k-major, [K][MR]) by NP panels (at[0..NP), adjacent, any groups) over the whole K; `nv` of
// the NP * 16 columns are stored, at y (rows ldy apart). For each line each panel's weights are widened,
// then used by every row, step by step: each output sums over k in order.
static inline __attribute__((always_inline)) void tile(const int MR, const int NP, const int BITS, int64_t K,
                                                       const float *x, const place_t *at, const float *bias,
                                                       float *y, int64_t ldy, int nv, int64_t ahead) {
    col16 c[MR_MAX][4];
    for (int p = 0; p < NP; p++) {
        const col16 b = load16(bias ? bias + p * NR : 0, nv - p * NR);
        for (int i = 0; i < MR; i++)
            c[i][p] = b;
    }
    for (int64_t b = 0; b < K / BLOCK; b++) {
        scales_t sc[4];
        const uint8_t *q[4];
        for (int p = 0; p < NP; p++) {
            sc[p] = load_scales(BITS, at[p].scales + b * at[p].block_stride);
            q[p] = at[p].q + b * at[p].block_stride;
        }
        const float *xb = x + b * BLOCK * MR;
        for (int l = 0; l < block_lines(BITS); l++) {
            const float *xk = xb + l * (BLOCK / block_lines(BITS)) * MR;
            if (ahead) {  // the DRAM stream, a few blocks ahead: a cache line holds a line of each of a
                          // group's panels, and a tile's panels span at most two groups
                const place_t *last = at + NP - 1;
                _mm_prefetch((const char *)(q[0] + l * at->line_stride + ahead * at->block_stride),
                             _MM_HINT_T0);
                if (NP > 1)
                    _mm_prefetch((const char *)(q[NP - 1] + l * last->line_stride + ahead * last->block_stride),
                                 _MM_HINT_T0);
            }
            for (int p = 0; p < NP; p++) {
                col16 w0, w1;
                widen(BITS, sc[p], q[p] + l * at[p].line_stride, &w0, &w1);
                for (int i = 0; i < MR; i++)
                    c[i][p] = fma16(xk[i], w0, c[i][p]);
                if (BITS == 4)
                    for (int i = 0; i < MR; i++)
                        c[i][p] = fma16(xk[MR + i], w1, c[i][p]);
            }
        }
    }
    for (int p = 0; p < NP; p++)
        for (int i = 0; i < MR; i++)
            store16(y + i * ldy + p * NR, nv - p * NR, c[i][p]);
}

// `mr` rows by `np` panels (np <= tile_panels(mr)): 1 or 2 panels, and with AVX-512 3 or 4 for 1-2 rows.
#define NARROW(MR, BITS, ...)                                                       \
    if (np > 1) tile(MR, 2, BITS, __VA_ARGS__);                                     \
    else tile(MR, 1, BITS, __VA_ARGS__);
#if defined(__AVX512F__)
#define WIDE(MR, BITS, ...)                                                         \
    if (np == 4) tile(MR, 4, BITS, __VA_ARGS__);                                    \
    else if (np == 3) tile(MR, 3, BITS, __VA_ARGS__);                               \
    else NARROW(MR, BITS, __VA_ARGS__)
#else
#define WIDE NARROW
#endif
#define BY_ROWS(BITS, ...)                                                          \
    switch (mr) {                                                                   \
    case 5: NARROW(5, BITS, __VA_ARGS__) break;                                     \
    case 4: NARROW(4, BITS, __VA_ARGS__) break;                                     \
    case 3: NARROW(3, BITS, __VA_ARGS__) break;                                     \
    case 2: WIDE(2, BITS, __VA_ARGS__) break;                                       \
    default: WIDE(1, BITS, __VA_ARGS__) break;                                      \
    }

static void tile_rows(int mr, int np, int bits, int64_t K, const float *x, const place_t *at, const float *bias,
                      float *y, int64_t ldy, int nv, int64_t ahead) {
    if (bits == 4) {
        BY_ROWS(4, K, x, at, bias, y, ldy, nv, ahead)
    } else {
        BY_ROWS(8, K, x, at, bias, y, ldy, nv, ahead)
    }
}

// The most rows for which these tiles are used instead of gemm.c's over float32 panels: past 5 rows a second
// row block widens the weights again. SmolLM2's 30 layers of projections from DRAM (`pdserve bench kernels
// --layers 30`), blocks against float32 panels. AVX2 Zen 3, Q4_1, two threads / one: 1 row 2.1-2.7x /
// 2.2-2.5x, 5 rows 1.5-1.9x / 1.5x, 6-10 rows 1.1-1.2x / 0.96-1.03x, 12 rows 0.88x on two; so 8 rows on two
// threads (they share the DRAM stream), 5 on one. AVX-512 Zen 5, two threads: Q4_1 12 rows 1.63x, 16 rows
// 1.04-1.07x, 20 rows 0.96x; Q8_0 12 rows 1.45x, 16 rows 0.91x; one thread: 12 rows 1.49x / 1.36x; so 12.
#if defined(__AVX512F__)
int packed_gemm_blocks_rows(void) { return 12; }
#else
int packed_gemm_blocks_rows(void) { return omp_get_max_threads() > 1 ? 8 : MR_MAX; }
#endif

// y[M, N] = x[M, K] @ W^T (+ bias), W as blocks of `bits` 4 or 8; x rows at x + m * ldx, y rows at
// y + m * ldy. Each thread takes an even share of the panels and walks it in tiles of as even widths as
// fit (18 panels of 4-panel tiles: 4 + 4 + 4 + 3 + 3), each tile over every row block in turn.
// Returns 0, -1 when the buffer of packed rows cannot grow, -2 for bad bits or a K that is not a multiple
// of 32.
int packed_gemm_blocks(const float *x, int64_t ldx, const uint8_t *wb, int64_t bits, const float *bias, float *y,
                       int64_t ldy, int64_t M, int64_t N, int64_t K) {
    if ((bits != 4 && bits != 8) || K % BLOCK)
        return -2;
    if (M <= 0 || N <= 0)
        return 0;
    const int64_t panels = (N + NR - 1) / NR, nb = K / BLOCK, blocks = gemm_row_blocks(M, MR_MAX);
    const int width = tile_panels(M < MR_MAX ? M : MR_MAX);  // every row block has at least min(M, 3) rows
    const float *xp = gemm_pack_rows(x, ldx, M, K, MR_MAX);
    if (!xp)
        return -1;
#pragma omp parallel if (M * N * K >= 32768)
    {
        const int64_t t = omp_get_thread_num(), threads = omp_get_num_threads();
        const int64_t p0 = panels * t / threads, share = panels * (t + 1) / threads - p0;
        const int64_t tiles = (share + width - 1) / width;
        for (int64_t e = 0; e < tiles; e++) {
            const int64_t a = p0 + share * e / tiles;
            const int np = (int)(p0 + share * (e + 1) / tiles - a);
            const int nv = N - a * NR < np * NR ? (int)(N - a * NR) : np * NR;
            place_t at[4];
            for (int i = 0; i < np; i++)
                at[i] = place(wb, bits, panels, nb, a + i);
            for (int64_t j = 0; j < blocks; j++) {
                const int64_t m = gemm_block_start(M, j, MR_MAX);
                const int mr = (int)(gemm_block_start(M, j + 1, MR_MAX) - m);
                tile_rows(mr, np, (int)bits, K, xp + m * K, at, bias ? bias + a * NR : 0, y + m * ldy + a * NR,
                          ldy, nv, j == 0 ? AHEAD : 0);
            }
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
