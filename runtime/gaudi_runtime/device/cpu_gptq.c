/* Activation rows times a GPTQ weight that stays packed: y = x W^T with W[o, i] =
   scale[o, g] * (q[o, i] - zero[o, g]) for the group g of input column i, never materialized.

   Decode multiplies a few rows by every weight: bound by the bytes read, 4x fewer than bfloat16's at 4
   bits if unpacking keeps up with the memory. So the inner step does three vector operations per vector of
   packed words and value position k (a mask, a conversion to float, a multiply-add), none per weight:
     - x is regrouped once per call as xt[r][k][word] = x[r, word * per + k] * 2^-(bits * k), so that the
       k-th value of LANES consecutive words meets LANES consecutive floats, and the field needs no shift:
       (word & (mask << bits * k)) as a float is q * 2^(bits * k), exactly, and the power of two cancels
       exactly in the product;
     - the scale is applied once per chunk of LANES words (one multiply-add of each lane's partial sum by
       the lane's group's scale: a broadcast when the chunk lies in one group, GPTQ's groups of 128 at 4
       bits), and the zero once per group and row: sum_g scale * zero * (sum of the group's x), subtracted;
     - a tile of OUTS output rows by ROWS activation rows shares each loaded x vector and unpacked weight
       vector (registers), and a block of activation rows reuses the unpacked words of an output row.
   Groups: any g_idx whose groups keep each packed word within one group (`wgroup`: the group of each word).

   Layouts (contiguous): x float32 [rows, in]; qweight int32 [out, in / (32 / bits)], consecutive input
   columns lowest bits first; zeros int16 [out, groups]; scales float32 [out, groups]; wgroup int32
   [in / per]; y float32 rows of stride ldy. Each output is summed by one thread in an order fixed by its
   row alone (neither the thread count nor the other rows change its bits). cpu_gptq.py builds and calls it.
   Plain C with GCC/Clang vector types; intrinsics only for what they cannot say (AVX-512 masked loads,
   the bfloat16 dot product). */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define ALWAYS_INLINE static inline __attribute__((always_inline))

#if defined(__AVX512F__)
#define LANES 16
#else
#define LANES 8
#endif
typedef float vf __attribute__((vector_size(LANES * 4)));
typedef uint32_t vu __attribute__((vector_size(LANES * 4)));

/* Activation rows per block: their accumulators and the tile's unpacked vectors fit the registers. */
enum { MAX_ROWS = 32 };
/* How far ahead of its reads a bfloat16 path asks for packed words (2 KB: the best of 0.5-8 KB at one row,
   of 0.5-4 KB at 16; without it 16 rows of a weight streamed from memory ran 15-30% slower than from L3). */
enum { PREFETCH_BYTES = 2048 };

struct problem {
    const float *xt;      /* [rows][per][words], pre-scaled (above) */
    const float *zx;      /* [rows][groups]: sum of x over each group's columns */
    const int32_t *q;     /* [out][words] */
    const int16_t *zeros; /* [out][groups] */
    const float *scales;  /* [out][groups] */
    const int32_t *wgroup;/* [words] */
    const int32_t *chunk_group; /* [chunks]: the group of every word of the chunk, or -1 if they differ */
    const uint32_t *xp;   /* the bfloat16 path's x (below), or NULL */
    int64_t words, chunks, groups, rows;
    int ybf16;            /* the folded path's y: bfloat16 (1) or float32 (0) */
};

static int32_t *word_groups(const int32_t *g_idx, int64_t words, int64_t chunks, int per);

/* The lanes of v summed pairwise in a fixed order (lane l += lane l + width, width halving), in registers. */
ALWAYS_INLINE float sum_lanes(vf v) {
#if LANES == 16
    v += __builtin_shuffle(v, (vu){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
#endif
    v += __builtin_shuffle(v, (vu){4, 5, 6, 7, 0, 1, 2, 3});
    v += __builtin_shuffle(v, (vu){2, 3, 0, 1, 2, 3, 0, 1});
    return v[0] + v[1];
}

typedef int16_t vs __attribute__((vector_size(LANES * 2)));

/* sum_g scale_g * (zero_g + offset) * zx_g: the zeros' term of one output and row, LANES groups a step. */
ALWAYS_INLINE float zero_term(const float *sc, const int16_t *z, const float *zx, int64_t groups, float offset) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    /* Per output, so it matters at one row: the groups past the last whole vector in one masked step
       (12 groups of 128 for 1536 inputs, all of them). */
    __m512 acc = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g += 16) {
        const __mmask16 m = groups - g >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (groups - g)) - 1u);
        const __m512 zf = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm256_maskz_loadu_epi16(m, z + g)));
        const __m512 sz = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, sc + g), _mm512_add_ps(zf, _mm512_set1_ps(offset)));
        acc = _mm512_fmadd_ps(sz, _mm512_maskz_loadu_ps(m, zx + g), acc);
    }
    return sum_lanes((vf)acc);
