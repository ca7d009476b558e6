/* GGUF blocks on the CPU (cpu_blocks.py builds and loads this file).

   A decode step on the CPU streams every weight once. Kept in its file's blocks, a weight
   is 4.5 to 8.5 bits, not float32's 32. Each block's weights are d * u + m (u its integer
   codes, d and m float16 widened), exactly the float32 values gguf's own dequantization
   gives; a product is summed as d * (u . x) + m * sum(x) in float32, which spares the
   widening of every weight (1.8 times the speed of d * u + m first, one CPU core). The vectors are GCC's vector extensions, so the compiler picks the instructions
   of the machine it builds on (-march=native); a byte goes to float through int32 because
   GCC scalarises the direct conversion.

   Block layouts (ggml's): Q4_0 {d; qs[16]}, Q4_1 {d; m; qs[16]}, Q5_0 {d; qh[4]; qs[16]},
   Q5_1 {d; m; qh[4]; qs[16]}, Q8_0 {d; qs[32] int8}. Element j < 16 of a block is the low
   nibble of qs[j], element j + 16 its high nibble; Q5's fifth bits are bit j of qh. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint8_t v16b __attribute__((vector_size(16)));

#define FLOATS(bytes) __builtin_convertvector(__builtin_convertvector((bytes), v16i), v16f)

/* Bytes ahead of the row being read that each thread asks the caches for: read from memory
   without it, the 121 matrices of the default model's step took 22 ms at one row on the
   2-core machine; 12-13 ms with 1 to 16 KB (2 KB best). */
#define PREFETCH 2048

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8 };   /* ggml's type ids */

static inline float half(const uint8_t *p) {
#ifdef __FLT16_MAX__
    _Float16 h;
    memcpy(&h, p, 2);
    return (float)h;
#else
    uint32_t h = (uint32_t)(p[0] | (p[1] << 8)), sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f,
             mant = h & 0x3ff, bits;
    float f;
    if (exp == 0) {
        f = (float)mant * (1.0f / 16777216.0f);
        return sign ? -f : f;
    }
    bits = sign | (exp == 0x1f ? 0x7f800000u | (mant << 13) : ((exp + 112) << 23) | (mant << 13));
    memcpy(&f, &bits, 4);
    return f;
#endif
}

static inline v16b bytes16(const uint8_t *p) {
    v16b v;
    memcpy(&v, p, 16);
    return v;
}

static inline v16f floats16(const float *p) {
    v16f v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Q5's fifth bits of elements first .. first + 15, as 0 or 16 */
static inline v16f fifth_bits(const uint8_t *qh, int first) {
    uint32_t bits;
    memcpy(&bits, qh, 4);
    const v16i at = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    v16i word = (v16i){0} + (int32_t)(bits >> first);
    return __builtin_convertvector(((word >> at) & 1) << 4, v16f);
}

/* One block as gguf's dequantization reads it, with every weight d * u + m for an
   unsigned code u: the codes of elements 0-15 in *lo and 16-31 in *hi, and the block's d
   and m (for the formats without an m, -8 d, -16 d or -128 d: Q4_0's weight d * (q - 8)
   is d * u + m exactly, each product and sum exact in float32). */
static inline void decode(int format, const uint8_t *b, v16f *lo, v16f *hi, float *d, float *m) {
    v16b q;
    *d = half(b);
    switch (format) {
    case Q4_0:
        q = bytes16(b + 2);
        *lo = FLOATS(q & 15), *hi = FLOATS(q >> 4), *m = -8.0f * *d;
        return;
    case Q4_1:
        q = bytes16(b + 4);
        *lo = FLOATS(q & 15), *hi = FLOATS(q >> 4), *m = half(b + 2);
        return;
    case Q5_0:
        q = bytes16(b + 6);
        *lo = FLOATS(q & 15) + fifth_bits(b + 2, 0), *hi = FLOATS(q >> 4) + fifth_bits(b + 2, 16);
        *m = -16.0f * *d;
        return;
    case Q5_1:
        q = bytes16(b + 8);
        *lo = FLOATS(q & 15) + fifth_bits(b + 4, 0), *hi = FLOATS(q >> 4) + fifth_bits(b + 4, 16);
        *m = half(b + 2);
        return;
    default:   /* Q8_0: the int8 q read as a byte u = q + 128 = byte ^ 0x80 */
        *lo = FLOATS(bytes16(b + 2) ^ 0x80), *hi = FLOATS(bytes16(b + 18) ^ 0x80), *m = -128.0f * *d;
    }
}

static int type_size(int format) {
    switch (format) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    }
    return 0;
}

static inline float total(v16f v) {
    float s = 0;
    for (int j = 0; j < 16; j++) s += v[j];
    return s;
}

/* out[r * n_out] for TILE rows of x from one weight row. A block's weights d * u + m
   give a row d * (u . x) + m * sum(x): each block's codes are widened once for all the
   rows, a row's products summed in 16 float32 lanes, and sums[r * blocks + b] holds
   row r's sum over block b. The same weights as gguf's, the sums in another order.
   FORMAT is a constant in every expansion, so decode's switch folds away. */
