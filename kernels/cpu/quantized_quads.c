/* y = x W^T (+ bias) over integer codes (int8, unsigned 4-bit) summed in integers: the
 * processor's byte dot products (AVX512_VNNI's vpdpbusd, 64 products an instruction where a
 * float32 FMA does 16), where quantized_tiles.c widens every code to float32 first.
 *
 * The input rows become integers: each row is scaled by a power of two, 2^s, that brings its
 * largest magnitude under 2^ROW_BITS, and rounded to the nearest integer X, which is cut into
 * byte "limbs", X = u0 + 2^8 u1 (+ 2^16 u2): every limb but the top one unsigned, the top one
 * signed. A limb times a code is a product of bytes, summed exactly in int32: a block's sums
 * depend on no order, so however the rows are blocked, a row's outputs are the same bits.
 *   - float32 inputs: three limbs, X under 2^22 (ROW_BITS_F32): a value rounds at 2^-22 of the
 *     row's largest, the accuracy of a float32 sum.
 *   - bf16 inputs: two limbs, X under 2^14 (ROW_BITS_BF16): exact for every value within 2^6 of
 *     the row's largest (a bf16 value has eight significant bits), the rest rounded at 2^-14 of
 *     it, an error some 2^-6 of the bf16 rounding each output then takes.
 *
 * Per block of at most BLOCK_K k-rows of a group the limbs' sums T_i are combined into P, the
 * block's sum of code times X: in int32 for two limbs (P = T0 + 2^8 T1, then converted), in
 * float32 for three (each T_i at most 2^24, converted exactly, P = fma(T2, 2^16, fma(T1, 2^8,
 * T0))). Then partial = P (+ partial, for a group of several blocks), and where the group ends
 * acc = fma(scale, partial, acc), acc = fma(-offset, xsum, acc) (xsum the row's float32 sum over
 * the group, times 2^s), all in units of X; the output is acc * 2^-s (+ bias), rounded once to
 * the output dtype. A row that holds an infinity or a NaN gives NaNs.
 *
 * The weight (kernels/cpu/quantized_linear.py's pack_quads) is in tiles of TILE output columns,
 * each one byte stream of its groups in order, a group being
 *     scales    [TILE] float32,
 *     offsets   [TILE] float32, only where the weight has offsets,
 *     codes in quads of k-rows (a group's rows padded with zero codes to a multiple of four):
 *         int8: 128 bytes a quad, byte 64 h + 4 j + i holding column 16 h + j's code of k-row
 *               4 q + i: a 64-byte load is 16 lanes of four k-rows, what vpdpbusd reads;
 *         uint4: 64 bytes a quad, byte 4 j + i holding column j's code of k-row 4 q + i in its
 *               low nibble and column 16 + j's in its high one.
 * Every group but the last is a multiple of four k-rows long, so the quads of all groups are
 * the input padded to a multiple of four.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "exports.h"
#include "numerics.h"
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define HAVE_QUADS 1
#endif

#define TILE 32
#define QUAD 4
/* Limbs of a float32 row and of a bf16 one, and the magnitude their integers stay under:
 * the top limb, X >> 16 or X >> 8, is then within [-64, 64], a signed byte. */
#define LIMBS_F32 3
#define LIMBS_BF16 2
#define ROW_BITS_F32 22
#define ROW_BITS_BF16 14
/* k-rows summed in int32 before a conversion: a limb times a code is at most 2^15 in
 * magnitude, so 512 of them stay within 2^24 (float32 holds each T_i exactly), and
 * T0 + 2^8 T1 of two limbs within 2^31. */
#define BLOCK_K 512
/* Rows run over one tile at a time, past two rows: that many rows' limb rows keep 18 (three
 * limbs) or 16 (two) sums. */
#define BLOCK_ROWS_F32 3
#define BLOCK_ROWS_BF16 4
#define MAX_BLOCK_ROWS 4
/* Rows a call runs at a time (see pdserve_quantized_quads_linear). */
#define ROW_CHUNK 256
/* Bytes of the stream fetched ahead of use into L1 and into L2, as quantized_tiles.c. */
#define PREFETCH_NEAR 4096
#define PREFETCH_FAR 32768

