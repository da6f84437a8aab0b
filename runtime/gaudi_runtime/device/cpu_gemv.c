/* One activation row times a weight matrix on a CPU: y = x W^T (+ bias), with W [out, in] as loaded;
   then two to eight float32 rows; two to eight bfloat16 rows (with the CPU's bfloat16 dot product where
   it has avx512_bf16, else widened to float32); and, at the end of the file, any number of rows each
   summed in one order fixed by the row alone (gemm_fixed, the batch-invariant mode's product).

   Decode at batch 1 multiplies one row by every weight matrix of the model, a product bound by how
   fast the weights stream from memory. oneDNN (over its reordered weights) and torch's float32 path
   run it well below the memory's speed (docs/performance.md); this reads each weight row once, in
   order, one row per thread at a time, which the hardware prefetcher follows. Plain C with GCC/Clang
   vector types (no intrinsics, no -ffast-math); cpu_gemv.py builds and calls it.

   Layouts (contiguous): x [in], w [out, in], bias [out] or NULL, y [out]; all float32 or all bfloat16.
   Arithmetic is float32. Each output is summed by one thread in one fixed order, so the result does
   not depend on the thread count. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define ALWAYS_INLINE static inline __attribute__((always_inline))

enum { DTYPE_FLOAT32 = 0, DTYPE_BFLOAT16 = 1 };

/* One AVX-512 register of floats, else 8 lanes (one AVX2 register; two SSE or NEON ones). */
#if defined(__AVX512F__)
#define LANES 16
#else
#define LANES 8
#endif
/* Values of a row taken per step: two vectors (a cache line of bfloat16 with AVX-512). */
enum { STEP = 2 * LANES };
/* Rows up to this many values are done by one thread: splitting them costs more than it saves. */
enum { MIN_VALUES_PER_THREAD = 1 << 15 };

typedef float f32xL __attribute__((vector_size(LANES * 4)));
typedef uint32_t u32xL __attribute__((vector_size(LANES * 4)));

/* A step of a row as two vectors. bfloat16 is widened by shifting bits: the even-indexed values go to
   the first vector and the odd-indexed ones to the second. x is widened once into the same order. */
ALWAYS_INLINE void load_step(const void *row, int64_t i, const int bf16, f32xL *a, f32xL *b) {
    if (bf16) {
        u32xL pairs;
        memcpy(&pairs, (const uint16_t *)row + i, sizeof pairs);
        *a = (f32xL)(pairs << 16);
        *b = (f32xL)(pairs & 0xffff0000u);
    } else {
        memcpy(a, (const float *)row + i, sizeof *a);
        memcpy(b, (const float *)row + i + LANES, sizeof *b);
    }
}

ALWAYS_INLINE float load_one(const void *p, int64_t i, const int bf16) {
    if (bf16) {
        const uint32_t bits = (uint32_t)((const uint16_t *)p)[i] << 16;
        float f;
        memcpy(&f, &bits, sizeof f);
        return f;
    }
    return ((const float *)p)[i];
}

/* float32 -> bfloat16 bits, rounded to nearest even as torch rounds. */
ALWAYS_INLINE uint16_t to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* The lanes of v summed pairwise, in a fixed order. */
ALWAYS_INLINE float sum_lanes(f32xL v) {
    float lanes[LANES];
    memcpy(lanes, &v, sizeof lanes);
    for (int width = LANES / 2; width > 0; width /= 2)
        for (int l = 0; l < width; l++) lanes[l] += lanes[l + width];
    return lanes[0];
}

/* One output: the row's dot product with x (xs: x widened, in step order), plus bias. Two accumulators
   so that consecutive steps do not wait on each other's sums. */
