/* Batched LoRA on the CPU: each segment's low-rank delta added to a projection's bf16 output,
 * kernels/lora.py's arithmetic (Punica's SGMV: a shrink to the rank, an expand back), with
 * lora_delta_reference its twin.
 *
 * Every row is computed on its own, in one order whatever rows sit beside it: a row's bits do
 * not depend on the batch, and the module path (common/model/lora_layers.py) and the C decoder
 * layer (decoder_layer.c) both call this function, so the two give the same bits. A target's
 * expand reads only its own block of B (the zeros beside it in the stacked slots are skipped).
 *
 * A decode step reads every adapter it serves whole, so the slots are bf16 (half the bytes of
 * float32), widened as they stream; sums are float32, and the shrunk columns stay float32
 * between the shrink and the expand. */
#include <stdint.h>

#include "exports.h"
#include "numerics.h"

#include <stdlib.h>

/* Lanes of one dot product's partial sums: a row's sum is its lanes in k order, then the lanes
 * in index order, the same for every row of every block. */
#define LANES 16
/* Rows that share each load of A and B, at most. A block of 1 to ROW_BLOCK rows runs code
 * made for its count (the `rows` of the inline functions below is a constant where they are
 * called), so the loops' trip counts are constants and their sums stay in registers. */
#define ROW_BLOCK 4
/* Rank rows of A shrunk at once: with ROW_BLOCK, the independent sums that keep both FMA units
 * busy. */
#define RANK_BLOCK 2
/* Output columns of the expand summed at once, in registers. */
#define COLUMN_CHUNK 32
/* Below this many multiply-adds a call runs on one thread: waking a second costs more. */
#define PARALLEL_MIN_WORK (512 * 1024)

/* shrunk[i][j] = sum_k xf[i][k] a[j][k] for the block's rows (xf: [rows, K] float32). */
static inline __attribute__((always_inline)) void shrink(
    const float *xf, int rows, const uint16_t *a, int R, int K,
    float shrunk[ROW_BLOCK][LORA_MAX_RANK_ROWS]) {
    for (int j0 = 0; j0 < R; j0 += RANK_BLOCK) {
        const uint16_t *a_rows[RANK_BLOCK];
        for (int jj = 0; jj < RANK_BLOCK; jj++)
            a_rows[jj] = a + (int64_t)(j0 + jj < R ? j0 + jj : j0) * K;
        float acc[RANK_BLOCK][ROW_BLOCK][LANES] = {{{0}}};
        int k = 0;
        for (; k + LANES <= K; k += LANES)
            for (int jj = 0; jj < RANK_BLOCK; jj++)
                for (int i = 0; i < rows; i++)
#pragma omp simd
                    for (int l = 0; l < LANES; l++)
                        acc[jj][i][l] +=
                            xf[(int64_t)i * K + k + l] * bf16_to_float(a_rows[jj][k + l]);
        for (int jj = 0; jj < RANK_BLOCK; jj++)
            for (int i = 0; i < rows; i++) {
                for (int l = 0; k + l < K; l++)
                    acc[jj][i][l] += xf[(int64_t)i * K + k + l] * bf16_to_float(a_rows[jj][k + l]);
                float sum = 0.0f;
                for (int l = 0; l < LANES; l++) sum += acc[jj][i][l];
                if (j0 + jj < R) shrunk[i][j0 + jj] = sum;
            }
    }
}

/* y_i[n] = bf16(y_i[n] + bf16(scale * sum_j shrunk[i][j] b[j][n])) for the block's first
 * `rows` rows, over one target's rank rows `first`.. `first + rank` and output columns
 * `start`.. `start + size`. */
static inline __attribute__((always_inline)) void expand(
    const float shrunk[ROW_BLOCK][LORA_MAX_RANK_ROWS], int rows, const uint16_t *b, int64_t N,
    int first, int rank, int start, int size, float scale, uint16_t *y, int64_t y_stride) {
    for (int n0 = start; n0 < start + size; n0 += COLUMN_CHUNK) {
        const int width = start + size - n0 < COLUMN_CHUNK ? start + size - n0 : COLUMN_CHUNK;
        float acc[ROW_BLOCK][COLUMN_CHUNK] = {{0}};
        if (width == COLUMN_CHUNK) {
            for (int j = first; j < first + rank; j++) {
                const uint16_t *b_row = b + j * N + n0;
                float b_wide[COLUMN_CHUNK];
#pragma omp simd
                for (int c = 0; c < COLUMN_CHUNK; c++) b_wide[c] = bf16_to_float(b_row[c]);
                for (int i = 0; i < rows; i++) {
                    const float s = shrunk[i][j];
#pragma omp simd
                    for (int c = 0; c < COLUMN_CHUNK; c++) acc[i][c] += s * b_wide[c];
                }
            }
        } else {
            for (int j = first; j < first + rank; j++) {
                const uint16_t *b_row = b + j * N + n0;
                for (int i = 0; i < rows; i++)
                    for (int c = 0; c < width; c++)
                        acc[i][c] += shrunk[i][j] * bf16_to_float(b_row[c]);
            }
        }
        for (int i = 0; i < rows; i++) {
            uint16_t *y_row = y + i * y_stride + n0;
#pragma omp simd
            for (int c = 0; c < width; c++)
                y_row[c] = float_to_bf16(bf16_to_float(y_row[c]) + round_bf16(acc[i][c] * scale));
        }
    }
}

