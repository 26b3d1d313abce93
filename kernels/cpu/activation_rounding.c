/* A W8A8 checkpoint's rounding of a linear layer's input, the same bits as
 * kernels/quantized.py's ActivationQuantization.apply: each value divided by its scale (float32
 * division), clamped, rounded to the nearest FP8 e4m3 or int8 code (ties to even), multiplied
 * back by the scale and rounded to the input's dtype. A dynamic scale is its span's largest
 * magnitude over 448 (FP8) or 127.5 (int8), at least float32's smallest normal, so an all-zero
 * span stays zero.
 *
 * In the module path this is half a dozen torch ops per linear layer; a decode step's rows are
 * short enough that their dispatch costs more than the arithmetic. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "exports.h"
#include "numerics.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define FP8_E4M3_MAX 448.0f
#define INT8_SCALE_RANGE 127.5f
/* e4m3's smallest normal, 2^-6; below it the codes are multiples of 2^-9. */
#define FP8_E4M3_MIN_NORMAL 0x1p-6f
/* Adding 2^14 leaves a float32 whose last mantissa bit is worth 2^-9: the sum is the value
 * rounded (to even) to a multiple of e4m3's subnormal step. */
#define FP8_E4M3_SUBNORMAL_SHIFT 16384.0f

/* A value within [-448, 448] rounded to the nearest e4m3 value (ties to even), as c10's
 * float -> Float8_e4m3fn conversion rounds it; the sign stays, zeros included. */
static inline float round_to_e4m3(float value) {
    const float magnitude = fabsf(value);
    float rounded;
    if (magnitude < FP8_E4M3_MIN_NORMAL) {
        rounded = (magnitude + FP8_E4M3_SUBNORMAL_SHIFT) - FP8_E4M3_SUBNORMAL_SHIFT;
    } else {
        /* Three mantissa bits kept of float32's 23: the 20 below rounded off to even. */
        uint32_t bits;
        memcpy(&bits, &magnitude, sizeof bits);
        bits += 0x7FFFFu + ((bits >> 20) & 1u);
        bits &= ~0xFFFFFu;
        memcpy(&rounded, &bits, sizeof rounded);
    }
    return copysignf(rounded, value);
}

static inline float load_value(const void *x, int io_dtype, int64_t at) {
    return io_dtype == KV_F32 ? ((const float *)x)[at] : bf16_to_float(((const uint16_t *)x)[at]);
}

#if defined(__AVX512F__)
/* Sixteen values from `at` on, as float32. */
static inline __m512 load_vector(const void *x, int io_dtype, int64_t at) {
    if (io_dtype == KV_F32) return _mm512_loadu_ps((const float *)x + at);
    const __m256i bits = _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + at));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

/* A lane's `magnitude > amax || magnitude != magnitude ? magnitude : amax`. */
static inline __m512 amax_step(__m512 amax, __m512 magnitude) {
    const __mmask16 wins = _mm512_cmp_ps_mask(magnitude, amax, _CMP_GT_OQ) |
                           _mm512_cmp_ps_mask(magnitude, magnitude, _CMP_UNORD_Q);
    return _mm512_mask_mov_ps(amax, wins, magnitude);
}
#endif

/* The largest magnitude of row elements [begin, end) over `rows` rows; a NaN wins, as
 * torch's amax gives it (which NaN may differ). */
static float span_amax(const void *x, int64_t x_stride, int io_dtype, int rows, int begin,
                       int end) {
    float amax = 0.0f;
    for (int r = 0; r < rows; r++) {
        int i = begin;
#if defined(__AVX512F__)
        /* Sixteen running maxima, then the lanes in turn: a maximum is the same in any order. */
        __m512 lanes = _mm512_setzero_ps();
        for (; i + 16 <= end; i += 16)
            lanes = amax_step(lanes, _mm512_abs_ps(load_vector(x, io_dtype, r * x_stride + i)));
        float lane[16];
        _mm512_storeu_ps(lane, lanes);
        for (int l = 0; l < 16; l++)
            amax = lane[l] > amax || lane[l] != lane[l] ? lane[l] : amax;
#endif
        for (; i < end; i++) {
            const float magnitude = fabsf(load_value(x, io_dtype, r * x_stride + i));
            amax = magnitude > amax || magnitude != magnitude ? magnitude : amax;
        }
    }
    return amax;
}

