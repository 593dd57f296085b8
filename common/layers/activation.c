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
        for (; i + 16 <= n; i += 16)
            _mm512_storeu_ps(o + i, silu_mul16(_mm512_loadu_ps(g + i), _mm512_loadu_ps(u + i)));
#endif
#if defined(__AVX2__) && defined(__FMA__)
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(o + i, silu_mul8(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
#endif
        for (; i < n; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}
