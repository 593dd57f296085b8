// Paged decode attention on CPU, reading K and V in place from the KV pool (no gather copy).
// Built and loaded by common/layers/native.py; the torch path in attention.py computes the same.
//
// pool: the KV pool's flat [rows, D] view (float32). rows[b, h, t] is the flat row of token t's K
// for request b and KV head h in the first layer; a layer's K row is rows + k_off, its V row
// rows + k_off + v_off. q is [B, H, G, D] (G query heads per KV head) with q_stride floats from
// one request to the next; out is [B, H, G, D] contiguous.
// Request b attends to its first lens[b] tokens. One (b, h) pair per task: each K and V row is
// read once for the G query heads that share it.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define MAX_G 64
#define MAX_D 512

// inlined into each specialisation below, so the loops over D and G unroll for common head shapes
static inline __attribute__((always_inline)) void one_head(const float *q, const float *pool, const int64_t *rows, int64_t len, int64_t G,
                     int64_t D, int64_t k_off, int64_t v_off, float scale, float *out, float *scores) {
    float mx[MAX_G], sum[MAX_G];
    for (int64_t g = 0; g < G * D; g++) out[g] = 0.f;
    if (len <= 0) return;
    for (int64_t g = 0; g < G; g++) mx[g] = -INFINITY;
    for (int64_t t = 0; t < len; t++) {
        const float *k = pool + (rows[t] + k_off) * D;
        for (int64_t g = 0; g < G; g++) {
            const float *qg = q + g * D;
            float acc = 0.f;
#pragma omp simd reduction(+ : acc)
            for (int64_t i = 0; i < D; i++) acc += qg[i] * k[i];
            acc *= scale;
            scores[g * len + t] = acc;
            if (acc > mx[g]) mx[g] = acc;
        }
    }
    for (int64_t g = 0; g < G; g++) {
        float s = 0.f;
        float *sg = scores + g * len;
        const float m = mx[g];
#pragma omp simd reduction(+ : s)
        for (int64_t t = 0; t < len; t++) {
            sg[t] = expf(sg[t] - m);
            s += sg[t];
        }
        sum[g] = s;
    }
    for (int64_t t = 0; t < len; t++) {
        const float *v = pool + (rows[t] + k_off + v_off) * D;
        for (int64_t g = 0; g < G; g++) {
            const float p = scores[g * len + t];
            float *og = out + g * D;
#pragma omp simd
            for (int64_t i = 0; i < D; i++) og[i] += p * v[i];
        }
    }
    for (int64_t g = 0; g < G; g++) {
        const float inv = 1.f / sum[g];
        float *og = out + g * D;
        for (int64_t i = 0; i < D; i++) og[i] *= inv;
    }
}

// Returns 0, or -1 when a dimension is out of range (G > MAX_G, D > MAX_D) or memory ran out.
int paged_decode_attention(const float *q, int64_t q_stride, const float *pool, const int64_t *rows,
                           const int64_t *lens, int64_t B, int64_t H, int64_t G, int64_t D, int64_t Lmax,
                           int64_t k_off, int64_t v_off, float scale, float *out) {
    if (G > MAX_G || D > MAX_D) return -1;
    int failed = 0;
#pragma omp parallel
    {
        float *scores = (float *)malloc(sizeof(float) * (size_t)(G * (Lmax > 0 ? Lmax : 1)));
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < B * H; bh++) {
            if (!scores) continue;
            const int64_t b = bh / H, h = bh % H;
            int64_t len = lens[b];
            if (len > Lmax) len = Lmax;
            const float *qb = q + b * q_stride + h * G * D;
            float *ob = out + bh * G * D;
            const int64_t *rb = rows + bh * Lmax;
            if (D == 64 && G == 1) one_head(qb, pool, rb, len, 1, 64, k_off, v_off, scale, ob, scores);
            else if (D == 64 && G == 2) one_head(qb, pool, rb, len, 2, 64, k_off, v_off, scale, ob, scores);
            else if (D == 64 && G == 3) one_head(qb, pool, rb, len, 3, 64, k_off, v_off, scale, ob, scores);
            else if (D == 64 && G == 4) one_head(qb, pool, rb, len, 4, 64, k_off, v_off, scale, ob, scores);
            else if (D == 128 && G == 1) one_head(qb, pool, rb, len, 1, 128, k_off, v_off, scale, ob, scores);
            else if (D == 128 && G == 2) one_head(qb, pool, rb, len, 2, 128, k_off, v_off, scale, ob, scores);
            else if (D == 128 && G == 4) one_head(qb, pool, rb, len, 4, 128, k_off, v_off, scale, ob, scores);
            else if (D == 128 && G == 8) one_head(qb, pool, rb, len, 8, 128, k_off, v_off, scale, ob, scores);
            else one_head(qb, pool, rb, len, G, D, k_off, v_off, scale, ob, scores);
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