/* The scale of a span whose largest magnitude is `amax`: clamped below as torch.clamp does
 * (a NaN stays NaN). */
static inline float dynamic_scale(int kind, float amax) {
    const float scale = amax / (kind == QUANT_FP8_E4M3 ? FP8_E4M3_MAX : INT8_SCALE_RANGE);
    return scale < FLT_MIN ? FLT_MIN : scale;
}

#if defined(__AVX512F__)
/* round_to_e4m3 of sixteen values within [-448, 448] (a NaN stays as it is), lane by lane the
 * same bits. */
static inline __m512 round_to_e4m3_vector(__m512 value) {
    const __m512 magnitude = _mm512_abs_ps(value);
    const __m512 shift = _mm512_set1_ps(FP8_E4M3_SUBNORMAL_SHIFT);
    const __m512 subnormal = _mm512_sub_ps(_mm512_add_ps(magnitude, shift), shift);
    __m512i bits = _mm512_castps_si512(magnitude);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 20), _mm512_set1_epi32(1));
    bits = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFFF), odd));
    bits = _mm512_andnot_si512(_mm512_set1_epi32(0xFFFFF), bits);
    const __mmask16 small =
        _mm512_cmp_ps_mask(magnitude, _mm512_set1_ps(FP8_E4M3_MIN_NORMAL), _CMP_LT_OQ);
    const __m512 rounded = _mm512_mask_mov_ps(_mm512_castsi512_ps(bits), small, subnormal);
    const __m512i sign =
        _mm512_and_si512(_mm512_castps_si512(value), _mm512_set1_epi32((int)0x80000000u));
    const __m512 signed_rounded =
        _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(rounded), sign));
    const __mmask16 nan = _mm512_cmp_ps_mask(value, value, _CMP_UNORD_Q);
    return _mm512_mask_mov_ps(signed_rounded, nan, value);
}

/* Sixteen values of round_span's loop body: the same bits lane by lane. max(low, v) and
 * min(high, v) return v where it is NaN, as the scalar clamps pass it through. */
static inline void round_vector(int kind, __m512 scale, const void *x, void *out, int io_dtype,
                                int64_t at, int64_t at_out) {
    const __m512 scaled = _mm512_div_ps(load_vector(x, io_dtype, at), scale);
    __m512 code;
    if (kind == QUANT_FP8_E4M3) {
        const __m512 clamped =
            _mm512_min_ps(_mm512_set1_ps(FP8_E4M3_MAX),
                          _mm512_max_ps(_mm512_set1_ps(-FP8_E4M3_MAX), scaled));
        code = round_to_e4m3_vector(clamped);
    } else {
        const __m512 clamped = _mm512_min_ps(_mm512_set1_ps(127.0f),
                                             _mm512_max_ps(_mm512_set1_ps(-128.0f), scaled));
        code = _mm512_roundscale_ps(clamped, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    const __m512 value = _mm512_mul_ps(code, scale);
    if (io_dtype == KV_F32) {
        _mm512_storeu_ps((float *)out + at_out, value);
        return;
    }
    /* float_to_bf16, lane by lane. */
    const __m512i bits = _mm512_castps_si512(value);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(
        _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF)), _mm512_set1_epi32(0x7F800000));
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd)), 16);
    const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
    const __m512i halves = _mm512_mask_mov_epi32(rounded, nan, quiet);
    _mm256_storeu_si256((__m256i *)((uint16_t *)out + at_out), _mm512_cvtepi32_epi16(halves));
}
#endif

