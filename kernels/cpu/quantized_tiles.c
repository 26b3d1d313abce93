/* y = x W^T (+ bias) over quantized weights prepacked in tiles: int8, unsigned 4-bit or FP8
 * e4m3 codes in groups along the input, a float32 scale (and offset) per group and column.
 *
 * The weight (kernels/quantized.py's QuantizedWeight) is prepacked once by
 * kernels/cpu/quantized_linear.py into tiles of TILE output columns. A tile is one byte stream
 * of its groups in order, so a decode step reads each byte once, front to back; a group is
 *     scales  [TILE] float32 (FP8: 256 times the checkpoint's, see decode_rows),
 *     offsets [TILE] float32, only where the weight has offsets,
 *     codes, k-major: int8 and e4m3 [rows][TILE] bytes; uint4 [rows / 2][TILE] bytes, byte
 *            (p, j) holding column j's code of k-row 2p in its low nibble and of 2p + 1 in its
 *            high one (one load and a mask or a shift unpack 32 codes of either k-row),
 * where rows is the group size, or what is left of the input for the last group (uint4 pads
 * the input to an even length with zero codes).
 *
 * Every output is summed in one order: per group, partial = fma(x[k], code[k], partial) for
 * each k of the group in turn, from 0; then acc = fma(scale, partial, acc), then
 * acc = fma(-offset, xsum, acc), xsum being the row's sum over the group (group_sum, once per
 * row and group). The output is acc (+ bias) rounded once to the output dtype. However the rows
 * are blocked and however many a call has, a row's outputs are the same bits.
 *
 * A few rows (up to DIRECT_ROWS) decode the codes as they stream by, over a few tiles side by
 * side (TILES_FOR: the fewer the rows, the more tiles); more rows decode a chunk
 * of the tile into float32 in L1 once (decode_chunk) and run every row over it, so the decoding
 * is paid once per tile, not once per row block. Both read the same values in the same order.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "exports.h"
#include "numerics.h"
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include <immintrin.h>
#endif

#define TILE 32
/* k-rows decoded at a time for many rows: 16 KB of float32, which stays in L1 while every row
 * runs over it. */
#define CHUNK_K 128
/* Bytes of the stream fetched ahead of use into L1 and, further ahead, into L2: the stream
 * crosses tiles, which no prefetcher knows, and one core needs many lines in flight to read
 * memory at full speed. */
#define PREFETCH_NEAR 4096
#define PREFETCH_FAR 32768

/* Bytes of `rows` k-rows of a tile's codes. */
static inline int64_t code_bytes(int kind, int64_t rows) {
    return kind == QUANT_UINT4 ? rows / 2 * TILE : rows * TILE;
}

/* Bytes of a group of `rows` k-rows: its scales, its offsets, its codes. */
static inline int64_t group_bytes(int kind, int has_offsets, int rows) {
    return (int64_t)TILE * sizeof(float) * (1 + has_offsets) + code_bytes(kind, rows);
}

/* The input length a tile's codes cover: uint4 pairs k-rows, so its input is padded to even. */
static inline int padded_k(int kind, int K) { return kind == QUANT_UINT4 ? K + (K & 1) : K; }

static inline int64_t tile_bytes(int kind, int has_offsets, int group, int K) {
    const int groups = (K + group - 1) / group;
    const int last = padded_k(kind, K) - (groups - 1) * group;
    return (groups - 1) * group_bytes(kind, has_offsets, group) +
           group_bytes(kind, has_offsets, last);
}

/* Codes in quads of k-rows, summed in integers: quantized_quads.c's. */
static inline int quads_kind(int kind) {
    return kind == QUANT_INT8_QUADS || kind == QUANT_UINT4_QUADS;
}

/* An e4m3 code's value over 256 (its scale holds the 256): the code's bits moved into an fp16,
 * sign to bit 15, exponent and mantissa under bit 14, read as 2^(e - 15) (1 + m / 8) where the
 * code means 2^(e - 7) (1 + m / 8) (and alike for the subnormals): exact. */
