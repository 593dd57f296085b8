// Causal attention of one sequence's prefill chunk (CPU, float32). Built and loaded by
// common/layers/native.py; common/layers/attention.py calls it for each sequence of an EXTEND batch
// and falls back to torch's scaled_dot_product_attention without it.
//
// Query row i (position prefix + i) attends keys 0..prefix + i. The keys of kv head g are first laid
// out transposed by blocks of KB keys (32 with AVX-512, 16 with AVX2): block b is [D][KB], contiguous,
// the last one zero-padded, shared by the G query heads of the group. (As one [D][L] matrix, a tile's
// rows of keys lay L floats apart: at 512 keys 2 KiB, all in four sets of L1.) Then each task, one query
// head and a block of up to MR query rows, materialises its scores:
//   S = (scale Q) K^T (a register tile of MR rows x KB keys walks D; the rows of Q copied d-major and
//     scaled, so the broadcasts sit at fixed offsets as in gemm.c), masked above the diagonal;
//   P = exp(S - row max) (16 lanes with AVX-512, summed by eights in the AVX2 build's order), the row
//     sums kept; P copied key-major;
//   O = P V (a tile of MR rows x KB columns of D walks the keys), divided by the row sums.
// A task's scratch is MR x L floats, so chunks of a few thousand tokens stay in L2; it and the
// transposed keys live in gemm.c's per-thread buffers, kept between calls. The tiles use a GCC vector
// type as wide as one register (16 floats, a zmm, with AVX-512; 8, a ymm, with AVX2), two of them per
// tile row, MR rows: 24 accumulators of AVX-512's 32 registers, 12 of AVX2's 16. (A 16-float type under
// AVX2 is lowered as a pair of ymm that GCC moves through the stack on every step: 12 GFLOPS on
// SmolLM2's 512-token prefill attention on a Zen 3, a quarter of torch's flash kernel.) Tasks further
// down the chunk see more keys, so they are handed out dynamically. Torch's CPU flash kernel ran that
// attention at ~65 GFLOPS on an AVX-512 host, 44-51 on the AVX2 one.
#include <math.h>
#include <stdint.h>
#include <string.h>

void *gemm_scratch(int slot, size_t bytes);  // gemm.c

// K and V take token strides of their own (`pdserve bench kernels` asks, to call an older build the old way).
int prefill_attention_kv_strides(void) { return 1; }

#if defined(__AVX2__) && defined(__FMA__)
#include "vec_math.h"

#if defined(__AVX512F__)
#define VW 16
#define MR 12
#define ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#else
#define VW 8
#define MR 6
#define ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)
#endif
typedef float vec __attribute__((vector_size(VW * 4)));
typedef float vecu __attribute__((vector_size(VW * 4), aligned(4)));  // unaligned loads and stores
#define KB (2 * VW)  // keys (or columns of V) per tile: two vectors

// Head sizes must be a multiple of this (0: no kernel in this build).
int prefill_attention_block(void) { return KB; }

#define DECLARE(i) vec c##i = {0}, d##i = {0};
#define FMA(i)                          \
    if (R > i) {                        \
        const float a = x[k * R + (i)]; \
        c##i += a * b;                  \
        d##i += a * b2;                 \
    }
#define STORE(i)                                  \
    if (R > i) {                                  \
        *(vecu *)(y + (i) * ldy) = c##i;          \
        *(vecu *)(y + (i) * ldy + VW) = d##i;     \
    }

// y[i][0..KB) = sum over k of x[k * R + i] * w[k * ws + 0..KB), for the R rows of a k-major x.
static inline __attribute__((always_inline)) void tile(const int R, int64_t K, const float *x, const float *w,
                                                       int64_t ws, float *y, int64_t ldy) {
    ROWS(DECLARE)
    for (int64_t k = 0; k < K; k++) {
        const vec b = *(const vecu *)(w + k * ws);
        const vec b2 = *(const vecu *)(w + k * ws + VW);
        ROWS(FMA)
    }
    ROWS(STORE)
}

static void tile_rows(int r, int64_t K, const float *x, const float *w, int64_t ws, float *y, int64_t ldy) {
    switch (r) {
#if MR > 6
    case 12: tile(12, K, x, w, ws, y, ldy); break;
    case 11: tile(11, K, x, w, ws, y, ldy); break;
    case 10: tile(10, K, x, w, ws, y, ldy); break;
    case 9: tile(9, K, x, w, ws, y, ldy); break;
    case 8: tile(8, K, x, w, ws, y, ldy); break;
    case 7: tile(7, K, x, w, ws, y, ldy); break;
#endif
    case 6: tile(6, K, x, w, ws, y, ldy); break;
    case 5: tile(5, K, x, w, ws, y, ldy); break;
    case 4: tile(4, K, x, w, ws, y, ldy); break;
    case 3: tile(3, K, x, w, ws, y, ldy); break;
    case 2: tile(2, K, x, w, ws, y, ldy); break;
    default: tile(1, K, x, w, ws, y, ldy); break;
    }
}

// x[0..len) -> e^(x - max), in place; returns their sum. The maximum over four accumulators: one
// alone is a chain of dependent max instructions. x has room to the next whole vector (the row is
// KB-padded): the lanes past len are set to -inf, so their terms come out 0 and no lane is left to expf.
static float exp_row(float *x, int64_t len) {
    __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0, m2 = m0, m3 = m0;
    int64_t j = 0;
    for (; j + 32 <= len; j += 32) {
        m0 = _mm256_max_ps(m0, _mm256_loadu_ps(x + j));
        m1 = _mm256_max_ps(m1, _mm256_loadu_ps(x + j + 8));
        m2 = _mm256_max_ps(m2, _mm256_loadu_ps(x + j + 16));
        m3 = _mm256_max_ps(m3, _mm256_loadu_ps(x + j + 24));
    }
    for (; j + 8 <= len; j += 8)
        m0 = _mm256_max_ps(m0, _mm256_loadu_ps(x + j));
    float mx = hmax8(_mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3)));
    for (; j < len; j++)
        mx = x[j] > mx ? x[j] : mx;
    const int64_t whole = (len + VW - 1) / VW * VW;
    for (j = len; j < whole; j++)
        x[j] = -INFINITY;