#else
    vf acc = (vf){0};
    int64_t g = 0;
    for (; g + LANES <= groups; g += LANES) {
        vf sv, xv;
        vs zv;
        memcpy(&sv, sc + g, sizeof sv);
        memcpy(&xv, zx + g, sizeof xv);
        memcpy(&zv, z + g, sizeof zv);
        acc += sv * (__builtin_convertvector(zv, vf) + offset) * xv;
    }
    float sum = sum_lanes(acc);
    for (; g < groups; g++) sum += sc[g] * ((float)z[g] + offset) * zx[g];
    return sum;
#endif
}

ALWAYS_INLINE vf chunk_scales(const struct problem *p, const float *sc, int64_t c) {
    const int32_t g = p->chunk_group[c];
    if (g >= 0)
        return (vf){0} + sc[g];
    vf s;
    for (int l = 0; l < LANES; l++) s[l] = sc[p->wgroup[c * LANES + l]];
    return s;
}

/* What is left of output o for activation row r once the vector part is summed: the words past the
   last whole chunk, and the zeros' term. */
ALWAYS_INLINE void finish(float *y, int64_t ldy, const struct problem *p, int64_t o, int64_t r, vf total,
                          const int BITS) {
    const int per = 32 / BITS;
    const uint32_t mask = (1u << BITS) - 1u;
    const int64_t words = p->words;
    if (r >= p->rows) return;  /* a padding row */
    const float *sc = p->scales + o * p->groups;
    const int16_t *z = p->zeros + o * p->groups;
    const float *xt = p->xt + r * per * words;
    float acc = sum_lanes(total);
    for (int64_t j = p->chunks * LANES; j < words; j++) {
        const uint32_t word = (uint32_t)p->q[o * words + j];
        float part = 0.0f;
        for (int k = 0; k < per; k++) part += xt[k * words + j] * (float)(word & (mask << (BITS * k)));
        acc += sc[p->wgroup[j]] * part;
    }
    y[r * ldy + o] = acc - zero_term(sc, z, p->zx + r * p->groups, p->groups, 0.0f);
}

#define FOR4(M) M(0) M(1) M(2) M(3)
#define FIELD(w, k) __builtin_convertvector((w) & (mask << (BITS * (k))), vf)

/* One activation row, output rows o0 .. o0 + 3 (decode at c=1): four independent sums, each chunk's
   partial sums scaled once by the chunk's scales. */
