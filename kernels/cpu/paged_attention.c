/* Paged attention on the CPU for short query runs (decode steps, speculative verification).
 *
 * One call attends every query row of the listed sequences over their context, read straight
 * from the block-major pool's pages through its strides: nothing is gathered, and only the
 * first seq_len slots of a sequence are ever read, so never-written slots cannot leak in.
 * Keys and values are widened to float32 as they are read (FP8 pages through a table and
 * their per-token scales); scores, softmax and the weighted sum of values are float32. The
 * reduction order depends only on the sequence itself, never on the rest of the batch.
 *
 * Layout (see kernels/interface.py): query rows of sequence s are
 * query_start_loc[s] .. query_start_loc[s + 1]; with q rows and L = seq_lens[s], row j sits at
 * position L - q + j and sees positions 0 .. L - q + j.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "numerics.h"

enum kv_dtype { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2, KV_FP8_E4M3 = 3 };

static float fp8_e4m3_table[256];

/* Called once when the library is loaded, before any attention call. */
void pdserve_init(void) {
    for (int byte = 0; byte < 256; byte++) {
        int sign = byte >> 7, exponent = (byte >> 3) & 0xF, mantissa = byte & 0x7;
        float value;
        if (exponent == 0xF && mantissa == 0x7) {
            value = NAN; /* e4m3fn has no infinities; S.1111.111 is NaN */
        } else if (exponent == 0) {
            value = ldexpf((float)mantissa, -9); /* subnormal: m/8 * 2^-6 */
        } else {
            value = ldexpf(1.0f + mantissa / 8.0f, exponent - 7);
        }
        fp8_e4m3_table[byte] = sign ? -value : value;
    }
}

/* Widen one head vector of `dim` elements to float32 (times `scale` for FP8 pages). */
static inline __attribute__((always_inline)) void load_row(const void *restrict src, int dtype,
                                                           float scale, int dim,
                                                           float *restrict dst) {
    switch (dtype) {
    case KV_F32:
        memcpy(dst, src, (size_t)dim * sizeof(float));
        break;
    case KV_BF16: {
        const uint16_t *bits = (const uint16_t *)src;
#pragma omp simd
        for (int d = 0; d < dim; d++) dst[d] = bf16_to_float(bits[d]);
        break;
    }
    case KV_F16: {
        const _Float16 *halves = (const _Float16 *)src;
#pragma omp simd
        for (int d = 0; d < dim; d++) dst[d] = (float)halves[d];
        break;
    }
    default: {
        const uint8_t *bytes = (const uint8_t *)src;
        for (int d = 0; d < dim; d++) dst[d] = fp8_e4m3_table[bytes[d]] * scale;
        break;
    }
    }
}

/* Write one float32 head vector as float32 or bf16 (rounded to nearest even). */
static inline void store_row(const float *restrict src, int dtype, int dim, void *restrict dst) {
    if (dtype == KV_F32) {
        memcpy(dst, src, (size_t)dim * sizeof(float));
        return;
    }
    uint16_t *bits = (uint16_t *)dst;
    for (int d = 0; d < dim; d++) bits[d] = float_to_bf16(src[d]);
}

static inline size_t element_size(int dtype) {
    return dtype == KV_F32 ? 4 : dtype == KV_FP8_E4M3 ? 1 : 2;
}

typedef struct {
    const void *key;            /* [num_blocks, block_size, num_kv_heads, head_dim], strided */
    const void *value;          /* same shape and strides as key */
    const float *key_scale;     /* [num_blocks, block_size, num_kv_heads] or NULL */
    const float *value_scale;   /* same strides as key_scale */
    int64_t block_stride;       /* elements, for key/value */
    int64_t token_stride;
    int64_t head_stride;
    int64_t scale_block_stride; /* elements, for the scales */
    int64_t scale_token_stride;
    int64_t scale_head_stride;
    int dtype;                  /* enum kv_dtype */
    int block_size;
} kv_cache;

static inline const void *kv_address(const kv_cache *cache, const void *base, int64_t block,
                                     int64_t offset, int kv_head) {
    return (const char *)base + (block * cache->block_stride + offset * cache->token_stride +
                                 kv_head * cache->head_stride) *
                                    (int64_t)element_size(cache->dtype);
}

static inline float kv_scale(const kv_cache *cache, const float *scales, int64_t block,
                             int64_t offset, int kv_head) {
    if (!scales) return 1.0f;
    return scales[block * cache->scale_block_stride + offset * cache->scale_token_stride +
                  kv_head * cache->scale_head_stride];
}

