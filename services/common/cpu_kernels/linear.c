/* A linear layer, y = x W^T + b, float32, for the CPU, over a weight packed once.
 *
 * A decode step multiplies a few rows by every weight of the model: the
 * weights stream from memory once per step and each is used by only as many
 * rows as there are requests. General matmuls tune for the opposite (many
 * rows, the weight re-used from cache) and, at 1-48 rows, ran the bench LM's
 * shapes at half the memory bandwidth or less. Here the weight is packed
 * into panels of PANEL output columns, each panel K-major and contiguous
 * (packed[p][k][c] = W[p * PANEL + c][k], columns past N zero), so one pass
 * over a panel is one sequential read; a tile of up to TILE rows by PANEL
 * columns keeps its sums in registers while the panel streams by, and the
 * rows are walked in blocks of KB inputs so that the panel's block stays in
 * the first-level cache while every row tile uses it; the panel is prefetched
 * one block (16 KiB; 32 KiB with AVX-512) ahead of the inputs in use: against 4 KiB ahead, the
 * linears of a bench-LM decode step (out of cache) ran 4-12% faster at 8-48
 * rows and the same at 1 row and at prefill sizes. Each
 * output is summed in input order (k = 0 .. K-1), one fused multiply-add per
 * input.
 *
 * Panels are spread over OpenMP threads (the process's libgomp, the one
 * PyTorch loaded). GCC's vector extensions, not intrinsics: the build uses
 * -march=native, and the same source vectorises for AVX2, AVX-512 or NEON.
 */
#include <stdint.h>
#include <string.h>

/* One vector of the widest kind the build targets, and as many rows per register tile as its registers
 * hold: with AVX-512 (32 registers), 16 floats and 8 rows; else (AVX2, NEON: 16 registers) 8 floats and 6
 * rows. On a core with full-width AVX-512 units (AMD Zen 5), the linears of a 32-row decode step of the
 * bench LM took 33.5 ms with 8-float vectors and 6-row tiles, 20.9 with 16-float vectors, 19.5 with 8-row
 * tiles too (12 layers, out of cache, 2 threads; 512 rows: 285 and 271 ms). */
#if defined(__AVX512F__)
#define VEC 16
#define TILE 8  /* rows per register tile: 16 accumulators, 2 weight vectors, 1 broadcast */
#else
#define VEC 8
#define TILE 6  /* rows per register tile: 12 accumulators, 2 weight vectors, 1 broadcast */
#endif
#define PANEL (2 * VEC)  /* output columns per panel: two vectors */
#define KB (4096 / VEC)  /* inputs per cache block of a panel (16 KiB at 8 floats a vector, 32 KiB at 16) */
#define MAX_ROWS 256     /* rows per pass; more rows are done in passes (the sums of one pass live on the stack) */
#define AHEAD KB         /* inputs (one block of a panel) that are prefetched ahead of the ones in use */

typedef float vec __attribute__((vector_size(4 * VEC), aligned(4)));

int epd_linear_abi(void) { return 1; }
int epd_linear_panel(void) { return PANEL; }

/* Sums of ROWS rows x PANEL columns over inputs [k0, k1), carried in `sums` between blocks. */
#define DEFINE_TILE(ROWS)                                                                             \
    static void tile_##ROWS(const float* x, int64_t x_stride, const float* panel, int64_t k0,         \
                            int64_t k1, float* sums) {                                                \
        vec lo[ROWS], hi[ROWS];                                                                        \
        for (int r = 0; r < ROWS; ++r) {                                                              \
            lo[r] = *(const vec*)(sums + r * PANEL);                                                   \
            hi[r] = *(const vec*)(sums + r * PANEL + VEC);                                               \
        }                                                                                             \
        for (int64_t k = k0; k < k1; ++k) {                                                           \
            __builtin_prefetch(panel + (k + AHEAD) * PANEL);                                          \
            if (VEC > 8) __builtin_prefetch(panel + (k + AHEAD) * PANEL + VEC); /* a panel row: 2 lines */ \
            const vec w_lo = *(const vec*)(panel + k * PANEL);                                          \
            const vec w_hi = *(const vec*)(panel + k * PANEL + VEC);                                      \
            for (int r = 0; r < ROWS; ++r) {                                                          \
                const float xs = x[r * x_stride + k];                                                 \
                lo[r] += xs * w_lo;                                                                   \
                hi[r] += xs * w_hi;                                                                   \
            }                                                                                         \
        }                                                                                             \
        for (int r = 0; r < ROWS; ++r) {                                                              \
            *(vec*)(sums + r * PANEL) = lo[r];                                                         \
            *(vec*)(sums + r * PANEL + VEC) = hi[r];                                                     \
        }                                                                                             \
    }