ALWAYS_INLINE void one_row(float *y, int64_t ldy, const struct problem *p, int64_t o0, const int BITS) {
    const int per = 32 / BITS;
    const uint32_t mask = (1u << BITS) - 1u;
    const int64_t words = p->words;
#define DECL(i) vf t##i = (vf){0}; const int32_t *q##i = p->q + (o0 + i) * words; \
    const float *sc##i = p->scales + (o0 + i) * p->groups;
    FOR4(DECL)
    for (int64_t c = 0; c < p->chunks; c++) {
        const int64_t j = c * LANES;
#define LOAD(i) vu w##i; memcpy(&w##i, q##i + j, sizeof w##i); vf p##i = (vf){0}; \
    __builtin_prefetch(q##i + 4 * words + j);
        FOR4(LOAD)
        for (int k = 0; k < per; k++) {
            vf xv;
            memcpy(&xv, p->xt + k * words + j, sizeof xv);
#define MAC(i) p##i += xv * FIELD(w##i, k);
            FOR4(MAC)
        }
#define SCALE(i) t##i += chunk_scales(p, sc##i, c) * p##i;
        FOR4(SCALE)
    }
#define FINISH(i) finish(y, ldy, p, o0 + i, 0, t##i, BITS);
    FOR4(FINISH)
}

/* Four activation rows (r0 ..), output rows o0 and o0 + 1: each unpacked weight vector, scaled by its
   lanes' scales, meets four rows of x, and each x vector two weight rows. */
ALWAYS_INLINE void four_rows(float *y, int64_t ldy, const struct problem *p, int64_t o0, int64_t r0,
                             const int BITS) {
    const int per = 32 / BITS;
    const uint32_t mask = (1u << BITS) - 1u;
    const int64_t words = p->words;
    const int32_t *qa = p->q + o0 * words, *qb = qa + words;
    const float *sa = p->scales + o0 * p->groups, *sb = sa + p->groups;
#define ZERO(r) vf a##r = (vf){0}, b##r = (vf){0};
    FOR4(ZERO)
    for (int64_t c = 0; c < p->chunks; c++) {
        const int64_t j = c * LANES;
        vu wa, wb;
        memcpy(&wa, qa + j, sizeof wa);
        memcpy(&wb, qb + j, sizeof wb);
        const vf ska = chunk_scales(p, sa, c), skb = chunk_scales(p, sb, c);
        for (int k = 0; k < per; k++) {
            const vf fa = FIELD(wa, k) * ska, fb = FIELD(wb, k) * skb;
#define ROW(r) { vf xv; memcpy(&xv, p->xt + ((r0 + r) * per + k) * words + j, sizeof xv); \
                 a##r += xv * fa; b##r += xv * fb; }
            FOR4(ROW)
        }
    }
#define DONE(r) finish(y, ldy, p, o0, r0 + r, a##r, BITS); finish(y, ldy, p, o0 + 1, r0 + r, b##r, BITS);
    FOR4(DONE)
}

/* Output rows o0 .. o0 + 4 quads - 1, every activation row (padded to a multiple of four: see gptq_gemm).
   Several rows: row block by row block over the whole tile of outputs, so that a block's x stays in the
   L1 cache while the tile's packed words (QUADS * 4 rows) come from L2. */
enum { QUADS = 16 };

ALWAYS_INLINE void outputs(float *y, int64_t ldy, const struct problem *p, int64_t o0, int64_t quads, int64_t rows,
                           const int BITS) {
    if (rows == 1) {
        for (int64_t t = 0; t < quads; t++) one_row(y, ldy, p, o0 + 4 * t, BITS);
        return;
    }
    for (int64_t r = 0; r < rows; r += 4)
        for (int64_t o = o0; o < o0 + 2 * 2 * quads; o += 2) four_rows(y, ldy, p, o, r, BITS);
}

static void run(float *y, int64_t ldy, const struct problem *p, int64_t rows, int64_t out, int bits, int threads) {
    const int64_t quads = out / 4, tiles = (quads + QUADS - 1) / QUADS;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t n = quads - t * QUADS < QUADS ? quads - t * QUADS : QUADS;
        if (bits == 4) outputs(y, ldy, p, t * QUADS * 4, n, rows, 4);
        else outputs(y, ldy, p, t * QUADS * 4, n, rows, 8);
    }
}

/* ---- bfloat16 activations, 4 bits, on a CPU with avx512_bf16 ---------------------------------------
   The instruction multiplies 32 pairs of bfloat16 per step where the float path converts 16 values: each
   packed value becomes the bfloat16 1 + q/16 (exponent of one, q in the top mantissa bits: a shift and one
   bitwise select per 32 values, exact), and x (bfloat16 already, exact) is paired to match:
   xp[r][k][word] = x[r, 8 word + k] | x[r, 8 word + k + 4] << 16 for k < 4, the two values a shift right by
   4k - 3 brings to bits 3 and 19. Products are exact and summed in float32 (round to nearest even, inputs
   below the smallest normal read as zero), so sum(x (1 + q/16)) = sum(x) + sum(x q)/16, and
       y = sum_g 16 scale_g * dot_g - sum_g scale_g * (zero_g + 16) * (sum of x over g). */
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define HAVE_BF16_DOT 1

ALWAYS_INLINE __m512bh ones_plus(__m512i w, const int k) {
    const __m512i v = k == 0 ? _mm512_slli_epi32(w, 3) : _mm512_srli_epi32(w, 4 * k - 3);
    /* (v & 0x00780078) | 0x3f803f80: ternary-logic table 0xea is (a & b) | c */
    return (__m512bh)_mm512_ternarylogic_epi32(v, _mm512_set1_epi32(0x00780078), _mm512_set1_epi32(0x3f803f80), 0xea);
}

ALWAYS_INLINE __m512bh xpair(const struct problem *p, int64_t r, int k, int64_t j) {
    return (__m512bh)_mm512_loadu_si512(p->xp + (r * 4 + k) * p->words + j);
}

/* Activation rows r0 .. r0 + ROWS - 1, output row o. The packed words of a tile's outputs are read in
   memory order, one sequential stream that the hardware prefetcher follows (outputs read side by side,
   a chunk of each in turn, made short streams it kept losing: half the speed), PREFETCH_BYTES fetched
   ahead; each chunk unpacked once for the rows, its four steps in two sums per row. */
