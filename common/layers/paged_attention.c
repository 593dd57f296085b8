// Paged decode attention on CPU, reading K and V in place from the KV pool (no gather copy).
// Built and loaded by common/layers/native.py; the torch path in attention.py computes the same.
//
// With AVX2 + FMA and a head size that is a multiple of 8, `heads_avx2` runs: scores for 8 tokens at a
// time (8 dot-product accumulators folded into one vector by a horizontal-add tree, so there is no
// horizontal sum per token), a vectorised softmax with its own exp, and P.V with up to 64 output floats
// held in registers across the tokens.
// Otherwise `one_head` runs its plain loops, which the compiler vectorises per token.
//
// pool: the KV pool's flat [rows, D] view (float32). rows[b, h, t] is the flat row of token t's K
// for request b and KV head h in the first layer; a layer's K row is rows + k_off, its V row
// rows + k_off + v_off. q is [B, H, G, D] (G query heads per KV head) with q_stride floats from
// one request to the next; out is [B, H, G, D] contiguous.
// When write_rows is given, each request's new K and V (k_new / v_new: [B, H, D] with k_stride /
// v_stride floats from one request to the next) are first stored at flat row write_rows[b * H + h]
// (+ the layer's offsets), so the step needs no separate scatter; all of them before any is read, so a
// "request" may be one token of a speculative verify step that attends to the tokens before it.
// Request b attends to its first lens[b] tokens. Each K and V row is read once for the G query heads that
// share it. A (b, h) pair of up to SPAN tokens is one task; a longer one is split into spans of SPAN
// tokens (the last one shorter), each a task that keeps its softmax unnormalised (its max, its sum of
// exponentials and its P.V), and the spans are then combined in order. A single stream has as many
// pairs as KV heads (3 for SmolLM2), which two threads split 2 : 1; its spans split more evenly, and they
// are handed out as threads come free, so a thread the OS preempts holds up less. One stream's 30 layers
// at 576 tokens of context: 1.30x, at 2000 1.53x (SPAN 128 was slower than one task a pair at 200). The
// spans depend on a request's own length alone, so a request gets the same bits whatever the batch and
// thread count.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX2__) && defined(__FMA__)
#include "vec_math.h"
#endif

#define MAX_G 64
#define MAX_D 512
#define SPAN 256         // tokens of one task (AVX2 path)
#define MAX_SPANS 4096   // spans of one (b, h): contexts up to 512 Ki tokens

void *gemm_scratch(int slot, size_t bytes);  // gemm.c

// One (request, KV head): the G query heads at q attend to len tokens; out gets [G, D]. scores: G * len floats.
static void one_head(const float *q, const float *pool, const int64_t *rows, int64_t len, int64_t G,
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

#if defined(__AVX2__) && defined(__FMA__)
// the 8 lanes of a0..a7 summed: lane j of the result is the sum of aj
static inline __m256 sum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6, __m256 a7) {
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

static inline float dot(const float *a, const float *b, int64_t D) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < D; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    return hsum8(acc);
}

// scores[0..len) -> softmax, in place
static inline void softmax_row(float *sc, int64_t len) {
    __m256 vm = _mm256_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 8 <= len; i += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(sc + i));
    float m = hmax8(vm);
    for (; i < len; i++) m = sc[i] > m ? sc[i] : m;
    const float inv = 1.f / exp_shifted_sum(sc, len, m);
    const __m256 vinv = _mm256_set1_ps(inv);
    for (i = 0; i + 8 <= len; i += 8) _mm256_storeu_ps(sc + i, _mm256_mul_ps(_mm256_loadu_ps(sc + i), vinv));
    for (; i < len; i++) sc[i] *= inv;
}

// out[0 .. 8 NV) = sum over tokens i of s[i] * V_i[0 .. 8 NV) (V_i at vc + rows[i] * D): NV independent
// FMA chains, each V vector loaded once
#define PV_DECL(v) __m256 o##v = _mm256_setzero_ps();
#define PV_FMA(v) if (NV > v) o##v = _mm256_fmadd_ps(p, _mm256_loadu_ps(vi + 8 * v), o##v);
#define PV_STORE(v) if (NV > v) _mm256_storeu_ps(out + 8 * v, o##v);
#define PV_ALL(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7)
static inline __attribute__((always_inline)) void pv(const int NV, const float *s, int64_t len, const float *vc,
                                                     const int64_t *rows, int64_t D, float *out) {
    PV_ALL(PV_DECL)
    for (int64_t i = 0; i < len; i++) {
        const float *vi = vc + rows[i] * D;
        const __m256 p = _mm256_broadcast_ss(s + i);
        PV_ALL(PV_FMA)
    }
    PV_ALL(PV_STORE)
}
#define PV_CASE(v)                                     \
    case v:                                            \
        pv(v, sg, len, vc, rows, D, og);               \
        break;

