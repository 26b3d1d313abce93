/* y = x W^T (+ bias) over weights prepacked in tiles: bf16 or float32 weights, float32 sums.
 *
 * The weight is prepacked once into tiles of TILE output columns, each tile [K, TILE]
 * contiguous (see kernels/cpu_linear.py), so a tile is one sequential stream. bf16 weights are
 * widened to float32 as they are read (a 16-bit shift: exact), and every product is a float32
 * FMA. The result is rounded to the output dtype once. A tile is read from memory once and then
 * serves every row of x while it sits in cache: a decode step streams the weights at memory
 * speed, a prefill chunk runs at the FMA rate.
 *
 * Every output is summed in one order: acc = 0, then acc = fma(x[k], w[k], acc) for k = 0, 1,
 * ..., K - 1. However the rows are blocked (one row, two, six, eight) and however many rows a
 * call has, a row's outputs are the same bits: a sequence's tokens do not depend on the batch.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "numerics.h"
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#define TILE 32
#define ROW_BLOCK 8
/* Weight rows fetched ahead of use, into L1 and, eight times further ahead, into L2: the stream
 * crosses tiles, which no prefetcher knows, and one core needs many lines in flight to read
 * memory at full speed. */
#define PREFETCH_K 64

/* Weight (k, j) of a tile as float32. */
static inline float tile_weight(const void *tile, int f32, int64_t k, int j) {
    return f32 ? ((const float *)tile)[k * TILE + j]
               : bf16_to_float(((const uint16_t *)tile)[k * TILE + j]);
}

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define HAVE_AVX2_TILES 1
/* k-rows of a tile widened to float32 at a time: 16 KB, so they stay in L1 while every row of x
 * runs over them. */
#define CHUNK_K 128
/* Rows per register block: six rows of 16 columns take 12 of AVX2's 16 registers, beside two
 * weight vectors and a broadcast, for 12 FMAs per 8 loads. */
#define MICRO_ROWS 6

/* Eight bf16 weights widened to float32 (exact: a 16-bit shift). */
static inline __attribute__((always_inline)) __m256 widen8(const uint16_t *w) {
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)w)), 16));
}

/* acc[r][0..16) += x[r][k] * wide[k][0..16) over `kc` k-rows, for `n` <= MICRO_ROWS rows (a
 * constant after inlining, so the accumulators stay in registers). */
static inline __attribute__((always_inline)) void micro_block(const float *x, int64_t x_stride,
                                                              const float *wide, int kc,
                                                              const int n, float *acc) {
    __m256 a[MICRO_ROWS][2];
    for (int r = 0; r < n; r++) {
        a[r][0] = _mm256_loadu_ps(acc + r * TILE);
        a[r][1] = _mm256_loadu_ps(acc + r * TILE + 8);
    }
    for (int k = 0; k < kc; k++) {
        const __m256 w0 = _mm256_load_ps(wide + k * TILE), w1 = _mm256_load_ps(wide + k * TILE + 8);
#pragma GCC unroll 6
        for (int r = 0; r < n; r++) {
            const __m256 xv = _mm256_broadcast_ss(x + r * x_stride + k);
            a[r][0] = _mm256_fmadd_ps(xv, w0, a[r][0]);
            a[r][1] = _mm256_fmadd_ps(xv, w1, a[r][1]);
        }
    }
    for (int r = 0; r < n; r++) {
        _mm256_storeu_ps(acc + r * TILE, a[r][0]);
        _mm256_storeu_ps(acc + r * TILE + 8, a[r][1]);
    }
}

#define MICRO_CASE(count)                                                                      \
    case count:                                                                                \
        micro_block(x, x_stride, wide, kc, count, acc);                                        \
        break;

static void micro_any(const float *x, int64_t x_stride, const float *wide, int kc, int n,
                      float *acc) {
    switch (n) { MICRO_CASE(1) MICRO_CASE(2) MICRO_CASE(3) MICRO_CASE(4) MICRO_CASE(5) MICRO_CASE(6) }
}
#undef MICRO_CASE

/* acc[m][j] = sum_k x[m][k] * tile[k][j] for all M rows: a chunk of the tile is widened into L1
 * once, then every row of x runs over it, six at a time, in two halves of 16 columns. */
