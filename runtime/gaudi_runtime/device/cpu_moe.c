/* A mixture-of-experts layer's routed experts on a CPU, in one call: for every token t and each of its
   k routed experts e (ascending), y = w2[e] (silu(gate_e x_t) * up_e x_t), and out[t] = the sum of
   weight[t, j] * y over its experts, added in ascending expert order.

   At decode sizes each routed expert has a few rows, and Python running each expert's products as torch
   calls of their own costs more than the products (docs/performance.md). Here one call reads each routed
   expert's weights once: phase 1 splits every used expert's intermediate rows over the threads (a gate
   row and its up row together, so silu(gate) * up is formed where both are computed); phase 2 splits the
   experts' output rows; phase 3 adds each token's experts. A row's sums are taken in one order that
   depends on that row alone, so a token's output does not depend on what else is in the step.

   bfloat16 rounds where torch's bfloat16 ops round (each product's output, silu, the gated product,
   each weighted term and each addition), so results match `layers/moe.grouped_experts` up to the dot
   products' summation order. Layouts (contiguous): x [T, H], ids int64 [T, k], weights float32 [T, k],
   w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I], out [T, H]; x, w13, w2 and out of one dtype. */

#include <math.h>
#include <stdlib.h>

#include "cpu_vectors.h"

enum { DTYPE_FLOAT32 = 0, DTYPE_BFLOAT16 = 1 };
/* Activation rows multiplied per read of a weight row (two accumulators each, held in registers): four
   float32 rows, or eight bfloat16 ones with the CPU's bfloat16 dot product (no widened copies to hold). */
enum { ROW_BLOCK = 4, DP_ROW_BLOCK = 8 };
/* Weight rows per unit of work: phase 1 takes this many gate rows and as many up rows, phase 2 this
   many output rows; small enough that every thread gets several units at decode sizes. */
enum { GATE_ROWS_PER_UNIT = 32, OUT_ROWS_PER_UNIT = 64 };

