/* Decode attention over a paged KV cache, float32, for the CPU.
 *
 * One query row per request (a decode step's rows), each attended over its
 * own context, read in place through its block table: no gather, no padding,
 * one call per layer for the whole batch. Work items are (request, KV head)
 * pairs spread over OpenMP threads (the process's libgomp, the one PyTorch
 * loaded); the query heads sharing a KV head (GQA) read each key and value
 * row once from memory. Softmax in float32 with the row maximum subtracted,
 * as SDPA.
 *
 * Given the rows' new keys and values (new_k, new_v not NULL), an item first
 * writes its row's new key and value into the cache, at the row's last
 * position (context - 1): the write then lands in lines the item reads next,
 * instead of a separate pass over the step's slots (index_copy_ took 150 us
 * a layer at 32 rows, out of cache).
 *
 * Head dims of 64 and 128 (nearly every model) take a path compiled for them:
 * the query head's row stays in registers while a block of keys is scored,
 * four keys at a time with four independent sums, and the weighted sum of the
 * values is kept in registers. It ran a bench-model layer at 32 rows of ~150
 * tokens 12-18% faster than the generic loop below, which serves other dims.
 *
 * Layouts (element strides given by the caller, so views need no copy):
 *   q            [rows, heads, head_dim]       (row stride, head stride; dims contiguous)
 *   new_k, new_v [rows, kv_heads, head_dim]    (row and head strides of each; dims contiguous), or NULL
 *   k/v cache    [kv_heads, blocks, block_size, head_dim] of one layer (kv head stride)
 *   tables       [rows, table_stride] int32    physical block ids
 *   context      [rows] int32                  tokens each row attends (its last is the new one)
 *   out          [rows, heads, head_dim]       (row stride, head stride)
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define EPD_MAX_GROUP 64 /* query heads per KV head the kernel accepts (checked by the caller) */

typedef float v8 __attribute__((vector_size(32), aligned(4)));

int epd_paged_decode_abi(void) { return 2; }

static inline float hsum8(v8 v) {
    float s = 0.f;
    for (int i = 0; i < 8; ++i) s += v[i];
    return s;
}

/* An item reads its key blocks, then its value blocks. A request's blocks lie anywhere in the cache, so
 * the hardware prefetcher, which follows sequential streams, stalls at the start of each; asking for the
 * block AHEAD_BLOCKS further in that order while one is used hides the stall. Over 32 rows of 180 tokens
 * in scattered blocks (12 layers, 12 heads of 64; 2 threads, AMD Zen 5): 24-30 ms without, 19.5-20.3
 * with 2 blocks ahead (3: 20.6; 1: 21.6-23.8). The same bytes are read, in the same order: same sums. */
#define AHEAD_BLOCKS 2

static inline void prefetch_block(const float* block, int64_t block_stride) {
    for (int64_t f = 0; f < block_stride; f += 16) __builtin_prefetch(block + f); /* one cache line each */
}

/* Block i of an item's reading order (its key blocks, then its value blocks), or NULL past its end. */
static inline const float* kv_block(const float* keys, const float* values, const int32_t* table,
                                    int64_t num_blocks, int64_t block_stride, int64_t i) {
    if (i >= 2 * num_blocks) return NULL;
    return (i < num_blocks ? keys + (int64_t)table[i] * block_stride
                           : values + (int64_t)table[i - num_blocks] * block_stride);
}

/* Inside an item (its keys, values, table, num_blocks, block_stride): prefetches its block i. */
#define PREFETCH_KV_BLOCK(i)                                                                          \
    do {                                                                                              \
        const float* ahead = kv_block(keys, values, table, num_blocks, block_stride, (i));           \
        if (ahead != NULL) prefetch_block(ahead, block_stride);                                       \
    } while (0)

/* Softmax of n scores in place, the maximum `mx` subtracted; returns 1 / the sum. */
static inline float softmax_weights(float* sc, int64_t n, float mx) {
    float sum = 0.f;
    for (int64_t t = 0; t < n; ++t) {
        const float e = expf(sc[t] - mx);
        sc[t] = e;
        sum += e;
    }
    return 1.f / sum;
}

/* One (request, KV head) item for head_dim = NV * 8: scores of the `group` query heads
 * (into `scores`, `n` per head), softmax, and the weighted sum of the values into `out`. */
