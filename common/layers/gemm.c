// Matrix product with a weight packed in 16-column panels (CPU, AVX2 + FMA). Built and loaded by
// common/layers/native.py; common/layers/linear.py packs the weights and falls back to oneDNN or
// F.linear without it.
//
// y[M, N] = x[M, K] @ W^T (+ bias), W given as panels: panel p holds output columns 16p..16p+15 as
// [K][16] weights (columns past N are zero). Each thread takes units (a panel; with AVX-512 two adjacent
// panels) in order from one end of a range it shares with one other thread (`claim`); for each unit a
// register tile (AVX2: 6 rows x 16 columns; AVX-512: 12 rows x 16 or
// 32 columns) walks the whole K, one row block after another, so each weight is read from memory once
// and every later row block finds the unit in L2. (Two panels per AVX-512 tile: 5-15 % faster at 512
// and 16 rows, up to 1.3x at 6, same bits.) The rows of x are first copied
// k-major per row block (`gemm_pack_rows`, into `gemm_scratch`), so a tile's broadcasts sit at fixed offsets
// from one pointer:
// read in place, each row needed its own address register, more than x86 has for a 12-row tile, and
// the spills left 512-row matmuls of SmolLM2's shapes 10-45 % slower. The copy goes to a per-thread
// buffer that grows to the largest x seen (3 MiB for a 512-token chunk of SmolLM2's MLP); a single row
// is read in place. A matmul of 2 (int8 weights: 1) to PREFETCH_ROWS - 1 rows has its tiles prefetch the
// next unit into L2 as they walk K (a unit's blocks split its lines between them): the weight stream then
// overlaps the arithmetic instead of waiting on DRAM at the start of each unit. With the weights from DRAM (SmolLM2's
// 30 layers of projections, `pdserve bench kernels --layers 30`): batch 16 ~15-20 % faster, batches of
// 4-6 rows 4-14 % faster on one or two threads. A single row of float32 gains nothing (its loop has two
// FMAs per step and the hardware prefetcher keeps up: 0.92x with prefetches on Zen 5), so it is left to the
// hardware. Int8 weights in a single row block stream a quarter of the bytes per FMA: on Zen 3 their
// prefetches cost 6 %, on Zen 5 the hardware alone kept them at ~25 GB/s and the prefetches make 1 and 2
// rows 1.47x and 1.6x faster (the w8a8 server's int8 lm_head, `--torchao-config int8wo`). Nor do prefill
// chunks gain: from ~128 rows a unit's arithmetic is long enough for the hardware prefetcher to keep up,
// and the prefetch instructions only cost time (bench/results/engine_tuning_notes.md). Each output sums over k in order,
// in float32 with FMA.
//
// `packed_gemm_silu` is the MLP's gate and up projection with its SiLU-and-mul as the epilogue of each
// row block, so the [M, 2 * inter] products never leave L1 (`gemm_panels`).
//
// `packed_gemm` takes float32 panels. `packed_gemm_i8` takes int8 panels and one float32 scale per
// output column (`--torchao-config int8wo`): y = (x @ Wq^T) * scale + bias. Each weight byte is widened
// to float32 in registers as it streams in, so a decode step, bound by memory bandwidth, reads a quarter
// of the bytes; each output sums from zero in k order and is scaled once at the end, whatever the tile
// height, so a row gets the same bits in any batch. (At larger batches the widening costs what the
// smaller weight saves: float32 compute is the bound there, not bytes.)
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

