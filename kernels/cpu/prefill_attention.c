/* A prefill chunk's causal attention on AMX tiles, for bf16 queries over bf16 pages: both
 * products (queries by keys, probabilities by values) in bf16 pairs with float32 sums, and the
 * softmax between them online, in float32 (flash attention).
 *
 * SDPA's CPU kernel, which long chunks took before, runs a 1792-token prompt's attention (9
 * query heads, 3 KV heads, head_dim 64) at about 260 GFLOP/s on one core of the AMX Xeon, 14 ms
 * a layer: 40% of the prompt's prefill. Here both products run on AMX and the call takes 6-7 ms
 * (benchmarks/step/cpu_attention.py prefill): what is left is mostly the softmax's exps, 16
 * lanes at a time, about half of it, and the products' tile loads and stores.
 *
 * How it goes. A call packs each KV head's keys and values once, read straight from their pages
 * into the tiles' pair layouts. Then each block of QUERY_ROWS query rows of a KV head's query
 * heads walks the keys in blocks of KEY_BLOCK, from key 0 up to its last row's position:
 *   scores  S = Q K^T on AMX, one tile of 16 rows by 16 keys at a time;
 *   softmax per row: the running max m over the keys the row sees, the block's probabilities
 *           p = exp(s * scale - m) rounded to bf16 (the second product's operand, as a GPU's
 *           flash attention rounds them) and their running sum l; where m grew, the row's sum
 *           and output so far are first scaled by exp(m_old - m);
 *   output  O += P V on AMX, its float32 rows loaded into the tiles and stored back.
 * At the end each row is O / l, rounded to bf16. The KV head's query heads take each key block
 * in turn, so its keys and values are read into L1 once for all of them.
 *
 * A row's result depends on its position alone: the key blocks start at key 0 whatever the
 * chunk, AMX never mixes rows, and a key block past a row's last key leaves the row as it was
 * (every probability 0 and the max unchanged, so nothing is scaled). A token's output is the same
 * bits whether it is prefilled in a chunk of 17 rows or 2048, after a cached prefix or not,
 * beside whichever rows share its block. (Not the decode kernel's bits, which sum another way:
 * the deterministic mode keeps every row on paged_attention.c.)
 *
 * Twin: tests/kernel_twins.py's prefill_attention_blocks_reference, the same blocks and
 * roundings, within the order of the sums and the last bits of the exps.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "exports.h"
#include "numerics.h"
/* Both products on AMX, the probabilities rounded to bf16 with AVX512_BF16 (every processor
 * with AMX has it). */
#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define PREFILL_ON_AMX 1
#include <immintrin.h>

#include "amx_tiles.h"
#endif

/* Query rows of one head in a block: an AMX tile's rows. */
#define QUERY_ROWS 16
/* Keys per step of the online softmax: four score tiles of 16 keys, two probability tiles of
 * 32 keys (one tile's 16 pairs). */
#define KEY_BLOCK 64
/* head_dim: a multiple of 32 (a tile row of bf16), at most this. */
#define MAX_HEAD_DIM 256
/* Query heads per KV head. */
#define MAX_GROUP 16
/* uint32 words in a tile: 16 rows of 64 bytes. */
#define TILE_WORDS 256

int pdserve_prefill_attention_fits(int num_heads, int num_kv_heads, int head_dim) {
    return num_kv_heads > 0 && num_heads % num_kv_heads == 0 &&
           num_heads / num_kv_heads <= MAX_GROUP && head_dim % 32 == 0 && head_dim > 0 &&
           head_dim <= MAX_HEAD_DIM;
}

int pdserve_prefill_attention_available(void) {
#ifdef PREFILL_ON_AMX
    return amx_tiles_permitted();
#else
    return 0;
#endif
}

#ifdef PREFILL_ON_AMX
/* The head vector of key `position` in its page. */
static inline const uint16_t *context_row(const uint16_t *pages, const int32_t *page_table,
                                          int64_t page_stride, int64_t token_stride,
                                          int page_size, int position) {
    return pages + (int64_t)page_table[position / page_size] * page_stride +
           (int64_t)(position % page_size) * token_stride;
}

/* One KV head's keys as the scores' right operand: tile (b, d), at (b * head_dim / 32 + d)
 * tiles, holds keys 16b..16b+15 by dims 32d..32d+31, its word [p][j] the pair of dims
 * 32d + 2p and 32d + 2p + 1 of key 16b + j. Keys from `count` to `padded` are zeros. */
