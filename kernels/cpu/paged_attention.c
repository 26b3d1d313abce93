/* Paged attention on the CPU for short query runs (decode steps, speculative verification).
 *
 * One call attends every query row of the listed sequences over their context, read straight
 * from the page-major pool's pages through its strides: nothing is gathered, and only the
 * first seq_len slots of a sequence are ever read, so never-written slots cannot leak in.
 * Keys and values are widened to float32 as they are read (FP8 pages through a table, int8 pages
 * exactly, both times their per-token scales); scores, softmax and the weighted sum of values are
 * float32, so every page dtype goes through the same sums in the same order.
 *
 * Every sum runs in an order fixed by absolute positions alone: a query row at position p gets
 * the same bits whether it is a decode step, one row of a prefill chunk of any length, or sits
 * after a cached prefix, and whatever else is in the batch. Keys are scored in groups of a fixed
 * width, each dot product summed in the same lanes and tree; the softmax denominator is summed
 * in fixed lanes over positions 0..p; values are accumulated in position order and stop at p.
 * Long runs are cut into tiles of ROW_TILE rows, each attending only up to its last row.
 *
 * Layout (see kernels/interface.py): query rows of sequence s are
 * query_start_loc[s] .. query_start_loc[s + 1]; with q rows and L = seq_lens[s], row j sits at
 * position L - q + j and sees positions 0 .. L - q + j; through a sliding window (window > 0),
 * only positions L - q + j - window + 1 .. L - q + j. The pages before the first position a
 * run's first row sees are not read at all (they may be back in the pool): its page table is
 * read from that page on. Positions a row does not see in the pages read get a weight of exact
 * zero, so a row's sums are still fixed by its own position alone.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "exports.h"
#include "kv_rows.h"
#include "numerics.h"

/* Query rows of one sequence attended together: one tile's scores stay small, and tiles of a long
 * prefill chunk spread over the threads. */
#define ROW_TILE 16
/* Pages requested ahead of the one being read, in two steps: into L2 PAGES_TO_L2 ahead, then
 * into L1 PAGES_TO_L1 ahead, a part at a time. A Zen 3 core over SmolLM2's pages (8 x 1024
 * tokens) read 20% faster with 2 to 4 ahead into L1 than with one page ahead at once, and 8 ahead
 * was slower again; on a 2-core AMX Xeon the two steps (10 into L2, then 1 into L1) read 5-10%
 * faster than 4 into L1 alone (benchmarks/step/cpu_attention.py decode, 8 and 32 x 256 and
 * x 1024).
 * Where bf16 rows are read in place (the row sets below), a part's lines are requested a few
 * per key from inside the work rather than all before it: a burst of 64 requests fills the
 * core's line fill buffers, and the work's own loads queue behind them (on the AMX Xeon 10-18%
 * faster at 8 and 32 x 1024, the same at 1 x 256). */
#define PAGES_TO_L2 10
#define PAGES_TO_L1 1
/* Keys scored at a time: the widest vector's lane count. The row buffer holds a page rounded up
 * to it, so the last group of a page is always a full one. */
#if defined(__AVX512F__)
#define KEY_GROUP 16
#else
#define KEY_GROUP 8
#endif

/* The first page a run of q_len query rows ending at seq_len reads: the one holding the first
 * position its first row sees (0 without a window). */
static inline int first_page_read(int seq_len, int q_len, int window, int page_size) {
    const int first_seen = seq_len - q_len - window + 1;
    return window > 0 && first_seen > 0 ? first_seen / page_size : 0;
}

/* Rows of the widened-page buffer: a page rounded up to whole key groups. */
static inline int page_rows(int page_size) {
    return (page_size + KEY_GROUP - 1) / KEY_GROUP * KEY_GROUP;
}

typedef struct {
    const void *key;            /* [num_pages, page_size, num_kv_heads, head_dim], strided */
    const void *value;          /* same shape and strides as key */
    const void *key_scale;      /* [num_pages, page_size, num_kv_heads] or NULL: float32, or */
    const void *value_scale;    /* uint8 codes for KV_INT8; same strides as key_scale */
    int64_t page_stride;       /* elements, for key/value */
    int64_t token_stride;
    int64_t head_stride;
    int64_t scale_page_stride; /* elements, for the scales */
    int64_t scale_token_stride;
    int64_t scale_head_stride;
    int dtype;                  /* enum kv_dtype */
    int page_size;
} kv_cache;

static inline const void *kv_address(const kv_cache *cache, const void *base, int64_t page,
                                     int64_t offset, int kv_head) {
    return (const char *)base + (page * cache->page_stride + offset * cache->token_stride +
                                 kv_head * cache->head_stride) *
                                    (int64_t)element_size(cache->dtype);
}

static inline float kv_scale(const kv_cache *cache, const void *scales, int64_t page,
                             int64_t offset, int kv_head) {
    if (!scales) return 1.0f;
    const int64_t at = page * cache->scale_page_stride + offset * cache->scale_token_stride +
                       kv_head * cache->scale_head_stride;
    if (cache->dtype != KV_INT8) return ((const float *)scales)[at];
    const uint32_t bits = ((uint32_t)((const uint8_t *)scales)[at] << 20) + INT8_SCALE_BITS_BASE;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return scale;
}

/* Pages read one after another: one pass over a sequence's keys or over its values. */
typedef struct {
    const void *base; /* kv_cache's key or value */
    const int32_t *page_table;
    int num_pages;
} page_run;

/* Where part `part` of `parts` of page `index` of the stream of pages that reads `now` and then
 * `then` starts, and how many 64-byte lines it has (0 past the stream's end). A call's passes
 * are requested as one stream (a sequence's keys, its values, the next work item's keys, ...),
 * so a pass starts on pages already requested instead of requesting its first ones as it
 * starts. */
static inline __attribute__((always_inline)) const char *stream_part_lines(
    const kv_cache *cache, const page_run *now, const page_run *then, int index, int part,
    int parts, int *count) {
    const void *base;
    int64_t page;
    *count = 0;
    if (index < now->num_pages) {
        base = now->base;
        page = now->page_table[index];
    } else if (index - now->num_pages < then->num_pages) {
        base = then->base;
        page = then->page_table[index - now->num_pages];
    } else {
        return NULL;
    }
    const int64_t lines =
        (cache->page_size * cache->token_stride * (int64_t)element_size(cache->dtype) + 63) / 64;
    *count = (int)(lines * (part + 1) / parts - lines * part / parts);
    return (const char *)kv_address(cache, base, page, 0, 0) + 64 * (lines * part / parts);
}

