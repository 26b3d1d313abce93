/* y = x W^T (+ bias) with bf16 weights, float32 arithmetic, bf16 activations in and out.
 *
 * The weight is prepacked once into tiles of TILE output columns, each tile [K, TILE]
 * contiguous (see kernels/cpu_linear.py), so a tile is one sequential stream. Every weight
 * value is widened to float32 as it is read (a 16-bit shift: exact) and multiplied with float32
 * FMAs, so the products are exact and the sums float32; the result is rounded to bf16 (to
 * nearest even) once. A tile is read from memory once and then serves every row of x while it
 * sits in cache: a decode step streams half the bytes of fp32 weights, a prefill chunk runs at
 * the FMA rate. The summation order of an output depends only on K, never on the row count.
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

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
/* k-rows of a tile widened to float32 at a time: 16 KB, so they stay in L1 while every row
 * pair of the block runs over them. */
#define CHUNK_K 128

/* Eight bf16 weights widened to float32 (exact: a 16-bit shift). */
static inline __attribute__((always_inline)) __m256 widen8(const uint16_t *w) {
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)w)), 16));
}

/* acc[0..n) += x[r][k] * wide[k][j] over `kc` k-rows, for `n` (1 or 2) rows: AVX2 has 16
 * registers and a row's 32 columns take four, so two rows stay in registers beside the four
 * weight vectors. Each output still sums its k in order: the chunks only split the loop. */
static inline __attribute__((always_inline)) void chunk_pair(const float *x, int64_t x_stride,
                                                             const float *wide, int kc,
                                                             const int n, float *acc0,
                                                             float *acc1) {
    __m256 a[2][4];
    for (int i = 0; i < 4; i++) {
        a[0][i] = _mm256_loadu_ps(acc0 + 8 * i);
        if (n == 2) a[1][i] = _mm256_loadu_ps(acc1 + 8 * i);
    }
    for (int k = 0; k < kc; k++) {
        const float *w = wide + k * TILE;
        const __m256 w0 = _mm256_load_ps(w), w1 = _mm256_load_ps(w + 8);
        const __m256 w2 = _mm256_load_ps(w + 16), w3 = _mm256_load_ps(w + 24);
#pragma GCC unroll 2
        for (int r = 0; r < n; r++) {
            const __m256 xv = _mm256_set1_ps(x[r * x_stride + k]);
            a[r][0] = _mm256_fmadd_ps(xv, w0, a[r][0]);
            a[r][1] = _mm256_fmadd_ps(xv, w1, a[r][1]);
            a[r][2] = _mm256_fmadd_ps(xv, w2, a[r][2]);
            a[r][3] = _mm256_fmadd_ps(xv, w3, a[r][3]);
        }
    }
    for (int i = 0; i < 4; i++) {
        _mm256_storeu_ps(acc0 + 8 * i, a[0][i]);
        if (n == 2) _mm256_storeu_ps(acc1 + 8 * i, a[1][i]);
    }
}
#endif

/* acc[r][j] = sum_k x[r][k] * tile[k][j] for `rows` rows (a compile-time count after
 * inlining, so the accumulators stay in registers). */