ALWAYS_INLINE float scalar_at(const void *p, int64_t i, const int bf16) {
    if (!bf16) return ((const float *)p)[i];
    const uint32_t bits = (uint32_t)((const uint16_t *)p)[i] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* float32 -> the nearest bfloat16 value (ties to even, as torch rounds), as a float; float32 kept. */
ALWAYS_INLINE float rounded(float v, const int bf16) {
    if (!bf16) return v;
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return v;
    bits = ((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16) << 16;
    memcpy(&v, &bits, sizeof v);
    return v;
}

/* res[m] = rows[m] . w for N (1 .. ROW_BLOCK, a constant: the accumulators then stay in registers) float32
   rows and one float32 or bfloat16 weight row of length len. Two accumulators per row, lanes summed
   pairwise: a row's sum in one order whatever N is. */
ALWAYS_INLINE void dots_n(float *res, const float *const *rows, const void *w, int64_t len, const int bf16,
                          const int N) {
    f32xL even[ROW_BLOCK], odd[ROW_BLOCK];
#pragma GCC unroll 4
    for (int m = 0; m < N; m++) even[m] = odd[m] = (f32xL){0};
    int64_t i = 0;
    for (; i + 2 * LANES <= len; i += 2 * LANES) {
        const f32xL wa = load_plain(w, i, bf16), wb = load_plain(w, i + LANES, bf16);
#pragma GCC unroll 4
        for (int m = 0; m < N; m++) {
            f32xL xa, xb;
            memcpy(&xa, rows[m] + i, sizeof xa);
            memcpy(&xb, rows[m] + i + LANES, sizeof xb);
            even[m] += xa * wa;
            odd[m] += xb * wb;
        }
    }
#pragma GCC unroll 4
    for (int m = 0; m < N; m++) {
        const f32xL sum = even[m] + odd[m];
        float lanes[LANES];
        memcpy(lanes, &sum, sizeof lanes);
        for (int width = LANES / 2; width > 0; width /= 2)
            for (int l = 0; l < width; l++) lanes[l] += lanes[l + width];
        float v = lanes[0];
        for (int64_t j = i; j < len; j++) v += rows[m][j] * scalar_at(w, j, bf16);
        res[m] = v;
    }
}

ALWAYS_INLINE void dots(float *res, const float *const *rows, const int n, const void *w, int64_t len,
                        const int bf16) {
    switch (n) {
        case 1: dots_n(res, rows, w, len, bf16, 1); break;
        case 2: dots_n(res, rows, w, len, bf16, 2); break;
        case 3: dots_n(res, rows, w, len, bf16, 3); break;
        default: dots_n(res, rows, w, len, bf16, 4); break;
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
/* With the CPU's bfloat16 dot product the activations stay bfloat16 (products exact, float32 sums, 32
   values per instruction): twice the float32 loop's values per instruction, and nothing to widen. */
#define ACT_BF16 1

ALWAYS_INLINE void dp_dots_n(float *res, const uint16_t *const *rows, const uint16_t *w, int64_t len, const int N) {
    __m512 a[DP_ROW_BLOCK], b[DP_ROW_BLOCK];
#pragma GCC unroll 8
    for (int m = 0; m < N; m++) a[m] = b[m] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 64 <= len; i += 64) {
        const __m512bh wa = (__m512bh)_mm512_loadu_si512(w + i), wb = (__m512bh)_mm512_loadu_si512(w + i + 32);
#pragma GCC unroll 8
        for (int m = 0; m < N; m++) {
            a[m] = _mm512_dpbf16_ps(a[m], (__m512bh)_mm512_loadu_si512(rows[m] + i), wa);
            b[m] = _mm512_dpbf16_ps(b[m], (__m512bh)_mm512_loadu_si512(rows[m] + i + 32), wb);
        }
    }
    for (; i < len; i += 32) {
        const __mmask32 lanes = len - i >= 32 ? 0xffffffffu : (1u << (len - i)) - 1u;
        const __m512bh wa = (__m512bh)_mm512_maskz_loadu_epi16(lanes, w + i);
#pragma GCC unroll 8
        for (int m = 0; m < N; m++)
            a[m] = _mm512_dpbf16_ps(a[m], (__m512bh)_mm512_maskz_loadu_epi16(lanes, rows[m] + i), wa);
    }
#pragma GCC unroll 8
    for (int m = 0; m < N; m++) res[m] = _mm512_reduce_add_ps(_mm512_add_ps(a[m], b[m]));
}

ALWAYS_INLINE void dp_dots(float *res, const void *const *rows, const int n, const void *w, int64_t len) {
    const uint16_t *const *r = (const uint16_t *const *)rows;
    switch (n) {
        case 1: dp_dots_n(res, r, w, len, 1); break;
        case 2: dp_dots_n(res, r, w, len, 2); break;
        case 3: dp_dots_n(res, r, w, len, 3); break;
        case 4: dp_dots_n(res, r, w, len, 4); break;
        case 5: dp_dots_n(res, r, w, len, 5); break;
        case 6: dp_dots_n(res, r, w, len, 6); break;
        case 7: dp_dots_n(res, r, w, len, 7); break;
        default: dp_dots_n(res, r, w, len, 8); break;
    }
}
#else
#define ACT_BF16 0
#endif

/* The activations a phase multiplies: bfloat16 as stored where ACT_BF16 takes them, else float32. */
ALWAYS_INLINE int act_bf16(const int bf16) { return ACT_BF16 && bf16; }

ALWAYS_INLINE int row_block(const int bf16) { return act_bf16(bf16) ? DP_ROW_BLOCK : ROW_BLOCK; }

/* res[m] = rows[m] . w for n (1 .. row_block) activation rows (act_bf16's dtype) and one weight row. */
ALWAYS_INLINE void row_dots(float *res, const void *const *rows, const int n, const void *w, int64_t len,
                            const int bf16) {
#if ACT_BF16
    if (bf16) {
        dp_dots(res, rows, n, w, len);
        return;
    }
#endif
    dots(res, (const float *const *)rows, n, w, len, bf16);
}

ALWAYS_INLINE void store_act(void *base, size_t i, float v, const int bf16) {
    if (act_bf16(bf16)) {
        uint32_t bits;
        memcpy(&bits, &v, sizeof bits);
        ((uint16_t *)base)[i] = (uint16_t)(bits >> 16);  /* v is a bfloat16 value already */
    } else {
        ((float *)base)[i] = v;
    }
}

/* Which pairs (t * k + j) each expert got: pairs[start[e] .. start[e + 1]) ascending; the used experts
   in used[0 .. returned count). */
static int64_t group_pairs(const int64_t *ids, int64_t pairs_total, int64_t experts, int64_t *start,
                           int64_t *pairs, int64_t *used) {
    for (int64_t e = 0; e <= experts; e++) start[e] = 0;
    for (int64_t p = 0; p < pairs_total; p++) start[ids[p] + 1]++;
    int64_t n_used = 0;
    for (int64_t e = 0; e < experts; e++) {
        if (start[e + 1]) used[n_used++] = e;
        start[e + 1] += start[e];
    }
    int64_t *fill = malloc((size_t)(experts > 0 ? experts : 1) * sizeof *fill);
    if (!fill) return -1;
    memcpy(fill, start, (size_t)experts * sizeof *fill);
    for (int64_t p = 0; p < pairs_total; p++) pairs[fill[ids[p]]++] = p;
    free(fill);
    return n_used;
}

/* Phase 1, one unit: gate/up rows [r0, r1) of expert e for its pairs; h[p, r] = silu(gate) * up. `xa`:
   the activation rows, [T, hidden] of act_bf16's dtype. */
ALWAYS_INLINE void gated_unit(void *h, const void *xa, const void *w13, const int64_t *pairs, int64_t n_pairs,
                              int64_t e, int64_t r0, int64_t r1, int64_t hidden, int64_t inter, int64_t k,
                              const int bf16) {
    const size_t row_bytes = (size_t)hidden * (bf16 ? 2 : 4), act_row = (size_t)hidden * (act_bf16(bf16) ? 2 : 4);
    const char *expert = (const char *)w13 + (size_t)e * 2 * (size_t)inter * row_bytes;
    for (int64_t r = r0; r < r1; r++) {
        const void *gate = expert + (size_t)r * row_bytes, *up = expert + (size_t)(inter + r) * row_bytes;
        for (int64_t q = 0; q < n_pairs; q += row_block(bf16)) {
            const int n = n_pairs - q < row_block(bf16) ? (int)(n_pairs - q) : row_block(bf16);
            const void *rows[DP_ROW_BLOCK];
            float g[DP_ROW_BLOCK], u[DP_ROW_BLOCK];
            for (int m = 0; m < n; m++) rows[m] = (const char *)xa + (size_t)(pairs[q + m] / k) * act_row;
            row_dots(g, rows, n, gate, hidden, bf16);
            row_dots(u, rows, n, up, hidden, bf16);
            for (int m = 0; m < n; m++) {
                const float gr = rounded(g[m], bf16);
                const float act = rounded(gr / (1.0f + expf(-gr)), bf16);
                store_act(h, (size_t)pairs[q + m] * (size_t)inter + r, rounded(act * rounded(u[m], bf16), bf16), bf16);
            }
        }
    }
}

/* Phase 2, one unit: output rows [o0, o1) of expert e for its pairs; y[p, o] = h[p] . w2[e, o]. */
ALWAYS_INLINE void down_unit(float *y, const void *h, const void *w2, const int64_t *pairs, int64_t n_pairs,
                             int64_t e, int64_t o0, int64_t o1, int64_t hidden, int64_t inter, const int bf16) {
    const size_t row_bytes = (size_t)inter * (bf16 ? 2 : 4), act_row = (size_t)inter * (act_bf16(bf16) ? 2 : 4);
    const char *expert = (const char *)w2 + (size_t)e * (size_t)hidden * row_bytes;
    for (int64_t o = o0; o < o1; o++) {
        const void *row = expert + (size_t)o * row_bytes;
        for (int64_t q = 0; q < n_pairs; q += row_block(bf16)) {
            const int n = n_pairs - q < row_block(bf16) ? (int)(n_pairs - q) : row_block(bf16);
            const void *rows[DP_ROW_BLOCK];
            float v[DP_ROW_BLOCK];
            for (int m = 0; m < n; m++) rows[m] = (const char *)h + (size_t)pairs[q + m] * act_row;
            row_dots(v, rows, n, row, inter, bf16);
            for (int m = 0; m < n; m++) y[(size_t)pairs[q + m] * (size_t)hidden + o] = rounded(v[m], bf16);
        }
    }
}

/* Phase 3: out[t] = the weighted sum of its k experts' outputs, added in ascending expert order. */
static void combine(void *out, const float *y, const float *weights, int64_t tokens, int64_t k, int64_t hidden,
                    const int bf16, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < tokens; t++)
        for (int64_t c = 0; c < hidden; c++) {
            float acc = 0.0f;
            for (int64_t j = 0; j < k; j++) {
                const int64_t p = t * k + j;
                acc = rounded(acc + rounded(y[(size_t)p * (size_t)hidden + c] * weights[p], bf16), bf16);
            }
            if (bf16) {
                uint32_t bits;
                memcpy(&bits, &acc, sizeof bits);
                ((uint16_t *)out)[(size_t)t * (size_t)hidden + c] = (uint16_t)(bits >> 16);
            } else {
                ((float *)out)[(size_t)t * (size_t)hidden + c] = acc;
            }
        }
}

/* Phases 1 and 2 over every used expert, the units shared out among the threads as they come free. */
ALWAYS_INLINE void experts_phases(void *h, float *y, const void *xa, const void *w13, const void *w2,
                                  const int64_t *start, const int64_t *pairs, const int64_t *used, int64_t n_used,
                                  int64_t k, int64_t hidden, int64_t inter, const int bf16, int threads) {
    const int64_t gate_units = (inter + GATE_ROWS_PER_UNIT - 1) / GATE_ROWS_PER_UNIT;
    const int64_t out_units = (hidden + OUT_ROWS_PER_UNIT - 1) / OUT_ROWS_PER_UNIT;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < n_used * gate_units; u++) {
            const int64_t e = used[u / gate_units], r0 = (u % gate_units) * GATE_ROWS_PER_UNIT;
            const int64_t r1 = r0 + GATE_ROWS_PER_UNIT < inter ? r0 + GATE_ROWS_PER_UNIT : inter;
            gated_unit(h, xa, w13, pairs + start[e], start[e + 1] - start[e], e, r0, r1, hidden, inter, k, bf16);
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < n_used * out_units; u++) {
            const int64_t e = used[u / out_units], o0 = (u % out_units) * OUT_ROWS_PER_UNIT;
            const int64_t o1 = o0 + OUT_ROWS_PER_UNIT < hidden ? o0 + OUT_ROWS_PER_UNIT : hidden;
            down_unit(y, h, w2, pairs + start[e], start[e + 1] - start[e], e, o0, o1, hidden, inter, bf16);
        }
    }
}

