/* A whole bf16 decoder layer of a short-run step (decodes, verification runs) in one call,
 * over bf16 or FP8 pages.
 *
 * In a decode step the layer's arithmetic is a few GEMMs over a handful of rows; calling its
 * dozen parts one by one from Python (norm, projections, RoPE, KV store, attention, SiLU,
 * residual adds) costs more than some of them compute. This runs the very same kernels in the
 * very same order, with the residual adds rounded to bf16 as torch's are, so the layer's output
 * is the same bits as the module path's (common/model/llama.py), which stays for every other
 * case. */
#include <stdint.h>

#include "exports.h"
#include "numerics.h"

/* What a layer keeps from load to load: its weights and its KV pages. Mirrored field by field
 * by kernels/cpu_layer.py's LayerWeights. */
typedef struct {
    const uint16_t *input_norm;
    const uint16_t *post_attention_norm;
    const uint16_t *qkv_tiles;
    const float *qkv_bias; /* or NULL */
    const uint16_t *o_tiles;
    const uint16_t *gate_up_tiles;
    const uint16_t *down_tiles;
    void *key_cache; /* pages [num_pages, page_size, num_kv_heads, head_dim], bf16 or e4m3 */
    void *value_cache;
    float *key_scale; /* FP8 pages: [num_pages, page_size, num_kv_heads]; else NULL */
    float *value_scale;
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
    int32_t kv_dtype; /* paged_attention.c's kv_dtype: 1 bf16, 3 FP8 e4m3 */
} layer_weights;

enum { KV_BF16 = 1, KV_FP8_E4M3 = 3 };

/* hidden[i] = bf16(hidden[i] + delta[i]), as a bf16 tensor add rounds. */
static void add_bf16(uint16_t *hidden, const uint16_t *delta, int64_t count) {
#pragma omp simd
    for (int64_t i = 0; i < count; i++)
        hidden[i] = float_to_bf16(bf16_to_float(hidden[i]) + bf16_to_float(delta[i]));
}

/* Bytes of scratch a layer of `w`'s shapes needs for `rows` rows. */
int64_t pdserve_decoder_layer_scratch_bytes(const layer_weights *w, int rows) {
    const int64_t q_size = (int64_t)w->num_heads * w->head_dim;
    const int64_t qkv = q_size + 2 * (int64_t)w->num_kv_heads * w->head_dim;
    return (int64_t)rows * (2 * w->hidden + qkv + q_size + 3 * (int64_t)w->intermediate) * 2;
}

/* hidden: [rows, hidden] bf16, contiguous, updated in place; cos, sin: [rows, head_dim] bf16
 * rows `trig_stride` apart; slots: [rows] int64; the attention step arguments as
 * pdserve_paged_attention takes them; scratch: pdserve_decoder_layer_scratch_bytes. Returns 0,
 * or -1 if a kernel could not allocate its scratch memory (or, FP8 pages, a head_dim beyond
 * the store's row buffer, which kernels/cpu_layer.py does not fuse). */
int pdserve_decoder_layer_bf16(const layer_weights *w, uint16_t *hidden, int rows,
                               const uint16_t *cos, const uint16_t *sin, int64_t trig_stride,
                               const int64_t *slots, const int32_t *page_tables,
                               int64_t page_table_stride, const int32_t *query_start_loc,
                               const int32_t *seq_lens, const int32_t *seq_ids, int num_listed,
                               uint16_t *scratch, int num_threads) {
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
    if (pdserve_linear_bf16(normed, hidden_size, w->qkv_tiles, w->qkv_bias, qkv, qkv_size, rows,
                            qkv_size, hidden_size, num_threads))
        return -1;
    pdserve_rope_bf16(qkv, qkv_size, head_dim, rows, w->num_heads, head_dim, cos, sin,
                      trig_stride);
    pdserve_rope_bf16(qkv + q_size, qkv_size, head_dim, rows, w->num_kv_heads, head_dim, cos,
                      sin, trig_stride);
    const uint16_t *keys = qkv + q_size, *values = qkv + q_size + kv_size;
    if (w->kv_dtype == KV_FP8_E4M3) {
        if (pdserve_store_kv_fp8(keys, qkv_size, values, qkv_size, /* bf16 rows */ 1,
                                 w->key_cache, w->value_cache, w->page_stride, w->token_stride,
                                 w->head_stride, w->key_scale, w->value_scale,
                                 w->scale_page_stride, w->scale_token_stride,
                                 w->scale_head_stride, w->page_size, slots, rows,
                                 w->num_kv_heads, head_dim))
            return -1;
    } else {
        pdserve_store_kv(keys, qkv_size, values, qkv_size, w->key_cache, w->value_cache,
                         w->page_stride, w->token_stride, w->head_stride, 2, w->page_size, slots,
                         rows, w->num_kv_heads, head_dim);
    }
    if (pdserve_paged_attention(qkv, qkv_size, attended, q_size, w->key_cache, w->value_cache,
                                w->key_scale, w->value_scale, w->page_stride, w->token_stride,
                                w->head_stride, w->scale_page_stride, w->scale_token_stride,
                                w->scale_head_stride, w->kv_dtype, w->page_size, page_tables,
                                page_table_stride, query_start_loc, seq_lens, seq_ids,
                                num_listed, w->num_heads, w->num_kv_heads, head_dim,
                                w->softmax_scale, /* bf16 in and out */ 1, num_threads))
        return -1;
    if (pdserve_linear_bf16(attended, q_size, w->o_tiles, NULL, projected, hidden_size, rows,
                            hidden_size, q_size, num_threads))
        return -1;
    add_bf16(hidden, projected, count);

    pdserve_rms_norm_bf16(hidden, hidden_size, w->post_attention_norm, w->eps, normed,
                          hidden_size, rows, hidden_size);
    if (pdserve_linear_bf16(normed, hidden_size, w->gate_up_tiles, NULL, gate_up,
                            2 * intermediate, rows, 2 * intermediate, hidden_size, num_threads))
        return -1;
    pdserve_silu_mul_bf16(gate_up, 2 * intermediate, activated, intermediate, rows, intermediate);
    if (pdserve_linear_bf16(activated, intermediate, w->down_tiles, NULL, projected, hidden_size,
                            rows, hidden_size, intermediate, num_threads))
        return -1;
    add_bf16(hidden, projected, count);
    return 0;
}
