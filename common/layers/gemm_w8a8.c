// Matrix product of int8 activations and int8 weights (`--quantization w8a8_int8`; CPU, AVX2). Built and
// loaded by common/layers/native.py; common/layers/linear.py packs the weights.
//
// y[m, n] = ws[n] * sum_g xs[m, g] * (sum_{k in g} xq[m, k] * wq[n, k]) + bias[n]. The weights and their
// per-output-channel scales `ws` are quantized at load, symmetric, within [-64, 64] (ws = max|w| / 64; why
// not [-127, 127] below); each row of x is quantized here on the way in, per token and per block of SG = 64
// input channels g (xs = max|x| / 127 over the block, xq = round(x / xs) in [-127, 127]): a channel with
// outliers then coarsens only its own block (one scale per token costs SmolLM2 2-3 % of perplexity, one per
// 64 channels under 1 %; `pdserve bench quant`). Each block's products are summed exactly in int32,
// converted to float32 once and scaled; the blocks are added in order and the weight scale and bias
// applied last, so a row gets the same bits whatever the batch.
//
// The activations are stored as unsigned bytes xq + 128, the form both builds' byte multiply-adds take
// (unsigned times signed), and each block's int32 sums start from -128 * sum_{k in g} wq[n, k], which the
// packing computed once for AVX2 (`comp`), so they end at the products of xq alone. Panel p holds
// output columns 16p..16p+15, K rounded up to KP, whole blocks padded with zeros, as KP / SG blocks of
// BLOCK_BYTES: with AVX2 the block's comp line (16 int32), then its [SG / 4][16][4] int8 weights (a
// 64-byte line is four steps of k for 16 columns). The VNNI build reads the same weights without the
// comp lines: its dpbusd sums them against 128s in one instruction a step, and a decode step, bound by
// reading the weights, then reads 6 % fewer bytes (a build's layout: `packed_gemm_w8a8_comp_lines()`).
// The comp line leads its weights in the one stream a tile reads: kept apart at the end of the panel it
// cost a decode step (one row, weights from DRAM) a miss per block, 1.4x the time of the whole matmul.
// * AVX2: `_mm256_maddubs_epi16` multiplies 32 unsigned bytes by 32 signed ones and sums adjacent pairs
//   into int16, saturating; `_mm256_madd_epi16` with ones sums those pairs into int32 lanes. A pair is at
//   most 2 * 255 * 64 = 32640 in magnitude, so with weights within [-64, 64] nothing saturates and the sums
//   are exact. That is 32 byte products for two multiply-port instructions and an add, where widening the
//   bytes to int16 for madd_epi16 alone (the previous kernel) took two madds, two adds and the widening
//   for the same 32: 1.4x the multiply-adds per cycle (an AVX-512 host built for AVX2). Moving x's sign
//   onto w instead (to keep 8-bit weights) costs one more multiply-port instruction per row and step,
//   slower than the widening. Weights of 129 levels cost SmolLM2 no measurable perplexity beside the
//   activations' rounding (`pdserve bench quant`). Tiles of up to 6 rows x 16 columns (two int32
//   accumulators a row); each row's step (broadcast, two maddubs, two madds, two adds) is one asm
//   statement and the tile's masks, bias and scales are set up only after the walk over k: left to
//   itself, GCC 12 kept fewer than the 12 accumulators in registers.
// * AVX-512 VNNI: `_mm512_dpbusd_epi32`, 64 byte products summed in fours into 16 int32 lanes in one
//   instruction, one 64-byte line a step. Tiles of up to 12 rows x 16 columns (one accumulator a row).
// As in gemm.c, the rows are split into blocks of heights that differ by at most one (a short tile has
// too few accumulators), and each row block is quantized k-major (`quantize_rows`: group u of k of row i
// at (u * mr + i) * 4), so a tile's broadcasts sit at fixed offsets from one pointer walking k. The
// quantization (eight floats at a time: max|x|, then x * (127 / max|x|) rounded by cvtps2dq, as lrintf
// rounds) and the matmul share one parallel region: the threads split the row blocks, then each owns a
// run of panels and walks each with one tile after another, so every weight is read from memory once per
// matmul, and each row block's tile prefetches its share of the next panel (a single block's, all of
// it), a few lines after each block of k (no per-step counter in the walk): from DRAM on Zen 5, 1, 2 and 4
// rows 1.11x, 1.15x and 1.37x faster than with the hardware prefetcher alone. A decode step streams a
// quarter of float32's bytes (as int8wo does); a prefill or a large batch, bound by arithmetic, does its
// multiply-adds at up to twice (AVX2) or four times (VNNI) float32's rate per instruction. `packed_gemm_w8a8_group()`,
// `_block()` and `_weight_max()` give the layout and the weights' range.
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define SG 64          // input channels per activation scale (a multiple of GROUP)
#define WEIGHT_MAX 64  // |wq| bound that keeps maddubs' pair sums exact