/* Row elements [begin, end) of `rows` rows rounded over one scale into out (which may be x). */
static void round_span(int kind, float scale, const void *x, int64_t x_stride, void *out,
                       int64_t out_stride, int io_dtype, int rows, int begin, int end) {
    for (int r = 0; r < rows; r++) {
        int i = begin;
#if defined(__AVX512F__)
        /* A decode step's rows are a few hundred values wide: one at a time, the rounding
         * cost a W8A8 model's step more than its GEMMs' extra arithmetic. */
        const __m512 scales = _mm512_set1_ps(scale);
        for (; i + 16 <= end; i += 16)
            round_vector(kind, scales, x, out, io_dtype, r * x_stride + i, r * out_stride + i);
#endif
        for (; i < end; i++) {
            const float scaled = load_value(x, io_dtype, r * x_stride + i) / scale;
            float code;
            if (kind == QUANT_FP8_E4M3) {
                const float clamped = scaled < -FP8_E4M3_MAX  ? -FP8_E4M3_MAX
                                      : scaled > FP8_E4M3_MAX ? FP8_E4M3_MAX
                                                              : scaled;
                code = clamped != clamped ? clamped : round_to_e4m3(clamped);
            } else {
                /* One code wider below: a span's most negative value, at -127.5 scales, rounds
                 * (to even) to -128. */
                code = rintf(scaled < -128.0f ? -128.0f : scaled > 127.0f ? 127.0f : scaled);
            }
            const float value = code * scale;
            const int64_t at = r * out_stride + i;
            if (io_dtype == KV_F32)
                ((float *)out)[at] = value;
            else
                ((uint16_t *)out)[at] = float_to_bf16(value);
        }
    }
}

int pdserve_round_activations(const activation_rounding *rounding, const void *x,
                              int64_t x_stride, void *out, int64_t out_stride, int io_dtype,
                              int rows, int width) {
    const int kind = rounding->kind, strategy = rounding->strategy;
    const int known_kind = kind == QUANT_INT8 || kind == QUANT_FP8_E4M3;
    if ((strategy != ROUND_NONE && !known_kind) || (io_dtype != KV_F32 && io_dtype != KV_BF16))
        return -2;
    if (strategy == ROUND_PER_TOKEN_GROUP && rounding->group_size <= 0) return -2;
    if (rows <= 0 || width <= 0) return 0;
    const size_t element = io_dtype == KV_F32 ? sizeof(float) : sizeof(uint16_t);
    switch (strategy) {
    case ROUND_NONE:
        if (out != x)
            for (int r = 0; r < rows; r++)
                memcpy((char *)out + r * out_stride * element,
                       (const char *)x + r * x_stride * element, (size_t)width * element);
        return 0;
    case ROUND_STATIC: {
        const float scale = rounding->static_scale < FLT_MIN ? FLT_MIN : rounding->static_scale;
        round_span(kind, scale, x, x_stride, out, out_stride, io_dtype, rows, 0, width);
        return 0;
    }
    case ROUND_PER_TENSOR: {
        const float scale = dynamic_scale(kind, span_amax(x, x_stride, io_dtype, rows, 0, width));
        round_span(kind, scale, x, x_stride, out, out_stride, io_dtype, rows, 0, width);
        return 0;
    }
    case ROUND_PER_TOKEN:
    case ROUND_PER_TOKEN_GROUP: {
        const int group = strategy == ROUND_PER_TOKEN ? width : rounding->group_size;
        for (int r = 0; r < rows; r++) {
            const char *row = (const char *)x + r * x_stride * element;
            char *row_out = (char *)out + r * out_stride * element;
            for (int begin = 0; begin < width; begin += group) {
                const int end = width - begin < group ? width : begin + group;
                const float scale =
                    dynamic_scale(kind, span_amax(row, 0, io_dtype, 1, begin, end));
                round_span(kind, scale, row, 0, row_out, 0, io_dtype, 1, begin, end);
            }
        }
        return 0;
    }
    }
    return -2;
}
