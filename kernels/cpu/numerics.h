/* Number conversions and exp shared by the CPU kernels. */
#ifndef PDSERVE_NUMERICS_H
#define PDSERVE_NUMERICS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_to_float(uint16_t bits) {
    uint32_t widened = (uint32_t)bits << 16;
    float value;
    memcpy(&value, &widened, sizeof value);
    return value;
}

/* Round to nearest even, as torch's float32 -> bf16 conversion does; NaN stays NaN. */
static inline uint16_t float_to_bf16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* A row's sum of x[0..n) in a fixed order: eight running lanes (one vector add a step), then
 * the lanes in turn, then the tail. */
static inline float group_sum(const float *x, int n) {
    float lanes[8] = {0};
    int k = 0;
    for (; k + 8 <= n; k += 8)
        for (int l = 0; l < 8; l++) lanes[l] += x[k + l];
    float sum = 0.0f;
    for (int l = 0; l < 8; l++) sum += lanes[l];
    for (; k < n; k++) sum += x[k];
    return sum;
}

/* A float32 value rounded to bf16 and back, as a bf16 tensor op's output is. */
static inline float round_bf16(float value) { return bf16_to_float(float_to_bf16(value)); }

/* Weight (n, k) of a dequantized [N, K] weight (or, transposed, [K, N]), float32 or (not f32)
 * rounded once to bf16. */
static inline void put_weight(void *out, int f32, int transposed, int N, int K, int n, int k,
                              float w) {
    const int64_t at = transposed ? (int64_t)k * N + n : (int64_t)n * K + k;
    if (f32)
        ((float *)out)[at] = w;
    else
        ((uint16_t *)out)[at] = float_to_bf16(w);
}

#ifdef __AVX512F__
#include <immintrin.h>

/* 16 bf16 values widened to float32. */
static inline __m512 bf16x16_to_float(const uint16_t *bits) {
    const __m256i loaded = _mm256_loadu_si256((const __m256i *)bits);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(loaded), 16));
}

/* 16 float32 values rounded to bf16 in integers, as float_to_bf16 rounds each (to nearest
 * even; NaN stays NaN). */
static inline __m256i float_to_bf16x16_integers(__m512 value) {
    const __m512i bits = _mm512_castps_si512(value);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), odd), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(value, value, _CMP_UNORD_Q);
    rounded = _mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32(bits, 16),
                                   _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(rounded);
}

/* 16 float32 values rounded to bf16 exactly as float_to_bf16 rounds each. With AVX512_BF16,
 * vcvtneps2bf16 is one instruction for what takes gcc's vectorised float_to_bf16 a dozen, and
 * rounds to nearest even as it does, NaN included, but reads denormal inputs as zero: lanes
 * holding one (never seen in a model's activations, so the branch costs one test) are rounded
 * in integers instead. */
static inline __m256i float_to_bf16x16(__m512 value) {
#ifdef __AVX512BF16__
    __m256i rounded = (__m256i)_mm512_cvtneps_pbh(value);
    const __mmask16 denormal = _mm512_fpclass_ps_mask(value, 0x20); /* class: denormal */
    if (denormal)
        rounded =
            _mm256_mask_blend_epi16(denormal, rounded, float_to_bf16x16_integers(value));
    return rounded;
#else
    return float_to_bf16x16_integers(value);
#endif
}

/* A vector of float32 values rounded to bf16 and back (round_bf16 of each). */
static inline __m512 round_bf16x16(__m512 value) {
    const __m256i rounded = float_to_bf16x16(value);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(rounded), 16));
}

/* The first `count` of 16 lanes (all 16 past that). */
static inline __mmask16 first_lanes(int count) {
    return count >= 16 ? 0xFFFF : count > 0 ? (__mmask16)((1u << count) - 1) : 0;
}

/* One output row: `width` float32 sums times `scale` (exact where it is a power of two), plus
 * the bias, in float32 (y_f32) or rounded once to bf16. */
static inline void store_scaled_row(const float *sums, float scale, const float *bias, int width,
                                    int y_f32, void *y) {
    for (int j = 0; j < width; j += 16) {
        const __mmask16 mask = first_lanes(width - j);
        __m512 value = _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, sums + j), _mm512_set1_ps(scale));
        if (bias) value = _mm512_add_ps(value, _mm512_maskz_loadu_ps(mask, bias + j));
        if (y_f32)
            _mm512_mask_storeu_ps((float *)y + j, mask, value);
        else
            _mm256_mask_storeu_epi16((uint16_t *)y + j, mask, float_to_bf16x16(value));
    }
}
#endif

/* exp(x) within 2 ulp of expf for -87 <= x <= 88 (clamped outside, up to ln(FLT_MAX); past it
 * infinite, as expf is, so that silu(x) = x / (1 + exp(-x)) is 0 for very negative x), written so
 * that loops over it vectorize without -ffast-math (which would also switch the whole process to
 * flush-to-zero): 2^(x log2 e) split into an integer power, set in the exponent bits, and a
 * fraction in [-0.5, 0.5] whose 2^f is a degree-6 polynomial. */
static inline float exp_approx(float x) {
    const int overflows = x > 88.72283935546875f;
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float scaled = x * 1.44269504088896341f;
    const float whole = (scaled + 12582912.0f) - 12582912.0f; /* round to nearest: 1.5 * 2^23 */
    const float f = scaled - whole;
    float p = 1.535336188319500e-4f;
    p = p * f + 1.339887440266574e-3f;
    p = p * f + 9.618437357674640e-3f;
    p = p * f + 5.550332471162809e-2f;
    p = p * f + 2.402264791363012e-1f;
    p = p * f + 6.931472028550421e-1f;
    p = p * f + 1.0f;
    const int32_t exponent_bits = ((int32_t)whole + 127) << 23;
    float power;
    memcpy(&power, &exponent_bits, sizeof power);
    return overflows ? INFINITY : p * power;
}

#ifdef __AVX512BF16__
/* exp(x) in 16 lanes: exp_approx's arithmetic (the same product, rounding to an integer power
 * and polynomial), with the power of 2 applied by vscalefps instead of set in exponent bits.
 * That needs no clamps: past ln(FLT_MAX) it gives infinity, below about -87 exp's own tiny values
 * (denormals, then 0) where exp_approx holds exp(-87). Within the clamps the two are the same
 * bits; between 88 and ln(FLT_MAX), where exp_approx holds exp(88), this is the closer. */
static inline __m512 exp_x16(__m512 x) {
    const __m512 scaled = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const __m512 whole =
        _mm512_roundscale_ps(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(scaled, whole);
    __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, whole);
}
#endif

#endif