/* Lines of the pages ahead to pull toward the core, into L2 and into L1: pages sit anywhere in
 * the pool, so no hardware prefetcher sees the next one coming. A page is requested a part at a
 * time between pieces of work, not at once: a whole page's lines in one burst fill the core's
 * queue of loads, and the work waits behind them; where the work reads bf16 rows in place it
 * requests a few lines per key it reads (request_lines), so that they go out between its loads.
 * Always inlined, as are its callers: gcc takes a function that only prefetches for one without
 * effects, and drops its calls. */
typedef struct {
    const char *to_l2, *to_l1; /* the next line of each part */
    int left_l2, left_l1;      /* lines of each part not yet requested */
    int per_key;               /* lines of each requested per key: a page's keys request all */
} lines_ahead;

/* The two parts ahead of page `index` of a pass over `now` (then `then`): part `part` of the
 * page PAGES_TO_L2 ahead, for L2, and of the page PAGES_TO_L1 ahead, for L1. */
static inline __attribute__((always_inline)) lines_ahead lines_ahead_of(
    const kv_cache *cache, const page_run *now, const page_run *then, int index, int part,
    int parts) {
    lines_ahead ahead;
    ahead.to_l2 = stream_part_lines(cache, now, then, index + PAGES_TO_L2, part, parts,
                                    &ahead.left_l2);
    ahead.to_l1 = stream_part_lines(cache, now, then, index + PAGES_TO_L1, part, parts,
                                    &ahead.left_l1);
    const int most = ahead.left_l2 > ahead.left_l1 ? ahead.left_l2 : ahead.left_l1;
    ahead.per_key = (most + cache->page_size - 1) / cache->page_size;
    return ahead;
}

static inline __attribute__((always_inline)) void request_lines(lines_ahead *ahead, int n) {
    for (int i = 0; i < n && ahead->left_l2 > 0; i++, ahead->left_l2--, ahead->to_l2 += 64)
        __builtin_prefetch(ahead->to_l2, 0, 2);
    for (int i = 0; i < n && ahead->left_l1 > 0; i++, ahead->left_l1--, ahead->to_l1 += 64)
        __builtin_prefetch(ahead->to_l1, 0, 3);
}

/* What the work left unrequested (a page of fewer keys than page_size), or all of it. */
static inline __attribute__((always_inline)) void request_rest(lines_ahead *ahead) {
    request_lines(ahead, ahead->left_l2 > ahead->left_l1 ? ahead->left_l2 : ahead->left_l1);
}

/* Both parts ahead of page `index` at once, before a piece of work on it. */
static inline __attribute__((always_inline)) void prefetch_ahead(const kv_cache *cache,
                                                                 const page_run *now,
                                                                 const page_run *then, int index,
                                                                 int part, int parts) {
    lines_ahead ahead = lines_ahead_of(cache, now, then, index, part, parts);
    request_rest(&ahead);
}

/* Sums in 8 fixed lanes (element i into lane i % 8) and then a fixed tree: the compiler may
 * vectorise these loops but not reorder them, so the result depends on the values alone, not on
 * how the loop was compiled or where the data sits. */
static inline float lane_tree(float lanes[8]) {
    return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +
           ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

static inline float ordered_sum(const float *restrict x, int n) {
    float lanes[8] = {0};
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; l++) lanes[l] += x[i + l];
    for (int l = 0; i + l < n; l++) lanes[l] += x[i + l];
    return lane_tree(lanes);
}

static inline float ordered_dot(const float *restrict a, const float *restrict b, int n) {
    float lanes[8] = {0};
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; l++) lanes[l] += a[i + l] * b[i + l];
    for (int l = 0; i + l < n; l++) lanes[l] += a[i + l] * b[i + l];
    return lane_tree(lanes);
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

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
/* out[i] = the sum of v[i]'s 8 lanes, for 8 vectors at once: ((0+1)+(2+3))+((4+5)+(6+7)). */
static inline __m256 sum8(const __m256 v[8]) {
    const __m256 a01 = _mm256_hadd_ps(v[0], v[1]), a23 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 a45 = _mm256_hadd_ps(v[4], v[5]), a67 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 low = _mm256_hadd_ps(a01, a23), high = _mm256_hadd_ps(a45, a67);
    return _mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20),
                         _mm256_permute2f128_ps(low, high, 0x31));
}
#endif

/* Keep the first `count` of a group's KEY_GROUP scores. */
static inline void store_scores(const float *group, int count, float *restrict scores) {
    memcpy(scores, group, (size_t)(count < KEY_GROUP ? count : KEY_GROUP) * sizeof(float));
}

/* scores[t] = q . rows[t] for `count` rows of `head_dim` floats. `rows` has room for `count`
 * rounded up to KEY_GROUP rows, scored and dropped past `count`: every key, the last ones of a
 * page included, is summed by the same code in the same lanes and order. */
static inline __attribute__((always_inline)) void dot_rows(const float *restrict q,
                                                           const float *restrict rows, int count,
                                                           int head_dim, float *restrict scores) {
#ifdef __AVX512F__
    if (head_dim % 16 == 0 && head_dim <= 256) {
        __m512 qv[16], partial[16];
        float group[16];
        const int chunks = head_dim / 16;
        for (int c = 0; c < chunks; c++) qv[c] = _mm512_loadu_ps(q + 16 * c);
        for (int first = 0; first < count; first += 16) {
            for (int t = 0; t < 16; t++) {
                const float *row = rows + (first + t) * head_dim;
                __m512 sum = _mm512_mul_ps(qv[0], _mm512_loadu_ps(row));
                for (int c = 1; c < chunks; c++)
                    sum = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(row + 16 * c), sum);
                partial[t] = sum;
            }
            _mm512_storeu_ps(group, sum16(partial));
            store_scores(group, count - first, scores + first);
        }
        return;
    }
#elif defined(__AVX2__) && defined(__FMA__)
    if (head_dim % 8 == 0 && head_dim <= 256) {
        __m256 partial[8];
        float group[8];
        const int chunks = head_dim / 8;
        for (int first = 0; first < count; first += 8) {
            const float *group_rows = rows + first * head_dim;
            /* Chunk by chunk across the eight keys: each chunk of q is loaded once. */
            const __m256 q0 = _mm256_loadu_ps(q);
            for (int t = 0; t < 8; t++)
                partial[t] = _mm256_mul_ps(q0, _mm256_loadu_ps(group_rows + t * head_dim));
            for (int c = 1; c < chunks; c++) {
                const __m256 qc = _mm256_loadu_ps(q + 8 * c);
                for (int t = 0; t < 8; t++)
                    partial[t] = _mm256_fmadd_ps(
                        qc, _mm256_loadu_ps(group_rows + t * head_dim + 8 * c), partial[t]);
            }
            _mm256_storeu_ps(group, sum8(partial));
            store_scores(group, count - first, scores + first);
        }
        return;
    }