/* Pull a page of one layer's keys or values toward the cache while the previous page computes:
 * pages sit anywhere in the pool, so no hardware prefetcher sees the next one coming. */
static inline void prefetch_page(const kv_cache *cache, const void *base, int64_t block,
                                 int count) {
    const char *start = kv_address(cache, base, block, 0, 0);
    const int64_t bytes = count * cache->token_stride * (int64_t)element_size(cache->dtype);
    for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(start + line, 0, 3);
}

#ifdef __AVX512F__
/* out[i] = the sum of v[i]'s 16 lanes, for 16 vectors at once: a tree of in-lane unpacks and
 * cross-lane shuffles instead of 16 separate horizontal sums. */
static inline __m512 sum16(const __m512 v[16]) {
    __m512 pairs[8], quads[4], octs[2];
    for (int i = 0; i < 8; i++)
        pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                                 _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++)
        quads[i] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0x44),
                                 _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0xEE));
    for (int i = 0; i < 2; i++)
        octs[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0x88),
                                _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(octs[0], octs[1], 0x88),
                         _mm512_shuffle_f32x4(octs[0], octs[1], 0xDD));
}
#endif

/* scores[t] = q . rows[t] for `count` rows of `head_dim` floats. */
static inline __attribute__((always_inline)) void dot_rows(const float *restrict q,
                                                           const float *restrict rows, int count,
                                                           int head_dim, float *restrict scores) {
#ifdef __AVX512F__
    if (head_dim % 16 == 0 && head_dim <= 256 && count == 16) {
        __m512 qv[16], partial[16];
        const int chunks = head_dim / 16;
        for (int c = 0; c < chunks; c++) qv[c] = _mm512_loadu_ps(q + 16 * c);
        for (int t = 0; t < 16; t++) {
            const float *row = rows + t * head_dim;
            __m512 sum = _mm512_mul_ps(qv[0], _mm512_loadu_ps(row));
            for (int c = 1; c < chunks; c++)
                sum = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(row + 16 * c), sum);
            partial[t] = sum;
        }
        _mm512_storeu_ps(scores, sum16(partial));
        return;
    }
#endif
    for (int t = 0; t < count; t++) {
        const float *row = rows + t * head_dim;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int d = 0; d < head_dim; d++) dot += q[d] * row[d];
        scores[t] = dot;
    }
}

/* acc += sum_t weights[t] * rows[t], for `count` rows of `head_dim` floats. */
static inline __attribute__((always_inline)) void weighted_rows(const float *restrict weights,
                                                                const float *restrict rows,
                                                                int count, int head_dim,
                                                                float *restrict acc) {
#ifdef __AVX512F__
    if (head_dim % 16 == 0 && head_dim <= 256) {
        __m512 sum[16];
        const int chunks = head_dim / 16;
        for (int c = 0; c < chunks; c++) sum[c] = _mm512_loadu_ps(acc + 16 * c);
        for (int t = 0; t < count; t++) {
            const __m512 p = _mm512_set1_ps(weights[t]);
            for (int c = 0; c < chunks; c++)
                sum[c] = _mm512_fmadd_ps(p, _mm512_loadu_ps(rows + t * head_dim + 16 * c), sum[c]);
        }
        for (int c = 0; c < chunks; c++) _mm512_storeu_ps(acc + 16 * c, sum[c]);
        return;
    }
#endif
    for (int t = 0; t < count; t++) {
        const float p = weights[t];
#pragma omp simd
        for (int d = 0; d < head_dim; d++) acc[d] += p * rows[t * head_dim + d];
    }
}

/* One page's rows of one KV head, widened to float32: rows[offset][head_dim]. */
static inline __attribute__((always_inline)) void load_page_rows(const kv_cache *cache,
                                                                 const void *base,
                                                                 const float *scales,
                                                                 int64_t block, int count,
                                                                 int kv_head, int head_dim,
                                                                 float *restrict rows) {
    for (int offset = 0; offset < count; offset++)
        load_row(kv_address(cache, base, block, offset, kv_head), cache->dtype,
                 kv_scale(cache, scales, block, offset, kv_head), head_dim,
                 rows + offset * head_dim);
}

/* One sequence, all heads: its q_len x num_heads query vectors. Page by page and KV head by KV
 * head, the page's rows are widened once into a small buffer that stays in L1 while every query
 * vector of that head goes over it. */
