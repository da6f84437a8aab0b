/* LoRA adapters' products on a CPU, added into a linear layer's output in one call (punica's SGMV idea):
   y[t] += (x[t] A[s]) B[s] for every token t whose row uses adapter slot s > 0.

   The tokens are grouped by slot, so each adapter's A and B are read once per group of tokens rather than
   gathered per row (torch's path materializes rows x rank x out of B per layer), slot 0 (the base model)
   costs nothing, and a fused layer's B is read only on its block diagonal: slice j of the rank axis
   (columns j * rank ... of A) writes only its projection's output columns.

   Two steps, each cut into tiles of up to TB tokens of one slot by one or two vectors of columns, whose
   sums stay in registers: shrink (t = x A, a scratch of [tokens, k]) and expand (y += t B). A tile
   short of TB tokens reads rows of zeros in their place, so every tile runs the loop compiled for TB
   tokens (a loop over a token count known only at run time keeps its sums in memory: several times
   slower).

   bfloat16 where the CPU has avx512_bf16 (the x86-64-v4-bf16 build, cpu_isa.py): both products run on its bfloat16 dot product (two inputs per
   lane and instruction, products exact, sums in float32, denormal inputs read as zero), over x, A and B as
   stored: a matrix's rows r and r + 1 are interleaved into the pairs the instruction takes as they are
   loaded, so the weights keep the layout the bmm reads. t is rounded to bfloat16 in between, as torch's
   bfloat16 bmm (and peft) round x A. Elsewhere x is widened to float32 once per call, A and B as they are
   read, and t stays float32. Either way each output is rounded to bfloat16 once, after adding into y.

   Layouts (contiguous, all float32 or all bfloat16):
     x [tokens, in], y [tokens, out] (added to in place), a [slots, in, k], b [slots, k, out],
     slots [rows] (int64; row r holds tokens r * seq ... r * seq + seq - 1),
     slices [nslices, 2] (int64: output offset, size), k = nslices * rank.
   Each output value is one thread's sum in a fixed order: the result does not depend on the thread
   count. cpu_lora.py builds and calls it. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_vectors.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define DOT_BF16 1
#else
#define DOT_BF16 0
#endif

enum { DTYPE_FLOAT32 = 0, DTYPE_BFLOAT16 = 1 };
/* A tile: TB tokens of one slot by up to KT vectors of columns. */
enum { TB = 4, KT = 2, TILE = KT * LANES };
/* Below this many multiply-adds a call runs on the calling thread: waking the pool costs more. */
enum { PARALLEL_MIN = 1 << 16 };

ALWAYS_INLINE float load_one(const void *p, int64_t i, const int bf16) {
    if (bf16) {
        const uint32_t bits = (uint32_t)((const uint16_t *)p)[i] << 16;
        float f;
        memcpy(&f, &bits, sizeof f);
        return f;
    }
    return ((const float *)p)[i];
}

/* The first n (<= LANES) values from base + offset, the lanes past them 0. */
ALWAYS_INLINE f32xL load_n(const void *base, int64_t offset, int64_t n, const int bf16) {
    if (n >= LANES) return load_plain(base, offset, bf16);
    f32xL v = {};
    for (int64_t i = 0; i < n; i++) v[i] = load_one(base, offset + i, bf16);
    return v;
}

/* y[at ...] += the first n (<= LANES) lanes of v, each sum rounded to the dtype once (to nearest even, as
   torch rounds). */
ALWAYS_INLINE void add_n(void *y, int64_t at, int64_t n, f32xL v, const int bf16) {
    if (n >= LANES) {
        const f32xL sum = load_plain(y, at, bf16) + v;
        if (bf16) {
            const u16xL h = __builtin_convertvector(to_bf16(sum), u16xL);
            memcpy((uint16_t *)y + at, &h, sizeof h);
        } else {
            memcpy((float *)y + at, &sum, sizeof sum);
        }
        return;
    }
    f32xL sum = {};
    for (int64_t i = 0; i < n; i++) sum[i] = load_one(y, at + i, bf16) + v[i];
    const u32xL h = to_bf16(sum);
    for (int64_t i = 0; i < n; i++) {
        if (bf16) ((uint16_t *)y)[at + i] = (uint16_t)h[i];
        else ((float *)y)[at + i] = sum[i];
    }
}

