// A forward through every layer of a Llama-family decoder in one call (CPU, float32): a decode step, or
// an extend (prefill) batch whose requests have no cached prefix. Built and loaded by
// common/layers/native.py; common/models/llama.py calls it for the batches that qualify (one TP rank, no
// q/k norm, panel-packed weights, the native attention path) and runs its layer modules otherwise. It
// chains the same kernels those modules call, in the same order, so the two paths give identical
// results; what it saves is the Python between the kernels (~10 small calls and ~40 tensor operations
// per layer: several milliseconds per decode step; in a prefill, the time the second thread waits while
// the first runs that Python).
#include <stdint.h>
#include <string.h>

int packed_gemm(const float *x, int64_t ldx, const float *w, const float *bias, float *y, int64_t ldy, int64_t M,
                int64_t N, int64_t K);
int packed_gemm_i8(const float *x, int64_t ldx, const int8_t *wq, const float *scale, const float *bias, float *y,
                   int64_t ldy, int64_t M, int64_t N, int64_t K);
int packed_gemm_w8a8(const float *x, int64_t ldx, const int8_t *wq, const float *scale, const float *bias, float *y,
                     int64_t ldy, int64_t M, int64_t N, int64_t K);
int packed_gemm_silu(const float *x, int64_t ldx, const void *w, const float *scale, const float *bias,
                     float *act, int64_t ld_act, int64_t M, int64_t n, int64_t K);
int packed_gemm_blocks(const float *x, int64_t ldx, const uint8_t *wb, int64_t bits, const float *bias, float *y,
                       int64_t ldy, int64_t M, int64_t N, int64_t K);
int packed_gemm_blocks_rows(void);
void add_rms_norm(const float *x, int64_t x_stride, const float *residual, int64_t res_stride, float *res_out,
                  const float *w, float *out, int64_t rows, int64_t n, float eps);
void rotary_apply(const float *x, int64_t x_stride, const float *cos, const float *sin, float *out, int64_t T,
                  int64_t heads, int64_t D);
int paged_decode_attention(const float *q, int64_t q_stride, float *pool, const int64_t *rows, const int64_t *lens,
                           int64_t B, int64_t H, int64_t G, int64_t D, int64_t Lmax, int64_t k_off, int64_t v_off,
                           float scale, float *out, const float *k_new, int64_t k_stride, const float *v_new,
                           int64_t v_stride, const int64_t *write_rows);
void silu_and_mul(const float *x, int64_t x_stride, float *out, int64_t rows, int64_t n);
void kv_store(float *pool, const int64_t *rows, int64_t T, int64_t H, int64_t D, int64_t k_off, int64_t v_off,
              const float *k, int64_t k_stride, const float *v, int64_t v_stride);
int prefill_attention(const float *q, int64_t q_stride, const float *k, int64_t k_tok, const float *v,
                      int64_t v_tok, int64_t kv_head, int64_t n, int64_t prefix, int64_t H, int64_t G, int64_t D,
                      float scale, float *out, int64_t o_stride);

// One layer's weights (panel-packed projections; biases and the KV offset may be 0 / NULL). A projection
// with a scale is int8: with int8 activations too when `int8_activations` (`packed_gemm_w8a8`), else
// weight-only (`packed_gemm_i8`); one without a scale is float32, and may also have its checkpoint's blocks
// of `bits` 4 or 8 (`gemm_blocks.c`), read instead when the batch is small enough.
typedef struct {
    const float *input_norm, *post_norm;
    const void *qkv, *o, *gate_up, *down;
    const float *qkv_bias, *o_bias, *gate_up_bias, *down_bias;
    const float *qkv_scale, *o_scale, *gate_up_scale, *down_scale;
    const uint8_t *qkv_blocks, *o_blocks, *gate_up_blocks, *down_blocks;
    int64_t qkv_bits, o_bits, gate_up_bits, down_bits;
    int64_t kv_offset;  // the layer's K rows = token rows + kv_offset
    int64_t int8_activations;
} DecoderLayer;

#define WEIGHTS(L, p) L->p, L->p##_scale, L->p##_blocks, L->p##_bits, L->p##_bias