static inline __attribute__((always_inline)) void attend_sequence(
    const char *query, int64_t query_row_stride, char *out, int64_t out_row_stride, int io_dtype,
    const kv_cache *cache, const int32_t *block_table, int seq_len, int q_len, int num_heads,
    int num_kv_heads, int head_dim, float softmax_scale, float *scratch) {
    const size_t io_size = element_size(io_dtype);
    const int group = num_heads / num_kv_heads;
    const int num_vectors = q_len * num_heads; /* vector v: row v / num_heads, head v % num_heads */
    const int block_size = cache->block_size;
    float *restrict queries = scratch;                              /* [num_vectors, head_dim] */
    float *restrict acc = queries + (size_t)num_vectors * head_dim; /* [num_vectors, head_dim] */
    float *restrict rows = acc + (size_t)num_vectors * head_dim;    /* [block_size, head_dim] */
    float *restrict scores = rows + (size_t)block_size * head_dim;  /* [num_vectors, seq_len] */

    for (int j = 0; j < q_len; j++)
        for (int head = 0; head < num_heads; head++) {
            float *dst = queries + (size_t)(j * num_heads + head) * head_dim;
            load_row(query + (j * query_row_stride + head * head_dim) * io_size, io_dtype, 1.0f,
                     head_dim, dst);
            for (int d = 0; d < head_dim; d++) dst[d] *= softmax_scale;
        }

    /* Pass 1: scores of every vector over the whole context (causality is applied below). */
    for (int first = 0; first < seq_len; first += block_size) {
        const int64_t block = block_table[first / block_size];
        const int count = seq_len - first < block_size ? seq_len - first : block_size;
        if (first + block_size < seq_len)
            prefetch_page(cache, cache->key, block_table[first / block_size + 1], block_size);
        for (int kv_head = 0; kv_head < num_kv_heads; kv_head++) {
            load_page_rows(cache, cache->key, cache->key_scale, block, count, kv_head, head_dim,
                           rows);
            for (int j = 0; j < q_len; j++)
                for (int g = 0; g < group; g++) {
                    const int v = j * num_heads + kv_head * group + g;
                    dot_rows(queries + (size_t)v * head_dim, rows, count, head_dim,
                             scores + (size_t)v * seq_len + first);
                }
        }
    }

    /* Softmax of each vector over the positions its row may see; the rest weigh nothing. */
    for (int v = 0; v < num_vectors; v++) {
        const int visible = seq_len - q_len + v / num_heads + 1;
        float *s = scores + (size_t)v * seq_len;
        float max = -INFINITY;
#pragma omp simd reduction(max : max)
        for (int t = 0; t < visible; t++) max = s[t] > max ? s[t] : max;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int t = 0; t < visible; t++) {
            s[t] = exp_approx(s[t] - max);
            sum += s[t];
        }
        const float inverse = 1.0f / sum;
        for (int t = 0; t < visible; t++) s[t] *= inverse;
        for (int t = visible; t < seq_len; t++) s[t] = 0.0f;
    }

    /* Pass 2: every value row once per page and head, weighted into each vector of the head. */
    memset(acc, 0, (size_t)num_vectors * head_dim * sizeof(float));
    for (int first = 0; first < seq_len; first += block_size) {
        const int64_t block = block_table[first / block_size];
        const int count = seq_len - first < block_size ? seq_len - first : block_size;
        if (first + block_size < seq_len)
            prefetch_page(cache, cache->value, block_table[first / block_size + 1], block_size);
        for (int kv_head = 0; kv_head < num_kv_heads; kv_head++) {
            load_page_rows(cache, cache->value, cache->value_scale, block, count, kv_head,
                           head_dim, rows);
            for (int j = 0; j < q_len; j++)
                for (int g = 0; g < group; g++) {
                    const int v = j * num_heads + kv_head * group + g;
                    weighted_rows(scores + (size_t)v * seq_len + first, rows, count, head_dim,
                                  acc + (size_t)v * head_dim);
                }
        }
    }

    for (int v = 0; v < num_vectors; v++)
        store_row(acc + (size_t)v * head_dim, io_dtype, head_dim,
                  out + ((v / num_heads) * out_row_stride + (v % num_heads) * head_dim) * io_size);
}

/* attend_sequence with the common head sizes as constants, so its loops over a head vector
 * unroll into whole vector registers. */
static void attend_sequence_any(const char *query, int64_t query_row_stride, char *out,
                                int64_t out_row_stride, int io_dtype, const kv_cache *cache,
                                const int32_t *block_table, int seq_len, int q_len, int num_heads,
                                int num_kv_heads, int head_dim, float softmax_scale,
                                float *scratch) {
#define HEAD_DIM_CASE(dim)                                                                     \
    case dim:                                                                                  \
        attend_sequence(query, query_row_stride, out, out_row_stride, io_dtype, cache,         \
                        block_table, seq_len, q_len, num_heads, num_kv_heads, dim,             \
                        softmax_scale, scratch);                                               \
        return;
    switch (head_dim) {
        HEAD_DIM_CASE(64)
        HEAD_DIM_CASE(128)
    }
#undef HEAD_DIM_CASE
    attend_sequence(query, query_row_stride, out, out_row_stride, io_dtype, cache, block_table,
                    seq_len, q_len, num_heads, num_kv_heads, head_dim, softmax_scale, scratch);
}