void *gemm_scratch(int slot, size_t bytes);                     // gemm.c
int64_t gemm_row_blocks(int64_t M, int64_t mr_max);             // gemm.c: blocks of heights that differ by
int64_t gemm_block_start(int64_t M, int64_t j, int64_t mr_max); // at most one, and where block j starts

#if defined(__AVX2__)
#include <immintrin.h>

#include "vec_math.h"

#define NR 16
#define GROUP 4       // steps of k per 4-byte group
#define ACT_ZERO 128  // stored activations are xq + 128
typedef uint8_t ACT;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define VNNI 1
#define MR_MAX 12
#define COMP_LINE 0  // dpbusd sums the block's weights against 128s itself, one instruction a step
#else
#define VNNI 0
#define MR_MAX 6
#define COMP_LINE 1  // the block's sums come packed: maddubs would need three instructions a step
#endif
#define BLOCK_BYTES (COMP_LINE * 16 * (int64_t)sizeof(int32_t) + SG * 16)  // a panel's block
#define UNITS (SG / GROUP)  // groups of k (4 bytes of ACT each) per block

// Eight groups (32 bytes of ACT) in r into dst[0], dst[stride], ... dst[7 * stride], straight from the
// register: a copy through a buffer on the stack made each 4-byte load wait on the 32-byte store before it
// (quantizing then cost ~5 cycles a channel, a tenth of a 512-row w8a8 matmul).
static inline void scatter_groups(__m256i r, uint32_t *dst, int64_t stride) {
    const __m128i lo = _mm256_castsi256_si128(r), hi = _mm256_extracti128_si256(r, 1);
    dst[0] = (uint32_t)_mm_cvtsi128_si32(lo);
    dst[stride] = (uint32_t)_mm_extract_epi32(lo, 1);
    dst[2 * stride] = (uint32_t)_mm_extract_epi32(lo, 2);
    dst[3 * stride] = (uint32_t)_mm_extract_epi32(lo, 3);
    dst[4 * stride] = (uint32_t)_mm_cvtsi128_si32(hi);
    dst[5 * stride] = (uint32_t)_mm_extract_epi32(hi, 1);
    dst[6 * stride] = (uint32_t)_mm_extract_epi32(hi, 2);
    dst[7 * stride] = (uint32_t)_mm_extract_epi32(hi, 3);
}