// Returns 0, or -2 when the matmul found no memory for its packed or quantized activations.
static int gemm(const DecoderLayer *L, const float *x, int64_t ldx, const void *w, const float *scale,
                const uint8_t *blocks, int64_t bits, const float *bias, float *y, int64_t ldy, int64_t M, int64_t N,
                int64_t K) {
    int rc;
    if (blocks && M <= packed_gemm_blocks_rows())
        rc = packed_gemm_blocks(x, ldx, blocks, bits, bias, y, ldy, M, N, K);
    else if (scale && L->int8_activations)
        rc = packed_gemm_w8a8(x, ldx, (const int8_t *)w, scale, bias, y, ldy, M, N, K);
    else if (scale)
        rc = packed_gemm_i8(x, ldx, (const int8_t *)w, scale, bias, y, ldy, M, N, K);
    else
        rc = packed_gemm(x, ldx, (const float *)w, bias, y, ldy, M, N, K);
    return rc ? -2 : 0;
}

// Whether gemm() reads projection p of L from its panels (float32, or int8 with float32 activations) for M rows.
#define ON_PANELS(L, p, M) (!((L)->p##_blocks && (M) <= packed_gemm_blocks_rows()) && \
                            !((L)->p##_scale && (L)->int8_activations))

// The MLP's gate and up projection and its SiLU-and-mul, act [M, inter] from x [M, E]: in one pass
// through the panels (packed_gemm_silu) where the matmul reads them (float32 or int8 weights, inter a
// multiple of its tiles' columns), else the matmul into gate_up [M, 2 inter], then silu_and_mul. The same
// bits either way.
static int gate_up_silu(const DecoderLayer *L, const float *x, int64_t E, float *gate_up, float *act, int64_t M,
                        int64_t inter) {
    if (ON_PANELS(L, gate_up, M)) {
        const int rc = packed_gemm_silu(x, E, L->gate_up, L->gate_up_scale, L->gate_up_bias, act, inter, M,
                                        inter, E);
        if (rc != -3)
            return rc ? -2 : 0;
    }
    const int rc = gemm(L, x, E, WEIGHTS(L, gate_up), gate_up, 2 * inter, M, 2 * inter, E);
    if (rc == 0)
        silu_and_mul(gate_up, 2 * inter, act, M, inter);
    return rc;
}

// gemm() over the panels of the qkv projection's N columns from column `col` on (a multiple of 16: a panel
// holds 16 columns of E weights each, float32 or, with a scale, int8): y = x W[col..col + N)^T + bias[col..].
static int qkv_columns(const DecoderLayer *L, int64_t col, const float *x, float *y, int64_t ldy, int64_t M,
                       int64_t N, int64_t E) {
    const void *w = L->qkv_scale ? (const void *)((const int8_t *)L->qkv + col * E)
                                 : (const void *)((const float *)L->qkv + col * E);
    return gemm(L, x, E, w, L->qkv_scale ? L->qkv_scale + col : 0, 0, 0, L->qkv_bias ? L->qkv_bias + col : 0, y,
                ldy, M, N, E);
}

// The shapes every layer shares, and this forward's batch.
typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, inter;
    float eps, scale;
    int64_t tokens;  // T: one new token per request in decode, every request's new tokens in an extend
    const float *cos, *sin;  // [T, head_dim / 2]
    float *pool;  // the KV pool's flat [rows, head_dim] view
    // attention metadata (common/layers/attention.py): write_rows [T * kv_heads]; rows, lens and max_len
    // for decode
    const int64_t *rows, *lens, *write_rows;
    int64_t max_len, v_offset;
    // scratch, each at least: qkv T*(H+2K)*D, qk T*(H+K)*D, attn T*H*D, x T*hidden, gate_up T*2*inter,
    // act T*inter
    float *qkv, *qk, *attn, *x, *gate_up, *act;
    // extend: `seqs` requests, request i's new tokens at rows seq_starts[i].. seq_starts[i] + seq_lens[i] - 1
    // (0 for decode)
    int64_t seqs;
    const int64_t *seq_starts, *seq_lens;
    // the rows that go on past the last layer's attention (each < tokens, in any order), or NULL for all:
    // the rows whose logits are wanted, when no other row's hidden state is
    const int64_t *keep;
    int64_t n_keep;
} DecodeStep;

