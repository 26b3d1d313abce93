/* The kernels' entry points that other kernels call (decoder_layer.c); every kernel file
 * includes this, so a definition that drifts from its declaration does not compile. */
#ifndef PDSERVE_EXPORTS_H
#define PDSERVE_EXPORTS_H

#include <stdint.h>

/* The dtype codes of the entry points' `dtype` (pages) and `io_dtype` (rows in and out, float32
 * or bf16) arguments; kernels/cpu/backend.py's KV_DTYPE_CODES mirrors them. */
enum kv_dtype { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2, KV_FP8_E4M3 = 3, KV_INT8 = 4 };

void pdserve_rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *weight,
                           float eps, uint16_t *out, int64_t out_stride, int rows, int hidden);
void pdserve_add_rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *delta,
                               int64_t delta_stride, const uint16_t *weight, float eps,
                               uint16_t *sum, int64_t sum_stride, uint16_t *out,
                               int64_t out_stride, int rows, int hidden);
void pdserve_silu_mul_bf16(const uint16_t *gate_up, int64_t gate_up_stride, uint16_t *out,
                           int64_t out_stride, int rows, int width);
void pdserve_rope_bf16(uint16_t *x, int64_t row_stride, int64_t head_stride, int rows, int heads,
                       int head_dim, const uint16_t *cos, const uint16_t *sin,
                       int64_t trig_stride);
/* Which kernel multiplies bf16 tiles (bf16_pair_tiles.c): float32 FMAs over widened weights
 * (linear_tiles.c), or the processor's bf16 pairs, AVX512_BF16 or AMX; kernels/cpu/library.py's
 * BF16_TILES mirrors the codes. */
enum bf16_tiles_kind { BF16_TILES_FMA = 0, BF16_TILES_DPBF16 = 1, BF16_TILES_AMX = 2 };

int pdserve_bf16_tiles_available(int kind);
int pdserve_use_bf16_tiles(int kind);
int pdserve_bf16_tiles(void);
/* Whether attention scores bf16 queries over bf16 pages with vdpbf16ps (paged_attention.c):
 * available where the processor has AVX512_BF16, on there unless switched off. */
int pdserve_bf16_pair_scores_available(void);
int pdserve_use_bf16_pair_scores(int on);
int pdserve_bf16_pair_scores(void);
int pdserve_bf16_pair_scores_of(const uint16_t *query, const uint16_t *rows, int64_t row_stride,
                                int count, int head_dim, float scale, float *scores);
int pdserve_linear_bf16_pairs(const uint16_t *x, int64_t x_stride, const uint32_t *packed,
                              const float *bias, uint16_t *y, int64_t y_stride, int M, int N,
                              int K, int num_threads);
int pdserve_linear_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *packed,
                        const float *bias, uint16_t *y, int64_t y_stride, int M, int N, int K,
                        int num_threads);
int pdserve_linear_f32(const float *x, int64_t x_stride, const float *packed, const float *bias,
                       float *y, int64_t y_stride, int M, int N, int K, int num_threads);
/* Quantized weights in tiles (quantized_tiles.c): the kind of their codes, as
 * kernels/cpu/quantized_linear.py's KIND_CODES mirrors them; and integer codes in quads of
 * k-rows, summed in integers (quantized_quads.c), which quantized_tiles.c's entry points hand
 * on to quantized_quads.c's. */
enum quantized_code {
    QUANT_INT8 = 0,
    QUANT_UINT4 = 1,
    QUANT_FP8_E4M3 = 2,
    QUANT_INT8_QUADS = 3,
    QUANT_UINT4_QUADS = 4
};

int pdserve_quantized_tile_bytes(int kind, int group_size, int has_offsets, int K);
int pdserve_quantized_linear(const void *x, int64_t x_stride, const uint8_t *packed, int kind,
                             int group_size, int has_offsets, const float *bias, void *y,
                             int64_t y_stride, int io_dtype, int M, int N, int K,
                             int num_threads);
int pdserve_quantized_dequantize(const uint8_t *packed, int kind, int group_size,
                                 int has_offsets, void *out, int out_dtype, int transposed,
                                 int N, int K, int num_threads);
int pdserve_quantized_quads_available(void);
int pdserve_quantized_quads_tile_bytes(int kind, int group_size, int has_offsets, int K);
int pdserve_quantized_quads_linear(const void *x, int64_t x_stride, const uint8_t *packed,
                                   int kind, int group_size, int has_offsets, const float *bias,
                                   void *y, int64_t y_stride, int io_dtype, int M, int N, int K,
                                   int num_threads);
int pdserve_quantized_quads_dequantize(const uint8_t *packed, int kind, int group_size,
                                       int has_offsets, void *out, int out_dtype, int transposed,
                                       int N, int K, int num_threads);
/* How a W8A8 checkpoint rounds a linear layer's input (activation_rounding.c): to int8 or
 * e4m3 codes (`kind`, a quantized_code) over a scale per token, per token and group of
 * `group_size` inputs, per tensor (all rows of a call), or `static_scale`.
 * kernels/cpu/activation_rounding.py's ActivationRounding mirrors it. */
