// SiLU-and-multiply of the MLP (CPU, float32). Built and loaded by common/layers/native.py;
// common/layers/activation.py falls back to F.silu(gate) * up without it.
//
// For each of `rows` rows of x (x row r at x + r * x_stride, holding [gate (n) | up (n)]):
// out[r, i] = gate_i / (1 + e^-gate_i) * up_i, out rows n floats apart.
#include <math.h>
#include <stdint.h>
#if defined(__AVX2__) && defined(__FMA__)
#include "vec_math.h"
#endif

void silu_and_mul(const float *x, int64_t x_stride, float *out, int64_t rows, int64_t n) {
#pragma omp parallel for schedule(static) if (rows * n >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = x + r * x_stride, *u = g + n;
        float *o = out + r * n;
        int64_t i = 0;
#if defined(__AVX512F__)
        const __m512 one16 = _mm512_set1_ps(1.0f), zero16 = _mm512_setzero_ps();
        for (; i + 16 <= n; i += 16) {  // exp16: each lane's bits as exp8's below
            const __m512 gv = _mm512_loadu_ps(g + i);
            const __m512 s = _mm512_div_ps(gv, _mm512_add_ps(one16, exp16(_mm512_sub_ps(zero16, gv))));
            _mm512_storeu_ps(o + i, _mm512_mul_ps(s, _mm512_loadu_ps(u + i)));
        }
#endif
#if defined(__AVX2__) && defined(__FMA__)
        const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
        for (; i + 8 <= n; i += 8) {
            const __m256 gv = _mm256_loadu_ps(g + i);
            const __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, gv))));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
        }
#endif
        for (; i < n; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}