#endif
    for (int t = 0; t < count; t++) scores[t] = ordered_dot(q, rows + t * head_dim, head_dim);
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
#elif defined(__AVX2__) && defined(__FMA__)
    if (head_dim % 8 == 0 && head_dim <= 128) {
        __m256 sum[16];
        const int chunks = head_dim / 8;
        for (int c = 0; c < chunks; c++) sum[c] = _mm256_loadu_ps(acc + 8 * c);
        for (int t = 0; t < count; t++) {
            const __m256 p = _mm256_set1_ps(weights[t]);
            for (int c = 0; c < chunks; c++)
                sum[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(rows + t * head_dim + 8 * c), sum[c]);
        }
        for (int c = 0; c < chunks; c++) _mm256_storeu_ps(acc + 8 * c, sum[c]);
        return;
    }
#endif
    for (int t = 0; t < count; t++) {
        const float p = weights[t];
#pragma omp simd
        for (int d = 0; d < head_dim; d++) acc[d] += p * rows[t * head_dim + d];
    }
}

/* dot_rows for two query vectors over the same keys: on AVX2 four keys at a time, each chunk of
 * a key row loaded once for both vectors. Every score is summed exactly as dot_rows sums it
 * (the same lanes, the same tree). */
static inline __attribute__((always_inline)) void dot_rows_pair(
    const float *restrict qa, const float *restrict qb, const float *restrict rows, int count,
    int head_dim, float *restrict scores_a, float *restrict scores_b) {
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
    if (head_dim % 8 == 0 && head_dim <= 256) {
        __m256 partial[8];
        float group[8];
        const int chunks = head_dim / 8;
        for (int first = 0; first < count; first += 4) {
            const float *group_rows = rows + first * head_dim;
            const __m256 a0 = _mm256_loadu_ps(qa), b0 = _mm256_loadu_ps(qb);
            for (int t = 0; t < 4; t++) {
                const __m256 row = _mm256_loadu_ps(group_rows + t * head_dim);
                partial[t] = _mm256_mul_ps(a0, row);
                partial[4 + t] = _mm256_mul_ps(b0, row);
            }
            for (int c = 1; c < chunks; c++) {
                const __m256 ac = _mm256_loadu_ps(qa + 8 * c), bc = _mm256_loadu_ps(qb + 8 * c);
                for (int t = 0; t < 4; t++) {
                    const __m256 row = _mm256_loadu_ps(group_rows + t * head_dim + 8 * c);
                    partial[t] = _mm256_fmadd_ps(ac, row, partial[t]);
                    partial[4 + t] = _mm256_fmadd_ps(bc, row, partial[4 + t]);
                }
            }
            _mm256_storeu_ps(group, sum8(partial));
            const int n = count - first < 4 ? count - first : 4;
            memcpy(scores_a + first, group, (size_t)n * sizeof(float));
            memcpy(scores_b + first, group + 4, (size_t)n * sizeof(float));
        }
        return;
    }
#endif
    dot_rows(qa, rows, count, head_dim, scores_a);
    dot_rows(qb, rows, count, head_dim, scores_b);
}

/* weighted_rows for two vectors over the same rows, the first `count_a` rows into acc_a and
 * the first `count_b` into acc_b: on AVX2 each chunk of a row is loaded once for both. Every
 * output sums its rows in position order, exactly as weighted_rows does. */
static inline __attribute__((always_inline)) void weighted_rows_pair(
    const float *restrict weights_a, const float *restrict weights_b, const float *restrict rows,
    int count_a, int count_b, int head_dim, float *restrict acc_a, float *restrict acc_b) {
    int common = 0;
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
    if (head_dim % 32 == 0 && head_dim <= 128) {
        common = count_a < count_b ? count_a : count_b;
        for (int d0 = 0; d0 < head_dim; d0 += 32) {
            __m256 sum_a[4], sum_b[4];
            for (int c = 0; c < 4; c++) {
                sum_a[c] = _mm256_loadu_ps(acc_a + d0 + 8 * c);
                sum_b[c] = _mm256_loadu_ps(acc_b + d0 + 8 * c);
            }
            for (int t = 0; t < common; t++) {
                const __m256 pa = _mm256_set1_ps(weights_a[t]), pb = _mm256_set1_ps(weights_b[t]);
                for (int c = 0; c < 4; c++) {
                    const __m256 row = _mm256_loadu_ps(rows + t * head_dim + d0 + 8 * c);
                    sum_a[c] = _mm256_fmadd_ps(pa, row, sum_a[c]);
                    sum_b[c] = _mm256_fmadd_ps(pb, row, sum_b[c]);
                }
            }
            for (int c = 0; c < 4; c++) {
                _mm256_storeu_ps(acc_a + d0 + 8 * c, sum_a[c]);
                _mm256_storeu_ps(acc_b + d0 + 8 * c, sum_b[c]);
            }
        }
    }
#endif
    if (count_a > common)
        weighted_rows(weights_a + common, rows + common * head_dim, count_a - common, head_dim,
                      acc_a);
    if (count_b > common)
        weighted_rows(weights_b + common, rows + common * head_dim, count_b - common, head_dim,
                      acc_b);
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define HAVE_BF16_ROW_SETS 1
/* Query vectors scored and weighted together straight from a page's bf16 rows: the query heads
 * of one KV head in one query row (a decode step's whole group, for SmolLM2's 3 and Llama's 4 a
 * set or two). */
#define ROW_SET 3
/* Head sizes the row sets take: whole multiples of the values' blocks of dimensions. */
#define ROW_SET_DIM_MULTIPLE 32
#define ROW_SET_MAX_DIM INT32_MAX
/* Runs of more query rows than this widen a page's rows once into the buffer instead, where they
 * serve every row (measured on a Zen 3 core, SmolLM2's heads: in registers one row attends 30%
 * faster over 8 x 256 tokens, two rows 8%, three and four alike, five 7% slower, 16 15%). Both
 * paths sum in the same order: a row's bits do not depend on which one it took. */
#define ROW_SET_MAX_QUERY_ROWS 4

/* Eight bf16 values widened to float32 (exact: a 16-bit shift). */
static inline __attribute__((always_inline)) __m256 bf16x8(const uint16_t *bits) {
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)bits)), 16));
}