static inline int quad_bytes(int kind) { return kind == QUANT_INT8_QUADS ? 128 : 64; }

static inline int padded_rows(int rows) { return (rows + QUAD - 1) / QUAD * QUAD; }

/* The blocks of k-rows a group of `rows` is summed in. */
static inline int group_blocks(int rows) { return (rows + BLOCK_K - 1) / BLOCK_K; }

/* Bytes of a group's header: scales and offsets. */
static inline int64_t header_bytes(int has_offsets) {
    return (int64_t)TILE * sizeof(float) * (1 + has_offsets);
}

static inline int64_t group_bytes(int kind, int has_offsets, int rows) {
    return header_bytes(has_offsets) + (int64_t)padded_rows(rows) / QUAD * quad_bytes(kind);
}

static inline int64_t tile_bytes(int kind, int has_offsets, int group, int K) {
    const int groups = (K + group - 1) / group;
    return (groups - 1) * group_bytes(kind, has_offsets, group) +
           group_bytes(kind, has_offsets, K - (groups - 1) * group);
}

static int valid_shape(int kind, int group, int M, int N, int K) {
    if (kind != QUANT_INT8_QUADS && kind != QUANT_UINT4_QUADS) return 0;
    /* Groups but the last start on a quad. */
    if (group <= 0 || (group < K && group % QUAD)) return 0;
    return M >= 0 && N > 0 && K > 0;
}

int pdserve_quantized_quads_available(void) {
#ifdef HAVE_QUADS
    return 1;
#else
    return 0;
#endif
}

int pdserve_quantized_quads_tile_bytes(int kind, int group_size, int has_offsets, int K) {
    if (!valid_shape(kind, group_size, 0, 1, K)) return -1;
    return (int)tile_bytes(kind, has_offsets != 0, group_size, K);
}

/* Column j's code of k-row k of a group's quads, as the integer its scale multiplies. */
static inline int quad_code(int kind, const uint8_t *codes, int k, int j) {
    const int q = k / QUAD, i = k % QUAD;
    if (kind == QUANT_INT8_QUADS)
        return (int8_t)codes[(int64_t)q * 128 + (j / 16) * 64 + (j % 16) * 4 + i];
    const uint8_t byte = codes[(int64_t)q * 64 + (j % 16) * 4 + i];
    return j < 16 ? byte & 15 : byte >> 4;
}

/* out: the [N, K] weight (or, transposed, [K, N]) in float32 or bf16 (out_dtype), each weight
 * scale * code - offset in float32, rounded once, as quantized_tiles.c dequantizes. */
int pdserve_quantized_quads_dequantize(const uint8_t *packed, int kind, int group_size,
                                       int has_offsets, void *out, int out_dtype, int transposed,
                                       int N, int K, int num_threads) {
    if (!valid_shape(kind, group_size, 0, N, K) || (out_dtype != KV_F32 && out_dtype != KV_BF16))
        return -2;
    const int groups = (K + group_size - 1) / group_size;
    const int64_t stride = tile_bytes(kind, has_offsets != 0, group_size, K);
    const int num_tiles = (N + TILE - 1) / TILE;
#pragma omp parallel for num_threads(num_threads) if (num_threads > 1) schedule(static)
    for (int t = 0; t < num_tiles; t++) {
        const int n0 = t * TILE;
        const int width = N - n0 < TILE ? N - n0 : TILE;
        const uint8_t *at = packed + t * stride;
        for (int g = 0; g < groups; g++) {
            const int k0 = g * group_size;
            const int rows = K - k0 < group_size ? K - k0 : group_size;
            const float *scales = (const float *)at;
            const float *offsets = has_offsets ? scales + TILE : NULL;
            const uint8_t *codes = at + header_bytes(has_offsets != 0);
            for (int k = 0; k < rows; k++)
                for (int j = 0; j < width; j++)
                    put_weight(out, out_dtype == KV_F32, transposed, N, K, n0 + j, k0 + k,
                               scales[j] * (float)quad_code(kind, codes, k, j) -
                                   (offsets ? offsets[j] : 0.0f));
            at = codes + (int64_t)padded_rows(rows) / QUAD * quad_bytes(kind);
        }
    }
    return 0;
}

