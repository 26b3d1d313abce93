/* The KV store on the CPU: a step's new keys and values written into their pages, quantised on
 * the way for FP8 and int8 pages, bit for bit as kernels/kv_formats.py defines the formats.
 * Pages are laid out as kernels/interface.py's KVCacheView: strided views of the page-major pool.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "exports.h"
#include "kv_rows.h"
#include "numerics.h"

float pdserve_fp8_e4m3_table[256];

/* Called once when the library is loaded, before any kernel reads an FP8 page. */
void pdserve_init(void) {
    for (int byte = 0; byte < 256; byte++) {
        int sign = byte >> 7, exponent = (byte >> 3) & 0xF, mantissa = byte & 0x7;
        float value;
        if (exponent == 0xF && mantissa == 0x7) {
            value = NAN; /* e4m3fn has no infinities; S.1111.111 is NaN */
        } else if (exponent == 0) {
            value = ldexpf((float)mantissa, -9); /* subnormal: m/8 * 2^-6 */
        } else {
            value = ldexpf(1.0f + mantissa / 8.0f, exponent - 7);
        }
        pdserve_fp8_e4m3_table[byte] = sign ? -value : value;
    }
}

/* Write token n's key and value rows into slot slots[n] of a 16- or 32-bit cache whose dtype
 * is the rows' own (FP8 and int8 caches quantise on the way: pdserve_store_kv_fp8 / _int8).
 * key/value: [N, num_kv_heads, head_dim], rows key_stride / value_stride elements apart, unit
 * stride within a row; caches strided as kernels/interface.py's KVCacheView. */
void pdserve_store_kv(const void *key, int64_t key_stride, const void *value,
                      int64_t value_stride, void *key_cache, void *value_cache,
                      int64_t page_stride, int64_t token_stride, int64_t head_stride,
                      int element_bytes, int page_size, const int64_t *slots, int num_tokens,
                      int num_kv_heads, int head_dim) {
    const size_t row_bytes = (size_t)head_dim * element_bytes;
    for (int n = 0; n < num_tokens; n++) {
        const int64_t page = slots[n] / page_size, offset = slots[n] % page_size;
        for (int h = 0; h < num_kv_heads; h++) {
            const int64_t at = (page * page_stride + offset * token_stride + h * head_stride) *
                               element_bytes;
            memcpy((char *)key_cache + at,
                   (const char *)key + (n * key_stride + h * head_dim) * element_bytes, row_bytes);
            memcpy((char *)value_cache + at,
                   (const char *)value + (n * value_stride + h * head_dim) * element_bytes,
                   row_bytes);
        }
    }
}

/* The code of the smallest one-byte scale s with 127 * s >= amax: positive floats order like
 * their bits, so it is the ceiling of (bits(amax / 127) - base) over 2^20, as in the twin. */
static inline uint8_t int8_scale_code(float amax) {
    const float target = amax / 127.0f;
    uint32_t bits;
    memcpy(&bits, &target, sizeof bits);
    const int64_t above = (int64_t)bits - (int64_t)INT8_SCALE_BITS_BASE + ((1 << 20) - 1);
    if (above < 0) return 0;
    return above >> 20 > 255 ? 255 : (uint8_t)(above >> 20);
}

/* Quantise one head vector (float32) into int8 page bytes and its scale code, exactly as
 * kernels/kv_formats.py's quantize_int8: x / s (an IEEE division), plus one half, floored,
 * clamped. */
static void quantize_int8_row(const float *restrict x, int dim, void *restrict out_bytes,
                              void *restrict scale_out) {
    int8_t *out = out_bytes;
    float amax = 0.0f;
    for (int d = 0; d < dim; d++) amax = fmaxf(amax, fabsf(x[d]));
    const uint8_t code = int8_scale_code(amax);
    const uint32_t scale_bits = ((uint32_t)code << 20) + INT8_SCALE_BITS_BASE;
    float scale;
    memcpy(&scale, &scale_bits, sizeof scale);
    for (int d = 0; d < dim; d++) {
        const float step = floorf(x[d] / scale + 0.5f);
        out[d] = (int8_t)(step > 127.0f ? 127.0f : step < -127.0f ? -127.0f : step);
    }
    *(uint8_t *)scale_out = code;
}

/* float32 -> e4m3fn byte, rounded to nearest even, as torch converts (c10's
 * fp8e4m3fn_from_fp32_value): 480 and beyond (never reached after the store's clamp) is NaN. */
static inline uint8_t fp8_e4m3_from_float(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    const uint32_t sign = bits & 0x80000000u;
    bits ^= sign;
    uint8_t byte;
    if (bits >= 1087u << 20) {
        byte = 0x7f;
    } else if (bits < 121u << 23) {
        /* Below e4m3's smallest normal, 2^-6: adding 2^14 leaves the subnormal's three bits at
         * the bottom of the float32 mantissa, rounded to nearest even by the addition itself. */
        const uint32_t magic_bits = 141u << 23;
        float magic, sum;
        memcpy(&magic, &magic_bits, sizeof magic);
        memcpy(&sum, &bits, sizeof sum);
        sum += magic;
        memcpy(&bits, &sum, sizeof bits);
        byte = (uint8_t)(bits - magic_bits);
    } else {
        const uint32_t mantissa_odd = (bits >> 20) & 1;
        bits += ((uint32_t)(7 - 127) << 23) + 0x7FFFFu + mantissa_odd;
        byte = (uint8_t)(bits >> 20);
    }
    return byte | (uint8_t)(sign >> 24);
}

