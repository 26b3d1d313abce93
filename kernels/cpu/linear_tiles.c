/* y = x W^T (+ bias) over weights prepacked in tiles: bf16 or float32 weights, float32 sums.
 *
 * The weight is prepacked once into tiles of TILE output columns, each tile [K, TILE]
 * contiguous (see kernels/cpu/linear.py), so a tile is one sequential stream. bf16 weights are
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

#include "exports.h"
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
/* Each output is one dependent chain of FMAs (its fixed summation order), and an FMA takes four
 * cycles on each of two ports, so the FMA units are busy only with eight or more chains in
 * flight; AVX2 has 16 registers; and widening bf16 weights costs vector instructions beside the
 * FMAs (one per eight weights: a shift or a mask, see weight16), so a widened vector should serve
 * several rows. The register blocks, by row count (measured on a Zen 3 core, SmolLM2's shapes):
 * - one row runs over two tiles at once: 8 chains (one_row_two_tiles);
 * - two rows over all 32 columns of the tile as it is read: 8 chains (pair_block);
 * - up to STREAM_MAX_ROWS rows, up to six rows at a time over 16 columns as they are read: up
 *   to 12 chains, each widened vector feeding a FMA per row (stream_block; rows spread evenly
 *   over the blocks, 8 rows as 4 + 4);
 * - more rows widen a chunk of the tile into L1 once, then run six rows over 16 columns at a
 *   time (six_row_block): the same blocks from float32 copies, which only pays when many rows
 *   share a chunk (beyond 32 rows the two are even). */
#define STREAM_MAX_ROWS 32
#define PAIR_ROWS 2
#define STREAM_ROWS 6
#define SIX_ROWS 6
/* k-rows of a tile worked on at a time: 16 KB widened, so they stay in L1 while every row of x
 * runs over them. */
#define CHUNK_K 128

/* Sixteen columns of k-row `k` of a tile (`tile` points at the first of them) as two float32
 * vectors: columns 0-7 in `lo`, 8-15 in `hi`. A bf16 tile stores each 16 columns as eight 32-bit
 * words, word i holding column i in its low half and column i + 8 in its high half (see
 * pdserve_bf16_tile_order), so a shift widens the first eight and a mask the other eight, both
 * exactly and neither on a shuffle port: two cheap instructions per sixteen weights. */
static inline __attribute__((always_inline)) void weight16(const void *tile, const int f32,
                                                           int64_t k, __m256 *lo, __m256 *hi) {
    if (f32) {
        *lo = _mm256_loadu_ps((const float *)tile + k * TILE);
        *hi = _mm256_loadu_ps((const float *)tile + k * TILE + 8);
        return;
    }
    const __m256i words = _mm256_loadu_si256((const __m256i *)((const uint16_t *)tile + k * TILE));
    *lo = _mm256_castsi256_ps(_mm256_slli_epi32(words, 16));
    *hi = _mm256_and_ps(_mm256_castsi256_ps(words),
                        _mm256_castsi256_ps(_mm256_set1_epi32((int)0xFFFF0000u)));
}

/* `tile` advanced by `columns` columns of its dtype. */
static inline __attribute__((always_inline)) const void *tile_columns(const void *tile,
                                                                      const int f32,
                                                                      int columns) {
    return (const char *)tile + columns * (f32 ? 4 : 2);
}

/* k-row `k` + PREFETCH_K of a tile into L1, and the row eight times further into L2. */
static inline __attribute__((always_inline)) void prefetch_row(const void *tile, const int f32,
                                                               int64_t k) {
    const int64_t row_bytes = TILE * (f32 ? 4 : 2);
    const char *near = (const char *)tile + (k + PREFETCH_K) * row_bytes;
    const char *far = (const char *)tile + (k + 8 * PREFETCH_K) * row_bytes;
    _mm_prefetch(near, _MM_HINT_T0);
    _mm_prefetch(far, _MM_HINT_T1);
    if (f32) {
        _mm_prefetch(near + 64, _MM_HINT_T0);
        _mm_prefetch(far + 64, _MM_HINT_T1);
    }
}

/* acc[r][0..32) += x[r][k] * tile[k][0..32) over `kc` k-rows, for `n` <= PAIR_ROWS rows (a
 * constant after inlining, so the accumulators stay in registers). `prefetch`: the tile is
 * coming from memory. */