#define DOT_ROWS(FORMAT, TILE)                                                                   \
static void dot_##FORMAT##_##TILE(const float *x, const float *sums, int64_t k, const uint8_t *row, \
                                   float *out, int64_t n_out) {                                   \
    const int64_t blocks = k / 32;                                                                \
    v16f acc[TILE];                                                                               \
    float offsets[TILE];                                                                          \
    for (int r = 0; r < TILE; r++) acc[r] = (v16f){0}, offsets[r] = 0;                            \
    for (int64_t b = 0; b < blocks; b++) {                                                        \
        v16f lo, hi;                                                                              \
        float d, m;                                                                               \
        decode(FORMAT, row + b * type_size(FORMAT), &lo, &hi, &d, &m);                            \
        for (int r = 0; r < TILE; r++) {                                                          \
            const float *xr = x + r * k + b * 32;                                                 \
            acc[r] += (lo * floats16(xr) + hi * floats16(xr + 16)) * d;                           \
            offsets[r] += m * sums[r * blocks + b];                                               \
        }                                                                                         \
    }                                                                                             \
    for (int r = 0; r < TILE; r++) out[r * n_out] = total(acc[r]) + offsets[r];                  \
}

/* x [rows, k] times the weight [n, k] (rows of row_bytes) transposed, into out [rows, n]:
   the output features split over the threads, eight rows of x at a time (16 rows: 47 ms
   for the default model's matrices against 55 four at a time). (A prefetch past
   the matrix's end is harmless: prefetches never fault.) */
#define LINEAR(FORMAT)                                                                           \
DOT_ROWS(FORMAT, 1)                                                                               \
DOT_ROWS(FORMAT, 2)                                                                               \
DOT_ROWS(FORMAT, 4)                                                                               \
DOT_ROWS(FORMAT, 8)                                                                               \
static void linear_##FORMAT(const float *x, const float *sums, int64_t rows, int64_t k,          \
                            const uint8_t *w, int64_t n, int64_t row_bytes, float *out, int threads) { \
    const int64_t blocks = k / 32;                                                                \
    _Pragma("omp parallel for num_threads(threads) schedule(static)")                             \
    for (int64_t i = 0; i < n; i++) {                                                             \
        const uint8_t *row = w + i * row_bytes;                                                   \
        for (int64_t c = 0; c < row_bytes; c += 64) __builtin_prefetch(row + PREFETCH + c);       \
        int64_t r = 0;                                                                            \
        for (; r + 8 <= rows; r += 8)                                                             \
            dot_##FORMAT##_8(x + r * k, sums + r * blocks, k, row, out + r * n + i, n);           \
        for (; r + 4 <= rows; r += 4)                                                             \
            dot_##FORMAT##_4(x + r * k, sums + r * blocks, k, row, out + r * n + i, n);           \
        for (; r + 2 <= rows; r += 2)                                                             \
            dot_##FORMAT##_2(x + r * k, sums + r * blocks, k, row, out + r * n + i, n);           \
        for (; r < rows; r++)                                                                     \
            dot_##FORMAT##_1(x + r * k, sums + r * blocks, k, row, out + r * n + i, n);           \
    }                                                                                             \
}

LINEAR(Q4_0)
LINEAR(Q4_1)
LINEAR(Q5_0)
LINEAR(Q5_1)
LINEAR(Q8_0)

/* 0; -1 for a format this file does not decode, -2 if out of memory */
int tokenspeed_block_linear(int format, const float *x, int64_t rows, int64_t k, const uint8_t *w,
                            int64_t n, int64_t row_bytes, float *out, int threads) {
    if (!type_size(format)) return -1;
    float *sums = malloc(sizeof(float) * (size_t)(rows * (k / 32) + 1));
    if (!sums) return -2;
    for (int64_t i = 0; i < rows * (k / 32); i++) {
        float s = 0;
        for (int j = 0; j < 32; j++) s += x[i * 32 + j];
        sums[i] = s;
    }
    switch (format) {
    case Q4_0: linear_Q4_0(x, sums, rows, k, w, n, row_bytes, out, threads); break;
    case Q4_1: linear_Q4_1(x, sums, rows, k, w, n, row_bytes, out, threads); break;
    case Q5_0: linear_Q5_0(x, sums, rows, k, w, n, row_bytes, out, threads); break;
    case Q5_1: linear_Q5_1(x, sums, rows, k, w, n, row_bytes, out, threads); break;
    case Q8_0: linear_Q8_0(x, sums, rows, k, w, n, row_bytes, out, threads); break;
    }
    free(sums);
    return 0;
}

/* the weight [n, k] as float32 into out: for products of many rows (a prompt), which a
   BLAS computes faster from float32 than the loops above from blocks */
int tokenspeed_block_dequantize(int format, const uint8_t *w, int64_t n, int64_t k, int64_t row_bytes,
                                float *out, int threads) {
    const int size = type_size(format);
    if (!size) return -1;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        for (int64_t b = 0; b < k / 32; b++) {
            v16f lo, hi;
            float d, m;
            decode(format, w + i * row_bytes + b * size, &lo, &hi, &d, &m);
            lo = lo * d + m, hi = hi * d + m;   /* d * u exact: one rounding, gguf's */
            memcpy(out + i * k + b * 32, &lo, sizeof lo);
            memcpy(out + i * k + b * 32 + 16, &hi, sizeof hi);
        }
    }
    return 0;
}