static void pack_keys(const uint16_t *pages, const int32_t *page_table, int64_t page_stride,
                      int64_t token_stride, int page_size, int count, int padded, int head_dim,
                      uint32_t *packed) {
    const int dim_tiles = head_dim / 32;
    for (int first = 0; first < padded; first += 16) {
        uint32_t *tiles = packed + (int64_t)(first / 16) * dim_tiles * TILE_WORDS;
        for (int j = 0; j < 16; j++) {
            const int key = first + j;
            if (key >= count) {
                for (int p = 0; p < head_dim / 2; p++)
                    tiles[(p / 16) * TILE_WORDS + (p % 16) * 16 + j] = 0;
                continue;
            }
            const uint32_t *pairs = (const uint32_t *)context_row(pages, page_table, page_stride,
                                                                  token_stride, page_size, key);
            /* A key's pairs go down column j of its tiles: one word every 16. */
            const __m512i column = _mm512_add_epi32(
                _mm512_set_epi32(240, 224, 208, 192, 176, 160, 144, 128, 112, 96, 80, 64, 48, 32,
                                 16, 0),
                _mm512_set1_epi32(j));
            for (int p = 0; p < head_dim / 2; p += 16) {
                const __m512i words = _mm512_loadu_si512((const void *)(pairs + p));
                _mm512_i32scatter_epi32(tiles + (p / 16) * TILE_WORDS, column, words, 4);
            }
        }
    }
}

/* One KV head's values as the output's right operand: tile (b, d), at (b * head_dim / 16 + d)
 * tiles, holds keys 32b..32b+31 by dims 16d..16d+15, its word [p][j] dim 16d + j of keys
 * 32b + 2p (low half) and 32b + 2p + 1 (high half). Keys from `count` to `padded` are zeros. */
static void pack_values(const uint16_t *pages, const int32_t *page_table, int64_t page_stride,
                        int64_t token_stride, int page_size, int count, int padded,
                        int head_dim, uint32_t *packed) {
    static const uint16_t zeros[MAX_HEAD_DIM];
    const int dim_tiles = head_dim / 16;
    for (int key = 0; key < padded; key += 2) {
        const uint16_t *even = key < count ? context_row(pages, page_table, page_stride,
                                                         token_stride, page_size, key)
                                           : zeros;
        const uint16_t *odd = key + 1 < count ? context_row(pages, page_table, page_stride,
                                                            token_stride, page_size, key + 1)
                                              : zeros;
        uint32_t *row =
            packed + (int64_t)(key / 32) * dim_tiles * TILE_WORDS + (key % 32) / 2 * 16;
        for (int d = 0; d < head_dim; d += 16) {
            const __m512i low =
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(even + d)));
            const __m512i high =
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(odd + d)));
            _mm512_storeu_si512((void *)(row + (d / 16) * TILE_WORDS),
                                _mm512_or_si512(low, _mm512_slli_epi32(high, 16)));
        }
    }
}

/* 2^x in 16 lanes for x <= 0, 0 in the lanes `keep` leaves out: 2^whole * 2^f for the nearest
 * integer and a fraction in [-0.5, 0.5], 2^f a degree-5 polynomial (within 2e-7 of it, where
 * exp_approx's degree 6 is within 2 ulp: a probability is rounded to bf16, 2^-9, right after),
 * 2^whole by vscalefps. Clamped at 2^-125, a normal number, which vcvtneps2bf16 rounds as
 * float_to_bf16 would (it reads denormals as zero). */
static inline __m512 exp2_nonpositive_x16(__mmask16 keep, __m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-125.0f));
    const __m512 whole = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, whole);
    __m512 p = _mm512_set1_ps(1.3265772722661495e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.671544656157494e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550730600953102e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022240936756134e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931470036506653e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_maskz_scalef_ps(keep, p, whole);
}

/* Tiles 2-5 += tile 0 by the four tiles of pairs at `tiles`, `step` words apart: three tile
 * registers take turns holding them, so that a load overlaps the product before it. */
static inline void times_four_tiles(const uint32_t *tiles, int64_t step) {
    _tile_loadd(1, tiles, 64);
    _tile_loadd(6, tiles + step, 64);
    _tile_dpbf16ps(2, 0, 1);
    _tile_loadd(7, tiles + 2 * step, 64);
    _tile_dpbf16ps(3, 0, 6);
    _tile_loadd(1, tiles + 3 * step, 64);
    _tile_dpbf16ps(4, 0, 7);
    _tile_dpbf16ps(5, 0, 1);
}

