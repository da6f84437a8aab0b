/* A few activation rows times a GPTQ weight that stays packed: y = x W^T with W[o, i] =
   scale[o, g] * (q[o, i] - zero[o, g]) for the group g of input column i, never materialized.

   Decode multiplies one row by every weight: bound by the bytes read. Each output row's packed words
   (bits / 8 bytes per weight) are read once per activation row while they sit in cache, and the
   group's scale and zero are applied once per group, not per weight:
       y[r, o] = sum_g scale[o, g] * (sum_{i in g} x[r, i] q[o, i] - zero[o, g] * sum_{i in g} x[r, i]).
   Groups are runs of consecutive input columns (`bounds[k]` .. `bounds[k + 1]` belong to group
   `gid[k]`): GPTQ without desc_act, or any layout whose g_idx does not go back.

   Layouts (contiguous): x float32 [rows, in]; qweight int32 [out, in / (32 / bits)], consecutive input
   columns lowest bits first; zeros int16 [out, groups]; scales float32 [out, groups]; y float32 rows
   of stride ldy. Each output is summed by one thread in one fixed order. cpu_gptq.py builds and calls it. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* 8 lanes: one AVX2 register (two SSE or NEON ones); GCC/Clang vector types, no intrinsics. */
typedef float v8f __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
enum { VL = 8 };

/* The dot of a run of whole vectors of words: x regrouped as xt[k][word] = x[word * per + k], so that
   the k-th value of 8 consecutive words meets 8 consecutive floats. */
static float run_dot_vec(const float *xt, int64_t words, const int32_t *q, int64_t w0, int64_t w1, int bits) {
    const int per = 32 / bits;
    const v8u mask = (v8u){0} + ((1u << bits) - 1u);
    v8f acc = {0};
    for (int64_t j = w0; j < w1; j += VL) {
        v8u w;
        memcpy(&w, q + j, sizeof w);
        for (int k = 0; k < per; k++) {
            v8f xv;
            memcpy(&xv, xt + k * words + j, sizeof xv);
            const v8u v = (w >> (uint32_t)(bits * k)) & mask;
            acc += xv * __builtin_convertvector((v8i)v, v8f);  /* signed: one instruction, values < 256 */
        }
    }
    float sum = 0.0f;
    for (int l = 0; l < VL; l++)
        sum += acc[l];
    return sum;
}

static float run_dot(const float *x, const int32_t *q, int64_t b0, int64_t b1, int bits) {
    const int per = 32 / bits;
    const uint32_t mask = (1u << bits) - 1u;
    float acc = 0.0f;
    int64_t i = b0;
    for (; i < b1 && i % per; i++)  /* to a word boundary */
        acc += x[i] * (float)(((uint32_t)q[i / per] >> (bits * (i % per))) & mask);
    for (; i + per <= b1; i += per) {  /* whole words */
        const uint32_t w = (uint32_t)q[i / per];
        float part = 0.0f;
        for (int k = 0; k < per; k++)
            part += x[i + k] * (float)((w >> (bits * k)) & mask);
        acc += part;
    }
    for (; i < b1; i++)
        acc += x[i] * (float)(((uint32_t)q[i / per] >> (bits * (i % per))) & mask);
    return acc;
}

int gptq_gemm(float *y, int64_t ldy, const float *x, const int32_t *qweight, const int16_t *zeros,
              const float *scales, const int32_t *bounds, const int32_t *gid, int64_t runs, int64_t rows,
              int64_t in, int64_t out, int64_t groups, int bits, int threads) {
    const int per = 32 / bits;
    const int64_t words = in / per;
    /* Runs of whole vectors of words take the vector path (GPTQ's groups of 32 or more columns). */
    int aligned = 1;
    for (int64_t k = 0; k <= runs; k++)
        aligned &= bounds[k] % (per * VL) == 0;
    float *xsum = malloc(sizeof(float) * (size_t)(rows * runs + 1));
    float *xt = aligned ? malloc(sizeof(float) * (size_t)(rows * in + 1)) : NULL;
    if (!xsum || (aligned && !xt)) {
        free(xsum);
        free(xt);
        return -2;
    }
    if (aligned)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t j = 0; j < words; j++)
                for (int k = 0; k < per; k++)
                    xt[r * in + k * words + j] = x[r * in + j * per + k];
    for (int64_t r = 0; r < rows; r++)
        for (int64_t k = 0; k < runs; k++) {
            float s = 0.0f;
            for (int64_t i = bounds[k]; i < bounds[k + 1]; i++)
                s += x[r * in + i];
            xsum[r * runs + k] = s;
        }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t o = 0; o < out; o++) {
        const int32_t *q = qweight + o * words;
        const int16_t *z = zeros + o * groups;
        const float *sc = scales + o * groups;
        for (int64_t r = 0; r < rows; r++) {
            float acc = 0.0f;
            for (int64_t k = 0; k < runs; k++) {
                const int32_t g = gid[k];
                const float dot = aligned ? run_dot_vec(xt + r * in, words, q, bounds[k] / per, bounds[k + 1] / per, bits)
                                          : run_dot(x + r * in, q, bounds[k], bounds[k + 1], bits);
                acc += sc[g] * (dot - (float)z[g] * xsum[r * runs + k]);
            }
            y[r * ldy + o] = acc;
        }
    }
    free(xsum);
    free(xt);
    return 0;
}
