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
//   6 rows x 16 columns (two int32 accumulators a row). Each add into an accumulator is written as an
//   instruction of its own (DOT): left to itself, GCC 12 kept fewer than the 12 accumulators in
//   registers, and those it moved to the stack chained every step of k through a store and a reload,
//   so the tile ran at 0.75-0.9x float32's rate instead of 1.0-1.4x.
// * AVX-512 VNNI: `_mm512_dpbusd_epi32`, 64 byte products summed in fours into 16 int32 lanes in one
//   instruction (four float32 zmm FMAs' worth). Panels are [KP / 4][16][4] (GROUP 4): one 64-byte line is
//   four steps of k for 16 columns. dpbusd multiplies unsigned by signed bytes, so activations are stored
//   as xq + 128 and each block subtracts 128 * sum_k w, itself a dpbusd of 128s against the same lines.
//   Tiles of up to 12 rows x 16 columns (one accumulator a row).
// As in gemm.c, one thread owns a run of panels and walks each with one tile after another, so every
// weight is read from memory once per matmul, and a tile with later row blocks prefetches its share of the
// next panel. A decode step streams a quarter of float32's bytes (as int8wo does); a prefill or a large
// batch, bound by arithmetic, does its multiply-adds at up to twice (AVX2) or four times (VNNI) float32's
// rate per instruction. `packed_gemm_w8a8_group()` and `_block()` say which layout this build reads.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define SG 64  // input channels per activation scale (a multiple of every GROUP)

void *gemm_scratch(int slot, size_t bytes);  // gemm.c

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

// Row m of x into xq[m * KP ..] as ACT (int16 xq, or uint8 xq + 128 with VNNI; xq in [-127, 127]) and its
// block scales into xs[m * nb ..]. A block holding a NaN or an infinity gets scale NaN, so the row's
// outputs are NaN as float32's would be.
static void quantize_rows(const float *x, int64_t ldx, int64_t M, int64_t K, int64_t KP, ACT *xq, float *xs) {
    const int64_t nb = KP / SG;
#pragma omp parallel for schedule(static) if (M * K >= 65536)
    for (int64_t m = 0; m < M; m++) {
        const float *r = x + m * ldx;
        ACT *q = xq + m * KP;
        for (int64_t b = 0; b < nb; b++) {
            const int64_t k0 = b * SG, k1 = k0 + SG < K ? k0 + SG : K;
            float amax = 0.f, poison = 0.f;  // poison: 0 unless some r[k] * 0 is NaN (r[k] NaN or infinite)
            for (int64_t k = k0; k < k1; k++) {
                const float a = fabsf(r[k]);
                amax = a > amax ? a : amax;
                poison += r[k] * 0.f;
            }
            const float inv = amax > 0.f ? 127.f / amax : 0.f;
            for (int64_t k = k0; k < k1; k++)
                q[k] = (ACT)(lrintf(r[k] * inv) + ACT_ZERO);
            for (int64_t k = k1 > k0 ? k1 : k0; k < k0 + SG; k++)
                q[k] = ACT_ZERO;  // against zero weights
            xs[m * nb + b] = isnan(poison) ? NAN : amax / 127.f;
        }
    }
}

