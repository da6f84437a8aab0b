/* The greedy choice of a batch on a CPU: each row's first maximum and the sum that gives its
   log-probability, in two reads of the row.

   torch gets the same with a log_softmax over the whole vocabulary (three passes, and a [rows, vocab]
   output) and an argmax; greedy decoding needs only the chosen token's log-probability, which is
   -log(sum(exp(x - max))) since the chosen token is the maximum. cpu_sampling.py builds and calls it.

   scores: rows of `vocab` float32 values, row r at scores + r * stride. Writes ids[r] (the smallest
   index of the row's maximum, as torch.argmax) and sums[r] (sum of exp(x - max), at least 1).
   Returns 0, or 1 without a full answer when a row holds a NaN or its maximum is not finite: the
   caller then takes torch's path, whose answers for those rows are the reference. */

#include <stdint.h>
#include <string.h>

#include "cpu_vectors.h"

typedef struct {
    float top;
    int64_t at;
    int bad;
} RowMax;

static RowMax row_max(const float *x, int64_t vocab) {
    const int64_t whole = vocab - vocab % LANES;
    f32xL top, v;
    i32xL index, nan = {};
    for (int i = 0; i < LANES; i++) index[i] = i;
    i32xL at = index;
    memcpy(&top, x, sizeof top);  /* vocab >= LANES (the caller checks) */
    for (int64_t j = 0; j < whole; j += LANES, index += LANES) {
        memcpy(&v, x + j, sizeof v);
        const i32xL above = v > top;  /* strict: a lane keeps its first maximum */
        top = select_lanes(above, v, top);
        at = (above & index) | (~above & at);
        nan |= v != v;
    }
    RowMax m = {top[0], at[0], 0};
    for (int i = 0; i < LANES; i++) {
        m.bad |= nan[i] != 0;
        if (top[i] > m.top || (top[i] == m.top && at[i] < m.at)) {
            m.top = top[i];
            m.at = at[i];
        }
    }
    for (int64_t j = whole; j < vocab; j++) {  /* later indices: only a larger value wins */
        m.bad |= x[j] != x[j];
        if (x[j] > m.top) {
            m.top = x[j];
            m.at = j;
        }
    }
    m.bad |= !(m.top - m.top == 0.0f);  /* +-inf */
    return m;
}

/* Sum of exp(x - top) over the row, in ACCUMULATORS vectors of partial sums: each lane's chain of float
   additions is that many times shorter, and so is its rounding error (with one vector of 8 lanes, a
   128,256-token row was 3e-6 off log_softmax's log-probability), and the additions of one vector do not
   wait on the previous one's. */
enum { ACCUMULATORS = 4 };
_Static_assert(ACCUMULATORS == 4, "exp_sum adds its four partial sums pairwise by hand");

static float exp_sum(const float *x, int64_t vocab, float top) {
    const int64_t whole = vocab - vocab % LANES;
    f32xL v, sums[ACCUMULATORS] = {};
    int64_t j = 0;
    for (; j + ACCUMULATORS * LANES <= whole; j += ACCUMULATORS * LANES)
        for (int a = 0; a < ACCUMULATORS; a++) {
            memcpy(&v, x + j + a * LANES, sizeof v);
            sums[a] += exp_nonpositive(v - top);
        }
    for (int a = 0; j < whole; j += LANES, a++) {
        memcpy(&v, x + j, sizeof v);
        sums[a] += exp_nonpositive(v - top);
    }
    if (whole < vocab) {  /* the last values, the rest of the vector far below them */
        for (int i = 0; i < LANES; i++) v[i] = whole + i < vocab ? x[whole + i] - top : -1e30f;
        sums[ACCUMULATORS - 1] += exp_nonpositive(v);
    }
    const f32xL sum = (sums[0] + sums[1]) + (sums[2] + sums[3]);
    float total = 0.0f;
    for (int i = 0; i < LANES; i++) total += sum[i];
    return total;
}

int greedy_rows(const float *scores, int64_t rows, int64_t vocab, int64_t stride, int64_t *ids, float *sums,
                int nthreads) {
    int bad = 0;
#pragma omp parallel for num_threads(nthreads) schedule(static) reduction(| : bad) if (nthreads > 1 && rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *x = scores + r * stride;
        const RowMax m = row_max(x, vocab);
        bad |= m.bad;
        ids[r] = m.at;
        sums[r] = m.bad ? 1.0f : exp_sum(x, vocab, m.top);
    }
    return bad;
}
