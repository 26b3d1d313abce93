/* A whole decoder layer of a short-run step (decodes, verification runs) in one call, bf16
 * rows over bf16 or quantized weights (any mix), over bf16, FP8 or int8 pages (int8 pages with
 * their Hadamard turns, kernels/kv_turn.py).
 *
 * In a decode step the layer's arithmetic is a few GEMMs over a handful of rows; calling its
 * dozen parts one by one from Python (norm, projections, RoPE, KV store, attention, SiLU,
 * residual adds, a W8A8 checkpoint's rounding of each projection's input) costs more than some
 * of them compute. This runs the very same kernels in the very same order, with the residual
 * adds rounded to bf16 as torch's are, so the layer's output is the same bits as the module
 * path's (common/model/llama.py), which stays for every other case. */
#include <stdint.h>

#include "exports.h"
#include "numerics.h"

/* One of the layer's projections: bf16 tiles (linear_tiles.c) or quantized tiles
 * (quantized_tiles.c), its input first rounded as a W8A8 checkpoint's are. Mirrored field by
 * field by kernels/cpu/layer.py's LinearWeights. */
typedef struct {
    const void *tiles;
    const float *bias; /* or NULL */
    int32_t quantized; /* 0: bf16 tiles; else quantized tiles of codes `kind` */
    int32_t kind;      /* quantized_code */
    int32_t group_size;
    int32_t has_offsets;
    activation_rounding rounding; /* ROUND_NONE: the input as it is */
    const lora_weights *lora;     /* its adapter slots (with ROUND_NONE only), or NULL */
} linear_weights;

/* The rows of a step computing under adapters (kernels/lora.py's LoraSegments); count 0: none. */
typedef struct {
    const int32_t *starts;
    const int32_t *ends;
    const int32_t *slots;
    int32_t count;
} lora_rows;

/* What a layer keeps from load to load: its weights and its KV pages. Mirrored field by field
 * by kernels/cpu/layer.py's LayerWeights. */
typedef struct {
    const uint16_t *input_norm;
    const uint16_t *post_attention_norm;
    linear_weights qkv;
    linear_weights o; /* o, gate_up and down have no bias */
    linear_weights gate_up;
    linear_weights down;
    /* int8 pages: the float32 tiles of the turns (head_dim x head_dim); else NULL. */
    const float *query_turn_tiles;
    const float *kv_turn_tiles;
    void *key_cache; /* pages [num_pages, page_size, num_kv_heads, head_dim]: bf16, e4m3, int8 */
    void *value_cache;
    /* [num_pages, page_size, num_kv_heads]: float32 scales of FP8 pages, one-byte codes of
     * int8 pages; NULL for bf16 pages. */
    void *key_scale;
    void *value_scale;
    int64_t page_stride; /* elements */
    int64_t token_stride;
    int64_t head_stride;
    int64_t scale_page_stride; /* elements; zeros for bf16 pages */
    int64_t scale_token_stride;
    int64_t scale_head_stride;
    float eps;
    float softmax_scale;
    int32_t hidden;
    int32_t num_heads;
    int32_t num_kv_heads;
    int32_t head_dim;
    int32_t intermediate;
    int32_t page_size;
    int32_t kv_dtype; /* exports.h's kv_dtype: KV_BF16, KV_FP8_E4M3 or KV_INT8 */
    int32_t window;   /* the attention's sliding window; 0 for none */
} layer_weights;

/* y [rows, N] = x [rows, K] W^T (+ bias), bf16 rows, and the adapters' deltas of `lora`'s
 * rows added as the module path adds them; x, scratch, is rounded in place first where the
 * projection rounds its input (nothing else reads it after; kernels/cpu/layer.py fuses no
 * projection that both rounds and has adapters). Returns the kernels' status: 0, or nonzero if
 * one could not allocate its scratch memory. */