// One block of SG channels of one row, r[0 .. n) (n <= SG; the rest is zero), quantized (xq + 128, xq in
// [-127, 127]; 128 past n), its group u at dst[u * stride]; returns its scale, NaN
// when the block holds a NaN or an infinity (the row's outputs are then NaN, as float32's would be).
// Eight floats at a time: max|x| is exact in any order, and x * (127 / amax) is rounded to nearest-even by
// cvtps2dq as by lrintf. A NaN (or an infinity, which makes 127 / amax zero and itself NaN) converts to
// INT_MIN and saturates to byte 0, which no finite x gives (xq + 128 >= 1): one compare per 32 bytes finds
// it.
static float quantize_block(const float *r, int64_t n, uint32_t *dst, int64_t stride) {
    __m256 v[SG / 8];
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 amax8[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int c = 0; c < SG / 8; c++) {  // (two chains of max, so the next block's loads overlap sooner)
        const int64_t left = n - 8 * c;
        if (left >= 8)
            v[c] = _mm256_loadu_ps(r + 8 * c);
        else if (left > 0)
            v[c] = _mm256_maskload_ps(r + 8 * c, _mm256_cmpgt_epi32(_mm256_set1_epi32((int)left),
                                                                     _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
        else
            v[c] = _mm256_setzero_ps();
        const __m256 a = _mm256_andnot_ps(sign, v[c]);
        amax8[c & 1] = _mm256_max_ps(amax8[c & 1], a);
    }
    const __m256 amax_all = _mm256_max_ps(amax8[0], amax8[1]);
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax_all), _mm256_extractf128_ps(amax_all, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    const float amax = _mm_cvtss_f32(m4);
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    int poison = 0;
    if (!(inv <= FLT_MAX)) {  // amax below 127 / FLT_MAX (or NaN): lrintf's own answer for x * inf
        ACT q[SG];
        for (int64_t k = 0; k < SG; k++) {
            q[k] = k < n ? (ACT)(lrintf(r[k] * inv) + ACT_ZERO) : ACT_ZERO;
            poison |= k < n && !isfinite(r[k]);
        }
        for (int u = 0; u < UNITS; u++)
            memcpy(dst + u * stride, q + GROUP * u, 4);
    } else {
        const __m256 s = _mm256_set1_ps(inv);
        __m256i w[SG / 8];
        for (int c = 0; c < SG / 8; c++)
            w[c] = _mm256_cvtps_epi32(_mm256_mul_ps(v[c], s));
        const __m256i zero_point = _mm256_set1_epi16(ACT_ZERO), order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        __m256i zeros = _mm256_setzero_si256();
        for (int c = 0; c < SG / 32; c++) {
            const __m256i lo = _mm256_add_epi16(_mm256_packs_epi32(w[4 * c], w[4 * c + 1]), zero_point);
            const __m256i hi = _mm256_add_epi16(_mm256_packs_epi32(w[4 * c + 2], w[4 * c + 3]), zero_point);
            const __m256i q = _mm256_packus_epi16(lo, hi);
            zeros = _mm256_or_si256(zeros, _mm256_cmpeq_epi8(q, _mm256_setzero_si256()));
            scatter_groups(_mm256_permutevar8x32_epi32(q, order), dst + 8 * c * stride, stride);
        }
        poison = !_mm256_testz_si256(zeros, zeros);
    }
    return poison ? NAN : amax / 127.f;
}

// Rows m0 .. m0 + mr of x, one row block, as its tiles read them: group u of k (4 bytes of ACT) of row i at
// xq + (u * mr + i) * GROUP, so a tile's broadcasts sit at fixed offsets from one pointer walking k; the
// scale of row i's block b at xs[i * nb + b].
static void quantize_rows(const float *x, int64_t ldx, int64_t mr, int64_t K, int64_t KP, ACT *xq, float *xs) {
    const int64_t nb = KP / SG;
    for (int64_t i = 0; i < mr; i++)
        for (int64_t b = 0; b < nb; b++) {
            const int64_t k0 = b * SG;
            xs[i * nb + b] = quantize_block(x + i * ldx + k0, K - k0 < SG ? K - k0 : SG,
                                            (uint32_t *)(xq + b * SG * mr) + i, mr);
        }
}

static inline int32_t load_group(const ACT *p) {  // 4 activations for a broadcast
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

// Every tile keeps its running float32 sums over the blocks in `acc` (MR x 16, in L1); each block's
// integer sums start from the block's comp line (BLOCK_SETUP, DECLARE) and are folded into acc at its end
// (FOLD); the tile stores acc * ws + bias (STORE). DOT(i): row i's step j.
#if VNNI
#define ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
// (comp: 128 * sum_k w per column over the block, what the offset activations add)
#define BLOCK_SETUP __m512i k = _mm512_setzero_si512();
#define DECLARE(i) __m512i c##i = _mm512_setzero_si512();
#define DOT(i) \
    if (MR > i) c##i = _mm512_dpbusd_epi32(c##i, _mm512_set1_epi32(load_group(xb + (j * MR + (i)) * GROUP)), w8);
#define FOLD(i)                                                                                         \
    if (MR > i) {                                                                                       \
        const __m512 sum = _mm512_cvtepi32_ps(_mm512_sub_epi32(c##i, k));                              \
        _mm512_store_ps(acc + (i) * NR,                                                                 \
                        _mm512_fmadd_ps(sum, _mm512_set1_ps(xs[(i) * nb + b]), _mm512_load_ps(acc + (i) * NR))); \
    }
#define STORE(i) \
    if (MR > i) _mm512_mask_storeu_ps(y + (i) * ldy, m, _mm512_fmadd_ps(_mm512_load_ps(acc + (i) * NR), s, init));

#define STORE_SETUP                                                                 \
    const __mmask16 m = nv >= NR ? (__mmask16)0xFFFF : (__mmask16)((1u << nv) - 1);   \
    const __m512 init = bias ? _mm512_maskz_loadu_ps(m, bias) : _mm512_setzero_ps(); \
    const __m512 s = _mm512_loadu_ps(ws);
#define LOAD_LINE                                                                   \
    const __m512i w8 = _mm512_loadu_si512((const void *)(wb + j * GROUP * NR));       \
    k = _mm512_dpbusd_epi32(k, _mm512_set1_epi8((char)ACT_ZERO), w8);

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
static const int16_t ONES[16] __attribute__((aligned(32))) = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
#define ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)
#define BLOCK_SETUP \
    const __m256i k0 = _mm256_loadu_si256((const __m256i *)comp), \
                  k1 = _mm256_loadu_si256((const __m256i *)(comp + 8));
#define DECLARE(i) __m256i c##i##a = k0, c##i##b = k1;
// t1 = the row's 4 activations in every lane; t0, t1 = their pair sums with columns 0-7 and 8-15 (int16),
// widened to int32 by the madds with ones (from memory: the 12 accumulators, two lines and two temporaries
// fill the 16 registers)
#define DOT(i)                                                                                \
    if (MR > i) {                                                                             \
        __m256i t0, t1;                                                                       \
        __asm__("vpbroadcastd %4, %3\n\t"                                                     \
                "vpmaddubsw %5, %3, %2\n\t"                                                   \
                "vpmaddubsw %6, %3, %3\n\t"                                                   \
                "vpmaddwd %7, %2, %2\n\t"                                                     \
                "vpmaddwd %7, %3, %3\n\t"                                                     \
                "vpaddd %2, %0, %0\n\t"                                                       \
                "vpaddd %3, %1, %1"                                                           \
                : "+x"(c##i##a), "+x"(c##i##b), "=&x"(t0), "=&x"(t1)                          \
                : "m"(*(const int32_t *)(xb + (j * MR + (i)) * GROUP)), "x"(b0), "x"(b1),     \
                  "m"(*(const __m256i *)ONES));                                               \
    }
#define FOLD(i)                                                                                              \
    if (MR > i) {                                                                                            \
        const __m256 r = _mm256_set1_ps(xs[(i) * nb + b]);                                                   \
        float *t = acc + (i) * NR;                                                                           \
        _mm256_store_ps(t, _mm256_fmadd_ps(_mm256_cvtepi32_ps(c##i##a), r,             \
                                           _mm256_load_ps(t)));                                              \
        _mm256_store_ps(t + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(c##i##b), r,         \
                                               _mm256_load_ps(t + 8)));                                      \
    }
#define STORE(i)                                                                                             \
    if (MR > i)                                                                                              \
        store_row16(y + (i) * ldy, _mm256_fmadd_ps(_mm256_load_ps(acc + (i) * NR), s0, init0),               \
                    _mm256_fmadd_ps(_mm256_load_ps(acc + (i) * NR + 8), s1, init1), nv == NR, m0, m1);

#define STORE_SETUP                                                                 \
    const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);                  \
    const __m256i m0 = _mm256_cmpgt_epi32(_mm256_set1_epi32(nv), iota);              \
    const __m256i m1 = _mm256_cmpgt_epi32(_mm256_set1_epi32(nv - 8), iota);          \
    const __m256 init0 = bias ? _mm256_maskload_ps(bias, m0) : _mm256_setzero_ps();  \
    const __m256 init1 = bias ? _mm256_maskload_ps(bias + 8, m1) : _mm256_setzero_ps(); \
    const __m256 s0 = _mm256_loadu_ps(ws), s1 = _mm256_loadu_ps(ws + 8);
#define LOAD_LINE                                                                   \
    const __m256i b0 = _mm256_loadu_si256((const __m256i *)(wb + j * GROUP * NR));   \
    const __m256i b1 = _mm256_loadu_si256((const __m256i *)(wb + j * GROUP * NR + 32));

#define BY_HEIGHT(mr, ...)                           \
    switch (mr) {                                    \
    LOW_HEIGHTS(__VA_ARGS__)                         \
    }
#endif

// One MR x 16 tile over the whole K: a row block of xq (quantize_rows' layout; KP each) against one
// panel (blocks of BLOCK_BYTES, comp line first); `nv` of the 16 columns are stored. After each block of k it
// prefetches `per` of the `owed` lines at `pf` (NULL: none) and the rest at the end, so the walk over k
// carries no per-step counter. Each build supplies BLOCK_SETUP and DECLARE for the start of a block,
// LOAD_LINE (the weight line of step j) for the walk, FOLD for the end of a block, and STORE_SETUP
// (masks, bias, scales) for the store.
static inline __attribute__((always_inline)) void tile(const int MR, int64_t KP, const ACT *xq, const float *xs,
                                                       const int8_t *w, const float *ws, const float *bias, float *y,
                                                       int64_t ldy, int nv, const char *pf, int64_t owed) {
    const int64_t nb = KP / SG, per = pf ? (owed + nb - 1) / nb : 0;
    float acc[MR_MAX * NR] __attribute__((aligned(64))) = {0};
    for (int64_t b = 0; b < nb; b++) {
        const ACT *xb = xq + b * SG * MR;  // the block's activations and weights
        const int32_t *comp = (const int32_t *)(w + b * BLOCK_BYTES);  // (AVX2's)
        const int8_t *wb = w + b * BLOCK_BYTES + COMP_LINE * NR * (int64_t)sizeof(int32_t);
        (void)comp;
        BLOCK_SETUP
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
int packed_gemm_w8a8_weight_max(void) { return WEIGHT_MAX; }
int packed_gemm_w8a8_comp_lines(void) { return COMP_LINE; }

// x rows at x + m * ldx, y rows at y + m * ldy; wq: the panels above (K padded to whole blocks of SG, each
// block's weights led by its comp line), weights within [-WEIGHT_MAX, WEIGHT_MAX]; scale: one float per output
// column, padded to whole panels; bias may be NULL. Returns 0,
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
    const int64_t panel_bytes = nb * BLOCK_BYTES;
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
                const char *pf = p + 1 < panels ? (const char *)wp + panel_bytes + first * 64 : 0;
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
int packed_gemm_w8a8_weight_max(void) { return WEIGHT_MAX; }
int packed_gemm_w8a8_comp_lines(void) { return 0; }
int packed_gemm_w8a8(const float *x, int64_t ldx, const int8_t *wq, const float *scale, const float *bias, float *y,
                     int64_t ldy, int64_t M, int64_t N, int64_t K) {
    return -1;
}
#endif