#define DEFINE_ITEM(NV)                                                                               \
    static void item_##NV(const float* queries, int64_t q_head_stride, const float* keys,            \
                          const float* values, const int32_t* table, int64_t n, int64_t group,       \
                          int64_t block_size, float scale, float* scores, float* out,                 \
                          int64_t out_head_stride) {                                                  \
        const int64_t head_dim = NV * 8, block_stride = block_size * head_dim;                       \
        const int64_t num_blocks = (n + block_size - 1) / block_size;                                 \
        float row_max[EPD_MAX_GROUP];                                                                 \
        for (int64_t r = 0; r < group; ++r) row_max[r] = -INFINITY;                                   \
        for (int64_t b = 0; b < num_blocks; ++b) {                                                    \
            const float* kb = keys + (int64_t)table[b] * block_stride;                                \
            const int64_t t0 = b * block_size, m = n - t0 < block_size ? n - t0 : block_size;        \
            for (int64_t a = b == 0 ? 1 : AHEAD_BLOCKS; a <= AHEAD_BLOCKS; ++a)                       \
                PREFETCH_KV_BLOCK(b + a);                                                             \
            for (int64_t r = 0; r < group; ++r) {                                                     \
                v8 qv[NV];                                                                            \
                for (int i = 0; i < NV; ++i) qv[i] = *(const v8*)(queries + r * q_head_stride + i * 8); \
                float* sc = scores + r * n + t0;                                                      \
                float mx = row_max[r];                                                                \
                int64_t j = 0;                                                                        \
                for (; j + 4 <= m; j += 4) {                                                          \
                    const float* k = kb + j * head_dim;                                               \
                    v8 s0 = qv[0] * *(const v8*)k, s1 = qv[0] * *(const v8*)(k + head_dim);           \
                    v8 s2 = qv[0] * *(const v8*)(k + 2 * head_dim);                                   \
                    v8 s3 = qv[0] * *(const v8*)(k + 3 * head_dim);                                   \
                    for (int i = 1; i < NV; ++i) {                                                    \
                        s0 += qv[i] * *(const v8*)(k + i * 8);                                        \
                        s1 += qv[i] * *(const v8*)(k + head_dim + i * 8);                             \
                        s2 += qv[i] * *(const v8*)(k + 2 * head_dim + i * 8);                         \
                        s3 += qv[i] * *(const v8*)(k + 3 * head_dim + i * 8);                         \
                    }                                                                                 \
                    sc[j] = hsum8(s0) * scale;                                                        \
                    sc[j + 1] = hsum8(s1) * scale;                                                    \
                    sc[j + 2] = hsum8(s2) * scale;                                                    \
                    sc[j + 3] = hsum8(s3) * scale;                                                    \
                    mx = fmaxf(mx, fmaxf(fmaxf(sc[j], sc[j + 1]), fmaxf(sc[j + 2], sc[j + 3])));      \
                }                                                                                     \
                for (; j < m; ++j) {                                                                  \
                    const float* k = kb + j * head_dim;                                               \
                    v8 s0 = qv[0] * *(const v8*)k;                                                    \
                    for (int i = 1; i < NV; ++i) s0 += qv[i] * *(const v8*)(k + i * 8);               \
                    sc[j] = hsum8(s0) * scale;                                                        \
                    mx = fmaxf(mx, sc[j]);                                                            \
                }                                                                                     \
                row_max[r] = mx;                                                                      \
            }                                                                                         \
        }                                                                                             \
        for (int64_t r = 0; r < group; ++r) {                                                         \
            float* sc = scores + r * n;                                                               \
            const float inv = softmax_weights(sc, n, row_max[r]);                                     \
            v8 acc[NV];                                                                               \
            for (int i = 0; i < NV; ++i) acc[i] = (v8){0};                                            \
            for (int64_t b = 0; b < num_blocks; ++b) {                                                \
                const float* vb = values + (int64_t)table[b] * block_stride;                          \
                const int64_t t0 = b * block_size, m = n - t0 < block_size ? n - t0 : block_size;    \
                PREFETCH_KV_BLOCK(num_blocks + b + AHEAD_BLOCKS);                                     \
                for (int64_t j = 0; j < m; ++j) {                                                     \
                    const float p = sc[t0 + j];                                                       \
                    const float* v = vb + j * head_dim;                                               \
                    for (int i = 0; i < NV; ++i) acc[i] += p * *(const v8*)(v + i * 8);               \
                }                                                                                     \
            }                                                                                         \
            float* o = out + r * out_head_stride;                                                     \
            for (int i = 0; i < NV; ++i) {                                                            \
                const v8 res = acc[i] * inv;                                                          \
                memcpy(o + i * 8, &res, sizeof res);                                                  \
            }                                                                                         \
        }                                                                                             \
    }
DEFINE_ITEM(8)
DEFINE_ITEM(16)