#ifdef HAVE_QUADS
/* acc += the dot products of `bytes` (unsigned) and `signed_bytes` in fours, as vpdpbusd. gcc
 * copies an accumulator in and out of the intrinsic's register twice an instruction, enough
 * moves to make the loops wait on decoding; the instruction written out accumulates in place. */
static inline __attribute__((always_inline)) __m512i dot_bytes(__m512i acc, __m512i bytes,
                                                                __m512i signed_bytes) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(bytes), "v"(signed_bytes));
    return acc;
}

/* The rows of the input as the kernel reads them: limb rows, 2^-s, per block the sum of the
 * top limb (for int8 codes, see quad_block) and (for offsets) per group the row's sum times
 * 2^s. */
typedef struct {
    uint8_t *limbs;    /* [M][limbs][K4] */
    float *unscale;    /* [M]: 2^-s, or NaN where the row is not finite */
    int32_t *top_sums; /* [M][blocks] */
    float *xsum;       /* [M][groups] */
    int limbs_per_row;
    int K4;
    int blocks;
    int groups;
} limb_rows;

/* 16 inputs from `at` (io dtype; the first `mask` lanes) as float32. */
static inline __m512 load16(const void *at, int io_f32, __mmask16 mask) {
    if (io_f32) return _mm512_maskz_loadu_ps(mask, at);
    const __m256i bits = _mm256_maskz_loadu_epi16(mask, at);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

/* Row m of x (io dtype) as limb rows, its 2^-s, its top limb's block sums and its group sums
 * (`row`: scratch, K floats). */
static void make_limbs(const void *x, int64_t x_stride, int io_f32, int m, int K, int group,
                       int has_offsets, float *row, const limb_rows *r) {
    const int nl = r->limbs_per_row;
    const char *in = (const char *)x + (int64_t)m * x_stride * (io_f32 ? 4 : 2);
    __m512 largest = _mm512_setzero_ps();
    __mmask16 not_finite = 0;
    for (int k = 0; k < K; k += 16) {
        const __mmask16 mask = first_lanes(K - k);
        const __m512 v = load16(in + (int64_t)k * (io_f32 ? 4 : 2), io_f32, mask);
        _mm512_mask_storeu_ps(row + k, mask, v);
        const __m512 magnitude = _mm512_abs_ps(v);
        not_finite |= _mm512_cmp_ps_mask(magnitude, _mm512_set1_ps(INFINITY), _CMP_NLT_UQ);
        largest = _mm512_max_ps(largest, magnitude);
    }
    uint8_t *limbs = r->limbs + (int64_t)m * nl * r->K4;
    int32_t *top_sums = r->top_sums + (int64_t)m * r->blocks;
    int exponent = 0;
    const float top = _mm512_reduce_max_ps(largest);
    if (!not_finite && top > 0.0f) frexpf(top, &exponent); /* top < 2^exponent */
    int s = (nl == LIMBS_F32 ? ROW_BITS_F32 : ROW_BITS_BF16) - exponent;
    /* 2^-s must stay a normal float32: a row whose largest magnitude is under 2^-104 (float32)
     * or 2^-112 (bf16) has fewer bits than that. */
    s = s > 126 ? 126 : s;
    r->unscale[m] = not_finite ? NAN : ldexpf(1.0f, -s);
    if (not_finite) {
        memset(limbs, 0, (size_t)nl * r->K4);
        memset(top_sums, 0, (size_t)r->blocks * sizeof(int32_t));
        return;
    }
    const __m512 power = _mm512_set1_ps((float)s);
    for (int k = 0; k < r->K4; k += 16) {
        const __m512i X = _mm512_cvtps_epi32(
            _mm512_scalef_ps(_mm512_maskz_loadu_ps(first_lanes(K - k), row + k), power));
        const __mmask16 mask = first_lanes(r->K4 - k);
        for (int i = 0; i < nl; i++)
            _mm_mask_storeu_epi8(limbs + i * r->K4 + k, mask,
                                 _mm512_cvtepi32_epi8(_mm512_srai_epi32(X, 8 * i)));
    }
    const int8_t *high = (const int8_t *)limbs + (nl - 1) * r->K4;
    for (int g = 0, b = 0; g < r->groups; g++) {
        const int k0 = g * group;
        const int rows = K - k0 < group ? K - k0 : group;
        for (int b0 = 0; b0 < rows; b0 += BLOCK_K, b++) {
            const int end = k0 + (rows - b0 < BLOCK_K ? rows : b0 + BLOCK_K);
            int32_t sum = 0;
            for (int k = k0 + b0; k < end; k++) sum += high[k];
            top_sums[b] = sum;
        }
        if (has_offsets)
            r->xsum[(int64_t)m * r->groups + g] = ldexpf(group_sum(row + k0, rows), s);
    }
}

/* For nr rows (row r's limb i at limbs + (nl r + i) limb_stride) over nt tiles side by side
 * (their streams tile_stride bytes apart), nq quads of codes from `codes`: each row's sum of
 * code times X over the block, P (see the top), added to the group's partial sums in part
 * [r][t * TILE + 0..TILE) (`width` floats a row) unless the block starts its group (`first`),
 * and where it ends its group (`last`) scaled into acc, laid out alike, by the scales and
 * offsets of the tiles' group. The low
 * limbs are unsigned bytes against signed codes; the top limb is signed, so it runs against
 * the codes as unsigned bytes: int8 codes plus 128 (an XOR of the sign bit), 128 times the
 * limb's sum (top_sums, per row) taken off after. nl, nr, nt and kind are constants after
 * inlining, so the sums stay in registers. */
static inline __attribute__((always_inline)) void quad_block(
    const uint8_t *codes, int64_t tile_stride, const int kind, const int nl, int nq,
    const uint8_t *limbs, int64_t limb_stride, const int nr, const int nt,
    const int32_t *top_sums, int64_t top_stride, const float *scales, const float *offsets,
    const float *xsum, int64_t xsum_stride, int first, int last, float *part, float *acc,
    int width) {
    __m512i sums[MAX_BLOCK_ROWS][LIMBS_F32][4][2];
#pragma GCC unroll 4
    for (int r = 0; r < nr; r++)
#pragma GCC unroll 3
        for (int i = 0; i < nl; i++)
#pragma GCC unroll 4
            for (int t = 0; t < nt; t++)
                sums[r][i][t][0] = sums[r][i][t][1] = _mm512_setzero_si512();
    const int step = quad_bytes(kind);
    for (int q = 0; q < nq; q++) {
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++) {
            const uint8_t *at = codes + t * tile_stride + (int64_t)q * step;
            __m512i w[2];
            _mm_prefetch((const char *)at + PREFETCH_NEAR, _MM_HINT_T0);
            _mm_prefetch((const char *)at + PREFETCH_FAR, _MM_HINT_T1);
            if (kind == QUANT_INT8_QUADS) {
                _mm_prefetch((const char *)at + 64 + PREFETCH_NEAR, _MM_HINT_T0);
                _mm_prefetch((const char *)at + 64 + PREFETCH_FAR, _MM_HINT_T1);
                w[0] = _mm512_loadu_si512((const void *)at);
                w[1] = _mm512_loadu_si512((const void *)(at + 64));
            } else {
                const __m512i bytes = _mm512_loadu_si512((const void *)at);
                const __m512i low = _mm512_set1_epi8(15);
                w[0] = _mm512_and_si512(bytes, low);
                w[1] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low);
            }
            __m512i unsigned_w[2];
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++)
                unsigned_w[h] = kind == QUANT_INT8_QUADS
                                    ? _mm512_xor_si512(w[h], _mm512_set1_epi8((char)0x80))
                                    : w[h];
#pragma GCC unroll 4
            for (int r = 0; r < nr; r++) {
                const uint8_t *row = limbs + (int64_t)r * nl * limb_stride + (int64_t)q * QUAD;
                int32_t lanes[LIMBS_F32];
#pragma GCC unroll 3
                for (int i = 0; i < nl; i++) memcpy(&lanes[i], row + i * limb_stride, 4);
#pragma GCC unroll 2
                for (int h = 0; h < 2; h++) {
#pragma GCC unroll 2
                    for (int i = 0; i < nl - 1; i++)
                        sums[r][i][t][h] = dot_bytes(sums[r][i][t][h],
                                                     _mm512_set1_epi32(lanes[i]), w[h]);
                    sums[r][nl - 1][t][h] = dot_bytes(sums[r][nl - 1][t][h], unsigned_w[h],
                                                      _mm512_set1_epi32(lanes[nl - 1]));
                }
            }
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < nr; r++) {
        const __m512i carried =
            _mm512_set1_epi32(kind == QUANT_INT8_QUADS ? 128 * top_sums[r * top_stride] : 0);
        const __m512 minus_sum = _mm512_set1_ps(offsets ? -xsum[r * xsum_stride] : 0.0f);
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++)
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) {
                const __m512i top = _mm512_sub_epi32(sums[r][nl - 1][t][h], carried);
                const __m512 whole =
                    nl == LIMBS_BF16
                        ? _mm512_cvtepi32_ps(
                              _mm512_add_epi32(sums[r][0][t][h], _mm512_slli_epi32(top, 8)))
                        : _mm512_fmadd_ps(
                              _mm512_cvtepi32_ps(top), _mm512_set1_ps(65536.0f),
                              _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r][1][t][h]),
                                              _mm512_set1_ps(256.0f),
                                              _mm512_cvtepi32_ps(sums[r][0][t][h])));
                const int64_t at = (int64_t)r * width + t * TILE + 16 * h;
                const __m512 partial =
                    first ? whole : _mm512_add_ps(_mm512_loadu_ps(part + at), whole);
                if (!last) {
                    _mm512_storeu_ps(part + at, partial);
                    continue;
                }
                const int64_t column = t * tile_stride / 4 + 16 * h;
                __m512 sum = _mm512_fmadd_ps(_mm512_loadu_ps(scales + column), partial,
                                             _mm512_loadu_ps(acc + at));
                if (offsets)
                    sum = _mm512_fmadd_ps(_mm512_loadu_ps(offsets + column), minus_sum, sum);
                _mm512_storeu_ps(acc + at, sum);
            }
    }
}

