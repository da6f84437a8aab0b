/* LoRA adapters' products on a CPU, added into a linear layer's output in one call (punica's SGMV idea):
   y[t] += (x[t] A[s]) B[s] for every token t whose row uses adapter slot s > 0.

   The tokens are grouped by slot, so each adapter's A and B are read once per group of tokens rather than
   gathered per row (torch's path materializes rows x rank x out of B per layer), slot 0 (the base model)
   costs nothing, and a fused layer's B is read only on its block diagonal: slice j of the rank axis
   (columns j * rank ... of A) writes only its projection's output columns.

   Layouts (contiguous, all float32 or all bfloat16; arithmetic in float32):
     x [tokens, in], y [tokens, out] (added to in place), a [slots, in, k], b [slots, k, out],
     slots [rows] (int64; row r holds tokens r * seq ... r * seq + seq - 1),
     slices [nslices, 2] (int64: output offset, size), k = nslices * rank.
   Each output value is one thread's sum in a fixed order: the result does not depend on the thread
   count. cpu_lora.py builds and calls it. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_vectors.h"

enum { DTYPE_FLOAT32 = 0, DTYPE_BFLOAT16 = 1 };
/* A tile: up to TB tokens of one slot by KT vectors of columns, its sums held in registers. */
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

ALWAYS_INLINE float bf16_round(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) bits = (bits | 0x400000u) & 0xffff0000u;
    else bits = ((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16) << 16;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* y[offset + i] += the first n lanes of v, rounded to the dtype. */
ALWAYS_INLINE void add_n(void *y, int64_t offset, int64_t n, f32xL v, const int bf16) {
    for (int64_t i = 0; i < n && i < LANES; i++) {
        if (bf16) {
            const float sum = bf16_round(load_one(y, offset + i, 1) + v[i]);
            uint32_t bits;
            memcpy(&bits, &sum, sizeof bits);
            ((uint16_t *)y)[offset + i] = (uint16_t)(bits >> 16);
        } else {
            ((float *)y)[offset + i] += v[i];
        }
    }
}

/* t[j][k0 ...] = x[tok[j]] A[:, k0 ... k0 + width] for the n tokens of a tile (A: one slot's [in, k]).
   With n and vectors known at compile time (the full tile) the sums stay in registers. */
ALWAYS_INLINE void shrink_tile(float *t, int64_t t_stride, const void *x, const int64_t *tok, const int n,
                               const void *a, int64_t in, int64_t k, int64_t k0, int64_t width, const int vectors,
                               const int bf16) {
    f32xL acc[TB][KT] = {};
    for (int64_t i = 0; i < in; i++) {
        f32xL av[KT];
        for (int v = 0; v < vectors; v++) av[v] = load_n(a, i * k + k0 + v * LANES, width - v * LANES, bf16);
        for (int j = 0; j < n; j++) {
            const float xv = load_one(x, tok[j] * in + i, bf16);
            for (int v = 0; v < vectors; v++) acc[j][v] += xv * av[v];
        }
    }
    for (int j = 0; j < n; j++)
        for (int v = 0; v < vectors; v++)
            for (int l = 0; l < LANES && v * LANES + l < width; l++) t[j * t_stride + k0 + v * LANES + l] = acc[j][v][l];
}

/* y[tok[j]][col ... col + width] += t[j][k0 ... k0 + rank] B[k0 ..., col ...] for the n tokens of a tile
   (B: one slot's [k, out]). */
ALWAYS_INLINE void expand_tile(void *y, const float *t, int64_t t_stride, const int64_t *tok, const int n,
                               const void *b, int64_t out, int64_t k0, int64_t rank, int64_t col, int64_t width,
                               const int vectors, const int bf16) {
    f32xL acc[TB][KT] = {};
    for (int64_t kk = 0; kk < rank; kk++) {
        f32xL bv[KT];
        for (int v = 0; v < vectors; v++) bv[v] = load_n(b, (k0 + kk) * out + col + v * LANES, width - v * LANES, bf16);
        for (int j = 0; j < n; j++) {
            const float tv = t[j * t_stride + k0 + kk];
            for (int v = 0; v < vectors; v++) acc[j][v] += tv * bv[v];
        }
    }
    for (int j = 0; j < n; j++)
        for (int v = 0; v < vectors; v++) {
            const int64_t at = tok[j] * out + col + v * LANES, lanes = width - v * LANES;
            if (!bf16 && lanes >= LANES) {
                f32xL yv;
                memcpy(&yv, (float *)y + at, sizeof yv);
                yv += acc[j][v];
                memcpy((float *)y + at, &yv, sizeof yv);
            } else {
                add_n(y, at, lanes, acc[j][v], bf16);
            }
        }
}

/* A group of up to TB tokens of one slot: where its tokens start in the sorted order, how many, the slot. */
typedef struct { int64_t start, n, slot; } block_t;
/* A tile of output columns: its slice (which rank columns feed it), first column, width (<= TILE). */
typedef struct { int64_t slice, col, width; } cols_t;

static void shrink_item(float *t, const void *x, const int64_t *order, const block_t *bl, const void *a,
                        int64_t in, int64_t k, int64_t k0, const int bf16) {
    const int64_t width = k - k0 < TILE ? k - k0 : TILE;
    const void *as = (const char *)a + bl->slot * in * k * (bf16 ? 2 : 4);
    float *tb = t + bl->start * k;
    const int64_t *tok = order + bl->start;
    if (bl->n == TB && width == TILE) shrink_tile(tb, k, x, tok, TB, as, in, k, k0, TILE, KT, bf16);
    else shrink_tile(tb, k, x, tok, (int)bl->n, as, in, k, k0, width, (int)((width + LANES - 1) / LANES), bf16);
}

static void expand_item(void *y, const float *t, const int64_t *order, const block_t *bl, const cols_t *c,
                        const void *b, int64_t k, int64_t out, int64_t rank, const int bf16) {
    const void *bs = (const char *)b + bl->slot * k * out * (bf16 ? 2 : 4);
    const float *tb = t + bl->start * k;
    const int64_t *tok = order + bl->start, k0 = c->slice * rank;
    if (bl->n == TB && c->width == TILE) expand_tile(y, tb, k, tok, TB, bs, out, k0, rank, c->col, TILE, KT, bf16);
    else expand_tile(y, tb, k, tok, (int)bl->n, bs, out, k0, rank, c->col, c->width,
                     (int)((c->width + LANES - 1) / LANES), bf16);
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

/* Returns 0; 1: no memory for the scratch; 2: a slot outside [0, nslots). */
int lora_add(void *y, const void *x, const void *a, const void *b, const int64_t *slots, const int64_t *slices,
             int64_t rows, int64_t seq, int64_t in, int64_t k, int64_t out, int64_t nslots, int64_t nslices,
             int dtype, int threads) {
    const int bf16 = dtype == DTYPE_BFLOAT16;
    for (int64_t r = 0; r < rows; r++)
        if (slots[r] < 0 || slots[r] >= nslots) return 2;
    int64_t adapted = 0;  /* rows of the base model alone (a step with no adapter row) cost nothing */
    for (int64_t r = 0; r < rows; r++) adapted += slots[r] != 0;
    if (!adapted) return 0;
    const int64_t tokens = rows * seq, rank = k / nslices;
    int64_t ncols = 0;
    for (int64_t j = 0; j < nslices; j++) ncols += (slices[2 * j + 1] + TILE - 1) / TILE;
    int64_t *order = malloc(sizeof(int64_t) * (tokens ? tokens : 1));
    block_t *blocks = malloc(sizeof(block_t) * (tokens ? tokens : 1));
    cols_t *cols = malloc(sizeof(cols_t) * (ncols ? ncols : 1));
    float *t = malloc(sizeof(float) * (tokens ? tokens : 1) * k);
    if (!order || !blocks || !cols || !t) {
        free(order), free(blocks), free(cols), free(t);
        return 1;
    }
    const int64_t nblocks = group_tokens(slots, rows, seq, nslots, order, blocks);
    for (int64_t j = 0, c = 0; j < nslices; j++)
        for (int64_t col = 0; col < slices[2 * j + 1]; col += TILE)
            cols[c++] = (cols_t){j, slices[2 * j] + col, slices[2 * j + 1] - col < TILE ? slices[2 * j + 1] - col : TILE};
    const int64_t ktiles = (k + TILE - 1) / TILE, used = nblocks ? blocks[nblocks - 1].start + blocks[nblocks - 1].n : 0;
    if (threads < 2 || used * (in * k + rank * out) < PARALLEL_MIN) threads = 1;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
#pragma omp for schedule(static)
        for (int64_t item = 0; item < nblocks * ktiles; item++)
            shrink_item(t, x, order, &blocks[item / ktiles], a, in, k, (item % ktiles) * TILE, bf16);
        /* the implicit barrier: every token's x A is in t before any expand reads it */
#pragma omp for schedule(static)
        for (int64_t item = 0; item < nblocks * ncols; item++)
            expand_item(y, t, order, &blocks[item / ncols], &cols[item % ncols], b, k, out, rank, bf16);
    }
    free(order), free(blocks), free(cols), free(t);
    return 0;
}