/* scores[16][KEY_BLOCK] = 16 query rows (`stride` bytes apart) by one key block's packed keys. */
static inline void block_scores(const uint16_t *queries, int64_t stride, const uint32_t *keys,
                                int head_dim, float *scores) {
    const int dim_tiles = head_dim / 32;
    const int64_t next = (int64_t)dim_tiles * TILE_WORDS; /* the next 16 keys */
    _tile_zero(2);
    _tile_zero(3);
    _tile_zero(4);
    _tile_zero(5);
    for (int d = 0; d < dim_tiles; d++) {
        _tile_loadd(0, queries + 32 * d, stride);
        times_four_tiles(keys + (int64_t)d * TILE_WORDS, next);
    }
    _tile_stored(2, scores, KEY_BLOCK * sizeof(float));
    _tile_stored(3, scores + 16, KEY_BLOCK * sizeof(float));
    _tile_stored(4, scores + 32, KEY_BLOCK * sizeof(float));
    _tile_stored(5, scores + 48, KEY_BLOCK * sizeof(float));
}

/* out[16][head_dim] += probs[16][KEY_BLOCK] (bf16) by one key block's packed values: 64 output
 * columns (four tiles) at a time, 32 where head_dim leaves that many. */
static inline void block_values(const uint16_t *probs, const uint32_t *values, int head_dim,
                                float *out) {
    const int dim_tiles = head_dim / 16;
    const int64_t next_keys = (int64_t)dim_tiles * TILE_WORDS; /* keys 32..63 of the block */
    const int64_t stride = (int64_t)head_dim * sizeof(float);
    for (int d = 0; d < dim_tiles; d += 4) {
        float *o = out + 16 * d;
        const uint32_t *tile = values + (int64_t)d * TILE_WORDS;
        if (dim_tiles - d >= 4) {
            _tile_loadd(2, o, stride);
            _tile_loadd(3, o + 16, stride);
            _tile_loadd(4, o + 32, stride);
            _tile_loadd(5, o + 48, stride);
            for (int half = 0; half < 2; half++) {
                _tile_loadd(0, probs + 32 * half, KEY_BLOCK * sizeof(uint16_t));
                times_four_tiles(tile + half * next_keys, TILE_WORDS);
            }
            _tile_stored(2, o, stride);
            _tile_stored(3, o + 16, stride);
            _tile_stored(4, o + 32, stride);
            _tile_stored(5, o + 48, stride);
        } else {
            _tile_loadd(2, o, stride);
            _tile_loadd(3, o + 16, stride);
            for (int half = 0; half < 2; half++) {
                const uint32_t *keys = tile + half * next_keys;
                _tile_loadd(0, probs + 32 * half, KEY_BLOCK * sizeof(uint16_t));
                _tile_loadd(1, keys, 64);
                _tile_loadd(6, keys + TILE_WORDS, 64);
                _tile_dpbf16ps(2, 0, 1);
                _tile_dpbf16ps(3, 0, 6);
            }
            _tile_stored(2, o, stride);
            _tile_stored(3, o + 16, stride);
        }
    }
}

/* One head's running softmax state for a block of query rows. */
struct row_state {
    float max[QUERY_ROWS];   /* in powers of 2: the largest score * scale * log2(e) seen */
    __m512 sums[QUERY_ROWS]; /* l in 16 lanes, added up at the end */
};

/* The largest lane of each of 16 vectors, lane r of the result from rows[r]: halves, quarters,
 * pairs and lanes of pairs of rows folded together (15 shuffle pairs for the 16 rows, where a
 * reduction per row takes 4 dependent shuffles each), then the lanes put back in row order. */
static inline __m512 row_maxima(const __m512 rows[QUERY_ROWS]) {
    __m512 halves[8], quarters[4], pairs[2];
    for (int i = 0; i < 8; i++) /* lanes 0-7: row 2i's halves, 8-15: row 2i+1's */
        halves[i] = _mm512_max_ps(_mm512_shuffle_f32x4(rows[2 * i], rows[2 * i + 1], 0x44),
                                  _mm512_shuffle_f32x4(rows[2 * i], rows[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++) /* 128-bit lane q: row 4i + q's quarters */
        quarters[i] =
            _mm512_max_ps(_mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], 0x88),
                          _mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++) /* in 128-bit lane q: two lanes each of rows 8i + q, 8i + 4 + q */
        pairs[i] = _mm512_max_ps(_mm512_shuffle_ps(quarters[2 * i], quarters[2 * i + 1], 0x44),
                                 _mm512_shuffle_ps(quarters[2 * i], quarters[2 * i + 1], 0xEE));
    /* in 128-bit lane q: rows q, 4 + q, 8 + q, 12 + q */
    const __m512 folded = _mm512_max_ps(_mm512_shuffle_ps(pairs[0], pairs[1], 0x88),
                                        _mm512_shuffle_ps(pairs[0], pairs[1], 0xDD));
    const __m512i row_order =
        _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    return _mm512_permutexvar_ps(row_order, folded);
}