// scores[g * len + t] = scale * q_g . K_t for the G query heads and tokens t of rows[0 .. len); D % 8 == 0.
static void scores_avx2(const float *q, const float *pool, const int64_t *rows, int64_t len, int64_t G, int64_t D,
                        int64_t k_off, int64_t v_off, float scale, float *scores) {
    const __m256 vscale = _mm256_set1_ps(scale);
    int64_t t = 0;
    for (; t + 8 <= len; t += 8) {
        const float *k[8];
        for (int j = 0; j < 8; j++) k[j] = pool + (rows[t + j] + k_off) * D;
        // A task's rows sit in 4 KB runs (a page of one layer and head) spread over the pool, which the
        // hardware prefetcher does not follow: ask for the K rows two blocks ahead and for this block's
        // V rows (read after the softmax) now. Measured ~15% faster with the KV coming from DRAM.
        for (int j = 0; j < 8; j++) {
            const char *vj = (const char *)(pool + (rows[t + j] + k_off + v_off) * D);
            const char *kj = t + 16 + j < len ? (const char *)(pool + (rows[t + 16 + j] + k_off) * D) : 0;
            for (int64_t b = 0; b < D * (int64_t)sizeof(float); b += 64) {
                _mm_prefetch(vj + b, _MM_HINT_T0);
                if (kj) _mm_prefetch(kj + b, _MM_HINT_T0);
            }
        }
        for (int64_t g = 0; g < G; g++) {
            const float *qg = q + g * D;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
            for (int64_t i = 0; i < D; i += 8) {
                const __m256 qv = _mm256_loadu_ps(qg + i);
                a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[0] + i), a0);
                a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[1] + i), a1);
                a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[2] + i), a2);
                a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[3] + i), a3);
                a4 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[4] + i), a4);
                a5 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[5] + i), a5);
                a6 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[6] + i), a6);
                a7 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[7] + i), a7);
            }
            _mm256_storeu_ps(scores + g * len + t, _mm256_mul_ps(sum8(a0, a1, a2, a3, a4, a5, a6, a7), vscale));
        }
    }
    for (; t < len; t++) {
        const float *kt = pool + (rows[t] + k_off) * D;
        for (int64_t g = 0; g < G; g++) scores[g * len + t] = dot(q + g * D, kt, D) * scale;
    }
}

// out[g] = sum over t of scores[g * len + t] * V_t, one query head x up to 64 output floats at a time
static void pv_avx2(const float *scores, const float *pool, const int64_t *rows, int64_t len, int64_t G, int64_t D,
                    int64_t k_off, int64_t v_off, float *out) {
    for (int64_t g = 0; g < G; g++) {
        const float *sg = scores + g * len;
        for (int64_t c = 0; c < D; c += 64) {
            const float *vc = pool + (k_off + v_off) * D + c;
            float *og = out + g * D + c;
            switch ((D - c < 64 ? D - c : 64) / 8) {
                PV_CASE(1) PV_CASE(2) PV_CASE(3) PV_CASE(4) PV_CASE(5) PV_CASE(6) PV_CASE(7) PV_CASE(8)
            }
        }
    }
}

// Same contract as one_head; D % 8 == 0, len <= SPAN (scores: G * SPAN floats).
static void heads_avx2(const float *q, const float *pool, const int64_t *rows, int64_t len, int64_t G, int64_t D,
                       int64_t k_off, int64_t v_off, float scale, float *out, float *scores) {
    if (len <= 0) {  // otherwise P.V stores every output
        for (int64_t g = 0; g < G * D; g++) out[g] = 0.f;
        return;
    }
    scores_avx2(q, pool, rows, len, G, D, k_off, v_off, scale, scores);
    for (int64_t g = 0; g < G; g++) softmax_row(scores + g * len, len);
    pv_avx2(scores, pool, rows, len, G, D, k_off, v_off, out);
}

// One span of a longer (b, h), 0 < len <= SPAN: its unnormalised softmax. part: G maxima, G sums of
// exponentials, then G x D sums of exp(score - max) * V.
static void span_avx2(const float *q, const float *pool, const int64_t *rows, int64_t len, int64_t G, int64_t D,
                      int64_t k_off, int64_t v_off, float scale, float *part, float *scores) {
    scores_avx2(q, pool, rows, len, G, D, k_off, v_off, scale, scores);
    for (int64_t g = 0; g < G; g++) {
        float *sg = scores + g * len;
        __m256 vm = _mm256_set1_ps(-INFINITY);
        int64_t i = 0;
        for (; i + 8 <= len; i += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(sg + i));
        float m = hmax8(vm);
        for (; i < len; i++) m = sg[i] > m ? sg[i] : m;
        part[g] = m;
        part[G + g] = exp_shifted_sum(sg, len, m);
    }
    pv_avx2(scores, pool, rows, len, G, D, k_off, v_off, part + 2 * G);
}

