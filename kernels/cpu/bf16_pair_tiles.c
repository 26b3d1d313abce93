/* y = x W^T (+ bias) for bf16 x and W on the processor's own bf16 arithmetic: AMX tiles
 * (`tdpbf16ps`) or AVX512_BF16 (`vdpbf16ps`), beside linear_tiles.c's float32 FMAs.
 *
 * Both multiply bf16 values in pairs of k: a product of two bf16 values is exact in float32, and
 * the hardware sums two of them (AVX512_BF16) or sixteen pairs (AMX) into a float32 accumulator
 * per instruction, where the FMA path widens every weight and spends an instruction per product.
 * On a Xeon with AMX one `tdpbf16ps` does the work of 256 AVX-512 FMAs: a decode batch of 32
 * rows, compute-bound on FMAs, becomes a stream over the weights again.
 *
 * The weights are packed as the FMA path's tiles of TILE output columns, but with their k-rows
 * in pairs (kernels/cpu/linear.py, pack_tiles): pair p of a tile is 32 words, word j holding
 * column j's weights of k-rows 2p (low half) and 2p + 1 (high half), the operand both
 * instructions read; K is padded with zero rows to a multiple of PAIR_K_BLOCK (one AMX tile of
 * k). x's rows are copied once into the same pairs, zero-padded alike.
 *
 * Every output is summed in one order whatever the row count: AMX works on blocks of 16 rows,
 * each row's sums its own (rows of a block never mix), over K in blocks of PAIR_K_BLOCK in
 * order; AVX512_BF16 over the pairs in order. So a row's outputs do not depend on the rows
 * beside it, as with the FMA path, and deterministic inference may take either. The hardware
 * treats denormal inputs as zero and flushes denormal sums, and its rounding within a block is
 * its own: each kind is tested against its own twin (tests/test_cpu_kernels.py), and which kind
 * a process runs is chosen once, at load (kernels/cpu/library.py).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "exports.h"
#include "numerics.h"
#if defined(__AVX512BF16__) || defined(__AMX_BF16__)
#include <immintrin.h>
#endif
#ifdef __AMX_BF16__
#include "amx_tiles.h"
#endif

#define TILE 32
/* k of one AMX tile: 16 rows of 64 bytes, 16 pairs of bf16. Must match PAIR_K_BLOCK in
 * kernels/cpu/linear.py. */
#define PAIR_K_BLOCK 32
/* Rows of x an AMX tile holds. */
#define AMX_ROWS 16
/* Floats between rows of a block's sums: room for the two tiles AMX runs at a time. */
#define SUMS_WIDTH (2 * TILE)
/* Rows of x the AVX512_BF16 kernel keeps in registers at a time. */
#define DP_ROWS 8
/* Bytes of weights fetched ahead of use into L1, and eight times further into L2: the stream
 * crosses tiles, which no prefetcher knows, and one core needs many lines in flight to read
 * memory at full speed (as linear_tiles.c's PREFETCH_K). */
#define PREFETCH_BYTES 4096

static int bf16_tiles = BF16_TILES_FMA;

int pdserve_bf16_tiles_available(int kind) {
    switch (kind) {
    case BF16_TILES_FMA:
        return 1;
#ifdef __AVX512BF16__
    case BF16_TILES_DPBF16:
        return 1;
#endif
#ifdef __AMX_BF16__
    case BF16_TILES_AMX:
        return amx_tiles_permitted();
#endif
    default:
        return 0;
    }
}

int pdserve_use_bf16_tiles(int kind) {
    if (!pdserve_bf16_tiles_available(kind)) return -1;
    bf16_tiles = kind;
    return 0;
}

int pdserve_bf16_tiles(void) { return bf16_tiles; }

#ifdef __AMX_BF16__
/* Tiles (configure_tiles): tmm0, tmm1 (tmm5, tmm6) hold the sums of 16 rows by a tile's columns
 * 0-15 and 16-31 (the next tile's), float32; tmm2 16 rows of x by 16 pairs of k; tmm3, tmm4,
 * tmm7 16 pairs of k by 16 columns. */

/* The weights PREFETCH_BYTES past one block of `pairs` into L1, and eight times further into
 * L2. */
static inline void amx_prefetch(const uint32_t *pairs) {
    const char *ahead = (const char *)pairs + PREFETCH_BYTES;
    for (int line = 0; line < PAIR_K_BLOCK / 2 * TILE * 4; line += 64) {
        _mm_prefetch(ahead + line, _MM_HINT_T0);
        _mm_prefetch(ahead + 7 * PREFETCH_BYTES + line, _MM_HINT_T1);
    }
}