static inline float fp8_e4m3_over_256(uint8_t bits) {
    const int exponent = (bits >> 3) & 15, mantissa = bits & 7;
    const float magnitude =
        exponent ? ldexpf((float)(8 + mantissa), exponent - 18) : ldexpf((float)mantissa, -17);
    return bits & 0x80 ? -magnitude : magnitude;
}

/* Column j of k-row k of a tile's codes, as the value its scale multiplies. */
static inline float code_value(int kind, const uint8_t *codes, int64_t k, int j) {
    if (kind == QUANT_INT8) return (float)(int8_t)codes[k * TILE + j];
    if (kind == QUANT_UINT4) return (float)((codes[(k >> 1) * TILE + j] >> (4 * (k & 1))) & 15);
    return fp8_e4m3_over_256(codes[k * TILE + j]);
}

#if defined(__AVX512F__)
#define HAVE_VECTOR_TILES 1
typedef __m512 vec;
#define LANES 16
/* Eight rows over the whole tile: 16 accumulators, every one a chain of its own. */
#define DIRECT_ROWS 8
#define WIDE_ROWS 8
/* Fewer rows run over several tiles side by side (direct_block), so that even one row keeps
 * eight chains of FMAs in flight (a chain waits four cycles an FMA; one row over one tile has
 * two, a 4-bit code's pair of k-rows one after the other in each) and reads four streams at
 * once. SmolLM2's linears at one row, one core of the AVX-512 Xeon: 7-21% faster than one tile
 * at a time (with the 4-bit lookup in decode_rows and the longer prefetch). */
#define DIRECT_TILES 4
#define TILES_FOR(rows) ((rows) <= 2 ? 4 : (rows) <= 4 ? 2 : 1)
#define vec_load _mm512_loadu_ps
#define vec_store _mm512_storeu_ps
#define vec_fma _mm512_fmadd_ps
#define vec_set1 _mm512_set1_ps
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define HAVE_VECTOR_TILES 1
typedef __m256 vec;
#define LANES 8
/* AVX2 has 16 registers: a row over the whole tile holds four accumulators, and a decoded
 * uint4 pair of k-rows eight vectors. */
#define DIRECT_ROWS 2
#define WIDE_ROWS 3
#define DIRECT_TILES 2
#define TILES_FOR(rows) ((rows) == 1 ? 2 : 1)
#define vec_load _mm256_loadu_ps
#define vec_store _mm256_storeu_ps
#define vec_fma _mm256_fmadd_ps
#define vec_set1 _mm256_set1_ps
#endif

#ifdef HAVE_VECTOR_TILES
#define VECS (TILE / LANES)

/* k-rows decoded per step: a uint4 byte holds two. */
#define STEP(kind) ((kind) == QUANT_UINT4 ? 2 : 1)

/* The codes of k-row k (and, uint4, of k + 1, k even) as float32: w[0..VECS) and w[VECS..2VECS).
 * int8: sign-extended and converted; uint4: zero-extended, then the low nibble masked off and
 * the high one shifted down; e4m3: sign-extended to 16 bits, shifted left 7 and masked, which
 * leaves the sign at bit 15 and the rest under bit 14 (see fp8_e4m3_over_256), then converted
 * from fp16 by the processor. All exact. */
static inline __attribute__((always_inline)) void decode_rows(const int kind,
                                                              const uint8_t *codes, int64_t k,
                                                              vec *w) {
#if defined(__AVX512F__)
    if (kind == QUANT_UINT4) {
        /* vpermps reads the low four bits of each index: a nibble is looked up as it is, one
         * instruction where masking and converting take two. */
        const __m512 values =
            _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const uint8_t *p = codes + (k >> 1) * TILE;
        for (int v = 0; v < VECS; v++) {
            const __m512i bytes =
                _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 16 * v)));
            w[v] = _mm512_permutexvar_ps(bytes, values);
            w[VECS + v] = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), values);
        }
    } else if (kind == QUANT_INT8) {
        const uint8_t *p = codes + k * TILE;
        for (int v = 0; v < VECS; v++)
            w[v] = _mm512_cvtepi32_ps(
                _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16 * v))));
    } else {
        const __m512i words =
            _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(codes + k * TILE)));
        const __m512i halves =
            _mm512_and_si512(_mm512_slli_epi16(words, 7), _mm512_set1_epi16((short)0xBF80));
        w[0] = _mm512_cvtph_ps(_mm512_castsi512_si256(halves));
        w[1] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(halves, 1));
    }