/* Returns 0, or -2 when there is no memory for the work buffers. `ids` must hold experts < `experts`. */
int moe_experts(void *out, const void *x, const int64_t *ids, const float *weights, const void *w13, const void *w2,
                int64_t tokens, int64_t k, int64_t experts, int64_t hidden, int64_t inter, int dtype, int threads) {
    const int bf16 = dtype == DTYPE_BFLOAT16;
    const int64_t n = tokens * k;
    /* float32 activations widened (unless ACT_BF16 takes bfloat16 as stored), h, y. */
    float *work = malloc((size_t)(tokens * hidden + n * inter + n * hidden + 1) * sizeof(float));
    int64_t *index = malloc((size_t)(2 * experts + 1 + n + 1) * sizeof(int64_t));
    int64_t n_used = work && index ? group_pairs(ids, n, experts, index, index + experts + 1, index + experts + 1 + n)
                                   : -1;
    if (n_used < 0) {
        free(work);
        free(index);
        return -2;
    }
    float *xs = work, *h = xs + tokens * hidden, *y = h + n * inter;
    const int64_t *start = index, *pairs = index + experts + 1, *used = index + experts + 1 + n;
    if (act_bf16(bf16)) {
        experts_phases(h, y, x, w13, w2, start, pairs, used, n_used, k, hidden, inter, 1, threads);
    } else {
        for (int64_t i = 0; i < tokens * hidden; i++) xs[i] = scalar_at(x, i, bf16);
        if (bf16)
            experts_phases(h, y, xs, w13, w2, start, pairs, used, n_used, k, hidden, inter, 1, threads);
        else
            experts_phases(h, y, xs, w13, w2, start, pairs, used, n_used, k, hidden, inter, 0, threads);
    }
    combine(out, y, weights, tokens, k, hidden, bf16, threads);
    free(work);
    free(index);
    return 0;
}