/* out[i] = the sum of v[i]'s 8 lanes for 4 vectors, in sum8's tree. */
static inline __m128 sum4(const __m256 v[4]) {
    const __m256 quads = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    return _mm_add_ps(_mm256_castps256_ps128(quads), _mm256_extractf128_ps(quads, 1));
}

/* scores[v][t] = q[v] . rows[t] for `n` <= ROW_SET query vectors over `count` bf16 rows
 * `row_stride` elements apart, four keys at a time: each chunk of a row is widened once, in
 * registers, for all n vectors. Every score is summed as dot_rows sums it (the same lanes, the
 * same tree), so a row gets the same bits on either path. The last four keys of a page repeat
 * its last row where it has fewer, and those scores are dropped. */
static inline __attribute__((always_inline)) void score_bf16_rows(
    const float *const q[ROW_SET], const int n, const uint16_t *rows, int64_t row_stride,
    int count, const int head_dim, float *const scores[ROW_SET], lines_ahead *ahead) {
    const int chunks = head_dim / 8;
    for (int first = 0; first < count; first += 4) {
        const uint16_t *row[4];
        for (int t = 0; t < 4; t++)
            row[t] = rows + (first + t < count ? first + t : count - 1) * row_stride;
        request_lines(ahead, 4 * ahead->per_key);
        __m256 partial[ROW_SET][4];
        for (int t = 0; t < 4; t++) {
            const __m256 key = bf16x8(row[t]);
            for (int v = 0; v < n; v++) partial[v][t] = _mm256_mul_ps(_mm256_loadu_ps(q[v]), key);
        }
        for (int c = 1; c < chunks; c++)
            for (int t = 0; t < 4; t++) {
                const __m256 key = bf16x8(row[t] + 8 * c);
                for (int v = 0; v < n; v++)
                    partial[v][t] =
                        _mm256_fmadd_ps(_mm256_loadu_ps(q[v] + 8 * c), key, partial[v][t]);
            }
        const int kept = count - first < 4 ? count - first : 4;
        float group[4];
        for (int v = 0; v < n; v++) {
            _mm_storeu_ps(group, sum4(partial[v]));
            memcpy(scores[v] + first, group, (size_t)kept * sizeof(float));
        }
    }
}

/* acc[v] += sum_t weights[v][t] * rows[t] over the first `count` bf16 rows, for `n` <= ROW_SET
 * vectors, 32 dimensions at a time: each chunk of a row is widened once for all n. Every output
 * sums its rows in position order, exactly as weighted_rows does. */
static inline __attribute__((always_inline)) void weigh_bf16_rows(
    const float *const weights[ROW_SET], const int n, const uint16_t *rows, int64_t row_stride,
    int count, const int head_dim, float *const acc[ROW_SET], lines_ahead *ahead) {
    for (int d0 = 0; d0 < head_dim; d0 += 32) {
        __m256 sum[ROW_SET][4];
        for (int v = 0; v < n; v++)
            for (int c = 0; c < 4; c++) sum[v][c] = _mm256_loadu_ps(acc[v] + d0 + 8 * c);
        for (int t = 0; t < count; t++) {
            request_lines(ahead, ahead->per_key);
            const uint16_t *row = rows + t * row_stride + d0;
            __m256 p[ROW_SET];
            for (int v = 0; v < n; v++) p[v] = _mm256_set1_ps(weights[v][t]);
            for (int c = 0; c < 4; c++) {
                const __m256 value = bf16x8(row + 8 * c);
                for (int v = 0; v < n; v++) sum[v][c] = _mm256_fmadd_ps(p[v], value, sum[v][c]);
            }
        }
        for (int v = 0; v < n; v++)
            for (int c = 0; c < 4; c++) _mm256_storeu_ps(acc[v] + d0 + 8 * c, sum[v][c]);
    }
}

#endif

#ifdef __AVX512F__
#define HAVE_BF16_ROW_SETS 1
/* As on AVX2 (above): the query heads of one KV head in one query row, scored and weighted
 * straight from a page's bf16 rows, each chunk of a row widened once, in a register, for the
 * whole set. Both paths sum as dot_rows and weighted_rows do on AVX-512, so a row gets the same
 * bits whichever it takes (measured on a 2-core Xeon, SmolLM2's heads, pages from memory:
 * decode attention over 8 x 256 tokens 12% faster than through the widened buffer, over
 * 8 x 1024 15%). */
#define ROW_SET 3
/* Whole blocks of 64 dimensions, and no more than dot_rows sums in 16-lane chunks. */
#define ROW_SET_DIM_MULTIPLE 64
#define ROW_SET_MAX_DIM 256
#define ROW_SET_MAX_QUERY_ROWS 4

/* Sixteen bf16 values widened to float32 (exact: a 16-bit shift). */
static inline __attribute__((always_inline)) __m512 bf16x16(const uint16_t *bits) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)bits)), 16));
}

/* Lane i (i < 8) = the sum of v[i]'s 16 lanes, in sum16's tree: the first half of sum16, whose
 * lanes 0-7 depend on v[0..8) alone. */
static inline __m512 sum16_first8(const __m512 v[8]) {
    __m512 pairs[4], quads[2];
    for (int i = 0; i < 4; i++)
        pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                                 _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 2; i++)
        quads[i] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0x44),
                                 _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0xEE));
    const __m512 octs = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88),
                                      _mm512_shuffle_f32x4(quads[0], quads[1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(octs, octs, 0x88),
                         _mm512_shuffle_f32x4(octs, octs, 0xDD));
}

/* scores[v][t] = q[v] . rows[t] for `n` <= ROW_SET query vectors over `count` bf16 rows
 * `row_stride` elements apart, eight keys at a time (3 x 8 sums fill the registers). Each sum
 * runs over the head in 16-lane chunks and ends in sum16's tree, as dot_rows sums it. The last
 * eight keys of a page repeat its last row where it has fewer, and those scores are dropped. */