#else
    if (kind == QUANT_UINT4) {
        const uint8_t *p = codes + (k >> 1) * TILE;
        for (int v = 0; v < VECS; v++) {
            const __m256i bytes =
                _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8 * v)));
            w[v] = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, _mm256_set1_epi32(15)));
            w[VECS + v] = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
        }
    } else if (kind == QUANT_INT8) {
        const uint8_t *p = codes + k * TILE;
        for (int v = 0; v < VECS; v++)
            w[v] = _mm256_cvtepi32_ps(
                _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8 * v))));
    } else {
        const uint8_t *p = codes + k * TILE;
        for (int h = 0; h < 2; h++) {
            const __m256i words =
                _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + 16 * h)));
            const __m256i halves = _mm256_and_si256(_mm256_slli_epi16(words, 7),
                                                    _mm256_set1_epi16((short)0xBF80));
            w[2 * h] = _mm256_cvtph_ps(_mm256_castsi256_si128(halves));
            w[2 * h + 1] = _mm256_cvtph_ps(_mm256_extracti128_si256(halves, 1));
        }
    }
#endif
}

static inline __attribute__((always_inline)) void prefetch_stream(const uint8_t *at) {
    _mm_prefetch((const char *)at + PREFETCH_NEAR, _MM_HINT_T0);
    _mm_prefetch((const char *)at + PREFETCH_FAR, _MM_HINT_T1);
}

/* Where a block's partial sums go once it has run: where its group ends (`scales` set), into
 * the outputs' sums, acc = fma(scale, partial, acc) then acc = fma(-offset, xsum, acc), with
 * the partial sums still in registers; else (a group longer than a chunk) into `part`, for the
 * block over the next chunk to go on from. */
typedef struct {
    const float *scales;  /* NULL: the group goes on past this block */
    const float *offsets; /* or NULL */
    const float *xsum;    /* the first row's sum over the group; the next row's xsum_stride on */
    int64_t xsum_stride;
} group_end;

/* The partial sums of n rows: zero where the group starts (`fresh`), else kept in part. */
static inline __attribute__((always_inline)) void block_begin(vec a[][VECS], const int n,
                                                              int fresh, const float *part) {
    for (int r = 0; r < n; r++)
        for (int v = 0; v < VECS; v++)
            a[r][v] = fresh ? vec_set1(0.0f) : vec_load(part + r * TILE + v * LANES);
}

/* The partial sums of n rows scaled into acc, where their group ends. */
static inline __attribute__((always_inline)) void block_scale(vec a[][VECS], const int n,
                                                              const group_end *end, float *acc) {
    for (int r = 0; r < n; r++) {
        const vec minus_sum = vec_set1(end->offsets ? -end->xsum[r * end->xsum_stride] : 0.0f);
        for (int v = 0; v < VECS; v++) {
            vec sum = vec_fma(vec_load(end->scales + v * LANES), a[r][v],
                              vec_load(acc + r * TILE + v * LANES));
            if (end->offsets) sum = vec_fma(vec_load(end->offsets + v * LANES), minus_sum, sum);
            vec_store(acc + r * TILE + v * LANES, sum);
        }
    }
}

static inline __attribute__((always_inline)) void block_end(vec a[][VECS], const int n,
                                                            const group_end *end, float *part,
                                                            float *acc) {
    if (end->scales) {
        block_scale(a, n, end, acc);
        return;
    }
    for (int r = 0; r < n; r++)
        for (int v = 0; v < VECS; v++) vec_store(part + r * TILE + v * LANES, a[r][v]);
}