ALWAYS_INLINE void rows_bf16(float *y, int64_t ldy, const struct problem *p, int64_t o, int64_t r0, const int ROWS) {
    const int64_t words = p->words;
    const int32_t *q = p->q + o * words;
    const float *sc = p->scales + o * p->groups;
    __m512 t[4];
#pragma GCC unroll 4
    for (int r = 0; r < ROWS; r++) t[r] = _mm512_setzero_ps();
    for (int64_t c = 0; c < p->chunks; c++) {
        const int64_t j = c * LANES;
        const __m512i w = _mm512_loadu_si512(q + j);
        __builtin_prefetch((const char *)(q + j) + PREFETCH_BYTES);
        const __m512bh w0 = ones_plus(w, 0), w1 = ones_plus(w, 1), w2 = ones_plus(w, 2), w3 = ones_plus(w, 3);
        const __m512 scale = (__m512)chunk_scales(p, sc, c);
#pragma GCC unroll 4
        for (int r = 0; r < ROWS; r++) {
            __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), xpair(p, r0 + r, 0, j), w0);
            __m512 b = _mm512_dpbf16_ps(_mm512_setzero_ps(), xpair(p, r0 + r, 2, j), w2);
            a = _mm512_dpbf16_ps(a, xpair(p, r0 + r, 1, j), w1);
            b = _mm512_dpbf16_ps(b, xpair(p, r0 + r, 3, j), w3);
            t[r] = _mm512_fmadd_ps(scale, _mm512_add_ps(a, b), t[r]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < ROWS; r++)  /* whole chunks only: gptq_gemm takes this path when words % LANES == 0 */
        y[(r0 + r) * ldy + o] = 16.0f * sum_lanes((vf)t[r]) -
                                zero_term(sc, p->zeros + o * p->groups, p->zx + (r0 + r) * p->groups, p->groups, 16.0f);
}

/* Outputs o0 .. o1 - 1 for activation rows r0 .. r0 + rows - 1 (rows <= 4). */
ALWAYS_INLINE void row_block_bf16(float *y, int64_t ldy, const struct problem *p, int64_t o0, int64_t o1, int64_t r0,
                                  int64_t rows) {
    for (int64_t o = o0; o < o1; o++)
        switch (rows) {
        case 1: rows_bf16(y, ldy, p, o, r0, 1); break;
        case 2: rows_bf16(y, ldy, p, o, r0, 2); break;
        case 3: rows_bf16(y, ldy, p, o, r0, 3); break;
        default: rows_bf16(y, ldy, p, o, r0, 4); break;
        }
}

static void run_bf16(float *y, int64_t ldy, const struct problem *p, int64_t rows, int64_t out, int threads) {
    const int64_t quads = out / 4, tiles = (quads + QUADS - 1) / QUADS;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {  /* as run */
        const int64_t o0 = t * QUADS * 4, o1 = o0 + 4 * (quads - t * QUADS < QUADS ? quads - t * QUADS : QUADS);
        for (int64_t r = 0; r < rows; r += 4) row_block_bf16(y, ldy, p, o0, o1, r, rows - r < 4 ? rows - r : 4);
    }
}

/* ---- several bfloat16 rows, 4 bits: each weight dequantized once, in registers ----------------------
   From a few rows up, the path above spends more on partial sums and their scaling than on the dot
   products. Here each vector of 32 unpacked values of one output row becomes the bfloat16 of
   scale * (q - zero) (exact in float32 before the rounding: the same bfloat16 weight the layer's own
   dequantizing path multiplies), and meets up to FOLD_BLOCK activation rows held in registers; no partial
   sums and no zeros' term. The pairs are the bfloat16 path's (xp above: lane l of step k holds the
   values 8 word + k and + 4), so x is laid out as pair_x does, rows of one step side by side (fold_x).
   A chunk in one group (GPTQ's groups of 128) looks its 16 possible weights up in a table (a shift, a
   mask and one permute per 32 values); a chunk that mixes groups computes each from 1 + q/16 with one
   multiply-add per 16 values and interleaves the two halves. Row blocks run inside a tile of outputs
   whose packed words stay in the cache, so the weights come from memory once whatever the rows. */
enum { FOLD_BLOCK = 12, FOLD_TILE = 32 };

/* The bfloat16 weights scale * (q - zero) for q = 0..15, in the low 16 entries of a permute table. */
ALWAYS_INLINE __m512i weight_table(float scale, float zero) {
    const __m512 q = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m256bh w = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_sub_ps(q, _mm512_set1_ps(zero)), _mm512_set1_ps(scale)));
    return _mm512_zextsi256_si512((__m256i)w);
}

ALWAYS_INLINE __m512bh looked_up(__m512i w, const int k, __m512i table) {
    const __m512i q = _mm512_and_si512(k ? _mm512_srli_epi32(w, 4 * k) : w, _mm512_set1_epi32(0x000f000f));
    return (__m512bh)_mm512_permutexvar_epi16(q, table);
}

