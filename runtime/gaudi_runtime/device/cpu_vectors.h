/* Vector types and lane arithmetic shared by the CPU backend's C kernels (cpu_kernels.py compiles a
   kernel with the headers beside it and keys its cache on them too). GCC/Clang vector types, which
   the compiler maps onto the CPU's own: no intrinsics, and no -ffast-math. */
#ifndef GAUDI_SERVE_CPU_VECTORS_H
#define GAUDI_SERVE_CPU_VECTORS_H

#include <stdint.h>
#include <string.h>

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* Vectors of LANES floats: one AVX-512 register, else 8 lanes (one AVX2 register; two SSE or NEON
   ones). Wider vectors than the CPU has are lowered lane by lane in places, which costs more than
   it saves. REGS: how many the accumulators of one tile may take. */
#if defined(__AVX512F__)
#define LANES 16
#define REGS 16
#else
#define LANES 8
#define REGS 8
#endif

typedef float f32xL __attribute__((vector_size(LANES * 4)));
typedef int32_t i32xL __attribute__((vector_size(LANES * 4)));
typedef uint32_t u32xL __attribute__((vector_size(LANES * 4)));
typedef uint16_t u16xL __attribute__((vector_size(LANES * 2)));

ALWAYS_INLINE f32xL select_lanes(i32xL mask, f32xL a, f32xL b) {
    return (f32xL)((mask & (i32xL)a) | (~mask & (i32xL)b));
}

/* exp(x) for x <= 0 (scores minus their maximum): 2^n * e^r with |r| <= ln2 / 2 and a degree-6
   Taylor polynomial for e^r (relative error about 1e-7); lane arithmetic only, no libm call. */
ALWAYS_INLINE f32xL exp_nonpositive(f32xL x) {
    x = select_lanes(x < -87.0f, (f32xL){} - 87.0f, x);
    const i32xL n = __builtin_convertvector(x * 1.44269504f - 0.5f, i32xL);  /* truncation: round(x / ln2) */
    const f32xL nf = __builtin_convertvector(n, f32xL);
    const f32xL r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
    f32xL y = r * (1.0f / 720.0f) + 1.0f / 120.0f;
    y = y * r + 1.0f / 24.0f;
    y = y * r + 1.0f / 6.0f;
    y = y * r + 0.5f;
    y = y * r + 1.0f;
    y = y * r + 1.0f;
    return y * (f32xL)((n + 127) << 23);
}

/* LANES values of a float32 or bfloat16 row from base + offset (in elements), as floats. */
ALWAYS_INLINE f32xL load_plain(const void *base, int64_t offset, const int bf16) {
    if (bf16) {
        u16xL h;
        memcpy(&h, (const uint16_t *)base + offset, sizeof h);
        return (f32xL)(__builtin_convertvector(h, u32xL) << 16);
    }
    f32xL f;
    memcpy(&f, (const float *)base + offset, sizeof f);
    return f;
}

/* float32 -> bfloat16 bits in the low half of each lane, rounded to nearest even as torch rounds. */
ALWAYS_INLINE u32xL to_bf16(f32xL v) {
    const u32xL bits = (u32xL)v;
    const u32xL rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    const u32xL nan = (u32xL)((bits & 0x7fffffffu) > 0x7f800000u);
    return (nan & 0x7fc0u) | (~nan & rounded);
}

#endif