/* sums[16][SUMS_WIDTH] = rows of xp (AMX_ROWS rows, `k_padded` bf16 each) by two neighbouring
 * tiles' pairs, `tile` and the one after it: each block of x loaded once serves both, and twice
 * the weights are in flight (a decode step streams them from memory). */
static inline void amx_two_tiles_rows(const uint16_t *xp, int64_t k_padded, const uint32_t *tile,
                                      float *sums) {
    const uint32_t *next = tile + k_padded / 2 * TILE;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(5);
    _tile_zero(6);
    for (int64_t k0 = 0; k0 < k_padded; k0 += PAIR_K_BLOCK) {
        const uint32_t *pairs = tile + k0 / 2 * TILE;
        const uint32_t *next_pairs = next + k0 / 2 * TILE;
        amx_prefetch(pairs);
        amx_prefetch(next_pairs);
        _tile_loadd(2, xp + k0, k_padded * sizeof(uint16_t));
        _tile_loadd(3, pairs, TILE * sizeof(uint32_t));
        _tile_loadd(4, pairs + 16, TILE * sizeof(uint32_t));
        _tile_loadd(7, next_pairs, TILE * sizeof(uint32_t));
        _tile_dpbf16ps(0, 2, 3);
        _tile_dpbf16ps(1, 2, 4);
        _tile_dpbf16ps(5, 2, 7);
        _tile_loadd(3, next_pairs + 16, TILE * sizeof(uint32_t));
        _tile_dpbf16ps(6, 2, 3);
    }
    _tile_stored(0, sums, SUMS_WIDTH * sizeof(float));
    _tile_stored(1, sums + 16, SUMS_WIDTH * sizeof(float));
    _tile_stored(5, sums + TILE, SUMS_WIDTH * sizeof(float));
    _tile_stored(6, sums + TILE + 16, SUMS_WIDTH * sizeof(float));
}

/* The same for one tile (the last of an odd count): sums[16][SUMS_WIDTH]'s first TILE columns. */
static inline void amx_tile_rows(const uint16_t *xp, int64_t k_padded, const uint32_t *tile,
                                 float *sums) {
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t k0 = 0; k0 < k_padded; k0 += PAIR_K_BLOCK) {
        const uint32_t *pairs = tile + k0 / 2 * TILE;
        amx_prefetch(pairs);
        _tile_loadd(2, xp + k0, k_padded * sizeof(uint16_t));
        _tile_loadd(3, pairs, TILE * sizeof(uint32_t));
        _tile_loadd(4, pairs + 16, TILE * sizeof(uint32_t));
        _tile_dpbf16ps(0, 2, 3);
        _tile_dpbf16ps(1, 2, 4);
    }
    _tile_stored(0, sums, SUMS_WIDTH * sizeof(float));
    _tile_stored(1, sums + 16, SUMS_WIDTH * sizeof(float));
}
#endif

#ifdef __AVX512BF16__
/* sums[r][0..TILE) (rows SUMS_WIDTH floats apart) for `rows` <= DP_ROWS rows of pair words (a
 * compile-time count after inlining: the accumulators stay in registers). */
static inline __attribute__((always_inline)) void dp_tile_rows(const uint32_t *xp,
                                                               int64_t pairs_per_row,
                                                               const uint32_t *tile,
                                                               const int rows, float *sums) {
    __m512 lo[DP_ROWS], hi[DP_ROWS];
#pragma GCC unroll 8
    for (int r = 0; r < rows; r++) lo[r] = hi[r] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs_per_row; p++) {
        const uint32_t *w = tile + p * TILE;
        _mm_prefetch((const char *)w + PREFETCH_BYTES, _MM_HINT_T0);
        _mm_prefetch((const char *)w + PREFETCH_BYTES + 64, _MM_HINT_T0);
        _mm_prefetch((const char *)w + 8 * PREFETCH_BYTES, _MM_HINT_T1);
        _mm_prefetch((const char *)w + 8 * PREFETCH_BYTES + 64, _MM_HINT_T1);
        const __m512bh w_lo = (__m512bh)_mm512_loadu_si512((const void *)w);
        const __m512bh w_hi = (__m512bh)_mm512_loadu_si512((const void *)(w + 16));
#pragma GCC unroll 8
        for (int r = 0; r < rows; r++) {
            const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xp[r * pairs_per_row + p]);
            lo[r] = _mm512_dpbf16_ps(lo[r], w_lo, xv);
            hi[r] = _mm512_dpbf16_ps(hi[r], w_hi, xv);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < rows; r++) {
        _mm512_storeu_ps(sums + r * SUMS_WIDTH, lo[r]);
        _mm512_storeu_ps(sums + r * SUMS_WIDTH + 16, hi[r]);
    }
}