/* The same item for any head_dim. */
static void item_any(const float* queries, int64_t q_head_stride, const float* keys, const float* values,
                     const int32_t* table, int64_t n, int64_t group, int64_t head_dim, int64_t block_size,
                     float scale, float* scores, float* acc, float* out, int64_t out_head_stride) {
    const int64_t block_stride = block_size * head_dim;
    float row_max[EPD_MAX_GROUP];
    for (int64_t r = 0; r < group; ++r) row_max[r] = -INFINITY;
    /* Scores, block by block: one key row read for every query head of the group. */
    for (int64_t t0 = 0; t0 < n; t0 += block_size) {
        const float* kb = keys + (int64_t)table[t0 / block_size] * block_stride;
        const int64_t m = n - t0 < block_size ? n - t0 : block_size;
        for (int64_t j = 0; j < m; ++j) {
            const float* k = kb + j * head_dim;
            for (int64_t r = 0; r < group; ++r) {
                const float* qv = queries + r * q_head_stride;
                float s = 0.f;
                #pragma omp simd reduction(+ : s)
                for (int64_t d = 0; d < head_dim; ++d) s += qv[d] * k[d];
                s *= scale;
                scores[r * n + t0 + j] = s;
                if (s > row_max[r]) row_max[r] = s;
            }
        }
    }
    float inv[EPD_MAX_GROUP];
    for (int64_t r = 0; r < group; ++r) {
        inv[r] = softmax_weights(scores + r * n, n, row_max[r]);
        for (int64_t d = 0; d < head_dim; ++d) acc[r * head_dim + d] = 0.f;
    }
    /* Weighted sum of the values, block by block. */
    for (int64_t t0 = 0; t0 < n; t0 += block_size) {
        const float* vb = values + (int64_t)table[t0 / block_size] * block_stride;
        const int64_t m = n - t0 < block_size ? n - t0 : block_size;
        for (int64_t j = 0; j < m; ++j) {
            const float* v = vb + j * head_dim;
            for (int64_t r = 0; r < group; ++r) {
                const float p = scores[r * n + t0 + j];
                float* a = acc + r * head_dim;
                #pragma omp simd
                for (int64_t d = 0; d < head_dim; ++d) a[d] += p * v[d];
            }
        }
    }
    for (int64_t r = 0; r < group; ++r) {
        float* o = out + r * out_head_stride;
        for (int64_t d = 0; d < head_dim; ++d) o[d] = acc[r * head_dim + d] * inv[r];
    }
}

void epd_paged_decode_f32(
    const float* q, int64_t q_row_stride, int64_t q_head_stride,
    const float* new_k, int64_t new_k_row_stride, int64_t new_k_head_stride,
    const float* new_v, int64_t new_v_row_stride, int64_t new_v_head_stride,
    float* k_cache, float* v_cache, int64_t kv_head_stride,
    const int32_t* tables, int64_t table_stride, const int32_t* context,
    float* out, int64_t out_row_stride, int64_t out_head_stride,
    int64_t num_rows, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
    int64_t max_context, float scale, int num_threads)
{
    const int64_t group = num_heads / num_kv_heads;
    const int64_t block_stride = block_size * head_dim;
    #pragma omp parallel num_threads(num_threads)
    {
        /* Per thread: one score row per query head of a group, and their output accumulators. */
        float* scores = (float*)malloc(sizeof(float) * group * (max_context > 0 ? max_context : 1));
        float* acc = (float*)malloc(sizeof(float) * group * head_dim);
        #pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_rows * num_kv_heads; ++item) {
            const int64_t row = item / num_kv_heads, kvh = item % num_kv_heads;
            const int64_t n = context[row];
            const int32_t* table = tables + row * table_stride;
            float* keys = k_cache + kvh * kv_head_stride;
            float* values = v_cache + kvh * kv_head_stride;
            if (new_k != NULL && n > 0) {
                const int64_t slot = (int64_t)table[(n - 1) / block_size] * block_stride + (n - 1) % block_size * head_dim;
                memcpy(keys + slot, new_k + row * new_k_row_stride + kvh * new_k_head_stride, sizeof(float) * head_dim);
                memcpy(values + slot, new_v + row * new_v_row_stride + kvh * new_v_head_stride,
                       sizeof(float) * head_dim);
            }
            const float* queries = q + row * q_row_stride + kvh * group * q_head_stride;
            float* o = out + row * out_row_stride + kvh * group * out_head_stride;
            if (head_dim == 64)
                item_8(queries, q_head_stride, keys, values, table, n, group, block_size, scale, scores, o,
                       out_head_stride);
            else if (head_dim == 128)
                item_16(queries, q_head_stride, keys, values, table, n, group, block_size, scale, scores, o,
                        out_head_stride);
            else
                item_any(queries, q_head_stride, keys, values, table, n, group, head_dim, block_size, scale, scores,
                         acc, o, out_head_stride);
        }
        free(scores);
        free(acc);
    }
}