static void tile_all_rows(const float *x, int64_t x_stride, const void *tile, int f32, int K,
                          int M, float *acc) {
    float wide[CHUNK_K * TILE] __attribute__((aligned(32)));
    memset(acc, 0, (size_t)M * TILE * sizeof(float));
    for (int k0 = 0; k0 < K; k0 += CHUNK_K) {
        const int kc = K - k0 < CHUNK_K ? K - k0 : CHUNK_K;
        for (int k = 0; k < kc; k++) {
            float *dst = wide + k * TILE;
            if (f32) {
                const float *w = (const float *)tile + (int64_t)(k0 + k) * TILE;
                _mm_prefetch((const char *)(w + PREFETCH_K * TILE), _MM_HINT_T0);
                _mm_prefetch((const char *)(w + PREFETCH_K * TILE + 16), _MM_HINT_T0);
                _mm_prefetch((const char *)(w + 8 * PREFETCH_K * TILE), _MM_HINT_T1);
                _mm_prefetch((const char *)(w + 8 * PREFETCH_K * TILE + 16), _MM_HINT_T1);
                for (int i = 0; i < 4; i++) _mm256_store_ps(dst + 8 * i, _mm256_loadu_ps(w + 8 * i));
            } else {
                const uint16_t *w = (const uint16_t *)tile + (int64_t)(k0 + k) * TILE;
                _mm_prefetch((const char *)(w + PREFETCH_K * TILE), _MM_HINT_T0);
                _mm_prefetch((const char *)(w + 8 * PREFETCH_K * TILE), _MM_HINT_T1);
                for (int i = 0; i < 4; i++) _mm256_store_ps(dst + 8 * i, widen8(w + 8 * i));
            }
        }
        for (int m = 0; m < M; m += MICRO_ROWS) {
            const int n = M - m < MICRO_ROWS ? M - m : MICRO_ROWS;
            for (int half = 0; half < 2; half++)
                micro_any(x + m * x_stride + k0, x_stride, wide + 16 * half, kc, n,
                          acc + (int64_t)m * TILE + 16 * half);
        }
    }
}
#endif

/* acc[r][j] = sum_k x[r][k] * tile[k][j] for `rows` <= ROW_BLOCK rows (a compile-time count
 * after inlining, so the accumulators stay in registers). */
static inline __attribute__((always_inline)) void tile_rows(const float *x, int64_t x_stride,
                                                            const void *tile, int f32, int K,
                                                            const int rows,
                                                            float acc[ROW_BLOCK][TILE]) {
#ifdef __AVX512F__
    __m512 lo[ROW_BLOCK], hi[ROW_BLOCK];
#pragma GCC unroll 8
    for (int r = 0; r < rows; r++) lo[r] = hi[r] = _mm512_setzero_ps();
    for (int k = 0; k < K; k++) {
        __m512 w_lo, w_hi;
        if (f32) {
            const float *w = (const float *)tile + (int64_t)k * TILE;
            _mm_prefetch((const char *)(w + PREFETCH_K * TILE), _MM_HINT_T0);
            _mm_prefetch((const char *)(w + PREFETCH_K * TILE + 16), _MM_HINT_T0);
            _mm_prefetch((const char *)(w + 8 * PREFETCH_K * TILE), _MM_HINT_T1);
            _mm_prefetch((const char *)(w + 8 * PREFETCH_K * TILE + 16), _MM_HINT_T1);
            w_lo = _mm512_loadu_ps(w);
            w_hi = _mm512_loadu_ps(w + 16);
        } else {
            const uint16_t *w = (const uint16_t *)tile + (int64_t)k * TILE;
            _mm_prefetch((const char *)(w + PREFETCH_K * TILE), _MM_HINT_T0);
            _mm_prefetch((const char *)(w + 8 * PREFETCH_K * TILE), _MM_HINT_T1);
            w_lo = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)w)), 16));
            w_hi = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(w + 16))), 16));
        }
#pragma GCC unroll 8
        for (int r = 0; r < rows; r++) {
            const __m512 xv = _mm512_set1_ps(x[r * x_stride + k]);
            lo[r] = _mm512_fmadd_ps(xv, w_lo, lo[r]);
            hi[r] = _mm512_fmadd_ps(xv, w_hi, hi[r]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < rows; r++) {
        _mm512_storeu_ps(acc[r], lo[r]);
        _mm512_storeu_ps(acc[r] + 16, hi[r]);
    }
#else
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < TILE; j++) acc[r][j] = 0.0f;
    for (int k = 0; k < K; k++) {
        float w[TILE];
        for (int j = 0; j < TILE; j++) w[j] = tile_weight(tile, f32, k, j);
        for (int r = 0; r < rows; r++) {
            const float xv = x[r * x_stride + k];
#pragma omp simd
            for (int j = 0; j < TILE; j++) acc[r][j] += xv * w[j];
        }
    }
#endif
}

