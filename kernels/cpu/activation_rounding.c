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

/* The largest magnitude of row elements [begin, end) over `rows` rows; a NaN wins, as
 * torch's amax gives it. */
static float span_amax(const void *x, int64_t x_stride, int io_dtype, int rows, int begin,
                       int end) {
    float amax = 0.0f;
    for (int r = 0; r < rows; r++)
        for (int i = begin; i < end; i++) {
            const float magnitude = fabsf(load_value(x, io_dtype, r * x_stride + i));
            amax = magnitude > amax || magnitude != magnitude ? magnitude : amax;
        }
    return amax;
}

/* The scale of a span whose largest magnitude is `amax`: clamped below as torch.clamp does
 * (a NaN stays NaN). */
static inline float dynamic_scale(int kind, float amax) {
    const float scale = amax / (kind == QUANT_FP8_E4M3 ? FP8_E4M3_MAX : INT8_SCALE_RANGE);
    return scale < FLT_MIN ? FLT_MIN : scale;
}

/* Row elements [begin, end) of `rows` rows rounded over one scale into out (which may be x). */
static void round_span(int kind, float scale, const void *x, int64_t x_stride, void *out,
                       int64_t out_stride, int io_dtype, int rows, int begin, int end) {
    for (int r = 0; r < rows; r++)
        for (int i = begin; i < end; i++) {
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
