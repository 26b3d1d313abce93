/* One head vector of a KV page, widened to float32 and written back: what the attention kernels
 * (paged_attention.c) read pages with and the KV store (kv_store.c) reads its input rows with.
 * The 8-bit formats' constants are kernels/interface.py's. */
#ifndef PDSERVE_KV_ROWS_H
#define PDSERVE_KV_ROWS_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "exports.h"
#include "numerics.h"

/* An int8 page's scale is a one-byte code whose float32 bits are (code << 20) + this base
 * (kernels/interface.py): decoded by integer ops alone, it is bit for bit the torch twin's. */
#define INT8_SCALE_BITS_BASE ((uint32_t)(127 - 20) << 23)
/* An FP8 page's vector is scaled to e4m3's largest finite value; an all-zero vector's scale stays
 * positive (kernels/interface.py: FP8_MAX, FP8_MIN_SCALE). */
#define FP8_MAX 448.0f
#define FP8_MIN_SCALE 1e-12f

/* The float32 value of each e4m3 byte, filled by pdserve_init (kv_store.c). */
extern float pdserve_fp8_e4m3_table[256];

/* Widen one head vector of `dim` elements to float32 (times `scale` for FP8 and int8 pages). */
static inline __attribute__((always_inline)) void load_row(const void *restrict src, int dtype,
                                                           float scale, int dim,
                                                           float *restrict dst) {
    switch (dtype) {
    case KV_F32:
        memcpy(dst, src, (size_t)dim * sizeof(float));
        break;
    case KV_BF16: {
        const uint16_t *bits = (const uint16_t *)src;
#pragma omp simd
        for (int d = 0; d < dim; d++) dst[d] = bf16_to_float(bits[d]);
        break;
    }
    case KV_F16: {
        const _Float16 *halves = (const _Float16 *)src;
#pragma omp simd
        for (int d = 0; d < dim; d++) dst[d] = (float)halves[d];
        break;
    }
    case KV_FP8_E4M3: {
        const uint8_t *bytes = (const uint8_t *)src;
        int d = 0;
#ifdef __F16C__
        /* An e4m3 byte's sign, and its exponent and mantissa moved up 7 bits, are the bits of a
         * half whose value is the byte's over 2^8, subnormals included (their exponents are 8
         * apart), which F16C widens exactly. 2^8 goes into the scale: the product is the
         * table's, rounded once. NaN (S.1111.111) becomes a half NaN. */
        const __m256 scale8 = _mm256_set1_ps(scale * 256.0f);
        const __m128i magnitude_mask = _mm_set1_epi16(0x7F), sign_mask = _mm_set1_epi16(0x80);
        const __m128i half_nan = _mm_set1_epi16(0x7E00);
        for (; d + 8 <= dim; d += 8) {
            const __m128i wide = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(bytes + d)));
            const __m128i magnitude = _mm_and_si128(wide, magnitude_mask);
            __m128i half = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(wide, sign_mask), 8),
                                        _mm_slli_epi16(magnitude, 7));
            half = _mm_blendv_epi8(half, half_nan, _mm_cmpeq_epi16(magnitude, magnitude_mask));
            _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_cvtph_ps(half), scale8));
        }
#endif
        for (; d < dim; d++) dst[d] = pdserve_fp8_e4m3_table[bytes[d]] * scale;
        break;
    }
    case KV_INT8: {
        /* Exact either way (an 8-bit integer times a 4-bit significand fits in float32), so the
         * vector body and the scalar tail give the twin's bits. */
        const int8_t *values = (const int8_t *)src;
        int d = 0;
#ifdef __AVX2__
        const __m256 scale8 = _mm256_set1_ps(scale);
        for (; d + 8 <= dim; d += 8) {
            const __m128i bytes = _mm_loadl_epi64((const __m128i *)(values + d));
            const __m256 widened = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
            _mm256_storeu_ps(dst + d, _mm256_mul_ps(widened, scale8));
        }
#endif
        for (; d < dim; d++) dst[d] = (float)values[d] * scale;
        break;
    }
    }
}

/* Write one float32 head vector as float32 or bf16 (rounded to nearest even). */
static inline void store_row(const float *restrict src, int dtype, int dim, void *restrict dst) {
    if (dtype == KV_F32) {
        memcpy(dst, src, (size_t)dim * sizeof(float));
        return;
    }
    uint16_t *bits = (uint16_t *)dst;
    for (int d = 0; d < dim; d++) bits[d] = float_to_bf16(src[d]);
}

static inline size_t element_size(int dtype) {
    return dtype == KV_F32 ? 4 : dtype == KV_FP8_E4M3 || dtype == KV_INT8 ? 1 : 2;
}

#endif