// Whether the last layer of an extend with `keep` can project Q for the kept rows alone (kept_qkv): its
// qkv projection reads panels at T rows, Q ends on a panel's edge, and gate_up has room for the kept
// rows' x and Q.
static int splits_qkv(const DecoderLayer *L, const DecodeStep *s, int64_t T) {
    const int64_t q_size = s->heads * s->head_dim;
    return ON_PANELS(L, qkv, T) && q_size % 16 == 0 && 2 * s->inter >= s->hidden + q_size;
}

// That projection: K and V for every row (their panels alone), Q for the kept rows only, each into its row
// of qkv (the other rows' Q columns keep what they held: nothing uses them). The panels give a row the
// same bits in any batch, so these are the full matmul's values. The kept rows' x is gathered into
// gate_up (free until the MLP), then their Q. Returns 0 or -2.
static int kept_qkv(const DecoderLayer *L, const DecodeStep *s, int64_t T) {
    const int64_t E = s->hidden, q_size = s->heads * s->head_dim, kv = 2 * s->kv_heads * s->head_dim;
    const int64_t qkv_w = q_size + kv, n = s->n_keep;
    int rc = qkv_columns(L, q_size, s->x, s->qkv + q_size, qkv_w, T, kv, E);
    if (rc != 0)
        return rc;
    float *xk = s->gate_up, *qk = s->gate_up + n * E;
    for (int64_t i = 0; i < n; i++)
        memcpy(xk + i * E, s->x + s->keep[i] * E, sizeof(float) * (size_t)E);
    rc = qkv_columns(L, 0, xk, qk, q_size, n, q_size, E);
    if (rc != 0)
        return rc;
    for (int64_t i = 0; i < n; i++)
        memcpy(s->qkv + s->keep[i] * qkv_w, qk + i * q_size, sizeof(float) * (size_t)q_size);
    return 0;
}

// An extend's new K and V (every token's, columns q_size.. and q_size + kv_size.. of a qk / qkv row) into
// the pool, before its attention.
static void store_new_kv(const DecodeStep *s, const DecoderLayer *L, int64_t T) {
    const int64_t D = s->head_dim, K = s->kv_heads, q_size = s->heads * D, qk_w = q_size + K * D;
    kv_store(s->pool, s->write_rows, T, K, D, L->kv_offset, s->v_offset, s->qk + q_size, qk_w, s->qkv + qk_w,
             qk_w + K * D);
}

// An extend's attention: each request's causal attention over its own new tokens, K and V read in place
// from the projection's output (no request has a prefix).
static int extend_attention(const DecodeStep *s) {
    const int64_t D = s->head_dim, H = s->heads, K = s->kv_heads;
    const int64_t q_size = H * D, qk_w = q_size + K * D, qkv_w = qk_w + K * D;
    for (int64_t i = 0; i < s->seqs; i++) {
        const int64_t at = s->seq_starts[i];
        const float *q = s->qk + at * qk_w;
        const int rc = prefill_attention(q, qk_w, q + q_size, qk_w, s->qkv + at * qkv_w + qk_w, qkv_w, D,
                                         s->seq_lens[i], 0, H, H / K, D, s->scale, s->attn + at * q_size, q_size);
        if (rc != 0)
            return rc;
    }
    return 0;
}

// The last layer's attention of an extend with `keep`: the kept rows' only (row i of the output for
// keep[i]), each one query over the keys of its request up to it. The same scores and sums, in the same
// order, as its row in extend_attention's blocks.
static int kept_attention(const DecodeStep *s) {
    const int64_t D = s->head_dim, H = s->heads, K = s->kv_heads;
    const int64_t q_size = H * D, qk_w = q_size + K * D, qkv_w = qk_w + K * D;
    for (int64_t i = 0; i < s->n_keep; i++) {
        const int64_t r = s->keep[i];
        int64_t at = -1;
        for (int64_t j = 0; j < s->seqs && at < 0; j++)
            if (r >= s->seq_starts[j] && r < s->seq_starts[j] + s->seq_lens[j])
                at = s->seq_starts[j];
        if (at < 0)
            return -3;
        const float *keys = s->qk + at * qk_w + q_size;
        const int rc = prefill_attention(s->qk + r * qk_w, qk_w, keys, qk_w, s->qkv + at * qkv_w + qk_w, qkv_w, D,
                                         1, r - at, H, H / K, D, s->scale, s->attn + i * q_size, q_size);
        if (rc != 0)
            return rc;
    }
    return 0;
}