/* A chunk whose lanes' groups differ: 16 scale * (1 + q/16) - scale * (16 + zero), a and b per lane. */
ALWAYS_INLINE __m512bh computed(__m512i w, const int k, __m512 a, __m512 b) {
    const __m512i v = (__m512i)ones_plus(w, k);
    const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    const __m512 hi = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u)));
    const __m512i halves = (__m512i)_mm512_cvtne2ps_pbh(_mm512_fmadd_ps(hi, a, b), _mm512_fmadd_ps(lo, a, b));
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                           23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return (__m512bh)_mm512_permutexvar_epi16(pairs, halves);
}

/* Chunk c's four steps of output row o as bfloat16 pair vectors. */
ALWAYS_INLINE void chunk_weights(const struct problem *p, int64_t o, int64_t c, __m512bh wf[4]) {
    const float *sc = p->scales + o * p->groups;
    const int16_t *z = p->zeros + o * p->groups;
    const __m512i w = _mm512_loadu_si512(p->q + o * p->words + c * LANES);
    const int32_t g = p->chunk_group[c];
    if (g >= 0) {
        const __m512i table = weight_table(sc[g], (float)z[g]);
        wf[0] = looked_up(w, 0, table), wf[1] = looked_up(w, 1, table);
        wf[2] = looked_up(w, 2, table), wf[3] = looked_up(w, 3, table);
        return;
    }
    vf s, zf;
    for (int l = 0; l < LANES; l++) {
        s[l] = sc[p->wgroup[c * LANES + l]];
        zf[l] = (float)z[p->wgroup[c * LANES + l]];
    }
    const __m512 a = (__m512)(16.0f * s), b = (__m512)(-(s * (zf + 16.0f)));
    wf[0] = computed(w, 0, a, b), wf[1] = computed(w, 1, a, b);
    wf[2] = computed(w, 2, a, b), wf[3] = computed(w, 3, a, b);
}

/* float32 -> bfloat16 bits, rounded to nearest even (as torch rounds finite values). */
ALWAYS_INLINE uint16_t bf16_bits(float f) {
    uint32_t b;
    memcpy(&b, &f, sizeof b);
    return (uint16_t)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

/* Outputs o, o + 1 for activation rows r0 .. r0 + ROWS - 1 (rows past p->rows: zeros in xf, not written):
   each x vector meets both outputs' weights. */
ALWAYS_INLINE void folded_rows(float *y, int64_t ldy, const struct problem *p, const uint16_t *xf, int64_t padded,
                               int64_t o, int64_t r0, const int ROWS) {
    __m512 acc[FOLD_BLOCK], acc2[FOLD_BLOCK];
#pragma GCC unroll 16
    for (int r = 0; r < ROWS; r++) acc[r] = acc2[r] = _mm512_setzero_ps();
    for (int64_t c = 0; c < p->chunks; c++) {
        __m512bh wf[4], wf2[4];
        chunk_weights(p, o, c, wf);
        chunk_weights(p, o + 1, c, wf2);
        __builtin_prefetch((const char *)(p->q + o * p->words + c * LANES) + PREFETCH_BYTES);
        __builtin_prefetch((const char *)(p->q + (o + 1) * p->words + c * LANES) + PREFETCH_BYTES);
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) {
            const uint16_t *xk = xf + ((c * 4 + k) * padded + r0) * 32;
#pragma GCC unroll 16
            for (int r = 0; r < ROWS; r++) {
                const __m512bh xv = (__m512bh)_mm512_loadu_si512(xk + r * 32);
                acc[r] = _mm512_dpbf16_ps(acc[r], xv, wf[k]);
                acc2[r] = _mm512_dpbf16_ps(acc2[r], xv, wf2[k]);
            }
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < ROWS; r++)
        if (r0 + r < p->rows) {
            const float v = sum_lanes((vf)acc[r]), v2 = sum_lanes((vf)acc2[r]);
            if (p->ybf16) {
                ((uint16_t *)y)[(r0 + r) * ldy + o] = bf16_bits(v);
                ((uint16_t *)y)[(r0 + r) * ldy + o + 1] = bf16_bits(v2);
            } else {
                y[(r0 + r) * ldy + o] = v;
                y[(r0 + r) * ldy + o + 1] = v2;
            }
        }
}

/* Activation rows r0 .. r0 + min(size, rows - r0) - 1 against outputs o0 .. o1 - 1 (o1 - o0 even). */
static void folded_block(float *y, int64_t ldy, const struct problem *p, const uint16_t *xf, int64_t o0,
                         int64_t o1, int64_t r0, int64_t size) {
    const int64_t left = p->rows - r0 < size ? p->rows - r0 : size;
    const int64_t padded = (p->rows + FOLD_BLOCK - 1) / FOLD_BLOCK * FOLD_BLOCK;
    for (int64_t o = o0; o < o1; o += 2) {
        if (left > 8) folded_rows(y, ldy, p, xf, padded, o, r0, 12);
        else if (left > 4) folded_rows(y, ldy, p, xf, padded, o, r0, 8);
        else folded_rows(y, ldy, p, xf, padded, o, r0, 4);
    }
}

/* Rows in blocks of at most FOLD_BLOCK, as even as multiples of four allow (16 rows: two of 8, not 12 and
   4, since each block unpacks the weights again). */
static void run_folded(float *y, int64_t ldy, const struct problem *p, const uint16_t *xf, int64_t out,
                       int threads) {
    const int64_t tiles = (out + FOLD_TILE - 1) / FOLD_TILE, blocks = (p->rows + FOLD_BLOCK - 1) / FOLD_BLOCK;
    const int64_t size = ((p->rows + blocks - 1) / blocks + 3) / 4 * 4;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t o0 = t * FOLD_TILE, o1 = o0 + FOLD_TILE < out ? o0 + FOLD_TILE : out;
        for (int64_t r = 0; r < p->rows; r += size) folded_block(y, ldy, p, xf, o0, o1, r, size);
    }
}

