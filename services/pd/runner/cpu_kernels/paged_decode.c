/* Decode attention over a paged KV cache, float32, for the CPU.
 *
 * One query row per request (a decode step's rows), each attended over its
 * own context, read in place through its block table: no gather, no padding,
 * one call per layer for the whole batch. Work items are (request, KV head)
 * pairs spread over OpenMP threads (the process's libgomp, the one PyTorch
 * loaded); the query heads sharing a KV head (GQA) read each key and value
 * row once. Softmax in float32 with the row maximum subtracted, as SDPA.
 *
 * Layouts (element strides given by the caller, so views need no copy):
 *   q          [rows, heads, head_dim]       (row stride, head stride; dims contiguous)
 *   k/v cache  [kv_heads, blocks, block_size, head_dim] of one layer (kv head stride)
 *   tables     [rows, table_stride] int32    physical block ids
 *   context    [rows] int32                  tokens each row attends (its last is the new one)
 *   out        [rows, heads, head_dim]       (row stride, head stride)
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define EPD_MAX_GROUP 64 /* query heads per KV head the kernel accepts (checked by the caller) */

int epd_paged_decode_abi(void) { return 1; }

void epd_paged_decode_f32(
    const float* q, int64_t q_row_stride, int64_t q_head_stride,
    const float* k_cache, const float* v_cache, int64_t kv_head_stride,
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
            const float* keys = k_cache + kvh * kv_head_stride;
            const float* values = v_cache + kvh * kv_head_stride;
            const float* queries = q + row * q_row_stride + kvh * group * q_head_stride;
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
            for (int64_t r = 0; r < group; ++r) {
                float* sc = scores + r * n;
                float sum = 0.f;
                for (int64_t t = 0; t < n; ++t) {
                    const float e = expf(sc[t] - row_max[r]);
                    sc[t] = e;
                    sum += e;
                }
                const float inv = 1.f / sum;
                for (int64_t t = 0; t < n; ++t) sc[t] *= inv;
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
                float* o = out + row * out_row_stride + (kvh * group + r) * out_head_stride;
                for (int64_t d = 0; d < head_dim; ++d) o[d] = acc[r * head_dim + d];
            }
        }
        free(scores);
        free(acc);
    }
}