/* For n <= DIRECT_ROWS rows over nt tiles side by side (their streams tile_stride bytes
 * apart), a whole group: each tile's sums of x[r][k] * code[k][0..TILE) over its k-rows
 * [0, kc), decoding the codes as they are read, scaled into the tile's acc (acc_stride floats
 * after the previous tile's). Kind, n and nt are constants after inlining, so the sums stay in
 * registers; each output's sum runs in the order it would over its tile alone. */
static inline __attribute__((always_inline)) void direct_block(
    const float *x, int64_t x_stride, const uint8_t *codes, int64_t tile_stride, const int kind,
    int kc, const int n, const int nt, const group_end *end, float *acc, int64_t acc_stride) {
    vec a[DIRECT_TILES][DIRECT_ROWS][VECS];
    for (int t = 0; t < nt; t++) block_begin(a[t], n, 1, NULL);
    for (int k = 0; k < kc; k += STEP(kind)) {
        /* One prefetch a cache line of each stream. */
        const int fetch = (code_bytes(kind, k) & 63) == 0;
        for (int t = 0; t < nt; t++) {
            const uint8_t *tile_codes = codes + t * tile_stride;
            if (fetch) prefetch_stream(tile_codes + code_bytes(kind, k));
            vec w[2 * VECS];
            decode_rows(kind, tile_codes, k, w);
            for (int s = 0; s < STEP(kind); s++)
#pragma GCC unroll 8
                for (int r = 0; r < n; r++) {
                    const vec xv = vec_set1(x[r * x_stride + k + s]);
                    for (int v = 0; v < VECS; v++)
                        a[t][r][v] = vec_fma(xv, w[s * VECS + v], a[t][r][v]);
                }
        }
    }
    for (int t = 0; t < nt; t++) {
        group_end tile_end = *end;
        tile_end.scales = (const float *)((const uint8_t *)end->scales + t * tile_stride);
        if (end->offsets)
            tile_end.offsets = (const float *)((const uint8_t *)end->offsets + t * tile_stride);
        block_scale(a[t], n, &tile_end, acc + t * acc_stride);
    }
}

/* TILES_FOR(rows) tiles side by side, or (the tiles left over at the end) one. */
#define DIRECT_CASE(code, rows)                                                                \
    case (code) * DIRECT_ROWS + (rows) - 1:                                                    \
        if (nt == 1)                                                                           \
            direct_block(x, x_stride, codes, tile_stride, code, kc, rows, 1, end, acc,         \
                         acc_stride);                                                          \
        else                                                                                   \
            direct_block(x, x_stride, codes, tile_stride, code, kc, rows, TILES_FOR(rows),     \
                         end, acc, acc_stride);                                                \
        break;
#define DIRECT_KINDS(rows)                                                                     \
    DIRECT_CASE(QUANT_INT8, rows) DIRECT_CASE(QUANT_UINT4, rows) DIRECT_CASE(QUANT_FP8_E4M3, rows)

/* nt: 1 or TILES_FOR(n). */
static void direct_any(const float *x, int64_t x_stride, const uint8_t *codes,
                       int64_t tile_stride, int kind, int kc, int n, int nt,
                       const group_end *end, float *acc, int64_t acc_stride) {
    switch (kind * DIRECT_ROWS + n - 1) {
        DIRECT_KINDS(1)
        DIRECT_KINDS(2)
#if DIRECT_ROWS > 2
        DIRECT_KINDS(3) DIRECT_KINDS(4) DIRECT_KINDS(5) DIRECT_KINDS(6) DIRECT_KINDS(7)
        DIRECT_KINDS(8)
#endif
    }
}
#undef DIRECT_KINDS
#undef DIRECT_CASE

