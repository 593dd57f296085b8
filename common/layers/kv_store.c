// New tokens' K and V into the KV pool (CPU, float32), the write an extend step makes before its
// attention. Built and loaded by common/layers/native.py; common/layers/attention.py calls it where the
// pool is float32 on the CPU, and `KVPool.set_kv_rows` (two index_copy_ on one thread) otherwise.
//
// pool: the pool's flat [rows, D] view. rows[t * H + h]: the flat row of token t's K for KV head h in the
// first layer; a layer's K row is rows + k_off, its V row rows + k_off + v_off (v_off 0: one plane, V is K).
// k, v: token t's head h at + t * stride + h * D (views into the q/k/v projection's output).
// A 512-token extend of SmolLM2 writes 0.8 MB a layer: ~0.27 ms through index_copy_, a tenth of its
// attention.
#include <stdint.h>
#include <string.h>

void kv_store(float *pool, const int64_t *rows, int64_t T, int64_t H, int64_t D, int64_t k_off, int64_t v_off,
              const float *k, int64_t k_stride, const float *v, int64_t v_stride) {
#pragma omp parallel for schedule(static) if (T * H * D >= 16384)
    for (int64_t th = 0; th < T * H; th++) {
        const int64_t t = th / H, h = th % H;
        float *dst = pool + (rows[th] + k_off) * D;
        memcpy(dst, k + t * k_stride + h * D, sizeof(float) * (size_t)D);
        if (v_off)
            memcpy(dst + v_off * D, v + t * v_stride + h * D, sizeof(float) * (size_t)D);
    }
}