#if defined(__AVX512F__)
    const __m512 mv = _mm512_set1_ps(mx), floor = _mm512_set1_ps(-87.0f);
    __m256 vs = _mm256_setzero_ps();  // summed by eights in order, as exp_shifted_sum does: AVX2's bits
    for (j = 0; j < whole; j += 16) {
        const __m512 d = _mm512_sub_ps(_mm512_loadu_ps(x + j), mv);
        const __m512 e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(d, floor, _CMP_GE_OQ), exp16(d));
        _mm512_storeu_ps(x + j, e);
        vs = _mm256_add_ps(vs, _mm512_castps512_ps256(e));
        __asm__("" : "+x"(vs));  // no reassociation of the two adds (fast-math would allow it)
        vs = _mm256_add_ps(vs, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
    }
    return hsum8(vs);
#else
    return exp_shifted_sum(x, whole, mx);
#endif
}

// q: row i of the chunk at q + i * q_stride, head h at + h * D. k: token j of kv head g at + j * k_tok +
// g * kv_head, v at + j * v_tok + g * kv_head (tokens 0..prefix + n - 1: the prefix's, then the chunk's;
// two strides, so K and V can be read in place from one projection's output). out: like q.
// H query heads, G of them per kv head; D a multiple of KB. Returns 0, -1 on a bad dimension or no memory.
int prefill_attention(const float *q, int64_t q_stride, const float *k, int64_t k_tok, const float *v,
                      int64_t v_tok, int64_t kv_head, int64_t n, int64_t prefix, int64_t H, int64_t G, int64_t D,
                      float scale, float *out, int64_t o_stride) {
    if (n <= 0)
        return 0;
    if (D <= 0 || D % KB || G <= 0 || H % G || prefix < 0)
        return -1;
    const int64_t L = prefix + n, nb = (L + KB - 1) / KB, LP = nb * KB, HKV = H / G;
    const int64_t blocks = (n + MR - 1) / MR;
    float *kt = gemm_scratch(3, sizeof(float) * (size_t)(HKV * D * LP));
    if (!kt)
        return -1;
    int failed = 0;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t gb = 0; gb < HKV * nb; gb++) {
            const int64_t g = gb / nb, j0 = gb % nb * KB, keys = L - j0 < KB ? L - j0 : KB;
            const float *src = k + g * kv_head + j0 * k_tok;
            float *dst = kt + gb * D * KB;
            if (keys == KB) {
                pack_k_major(src, k_tok, KB, D, dst);
                continue;
            }
            for (int64_t d = 0; d < D; d++)
                for (int64_t j = 0; j < KB; j++)
                    dst[d * KB + j] = j < keys ? src[j * k_tok + d] : 0.0f;
        }
        // per thread, in one scratch buffer: Q rows d-major, S / P rows, P key-major, O rows
        float *qp = gemm_scratch(2, sizeof(float) * (size_t)(2 * D * MR + 2 * MR * LP));
        float *s = qp + D * MR, *pt = s + MR * LP, *o = pt + LP * MR;
        if (!qp) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic)
        for (int64_t task = 0; task < H * blocks; task++) {
            if (!qp)
                continue;
            const int64_t h = task / blocks, i0 = task % blocks * MR;
            const int r = n - i0 < MR ? (int)(n - i0) : MR;
            const int64_t keys = prefix + i0 + r, kp = (keys + KB - 1) / KB * KB;
            const float *qh = q + h * D;
            pack_k_major(qh + i0 * q_stride, q_stride, r, D, qp);
            for (int64_t e = 0; e < D * r; e++)  // scaled here, so the scores come out scaled
                qp[e] *= scale;
            const float *kg = kt + h / G * nb * D * KB;
            for (int64_t j = 0; j < kp; j += KB)
                tile_rows(r, D, qp, kg + j * D, KB, s + j, LP);
            float sums[MR];
            for (int i = 0; i < r; i++) {
                const int64_t seen = prefix + i0 + i + 1;  // the keys this row sees
                sums[i] = exp_row(s + i * LP, seen);
                memset(s + i * LP + seen, 0, sizeof(float) * (size_t)(keys - seen));
            }
            pack_k_major(s, LP, r, keys, pt);
            const float *vg = v + h / G * kv_head;
            for (int64_t c = 0; c < D; c += KB)
                tile_rows(r, keys, pt, vg + c, v_tok, o + c, D);
            for (int i = 0; i < r; i++) {
                float *dst = out + (i0 + i) * o_stride + h * D;
                const float inv = 1.0f / sums[i];
                for (int64_t d = 0; d < D; d++)
                    dst[d] = o[i * D + d] * inv;
            }
        }
    }
    return failed ? -1 : 0;
}

#else
int prefill_attention_block(void) { return 0; }

int prefill_attention(const float *q, int64_t q_stride, const float *k, int64_t k_tok, const float *v,
                      int64_t v_tok, int64_t kv_head, int64_t n, int64_t prefix, int64_t H, int64_t G, int64_t D,
                      float scale, float *out, int64_t o_stride) {
    return -1;
}
#endif