/* wide[0..kc)[0..TILE): k-rows [0, kc) of a tile's codes as float32. */
static inline __attribute__((always_inline)) void decode_kind(const int kind,
                                                              const uint8_t *codes, int kc,
                                                              float *wide) {
    for (int k = 0; k < kc; k += STEP(kind)) {
        prefetch_stream(codes + code_bytes(kind, k));
        vec w[2 * VECS];
        decode_rows(kind, codes, k, w);
        for (int v = 0; v < STEP(kind) * VECS; v++) vec_store(wide + k * TILE + v * LANES, w[v]);
    }
}

static void decode_chunk(int kind, const uint8_t *codes, int kc, float *wide) {
    if (kind == QUANT_INT8)
        decode_kind(QUANT_INT8, codes, kc, wide);
    else if (kind == QUANT_UINT4)
        decode_kind(QUANT_UINT4, codes, kc, wide);
    else
        decode_kind(QUANT_FP8_E4M3, codes, kc, wide);
}

/* For n <= WIDE_ROWS rows (a constant after inlining), the sums of x[r][k] * wide[k][0..TILE)
 * over k-rows [0, kc) of a decoded chunk, going on from part unless the chunk starts its group
 * (`fresh`), and where it ends its group scaled into acc (see group_end). */
static inline __attribute__((always_inline)) void wide_block(const float *x, int64_t x_stride,
                                                             const float *wide, int kc,
                                                             const int n, int fresh,
                                                             const group_end *end, float *part,
                                                             float *acc) {
    vec a[WIDE_ROWS][VECS];
    block_begin(a, n, fresh, part);
    for (int k = 0; k < kc; k++)
        for (int v = 0; v < VECS; v++) {
            const vec w = vec_load(wide + k * TILE + v * LANES);
#pragma GCC unroll 8
            for (int r = 0; r < n; r++)
                a[r][v] = vec_fma(vec_set1(x[r * x_stride + k]), w, a[r][v]);
        }
    block_end(a, n, end, part, acc);
}

#define WIDE_CASE(rows)                                                                        \
    case rows:                                                                                 \
        wide_block(x, x_stride, wide, kc, rows, fresh, end, part, acc);                        \
        break;

static void wide_any(const float *x, int64_t x_stride, const float *wide, int kc, int n,
                     int fresh, const group_end *end, float *part, float *acc) {
    switch (n) {
        WIDE_CASE(1) WIDE_CASE(2) WIDE_CASE(3)
#if WIDE_ROWS > 3
        WIDE_CASE(4) WIDE_CASE(5) WIDE_CASE(6) WIDE_CASE(7) WIDE_CASE(8)
#endif
    }
}
#undef WIDE_CASE
#else
/* Portable C: a chunk decoded one code at a time, then each row over it. */
#define DIRECT_ROWS 0
#define WIDE_ROWS 1
#define TILES_FOR(rows) 1

typedef struct {
    const float *scales;
    const float *offsets;
    const float *xsum;
    int64_t xsum_stride;
} group_end;

static void decode_chunk(int kind, const uint8_t *codes, int kc, float *wide) {
    for (int k = 0; k < kc; k++)
        for (int j = 0; j < TILE; j++) wide[k * TILE + j] = code_value(kind, codes, k, j);
}

/* One row (n is 1) over a decoded chunk, as the vector paths' wide_block. */
static void wide_any(const float *x, int64_t x_stride, const float *wide, int kc, int n,
                     int fresh, const group_end *end, float *part, float *acc) {
    (void)x_stride, (void)n;
    float sums[TILE];
    for (int j = 0; j < TILE; j++) sums[j] = fresh ? 0.0f : part[j];
    for (int k = 0; k < kc; k++)
        for (int j = 0; j < TILE; j++) sums[j] += x[k] * wide[k * TILE + j];
    if (!end->scales) {
        memcpy(part, sums, sizeof sums);
        return;
    }
    for (int j = 0; j < TILE; j++) {
        acc[j] = fmaf(end->scales[j], sums[j], acc[j]);
        if (end->offsets) acc[j] = fmaf(end->offsets[j], -end->xsum[0], acc[j]);
    }
}