/* The tile's sums into t: rows tr[j] (j < n, the tile's real tokens), columns k0 ... k0 + w. */
ALWAYS_INLINE void store_sums(float *const *tr, int64_t n, int64_t k0, int64_t w, f32xL acc[TB][KT], const int vectors) {
    for (int j = 0; j < TB; j++)
        for (int v = 0; v < vectors; v++)
            for (int64_t l = 0; l < LANES && v * LANES + l < w && j < n; l++) tr[j][k0 + v * LANES + l] = acc[j][v][l];
}

/* tr[j][k0 ... k0 + width] = xr[j] A[:, k0 ...] for a tile's TB rows of float32 x (A: one slot's [in, k] of
   the dtype, widened as read). vectors and full (width == vectors * LANES) are constants at every call, so
   the loop is compiled for each shape with its sums in registers. */
ALWAYS_INLINE void shrink_tile(float *const *tr, int64_t n, const float *const *xr, const void *a, int64_t in,
                               int64_t k, int64_t k0, int64_t width, const int vectors, const int full, const int bf16) {
    const int64_t w = full ? vectors * LANES : width;
    f32xL acc[TB][KT] = {};
    for (int64_t i = 0; i < in; i++) {
        f32xL av[KT];
        for (int v = 0; v < vectors; v++) av[v] = load_n(a, i * k + k0 + v * LANES, w - v * LANES, bf16);
        for (int j = 0; j < TB; j++) {
            const float xv = xr[j][i];
            for (int v = 0; v < vectors; v++) acc[j][v] += xv * av[v];
        }
    }
    store_sums(tr, n, k0, w, acc, vectors);
}

/* shrink_tile with its shape (KT == 2) and dtype as constants. */
ALWAYS_INLINE void shrink_widened(float *const *tr, int64_t n, const float *const *xr, const void *a, int64_t in,
                                  int64_t k, int64_t k0, int64_t width, const int bf16) {
    if (width == TILE) shrink_tile(tr, n, xr, a, in, k, k0, width, KT, 1, bf16);
    else if (width == LANES) shrink_tile(tr, n, xr, a, in, k, k0, width, 1, 1, bf16);
    else if (width > LANES) shrink_tile(tr, n, xr, a, in, k, k0, width, KT, 0, bf16);
    else shrink_tile(tr, n, xr, a, in, k, k0, width, 1, 0, bf16);
}

#if DOT_BF16
/* Rows r and r + 1 of a bfloat16 matrix m (rows `stride` apart), n (<= 16) columns from c, as the dot
   product's pairs: lane l holds m[r][c + l] in its low half and m[r + 1][c + l] in its high half (0 with
   last: r is the last row). */
ALWAYS_INLINE __m512bh row_pairs(const uint16_t *m, int64_t stride, int64_t r, int64_t c, int64_t n, const int last) {
    const __mmask16 mask = n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u);
    const __m512i lo = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, m + r * stride + c));
    if (last) return (__m512bh)lo;
    const __m512i hi = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, m + (r + 1) * stride + c));
    return (__m512bh)_mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
}

/* The same for 32 columns at two instructions: unpacklo interleaves the low four of every eight columns,
   unpackhi the high four (lane 4L + i of p[0]: column 8L + i; of p[1]: column 8L + 4 + i); unpair puts the
   sums back in column order. */
ALWAYS_INLINE void pairs32(__m512bh p[2], const uint16_t *m, int64_t stride, int64_t r, int64_t c, const int last) {
    const __m512i r0 = _mm512_loadu_si512(m + r * stride + c);
    const __m512i r1 = last ? _mm512_setzero_si512() : _mm512_loadu_si512(m + (r + 1) * stride + c);
    p[0] = (__m512bh)_mm512_unpacklo_epi16(r0, r1);
    p[1] = (__m512bh)_mm512_unpackhi_epi16(r0, r1);
}

ALWAYS_INLINE void unpair(f32xL out[2], __m512 lo, __m512 hi) {
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    out[0] = (f32xL)_mm512_permutex2var_ps(lo, first, hi);
    out[1] = (f32xL)_mm512_permutex2var_ps(lo, second, hi);
}