// rows keep[0..n-1] of m [*, E] to its first n rows, in keep's order (any order, repeats too), through
// scratch [n, E].
static void keep_rows(float *m, const int64_t *keep, int64_t n, int64_t E, float *scratch) {
    for (int64_t i = 0; i < n; i++)
        memcpy(scratch + i * E, m + keep[i] * E, sizeof(float) * (size_t)E);
    memcpy(m, scratch, sizeof(float) * (size_t)(n * E));
}

// h [T, hidden]: the embeddings in, the last layer's MLP output out. residual [T, hidden]: out only (the
// running sum before the last layer's MLP), as the modules leave them for the final norm. With `keep`,
// only its rows come out, in its order, in the first n_keep rows of both.
// Returns 0, the attention kernel's error, -2 (no memory for a matmul's activations) or -3 (a kept row out
// of range or in no request, or kept rows in a decode step).
int decoder_stack(const DecoderLayer *layers, int64_t n_layers, const DecodeStep *s, float *h, float *residual) {
    const int64_t E = s->hidden, D = s->head_dim, H = s->heads, K = s->kv_heads;
    int64_t T = s->tokens;
    if (s->keep && (s->n_keep > T || !s->seqs))  // kept rows: an extend's only
        return -3;
    for (int64_t i = 0; s->keep && i < s->n_keep; i++)
        if (s->keep[i] < 0 || s->keep[i] >= T)
            return -3;
    const int64_t q_size = H * D, kv_size = K * D, qkv_w = q_size + 2 * kv_size, qk_w = q_size + kv_size;
    for (int64_t l = 0; l < n_layers; l++) {
        const DecoderLayer *L = layers + l;
        if (l == 0) {  // the first layer's residual is its input
            memcpy(residual, h, sizeof(float) * (size_t)(T * E));
            add_rms_norm(h, E, 0, 0, 0, L->input_norm, s->x, T, E, s->eps);
        } else {
            add_rms_norm(h, E, residual, E, residual, L->input_norm, s->x, T, E, s->eps);
        }
        const int kept = s->keep && l == n_layers - 1;  // only the kept rows go on past K and V
        int rc = kept && splits_qkv(L, s, T) ? kept_qkv(L, s, T)
                                             : gemm(L, s->x, E, WEIGHTS(L, qkv), s->qkv, qkv_w, T, qkv_w, E);
        if (rc != 0) return rc;
        rotary_apply(s->qkv, qkv_w, s->cos, s->sin, s->qk, T, H + K, D);
        if (s->seqs) {
            store_new_kv(s, L, T);
            rc = kept ? kept_attention(s) : extend_attention(s);
        } else {
            rc = paged_decode_attention(s->qk, qk_w, s->pool, s->rows, s->lens, T, K, H / K, D, s->max_len,
                                        L->kv_offset, s->v_offset, s->scale, s->attn, s->qk + q_size, qk_w,
                                        s->qkv + qk_w, qkv_w, s->write_rows);
        }
        if (rc != 0) return rc;
        if (kept) {  // the kept rows' residuals to the front, through x (free until the norm)
            keep_rows(residual, s->keep, s->n_keep, E, s->x);
            T = s->n_keep;
        }
        // the kept rows' o projection through the panels, as the modules' projection of every row: not
        // through the checkpoint's blocks, which a few rows would take
        rc = gemm(L, s->attn, q_size, L->o, L->o_scale, kept ? 0 : L->o_blocks, L->o_bits, L->o_bias, h, E, T, E,
                  q_size);
        if (rc != 0) return rc;
        add_rms_norm(h, E, residual, E, residual, L->post_norm, s->x, T, E, s->eps);
        rc = gate_up_silu(L, s->x, E, s->gate_up, s->act, T, s->inter);
        if (rc != 0) return rc;
        rc = gemm(L, s->act, s->inter, WEIGHTS(L, down), h, E, T, E, s->inter);
        if (rc != 0) return rc;
    }
    return 0;
}