static int project(const linear_weights *l, uint16_t *x, int64_t x_stride, uint16_t *y,
                   int64_t y_stride, int rows, int N, int K, const lora_rows *lora,
                   int num_threads) {
    if (l->rounding.strategy != ROUND_NONE &&
        pdserve_round_activations(&l->rounding, x, x_stride, x, x_stride, KV_BF16, rows, K))
        return -1;
    const int status =
        l->quantized
            ? pdserve_quantized_linear(x, x_stride, l->tiles, l->kind, l->group_size,
                                       l->has_offsets, l->bias, y, y_stride, KV_BF16, rows, N,
                                       K, num_threads)
            : pdserve_linear_bf16(x, x_stride, l->tiles, l->bias, y, y_stride, rows, N, K,
                                  num_threads);
    if (status || !l->lora || !lora->count) return status;
    return pdserve_lora_delta_bf16(l->lora, lora->starts, lora->ends, lora->slots, lora->count,
                                   x, x_stride, y, y_stride, N, K, num_threads);
}

/* hidden[i] = bf16(hidden[i] + delta[i]), as a bf16 tensor add rounds. */
static void add_bf16(uint16_t *hidden, const uint16_t *delta, int64_t count) {
#pragma omp simd
    for (int64_t i = 0; i < count; i++)
        hidden[i] = float_to_bf16(bf16_to_float(hidden[i]) + bf16_to_float(delta[i]));
}

/* Bytes of the layer's bf16 buffers for `rows` rows, rounded up to a cache line (float32
 * buffers follow them). */
static int64_t bf16_scratch_bytes(const layer_weights *w, int rows) {
    const int64_t q_size = (int64_t)w->num_heads * w->head_dim;
    const int64_t kv_size = (int64_t)w->num_kv_heads * w->head_dim;
    const int64_t bytes =
        (int64_t)rows * (2 * w->hidden + q_size + 2 * kv_size + q_size + 3 * w->intermediate) * 2;
    return (bytes + 63) / 64 * 64;
}

/* Bytes of scratch a layer of `w`'s shapes needs for `rows` rows. */
int64_t pdserve_decoder_layer_scratch_bytes(const layer_weights *w, int rows) {
    if (w->kv_dtype != KV_INT8) return bf16_scratch_bytes(w, rows);
    /* Turned heads stay float32: queries, keys, values, and the widened heads / output. */
    const int64_t q_size = (int64_t)w->num_heads * w->head_dim;
    const int64_t kv_size = (int64_t)w->num_kv_heads * w->head_dim;
    return bf16_scratch_bytes(w, rows) + (int64_t)rows * (2 * q_size + 2 * kv_size) * 4;
}

/* The attention half of a layer over bf16 or FP8 pages: keys and values stored (quantised for
 * FP8), bf16 queries attended into `attended`. */
static int attend_stored(const layer_weights *w, const uint16_t *qkv, int rows,
                         const int64_t *slots, const int32_t *page_tables,
                         int64_t page_table_stride, const int32_t *query_start_loc,
                         const int32_t *seq_lens, const int32_t *seq_ids, int num_listed,
                         uint16_t *attended, int num_threads) {
    const int head_dim = w->head_dim;
    const int q_size = w->num_heads * head_dim, kv_size = w->num_kv_heads * head_dim;
    const int64_t qkv_size = q_size + 2 * kv_size;
    const uint16_t *keys = qkv + q_size, *values = qkv + q_size + kv_size;
    if (w->kv_dtype == KV_FP8_E4M3) {
        if (pdserve_store_kv_fp8(keys, qkv_size, values, qkv_size, KV_BF16, w->key_cache,
                                 w->value_cache, w->page_stride, w->token_stride, w->head_stride,
                                 w->key_scale, w->value_scale, w->scale_page_stride,
                                 w->scale_token_stride, w->scale_head_stride, w->page_size, slots,
                                 rows, w->num_kv_heads, head_dim))
            return -1;
    } else {
        pdserve_store_kv(keys, qkv_size, values, qkv_size, w->key_cache, w->value_cache,
                         w->page_stride, w->token_stride, w->head_stride, 2, w->page_size, slots,
                         rows, w->num_kv_heads, head_dim);
    }
    return pdserve_paged_attention(qkv, qkv_size, attended, q_size, w->key_cache, w->value_cache,
                                   w->key_scale, w->value_scale, w->page_stride, w->token_stride,
                                   w->head_stride, w->scale_page_stride, w->scale_token_stride,
                                   w->scale_head_stride, w->kv_dtype, w->page_size, page_tables,
                                   page_table_stride, query_start_loc, seq_lens, seq_ids,
                                   num_listed, w->num_heads, w->num_kv_heads, head_dim,
                                   w->softmax_scale, w->window, KV_BF16, num_threads);
}