/* One step of a dot-product tile: rows r and r + 1 of m (r alone with last) times inputs r and r + 1 of
   the TB rows xr. */
ALWAYS_INLINE void dot_step(__m512 acc[TB][KT], const uint16_t *const *xr, const uint16_t *m, int64_t stride,
                            int64_t r, int64_t c, int64_t w, const int vectors, const int full, const int last) {
    __m512bh mv[KT];
    if (full && vectors == KT) pairs32(mv, m, stride, r, c, last);
    else
        for (int v = 0; v < vectors; v++) mv[v] = row_pairs(m, stride, r, c + v * LANES, w - v * LANES, last);
    for (int j = 0; j < TB; j++) {
        uint32_t pair = xr[j][r];
        if (!last) memcpy(&pair, xr[j] + r, sizeof pair);
        const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)pair);
        for (int v = 0; v < vectors; v++) acc[j][v] = _mm512_dpbf16_ps(acc[j][v], xv, mv[v]);
    }
}

/* sums[j][v] = xr[j][0 ... depth] m[:, c + v * LANES ...] for a tile's TB bfloat16 rows, m bfloat16 [depth,
   stride]: two inputs per instruction, x and m as stored. Constants as in shrink_tile. */
ALWAYS_INLINE void dot_tile(f32xL sums[TB][KT], const uint16_t *const *xr, const uint16_t *m, int64_t depth,
                            int64_t stride, int64_t c, int64_t width, const int vectors, const int full) {
    const int64_t w = full ? vectors * LANES : width;
    __m512 acc[TB][KT];
    for (int j = 0; j < TB; j++)
        for (int v = 0; v < KT; v++) acc[j][v] = _mm512_setzero_ps();
    int64_t r = 0;
    for (; r + 2 <= depth; r += 2) dot_step(acc, xr, m, stride, r, c, w, vectors, full, 0);
    if (r < depth) dot_step(acc, xr, m, stride, r, c, w, vectors, full, 1);
    for (int j = 0; j < TB; j++) {
        if (full && vectors == KT) unpair(sums[j], acc[j][0], acc[j][1]);
        else
            for (int v = 0; v < KT; v++) sums[j][v] = (f32xL)acc[j][v];
    }
}

/* t = x A on the dot product, stored rounded to bfloat16 (tb: rows of k bfloat16), as the expand's dot
   product reads it (the bfloat16 bmm rounds x A too). */
ALWAYS_INLINE void shrink_dot_tile(uint16_t *const *tb, int64_t n, const uint16_t *const *xr, const uint16_t *a,
                                   int64_t in, int64_t k, int64_t k0, int64_t width, const int vectors, const int full) {
    const int64_t w = full ? vectors * LANES : width;
    f32xL sums[TB][KT];
    dot_tile(sums, xr, a, in, k, k0, width, vectors, full);
    for (int j = 0; j < TB && j < n; j++)
        for (int v = 0; v < vectors; v++) {
            const u32xL h = to_bf16(sums[j][v]);
            for (int64_t l = 0; l < LANES && v * LANES + l < w; l++) tb[j][k0 + v * LANES + l] = (uint16_t)h[l];
        }
}

static void shrink_dot(uint16_t *const *tb, int64_t n, const uint16_t *const *xr, const uint16_t *a, int64_t in,
                       int64_t k, int64_t k0, int64_t width) {
    if (width == TILE) shrink_dot_tile(tb, n, xr, a, in, k, k0, width, KT, 1);
    else if (width == LANES) shrink_dot_tile(tb, n, xr, a, in, k, k0, width, 1, 1);
    else if (width > LANES) shrink_dot_tile(tb, n, xr, a, in, k, k0, width, KT, 0);
    else shrink_dot_tile(tb, n, xr, a, in, k, k0, width, 1, 0);
}

/* y[tok[j]][col ...] += tb[j][0 ... rank] B[rows ..., col ...] on the dot product (b: B's rows of this
   slice, [rank, out]). */