ALWAYS_INLINE void one_row(void *y, const float *xs, const void *x, const void *w, const void *bias, int64_t in,
                           int64_t o, const int bf16) {
    const int64_t steps = in / STEP;
    const void *row = (const char *)w + (size_t)o * (size_t)in * (bf16 ? 2 : 4);
    f32xL even = (f32xL){0}, odd = (f32xL){0};
    int64_t s = 0;
    for (; s + 1 < steps; s += 2) {
        f32xL xa, xb, xc, xd, wa, wb, wc, wd;
        memcpy(&xa, xs + s * STEP, sizeof xa);
        memcpy(&xb, xs + s * STEP + LANES, sizeof xb);
        memcpy(&xc, xs + (s + 1) * STEP, sizeof xc);
        memcpy(&xd, xs + (s + 1) * STEP + LANES, sizeof xd);
        load_step(row, s * STEP, bf16, &wa, &wb);
        load_step(row, (s + 1) * STEP, bf16, &wc, &wd);
        even += xa * wa + xb * wb;
        odd += xc * wc + xd * wd;
    }
    if (s < steps) {
        f32xL xa, xb, wa, wb;
        memcpy(&xa, xs + s * STEP, sizeof xa);
        memcpy(&xb, xs + s * STEP + LANES, sizeof xb);
        load_step(row, s * STEP, bf16, &wa, &wb);
        even += xa * wa + xb * wb;
    }
    float v = sum_lanes(even + odd);
    for (int64_t i = steps * STEP; i < in; i++) v += load_one(x, i, bf16) * load_one(row, i, bf16);
    if (bias) v += load_one(bias, o, bf16);
    if (bf16)
        ((uint16_t *)y)[o] = to_bf16(v);
    else
        ((float *)y)[o] = v;
}

/* The threads worth starting for a product of in x out values (MIN_VALUES_PER_THREAD each at least). */
static int threads_for(int threads, int64_t in, int64_t out) {
    const int64_t most = (in * out) / MIN_VALUES_PER_THREAD;
    return threads > most ? (most > 1 ? (int)most : 1) : threads;
}

/* The rows of x [rows, in] widened to float32 in step order (row m's steps from m * (in / STEP) * STEP),
   read once per weight row by the loops below; NULL when there is no memory. */
static float *widen_rows(const void *x, int64_t rows, int64_t in, const int bf16) {
    const int64_t steps = in / STEP;
    float *xs = malloc((size_t)rows * (size_t)(steps > 0 ? steps : 1) * STEP * sizeof(float));
    if (!xs) return NULL;
    for (int64_t m = 0; m < rows; m++) {
        const void *row = (const char *)x + (size_t)m * (size_t)in * (bf16 ? 2 : 4);
        for (int64_t s = 0; s < steps; s++) {
            f32xL a, b;
            load_step(row, s * STEP, bf16, &a, &b);
            memcpy(xs + (m * steps + s) * STEP, &a, sizeof a);
            memcpy(xs + (m * steps + s) * STEP + LANES, &b, sizeof b);
        }
    }
    return xs;
}

/* Returns 0, or -2 when there is no memory for the widened copy of x. */
int gemv(void *y, const void *x, const void *w, const void *bias, int64_t in, int64_t out, int dtype, int threads) {
    const int bf16 = dtype == DTYPE_BFLOAT16;
    float *xs = widen_rows(x, 1, in, bf16);
    if (!xs) return -2;
    threads = threads_for(threads, in, out);
    /* Two copies of the loop, so that each is compiled for its dtype. */
    if (bf16) {
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t o = 0; o < out; o++) one_row(y, xs, x, w, bias, in, o, 1);
    } else {
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t o = 0; o < out; o++) one_row(y, xs, x, w, bias, in, o, 0);
    }
    free(xs);
    return 0;
}

/* ---- a few rows, float32 --------------------------------------------------------------------------
   Decode at batch 2-8, or a speculative step's few tokens, in float32: each weight row is read once and
   multiplied with every activation row (an accumulator each), so the product stays bound by reading
   the weights, where oneDNN runs it well below the memory's speed. */

enum { MAX_ROWS_F32 = 8 };

ALWAYS_INLINE void rows_out_f32(float *y, const float *x, const float *w, const float *bias, int64_t in,
                                int64_t out, int64_t o, const int rows) {
    const float *row = w + (size_t)o * (size_t)in;
    f32xL acc[MAX_ROWS_F32];
#pragma GCC unroll 8
    for (int m = 0; m < rows; m++) acc[m] = (f32xL){0};
    const int64_t steps = in / LANES;
    for (int64_t s = 0; s < steps; s++) {
        f32xL wv;
        memcpy(&wv, row + s * LANES, sizeof wv);
#pragma GCC unroll 8
        for (int m = 0; m < rows; m++) {
            f32xL xv;
            memcpy(&xv, x + (size_t)m * in + s * LANES, sizeof xv);
            acc[m] += xv * wv;
        }
    }
#pragma GCC unroll 8
    for (int m = 0; m < rows; m++) {
        float v = sum_lanes(acc[m]);
        for (int64_t i = steps * LANES; i < in; i++) v += x[(size_t)m * in + i] * row[i];
        if (bias) v += bias[o];
        y[(size_t)m * out + o] = v;
    }
}