static inline __attribute__((always_inline)) void score_bf16_rows(
    const float *const q[ROW_SET], const int n, const uint16_t *rows, int64_t row_stride,
    int count, const int head_dim, float *const scores[ROW_SET], lines_ahead *ahead) {
    const int chunks = head_dim / 16;
    for (int first = 0; first < count; first += 8) {
        __m512 partial[ROW_SET][8];
        for (int t = 0; t < 8; t++) {
            request_lines(ahead, ahead->per_key);
            const uint16_t *row = rows + (first + t < count ? first + t : count - 1) * row_stride;
            const __m512 key = bf16x16(row);
            for (int v = 0; v < n; v++) partial[v][t] = _mm512_mul_ps(_mm512_loadu_ps(q[v]), key);
            for (int c = 1; c < chunks; c++) {
                const __m512 key_c = bf16x16(row + 16 * c);
                for (int v = 0; v < n; v++)
                    partial[v][t] =
                        _mm512_fmadd_ps(_mm512_loadu_ps(q[v] + 16 * c), key_c, partial[v][t]);
            }
        }
        /* Lanes 0-7 hold the eight keys' sums: a masked store keeps those the page has. */
        const int kept = count - first < 8 ? count - first : 8;
        for (int v = 0; v < n; v++)
            _mm512_mask_storeu_ps(scores[v] + first, (__mmask16)((1u << kept) - 1),
                                  sum16_first8(partial[v]));
    }
}

/* acc[v] += sum_t weights[v][t] * rows[t] over the first `count` bf16 rows, for `n` <= ROW_SET
 * vectors, 64 dimensions at a time: each chunk of a row is widened once for all n. Every output
 * sums its rows in position order, exactly as weighted_rows does. */
static inline __attribute__((always_inline)) void weigh_bf16_rows(
    const float *const weights[ROW_SET], const int n, const uint16_t *rows, int64_t row_stride,
    int count, const int head_dim, float *const acc[ROW_SET], lines_ahead *ahead) {
    for (int d0 = 0; d0 < head_dim; d0 += 64) {
        __m512 sum[ROW_SET][4];
        for (int v = 0; v < n; v++)
            for (int c = 0; c < 4; c++) sum[v][c] = _mm512_loadu_ps(acc[v] + d0 + 16 * c);
        for (int t = 0; t < count; t++) {
            request_lines(ahead, ahead->per_key);
            const uint16_t *row = rows + t * row_stride + d0;
            __m512 p[ROW_SET];
            for (int v = 0; v < n; v++) p[v] = _mm512_set1_ps(weights[v][t]);
            for (int c = 0; c < 4; c++) {
                const __m512 value = bf16x16(row + 16 * c);
                for (int v = 0; v < n; v++) sum[v][c] = _mm512_fmadd_ps(p[v], value, sum[v][c]);
            }
        }
        for (int v = 0; v < n; v++)
            for (int c = 0; c < 4; c++) _mm512_storeu_ps(acc[v] + d0 + 16 * c, sum[v][c]);
    }
}
#endif

#ifdef __AVX512BF16__
#define HAVE_BF16_PAIR_SCORES 1
/* Scores of bf16 queries over bf16 keys with vdpbf16ps, two products per lane and no widening:
 * lane i of a 32-value chunk adds q[2i+1] k[2i+1], then q[2i] k[2i] (each product exact, each
 * add rounded to float32, denormals read and written as zero), chunk after chunk; the 16 lanes
 * then go through sum16's tree and the sum is multiplied by the softmax scale. That is another
 * order than the widening path's (16-lane chunks of FMAs over scaled queries), so it is a
 * rounding path of its own, with its own twin (tests/kernel_twins.py's bf16_pair_scores); every
 * query row takes it, whatever its run's length, so a position's bits stay the same however a
 * step is batched. Off unless asked for: on a 2-core AMX Xeon (SmolLM2's heads) it changed
 * nothing measurable, cached pages or not, since the kernel's time there is not in the score
 * products; it is here for processors whose FMAs are the slower half (an AVX-512 BF16 EPYC). */
#define PAIR_SCORE_MAX_DIM 256
static int bf16_pair_scores_on = 0; /* kernels/cpu/library.py's ENV_BF16_PAIR_SCORES */

int pdserve_bf16_pair_scores_available(void) { return 1; }

int pdserve_use_bf16_pair_scores(int on) {
    bf16_pair_scores_on = on != 0;
    return 0;
}

int pdserve_bf16_pair_scores(void) { return bf16_pair_scores_on; }

/* scores[v][t] = scale * (q[v] . rows[t]) for `n` <= ROW_SET bf16 query vectors over `count`
 * bf16 rows `row_stride` elements apart, eight keys at a time. The last eight keys of a page
 * repeat its last row where it has fewer, and those scores are dropped. */
static inline __attribute__((always_inline)) void score_bf16_pairs(
    const uint16_t *const q[ROW_SET], const int n, const uint16_t *rows, int64_t row_stride,
    int count, const int head_dim, float scale, float *const scores[ROW_SET]) {
    const int chunks = head_dim / 32;
    const __m512 scale16 = _mm512_set1_ps(scale);
    for (int first = 0; first < count; first += 8) {
        __m512 partial[ROW_SET][8];
        for (int t = 0; t < 8; t++) {
            const uint16_t *row = rows + (first + t < count ? first + t : count - 1) * row_stride;
            for (int v = 0; v < n; v++) partial[v][t] = _mm512_setzero_ps();
            for (int c = 0; c < chunks; c++) {
                const __m512bh key = (__m512bh)_mm512_loadu_si512(row + 32 * c);
                for (int v = 0; v < n; v++)
                    partial[v][t] = _mm512_dpbf16_ps(
                        partial[v][t], (__m512bh)_mm512_loadu_si512(q[v] + 32 * c), key);
            }
        }
        const int kept = count - first < 8 ? count - first : 8;
        for (int v = 0; v < n; v++)
            _mm512_mask_storeu_ps(scores[v] + first, (__mmask16)((1u << kept) - 1),
                                  _mm512_mul_ps(sum16_first8(partial[v]), scale16));
    }
}

/* score_bf16_pairs with the common sizes as constants. */
static void bf16_pair_score_set(const uint16_t *const q[ROW_SET], const int n,
                                const uint16_t *rows, int64_t row_stride, int count,
                                const int head_dim, float scale, float *const scores[ROW_SET]) {
#define PAIR_CASE(sets, dim)                                                                   \
    if (n == sets && head_dim == dim) {                                                        \
        score_bf16_pairs(q, sets, rows, row_stride, count, dim, scale, scores);               \
        return;                                                                                \
    }
    PAIR_CASE(1, 64) PAIR_CASE(2, 64) PAIR_CASE(3, 64)
    PAIR_CASE(1, 128) PAIR_CASE(2, 128) PAIR_CASE(3, 128)
#undef PAIR_CASE
    score_bf16_pairs(q, n, rows, row_stride, count, head_dim, scale, scores);
}

/* Test entry: scores of one bf16 query vector over `count` bf16 rows as attention computes them
 * on this path. Returns -1 where the processor lacks it or the head size does not fit. */