/* x in the folded path's order: pair_x's pairs, the rows of one (chunk, k) side by side so that a block of
   rows reads consecutive lines: xf[(chunk * 4 + k) * padded + r][2 l + h] = x[r, 8 (16 chunk + l) + k + 4 h],
   rows padded with zeros to a multiple of FOLD_BLOCK; NULL: no memory. A chunk's 128 values of a row are
   four vectors, and each k's 32 a permutation of them: two two-source permutes and a blend. */
static uint16_t *fold_x(const uint16_t *x, int64_t rows, int64_t in) {
    const int64_t padded = (rows + FOLD_BLOCK - 1) / FOLD_BLOCK * FOLD_BLOCK, chunks = in / 128;
    uint16_t *xf = calloc((size_t)(padded * in + 1), sizeof(uint16_t));
    if (!xf) return NULL;
    __m512i idx[4];
    for (int k = 0; k < 4; k++) {
        uint16_t lane[32];
        for (int t = 0; t < 32; t++) lane[t] = (uint16_t)((8 * (t / 2) + k + 4 * (t % 2)) & 63);
        idx[k] = _mm512_loadu_si512(lane);
    }
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < chunks; c++) {
            const uint16_t *src = x + r * in + 128 * c;
            const __m512i a = _mm512_loadu_si512(src), b = _mm512_loadu_si512(src + 32);
            const __m512i d = _mm512_loadu_si512(src + 64), e = _mm512_loadu_si512(src + 96);
            for (int k = 0; k < 4; k++) {
                const __m512i low = _mm512_permutex2var_epi16(a, idx[k], b), high = _mm512_permutex2var_epi16(d, idx[k], e);
                _mm512_storeu_si512(xf + ((c * 4 + k) * padded + r) * 32, _mm512_mask_blend_epi16(0xffff0000u, low, high));
            }
        }
    return xf;
}

/* y[rows, out] (float32, or bfloat16 rounded to nearest even when ybf16; row stride ldy) = x W^T for
   bfloat16 x, 4-bit W whose packed rows are whole chunks (in % 128 == 0): any number of rows. Returns 0;
   -2: no memory; -3: not a problem it takes (gptq_folds says which). */
int gptq_folded_gemm(void *y, int64_t ldy, int ybf16, const uint16_t *x, const int32_t *qweight,
                     const int16_t *zeros, const float *scales, const int32_t *g_idx, int64_t rows, int64_t in,
                     int64_t out, int64_t groups, int threads) {
    if (in % 128 || out % 2) return -3;
    const int64_t words = in / 8, chunks = words / LANES;
    uint16_t *xf = fold_x(x, rows, in);
    int32_t *wgroup = word_groups(g_idx, words, chunks, 8);
    int err = (!xf || !wgroup) ? -2 : 0;
    if (!err) {
        const struct problem p = {NULL, NULL, qweight, zeros, scales, wgroup, wgroup + words, NULL, words, chunks,
                                  groups, rows, ybf16};
        run_folded(y, ldy, &p, xf, out, threads);
    }
    free(xf);
    free(wgroup);
    return err;
}