// A per-thread buffer of at least `bytes` for the activations of one matmul, kept between calls (the GEMMs
// run ~120 times a decode step, and a prefill's rows are megabytes: allocating each time would map and
// fault in fresh pages on every call); `slot` 0 is this file's, 1 is gemm_w8a8.c's, 2 and 3
// prefill_attention.c's, 4 to 6 paged_attention.c's. NULL when it cannot grow.
void *gemm_scratch(int slot, size_t bytes) {
    static __thread void *buf[7];
    static __thread size_t cap[7];
    if (bytes > cap[slot]) {
        void *grown = realloc(buf[slot], bytes);
        if (!grown)
            return 0;
        buf[slot] = grown;
        cap[slot] = bytes;
    }
    return buf[slot];
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "vec_math.h"

int packed_gemm_supported(void) { return 1; }

#define NR 16
#define PREFETCH_ROWS 128  // from this many rows the hardware prefetcher alone keeps up (see the top)

// The walk over K shared by both tiles (STEP / STEP_I8 are each width's), unrolled 4x. With a line at
// `pf` to prefetch every `every` steps, the walk goes in spans of at least 16 steps with the span's
// lines requested after it (the same lines, K / every in all, the last ones after the walk), so the
// unrolled loop carries no per-step counter and branch: float32 matmuls of 512 rows 1.23x and of 64 rows
// 1.12x faster, 1 and 16 rows 1.02x, same bits (`pdserve bench kernels`, AVX2 Zen 3 host; not measured
// with AVX-512).
#define K_LOOP                                                                      \
    const int64_t per = pf ? (every >= 16 ? 1 : (16 + every - 1) / every) : 1;      \
    const int64_t span = pf ? per * every : K;                                      \
    int64_t owed = pf ? K / every : 0;                                              \
    for (int64_t k0 = 0; k0 < K; k0 += span) {                                     \
        const int64_t k1 = K - k0 < span ? K : k0 + span;                           \
        _Pragma("GCC unroll 4")                                                     \
        for (int64_t k = k0; k < k1; k++) {                                         \
            if (Q)                                                                  \
                STEP_I8                                                             \
            else                                                                    \
                STEP                                                                \
        }                                                                           \
        for (int64_t r = 0; r < per && owed > 0 && k1 - k0 == span; r++, owed--) {  \
            _mm_prefetch(pf, _MM_HINT_T1);                                          \
            pf += 64;                                                               \
        }                                                                           \
    }                                                                               \
    for (; owed > 0; owed--) {                                                      \
        _mm_prefetch(pf, _MM_HINT_T1);                                              \
        pf += 64;                                                                   \
    }

// `tile(MR, Q, ...)` with MR and Q compile-time constants, so each variant is its own unrolled loop
// (BY_HEIGHT, per width, adds the heights above 6 where registers allow).
#define LOW_HEIGHTS(Q, ...)                          \
    case 6: tile(6, Q, __VA_ARGS__); break;          \
    case 5: tile(5, Q, __VA_ARGS__); break;          \
    case 4: tile(4, Q, __VA_ARGS__); break;          \
    case 3: tile(3, Q, __VA_ARGS__); break;          \
    case 2: tile(2, Q, __VA_ARGS__); break;          \
    default: tile(1, Q, __VA_ARGS__); break;

#if defined(__AVX512F__)
// One zmm holds a panel's 16 columns: a tile is up to 12 rows x one or two panels (NP), one
// accumulator per row and panel. With two panels each broadcast of x feeds two FMAs: one load per FMA
// leaves the loads, not the FMA units, the bound of a 12-row tile of one panel (prefill-sized
// matmuls ran at ~0.7 of torch.mm's rate that way). Every output gets the same fused multiply-adds in
// the same order as in the AVX2 tile below, so the results are bit-identical whichever the machine
// builds and whatever the tile.
#define MR_MAX 12
#define PAIRS 1
#define ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#define DECLARE(i) __m512 c##i = acc, d##i = acc2;
#define FMA(i)                                                                      \
    if (MR > i) {                                                                   \
        const __m512 a = _mm512_set1_ps(x[k * MR + (i)]);                           \
        c##i = _mm512_fmadd_ps(a, b, c##i);                                         \
        if (NP > 1) d##i = _mm512_fmadd_ps(a, b2, d##i);                            \
    }
#define STEP                                                                        \
    {                                                                               \
        const __m512 b = _mm512_loadu_ps(w + k * NR);                               \
        const __m512 b2 = NP > 1 ? _mm512_loadu_ps(w + K * NR + k * NR) : b;        \
        ROWS(FMA)                                                                   \
    }
#define WIDEN(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define STEP_I8                                                                     \
    {                                                                               \
        const __m512 b = WIDEN(wq + k * NR);                                        \
        const __m512 b2 = NP > 1 ? WIDEN(wq + K * NR + k * NR) : b;                 \
        ROWS(FMA)                                                                   \
    }
#define STORE(i)                                                                    \
    if (MR > i) {                                                                   \
        _mm512_mask_storeu_ps(y + (i) * ldy, m, Q ? _mm512_fmadd_ps(c##i, s, init) : c##i); \
        if (NP > 1)                                                                 \
            _mm512_mask_storeu_ps(y + (i) * ldy + NR, m2, Q ? _mm512_fmadd_ps(d##i, s2, init2) : d##i); \
    }

static inline __mmask16 cols_mask(int nv) {
    return nv >= NR ? (__mmask16)0xFFFF : nv <= 0 ? 0 : (__mmask16)((1u << nv) - 1);
}

// One MR x (NP x 16) tile over the whole K: NP panels, the second K * 16 weights after the first; `nv`
// of their columns are stored (see the AVX2 tile).
static inline __attribute__((always_inline)) void tile(const int MR, const int Q, const int NP, int64_t K,
                                                       const float *x, const void *wv, const float *scale,
                                                       const float *bias, float *y, int64_t ldy, int nv,
                                                       const char *pf, int64_t every) {
    const float *w = (const float *)wv;
    const int8_t *wq = (const int8_t *)wv;
    const __mmask16 m = cols_mask(nv), m2 = cols_mask(nv - NR);
    const __m512 init = bias ? _mm512_maskz_loadu_ps(m, bias) : _mm512_setzero_ps();
    const __m512 init2 = bias && NP > 1 ? _mm512_maskz_loadu_ps(m2, bias + NR) : _mm512_setzero_ps();
    const __m512 s = Q ? _mm512_loadu_ps(scale) : init;
    const __m512 s2 = Q && NP > 1 ? _mm512_loadu_ps(scale + NR) : init2;
    const __m512 acc = Q ? _mm512_setzero_ps() : init, acc2 = Q ? _mm512_setzero_ps() : init2;
    ROWS(DECLARE)
    K_LOOP
    ROWS(STORE)
}

#define BY_HEIGHT(mr, Q, ...)                        \
    switch (mr) {                                    \
    case 12: tile(12, Q, __VA_ARGS__); break;        \
    case 11: tile(11, Q, __VA_ARGS__); break;        \
    case 10: tile(10, Q, __VA_ARGS__); break;        \
    case 9: tile(9, Q, __VA_ARGS__); break;          \
    case 8: tile(8, Q, __VA_ARGS__); break;          \
    case 7: tile(7, Q, __VA_ARGS__); break;          \
    LOW_HEIGHTS(Q, __VA_ARGS__)                      \
    }

#else
#define MR_MAX 6
#define PAIRS 0  // two 16-column panels would need 24 of AVX2's 16 registers

#define ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)
#define DECLARE(i) __m256 c##i##a = acc0, c##i##b = acc1;
#define FMA(i)                                                         \
    if (MR > i) {                                                      \
        const __m256 a = _mm256_broadcast_ss(x + k * MR + (i));          \
        c##i##a = _mm256_fmadd_ps(a, b0, c##i##a);                     \
        c##i##b = _mm256_fmadd_ps(a, b1, c##i##b);                     \
    }
#define STEP                                                           \
    {                                                                  \
        const __m256 b0 = _mm256_loadu_ps(w + k * NR);                 \
        const __m256 b1 = _mm256_loadu_ps(w + k * NR + 8);             \
        ROWS(FMA)                                                      \
    }
#define STEP_I8                                                                               \
    {                                                                                         \
        const __m128i q = _mm_loadu_si128((const __m128i *)(wq + k * NR));                    \
        const __m256 b0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));                        \
        const __m256 b1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(q, q))); \
        ROWS(FMA)                                                                             \
    }
#define STORE(i)                                                                                  \
    if (MR > i)                                                                                   \
        store_row16(y + (i) * ldy, Q ? _mm256_fmadd_ps(c##i##a, s0, init0) : c##i##a,              \
                    Q ? _mm256_fmadd_ps(c##i##b, s1, init1) : c##i##b, nv == NR, m0, m1);

// One MR x 16 tile over the whole K (Q: int8 weights with `scale`, else float32); `nv` of the 16
// columns are stored. Every `every` steps the next line at `pf` (if not NULL) is prefetched.
static inline __attribute__((always_inline)) void tile(const int MR, const int Q, const int NP, int64_t K,
                                                       const float *x, const void *wv, const float *scale,
                                                       const float *bias, float *y, int64_t ldy, int nv,
                                                       const char *pf, int64_t every) {
    const float *w = (const float *)wv;
    const int8_t *wq = (const int8_t *)wv;
    const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i m0 = _mm256_cmpgt_epi32(_mm256_set1_epi32(nv), iota);
    const __m256i m1 = _mm256_cmpgt_epi32(_mm256_set1_epi32(nv - 8), iota);
    const __m256 init0 = bias ? _mm256_maskload_ps(bias, m0) : _mm256_setzero_ps();
    const __m256 init1 = bias ? _mm256_maskload_ps(bias + 8, m1) : _mm256_setzero_ps();
    const __m256 s0 = Q ? _mm256_loadu_ps(scale) : init0, s1 = Q ? _mm256_loadu_ps(scale + 8) : init1;
    const __m256 acc0 = Q ? _mm256_setzero_ps() : init0, acc1 = Q ? _mm256_setzero_ps() : init1;
    ROWS(DECLARE)
    K_LOOP
    ROWS(STORE)
}

#define BY_HEIGHT(mr, Q, ...)                        \
    switch (mr) {                                    \
    LOW_HEIGHTS(Q, __VA_ARGS__)                      \
    }

#endif  // __AVX512F__

// `np` panels (2 only where PAIRS) of `mr` rows.
static void tile_rows(int mr, int q, int np, int64_t K, const float *x, const void *w, const float *scale,
                      const float *bias, float *y, int64_t ldy, int nv, const char *pf, int64_t every) {
    if (q && np > 1) {
        BY_HEIGHT(mr, 1, PAIRS + 1, K, x, w, scale, bias, y, ldy, nv, pf, every)
    } else if (q) {
        BY_HEIGHT(mr, 1, 1, K, x, w, scale, bias, y, ldy, nv, pf, every)
    } else if (np > 1) {
        BY_HEIGHT(mr, 0, PAIRS + 1, K, x, w, scale, bias, y, ldy, nv, pf, every)
    } else {
        BY_HEIGHT(mr, 0, 1, K, x, w, scale, bias, y, ldy, nv, pf, every)
    }
}

// M rows in as few blocks of at most MR_MAX rows as fit, of heights that differ by at most one (8 rows: 4 + 4,
// not 6 + 2): a short tile has too few accumulators to hide the FMA's latency, so an even split takes fewer
// cycles per step of K. SmolLM2's 30 layers of projections from DRAM (`pdserve bench kernels --layers 30`,
// AVX2 Zen 3): 8 rows 1.04-1.06x on one or two threads (1.09x with the weights in cache), 7 rows 1.05x,
// 13 rows 1.03x, 16 rows (6 + 5 + 5) 1.00-1.02x; same bits (the AVX-512 tile, 12 rows, not measured).
// Block j starts at row block_start(M, j); block_start(M, row_blocks(M)) is M.
// `mr_max`: the tallest tile (gemm_blocks.c, whose tiles are at most 6 rows in either build, shares these).
#define SHARED __attribute__((visibility("hidden")))  // gemm_blocks.c calls these; -fPIC may still inline them here
SHARED int64_t gemm_row_blocks(int64_t M, int64_t mr_max) { return (M + mr_max - 1) / mr_max; }
SHARED int64_t gemm_block_start(int64_t M, int64_t j, int64_t mr_max) {
    const int64_t n = gemm_row_blocks(M, mr_max), base = M / n, extra = M % n;
    return j * base + (j < extra ? j : extra);
}
static inline int64_t row_blocks(int64_t M) { return gemm_row_blocks(M, MR_MAX); }
static inline int64_t block_start(int64_t M, int64_t j) { return gemm_block_start(M, j, MR_MAX); }

// The rows of x as the tiles read them: each row block (rows m..m+mr-1, from block_start) k-major,
// [K][mr] at xp + m * K, so a tile's broadcasts sit at fixed offsets from one pointer walking k. In a
// per-thread buffer that grows to the largest x seen (one row is its own layout: no copy). NULL when
// the buffer cannot grow.
SHARED const float *gemm_pack_rows(const float *x, int64_t ldx, int64_t M, int64_t K, int64_t mr_max) {
    if (M == 1)
        return x;
    float *out = gemm_scratch(0, (size_t)(M * K) * sizeof(float));
    if (!out)
        return 0;
#pragma omp parallel for schedule(static) if (M * K >= 65536)
    for (int64_t j = 0; j < gemm_row_blocks(M, mr_max); j++) {
        const int64_t m0 = gemm_block_start(M, j, mr_max), mr = gemm_block_start(M, j + 1, mr_max) - m0;
        pack_k_major(x + m0 * ldx, ldx, mr, K, out + m0 * K);
    }
    return out;
}

// The units of a matmul are handed out from both ends of a range: threads 2i and 2i + 1 share the i-th
// of ceil(threads / 2) even ranges, the first taking units from its front, the second from its back, until
// they meet. Each thread still walks its units in order, so it prefetches its next one as under a static
// split; but when one core is slowed for a while (a vCPU of this host loses hundreds of microseconds at a
// time, at random), the other takes more units instead of waiting for it at the end. (A dynamic schedule,
// the threads interleaving units, was 4 % slower on SmolLM2's 512-token prefill: no thread knew its next
// unit, to prefetch it.)
typedef struct {
    int64_t lo, hi;  // the range
    int64_t *taken;  // units claimed from it so far, by both its threads
    int back;        // this thread takes from its back
} Share;

static Share share_of(int64_t units, int64_t *taken) {
    const int t = omp_get_thread_num(), ranges = (omp_get_num_threads() + 1) / 2, r = t / 2;
    return (Share){units * r / ranges, units * (r + 1) / ranges, taken + r, t % 2};
}

// This thread's `mine`-th unit (from 0), or -1 when its range is used up: the two threads' claims never
// outnumber the range's units, so the front's units and the back's never meet.
static int64_t claim(const Share *sh, int64_t mine) {
    if (__atomic_fetch_add(sh->taken, 1, __ATOMIC_RELAXED) >= sh->hi - sh->lo)
        return -1;
    return sh->back ? sh->hi - 1 - mine : sh->lo + mine;
}

// The MLP's epilogue on one row block: act row i, columns 0..nv = SiLU(gate) * up, from tmp row i (ldt
// apart): its nv gate columns, then its nv up columns (nv a multiple of the vector width).
static void silu_rows(const float *tmp, int64_t ldt, int mr, int nv, float *act, int64_t ld_act) {
    for (int i = 0; i < mr; i++)
        for (int c = 0; c < nv; c += NR) {
            const float *g = tmp + i * ldt + c;
            float *o = act + i * ld_act + c;
#if defined(__AVX512F__)
            _mm512_storeu_ps(o, silu_mul16(_mm512_loadu_ps(g), _mm512_loadu_ps(g + nv)));
#else
            _mm256_storeu_ps(o, silu_mul8(_mm256_loadu_ps(g), _mm256_loadu_ps(g + nv)));
            _mm256_storeu_ps(o + 8, silu_mul8(_mm256_loadu_ps(g + 8), _mm256_loadu_ps(g + nv + 8)));
#endif
        }
}

// x rows at x + m * ldx; bias may be NULL; q: int8 weights (scale: one float per output column, padded to
// whole panels), else float32. Without `act`: y = x W^T + bias, y rows at y + m * ldy. With `act`, the MLP's
// gate and up projection and its SiLU-and-mul in one: W's N = 2 n columns are [gate | up], and act (rows
// ld_act apart) gets SiLU(gate) * up, n columns; y is not used. A unit is then some columns of gate with
// the same columns of up: for each row block, both tiles go to a small buffer, and the block's act rows
// are computed from it while it is in L1 (the unfused MLP writes the M x 2n products out and reads them
// back). The products and the SiLU are those of the unfused pair, and so are the bits.
static int gemm_panels(int q, const float *x, int64_t ldx, const void *w, const float *scale, const float *bias,
                       float *y, int64_t ldy, int64_t M, int64_t N, int64_t K, float *act, int64_t ld_act) {
    const int64_t panels = (N + NR - 1) / NR;
    const int np = PAIRS && panels > 1 ? 2 : 1;  // panels per tile: a unit of work
    const int64_t n = N / 2, up_at = n / NR;     // with act: up's first panel
    if (act && (N % 2 || n % (np * NR)))
        return -3;
    if (M <= 0 || N <= 0)
        return 0;
    const int64_t units = act ? up_at / np : (panels + np - 1) / np;
    const int64_t blocks = row_blocks(M);
    const int64_t panel_bytes = K * NR * (q ? 1 : 4), unit_bytes = np * panel_bytes;
    const int64_t lines = (unit_bytes + 63) / 64;
    // block j prefetches lines [j lines / blocks, (j + 1) lines / blocks) of the next unit, one every
    // `every` of its K steps: the whole next unit is requested evenly over this one's compute
    const int64_t every = (K * blocks + lines - 1) / lines;
    const float *xp = gemm_pack_rows(x, ldx, M, K, MR_MAX);
    if (!xp)
        return -1;
    int64_t taken[(omp_get_max_threads() + 1) / 2];
    memset(taken, 0, sizeof(taken));
#pragma omp parallel if (M * N * K >= 32768)
    {
        const Share sh = share_of(units, taken);
        float tmp[MR_MAX * 2 * NR * (PAIRS + 1)];  // with act: a row block's gate tile, then its up tile
        for (int64_t mine = 0;; mine++) {
            const int64_t u = claim(&sh, mine);
            if (u < 0)
                break;
            const int64_t p = u * np, next = sh.back ? u - 1 : u + 1;
            const int un = panels - p < np ? (int)(panels - p) : np;
            const int nv = N - p * NR < un * NR ? (int)(N - p * NR) : un * NR;
            const int prefetch =
                M < PREFETCH_ROWS && (M > 1 || q) && next >= sh.lo && next < sh.hi;
            for (int64_t j = 0; j < blocks; j++) {
                const int64_t m = block_start(M, j);
                const int mr = (int)(block_start(M, j + 1) - m);
                for (int half = 0; half < (act ? 2 : 1); half++) {  // with act: gate's tile, then up's
                    const int64_t at = p + half * up_at;  // the unit's first panel
                    const char *wp = (const char *)w + at * panel_bytes;
                    const char *pf = prefetch ? wp + (next - u) * unit_bytes + (lines * j / blocks) * 64 : 0;
                    const float *b = bias ? bias + at * NR : 0, *s = q ? scale + at * NR : 0;
                    if (act)
                        tile_rows(mr, q, un, K, xp + m * K, wp, s, b, tmp + half * nv, 2 * nv, nv, pf, every);
                    else
                        tile_rows(mr, q, un, K, xp + m * K, wp, s, b, y + m * ldy + p * NR, ldy, nv, pf, every);
                }
                if (act)
                    silu_rows(tmp, 2 * nv, mr, nv, act + m * ld_act + p * NR, ld_act);
            }
        }
    }
    return 0;
}

// All return 0, or -1 when the buffer of packed rows cannot grow (y / act is then not written);
// packed_gemm_silu -3 when n is not a multiple of `packed_gemm_silu_cols()`.
int packed_gemm(const float *x, int64_t ldx, const float *w, const float *bias, float *y, int64_t ldy, int64_t M,
                int64_t N, int64_t K) {
    return gemm_panels(0, x, ldx, w, 0, bias, y, ldy, M, N, K, 0, 0);
}

int packed_gemm_i8(const float *x, int64_t ldx, const int8_t *wq, const float *scale, const float *bias, float *y,
                   int64_t ldy, int64_t M, int64_t N, int64_t K) {
    return gemm_panels(1, x, ldx, wq, scale, bias, y, ldy, M, N, K, 0, 0);
}

// act = SiLU(x Wg^T + bg) * (x Wu^T + bu): w the panels of [gate | up] (2 n columns: float32, or int8 with
// `scale`, which may be NULL for float32), act [M, n] with rows ld_act apart. The same bits as packed_gemm
// (or packed_gemm_i8) into [M, 2 n], then silu_and_mul.
int packed_gemm_silu(const float *x, int64_t ldx, const void *w, const float *scale, const float *bias,
                     float *act, int64_t ld_act, int64_t M, int64_t n, int64_t K) {
    return gemm_panels(scale != 0, x, ldx, w, scale, bias, 0, 0, M, 2 * n, K, act, ld_act);
}

// What n must be a multiple of for packed_gemm_silu: a tile's columns.
int packed_gemm_silu_cols(void) { return NR * (PAIRS + 1); }

#else
// Without AVX2 + FMA the caller keeps oneDNN's packed weights (or F.linear) instead.
int packed_gemm_supported(void) { return 0; }

int packed_gemm(const float *x, int64_t ldx, const float *w, const float *bias, float *y, int64_t ldy, int64_t M,
                int64_t N, int64_t K) {
    return -1;
}
int packed_gemm_i8(const float *x, int64_t ldx, const int8_t *wq, const float *scale, const float *bias, float *y,
                   int64_t ldy, int64_t M, int64_t N, int64_t K) {
    return -1;
}
int packed_gemm_silu(const float *x, int64_t ldx, const void *w, const float *scale, const float *bias,
                     float *act, int64_t ld_act, int64_t M, int64_t n, int64_t K) {
    return -1;
}
int packed_gemm_silu_cols(void) { return 0; }
#endif