/* Each shape its own function: inlined together into one, gcc's register allocator copies
 * every accumulator in and out of its register around each instruction. */
#define BLOCK_ARGS                                                                             \
    const uint8_t *codes, int64_t tile_stride, int nq, const uint8_t *limbs,                   \
        int64_t limb_stride, const int32_t *top_sums, int64_t top_stride, const float *scales, \
        const float *offsets, const float *xsum, int64_t xsum_stride, int first, int last,     \
        float *part, float *acc, int width
#define BLOCK_SHAPE(name, code, limbs_per_row, rows, tiles)                                    \
    static __attribute__((noinline)) void name(BLOCK_ARGS) {                                   \
        quad_block(codes, tile_stride, code, limbs_per_row, nq, limbs, limb_stride, rows,      \
                   tiles, top_sums, top_stride, scales, offsets, xsum, xsum_stride, first,     \
                   last, part, acc, width);                                                    \
    }
/* Per kind and limb count: one row over four tiles, two over two, 1 to `most` over one. */
#define BLOCK_SHAPES(name, code, limbs_per_row, most)                                          \
    BLOCK_SHAPE(name##_1x4, code, limbs_per_row, 1, 4)                                         \
    BLOCK_SHAPE(name##_2x2, code, limbs_per_row, 2, 2)                                         \
    BLOCK_SHAPE(name##_1x1, code, limbs_per_row, 1, 1)                                         \
    BLOCK_SHAPE(name##_2x1, code, limbs_per_row, 2, 1)                                         \
    BLOCK_SHAPE(name##_3x1, code, limbs_per_row, 3, 1)                                         \
    BLOCK_SHAPE(name##_4x1, code, limbs_per_row, most, 1)
BLOCK_SHAPES(int8_f32, QUANT_INT8_QUADS, LIMBS_F32, BLOCK_ROWS_F32)
BLOCK_SHAPES(uint4_f32, QUANT_UINT4_QUADS, LIMBS_F32, BLOCK_ROWS_F32)
BLOCK_SHAPES(int8_bf16, QUANT_INT8_QUADS, LIMBS_BF16, BLOCK_ROWS_BF16)
BLOCK_SHAPES(uint4_bf16, QUANT_UINT4_QUADS, LIMBS_BF16, BLOCK_ROWS_BF16)
#undef BLOCK_SHAPES
#undef BLOCK_SHAPE

typedef void (*block_kernel)(BLOCK_ARGS);
#undef BLOCK_ARGS

#define SHAPES(name) {name##_1x4, name##_2x2, name##_1x1, name##_2x1, name##_3x1, name##_4x1}
/* The quad_block of a kind, limb count and shape. */
static block_kernel block_for(int kind, int limbs_per_row, int rows, int tiles) {
    static const block_kernel kernels[2][2][6] = {
        {SHAPES(int8_f32), SHAPES(uint4_f32)},
        {SHAPES(int8_bf16), SHAPES(uint4_bf16)},
    };
    const int shape = tiles == 4 ? 0 : tiles == 2 ? 1 : rows + 1;
    return kernels[limbs_per_row == LIMBS_BF16][kind == QUANT_UINT4_QUADS][shape];
}
#undef SHAPES

/* Tiles run side by side for a row count: one row's limb rows over four tiles, two rows' over
 * two; more rows run a few at a time over one tile. */
static inline int tiles_for(int M) { return M == 1 ? 4 : M == 2 ? 2 : 1; }

/* nt tiles side by side (tile_stride bytes apart): every row's sums, in units of its X, into
 * acc [M][nt * TILE]; part: scratch of the same size. */
static void run_tiles(const uint8_t *tile, int64_t tile_stride, int nt, int kind, int group,
                      int has_offsets, int K, int M, const limb_rows *r, float *acc,
                      float *part) {
    const int width = nt * TILE;
    const int nl = r->limbs_per_row;
    const int most = nl == LIMBS_F32 ? BLOCK_ROWS_F32 : BLOCK_ROWS_BF16;
    memset(acc, 0, (size_t)M * width * sizeof(float));
    const uint8_t *at = tile;
    for (int g = 0, block = 0; g < r->groups; g++) {
        const int k0 = g * group;
        const int rows = K - k0 < group ? K - k0 : group;
        const float *scales = (const float *)at;
        const float *offsets = has_offsets ? scales + TILE : NULL;
        const uint8_t *codes = at + header_bytes(has_offsets);
        for (int b0 = 0; b0 < rows; b0 += BLOCK_K, block++) {
            const int nq = padded_rows(rows - b0 < BLOCK_K ? rows - b0 : BLOCK_K) / QUAD;
            for (int m = 0; m < M; m += most) {
                const int nr = M - m < most ? M - m : most;
                block_for(kind, nl, nr, nt)(
                    codes + (int64_t)b0 / QUAD * quad_bytes(kind), tile_stride, nq,
                    r->limbs + ((int64_t)m * nl * r->K4) + k0 + b0, r->K4,
                    r->top_sums + (int64_t)m * r->blocks + block, r->blocks, scales, offsets,
                    r->xsum + (int64_t)m * r->groups + g, r->groups, b0 == 0,
                    b0 + BLOCK_K >= rows, part + (int64_t)m * width, acc + (int64_t)m * width,
                    width);
            }
        }
        at = codes + (int64_t)padded_rows(rows) / QUAD * quad_bytes(kind);
    }
}

#endif

int pdserve_quantized_quads_linear(const void *x, int64_t x_stride, const uint8_t *packed,
                                   int kind, int group_size, int has_offsets, const float *bias,
                                   void *y, int64_t y_stride, int io_dtype, int M, int N, int K,
                                   int num_threads) {
    if (!valid_shape(kind, group_size, M, N, K) || (io_dtype != KV_F32 && io_dtype != KV_BF16))
        return -2;
#ifndef HAVE_QUADS
    (void)x, (void)x_stride, (void)packed, (void)has_offsets, (void)bias, (void)y, (void)y_stride;
    (void)num_threads;
    return -2;
#else
    if (M == 0) return 0;
    has_offsets = has_offsets != 0;
    const int groups = (K + group_size - 1) / group_size;
    const int K4 = padded_rows(K);
    const int64_t stride = tile_bytes(kind, has_offsets, group_size, K);
    const int num_tiles = (N + TILE - 1) / TILE;
    const int per_block = tiles_for(M);
    const int num_blocks = (num_tiles + per_block - 1) / per_block;
    const int io_f32 = io_dtype == KV_F32;
    const size_t in_size = io_f32 ? sizeof(float) : sizeof(uint16_t);
    /* Rows run ROW_CHUNK at a time, each chunk's limbs made once (every tile reads all of
     * them) and small enough to stay in L2 while the tiles run over them. */
    const int chunk = M < ROW_CHUNK ? M : ROW_CHUNK;
    const int limbs_per_row = io_f32 ? LIMBS_F32 : LIMBS_BF16;
    const size_t limb_bytes = ((size_t)chunk * limbs_per_row * K4 + 63) / 64 * 64;
    int blocks = 0;
    for (int g = 0; g < groups; g++)
        blocks += group_blocks(K - g * group_size < group_size ? K - g * group_size : group_size);
    uint8_t *shared =
        aligned_alloc(64, limb_bytes + (size_t)chunk * (1 + groups + blocks) * sizeof(float));
    if (!shared) return -1;
    const limb_rows rows = {
        .limbs = shared,
        .unscale = (float *)(shared + limb_bytes),
        .xsum = (float *)(shared + limb_bytes) + chunk,
        .top_sums = (int32_t *)(shared + limb_bytes) + chunk + (size_t)chunk * groups,
        .limbs_per_row = limbs_per_row,
        .K4 = K4,
        .blocks = blocks,
        .groups = groups,
    };
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        float *row = malloc((size_t)K * sizeof(float));
        const int width = per_block * TILE;
        float *acc = aligned_alloc(64, (size_t)2 * chunk * width * sizeof(float));
        if (!row || !acc) {
#pragma omp atomic write
            failed = 1;
        }
        float *part = acc + (size_t)chunk * width;
        for (int m0 = 0; m0 < M; m0 += chunk) {
            const int rows_here = M - m0 < chunk ? M - m0 : chunk;
            const char *x_here = (const char *)x + (int64_t)m0 * x_stride * in_size;
            char *y_here = (char *)y + (int64_t)m0 * y_stride * in_size;
#pragma omp for schedule(static)
            for (int m = 0; m < rows_here; m++)
                if (row)
                    make_limbs(x_here, x_stride, io_f32, m, K, group_size, has_offsets, row,
                               &rows);
#pragma omp for schedule(static)
            for (int b = 0; b < num_blocks; b++) {
                if (failed) continue;
                const int t0 = b * per_block;
                const int nt = num_tiles - t0 < per_block ? num_tiles - t0 : per_block;
                /* A short last block runs its tiles one at a time. */
                const int run = nt == per_block ? nt : 1;
                for (int t = 0; t < nt; t += run) {
                    run_tiles(packed + (t0 + t) * stride, stride, run, kind, group_size,
                              has_offsets, K, rows_here, &rows, acc, part);
                    for (int u = 0; u < run; u++) {
                        const int n0 = (t0 + t + u) * TILE;
                        const int columns = N - n0 < TILE ? N - n0 : TILE;
                        for (int m = 0; m < rows_here; m++)
                            store_scaled_row(acc + (int64_t)m * run * TILE + u * TILE,
                                             rows.unscale[m], bias ? bias + n0 : NULL, columns,
                                             io_f32,
                                             y_here + ((int64_t)m * y_stride + n0) * in_size);
                    }
                }
            }
        }
        free(row);
        free(acc);
    }
    free(shared);
    return failed ? -1 : 0;
#endif
}