/* x's bfloat16 pairs (above), padded rows zero; NULL: no memory. */
static uint32_t *pair_x(const uint16_t *x, int64_t rows, int64_t in) {
    const int64_t words = in / 8;
    uint32_t *xp = calloc((size_t)((rows + 3) / 4 * 4 * in / 2 + 1), sizeof(uint32_t));
    if (!xp) return NULL;
    for (int64_t r = 0; r < rows; r++)
        for (int k = 0; k < 4; k++)
            for (int64_t j = 0; j < words; j++)
                xp[(r * 4 + k) * words + j] = x[r * in + 8 * j + k] | (uint32_t)x[r * in + 8 * j + k + 4] << 16;
    return xp;
}
#else
#define HAVE_BF16_DOT 0
int gptq_folded_gemm(void *y, int64_t ldy, int ybf16, const uint16_t *x, const int32_t *qweight,
                     const int16_t *zeros, const float *scales, const int32_t *g_idx, int64_t rows, int64_t in,
                     int64_t out, int64_t groups, int threads) {
    return -3;
}
#endif

int gptq_max_rows(void) { return MAX_ROWS; }

/* Whether gptq_folded_gemm exists in this build (a CPU with the bfloat16 dot product). */
int gptq_folds(void) { return HAVE_BF16_DOT; }

/* The regrouped, pre-scaled x and each group's sums of x (freed by the caller); NULL: no memory. */
static float *prepare_x(const float *x, const int32_t *g_idx, int64_t rows, int64_t in, int64_t groups, int bits,
                        float **zx) {
    const int per = 32 / bits;
    const int64_t words = in / per;
    const int64_t padded = (rows + 3) / 4 * 4;  /* the row blocks' padding rows: zeros */
    float *xt = calloc((size_t)(padded * in + 1), sizeof(float));
    *zx = calloc((size_t)(padded * groups + 1), sizeof(float));
    if (!xt || !*zx) {
        free(xt);
        free(*zx);
        *zx = NULL;
        return NULL;
    }
    for (int64_t r = 0; r < rows; r++)
        for (int k = 0; k < per; k++) {
            const float unit = 1.0f / (float)(1u << (bits * k));  /* 2^-(bits k): exact */
            float *dst = xt + (r * per + k) * words;
            const float *src = x + r * in + k;
            for (int64_t j = 0; j < words; j++) dst[j] = src[j * per] * unit;
        }
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < in; i++) (*zx)[r * groups + g_idx[i]] += x[r * in + i];
    return xt;
}

/* The group of each packed word, then each chunk's group (-1: several); NULL: no memory. */
static int32_t *word_groups(const int32_t *g_idx, int64_t words, int64_t chunks, int per) {
    int32_t *wgroup = malloc(sizeof(int32_t) * (size_t)(words + chunks + 1));
    if (!wgroup) return NULL;
    int32_t *chunk_group = wgroup + words;
    for (int64_t j = 0; j < words; j++) wgroup[j] = g_idx[j * per];
    for (int64_t c = 0; c < chunks; c++) {
        chunk_group[c] = wgroup[c * LANES];
        for (int l = 1; l < LANES; l++)
            if (wgroup[c * LANES + l] != chunk_group[c]) chunk_group[c] = -1;
    }
    return wgroup;
}

static float *widen(const uint16_t *x, int64_t n) {
    float *f = malloc(sizeof(float) * (size_t)(n + 1));
    if (f)
        for (int64_t i = 0; i < n; i++) {
            const uint32_t bits = (uint32_t)x[i] << 16;
            memcpy(f + i, &bits, sizeof bits);
        }
    return f;
}

/* y[rows, out] (float32, row stride ldy) = x[rows, in] W^T for rows <= MAX_ROWS and out a multiple of 4;
   x float32 (xbf16 = 0) or bfloat16 (1); g_idx [in]: each column's group (every packed word within one
   group). Returns 0; -2: no memory; -3: rows or out not ones it takes. */
int gptq_gemm(float *y, int64_t ldy, const void *x, int xbf16, const int32_t *qweight, const int16_t *zeros,
              const float *scales, const int32_t *g_idx, int64_t rows, int64_t in, int64_t out, int64_t groups,
              int bits, int threads) {
    if (rows > MAX_ROWS || out % 4) return -3;
    const int per = 32 / bits;
    const int64_t words = in / per;
    const int64_t chunks = words / LANES;
    const int pairs = HAVE_BF16_DOT && xbf16 && bits == 4 && words % LANES == 0;
    float *xf = xbf16 ? widen(x, rows * in) : NULL;  /* the sums of x, and the float path's x */
    const float *x32 = xbf16 ? xf : x;
    float *zx = NULL, *xt = NULL;
    uint32_t *xp = NULL;
    if (pairs) {
#if HAVE_BF16_DOT
        xp = pair_x(x, rows, in);
        zx = calloc((size_t)((rows + 3) / 4 * 4 * groups + 1), sizeof(float));
        if (x32 && zx)
            for (int64_t r = 0; r < rows; r++)
                for (int64_t i = 0; i < in; i++) zx[r * groups + g_idx[i]] += x32[r * in + i];
#endif
    } else if (x32) {
        xt = prepare_x(x32, g_idx, rows, in, groups, bits, &zx);
    }
    int32_t *wgroup = word_groups(g_idx, words, chunks, per);
    int err = (!x32 || !zx || !wgroup || (pairs ? !xp : !xt)) ? -2 : 0;
    if (!err) {
        const struct problem p = {xt, zx, qweight, zeros, scales, wgroup, wgroup + words, xp, words, chunks, groups,
                                  rows, 0};
#if HAVE_BF16_DOT
        if (pairs) run_bf16(y, ldy, &p, rows, out, threads);
#endif
        if (!pairs) run(y, ldy, &p, rows, out, bits, threads);
    }
    free(xf);
    free(xt);
    free(zx);
    free(xp);
    free(wgroup);
    return err;
}