#define ROWS_F32_CASE(R)                                                            \
    case R: {                                                                       \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")          \
        for (int64_t o = 0; o < out; o++) rows_out_f32(y, x, w, bias, in, out, o, R); \
        return 0;                                                                   \
    }

/* x [rows, in], w [out, in], bias [out] or NULL, y [rows, out]: all float32, contiguous. Returns 0, or
   -3 for a row count the kernel does not take. Each output is summed by one thread in one fixed order. */
int gemm_rows_f32(float *y, const float *x, const float *w, const float *bias, int64_t in, int64_t out, int rows,
                  int threads) {
    threads = threads_for(threads, in, out);
    switch (rows) {
        ROWS_F32_CASE(2) ROWS_F32_CASE(3) ROWS_F32_CASE(4) ROWS_F32_CASE(5) ROWS_F32_CASE(6) ROWS_F32_CASE(7)
        ROWS_F32_CASE(8)
    }
    return -3;
}

int max_rows_f32(void) { return MAX_ROWS_F32; }

/* ---- a few rows, bfloat16 ------------------------------------------------------------------------
   Decode at batch 2-8 multiplies a few rows by every weight: still bound by reading the weights, where
   oneDNN runs at a third of the memory's speed (docs/performance.md). The loop above, run over several
   rows, is bound by its arithmetic instead (a multiply-add per value and row, plus widening); the CPU's
   bfloat16 dot product (two values per lane and instruction, products exact, sums in float32, denormal
   inputs read as zero) keeps up with the memory to about eight rows. It needs the instruction, hence the
   one intrinsic header. A CPU without it widens, as the one-row loop does: slower than the instruction,
   still well ahead of oneDNN, which widens too there (docs/performance.md). With the instruction, oneDNN
   is the faster one for several rows of wide inputs, which cpu_gemm.py then leaves to it
   (BF16_DOT_X_VALUES). */

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

enum { MAX_ROWS = 8 };

/* Output o of every row m: y[m, o] = x[m] . w[o] (+ bias[o]); two accumulators per row, 32 values per
   instruction, a zero-padded last step; the lanes summed by _mm512_reduce_add_ps's fixed tree. */
ALWAYS_INLINE void rows_out(uint16_t *y, const uint16_t *x, const uint16_t *w, const uint16_t *bias, int64_t in,
                            int64_t out, int64_t o, const int rows) {
    const uint16_t *row = w + (size_t)o * (size_t)in;
    __m512 a[MAX_ROWS], b[MAX_ROWS];
#pragma GCC unroll 8
    for (int m = 0; m < rows; m++) a[m] = b[m] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 64 <= in; i += 64) {
        const __m512bh wa = (__m512bh)_mm512_loadu_si512(row + i);
        const __m512bh wb = (__m512bh)_mm512_loadu_si512(row + i + 32);
#pragma GCC unroll 8
        for (int m = 0; m < rows; m++) {
            a[m] = _mm512_dpbf16_ps(a[m], (__m512bh)_mm512_loadu_si512(x + m * in + i), wa);
            b[m] = _mm512_dpbf16_ps(b[m], (__m512bh)_mm512_loadu_si512(x + m * in + i + 32), wb);
        }
    }
    for (; i < in; i += 32) {
        const __mmask32 lanes = in - i >= 32 ? 0xffffffffu : (1u << (in - i)) - 1u;
        const __m512bh wa = (__m512bh)_mm512_maskz_loadu_epi16(lanes, row + i);
#pragma GCC unroll 8
        for (int m = 0; m < rows; m++)
            a[m] = _mm512_dpbf16_ps(a[m], (__m512bh)_mm512_maskz_loadu_epi16(lanes, x + m * in + i), wa);
    }
#pragma GCC unroll 8
    for (int m = 0; m < rows; m++) {
        float v = _mm512_reduce_add_ps(_mm512_add_ps(a[m], b[m]));
        if (bias) v += load_one(bias, o, 1);
        y[(size_t)m * out + o] = to_bf16(v);
    }
}