ALWAYS_INLINE void expand_dot_tile(uint16_t *y, const uint16_t *const *tb, const int64_t *tok, int64_t n,
                                   const uint16_t *b, int64_t out, int64_t rank, int64_t col, int64_t width,
                                   const int vectors, const int full) {
    const int64_t w = full ? vectors * LANES : width;
    f32xL sums[TB][KT];
    dot_tile(sums, tb, b, rank, out, col, width, vectors, full);
    for (int j = 0; j < TB; j++)
        for (int v = 0; v < vectors; v++)
            if (j < n) add_n(y, tok[j] * out + col + v * LANES, w - v * LANES, sums[j][v], 1);
}

static void expand_dot(uint16_t *y, const uint16_t *const *tb, const int64_t *tok, int64_t n, const uint16_t *b,
                       int64_t out, int64_t rank, int64_t col, int64_t width) {
    if (width == TILE) expand_dot_tile(y, tb, tok, n, b, out, rank, col, width, KT, 1);
    else if (width == LANES) expand_dot_tile(y, tb, tok, n, b, out, rank, col, width, 1, 1);
    else if (width > LANES) expand_dot_tile(y, tb, tok, n, b, out, rank, col, width, KT, 0);
    else expand_dot_tile(y, tb, tok, n, b, out, rank, col, width, 1, 0);
}
#endif

/* y[tok[j]][col ... col + width] += tr[j][k0 ... k0 + rank] B[k0 ..., col ...] for a tile's n real tokens
   (B: one slot's [k, out], widened as read); constants as in shrink_tile. */
ALWAYS_INLINE void expand_tile(void *y, const float *const *tr, const int64_t *tok, int64_t n, const void *b,
                               int64_t out, int64_t k0, int64_t rank, int64_t col, int64_t width, const int vectors,
                               const int full, const int bf16) {
    const int64_t w = full ? vectors * LANES : width;
    f32xL acc[TB][KT] = {};
    for (int64_t kk = 0; kk < rank; kk++) {
        f32xL bv[KT];
        for (int v = 0; v < vectors; v++) bv[v] = load_n(b, (k0 + kk) * out + col + v * LANES, w - v * LANES, bf16);
        for (int j = 0; j < TB; j++) {
            const float tv = tr[j][k0 + kk];
            for (int v = 0; v < vectors; v++) acc[j][v] += tv * bv[v];
        }
    }
    for (int j = 0; j < TB; j++)
        for (int v = 0; v < vectors; v++)
            if (j < n) add_n(y, tok[j] * out + col + v * LANES, w - v * LANES, acc[j][v], bf16);
}

ALWAYS_INLINE void expand_shaped(void *y, const float *const *tr, const int64_t *tok, int64_t n, const void *b,
                                 int64_t out, int64_t k0, int64_t rank, int64_t col, int64_t width, const int bf16) {
    if (width == TILE) expand_tile(y, tr, tok, n, b, out, k0, rank, col, width, KT, 1, bf16);
    else if (width == LANES) expand_tile(y, tr, tok, n, b, out, k0, rank, col, width, 1, 1, bf16);
    else if (width > LANES) expand_tile(y, tr, tok, n, b, out, k0, rank, col, width, KT, 0, bf16);
    else expand_tile(y, tr, tok, n, b, out, k0, rank, col, width, 1, 0, bf16);
}

/* A group of up to TB tokens of one slot: where its tokens start in the sorted order, how many, the slot. */
typedef struct { int64_t start, n, slot; } block_t;
/* A tile of output columns: its slice (which rank columns feed it), first column, width (<= TILE). */
typedef struct { int64_t slice, col, width; } cols_t;
/* How x reaches the shrink: float32 as given, bfloat16 widened into a float32 copy once, bfloat16 as given
   (the dot product). */
enum { X_FLOAT32, X_WIDENED, X_DOT };

/* One call: its operands, the sorted tokens (order: token index per sorted position) and their blocks,
   the output tiles, and the scratch (t [sorted tokens, k]; xw [sorted tokens, in] for X_WIDENED; zeros:
   max(in, k) zeros, the rows a tile short of TB tokens reads). */
typedef struct {
    void *y;
    const void *x, *a, *b;
    int64_t in, k, out, rank;
    const int64_t *order;
    const block_t *blocks;
    const cols_t *cols;
    float *t, *xw, *zeros;
    int path, bf16;
} call_t;

