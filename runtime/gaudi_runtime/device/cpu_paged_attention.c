/* Decode attention over a paged KV cache on a CPU, reading K and V where they are.

   The torch path copies every sequence's blocks into a contiguous tensor each step and each layer
   before it can call a kernel; this one walks the block table instead. Plain C (no torch headers) so
   that it compiles in about a second at first use; cpu_paged_attention.py builds and calls it.

   Layouts (all contiguous):
     q, out        [batch, num_kv_heads * group, head_size]   query heads of KV head h are h*group ..
     k/v_cache     [num_blocks, block_size, num_kv_heads, head_size]
     block_tables  [batch, max_blocks] int64;  context_lens [batch] int64
   Sequence b attends to its positions 0 .. context_lens[b] - 1; position j lives at
   cache[block_tables[b, j / block_size], j % block_size]. A row with context length 0 (a padded
   row) attends to its position 0 alone, so its output stays finite. head_size is a multiple of 16
   and at most MAX_HEAD_SIZE. A sliding-window layer passes `starts` [batch] int64: row b then attends
   to positions starts[b] .. context_lens[b] - 1 only (NULL: from 0). A soft-capped layer passes
   softcap > 0: each scaled score s becomes softcap * tanh(s / softcap) before the softmax.

   Arithmetic is float32 (scores, softmax, the weighted sum of values). The work is split over
   sequences (a sequence's KV heads together, so that each cache line is fetched once), with OpenMP:
   the library is linked against the libgomp torch has loaded, so both share one thread pool. Vectors are
   GCC/Clang vector types, which the compiler maps onto the CPU's own: no intrinsics, and no
   -ffast-math (exp is a polynomial of ours, sums are reordered by hand). */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_vectors.h"

enum { DTYPE_FLOAT32 = 0, DTYPE_BFLOAT16 = 1 };

/* Positions scored together: one vector of scores. */
enum { SPAN = LANES };
/* How many spans ahead the rows are prefetched: a span's arithmetic outlasts a fetch from memory. */
enum { AHEAD = 2 };
/* Bounds of a tile's arrays: head size <= MAX_HEAD_SIZE (cpu_paged_attention.py checks), query heads
   per tile <= MAX_GT (tile_heads). Arrays of a fixed size are kept in registers once the loops over
   them unroll; variable-length ones stay on the stack, and every step then waits on a store. */
enum { MAX_HEAD_SIZE = 256, MAX_C = MAX_HEAD_SIZE / 8, MAX_GT = 8 };

#if defined(__clang__) || __GNUC__ >= 12
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (i32xL){__VA_ARGS__})
#endif

/* ---- rows of head_size values as c vectors ----------------------------------------------------------
   A bfloat16 row is widened 2 * LANES values at a time by shifting bits: the even-indexed values go
   to one vector and the odd-indexed ones to the next (a last LANES values keep their order). Every
   row (q, k, v, out) uses the same order, so dot products and sums are unaffected, and storing
   interleaves them back. */

ALWAYS_INLINE void load_row(const void *base, int64_t offset, const int64_t c, const int bf16, f32xL *row) {
    int64_t i = 0;
    if (bf16) {
#pragma GCC unroll 16
        for (; i + 1 < c; i += 2) {
            u32xL pairs;
            memcpy(&pairs, (const uint16_t *)base + offset + i * LANES, sizeof pairs);
            row[i] = (f32xL)(pairs << 16);
            row[i + 1] = (f32xL)(pairs & 0xffff0000u);
        }
    }
    for (; i < c; i++) row[i] = load_plain(base, offset + i * LANES, bf16);
}

ALWAYS_INLINE void store_row(void *base, int64_t offset, const int64_t c, const int bf16, const f32xL *row,
                             float factor) {
    int64_t i = 0;
    if (bf16) {
        for (; i + 1 < c; i += 2) {
            const u32xL pairs = to_bf16(row[i] * factor) | (to_bf16(row[i + 1] * factor) << 16);
            memcpy((uint16_t *)base + offset + i * LANES, &pairs, sizeof pairs);
        }
        for (; i < c; i++) {
            const u16xL h = __builtin_convertvector(to_bf16(row[i] * factor), u16xL);
            memcpy((uint16_t *)base + offset + i * LANES, &h, sizeof h);
        }
        return;
    }
    for (; i < c; i++) {
        const f32xL f = row[i] * factor;
        memcpy((float *)base + offset + i * LANES, &f, sizeof f);
    }
}