/* float32 -> bfloat16 bits, rounded to nearest even (as torch rounds finite values). */
ALWAYS_INLINE vu round_bf16(vf v) {
    vu b;
    memcpy(&b, &v, sizeof b);
    return (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
}

typedef uint16_t vh __attribute__((vector_size(LANES * 2)));

/* Row o of W, (q - zero) * scale in float32 as the layer's own path computes it, LANES values at a time:
   lane l of a step holds column l of the step's LANES / per words. A chunk of LANES words in one group
   (GPTQ's groups of 128 at 4 bits) takes its scale and zero once; others per word. */
ALWAYS_INLINE void dequantize_row(void *dst, const int bf16, const struct problem *p, int64_t o, const int BITS) {
    const int per = 32 / BITS, wpv = LANES / per;
    const uint32_t mask = (1u << BITS) - 1u;
    const int64_t words = p->words;
    const uint32_t *q = (const uint32_t *)p->q + o * words;
    const float *sc = p->scales + o * p->groups;
    const int16_t *z = p->zeros + o * p->groups;
    vu idx, shift;
    for (int l = 0; l < LANES; l++) {
        idx[l] = (uint32_t)(l / per);
        shift[l] = (uint32_t)(BITS * (l % per));
    }
    for (int64_t j = 0; j < words; j += wpv) {
        const int32_t g = j / LANES < p->chunks ? p->chunk_group[j / LANES] : -1;
        vu w = {0};
        vf s = {0}, zf = {0};
        if (j + LANES <= words)
            memcpy(&w, q + j, sizeof w);  /* whole: a partial copy into w would stall its load */
        else
            memcpy(&w, q + j, sizeof(uint32_t) * (size_t)wpv);
        if (g >= 0) {
            s += sc[g];
            zf += (float)z[g];
        } else {
            for (int l = 0; l < wpv; l++) {
                s[l] = sc[p->wgroup[j + l]];
                zf[l] = (float)z[p->wgroup[j + l]];
            }
            s = __builtin_shuffle(s, idx);
            zf = __builtin_shuffle(zf, idx);
        }
        const vf v = (__builtin_convertvector((__builtin_shuffle(w, idx) >> shift) & mask, vf) - zf) * s;
        if (bf16) {
            const vh h = __builtin_convertvector(round_bf16(v), vh);
            memcpy((uint16_t *)dst + j * per, &h, sizeof h);
        } else {
            memcpy((float *)dst + j * per, &v, sizeof v);
        }
    }
}

/* The weight W [out, in] as float32 (bf16 = 0) or bfloat16 (bf16 = 1), for the products of more rows than
   gptq_gemm takes: one pass over the packed words. Same g_idx condition as gptq_gemm, and in a multiple
   of 16. Returns 0; -2: no memory; -3: in is not. */
int gptq_dequantize(void *w, int bf16, const int32_t *qweight, const int16_t *zeros, const float *scales,
                    const int32_t *g_idx, int64_t in, int64_t out, int64_t groups, int bits, int threads) {
    if (in % 16) return -3;
    const int per = 32 / bits;
    const int64_t words = in / per, chunks = words / LANES;
    int32_t *wgroup = word_groups(g_idx, words, chunks, per);
    if (!wgroup) return -2;
    const struct problem p = {NULL, NULL, qweight, zeros, scales, wgroup, wgroup + words, NULL, words, chunks, groups,
                              0, 0};
    const size_t size = bf16 ? 2 : 4;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t o = 0; o < out; o++) {
        char *row = (char *)w + (size_t)(o * in) * size;
        if (bits == 4 && bf16) dequantize_row(row, 1, &p, o, 4);
        else if (bits == 4) dequantize_row(row, 0, &p, o, 4);
        else if (bf16) dequantize_row(row, 1, &p, o, 8);
        else dequantize_row(row, 0, &p, o, 8);
    }
    free(wgroup);
    return 0;
}