static void direct_any(const float *x, int64_t x_stride, const uint8_t *codes,
                       int64_t tile_stride, int kind, int kc, int n, int nt,
                       const group_end *end, float *acc, int64_t acc_stride) {
    (void)x, (void)x_stride, (void)codes, (void)tile_stride, (void)kind, (void)kc, (void)n;
    (void)nt, (void)end, (void)acc, (void)acc_stride;
}
#endif

/* The shape of a packed weight, as a call reads it. */
typedef struct {
    const uint8_t *packed;
    int kind;
    int group;
    int has_offsets;
    int K;
    int groups;
} quantized_shape;

/* acc[t][m][0..TILE) = the sums of the outputs of nt tiles side by side (their streams
 * tile_stride bytes apart; nt is 1 or, up to DIRECT_ROWS rows, TILES_FOR(M)) for all M rows of
 * x (float32, rows x_stride apart, K padded); part and wide are scratch. */
static void tile_sums(const quantized_shape *q, const uint8_t *tile, int64_t tile_stride, int nt,
                      const float *x, int64_t x_stride, const float *xsum, int M, float *acc,
                      float *part, float *wide) {
    const int64_t header = (int64_t)TILE * (1 + q->has_offsets);
    const int K = padded_k(q->kind, q->K);
    memset(acc, 0, (size_t)nt * M * TILE * sizeof(float));
    const uint8_t *at = tile;
    for (int g = 0; g < q->groups; g++) {
        const int k0 = g * q->group;
        const int rows = K - k0 < q->group ? K - k0 : q->group;
        const float *scales = (const float *)at;
        const float *offsets = q->has_offsets ? scales + TILE : NULL;
        const uint8_t *codes = (const uint8_t *)(scales + header);
        if (M <= DIRECT_ROWS) {
            const group_end end = {scales, offsets, xsum + g, q->groups};
            direct_any(x + k0, x_stride, codes, tile_stride, q->kind, rows, M, nt, &end, acc,
                       (int64_t)M * TILE);
        } else {
            for (int c0 = 0; c0 < rows; c0 += CHUNK_K) {
                const int kc = rows - c0 < CHUNK_K ? rows - c0 : CHUNK_K;
                const int ends = c0 + kc == rows;
                decode_chunk(q->kind, codes + code_bytes(q->kind, c0), kc, wide);
                for (int m = 0; m < M; m += WIDE_ROWS) {
                    const group_end end = {ends ? scales : NULL, offsets,
                                           xsum + (int64_t)m * q->groups + g, q->groups};
                    wide_any(x + (int64_t)m * x_stride + k0 + c0, x_stride, wide, kc,
                             M - m < WIDE_ROWS ? M - m : WIDE_ROWS, c0 == 0, &end,
                             part + (int64_t)m * TILE, acc + (int64_t)m * TILE);
                }
            }
        }
        at = codes + code_bytes(q->kind, rows);
    }
}

/* One output row's `width` columns from its float32 sums, plus the bias, in the output dtype. */
static void store_row(const float *acc, const float *bias, int width, int y_f32, void *y) {
#ifdef __AVX512F__
    store_scaled_row(acc, 1.0f, bias, width, y_f32, y);
#else
    if (y_f32) {
        for (int j = 0; j < width; j++) ((float *)y)[j] = bias ? acc[j] + bias[j] : acc[j];
        return;
    }
    for (int j = 0; j < width; j++)
        ((uint16_t *)y)[j] = float_to_bf16(bias ? acc[j] + bias[j] : acc[j]);
#endif
}

static int valid_shape(int kind, int group, int M, int N, int K) {
    if (kind != QUANT_INT8 && kind != QUANT_UINT4 && kind != QUANT_FP8_E4M3) return 0;
    /* A uint4 byte holds two k-rows of one group. */
    if (group <= 0 || (kind == QUANT_UINT4 && group % 2)) return 0;
    return M >= 0 && N > 0 && K > 0;
}

int pdserve_quantized_tile_bytes(int kind, int group_size, int has_offsets, int K) {
    if (quads_kind(kind))
        return pdserve_quantized_quads_tile_bytes(kind, group_size, has_offsets, K);
    if (!valid_shape(kind, group_size, 0, 1, K)) return -1;
    return (int)tile_bytes(kind, has_offsets != 0, group_size, K);
}