#define ROWS_CASE(n)                                                                           \
    case n:                                                                                    \
        tile_rows(x, x_stride, tile, f32, K, n, acc);                                          \
        break;

static void tile_any_rows(const float *x, int64_t x_stride, const void *tile, int f32, int K,
                          int rows, float acc[ROW_BLOCK][TILE]) {
    switch (rows) {
        ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4)
        ROWS_CASE(5) ROWS_CASE(6) ROWS_CASE(7) ROWS_CASE(8)
    }
}
#undef ROWS_CASE

/* One output row's `width` columns from its float32 sums, plus the bias, in the output dtype. */
static inline void store_outputs(const float *acc, const float *bias, int width, int y_f32,
                                 void *y) {
    for (int j = 0; j < width; j++) {
        const float value = bias ? acc[j] + bias[j] : acc[j];
        if (y_f32)
            ((float *)y)[j] = value;
        else
            ((uint16_t *)y)[j] = float_to_bf16(value);
    }
}

/* x: [M, K] float32, rows x_stride elements apart; packed: [ceil(N / TILE), K, TILE] of float32
 * (f32) or bf16, columns past N zero; bias: [N] float32 or NULL; y: [M, N] of float32 (y_f32)
 * or bf16, rows y_stride elements apart. Returns 0, or -1 if scratch memory could not be had. */
static int linear_tiles(const float *x, int64_t x_stride, const void *packed, int f32,
                        const float *bias, void *y, int y_f32, int64_t y_stride, int M, int N,
                        int K, int num_threads) {
    const int num_tiles = (N + TILE - 1) / TILE;
    const size_t weight_size = f32 ? sizeof(float) : sizeof(uint16_t);
    const size_t out_size = y_f32 ? sizeof(float) : sizeof(uint16_t);
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
#ifdef HAVE_AVX2_TILES
        float *acc = malloc((size_t)M * TILE * sizeof(float));
        if (!acc) {
#pragma omp atomic write
            failed = 1;
        }
#endif
#pragma omp for schedule(static)
        for (int t = 0; t < num_tiles; t++) {
            const void *tile = (const char *)packed + (int64_t)t * K * TILE * weight_size;
            const int n0 = t * TILE;
            const int width = N - n0 < TILE ? N - n0 : TILE;
            const float *tile_bias = bias ? bias + n0 : NULL;
#ifdef HAVE_AVX2_TILES
            if (!acc) continue;
            tile_all_rows(x, x_stride, tile, f32, K, M, acc);
            for (int m = 0; m < M; m++)
                store_outputs(acc + (int64_t)m * TILE, tile_bias, width, y_f32,
                              (char *)y + ((int64_t)m * y_stride + n0) * out_size);
#else
            float acc[ROW_BLOCK][TILE];
            for (int m0 = 0; m0 < M; m0 += ROW_BLOCK) {
                const int rows = M - m0 < ROW_BLOCK ? M - m0 : ROW_BLOCK;
                tile_any_rows(x + (int64_t)m0 * x_stride, x_stride, tile, f32, K, rows, acc);
                for (int r = 0; r < rows; r++)
                    store_outputs(acc[r], tile_bias, width, y_f32,
                                  (char *)y + ((int64_t)(m0 + r) * y_stride + n0) * out_size);
            }
#endif
        }
#ifdef HAVE_AVX2_TILES
        free(acc);
#endif
    }
    return failed ? -1 : 0;
}

/* bf16 in and out, bf16 weights. x: [M, K] bf16, rows x_stride elements apart; y: [M, N] bf16. */
int pdserve_linear_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *packed,
                        const float *bias, uint16_t *y, int64_t y_stride, int M, int N, int K,
                        int num_threads) {
    /* x widened once: every tile reads all of it. */
    float *x32 = malloc((size_t)M * K * sizeof(float));
    if (!x32) return -1;
    for (int m = 0; m < M; m++)
        for (int k = 0; k < K; k++) x32[(int64_t)m * K + k] = bf16_to_float(x[m * x_stride + k]);
    const int status = linear_tiles(x32, K, packed, 0, bias, y, 0, y_stride, M, N, K, num_threads);
    free(x32);
    return status;
}

/* float32 in and out, float32 weights; x and y as in pdserve_linear_bf16. */
int pdserve_linear_f32(const float *x, int64_t x_stride, const float *packed, const float *bias,
                       float *y, int64_t y_stride, int M, int N, int K, int num_threads) {
    return linear_tiles(x, x_stride, packed, 1, bias, y, 1, y_stride, M, N, K, num_threads);
}
