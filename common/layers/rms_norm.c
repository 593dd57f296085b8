// RMSNorm over the last dimension, with the residual add fused in (CPU, float32). Built and loaded by
// common/layers/native.py; common/layers/norm.py falls back to F.rms_norm without it.
//
// For each of `rows` rows of n floats (x row r at x + r * x_stride): h = x (+ residual), written to
// res_out when residual is given; out = w * (h * 1 / sqrt(mean(h^2) + eps)), the order Hugging Face
// computes it in. The sum of squares is accumulated in double.
#include <math.h>
#include <stdint.h>

void add_rms_norm(const float *x, int64_t x_stride, const float *residual, int64_t res_stride, float *res_out,
                  const float *w, float *out, int64_t rows, int64_t n, float eps) {
#pragma omp parallel for schedule(static) if (rows * n >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        float *o = out + r * n;
        const float *h = xr;
        if (residual) {
            const float *rr = residual + r * res_stride;
            float *ro = res_out + r * n;
#pragma omp simd
            for (int64_t i = 0; i < n; i++) ro[i] = xr[i] + rr[i];
            h = ro;
        }
        double ss = 0.0;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < n; i++) ss += (double)h[i] * (double)h[i];
        const float inv = 1.0f / sqrtf((float)(ss / (double)n) + eps);
#pragma omp simd
        for (int64_t i = 0; i < n; i++) o[i] = w[i] * (h[i] * inv);
    }
}