static inline __attribute__((always_inline)) void pair_block(const float *x, int64_t x_stride,
                                                             const void *tile, const int f32,
                                                             int kc, const int n,
                                                             const int prefetch, float *acc) {
    __m256 a[PAIR_ROWS][4];
    for (int r = 0; r < n; r++)
        for (int c = 0; c < 4; c++) a[r][c] = _mm256_loadu_ps(acc + r * TILE + 8 * c);
    for (int k = 0; k < kc; k++) {
        if (prefetch) prefetch_row(tile, f32, k);
        __m256 xv[PAIR_ROWS];
        for (int r = 0; r < n; r++) xv[r] = _mm256_broadcast_ss(x + r * x_stride + k);
        for (int half = 0; half < 2; half++) {
            __m256 w0, w1;
            weight16(tile_columns(tile, f32, 16 * half), f32, k, &w0, &w1);
            for (int r = 0; r < n; r++) {
                a[r][2 * half] = _mm256_fmadd_ps(xv[r], w0, a[r][2 * half]);
                a[r][2 * half + 1] = _mm256_fmadd_ps(xv[r], w1, a[r][2 * half + 1]);
            }
        }
    }
    for (int r = 0; r < n; r++)
        for (int c = 0; c < 4; c++) _mm256_storeu_ps(acc + r * TILE + 8 * c, a[r][c]);
}

#define PAIR_CASE(rows, is_f32)                                                                \
    case 2 * rows + is_f32:                                                                    \
        pair_block(x, x_stride, tile, is_f32, kc, rows, prefetch, acc);                        \
        break;

static void pair_any(const float *x, int64_t x_stride, const void *tile, int f32, int kc, int n,
                     int prefetch, float *acc) {
    switch (2 * n + f32) { PAIR_CASE(1, 0) PAIR_CASE(1, 1) PAIR_CASE(2, 0) PAIR_CASE(2, 1) }
}
#undef PAIR_CASE

/* acc[r][0..16) += x[r][k] * tile[k][0..16) over `kc` k-rows of half a tile (`tile` points at
 * its first column), for `n` <= STREAM_ROWS rows. */
static inline __attribute__((always_inline)) void stream_block(const float *x, int64_t x_stride,
                                                               const void *tile, const int f32,
                                                               int kc, const int n,
                                                               const int prefetch, float *acc) {
    __m256 a[STREAM_ROWS][2];
    for (int r = 0; r < n; r++)
        for (int c = 0; c < 2; c++) a[r][c] = _mm256_loadu_ps(acc + r * TILE + 8 * c);
    for (int k = 0; k < kc; k++) {
        if (prefetch) prefetch_row(tile, f32, k);
        __m256 w0, w1;
        weight16(tile, f32, k, &w0, &w1);
#pragma GCC unroll 6
        for (int r = 0; r < n; r++) {
            const __m256 xv = _mm256_broadcast_ss(x + r * x_stride + k);
            a[r][0] = _mm256_fmadd_ps(xv, w0, a[r][0]);
            a[r][1] = _mm256_fmadd_ps(xv, w1, a[r][1]);
        }
    }
    for (int r = 0; r < n; r++)
        for (int c = 0; c < 2; c++) _mm256_storeu_ps(acc + r * TILE + 8 * c, a[r][c]);
}

#define STREAM_CASE(rows, is_f32)                                                              \
    case 2 * rows + is_f32:                                                                    \
        stream_block(x, x_stride, tile, is_f32, kc, rows, prefetch, acc);                      \
        break;

static void stream_any(const float *x, int64_t x_stride, const void *tile, int f32, int kc,
                       int n, int prefetch, float *acc) {
    switch (2 * n + f32) {
        STREAM_CASE(1, 0) STREAM_CASE(1, 1) STREAM_CASE(2, 0) STREAM_CASE(2, 1)
        STREAM_CASE(3, 0) STREAM_CASE(3, 1) STREAM_CASE(4, 0) STREAM_CASE(4, 1)
        STREAM_CASE(5, 0) STREAM_CASE(5, 1) STREAM_CASE(6, 0) STREAM_CASE(6, 1)
    }
}
#undef STREAM_CASE

/* acc[r][0..16) += x[r][k] * wide[k][0..16) over `kc` k-rows of a widened chunk, for `n` <=
 * SIX_ROWS rows (a constant after inlining). */