/* The online softmax over one key block (keys `first_key`..+KEY_BLOCK) for 16 rows, the first
 * at `first_position`: probs gets the block's bf16 probabilities (0 past a row's last key), and
 * a row whose max grew has its sums and `out` scaled to the new max. exp(s * scale - m) is taken
 * as 2^(s * scale * log2(e) - m'), one FMA from the score to 2's power. The rows' maxima are
 * found together (row_maxima) and only rows whose max grew take the scalar path: the rows of a
 * block are independent, and a per-row reduction and branch kept the vector units waiting. */
static inline __attribute__((always_inline)) void softmax_of_block(
    const float *scores, int first_position, int first_key, float scale, struct row_state *state,
    uint16_t *probs, float *out, int head_dim, const int diagonal) {
    const float to_power = scale * 1.44269504088896341f; /* a score to 2's power */
    const __m512 to_power16 = _mm512_set1_ps(to_power);
    const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3F80); /* bf16 1.0 */
    __mmask16 seen[QUERY_ROWS][KEY_BLOCK / 16];
    __m512 block_max[QUERY_ROWS];
    for (int r = 0; r < QUERY_ROWS; r++) {
        const int visible = first_position + r - first_key + 1;
        block_max[r] = _mm512_set1_ps(-INFINITY);
        for (int i = 0; i < KEY_BLOCK / 16; i++) {
            const int lanes = visible - 16 * i;
            seen[r][i] = !diagonal || lanes >= 16 ? 0xFFFF
                         : lanes > 0              ? (__mmask16)((1u << lanes) - 1)
                                                  : 0;
            block_max[r] = _mm512_mask_max_ps(block_max[r], seen[r][i], block_max[r],
                                              _mm512_loadu_ps(scores + r * KEY_BLOCK + 16 * i));
        }
    }
    /* The scale is positive: the largest score scaled is the largest scaled score. */
    const __m512 seen_max = _mm512_mul_ps(row_maxima(block_max), to_power16);
    const __m512 old_max = _mm512_loadu_ps(state->max);
    __mmask16 grew = _mm512_cmp_ps_mask(seen_max, old_max, _CMP_GT_OQ);
    _mm512_storeu_ps(state->max, _mm512_max_ps(seen_max, old_max));
    /* Rows whose max grew after keys they saw before: their sums and output scaled down. */
    grew &= _mm512_cmp_ps_mask(old_max, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
    float old[QUERY_ROWS];
    _mm512_storeu_ps(old, old_max);
    while (grew) {
        const int r = __builtin_ctz(grew);
        grew &= grew - 1;
        const __m512 rescale = _mm512_set1_ps(exp2f(old[r] - state->max[r]));
        state->sums[r] = _mm512_mul_ps(state->sums[r], rescale);
        float *o = out + (int64_t)r * head_dim;
        for (int d = 0; d < head_dim; d += 16)
            _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_loadu_ps(o + d), rescale));
    }
    for (int r = 0; r < QUERY_ROWS; r++) {
        uint16_t *p = probs + r * KEY_BLOCK;
        if (state->max[r] == -INFINITY) { /* no key seen yet: nothing to add */
            memset(p, 0, KEY_BLOCK * sizeof(uint16_t));
            continue;
        }
        const __m512 max16 = _mm512_set1_ps(state->max[r]);
        const float *x = scores + r * KEY_BLOCK;
        __m512 sum = state->sums[r];
        for (int i = 0; i < KEY_BLOCK / 16; i += 2) {
            const __m512 low = exp2_nonpositive_x16(
                seen[r][i], _mm512_fmsub_ps(_mm512_loadu_ps(x + 16 * i), to_power16, max16));
            const __m512 high = exp2_nonpositive_x16(
                seen[r][i + 1],
                _mm512_fmsub_ps(_mm512_loadu_ps(x + 16 * (i + 1)), to_power16, max16));
            const __m512bh rounded = _mm512_cvtne2ps_pbh(high, low); /* low's keys first */
            _mm512_storeu_si512((void *)(p + 16 * i), (__m512i)rounded);
            sum = _mm512_dpbf16_ps(sum, rounded, ones); /* + each pair of probabilities */
        }
        state->sums[r] = sum;
    }
}