#if DOT_BF16
/* X_DOT: t holds x A rounded to bfloat16, rows of k values (the first half of the float32 scratch). */
static void shrink_dot_item(const call_t *c, const block_t *bl, int64_t k0, int64_t width) {
    const uint16_t *as = (const uint16_t *)c->a + bl->slot * c->in * c->k;
    uint16_t *tb[TB];
    const uint16_t *xr[TB];
    for (int j = 0; j < TB; j++) {
        const int64_t p = bl->start + (j < bl->n ? j : 0);
        tb[j] = (uint16_t *)c->t + p * c->k;  /* written for j < n only */
        xr[j] = j < bl->n ? (const uint16_t *)c->x + c->order[p] * c->in : (const uint16_t *)c->zeros;
    }
    shrink_dot(tb, bl->n, xr, as, c->in, c->k, k0, width);
}

static void expand_dot_item(const call_t *c, const block_t *bl, const cols_t *col) {
    const int64_t k0 = col->slice * c->rank;
    const uint16_t *bs = (const uint16_t *)c->b + (bl->slot * c->k + k0) * c->out;
    const uint16_t *tb[TB];
    for (int j = 0; j < TB; j++)
        tb[j] = j < bl->n ? (const uint16_t *)c->t + (bl->start + j) * c->k + k0 : (const uint16_t *)c->zeros;
    expand_dot(c->y, tb, c->order + bl->start, bl->n, bs, c->out, c->rank, col->col, col->width);
}
#endif

static void shrink_item(const call_t *c, const block_t *bl, int64_t k0) {
    const int64_t width = c->k - k0 < TILE ? c->k - k0 : TILE;
#if DOT_BF16
    if (c->path == X_DOT) {
        shrink_dot_item(c, bl, k0, width);
        return;
    }
#endif
    const char *as = (const char *)c->a + bl->slot * c->in * c->k * (c->bf16 ? 2 : 4);
    float *tr[TB];
    const float *xr[TB];
    for (int j = 0; j < TB; j++) {
        const int64_t p = bl->start + (j < bl->n ? j : 0);
        tr[j] = c->t + p * c->k;  /* written for j < n only */
        if (j >= bl->n) xr[j] = c->zeros;
        else xr[j] = c->path == X_WIDENED ? c->xw + p * c->in : (const float *)c->x + c->order[p] * c->in;
    }
    if (c->bf16) shrink_widened(tr, bl->n, xr, as, c->in, c->k, k0, width, 1);
    else shrink_widened(tr, bl->n, xr, as, c->in, c->k, k0, width, 0);
}

static void expand_item(const call_t *c, const block_t *bl, const cols_t *col) {
#if DOT_BF16
    if (c->path == X_DOT) {
        expand_dot_item(c, bl, col);
        return;
    }
#endif
    const char *bs = (const char *)c->b + bl->slot * c->k * c->out * (c->bf16 ? 2 : 4);
    const float *tr[TB];
    for (int j = 0; j < TB; j++) tr[j] = j < bl->n ? c->t + (bl->start + j) * c->k : c->zeros;
    const int64_t *tok = c->order + bl->start, k0 = col->slice * c->rank;
    if (c->bf16) expand_shaped(c->y, tr, tok, bl->n, bs, c->out, k0, c->rank, col->col, col->width, 1);
    else expand_shaped(c->y, tr, tok, bl->n, bs, c->out, k0, c->rank, col->col, col->width, 0);
}

static void widen_row(float *dst, const uint16_t *src, int64_t n) {
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        const f32xL v = load_plain(src, i, 1);
        memcpy(dst + i, &v, sizeof v);
    }
    for (; i < n; i++) dst[i] = load_one(src, i, 1);
}

/* The tokens of slot > 0 sorted by slot (stable), cut into blocks of at most TB; returns how many blocks
   (order and blocks hold rows * seq entries). */
static int64_t group_tokens(const int64_t *slots, int64_t rows, int64_t seq, int64_t nslots, int64_t *order,
                            block_t *blocks) {
    int64_t used = 0, nblocks = 0;
    for (int64_t s = 1; s < nslots; s++) {
        const int64_t first = used;
        for (int64_t r = 0; r < rows; r++)
            if (slots[r] == s)
                for (int64_t p = 0; p < seq; p++) order[used++] = r * seq + p;
        for (int64_t i = first; i < used; i += TB)
            blocks[nblocks++] = (block_t){i, used - i < TB ? used - i : TB, s};
    }
    return nblocks;
}