/* Attend the query rows of sequences `seq_ids[0 .. num_listed)`.
 *
 * query: [N, num_heads, head_dim] of io_dtype (float32 or bf16), rows `query_row_stride`
 *        elements apart
 * out:   [N, num_heads, head_dim] of io_dtype, rows `out_row_stride` elements apart
 * block_tables: [num_seqs, block_table_stride] int32; query_start_loc: [num_seqs + 1] int32;
 * seq_lens: [num_seqs] int32. Returns 0, or -1 if scratch memory could not be had.
 */
int pdserve_paged_attention(const void *query, int64_t query_row_stride, void *out,
                            int64_t out_row_stride, const void *key, const void *value,
                            const float *key_scale, const float *value_scale,
                            int64_t block_stride, int64_t token_stride, int64_t head_stride,
                            int64_t scale_block_stride, int64_t scale_token_stride,
                            int64_t scale_head_stride, int dtype, int block_size,
                            const int32_t *block_tables, int64_t block_table_stride,
                            const int32_t *query_start_loc, const int32_t *seq_lens,
                            const int32_t *seq_ids, int num_listed, int num_heads,
                            int num_kv_heads, int head_dim, float softmax_scale, int io_dtype,
                            int num_threads) {
    const kv_cache cache = {key,          value,        key_scale,          value_scale,
                            block_stride, token_stride, head_stride,        scale_block_stride,
                            scale_token_stride,         scale_head_stride,  dtype,
                            block_size};
    int max_vectors = 0, max_len = 0;
    for (int i = 0; i < num_listed; i++) {
        const int s = seq_ids[i];
        const int q_len = query_start_loc[s + 1] - query_start_loc[s];
        max_vectors = q_len * num_heads > max_vectors ? q_len * num_heads : max_vectors;
        max_len = seq_lens[s] > max_len ? seq_lens[s] : max_len;
    }
    const size_t scratch_floats =
        (size_t)max_vectors * (2 * head_dim + max_len) + (size_t)block_size * head_dim;
    const int64_t io_size = (int64_t)element_size(io_dtype);
    int failed = 0;

#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && num_listed > 1)
    {
        float *scratch = malloc(scratch_floats * sizeof(float));
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
        /* Every thread reaches the worksharing loop, with or without its scratch. */
#pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < num_listed; i++) {
            if (!scratch) continue;
            const int s = seq_ids[i];
            const int start = query_start_loc[s];
            attend_sequence_any((const char *)query + start * query_row_stride * io_size,
                            query_row_stride, (char *)out + start * out_row_stride * io_size,
                            out_row_stride, io_dtype, &cache,
                            block_tables + s * block_table_stride, seq_lens[s],
                            query_start_loc[s + 1] - start, num_heads, num_kv_heads, head_dim,
                            softmax_scale, scratch);
        }
        free(scratch);
    }
    return failed ? -1 : 0;
}

/* Write token n's key and value rows into slot slots[n] of a 16- or 32-bit cache whose dtype
 * is the rows' own (an FP8 cache quantises on the way and goes through the torch reference).
 * key/value: [N, num_kv_heads, head_dim], rows key_stride / value_stride elements apart, unit
 * stride within a row; caches as in kv_cache. */
void pdserve_store_kv(const void *key, int64_t key_stride, const void *value,
                      int64_t value_stride, void *key_cache, void *value_cache,
                      int64_t block_stride, int64_t token_stride, int64_t head_stride,
                      int element_bytes, int block_size, const int64_t *slots, int num_tokens,
                      int num_kv_heads, int head_dim) {
    const size_t row_bytes = (size_t)head_dim * element_bytes;
    for (int n = 0; n < num_tokens; n++) {
        const int64_t block = slots[n] / block_size, offset = slots[n] % block_size;
        for (int h = 0; h < num_kv_heads; h++) {
            const int64_t at = (block * block_stride + offset * token_stride + h * head_stride) *
                               element_bytes;
            memcpy((char *)key_cache + at,
                   (const char *)key + (n * key_stride + h * head_dim) * element_bytes, row_bytes);
            memcpy((char *)value_cache + at,
                   (const char *)value + (n * value_stride + h * head_dim) * element_bytes,
                   row_bytes);
        }
    }
}