/* block_softmax for the blocks off the diagonal (every row sees every key: no masks to build or
 * apply, a few hundred scalar instructions a block) and on it, each compiled of its own. Keys of
 * the block each row sees: all of them unless the block holds a row's own position or later ones
 * (the diagonal), where row r sees first_position + r - first_key + 1. */
static inline void block_softmax(const float *scores, int first_position, int first_key,
                                 float scale, struct row_state *state, uint16_t *probs,
                                 float *out, int head_dim) {
    if (first_position - first_key < KEY_BLOCK - 1)
        softmax_of_block(scores, first_position, first_key, scale, state, probs, out, head_dim, 1);
    else
        softmax_of_block(scores, first_position, first_key, scale, state, probs, out, head_dim, 0);
}

/* Per-thread room for one block of query rows of a KV head's `group` query heads. */
struct scratch {
    float scores[QUERY_ROWS * KEY_BLOCK];
    uint16_t probs[QUERY_ROWS * KEY_BLOCK];
    struct row_state rows[MAX_GROUP];
    float out[]; /* [group][QUERY_ROWS][head_dim]; then a short block's queries, bf16, alike */
};

static size_t scratch_bytes(int group, int head_dim) {
    const size_t per_head = (size_t)QUERY_ROWS * head_dim;
    const size_t bytes =
        sizeof(struct scratch) + group * per_head * (sizeof(float) + sizeof(uint16_t));
    return (bytes + 63) / 64 * 64;
}

/* Rows first_row..first_row + rows (rows <= QUERY_ROWS) of KV head `kv_head`'s query heads.
 * (Asking AMX for the next head's scores before this head's softmax, so that the tiles would
 * multiply while the vector units take exps, ran no faster on the Xeon.) */
static void attend_rows(const uint16_t *query, int64_t query_stride, uint16_t *out,
                        int64_t out_stride, const uint32_t *keys, const uint32_t *values,
                        int first_row, int rows, int prefix, int kv_head, int group,
                        int head_dim, float scale, struct scratch *s) {
    const int first_position = prefix + first_row;
    const int blocks = (first_position + rows - 1) / KEY_BLOCK + 1;
    const int64_t per_head = (int64_t)QUERY_ROWS * head_dim;
    const int64_t key_block_words = (int64_t)(KEY_BLOCK / 16) * (head_dim / 32) * TILE_WORDS;
    const int64_t value_block_words = (int64_t)(KEY_BLOCK / 32) * (head_dim / 16) * TILE_WORDS;
    memset(s->out, 0, (size_t)group * per_head * sizeof(float));
    const uint16_t *queries[MAX_GROUP];
    int64_t query_bytes = query_stride * (int64_t)sizeof(uint16_t);
    uint16_t *short_rows = (uint16_t *)(s->out + group * per_head);
    for (int g = 0; g < group; g++) {
        for (int r = 0; r < QUERY_ROWS; r++) {
            s->rows[g].max[r] = -INFINITY;
            s->rows[g].sums[r] = _mm512_setzero_ps();
        }
        const int head = kv_head * group + g;
        queries[g] = query + (int64_t)first_row * query_stride + (int64_t)head * head_dim;
        if (rows < QUERY_ROWS) {
            /* A short last block: its rows copied out, zero rows after them. */
            uint16_t *copy = short_rows + g * per_head;
            memset(copy, 0, (size_t)per_head * sizeof(uint16_t));
            for (int r = 0; r < rows; r++)
                memcpy(copy + r * head_dim, queries[g] + r * query_stride,
                       head_dim * sizeof(uint16_t));
            queries[g] = copy;
        }
    }
    if (rows < QUERY_ROWS) query_bytes = head_dim * (int64_t)sizeof(uint16_t);
    for (int b = 0; b < blocks; b++) {
        const uint32_t *keys_b = keys + b * key_block_words;
        const uint32_t *values_b = values + b * value_block_words;
        for (int g = 0; g < group; g++) {
            float *head_out = s->out + g * per_head;
            block_scores(queries[g], query_bytes, keys_b, head_dim, s->scores);
            block_softmax(s->scores, first_position, b * KEY_BLOCK, scale, &s->rows[g], s->probs,
                          head_out, head_dim);
            block_values(s->probs, values_b, head_dim, head_out);
        }
    }
    for (int g = 0; g < group; g++) {
        const int head = kv_head * group + g;
        for (int r = 0; r < rows; r++) {
            const __m512 sum = _mm512_set1_ps(_mm512_reduce_add_ps(s->rows[g].sums[r]));
            const float *o = s->out + g * per_head + (int64_t)r * head_dim;
            uint16_t *y = out + (int64_t)(first_row + r) * out_stride + (int64_t)head * head_dim;
            for (int d = 0; d < head_dim; d += 16)
                _mm256_storeu_si256((__m256i *)(y + d),
                                    float_to_bf16x16(_mm512_div_ps(_mm512_loadu_ps(o + d), sum)));
        }
    }
}
#endif