// The spans' parts of one (b, h), in order, into out [G, D]: each span weighted by exp(its max - the max).
static void combine_spans(const float *parts, int64_t spans, int64_t G, int64_t D, float *out) {
    const int64_t stride = G * (D + 2);
    for (int64_t g = 0; g < G; g++) {
        float m = -INFINITY;
        for (int64_t c = 0; c < spans; c++) m = parts[c * stride + g] > m ? parts[c * stride + g] : m;
        float w[MAX_SPANS], total = 0.f;
        for (int64_t c = 0; c < spans; c++) {
            w[c] = expf(parts[c * stride + g] - m);
            total += w[c] * parts[c * stride + G + g];
        }
        const float inv = 1.f / total;
        float *og = out + g * D;
        for (int64_t i = 0; i < D; i++) {
            float acc = 0.f;
            for (int64_t c = 0; c < spans; c++) acc += w[c] * parts[c * stride + 2 * G + g * D + i];
            og[i] = acc * inv;
        }
    }
}
#endif

// Returns 0, or -1 when a dimension is out of range (G > MAX_G, D > MAX_D, a context past MAX_SPANS spans)
// or memory ran out.
int paged_decode_attention(const float *q, int64_t q_stride, float *pool, const int64_t *rows,
                           const int64_t *lens, int64_t B, int64_t H, int64_t G, int64_t D, int64_t Lmax,
                           int64_t k_off, int64_t v_off, float scale, float *out, const float *k_new,
                           int64_t k_stride, const float *v_new, int64_t v_stride, const int64_t *write_rows) {
    if (G > MAX_G || D > MAX_D) return -1;
#if defined(__AVX2__) && defined(__FMA__)
    const int spans_ok = D % 8 == 0;  // the AVX2 heads split long contexts; the plain loop does not
#else
    const int spans_ok = 0;
#endif
    // tasks: one per (b, h) of at most SPAN tokens, else one per span; first[bh] is its first task
    int64_t *first = gemm_scratch(4, sizeof(int64_t) * (size_t)(B * H + 1));
    if (!first) return -1;
    int64_t tasks = 0, longest = 1;
    for (int64_t bh = 0; bh < B * H; bh++) {
        const int64_t len = lens[bh / H] < Lmax ? lens[bh / H] : Lmax;
        const int64_t spans = spans_ok && len > SPAN ? (len + SPAN - 1) / SPAN : 1;
        if (spans > MAX_SPANS) return -1;
        first[bh] = tasks;
        tasks += spans;
        longest = spans > longest ? spans : longest;
    }
    first[B * H] = tasks;
    // the spans' parts (only tasks of split pairs write theirs)
    float *parts = longest > 1 ? gemm_scratch(5, sizeof(float) * (size_t)(tasks * G * (D + 2))) : 0;
    if (longest > 1 && !parts) return -1;
    const int64_t span_cap = spans_ok ? (Lmax < SPAN ? (Lmax > 0 ? Lmax : 1) : SPAN) : (Lmax > 0 ? Lmax : 1);
    const int64_t stride = G * (D + 2);
    (void)stride;
    int failed = 0;
#pragma omp parallel
    {
        float *scores = gemm_scratch(6, sizeof(float) * (size_t)(G * span_cap));  // this thread's
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
        // every query token's K and V go into the pool first (the loop's barrier ends this): a token of
        // a speculative verify step reads the K/V of the tokens before it in the same step
        if (write_rows) {
#pragma omp for schedule(static)
            for (int64_t bh = 0; bh < B * H; bh++) {
                const int64_t b = bh / H, h = bh % H;
                float *kd = pool + (write_rows[bh] + k_off) * D, *vd = kd + v_off * D;
                const float *ks = k_new + b * k_stride + h * D, *vs = v_new + b * v_stride + h * D;
                for (int64_t i = 0; i < D; i++) {
                    kd[i] = ks[i];
                    vd[i] = vs[i];
                }
            }
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            if (!scores) continue;
            int64_t lo = 0, hi = B * H - 1;  // the pair whose tasks hold this one
            while (lo < hi) {
                const int64_t mid = (lo + hi + 1) / 2;
                if (first[mid] <= task) lo = mid; else hi = mid - 1;
            }
            const int64_t bh = lo, b = bh / H, h = bh % H, spans = first[bh + 1] - first[bh];
            const int64_t len = lens[b] < Lmax ? lens[b] : Lmax;
            const float *qb = q + b * q_stride + h * G * D;
            const int64_t *rb = rows + bh * Lmax;
            (void)spans;
#if defined(__AVX2__) && defined(__FMA__)
            if (spans > 1) {
                const int64_t t0 = (task - first[bh]) * SPAN;
                span_avx2(qb, pool, rb + t0, len - t0 < SPAN ? len - t0 : SPAN, G, D, k_off, v_off, scale,
                          parts + task * stride, scores);
                continue;
            }
            if (spans_ok) {
                heads_avx2(qb, pool, rb, len, G, D, k_off, v_off, scale, out + bh * G * D, scores);
                continue;
            }
#endif
            one_head(qb, pool, rb, len, G, D, k_off, v_off, scale, out + bh * G * D, scores);
        }
#if defined(__AVX2__) && defined(__FMA__)
        if (longest > 1) {
#pragma omp for schedule(static)
            for (int64_t bh = 0; bh < B * H; bh++)
                if (first[bh + 1] - first[bh] > 1)
                    combine_spans(parts + first[bh] * stride, first[bh + 1] - first[bh], G, D, out + bh * G * D);
        }
#endif
    }
    return failed ? -1 : 0;
}