int pdserve_quantized_linear(const void *x, int64_t x_stride, const uint8_t *packed, int kind,
                             int group_size, int has_offsets, const float *bias, void *y,
                             int64_t y_stride, int io_dtype, int M, int N, int K,
                             int num_threads) {
    if (quads_kind(kind))
        return pdserve_quantized_quads_linear(x, x_stride, packed, kind, group_size, has_offsets,
                                              bias, y, y_stride, io_dtype, M, N, K, num_threads);
    if (!valid_shape(kind, group_size, M, N, K) || (io_dtype != KV_F32 && io_dtype != KV_BF16))
        return -2;
    if (M == 0) return 0;
    const quantized_shape q = {packed, kind, group_size, has_offsets != 0, K,
                               (K + group_size - 1) / group_size};
    const int K_pad = padded_k(kind, K);
    const int64_t stride_bytes = tile_bytes(kind, q.has_offsets, group_size, K);
    const int num_tiles = (N + TILE - 1) / TILE;
    /* Up to DIRECT_ROWS rows, TILES_FOR(M) tiles run side by side (direct_block). */
    const int per_block = M <= DIRECT_ROWS ? TILES_FOR(M) : 1;
    const int num_blocks = (num_tiles + per_block - 1) / per_block;
    const int io_f32 = io_dtype == KV_F32;
    const size_t out_size = io_f32 ? sizeof(float) : sizeof(uint16_t);
    /* x widened once into float32 rows of K_pad (zeros past K), beside each row's group sums:
     * every tile reads all of them. */
    float *x32 = malloc(((size_t)M * K_pad + (size_t)M * q.groups) * sizeof(float));
    if (!x32) return -1;
    float *xsum = x32 + (size_t)M * K_pad;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
#pragma omp for schedule(static)
        for (int m = 0; m < M; m++) {
            float *row = x32 + (int64_t)m * K_pad;
            if (io_f32)
                memcpy(row, (const float *)x + m * x_stride, (size_t)K * sizeof(float));
            else
                for (int k = 0; k < K; k++)
                    row[k] = bf16_to_float(((const uint16_t *)x)[m * x_stride + k]);
            for (int k = K; k < K_pad; k++) row[k] = 0.0f;
            if (q.has_offsets)
                for (int g = 0; g < q.groups; g++) {
                    const int k0 = g * group_size;
                    const int n = K_pad - k0 < group_size ? K_pad - k0 : group_size;
                    xsum[(int64_t)m * q.groups + g] = group_sum(row + k0, n);
                }
        }
        const size_t scratch = ((per_block + 1) * (size_t)M + CHUNK_K) * TILE * sizeof(float);
        float *acc = aligned_alloc(64, scratch);
        if (!acc) {
#pragma omp atomic write
            failed = 1;
        }
        float *part = acc + (size_t)per_block * M * TILE;
        float *wide = part + (size_t)M * TILE;
#pragma omp for schedule(static)
        for (int b = 0; b < num_blocks; b++) {
            if (!acc) continue;
            const int t0 = b * per_block;
            const int nt = num_tiles - t0 < per_block ? num_tiles - t0 : per_block;
            if (nt == per_block)
                tile_sums(&q, packed + t0 * stride_bytes, stride_bytes, nt, x32, K_pad, xsum, M,
                          acc, part, wide);
            else
                for (int t = 0; t < nt; t++)
                    tile_sums(&q, packed + (t0 + t) * stride_bytes, stride_bytes, 1, x32, K_pad,
                              xsum, M, acc + (int64_t)t * M * TILE, part, wide);
            for (int t = 0; t < nt; t++) {
                const int n0 = (t0 + t) * TILE;
                const int width = N - n0 < TILE ? N - n0 : TILE;
                for (int m = 0; m < M; m++)
                    store_row(acc + ((int64_t)t * M + m) * TILE, bias ? bias + n0 : NULL, width,
                              io_f32, (char *)y + ((int64_t)m * y_stride + n0) * out_size);
            }
        }
        free(acc);
    }
    free(x32);
    return failed ? -1 : 0;
}

