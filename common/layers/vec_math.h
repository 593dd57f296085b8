// Vector math shared by the native kernels (AVX2 + FMA builds only).
#pragma once
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

// e^x, 8 at a time: x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial (relative
// error < 2e-7 there), 2^n put into the exponent bits. x is clamped to [-87, 88], so the result is
// always a normal float; callers that need e^x -> 0 below that mask it themselves.
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    // r = x - n ln2, with ln2 split in a part exact in float and the rest
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

#if defined(__AVX512F__)
// exp8's steps sixteen at a time (each lane's bits as exp8's)
static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}
#endif

// SiLU(g) * u = g / (1 + e^-g) * u, 8 lanes (and 16 with AVX-512, each lane's bits as the 8-lane one's):
// activation.c's silu_and_mul and gemm.c's MLP epilogue compute it this one way.
static inline __m256 silu_mul8(__m256 g, __m256 u) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), u);
}

#if defined(__AVX512F__)
static inline __m512 silu_mul16(__m512 g, __m512 u) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
    return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), u);
}
#endif

// the sum and the maximum of the 8 lanes
static inline float hsum8(__m256 v) {
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

static inline float hmax8(__m256 v) {
    const __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    return _mm_cvtss_f32(_mm_max_ss(m2, _mm_movehdup_ps(m2)));
}


// x[0..len) -> e^(x - mx) in place (mx >= every x: the terms are in (0, 1]; below e^-87, where exp8
// clamps, a term is 0; the tail past the last 8 through expf); returns their sum
static inline float exp_shifted_sum(float *x, int64_t len, float mx) {
    const __m256 mv = _mm256_set1_ps(mx);
    __m256 vs = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= len; j += 8) {
        const __m256 d = _mm256_sub_ps(_mm256_loadu_ps(x + j), mv);
        const __m256 e = _mm256_andnot_ps(_mm256_cmp_ps(d, _mm256_set1_ps(-87.0f), _CMP_LT_OQ), exp8(d));
        _mm256_storeu_ps(x + j, e);
        vs = _mm256_add_ps(vs, e);
    }
    float sum = hsum8(vs);
    for (; j < len; j++) {
        x[j] = expf(x[j] - mx);
        sum += x[j];
    }
    return sum;
}

// Sixteen floats of one output row, lo then hi: plain stores where the row is whole (`whole`), else the
// first ones under masks m0 / m1 (AMD microcodes masked stores: they took a twelfth of a 512-row matmul).
static inline void store_row16(float *y, __m256 lo, __m256 hi, int whole, __m256i m0, __m256i m1) {
    if (whole) {
        _mm256_storeu_ps(y, lo);
        _mm256_storeu_ps(y + 8, hi);
    } else {
        _mm256_maskstore_ps(y, m0, lo);
        _mm256_maskstore_ps(y + 8, m1, hi);
    }
}

// Rows x[0..4) (ld apart), floats 0..8 of each, to dst k-major: dst[k * ldd + i] = x[i * ld + k].
static inline void transpose4x8(const float *x, int64_t ld, float *dst, int64_t ldd) {
    const __m256 r0 = _mm256_loadu_ps(x), r1 = _mm256_loadu_ps(x + ld);
    const __m256 r2 = _mm256_loadu_ps(x + 2 * ld), r3 = _mm256_loadu_ps(x + 3 * ld);
    const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
    const __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
    const __m256 c[4] = {_mm256_shuffle_ps(t0, t2, 0x44), _mm256_shuffle_ps(t0, t2, 0xEE),
                         _mm256_shuffle_ps(t1, t3, 0x44), _mm256_shuffle_ps(t1, t3, 0xEE)};
    for (int j = 0; j < 4; j++) {
        _mm_storeu_ps(dst + j * ldd, _mm256_castps256_ps128(c[j]));
        _mm_storeu_ps(dst + (j + 4) * ldd, _mm256_extractf128_ps(c[j], 1));
    }
}

// `rows` rows of x (ld apart), K floats each, to dst k-major: dst[k * rows + i] = x[i * ld + k]. Fours of
// rows by eights of k through registers (with rows % 4, the last four overlap the four before: the same
// values are stored twice); the rest one float at a time. A plain copy: no float is changed.
static inline void pack_k_major(const float *x, int64_t ld, int64_t rows, int64_t K, float *dst) {
    int64_t k = 0;
    if (rows >= 4)
        for (; k + 8 <= K; k += 8)
            for (int64_t i = 0; i < rows; i += 4) {
                const int64_t i0 = i + 4 <= rows ? i : rows - 4;
                transpose4x8(x + i0 * ld + k, ld, dst + k * rows + i0, rows);
            }
    for (; k < K; k++)
        for (int64_t i = 0; i < rows; i++)
            dst[k * rows + i] = x[i * ld + k];
}