int pdserve_bf16_pair_scores_of(const uint16_t *query, const uint16_t *rows, int64_t row_stride,
                                int count, int head_dim, float scale, float *scores) {
    if (head_dim % 32 != 0 || head_dim > PAIR_SCORE_MAX_DIM) return -1;
    const uint16_t *q[ROW_SET] = {query};
    float *out[ROW_SET] = {scores};
    bf16_pair_score_set(q, 1, rows, row_stride, count, head_dim, scale, out);
    return 0;
}
#else
int pdserve_bf16_pair_scores_available(void) { return 0; }
int pdserve_use_bf16_pair_scores(int on) { return on ? -1 : 0; }
int pdserve_bf16_pair_scores(void) { return 0; }
int pdserve_bf16_pair_scores_of(const uint16_t *query, const uint16_t *rows, int64_t row_stride,
                                int count, int head_dim, float scale, float *scores) {
    (void)query, (void)rows, (void)row_stride, (void)count, (void)head_dim, (void)scale;
    (void)scores;
    return -1;
}
#endif

#ifdef HAVE_BF16_ROW_SETS
/* A page's `count` key rows (`is_value` 0) of one KV head scored against the `n` query vectors
 * of a set into outputs[v], or its first `count` value rows weighted by the scores in
 * vectors[v] into the sums outputs[v], requesting `ahead`'s lines as it goes; with the common
 * sizes as constants. */
static void bf16_row_set(const float *const vectors[ROW_SET], const int n, const uint16_t *rows,
                         int64_t row_stride, int count, const int head_dim, const int is_value,
                         float *const outputs[ROW_SET], lines_ahead *ahead) {
#define SET_CASE(sets, dim)                                                                    \
    if (n == sets && head_dim == dim) {                                                        \
        if (is_value)                                                                          \
            weigh_bf16_rows(vectors, sets, rows, row_stride, count, dim, outputs, ahead);     \
        else                                                                                   \
            score_bf16_rows(vectors, sets, rows, row_stride, count, dim, outputs, ahead);     \
        return;                                                                                \
    }
    SET_CASE(1, 64) SET_CASE(2, 64) SET_CASE(3, 64)
    SET_CASE(1, 128) SET_CASE(2, 128) SET_CASE(3, 128)
#undef SET_CASE
    if (is_value)
        weigh_bf16_rows(vectors, n, rows, row_stride, count, head_dim, outputs, ahead);
    else
        score_bf16_rows(vectors, n, rows, row_stride, count, head_dim, outputs, ahead);
}
#endif

/* One page's rows of one KV head, widened to float32: rows[offset][head_dim]. */
static inline __attribute__((always_inline)) void load_page_rows(const kv_cache *cache,
                                                                 const void *base,
                                                                 const void *scales,
                                                                 int64_t page, int count,
                                                                 int kv_head, int head_dim,
                                                                 float *restrict rows) {
    for (int offset = 0; offset < count; offset++)
        load_row(kv_address(cache, base, page, offset, kv_head), cache->dtype,
                 kv_scale(cache, scales, page, offset, kv_head), head_dim,
                 rows + offset * head_dim);
}

/* One sequence, all heads: its q_len x num_heads query vectors. Page by page and KV head by KV
 * head, the page's rows are widened once into a small buffer that stays in L1 while every query
 * vector of that head goes over it. */