enum rounding_strategy {
    ROUND_NONE = 0,
    ROUND_PER_TOKEN = 1,
    ROUND_PER_TOKEN_GROUP = 2,
    ROUND_PER_TENSOR = 3,
    ROUND_STATIC = 4
};
typedef struct {
    int32_t strategy; /* rounding_strategy */
    int32_t kind;
    int32_t group_size;
    float static_scale;
} activation_rounding;

int pdserve_round_activations(const activation_rounding *rounding, const void *x,
                              int64_t x_stride, void *out, int64_t out_stride, int io_dtype,
                              int rows, int width);
void pdserve_store_kv(const void *key, int64_t key_stride, const void *value,
                      int64_t value_stride, void *key_cache, void *value_cache,
                      int64_t page_stride, int64_t token_stride, int64_t head_stride,
                      int element_bytes, int page_size, const int64_t *slots, int num_tokens,
                      int num_kv_heads, int head_dim);
int pdserve_store_kv_int8(const void *key, int64_t key_stride, const void *value,
                          int64_t value_stride, int io_dtype, int8_t *key_cache,
                          int8_t *value_cache, int64_t page_stride, int64_t token_stride,
                          int64_t head_stride, uint8_t *key_codes, uint8_t *value_codes,
                          int64_t scale_page_stride, int64_t scale_token_stride,
                          int64_t scale_head_stride, int page_size, const int64_t *slots,
                          int num_tokens, int num_kv_heads, int head_dim);
int pdserve_store_kv_fp8(const void *key, int64_t key_stride, const void *value,
                         int64_t value_stride, int io_dtype, uint8_t *key_cache,
                         uint8_t *value_cache, int64_t page_stride, int64_t token_stride,
                         int64_t head_stride, float *key_scales, float *value_scales,
                         int64_t scale_page_stride, int64_t scale_token_stride,
                         int64_t scale_head_stride, int page_size, const int64_t *slots,
                         int num_tokens, int num_kv_heads, int head_dim);
int pdserve_paged_attention(const void *query, int64_t query_row_stride, void *out,
                            int64_t out_row_stride, const void *key, const void *value,
                            const void *key_scale, const void *value_scale,
                            int64_t page_stride, int64_t token_stride, int64_t head_stride,
                            int64_t scale_page_stride, int64_t scale_token_stride,
                            int64_t scale_head_stride, int dtype, int page_size,
                            const int32_t *page_tables, int64_t page_table_stride,
                            const int32_t *query_start_loc, const int32_t *seq_lens,
                            const int32_t *seq_ids, int num_listed, int num_heads,
                            int num_kv_heads, int head_dim, float softmax_scale, int window,
                            int io_dtype, int num_threads);

/* A prefill chunk's causal attention on AMX tiles (prefill_attention.c). */
int pdserve_prefill_attention_fits(int num_heads, int num_kv_heads, int head_dim);
int pdserve_prefill_attention_available(void);
int pdserve_prefill_attention_bf16(const uint16_t *query, int64_t query_stride, uint16_t *out,
                                   int64_t out_stride, const uint16_t *key_pages,
                                   const uint16_t *value_pages, int64_t page_stride,
                                   int64_t token_stride, int64_t head_stride, int page_size,
                                   const int32_t *page_table, int query_len, int seq_len,
                                   int num_heads, int num_kv_heads, int head_dim, float scale,
                                   int num_threads);

/* One projection's LoRA adapter slots (lora_delta.c), kernels/cpu/lora_delta.py's LoraWeights
 * field by field: `num_targets` targets (q, k and v share one projection) of `max_rank` rank
 * rows each, target t's A on rows t * max_rank.. of a slot and its B (transposed) on the same
 * rows and on output columns out_starts[t].. out_starts[t] + out_sizes[t]. */
#define LORA_MAX_TARGETS 3
#define LORA_MAX_RANK_ROWS 1536 /* num_targets * max_rank: 3 targets of rank 512 */
typedef struct {
    const uint16_t *a;   /* [slots, num_targets * max_rank, K] bf16 */
    const uint16_t *b;   /* [slots, num_targets * max_rank, N] bf16 */
    const float *scales; /* [slots] */
    int32_t num_targets;
    int32_t max_rank;
    int32_t out_starts[LORA_MAX_TARGETS];
    int32_t out_sizes[LORA_MAX_TARGETS];
} lora_weights;

/* Adds each segment's delta (rows starts[g].. ends[g] under slot slots[g]) to y [rows, N] bf16
 * for x [rows, K] bf16; rows outside every segment are left alone. Returns 0, or -1 for
 * weights beyond LORA_MAX_TARGETS or LORA_MAX_RANK_ROWS. */
int pdserve_lora_delta_bf16(const lora_weights *l, const int32_t *starts, const int32_t *ends,
                            const int32_t *slots, int num_segments, const uint16_t *x,
                            int64_t x_stride, uint16_t *y, int64_t y_stride, int N, int K,
                            int num_threads);

#endif