#define ROWS_CASE(R)                                                            \
    case R: {                                                                   \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")      \
        for (int64_t o = 0; o < out; o++) rows_out(y, x, w, bias, in, out, o, R); \
        return 0;                                                               \
    }

/* x [rows, in], w [out, in], bias [out] or NULL, y [rows, out]: all bfloat16, contiguous. Returns 0,
   or -3 for a row count the kernel does not take. */
int gemm_rows_bf16(uint16_t *y, const uint16_t *x, const uint16_t *w, const uint16_t *bias, int64_t in, int64_t out,
                   int rows, int threads) {
    threads = threads_for(threads, in, out);
    switch (rows) {
        ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4) ROWS_CASE(5) ROWS_CASE(6) ROWS_CASE(7) ROWS_CASE(8)
    }
    return -3;
}
#else
/* Without the instruction: each weight step widened once, as one_row widens it, and multiplied with every
   row, the rows widened beforehand into the same order. Still one read of the weights, one multiply-add
   per value and row; float32 sums, one rounding to bfloat16. */

enum { MAX_ROWS = 8 };

/* Output o of every row m; xs: the rows widened, row m's steps at xs + m * steps * STEP. */
ALWAYS_INLINE void rows_out(uint16_t *y, const float *xs, const uint16_t *x, const uint16_t *w, const uint16_t *bias,
                            int64_t in, int64_t out, int64_t o, const int rows) {
    const int64_t steps = in / STEP;
    const uint16_t *row = w + (size_t)o * (size_t)in;
    f32xL acc[MAX_ROWS];
#pragma GCC unroll 8
    for (int m = 0; m < rows; m++) acc[m] = (f32xL){0};
    for (int64_t s = 0; s < steps; s++) {
        f32xL wa, wb;
        load_step(row, s * STEP, 1, &wa, &wb);
#pragma GCC unroll 8
        for (int m = 0; m < rows; m++) {
            f32xL xa, xb;
            memcpy(&xa, xs + (m * steps + s) * STEP, sizeof xa);
            memcpy(&xb, xs + (m * steps + s) * STEP + LANES, sizeof xb);
            acc[m] += xa * wa + xb * wb;
        }
    }
#pragma GCC unroll 8
    for (int m = 0; m < rows; m++) {
        float v = sum_lanes(acc[m]);
        for (int64_t i = steps * STEP; i < in; i++) v += load_one(x + (size_t)m * in, i, 1) * load_one(row, i, 1);
        if (bias) v += load_one(bias, o, 1);
        y[(size_t)m * out + o] = to_bf16(v);
    }
}

#define ROWS_CASE(R)                                                                  \
    case R: {                                                                         \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")            \
        for (int64_t o = 0; o < out; o++) rows_out(y, xs, x, w, bias, in, out, o, R); \
        break;                                                                        \
    }

/* x [rows, in], w [out, in], bias [out] or NULL, y [rows, out]: all bfloat16, contiguous. Returns 0, -2
   when there is no memory for the widened rows, or -3 for a row count the kernel does not take. */
int gemm_rows_bf16(uint16_t *y, const uint16_t *x, const uint16_t *w, const uint16_t *bias, int64_t in, int64_t out,
                   int rows, int threads) {
    if (rows < 2 || rows > MAX_ROWS) return -3;
    float *xs = widen_rows(x, rows, in, 1);
    if (!xs) return -2;
    threads = threads_for(threads, in, out);
    switch (rows) {
        ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4) ROWS_CASE(5) ROWS_CASE(6) ROWS_CASE(7) ROWS_CASE(8)
    }
    free(xs);
    return 0;
}
#endif

/* How many rows gemm_rows_bf16 takes. */
int max_rows_bf16(void) { return MAX_ROWS; }

/* Whether gemm_rows_bf16 runs on the CPU's bfloat16 dot product (else it widens). */
int bf16_dot(void) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    return 1;
#else
    return 0;
#endif
}

/* ---- any number of rows, each in one fixed order: the batch-invariant mode ------------------------
   y[m, o] for every row m of x [rows, in], each summed by `rows_out` (bfloat16) or `rows_out_f32` as a
   group of up to eight rows sums it: a row's arithmetic is the same whatever the group's size and
   wherever the row sits in the batch, so a row's output depends on that row alone. Rows are taken a
   block at a time (their widened copy stays in the outer caches), each block's outputs split over the
   threads, each output by one thread: nothing depends on the thread count either. */

