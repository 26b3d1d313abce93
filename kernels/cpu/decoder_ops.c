/* The elementwise parts of a decoder layer for bf16 tensors, one pass each: RMSNorm, SiLU-and-
 * multiply, rotary embedding. In eager torch each is half a dozen ops, each a pass over memory
 * and a dispatch; in a decode step those dispatches cost more than the arithmetic.
 *
 * Every result is rounded to bf16 at the points where the torch code (common/model/llama.py)
 * rounds, so the two differ only where float32 sums are ordered differently (RMSNorm's mean)
 * or where exp differs in its last bit (SiLU).
 */
#include <math.h>
#include <stdint.h>

#include "exports.h"
#include "numerics.h"

/* yr = weight * bf16(xr * rsqrt(mean(xr^2) + eps)) over one row; xr, weight, yr bf16. Both
 * entry points below run this one body, so a row's sum of squares is summed in one order. */
static inline void rms_norm_row(const uint16_t *xr, const uint16_t *weight, float eps,
                                uint16_t *yr, int hidden) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int i = 0; i < hidden; i++) {
        const float v = bf16_to_float(xr[i]);
        sum += v * v;
    }
    const float inverse_rms = 1.0f / sqrtf(sum / (float)hidden + eps);
    int i0 = 0;
#ifdef __AVX512BF16__
    const __m512 scale = _mm512_set1_ps(inverse_rms);
    for (; i0 + 16 <= hidden; i0 += 16) {
        const __m512 normed = round_bf16x16(_mm512_mul_ps(bf16x16_to_float(xr + i0), scale));
        _mm256_storeu_si256((__m256i *)(yr + i0),
                            float_to_bf16x16(_mm512_mul_ps(bf16x16_to_float(weight + i0), normed)));
    }
#endif
#pragma omp simd
    for (int i = i0; i < hidden; i++) {
        const float normed = round_bf16(bf16_to_float(xr[i]) * inverse_rms);
        yr[i] = float_to_bf16(bf16_to_float(weight[i]) * normed);
    }
}

/* out = weight * bf16(x * rsqrt(mean(x^2) + eps)), per row; x, weight, out bf16. */
void pdserve_rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *weight,
                           float eps, uint16_t *out, int64_t out_stride, int rows, int hidden) {
    for (int r = 0; r < rows; r++)
        rms_norm_row(x + r * x_stride, weight, eps, out + r * out_stride, hidden);
}

/* A residual add and the norm after it in one pass over the rows: sum = bf16(x + delta), as a
 * bf16 tensor add rounds, then out = the norm of sum (pdserve_rms_norm_bf16's, bit for bit).
 * In eager torch the add is a pass of its own over memory and the norm reads its output back. */
void pdserve_add_rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *delta,
                               int64_t delta_stride, const uint16_t *weight, float eps,
                               uint16_t *sum, int64_t sum_stride, uint16_t *out,
                               int64_t out_stride, int rows, int hidden) {
    for (int r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * x_stride, *dr = delta + r * delta_stride;
        uint16_t *sr = sum + r * sum_stride;
        int i0 = 0;
#ifdef __AVX512BF16__
        for (; i0 + 16 <= hidden; i0 += 16)
            _mm256_storeu_si256(
                (__m256i *)(sr + i0),
                float_to_bf16x16(_mm512_add_ps(bf16x16_to_float(xr + i0), bf16x16_to_float(dr + i0))));
#endif
#pragma omp simd
        for (int i = i0; i < hidden; i++)
            sr[i] = float_to_bf16(bf16_to_float(xr[i]) + bf16_to_float(dr[i]));
        rms_norm_row(sr, weight, eps, out + r * out_stride, hidden);
    }
}

#ifdef __AVX512BF16__
/* -value, the sign bit flipped (0 - value would turn -0 into +0, which rounds the sum of
 * two zeros differently from the scalar loop's negation). */
static inline __m512 negated(__m512 value) {
    return _mm512_castsi512_ps(
        _mm512_xor_si512(_mm512_castps_si512(value), _mm512_set1_epi32((int)0x80000000)));
}
#endif

/* Elements of a row that SiLU-and-multiply works on at a time (a stack buffer of denominators). */
#define SILU_CHUNK 256

/* out[i] = bf16(silu(gate[i])) * up[i] for i in [first, width): the scalar path, and the tail
 * of a row wider than the vector loop takes. The denominators 1 + exp(-g) are computed in a loop
 * of their own: fused into the division's loop, the compiler splits the loop body at
 * exp_approx's clamps and gives each path a division of its own, five times the divisions (the
 * slowest vector instruction) the loop needs, and the loop ran ten times slower. */