/* One block of `rows` rows of one segment, under adapter slot `slot`; `xf` is float32 scratch
 * of ROW_BLOCK * K. */
static inline __attribute__((always_inline)) void delta_rows(
    const lora_weights *l, int slot, const uint16_t *x, int64_t x_stride, uint16_t *y,
    int64_t y_stride, int rows, int N, int K, float *xf) {
    const int R = l->num_targets * l->max_rank;
    const uint16_t *a = l->a + (int64_t)slot * R * K;
    const uint16_t *b = l->b + (int64_t)slot * R * N;
    for (int i = 0; i < rows; i++) {
        const uint16_t *x_row = x + i * x_stride;
#pragma omp simd
        for (int k = 0; k < K; k++) xf[(int64_t)i * K + k] = bf16_to_float(x_row[k]);
    }
    float shrunk[ROW_BLOCK][LORA_MAX_RANK_ROWS];
    shrink(xf, rows, a, R, K, shrunk);
    for (int t = 0; t < l->num_targets; t++)
        expand(shrunk, rows, b, N, t * l->max_rank, l->max_rank, l->out_starts[t],
               l->out_sizes[t], l->scales[slot], y, y_stride);
}

/* delta_rows made for each block size: a row's arithmetic is the same in all four. */
static void delta_block(const lora_weights *l, int slot, const uint16_t *x, int64_t x_stride,
                        uint16_t *y, int64_t y_stride, int rows, int N, int K, float *xf) {
    switch (rows) {
    case 1: delta_rows(l, slot, x, x_stride, y, y_stride, 1, N, K, xf); break;
    case 2: delta_rows(l, slot, x, x_stride, y, y_stride, 2, N, K, xf); break;
    case 3: delta_rows(l, slot, x, x_stride, y, y_stride, 3, N, K, xf); break;
    default: delta_rows(l, slot, x, x_stride, y, y_stride, ROW_BLOCK, N, K, xf); break;
    }
}

/* This thread's share of every segment's row blocks; returns -1 if its scratch could not be
 * allocated. */
static int delta_segments(const lora_weights *l, const int32_t *starts, const int32_t *ends,
                          const int32_t *slots, int num_segments, const uint16_t *x,
                          int64_t x_stride, uint16_t *y, int64_t y_stride, int N, int K) {
    float *xf = malloc(sizeof(float) * ROW_BLOCK * K);
    for (int g = 0; g < num_segments; g++) {
        const int first = starts[g], count = ends[g] - starts[g];
        const int blocks = (count + ROW_BLOCK - 1) / ROW_BLOCK;
        /* Every thread meets each loop (the worksharing rule), with or without its scratch. */
#pragma omp for schedule(static) nowait
        for (int block = 0; block < blocks; block++) {
            const int row = first + block * ROW_BLOCK;
            const int rows = first + count - row < ROW_BLOCK ? first + count - row : ROW_BLOCK;
            if (xf)
                delta_block(l, slots[g], x + row * x_stride, x_stride, y + row * y_stride,
                            y_stride, rows, N, K, xf);
        }
    }
    free(xf);
    return xf ? 0 : -1;
}

int pdserve_lora_delta_bf16(const lora_weights *l, const int32_t *starts, const int32_t *ends,
                            const int32_t *slots, int num_segments, const uint16_t *x,
                            int64_t x_stride, uint16_t *y, int64_t y_stride, int N, int K,
                            int num_threads) {
    const int R = l->num_targets * l->max_rank;
    if (l->num_targets < 1 || l->num_targets > LORA_MAX_TARGETS || R > LORA_MAX_RANK_ROWS)
        return -1;
    int64_t rows = 0;
    for (int g = 0; g < num_segments; g++) rows += ends[g] - starts[g];
    const int64_t work = rows * ((int64_t)R * K + (int64_t)l->max_rank * N);
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && work >= PARALLEL_MIN_WORK)
    {
        if (delta_segments(l, starts, ends, slots, num_segments, x, x_stride, y, y_stride, N, K)) {
#pragma omp atomic write
            failed = 1;
        }
    }
    return failed ? -1 : 0;
}