#define DP_ROWS_CASE(n)                                                                        \
    case n:                                                                                    \
        dp_tile_rows(xp, pairs_per_row, tile, n, sums);                                        \
        break;

static void dp_tile_any_rows(const uint32_t *xp, int64_t pairs_per_row, const uint32_t *tile,
                             int rows, float *sums) {
    switch (rows) {
        DP_ROWS_CASE(1) DP_ROWS_CASE(2) DP_ROWS_CASE(3) DP_ROWS_CASE(4)
        DP_ROWS_CASE(5) DP_ROWS_CASE(6) DP_ROWS_CASE(7) DP_ROWS_CASE(8)
    }
}
#undef DP_ROWS_CASE
#endif

/* One row block's sums (`sums`, rows SUMS_WIDTH floats apart) for its `tiles` tiles from `n0`
 * on, plus the bias, rounded to bf16 into y. */
static void store_rows(const float *sums, const float *bias, int rows, int n0, int N, int tiles,
                       uint16_t *y, int64_t y_stride) {
    const int end = n0 + tiles * TILE < N ? n0 + tiles * TILE : N;
    for (int r = 0; r < rows; r++) {
        uint16_t *out = y + r * y_stride;
        for (int n = n0; n < end; n++) {
            const float sum = sums[r * SUMS_WIDTH + n - n0];
            out[n] = float_to_bf16(bias ? sum + bias[n] : sum);
        }
    }
}

int pdserve_linear_bf16_pairs(const uint16_t *x, int64_t x_stride, const uint32_t *packed,
                              const float *bias, uint16_t *y, int64_t y_stride, int M, int N,
                              int K, int num_threads) {
    const int kind = bf16_tiles;
    const int64_t k_padded = (K + PAIR_K_BLOCK - 1) / PAIR_K_BLOCK * PAIR_K_BLOCK;
    const int64_t tile_words = k_padded / 2 * TILE;
    const int block = kind == BF16_TILES_AMX ? AMX_ROWS : DP_ROWS;
    /* AMX runs two tiles at a time (amx_two_tiles_rows). */
    const int group = kind == BF16_TILES_AMX ? 2 : 1;
    const int m_padded = (M + block - 1) / block * block;
    const int num_tiles = (N + TILE - 1) / TILE;
    /* x's rows as pairs, zero past K and past M (an AMX tile reads 16 whole rows). */
    uint16_t *xp = malloc((size_t)m_padded * k_padded * sizeof(uint16_t));
    if (!xp) return -1;
    for (int m = 0; m < M; m++) {
        memcpy(xp + m * k_padded, x + m * x_stride, (size_t)K * sizeof(uint16_t));
        memset(xp + m * k_padded + K, 0, (size_t)(k_padded - K) * sizeof(uint16_t));
    }
    memset(xp + (int64_t)M * k_padded, 0, (size_t)(m_padded - M) * k_padded * sizeof(uint16_t));
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        float *sums = malloc((size_t)block * SUMS_WIDTH * sizeof(float));
        if (!sums) {
#pragma omp atomic write
            failed = 1;
        }
#ifdef __AMX_BF16__
        if (kind == BF16_TILES_AMX) configure_tiles();
#endif
#pragma omp for schedule(static)
        for (int t = 0; t < num_tiles; t += group) {
            if (!sums) continue;
            const uint32_t *tile = packed + (int64_t)t * tile_words;
            const int tiles = num_tiles - t < group ? num_tiles - t : group;
            for (int m0 = 0; m0 < M; m0 += block) {
                const int rows = M - m0 < block ? M - m0 : block;
                const uint16_t *rows_x = xp + (int64_t)m0 * k_padded;
#ifdef __AMX_BF16__
                if (kind == BF16_TILES_AMX) {
                    if (tiles == 2)
                        amx_two_tiles_rows(rows_x, k_padded, tile, sums);
                    else
                        amx_tile_rows(rows_x, k_padded, tile, sums);
                }
#endif
#ifdef __AVX512BF16__
                if (kind == BF16_TILES_DPBF16)
                    dp_tile_any_rows((const uint32_t *)rows_x, k_padded / 2, tile, rows, sums);
#endif
                (void)tile, (void)rows_x; /* where the processor has neither, never reached */
                store_rows(sums, bias, rows, t * TILE, N, tiles, y + (int64_t)m0 * y_stride,
                           y_stride);
            }
        }
        free(sums);
    }
    free(xp);
    return failed ? -1 : 0;
}
