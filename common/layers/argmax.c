// Row-wise argmax of float32 logits (greedy sampling). Built and loaded by common/layers/native.py;
// common/layers/sampling.py falls back to torch.argmax without it.
//
// out[r] = the first index of the largest value of row r (x row r at x + r * stride, n values), as
// torch.argmax: a NaN counts as the largest, so the first NaN's index wins. torch's CPU argmax runs one
// thread over a [16, 49152] batch in ~0.5 ms here; this is two vector passes per row over rows in
// parallel.
#include <math.h>
#include <stdint.h>
#if defined(__AVX2__) && defined(__FMA__)
#include "vec_math.h"
#endif

static int64_t argmax_row(const float *x, int64_t n) {
    float m = -INFINITY;
    int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 vm = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        vm = _mm256_max_ps(vm, v);
    }
    m = hmax8(vm);
    if (_mm256_movemask_ps(nan)) {
        for (int64_t j = 0; j < n; j++)
            if (isnan(x[j])) return j;
    }
#endif
    for (int64_t j = i; j < n; j++) {
        if (isnan(x[j])) return j;  // none came before it (checked above)
        m = x[j] > m ? x[j] : m;
    }
    i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 target = _mm256_set1_ps(m);
    for (; i + 8 <= n; i += 8) {
        const int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), target, _CMP_EQ_OQ));
        if (mask) return i + __builtin_ctz(mask);
    }
#endif
    for (; i < n; i++)
        if (x[i] == m) return i;
    return 0;  // n == 0
}

void argmax_rows(const float *x, int64_t stride, int64_t rows, int64_t n, int64_t *out) {
#pragma omp parallel for schedule(static) if (rows * n >= 65536)
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_row(x + r * stride, n);
}
