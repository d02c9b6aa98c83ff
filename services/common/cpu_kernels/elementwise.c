/* Row-wise ops of a decoder layer, float32, for the CPU: RMSNorm and SiLU-and-multiply.
 *
 * PyTorch runs RMSNorm as seven ops and an MLP's act(gate) * up as two, each
 * paying dispatch and a pass over memory; at decode sizes (a few dozen rows)
 * the dispatch is most of their cost: the bench model's 25 norms took 5-6 ms
 * of a 130 ms step at 32 rows. Here each is one pass over its rows.
 *
 * RMSNorm computes what HF's modules do, in their order:
 * weight * (x * (1 / sqrt(mean(x * x) + eps))), the mean summed in eight lanes
 * (not bit for bit torch's reduction order: within a few ulps). SiLU is
 * x / (1 + exp(-x)) with exp from a degree-6 polynomial on eight lanes, as
 * PyTorch's vectorised CPU kernel computes it (within a few ulps of it).
 *
 * Small calls run on the calling thread (a parallel region costs more than
 * the work); from PARALLEL_MIN elements on, rows spread over the OpenMP
 * threads PyTorch uses.
 *
 * Layouts: rows of `dim` (or `n`) contiguous floats, each operand with its own
 * row stride in elements; outputs contiguous.
 */
#include <math.h>
#include <stdint.h>

#define PARALLEL_MIN 65536

typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef int32_t vi8 __attribute__((vector_size(32), aligned(4)));

int epd_elementwise_abi(void) { return 1; }

static void rms_norm_row(const float* x, const float* w, float* o, int64_t dim, float eps) {
    v8 s = {0};
    int64_t d = 0;
    for (; d + 8 <= dim; d += 8) {
        const v8 v = *(const v8*)(x + d);
        s += v * v;
    }
    float sum = 0.f;
    for (int i = 0; i < 8; ++i) sum += s[i];
    for (; d < dim; ++d) sum += x[d] * x[d];
    const float r = 1.f / sqrtf(sum / (float)dim + eps);
    for (d = 0; d < dim; ++d) o[d] = w[d] * (x[d] * r);
}

void epd_rms_norm_f32(const float* x, int64_t x_stride, const float* weight, float eps, float* out, int64_t rows,
                      int64_t dim, int num_threads) {
    #pragma omp parallel for num_threads(rows * dim >= PARALLEL_MIN ? num_threads : 1) schedule(static)
    for (int64_t r = 0; r < rows; ++r) rms_norm_row(x + r * x_stride, weight, out + r * dim, dim, eps);
}

/* exp on eight lanes: 2^k * p(f), k = round(x / ln 2), f = x - k ln 2 (ln 2 in two parts), p the
 * Cephes polynomial; inputs clamped to where a float's exp is finite and normal. NaN stays NaN. */
static inline v8 select8(vi8 mask, v8 a, v8 b) { return (v8)(((vi8)a & mask) | ((vi8)b & ~mask)); }

/* exp on eight lanes: 2^k * p(f), k = round(x / ln 2), f = x - k ln 2 (ln 2 in two parts), p the
 * Cephes polynomial; inputs clamped to where a float's exp is finite and normal. NaN stays NaN. */
static inline v8 exp8(v8 x) {
    const v8 max_x = (v8){0} + 88.3762626647949f, min_x = (v8){0} - 87.3365447504f;
    x = select8(x > max_x, max_x, x);
    x = select8(x < min_x, min_x, x);
    const v8 t = x * 1.44269504088896341f + 0.5f;
    vi8 k = __builtin_convertvector(t, vi8);
    k += (vi8)(__builtin_convertvector(k, v8) > t); /* truncation to floor: minus one where it rounded up */
    const v8 kf = __builtin_convertvector(k, v8);
    const v8 f = x - kf * 0.693359375f - kf * -2.12194440e-4f;
    const v8 z = f * f;
    v8 p = 1.9875691500e-4f * f + 1.3981999507e-3f;
    p = p * f + 8.3334519073e-3f;
    p = p * f + 4.1665795894e-2f;
    p = p * f + 1.6666665459e-1f;
    p = p * f + 5.0000001201e-1f;
    p = p * z + f + 1.f;
    return p * (v8)((k + 127) << 23);
}

void epd_silu_mul_f32(const float* gate, int64_t gate_stride, const float* up, int64_t up_stride, float* out,
                      int64_t rows, int64_t n, int num_threads) {
    #pragma omp parallel for num_threads(rows * n >= PARALLEL_MIN ? num_threads : 1) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const float* g = gate + r * gate_stride;
        const float* u = up + r * up_stride;
        float* o = out + r * n;
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) {
            const v8 gv = *(const v8*)(g + i);
            *(v8*)(o + i) = gv / (1.f + exp8(-gv)) * *(const v8*)(u + i);
        }
        for (; i < n; ++i) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
    }
}