/* The output tiles of every slice (cols NULL: only count them); returns how many. */
static int64_t plan_cols(const int64_t *slices, int64_t nslices, cols_t *cols) {
    int64_t c = 0;
    for (int64_t j = 0; j < nslices; j++)
        for (int64_t col = 0; col < slices[2 * j + 1]; col += TILE, c++)
            if (cols) cols[c] = (cols_t){j, slices[2 * j] + col, slices[2 * j + 1] - col < TILE ? slices[2 * j + 1] - col : TILE};
    return c;
}

static void run(const call_t *c, int64_t nblocks, int64_t ncols, int64_t used, int threads) {
    const int64_t ktiles = (c->k + TILE - 1) / TILE;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        if (c->path == X_WIDENED) {
#pragma omp for schedule(static)
            for (int64_t p = 0; p < used; p++)
                widen_row(c->xw + p * c->in, (const uint16_t *)c->x + c->order[p] * c->in, c->in);
        }
#pragma omp for schedule(static)
        for (int64_t item = 0; item < nblocks * ktiles; item++)
            shrink_item(c, &c->blocks[item / ktiles], (item % ktiles) * TILE);
        /* the implicit barrier: every token's x A is in t before any expand reads it */
#pragma omp for schedule(static)
        for (int64_t item = 0; item < nblocks * ncols; item++)
            expand_item(c, &c->blocks[item / ncols], &c->cols[item % ncols]);
    }
}

/* 1 where bfloat16's x A runs on the CPU's dot product (this build has avx512_bf16), else 0. */
int lora_dot_bf16(void) { return DOT_BF16; }

/* Returns 0; 1: no memory for the scratch; 2: a slot outside [0, nslots). */
int lora_add(void *y, const void *x, const void *a, const void *b, const int64_t *slots, const int64_t *slices,
             int64_t rows, int64_t seq, int64_t in, int64_t k, int64_t out, int64_t nslots, int64_t nslices,
             int dtype, int threads) {
    const int bf16 = dtype == DTYPE_BFLOAT16;
    int64_t adapted = 0;  /* rows of the base model alone (a step with no adapter row) cost nothing */
    for (int64_t r = 0; r < rows; r++) {
        if (slots[r] < 0 || slots[r] >= nslots) return 2;
        adapted += slots[r] != 0;
    }
    if (!adapted) return 0;
    const int64_t tokens = rows * seq, n = tokens ? tokens : 1, ncols = plan_cols(slices, nslices, NULL);
    const int path = !bf16 ? X_FLOAT32 : DOT_BF16 ? X_DOT : X_WIDENED;
    int64_t *order = malloc(sizeof(int64_t) * n);
    block_t *blocks = malloc(sizeof(block_t) * n);
    cols_t *cols = malloc(sizeof(cols_t) * (ncols ? ncols : 1));
    float *t = malloc(sizeof(float) * n * k), *zeros = calloc(in > k ? in : k, sizeof(float));
    float *xw = path == X_WIDENED ? malloc(sizeof(float) * n * in) : NULL;
    if (!order || !blocks || !cols || !t || !zeros || (path == X_WIDENED && !xw)) {
        free(order), free(blocks), free(cols), free(t), free(zeros), free(xw);
        return 1;
    }
    const int64_t nblocks = group_tokens(slots, rows, seq, nslots, order, blocks);
    plan_cols(slices, nslices, cols);
    const int64_t used = nblocks ? blocks[nblocks - 1].start + blocks[nblocks - 1].n : 0, rank = k / nslices;
    if (threads < 2 || used * (in * k + rank * out) < PARALLEL_MIN) threads = 1;
    const call_t c = {y, x, a, b, in, k, out, rank, order, blocks, cols, t, xw, zeros, path, bf16};
    run(&c, nblocks, ncols, used, threads);
    free(order), free(blocks), free(cols), free(t), free(zeros), free(xw);
    return 0;
}