static inline __attribute__((always_inline)) void tile_rows(const float *x, int64_t x_stride,
                                                            const uint16_t *tile, int K,
                                                            const int rows,
                                                            float acc[ROW_BLOCK][TILE]) {
#ifdef __AVX512F__
    __m512 lo[ROW_BLOCK], hi[ROW_BLOCK];
#pragma GCC unroll 8
    for (int r = 0; r < rows; r++) lo[r] = hi[r] = _mm512_setzero_ps();
    for (int k = 0; k < K; k++) {
        const uint16_t *w = tile + (int64_t)k * TILE;
        _mm_prefetch((const char *)(w + PREFETCH_K * TILE), _MM_HINT_T0);
        _mm_prefetch((const char *)(w + 8 * PREFETCH_K * TILE), _MM_HINT_T1);
        const __m512 w_lo = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)w)), 16));
        const __m512 w_hi = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(w + 16))), 16));
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
#elif defined(__AVX2__) && defined(__FMA__)
    /* A chunk of the tile is widened once, then every pair of rows runs over it from L1. */
    float wide[CHUNK_K * TILE] __attribute__((aligned(32)));
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < TILE; j++) acc[r][j] = 0.0f;
    for (int k0 = 0; k0 < K; k0 += CHUNK_K) {
        const int kc = K - k0 < CHUNK_K ? K - k0 : CHUNK_K;
        for (int k = 0; k < kc; k++) {
            const uint16_t *w = tile + (int64_t)(k0 + k) * TILE;
            _mm_prefetch((const char *)(w + PREFETCH_K * TILE), _MM_HINT_T0);
            _mm_prefetch((const char *)(w + 8 * PREFETCH_K * TILE), _MM_HINT_T1);
            for (int i = 0; i < 4; i++) _mm256_store_ps(wide + k * TILE + 8 * i, widen8(w + 8 * i));
        }
        const float *xk = x + k0;
        for (int r = 0; r + 1 < rows; r += 2)
            chunk_pair(xk + r * x_stride, x_stride, wide, kc, 2, acc[r], acc[r + 1]);
        if (rows & 1) chunk_pair(xk + (rows - 1) * x_stride, x_stride, wide, kc, 1, acc[rows - 1], 0);
    }
#else
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < TILE; j++) acc[r][j] = 0.0f;
    for (int k = 0; k < K; k++) {
        float w[TILE];
        for (int j = 0; j < TILE; j++) w[j] = bf16_to_float(tile[(int64_t)k * TILE + j]);
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
        tile_rows(x, x_stride, tile, K, n, acc);                                               \
        break;

static void tile_any_rows(const float *x, int64_t x_stride, const uint16_t *tile, int K,
                          int rows, float acc[ROW_BLOCK][TILE]) {
    switch (rows) {
        ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4)
        ROWS_CASE(5) ROWS_CASE(6) ROWS_CASE(7) ROWS_CASE(8)
    }
}

/* x: [M, K] bf16, rows x_stride elements apart; packed: [ceil(N / TILE), K, TILE] bf16 (columns
 * past N zero); bias: [N] float32 or NULL; y: [M, N] bf16, rows y_stride elements apart.
 * Returns 0, or -1 if scratch memory could not be had. */
int pdserve_linear_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *packed,
                        const float *bias, uint16_t *y, int64_t y_stride, int M, int N, int K,
                        int num_threads) {
    /* x widened once: every tile reads all of it. */
    float *x32 = malloc((size_t)M * K * sizeof(float));
    if (!x32) return -1;
    for (int m = 0; m < M; m++)
        for (int k = 0; k < K; k++) x32[(int64_t)m * K + k] = bf16_to_float(x[m * x_stride + k]);

    const int num_tiles = (N + TILE - 1) / TILE;
#pragma omp parallel for num_threads(num_threads) if (num_threads > 1) schedule(static)
    for (int t = 0; t < num_tiles; t++) {
        const uint16_t *tile = packed + (int64_t)t * K * TILE;
        const int n0 = t * TILE;
        const int width = N - n0 < TILE ? N - n0 : TILE;
        float acc[ROW_BLOCK][TILE];
        for (int m0 = 0; m0 < M; m0 += ROW_BLOCK) {
            const int rows = M - m0 < ROW_BLOCK ? M - m0 : ROW_BLOCK;
            tile_any_rows(x32 + (int64_t)m0 * K, K, tile, K, rows, acc);
            for (int r = 0; r < rows; r++) {
                uint16_t *yr = y + (int64_t)(m0 + r) * y_stride + n0;
                for (int j = 0; j < width; j++)
                    yr[j] = float_to_bf16(bias ? acc[r][j] + bias[n0 + j] : acc[r][j]);
            }
        }
    }
    free(x32);
    return 0;
}