/* `heads` head vectors of `head_dim` bf16 values, rows `row_stride` apart with `per_row` heads
 * each, widened to float32 and turned by `tiles` into `out` ([rows * per_row, head_dim]),
 * `wide` holding the widened vectors: the module path's turn of a `.float()` tensor. */
static int turn_heads(const uint16_t *heads, int64_t row_stride, int rows, int per_row,
                      int head_dim, const float *tiles, float *wide, float *out,
                      int num_threads) {
    const int width = per_row * head_dim;
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < width; i++)
            wide[(int64_t)r * width + i] = bf16_to_float(heads[r * row_stride + i]);
    return pdserve_linear_f32(wide, head_dim, tiles, NULL, out, head_dim, rows * per_row,
                              head_dim, head_dim, num_threads);
}

/* The attention half of a layer over int8 pages: queries and keys (after RoPE) and values
 * turned in float32, keys and values stored as int8, float32 queries attended, the output
 * turned back and rounded to bf16 into `attended`, as common/model/llama.py's Attention does
 * with its turns. `turned` is float32 scratch of rows * (2 q_size + 2 kv_size). */
static int attend_turned(const layer_weights *w, const uint16_t *qkv, int rows,
                         const int64_t *slots, const int32_t *page_tables,
                         int64_t page_table_stride, const int32_t *query_start_loc,
                         const int32_t *seq_lens, const int32_t *seq_ids, int num_listed,
                         float *turned, uint16_t *attended, int num_threads) {
    const int head_dim = w->head_dim;
    const int q_size = w->num_heads * head_dim, kv_size = w->num_kv_heads * head_dim;
    const int64_t qkv_size = q_size + 2 * kv_size;
    float *queries = turned;                            /* [rows, q_size], then the output */
    float *keys = queries + (int64_t)rows * q_size;     /* [rows, kv_size] */
    float *values = keys + (int64_t)rows * kv_size;     /* [rows, kv_size] */
    float *wide = values + (int64_t)rows * kv_size;     /* [rows, q_size] */
    if (turn_heads(qkv, qkv_size, rows, w->num_heads, head_dim, w->query_turn_tiles, wide,
                   queries, num_threads) ||
        turn_heads(qkv + q_size, qkv_size, rows, w->num_kv_heads, head_dim, w->kv_turn_tiles,
                   wide, keys, num_threads) ||
        turn_heads(qkv + q_size + kv_size, qkv_size, rows, w->num_kv_heads, head_dim,
                   w->kv_turn_tiles, wide, values, num_threads))
        return -1;
    if (pdserve_store_kv_int8(keys, kv_size, values, kv_size, KV_F32, w->key_cache,
                              w->value_cache, w->page_stride, w->token_stride, w->head_stride,
                              w->key_scale, w->value_scale, w->scale_page_stride,
                              w->scale_token_stride, w->scale_head_stride, w->page_size, slots,
                              rows, w->num_kv_heads, head_dim))
        return -1;
    float *out = wide; /* the attention output, float32 as the module path's */
    if (pdserve_paged_attention(queries, q_size, out, q_size, w->key_cache, w->value_cache,
                                w->key_scale, w->value_scale, w->page_stride, w->token_stride,
                                w->head_stride, w->scale_page_stride, w->scale_token_stride,
                                w->scale_head_stride, KV_INT8, w->page_size, page_tables,
                                page_table_stride, query_start_loc, seq_lens, seq_ids,
                                num_listed, w->num_heads, w->num_kv_heads, head_dim,
                                w->softmax_scale, w->window, KV_F32, num_threads))
        return -1;
    /* Turned back into the queries' buffer (they are spent), then rounded to bf16. */
    if (pdserve_linear_f32(out, head_dim, w->query_turn_tiles, NULL, queries, head_dim,
                           rows * w->num_heads, head_dim, head_dim, num_threads))
        return -1;
    const int64_t count = (int64_t)rows * q_size;
    for (int64_t i = 0; i < count; i++) attended[i] = float_to_bf16(queries[i]);
    return 0;
}