/* Quantise one head vector (float32) into e4m3 page bytes and its float32 scale, exactly as
 * kernels/kv_formats.py's quantize_fp8: s = max(amax / 448, 1e-12), x / s clamped to +-448,
 * then rounded. */
static void quantize_fp8_row(const float *restrict x, int dim, void *restrict out_bytes,
                             void *restrict scale_out) {
    uint8_t *out = out_bytes;
    float amax = 0.0f;
    for (int d = 0; d < dim; d++) amax = fmaxf(amax, fabsf(x[d]));
    float scale = amax / FP8_MAX;
    if (scale < FP8_MIN_SCALE) scale = FP8_MIN_SCALE;
    for (int d = 0; d < dim; d++) {
        const float step = x[d] / scale;
        out[d] = fp8_e4m3_from_float(step > FP8_MAX ? FP8_MAX : step < -FP8_MAX ? -FP8_MAX : step);
    }
    memcpy(scale_out, &scale, sizeof scale);
}

typedef void (*quantize_row_fn)(const float *restrict x, int dim, void *restrict out_bytes,
                                void *restrict scale_out);

/* Write token n's key and value rows, quantised by `quantize`, into slot slots[n] of a
 * one-byte cache and their scales (`scale_bytes` each) beside them. key/value:
 * [N, num_kv_heads, head_dim] of `io_dtype` (float32, bf16 or fp16), rows key_stride /
 * value_stride elements apart; caches and scales strided as KVCacheView, in elements. Returns
 * 0, or -1 for a head_dim beyond the row buffer. */
static int store_kv_quantized(quantize_row_fn quantize, size_t scale_bytes, const void *key,
                              int64_t key_stride, const void *value, int64_t value_stride,
                              int io_dtype, uint8_t *key_cache, uint8_t *value_cache,
                              int64_t page_stride, int64_t token_stride, int64_t head_stride,
                              char *key_scales, char *value_scales, int64_t scale_page_stride,
                              int64_t scale_token_stride, int64_t scale_head_stride,
                              int page_size, const int64_t *slots, int num_tokens,
                              int num_kv_heads, int head_dim) {
    enum { MAX_DIM = 1024 };
    if (head_dim > MAX_DIM) return -1;
    const size_t io_size = element_size(io_dtype);
    float row[MAX_DIM];
    for (int n = 0; n < num_tokens; n++) {
        const int64_t page = slots[n] / page_size, offset = slots[n] % page_size;
        for (int h = 0; h < num_kv_heads; h++) {
            const int64_t at = page * page_stride + offset * token_stride + h * head_stride;
            const int64_t scale_at = (page * scale_page_stride + offset * scale_token_stride +
                                      h * scale_head_stride) *
                                     (int64_t)scale_bytes;
            load_row((const char *)key + (n * key_stride + h * head_dim) * io_size, io_dtype,
                     1.0f, head_dim, row);
            quantize(row, head_dim, key_cache + at, key_scales + scale_at);
            load_row((const char *)value + (n * value_stride + h * head_dim) * io_size, io_dtype,
                     1.0f, head_dim, row);
            quantize(row, head_dim, value_cache + at, value_scales + scale_at);
        }
    }
    return 0;
}

/* store_kv_quantized into an int8 cache, one-byte scale codes beside it. */
int pdserve_store_kv_int8(const void *key, int64_t key_stride, const void *value,
                          int64_t value_stride, int io_dtype, int8_t *key_cache,
                          int8_t *value_cache, int64_t page_stride, int64_t token_stride,
                          int64_t head_stride, uint8_t *key_codes, uint8_t *value_codes,
                          int64_t scale_page_stride, int64_t scale_token_stride,
                          int64_t scale_head_stride, int page_size, const int64_t *slots,
                          int num_tokens, int num_kv_heads, int head_dim) {
    return store_kv_quantized(quantize_int8_row, 1, key, key_stride, value, value_stride,
                              io_dtype, (uint8_t *)key_cache, (uint8_t *)value_cache,
                              page_stride, token_stride, head_stride, (char *)key_codes,
                              (char *)value_codes, scale_page_stride, scale_token_stride,
                              scale_head_stride, page_size, slots, num_tokens, num_kv_heads,
                              head_dim);
}

/* store_kv_quantized into an e4m3 cache, float32 scales beside it. */
int pdserve_store_kv_fp8(const void *key, int64_t key_stride, const void *value,
                         int64_t value_stride, int io_dtype, uint8_t *key_cache,
                         uint8_t *value_cache, int64_t page_stride, int64_t token_stride,
                         int64_t head_stride, float *key_scales, float *value_scales,
                         int64_t scale_page_stride, int64_t scale_token_stride,
                         int64_t scale_head_stride, int page_size, const int64_t *slots,
                         int num_tokens, int num_kv_heads, int head_dim) {
    return store_kv_quantized(quantize_fp8_row, sizeof(float), key, key_stride, value,
                              value_stride, io_dtype, key_cache, value_cache, page_stride,
                              token_stride, head_stride, (char *)key_scales, (char *)value_scales,
                              scale_page_stride, scale_token_stride, scale_head_stride, page_size,
                              slots, num_tokens, num_kv_heads, head_dim);
}