DEFINE_TILE(1)
DEFINE_TILE(2)
DEFINE_TILE(3)
DEFINE_TILE(4)
DEFINE_TILE(5)
DEFINE_TILE(6)
#if TILE == 8
DEFINE_TILE(7)
DEFINE_TILE(8)
#endif

static void tile(int rows, const float* x, int64_t x_stride, const float* panel, int64_t k0, int64_t k1,
                 float* sums) {
    switch (rows) {
        case 1: tile_1(x, x_stride, panel, k0, k1, sums); break;
        case 2: tile_2(x, x_stride, panel, k0, k1, sums); break;
        case 3: tile_3(x, x_stride, panel, k0, k1, sums); break;
        case 4: tile_4(x, x_stride, panel, k0, k1, sums); break;
        case 5: tile_5(x, x_stride, panel, k0, k1, sums); break;
#if TILE == 8
        case 6: tile_6(x, x_stride, panel, k0, k1, sums); break;
        case 7: tile_7(x, x_stride, panel, k0, k1, sums); break;
        default: tile_8(x, x_stride, panel, k0, k1, sums); break;
#else
        default: tile_6(x, x_stride, panel, k0, k1, sums); break;
#endif
    }
}

/* One pass: up to MAX_ROWS rows of x [rows, k] (contiguous) into out [rows, n] (row stride n). */
static void linear_pass(const float* x, int64_t rows, int64_t k, const float* packed, int64_t n,
                        const float* bias, float* out, int num_threads) {
    const int64_t panels = (n + PANEL - 1) / PANEL;
    #pragma omp parallel num_threads(num_threads)
    {
        float sums[MAX_ROWS * PANEL];
        #pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; ++p) {
            const float* panel = packed + p * k * PANEL;
            const int64_t col0 = p * PANEL;
            const int cols = n - col0 < PANEL ? (int)(n - col0) : PANEL;
            memset(sums, 0, sizeof(float) * rows * PANEL);
            for (int64_t k0 = 0; k0 < k; k0 += KB) {
                const int64_t k1 = k0 + KB < k ? k0 + KB : k;
                for (int64_t r0 = 0; r0 < rows; r0 += TILE) {
                    const int tile_rows = rows - r0 < TILE ? (int)(rows - r0) : TILE;
                    tile(tile_rows, x + r0 * k, k, panel, k0, k1, sums + r0 * PANEL);
                }
            }
            for (int64_t r = 0; r < rows; ++r) {
                float* o = out + r * n + col0;
                const float* s = sums + r * PANEL;
                for (int c = 0; c < cols; ++c) o[c] = bias ? s[c] + bias[col0 + c] : s[c];
            }
        }
    }
}

/* x [m, k] contiguous; packed as above for n outputs; bias [n] or NULL; out [m, n] contiguous. */
void epd_linear_f32(const float* x, int64_t m, int64_t k, const float* packed, int64_t n, const float* bias,
                    float* out, int num_threads) {
    for (int64_t r = 0; r < m; r += MAX_ROWS) {
        const int64_t rows = m - r < MAX_ROWS ? m - r : MAX_ROWS;
        linear_pass(x + r * k, rows, k, packed, n, bias, out + r * n, num_threads);
    }
}