enum { FIXED_ROW_BLOCK = 64 };

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define FIXED_BF16(R) rows_out(y + (size_t)m * out, x + (size_t)m * in, w, bias, in, out, o, R)
#else
#define FIXED_BF16(R) rows_out(y + (size_t)m * out, xs + (size_t)m * steps * STEP, x + (size_t)m * in, w, bias, \
                               in, out, o, R)
#endif

/* Output o of the n (1 .. MAX_ROWS) rows from row m; each count gets its own unrolled copy. */
ALWAYS_INLINE void fixed_group_bf16(uint16_t *y, const float *xs, const uint16_t *x, const uint16_t *w,
                                    const uint16_t *bias, int64_t in, int64_t out, int64_t o, int64_t m, int n) {
    const int64_t steps = in / STEP;
    (void)xs; (void)steps;
    switch (n) {
        case 1: FIXED_BF16(1); break;
        case 2: FIXED_BF16(2); break;
        case 3: FIXED_BF16(3); break;
        case 4: FIXED_BF16(4); break;
        case 5: FIXED_BF16(5); break;
        case 6: FIXED_BF16(6); break;
        case 7: FIXED_BF16(7); break;
        default: FIXED_BF16(8); break;
    }
}

ALWAYS_INLINE void fixed_group_f32(float *y, const float *x, const float *w, const float *bias, int64_t in,
                                   int64_t out, int64_t o, int64_t m, int n) {
    float *ym = y + (size_t)m * out;
    const float *xm = x + (size_t)m * in;
    switch (n) {
        case 1: rows_out_f32(ym, xm, w, bias, in, out, o, 1); break;
        case 2: rows_out_f32(ym, xm, w, bias, in, out, o, 2); break;
        case 3: rows_out_f32(ym, xm, w, bias, in, out, o, 3); break;
        case 4: rows_out_f32(ym, xm, w, bias, in, out, o, 4); break;
        case 5: rows_out_f32(ym, xm, w, bias, in, out, o, 5); break;
        case 6: rows_out_f32(ym, xm, w, bias, in, out, o, 6); break;
        case 7: rows_out_f32(ym, xm, w, bias, in, out, o, 7); break;
        default: rows_out_f32(ym, xm, w, bias, in, out, o, 8); break;
    }
}

/* x [rows, in], w [out, in], bias [out] or NULL, y [rows, out]: all float32 or all bfloat16 (dtype),
   contiguous, rows >= 1. Returns 0, or -2 when there is no memory for the widened rows. */
int gemm_fixed(void *y, const void *x, const void *w, const void *bias, int64_t in, int64_t out, int64_t rows,
               int dtype, int threads) {
    const int bf16 = dtype == DTYPE_BFLOAT16;
    float *xs = NULL;
#if !(defined(__AVX512BF16__) && defined(__AVX512BW__))
    if (bf16 && rows > 0 && !(xs = widen_rows(x, rows, in, 1))) return -2;
#endif
    threads = threads_for(threads, in, out);
    for (int64_t r0 = 0; r0 < rows; r0 += FIXED_ROW_BLOCK) {
        const int64_t r1 = r0 + FIXED_ROW_BLOCK < rows ? r0 + FIXED_ROW_BLOCK : rows;
        if (bf16) {
#pragma omp parallel for schedule(static) num_threads(threads)
            for (int64_t o = 0; o < out; o++)
                for (int64_t m = r0; m < r1; m += MAX_ROWS)
                    fixed_group_bf16((uint16_t *)y, xs, (const uint16_t *)x, (const uint16_t *)w,
                                     (const uint16_t *)bias, in, out, o, m, r1 - m < MAX_ROWS ? (int)(r1 - m) : MAX_ROWS);
        } else {
#pragma omp parallel for schedule(static) num_threads(threads)
            for (int64_t o = 0; o < out; o++)
                for (int64_t m = r0; m < r1; m += MAX_ROWS_F32)
                    fixed_group_f32((float *)y, (const float *)x, (const float *)w, (const float *)bias, in, out, o, m,
                                    r1 - m < MAX_ROWS_F32 ? (int)(r1 - m) : MAX_ROWS_F32);
        }
    }
    free(xs);
    return 0;
}