/* hidden: [rows, hidden] bf16, contiguous, updated in place; cos, sin: [rows, head_dim] bf16
 * rows `trig_stride` apart; slots: [rows] int64; the attention step arguments as
 * pdserve_paged_attention takes them; lora: the rows under adapters (NULL: none); scratch:
 * pdserve_decoder_layer_scratch_bytes. Returns 0,
 * or -1 if a kernel could not allocate its scratch memory (or, 8-bit pages, a head_dim beyond
 * the store's row buffer, which kernels/cpu/layer.py does not fuse). */
int pdserve_decoder_layer_bf16(const layer_weights *w, uint16_t *hidden, int rows,
                               const uint16_t *cos, const uint16_t *sin, int64_t trig_stride,
                               const int64_t *slots, const int32_t *page_tables,
                               int64_t page_table_stride, const int32_t *query_start_loc,
                               const int32_t *seq_lens, const int32_t *seq_ids, int num_listed,
                               const lora_rows *adapter_rows, uint16_t *scratch,
                               int num_threads) {
    static const lora_rows no_adapters = {0};
    const lora_rows *lora = adapter_rows ? adapter_rows : &no_adapters;
    const int hidden_size = w->hidden, head_dim = w->head_dim;
    const int q_size = w->num_heads * head_dim, kv_size = w->num_kv_heads * head_dim;
    const int qkv_size = q_size + 2 * kv_size, intermediate = w->intermediate;
    uint16_t *normed = scratch;                                  /* [rows, hidden] */
    uint16_t *qkv = normed + (int64_t)rows * hidden_size;        /* [rows, q + 2 kv] */
    uint16_t *attended = qkv + (int64_t)rows * qkv_size;         /* [rows, q] */
    uint16_t *projected = attended + (int64_t)rows * q_size;     /* [rows, hidden] */
    uint16_t *gate_up = projected + (int64_t)rows * hidden_size; /* [rows, 2 intermediate] */
    uint16_t *activated = gate_up + (int64_t)rows * 2 * intermediate; /* [rows, intermediate] */
    const int64_t count = (int64_t)rows * hidden_size;

    pdserve_rms_norm_bf16(hidden, hidden_size, w->input_norm, w->eps, normed, hidden_size, rows,
                          hidden_size);
    if (project(&w->qkv, normed, hidden_size, qkv, qkv_size, rows, qkv_size, hidden_size,
                lora, num_threads))
        return -1;
    pdserve_rope_bf16(qkv, qkv_size, head_dim, rows, w->num_heads, head_dim, cos, sin,
                      trig_stride);
    pdserve_rope_bf16(qkv + q_size, qkv_size, head_dim, rows, w->num_kv_heads, head_dim, cos,
                      sin, trig_stride);
    const int status =
        w->kv_dtype == KV_INT8
            ? attend_turned(w, qkv, rows, slots, page_tables, page_table_stride,
                            query_start_loc, seq_lens, seq_ids, num_listed,
                            (float *)((char *)scratch + bf16_scratch_bytes(w, rows)), attended,
                            num_threads)
            : attend_stored(w, qkv, rows, slots, page_tables, page_table_stride,
                            query_start_loc, seq_lens, seq_ids, num_listed, attended,
                            num_threads);
    if (status) return -1;
    if (project(&w->o, attended, q_size, projected, hidden_size, rows, hidden_size, q_size,
                lora, num_threads))
        return -1;
    add_bf16(hidden, projected, count);

    pdserve_rms_norm_bf16(hidden, hidden_size, w->post_attention_norm, w->eps, normed,
                          hidden_size, rows, hidden_size);
    if (project(&w->gate_up, normed, hidden_size, gate_up, 2 * intermediate, rows,
                2 * intermediate, hidden_size, lora, num_threads))
        return -1;
    pdserve_silu_mul_bf16(gate_up, 2 * intermediate, activated, intermediate, rows, intermediate);
    if (project(&w->down, activated, intermediate, projected, hidden_size, rows, hidden_size,
                intermediate, lora, num_threads))
        return -1;
    add_bf16(hidden, projected, count);
    return 0;
}