static inline __attribute__((always_inline)) void six_row_block(const float *x, int64_t x_stride,
                                                                const float *wide, int kc,
                                                                const int n, float *acc) {
    __m256 a[SIX_ROWS][2];
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

#define SIX_CASE(rows)                                                                         \
    case rows:                                                                                 \
        six_row_block(x, x_stride, wide, kc, rows, acc);                                       \
        break;

static void six_any(const float *x, int64_t x_stride, const float *wide, int kc, int n,
                    float *acc) {
    switch (n) { SIX_CASE(1) SIX_CASE(2) SIX_CASE(3) SIX_CASE(4) SIX_CASE(5) SIX_CASE(6) }
}
#undef SIX_CASE

/* acc[m][j] = sum_k x[m][k] * tile[k][j] for all M rows, a chunk of k-rows at a time (the sums
 * wait in acc between chunks, so each is still one chain over k). */
static void tile_all_rows(const float *x, int64_t x_stride, const void *tile, int f32, int K,
                          int M, float *acc) {
    memset(acc, 0, (size_t)M * TILE * sizeof(float));
    if (M <= PAIR_ROWS) {
        pair_any(x, x_stride, tile, f32, K, M, 1, acc);
        return;
    }
    float wide[CHUNK_K * TILE] __attribute__((aligned(32)));
    for (int k0 = 0; k0 < K; k0 += CHUNK_K) {
        const int kc = K - k0 < CHUNK_K ? K - k0 : CHUNK_K;
        const void *chunk = (const char *)tile + (int64_t)k0 * TILE * (f32 ? 4 : 2);
        if (M <= STREAM_MAX_ROWS) {
            /* The first block brings the chunk in; the rest find it in L1. */
            for (int m = 0, left = (M + STREAM_ROWS - 1) / STREAM_ROWS, n; m < M; m += n, left--) {
                n = (M - m + left - 1) / left; /* rows spread evenly over the blocks */
                for (int half = 0; half < 2; half++)
                    stream_any(x + m * x_stride + k0, x_stride,
                               tile_columns(chunk, f32, 16 * half), f32, kc, n, m == 0,
                               acc + (int64_t)m * TILE + 16 * half);
            }
            continue;
        }
        for (int k = 0; k < kc; k++) {
            prefetch_row(chunk, f32, k);
            for (int half = 0; half < 2; half++) {
                __m256 w0, w1;
                weight16(tile_columns(chunk, f32, 16 * half), f32, k, &w0, &w1);
                _mm256_store_ps(wide + k * TILE + 16 * half, w0);
                _mm256_store_ps(wide + k * TILE + 16 * half + 8, w1);
            }
        }
        for (int m = 0; m < M; m += SIX_ROWS) {
            const int n = M - m < SIX_ROWS ? M - m : SIX_ROWS;
            for (int half = 0; half < 2; half++)
                six_any(x + m * x_stride + k0, x_stride, wide + 16 * half, kc, n,
                        acc + (int64_t)m * TILE + 16 * half);
        }
    }
}

/* One row of x over two tiles at once: eight chains, where one tile gives only four. */
static inline __attribute__((always_inline)) void one_row_two_tiles(const float *x,
                                                                    const void *tile0,
                                                                    const void *tile1,
                                                                    const int f32, int K,
                                                                    float *acc0, float *acc1) {
    __m256 a0[4], a1[4];
    for (int c = 0; c < 4; c++) a0[c] = a1[c] = _mm256_setzero_ps();
    for (int k = 0; k < K; k++) {
        prefetch_row(tile0, f32, k);
        prefetch_row(tile1, f32, k);
        const __m256 xv = _mm256_broadcast_ss(x + k);
        for (int half = 0; half < 2; half++) {
            __m256 w0, w1, w2, w3;
            weight16(tile_columns(tile0, f32, 16 * half), f32, k, &w0, &w1);
            weight16(tile_columns(tile1, f32, 16 * half), f32, k, &w2, &w3);
            a0[2 * half] = _mm256_fmadd_ps(xv, w0, a0[2 * half]);
            a0[2 * half + 1] = _mm256_fmadd_ps(xv, w1, a0[2 * half + 1]);
            a1[2 * half] = _mm256_fmadd_ps(xv, w2, a1[2 * half]);
            a1[2 * half + 1] = _mm256_fmadd_ps(xv, w3, a1[2 * half + 1]);
        }
    }
    for (int c = 0; c < 4; c++) {
        _mm256_storeu_ps(acc0 + 8 * c, a0[c]);
        _mm256_storeu_ps(acc1 + 8 * c, a1[c]);
    }
}

/* One row over tiles t and t + 1 (or tile t alone, the last one), sums into acc[0..64). */
static void one_row_tile_pair(const float *x, const void *packed, int f32, int K, int t,
                              int num_tiles, float *acc) {
    const size_t tile_bytes = (size_t)K * TILE * (f32 ? 4 : 2);
    const char *tile0 = (const char *)packed + t * tile_bytes;
    if (t + 1 == num_tiles)
        tile_all_rows(x, 0, tile0, f32, K, 1, acc);
    else if (f32)
        one_row_two_tiles(x, tile0, tile0 + tile_bytes, 1, K, acc, acc + TILE);
    else
        one_row_two_tiles(x, tile0, tile0 + tile_bytes, 0, K, acc, acc + TILE);
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
            /* Word i holds column i in its low half and column i + 16 in its high half (see
             * pdserve_bf16_tile_order): a shift and a mask widen them, where widening columns
             * in order takes a shuffle per sixteen, on a port the FMAs need. */
            const __m512i words = _mm512_loadu_si512((const void *)w);
            w_lo = _mm512_castsi512_ps(_mm512_slli_epi32(words, 16));
            w_hi = _mm512_castsi512_ps(
                _mm512_and_si512(words, _mm512_set1_epi32((int)0xFFFF0000u)));
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
#ifdef HAVE_AVX2_TILES
    /* One row runs over two tiles at a time (see one_row_two_tiles). */
    const int group = M == 1 ? 2 : 1;
#endif
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
#ifdef HAVE_AVX2_TILES
        float *acc = malloc((size_t)M * group * TILE * sizeof(float));
        if (!acc) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int t = 0; t < num_tiles; t += group) {
            if (!acc) continue;
            if (group == 2)
                one_row_tile_pair(x, packed, f32, K, t, num_tiles, acc);
            else
                tile_all_rows(x, x_stride,
                              (const char *)packed + (int64_t)t * K * TILE * weight_size, f32, K,
                              M, acc);
            for (int u = t; u < t + group && u < num_tiles; u++) {
                const int n0 = u * TILE;
                for (int m = 0; m < M; m++)
                    store_outputs(acc + ((int64_t)m * group + u - t) * TILE,
                                  bias ? bias + n0 : NULL, N - n0 < TILE ? N - n0 : TILE, y_f32,
                                  (char *)y + ((int64_t)m * y_stride + n0) * out_size);
            }
        }
        free(acc);
#else
#pragma omp for schedule(static)
        for (int t = 0; t < num_tiles; t++) {
            const void *tile = (const char *)packed + (int64_t)t * K * TILE * weight_size;
            const int n0 = t * TILE;
            const int width = N - n0 < TILE ? N - n0 : TILE;
            const float *tile_bias = bias ? bias + n0 : NULL;
            float acc[ROW_BLOCK][TILE];
            for (int m0 = 0; m0 < M; m0 += ROW_BLOCK) {
                const int rows = M - m0 < ROW_BLOCK ? M - m0 : ROW_BLOCK;
                tile_any_rows(x + (int64_t)m0 * x_stride, x_stride, tile, f32, K, rows, acc);
                for (int r = 0; r < rows; r++)
                    store_outputs(acc[r], tile_bias, width, y_f32,
                                  (char *)y + ((int64_t)(m0 + r) * y_stride + n0) * out_size);
            }
        }
#endif
    }
    return failed ? -1 : 0;
}