/* out: the [N, K] weight (or, transposed, [K, N]) in float32 or bf16 (out_dtype), each weight
 * scale * code - offset in float32, rounded once. */
int pdserve_quantized_dequantize(const uint8_t *packed, int kind, int group_size,
                                 int has_offsets, void *out, int out_dtype, int transposed,
                                 int N, int K, int num_threads) {
    if (quads_kind(kind))
        return pdserve_quantized_quads_dequantize(packed, kind, group_size, has_offsets, out,
                                                  out_dtype, transposed, N, K, num_threads);
    if (!valid_shape(kind, group_size, 0, N, K) || (out_dtype != KV_F32 && out_dtype != KV_BF16))
        return -2;
    const int groups = (K + group_size - 1) / group_size;
    const int K_pad = padded_k(kind, K);
    const int64_t header = (int64_t)TILE * (1 + (has_offsets != 0));
    const int64_t stride_bytes = tile_bytes(kind, has_offsets != 0, group_size, K);
    const int num_tiles = (N + TILE - 1) / TILE;
#ifdef __AVX512F__
    const int streamed =
        transposed && out_dtype == KV_F32 && N % 16 == 0 && ((uintptr_t)out & 63) == 0;
#endif
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        float *wide = aligned_alloc(64, CHUNK_K * TILE * sizeof(float));
        if (!wide) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int t = 0; t < num_tiles; t++) {
            if (!wide) continue;
            const int n0 = t * TILE;
            const int width = N - n0 < TILE ? N - n0 : TILE;
            const uint8_t *at = packed + t * stride_bytes;
            for (int g = 0; g < groups; g++) {
                const int k0 = g * group_size;
                const int rows = K_pad - k0 < group_size ? K_pad - k0 : group_size;
                const float *scales = (const float *)at;
                const float *offsets = has_offsets ? scales + TILE : NULL;
                const uint8_t *codes = (const uint8_t *)(scales + header);
                for (int c0 = 0; c0 < rows; c0 += CHUNK_K) {
                    const int kc = rows - c0 < CHUNK_K ? rows - c0 : CHUNK_K;
                    decode_chunk(kind, codes + code_bytes(kind, c0), kc, wide);
#ifdef __AVX512F__
                    /* What the float32 BLAS reads, whole tiles as rows of the [K, N] weight,
                     * written past the caches where every row is aligned: a weight larger than
                     * them is written at memory speed, and not read first. */
                    if (streamed && width == TILE) {
                        for (int k = 0; k < kc && k0 + c0 + k < K; k++) {
                            float *row = (float *)out + (int64_t)(k0 + c0 + k) * N + n0;
                            for (int v = 0; v < TILE / 16; v++) {
                                const __m512 code = _mm512_loadu_ps(wide + k * TILE + 16 * v);
                                __m512 w = _mm512_mul_ps(_mm512_loadu_ps(scales + 16 * v), code);
                                if (offsets)
                                    w = _mm512_sub_ps(w, _mm512_loadu_ps(offsets + 16 * v));
                                _mm512_stream_ps(row + 16 * v, w);
                            }
                        }
                        continue;
                    }
#endif
                    for (int k = 0; k < kc && k0 + c0 + k < K; k++)
                        for (int j = 0; j < width; j++)
                            put_weight(out, out_dtype == KV_F32, transposed, N, K, n0 + j,
                                       k0 + c0 + k,
                                       scales[j] * wide[k * TILE + j] -
                                           (offsets ? offsets[j] : 0.0f));
                }
                at = codes + code_bytes(kind, rows);
            }
        }
        free(wide);
#ifdef __AVX512F__
        /* The streamed stores seen by every thread before the BLAS reads them. */
        _mm_sfence();
#endif
    }
    return failed ? -1 : 0;
}