static inline int32_t load_group(const ACT *p) {  // GROUP activations (4 bytes) for a broadcast
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

// Every `every` steps of the walk over k, the next line at `pf` (if not NULL) is prefetched.
#define PREFETCH_STEP                   \
    if (pf && --cnt == 0) {             \
        _mm_prefetch(pf, _MM_HINT_T1);  \
        pf += 64;                       \
        cnt = every;                    \
    }

// Every tile keeps its running float32 sums over the blocks in `acc` (MR x 16, in L1), folds each
// block's integer sums into it (FOLD), and stores acc * ws + bias (STORE).
#if VNNI
#define ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#define DECLARE(i) __m512i c##i = _mm512_setzero_si512();
#define DOT(i) \
    if (MR > i) c##i = _mm512_dpbusd_epi32(c##i, _mm512_set1_epi32(load_group(xq + (i) * KP + GROUP * j)), w8);
#define FOLD(i)                                                                                         \
    if (MR > i) {                                                                                       \
        const __m512 sum = _mm512_cvtepi32_ps(_mm512_sub_epi32(c##i, comp));                           \
        _mm512_store_ps(acc + (i) * NR,                                                                 \
                        _mm512_fmadd_ps(sum, _mm512_set1_ps(xs[(i) * nb + b]), _mm512_load_ps(acc + (i) * NR))); \
    }
#define STORE(i) \
    if (MR > i) _mm512_mask_storeu_ps(y + (i) * ldy, m, _mm512_fmadd_ps(_mm512_load_ps(acc + (i) * NR), s, init));

#define TILE_SETUP                                                                  \
    const __mmask16 m = nv >= NR ? (__mmask16)0xFFFF : (__mmask16)((1u << nv) - 1);   \
    const __m512 init = bias ? _mm512_maskz_loadu_ps(m, bias) : _mm512_setzero_ps(); \
    const __m512 s = _mm512_loadu_ps(ws);                                             \
    const __m512i zero_point = _mm512_set1_epi8((char)ACT_ZERO);
// comp: 128 * sum_k w per column over the block, what the offset activations add
#define BLOCK_START __m512i comp = _mm512_setzero_si512();
#define LOAD_LINE                                                                   \
    const __m512i w8 = _mm512_loadu_si512((const void *)(w + j * GROUP * NR));       \
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
#define DOT(i)                                                                      \
    if (MR > i) {                                                                   \
        const __m256i a = _mm256_set1_epi32(load_group(xq + (i) * KP + GROUP * j)); \
        const __m256i t0 = _mm256_madd_epi16(a, b0), t1 = _mm256_madd_epi16(a, b1); \
        __asm__("vpaddd %2, %0, %0\n\tvpaddd %3, %1, %1" : "+x"(c##i##a), "+x"(c##i##b) : "x"(t0), "x"(t1)); \
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

#define TILE_SETUP                                                                  \
    const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);                  \
    const __m256i m0 = _mm256_cmpgt_epi32(_mm256_set1_epi32(nv), iota);              \
    const __m256i m1 = _mm256_cmpgt_epi32(_mm256_set1_epi32(nv - 8), iota);          \
    const __m256 init0 = bias ? _mm256_maskload_ps(bias, m0) : _mm256_setzero_ps();  \
    const __m256 init1 = bias ? _mm256_maskload_ps(bias + 8, m1) : _mm256_setzero_ps(); \
    const __m256 s0 = _mm256_loadu_ps(ws), s1 = _mm256_loadu_ps(ws + 8);
#define BLOCK_START
#define LOAD_LINE                                                                   \
    const __m256i b0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + j * GROUP * NR)));      \
    const __m256i b1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + j * GROUP * NR + 16)));

#define BY_HEIGHT(mr, ...)                           \
    switch (mr) {                                    \
    LOW_HEIGHTS(__VA_ARGS__)                         \
    }
#endif

// One MR x 16 tile over the whole K: rows of xq (KP each) against one panel; `nv` of the 16 columns are
// stored. Every `every` groups of k the next line at `pf` (if not NULL) is prefetched. Each build
// supplies TILE_SETUP (masks, bias, scales), BLOCK_START and LOAD_LINE (the weight line of step j).
static inline __attribute__((always_inline)) void tile(const int MR, int64_t KP, const ACT *xq, const float *xs,
                                                       const int8_t *w, const float *ws, const float *bias, float *y,
                                                       int64_t ldy, int nv, const char *pf, int64_t every) {
    const int64_t nb = KP / SG;
    TILE_SETUP
    float acc[MR_MAX * NR] __attribute__((aligned(64))) = {0};
    int64_t cnt = every;
    for (int64_t b = 0; b < nb; b++) {
        BLOCK_START
        ROWS(DECLARE)
#pragma GCC unroll 4
        for (int64_t j = b * (SG / GROUP); j < (b + 1) * (SG / GROUP); j++) {
            LOAD_LINE
            ROWS(DOT)
            PREFETCH_STEP
        }
        ROWS(FOLD)
    }
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
                      const float *bias, float *y, int64_t ldy, int nv, const char *pf, int64_t every) {
    BY_HEIGHT(mr, KP, xq, xs, w, ws, bias, y, ldy, nv, pf, every)
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
    quantize_rows(x, ldx, M, K, KP, xq, xs);
    const int64_t panels = (N + NR - 1) / NR;
    const int64_t blocks = (M + MR_MAX - 1) / MR_MAX;
    const int64_t panel_bytes = KP * NR;
    const int64_t lines = (panel_bytes + 63) / 64;
    const int64_t every = blocks > 1 ? (KP / GROUP * blocks + lines - 1) / lines : 1;
#pragma omp parallel for schedule(static) if (M * N * K >= 32768)
    for (int64_t p = 0; p < panels; p++) {
        const int nv = N - p * NR < NR ? (int)(N - p * NR) : NR;
        const int8_t *wp = wq + p * panel_bytes;
        const float *b = bias ? bias + p * NR : 0;
        for (int64_t j = 0; j < blocks; j++) {
            const int64_t m = j * MR_MAX;
            const int mr = M - m < MR_MAX ? (int)(M - m) : MR_MAX;
            const char *pf = blocks > 1 && p + 1 < panels ? (const char *)wp + panel_bytes + (lines * j / blocks) * 64
                                                          : 0;
            tile_rows(mr, KP, xq + m * KP, xs + m * nb, wp, scale + p * NR, b, y + m * ldy + p * NR, ldy, nv, pf,
                      every);
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