/* out[i] for query rows i < query_len, the last query_len positions of a sequence of seq_len
 * tokens whose keys and values sit in pages (page_table): each row attends every key up to its
 * own position. query and out rows hold num_heads head vectors of head_dim bf16 each, one after
 * another; the pages hold bf16 head vectors at the given element strides. Returns 0, -1 where
 * the shapes do not fit (pdserve_prefill_attention_fits) or the processor has no AMX, -2 where
 * memory ran out. */
int pdserve_prefill_attention_bf16(const uint16_t *query, int64_t query_stride, uint16_t *out,
                                   int64_t out_stride, const uint16_t *key_pages,
                                   const uint16_t *value_pages, int64_t page_stride,
                                   int64_t token_stride, int64_t head_stride, int page_size,
                                   const int32_t *page_table, int query_len, int seq_len,
                                   int num_heads, int num_kv_heads, int head_dim, float scale,
                                   int num_threads) {
#ifndef PREFILL_ON_AMX
    (void)query, (void)query_stride, (void)out, (void)out_stride, (void)key_pages,
        (void)value_pages, (void)page_stride, (void)token_stride, (void)head_stride,
        (void)page_size, (void)page_table, (void)query_len, (void)seq_len, (void)num_heads,
        (void)num_kv_heads, (void)head_dim, (void)scale, (void)num_threads;
    return -1;
#else
    if (!pdserve_prefill_attention_fits(num_heads, num_kv_heads, head_dim) || query_len <= 0 ||
        query_len > seq_len)
        return -1;
    const int group = num_heads / num_kv_heads;
    const int padded = (seq_len + KEY_BLOCK - 1) / KEY_BLOCK * KEY_BLOCK;
    const int64_t head_words = (int64_t)padded * head_dim / 2; /* a packed K or V, in words */
    uint32_t *packed =
        aligned_alloc(64, (size_t)num_kv_heads * 2 * head_words * sizeof(uint32_t));
    if (packed == NULL) return -2;
    const int query_blocks = (query_len + QUERY_ROWS - 1) / QUERY_ROWS;
    const int prefix = seq_len - query_len;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
#pragma omp for schedule(static)
        for (int h = 0; h < num_kv_heads; h++) {
            uint32_t *keys = packed + 2 * h * head_words;
            pack_keys(key_pages + h * head_stride, page_table, page_stride, token_stride,
                      page_size, seq_len, padded, head_dim, keys);
            pack_values(value_pages + h * head_stride, page_table, page_stride, token_stride,
                        page_size, seq_len, padded, head_dim, keys + head_words);
        }
        struct scratch *s = aligned_alloc(64, scratch_bytes(group, head_dim));
        if (s == NULL) {
#pragma omp atomic write
            failed = 1;
        } else {
            configure_tiles();
        }
        /* The last query blocks attend the most keys: handed out first. */
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < num_kv_heads * query_blocks; item++) {
            if (s == NULL) continue;
            const int block = query_blocks - 1 - item / num_kv_heads;
            const int kv_head = item % num_kv_heads;
            const int first_row = block * QUERY_ROWS;
            const int rows =
                query_len - first_row < QUERY_ROWS ? query_len - first_row : QUERY_ROWS;
            const uint32_t *keys = packed + 2 * kv_head * head_words;
            attend_rows(query, query_stride, out, out_stride, keys, keys + head_words, first_row,
                        rows, prefix, kv_head, group, head_dim, scale, s);
        }
        free(s);
    }
    free(packed);
    return failed ? -2 : 0;
#endif
}