static inline __attribute__((always_inline)) void attend_sequence(
    const char *query, int64_t query_row_stride, char *out, int64_t out_row_stride, int io_dtype,
    const kv_cache *cache, const int32_t *page_table, int seq_len, int q_len, int window,
    int num_heads, int num_kv_heads, int head_dim, float softmax_scale,
    const page_run *next_keys, int first_pages_requested, float *scratch) {
    const size_t io_size = element_size(io_dtype);
    const int group = num_heads / num_kv_heads;
    const int num_vectors = q_len * num_heads; /* vector v: row v / num_heads, head v % num_heads */
    const int page_size = cache->page_size;
    float *restrict queries = scratch;                              /* [num_vectors, head_dim] */
    float *restrict acc = queries + (size_t)num_vectors * head_dim; /* [num_vectors, head_dim] */
    float *restrict rows = acc + (size_t)num_vectors * head_dim; /* [page_rows(), head_dim] */
    /* Positions base .. seq_len - 1 are read: the pages before base hold none a row sees. */
    const int skipped = first_page_read(seq_len, q_len, window, page_size);
    const int base = skipped * page_size, span = seq_len - base;
    float *restrict scores = rows + (size_t)page_rows(page_size) * head_dim; /* [vectors, span] */
#ifdef HAVE_BF16_PAIR_SCORES
    /* bf16 queries over bf16 pages: scored in pairs, for every run length alike. */
    const int pair_scores = bf16_pair_scores_on && cache->dtype == KV_BF16 &&
                            io_dtype == KV_BF16 && head_dim % 32 == 0 &&
                            head_dim <= PAIR_SCORE_MAX_DIM;
#endif
#ifdef HAVE_BF16_ROW_SETS
    /* bf16 pages are read in place, each row widened in registers for the vectors of a set. */
    const int bf16_rows =
        cache->dtype == KV_BF16 && head_dim % ROW_SET_DIM_MULTIPLE == 0 &&
        head_dim <= ROW_SET_MAX_DIM && q_len <= ROW_SET_MAX_QUERY_ROWS;
#endif

    for (int j = 0; j < q_len; j++)
        for (int head = 0; head < num_heads; head++) {
#ifdef HAVE_BF16_PAIR_SCORES
            if (pair_scores) break; /* read in place */
#endif
            float *dst = queries + (size_t)(j * num_heads + head) * head_dim;
            load_row(query + (j * query_row_stride + head * head_dim) * io_size, io_dtype, 1.0f,
                     head_dim, dst);
            for (int d = 0; d < head_dim; d++) dst[d] *= softmax_scale;
        }

    /* Pass 1: scores of every vector over the whole context (causality is applied below). */
    const int num_pages = (seq_len + page_size - 1) / page_size - skipped;
    const page_run key_run = {cache->key, page_table + skipped, num_pages};
    const page_run value_run = {cache->value, page_table + skipped, num_pages};
    if (!first_pages_requested)
        for (int index = 0; index < PAGES_TO_L2; index++) {
            /* The first pages whole: those up to PAGES_TO_L1 into L1, the rest into L2. */
            lines_ahead whole = {0};
            if (index < PAGES_TO_L1)
                whole.to_l1 = stream_part_lines(cache, &key_run, &value_run, index, 0, 1,
                                                &whole.left_l1);
            else
                whole.to_l2 = stream_part_lines(cache, &key_run, &value_run, index, 0, 1,
                                                &whole.left_l2);
            request_rest(&whole);
        }
    for (int first = base; first < seq_len; first += page_size) {
        const int64_t page = page_table[first / page_size];
        const int count = seq_len - first < page_size ? seq_len - first : page_size;
        for (int kv_head = 0; kv_head < num_kv_heads; kv_head++) {
#ifdef HAVE_BF16_PAIR_SCORES
            if (pair_scores) {
                prefetch_ahead(cache, &key_run, &value_run, (first - base) / page_size, kv_head,
                               num_kv_heads);
                const uint16_t *keys = kv_address(cache, cache->key, page, 0, kv_head);
                for (int j = 0; j < q_len; j++)
                    for (int g = 0; g < group; g += ROW_SET) {
                        const int n = group - g < ROW_SET ? group - g : ROW_SET;
                        const uint16_t *vectors[ROW_SET];
                        float *outputs[ROW_SET];
                        for (int v = 0; v < n; v++) {
                            const int head = kv_head * group + g + v;
                            vectors[v] = (const uint16_t *)query +
                                         j * query_row_stride + head * head_dim;
                            outputs[v] =
                                scores + (size_t)(j * num_heads + head) * span + first - base;
                        }
                        bf16_pair_score_set(vectors, n, keys, cache->token_stride, count,
                                            head_dim, softmax_scale, outputs);
                    }
                continue;
            }
#endif
#ifdef HAVE_BF16_ROW_SETS
            if (bf16_rows) {
                lines_ahead ahead =
                    lines_ahead_of(cache, &key_run, &value_run, (first - base) / page_size,
                                   kv_head, num_kv_heads);
                const uint16_t *keys = kv_address(cache, cache->key, page, 0, kv_head);
                for (int j = 0; j < q_len; j++)
                    for (int g = 0; g < group; g += ROW_SET) {
                        const int n = group - g < ROW_SET ? group - g : ROW_SET;
                        const float *vectors[ROW_SET];
                        float *outputs[ROW_SET];
                        for (int v = 0; v < n; v++) {
                            const int a = j * num_heads + kv_head * group + g + v;
                            vectors[v] = queries + (size_t)a * head_dim;
                            outputs[v] = scores + (size_t)a * span + first - base;
                        }
                        bf16_row_set(vectors, n, keys, cache->token_stride, count, head_dim, 0,
                                     outputs, &ahead);
                    }
                request_rest(&ahead);
                continue;
            }
#endif
            prefetch_ahead(cache, &key_run, &value_run, (first - base) / page_size, kv_head,
                           num_kv_heads);
            load_page_rows(cache, cache->key, cache->key_scale, page, count, kv_head, head_dim,
                           rows);
            /* The head's vectors (row i / group, query head i % group of this KV head), by twos. */
            for (int i = 0; i < q_len * group; i += 2) {
                const int a = (i / group) * num_heads + kv_head * group + i % group;
                if (i + 1 == q_len * group) {
                    dot_rows(queries + (size_t)a * head_dim, rows, count, head_dim,
                             scores + (size_t)a * span + first - base);
                    break;
                }
                const int b = ((i + 1) / group) * num_heads + kv_head * group + (i + 1) % group;
                dot_rows_pair(queries + (size_t)a * head_dim, queries + (size_t)b * head_dim, rows,
                              count, head_dim, scores + (size_t)a * span + first - base,
                              scores + (size_t)b * span + first - base);
            }
        }
    }

    /* Softmax of each vector over the positions its row may see (the maximum is exact in any
     * order; the denominator is summed in fixed lanes from the first of them). Positions before
     * a window weigh an exact zero in pass 2. */
    for (int v = 0; v < num_vectors; v++) {
        const int position = seq_len - q_len + v / num_heads;
        const int first_seen =
            window > 0 && position - window + 1 > base ? position - window + 1 : base;
        const int visible = position + 1 - first_seen;
        memset(scores + (size_t)v * span, 0, (size_t)(first_seen - base) * sizeof(float));
        float *s = scores + (size_t)v * span + first_seen - base;
        float max = -INFINITY;
#pragma omp simd reduction(max : max)
        for (int t = 0; t < visible; t++) max = s[t] > max ? s[t] : max;
#pragma omp simd
        for (int t = 0; t < visible; t++) s[t] = exp_approx(s[t] - max);
        const float inverse = 1.0f / ordered_sum(s, visible);
#pragma omp simd
        for (int t = 0; t < visible; t++) s[t] *= inverse;
    }

    /* Pass 2: every value row once per page and head, weighted into each vector of the head in
     * position order, up to the vector's own position (its first pages were requested by pass
     * 1's last ones). */
    memset(acc, 0, (size_t)num_vectors * head_dim * sizeof(float));
    for (int first = base; first < seq_len; first += page_size) {
        const int64_t page = page_table[first / page_size];
        const int count = seq_len - first < page_size ? seq_len - first : page_size;
        for (int kv_head = 0; kv_head < num_kv_heads; kv_head++) {
#ifdef HAVE_BF16_ROW_SETS
            if (bf16_rows) {
                lines_ahead ahead =
                    lines_ahead_of(cache, &value_run, next_keys, (first - base) / page_size,
                                   kv_head, num_kv_heads);
                const uint16_t *values = kv_address(cache, cache->value, page, 0, kv_head);
                for (int j = 0; j < q_len; j++) {
                    const int seen = seq_len - q_len + j + 1 - first;
                    if (seen <= 0) continue;
                    for (int g = 0; g < group; g += ROW_SET) {
                        const int n = group - g < ROW_SET ? group - g : ROW_SET;
                        const float *weights[ROW_SET];
                        float *outputs[ROW_SET];
                        for (int v = 0; v < n; v++) {
                            const int a = j * num_heads + kv_head * group + g + v;
                            weights[v] = scores + (size_t)a * span + first - base;
                            outputs[v] = acc + (size_t)a * head_dim;
                        }
                        bf16_row_set(weights, n, values, cache->token_stride,
                                     seen < count ? seen : count, head_dim, 1, outputs,
                                     &ahead);
                    }
                }
                request_rest(&ahead);
                continue;
            }
#endif
            prefetch_ahead(cache, &value_run, next_keys, (first - base) / page_size, kv_head,
                           num_kv_heads);
            load_page_rows(cache, cache->value, cache->value_scale, page, count, kv_head,
                           head_dim, rows);
            /* As in pass 1, by twos; each vector takes the page's rows up to its own position. */
            for (int i = 0; i < q_len * group; i += 2) {
                const int second = i + 1 < q_len * group ? i + 1 : i;
                const int a = (i / group) * num_heads + kv_head * group + i % group;
                const int b = (second / group) * num_heads + kv_head * group + second % group;
                const int seen_a = seq_len - q_len + i / group + 1 - first;
                const int seen_b = second == i ? 0 : seq_len - q_len + second / group + 1 - first;
                weighted_rows_pair(scores + (size_t)a * span + first - base,
                                   scores + (size_t)b * span + first - base, rows,
                                   seen_a <= 0 ? 0 : seen_a < count ? seen_a : count,
                                   seen_b <= 0 ? 0 : seen_b < count ? seen_b : count, head_dim,
                                   acc + (size_t)a * head_dim, acc + (size_t)b * head_dim);
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
                                const int32_t *page_table, int seq_len, int q_len, int window,
                                int num_heads, int num_kv_heads, int head_dim,
                                float softmax_scale, const page_run *next_keys,
                                int first_pages_requested, float *scratch) {
#define HEAD_DIM_CASE(dim)                                                                     \
    case dim:                                                                                  \
        attend_sequence(query, query_row_stride, out, out_row_stride, io_dtype, cache,         \
                        page_table, seq_len, q_len, window, num_heads, num_kv_heads, dim,     \
                        softmax_scale, next_keys, first_pages_requested, scratch);            \
        return;
    switch (head_dim) {
        HEAD_DIM_CASE(64)
        HEAD_DIM_CASE(128)
    }
#undef HEAD_DIM_CASE
    attend_sequence(query, query_row_stride, out, out_row_stride, io_dtype, cache, page_table,
                    seq_len, q_len, window, num_heads, num_kv_heads, head_dim, softmax_scale,
                    next_keys, first_pages_requested, scratch);
}

/* The context a work item (a sequence, the first of its rows) attends: its tile of ROW_TILE
 * rows (or fewer, at the run's end) sees up to the tile's last row and no further. */
static inline int item_rows(const int32_t item[2], const int32_t *query_start_loc) {
    const int s = item[0], row = item[1];
    const int q_len = query_start_loc[s + 1] - query_start_loc[s];
    return q_len - row < ROW_TILE ? q_len - row : ROW_TILE;
}

static inline int item_len(const int32_t item[2], const int32_t *query_start_loc,
                           const int32_t *seq_lens) {
    const int s = item[0], row = item[1];
    const int q_len = query_start_loc[s + 1] - query_start_loc[s];
    return seq_lens[s] - q_len + row + item_rows(item, query_start_loc);
}

/* Attend the query rows of sequences `seq_ids[0 .. num_listed)`.
 *
 * query: [N, num_heads, head_dim] of io_dtype (float32 or bf16), rows `query_row_stride`
 *        elements apart
 * out:   [N, num_heads, head_dim] of io_dtype, rows `out_row_stride` elements apart
 * page_tables: [num_seqs, page_table_stride] int32; query_start_loc: [num_seqs + 1] int32;
 * seq_lens: [num_seqs] int32; window: the sliding window, 0 for none. Returns 0, or -1 if
 * scratch memory could not be had.
 */
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
                            int io_dtype, int num_threads) {
    const kv_cache cache = {key,          value,        key_scale,          value_scale,
                            page_stride, token_stride, head_stride,        scale_page_stride,
                            scale_token_stride,         scale_head_stride,  dtype,
                            page_size};
    /* Work items: one tile of ROW_TILE query rows (or fewer, at a run's end) of one sequence. */
    int num_items = 0, max_vectors = 0, max_len = 0;
    for (int i = 0; i < num_listed; i++) {
        const int s = seq_ids[i];
        const int q_len = query_start_loc[s + 1] - query_start_loc[s];
        const int tile = q_len < ROW_TILE ? q_len : ROW_TILE;
        num_items += (q_len + ROW_TILE - 1) / ROW_TILE;
        max_vectors = tile * num_heads > max_vectors ? tile * num_heads : max_vectors;
        max_len = seq_lens[s] > max_len ? seq_lens[s] : max_len;
    }
    int32_t *items = malloc((size_t)(num_items > 0 ? num_items : 1) * 2 * sizeof(int32_t));
    if (!items) return -1;
    for (int i = 0, n = 0; i < num_listed; i++) {
        const int s = seq_ids[i];
        for (int row = 0; row < query_start_loc[s + 1] - query_start_loc[s]; row += ROW_TILE) {
            items[2 * n] = s;
            items[2 * n + 1] = row;
            n++;
        }
    }
    const size_t scratch_floats = (size_t)max_vectors * (2 * head_dim + max_len) +
                                  (size_t)page_rows(page_size) * head_dim;
    const int64_t io_size = (int64_t)element_size(io_dtype);
    int failed = 0;

#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && num_items > 1)
    {
        /* Zeroed once: key rows past a page's end are scored and dropped, never uninitialised. */
        float *scratch = calloc(scratch_floats, sizeof(float));
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
        /* The item this thread attended last: where it is the one before, this item's first
         * pages were requested at the end of that one. */
        int previous = -2;
        /* Every thread reaches the worksharing loop, with or without its scratch. */
#pragma omp for schedule(dynamic, 1)
        for (int n = 0; n < num_items; n++) {
            if (!scratch) continue;
            const int s = items[2 * n], row = items[2 * n + 1];
            const int start = query_start_loc[s];
            page_run next_keys = {key, NULL, 0};
            if (n + 1 < num_items) {
                const int32_t *next = items + 2 * n + 2;
                const int next_len = item_len(next, query_start_loc, seq_lens);
                const int skipped =
                    first_page_read(next_len, item_rows(next, query_start_loc), window, page_size);
                next_keys.page_table = page_tables + next[0] * page_table_stride + skipped;
                next_keys.num_pages = (next_len + page_size - 1) / page_size - skipped;
            }
            const int rows = item_rows(items + 2 * n, query_start_loc);
            attend_sequence_any(
                (const char *)query + (start + row) * query_row_stride * io_size,
                query_row_stride, (char *)out + (start + row) * out_row_stride * io_size,
                out_row_stride, io_dtype, &cache, page_tables + s * page_table_stride,
                item_len(items + 2 * n, query_start_loc, seq_lens), rows, window, num_heads,
                num_kv_heads, head_dim, softmax_scale, &next_keys, n == previous + 1, scratch);
            previous = n;
        }
        free(scratch);
    }
    free(items);
    return failed ? -1 : 0;
}