static void silu_mul_row(const uint16_t *gate, const uint16_t *up, uint16_t *yr, int first,
                         int width) {
    float denominators[SILU_CHUNK];
    for (int i0 = first; i0 < width; i0 += SILU_CHUNK) {
        const int n = width - i0 < SILU_CHUNK ? width - i0 : SILU_CHUNK;
#pragma omp simd
        for (int i = 0; i < n; i++)
            denominators[i] = 1.0f + exp_approx(-bf16_to_float(gate[i0 + i]));
#pragma omp simd
        for (int i = 0; i < n; i++) {
            const float silu = round_bf16(bf16_to_float(gate[i0 + i]) / denominators[i]);
            yr[i0 + i] = float_to_bf16(silu * bf16_to_float(up[i0 + i]));
        }
    }
}

/* out[r, i] = bf16(silu(gate[r, i])) * up[r, i], gate and up the two halves of gate_up's row.
 * With AVX-512, 16 lanes in one pass: exp_x16 needs no clamps (the scalar exp's clamps are
 * what made the scalar path split in two), so exp, division and both roundings stay in
 * registers; 1.3x the speed of the two-pass loop on the AMX Xeon, where prefill's rows felt it.
 * The two paths differ only at gates whose exp(-g) lies past exp_approx's clamp at 88 (of bf16
 * gates, -88.5 alone), where the vector lanes' exp is the closer. */
void pdserve_silu_mul_bf16(const uint16_t *gate_up, int64_t gate_up_stride, uint16_t *out,
                           int64_t out_stride, int rows, int width) {
    for (int r = 0; r < rows; r++) {
        const uint16_t *gate = gate_up + r * gate_up_stride;
        const uint16_t *up = gate + width;
        uint16_t *yr = out + r * out_stride;
        int i = 0;
#ifdef __AVX512BF16__
        for (; i + 16 <= width; i += 16) {
            const __m512 g = bf16x16_to_float(gate + i);
            const __m512 denominator = _mm512_add_ps(_mm512_set1_ps(1.0f), exp_x16(negated(g)));
            const __m512 silu = round_bf16x16(_mm512_div_ps(g, denominator));
            _mm256_storeu_si256((__m256i *)(yr + i),
                                float_to_bf16x16(_mm512_mul_ps(silu, bf16x16_to_float(up + i))));
        }
#endif
        silu_mul_row(gate, up, yr, i, width);
    }
}

/* In place: x[r, h] = bf16(x * cos[r]) + bf16(rotate_half(x) * sin[r]) (rounded again), for
 * `heads` head vectors of each row. cos, sin: [rows, head_dim] bf16 rows `trig_stride` apart. */
void pdserve_rope_bf16(uint16_t *x, int64_t row_stride, int64_t head_stride, int rows, int heads,
                       int head_dim, const uint16_t *cos, const uint16_t *sin,
                       int64_t trig_stride) {
    const int half = head_dim / 2;
    for (int r = 0; r < rows; r++) {
        const uint16_t *c = cos + r * trig_stride;
        const uint16_t *s = sin + r * trig_stride;
        for (int h = 0; h < heads; h++) {
            uint16_t *v = x + r * row_stride + h * head_stride;
            float first[256], second[256];
            if (half > 256) return; /* head sizes past 512 are refused by the caller */
            int i0 = 0;
#ifdef __AVX512BF16__
            /* Straight from the row, no stack copy; stores land only after both halves' loads. */
            for (; i0 + 16 <= half; i0 += 16) {
                const __m512 low_in = bf16x16_to_float(v + i0);
                const __m512 high_in = bf16x16_to_float(v + half + i0);
                const __m512 low = _mm512_add_ps(
                    round_bf16x16(_mm512_mul_ps(low_in, bf16x16_to_float(c + i0))),
                    round_bf16x16(_mm512_mul_ps(negated(high_in), bf16x16_to_float(s + i0))));
                const __m512 high = _mm512_add_ps(
                    round_bf16x16(_mm512_mul_ps(high_in, bf16x16_to_float(c + half + i0))),
                    round_bf16x16(_mm512_mul_ps(low_in, bf16x16_to_float(s + half + i0))));
                _mm256_storeu_si256((__m256i *)(v + i0), float_to_bf16x16(low));
                _mm256_storeu_si256((__m256i *)(v + half + i0), float_to_bf16x16(high));
            }
#endif
            for (int i = i0; i < half; i++) {
                first[i] = bf16_to_float(v[i]);
                second[i] = bf16_to_float(v[i + half]);
            }
#pragma omp simd
            for (int i = i0; i < half; i++) {
                const float low = round_bf16(first[i] * bf16_to_float(c[i])) +
                                  round_bf16(-second[i] * bf16_to_float(s[i]));
                const float high = round_bf16(second[i] * bf16_to_float(c[i + half])) +
                                   round_bf16(first[i] * bf16_to_float(s[i + half]));
                v[i] = float_to_bf16(low);
                v[i + half] = float_to_bf16(high);
            }
        }
    }
}
