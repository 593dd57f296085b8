// Matrix product of int8 activations and int8 weights (`--quantization w8a8_int8`; CPU, AVX2). Built and
// loaded by common/layers/native.py; common/layers/linear.py packs the weights.
//
// y[m, n] = ws[n] * sum_g xs[m, g] * (sum_{k in g} xq[m, k] * wq[n, k]) + bias[n]. The weights and their
// per-output-channel scales `ws` are quantized at load (symmetric, within [-127, 127]); each row of x is
// quantized here on the way in, per token and per block of SG = 64 input channels g (xs = max|x| / 127
// over the block, xq = round(x / xs)): a channel with outliers then coarsens only its own block (one
// scale per token costs SmolLM2 2-3 % of perplexity, one per 64 channels 0.8 %, as weight-only int8 does;
// `pdserve bench quant`). Each block's products are summed exactly in int32, converted to float32 once and
// scaled; the blocks are added in order and the weight scale and bias applied last, so a row gets the
// same bits whatever the batch.
//
// Two builds, one result (the sums are exact integers, scaled by the same float32 operations):
// * AVX2: `_mm256_madd_epi16`, the widest exact integer multiply-add without VNNI: 16 int16 products
//   summed in pairs into 8 int32 lanes, twice the multiply-adds of a float32 FMA. Panel p holds output
//   columns 16p..16p+15 as [KP / 2][16][2] int8 (GROUP 2; KP = K rounded up to whole blocks, padded with
//   zeros): each 32-byte line is two steps of k for 16 columns, widened to int16 as it is loaded; the
//   activations are widened once, when quantized, and a pair is broadcast to every lane. Tiles of up to
//   6 rows x 16 columns (two int32 accumulators a row). Each row's step (DOT: broadcast, two madds, two
//   adds) is written as one asm statement, and the tile's masks, bias and scales are set up only after
//   the walk over k: left to itself, GCC 12 kept fewer than the 12 accumulators in registers, and those
//   it moved to the stack chained every step of k through a store and a reload.
//   (`_mm256_maddubs_epi16` does 32 byte products per instruction but saturates at int16: exact only with
//   the sign of x moved onto w, one more multiply-port instruction a row and step, and its int16 sums
//   still need a madd with ones to reach int32, so it issues no fewer multiply-port instructions per
//   product than madd_epi16 on widened operands.)
// * AVX-512 VNNI: `_mm512_dpbusd_epi32`, 64 byte products summed in fours into 16 int32 lanes in one
//   instruction (four float32 zmm FMAs' worth). Panels are [KP / 4][16][4] (GROUP 4): one 64-byte line is
//   four steps of k for 16 columns. dpbusd multiplies unsigned by signed bytes, so activations are stored
//   as xq + 128 and each block subtracts 128 * sum_k w, itself a dpbusd of 128s against the same lines.
//   Tiles of up to 12 rows x 16 columns (one accumulator a row).
// As in gemm.c, the rows are split into blocks of heights that differ by at most one (a short tile has
// too few accumulators), and each row block is quantized k-major (`quantize_rows`: group u of k of row i
// at (u * mr + i) * GROUP), so a tile's broadcasts sit at fixed offsets from one pointer walking k. The
// quantization (eight floats at a time: max|x|, then x * (127 / max|x|) rounded by cvtps2dq, as lrintf
// rounds) and the matmul share one parallel region: the threads split the row blocks, then each owns a
// run of panels and walks each with one tile after another, so every weight is read from memory once per
// matmul, and a tile with later row blocks prefetches its share of the next panel, a few lines after each
// block of k (no per-step counter in the walk). A decode step streams a quarter of float32's bytes (as
// int8wo does); a prefill or a large batch, bound by arithmetic, does its multiply-adds at up to twice
// (AVX2) or four times (VNNI) float32's rate per instruction. `packed_gemm_w8a8_group()` and `_block()`
// say which layout this build reads.
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define SG 64  // input channels per activation scale (a multiple of every GROUP)

