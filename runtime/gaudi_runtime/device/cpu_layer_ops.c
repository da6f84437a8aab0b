/* A decoder layer's small operations on a CPU, each in one call: RMSNorm with the residual add, rotary
   position embedding of q and k, and the write of k and v into the paged cache.

   In torch each of these is five to fifteen operators on a few thousand values, and at decode batch
   sizes their fixed costs, not their arithmetic, are what a step pays (docs/performance.md). The
   arithmetic here is torch's, operator by operator: every intermediate that torch rounds to the model's
   dtype is rounded here too, in the same order, so rotary and the cache writes give torch's bits and
   RMSNorm differs only where its sum of squares, added in another order, rounds differently.

   Layouts: rows of a tensor lie `stride` elements apart; within a row everything is contiguous. A
   row's last vector may be partial (LANES floats do not divide every size): it is read and written
   lane by lane. */

/* torch rounds each product before the sum, so no multiply-add may be fused here, which GCC otherwise
   does for -std=gnu11 (the line below is read by cpu_kernels.py, for every build of this file): */
// gaudi-serve cflags: -ffp-contract=off

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_vectors.h"

enum { DTYPE_FLOAT32 = 0, DTYPE_BFLOAT16 = 1 };
/* Below this many values a call runs on the calling thread: waking the pool costs more than it saves. */
enum { PARALLEL_MIN = 1 << 16 };

/* The first n (<= LANES) values from base + offset; the lanes past them are 0. */
ALWAYS_INLINE f32xL load_n(const void *base, int64_t offset, int64_t n, const int bf16) {
    if (n == LANES) return load_plain(base, offset, bf16);
    f32xL v = {};
    for (int64_t i = 0; i < n; i++) {
        if (bf16) {
            const uint32_t bits = (uint32_t)((const uint16_t *)base)[offset + i] << 16;
            memcpy((float *)&v + i, &bits, sizeof bits);
        } else {
            v[i] = ((const float *)base)[offset + i];
        }
    }
    return v;
}

/* The first n (<= LANES) lanes of v to base + offset, rounded to the dtype. */
ALWAYS_INLINE void store_n(void *base, int64_t offset, int64_t n, const int bf16, f32xL v) {
    if (bf16) {
        const u16xL h = __builtin_convertvector(to_bf16(v), u16xL);
        if (n == LANES) memcpy((uint16_t *)base + offset, &h, sizeof h);
        else for (int64_t i = 0; i < n; i++) ((uint16_t *)base)[offset + i] = h[i];
    } else {
        if (n == LANES) memcpy((float *)base + offset, &v, sizeof v);
        else for (int64_t i = 0; i < n; i++) ((float *)base)[offset + i] = v[i];
    }
}

/* Lanes of a row of `size` values from j on: a whole vector, or the partial last one. */
ALWAYS_INLINE int64_t lanes_at(int64_t j, int64_t size) {
    return size - j < LANES ? size - j : LANES;
}

/* v as the model's dtype holds it: what torch's result of an operator on that dtype would be. */
ALWAYS_INLINE f32xL round_to(f32xL v, const int bf16) {
    return bf16 ? (f32xL)(to_bf16(v) << 16) : v;
}

/* ---- RMSNorm -------------------------------------------------------------------------------------
   s = x + residual (rounded), out = weight * dtype(s * rsqrt(mean(s^2) + eps)), as layers/norm.py. */

ALWAYS_INLINE void norm_row(void *out, void *sum, const void *x, const void *residual, const void *weight,
                            int64_t row, int64_t hidden, int64_t x_stride, int64_t r_stride, float eps,
                            const int bf16) {
    const void *s = x;
    int64_t s_off = row * x_stride;
    f32xL squares = {};
    for (int64_t j = 0; j < hidden; j += LANES) {
        const int64_t n = lanes_at(j, hidden);
        f32xL v = load_n(x, row * x_stride + j, n, bf16);
        if (residual) {
            v = round_to(v + load_n(residual, row * r_stride + j, n, bf16), bf16);
            store_n(sum, row * hidden + j, n, bf16, v);
        }
        squares += v * v;
    }
    if (residual) s = sum, s_off = row * hidden;
    float total = 0.0f;
    for (int i = 0; i < LANES; i++) total += squares[i];
    const float scale = 1.0f / sqrtf(total / (float)hidden + eps);
    for (int64_t j = 0; j < hidden; j += LANES) {
        const int64_t n = lanes_at(j, hidden);
        const f32xL y = round_to(load_n(s, s_off + j, n, bf16) * scale, bf16);
        store_n(out, row * hidden + j, n, bf16, load_n(weight, j, n, bf16) * y);
    }
}

/* out [rows, hidden] = RMSNorm(x + residual) and sum [rows, hidden] = x + residual (residual NULL: of x,
   and sum is not written). */
