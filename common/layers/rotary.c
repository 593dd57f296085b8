// Rotary position embedding, rotate-half (neox) style, as common/layers/rotary.py's torch path
// computes it (CPU, float32). Built and loaded by common/layers/native.py.
//
// x: T tokens of `heads` heads of D floats; token t's head h at x + t * x_stride + h * D.
// cos, sin: [T, D / 2] contiguous. out: [T, heads, D] contiguous.
// out[:half] = x1 * cos - x2 * sin; out[half:] = x2 * cos + x1 * sin.
#include <stdint.h>

void rotary_apply(const float *x, int64_t x_stride, const float *cos, const float *sin, float *out, int64_t T,
                  int64_t heads, int64_t D) {
    const int64_t half = D / 2;
#pragma omp parallel for schedule(static) if (T * heads * D >= 65536)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos + t * half;
        const float *s = sin + t * half;
        for (int64_t h = 0; h < heads; h++) {
            const float *x1 = x + t * x_stride + h * D;
            const float *x2 = x1 + half;
            float *o1 = out + (t * heads + h) * D;
            float *o2 = o1 + half;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                o1[i] = x1[i] * c[i] - x2[i] * s[i];
                o2[i] = x2[i] * c[i] + x1[i] * s[i];
            }
        }
    }
}