/* ---- arithmetic on vectors -------------------------------------------------------------------- */

/* Dot products are finished LANES at a time by a tree of shuffles instead of LANES horizontal sums:
   `combine` is one level of that tree. At level 0, a and b are the lane-wise products of two positions;
   at level l they are two results of level l - 1, in position order. After LEVELS levels lane j holds
   position j's dot product. */
#if LANES == 16
enum { LEVELS = 4 };
ALWAYS_INLINE f32xL combine(f32xL a, f32xL b, const int level) {
    if (level == 0)
        return SHUFFLE(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               SHUFFLE(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    if (level == 1)
        return SHUFFLE(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               SHUFFLE(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    if (level == 2)
        return SHUFFLE(a, b, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
               SHUFFLE(a, b, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return SHUFFLE(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           SHUFFLE(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
#else
enum { LEVELS = 3 };
ALWAYS_INLINE f32xL combine(f32xL a, f32xL b, const int level) {
    if (level == 0)
        return SHUFFLE(a, b, 0, 1, 2, 3, 8, 9, 10, 11) + SHUFFLE(a, b, 4, 5, 6, 7, 12, 13, 14, 15);
    if (level == 1)
        return SHUFFLE(a, b, 0, 1, 4, 5, 8, 9, 12, 13) + SHUFFLE(a, b, 2, 3, 6, 7, 10, 11, 14, 15);
    return SHUFFLE(a, b, 0, 2, 4, 6, 8, 10, 12, 14) + SHUFFLE(a, b, 1, 3, 5, 7, 9, 11, 13, 15);
}
#endif

/* Turns a row of scores into unnormalized probabilities in place and returns their sum. The row is
   `padded` long (a multiple of LANES), its entries past the real ones very negative: their exp is
   at most 2^-125 and adds nothing visible to the sum. */
static float softmax_row(float *s, int64_t padded) {
    f32xL top, x, sum = {};
    memcpy(&top, s, sizeof top);
    for (int64_t j = LANES; j < padded; j += LANES) {
        memcpy(&x, s + j, sizeof x);
        top = select_lanes(x > top, x, top);
    }
    float m = top[0], total = 0.0f;
    for (int i = 1; i < LANES; i++) m = top[i] > m ? top[i] : m;
    for (int64_t j = 0; j < padded; j += LANES) {
        memcpy(&x, s + j, sizeof x);
        x = exp_nonpositive(x - m);
        memcpy(s + j, &x, sizeof x);
        sum += x;
    }
    for (int i = 0; i < LANES; i++) total += sum[i];
    return total;
}

/* ---- one span of positions, one tile of query heads ------------------------------------------------
   A span is up to SPAN consecutive positions of one sequence inside one block: rows `stride` values
   apart from `base`. A tile is gt query heads of one KV head, c vectors each. With constant c and gt
   (see DISPATCH) the loops unroll and the tile's query and accumulators stay in registers. */

typedef struct {
    int64_t base, stride, n;
    /* where the same rows of a span AHEAD spans later start (or -1): prefetched row by row, so
       that the blocks, which lie anywhere in the cache where no hardware prefetcher looks, are
       on their way while this span is computed. Into the outer caches (locality 1): on the AMD
       CPU measured, random blocks prefetched into L1 read at 13 GB/s, into the outer caches at 23
       (docs/performance.md). */
    int64_t ahead;
} Span;

ALWAYS_INLINE void prefetch_row(const void *cache, Span s, int64_t j, const int64_t c, const int bf16) {
    if (s.ahead < 0) return;
    const char *row = (const char *)cache + (s.ahead + j * s.stride) * (bf16 ? 2 : 4);
    for (int64_t b = 0; b < c * LANES * (bf16 ? 2 : 4); b += 64) __builtin_prefetch(row + b, 0, 1);
}

/* scores[g * row_len + j] = q_g . k_j for the span's positions j. A whole vector of SPAN scores is
   written; the lanes past the span repeat its last position and are overwritten by the next span or
   by the row's padding. Each K row is widened once for all heads of the tile, and each head's dot
   products enter the tree of `combine` as they come (pending[g][l]: the level-l result waiting for
   its pair), so that the tile's state fits in registers. */
ALWAYS_INLINE void score_span(const void *k_cache, const float *q, float *scores, int64_t row_len, Span s,
                              const int64_t c, const int64_t gt, const int bf16) {
    f32xL qv[MAX_GT][MAX_C], row[MAX_C], pending[MAX_GT][LEVELS + 1];
    for (int64_t g = 0; g < gt; g++) memcpy(qv[g], q + g * c * LANES, sizeof(f32xL) * c);
#pragma GCC unroll 16
    for (int64_t j = 0; j < SPAN; j++) {
        prefetch_row(k_cache, s, j, c, bf16);
        load_row(k_cache, s.base + (j < s.n ? j : s.n - 1) * s.stride, c, bf16, row);
        for (int64_t g = 0; g < gt; g++) {
            f32xL v = qv[g][0] * row[0];
            for (int64_t i = 1; i < c; i++) v += qv[g][i] * row[i];
            int level = 0;
            for (int64_t t = j; t & 1; t >>= 1, level++) v = combine(pending[g][level], v, level);
            pending[g][level] = v;
        }
    }
    for (int64_t g = 0; g < gt; g++) memcpy(scores + g * row_len, &pending[g][LEVELS], sizeof(f32xL));
}

/* acc_g += sum over the span of probs[g * row_len + j] * v_j. */
ALWAYS_INLINE void weigh_span(const void *v_cache, const float *probs, float *acc, int64_t row_len, Span s,
                              const int64_t c, const int64_t gt, const int bf16) {
    f32xL sums[MAX_GT][MAX_C], row[MAX_C];
    for (int64_t g = 0; g < gt; g++) memcpy(sums[g], acc + g * c * LANES, sizeof(f32xL) * c);
    for (int64_t j = 0; j < s.n; j++) {
        prefetch_row(v_cache, s, j, c, bf16);
        load_row(v_cache, s.base + j * s.stride, c, bf16, row);
#pragma GCC unroll 8
        for (int64_t g = 0; g < gt; g++) {
            const float w = probs[g * row_len + j];
#pragma GCC unroll 16
            for (int64_t i = 0; i < c; i++) sums[g][i] += w * row[i];
        }
    }
    for (int64_t g = 0; g < gt; g++) memcpy(acc + g * c * LANES, sums[g], sizeof(f32xL) * c);
}

/* Query heads per tile: the most (dividing the group) whose accumulators fit REGS vectors. */
static int64_t tile_heads(int64_t group, int64_t c) {
    for (int64_t gt = 8; gt > 1; gt /= 2)
        if (group % gt == 0 && gt * c <= REGS) return gt;
    return 1;
}

/* Head sizes 64, 128 and 32 get code of their own for their tiles; any other runs with runtime bounds. */
#define DISPATCH(CALL)                                                                               \
    do {                                                                                             \
        const int64_t d = c * LANES;                                                                 \
        if (d == 64 && gt == 2) CALL(64 / LANES, 2); else if (d == 64 && gt == 1) CALL(64 / LANES, 1); \
        else if (d == 64 && gt == 4) CALL(64 / LANES, 4); else if (d == 128 && gt == 1) CALL(128 / LANES, 1); \
        else if (d == 128 && gt == 2) CALL(128 / LANES, 2); else if (d == 32 && gt == 1) CALL(32 / LANES, 1); \
        else if (d == 32 && gt == 2) CALL(32 / LANES, 2); else if (d == 32 && gt == 4) CALL(32 / LANES, 4); \
        else CALL(c, gt);                                                                            \
    } while (0)
#define SCORE(C, GT) (bf16 ? score_span(k, q, scores, row_len, s, C, GT, 1) \
                           : score_span(k, q, scores, row_len, s, C, GT, 0))
#define WEIGH(C, GT) (bf16 ? weigh_span(v, probs, acc, row_len, s, C, GT, 1) \
                           : weigh_span(v, probs, acc, row_len, s, C, GT, 0))

static void score_tile(const void *k, const float *q, float *scores, int64_t row_len, Span s, int64_t c,
                       int64_t gt, int bf16) {
    DISPATCH(SCORE);
}

static void weigh_tile(const void *v, const float *probs, float *acc, int64_t row_len, Span s, int64_t c,
                       int64_t gt, int bf16) {
    DISPATCH(WEIGH);
}

/* ---- one sequence ------------------------------------------------------------------------------ */

typedef struct {
    void *out;
    const void *q, *k_cache, *v_cache;
    const int64_t *block_tables, *context_lens, *starts;
    int64_t batch, num_kv_heads, group, head_size, block_size, max_blocks, num_blocks;
    float scale, softcap;
    int dtype;
} Problem;

/* The span of up to SPAN positions from `first`: it ends early where its block does. */
static Span span_at(const Problem *p, const int64_t *table, int64_t len, int64_t first) {
    const int64_t bs = p->block_size, stride = p->num_kv_heads * p->head_size, later = first + AHEAD * SPAN;
    Span s = {(table[first / bs] * bs + first % bs) * stride, stride, bs - first % bs, -1};
    s.n = s.n < SPAN ? s.n : SPAN;
    s.n = s.n < len - first ? s.n : len - first;
    if (later + s.n <= len) s.ahead = (table[later / bs] * bs + later % bs) * stride;
    return s;
}

/* Scores (phase 0) or weighs values (phase 1) over every span of a sequence from position `start` for its
   KV heads h0 .. h1 - 1, positions outer and heads inner, so that the span's rows of all heads are read
   from memory once. Query head r (counted from h0's first) has its query at qf + r * d, scores at
   scores + r * row_len (position start first), accumulator at acc + r * d. */
static void each_span(const Problem *p, const int64_t *table, int64_t start, int64_t len, int64_t h0, int64_t h1,
                      int phase, const float *qf, float *scores, float *acc, int64_t row_len) {
    const int64_t d = p->head_size, c = d / LANES, gt = tile_heads(p->group, c);
    const int bf16 = p->dtype == DTYPE_BFLOAT16;
    const void *cache = phase == 0 ? p->k_cache : p->v_cache;
    Span s = span_at(p, table, len, start);
    for (int64_t first = start; first < len; first += s.n) {
        s = span_at(p, table, len, first);
        for (int64_t h = h0; h < h1; h++) {
            Span hs = s;
            hs.base += h * d;
            hs.ahead += hs.ahead < 0 ? 0 : h * d;
            for (int64_t r = (h - h0) * p->group; r < (h - h0 + 1) * p->group; r += gt) {
                float *at = scores + r * row_len + first - start;
                if (phase == 0) score_tile(cache, qf + r * d, at, row_len, hs, c, gt, bf16);
                else weigh_tile(cache, at, acc + r * d, row_len, hs, c, gt, bf16);
            }
        }
    }
}

/* s[j] = cap * tanh(s[j] / cap) for the `padded` scores of a row; tanh from exp(-2|x|), no libm. */
static void softcap_row(float *s, int64_t padded, float cap) {
    f32xL x;
    for (int64_t j = 0; j < padded; j += LANES) {
        memcpy(&x, s + j, sizeof x);
        const f32xL y = x * (1.0f / cap), a = select_lanes(y < 0.0f, -y, y);
        const f32xL e = exp_nonpositive(a * -2.0f), t = (1.0f - e) / (1.0f + e);
        x = select_lanes(y < 0.0f, -t, t) * cap;
        memcpy(s + j, &x, sizeof x);
    }
}

/* Sequence b, KV heads h0 .. h1 - 1: 0, or -1 when its length or block ids do not fit the cache. `work`
   holds (h1 - h0) * group * (row_len + 2 * head_size) floats, row_len >= the padded length + SPAN. */
static int attend(const Problem *p, int64_t b, int64_t h0, int64_t h1, float *work, int64_t row_len) {
    const int64_t bs = p->block_size, d = p->head_size, c = d / LANES, rows = (h1 - h0) * p->group;
    const int64_t *table = p->block_tables + b * p->max_blocks;
    const int64_t len = p->context_lens[b] < 1 ? 1 : p->context_lens[b];  /* a padded row reads its position 0 */
    int64_t start = p->starts == NULL ? 0 : p->starts[b];
    start = start < 0 ? 0 : start > len - 1 ? len - 1 : start;
    const int64_t n = len - start, padded = (n + LANES - 1) / LANES * LANES;
    const int bf16 = p->dtype == DTYPE_BFLOAT16;
    if (len > p->max_blocks * bs) return -1;
    for (int64_t k = 0; k < (len + bs - 1) / bs; k++)
        if (table[k] < 0 || table[k] >= p->num_blocks) return -1;
    float *scores = work, *qf = work + rows * row_len, *acc = qf + rows * d;
    const int64_t q_off = (b * p->num_kv_heads + h0) * p->group * d;
    f32xL row[c];
    for (int64_t r = 0; r < rows; r++) {
        load_row(p->q, q_off + r * d, c, bf16, row);
        for (int64_t i = 0; i < c; i++) row[i] *= p->scale;
        memcpy(qf + r * d, row, sizeof row);
    }
    each_span(p, table, start, len, h0, h1, 0, qf, scores, acc, row_len);
    float sums[rows];
    for (int64_t r = 0; r < rows; r++) {
        if (p->softcap > 0.0f) softcap_row(scores + r * row_len, padded, p->softcap);
        for (int64_t j = n; j < padded; j++) scores[r * row_len + j] = -1e30f;
        sums[r] = softmax_row(scores + r * row_len, padded);
    }
    memset(acc, 0, (size_t)(rows * d) * sizeof(float));
    each_span(p, table, start, len, h0, h1, 1, qf, scores, acc, row_len);
    for (int64_t r = 0; r < rows; r++) {
        memcpy(row, acc + r * d, sizeof row);
        store_row(p->out, q_off + r * d, c, bf16, row, 1.0f / sums[r]);
    }
    return 0;
}

/* Returns 0; -1 when a context length exceeds its block table or a block id is out of range (that
   row's output is then left unwritten); -2 when scratch memory could not be allocated; -3 (nothing
   written) for a head size the kernel does not take. */
int paged_decode_attention(void *out, const void *q, const void *k_cache, const void *v_cache,
                           const int64_t *block_tables, const int64_t *context_lens, int64_t batch,
                           int64_t num_kv_heads, int64_t group, int64_t head_size, int64_t block_size,
                           int64_t max_blocks, int64_t num_blocks, float scale, int dtype, int num_threads,
                           const int64_t *starts, float softcap) {
    if (head_size % 16 || head_size > MAX_HEAD_SIZE) return -3;
    Problem p = {out, q, k_cache, v_cache, block_tables, context_lens, starts, batch, num_kv_heads, group,
                 head_size, block_size, max_blocks, num_blocks, scale, softcap, dtype};
    int64_t max_len = 1;
    for (int64_t b = 0; b < batch; b++) max_len = context_lens[b] > max_len ? context_lens[b] : max_len;
    if (max_len > max_blocks * block_size) max_len = max_blocks * block_size;
    const int64_t row_len = (max_len + LANES - 1) / LANES * LANES + SPAN;
    /* A task is a sequence's KV heads, or a share of them when there are fewer sequences than threads. */
    int64_t splits = num_threads > batch ? (num_threads + batch - 1) / batch : 1;
    splits = splits < num_kv_heads ? splits : num_kv_heads;
    const int64_t per_task = (num_kv_heads + splits - 1) / splits, tasks = batch * splits;
    const size_t work_floats = (size_t)(per_task * group * (row_len + 2 * head_size));
    int status = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && tasks > 1)
    {
        float *work = malloc(work_floats * sizeof(float));
        int mine = work == NULL ? -2 : 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tasks; t++) {
            const int64_t b = t / splits, h0 = t % splits * per_task;
            const int64_t h1 = h0 + per_task < num_kv_heads ? h0 + per_task : num_kv_heads;
            if (mine != -2 && h0 < h1 && attend(&p, b, h0, h1, work, row_len) != 0) mine = -1;
        }
        free(work);
        if (mine != 0) {
#pragma omp atomic write
            status = mine;
        }
    }
    return status;
}