/* How a bf16 tile orders its columns, for kernels/cpu/linear.py to pack them: 0, in column
 * order (what the portable kernel reads); 1, each 16 columns as eight 32-bit words, word i
 * holding column i in its low half and column i + 8 in its high half (the AVX2 kernel, see
 * weight16); 2, each k-row's 32 columns as sixteen words, word i holding columns i and i + 16
 * (the AVX-512 kernel); 3, k-rows in pairs (bf16_pair_tiles.c), where the processor's bf16
 * units multiply the tiles. */
int pdserve_bf16_tile_order(void) {
    if (pdserve_bf16_tiles() != BF16_TILES_FMA) return 3;
#ifdef HAVE_AVX2_TILES
    return 1;
#elif defined(__AVX512F__)
    return 2;
#else
    return 0;
#endif
}

/* bf16 in and out, bf16 weights. x: [M, K] bf16, rows x_stride elements apart; y: [M, N] bf16. */
int pdserve_linear_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *packed,
                        const float *bias, uint16_t *y, int64_t y_stride, int M, int N, int K,
                        int num_threads) {
    if (pdserve_bf16_tiles() != BF16_TILES_FMA)
        return pdserve_linear_bf16_pairs(x, x_stride, (const uint32_t *)packed, bias, y, y_stride,
                                         M, N, K, num_threads);
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