void *gemm_scratch(int slot, size_t bytes);                     // gemm.c
int64_t gemm_row_blocks(int64_t M, int64_t mr_max);             // gemm.c: blocks of heights that differ by
int64_t gemm_block_start(int64_t M, int64_t j, int64_t mr_max); // at most one, and where block j starts

#if defined(__AVX2__)
#include <immintrin.h>

#define NR 16
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define VNNI 1
#define GROUP 4
#define MR_MAX 12
typedef uint8_t ACT;
#define ACT_ZERO 128
#else
#define VNNI 0
#define GROUP 2
#define MR_MAX 6
typedef int16_t ACT;
#define ACT_ZERO 0
#endif
#define UNITS (SG / GROUP)  // groups of k (4 bytes of ACT each) per block

// One block of SG channels of one row, r[0 .. n) (n <= SG; the rest is zero), into SG ACT at q (xq, or
// xq + 128 with VNNI; xq in [-127, 127], ACT_ZERO past n); returns its scale, NaN when the block holds a
// NaN or an infinity (the row's outputs are then NaN, as float32's would be). Eight floats at a time:
// max|x| is exact in any order, and x * (127 / amax) is rounded to nearest-even by cvtps2dq as by lrintf.
static float quantize_block(const float *r, int64_t n, ACT *q) {
    __m256 v[SG / 8];
    const __m256 sign = _mm256_set1_ps(-0.f), big = _mm256_set1_ps(FLT_MAX);
    __m256 amax8 = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
    for (int c = 0; c < SG / 8; c++) {
        const int64_t left = n - 8 * c;
        if (left >= 8)
            v[c] = _mm256_loadu_ps(r + 8 * c);
        else if (left > 0)
            v[c] = _mm256_maskload_ps(r + 8 * c, _mm256_cmpgt_epi32(_mm256_set1_epi32((int)left),
                                                                     _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
        else
            v[c] = _mm256_setzero_ps();
        const __m256 a = _mm256_andnot_ps(sign, v[c]);
        amax8 = _mm256_max_ps(amax8, a);
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, big, _CMP_NLE_UQ));  // infinite or NaN
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    const float amax = _mm_cvtss_f32(m4);
    const int poison = _mm256_movemask_ps(bad) != 0;
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    if (!(inv <= FLT_MAX)) {  // amax below 127 / FLT_MAX (or NaN): lrintf's own answer for x * inf
        for (int64_t k = 0; k < SG; k++)
            q[k] = k < n ? (ACT)(lrintf(r[k] * inv) + ACT_ZERO) : ACT_ZERO;
    } else {
        const __m256 s = _mm256_set1_ps(inv);
        __m256i w[SG / 8];
        for (int c = 0; c < SG / 8; c++)
            w[c] = _mm256_cvtps_epi32(_mm256_mul_ps(v[c], s));
#if VNNI
        const __m256i zero_point = _mm256_set1_epi16(ACT_ZERO), order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        for (int c = 0; c < SG / 32; c++) {
            const __m256i lo = _mm256_add_epi16(_mm256_packs_epi32(w[4 * c], w[4 * c + 1]), zero_point);
            const __m256i hi = _mm256_add_epi16(_mm256_packs_epi32(w[4 * c + 2], w[4 * c + 3]), zero_point);
            _mm256_storeu_si256((__m256i *)(q + 32 * c),
                                _mm256_permutevar8x32_epi32(_mm256_packus_epi16(lo, hi), order));
        }
#else
        for (int c = 0; c < SG / 16; c++)
            _mm256_storeu_si256((__m256i *)(q + 16 * c),
                                _mm256_permute4x64_epi64(_mm256_packs_epi32(w[2 * c], w[2 * c + 1]), 0xD8));
#endif
    }
    return poison ? NAN : amax / 127.f;
}

// Rows m0 .. m0 + mr of x, one row block, as its tiles read them: group u of k (4 bytes of ACT) of row i at
// xq + (u * mr + i) * GROUP, so a tile's broadcasts sit at fixed offsets from one pointer walking k; the
// scale of row i's block b at xs[i * nb + b].
static void quantize_rows(const float *x, int64_t ldx, int64_t mr, int64_t K, int64_t KP, ACT *xq, float *xs) {
    const int64_t nb = KP / SG;
    ACT q[SG] __attribute__((aligned(32)));
    for (int64_t i = 0; i < mr; i++)
        for (int64_t b = 0; b < nb; b++) {
            const int64_t k0 = b * SG;
            xs[i * nb + b] = quantize_block(x + i * ldx + k0, K - k0 < SG ? K - k0 : SG, q);
            uint32_t *dst = (uint32_t *)(xq + b * SG * mr) + i;
            for (int u = 0; u < UNITS; u++)
                memcpy(dst + u * mr, q + GROUP * u, 4);
        }
}

static inline int32_t load_group(const ACT *p) {  // GROUP activations (4 bytes) for a broadcast
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

// Every tile keeps its running float32 sums over the blocks in `acc` (MR x 16, in L1), folds each
// block's integer sums into it (FOLD), and stores acc * ws + bias (STORE). DOT(i): row i's step j.
#if VNNI
#define ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#define DECLARE(i) __m512i c##i = _mm512_setzero_si512();
#define DOT(i) \
    if (MR > i) c##i = _mm512_dpbusd_epi32(c##i, _mm512_set1_epi32(load_group(xb + (j * MR + (i)) * GROUP)), w8);
#define FOLD(i)                                                                                         \
    if (MR > i) {                                                                                       \
        const __m512 sum = _mm512_cvtepi32_ps(_mm512_sub_epi32(c##i, comp));                           \
        _mm512_store_ps(acc + (i) * NR,                                                                 \
                        _mm512_fmadd_ps(sum, _mm512_set1_ps(xs[(i) * nb + b]), _mm512_load_ps(acc + (i) * NR))); \
    }
#define STORE(i) \
    if (MR > i) _mm512_mask_storeu_ps(y + (i) * ldy, m, _mm512_fmadd_ps(_mm512_load_ps(acc + (i) * NR), s, init));

#define LOOP_SETUP const __m512i zero_point = _mm512_set1_epi8((char)ACT_ZERO);
#define STORE_SETUP                                                                 \
    const __mmask16 m = nv >= NR ? (__mmask16)0xFFFF : (__mmask16)((1u << nv) - 1);   \
    const __m512 init = bias ? _mm512_maskz_loadu_ps(m, bias) : _mm512_setzero_ps(); \
    const __m512 s = _mm512_loadu_ps(ws);
// comp: 128 * sum_k w per column over the block, what the offset activations add
#define BLOCK_START __m512i comp = _mm512_setzero_si512();
#define LOAD_LINE                                                                   \
    const __m512i w8 = _mm512_loadu_si512((const void *)(wb + j * GROUP * NR));       \
    comp = _mm512_dpbusd_epi32(comp, zero_point, w8);

#define BY_HEIGHT(mr, ...)                           \
    switch (mr) {                                    \
    case 12: tile(12, __VA_ARGS__); break;           \
    case 11: tile(11, __VA_ARGS__); break;           \
    case 10: tile(10, __VA_ARGS__); break;           \
    case 9: tile(9, __VA_ARGS__); break;             \
    case 8: tile(8, __VA_ARGS__); break;             \
    case 7: tile(7, __VA_ARGS__); break;             \
    LOW_HEIGHTS(__VA_ARGS__)                         \
    }

#else
#define ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)
#define DECLARE(i) __m256i c##i##a = _mm256_setzero_si256(), c##i##b = _mm256_setzero_si256();
#define DOT(i)                                                                                \
    if (MR > i) {                                                                             \
        __m256i t0, t1;                                                                       \
        __asm__("vpbroadcastd %4, %3\n\t"                                                     \
                "vpmaddwd %5, %3, %2\n\t"                                                     \
                "vpmaddwd %6, %3, %3\n\t"                                                     \
                "vpaddd %2, %0, %0\n\t"                                                       \
                "vpaddd %3, %1, %1"                                                           \
                : "+x"(c##i##a), "+x"(c##i##b), "=&x"(t0), "=&x"(t1)                          \
                : "m"(*(const int32_t *)(xb + (j * MR + (i)) * GROUP)), "x"(b0), "x"(b1));    \
    }
#define FOLD(i)                                                                                              \
    if (MR > i) {                                                                                            \
        const __m256 r = _mm256_set1_ps(xs[(i) * nb + b]);                                                   \
        float *t = acc + (i) * NR;                                                                           \
        _mm256_store_ps(t, _mm256_fmadd_ps(_mm256_cvtepi32_ps(c##i##a), r, _mm256_load_ps(t)));              \
        _mm256_store_ps(t + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(c##i##b), r, _mm256_load_ps(t + 8)));      \
    }
#define STORE(i)                                                                                             \
    if (MR > i) {                                                                                            \
        const float *t = acc + (i) * NR;                                                                     \
        _mm256_maskstore_ps(y + (i) * ldy, m0, _mm256_fmadd_ps(_mm256_load_ps(t), s0, init0));               \
        _mm256_maskstore_ps(y + (i) * ldy + 8, m1, _mm256_fmadd_ps(_mm256_load_ps(t + 8), s1, init1));       \
    }

#define LOOP_SETUP
#define STORE_SETUP                                                                 \
    const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);                  \
    const __m256i m0 = _mm256_cmpgt_epi32(_mm256_set1_epi32(nv), iota);              \
    const __m256i m1 = _mm256_cmpgt_epi32(_mm256_set1_epi32(nv - 8), iota);          \
    const __m256 init0 = bias ? _mm256_maskload_ps(bias, m0) : _mm256_setzero_ps();  \
    const __m256 init1 = bias ? _mm256_maskload_ps(bias + 8, m1) : _mm256_setzero_ps(); \
    const __m256 s0 = _mm256_loadu_ps(ws), s1 = _mm256_loadu_ps(ws + 8);
#define BLOCK_START
#define LOAD_LINE                                                                   \
    const __m256i b0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wb + j * GROUP * NR)));      \
    const __m256i b1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wb + j * GROUP * NR + 16)));

#define BY_HEIGHT(mr, ...)                           \
    switch (mr) {                                    \
    LOW_HEIGHTS(__VA_ARGS__)                         \
    }
#endif

// One MR x 16 tile over the whole K: a row block of xq (quantize_rows' layout; KP each) against one
// panel; `nv` of the 16 columns are stored. After each block of k it prefetches `per` of the `owed`
// lines at `pf` (NULL: none) and the rest at the end, so the walk over k carries no per-step counter.
// Each build supplies LOOP_SETUP, BLOCK_START and LOAD_LINE (the weight line of step j) for the walk and
// STORE_SETUP (masks, bias, scales) for the store.
static inline __attribute__((always_inline)) void tile(const int MR, int64_t KP, const ACT *xq, const float *xs,
                                                       const int8_t *w, const float *ws, const float *bias, float *y,
                                                       int64_t ldy, int nv, const char *pf, int64_t owed) {
    const int64_t nb = KP / SG, per = pf ? (owed + nb - 1) / nb : 0;
    LOOP_SETUP
    float acc[MR_MAX * NR] __attribute__((aligned(64))) = {0};
    for (int64_t b = 0; b < nb; b++) {
        const ACT *xb = xq + b * SG * MR;  // the block's activations and weights
        const int8_t *wb = w + b * SG * NR;
        BLOCK_START
        ROWS(DECLARE)
#pragma GCC unroll 8
        for (int j = 0; j < UNITS; j++) {
            LOAD_LINE
            ROWS(DOT)
        }
        ROWS(FOLD)
        for (int64_t r = 0; r < per && owed > 0; r++, owed--) {
            _mm_prefetch(pf, _MM_HINT_T1);
            pf += 64;
        }
    }
    STORE_SETUP  // (here, not live over the walk: GCC then keeps every accumulator in a register)
    ROWS(STORE)
}

#define LOW_HEIGHTS(...)                             \
    case 6: tile(6, __VA_ARGS__); break;             \
    case 5: tile(5, __VA_ARGS__); break;             \
    case 4: tile(4, __VA_ARGS__); break;             \
    case 3: tile(3, __VA_ARGS__); break;             \
    case 2: tile(2, __VA_ARGS__); break;             \
    default: tile(1, __VA_ARGS__); break;

static void tile_rows(int mr, int64_t KP, const ACT *xq, const float *xs, const int8_t *w, const float *ws,
                      const float *bias, float *y, int64_t ldy, int nv, const char *pf, int64_t owed) {
    BY_HEIGHT(mr, KP, xq, xs, w, ws, bias, y, ldy, nv, pf, owed)
}

int packed_gemm_w8a8_group(void) { return GROUP; }
int packed_gemm_w8a8_block(void) { return SG; }

// x rows at x + m * ldx, y rows at y + m * ldy; wq: the panels above (this build's GROUP, K padded to whole
// blocks of SG); scale: one float per output column, padded to whole panels; bias may be NULL. Returns 0,
// or -1 when the activations' scratch cannot grow.
int packed_gemm_w8a8(const float *x, int64_t ldx, const int8_t *wq, const float *scale, const float *bias, float *y,
                     int64_t ldy, int64_t M, int64_t N, int64_t K) {
    if (M <= 0 || N <= 0)
        return 0;
    const int64_t KP = (K + SG - 1) / SG * SG, nb = KP / SG;
    // the scales first (float-aligned), then the quantized rows, in gemm.c's per-thread scratch
    float *xs = gemm_scratch(1, sizeof(float) * (size_t)(M * nb) + sizeof(ACT) * (size_t)(M * KP));
    if (!xs)
        return -1;
    ACT *xq = (ACT *)(xs + M * nb);
    const int64_t panels = (N + NR - 1) / NR;
    const int64_t blocks = gemm_row_blocks(M, MR_MAX);
    const int64_t panel_bytes = KP * NR;
    const int64_t lines = (panel_bytes + 63) / 64;
    // One parallel region: the row blocks are quantized (split between the threads), then each thread
    // walks its run of panels.
#pragma omp parallel if (M * N * K >= 32768)
    {
#pragma omp for schedule(static)
        for (int64_t j = 0; j < blocks; j++) {
            const int64_t m = gemm_block_start(M, j, MR_MAX);
            quantize_rows(x + m * ldx, ldx, gemm_block_start(M, j + 1, MR_MAX) - m, K, KP, xq + m * KP, xs + m * nb);
        }
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            const int nv = N - p * NR < NR ? (int)(N - p * NR) : NR;
            const int8_t *wp = wq + p * panel_bytes;
            const float *b = bias ? bias + p * NR : 0;
            for (int64_t j = 0; j < blocks; j++) {
                const int64_t m = gemm_block_start(M, j, MR_MAX);
                const int mr = (int)(gemm_block_start(M, j + 1, MR_MAX) - m);
                // block j prefetches lines [j lines / blocks, (j + 1) lines / blocks) of the next panel
                const int64_t first = lines * j / blocks, owed = lines * (j + 1) / blocks - first;
                const char *pf = blocks > 1 && p + 1 < panels ? (const char *)wp + panel_bytes + first * 64 : 0;
                tile_rows(mr, KP, xq + m * KP, xs + m * nb, wp, scale + p * NR, b, y + m * ldy + p * NR, ldy, nv, pf,
                          owed);
            }
        }
    }
    return 0;
}

#else
// Without AVX2 linear.py refuses w8a8_int8 (packed_gemm_supported() is 0 in gemm.c).
int packed_gemm_w8a8_group(void) { return 0; }
int packed_gemm_w8a8_block(void) { return SG; }
int packed_gemm_w8a8(const float *x, int64_t ldx, const int8_t *wq, const float *scale, const float *bias, float *y,
                     int64_t ldy, int64_t M, int64_t N, int64_t K) {
    return -1;
}
#endif