void rms_norm(void *out, void *sum, const void *x, const void *residual, const void *weight, int64_t rows,
             int64_t hidden, int64_t x_stride, int64_t r_stride, float eps, int dtype, int num_threads) {
    const int bf16 = dtype == DTYPE_BFLOAT16;
#pragma omp parallel for num_threads(num_threads) if (num_threads > 1 && rows * hidden >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        if (bf16) norm_row(out, sum, x, residual, weight, r, hidden, x_stride, r_stride, eps, 1);
        else norm_row(out, sum, x, residual, weight, r, hidden, x_stride, r_stride, eps, 0);
    }
}

/* ---- rotary position embedding ---------------------------------------------------------------------
   The halves (x1, x2) of each head become (x1 cos - x2 sin, x2 cos + x1 sin) with the position's row of
   the cos and sin tables (in the model's dtype), each product and sum rounded as torch rounds it. */

ALWAYS_INLINE void rotate_heads(void *out, const void *in, int64_t in_off, int64_t out_off, int64_t heads,
                                int64_t head_dim, const void *cos, const void *sin, int64_t table_off,
                                const int bf16) {
    const int64_t half = head_dim / 2;
    for (int64_t h = 0; h < heads; h++) {
        const int64_t i0 = in_off + h * head_dim, o0 = out_off + h * head_dim;
        for (int64_t j = 0; j < half; j += LANES) {
            const int64_t n = lanes_at(j, half);
            const f32xL x1 = load_n(in, i0 + j, n, bf16), x2 = load_n(in, i0 + half + j, n, bf16);
            const f32xL c = load_n(cos, table_off + j, n, bf16), s = load_n(sin, table_off + j, n, bf16);
            const f32xL first = round_to(x1 * c, bf16) - round_to(x2 * s, bf16);
            const f32xL second = round_to(x2 * c, bf16) + round_to(x1 * s, bf16);
            store_n(out, o0 + j, n, bf16, first);
            store_n(out, o0 + half + j, n, bf16, second);
        }
    }
}

/* q_out [rows, q_heads, head_dim] and k_out [rows, k_heads, head_dim] (contiguous) from q and k rows
   (q_stride and k_stride apart, heads contiguous within a row), row r at positions[r]; cos and sin are
   [max_position, head_dim / 2] (head_dim even). Returns 0, or -1 (nothing written) when a position is
   outside the tables. */
int rotary(void *q_out, void *k_out, const void *q, const void *k, const void *cos, const void *sin,
           const int64_t *positions, int64_t rows, int64_t q_heads, int64_t k_heads, int64_t head_dim,
           int64_t q_stride, int64_t k_stride, int64_t max_position, int dtype, int num_threads) {
    for (int64_t r = 0; r < rows; r++)
        if (positions[r] < 0 || positions[r] >= max_position) return -1;
    const int bf16 = dtype == DTYPE_BFLOAT16;
    const int64_t half = head_dim / 2;
#pragma omp parallel for num_threads(num_threads) \
    if (num_threads > 1 && rows * (q_heads + k_heads) * head_dim >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t t = positions[r] * half;
        if (bf16) {
            rotate_heads(q_out, q, r * q_stride, r * q_heads * head_dim, q_heads, head_dim, cos, sin, t, 1);
            rotate_heads(k_out, k, r * k_stride, r * k_heads * head_dim, k_heads, head_dim, cos, sin, t, 1);
        } else {
            rotate_heads(q_out, q, r * q_stride, r * q_heads * head_dim, q_heads, head_dim, cos, sin, t, 0);
            rotate_heads(k_out, k, r * k_stride, r * k_heads * head_dim, k_heads, head_dim, cos, sin, t, 0);
        }
    }
    return 0;
}

/* ---- the paged cache's writes ------------------------------------------------------------------- */

/* Row r of k and v (row_bytes each, k_stride and v_stride bytes apart) into slot slots[r] of k_cache and
   v_cache (num_slots rows of row_bytes). Returns 0, or -1 (nothing written) when a slot is outside the
   caches. Rows naming the same slot are written in order: the last one stays. */
int write_kv(void *k_cache, void *v_cache, const void *k, const void *v, const int64_t *slots, int64_t rows,
             int64_t row_bytes, int64_t k_stride, int64_t v_stride, int64_t num_slots) {
    for (int64_t r = 0; r < rows; r++)
        if (slots[r] < 0 || slots[r] >= num_slots) return -1;
    for (int64_t r = 0; r < rows; r++) {
        memcpy((char *)k_cache + slots[r] * row_bytes, (const char *)k + r * k_stride, (size_t)row_bytes);
        memcpy((char *)v_cache + slots[r] * row_bytes, (const char *)v + r * v_stride, (size_t)row_bytes);
    }
    return 0;
}
